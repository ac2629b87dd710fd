// The upgrade of a format-2 Db (one RocksDB database holding every column
// family) to format 3 (the users engine in the Db directory, the state
// engine in <path>/state), run by a writable open (Storage::open).
//
// Crash-safe by a single commit point, the users engine's "db_format"
// record:
//   1. delete whatever state/ (and RocksDB's state.tmp/) holds: what an
//      earlier attempt left;
//   2. make state/ a checkpoint of the format-2 database: RocksDB flushes
//      its memtables and hard-links every SST file into state/ (the
//      aggregates, the ledger and the change feed keep their files, levels
//      and sequence numbers as they are); drop the users partition's column
//      families and the users engine's meta records from that copy
//      (checkpoint_as_state), open it as the state engine, and ingest, in
//      one atomic step, a state_epoch at or above every epoch the ledger
//      names and the purge receipts (from the users partition);
//   3. fsync the Db directory (state/'s own entry), then write, synced, in
//      one batch of the users engine: db_format = 3, the deletion of the
//      moved receipts and meta records, and a state_format that tidal 0.2
//      refuses (kUsersStateFormatMark) (the commit point);
//   4. drop the format-2 column families (their files live on as the state
//      engine's).
// A crash before 3 leaves the format-2 Db whole (the next open starts over
// at 1): RocksDB never writes an SST file in place, so the two databases
// share files safely. A crash after it leaves a format-3 Db whose next open
// finishes 4. A new Db takes the same path with nothing to link.
//
// So the upgrade writes no second copy of the state: only the memtables'
// flush, the MANIFEST and the receipts and meta records. The copy it
// replaced needed up to 3x the state's disk (its build files, then
// ingestion's copy of them) and made each column family one giant file
// (bench/README.md "Upgrade"). On a file system without hard links
// RocksDB's checkpoint copies the files, and the upgrade needs 2x.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include <rocksdb/utilities/checkpoint.h>

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

Status Storage::checkpoint_as_state(const rocksdb::Options& base) {
  const std::string what = "upgrade of tidal Db '" + path_ + "' from format 2";
  const std::string dir = state_path();
  {
    rocksdb::Checkpoint* raw = nullptr;
    if (Status s = from_rocksdb(rocksdb::Checkpoint::Create(users_.db.get(), &raw), what); !s.ok()) return s;
    std::unique_ptr<rocksdb::Checkpoint> checkpoint(raw);
    // log_size_for_flush 0: every memtable is flushed first, so the copy
    // needs no WAL of its own.
    if (Status s = from_rocksdb(checkpoint->CreateCheckpoint(dir, /*log_size_for_flush=*/0),
                                what + ": linking the format-2 database into '" + dir + "'");
        !s.ok()) {
      return s;
    }
  }
  // The copy holds every column family of format 2; the users partition's
  // and the users engine's own meta records are not the state engine's.
  std::vector<std::string> names;
  if (Status s = from_rocksdb(rocksdb::DB::ListColumnFamilies(base, dir, &names), what); !s.ok()) return s;
  std::vector<rocksdb::ColumnFamilyDescriptor> descriptors;
  for (const std::string& name : names) {
    rocksdb::ColumnFamilyOptions options = state_cf_options(base, name);
    options.disable_auto_compactions = true;  // open only to be pruned
    descriptors.emplace_back(name, options);
  }
  rocksdb::Options options(base);
  options.create_if_missing = false;
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  if (Status s = from_rocksdb(rocksdb::DB::Open(options, dir, descriptors, &handles, &raw), what); !s.ok()) return s;
  std::unique_ptr<rocksdb::DB> db(raw);
  Status result;
  rocksdb::WriteBatch prune;
  for (rocksdb::ColumnFamilyHandle* h : handles) {
    if (h->GetName() == "users" || h->GetName() == "by_tag") {
      if (result.ok()) result = from_rocksdb(db->DropColumnFamily(h), what);
    } else if (h->GetName() == rocksdb::kDefaultColumnFamilyName && result.ok()) {
      std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions(), h));
      for (it->SeekToFirst(); it->Valid(); it->Next()) {
        if (!copied_to_state(view(it->key()))) prune.Delete(h, it->key());
      }
      result = from_rocksdb(it->status(), what);
    }
  }
  if (result.ok()) {
    rocksdb::WriteOptions sync;
    sync.sync = true;
    result = from_rocksdb(db->Write(sync, &prune), what);
  }
  for (rocksdb::ColumnFamilyHandle* h : handles) (void)db->DestroyColumnFamilyHandle(h);
  if (Status s = from_rocksdb(db->Close(), what); !s.ok() && result.ok()) result = s;
  return result;
}

