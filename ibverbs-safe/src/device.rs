//! Device discovery: which RDMA devices exist, and opening one.
#![allow(unsafe_code)]

use crate::context::Context;
use crate::error::{last_os_error, Error, Result};
use crate::loader::{verbs, Verbs};
use crate::sys::ibv_device;
use std::ffi::{c_int, CStr};

/// One RDMA device as listed by `ibv_get_device_list`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel device name (`rxe0`, `mlx5_0`, ...).
    pub name: String,
    /// Node GUID (host byte order).
    pub guid: u64,
}

/// The device list, freed on drop.
struct DeviceList {
    v: &'static Verbs,
    list: *mut *mut ibv_device,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<Self> {
        let v = verbs()?;
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer.
        let list = unsafe { (v.get_device_list)(&mut n) };
        if list.is_null() {
            let e = last_os_error();
            // ENOSYS: no kernel support for RDMA at all; that is "no device", not a failure.
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOSYS) | Some(libc::ENOENT) | None | Some(0)
            ) {
                return Ok(Self { v, list, len: 0 });
            }
            return Err(Error::GetDeviceList(e));
        }
        Ok(Self {
            v,
            list,
            len: n.max(0) as usize,
        })
    }

    fn devices(&self) -> impl Iterator<Item = *mut ibv_device> + '_ {
        // SAFETY: `list` holds `len` valid device pointers until freed in Drop.
        (0..self.len).map(move |i| unsafe { *self.list.add(i) })
    }

    fn info(&self, d: *mut ibv_device) -> DeviceInfo {
        // SAFETY: `d` comes from the live list; the name is a NUL-terminated string inside it.
        let name = unsafe {
            let p = (self.v.get_device_name)(d);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        // SAFETY: `d` comes from the live list.
        let guid = u64::from_be(unsafe { (self.v.get_device_guid)(d) });
        DeviceInfo { name, guid }
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        if !self.list.is_null() {
            // SAFETY: `list` came from ibv_get_device_list and is freed exactly once. Devices
            // opened from it stay valid (libibverbs refcounts them).
            unsafe { (self.v.free_device_list)(self.list) };
        }
    }
}

/// Lists the RDMA devices of this machine.
///
/// # Errors
/// [`Error::LibraryUnavailable`] without libibverbs; [`Error::GetDeviceList`] if listing
/// fails. No devices is an empty list, not an error.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    let list = DeviceList::get()?;
    Ok(list.devices().map(|d| list.info(d)).collect())
}

/// Opens the device called `name`, or the first device when `name` is `None`.
///
/// # Errors
/// [`Error::LibraryUnavailable`], [`Error::NoDevice`] (none present, or none with that
/// name; the message lists those present), [`Error::OpenDevice`].
pub fn open(name: Option<&str>) -> Result<Context> {
    let list = DeviceList::get()?;
    let found = list
        .devices()
        .find(|&d| name.is_none_or(|n| list.info(d).name == n));
    let Some(dev) = found else {
        return Err(Error::NoDevice {
            name: name.map(str::to_owned),
            available: list.devices().map(|d| list.info(d).name).collect(),
        });
    };
    let info = list.info(dev);
    // SAFETY: `dev` is a live entry of the device list.
    let ctx = unsafe { (list.v.open_device)(dev) };
    if ctx.is_null() {
        return Err(Error::OpenDevice {
            device: info.name,
            source: last_os_error(),
        });
    }
    Ok(Context::from_raw(list.v, ctx, info))
}
