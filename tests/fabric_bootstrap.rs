//! The bootstrap listener against bad peers: garbage, a truncated frame, a 4 GiB length
//! prefix, a wrong secret, a wrong world size and a silent client each get an error, and
//! the listener still serves the next well-formed rank. Also: a 4-rank all-gather and the
//! two-party `pair` over tcp and shm.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use fabric_core::bootstrap::{self, auth, wire, Role, Server};
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
    let port = support::free_port(bind_ip);
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

/// Raises the soft limit on open files to at least `want` (up to the hard limit); returns
/// the limit in force.
fn raise_fd_limit(want: u64) -> u64 {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `l`.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) }, 0);
    if l.rlim_cur < want {
        let raised = libc::rlimit {
            rlim_cur: want.min(l.rlim_max),
            rlim_max: l.rlim_max,
        };
        // SAFETY: setrlimit reads one valid rlimit; the soft limit stays within the hard.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            println!(
                "raised the open-file soft limit from {} to {}",
                l.rlim_cur, raised.rlim_cur
            );
            l = raised;
        }
    }
    l.rlim_cur
}

type Joiner = (
    u32,
    std::thread::JoinHandle<fabric_core::Result<Vec<wire::PeerEntry>>>,
);

/// Ranks `ranks` of `size` join through `join` on threads; rank `r`'s blob is `blob(r)`.
fn spawn_joiners(
    addr: &str,
    size: u32,
    ranks: impl Iterator<Item = u32>,
    blob: fn(u32) -> Vec<u8>,
    timeout: Duration,
) -> Vec<Joiner> {
    ranks
        .map(|r| {
            let addr = addr.to_string();
            let h = std::thread::Builder::new()
                .stack_size(256 << 10)
                .spawn(move || bootstrap::join(&addr, r, size, Some(SECRET), &blob(r), timeout))
                .unwrap();
            (r, h)
        })
        .collect()
}

/// About the size of a real endpoint blob (host id + three listener addresses).
fn endpoint_sized_blob(r: u32) -> Vec<u8> {
    format!("rank {r:04} ").repeat(12).into_bytes()
}

/// 1,000 ranks (rank 0 serving, 999 joining on threads, loopback) complete the exchange with
/// a secret, and every rank gets the same table.
#[test]
fn a_thousand_ranks_get_the_same_table() {
    const N: u32 = 1000;
    // Two sockets per joining rank (its own and the server's accepted one), plus headroom.
    let need = 2 * u64::from(N) + 64;
    let have = raise_fd_limit(need);
    if have < need {
        skip(
            "fd-limit",
            format_args!("{N} ranks need {need} open files; the hard limit allows {have}"),
        );
        return;
    }
    let mut srv = Server::bind("127.0.0.1:0", N, Some(SECRET)).unwrap();
    let addr = srv.local_addr().unwrap().to_string();
    let start = Instant::now();
    let server = std::thread::spawn(move || {
        let t = srv.run(&endpoint_sized_blob(0), Duration::from_secs(300));
        (t, srv.refused)
    });
    let joiners = spawn_joiners(
        &addr,
        N,
        1..N,
        endpoint_sized_blob,
        Duration::from_secs(300),
    );
    let (t0, refused) = server.join().unwrap();
    let took = start.elapsed();
    let t0 = t0.unwrap_or_else(|e| panic!("the server failed: {e}; refused: {refused:?}"));
    assert!(refused.is_empty(), "{refused:?}");
    assert_eq!(t0.len(), N as usize);
    for (i, e) in t0.iter().enumerate() {
        assert_eq!(e.rank as usize, i);
        assert_eq!(e.blob, endpoint_sized_blob(i as u32));
    }
    for (r, h) in joiners {
        let t = h
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(t == t0, "rank {r} got another table");
    }
    println!(
        "{N} ranks: rendezvous + table ({} bytes each) + confirmations in {took:?} \
         (one process, loopback, on a host loaded by other builds: a noisy figure)",
        wire::encode_table(&t0).len()
    );
}

