#include "storage/storage.h"

#include "storage/state_format.h"

#include <rocksdb/cache.h>
#include <rocksdb/filter_policy.h>
#include <rocksdb/table.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>
#include <system_error>

namespace tidal {
namespace {

const char* const kColumnFamilies[] = {"default", "users", "by_tag", "aggregates", "ledger"};

bool is_lock_error(const rocksdb::Status& s) {
  const std::string text = s.ToString();
  return s.IsIOError() && (text.find("/LOCK") != std::string::npos || text.find("lock hold") != std::string::npos);
}

// Directories this process has open for writing. RocksDB refuses a second
// open too, but only after it has rotated the holder's info LOG; checking
// first leaves the holder's files alone.
std::mutex g_open_mu;
std::set<std::string> g_open_paths;

std::string canonical(const std::string& path) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::weakly_canonical(path, ec);
  return ec ? path : p.string();
}

// Busy when another process holds RocksDB's lock on the directory. Safe to
// open and close LOCK here only because this process does not hold it (an
// fcntl lock dies with any descriptor of its file that its process closes).
Status check_not_held_elsewhere(const std::string& path) {
  const int fd = ::open((path + "/LOCK").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::OK();  // no LOCK file yet: nobody holds it
  struct flock probe {};
  probe.l_type = F_WRLCK;
  probe.l_whence = SEEK_SET;
  const bool held = ::fcntl(fd, F_GETLK, &probe) == 0 && probe.l_type != F_UNLCK;
  ::close(fd);
  if (!held) return Status::OK();
  return Status::Busy("cannot open tidal Db at '" + path + "': it is already open by another process (pid " +
                      std::to_string(probe.l_pid) + " holds " + path + "/LOCK)");
}

// G8: refuse what RocksDB would fail on or misreport, before touching disk.
Status check_path(const std::string& path, const Storage::Config& config) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) {
    return Status::IOError("cannot open tidal Db at '" + path + "': " + ec.message());
  }
  if (!fs::exists(st)) {
    if (!config.create_if_missing || config.read_only) {
      return Status::NotFound("cannot open tidal Db at '" + path + "': no such directory" +
                              (config.read_only ? " (read-only open never creates one)" : ""));
    }
    return Status::OK();
  }
  if (!fs::is_directory(st)) {
    return Status::InvalidArgument("cannot open tidal Db at '" + path + "': it is a " +
                                   (fs::is_regular_file(st) ? "regular file" : "non-directory file") +
                                   ", not a directory");
  }
  if ((config.read_only || !config.create_if_missing) && !fs::exists(fs::path(path) / "CURRENT", ec)) {
    return Status::NotFound("cannot open tidal Db at '" + path + "': the directory holds no database (no CURRENT file)" +
                            (config.read_only ? "; a read-only open never creates one" : ""));
  }
  if (config.read_only) return Status::OK();
  if (::access(path.c_str(), W_OK | X_OK) != 0) {
    return Status::IOError("cannot open tidal Db at '" + path + "': directory is not writable (" +
                           std::strerror(errno) + ")");
  }
  return check_not_held_elsewhere(path);
}

// The state store's column families: a bounded block cache shared by every
// column family, the integer-add merge operator on aggregates, and prefix
// bloom filters so a point read of a cell touches few blocks.
void apply_state_store_options(const Storage::Config& config, std::vector<rocksdb::ColumnFamilyDescriptor>* cfs) {
  rocksdb::BlockBasedTableOptions table;
  table.block_cache = rocksdb::NewLRUCache(config.block_cache_bytes);
  table.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
  table.cache_index_and_filter_blocks = true;  // index and filters count against the cache bound
  table.pin_l0_filter_and_index_blocks_in_cache = true;
  for (auto& cf : *cfs) cf.options.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  (*cfs)[3].options.merge_operator = new_units_add_operator();
}

}  // namespace

bool is_indexed(Tag tag) { return tag == Tag::CommunityMember || tag == Tag::CommunityLeave; }

Status from_rocksdb(const rocksdb::Status& s, std::string_view what) {
  if (s.ok()) return Status::OK();
  std::string msg = std::string(what) + ": " + s.ToString();
  if (s.IsNotFound()) return Status::NotFound(std::move(msg));
  if (s.IsCorruption()) return Status::Corruption(std::move(msg));
  if (s.IsInvalidArgument() || s.IsNotSupported()) return Status::InvalidArgument(std::move(msg));
  if (s.IsBusy() || s.IsTryAgain()) return Status::Busy(std::move(msg));
  return Status::IOError(std::move(msg));
}

