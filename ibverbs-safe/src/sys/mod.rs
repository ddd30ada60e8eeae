//! Hand-written `#[repr(C)]` mirrors of the parts of `<infiniband/verbs.h>` this crate uses.
//!
//! Only what is needed is declared; structs that the library allocates and we only read are
//! declared as *prefixes* (their leading fields), which is sound because we only ever hold
//! pointers to them.
//!
//! **How they are proven.** The `fabric-ffi-check` crate (`ffi-check/`, dev-only, never a
//! dependency of a build) runs `bindgen` over the installed `verbs.h` and compares, for every
//! `#[repr(C)]` item in this file (read with `syn`, so nothing is listed by hand): size,
//! alignment, the offset, size and type of every field, every integer constant, the
//! op-table function signatures, and the enum values of [`enum_values`]. Conventions it reads:
//! * a field is matched by name, through anonymous unions/structs of the header; a doc line
//!   `` C field: `a.b` `` names a nested member, `` `first..=last` `` a run of fields, and
//!   `` `{x, y}` `` the anonymous member holding `x` and `y`; a field named `_...` is opaque
//!   storage (only its offset and size are compared);
//! * a mirror whose name the header lacks is matched through the field that holds it; a
//!   doc line `` C alias: `name` `` lets it stand for that header type in prototypes;
//! * a header field the mirror leaves out must be listed in [`OMITTED_FIELDS`], with why;
//! * a constant the header lacks needs a doc line `` C: `sizeof(struct x)` ``.
//!
//! The C program in `layout_tests` (compiled with the system `cc`) stays as a second,
//! independent witness that needs neither libclang nor bindgen: it samples the same mirrors
//! through `offsetof`/`sizeof` of the system C compiler (not clang's), and runs wherever only
//! `cc` and the headers exist; the bindgen check is the complete one (every field, type and
//! signature). Both search `FABRIC_VERBS_INCLUDE` first, to check another rdma-core.
#![allow(
    non_camel_case_types,
    dead_code,
    missing_docs,
    missing_debug_implementations
)]

use std::ffi::{c_char, c_int, c_uint, c_void};

// The unions are written for 64-bit pointers: `ibv_send_wr`'s `_bind_mw_tso` storage is
// `[u64; 6]` because the `bind_mw`/`tso` union holds pointers and is 48 bytes only on LP64,
// and `ibv_send_wr_wr` relies on `wr.ud.ah` being 8 bytes. The layouts are proven on LP64
// only; a 32-bit build would silently disagree with `verbs.h`.
#[cfg(not(target_pointer_width = "64"))]
compile_error!(
    "ibverbs-safe's verbs.h mirrors (src/sys/mod.rs) assume 64-bit pointers; \
     this target is not supported"
);

/// `union ibv_gid` (16 raw bytes, 8-byte aligned because of the `global` view).
#[repr(C, align(8))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ibv_gid_entry {
    pub gid: ibv_gid,
    pub gid_index: u32,
    pub port_num: u32,
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct _compat_ibv_port_attr`: the prefix of `struct ibv_port_attr` that the versioned
/// `ibv_query_port@IBVERBS_1.1` we call writes (it copies 48 bytes, through `flags`: seen in
/// the machine code of rdma-core 44 and 56.1, and fixed by that symbol's ABI). Newer fields (`port_cap_flags2`, `active_speed_ex`) are only
/// filled by the header's inline `ibv_query_port` through `query_port_ex`, so they are left
/// out (see [`OMITTED_FIELDS`]); the mirror is the same whichever header is installed.
///
/// C alias: `_compat_ibv_port_attr`
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ibv_port_attr {
    pub state: c_int,
    pub max_mtu: c_int,
    pub active_mtu: c_int,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
}

/// `struct ibv_sge`: one scatter/gather element.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ibv_sge {
    /// Start address (virtual address inside a registered region).
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the region that holds `[addr, addr + length)`.
    pub lkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ibv_send_wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ibv_send_wr_atomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ibv_send_wr_ud {
    pub ah: *mut ibv_ah,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// The `wr` union of `struct ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_wr {
    pub rdma: ibv_send_wr_rdma,
    pub atomic: ibv_send_wr_atomic,
    pub ud: ibv_send_wr_ud,
}

/// `struct ibv_send_wr`. The trailing `qp_type` (XRC) and `bind_mw`/`tso` unions are
/// declared as opaque, zero-initialised storage: this crate never uses them.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_uint,
    pub send_flags: c_uint,
    /// `imm_data` (network byte order) / `invalidate_rkey`.
    pub imm_data: u32,
    pub wr: ibv_send_wr_wr,
    /// `qp_type.xrc.remote_srqn`.
    ///
    /// C field: `qp_type.xrc.remote_srqn`
    pub qp_type_xrc_remote_srqn: u32,
    /// The `bind_mw` / `tso` union (48 bytes, 8-aligned).
    ///
    /// C field: `{bind_mw, tso}`
    pub _bind_mw_tso: [u64; 6],
}

