//! A peer that goes away while we write to it is an error, never a signal — also in a
//! process whose `SIGPIPE` keeps its default action (Rust programs ignore it before `main`;
//! a C program, a Python extension or a Rust binary built to die on broken pipes does not).
//! This test binary restores the default action first (`fabric::cli::die_on_broken_pipe`, as
//! the examples do), so a plain `write`/`writev` to the
//! closed socket would kill it (the harness then reports the signal), where a
//! `MSG_NOSIGNAL` send returns `EPIPE` and the connection's operations fail with
//! `PeerGone`.

use std::time::{Duration, Instant};

use fabric_core::backend::{self, Options};
use fabric_core::{Access, Completion, Status, Transport, TransportKind};

const DEADLINE: Duration = Duration::from_secs(60);

/// Streams 1 MiB sends at a tcp peer that is gone until the connection reports it; returns
/// the status the failed operations completed with.
fn stream_at_a_gone_peer(conn: &mut dyn Transport) -> Status {
    let tx = conn.register(1 << 20, Access::empty()).unwrap();
    let mut out: Vec<Completion> = (0..16).map(|_| Completion::default()).collect();
    let start = Instant::now();
    loop {
        assert!(
            start.elapsed() < DEADLINE,
            "the peer's departure was never noticed"
        );
        match conn.post_send(tx.slice(0, 1 << 20).unwrap(), 1) {
            Ok(()) => {}
            Err(e) if e.is_would_block() => {}
            Err(e) => {
                // Posts after the failure are refused; the failed ones were reported.
                assert!(
                    matches!(e.error, fabric_core::Error::Disconnected(_)),
                    "{:?}",
                    e.error
                );
            }
        }
        let n = conn
            .poll(&mut out)
            .expect("poll reports failures per operation");
        if let Some(c) = out[..n].iter().find(|c| c.status != Status::Success) {
            return c.status;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn tcp_sends_to_a_closed_peer_fail_without_sigpipe() {
    fabric::cli::die_on_broken_pipe();
    let opts = Options::default();
    let mut l = backend::listen(TransportKind::Tcp, &opts).expect("tcp listener");
    let mut c = backend::connect(l.address(), &opts).expect("connect");
    let (mut a, b) = backend::loopback(l.as_mut(), c.as_mut(), DEADLINE).expect("tcp pair");
    drop(b);
    assert_eq!(stream_at_a_gone_peer(a.as_mut()), Status::PeerGone);
}

/// The control sockets' writes (`sys::send`, as the cuda-ipc backend's control channel
/// uses it) on a Unix stream whose peer closed: `EPIPE`, and the process lives on.
#[test]
fn control_socket_sends_to_a_closed_peer_fail_without_sigpipe() {
    use std::os::fd::AsFd;
    fabric::cli::die_on_broken_pipe();
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    drop(theirs);
    let e = fabric_core::sys::send(ours.as_fd(), b"revoke").expect_err("peer closed");
    assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");
    // A live peer gets the bytes.
    let (a, mut b) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    assert_eq!(fabric_core::sys::send(a.as_fd(), b"ok").expect("send"), 2);
    let mut got = [0u8; 2];
    std::io::Read::read_exact(&mut b, &mut got).expect("read");
    assert_eq!(&got, b"ok");
}
