//! The tcp backend's frame-header decoder on bytes from a peer: a typed error or a header
//! within the limits (payload length <= MAX_FRAME_PAYLOAD, none on frames that carry none),
//! never a panic; a header that decodes re-encodes to the same 56 bytes, except the
//! reserved ones (3 and 36..40).
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
        let mut want = [0u8; FRAME_HEADER];
        want.copy_from_slice(&data[..FRAME_HEADER]);
        want[3] = 0;
        want[36..40].fill(0);
        assert_eq!(h.encode(), want);
        assert_eq!(decode_header(&h.encode()), Ok(h));
    }
});
