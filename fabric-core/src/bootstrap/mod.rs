//! Out-of-band bootstrap: a TCP rendezvous where N ranks exchange versioned,
//! length-limited endpoint blobs (an all-gather through rank 0), rank/size discovery from
//! the usual launchers, and [`pair`] — the two-party setup the examples use, which picks a
//! transport (same host → shm; RDMA on both → verbs; else tcp; overridable) and connects.
//!
//! The server binds loopback unless told otherwise, serves connections concurrently on
//! non-blocking sockets under one `poll`, each with its own deadline, validates each frame
//! header (type, version, reserved byte, per-type length limit) before buffering its
//! payload, refuses malformed, truncated, oversized or unauthenticated peers (HMAC-SHA256
//! challenge–response, [`auth`]) with a typed error (sent back as an `Error` frame when
//! possible) and keeps serving the others. It sends the table to every rank at once and
//! waits for each to confirm it; what a rank lost on the way means is spelled out on
//! [`Server`]. 1,000 ranks in one process complete in 1–4 s on loopback on a loaded 2-core
//! host (`tests/fabric_bootstrap.rs`).

pub mod auth;
pub mod launcher;
pub mod mesh;
pub mod wire;

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd};
use std::time::{Duration, Instant};

use crate::backend::{self, Options};
use crate::error::{Error, Result};
use crate::transport::{Transport, TransportKind};
use wire::{
    Challenge, EndpointInfo, FrameType, Hello, Lost, PeerEntry, HEADER_LEN, MAC_LEN, NONCE_LEN,
};

pub use launcher::{Launch, Launcher};
pub use mesh::{connect_mesh, mesh_from_launch, Mesh, MeshOptions, Rendezvous};

/// Per-connection deadline of the rendezvous server: a handshake must complete within it
/// of its accept. (Receiving and confirming the table has the run's timeout, at least
/// this.)
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Most handshakes the server runs at once. Further connections wait in the listen backlog
/// until one finishes (they are not dropped for it): at worst a flood of silent
/// connections delays the others by one [`IO_TIMEOUT`] per `MAX_PENDING` of them.
pub const MAX_PENDING: usize = 1024;

/// Open files the server leaves for the rest of the process beyond one per rank.
pub const FD_HEADROOM: u64 = 256;

/// The listen backlog the server asks for (the kernel caps it at `net.core.somaxconn`,
/// 4096 by default since Linux 5.4): 1,000 ranks connecting at once are queued, not
/// dropped into SYN retries.
pub const LISTEN_BACKLOG: i32 = 4096;

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
/// [`Error::Bootstrap`] when the peer sent an `Error` frame, [`Error::RanksLost`] when it
/// sent a `Lost` frame.
pub fn read_frame(s: &mut TcpStream) -> Result<(FrameType, Vec<u8>)> {
    read_frame_of(s, None)
}

/// Reads one frame that must be of type `want` (or an `Error` / `Lost` frame): the header
/// is validated — magic, version, reserved byte, type, the type's length limit — before
/// the payload is allocated, so a peer cannot make us allocate a large frame of a type we
/// do not expect.
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
        if !matches!(t, FrameType::Error | FrameType::Lost) {
            expect(t, want)?;
        }
    }
    let mut p = vec![0u8; len];
    s.read_exact(&mut p).map_err(io_err("bootstrap read"))?;
    match t {
        FrameType::Error => Err(Error::Bootstrap(format!(
            "peer refused: {}",
            String::from_utf8_lossy(&p)
        ))),
        FrameType::Lost => {
            let l = Lost::decode(&p)?;
            Err(Error::RanksLost {
                ranks: l.ranks,
                reason: l.reason,
            })
        }
        _ => Ok((t, p)),
    }
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
///
/// # What a lost rank means
///
/// - A rank that joined and hangs up *before the table is sent* gives its slot back: a
///   well-formed rank may still take it (a restarted process, say). If no one has by the
///   deadline, the run fails with [`Error::RanksLost`] naming it, and every rank still
///   waiting gets the same error (a `Lost` frame, listing up to 1,024 of them) instead of
///   a bare hang-up.
/// - The table goes to every rank at once (non-blocking sockets under one `poll`), and a
///   rank counts as served only when it *confirms* the complete table (an `Ack` frame,
///   which [`join`] sends before it returns). A rank that confirmed and then exits fails
///   no one. A rank that vanishes before confirming (its connection breaks), or has not
///   confirmed when the run's timeout (counted again from the start of the send, at least
///   [`IO_TIMEOUT`]) has passed, does not stop the others from being served; when all are
///   done the run returns [`Error::RanksLost`] naming it.
#[derive(Debug)]
pub struct Server {
    listener: TcpListener,
    size: u32,
    secret: Option<Vec<u8>>,
    /// Peers refused so far, with the reason (for logs and tests).
    pub refused: Vec<String>,
}

