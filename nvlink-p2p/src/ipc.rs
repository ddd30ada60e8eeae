//! Legacy CUDA IPC: exporting `cuMemAlloc` memory as a 64-byte handle, opening it in another
//! process through a per-process cache, and IPC events for cross-process ordering.
//!
//! The cache: a handle that is already open in a context is not opened again; the new
//! [`IpcMapping`] shares the existing mapping (a lock and a hash lookup), and the handle is
//! closed (`cuIpcCloseMemHandle`, never `cuMemFree`) when the last mapping drops.
//!
//! The cache key is the context, the 64 handle bytes *and* the exporter's allocation id
//! ([`IpcMemHandle::allocation_id`]): the driver's handle bytes can repeat when the exporter
//! frees an allocation and makes a new one at the same place, and a key of the bytes alone
//! would then hand back the stale mapping of the old memory.
//!
//! A handle cannot be opened in the process that exported it (the driver refuses with
//! `CUDA_ERROR_INVALID_CONTEXT`): this process remembers the allocations it exported and
//! returns [`Error::IpcHandleFromThisProcess`] before calling the driver.
//!
//! The cross-process contract that no type system can enforce: the exporting process must
//! keep the allocation alive until every importer has dropped its mapping (exchange a
//! message over the socket you sent the handle on; fabric-core's cuda-ipc backend does).
#![allow(unsafe_code)]

use std::collections::HashSet;
use std::ffi::c_void;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{sys, CudaSlice, DevicePtr};

use crate::cache::{CacheStats, RefCache};
use crate::driver::{check, cudarc_error, CurrentContext, Device};
use crate::error::{Error, Result};
use crate::handle::{IpcEventHandle, IpcMemHandle};
use crate::memory::{DeviceBuffer, DeviceMemory, Sealed};
use crate::stream::Stream;

/// Context, handle bytes, exporter's allocation id.
type Key = (usize, [u8; 64], u64);

/// A fresh allocation id: a random start per process, then counted (never 0).
pub(crate) fn next_allocation_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static START: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let start = *START.get_or_init(|| {
        // std's hasher keys are random per process.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish()
    });
    match start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) {
        0 => start.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)),
        id => id,
    }
}

/// The allocation ids this process exported and has not freed.
fn exported() -> &'static Mutex<HashSet<u64>> {
    static E: OnceLock<Mutex<HashSet<u64>>> = OnceLock::new();
    E.get_or_init(|| Mutex::new(HashSet::new()))
}

pub(crate) fn forget_export(id: u64) {
    exported()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&id);
}

fn exported_here(id: u64) -> bool {
    id != 0
        && exported()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&id)
}

/// Value: the mapped pointer and the mapping's real size.
fn cache() -> &'static RefCache<Key, (u64, usize)> {
    static C: OnceLock<RefCache<Key, (u64, usize)>> = OnceLock::new();
    C.get_or_init(RefCache::new)
}

/// Hits, misses and open entries of this process's IPC mapping cache.
pub fn ipc_cache_stats() -> CacheStats {
    cache().stats()
}

/// Base and size of the allocation containing `ptr` (the right context must be current).
fn address_range(ptr: u64) -> Result<(u64, usize)> {
    let (mut base, mut size) = (0u64, 0usize);
    // SAFETY: valid out-pointers; the driver validates `ptr`.
    check("cuMemGetAddressRange_v2", unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
    })?;
    Ok((base, size))
}

/// Whether `ptr` comes from a memory pool (stream-ordered allocator).
fn from_memory_pool(ptr: u64) -> bool {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: MEMPOOL_HANDLE writes one CUmemoryPool through the out-pointer; drivers that
    // do not know the attribute return an error, which means "no pool".
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut pool as *mut sys::CUmemoryPool).cast::<c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
            ptr,
        )
    };
    r == sys::CUresult::CUDA_SUCCESS && !pool.is_null()
}

/// Exports the allocation starting at `ptr` (context of `uuid`'s device current) under
/// allocation id `id`.
fn export(ptr: u64, uuid: [u8; 16], id: u64) -> Result<IpcMemHandle> {
    if from_memory_pool(ptr) {
        return Err(Error::StreamOrderedAllocation);
    }
    let (base, size) = address_range(ptr)?;
    if base != ptr {
        return Err(Error::NotAllocationBase {
            ptr,
            offset: ptr - base,
        });
    }
    // SAFETY: CUipcMemHandle is plain bytes.
    let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; `ptr` is the base of a live allocation in the current
    // context (checked above).
    check("cuIpcGetMemHandle", unsafe {
        sys::cuIpcGetMemHandle(&mut h, ptr)
    })?;
    exported()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id);
    Ok(
        IpcMemHandle::from_parts(h.reserved.map(|c| c as u8), size as u64, uuid)
            .with_allocation_id(id),
    )
}

