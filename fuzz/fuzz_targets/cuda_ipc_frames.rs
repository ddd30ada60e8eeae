//! The cuda-ipc backend's decoders of peer bytes: frame headers and region announcements.
#![no_main]

use fabric_core::backend::cuda_ipc::{decode_frame_header, Announcement, FRAME_HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((_, len)) = decode_frame_header(data, 1 << 20) {
        assert!(data.len() >= FRAME_HEADER_LEN);
        assert!(len <= 1 << 20);
    }
    let _ = Announcement::decode(data);
});
