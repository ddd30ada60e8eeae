//! Peer access between devices, enabled for as long as a [`PeerAccess`] guard lives.
#![allow(unsafe_code)]

use std::fmt;
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::cache::RefCache;
use crate::driver::{check, Device};
use crate::error::{Error, Result};

type Key = (usize, usize);

fn registry() -> &'static RefCache<Key, ()> {
    static R: OnceLock<RefCache<Key, ()>> = OnceLock::new();
    R.get_or_init(RefCache::new)
}

fn key(from: &Device, to: &Device) -> Key {
    (
        from.context().cu_ctx() as usize,
        to.context().cu_ctx() as usize,
    )
}

/// Whether a guard enables access between the two contexts, in either direction.
pub(crate) fn enabled_between(a: &Device, b: &Device) -> bool {
    registry().contains(&key(a, b)) || registry().contains(&key(b, a))
}

/// Access from one context to another device's memory, enabled (`cuCtxEnablePeerAccess`)
/// while this guard lives and disabled when the last guard for the pair drops. Guards for
/// the same pair share one enable.
///
/// Two contexts on the *same* GPU need no enabling: the guard is then a no-op and copies
/// between them stay on the GPU.
pub struct PeerAccess {
    from: Device,
    to: Device,
    key: Option<Key>,
}

impl fmt::Debug for PeerAccess {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PeerAccess")
            .field("from", &self.from.ordinal())
            .field("to", &self.to.ordinal())
            .field("same_gpu", &self.key.is_none())
            .finish()
    }
}

impl PeerAccess {
    /// The device that gained access.
    pub fn from(&self) -> &Device {
        &self.from
    }

    /// The device whose memory it can access.
    pub fn to(&self) -> &Device {
        &self.to
    }
}

impl Device {
    /// Whether this device can access `peer`'s memory directly (`cuDeviceCanAccessPeer`).
    /// Always true for the same GPU.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        if self.same_gpu(peer) {
            return Ok(true);
        }
        let mut can = 0;
        // SAFETY: valid out-pointer and device handles.
        check("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(
                &mut can,
                self.context().cu_device(),
                peer.context().cu_device(),
            )
        })?;
        Ok(can != 0)
    }

    /// Enables access from this context to `peer`'s memory for the guard's lifetime.
    ///
    /// # Errors
    /// [`Error::PeerAccessUnavailable`] when there is no peer path (no NVLink / PCIe P2P):
    /// nothing is staged through the host behind your back. [`Error::Driver`] otherwise.
    pub fn enable_peer_access(&self, peer: &Device) -> Result<PeerAccess> {
        if self.same_gpu(peer) {
            return Ok(PeerAccess {
                from: self.clone(),
                to: peer.clone(),
                key: None,
            });
        }
        if !self.can_access_peer(peer)? {
            return Err(Error::PeerAccessUnavailable {
                from: self.ordinal(),
                to: peer.ordinal(),
            });
        }
        let k = key(self, peer);
        registry().acquire(&k, || {
            let _ctx = self.bind()?;
            // SAFETY: both contexts are live (held by self/peer); flags must be 0.
            let r = unsafe { sys::cuCtxEnablePeerAccess(peer.context().cu_ctx(), 0) };
            match r {
                // Enabled outside this crate already: share it.
                sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
                r => check("cuCtxEnablePeerAccess", r),
            }
        })?;
        Ok(PeerAccess {
            from: self.clone(),
            to: peer.clone(),
            key: Some(k),
        })
    }
}

impl Drop for PeerAccess {
    fn drop(&mut self) {
        let Some(k) = self.key else { return };
        let (from, to) = (&self.from, &self.to);
        registry().release(&k, |()| {
            if let Ok(_ctx) = from.bind() {
                // SAFETY: both contexts are live (held by this guard).
                let _ = unsafe { sys::cuCtxDisablePeerAccess(to.context().cu_ctx()) };
            }
        });
    }
}
