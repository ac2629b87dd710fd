// The GlobalView: every shard's change feed summed in one RocksDB database
// (view/view_format.h). Open and its checks, the Call that counts every
// public call so that close() waits for them, apply, reads and checkpoint.
#include "tidal/global_view.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <system_error>
#include <utility>

#include <rocksdb/cache.h>
#include <rocksdb/db.h>
#include <rocksdb/utilities/checkpoint.h>
#include <rocksdb/write_batch.h>

#include "db/guarded.h"
#include "storage/feed_format.h"
#include "storage/state_format.h"
#include "storage/storage.h"
#include "view/global_view_impl.h"
#include "view/view_format.h"

namespace tidal {
namespace {

namespace fs = std::filesystem;

std::string view_at(const std::string& path) { return "global view at '" + path + "'"; }
std::string cannot_open(const std::string& path) { return "cannot open tidal " + view_at(path); }
std::string shard_seq(std::uint64_t shard, std::uint64_t seq) {
  return "shard " + std::to_string(shard) + " seq " + std::to_string(seq);
}
rocksdb::Slice slice(std::string_view s) { return {s.data(), s.size()}; }
std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

// ---- which directories this process holds ----

// Views this process has open for writing, keyed by the directory itself
// (device, inode), so that every spelling of it (symlink, "a/../a", trailing
// '/') finds the entry; the value is the path the holder opened, for
// messages. RocksDB's own lock table is keyed by the path string, and an
// fcntl lock never conflicts with its own process: without this table a
// second spelling would open a second writer. Guarded by g_open_mu, which
// open holds from the check to the insert.
using DirId = std::pair<dev_t, ino_t>;
std::mutex g_open_mu;
std::map<DirId, std::string> g_open_dirs;

Status check_not_open_here(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::OK();  // no directory yet: nothing open there
  auto it = g_open_dirs.find({st.st_dev, st.st_ino});
  if (it == g_open_dirs.end()) return Status::OK();
  return Status::Busy(cannot_open(path) + ": it is already open for writing by another handle in this process, as '" +
                      it->second + "'");
}

// Busy when another process holds RocksDB's LOCK on the directory, checked
// before RocksDB's open, which would first start a new info LOG (renaming
// the holder's). Only after check_not_open_here: closing any descriptor of
// LOCK drops this process's own fcntl lock on it.
Status check_not_held_elsewhere(const std::string& path) {
  const int fd = ::open((path + "/LOCK").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::OK();  // no LOCK file yet: nobody holds it
  struct flock probe {};
  probe.l_type = F_WRLCK;
  probe.l_whence = SEEK_SET;
  const bool held = ::fcntl(fd, F_GETLK, &probe) == 0 && probe.l_type != F_UNLCK;
  ::close(fd);
  if (!held) return Status::OK();
  return Status::Busy(cannot_open(path) + ": it is already open by another process (pid " +
                      std::to_string(probe.l_pid) + " holds " + path + "/LOCK)");
}

bool is_lock_error(const rocksdb::Status& s) {
  const std::string text = s.ToString();
  return s.IsIOError() && (text.find("/LOCK") != std::string::npos || text.find("lock hold") != std::string::npos);
}

// What is at `path` before RocksDB is asked to open it: nothing to open (a
// Status), a database (true) or nothing yet (false).
Result<bool> check_path(const std::string& path, const GlobalViewOptions& options) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) return Status::IOError(cannot_open(path) + ": " + ec.message());
  if (!fs::exists(st)) {
    if (!options.create_if_missing || options.read_only) {
      return Status::NotFound(cannot_open(path) + ": no such directory" +
                              (options.read_only ? " (a read-only open never creates one)" : ""));
    }
    return false;
  }
  if (!fs::is_directory(st)) {
    return Status::InvalidArgument(cannot_open(path) + ": it is a " +
                                   (fs::is_regular_file(st) ? "regular file" : "non-directory file") +
                                   ", not a directory");
  }
  const bool exists = fs::exists(fs::path(path) / "CURRENT", ec);
  if (!exists && (options.read_only || !options.create_if_missing)) {
    return Status::NotFound(cannot_open(path) + ": the directory holds no database (no CURRENT file)" +
                            (options.read_only ? "; a read-only open never creates one" : ""));
  }
  if (options.read_only) return exists;
  if (::access(path.c_str(), W_OK | X_OK) != 0) {
    return Status::IOError(cannot_open(path) + ": directory is not writable (" + std::strerror(errno) + ")");
  }
  if (Status s = check_not_held_elsewhere(path); !s.ok()) return s;
  return exists;
}

// InvalidArgument unless the database at `path` has exactly the view's
// column families (a view made before per-shard sums lacks "shards"): a
// tidal Db (or any other RocksDB database) is refused before RocksDB opens
// it for writing, so it is left as it was. *has_shards: whether it has them.
Status check_column_families(const std::string& path, bool* has_shards) {
  std::vector<std::string> names;
  rocksdb::Status s = rocksdb::DB::ListColumnFamilies(rocksdb::DBOptions(), path, &names);
  if (!s.ok()) return from_rocksdb(s, cannot_open(path) + ": listing its column families failed");
  std::sort(names.begin(), names.end());
  *has_shards = names == std::vector<std::string>{kViewAggregatesFamily, kViewMetaFamily, kViewShardsFamily};
  if (*has_shards || names == std::vector<std::string>{kViewAggregatesFamily, kViewMetaFamily}) return Status::OK();
  std::string list;
  for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
  if (std::find(names.begin(), names.end(), "users") != names.end()) {
    return Status::InvalidArgument(cannot_open(path) + ": the directory holds a tidal Db (column families " + list +
                                   "), not a global view");
  }
  return Status::InvalidArgument(cannot_open(path) + ": the directory holds a RocksDB database that is not a tidal " +
                                 "global view (column families " + list + "; a view has aggregates, default, shards)");
}

// The RocksDB options of a view: bounded memory (the block cache, index and
// filter blocks included, and 64 MiB of memtables), bloom filters, the
// integer-add merge operator on aggregates, and the files kept small on a
// small disk (no WAL preallocation, at most 16 MiB of WAL, two info logs).
// The table options are the Db's (set_table_options, storage/storage.h).
rocksdb::Options view_options(const GlobalViewOptions& config, bool with_shards,
                              std::vector<rocksdb::ColumnFamilyDescriptor>* descriptors) {
  rocksdb::Options options;
  options.create_if_missing = config.create_if_missing && !config.read_only;
  options.create_missing_column_families = !config.read_only;
  options.paranoid_checks = true;
  options.avoid_flush_during_shutdown = false;
  options.keep_log_file_num = 2;
  options.allow_fallocate = false;
  options.max_total_wal_size = 16 << 20;
  options.db_write_buffer_size = 64 << 20;

  const std::shared_ptr<rocksdb::Cache> cache = rocksdb::NewLRUCache(config.block_cache_bytes);
  rocksdb::ColumnFamilyOptions meta(options);
  set_table_options(cache, &meta);
  rocksdb::ColumnFamilyOptions aggregates(options);
  set_table_options(cache, &aggregates);
  aggregates.merge_operator = new_units_add_operator();
  aggregates.level_compaction_dynamic_level_bytes = true;
  descriptors->emplace_back(kViewMetaFamily, meta);
  descriptors->emplace_back(kViewAggregatesFamily, aggregates);
  if (with_shards) descriptors->emplace_back(kViewShardsFamily, aggregates);
  return options;
}

// ---- views alive in the process, for the exit handler ----

// Allocated once and never destroyed, so it outlives every static destructor.
struct LiveViews {
  std::mutex mu;
  std::vector<GlobalView::Impl*> impls;
  bool exiting = false;  // set by the exit handler; ~GlobalView then leaks the Impl
};
LiveViews& live_views() {
  static LiveViews* const views = new LiveViews();
  return *views;
}

bool exit_started() {
  LiveViews& views = live_views();
  std::lock_guard<std::mutex> lock(views.mu);
  return views.exiting;
}

void close_all_at_exit();

// Registered at the end of the first successful open, so it runs before the
// destructors of RocksDB's statics built during that open (which close
// needs) and before that of a host global constructed earlier, which then
// finds its view closed (as the Db's exit handler, db/db_impl_open.cc).
void register_exit_handler() {
  static std::once_flag once;
  std::call_once(once, [] { std::atexit(&close_all_at_exit); });
}

}  // namespace

