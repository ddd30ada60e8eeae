//! Every nvlink-p2p decoder of bytes from a peer: never panics, and whatever decodes
//! re-encodes to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvlink_p2p::handle::{FabricHandle, IpcEventHandle, IpcMemHandle, VmmDescriptor};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = IpcMemHandle::decode(data) {
        assert_eq!(&h.encode()[..], data);
    }
    if let Ok(h) = IpcEventHandle::decode(data) {
        assert_eq!(&h.encode()[..], data);
    }
    if let Ok(h) = VmmDescriptor::decode(data) {
        assert_eq!(&h.encode()[..], data);
    }
    if let Ok(h) = FabricHandle::decode(data) {
        assert_eq!(&h.encode()[..], data);
    }
});
