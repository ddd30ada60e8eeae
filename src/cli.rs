//! What every example does first, like a C command-line tool.

/// Gives `SIGPIPE` back its default action, so that an example whose output goes to a pipe
/// that closes early (`pingpong | head -3`) ends quietly, killed by the signal as `cat` or
/// `ib_send_lat` would be, instead of panicking with "failed printing to stdout". Rust
/// programs start with `SIGPIPE` ignored; the libraries do not depend on that (their
/// socket writes use `MSG_NOSIGNAL`: a peer gone is an error, not this signal —
/// `tests/fabric_sigpipe.rs`). Call it at the start of `main`, before any thread starts.
#[allow(unsafe_code)]
pub fn die_on_broken_pipe() {
    // SAFETY: installs the default disposition (no handler runs); called before other
    // threads exist, so no thread races on the signal's disposition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
