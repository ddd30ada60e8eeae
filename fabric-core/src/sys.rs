//! Thin, checked wrappers over the Linux calls the backends need (`memfd_create`, seals,
//! `eventfd`, `epoll`, `SCM_RIGHTS`, `SO_PEERCRED`, `poll`). Every unsafe block of the
//! crate that talks to the kernel is here.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

use crate::error::{Error, Result};

fn cvt(op: &'static str, r: libc::c_int) -> Result<libc::c_int> {
    if r < 0 {
        Err(Error::last_os(op))
    } else {
        Ok(r)
    }
}

/// A sealed-able anonymous memory file of `len` bytes (never a path in the file system).
///
/// # Errors
/// [`Error::Io`] when `memfd_create` or `ftruncate` fails.
pub fn memfd(name: &str, len: usize) -> Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).unwrap_or_default();
    // SAFETY: cname is a valid NUL-terminated string; flags are valid.
    let fd =
        unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    cvt("memfd_create", fd)?;
    // SAFETY: fd is a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: fd is valid; ftruncate takes no pointers.
    cvt("ftruncate", unsafe {
        libc::ftruncate(fd.as_raw_fd(), len as libc::off_t)
    })?;
    Ok(fd)
}

const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// Seals the size of a memfd so a peer cannot shrink it under our mapping (SIGBUS).
///
/// # Errors
/// [`Error::Io`] when `fcntl` fails.
pub fn seal_size(fd: BorrowedFd<'_>) -> Result<()> {
    // SAFETY: F_ADD_SEALS takes an int argument.
    cvt("fcntl(F_ADD_SEALS)", unsafe {
        libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS)
    })?;
    Ok(())
}

/// Checks that a memfd received from a peer is size-sealed and returns its size.
///
/// # Errors
/// [`Error::Protocol`] when it is not sealed; [`Error::Io`] when `fcntl`/`fstat` fail.
pub fn check_sealed_size(fd: BorrowedFd<'_>) -> Result<u64> {
    // SAFETY: F_GET_SEALS takes no argument.
    let seals = cvt("fcntl(F_GET_SEALS)", unsafe {
        libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS)
    })?;
    if seals & (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) != libc::F_SEAL_SHRINK | libc::F_SEAL_GROW
    {
        return Err(Error::Protocol(
            "peer's memory file is not size-sealed".into(),
        ));
    }
    let f = std::fs::File::from(fd.try_clone_to_owned().map_err(|e| Error::io("dup", e))?);
    Ok(f.metadata().map_err(|e| Error::io("fstat", e))?.len())
}

