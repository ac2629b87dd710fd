// Backups and recovery (docs/CONTRACT.md, "Backup and restore"): a
// point-in-time copy of both engines in the Db's own layout, and the
// recovering state of a Db opened from one.
//
// The copy is made state engine first, users engine second (RocksDB
// checkpoints: memtables flushed, SST files hard-linked where the file
// system allows), with no purge deleting ledger keys in between (the key
// store is in the users copy, the sealed ledger in the state copy). The
// users engine's copy is the newer one, so every purge
// receipt in the state copy cites a leave that is in the users copy, as
// after a crash (E2); the state copy may lack signals the users copy's
// later leaves did not gate, never part of one. No purge runs while the
// two are copied (backup_mu_, which a purge takes before its drain, so that
// signals are not held up by a purge waiting for the copy): with the
// journal, a purge whose intent is in the users copy is then in the state
// copy too, or still marked there and finished by the restored Db's open.
//
// The manifest (kBackupManifest, text, one "key value" a line) says where
// the copy stands: the change feed's shard, incarnation and seqs, and how
// the files were made. A Db directory holding it is recovering: signals and
// every call that reads or changes a user's community status are Busy until
// finish_recovery() removes it (after the privacy journal's entries since
// the backup were replayed), so nothing served from the copy can forget a
// leave or a purge made after it.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <rocksdb/utilities/checkpoint.h>

#include "db/guarded.h"
#include "db/impl.h"
#include "storage/state_format.h"

namespace tidal {
namespace {

namespace fs = std::filesystem;

// fsync of a file or directory; the errno text when it fails.
std::string sync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::strerror(errno);
  const bool ok = ::fsync(fd) == 0;
  const std::string error = ok ? std::string() : std::strerror(errno);
  ::close(fd);
  return error;
}

std::string parent_of(const std::string& path) {
  const fs::path p = fs::path(path).lexically_normal();
  const fs::path parent = p.has_relative_path() && p.filename().empty() ? p.parent_path().parent_path() : p.parent_path();
  return parent.empty() ? std::string(".") : parent.string();
}

// Whether RocksDB's checkpoint into `dir` hard-linked the files of the Db
// at `db_dir`: it links them whenever both are on one file system (and
// copies them otherwise). Not read from the link counts: a compaction may
// delete a linked file from the Db right after the checkpoint.
bool same_file_system(const std::string& dir, const std::string& db_dir) {
  struct stat a {}, b {};
  return ::stat(dir.c_str(), &a) == 0 && ::stat(db_dir.c_str(), &b) == 0 && a.st_dev == b.st_dev;
}

Status checkpoint(rocksdb::DB* db, const std::string& dir, const std::string& what) {
  rocksdb::Checkpoint* raw = nullptr;
  if (Status s = from_rocksdb(rocksdb::Checkpoint::Create(db, &raw), what); !s.ok()) return s;
  std::unique_ptr<rocksdb::Checkpoint> cp(raw);
  // log_size_for_flush 0: memtables are flushed first, so the copy is SST files.
  return from_rocksdb(cp->CreateCheckpoint(dir, /*log_size_for_flush=*/0), what);
}

// Writes `text` to a new file at `path`, then fsyncs it and its directory.
Status write_file_durably(const std::string& path, const std::string& text, const std::string& what) {
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) {
      std::error_code ec;
      fs::remove(path, ec);
      return Status::IOError(what + ": writing '" + path + "' failed (" + std::strerror(errno) + ")");
    }
  }
  for (const std::string& p : {path, parent_of(path)}) {
    if (std::string error = sync_path(p); !error.empty()) {
      std::error_code ec;
      fs::remove(path, ec);
      return Status::IOError(what + ": fsync of '" + p + "' failed: " + error);
    }
  }
  return Status::OK();
}

}  // namespace

