// FaultFs: a RocksDB FileSystem that fails file operations on demand and
// simulates power loss, for tidal's fault and durability tests.
//
//   auto fault = tidal::reliability::FaultEnv::make();
//   Db::Impl::open(path, options, fault.env.get());   // keep `fault` alive
//
// (a) WAL faults: set_fail_wal_append / set_fail_wal_sync make every Append /
//     Sync (or Fsync) of a write-ahead-log file ("*.log") fail with IOError.
// (b) Nth-operation faults: fail_nth_op(n, persistent) fails the n-th counted
//     operation from now (1-based), and with `persistent` every one after it.
//     Counted operations: opening a file (sequential, random-access, writable,
//     reopen, reuse, random-rw, directory), Append, PositionedAppend,
//     Truncate, Sync, Fsync, RangeSync and Close of a writable file,
//     directory Fsync, Read of sequential and random-access files,
//     RenameFile, LinkFile, DeleteFile, Truncate by name, CreateDir,
//     CreateDirIfMissing, DeleteDir. Not counted (never failed): Flush of a
//     writable file (a no-op for POSIX files), LockFile/UnlockFile,
//     FileExists, GetChildren, GetFileSize and the other metadata queries.
// (c) Power loss: the file system remembers, for every file written through
//     it, its length and the length at its last Sync/Fsync. cut_power() makes
//     every later mutating operation fail with IOError without touching disk
//     (the "machine" is off: the Db can be destroyed, and whatever its close
//     tries to write is lost). restore_power() then truncates every such file
//     to its last synced length and forgets them. The model is deliberately
//     simple:
//       - a file created and never synced is truncated to 0 bytes (not
//         deleted: directory entries count as durable);
//       - renames, links and deletes are durable when they return;
//       - RangeSync (sync_file_range) does not count as a sync;
//       - files not written since the last restore_power() (or ever) are
//         durable as they are.
//     RocksDB syncs a directory after creating CURRENT/MANIFEST files, so
//     treating directory entries as durable hides nothing tidal relies on.
//
// Thread-safe: RocksDB calls it from its background threads too.
#ifndef TIDAL_TESTS_FAULT_FS_H_
#define TIDAL_TESTS_FAULT_FS_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <rocksdb/env.h>
#include <rocksdb/file_system.h>

namespace tidal::reliability {

class FaultFs : public rocksdb::FileSystemWrapper {
 public:
  explicit FaultFs(std::shared_ptr<rocksdb::FileSystem> base = rocksdb::FileSystem::Default());

  static const char* kClassName() { return "TidalFaultFs"; }
  const char* Name() const override { return kClassName(); }

  // ---- (a) WAL faults ----
  void set_fail_wal_append(bool on) { fail_wal_append_.store(on); }
  void set_fail_wal_sync(bool on) { fail_wal_sync_.store(on); }

  // Makes every DeleteFile fail (RocksDB then keeps obsolete files, and
  // retries at its next purge of obsolete files); cleared by clear_faults.
  void set_fail_deletes(bool on) { fail_deletes_.store(on); }

  // Makes every open and Read of the file at `path` fail (a bad sector
  // under one file); "" for none. Cleared by clear_faults.
  void fail_reads_of(const std::string& path);

  // Holds every Sync/Fsync of a writable file whose path starts with
  // `prefix` (a stalled disk under one engine) until release_syncs(). With
  // `first_sst_only`, only those of the first such SST file to sync (one
  // flush or compaction stalled while the rest of the engine goes on).
  void hold_syncs_under(const std::string& prefix, bool first_sst_only = false);
  void release_syncs();
  // Syncs waiting in a hold now.
  std::uint64_t held_syncs() const { return held_.load(); }
  // Called by the file wrappers before a Sync/Fsync of `fname`.
  void wait_if_held(const std::string& fname);

  // ---- (b) Nth-operation faults ----
  // Fails the n-th counted operation from now (n >= 1); with `persistent`,
  // every counted operation after it too. Resets ops_since_arm().
  void fail_nth_op(std::uint64_t n, bool persistent);
  // Disarms every fault (WAL and Nth-operation); power state is unchanged.
  void clear_faults();
  // Counted operations since the last fail_nth_op/clear_faults.
  std::uint64_t ops_since_arm() const { return ops_.load() - arm_base_.load(); }
  // Faults injected (all kinds) since construction.
  std::uint64_t faults_injected() const { return injected_.load(); }

