//! Loading the CUDA driver: the single entry point [`Cuda::init`], devices and contexts.
//!
//! cudarc loads `libcuda` lazily and panics when it is missing or lacks a symbol. Everything
//! in this crate goes through [`Cuda::init`], which first `dlopen`s the same library names
//! cudarc will try, checks the entry points every later call needs, reads the driver
//! version, and turns each failure into a typed [`Error`]. Entry points newer than that base
//! (VMM, fabric handles, DMA-BUF export) are checked with [`Cuda::require`] before use.
#![allow(unsafe_code)]

use std::ffi::{c_void, CString};
use std::fmt;
use std::mem::ManuallyDrop;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaContext};

use crate::error::{DriverVersion, Error, Result};
use crate::memory::DeviceBuffer;
use crate::stream::Stream;

/// Entry points the base of this crate calls (present in every driver since CUDA 10).
const BASE_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDeviceGetUuid",
    "cuDeviceCanAccessPeer",
    "cuDeviceGetP2PAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuCtxEnablePeerAccess",
    "cuCtxDisablePeerAccess",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetInfo_v2",
    "cuMemGetAddressRange_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyDtoD_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyPeerAsync",
    "cuMemsetD8_v2",
    "cuPointerGetAttribute",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuIpcGetEventHandle",
    "cuIpcOpenEventHandle",
];

/// The driver entry points [`Cuda::init`] requires (all present since CUDA 10); newer ones
/// are checked when used ([`Cuda::require`]).
pub fn required_driver_symbols() -> &'static [&'static str] {
    BASE_SYMBOLS
}

/// Turns a `CUresult` into `Ok` or an [`Error::Driver`] naming the call.
pub(crate) fn check(call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_error(call, r))
    }
}

/// Whether `r` is how a driver (or a sandbox in front of it) says "not here": not supported,
/// not permitted, or an operating-system refusal.
pub(crate) fn is_refusal(r: sys::CUresult) -> bool {
    matches!(
        r,
        sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
            | sys::CUresult::CUDA_ERROR_NOT_PERMITTED
            | sys::CUresult::CUDA_ERROR_OPERATING_SYSTEM
    )
}

/// [`Error::Refused`] for `feature`, keeping the driver's code.
pub(crate) fn refused(feature: &'static str, call: &'static str, r: sys::CUresult) -> Error {
    Error::Refused {
        feature,
        call,
        code: r as u32,
        name: format!("{r:?}"),
    }
}

pub(crate) fn driver_error(call: &'static str, r: sys::CUresult) -> Error {
    Error::Driver {
        call,
        code: r as u32,
        name: format!("{r:?}"),
    }
}

/// The context that was current on this thread before one of this crate's calls, made
/// current again when the guard drops: every call leaves the caller's binding as it found it,
/// so code on the same thread that uses the CUDA runtime (PyTorch, for one) is not disturbed.
///
/// Unlike cudarc's `bind_to_thread`, taking the guard does not read (and so consume) an error
/// that cudarc recorded for an earlier, unrelated call: `Drop` impls that release memory run
/// even while such an error is pending, and the error stays there for whoever asks.
#[must_use = "the previous context is restored when the guard drops"]
pub(crate) struct CurrentContext {
    previous: sys::CUcontext,
    changed: bool,
}

impl CurrentContext {
    /// Makes `ctx` current (if it is not already) until the guard drops.
    pub(crate) fn enter(ctx: sys::CUcontext) -> Result<Self> {
        let mut guard = Self::save()?;
        if guard.previous != ctx {
            // SAFETY: `ctx` is a live context (held by the caller's Device).
            check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })?;
            guard.changed = true;
        }
        Ok(guard)
    }

    /// Remembers the current context, to be restored on drop (for calls into cudarc, which
    /// binds its own context and leaves it bound).
    pub(crate) fn save() -> Result<Self> {
        let mut previous: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the driver is initialised (Cuda::init ran).
        check("cuCtxGetCurrent", unsafe {
            sys::cuCtxGetCurrent(&mut previous)
        })?;
        Ok(CurrentContext {
            previous,
            changed: false,
        })
    }
}

