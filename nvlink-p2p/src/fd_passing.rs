//! Passing file descriptors between processes: `SCM_RIGHTS` over a Unix stream socket,
//! peer-credential checks (`SO_PEERCRED`), and `pidfd_getfd` where the kernel allows it.
//!
//! Used to hand VMM shareable handles (POSIX fds) and DMA-BUF fds to another process, but
//! nothing here is CUDA-specific: the tests use ordinary memfds.
//!
//! A message is an 8-byte header (`u32` payload length, `u16` fd count, `u16` zero, all
//! little-endian), the fds attached as `SCM_RIGHTS` ancillary data to the header's first
//! byte, then the payload.
#![allow(unsafe_code)]

use std::io::Read;
use std::mem;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use crate::error::{Error, Result};

/// The most fds one message may carry.
pub const MAX_FDS: usize = 16;
/// The largest payload one message may carry.
pub const MAX_PAYLOAD: usize = 64 * 1024;
const HEADER_LEN: usize = 8;

/// The identity of the process on the other end of a Unix socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCredentials {
    /// Process id.
    pub pid: i32,
    /// User id.
    pub uid: u32,
    /// Group id.
    pub gid: u32,
}

fn cmsg_space(fds: usize) -> usize {
    // SAFETY: CMSG_SPACE is a pure size computation.
    unsafe { libc::CMSG_SPACE((fds * mem::size_of::<RawFd>()) as u32) as usize }
}

/// Sends `payload` and `fds` as one message. The fds stay open here (the receiver gets
/// duplicates).
///
/// # Errors
/// [`Error::InvalidArgument`] for more than [`MAX_FDS`] fds or a payload over
/// [`MAX_PAYLOAD`]; [`Error::Io`] when the socket fails.
pub fn send_with_fds(sock: &UnixStream, payload: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    if fds.len() > MAX_FDS {
        return Err(Error::InvalidArgument(format!(
            "{} fds in one message; at most {MAX_FDS}",
            fds.len()
        )));
    }
    if payload.len() > MAX_PAYLOAD {
        return Err(Error::InvalidArgument(format!(
            "payload of {} bytes; at most {MAX_PAYLOAD}",
            payload.len()
        )));
    }
    let mut header = [0u8; HEADER_LEN];
    header[..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    header[4..6].copy_from_slice(&(fds.len() as u16).to_le_bytes());
    let mut message = Vec::with_capacity(HEADER_LEN + payload.len());
    message.extend_from_slice(&header);
    message.extend_from_slice(payload);

    // u64 elements keep the control buffer aligned for cmsghdr.
    let mut control = vec![0u64; cmsg_space(MAX_FDS).div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: message.as_ptr() as *mut libc::c_void,
        iov_len: message.len(),
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = cmsg_space(fds.len()) as _;
        // SAFETY: msg_control points at a buffer of at least CMSG_SPACE(fds.len() fds) bytes,
        // aligned for cmsghdr, so the first header and its data are in bounds.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN((fds.len() * mem::size_of::<RawFd>()) as u32) as _;
            let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
            for (i, fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    // The fds go with the first byte; a partial send continues with plain data (the same
    // sendmsg with the rest of the message and no control part). MSG_NOSIGNAL: a peer gone
    // is an error, not a SIGPIPE that kills the process.
    let mut at = 0;
    while at < message.len() {
        // SAFETY: msg points at live iovec/control buffers for the duration of the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n > 0 {
            at += n as usize;
            iov.iov_base = message[at..].as_ptr() as *mut libc::c_void;
            iov.iov_len = message.len() - at;
            // Re-derived after the writes above: they went through `iov` itself, which
            // invalidates the pointer taken before them.
            msg.msg_iov = &mut iov;
            msg.msg_control = std::ptr::null_mut();
            msg.msg_controllen = 0;
            continue;
        }
        let e = if n == 0 {
            std::io::Error::from(std::io::ErrorKind::WriteZero)
        } else {
            std::io::Error::last_os_error()
        };
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::io("sendmsg(SCM_RIGHTS)", e));
        }
    }
    Ok(())
}