// One public call, counted in calls_ while it runs; refused (Closed, counting
// nothing) once close() has begun. closed_ and calls_ are seq_cst on both
// sides (Dekker): either the caller sees closed_, or close() sees the call
// counted and waits for it.
class GlobalView::Impl::Call {
 public:
  Call(const Impl* impl, const char* what) : impl_(impl) {
    impl_->calls_.fetch_add(1, std::memory_order_seq_cst);
    if (impl_->closed_.load(std::memory_order_seq_cst)) {
      status_ = Status::Closed(std::string(what) + " on a closed global view");
    }
  }
  ~Call() {
    if (impl_->calls_.fetch_sub(1, std::memory_order_seq_cst) == 1 && impl_->closed_.load(std::memory_order_seq_cst)) {
      std::lock_guard<std::mutex> lock(impl_->drain_mu_);  // close() is waiting or has not checked calls_ yet
      impl_->drained_.notify_all();
    }
  }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  const Status& status() const { return status_; }

 private:
  const Impl* impl_;
  Status status_;
};

namespace {
void close_all_at_exit() {
  LiveViews& views = live_views();
  // Held throughout, so no ~Impl runs on another thread meanwhile.
  std::lock_guard<std::mutex> lock(views.mu);
  views.exiting = true;
  for (GlobalView::Impl* impl : views.impls) (void)impl->close();
}
}  // namespace

