//! Hand-written `#[repr(C)]` mirrors of the parts of `<rdma/rdma_cma.h>` (librdmacm) that
//! the `cm` module uses.
//!
//! `rdma_cm_id`, `rdma_cm_event` and `rdma_event_channel` are allocated by librdmacm and only
//! read through pointers here, so they are declared as *prefixes* (their leading fields).
//! `rdma_conn_param` is allocated by us and passed in, so it is declared whole.
use super::{ibv_context, ibv_qp};
use std::ffi::{c_int, c_void};

/// `struct rdma_event_channel` (whole: one `int fd`).
#[repr(C)]
#[derive(Debug)]
pub struct rdma_event_channel {
    pub fd: c_int,
}

/// Prefix of `struct rdma_cm_id`: `verbs`, `channel`, `context`, `qp` (the `route`, `ps`,
/// `port_num`, ... that follow are not read; they are listed in `sys::OMITTED_FIELDS`).
#[repr(C)]
#[derive(Debug)]
pub struct rdma_cm_id {
    pub verbs: *mut ibv_context,
    pub channel: *mut rdma_event_channel,
    pub context: *mut c_void,
    pub qp: *mut ibv_qp,
}

/// `struct rdma_conn_param` (whole).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct rdma_conn_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: u8,
    pub qp_num: u32,
}

/// `struct rdma_cm_event` (whole: librdmacm allocates it, we read `param.conn` only).
#[repr(C)]
#[derive(Debug)]
pub struct rdma_cm_event {
    pub id: *mut rdma_cm_id,
    pub listen_id: *mut rdma_cm_id,
    pub event: u32,
    pub status: c_int,
    pub param: rdma_cm_event_param,
}

/// The `param` union of `struct rdma_cm_event`: `conn` for connected (port space TCP) ids,
/// which are the only ones this crate creates; `ud` for UD ids, never read.
#[repr(C)]
#[derive(Clone, Copy)]
pub union rdma_cm_event_param {
    pub conn: rdma_conn_param,
    /// `struct rdma_ud_param` (56 bytes on LP64), never read.
    ///
    /// C field: `ud`
    pub _ud: [u64; 7],
}

impl std::fmt::Debug for rdma_cm_event_param {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("rdma_cm_event_param { .. }")
    }
}

/// `enum rdma_port_space`: reliable-connected, TCP-like port space.
pub const RDMA_PS_TCP: u32 = 0x0106;

// `enum rdma_cm_event_type`
pub const RDMA_CM_EVENT_ADDR_RESOLVED: u32 = 0;
pub const RDMA_CM_EVENT_ADDR_ERROR: u32 = 1;
pub const RDMA_CM_EVENT_ROUTE_RESOLVED: u32 = 2;
pub const RDMA_CM_EVENT_ROUTE_ERROR: u32 = 3;
pub const RDMA_CM_EVENT_CONNECT_REQUEST: u32 = 4;
pub const RDMA_CM_EVENT_CONNECT_RESPONSE: u32 = 5;
pub const RDMA_CM_EVENT_CONNECT_ERROR: u32 = 6;
pub const RDMA_CM_EVENT_UNREACHABLE: u32 = 7;
pub const RDMA_CM_EVENT_REJECTED: u32 = 8;
pub const RDMA_CM_EVENT_ESTABLISHED: u32 = 9;
pub const RDMA_CM_EVENT_DISCONNECTED: u32 = 10;
pub const RDMA_CM_EVENT_DEVICE_REMOVAL: u32 = 11;
pub const RDMA_CM_EVENT_MULTICAST_JOIN: u32 = 12;
pub const RDMA_CM_EVENT_MULTICAST_ERROR: u32 = 13;
pub const RDMA_CM_EVENT_ADDR_CHANGE: u32 = 14;
pub const RDMA_CM_EVENT_TIMEWAIT_EXIT: u32 = 15;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    // x86_64/aarch64 LP64 layout of rdma_cma.h, by hand, for machines without the header;
    // `ffi-check/` proves every field against the installed header with bindgen.
    #[test]
    fn conn_param_and_event_prefix_match_the_header_layout() {
        assert_eq!(size_of::<rdma_conn_param>(), 24);
        assert_eq!(offset_of!(rdma_conn_param, private_data_len), 8);
        assert_eq!(offset_of!(rdma_conn_param, srq), 14);
        assert_eq!(offset_of!(rdma_conn_param, qp_num), 16);
        assert_eq!(offset_of!(rdma_cm_event, event), 16);
        assert_eq!(offset_of!(rdma_cm_event, status), 20);
        assert_eq!(offset_of!(rdma_cm_event, param), 24);
        assert_eq!(size_of::<rdma_cm_event_param>(), 56);
        assert_eq!(size_of::<rdma_cm_event>(), 80);
        assert_eq!(offset_of!(rdma_cm_id, qp), 24);
    }
}
