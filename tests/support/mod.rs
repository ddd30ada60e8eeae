//! What every test of the root package prints when it cannot run, and the one switch that
//! turns that into a failure: `FABRIC_REQUIRE`, a comma-separated list of capabilities this
//! machine must have (the Soft-RoCE guest sets `rdma,vgem,verbs-headers,…`, `.ci/run` sets
//! what its host test stage must have). The same policy lives in `ibverbs-safe`'s test
//! helpers (`tests/common`, the `skip!` macro) and in `fabric-core/tests`: one copy per crate,
//! since each crate is usable alone.
//!
//! Capability names: `rdma` (an RDMA device with an active port), `verbs-headers`
//! (infiniband/verbs.h and a C compiler), `libclang`, `vgem` (a DMA-BUF exporter),
//! `libibverbs` (the library itself), `librdmacm` (the rdma_cm library), `examples` (the
//! example binaries built next to the test binaries), `cc` (a C compiler for stand-in
//! drivers), `gpu` (a CUDA driver and GPU; `NVLINK_P2P_REQUIRE_GPU=1` requires it too),
//! `no-gpu` (a machine without one), `non-loopback-ipv4` (an IPv4 address other than
//! 127.0.0.0/8, to cross two addresses), `fd-limit` (a hard open-file limit high enough for
//! 1,000 sockets), `somaxconn` (a kernel listen backlog of at least 1,000).

/// Says why a test did not run — `skipped: <why> [lacks <capability>] [<test>]`, past
/// libtest's output capture so that `cargo test` shows it — or, where `FABRIC_REQUIRE` names
/// the capability, fails the test with the same reason.
pub fn skip(capability: &str, why: std::fmt::Arguments<'_>) {
    let test = std::thread::current().name().unwrap_or("?").to_owned();
    let required = std::env::var("FABRIC_REQUIRE").unwrap_or_default();
    if required.split(',').any(|c| c.trim() == capability) {
        panic!(
            "this machine must have `{capability}` (FABRIC_REQUIRE={required}), but {why} [{test}]"
        );
    }
    let _ = std::io::Write::write_fmt(
        &mut std::io::stdout(),
        format_args!("skipped: {why} [lacks {capability}] [{test}]\n"),
    );
}
