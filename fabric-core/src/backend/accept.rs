//! Connection setup shared by every backend: the accept engine behind each listener, the
//! connect engine behind each connector, and the socket addresses they use.
//!
//! A backend supplies only its handshake (a [`Handshake`]: what it says first, what it
//! waits for, how the connection is built once both sides spoke); the engines own the
//! socket work and the policy:
//!
//! * [`AcceptQueue`] drains the listening socket (`WouldBlock` ends the pass, `EINTR` is
//!   retried, any other error is the listener's own and fails `accept`), starts a handshake
//!   on every new stream, steps every pending one and returns the first that finished. A
//!   handshake that fails (a stranger, garbage, a hang-up, a failing setup) or is still
//!   unfinished at its deadline ([`Options::handshake_timeout`](super::Options) after it
//!   started) is dropped alone: the listener keeps serving everyone else.
//! * [`Connecting`] waits for a non-blocking connect (TCP), then steps the handshake; each
//!   phase has its own deadline, and a connector hands out one connection only.
//! * [`bind_abstract`] / [`connect_abstract`] name Unix sockets in the abstract namespace
//!   (`@name`: nothing on the file system); [`bind_tcp`] / [`dial_tcp`] do the TCP side.

use std::fmt;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::BorrowedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{self, UnixListener, UnixStream};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::sys;

/// A listening socket the [`AcceptQueue`] drains (set non-blocking by its maker).
pub(crate) trait ListenSocket {
    /// What an accepted connection is.
    type Stream;
    /// The call named in the error when accepting fails (e.g. `accept(unix)`).
    const ACCEPT: &'static str;
    /// One pending connection (`WouldBlock` when there is none).
    fn accept_stream(&self) -> io::Result<Self::Stream>;
}

impl ListenSocket for UnixListener {
    type Stream = UnixStream;
    const ACCEPT: &'static str = "accept(unix)";
    fn accept_stream(&self) -> io::Result<UnixStream> {
        self.accept().map(|(s, _)| s)
    }
}

impl ListenSocket for TcpListener {
    type Stream = TcpStream;
    const ACCEPT: &'static str = "accept(tcp)";
    fn accept_stream(&self) -> io::Result<TcpStream> {
        self.accept().map(|(s, _)| s)
    }
}

/// One side of a backend's connection handshake over a stream `S`, driven without
/// blocking by an [`AcceptQueue`] (listener side) or a [`Connecting`] (connector side).
pub(crate) trait Handshake<S>: Sized {
    /// What every step is given (a backend's [`Domain`](crate::Domain)).
    type Ctx: ?Sized;
    /// What a finished handshake gives (a backend's connection).
    type Output;
    /// Begins on a stream just accepted or connected (e.g. checks the peer, sends this
    /// side's hello).
    ///
    /// # Errors
    /// The peer is refused or the setup failed (the listener drops only this peer).
    fn start(stream: S, ctx: &Self::Ctx) -> Result<Self>;
    /// Moves on without blocking: `Ok(true)` once everything the peer must say arrived.
    ///
    /// # Errors
    /// The peer hung up, said something wrong, or the socket failed.
    fn step(&mut self, ctx: &Self::Ctx) -> Result<bool>;
    /// Builds the connection once [`step`](Self::step) said it is done.
    ///
    /// # Errors
    /// Building it failed.
    fn establish(self, ctx: &Self::Ctx) -> Result<Self::Output>;
}

/// A started handshake and when it must be done.
struct Pending<H> {
    handshake: H,
    deadline: Instant,
}

/// The accept engine: a non-blocking listening socket and the handshakes in progress on
/// the streams it accepted (see the [module docs](self) for the policy).
pub(crate) struct AcceptQueue<L, H> {
    sock: L,
    pending: Vec<Pending<H>>,
    timeout: Duration,
}

impl<L, H> AcceptQueue<L, H> {
    /// Handshakes in progress.
    fn pending(&self) -> usize {
        self.pending.len()
    }
}

impl<L: fmt::Debug, H> fmt::Debug for AcceptQueue<L, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AcceptQueue")
            .field("sock", &self.sock)
            .field("pending", &self.pending())
            .field("timeout", &self.timeout)
            .finish()
    }
}

impl<L: ListenSocket, H: Handshake<L::Stream>> AcceptQueue<L, H> {
    /// Serves `sock` (already listening and non-blocking); each handshake gets `timeout`.
    pub(crate) fn new(sock: L, timeout: Duration) -> Self {
        AcceptQueue {
            sock,
            pending: Vec::new(),
            timeout,
        }
    }

