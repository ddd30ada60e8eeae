//! Wire formats of the handles exchanged between processes.
//!
//! Every handle is encoded as a fixed-size little-endian record with an 8-byte header:
//! the magic `NVP2`, a format version (2), a kind byte and two reserved zero bytes.
//! `decode` functions are pure: they take bytes from an untrusted peer and return a typed
//! [`DecodeError`] on anything malformed (a fuzz target calls them directly).
//!
//! The opaque 64-byte CUDA handles inside cannot be validated here; the driver rejects
//! bad ones when they are opened (an [`Error::Driver`](crate::Error::Driver)).

use std::fmt;

/// The four magic bytes that start every encoded handle.
pub const MAGIC: [u8; 4] = *b"NVP2";
/// The wire-format version this crate writes and reads (2: the IPC memory handle carries the
/// exporter's allocation id).
pub const FORMAT_VERSION: u8 = 2;
const HEADER_LEN: usize = 8;

/// Why bytes did not decode as a handle.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The record has the wrong size.
    #[error("{kind} record must be {expected} bytes, got {got}")]
    WrongLength {
        /// The record kind expected.
        kind: &'static str,
        /// Its size.
        expected: usize,
        /// The size received.
        got: usize,
    },
    /// The record does not start with `NVP2`.
    #[error("bad magic {0:02x?}, expected \"NVP2\"")]
    BadMagic([u8; 4]),
    /// A wire-format version this build does not know.
    #[error("unsupported handle format version {0} (this build reads version {FORMAT_VERSION})")]
    UnsupportedVersion(u8),
    /// A record of another kind.
    #[error("expected a {expected} record, got kind {got}")]
    WrongKind {
        /// The record kind expected.
        expected: &'static str,
        /// The kind byte received.
        got: u8,
    },
    /// Reserved bytes that are not zero.
    #[error("reserved bytes are not zero")]
    ReservedNotZero,
    /// A zero allocation size.
    #[error("allocation size is zero")]
    ZeroSize,
    /// A size that does not fit this machine's address space.
    #[error("allocation size {0} does not fit in usize")]
    SizeTooLarge(u64),
    /// A shareable-handle type this crate does not know.
    #[error("unknown shareable handle type {0}")]
    UnknownHandleType(u32),
}

#[derive(Clone, Copy)]
#[repr(u8)]
enum Kind {
    IpcMem = 1,
    IpcEvent = 2,
    Vmm = 3,
    Fabric = 4,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::IpcMem => "IPC memory handle",
            Kind::IpcEvent => "IPC event handle",
            Kind::Vmm => "VMM descriptor",
            Kind::Fabric => "fabric handle",
        }
    }
}

fn header(kind: Kind) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4] = FORMAT_VERSION;
    h[5] = kind as u8;
    h
}

/// Checks length and header; returns the body.
fn check(bytes: &[u8], kind: Kind, total: usize) -> Result<&[u8], DecodeError> {
    if bytes.len() != total {
        return Err(DecodeError::WrongLength {
            kind: kind.name(),
            expected: total,
            got: bytes.len(),
        });
    }
    let magic: [u8; 4] = bytes[..4].try_into().expect("length checked");
    if magic != MAGIC {
        return Err(DecodeError::BadMagic(magic));
    }
    if bytes[4] != FORMAT_VERSION {
        return Err(DecodeError::UnsupportedVersion(bytes[4]));
    }
    if bytes[5] != kind as u8 {
        return Err(DecodeError::WrongKind {
            expected: kind.name(),
            got: bytes[5],
        });
    }
    if bytes[6] != 0 || bytes[7] != 0 {
        return Err(DecodeError::ReservedNotZero);
    }
    Ok(&bytes[HEADER_LEN..])
}

fn size_field(raw: u64) -> Result<u64, DecodeError> {
    if raw == 0 {
        return Err(DecodeError::ZeroSize);
    }
    if usize::try_from(raw).is_err() {
        return Err(DecodeError::SizeTooLarge(raw));
    }
    Ok(raw)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("in bounds"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("in bounds"))
}

fn array_at<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    b[at..at + N].try_into().expect("in bounds")
}

struct Hex<'a>(&'a [u8]);
impl fmt::Debug for Hex<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// A legacy CUDA IPC memory handle (`CUipcMemHandle`) plus what the importer needs to know.
///
/// Produced by [`DeviceBuffer::ipc_handle`](crate::DeviceBuffer::ipc_handle), opened with
/// [`IpcMemHandle::open`](crate::IpcMemHandle::open).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcMemHandle {
    pub(crate) raw: [u8; 64],
    pub(crate) len: u64,
    pub(crate) device_uuid: [u8; 16],
    pub(crate) allocation_id: u64,
}

