#!/usr/bin/env bash
# Deterministic per-message instruction counts of post+poll (owned, scoped, raw) with
# callgrind; run inside the Soft-RoCE guest (it needs a device), e.g.
#   cargo build --release -p ibverbs-safe --example post_poll_bench
#   ci/softroce/run-in-guest.sh --layout lo -- ibverbs-safe/bench/callgrind-post-poll.sh [BIN...]
# BENCH_SETTLE=20 makes every burst of 32 complete before the poll (no spin loop counted);
# 5 rounds (1 warm-up + 4) x 1024 messages per variant.
#
# Two figures per variant:
# * "toggle": callgrind collects only inside the variant's round function
#   (--toggle-collect), so the total is exactly its inclusive cost (user space: the safe
#   layer, libibverbs and the rxe provider; the kernel's work behind the doorbell is not
#   counted) — the figure of record from issue 16 on;
# * "grep": the sum of callgrind_annotate's inclusive lines naming the round function, the
#   figure the earlier tables (issues 9 and before) were made with (kept for comparison; the
#   same run, and the two agreed on every binary measured so far).
# With BENCH_PROFILE=1, the per-function exclusive costs (per message, top 40) of each
# variant are printed too (to stdout: the guest's file system is a throw-away overlay).
set -euo pipefail
[ $# -gt 0 ] || set -- target/release/examples/post_poll_bench
OUT=$(mktemp -d)
for BIN in "$@"; do
  name=$(basename "$BIN")
  for v in owned scoped raw; do
    f=${v/owned/safe}_round
    BENCH_SETTLE=20 BENCH_ONLY=$v valgrind --tool=callgrind --callgrind-out-file="$OUT/tg.$v" \
      --toggle-collect="*post_poll_bench::$f*" "$BIN" --rounds 4 --iters 1024 > /dev/null 2>&1
    tot=$(callgrind_annotate "$OUT/tg.$v" | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
    grep_tot=$(callgrind_annotate --inclusive=yes "$OUT/tg.$v" | grep -E "::$f \[" |
      awk '{gsub(",", "", $1); s += $1} END {print s}')
    echo "$name $v: toggle $((tot / 5120)) per message ($tot / 5120); grep $((grep_tot / 5120)) per message"
    if [ -n "${BENCH_PROFILE:-}" ]; then
      callgrind_annotate --threshold=100 "$OUT/tg.$v" |
        awk -v m=5120 -v p="$name $v |" '/file:function/ {on = 1; next} on && $1 ~ /^[0-9,]+$/ {
          c = $1; gsub(",", "", c); sub(/^ *[0-9,]+ +(\( *[0-9.]+%\) +)?/, ""); printf "%s %8.1f %s\n", p, c / m, $0 }' |
        sed -n '1,40p'
    fi
  done
done
rm -rf "$OUT"
