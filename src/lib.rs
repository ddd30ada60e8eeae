//! Root package of the workspace: it holds the `examples/` and the cross-crate `tests/`.
//! The libraries are `ibverbs-safe`, `nvlink-p2p` and `fabric-core`.
#![forbid(unsafe_code)]

pub mod perf;
pub mod pingpong_wire;
pub mod rping_wire;