Result<std::unique_ptr<Storage>> Storage::open(const std::string& path, const Storage::Config& config) {
  std::unique_lock<std::mutex> registry(g_open_mu);
  const std::string key = canonical(path);
  if (!config.read_only && g_open_paths.count(key) != 0) {
    return Status::Busy("cannot open tidal Db at '" + path + "': it is already open by another handle in this process");
  }
  if (Status s = check_path(path, config); !s.ok()) return s;

  rocksdb::Options options;
  options.create_if_missing = config.create_if_missing;
  options.create_missing_column_families = true;
  options.paranoid_checks = true;
  options.avoid_flush_during_shutdown = false;
  if (config.env != nullptr) options.env = config.env;

  std::vector<rocksdb::ColumnFamilyDescriptor> descriptors;
  for (const char* name : kColumnFamilies) descriptors.emplace_back(name, rocksdb::ColumnFamilyOptions(options));
  apply_state_store_options(config, &descriptors);

  auto storage = std::unique_ptr<Storage>(new Storage());
  storage->path_ = path;
  storage->read_only_ = config.read_only;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s;
  if (config.read_only) {
    // A Db written by an older layout may lack a column family: open those that exist.
    std::vector<std::string> existing;
    s = rocksdb::DB::ListColumnFamilies(options, path, &existing);
    if (!s.ok()) return from_rocksdb(s, "cannot open tidal Db at '" + path + "' read-only");
    std::vector<rocksdb::ColumnFamilyDescriptor> present;
    for (auto& d : descriptors) {
      for (auto& e : existing) {
        if (e == d.name) present.push_back(d);
      }
    }
    if (present.size() != descriptors.size()) {
      return Status::InvalidArgument("cannot open tidal Db at '" + path +
                                     "' read-only: it lacks tidal's column families (not a tidal Db, or never opened "
                                     "for writing)");
    }
    s = rocksdb::DB::OpenForReadOnly(options, path, present, &storage->handles_, &raw);
  } else {
    s = rocksdb::DB::Open(options, path, descriptors, &storage->handles_, &raw);
  }
  if (!s.ok()) {
    if (is_lock_error(s)) {
      return Status::Busy("cannot open tidal Db at '" + path +
                          "': it is already open by another handle (this process or another one): " + s.ToString());
    }
    return from_rocksdb(s, "cannot open tidal Db at '" + path + "'");
  }
  storage->db_.reset(raw);
  if (!config.read_only) {
    storage->registry_key_ = key;
    g_open_paths.insert(key);
  }
  return storage;
}

Storage::~Storage() {
  if (db_ != nullptr) (void)close();
}

Status Storage::write(rocksdb::WriteBatch* batch, WriteMode mode, std::string_view what) {
  if (read_only_) return Status::InvalidArgument(std::string(what) + ": the Db at '" + path_ + "' is open read-only");
  rocksdb::WriteOptions wo;
  wo.sync = mode == WriteMode::Sync;
  wo.disableWAL = mode == WriteMode::NoWal;
  return from_rocksdb(db_->Write(wo, batch), what);
}

void Storage::put_record(rocksdb::WriteBatch* batch, EntityId id, Tag tag, std::string_view suffix,
                         std::string_view value) const {
  const rocksdb::Slice v(value.data(), value.size());
  batch->Put(users(), encode_key(id, tag, suffix), v);
  if (is_indexed(tag)) batch->Put(by_tag(), encode_index_key(id, tag, suffix), v);
}

void Storage::delete_record(rocksdb::WriteBatch* batch, EntityId id, Tag tag, std::string_view suffix) const {
  batch->Delete(users(), encode_key(id, tag, suffix));
  if (is_indexed(tag)) batch->Delete(by_tag(), encode_index_key(id, tag, suffix));
}

Status Storage::get(rocksdb::ColumnFamilyHandle* cf, std::string_view key, std::string* value,
                    const rocksdb::Snapshot* snapshot) const {
  rocksdb::ReadOptions ro;
  ro.snapshot = snapshot;
  rocksdb::Status s = db_->Get(ro, cf, rocksdb::Slice(key.data(), key.size()), value);
  if (s.IsNotFound()) return Status::NotFound("no record");
  return from_rocksdb(s, "read from '" + path_ + "'");
}

std::unique_ptr<rocksdb::Iterator> Storage::iterator(rocksdb::ColumnFamilyHandle* cf, bool bulk,
                                                     const rocksdb::Snapshot* snapshot) const {
  rocksdb::ReadOptions ro;
  ro.snapshot = snapshot;
  if (bulk) {
    ro.readahead_size = 4 << 20;
    ro.fill_cache = false;
  }
  return std::unique_ptr<rocksdb::Iterator>(db_->NewIterator(ro, cf));
}

std::uint64_t Storage::estimate_keys(rocksdb::ColumnFamilyHandle* cf) const {
  std::uint64_t n = 0;
  return db_->GetIntProperty(cf, rocksdb::DB::Properties::kEstimateNumKeys, &n) ? n : 0;
}

Status Storage::flush() {
  if (read_only_) return Status::OK();
  rocksdb::FlushOptions fo;
  fo.wait = true;
  return from_rocksdb(db_->Flush(fo, handles_), "flush of '" + path_ + "'");
}

Status Storage::close() {
  if (db_ == nullptr) return Status::OK();
  Status result = flush();
  for (auto* h : handles_) {
    if (Status s = from_rocksdb(db_->DestroyColumnFamilyHandle(h), "close of '" + path_ + "'"); !s.ok() && result.ok()) {
      result = s;
    }
  }
  handles_.clear();
  if (Status s = from_rocksdb(db_->Close(), "close of '" + path_ + "'"); !s.ok() && result.ok()) result = s;
  db_.reset();
  if (!registry_key_.empty()) {
    std::lock_guard<std::mutex> registry(g_open_mu);
    g_open_paths.erase(registry_key_);
  }
  return result;
}

}  // namespace tidal