/// A non-blocking, close-on-exec eventfd.
///
/// # Errors
/// [`Error::Io`] when `eventfd` fails.
pub fn eventfd() -> Result<OwnedFd> {
    // SAFETY: plain flags.
    let fd = cvt("eventfd", unsafe {
        libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
    })?;
    // SAFETY: fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds one to an eventfd (wakes a sleeper). Errors are ignored: a full counter still wakes.
pub fn eventfd_signal(fd: BorrowedFd<'_>) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid u64.
    unsafe { libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

/// Resets an eventfd's counter (non-blocking).
pub fn eventfd_drain(fd: BorrowedFd<'_>) {
    let mut v: u64 = 0;
    // SAFETY: reads at most 8 bytes into a valid u64.
    unsafe { libc::read(fd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
}

/// An epoll instance watching `fds` for readability (and hang-up).
///
/// # Errors
/// [`Error::Io`] when `epoll_create1`/`epoll_ctl` fail.
pub fn epoll_of(fds: &[BorrowedFd<'_>]) -> Result<OwnedFd> {
    // SAFETY: plain flags.
    let ep = cvt("epoll_create1", unsafe {
        libc::epoll_create1(libc::EPOLL_CLOEXEC)
    })?;
    // SAFETY: fresh descriptor we own.
    let ep = unsafe { OwnedFd::from_raw_fd(ep) };
    for fd in fds {
        epoll_set(ep.as_fd(), *fd, false, true)?;
    }
    Ok(ep)
}

/// Adds or modifies `fd` in `ep`: readable + hang-up, and writable if `out`.
///
/// # Errors
/// [`Error::Io`] when `epoll_ctl` fails.
pub fn epoll_set(ep: BorrowedFd<'_>, fd: BorrowedFd<'_>, out: bool, add: bool) -> Result<()> {
    let mut ev = libc::epoll_event {
        events: (libc::EPOLLIN | libc::EPOLLRDHUP | if out { libc::EPOLLOUT } else { 0 }) as u32,
        u64: fd.as_raw_fd() as u64,
    };
    let op = if add {
        libc::EPOLL_CTL_ADD
    } else {
        libc::EPOLL_CTL_MOD
    };
    // SAFETY: `ev` is a valid epoll_event; both fds are open.
    cvt("epoll_ctl", unsafe {
        libc::epoll_ctl(ep.as_raw_fd(), op, fd.as_raw_fd(), &mut ev)
    })?;
    Ok(())
}

/// Waits until `fd` is readable (or hung up) or `timeout` passes. Returns whether it is.
///
/// # Errors
/// [`Error::Io`] when `poll` fails (EINTR is retried as a spurious wake-up: returns false).
pub fn poll_readable(fd: BorrowedFd<'_>, timeout: Option<Duration>) -> Result<bool> {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.map_or(-1, |d| d.as_millis().min(i32::MAX as u128) as libc::c_int);
    // SAFETY: one valid pollfd.
    let r = unsafe { libc::poll(&mut p, 1, ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(Error::io("poll", e));
    }
    Ok(r > 0)
}

/// Whether a socket's peer has hung up or the socket failed (non-blocking `poll` for
/// `POLLRDHUP`; pending unread data does not hide a hang-up).
pub fn peer_hung_up(fd: BorrowedFd<'_>) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    r > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0
}

/// `poll(2)` over many descriptors: waits until one has an event or `timeout` passes and
/// returns how many have events (`revents` set). EINTR is a spurious wake-up (returns 0).
///
/// # Errors
/// [`Error::Io`] when `poll` fails otherwise.
pub fn poll_fds(fds: &mut [libc::pollfd], timeout: Duration) -> Result<usize> {
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: `fds` is a valid, exclusively borrowed slice of pollfd of the length passed.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(Error::io("poll", e));
    }
    Ok(r as usize)
}

/// Sets the accept backlog of a listening socket (`listen(2)` again; the kernel caps it at
/// `net.core.somaxconn`).
///
/// # Errors
/// [`Error::Io`] when `listen` fails.
pub fn set_listen_backlog(fd: BorrowedFd<'_>, backlog: i32) -> Result<()> {
    // SAFETY: `fd` is an open socket; listen only changes its backlog.
    cvt("listen", unsafe { libc::listen(fd.as_raw_fd(), backlog) }).map(|_| ())
}

/// The congestion control algorithm a TCP socket uses (`getsockopt(TCP_CONGESTION)`,
/// e.g. `"cubic"`).
///
/// # Errors
/// [`Error::Io`] when `getsockopt` fails (not a TCP socket).
pub fn tcp_congestion(fd: BorrowedFd<'_>) -> Result<String> {
    let mut buf = [0u8; 32];
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `buf` and the length it wrote
    // into `len`.
    cvt("getsockopt(TCP_CONGESTION)", unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    })?;
    let name = &buf[..(len as usize).min(buf.len())];
    let end = name.iter().position(|&c| c == 0).unwrap_or(name.len());
    Ok(String::from_utf8_lossy(&name[..end]).into_owned())
}

/// Chooses a TCP socket's congestion control algorithm (`setsockopt(TCP_CONGESTION)`).
/// The kernel refuses a name it does not know (`ENOENT`) and, without `CAP_NET_ADMIN`,
/// one outside `net.ipv4.tcp_allowed_congestion_control` (`EPERM`).
///
/// # Errors
/// The OS error, unwrapped: callers decide whether a refusal matters.
pub fn set_tcp_congestion(fd: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    // SAFETY: setsockopt reads `name.len()` bytes from `name`, which outlives the call.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CONGESTION,
            name.as_ptr().cast(),
            name.len() as libc::socklen_t,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Raises this process's soft limit on open files to at least `want`, as far as the hard
/// limit allows (never lowers it). Returns `(soft, hard)` as they are afterwards.
///
/// # Errors
/// [`Error::Io`] when `getrlimit` fails (a refused `setrlimit` just leaves the limit).
pub fn raise_nofile_limit(want: u64) -> Result<(u64, u64)> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `l`.
    cvt("getrlimit", unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut l)
    })?;
    if l.rlim_cur < want {
        let raised = libc::rlimit {
            rlim_cur: want.min(l.rlim_max),
            rlim_max: l.rlim_max,
        };
        // SAFETY: setrlimit reads one valid rlimit; the soft limit stays within the hard.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            l = raised;
        }
    }
    Ok((l.rlim_cur, l.rlim_max))
}

/// Our effective uid.
pub fn uid() -> u32 {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() }
}

/// The uid of the process at the other end of a Unix socket (`SO_PEERCRED`).
///
/// # Errors
/// [`Error::Io`] when `getsockopt` fails.
pub fn peer_uid(fd: BorrowedFd<'_>) -> Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred`/`len` are valid out-parameters of the right size.
    cvt("getsockopt(SO_PEERCRED)", unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    })?;
    Ok(cred.uid)
}

