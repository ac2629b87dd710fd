#include "storage/storage.h"

#include "storage/sealed_ledger.h"
#include "storage/secret.h"
#include "storage/state_format.h"

#include <rocksdb/cache.h>
#include <rocksdb/compaction_filter.h>
#include <rocksdb/convenience.h>
#include <rocksdb/file_system.h>
#include <rocksdb/filter_policy.h>
#include <rocksdb/listener.h>
#include <rocksdb/slice_transform.h>
#include <rocksdb/snapshot.h>
#include <rocksdb/table.h>
#include <rocksdb/table_properties.h>
#include <rocksdb/threadpool.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <system_error>
#include <unordered_set>
#include <utility>

namespace tidal {
namespace {

constexpr char kFeedColumnFamily[] = "feed";
// Format 4's key store (storage/sealed_ledger.h).
constexpr char kWrappedKeysFamily[] = "wrapped_keys";
constexpr char kBucketKeysFamily[] = "bucket_keys";
// The key store of development builds of 0.4 before the bucket keys: each
// user's key unwrapped, under [user_id BE]. Not read.
constexpr char kUnwrappedKeysFamily[] = "keys";

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
//
// No line names a key: RocksDB writes a key it logs (a manual compaction's
// range, a corrupt entry's key) as quoted hex ('0000000000000007130000...'),
// and a ledger, receipt or key-store key names a user. Each such run of hex
// digits is written as '<key>' (docs/PURGE.md, "What an attacker holding the
// files can learn").
class InfoLog final : public rocksdb::Logger {
 public:
  static constexpr off_t kMaxBytes = 1 << 20;

  explicit InfoLog(std::string dir) : log_path_(dir + "/LOG"), old_path_(dir + "/LOG.old") {}
  ~InfoLog() override {
    if (fd_ >= 0) ::close(fd_);
  }

  // Replaces, in place, every quoted run of two or more hex digits by
  // '<key>'.
  static void redact_keys(std::string* line) {
    std::string out;
    out.reserve(line->size());
    std::size_t at = 0;
    while (at < line->size()) {
      const std::size_t open = line->find('\'', at);
      if (open == std::string::npos) break;
      std::size_t end = open + 1;
      while (end < line->size() && std::isxdigit(static_cast<unsigned char>((*line)[end]))) ++end;
      out.append(*line, at, open + 1 - at);
      if (end < line->size() && (*line)[end] == '\'' && end - open - 1 >= 2) {
        out += "<key>'";
        at = end + 1;
      } else {
        at = open + 1;
      }
    }
    if (at == 0) return;
    out.append(*line, at, std::string::npos);
    *line = std::move(out);
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
    redact_keys(&line);
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
  // RocksDB resumes an engine stopped by a retryable error (ENOSPC, as
  // NoSpaceIsRetryable reports it) by itself, one attempt every interval
  // until one succeeds (Storage::recover waits for the next one).
  options->max_bgerror_resume_count = std::numeric_limits<int>::max();
  options->bgerror_resume_retry_interval =
      static_cast<std::uint64_t>(std::chrono::microseconds(Storage::kResumeInterval).count());
}

bool is_no_space(const rocksdb::Status& s) {
  return s.IsNoSpace() || s.ToString().find("No space left on device") != std::string::npos;
}

// ENOSPC reported to RocksDB as a retryable I/O error, the message kept
// ("IO error: No space left on device: While appending to file: ..."):
// RocksDB 7.8.3 resumes an engine after a retryable error completely, and
// after a NoSpace one only in part (Storage::recover).
rocksdb::IOStatus retryable_if_no_space(rocksdb::IOStatus s) {
  if (!s.IsNoSpace()) return s;
  rocksdb::IOStatus r = rocksdb::IOStatus::IOError("No space left on device", s.getState() ? s.getState() : "");
  r.SetRetryable(true);
  return r;
}

class NoSpaceIsRetryableFile final : public rocksdb::FSWritableFileOwnerWrapper {
 public:
  using IOStatus = rocksdb::IOStatus;
  using IOOptions = rocksdb::IOOptions;
  using IODebugContext = rocksdb::IODebugContext;
  using Slice = rocksdb::Slice;
  explicit NoSpaceIsRetryableFile(std::unique_ptr<rocksdb::FSWritableFile>&& target)
      : FSWritableFileOwnerWrapper(std::move(target)) {}
  IOStatus Append(const Slice& data, const IOOptions& o, IODebugContext* dbg) override {
    return retryable_if_no_space(target()->Append(data, o, dbg));
  }
  IOStatus Append(const Slice& data, const IOOptions& o, const rocksdb::DataVerificationInfo& info,
                  IODebugContext* dbg) override {
    return retryable_if_no_space(target()->Append(data, o, info, dbg));
  }
  IOStatus PositionedAppend(const Slice& data, uint64_t offset, const IOOptions& o, IODebugContext* dbg) override {
    return retryable_if_no_space(target()->PositionedAppend(data, offset, o, dbg));
  }
  IOStatus PositionedAppend(const Slice& data, uint64_t offset, const IOOptions& o,
                            const rocksdb::DataVerificationInfo& info, IODebugContext* dbg) override {
    return retryable_if_no_space(target()->PositionedAppend(data, offset, o, info, dbg));
  }
  IOStatus Truncate(uint64_t size, const IOOptions& o, IODebugContext* dbg) override {
    return retryable_if_no_space(target()->Truncate(size, o, dbg));
  }
  IOStatus Close(const IOOptions& o, IODebugContext* dbg) override {
    return retryable_if_no_space(target()->Close(o, dbg));
  }
  IOStatus Flush(const IOOptions& o, IODebugContext* dbg) override {
    return retryable_if_no_space(target()->Flush(o, dbg));
  }
  IOStatus Sync(const IOOptions& o, IODebugContext* dbg) override {
    return retryable_if_no_space(target()->Sync(o, dbg));
  }
  IOStatus Fsync(const IOOptions& o, IODebugContext* dbg) override {
    return retryable_if_no_space(target()->Fsync(o, dbg));
  }
  IOStatus RangeSync(uint64_t offset, uint64_t nbytes, const IOOptions& o, IODebugContext* dbg) override {
    return retryable_if_no_space(target()->RangeSync(offset, nbytes, o, dbg));
  }
  IOStatus Allocate(uint64_t offset, uint64_t len, const IOOptions& o, IODebugContext* dbg) override {
    return retryable_if_no_space(target()->Allocate(offset, len, o, dbg));
  }
};

class NoSpaceIsRetryable final : public rocksdb::FileSystemWrapper {
 public:
  using IOStatus = rocksdb::IOStatus;
  using IOOptions = rocksdb::IOOptions;
  using IODebugContext = rocksdb::IODebugContext;
  using FileOptions = rocksdb::FileOptions;
  explicit NoSpaceIsRetryable(const std::shared_ptr<rocksdb::FileSystem>& target) : FileSystemWrapper(target) {}
  static const char* kClassName() { return "TidalNoSpaceIsRetryable"; }
  const char* Name() const override { return kClassName(); }
  IOStatus NewWritableFile(const std::string& f, const FileOptions& o, std::unique_ptr<rocksdb::FSWritableFile>* r,
                           IODebugContext* dbg) override {
    return wrap(target()->NewWritableFile(f, o, r, dbg), r);
  }
  IOStatus ReopenWritableFile(const std::string& f, const FileOptions& o,
                              std::unique_ptr<rocksdb::FSWritableFile>* r, IODebugContext* dbg) override {
    return wrap(target()->ReopenWritableFile(f, o, r, dbg), r);
  }
  IOStatus ReuseWritableFile(const std::string& f, const std::string& old, const FileOptions& o,
                             std::unique_ptr<rocksdb::FSWritableFile>* r, IODebugContext* dbg) override {
    return wrap(target()->ReuseWritableFile(f, old, o, r, dbg), r);
  }
  IOStatus RenameFile(const std::string& s, const std::string& d, const IOOptions& o, IODebugContext* dbg) override {
    return retryable_if_no_space(target()->RenameFile(s, d, o, dbg));
  }
  IOStatus LinkFile(const std::string& s, const std::string& d, const IOOptions& o, IODebugContext* dbg) override {
    return retryable_if_no_space(target()->LinkFile(s, d, o, dbg));
  }