/// A rank whose hello was accepted, waiting for the table.
#[derive(Debug)]
struct Joined {
    s: TcpStream,
    entry: PeerEntry,
}

/// How many per-rank reasons an error text spells out (the rank list is complete).
const REASONS_SHOWN: usize = 16;

/// How many lost ranks the `Lost` frame to waiting ranks lists (the text says how many
/// more): the frame stays within 5 KiB, which a fresh socket's send buffer takes whole, so
/// the never-blocking send does not cut it short.
const LOST_LISTED: usize = 1024;

fn ranks_lost(mut lost: Vec<(u32, String)>) -> Error {
    lost.sort_by_key(|l| l.0);
    let mut reason = lost
        .iter()
        .take(REASONS_SHOWN)
        .map(|(r, why)| format!("rank {r} {why}"))
        .collect::<Vec<_>>()
        .join("; ");
    if lost.len() > REASONS_SHOWN {
        reason.push_str(&format!("; and {} more", lost.len() - REASONS_SHOWN));
    }
    Error::RanksLost {
        ranks: lost.into_iter().map(|l| l.0).collect(),
        reason,
    }
}

/// Best effort, never blocking: tells a peer why the run ends.
fn tell(s: &mut TcpStream, t: FrameType, payload: &[u8]) {
    let mut v = wire::encode_header(t, payload.len()).to_vec();
    v.extend_from_slice(payload);
    let _ = s.write(&v);
}

