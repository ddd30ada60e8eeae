//! `tcp`: any two hosts, no special hardware.
//!
//! One non-blocking, `TCP_NODELAY` stream per connection carrying 56-byte framed headers
//! (decoded by the pure [`decode_header`], lengths limited) and payloads. One-sided
//! operations are emulated with the same semantics and errors as shm/verbs: a WRITE frame
//! carries the data and is answered by an ACK with a status; READ and ATOMIC are requests
//! answered by responses carrying data / the old value. The target checks key, access and
//! bounds against its own registrations ([`Tracker::check_target`]); a refusal is a
//! [`Status::RemoteAccess`] completion at the initiator. Responses echo the initiator's
//! slot token, which the tracker validates (a forged or stale token is a protocol error).
//!
//! Connection setup: each side sends a 32-byte hello (magic, flags, nonce, decoded by the
//! pure [`decode_hello`]). With [`Options::tcp_secret`](super::Options::tcp_secret) set
//! (off by default; `pair` uses the bootstrap's secret) each side then proves the secret by
//! answering the other's nonce (the bootstrap's challenge response, bound to its role); a
//! peer without it, or with another, is dropped before it gets a connection.
//!
//! Backpressure: the owed-response queue is bounded; when it is full, or when a message
//! arrives with no receive posted, the backend stops reading the socket and TCP flow
//! control pushes back on the peer.
//!
//! Congestion control: a connection that stays on this host leaves a pacing algorithm
//! (BBR) for `cubic` or `reno`; see [`TcpCongestion`] for why and
//! how to choose otherwise.
//!
//! Sleeping: a connection holds one fd, its socket. A lone [`wait_fd`](Transport::wait_fd)
//! is an epoll of the socket, made on first need, that `arm` also sets to watch
//! writability while output waits for room; a [`Worker`](crate::Worker) watches the socket
//! itself in its own epoll (for writability too, after such an arm), so a connection in a
//! worker never makes one.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::OnceLock;

use super::accept::{self, AcceptQueue, Connecting, Handshake};
use super::{BackendEntry, Connector, Endpoint, Hal, Listener, TcpCongestion, WatchFds};
use crate::bootstrap::auth;
use crate::bootstrap::wire::{MAC_LEN, NONCE_LEN};
use crate::domain::{Domain, DomainBackend, MemorySupport};
use crate::error::{DecodeError, Error, Result};
use crate::region::{Access, Region};
use crate::sys;
use crate::tracker::{OpDesc, RecvRef, Sink, Token, Tracker};
use crate::transport::{
    AtomicOp, Capabilities, MemoryKinds, MessageOrdering, Status, Transport, TransportKind,
};

/// The registry entry.
pub static ENTRY: BackendEntry = BackendEntry {
    kind: TransportKind::Tcp,
    probe: || Ok(()),
    open: Some(|_| Ok(Box::new(TcpDomain))),
    listen: |o| Domain::open(TransportKind::Tcp, o)?.listen(),
    connect: |a, o| Domain::open(TransportKind::Tcp, o)?.connect(a),
};

/// The tcp domain: nothing per device; caller memory needs no registration (the
/// target side checks keys against the domain's registry).
#[derive(Debug)]
struct TcpDomain;

impl DomainBackend for TcpDomain {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }
    fn memory(&self) -> MemorySupport {
        MemorySupport {
            allocated: MemoryKinds::HOST,
            allocated_remote: MemoryKinds::HOST,
            caller: MemoryKinds::HOST,
            caller_remote: MemoryKinds::HOST,
        }
    }
    fn listen(&self, d: &Domain) -> Result<Box<dyn Listener>> {
        Ok(Box::new(TcpListenerT::bind(d)?))
    }
    fn connect(&self, d: &Domain, address: &str) -> Result<Box<dyn Connector>> {
        Ok(Box::new(TcpConnector::connect(address, d)?))
    }
}

/// The hello's magic: `"FBFBTCP"` and the wire version's digit. Version 2 carries a
/// tag in [`FrameKind::Send`] frames (`aux0`) and adds [`FrameKind::WriteImm`].
pub const HELLO_MAGIC: u64 = 0x3250_4354_4246_4246; // "FBFBTCP2"
/// The magic of version 1 peers (no tags): refused with [`DecodeError::Version`].
pub const HELLO_MAGIC_V1: u64 = 0x3150_4354_4246_4246; // "FBFBTCP1"
const WIRE_VERSION: u32 = 2;
/// Bytes of the hello each side sends first: magic `u64`, flags `u32` (bit 0: this side
/// requires the shared secret), reserved `u32` (zero), a 16-byte random nonce.
pub const HELLO_LEN: usize = 32;
/// Hello flag: the sender holds a shared secret and requires the peer to prove it.
pub const HELLO_SECRET: u32 = 1;
/// Bytes of the proof each side sends after the hellos when a secret is in use: the
/// bootstrap's challenge response to the peer's nonce, bound to the sender's role
/// (listener 0, connector 1) so a proof cannot be reflected back.
pub const PROOF_LEN: usize = MAC_LEN;
/// Bytes of a frame header.
pub const FRAME_HEADER: usize = 56;
/// Largest payload a frame may announce.
pub const MAX_FRAME_PAYLOAD: u64 = 1 << 30;
const STAGING: usize = 256 << 10;
/// Most bytes one read into staging asks for. Payload bytes that land in staging are
/// copied once more into the receive buffer; a cap keeps that second copy small (and in
/// cache) for large messages, whose rest is read straight into the receive buffer,
/// while one read still takes hundreds of small frames.
const FILL_MAX: usize = 32 << 10;
const DIRECT_MIN: usize = 16 << 10;
/// Frame types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// Two-sided message (payload).
    Send = 1,
    /// One-sided write (payload), answered by `WriteAck`.
    Write = 2,
    /// One-sided read request (no payload; `len` = bytes wanted).
    ReadReq = 3,
    /// Atomic request (no payload).
    AtomicReq = 4,
    /// Write acknowledgement with a status.
    WriteAck = 5,
    /// Read response (payload when the status is success).
    ReadResp = 6,
    /// Atomic response (`aux0` = old value).
    AtomicResp = 7,
    /// One-sided write with immediate (payload; `aux0` = the immediate), answered by
    /// `WriteAck`; the target's notification is matched as a zero-byte message of tag 0.
    WriteImm = 8,
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// The type.
    pub kind: FrameKind,
    /// Status (responses): 0 success, 1 remote access error.
    pub status: u8,
    /// Atomic op: 1 compare-swap, 2 fetch-add.
    pub op: u8,
    /// Payload bytes that follow (`ReadReq`: bytes requested).
    pub len: u32,
    /// Initiator's slot token (one-sided ops).
    pub token: u64,
    /// Target region key.
    pub key: u64,
    /// Target offset.
    pub offset: u64,
    /// Target region id.
    pub region: u32,
    /// Target region id's generation.
    pub gen: u32,
    /// Operand / result; a `Send` frame's tag; a `WriteImm` frame's immediate.
    pub aux0: u64,
    /// Second operand.
    pub aux1: u64,
}