/// While the (large) table is still going out to slow readers, a rank that got its table
/// and exits at once fails no one: the run and every other rank succeed.
#[test]
fn a_rank_that_exits_right_after_its_table_fails_no_one() {
    const N: u32 = 8;
    fn big(r: u32) -> Vec<u8> {
        vec![r as u8; wire::MAX_BLOB] // 8 × 64 KiB: more than a socket buffer holds
    }
    let mut srv = Server::bind("127.0.0.1:0", N, Some(SECRET)).unwrap();
    let addr = srv.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let t = srv.run(&big(0), Duration::from_secs(60));
        (t, srv.refused)
    });
    // Rank 1 joins normally and its thread ends (socket closed) the moment it has the
    // table; ranks 2.. read it slowly (see below).
    let quick = spawn_joiners(&addr, N, 1..2, big, Duration::from_secs(60));
    let slow: Vec<_> = (2..N)
        .map(|r| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(&addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
                let p = read_challenge(&mut s);
                let nonce: [u8; wire::NONCE_LEN] = p[..wire::NONCE_LEN].try_into().unwrap();
                send_hello(
                    &mut s,
                    r,
                    N,
                    auth::answer(auth::Purpose::Bootstrap, SECRET, &nonce, r),
                    &big(r),
                );
                std::thread::sleep(Duration::from_millis(500)); // slow to read
                let t = bootstrap::read_frame_expecting(&mut s, wire::FrameType::Table).unwrap();
                let t = wire::decode_table(&t).unwrap();
                s.write_all(&wire::encode_header(wire::FrameType::Ack, 0))
                    .unwrap();
                t
            })
        })
        .collect();
    let first = quick.into_iter().next().unwrap().1.join().unwrap().unwrap();
    let (t0, refused) = server.join().unwrap();
    let t0 = t0.unwrap_or_else(|e| panic!("the run failed: {e}; refused: {refused:?}"));
    assert_eq!(first, t0);
    for h in slow {
        assert_eq!(h.join().unwrap(), t0);
    }
}

/// A rank that vanishes during the send — it reads the table's header, then closes without
/// reading the rest — is named in a typed error; every other rank is still served.
#[test]
fn a_rank_that_vanishes_during_the_send_is_named_and_the_others_are_served() {
    const N: u32 = 6;
    fn big(r: u32) -> Vec<u8> {
        vec![r as u8; wire::MAX_BLOB]
    }
    let mut srv = Server::bind("127.0.0.1:0", N, Some(SECRET)).unwrap();
    let addr = srv.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || srv.run(&big(0), Duration::from_secs(60)));
    // Rank 1 (first in line for a one-at-a-time sender) vanishes mid-table.
    let vanisher = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            let p = read_challenge(&mut s);
            let nonce: [u8; wire::NONCE_LEN] = p[..wire::NONCE_LEN].try_into().unwrap();
            send_hello(
                &mut s,
                1,
                N,
                auth::answer(auth::Purpose::Bootstrap, SECRET, &nonce, 1),
                &big(1),
            );
            let mut h = [0u8; wire::HEADER_LEN];
            s.read_exact(&mut h).unwrap();
            assert_eq!(wire::decode_header(&h).unwrap().0, wire::FrameType::Table);
            // Dropped with unread data: the kernel resets the connection.
        })
    };
    let joiners = spawn_joiners(&addr, N, 2..N, big, Duration::from_secs(60));
    vanisher.join().unwrap();
    let e = server.join().unwrap().unwrap_err();
    println!("{e}");
    assert!(
        matches!(&e, Error::RanksLost { ranks, .. } if ranks == &[1]),
        "expected rank 1 named as lost, got {e}"
    );
    for (r, h) in joiners {
        let t = h
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(t.len(), N as usize);
    }
}

