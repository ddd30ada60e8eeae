//! The shm backend's decoders of peer bytes (the channel hello and the control messages:
//! region announcements and revocations): a typed error or a value within the documented
//! limits, never a panic; a revocation carries nothing but its id and generation.
#![no_main]

use fabric_core::backend::shm::{decode_announcement, decode_hello};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(cap) = decode_hello(data) {
        assert_eq!(data.len(), 24);
        assert!(cap == 0 || (cap.is_power_of_two() && (4096..=1 << 30).contains(&cap)));
    }
    if let Ok((_id, len, key, access, flags, _gen)) = decode_announcement(data) {
        assert_eq!(data.len(), 40);
        assert!(len <= isize::MAX as u64);
        assert!(flags <= 2, "unknown flags {flags}");
        if flags == 2 {
            assert_eq!(
                (len, key, access.bits()),
                (0, 0, 0),
                "revocation with fields"
            );
        }
    }
});
