// RawDb: a tidal Db directory opened as plain RocksDB databases, for tests
// that write or inspect stored bytes directly (corrupt records, build large
// Dbs quickly). Format 3 (the default): the users engine in the directory
// and the state engine in <path>/state; a new directory is created as a
// format-3 Db. Format 2: one database with every column family, as tidal
// wrote before format 3 (for the upgrade tests). Creates missing column
// families; flushes its memtables on close.
#ifndef TIDAL_TESTS_RAW_DB_H_
#define TIDAL_TESTS_RAW_DB_H_

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include "storage/format.h"
#include "storage/state_format.h"

namespace tidal::testing {

struct RawDb {
  // tidal's column families. kKeys (format 4's key store) is in the users
  // engine. In format 2 the state ones are in the users engine too, and
  // there is no kStateMeta, kReceipts, kKeys or kSealedLedger.
  // kLedger is format 3's unsealed ledger (read by format 4, never written).
  enum Cf { kMeta, kUsers, kByTag, kStateMeta, kAggregates, kLedger, kReceipts, kKeys, kSealedLedger };
  enum class Layout { Format3, Format2 };

  explicit RawDb(const std::string& path, Layout layout = Layout::Format3) : layout_(layout) {
    if (layout == Layout::Format2) {
      open(path, {"default", "users", "by_tag", "aggregates", "ledger"}, &users_);
      return;
    }
    const bool fresh = !std::filesystem::exists(path + "/CURRENT");
    if (!open(path, {"default", "users", "by_tag", "keys"}, &users_)) return;
    if (fresh) {
      EXPECT_TRUE(users_.db->Put(rocksdb::WriteOptions(), users_.handles[0], kDbFormatKey, kDbFormat).ok());
    }
    open(state_engine_dir(path), {"default", "aggregates", "ledger", "receipts", "sealed_ledger"}, &state_);
  }
  ~RawDb() {
    close(&state_);
    close(&users_);
  }
  RawDb(const RawDb&) = delete;
  RawDb& operator=(const RawDb&) = delete;

  bool ok() const { return users_.db != nullptr && (layout_ == Layout::Format2 || state_.db != nullptr); }
  // The database holding `which`, and its handle.
  rocksdb::DB* db(Cf which) const { return engine(which).db.get(); }
  rocksdb::ColumnFamilyHandle* cf(Cf which) const {
    static constexpr std::size_t kNone = ~std::size_t{0};
    static constexpr std::size_t kFormat3[] = {0, 1, 2, 0, 1, 2, 3, 3, 4};
    static constexpr std::size_t kFormat2[] = {0, 1, 2, kNone, 3, 4, kNone, kNone, kNone};
    const std::size_t i = (layout_ == Layout::Format2 ? kFormat2 : kFormat3)[which];
    return i == kNone ? nullptr : engine(which).handles[i];
  }

 private:
  struct Engine {
    std::unique_ptr<rocksdb::DB> db;
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
  };
  const Engine& engine(Cf which) const {
    return layout_ == Layout::Format3 && which >= kStateMeta && which != kKeys ? state_ : users_;
  }
  // Opens `path` with `names` first, then any other column family it has
  // (the change feed's), which a read-write open must name.
  static bool open(const std::string& path, std::vector<std::string> names, Engine* engine) {
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
    std::vector<std::string> existing;
    if (rocksdb::DB::ListColumnFamilies(rocksdb::Options(), path, &existing).ok()) {
      for (const std::string& name : existing) {
        if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
      }
    }
    for (const std::string& name : names) {
      cfs.emplace_back(name, rocksdb::ColumnFamilyOptions());
      if (name == "aggregates") cfs.back().options.merge_operator = new_units_add_operator();
    }
    rocksdb::Options options;
    options.create_if_missing = true;
    options.create_missing_column_families = true;
    rocksdb::DB* raw = nullptr;
    rocksdb::Status s = rocksdb::DB::Open(options, path, cfs, &engine->handles, &raw);
    if (!s.ok()) {
      ADD_FAILURE() << "raw open of " << path << ": " << s.ToString();
      return false;
    }
    engine->db.reset(raw);
    return true;
  }
  static void close(Engine* engine) {
    if (!engine->db) return;
    (void)engine->db->Flush(rocksdb::FlushOptions(), engine->handles);
    for (auto* h : engine->handles) (void)engine->db->DestroyColumnFamilyHandle(h);
    (void)engine->db->Close();
    engine->db.reset();
  }

  const Layout layout_;
  Engine users_;
  Engine state_;
};

}  // namespace tidal::testing

#endif  // TIDAL_TESTS_RAW_DB_H_
