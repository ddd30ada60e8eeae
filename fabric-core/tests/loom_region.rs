//! loom model of a region's local-borrow bookkeeping (`Lend` in `src/region.rs`): a
//! copy-free borrow (`bytes` / `bytes_mut`) and an operation's slice (or a copy) never
//! coexist, under every interleaving of two threads; two shared borrows may.
//!
//! Run: `RUSTFLAGS="--cfg fabric_loom" cargo test --release -p fabric-core --test loom_region`.
#![cfg(fabric_loom)]

use fabric_core::{Access, Region, TransportKind};
use loom::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use loom::sync::Arc;
use loom::thread;

fn region() -> Region {
    Region::anonymous(0, 1, TransportKind::Tcp, Access::LOCAL_WRITE, 64).unwrap()
}

/// Who holds the bytes right now, as the model sees it: bit 0 a mutable borrow, bits 1..
/// count slices, bits 8.. count shared borrows.
struct Seen(AtomicUsize);

const MUT: usize = 1;
const SLICE: usize = 2;
const SHARED: usize = 1 << 8;

impl Seen {
    fn enter(&self, what: usize) {
        let before = self.0.fetch_add(what, SeqCst);
        let after = before + what;
        let muts = after & 1;
        let slices = (after >> 1) & 0x7f;
        let shared = after >> 8;
        assert!(muts <= 1, "two mutable borrows");
        assert!(
            !(muts == 1 && (slices > 0 || shared > 0)),
            "a mutable borrow coexists with a slice or a shared borrow ({after:#x})"
        );
        assert!(
            !(shared > 0 && slices > 0),
            "a shared borrow coexists with a slice ({after:#x})"
        );
    }
    fn leave(&self, what: usize) {
        self.0.fetch_sub(what, SeqCst);
    }
}

#[test]
fn a_mutable_borrow_and_a_slice_exclude_each_other() {
    loom::model(|| {
        let r = region();
        let seen = Arc::new(Seen(AtomicUsize::new(0)));
        let (r2, s2) = (r.clone(), seen.clone());
        let t = thread::spawn(move || {
            if let Ok(g) = r2.bytes_mut() {
                s2.enter(MUT);
                s2.leave(MUT);
                drop(g);
            }
        });
        if let Ok(b) = r.slice(0, 8) {
            seen.enter(SLICE);
            seen.leave(SLICE);
            drop(b);
        }
        t.join().unwrap();
        // Everything was given back: both kinds work again.
        assert!(r.bytes_mut().is_ok());
        assert!(r.slice(0, 8).is_ok());
    });
}

#[test]
fn shared_borrows_coexist_but_exclude_slices_and_copies() {
    loom::model(|| {
        let r = region();
        let seen = Arc::new(Seen(AtomicUsize::new(0)));
        let (r2, s2) = (r.clone(), seen.clone());
        let t = thread::spawn(move || {
            if let Ok(g) = r2.bytes() {
                s2.enter(SHARED);
                s2.leave(SHARED);
                drop(g);
            }
            // A copy counts like a slice while it runs.
            let _ = r2.write_at(0, &[1]);
        });
        if let Ok(g) = r.bytes() {
            seen.enter(SHARED);
            if let Ok(b) = r.slice(0, 8) {
                panic!("a slice was handed out during a shared borrow: {b:?}");
            }
            seen.leave(SHARED);
            drop(g);
        }
        t.join().unwrap();
    });
}
