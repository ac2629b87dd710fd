#!/usr/bin/env bash
# Installs, with apt-get, whatever Debian 12 packages tidal needs that are
# missing, then builds tidal's RocksDB (scripts/rocksdb.sh) unless it is
# built already. Runs as root (or through sudo when available). Idempotent.
set -euo pipefail

packages=(
  cmake g++ make pkg-config python3   # python3: JSON checks in the CLI tests
  ccache                              # a compiler cache for every build of tidal (CMakeLists.txt)
  libcuckoo-dev
  libssl-dev                          # libcrypto: the sealed ledger's AES-256-GCM, HMAC and CSPRNG
  # RocksDB is built from Debian's source package (scripts/rocksdb.sh):
  # apt-get source, patch, and the compression libraries it links
  dpkg-dev patch libsnappy-dev liblz4-dev libzstd-dev zlib1g-dev libbz2-dev
  libgtest-dev libbenchmark-dev
  nats-server libnats-dev    # tidal::nats (the NATS C client) and the 3-node cluster its tests start
  clang libclang-rt-14-dev   # libFuzzer and the sanitizer runtimes for clang
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "tidal: installing missing Debian packages: ${missing[*]}"
  as_root=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "tidal: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
    as_root=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

"$(dirname "$0")/rocksdb.sh"
