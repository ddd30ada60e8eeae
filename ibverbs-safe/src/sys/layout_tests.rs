//! Checks every declared `#[repr(C)]` layout and constant against `<infiniband/verbs.h>`
//! by compiling a small C program with the system `cc` and comparing its `sizeof`/`offsetof`
//! output with Rust's `size_of`/`offset_of!`.
use super::*;
use std::mem::{align_of, offset_of, size_of};
use std::process::Command;

const HEADER: &str = "/usr/include/infiniband/verbs.h";

macro_rules! checks {
    ($($c:expr => $r:expr),* $(,)?) => { vec![$(($c.to_string(), ($r) as u64)),*] };
}

fn expectations() -> Vec<(String, u64)> {
    let mut v = checks![
        "sizeof(union ibv_gid)" => size_of::<ibv_gid>(),
        "_Alignof(union ibv_gid)" => align_of::<ibv_gid>(),
        "sizeof(struct ibv_gid_entry)" => size_of::<ibv_gid_entry>(),
        "offsetof(struct ibv_gid_entry, gid_index)" => offset_of!(ibv_gid_entry, gid_index),
        "offsetof(struct ibv_gid_entry, port_num)" => offset_of!(ibv_gid_entry, port_num),
        "offsetof(struct ibv_gid_entry, gid_type)" => offset_of!(ibv_gid_entry, gid_type),
        "offsetof(struct ibv_gid_entry, ndev_ifindex)" => offset_of!(ibv_gid_entry, ndev_ifindex),
        "sizeof(struct ibv_sge)" => size_of::<ibv_sge>(),
        "offsetof(struct ibv_sge, length)" => offset_of!(ibv_sge, length),
        "offsetof(struct ibv_sge, lkey)" => offset_of!(ibv_sge, lkey),
        "sizeof(struct ibv_send_wr)" => size_of::<ibv_send_wr>(),
        "_Alignof(struct ibv_send_wr)" => align_of::<ibv_send_wr>(),
        "offsetof(struct ibv_send_wr, next)" => offset_of!(ibv_send_wr, next),
        "offsetof(struct ibv_send_wr, sg_list)" => offset_of!(ibv_send_wr, sg_list),
        "offsetof(struct ibv_send_wr, num_sge)" => offset_of!(ibv_send_wr, num_sge),
        "offsetof(struct ibv_send_wr, opcode)" => offset_of!(ibv_send_wr, opcode),
        "offsetof(struct ibv_send_wr, send_flags)" => offset_of!(ibv_send_wr, send_flags),
        "offsetof(struct ibv_send_wr, imm_data)" => offset_of!(ibv_send_wr, imm_data),
        "offsetof(struct ibv_send_wr, invalidate_rkey)" => offset_of!(ibv_send_wr, imm_data),
        "offsetof(struct ibv_send_wr, wr)" => offset_of!(ibv_send_wr, wr),
        "sizeof(((struct ibv_send_wr*)0)->wr)" => size_of::<ibv_send_wr_wr>(),
        "offsetof(struct ibv_send_wr, wr.rdma.remote_addr)" => offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_rdma, remote_addr),
        "offsetof(struct ibv_send_wr, wr.rdma.rkey)" => offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_rdma, rkey),
        "offsetof(struct ibv_send_wr, wr.atomic.remote_addr)" => offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_atomic, remote_addr),
        "offsetof(struct ibv_send_wr, wr.atomic.compare_add)" => offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_atomic, compare_add),
        "offsetof(struct ibv_send_wr, wr.atomic.swap)" => offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_atomic, swap),
        "offsetof(struct ibv_send_wr, wr.atomic.rkey)" => offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_atomic, rkey),
        "offsetof(struct ibv_send_wr, wr.ud.ah)" => offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_ud, ah),
        "offsetof(struct ibv_send_wr, wr.ud.remote_qpn)" => offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_ud, remote_qpn),
        "offsetof(struct ibv_send_wr, wr.ud.remote_qkey)" => offset_of!(ibv_send_wr, wr) + offset_of!(ibv_send_wr_ud, remote_qkey),
        "offsetof(struct ibv_send_wr, qp_type.xrc.remote_srqn)" => offset_of!(ibv_send_wr, qp_type_xrc_remote_srqn),
        "offsetof(struct ibv_send_wr, bind_mw)" => offset_of!(ibv_send_wr, _bind_mw_tso),
        "sizeof(((struct ibv_send_wr*)0)->bind_mw)" => size_of::<[u64; 6]>(),
        "sizeof(struct ibv_recv_wr)" => size_of::<ibv_recv_wr>(),
        "offsetof(struct ibv_recv_wr, next)" => offset_of!(ibv_recv_wr, next),
        "offsetof(struct ibv_recv_wr, sg_list)" => offset_of!(ibv_recv_wr, sg_list),
        "offsetof(struct ibv_recv_wr, num_sge)" => offset_of!(ibv_recv_wr, num_sge),
        "sizeof(struct ibv_wc)" => size_of::<ibv_wc>(),
        "offsetof(struct ibv_wc, status)" => offset_of!(ibv_wc, status),
        "offsetof(struct ibv_wc, opcode)" => offset_of!(ibv_wc, opcode),
        "offsetof(struct ibv_wc, vendor_err)" => offset_of!(ibv_wc, vendor_err),
        "offsetof(struct ibv_wc, byte_len)" => offset_of!(ibv_wc, byte_len),
        "offsetof(struct ibv_wc, imm_data)" => offset_of!(ibv_wc, imm_data),
        "offsetof(struct ibv_wc, qp_num)" => offset_of!(ibv_wc, qp_num),
        "offsetof(struct ibv_wc, src_qp)" => offset_of!(ibv_wc, src_qp),
        "offsetof(struct ibv_wc, wc_flags)" => offset_of!(ibv_wc, wc_flags),
        "offsetof(struct ibv_wc, pkey_index)" => offset_of!(ibv_wc, pkey_index),
        "offsetof(struct ibv_wc, slid)" => offset_of!(ibv_wc, slid),
        "offsetof(struct ibv_wc, sl)" => offset_of!(ibv_wc, sl),
        "offsetof(struct ibv_wc, dlid_path_bits)" => offset_of!(ibv_wc, dlid_path_bits),
        "sizeof(struct ibv_qp_cap)" => size_of::<ibv_qp_cap>(),
        "offsetof(struct ibv_qp_cap, max_recv_wr)" => offset_of!(ibv_qp_cap, max_recv_wr),
        "offsetof(struct ibv_qp_cap, max_send_sge)" => offset_of!(ibv_qp_cap, max_send_sge),
        "offsetof(struct ibv_qp_cap, max_recv_sge)" => offset_of!(ibv_qp_cap, max_recv_sge),
        "offsetof(struct ibv_qp_cap, max_inline_data)" => offset_of!(ibv_qp_cap, max_inline_data),
        "sizeof(struct ibv_qp_init_attr)" => size_of::<ibv_qp_init_attr>(),
        "offsetof(struct ibv_qp_init_attr, send_cq)" => offset_of!(ibv_qp_init_attr, send_cq),
        "offsetof(struct ibv_qp_init_attr, recv_cq)" => offset_of!(ibv_qp_init_attr, recv_cq),
        "offsetof(struct ibv_qp_init_attr, srq)" => offset_of!(ibv_qp_init_attr, srq),
        "offsetof(struct ibv_qp_init_attr, cap)" => offset_of!(ibv_qp_init_attr, cap),
        "offsetof(struct ibv_qp_init_attr, qp_type)" => offset_of!(ibv_qp_init_attr, qp_type),
        "offsetof(struct ibv_qp_init_attr, sq_sig_all)" => offset_of!(ibv_qp_init_attr, sq_sig_all),
        "sizeof(struct ibv_global_route)" => size_of::<ibv_global_route>(),
        "offsetof(struct ibv_global_route, flow_label)" => offset_of!(ibv_global_route, flow_label),
        "offsetof(struct ibv_global_route, sgid_index)" => offset_of!(ibv_global_route, sgid_index),
        "offsetof(struct ibv_global_route, hop_limit)" => offset_of!(ibv_global_route, hop_limit),
        "offsetof(struct ibv_global_route, traffic_class)" => offset_of!(ibv_global_route, traffic_class),
        "sizeof(struct ibv_ah_attr)" => size_of::<ibv_ah_attr>(),
        "offsetof(struct ibv_ah_attr, dlid)" => offset_of!(ibv_ah_attr, dlid),
        "offsetof(struct ibv_ah_attr, sl)" => offset_of!(ibv_ah_attr, sl),
        "offsetof(struct ibv_ah_attr, src_path_bits)" => offset_of!(ibv_ah_attr, src_path_bits),
        "offsetof(struct ibv_ah_attr, static_rate)" => offset_of!(ibv_ah_attr, static_rate),
        "offsetof(struct ibv_ah_attr, is_global)" => offset_of!(ibv_ah_attr, is_global),
        "offsetof(struct ibv_ah_attr, port_num)" => offset_of!(ibv_ah_attr, port_num),
        "sizeof(struct ibv_qp_attr)" => size_of::<ibv_qp_attr>(),
        "offsetof(struct ibv_qp_attr, cur_qp_state)" => offset_of!(ibv_qp_attr, cur_qp_state),
        "offsetof(struct ibv_qp_attr, path_mtu)" => offset_of!(ibv_qp_attr, path_mtu),
        "offsetof(struct ibv_qp_attr, path_mig_state)" => offset_of!(ibv_qp_attr, path_mig_state),
        "offsetof(struct ibv_qp_attr, qkey)" => offset_of!(ibv_qp_attr, qkey),
        "offsetof(struct ibv_qp_attr, rq_psn)" => offset_of!(ibv_qp_attr, rq_psn),
        "offsetof(struct ibv_qp_attr, sq_psn)" => offset_of!(ibv_qp_attr, sq_psn),
        "offsetof(struct ibv_qp_attr, dest_qp_num)" => offset_of!(ibv_qp_attr, dest_qp_num),
        "offsetof(struct ibv_qp_attr, qp_access_flags)" => offset_of!(ibv_qp_attr, qp_access_flags),
        "offsetof(struct ibv_qp_attr, cap)" => offset_of!(ibv_qp_attr, cap),
        "offsetof(struct ibv_qp_attr, ah_attr)" => offset_of!(ibv_qp_attr, ah_attr),
        "offsetof(struct ibv_qp_attr, alt_ah_attr)" => offset_of!(ibv_qp_attr, alt_ah_attr),
        "offsetof(struct ibv_qp_attr, pkey_index)" => offset_of!(ibv_qp_attr, pkey_index),
        "offsetof(struct ibv_qp_attr, alt_pkey_index)" => offset_of!(ibv_qp_attr, alt_pkey_index),
        "offsetof(struct ibv_qp_attr, en_sqd_async_notify)" => offset_of!(ibv_qp_attr, en_sqd_async_notify),
        "offsetof(struct ibv_qp_attr, sq_draining)" => offset_of!(ibv_qp_attr, sq_draining),
        "offsetof(struct ibv_qp_attr, max_rd_atomic)" => offset_of!(ibv_qp_attr, max_rd_atomic),
        "offsetof(struct ibv_qp_attr, max_dest_rd_atomic)" => offset_of!(ibv_qp_attr, max_dest_rd_atomic),
        "offsetof(struct ibv_qp_attr, min_rnr_timer)" => offset_of!(ibv_qp_attr, min_rnr_timer),
        "offsetof(struct ibv_qp_attr, port_num)" => offset_of!(ibv_qp_attr, port_num),
        "offsetof(struct ibv_qp_attr, timeout)" => offset_of!(ibv_qp_attr, timeout),
        "offsetof(struct ibv_qp_attr, retry_cnt)" => offset_of!(ibv_qp_attr, retry_cnt),
        "offsetof(struct ibv_qp_attr, rnr_retry)" => offset_of!(ibv_qp_attr, rnr_retry),
        "offsetof(struct ibv_qp_attr, alt_port_num)" => offset_of!(ibv_qp_attr, alt_port_num),
        "offsetof(struct ibv_qp_attr, alt_timeout)" => offset_of!(ibv_qp_attr, alt_timeout),
        "offsetof(struct ibv_qp_attr, rate_limit)" => offset_of!(ibv_qp_attr, rate_limit),
        "sizeof(struct ibv_srq_attr)" => size_of::<ibv_srq_attr>(),
        "offsetof(struct ibv_srq_attr, max_sge)" => offset_of!(ibv_srq_attr, max_sge),
        "offsetof(struct ibv_srq_attr, srq_limit)" => offset_of!(ibv_srq_attr, srq_limit),
        "sizeof(struct ibv_srq_init_attr)" => size_of::<ibv_srq_init_attr>(),
        "offsetof(struct ibv_srq_init_attr, attr)" => offset_of!(ibv_srq_init_attr, attr),
        "sizeof(struct ibv_device_attr)" => size_of::<ibv_device_attr>(),
        "offsetof(struct ibv_device_attr, node_guid)" => offset_of!(ibv_device_attr, node_guid),
        "offsetof(struct ibv_device_attr, max_mr_size)" => offset_of!(ibv_device_attr, max_mr_size),
        "offsetof(struct ibv_device_attr, vendor_id)" => offset_of!(ibv_device_attr, vendor_id),
        "offsetof(struct ibv_device_attr, max_qp)" => offset_of!(ibv_device_attr, max_qp),
        "offsetof(struct ibv_device_attr, max_qp_wr)" => offset_of!(ibv_device_attr, max_qp_wr),
        "offsetof(struct ibv_device_attr, max_sge)" => offset_of!(ibv_device_attr, max_sge),
        "offsetof(struct ibv_device_attr, max_cqe)" => offset_of!(ibv_device_attr, max_cqe),
        "offsetof(struct ibv_device_attr, max_mr)" => offset_of!(ibv_device_attr, max_mr),
        "offsetof(struct ibv_device_attr, max_qp_rd_atom)" => offset_of!(ibv_device_attr, max_qp_rd_atom),
        "offsetof(struct ibv_device_attr, max_qp_init_rd_atom)" => offset_of!(ibv_device_attr, max_qp_init_rd_atom),
        "offsetof(struct ibv_device_attr, atomic_cap)" => offset_of!(ibv_device_attr, atomic_cap),
        "offsetof(struct ibv_device_attr, max_srq_wr)" => offset_of!(ibv_device_attr, max_srq_wr),
        "offsetof(struct ibv_device_attr, max_srq_sge)" => offset_of!(ibv_device_attr, max_srq_sge),
        "offsetof(struct ibv_device_attr, max_pkeys)" => offset_of!(ibv_device_attr, max_pkeys),
        "offsetof(struct ibv_device_attr, local_ca_ack_delay)" => offset_of!(ibv_device_attr, local_ca_ack_delay),
        "offsetof(struct ibv_device_attr, phys_port_cnt)" => offset_of!(ibv_device_attr, phys_port_cnt),
        // The mirror is `_compat_ibv_port_attr` (what ibv_query_port@IBVERBS_1.1 writes): it
        // ends where `port_cap_flags2` starts, on old and new headers alike.
        "offsetof(struct ibv_port_attr, port_cap_flags2)" => size_of::<ibv_port_attr>(),
        "offsetof(struct ibv_port_attr, max_mtu)" => offset_of!(ibv_port_attr, max_mtu),
        "offsetof(struct ibv_port_attr, active_mtu)" => offset_of!(ibv_port_attr, active_mtu),
        "offsetof(struct ibv_port_attr, gid_tbl_len)" => offset_of!(ibv_port_attr, gid_tbl_len),
        "offsetof(struct ibv_port_attr, port_cap_flags)" => offset_of!(ibv_port_attr, port_cap_flags),
        "offsetof(struct ibv_port_attr, max_msg_sz)" => offset_of!(ibv_port_attr, max_msg_sz),
        "offsetof(struct ibv_port_attr, pkey_tbl_len)" => offset_of!(ibv_port_attr, pkey_tbl_len),
        "offsetof(struct ibv_port_attr, lid)" => offset_of!(ibv_port_attr, lid),
        "offsetof(struct ibv_port_attr, sm_lid)" => offset_of!(ibv_port_attr, sm_lid),
        "offsetof(struct ibv_port_attr, lmc)" => offset_of!(ibv_port_attr, lmc),
        "offsetof(struct ibv_port_attr, active_width)" => offset_of!(ibv_port_attr, active_width),
        "offsetof(struct ibv_port_attr, active_speed)" => offset_of!(ibv_port_attr, active_speed),
        "offsetof(struct ibv_port_attr, phys_state)" => offset_of!(ibv_port_attr, phys_state),
        "offsetof(struct ibv_port_attr, link_layer)" => offset_of!(ibv_port_attr, link_layer),
        "offsetof(struct ibv_port_attr, flags)" => offset_of!(ibv_port_attr, flags),
        "sizeof(struct ibv_context_ops)" => size_of::<ibv_context_ops>(),
        "offsetof(struct ibv_context_ops, poll_cq)" => offset_of!(ibv_context_ops, poll_cq),
        "offsetof(struct ibv_context_ops, req_notify_cq)" => offset_of!(ibv_context_ops, req_notify_cq),
        "offsetof(struct ibv_context_ops, post_srq_recv)" => offset_of!(ibv_context_ops, post_srq_recv),
        "offsetof(struct ibv_context_ops, post_send)" => offset_of!(ibv_context_ops, post_send),
        "offsetof(struct ibv_context_ops, post_recv)" => offset_of!(ibv_context_ops, post_recv),
        "offsetof(struct ibv_context, ops)" => offset_of!(ibv_context, ops),
        "offsetof(struct ibv_context, cmd_fd)" => offset_of!(ibv_context, cmd_fd),
        "offsetof(struct ibv_context, async_fd)" => offset_of!(ibv_context, async_fd),
        "offsetof(struct ibv_context, num_comp_vectors)" => offset_of!(ibv_context, num_comp_vectors),
        "sizeof(struct ibv_pd)" => size_of::<ibv_pd>(),
        "offsetof(struct ibv_pd, handle)" => offset_of!(ibv_pd, handle),
        "sizeof(struct ibv_mr)" => size_of::<ibv_mr>(),
        "offsetof(struct ibv_mr, pd)" => offset_of!(ibv_mr, pd),
        "offsetof(struct ibv_mr, addr)" => offset_of!(ibv_mr, addr),
        "offsetof(struct ibv_mr, length)" => offset_of!(ibv_mr, length),
        "offsetof(struct ibv_mr, handle)" => offset_of!(ibv_mr, handle),
        "offsetof(struct ibv_mr, lkey)" => offset_of!(ibv_mr, lkey),
        "offsetof(struct ibv_mr, rkey)" => offset_of!(ibv_mr, rkey),
        "sizeof(struct ibv_comp_channel)" => size_of::<ibv_comp_channel>(),
        "offsetof(struct ibv_comp_channel, fd)" => offset_of!(ibv_comp_channel, fd),
        "offsetof(struct ibv_comp_channel, refcnt)" => offset_of!(ibv_comp_channel, refcnt),
        "offsetof(struct ibv_cq, channel)" => offset_of!(ibv_cq, channel),
        "offsetof(struct ibv_cq, cq_context)" => offset_of!(ibv_cq, cq_context),
        "offsetof(struct ibv_cq, handle)" => offset_of!(ibv_cq, handle),
        "offsetof(struct ibv_cq, cqe)" => offset_of!(ibv_cq, cqe),
        "offsetof(struct ibv_qp, qp_context)" => offset_of!(ibv_qp, qp_context),
        "offsetof(struct ibv_qp, pd)" => offset_of!(ibv_qp, pd),
        "offsetof(struct ibv_qp, send_cq)" => offset_of!(ibv_qp, send_cq),
        "offsetof(struct ibv_qp, recv_cq)" => offset_of!(ibv_qp, recv_cq),
        "offsetof(struct ibv_qp, srq)" => offset_of!(ibv_qp, srq),
        "offsetof(struct ibv_qp, handle)" => offset_of!(ibv_qp, handle),
        "offsetof(struct ibv_qp, qp_num)" => offset_of!(ibv_qp, qp_num),
        "offsetof(struct ibv_qp, state)" => offset_of!(ibv_qp, state),
        "offsetof(struct ibv_qp, qp_type)" => offset_of!(ibv_qp, qp_type),
        "offsetof(struct ibv_srq, srq_context)" => offset_of!(ibv_srq, srq_context),
        "offsetof(struct ibv_srq, pd)" => offset_of!(ibv_srq, pd),
        "offsetof(struct ibv_srq, handle)" => offset_of!(ibv_srq, handle),
    ];
    // Constants (enums and flags).
    v.extend(checks![
        "IBV_WR_RDMA_WRITE" => IBV_WR_RDMA_WRITE,
        "IBV_WR_RDMA_WRITE_WITH_IMM" => IBV_WR_RDMA_WRITE_WITH_IMM,
        "IBV_WR_SEND" => IBV_WR_SEND,
        "IBV_WR_SEND_WITH_IMM" => IBV_WR_SEND_WITH_IMM,
        "IBV_WR_RDMA_READ" => IBV_WR_RDMA_READ,
        "IBV_WR_ATOMIC_CMP_AND_SWP" => IBV_WR_ATOMIC_CMP_AND_SWP,
        "IBV_WR_ATOMIC_FETCH_AND_ADD" => IBV_WR_ATOMIC_FETCH_AND_ADD,
        "IBV_SEND_FENCE" => IBV_SEND_FENCE,
        "IBV_SEND_SIGNALED" => IBV_SEND_SIGNALED,
        "IBV_SEND_SOLICITED" => IBV_SEND_SOLICITED,
        "IBV_SEND_INLINE" => IBV_SEND_INLINE,
        "IBV_WC_SEND" => IBV_WC_SEND,
        "IBV_WC_RDMA_WRITE" => IBV_WC_RDMA_WRITE,
        "IBV_WC_RDMA_READ" => IBV_WC_RDMA_READ,
        "IBV_WC_COMP_SWAP" => IBV_WC_COMP_SWAP,
        "IBV_WC_FETCH_ADD" => IBV_WC_FETCH_ADD,
        "IBV_WC_RECV" => IBV_WC_RECV,
        "IBV_WC_RECV_RDMA_WITH_IMM" => IBV_WC_RECV_RDMA_WITH_IMM,
        "IBV_WC_GRH" => IBV_WC_GRH,
        "IBV_WC_WITH_IMM" => IBV_WC_WITH_IMM,
        "IBV_ACCESS_LOCAL_WRITE" => IBV_ACCESS_LOCAL_WRITE,
        "IBV_ACCESS_REMOTE_WRITE" => IBV_ACCESS_REMOTE_WRITE,
        "IBV_ACCESS_REMOTE_READ" => IBV_ACCESS_REMOTE_READ,
        "IBV_ACCESS_REMOTE_ATOMIC" => IBV_ACCESS_REMOTE_ATOMIC,
        "IBV_ACCESS_RELAXED_ORDERING" => IBV_ACCESS_RELAXED_ORDERING,
        "IBV_QPS_RESET" => IBV_QPS_RESET,
        "IBV_QPS_INIT" => IBV_QPS_INIT,
        "IBV_QPS_RTR" => IBV_QPS_RTR,
        "IBV_QPS_RTS" => IBV_QPS_RTS,
        "IBV_QPS_ERR" => IBV_QPS_ERR,
        "IBV_QPT_RC" => IBV_QPT_RC,
        "IBV_QPT_UC" => IBV_QPT_UC,
        "IBV_QPT_UD" => IBV_QPT_UD,
        "IBV_QP_STATE" => IBV_QP_STATE,
        "IBV_QP_ACCESS_FLAGS" => IBV_QP_ACCESS_FLAGS,
        "IBV_QP_PKEY_INDEX" => IBV_QP_PKEY_INDEX,
        "IBV_QP_PORT" => IBV_QP_PORT,
        "IBV_QP_QKEY" => IBV_QP_QKEY,
        "IBV_QP_AV" => IBV_QP_AV,
        "IBV_QP_PATH_MTU" => IBV_QP_PATH_MTU,
        "IBV_QP_TIMEOUT" => IBV_QP_TIMEOUT,
        "IBV_QP_RETRY_CNT" => IBV_QP_RETRY_CNT,
        "IBV_QP_RNR_RETRY" => IBV_QP_RNR_RETRY,
        "IBV_QP_RQ_PSN" => IBV_QP_RQ_PSN,
        "IBV_QP_MAX_QP_RD_ATOMIC" => IBV_QP_MAX_QP_RD_ATOMIC,
        "IBV_QP_MIN_RNR_TIMER" => IBV_QP_MIN_RNR_TIMER,
        "IBV_QP_SQ_PSN" => IBV_QP_SQ_PSN,
        "IBV_QP_MAX_DEST_RD_ATOMIC" => IBV_QP_MAX_DEST_RD_ATOMIC,
        "IBV_QP_DEST_QPN" => IBV_QP_DEST_QPN,
        "IBV_PORT_ACTIVE" => IBV_PORT_ACTIVE,
        "IBV_LINK_LAYER_INFINIBAND" => IBV_LINK_LAYER_INFINIBAND,
        "IBV_LINK_LAYER_ETHERNET" => IBV_LINK_LAYER_ETHERNET,
        "IBV_GID_TYPE_IB" => crate::gid::GidType::Ib as u32,
        "IBV_GID_TYPE_ROCE_V1" => crate::gid::GidType::RoceV1 as u32,
        "IBV_GID_TYPE_ROCE_V2" => crate::gid::GidType::RoceV2 as u32,
        "IBV_MTU_256" => crate::port::Mtu::Mtu256 as u32,
        "IBV_MTU_4096" => crate::port::Mtu::Mtu4096 as u32,
    ]);
    for (i, name) in crate::error::WC_STATUS_C_NAMES.iter().enumerate() {
        v.push((name.to_string(), i as u64));
    }
    v
}

