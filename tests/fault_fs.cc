#include "fault_fs.h"

#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string_view>
#include <system_error>
#include <utility>

#include <rocksdb/system_clock.h>

namespace tidal::reliability {
namespace {

using rocksdb::IODebugContext;
using rocksdb::IOOptions;
using rocksdb::IOStatus;
using rocksdb::Slice;

// RocksDB waits 1 s after a failed background flush or compaction before it
// retries, and a close waits for that wait: a sweep fails hundreds of them
// (FaultSweepTest.OpenPersistent spent 70 of its 116 s there). The fault
// Env's clock waits 10 ms instead; every other wait, and every reading of
// the time, is the system clock's. RocksDB does the same work either way.
class ShortBackoffClock : public rocksdb::SystemClockWrapper {
 public:
  ShortBackoffClock() : SystemClockWrapper(rocksdb::SystemClock::Default()) {}
  const char* Name() const override { return "ShortBackoffClock"; }
  void SleepForMicroseconds(int micros) override {
    SystemClockWrapper::SleepForMicroseconds(micros == 1'000'000 ? 10'000 : micros);
  }
};

// The Env of a FaultFs: its file system, with the clock above.
class FaultEnvImpl : public rocksdb::EnvWrapper {
 public:
  explicit FaultEnvImpl(const std::shared_ptr<FaultFs>& fs) : EnvWrapper(rocksdb::NewCompositeEnv(fs)) {
    system_clock_ = std::make_shared<ShortBackoffClock>();
  }
  const char* Name() const override { return "FaultEnv"; }
};

bool is_wal(std::string_view fname) { return fname.size() > 4 && fname.substr(fname.size() - 4) == ".log"; }

class FaultWritableFile : public rocksdb::FSWritableFileOwnerWrapper {
 public:
  FaultWritableFile(FaultFs* fs, std::string fname, std::unique_ptr<rocksdb::FSWritableFile>&& target)
      : FSWritableFileOwnerWrapper(std::move(target)), fs_(fs), fname_(std::move(fname)) {}

  IOStatus Append(const Slice& data, const IOOptions& options, IODebugContext* dbg) override {
    if (IOStatus s = before_append(); !s.ok()) return s;
    IOStatus s = target()->Append(data, options, dbg);
    if (s.ok()) fs_->note_append(fname_, data.size());
    return s;
  }
  IOStatus Append(const Slice& data, const IOOptions& options, const rocksdb::DataVerificationInfo& info,
                  IODebugContext* dbg) override {
    if (IOStatus s = before_append(); !s.ok()) return s;
    IOStatus s = target()->Append(data, options, info, dbg);
    if (s.ok()) fs_->note_append(fname_, data.size());
    return s;
  }
  IOStatus PositionedAppend(const Slice& data, uint64_t offset, const IOOptions& options,
                            IODebugContext* dbg) override {
    if (IOStatus s = before_append(); !s.ok()) return s;
    IOStatus s = target()->PositionedAppend(data, offset, options, dbg);
    if (s.ok()) fs_->note_positioned_append(fname_, offset + data.size());
    return s;
  }
  IOStatus PositionedAppend(const Slice& data, uint64_t offset, const IOOptions& options,
                            const rocksdb::DataVerificationInfo& info, IODebugContext* dbg) override {
    if (IOStatus s = before_append(); !s.ok()) return s;
    IOStatus s = target()->PositionedAppend(data, offset, options, info, dbg);
    if (s.ok()) fs_->note_positioned_append(fname_, offset + data.size());
    return s;
  }
  IOStatus Truncate(uint64_t size, const IOOptions& options, IODebugContext* dbg) override {
    if (IOStatus s = fs_->check("Truncate", fname_, true); !s.ok()) return s;
    IOStatus s = target()->Truncate(size, options, dbg);
    if (s.ok()) fs_->note_truncate(fname_, size);
    return s;
  }
  IOStatus Close(const IOOptions& options, IODebugContext* dbg) override {
    if (IOStatus s = fs_->check("Close", fname_, true); !s.ok()) return s;
    return target()->Close(options, dbg);
  }
  IOStatus Sync(const IOOptions& options, IODebugContext* dbg) override {
    if (IOStatus s = before_sync("Sync"); !s.ok()) return s;
    IOStatus s = target()->Sync(options, dbg);
    if (s.ok()) fs_->note_sync(fname_);
    return s;
  }
  IOStatus Fsync(const IOOptions& options, IODebugContext* dbg) override {
    if (IOStatus s = before_sync("Fsync"); !s.ok()) return s;
    IOStatus s = target()->Fsync(options, dbg);
    if (s.ok()) fs_->note_sync(fname_);
    return s;
  }
  IOStatus RangeSync(uint64_t offset, uint64_t nbytes, const IOOptions& options, IODebugContext* dbg) override {
    if (IOStatus s = fs_->check("RangeSync", fname_, true); !s.ok()) return s;
    return target()->RangeSync(offset, nbytes, options, dbg);  // not a durability point
  }

