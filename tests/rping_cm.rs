//! rdma_cm in the Soft-RoCE guest: its error paths (a port nobody listens on, a peer that
//! disconnects mid-run, an address with no RDMA device) and bad peers against the `rping`
//! example (malformed `rdma_info`: wrong size, a buffer that does not fit, an out-of-range
//! address or a wrong rkey) — each must end with a clear error within a bound, never a
//! panic, a hang or a touched byte. The well-formed peers are `ci/softroce/rping-interop.sh`'s
//! job (rdma-core's rping against ours both ways, and ours against ours).
//!
//! Needs an RDMA device with an IPv4 address on its netdev (`SOFTROCE_CM_ADDR`, default
//! 10.77.0.1: veth0 = rxe0 in the guest); elsewhere it prints `skipped: ...` (a failure when
//! `FABRIC_REQUIRE` lists `rdma`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use fabric::rping_wire::{RdmaInfo, INFO_LEN};
use ibverbs_safe::cm::{CmError, CmId, ConnParam, Connection, Listener};
use ibverbs_safe::{
    Completion, CompletionQueue, Context, Error, MemoryRegion, ProtectionDomain, QueuePair, Rc,
    RemoteAccess,
};

const T: Duration = Duration::from_secs(20);
static PORT: AtomicU16 = AtomicU16::new(7500);

fn port() -> u16 {
    PORT.fetch_add(1, Ordering::Relaxed) + (std::process::id() % 100) as u16 * 10
}

mod support;

/// A skip for lack of an RDMA device with rdma_cm (`rdma`): a failure where FABRIC_REQUIRE
/// names it (the Soft-RoCE guest).
fn skip(test: &str, why: &str) {
    support::skip("rdma", format_args!("{test}: {why}"));
}

/// The rdma_cm address to use, or why there is none.
fn cm_addr(test: &str) -> Option<std::net::IpAddr> {
    let ip: std::net::IpAddr = std::env::var("SOFTROCE_CM_ADDR")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or([10, 77, 0, 1].into());
    let mut id = match CmId::new() {
        Ok(id) => id,
        Err(e) => {
            skip(test, &format!("rdma_cm unavailable ({e})"));
            return None;
        }
    };
    match id.resolve(SocketAddr::new(ip, 1), Duration::from_secs(5)) {
        Ok(()) => Some(ip),
        Err(e) => {
            skip(
                test,
                &format!(
                    "no RDMA device with an address for rdma_cm ({e}); runs in the Soft-RoCE guest"
                ),
            );
            None
        }
    }
}

/// A raw peer speaking rping's protocol by hand.
struct RawPeer {
    conn: Connection,
    qp: QueuePair<Rc>,
    cq: CompletionQueue,
    _rx: MemoryRegion,
    tx: MemoryRegion,
    pd: ProtectionDomain,
    _ctx: Context,
}

impl RawPeer {
    /// Connects to a server at `addr`, retrying while it is not listening yet.
    fn connect(addr: SocketAddr) -> RawPeer {
        let end = Instant::now() + T;
        loop {
            let mut id = CmId::new().unwrap();
            id.resolve(addr, Duration::from_secs(5)).unwrap();
            let ctx = id.open_context().unwrap();
            let pd = ctx.alloc_pd().unwrap();
            let cq = ctx.create_cq(16).unwrap();
            let mut p = id.queue_pair(&pd, &cq, &cq).unwrap().build_rc().unwrap();
            let mut rx = pd.alloc_region(64).unwrap();
            p.post_recv(rx.slice(..).unwrap(), 1).unwrap();
            match id.connect(p, &ConnParam::default(), T) {
                Ok((conn, qp)) => {
                    let tx = pd.alloc_region(64).unwrap();
                    return RawPeer {
                        conn,
                        qp,
                        cq,
                        _rx: rx,
                        tx,
                        pd,
                        _ctx: ctx,
                    };
                }
                Err(Error::Cm(CmError::Rejected { .. })) if Instant::now() < end => {
                    std::thread::sleep(Duration::from_millis(300))
                }
                Err(e) => panic!("connect to {addr}: {e}"),
            }
        }
    }

    fn send(&mut self, bytes: &[u8]) {
        self.tx.write_from(0, bytes).unwrap();
        self.qp
            .send(self.tx.slice(..bytes.len()).unwrap(), 2)
            .unwrap();
        let mut wc = Completion::buffer(1);
        self.cq.poll_exact(&mut wc, 1, T).unwrap();
        wc[0].result().unwrap();
    }
}

fn example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("rping")
}

fn spawn(args: &[&str]) -> Child {
    Command::new(example())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the rping example (cargo build --examples)")
}