impl FrameHeader {
    fn new(kind: FrameKind) -> Self {
        FrameHeader {
            kind,
            status: 0,
            op: 0,
            len: 0,
            token: 0,
            key: 0,
            offset: 0,
            region: 0,
            gen: 0,
            aux0: 0,
            aux1: 0,
        }
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; FRAME_HEADER] {
        let mut b = [0u8; FRAME_HEADER];
        b[0] = self.kind as u8;
        b[1] = self.status;
        b[2] = self.op;
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b[8..16].copy_from_slice(&self.token.to_le_bytes());
        b[16..24].copy_from_slice(&self.key.to_le_bytes());
        b[24..32].copy_from_slice(&self.offset.to_le_bytes());
        b[32..36].copy_from_slice(&self.region.to_le_bytes());
        b[36..40].copy_from_slice(&self.gen.to_le_bytes());
        b[40..48].copy_from_slice(&self.aux0.to_le_bytes());
        b[48..56].copy_from_slice(&self.aux1.to_le_bytes());
        b
    }
}

/// Decodes a frame header from a peer.
///
/// # Errors
/// A [`DecodeError`] for a short buffer, a non-zero reserved byte (3), an
/// unknown type, status or atomic op, or a length over [`MAX_FRAME_PAYLOAD`].
pub fn decode_header(b: &[u8]) -> std::result::Result<FrameHeader, DecodeError> {
    if b.len() < FRAME_HEADER {
        return Err(DecodeError::Truncated {
            what: "tcp frame header",
            need: FRAME_HEADER,
            got: b.len(),
        });
    }
    let u64_at = |o: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[o..o + 8]);
        u64::from_le_bytes(a)
    };
    let kind = match b[0] {
        1 => FrameKind::Send,
        2 => FrameKind::Write,
        3 => FrameKind::ReadReq,
        4 => FrameKind::AtomicReq,
        5 => FrameKind::WriteAck,
        6 => FrameKind::ReadResp,
        7 => FrameKind::AtomicResp,
        8 => FrameKind::WriteImm,
        v => {
            return Err(DecodeError::Invalid {
                what: "tcp frame type",
                value: v as u64,
            })
        }
    };
    if b[3] != 0 {
        return Err(DecodeError::Invalid {
            what: "tcp frame header reserved byte (must be zero)",
            value: b[3] as u64,
        });
    }
    if b[1] > 1 {
        return Err(DecodeError::Invalid {
            what: "tcp frame status",
            value: b[1] as u64,
        });
    }
    if kind == FrameKind::AtomicReq && !(1..=2).contains(&b[2]) {
        return Err(DecodeError::Invalid {
            what: "tcp atomic op",
            value: b[2] as u64,
        });
    }
    let len = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    if len as u64 > MAX_FRAME_PAYLOAD {
        return Err(DecodeError::TooLong {
            what: "tcp frame",
            len: len as u64,
            max: MAX_FRAME_PAYLOAD,
        });
    }
    let carries = matches!(
        kind,
        FrameKind::Send | FrameKind::Write | FrameKind::WriteImm | FrameKind::ReadResp
    );
    if kind == FrameKind::WriteImm && b[48..56] != [0u8; 8] {
        return Err(DecodeError::Invalid {
            what: "tcp write-imm frame: aux1 (must be zero)",
            value: u64_at(48),
        });
    }
    if kind == FrameKind::WriteImm && u64_at(40) > u32::MAX as u64 {
        return Err(DecodeError::Invalid {
            what: "tcp write-imm immediate (32 bits)",
            value: u64_at(40),
        });
    }
    if !carries && kind != FrameKind::ReadReq && len != 0 {
        return Err(DecodeError::Invalid {
            what: "tcp frame length for a frame without payload",
            value: len as u64,
        });
    }
    Ok(FrameHeader {
        kind,
        status: b[1],
        op: b[2],
        len,
        token: u64_at(8),
        key: u64_at(16),
        offset: u64_at(24),
        region: u32::from_le_bytes([b[32], b[33], b[34], b[35]]),
        gen: u32::from_le_bytes([b[36], b[37], b[38], b[39]]),
        aux0: u64_at(40),
        aux1: u64_at(48),
    })
}

/// Decodes a peer's tcp hello: `(flags, nonce)`.
///
/// # Errors
/// A [`DecodeError`] for a short buffer, a wrong magic, unknown flags or non-zero
/// reserved bytes.
pub fn decode_hello(b: &[u8]) -> std::result::Result<(u32, [u8; NONCE_LEN]), DecodeError> {
    if b.len() < HELLO_LEN {
        return Err(DecodeError::Truncated {
            what: "tcp hello",
            need: HELLO_LEN,
            got: b.len(),
        });
    }
    let mut m = [0u8; 8];
    m.copy_from_slice(&b[..8]);
    let magic = u64::from_le_bytes(m);
    if magic == HELLO_MAGIC_V1 {
        return Err(DecodeError::Version {
            what: "tcp hello",
            found: 1,
            expected: WIRE_VERSION,
        });
    }
    if magic != HELLO_MAGIC {
        return Err(DecodeError::BadMagic {
            what: "tcp hello",
            found: magic,
        });
    }
    let flags = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    if flags & !HELLO_SECRET != 0 {
        return Err(DecodeError::Invalid {
            what: "tcp hello flags",
            value: flags as u64,
        });
    }
    let reserved = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
    if reserved != 0 {
        return Err(DecodeError::Invalid {
            what: "tcp hello reserved bytes (must be zero)",
            value: reserved as u64,
        });
    }
    let mut nonce = [0u8; NONCE_LEN];
    nonce.copy_from_slice(&b[16..16 + NONCE_LEN]);
    Ok((flags, nonce))
}

fn setup(s: &TcpStream, congestion: &TcpCongestion) -> Result<()> {
    s.set_nonblocking(true)
        .map_err(|e| Error::io("fcntl(O_NONBLOCK)", e))?;
    s.set_nodelay(true)
        .map_err(|e| Error::io("setsockopt(TCP_NODELAY)", e))?;
    if let (TcpCongestion::UnpacedOnLoopback, Ok(l), Ok(p)) =
        (congestion, s.local_addr(), s.peer_addr())
    {
        // Only a same-host connection not known as one before it connected gets here
        // unpaced (a listener on every address, a peer at our own non-loopback address).
        // BBR's pacing stays with a socket switched after it connected (the kernel keeps
        // it on), its rate then set from cubic's window: less than set before, still a gain.
        if same_host(l.ip(), p.ip()) {
            unpace(s.as_fd());
        }
    }
    Ok(())
}

/// Whether a connection from `local` to `peer` stays on this host: the kernel routes a
/// loopback peer, and a peer at the local address itself, over the loopback device.
fn same_host(local: IpAddr, peer: IpAddr) -> bool {
    let peer = peer.to_canonical();
    peer.is_loopback() || peer == local.to_canonical()
}

