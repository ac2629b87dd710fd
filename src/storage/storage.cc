#include "storage/storage.h"

#include "storage/state_format.h"

#include <rocksdb/cache.h>
#include <rocksdb/filter_policy.h>
#include <rocksdb/table.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <mutex>
#include <system_error>
#include <utility>

namespace tidal {
namespace {

const char* const kColumnFamilies[] = {"default", "users", "by_tag", "aggregates", "ledger"};
constexpr char kFeedColumnFamily[] = "feed";

bool is_lock_error(const rocksdb::Status& s) {
  const std::string text = s.ToString();
  return s.IsIOError() && (text.find("/LOCK") != std::string::npos || text.find("lock hold") != std::string::npos);
}

// Directories this process has open for writing, keyed by the directory
// itself (device, inode) so that every alias of it (symlink, bind mount,
// "a/../a", trailing '/') finds the entry; the value is the canonical path
// the holder opened, for messages. RocksDB's own in-process lock table is
// keyed by the path string and an fcntl lock never conflicts with its own
// process, so without this table an alias would open a second writer.
// Guarded by g_open_mu, which open() holds from the check to the insert.
using DirId = std::pair<dev_t, ino_t>;
std::mutex g_open_mu;
std::map<DirId, std::string> g_open_dirs;

std::string canonical(const std::string& path) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::weakly_canonical(path, ec);
  return ec ? path : p.string();
}

// Busy when this process already has the directory at `path` open for
// writing (under any name). Requires g_open_mu.
Status check_not_open_here(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::OK();  // no directory yet: nothing open there
  auto it = g_open_dirs.find({st.st_dev, st.st_ino});
  if (it == g_open_dirs.end()) return Status::OK();
  return Status::Busy("cannot open tidal Db at '" + path + "': it is already open for writing by another handle in "
                      "this process, as '" + it->second + "'");
}

// Busy when another process holds RocksDB's lock on the directory. Opens and
// closes a descriptor of LOCK: an fcntl lock dies with ANY descriptor of its
// file that its process closes, so this must run only after
// check_not_open_here() has shown this process does not hold the lock.
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

// RocksDB's info LOG, written so that it can never take the host down.
//
// RocksDB's own file logger writes through a WritableFileWriter, which
// asserts when it is written again after a failed write (Debian's librocksdb
// keeps assertions): on a full or read-only disk the LOG's first ENOSPC/EROFS,
// then the line RocksDB logs about that very error (ErrorHandler::SetBGError)
// aborted the host. Here each line is formatted and handed to one write(2) on
// an O_APPEND descriptor; a failed open or write loses that line and nothing
// else, and no later call depends on it.
//
// The level stays RocksDB's default, INFO: the lines that explain an incident
// (opens, flushes, compactions, background errors) are INFO and WARN, and an
// open/close logs ~55 KB (mostly the options of the four column families).
// The file is bounded instead: one LOG appended to by every open (RocksDB's
// logger started a new one per open and kept the old as LOG.old.<time>: 220
// files after 200 opens), renamed LOG.old (replacing the previous one) once
// it passes kMaxBytes. A Db directory holds two info logs, about 2 MiB.
class InfoLog final : public rocksdb::Logger {
 public:
  static constexpr off_t kMaxBytes = 1 << 20;

  explicit InfoLog(std::string dir) : log_path_(dir + "/LOG"), old_path_(dir + "/LOG.old") {}
  ~InfoLog() override {
    if (fd_ >= 0) ::close(fd_);
  }

