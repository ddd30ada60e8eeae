#!/usr/bin/env bash
# The one prepared script for the GPU machine (one H200). It runs what ci/gpu/build.sh built
# on the host (carried in ci/gpu/bin/) and writes to $OUT/ (or /tmp/nvlink-gpu-out):
#   gpu-report.txt  everything printed, in order
#   summary.txt     one line per step, rewritten after every step (so it is there even if a
#                   binary hangs or the whole run is killed), then the verdict
#   <step>.log      each binary's full output
#
#   host:  bash ci/gpu/build.sh
#   GPU:   run(command="bash ci/gpu/run.sh", carry=["ci/gpu/bin"], timeout_s=300)
#
# Order: the machine (kernel, nvidia-smi with compute mode, driver version, the driver
# library, ldd of the carried binaries), then the probe of what the driver and any sandbox
# allow, then the tests (--nocapture, so their facts and skips reach this report), then the
# ipc_bench figures. Every step has its own time limit, and all of them together stay under
# GPU_RUN_BUDGET_S (default 240 s, well inside the caller's 300 s): a step only gets what
# is left of the budget.
#
# On this machine a test that would skip fails (NVLINK_P2P_REQUIRE_GPU=1), unless the skip is
# a named limit of the machine: one GPU, or a feature the probe found refused
# (NVLINK_P2P_PROBE_REFUSED). Such limits are listed in the summary.
#
# Exit status: 0 when every step passed and both figures met their targets.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
bin=ci/gpu/bin
out=${OUT:-/tmp/nvlink-gpu-out}
mkdir -p "$out"
exec > >(tee "$out/gpu-report.txt") 2>&1

start=$(date +%s)
budget=${GPU_RUN_BUDGET_S:-240}
summary=()
fail=0
verdict=INCOMPLETE

