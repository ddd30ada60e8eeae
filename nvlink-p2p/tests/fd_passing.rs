//! fd passing across two real processes with ordinary memfds.
mod common;

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

use common::*;
use nvlink_p2p::fd_passing::{pidfd_getfd, recv_with_fds, require_same_uid, send_with_fds};
use nvlink_p2p::Error;

/// fd counts are per process: tests that count them must not overlap with other tests.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn memfd(name: &str, contents: &[u8]) -> OwnedFd {
    let cname = std::ffi::CString::new(name).unwrap();
    // SAFETY: valid C string.
    #[allow(unsafe_code)]
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a fresh fd we own.
    #[allow(unsafe_code)]
    let mut f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    f.write_all(contents).unwrap();
    f.into()
}

fn contents(fd: &OwnedFd) -> Vec<u8> {
    let mut f = File::from(fd.try_clone().unwrap());
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut v = Vec::new();
    f.read_to_end(&mut v).unwrap();
    v
}

#[test]
fn memfds_travel_between_processes_without_leaks() {
    if role().as_deref() == Some("receiver") {
        let sock = connect();
        require_same_uid(&sock).unwrap();
        let before = open_fds();
        let (payload, fds) = recv_with_fds(&sock, 4).unwrap();
        assert_eq!(payload, b"two memfds");
        assert_eq!(fds.len(), 2);
        assert_eq!(contents(&fds[0]), b"alpha");
        assert_eq!(contents(&fds[1]), b"beta");
        // Write through the received fd; the parent sees it through its own.
        let mut f = File::from(fds[1].try_clone().unwrap());
        f.seek(SeekFrom::End(0)).unwrap();
        f.write_all(b"+child").unwrap();
        drop(f);
        // Send the first one back.
        send_with_fds(&sock, b"back", &[fds[0].as_fd()]).unwrap();
        drop(fds);
        assert_eq!(open_fds(), before, "receiver leaked fds");
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let l = Listener::new("fdpass");
    let child = spawn_child(
        "memfds_travel_between_processes_without_leaks",
        "receiver",
        Some(&l),
        &[],
    );
    let sock = l.accept();
    let creds = require_same_uid(&sock).unwrap();
    assert_eq!(creds.pid, child.id() as i32);
    let before = open_fds();
    {
        let a = memfd("alpha", b"alpha");
        let b = memfd("beta", b"beta");
        send_with_fds(&sock, b"two memfds", &[a.as_fd(), b.as_fd()]).unwrap();
        let (payload, back) = recv_with_fds(&sock, 1).unwrap();
        assert_eq!(payload, b"back");
        assert_eq!(back.len(), 1);
        assert_eq!(contents(&back[0]), b"alpha");
        // The fd came back as a new number referring to the same file.
        assert_ne!(back[0].as_raw_fd(), a.as_raw_fd());
        expect_success(child, "fd receiver");
        assert_eq!(contents(&b), b"beta+child");
    }
    assert_eq!(open_fds(), before, "sender leaked fds");
}

#[test]
fn pidfd_getfd_takes_a_memfd_from_a_child() {
    if role().as_deref() == Some("holder") {
        let sock = connect();
        let m = memfd("held", b"held by child");
        let mut w = &sock;
        w.write_all(&m.as_raw_fd().to_le_bytes()).unwrap();
        // Keep the fd open until the parent says it is done.
        let mut done = [0u8; 1];
        let mut r = &sock;
        r.read_exact(&mut done).unwrap();
        return;
    }
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let l = Listener::new("pidfd");
    let child = spawn_child(
        "pidfd_getfd_takes_a_memfd_from_a_child",
        "holder",
        Some(&l),
        &[],
    );
    let sock = l.accept();
    let mut fdno = [0u8; 4];
    (&sock).read_exact(&mut fdno).unwrap();
    let result = pidfd_getfd(child.id() as i32, i32::from_le_bytes(fdno));
    (&sock).write_all(b"x").unwrap();
    expect_success(child, "fd holder");
    match result {
        Ok(fd) => assert_eq!(contents(&fd), b"held by child"),
        // A kernel before 5.6 or a sandbox: a machine limit where the GPU probe saw it too.
        Err(Error::Unsupported { reason, .. }) => skip_or_fail(
            format_args!("pidfd_getfd not allowed here: {reason}"),
            Limit::RefusedHere("pidfd"),
        ),
        Err(e) => panic!("unexpected error {e}"),
    }
}
