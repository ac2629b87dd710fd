#!/usr/bin/env bash
# Builds and runs tests/package/consumer against tidal.
#   run_consumer.sh package      BUILD_DIR SOURCE_DIR WORK_DIR  (cmake --install, find_package, pkg-config)
#   run_consumer.sh subdirectory BUILD_DIR SOURCE_DIR WORK_DIR [LAUNCHER]  (add_subdirectory)
set -euo pipefail
mode=$1 build=$2 source=$3 work=$4 launcher=${5:-}
rm -rf "$work" && mkdir -p "$work"
consumer="$source/tests/package/consumer"
jobs=$(nproc)

if [ "$mode" = package ]; then
  prefix="$work/prefix"
  cmake --install "$build" --prefix "$prefix" >/dev/null
  cmake -S "$consumer" -B "$work/build" -DTIDAL_CONSUME=package -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
  cmake --build "$work/build" -j "$jobs" >/dev/null
  "$work/build/consumer" "$work/db"
  "$work/build/nats_consumer" "$work/db-nats"

  # The same program through pkg-config.
  export PKG_CONFIG_PATH="$prefix/lib/pkgconfig"
  # ... and the RocksDB tidal was built with (tidal's own build: build/rocksdb).
  rocksdb_dir=$(sed -n 's/^RocksDB_DIR:PATH=//p' "$build/CMakeCache.txt")
  if [ -d "$rocksdb_dir/../../pkgconfig" ]; then PKG_CONFIG_PATH+=":$rocksdb_dir/../../pkgconfig"; fi
  # shellcheck disable=SC2046
  g++ "$consumer/main.cc" -o "$work/consumer-pc" $(pkg-config --cflags tidal) $(pkg-config --libs --static tidal)
  "$work/consumer-pc" "$work/db-pc"
else
  cmake -S "$consumer" -B "$work/build" -DTIDAL_CONSUME=subdirectory -DTIDAL_SOURCE_DIR="$source" \
    ${launcher:+"-DCMAKE_CXX_COMPILER_LAUNCHER=$launcher"} >/dev/null
  cmake --build "$work/build" -j "$jobs" >/dev/null
  "$work/build/consumer" "$work/db"
  "$work/build/nats_consumer" "$work/db-nats"
fi
