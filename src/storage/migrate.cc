// The upgrade of a format-2 Db (one RocksDB database holding every column
// family) to format 3 (the users engine in the Db directory, the state
// engine in <path>/state), run by a writable open (Storage::open).
//
// Crash-safe by a single commit point, the users engine's "db_format"
// record:
//   1. delete whatever state/ holds (what an earlier attempt left);
//   2. create the state engine and copy into it, in one atomic ingestion,
//      the aggregates, the ledger, the change feed, the purge receipts
//      (from the users partition) and the state store's meta records, with
//      a state_epoch at or above every epoch the copied ledger names;
//   3. fsync the Db directory (state/'s own entry), then write, synced, in
//      one batch of the users engine: db_format = 3, the deletion of the
//      copied receipts and meta records, and a state_format that tidal 0.2
//      refuses (kUsersStateFormatMark) (the commit point);
//   4. drop the format-2 column families.
// A crash before 3 leaves the format-2 Db whole (the next open starts over
// at 1); a crash after it leaves a format-3 Db whose next open finishes 4.
// A new Db takes the same path with nothing to copy.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "storage/ingest_batch.h"
#include "storage/storage.h"

namespace tidal {
namespace {

std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

// The state store's meta records of format 2, moved with it. The clock
// floors are copied and also stay: the users engine's keep its leaves'.
bool moves_to_state(std::string_view key) {
  return key == kStateFormatKey || key == kStateEpochKey || key == kFeedShardKey || key == kFeedTrimmedKey ||
         key.starts_with(kErasurePendingPrefix);
}
bool copied_to_state(std::string_view key) { return moves_to_state(key) || key.starts_with(kClockFloorPrefix); }

Status fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    return Status::IOError("fsync of the directory '" + dir + "' failed (" + std::strerror(err) + ")");
  }
  ::close(fd);
  return Status::OK();
}

}  // namespace