/// Applies [`Options::tcp_congestion`](super::Options::tcp_congestion) to a socket that has
/// not connected yet: a listener bound to `addr` (the sockets it accepts inherit the
/// algorithm) or a socket about to connect to `addr`. Set this early, a socket never runs
/// the host's algorithm; a socket that started under BBR keeps BBR's pacing after a switch.
fn congestion_before_connecting(
    fd: BorrowedFd<'_>,
    addr: SocketAddr,
    policy: &TcpCongestion,
) -> Result<()> {
    match policy {
        TcpCongestion::Host => {}
        TcpCongestion::Named(name) => {
            sys::set_tcp_congestion(fd, name).map_err(|e| congestion_refused(name, &e))?;
        }
        TcpCongestion::UnpacedOnLoopback => {
            if addr.ip().to_canonical().is_loopback() {
                unpace(fd);
            }
        }
    }
    Ok(())
}

/// A socket the host gives a pacing algorithm (BBR) gets `cubic` where this process may
/// choose it, else `reno` (never restricted); neither: the host's stays (a loss of speed,
/// not of function).
fn unpace(fd: BorrowedFd<'_>) {
    if sys::tcp_congestion(fd).is_ok_and(|now| now.starts_with("bbr"))
        && sys::set_tcp_congestion(fd, "cubic").is_err()
    {
        let _ = sys::set_tcp_congestion(fd, "reno");
    }
}

/// The error for a [`TcpCongestion::Named`] algorithm the kernel refused, with what this
/// host offers.
fn congestion_refused(name: &str, e: &io::Error) -> Error {
    let sysctl = |f: &str| {
        std::fs::read_to_string(format!("/proc/sys/net/ipv4/{f}"))
            .map_or_else(|_| "?".to_owned(), |s| s.trim().to_owned())
    };
    Error::InvalidArgument(format!(
        "tcp congestion control {name:?} refused by the kernel ({e}); this host allows \
         {:?} without CAP_NET_ADMIN (net.ipv4.tcp_allowed_congestion_control) and has {:?} \
         (net.ipv4.tcp_available_congestion_control); FABRIC_TCP_CONGESTION=host keeps \
         its default",
        sysctl("tcp_allowed_congestion_control"),
        sysctl("tcp_available_congestion_control"),
    ))
}

/// The non-blocking connection handshake: hellos both ways, then — when a shared secret
/// is in use — each side proves it by answering the other's nonce.
#[derive(Debug)]
struct Hello {
    secret: Option<Vec<u8>>,
    /// 0 listener, 1 connector (bound into the proofs).
    role: u32,
    nonce: [u8; NONCE_LEN],
    out: [u8; HELLO_LEN + PROOF_LEN],
    out_len: usize,
    out_sent: usize,
    got: [u8; HELLO_LEN + PROOF_LEN],
    need: usize,
    n: usize,
    peer_checked: bool,
}

impl Hello {
    fn new(secret: Option<Vec<u8>>, role: u32) -> Result<Self> {
        let mut nonce = [0u8; NONCE_LEN];
        sys::random_bytes(&mut nonce)?;
        let mut out = [0u8; HELLO_LEN + PROOF_LEN];
        out[..8].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        let flags = if secret.is_some() { HELLO_SECRET } else { 0 };
        out[8..12].copy_from_slice(&flags.to_le_bytes());
        out[16..16 + NONCE_LEN].copy_from_slice(&nonce);
        Ok(Hello {
            secret,
            role,
            nonce,
            out,
            out_len: HELLO_LEN,
            out_sent: 0,
            got: [0; HELLO_LEN + PROOF_LEN],
            need: HELLO_LEN,
            n: 0,
            peer_checked: false,
        })
    }

