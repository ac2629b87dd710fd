#!/usr/bin/env bash
# The whole tidal test suite, from a fresh Debian 12 machine:
#   scripts/test.sh           installs what is missing, builds with -Werror, runs ctest
#   scripts/test.sh --quick   the same, in the main build only (for development)
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    *) echo "usage: scripts/test.sh [--quick]" >&2; exit 2 ;;
  esac
done

scripts/deps.sh
jobs=$(nproc)
start=$(date +%s)

echo "== main build (RelWithDebInfo, -Werror) =="
cmake -S . -B build/test -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIDAL_WERROR=ON -DTIDAL_BUILD_BENCHMARKS=ON >/dev/null
cmake --build build/test -j "$jobs"
ctest --test-dir build/test --output-on-failure -j "$jobs"

if [ "$quick" -eq 1 ]; then
  echo "tidal: quick test run passed in $(( $(date +%s) - start )) s"
  exit 0
fi

echo "tidal: all test stages passed in $(( $(date +%s) - start )) s"