Status Storage::migrate_to_format3(const rocksdb::Options& base,
                                   const std::vector<rocksdb::ColumnFamilyHandle*>& legacy) {
  const auto step = [](int n) { test_step("migrate", n); };
  rocksdb::ColumnFamilyHandle* old_aggregates = nullptr;
  rocksdb::ColumnFamilyHandle* old_ledger = nullptr;
  rocksdb::ColumnFamilyHandle* old_feed = nullptr;
  for (auto* h : legacy) {
    if (h->GetName() == "aggregates") old_aggregates = h;
    if (h->GetName() == "ledger") old_ledger = h;
    if (h->GetName() == "feed") old_feed = h;
  }
  const std::string what = "upgrade of tidal Db '" + path_ + "' to format 3";
  // A refusal leaves the format-2 Db as it was, and no state/.
  const auto refuse = [&](Status s) {
    if (state_.db != nullptr) (void)close_instance(&state_, state_path());
    std::error_code ec;
    std::filesystem::remove_all(state_path(), ec);
    return s;
  };

  step(1);
  std::error_code ec;
  std::filesystem::remove_all(state_path(), ec);
  if (ec) return refuse(Status::IOError(what + ": removing '" + state_path() + "' failed: " + ec.message()));
  step(2);
  if (Status s = open_state(base, /*create=*/true); !s.ok()) return refuse(s);
  if (old_feed != nullptr) {
    if (Status s = create_feed(); !s.ok()) return refuse(s);
  }

  // One file per column family, each in key order; one atomic ingestion.
  IngestBatch copy(this, "migrate");
  std::vector<std::string> moved;  // users-engine keys the commit deletes: meta, then receipts
  // The largest epoch a copied ledger key names (its last 8 bytes).
  std::uint64_t ledger_epoch = 0;
  const auto copy_all = [&](rocksdb::ColumnFamilyHandle* from, rocksdb::ColumnFamilyHandle* to) -> Status {
    auto it = iterator(from, /*bulk=*/true);
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      if (to == ledger()) {
        if (const std::optional<LedgerKey> k = decode_ledger_key(view(it->key()))) {
          ledger_epoch = std::max(ledger_epoch, k->epoch);
        }
      }
      if (rocksdb::Status s = copy.put(to, view(it->key()), view(it->value())); !s.ok()) return from_rocksdb(s, what);
    }
    return from_rocksdb(it->status(), what);
  };
  if (old_aggregates != nullptr) {
    if (Status s = copy_all(old_aggregates, aggregates()); !s.ok()) return refuse(s);
  }
  if (old_ledger != nullptr) {
    if (Status s = copy_all(old_ledger, ledger()); !s.ok()) return refuse(s);
  }
  // The state store names each batch's ledger records by an epoch above the
  // stored state_epoch (StateStore), and the new engine's sequence numbers
  // restart near 0: without a state_epoch at or above every copied epoch,
  // new batches would reuse epochs and silently replace ledger records
  // (I1 broken, a purge removing the wrong amount). tidal 0.2.0 before the
  // record existed named epochs by the one engine's sequence numbers, so
  // the floor is the largest of the stored record, the largest copied
  // epoch and that engine's (the users engine's) latest sequence number.
  std::uint64_t epoch_floor = std::max(ledger_epoch, users_.db->GetLatestSequenceNumber());
  {
    std::string stored;
    Status s = get(meta(), kStateEpochKey, &stored);
    if (s.ok() && stored.size() != 8) {
      return refuse(Status::Corruption(what + ": its state_epoch record has " + std::to_string(stored.size()) +
                                       " bytes; expected 8"));
    }
    if (s.ok()) epoch_floor = std::max(epoch_floor, get_u64_be(stored.data()));
    if (!s.ok() && s.code() != StatusCode::NotFound) return refuse(s);
  }
  {
    std::string epoch_value;
    put_u64_be(&epoch_value, epoch_floor);
    bool epoch_copied = epoch_floor == 0;  // a new Db: nothing to stay above
    const auto copy_epoch = [&]() {
      epoch_copied = true;
      return copy.put(state_meta(), kStateEpochKey, epoch_value);
    };
    auto it = iterator(meta());
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      const std::string_view key = view(it->key());
      if (!copied_to_state(key)) continue;
      if (moves_to_state(key)) moved.emplace_back(key);
      if (key == kStateEpochKey) continue;  // copied as epoch_floor, in key order
      if (!epoch_copied && key > std::string_view(kStateEpochKey)) {
        if (rocksdb::Status s = copy_epoch(); !s.ok()) return refuse(from_rocksdb(s, what));
      }
      if (rocksdb::Status s = copy.put(state_meta(), key, view(it->value())); !s.ok()) return refuse(from_rocksdb(s, what));
    }
    if (Status s = from_rocksdb(it->status(), what); !s.ok()) return refuse(s);
    if (!epoch_copied) {
      if (rocksdb::Status s = copy_epoch(); !s.ok()) return refuse(from_rocksdb(s, what));
    }
  }
  const std::size_t moved_meta = moved.size();
  {
    // The purge receipts (users records of tag 0x10), keyed as before.
    auto it = iterator(users(), /*bulk=*/true);
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      const std::optional<DecodedKey> key = decode_key(view(it->key()));
      if (!key || key->tag != static_cast<std::uint8_t>(Tag::PurgeManifest)) continue;
      if (rocksdb::Status s = copy.put(receipts(), view(it->key()), view(it->value())); !s.ok()) {
        return refuse(from_rocksdb(s, what));
      }
      moved.emplace_back(view(it->key()));
    }
    if (Status s = from_rocksdb(it->status(), what); !s.ok()) return refuse(s);
  }
  if (old_feed != nullptr) {
    if (Status s = copy_all(old_feed, feed()); !s.ok()) return refuse(s);
  }
  if (!copy.empty()) {
    if (Status s = copy.ingest(what); !s.ok()) return refuse(s);
  }
  step(3);
  // Aggregates of tidal 0.1, or of a newer state format: refused, nothing changed.
  if (Status s = check_state_format(); !s.ok()) return refuse(s);
  if (Status s = fsync_dir(path_); !s.ok()) return refuse(s);
  step(4);

  rocksdb::WriteBatch commit;
  commit.Put(meta(), kDbFormatKey, kDbFormat);
  for (std::size_t i = 0; i < moved.size(); ++i) commit.Delete(i < moved_meta ? meta() : users(), moved[i]);
  // After the deletion of the moved "2": the mark tidal 0.2 refuses (a rollback is refused, never run empty).
  commit.Put(meta(), kStateFormatKey, kUsersStateFormatMark);
  if (Status s = write(Engine::Users, &commit, WriteMode::Sync, what); !s.ok()) {
    // The commit may or may not be durable: state/ stays, for the format-3
    // Db the next open then finds, or to be rebuilt by its next attempt.
    return Status(s.code(), s.message() + " (the upgrade may or may not have been committed; the next open finishes "
                                          "or repeats it)");
  }
  step(5);
  return drop_legacy(legacy);
}

}  // namespace tidal
