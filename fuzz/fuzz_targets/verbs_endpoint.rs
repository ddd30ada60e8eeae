//! ibverbs-safe's decoders of peer bytes: the QP endpoint blob and the remote memory
//! descriptor. A typed error or a value, never a panic; whatever decodes re-encodes to the
//! same bytes; an endpoint built from valid fields round-trips.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use ibverbs_safe::{Endpoint, Gid, Mtu, RemoteMemory};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Fields {
    lid: u16,
    qpn: u32,
    psn: u32,
    gid: [u8; 16],
    mtu: u8,
    qkey: u32,
}

fuzz_target!(|data: &[u8]| {
    if let Ok(e) = Endpoint::from_bytes(data) {
        assert!(e.qpn >> 24 == 0 && e.psn >> 24 == 0);
        assert_eq!(&e.to_bytes()[..], data);
    }
    if let Ok(m) = RemoteMemory::from_bytes(data) {
        assert_eq!(&m.to_bytes()[..], data);
    }
    if let Ok(f) = Fields::arbitrary(&mut Unstructured::new(data)) {
        let Some(mtu) = Mtu::from_raw(f.mtu as u32) else {
            return;
        };
        let e = Endpoint {
            lid: f.lid,
            qpn: f.qpn & 0x00ff_ffff,
            psn: f.psn & 0x00ff_ffff,
            gid: Gid(f.gid),
            mtu,
            qkey: f.qkey,
        };
        assert_eq!(Endpoint::from_bytes(&e.to_bytes()), Ok(e));
    }
});