Status Storage::check_upgrade_room(const std::string& what) {
  // The meta records and receipts the upgrade moves into state/.
  std::uintmax_t moved = 0;
  {
    auto it = iterator(meta());
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      if (copied_to_state(view(it->key()))) moved += it->key().size() + it->value().size();
    }
    if (Status s = from_rocksdb(it->status(), what); !s.ok()) return s;
  }
  {
    auto it = iterator(users(), /*bulk=*/true);
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      const std::optional<DecodedKey> key = decode_key(view(it->key()));
      if (key && key->tag == static_cast<std::uint8_t>(Tag::PurgeManifest)) {
        moved += it->key().size() + it->value().size();
      }
    }
    if (Status s = from_rocksdb(it->status(), what); !s.ok()) return s;
  }
  std::uintmax_t need = checkpoint_unlinked_bytes(users_.db.get(), path_) + moved;
  need += need / 100 + (std::uintmax_t{1} << 20);
  std::error_code ec;
  const std::filesystem::space_info room = std::filesystem::space(path_, ec);
  if (ec || room.available >= need) return Status::OK();
  return Status::IOError(what + ": it needs " + std::to_string(need) + " bytes free in '" + path_ +
                         "' (the memtables it flushes, the files it copies and the records it moves into state/; "
                         "the table files are hard-linked; with 1 % and 1 MiB to spare); " +
                         std::to_string(room.available) +
                         " are: free some and open again; the Db is unchanged (format 2, readable by tidal 0.2)");
}

Status Storage::migrate_to_format3(const rocksdb::Options& base,
                                   const std::vector<rocksdb::ColumnFamilyHandle*>& legacy) {
  const auto step = [](int n) { test_step("migrate", n); };
  rocksdb::ColumnFamilyHandle* old_ledger = nullptr;
  for (auto* h : legacy) {
    if (h->GetName() == "ledger") old_ledger = h;
  }
  const std::string what = "upgrade of tidal Db '" + path_ + "' from format 2";
  // A refusal leaves the format-2 Db as it was, and no state/.
  const auto refuse = [&](Status s) {
    if (state_.db != nullptr) (void)close_state();
    std::error_code ec;
    std::filesystem::remove_all(state_path(), ec);
    std::filesystem::remove_all(checkpoint_tmp_dir(), ec);
    return s;
  };

  step(1);
  std::error_code ec;
  for (const std::string& dir : {state_path(), checkpoint_tmp_dir()}) {
    std::filesystem::remove_all(dir, ec);
    if (ec) return refuse(Status::IOError(what + ": removing '" + dir + "' failed: " + ec.message()));
  }
  // Room first, before anything is written (issue 41 item 9): the format-2
  // files go only after the commit.
  if (Status s = check_upgrade_room(what); !s.ok()) return refuse(s);
  step(2);
  // The largest epoch a ledger key names (its last 8 bytes); only read.
  std::uint64_t ledger_epoch = 0;
  if (old_ledger != nullptr) {
    auto it = iterator(old_ledger, /*bulk=*/true);
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      if (const std::optional<LedgerKey> k = decode_ledger_key(view(it->key()))) {
        ledger_epoch = std::max(ledger_epoch, k->epoch);
      }
    }
    if (Status s = from_rocksdb(it->status(), what); !s.ok()) return refuse(s);
  }
  if (legacy.empty()) {
    if (Status s = open_state(base, /*create=*/true); !s.ok()) return refuse(s);
  } else {
    if (Status s = checkpoint_as_state(base); !s.ok()) return refuse(s);
    if (Status s = open_state(base, /*create=*/false); !s.ok()) return refuse(s);
  }

  // The state_epoch and the receipts, in one file per column family, each
  // in key order; one atomic ingestion.
  // The rest, in one file per column family, each in key order; one atomic ingestion.
  IngestBatch copy(this, "migrate");
  std::vector<std::string> moved;  // users-engine keys the commit deletes: meta, then receipts
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
  if (!copy.empty()) {
    if (Status s = copy.ingest(what); !s.ok()) return refuse(s);
  }
  step(3);
  // Aggregates of tidal 0.1, or of a newer state format: refused, nothing changed.
  if (Status s = check_state_format(); !s.ok()) return refuse(s);
  // The imports' links and the state engine's own entry, durable before the commit.
  for (const std::string& dir : {state_path(), path_}) {
    if (Status s = fsync_dir(dir); !s.ok()) return refuse(s);
  }
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
