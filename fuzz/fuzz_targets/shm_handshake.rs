//! The shm backend's decoders of peer bytes (the channel hello and the region
//! announcement): a typed error or a value within the documented limits, never a panic.
#![no_main]

use fabric_core::backend::shm::{decode_announcement, decode_hello};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(cap) = decode_hello(data) {
        assert_eq!(data.len(), 24);
        assert!(cap == 0 || (cap.is_power_of_two() && (4096..=1 << 30).contains(&cap)));
    }
    if let Ok((_id, len, ..)) = decode_announcement(data) {
        assert_eq!(data.len(), 32);
        assert!(len <= isize::MAX as u64);
    }
});