    /// Accepts what waits on the socket, moves every handshake on, and returns the first
    /// finished connection (`None`: none yet). Failed and overdue handshakes are dropped.
    ///
    /// # Errors
    /// Only when the listening socket fails ([`Error::Io`] naming [`ListenSocket::ACCEPT`]).
    pub(crate) fn accept(&mut self, ctx: &H::Ctx) -> Result<Option<H::Output>> {
        loop {
            match self.sock.accept_stream() {
                Ok(stream) => {
                    // A stranger or a failing setup is dropped here; keep serving.
                    if let Ok(handshake) = H::start(stream, ctx) {
                        self.pending.push(Pending {
                            handshake,
                            deadline: Instant::now() + self.timeout,
                        });
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::io(L::ACCEPT, e)),
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            let p = &mut self.pending[i];
            match p.handshake.step(ctx) {
                Ok(true) => {
                    let p = self.pending.swap_remove(i);
                    // A connection that cannot be built is one more failed peer.
                    if let Ok(out) = p.handshake.establish(ctx) {
                        return Ok(Some(out));
                    }
                }
                Ok(false) if Instant::now() < p.deadline => i += 1,
                // Timed out, hung up or spoke garbage: drop this peer only.
                Ok(false) | Err(_) => {
                    self.pending.swap_remove(i);
                }
            }
        }
        Ok(None)
    }
}

/// A stream whose connect may still be in progress.
pub(crate) trait Dialed {
    /// `Ok(true)` once connected.
    ///
    /// # Errors
    /// The connect failed.
    fn connected(&self) -> Result<bool>;
}

impl Dialed for TcpStream {
    fn connected(&self) -> Result<bool> {
        sys::connect_finished(self)
    }
}

impl Dialed for UnixStream {
    /// Unix sockets connect at once ([`connect_abstract`]).
    fn connected(&self) -> Result<bool> {
        Ok(true)
    }
}

enum Phase<S, H> {
    Dialing(S),
    Handshaking(H),
    Done,
}

/// The connect engine: a connect in progress, then the handshake, each with its deadline.
pub(crate) struct Connecting<S, H> {
    phase: Phase<S, H>,
    deadline: Instant,
    timeout: Duration,
    /// The [`Error::Timeout`] of each phase (connect, handshake).
    what: [&'static str; 2],
}

impl<S, H> fmt::Debug for Connecting<S, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let phase = match self.phase {
            Phase::Dialing(_) => "connecting",
            Phase::Handshaking(_) => "handshake",
            Phase::Done => "done",
        };
        f.debug_struct("Connecting")
            .field("phase", &phase)
            .field("deadline", &self.deadline)
            .finish()
    }
}

impl<S: Dialed, H: Handshake<S>> Connecting<S, H> {
    /// Waits for `stream`'s connect (at most `timeout`, else `Error::Timeout(what[0])`),
    /// then runs the handshake (at most `timeout` again, else `Error::Timeout(what[1])`).
    pub(crate) fn dial(stream: S, timeout: Duration, what: [&'static str; 2]) -> Self {
        Connecting {
            phase: Phase::Dialing(stream),
            deadline: Instant::now() + timeout,
            timeout,
            what,
        }
    }

    /// Starts the handshake on a connected `stream` now.
    ///
    /// # Errors
    /// [`Handshake::start`]'s.
    pub(crate) fn connected(
        stream: S,
        ctx: &H::Ctx,
        timeout: Duration,
        what: &'static str,
    ) -> Result<Self> {
        Ok(Connecting {
            phase: Phase::Handshaking(H::start(stream, ctx)?),
            deadline: Instant::now() + timeout,
            timeout,
            what: [what, what],
        })
    }

    /// Moves on: the connection once the handshake finished, `None` before.
    ///
    /// # Errors
    /// The connect or the handshake failed or ran past its deadline; the connection was
    /// already handed out.
    pub(crate) fn poll(&mut self, ctx: &H::Ctx) -> Result<Option<H::Output>> {
        loop {
            match std::mem::replace(&mut self.phase, Phase::Done) {
                Phase::Dialing(s) => {
                    let ready = s.connected();
                    if !matches!(ready, Ok(true)) {
                        self.phase = Phase::Dialing(s);
                        ready?;
                        return self.not_yet(0);
                    }
                    self.phase = Phase::Handshaking(H::start(s, ctx)?);
                    self.deadline = Instant::now() + self.timeout;
                }
                Phase::Handshaking(mut h) => {
                    let done = h.step(ctx);
                    if matches!(done, Ok(true)) {
                        return h.establish(ctx).map(Some);
                    }
                    self.phase = Phase::Handshaking(h);
                    done?;
                    return self.not_yet(1);
                }
                Phase::Done => {
                    return Err(Error::InvalidArgument("connector already finished".into()))
                }
            }
        }
    }

    fn not_yet(&self, phase: usize) -> Result<Option<H::Output>> {
        if Instant::now() > self.deadline {
            return Err(Error::Timeout(self.what[phase]));
        }
        Ok(None)
    }
}

/// Binds a fresh abstract-namespace Unix socket, `fabric-<tag>-<pid>-<random hex>`,
/// non-blocking; returns it and its name (the address is `@name`).
///
/// # Errors
/// [`Error::Io`] when the socket cannot be bound.
pub(crate) fn bind_abstract(tag: &str) -> Result<(UnixListener, String)> {
    let mut rnd = [0u8; 8];
    sys::random_bytes(&mut rnd)?;
    let name = format!(
        "fabric-{tag}-{}-{:016x}",
        std::process::id(),
        u64::from_le_bytes(rnd)
    );
    let addr = net::SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| Error::io("unix socket address", e))?;
    let sock = UnixListener::bind_addr(&addr).map_err(|e| Error::io("bind(unix)", e))?;
    sock.set_nonblocking(true)
        .map_err(|e| Error::io("fcntl(O_NONBLOCK)", e))?;
    Ok((sock, name))
}

/// Connects to `@name` (a `backend` address without its prefix).
///
/// # Errors
/// [`Error::InvalidArgument`] without the `@`; [`Error::Io`] when nobody listens there.
pub(crate) fn connect_abstract(address: &str, backend: &str) -> Result<UnixStream> {
    let name = address.strip_prefix('@').ok_or_else(|| {
        Error::InvalidArgument(format!("{backend} address {address:?} must start with '@'"))
    })?;
    let addr = net::SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| Error::io("unix socket address", e))?;
    UnixStream::connect_addr(&addr).map_err(|e| Error::io("connect(unix)", e))
}