GlobalView::Impl::Impl(std::string path, const GlobalViewOptions& options)
    : path_(std::move(path)), options_(options) {
  LiveViews& views = live_views();
  std::lock_guard<std::mutex> lock(views.mu);
  views.impls.push_back(this);
}

GlobalView::Impl::~Impl() {
  if (db_ != nullptr) (void)shut_down(/*flush=*/false);
  LiveViews& views = live_views();
  std::lock_guard<std::mutex> lock(views.mu);
  views.impls.erase(std::find(views.impls.begin(), views.impls.end(), this));
}

Result<std::unique_ptr<GlobalView>> GlobalView::Impl::open(const std::string& path, const GlobalViewOptions& options,
                                                           rocksdb::Env* env) {
  // Constructed (listed for the exit handler) before g_open_mu is taken, and
  // destroyed after it is released: the exit handler takes the two locks in
  // the other order (live_views().mu, then g_open_mu in shut_down).
  auto impl = std::unique_ptr<Impl>(new Impl(path, options));
  std::unique_lock<std::mutex> registry(g_open_mu);
  if (!options.read_only) {
    if (Status s = check_not_open_here(path); !s.ok()) return s;
  }
  Result<bool> exists = check_path(path, options);
  if (!exists.ok()) return exists.status();
  bool has_shards = false;
  if (*exists) {
    if (Status s = check_column_families(path, &has_shards); !s.ok()) return s;
  }

  // A writable open adds the shards family to a view made before it; a
  // read-only one opens what is there.
  std::vector<rocksdb::ColumnFamilyDescriptor> descriptors;
  rocksdb::Options rocks = view_options(options, has_shards || !options.read_only, &descriptors);
  if (env != nullptr) rocks.env = env;
  rocksdb::DB* raw = nullptr;
  const rocksdb::Status s = options.read_only
                                ? rocksdb::DB::OpenForReadOnly(rocks, path, descriptors, &impl->handles_, &raw)
                                : rocksdb::DB::Open(rocks, path, descriptors, &impl->handles_, &raw);
  if (!s.ok()) {
    if (is_lock_error(s)) {
      return Status::Busy(cannot_open(path) + ": it is already open by another handle (this process or another one): " +
                          s.ToString());
    }
    return from_rocksdb(s, cannot_open(path));
  }
  impl->db_.reset(raw);
  if (Status f = impl->check_format(/*created=*/!*exists); !f.ok()) return f;  // ~Impl closes RocksDB
  if (!options.read_only) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      return Status::IOError(cannot_open(path) + ": stat of the directory failed (" + std::strerror(errno) + ")");
    }
    impl->registry_id_ = DirId{st.st_dev, st.st_ino};
    std::error_code ec;
    const fs::path canonical = fs::weakly_canonical(path, ec);
    g_open_dirs.emplace(*impl->registry_id_, ec ? path : canonical.string());
  }
  register_exit_handler();
  return std::unique_ptr<GlobalView>(new GlobalView(std::move(impl)));
}

Status GlobalView::Impl::check_format(bool created) {
  std::string mark;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), meta(), kViewFormatKey, &mark);
  if (s.ok()) {
    if (mark == kViewFormat) {
      per_shard_ = true;
      return Status::OK();
    }
    if (mark == kViewFormatBeforeIncarnations || mark == kViewFormatBeforePerShardSums) {
      // A view that applied batches before per-shard sums cannot tell a
      // shard's contribution apart: it stays "2" (a re-seed of a shard it
      // applied is refused). One that applied nothing becomes "3". A "1"'s
      // applied records are 8 bytes, which "2" reads too; marked before any
      // longer record is written (an older version refuses it).
      if (options_.read_only) return Status::OK();
      const rocksdb::Slice prefix(kAppliedPrefix, kAppliedPrefixSize);
      std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), meta()));
      it->Seek(prefix);
      if (Status is = from_rocksdb(it->status(), cannot_open(path_)); !is.ok()) return is;
      per_shard_ = !(it->Valid() && it->key().starts_with(prefix));
      it.reset();
      const char* to = per_shard_ ? kViewFormat : kViewFormatBeforePerShardSums;
      if (mark == to) return Status::OK();
      rocksdb::WriteOptions wo;
      wo.sync = true;
      return from_rocksdb(db_->Put(wo, meta(), kViewFormatKey, to),
                          cannot_open(path_) + ": marking its view_format " + to + " failed");
    }
    return Status::InvalidArgument(cannot_open(path_) + ": its view_format is '" + mark + "'; this version reads '" +
                                   kViewFormat + "' (and the older '2' and '1'; docs/FORMAT.md)");
  }
  if (!s.IsNotFound()) return from_rocksdb(s, cannot_open(path_) + ": reading its view_format failed");
  if (!created) {
    // A creation cut short before the mark was written left nothing else.
    for (rocksdb::ColumnFamilyHandle* cf : handles_) {
      std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), cf));
      it->SeekToFirst();
      if (it->Valid() && cf == meta() && it->key() == rocksdb::Slice(kCleanCloseKey)) it->Next();
      if (Status is = from_rocksdb(it->status(), cannot_open(path_)); !is.ok()) return is;
      if (it->Valid()) {
        return Status::InvalidArgument(cannot_open(path_) + ": it has the column families of a view and records, "
                                       "but no view_format mark (not written by tidal)");
      }
    }
  }
  per_shard_ = true;
  if (options_.read_only) return Status::OK();  // an empty view: it reads as one
  rocksdb::WriteOptions wo;
  wo.sync = true;
  return from_rocksdb(db_->Put(wo, meta(), kViewFormatKey, kViewFormat),
                      cannot_open(path_) + ": writing its view_format failed");
}

