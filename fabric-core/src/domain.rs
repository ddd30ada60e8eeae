//! [`Domain`]: one device and backend, owning registrations that every connection made
//! from it can use.
//!
//! The layering follows UCX (`ucp_context` → `ucp_mem_map` → `ucp_ep`) and libfabric
//! (`fi_domain` → `fi_mr_reg` → endpoints): a domain holds what is per device (the verbs
//! context and protection domain, the shm announcement fan-out, the CUDA context and the
//! IPC exports of cuda-ipc), registrations live in its [`SharedRegistry`] (ids with
//! generations, reused), and connections come from
//! [`Domain::listen`] / [`Domain::connect`]. A region is usable on every connection of its
//! domain; dropping it (once no operation holds a slice of it) deregisters it and revokes
//! its key at every peer.
#![allow(unsafe_code)]

use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::backend::{self, Connector, Listener, Options};
use crate::error::{Error, Result};
use crate::memory::{RegisterError, RegisterMemory};
use crate::region::{random_u64, Access, Memory, Parts, Region, RegionInner, Revoke};
use crate::registry::SharedRegistry;
use crate::transport::{MemoryKinds, Status, TransportKind};

/// GPU memory behind a region registered with [`Domain::register_dmabuf`]: host copies go
/// through the CUDA driver.
#[cfg(feature = "cuda-ipc")]
#[derive(Debug)]
struct GpuMemory {
    memory: Arc<dyn nvlink_p2p::DeviceMemory>,
    /// Where the region starts inside `memory`.
    start: usize,
}

#[cfg(feature = "cuda-ipc")]
fn gpu_err(e: nvlink_p2p::Error) -> Error {
    Error::Io {
        op: "CUDA copy",
        source: std::io::Error::other(e.to_string()),
    }
}

#[cfg(feature = "cuda-ipc")]
impl crate::region::DeviceBacking for GpuMemory {
    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        nvlink_p2p::copy_from_host(&*self.memory, self.start + offset, src).map_err(gpu_err)
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        nvlink_p2p::copy_to_host(&*self.memory, self.start + offset, dst).map_err(gpu_err)
    }
    fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        nvlink_p2p::fill(&*self.memory, self.start + offset, len, byte).map_err(gpu_err)
    }
    fn addr(&self) -> u64 {
        self.memory.device_ptr() + self.start as u64
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A registration the backend accepted, with its reserved id, not yet a region.
struct Prepared {
    id: u32,
    gen: u32,
    reg: Registered,
    access: Access,
}

/// What a backend contributes to a registration.
#[derive(Default)]
pub(crate) struct Registered {
    /// Backend state released with the region (before its memory): the verbs MR.
    pub(crate) backing: Option<Box<dyn std::any::Any + Send + Sync>>,
    /// Backend key for the peer (verbs rkey).
    pub(crate) rkey: u32,
    /// Where the device finds byte 0 and the key it needs for local access (verbs: the
    /// MR's address and lkey), read on every post without a downcast of `backing`.
    pub(crate) local: Option<(u64, u32)>,
}

/// Where the bytes of a new registration come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// fabric-core allocates them (`Domain::register`).
    Allocated,
    /// The caller's memory.
    Caller,
}

