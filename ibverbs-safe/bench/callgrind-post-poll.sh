#!/usr/bin/env bash
# Deterministic per-message instruction counts of post+poll (owned, scoped, raw) with
# callgrind; run inside the Soft-RoCE guest (it needs a device), e.g.
#   cargo build --release -p ibverbs-safe --example post_poll_bench
#   ci/softroce/run-in-guest.sh --layout lo -- ibverbs-safe/bench/callgrind-post-poll.sh
# BENCH_SETTLE=20 makes every burst of 32 complete before the poll (no spin loop counted);
# 5 rounds (1 warm-up + 4) x 1024 messages per variant; inclusive cost of each variant's
# round function, divided by the messages.
set -euo pipefail
BIN=${1:-target/release/examples/post_poll_bench}
OUT=$(mktemp -d)
for v in owned scoped raw; do
  BENCH_SETTLE=20 BENCH_ONLY=$v valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.$v" \
    "$BIN" --rounds 4 --iters 1024 > /dev/null 2>&1
  f=${v/owned/safe}_round
  tot=$(callgrind_annotate --inclusive=yes "$OUT/cg.$v" | grep -E "::$f \[" |
    awk '{gsub(",", "", $1); s += $1} END {print s}')
  echo "$v: $tot instructions / 5120 messages = $((tot / 5120)) per message"
done
rm -rf "$OUT"
