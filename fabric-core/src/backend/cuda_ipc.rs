//! `cuda-ipc`: GPU memory between processes on one node, through `nvlink-p2p`.
//!
//! * Setup: a Unix socket in the abstract namespace (no file system path); both ends check
//!   the peer's uid (`SO_PEERCRED`) and open the GPU named by `FABRIC_CUDA_DEVICE`
//!   (default 0). Without a CUDA driver or GPU, `probe`, `listen` and `connect` return
//!   [`Error::Unavailable`] with `nvlink-p2p`'s message (what to install).
//! * Memory: [`register`](crate::Transport::register) allocates zeroed GPU memory
//!   (`cuMemAlloc`, so legacy IPC can export it). A region with remote access is announced
//!   to the peer on the socket with its 64-byte CUDA IPC handle; the peer opens it once
//!   (`nvlink-p2p`'s per-process mapping cache).
//!   Host writes into a region (`write_at`) have landed in device memory when they return,
//!   so a peer's copy that is ordered after them by a message sees them.
//! * Both ends in one process: the driver cannot open an IPC handle in the process that
//!   exported it, so the importer uses the exporter's buffer directly (found through a
//!   process-wide table of this backend's exports, by the handle's allocation id).
//! * One-sided: write and read are device-to-device copies between a local region and the
//!   peer's mapped region, queued on one CUDA stream, each completing through a CUDA event;
//!   the initiator checks the key, the granted access and the mapping's real length. An
//!   operation on a key whose announcement has not arrived yet waits for it (up to the
//!   handshake timeout, then [`Status::RemoteAccess`]).
//! * Access bits are enforced by the initiator only. Legacy CUDA IPC has no read-only
//!   mapping: a peer that opens a region's handle gets a read-write mapping even when the
//!   region granted only [`Access::REMOTE_READ`]. This backend's own initiator refuses a
//!   write to such a region (whatever bits the key claims: it checks the access the owner
//!   announced), but a peer running other code can write it. Grant remote access only to
//!   peers you trust with the memory (the uid check keeps out other users).
//! * Freeing exported memory: the driver's documentation makes it undefined to free memory
//!   a peer still maps. The exporter keeps every exported buffer until the peer says it
//!   closed its mapping: a `revoke` frame (sent when the region's memory is dropped, and for
//!   every export when the transport is dropped) is answered by `revoked` once the peer's
//!   in-flight copies on it finished and its mapping is closed; a peer that hangs up has
//!   closed its mappings with its transport, or died (the driver then unmaps them). A peer
//!   that neither answers nor hangs up within the handshake timeout of a dropped transport
//!   keeps the memory allocated (it leaks, deliberately) rather than have it freed under it.
//!   Revocations travel in order with messages: a peer that does not post receives for
//!   messages queued before a `revoke` delays its answer.
//! * Two-sided: messages travel over the Unix socket, staged through host memory
//!   (a control path: bulk GPU data should use one-sided writes). A send waits for the
//!   one-sided operations posted before it, so everything takes effect in post order.
//! * Not offered: atomics (`capabilities().atomics == false`; the tracker refuses them).
//! * Sleeping: [`wait_fd`](crate::Transport::wait_fd) is the socket; while GPU copies are in
//!   flight `arm` says "poll" (a CUDA event has no fd to sleep on).
//! * Peer death: the socket hangs up; everything in flight completes with
//!   [`Status::PeerGone`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use nvlink_p2p as nv;
use nvlink_p2p::DeviceMemory;

use super::{next_conn_id, BackendEntry, Connector, Endpoint, Hal, Listener, Options};
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
    open: None,
    probe,
    listen: |o| Ok(Box::new(CudaIpcListener::bind(o)?)),
    connect: |a, o| Ok(Box::new(CudaIpcConnector::connect(a, o)?)),
};