 private:
  IOStatus before_append() {
    if (IOStatus s = fs_->check_wal("Append", fname_, false); !s.ok()) return s;
    return fs_->check("Append", fname_, true);
  }
  IOStatus before_sync(const char* op) {
    fs_->wait_if_held(fname_);
    if (IOStatus s = fs_->check_wal(op, fname_, true); !s.ok()) return s;
    return fs_->check(op, fname_, true);
  }

  FaultFs* fs_;
  std::string fname_;
};

class FaultRandomAccessFile : public rocksdb::FSRandomAccessFileOwnerWrapper {
 public:
  FaultRandomAccessFile(FaultFs* fs, std::string fname, std::unique_ptr<rocksdb::FSRandomAccessFile>&& target)
      : FSRandomAccessFileOwnerWrapper(std::move(target)), fs_(fs), fname_(std::move(fname)) {}

  IOStatus Read(uint64_t offset, size_t n, const IOOptions& options, Slice* result, char* scratch,
                IODebugContext* dbg) const override {
    if (IOStatus s = fs_->check("Read", fname_, false); !s.ok()) return s;
    return target()->Read(offset, n, options, result, scratch, dbg);
  }
  // Both go through Read above (the base-class defaults), so each request counts.
  IOStatus MultiRead(rocksdb::FSReadRequest* reqs, size_t num_reqs, const IOOptions& options,
                     IODebugContext* dbg) override {
    return FSRandomAccessFile::MultiRead(reqs, num_reqs, options, dbg);
  }
  IOStatus ReadAsync(rocksdb::FSReadRequest& req, const IOOptions& opts,
                     std::function<void(const rocksdb::FSReadRequest&, void*)> cb, void* cb_arg, void** io_handle,
                     rocksdb::IOHandleDeleter* del_fn, IODebugContext* dbg) override {
    return FSRandomAccessFile::ReadAsync(req, opts, std::move(cb), cb_arg, io_handle, del_fn, dbg);
  }

 private:
  FaultFs* fs_;
  std::string fname_;
};

class FaultSequentialFile : public rocksdb::FSSequentialFileOwnerWrapper {
 public:
  FaultSequentialFile(FaultFs* fs, std::string fname, std::unique_ptr<rocksdb::FSSequentialFile>&& target)
      : FSSequentialFileOwnerWrapper(std::move(target)), fs_(fs), fname_(std::move(fname)) {}

  IOStatus Read(size_t n, const IOOptions& options, Slice* result, char* scratch, IODebugContext* dbg) override {
    if (IOStatus s = fs_->check("Read", fname_, false); !s.ok()) return s;
    return target()->Read(n, options, result, scratch, dbg);
  }
  IOStatus PositionedRead(uint64_t offset, size_t n, const IOOptions& options, Slice* result, char* scratch,
                          IODebugContext* dbg) override {
    if (IOStatus s = fs_->check("PositionedRead", fname_, false); !s.ok()) return s;
    return target()->PositionedRead(offset, n, options, result, scratch, dbg);
  }

 private:
  FaultFs* fs_;
  std::string fname_;
};

class FaultDirectory : public rocksdb::FSDirectoryWrapper {
 public:
  FaultDirectory(FaultFs* fs, std::string name, std::unique_ptr<rocksdb::FSDirectory>&& target)
      : FSDirectoryWrapper(std::move(target)), fs_(fs), name_(std::move(name)) {}

