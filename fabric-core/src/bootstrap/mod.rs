//! Out-of-band bootstrap: a TCP rendezvous where N ranks exchange versioned,
//! length-limited endpoint blobs (an all-gather through rank 0), rank/size discovery from
//! the usual launchers, and [`pair`] — the two-party setup the examples use, which picks a
//! transport (same host → shm; RDMA on both → verbs; else tcp; overridable) and connects.
//!
//! The server binds loopback unless told otherwise, serves connections concurrently on
//! non-blocking sockets, each with its own deadline, validates each frame header (type,
//! version, reserved byte, per-type length limit) before buffering its payload, refuses malformed, truncated, oversized or unauthenticated peers with a typed
//! error (sent back as an `Error` frame when possible) and keeps serving the others.

pub mod auth;
pub mod launcher;
pub mod mesh;
pub mod wire;

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::backend::{self, Options};
use crate::error::{Error, Result};
use crate::transport::{Transport, TransportKind};
use wire::{Challenge, EndpointInfo, FrameType, Hello, PeerEntry, HEADER_LEN, MAC_LEN, NONCE_LEN};

pub use launcher::{Launch, Launcher};
pub use mesh::{connect_mesh, mesh_from_launch, Mesh, MeshOptions, Rendezvous};

/// Per-connection read/write timeout of the rendezvous server.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

fn io_err(op: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |e| Error::io(op, e)
}

/// Writes one frame.
///
/// # Errors
/// [`Error::Io`] on a socket failure.
pub fn write_frame(s: &mut TcpStream, t: FrameType, payload: &[u8]) -> Result<()> {
    let mut v = wire::encode_header(t, payload.len()).to_vec();
    v.extend_from_slice(payload);
    s.write_all(&v).map_err(io_err("bootstrap write"))
}

/// Reads one frame (header checked before the payload is allocated).
///
/// # Errors
/// [`Error::Decode`] for a bad header, [`Error::Io`] for a socket failure or timeout,
/// [`Error::Bootstrap`] when the peer sent an `Error` frame.
pub fn read_frame(s: &mut TcpStream) -> Result<(FrameType, Vec<u8>)> {
    read_frame_of(s, None)
}

/// Reads one frame that must be of type `want` (or an `Error` frame): the header is
/// validated — magic, version, reserved byte, type, the type's length limit — before the
/// payload is allocated, so a peer cannot make us allocate a large frame of a type we do
/// not expect.
///
/// # Errors
/// As [`read_frame`]; [`Error::Bootstrap`] for a frame of another type.
pub fn read_frame_expecting(s: &mut TcpStream, want: FrameType) -> Result<Vec<u8>> {
    read_frame_of(s, Some(want)).map(|(_, p)| p)
}

fn read_frame_of(s: &mut TcpStream, want: Option<FrameType>) -> Result<(FrameType, Vec<u8>)> {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).map_err(io_err("bootstrap read"))?;
    let (t, len) = wire::decode_header(&h)?;
    if let Some(want) = want {
        if t != FrameType::Error {
            expect(t, want)?;
        }
    }
    let mut p = vec![0u8; len];
    s.read_exact(&mut p).map_err(io_err("bootstrap read"))?;
    if t == FrameType::Error {
        return Err(Error::Bootstrap(format!(
            "peer refused: {}",
            String::from_utf8_lossy(&p)
        )));
    }
    Ok((t, p))
}

fn expect(t: FrameType, want: FrameType) -> Result<()> {
    if t != want {
        return Err(Error::Bootstrap(format!(
            "expected a {want:?} frame, got {t:?}"
        )));
    }
    Ok(())
}

/// The rendezvous server (rank 0).
#[derive(Debug)]
pub struct Server {
    listener: TcpListener,
    size: u32,
    secret: Option<Vec<u8>>,
    /// Peers refused so far, with the reason (for logs and tests).
    pub refused: Vec<String>,
}