impl DeviceBuffer {
    /// Exports this allocation as a legacy IPC handle for another process.
    ///
    /// # Errors
    /// [`Error::Driver`] (e.g. on platforms without legacy IPC).
    pub fn ipc_handle(&self) -> Result<IpcMemHandle> {
        let _ctx = self.device().bind()?;
        let h = export(self.device_ptr(), self.device().uuid()?, self.id)?;
        self.exported.store(true, Ordering::Relaxed);
        Ok(h)
    }
}

/// Exports a cudarc allocation as a legacy IPC handle.
///
/// cudarc allocates from the stream-ordered allocator when the device supports memory
/// pools; such memory cannot be exported and is refused with
/// [`Error::StreamOrderedAllocation`] (use [`DeviceBuffer`] instead).
///
/// This crate cannot see when cudarc frees the slice, so each call gives the handle a new
/// allocation id: export a slice once and share that handle.
///
/// # Errors
/// [`Error::StreamOrderedAllocation`], [`Error::NotAllocationBase`], [`Error::Driver`].
pub fn ipc_handle_of_cudarc_slice<T>(slice: &CudaSlice<T>) -> Result<IpcMemHandle> {
    let ctx = slice.context();
    let _ctx = CurrentContext::enter(ctx.cu_ctx())?;
    let uuid = ctx
        .uuid()
        .map_err(|e| cudarc_error("cuDeviceGetUuid", e))?
        .bytes
        .map(|b| b as u8);
    let (ptr, _sync) = slice.device_ptr(slice.stream());
    export(ptr, uuid, next_allocation_id())
}

impl IpcMemHandle {
    /// Opens the exported allocation in `device`'s context (another process than the
    /// exporter's). If this process already has the handle open in that context, the
    /// existing mapping is shared (see [`IpcMapping::was_cached`]).
    ///
    /// # Errors
    /// [`Error::IpcHandleFromThisProcess`] for a handle this process exported;
    /// [`Error::Driver`] when the driver rejects the handle (forged bytes, exporter gone);
    /// [`Error::InvalidArgument`] when the handle claims more bytes than the mapped
    /// allocation has.
    pub fn open(&self, device: &Device) -> Result<IpcMapping> {
        if exported_here(self.allocation_id()) {
            return Err(Error::IpcHandleFromThisProcess);
        }
        let key = (
            device.context().cu_ctx() as usize,
            *self.raw(),
            self.allocation_id(),
        );
        let ((ptr, real), hit) = cache().acquire(&key, || {
            let _ctx = device.bind()?;
            let h = sys::CUipcMemHandle {
                reserved: self.raw().map(|b| b as std::ffi::c_char),
            };
            let mut ptr = 0;
            // SAFETY: valid out-pointer; the handle is plain bytes the driver validates.
            check("cuIpcOpenMemHandle_v2", unsafe {
                sys::cuIpcOpenMemHandle_v2(
                    &mut ptr,
                    h,
                    sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
                )
            })?;
            // Never trust the peer's size: remember how large the mapping really is. A driver
            // that cannot tell leaves the size unchecked (an overlong copy would then fault on
            // the GPU, it cannot touch host memory).
            let real = address_range(ptr).map_or(usize::MAX, |(_, real)| real);
            Ok::<_, Error>((ptr, real))
        })?;
        let mapping = IpcMapping {
            device: device.clone(),
            key,
            ptr,
            len: self.len() as usize,
            cached: hit,
        };
        if (real as u64) < self.len() {
            // Dropping `mapping` releases the reference.
            return Err(Error::InvalidArgument(format!(
                "IPC handle claims {} bytes but the mapped allocation has {real}",
                self.len()
            )));
        }
        Ok(mapping)
    }
}

/// Another process's `cuMemAlloc` allocation mapped into this one. Dropping the last
/// mapping of a handle closes it (`cuIpcCloseMemHandle`); the memory stays the exporter's.
pub struct IpcMapping {
    device: Device,
    key: Key,
    ptr: u64,
    len: usize,
    cached: bool,
}

impl fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcMapping")
            .field("device", &self.device.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("cached", &self.cached)
            .finish()
    }
}

impl IpcMapping {
    /// Whether this open was served by the cache (the handle was already open here).
    pub fn was_cached(&self) -> bool {
        self.cached
    }
}

