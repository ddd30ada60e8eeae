//! The CUDA virtual memory management API (`cuMem*`): physical allocations shareable as a
//! POSIX fd (any two processes on a node) or a fabric handle (multi-node NVLink through
//! IMEX), imported, mapped into a reserved address range, and made accessible.
//!
//! Ownership: a [`VmmAllocation`] is the physical memory (released on drop); a
//! [`VmmMapping`] maps it (unmapped and its address range freed on drop) and holds an `Arc`
//! of the allocation; an exported fd is an ordinary [`OwnedFd`]. Drop them in any order:
//! the driver frees the memory when the last of allocation handle, mapping and importer's
//! handle is gone, and none of them leaks.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::fmt;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;

use crate::driver::{check, driver_error, is_refusal, refused, Device};
use crate::error::{DriverVersion, Error, Result};
use crate::handle::{FabricHandle, ShareableHandleType, VmmDescriptor};
use crate::memory::{DeviceMemory, Sealed};

fn cu_type(t: ShareableHandleType) -> sys::CUmemAllocationHandleType {
    match t {
        ShareableHandleType::PosixFd => {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        }
        ShareableHandleType::Fabric => sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_FABRIC,
    }
}

fn prop(device: &Device, t: ShareableHandleType) -> Result<sys::CUmemAllocationProp> {
    // SAFETY: CUmemAllocationProp is plain data; all-zero is its documented default.
    let mut p: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    p.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    p.requestedHandleTypes = cu_type(t);
    p.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device.context().cu_device();
    let rdma = device.attribute(
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
    )?;
    // Lets the memory be exported as DMA-BUF / registered with a NIC.
    p.allocFlags.gpuDirectRDMACapable = u8::from(rdma != 0);
    Ok(p)
}

fn require_vmm(device: &Device, t: ShareableHandleType) -> Result<()> {
    use sys::CUdevice_attribute as A;
    let cuda = device.cuda();
    match t {
        ShareableHandleType::PosixFd => {
            cuda.require("VMM shareable handles", DriverVersion::VMM, "cuMemCreate")?
        }
        ShareableHandleType::Fabric => {
            cuda.require("fabric handles", DriverVersion::FABRIC, "cuMemCreate")?
        }
    }
    if device.attribute(A::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)? == 0 {
        return Err(Error::Unsupported {
            feature: "VMM (cuMemCreate)",
            reason: format!(
                "device {} reports no virtual memory management support",
                device.ordinal()
            ),
        });
    }
    let (attr, feature) = match t {
        ShareableHandleType::PosixFd => (
            A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            "POSIX-fd shareable handles",
        ),
        ShareableHandleType::Fabric => (
            A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
            "fabric handles",
        ),
    };
    if device.attribute(attr)? == 0 {
        return Err(Error::Unsupported {
            feature,
            reason: format!(
                "device {} does not report support for them",
                device.ordinal()
            ),
        });
    }
    Ok(())
}

/// The allocation granularity for `device` (sizes and mappings are multiples of it).
///
/// # Errors
/// [`Error::DriverTooOld`], [`Error::Unsupported`], [`Error::Driver`].
pub fn granularity(device: &Device) -> Result<usize> {
    require_vmm(device, ShareableHandleType::PosixFd)?;
    granularity_for(device, ShareableHandleType::PosixFd)
}

fn granularity_for(device: &Device, t: ShareableHandleType) -> Result<usize> {
    let p = prop(device, t)?;
    let mut g = 0usize;
    // SAFETY: valid out-pointer and property struct.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &p,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(g.max(1))
}

/// Physical GPU memory from `cuMemCreate` (or imported from another process), released
/// (`cuMemRelease`) on drop.
pub struct VmmAllocation {
    device: Device,
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
    handle_type: ShareableHandleType,
    gpu_direct_rdma: bool,
}

impl fmt::Debug for VmmAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VmmAllocation")
            .field("device", &self.device.ordinal())
            .field("size", &self.size)
            .field("handle_type", &self.handle_type)
            .finish()
    }
}

impl VmmAllocation {
    /// Allocates at least `size` bytes (rounded up to the granularity) on `device`,
    /// shareable as a POSIX fd.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `size == 0`; [`Error::DriverTooOld`] /
    /// [`Error::Unsupported`] where VMM or fd handles are missing; [`Error::Driver`].
    pub fn new(device: &Device, size: usize) -> Result<Arc<Self>> {
        Self::create(device, size, ShareableHandleType::PosixFd)
    }

