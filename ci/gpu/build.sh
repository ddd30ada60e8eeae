#!/usr/bin/env bash
# Builds, on a machine without CUDA, everything ci/gpu/run.sh runs on the GPU machine:
# the driver probe (ci/gpu/probe.c, C with dlopen), the nvlink-p2p test binaries (unit tests,
# no_driver, fake_driver, fd_passing, gpu), fabric-core's cuda_ipc backend test, and the
# ipc_bench / gpu_topology examples, in release mode, stripped, copied to ci/gpu/bin/
# (git-ignored).
#
# A compile error is shown (cargo's own rendering) and stops the script with cargo's status;
# nothing is copied from a failed build.
#
# Then hand that folder to the GPU machine with the device tool:
#   run(command="bash ci/gpu/run.sh", carry=["ci/gpu/bin"], timeout_s=300)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=ci/gpu/bin
rm -rf "$out"
mkdir -p "$out"
json=$(mktemp)
trap 'rm -f "$json"' EXIT

echo "== probe (cc)"
cc -O2 -Wall -Wextra -o "$out/gpu_probe" ci/gpu/probe.c -ldl

echo "== test binaries (cargo test --no-run)"
# JSON messages go to the file; diagnostics are rendered on stderr as usual.
cargo test --release -p nvlink-p2p --no-run --message-format=json-render-diagnostics >"$json"
cargo test --release -p fabric-core --test cuda_ipc --no-run \
  --message-format=json-render-diagnostics >>"$json"

echo "== examples"
cargo build --release -p nvlink-p2p --example ipc_bench --example gpu_topology

python3 - "$out" "$json" <<'EOF'
import json, shutil, sys
out, path = sys.argv[1], sys.argv[2]
want = {"lib", "no_driver", "fake_driver", "fd_passing", "gpu", "cuda_ipc"}
got = set()
for line in open(path):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
        continue
    t = m["target"]
    if t["kind"] == ["lib"] and t["name"] == "nvlink_p2p":
        name = "lib"
    elif t["kind"] == ["test"]:
        name = t["name"]
    else:
        continue
    if name in want:
        shutil.copy(m["executable"], f"{out}/{name}")
        got.add(name)
        print("copied", name, "<-", m["executable"])
missing = want - got
if missing:
    sys.exit(f"build.sh: no test binary for {sorted(missing)} in cargo's output")
EOF
cp target/release/examples/ipc_bench target/release/examples/gpu_topology "$out/"
strip --strip-debug "$out"/*
ls -la "$out"
du -sh "$out"
