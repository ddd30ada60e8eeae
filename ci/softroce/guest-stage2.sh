#!/bin/sh
# Stage 2 of the Soft-RoCE guest: PID 1 on the (overlaid, read-only) host root.
# Creates the rxe devices of the requested layout, runs /sr-job/cmd.sh under a timeout with
# its output in /sr-job/output.log (the host streams it), records the exit status in
# /sr-job/rc and powers the guest off. Started by guest-init.sh; not meant to run elsewhere.
#
# Layouts (also exported to the command, see run-in-guest.sh):
#   lo    rxe0 on lo                                   GID index 1 = ::ffff:127.0.0.1
#   pair  rxe0 on veth0, rxe1 on veth1 (MTU 9000)      GID index 0 = fe80:: link-local
#   all   pair (rxe0, rxe1: the first two devices, GID 0) + rxe2 on lo (GID 1)
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
J=/sr-job
say() { echo "softroce-guest: $*"; }
poweroff_now() {
  sync
  echo o > /proc/sysrq-trigger
  sleep 60
}
finish() { # rc
  echo "$1" > "$J/rc.tmp" && mv "$J/rc.tmp" "$J/rc"
  say "job exit $1 at uptime $(cut -d' ' -f1 /proc/uptime)s"
  poweroff_now
}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mountpoint -q /dev || mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
echo 1 > /proc/sys/kernel/sysrq

LAYOUT=$(cat "$J/layout" 2>/dev/null || echo lo)
TIMEOUT=$(cat "$J/timeout" 2>/dev/null || echo 1200)

wait_gid() { # dev index: wait (max 10 s) until that GID table entry is set
  i=0
  while [ $i -lt 100 ]; do
    g=$(cat "/sys/class/infiniband/$1/ports/1/gids/$2" 2>/dev/null)
    case "$g" in
      "" | 0000:0000:0000:0000:0000:0000:0000:0000) sleep 0.1; i=$((i + 1)) ;;
      *) return 0 ;;
    esac
  done
  echo "GID $2 of $1 never appeared"
  return 1
}
add_pair() { # first-dev second-dev
  ip link add veth0 mtu 9000 type veth peer name veth1 mtu 9000 &&
  # guest-internal address (qemu has no NIC) so that rdma_cm can resolve veth0's rxe
  ip addr add 10.77.0.1/24 dev veth0 &&
  ip link set veth0 up && ip link set veth1 up &&
  rdma link add "$1" type rxe netdev veth0 &&
  rdma link add "$2" type rxe netdev veth1 &&
  wait_gid "$1" 0 && wait_gid "$2" 0
}
setup_rdma() {
  ip link set lo up || return 1
  case "$LAYOUT" in
    lo)   rdma link add rxe0 type rxe netdev lo && wait_gid rxe0 1 ;;
    pair) add_pair rxe0 rxe1 ;;
    all)  add_pair rxe0 rxe1 && rdma link add rxe2 type rxe netdev lo && wait_gid rxe2 1 ;;
    none) true ;;
    *)    echo "unknown layout $LAYOUT"; return 1 ;;
  esac || return 1
  # the devices' user-space nodes appear only after `rdma link add`
  case "$LAYOUT" in
    none) true ;;
    *) i=0; while [ ! -e /dev/infiniband/uverbs0 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
       [ -e /dev/infiniband/uverbs0 ] || { echo "/dev/infiniband/uverbs0 never appeared"; return 1; } ;;
  esac
  rdma link show
}
if ! setup_rdma > "$J/setup.log" 2>&1; then
  say "RDMA setup for layout '$LAYOUT' failed (see setup.log)"
  dmesg | tail -n 30 > "$J/dmesg.log"
  finish 125
fi
ulimit -l unlimited
say "ready at uptime $(cut -d' ' -f1 /proc/uptime)s, layout $LAYOUT"
# timeout runs the command in its own process group and signals the whole group on expiry,
# so background servers the command started go down with it.
timeout -k 10 "$TIMEOUT" /bin/bash "$J/cmd.sh" > "$J/output.log" 2>&1 < /dev/null
rc=$?
[ $rc = 0 ] || dmesg | tail -n 30 > "$J/dmesg.log"
finish $rc