 private:
  static IOStatus wrap(IOStatus s, std::unique_ptr<rocksdb::FSWritableFile>* r) {
    if (s.ok()) *r = std::make_unique<NoSpaceIsRetryableFile>(std::move(*r));
    return retryable_if_no_space(std::move(s));
  }
};

// The base Env with NoSpaceIsRetryable over its file system.
class NoSpaceIsRetryableEnv final : public rocksdb::EnvWrapper {
 public:
  explicit NoSpaceIsRetryableEnv(rocksdb::Env* base) : EnvWrapper(base) {
    file_system_ = std::make_shared<NoSpaceIsRetryable>(base->GetFileSystem());
    system_clock_ = base->GetSystemClock();
  }
  const char* Name() const override { return "TidalNoSpaceIsRetryableEnv"; }
};

// Tells Storage::recover when an engine stops writing and when RocksDB has
// resumed it (EngineHealth), and counts the default column family's
// memtable switches (the anchor: Storage::anchor).
class ErrorWatch final : public rocksdb::EventListener {
 public:
  explicit ErrorWatch(std::shared_ptr<EngineHealth> health) : health_(std::move(health)) {}
  const char* Name() const override { return "TidalErrorWatch"; }
  void OnBackgroundError(rocksdb::BackgroundErrorReason reason, rocksdb::Status* error) override {
    if (error->ok()) return;
    // A retryable error arrives without a severity; RocksDB makes it a soft
    // one for a compaction (which it reschedules), a hard one otherwise, and
    // resumes the engine by itself. Any other error arrives with its
    // severity; below a hard one writes go on.
    const auto severity = error->severity();
    const bool retryable = severity == rocksdb::Status::Severity::kNoError;
    if (retryable ? reason == rocksdb::BackgroundErrorReason::kCompaction
                  : severity < rocksdb::Status::Severity::kHardError) {
      return;
    }
    {
      std::lock_guard<std::mutex> lock(health_->mu);
      health_->stopped.store(true, std::memory_order_release);
      if (severity >= rocksdb::Status::Severity::kFatalError) health_->needs_reopen = true;
      ++health_->failures;
      health_->error = error->ToString();
    }
    health_->changed.notify_all();
  }
  void OnErrorRecoveryEnd(const rocksdb::BackgroundErrorRecoveryInfo& info) override {
    if (info.new_bg_error.IsShutdownInProgress()) return;
    {
      std::lock_guard<std::mutex> lock(health_->mu);
      if (info.new_bg_error.ok()) {
        health_->stopped.store(false, std::memory_order_release);
        health_->recoveries.fetch_add(1, std::memory_order_relaxed);
      } else {
        // RocksDB gave up: no attempt follows.
        health_->needs_reopen = true;
        health_->error = info.new_bg_error.ToString();
      }
    }
    health_->changed.notify_all();
  }
  void OnMemTableSealed(const rocksdb::MemTableInfo& info) override {
    if (info.cf_name == rocksdb::kDefaultColumnFamilyName) health_->seals.fetch_add(1, std::memory_order_acq_rel);
  }

 private:
  const std::shared_ptr<EngineHealth> health_;
};

// The column families of a state store (the state engine's, or format 2's
// in the users engine while it is migrated): the integer-add merge operator
// on the aggregates, small ledger files, and compaction settings for a
// column family fed by ingestion.
void set_state_cf_options(const std::string& name, rocksdb::ColumnFamilyOptions* options) {
  if (name == "aggregates") options->merge_operator = new_units_add_operator();
  // A purge force-compacts the purged user's key range of the ledger, which
  // rewrites every SST file overlapping it: small files keep that rewrite
  // (and the purge's latency) small. 1 MiB instead of RocksDB's 64 MiB: on
  // a 10M-entry ledger the compaction step of a purge took ~95 ms with 4 MiB
  // files and ~35 ms with 1 MiB (bench/README.md, "Purge").
  if (name == "ledger") options->target_file_size_base = 1 << 20;
  // A purge seeks each purged user's index entries by pseudonym: prefix
  // bloom filters let the seek skip every file without the pseudonym.
  // Without them each seek read a block of every level-0 file, and at 1M
  // users, with ~100 of them behind, a bulk purge of 5,000 users took 11.8 s
  // (bench/README.md, "Format 4").
  if (name == "sealed_index") options->prefix_extractor.reset(rocksdb::NewFixedPrefixTransform(kPseudonymSize));
  // Ciphertext does not compress: RocksDB would try each block in vain.
  // (Its keys begin with the epoch, so each batch's file goes to the last
  // level and stays there: storage/sealed_ledger.h.)
  if (name == "sealed_ledger") options->compression = rocksdb::kNoCompression;
  if (name == "aggregates" || name == "ledger" || name == "sealed_ledger" || name == "sealed_index") {
    // The state store ingests one file per batch into each (Storage::ingest).
    // RocksDB puts an ingested file in the deepest level its keys do not
    // overlap, so a young Db's first batches landed one per level (L6, L5,
    // L4, ...), where no size target ever compacted them, and a score read
    // searched every one: p50 10 us instead of 3.7 (bench/README.md, "Score
    // reads"). With dynamic level sizes an ingested file goes to L0 or to the
    // lowest level in use, and a compaction starts at 2 level-0 files, so a
    // quiet Db settles into few files.
    options->level_compaction_dynamic_level_bytes = true;
    options->level0_file_num_compaction_trigger = 2;
  }
  // The sealed index's keys are in user order, so each batch's small file
  // overlaps all of it, and each compaction of level 0 rewrites the whole
  // index (140 MB at 1M users and 20M signals). Only a purge's seeks read
  // level 0 (prefix bloom filters skip a file without the pseudonym), so
  // level 0 may hold more files: each rewrite then takes 64 batches'
  // (at 16, on the light fan-out, the index's compactions cost as much
  // merge CPU as format 3's whole ledger: bench/README.md, "Session 31").
  // Admission counts them from 100 on (kDebtStartL0Files).
  if (name == "sealed_index") options->level0_file_num_compaction_trigger = 64;
  // No write stalls: RocksDB would delay or stop the writer's ingestions
  // and epoch marks, and a batch held back is a batch a crash may lose.
  // Admission control holds signals to a rate instead, and refuses them
  // at its hard stop (Storage::compaction_debt, StateStore::admit); these
  // triggers are far past that stop.
  options->level0_slowdown_writes_trigger = 1 << 16;
  options->level0_stop_writes_trigger = 1 << 16;
  options->soft_pending_compaction_bytes_limit = 0;
  options->hard_pending_compaction_bytes_limit = 0;
}

// The bucket keys' table property that Storage::may_hold_keys_of reads
// (docs/FORMAT.md): the number of values (entries that are not deletions)
// the file holds, 8 bytes big-endian, then a Bloom filter of their groups
// (mix64 of the group number: a key's first two bytes, whatever its
// bucket's depth), 10 bits a value and 7 probes of one 64-bit hash (double
// hashing), at least 64 bits. A key of another length (none is written)
// leaves the file without the property. The name carries the layout's
// version: a reader treats a file without this name as one that may hold
// any key, so a new layout must have a new name, or its filters would rule
// out keys the files hold. Version 1 filtered the buckets of depth 16 (its
// files hold no other key), which are their groups: a reader takes both.
constexpr char kKeyValuesProperty[] = "tidal.bucket_values.v2";
constexpr char kKeyValuesPropertyV1[] = "tidal.bucket_values.v1";
constexpr int kKeyValuesProbes = 7;

template <typename Bit>
bool key_values_probe(std::uint64_t hash, std::uint64_t bits, Bit bit) {
  const std::uint64_t step = (hash >> 32) | 1;
  for (int i = 0; i < kKeyValuesProbes; ++i, hash += step) {
    if (!bit(hash % bits)) return false;
  }
  return true;
}

class KeyValuesCollector : public rocksdb::TablePropertiesCollector {
 public:
  rocksdb::Status AddUserKey(const rocksdb::Slice& key, const rocksdb::Slice& /*value*/, rocksdb::EntryType type,
                             rocksdb::SequenceNumber /*seq*/, std::uint64_t /*file_size*/) override {
    if (type == rocksdb::kEntryDelete || type == rocksdb::kEntrySingleDelete ||
        type == rocksdb::kEntryDeleteWithTimestamp || type == rocksdb::kEntryRangeDeletion) {
      return rocksdb::Status::OK();
    }
    if (key.size() != kBucketKeySize && key.size() != kDeepBucketKeySize) other_ = true;
    else hashes_.push_back(mix64(static_cast<std::uint64_t>(static_cast<unsigned char>(key[0])) << 8 |
                                 static_cast<unsigned char>(key[1])));
    return rocksdb::Status::OK();
  }
  rocksdb::Status Finish(rocksdb::UserCollectedProperties* properties) override {
    if (other_) return rocksdb::Status::OK();
    std::string property;
    put_u64_be(&property, hashes_.size());
    const std::size_t bytes = std::max<std::size_t>(8, (hashes_.size() * 10 + 7) / 8);
    property.resize(8 + bytes, '\0');
    char* filter = property.data() + 8;
    for (std::uint64_t h : hashes_) {
      key_values_probe(h, bytes * 8, [&](std::uint64_t b) {
        filter[b / 8] = static_cast<char>(filter[b / 8] | (1 << (b % 8)));
        return true;
      });
    }
    properties->emplace(kKeyValuesProperty, std::move(property));
    return rocksdb::Status::OK();
  }
  rocksdb::UserCollectedProperties GetReadableProperties() const override { return {}; }
  const char* Name() const override { return "tidal.KeyValues"; }

