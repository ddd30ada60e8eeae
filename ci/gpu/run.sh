#!/usr/bin/env bash
# The one prepared script for the GPU machine (one H200; budget: keep a run under ~3 min).
# It runs the binaries ci/gpu/build.sh built on the host (carried in ci/gpu/bin/), prints
# pass/fail per test and the ipc_bench figures, and writes everything to $OUT/ (or
# /tmp/nvlink-gpu-out) as gpu-report.txt plus one log per binary.
#
#   host:  bash ci/gpu/build.sh
#   GPU:   run(command="bash ci/gpu/run.sh", carry=["ci/gpu/bin"], timeout_s=300)
#
# Exit status: 0 when every test passed and both figures met their targets.
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=ci/gpu/bin
out=${OUT:-/tmp/nvlink-gpu-out}
mkdir -p "$out"
exec > >(tee "$out/gpu-report.txt") 2>&1

echo "== machine"
date -u
uname -r
nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv 2>&1 || echo "(no nvidia-smi)"
nvidia-smi topo -m 2>&1 | head -20 || true
ls -l /dev/nvidia* 2>/dev/null | head -20 || true

echo "== topology (gpu_topology)"
[ -x "$bin/gpu_topology" ] && timeout 20 "$bin/gpu_topology" 2>&1 | tee "$out/gpu_topology.log"

# On this machine a missing GPU is a failure, not a skip.
export NVLINK_P2P_REQUIRE_GPU=1
export RUST_BACKTRACE=1
fail=0
summary=()
for t in lib no_driver fake_driver fd_passing gpu cuda_ipc; do
  exe=$bin/$t
  if [ ! -x "$exe" ]; then
    echo "MISSING $exe: run ci/gpu/build.sh on the host and carry ci/gpu/bin"
    summary+=("MISSING $t")
    fail=1
    continue
  fi
  echo "== tests: $t"
  # Worst case (everything hangs) stays under 300 s in total; a normal run takes ~1 min.
  case $t in gpu) limit=90 ;; cuda_ipc) limit=45 ;; *) limit=20 ;; esac
  timeout "$limit" "$exe" --test-threads=1 >"$out/$t.log" 2>&1
  rc=$?
  # One line per test (pass/fail), plus skips and the test's own printed facts.
  grep -E '^test .* \.\.\. |^skipped|skipped:|^device |^driver |^Peer|unsupported|supported:|dma-buf|panicked|^test result' "$out/$t.log"
  if [ $rc -ne 0 ]; then
    echo "-- $t failed (rc=$rc); tail of its log:"
    tail -40 "$out/$t.log"
    fail=1
    summary+=("FAIL $t (rc=$rc)")
  else
    summary+=("ok   $t")
  fi
done

echo "== ipc_bench (1 GiB)"
if [ -x "$bin/ipc_bench" ]; then
  timeout 60 "$bin/ipc_bench" --size-mib 1024 --iters 20 2>&1 | tee "$out/ipc_bench.log"
  rc=${PIPESTATUS[0]}
  if [ $rc -ne 0 ]; then fail=1; summary+=("FAIL ipc_bench (rc=$rc; 2 = a figure missed its target)"); else summary+=("ok   ipc_bench"); fi
else
  echo "MISSING $bin/ipc_bench"
  summary+=("MISSING ipc_bench")
  fail=1
fi

echo "== summary"
printf '%s\n' "${summary[@]}"
grep -h '^figure' "$out/ipc_bench.log" 2>/dev/null || true
echo "overall: $([ $fail -eq 0 ] && echo PASS || echo FAIL)"
exit $fail
