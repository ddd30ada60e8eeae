#!/usr/bin/env bash
# regen-corpus.sh — regenerate a fuzz target's seed corpus after its input layout changed
# (an `Arbitrary` input such as tracker_ops' `Op` decodes old seeds as different programs):
# fuzz from nothing for SECONDS, then minimize what was found into fuzz/corpus/TARGET
# (the old seeds are replaced). Needs nightly and cargo-fuzz, as ci/hardening.sh does.
#
#   fuzz/regen-corpus.sh tracker_ops        # 120 s
#   fuzz/regen-corpus.sh tracker_ops 600
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
target=${1:?usage: fuzz/regen-corpus.sh TARGET [SECONDS]}
secs=${2:-120}
nightly=${FABRIC_NIGHTLY:-nightly}
# Build flags of cargo fuzz (default: debug assertions, as ci/hardening.sh builds).
read -r -a flags <<< "${FUZZ_BUILD_FLAGS--a}"
[ -f "fuzz/fuzz_targets/$target.rs" ] || { echo "no fuzz target $target" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/found" "$work/min"
cargo +"$nightly" fuzz run --fuzz-dir fuzz "${flags[@]}" "$target" "$work/found" -- \
  -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
  >"$work/run.log" 2>&1 || { tail -n 40 "$work/run.log" >&2; exit 1; }
found=$(find "$work/found" -type f | wc -l)
# -merge=1 into an empty directory keeps a minimal subset with the same coverage.
cargo +"$nightly" fuzz run --fuzz-dir fuzz "${flags[@]}" "$target" "$work/min" "$work/found" -- \
  -merge=1 >"$work/merge.log" 2>&1 || { tail -n 40 "$work/merge.log" >&2; exit 1; }
kept=$(find "$work/min" -type f | wc -l)
((kept > 0)) || { echo "no seeds kept for $target" >&2; exit 1; }
rm -rf "fuzz/corpus/$target"
mkdir -p "fuzz/corpus/$target"
cp "$work/min"/* "fuzz/corpus/$target/"
echo "$target: $found inputs found in ${secs}s, $kept kept in fuzz/corpus/$target"
