//! The tcp backend's frame-header decoder on bytes from a peer: a typed error or a header
//! within the limits (payload length <= MAX_FRAME_PAYLOAD, none on frames that carry none),
//! never a panic; a header that decodes re-encodes to the same 56 bytes (its reserved
//! byte 3 must be zero; 36..40 carry the target region's generation). A write-with-immediate
//! frame (wire version 2) carries a 32-bit immediate in `aux0` and nothing in `aux1`.
#![no_main]

use fabric_core::backend::tcp::{decode_header, FrameKind, FRAME_HEADER, MAX_FRAME_PAYLOAD};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = decode_header(data) {
        assert!(data.len() >= FRAME_HEADER);
        assert!(u64::from(h.len) <= MAX_FRAME_PAYLOAD);
        if matches!(
            h.kind,
            FrameKind::WriteAck | FrameKind::AtomicReq | FrameKind::AtomicResp
        ) {
            assert_eq!(h.len, 0, "payload on a frame that carries none");
        }
        if h.kind == FrameKind::WriteImm {
            assert!(h.aux0 <= u64::from(u32::MAX), "immediate over 32 bits");
            assert_eq!(h.aux1, 0, "write-imm frame with aux1");
        }
        // Reserved bytes must be zero to decode: the header re-encodes exactly.
        assert_eq!(&h.encode()[..], &data[..FRAME_HEADER]);
        assert_eq!(decode_header(&h.encode()), Ok(h));
    }
});