    /// Moves the handshake on: `Ok(true)` once complete (and the peer proved the secret
    /// when one is in use).
    fn step(&mut self, s: &TcpStream) -> Result<bool> {
        use std::io::{Read, Write};
        loop {
            while self.out_sent < self.out_len {
                match (&*s).write(&self.out[self.out_sent..self.out_len]) {
                    Ok(k) => self.out_sent += k,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(Error::io("tcp hello write", e)),
                }
            }
            while self.n < self.need {
                match (&*s).read(&mut self.got[self.n..self.need]) {
                    Ok(0) => {
                        return Err(Error::Disconnected(
                            "peer closed during the tcp hello".into(),
                        ))
                    }
                    Ok(k) => {
                        self.n += k;
                        // Refuse a stranger (or an older peer, with a typed version
                        // error) as soon as its first 8 bytes are in.
                        if self.n >= 8 && self.got[..8] != HELLO_MAGIC.to_le_bytes() {
                            if self.got[..8] == HELLO_MAGIC_V1.to_le_bytes() {
                                return Err(Error::Decode(DecodeError::Version {
                                    what: "tcp hello (the peer speaks an older wire version)",
                                    found: 1,
                                    expected: WIRE_VERSION,
                                }));
                            }
                            return Err(Error::Protocol(
                                "not a fabric tcp peer (bad hello)".into(),
                            ));
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(Error::io("tcp hello read", e)),
                }
            }
            if self.n == HELLO_LEN && !self.peer_checked {
                self.peer_checked = true;
                let (flags, peer_nonce) = decode_hello(&self.got[..HELLO_LEN])
                    .map_err(|e| Error::Protocol(format!("not a fabric tcp peer: {e}")))?;
                let peer_secret = flags & HELLO_SECRET != 0;
                match (&self.secret, peer_secret) {
                    (None, false) => return Ok(true),
                    (None, true) => {
                        return Err(Error::Protocol(
                            "the tcp peer requires a shared secret (none configured here)".into(),
                        ))
                    }
                    (Some(_), false) => {
                        return Err(Error::Protocol(
                            "the tcp peer offers no shared secret".into(),
                        ))
                    }
                    (Some(sec), true) => {
                        let proof = auth::response(sec, &peer_nonce, self.role);
                        self.out[HELLO_LEN..].copy_from_slice(&proof);
                        self.out_len = HELLO_LEN + PROOF_LEN;
                        self.need = HELLO_LEN + PROOF_LEN;
                        continue;
                    }
                }
            }
            let Some(sec) = &self.secret else {
                return Ok(true);
            };
            let want = auth::response(sec, &self.nonce, 1 - self.role);
            if !auth::ct_eq(&want, &self.got[HELLO_LEN..]) {
                return Err(Error::Protocol(
                    "tcp peer failed the shared-secret check (wrong secret)".into(),
                ));
            }
            return Ok(true);
        }
    }
}

/// The handshake of either side (`ROLE` 0: the listener's, 1: the connector's).
#[derive(Debug)]
struct TcpHandshake<const ROLE: u32> {
    s: TcpStream,
    hello: Hello,
}

impl<const ROLE: u32> Handshake<TcpStream> for TcpHandshake<ROLE> {
    type Ctx = Domain;
    type Output = Box<dyn Transport>;
    fn start(s: TcpStream, domain: &Domain) -> Result<Self> {
        setup(&s, &domain.options().tcp_congestion)?;
        let hello = Hello::new(domain.options().tcp_secret.clone(), ROLE)?;
        Ok(TcpHandshake { s, hello })
    }
    fn step(&mut self, _: &Domain) -> Result<bool> {
        self.hello.step(&self.s)
    }
    fn establish(self, domain: &Domain) -> Result<Box<dyn Transport>> {
        finish(self.s, domain)
    }
}

/// A TCP listener (binds `Options::tcp_bind`, loopback by default).
#[derive(Debug)]
pub struct TcpListenerT {
    queue: AcceptQueue<TcpListener, TcpHandshake<0>>,
    address: String,
    domain: Domain,
}

impl TcpListenerT {
    /// Binds.
    ///
    /// # Errors
    /// [`Error::Io`] when the address cannot be bound; [`Error::InvalidArgument`] when
    /// [`Options::tcp_congestion`](super::Options::tcp_congestion) names an algorithm the
    /// kernel refuses.
    pub fn bind(domain: &Domain) -> Result<Self> {
        let opts = domain.options();
        let (sock, a) = accept::bind_tcp(&opts.tcp_bind)?;
        // A refusal of a named algorithm shows here, to the listener's owner, rather than
        // as dropped peers.
        congestion_before_connecting(sock.as_fd(), a, &opts.tcp_congestion)?;
        Ok(TcpListenerT {
            queue: AcceptQueue::new(sock, opts.handshake_timeout),
            address: format!("tcp:{a}"),
            domain: domain.clone(),
        })
    }
}

impl Listener for TcpListenerT {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }
    fn address(&self) -> &str {
        &self.address
    }
    fn accept(&mut self) -> Result<Option<Box<dyn Transport>>> {
        self.queue.accept(&self.domain)
    }
}

/// Connects to a [`TcpListenerT`] (address `HOST:PORT` without the `tcp:` prefix).
#[derive(Debug)]
pub struct TcpConnector {
    conn: Connecting<TcpStream, TcpHandshake<1>>,
    domain: Domain,
}

impl TcpConnector {
    /// Starts a non-blocking connect.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an address that does not resolve, or when
    /// [`Options::tcp_congestion`](super::Options::tcp_congestion) names an algorithm the
    /// kernel refuses; [`Error::Io`].
    pub fn connect(address: &str, domain: &Domain) -> Result<Self> {
        let policy = &domain.options().tcp_congestion;
        let s = accept::dial_tcp(address, "tcp", |fd, to| {
            congestion_before_connecting(fd, to, policy)
        })?;
        let timeout = domain.options().handshake_timeout;
        Ok(TcpConnector {
            conn: Connecting::dial(s, timeout, ["tcp connect"; 2]),
            domain: domain.clone(),
        })
    }
}

impl Connector for TcpConnector {
    fn poll_connect(&mut self) -> Result<Option<Box<dyn Transport>>> {
        self.conn.poll(&self.domain)
    }
}

fn finish(sock: TcpStream, domain: &Domain) -> Result<Box<dyn Transport>> {
    let opts = domain.options();
    let caps = Capabilities {
        ordering: MessageOrdering::InOrder,
        one_sided: true,
        atomics: true,
        max_message: opts.max_message.min(MAX_FRAME_PAYLOAD as usize),
        max_in_flight: opts.max_in_flight,
        inline_size: 0,
        memory_kinds: MemoryKinds::HOST,
        tagged: true,
        max_group: super::MAX_GROUP,
        write_imm: true,
        unexpected_messages: opts.unexpected_messages,
        unexpected_bytes: opts.unexpected_bytes,
        too_long_kills_connection: false,
        remote_error_kills_connection: false,
        remote_window: false,
    };
    let hal = TcpHal {
        domain: domain.clone(),
        sock,
        lone: OnceLock::new(),
        attached: false,
        epoll_out: false,
        tx: None,
        owed: VecDeque::with_capacity(2 * opts.max_in_flight),
        owed_cap: 2 * opts.max_in_flight,
        staging: vec![0u8; STAGING].into_boxed_slice(),
        start: 0,
        end: 0,
        rx: Rx::Header,
        eof: false,
        drained: false,
    };
    Ok(Box::new(Endpoint::in_domain(
        domain.clone(),
        Tracker::new(domain.id(), TransportKind::Tcp, caps),
        hal,
    )))
}

/// A frame being written.
#[derive(Debug)]
struct TxFrame {
    hdr: [u8; FRAME_HEADER],
    payload: *const u8,
    len: usize,
    sent: usize,
    /// The submission this frame carries (completed / left awaiting a response when sent).
    token: Option<(Token, bool)>,
    /// Keeps a response's source region alive.
    _keep: Option<Region>,
}

// SAFETY: `payload` points into a region kept alive by the tracker (submissions) or by
// `_keep` (responses); the frame is only used by the connection that owns it.
unsafe impl Send for TxFrame {}

/// A response we owe the peer.
#[derive(Debug)]
struct Owed {
    hdr: FrameHeader,
    src: Option<(Region, usize)>,
}

#[derive(Debug)]
enum Rx {
    Header,
    /// Copy `left` more payload bytes to `dst` (if any), then run `then`.
    Payload {
        dst: Option<*mut u8>,
        left: usize,
        then: Then,
        _keep: Option<Region>,
    },
}

#[derive(Debug, Clone, Copy)]
enum Then {
    /// The receive (part), the length and the tag.
    CompleteRecv(RecvRef, usize, u64),
    /// The unexpected message being stashed arrived in full.
    StashEnd,
    /// A write-imm's bytes landed: ack it and notify (the receive that matched, or the
    /// stashed notification when none did).
    AckImm(FrameHeader, Option<(RecvRef, u32, usize)>),
    Ack(FrameHeader),
    CompleteRead(Token, usize),
    Nothing,
}

#[derive(Debug)]
struct TcpHal {
    /// Target-side checks go to the domain's registry.
    domain: Domain,
    sock: TcpStream,
    /// The epoll of a lone [`wait_fd`](Hal::wait_fd) (the socket, and its writability
    /// while output waits), made on first need; `None` inside when it could not be made
    /// (then `arm` fails). A connection in a worker never makes it: the worker watches the
    /// socket itself ([`watch_fds`](Hal::watch_fds)).
    lone: OnceLock<Option<OwnedFd>>,
    /// A worker holds the connection.
    attached: bool,
    /// The last `arm` asked for writability (output waits for room in the socket), in the
    /// lone epoll where it exists and in what `watch_fds` reports.
    epoll_out: bool,
    tx: Option<TxFrame>,
    owed: VecDeque<Owed>,
    owed_cap: usize,
    staging: Box<[u8]>,
    start: usize,
    end: usize,
    rx: Rx,
    eof: bool,
    /// A read in this pass returned less than it asked for: the socket had no more, so
    /// this pass reads no further (the next `poll` does; the wait fd stays readable for
    /// anything that arrived meanwhile). Saves the `EAGAIN` read after every message.
    drained: bool,
}

// SAFETY: the raw pointers in `rx` point into regions kept alive by the tracker or
// `_keep`; the hal is used by one thread at a time (`&mut`).
unsafe impl Send for TcpHal {}

fn status_code(s: Status) -> u8 {
    (s != Status::Success) as u8
}
fn code_status(c: u8) -> Status {
    if c == 0 {
        Status::Success
    } else {
        Status::RemoteAccess
    }
}

impl TcpHal {
    /// Picks the next frame to write: responses first, then the front submission.
    fn next_frame(&mut self, t: &mut Tracker) -> Option<TxFrame> {
        if let Some(o) = self.owed.pop_front() {
            let (payload, keep) = match &o.src {
                // SAFETY: the offset was checked against the region by `check_target`.
                Some((r, off)) => (unsafe { r.base().add(*off) } as *const u8, Some(r.clone())),
                None => (std::ptr::null(), None),
            };
            let len = if o.src.is_some() {
                o.hdr.len as usize
            } else {
                0
            };
            return Some(TxFrame {
                hdr: o.hdr.encode(),
                payload,
                len,
                sent: 0,
                token: None,
                _keep: keep,
            });
        }
        // A queued operation cannot be finished behind our back (peers' responses only
        // match operations already sent), but stay total: skip anything not live.
        let (token, p) = loop {
            let token = t.submit_pop()?;
            if let Some(p) = t.get(token) {
                break (token, p);
            }
        };
        let len = p.buf.len();
        let (mut h, payload, plen, awaits) = match p.desc {
            OpDesc::Send => {
                let mut h = FrameHeader::new(FrameKind::Send);
                h.aux0 = p.tag;
                (h, p.buf.as_ptr() as *const u8, len, false)
            }
            OpDesc::Write { key, off } => {
                let mut h = match p.imm {
                    Some(imm) => {
                        let mut h = FrameHeader::new(FrameKind::WriteImm);
                        h.aux0 = imm as u64;
                        h
                    }
                    None => FrameHeader::new(FrameKind::Write),
                };
                h.key = key.key;
                h.offset = off;
                h.region = key.region;
                h.gen = key.gen;
                (h, p.buf.as_ptr() as *const u8, len, true)
            }
            OpDesc::Read { key, off } => {
                let mut h = FrameHeader::new(FrameKind::ReadReq);
                h.key = key.key;
                h.offset = off;
                h.region = key.region;
                h.gen = key.gen;
                (h, std::ptr::null(), 0, true)
            }
            OpDesc::Atomic { key, off, op } => {
                let mut h = FrameHeader::new(FrameKind::AtomicReq);
                h.key = key.key;
                h.offset = off;
                h.region = key.region;
                h.gen = key.gen;
                match op {
                    AtomicOp::CompareSwap { expect, new } => {
                        h.op = 1;
                        h.aux0 = expect;
                        h.aux1 = new;
                    }
                    AtomicOp::FetchAdd { add } => {
                        h.op = 2;
                        h.aux0 = add;
                    }
                }
                (h, std::ptr::null(), 0, true)
            }
            OpDesc::Recv => unreachable!("receives are not submissions"),
        };
        if h.kind != FrameKind::AtomicReq {
            h.len = len as u32;
        }
        h.token = token.0;
        Some(TxFrame {
            hdr: h.encode(),
            payload,
            len: plen,
            sent: 0,
            token: Some((token, awaits)),
            _keep: None,
        })
    }

