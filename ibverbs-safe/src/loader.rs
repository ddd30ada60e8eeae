//! Run-time loading of `libibverbs.so.1`: `dlopen` once, resolve every entry point by its
//! versioned symbol with `dlvsym` (as NCCL does), and hand out a `&'static` table.
#![allow(unsafe_code)]

use crate::error::{Error, Result};
use crate::sys::*;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

/// The library soname we open.
pub(crate) const LIBRARY: &str = "libibverbs.so.1";

/// What to install when the library is missing (named in `Error::LibraryUnavailable`).
pub(crate) const INSTALL_HINT: &str = "install libibverbs and a provider: \
     `apt-get install libibverbs1 ibverbs-providers` (Debian/Ubuntu) or \
     `dnf install libibverbs rdma-core` (RHEL/Fedora)";

/// Entry points of libibverbs used by this crate (the `static inline` data-path verbs are
/// not here: they go through each context's `ibv_context_ops`, exactly as `verbs.h` does).
#[allow(missing_debug_implementations)]
pub(crate) struct Verbs {
    pub get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    pub free_device_list: unsafe extern "C" fn(*mut *mut ibv_device),
    pub get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
    pub get_device_guid: unsafe extern "C" fn(*mut ibv_device) -> u64,
    pub open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    pub close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int,
    pub query_device: unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int,
    pub query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int,
    pub query_gid: unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int,
    /// `_ibv_query_gid_ex` (IBVERBS_1.11): GID type; absent on old libraries.
    pub query_gid_ex: Option<
        unsafe extern "C" fn(*mut ibv_context, u32, u32, *mut ibv_gid_entry, u32, usize) -> c_int,
    >,
    pub alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    pub dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    pub reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    pub dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    /// `ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)` (IBVERBS_1.12, rdma-core
    /// 34+): DMA-BUF registration; absent on older libraries.
    pub reg_dmabuf_mr: Option<RegDmabufMrFn>,
    pub create_comp_channel: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel,
    pub destroy_comp_channel: unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
    pub create_cq: unsafe extern "C" fn(
        *mut ibv_context,
        c_int,
        *mut c_void,
        *mut ibv_comp_channel,
        c_int,
    ) -> *mut ibv_cq,
    pub destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    pub get_cq_event:
        unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int,
    pub ack_cq_events: unsafe extern "C" fn(*mut ibv_cq, u32),
    pub create_qp: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
    pub modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    pub query_qp:
        unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int, *mut ibv_qp_init_attr) -> c_int,
    pub destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int,
    pub create_srq: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_srq_init_attr) -> *mut ibv_srq,
    pub destroy_srq: unsafe extern "C" fn(*mut ibv_srq) -> c_int,
    pub create_ah: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_ah_attr) -> *mut ibv_ah,
    pub destroy_ah: unsafe extern "C" fn(*mut ibv_ah) -> c_int,
}

/// The prototype of `ibv_reg_dmabuf_mr`.
pub(crate) type RegDmabufMrFn =
    unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr;

/// Symbol version that introduced `ibv_reg_dmabuf_mr`.
pub(crate) const REG_DMABUF_MR_VERSION: &str = "IBVERBS_1.12";

/// A `dlopen`ed library that is never closed (no Drop), so the function pointers resolved
/// from it stay valid for the life of the process. Shared by the libibverbs table and the
/// librdmacm table (`cm::loader`).
pub(crate) struct Library {
    handle: *mut c_void,
}

impl Library {
    pub(crate) fn open(name: &str) -> std::result::Result<Self, String> {
        let cname = std::ffi::CString::new(name).map_err(|e| e.to_string())?;
        // SAFETY: `cname` is a valid NUL-terminated string; dlopen has no other preconditions.
        let handle = unsafe { libc::dlopen(cname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(dlerror_string());
        }
        Ok(Self { handle })
    }

    /// Resolves exactly `name@version`, `None` when absent.
    fn vsym(&self, name: &str, version: &str) -> Option<*mut c_void> {
        self.sym(name, version).ok()
    }

    /// Resolves exactly `name@version`, never another version of `name`: a versioned
    /// library that lacks this version does not provide this ABI, and binding its default
    /// `name` would call a function of another prototype. A library built without any
    /// symbol versions still resolves (the dynamic linker accepts unversioned definitions
    /// for a versioned lookup in an object that has no version information); that is the
    /// only "fallback" there is, and it is the linker's.
    pub(crate) fn sym(
        &self,
        name: &str,
        version: &str,
    ) -> std::result::Result<*mut c_void, String> {
        let n = std::ffi::CString::new(name).map_err(|e| e.to_string())?;
        let v = std::ffi::CString::new(version).map_err(|e| e.to_string())?;
        // SAFETY: the handle came from a successful dlopen and both strings are NUL-terminated.
        let p = unsafe { libc::dlvsym(self.handle, n.as_ptr(), v.as_ptr()) };
        if p.is_null() {
            Err(format!(
                "symbol {name}@{version} not found: {}",
                dlerror_string()
            ))
        } else {
            Ok(p)
        }
    }
}

fn dlerror_string() -> String {
    // SAFETY: dlerror returns either NULL or a valid C string owned by libc.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null, NUL-terminated (see above); copied before any other dl* call.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// Reinterprets a symbol address as a function pointer.
///
/// # Safety
/// `F` must be a function-pointer type matching the C prototype of the symbol at `p`.
pub(crate) unsafe fn fn_ptr<F: Copy>(p: *mut c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: same size (checked); the caller guarantees the type matches the symbol.
    unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) }
}

