//! `RemoteKey::decode` on bytes from a peer: a typed error or a key, never a panic; a key
//! that decodes packs to the same bytes (reserved bytes must be zero); and every key
//! built from valid fields round-trips, the generation included (keys of a dropped
//! region differ from those of the region that reuses its id only by it).
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use fabric_core::{Access, RemoteKey, TransportKind};
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Fields {
    transport: u8,
    region: u32,
    gen: u32,
    access: u32,
    len: u64,
    key: u64,
    addr: u64,
    rkey: u32,
}

fuzz_target!(|data: &[u8]| {
    if let Ok(k) = RemoteKey::decode(data) {
        assert_eq!(data.len(), RemoteKey::PACKED_LEN);
        assert!(Access::from_bits(k.access).is_some());
        // The reserved bytes must be zero to decode: the key packs to the same bytes.
        assert_eq!(&k.pack()[..], data);
        assert_eq!(RemoteKey::decode(&k.pack()), Ok(k));
    }
    let mut u = Unstructured::new(data);
    if let Ok(f) = Fields::arbitrary(&mut u) {
        let Some(access) = Access::from_bits(f.access) else {
            return;
        };
        let transport = TransportKind::ALL[f.transport as usize % TransportKind::ALL.len()];
        let k = RemoteKey {
            transport,
            region: f.region,
            gen: f.gen,
            access: access.bits(),
            len: f.len,
            key: f.key,
            addr: f.addr,
            rkey: f.rkey,
        };
        assert_eq!(RemoteKey::decode(&k.pack()), Ok(k));
        // Another generation of the same id is another key, on the wire too.
        let other = RemoteKey {
            gen: f.gen.wrapping_add(1),
            ..k
        };
        assert_ne!(other.pack(), k.pack());
        assert_eq!(
            RemoteKey::decode(&other.pack()).map(|d| d.gen),
            Ok(other.gen)
        );
    }
});