const MAX_FDS: usize = 4;

/// Sends `data` with `fds` attached (`SCM_RIGHTS`) on a Unix stream socket.
/// Returns `Ok(false)` if the socket would block.
///
/// # Errors
/// [`Error::Io`] when `sendmsg` fails.
pub fn send_with_fds(sock: BorrowedFd<'_>, data: &[u8], fds: &[BorrowedFd<'_>]) -> Result<bool> {
    assert!(fds.len() <= MAX_FDS && !data.is_empty());
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // u64 array for alignment of the control buffer.
    let mut cbuf = [0u64; 16];
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE((fds.len() * 4) as u32) } as usize;
    // SAFETY: zeroed msghdr is a valid "empty" value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: msg_control points to `space` <= 128 bytes of aligned memory.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN((fds.len() * 4) as u32) as _;
            let p = libc::CMSG_DATA(c) as *mut RawFd;
            for (i, fd) in fds.iter().enumerate() {
                p.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    loop {
        // SAFETY: msg is fully initialised and points to live buffers.
        let r = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if r >= 0 {
            if (r as usize) < data.len() {
                return Err(Error::Protocol("short sendmsg on a control socket".into()));
            }
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(false),
            _ => return Err(Error::io("sendmsg", e)),
        }
    }
}

/// Receives up to `buf.len()` bytes and any attached descriptors (non-blocking socket:
/// `Ok(None)` when nothing is there). Returns the byte count (0 = hang-up) and the fds.
///
/// # Errors
/// [`Error::Io`] when `recvmsg` fails; [`Error::Protocol`] when more than four
/// descriptors or a truncated control message arrive (any received fds are closed).
pub fn recv_with_fds(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
) -> Result<Option<(usize, Vec<OwnedFd>)>> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 16];
    // SAFETY: zeroed msghdr is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    let r = loop {
        // SAFETY: msg points to live buffers of the stated sizes.
        let r = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if r >= 0 {
            break r as usize;
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(Error::io("recvmsg", e)),
        }
    };
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel filled in, within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let n = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..n {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() > MAX_FDS {
        return Err(Error::Protocol(
            "too many descriptors on the control socket".into(),
        ));
    }
    Ok(Some((r, fds)))
}

/// Random bytes from the kernel (`getrandom`).
///
/// # Errors
/// [`Error::Io`] when `getrandom` fails.
pub fn random_bytes(buf: &mut [u8]) -> Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: writes at most the remaining length into `buf`.
        let r = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::io("getrandom", e));
        }
        done += r as usize;
    }
    Ok(())
}

/// Shared (`MAP_SHARED`) read-write mapping of `len` bytes of `fd`.
///
/// # Errors
/// [`Error::Io`] when `mmap` fails.
pub fn map_shared(fd: BorrowedFd<'_>, len: usize) -> Result<memmap2::MmapRaw> {
    memmap2::MmapOptions::new()
        .len(len)
        .map_raw(&fd)
        .map_err(|e| Error::io("mmap", e))
}