    /// Writes as much as the socket takes. Returns whether anything moved.
    fn flush(&mut self, t: &mut Tracker) -> Result<bool> {
        let mut moved = false;
        loop {
            if self.tx.is_none() {
                self.tx = self.next_frame(t);
            }
            let Some(f) = self.tx.as_mut() else {
                return Ok(moved);
            };
            let total = FRAME_HEADER + f.len;
            while f.sent < total {
                let n = if f.sent < FRAME_HEADER {
                    // SAFETY: `payload` is valid for `len` bytes (see TxFrame).
                    unsafe { sys::sendv2(self.sock.as_fd(), &f.hdr[f.sent..], f.payload, f.len)? }
                } else {
                    let o = f.sent - FRAME_HEADER;
                    // SAFETY: o < len, so payload + o is valid for len - o bytes.
                    unsafe { sys::sendv2(self.sock.as_fd(), &[], f.payload.add(o), f.len - o)? }
                };
                if n == 0 {
                    return Ok(moved);
                }
                f.sent += n;
                moved = true;
            }
            if let Some((token, awaits)) = f.token {
                if awaits {
                    // Only now may the peer's response match it.
                    t.mark_awaiting(token);
                } else {
                    t.complete(token, Status::Success, f.len, 0);
                }
            }
            self.tx = None;
        }
    }

