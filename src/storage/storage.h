// The RocksDB database behind one Db and its column families:
//   default     meta records (index state, clock floor)
//   users       the users partition (docs/FORMAT.md)
//   by_tag      the index: a copy of the users records of the indexed tags,
//               keyed tag-first, written in the same WriteBatch
//   aggregates  personal/cohort/community sums (merge operands of an integer add)
//   ledger      the contribution ledger: what each user gave to which aggregate
//   feed        the change feed (only in a Db opened with Options::change_feed)
#ifndef TIDAL_STORAGE_STORAGE_H_
#define TIDAL_STORAGE_STORAGE_H_

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/sst_file_writer.h>
#include <rocksdb/write_batch.h>

#include "storage/format.h"
#include "tidal/status.h"

namespace tidal {

// Whether records of `tag` have a copy in the by_tag index.
bool is_indexed(Tag tag);

// Converts a RocksDB status into a tidal Status whose message starts with `what`.
Status from_rocksdb(const rocksdb::Status& s, std::string_view what);

class Storage {
 public:
  struct Config {
    bool create_if_missing = true;
    bool read_only = false;
    rocksdb::Env* env = nullptr;  // for fault injection in tests; null = default
    std::size_t block_cache_bytes = 64 << 20;  // shared by every column family
  };

  static Result<std::unique_ptr<Storage>> open(const std::string& path, const Config& config);
  ~Storage();

  rocksdb::DB* db() const { return db_.get(); }
  rocksdb::ColumnFamilyHandle* meta() const { return handles_[0]; }
  rocksdb::ColumnFamilyHandle* users() const { return handles_[1]; }
  rocksdb::ColumnFamilyHandle* by_tag() const { return handles_[2]; }
  rocksdb::ColumnFamilyHandle* aggregates() const { return handles_[3]; }
  rocksdb::ColumnFamilyHandle* ledger() const { return handles_[4]; }
  // The change feed (docs/FORMAT.md); null until create_feed().
  rocksdb::ColumnFamilyHandle* feed() const { return handles_.size() > 5 ? handles_[5] : nullptr; }
  // Creates the feed's column family (durable: RocksDB's MANIFEST). No-op
  // when it exists.
  Status create_feed();
  bool read_only() const { return read_only_; }
  const std::string& path() const { return path_; }

  enum class WriteMode {
    Sync,   // WAL fsynced before returning
    Async,  // WAL written, not fsynced: survives a process crash, not a power cut
    NoWal,  // memtable only: durable after the next flush()
  };
  static WriteMode durable_if(bool sync) { return sync ? WriteMode::Sync : WriteMode::Async; }
  Status write(rocksdb::WriteBatch* batch, WriteMode mode, std::string_view what);
  // Adds a users record to `batch` and, for an indexed tag, its by_tag copy:
  // the one place that keeps the index in step with the users partition.
  void put_record(rocksdb::WriteBatch* batch, EntityId id, Tag tag, std::string_view suffix,
                  std::string_view value) const;
  void delete_record(rocksdb::WriteBatch* batch, EntityId id, Tag tag, std::string_view suffix) const;
  // NotFound when absent. Reads as of `snapshot` when given.
  Status get(rocksdb::ColumnFamilyHandle* cf, std::string_view key, std::string* value,
             const rocksdb::Snapshot* snapshot = nullptr) const;
  // `bulk` for long scans: reads ahead and keeps the block cache for point reads.
  std::unique_ptr<rocksdb::Iterator> iterator(rocksdb::ColumnFamilyHandle* cf, bool bulk = false,
                                              const rocksdb::Snapshot* snapshot = nullptr) const;
  // RocksDB's estimate of the number of keys in `cf` (0 when unknown).
  std::uint64_t estimate_keys(rocksdb::ColumnFamilyHandle* cf) const;
  // A writer of one SST file for `cf`, with the column family's options
  // (merge operator, bloom filters, compression). Its entries must be added
  // in key order; files to ingest are built in ingest_dir().
  std::unique_ptr<rocksdb::SstFileWriter> sst_writer(rocksdb::ColumnFamilyHandle* cf) const;
  // `<path>/ingest`: created by a writable open, which also deletes what a
  // crash left there.
  std::string ingest_dir() const { return path_ + "/ingest"; }
  // Adds finished SST files, at most one per column family, to the database
  // in one atomic step: after a crash or power loss either all of them are
  // there or none. Durable (fsynced, MANIFEST included) when it returns. The
  // files are copied, so the caller deletes them.
  Status ingest(const std::vector<std::pair<rocksdb::ColumnFamilyHandle*, std::string>>& files, std::string_view what);
  // Deletes a file (quietly; for files of ingest_dir()).
  void delete_file(const std::string& file) const;
  // Flushes every memtable to SST files and waits, so the next open does not
  // replay the WAL. It does not wait for compactions first, even if the new
  // L0 files make RocksDB slow or stop writes until they catch up.
  Status flush();
  // True while the state store's column families are behind on compaction:
  // RocksDB is delaying or stopping writes, or the aggregates or the ledger
  // hold kPaceL0Files level-0 files or more. The state store's writer waits
  // while it is so (StateStore). Each of its batches adds one L0 file to
  // each; an L0->L1 compaction takes every L0 file there is, so the more
  // there are, the fewer times L1 is rewritten for the same data. Below the
  // kL0SlowdownFiles at which RocksDB starts delaying every write, leaves
  // included (bench/README.md, "Ingesting the writer's batches").
  static constexpr std::uint64_t kPaceL0Files = 48;
  static constexpr int kL0SlowdownFiles = 56;
  static constexpr int kL0StopFiles = 72;
  bool compaction_behind() const;
  // Flushes (unless read-only) and closes the database.
  Status close();

 private:
  Storage() = default;
  std::string path_;
  // The directory's (st_dev, st_ino) in the registry of Dbs open for
  // writing, while this handle holds it.
  std::optional<std::pair<dev_t, ino_t>> registry_id_;
  bool read_only_ = false;
  std::unique_ptr<rocksdb::DB> db_;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;
};

// The largest timestamp recorded in the meta clock-floor records (0 when
// there are none); Corruption for a record that does not decode.
Result<std::uint64_t> read_clock_floor(const Storage& storage);

}  // namespace tidal

#endif  // TIDAL_STORAGE_STORAGE_H_