    /// Allocates at least `size` bytes shareable as a fabric handle (multi-node NVLink).
    ///
    /// # Errors
    /// [`Error::Unsupported`] when the device, driver or system (no IMEX channel) cannot —
    /// found by actually allocating, since the device attribute alone can claim support
    /// that is not there; otherwise as [`VmmAllocation::new`].
    pub fn new_fabric(device: &Device, size: usize) -> Result<Arc<Self>> {
        Self::create(device, size, ShareableHandleType::Fabric)
    }

    fn create(device: &Device, size: usize, t: ShareableHandleType) -> Result<Arc<Self>> {
        if size == 0 {
            return Err(Error::InvalidArgument(
                "a VMM allocation needs at least one byte".into(),
            ));
        }
        require_vmm(device, t)?;
        let _ctx = device.bind()?;
        let g = granularity_for(device, t)?;
        let size = size.div_ceil(g) * g;
        let mut p = prop(device, t)?;
        let mut handle = 0;
        // SAFETY: valid out-pointer and property struct; flags must be 0.
        let mut r = unsafe { sys::cuMemCreate(&mut handle, size, &p, 0) };
        if r != sys::CUresult::CUDA_SUCCESS && p.allocFlags.gpuDirectRDMACapable != 0 {
            // Some drivers (and sandboxes) claim GPUDirect RDMA with VMM but refuse the flag:
            // the memory is still useful without it (it just cannot go to a NIC directly).
            p.allocFlags.gpuDirectRDMACapable = 0;
            // SAFETY: as above.
            r = unsafe { sys::cuMemCreate(&mut handle, size, &p, 0) };
        }
        if r != sys::CUresult::CUDA_SUCCESS {
            if t == ShareableHandleType::Fabric
                && matches!(
                    r,
                    sys::CUresult::CUDA_ERROR_NOT_PERMITTED
                        | sys::CUresult::CUDA_ERROR_NOT_SUPPORTED
                        | sys::CUresult::CUDA_ERROR_INVALID_VALUE
                        | sys::CUresult::CUDA_ERROR_INVALID_DEVICE
                )
            {
                // The device attribute claims support, but the system has no usable IMEX
                // channel (nvidia-imex daemon and /dev/nvidia-caps-imex-channels).
                return Err(refused("fabric handles", "cuMemCreate", r));
            }
            return Err(driver_error("cuMemCreate", r));
        }
        Ok(Arc::new(VmmAllocation {
            device: device.clone(),
            handle,
            size,
            handle_type: t,
            gpu_direct_rdma: p.allocFlags.gpuDirectRDMACapable != 0,
        }))
    }

    /// Whether the memory was created GPUDirect-RDMA capable (registrable with a NIC). False
    /// when the device does not offer it, or the driver refused the flag (the allocation was
    /// then retried without it); always false for imported allocations (unknown).
    pub fn gpu_direct_rdma(&self) -> bool {
        self.gpu_direct_rdma
    }

    /// The size in bytes (a multiple of the granularity).
    pub fn size(&self) -> usize {
        self.size
    }

    /// The device the allocation was created or imported on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// How the allocation can be shared.
    pub fn handle_type(&self) -> ShareableHandleType {
        self.handle_type
    }

    /// What an importer needs next to the fd or fabric handle.
    ///
    /// # Errors
    /// [`Error::Driver`] if the device UUID cannot be read.
    pub fn descriptor(&self) -> Result<VmmDescriptor> {
        Ok(VmmDescriptor {
            size: self.size as u64,
            device_uuid: self.device.uuid()?,
            handle_type: self.handle_type,
        })
    }

