#!/usr/bin/env bash
# Installs what the CI stages need on a fresh Debian 12 machine (idempotent; root).
# Nothing here is needed for `cargo build` / `cargo test --workspace` themselves:
# libibverbs and libcuda are loaded at run time and missing ones are typed errors.
set -euo pipefail
pkgs=(
  # layout checks of our #[repr(C)] verbs types against the real headers: the C program
  # (cc) and the bindgen proof in ffi-check/ (libclang, opened at run time; rdma_cma.h too)
  libibverbs-dev librdmacm-dev libclang-dev
  # real verbs in the Soft-RoCE guest, and the reference tools we compare against
  rdma-core ibverbs-providers ibverbs-utils perftest rdmacm-utils iproute2
  qemu-system-x86 busybox-static kmod cpio
  # reference figures for the shm/tcp transports
  ucx-utils
  # sanitizer runtimes
  libclang-rt-14-dev
)
need=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || need+=("$p"); done
if ((${#need[@]})); then
  echo "[install-deps] apt-get install ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
