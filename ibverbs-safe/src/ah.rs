//! Address handles (the destination of UD sends).
#![allow(unsafe_code)]

use crate::error::{last_os_error, Error, Result};
use crate::gid::Gid;
use crate::pd::ProtectionDomain;
use crate::qp::Endpoint;
use crate::result::record_drop_failure;
use crate::sys::{ibv_ah, ibv_ah_attr, ibv_gid, ibv_global_route};
use std::sync::Arc;

pub(crate) struct AhInner {
    pub(crate) pd: ProtectionDomain,
    ah: *mut ibv_ah,
}

// SAFETY: address handles are immutable verbs objects, usable from any thread.
unsafe impl Send for AhInner {}
// SAFETY: as above.
unsafe impl Sync for AhInner {}

impl Drop for AhInner {
    fn drop(&mut self) {
        // SAFETY: in-flight UD sends hold a clone of the handle, so none uses it now.
        let rc = unsafe { (self.pd.inner.ctx.inner.v.destroy_ah)(self.ah) };
        if rc != 0 {
            record_drop_failure("ibv_destroy_ah", rc);
        }
    }
}

/// Where a UD datagram goes: the path to a remote port. Cheap to clone; work requests
/// using it keep it alive until they complete.
#[derive(Clone)]
pub struct AddressHandle {
    pub(crate) inner: Arc<AhInner>,
}

impl std::fmt::Debug for AddressHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AddressHandle").finish_non_exhaustive()
    }
}

impl AddressHandle {
    pub(crate) fn as_ptr(&self) -> *mut ibv_ah {
        self.inner.ah
    }
}

/// The attributes of an address handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AhAttr {
    /// Destination LID (0 on RoCE).
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Local port (from 1).
    pub port: u8,
    /// Global route (GRH): required on RoCE; `None` for LID-only InfiniBand.
    pub grh: Option<GlobalRoute>,
}

/// The GRH fields of an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalRoute {
    /// Destination GID.
    pub dgid: Gid,
    /// Local GID index to send from.
    pub sgid_index: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
    /// Flow label.
    pub flow_label: u32,
}

impl AhAttr {
    /// The address of `remote`'s port, sent from local `port` / `sgid_index` (a GRH is used
    /// whenever the remote GID is non-zero).
    pub fn to_endpoint(remote: &Endpoint, port: u8, sgid_index: u8) -> Self {
        AhAttr {
            dlid: remote.lid,
            sl: 0,
            port,
            grh: (!remote.gid.is_zero()).then_some(GlobalRoute {
                dgid: remote.gid,
                sgid_index,
                hop_limit: 64,
                traffic_class: 0,
                flow_label: 0,
            }),
        }
    }

    pub(crate) fn to_raw(self) -> ibv_ah_attr {
        let mut a = ibv_ah_attr {
            dlid: self.dlid,
            sl: self.sl,
            port_num: self.port,
            ..Default::default()
        };
        if let Some(g) = self.grh {
            a.is_global = 1;
            a.grh = ibv_global_route {
                dgid: ibv_gid { raw: g.dgid.0 },
                flow_label: g.flow_label,
                sgid_index: g.sgid_index,
                hop_limit: g.hop_limit,
                traffic_class: g.traffic_class,
            };
        }
        a
    }
}

impl ProtectionDomain {
    /// Creates an address handle.
    ///
    /// # Errors
    /// [`Error::CreateAh`] (e.g. an unknown GID index or unreachable destination).
    pub fn create_ah(&self, attr: &AhAttr) -> Result<AddressHandle> {
        let mut a = attr.to_raw();
        // SAFETY: the PD is live; `a` is a valid attribute struct.
        let ah = unsafe { (self.inner.ctx.inner.v.create_ah)(self.inner.pd, &mut a) };
        if ah.is_null() {
            return Err(Error::CreateAh(last_os_error()));
        }
        Ok(AddressHandle {
            inner: Arc::new(AhInner {
                pd: self.clone(),
                ah,
            }),
        })
    }
}