write_summary() {
  {
    echo "GPU run $(date -u +%Y-%m-%dT%H:%M:%SZ), kernel $(uname -r), $(( $(date +%s) - start )) s"
    printf '%s\n' "${summary[@]}"
    grep -h '^limit:' "$out"/*.log 2>/dev/null | sort -u | sed 's/^/  /'
    grep -h '^figure' "$out/ipc_bench.log" 2>/dev/null | sed 's/^/  /'
    echo "GPUDirect RDMA (a NIC reading GPU memory through DMA-BUF): UNVERIFIED on this machine"
    echo "  (${nic_note:-no RDMA NIC checked}); only the GPU driver's DMA-BUF export was tried"
    echo "overall: $verdict"
  } >"$out/summary.txt.new" && mv "$out/summary.txt.new" "$out/summary.txt"
}
trap 'verdict=${verdict/INCOMPLETE/INCOMPLETE (killed)}; write_summary' TERM INT
write_summary

# Seconds a step may run: its own limit, capped by what is left of the budget (minus 5 s
# for the summary). 0 when nothing is left.
limit_for() {
  local left=$((budget - ($(date +%s) - start) - 5))
  ((left < 0)) && left=0
  ((left < $1)) && echo "$left" || echo "$1"
}

# run_step NAME LIMIT CMD...: runs CMD with a time limit, output to $out/NAME.log.
run_step() {
  local name=$1 want=$2
  shift 2
  local lim
  lim=$(limit_for "$want")
  if ((lim < 3)); then
    summary+=("SKIPPED $name: the run's ${budget}s budget is spent")
    fail=1
    write_summary
    return 1
  fi
  timeout -k 3 "$lim" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  if ((rc == 124 || rc == 137)); then
    summary+=("HUNG   $name: killed after ${lim}s")
    fail=1
  elif ((rc != 0)); then
    summary+=("FAIL   $name (rc=$rc)")
    fail=1
  else
    summary+=("ok     $name")
  fi
  write_summary
  return $rc
}

echo "== machine"
date -u
echo "kernel: $(uname -r) ($(uname -v))"
nvidia-smi --query-gpu=index,name,driver_version,compute_mode,memory.total,memory.used,pci.bus_id \
  --format=csv 2>&1 || echo "(nvidia-smi failed or is missing)"
nvidia-smi -q 2>/dev/null | grep -iE 'driver version|cuda version|compute mode|mig mode' | sed 's/^ */  /' | sort -u
nvidia-smi topo -m 2>&1 | head -12 || true
echo "libcuda on the loader's path:"
ldconfig -p 2>/dev/null | grep -E 'libcuda\.so' | sed 's/^/  /' || echo "  (ldconfig -p has none)"
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
rdma_devs=$(find /sys/class/infiniband/ -mindepth 1 -maxdepth 1 -printf '%f ' 2>/dev/null)
if [ -n "$rdma_devs" ]; then
  nic_note="RDMA devices present: ${rdma_devs}not used by this run"
else
  nic_note="no RDMA NIC here (/sys/class/infiniband is empty or missing)"
fi
echo "rdma: $nic_note"
echo "== carried binaries (ldd)"
for f in "$bin"/*; do
  [ -f "$f" ] || continue
  echo "-- $f"
  ldd "$f" 2>&1 | sed 's/^/  /'
done
if [ ! -x "$bin/gpu_probe" ]; then
  echo "MISSING $bin: run ci/gpu/build.sh on the host and carry ci/gpu/bin"
  summary+=("MISSING $bin/gpu_probe: nothing was carried?")
  verdict=FAIL
  write_summary
  exit 1
fi

echo "== probe: what the driver and any sandbox allow"
run_step probe 25 "$bin/gpu_probe"
cat "$out/probe.log"
refused=$(sed -n 's/^PROBE_REFUSED=//p' "$out/probe.log" | tail -n1)
export NVLINK_P2P_PROBE_REFUSED=$refused
echo "features this machine refuses (named limits for the tests): ${refused:-none}"
summary+=("       probe: refused here: ${refused:-none}")

echo "== topology (gpu_topology)"
run_step gpu_topology 15 "$bin/gpu_topology"
cat "$out/gpu_topology.log"
if grep -q '^no GPU available' "$out/gpu_topology.log"; then
  summary+=("FAIL   gpu_topology saw no GPU")
  fail=1
fi

# On this machine a missing GPU, or a skip that is not a named limit, is a failure.
export NVLINK_P2P_REQUIRE_GPU=1
export RUST_BACKTRACE=1
# fabric-core's cuda_ipc tests run on the real driver and again over the stand-in (a child
# process each): caller device memory, regions shared by two connections of one domain,
# revocation between processes, and the region churn, here with FABRIC_CUDA_CHURN regions
# (the host runs a million over the stand-in; a real cuMemAlloc + IPC export per region
# would not fit this budget).
export FABRIC_CUDA_CHURN=${FABRIC_CUDA_CHURN:-20000}
# Per-binary limits: 15+15+30+15+60+60 = 195 s worst case (each step is also capped by what
# is left of the budget); a normal run takes about a minute.
for t in lib:15 no_driver:15 fake_driver:30 fd_passing:15 gpu:60 cuda_ipc:60; do
  name=${t%%:*}
  lim=${t##*:}
  exe=$bin/$name
  echo "== tests: $name (limit ${lim}s)"
  if [ ! -x "$exe" ]; then
    echo "MISSING $exe"
    summary+=("MISSING $name")
    fail=1
    write_summary
    continue
  fi
  run_step "$name" "$lim" "$exe" --test-threads=1 --nocapture
  # Per test: its verdict, plus the facts, skips and limits it printed.
  grep -E '^test .* \.\.\. |^skipped|^limit:|^not (needed|applicable)|^driver |^device |^Peer|^dma-buf|^fabric|^no fabric|^variant|^cuda-ipc|^caller device|^regions served|^revocation|panicked|^test result' "$out/$name.log"
  if grep -q '^skipped' "$out/$name.log"; then
    # Should not happen with NVLINK_P2P_REQUIRE_GPU=1: say so loudly.
    summary+=("FAIL   $name printed 'skipped' lines on the GPU machine (see $name.log)")
    fail=1
  fi
  tail -n 5 "$out/$name.log"
done

echo "== ipc_bench (1 GiB)"
run_step ipc_bench 40 "$bin/ipc_bench" --size-mib 1024 --iters 20
cat "$out/ipc_bench.log"

echo "== summary"
if ((fail == 0)); then verdict=PASS; else verdict=FAIL; fi
write_summary
cat "$out/summary.txt"
exit $fail