Status GlobalView::Impl::shut_down(bool flush) {
  Status result;
  if (flush && !options_.read_only) {
    // RocksDB deletes a WAL only once a flush moved every column family past
    // it, and a flush of empty memtables does nothing: a memtable-only
    // record makes it happen, so the next open replays no WAL.
    rocksdb::WriteOptions no_wal;
    no_wal.disableWAL = true;
    (void)db_->Put(no_wal, meta(), kCleanCloseKey, "");
    rocksdb::FlushOptions fo;
    fo.allow_write_stall = true;
    result = from_rocksdb(db_->Flush(fo, handles_), "close of the " + view_at(path_));
  }
  for (rocksdb::ColumnFamilyHandle* h : handles_) {
    if (Status s = from_rocksdb(db_->DestroyColumnFamilyHandle(h), "close of the " + view_at(path_));
        !s.ok() && result.ok()) {
      result = s;
    }
  }
  handles_.clear();
  if (Status s = from_rocksdb(db_->Close(), "close of the " + view_at(path_)); !s.ok() && result.ok()) result = s;
  db_.reset();
  if (registry_id_) {
    std::lock_guard<std::mutex> registry(g_open_mu);
    g_open_dirs.erase(*registry_id_);
    registry_id_.reset();
  }
  return result;
}

Status GlobalView::Impl::close() {
  std::lock_guard<std::mutex> closing(close_mu_);
  if (closed_.exchange(true, std::memory_order_seq_cst)) return Status::OK();
  {
    std::unique_lock<std::mutex> lock(drain_mu_);
    drained_.wait(lock, [&] { return calls_.load(std::memory_order_seq_cst) == 0; });
  }
  return shut_down(/*flush=*/true);
}

Result<std::uint64_t> GlobalView::Impl::read_applied(std::uint64_t shard_id) const {
  Result<AppliedRecord> r = read_applied_record(shard_id);
  if (!r.ok()) return r.status();
  return r->seq;
}

Result<AppliedRecord> GlobalView::Impl::read_applied_record(std::uint64_t shard_id) const {
  const std::string key = encode_applied_key(shard_id);
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), meta(), key, &value);
  if (s.IsNotFound()) return AppliedRecord{};
  if (!s.ok()) {
    return from_rocksdb(s, "read of shard " + std::to_string(shard_id) + "'s applied seq (key " + hex(key) +
                               ") of the " + view_at(path_));
  }
  std::optional<AppliedRecord> record = decode_applied(value);
  if (!record) {
    return Status::Corruption("shard " + std::to_string(shard_id) + "'s applied seq (key " + hex(key) + ") of the " +
                              view_at(path_) + " has a " + std::to_string(value.size()) +
                              "-byte value; expected 8, 24 or 40");
  }
  Result<std::uint64_t> ordinal = read_ordinal(shard_id);
  if (!ordinal.ok()) return ordinal.status();
  record->ordinal = *ordinal;
  return std::move(*record);
}

Result<std::uint64_t> GlobalView::Impl::read_ordinal(std::uint64_t shard_id) const {
  const std::string key = encode_ordinal_key(shard_id);
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), meta(), key, &value);
  if (s.IsNotFound()) return std::uint64_t{0};
  if (!s.ok()) {
    return from_rocksdb(s, "read of shard " + std::to_string(shard_id) + "'s incarnation ordinal (key " + hex(key) +
                               ") of the " + view_at(path_));
  }
  if (value.size() != 8) {
    return Status::Corruption("shard " + std::to_string(shard_id) + "'s incarnation ordinal (key " + hex(key) +
                              ") of the " + view_at(path_) + " has a " + std::to_string(value.size()) +
                              "-byte value; expected 8");
  }
  return get_u64_be(value.data());
}

Result<bool> GlobalView::Impl::is_retired(std::uint64_t shard_id, const std::string& incarnation,
                                          const AppliedRecord& record) const {
  if (incarnation == record.retired) return true;  // also a view made before "retired/" records
  std::optional<std::string> bytes = incarnation_bytes(incarnation);
  if (!bytes) return false;
  const std::string key = encode_retired_key(shard_id, *bytes);
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), meta(), key, &value);
  if (s.IsNotFound()) return false;
  if (!s.ok()) {
    return from_rocksdb(s, "read of shard " + std::to_string(shard_id) + "'s retired incarnations (key " +
                               hex(key) + ") of the " + view_at(path_));
  }
  return true;
}

