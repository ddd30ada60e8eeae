//! The bootstrap listener against bad peers: garbage, a truncated frame, a 4 GiB length
//! prefix, a wrong secret, a wrong world size and a silent client each get an error, and
//! the listener still serves the next well-formed rank. Also: a 4-rank all-gather and the
//! two-party `pair` over tcp and shm.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use fabric_core::bootstrap::{self, wire, Role, Server};
use fabric_core::{backend::Options, Access, Completion, Error, OpKind, TransportKind};

mod support;
use support::skip;

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
    // A silent client: served concurrently, it holds up no one (it is still waiting
    // when the table goes out, so it is closed rather than counted as refused).
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
    assert_eq!(refused.len(), 7, "{refused:#?}");
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
    pair_roundtrip_at("127.0.0.1", "127.0.0.1", forced, expect);
}

/// `pair` with the server bound to `bind_ip` and the client joining at `join_ip`.
fn pair_roundtrip_at(
    bind_ip: &str,
    join_ip: &str,
    forced: Option<TransportKind>,
    expect: TransportKind,
) {
    let port = {
        let l = std::net::TcpListener::bind(format!("{bind_ip}:0")).unwrap();
        l.local_addr().unwrap().port()
    };
    let bind = format!("{bind_ip}:{port}");
    let join = format!("{join_ip}:{port}");
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
        bootstrap::pair(&Role::Client { server: join }, forced, Some("s"), &opts, t).unwrap();
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

/// A non-loopback IPv4 address of this machine (the Soft-RoCE guest: veth0's 10.77.0.1).
fn non_loopback_ipv4() -> Option<String> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a list we free below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return None;
    }
    let mut found = None;
    let mut p = list;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*p };
        if !ifa.ifa_addr.is_null()
            // SAFETY: `ifa_addr` is non-null and points to a sockaddr of its family.
            && i32::from(unsafe { (*ifa.ifa_addr).sa_family }) == libc::AF_INET
            && ifa.ifa_flags & libc::IFF_UP as u32 != 0
        {
            // SAFETY: AF_INET addresses are sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
            if !ip.is_loopback() && found.is_none() {
                found = Some(ip.to_string());
            }
        }
        p = ifa.ifa_next;
    }
    // SAFETY: frees the list getifaddrs returned, once.
    unsafe { libc::freeifaddrs(list) };
    found
}

/// The server binds the wildcard address and publishes its listeners; the client joins at
/// another address than loopback and must connect to that host, for every backend that
/// publishes a socket address (tcp; verbs, whose listener published `verbs:0.0.0.0:PORT`).
#[test]
fn pair_across_two_addresses_over_tcp_and_verbs() {
    let Some(ip) = non_loopback_ipv4() else {
        skip(
            "non-loopback-ipv4",
            format_args!("no non-loopback IPv4 address on this machine"),
        );
        return;
    };
    pair_roundtrip_at("0.0.0.0", &ip, Some(TransportKind::Tcp), TransportKind::Tcp);
    match fabric_core::Domain::open(TransportKind::Verbs, &Options::default()) {
        Err(e) => skip("rdma", format_args!("no RDMA device ({e})")),
        Ok(_) => pair_roundtrip_at(
            "0.0.0.0",
            &ip,
            Some(TransportKind::Verbs),
            TransportKind::Verbs,
        ),
    }
}

#[test]
fn pair_selects_shm_on_one_host_and_honours_overrides() {
    pair_roundtrip(None, TransportKind::Shm);
    pair_roundtrip(Some(TransportKind::Tcp), TransportKind::Tcp);
}

/// Joins as `rank` of `size` by hand: reads the challenge, sends a hello, returns the
/// socket (the rank now waits for the table).
fn raw_join(addr: &str, rank: u32, size: u32) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let mut h = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let (_, len) = wire::decode_header(&h).unwrap();
    let mut p = vec![0u8; len];
    s.read_exact(&mut p).unwrap();
    let hello = wire::Hello {
        rank,
        size,
        mac: [0; wire::MAC_LEN],
        blob: b"quitter".to_vec(),
    }
    .encode();
    let mut f = wire::encode_header(wire::FrameType::Hello, hello.len()).to_vec();
    f.extend_from_slice(&hello);
    s.write_all(&f).unwrap();
    s
}