macro_rules! resolve {
    ($lib:expr, $name:literal, $ver:literal) => {{
        let p = $lib.sym($name, $ver)?;
        // SAFETY: `p` is the non-null address of the libibverbs function `$name` whose C
        // prototype (verbs.h) matches the field's fn-pointer type.
        unsafe { fn_ptr(p) }
    }};
}

impl Verbs {
    /// Opens `library` and resolves every entry point.
    pub(crate) fn load_from(library: &str) -> std::result::Result<Self, String> {
        let lib = Library::open(library)?;
        let query_gid_ex = lib.sym("_ibv_query_gid_ex", "IBVERBS_1.11").ok().map(|p| {
            // SAFETY: `_ibv_query_gid_ex(ctx, port, index, entry, flags, entry_size)` has this
            // prototype in verbs.h (IBVERBS_1.11).
            unsafe {
                fn_ptr::<
                    unsafe extern "C" fn(
                        *mut ibv_context,
                        u32,
                        u32,
                        *mut ibv_gid_entry,
                        u32,
                        usize,
                    ) -> c_int,
                >(p)
            }
        });
        // Only the exact versioned symbol (as every entry point).
        let reg_dmabuf_mr = lib
            .vsym("ibv_reg_dmabuf_mr", REG_DMABUF_MR_VERSION)
            .map(|p| {
                // SAFETY: `ibv_reg_dmabuf_mr(pd, offset, length, iova, fd, access)` has this
                // prototype in verbs.h (IBVERBS_1.12).
                unsafe { fn_ptr::<RegDmabufMrFn>(p) }
            });
        let v = Verbs {
            get_device_list: resolve!(lib, "ibv_get_device_list", "IBVERBS_1.1"),
            free_device_list: resolve!(lib, "ibv_free_device_list", "IBVERBS_1.1"),
            get_device_name: resolve!(lib, "ibv_get_device_name", "IBVERBS_1.1"),
            get_device_guid: resolve!(lib, "ibv_get_device_guid", "IBVERBS_1.1"),
            open_device: resolve!(lib, "ibv_open_device", "IBVERBS_1.1"),
            close_device: resolve!(lib, "ibv_close_device", "IBVERBS_1.1"),
            query_device: resolve!(lib, "ibv_query_device", "IBVERBS_1.1"),
            query_port: resolve!(lib, "ibv_query_port", "IBVERBS_1.1"),
            query_gid: resolve!(lib, "ibv_query_gid", "IBVERBS_1.1"),
            query_gid_ex,
            alloc_pd: resolve!(lib, "ibv_alloc_pd", "IBVERBS_1.1"),
            dealloc_pd: resolve!(lib, "ibv_dealloc_pd", "IBVERBS_1.1"),
            reg_mr: resolve!(lib, "ibv_reg_mr", "IBVERBS_1.1"),
            dereg_mr: resolve!(lib, "ibv_dereg_mr", "IBVERBS_1.1"),
            reg_dmabuf_mr,
            create_comp_channel: resolve!(lib, "ibv_create_comp_channel", "IBVERBS_1.0"),
            destroy_comp_channel: resolve!(lib, "ibv_destroy_comp_channel", "IBVERBS_1.0"),
            create_cq: resolve!(lib, "ibv_create_cq", "IBVERBS_1.1"),
            destroy_cq: resolve!(lib, "ibv_destroy_cq", "IBVERBS_1.1"),
            get_cq_event: resolve!(lib, "ibv_get_cq_event", "IBVERBS_1.1"),
            ack_cq_events: resolve!(lib, "ibv_ack_cq_events", "IBVERBS_1.1"),
            create_qp: resolve!(lib, "ibv_create_qp", "IBVERBS_1.1"),
            modify_qp: resolve!(lib, "ibv_modify_qp", "IBVERBS_1.1"),
            query_qp: resolve!(lib, "ibv_query_qp", "IBVERBS_1.1"),
            destroy_qp: resolve!(lib, "ibv_destroy_qp", "IBVERBS_1.1"),
            create_srq: resolve!(lib, "ibv_create_srq", "IBVERBS_1.1"),
            destroy_srq: resolve!(lib, "ibv_destroy_srq", "IBVERBS_1.1"),
            create_ah: resolve!(lib, "ibv_create_ah", "IBVERBS_1.1"),
            destroy_ah: resolve!(lib, "ibv_destroy_ah", "IBVERBS_1.1"),
        };
        // The library stays loaded for the life of the process: `Library` has no Drop (no
        // dlclose), so the fn pointers above can be handed out as `&'static`.
        let _ = lib;
        Ok(v)
    }
}

