//! Helpers for tests that run two real processes: the test binary re-runs itself, filtered to
//! one test, with a role in the environment.
#![allow(dead_code)]

use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
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

/// The stand-in `libcuda.so` variants built from C at test time (never a GPU).
#[derive(Clone, Copy, Debug)]
pub enum Stub {
    /// Every base symbol; all but init/version/count fail with `CUDA_ERROR_UNKNOWN`.
    Full,
    /// `cuInit` only.
    Minimal,
    /// `fake_host_driver.c`: "device" memory in host memory, VMM over memfds.
    Host,
}

struct Stubs {
    full: PathBuf,
    minimal: PathBuf,
    host: PathBuf,
}

/// The directory holding `libcuda.so` of the `stub` variant (for `LD_LIBRARY_PATH`), or
/// `None` when it cannot be built (no `cc`).
pub fn stand_in(stub: Stub) -> Option<&'static Path> {
    static DIRS: OnceLock<Option<Stubs>> = OnceLock::new();
    let s = DIRS
        .get_or_init(|| {
            // Inside cargo's target dir (cleaned by `cargo clean`) when it is there; else /tmp.
            let target_tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
            let root = if std::fs::create_dir_all(target_tmp).is_ok() {
                target_tmp.join(format!("nvlink-fake-cuda-{}", std::process::id()))
            } else {
                std::env::temp_dir().join(format!("nvlink-fake-cuda-{}", std::process::id()))
            };
            let mut src = String::from(
                "#include <stdlib.h>\n\
                 static int env(const char *n, int d) { const char *v = getenv(n); return v ? atoi(v) : d; }\n\
                 int cuInit(unsigned int f) { (void)f; return env(\"FAKE_CUDA_INIT\", 0); }\n\
                 #ifndef MINIMAL\n\
                 int cuDriverGetVersion(int *v) { *v = env(\"FAKE_CUDA_VERSION\", 12080); return 0; }\n\
                 int cuDeviceGetCount(int *c) { *c = env(\"FAKE_CUDA_COUNT\", 1); return 0; }\n",
            );
            for s in nvlink_p2p::required_driver_symbols() {
                if !matches!(*s, "cuInit" | "cuDriverGetVersion" | "cuDeviceGetCount") {
                    // CUDA_ERROR_UNKNOWN: a valid CUresult, so cudarc can represent it.
                    src.push_str(&format!("int {s}(void) {{ return 999; }}\n"));
                }
            }
            src.push_str("#endif\n");
            let build = |dir: &Path, src: &str, define: Option<&str>| -> bool {
                let c = dir.join("stub.c");
                if std::fs::create_dir_all(dir).is_err() || std::fs::write(&c, src).is_err() {
                    return false;
                }
                let mut cmd = Command::new("cc");
                cmd.args(["-shared", "-fPIC", "-O1", "-o"])
                    .arg(dir.join("libcuda.so"))
                    .arg(&c);
                if let Some(d) = define {
                    cmd.arg(d);
                }
                matches!(cmd.status(), Ok(s) if s.success())
            };
            let stubs = Stubs {
                full: root.join("full"),
                minimal: root.join("minimal"),
                host: root.join("host"),
            };
            (build(&stubs.full, &src, None)
                && build(&stubs.minimal, &src, Some("-DMINIMAL"))
                && build(&stubs.host, include_str!("../fake_host_driver.c"), None))
            .then_some(stubs)
        })
        .as_ref()?;
    Some(match stub {
        Stub::Full => &s.full,
        Stub::Minimal => &s.minimal,
        Stub::Host => &s.host,
    })
}