    /// Exports the allocation as a POSIX fd (close-on-exec is up to the receiver; pass it
    /// with [`send_with_fds`](crate::fd_passing::send_with_fds)).
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a fabric allocation; [`Error::Driver`].
    pub fn export_fd(&self) -> Result<OwnedFd> {
        if self.handle_type != ShareableHandleType::PosixFd {
            return Err(Error::Unsupported {
                feature: "exporting a POSIX fd",
                reason: "the allocation was created for fabric handles".into(),
            });
        }
        let _ctx = self.device.bind()?;
        let mut fd: libc::c_int = -1;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the driver writes one int through the pointer.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut libc::c_int).cast::<c_void>(),
                self.handle,
                cu_type(ShareableHandleType::PosixFd),
                0,
            )
        })?;
        // SAFETY: the driver returned a new fd that we own.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// Exports the allocation as a fabric handle.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for a POSIX-fd allocation; [`Error::Driver`].
    pub fn export_fabric(&self) -> Result<FabricHandle> {
        if self.handle_type != ShareableHandleType::Fabric {
            return Err(Error::Unsupported {
                feature: "exporting a fabric handle",
                reason: "the allocation was created for POSIX-fd handles (use VmmAllocation::new_fabric)".into(),
            });
        }
        let _ctx = self.device.bind()?;
        // SAFETY: plain bytes.
        let mut h: sys::CUmemFabricHandle = unsafe { std::mem::zeroed() };
        // SAFETY: for FABRIC the driver writes one CUmemFabricHandle through the pointer.
        let r = unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut h as *mut sys::CUmemFabricHandle).cast::<c_void>(),
                self.handle,
                cu_type(ShareableHandleType::Fabric),
                0,
            )
        };
        if is_refusal(r) {
            // No usable IMEX channel (nvidia-imex daemon and /dev/nvidia-caps-imex-channels).
            return Err(refused("fabric handles", "cuMemExportToShareableHandle", r));
        }
        check("cuMemExportToShareableHandle", r)?;
        Ok(FabricHandle::from_parts(
            h.data,
            self.size as u64,
            self.device.uuid()?,
        ))
    }

    /// Imports an allocation another process exported as a POSIX fd. The fd is not consumed
    /// (close it whenever you like).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `desc` is not a POSIX-fd descriptor; as
    /// [`VmmAllocation::new`] otherwise.
    pub fn import_fd(
        device: &Device,
        fd: BorrowedFd<'_>,
        desc: &VmmDescriptor,
    ) -> Result<Arc<Self>> {
        if desc.handle_type != ShareableHandleType::PosixFd {
            return Err(Error::InvalidArgument(
                "descriptor is not for a POSIX-fd handle".into(),
            ));
        }
        require_vmm(device, ShareableHandleType::PosixFd)?;
        let _ctx = device.bind()?;
        let size = checked_peer_size(device, ShareableHandleType::PosixFd, desc.size)?;
        let mut handle = 0;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the "pointer" is the fd value itself; the driver
        // validates it and does not take ownership.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut c_void,
                cu_type(ShareableHandleType::PosixFd),
            )
        })?;
        Ok(Arc::new(VmmAllocation {
            device: device.clone(),
            handle,
            size,
            handle_type: ShareableHandleType::PosixFd,
            gpu_direct_rdma: false,
        }))
    }

    /// Imports an allocation exported as a fabric handle (this or another node).
    ///
    /// # Errors
    /// As [`VmmAllocation::new_fabric`].
    pub fn import_fabric(device: &Device, handle: &FabricHandle) -> Result<Arc<Self>> {
        require_vmm(device, ShareableHandleType::Fabric)?;
        let _ctx = device.bind()?;
        let size = checked_peer_size(device, ShareableHandleType::Fabric, handle.size())?;
        let mut raw = sys::CUmemFabricHandle {
            data: *handle.raw(),
        };
        let mut h = 0;
        // SAFETY: for FABRIC the driver reads one CUmemFabricHandle through the pointer.
        let r = unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                (&mut raw as *mut sys::CUmemFabricHandle).cast::<c_void>(),
                cu_type(ShareableHandleType::Fabric),
            )
        };
        if is_refusal(r) {
            return Err(refused(
                "fabric handles",
                "cuMemImportFromShareableHandle",
                r,
            ));
        }
        check("cuMemImportFromShareableHandle", r)?;
        Ok(Arc::new(VmmAllocation {
            device: device.clone(),
            handle: h,
            size,
            handle_type: ShareableHandleType::Fabric,
            gpu_direct_rdma: false,
        }))
    }
}

impl Drop for VmmAllocation {
    fn drop(&mut self) {
        if let Ok(_ctx) = self.device.bind() {
            // SAFETY: the handle is ours and released once; mappings hold an Arc of us, so
            // none is left (and the driver would keep mapped memory alive anyway).
            let _ = unsafe { sys::cuMemRelease(self.handle) };
        }
    }
}

