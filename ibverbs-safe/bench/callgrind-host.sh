#!/usr/bin/env bash
# Host-side instruction counts of post+poll (owned, scoped, raw): the rounds of
# post_poll_bench on the fake provider's lean data path (src/hotpath_counts.rs), under
# callgrind. No device needed; the provider's share is a few dozen instructions, so the
# difference between a safe variant and raw is the safe layer's own work. The figures of
# record come from the guest (callgrind-post-poll.sh); this tracks changes between guest runs.
#
#   ibverbs-safe/bench/callgrind-host.sh [--lines]   # --lines: per-source-line breakdown
#
# 5 rounds x 1024 messages per variant; inclusive cost of each variant's round function
# divided by the messages.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
lines=${1:-}
bin=$(cargo test --release -p ibverbs-safe --lib --no-run --message-format=json 2>/dev/null |
  sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
[ -x "$bin" ] || { echo "no test executable" >&2; exit 1; }
OUT=${CALLGRIND_OUT:-$(mktemp -d)}
mkdir -p "$OUT"
for v in owned scoped raw; do
  # collect only inside the variant's round function: the totals are its inclusive cost
  HOTPATH_ONLY=$v valgrind --tool=callgrind --callgrind-out-file="$OUT/cg.$v" \
    --toggle-collect="*hotpath_counts::${v}_round*" \
    "$bin" --exact hotpath_counts::post_poll_rounds --test-threads 1 > /dev/null 2>&1
  tot=$(callgrind_annotate "$OUT/cg.$v" | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
  echo "$v: $tot instructions / 5120 messages = $((tot / 5120)) per message"
  if [ "$lines" = --lines ]; then
    # exclusive cost per function and per source file of the inlined code
    callgrind_annotate --threshold=100 "$OUT/cg.$v" |
      awk -v m=5120 '/file:function/ {on = 1; next} on && $1 ~ /^[0-9,]+$/ {
        c = $1; gsub(",", "", c); sub(/^ *[0-9,]+ +(\( *[0-9.]+%\) +)?/, ""); printf "%8.1f %s\n", c / m, $0 }' > "$OUT/fn.$v"
  fi
done
[ "$lines" = --lines ] && echo "per-function files: $OUT/fn.*, raw data: $OUT/cg.*"
[ -n "${CALLGRIND_OUT:-}" ] || [ "$lines" = --lines ] || rm -rf "$OUT"
