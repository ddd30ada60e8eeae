//! Helpers for tests that run two real processes: the test binary re-runs itself, filtered to
//! one test, with a role in the environment.
#![allow(dead_code)]

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub const ROLE_ENV: &str = "NVLINK_P2P_TEST_ROLE";
pub const SOCKET_ENV: &str = "NVLINK_P2P_TEST_SOCKET";

/// The role this process plays, if it is a child.
pub fn role() -> Option<String> {
    std::env::var(ROLE_ENV).ok()
}

/// A listening socket in a fresh path, removed on drop.
pub struct Listener {
    pub path: PathBuf,
    pub listener: UnixListener,
}

impl Listener {
    pub fn new(tag: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "nvlink-p2p-{tag}-{}-{}.sock",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .subsec_nanos()
        ));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).expect("bind test socket");
        Listener { path, listener }
    }

    pub fn accept(&self) -> UnixStream {
        let (s, _) = self.listener.accept().expect("accept");
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        s
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Re-runs this test binary as a child playing `role` in test `test_name`.
pub fn spawn_child(
    test_name: &str,
    role: &str,
    socket: Option<&Listener>,
    envs: &[(&str, &str)],
) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([test_name, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE_ENV, role)
        .stdin(Stdio::null());
    if let Some(l) = socket {
        cmd.env(SOCKET_ENV, &l.path);
    }
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn child test process")
}

/// The child's end of the socket.
pub fn connect() -> UnixStream {
    let path = std::env::var(SOCKET_ENV).expect("socket path in env");
    let s = UnixStream::connect(path).expect("connect to parent");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s
}

/// Waits for the child and asserts it passed.
pub fn expect_success(mut child: Child, what: &str) {
    let status = child.wait().expect("wait for child");
    assert!(status.success(), "{what}: child process failed: {status}");
}

/// Number of open fds of this process.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}
