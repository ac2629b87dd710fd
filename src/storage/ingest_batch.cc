#include "storage/ingest_batch.h"

namespace tidal {
namespace {

rocksdb::Slice slice(std::string_view s) { return {s.data(), s.size()}; }

}  // namespace

IngestBatch::~IngestBatch() {
  for (const File& f : files_) storage_->delete_file(f.path);
}

IngestBatch::File& IngestBatch::file(rocksdb::ColumnFamilyHandle* cf) {
  for (File& f : files_) {
    if (f.cf == cf) return f;
  }
  File& f = files_.emplace_back();
  f.cf = cf;
  f.path = storage_->ingest_dir() + "/" + name_ + "." + cf->GetName() + ".sst";
  f.writer = storage_->sst_writer(cf);
  if (f.open_status = f.writer->Open(f.path); !f.open_status.ok()) f.writer.reset();
  return f;
}

rocksdb::Status IngestBatch::put(rocksdb::ColumnFamilyHandle* cf, std::string_view key, std::string_view value) {
  if (via_ == Via::Wal) return wal_batch_.Put(cf, slice(key), slice(value));
  File& f = file(cf);
  return f.writer ? f.writer->Put(slice(key), slice(value)) : f.open_status;
}

rocksdb::Status IngestBatch::merge(rocksdb::ColumnFamilyHandle* cf, std::string_view key, std::string_view value) {
  if (via_ == Via::Wal) return wal_batch_.Merge(cf, slice(key), slice(value));
  File& f = file(cf);
  return f.writer ? f.writer->Merge(slice(key), slice(value)) : f.open_status;
}

rocksdb::Status IngestBatch::delete_range(rocksdb::ColumnFamilyHandle* cf, std::string_view begin,
                                          std::string_view end) {
  if (via_ == Via::Wal) return wal_batch_.DeleteRange(cf, slice(begin), slice(end));
  File& f = file(cf);
  return f.writer ? f.writer->DeleteRange(slice(begin), slice(end)) : f.open_status;
}

Status IngestBatch::finish(std::string_view what) {
  for (File& f : files_) {
    if (f.finished) continue;
    if (!f.writer) return from_rocksdb(f.open_status, what);
    if (rocksdb::Status s = f.writer->Finish(); !s.ok()) return from_rocksdb(s, what);
    f.finished = true;
  }
  return Status::OK();
}

Status IngestBatch::ingest(std::string_view what, IngestBatch* with) {
  if (via_ == Via::Wal) {
    if (with != nullptr) {
      return Status::InvalidArgument(std::string(what) + ": a batch written through the WAL takes no other batch");
    }
    return storage_->write(Storage::Engine::State, &wal_batch_, Storage::WriteMode::Sync, what);
  }
  std::vector<std::pair<rocksdb::ColumnFamilyHandle*, std::string>> done;
  for (IngestBatch* batch : {this, with}) {
    if (batch == nullptr) continue;
    if (Status s = batch->finish(what); !s.ok()) return s;
    for (const File& f : batch->files_) done.emplace_back(f.cf, f.path);
  }
  return storage_->ingest(done, what);
}

}  // namespace tidal
