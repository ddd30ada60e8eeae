#!/usr/bin/env bash
# guest-bench.sh — runs INSIDE the Soft-RoCE guest (started by bench.sh): perftest's
# ib_send_lat, ib_write_lat, ib_read_lat, ib_send_bw, ib_write_bw, ib_read_bw, and the
# 8-byte message rate of ib_write_bw / ib_send_bw at 32 and 128 in flight, against our
# verbs_perf equivalents on the same device, same sizes and iteration counts, ROUNDS rounds,
# interleaved (theirs, ours, theirs, ...; every test in every round) so that drifts of the
# emulated machine hit both.
# Our runs get the TX depth, CQ moderation and inline size perftest reported for itself.
# Prints one "ROW" line per run and then the side-by-side table (medians over the rounds,
# ratio = ours / theirs).
#
#   guest-bench.sh VERBS_PERF_BINARY ROUNDS DEVICE GID_INDEX
set -u
OURS=${1:?verbs_perf binary}
ROUNDS=${2:-7}
DEV=${3:-rxe0}
GID=${4:-1}
PORT=19100
ROWS=$(mktemp)
TO=300

pair() { # server-cmd... -- client-cmd... : prints the client's output, fails if either fails
  local srv=() cli=() seen=0 a
  for a in "$@"; do
    if [ "$a" = -- ]; then seen=1; continue; fi
    if [ $seen = 0 ]; then srv+=("$a"); else cli+=("$a"); fi
  done
  local sout
  sout=$(mktemp)
  timeout -k 5 $TO "${srv[@]}" > "$sout" 2>&1 &
  local sp=$!
  local i=0
  while ! ss -Hltn "sport = :$PORT" | grep -q . && [ $i -lt 200 ]; do sleep 0.1; i=$((i + 1)); done
  timeout -k 5 $TO "${cli[@]}"
  local crc=$?
  # a failed client leaves the server waiting: do not wait for its timeout
  [ $crc = 0 ] || kill $sp 2> /dev/null
  wait $sp
  local src=$?
  if [ $crc != 0 ] || [ $src != 0 ]; then
    echo "FAILED: client status $crc, server status $src; server said:"
    cat "$sout"
    rm -f "$sout"
    return 1
  fi
  rm -f "$sout"
}

field() { # "Name" perftest-output : value of a " Name : value" header line
  sed -n "s/^ *$1 *: *\([0-9]*\).*/\1/p" "$2" | head -1
}

FAILED=0
# one_pair LABEL TEST [extra perftest args...]: perftest, then ours with the TX depth, CQ
# moderation and inline size perftest reported for itself; ROW lines go to $ROWS under LABEL.
one_pair() {
  local label=$1 test=$2 round=$3
  shift 3
  PORT=$((PORT + 1))
  local out
  out=$(mktemp)
  echo "=== $label round $round: perftest ib_$test $*"
  if ! pair "ib_$test" -d "$DEV" -x "$GID" -F -p $PORT "$@" -- \
    "ib_$test" -d "$DEV" -x "$GID" -F -p $PORT "$@" 127.0.0.1 > "$out" 2>&1; then
    cat "$out"
    FAILED=$((FAILED + 1))
    rm -f "$out"
    return
  fi
  cat "$out"
  local txd cqm inl res
  txd=$(field "TX depth" "$out")
  cqm=$(field "CQ Moderation" "$out")
  inl=$(field "Max inline data" "$out")
  # the result line: "#bytes #iterations ..." then numbers (9 columns for latency:
  # t_min t_max t_typical t_avg t_stdev 99% 99.9%; 5 for bandwidth: peak average msg-rate)
  res=$(awk '$1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ && (NF == 5 || NF >= 9) { print; exit }' "$out")
  if [ -z "$res" ]; then
    echo "FAILED: no result line from ib_$test"
    FAILED=$((FAILED + 1))
    rm -f "$out"
    return
  fi
  set -- $res
  local bytes=$1 iters=$2
  case $test in
    *_lat) echo "ROW $label perftest $round bytes=$1 iters=$2 typical=$5 p99=$8" >> "$ROWS" ;;
    *_bw) echo "ROW $label perftest $round bytes=$1 iters=$2 bw=$4 mr=$5" >> "$ROWS" ;;
  esac
  local opts=(-s "${bytes:-2}" -n "${iters:-1000}")
  [ -n "$txd" ] && opts+=(-t "$txd")
  [ -n "$cqm" ] && opts+=(-Q "$cqm")
  [ -n "$inl" ] && opts+=(-I "$inl")
  PORT=$((PORT + 1))
  echo "=== $label round $round: ours verbs_perf $test ${opts[*]}"
  if ! pair "$OURS" "$test" -d "$DEV" -x "$GID" -p $PORT "${opts[@]}" -- \
    "$OURS" "$test" -d "$DEV" -x "$GID" -p $PORT "${opts[@]}" 127.0.0.1 > "$out" 2>&1; then
    cat "$out"
    FAILED=$((FAILED + 1))
    rm -f "$out"
    return
  fi
  cat "$out"
  sed -n 's/^RESULT test=[A-Za-z]* bytes=\([0-9]*\) iters=\([0-9]*\).*t_typical_us=\([0-9.]*\).*t_p99_us=\([0-9.]*\).*/\1 \2 \3 \4/p' "$out" |
    awk -v t=$label -v r=$round '{ printf "ROW %s ours %s bytes=%s iters=%s typical=%s p99=%s\n", t, r, $1, $2, $3, $4 }' >> "$ROWS"
  sed -n 's/^RESULT test=[A-Za-z]* bytes=\([0-9]*\) iters=\([0-9]*\) bw_avg_MiBps=\([0-9.]*\) msg_rate_Mpps=\([0-9.]*\).*/\1 \2 \3 \4/p' "$out" |
    awk -v t=$label -v r=$round '{ printf "ROW %s ours %s bytes=%s iters=%s bw=%s mr=%s\n", t, r, $1, $2, $3, $4 }' >> "$ROWS"
  rm -f "$out"
}

# Round-major: every round runs every test (theirs, then ours), so a slow phase of the
# emulated machine hits all of them, and each pair runs back to back.
for round in $(seq 1 "$ROUNDS"); do
  for test in send_lat write_lat read_lat send_bw write_bw read_bw; do
    one_pair "$test" "$test" "$round"
  done
  # message rate: 8-byte messages, 32 and 128 in flight (perftest's CQ moderation: the
  # others are unsignalled, ours too)
  for depth in 32 128; do
    one_pair "write_mr_$depth" write_bw "$round" -s 8 -t "$depth"
    one_pair "send_mr_$depth" send_bw "$round" -s 8 -t "$depth"
  done
done

echo
echo "=== raw rows"
cat "$ROWS"
echo
echo "=== side by side (median of $ROUNDS rounds; ratio = ours / perftest; paired = median of the per-round ratios)"
awk -f "$(dirname "$0")/bench-table.awk" "$ROWS"
rm -f "$ROWS"
if [ $FAILED -gt 0 ]; then
  echo "$FAILED run(s) FAILED"
  exit 1
fi