 private:
  std::vector<std::uint64_t> hashes_;
  bool other_ = false;
};

class KeyValuesCollectorFactory : public rocksdb::TablePropertiesCollectorFactory {
 public:
  rocksdb::TablePropertiesCollector* CreateTablePropertiesCollector(
      rocksdb::TablePropertiesCollectorFactory::Context /*context*/) override {
    return new KeyValuesCollector();
  }
  const char* Name() const override { return "tidal.KeyValues"; }
};

// The bucket keys (format 4), in the users engine: a purge erases the
// bucket keys it replaced by compacting in place the files that hold them,
// so small files keep that rewrite small (256 KiB instead of RocksDB's 64
// MiB), and with dynamic level sizes a young Db's files settle into few
// levels. The keys are random bytes, which no compression shrinks: not
// compressed (a single purge's rewrite of a 1 MiB Snappy file took 22-26 ms
// at p50 and 55-85 ms at p99 with signals flowing, of a 256 KiB plain one
// 10 and 43 ms; bench/README.md, "Session 37"). They sit in the users
// engine, not beside the ledger in the state engine, because RocksDB
// deletes a file replaced by a compaction only once every compaction of the
// engine that began before the file was written has ended: in the state
// engine the erasure of a bulk purge waited 9.7 s for the aggregates' and
// the sealed ledger's compactions (bench/README.md, "Format 4").
void set_bucket_key_options(rocksdb::ColumnFamilyOptions* options) {
  options->target_file_size_base = 256 << 10;
  options->compression = rocksdb::kNoCompression;
  options->write_buffer_size = 4 << 20;
  options->level_compaction_dynamic_level_bytes = true;
  // Which buckets' keys each file holds (Storage::may_hold_keys_of).
  options->table_properties_collector_factories.push_back(std::make_shared<KeyValuesCollectorFactory>());
}

// The wrapped keys: never erased physically (what erases a user's key is
// the erasure of the bucket key that wrapped it), so RocksDB's own file
// sizes; random bytes, so not compressed.
void set_wrapped_key_options(rocksdb::ColumnFamilyOptions* options) {
  options->compression = rocksdb::kNoCompression;
  // Keys arrive as users first contribute (~1M in the demo's first minutes,
  // 66 bytes each): small memtables flush them soon instead of holding up to
  // 64 MiB of them in memory (RocksDB's default).
  options->write_buffer_size = 4 << 20;
  options->level_compaction_dynamic_level_bytes = true;
}

// The users engine's Env: its files go through the base Env's file system,
// its flushes and compactions run on two threads of its own instead of the
// base Env's pools (Env::Default's, which the state engine uses), so a stuck
// or busy state engine never holds up a users-engine flush or compaction,
// and with it a leave (issue 26, item 8). The two threads (one for flushes,
// one for compactions, as RocksDB's default max_background_jobs = 2 uses)
// are shared by the users engines of every Db of the process, created at
// the first open and kept until the process ends. RocksDB cannot take a job
// back from them (UnSchedule does nothing): a closing engine waits until
// its queued jobs have run, each of them returning at once.
class UsersEngineEnv : public rocksdb::EnvWrapper {
 public:
  explicit UsersEngineEnv(rocksdb::Env* base) : EnvWrapper(base) {
    file_system_ = base->GetFileSystem();
    system_clock_ = base->GetSystemClock();
  }
  static constexpr int kFlushThreads = 1;
  static constexpr int kCompactionThreads = 1;

  const char* Name() const override { return "TidalUsersEngineEnv"; }
  void Schedule(void (*fn)(void*), void* arg, Priority pri, void* /*tag*/, void (*/*unschedule*/)(void*)) override {
    pool(pri)->SubmitJob([fn, arg] { fn(arg); });
  }
  int UnSchedule(void* /*tag*/, Priority /*pri*/) override { return 0; }
  unsigned int GetThreadPoolQueueLen(Priority pri) const override { return pool(pri)->GetQueueLen(); }
  // HIGH (flushes) and LOW (compactions); none in BOTTOM, so RocksDB never
  // schedules there. Fixed sizes: RocksDB's requests for more are ignored.
  int GetBackgroundThreads(Priority pri) override {
    return pri == HIGH ? kFlushThreads : pri == LOW ? kCompactionThreads : 0;
  }
  void SetBackgroundThreads(int /*number*/, Priority /*pri*/) override {}
  void IncBackgroundThreadsIfNeeded(int /*number*/, Priority /*pri*/) override {}
  int ReserveThreads(int /*number*/, Priority /*pri*/) override { return 0; }
  int ReleaseThreads(int /*number*/, Priority /*pri*/) override { return 0; }
  void LowerThreadPoolIOPriority(Priority /*pool*/) override {}
  void LowerThreadPoolCPUPriority(Priority /*pool*/) override {}
  rocksdb::Status LowerThreadPoolCPUPriority(Priority /*pool*/, rocksdb::CpuPriority /*pri*/) override {
    return rocksdb::Status::OK();
  }

 private:
  // Never destroyed: a Db may still be open while static objects are.
  static rocksdb::ThreadPool* pool(Priority pri) {
    static rocksdb::ThreadPool* const flushes = rocksdb::NewThreadPool(kFlushThreads);
    static rocksdb::ThreadPool* const compactions = rocksdb::NewThreadPool(kCompactionThreads);
    return pri == HIGH ? flushes : compactions;
  }
};

// The column families of each engine, in the order of Storage's accessors.
const char* const kUsersFamilies[] = {"default", "users", "by_tag"};
const char* const kStateFamilies[] = {"default",       "aggregates",  "ledger",
                                      "receipts",      "sealed_ledger", "sealed_index"};
// Format 2 kept these in the users engine (storage/migrate.cc moves them).
const char* const kLegacyFamilies[] = {"aggregates", "ledger", "feed"};

bool contains(const std::vector<std::string>& names, std::string_view name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

}  // namespace

void set_table_options(const std::shared_ptr<rocksdb::Cache>& cache, rocksdb::ColumnFamilyOptions* options) {
  rocksdb::BlockBasedTableOptions table;
  table.block_cache = cache;
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
  options->table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
}

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

std::uintmax_t checkpoint_unlinked_bytes(rocksdb::DB* db, const std::string& dir) {
  std::uintmax_t bytes = 0;
  std::uint64_t memtables = 0;
  if (db->GetAggregatedIntProperty("rocksdb.cur-size-all-mem-tables", &memtables)) bytes += memtables;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_regular_file(ec) || name.rfind("LOG", 0) == 0 || name.ends_with(".sst")) continue;
    bytes += e.file_size(ec);
  }
  return bytes;
}

// Reclaims the space of a purged user's sealed records. A purge deletes the
// user's index keys and erases the key; the records stay in the sealed
// ledger's files, which the write-order layout never rewrites for a purge
// (storage/sealed_ledger.h). Whenever RocksDB does compact those files
// (periodic compaction, every kSealedReclaimPeriod; or a manual one), this
// filter drops each record no index key names any more: it cannot be
// opened, and no purge, check or reader ever looks for it.
//
// A ledger check (storage/ledger_scan.h) reads the sealed ledger at a
// snapshot, which a compaction filter does not honour: a record dropped
// after the check's snapshot was taken, whose purge came after it too,
// would be missing from the check's read, and the check would count the
// user's contributions in the aggregates but not in the ledger. So a check
// never reads a compaction's output with a snapshot older than a record it
// dropped:
//  - A check that lets go (most do) is asked to when a compaction's
//    filtering ends having dropped a record, before RocksDB installs the
//    compaction's output: a check that started before then starts over,
//    with a snapshot that sees every purge the filter saw; one that ended
//    before then never saw the output. (A compaction that drops nothing
//    leaves the checks alone.)
//  - While a check that does not let go (Storage::scans_holding) runs,
//    nothing is dropped. It is counted before it takes its snapshot, and the
//    filter reads the count after its read of the index: a check counted
//    later has a snapshot that sees the purge.
class SealedRecordReclaim : public rocksdb::CompactionFilterFactory {
 public:
  void attach(const Storage* storage) {
    std::unique_lock<std::shared_mutex> lock(mu_);
    storage_ = storage;
  }
  // Once it returns no filter reads the engine; a compaction still running
  // keeps every record.
  void detach() {
    std::unique_lock<std::shared_mutex> lock(mu_);
    storage_ = nullptr;
  }
  std::uint64_t reclaimed() const { return reclaimed_.load(std::memory_order_relaxed); }

  std::unique_ptr<rocksdb::CompactionFilter> CreateCompactionFilter(
      const rocksdb::CompactionFilter::Context& /*context*/) override {
    return std::make_unique<RecordFilter>(this);
  }
  const char* Name() const override { return "tidal.SealedRecordReclaim"; }

 private:
  class RecordFilter : public rocksdb::CompactionFilter {
   public:
    explicit RecordFilter(SealedRecordReclaim* reclaim) : reclaim_(reclaim) {}
    // RocksDB destroys the filter before it installs the compaction's output.
    ~RecordFilter() override {
      if (dropped_ > 0) reclaim_->ask_scans_to_let_go();
    }
    bool Filter(int /*level*/, const rocksdb::Slice& key, const rocksdb::Slice& /*value*/, std::string* /*new_value*/,
                bool* /*value_changed*/) const override {
      if (!reclaim_->unnamed({key.data(), key.size()}, &index_key_)) return false;
      ++dropped_;
      return true;
    }
    const char* Name() const override { return "tidal.SealedRecordReclaim"; }

