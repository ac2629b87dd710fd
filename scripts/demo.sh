#!/usr/bin/env bash
# Builds tidal and runs the demo on ./tidal-demo-data (a local directory).
#   scripts/demo.sh [tidal-demo flags]     e.g. scripts/demo.sh --users 20000
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake -S . -B build/demo -DCMAKE_BUILD_TYPE=Release -DTIDAL_BUILD_TESTS=OFF >/dev/null
cmake --build build/demo -j "$(nproc)" --target tidal-demo tidalctl
exec build/demo/tools/tidal-demo --dir ./tidal-demo-data "$@"