/// The per-device half of a backend.
pub(crate) trait DomainBackend: Send + Sync + fmt::Debug {
    /// Refuses a registration the backend cannot serve (before any memory is touched).
    fn admit(&self, _source: Source, _access: Access) -> Result<()> {
        Ok(())
    }
    /// Allocates `len` bytes for [`Domain::register`] (anonymous memory by default).
    fn allocate(&self, len: usize) -> Result<(Memory, Option<Arc<OwnedFd>>)> {
        Ok((
            Memory::Mapped(Arc::new(crate::region::anon_map(len)?)),
            None,
        ))
    }
    /// The completion queue number `index` that this domain's connections share, if the
    /// backend shares one (verbs); see [`crate::backend::SharedCompletions`].
    fn shared_completions(
        &self,
        _index: u32,
    ) -> Option<Arc<dyn crate::backend::SharedCompletions>> {
        None
    }
    /// Registers `[ptr, ptr + len)` with the device (verbs: `ibv_reg_mr`).
    fn register(&self, _ptr: *mut u8, _len: usize, _access: Access) -> Result<Registered> {
        Ok(Registered::default())
    }
    /// Registers GPU memory exported as a DMA-BUF (verbs: `ibv_reg_dmabuf_mr`); the
    /// registration keeps `buf`'s memory alive until it is released.
    #[cfg(feature = "cuda-ipc")]
    fn register_dmabuf(&self, _buf: nvlink_p2p::DmaBuf, _access: Access) -> Result<Registered> {
        Err(Error::Unsupported {
            transport: self.kind(),
            what: "GPU memory (DMA-BUF) registration",
        })
    }
    /// Allocates `len` zeroed bytes of device memory for [`Domain::register`], in domains
    /// whose memory is on the GPU (cuda-ipc); `None` (the default): host memory through
    /// [`allocate`](Self::allocate).
    #[cfg(feature = "cuda-ipc")]
    fn allocate_device(
        &self,
        _len: usize,
        _access: Access,
    ) -> Result<Option<Box<dyn crate::region::DeviceBacking>>> {
        Ok(None)
    }
    /// Takes the caller's device allocation for [`Domain::register_device`] (cuda-ipc:
    /// exports it as an IPC handle when `access` is remote); hands `buf` back on failure.
    #[cfg(feature = "cuda-ipc")]
    fn register_device(
        &self,
        buf: nvlink_p2p::DeviceBuffer,
        _access: Access,
    ) -> std::result::Result<Box<dyn crate::region::DeviceBacking>, (Error, nvlink_p2p::DeviceBuffer)>
    {
        Err((
            Error::Unsupported {
                transport: self.kind(),
                what: "registering a CUDA device buffer in place (cuda-ipc domains do; verbs \
                       takes GPU memory as a DMA-BUF: Domain::register_dmabuf)",
            },
            buf,
        ))
    }
    /// The backend's kind.
    #[cfg_attr(not(feature = "cuda-ipc"), allow(dead_code))]
    fn kind(&self) -> TransportKind;
    /// A region was published in the registry (shm: announce it to every peer).
    fn published(&self, _r: &Region) {}
    /// A region was released (shm: revoke it at every peer).
    fn revoked(&self, _id: u32, _gen: u32) {}
    /// Memory kinds this domain registers, by source.
    fn memory(&self) -> MemorySupport;
    /// For a backend's connections to find their own domain type.
    fn as_any(&self) -> &dyn std::any::Any;
    /// Starts a listener whose connections belong to `d`.
    fn listen(&self, d: &Domain) -> Result<Box<dyn Listener>>;
    /// Starts connecting; the connection belongs to `d`.
    fn connect(&self, d: &Domain, address: &str) -> Result<Box<dyn Connector>>;
}

/// What a domain can register, per memory kind and per use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemorySupport {
    /// Kinds of fabric-core-allocated memory usable for two-sided operations.
    pub allocated: MemoryKinds,
    /// Kinds of fabric-core-allocated memory a peer may address one-sided.
    pub allocated_remote: MemoryKinds,
    /// Kinds of caller memory usable for two-sided operations.
    pub caller: MemoryKinds,
    /// Kinds of caller memory a peer may address one-sided (shm: none; see its docs).
    pub caller_remote: MemoryKinds,
}

pub(crate) struct DomainInner {
    id: u64,
    kind: TransportKind,
    opts: Options,
    registry: SharedRegistry<RegionInner>,
    backend: Box<dyn DomainBackend>,
}

impl fmt::Debug for DomainInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Domain")
            .field("id", &self.id)
            .field("kind", &self.kind)
            .field("backend", &self.backend)
            .finish()
    }
}

impl Revoke for DomainInner {
    fn revoke(&self, id: u32, gen: u32) {
        self.registry.release(id, gen);
        self.backend.revoked(id, gen);
    }
}

/// One device and backend: owns registrations, makes connections.
///
/// ```no_run
/// use fabric_core::{Access, Domain, TransportKind, backend::Options};
/// # fn main() -> fabric_core::Result<()> {
/// let domain = Domain::open(TransportKind::Tcp, &Options::default())?;
/// // The caller's memory, registered in place (no copy); usable on every connection.
/// let floats = domain.register_memory(vec![0f32; 1024], Access::REMOTE_READ)?;
/// let key = floats.remote_key(); // give it to peers
/// let listener = domain.listen()?;
/// # let _ = (key, listener);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Domain {
    pub(crate) inner: Arc<DomainInner>,
}

