//! One small `Transport` trait, an out-of-band bootstrap, and the shm, verbs, cuda-ipc and tcp backends.
#![deny(unsafe_code)]