Result<bool> GlobalView::Impl::apply(const ChangeBatch& batch) {
  Result<ApplyOutcome> outcome = apply(std::span<const ChangeBatch>(&batch, 1));
  if (!outcome.ok()) return outcome.status();
  if (!outcome->refused.ok()) return outcome->refused;
  return outcome->applied == 1;
}

Result<ApplyOutcome> GlobalView::Impl::apply(std::span<const ChangeBatch> batches) {
  Call call(this, "apply");
  if (!call.status().ok()) return call.status();
  const std::size_t n = batches.size();
  // The call as a whole: one batch is named by its shard and seq, as apply(batch) names it.
  const std::string what_all =
      (n == 1 ? "apply of " + shard_seq(batches[0].shard_id, batches[0].seq)
              : "apply of " + std::to_string(n) + " batches" +
                    (n == 0 ? std::string()
                            : " (" + shard_seq(batches[0].shard_id, batches[0].seq) + " to " +
                                  shard_seq(batches[n - 1].shard_id, batches[n - 1].seq) + ")")) +
      " to the " + view_at(path_);
  if (options_.read_only) return Status::InvalidArgument(what_all + ": the view is open read-only");

  ApplyOutcome out;
  // What a refusal leaves: for one batch, nothing; for a run, the batches before it.
  auto untouched = [&](std::size_t i) {
    if (n == 1) return std::string("nothing changed");
    return "nothing of it or of the " + std::to_string(n - i - 1) + " later batches of the call applied (the " +
           std::to_string(i) + " before it are)";
  };
  // Each shard's applied record as the batches taken so far leave it, and
  // whether one of them moved it since the last write.
  std::map<std::uint64_t, std::pair<AppliedRecord, bool>> seqs;
  // The shards and payloads of the batches to apply in the next write
  // (checked whole).
  std::vector<std::pair<std::uint64_t, std::string_view>> pending;
  std::string error;
  const std::string may_be_stored =
      std::string(" failed; ") + (n == 1 ? "the batch" : "the batches") +
      " may or may not be stored (applied_seq tells after a reopen; delivering " + (n == 1 ? "it" : "them") +
      " again is safe)";

  // Writes `pending` and the applied records they moved in one atomic,
  // fsynced write: after a crash either all of them are there or none.
  auto write_pending = [&]() -> Status {
    if (pending.empty()) return Status::OK();
    rocksdb::WriteBatch write;
    rocksdb::Status added;
    std::string units;
    // One merge operand a cell for the whole write, not one a delta (a
    // fetched run of 18 batches held ~270k deltas for 32k cells in
    // bench/nats_sim): each payload's keys ascend, so a merge of the
    // payloads meets a cell's deltas one after another. Integer sums
    // (modulo 2^128, as the merge operator adds): exactly what the deltas
    // one by one would give. The shards family gets the same per shard.
    std::vector<std::string_view> payloads;
    auto merge_into = [&](rocksdb::ColumnFamilyHandle* cf, std::optional<std::uint64_t> shard) {
      merge_feed_payloads(payloads, [&](std::string_view key, Units sum) {
        if (!added.ok()) return;
        units.clear();
        put_units(&units, sum);
        added = shard ? write.Merge(cf, encode_shard_cell_key(*shard, key), slice(units))
                      : write.Merge(cf, slice(key), slice(units));
      });
    };
    for (const auto& p : pending) payloads.push_back(p.second);
    merge_into(aggregates(), std::nullopt);
    if (per_shard_) {
      for (const auto& [shard, state] : seqs) {
        if (!state.second) continue;
        payloads.clear();
        for (const auto& p : pending) {
          if (p.first == shard) payloads.push_back(p.second);
        }
        merge_into(shards(), shard);
      }
    }
    if (!added.ok()) return from_rocksdb(added, what_all + ": building its write failed; nothing changed");
    for (auto& [shard, state] : seqs) {
      if (!state.second) continue;
      added = write.Put(meta(), encode_applied_key(shard), encode_applied(state.first));
      if (added.ok() && state.first.ordinal > 0) {
        added = write.Put(meta(), encode_ordinal_key(shard), encode_ordinal(state.first.ordinal));
      }
      if (!added.ok()) return from_rocksdb(added, what_all + ": building its write failed; nothing changed");
    }
    rocksdb::WriteOptions wo;
    wo.sync = true;
    if (Status s = from_rocksdb(db_->Write(wo, &write), what_all + may_be_stored); !s.ok()) return s;
    pending.clear();
    for (auto& entry : seqs) entry.second.second = false;
    return Status::OK();
  };

  // The first batch of a re-seed (FeedOrigin::Reseed) of a new incarnation:
  // in one atomic, fsynced write, the shard's whole contribution is taken
  // out of the sums and replaced by the batch's values.
  auto write_reseed = [&](const ChangeBatch& batch, AppliedRecord* record) -> Status {
    rocksdb::WriteBatch write;
    rocksdb::Status added;
    std::string units;
    std::string prefix;
    put_u64_be(&prefix, batch.shard_id);
    if (per_shard_) {
      std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), shards()));
      for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix) && added.ok(); it->Next()) {
        std::optional<Units> v = decode_units(view(it->value()));
        if (!v) {
          return Status::Corruption("re-seed of shard " + std::to_string(batch.shard_id) + " in the " +
                                    view_at(path_) + ": its sum under key " + hex(view(it->key())) + " has a " +
                                    std::to_string(it->value().size()) + "-byte value; expected 16; nothing changed");
        }
        units.clear();
        put_units(&units, static_cast<Units>(UUnits{0} - static_cast<UUnits>(*v)));
        added = write.Merge(aggregates(), it->key().ToString().substr(8), units);
        if (added.ok()) added = write.Delete(shards(), it->key());
      }
      if (Status s = from_rocksdb(it->status(), "re-seed of shard " + std::to_string(batch.shard_id) + " in the " +
                                                    view_at(path_) + ": reading its sums");
          !s.ok()) {
        return s;
      }
    }
    (void)decode_feed_payload(
        batch.payload,
        [&](const FeedEntry& e) {
          if (!added.ok()) return;
          const std::string key = encode_aggregate_key(e.kind, e.owner, e.item);
          units.clear();
          put_units(&units, e.delta);
          added = write.Merge(aggregates(), key, units);
          if (added.ok() && per_shard_) added = write.Merge(shards(), encode_shard_cell_key(batch.shard_id, key), units);
        },
        &error);
    // Not older than the shard's (apply checked): its ordinal is the highest.
    AppliedRecord next{batch.seq, batch.incarnation, record->incarnation,
                       std::max(record->ordinal, batch.incarnation_ordinal)};
    if (added.ok()) added = write.Put(meta(), encode_applied_key(batch.shard_id), encode_applied(next));
    if (added.ok() && next.ordinal > 0) {
      added = write.Put(meta(), encode_ordinal_key(batch.shard_id), encode_ordinal(next.ordinal));
    }
    // Every incarnation replaced is remembered, not only the last: a batch
    // of any of them delivered late is skipped (an incarnation is random
    // and new at each re-seed and restore, so none comes back).
    for (const std::string* replaced : {&record->incarnation, &record->retired}) {
      std::optional<std::string> bytes = incarnation_bytes(*replaced);
      if (added.ok() && bytes) added = write.Put(meta(), encode_retired_key(batch.shard_id, *bytes), "");
    }
    if (!added.ok()) return from_rocksdb(added, what_all + ": building its write failed; nothing changed");
    rocksdb::WriteOptions wo;
    wo.sync = true;
    if (Status s = from_rocksdb(db_->Write(wo, &write), what_all + may_be_stored); !s.ok()) return s;
    *record = std::move(next);
    return Status::OK();
  };

  std::lock_guard<std::mutex> serial(apply_mu_);
  for (const ChangeBatch& batch : batches) {
    const std::size_t i = out.taken;
    const std::string what = "apply of " + shard_seq(batch.shard_id, batch.seq) + " to the " + view_at(path_);
    if (batch.seq == 0) {
      out.refused = Status::InvalidArgument(what + ": seqs start at 1; " + untouched(i));
      break;
    }
    // The payload is checked whole before its seq is compared (so a payload
    // that does not decode is refused at an applied seq too).
    if (batch.payload.size() > kMaxChangePayloadBytes) {
      out.refused = Status::Corruption(what + ": the payload does not decode: " +
                                       std::to_string(batch.payload.size()) +
                                       " bytes, above kMaxChangePayloadBytes (" +
                                       std::to_string(kMaxChangePayloadBytes) + "); " + untouched(i));
      break;
    }
    error.clear();
    if (!check_feed_payload(batch.payload, &error)) {
      out.refused = Status::Corruption(what + ": the payload does not decode: " + error + "; " + untouched(i));
      break;
    }
    if (!batch.incarnation.empty() && !incarnation_bytes(batch.incarnation)) {
      out.refused = Status::Corruption(what + ": its incarnation '" + batch.incarnation +
                                       "' is not 32 lowercase hex digits; " + untouched(i));
      break;
    }
    auto it = seqs.find(batch.shard_id);
    if (it == seqs.end()) {
      Result<AppliedRecord> record = read_applied_record(batch.shard_id);
      if (!record.ok()) return record.status();
      it = seqs.emplace(batch.shard_id, std::make_pair(std::move(*record), false)).first;
    }
    AppliedRecord& record = it->second.first;
    std::uint64_t& applied = record.seq;
    std::string& incarnation = record.incarnation;
    if (!batch.incarnation.empty() && batch.incarnation != incarnation) {
      // A batch of an incarnation older than one applied for the shard,
      // seen or not (a late delivery): superseded.
      if (batch.incarnation_ordinal > 0 && batch.incarnation_ordinal < record.ordinal) {
        ++out.taken;
        ++out.superseded;
        continue;
      }
      Result<bool> retired = is_retired(batch.shard_id, batch.incarnation, record);
      if (!retired.ok()) return retired.status();
      if (*retired) {
        ++out.taken;  // a batch of an incarnation a re-seed replaced, delivered late: superseded
        ++out.superseded;
        continue;
      }
    }
    // The first batch of a re-seed: at whatever seq, it replaces all the
    // view holds of the shard (a view made before per-shard sums cannot
    // tell that apart once it applied the shard).
    if (feed_origin(batch.payload) == FeedOrigin::Reseed && !batch.incarnation.empty() &&
        batch.incarnation != incarnation) {
      // Without an ordinal (a writer before ordinals), it cannot be ordered
      // against the shard's, which has one: it may be older (delivered
      // late), so it replaces nothing.
      if (record.ordinal > 0 && batch.incarnation_ordinal == 0) {
        out.refused = Status::Corruption(
            "re-seed: shard " + std::to_string(batch.shard_id) + " has applied through seq " +
            std::to_string(applied) + " of incarnation " + incarnation + " (ordinal " +
            std::to_string(record.ordinal) + "); batch seq " + std::to_string(batch.seq) +
            " re-seeds it as incarnation " + batch.incarnation + ", which has no ordinal (written by a version "
            "before ordinals), so the " + view_at(path_) + " cannot tell whether it is older; " + untouched(i) +
            ": if that Db owns the shard now, upgrade it and re-seed it again (Db::reseed_change_feed)");
        break;
      }
      if (applied > 0 && !per_shard_) {
        out.refused = Status::Corruption(
            "re-seed: shard " + std::to_string(batch.shard_id) + " has applied through seq " +
            std::to_string(applied) + "; batch seq " + std::to_string(batch.seq) + " re-seeds it as incarnation " +
            batch.incarnation + ", but the " + view_at(path_) +
            " was made before views kept each shard's sums (view_format 2), so it cannot take out the shard's old "
            "contribution; " + untouched(i) + ": build a new view (docs/SCALE.md, \"Re-seeding a shard\")");
        break;
      }
      if (Status s = write_pending(); !s.ok()) return s;
      if (Status s = write_reseed(batch, &record); !s.ok()) return s;
      ++out.taken;
      ++out.applied;
      continue;
    }
    // A batch of another feed than the one the view applied for this shard
    // (a Db restored or re-created for it, or a twin): refused, whatever its
    // seq, so that one at an applied seq is not skipped as delivered again.
    if (applied > 0 && !batch.incarnation.empty() && !incarnation.empty() && batch.incarnation != incarnation) {
      out.refused = Status::Corruption(
          "incarnation: shard " + std::to_string(batch.shard_id) + " has applied through seq " +
          std::to_string(applied) + " of incarnation " + incarnation + "; batch seq " + std::to_string(batch.seq) +
          " is of incarnation " + batch.incarnation + " (" + view_at(path_) + "); " + untouched(i) +
          ": another Db (restored, re-created or a twin) published this shard; the shard must be re-seeded "
          "(Db::reseed_change_feed on the Db that owns it)");
      break;
    }
    if (batch.seq <= applied) {  // delivered again
      ++out.taken;
      continue;
    }
    if (batch.seq != applied + 1) {
      out.refused = Status::Corruption("gap: shard " + std::to_string(batch.shard_id) + " has applied through " +
                                       std::to_string(applied) + "; batch seq " + std::to_string(batch.seq) + " (" +
                                       view_at(path_) + "); " + untouched(i) + ": apply seq " +
                                       std::to_string(applied + 1) + " first");
      break;
    }
    pending.emplace_back(batch.shard_id, batch.payload);
    applied = batch.seq;
    if (incarnation.empty()) incarnation = batch.incarnation;  // the first known, kept from now on
    // A feed made before ordinals gets one for its incarnation at its first
    // writable open: the same incarnation's batches then carry it.
    if (!batch.incarnation.empty()) record.ordinal = std::max(record.ordinal, batch.incarnation_ordinal);
    it->second.second = true;
    ++out.taken;
    ++out.applied;
  }
  if (Status s = write_pending(); !s.ok()) return s;
  return out;
}

