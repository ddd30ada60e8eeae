#!/usr/bin/env bash
# rping-interop.sh — rping over rdma_cm, run INSIDE the Soft-RoCE guest (pair layout: rdma_cm
# needs an IP address on an rxe netdev; guest-stage2.sh puts 10.77.0.1 on veth0 = rxe0):
#
#   ci/softroce/rping-interop.sh EXAMPLES_DIR [ADDR]
#
# Pairs rdma-core's rping server with our client, our server with rdma-core's client (both
# with -V validation), ours with ours, and checks the output lines. Prints one
# "PASS|FAIL <seconds> rping: <name>" line per pairing and exits 1 if any failed.
set -u
EXAMPLES=${1:?usage: rping-interop.sh EXAMPLES_DIR [ADDR]}
ADDR=${2:-${SOFTROCE_CM_ADDR:-10.77.0.1}}
OURS=$EXAMPLES/rping
THEIRS=$(command -v rping || true)
FAILED=0
PORT=7300
T0=$(date +%s.%N)
since() { awk -v a="$(date +%s.%N)" -v b="$1" 'BEGIN{printf "%.1f", a-b}'; }
result() { echo "$1 $(since "$T0") rping: $2"; [ "$1" = PASS ] || FAILED=$((FAILED + 1)); }
if [ ! -x "$OURS" ]; then result FAIL "our rping not built ($OURS)"; exit 1; fi
if [ -z "$THEIRS" ]; then result FAIL "rdma-core's rping not installed (rdmacm-utils)"; exit 1; fi

# pair NAME SERVER CLIENT COUNT SIZE
pair() {
  local name=$1 sprog=$2 cprog=$3 count=$4 size=$5 out src crc ok=1 i
  PORT=$((PORT + 1))
  T0=$(date +%s.%N)
  out=$(mktemp -d)
  echo "=== rping $name (port $PORT, -C $count -S $size)"
  timeout -k 5 120 "$sprog" -s -v -a "$ADDR" -p "$PORT" -S "$size" > "$out/server" 2> "$out/server.err" &
  local srv=$!
  # rdma_cm listeners do not show in ss: give the server a moment, then retry the client
  # while it is refused (REJECTED, reason 8)
  for i in 1 2 3 4 5 6 7 8 9 10; do
    sleep 1
    timeout -k 5 120 "$cprog" -c -v -V -a "$ADDR" -p "$PORT" -C "$count" -S "$size" > "$out/client" 2> "$out/client.err"
    crc=$?
    grep -q 'REJECTED\|rejected' "$out/client.err" || break
  done
  wait "$srv"
  src=$?
  for f in server server.err client client.err; do sed "s/^/  [$f] /" "$out/$f"; done
  [ $src = 0 ] && [ $crc = 0 ] || ok=0
  [ "$(grep -c '^ping data: rdma-ping-' "$out/client")" = "$count" ] || ok=0
  [ "$(grep -c '^server ping data: rdma-ping-' "$out/server")" = "$count" ] || ok=0
  grep -q "^ping data: rdma-ping-$((count - 1)): " "$out/client" || ok=0
  grep -q 'server DISCONNECT EVENT' "$out/server.err" || ok=0
  if [ $ok = 1 ]; then result PASS "$name"; else result FAIL "$name (server status $src, client status $crc)"; fi
  rm -rf "$out"
}

pair "rdma-core server <-> our client" "$THEIRS" "$OURS" 20 64
pair "our server <-> rdma-core client" "$OURS" "$THEIRS" 20 64
pair "ours <-> ours" "$OURS" "$OURS" 20 64
pair "rdma-core server <-> our client, -S 4096" "$THEIRS" "$OURS" 5 4096
pair "our server <-> rdma-core client, -S 26" "$OURS" "$THEIRS" 5 26
[ $FAILED = 0 ]
