#!/usr/bin/env bash
# run-in-guest.sh — run one command inside a throw-away qemu guest that has real RDMA verbs
# (Debian's kernel with Soft-RoCE / rdma_rxe), on THIS machine's root file system, shared
# read-only over virtio-9p with a tmpfs overlay (so host-built binaries run unchanged).
#
#   usage: ci/softroce/run-in-guest.sh [OPTIONS] -- CMD [ARGS...]
#          ci/softroce/run-in-guest.sh --prepare        # install + fetch + build only, no boot
#
#   --layout L      lo   : rxe0 on the guest's loopback, GID index 1 (::ffff:127.0.0.1)
#                   pair : veth0<->veth1 (MTU 9000), rxe0 on veth0, rxe1 on veth1, GID index 0
#                   all  : (default) both in one boot: the pair as rxe0/rxe1 (GID 0; the first
#                          two devices, as in `pair`) and rxe2 on lo (GID 1)
#                   none : RDMA modules loaded, no device
#   --timeout S     seconds the command may run in the guest (default 1200); the whole qemu
#                   run is killed S+120 s after it started, whatever happens
#   --mem MiB       guest memory (default 3072)      --smp N    guest vCPUs (default 2)
#   --accel A       tcg (default) or kvm
#   --keep          keep the job directory (console log, output) even on success
#   --quiet         do not stream the command's output (it is still printed on failure)
#
# The command runs as root in the guest, in the caller's current directory, with the caller's
# exported environment plus, describing the devices:
#   SOFTROCE=1 SOFTROCE_LAYOUT=<layout>
#   SOFTROCE_DEV / SOFTROCE_GID            one device + GID index to use by default
#   SOFTROCE_LO_DEV / SOFTROCE_LO_GID      (lo, all) the loopback device
#   SOFTROCE_PAIR_DEVS / SOFTROCE_PAIR_GID (pair, all) "devA devB" joined by the veth pair
# Its output is streamed; the script exits with the command's status
# (124 = timed out, 125 = the guest or the harness failed before the command could report).
#
# Cache (kernel, modules, initramfs, job directories): $FABRIC_SOFTROCE_DIR, default
# <repo>/.softroce (git-ignored). Only the needed kernel modules are kept (a few MB).
# Needs on the host (installed with apt-get when missing, as root): qemu-system-x86
# busybox-static kmod cpio iproute2 rdma-core ibverbs-providers ibverbs-utils perftest.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
REPO=$(cd "$HERE/../.." && pwd -P)
CACHE=${FABRIC_SOFTROCE_DIR:-$REPO/.softroce}
LAYOUT=all TIMEOUT=1200 MEM=3072 SMP=2 ACCEL=${SOFTROCE_ACCEL:-tcg} KEEP=0 QUIET=0 PREPARE=0
log() { echo "[softroce] $*" >&2; }
die() { log "error: $*"; exit 125; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

while (($#)); do
  case "$1" in
    --layout) LAYOUT=${2:?}; shift 2 ;;
    --timeout) TIMEOUT=${2:?}; shift 2 ;;
    --mem) MEM=${2:?}; shift 2 ;;
    --smp) SMP=${2:?}; shift 2 ;;
    --accel) ACCEL=${2:?}; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --quiet) QUIET=1; shift ;;
    --prepare) PREPARE=1; shift ;;
    -h | --help) usage ;;
    --) shift; break ;;
    -*) log "unknown option $1"; usage ;;
    *) break ;;
  esac