/// A rank that joins and hangs up before the table is sent gives its slot back: the run
/// goes on and serves a well-formed rank 1 instead of failing or refusing it.
#[test]
fn a_rank_that_leaves_before_the_table_frees_its_slot() {
    let mut srv = Server::bind("127.0.0.1:0", 3, None).unwrap();
    let addr = srv.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let t = srv.run(b"r0", Duration::from_secs(30));
        (t, srv.refused)
    });
    let quitter = raw_join(&addr, 1, 3);
    std::thread::sleep(Duration::from_millis(300)); // it has joined
    drop(quitter);
    std::thread::sleep(Duration::from_millis(300)); // and left
    let clients: Vec<_> = (1..3u32)
        .map(|r| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                bootstrap::join(&addr, r, 3, None, b"good", Duration::from_secs(20))
            })
        })
        .collect();
    let results: Vec<_> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let (t0, refused) = server.join().unwrap();
    println!("refused: {refused:?}");
    let t0 = t0.expect("the run must survive a rank that left");
    for r in results {
        assert_eq!(r.expect("a well-formed rank must be served"), t0);
    }
    assert!(t0.iter().skip(1).all(|e| e.blob == b"good"), "{t0:?}");
    assert!(
        refused.iter().any(|r| r.contains("left before the table")),
        "{refused:?}"
    );
}

/// Slow clients (one silent, one trickling a byte at a time) do not hold up the others:
/// handshakes run concurrently, each with its own deadline.
#[test]
fn slow_clients_do_not_hold_up_the_rendezvous() {
    let mut srv = Server::bind("127.0.0.1:0", 2, None).unwrap();
    let addr = srv.local_addr().unwrap().to_string();
    let silent: Vec<_> = (0..3).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    let trickle_addr = addr.clone();
    let trickler = std::thread::spawn(move || {
        let mut s = TcpStream::connect(&trickle_addr).unwrap();
        let h = wire::encode_header(wire::FrameType::Hello, 8);
        for b in h {
            if s.write_all(&[b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    });
    std::thread::sleep(Duration::from_millis(100)); // the slow ones are first in line
    let start = Instant::now();
    let server = std::thread::spawn(move || srv.run(b"r0", Duration::from_secs(60)));
    let t = bootstrap::join(&addr, 1, 2, None, b"r1", Duration::from_secs(60)).unwrap();
    let took = start.elapsed();
    assert_eq!(server.join().unwrap().unwrap(), t);
    println!("rendezvous behind 4 slow clients took {took:?}");
    assert!(
        took < bootstrap::IO_TIMEOUT,
        "the well-formed rank waited {took:?} behind slow clients"
    );
    drop(silent);
    let _ = trickler.join();
}

/// A frame of a type the server does not expect (a 64 MiB Table instead of a Hello) is
/// refused from its header at once: nothing is allocated and nothing waits for the payload.
#[test]
fn an_unexpected_frame_type_is_refused_from_its_header() {
    let mut srv = Server::bind("127.0.0.1:0", 2, None).unwrap();
    let addr = srv.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || srv.run(b"r0", Duration::from_secs(60)));
    let h = wire::encode_header(wire::FrameType::Table, wire::MAX_TABLE);
    let start = Instant::now();
    let r = raw_exchange(&addr, &h, false);
    let took = start.elapsed();
    println!("Table header instead of Hello: {r:?} after {took:?}");
    assert!(r.contains("expected a Hello frame"), "{r}");
    assert!(
        took < Duration::from_secs(2),
        "refused only after {took:?} (waited for the payload)"
    );
    let t = bootstrap::join(&addr, 1, 2, None, b"r1", Duration::from_secs(30)).unwrap();
    assert_eq!(server.join().unwrap().unwrap(), t);
}
