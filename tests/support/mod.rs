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

/// A TCP port on `ip` for a server a test starts by name (`bootstrap::pair`, a launcher's
/// `FABRIC_BOOTSTRAP`): one below the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`), found free by binding it once. A port taken with
/// `bind(":0")` and released comes from the range every other `bind(":0")` and outgoing
/// connection of the tests running beside it draw from, so one of them can take it before the
/// server binds it (seen: the server failing with "Address already in use" and its client
/// reset by another test's listener). Below that range only an explicit choice lands, and
/// within this process the choices never repeat (one shared counter from a random start).
#[allow(dead_code)] // each test crate compiles this module; not all of them start servers
pub fn free_port(ip: &str) -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const LOWEST: u32 = 10_000;
    let top = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    if top <= LOWEST + 100 {
        // An unusual range leaves no room below it: fall back to the kernel's choice.
        return std::net::TcpListener::bind((ip, 0))
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
    }
    let span = top - LOWEST;
    let start = {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        (nanos ^ std::process::id().wrapping_mul(2_654_435_761)) % span
    };
    let _ = NEXT.compare_exchange(0, start + 1, Ordering::Relaxed, Ordering::Relaxed);
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (LOWEST + n % span) as u16;
        if std::net::TcpListener::bind((ip, port)).is_ok() {
            return port;
        }
    }
    panic!("no free port on {ip} between {LOWEST} and {top}");
}
