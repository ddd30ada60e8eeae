//! Safe, zero-copy wrappers over libibverbs, loaded at run time.
#![deny(unsafe_code)]