/// Waits (bounded) for the example to exit: (status, stdout, stderr).
fn finish(mut c: Child, bound: Duration) -> (i32, String, String) {
    let end = Instant::now() + bound;
    loop {
        if let Some(st) = c.try_wait().unwrap() {
            let out = c.wait_with_output().unwrap();
            return (
                st.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            );
        }
        if Instant::now() > end {
            let _ = c.kill();
            panic!("rping did not exit within {bound:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn connect_to_a_port_nobody_listens_on_is_rejected_within_a_bound() {
    let Some(ip) = cm_addr("connect_to_a_port_nobody_listens_on") else {
        return;
    };
    let mut id = CmId::new().unwrap();
    id.resolve(SocketAddr::new(ip, port()), Duration::from_secs(5))
        .unwrap();
    let ctx = id.open_context().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(4).unwrap();
    let qp = id.queue_pair(&pd, &cq, &cq).unwrap().build_rc().unwrap();
    let t0 = Instant::now();
    let e = id.connect(qp, &ConnParam::default(), T).unwrap_err();
    let took = t0.elapsed();
    assert!(
        matches!(
            e,
            Error::Cm(CmError::Rejected { reason: 8, .. } | CmError::Unreachable(_))
        ),
        "{e}"
    );
    assert!(took < T, "took {took:?}");
    println!("no listener: {e} after {took:?}");
}

#[test]
fn resolving_an_address_without_an_rdma_device_is_a_typed_error() {
    if cm_addr("resolving_an_address_without_an_rdma_device").is_none() {
        return;
    }
    let mut id = CmId::new().unwrap();
    let t0 = Instant::now();
    let e = id
        .resolve("127.0.0.1:7174".parse().unwrap(), Duration::from_secs(5))
        .unwrap_err();
    assert!(
        matches!(e, Error::Cm(CmError::NoDeviceForAddress { .. })),
        "{e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("ip addr add") && msg.contains("127.0.0.1"),
        "{msg}"
    );
    assert!(t0.elapsed() < Duration::from_secs(12));
    // connecting an id whose route never resolved is refused before anything is sent
    // (with rxe on lo the address step binds the id to that device; without, it has none)
    if let Ok(ctx) = id.open_context() {
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4).unwrap();
        let qp = id.queue_pair(&pd, &cq, &cq).unwrap().build_rc().unwrap();
        assert!(id.connect(qp, &ConnParam::default(), T).is_err());
    }
}

#[test]
fn private_data_reject_and_peer_disconnect_mid_run() {
    let Some(ip) = cm_addr("private_data_reject_and_peer_disconnect") else {
        return;
    };
    let addr = SocketAddr::new(ip, port());
    let mut l = Listener::bind(addr, 4).unwrap();
    let server = std::thread::spawn(move || {
        // first request: rejected with private data
        let r = l.get_request(T).unwrap();
        assert_eq!(&r.private_data()[..5], b"first");
        r.reject(b"go away").unwrap();
        // second: accepted with private data; then the peer disconnects
        let r = l.get_request(T).unwrap();
        assert_eq!(&r.private_data()[..6], b"second");
        let ctx = r.open_context().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(4).unwrap();
        let qp = r.queue_pair(&pd, &cq, &cq).unwrap().build_rc().unwrap();
        let p = ConnParam {
            private_data: b"welcome".to_vec(),
            ..Default::default()
        };
        let (mut conn, _qp) = r.accept(qp, &p, T).unwrap();
        let t0 = Instant::now();
        conn.wait_disconnected(T).unwrap();
        assert!(conn.check().is_err());
        t0.elapsed()
    });
    let attempt = |data: &[u8]| {
        let end = Instant::now() + T;
        loop {
            let mut id = CmId::new().unwrap();
            id.resolve(addr, Duration::from_secs(5)).unwrap();
            let ctx = id.open_context().unwrap();
            let pd = ctx.alloc_pd().unwrap();
            let cq = ctx.create_cq(4).unwrap();
            let qp = id.queue_pair(&pd, &cq, &cq).unwrap().build_rc().unwrap();
            let p = ConnParam {
                private_data: data.to_vec(),
                ..Default::default()
            };
            match id.connect(qp, &p, T) {
                // reason 8: the listener thread is not listening yet
                Err(Error::Cm(CmError::Rejected { reason: 8, .. })) if Instant::now() < end => {
                    std::thread::sleep(Duration::from_millis(200))
                }
                r => return r.map(|(c, q)| (c, q, ctx, pd, cq)),
            }
        }
    };
    match attempt(b"first") {
        Err(Error::Cm(CmError::Rejected { private_data, .. })) => {
            assert_eq!(&private_data[..7], b"go away")
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("the first connect was accepted"),
    }
    let (mut conn, _qp, _ctx, _pd, _cq) = attempt(b"second").unwrap();
    assert_eq!(&conn.private_data()[..7], b"welcome");
    conn.disconnect().unwrap();
    let took = server.join().unwrap();
    println!("disconnect seen by the server after {took:?}");
}

#[test]
fn rping_server_sees_a_client_disconnect_mid_run_and_exits_cleanly() {
    let Some(ip) = cm_addr("rping_server_client_disconnect") else {
        return;
    };
    let p = port();
    let srv = spawn(&["-s", "-v", "-a", &ip.to_string(), "-p", &p.to_string()]);
    let mut peer = RawPeer::connect(SocketAddr::new(ip, p));
    // one advertisement of a real buffer, then vanish before the server answers
    let mut src = peer
        .pd
        .register_remote(vec![b'x'; 64], RemoteAccess::READ)
        .unwrap();
    let _ = src.slice(..).unwrap();
    let r = src.remote();
    peer.send(
        &RdmaInfo {
            addr: r.addr,
            rkey: r.rkey,
            size: 64,
        }
        .encode(),
    );
    std::thread::sleep(Duration::from_millis(500));
    peer.conn.disconnect().unwrap();
    drop(peer);
    let (code, _out, err) = finish(srv, T);
    assert!(
        err.contains("server DISCONNECT EVENT"),
        "status {code}: {err}"
    );
    assert_eq!(code, 0, "{err}");
}

/// Our rping server against a client that sends `msg` as its first advertisement: it must
/// exit 255 with `want` on stderr, and the client's memory stays as it was.
fn bad_client(test: &str, make: impl FnOnce(&RdmaInfo) -> Vec<u8>, want: &str) {
    let Some(ip) = cm_addr(test) else { return };
    let p = port();
    let srv = spawn(&["-s", "-a", &ip.to_string(), "-p", &p.to_string()]);
    let mut peer = RawPeer::connect(SocketAddr::new(ip, p));
    // a canary the server may read but must never change
    let canary = peer
        .pd
        .register_remote(vec![0x5a; 64], RemoteAccess::READ | RemoteAccess::WRITE)
        .unwrap();
    let r = canary.remote();
    let good = RdmaInfo {
        addr: r.addr,
        rkey: r.rkey,
        size: 64,
    };
    peer.send(&make(&good));
    let (code, out, err) = finish(srv, T);
    assert_eq!(code, 255, "{test}: stdout {out} stderr {err}");
    assert!(err.contains(want), "{test}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let mut now = [0u8; 64];
    canary.read_into(0, &mut now).unwrap();
    assert_eq!(now, [0x5a; 64], "{test}: the peer's memory changed");
    println!("{test}: {}", err.trim());
}

#[test]
fn rping_server_refuses_a_short_rdma_info() {
    bad_client(
        "short rdma_info",
        |_| vec![1; 8],
        "Received bogus data, size 8",
    );
}

#[test]
fn rping_server_refuses_a_long_rdma_info() {
    bad_client(
        "long rdma_info",
        |_| vec![1; INFO_LEN + 4],
        "Received bogus data, size 20",
    );
}

#[test]
fn rping_server_refuses_a_buffer_larger_than_its_own() {
    bad_client(
        "oversized buffer",
        |g| {
            RdmaInfo {
                size: 1 << 20,
                ..*g
            }
            .encode()
            .to_vec()
        },
        "more than our 64-byte buffer",
    );
}

#[test]
fn rping_server_reports_an_out_of_range_address() {
    bad_client(
        "out-of-range address",
        |g| {
            RdmaInfo {
                addr: g.addr + (1 << 30),
                ..*g
            }
            .encode()
            .to_vec()
        },
        "IBV_WC_REM_ACCESS_ERR",
    );
}

#[test]
fn rping_server_reports_a_wrong_rkey() {
    bad_client(
        "wrong rkey",
        |g| {
            RdmaInfo {
                rkey: g.rkey ^ 0x00ff_ff00,
                ..*g
            }
            .encode()
            .to_vec()
        },
        "IBV_WC_REM_ACCESS_ERR",
    );
}

#[test]
fn rping_client_refuses_a_malformed_answer() {
    let Some(ip) = cm_addr("rping_client_malformed_answer") else {
        return;
    };
    let addr = SocketAddr::new(ip, port());
    let mut l = Listener::bind(addr, 2).unwrap();
    let cli = spawn(&[
        "-c",
        "-a",
        &ip.to_string(),
        "-p",
        &addr.port().to_string(),
        "-C",
        "1",
    ]);
    let r = l.get_request(T).unwrap();
    let ctx = r.open_context().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(8).unwrap();
    let mut qp = r.queue_pair(&pd, &cq, &cq).unwrap().build_rc().unwrap();
    let mut rx = pd.alloc_region(64).unwrap();
    qp.post_recv(rx.slice(..).unwrap(), 1).unwrap();
    let (_conn, mut qp) = r.accept(qp, &ConnParam::default(), T).unwrap();
    let mut wc = Completion::buffer(1);
    cq.poll_exact(&mut wc, 1, T).unwrap();
    wc[0].result().unwrap();
    assert_eq!(wc[0].byte_len() as usize, INFO_LEN);
    drop(wc[0].take_bufs());
    // answer with 4 bytes instead of 16
    let mut tx = pd.alloc_region(4).unwrap();
    qp.send(tx.slice(..).unwrap(), 2).unwrap();
    let (code, _out, err) = finish(cli, T);
    assert_eq!(code, 255, "{err}");
    assert!(err.contains("Received bogus data, size 4"), "{err}");
    cq.poll_exact(&mut wc, 1, T).unwrap();
}
