#!/usr/bin/env bash
# Hardening jobs run by .ci/run after the host tests and the Soft-RoCE suite:
#   1. loom models      (--cfg fabric_loom / ibverbs_loom / nvlink_loom, LOOM_MAX_PREEMPTIONS)
#   2. cargo-fuzz       (every target in fuzz/fuzz_targets/ for a fixed time; executions printed)
#   3. Miri             (the pure-Rust unsafe code: rings, pools, buffer types, in-flight tracker)
#   4. AddressSanitizer + LeakSanitizer over the cross-process shm/tcp and fd-passing tests
# Every job is bounded by `timeout`; the whole script is meant to fit in ~25 minutes on 2 cores
# including builds. All jobs run even if one fails; the script fails if any job failed.
# A job that ran nothing fails too: no loom models, no fuzz targets (or a target that executed
# no input), an empty Miri/ASan list, a cargo test step that ran zero tests, and a test filter
# that matched no test that ran (`check_ran`, applied to every test step).
#
# Knobs (environment):
#   HARDENING_JOBS          which jobs to run (default "loom fuzz miri asan")
#   LOOM_MAX_PREEMPTIONS    loom preemption bound (default 3)
#   FUZZ_SECONDS            seconds per fuzz target (default 60)
#   FUZZ_TOTAL_SECONDS      cap on all fuzzing together; per-target time shrinks to fit (default 600)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
export CARGO_TERM_COLOR=never CARGO_INCREMENTAL=0

jobs=${HARDENING_JOBS:-loom fuzz miri asan}
export LOOM_MAX_PREEMPTIONS=${LOOM_MAX_PREEMPTIONS:-3}
fuzz_seconds=${FUZZ_SECONDS:-60}
fuzz_total=${FUZZ_TOTAL_SECONDS:-600}
nightly=nightly
host_triple=x86_64-unknown-linux-gnu

start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }
say() { echo "[hardening $(elapsed)s] $*"; }
failures=()
summary=()
logdir=$(mktemp -d "${TMPDIR:-/tmp}/hardening.XXXXXX")

# run_step NAME SECONDS CMD... : run CMD under a timeout, record pass/fail, never abort the script.
# Its output is also kept in $step_log (for check_ran).
step_n=0
step_log=
run_step() {
  local name=$1 secs=$2
  shift 2
  local t0 rc=0
  t0=$(date +%s)
  step_n=$((step_n + 1))
  step_log="$logdir/step-$step_n.log"
  say "step '$name' (limit ${secs}s): $*"
  set +e
  timeout --kill-after=30 "$secs" "$@" 2>&1 | tee "$step_log"
  rc=${PIPESTATUS[0]}
  set -e
  local took=$(($(date +%s) - t0))
  if ((rc == 124 || rc == 137)); then
    failures+=("$name: timed out after ${secs}s")
    summary+=("FAIL  $name (timeout ${secs}s)")
  elif ((rc != 0)); then
    failures+=("$name: exit status $rc")
    summary+=("FAIL  $name (${took}s, exit $rc)")
  else
    summary+=("ok    $name (${took}s)")
  fi
  return 0
}

has_job() { [[ " $jobs " == *" $1 "* ]]; }

# ran_nothing NAME WHY : record a job or step that ran nothing as a failure.
ran_nothing() {
  say "FAIL: $1 ran nothing: $2"
  failures+=("$1: ran nothing ($2)")
  summary+=("FAIL  $1 (ran nothing: $2)")
}

# check_ran NAME [LIBTEST ARGS...] : after a `cargo test` step, fail it when it ran no test, or
# when a name filter among the libtest ARGS matched no test that ran (a renamed or deleted test
# would otherwise leave its line here checking nothing). Arguments of --skip and other options
# are not filters. Reads $step_log ("test NAME ... ok|FAILED" and "test result:" lines).
check_ran() {
  local name=$1
  shift
  local ran names f opt=""
  ran=$(sed -nE 's/^test result: [A-Za-z]+\. ([0-9]+) passed; ([0-9]+) failed.*/\1 \2/p' "$step_log" |
    awk '{ n += $1 + $2 } END { print n + 0 }')
  if ((ran == 0)); then
    ran_nothing "$name" "no test ran"
    return 0
  fi
  names=$(grep -vE '^test [^ ]+ \.\.\. ignored' "$step_log" | sed -nE 's/^test ([^ ]+) \.\.\. .*/\1/p' || true)
  for f in "$@"; do
    if [[ -n $opt ]]; then opt=""; continue; fi
    case "$f" in
      --skip) opt=1; continue ;;
      -*) continue ;;
    esac
    grep -qF -- "$f" <<<"$names" || ran_nothing "$name" "the filter '$f' matched no test"
  done
  say "$name: $ran tests ran"
}

