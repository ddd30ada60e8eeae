//! The probe against a stand-in `libcuda.so` built here from a few lines of C: a driver
//! that lacks base entry points, reports no device, fails `cuInit`, is too old for VMM, or
//! lacks a newer entry point. Each must be a typed error, never a panic (cudarc alone would
//! panic on a missing symbol). Each case runs in a child process with `LD_LIBRARY_PATH`
//! pointing at the stand-in (the driver is probed once per process).
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use common::*;
use nvlink_p2p::{required_driver_symbols, Cuda, DriverVersion, Error};

/// Builds the stand-in libraries once: `full/` (every base symbol) and `minimal/` (cuInit only).
fn stub_dirs() -> Option<&'static (PathBuf, PathBuf)> {
    static DIRS: OnceLock<Option<(PathBuf, PathBuf)>> = OnceLock::new();
    DIRS.get_or_init(|| {
        let root = std::env::temp_dir().join(format!("nvlink-fake-cuda-{}", std::process::id()));
        let mut src = String::from(
            "#include <stdlib.h>\n\
             static int env(const char *n, int d) { const char *v = getenv(n); return v ? atoi(v) : d; }\n\
             int cuInit(unsigned int f) { (void)f; return env(\"FAKE_CUDA_INIT\", 0); }\n\
             #ifndef MINIMAL\n\
             int cuDriverGetVersion(int *v) { *v = env(\"FAKE_CUDA_VERSION\", 12080); return 0; }\n\
             int cuDeviceGetCount(int *c) { *c = env(\"FAKE_CUDA_COUNT\", 1); return 0; }\n",
        );
        for s in required_driver_symbols() {
            if !matches!(*s, "cuInit" | "cuDriverGetVersion" | "cuDeviceGetCount") {
                // CUDA_ERROR_UNKNOWN: a valid CUresult, so cudarc can represent it.
                src.push_str(&format!("int {s}(void) {{ return 999; }}\n"));
            }
        }
        src.push_str("#endif\n");
        let build = |dir: &Path, minimal: bool| -> bool {
            let c = dir.join("stub.c");
            if std::fs::create_dir_all(dir).is_err() || std::fs::write(&c, &src).is_err() {
                return false;
            }
            let mut cmd = Command::new("cc");
            cmd.args(["-shared", "-fPIC", "-O0", "-o"])
                .arg(dir.join("libcuda.so"))
                .arg(&c);
            if minimal {
                cmd.arg("-DMINIMAL");
            }
            matches!(cmd.status(), Ok(s) if s.success())
        };
        let (full, minimal) = (root.join("full"), root.join("minimal"));
        (build(&full, false) && build(&minimal, true)).then_some((full, minimal))
    })
    .as_ref()
}

/// Runs `test` in a child with the stand-in driver and `envs`; true if it ran.
fn run_with_fake(test: &str, minimal: bool, envs: &[(&str, &str)]) -> bool {
    let Some((full, min)) = stub_dirs() else {
        println!("skipped: cannot build the stand-in driver (no C compiler `cc`, or no writable temp dir)");
        return false;
    };
    let dir = if minimal { min } else { full };
    let mut all = vec![("LD_LIBRARY_PATH", dir.to_str().unwrap())];
    all.extend_from_slice(envs);
    expect_success(spawn_child(test, "fake", None, &all), test);
    true
}

fn in_child() -> bool {
    role().as_deref() == Some("fake")
}

#[test]
fn driver_without_base_symbols_is_missing_symbol() {
    if in_child() {
        let e = Cuda::init().unwrap_err();
        assert!(
            matches!(
                e,
                Error::MissingSymbol {
                    symbol: "cuDriverGetVersion",
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("upgrade the NVIDIA driver"), "{e}");
        return;
    }
    run_with_fake("driver_without_base_symbols_is_missing_symbol", true, &[]);
}

#[test]
fn init_reporting_no_device_is_no_device() {
    if in_child() {
        assert!(matches!(Cuda::init(), Err(Error::NoDevice)));
        return;
    }
    run_with_fake(
        "init_reporting_no_device_is_no_device",
        false,
        &[("FAKE_CUDA_INIT", "100")],
    );
}

#[test]
fn zero_devices_is_no_device() {
    if in_child() {
        let e = Cuda::init().unwrap_err();
        assert!(matches!(e, Error::NoDevice), "{e:?}");
        return;
    }
    run_with_fake(
        "zero_devices_is_no_device",
        false,
        &[("FAKE_CUDA_COUNT", "0")],
    );
}

#[test]
fn failing_init_is_a_driver_error() {
    if in_child() {
        let e = Cuda::init().unwrap_err();
        match &e {
            Error::Driver { call, code, name } => {
                assert_eq!(
                    (*call, *code, name.as_str()),
                    ("cuInit", 999, "CUDA_ERROR_UNKNOWN")
                )
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(e.to_string(), "cuInit failed: CUDA_ERROR_UNKNOWN (999)");
        return;
    }
    run_with_fake(
        "failing_init_is_a_driver_error",
        false,
        &[("FAKE_CUDA_INIT", "999")],
    );
}

#[test]
fn old_driver_refuses_newer_features_without_calling_them() {
    if in_child() {
        let cuda = Cuda::init().unwrap();
        assert_eq!(cuda.driver_version(), DriverVersion(10010));
        assert_eq!(cuda.device_count(), 2);
        let e = cuda
            .require("VMM shareable handles", DriverVersion::VMM, "cuMemCreate")
            .unwrap_err();
        assert!(
            matches!(e, Error::DriverTooOld { needed, found, .. } if needed == DriverVersion::VMM && found == DriverVersion(10010)),
            "{e:?}"
        );
        assert!(
            e.to_string().contains("needs CUDA driver 10.2 or newer"),
            "{e}"
        );
        return;
    }
    run_with_fake(
        "old_driver_refuses_newer_features_without_calling_them",
        false,
        &[("FAKE_CUDA_VERSION", "10010"), ("FAKE_CUDA_COUNT", "2")],
    );
}

#[test]
fn missing_newer_entry_point_and_failing_context_are_typed() {
    if in_child() {
        let cuda = Cuda::init().unwrap();
        let e = cuda
            .require(
                "DMA-BUF export",
                DriverVersion::DMA_BUF,
                "cuMemGetHandleForAddressRange",
            )
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::MissingSymbol {
                    symbol: "cuMemGetHandleForAddressRange",
                    ..
                }
            ),
            "{e:?}"
        );
        // The stand-in fails every other call: opening a device is a typed error.
        let e = cuda.device(0).unwrap_err();
        assert!(matches!(e, Error::Driver { code: 999, .. }), "{e:?}");
        assert!(matches!(
            cuda.device(1),
            Err(Error::DeviceOutOfRange {
                ordinal: 1,
                count: 1
            })
        ));
        return;
    }
    run_with_fake(
        "missing_newer_entry_point_and_failing_context_are_typed",
        false,
        &[],
    );
}