/// Binds `bind` (e.g. `127.0.0.1:0`), non-blocking; returns it and its address.
///
/// # Errors
/// [`Error::Io`] when the address cannot be bound.
pub(crate) fn bind_tcp(bind: &str) -> Result<(TcpListener, SocketAddr)> {
    let sock = TcpListener::bind(bind).map_err(|e| Error::io("bind(tcp)", e))?;
    sock.set_nonblocking(true)
        .map_err(|e| Error::io("fcntl(O_NONBLOCK)", e))?;
    let a = sock.local_addr().map_err(|e| Error::io("getsockname", e))?;
    Ok((sock, a))
}

/// Resolves `HOST:PORT` (a `backend` address without its prefix) and starts a
/// non-blocking connect to its first address; `prepare` sees the socket and that address
/// before the connect.
///
/// # Errors
/// [`Error::InvalidArgument`] for an address that does not resolve; [`Error::Io`];
/// `prepare`'s error.
pub(crate) fn dial_tcp(
    address: &str,
    backend: &str,
    prepare: impl FnOnce(BorrowedFd<'_>, SocketAddr) -> Result<()>,
) -> Result<TcpStream> {
    let addr: SocketAddr = address
        .to_socket_addrs()
        .map_err(|e| Error::InvalidArgument(format!("{backend} address {address:?}: {e}")))?
        .next()
        .ok_or_else(|| {
            Error::InvalidArgument(format!("{backend} address {address:?} resolves to nothing"))
        })?;
    sys::tcp_connect_start(addr, |fd| prepare(fd, addr))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    /// A stream the test handshake runs on.
    trait Duplex: Read + Write {
        fn nonblocking(&self) -> io::Result<()>;
    }
    impl Duplex for UnixStream {
        fn nonblocking(&self) -> io::Result<()> {
            self.set_nonblocking(true)
        }
    }
    impl Duplex for TcpStream {
        fn nonblocking(&self) -> io::Result<()> {
            self.set_nonblocking(true)
        }
    }

    /// What the test handshake is told to do wrong.
    #[derive(Default)]
    struct Script {
        /// Starts still to refuse (as a stranger of another uid is).
        refuse_starts: AtomicUsize,
        /// Finished handshakes still to fail building their connection.
        fail_establish: AtomicUsize,
    }

    fn take_one(n: &AtomicUsize) -> bool {
        n.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1))
            .is_ok()
    }

    /// The test handshake: this side says `hi`, the peer answers `ok` and its id (`u16`).
    struct Ping<S> {
        s: S,
        got: Vec<u8>,
    }

    impl<S: Duplex> Handshake<S> for Ping<S> {
        type Ctx = Script;
        type Output = (u16, S);
        fn start(mut s: S, ctx: &Script) -> Result<Self> {
            if take_one(&ctx.refuse_starts) {
                return Err(Error::PeerUid { peer: 1, ours: 0 });
            }
            s.write_all(b"hi").map_err(|e| Error::io("hi", e))?;
            s.nonblocking().map_err(|e| Error::io("fcntl", e))?;
            Ok(Ping { s, got: Vec::new() })
        }
        fn step(&mut self, _: &Script) -> Result<bool> {
            let mut b = [0u8; 4];
            while self.got.len() < 4 {
                match self.s.read(&mut b[..4 - self.got.len()]) {
                    Ok(0) => return Err(Error::Disconnected("peer hung up".into())),
                    Ok(n) => self.got.extend_from_slice(&b[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                    Err(e) => return Err(Error::io("read", e)),
                }
            }
            if &self.got[..2] != b"ok" {
                return Err(Error::Protocol("garbage".into()));
            }
            Ok(true)
        }
        fn establish(self, ctx: &Script) -> Result<(u16, S)> {
            if take_one(&ctx.fail_establish) {
                return Err(Error::Protocol("cannot build".into()));
            }
            Ok((u16::from_le_bytes([self.got[2], self.got[3]]), self.s))
        }
    }

    type Queue = AcceptQueue<UnixListener, Ping<UnixStream>>;

    fn listen(timeout: Duration) -> (Queue, String) {
        let (sock, name) = bind_abstract("test").expect("bind");
        (AcceptQueue::new(sock, timeout), format!("@{name}"))
    }

    fn peer(addr: &str) -> UnixStream {
        let s = connect_abstract(addr, "test").expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        s
    }

    /// A peer whose handshake the listener started (so its `hi` is on the way).
    fn started_peer(q: &mut Queue, ctx: &Script, addr: &str) -> UnixStream {
        let s = peer(addr);
        assert!(q.accept(ctx).expect("accept").is_none());
        s
    }

    /// Reads the listener's `hi` and answers with `id`.
    fn answer(s: &mut UnixStream, id: u16) {
        let mut hi = [0u8; 2];
        s.read_exact(&mut hi).expect("hi");
        assert_eq!(&hi, b"hi");
        let mut b = *b"ok\0\0";
        b[2..].copy_from_slice(&id.to_le_bytes());
        s.write_all(&b).expect("answer");
    }

    /// Whether the listener closed `s` (after its `hi`), without waiting.
    fn closed(s: &mut UnixStream) -> bool {
        s.set_nonblocking(true).expect("nonblocking");
        let mut b = [0u8; 16];
        loop {
            match s.read(&mut b) {
                // (Reset: the listener closed it with bytes unread.)
                Ok(0) => return true,
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return true,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(e) => panic!("read: {e}"),
            }
        }
    }

    /// Accepts until a connection comes (at most 5 s).
    fn accept_one(q: &mut Queue, ctx: &Script) -> (u16, UnixStream) {
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(c) = q.accept(ctx).expect("accept") {
                return c;
            }
            assert!(Instant::now() < end, "nothing accepted");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_silent_stranger_is_dropped_at_its_deadline_and_the_peer_behind_it_is_served() {
        let ctx = Script::default();
        let timeout = Duration::from_millis(300);
        let (mut q, addr) = listen(timeout);
        let t0 = Instant::now();
        let mut stranger = peer(&addr);
        let mut good = peer(&addr);
        assert!(q.accept(&ctx).expect("accept").is_none());
        assert_eq!(q.pending(), 2);
        answer(&mut good, 7);
        let (id, _conn) = accept_one(&mut q, &ctx);
        assert_eq!(id, 7);
        // Served while the stranger ahead of it still waits.
        assert!(
            t0.elapsed() < timeout,
            "served only after {:?}",
            t0.elapsed()
        );
        assert_eq!(q.pending(), 1);
        assert!(!closed(&mut stranger), "the stranger was dropped early");
        while t0.elapsed() < timeout + Duration::from_millis(50) {
            assert!(q.accept(&ctx).expect("accept").is_none());
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(q.pending(), 0, "the stranger outlived its deadline");
        assert!(closed(&mut stranger), "the stranger's socket is still open");
    }

    #[test]
    fn garbage_and_hang_ups_drop_only_their_peer() {
        let ctx = Script::default();
        let (mut q, addr) = listen(Duration::from_secs(10));
        let mut junk = peer(&addr);
        let quitter = peer(&addr);
        assert!(q.accept(&ctx).expect("accept").is_none());
        assert_eq!(q.pending(), 2);
        junk.write_all(b"GET / HTTP/1.1\r\n").expect("junk");
        drop(quitter);
        let mut good = started_peer(&mut q, &ctx, &addr);
        answer(&mut good, 3);
        assert_eq!(accept_one(&mut q, &ctx).0, 3);
        assert_eq!(q.pending(), 0, "a bad peer is still pending");
        assert!(closed(&mut junk), "the garbage peer was not dropped");
        // And the listener keeps serving.
        let mut next = started_peer(&mut q, &ctx, &addr);
        answer(&mut next, 4);
        assert_eq!(accept_one(&mut q, &ctx).0, 4);
    }

    #[test]
    fn many_handshakes_at_once_are_all_accepted() {
        const N: u16 = 16;
        let ctx = Script::default();
        let (mut q, addr) = listen(Duration::from_secs(10));
        let mut peers: Vec<UnixStream> = (0..N).map(|_| peer(&addr)).collect();
        assert!(q.accept(&ctx).expect("accept").is_none());
        assert_eq!(q.pending(), N as usize);
        // Answers arrive in reverse order of connection.
        for (id, p) in peers.iter_mut().enumerate().rev() {
            answer(p, id as u16);
        }
        let mut ids: Vec<u16> = (0..N).map(|_| accept_one(&mut q, &ctx).0).collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..N).collect::<Vec<_>>());
        assert_eq!(q.pending(), 0);
    }

    #[test]
    fn a_refused_start_or_a_failed_build_drops_only_that_peer() {
        let ctx = Script::default();
        let (mut q, addr) = listen(Duration::from_secs(10));
        ctx.refuse_starts.store(1, Ordering::Relaxed);
        let mut refused = peer(&addr);
        assert!(q.accept(&ctx).expect("accept").is_none());
        assert_eq!(q.pending(), 0);
        assert!(closed(&mut refused), "the refused peer was kept");
        ctx.fail_establish.store(1, Ordering::Relaxed);
        let mut broken = started_peer(&mut q, &ctx, &addr);
        let mut good = started_peer(&mut q, &ctx, &addr);
        answer(&mut broken, 1);
        answer(&mut good, 2);
        // The failed build is not an error of accept; the next peer is served.
        assert_eq!(accept_one(&mut q, &ctx).0, 2);
        assert_eq!(ctx.fail_establish.load(Ordering::Relaxed), 0);
        assert!(closed(&mut broken), "the peer whose build failed was kept");
    }

    /// A listening socket that replays a script, then has nothing (`WouldBlock`).
    #[derive(Debug)]
    struct Scripted(Mutex<VecDeque<io::Result<UnixStream>>>);

    impl ListenSocket for Scripted {
        type Stream = UnixStream;
        const ACCEPT: &'static str = "accept(scripted)";
        fn accept_stream(&self) -> io::Result<UnixStream> {
            let mut q = self.0.lock().expect("script");
            q.pop_front()
                .unwrap_or_else(|| Err(io::ErrorKind::WouldBlock.into()))
        }
    }

    #[test]
    fn only_the_listening_socket_fails_accept_and_interrupts_are_retried() {
        let ctx = Script::default();
        let (ours, mut theirs) = UnixStream::pair().expect("pair");
        let script = VecDeque::from([
            Err(io::ErrorKind::Interrupted.into()),
            Ok(ours),
            Err(io::Error::from_raw_os_error(libc::EMFILE)),
        ]);
        let mut q: AcceptQueue<Scripted, Ping<UnixStream>> =
            AcceptQueue::new(Scripted(Mutex::new(script)), Duration::from_secs(10));
        match q.accept(&ctx) {
            Err(Error::Io { op, source }) => {
                assert_eq!(op, "accept(scripted)");
                assert_eq!(source.raw_os_error(), Some(libc::EMFILE));
            }
            other => panic!("expected the socket's error, got {other:?}"),
        }
        // The stream accepted after the interrupt was kept and finishes.
        assert_eq!(q.pending(), 1);
        answer(&mut theirs, 9);
        let end = Instant::now() + Duration::from_secs(5);
        let got = loop {
            if let Some((id, _)) = q.accept(&ctx).expect("accept") {
                break id;
            }
            assert!(Instant::now() < end, "nothing accepted");
        };
        assert_eq!(got, 9);
    }

    #[test]
    fn a_connector_times_out_and_hands_out_one_connection() {
        let ctx = Script::default();
        let timeout = Duration::from_millis(100);
        let (a, _silent) = UnixStream::pair().expect("pair");
        let mut c: Connecting<UnixStream, Ping<UnixStream>> =
            Connecting::connected(a, &ctx, timeout, "test handshake").expect("start");
        assert!(c.poll(&ctx).expect("poll").is_none());
        std::thread::sleep(timeout + Duration::from_millis(20));
        assert!(
            matches!(c.poll(&ctx), Err(Error::Timeout("test handshake"))),
            "no timeout"
        );
        let (a, mut b) = UnixStream::pair().expect("pair");
        let mut c: Connecting<UnixStream, Ping<UnixStream>> =
            Connecting::connected(a, &ctx, Duration::from_secs(5), "test").expect("start");
        answer(&mut b, 5);
        let end = Instant::now() + Duration::from_secs(5);
        let id = loop {
            if let Some((id, _)) = c.poll(&ctx).expect("poll") {
                break id;
            }
            assert!(Instant::now() < end, "not connected");
        };
        assert_eq!(id, 5);
        assert!(
            matches!(c.poll(&ctx), Err(Error::InvalidArgument(_))),
            "a second connection was handed out"
        );
    }

    #[test]
    fn a_tcp_dial_connects_then_handshakes() {
        let ctx = Script::default();
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = l.local_addr().expect("addr").to_string();
        let s = dial_tcp(&addr, "test", |_, _| Ok(())).expect("dial");
        let mut c: Connecting<TcpStream, Ping<TcpStream>> = Connecting::dial(
            s,
            Duration::from_secs(5),
            ["test connect", "test handshake"],
        );
        let (mut theirs, _) = l.accept().expect("accept");
        let end = Instant::now() + Duration::from_secs(5);
        let mut answered = false;
        let id = loop {
            if let Some((id, _)) = c.poll(&ctx).expect("poll") {
                break id;
            }
            if !answered && matches!(c.phase, Phase::Handshaking(_)) {
                let mut hi = [0u8; 2];
                theirs.read_exact(&mut hi).expect("hi");
                assert_eq!(&hi, b"hi");
                theirs.write_all(b"ok\x0b\0").expect("answer");
                answered = true;
            }
            assert!(Instant::now() < end, "not connected");
            std::thread::sleep(Duration::from_millis(1));
        };
        assert_eq!(id, 11);
        // Nobody there: the connect's own error, not a timeout.
        drop(l);
        let mut c: Connecting<TcpStream, Ping<TcpStream>> = Connecting::dial(
            dial_tcp(&addr, "test", |_, _| Ok(())).expect("dial"),
            Duration::from_secs(5),
            ["test connect", "test handshake"],
        );
        let end = Instant::now() + Duration::from_secs(5);
        let e = loop {
            match c.poll(&ctx) {
                Err(e) => break e,
                Ok(None) => assert!(Instant::now() < end, "no error"),
                Ok(Some(_)) => panic!("connected to nobody"),
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        assert!(matches!(e, Error::Io { op: "connect", .. }), "{e}");
    }

    #[test]
    fn addresses_are_named_and_checked() {
        let (_l, name) = bind_abstract("test").expect("bind");
        let prefix = format!("fabric-test-{}-", std::process::id());
        let hex = name.strip_prefix(&prefix).expect("prefix");
        assert_eq!(hex.len(), 16, "{name}");
        assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()), "{name}");
        assert!(connect_abstract(&format!("@{name}"), "test").is_ok());
        match connect_abstract(&name, "shm") {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("shm address"), "{m}"),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        match dial_tcp("no port here", "verbs", |_, _| Ok(())) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("verbs address"), "{m}"),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }
}