impl Drop for CurrentContext {
    fn drop(&mut self) {
        let mut now: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        let r = unsafe { sys::cuCtxGetCurrent(&mut now) };
        if self.changed || r != sys::CUresult::CUDA_SUCCESS || now != self.previous {
            // SAFETY: `previous` was current when the guard was taken (a context the caller
            // owns, or null, which unbinds); restoring it is what the caller expects.
            let _ = unsafe { sys::cuCtxSetCurrent(self.previous) };
        }
    }
}

/// Runs `f` (a call into cudarc, which binds contexts itself) and restores the thread's
/// current context afterwards.
pub(crate) fn keeping_current<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let _saved = CurrentContext::save()?;
    f()
}

/// Converts an error from cudarc's safe layer.
pub(crate) fn cudarc_error(call: &'static str, e: cudarc::driver::DriverError) -> Error {
    driver_error(call, e.0)
}

/// Tries to `dlopen` each candidate name; returns the first that loads. The library stays
/// loaded (cudarc opens it again by name and gets the same mapping).
///
/// This is the probe [`Cuda::init`] runs over cudarc's candidate names for `libcuda`.
///
/// # Errors
/// [`Error::DriverUnavailable`] listing the names tried when none loads.
pub fn probe_library(candidates: &[&str]) -> Result<String> {
    for name in candidates {
        let Ok(cname) = CString::new(*name) else {
            continue;
        };
        // SAFETY: cname is a valid C string. Loading the NVIDIA driver library runs its
        // initialisers, which is what using it requires anyway; the handle is kept (never
        // dlclosed) so the library is not unloaded under cudarc.
        let handle = unsafe { libc::dlopen(cname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if !handle.is_null() {
            return Ok((*name).to_string());
        }
    }
    Err(Error::DriverUnavailable {
        tried: candidates.join(", "),
    })
}

/// Whether the loaded driver library exports `symbol`. Only call after a successful probe.
pub(crate) fn has_symbol(symbol: &str) -> bool {
    // SAFETY: only reached after `probe` found the library, so `culib()` finds it too (same
    // candidate list) and does not panic; looking a symbol up has no side effects.
    unsafe { sys::culib().get::<*const c_void>(symbol.as_bytes()).is_ok() }
}

#[derive(Clone, Debug)]
enum ProbeFailure {
    Missing(String),
    MissingSymbol(&'static str),
    NoDevice,
    Driver(&'static str, sys::CUresult),
}

impl From<&ProbeFailure> for Error {
    fn from(f: &ProbeFailure) -> Self {
        match f {
            ProbeFailure::Missing(tried) => Error::DriverUnavailable {
                tried: tried.clone(),
            },
            ProbeFailure::MissingSymbol(symbol) => Error::MissingSymbol {
                feature: "the CUDA driver API",
                symbol,
            },
            ProbeFailure::NoDevice => Error::NoDevice,
            ProbeFailure::Driver(call, r) => driver_error(call, *r),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct DriverInfo {
    version: DriverVersion,
    device_count: usize,
}

fn probe() -> std::result::Result<DriverInfo, ProbeFailure> {
    let candidates = cudarc::get_lib_name_candidates("cuda");
    let mut refs: Vec<&str> = Vec::new();
    for c in &candidates {
        if !refs.contains(&c.as_str()) {
            refs.push(c);
        }
    }
    if let Err(Error::DriverUnavailable { tried }) = probe_library(&refs) {
        return Err(ProbeFailure::Missing(tried));
    }
    if let Some(missing) = BASE_SYMBOLS.iter().find(|s| !has_symbol(s)) {
        return Err(ProbeFailure::MissingSymbol(missing));
    }
    let mut version = 0;
    // SAFETY: the library and symbol are present; the out-pointer is valid.
    let r = unsafe { sys::cuDriverGetVersion(&mut version) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(ProbeFailure::Driver("cuDriverGetVersion", r));
    }
    // SAFETY: symbol present; cuInit has no pointer arguments.
    match unsafe { sys::cuInit(0) } {
        sys::CUresult::CUDA_SUCCESS => {}
        sys::CUresult::CUDA_ERROR_NO_DEVICE => return Err(ProbeFailure::NoDevice),
        r => return Err(ProbeFailure::Driver("cuInit", r)),
    }
    let mut count = 0;
    // SAFETY: symbol present, driver initialised, valid out-pointer.
    let r = unsafe { sys::cuDeviceGetCount(&mut count) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(ProbeFailure::Driver("cuDeviceGetCount", r));
    }
    device_count_check(count as usize).map_err(|_| ProbeFailure::NoDevice)?;
    Ok(DriverInfo {
        version: DriverVersion(version as u32),
        device_count: count as usize,
    })
}

/// The check [`Cuda::init`] applies to the driver's device count.
///
/// # Errors
/// [`Error::NoDevice`] for zero devices.
pub fn device_count_check(count: usize) -> Result<usize> {
    if count == 0 {
        Err(Error::NoDevice)
    } else {
        Ok(count)
    }
}

/// The loaded, initialised CUDA driver: the single entry point of this crate.
#[derive(Clone, Copy)]
pub struct Cuda {
    info: DriverInfo,
}

impl fmt::Debug for Cuda {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cuda")
            .field("driver_version", &self.info.version.to_string())
            .field("device_count", &self.info.device_count)
            .finish()
    }
}

impl Cuda {
    /// Loads and initialises the CUDA driver (once per process; later calls return the
    /// cached outcome).
    ///
    /// # Errors
    /// [`Error::DriverUnavailable`] when `libcuda.so.1` cannot be loaded (install the NVIDIA
    /// driver), [`Error::MissingSymbol`] for a driver too old for the base API,
    /// [`Error::NoDevice`] when the driver sees no GPU, [`Error::Driver`] when `cuInit` fails
    /// otherwise. Never panics.
    pub fn init() -> Result<Cuda> {
        static STATE: OnceLock<std::result::Result<DriverInfo, ProbeFailure>> = OnceLock::new();
        match STATE.get_or_init(probe) {
            Ok(info) => Ok(Cuda { info: *info }),
            Err(f) => Err(f.into()),
        }
    }

    /// The driver's CUDA version.
    pub fn driver_version(&self) -> DriverVersion {
        self.info.version
    }

    /// The file the driver library was loaded from (`dladdr` of `cuInit`), for reports: it
    /// tells the real NVIDIA driver from anything else named `libcuda.so` on the search path.
    pub fn library_path(&self) -> Option<std::path::PathBuf> {
        use std::os::unix::ffi::OsStrExt;
        // SAFETY: the library was found by `probe` (culib() finds it too and does not panic);
        // looking a symbol up has no side effects.
        let sym = unsafe { sys::culib().get::<*const c_void>(b"cuInit") }.ok()?;
        let addr: *const c_void = *sym;
        // SAFETY: Dl_info is plain data; dladdr fills it for an address inside a loaded object.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer; `addr` is the address of a loaded symbol.
        if unsafe { libc::dladdr(addr, &mut info) } == 0 || info.dli_fname.is_null() {
            return None;
        }
        // SAFETY: dladdr returned a NUL-terminated path owned by the loader.
        let name = unsafe { std::ffi::CStr::from_ptr(info.dli_fname) };
        Some(std::path::PathBuf::from(std::ffi::OsStr::from_bytes(
            name.to_bytes(),
        )))
    }

    /// The number of visible devices (at least one).
    pub fn device_count(&self) -> usize {
        self.info.device_count
    }

    /// Checks that the driver is at least `needed` and exports `symbol`, before a newer
    /// entry point is called (cudarc would panic on a missing symbol).
    ///
    /// # Errors
    /// [`Error::DriverTooOld`] or [`Error::MissingSymbol`].
    pub fn require(
        &self,
        feature: &'static str,
        needed: DriverVersion,
        symbol: &'static str,
    ) -> Result<()> {
        if self.info.version < needed {
            return Err(Error::DriverTooOld {
                feature,
                needed,
                found: self.info.version,
            });
        }
        if !has_symbol(symbol) {
            return Err(Error::MissingSymbol { feature, symbol });
        }
        Ok(())
    }

    /// Opens device `ordinal` (its primary context, shared with the CUDA runtime).
    ///
    /// # Errors
    /// [`Error::DeviceOutOfRange`], or [`Error::Driver`] if the context cannot be retained.
    pub fn device(&self, ordinal: usize) -> Result<Device> {
        if ordinal >= self.info.device_count {
            return Err(Error::DeviceOutOfRange {
                ordinal,
                count: self.info.device_count,
            });
        }
        let ctx = keeping_current(|| {
            CudaContext::new(ordinal).map_err(|e| cudarc_error("cuDevicePrimaryCtxRetain", e))
        })?;
        Ok(Device {
            cuda: *self,
            ordinal,
            ctx: ManuallyDrop::new(ctx),
        })
    }

    /// Opens every device.
    ///
    /// # Errors
    /// As [`Cuda::device`].
    pub fn devices(&self) -> Result<Vec<Device>> {
        (0..self.info.device_count)
            .map(|i| self.device(i))
            .collect()
    }
}

/// One GPU seen through one CUDA context. Cheap to clone (the context is shared).
#[derive(Clone)]
pub struct Device {
    cuda: Cuda,
    ordinal: usize,
    /// Dropped by hand in `Drop`, under a guard: cudarc binds the context to release it.
    ctx: ManuallyDrop<Arc<CudaContext>>,
}

impl Drop for Device {
    fn drop(&mut self) {
        let saved = CurrentContext::save();
        // SAFETY: dropped exactly once, here; the field is not used afterwards.
        let ctx = unsafe { ManuallyDrop::take(&mut self.ctx) };
        let raw = ctx.cu_ctx();
        let last = Arc::strong_count(&ctx) == 1;
        drop(ctx);
        if let Ok(mut saved) = saved {
            if last && saved.previous == raw {
                // The caller's context is the one just released: leave the thread unbound
                // rather than bind a dead context.
                saved.previous = std::ptr::null_mut();
                saved.changed = true;
            }
        }
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ordinal)
            .field("primary_context", &self.ctx.is_primary())
            .finish()
    }
}

impl Device {
    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The driver this device came from.
    pub fn cuda(&self) -> Cuda {
        self.cuda
    }

    /// The cudarc context, for interoperating with cudarc's own types.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Whether this is the device's primary context.
    pub fn is_primary_context(&self) -> bool {
        self.ctx.is_primary()
    }

    /// Makes this device's context current until the returned guard drops (see
    /// [`CurrentContext`]).
    pub(crate) fn bind(&self) -> Result<CurrentContext> {
        CurrentContext::enter(self.ctx.cu_ctx())
    }

    /// The device name, e.g. `NVIDIA H200`.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn name(&self) -> Result<String> {
        self.ctx
            .name()
            .map_err(|e| cudarc_error("cuDeviceGetName", e))
    }

    /// The device UUID.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn uuid(&self) -> Result<[u8; 16]> {
        let u = self
            .ctx
            .uuid()
            .map_err(|e| cudarc_error("cuDeviceGetUuid", e))?;
        Ok(u.bytes.map(|b| b as u8))
    }

    /// A device attribute (`cuDeviceGetAttribute`).
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn attribute(&self, attr: sys::CUdevice_attribute) -> Result<i32> {
        self.ctx
            .attribute(attr)
            .map_err(|e| cudarc_error("cuDeviceGetAttribute", e))
    }

    /// Free and total device memory in bytes.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        keeping_current(|| {
            self.ctx
                .mem_get_info()
                .map_err(|e| cudarc_error("cuMemGetInfo", e))
        })
    }

    /// Creates a second, independent (non-primary) context on the same GPU. Memory of one
    /// context is not the other's: copies between them go through
    /// [`copy_async`](crate::copy_async) like copies between devices.
    ///
    /// # Errors
    /// [`Error::MissingSymbol`] when the driver lacks `cuCtxCreate_v2`; [`Error::Driver`].
    pub fn new_context(&self) -> Result<Device> {
        if !has_symbol("cuCtxCreate_v2") {
            return Err(Error::MissingSymbol {
                feature: "a second context",
                symbol: "cuCtxCreate_v2",
            });
        }
        let _saved = CurrentContext::save()?;
        let dev = self.ctx.cu_device();
        let mut raw: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: symbol present; valid out-pointer; flags 0 = CU_CTX_SCHED_AUTO.
        check("cuCtxCreate_v2", unsafe {
            sys::cuCtxCreate_v2(&mut raw, 0, dev)
        })?;
        // SAFETY: `raw` is a context just created for `dev` and owned by nobody else; the
        // returned Arc destroys it (cuCtxDestroy_v2) when the last clone drops.
        let ctx = unsafe { CudaContext::from_raw_context(self.ordinal, dev, raw) };
        // On failure cudarc may already have wrapped (and so destroyed) the context, so it is
        // not destroyed again here: at worst a context leaks on a path that needs a failing
        // driver, never a double destroy.
        let ctx = ctx.map_err(|e| cudarc_error("cuCtxSetCurrent", e))?;
        Ok(Device {
            cuda: self.cuda,
            ordinal: self.ordinal,
            ctx: ManuallyDrop::new(ctx),
        })
    }

    /// Whether two `Device`s use the same CUDA context.
    pub fn same_context(&self, other: &Device) -> bool {
        self.ctx.cu_ctx() == other.ctx.cu_ctx()
    }

    /// Whether two `Device`s are the same GPU (possibly through different contexts).
    pub fn same_gpu(&self, other: &Device) -> bool {
        self.ctx.cu_device() == other.ctx.cu_device()
    }

    /// Creates a non-blocking stream in this context.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn new_stream(&self) -> Result<Stream> {
        Stream::new(self)
    }

    /// Allocates `len` bytes of device memory with `cuMemAlloc` (exportable by legacy IPC
    /// and DMA-BUF).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `len == 0`; [`Error::Driver`] (e.g. out of memory).
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer> {
        DeviceBuffer::new(self, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_typed() {
        let e = probe_library(&["libnvlink-p2p-no-such-driver.so.1", "libnope.so"]).unwrap_err();
        match &e {
            Error::DriverUnavailable { tried } => {
                assert_eq!(tried, "libnvlink-p2p-no-such-driver.so.1, libnope.so")
            }
            other => panic!("wrong variant {other:?}"),
        }
        let msg = e.to_string();
        assert!(msg.contains("install the NVIDIA driver"), "{msg}");
        assert!(msg.contains("libcuda.so.1"), "{msg}");
    }

    #[test]
    fn present_library_is_found() {
        // libc is always loadable: proves the probe can succeed, not only fail.
        assert_eq!(
            probe_library(&["libnvlink-p2p-no-such.so", "libc.so.6"]).unwrap(),
            "libc.so.6"
        );
    }

    #[test]
    fn zero_devices_is_no_device() {
        let e = device_count_check(0).unwrap_err();
        assert!(matches!(e, Error::NoDevice));
        assert!(e.to_string().contains("no CUDA device"), "{e}");
        assert_eq!(device_count_check(2).unwrap(), 2);
    }

    #[test]
    fn version_display() {
        assert_eq!(DriverVersion(12080).to_string(), "12.8");
        assert_eq!(DriverVersion(11070).to_string(), "11.7");
        assert!(DriverVersion(12030) > DriverVersion::DMA_BUF);
    }
}