  using rocksdb::Logger::Logv;
  void Logv(const char* format, va_list ap) override {
    std::string line = prefix();
    va_list copy;
    va_copy(copy, ap);
    const int n = std::vsnprintf(nullptr, 0, format, copy);
    va_end(copy);
    if (n > 0) {
      const std::size_t start = line.size();
      line.resize(start + static_cast<std::size_t>(n) + 1);
      std::vsnprintf(line.data() + start, static_cast<std::size_t>(n) + 1, format, ap);
      line.pop_back();  // the terminating NUL
    }
    if (line.back() != '\n') line += '\n';
    std::lock_guard<std::mutex> lock(mu_);
    // The directory does not exist yet when a new Db's first lines arrive,
    // and a descriptor may have failed to open: try again on each line.
    if (fd_ < 0 && !open_locked()) return;
    const ssize_t written = ::write(fd_, line.data(), line.size());
    if (written > 0) size_ += written;
    if (size_ >= kMaxBytes) rotate_locked();
  }

 private:
  // "2026/11/30-03:35:12.123456 4242 ", as RocksDB's logger starts a line.
  static std::string prefix() {
    timespec ts{};
    ::clock_gettime(CLOCK_REALTIME, &ts);
    tm t{};
    ::localtime_r(&ts.tv_sec, &t);
    char buf[64];
    const int n = std::snprintf(buf, sizeof buf, "%04d/%02d/%02d-%02d:%02d:%02d.%06ld %d ", t.tm_year + 1900,
                                t.tm_mon + 1, t.tm_mday, t.tm_hour, t.tm_min, t.tm_sec, ts.tv_nsec / 1000,
                                static_cast<int>(::gettid()));
    return std::string(buf, n > 0 ? static_cast<std::size_t>(n) : 0);
  }

  bool open_locked() {
    fd_ = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    struct stat st {};
    size_ = fd_ >= 0 && ::fstat(fd_, &st) == 0 ? st.st_size : 0;
    if (size_ >= kMaxBytes) rotate_locked();
    return fd_ >= 0;
  }

  // After a failed rename LOG keeps growing, and the next try is kMaxBytes later.
  void rotate_locked() {
    ::close(fd_);
    (void)::rename(log_path_.c_str(), old_path_.c_str());
    fd_ = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    size_ = 0;
  }