  IOStatus Fsync(const IOOptions& options, IODebugContext* dbg) override {
    if (IOStatus s = fs_->check("DirFsync", name_, true); !s.ok()) return s;
    return FSDirectoryWrapper::Fsync(options, dbg);
  }
  IOStatus FsyncWithDirOptions(const IOOptions& options, IODebugContext* dbg,
                               const rocksdb::DirFsyncOptions& dir_fsync_options) override {
    if (IOStatus s = fs_->check("DirFsync", name_, true); !s.ok()) return s;
    return FSDirectoryWrapper::FsyncWithDirOptions(options, dbg, dir_fsync_options);
  }

 private:
  FaultFs* fs_;
  std::string name_;
};

}  // namespace

FaultFs::FaultFs(std::shared_ptr<rocksdb::FileSystem> base) : FileSystemWrapper(std::move(base)) {}

void FaultFs::fail_nth_op(std::uint64_t n, bool persistent) {
  const std::uint64_t base = ops_.load();
  arm_base_.store(base);
  persistent_.store(persistent);
  fail_at_.store(n == 0 ? 0 : base + n);
}

void FaultFs::clear_faults() {
  fail_at_.store(0);
  persistent_.store(false);
  arm_base_.store(ops_.load());
  fail_wal_append_.store(false);
  fail_wal_sync_.store(false);
  fail_deletes_.store(false);
  fail_reads_of("");
}

void FaultFs::fail_reads_of(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  unreadable_ = path;
  reads_fail_.store(!path.empty());
}

void FaultFs::hold_syncs_under(const std::string& prefix, bool first_sst_only) {
  std::lock_guard<std::mutex> lock(hold_mu_);
  hold_prefix_ = prefix;
  hold_first_sst_only_ = first_sst_only;
  hold_file_.clear();
}

void FaultFs::release_syncs() {
  {
    std::lock_guard<std::mutex> lock(hold_mu_);
    hold_prefix_.clear();
    hold_file_.clear();
  }
  hold_cv_.notify_all();
}

void FaultFs::wait_if_held(const std::string& fname) {
  std::unique_lock<std::mutex> lock(hold_mu_);
  if (hold_prefix_.empty() || fname.rfind(hold_prefix_, 0) != 0) return;
  if (hold_first_sst_only_) {
    const bool sst = fname.size() > 4 && fname.compare(fname.size() - 4, 4, ".sst") == 0;
    if (hold_file_.empty() && sst) hold_file_ = fname;
    if (fname != hold_file_) return;
  }
  held_.fetch_add(1);
  hold_cv_.wait(lock, [&] { return hold_prefix_.empty(); });
  held_.fetch_sub(1);
}

IOStatus FaultFs::check(const char* op, const std::string& fname, bool mutating) {
  if (mutating && power_cut_.load()) return IOStatus::IOError("tidal FaultFs: power is cut: " + std::string(op), fname);
  if (!mutating && reads_fail_.load()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!unreadable_.empty() && fname == unreadable_) {
      injected_.fetch_add(1);
      return IOStatus::IOError("tidal FaultFs: injected read failure (" + std::string(op) + ")", fname);
    }
  }
  const std::uint64_t n = ops_.fetch_add(1) + 1;
  const std::uint64_t at = fail_at_.load();
  if (at != 0 && (n == at || (n > at && persistent_.load()))) {
    injected_.fetch_add(1);
    return IOStatus::IOError("tidal FaultFs: injected failure of operation #" + std::to_string(n - arm_base_.load()) +
                                 " (" + op + ")",
                             fname);
  }
  return IOStatus::OK();
}

IOStatus FaultFs::check_wal(const char* op, const std::string& fname, bool sync) {
  if (!is_wal(fname)) return IOStatus::OK();
  if ((sync && fail_wal_sync_.load()) || (!sync && fail_wal_append_.load())) {
    injected_.fetch_add(1);
    return IOStatus::IOError("tidal FaultFs: injected WAL failure (" + std::string(op) + ")", fname);
  }
  return IOStatus::OK();
}

void FaultFs::note_append(const std::string& fname, std::uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  files_[fname].size += bytes;
}

void FaultFs::note_positioned_append(const std::string& fname, std::uint64_t end) {
  std::lock_guard<std::mutex> lock(mu_);
  FileState& f = files_[fname];
  if (end > f.size) f.size = end;
}

void FaultFs::note_truncate(const std::string& fname, std::uint64_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = files_.find(fname);
  if (it == files_.end()) {
    files_[fname] = FileState{size, size};  // an old (durable) file cut short: the truncation is durable
    return;
  }
  it->second.size = size;
  if (it->second.synced > size) it->second.synced = size;
}

void FaultFs::note_sync(const std::string& fname) {
  std::lock_guard<std::mutex> lock(mu_);
  FileState& f = files_[fname];
  f.synced = f.size;
}

void FaultFs::cut_power() { power_cut_.store(true); }

FaultFs::CutReport FaultFs::restore_power() {
  CutReport report;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [fname, state] : files_) {
    std::error_code ec;
    const auto actual = std::filesystem::file_size(fname, ec);
    if (ec || actual <= state.synced) continue;
    if (::truncate(fname.c_str(), static_cast<off_t>(state.synced)) != 0) std::abort();
    ++report.files_truncated;
    report.bytes_dropped += actual - state.synced;
  }
  files_.clear();
  power_cut_.store(false);
  return report;
}