impl Server {
    /// Binds `addr` (use `127.0.0.1:PORT` unless other hosts must reach it), with a listen
    /// backlog of [`LISTEN_BACKLOG`].
    ///
    /// The server holds one socket per rank until the table is confirmed, so it raises the
    /// process's soft limit on open files to `size +` [`FD_HEADROOM`] where that is below
    /// (as far as the hard limit allows; a 1,000-rank job would otherwise hit the usual
    /// soft limit of 1,024). If the hard limit is lower, accepting fails with a typed error
    /// that says so.
    ///
    /// # Errors
    /// [`Error::Io`] when the address cannot be bound; [`Error::InvalidArgument`] for
    /// `size == 0`.
    pub fn bind(addr: &str, size: u32, secret: Option<&[u8]>) -> Result<Self> {
        if size == 0 {
            return Err(Error::InvalidArgument("world size 0".into()));
        }
        crate::sys::raise_nofile_limit(u64::from(size) + FD_HEADROOM)?;
        let listener = TcpListener::bind(addr).map_err(io_err("bootstrap bind"))?;
        crate::sys::set_listen_backlog(listener.as_fd(), LISTEN_BACKLOG)?;
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

    /// Serves until ranks `1..size` have joined, sends them the table and waits for each to
    /// confirm it; returns the table (rank 0's entry holds `blob`). Bad peers are refused
    /// and do not count (see [`Server`] for what a lost rank means).
    ///
    /// Everything runs on non-blocking sockets under one `poll`: connections are served
    /// concurrently, each with its own deadline ([`IO_TIMEOUT`] to complete its hello), so a
    /// slow or silent client holds up no one; the table goes to all ranks at once.
    ///
    /// # Errors
    /// [`Error::RanksLost`] when not every rank joined within `timeout` (naming the missing
    /// ones), or when ranks vanished or stalled before confirming the table (naming them;
    /// every other rank was served); [`Error::Bootstrap`] when the table exceeds
    /// [`wire::MAX_TABLE`]; [`Error::Io`] when the listener or `poll` fails.
    pub fn run(&mut self, blob: &[u8], timeout: Duration) -> Result<Vec<PeerEntry>> {
        let start = Instant::now();
        self.listener
            .set_nonblocking(true)
            .map_err(io_err("fcntl(O_NONBLOCK)"))?;
        let mut joined = self.gather(start + timeout)?;
        let mut table = vec![PeerEntry {
            rank: 0,
            ip: String::new(),
            blob: blob.to_vec(),
        }];
        table.extend(joined.iter().map(|j| j.entry.clone()));
        let payload = wire::encode_table(&table);
        if payload.len() > wire::MAX_TABLE {
            let why = format!(
                "the table of {} ranks is {} bytes, above the limit of {}",
                table.len(),
                payload.len(),
                wire::MAX_TABLE
            );
            for j in &mut joined {
                tell(&mut j.s, FrameType::Error, why.as_bytes());
            }
            return Err(Error::Bootstrap(why));
        }
        let mut frame = wire::encode_header(FrameType::Table, payload.len()).to_vec();
        frame.extend_from_slice(&payload);
        drop(payload);
        let lost = distribute(joined, &frame, Instant::now() + timeout.max(IO_TIMEOUT))?;
        if !lost.is_empty() {
            return Err(ranks_lost(lost));
        }
        Ok(table)
    }

    /// The all-gather: accepts and authenticates ranks until `1..size` have joined.
    fn gather(&mut self, end: Instant) -> Result<Vec<Joined>> {
        let n = self.size as usize;
        let mut joined: Vec<Option<Joined>> = (0..n).map(|_| None).collect();
        let mut left: Vec<Option<String>> = vec![None; n];
        let mut pending: Vec<Handshake> = Vec::new();
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut missing = n - 1;
        // What the last poll said: the listener, then `pending[..polled]`, then the joined
        // ranks `polled_ranks`.
        let mut listener_ready = true;
        let mut polled = 0;
        let mut polled_ranks: Vec<usize> = Vec::new();
        loop {
            // Handshakes in progress (only those the poll woke, or new ones).
            let now = Instant::now();
            let old = std::mem::take(&mut pending);
            for (i, mut h) in old.into_iter().enumerate() {
                let woke = i >= polled || fds[1 + i].revents != 0;
                match if woke { h.step() } else { Ok(None) } {
                    Ok(None) if now < h.deadline => pending.push(h),
                    Ok(None) => self.refuse(h, "timed out before completing its hello".into()),
                    Ok(Some(hello)) => match self.check(&hello, &h.nonce, &joined) {
                        Ok(()) => {
                            let r = hello.rank as usize;
                            let entry = PeerEntry {
                                rank: hello.rank,
                                ip: h.from.ip().to_string(),
                                blob: hello.blob,
                            };
                            joined[r] = Some(Joined { s: h.s, entry });
                            left[r] = None;
                            missing -= 1;
                        }
                        Err(e) => self.refuse(h, e.to_string()),
                    },
                    Err(e) => self.refuse(h, e.to_string()),
                }
            }
            // Joined ranks that hung up (or spoke out of turn) give their slot back.
            for (k, &r) in polled_ranks.iter().enumerate() {
                if fds[1 + polled + k].revents != 0 {
                    let Some(j) = joined[r].as_mut() else {
                        continue;
                    };
                    if let Some(why) = gone(&mut j.s) {
                        let what = format!(
                            "joined from {}, then left before the table was sent ({why})",
                            j.entry.ip
                        );
                        self.refused.push(format!("rank {r} {what}"));
                        left[r] = Some(what);
                        joined[r] = None;
                        missing += 1;
                    }
                }
            }
            // New connections (at most MAX_PENDING handshakes at once; the rest wait in
            // the backlog). Their challenge goes out as soon as the poll says writable.
            while listener_ready && pending.len() < MAX_PENDING {
                match self.listener.accept() {
                    Ok((s, from)) => match Handshake::start(s, from, self.secret.is_some()) {
                        Ok(h) => pending.push(h),
                        Err(e) => self.refused.push(format!("{from}: {e}")),
                    },
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                        let (soft, hard) = crate::sys::raise_nofile_limit(0).unwrap_or((0, 0));
                        return Err(Error::Bootstrap(format!(
                            "out of file descriptors with {} of {} ranks joined ({e}): the \
                             server holds one socket per rank; raise the open-file limit \
                             (`ulimit -n`; now {soft}, hard limit {hard}) to at least {}",
                            n - 1 - missing,
                            n - 1,
                            n as u64 + FD_HEADROOM
                        )));
                    }
                    Err(e) => return Err(Error::io("bootstrap accept", e)),
                }
            }
            if missing == 0 {
                // Late or surplus handshakes are closed (their peers see a hang-up).
                return Ok(joined.into_iter().skip(1).flatten().collect());
            }
            let now = Instant::now();
            if now >= end {
                let mut lost = Vec::new();
                for r in 1..n {
                    if joined[r].is_none() {
                        let why = left[r].take().unwrap_or_else(|| "never joined".into());
                        lost.push((r as u32, why));
                    }
                }
                let err = ranks_lost(lost);
                if let Error::RanksLost { ranks, reason } = &err {
                    let msg = Lost {
                        ranks: ranks[..ranks.len().min(LOST_LISTED)].to_vec(),
                        reason: reason.clone(),
                    }
                    .encode();
                    for j in joined.iter_mut().flatten() {
                        tell(&mut j.s, FrameType::Lost, &msg);
                    }
                }
                for h in pending {
                    self.refuse(h, "the rendezvous ended: not every rank joined".into());
                }
                return Err(err);
            }
            // Wait for the next event (or the nearest deadline).
            let next = pending.iter().map(|h| h.deadline).fold(end, Instant::min);
            fds.clear();
            fds.push(libc::pollfd {
                fd: self.listener.as_raw_fd(),
                events: if pending.len() < MAX_PENDING {
                    libc::POLLIN
                } else {
                    0
                },
                revents: 0,
            });
            fds.extend(pending.iter().map(|h| libc::pollfd {
                fd: h.s.as_raw_fd(),
                events: if h.out_done < h.out.len() {
                    libc::POLLOUT
                } else {
                    libc::POLLIN
                },
                revents: 0,
            }));
            polled = pending.len();
            // Only ranks that joined: `nfds` above the open-file limit is EINVAL.
            polled_ranks.clear();
            for (r, j) in joined.iter().enumerate() {
                if let Some(j) = j {
                    polled_ranks.push(r);
                    fds.push(libc::pollfd {
                        fd: j.s.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    });
                }
            }
            let wait = next
                .saturating_duration_since(now)
                .clamp(Duration::from_millis(1), Duration::from_secs(1));
            crate::sys::poll_fds(&mut fds, wait)?;
            listener_ready = fds[0].revents != 0;
        }
    }

