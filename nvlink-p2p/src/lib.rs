//! Safe CUDA peer access, IPC and VMM shareable handles, and DMA-BUF export, on `cudarc`.
#![deny(unsafe_code)]
