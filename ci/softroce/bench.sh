#!/usr/bin/env bash
# bench.sh — perftest and our verbs_perf side by side, in ONE Soft-RoCE guest boot:
# ib_send_lat, ib_write_lat, ib_read_lat, ib_send_bw, ib_write_bw, ib_read_bw, and the
# 8-byte message rate of ib_write_bw / ib_send_bw at 32 and 128 in flight, against
# `examples/verbs_perf.rs` (release build) on the loopback rxe device (GID index 1), same
# sizes, iteration counts and queue settings, ROUNDS interleaved rounds (default 7).
# Prints the table (ratio = ours / perftest: medians, the paired median of the per-round
# ratios and their spread) and writes it to target/softroce-bench.md.
#
#   ci/softroce/bench.sh [ROUNDS]
#
# Under TCG absolute figures mean little (the guest CPU is emulated); only the ratios of
# programs measured in the same boot do.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
cd "$HERE/../.."
ROUNDS=${1:-7}
cargo build --release --example verbs_perf
target=$(cargo metadata --no-deps --format-version 1 | grep -o '"target_directory":"[^"]*"' | cut -d'"' -f4)
out=$target/softroce-bench.log
mkdir -p "$target"
rc=0
"$HERE/run-in-guest.sh" --layout all --timeout 2400 -- bash -c \
  "exec '$HERE/guest-bench.sh' '$target/release/examples/verbs_perf' '$ROUNDS' \"\$SOFTROCE_LO_DEV\" \"\$SOFTROCE_LO_GID\"" |
  tee "$out" || rc=$?
sed -n '/^=== side by side/,$p' "$out" | sed '1d' > "$target/softroce-bench.md"
echo "[bench] table written to $target/softroce-bench.md (full log: $out)"
exit "$rc"
