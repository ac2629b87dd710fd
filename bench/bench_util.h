// Shared pieces of the benchmarks: scratch directories and bulk loading.
#ifndef TIDAL_BENCH_BENCH_UTIL_H_
#define TIDAL_BENCH_BENCH_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tidal/db.h"

namespace rocksdb {
class ColumnFamilyHandle;
class DB;
class WriteBatch;
}

namespace tidal {
class Storage;
}

namespace tidal::bench {

// A fresh directory under $TMPDIR (or $TIDAL_BENCH_DIR), removed at exit.
std::string scratch_dir(const std::string& name);

// The process's resident set now, and its peak so far (ru_maxrss), in MiB.
double rss_mib();
double peak_rss_mib();

// Opens a Db or aborts with the Status.
std::unique_ptr<Db> must_open(const std::string& path, const Options& options = {});

// Opens the state engine of the tidal Db at `path` as plain RocksDB, to
// build a ledger fast (as format 3 wrote it: format 4 reads it, carried):
// handles[0..3] are default, aggregates (with the units merge operator),
// ledger and receipts; the families it has besides (the sealed ledger, the
// feed) follow, since a writable open must name every one.
rocksdb::DB* open_raw_state(const std::string& path, std::vector<rocksdb::ColumnFamilyHandle*>* handles);

// Writes `leavers` Left 0x11 records (users 0..leavers-1, with their history
// entry and index copy, exactly as leave_community_layer does) and `others`
// records of a tag tidal does not read at start-up, straight into RocksDB.
void bulk_load(const std::string& path, std::uint64_t leavers, std::uint64_t others);

// Adds user `u`'s Left 0x11 record with boundary `left_at_ns`, its index copy
// and its history entry to `batch`, as leave_community_layer writes them.
void put_left(const Storage& storage, rocksdb::WriteBatch* batch, std::uint64_t u, std::uint64_t left_at_ns);

}  // namespace tidal::bench

#endif  // TIDAL_BENCH_BENCH_UTIL_H_