impl Sealed for IpcMapping {}
impl DeviceMemory for IpcMapping {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn device(&self) -> &Device {
        &self.device
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let device = &self.device;
        cache().release(&self.key, |(ptr, _)| {
            if let Ok(_ctx) = device.bind() {
                // SAFETY: `ptr` came from cuIpcOpenMemHandle in this context and this was the
                // last reference to it; it is closed exactly once.
                let _ = unsafe { sys::cuIpcCloseMemHandle(ptr) };
            }
        });
    }
}

/// A CUDA event that can be shared between processes (`CU_EVENT_INTERPROCESS`, no timing).
///
/// The exporter records it after queueing work and tells the importer (e.g. over the socket)
/// that it did; the importer then makes a stream wait on it or synchronizes. Waiting before
/// the first record returns immediately: the message is what orders the two.
pub struct IpcEvent {
    device: Device,
    event: sys::CUevent,
}

// SAFETY: a CUevent is a handle to driver-side state; the driver API is thread-safe for
// events, and every use binds the owning context first.
unsafe impl Send for IpcEvent {}
// SAFETY: as above; no method hands out interior references.
unsafe impl Sync for IpcEvent {}

impl fmt::Debug for IpcEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcEvent")
            .field("device", &self.device.ordinal())
            .finish()
    }
}

impl IpcEvent {
    /// Creates an interprocess event in `device`'s context.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn new(device: &Device) -> Result<Self> {
        let _ctx = device.bind()?;
        let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        let mut event = std::ptr::null_mut();
        // SAFETY: valid out-pointer; INTERPROCESS requires DISABLE_TIMING, which is set.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut event, flags)
        })?;
        Ok(IpcEvent {
            device: device.clone(),
            event,
        })
    }

    /// The handle another process opens with [`IpcEventHandle::open`].
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn handle(&self) -> Result<IpcEventHandle> {
        let _ctx = self.device.bind()?;
        // SAFETY: plain bytes.
        let mut h: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer; the event is live and interprocess.
        check("cuIpcGetEventHandle", unsafe {
            sys::cuIpcGetEventHandle(&mut h, self.event)
        })?;
        Ok(IpcEventHandle::from_raw(h.reserved.map(|c| c as u8)))
    }

    /// Records the event on `stream` (which must be in the event's context).
    ///
    /// # Errors
    /// [`Error::ContextMismatch`], [`Error::Driver`].
    pub fn record(&self, stream: &Stream) -> Result<()> {
        if !stream.device().same_context(&self.device) {
            return Err(Error::ContextMismatch(
                "an event can only be recorded on a stream of its own context".into(),
            ));
        }
        let _ctx = self.device.bind()?;
        // SAFETY: event and stream are live and belong to the current context.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(self.event, stream.cu_stream())
        })
    }

    /// Whether the work before the last record has completed.
    ///
    /// # Errors
    /// [`Error::Driver`] if that work failed.
    pub fn query(&self) -> Result<bool> {
        let _ctx = self.device.bind()?;
        // SAFETY: the event is live.
        match unsafe { sys::cuEventQuery(self.event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuEventQuery", r).map(|()| false),
        }
    }

    /// Blocks until the work before the last record has completed.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn synchronize(&self) -> Result<()> {
        let _ctx = self.device.bind()?;
        // SAFETY: the event is live.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(self.event)
        })
    }

    /// The raw `CUevent`, valid while `self` lives.
    pub fn cu_event(&self) -> sys::CUevent {
        self.event
    }
}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        if let Ok(_ctx) = self.device.bind() {
            // SAFETY: created or opened by us, destroyed once (opened IPC events are
            // released with cuEventDestroy too).
            let _ = unsafe { sys::cuEventDestroy_v2(self.event) };
        }
    }
}

impl IpcEventHandle {
    /// Opens another process's interprocess event in `device`'s context.
    ///
    /// # Errors
    /// [`Error::Driver`] when the driver rejects the handle.
    pub fn open(&self, device: &Device) -> Result<IpcEvent> {
        let _ctx = device.bind()?;
        let h = sys::CUipcEventHandle {
            reserved: self.raw().map(|b| b as std::ffi::c_char),
        };
        let mut event = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the driver validates the handle bytes.
        check("cuIpcOpenEventHandle", unsafe {
            sys::cuIpcOpenEventHandle(&mut event, h)
        })?;
        Ok(IpcEvent {
            device: device.clone(),
            event,
        })
    }
}

impl Stream {
    /// Makes later work on this stream wait for the last record of `event`.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn wait_event(&self, event: &IpcEvent) -> Result<()> {
        self.wait_raw_event(event.cu_event())
    }
}