/// A rank that dies mid-handshake — part of its hello sent, or all of it and then gone
/// before the others joined — is named by the server's typed error, and every rank still
/// waiting gets the same typed error (not a bare hang-up). (A rank that dies once the table
/// is on its way: `a_rank_that_vanishes_during_the_send_...`.)
#[test]
fn a_rank_that_dies_mid_handshake_is_named_everywhere() {
    const N: u32 = 5;
    const DEAD: u32 = 3;
    let scenario = |complete_hello: bool| {
        let mut srv = Server::bind("127.0.0.1:0", N, Some(SECRET)).unwrap();
        let addr = srv.local_addr().unwrap().to_string();
        // Long enough for the other ranks to join on a loaded host.
        let server = std::thread::spawn(move || srv.run(b"r0", Duration::from_secs(5)));
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        let p = read_challenge(&mut s);
        let nonce: [u8; wire::NONCE_LEN] = p[..wire::NONCE_LEN].try_into().unwrap();
        let mac = auth::answer(auth::Purpose::Bootstrap, SECRET, &nonce, DEAD);
        if complete_hello {
            send_hello(&mut s, DEAD, N, mac, b"dead");
        } else {
            let hello = wire::Hello {
                rank: DEAD,
                size: N,
                mac,
                blob: b"dead".to_vec(),
            }
            .encode();
            let mut f = wire::encode_header(wire::FrameType::Hello, hello.len()).to_vec();
            f.extend_from_slice(&hello[..6]);
            s.write_all(&f).unwrap();
        }
        std::thread::sleep(Duration::from_millis(200)); // the server has it
        drop(s); // dies
        let joiners = spawn_joiners(
            &addr,
            N,
            (1..N).filter(|r| *r != DEAD),
            |r| vec![r as u8],
            Duration::from_secs(30),
        );
        let e = server.join().unwrap().unwrap_err();
        println!("server: {e}");
        let Error::RanksLost { ranks, reason } = &e else {
            panic!("expected RanksLost, got {e}");
        };
        assert_eq!(ranks, &[DEAD]);
        let why = if complete_hello {
            "joined from 127.0.0.1, then left before the table"
        } else {
            "never joined"
        };
        assert!(reason.contains(&format!("rank {DEAD} {why}")), "{reason}");
        for (r, h) in joiners {
            match h.join().unwrap() {
                Err(Error::RanksLost { ranks, .. }) => assert_eq!(ranks, vec![DEAD], "rank {r}"),
                other => panic!("rank {r}: expected RanksLost, got {other:?}"),
            }
        }
    };
    scenario(false);
    scenario(true);
}

/// Reads the server's challenge frame; returns its payload.
fn read_challenge(s: &mut TcpStream) -> Vec<u8> {
    bootstrap::read_frame_expecting(s, wire::FrameType::Challenge).unwrap()
}

fn send_hello(s: &mut TcpStream, rank: u32, size: u32, mac: [u8; wire::MAC_LEN], blob: &[u8]) {
    let hello = wire::Hello {
        rank,
        size,
        mac,
        blob: blob.to_vec(),
    }
    .encode();
    let mut f = wire::encode_header(wire::FrameType::Hello, hello.len()).to_vec();
    f.extend_from_slice(&hello);
    s.write_all(&f).unwrap();
}

/// The right answer with one bit flipped is refused as a wrong secret; the right answer,
/// sent by hand, is accepted.
#[test]
fn a_tampered_answer_is_refused() {
    let mut srv = Server::bind("127.0.0.1:0", 2, Some(SECRET)).unwrap();
    let addr = srv.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let t = srv.run(b"r0", Duration::from_secs(30));
        (t, srv.refused)
    });
    for flip in [Some(0usize), Some(wire::MAC_LEN * 8 - 1), None] {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        let p = read_challenge(&mut s);
        let nonce: [u8; wire::NONCE_LEN] = p[..wire::NONCE_LEN].try_into().unwrap();
        let mut mac = auth::answer(auth::Purpose::Bootstrap, SECRET, &nonce, 1);
        if let Some(bit) = flip {
            mac[bit / 8] ^= 1 << (bit % 8);
        }
        send_hello(&mut s, 1, 2, mac, b"r1");
        let got = bootstrap::read_frame_expecting(&mut s, wire::FrameType::Table);
        match flip {
            Some(bit) => assert!(
                matches!(&got, Err(Error::Bootstrap(m)) if m.contains("wrong secret")),
                "bit {bit} flipped: {got:?}"
            ),
            None => {
                let t = wire::decode_table(&got.unwrap()).unwrap();
                assert_eq!(t[1].blob, b"r1");
                s.write_all(&wire::encode_header(wire::FrameType::Ack, 0))
                    .unwrap();
            }
        }
    }
    let (t, refused) = server.join().unwrap();
    assert_eq!(t.unwrap().len(), 2);
    assert_eq!(refused.len(), 2, "{refused:?}");
}