impl IpcMemHandle {
    /// Size of the encoded record.
    pub const ENCODED_LEN: usize = HEADER_LEN + 64 + 8 + 16 + 8;

    /// Builds a handle from its parts (the raw bytes come from `cuIpcGetMemHandle`), with
    /// allocation id 0 (see [`IpcMemHandle::with_allocation_id`]).
    pub fn from_parts(raw: [u8; 64], len: u64, device_uuid: [u8; 16]) -> Self {
        IpcMemHandle {
            raw,
            len,
            device_uuid,
            allocation_id: 0,
        }
    }

    /// The same handle naming allocation `id` of its exporter.
    pub fn with_allocation_id(mut self, id: u64) -> Self {
        self.allocation_id = id;
        self
    }

    /// An id the exporter gives each allocation it exports (random per process, then
    /// counted), so that an importer can tell two allocations apart even when the driver's
    /// 64 handle bytes repeat (memory freed and allocated again at the same place).
    pub fn allocation_id(&self) -> u64 {
        self.allocation_id
    }

    /// The opaque 64-byte `CUipcMemHandle`.
    pub fn raw(&self) -> &[u8; 64] {
        &self.raw
    }

    /// The size in bytes of the exported allocation.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the exported allocation is empty (never true for a decoded handle).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The UUID of the GPU that owns the memory.
    pub fn device_uuid(&self) -> [u8; 16] {
        self.device_uuid
    }

    /// Encodes the handle for sending to another process.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[..HEADER_LEN].copy_from_slice(&header(Kind::IpcMem));
        out[8..72].copy_from_slice(&self.raw);
        out[72..80].copy_from_slice(&self.len.to_le_bytes());
        out[80..96].copy_from_slice(&self.device_uuid);
        out[96..104].copy_from_slice(&self.allocation_id.to_le_bytes());
        out
    }

    /// Decodes a handle received from another process.
    ///
    /// # Errors
    /// A [`DecodeError`] naming what is wrong with the bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let b = check(bytes, Kind::IpcMem, Self::ENCODED_LEN)?;
        Ok(IpcMemHandle {
            raw: array_at(b, 0),
            len: size_field(u64_at(b, 64))?,
            device_uuid: array_at(b, 72),
            allocation_id: u64_at(b, 88),
        })
    }
}

impl fmt::Debug for IpcMemHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcMemHandle")
            .field("raw", &Hex(&self.raw[..16]))
            .field("len", &self.len)
            .field("device_uuid", &Hex(&self.device_uuid))
            .field("allocation_id", &format_args!("{:#x}", self.allocation_id))
            .finish()
    }
}

/// A legacy CUDA IPC event handle (`CUipcEventHandle`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpcEventHandle {
    pub(crate) raw: [u8; 64],
}

impl IpcEventHandle {
    /// Size of the encoded record.
    pub const ENCODED_LEN: usize = HEADER_LEN + 64;

    /// Builds a handle from the raw bytes of `cuIpcGetEventHandle`.
    pub fn from_raw(raw: [u8; 64]) -> Self {
        IpcEventHandle { raw }
    }

    /// The opaque 64-byte `CUipcEventHandle`.
    pub fn raw(&self) -> &[u8; 64] {
        &self.raw
    }

    /// Encodes the handle for sending to another process.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[..HEADER_LEN].copy_from_slice(&header(Kind::IpcEvent));
        out[8..].copy_from_slice(&self.raw);
        out
    }

    /// Decodes a handle received from another process.
    ///
    /// # Errors
    /// A [`DecodeError`] naming what is wrong with the bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let b = check(bytes, Kind::IpcEvent, Self::ENCODED_LEN)?;
        Ok(IpcEventHandle {
            raw: array_at(b, 0),
        })
    }
}

impl fmt::Debug for IpcEventHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcEventHandle")
            .field("raw", &Hex(&self.raw[..16]))
            .finish()
    }
}

/// The kind of OS handle a VMM allocation is shared through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ShareableHandleType {
    /// A POSIX file descriptor, passed with `SCM_RIGHTS` or `pidfd_getfd`.
    PosixFd,
    /// A 64-byte fabric handle (multi-node NVLink through IMEX).
    Fabric,
}

impl ShareableHandleType {
    fn to_wire(self) -> u32 {
        match self {
            ShareableHandleType::PosixFd => 1,
            ShareableHandleType::Fabric => 8,
        }
    }

