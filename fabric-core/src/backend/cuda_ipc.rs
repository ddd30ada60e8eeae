//! `cuda-ipc`: GPU memory between processes on one node, through `nvlink-p2p`.
//!
//! * Domain: [`Domain::open`](crate::Domain::open) opens the GPU named by
//!   `FABRIC_CUDA_DEVICE` (default 0, its primary context). Without a CUDA driver or GPU,
//!   `probe`, `Domain::open`, `listen` and `connect` return [`Error::Unavailable`] with
//!   `nvlink-p2p`'s message (what to install).
//! * Setup: a Unix socket in the abstract namespace (no file system path); both ends check
//!   the peer's uid (`SO_PEERCRED`).
//! * Memory: registrations live in the domain's registry (ids with generations, reused) and
//!   are usable on every connection of the domain.
//!   [`Domain::register`](crate::Domain::register) allocates zeroed GPU memory (`cuMemAlloc`,
//!   so legacy IPC can export it); [`Domain::register_device`](crate::Domain::register_device)
//!   takes the caller's `nvlink_p2p::DeviceBuffer` in place, without a copy. Host memory is
//!   refused (`Unsupported`): this backend moves GPU memory. A region with remote access is
//!   exported as a legacy IPC handle and announced, with its id, generation, key and access,
//!   to the peer of every connection of the domain (a connection made later is told of
//!   every live one first). The peer opens the handle when it first addresses the region
//!   (`nvlink-p2p`'s per-process mapping cache), so announcing costs the peer no mapping.
//!   Host writes into a region (`write_at`) have landed in device memory when they return,
//!   so a peer's copy that is ordered after them by a message sees them.
//! * Revocation: dropping a region (once no operation holds it) sends `revoke (id, gen)` to
//!   every peer it was announced to. From then on the peer's operations with that key
//!   complete with [`Status::RemoteAccess`] without touching memory; the peer closes its
//!   mapping once its in-flight copies on it finished and answers `revoked`. The memory is
//!   freed when every peer answered (an answer is read when its connection is next polled)
//!   or hung up (its mappings closed with its transport, or the driver unmapped them with
//!   its process). The driver's documentation makes it
//!   undefined to free memory a peer still maps, so a connection dropped while its peer has
//!   not answered waits for the answers for at most the handshake timeout, then leaks what is
//!   still unanswered rather than free it under the peer. Revocations travel in order with
//!   messages: a peer that does not post receives for messages queued before a `revoke`
//!   delays its answer.
//! * Both ends in one process: the driver cannot open an IPC handle in the process that
//!   exported it, so the importer uses the exporter's buffer directly (found through a
//!   process-wide table of this backend's exports, by the handle's allocation id).
//! * One-sided: write and read are device-to-device copies between a local region and the
//!   peer's mapped region, queued on one CUDA stream per connection, each completing through
//!   a CUDA event; the initiator checks the key's id, generation and value, the granted
//!   access and the mapping's real length. An operation on a key whose announcement has not
//!   arrived yet waits for it (up to the handshake timeout, then [`Status::RemoteAccess`]);
//!   a key of a revoked (or superseded) generation fails at once.
//! * Access bits are enforced by the initiator only. Legacy CUDA IPC has no read-only
//!   mapping: a peer that opens a region's handle gets a read-write mapping even when the
//!   region granted only [`Access::REMOTE_READ`]. This backend's own initiator refuses a
//!   write to such a region (whatever bits the key claims: it checks the access the owner
//!   announced), but a peer running other code can write it. Grant remote access only to
//!   peers you trust with the memory (the uid check keeps out other users).
//! * Bounded state: a peer's regions are tracked by id (ids are reused, so this is the most
//!   regions the peer had alive at once, plus the last revoked generation per id); a peer
//!   that names more than 2^20 distinct ids is dropped with a protocol error.
//! * Two-sided: messages travel over the Unix socket, staged through host memory
//!   (a control path: bulk GPU data should use one-sided writes). A send waits for the
//!   one-sided operations posted before it, so everything takes effect in post order.
//! * Not offered: atomics (`capabilities().atomics == false`; the tracker refuses them).
//! * Sleeping: [`wait_fd`](crate::Transport::wait_fd) is the socket; while GPU copies are in
//!   flight `arm` says "poll" (a CUDA event has no fd to sleep on).
//! * Peer death: the socket hangs up; everything in flight completes with
//!   [`Status::PeerGone`].

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use nvlink_p2p as nv;
use nvlink_p2p::DeviceMemory;

use super::accept::{self, AcceptQueue, Connecting, Handshake};
use super::{BackendEntry, Connector, Endpoint, Hal, Listener};
use crate::domain::{Domain, DomainBackend, MemorySupport, Source};
use crate::error::{DecodeError, Error, Result};
use crate::region::{Access, DeviceBacking, Region};
use crate::sys;
use crate::tracker::{OpDesc, Token, Tracker};
use crate::transport::{
    Capabilities, MemoryKinds, MessageOrdering, Status, Transport, TransportKind,
};

/// The registry entry.
pub static ENTRY: BackendEntry = BackendEntry {
    kind: TransportKind::CudaIpc,
    open: Some(|_| Ok(Box::new(CudaIpcDomain::open()?))),
    probe,
    listen: |o| Domain::open(TransportKind::CudaIpc, o)?.listen(),
    connect: |a, o| Domain::open(TransportKind::CudaIpc, o)?.connect(a),
};

/// Length of a frame header: kind, three zero bytes, `u32` body length.
pub const FRAME_HEADER_LEN: usize = 8;
/// Frame kind: the hello that opens a connection (body: magic, version, device UUID).
pub const K_HELLO: u8 = 1;
/// Frame kind: a region announcement (body: [`Announcement`]).
pub const K_ANNOUNCE: u8 = 2;
/// Frame kind: a two-sided message (body: the message).
pub const K_MSG: u8 = 3;
/// Frame kind: the exporter asks the peer to close its mapping of a region (body: region
/// id and generation, [`encode_revoke`]).
pub const K_REVOKE: u8 = 4;
/// Frame kind: the peer closed its mapping of a region (body: region id and generation).
pub const K_REVOKED: u8 = 5;
/// Length of a revoke / revoked body: id and generation.
pub const REVOKE_LEN: usize = 8;
/// Length of a hello body.
pub const HELLO_LEN: usize = 32;
const HELLO_MAGIC: u64 = 0x3130_4144_5543_4246; // "FBCUDA01"
/// 3: regions of a domain (ids reused): announcements and revocations carry the generation.
const HELLO_VERSION: u32 = 3;
/// Length of an announcement body.
pub const ANNOUNCE_LEN: usize = 24 + nv::IpcMemHandle::ENCODED_LEN;
/// Most distinct region ids of one peer tracked at once (live or last revoked).
const MAX_REMOTE_IDS: usize = 1 << 20;
/// Sends stop being taken while this many bytes wait for the socket (backpressure).
const OUTBOX_LIMIT: usize = 64 << 20;

fn unavailable(e: nv::Error) -> Error {
    Error::Unavailable {
        transport: TransportKind::CudaIpc,
        reason: e.to_string(),
    }
}