/// A peer of protocol version 1 (the SipHash MAC) gets a typed version error both ways: the
/// server refuses its hello, and the client refuses a version-1 server's challenge.
#[test]
fn an_old_peer_gets_a_version_error() {
    let mut srv = Server::bind("127.0.0.1:0", 2, None).unwrap();
    let addr = srv.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || srv.run(b"r0", Duration::from_secs(30)));
    let hello = wire::Hello {
        rank: 1,
        size: 2,
        mac: [0; wire::MAC_LEN],
        blob: vec![],
    }
    .encode();
    let mut f = wire::encode_header(wire::FrameType::Hello, hello.len()).to_vec();
    f[4..6].copy_from_slice(&1u16.to_le_bytes());
    f.extend_from_slice(&hello);
    let r = raw_exchange(&addr, &f, false);
    assert!(r.contains("version 1"), "{r}");
    let t = bootstrap::join(&addr, 1, 2, None, b"r1", Duration::from_secs(30)).unwrap();
    assert_eq!(server.join().unwrap().unwrap(), t);

    // A version-1 server: its challenge header says 1.
    let old = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let old_addr = old.local_addr().unwrap().to_string();
    let old_server = std::thread::spawn(move || {
        let (mut s, _) = old.accept().unwrap();
        let mut h = wire::encode_header(wire::FrameType::Challenge, wire::NONCE_LEN + 4);
        h[4..6].copy_from_slice(&1u16.to_le_bytes());
        s.write_all(&h).unwrap();
        s.write_all(&[0; wire::NONCE_LEN + 4]).unwrap();
        std::thread::sleep(Duration::from_millis(200));
    });
    let e = bootstrap::join(&old_addr, 1, 2, None, b"r1", Duration::from_secs(10)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Decode(fabric_core::DecodeError::Version { found: 1, .. })
        ),
        "{e}"
    );
    old_server.join().unwrap();
}

/// 1,000 ranks connecting before the server accepts any are all queued by the kernel (the
/// listen backlog is raised from std's 128): none waits out SYN retries.
#[test]
fn a_thousand_connections_are_queued_before_the_server_runs() {
    const N: usize = 1000;
    let need = N as u64 + 64;
    let have = raise_fd_limit(need);
    if have < need {
        skip(
            "fd-limit",
            format_args!("{N} connections need {need} open files; the hard limit allows {have}"),
        );
        return;
    }
    let somaxconn: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    if somaxconn < N {
        skip(
            "somaxconn",
            format_args!(
                "net.core.somaxconn is {somaxconn}: the kernel caps the backlog below {N}"
            ),
        );
        return;
    }
    let srv = Server::bind("127.0.0.1:0", 2, None).unwrap();
    let addr = srv.local_addr().unwrap();
    let start = Instant::now();
    let conns: Vec<TcpStream> = (0..N)
        .map(|i| {
            TcpStream::connect_timeout(&addr, Duration::from_secs(3))
                .unwrap_or_else(|e| panic!("connection {i} was not queued: {e}"))
        })
        .collect();
    println!("{N} connections queued in {:?}", start.elapsed());
    drop(conns);
}