// ---- FileSystem ----

IOStatus FaultFs::NewSequentialFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSSequentialFile>* r, IODebugContext* dbg) {
  if (IOStatus s = check("NewSequentialFile", f, false); !s.ok()) return s;
  std::unique_ptr<rocksdb::FSSequentialFile> file;
  IOStatus s = target()->NewSequentialFile(f, o, &file, dbg);
  if (s.ok()) *r = std::make_unique<FaultSequentialFile>(this, f, std::move(file));
  return s;
}

IOStatus FaultFs::NewRandomAccessFile(const std::string& f, const rocksdb::FileOptions& o,
                                      std::unique_ptr<rocksdb::FSRandomAccessFile>* r, IODebugContext* dbg) {
  if (IOStatus s = check("NewRandomAccessFile", f, false); !s.ok()) return s;
  std::unique_ptr<rocksdb::FSRandomAccessFile> file;
  IOStatus s = target()->NewRandomAccessFile(f, o, &file, dbg);
  if (s.ok()) *r = std::make_unique<FaultRandomAccessFile>(this, f, std::move(file));
  return s;
}

IOStatus FaultFs::NewWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                  std::unique_ptr<rocksdb::FSWritableFile>* r, IODebugContext* dbg) {
  if (IOStatus s = check("NewWritableFile", f, true); !s.ok()) return s;
  std::unique_ptr<rocksdb::FSWritableFile> file;
  IOStatus s = target()->NewWritableFile(f, o, &file, dbg);
  if (!s.ok()) return s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    files_[f] = FileState{};  // created (or truncated) and not yet synced
  }
  *r = std::make_unique<FaultWritableFile>(this, f, std::move(file));
  return s;
}

IOStatus FaultFs::ReopenWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                     std::unique_ptr<rocksdb::FSWritableFile>* r, IODebugContext* dbg) {
  if (IOStatus s = check("ReopenWritableFile", f, true); !s.ok()) return s;
  std::unique_ptr<rocksdb::FSWritableFile> file;
  IOStatus s = target()->ReopenWritableFile(f, o, &file, dbg);
  if (!s.ok()) return s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (files_.find(f) == files_.end()) {
      std::error_code ec;
      const auto size = std::filesystem::file_size(f, ec);
      const std::uint64_t existing = ec ? 0 : size;
      files_[f] = FileState{existing, existing};  // what is there already is durable
    }
  }
  *r = std::make_unique<FaultWritableFile>(this, f, std::move(file));
  return s;
}

IOStatus FaultFs::ReuseWritableFile(const std::string& f, const std::string& old_f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r, IODebugContext* dbg) {
  if (IOStatus s = check("ReuseWritableFile", f, true); !s.ok()) return s;
  std::unique_ptr<rocksdb::FSWritableFile> file;
  IOStatus s = target()->ReuseWritableFile(f, old_f, o, &file, dbg);
  if (!s.ok()) return s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    files_.erase(old_f);
    files_[f] = FileState{};
  }
  *r = std::make_unique<FaultWritableFile>(this, f, std::move(file));
  return s;
}

