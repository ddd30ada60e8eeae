//! The behaviour without a CUDA driver or device: typed errors, never a panic.
mod common;

use common::*;
use nvlink_p2p::{probe_library, Cuda, Error};

#[test]
fn init_reports_missing_driver_or_no_device() {
    match Cuda::init() {
        Err(e) if gpu_required() => panic!("NVLINK_P2P_REQUIRE_GPU=1 but: {e}"),
        Err(e @ Error::DriverUnavailable { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("install the NVIDIA driver"), "{msg}");
            assert!(msg.contains("libcuda.so.1"), "{msg}");
            if let Error::DriverUnavailable { tried } = &e {
                assert!(tried.contains("libcuda.so.1"), "{tried}");
            }
            // The outcome is cached and stays the same error.
            assert!(matches!(Cuda::init(), Err(Error::DriverUnavailable { .. })));
        }
        Err(e @ Error::NoDevice) => assert!(e.to_string().contains("no CUDA device"), "{e}"),
        Ok(cuda) if gpu_required() => {
            // The state this machine must be in: a fact for the report, not a skip.
            assert_real_driver_when_required(&cuda);
            println!(
                "driver present as required: CUDA {} with {} device(s), library {:?} \
                 (the no-driver path is covered by probe_with_missing_library)",
                cuda.driver_version(),
                cuda.device_count(),
                cuda.library_path()
            );
        }
        Ok(cuda) => skip(format_args!("a CUDA driver {} with {} device(s) is present (the no-driver path is covered by probe_with_missing_library)",
            cuda.driver_version(),
            cuda.device_count()
        )),
        Err(other) => panic!("unexpected error variant: {other:?}"),
    }
}

#[test]
fn probe_with_missing_library() {
    let e = probe_library(&["libcuda-nvlink-p2p-test-missing.so.1"]).unwrap_err();
    assert!(
        matches!(e, Error::DriverUnavailable { ref tried } if tried == "libcuda-nvlink-p2p-test-missing.so.1")
    );
    assert!(e.to_string().contains("libcuda.so.1"), "{e}");
}

#[test]
fn out_of_range_device_is_typed() {
    let Ok(cuda) = Cuda::init() else {
        skip(format_args!(
            "no CUDA driver or device (device ordinals need one)"
        ));
        return;
    };
    let e = cuda.device(cuda.device_count()).unwrap_err();
    assert!(matches!(e, Error::DeviceOutOfRange { ordinal, count } if ordinal == count));
}

/// With every device hidden, the driver (where present) must report `NoDevice`; without a
/// driver the same code path reports `DriverUnavailable`. Runs in a child process because
/// the driver reads `CUDA_VISIBLE_DEVICES` once.
#[test]
fn hidden_devices_are_no_device() {
    if role().as_deref() == Some("hidden") {
        match Cuda::init() {
            Err(Error::NoDevice) => println!("variant: NoDevice"),
            Err(Error::DriverUnavailable { .. }) => println!("variant: DriverUnavailable"),
            other => panic!("expected NoDevice or DriverUnavailable, got {other:?}"),
        }
        return;
    }
    let child = spawn_child(
        "hidden_devices_are_no_device",
        "hidden",
        None,
        &[("CUDA_VISIBLE_DEVICES", "")],
    );
    expect_success(child, "hidden-devices child");
}

/// Says why a test did not run; with `NVLINK_P2P_REQUIRE_GPU=1` that fails instead.
fn skip(why: std::fmt::Arguments<'_>) {
    skip_or_fail(why, Limit::None);
}