Result<std::uint64_t> GlobalView::Impl::applied_seq(std::uint64_t shard_id) const {
  Call call(this, "applied_seq");
  if (!call.status().ok()) return call.status();
  return read_applied(shard_id);
}

Result<std::vector<ShardProgress>> GlobalView::Impl::applied_shards() const {
  Call call(this, "applied_shards");
  if (!call.status().ok()) return call.status();
  std::vector<ShardProgress> out;
  const rocksdb::Slice prefix(kAppliedPrefix, kAppliedPrefixSize);
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), meta()));
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    const std::optional<std::uint64_t> shard = decode_applied_key(view(it->key()));
    std::optional<AppliedRecord> record = decode_applied(view(it->value()));
    if (!shard || !record) {
      return Status::Corruption("applied record (key " + hex(view(it->key())) + ") of the " + view_at(path_) +
                                " does not decode: expected an 8-byte shard id in the key and an 8-byte seq (and "
                                "a 16-byte incarnation), got a " +
                                std::to_string(it->value().size()) + "-byte value");
    }
    Result<std::uint64_t> ordinal = read_ordinal(*shard);
    if (!ordinal.ok()) return ordinal.status();
    out.push_back({*shard, record->seq, std::move(record->incarnation), *ordinal});
  }
  if (Status s = from_rocksdb(it->status(), "applied_shards of the " + view_at(path_)); !s.ok()) return s;
  return out;
}