#[test]
fn repr_c_layouts_match_verbs_h() {
    // FABRIC_VERBS_INCLUDE (`:`-separated) is searched first, as by the bindgen check in
    // `ffi-check/`: point it at a newer rdma-core's `include` directory to check against it.
    let include: Vec<std::path::PathBuf> = std::env::var_os("FABRIC_VERBS_INCLUDE")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    let found = include
        .iter()
        .map(|d| d.join("infiniband/verbs.h"))
        .chain([std::path::PathBuf::from(HEADER)])
        .find(|p| p.exists());
    let Some(header) = found else {
        skip!(
            "verbs-headers",
            "libibverbs-dev headers not installed ({HEADER} missing)"
        );
        return;
    };
    let exp = expectations();
    let dir = std::env::temp_dir().join(format!("ibverbs-safe-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut src = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\nint main(void){\n",
    );
    for (c, _) in &exp {
        src.push_str(&format!(
            "printf(\"%llu\\n\", (unsigned long long)({c}));\n"
        ));
    }
    src.push_str("return 0;}\n");
    let c_path = dir.join("layout.c");
    let exe = dir.join("layout");
    std::fs::write(&c_path, src).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let mut cmd = Command::new(&cc);
    for d in &include {
        cmd.arg("-I").arg(d);
    }
    let out = match cmd.arg(&c_path).arg("-o").arg(&exe).output() {
        Ok(o) => o,
        Err(e) => {
            skip!("verbs-headers", "no C compiler ({cc}: {e})");
            return;
        }
    };
    assert!(
        out.status.success(),
        "compiling the layout probe failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    assert!(run.status.success());
    let text = String::from_utf8(run.stdout).unwrap();
    let got: Vec<u64> = text.lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(got.len(), exp.len());
    let mut bad = Vec::new();
    for ((c, r), g) in exp.iter().zip(&got) {
        if r != g {
            bad.push(format!("{c}: C says {g}, Rust says {r}"));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert!(bad.is_empty(), "layout mismatches:\n{}", bad.join("\n"));
    println!(
        "checked {} layouts/constants against {}",
        exp.len(),
        header.display()
    );
}