/// A server whose process cannot open a socket per rank (hard limit too low to raise) fails
/// with a typed error that says what to raise — not a bare `EMFILE`. The server runs in a
/// child process (this test binary again) whose open-file limit is lowered for good; the
/// parent makes the connections.
#[test]
fn running_out_of_file_descriptors_is_a_clear_error() {
    const CHILD: &str = "FABRIC_BOOTSTRAP_EMFILE_CHILD";
    const TEST: &str = "running_out_of_file_descriptors_is_a_clear_error";
    if std::env::var_os(CHILD).is_some() {
        let l = libc::rlimit {
            rlim_cur: 32,
            rlim_max: 32,
        };
        // SAFETY: setrlimit reads one valid rlimit (lowering both limits is always allowed).
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) }, 0);
        let mut srv = Server::bind("127.0.0.1:0", 200, None).unwrap();
        println!("PORT {}", srv.local_addr().unwrap().port());
        std::io::Write::flush(&mut std::io::stdout()).unwrap();
        match srv.run(b"r0", Duration::from_secs(30)) {
            Err(e) => println!("RESULT {e}"),
            Ok(_) => println!("RESULT ok"),
        }
        return;
    }
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", TEST, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    let port = loop {
        line.clear();
        assert!(
            std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0,
            "the child ended before printing its port"
        );
        // libtest's "test NAME ... " shares the line.
        if let Some(i) = line.find("PORT ") {
            break line[i + 5..].trim().parse::<u16>().unwrap();
        }
    };
    // More connections than the child can accept; they wait in its backlog. Once the child
    // has failed and exited, further connections are refused: that is fine.
    let conns: Vec<TcpStream> = (0..64)
        .map_while(|_| TcpStream::connect(("127.0.0.1", port)).ok())
        .collect();
    assert!(conns.len() > 20, "only {} connections made", conns.len());
    let result = loop {
        line.clear();
        assert!(
            std::io::BufRead::read_line(&mut out, &mut line).unwrap() > 0,
            "the child ended without a result"
        );
        if let Some(i) = line.find("RESULT ") {
            break line[i + 7..].trim().to_string();
        }
    };
    drop(conns);
    let status = child.wait().unwrap();
    println!("child: {result}");
    assert!(status.success(), "child failed: {status}");
    assert!(
        result.contains("out of file descriptors") && result.contains("ulimit -n"),
        "{result}"
    );
}

/// A rank that joins and then never reads its table (alive, connection open) is named once
/// the deadline passes; the others are served meanwhile, and the run does not wait longer.
#[test]
fn a_rank_that_never_takes_its_table_is_named_at_the_deadline() {
    const N: u32 = 4;
    const STUCK: u32 = 2;
    let mut srv = Server::bind("127.0.0.1:0", N, None).unwrap();
    let addr = srv.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let start = Instant::now();
        let r = srv.run(b"r0", Duration::from_secs(2));
        (r, start.elapsed())
    });
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    read_challenge(&mut s);
    let hello = wire::Hello {
        rank: STUCK,
        size: N,
        mac: [0; wire::MAC_LEN],
        blob: b"stuck".to_vec(),
    }
    .encode();
    let mut f = wire::encode_header(wire::FrameType::Hello, hello.len()).to_vec();
    f.extend_from_slice(&hello);
    s.write_all(&f).unwrap();
    let joiners: Vec<_> = (1..N)
        .filter(|r| *r != STUCK)
        .map(|r| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                bootstrap::join(&addr, r, N, None, b"ok", Duration::from_secs(30))
            })
        })
        .collect();
    for j in joiners {
        assert_eq!(j.join().unwrap().unwrap().len(), N as usize);
    }
    let (r, took) = server.join().unwrap();
    drop(s); // only now: it held its connection open all along
    let e = r.unwrap_err();
    println!("after {took:?}: {e}");
    assert!(
        matches!(&e, Error::RanksLost { ranks, reason }
            if ranks == &[STUCK] && reason.contains("did not confirm it in time")),
        "{e}"
    );
    assert!(
        took < Duration::from_secs(20),
        "the run waited {took:?} for a stuck rank"
    );
}