fn cuda(op: &'static str) -> impl Fn(nv::Error) -> Error {
    move |e| Error::Io {
        op,
        source: io::Error::other(e),
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update under these locks is a single step: a poisoned lock is consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The driver and the ordinal of the GPU this process uses: `FABRIC_CUDA_DEVICE`
/// (default 0). Loads the driver but creates no context.
fn driver() -> Result<(nv::Cuda, usize)> {
    let cuda = nv::Cuda::init().map_err(unavailable)?;
    let ordinal = match std::env::var("FABRIC_CUDA_DEVICE") {
        Ok(v) => v.trim().parse().map_err(|_| {
            Error::InvalidArgument(format!("FABRIC_CUDA_DEVICE={v:?} is not a device ordinal"))
        })?,
        Err(_) => 0,
    };
    if ordinal >= cuda.device_count() {
        return Err(unavailable(nv::Error::DeviceOutOfRange {
            ordinal,
            count: cuda.device_count(),
        }));
    }
    Ok((cuda, ordinal))
}

fn probe() -> Result<()> {
    driver().map(|_| ())
}

fn check_peer(stream: &UnixStream) -> Result<()> {
    let peer = sys::peer_uid(stream.as_fd())?;
    let ours = sys::uid();
    if peer != ours {
        return Err(Error::PeerUid { peer, ours });
    }
    Ok(())
}

/// Decodes a frame header: `(kind, body length)`.
///
/// # Errors
/// [`DecodeError`] for a short header, non-zero reserved bytes, an unknown kind or a body
/// longer than `max_body`.
pub fn decode_frame_header(
    b: &[u8],
    max_body: usize,
) -> std::result::Result<(u8, usize), DecodeError> {
    const W: &str = "cuda-ipc frame header";
    if b.len() < FRAME_HEADER_LEN {
        return Err(DecodeError::Truncated {
            what: W,
            need: FRAME_HEADER_LEN,
            got: b.len(),
        });
    }
    if b[1..4] != [0, 0, 0] {
        return Err(DecodeError::Invalid {
            what: "cuda-ipc frame reserved bytes",
            value: u32::from_le_bytes([b[1], b[2], b[3], 0]) as u64,
        });
    }
    let kind = b[0];
    if !matches!(kind, K_HELLO | K_ANNOUNCE | K_MSG | K_REVOKE | K_REVOKED) {
        return Err(DecodeError::Invalid {
            what: "cuda-ipc frame kind",
            value: kind as u64,
        });
    }
    let len = u32::from_le_bytes([b[4], b[5], b[6], b[7]]) as usize;
    let max = match kind {
        K_HELLO => HELLO_LEN,
        K_ANNOUNCE => ANNOUNCE_LEN,
        K_REVOKE | K_REVOKED => REVOKE_LEN,
        _ => max_body,
    };
    if len > max || (kind != K_MSG && len != max) {
        return Err(DecodeError::TooLong {
            what: W,
            len: len as u64,
            max: max as u64,
        });
    }
    Ok((kind, len))
}

/// A peer's region, as announced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Announcement {
    /// Region id in the peer's domain.
    pub region: u32,
    /// Generation of the id (a key of another generation is refused).
    pub gen: u32,
    /// [`Access`] bits granted.
    pub access: u32,
    /// The region's capability key.
    pub key: u64,
    /// The CUDA IPC handle of its memory.
    pub handle: nv::IpcMemHandle,
}

/// Encodes a frame of `kind` with `body` (the frame layout [`decode_frame_header`] reads).
///
/// # Errors
/// [`DecodeError::TooLong`] when the body does not fit the frame's `u32` length field.
pub fn encode_frame(kind: u8, body: &[u8]) -> std::result::Result<Vec<u8>, DecodeError> {
    let len = u32::try_from(body.len()).map_err(|_| DecodeError::TooLong {
        what: "cuda-ipc frame body",
        len: body.len() as u64,
        max: u32::MAX as u64,
    })?;
    let mut f = Vec::with_capacity(FRAME_HEADER_LEN + body.len());
    f.push(kind);
    f.extend_from_slice(&[0, 0, 0]);
    f.extend_from_slice(&len.to_le_bytes());
    f.extend_from_slice(body);
    Ok(f)
}

/// The frame kinds, for encoders outside this module (the fuzz target): hello, announce,
/// message, revoke, revoked.
pub const FRAME_KINDS: [u8; 5] = [K_HELLO, K_ANNOUNCE, K_MSG, K_REVOKE, K_REVOKED];

/// Encodes a revoke / revoked body: region id and generation.
pub fn encode_revoke(region: u32, gen: u32) -> [u8; REVOKE_LEN] {
    let mut b = [0u8; REVOKE_LEN];
    b[0..4].copy_from_slice(&region.to_le_bytes());
    b[4..8].copy_from_slice(&gen.to_le_bytes());
    b
}

/// Decodes a revoke / revoked body: `(region id, generation)`.
///
/// # Errors
/// [`DecodeError::Truncated`] for a body that is not exactly [`REVOKE_LEN`] bytes.
pub fn decode_revoke(b: &[u8]) -> std::result::Result<(u32, u32), DecodeError> {
    let b: [u8; REVOKE_LEN] = b.try_into().map_err(|_| DecodeError::Truncated {
        what: "cuda-ipc revoke",
        need: REVOKE_LEN,
        got: b.len(),
    })?;
    Ok((
        u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
    ))
}

impl Announcement {
    /// Encodes the announcement body (what [`Announcement::decode`] reads).
    pub fn encode(&self) -> [u8; ANNOUNCE_LEN] {
        let mut b = [0u8; ANNOUNCE_LEN];
        b[0..4].copy_from_slice(&self.region.to_le_bytes());
        b[4..8].copy_from_slice(&self.gen.to_le_bytes());
        b[8..12].copy_from_slice(&self.access.to_le_bytes());
        // 12..16 reserved (zero)
        b[16..24].copy_from_slice(&self.key.to_le_bytes());
        b[24..].copy_from_slice(&self.handle.encode());
        b
    }

    /// Decodes an announcement body.
    ///
    /// # Errors
    /// [`DecodeError`] for a wrong length, unknown access bits, non-zero reserved bytes or a
    /// malformed IPC handle.
    pub fn decode(b: &[u8]) -> std::result::Result<Self, DecodeError> {
        const W: &str = "cuda-ipc announcement";
        if b.len() != ANNOUNCE_LEN {
            return Err(DecodeError::Truncated {
                what: W,
                need: ANNOUNCE_LEN,
                got: b.len(),
            });
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let access = u32_at(8);
        if Access::from_bits(access).is_none() {
            return Err(DecodeError::Invalid {
                what: "cuda-ipc announcement access bits",
                value: access as u64,
            });
        }
        if u32_at(12) != 0 {
            return Err(DecodeError::Invalid {
                what: "cuda-ipc announcement reserved bytes",
                value: u32_at(12) as u64,
            });
        }
        let handle = nv::IpcMemHandle::decode(&b[24..]).map_err(|_| DecodeError::Invalid {
            what: "cuda-ipc announcement IPC handle",
            value: 0,
        })?;
        let mut key = [0u8; 8];
        key.copy_from_slice(&b[16..24]);
        Ok(Announcement {
            region: u32_at(0),
            gen: u32_at(4),
            access,
            key: u64::from_le_bytes(key),
            handle,
        })
    }
}

fn hello(device: &nv::Device) -> Result<[u8; HELLO_LEN]> {
    let mut b = [0u8; HELLO_LEN];
    b[0..8].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[8..12].copy_from_slice(&HELLO_VERSION.to_le_bytes());
    b[16..32].copy_from_slice(&device.uuid().map_err(unavailable)?);
    Ok(b)
}

fn check_hello(b: &[u8]) -> Result<()> {
    let magic = u64::from_le_bytes(b[0..8].try_into().expect("8 bytes"));
    if magic != HELLO_MAGIC {
        return Err(DecodeError::BadMagic {
            what: "cuda-ipc hello",
            found: magic,
        }
        .into());
    }
    let version = u32::from_le_bytes(b[8..12].try_into().expect("4 bytes"));
    if version != HELLO_VERSION {
        return Err(DecodeError::Version {
            what: "cuda-ipc hello",
            found: version,
            expected: HELLO_VERSION,
        }
        .into());
    }
    Ok(())
}

// ---- the domain: the GPU, the exported regions, the connections that hear of them ----

/// A cuda-ipc domain: the GPU (its primary context), the regions exported to peers, and the
/// connections they are announced to.
#[derive(Debug)]
pub(crate) struct CudaIpcDomain {
    device: nv::Device,
    state: Mutex<DomainState>,
}

/// Exported regions and the connections that hear of them (one lock, so a new connection's
/// snapshot and later announcements never miss or repeat one).
#[derive(Debug, Default)]
struct DomainState {
    exports: HashMap<u32, Arc<Export>>,
    conns: Vec<Weak<ConnShared>>,
}

/// A region exported to peers.
#[derive(Debug)]
struct Export {
    gen: u32,
    announcement: [u8; ANNOUNCE_LEN],
    buf: Arc<nv::DeviceBuffer>,
}

impl CudaIpcDomain {
    fn open() -> Result<Self> {
        let (cuda, ordinal) = driver()?;
        Ok(CudaIpcDomain {
            device: cuda.device(ordinal).map_err(unavailable)?,
            state: Mutex::new(DomainState::default()),
        })
    }

    fn of(d: &Domain) -> Result<&CudaIpcDomain> {
        d.backend()
            .as_any()
            .downcast_ref::<CudaIpcDomain>()
            .ok_or_else(|| Error::InvalidArgument("not a cuda-ipc domain".into()))
    }

    /// Registers a new connection, told of every live export first.
    fn attach(&self, c: &Arc<ConnShared>) {
        let mut st = lock(&self.state);
        for (&id, e) in &st.exports {
            c.announce(id, e);
        }
        st.conns.retain(|w| w.strong_count() > 0);
        st.conns.push(Arc::downgrade(c));
    }

    /// Makes the region's device memory: exported (IPC handle, and this process's table for
    /// a same-process importer) when `access` is remote. Hands `buf` back on failure.
    fn backing(
        &self,
        buf: nv::DeviceBuffer,
        access: Access,
    ) -> std::result::Result<GpuMemory, (Error, nv::DeviceBuffer)> {
        let handle = if access.is_remote() {
            match buf.ipc_handle() {
                Ok(h) => Some(h),
                Err(e) => return Err((cuda("cuIpcGetMemHandle")(e), buf)),
            }
        } else {
            None
        };
        let buf = Arc::new(buf);
        if let Some(h) = &handle {
            lock(local_exports()).insert(h.allocation_id(), Arc::downgrade(&buf));
        }
        Ok(GpuMemory { buf, handle })
    }
}

impl DomainBackend for CudaIpcDomain {
    fn admit(&self, source: Source, _access: Access) -> Result<()> {
        if source == Source::Caller {
            return Err(Error::Unsupported {
                transport: TransportKind::CudaIpc,
                what: "host memory (cuda-ipc moves GPU memory: register an \
                       nvlink_p2p::DeviceBuffer with Domain::register_device, or let \
                       Domain::register allocate one)",
            });
        }
        Ok(())
    }

    fn allocate_device(
        &self,
        len: usize,
        access: Access,
    ) -> Result<Option<Box<dyn DeviceBacking>>> {
        let bytes = len.max(1);
        let buf = self.device.alloc(bytes).map_err(cuda("cuMemAlloc"))?;
        nv::fill(&buf, 0, bytes, 0).map_err(cuda("cuMemsetD8"))?;
        let g = self.backing(buf, access).map_err(|(e, _)| e)?;
        Ok(Some(Box::new(g)))
    }

    fn register_device(
        &self,
        buf: nv::DeviceBuffer,
        access: Access,
    ) -> std::result::Result<Box<dyn DeviceBacking>, (Error, nv::DeviceBuffer)> {
        if !buf.device().same_context(&self.device) {
            return Err((
                Error::InvalidArgument(format!(
                    "a device buffer of GPU {} (or another context) on a cuda-ipc domain of \
                     GPU {} (its primary context)",
                    buf.device().ordinal(),
                    self.device.ordinal()
                )),
                buf,
            ));
        }
        Ok(Box::new(self.backing(buf, access)?))
    }

    fn kind(&self) -> TransportKind {
        TransportKind::CudaIpc
    }

    fn published(&self, r: &Region) {
        let Some(g) = gpu_memory(r) else { return };
        let Some(handle) = &g.handle else { return };
        let a = Announcement {
            region: r.id(),
            gen: r.generation(),
            access: r.access().bits(),
            key: r.inner.key,
            handle: *handle,
        };
        let e = Arc::new(Export {
            gen: r.generation(),
            announcement: a.encode(),
            buf: g.buf.clone(),
        });
        let mut st = lock(&self.state);
        st.conns.retain(|w| w.strong_count() > 0);
        for c in st.conns.iter().filter_map(Weak::upgrade) {
            c.announce(r.id(), &e);
        }
        st.exports.insert(r.id(), e);
    }

    fn revoked(&self, id: u32, gen: u32) {
        let mut st = lock(&self.state);
        if st.exports.get(&id).is_some_and(|e| e.gen == gen) {
            st.exports.remove(&id);
        }
        // Every connection that announced `(id, gen)` revokes it (even when a newer
        // generation of the id was published meanwhile).
        st.conns.retain(|w| w.strong_count() > 0);
        for c in st.conns.iter().filter_map(Weak::upgrade) {
            c.revoke(id, gen);
        }
    }

    fn memory(&self) -> MemorySupport {
        MemorySupport {
            allocated: MemoryKinds::CUDA_DEVICE,
            allocated_remote: MemoryKinds::CUDA_DEVICE,
            caller: MemoryKinds::CUDA_DEVICE,
            caller_remote: MemoryKinds::CUDA_DEVICE,
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn listen(&self, d: &Domain) -> Result<Box<dyn Listener>> {
        Ok(Box::new(CudaIpcListener::bind(d)?))
    }

    fn connect(&self, d: &Domain, address: &str) -> Result<Box<dyn Connector>> {
        Ok(Box::new(CudaIpcConnector::connect(address, d)?))
    }
}

/// GPU memory behind a cuda-ipc [`Region`]: the buffer, and its IPC handle when exported.
/// Connections that announced it hold their own reference until their peer closed its
/// mapping, so the memory outlives the region as long as a peer may map it.
#[derive(Debug)]
struct GpuMemory {
    buf: Arc<nv::DeviceBuffer>,
    handle: Option<nv::IpcMemHandle>,
}

impl Drop for GpuMemory {
    fn drop(&mut self) {
        // This process's table forgets the export (a same-process importer that has not
        // mapped it yet finds it gone: the region was revoked).
        if let Some(h) = &self.handle {
            let mut e = lock(local_exports());
            if let Some(w) = e.get(&h.allocation_id()) {
                if std::ptr::eq(w.as_ptr(), Arc::as_ptr(&self.buf)) {
                    e.remove(&h.allocation_id());
                }
            }
        }
    }
}

fn gpu_memory(r: &Region) -> Option<&GpuMemory> {
    r.device_backing()?.as_any().downcast_ref::<GpuMemory>()
}

fn gpu_buffer(r: &Region) -> Option<Arc<nv::DeviceBuffer>> {
    gpu_memory(r).map(|g| g.buf.clone())
}

impl DeviceBacking for GpuMemory {
    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.buf.write(offset, src).map_err(cuda("cuMemcpyHtoD"))
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.buf.read(offset, dst).map_err(cuda("cuMemcpyDtoH"))
    }
    fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        nv::fill(&*self.buf, offset, len, byte).map_err(cuda("cuMemsetD8"))
    }
    fn addr(&self) -> u64 {
        self.buf.device_ptr()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// This process's exported buffers by allocation id, for an importer in the same process
/// (where the driver cannot open the handle). Weak: the exporter owns the memory; an entry
/// goes with its region's memory.
fn local_exports() -> &'static Mutex<HashMap<u64, Weak<nv::DeviceBuffer>>> {
    static E: OnceLock<Mutex<HashMap<u64, Weak<nv::DeviceBuffer>>>> = OnceLock::new();
    E.get_or_init(|| Mutex::new(HashMap::new()))
}

/// A peer's region as this process reaches it.
#[derive(Debug, Clone)]
enum Mapped {
    /// Opened through legacy IPC (another process's memory).
    Ipc(Arc<nv::IpcMapping>),
    /// The exporter is this process: its buffer itself.
    Local(Arc<nv::DeviceBuffer>),
}

impl Mapped {
    fn len(&self) -> usize {
        match self {
            Mapped::Ipc(m) => m.len(),
            Mapped::Local(b) => b.len(),
        }
    }

    /// Whether nothing but this value holds the mapping (no copy in flight uses it).
    fn unused(&self) -> bool {
        match self {
            Mapped::Ipc(m) => Arc::strong_count(m) == 1,
            Mapped::Local(_) => true,
        }
    }

    fn open(handle: &nv::IpcMemHandle, device: &nv::Device) -> std::result::Result<Self, String> {
        match handle.open(device) {
            Ok(m) => Ok(Mapped::Ipc(Arc::new(m))),
            Err(nv::Error::IpcHandleFromThisProcess) => lock(local_exports())
                .get(&handle.allocation_id())
                .and_then(Weak::upgrade)
                .map(Mapped::Local)
                .ok_or_else(|| "exported by this process, and already freed".to_string()),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Queues a copy between `local` and this mapping (`write`: into the mapping).
    fn copy(
        &self,
        stream: &nv::Stream,
        write: bool,
        off: usize,
        local: &Arc<nv::DeviceBuffer>,
        local_off: usize,
        len: usize,
    ) -> nv::Result<nv::PendingCopy> {
        match (self, write) {
            (Mapped::Ipc(m), true) => nv::copy_async(stream, m, off, local, local_off, len),
            (Mapped::Ipc(m), false) => nv::copy_async(stream, local, local_off, m, off, len),
            (Mapped::Local(b), true) => nv::copy_async(stream, b, off, local, local_off, len),
            (Mapped::Local(b), false) => nv::copy_async(stream, local, local_off, b, off, len),
        }
    }
}

/// A cuda-ipc listener (Unix socket in the abstract namespace); its connections belong to
/// its domain.
#[derive(Debug)]
pub struct CudaIpcListener {
    queue: AcceptQueue<UnixListener, CudaHandshake>,
    address: String,
    domain: Domain,
}

/// The handshake of either side: none before the connection exists. [`finish`] checks the
/// peer and sends the hello; the peer's hello is taken by the connection itself.
#[derive(Debug)]
struct CudaHandshake(UnixStream);

impl Handshake<UnixStream> for CudaHandshake {
    type Ctx = Domain;
    type Output = Box<dyn Transport>;
    fn start(stream: UnixStream, _: &Domain) -> Result<Self> {
        Ok(CudaHandshake(stream))
    }
    fn step(&mut self, _: &Domain) -> Result<bool> {
        Ok(true)
    }
    fn establish(self, domain: &Domain) -> Result<Box<dyn Transport>> {
        finish(self.0, domain)
    }
}

impl CudaIpcListener {
    /// Binds a fresh abstract-namespace address for `domain` (a cuda-ipc domain).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a domain of another backend; [`Error::Io`] when the
    /// socket cannot be bound.
    pub fn bind(domain: &Domain) -> Result<Self> {
        CudaIpcDomain::of(domain)?;
        let (sock, name) = accept::bind_abstract("cuda")?;
        Ok(CudaIpcListener {
            queue: AcceptQueue::new(sock, domain.options().handshake_timeout),
            address: format!("cuda-ipc:@{name}"),
            domain: domain.clone(),
        })
    }
}

impl Listener for CudaIpcListener {
    fn kind(&self) -> TransportKind {
        TransportKind::CudaIpc
    }
    fn address(&self) -> &str {
        &self.address
    }
    fn accept(&mut self) -> Result<Option<Box<dyn Transport>>> {
        self.queue.accept(&self.domain)
    }
}

/// Connects to a [`CudaIpcListener`] (address without the `cuda-ipc:` prefix: `@name`).
#[derive(Debug)]
pub struct CudaIpcConnector {
    conn: Connecting<UnixStream, CudaHandshake>,
    domain: Domain,
}

impl CudaIpcConnector {
    /// Connects; the connection belongs to `domain` (a cuda-ipc domain).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a malformed address or a domain of another backend;
    /// [`Error::Io`] when the listener is not there.
    pub fn connect(address: &str, domain: &Domain) -> Result<Self> {
        CudaIpcDomain::of(domain)?;
        let stream = accept::connect_abstract(address, "cuda-ipc")?;
        let timeout = domain.options().handshake_timeout;
        Ok(CudaIpcConnector {
            conn: Connecting::connected(stream, domain, timeout, "cuda-ipc connect")?,
            domain: domain.clone(),
        })
    }
}

impl Connector for CudaIpcConnector {
    fn poll_connect(&mut self) -> Result<Option<Box<dyn Transport>>> {
        self.conn.poll(&self.domain)
    }
}

fn finish(sock: UnixStream, domain: &Domain) -> Result<Box<dyn Transport>> {
    let d = CudaIpcDomain::of(domain)?;
    let opts = domain.options();
    sock.set_nonblocking(true)
        .map_err(|e| Error::io("fcntl(O_NONBLOCK)", e))?;
    check_peer(&sock)?;
    let same_process = nv::fd_passing::peer_credentials(&sock)
        .map(|c| c.pid == std::process::id() as i32)
        .unwrap_or(false);
    let stream = d.device.new_stream().map_err(unavailable)?;
    let max_message = opts.max_message.min(u32::MAX as usize);
    let caps = Capabilities {
        ordering: MessageOrdering::InOrder,
        one_sided: true,
        atomics: false,
        max_message,
        max_in_flight: opts.max_in_flight,
        inline_size: 0,
        memory_kinds: MemoryKinds::CUDA_DEVICE,
        ..Capabilities::default()
    };
    let shared = Arc::new(ConnShared {
        sock,
        out: Mutex::new(Out {
            same_process,
            ..Out::default()
        }),
    });
    {
        let mut out = lock(&shared.out);
        out.push_frame(K_HELLO, &hello(&d.device)?);
        out.flush(&shared.sock)?;
    }
    // After the hello: the peer hears of every live export, then of each new one.
    d.attach(&shared);
    let hal = CudaIpcHal {
        device: d.device.clone(),
        stream,
        shared,
        inbox: Vec::new(),
        chunk: vec![0u8; 64 * 1024].into_boxed_slice(),
        hello_seen: false,
        remote: RemoteTable::default(),
        answers: Vec::new(),
        copies: VecDeque::new(),
        blocked_since: None,
        wait_limit: opts.handshake_timeout,
        max_message,
    };
    Ok(Box::new(Endpoint::in_domain(
        domain.clone(),
        Tracker::new(domain.id(), TransportKind::CudaIpc, caps),
        hal,
    )))
}

/// The half of a connection its domain reaches (from any thread): the socket's sending
/// side and the exports its peer was told of.
#[derive(Debug)]
struct ConnShared {
    sock: UnixStream,
    out: Mutex<Out>,
}

/// Frames waiting for the socket, and this connection's exports.
#[derive(Debug, Default)]
struct Out {
    outbox: Vec<u8>,
    out_pos: usize,
    /// Buffers announced to the peer, by `(id, gen)`, kept until the peer closed its
    /// mapping (`revoked`) or left.
    exports: HashMap<(u32, u32), Arc<nv::DeviceBuffer>>,
    /// The transport is being dropped: its exports are revoked by the drop, nothing new is
    /// announced.
    closed: bool,
    /// The socket hung up: the peer's mappings are gone.
    peer_gone: bool,
    /// The peer is this process (it maps our buffers as `Mapped::Local`, which keeps them).
    same_process: bool,
}

impl Out {
    fn push_frame(&mut self, kind: u8, body: &[u8]) {
        self.outbox.push(kind);
        self.outbox.extend_from_slice(&[0, 0, 0]);
        self.outbox
            .extend_from_slice(&(body.len() as u32).to_le_bytes());
        self.outbox.extend_from_slice(body);
    }

    fn pending(&self) -> usize {
        self.outbox.len() - self.out_pos
    }

    /// Writes as much of the outbox as the socket takes.
    fn flush(&mut self, sock: &UnixStream) -> Result<()> {
        while self.out_pos < self.outbox.len() {
            match sys::send(sock.as_fd(), &self.outbox[self.out_pos..]) {
                Ok(0) => return Err(Error::Disconnected("cuda-ipc socket closed".into())),
                Ok(n) => self.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::Disconnected(format!("cuda-ipc peer: {e}"))),
            }
        }
        if self.out_pos == self.outbox.len() {
            self.outbox.clear();
            self.out_pos = 0;
        }
        Ok(())
    }

    /// The peer closed its mapping of `(id, gen)` (or never opened it): our reference goes.
    fn release(&mut self, id: u32, gen: u32) {
        self.exports.remove(&(id, gen));
    }

    /// The peer's mappings are gone with it: every export can be freed.
    fn peer_left(&mut self) {
        self.peer_gone = true;
        self.exports.clear();
    }
}

impl ConnShared {
    /// Tells the peer of an export (the domain calls this under its lock).
    fn announce(&self, id: u32, e: &Export) {
        let mut out = lock(&self.out);
        if out.closed || out.peer_gone {
            return;
        }
        out.exports.insert((id, e.gen), e.buf.clone());
        out.push_frame(K_ANNOUNCE, &e.announcement);
        // Errors (a peer gone) surface in the connection's own progress.
        let _ = out.flush(&self.sock);
    }

    /// Revokes an export at the peer (the domain calls this under its lock).
    fn revoke(&self, id: u32, gen: u32) {
        let mut out = lock(&self.out);
        if out.closed || !out.exports.contains_key(&(id, gen)) {
            return;
        }
        if out.peer_gone {
            // Its mappings went with it: free now.
            out.release(id, gen);
            return;
        }
        if out.same_process {
            // Its "mapping" is the buffer itself (it holds its own reference): ours can go
            // now. The peer still has to hear of the revocation.
            out.release(id, gen);
        }
        out.push_frame(K_REVOKE, &encode_revoke(id, gen));
        let _ = out.flush(&self.sock);
    }
}

#[derive(Debug)]
struct RemoteRegion<M> {
    gen: u32,
    key: u64,
    access: Access,
    handle: nv::IpcMemHandle,
    /// Opened at the first operation: the mapping, or why it could not be opened.
    mapping: Option<std::result::Result<M, String>>,
}

/// Whether `a` is an older generation than `b` (or the same): serial-number order.
fn not_newer(a: u32, b: u32) -> bool {
    (b.wrapping_sub(a) as i32) >= 0
}

/// Where a key stands on this side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyState {
    /// Announced with this generation.
    Live,
    /// Revoked, or superseded by a newer generation.
    Stale,
    /// Not announced yet.
    Unknown,
}

/// The peer's regions as this side knows them, with no I/O (`M`: an opened mapping): live
/// announcements by id, the newest revoked generation per id, and revoked mappings that
/// wait for their in-flight copies. Revocations to answer (`revoked (id, gen)`) are pushed
/// to `answers`.
#[derive(Debug)]
struct RemoteTable<M> {
    live: HashMap<u32, RemoteRegion<M>>,
    /// The newest revoked (or superseded) generation per id: keys up to it fail at once.
    retired: HashMap<u32, u32>,
    closing: Vec<(u32, u32, M)>,
    /// Most distinct ids tracked ([`MAX_REMOTE_IDS`]).
    max_ids: usize,
}

impl<M> Default for RemoteTable<M> {
    fn default() -> Self {
        RemoteTable {
            live: HashMap::new(),
            retired: HashMap::new(),
            closing: Vec::new(),
            max_ids: MAX_REMOTE_IDS,
        }
    }
}

impl<M> RemoteTable<M> {
    fn retire(&mut self, id: u32, gen: u32) {
        let newest = self.retired.entry(id).or_insert(gen);
        if not_newer(*newest, gen) {
            *newest = gen;
        }
    }

    /// The peer announced a region. A newer generation of a live id supersedes it (the
    /// old one's revocation may come later: the id was reused meanwhile).
    ///
    /// # Errors
    /// [`Error::Protocol`] when the peer names more ids than the table tracks.
    fn announce(&mut self, a: Announcement, answers: &mut Vec<(u32, u32)>) -> Result<()> {
        let known = self.live.contains_key(&a.region) || self.retired.contains_key(&a.region);
        if !known && self.live.len() + self.retired.len() >= self.max_ids {
            return Err(Error::Protocol(format!(
                "cuda-ipc: the peer named more than {} region ids",
                self.max_ids
            )));
        }
        if let Some(old) = self.live.get(&a.region).map(|r| r.gen) {
            self.revoke(a.region, old, answers);
        }
        self.live.insert(
            a.region,
            RemoteRegion {
                gen: a.gen,
                key: a.key,
                access: Access::from_bits_truncate(a.access),
                handle: a.handle,
                mapping: None,
            },
        );
        Ok(())
    }

    /// The peer revoked `(id, gen)`: keys of it fail from now on; its mapping closes once
    /// no copy uses it (then it is answered), or is answered now when it was never opened.
    fn revoke(&mut self, id: u32, gen: u32, answers: &mut Vec<(u32, u32)>) {
        self.retire(id, gen);
        if self.live.get(&id).is_some_and(|r| r.gen == gen) {
            let r = self.live.remove(&id).expect("checked above");
            match r.mapping {
                Some(Ok(m)) => self.closing.push((id, gen, m)),
                _ => answers.push((id, gen)),
            }
        } else if !self.closing.iter().any(|c| c.0 == id && c.1 == gen) {
            // Never announced, superseded and closed, or answered before: answer (again).
            answers.push((id, gen));
        }
    }

    fn key_state(&self, id: u32, gen: u32) -> KeyState {
        if let Some(r) = self.live.get(&id) {
            if r.gen == gen {
                return KeyState::Live;
            }
            if not_newer(gen, r.gen) {
                return KeyState::Stale;
            }
        }
        match self.retired.get(&id) {
            Some(&newest) if not_newer(gen, newest) => KeyState::Stale,
            _ => KeyState::Unknown,
        }
    }

    /// Closes revoked mappings that `unused` says no copy holds, and answers them.
    fn close_unused(&mut self, unused: impl Fn(&M) -> bool, answers: &mut Vec<(u32, u32)>) {
        let mut i = 0;
        while i < self.closing.len() {
            if unused(&self.closing[i].2) {
                let (id, gen, mapping) = self.closing.swap_remove(i);
                drop(mapping);
                answers.push((id, gen));
            } else {
                i += 1;
            }
        }
    }
}

#[derive(Debug)]
struct CudaIpcHal {
    device: nv::Device,
    stream: nv::Stream,
    shared: Arc<ConnShared>,
    inbox: Vec<u8>,
    /// Where socket reads land (allocated once: no 64 KiB clearing per poll).
    chunk: Box<[u8]>,
    hello_seen: bool,
    /// The peer's regions.
    remote: RemoteTable<Mapped>,
    /// Revocations to answer (scratch, kept for its capacity).
    answers: Vec<(u32, u32)>,
    copies: VecDeque<(Token, nv::PendingCopy, usize)>,
    blocked_since: Option<Instant>,
    wait_limit: Duration,
    max_message: usize,
}

enum Parsed {
    /// Everything complete was consumed.
    Drained,
    /// A message waits for a posted receive.
    WaitingForRecv,
}

impl CudaIpcHal {
    fn out(&self) -> MutexGuard<'_, Out> {
        lock(&self.shared.out)
    }

    fn push_frame(&self, kind: u8, body: &[u8]) {
        self.out().push_frame(kind, body);
    }

    fn flush(&self) -> Result<()> {
        self.out().flush(&self.shared.sock)
    }

    fn pending_out(&self) -> usize {
        self.out().pending()
    }

    /// Sends the revocation answers collected in `self.answers`.
    fn answer(&mut self) {
        if self.answers.is_empty() {
            return;
        }
        let mut out = lock(&self.shared.out);
        for (id, gen) in self.answers.drain(..) {
            out.push_frame(K_REVOKED, &encode_revoke(id, gen));
        }
    }

    /// Handles complete frames in the inbox.
    fn parse(&mut self, t: &mut Tracker) -> Result<Parsed> {
        let mut at = 0;
        let result = loop {
            let avail = &self.inbox[at..];
            if avail.len() < FRAME_HEADER_LEN {
                break Parsed::Drained;
            }
            let (kind, len) = decode_frame_header(avail, self.max_message)?;
            if avail.len() < FRAME_HEADER_LEN + len {
                break Parsed::Drained;
            }
            let body = &avail[FRAME_HEADER_LEN..FRAME_HEADER_LEN + len];
            if !self.hello_seen {
                if kind != K_HELLO {
                    return Err(Error::Protocol(
                        "cuda-ipc: first frame is not a hello".into(),
                    ));
                }
                check_hello(body)?;
                self.hello_seen = true;
                at += FRAME_HEADER_LEN + len;
                continue;
            }
            match kind {
                K_ANNOUNCE => {
                    let a = Announcement::decode(body)?;
                    self.remote.announce(a, &mut self.answers)?;
                    self.answer();
                }
                K_MSG => {
                    let Some(rt) = t.recv_front() else {
                        break Parsed::WaitingForRecv;
                    };
                    t.recv_pop();
                    let (status, n) = match t.get(rt) {
                        Some(p) if len > p.buf.len() => (Status::MessageTooLong, 0),
                        Some(p) => match p.buf.region().write_at(p.buf.offset(), body) {
                            Ok(()) => (Status::Success, len),
                            Err(_) => (Status::ProtocolError, 0),
                        },
                        None => (Status::ProtocolError, 0),
                    };
                    t.complete(rt, status, n, 0);
                }
                K_REVOKE => {
                    let (id, gen) = decode_revoke(body)?;
                    self.remote.revoke(id, gen, &mut self.answers);
                    self.answer();
                }
                K_REVOKED => {
                    let (id, gen) = decode_revoke(body)?;
                    self.out().release(id, gen);
                }
                _ => return Err(Error::Protocol("cuda-ipc: second hello".into())),
            }
            at += FRAME_HEADER_LEN + len;
        };
        self.inbox.drain(..at);
        Ok(result)
    }

    /// Reads the socket and handles frames; a hang-up fails everything in flight.
    fn receive(&mut self, t: &mut Tracker) -> Result<()> {
        loop {
            if let Parsed::WaitingForRecv = self.parse(t)? {
                return Ok(());
            }
            let chunk = &mut self.chunk[..];
            match (&self.shared.sock).read(chunk) {
                Ok(0) => {
                    self.parse(t)?;
                    self.out().peer_left();
                    t.fail_all(Status::PeerGone, "cuda-ipc peer hung up");
                    return Ok(());
                }
                Ok(n) => self.inbox.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.out().peer_left();
                    t.fail_all(Status::PeerGone, format!("cuda-ipc peer: {e}"));
                    return Ok(());
                }
            }
        }
    }

    /// Takes queued sends and one-sided operations, in post order. Returns `false` when the
    /// front one has to wait.
    fn submit_one(&mut self, t: &mut Tracker, tok: Token) -> bool {
        let Some(p) = t.get(tok) else {
            t.submit_pop();
            return true;
        };
        let desc = p.desc;
        let (local, local_off, len) = (gpu_buffer(p.buf.region()), p.buf.offset(), p.buf.len());
        match desc {
            OpDesc::Send => {
                // In order: earlier one-sided operations land before the message leaves.
                if !self.copies.is_empty() || self.pending_out() > OUTBOX_LIMIT {
                    return false;
                }
                let mut bytes = vec![0u8; len];
                let status = match p.buf.copy_to(&mut bytes) {
                    Ok(()) => {
                        self.push_frame(K_MSG, &bytes);
                        Status::Success
                    }
                    Err(_) => Status::ProtocolError,
                };
                t.submit_pop();
                t.complete(tok, status, len, 0);
                true
            }
            OpDesc::Write { key, off } | OpDesc::Read { key, off } => {
                let write = matches!(desc, OpDesc::Write { .. });
                match self.remote.key_state(key.region, key.gen) {
                    KeyState::Live => self.blocked_since = None,
                    KeyState::Stale => {
                        t.submit_pop();
                        t.complete(tok, Status::RemoteAccess, 0, 0);
                        return true;
                    }
                    KeyState::Unknown => {
                        // Not announced yet: wait for it, for a while.
                        let since = *self.blocked_since.get_or_insert_with(Instant::now);
                        if since.elapsed() < self.wait_limit {
                            return false;
                        }
                        self.blocked_since = None;
                        t.submit_pop();
                        t.complete(tok, Status::RemoteAccess, 0, 0);
                        return true;
                    }
                }
                t.submit_pop();
                let need = if write {
                    Access::REMOTE_WRITE
                } else {
                    Access::REMOTE_READ
                };
                let device = &self.device;
                let r = self.remote.live.get_mut(&key.region).expect("live key");
                if r.key != key.key || !r.access.contains(need) {
                    t.complete(tok, Status::RemoteAccess, 0, 0);
                    return true;
                }
                let mapping = r
                    .mapping
                    .get_or_insert_with(|| Mapped::open(&r.handle, device));
                let (Ok(mapping), Some(local)) = (&*mapping, local) else {
                    t.complete(tok, Status::RemoteAccess, 0, 0);
                    return true;
                };
                let in_bounds = matches!(
                    off.checked_add(len as u64),
                    Some(end) if end <= mapping.len() as u64
                );
                if !in_bounds {
                    t.complete(tok, Status::RemoteAccess, 0, 0);
                    return true;
                }
                match mapping.copy(&self.stream, write, off as usize, &local, local_off, len) {
                    Ok(c) => self.copies.push_back((tok, c, len)),
                    Err(_) => {
                        t.complete(tok, Status::RemoteAccess, 0, 0);
                    }
                }
                true
            }
            // Receives have their own queue, atomics are refused by the tracker; operations
            // this backend does not know complete with an error.
            #[allow(unreachable_patterns)]
            _ => {
                t.submit_pop();
                t.complete(tok, Status::ProtocolError, 0, 0);
                true
            }
        }
    }

    /// Closes revoked peer mappings that no copy uses any more, and says so to the peer.
    fn close_revoked(&mut self) {
        self.remote.close_unused(Mapped::unused, &mut self.answers);
        self.answer();
    }

    /// Completes finished copies, in order.
    fn reap(&mut self, t: &mut Tracker) {
        while let Some((_, c, _)) = self.copies.front() {
            let status = match c.is_complete() {
                Ok(false) => break,
                Ok(true) => Status::Success,
                Err(_) => Status::RemoteAccess,
            };
            let (tok, c, len) = self.copies.pop_front().expect("front exists");
            drop(c);
            let n = if status.is_ok() { len } else { 0 };
            t.complete(tok, status, n, 0);
        }
    }
}

impl Drop for CudaIpcHal {
    /// Closes this side's mappings of the peer's memory first (after the copies using them),
    /// then makes sure the peer closed its mappings of ours before they are freed: every
    /// export of this connection is revoked and kept until the peer answers or hangs up, for
    /// at most the handshake timeout; what is still unanswered then is leaked, not freed
    /// under the peer.
    fn drop(&mut self) {
        self.copies.clear(); // each waits for its copy
        self.remote = RemoteTable::default();
        let regions: Vec<(u32, u32)> = {
            let mut out = self.out();
            out.closed = true;
            if out.exports.is_empty() || out.peer_gone || out.same_process {
                out.exports.clear();
                return;
            }
            out.exports.keys().copied().collect()
        };
        for (id, gen) in regions {
            self.push_frame(K_REVOKE, &encode_revoke(id, gen));
        }
        let deadline = Instant::now() + self.wait_limit;
        let mut chunk = [0u8; 4096];
        let mut broken = false;
        while !self.out().exports.is_empty() && !broken && Instant::now() < deadline {
            if self.flush().is_err() {
                break;
            }
            // Frames the peer sent: answers to our revocations, and its own revocations
            // (our mappings are closed already, so they are answered at once).
            let mut at = 0;
            while self.inbox.len() - at >= FRAME_HEADER_LEN {
                let Ok((kind, len)) = decode_frame_header(&self.inbox[at..], self.max_message)
                else {
                    // A peer that sends garbage gets no more answers; its mappings may
                    // live on, so what it has not answered is kept (below).
                    self.inbox.clear();
                    at = 0;
                    broken = true;
                    break;
                };
                if self.inbox.len() - at < FRAME_HEADER_LEN + len {
                    break;
                }
                let body = &self.inbox[at + FRAME_HEADER_LEN..at + FRAME_HEADER_LEN + len];
                match (kind, decode_revoke(body)) {
                    (K_REVOKED, Ok((id, gen))) => self.out().release(id, gen),
                    (K_REVOKE, Ok((id, gen))) => {
                        self.push_frame(K_REVOKED, &encode_revoke(id, gen))
                    }
                    _ => {}
                }
                at += FRAME_HEADER_LEN + len;
            }
            self.inbox.drain(..at);
            match (&self.shared.sock).read(&mut chunk) {
                Ok(0) => {
                    self.out().peer_left();
                    break;
                }
                Ok(n) => self.inbox.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let _ = sys::poll_readable(
                        self.shared.sock.as_fd(),
                        Some(Duration::from_millis(10)),
                    );
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.out().peer_left();
                    break;
                }
            }
        }
        // Unanswered: the peer may still map them. Never free memory under it.
        for (_, buf) in self.out().exports.drain() {
            std::mem::forget(buf);
        }
    }
}

