//! Streams and asynchronous device-to-device copies (within a context, between contexts
//! on one GPU, and between GPUs over peer access), each completed through a CUDA event.
#![allow(unsafe_code)]

use std::fmt;
use std::sync::Arc;

use cudarc::driver::{sys, CudaEvent, CudaStream};

use crate::driver::{check, cudarc_error, keeping_current, CurrentContext, Device};
use crate::error::{Error, Result};
use crate::memory::{range_ptr, DeviceMemory};
use crate::peer;

/// A non-blocking CUDA stream in one context.
#[derive(Clone)]
pub struct Stream {
    device: Device,
    /// `Some` until drop (taken there so cudarc's destroy runs under a context guard).
    inner: Option<Arc<CudaStream>>,
}

impl Drop for Stream {
    fn drop(&mut self) {
        // cudarc binds the stream's context to destroy it; put the caller's back afterwards.
        let _saved = CurrentContext::save();
        drop(self.inner.take());
    }
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("device", &self.device.ordinal())
            .finish()
    }
}

impl Stream {
    pub(crate) fn new(device: &Device) -> Result<Self> {
        let inner = keeping_current(|| {
            device
                .context()
                .new_stream()
                .map_err(|e| cudarc_error("cuStreamCreate", e))
        })?;
        Ok(Stream {
            device: device.clone(),
            inner: Some(inner),
        })
    }

    /// The device (context) the stream belongs to.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The cudarc stream, for cudarc interop (timing events, kernels).
    pub fn as_cudarc(&self) -> &Arc<CudaStream> {
        self.inner.as_ref().expect("present until drop")
    }

    /// The raw `CUstream`.
    pub fn cu_stream(&self) -> sys::CUstream {
        self.as_cudarc().cu_stream()
    }

    /// Blocks until all work queued on the stream has finished.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn synchronize(&self) -> Result<()> {
        keeping_current(|| {
            self.as_cudarc()
                .synchronize()
                .map_err(|e| cudarc_error("cuStreamSynchronize", e))
        })
    }

    /// Makes later work on this stream wait for the last record of `event` (a live event
    /// owned by the caller).
    pub(crate) fn wait_raw_event(&self, event: sys::CUevent) -> Result<()> {
        let _ctx = self.device.bind()?;
        // SAFETY: `event` is a live event handle (callers pass one they own), the stream is
        // live for the call.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.cu_stream(), event, 0)
        })
    }

    /// Records a fresh completion event on the stream.
    ///
    /// # Errors
    /// [`Error::Driver`].
    pub fn record(&self) -> Result<CudaEvent> {
        keeping_current(|| {
            let event = self
                .device
                .context()
                .new_event(None)
                .map_err(|e| cudarc_error("cuEventCreate", e))?;
            event
                .record(self.as_cudarc())
                .map_err(|e| cudarc_error("cuEventRecord", e))?;
            Ok(event)
        })
    }
}

/// An asynchronous copy in flight. It owns its source and destination until the copy's
/// event completes, so they cannot be freed under the GPU; dropping it waits for the copy,
/// and forgetting it only leaks the two `Arc`s.
#[must_use = "dropping a PendingCopy waits for the copy; call wait() to see its errors"]
pub struct PendingCopy {
    event: Option<CudaEvent>,
    _src: Arc<dyn DeviceMemory>,
    _dst: Arc<dyn DeviceMemory>,
}

impl fmt::Debug for PendingCopy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingCopy").finish_non_exhaustive()
    }
}

impl PendingCopy {
    /// The completion event (e.g. to make another stream wait on it).
    pub fn event(&self) -> &CudaEvent {
        self.event.as_ref().expect("present until drop")
    }

    /// Whether the copy has finished.
    ///
    /// # Errors
    /// [`Error::Driver`] if the copy failed.
    pub fn is_complete(&self) -> Result<bool> {
        keeping_current(|| {
            self.event()
                .try_is_complete()
                .map_err(|e| cudarc_error("cuEventQuery", e))
        })
    }