   private:
    SealedRecordReclaim* const reclaim_;
    mutable std::string index_key_;
    mutable std::uint64_t dropped_ = 0;
  };

  void ask_scans_to_let_go() const {
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (storage_ != nullptr) storage_->ask_scans_to_let_go();
  }

  // Whether no index key names the sealed record `record_key`. Keeps (false)
  // a key that is not a record's, and on any error.
  bool unnamed(std::string_view record_key, std::string* index_key) {
    std::shared_lock<std::shared_mutex> lock(mu_);
    if (storage_ == nullptr || storage_->sealed_index() == nullptr) return false;
    if (!sealed_index_key_of(record_key, index_key)) return false;
    std::string value;
    const rocksdb::Status s =
        storage_->db(Storage::Engine::State)->Get(rocksdb::ReadOptions(), storage_->sealed_index(), *index_key, &value);
    if (!s.IsNotFound()) return false;
    // After the read: a check counted from here on took its snapshot after
    // the purge that deleted the index key.
    if (storage_->scans_holding().load(std::memory_order_seq_cst) > 0) return false;
    reclaimed_.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  mutable std::shared_mutex mu_;
  const Storage* storage_ = nullptr;  // guarded by mu_
  std::atomic<std::uint64_t> reclaimed_{0};
};

// The key store's erasure filter (Storage::KeysErased). It acts only in
// manual compactions, and only while an erasure has named its ranges; it
// keeps a value that is still the key's current one (a key made after a
// rejoin), or was when the erasure began, and every value whose current key
// it cannot read, which it counts: the erasure then fails, and stays marked
// (an injected read failure once let a purge report its erasure done with
// the value kept: PurgeFaultSweep). A value it drops becomes a deletion
// (RocksDB's kRemove), which a compaction into the last level drops in
// turn. RocksDB applies the filter whatever the snapshots: a key that a
// split (or another purge) replaced during the erasure may still be read
// at a snapshot taken before, and is kept (the erasure owes only the keys
// replaced before it began; a later purge of the group erases the others).
class KeyStoreErasure : public rocksdb::CompactionFilterFactory {
 public:
  explicit KeyStoreErasure(const Storage* storage) : storage_(storage) {}
  void begin(const std::vector<std::pair<std::string, std::string>>& ranges) {
    std::unique_lock<std::shared_mutex> lock(mu_);
    ranges_ = ranges;
    began_.emplace(storage_->db(Storage::Engine::Users));
    unread_.store(0, std::memory_order_relaxed);
  }
  void end() {
    std::unique_lock<std::shared_mutex> lock(mu_);
    ranges_.clear();
    began_.reset();
  }
  std::uint64_t unread() const { return unread_.load(std::memory_order_relaxed); }

  std::unique_ptr<rocksdb::CompactionFilter> CreateCompactionFilter(
      const rocksdb::CompactionFilter::Context& context) override {
    if (!context.is_manual_compaction) return nullptr;
    return std::make_unique<KeyFilter>(this);
  }
  const char* Name() const override { return "tidal.KeyStoreErasure"; }

 private:
  class KeyFilter : public rocksdb::CompactionFilter {
   public:
    explicit KeyFilter(KeyStoreErasure* erasure) : erasure_(erasure) {}
    bool Filter(int /*level*/, const rocksdb::Slice& key, const rocksdb::Slice& value, std::string* /*new_value*/,
                bool* /*value_changed*/) const override {
      const bool stale = erasure_->stale({key.data(), key.size()}, {value.data(), value.size()}, current_.buffer());
      current_.clear();  // a bucket key read back
      return stale;
    }
    const char* Name() const override { return "tidal.KeyStoreErasure"; }

   private:
    KeyStoreErasure* const erasure_;
    mutable SecretBytes current_;
  };

  // Whether `value` of `key` is in a range being erased, and is the key's
  // value neither when the erasure began nor now (a key never becomes
  // current again: each is new random bytes).
  bool stale(std::string_view key, std::string_view value, std::string* current) {
    std::shared_lock<std::shared_mutex> lock(mu_);
    auto r = std::upper_bound(ranges_.begin(), ranges_.end(), key,
                              [](std::string_view k, const auto& range) { return k < range.second; });
    if (r == ranges_.end() || key < r->first) return false;
    for (const rocksdb::Snapshot* at : {began_->snapshot(), static_cast<const rocksdb::Snapshot*>(nullptr)}) {
      rocksdb::ReadOptions read;
      read.snapshot = at;
      const rocksdb::Status s = storage_->db(Storage::Engine::Users)
                                    ->Get(read, storage_->bucket_keys(), rocksdb::Slice(key.data(), key.size()), current);
      if (s.ok() && *current == value) return false;
      if (!s.ok() && !s.IsNotFound()) {
        unread_.fetch_add(1, std::memory_order_relaxed);
        return false;
      }
    }
    return true;
  }

  const Storage* const storage_;
  mutable std::shared_mutex mu_;
  std::vector<std::pair<std::string, std::string>> ranges_;  // guarded by mu_
  std::optional<rocksdb::ManagedSnapshot> began_;              // guarded by mu_; while ranges_ are named
  std::atomic<std::uint64_t> unread_{0};
};

bool Storage::may_hold_keys_of(const rocksdb::TableProperties& file, const std::vector<std::uint64_t>& buckets) {
  if (buckets.empty()) return false;
  auto it = file.user_collected_properties.find(kKeyValuesProperty);
  if (it == file.user_collected_properties.end()) it = file.user_collected_properties.find(kKeyValuesPropertyV1);
  // A filter that saw fewer values than the file holds (RocksDB skips its
  // collectors for an entry it cannot parse) may rule out a key it holds.
  if (it == file.user_collected_properties.end() || it->second.size() < 16 ||
      get_u64_be(it->second.data()) != file.num_entries - file.num_deletions) {
    return true;
  }
  const std::string_view filter = std::string_view(it->second).substr(8);
  const std::uint64_t bits = filter.size() * 8;
  return std::any_of(buckets.begin(), buckets.end(), [&](std::uint64_t b) {
    return key_values_probe(mix64(b), bits, [&](std::uint64_t bit) {
      return (static_cast<unsigned char>(filter[bit / 8]) >> (bit % 8)) & 1;
    });
  });
}

Storage::KeysErased::KeysErased(const Storage& storage,
                                const std::vector<std::pair<std::string, std::string>>& ranges)
    : storage_(storage) {
  storage_.key_erasure_->begin(ranges);
}
Storage::KeysErased::~KeysErased() { storage_.key_erasure_->end(); }
std::uint64_t Storage::KeysErased::unread() const { return storage_.key_erasure_->unread(); }

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
  auto storage = std::unique_ptr<Storage>(new Storage());
  storage->env_ = std::make_unique<NoSpaceIsRetryableEnv>(config.env != nullptr ? config.env : rocksdb::Env::Default());
  options.env = storage->env_.get();
  // A read-only open writes nothing, not even a LOG (RocksDB then logs nowhere).
  if (!config.read_only) set_hostile_fs_options(path, &options);
  // Each engine's memtables, across its column families, stay within 64 MiB
  // (besides tidal's own write buffers and the block cache).
  options.db_write_buffer_size = 64 << 20;

  storage->users_env_ = std::make_unique<UsersEngineEnv>(options.env);
  // The users engine's own background threads; `options` stays the state
  // engine's base (open_state).
  rocksdb::Options users_options(options);
  users_options.env = storage->users_env_.get();
  if (!config.read_only) users_options.listeners.push_back(std::make_shared<ErrorWatch>(storage->health_[0]));
  storage->path_ = path;
  storage->read_only_ = config.read_only;
  storage->state_manifest_per_edit_ = config.state_manifest_per_edit;
  if (!config.read_only) storage->reclaim_ = std::make_shared<SealedRecordReclaim>();
  storage->key_erasure_ = std::make_shared<KeyStoreErasure>(storage.get());
  storage->block_cache_ = rocksdb::NewLRUCache(config.block_cache_bytes);