    /// Reads and dispatches frames; a receive that completes goes into `sink` where it may
    /// ([`Tracker::complete_recv_into`]). Returns whether anything moved.
    fn receive(&mut self, t: &mut Tracker, sink: &mut Sink<'_>) -> Result<bool> {
        let mut moved = false;
        loop {
            if let Rx::Payload {
                dst, left, then, ..
            } = &self.rx
            {
                let (mut d, mut l, then) = (*dst, *left, *then);
                if l > 0 {
                    let avail = self.end - self.start;
                    let mut stop = false;
                    if avail > 0 {
                        let n = avail.min(l);
                        if let Some(p) = d {
                            // SAFETY: `p` has `l` writable bytes (checked when the header
                            // was dispatched); staging[start..start + n] is initialised.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    self.staging.as_ptr().add(self.start),
                                    p,
                                    n,
                                );
                                d = Some(p.add(n));
                            }
                        }
                        self.start += n;
                        l -= n;
                        moved = true;
                    } else if l >= DIRECT_MIN && d.is_some() && !self.eof && !self.drained {
                        let p = d.expect("checked");
                        // SAFETY: `p` has `l` writable bytes.
                        match unsafe { sys::read_raw(self.sock.as_fd(), p, l)? } {
                            None => {
                                self.drained = true;
                                stop = true;
                            }
                            Some(0) => {
                                self.eof = true;
                                stop = true;
                            }
                            Some(n) => {
                                self.drained = n < l;
                                // SAFETY: n <= l.
                                d = Some(unsafe { p.add(n) });
                                l -= n;
                                moved = true;
                            }
                        }
                    } else if !self.fill()? {
                        stop = true;
                    }
                    if let Rx::Payload { dst, left, .. } = &mut self.rx {
                        *dst = d;
                        *left = l;
                    }
                    if stop {
                        return Ok(moved);
                    }
                    continue;
                }
                self.rx = Rx::Header;
                moved = true;
                match then {
                    Then::CompleteRecv(at, len, tag) => {
                        t.complete_recv_into(at, Status::Success, len, tag, None, sink);
                    }
                    Then::StashEnd => t.stash_end(),
                    Then::AckImm(h, to) => {
                        match to {
                            Some((at, imm, len)) => {
                                t.complete_recv(at, Status::Success, len, 0, Some(imm));
                            }
                            None => t.stash_end(),
                        }
                        self.owed.push_back(Owed { hdr: h, src: None });
                    }
                    Then::CompleteRead(tok, len) => {
                        t.complete(tok, Status::Success, len, 0);
                    }
                    Then::Ack(h) => self.owed.push_back(Owed { hdr: h, src: None }),
                    Then::Nothing => {}
                }
                continue;
            }
            match self.rx {
                Rx::Payload { .. } => unreachable!("handled above"),
                Rx::Header => {
                    if self.end - self.start < FRAME_HEADER {
                        if !self.fill()? {
                            return Ok(moved);
                        }
                        continue;
                    }
                    let h = decode_header(&self.staging[self.start..self.start + FRAME_HEADER])?;
                    if !self.dispatch(t, h)? {
                        return Ok(moved); // blocked: no receive posted / responses full
                    }
                    self.start += FRAME_HEADER;
                    moved = true;
                }
            }
        }
    }

    /// Reads more into staging. `Ok(false)` when nothing is available.
    fn fill(&mut self) -> Result<bool> {
        if self.eof || self.drained {
            return Ok(false);
        }
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.staging.len() {
            self.staging.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let room = (self.staging.len() - self.end).min(FILL_MAX);
        // SAFETY: staging[end..] has at least `room` writable bytes.
        match unsafe {
            sys::read_raw(
                self.sock.as_fd(),
                self.staging.as_mut_ptr().add(self.end),
                room,
            )?
        } {
            None => {
                self.drained = true;
                Ok(false)
            }
            Some(0) => {
                self.eof = true;
                Ok(false)
            }
            Some(n) => {
                self.end += n;
                self.drained = n < room;
                Ok(true)
            }
        }
    }

    /// Acts on a header. `Ok(false)` = cannot now (leave it in staging).
    fn dispatch(&mut self, t: &mut Tracker, h: FrameHeader) -> Result<bool> {
        let len = h.len as usize;
        let owes_response = matches!(
            h.kind,
            FrameKind::Write | FrameKind::WriteImm | FrameKind::ReadReq | FrameKind::AtomicReq
        );
        if owes_response && self.owed.len() >= self.owed_cap {
            return Ok(false);
        }
        let proto = |what: &str| Err(Error::Protocol(format!("tcp: {what}")));
        match h.kind {
            FrameKind::Send => {
                let tag = h.aux0;
                let Some(at) = t.match_message(tag) else {
                    // No receive at all: the frame waits on the wire (backpressure).
                    if !t.has_posted_recv() {
                        return Ok(false);
                    }
                    // Receives wait for other tags: queue it so that they can go on (or
                    // wait on the wire while the unexpected queue is full).
                    let Some(dst) = t.stash_begin(tag, None, len, len) else {
                        return Ok(false);
                    };
                    self.rx = Rx::Payload {
                        dst: Some(dst),
                        left: len,
                        then: Then::StashEnd,
                        _keep: None,
                    };
                    return Ok(true);
                };
                let Some(buf) = t.recv_buf(at) else {
                    return proto("receive queue names a finished receive");
                };
                if len > buf.len() {
                    t.complete_recv(at, Status::MessageTooLong, len, tag, None);
                    self.rx = Rx::Payload {
                        dst: None,
                        left: len,
                        then: Then::Nothing,
                        _keep: None,
                    };
                } else {
                    self.rx = Rx::Payload {
                        dst: Some(buf.as_ptr()),
                        left: len,
                        then: Then::CompleteRecv(at, len, tag),
                        _keep: None,
                    };
                }
            }
            FrameKind::Write | FrameKind::WriteImm => {
                let mut ack = FrameHeader::new(FrameKind::WriteAck);
                ack.token = h.token;
                let imm = (h.kind == FrameKind::WriteImm).then_some(h.aux0 as u32);
                match self.domain.check_target(
                    h.region,
                    h.gen,
                    h.key,
                    h.offset,
                    len as u64,
                    Access::REMOTE_WRITE,
                ) {
                    Ok(r) => {
                        let then = match imm {
                            None => Then::Ack(ack),
                            // The notification takes a receive matching tag 0 now (it
                            // completes once the bytes landed), or is queued as unexpected.
                            Some(imm) => match t.match_message(0) {
                                Some(at) => Then::AckImm(ack, Some((at, imm, len))),
                                None if !t.has_posted_recv() => return Ok(false),
                                None => {
                                    if t.stash_begin(0, Some(imm), len, 0).is_none() {
                                        return Ok(false);
                                    }
                                    Then::AckImm(ack, None)
                                }
                            },
                        };
                        // SAFETY: offset + len within the region (check_target).
                        let d = unsafe { r.base().add(h.offset as usize) };
                        self.rx = Rx::Payload {
                            dst: Some(d),
                            left: len,
                            then,
                            _keep: Some(r.clone()),
                        };
                    }
                    Err(st) => {
                        ack.status = status_code(st);
                        self.rx = Rx::Payload {
                            dst: None,
                            left: len,
                            then: Then::Ack(ack),
                            _keep: None,
                        };
                    }
                }
            }
            FrameKind::ReadReq => {
                let mut resp = FrameHeader::new(FrameKind::ReadResp);
                resp.token = h.token;
                match self.domain.check_target(
                    h.region,
                    h.gen,
                    h.key,
                    h.offset,
                    len as u64,
                    Access::REMOTE_READ,
                ) {
                    Ok(r) => {
                        resp.len = h.len;
                        self.owed.push_back(Owed {
                            hdr: resp,
                            src: Some((r.clone(), h.offset as usize)),
                        });
                    }
                    Err(st) => {
                        resp.status = status_code(st);
                        self.owed.push_back(Owed {
                            hdr: resp,
                            src: None,
                        });
                    }
                }
            }
            FrameKind::AtomicReq => {
                let mut resp = FrameHeader::new(FrameKind::AtomicResp);
                resp.token = h.token;
                let r = if !h.offset.is_multiple_of(8) {
                    Err(Status::RemoteAccess)
                } else {
                    self.domain.check_target(
                        h.region,
                        h.gen,
                        h.key,
                        h.offset,
                        8,
                        Access::REMOTE_ATOMIC,
                    )
                };
                let r = r.ok();
                match r.as_ref().map(|r| r.atomic_at(h.offset as usize)) {
                    Some(Ok(a)) => {
                        use std::sync::atomic::Ordering::SeqCst;
                        resp.aux0 = if h.op == 1 {
                            match a.compare_exchange(h.aux0, h.aux1, SeqCst, SeqCst) {
                                Ok(v) | Err(v) => v,
                            }
                        } else {
                            a.fetch_add(h.aux0, SeqCst)
                        };
                    }
                    _ => resp.status = 1,
                }
                self.owed.push_back(Owed {
                    hdr: resp,
                    src: None,
                });
            }
            // Responses are matched only against operations sent in full and waiting
            // (`Tracker::awaiting`): tokens are guessable, and a response naming a queued
            // or half-sent operation must not complete it (its buffer is still in use).
            FrameKind::WriteAck => {
                let tok = Token(h.token);
                match t.awaiting(tok).map(|p| (p.desc, p.buf.len())) {
                    // A write with immediate is an `OpDesc::Write` too.
                    Some((OpDesc::Write { .. }, n)) => {
                        t.complete(tok, code_status(h.status), n, 0);
                    }
                    _ => return proto("write ack for no write awaiting one"),
                }
            }
            FrameKind::ReadResp => {
                let tok = Token(h.token);
                let Some(p) = t.awaiting(tok) else {
                    return proto("read response for no read awaiting one");
                };
                if !matches!(p.desc, OpDesc::Read { .. }) {
                    return proto("read response for no read");
                }
                if h.status != 0 {
                    if len != 0 {
                        return proto("failed read response with data");
                    }
                    t.complete(tok, Status::RemoteAccess, 0, 0);
                } else {
                    if len != p.buf.len() {
                        return proto("read response of the wrong length");
                    }
                    self.rx = Rx::Payload {
                        dst: Some(p.buf.as_ptr()),
                        left: len,
                        then: Then::CompleteRead(tok, len),
                        _keep: None,
                    };
                }
            }
            FrameKind::AtomicResp => {
                let tok = Token(h.token);
                match t.awaiting(tok) {
                    Some(p) if matches!(p.desc, OpDesc::Atomic { .. }) => {
                        if h.status == 0 {
                            let _ = p.buf.copy_from(&h.aux0.to_ne_bytes());
                        }
                        t.complete(tok, code_status(h.status), 8, h.aux0);
                    }
                    _ => return proto("atomic response for no atomic"),
                }
            }
        }
        Ok(true)
    }
}