std::uintmax_t Db::Impl::backup_bytes_needed(const std::string& parent) const {
  const bool linked = same_file_system(parent, storage_->path());
  std::uintmax_t need = 0;
  for (auto [engine, engine_dir] : {std::pair{Storage::Engine::Users, storage_->path()},
                                    std::pair{Storage::Engine::State, storage_->state_path()}}) {
    rocksdb::DB* db = storage_->db(engine);
    need += checkpoint_unlinked_bytes(db, engine_dir);
    if (!linked) {  // the table files are copied too
      std::vector<rocksdb::LiveFileMetaData> files;
      db->GetLiveFilesMetaData(&files);
      for (const rocksdb::LiveFileMetaData& f : files) need += f.size;
    }
  }
  return need + need / 100 + (std::uintmax_t{1} << 20);
}

Status Db::Impl::backup(const std::string& dir) const {
  return guarded("backup", [&]() -> Status {
    Call call(this, "backup", /*write=*/false);
    if (!call.status().ok()) return call.status();
    // It flushes, which waits for every signal in flight: from inside a
    // ContributionSink callback, for the callback's own (issue 41 item 6).
    if (Status s = check_outside_sink("backup"); !s.ok()) return s;
    const std::string what = "backup of the Db at '" + storage_->path() + "' into '" + dir + "'";
    if (options_.read_only) {
      return Status::InvalidArgument(what + ": the Db is open read-only (a backup flushes both engines first: call "
                                            "backup on the handle that writes)");
    }
    if (recovering_.load(std::memory_order_acquire)) return recovering_status("backup");
    if (dir.empty()) return Status::InvalidArgument(what + ": no directory given");
    std::error_code ec;
    if (fs::exists(fs::symlink_status(dir, ec))) {
      return Status::InvalidArgument(what + ": '" + dir + "' already exists; a backup is made into a new directory");
    }
    const std::string parent = parent_of(dir);
    if (!fs::is_directory(parent, ec)) {
      return Status::InvalidArgument(what + ": its parent directory '" + parent + "' does not exist");
    }
    // Everything is made in `staging` and renamed to `dir` once whole, so
    // `dir` never exists without its manifest (a directory holding the
    // engines but no manifest would open as a Db that is not recovering).
    // The engines are copied into subdirectories of `staging`: RocksDB's
    // own temporary directory is then inside it too.
    const std::string staging = fs::absolute(fs::path(dir).lexically_normal(), ec).string() + kBackupStagingSuffix;
    if (fs::exists(fs::symlink_status(staging, ec))) {
      return Status::InvalidArgument(what + ": '" + staging +
                                     "' exists (another backup into the same directory is running, or one was "
                                     "killed and its Db not opened since: remove it and try again)");
    }
    // Room first, before anything is written.
    if (backup_checks_space) {
      const std::uintmax_t need = backup_bytes_needed(parent);
      const fs::space_info room = fs::space(parent, ec);
      if (!ec && room.available < need) {
        return Status::IOError(what + ": it needs " + std::to_string(need) + " bytes free in '" + parent +
                               "' (the memtables it flushes and the files it copies" +
                               (same_file_system(parent, storage_->path()) ? ", table files hard-linked" : "") +
                               ", with 1 % and 1 MiB to spare); " + std::to_string(room.available) +
                               " are: free some, or back up onto another file system; nothing written");
      }
    }
    // The marker, durable before anything is copied: after a crash the
    // next open removes `staging`, which holds ledger records that later
    // purges erase from the Db (and from no copy of them).
    char hash[17];
    std::snprintf(hash, sizeof(hash), "%016llx", static_cast<unsigned long long>(std::hash<std::string>{}(staging)));
    const std::string marker = storage_->path() + "/" + kBackupPendingPrefix + hash;
    if (Status s = write_file_durably(marker, staging + "\n", what + ": its pending marker"); !s.ok()) return s;
    Storage::test_step("backup", 1);
    // Removes the staging directory and the marker, and returns `s`: on
    // every failure, and once the backup is whole (its staging directory
    // is empty then).
    auto remove_staging = [&](Status s) {
      fs::remove_all(staging, ec);
      if (!ec) {
        fs::remove(marker, ec);
        (void)sync_path(storage_->path());
      }
      return s;
    };
    const std::string users_copy = staging + "/users";
    const std::string state_copy = staging + "/state";
    const auto start = std::chrono::steady_clock::now();
    fs::create_directory(staging, ec);
    if (ec) return remove_staging(Status::IOError(what + ": creating '" + staging + "' failed: " + ec.message()));
    // Everything acknowledged before the call is in the copy.
    if (Status s = state_->flush(); !s.ok()) return remove_staging(s);
    std::ostringstream manifest;
    manifest << "tidal backup\n"
             << "format 3\n"
             << "created_ns "
             << std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::system_clock::now().time_since_epoch())
                    .count()
             << "\n";
    // No purge between its intent and its marks' deletion while both engines
    // are copied: otherwise the users copy could hold a purge's intent (so the
    // replay after a restore skips it) without its mark (so the open does
    // not finish it) while the older state copy lacks the purge itself.
    std::unique_lock<WriterFirstMutex> no_purge(backup_mu_);
    // From the state engine's copy to the users engine's, no purge deletes
    // keys (format 4): every sealed record in the state copy has its key in
    // the users copy. Taken after the drain lock, as a purge takes it.
    std::shared_lock<std::shared_mutex> keys_kept(storage_->key_store_mu(), std::defer_lock);
    // The state engine's copy and the feed's position at one batch boundary.
    Status s = state_->between_batches([&]() -> Status {
      keys_kept.lock();
      if (Status c = checkpoint(storage_->db(Storage::Engine::State), state_copy, what + ": the state engine");
          !c.ok()) {
        return c;
      }
      if (feed_) {
        const ChangeFeed::Stats f = feed_->stats();
        manifest << "feed_shard_id " << f.shard_id << "\nfeed_incarnation " << f.incarnation << "\nfeed_last_seq "
                 << f.last_seq << "\nfeed_trimmed_seq " << f.trimmed_through << "\n";
      } else {
        manifest << "feed off\n";
      }
      return Status::OK();
    });
    if (s.ok()) Storage::test_step("backup", 2);
    if (s.ok() && between_backup_copies_for_testing) between_backup_copies_for_testing();
    // The journal's position, read before the users engine is copied: the
    // copy holds at least these entries (the restored Db's
    // last_journal_seq() is exact).
    if (s.ok() && journal_) manifest << "journal_last_seq " << journal_->last_seq() << "\n";
    if (s.ok()) s = checkpoint(storage_->db(Storage::Engine::Users), users_copy, what + ": the users engine");
    if (keys_kept.owns_lock()) keys_kept.unlock();
    no_purge.unlock();
    if (!s.ok()) return remove_staging(s);
    Storage::test_step("backup", 3);
    fs::rename(state_copy, state_engine_dir(users_copy), ec);
    if (ec) {
      return remove_staging(Status::IOError(what + ": moving the state engine's copy into place failed: " + ec.message()));
    }
    const bool linked = same_file_system(staging, storage_->path());
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    manifest << "files " << (linked ? "linked" : "copied") << "\nseconds " << seconds << "\n";
    if (Status w = write_file_durably(users_copy + "/" + kBackupManifest, manifest.str(), what + ": its manifest");
        !w.ok()) {
      return remove_staging(w);
    }
    for (const std::string& p : {state_engine_dir(users_copy), users_copy}) {
      if (std::string error = sync_path(p); !error.empty()) {
        return remove_staging(Status::IOError(what + ": fsync of '" + p + "' failed: " + error));
      }
    }
    Storage::test_step("backup", 4);
    fs::rename(users_copy, dir, ec);
    if (ec) return remove_staging(Status::IOError(what + ": renaming the copy to '" + dir + "' failed: " + ec.message()));
    if (std::string error = sync_path(parent); !error.empty()) {
      fs::remove_all(dir, ec);
      return remove_staging(Status::IOError(what + ": fsync of '" + parent + "' failed: " + error));
    }
    Storage::test_step("backup", 5);
    // The backup is whole: what is left is an empty directory and the
    // marker, which the next open removes if this fails.
    return remove_staging(Status::OK());
  });
}

