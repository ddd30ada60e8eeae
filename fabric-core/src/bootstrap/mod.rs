//! Out-of-band bootstrap: a TCP rendezvous where N ranks exchange versioned,
//! length-limited endpoint blobs (an all-gather through rank 0), rank/size discovery from
//! the usual launchers, and [`pair`] — the two-party setup the examples use, which picks a
//! transport (same host → shm; RDMA on both → verbs; else tcp; overridable) and connects.
//!
//! The server binds loopback unless told otherwise, reads every frame with a per-connection
//! timeout, refuses malformed, truncated, oversized or unauthenticated peers with a typed
//! error (sent back as an `Error` frame when possible) and keeps serving the others.

pub mod auth;
pub mod launcher;
pub mod wire;

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::backend::{self, Options};
use crate::error::{Error, Result};
use crate::transport::{Transport, TransportKind};
use wire::{Challenge, EndpointInfo, FrameType, Hello, PeerEntry, HEADER_LEN, MAC_LEN, NONCE_LEN};

pub use launcher::{Launch, Launcher};

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
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).map_err(io_err("bootstrap read"))?;
    let (t, len) = wire::decode_header(&h)?;
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
    /// # Errors
    /// [`Error::Timeout`] when not everyone joined within `timeout`.
    pub fn run(&mut self, blob: &[u8], timeout: Duration) -> Result<Vec<PeerEntry>> {
        let end = Instant::now() + timeout;
        self.listener
            .set_nonblocking(true)
            .map_err(io_err("fcntl(O_NONBLOCK)"))?;
        let n = self.size as usize;
        let mut joined: Vec<Option<(TcpStream, PeerEntry)>> = (0..n).map(|_| None).collect();
        let mut count = 1;
        while count < n {
            let (stream, from) = match self.listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() > end {
                        return Err(Error::Timeout("bootstrap: not every rank joined"));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::io("bootstrap accept", e)),
            };
            match self.admit(stream, from.ip(), &joined) {
                Ok((s, entry)) => {
                    let r = entry.rank as usize;
                    joined[r] = Some((s, entry));
                    count += 1;
                }
                Err(e) => self.refused.push(format!("{from}: {e}")),
            }
        }
        let mut table = vec![PeerEntry {
            rank: 0,
            ip: String::new(),
            blob: blob.to_vec(),
        }];
        table.extend(joined.iter().skip(1).flatten().map(|(_, e)| e.clone()));
        let payload = wire::encode_table(&table);
        for (s, e) in joined.iter_mut().skip(1).flatten() {
            if let Err(err) = write_frame(s, FrameType::Table, &payload) {
                return Err(Error::Bootstrap(format!(
                    "sending the table to rank {}: {err}",
                    e.rank
                )));
            }
        }
        Ok(table)
    }

    fn admit(
        &self,
        mut s: TcpStream,
        ip: IpAddr,
        joined: &[Option<(TcpStream, PeerEntry)>],
    ) -> Result<(TcpStream, PeerEntry)> {
        s.set_nonblocking(false).map_err(io_err("fcntl"))?;
        s.set_read_timeout(Some(IO_TIMEOUT))
            .map_err(io_err("SO_RCVTIMEO"))?;
        s.set_write_timeout(Some(IO_TIMEOUT))
            .map_err(io_err("SO_SNDTIMEO"))?;
        let _ = s.set_nodelay(true);
        let mut nonce = [0u8; NONCE_LEN];
        crate::sys::random_bytes(&mut nonce)?;
        let ch = Challenge {
            nonce,
            secret_required: self.secret.is_some(),
        };
        write_frame(&mut s, FrameType::Challenge, &ch.encode())?;
        let r = (|| {
            let (t, p) = read_frame(&mut s)?;
            expect(t, FrameType::Hello)?;
            let h = Hello::decode(&p)?;
            if let Some(secret) = &self.secret {
                let want = auth::response(secret, &nonce, h.rank);
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
            if h.rank == 0 || joined[h.rank as usize].is_some() {
                return Err(Error::Bootstrap(format!("rank {} already taken", h.rank)));
            }
            Ok(PeerEntry {
                rank: h.rank,
                ip: ip.to_string(),
                blob: h.blob,
            })
        })();
        match r {
            Ok(e) => Ok((s, e)),
            Err(e) => {
                let msg = e.to_string();
                let _ = write_frame(
                    &mut s,
                    FrameType::Error,
                    &msg.as_bytes()[..msg.len().min(wire::MAX_ERROR)],
                );
                Err(e)
            }
        }
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
    let (t, p) = read_frame(&mut s)?;
    expect(t, FrameType::Challenge)?;
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
    let (t, p) = read_frame(&mut s)?;
    expect(t, FrameType::Table)?;
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
    (crate::backend::verbs::ENTRY.probe)().is_ok()
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
            let mut c = backend::connect(&addr, opts)?;
            backend::connect_timeout(c.as_mut(), timeout)
        }
    }
}

/// `tcp:0.0.0.0:P` → `tcp:*:P` (the peer substitutes the IP it bootstrapped with).
fn publishable(addr: &str) -> String {
    match addr.strip_prefix("tcp:0.0.0.0:") {
        Some(port) => format!("tcp:*:{port}"),
        None => addr.to_string(),
    }
}

/// `tcp:*:P` → `tcp:IP:P`.
pub fn resolve_wildcard(addr: &str, ip: &str) -> String {
    match addr.strip_prefix("tcp:*:") {
        Some(port) if ip.contains(':') => format!("tcp:[{ip}]:{port}"),
        Some(port) => format!("tcp:{ip}:{port}"),
        None => addr.to_string(),
    }
}