/// `struct ibv_recv_wr`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

/// `struct ibv_wc`: one work completion.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_uint,
    pub opcode: c_uint,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// `imm_data` (network byte order) / `invalidated_rkey`.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: c_uint,
    pub sq_sig_all: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ibv_qp_attr {
    pub qp_state: c_uint,
    pub cur_qp_state: c_uint,
    pub path_mtu: c_uint,
    pub path_mig_state: c_uint,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ibv_srq_attr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ibv_srq_init_attr {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
}

/// Opaque `struct ibv_device`.
#[repr(C)]
pub struct ibv_device {
    _private: [u8; 0],
}

/// Opaque `struct ibv_ah`.
#[repr(C)]
pub struct ibv_ah {
    _private: [u8; 0],
}

pub type PostSendFn = unsafe extern "C" fn(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int;
pub type PostRecvFn = unsafe extern "C" fn(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int;
pub type PostSrqRecvFn = unsafe extern "C" fn(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int;
pub type PollCqFn = unsafe extern "C" fn(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int;
pub type ReqNotifyCqFn = unsafe extern "C" fn(cq: *mut ibv_cq, solicited_only: c_int) -> c_int;
type AnyFn = Option<unsafe extern "C" fn()>;

/// `struct ibv_context_ops`: the provider's data-path op table inside every context.
#[repr(C)]
pub struct ibv_context_ops {
    /// C field: `_compat_query_device..=_compat_create_cq`
    pub _compat_0_10: [AnyFn; 11],
    pub poll_cq: Option<PollCqFn>,
    pub req_notify_cq: Option<ReqNotifyCqFn>,
    /// C field: `_compat_cq_event..=_compat_destroy_srq`
    pub _compat_13_19: [AnyFn; 7],
    pub post_srq_recv: Option<PostSrqRecvFn>,
    /// C field: `_compat_create_qp..=_compat_destroy_qp`
    pub _compat_21_24: [AnyFn; 4],
    pub post_send: Option<PostSendFn>,
    pub post_recv: Option<PostRecvFn>,
    /// C field: `_compat_create_ah..=_compat_async_event`
    pub _compat_27_31: [AnyFn; 5],
}

/// Prefix of `struct ibv_context` (allocated by the library; only read through pointers).
#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
}

/// `struct ibv_pd`.
#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// Prefix of `struct ibv_cq`.
#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
}

/// Prefix of `struct ibv_qp`.
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_uint,
    pub qp_type: c_uint,
}

/// Prefix of `struct ibv_srq`.
#[repr(C)]
pub struct ibv_srq {
    pub context: *mut ibv_context,
    pub srq_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub handle: u32,
}

// enum ibv_wr_opcode
pub const IBV_WR_RDMA_WRITE: c_uint = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_uint = 1;
pub const IBV_WR_SEND: c_uint = 2;
pub const IBV_WR_SEND_WITH_IMM: c_uint = 3;
pub const IBV_WR_RDMA_READ: c_uint = 4;
pub const IBV_WR_ATOMIC_CMP_AND_SWP: c_uint = 5;
pub const IBV_WR_ATOMIC_FETCH_AND_ADD: c_uint = 6;

// enum ibv_send_flags
pub const IBV_SEND_FENCE: c_uint = 1;
pub const IBV_SEND_SIGNALED: c_uint = 2;
pub const IBV_SEND_SOLICITED: c_uint = 4;
pub const IBV_SEND_INLINE: c_uint = 8;

// enum ibv_wc_opcode
pub const IBV_WC_SEND: c_uint = 0;
pub const IBV_WC_RDMA_WRITE: c_uint = 1;
pub const IBV_WC_RDMA_READ: c_uint = 2;
pub const IBV_WC_COMP_SWAP: c_uint = 3;
pub const IBV_WC_FETCH_ADD: c_uint = 4;
pub const IBV_WC_RECV: c_uint = 128;
pub const IBV_WC_RECV_RDMA_WITH_IMM: c_uint = 129;

// enum ibv_wc_flags
pub const IBV_WC_GRH: c_uint = 1;
pub const IBV_WC_WITH_IMM: c_uint = 2;

// enum ibv_access_flags
pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 2;
pub const IBV_ACCESS_REMOTE_READ: c_int = 4;
pub const IBV_ACCESS_REMOTE_ATOMIC: c_int = 8;
pub const IBV_ACCESS_RELAXED_ORDERING: c_int = 1 << 20;

// enum ibv_qp_state
pub const IBV_QPS_RESET: c_uint = 0;
pub const IBV_QPS_INIT: c_uint = 1;
pub const IBV_QPS_RTR: c_uint = 2;
pub const IBV_QPS_RTS: c_uint = 3;
pub const IBV_QPS_ERR: c_uint = 6;

// enum ibv_qp_type
pub const IBV_QPT_RC: c_uint = 2;
pub const IBV_QPT_UC: c_uint = 3;
pub const IBV_QPT_UD: c_uint = 4;

// enum ibv_qp_attr_mask
pub const IBV_QP_STATE: c_int = 1 << 0;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_QKEY: c_int = 1 << 6;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;

// enum ibv_port_state
pub const IBV_PORT_ACTIVE: c_int = 4;
// IBV_LINK_LAYER_*
pub const IBV_LINK_LAYER_INFINIBAND: u8 = 1;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;

/// Size of the Global Routing Header that UD receives get in front of the payload.
///
/// C: `sizeof(struct ibv_grh)`
pub const GRH_LEN: usize = 40;

/// A field of a mirrored `verbs.h` struct that the mirror deliberately leaves out.
#[derive(Clone, Copy, Debug)]
pub struct OmittedField {
    /// The C struct (`ibv_cq`), or the mirror's name for a nested one.
    pub c_type: &'static str,
    /// The header's field name.
    pub field: &'static str,
    /// Added by a newer rdma-core than some we support: the installed header may lack it.
    pub newer: bool,
    /// Why the mirror does without it.
    pub reason: &'static str,
}

const LIBRARY_TAIL: &str = "library-private tail of an object the library allocates; we only \
     hold pointers to it and never read past the mirrored prefix";

/// Every header field our mirrors leave out, with the reason: the one list the bindgen
/// check (`ffi-check/`) accepts omissions from. A header field that is neither mirrored nor
/// listed here fails the check, as does an entry the header does not have (unless `newer`).
pub const OMITTED_FIELDS: &[OmittedField] = &[
    OmittedField {
        c_type: "rdma_cm_id",
        field: "route",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "rdma_cm_id",
        field: "ps",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "rdma_cm_id",
        field: "port_num",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "rdma_cm_id",
        field: "event",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "rdma_cm_id",
        field: "send_cq_channel",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "rdma_cm_id",
        field: "send_cq",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "rdma_cm_id",
        field: "recv_cq_channel",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "rdma_cm_id",
        field: "recv_cq",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "rdma_cm_id",
        field: "srq",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "rdma_cm_id",
        field: "pd",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "rdma_cm_id",
        field: "qp_type",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "ibv_gid",
        field: "global",
        newer: false,
        reason: "the same 16 bytes as `raw`, viewed as two big-endian u64; `align(8)` keeps its \
                 alignment",
    },
    OmittedField {
        c_type: "ibv_port_attr",
        field: "port_cap_flags2",
        newer: false,
        reason: "not in `_compat_ibv_port_attr`: ibv_query_port@IBVERBS_1.1 never writes it",
    },
    OmittedField {
        c_type: "ibv_port_attr",
        field: "active_speed_ex",
        newer: true,
        reason: "appended by rdma-core releases newer than Debian 12's 44 (56.1 has it); not \
                 in `_compat_ibv_port_attr`, all that ibv_query_port@IBVERBS_1.1 writes",
    },
    OmittedField {
        c_type: "ibv_context",
        field: "mutex",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "ibv_context",
        field: "abi_compat",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "ibv_cq",
        field: "mutex",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "ibv_cq",
        field: "cond",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "ibv_cq",
        field: "comp_events_completed",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "ibv_cq",
        field: "async_events_completed",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "ibv_qp",
        field: "mutex",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "ibv_qp",
        field: "cond",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "ibv_qp",
        field: "events_completed",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "ibv_srq",
        field: "mutex",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "ibv_srq",
        field: "cond",
        newer: false,
        reason: LIBRARY_TAIL,
    },
    OmittedField {
        c_type: "ibv_srq",
        field: "events_completed",
        newer: false,
        reason: LIBRARY_TAIL,
    },
];

/// `verbs.h` enum values the crate keeps in its public Rust enums instead of constants here
/// (`(C enumerator, our value)`), for the bindgen check.
pub fn enum_values() -> Vec<(&'static str, i128)> {
    use crate::gid::GidType;
    use crate::port::Mtu;
    let mut v: Vec<(&'static str, i128)> = vec![
        ("IBV_GID_TYPE_IB", GidType::Ib as i128),
        ("IBV_GID_TYPE_ROCE_V1", GidType::RoceV1 as i128),
        ("IBV_GID_TYPE_ROCE_V2", GidType::RoceV2 as i128),
        ("IBV_MTU_256", Mtu::Mtu256 as i128),
        ("IBV_MTU_512", Mtu::Mtu512 as i128),
        ("IBV_MTU_1024", Mtu::Mtu1024 as i128),
        ("IBV_MTU_2048", Mtu::Mtu2048 as i128),
        ("IBV_MTU_4096", Mtu::Mtu4096 as i128),
    ];
    for (i, name) in crate::error::WC_STATUS_C_NAMES.iter().enumerate() {
        v.push((name, i as i128));
    }
    v
}

pub mod cm;
#[cfg(test)]
mod layout_tests;