impl fmt::Debug for Domain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl Domain {
    /// Opens a domain of backend `kind` (verbs: the device, port and GID of `opts`).
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the backend cannot run here (or is not built in; for
    /// cuda-ipc: no CUDA driver or GPU, with what to install).
    pub fn open(kind: TransportKind, opts: &Options) -> Result<Domain> {
        let e = backend::entry(kind)?;
        let open = e.open.ok_or(Error::Unsupported {
            transport: kind,
            what: "domains",
        })?;
        Ok(Self::with_backend(kind, opts, open(opts)?))
    }

    pub(crate) fn with_backend(
        kind: TransportKind,
        opts: &Options,
        backend: Box<dyn DomainBackend>,
    ) -> Domain {
        Domain {
            inner: Arc::new(DomainInner {
                id: backend::next_conn_id(),
                kind,
                opts: opts.clone(),
                registry: SharedRegistry::new(),
                backend,
            }),
        }
    }

    /// The backend.
    pub fn kind(&self) -> TransportKind {
        self.inner.kind
    }

    /// The process-unique id regions and connections of this domain carry.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The options it was opened with (its connections use them).
    pub fn options(&self) -> &Options {
        &self.inner.opts
    }

    /// What it can register, per memory kind.
    pub fn memory_support(&self) -> MemorySupport {
        self.inner.backend.memory()
    }

    /// Registrations alive now.
    pub fn live_regions(&self) -> usize {
        self.inner.registry.live()
    }

    /// Slots of the registration table (the most registrations that were alive at once):
    /// it does not grow with the number registered over time.
    pub fn registry_capacity(&self) -> usize {
        self.inner.registry.capacity()
    }

    pub(crate) fn backend(&self) -> &dyn DomainBackend {
        &*self.inner.backend
    }

    /// Starts a listener; its connections belong to this domain.
    ///
    /// # Errors
    /// The backend's setup errors.
    pub fn listen(&self) -> Result<Box<dyn Listener>> {
        self.inner.backend.listen(self)
    }

    /// Starts connecting to `address` (with or without its `kind:` prefix).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an address of another backend; the backend's errors.
    pub fn connect(&self, address: &str) -> Result<Box<dyn Connector>> {
        let rest = match address.split_once(':') {
            Some((k, rest)) => match k.parse::<TransportKind>() {
                Ok(kind) if kind == self.kind() => rest,
                Ok(kind) => {
                    return Err(Error::InvalidArgument(format!(
                        "address {address:?} is for {kind}, this domain is {}",
                        self.kind()
                    )))
                }
                Err(_) => address,
            },
            None => address,
        };
        self.inner.backend.connect(self, rest)
    }

    /// Allocates `len` zeroed bytes and registers them (the convenient form).
    ///
    /// # Errors
    /// [`Error::Io`] when memory cannot be allocated or registered;
    /// [`Error::Unsupported`] for access the backend does not offer.
    pub fn register(&self, len: usize, access: Access) -> Result<Region> {
        let access = access | Access::LOCAL_WRITE;
        self.inner.backend.admit(Source::Allocated, access)?;
        #[cfg(feature = "cuda-ipc")]
        if let Some(device) = self.inner.backend.allocate_device(len, access)? {
            let mem = Memory::Placeholder(crate::region::anon_map(1)?);
            let (id, gen) = self.reserve()?;
            return Ok(self.finish(
                id,
                gen,
                mem,
                None,
                Some(device),
                Registered::default(),
                len,
                access,
            ));
        }
        let (mem, fd) = self.inner.backend.allocate(len)?;
        let ptr = match &mem {
            Memory::Mapped(m) => m.as_mut_ptr(),
            Memory::Caller { ptr, .. } => *ptr,
            Memory::Placeholder(m) => m.as_mut_ptr(),
        };
        let (id, gen) = self.reserve()?;
        let reg = self
            .inner
            .backend
            .register(ptr, len, access)
            .inspect_err(|_| self.unreserve(id, gen))?;
        Ok(self.finish(id, gen, mem, fd, None, reg, len, access))
    }

    /// Registers memory the caller owns, in place (no copy): `Vec<u8>`, `Box<[u8]>`,
    /// typed vectors of [`Plain`](crate::memory::Plain) elements (`Vec<f32>`, ...),
    /// `memmap2::MmapMut`, [`AlignedBuf`](crate::memory::AlignedBuf). The region keeps the
    /// memory until it is dropped; [`Region::into_memory`] gives it back.
    ///
    /// # Errors
    /// A [`RegisterError`] that hands `mem` back untouched, with the reason: as
    /// [`register`](Self::register); [`Error::InvalidArgument`] for memory of zero bytes;
    /// [`Error::Unsupported`] with the reason when the backend cannot give peers one-sided
    /// access to caller memory (shm). `?` turns it into an [`Error`] where the memory is
    /// not wanted back.
    pub fn register_memory<M: RegisterMemory>(
        &self,
        mut mem: M,
        access: Access,
    ) -> std::result::Result<Region, RegisterError<M>> {
        let ptr = mem.as_mut_ptr();
        let len = mem.byte_len();
        // SAFETY: `RegisterMemory` promises `ptr` is valid for `len` bytes while `mem` lives
        // and does not move with it; on success `mem` becomes the region's keep-alive, on
        // failure nothing refers to the bytes any more (the backend registration, if any,
        // is gone) before `mem` is handed back.
        match unsafe { self.register_caller(ptr, len, access) } {
            Ok(p) => Ok(self.finish_caller(p, ptr, len, Box::new(mem))),
            Err(e) => Err(RegisterError::new(e, mem)),
        }
    }

    /// Registers `len` bytes at `ptr` that foreign code owns; `keep` is dropped (after the
    /// registration is released) when the region goes.
    ///
    /// # Safety
    /// 1. `ptr` is valid for reads and writes of `len` bytes until `keep` is dropped;
    /// 2. nothing else reads or writes those bytes meanwhile except through the region
    ///    (peers and the hardware write arbitrary bytes there);
    /// 3. the memory is host memory of this process.
    ///
    /// # Errors
    /// As [`register_memory`](Self::register_memory) (the [`RegisterError`] hands `keep`
    /// back); [`Error::InvalidArgument`] for a null pointer.
    pub unsafe fn register_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        keep: Box<dyn std::any::Any + Send + Sync>,
        access: Access,
    ) -> std::result::Result<Region, RegisterError<Box<dyn std::any::Any + Send + Sync>>> {
        // SAFETY: the caller's promises (this function's contract) are the ones
        // `register_caller` needs.
        match unsafe { self.register_caller(ptr, len, access) } {
            Ok(p) => Ok(self.finish_caller(p, ptr, len, keep)),
            Err(e) => Err(RegisterError::new(e, keep)),
        }
    }

