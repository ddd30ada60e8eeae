#!/usr/bin/env bash
# suite.sh — the real-verbs suite: builds the workspace's test executables and examples on
# the host, boots ONE Soft-RoCE guest (rxe0 on lo + rxe1/rxe2 on a veth pair) and runs them
# all there, plus the ibv_rc_pingpong interop pairings (guest-suite.sh). Exits non-zero when
# anything fails. Run by .ci/run after the host tests; runs locally the same way:
#
#   ci/softroce/suite.sh                 # whole suite
#   ci/softroce/suite.sh verbs_pingpong  # only test executables whose name contains a filter
#
# FLAKY history: a test executable that failed once and then passed (guest-suite.sh) is
# recorded in $FABRIC_SOFTROCE_DIR/flaky-history (default .softroce/, git-ignored); when its
# previous recorded run on this machine was FLAKY too, this run fails. A fresh machine has no
# history: there "twice in a row" is judged within the run (guest-suite.sh). With
# FABRIC_CI_NOTES set (.ci/run), the FLAKY count and the "unverified" lines are appended to
# that file for CI's closing summary.
#
# Knobs: SOFTROCE_SUITE_SKIP (package directories whose tests do not run in the guest;
# default "nvlink-p2p ffi-check": GPU tests, host-only header checks), SOFTROCE_FEATURE_BUILDS
# (test targets that need cargo features; default "ibverbs-safe:tokio"),
# SOFTROCE_SUITE_TIMEOUT (guest seconds, default 1500),
# SOFTROCE_STEP_TIMEOUT (per test executable, default 600), SOFTROCE_TEST_THREADS (default 1).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
cd "$HERE/../.."
log() { echo "[softroce-suite] $*" >&2; }
t0=$(date +%s)

# The same build as `cargo test --workspace` (what .ci/run ran just before: nothing is
# rebuilt). nvlink-p2p's tests need a GPU, never present in the guest; they ran on the host,
# as did ffi-check's (a header check that needs no device).
read -r -a SKIP <<< "${SOFTROCE_SUITE_SKIP:-nvlink-p2p ffi-check}"

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
history=${FABRIC_SOFTROCE_DIR:-$PWD/.softroce}/flaky-history
# the executables whose latest recorded run was FLAKY (lines: date TAB commit TAB ran TAB flaky)
SOFTROCE_FLAKY_BEFORE=$(awk -F'\t' '{ n = split($3, r, " "); for (i = 1; i <= n; i++) last[r[i]] = 0
  n = split($4, f, " "); for (i = 1; i <= n; i++) last[f[i]] = 1 }
  END { for (k in last) if (last[k]) printf "%s ", k }' "$history" 2>/dev/null || true)
export SOFTROCE_FLAKY_BEFORE
if [ -s "$history" ]; then
  log "FLAKY in their previous recorded run here: ${SOFTROCE_FLAKY_BEFORE:-none} ($history)"
else
  log "no FLAKY history on this machine ($history): 'FLAKY twice in a row' is judged within this run"
fi
log "host part done in $(($(date +%s) - t0)) s; booting the guest"
out=$(mktemp)
trap 'rm -f "$list" "$prep_log" "$out"' EXIT
rc=0
"$HERE/run-in-guest.sh" --layout all --timeout "${SOFTROCE_SUITE_TIMEOUT:-1500}" -- \
  "$HERE/guest-suite.sh" "$list" "$target/debug/examples" 2>&1 | tee "$out" || rc=${PIPESTATUS[0]}
ran=$(sed -n 's/^softroce-suite-ran: *//p' "$out" | tail -n 1)
flaky=$(sed -n 's/^softroce-suite-flaky: *//p' "$out" | tail -n 1)
if [ -n "$ran" ]; then
  mkdir -p "$(dirname "$history")"
  printf '%s\t%s\t%s\t%s\n' "$(date -u +%FT%TZ)" "$(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
    "$ran" "$flaky" >> "$history"
fi
if [ -n "${FABRIC_CI_NOTES:-}" ]; then
  {
    grep -E '^FLAKY: [0-9]+' "$out" | tail -n 1 | sed 's/^/soft-roce suite: /' || true
    grep -E '^  [^ ]+: unverified:' "$out" | sed 's/^  /soft-roce suite: /' || true
  } >> "$FABRIC_CI_NOTES"
fi
log "finished in $(($(date +%s) - t0)) s with status $rc${flaky:+; FLAKY: $flaky}"
exit "$rc"
