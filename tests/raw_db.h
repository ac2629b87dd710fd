// RawDb: a tidal Db directory opened as plain RocksDB databases, for tests
// that write or inspect stored bytes directly (corrupt records, build large
// Dbs quickly). Format 3 (the default): the users engine in the directory
// and the state engine in <path>/state; a new directory is created as a
// format-3 Db. Format 2: one database with every column family, as tidal
// wrote before format 3 (for the upgrade tests). Creates missing column
// families; flushes its memtables on close. RawReader: one RocksDB database
// opened read-only, as it is (the upgrade tests' view before an open).
#ifndef TIDAL_TESTS_RAW_DB_H_
#define TIDAL_TESTS_RAW_DB_H_

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include "storage/format.h"
#include "storage/state_format.h"

namespace tidal::testing {

struct RawDb {
  // tidal's column families. kKeys and kBucketKeys (format 4's key store:
  // the wrapped keys, the bucket keys) are in the users engine. In format 2
  // the state ones are in the users engine too, and there is no
  // kStateMeta, kReceipts, kKeys, kSealedLedger, kSealedIndex or
  // kBucketKeys. kLedger is format 3's unsealed ledger (read by format 4,
  // never written).
  enum Cf {
    kMeta, kUsers, kByTag, kStateMeta, kAggregates, kLedger, kReceipts, kKeys, kSealedLedger, kSealedIndex, kBucketKeys
  };
  enum class Layout { Format3, Format2 };

  explicit RawDb(const std::string& path, Layout layout = Layout::Format3) : layout_(layout) {
    if (layout == Layout::Format2) {
      open(path, {"default", "users", "by_tag", "aggregates", "ledger"}, &users_);
      return;
    }
    const bool fresh = !std::filesystem::exists(path + "/CURRENT");
    if (!open(path, {"default", "users", "by_tag", "wrapped_keys", "bucket_keys"}, &users_)) return;
    if (fresh) {
      EXPECT_TRUE(users_.db->Put(rocksdb::WriteOptions(), users_.handles[0], kDbFormatKey, kDbFormat).ok());
    }
    open(state_engine_dir(path), {"default", "aggregates", "ledger", "receipts", "sealed_ledger", "sealed_index"}, &state_);
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
    static constexpr std::size_t kFormat3[] = {0, 1, 2, 0, 1, 2, 3, 3, 4, 5, 4};
    static constexpr std::size_t kFormat2[] = {0, 1, 2, kNone, 3, 4, kNone, kNone, kNone, kNone, kNone};
    const std::size_t i = (layout_ == Layout::Format2 ? kFormat2 : kFormat3)[which];
    return i == kNone ? nullptr : engine(which).handles[i];
  }

 private:
  struct Engine {
    std::unique_ptr<rocksdb::DB> db;
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
  };
  const Engine& engine(Cf which) const {
    return layout_ == Layout::Format3 && which >= kStateMeta && which != kKeys && which != kBucketKeys ? state_ : users_;
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

// A RocksDB database (a Db directory's, or its state engine's) opened
// read-only with every column family it has.
class RawReader {
 public:
  explicit RawReader(const std::string& path) {
    std::vector<std::string> names;
    rocksdb::Status s = rocksdb::DB::ListColumnFamilies(rocksdb::Options(), path, &names);
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
    for (const std::string& name : names) {
      cfs.emplace_back(name, rocksdb::ColumnFamilyOptions());
      if (name == "aggregates") cfs.back().options.merge_operator = new_units_add_operator();
    }
    rocksdb::DB* raw = nullptr;
    if (s.ok()) s = rocksdb::DB::OpenForReadOnly(rocksdb::Options(), path, cfs, &handles_, &raw);
    EXPECT_TRUE(s.ok()) << "read-only open of " << path << ": " << s.ToString();
    db_.reset(raw);
  }
  ~RawReader() {
    for (auto* h : handles_) (void)db_->DestroyColumnFamilyHandle(h);
  }
  RawReader(const RawReader&) = delete;
  RawReader& operator=(const RawReader&) = delete;

  rocksdb::DB* db() const { return db_.get(); }
  // Null when the database has no such column family.
  rocksdb::ColumnFamilyHandle* cf(const std::string& name) const {
    for (auto* h : handles_) {
      if (h->GetName() == name) return h;
    }
    return nullptr;
  }
  // Every key and value of every column family, by name.
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> contents() const {
    std::map<std::string, std::vector<std::pair<std::string, std::string>>> out;
    for (auto* h : handles_) {
      std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), h));
      auto& rows = out[h->GetName()];
      for (it->SeekToFirst(); it->Valid(); it->Next()) rows.emplace_back(it->key().ToString(), it->value().ToString());
      EXPECT_TRUE(it->status().ok()) << it->status().ToString();
    }
    return out;
  }

 private:
  std::unique_ptr<rocksdb::DB> db_;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;
};

// The format a Db directory's users engine holds ("" when it has none).
inline std::string stored_format(const std::string& path) {
  RawReader raw(path);
  std::string format;
  if (raw.db() == nullptr) return format;
  // "default": the meta family.
  const rocksdb::Status s = raw.db()->Get(rocksdb::ReadOptions(), raw.cf("default"), kDbFormatKey, &format);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return format;
}

}  // namespace tidal::testing

#endif  // TIDAL_TESTS_RAW_DB_H_
