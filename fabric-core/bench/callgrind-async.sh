#!/usr/bin/env bash
# Instructions per round trip of side A on the bare transport, a Worker endpoint and an
# AsyncWorker endpoint (awaiting the send first, or the reply first, or both posted by one
# AsyncWorker::recv_send) (`async_hotpath`, both sides in one thread over shm; see that file).
# Each variant runs for N and 2N round trips under callgrind; the difference of the two
# totals divided by N is the per-round-trip cost (A's side plus B's echo, which is the same
# in every variant), so the differences between variants are the engines' costs.
#
#   cargo build --release -p fabric-core --features tokio --example async_hotpath
#   bash fabric-core/bench/callgrind-async.sh [BIN] [N]
#
# Deterministic: the same binary gives the same counts on an idle or a loaded host.
set -euo pipefail
BIN=${1:-target/release/examples/async_hotpath}
N=${2:-20000}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
total() {
  valgrind --tool=callgrind --callgrind-out-file="$OUT/cg" "$BIN" "$1" 8 "$2" > "$OUT/log" 2>&1 ||
    { cat "$OUT/log" >&2; exit 1; }
  callgrind_annotate "$OUT/cg" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}'
}
declare -A per
for v in bare worker async async_reply_first async_post; do
  a=$(total "$v" "$N")
  b=$(total "$v" $((2 * N)))
  per[$v]=$(( (b - a) / N ))
  echo "$v: $(( (b - a) / N )) instructions per round trip (8 B, $N vs $((2 * N)) round trips)"
done
echo "over bare, per round trip: worker $(( per[worker] - per[bare] )), async $(( per[async] - per[bare] )), async_reply_first $(( per[async_reply_first] - per[bare] )), async_post $(( per[async_post] - per[bare] ))"
