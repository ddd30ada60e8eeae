#!/usr/bin/env bash
# Builds, on a machine without CUDA, everything ci/gpu/run.sh runs on the GPU machine:
# the nvlink-p2p test binaries (unit tests, no_driver, fd_passing, gpu), fabric-core's
# cuda_ipc backend test, and the ipc_bench / gpu_topology examples, in release mode,
# stripped, copied to ci/gpu/bin/ (git-ignored).
#
# Then hand that folder to the GPU machine with the device tool:
#   run(command="bash ci/gpu/run.sh", carry=["ci/gpu/bin"], timeout_s=300)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=ci/gpu/bin
rm -rf "$out"
mkdir -p "$out"

json=$(cargo test --release -p nvlink-p2p --no-run --message-format=json 2>/dev/null
       cargo test --release -p fabric-core --test cuda_ipc --no-run --message-format=json 2>/dev/null)
cargo build --release -p nvlink-p2p --example ipc_bench --example gpu_topology
python3 -c '
import json, shutil, sys
out = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    if m["target"]["name"] == "nvlink_p2p" or m["target"]["name"] == "nvlink-p2p":
        name = "lib"
    else:
        name = m["target"]["name"]
    if m["target"]["kind"] == ["lib"] or "test" in m["target"]["kind"] or m["profile"]["test"]:
        shutil.copy(m["executable"], f"{out}/{name}")
        print("copied", name, "<-", m["executable"])
' "$out" <<<"$json"
cp target/release/examples/ipc_bench target/release/examples/gpu_topology "$out/"
strip --strip-debug "$out"/* 2>/dev/null || true
ls -la "$out"
du -sh "$out"