impl Hal for CudaIpcHal {
    fn kind(&self) -> TransportKind {
        TransportKind::CudaIpc
    }

    fn progress(&mut self, t: &mut Tracker) -> Result<()> {
        self.close_revoked();
        self.flush()?;
        self.receive(t)?;
        if t.failure().is_some() {
            return Ok(());
        }
        self.reap(t);
        while let Some(tok) = t.submit_front() {
            if !self.submit_one(t, tok) {
                break;
            }
        }
        self.reap(t);
        self.flush()
    }

    fn wait_fd(&self) -> BorrowedFd<'_> {
        self.shared.sock.as_fd()
    }

    fn arm(&mut self, t: &Tracker) -> Result<bool> {
        let work = !self.copies.is_empty()
            || !self.remote.closing.is_empty()
            || self.pending_out() > 0
            || (t.has_submissions() && self.blocked_since.is_none())
            || (self.inbox.len() >= FRAME_HEADER_LEN && t.recv_front().is_some());
        Ok(!work)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_headers() {
        let mut h = [K_MSG, 0, 0, 0, 0, 0, 0, 0];
        h[4..8].copy_from_slice(&100u32.to_le_bytes());
        assert_eq!(decode_frame_header(&h, 1000).unwrap(), (K_MSG, 100));
        assert!(matches!(
            decode_frame_header(&h, 99),
            Err(DecodeError::TooLong {
                len: 100,
                max: 99,
                ..
            })
        ));
        assert!(matches!(
            decode_frame_header(&h[..7], 1000),
            Err(DecodeError::Truncated {
                need: 8,
                got: 7,
                ..
            })
        ));
        let mut bad = h;
        bad[0] = 9;
        assert!(matches!(
            decode_frame_header(&bad, 1000),
            Err(DecodeError::Invalid { value: 9, .. })
        ));
        let mut bad = h;
        bad[2] = 1;
        assert!(decode_frame_header(&bad, 1000).is_err());
        // Fixed-size frames must have exactly their size.
        let mut ann = [K_ANNOUNCE, 0, 0, 0, 0, 0, 0, 0];
        ann[4..8].copy_from_slice(&(ANNOUNCE_LEN as u32 - 1).to_le_bytes());
        assert!(decode_frame_header(&ann, 1 << 20).is_err());
        ann[4..8].copy_from_slice(&(ANNOUNCE_LEN as u32).to_le_bytes());
        assert_eq!(
            decode_frame_header(&ann, 1 << 20).unwrap(),
            (K_ANNOUNCE, ANNOUNCE_LEN)
        );
    }

    #[test]
    fn revoke_frames_are_exactly_a_region_id() {
        let f = encode_frame(K_REVOKE, &encode_revoke(7, 0x0102_0304)).unwrap();
        assert_eq!(decode_frame_header(&f, 0).unwrap(), (K_REVOKE, REVOKE_LEN));
        assert_eq!(
            decode_revoke(&f[FRAME_HEADER_LEN..]).unwrap(),
            (7, 0x0102_0304)
        );
        // A version-2 revocation (id only) is refused.
        let f = encode_frame(K_REVOKED, &7u32.to_le_bytes()).unwrap();
        assert!(matches!(
            decode_frame_header(&f, 1 << 20),
            Err(DecodeError::TooLong { len: 4, max: 8, .. })
        ));
        assert!(decode_revoke(&[1, 2, 3, 4, 5]).is_err());
        // Every kind the encoder knows decodes (with its fixed length where it has one).
        for kind in FRAME_KINDS {
            let len = match kind {
                K_HELLO => HELLO_LEN,
                K_ANNOUNCE => ANNOUNCE_LEN,
                K_REVOKE | K_REVOKED => REVOKE_LEN,
                _ => 10,
            };
            let f = encode_frame(kind, &vec![0; len]).unwrap();
            assert_eq!(decode_frame_header(&f, 10).unwrap(), (kind, len));
        }
    }

    #[test]
    fn announcements_round_trip_and_reject_garbage() {
        let a = Announcement {
            region: 7,
            gen: 0xdead_beef,
            access: (Access::REMOTE_WRITE | Access::REMOTE_READ).bits(),
            key: 0x1234_5678_9abc_def0,
            handle: nv::IpcMemHandle::from_parts([3; 64], 1 << 20, [9; 16]),
        };
        assert_eq!(Announcement::decode(&a.encode()).unwrap(), a);
        let mut b = a.encode();
        b[8] = 0xff;
        assert!(matches!(
            Announcement::decode(&b),
            Err(DecodeError::Invalid { what, .. }) if what.contains("access")
        ));
        let mut b = a.encode();
        b[13] = 1;
        assert!(matches!(
            Announcement::decode(&b),
            Err(DecodeError::Invalid { what, .. }) if what.contains("reserved")
        ));
        let mut b = a.encode();
        b[24] = b'X'; // handle magic
        assert!(Announcement::decode(&b).is_err());
        assert!(Announcement::decode(&b[..10]).is_err());
    }

    #[test]
    fn generations_compare_across_the_wrap() {
        assert!(not_newer(3, 3) && not_newer(3, 4) && !not_newer(4, 3));
        assert!(not_newer(u32::MAX, 0) && !not_newer(0, u32::MAX));
    }

    fn ann(region: u32, gen: u32) -> Announcement {
        Announcement {
            region,
            gen,
            access: Access::REMOTE_WRITE.bits(),
            key: 99,
            handle: nv::IpcMemHandle::from_parts([3; 64], 4096, [9; 16]),
        }
    }

    #[test]
    fn remote_keys_follow_announcements_revocations_and_reuse() {
        let mut t = RemoteTable::<u8>::default();
        let mut answers = Vec::new();
        assert_eq!(t.key_state(5, 0), KeyState::Unknown);
        t.announce(ann(5, 0), &mut answers).unwrap();
        assert_eq!(t.key_state(5, 0), KeyState::Live);
        assert_eq!(t.key_state(5, 1), KeyState::Unknown, "a newer one may come");
        // Revoked before any use: answered at once; its key is stale from now on.
        t.revoke(5, 0, &mut answers);
        assert_eq!(answers, [(5, 0)]);
        assert_eq!(t.key_state(5, 0), KeyState::Stale);
        // The id comes back with the next generation.
        answers.clear();
        t.announce(ann(5, 1), &mut answers).unwrap();
        assert!(answers.is_empty());
        assert_eq!(t.key_state(5, 1), KeyState::Live);
        assert_eq!(t.key_state(5, 0), KeyState::Stale);
        // Mapped, then revoked: answered only once the mapping is unused.
        t.live.get_mut(&5).unwrap().mapping = Some(Ok(7));
        t.revoke(5, 1, &mut answers);
        assert!(answers.is_empty(), "answered while a copy may use it");
        assert_eq!(t.key_state(5, 1), KeyState::Stale);
        t.close_unused(|_| false, &mut answers);
        assert!(answers.is_empty());
        t.close_unused(|&m| m == 7, &mut answers);
        assert_eq!(answers, [(5, 1)]);
        assert!(t.closing.is_empty());
        // A newer generation announced before the old one's revocation (the exporter
        // reused the id meanwhile) supersedes it; the late revocation is answered again
        // (harmless) and does not touch the new one.
        answers.clear();
        t.announce(ann(6, 0), &mut answers).unwrap();
        t.live.get_mut(&6).unwrap().mapping = Some(Ok(1));
        t.announce(ann(6, 1), &mut answers).unwrap();
        assert_eq!(t.key_state(6, 0), KeyState::Stale);
        assert_eq!(t.key_state(6, 1), KeyState::Live);
        assert_eq!(t.closing.len(), 1);
        t.revoke(6, 0, &mut answers);
        assert!(answers.is_empty(), "still closing");
        assert_eq!(t.key_state(6, 1), KeyState::Live);
        t.close_unused(|_| true, &mut answers);
        assert_eq!(answers, [(6, 0)]);
        // Generations wrap.
        t.announce(ann(8, u32::MAX), &mut answers).unwrap();
        t.revoke(8, u32::MAX, &mut answers);
        t.announce(ann(8, 0), &mut answers).unwrap();
        assert_eq!(t.key_state(8, 0), KeyState::Live);
        assert_eq!(t.key_state(8, u32::MAX), KeyState::Stale);
    }

    #[test]
    fn a_churning_peer_keeps_the_table_bounded_and_too_many_ids_are_refused() {
        let mut t = RemoteTable::<u8>::default();
        let mut answers = Vec::new();
        for gen in 0..100_000u32 {
            t.announce(ann(gen % 3, gen / 3), &mut answers).unwrap();
            t.revoke(gen % 3, gen / 3, &mut answers);
        }
        assert_eq!(answers.len(), 100_000);
        assert!(t.live.is_empty() && t.closing.is_empty());
        assert_eq!(t.retired.len(), 3);
        let mut t = RemoteTable::<u8> {
            max_ids: 1000,
            ..RemoteTable::default()
        };
        for id in 0..1000 {
            t.announce(ann(id, 0), &mut answers).unwrap();
        }
        // A known id is fine, live or revoked; a new one is a protocol error.
        t.announce(ann(0, 1), &mut answers).unwrap();
        t.revoke(1, 0, &mut answers);
        t.announce(ann(1, 1), &mut answers).unwrap();
        assert!(matches!(
            t.announce(ann(1000, 0), &mut answers),
            Err(Error::Protocol(_))
        ));
        assert_eq!(RemoteTable::<u8>::default().max_ids, MAX_REMOTE_IDS);
    }

    #[test]
    fn hello_checks() {
        let mut b = [0u8; HELLO_LEN];
        b[0..8].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[8..12].copy_from_slice(&HELLO_VERSION.to_le_bytes());
        check_hello(&b).unwrap();
        // A version-2 peer (connection-scoped ids, no generations) is refused.
        b[8] = 2;
        assert!(matches!(
            check_hello(&b),
            Err(Error::Decode(DecodeError::Version { found: 2, .. }))
        ));
        b[0] = 0;
        assert!(matches!(
            check_hello(&b),
            Err(Error::Decode(DecodeError::BadMagic { .. }))
        ));
    }
}
