#!/usr/bin/env bash
# The whole tidal test suite, from a fresh Debian 12 machine (installs what is
# missing first: scripts/deps.sh). Three tiers:
#   scripts/test.sh           what CI runs (.ci/run): every test of the main build, the
#                             soak tests at a size that fits the budget; ASan+UBSan on
#                             every test but the soaks (fault sweeps at a 3x stride);
#                             TSan on the concurrency tests; the fuzzers. <= 30 min on
#                             2 cores with warm caches.
#   scripts/test.sh --quick   the main build's suite only (for development), ~10 min warm
#   scripts/test.sh --soak    the default tier with every soak test at full size
#                             (TIDAL_SOAK=1: SIGKILL rounds, drills, NATS kill rounds,
#                             every file operation of each sweep), and the soaks under
#                             ASan+UBSan too, at a smoke size
# tests/RELIABILITY.md ("Test tiers") lists the soak tests and their sizes.
#
# Caches (never a different result, only a faster one): tidal's RocksDB is
# built once per machine (scripts/rocksdb.sh), and every build of tidal goes
# through ccache when it is installed (CMakeLists.txt, TIDAL_CCACHE).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=ci
for arg in "$@"; do
  case "$arg" in
    --quick) tier=quick ;;
    --soak) tier=soak ;;
    *) echo "usage: scripts/test.sh [--quick | --soak]" >&2; exit 2 ;;
  esac
done
if [ "$tier" = soak ]; then export TIDAL_SOAK=1; fi

start=$(date +%s)
stage_times=()
stage_start=$start
# begin_stage <name>: prints the stage's heading and starts its clock.
begin_stage() {
  stage_name=$1
  stage_start=$(date +%s)
  echo "== $stage_name =="
}
# end_stage: prints the stage's time and records it for the summary.
end_stage() {
  local took=$(( $(date +%s) - stage_start ))
  stage_times+=("$(printf '%-44s %5d s' "$stage_name" "$took")")
  echo "tidal: $stage_name passed in $took s"
}
summary() {
  echo "tidal: stage times ($tier tier)"
  printf '  %s\n' "${stage_times[@]}"
  echo "tidal: all $tier-tier stages passed in $(( $(date +%s) - start )) s"
}

begin_stage "dependencies (scripts/deps.sh)"
scripts/deps.sh
end_stage
jobs=$(nproc)
if command -v ccache >/dev/null; then ccache --zero-stats >/dev/null; fi

# ctest on every core; the tests that need a quiet machine or a NATS cluster
# of their own say so (tests/ctest_properties.cmake: PROCESSORS,
# RESOURCE_LOCK), and the longest start first (COST, then ctest's own record
# of the last run's times).
run_ctest() {
  ctest --test-dir "$1" --output-on-failure -j "$jobs" "${@:2}"
}

# The main build is also the Release warning check: -O3 as a Release build,
# where GCC warns about things -O2 does not see (e.g. -Wrestrict).
# Every build here is -g1: line tables, so that a backtrace, a sanitizer's
# report and gdb's `bt` name files and lines, without the variables and types
# of -g, which cost a third of each compile (tests/RELIABILITY.md, "Test tiers").
begin_stage "main build (Release -O3 -g1, -Werror; tests, tools, benches)"
cmake -S . -B build/test -DCMAKE_BUILD_TYPE=Release "-DCMAKE_CXX_FLAGS_RELEASE=-O3 -g1 -DNDEBUG" \
  -DTIDAL_WERROR=ON -DTIDAL_BUILD_BENCHMARKS=ON >/dev/null