  std::vector<std::string> existing;
  const bool listed = rocksdb::DB::ListColumnFamilies(options, path, &existing).ok();
  // A RocksDB database of another kind (a GlobalView's directory, a Db's
  // state engine) has column families but not tidal's: a writable open
  // would add tidal's to it. (Only "default" may be a tidal Db whose
  // creation was cut short; a read-only open refuses any database without
  // tidal's column families.)
  if (!config.read_only && listed && existing.size() > 1 && !contains(existing, "users")) {
    std::string names;
    for (const std::string& n : existing) names += (names.empty() ? "" : ", ") + n;
    return Status::InvalidArgument("cannot open tidal Db at '" + path +
                                   "': it holds another RocksDB database, not a tidal Db (its column families: " +
                                   names + "); nothing changed");
  }
  std::vector<rocksdb::ColumnFamilyDescriptor> descriptors;
  for (const char* name : kUsersFamilies) descriptors.emplace_back(name, rocksdb::ColumnFamilyOptions(options));
  // Format 4's key store, when there is one: a writable open creates it
  // once the Db's checks passed (create_key_store); a read-only open of a
  // format-3 Db opens it without one.
  if (listed && contains(existing, kUnwrappedKeysFamily)) {
    return Status::InvalidArgument("cannot open tidal Db at '" + path +
                                   "': its key store was written by a development build of format 4 (each user's "
                                   "key unwrapped, in column family '" + kUnwrappedKeysFamily +
                                   "'); this version cannot read it. Re-create the Db (nothing changed)");
  }
  const bool has_wrapped = listed && contains(existing, kWrappedKeysFamily);
  const bool has_buckets = listed && contains(existing, kBucketKeysFamily);
  if (has_wrapped) descriptors.emplace_back(kWrappedKeysFamily, rocksdb::ColumnFamilyOptions(options));
  if (has_buckets) descriptors.emplace_back(kBucketKeysFamily, rocksdb::ColumnFamilyOptions(options));
  // Format 2's state store, still in the users engine: opened to be moved.
  for (const char* name : kLegacyFamilies) {
    if (listed && contains(existing, name)) descriptors.emplace_back(name, rocksdb::ColumnFamilyOptions(options));
  }
  for (auto& d : descriptors) {
    set_table_options(storage->block_cache_, &d.options);
    if (d.name == kWrappedKeysFamily) {
      set_wrapped_key_options(&d.options);
    } else if (d.name == kBucketKeysFamily) {
      set_bucket_key_options(&d.options);
      d.options.compaction_filter_factory = storage->key_erasure_;
    } else if (d.name != "users" && d.name != "by_tag" && d.name != "default") {
      set_state_cf_options(d.name, &d.options);
    }
  }

  rocksdb::DB* raw = nullptr;
  rocksdb::Status s;
  if (config.read_only) {
    if (!listed) {
      return from_rocksdb(rocksdb::DB::ListColumnFamilies(options, path, &existing),
                          "cannot open tidal Db at '" + path + "' read-only");
    }
    for (const char* name : kUsersFamilies) {
      if (!contains(existing, name)) {
        return Status::InvalidArgument("cannot open tidal Db at '" + path +
                                       "' read-only: it lacks tidal's column families (not a tidal Db, or never "
                                       "opened for writing)");
      }
    }
    s = rocksdb::DB::OpenForReadOnly(users_options, path, descriptors, &storage->users_.handles, &raw);
  } else {
    s = rocksdb::DB::Open(users_options, path, descriptors, &storage->users_.handles, &raw);
  }
  if (!s.ok()) {
    if (is_lock_error(s)) {
      return Status::Busy("cannot open tidal Db at '" + path +
                          "': it is already open by another handle (this process or another one): " + s.ToString());
    }
    return from_rocksdb(s, "cannot open tidal Db at '" + path + "'");
  }
  storage->users_.db.reset(raw);
  // Destroyed (not dropped) by the end of the open or of the upgrade, or by close().
  const std::size_t fixed = std::size(kUsersFamilies);
  const std::size_t opened = fixed + (has_wrapped ? 1 : 0) + (has_buckets ? 1 : 0);
  std::vector<rocksdb::ColumnFamilyHandle*>& handles = storage->users_.handles;
  storage->legacy_.assign(handles.begin() + static_cast<std::ptrdiff_t>(opened), handles.end());
  rocksdb::ColumnFamilyHandle* const wrapped = has_wrapped ? handles[fixed] : nullptr;
  rocksdb::ColumnFamilyHandle* const buckets = has_buckets ? handles[fixed + (has_wrapped ? 1 : 0)] : nullptr;
  handles.resize(fixed);
  handles.push_back(wrapped);  // keys()
  handles.push_back(buckets);  // bucket_keys()

  std::string format;
  Status f = storage->get(storage->meta(), kDbFormatKey, &format);
  if (!f.ok() && f.code() != StatusCode::NotFound) return f;
  if (f.ok() && format != kDbFormat && format != kDbFormat3) {
    return Status::InvalidArgument("cannot open tidal Db at '" + path + "': it is in format " + format +
                                   "; this version reads format " + kDbFormat + " (and upgrades formats 2 and 3)");
  }
  if (config.read_only) {
    if (!f.ok()) {
      return Status::InvalidArgument("cannot open tidal Db at '" + path +
                                     "' read-only: it is in format 2 (one RocksDB database); a writable open "
                                     "upgrades it to format 4, or run `tidalctl migrate " + path + "`");
    }
    if (Status o = storage->open_state(options, /*create=*/false); !o.ok()) return o;
    return storage;
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    return Status::IOError("cannot open tidal Db at '" + path + "': stat of the directory failed (" +
                           std::strerror(err) + ")");
  }
  // Files a crash left half-built for the state store's next ingestion.
  rocksdb::Env* env = storage->users_.db->GetEnv();
  std::vector<std::string> leftovers;
  if (env->GetChildren(storage->ingest_dir(), &leftovers).ok()) {
    for (const std::string& name : leftovers) storage->delete_file(storage->ingest_dir() + "/" + name);
  }
  if (rocksdb::Status cs = env->CreateDirIfMissing(storage->ingest_dir()); !cs.ok()) {
    return from_rocksdb(cs, "cannot open tidal Db at '" + path + "': creating " + storage->ingest_dir() + " failed");
  }
  bool upgrade_now = false;
  if (!f.ok()) {
    // Format 2, a new Db, or either of them cut short by a crash. Deferred
    // only for a format-2 state store (a new Db has nothing to check); not
    // under g_open_mu either way (below).
    storage->options_ = options;
    storage->upgrade_pending_ = true;
    upgrade_now = !config.defer_upgrade || storage->legacy("aggregates") == nullptr;
  } else {
    // A migration that a crash cut short after its commit point.
    if (Status d = storage->drop_legacy(storage->legacy_); !d.ok()) return d;
    storage->release_legacy();

    const bool upgrade4 = format == kDbFormat3;
    if (Status o = storage->open_state(options, /*create=*/false); !o.ok()) return o;
    if (upgrade4) test_step("upgrade4", 1);
    if (Status k = storage->create_key_store(); !k.ok()) return k;
    if (upgrade4) test_step("upgrade4", 2);
    // Format 3 to 4: open_state and create_key_store created the sealed
    // ledger and the key store;
    // the ledger format 3 wrote stays where it is, read and never written
    // again (storage/sealed_ledger.h). Written synced, after the families
    // (RocksDB's MANIFEST): a crash before it leaves a format-3 Db whose next
    // open finds them there, and tidal 0.3 refuses the Db from then on
    // ("it is in format 4; this version reads format 3").
    if (upgrade4) {
      rocksdb::WriteBatch batch;
      batch.Put(storage->meta(), kDbFormatKey, kDbFormat);
      if (Status w = storage->write(Engine::Users, &batch, WriteMode::Sync, "upgrade of '" + path + "' to format 4");
          !w.ok()) {
        return w;
      }
      test_step("upgrade4", 3);
    }
    // A format-3 Db upgraded or created before the users engine carried the
    // mark that tidal 0.2 refuses (format.h, kUsersStateFormatMark).
    std::string mark;
    Status m = storage->get(storage->meta(), kStateFormatKey, &mark);
    if (!m.ok() && m.code() != StatusCode::NotFound) return m;
    if (!m.ok() || mark != kUsersStateFormatMark) {
      rocksdb::WriteBatch batch;
      batch.Put(storage->meta(), kStateFormatKey, kUsersStateFormatMark);
      if (Status w = storage->write(Engine::Users, &batch, WriteMode::Sync, "format mark of '" + path + "'"); !w.ok()) {
        return w;
      }
    }
  }

