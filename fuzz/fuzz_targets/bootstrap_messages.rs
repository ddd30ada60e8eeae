//! Every bootstrap decoder (frame header, challenge, hello, rank table, lost ranks,
//! endpoint info) on
//! bytes from a peer: a typed error or a value, never a panic, and whatever decodes
//! re-encodes to the same bytes. Structured values (from the same input) round-trip too.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use fabric_core::bootstrap::wire::{
    decode_header, decode_table, encode_header, encode_table, Challenge, EndpointInfo, Hello, Lost,
    PeerEntry, HEADER_LEN, MAC_LEN, MAX_BLOB, MAX_ERROR, MAX_LOST,
};
use libfuzzer_sys::fuzz_target;

/// A structured message to encode and decode again.
#[derive(Debug, Arbitrary)]
enum Msg {
    Hello {
        rank: u32,
        size: u32,
        mac: [u8; MAC_LEN],
        blob: Vec<u8>,
    },
    Table(Vec<(String, Vec<u8>)>),
    Info {
        host: String,
        rdma: bool,
        addrs: Vec<String>,
    },
    Lost {
        ranks: Vec<u32>,
        reason: String,
    },
}

fn raw(data: &[u8]) {
    if let Ok((t, len)) = decode_header(data) {
        assert!(len <= t.max_len(), "length above the type's limit accepted");
        // Byte 7 is reserved: only zero decodes, so the header round-trips exactly.
        assert_eq!(data[7], 0, "non-zero reserved byte accepted");
        assert_eq!(&encode_header(t, len)[..], &data[..HEADER_LEN]);
    }
    if let Ok(c) = Challenge::decode(data) {
        assert_eq!(c.encode(), data);
    }
    if let Ok(h) = Hello::decode(data) {
        assert!(h.rank < h.size && h.blob.len() <= MAX_BLOB);
        assert_eq!(h.encode(), data);
    }
    if let Ok(t) = decode_table(data) {
        for (i, e) in t.iter().enumerate() {
            assert_eq!(e.rank as usize, i);
            assert!(e.blob.len() <= MAX_BLOB);
        }
        assert_eq!(encode_table(&t), data);
    }
    if let Ok(i) = EndpointInfo::decode(data) {
        assert_eq!(i.encode(), data);
    }
    if let Ok(l) = Lost::decode(data) {
        assert!(l.ranks.len() <= MAX_LOST && l.reason.len() <= MAX_ERROR);
        assert_eq!(l.encode(), data);
    }
}

fn structured(m: Msg) {
    match m {
        Msg::Hello {
            rank,
            size,
            mac,
            blob,
        } => {
            let h = Hello {
                rank,
                size,
                mac,
                blob,
            };
            let valid = size > 0 && rank < size && h.blob.len() <= MAX_BLOB;
            match Hello::decode(&h.encode()) {
                Ok(d) => {
                    assert!(valid, "invalid hello accepted: {h:?}");
                    assert_eq!(d, h);
                }
                Err(_) => assert!(!valid, "valid hello refused: {h:?}"),
            }
        }
        Msg::Table(entries) => {
            let t: Vec<PeerEntry> = entries
                .into_iter()
                .enumerate()
                .map(|(i, (ip, blob))| PeerEntry {
                    rank: i as u32,
                    ip,
                    blob,
                })
                .collect();
            let valid = t
                .iter()
                .all(|e| e.ip.len() <= 255 && e.blob.len() <= MAX_BLOB);
            match decode_table(&encode_table(&t)) {
                Ok(d) if valid => assert_eq!(d, t),
                Ok(_) => {}
                Err(e) => assert!(!valid, "valid table refused: {e}"),
            }
        }
        Msg::Info { host, rdma, addrs } => {
            let i = EndpointInfo { host, rdma, addrs };
            let valid = i.host.len() <= 1024
                && i.addrs.len() <= 16
                && i.addrs.iter().all(|a| a.len() <= 1024);
            match EndpointInfo::decode(&i.encode()) {
                Ok(d) if valid => assert_eq!(d, i),
                Ok(_) => {}
                Err(e) => assert!(!valid, "valid endpoint info refused: {e}"),
            }
        }
        Msg::Lost { ranks, reason } => {
            let l = Lost { ranks, reason };
            // Over-long lists and texts are cut when encoded: what decodes is a prefix.
            let d = Lost::decode(&l.encode()).expect("an encoded Lost frame must decode");
            assert!(l.ranks.starts_with(&d.ranks) && l.reason.starts_with(&d.reason));
            if l.ranks.len() <= MAX_LOST && l.reason.len() <= MAX_ERROR {
                assert_eq!(d, l);
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    raw(data);
    if let Ok(m) = Msg::arbitrary_take_rest(Unstructured::new(data)) {
        structured(m);
    }
});