    fn from_wire(v: u32) -> Result<Self, DecodeError> {
        match v {
            1 => Ok(ShareableHandleType::PosixFd),
            8 => Ok(ShareableHandleType::Fabric),
            other => Err(DecodeError::UnknownHandleType(other)),
        }
    }
}

/// What travels next to a VMM shareable fd: the allocation size and owning GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VmmDescriptor {
    /// Size of the physical allocation in bytes (a multiple of the granularity).
    pub size: u64,
    /// UUID of the GPU that owns the allocation.
    pub device_uuid: [u8; 16],
    /// How the allocation is shared.
    pub handle_type: ShareableHandleType,
}

impl VmmDescriptor {
    /// Size of the encoded record.
    pub const ENCODED_LEN: usize = HEADER_LEN + 8 + 16 + 4 + 4;

    /// Encodes the descriptor.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[..HEADER_LEN].copy_from_slice(&header(Kind::Vmm));
        out[8..16].copy_from_slice(&self.size.to_le_bytes());
        out[16..32].copy_from_slice(&self.device_uuid);
        out[32..36].copy_from_slice(&self.handle_type.to_wire().to_le_bytes());
        out
    }

    /// Decodes a descriptor received from another process.
    ///
    /// # Errors
    /// A [`DecodeError`] naming what is wrong with the bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let b = check(bytes, Kind::Vmm, Self::ENCODED_LEN)?;
        let size = size_field(u64_at(b, 0))?;
        let device_uuid = array_at(b, 8);
        let handle_type = ShareableHandleType::from_wire(u32_at(b, 24))?;
        if u32_at(b, 28) != 0 {
            return Err(DecodeError::ReservedNotZero);
        }
        Ok(VmmDescriptor {
            size,
            device_uuid,
            handle_type,
        })
    }
}

/// A VMM fabric handle (`CUmemFabricHandle`) with its allocation size and owning GPU.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FabricHandle {
    pub(crate) raw: [u8; 64],
    pub(crate) size: u64,
    pub(crate) device_uuid: [u8; 16],
}

impl FabricHandle {
    /// Size of the encoded record.
    pub const ENCODED_LEN: usize = HEADER_LEN + 64 + 8 + 16;

    /// Builds a handle from its parts (the raw bytes come from `cuMemExportToShareableHandle`).
    pub fn from_parts(raw: [u8; 64], size: u64, device_uuid: [u8; 16]) -> Self {
        FabricHandle {
            raw,
            size,
            device_uuid,
        }
    }

    /// The opaque 64-byte `CUmemFabricHandle`.
    pub fn raw(&self) -> &[u8; 64] {
        &self.raw
    }

    /// Size of the physical allocation in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// UUID of the GPU that owns the allocation.
    pub fn device_uuid(&self) -> [u8; 16] {
        self.device_uuid
    }

    /// Encodes the handle.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[..HEADER_LEN].copy_from_slice(&header(Kind::Fabric));
        out[8..72].copy_from_slice(&self.raw);
        out[72..80].copy_from_slice(&self.size.to_le_bytes());
        out[80..96].copy_from_slice(&self.device_uuid);
        out
    }

    /// Decodes a handle received from another process or node.
    ///
    /// # Errors
    /// A [`DecodeError`] naming what is wrong with the bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let b = check(bytes, Kind::Fabric, Self::ENCODED_LEN)?;
        Ok(FabricHandle {
            raw: array_at(b, 0),
            size: size_field(u64_at(b, 64))?,
            device_uuid: array_at(b, 72),
        })
    }
}