  const std::string log_path_;
  const std::string old_path_;
  std::mutex mu_;
  int fd_ = -1;    // guarded by mu_; -1 until opened, or after a failed open
  off_t size_ = 0;  // guarded by mu_
};

// Every RocksDB option tidal sets so that a Db survives a hostile file system
// (issue 9 items 3 and 10): a full or failing disk must fail writes, never
// abort the host, and a small disk must hold a Db.
void set_hostile_fs_options(const std::string& path, rocksdb::Options* options) {
  options->info_log = std::make_shared<InfoLog>(path);
  // RocksDB deletes info logs named LOG.old.<time> beyond this count at open
  // (the pile an older tidal left behind); the InfoLog's LOG and LOG.old are
  // not counted.
  options->keep_log_file_num = 1;
  // RocksDB preallocates each WAL in blocks of 1.1 x the largest
  // write_buffer_size (64 MiB: ~70 MiB), capped by max_total_wal_size. On a
  // 64 MiB ext4 (which keeps a partial fallocate) that reservation took the
  // whole disk: the first flush failed with ENOSPC. No preallocation: a WAL
  // takes what is written to it. It does not slow synced leaves (3,000 on a
  // loop-mounted ext4, median of 5-7 runs: 10.8 s preallocating ~70 MiB,
  // 9.8 s preallocating 4 MiB, 8.1 s with allow_fallocate off; runs vary by
  // +-25 %).
  options->allow_fallocate = false;
  // Once the WALs pass 16 MiB RocksDB flushes the column families holding
  // the oldest one, which bounds the disk they take (a 64 MiB write buffer
  // would otherwise fill a small disk with WAL before the first flush) and
  // the replay at open. The cap also sets the size of the state store's L0
  // files, since the writer fills the WAL faster than any memtable fills:
  // at 4 MiB (the first cap) the aggregates and ledger flushed ~1 MB files,
  // and each L0->L1 compaction rewrote all of L1 (~430 MB) for them. At 1M
  // users tidal-demo then ran at 29-37k signals/s and wrote 4.2 GB for 4M
  // signals, a leave waited up to 5.5 s behind a stalled write, and close()
  // waited 4.6-6.5 s for the compaction under way; at 16 MiB 45.7k
  // signals/s, 3.2 GB, 0.24 s and 1.3 s (bench/README.md, "The WAL cap").
  options->max_total_wal_size = 16 << 20;
}

// The state store's column families: a bounded block cache shared by every
// column family (index and filter blocks included), the integer-add merge
// operator on aggregates, and bloom filters so a point read of a cell that is
// not in a file skips it.
void apply_state_store_options(const Storage::Config& config, std::vector<rocksdb::ColumnFamilyDescriptor>* cfs) {
  rocksdb::BlockBasedTableOptions table;
  table.block_cache = rocksdb::NewLRUCache(config.block_cache_bytes);
  table.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
  // Index and filters count against the cache bound, partitioned: a point
  // read loads one small partition, not a whole file's filter (a 1 MiB
  // filter block per file, re-read after every eviction, made reads of a
  // 1M-cell Db 100x slower). Only the top-level index stays pinned.
  table.cache_index_and_filter_blocks = true;
  table.cache_index_and_filter_blocks_with_high_priority = true;
  table.index_type = rocksdb::BlockBasedTableOptions::kTwoLevelIndexSearch;
  table.partition_filters = true;
  table.metadata_block_size = 4096;
  table.pin_top_level_index_and_filter = true;
  for (auto& cf : *cfs) cf.options.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  (*cfs)[3].options.merge_operator = new_units_add_operator();
  // A purge force-compacts the purged user's key range of the ledger, which
  // rewrites every SST file overlapping it: small files keep that rewrite
  // (and the purge's latency) small. 1 MiB instead of RocksDB's 64 MiB: on
  // a 10M-entry ledger the compaction step of a purge took ~95 ms with 4 MiB
  // files and ~35 ms with 1 MiB (bench/README.md, "Purge").
  (*cfs)[4].options.target_file_size_base = 1 << 20;
  // The state store ingests one file per batch into each (Storage::ingest).
  // RocksDB puts an ingested file in the deepest level its keys do not
  // overlap, so a young Db's first batches landed one per level (L6, L5,
  // L4, ...), where no size target ever compacted them, and a score read
  // searched every one: p50 10 us instead of 3.7 (bench/README.md, "Score
  // reads"). With dynamic level sizes an ingested file goes to L0 or to the
  // lowest level in use, and a compaction starts at 2 level-0 files, so a
  // quiet Db settles into few files. Under load, a compaction takes every L0
  // file there is: room for kPaceL0Files of them before RocksDB slows writes.
  for (std::size_t i : {3u, 4u}) {
    auto& options = (*cfs)[i].options;
    options.level_compaction_dynamic_level_bytes = true;
    options.level0_file_num_compaction_trigger = 2;
    options.level0_slowdown_writes_trigger = Storage::kL0SlowdownFiles;
    options.level0_stop_writes_trigger = Storage::kL0StopFiles;
  }
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
  if (!config.read_only) {
    if (Status s = check_not_open_here(path); !s.ok()) return s;
  }
  if (Status s = check_path(path, config); !s.ok()) return s;

  rocksdb::Options options;
  options.create_if_missing = config.create_if_missing;
  options.create_missing_column_families = true;
  options.paranoid_checks = true;
  options.avoid_flush_during_shutdown = false;
  if (config.env != nullptr) options.env = config.env;
  // A read-only open writes nothing, not even a LOG (RocksDB then logs nowhere).
  if (!config.read_only) set_hostile_fs_options(path, &options);
  // RocksDB's memtables, across every column family, stay within 64 MiB
  // (besides tidal's own write buffers and the block cache).
  options.db_write_buffer_size = 64 << 20;

  std::vector<rocksdb::ColumnFamilyDescriptor> descriptors;
  for (const char* name : kColumnFamilies) descriptors.emplace_back(name, rocksdb::ColumnFamilyOptions(options));
  // The change feed's column family exists once a writable open with
  // Options::change_feed created it (create_feed).
  std::vector<std::string> existing;
  const bool listed = rocksdb::DB::ListColumnFamilies(options, path, &existing).ok();
  const bool has_feed = listed && std::find(existing.begin(), existing.end(), kFeedColumnFamily) != existing.end();
  // A RocksDB database of another kind (a GlobalView's directory, say) has
  // column families but not tidal's: a writable open would add tidal's to
  // it. (Only "default" may be a tidal Db whose creation was cut short; a
  // read-only open refuses any database without tidal's column families.)
  if (!config.read_only && listed && existing.size() > 1 &&
      std::find(existing.begin(), existing.end(), "users") == existing.end()) {
    std::string names;
    for (const std::string& n : existing) names += (names.empty() ? "" : ", ") + n;
    return Status::InvalidArgument("cannot open tidal Db at '" + path +
                                   "': it holds another RocksDB database, not a tidal Db (its column families: " +
                                   names + "); nothing changed");
  }
  if (has_feed) descriptors.emplace_back(kFeedColumnFamily, rocksdb::ColumnFamilyOptions(options));
  apply_state_store_options(config, &descriptors);

  auto storage = std::unique_ptr<Storage>(new Storage());
  storage->path_ = path;
  storage->read_only_ = config.read_only;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s;
  if (config.read_only) {
    // A Db written by an older layout may lack a column family: open those that exist.
    if (!listed) {
      return from_rocksdb(rocksdb::DB::ListColumnFamilies(options, path, &existing),
                          "cannot open tidal Db at '" + path + "' read-only");
    }
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
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      const int err = errno;
      (void)storage->close();
      return Status::IOError("cannot open tidal Db at '" + path + "': stat of the directory failed (" +
                             std::strerror(err) + ")");
    }
    // Files a crash left half-built for the state store's next ingestion.
    rocksdb::Env* env = storage->db_->GetEnv();
    std::vector<std::string> leftovers;
    if (env->GetChildren(storage->ingest_dir(), &leftovers).ok()) {
      for (const std::string& f : leftovers) storage->delete_file(storage->ingest_dir() + "/" + f);
    }
    if (rocksdb::Status cs = env->CreateDirIfMissing(storage->ingest_dir()); !cs.ok()) {
      (void)storage->close();
      return from_rocksdb(cs, "cannot open tidal Db at '" + path + "': creating " + storage->ingest_dir() + " failed");
    }
    storage->registry_id_ = {st.st_dev, st.st_ino};
    g_open_dirs.emplace(*storage->registry_id_, canonical(path));
  }
  return storage;
}