impl Hal for TcpHal {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn progress(&mut self, t: &mut Tracker) -> Result<()> {
        let mut none = 0;
        self.progress_into(t, &mut [], &mut none)
    }

    /// A full pass; receives that complete go straight into the caller's `out[*n..]`.
    fn progress_into(
        &mut self,
        t: &mut Tracker,
        out: &mut [crate::Completion],
        n: &mut usize,
    ) -> Result<()> {
        let mut sink = Sink::new(out, n);
        if self.epoll_out {
            self.epoll_out = false;
            if let Some(ep) = self.lone_made() {
                sys::epoll_set(ep, self.sock.as_fd(), false, false)?;
            }
        }
        self.drained = false;
        let step = (|| -> Result<()> {
            self.flush(t)?;
            if self.receive(t, &mut sink)? {
                // Responses may have been queued.
                self.flush(t)?;
            }
            Ok(())
        })();
        self.settle(t, step)
    }

    /// A post writes what it queued (one `writev` for a small send) and reads nothing:
    /// incoming frames wait in the socket, whose readability the wait fd reports. Only
    /// a receive posted while bytes already read wait in staging dispatches them now
    /// (nothing else would wake a caller that sleeps after this post).
    fn post_kick(&mut self, t: &mut Tracker, recv: bool) -> Result<()> {
        if recv {
            if self.end > self.start {
                return self.progress(t);
            }
            return Ok(());
        }
        let step = self.flush(t).map(|_| ());
        self.settle(t, step)
    }

    fn wait_fd(&self) -> BorrowedFd<'_> {
        match self.lone() {
            Some(ep) => ep,
            // No fd left for the epoll: `arm` reports it (the socket still tells of data).
            None => self.sock.as_fd(),
        }
    }

    fn watch_fds(&self) -> WatchFds<'_> {
        WatchFds::one(self.sock.as_fd(), self.epoll_out)
    }

    fn attach_worker(&mut self, worker: Option<u64>) -> Option<u64> {
        self.attached = worker.is_some();
        None
    }

    fn arm(&mut self, t: &Tracker) -> Result<bool> {
        if !self.attached && self.lone().is_none() {
            return Err(Error::io(
                "tcp wait fd (epoll_create1)",
                io::Error::other("could not be created (file descriptor limit?)"),
            ));
        }
        let want_out = self.tx.is_some() || !self.owed.is_empty() || t.has_submissions();
        if want_out {
            if let Some(ep) = self.lone_made() {
                sys::epoll_set(ep, self.sock.as_fd(), true, false)?;
            }
            self.epoll_out = true;
        }
        Ok(true)
    }
}

