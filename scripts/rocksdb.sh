#!/usr/bin/env bash
# Builds the RocksDB tidal links: Debian 12's own RocksDB 7.8.3 (its source
# package, with Debian's patches) plus tidal's fixes in third_party/rocksdb/,
# as an optimized static library. CMake finds it in build/rocksdb first
# (CMakeLists.txt, TIDAL_ROCKSDB_PREFIX).
#
# Why not Debian's librocksdb: it is built without NDEBUG (its ~6,400 asserts
# run on every write) and its ingestion of SST files, which tidal's state
# store uses, can corrupt a Db after one failed read (the patch explains).
# docs/ROCKSDB.md has the measurements.
#
# The build is cached per machine, outside the checkout, in
#   ${TIDAL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tidal}/rocksdb/<version>-<key>/
# where <key> hashes everything that changes the result: the Debian source
# package (its .dsc and hash), tidal's patches, the C and C++ compilers, cmake
# and the build's flags. build/rocksdb is a symbolic link to the entry. Any
# clone on the machine finds the entry; a changed patch, flag or compiler makes
# a new one; an entry is complete (its stamp written last) or not used.
#
# The first build takes ~11 min on 2 idle cores, longer on a loaded machine,
# with a progress line at each 10 %. Needs root (or sudo) the first time, to
# add Debian's source archive to apt.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
link=$root/build/rocksdb
version=7.8.3
patches=("$root"/third_party/rocksdb/*.patch)
cache=${TIDAL_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/tidal}/rocksdb

# Release: NDEBUG. PORTABLE keeps the library runnable on any x86-64 the
# build runs on; FORCE_SSE42 still uses the CRC32C instruction. RTTI stays
# on: tidal subclasses RocksDB's FileSystem, Logger and MergeOperator.
flags=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_LIBDIR=lib -DROCKSDB_BUILD_SHARED=OFF -DPORTABLE=ON
  -DFORCE_SSE42=ON -DUSE_RTTI=1 -DWITH_SNAPPY=ON -DWITH_LZ4=ON -DWITH_ZSTD=ON -DWITH_ZLIB=ON -DWITH_BZ2=ON
  -DWITH_GFLAGS=OFF -DWITH_TESTS=OFF -DWITH_TOOLS=OFF -DWITH_CORE_TOOLS=OFF -DWITH_BENCHMARK_TOOLS=OFF
  -DFAIL_ON_WARNINGS=OFF)
# The library is static: pkg-config --static must name what it links.
libs_private='Libs.private: -lsnappy -llz4 -lzstd -lz -lbz2 -lpthread -ldl'

as_root=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "tidal: need root (or sudo) to fetch RocksDB's Debian source" >&2; exit 1; }
  as_root=(sudo)
fi
# apt-get source needs a deb-src entry; Debian 12 images ship only deb ones.
if ! grep -rqs '^Types:.*deb-src\|^deb-src' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  echo "tidal: adding Debian's source archive to apt (/etc/apt/sources.list.d/tidal-deb-src.sources)"
  printf '%s\n' 'Types: deb-src' 'URIs: http://deb.debian.org/debian' 'Suites: bookworm' 'Components: main' \
    'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg' |
    "${as_root[@]}" tee /etc/apt/sources.list.d/tidal-deb-src.sources >/dev/null
  "${as_root[@]}" apt-get update -qq
fi

# What `apt-get source` would fetch: the .dsc's name and hash (no download).
dsc=$(apt-get source --print-uris -qq rocksdb | awk '/\.dsc\x27/ { print $2, $4 }')
[ -n "$dsc" ] || { echo "tidal: apt-get source --print-uris rocksdb names no .dsc" >&2; exit 1; }
stamp_text=$(printf '%s\n' "rocksdb $version" "source $dsc" \
  "patches $(cat "${patches[@]}" | sha256sum | cut -d' ' -f1)" \
  "cc $(cc --version | head -n 1)" "c++ $(c++ --version | head -n 1)" "cmake $(cmake --version | head -n 1)" \
  "flags ${flags[*]}" "$libs_private")
key=$(printf '%s\n' "$stamp_text" | sha256sum | cut -c1-16)
prefix=$cache/$version-$key
stamp=$prefix/share/tidal/rocksdb-build

# Points build/rocksdb at the cache entry (a directory there from before the
# cache is replaced).
use_entry() {
  if [ "$(readlink "$link" 2>/dev/null)" != "$prefix" ]; then
    rm -rf "$link"
    mkdir -p "$(dirname "$link")"
    ln -sfn "$prefix" "$link"
  fi
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_text" ]; then use_entry; exit 0; fi

# One build per entry at a time: another clone building the same entry is
# waited for, then its result used.
mkdir -p "$cache"
exec 9>"$cache/.lock-$version-$key"
if ! flock -n 9; then
  echo "tidal: another process is building RocksDB into $prefix; waiting for it"
  flock 9
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_text" ]; then use_entry; exit 0; fi

# The build's progress in percent: the highest "[ NN%]" that cmake's make
# output has written to the log <file> so far (0 before the first).
build_percent() {
  [ -f "$1" ] || { echo 0; return; }
  awk 'match($0, /^\[ *[0-9]+%\]/) { p = substr($0, RSTART + 1, RLENGTH - 3) + 0; if (p > max) max = p }
       END { print max + 0 }' "$1"
}

# "3 min 07 s" for <seconds>.
minutes() { printf '%d min %02d s' $(($1 / 60)) $(($1 % 60)); }

# Prints a line when the log <file> has reached a 10 % step above the one in
# $progress_shown (the last printed), with the time since <start> (epoch
# seconds); then sets $progress_shown to that step.
progress_shown=0
report_progress() {
  local percent step
  percent=$(build_percent "$1")
  step=$((percent / 10 * 10))
  if [ "$step" -gt "$progress_shown" ]; then
    progress_shown=$step
    echo "tidal: RocksDB build at $percent % after $(minutes $(($(date +%s) - $2)))"
  fi
}

# Checks the log <file> every 10 s while the process <pid> (this script)
# runs; run in the background beside the build.
watch_progress() {
  while kill -0 "$3" 2>/dev/null; do
    sleep 10
    report_progress "$1" "$2"
  done
}

work=$cache/build-$version-$key
rm -rf "$work" "$prefix"
mkdir -p "$work"
echo "tidal: building RocksDB $version (Debian source + third_party/rocksdb patches) into $prefix"
echo "tidal: this runs once and takes ~11 min on 2 idle cores (longer on a loaded machine); a line at each 10 %"
start=$(date +%s)
(cd "$work" && apt-get source -qq rocksdb >/dev/null)
src=$(find "$work" -maxdepth 1 -type d -name "rocksdb-$version" | head -n 1)
[ -n "$src" ] || { echo "tidal: apt-get source did not unpack rocksdb-$version in $work" >&2; exit 1; }
for p in "${patches[@]}"; do
  patch -d "$src" -p1 --forward --quiet <"$p"
done
cmake -S "$src" -B "$work/build" -DCMAKE_INSTALL_PREFIX="$prefix" "${flags[@]}" >/dev/null
# The build stays in the foreground (Ctrl-C stops it); the watcher beside it
# ends with this script.
watch_progress "$work/build.log" "$start" $$ &
watcher=$!
trap 'kill "$watcher" 2>/dev/null || true' EXIT
cmake --build "$work/build" -j "$(nproc)" >"$work/build.log" 2>&1 ||
  { tail -n 40 "$work/build.log"; echo "tidal: RocksDB build failed (log: $work/build.log)" >&2; exit 1; }
kill "$watcher" 2>/dev/null || true
cmake --install "$work/build" >/dev/null
echo "$libs_private" >>"$prefix/lib/pkgconfig/rocksdb.pc"
mkdir -p "$(dirname "$stamp")"
cp "${patches[@]}" "$(dirname "$stamp")/"
echo "$stamp_text" >"$stamp"
rm -rf "$work"
use_entry
echo "tidal: RocksDB $version built in $(( $(date +%s) - start )) s (cached in $prefix)"
