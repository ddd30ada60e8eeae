//! Run-time loading of `librdmacm.so.1`, the same way `crate::loader` loads libibverbs:
//! `dlopen` once, resolve every entry point by its versioned symbol (`dlvsym`), keep the
//! library loaded for the life of the process and hand out a `&'static` table.
#![allow(unsafe_code)]

use crate::error::{Error, Result};
use crate::loader::{fn_ptr, Library};
use crate::sys::cm::*;
use crate::sys::ibv_qp_attr;
use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

/// The library soname we open.
pub(crate) const LIBRARY: &str = "librdmacm.so.1";

/// What to install when the library is missing (named in `Error::LibraryUnavailable`).
pub(crate) const INSTALL_HINT: &str = "install the RDMA connection manager library: \
     `apt-get install librdmacm1` (Debian/Ubuntu) or `dnf install librdmacm` (RHEL/Fedora)";

/// Entry points of librdmacm used by the `cm` module.
#[allow(missing_debug_implementations)]
pub(crate) struct CmLib {
    pub create_event_channel: unsafe extern "C" fn() -> *mut rdma_event_channel,
    pub destroy_event_channel: unsafe extern "C" fn(*mut rdma_event_channel),
    pub create_id: unsafe extern "C" fn(
        *mut rdma_event_channel,
        *mut *mut rdma_cm_id,
        *mut c_void,
        u32,
    ) -> c_int,
    pub destroy_id: unsafe extern "C" fn(*mut rdma_cm_id) -> c_int,
    pub bind_addr: unsafe extern "C" fn(*mut rdma_cm_id, *mut libc::sockaddr) -> c_int,
    pub resolve_addr: unsafe extern "C" fn(
        *mut rdma_cm_id,
        *mut libc::sockaddr,
        *mut libc::sockaddr,
        c_int,
    ) -> c_int,
    pub resolve_route: unsafe extern "C" fn(*mut rdma_cm_id, c_int) -> c_int,
    pub init_qp_attr: unsafe extern "C" fn(*mut rdma_cm_id, *mut ibv_qp_attr, *mut c_int) -> c_int,
    pub connect: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_conn_param) -> c_int,
    pub establish: unsafe extern "C" fn(*mut rdma_cm_id) -> c_int,
    pub listen: unsafe extern "C" fn(*mut rdma_cm_id, c_int) -> c_int,
    pub accept: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_conn_param) -> c_int,
    pub reject: unsafe extern "C" fn(*mut rdma_cm_id, *const c_void, u8) -> c_int,
    pub disconnect: unsafe extern "C" fn(*mut rdma_cm_id) -> c_int,
    pub get_cm_event:
        unsafe extern "C" fn(*mut rdma_event_channel, *mut *mut rdma_cm_event) -> c_int,
    pub ack_cm_event: unsafe extern "C" fn(*mut rdma_cm_event) -> c_int,
    pub migrate_id: unsafe extern "C" fn(*mut rdma_cm_id, *mut rdma_event_channel) -> c_int,
}

macro_rules! resolve {
    ($h:expr, $name:literal, $ver:literal) => {{
        let p = $h.sym($name, $ver)?;
        // SAFETY: `p` is the non-null address of the librdmacm function `$name`, whose C
        // prototype (rdma_cma.h) matches the field's fn-pointer type.
        unsafe { fn_ptr(p) }
    }};
}

impl CmLib {
    /// Opens `library` and resolves every entry point.
    pub(crate) fn load_from(library: &str) -> std::result::Result<Self, String> {
        // Exactly `name@version` (librdmacm has versioned every symbol since its first
        // release). The library is never closed: the table below is `'static`.
        let h = Library::open(library)?;
        Ok(CmLib {
            create_event_channel: resolve!(h, "rdma_create_event_channel", "RDMACM_1.0"),
            destroy_event_channel: resolve!(h, "rdma_destroy_event_channel", "RDMACM_1.0"),
            create_id: resolve!(h, "rdma_create_id", "RDMACM_1.0"),
            destroy_id: resolve!(h, "rdma_destroy_id", "RDMACM_1.0"),
            bind_addr: resolve!(h, "rdma_bind_addr", "RDMACM_1.0"),
            resolve_addr: resolve!(h, "rdma_resolve_addr", "RDMACM_1.0"),
            resolve_route: resolve!(h, "rdma_resolve_route", "RDMACM_1.0"),
            init_qp_attr: resolve!(h, "rdma_init_qp_attr", "RDMACM_1.2"),
            connect: resolve!(h, "rdma_connect", "RDMACM_1.0"),
            establish: resolve!(h, "rdma_establish", "RDMACM_1.2"),
            listen: resolve!(h, "rdma_listen", "RDMACM_1.0"),
            accept: resolve!(h, "rdma_accept", "RDMACM_1.0"),
            reject: resolve!(h, "rdma_reject", "RDMACM_1.0"),
            disconnect: resolve!(h, "rdma_disconnect", "RDMACM_1.0"),
            get_cm_event: resolve!(h, "rdma_get_cm_event", "RDMACM_1.0"),
            ack_cm_event: resolve!(h, "rdma_ack_cm_event", "RDMACM_1.0"),
            migrate_id: resolve!(h, "rdma_migrate_id", "RDMACM_1.0"),
        })
    }
}

// SAFETY: the table holds only plain function pointers into a library never unloaded.
unsafe impl Send for CmLib {}
// SAFETY: as above; immutable after loading.
unsafe impl Sync for CmLib {}

static CM: OnceLock<std::result::Result<CmLib, String>> = OnceLock::new();

/// The process-wide librdmacm table, loaded on first use.
///
/// # Errors
/// [`Error::LibraryUnavailable`] naming `librdmacm.so.1` and the package to install.
pub(crate) fn cm() -> Result<&'static CmLib> {
    match CM.get_or_init(|| CmLib::load_from(LIBRARY)) {
        Ok(v) => Ok(v),
        Err(reason) => Err(unavailable(reason.clone())),
    }
}

pub(crate) fn unavailable(reason: String) -> Error {
    Error::LibraryUnavailable {
        library: LIBRARY,
        reason,
        hint: INSTALL_HINT,
    }
}

/// Whether librdmacm could be loaded in this process.
pub fn cm_library_available() -> bool {
    cm().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_a_typed_error_naming_the_package() {
        let Err(reason) = CmLib::load_from("librdmacm-does-not-exist.so.1") else {
            panic!("a library that does not exist loaded");
        };
        let msg = unavailable(reason).to_string();
        assert!(msg.contains("librdmacm.so.1"), "{msg}");
        assert!(msg.contains("librdmacm1"), "{msg}");
        assert!(msg.contains("librdmacm-does-not-exist"), "{msg}");
    }

    #[test]
    fn loads_versioned_symbols_where_installed() {
        match CmLib::load_from(LIBRARY) {
            // every entry point resolved by its versioned symbol
            Ok(lib) => assert!(lib.get_cm_event as usize != 0),
            Err(e) => skip!("librdmacm", "{LIBRARY} not installed ({e})"),
        }
    }
}
