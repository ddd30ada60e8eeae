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
//! * One-sided: write and read are device-to-device copies between a local region and the
//!   peer's mapped region, queued on one CUDA stream, each completing through a CUDA event;
//!   the initiator checks the key, the granted access and the mapping's real length. An
//!   operation on a key whose announcement has not arrived yet waits for it (up to the
//!   handshake timeout, then [`Status::RemoteAccess`]).
//! * Two-sided: messages travel over the Unix socket, staged through host memory
//!   (a control path: bulk GPU data should use one-sided writes). A send waits for the
//!   one-sided operations posted before it, so everything takes effect in post order.
//! * Not offered: atomics (`capabilities().atomics == false`; the tracker refuses them).
//! * Sleeping: [`wait_fd`](crate::Transport::wait_fd) is the socket; while GPU copies are in
//!   flight `arm` says "poll" (a CUDA event has no fd to sleep on).
//! * Peer death: the socket hangs up; everything in flight completes with
//!   [`Status::PeerGone`].

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
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
/// Frame kinds.
const K_HELLO: u8 = 1;
const K_ANNOUNCE: u8 = 2;
const K_MSG: u8 = 3;
const HELLO_MAGIC: u64 = 0x3130_4144_5543_4246; // "FBCUDA01"
const HELLO_VERSION: u32 = 1;
const HELLO_LEN: usize = 32;
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
    if !matches!(kind, K_HELLO | K_ANNOUNCE | K_MSG) {
        return Err(DecodeError::Invalid {
            what: "cuda-ipc frame kind",
            value: kind as u64,
        });
    }
    let len = u32::from_le_bytes([b[4], b[5], b[6], b[7]]) as usize;
    let max = match kind {
        K_HELLO => HELLO_LEN,
        K_ANNOUNCE => ANNOUNCE_LEN,
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

impl Announcement {
    fn encode(&self) -> [u8; ANNOUNCE_LEN] {
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

/// GPU memory behind a cuda-ipc [`Region`].
#[derive(Debug)]
struct GpuMemory(Arc<nv::DeviceBuffer>);

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
    mapping: std::result::Result<Arc<nv::IpcMapping>, String>,
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
                    let mapping = a
                        .handle
                        .open(&self.device)
                        .map(Arc::new)
                        .map_err(|e| e.to_string());
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
                    t.fail_all(Status::PeerGone, "cuda-ipc peer hung up");
                    return Ok(());
                }
                Ok(n) => self.inbox.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
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
                let off = off as usize;
                let copy = if write {
                    nv::copy_async(&self.stream, mapping, off, &local, local_off, len)
                } else {
                    nv::copy_async(&self.stream, &local, local_off, mapping, off, len)
                };
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
        let r = Region::device(
            t.next_region_id(),
            self.conn,
            TransportKind::CudaIpc,
            access,
            len,
            Box::new(GpuMemory(buf)),
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