# ---------------------------------------------------------------------------------------------
# toolchain: nightly with miri + rust-src (idempotent), cargo-fuzz (no-op when installed)
# ---------------------------------------------------------------------------------------------
need_nightly=0
for j in fuzz miri asan; do has_job "$j" && need_nightly=1; done
if ((need_nightly)); then
  if ! rustup toolchain list | grep -q "^$nightly"; then
    say "installing the nightly toolchain"
    rustup toolchain install "$nightly" --profile minimal ||
      { echo "error: cannot install the Rust nightly toolchain (needed for cargo-fuzz, Miri and -Zsanitizer); check rustup's network access" >&2; exit 1; }
  fi
  rustup component add miri rust-src --toolchain "$nightly" >/dev/null 2>&1 ||
    { echo "error: 'rustup component add miri rust-src --toolchain $nightly' failed; Miri and the sanitizer job need them. Try it by hand to see why (network, or this nightly lacks miri: pick a nightly that has it)" >&2; exit 1; }
fi
if has_job fuzz && ! cargo fuzz --version >/dev/null 2>&1; then
  say "installing cargo-fuzz"
  timeout 900 cargo install cargo-fuzz --locked ||
    { echo "error: 'cargo install cargo-fuzz --locked' failed; the fuzz job needs it" >&2; exit 1; }
fi

