// RawDb: a tidal Db directory opened as a plain RocksDB database, for tests
// that write or inspect stored bytes directly (corrupt records, build large
// Dbs quickly). Creates the directory and tidal's column families if missing;
// flushes its memtables on close.
#ifndef TIDAL_TESTS_RAW_DB_H_
#define TIDAL_TESTS_RAW_DB_H_

#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include "storage/state_format.h"

namespace tidal::testing {

struct RawDb {
  // tidal's column families, in Storage's order.
  enum Cf { kMeta = 0, kUsers = 1, kByTag = 2, kAggregates = 3, kLedger = 4 };

  explicit RawDb(const std::string& path) {
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
    for (const char* name : {"default", "users", "by_tag", "aggregates", "ledger"}) {
      cfs.emplace_back(name, rocksdb::ColumnFamilyOptions());
    }
    // And any other column family the Db has (the change feed's), which a
    // read-write open must name.
    std::vector<std::string> existing;
    if (rocksdb::DB::ListColumnFamilies(rocksdb::Options(), path, &existing).ok()) {
      for (const std::string& name : existing) {
        bool known = false;
        for (const auto& cf : cfs) known = known || cf.name == name;
        if (!known) cfs.emplace_back(name, rocksdb::ColumnFamilyOptions());
      }
    }
    cfs[kAggregates].options.merge_operator = new_units_add_operator();
    rocksdb::Options options;
    options.create_if_missing = true;
    options.create_missing_column_families = true;
    rocksdb::DB* raw = nullptr;
    rocksdb::Status s = rocksdb::DB::Open(options, path, cfs, &handles, &raw);
    if (!s.ok()) {
      ADD_FAILURE() << "raw open of " << path << ": " << s.ToString();
      return;
    }
    db.reset(raw);
  }
  ~RawDb() {
    if (!db) return;
    (void)db->Flush(rocksdb::FlushOptions(), handles);
    for (auto* h : handles) (void)db->DestroyColumnFamilyHandle(h);
    (void)db->Close();
  }
  RawDb(const RawDb&) = delete;
  RawDb& operator=(const RawDb&) = delete;

  rocksdb::ColumnFamilyHandle* cf(Cf which) const { return handles[which]; }

  std::unique_ptr<rocksdb::DB> db;
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
};

}  // namespace tidal::testing

#endif  // TIDAL_TESTS_RAW_DB_H_
