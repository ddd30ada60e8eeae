//! Root package of the workspace: it holds the `examples/` and the cross-crate `tests/`.
//! The libraries are `ibverbs-safe`, `nvlink-p2p` and `fabric-core`.
#![deny(unsafe_code)]

pub mod cli;
pub mod clock;

pub mod perf;
pub mod pingpong_wire;
pub mod rping_wire;