Result<double> GlobalView::Impl::score(AggregateKind kind, std::uint64_t owner, std::uint64_t item) const {
  Call call(this, "score read");
  if (!call.status().ok()) return call.status();
  const std::string key = encode_aggregate_key(kind, owner, item);
  const std::string cell = describe(AggregateCell{kind, owner, item});
  std::string value;
  rocksdb::Status s = db_->Get(rocksdb::ReadOptions(), aggregates(), slice(key), &value);
  if (s.IsNotFound()) return 0.0;
  if (!s.ok()) return from_rocksdb(s, "read of aggregate " + cell + " (key " + hex(key) + ") of the " + view_at(path_));
  std::optional<Units> sum = decode_units(value);
  if (!sum) {
    return Status::Corruption("aggregate " + cell + " (key " + hex(key) + ") of the " + view_at(path_) + " has a " +
                              std::to_string(value.size()) + "-byte value; expected 16");
  }
  return units_to_double(*sum);
}

Status GlobalView::Impl::checkpoint(const std::string& dir) const {
  Call call(this, "checkpoint");
  if (!call.status().ok()) return call.status();
  const std::string what = "checkpoint of the " + view_at(path_) + " into '" + dir + "'";
  if (options_.read_only) return Status::InvalidArgument(what + ": the view is open read-only");
  if (dir.empty()) return Status::InvalidArgument(what + ": no directory given");
  std::error_code ec;
  if (fs::exists(fs::symlink_status(dir, ec))) {
    return Status::InvalidArgument(what + ": '" + dir + "' already exists; a checkpoint is made into a new directory");
  }
  // Applies wait, so the copy holds exactly the batches applied before it.
  std::lock_guard<std::mutex> serial(apply_mu_);
  rocksdb::Checkpoint* raw = nullptr;
  if (Status s = from_rocksdb(rocksdb::Checkpoint::Create(db_.get(), &raw), what); !s.ok()) return s;
  std::unique_ptr<rocksdb::Checkpoint> cp(raw);
  // log_size_for_flush 0: memtables are flushed first, so the copy is SST files.
  return from_rocksdb(cp->CreateCheckpoint(dir, /*log_size_for_flush=*/0), what);
}

