#!/usr/bin/env bash
# Prints an include directory that holds a newer rdma-core's infiniband/verbs.h than the
# installed one: Debian trixie's libibverbs-dev, downloaded with apt and unpacked (not
# installed). For the layout checks: FABRIC_VERBS_INCLUDE=$(ci/newer-verbs-headers.sh).
# apt runs on a private state directory ($1, default $TMPDIR/fabric-newer-verbs): the
# system's sources, package lists and package database are not touched.
set -euo pipefail
dir=${1:-${TMPDIR:-/tmp}/fabric-newer-verbs}
suite=${FABRIC_NEWER_VERBS_SUITE:-trixie}
mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial" "$dir/deb"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main" \
  > "$dir/sources.list"
opts=(-o "Dir::Etc::sourcelist=$dir/sources.list" -o "Dir::Etc::sourceparts=-"
      -o "Dir::State::Lists=$dir/lists" -o "Dir::Cache=$dir/cache" -o "APT::Sandbox::User=root")
apt-get "${opts[@]}" -qq update >&2
rm -rf "$dir/deb" && mkdir -p "$dir/deb"
(cd "$dir/deb" && apt-get "${opts[@]}" -qq download "libibverbs-dev/$suite" >&2)
dpkg-deb -x "$dir"/deb/libibverbs-dev_*.deb "$dir/deb/root"
test -f "$dir/deb/root/usr/include/infiniband/verbs.h"
echo "[newer-verbs-headers] $(basename "$dir"/deb/libibverbs-dev_*.deb)" >&2
echo "$dir/deb/root/usr/include"