  // ---- (c) power loss ----
  void cut_power();
  struct CutReport {
    std::uint64_t files_truncated = 0;
    std::uint64_t bytes_dropped = 0;
  };
  // Truncates every file written since the last restore to its last synced
  // length, forgets them and lets operations through again. Call it once the
  // Db opened on this file system is destroyed.
  CutReport restore_power();

  // ---- FileSystem ----
  rocksdb::IOStatus NewSequentialFile(const std::string& f, const rocksdb::FileOptions& o,
                                      std::unique_ptr<rocksdb::FSSequentialFile>* r,
                                      rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus NewRandomAccessFile(const std::string& f, const rocksdb::FileOptions& o,
                                        std::unique_ptr<rocksdb::FSRandomAccessFile>* r,
                                        rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus NewWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r,
                                    rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus ReopenWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                       std::unique_ptr<rocksdb::FSWritableFile>* r,
                                       rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus ReuseWritableFile(const std::string& f, const std::string& old_f,
                                      const rocksdb::FileOptions& o, std::unique_ptr<rocksdb::FSWritableFile>* r,
                                      rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus NewRandomRWFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSRandomRWFile>* r,
                                    rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus NewDirectory(const std::string& name, const rocksdb::IOOptions& o,
                                 std::unique_ptr<rocksdb::FSDirectory>* r, rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus DeleteFile(const std::string& f, const rocksdb::IOOptions& o,
                               rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus Truncate(const std::string& f, size_t size, const rocksdb::IOOptions& o,
                             rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus CreateDir(const std::string& d, const rocksdb::IOOptions& o,
                              rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus CreateDirIfMissing(const std::string& d, const rocksdb::IOOptions& o,
                                       rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus DeleteDir(const std::string& d, const rocksdb::IOOptions& o,
                              rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus RenameFile(const std::string& s, const std::string& t, const rocksdb::IOOptions& o,
                               rocksdb::IODebugContext* dbg) override;
  rocksdb::IOStatus LinkFile(const std::string& s, const std::string& t, const rocksdb::IOOptions& o,
                             rocksdb::IODebugContext* dbg) override;

  // ---- used by the file wrappers (fault_fs.cc) ----
  // Counts one operation and returns the fault to inject, if any. `mutating`
  // operations also fail while the power is cut.
  rocksdb::IOStatus check(const char* op, const std::string& fname, bool mutating);
  // A WAL fault for an Append (`sync` false) or Sync of `fname`, if armed.
  rocksdb::IOStatus check_wal(const char* op, const std::string& fname, bool sync);
  void note_append(const std::string& fname, std::uint64_t bytes);
  void note_positioned_append(const std::string& fname, std::uint64_t end);
  void note_truncate(const std::string& fname, std::uint64_t size);
  void note_sync(const std::string& fname);

 private:
  std::mutex hold_mu_;
  std::condition_variable hold_cv_;
  std::string hold_prefix_;  // empty: no hold
  bool hold_first_sst_only_ = false;
  std::string hold_file_;  // with hold_first_sst_only_: the file held, once one synced
  std::atomic<std::uint64_t> held_{0};
  struct FileState {
    std::uint64_t size = 0;
    std::uint64_t synced = 0;
  };

  std::atomic<bool> fail_wal_append_{false};
  std::atomic<bool> fail_wal_sync_{false};
  std::atomic<bool> fail_deletes_{false};
  std::string unreadable_;  // guarded by mu_; "" for none
  std::atomic<bool> reads_fail_{false};  // unreadable_ is not "": reads take mu_ only then
  std::atomic<std::uint64_t> ops_{0};
  std::atomic<std::uint64_t> arm_base_{0};
  std::atomic<std::uint64_t> fail_at_{0};  // absolute op number; 0 = disarmed
  std::atomic<bool> persistent_{false};
  std::atomic<std::uint64_t> injected_{0};
  std::atomic<bool> power_cut_{false};

  std::mutex mu_;
  std::map<std::string, FileState> files_;  // written since the last restore_power()
};

// A FaultFs and the Env that plugs it into RocksDB. Keep it alive as long as
// any Db opened on `env`.
struct FaultEnv {
  std::shared_ptr<FaultFs> fs;
  std::unique_ptr<rocksdb::Env> env;
  static FaultEnv make();
};

}  // namespace tidal::reliability

#endif  // TIDAL_TESTS_FAULT_FS_H_