/// Length of a frame header: kind, three zero bytes, `u32` body length.
pub const FRAME_HEADER_LEN: usize = 8;
/// Frame kind: the hello that opens a connection (body: magic, version, device UUID).
pub const K_HELLO: u8 = 1;
/// Frame kind: a region announcement (body: [`Announcement`]).
pub const K_ANNOUNCE: u8 = 2;
/// Frame kind: a two-sided message (body: the message).
pub const K_MSG: u8 = 3;
/// Frame kind: the exporter asks the peer to close its mapping of a region (body: region id).
pub const K_REVOKE: u8 = 4;
/// Frame kind: the peer closed its mapping of a region (body: region id).
pub const K_REVOKED: u8 = 5;
/// Length of a revoke / revoked body.
pub const REVOKE_LEN: usize = 4;
/// Length of a hello body.
pub const HELLO_LEN: usize = 32;
const HELLO_MAGIC: u64 = 0x3130_4144_5543_4246; // "FBCUDA01"
/// 2: revoke / revoked frames; the IPC handle carries the exporter's allocation id.
const HELLO_VERSION: u32 = 2;
/// Length of an announcement body.
pub const ANNOUNCE_LEN: usize = 16 + nv::IpcMemHandle::ENCODED_LEN;
const MAX_REMOTE_REGIONS: usize = 65_536;
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

