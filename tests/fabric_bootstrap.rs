//! The bootstrap listener against bad peers: garbage, a truncated frame, a 4 GiB length
//! prefix, a wrong secret, a wrong world size and a silent client each get an error, and
//! the listener still serves the next well-formed rank. Also: a 4-rank all-gather and the
//! two-party `pair` over tcp and shm.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use fabric_core::bootstrap::{self, wire, Role, Server};
use fabric_core::{backend::Options, Access, Completion, Error, OpKind, TransportKind};

const SECRET: &[u8] = b"correct horse battery staple";

/// Reads the server's challenge, then returns whatever it answers to `send` (the error
/// text of its `Error` frame, or "closed").
fn raw_exchange(addr: &str, send: &[u8], then_close: bool) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let mut h = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let (t, len) = wire::decode_header(&h).unwrap();
    assert_eq!(t, wire::FrameType::Challenge);
    let mut p = vec![0u8; len];
    s.read_exact(&mut p).unwrap();
    s.write_all(send).unwrap();
    if then_close {
        s.shutdown(std::net::Shutdown::Write).unwrap();
    }
    let mut h = [0u8; wire::HEADER_LEN];
    if s.read_exact(&mut h).is_err() {
        return "closed".into();
    }
    match wire::decode_header(&h) {
        Ok((wire::FrameType::Error, len)) => {
            let mut p = vec![0u8; len];
            s.read_exact(&mut p).unwrap();
            String::from_utf8_lossy(&p).into_owned()
        }
        other => panic!("expected an error frame, got {other:?}"),
    }
}

#[test]
fn listener_survives_hostile_peers() {
    let mut srv = Server::bind("127.0.0.1:0", 2, Some(SECRET)).unwrap();
    let addr = srv.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let table = srv.run(b"rank0", Duration::from_secs(60));
        (table, srv.refused)
    });

    // Garbage (an HTTP request).
    let r = raw_exchange(&addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", false);
    assert!(r.contains("bad magic"), "{r}");
    // A 4 GiB length prefix: refused from the header alone.
    let mut h = wire::encode_header(wire::FrameType::Hello, 0);
    h[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    let r = raw_exchange(&addr, &h, false);
    assert!(r.contains("exceeds the limit"), "{r}");
    // A truncated frame: header promises 100 bytes, 10 arrive, then EOF.
    let mut f = wire::encode_header(wire::FrameType::Hello, 100).to_vec();
    f.extend_from_slice(&[0u8; 10]);
    let r = raw_exchange(&addr, &f, true);
    assert!(r.contains("bootstrap read"), "{r}");
    // A well-formed hello whose payload is malformed (rank >= size).
    let bad = wire::Hello {
        rank: 5,
        size: 2,
        mac: [0; wire::MAC_LEN],
        blob: vec![],
    }
    .encode();
    let mut f = wire::encode_header(wire::FrameType::Hello, bad.len()).to_vec();
    f.extend_from_slice(&bad);
    let r = raw_exchange(&addr, &f, false);
    assert!(r.contains("invalid bootstrap rank"), "{r}");
    // Wrong secret, through the real client.
    let e =
        bootstrap::join(&addr, 1, 2, Some(b"wrong"), b"x", Duration::from_secs(10)).unwrap_err();
    assert!(
        matches!(&e, Error::Bootstrap(m) if m.contains("wrong secret")),
        "{e}"
    );
    // No secret at all.
    let e = bootstrap::join(&addr, 1, 2, None, b"x", Duration::from_secs(10)).unwrap_err();
    assert!(e.to_string().contains("requires a shared secret"), "{e}");
    // Wrong world size.
    let e = bootstrap::join(&addr, 1, 3, Some(SECRET), b"x", Duration::from_secs(10)).unwrap_err();
    assert!(e.to_string().contains("world size"), "{e}");
    // A silent client: the per-connection read timeout frees the listener.
    let silent = TcpStream::connect(&addr).unwrap();
    // Finally a well-formed rank is served.
    let table =
        bootstrap::join(&addr, 1, 2, Some(SECRET), b"rank1", Duration::from_secs(30)).unwrap();
    drop(silent);
    assert_eq!(table.len(), 2);
    assert_eq!(table[0].blob, b"rank0");
    assert_eq!(table[1].blob, b"rank1");
    assert_eq!(table[1].ip, "127.0.0.1");
    let (server_table, refused) = server.join().unwrap();
    assert_eq!(server_table.unwrap(), table);
    assert_eq!(refused.len(), 8, "{refused:#?}");
}

#[test]
fn four_rank_all_gather() {
    let mut srv = Server::bind("127.0.0.1:0", 4, None).unwrap();
    let addr = srv.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || srv.run(b"r0", Duration::from_secs(30)).unwrap());
    let clients: Vec<_> = (1..4u32)
        .map(|r| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                bootstrap::join(
                    &addr,
                    r,
                    4,
                    None,
                    format!("r{r}").as_bytes(),
                    Duration::from_secs(30),
                )
                .unwrap()
            })
        })
        .collect();
    let t0 = server.join().unwrap();
    for c in clients {
        assert_eq!(c.join().unwrap(), t0);
    }
    let blobs: Vec<_> = t0.iter().map(|e| e.blob.clone()).collect();
    assert_eq!(
        blobs,
        vec![
            b"r0".to_vec(),
            b"r1".to_vec(),
            b"r2".to_vec(),
            b"r3".to_vec()
        ]
    );
}

fn pair_roundtrip(forced: Option<TransportKind>, expect: TransportKind) {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let bind = format!("127.0.0.1:{port}");
    let opts = Options::default();
    let t = Duration::from_secs(30);
    let server = {
        let (bind, opts) = (bind.clone(), opts.clone());
        std::thread::spawn(move || {
            let mut c =
                bootstrap::pair(&Role::Server { bind }, forced, Some("s"), &opts, t).unwrap();
            let r = c.register(64, Access::empty()).unwrap();
            c.post_recv(r.slice(0, 64).unwrap(), 1)
                .map_err(|e| e.error)
                .unwrap();
            let mut cq = [Completion::default()];
            while c.poll(&mut cq).unwrap() == 0 {
                c.wait(Some(Duration::from_millis(5))).unwrap();
            }
            assert_eq!(cq[0].op, OpKind::Recv);
            (
                c.kind(),
                cq[0].buf.take().unwrap().to_vec()[..cq[0].len].to_vec(),
            )
        })
    };
    let mut c =
        bootstrap::pair(&Role::Client { server: bind }, forced, Some("s"), &opts, t).unwrap();
    assert_eq!(c.kind(), expect);
    let r = c.register(64, Access::empty()).unwrap();
    r.write_at(0, b"hello").unwrap();
    c.post_send(r.slice(0, 5).unwrap(), 1)
        .map_err(|e| e.error)
        .unwrap();
    let mut cq = [Completion::default()];
    while c.poll(&mut cq).unwrap() == 0 {
        c.wait(Some(Duration::from_millis(5))).unwrap();
    }
    let (kind, got) = server.join().unwrap();
    assert_eq!(kind, expect);
    assert_eq!(got, b"hello");
}

#[test]
fn pair_selects_shm_on_one_host_and_honours_overrides() {
    pair_roundtrip(None, TransportKind::Shm);
    pair_roundtrip(Some(TransportKind::Tcp), TransportKind::Tcp);
}
