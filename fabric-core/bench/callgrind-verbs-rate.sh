#!/usr/bin/env bash
# Issue 12's verbs figures, run inside the Soft-RoCE guest (it needs a device):
#   cargo build --release -p fabric-core --example verbs_rate
#   FABRIC_SOFTROCE_DIR=/work/softroce-cache ci/softroce/run-in-guest.sh --layout lo -- \
#     fabric-core/bench/callgrind-verbs-rate.sh [BIN]
# 1. the message rate (verbs_rate's timed rounds: fabric-core with one doorbell per post,
#    fabric-core with held+flushed bursts, and ibverbs-safe rotate), ratios to ibv (>= 0.9);
# 2. user-space instructions per message with callgrind, as ibverbs-safe/bench/
#    callgrind-post-poll.sh counts them: BENCH_SETTLE=20 (every burst of 32 has completed
#    before the poll pass, so no spin loop is counted), --toggle-collect on the variant's
#    round function (its inclusive cost: the safe layers, libibverbs and the rxe provider;
#    not the kernel behind the doorbell), 5 rounds (1 warm-up + 4) x 1024 messages; the
#    fabric/ibv ratio (target <= 1.3). One message = one SEND posted and completed plus its
#    RECV completed and reposted.
# BENCH_PROFILE=1 also prints the top 40 functions by exclusive cost per message.
# RATE_ROUNDS (default 21) sets the timed rounds; SKIP_RATE=1 / SKIP_CALLGRIND=1 skip a part.
set -euo pipefail
BIN=${1:-target/release/examples/verbs_rate}
export FABRIC_VERBS_DEVICE=${FABRIC_VERBS_DEVICE:-${SOFTROCE_LO_DEV:-${SOFTROCE_DEV:-}}}
[ -n "$FABRIC_VERBS_DEVICE" ] || unset FABRIC_VERBS_DEVICE
if [ -z "${SKIP_RATE:-}" ]; then
  "$BIN" --rounds "${RATE_ROUNDS:-21}" --iters 1024
fi
[ -z "${SKIP_CALLGRIND:-}" ] || exit 0
OUT=$(mktemp -d)
declare -A per
for v in fabric fabric_batch ibv; do
  BENCH_SETTLE=20 BENCH_ONLY=$v valgrind --tool=callgrind --callgrind-out-file="$OUT/tg.$v" \
    --toggle-collect="*verbs_rate::${v}_round*" "$BIN" --rounds 4 --iters 1024 > /dev/null 2>&1
  tot=$(callgrind_annotate "$OUT/tg.$v" | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
  if [ -z "$tot" ]; then
    # (a binary whose two fabric round functions are identical has only one of them)
    echo "callgrind $v: nothing collected (no function ${v}_round in $BIN)"
    per[$v]=0
    continue
  fi
  per[$v]=$((tot / 5120))
  echo "callgrind $v: $((tot / 5120)) instructions per message ($tot / 5120)"
  if [ -n "${BENCH_PROFILE:-}" ]; then
    callgrind_annotate --threshold=100 "$OUT/tg.$v" |
      awk -v m=5120 -v p="$v |" '/file:function/ {on = 1; next} on && $1 ~ /^[0-9,]+$/ {
        c = $1; gsub(",", "", c); sub(/^ *[0-9,]+ +(\( *[0-9.]+%\) +)?/, ""); printf "%s %8.1f %s\n", p, c / m, $0 }' |
      sed -n '1,40p'
  fi
done
awk -v f="${per[fabric]}" -v b="${per[fabric_batch]}" -v i="${per[ibv]}" \
  'BEGIN { if (i > 0) printf "callgrind ratio fabric/ibv %.3f, held+flushed/ibv %.3f (target <= 1.3)\n", f / i, b / i }'
rm -rf "$OUT"