    /// Checks a complete hello against the secret, the world size and the taken ranks.
    fn check(&self, h: &Hello, nonce: &[u8; NONCE_LEN], joined: &[Option<Joined>]) -> Result<()> {
        if let Some(secret) = &self.secret {
            if !auth::verify(auth::Purpose::Bootstrap, secret, nonce, h.rank, &h.mac) {
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
        tell(&mut h.s, FrameType::Error, msg);
        self.refused.push(format!("{}: {why}", h.from));
    }
}

/// One rank receiving the table: the frame going out, then its `Ack` coming in.
#[derive(Debug)]
struct Delivery {
    s: TcpStream,
    rank: u32,
    sent: usize,
    ack: [u8; HEADER_LEN],
    ack_got: usize,
}

impl Delivery {
    /// Moves on without blocking: `Ok(true)` once the rank confirmed the table, `Ok(false)`
    /// for "not yet", `Err(what happened)` when it is lost.
    fn advance(&mut self, frame: &[u8]) -> std::result::Result<bool, String> {
        let lost = |sent: usize, e: &dyn std::fmt::Display| {
            format!(
                "vanished before receiving the table ({sent} of {} bytes sent): {e}",
                frame.len()
            )
        };
        while self.sent < frame.len() {
            match self.s.write(&frame[self.sent..]) {
                Ok(0) => return Err(lost(self.sent, &"the socket took nothing")),
                Ok(k) => self.sent += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(lost(self.sent, &e)),
            }
        }
        while self.ack_got < HEADER_LEN {
            match self.s.read(&mut self.ack[self.ack_got..]) {
                Ok(0) => {
                    return Err("hung up before confirming the table (it may not have \
                                received all of it)"
                        .into())
                }
                Ok(k) => self.ack_got += k,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("vanished before confirming the table: {e}")),
            }
        }
        match wire::decode_header(&self.ack) {
            Ok((FrameType::Ack, 0)) => Ok(true),
            Ok((t, _)) => Err(format!("answered the table with {t:?} instead of an Ack")),
            Err(e) => Err(format!("answered the table with a bad frame: {e}")),
        }
    }
}

/// Sends `frame` to every joined rank at once and collects their confirmations. Returns
/// the ranks lost on the way: those whose connection broke (at once: the kernel says so)
/// and those not done by `deadline` (alive but not reading, or a host gone silent); the
/// others are served whatever happens to those.
///
/// The deadline is the run's whole timeout, not a short per-step one: on a loaded machine
/// (1,000 ranks on a few cores, or an emulated guest) a healthy rank can take many seconds
/// between its last byte and its confirmation, and calling it lost would fail the run.
fn distribute(joined: Vec<Joined>, frame: &[u8], deadline: Instant) -> Result<Vec<(u32, String)>> {
    let mut live: Vec<Delivery> = joined
        .into_iter()
        .map(|j| Delivery {
            s: j.s,
            rank: j.entry.rank,
            sent: 0,
            ack: [0; HEADER_LEN],
            ack_got: 0,
        })
        .collect();
    let mut lost = Vec::new();
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(live.len());
    let mut first = true;
    while !live.is_empty() {
        if !first {
            fds.clear();
            fds.extend(live.iter().map(|d| libc::pollfd {
                fd: d.s.as_raw_fd(),
                events: if d.sent < frame.len() {
                    libc::POLLOUT
                } else {
                    libc::POLLIN
                },
                revents: 0,
            }));
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .clamp(Duration::from_millis(1), Duration::from_secs(1));
            crate::sys::poll_fds(&mut fds, wait)?;
        }
        let now = Instant::now();
        let old = std::mem::take(&mut live);
        for (i, mut d) in old.into_iter().enumerate() {
            let woke = first || fds[i].revents != 0;
            match if woke { d.advance(frame) } else { Ok(false) } {
                Ok(true) => {} // served: the socket closes here
                Ok(false) if now < deadline => live.push(d),
                Ok(false) => {
                    let what = if d.sent < frame.len() {
                        format!(
                            "stalled receiving the table ({} of {} bytes taken)",
                            d.sent,
                            frame.len()
                        )
                    } else {
                        "was sent the whole table but did not confirm it in time".into()
                    };
                    lost.push((d.rank, what));
                }
                Err(what) => lost.push((d.rank, what)),
            }
        }
        first = false;
    }
    Ok(lost)
}

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

/// Joins the rendezvous at `server` as `rank` of `size`; returns every rank's entry, after
/// confirming it to the server. Retries the connection until `timeout` (the server may
/// start later).
///
/// # Errors
/// [`Error::Timeout`], [`Error::Bootstrap`] (refused: wrong secret, rank taken, ...),
/// [`Error::RanksLost`] when the server gave up because other ranks never joined (naming
/// them), [`Error::Decode`] for a malformed answer (or a server of another protocol
/// version: [`DecodeError::Version`](crate::DecodeError::Version)).
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
        (Some(sec), _) => auth::answer(auth::Purpose::Bootstrap, sec, &ch.nonce, rank),
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
    // Confirm: the server counts this rank as served only now. If the confirmation cannot
    // be sent, the server will report this rank lost, so this rank fails too.
    write_frame(&mut s, FrameType::Ack, &[])?;
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
