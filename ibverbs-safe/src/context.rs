//! An open device (`ibv_context`) and the queries on it.
#![allow(unsafe_code)]

use crate::cq::{CompletionChannel, CompletionQueue};
use crate::device::DeviceInfo;
use crate::error::{rc_error, Error, Result};
use crate::gid::{Gid, GidEntry, GidType};
use crate::loader::Verbs;
use crate::pd::ProtectionDomain;
use crate::port::PortAttr;
use crate::result::record_drop_failure;
use crate::sys::*;
use std::ffi::CStr;
use std::sync::Arc;

pub(crate) struct ContextInner {
    pub(crate) v: &'static Verbs,
    pub(crate) ctx: *mut ibv_context,
    pub(crate) info: DeviceInfo,
}

// SAFETY: libibverbs contexts may be used from any thread (verbs are thread-safe).
unsafe impl Send for ContextInner {}
// SAFETY: as above; we never mutate through `&ContextInner` except via thread-safe verbs.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: every child (PD, CQ, channel) holds an Arc to us, so none is alive now;
        // `ctx` came from ibv_open_device and is closed exactly once.
        let rc = unsafe { (self.v.close_device)(self.ctx) };
        if rc != 0 {
            record_drop_failure("ibv_close_device", rc);
        }
    }
}

/// An open RDMA device. Cheap to clone (reference counted); closed when the last clone and
/// every object created from it are gone.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.inner.info.name)
            .finish()
    }
}

/// Device capabilities (`struct ibv_device_attr`, the commonly used part).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceAttr {
    /// Firmware version string.
    pub fw_ver: String,
    /// Node GUID (host byte order).
    pub node_guid: u64,
    /// Vendor id.
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Largest registrable region.
    pub max_mr_size: u64,
    /// Max QPs.
    pub max_qp: u32,
    /// Max outstanding WRs per queue.
    pub max_qp_wr: u32,
    /// Max SGEs per WR.
    pub max_sge: u32,
    /// Max CQ entries.
    pub max_cqe: u32,
    /// Max memory regions.
    pub max_mr: u32,
    /// Max outstanding RDMA READ/atomic per QP as responder.
    pub max_qp_rd_atom: u32,
    /// Max outstanding RDMA READ/atomic per QP as initiator.
    pub max_qp_init_rd_atom: u32,
    /// Atomic support (`enum ibv_atomic_cap`: 0 none, 1 HCA, 2 global).
    pub atomic_cap: u32,
    /// Max SRQs.
    pub max_srq: u32,
    /// Max WRs per SRQ.
    pub max_srq_wr: u32,
    /// Max SGEs per SRQ WR.
    pub max_srq_sge: u32,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
}

impl Context {
    pub(crate) fn from_raw(v: &'static Verbs, ctx: *mut ibv_context, info: DeviceInfo) -> Self {
        Context {
            inner: Arc::new(ContextInner { v, ctx, info }),
        }
    }

    /// Opens the device called `name`, or the first one. Same as [`crate::open`].
    ///
    /// # Errors
    /// See [`crate::open`].
    pub fn open(name: Option<&str>) -> Result<Self> {
        crate::device::open(name)
    }

    /// The device's name and GUID.
    pub fn device(&self) -> &DeviceInfo {
        &self.inner.info
    }

    /// Number of completion vectors.
    pub fn num_comp_vectors(&self) -> u32 {
        // SAFETY: `ctx` is live for as long as `self`.
        unsafe { (*self.inner.ctx).num_comp_vectors.max(0) as u32 }
    }

    /// `ibv_query_device`.
    ///
    /// # Errors
    /// [`Error::QueryDevice`].
    pub fn query_device(&self) -> Result<DeviceAttr> {
        // SAFETY: all-zero is a valid `ibv_device_attr` (plain integers and chars).
        let mut a: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is live and `a` is a valid out-struct.
        let rc = unsafe { (self.inner.v.query_device)(self.inner.ctx, &mut a) };
        if rc != 0 {
            return Err(Error::QueryDevice(rc_error(rc)));
        }
        let fw: Vec<u8> = a.fw_ver.iter().map(|&c| c as u8).collect();
        let fw_ver = CStr::from_bytes_until_nul(&fw)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default();
        let u = |x: i32| x.max(0) as u32;
        Ok(DeviceAttr {
            fw_ver,
            node_guid: u64::from_be(a.node_guid),
            vendor_id: a.vendor_id,
            vendor_part_id: a.vendor_part_id,
            max_mr_size: a.max_mr_size,
            max_qp: u(a.max_qp),
            max_qp_wr: u(a.max_qp_wr),
            max_sge: u(a.max_sge),
            max_cqe: u(a.max_cqe),
            max_mr: u(a.max_mr),
            max_qp_rd_atom: u(a.max_qp_rd_atom),
            max_qp_init_rd_atom: u(a.max_qp_init_rd_atom),
            atomic_cap: u(a.atomic_cap),
            max_srq: u(a.max_srq),
            max_srq_wr: u(a.max_srq_wr),
            max_srq_sge: u(a.max_srq_sge),
            phys_port_cnt: a.phys_port_cnt,
        })
    }