cmake --build build/test -j "$jobs"
end_stage
fuzz_seconds=${TIDAL_FUZZ_SECONDS:-30}
# fuzz_one <target>: runs it for $fuzz_seconds from the committed corpus
# (only read; new inputs go to a scratch directory) and prints its line.
fuzz_one() {
  local target=$1 scratch log=build/test-fuzz/fuzz_$1.log
  scratch=$(mktemp -d)
  if ! ASAN_OPTIONS="detect_leaks=1" build/test-fuzz/fuzz/fuzz_$target -max_total_time="$fuzz_seconds" \
      -print_final_stats=1 -artifact_prefix=build/test-fuzz/ "$scratch" "fuzz/corpus/$target" >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "tidal: fuzz_$target failed (crash input saved in build/test-fuzz/, log $log)" >&2
    rm -rf "$scratch"
    return 1
  fi
  rm -rf "$scratch"
  echo "fuzz_$target: $(grep -m1 -o 'Done [0-9]* runs in [0-9]* second(s)' "$log")"
}
# run_fuzzers: every target for $fuzz_seconds, $jobs at a time.
run_fuzzers() {
  local targets=(membership_codec history_codec keys open_records receipt_codec) pids=() failed=0 i pid
  for i in "${!targets[@]}"; do
    fuzz_one "${targets[$i]}" &
    pids+=($!)
    if [ ${#pids[@]} -ge "$jobs" ] || [ "$i" -eq $(( ${#targets[@]} - 1 )) ]; then
      for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
      pids=()
    fi
  done
  [ "$failed" -eq 0 ]
}

# The sanitizer and fuzz builds compile beside the main suite, at the lowest
# priority, and the fuzzers run there once built: the suite leaves a core
# idle much of the time (tests that wait for a child, a cluster or an
# fsync), and its tests hold on a busy machine.
# tidal's RocksDB build is not instrumented; tidal and its tests are. At -O1:
# GCC's ASan+UBSan build of the tests takes ~1.6x as long at -O2, and the
# sanitizers see the same code.
san_flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" -DTIDAL_WERROR=ON
  -DTIDAL_INSTALL=OFF)
other_builds() {
  cmake -S . -B build/test-asan "${san_flags[@]}" -DTIDAL_SANITIZE=address,undefined >/dev/null
  cmake --build build/test-asan -j "$jobs"
  cmake -S . -B build/test-tsan "${san_flags[@]}" -DTIDAL_SANITIZE=thread -DTIDAL_BUILD_TOOLS=OFF >/dev/null
  cmake --build build/test-tsan -j "$jobs" --target tidal_tests
  cmake -S . -B build/test-fuzz "${san_flags[@]}" -DCMAKE_CXX_COMPILER=clang++ -DTIDAL_BUILD_FUZZERS=ON -DTIDAL_BUILD_NATS=OFF \
    -DTIDAL_SANITIZE=address,undefined -DTIDAL_BUILD_TESTS=OFF -DTIDAL_BUILD_TOOLS=OFF >/dev/null
  cmake --build build/test-fuzz -j "$jobs"
  echo "== libFuzzer, $fuzz_seconds s per target, $jobs at a time =="
  run_fuzzers
}
builds_pid=
if [ "$tier" != quick ]; then
  mkdir -p build
  other_builds_log=build/other-builds.log
  # In a process group of their own (set -m), so that an early exit stops
  # every compiler and fuzzer of theirs, not only their shell.
  set -m
  (renice -n 19 -p "$BASHPID" >/dev/null && other_builds) >"$other_builds_log" 2>&1 &
  builds_pid=$!
  set +m
  trap 'if [ -n "$builds_pid" ]; then kill -- "-$builds_pid" 2>/dev/null || true; fi' EXIT
fi

begin_stage "main suite (every test)"
run_ctest build/test
end_stage

if [ "$tier" = quick ]; then summary; exit 0; fi

begin_stage "ASan+UBSan, TSan and fuzz builds, and the fuzzers (the rest of them, begun beside the main suite)"
if ! wait "$builds_pid"; then
  builds_pid=
  tail -n 60 "$other_builds_log"
  echo "tidal: a sanitizer or fuzz build, or a fuzzer, failed (log: $other_builds_log)" >&2
  exit 1
fi
builds_pid=
grep '^fuzz_' "$other_builds_log" || true
end_stage

export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
# The package tests (label package) build tidal again as a host would, which
# the main build did. The soak tests (label soak: SIGKILL rounds, power cuts,
# the drill) ran in the main build; here they run only in the soak tier, at
# a smoke size (every process of theirs instrumented: 20 crash rounds, 4
# drill rounds, enough for each test's own checks that the rounds did
# something). The fault sweeps step over 3x as many file operations as the
# main build's (TIDAL_SWEEP_SCALE; every operation under --soak).
if [ "$tier" = soak ]; then
  asan_stage="ASan+UBSan suite (every test; the soaks at a smoke size)"
  asan_exclude=package
else
  asan_stage="ASan+UBSan suite (every test but the soaks; sweeps at 3x stride)"
  asan_exclude='package|soak'
fi
begin_stage "$asan_stage"
ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" TIDAL_CRASH_ROUNDS=20 TIDAL_DRILL_ROUNDS=4 TIDAL_SWEEP_SCALE=3 \
  run_ctest build/test-asan -LE "$asan_exclude"
end_stage

# tests/tsan.supp lists what TSan may report inside RocksDB's own
# (uninstrumented) code, each entry explained; nothing of tidal's is suppressed.
begin_stage "TSan suite (names containing Concurrent or Stress)"
TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp" \
  run_ctest build/test-tsan -LE package -R 'Concurrent|Stress' --no-tests=error \
    -E 'BulkConcurrentTest'  # a bulk leave holds all 64 user-lock stripes: past TSan's 64-lock deadlock detector
end_stage

summary