/// Receives one message sent by [`send_with_fds`]: its payload and its fds (opened
/// close-on-exec). Fds that arrive with a malformed message are closed, never leaked.
///
/// # Errors
/// [`Error::Io`] when the socket fails or closes early; [`Error::Protocol`] for a payload
/// over [`MAX_PAYLOAD`], more than `max_fds` fds, truncated ancillary data, or an fd count
/// that does not match the header.
pub fn recv_with_fds(sock: &UnixStream, max_fds: usize) -> Result<(Vec<u8>, Vec<OwnedFd>)> {
    let max_fds = max_fds.min(MAX_FDS);
    let mut header = [0u8; HEADER_LEN];
    // Room for MAX_FDS so a peer sending too many is detected, not silently truncated.
    let mut control = vec![0u64; cmsg_space(MAX_FDS).div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: header.as_mut_ptr().cast(),
        iov_len: HEADER_LEN,
    };
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = (control.len() * 8) as _;
    let got = loop {
        // SAFETY: msg points at live header/control buffers of the sizes it states.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::io("recvmsg(SCM_RIGHTS)", e));
        }
    };
    // Take ownership of every fd that arrived before looking at anything else.
    let mut fds = Vec::new();
    if msg.msg_controllen > 0 {
        // SAFETY: the kernel filled msg_control with msg_controllen bytes of cmsghdrs;
        // CMSG_FIRSTHDR/NXTHDR stay within that, and SCM_RIGHTS data are RawFds that this
        // process now owns (received with MSG_CMSG_CLOEXEC).
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let data_len =
                        ((*cmsg).cmsg_len as usize).saturating_sub(libc::CMSG_LEN(0) as usize);
                    let n = data_len / mem::size_of::<RawFd>();
                    let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                    for i in 0..n {
                        fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(Error::Protocol(
            "ancillary data truncated: the peer sent more fds than fit".into(),
        ));
    }
    if got == 0 {
        return Err(Error::io(
            "receiving an fd-passing message",
            std::io::ErrorKind::UnexpectedEof.into(),
        ));
    }
    let mut r = sock;
    if got < HEADER_LEN {
        r.read_exact(&mut header[got..])
            .map_err(|e| Error::io("receiving an fd-passing header", e))?;
    }
    let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes")) as usize;
    let nfds = u16::from_le_bytes(header[4..6].try_into().expect("2 bytes")) as usize;
    if header[6] != 0 || header[7] != 0 {
        return Err(Error::Protocol("reserved header bytes are not zero".into()));
    }
    if len > MAX_PAYLOAD {
        return Err(Error::Protocol(format!(
            "payload of {len} bytes announced; at most {MAX_PAYLOAD}"
        )));
    }
    if nfds != fds.len() {
        return Err(Error::Protocol(format!(
            "header announces {nfds} fds but {} arrived",
            fds.len()
        )));
    }
    if fds.len() > max_fds {
        return Err(Error::Protocol(format!(
            "{} fds arrived; at most {max_fds} expected",
            fds.len()
        )));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)
        .map_err(|e| Error::io("receiving an fd-passing payload", e))?;
    Ok((payload, fds))
}

/// The pid/uid/gid of the process on the other end (`SO_PEERCRED`).
///
/// # Errors
/// [`Error::Io`] if `getsockopt` fails.
pub fn peer_credentials(sock: &UnixStream) -> Result<PeerCredentials> {
    // SAFETY: ucred is plain data.
    let mut cred: libc::ucred = unsafe { mem::zeroed() };
    let mut len = mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred/len describe a writable ucred-sized buffer.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(Error::last_os("getsockopt(SO_PEERCRED)"));
    }
    Ok(PeerCredentials {
        pid: cred.pid,
        uid: cred.uid,
        gid: cred.gid,
    })
}

/// Checks that `creds` belong to user `expected`.
///
/// # Errors
/// [`Error::PeerUidMismatch`] otherwise.
pub fn check_peer_uid(creds: PeerCredentials, expected: u32) -> Result<()> {
    if creds.uid == expected {
        Ok(())
    } else {
        Err(Error::PeerUidMismatch {
            pid: creds.pid,
            got: creds.uid,
            expected,
        })
    }
}