// SAFETY: the table holds only plain function pointers into a library that is never unloaded.
unsafe impl Send for Verbs {}
// SAFETY: as above; the table is immutable after loading.
unsafe impl Sync for Verbs {}

static VERBS: OnceLock<std::result::Result<Verbs, String>> = OnceLock::new();

/// The process-wide libibverbs table, loaded on first use.
///
/// # Errors
/// [`Error::LibraryUnavailable`] when `libibverbs.so.1` (or one of its required entry
/// points) cannot be loaded; the message names the packages to install.
pub(crate) fn verbs() -> Result<&'static Verbs> {
    match VERBS.get_or_init(|| Verbs::load_from(LIBRARY)) {
        Ok(v) => Ok(v),
        Err(reason) => Err(Error::LibraryUnavailable {
            library: LIBRARY,
            reason: reason.clone(),
            hint: INSTALL_HINT,
        }),
    }
}

/// Whether libibverbs could be loaded in this process.
pub fn library_available() -> bool {
    verbs().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_a_typed_error_naming_the_package() {
        let err = Verbs::load_from("libibverbs-does-not-exist.so.1")
            .err()
            .unwrap();
        let e = Error::LibraryUnavailable {
            library: LIBRARY,
            reason: err,
            hint: INSTALL_HINT,
        };
        let msg = e.to_string();
        assert!(msg.contains("libibverbs1"), "{msg}");
        assert!(msg.contains("ibverbs-providers"), "{msg}");
        assert!(msg.contains("rdma-core"), "{msg}");
        assert!(msg.contains("libibverbs-does-not-exist"), "{msg}");
    }

    /// `sym` must not bind a symbol of another version: libc has `memcpy`, but not at
    /// this version.
    #[test]
    fn a_missing_symbol_version_is_not_replaced_by_another() {
        let lib = Library::open("libc.so.6").expect("glibc");
        assert!(lib.sym("memcpy", "GLIBC_2.14").is_ok());
        let r = lib.sym("memcpy", "IBVERBS_1.1");
        assert!(r.is_err(), "memcpy@IBVERBS_1.1 resolved to another version");
    }

    /// A library without any version information still resolves: the dynamic linker
    /// accepts its unversioned definitions for a versioned lookup.
    #[test]
    fn an_unversioned_library_resolves() {
        let dir = std::env::temp_dir().join(format!("ibverbs-safe-sym-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let c = dir.join("f.c");
        let so = dir.join("libf.so");
        std::fs::write(&c, "int ibv_fake_fn(void) { return 42; }\n").unwrap();
        let built = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(&so)
            .arg(&c)
            .status();
        match built {
            Ok(s) if s.success() => {
                let lib = Library::open(so.to_str().unwrap()).unwrap();
                assert!(lib.sym("ibv_fake_fn", "IBVERBS_1.1").is_ok());
            }
            _ => skip!("cc", "no C compiler to build an unversioned test library"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn loads_versioned_symbols_where_installed() {
        match Verbs::load_from(LIBRARY) {
            // rdma-core 34 (2021) added ibv_reg_dmabuf_mr; CI installs a newer one.
            Ok(v) => assert!(
                v.reg_dmabuf_mr.is_some(),
                "ibv_reg_dmabuf_mr@{REG_DMABUF_MR_VERSION} not resolved"
            ),
            Err(e) => skip!("libibverbs", "{LIBRARY} not installed ({e})"),
        }
    }
}
