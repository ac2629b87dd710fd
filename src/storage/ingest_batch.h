// One atomic ingestion of SST files: at most one file per column family,
// each written in key order into the Db's ingest_dir(), then added to the
// database together (Storage::ingest): after a crash or a power cut either
// every file is there or none. The state store's writer stores its batches
// so, and a purge its subtraction, ledger deletion and receipt. Building the
// files streams to disk: the memory does not grow with the batch. One thread
// builds a batch; two batches built on two threads can be ingested together
// (ingest(what, with)), as the writer does with the change feed's file.
//
// A small batch can go through the state engine's WAL instead (Via::Wal):
// the same entries, held in memory in one rocksdb::WriteBatch, written
// synced by ingest(). It is as atomic and as durable, for one fsync where
// an ingestion costs one a file and RocksDB's own (the link's, the
// directory's, the MANIFEST's): a purge of one user at 1M users with
// signals flowing took 12-13 ms at p50 and 29-40 ms at p99 so, against
// 24-29 and 53-79 ms as files (bench/README.md, "Session 42"). Its entries
// then wait in memtables, which RocksDB flushes before it ingests a file
// that overlaps them (the writer's next batch).
#ifndef TIDAL_STORAGE_INGEST_BATCH_H_
#define TIDAL_STORAGE_INGEST_BATCH_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <rocksdb/sst_file_writer.h>
#include <rocksdb/write_batch.h>

#include "storage/storage.h"

namespace tidal {

class IngestBatch {
 public:
  enum class Via { Files, Wal };
  // Files are named <ingest_dir>/<name>.<column family>.sst; `name` must be
  // unique among batches built at the same time. A batch Via::Wal writes no
  // file, and keeps its entries in memory: only for small batches.
  IngestBatch(Storage* storage, std::string name, Via via = Via::Files)
      : storage_(storage), name_(std::move(name)), via_(via) {}
  ~IngestBatch();  // deletes what is left of the files (ingest moves them into the engine)
  IngestBatch(const IngestBatch&) = delete;
  IngestBatch& operator=(const IngestBatch&) = delete;

  // Each column family's keys must come in ascending order (Via::Files).
  rocksdb::Status put(rocksdb::ColumnFamilyHandle* cf, std::string_view key, std::string_view value);
  rocksdb::Status merge(rocksdb::ColumnFamilyHandle* cf, std::string_view key, std::string_view value);
  rocksdb::Status delete_range(rocksdb::ColumnFamilyHandle* cf, std::string_view begin, std::string_view end);

  bool empty() const { return files_.empty() && wal_batch_.Count() == 0; }
  // Finishes the files: each is written out and fsynced. Optional (ingest()
  // finishes what is not finished yet); it lets another thread than the
  // ingesting one do that work.
  Status finish(std::string_view what);
  // Finishes the files and ingests them, with those of `with` (another
  // batch of the same Db, whose files of a column family this batch also
  // writes must not overlap this batch's; null: none), in one atomic,
  // durable step. Via::Wal: one synced write of the state engine, which
  // takes no `with` (InvalidArgument).
  Status ingest(std::string_view what, IngestBatch* with = nullptr);

 private:
  struct File {
    rocksdb::ColumnFamilyHandle* cf = nullptr;
    std::string path;
    std::unique_ptr<rocksdb::SstFileWriter> writer;  // null when Open failed
    rocksdb::Status open_status;
    bool finished = false;
  };
  // The column family's file, opened at its first entry.
  File& file(rocksdb::ColumnFamilyHandle* cf);

  Storage* const storage_;
  const std::string name_;
  const Via via_;
  std::vector<File> files_;
  rocksdb::WriteBatch wal_batch_;  // Via::Wal
};

}  // namespace tidal

#endif  // TIDAL_STORAGE_INGEST_BATCH_H_