/// Starts a non-blocking TCP connect (`EINPROGRESS` is success); finish it with
/// [`connect_finished`]. `prepare` sees the socket before it connects (options that must
/// hold from the first segment on).
///
/// # Errors
/// [`Error::Io`] when the socket cannot be created or the connect fails at once;
/// `prepare`'s error.
pub fn tcp_connect_start(
    addr: std::net::SocketAddr,
    prepare: impl FnOnce(BorrowedFd<'_>) -> Result<()>,
) -> Result<std::net::TcpStream> {
    use std::net::SocketAddr;
    let domain = match addr {
        SocketAddr::V4(_) => libc::AF_INET,
        SocketAddr::V6(_) => libc::AF_INET6,
    };
    // SAFETY: plain arguments.
    let fd = cvt("socket", unsafe {
        libc::socket(
            domain,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    })?;
    // SAFETY: fresh descriptor we own.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    prepare(owned.as_fd())?;
    // SAFETY: zeroed sockaddr_storage is valid; we fill the variant matching `domain`.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in.
            let sin = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in6.
            let sin6 = unsafe { &mut *(&mut ss as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            sin6.sin6_flowinfo = a.flowinfo();
            sin6.sin6_scope_id = a.scope_id();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    // SAFETY: `ss` holds a valid address of `len` bytes.
    let r = unsafe {
        libc::connect(
            fd,
            (&ss as *const libc::sockaddr_storage).cast(),
            len as libc::socklen_t,
        )
    };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(Error::io("connect", e));
        }
    }
    Ok(std::net::TcpStream::from(owned))
}

/// Whether a non-blocking connect finished: `Ok(true)` connected, `Ok(false)` not yet.
///
/// # Errors
/// [`Error::Io`] with the connect's error (`SO_ERROR`).
pub fn connect_finished(s: &std::net::TcpStream) -> Result<bool> {
    let mut p = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLOUT,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let r = unsafe { libc::poll(&mut p, 1, 0) };
    if r <= 0 {
        return Ok(false);
    }
    match s.take_error() {
        Ok(None) => Ok(true),
        Ok(Some(e)) | Err(e) => Err(Error::io("connect", e)),
    }
}

/// `sendmsg` of `a` then `len_b` bytes at `b` on a stream socket, with `MSG_NOSIGNAL`;
/// returns bytes sent, `Ok(0)` when the socket would block.
///
/// A peer that went away is an error here, never a signal: `writev` on a socket whose peer
/// closed raises `SIGPIPE`, which kills any process that keeps the default action (a C
/// program using this library, a Rust program built to die on broken pipes).
///
/// # Safety
/// `b` must be valid for reads of `len_b` bytes for the duration of the call.
///
/// # Errors
/// [`Error::Io`] for socket failures (EPIPE/ECONNRESET included).
pub unsafe fn sendv2(sock: BorrowedFd<'_>, a: &[u8], b: *const u8, len_b: usize) -> Result<usize> {
    let mut iov = [
        libc::iovec {
            iov_base: a.as_ptr() as *mut libc::c_void,
            iov_len: a.len(),
        },
        libc::iovec {
            iov_base: b as *mut libc::c_void,
            iov_len: len_b,
        },
    ];
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    loop {
        // SAFETY: both iovecs describe readable memory (caller contract for `b`).
        let r = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(0),
            _ => return Err(Error::io("sendmsg", e)),
        }
    }
}

/// `send` of `buf` on a stream socket with `MSG_NOSIGNAL` (a peer that went away is
/// `EPIPE`, not a `SIGPIPE` that kills the process): what `Write::write` on a
/// `UnixStream` does, minus the signal.
///
/// # Errors
/// The socket's error, as `write` reports it (`WouldBlock` on a full non-blocking socket).
pub fn send(sock: BorrowedFd<'_>, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is readable for its length.
    let r = unsafe {
        libc::send(
            sock.as_raw_fd(),
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_NOSIGNAL,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// `read` into `len` bytes at `dst`; `Ok(None)` when it would block, `Ok(Some(0))` at end
/// of stream.
///
/// # Safety
/// `dst` must be valid for writes of `len` bytes for the duration of the call.
///
/// # Errors
/// [`Error::Io`] for socket failures.
pub unsafe fn read_raw(fd: BorrowedFd<'_>, dst: *mut u8, len: usize) -> Result<Option<usize>> {
    loop {
        // SAFETY: caller guarantees `dst` is writable for `len` bytes.
        let r = unsafe { libc::read(fd.as_raw_fd(), dst.cast(), len) };
        if r >= 0 {
            return Ok(Some(r as usize));
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(Error::io("read", e)),
        }
    }
}

/// The CPUs this thread may run on (`sched_getaffinity`), in order.
///
/// # Errors
/// [`Error::Io`] when the call fails.
pub fn allowed_cpus() -> Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid out-parameter of the stated size.
    cvt("sched_getaffinity", unsafe {
        libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set)
    })?;
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: CPU_ISSET reads the set; the index is below CPU_SETSIZE.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Pins the calling thread to `cpu` (benchmarks: keeps two busy-polling peers off one core).
///
/// # Errors
/// [`Error::Io`] when the CPU is not allowed or the call fails.
pub fn pin_to_cpu(cpu: usize) -> Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(Error::InvalidArgument(format!("cpu {cpu} out of range")));
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: the index is below CPU_SETSIZE (checked).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the stated size.
    cvt("sched_setaffinity", unsafe {
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    })?;
    Ok(())
}