void Db::Impl::remove_unfinished_backups() {
  std::error_code ec;
  bool removed = false;
  for (const auto& e : fs::directory_iterator(storage_->path(), ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(kBackupPendingPrefix, 0) != 0) continue;
    std::string staging;
    {
      std::ifstream in(e.path(), std::ios::binary);
      std::getline(in, staging);
    }
    // Only ever a staging directory (the marker names nothing else).
    const std::string suffix = kBackupStagingSuffix;
    std::error_code rm;
    if (staging.size() > suffix.size() && staging.compare(staging.size() - suffix.size(), suffix.size(), suffix) == 0) {
      fs::remove_all(staging, rm);
    }
    if (!rm) {
      fs::remove(e.path(), rm);
      removed = true;
    }
  }
  if (removed) (void)sync_path(storage_->path());
}

Status Db::Impl::load_recovery_state() {
  const std::string path = storage_->path() + "/" + kBackupManifest;
  std::error_code ec;
  if (!fs::exists(path, ec)) return Status::OK();
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in || text.str().rfind("tidal backup\n", 0) != 0) {
    return Status::Corruption("cannot open tidal Db at '" + storage_->path() + "': its backup manifest " + path +
                              " does not read as one (it should start with 'tidal backup')");
  }
  recovery_manifest_ = text.str();
  recovering_.store(true, std::memory_order_release);
  return Status::OK();
}