    /// Blocks until the copy has finished and hands the buffers back to their owners.
    ///
    /// # Errors
    /// [`Error::Driver`] if the copy failed.
    pub fn wait(mut self) -> Result<()> {
        let event = self.event.take().expect("present until drop");
        keeping_current(|| {
            let r = event
                .synchronize()
                .map_err(|e| cudarc_error("cuEventSynchronize", e));
            drop(event);
            r
        })
    }
}

impl Drop for PendingCopy {
    fn drop(&mut self) {
        if let Some(event) = self.event.take() {
            let _saved = CurrentContext::save();
            // Keep src/dst alive until the GPU is done with them.
            let _ = event.synchronize();
            drop(event);
        }
    }
}

/// Queues a copy of `len` bytes from `src[src_offset..]` to `dst[dst_offset..]` on `stream`.
///
/// - same context: `cuMemcpyDtoDAsync`;
/// - two contexts on the same GPU: `cuMemcpyPeerAsync` (stays on the GPU);
/// - two GPUs: `cuMemcpyPeerAsync` **only** while a [`PeerAccess`](crate::PeerAccess) guard
///   for the pair is held — otherwise the driver would silently stage through host memory,
///   so this refuses with [`Error::PeerAccessNotEnabled`].
///
/// The stream must belong to the source's or the destination's context.
///
/// # Errors
/// [`Error::OutOfBounds`], [`Error::ContextMismatch`], [`Error::PeerAccessNotEnabled`],
/// [`Error::Driver`].
pub fn copy_async<D, S>(
    stream: &Stream,
    dst: &Arc<D>,
    dst_offset: usize,
    src: &Arc<S>,
    src_offset: usize,
    len: usize,
) -> Result<PendingCopy>
where
    D: DeviceMemory + 'static,
    S: DeviceMemory + 'static,
{
    let dptr = range_ptr(&**dst, dst_offset, len)?;
    let sptr = range_ptr(&**src, src_offset, len)?;
    let (ddev, sdev) = (dst.device(), src.device());
    if !stream.device().same_context(ddev) && !stream.device().same_context(sdev) {
        return Err(Error::ContextMismatch(
            "the stream must belong to the source's or the destination's context".into(),
        ));
    }
    let _ctx = stream.device().bind()?;
    if ddev.same_context(sdev) {
        // SAFETY: both ranges are in bounds of live allocations, which the returned
        // PendingCopy keeps alive until the copy's event completes; the stream is live.
        check("cuMemcpyDtoDAsync_v2", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dptr, sptr, len, stream.cu_stream())
        })?;
    } else {
        if !ddev.same_gpu(sdev) && !peer::enabled_between(ddev, sdev) {
            return Err(Error::PeerAccessNotEnabled {
                src: sdev.ordinal(),
                dst: ddev.ordinal(),
            });
        }
        // SAFETY: as above; the contexts are live (held by src/dst).
        check("cuMemcpyPeerAsync", unsafe {
            sys::cuMemcpyPeerAsync(
                dptr,
                ddev.context().cu_ctx(),
                sptr,
                sdev.context().cu_ctx(),
                len,
                stream.cu_stream(),
            )
        })?;
    }
    let event = stream.record()?;
    Ok(PendingCopy {
        event: Some(event),
        _src: src.clone(),
        _dst: dst.clone(),
    })
}

/// [`copy_async`] on a fresh stream of the destination's context, then waits.
///
/// # Errors
/// As [`copy_async`].
pub fn copy<D, S>(
    dst: &Arc<D>,
    dst_offset: usize,
    src: &Arc<S>,
    src_offset: usize,
    len: usize,
) -> Result<()>
where
    D: DeviceMemory + 'static,
    S: DeviceMemory + 'static,
{
    let stream = dst.device().new_stream()?;
    copy_async(&stream, dst, dst_offset, src, src_offset, len)?.wait()
}