IOStatus FaultFs::NewRandomRWFile(const std::string& f, const rocksdb::FileOptions& o,
                                  std::unique_ptr<rocksdb::FSRandomRWFile>* r, IODebugContext* dbg) {
  // RocksDB uses random-rw files only for features tidal does not enable;
  // the open is counted, the writes are not tracked.
  if (IOStatus s = check("NewRandomRWFile", f, true); !s.ok()) return s;
  return target()->NewRandomRWFile(f, o, r, dbg);
}

IOStatus FaultFs::NewDirectory(const std::string& name, const IOOptions& o, std::unique_ptr<rocksdb::FSDirectory>* r,
                               IODebugContext* dbg) {
  if (IOStatus s = check("NewDirectory", name, false); !s.ok()) return s;
  std::unique_ptr<rocksdb::FSDirectory> dir;
  IOStatus s = target()->NewDirectory(name, o, &dir, dbg);
  if (s.ok()) *r = std::make_unique<FaultDirectory>(this, name, std::move(dir));
  return s;
}

IOStatus FaultFs::DeleteFile(const std::string& f, const IOOptions& o, IODebugContext* dbg) {
  if (IOStatus s = check("DeleteFile", f, true); !s.ok()) return s;
  if (fail_deletes_.load()) {
    injected_.fetch_add(1);
    return IOStatus::IOError("tidal FaultFs: injected failure of DeleteFile", f);
  }
  IOStatus s = target()->DeleteFile(f, o, dbg);
  if (s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    files_.erase(f);
  }
  return s;
}

IOStatus FaultFs::Truncate(const std::string& f, size_t size, const IOOptions& o, IODebugContext* dbg) {
  if (IOStatus s = check("Truncate", f, true); !s.ok()) return s;
  IOStatus s = target()->Truncate(f, size, o, dbg);
  if (s.ok()) note_truncate(f, size);
  return s;
}

IOStatus FaultFs::CreateDir(const std::string& d, const IOOptions& o, IODebugContext* dbg) {
  if (IOStatus s = check("CreateDir", d, true); !s.ok()) return s;
  return target()->CreateDir(d, o, dbg);
}

IOStatus FaultFs::CreateDirIfMissing(const std::string& d, const IOOptions& o, IODebugContext* dbg) {
  if (IOStatus s = check("CreateDirIfMissing", d, true); !s.ok()) return s;
  return target()->CreateDirIfMissing(d, o, dbg);
}

IOStatus FaultFs::DeleteDir(const std::string& d, const IOOptions& o, IODebugContext* dbg) {
  if (IOStatus s = check("DeleteDir", d, true); !s.ok()) return s;
  return target()->DeleteDir(d, o, dbg);
}

IOStatus FaultFs::RenameFile(const std::string& s_name, const std::string& t_name, const IOOptions& o,
                             IODebugContext* dbg) {
  if (IOStatus s = check("RenameFile", s_name, true); !s.ok()) return s;
  IOStatus s = target()->RenameFile(s_name, t_name, o, dbg);
  if (s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(s_name);
    if (it != files_.end()) {
      files_[t_name] = it->second;
      files_.erase(s_name);
    } else {
      files_.erase(t_name);  // the target is now an old, durable file
    }
  }
  return s;
}

IOStatus FaultFs::LinkFile(const std::string& s_name, const std::string& t_name, const IOOptions& o,
                           IODebugContext* dbg) {
  if (IOStatus s = check("LinkFile", s_name, true); !s.ok()) return s;
  IOStatus s = target()->LinkFile(s_name, t_name, o, dbg);
  if (s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(s_name);
    if (it != files_.end()) files_[t_name] = it->second;
  }
  return s;
}

FaultEnv FaultEnv::make() {
  FaultEnv e;
  e.fs = std::make_shared<FaultFs>();
  e.env = std::make_unique<FaultEnvImpl>(e.fs);
  return e;
}

}  // namespace tidal::reliability