Status Db::Impl::recovering_status(const char* what) const {
  return Status::Busy(std::string(what) + ": the Db at '" + storage_->path() +
                      "' is recovering from a backup: replay the privacy journal's entries after the backup's "
                      "position (replay_journal, or tidal::nats::recover_shard), then call finish_recovery(); "
                      "until then no signal is taken and no user's community status is read or changed");
}

Status Db::Impl::finish_recovery() {
  return guarded("finish_recovery", [&]() -> Status {
    Call call(this, "finish_recovery", /*write=*/true);
    if (!call.status().ok()) return call.status();
    std::lock_guard<std::mutex> one(recovery_mu_);
    if (!recovering_.load(std::memory_order_acquire)) return Status::OK();
    {
      std::lock_guard<std::mutex> lock(unfinished_mu_);
      if (!unfinished_purges_.empty()) {
        return Status::Busy("finish_recovery: the replayed purge of user " + std::to_string(*unfinished_purges_.begin()) +
                            (unfinished_purges_.size() > 1
                                 ? " (and " + std::to_string(unfinished_purges_.size() - 1) + " more users)"
                                 : std::string()) +
                            " failed after its intent was written; call replay_journal again, which finishes it, "
                            "then finish_recovery; nothing changed");
      }
    }
    // A new incarnation whose snapshot replaces, in every view, what the
    // shard's earlier incarnation published after the backup.
    if (feed_) {
      Status s = state_->between_batches([&]() -> Status { return feed_->reseed().status(); });
      if (!s.ok()) return Status(s.code(), "finish_recovery: re-seeding the change feed: " + s.message());
    }
    const std::string path = storage_->path() + "/" + kBackupManifest;
    std::error_code ec;
    fs::remove(path, ec);
    if (ec) return Status::IOError("finish_recovery: removing " + path + " failed: " + ec.message());
    Storage::test_step("finish recovery", 1);
    if (std::string error = sync_path(storage_->path()); !error.empty()) {
      return Status::IOError("finish_recovery: fsync of '" + storage_->path() + "' failed: " + error);
    }
    recovering_.store(false, std::memory_order_release);
    return Status::OK();
  });
}

}  // namespace tidal