/// Opens (the primary context of) the GPU this process uses.
fn open_device() -> Result<nv::Device> {
    let (cuda, ordinal) = driver()?;
    cuda.device(ordinal).map_err(unavailable)
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
    /// Region id on the peer's connection.
    pub region: u32,
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

/// Decodes a revoke / revoked body: the region id.
///
/// # Errors
/// [`DecodeError::Truncated`] for a body that is not exactly 4 bytes.
pub fn decode_revoke(b: &[u8]) -> std::result::Result<u32, DecodeError> {
    let b: [u8; REVOKE_LEN] = b.try_into().map_err(|_| DecodeError::Truncated {
        what: "cuda-ipc revoke",
        need: REVOKE_LEN,
        got: b.len(),
    })?;
    Ok(u32::from_le_bytes(b))
}

impl Announcement {
    /// Encodes the announcement body (what [`Announcement::decode`] reads).
    pub fn encode(&self) -> [u8; ANNOUNCE_LEN] {
        let mut b = [0u8; ANNOUNCE_LEN];
        b[0..4].copy_from_slice(&self.region.to_le_bytes());
        b[4..8].copy_from_slice(&self.access.to_le_bytes());
        b[8..16].copy_from_slice(&self.key.to_le_bytes());
        b[16..].copy_from_slice(&self.handle.encode());
        b
    }

    /// Decodes an announcement body.
    ///
    /// # Errors
    /// [`DecodeError`] for a wrong length, unknown access bits or a malformed IPC handle.
    pub fn decode(b: &[u8]) -> std::result::Result<Self, DecodeError> {
        const W: &str = "cuda-ipc announcement";
        if b.len() != ANNOUNCE_LEN {
            return Err(DecodeError::Truncated {
                what: W,
                need: ANNOUNCE_LEN,
                got: b.len(),
            });
        }
        let access = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes"));
        if Access::from_bits(access).is_none() {
            return Err(DecodeError::Invalid {
                what: "cuda-ipc announcement access bits",
                value: access as u64,
            });
        }
        let handle = nv::IpcMemHandle::decode(&b[16..]).map_err(|_| DecodeError::Invalid {
            what: "cuda-ipc announcement IPC handle",
            value: 0,
        })?;
        Ok(Announcement {
            region: u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")),
            access,
            key: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
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

/// GPU memory behind a cuda-ipc [`Region`]. When it drops (the region is gone), an exported
/// one tells its connection, which then revokes the peer's mapping before freeing it.
#[derive(Debug)]
struct GpuMemory(Arc<nv::DeviceBuffer>, Option<(u32, Arc<DropNotices>)>);

impl Drop for GpuMemory {
    fn drop(&mut self) {
        if let Some((region, notices)) = &self.1 {
            notices
                .regions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(*region);
            notices.any.store(true, Ordering::Release);
        }
    }
}

/// Regions of one connection whose memory was dropped (checked with one atomic load per
/// progress call).
#[derive(Debug, Default)]
struct DropNotices {
    any: AtomicBool,
    regions: Mutex<Vec<u32>>,
}

/// This process's exported buffers by allocation id, for an importer in the same process
/// (where the driver cannot open the handle). Weak: the exporter owns the memory.
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
            Err(nv::Error::IpcHandleFromThisProcess) => local_exports()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
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

impl DeviceBacking for GpuMemory {
    fn write(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.0.write(offset, src).map_err(cuda("cuMemcpyHtoD"))
    }
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.0.read(offset, dst).map_err(cuda("cuMemcpyDtoH"))
    }
    fn fill(&self, offset: usize, len: usize, byte: u8) -> Result<()> {
        nv::fill(&*self.0, offset, len, byte).map_err(cuda("cuMemsetD8"))
    }
    fn addr(&self) -> u64 {
        self.0.device_ptr()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn gpu_buffer(r: &Region) -> Option<Arc<nv::DeviceBuffer>> {
    r.device_backing()?
        .as_any()
        .downcast_ref::<GpuMemory>()
        .map(|g| g.0.clone())
}

/// A cuda-ipc listener (Unix socket in the abstract namespace).
#[derive(Debug)]
pub struct CudaIpcListener {
    sock: UnixListener,
    address: String,
    opts: Options,
    /// Opened at the first connection (a listener that is never used costs no context).
    device: Option<nv::Device>,
}

impl CudaIpcListener {
    /// Checks for the driver and binds a fresh abstract-namespace address.
    ///
    /// # Errors
    /// [`Error::Unavailable`] without a CUDA driver or GPU; [`Error::Io`] when the socket
    /// cannot be bound.
    pub fn bind(opts: &Options) -> Result<Self> {
        driver()?;
        let mut rnd = [0u8; 8];
        sys::random_bytes(&mut rnd)?;
        let name = format!(
            "fabric-cuda-{}-{:016x}",
            std::process::id(),
            u64::from_le_bytes(rnd)
        );
        let addr = SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::io("unix socket address", e))?;
        let sock = UnixListener::bind_addr(&addr).map_err(|e| Error::io("bind(unix)", e))?;
        sock.set_nonblocking(true)
            .map_err(|e| Error::io("fcntl(O_NONBLOCK)", e))?;
        Ok(CudaIpcListener {
            sock,
            address: format!("cuda-ipc:@{name}"),
            opts: opts.clone(),
            device: None,
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
        loop {
            match self.sock.accept() {
                Ok((s, _)) => {
                    let device = match &self.device {
                        Some(d) => d.clone(),
                        None => self.device.insert(open_device()?).clone(),
                    };
                    // A stranger (other uid) or a failing setup is dropped; keep serving.
                    if let Ok(t) = finish(s, &device, &self.opts) {
                        return Ok(Some(t));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::io("accept(unix)", e)),
            }
        }
    }
}

/// Connects to a [`CudaIpcListener`] (address without the `cuda-ipc:` prefix: `@name`).
#[derive(Debug)]
pub struct CudaIpcConnector {
    stream: Option<UnixStream>,
    opts: Options,
    device: nv::Device,
}

impl CudaIpcConnector {
    /// Opens the GPU and connects.
    ///
    /// # Errors
    /// [`Error::Unavailable`] without a CUDA driver or GPU; [`Error::InvalidArgument`] for a
    /// malformed address; [`Error::Io`] when the listener is not there.
    pub fn connect(address: &str, opts: &Options) -> Result<Self> {
        let device = open_device()?;
        let name = address.strip_prefix('@').ok_or_else(|| {
            Error::InvalidArgument(format!("cuda-ipc address {address:?} must start with '@'"))
        })?;
        let addr = SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::io("unix socket address", e))?;
        let stream = UnixStream::connect_addr(&addr).map_err(|e| Error::io("connect(unix)", e))?;
        Ok(CudaIpcConnector {
            stream: Some(stream),
            opts: opts.clone(),
            device,
        })
    }
}

impl Connector for CudaIpcConnector {
    fn poll_connect(&mut self) -> Result<Option<Box<dyn Transport>>> {
        let stream = self
            .stream
            .take()
            .ok_or_else(|| Error::InvalidArgument("connector already finished".into()))?;
        finish(stream, &self.device, &self.opts).map(Some)
    }
}

fn finish(sock: UnixStream, device: &nv::Device, opts: &Options) -> Result<Box<dyn Transport>> {
    sock.set_nonblocking(true)
        .map_err(|e| Error::io("fcntl(O_NONBLOCK)", e))?;
    check_peer(&sock)?;
    let same_process = nv::fd_passing::peer_credentials(&sock)
        .map(|c| c.pid == std::process::id() as i32)
        .unwrap_or(false);
    let stream = device.new_stream().map_err(unavailable)?;
    let conn = next_conn_id();
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
    let mut hal = CudaIpcHal {
        conn,
        device: device.clone(),
        stream,
        sock,
        outbox: Vec::new(),
        out_pos: 0,
        inbox: Vec::new(),
        hello_seen: false,
        remote: HashMap::new(),
        revoked: HashSet::new(),
        closing: Vec::new(),
        exports: HashMap::new(),
        notices: Arc::new(DropNotices::default()),
        same_process,
        peer_gone: false,
        copies: VecDeque::new(),
        blocked_since: None,
        wait_limit: opts.handshake_timeout,
        max_message,
    };
    hal.push_frame(K_HELLO, &hello(device)?);
    hal.flush()?;
    Ok(Box::new(Endpoint::new(
        Tracker::new(conn, TransportKind::CudaIpc, caps),
        hal,
    )))
}

#[derive(Debug)]
struct RemoteRegion {
    key: u64,
    access: Access,
    /// The opened mapping, or why it could not be opened.
    mapping: std::result::Result<Mapped, String>,
}

#[derive(Debug)]
struct CudaIpcHal {
    conn: u64,
    device: nv::Device,
    stream: nv::Stream,
    sock: UnixStream,
    outbox: Vec<u8>,
    out_pos: usize,
    inbox: Vec<u8>,
    hello_seen: bool,
    remote: HashMap<u32, RemoteRegion>,
    /// Peer regions it revoked: operations on them fail at once.
    revoked: HashSet<u32>,
    /// Revoked peer mappings waiting for their in-flight copies before they close.
    closing: Vec<(u32, Mapped)>,
    /// Our exported buffers, kept until the peer closed its mapping (`revoked`) or left.
    exports: HashMap<u32, Arc<nv::DeviceBuffer>>,
    /// Exported regions whose memory the user dropped.
    notices: Arc<DropNotices>,
    /// The peer is this process (it maps our buffers as `Mapped::Local`, which keeps them).
    same_process: bool,
    /// The socket hung up: the peer's mappings are gone.
    peer_gone: bool,
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
    fn push_frame(&mut self, kind: u8, body: &[u8]) {
        self.outbox.push(kind);
        self.outbox.extend_from_slice(&[0, 0, 0]);
        self.outbox
            .extend_from_slice(&(body.len() as u32).to_le_bytes());
        self.outbox.extend_from_slice(body);
    }

    fn pending_out(&self) -> usize {
        self.outbox.len() - self.out_pos
    }

    /// Writes as much of the outbox as the socket takes.
    fn flush(&mut self) -> Result<()> {
        while self.out_pos < self.outbox.len() {
            match (&self.sock).write(&self.outbox[self.out_pos..]) {
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
                    if self.remote.len() >= MAX_REMOTE_REGIONS {
                        return Err(Error::Protocol(format!(
                            "cuda-ipc: more than {MAX_REMOTE_REGIONS} remote regions"
                        )));
                    }
                    let mapping = Mapped::open(&a.handle, &self.device);
                    self.revoked.remove(&a.region);
                    self.remote.insert(
                        a.region,
                        RemoteRegion {
                            key: a.key,
                            access: Access::from_bits_truncate(a.access),
                            mapping,
                        },
                    );
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
                    let region = decode_revoke(body)?;
                    self.revoked.insert(region);
                    match self.remote.remove(&region) {
                        Some(RemoteRegion { mapping: Ok(m), .. }) => self.closing.push((region, m)),
                        // Never opened: nothing to close.
                        _ => self.push_frame(K_REVOKED, &region.to_le_bytes()),
                    }
                }
                K_REVOKED => {
                    let region = decode_revoke(body)?;
                    if let Some(buf) = self.exports.remove(&region) {
                        forget_local_export(&buf);
                    }
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
        let mut chunk = [0u8; 64 * 1024];
        loop {
            if let Parsed::WaitingForRecv = self.parse(t)? {
                return Ok(());
            }
            match (&self.sock).read(&mut chunk) {
                Ok(0) => {
                    self.parse(t)?;
                    self.peer_left();
                    t.fail_all(Status::PeerGone, "cuda-ipc peer hung up");
                    return Ok(());
                }
                Ok(n) => self.inbox.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.peer_left();
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
                if self.revoked.contains(&key.region) {
                    t.submit_pop();
                    t.complete(tok, Status::RemoteAccess, 0, 0);
                    return true;
                }
                let Some(r) = self.remote.get(&key.region) else {
                    // Not announced yet: wait for it, for a while.
                    let since = *self.blocked_since.get_or_insert_with(Instant::now);
                    if since.elapsed() < self.wait_limit {
                        return false;
                    }
                    self.blocked_since = None;
                    t.submit_pop();
                    t.complete(tok, Status::RemoteAccess, 0, 0);
                    return true;
                };
                self.blocked_since = None;
                let need = if write {
                    Access::REMOTE_WRITE
                } else {
                    Access::REMOTE_READ
                };
                t.submit_pop();
                let (Ok(mapping), Some(local)) = (&r.mapping, local) else {
                    t.complete(tok, Status::RemoteAccess, 0, 0);
                    return true;
                };
                let in_bounds = matches!(
                    off.checked_add(len as u64),
                    Some(end) if end <= mapping.len() as u64
                );
                if r.key != key.key || !r.access.contains(need) || !in_bounds {
                    t.complete(tok, Status::RemoteAccess, 0, 0);
                    return true;
                }
                let copy = mapping.copy(&self.stream, write, off as usize, &local, local_off, len);
                match copy {
                    Ok(c) => self.copies.push_back((tok, c, len)),
                    Err(_) => {
                        t.complete(tok, Status::RemoteAccess, 0, 0);
                    }
                }
                true
            }
            OpDesc::Recv | OpDesc::Atomic { .. } => {
                // Never queued here: receives have their own queue, atomics are refused.
                t.submit_pop();
                t.complete(tok, Status::ProtocolError, 0, 0);
                true
            }
        }
    }

    /// Sends `revoke` for exported regions whose memory the user dropped.
    fn revoke_dropped(&mut self) {
        if !self.notices.any.swap(false, Ordering::AcqRel) {
            return;
        }
        let dropped = std::mem::take(
            &mut *self
                .notices
                .regions
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        for region in dropped {
            if self.exports.contains_key(&region) {
                if self.peer_gone || self.same_process {
                    // No mapping of another process can be left: free now.
                    if let Some(buf) = self.exports.remove(&region) {
                        forget_local_export(&buf);
                    }
                } else {
                    self.push_frame(K_REVOKE, &region.to_le_bytes());
                }
            }
        }
    }

    /// Closes revoked peer mappings that no copy uses any more, and says so to the peer.
    fn close_revoked(&mut self) {
        let mut i = 0;
        while i < self.closing.len() {
            if self.closing[i].1.unused() {
                let (region, mapping) = self.closing.swap_remove(i);
                drop(mapping);
                self.push_frame(K_REVOKED, &region.to_le_bytes());
            } else {
                i += 1;
            }
        }
    }

    /// The socket hung up: the peer's mappings are closed (with its transport) or gone (with
    /// its process), so our exports can be freed.
    fn peer_left(&mut self) {
        self.peer_gone = true;
        for (_, buf) in self.exports.drain() {
            forget_local_export(&buf);
        }
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

fn forget_local_export(buf: &Arc<nv::DeviceBuffer>) {
    let mut e = local_exports().lock().unwrap_or_else(|p| p.into_inner());
    e.retain(|_, w| w.strong_count() > 0 && !std::ptr::eq(w.as_ptr(), Arc::as_ptr(buf)));
}

impl Drop for CudaIpcHal {
    /// Closes this side's mappings of the peer's memory first (after the copies using them),
    /// then makes sure the peer closed its mappings of ours before they are freed: every
    /// export is revoked and kept until the peer answers or hangs up, for at most the
    /// handshake timeout; what is still unanswered then is leaked, not freed under the peer.
    fn drop(&mut self) {
        self.copies.clear(); // each waits for its copy
        self.remote.clear();
        self.closing.clear();
        if self.exports.is_empty() || self.peer_gone || self.same_process {
            let exports: Vec<_> = self.exports.drain().map(|(_, b)| b).collect();
            for buf in &exports {
                forget_local_export(buf);
            }
            return;
        }
        let regions: Vec<u32> = self.exports.keys().copied().collect();
        for region in regions {
            self.push_frame(K_REVOKE, &region.to_le_bytes());
        }
        let deadline = Instant::now() + self.wait_limit;
        let mut chunk = [0u8; 4096];
        let mut broken = false;
        while !self.exports.is_empty() && !broken && Instant::now() < deadline {
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
                    (K_REVOKED, Ok(region)) => {
                        if let Some(buf) = self.exports.remove(&region) {
                            forget_local_export(&buf);
                        }
                    }
                    (K_REVOKE, Ok(region)) => self.push_frame(K_REVOKED, &region.to_le_bytes()),
                    _ => {}
                }
                at += FRAME_HEADER_LEN + len;
            }
            self.inbox.drain(..at);
            match (&self.sock).read(&mut chunk) {
                Ok(0) => {
                    self.peer_left();
                    break;
                }
                Ok(n) => self.inbox.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let _ = sys::poll_readable(self.sock.as_fd(), Some(Duration::from_millis(10)));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    self.peer_left();
                    break;
                }
            }
        }
        // Unanswered: the peer may still map them. Never free memory under it.
        for (_, buf) in self.exports.drain() {
            forget_local_export(&buf);
            std::mem::forget(buf);
        }
    }
}

impl Hal for CudaIpcHal {
    fn kind(&self) -> TransportKind {
        TransportKind::CudaIpc
    }

    fn register(&mut self, t: &mut Tracker, len: usize, access: Access) -> Result<Region> {
        let bytes = len.max(1);
        let buf = Arc::new(self.device.alloc(bytes).map_err(cuda("cuMemAlloc"))?);
        nv::fill(&*buf, 0, bytes, 0).map_err(cuda("cuMemsetD8"))?;
        let handle = if access.is_remote() {
            Some(buf.ipc_handle().map_err(cuda("cuIpcGetMemHandle"))?)
        } else {
            None
        };
        let id = t.next_region_id();
        let notice = handle.is_some().then(|| (id, self.notices.clone()));
        if let Some(h) = &handle {
            self.exports.insert(id, buf.clone());
            local_exports()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(h.allocation_id(), Arc::downgrade(&buf));
        }
        let r = Region::device(
            id,
            self.conn,
            TransportKind::CudaIpc,
            access,
            len,
            Box::new(GpuMemory(buf, notice)),
        )?;
        if let Some(handle) = handle {
            let a = Announcement {
                region: r.id(),
                access: access.bits(),
                key: r.inner.key,
                handle,
            };
            self.push_frame(K_ANNOUNCE, &a.encode());
            self.flush()?;
        }
        t.add_region(r.clone());
        Ok(r)
    }

    fn progress(&mut self, t: &mut Tracker) -> Result<()> {
        self.revoke_dropped();
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
        self.sock.as_fd()
    }

    fn arm(&mut self, t: &Tracker) -> Result<bool> {
        let work = !self.copies.is_empty()
            || !self.closing.is_empty()
            || self.notices.any.load(Ordering::Acquire)
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
        let f = encode_frame(K_REVOKE, &7u32.to_le_bytes()).unwrap();
        assert_eq!(decode_frame_header(&f, 0).unwrap(), (K_REVOKE, REVOKE_LEN));
        assert_eq!(decode_revoke(&f[FRAME_HEADER_LEN..]).unwrap(), 7);
        let f = encode_frame(K_REVOKED, &[1, 2, 3]).unwrap();
        assert!(matches!(
            decode_frame_header(&f, 1 << 20),
            Err(DecodeError::TooLong { len: 3, max: 4, .. })
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
            access: (Access::REMOTE_WRITE | Access::REMOTE_READ).bits(),
            key: 0x1234_5678_9abc_def0,
            handle: nv::IpcMemHandle::from_parts([3; 64], 1 << 20, [9; 16]),
        };
        assert_eq!(Announcement::decode(&a.encode()).unwrap(), a);
        let mut b = a.encode();
        b[4] = 0xff;
        assert!(matches!(
            Announcement::decode(&b),
            Err(DecodeError::Invalid { what, .. }) if what.contains("access")
        ));
        let mut b = a.encode();
        b[16] = b'X'; // handle magic
        assert!(Announcement::decode(&b).is_err());
        assert!(Announcement::decode(&b[..10]).is_err());
    }

    #[test]
    fn hello_checks() {
        let mut b = [0u8; HELLO_LEN];
        b[0..8].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
        b[8..12].copy_from_slice(&HELLO_VERSION.to_le_bytes());
        check_hello(&b).unwrap();
        // A version-1 peer (no revocations) is refused.
        b[8] = 1;
        assert!(matches!(
            check_hello(&b),
            Err(Error::Decode(DecodeError::Version { found: 1, .. }))
        ));
        b[0] = 0;
        assert!(matches!(
            check_hello(&b),
            Err(Error::Decode(DecodeError::BadMagic { .. }))
        ));
    }
}
