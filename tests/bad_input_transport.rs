//! Bad peers against the transport listeners (the connection setup after the bootstrap):
//! the `tcp` listener gets an HTTP request, a truncated hello, a silent client and, once a
//! raw peer has passed the hello, a frame with a 4 GiB length prefix; the `shm` listener
//! gets a Unix-socket peer that speaks garbage, one that hangs up mid-handshake and a silent
//! one. Each bad peer is dropped (or its connection fails with a typed error completion),
//! and the listener still serves the next well-formed peer. (The bootstrap listener's bad
//! peers, wrong secret included, are in `tests/fabric_bootstrap.rs`.)

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::{Duration, Instant};

use fabric_core::backend::{self, Listener, Options};
use fabric_core::{Access, Completion, OpKind, Status, Transport, TransportKind};

fn opts() -> Options {
    Options {
        handshake_timeout: Duration::from_secs(2),
        ..Options::default()
    }
}

/// Drives `l.accept()` (and the good connector) until the good peer is connected; the
/// bad peers must neither block nor break the listener meanwhile.
fn serve_good_peer(
    l: &mut dyn Listener,
    opts: &Options,
) -> (Box<dyn Transport>, Box<dyn Transport>) {
    let mut c = backend::connect(l.address(), opts).expect("connect");
    let (mut a, mut b) = (None, None);
    let end = Instant::now() + Duration::from_secs(20);
    while a.is_none() || b.is_none() {
        assert!(Instant::now() < end, "the well-formed peer was not served");
        if a.is_none() {
            a = l.accept().expect("the listener itself must not fail");
        }
        if b.is_none() {
            b = c.poll_connect().expect("the good connector must not fail");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    (a.unwrap(), b.unwrap())
}

fn wait_one(t: &mut dyn Transport) -> Completion {
    let mut out: Vec<Completion> = (0..1).map(|_| Completion::default()).collect();
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        if t.poll(&mut out).expect("poll") == 1 {
            return std::mem::take(&mut out[0]);
        }
        assert!(Instant::now() < end, "no completion within 20 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A message goes through the connection the listener finally served.
fn works(a: &mut dyn Transport, b: &mut dyn Transport) {
    let rx = a.register(64, Access::empty()).unwrap();
    let tx = b.register(64, Access::empty()).unwrap();
    tx.write_at(0, b"well-formed peer").unwrap();
    a.post_recv(rx.slice(0, 64).unwrap(), 1)
        .map_err(|e| e.error)
        .unwrap();
    b.post_send(tx.slice(0, 16).unwrap(), 2)
        .map_err(|e| e.error)
        .unwrap();
    let (mut got_recv, mut got_send) = (None, None);
    let end = Instant::now() + Duration::from_secs(20);
    let mut out: Vec<Completion> = (0..2).map(|_| Completion::default()).collect();
    while got_recv.is_none() || got_send.is_none() {
        assert!(Instant::now() < end, "message never arrived");
        if a.poll(&mut out).unwrap() > 0 {
            got_recv = Some(std::mem::take(&mut out[0]));
        }
        if b.poll(&mut out).unwrap() > 0 {
            got_send = Some(std::mem::take(&mut out[0]));
        }
    }
    let r = got_recv.unwrap();
    assert_eq!((r.op, r.status, r.len), (OpKind::Recv, Status::Success, 16));
    let mut buf = [0u8; 16];
    rx.read_at(0, &mut buf).unwrap();
    assert_eq!(&buf, b"well-formed peer");
    assert_eq!(got_send.unwrap().status, Status::Success);
}

fn tcp_addr(l: &dyn Listener) -> String {
    l.address()
        .strip_prefix("tcp:")
        .expect("tcp address")
        .to_string()
}

#[test]
fn tcp_listener_survives_bad_peers() {
    let opts = opts();
    let mut l = backend::listen(TransportKind::Tcp, &opts).unwrap();
    let addr = tcp_addr(l.as_ref());

    // Garbage: an HTTP request.
    let mut http = TcpStream::connect(&addr).unwrap();
    http.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    // A truncated hello, then hang-up.
    let mut short = TcpStream::connect(&addr).unwrap();
    short
        .write_all(&0x3150_4354_4246_4246u64.to_le_bytes()[..5])
        .unwrap();
    drop(short);
    // A silent client that keeps its connection open.
    let silent = TcpStream::connect(&addr).unwrap();
    for _ in 0..50 {
        assert!(
            l.accept().expect("listener").is_none(),
            "a bad peer was accepted"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    // The garbage peer is refused: the listener closes it.
    http.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut sink = Vec::new();
    let _ = http.read_to_end(&mut sink);

    let (mut a, mut b) = serve_good_peer(l.as_mut(), &opts);
    works(a.as_mut(), b.as_mut());
    drop(silent);
}

#[test]
fn tcp_connection_refuses_a_4gib_frame() {
    let opts = opts();
    let mut l = backend::listen(TransportKind::Tcp, &opts).unwrap();
    let addr = tcp_addr(l.as_ref());
    // A raw peer that passes the 32-byte hello (HELLO_MAGIC, no flags, a nonce), then sends a Send
    // frame header whose length field says 4 GiB - 1.
    let mut raw = TcpStream::connect(&addr).unwrap();
    let mut hello = [0u8; fabric_core::backend::tcp::HELLO_LEN];
    hello[..8].copy_from_slice(&fabric_core::backend::tcp::HELLO_MAGIC.to_le_bytes());
    raw.write_all(&hello).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    let mut t = loop {
        if let Some(t) = l.accept().unwrap() {
            break t;
        }
        assert!(
            Instant::now() < end,
            "the raw peer's hello was not accepted"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    let rx = t.register(4096, Access::empty()).unwrap();
    t.post_recv(rx.slice(0, 4096).unwrap(), 7)
        .map_err(|e| e.error)
        .unwrap();
    let mut frame = [0u8; fabric_core::backend::tcp::FRAME_HEADER];
    frame[0] = 1; // Send
    frame[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    raw.write_all(&frame).unwrap();
    raw.write_all(&[0xAB; 4096]).unwrap();
    // The receive completes with an error (the connection is unusable), promptly, with no
    // 4 GiB allocation; the buffer comes back.
    let c = wait_one(t.as_mut());
    assert_eq!(c.wr_id, 7);
    println!("4 GiB frame: receive completed with {:?}", c.status);
    assert!(!c.status.is_ok(), "a 4 GiB frame was accepted: {c:?}");
    assert!(c.buf.is_some());
    assert_eq!(t.in_flight(), 0);
    // New posts get a typed error instead of hanging.
    let e = t.post_recv(rx.slice(0, 8).unwrap(), 8).unwrap_err();
    assert!(
        matches!(e.error, fabric_core::Error::Disconnected(_)),
        "{}",
        e.error
    );
    // And the listener still serves a well-formed peer.
    let (mut a, mut b) = serve_good_peer(l.as_mut(), &opts);
    works(a.as_mut(), b.as_mut());
}

#[test]
fn shm_listener_survives_bad_peers() {
    let opts = opts();
    let mut l = backend::listen(TransportKind::Shm, &opts).unwrap();
    let name = l
        .address()
        .strip_prefix("shm:@")
        .expect("shm address")
        .to_string();
    let sa = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    // Garbage instead of the 24-byte answer (and no descriptor).
    let mut junk = UnixStream::connect_addr(&sa).unwrap();
    // A peer that hangs up mid-handshake.
    let quitter = UnixStream::connect_addr(&sa).unwrap();
    // A silent peer.
    let silent = UnixStream::connect_addr(&sa).unwrap();
    for _ in 0..20 {
        assert!(
            l.accept().expect("listener").is_none(),
            "a bad peer was accepted"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    drop(quitter);
    junk.write_all(&[0xff; 24]).unwrap();
    junk.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    for _ in 0..20 {
        assert!(
            l.accept().expect("listener").is_none(),
            "a bad peer was accepted"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let (mut a, mut b) = serve_good_peer(l.as_mut(), &opts);
    works(a.as_mut(), b.as_mut());
    drop(silent);
}

/// A hostile tcp peer answers an operation it has not been sent: tokens are predictable
/// (slot index | generation << 32), so it can send a WriteAck for the write that is half
/// written (slot 0, stuck because the peer does not read) or for one still queued behind
/// it (slot 1). Responses are only accepted for operations sent in full: the forged ack
/// is a protocol error that fails the connection cleanly — no success completion for a
/// write that never happened, every buffer back exactly once, no panic.
fn premature_response(forged_slot: u64) {
    let opts = Options {
        max_message: 64 << 20,
        ..opts()
    };
    let mut l = backend::listen(TransportKind::Tcp, &opts).unwrap();
    let addr = tcp_addr(l.as_ref());
    let mut raw = TcpStream::connect(&addr).unwrap();
    let mut hello = [0u8; fabric_core::backend::tcp::HELLO_LEN];
    hello[..8].copy_from_slice(&fabric_core::backend::tcp::HELLO_MAGIC.to_le_bytes());
    raw.write_all(&hello).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    let mut t = loop {
        if let Some(t) = l.accept().unwrap() {
            break t;
        }
        assert!(
            Instant::now() < end,
            "the raw peer's hello was not accepted"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    let mut their_hello = [0u8; fabric_core::backend::tcp::HELLO_LEN];
    raw.read_exact(&mut their_hello).unwrap();
    // Keys only have to pass the local checks.
    let key = |len| fabric_core::RemoteKey {
        transport: TransportKind::Tcp,
        region: 0,
        gen: 0,
        access: (Access::REMOTE_WRITE | Access::LOCAL_WRITE).bits(),
        len,
        key: 0x1234,
        addr: 0,
        rkey: 0,
    };
    // Slot 0: a write far larger than the socket buffers (the raw peer does not read yet).
    let big = t.register(32 << 20, Access::empty()).unwrap();
    t.post_write(big.full(), &key(32 << 20), 0, 1)
        .map_err(|e| e.error)
        .unwrap();
    // Slot 1: a write queued behind it.
    let src = t.register(64, Access::empty()).unwrap();
    t.post_write(src.slice(0, 64).unwrap(), &key(4096), 0, 2)
        .map_err(|e| e.error)
        .unwrap();
    let mut out: Vec<Completion> = (0..4).map(|_| Completion::default()).collect();
    assert_eq!(t.poll(&mut out).unwrap(), 0);
    // The peer acknowledges a write it never received (generation 0).
    let mut ack = [0u8; fabric_core::backend::tcp::FRAME_HEADER];
    ack[0] = 5; // WriteAck, status success
    ack[8..16].copy_from_slice(&forged_slot.to_le_bytes());
    raw.write_all(&ack).unwrap();
    // Let the transport see the forged ack while both writes are still unsent (the peer
    // reads nothing yet: draining first would let slot 0 finish and make the ack timely).
    let mut seen = std::collections::HashMap::new();
    let end = Instant::now() + Duration::from_secs(2);
    while seen.len() < 2 && Instant::now() < end {
        let n = t.poll(&mut out).unwrap();
        for c in out.iter_mut().take(n) {
            assert!(c.buf.take().is_some(), "completion without its buffer");
            assert!(seen.insert(c.wr_id, c.status).is_none());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    // Now it drains everything we send, so the queue could move on.
    let reader = std::thread::spawn(move || {
        let mut sink = vec![0u8; 1 << 20];
        let mut total = 0usize;
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        while let Ok(n) = raw.read(&mut sink) {
            if n == 0 {
                break;
            }
            total += n;
        }
        total
    });
    let end = Instant::now() + Duration::from_secs(30);
    while seen.len() < 2 {
        assert!(Instant::now() < end, "operations never completed: {seen:?}");
        let n = t.poll(&mut out).unwrap();
        for c in out.iter_mut().take(n) {
            assert!(c.buf.take().is_some(), "completion without its buffer");
            assert!(
                seen.insert(c.wr_id, c.status).is_none(),
                "wr_id {} completed twice",
                c.wr_id
            );
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    println!("forged ack for slot {forged_slot}: completions {seen:?}");
    // The forged ack completed nothing: both writes fail with the protocol error.
    assert_eq!(seen[&1], Status::ProtocolError, "{seen:?}");
    assert_eq!(seen[&2], Status::ProtocolError, "{seen:?}");
    assert_eq!(t.in_flight(), 0);
    let e = t.post_recv(src.slice(0, 8).unwrap(), 3).unwrap_err();
    assert!(
        matches!(e.error, fabric_core::Error::Disconnected(_)),
        "{}",
        e.error
    );
    drop(t);
    let _ = reader.join();
}

#[test]
fn tcp_premature_response_for_a_queued_op() {
    premature_response(1);
}

#[test]
fn tcp_premature_response_for_a_half_sent_op() {
    premature_response(0);
}

fn connect_with(l: &mut dyn Listener, opts: &Options) -> fabric_core::Result<Box<dyn Transport>> {
    let mut c = backend::connect(l.address(), opts)?;
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(t) = c.poll_connect()? {
            return Ok(t);
        }
        assert!(
            l.accept().expect("listener").is_none(),
            "a peer without the secret was accepted"
        );
        assert!(
            Instant::now() < end,
            "the handshake neither failed nor finished"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The tcp listener with a shared secret (challenge-response, off by default): a wrong
/// secret, no secret, and a raw peer that only knows the hello are refused with typed
/// errors; a peer with the right secret is served.
#[test]
fn tcp_listener_with_a_shared_secret_refuses_strangers() {
    let secret = |s: &[u8]| Options {
        tcp_secret: Some(s.to_vec()),
        ..opts()
    };
    let server = secret(b"correct horse");
    let mut l = backend::listen(TransportKind::Tcp, &server).unwrap();

    let e = connect_with(l.as_mut(), &secret(b"wrong horse")).unwrap_err();
    println!("wrong secret: {e}");
    assert!(
        matches!(&e, fabric_core::Error::Protocol(m) if m.contains("wrong secret")),
        "{e}"
    );
    let e = connect_with(l.as_mut(), &opts()).unwrap_err();
    println!("no secret: {e}");
    assert!(e.to_string().contains("requires a shared secret"), "{e}");
    // A raw peer that sends a plain hello and waits: dropped, never accepted.
    let mut raw = TcpStream::connect(tcp_addr(l.as_ref())).unwrap();
    let mut hello = [0u8; fabric_core::backend::tcp::HELLO_LEN];
    hello[..8].copy_from_slice(&fabric_core::backend::tcp::HELLO_MAGIC.to_le_bytes());
    raw.write_all(&hello).unwrap();
    for _ in 0..50 {
        assert!(
            l.accept().expect("listener").is_none(),
            "a stranger was accepted"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    // The right secret works, and so does the connection.
    let mut c = backend::connect(l.address(), &server).unwrap();
    let (mut a, mut b) = (None, None);
    let end = Instant::now() + Duration::from_secs(20);
    while a.is_none() || b.is_none() {
        assert!(
            Instant::now() < end,
            "the peer with the secret was not served"
        );
        if a.is_none() {
            a = l.accept().unwrap();
        }
        if b.is_none() {
            b = c.poll_connect().unwrap();
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    works(a.unwrap().as_mut(), b.unwrap().as_mut());
}