    /// `ibv_query_port` (ports are numbered from 1).
    ///
    /// # Errors
    /// [`Error::QueryPort`] (e.g. `EINVAL` for a port that does not exist).
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let mut a = ibv_port_attr::default();
        // SAFETY: `ctx` is live; `a` is a zeroed full-size struct, of which the exported
        // (compat) ibv_query_port fills the leading part.
        let rc = unsafe { (self.inner.v.query_port)(self.inner.ctx, port, &mut a) };
        if rc != 0 {
            return Err(Error::QueryPort {
                port,
                source: rc_error(rc),
            });
        }
        Ok(PortAttr::from_raw(&a))
    }

    /// `ibv_query_gid`: the GID at `index` of `port`'s table.
    ///
    /// # Errors
    /// [`Error::QueryGid`].
    pub fn query_gid(&self, port: u8, index: u32) -> Result<Gid> {
        let mut g = ibv_gid::default();
        // SAFETY: `ctx` is live; `g` is a valid out-struct.
        let rc = unsafe { (self.inner.v.query_gid)(self.inner.ctx, port, index as i32, &mut g) };
        if rc != 0 {
            return Err(Error::QueryGid {
                port,
                index,
                source: rc_error(rc),
            });
        }
        Ok(Gid(g.raw))
    }

    /// The GID at `index` with its type (RoCE v1/v2, IB) where the library reports it.
    ///
    /// # Errors
    /// [`Error::QueryGid`] (`ENODATA` for an empty slot on recent libraries).
    pub fn gid_entry(&self, port: u8, index: u32) -> Result<GidEntry> {
        if let Some(f) = self.inner.v.query_gid_ex {
            // SAFETY: all-zero is a valid `ibv_gid_entry`.
            let mut e: ibv_gid_entry = unsafe { std::mem::zeroed() };
            // SAFETY: `ctx` is live; `e` is a valid out-struct of the size we pass.
            let rc = unsafe {
                f(
                    self.inner.ctx,
                    port as u32,
                    index,
                    &mut e,
                    0,
                    std::mem::size_of::<ibv_gid_entry>(),
                )
            };
            if rc != 0 {
                return Err(Error::QueryGid {
                    port,
                    index,
                    source: rc_error(rc),
                });
            }
            return Ok(GidEntry {
                gid: Gid(e.gid.raw),
                index,
                port,
                gid_type: GidType::from_raw(e.gid_type),
            });
        }
        Ok(GidEntry {
            gid: self.query_gid(port, index)?,
            index,
            port,
            gid_type: None,
        })
    }

    /// Every populated (non-zero) entry of `port`'s GID table.
    ///
    /// # Errors
    /// [`Error::QueryPort`] if the port does not exist.
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        let len = self.query_port(port)?.gid_table_len;
        Ok((0..len)
            .filter_map(|i| self.gid_entry(port, i).ok())
            .filter(|e| !e.gid.is_zero())
            .collect())
    }

    /// Allocates a protection domain.
    ///
    /// # Errors
    /// [`Error::AllocPd`].
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        ProtectionDomain::new(self)
    }

    /// Creates a completion queue with at least `cqe` entries.
    ///
    /// # Errors
    /// [`Error::CreateCq`].
    pub fn create_cq(&self, cqe: u32) -> Result<CompletionQueue> {
        CompletionQueue::new(self, cqe, None)
    }

    /// Creates a completion queue whose events are delivered to `channel`.
    ///
    /// # Errors
    /// [`Error::CreateCq`].
    pub fn create_cq_with_channel(
        &self,
        cqe: u32,
        channel: &CompletionChannel,
    ) -> Result<CompletionQueue> {
        CompletionQueue::new(self, cqe, Some(channel))
    }

    /// Creates a completion channel (a file descriptor that becomes readable when a CQ
    /// armed with [`CompletionQueue::req_notify`] gets a completion).
    ///
    /// # Errors
    /// [`Error::CreateCompChannel`].
    pub fn create_comp_channel(&self) -> Result<CompletionChannel> {
        CompletionChannel::new(self)
    }
}