impl fmt::Debug for FabricHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FabricHandle")
            .field("raw", &Hex(&self.raw[..16]))
            .field("size", &self.size)
            .field("device_uuid", &Hex(&self.device_uuid))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern<const N: usize>(seed: u8) -> [u8; N] {
        let mut a = [0u8; N];
        for (i, b) in a.iter_mut().enumerate() {
            *b = seed.wrapping_mul(31).wrapping_add(i as u8);
        }
        a
    }

    #[test]
    fn ipc_mem_round_trip() {
        let h = IpcMemHandle::from_parts(pattern(3), 1 << 30, pattern(9));
        let bytes = h.encode();
        assert_eq!(&bytes[..4], b"NVP2");
        assert_eq!(IpcMemHandle::decode(&bytes).unwrap(), h);
    }

    #[test]
    fn ipc_event_round_trip() {
        let h = IpcEventHandle::from_raw(pattern(5));
        assert_eq!(IpcEventHandle::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn vmm_round_trip_both_types() {
        for t in [ShareableHandleType::PosixFd, ShareableHandleType::Fabric] {
            let d = VmmDescriptor {
                size: 2 << 20,
                device_uuid: pattern(1),
                handle_type: t,
            };
            assert_eq!(VmmDescriptor::decode(&d.encode()).unwrap(), d);
        }
    }

    #[test]
    fn fabric_round_trip() {
        let h = FabricHandle::from_parts(pattern(7), 4 << 20, pattern(2));
        assert_eq!(FabricHandle::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn wrong_length_is_rejected() {
        let bytes = IpcMemHandle::from_parts(pattern(3), 64, pattern(9)).encode();
        for len in [0, 1, 7, 8, IpcMemHandle::ENCODED_LEN - 1] {
            assert_eq!(
                IpcMemHandle::decode(&bytes[..len]),
                Err(DecodeError::WrongLength {
                    kind: "IPC memory handle",
                    expected: IpcMemHandle::ENCODED_LEN,
                    got: len
                })
            );
        }
        let mut longer = bytes.to_vec();
        longer.push(0);
        assert!(matches!(
            IpcMemHandle::decode(&longer),
            Err(DecodeError::WrongLength { got, .. }) if got == IpcMemHandle::ENCODED_LEN + 1
        ));
    }

    #[test]
    fn bad_header_fields_are_rejected() {
        let good = IpcEventHandle::from_raw(pattern(5)).encode();
        let mut b = good;
        b[0] = b'X';
        assert_eq!(
            IpcEventHandle::decode(&b),
            Err(DecodeError::BadMagic(*b"XVP2"))
        );
        let mut b = good;
        b[4] = 1;
        let e = IpcEventHandle::decode(&b).unwrap_err();
        assert_eq!(e, DecodeError::UnsupportedVersion(1));
        assert!(e.to_string().contains("version 1"), "{e}");
        let mut b = good;
        b[6] = 1;
        assert_eq!(
            IpcEventHandle::decode(&b),
            Err(DecodeError::ReservedNotZero)
        );
    }

    #[test]
    fn kinds_are_not_interchangeable() {
        let mem = IpcMemHandle::from_parts(pattern(3), 64, pattern(9)).encode();
        // The first fabric-handle-sized bytes of it: the same layout, a different kind byte.
        assert_eq!(
            FabricHandle::decode(&mem[..FabricHandle::ENCODED_LEN]),
            Err(DecodeError::WrongKind {
                expected: "fabric handle",
                got: 1
            })
        );
    }

    #[test]
    fn zero_size_and_unknown_type_are_rejected() {
        let mut mem = IpcMemHandle::from_parts(pattern(3), 64, pattern(9)).encode();
        mem[72..80].copy_from_slice(&0u64.to_le_bytes());
        assert_eq!(IpcMemHandle::decode(&mem), Err(DecodeError::ZeroSize));

        let d = VmmDescriptor {
            size: 2 << 20,
            device_uuid: pattern(1),
            handle_type: ShareableHandleType::PosixFd,
        };
        let mut b = d.encode();
        b[32..36].copy_from_slice(&2u32.to_le_bytes());
        assert_eq!(
            VmmDescriptor::decode(&b),
            Err(DecodeError::UnknownHandleType(2))
        );
        let mut b = d.encode();
        b[36] = 1;
        assert_eq!(VmmDescriptor::decode(&b), Err(DecodeError::ReservedNotZero));
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A cheap deterministic stand-in for the fuzz target: every decoder on many inputs.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for round in 0..20_000usize {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = [72, 104, 40, round % 128][round % 4];
            let mut buf = vec![0u8; len];
            for (i, b) in buf.iter_mut().enumerate() {
                *b = (state >> ((i % 8) * 8)) as u8 ^ i as u8;
            }
            if len >= 8 && round % 3 == 0 {
                buf[..4].copy_from_slice(&MAGIC);
                buf[4] = FORMAT_VERSION;
                buf[5] = (round % 5) as u8;
                buf[6] = 0;
                buf[7] = 0;
            }
            if let Ok(h) = IpcMemHandle::decode(&buf) {
                assert_eq!(h.encode().as_slice(), buf.as_slice());
            }
            if let Ok(h) = IpcEventHandle::decode(&buf) {
                assert_eq!(h.encode().as_slice(), buf.as_slice());
            }
            if let Ok(h) = VmmDescriptor::decode(&buf) {
                assert_eq!(h.encode().as_slice(), buf.as_slice());
            }
            if let Ok(h) = FabricHandle::decode(&buf) {
                assert_eq!(h.encode().as_slice(), buf.as_slice());
            }
        }
    }
}