impl TcpHal {
    /// The epoll a lone `wait_fd` sleeps on (made on the first call, watching writability
    /// too if the last `arm` asked for it).
    fn lone(&self) -> Option<BorrowedFd<'_>> {
        self.lone
            .get_or_init(|| {
                let ep = sys::epoll_of(&[self.sock.as_fd()]).ok()?;
                if self.epoll_out {
                    sys::epoll_set(ep.as_fd(), self.sock.as_fd(), true, false).ok()?;
                }
                Some(ep)
            })
            .as_ref()
            .map(|ep| ep.as_fd())
    }

    /// The lone epoll if it was made (a connection in a worker has none).
    fn lone_made(&self) -> Option<BorrowedFd<'_>> {
        self.lone.get()?.as_ref().map(|ep| ep.as_fd())
    }

    /// The end of a pass: end of stream and a peer that went away fail the connection's
    /// operations (`PeerGone`); other errors go to the caller.
    fn settle(&mut self, t: &mut Tracker, step: Result<()>) -> Result<()> {
        match step {
            Ok(()) if !self.eof => Ok(()),
            Ok(()) => {
                t.fail_all(Status::PeerGone, "tcp peer closed the connection");
                Ok(())
            }
            Err(Error::Io { source, .. })
                if matches!(
                    source.kind(),
                    io::ErrorKind::BrokenPipe
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::ConnectionAborted
                ) =>
            {
                t.fail_all(Status::PeerGone, format!("tcp peer went away: {source}"));
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIND: TransportKind = TransportKind::Tcp;

    /// See [`crate::backend::shared_tests::a_receive_posted_after_its_message_arrived_does_not_sleep`].
    #[test]
    fn a_receive_posted_after_its_message_arrived_does_not_sleep() {
        crate::backend::shared_tests::a_receive_posted_after_its_message_arrived_does_not_sleep(
            KIND,
        );
    }

    /// A connected loopback pair under `policy`, with each socket's algorithm.
    fn congestion_of_a_pair(policy: TcpCongestion) -> Result<[String; 2]> {
        let opts = crate::backend::Options {
            tcp_congestion: policy,
            ..Default::default()
        };
        let mut l = crate::backend::listen(KIND, &opts)?;
        let mut c = crate::backend::connect(l.address(), &opts)?;
        let (a, b) =
            crate::backend::loopback(l.as_mut(), c.as_mut(), std::time::Duration::from_secs(10))?;
        let of = |t: &dyn Transport| sys::tcp_congestion(t.watch_fds().as_slice()[0].0);
        Ok([of(a.as_ref())?, of(b.as_ref())?])
    }

    fn host_default() -> String {
        std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
            .expect("net.ipv4.tcp_congestion_control")
            .trim()
            .to_owned()
    }

    #[test]
    fn loopback_connections_leave_a_pacing_default_and_keep_any_other() {
        let host = host_default();
        let got = congestion_of_a_pair(TcpCongestion::UnpacedOnLoopback).unwrap();
        for cc in &got {
            assert_unpaced(cc, &host, "a loopback connection");
        }
        println!("host default {host:?}, loopback connection: {got:?}");
    }

    #[test]
    fn host_policy_keeps_the_default_and_a_named_one_is_used_or_refused_by_name() {
        let host = host_default();
        assert_eq!(
            congestion_of_a_pair(TcpCongestion::Host).unwrap(),
            [host.clone(), host]
        );
        // `reno` is never restricted: any process may choose it.
        assert_eq!(
            congestion_of_a_pair(TcpCongestion::Named("reno".into())).unwrap(),
            ["reno", "reno"]
        );
        let e = congestion_of_a_pair(TcpCongestion::Named("no-such-cc".into())).unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, Error::InvalidArgument(_))
                && msg.contains("\"no-such-cc\"")
                && msg.contains("tcp_allowed_congestion_control"),
            "{msg}"
        );
    }

    /// What the default policy must leave a socket with, given the host's default.
    fn assert_unpaced(cc: &str, host: &str, what: &str) {
        if host.starts_with("bbr") {
            assert!(
                cc == "cubic" || cc == "reno",
                "{what} kept the pacing {cc:?} (host default {host:?})"
            );
        } else {
            assert_eq!(cc, host, "{what}: a non-pacing host default was replaced");
        }
    }

    #[test]
    fn loopback_sockets_are_unpaced_before_they_connect() {
        let host = host_default();
        let policy = TcpCongestion::UnpacedOnLoopback;
        // A loopback listener: the sockets it accepts inherit its algorithm.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        congestion_before_connecting(l.as_fd(), at, &policy).unwrap();
        assert_unpaced(
            &sys::tcp_congestion(l.as_fd()).unwrap(),
            &host,
            "a loopback listener",
        );
        // A socket about to connect to a loopback address: set before `connect`.
        let mut before = None;
        let s = sys::tcp_connect_start(at, |fd| {
            congestion_before_connecting(fd, at, &policy)?;
            before = Some(sys::tcp_congestion(fd)?);
            Ok(())
        })
        .unwrap();
        assert_unpaced(&before.unwrap(), &host, "a socket before connecting");
        drop(s);
        // A listener on every address cannot know its peers: it keeps the host's.
        let any = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        congestion_before_connecting(any.as_fd(), any.local_addr().unwrap(), &policy).unwrap();
        assert_eq!(sys::tcp_congestion(any.as_fd()).unwrap(), host);
        println!("host default {host:?}");
    }

    #[test]
    fn the_environment_names_a_policy() {
        for (v, want) in [
            ("", TcpCongestion::UnpacedOnLoopback),
            (" unpaced-on-loopback ", TcpCongestion::UnpacedOnLoopback),
            ("host", TcpCongestion::Host),
            ("cubic", TcpCongestion::Named("cubic".into())),
        ] {
            assert_eq!(TcpCongestion::parse(v), want, "{v:?}");
        }
    }

    #[test]
    fn only_connections_that_stay_on_this_host_count_as_loopback() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        for (local, peer, same) in [
            ("127.0.0.1", "127.0.0.1", true),
            ("127.0.0.1", "127.0.0.2", true),
            ("::1", "::1", true),
            ("::ffff:127.0.0.1", "::ffff:127.0.0.1", true),
            ("10.0.0.5", "10.0.0.5", true),
            ("::ffff:10.0.0.5", "10.0.0.5", true),
            ("10.0.0.5", "10.0.0.6", false),
            ("fe80::1", "fe80::2", false),
        ] {
            assert_eq!(same_host(ip(local), ip(peer)), same, "{local} -> {peer}");
        }
    }

    #[test]
    fn hellos_decode_and_reject_garbage() {
        let h = Hello::new(Some(b"s".to_vec()), 0).unwrap();
        let (flags, nonce) = decode_hello(&h.out[..HELLO_LEN]).unwrap();
        assert_eq!((flags, nonce), (HELLO_SECRET, h.nonce));
        for (i, v) in [(0usize, 0u8), (8, 2), (12, 1)] {
            let mut b = h.out;
            b[i] = v;
            assert!(
                decode_hello(&b[..HELLO_LEN]).is_err(),
                "byte {i} = {v} accepted"
            );
        }
        assert!(decode_hello(&h.out[..HELLO_LEN - 1]).is_err());
    }

    #[test]
    fn frame_headers_round_trip_and_reject_garbage() {
        let mut h = FrameHeader::new(FrameKind::AtomicReq);
        h.op = 1;
        h.token = 0x1234_5678_9abc;
        h.key = 7;
        h.offset = 64;
        h.region = 3;
        h.gen = 0xdead_beef;
        h.aux0 = 5;
        h.aux1 = 6;
        assert_eq!(decode_header(&h.encode()).unwrap(), h);
        let mut s = FrameHeader::new(FrameKind::Send);
        s.len = 1 << 20;
        assert_eq!(decode_header(&s.encode()).unwrap(), s);

        let mut b = s.encode();
        b[0] = 99;
        assert!(matches!(
            decode_header(&b),
            Err(DecodeError::Invalid { .. })
        ));
        let mut b = h.encode();
        b[3] = 1; // reserved
        assert!(
            matches!(decode_header(&b), Err(DecodeError::Invalid { .. })),
            "reserved byte 3 ignored"
        );
        let mut b = h.encode();
        b[2] = 9; // unknown atomic op
        assert!(decode_header(&b).is_err());
        let mut b = h.encode();
        b[4..8].copy_from_slice(&8u32.to_le_bytes()); // an atomic request with a payload
        assert!(decode_header(&b).is_err());
        let mut b = s.encode();
        b[4..8].copy_from_slice(&u32::MAX.to_le_bytes()); // 4 GiB payload
        assert!(matches!(
            decode_header(&b),
            Err(DecodeError::TooLong { .. })
        ));
        assert!(matches!(
            decode_header(&b[..10]),
            Err(DecodeError::Truncated { .. })
        ));
        // Any bytes: a typed result, never a panic.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..10_000 {
            let mut g = [0u8; FRAME_HEADER];
            for c in g.chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
            }
            let _ = decode_header(&g);
        }
    }
}
