#!/usr/bin/env bash
# suite.sh — the real-verbs suite: builds the workspace's test executables and examples on
# the host, boots ONE Soft-RoCE guest (rxe0 on lo + rxe1/rxe2 on a veth pair) and runs them
# all there, plus the ibv_rc_pingpong interop pairings (guest-suite.sh). Exits non-zero when
# anything fails. Run by .ci/run after the host tests; runs locally the same way:
#
#   ci/softroce/suite.sh                 # whole suite
#   ci/softroce/suite.sh verbs_pingpong  # only test executables whose name contains a filter
#
# Knobs: SOFTROCE_SUITE_SKIP (package directories whose tests do not run in the guest;
# default "nvlink-p2p": GPU tests), SOFTROCE_FEATURE_BUILDS (test targets that need cargo
# features; default "ibverbs-safe:tokio"), SOFTROCE_SUITE_TIMEOUT (guest seconds, default 1500),
# SOFTROCE_STEP_TIMEOUT (per test executable, default 600), SOFTROCE_TEST_THREADS (default 1).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
cd "$HERE/../.."
log() { echo "[softroce-suite] $*" >&2; }
t0=$(date +%s)

# The same build as `cargo test --workspace` (what .ci/run ran just before: nothing is
# rebuilt). nvlink-p2p's tests need a GPU, never present in the guest; they ran on the host.
read -r -a SKIP <<< "${SOFTROCE_SUITE_SKIP:-nvlink-p2p}"

# fetch the kernel and build the initramfs while cargo builds
prep_log=$(mktemp)
"$HERE/run-in-guest.sh" --prepare > "$prep_log" 2>&1 &
prep_pid=$!

log "building test executables and examples (cargo test --workspace --no-run)"
list=$(mktemp)
trap 'rm -f "$list" "$prep_log"' EXIT
# one line per test executable: <package directory> TAB <executable> (cargo runs tests in
# their package's directory; the guest does the same)
# (cargo test also builds the examples as plain programs: keep only test harnesses)
cargo test --workspace --no-run --message-format=json-render-diagnostics |
  grep '"profile":{[^}]*"test":true' |
  sed -n 's|.*"manifest_path":"\([^"]*\)/Cargo.toml".*"executable":"\([^"]*\)".*|\1\t\2|p' |
  sort -u > "$list.all"
# Test targets declared with `required-features` are not built by the plain build: build
# each package with its features (SOFTROCE_FEATURE_BUILDS, "package:feature,feature ...")
# and add the executables of targets the plain build lacks (by target name; the others
# already ran above, without the features).
exe_name() { sed 's|.*/||; s|-[0-9a-f]\{16\}$||'; }
for fb in ${SOFTROCE_FEATURE_BUILDS-ibverbs-safe:tokio}; do
  log "building test executables of ${fb%%:*} with features ${fb#*:}"
  cargo test -p "${fb%%:*}" --features "${fb#*:}" --no-run --message-format=json-render-diagnostics |
    grep '"profile":{[^}]*"test":true' |
    sed -n 's|.*"manifest_path":"\([^"]*\)/Cargo.toml".*"executable":"\([^"]*\)".*|\1\t\2|p' |
    sort -u > "$list.feat"
  cut -f2 "$list.all" | exe_name | sort -u > "$list.names"
  while IFS=$'\t' read -r dir exe; do
    if ! grep -qxF "$(exe_name <<< "$exe")" "$list.names"; then
      printf '%s\t%s\n' "$dir" "$exe" >> "$list.all"
    fi
  done < "$list.feat"
done
rm -f "$list.feat" "$list.names"
for d in "${SKIP[@]}"; do
  grep -v "/$d"$'\t' "$list.all" > "$list.f" || true
  mv "$list.f" "$list.all"
done
mv "$list.all" "$list"
cargo build --workspace --examples
target=$(cargo metadata --no-deps --format-version 1 | grep -o '"target_directory":"[^"]*"' | cut -d'"' -f4)
if (($#)); then
  pattern=$(printf '%s\n' "$@")
  grep -F "$pattern" "$list" > "$list.f" || true
  mv "$list.f" "$list"
fi
log "$(wc -l < "$list") test executables:"
sed 's|.*/||; s/^/  /' "$list" >&2

if ! wait "$prep_pid"; then
  cat "$prep_log" >&2
  log "preparing the guest failed"
  exit 125
fi
cat "$prep_log" >&2
log "host part done in $(($(date +%s) - t0)) s; booting the guest"
rc=0
"$HERE/run-in-guest.sh" --layout all --timeout "${SOFTROCE_SUITE_TIMEOUT:-1500}" -- \
  "$HERE/guest-suite.sh" "$list" "$target/debug/examples" || rc=$?
log "finished in $(($(date +%s) - t0)) s with status $rc"
exit "$rc"
