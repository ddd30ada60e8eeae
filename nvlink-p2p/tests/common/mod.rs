//! Helpers for tests that run two real processes: the test binary re-runs itself, filtered to
//! one test, with a role in the environment.
#![allow(dead_code)]

use std::io::Write;
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

/// The symbol every stand-in driver of these tests exports (the real driver does not).
pub const STAND_IN_MARKER: &str = "nvlink_p2p_stand_in_driver";

/// Whether the driver `cuda` was loaded from is one of these tests' stand-ins (`None`: the
/// library path is unknown).
pub fn loaded_driver_is_stand_in(cuda: &nvlink_p2p::Cuda) -> Option<bool> {
    let path = cuda.library_path()?;
    let c = std::ffi::CString::new(path.to_str()?).ok()?;
    let sym = std::ffi::CString::new(STAND_IN_MARKER).unwrap();
    // SAFETY: RTLD_NOLOAD only returns the already loaded library; dlsym has no side effects.
    #[allow(unsafe_code)]
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if h.is_null() {
            return None;
        }
        Some(!libc::dlsym(h, sym.as_ptr()).is_null())
    }
}

/// `Cuda::init` in a child that must run against a stand-in: fails if the real driver (or
/// anything but a stand-in) was loaded, so a stand-in test can never pass or fail against a
/// GPU by accident.
pub fn stand_in_cuda() -> nvlink_p2p::Cuda {
    let cuda = nvlink_p2p::Cuda::init().expect("the stand-in driver initialises");
    assert_eq!(
        loaded_driver_is_stand_in(&cuda),
        Some(true),
        "expected a stand-in libcuda.so, but {:?} was loaded",
        cuda.library_path()
    );
    cuda
}

/// `Cuda::init` in a test that must run against the real driver when one is required
/// (`NVLINK_P2P_REQUIRE_GPU=1` without `NVLINK_P2P_STANDIN`): a stand-in `libcuda.so` found
/// on the search path in place of the real one is a failure, never a pass.
pub fn assert_real_driver_when_required(cuda: &nvlink_p2p::Cuda) {
    let required = std::env::var("NVLINK_P2P_REQUIRE_GPU").as_deref() == Ok("1")
        && std::env::var("NVLINK_P2P_STANDIN").is_err();
    if required {
        assert_eq!(
            loaded_driver_is_stand_in(cuda),
            Some(false),
            "NVLINK_P2P_REQUIRE_GPU=1: {:?} is a stand-in (or unknown), not the NVIDIA driver",
            cuda.library_path()
        );
    }
}

/// Whether this run must have a GPU (`NVLINK_P2P_REQUIRE_GPU=1`, set by `ci/gpu/run.sh`).
pub fn gpu_required() -> bool {
    std::env::var("NVLINK_P2P_REQUIRE_GPU").as_deref() == Ok("1")
}

/// A named limit that a GPU machine may have without that being a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// The machine has one GPU: two-GPU checks cannot run.
    OneGpu,
    /// The driver (or a sandbox around it) refuses this feature, and the GPU probe that
    /// `ci/gpu/run.sh` runs first found the same (`NVLINK_P2P_PROBE_REFUSED`, a comma
    /// list of: `ipc`, `vmm`, `dmabuf`, `fabric`).
    RefusedHere(&'static str),
    /// A tool the test needs is missing (a C compiler for the stand-in drivers).
    Tool,
    /// Not an expected limit: on a machine that must have a GPU this skip is a failure.
    None,
}

/// Says why (part of) a test does not run. Without `NVLINK_P2P_REQUIRE_GPU=1` that is a
/// `skipped: WHY [test]` line. With it, only a named limit this machine is expected to have
/// passes (as a `limit: WHY [test]` line, for the report); any other skip fails the test.
pub fn skip_or_fail(why: std::fmt::Arguments<'_>, limit: Limit) {
    let test = std::thread::current().name().unwrap_or("?").to_owned();
    let allowed = match limit {
        Limit::OneGpu | Limit::Tool => true,
        Limit::RefusedHere(feature) => std::env::var("NVLINK_P2P_PROBE_REFUSED")
            .map(|list| list.split(',').any(|f| f.trim() == feature))
            .unwrap_or(false),
        Limit::None => false,
    };
    // Past libtest's capture, so that a plain `cargo test` shows it too.
    let mut out = std::io::stdout();
    if !gpu_required() {
        let _ = writeln!(out, "skipped: {why} [{test}]");
    } else if allowed {
        let _ = writeln!(out, "limit: {why} ({limit:?}) [{test}]");
    } else {
        panic!(
            "NVLINK_P2P_REQUIRE_GPU=1, but this would skip ({limit:?}, not an expected limit of \
             this machine per the GPU probe): {why}"
        );
    }
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
                 int nvlink_p2p_stand_in_driver(void) { return 1; }\n\
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