done
case "$LAYOUT" in lo | pair | all | none) ;; *) die "unknown layout '$LAYOUT' (lo, pair, all, none)" ;; esac
[[ $TIMEOUT =~ ^[0-9]+$ ]] || die "--timeout wants seconds, got '$TIMEOUT'"
((PREPARE)) || (($#)) || usage

# ------------------------------------------------------------------ host packages
HOST_PKGS=(qemu-system-x86 busybox-static kmod cpio iproute2 rdma-core ibverbs-providers
  ibverbs-utils perftest)
install_host_packages() {
  local need=() p
  for p in "${HOST_PKGS[@]}"; do dpkg -s "$p" > /dev/null 2>&1 || need+=("$p"); done
  ((${#need[@]})) || return 0
  log "installing ${need[*]}"
  local sudo=()
  ((EUID == 0)) || sudo=(sudo)
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
    "${need[@]}" > /dev/null
}

# ------------------------------------------------------------------ kernel + initramfs
# Modules the guest loads, in dependency order after resolution (initramfs stage 1).
# (rdma_rxe asks the crypto API for "crc32" at run time: the guest has no modprobe to find it)
# vgem: a DRM driver whose buffers export as real dma-bufs (ibverbs-safe's rxe_dmabuf test)
GUEST_MODULES=(virtio_pci 9pnet_virtio 9p overlay crc32_generic rdma_rxe ib_uverbs rdma_ucm veth vgem)

kernel_package() { # the versioned image package behind linux-image-amd64
  local p
  p=$(apt-cache depends linux-image-amd64 2> /dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  if [[ -z $p ]]; then
    local sudo=()
    ((EUID == 0)) || sudo=(sudo)
    "${sudo[@]}" apt-get update -qq > /dev/null 2>&1 || true
    p=$(apt-cache depends linux-image-amd64 2> /dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  fi
  echo "$p"
}

fetch_kernel() { # -> sets KDIR (holds vmlinuz, mods/*.ko, mods/order)
  local kpkg=${FABRIC_SOFTROCE_KPKG:-}
  [[ -n $kpkg ]] || kpkg=$(kernel_package)
  if [[ -z $kpkg ]]; then
    # offline: fall back to any kernel already in the cache
    KDIR=$(ls -d "$CACHE"/kernel/*/ 2> /dev/null | head -1)
    [[ -n $KDIR && -s $KDIR/vmlinuz ]] || die "cannot resolve linux-image-amd64 with apt-cache and no kernel is cached"
    KDIR=${KDIR%/}
    return
  fi
  KDIR=$CACHE/kernel/$kpkg
  # a cache made for another module list is rebuilt
  [[ -s $KDIR/vmlinuz && -s $KDIR/mods/order && "$(cat "$KDIR/modules.list" 2> /dev/null)" == "${GUEST_MODULES[*]}" ]] && return
  log "fetching $kpkg (unpacked into the cache, never installed on the host)"
  local tmp
  tmp=$(mktemp -d "$CACHE/kernel/.fetch.XXXXXX")
  # apt's sandbox user may not write here: that only costs a warning, silence it
  (cd "$tmp" && apt-get download -o APT::Sandbox::User=root "$kpkg" > download.log 2>&1) ||
    { cat "$tmp/download.log" >&2; rm -rf "$tmp"; die "apt-get download $kpkg failed"; }
  mkdir -p "$tmp/root"
  dpkg -x "$tmp"/*.deb "$tmp/root"
  local kver
  kver=$(ls "$tmp/root/lib/modules" | head -1)
  [[ -n $kver ]] || die "$kpkg holds no modules"
  depmod -b "$tmp/root" "$kver"
  mkdir -p "$tmp/out/mods"
  cp "$tmp/root/boot/vmlinuz-$kver" "$tmp/out/vmlinuz"
  local m ko
  for m in "${GUEST_MODULES[@]}"; do
    modprobe -d "$tmp/root" -S "$kver" --show-depends "$m" | awk '$1=="insmod"{print $2}' ||
      die "module $m not found in $kpkg"
  done | awk '!seen[$0]++' | while read -r ko; do
    cp "$ko" "$tmp/out/mods/"
    basename "$ko" >> "$tmp/out/mods/order"
  done
  [[ -s $tmp/out/mods/order ]] || die "resolving the guest modules failed"
  echo "$kver" > "$tmp/out/version"
  echo "${GUEST_MODULES[*]}" > "$tmp/out/modules.list"
  rm -rf "$KDIR"
  mv "$tmp/out" "$KDIR"
  rm -rf "$tmp" # the .deb and the 400 MB of unneeded modules
  log "kernel $kver cached in $KDIR ($(du -sh "$KDIR" | cut -f1))"
}

build_initramfs() { # -> sets INITRD
  local stamp
  stamp=$({ cat "$HERE/guest-init.sh" "$KDIR/mods/order"; } | sha256sum | cut -c1-16)
  INITRD=$KDIR/initramfs-$stamp.cpio.gz
  [[ -s $INITRD ]] && return
  local d
  d=$(mktemp -d "$KDIR/.initramfs.XXXXXX")
  mkdir -p "$d"/{bin,dev,proc,sys,newroot,lower,upper,mods}
  cp /bin/busybox "$d/bin/busybox"
  local a
  for a in sh mount umount mkdir insmod switch_root cat echo sleep; do ln -s busybox "$d/bin/$a"; done
  cp "$KDIR"/mods/* "$d/mods/"
  cp "$HERE/guest-init.sh" "$d/init"
  chmod 755 "$d/init"
  (cd "$d" && find . | cpio -o -H newc --quiet | gzip -1) > "$d.cpio.gz"
  rm -rf "$d" "$KDIR"/initramfs-*.cpio.gz
  mv "$d.cpio.gz" "$INITRD"
}

prepare() {
  install_host_packages
  mkdir -p "$CACHE/kernel" "$CACHE/jobs"
  # several runs (or worktrees sharing a cache) may prepare at once
  exec 9> "$CACHE/.lock"
  flock -w 900 9 || die "timed out waiting for the cache lock $CACHE/.lock"
  fetch_kernel
  build_initramfs
  flock -u 9
}

prepare
if ((PREPARE)); then
  log "ready: $KDIR/vmlinuz, $INITRD"
  exit 0
fi

# ------------------------------------------------------------------ one guest run
JOB=$(mktemp -d "$CACHE/jobs/job.XXXXXX")
RUN_PID= TAIL_PID=
cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  # RUN_PID is the `timeout` that owns qemu: TERM makes it pass TERM on to qemu
  if [[ -n $RUN_PID ]] && kill -0 "$RUN_PID" 2> /dev/null; then
    kill -TERM "$RUN_PID" 2> /dev/null || true
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$RUN_PID" 2> /dev/null || break; sleep 0.5; done
    local qpid
    qpid=$(cat "$JOB/qemu.pid" 2> /dev/null || true)
    if [[ -n $qpid ]]; then kill -KILL "$qpid" 2> /dev/null || true; fi
    kill -KILL "$RUN_PID" 2> /dev/null || true
  fi
  if [[ -n $TAIL_PID ]]; then kill "$TAIL_PID" 2> /dev/null || true; fi
  if ((KEEP == 0 && rc == 0)); then rm -rf "$JOB"; fi
  exit "$rc"
}
trap cleanup EXIT
trap 'log "interrupted"; exit 130' INT
trap 'log "terminated"; exit 143' TERM HUP

# The command: the caller's environment and directory, the device description, then CMD.
{
  export -p | grep -vE '^declare -x (PWD|OLDPWD|SHLVL|_|HOSTNAME|TERM|SSH_[A-Z_]*)(=|$)' || true
  echo "export SOFTROCE=1 SOFTROCE_LAYOUT=$LAYOUT"
  case "$LAYOUT" in
    lo) echo "export SOFTROCE_DEV=rxe0 SOFTROCE_GID=1 SOFTROCE_LO_DEV=rxe0 SOFTROCE_LO_GID=1" ;;
    pair) echo "export SOFTROCE_DEV=rxe0 SOFTROCE_GID=0 SOFTROCE_PAIR_DEVS='rxe0 rxe1' SOFTROCE_PAIR_GID=0" ;;
    all) echo "export SOFTROCE_DEV=rxe0 SOFTROCE_GID=0 SOFTROCE_LO_DEV=rxe2 SOFTROCE_LO_GID=1 SOFTROCE_PAIR_DEVS='rxe0 rxe1' SOFTROCE_PAIR_GID=0" ;;
  esac
  printf 'cd %q || exit 126\n' "$PWD"
  printf 'exec'
  printf ' %q' "$@"
  printf '\n'
} > "$JOB/cmd.sh"
echo "$LAYOUT" > "$JOB/layout"
echo "$TIMEOUT" > "$JOB/timeout"
: > "$JOB/output.log"

case "$ACCEL" in
  kvm) ACCEL_ARGS=(-enable-kvm -cpu host) ;;
  tcg) ACCEL_ARGS=(-accel tcg,thread=multi -cpu max) ;;
  *) die "unknown accelerator '$ACCEL' (tcg, kvm)" ;;
esac
HOST_LIMIT=$((TIMEOUT + 120))
t0=$(date +%s.%N)
# whatever happens in the guest, qemu does not outlive HOST_LIMIT
timeout -s KILL "$HOST_LIMIT" qemu-system-x86_64 "${ACCEL_ARGS[@]}" -m "$MEM" -smp "$SMP" \
  -display none -monitor none -serial "file:$JOB/console.log" -no-reboot -nic none \
  -pidfile "$JOB/qemu.pid" -kernel "$KDIR/vmlinuz" -initrd "$INITRD" \
  -append "console=ttyS0 loglevel=4 panic=-1 softroce.stage2=$HERE/guest-stage2.sh" \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
  -virtfs "local,path=$JOB,mount_tag=srjob,security_model=none" \
  < /dev/null > "$JOB/qemu.log" 2>&1 &
RUN_PID=$!
if ((QUIET == 0)); then
  tail -n +1 -F -s 0.2 --pid="$RUN_PID" "$JOB/output.log" 2> /dev/null &
  TAIL_PID=$!
fi
set +e
wait "$RUN_PID"
qrc=$?
set -e
RUN_PID=
if [[ -n $TAIL_PID ]]; then wait "$TAIL_PID" 2> /dev/null || true; TAIL_PID=; fi
wall=$(awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN{printf "%.1f", a-b}')
ready=$(sed -n 's/.*softroce-guest: ready at uptime \([0-9.]*\)s.*/\1/p' "$JOB/console.log" | head -1)

failure_details() {
  if ((QUIET)); then log "command output:"; cat "$JOB/output.log" >&2; fi
  if [[ -s $JOB/setup.log ]]; then log "RDMA setup log:"; sed 's/^/  /' "$JOB/setup.log" >&2; fi
  if [[ -s $JOB/dmesg.log ]]; then log "guest kernel log (tail):"; sed 's/^/  /' "$JOB/dmesg.log" >&2; fi
  log "guest console (tail):"
  tail -n 25 "$JOB/console.log" | sed 's/^/  /' >&2
  if [[ -s $JOB/qemu.log ]]; then log "qemu:"; sed 's/^/  /' "$JOB/qemu.log" >&2; fi
  log "job directory kept: $JOB"
}
if [[ -f $JOB/rc ]]; then
  rc=$(cat "$JOB/rc")
  case "$rc" in
    0) ;;
    124 | 137) log "the command timed out after ${TIMEOUT}s in the guest" ;;
    125) log "the guest failed before running the command" ;;
    *) log "the command failed with status $rc" ;;
  esac
elif ((qrc == 137)); then
  rc=124
  log "qemu killed after ${HOST_LIMIT}s: the guest never reported"
else
  rc=125
  log "the guest powered off without reporting a status (qemu status $qrc)"
fi
log "layout $LAYOUT: guest ready at ${ready:-?}s (guest uptime), status $rc, wall ${wall}s"
((rc == 0)) || failure_details
exit "$rc"