/// A size an importer got from a peer, checked before the driver sees it: non-zero, within
/// the address space, and a multiple of the allocation granularity (a larger size than the
/// real allocation is then refused by `cuMemMap`, a typed error, not a fault).
fn checked_peer_size(device: &Device, t: ShareableHandleType, size: u64) -> Result<usize> {
    let g = granularity_for(device, t)?;
    match usize::try_from(size) {
        Ok(s) if s != 0 && s % g == 0 => Ok(s),
        _ => Err(Error::InvalidArgument(format!(
            "a peer's VMM allocation size {size} is not a non-zero multiple of the \
             {g}-byte allocation granularity"
        ))),
    }
}

/// Whether fabric handles work on `device`, found by a real probe: create a small fabric
/// allocation, export it, import the handle again, and release both.
///
/// Any driver refusal along the way (no IMEX channel, a sandbox, an unsupported platform)
/// is `Ok(Err(reason))`, "no fabric", with the step and the driver's code in the reason.
///
/// # Errors
/// Only a failure to reach the device at all (its attributes or context).
pub fn fabric_support(device: &Device) -> Result<std::result::Result<(), String>> {
    let step = |what: &str, e: Error| -> Result<std::result::Result<(), String>> {
        match e {
            e @ (Error::Unsupported { .. }
            | Error::DriverTooOld { .. }
            | Error::MissingSymbol { .. }
            | Error::Refused { .. }
            | Error::Driver { .. }) => Ok(Err(format!("{what}: {e}"))),
            e => Err(e),
        }
    };
    let alloc = match VmmAllocation::new_fabric(device, 1) {
        Ok(a) => a,
        Err(e) => return step("create", e),
    };
    let handle = match alloc.export_fabric() {
        Ok(h) => h,
        Err(e) => return step("export", e),
    };
    match VmmAllocation::import_fabric(device, &handle) {
        Ok(imported) => {
            drop(imported);
            Ok(Ok(()))
        }
        Err(e) => step("import", e),
    }
}

/// A [`VmmAllocation`] mapped at a reserved device address range, readable and writable
/// from its device. Unmapped and the range freed on drop.
pub struct VmmMapping {
    alloc: Arc<VmmAllocation>,
    ptr: u64,
}

impl fmt::Debug for VmmMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VmmMapping")
            .field("alloc", &self.alloc)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .finish()
    }
}

impl VmmMapping {
    /// Reserves an address range, maps `alloc` there and grants its device read/write
    /// access.
    ///
    /// # Errors
    /// [`Error::Driver`]; nothing is left reserved or mapped on failure.
    pub fn new(alloc: &Arc<VmmAllocation>) -> Result<Self> {
        let device = alloc.device();
        let _ctx = device.bind()?;
        let size = alloc.size;
        let mut ptr = 0;
        // SAFETY: valid out-pointer; size is a granularity multiple; no fixed address.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, size, 0, 0, 0)
        })?;
        // SAFETY: the range was just reserved with this size; the handle is live.
        let r = unsafe { sys::cuMemMap(ptr, size, 0, alloc.handle, 0) };
        if let Err(e) = check("cuMemMap", r) {
            // SAFETY: reserved above, not mapped.
            unsafe { sys::cuMemAddressFree(ptr, size) };
            return Err(e);
        }
        let mapping = VmmMapping {
            alloc: alloc.clone(),
            ptr,
        };
        // On failure the Drop below unmaps and frees.
        mapping.grant_access(device)?;
        Ok(mapping)
    }

    /// Grants `device` read/write access to the mapping (e.g. a peer GPU).
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn grant_access(&self, device: &Device) -> Result<()> {
        let _ctx = self.alloc.device().bind()?;
        let desc = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: device.context().cu_device(),
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the range is mapped (we own the mapping); one valid descriptor.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(self.ptr, self.alloc.size, &desc, 1)
        })
    }

    /// The mapped allocation.
    pub fn allocation(&self) -> &Arc<VmmAllocation> {
        &self.alloc
    }
}

impl Sealed for VmmMapping {}
impl DeviceMemory for VmmMapping {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.alloc.size
    }
    fn device(&self) -> &Device {
        self.alloc.device()
    }
}

impl Drop for VmmMapping {
    fn drop(&mut self) {
        if let Ok(_ctx) = self.alloc.device().bind() {
            // SAFETY: mapped and reserved by `new`, undone exactly once; async copies that
            // used the mapping held an Arc of it until they completed.
            unsafe {
                let _ = sys::cuMemUnmap(self.ptr, self.alloc.size);
                let _ = sys::cuMemAddressFree(self.ptr, self.alloc.size);
            }
        }
    }
}
