#!/usr/bin/env bash
# guest-bench.sh — runs INSIDE the Soft-RoCE guest (started by bench.sh): perftest's
# ib_send_lat, ib_write_lat, ib_read_lat, ib_write_bw, ib_send_bw and our verbs_perf
# equivalents on the same device, same sizes and iteration counts, ROUNDS times each,
# interleaved (theirs, ours, theirs, ...) so that drifts of the emulated machine hit both.
# Our runs get the TX depth, CQ moderation and inline size perftest reported for itself.
# Prints one "ROW" line per run and then the side-by-side table (medians over the rounds,
# ratio = ours / theirs).
#
#   guest-bench.sh VERBS_PERF_BINARY ROUNDS DEVICE GID_INDEX
set -u
OURS=${1:?verbs_perf binary}
ROUNDS=${2:-3}
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
for test in send_lat write_lat read_lat write_bw send_bw; do
  for round in $(seq 1 "$ROUNDS"); do
    PORT=$((PORT + 1))
    out=$(mktemp)
    echo "=== $test round $round: perftest ib_$test"
    if ! pair "ib_$test" -d "$DEV" -x "$GID" -F -p $PORT -- \
      "ib_$test" -d "$DEV" -x "$GID" -F -p $PORT 127.0.0.1 > "$out" 2>&1; then
      cat "$out"
      FAILED=$((FAILED + 1))
      continue
    fi
    cat "$out"
    txd=$(field "TX depth" "$out")
    cqm=$(field "CQ Moderation" "$out")
    inl=$(field "Max inline data" "$out")
    # the result line: "#bytes #iterations ..." then numbers (9 columns for latency:
    # t_min t_max t_typical t_avg t_stdev 99% 99.9%; 5 for bandwidth: peak average rate)
    res=$(awk '$1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ && (NF == 5 || NF >= 9) { print; exit }' "$out")
    if [ -z "$res" ]; then
      echo "FAILED: no result line from ib_$test"
      FAILED=$((FAILED + 1))
      continue
    fi
    set -- $res
    bytes=$1 iters=$2
    case $test in
      *_lat) echo "ROW $test perftest $round bytes=$1 iters=$2 typical=$5 p99=$8" >> "$ROWS" ;;
      *_bw) echo "ROW $test perftest $round bytes=$1 iters=$2 bw=$4" >> "$ROWS" ;;
    esac
    opts=(-s "${bytes:-2}" -n "${iters:-1000}")
    [ -n "$txd" ] && opts+=(-t "$txd")
    [ -n "$cqm" ] && opts+=(-Q "$cqm")
    [ -n "$inl" ] && opts+=(-I "$inl")
    PORT=$((PORT + 1))
    echo "=== $test round $round: ours verbs_perf $test ${opts[*]}"
    if ! pair "$OURS" "$test" -d "$DEV" -x "$GID" -p $PORT "${opts[@]}" -- \
      "$OURS" "$test" -d "$DEV" -x "$GID" -p $PORT "${opts[@]}" 127.0.0.1 > "$out" 2>&1; then
      cat "$out"
      FAILED=$((FAILED + 1))
      continue
    fi
    cat "$out"
    sed -n 's/^RESULT test=[A-Za-z]* bytes=\([0-9]*\) iters=\([0-9]*\).*t_typical_us=\([0-9.]*\).*t_p99_us=\([0-9.]*\).*/\1 \2 \3 \4/p' "$out" |
      awk -v t=$test -v r=$round '{ printf "ROW %s ours %s bytes=%s iters=%s typical=%s p99=%s\n", t, r, $1, $2, $3, $4 }' >> "$ROWS"
    sed -n 's/^RESULT test=[A-Za-z]* bytes=\([0-9]*\) iters=\([0-9]*\) bw_avg_MiBps=\([0-9.]*\).*/\1 \2 \3/p' "$out" |
      awk -v t=$test -v r=$round '{ printf "ROW %s ours %s bytes=%s iters=%s bw=%s\n", t, r, $1, $2, $3 }' >> "$ROWS"
    rm -f "$out"
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
