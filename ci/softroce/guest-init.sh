#!/bin/sh
# Stage 1 of the Soft-RoCE guest: PID 1 inside the initramfs (busybox only).
# Loads every kernel module the guest needs (virtio/9p/overlay to reach the host's root
# file system, then the RDMA stack), mounts the host root read-only over virtio-9p with a
# tmpfs overlay on top, mounts the job directory at /sr-job and hands PID 1 over to stage 2
# (ci/softroce/guest-stage2.sh, read from the host tree so editing it needs no rebuild).
# Built into the initramfs by run-in-guest.sh; not meant to run anywhere else.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
fail() {
  echo "softroce-init: $*"
  echo "softroce-init: powering off"
  echo o > /proc/sysrq-trigger
  sleep 30
}
while read -r m; do
  insmod "/mods/$m" || echo "softroce-init: insmod $m failed"
done < /mods/order
STAGE2=
for a in $(cat /proc/cmdline); do
  case "$a" in softroce.stage2=*) STAGE2=${a#softroce.stage2=} ;; esac
done
[ -n "$STAGE2" ] || fail "no softroce.stage2= on the kernel command line"
O=trans=virtio,version=9p2000.L,msize=512000
mount -t 9p -o "$O,ro,cache=loose" hostroot /lower || fail "mounting the host root (9p) failed"
mount -t tmpfs -o mode=755 tmpfs /upper || fail "tmpfs for the overlay failed"
mkdir -p /upper/u /upper/w
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w /newroot \
  || fail "overlay mount failed"
mkdir -p /newroot/sr-job
mount -t 9p -o "$O,cache=none" srjob /newroot/sr-job || fail "mounting the job directory (9p) failed"
[ -f "/newroot$STAGE2" ] || fail "stage 2 script $STAGE2 not visible in the guest"
umount /sys
umount /proc
exec switch_root /newroot /bin/sh "$STAGE2"