  storage->registry_id_ = {st.st_dev, st.st_ino};
  g_open_dirs.emplace(*storage->registry_id_, canonical(path));
  if (config.users_wal_sync_period.count() > 0) {
    Storage* self = storage.get();
    storage->wal_syncer_ = std::thread([self, period = config.users_wal_sync_period] { self->run_wal_syncer(period); });
  }
  // Registered: another open of this directory is refused from here on, so
  // the upgrade, which takes as long as reading the ledger, runs without
  // holding up opens of other Dbs. (A failure destroys `storage`, whose
  // close() takes g_open_mu to unregister it.)
  registry.unlock();
  if (upgrade_now) {
    if (Status m = storage->finish_upgrade(); !m.ok()) return m;
  }
  return storage;
}

std::uint64_t Storage::sealed_records_reclaimed() const { return reclaim_ ? reclaim_->reclaimed() : 0; }

Status Storage::close_state() {
  if (reclaim_) reclaim_->detach();
  return close_instance(&state_, state_path());
}

Status Storage::open_state(const rocksdb::Options& base, bool create) {
  const std::string dir = state_path();
  rocksdb::Options options(base);
  options.create_if_missing = create;
  if (!read_only_) {
    set_hostile_fs_options(dir, &options);
    options.listeners.push_back(std::make_shared<ErrorWatch>(health_[1]));
  }
  // The compaction statistics of each column family (write amplification
  // per level) in state/LOG once a minute, where bench/README.md read them.
  options.stats_dump_period_sec = 60;
  if (state_manifest_per_edit_) options.max_manifest_file_size = 0;
  std::vector<std::string> existing;
  const bool listed = rocksdb::DB::ListColumnFamilies(options, dir, &existing).ok();
  if (!create && !listed) {
    return Status::Corruption("cannot open tidal Db at '" + path_ + "': its state engine (" + dir +
                              ") is missing or unreadable, though the Db is in format 3 or 4 (which have one)");
  }
  // A development build of format 4 (before the sealed index, 2026-12-06)
  // keyed the sealed ledger by pseudonym: this version would not find its
  // records, and a purge would subtract nothing. (A format-3 Db whose
  // upgrade a crash cut short between the two families' creation is in
  // format 3 still, and its open creates the index.)
  std::string format;
  if (listed && contains(existing, "sealed_ledger") && !contains(existing, "sealed_index") &&
      get(meta(), kDbFormatKey, &format).ok() && format == kDbFormat) {
    return Status::InvalidArgument("cannot open tidal Db at '" + path_ +
                                   "': its sealed ledger was written by a development build of format 4 (keyed "
                                   "by pseudonym, with no sealed_index); this version cannot read it. Re-create "
                                   "the Db (nothing changed)");
  }
  // A writable open creates format 4's families in a format-3 state engine
  // (the upgrade, Storage::open); a read-only open of one opens it without
  // them (their handles null: an empty key store and sealed ledger).
  options.create_missing_column_families = !read_only_;
  std::vector<rocksdb::ColumnFamilyDescriptor> descriptors;
  std::vector<bool> opened;  // per kStateFamilies entry
  for (const char* name : kStateFamilies) {
    opened.push_back(!read_only_ || !listed || contains(existing, name));
    if (opened.back()) descriptors.emplace_back(name, rocksdb::ColumnFamilyOptions(options));
  }
  if (listed && contains(existing, kFeedColumnFamily)) {
    descriptors.emplace_back(kFeedColumnFamily, rocksdb::ColumnFamilyOptions(options));
  }
  for (auto& d : descriptors) d.options = state_cf_options(options, d.name);
  rocksdb::DB* raw = nullptr;
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::Status s = read_only_ ? rocksdb::DB::OpenForReadOnly(options, dir, descriptors, &handles, &raw)
                                 : rocksdb::DB::Open(options, dir, descriptors, &handles, &raw);
  if (!s.ok()) return from_rocksdb(s, "cannot open the state engine of tidal Db '" + path_ + "' (" + dir + ")");
  state_.db.reset(raw);
  auto next = handles.begin();
  state_.handles.clear();
  for (bool o : opened) state_.handles.push_back(o ? *next++ : nullptr);
  state_.handles.insert(state_.handles.end(), next, handles.end());
  if (reclaim_) reclaim_->attach(this);
  return Status::OK();
}

rocksdb::ColumnFamilyOptions Storage::state_cf_options(const rocksdb::Options& base, const std::string& name) const {
  rocksdb::ColumnFamilyOptions options(base);
  set_table_options(block_cache_, &options);
  set_state_cf_options(name, &options);
  if (name == "sealed_ledger" && reclaim_) {
    options.compaction_filter_factory = reclaim_;
    // RocksDB rewrites each file once it is this old, and the filter drops
    // its purged records then: a purged user's ciphertext leaves the disk
    // within this period of the purge (or sooner, when a compaction
    // reaches its file first).
    options.periodic_compaction_seconds = kSealedReclaimPeriod.count();
  }
  return options;
}

Status Storage::finish_upgrade() {
  if (!upgrade_pending_) return Status::OK();
  upgrade_pending_ = false;  // from here on the accessors name the state engine's column families
  Status s = migrate_to_format3(options_, legacy_);
  release_legacy();
  if (s.ok()) s = create_key_store();
  return s;
}

Status Storage::create_key_store() {
  const auto create = [&](const char* name, std::size_t at, void (*set)(rocksdb::ColumnFamilyOptions*)) -> Status {
    if (users_.handles[at] != nullptr) return Status::OK();
    rocksdb::ColumnFamilyOptions options(users_.db->GetOptions(users()));
    set_table_options(block_cache_, &options);
    set(&options);
    if (at == 4) options.compaction_filter_factory = key_erasure_;
    rocksdb::ColumnFamilyHandle* handle = nullptr;
    // Durable (RocksDB's MANIFEST) when it returns.
    if (Status s = from_rocksdb(users_.db->CreateColumnFamily(options, name, &handle),
                                "creating the key store of '" + path_ + "' (" + name + ")");
        !s.ok()) {
      return s;
    }
    users_.handles[at] = handle;
    return Status::OK();
  };
  if (Status s = create(kWrappedKeysFamily, 3, set_wrapped_key_options); !s.ok()) return s;
  return create(kBucketKeysFamily, 4, set_bucket_key_options);
}

rocksdb::ColumnFamilyHandle* Storage::legacy(std::string_view name) const {
  for (auto* h : legacy_) {
    if (h->GetName() == name) return h;
  }
  return nullptr;
}

void Storage::release_legacy() {
  for (auto* h : legacy_) (void)users_.db->DestroyColumnFamilyHandle(h);
  legacy_.clear();
}

Status Storage::drop_legacy(const std::vector<rocksdb::ColumnFamilyHandle*>& legacy) {
  for (auto* h : legacy) {
    // Durable in the MANIFEST when it returns.
    if (Status s = from_rocksdb(users_.db->DropColumnFamily(h),
                                "dropping the format-2 column family " + h->GetName() + " of '" + path_ + "'");
        !s.ok()) {
      return s;
    }
  }
  return Status::OK();
}

Status Storage::create_feed() {
  if (feed() != nullptr) return Status::OK();
  rocksdb::ColumnFamilyOptions options(state_.db->GetOptions(state_meta()));
  rocksdb::ColumnFamilyHandle* handle = nullptr;
  if (Status s = from_rocksdb(state_.db->CreateColumnFamily(options, kFeedColumnFamily, &handle),
                              "creating the change feed of '" + path_ + "'");
      !s.ok()) {
    return s;
  }
  state_.handles.push_back(handle);
  return Status::OK();
}

Storage::~Storage() { (void)close(); }

rocksdb::DB* Storage::db_of(rocksdb::ColumnFamilyHandle* cf) const {
  for (auto* h : state_.handles) {
    if (h == cf) return state_.db.get();
  }
  return users_.db.get();
}

namespace {

#if defined(__SANITIZE_THREAD__)
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#endif

// ThreadSanitizer builds only: the memory accesses of a RocksDB write are not
// checked. RocksDB is not built with -fsanitize=thread, so TSan sees the
// libc and libstdc++ calls inside it (memset, memcpy) but not the write
// group's handoff through RocksDB's own atomics: two leaders clearing the
// DB's merged batch (WriteBatch::Clear inside DBImpl::WriteImpl) looked like
// a race whose only named frames are tidal's callers (CI, 2026-12-02), which
// tests/tsan.supp cannot name without hiding tidal's own frames. Tidal's
// accesses before and after the call are checked as always.
class IgnoredByTsan {
 public:
#if defined(__SANITIZE_THREAD__)
  IgnoredByTsan() { __tsan_ignore_thread_begin(); }
  ~IgnoredByTsan() { __tsan_ignore_thread_end(); }
#else
  IgnoredByTsan() = default;
#endif
  IgnoredByTsan(const IgnoredByTsan&) = delete;
  IgnoredByTsan& operator=(const IgnoredByTsan&) = delete;
};

}  // namespace

Status Storage::write(Engine engine, rocksdb::WriteBatch* batch, WriteMode mode, std::string_view what) {
  if (read_only_) return Status::InvalidArgument(std::string(what) + ": the Db at '" + path_ + "' is open read-only");
  if (db(engine) == nullptr) return not_upgraded(what);
  if (Status r = recover(engine, what); !r.ok()) return r;
  rocksdb::WriteOptions wo;
  wo.sync = mode == WriteMode::Sync;
  wo.disableWAL = mode == WriteMode::NoWal;
  if (mode != WriteMode::NoWal) anchor(engine);
  Status s;
  {
    [[maybe_unused]] IgnoredByTsan uninstrumented;
    rocksdb::Status w = db(engine)->Write(wo, batch);
    if (!w.ok()) s = engine_error(engine, w, what);
  }
  // After the write: a sync that clears the flag before this point finds
  // it set again, one that clears it after it syncs this write too.
  if (engine == Engine::Users && mode == WriteMode::Async) users_unsynced_.store(true, std::memory_order_release);
  return s;
}

Status Storage::sync_users_wal() {
  if (read_only_ || users_.db == nullptr) return Status::OK();
  std::lock_guard<std::mutex> lock(sync_mu_);
  // Cleared before the fsync: a write that returns during it sets it again.
  if (!users_unsynced_.exchange(false, std::memory_order_acq_rel)) return Status::OK();
  const std::string what = "fsync of the write-ahead log of '" + path_ + "'";
  Status s = recover(Engine::Users, what);
  if (s.ok()) {
    anchor(Engine::Users);
    if (rocksdb::Status w = users_.db->SyncWAL(); !w.ok()) s = engine_error(Engine::Users, w, what);
  }
  if (!s.ok()) users_unsynced_.store(true, std::memory_order_release);
  return s;
}

void Storage::run_wal_syncer(std::chrono::milliseconds period) {
  std::unique_lock<std::mutex> lock(syncer_mu_);
  auto next = std::chrono::steady_clock::now() + period;
  while (!syncer_cv_.wait_until(lock, next, [this] { return syncer_stop_; })) {
    next += period;
    lock.unlock();
    // A failure leaves the flag set: the next round tries again.
    (void)sync_users_wal();
    lock.lock();
    next = std::max(next, std::chrono::steady_clock::now());
  }
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
  rocksdb::Status s = db_of(cf)->Get(ro, cf, rocksdb::Slice(key.data(), key.size()), value);
  if (s.IsNotFound()) return Status::NotFound("no record");
  return from_rocksdb(s, "read from '" + path_ + "'");
}

std::unique_ptr<rocksdb::Iterator> Storage::iterator(rocksdb::ColumnFamilyHandle* cf, bool bulk,
                                                     const rocksdb::Snapshot* snapshot) const {
  rocksdb::ReadOptions ro;
  ro.snapshot = snapshot;
  // In key order across prefixes too: the sealed ledger has a prefix
  // extractor (its pseudonyms), which would otherwise bound a Seek to one.
  ro.total_order_seek = true;
  if (bulk) {
    ro.readahead_size = 4 << 20;
    ro.fill_cache = false;
  }
  return std::unique_ptr<rocksdb::Iterator>(db_of(cf)->NewIterator(ro, cf));
}

std::unique_ptr<rocksdb::Iterator> Storage::prefix_iterator(rocksdb::ColumnFamilyHandle* cf) const {
  rocksdb::ReadOptions ro;
  ro.prefix_same_as_start = true;
  return std::unique_ptr<rocksdb::Iterator>(db_of(cf)->NewIterator(ro, cf));
}

std::uint64_t Storage::estimate_keys(rocksdb::ColumnFamilyHandle* cf) const {
  std::uint64_t n = 0;
  return db_of(cf)->GetIntProperty(cf, rocksdb::DB::Properties::kEstimateNumKeys, &n) ? n : 0;
}

std::unique_ptr<rocksdb::SstFileWriter> Storage::sst_writer(rocksdb::ColumnFamilyHandle* cf) const {
  const rocksdb::Options options = db_of(cf)->GetOptions(cf);
  // Keep the file's pages cached: its first reads come right after ingest().
  // No bloom filter in the sealed ledger's files: only a purge reads them,
  // by point reads of records its index names, which a filter can only
  // confirm, at the cost of one more block read each (and of building it
  // for every record the writer stores).
  return std::make_unique<rocksdb::SstFileWriter>(rocksdb::EnvOptions(options), options, cf,
                                                  /*invalidate_page_cache=*/false, rocksdb::Env::IO_TOTAL,
                                                  /*skip_filters=*/cf == sealed_ledger());
}

Status Storage::ingest(const std::vector<std::pair<rocksdb::ColumnFamilyHandle*, std::string>>& files,
                       std::string_view what) {
  if (read_only_) return Status::InvalidArgument(std::string(what) + ": the Db at '" + path_ + "' is open read-only");
  if (state_.db == nullptr) return not_upgraded(what);
  std::vector<rocksdb::IngestExternalFileArg> args;  // one per column family, as RocksDB requires
  for (const auto& [cf, file] : files) {
    // Two batches of one name would have written the same file.
    if (std::count_if(files.begin(), files.end(), [&file = file](const auto& f) { return f.second == file; }) > 1) {
      return Status::InvalidArgument(std::string(what) + ": the file '" + file + "' is named twice in one ingestion");
    }
    auto same = std::find_if(args.begin(), args.end(), [cf = cf](const auto& a) { return a.column_family == cf; });
    if (same != args.end()) {
      same->external_files.push_back(file);
      continue;
    }
    rocksdb::IngestExternalFileArg& arg = args.emplace_back();
    arg.column_family = cf;
    arg.external_files.push_back(file);
    // Linked, not copied: the file was written and fsynced once, by
    // SstFileWriter::Finish (RocksDB fsyncs the link again, which finds
    // nothing left to write). A copy, written and fsynced a second time,
    // only where the file system has no hard links.
    arg.options.move_files = true;
    arg.options.failed_move_fall_back_to_copy = true;
    // The file's sequence number lives in the MANIFEST only: no rewrite of
    // the file after it is copied.
    arg.options.write_global_seqno = false;
  }
  if (Status r = recover(Engine::State, what); !r.ok()) return r;
  rocksdb::Status s = state_.db->IngestExternalFiles(args);
  return s.ok() ? Status::OK() : engine_error(Engine::State, s, what);
}

void Storage::delete_file(const std::string& file) const { (void)users_.db->GetEnv()->DeleteFile(file); }

Status Storage::drop_files_in_range(rocksdb::ColumnFamilyHandle* cf, std::string_view begin, std::string_view end,
                                    std::string_view what) {
  if (read_only_) return Status::InvalidArgument(std::string(what) + ": the Db at '" + path_ + "' is open read-only");
  if (Status r = recover(Engine::State, what); !r.ok()) return r;
  const rocksdb::Slice b(begin.data(), begin.size()), e(end.data(), end.size());
  rocksdb::Status s = rocksdb::DeleteFilesInRange(state_.db.get(), cf, &b, &e, /*include_end=*/true);
  return s.ok() ? Status::OK() : engine_error(Engine::State, s, what);
}

Status Storage::flush() {
  Status s = flush(Engine::Users);
  Status t = flush(Engine::State);
  return s.ok() ? t : s;
}

Status Storage::flush_past_wals(Engine engine) {
  if (read_only_ || db(engine) == nullptr) return Status::OK();
  std::uint64_t number = 0, seq = 0;  // of this flush, begun before its memtables switch
  if (engine == Engine::Users) {
    std::lock_guard<std::mutex> lock(stored_keys_mu_);
    number = ++flushes_begun_;
    seq = users_.db->GetLatestSequenceNumber();
  }
  rocksdb::WriteBatch marker;
  marker.Put(engine == Engine::Users ? meta() : state_meta(), kCleanCloseKey, "");
  Status written = write(engine, &marker, WriteMode::NoWal, "the marker of a flush past the WALs");
  Status flushed = flush(engine);
  if (!written.ok()) return written;
  if (flushed.ok() && engine == Engine::Users) {
    std::lock_guard<std::mutex> lock(stored_keys_mu_);
    if (number > flushed_) {
      flushed_ = number;
      flushed_seq_ = seq;
    }
  }
  return flushed;
}

Status Storage::write_key_store(rocksdb::WriteBatch* batch, const std::vector<std::uint64_t>& buckets, bool sync,
                                const std::string& what) {
  Status s = write(Engine::Users, batch, durable_if(sync), what);
  if (buckets.empty()) return s;
  std::lock_guard<std::mutex> lock(stored_keys_mu_);
  const std::uint64_t by = users_.db->GetLatestSequenceNumber();
  noted_keys_ += buckets.size();
  if (noted_keys_ > kMaxNotedKeys) {
    stored_keys_.assign(1, StoredKeys{flushes_begun_, by, true, {}});
    noted_keys_ = 0;
  } else {
    stored_keys_.push_back(StoredKeys{flushes_begun_, by, false, buckets});
  }
  return s;
}

Storage::KeysWritten Storage::keys_written(const std::vector<std::uint64_t>& buckets) {
  std::vector<std::uint64_t> sorted(buckets);
  std::sort(sorted.begin(), sorted.end());
  std::lock_guard<std::mutex> lock(stored_keys_mu_);
  // A flush begun after a note took its keys out of the WALs and memtables.
  std::erase_if(stored_keys_, [&](const StoredKeys& k) {
    if (k.flushes_begun >= flushed_) return false;
    noted_keys_ -= k.buckets.size();
    return true;
  });
  // Newest first: a bucket's newest note wrote its current key, which is
  // not erased; the notes before it wrote the keys it replaced.
  KeysWritten out{false, flushed_seq_};
  std::unordered_set<std::uint64_t> current;  // buckets whose newest note was seen
  for (auto k = stored_keys_.rbegin(); k != stored_keys_.rend(); ++k) {
    bool replaced = k->everyone;
    for (std::uint64_t b : k->buckets) {
      if (!std::binary_search(sorted.begin(), sorted.end(), b)) continue;
      if (!current.insert(b).second) replaced = true;
    }
    if (replaced) {
      out.in_wals = true;
      out.by = std::max(out.by, k->by);
    }
  }
  return out;
}

Status Storage::flush(Engine engine) {
  if (read_only_) return Status::OK();
  const Instance& instance = engine == Engine::Users ? users_ : state_;
  if (instance.db == nullptr) return Status::OK();
  const std::string what = "flush of '" + (engine == Engine::Users ? path_ : state_path()) + "'";
  if (Status r = recover(engine, what); !r.ok()) return r;
  rocksdb::Status s = flush_instance(instance);
  return s.ok() ? Status::OK() : engine_error(engine, s, what);
}

rocksdb::Status Storage::flush_instance(const Instance& instance) const {
  rocksdb::FlushOptions fo;
  fo.wait = true;
  // RocksDB's default first waits until the flush would not stall writes,
  // i.e. for compactions of L0, which at 1M users ran for 34 s: close()
  // waited 35.8 s, and a purge as long.
  fo.allow_write_stall = true;
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  for (auto* h : instance.handles) {
    if (h != nullptr) handles.push_back(h);
  }
  return instance.db->Flush(fo, handles);
}

Status Storage::engine_error(Engine engine, const rocksdb::Status& s, std::string_view what) const {
  Status out = from_rocksdb(s, what);
  if (out.code() != StatusCode::IOError) return out;
  const std::string dir = engine == Engine::Users ? path_ : state_path();
  EngineHealth& h = health(engine);
  bool reopen = false;
  {
    std::lock_guard<std::mutex> lock(h.mu);
    reopen = h.needs_reopen;
  }
  if (reopen) {
    return Status::IOError(out.message() + "; RocksDB does not recover from this error: close the Db and open it "
                                           "again");
  }
  return Status::IOError(out.message() +
                         (is_no_space(s) ? "; the file system of '" + dir +
                                               "' is full: free space there and call again (the Db recovers in "
                                               "place at its next call, no reopen needed)"
                                         : "; call again once the cause is fixed (the Db recovers in place at its "
                                           "next call, or says to reopen it)"));
}

void Storage::anchor(Engine engine) {
  EngineHealth& h = health(engine);
  const std::uint64_t seals = h.seals.load(std::memory_order_acquire);
  if (h.anchored.load(std::memory_order_acquire) == seals) return;
  rocksdb::WriteOptions wo;
  wo.disableWAL = true;
  const Instance& instance = engine == Engine::Users ? users_ : state_;
  // The marker flush_past_wals writes too. A failure leaves the next write
  // to try again.
  if (instance.db->Put(wo, instance.handles[0], kCleanCloseKey, "").ok()) {
    h.anchored.store(seals, std::memory_order_release);
  }
}

Status Storage::recover(Engine engine, std::string_view what) {
  if (read_only_ || db(engine) == nullptr) return Status::OK();
  EngineHealth& h = health(engine);
  if (!h.stopped.load(std::memory_order_acquire)) return Status::OK();
  std::unique_lock<std::mutex> lock(h.mu);
  const std::uint64_t failures = h.failures;
  h.changed.wait_for(lock, kRecoveryWait, [&] {
    return !h.stopped.load(std::memory_order_acquire) || h.needs_reopen || h.failures != failures;
  });
  if (!h.stopped.load(std::memory_order_acquire)) return Status::OK();
  const std::string dir = engine == Engine::Users ? path_ : state_path();
  std::string out = std::string(what) + ": the writes of '" + dir + "' stopped after an error (" + h.error + ")";
  if (h.needs_reopen) {
    out += ", which RocksDB does not recover from: close the Db and open it again";
  } else if (h.error.find("No space left on device") != std::string::npos) {
    out += " and do not resume yet: its file system is still full. Free space there and call again (the Db "
           "recovers in place, no reopen needed)";
  } else {
    out += " and have not resumed yet: call again once the cause is fixed (the Db recovers in place), or close "
           "the Db and open it again";
  }
  return Status::IOError(out);
}

std::uint64_t Storage::recoveries() const {
  return health(Engine::Users).recoveries.load(std::memory_order_relaxed) +
         health(Engine::State).recoveries.load(std::memory_order_relaxed);
}

Storage::CompactionDebt Storage::compaction_debt() const {
  CompactionDebt debt;
  if (read_only_ || state_.db == nullptr) return debt;
  for (rocksdb::ColumnFamilyHandle* cf : {aggregates(), sealed_ledger(), sealed_index(), ledger()}) {
    if (cf == nullptr) continue;
    std::string files;
    if (state_.db->GetProperty(cf, rocksdb::DB::Properties::kNumFilesAtLevelPrefix + "0", &files)) {
      debt.l0_files = std::max<std::uint64_t>(debt.l0_files, std::strtoull(files.c_str(), nullptr, 10));
    }
    std::uint64_t bytes = 0;
    if (state_.db->GetIntProperty(cf, rocksdb::DB::Properties::kEstimatePendingCompactionBytes, &bytes)) {
      debt.pending_bytes += bytes;
    }
  }
  return debt;
}

Status Storage::close_instance(Instance* instance, const std::string& path) {
  Status result;
  for (auto* h : instance->handles) {
    if (h == nullptr) continue;  // a family a read-only open found absent
    if (Status s = from_rocksdb(instance->db->DestroyColumnFamilyHandle(h), "close of '" + path + "'");
        !s.ok() && result.ok()) {
      result = s;
    }
  }
  instance->handles.clear();
  if (Status s = from_rocksdb(instance->db->Close(), "close of '" + path + "'"); !s.ok() && result.ok()) result = s;
  instance->db.reset();
  return result;
}

Status Storage::not_upgraded(std::string_view what) const {
  return Status::InvalidArgument(std::string(what) + ": the Db at '" + path_ +
                                 "' has no state engine yet (its upgrade from format 2 has not run)");
}

Status Storage::close() {
  if (wal_syncer_.joinable()) {
    {
      std::lock_guard<std::mutex> lock(syncer_mu_);
      syncer_stop_ = true;
    }
    syncer_cv_.notify_all();
    wal_syncer_.join();
  }
  if (users_.db == nullptr && state_.db == nullptr) return Status::OK();
  if (users_.db != nullptr) release_legacy();
  // So that the next open has no WAL to replay.
  Status result = flush_past_wals(Engine::Users);
  if (Status s = flush_past_wals(Engine::State); result.ok()) result = s;
  if (!read_only_ && state_.db != nullptr) {
    // The state engine's compaction statistics (per column family and
    // level: bytes ingested and written, write amplification, time) into
    // state/LOG, as RocksDB's periodic dump writes them, so that a run's
    // totals are there. kStats alone has the default column family's only.
    std::string stats;
    if (state_.db->GetProperty(rocksdb::DB::Properties::kDBStats, &stats)) {
      for (rocksdb::ColumnFamilyHandle* cf : state_.handles) {
        std::string cf_stats;
        if (state_.db->GetProperty(cf, rocksdb::DB::Properties::kCFStatsNoFileHistogram, &cf_stats)) stats += cf_stats;
      }
      rocksdb::Log(rocksdb::InfoLogLevel::INFO_LEVEL, state_.db->GetDBOptions().info_log,
                   "tidal: statistics at close\n%s", stats.c_str());
    }
  }
  // The state engine first: the users engine holds the directory's LOCK.
  if (state_.db != nullptr) {
    if (Status s = close_state(); !s.ok() && result.ok()) result = s;
  }
  if (users_.db != nullptr) {
    if (Status s = close_instance(&users_, path_); !s.ok() && result.ok()) result = s;
  }
  if (registry_id_) {
    std::lock_guard<std::mutex> registry(g_open_mu);
    g_open_dirs.erase(*registry_id_);
    registry_id_.reset();
  }
  return result;
}

Status Storage::check_state_format() {
  std::string format;
  Status s = get(state_meta(), kStateFormatKey, &format);
  if (s.ok()) {
    if (format == kStateFormat) return Status::OK();
    return Status::InvalidArgument("cannot open tidal Db at '" + path_ + "': its aggregates are in format " + format +
                                   "; this version reads format " + kStateFormat);
  }
  if (s.code() != StatusCode::NotFound) return s;
  auto it = iterator(aggregates());
  it->SeekToFirst();
  if (it->Valid()) {
    return Status::InvalidArgument(
        "cannot open tidal Db at '" + path_ +
        "': its aggregates were written by tidal 0.1 (double scores, no contribution ledger), which this version "
        "cannot read exactly; open it with tidal 0.1 to export them");
  }
  if (s = from_rocksdb(it->status(), "format check of '" + path_ + "'"); !s.ok()) return s;
  // Before the upgrade, it marks the state engine once the records are there.
  if (read_only_ || upgrade_pending_) return Status::OK();
  rocksdb::WriteBatch batch;
  batch.Put(state_meta(), kStateFormatKey, kStateFormat);
  return write(Engine::State, &batch, WriteMode::Sync, "format mark of '" + path_ + "'");
}

Result<std::uint64_t> read_clock_floor(const Storage& storage) {
  std::uint64_t floor = 0;
  const rocksdb::Slice prefix(kClockFloorPrefix);
  for (rocksdb::ColumnFamilyHandle* meta : {storage.meta(), storage.state_meta()}) {
    auto it = storage.iterator(meta);
    for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
      const std::optional<std::uint64_t> ts = deserialize_clock_floor({it->value().data(), it->value().size()});
      if (!ts) {
        return Status::Corruption("clock floor record " + hex({it->key().data(), it->key().size()}) + " of '" +
                                  storage.path() + "' is not 8 bytes");
      }
      floor = std::max(floor, *ts);
    }
    if (Status s = from_rocksdb(it->status(), "clock floor read of '" + storage.path() + "'"); !s.ok()) return s;
  }
  return floor;
}

}  // namespace tidal