// ---- GlobalView facade ----

GlobalView::GlobalView(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

GlobalView::~GlobalView() {
  if (!impl_) return;
  (void)guarded("global view close", [&] { return impl_->close(); });
  // Past the exit handler RocksDB's statics may be gone: leave the Impl
  // (closed) to the operating system.
  if (exit_started()) (void)impl_.release();
}

Result<std::unique_ptr<GlobalView>> GlobalView::open(const std::string& path, const GlobalViewOptions& options) {
  return guarded("global view open", [&]() -> Result<std::unique_ptr<GlobalView>> {
    return Impl::open(path, options, nullptr);
  });
}

Status GlobalView::close() {
  return guarded("global view close", [&] { return impl_->close(); });
}

Result<bool> GlobalView::apply(const ChangeBatch& batch) {
  return guarded("global view apply", [&] { return impl_->apply(batch); });
}

Result<ApplyOutcome> GlobalView::apply(std::span<const ChangeBatch> batches) {
  return guarded("global view apply", [&] { return impl_->apply(batches); });
}

Result<std::uint64_t> GlobalView::applied_seq(std::uint64_t shard_id) const {
  return guarded("global view applied_seq", [&] { return impl_->applied_seq(shard_id); });
}

Result<std::vector<ShardProgress>> GlobalView::applied_shards() const {
  return guarded("global view applied_shards", [&] { return impl_->applied_shards(); });
}

Result<double> GlobalView::cohort_score(std::uint64_t cohort_id, std::uint64_t item_id) const {
  return guarded("global view score read", [&] { return impl_->score(AggregateKind::Cohort, cohort_id, item_id); });
}

Result<double> GlobalView::community_score(std::uint64_t community_id, std::uint64_t item_id) const {
  return guarded("global view score read",
                 [&] { return impl_->score(AggregateKind::Community, community_id, item_id); });
}

bool GlobalView::read_only() const { return impl_->read_only(); }

Status GlobalView::checkpoint(const std::string& dir) const {
  return guarded("global view checkpoint", [&] { return impl_->checkpoint(dir); });
}

}  // namespace tidal