    /// Checks, admits and registers caller memory with the backend, and reserves its id;
    /// on failure nothing is left registered or reserved.
    ///
    /// # Safety
    /// As [`register_raw`](Self::register_raw) 1-3, for as long as the returned
    /// registration lives.
    unsafe fn register_caller(&self, ptr: *mut u8, len: usize, access: Access) -> Result<Prepared> {
        if ptr.is_null() {
            return Err(Error::InvalidArgument("null pointer to register".into()));
        }
        if len == 0 {
            return Err(Error::InvalidArgument(
                "caller memory of zero bytes (nothing to register; Domain::register(0, ..) \
                 makes an empty region)"
                    .into(),
            ));
        }
        let access = access | Access::LOCAL_WRITE;
        self.inner.backend.admit(Source::Caller, access)?;
        let (id, gen) = self.reserve()?;
        let reg = self
            .inner
            .backend
            .register(ptr, len, access)
            .inspect_err(|_| self.unreserve(id, gen))?;
        Ok(Prepared {
            id,
            gen,
            reg,
            access,
        })
    }

    fn finish_caller(
        &self,
        p: Prepared,
        ptr: *mut u8,
        len: usize,
        keep: Box<dyn std::any::Any + Send + Sync>,
    ) -> Region {
        let mem = Memory::Caller {
            ptr,
            len,
            keep: Some(keep),
        };
        self.finish(p.id, p.gen, mem, None, None, p.reg, len, p.access)
    }

    /// Registers GPU memory exported by `nvlink-p2p` as a DMA-BUF (GPUDirect RDMA: the NIC
    /// reads and writes it directly). Only the verbs backend can; the region's byte copies
    /// ([`Region::write_at`], ...) go through the CUDA driver, and its remote key carries
    /// the device address.
    ///
    /// # Errors
    /// [`Error::Unsupported`] on backends without GPUDirect RDMA (shm, tcp), and on verbs
    /// when the device, provider or kernel cannot register DMA-BUF memory (Soft-RoCE
    /// cannot); [`Error::Io`] when the registration fails otherwise.
    #[cfg(feature = "cuda-ipc")]
    pub fn register_dmabuf(&self, buf: nvlink_p2p::DmaBuf, access: Access) -> Result<Region> {
        let access = access | Access::LOCAL_WRITE;
        let memory = buf.memory().clone();
        let start = (buf.device_ptr() - memory.device_ptr()) as usize;
        let len = buf.len();
        let mem = Memory::Placeholder(crate::region::anon_map(1)?);
        let (id, gen) = self.reserve()?;
        let reg = self
            .inner
            .backend
            .register_dmabuf(buf, access)
            .inspect_err(|_| self.unreserve(id, gen))?;
        let device: Box<dyn crate::region::DeviceBacking> = Box::new(GpuMemory { memory, start });
        Ok(self.finish(id, gen, mem, None, Some(device), reg, len, access))
    }