impl Server {
    /// Binds `addr` (use `127.0.0.1:PORT` unless other hosts must reach it).
    ///
    /// # Errors
    /// [`Error::Io`] when the address cannot be bound; [`Error::InvalidArgument`] for
    /// `size == 0`.
    pub fn bind(addr: &str, size: u32, secret: Option<&[u8]>) -> Result<Self> {
        if size == 0 {
            return Err(Error::InvalidArgument("world size 0".into()));
        }
        let listener = TcpListener::bind(addr).map_err(io_err("bootstrap bind"))?;
        Ok(Server {
            listener,
            size,
            secret: secret.map(<[u8]>::to_vec),
            refused: Vec::new(),
        })
    }

    /// The bound address.
    ///
    /// # Errors
    /// [`Error::Io`] if the socket has no address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener.local_addr().map_err(io_err("getsockname"))
    }

    /// Serves until ranks `1..size` have joined; returns the table (rank 0's entry holds
    /// `blob`). Bad peers are refused and do not count.
    ///
    /// Connections are served concurrently on non-blocking sockets, each with its own
    /// deadline ([`IO_TIMEOUT`] to complete its hello), so a slow or silent client holds
    /// up no one. A rank that joined and hangs up before the table is sent frees its slot
    /// for a well-formed rank. At most [`MAX_PENDING`] handshakes run at once; beyond that
    /// the oldest is dropped.
    ///
    /// # Errors
    /// [`Error::Timeout`] when not everyone joined within `timeout`; [`Error::Bootstrap`]
    /// when the table cannot be sent to a rank.
    pub fn run(&mut self, blob: &[u8], timeout: Duration) -> Result<Vec<PeerEntry>> {
        let end = Instant::now() + timeout;
        self.listener
            .set_nonblocking(true)
            .map_err(io_err("fcntl(O_NONBLOCK)"))?;
        let n = self.size as usize;
        let mut joined: Vec<Option<(TcpStream, PeerEntry)>> = (0..n).map(|_| None).collect();
        let mut pending: Vec<Handshake> = Vec::new();
        loop {
            let mut moved = false;
            // New connections.
            loop {
                match self.listener.accept() {
                    Ok((s, from)) => {
                        moved = true;
                        match Handshake::start(s, from, self.secret.is_some()) {
                            Ok(h) => {
                                if pending.len() >= MAX_PENDING {
                                    let old = pending.remove(0);
                                    self.refuse(old, "too many concurrent handshakes".into());
                                }
                                pending.push(h);
                            }
                            Err(e) => self.refused.push(format!("{from}: {e}")),
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(Error::io("bootstrap accept", e)),
                }
            }
            // Handshakes in progress.
            let now = Instant::now();
            let mut i = 0;
            while i < pending.len() {
                match pending[i].step() {
                    Ok(None) if now < pending[i].deadline => i += 1,
                    Ok(None) => {
                        let h = pending.swap_remove(i);
                        self.refuse(h, "timed out before completing its hello".into());
                    }
                    Ok(Some(hello)) => {
                        moved = true;
                        let h = pending.swap_remove(i);
                        match self.check(&hello, &h.nonce, &joined) {
                            Ok(()) => {
                                let r = hello.rank as usize;
                                let entry = PeerEntry {
                                    rank: hello.rank,
                                    ip: h.from.ip().to_string(),
                                    blob: hello.blob,
                                };
                                joined[r] = Some((h.s, entry));
                            }
                            Err(e) => self.refuse(h, e.to_string()),
                        }
                    }
                    Err(e) => {
                        moved = true;
                        let h = pending.swap_remove(i);
                        self.refuse(h, e.to_string());
                    }
                }
            }
            // Joined ranks that hung up (or spoke out of turn) give their slot back.
            for slot in joined.iter_mut().skip(1) {
                if let Some((s, e)) = slot {
                    if let Some(why) = gone(s) {
                        self.refused
                            .push(format!("rank {} left before the table: {why}", e.rank));
                        *slot = None;
                        moved = true;
                    }
                }
            }
            if joined.iter().skip(1).all(Option::is_some) {
                break;
            }
            if Instant::now() > end {
                return Err(Error::Timeout("bootstrap: not every rank joined"));
            }
            if !moved {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        drop(pending);
        let mut table = vec![PeerEntry {
            rank: 0,
            ip: String::new(),
            blob: blob.to_vec(),
        }];
        table.extend(joined.iter().skip(1).flatten().map(|(_, e)| e.clone()));
        let payload = wire::encode_table(&table);
        for (s, e) in joined.iter_mut().skip(1).flatten() {
            let sent = s
                .set_nonblocking(false)
                .map_err(io_err("fcntl"))
                .and_then(|_| {
                    s.set_write_timeout(Some(IO_TIMEOUT))
                        .map_err(io_err("SO_SNDTIMEO"))
                })
                .and_then(|_| write_frame(s, FrameType::Table, &payload));
            if let Err(err) = sent {
                return Err(Error::Bootstrap(format!(
                    "sending the table to rank {}: {err}",
                    e.rank
                )));
            }
        }
        Ok(table)
    }

    /// Checks a complete hello against the secret, the world size and the taken ranks.
    fn check(
        &self,
        h: &Hello,
        nonce: &[u8; NONCE_LEN],
        joined: &[Option<(TcpStream, PeerEntry)>],
    ) -> Result<()> {
        if let Some(secret) = &self.secret {
            let want = auth::response(secret, nonce, h.rank);
            if !auth::ct_eq(&want, &h.mac) {
                return Err(Error::Bootstrap("wrong secret".into()));
            }
        }
        if h.size != self.size {
            return Err(Error::Bootstrap(format!(
                "world size {} differs from the server's {}",
                h.size, self.size
            )));
        }
        if h.rank == 0 || !matches!(joined.get(h.rank as usize), Some(None)) {
            return Err(Error::Bootstrap(format!("rank {} already taken", h.rank)));
        }
        Ok(())
    }

    /// Records the refusal and tells the peer why (best effort, never blocking).
    fn refuse(&mut self, mut h: Handshake, why: String) {
        let msg = &why.as_bytes()[..why.len().min(wire::MAX_ERROR)];
        let mut v = wire::encode_header(FrameType::Error, msg.len()).to_vec();
        v.extend_from_slice(msg);
        let _ = h.s.write(&v);
        self.refused.push(format!("{}: {why}", h.from));
    }
}

/// Most handshakes the server runs at once.
pub const MAX_PENDING: usize = 128;

/// One peer's handshake on a non-blocking socket: our challenge going out, its hello
/// coming in (header first, validated before any payload is buffered).
#[derive(Debug)]
struct Handshake {
    s: TcpStream,
    from: SocketAddr,
    nonce: [u8; NONCE_LEN],
    deadline: Instant,
    out: Vec<u8>,
    out_done: usize,
    hdr: [u8; HEADER_LEN],
    hdr_got: usize,
    payload: Vec<u8>,
    payload_len: usize,
}

impl Handshake {
    fn start(s: TcpStream, from: SocketAddr, secret_required: bool) -> Result<Self> {
        s.set_nonblocking(true)
            .map_err(io_err("fcntl(O_NONBLOCK)"))?;
        let _ = s.set_nodelay(true);
        let mut nonce = [0u8; NONCE_LEN];
        crate::sys::random_bytes(&mut nonce)?;
        let ch = Challenge {
            nonce,
            secret_required,
        };
        let p = ch.encode();
        let mut out = wire::encode_header(FrameType::Challenge, p.len()).to_vec();
        out.extend_from_slice(&p);
        Ok(Handshake {
            s,
            from,
            nonce,
            deadline: Instant::now() + IO_TIMEOUT,
            out,
            out_done: 0,
            hdr: [0; HEADER_LEN],
            hdr_got: 0,
            payload: Vec::new(),
            payload_len: 0,
        })
    }

    /// Moves the handshake on without blocking: `Ok(Some(hello))` once a complete, well-formed
    /// hello arrived; `Ok(None)` for "not yet".
    fn step(&mut self) -> Result<Option<Hello>> {
        let nb = |r: io::Result<usize>, op| match r {
            Ok(n) => Ok(Some(n)),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(Error::io(op, e)),
        };
        while self.out_done < self.out.len() {
            match nb(self.s.write(&self.out[self.out_done..]), "bootstrap write")? {
                Some(k) => self.out_done += k,
                None => return Ok(None),
            }
        }
        while self.hdr_got < HEADER_LEN {
            match nb(self.s.read(&mut self.hdr[self.hdr_got..]), "bootstrap read")? {
                Some(0) => {
                    return Err(Error::Disconnected(
                        "bootstrap read: hung up during its hello".into(),
                    ))
                }
                Some(k) => self.hdr_got += k,
                None => return Ok(None),
            }
            if self.hdr_got == HEADER_LEN {
                let (t, len) = wire::decode_header(&self.hdr)?;
                expect(t, FrameType::Hello)?;
                self.payload_len = len; // <= Hello's limit (decode_header)
            }
        }
        let mut chunk = [0u8; 4096];
        while self.payload.len() < self.payload_len {
            let want = (self.payload_len - self.payload.len()).min(chunk.len());
            match nb(self.s.read(&mut chunk[..want]), "bootstrap read")? {
                Some(0) => {
                    return Err(Error::Disconnected(
                        "bootstrap read: hung up during its hello".into(),
                    ))
                }
                Some(k) => self.payload.extend_from_slice(&chunk[..k]),
                None => return Ok(None),
            }
        }
        Ok(Some(Hello::decode(&self.payload)?))
    }
}

/// Whether a joined rank, which must now only wait for the table, hung up or sent
/// anything: `Some(reason)` if so.
fn gone(s: &mut TcpStream) -> Option<String> {
    let mut b = [0u8; 1];
    match s.read(&mut b) {
        Ok(0) => Some("hung up".into()),
        Ok(_) => Some("sent data out of turn".into()),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ) =>
        {
            None
        }
        Err(e) => Some(e.to_string()),
    }
}

/// Joins the rendezvous at `server` as `rank` of `size`; returns every rank's entry.
/// Retries the connection until `timeout` (the server may start later).
///
/// # Errors
/// [`Error::Timeout`], [`Error::Bootstrap`] (refused: wrong secret, rank taken, ...),
/// [`Error::Decode`] for a malformed answer.
pub fn join(
    server: &str,
    rank: u32,
    size: u32,
    secret: Option<&[u8]>,
    blob: &[u8],
    timeout: Duration,
) -> Result<Vec<PeerEntry>> {
    let end = Instant::now() + timeout;
    let mut s = loop {
        let addrs: Vec<SocketAddr> = server
            .to_socket_addrs()
            .map_err(|e| Error::InvalidArgument(format!("bootstrap address {server:?}: {e}")))?
            .collect();
        if let Some(s) = addrs
            .iter()
            .find_map(|a| TcpStream::connect_timeout(a, Duration::from_secs(2)).ok())
        {
            break s;
        }
        if Instant::now() > end {
            return Err(Error::Timeout("bootstrap: server unreachable"));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let remaining = end
        .saturating_duration_since(Instant::now())
        .max(IO_TIMEOUT);
    s.set_read_timeout(Some(remaining))
        .map_err(io_err("SO_RCVTIMEO"))?;
    s.set_write_timeout(Some(IO_TIMEOUT))
        .map_err(io_err("SO_SNDTIMEO"))?;
    let _ = s.set_nodelay(true);
    let p = read_frame_expecting(&mut s, FrameType::Challenge)?;
    let ch = Challenge::decode(&p)?;
    let mac = match (secret, ch.secret_required) {
        (Some(sec), _) => auth::response(sec, &ch.nonce, rank),
        (None, true) => {
            return Err(Error::Bootstrap(
                "the server requires a shared secret (set FABRIC_SECRET)".into(),
            ))
        }
        (None, false) => [0u8; MAC_LEN],
    };
    let hello = Hello {
        rank,
        size,
        mac,
        blob: blob.to_vec(),
    };
    write_frame(&mut s, FrameType::Hello, &hello.encode())?;
    let p = read_frame_expecting(&mut s, FrameType::Table)?;
    let table = wire::decode_table(&p)?;
    if table.len() != size as usize {
        return Err(Error::Bootstrap(format!(
            "table of {} ranks, expected {size}",
            table.len()
        )));
    }
    Ok(table)
}

/// This host's identity for "same host" decisions: the kernel boot id plus the network
/// namespace (abstract Unix sockets are per network namespace).
pub fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    format!("{}/{}", boot.trim(), ns)
}

/// Whether an RDMA device with an active port is present (the verbs backend's probe).
pub fn local_rdma_active() -> bool {
    crate::backend::entry(TransportKind::Verbs).is_ok_and(|e| (e.probe)().is_ok())
}

/// Picks the transport for two endpoints: `forced` if given; else shm on the same host,
/// verbs if both have active RDMA ports, else tcp — among the kinds `remote` offers.
///
/// # Errors
/// [`Error::Unavailable`] when the forced kind (or any kind) is not offered.
pub fn select(
    local: &EndpointInfo,
    remote: &EndpointInfo,
    forced: Option<TransportKind>,
) -> Result<(TransportKind, String)> {
    let offered = |k: TransportKind| {
        remote
            .addrs
            .iter()
            .find(|a| {
                a.split_once(':')
                    .map(|(p, _)| p.parse::<TransportKind>().ok())
                    == Some(Some(k))
            })
            .cloned()
    };
    let order: Vec<TransportKind> = match forced {
        Some(k) => vec![k],
        None => {
            let mut v = Vec::new();
            if local.host == remote.host && !local.host.is_empty() {
                v.push(TransportKind::Shm);
            }
            if local.rdma && remote.rdma {
                v.push(TransportKind::Verbs);
            }
            v.push(TransportKind::Tcp);
            v
        }
    };
    for k in &order {
        if let Some(a) = offered(*k) {
            return Ok((*k, a));
        }
    }
    Err(Error::Unavailable {
        transport: order[0],
        reason: format!("the peer offers only {:?}", remote.addrs),
    })
}

/// Which side of a two-party run this process is.
#[derive(Debug, Clone)]
pub enum Role {
    /// Hosts the rendezvous on `bind` (e.g. `0.0.0.0:18515`) and accepts the connection.
    Server {
        /// Address to bind.
        bind: String,
    },
    /// Joins the rendezvous at `server` and connects.
    Client {
        /// `HOST:PORT` of the server.
        server: String,
    },
}

fn is_loopback_bind(bind: &str) -> bool {
    bind.to_socket_addrs()
        .map(|mut a| a.all(|a| a.ip().is_loopback()))
        .unwrap_or(true)
}

/// Two-party setup: exchange endpoint info through the bootstrap, pick a transport (the
/// client decides; the server accepts on whichever of its listeners is used), connect.
///
/// # Errors
/// Bootstrap and transport errors; [`Error::Unavailable`] when no common transport exists.
pub fn pair(
    role: &Role,
    forced: Option<TransportKind>,
    secret: Option<&str>,
    opts: &Options,
    timeout: Duration,
) -> Result<Box<dyn Transport>> {
    let secret = secret.map(str::as_bytes);
    match role {
        Role::Server { bind } => {
            let mut opts = opts.clone();
            if let Some(s) = secret {
                opts.tcp_secret = Some(s.to_vec());
            }
            let loopback = is_loopback_bind(bind);
            let ip = if loopback { "127.0.0.1" } else { "0.0.0.0" };
            opts.tcp_bind = format!("{ip}:0");
            let kinds: Vec<TransportKind> = match forced {
                Some(k) => vec![k],
                None => backend::BACKENDS.iter().map(|e| e.kind).collect(),
            };
            let mut listeners = Vec::new();
            for k in kinds {
                let e = backend::entry(k)?;
                match (e.probe)().and_then(|_| (e.listen)(&opts)) {
                    Ok(l) => listeners.push(l),
                    Err(err) if forced.is_some() => return Err(err),
                    Err(_) => {}
                }
            }
            let addrs = listeners.iter().map(|l| publishable(l.address())).collect();
            let info = EndpointInfo {
                host: host_id(),
                rdma: local_rdma_active(),
                addrs,
            };
            let mut srv = Server::bind(bind, 2, secret)?;
            srv.run(&info.encode(), timeout)?;
            let end = Instant::now() + timeout;
            loop {
                for l in listeners.iter_mut() {
                    if let Some(c) = l.accept()? {
                        return Ok(c);
                    }
                }
                if Instant::now() > end {
                    return Err(Error::Timeout(
                        "the peer never connected after the bootstrap",
                    ));
                }
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        Role::Client { server } => {
            let me = EndpointInfo {
                host: host_id(),
                rdma: local_rdma_active(),
                addrs: Vec::new(),
            };
            let table = join(server, 1, 2, secret, &me.encode(), timeout)?;
            let remote = EndpointInfo::decode(&table[0].blob)?;
            let (_, addr) = select(&me, &remote, forced)?;
            let server_ip = server
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.next())
                .map(|a| a.ip().to_string())
                .unwrap_or_else(|| "127.0.0.1".into());
            let addr = resolve_wildcard(&addr, &server_ip);
            let mut opts = opts.clone();
            if let Some(s) = secret {
                opts.tcp_secret = Some(s.to_vec());
            }
            let mut c = backend::connect(&addr, &opts)?;
            backend::connect_timeout(c.as_mut(), timeout)
        }
    }
}

/// `KIND:0.0.0.0:P` / `KIND:[::]:P` → `KIND:*:P` for every backend whose address is a
/// socket address (tcp, verbs's side channel): the peer substitutes the IP it
/// bootstrapped with.
fn publishable(addr: &str) -> String {
    let Some((kind, rest)) = addr.split_once(':') else {
        return addr.to_string();
    };
    for wild in ["0.0.0.0:", "[::]:"] {
        if let Some(port) = rest.strip_prefix(wild) {
            return format!("{kind}:*:{port}");
        }
    }
    addr.to_string()
}

/// `KIND:*:P` → `KIND:IP:P` (brackets for an IPv6 `ip`), for any backend prefix.
pub fn resolve_wildcard(addr: &str, ip: &str) -> String {
    let Some((kind, rest)) = addr.split_once(':') else {
        return addr.to_string();
    };
    match rest.strip_prefix("*:") {
        Some(port) if ip.contains(':') => format!("{kind}:[{ip}]:{port}"),
        Some(port) => format!("{kind}:{ip}:{port}"),
        None => addr.to_string(),
    }
}

#[cfg(test)]
mod wildcard_tests {
    use super::*;

    #[test]
    fn every_backends_wildcard_address_is_published_and_resolved() {
        for kind in ["tcp", "verbs"] {
            let p = publishable(&format!("{kind}:0.0.0.0:4000"));
            assert_eq!(p, format!("{kind}:*:4000"), "{kind} wildcard not rewritten");
            assert_eq!(
                resolve_wildcard(&p, "10.0.0.2"),
                format!("{kind}:10.0.0.2:4000")
            );
            assert_eq!(
                resolve_wildcard(&p, "fd00::2"),
                format!("{kind}:[fd00::2]:4000")
            );
            let p6 = publishable(&format!("{kind}:[::]:4000"));
            assert_eq!(p6, format!("{kind}:*:4000"));
            // A concrete address travels unchanged.
            let c = format!("{kind}:10.0.0.1:4000");
            assert_eq!(publishable(&c), c);
            assert_eq!(resolve_wildcard(&c, "10.0.0.2"), c);
        }
        assert_eq!(publishable("shm:@name"), "shm:@name");
        assert_eq!(resolve_wildcard("shm:@name", "10.0.0.2"), "shm:@name");
    }
}