/// Requires the peer on `sock` to run as the same user as this process, and returns its
/// credentials. Call it before sending handles to, or accepting them from, a peer.
///
/// # Errors
/// [`Error::PeerUidMismatch`] or [`Error::Io`].
pub fn require_same_uid(sock: &UnixStream) -> Result<PeerCredentials> {
    let creds = peer_credentials(sock)?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    check_peer_uid(creds, me)?;
    Ok(creds)
}

/// Duplicates file descriptor `fd` of process `pid` into this process (`pidfd_open` +
/// `pidfd_getfd`, Linux 5.6+). The caller needs ptrace access to the target
/// (`PTRACE_MODE_ATTACH_REALCREDS`: usually same user and a Yama `ptrace_scope` that allows
/// it, or `CAP_SYS_PTRACE`); containers often forbid it, so [`send_with_fds`] is the
/// portable path.
///
/// # Errors
/// [`Error::Unsupported`] when the kernel lacks the calls or the caller lacks permission;
/// [`Error::Io`] otherwise (e.g. no such process or fd).
pub fn pidfd_getfd(pid: i32, fd: RawFd) -> Result<OwnedFd> {
    fn classify(op: &'static str, e: std::io::Error) -> Error {
        match e.raw_os_error() {
            Some(libc::ENOSYS) => Error::Unsupported {
                feature: "pidfd_getfd",
                reason: format!("{op}: the kernel lacks it (needs Linux 5.6+) or a seccomp filter blocks it"),
            },
            Some(libc::EPERM) => Error::Unsupported {
                feature: "pidfd_getfd",
                reason: format!(
                    "{op}: permission denied (needs ptrace access to the target process: \
                     same uid and Yama ptrace_scope allowing it, or CAP_SYS_PTRACE); pass the fd with SCM_RIGHTS instead"
                ),
            },
            _ => Error::io(op, e),
        }
    }
    // SAFETY: pidfd_open(pid, 0) takes no pointers.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(classify("pidfd_open", std::io::Error::last_os_error()));
    }
    // SAFETY: the kernel returned a new fd that we own.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    // SAFETY: pidfd_getfd(pidfd, fd, 0) takes no pointers.
    let newfd = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if newfd < 0 {
        return Err(classify("pidfd_getfd", std::io::Error::last_os_error()));
    }
    // SAFETY: the kernel returned a new fd (close-on-exec) that we own.
    Ok(unsafe { OwnedFd::from_raw_fd(newfd as RawFd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;

    fn memfd(name: &str, contents: &[u8]) -> OwnedFd {
        let cname = std::ffi::CString::new(name).unwrap();
        // SAFETY: cname is a valid C string.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: fresh fd owned by us.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut f = std::fs::File::from(fd);
        f.write_all(contents).unwrap();
        f.into()
    }

    fn read_all(fd: OwnedFd) -> Vec<u8> {
        use std::io::Seek;
        let mut f = std::fs::File::from(fd);
        f.seek(std::io::SeekFrom::Start(0)).unwrap();
        let mut v = Vec::new();
        f.read_to_end(&mut v).unwrap();
        v
    }

    #[test]
    fn in_process_round_trip() {
        let (a, b) = UnixStream::pair().unwrap();
        let m1 = memfd("one", b"first");
        let m2 = memfd("two", b"second");
        send_with_fds(&a, b"hello", &[m1.as_fd(), m2.as_fd()]).unwrap();
        let (payload, fds) = recv_with_fds(&b, 4).unwrap();
        assert_eq!(payload, b"hello");
        assert_eq!(fds.len(), 2);
        let mut it = fds.into_iter();
        assert_eq!(read_all(it.next().unwrap()), b"first");
        assert_eq!(read_all(it.next().unwrap()), b"second");
    }

    #[test]
    fn too_many_fds_is_a_protocol_error_and_closes_them() {
        let (a, b) = UnixStream::pair().unwrap();
        let m = memfd("x", b"x");
        send_with_fds(&a, b"", &[m.as_fd(), m.as_fd(), m.as_fd()]).unwrap();
        let e = recv_with_fds(&b, 2).unwrap_err();
        assert!(
            matches!(e, Error::Protocol(ref s) if s.contains("3 fds")),
            "{e}"
        );
    }

    #[test]
    fn largest_payload_crosses_in_pieces() {
        let (a, b) = UnixStream::pair().unwrap();
        // A small send buffer makes the kernel move the message in pieces; the receiver
        // must reassemble it (and get the fd with the first piece).
        let small: libc::c_int = 4096;
        // SAFETY: valid option pointer and length.
        let rc = unsafe {
            libc::setsockopt(
                a.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&small as *const libc::c_int).cast(),
                mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0);
        let payload: Vec<u8> = (0..MAX_PAYLOAD).map(|i| (i * 7 % 251) as u8).collect();
        let m = memfd("big", b"big");
        let expected = payload.clone();
        let reader = std::thread::spawn(move || recv_with_fds(&b, 1).unwrap());
        send_with_fds(&a, &payload, &[m.as_fd()]).unwrap();
        let (got, fds) = reader.join().unwrap();
        assert!(got == expected);
        assert_eq!(read_all(fds.into_iter().next().unwrap()), b"big");
    }

    #[test]
    fn send_limits() {
        let (a, _b) = UnixStream::pair().unwrap();
        let m = memfd("x", b"x");
        let many: Vec<_> = (0..MAX_FDS + 1).map(|_| m.as_fd()).collect();
        assert!(matches!(
            send_with_fds(&a, b"", &many),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            send_with_fds(&a, &vec![0; MAX_PAYLOAD + 1], &[]),
            Err(Error::InvalidArgument(_))
        ));
    }

    #[test]
    fn malformed_header_is_rejected() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut w = &a;
        // Announces 2 fds but carries none.
        w.write_all(&[0, 0, 0, 0, 2, 0, 0, 0]).unwrap();
        let e = recv_with_fds(&b, 4).unwrap_err();
        assert!(
            matches!(e, Error::Protocol(ref s) if s.contains("announces 2 fds")),
            "{e}"
        );
        // An oversized payload announcement.
        w.write_all(&((MAX_PAYLOAD as u32 + 1).to_le_bytes()))
            .unwrap();
        w.write_all(&[0, 0, 0, 0]).unwrap();
        let e = recv_with_fds(&b, 4).unwrap_err();
        assert!(
            matches!(e, Error::Protocol(ref s) if s.contains("at most")),
            "{e}"
        );
    }

    #[test]
    fn eof_is_an_io_error() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        let e = recv_with_fds(&b, 1).unwrap_err();
        assert!(
            matches!(e, Error::Io { ref source, .. } if source.kind() == std::io::ErrorKind::UnexpectedEof),
            "{e}"
        );
    }

    #[test]
    fn uid_check() {
        let (a, _b) = UnixStream::pair().unwrap();
        let creds = require_same_uid(&a).unwrap();
        assert_eq!(creds.pid, std::process::id() as i32);
        let e = check_peer_uid(creds, creds.uid + 1).unwrap_err();
        assert!(
            matches!(e, Error::PeerUidMismatch { got, expected, .. } if got == creds.uid && expected == creds.uid + 1)
        );
        assert!(e.to_string().contains("refusing"), "{e}");
    }

    #[test]
    fn pidfd_getfd_bad_fd_is_typed() {
        // Our own process, an fd number that is not open: EBADF (or Unsupported where the
        // kernel or sandbox forbids pidfd_getfd) — never a panic.
        match pidfd_getfd(std::process::id() as i32, 1_000_000) {
            Err(Error::Io { source, .. }) => assert_eq!(source.raw_os_error(), Some(libc::EBADF)),
            Err(Error::Unsupported { feature, .. }) => assert_eq!(feature, "pidfd_getfd"),
            other => panic!("unexpected {other:?}"),
        }
    }
}