    /// An id and its generation for a new registration.
    fn reserve(&self) -> Result<(u32, u32)> {
        self.inner
            .registry
            .reserve()
            .ok_or(Error::WouldBlock("registration table (2^32 regions)"))
    }

    /// Gives back an id whose registration failed (never published, so no peer knows it).
    fn unreserve(&self, id: u32, gen: u32) {
        self.inner.registry.release(id, gen);
    }

    /// Registers the caller's CUDA device allocation in place (no copy; cuda-ipc domains).
    /// With remote access it is exported as a legacy IPC handle and announced to the peers
    /// of every connection of the domain, which map it when they first address it. The
    /// region owns the buffer: its byte copies ([`Region::write_at`], ...) go through the
    /// CUDA driver, and dropping the region revokes it at every peer and frees the buffer
    /// once each peer closed its mapping. ([`Region::into_memory`] does not hand device
    /// memory back: a peer may still map it.)
    ///
    /// [`register`](Self::register) stays the convenient form: on cuda-ipc it allocates
    /// zeroed device memory.
    ///
    /// ```no_run
    /// use fabric_core::{backend::Options, Access, Domain, TransportKind};
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let domain = Domain::open(TransportKind::CudaIpc, &Options::default())?;
    /// let gpu = nvlink_p2p::Cuda::init()?.device(0)?;
    /// let tensor = gpu.alloc(1 << 20)?; // the caller's device allocation
    /// let region = domain
    ///     .register_device(tensor, Access::REMOTE_READ)
    ///     .map_err(|(e, _tensor)| e)?; // on failure the buffer comes back
    /// let key = region.remote_key(); // for the peers of every connection of `domain`
    /// # let _ = key;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The error and `buf`, handed back: [`Error::Unsupported`] on domains that do not
    /// register device buffers in place (shm, tcp; verbs takes GPU memory as a DMA-BUF,
    /// [`register_dmabuf`](Self::register_dmabuf)); [`Error::InvalidArgument`] for a buffer
    /// of another device or context than the domain's (`FABRIC_CUDA_DEVICE`, primary
    /// context); [`Error::Io`] when the driver refuses the IPC export;
    /// [`Error::WouldBlock`] with 2^32 - 1 registrations alive.
    #[cfg(feature = "cuda-ipc")]
    pub fn register_device(
        &self,
        buf: nvlink_p2p::DeviceBuffer,
        access: Access,
    ) -> std::result::Result<Region, (Error, nvlink_p2p::DeviceBuffer)> {
        let access = access | Access::LOCAL_WRITE;
        let placeholder = match crate::region::anon_map(1) {
            Ok(m) => m,
            Err(e) => return Err((e, buf)),
        };
        let (id, gen) = match self.reserve() {
            Ok(r) => r,
            Err(e) => return Err((e, buf)),
        };
        let len = nvlink_p2p::DeviceMemory::len(&buf);
        let device = self
            .inner
            .backend
            .register_device(buf, access)
            .inspect_err(|_| self.unreserve(id, gen))?;
        Ok(self.finish(
            id,
            gen,
            Memory::Placeholder(placeholder),
            None,
            Some(device),
            Registered::default(),
            len,
            access,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        id: u32,
        gen: u32,
        mem: Memory,
        fd: Option<Arc<OwnedFd>>,
        device: Option<Box<dyn crate::region::DeviceBacking>>,
        reg: Registered,
        len: usize,
        access: Access,
    ) -> Region {
        let key = random_u64();
        let revoke: Arc<dyn Revoke> = self.inner.clone();
        let region = Region::from_parts(Parts {
            id,
            gen,
            owner: self.inner.id,
            key,
            transport: self.kind(),
            access,
            len,
            mem,
            fd,
            backing: reg.backing,
            rkey: reg.rkey,
            local: reg.local,
            revoke: Some(revoke),
            device,
        });
        self.inner
            .registry
            .publish(id, gen, key, access, len as u64, &region.inner);
        self.inner.backend.published(&region);
        region
    }

    /// Target-side check of a peer's access to one of this domain's regions; the region
    /// (held for the duration of the access) when it passes.
    ///
    /// # Errors
    /// [`Status::RemoteAccess`] for an unknown, stale or revoked key, missing access or a
    /// range outside the region.
    pub(crate) fn check_target(
        &self,
        id: u32,
        gen: u32,
        key: u64,
        off: u64,
        len: u64,
        need: Access,
    ) -> Result<Region, Status> {
        self.inner
            .registry
            .lookup(id, gen, key, off, len, need)
            .map(|inner| Region { inner })
    }
}