# ---------------------------------------------------------------------------------------------
# 1. loom: every `<crate>/tests/loom_*.rs` and every lib test whose path contains `loom`,
#    built with the crate's own cfg in a separate target dir (RUSTFLAGS would otherwise
#    invalidate the main build).
# ---------------------------------------------------------------------------------------------
if has_job loom; then
  say "== loom (LOOM_MAX_PREEMPTIONS=$LOOM_MAX_PREEMPTIONS)"
  loom_found=0
  for pair in fabric-core:fabric_loom ibverbs-safe:ibverbs_loom nvlink-p2p:nvlink_loom; do
    crate=${pair%%:*} cfg=${pair#*:}
    args=()
    for f in "$crate"/tests/loom_*.rs; do
      [ -e "$f" ] || continue
      args+=(--test "$(basename "$f" .rs)")
    done
    lib_loom=0
    if grep -rqs "cfg($cfg)" "$crate/src" && grep -rqsE "fn loom_|mod loom" "$crate/src"; then
      lib_loom=1
    fi
    if ((${#args[@]})); then
      loom_found=1
      RUSTFLAGS="--cfg $cfg" run_step "loom $crate ${args[*]}" 900 \
        cargo test --release --target-dir target/loom -p "$crate" "${args[@]}"
      check_ran "loom $crate ${args[*]}"
    fi
    if ((lib_loom)); then
      loom_found=1
      RUSTFLAGS="--cfg $cfg" run_step "loom $crate --lib" 900 \
        cargo test --release --target-dir target/loom -p "$crate" --lib -- loom
      check_ran "loom $crate --lib" loom
    fi
  done
  ((loom_found)) || ran_nothing loom "no loom models found (no */tests/loom_*.rs, no lib loom tests)"
fi

# ---------------------------------------------------------------------------------------------
# 2. cargo-fuzz: each target for a fixed time, seeded from fuzz/corpus/<target>/ (read only:
#    new inputs go to a scratch dir so CI leaves the clone clean); a crash fails the job and
#    its reproducer is kept under fuzz/artifacts/<target>/.
# ---------------------------------------------------------------------------------------------
if has_job fuzz; then
  say "== fuzz"
  mapfile -t targets < <(cargo +"$nightly" fuzz list --fuzz-dir fuzz 2>/dev/null || true)
  if ((${#targets[@]} == 0)); then
    ran_nothing fuzz "no fuzz targets listed by 'cargo fuzz list' (fuzz/fuzz_targets/)"
  else
    per=$fuzz_seconds
    ((fuzz_total / ${#targets[@]} < per)) && per=$((fuzz_total / ${#targets[@]}))
    ((per < 5)) && per=5
    say "fuzz: ${#targets[@]} targets x ${per}s: ${targets[*]}"
    # One build for all targets (ASan + coverage, debug assertions on so overflows are found).
    run_step "fuzz build" 1200 cargo +"$nightly" fuzz build --fuzz-dir fuzz -a
    for t in "${targets[@]}"; do
      work="$logdir/corpus-$t"
      mkdir -p "$work" "fuzz/corpus/$t"
      log="$logdir/fuzz-$t.log"
      run_step "fuzz $t" $((per + 240)) bash -c '
        cargo +"$1" fuzz run --fuzz-dir fuzz -a "$2" "$3" "fuzz/corpus/$2" -- \
          -max_total_time="$4" -print_final_stats=1 -rss_limit_mb=2048 -timeout=10 >"$5" 2>&1
        rc=$?; tail -n 40 "$5"; exit $rc' _ "$nightly" "$t" "$work" "$per" "$log"
      execs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -Eo '[0-9]+$' | tail -n1 || true)
      [ -n "$execs" ] || execs=$(grep -Eo 'Done [0-9]+ runs' "$log" | grep -Eo '[0-9]+' | tail -n1 || true)
      summary+=("      fuzz $t: ${execs:-?} executions in ${per}s")
      [[ ${execs:-0} =~ ^[0-9]+$ ]] && ((execs > 0)) || ran_nothing "fuzz $t" "no executions reported"
    done
  fi
fi

# ---------------------------------------------------------------------------------------------
# 3. Miri: tests of the pure-Rust unsafe code. Each entry: "<crate>|<cargo test selectors>|<filters>".
#    Tests that make syscalls Miri cannot emulate (sockets, memfd, fork, dlopen) stay out of these
#    filters or carry #[cfg_attr(miri, ignore)].
# ---------------------------------------------------------------------------------------------
miri_jobs=(
  # the SPSC ring (raw pointers into shared memory) and the in-flight tracker; the two long
  # deterministic simulations are skipped here (minutes under Miri; they run in the host tests)
  "fabric-core|--lib|ring:: tracker:: --skip push_peek_consume_in_order_with_wrap --skip simulation_every_buffer_returns_exactly_once"
  "fabric-core|--test ring_small|"
  # ibverbs-safe: the work-queue slot table (wr_id = slot pointer), owned buffers, MR copies
  "ibverbs-safe|--lib|inflight:: buffer:: mr::tests::copies_in_and_out_at_any_alignment mr::tests::ranges_are_checked"
  # ibverbs-safe on the fake provider (src/fake.rs): scopes, completions, slot tables,
  # deregistration and context checks through the normal code paths, no FFI; the tests that
  # leak by design (a panicking drop) are #[cfg_attr(miri, ignore)]
  "ibverbs-safe|--lib|fault_tests::"
)
if has_job miri; then
  say "== miri"
  if ((${#miri_jobs[@]} == 0)); then
    ran_nothing miri "no Miri test sets configured"
  else
    # Isolation off: the code under test reads the clock and getrandom for keys and nonces.
    export MIRIFLAGS="${MIRIFLAGS:--Zmiri-disable-isolation}"
    run_step "miri setup" 600 cargo +"$nightly" miri setup
    for entry in "${miri_jobs[@]}"; do
      IFS='|' read -r crate sel filt <<<"$entry"
      # shellcheck disable=SC2086
      run_step "miri $crate $sel $filt" 900 cargo +"$nightly" miri test -p "$crate" $sel -- $filt
      # shellcheck disable=SC2086
      check_ran "miri $crate $sel $filt" $filt
    done
  fi
fi

# ---------------------------------------------------------------------------------------------
# 4. AddressSanitizer + LeakSanitizer: cross-process shm/tcp tests and fd passing. Reports from
#    any process (also re-exec'd children) land in $logdir/asan.*; any report fails the job.
#    Entries: "<crate>|<cargo test selectors>|<filters>".
# ---------------------------------------------------------------------------------------------
asan_jobs=(
  # fabric-core: shm/tcp cross-process suites (peer killed, fd/mapping counts), bootstrap
  "fabric|--test fabric_transport|"
  "fabric|--test fabric_bootstrap|"
  "fabric|--test bad_input_transport|"
  "fabric|--test fabric_shm_control|"
  "fabric-core|--lib|"
  # nvlink-p2p: SCM_RIGHTS / pidfd fd passing between processes
  "nvlink-p2p|--test fd_passing|"
)
if has_job asan; then
  say "== asan"
  if ((${#asan_jobs[@]} == 0)); then
    ran_nothing asan "no sanitizer test sets configured"
  else
    asan_logs="$logdir/asan-reports"
    mkdir -p "$asan_logs"
    for entry in "${asan_jobs[@]}"; do
      IFS='|' read -r crate sel filt <<<"$entry"
      # shellcheck disable=SC2086
      # FABRIC_SANITIZER: tests skip /proc/self/maps growth checks (ASan maps memory itself).
      FABRIC_SANITIZER=address \
      RUSTFLAGS="-Zsanitizer=address -Cforce-frame-pointers=yes" RUSTDOCFLAGS="-Zsanitizer=address" \
        ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:log_path=$asan_logs/asan" \
        LSAN_OPTIONS="" \
        run_step "asan $crate $sel $filt" 1200 \
        cargo +"$nightly" test --target "$host_triple" --target-dir target/asan -p "$crate" $sel -- $filt
      # shellcheck disable=SC2086
      check_ran "asan $crate $sel $filt" $filt
    done
    if compgen -G "$asan_logs/asan*" >/dev/null; then
      say "asan: sanitizer reports:"
      cat "$asan_logs"/asan*
      failures+=("asan: sanitizer reported problems (above)")
      summary+=("FAIL  asan reports")
    fi
  fi
fi

echo
say "summary (total wall time $(elapsed)s):"
printf '  %s\n' "${summary[@]}"
if ((${#failures[@]})); then
  echo "hardening FAILED:" >&2
  printf '  %s\n' "${failures[@]}" >&2
  exit 1
fi
say "all hardening jobs passed"
