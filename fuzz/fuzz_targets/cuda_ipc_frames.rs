//! The cuda-ipc backend's decoders of peer bytes: frame headers, region announcements and
//! revocations. A typed error or a value within the limits, never a panic; bytes that decode
//! re-encode to the same bytes (reserved bytes must be zero); and every frame the encoder
//! builds from arbitrary fields decodes back to those fields.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use fabric_core::backend::cuda_ipc::{
    decode_frame_header, decode_revoke, encode_frame, encode_revoke, Announcement, ANNOUNCE_LEN,
    FRAME_HEADER_LEN, FRAME_KINDS, HELLO_LEN, K_ANNOUNCE, K_HELLO, K_MSG, K_REVOKE, K_REVOKED,
    REVOKE_LEN,
};
use fabric_core::Access;
use libfuzzer_sys::fuzz_target;
use nvlink_p2p::IpcMemHandle;

const MAX_BODY: usize = 1 << 20;

#[derive(Debug, Arbitrary)]
struct Fields {
    kind: u8,
    region: u32,
    gen: u32,
    access: u32,
    key: u64,
    raw: [u8; 64],
    len: u64,
    uuid: [u8; 16],
    allocation_id: u64,
    message: Vec<u8>,
}

/// Decodes one frame (header and body) as the backend does.
fn decode(frame: &[u8]) -> Option<(u8, &[u8])> {
    let (kind, len) = decode_frame_header(frame, MAX_BODY).ok()?;
    frame
        .get(FRAME_HEADER_LEN..FRAME_HEADER_LEN + len)
        .map(|b| (kind, b))
}

fuzz_target!(|data: &[u8]| {
    // Bytes from a peer.
    if let Ok((kind, len)) = decode_frame_header(data, MAX_BODY) {
        assert!(data.len() >= FRAME_HEADER_LEN);
        assert!(FRAME_KINDS.contains(&kind));
        let fixed = match kind {
            K_HELLO => Some(HELLO_LEN),
            K_ANNOUNCE => Some(ANNOUNCE_LEN),
            K_REVOKE | K_REVOKED => Some(REVOKE_LEN),
            _ => None,
        };
        match fixed {
            Some(n) => assert_eq!(len, n, "fixed-size frame of another size"),
            None => assert!(len <= MAX_BODY),
        }
        // The header re-encodes exactly (its reserved bytes are zero).
        let header = encode_frame(kind, &vec![0; len]).unwrap();
        assert_eq!(&header[..FRAME_HEADER_LEN], &data[..FRAME_HEADER_LEN]);
        if let Some((_, body)) = decode(data) {
            match kind {
                K_ANNOUNCE => {
                    if let Ok(a) = Announcement::decode(body) {
                        assert_eq!(&a.encode()[..], body);
                    }
                }
                K_REVOKE | K_REVOKED => {
                    let (region, gen) = decode_revoke(body).expect("an 8-byte body decodes");
                    assert_eq!(&encode_revoke(region, gen)[..], body);
                }
                _ => {}
            }
        }
    }
    if let Ok(a) = Announcement::decode(data) {
        assert_eq!(data.len(), ANNOUNCE_LEN);
        assert!(Access::from_bits(a.access).is_some());
        assert!(!a.handle.is_empty());
        assert_eq!(&a.encode()[..], data);
    }

    // Frames our encoder builds from arbitrary (valid) fields.
    let mut u = Unstructured::new(data);
    let Ok(f) = Fields::arbitrary(&mut u) else {
        return;
    };
    let (Some(access), true) = (Access::from_bits(f.access), f.len != 0) else {
        return;
    };
    let announcement = Announcement {
        region: f.region,
        gen: f.gen,
        access: access.bits(),
        key: f.key,
        handle: IpcMemHandle::from_parts(f.raw, f.len, f.uuid).with_allocation_id(f.allocation_id),
    };
    let frame = encode_frame(K_ANNOUNCE, &announcement.encode()).unwrap();
    let (kind, body) = decode(&frame).expect("an encoded announcement frame decodes");
    assert_eq!(kind, K_ANNOUNCE);
    assert_eq!(Announcement::decode(body), Ok(announcement));

    let revoke_kind = if f.kind & 1 == 0 { K_REVOKE } else { K_REVOKED };
    let body = encode_revoke(f.region, f.gen);
    let frame = encode_frame(revoke_kind, &body).unwrap();
    assert_eq!(decode(&frame), Some((revoke_kind, &body[..])));
    assert_eq!(
        decode_revoke(&body),
        Ok((f.region, f.gen)),
        "a revocation round-trips"
    );

    if f.message.len() <= MAX_BODY {
        let frame = encode_frame(K_MSG, &f.message).unwrap();
        assert_eq!(decode(&frame), Some((K_MSG, &f.message[..])));
    }
});