Status Storage::create_feed() {
  if (feed() != nullptr) return Status::OK();
  rocksdb::ColumnFamilyOptions options(db_->GetOptions(handles_[0]));
  rocksdb::ColumnFamilyHandle* handle = nullptr;
  if (Status s = from_rocksdb(db_->CreateColumnFamily(options, kFeedColumnFamily, &handle),
                              "creating the change feed of '" + path_ + "'");
      !s.ok()) {
    return s;
  }
  handles_.push_back(handle);
  return Status::OK();
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

std::unique_ptr<rocksdb::SstFileWriter> Storage::sst_writer(rocksdb::ColumnFamilyHandle* cf) const {
  const rocksdb::Options options = db_->GetOptions(cf);
  // Keep the file's pages cached: ingest() copies it right away.
  return std::make_unique<rocksdb::SstFileWriter>(rocksdb::EnvOptions(options), options, cf,
                                                  /*invalidate_page_cache=*/false);
}

Status Storage::ingest(const std::vector<std::pair<rocksdb::ColumnFamilyHandle*, std::string>>& files,
                       std::string_view what) {
  if (read_only_) return Status::InvalidArgument(std::string(what) + ": the Db at '" + path_ + "' is open read-only");
  std::vector<rocksdb::IngestExternalFileArg> args;
  for (const auto& [cf, file] : files) {
    rocksdb::IngestExternalFileArg& arg = args.emplace_back();
    arg.column_family = cf;
    arg.external_files.push_back(file);
    // Copied, not linked: a copy is written and fsynced through the Db's
    // file system like every other file of the Db.
    arg.options.move_files = false;
    // The file's sequence number lives in the MANIFEST only: no rewrite of
    // the file after it is copied.
    arg.options.write_global_seqno = false;
  }
  return from_rocksdb(db_->IngestExternalFiles(args), what);
}

void Storage::delete_file(const std::string& file) const { (void)db_->GetEnv()->DeleteFile(file); }

Status Storage::flush() {
  if (read_only_) return Status::OK();
  rocksdb::FlushOptions fo;
  fo.wait = true;
  // RocksDB's default first waits until the flush would not stall writes,
  // i.e. for compactions of L0, which at 1M users ran for 34 s: close()
  // waited 35.8 s, and a purge as long.
  fo.allow_write_stall = true;
  return from_rocksdb(db_->Flush(fo, handles_), "flush of '" + path_ + "'");
}

bool Storage::compaction_behind() const {
  if (read_only_) return false;
  std::uint64_t v = 0;
  if (db_->GetIntProperty(rocksdb::DB::Properties::kIsWriteStopped, &v) && v != 0) return true;
  if (db_->GetIntProperty(rocksdb::DB::Properties::kActualDelayedWriteRate, &v) && v != 0) return true;
  for (rocksdb::ColumnFamilyHandle* cf : {aggregates(), ledger()}) {
    std::string files;
    if (db_->GetProperty(cf, rocksdb::DB::Properties::kNumFilesAtLevelPrefix + "0", &files) &&
        std::strtoull(files.c_str(), nullptr, 10) >= kPaceL0Files) {
      return true;
    }
  }
  return false;
}

Status Storage::close() {
  if (db_ == nullptr) return Status::OK();
  if (!read_only_) {
    // RocksDB deletes a WAL only once a flush has moved every column family
    // past it; with empty memtables Flush does nothing, and each open/close
    // would leave one more WAL to replay. A memtable-only record makes the
    // flush happen.
    rocksdb::WriteBatch marker;
    marker.Put(meta(), kCleanCloseKey, "");
    (void)write(&marker, WriteMode::NoWal, "close marker");
  }
  Status result = flush();
  for (auto* h : handles_) {
    if (Status s = from_rocksdb(db_->DestroyColumnFamilyHandle(h), "close of '" + path_ + "'"); !s.ok() && result.ok()) {
      result = s;
    }
  }
  handles_.clear();
  if (Status s = from_rocksdb(db_->Close(), "close of '" + path_ + "'"); !s.ok() && result.ok()) result = s;
  db_.reset();
  if (registry_id_) {
    std::lock_guard<std::mutex> registry(g_open_mu);
    g_open_dirs.erase(*registry_id_);
    registry_id_.reset();
  }
  return result;
}

Result<std::uint64_t> read_clock_floor(const Storage& storage) {
  std::uint64_t floor = 0;
  const rocksdb::Slice prefix(kClockFloorPrefix);
  auto it = storage.iterator(storage.meta());
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    const std::optional<std::uint64_t> ts = deserialize_clock_floor({it->value().data(), it->value().size()});
    if (!ts) {
      return Status::Corruption("clock floor record " + hex({it->key().data(), it->key().size()}) + " of '" +
                                storage.path() + "' is not 8 bytes");
    }
    floor = std::max(floor, *ts);
  }
  if (Status s = from_rocksdb(it->status(), "clock floor read of '" + storage.path() + "'"); !s.ok()) return s;
  return floor;
}

}  // namespace tidal
