// The two RocksDB databases behind one Db (formats 3 and 4, docs/FORMAT.md), each
// with its own WAL, write queue and write controller, so that a stall of
// one is never a stall of the other. They share a block cache; their
// flushes and compactions run on different threads: the state engine's on
// the Env's pools (Env::Default's), the users engine's on two threads of
// its own, shared by the users engines of every Db in the process.
//
// The users engine, in the Db directory itself:
//   default     meta records (index state, clock floor and lease, format)
//   users       the users partition (docs/FORMAT.md)
//   by_tag      the index: a copy of the users records of the indexed tags,
//               keyed tag-first, written in the same WriteBatch
//   wrapped_keys  format 4: each contributing user's ledger key, wrapped
//               with the key of the user's bucket (storage/sealed_ledger.h)
//   bucket_keys   format 4: the bucket keys (65,536 at first, split as
//               the key store grows)
// The state engine, in <path>/state:
//   default     meta records of the state store (format, epoch, clock floor
//               of purges, erasure marks, the change feed's shard and trim)
//   aggregates  personal/cohort/community sums (merge operands of an integer add)
//   ledger      the contribution ledger: what each user gave to which aggregate
//   receipts    purge receipts, keyed as users records (tag 0x10)
//   sealed_ledger  format 4: the ledger, sealed per user, in write order;
//               "ledger" keeps what format 3 wrote before the upgrade, unsealed
//   sealed_index   format 4: which records of the sealed ledger are whose
//   feed        the change feed (only in a Db opened with Options::change_feed)
// Everything a purge or a batch of the writer writes is in the state engine,
// so each stays one atomic step, except the ledger keys: the writer stores a
// user's new key (synced) before the first batch it seals, and a purge
// deletes the keys after its batch (storage/sealed_ledger.h). A leave
// touches only the users engine.
#ifndef TIDAL_STORAGE_STORAGE_H_
#define TIDAL_STORAGE_STORAGE_H_

#include <sys/types.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/sst_file_writer.h>
#include <rocksdb/table_properties.h>
#include <rocksdb/write_batch.h>

#include "storage/format.h"
#include "storage/state_format.h"
#include "tidal/status.h"

namespace tidal {

class KeyEncryptionKey;     // storage/sealed_ledger.h
class SealedRecordReclaim;  // storage.cc
class KeyStoreErasure;      // storage.cc

// Whether records of `tag` have a copy in the by_tag index.
bool is_indexed(Tag tag);

// Converts a RocksDB status into a tidal Status whose message starts with `what`.
Status from_rocksdb(const rocksdb::Status& s, std::string_view what);

// What a RocksDB checkpoint of `db`, whose files are in `dir`, writes beside
// the table files it hard-links on the same file system: the memtables it
// flushes (every column family's) and the MANIFEST, OPTIONS, CURRENT and
// WAL files it copies (an upper bound: older OPTIONS files count too).
std::uintmax_t checkpoint_unlinked_bytes(rocksdb::DB* db, const std::string& dir);

// The table options of every column family of a Db's two engines and of a
// global view: `cache` bounds the blocks read, index and filter blocks
// included (partitioned), and bloom filters skip files for absent keys.
void set_table_options(const std::shared_ptr<rocksdb::Cache>& cache, rocksdb::ColumnFamilyOptions* options);

// One engine's state after a failed write, as RocksDB reports it to the
// listener storage.cc installs (ErrorWatch); what Storage::recover waits on.
struct EngineHealth {
  std::atomic<bool> stopped{false};  // RocksDB refuses the engine's writes until it recovers
  std::mutex mu;
  std::condition_variable changed;
  bool needs_reopen = false;   // an error RocksDB does not recover from; under mu
  std::uint64_t failures = 0;  // errors reported, a failed recovery attempt's included; under mu
  std::string error;           // the last one; under mu
  std::atomic<std::uint64_t> recoveries{0};
  // The anchor (Storage::write): memtable switches of the engine's default
  // column family, and their count when the anchor record was last written.
  std::atomic<std::uint64_t> seals{0};
  std::atomic<std::uint64_t> anchored{std::numeric_limits<std::uint64_t>::max()};
};

class Storage {
 public:
  struct Config {
    bool create_if_missing = true;
    bool read_only = false;
    rocksdb::Env* env = nullptr;  // for fault injection in tests; null = default
    std::size_t block_cache_bytes = 64 << 20;  // shared by every column family of both engines
    // How often a background thread makes the users engine's unsynced
    // writes (WriteMode::Async) durable, when there are any; 0: never
    // (every write that must be durable is synced).
    std::chrono::milliseconds users_wal_sync_period{0};
    // A writable open of a format-2 Db leaves the upgrade to finish_upgrade(),
    // so that the caller's checks run first, on the format-2 records.
    bool defer_upgrade = false;
    // The state engine writes a new MANIFEST (the live files alone) at each
    // of its edits, and RocksDB deletes the one before: no MANIFEST keeps
    // the edits of files that are gone (Options::strict_erasure). Each
    // flush, ingestion and compaction then writes the whole list of live
    // files.
    bool state_manifest_per_edit = false;
  };
  enum class Engine { Users, State };

  // Opens both engines. A writable open of a Db in the one-engine layout of
  // format 2 (or one whose creation or upgrade a crash cut short) first
  // moves its state store into <path>/state (storage/migrate.cc); a
  // read-only open of one is InvalidArgument naming `tidalctl migrate`.
  // With Config::defer_upgrade, a format-2 Db is opened as it is, its state
  // store read where format 2 keeps it (upgrade_pending()), until
  // finish_upgrade().
  static Result<std::unique_ptr<Storage>> open(const std::string& path, const Config& config);
  ~Storage();

  // True from a deferred open of a format-2 Db until finish_upgrade(): the
  // state store's accessors then name its column families in the users
  // engine (state_meta() is meta(), receipts() is users()), for reading
  // only; there is no state engine, and a write to it is refused.
  bool upgrade_pending() const { return upgrade_pending_; }
  // Upgrades a format-2 Db opened with Config::defer_upgrade to format 3
  // (storage/migrate.cc); OK at once when none is pending.
  Status finish_upgrade();

  rocksdb::DB* db(Engine engine) const { return engine == Engine::Users ? users_.db.get() : state_.db.get(); }
  // The users engine's column families.
  rocksdb::ColumnFamilyHandle* meta() const { return users_.handles[0]; }
  rocksdb::ColumnFamilyHandle* users() const { return users_.handles[1]; }
  rocksdb::ColumnFamilyHandle* by_tag() const { return users_.handles[2]; }
  // The state engine's (format 2's, while upgrade_pending()).
  rocksdb::ColumnFamilyHandle* state_meta() const { return upgrade_pending_ ? meta() : state_.handles[0]; }
  rocksdb::ColumnFamilyHandle* aggregates() const {
    return upgrade_pending_ ? legacy("aggregates") : state_.handles[1];
  }
  // The unsealed ledger of format 3 and older: read, never written by this
  // version (storage/sealed_ledger.h).
  rocksdb::ColumnFamilyHandle* ledger() const { return upgrade_pending_ ? legacy("ledger") : state_.handles[2]; }
  rocksdb::ColumnFamilyHandle* receipts() const { return upgrade_pending_ ? users() : state_.handles[3]; }
  // Format 4's key store (in the users engine: the users' wrapped keys and
  // their buckets' keys) and sealed ledger (in the state engine)
  // (storage/sealed_ledger.h); null while upgrade_pending(), and in a
  // read-only open of a format-3 Db.
  rocksdb::ColumnFamilyHandle* keys() const { return upgrade_pending_ ? nullptr : users_.handles[3]; }
  rocksdb::ColumnFamilyHandle* bucket_keys() const { return upgrade_pending_ ? nullptr : users_.handles[4]; }
  rocksdb::ColumnFamilyHandle* sealed_ledger() const { return upgrade_pending_ ? nullptr : state_.handles[4]; }
  rocksdb::ColumnFamilyHandle* sealed_index() const { return upgrade_pending_ ? nullptr : state_.handles[5]; }
  // What keeps the key store in step with the sealed ledger for a reader of
  // both engines: a purge holds it exclusively from its batch's ingestion
  // until its keys are deleted; a reader that takes a snapshot of each
  // engine (a ledger check) or copies each (a backup) holds it shared
  // meanwhile, and so sees a purged user's records and key both or
  // neither. Taken after StateStore's drain lock, never before.
  std::shared_mutex& key_store_mu() const { return key_store_mu_; }
  // Held by every write of the key store (storage/sealed_ledger.h,
  // store_user_keys and delete_user_keys), which reads a bucket's current
  // key and writes what it wraps: a new key wrapped with a bucket key that
  // a purge replaced meanwhile would be lost. Taken after key_store_mu;
  // under it only the notes' lock (write_key_store) and RocksDB's own.
  std::mutex& key_writes_mu() const { return key_writes_mu_; }
  // The key store's shape as last read or written (storage/sealed_ledger.h,
  // KeyShape::encode); empty until the first write of the key store reads
  // it. Under key_writes_mu.
  std::optional<std::string>& key_shape_cache() { return key_shape_; }
  // The key-encryption keys that wrap the bucket keys (storage/sealed_ledger.h,
  // open_key_encryption): none when the Db has none; the current one, and
  // the one a rotation replaced since the open (a read at an older snapshot
  // finds values it wrapped); `pending` while the bucket keys are still in
  // clear and the open is to wrap them (finish_key_encryption).
  struct KeyEncryption {
    std::shared_ptr<const KeyEncryptionKey> current, previous;
    bool pending = false;
  };
  KeyEncryption key_encryption() const {
    std::lock_guard<std::mutex> lock(kek_mu_);
    return kek_;
  }
  void set_key_encryption(KeyEncryption kek) {
    std::lock_guard<std::mutex> lock(kek_mu_);
    kek_ = std::move(kek);
  }
  // The change feed (docs/FORMAT.md); null until create_feed().
  rocksdb::ColumnFamilyHandle* feed() const {
    if (upgrade_pending_) return legacy("feed");
    return state_.handles.size() > kFeedHandle ? state_.handles[kFeedHandle] : nullptr;
  }
  // Creates the feed's column family (durable: RocksDB's MANIFEST). No-op
  // when it exists.
  Status create_feed();
  // Creates format 4's key store in the users engine (durable, as
  // create_feed). No-op when it exists. Part of every writable open once
  // the Db's checks have passed.
  Status create_key_store();
  bool read_only() const { return read_only_; }
  const std::string& path() const { return path_; }
  // The state engine's directory.
  std::string state_path() const { return state_engine_dir(path_); }

  enum class WriteMode {
    Sync,   // WAL fsynced before returning
    Async,  // WAL written, not fsynced: survives a process crash, not a power cut
    NoWal,  // memtable only: durable after the next flush()
  };
  static WriteMode durable_if(bool sync) { return sync ? WriteMode::Sync : WriteMode::Async; }
  // Every column family of `batch` must be of `engine`.
  Status write(Engine engine, rocksdb::WriteBatch* batch, WriteMode mode, std::string_view what);
  // Makes every write of the users engine that returned before the call
  // durable: fsyncs its WAL when an Async write may have left it unsynced,
  // and returns at once when none did. Before a state-engine write that
  // relies on a users-engine one (a purge on its leave), and every
  // Config::users_wal_sync_period.
  Status sync_users_wal();
  // Adds a users record to `batch` and, for an indexed tag, its by_tag copy:
  // the one place that keeps the index in step with the users partition.
  void put_record(rocksdb::WriteBatch* batch, EntityId id, Tag tag, std::string_view suffix,
                  std::string_view value) const;
  void delete_record(rocksdb::WriteBatch* batch, EntityId id, Tag tag, std::string_view suffix) const;
  // NotFound when absent. Reads as of `snapshot` (of the column family's
  // engine) when given.
  Status get(rocksdb::ColumnFamilyHandle* cf, std::string_view key, std::string* value,
             const rocksdb::Snapshot* snapshot = nullptr) const;
  // `bulk` for long scans: reads ahead and keeps the block cache for point reads.
  std::unique_ptr<rocksdb::Iterator> iterator(rocksdb::ColumnFamilyHandle* cf, bool bulk = false,
                                              const rocksdb::Snapshot* snapshot = nullptr) const;
  // An iterator of one prefix of the sealed ledger (a pseudonym): Seek to
  // it, then Next while the key starts with it; the prefix bloom filters
  // skip the files without it.
  std::unique_ptr<rocksdb::Iterator> prefix_iterator(rocksdb::ColumnFamilyHandle* cf) const;
  // RocksDB's estimate of the number of keys in `cf` (0 when unknown).
  std::uint64_t estimate_keys(rocksdb::ColumnFamilyHandle* cf) const;
  // A writer of one SST file for `cf`, with the column family's options
  // (merge operator, bloom filters, compression). Its entries must be added
  // in key order; files to ingest are built in ingest_dir().
  std::unique_ptr<rocksdb::SstFileWriter> sst_writer(rocksdb::ColumnFamilyHandle* cf) const;
  // `<path>/ingest`: created by a writable open, which also deletes what a
  // crash left there.
  std::string ingest_dir() const { return path_ + "/ingest"; }
  // Adds finished SST files of the state engine's column families to it in
  // one atomic step: after a crash or power loss either all of them are
  // there or none. Files of the same column family must not overlap. Durable (fsynced, MANIFEST included) when it
  // returns. The files move into the engine by a hard link (a copy where the
  // file system has none), so their data is written and fsynced once
  // (SstFileWriter::Finish); a file left in ingest_dir() is the caller's to
  // delete.
  Status ingest(const std::vector<std::pair<rocksdb::ColumnFamilyHandle*, std::string>>& files, std::string_view what);
  // Deletes a file (quietly; for files of ingest_dir()).
  void delete_file(const std::string& file) const;
  // Drops from the state engine's `cf` every SST file below level 0 whose
  // keys all lie in [begin, end] (RocksDB's DeleteFilesInRange: one
  // MANIFEST edit, atomic and durable). Only for a range whose every key is
  // already deleted by a range deletion that stays (its end lies past
  // `end`): dropping a file then changes no read, before or after a crash.
  Status drop_files_in_range(rocksdb::ColumnFamilyHandle* cf, std::string_view begin, std::string_view end,
                             std::string_view what);
  // Flushes every memtable of both engines (or of one) to SST files and
  // waits, so the next open does not replay the WAL. It does not wait for
  // compactions first.
  Status flush();
  Status flush(Engine engine);
  // flush(engine), which also moves RocksDB's min-log-number-to-keep past
  // every WAL written so far, so that RocksDB deletes them: with every
  // memtable empty Flush does nothing and the number stays, and so do the
  // WALs (each open/close would leave one more; after an open that replayed
  // no data, a WAL holding a purged key stayed). A memtable-only record
  // (the engine's clean_close) gives the flush something to write.
  Status flush_past_wals(Engine engine);

  // Where the replaced bucket keys of `buckets` (each one's keys before its
  // current one) can be (format 4), as far as this open saw them stored: whether the users engine's WALs or memtables may
  // still hold one, and a sequence number no key of theirs was written
  // after, so that no SST file all of whose entries came later holds one (a
  // compaction keeps sequence numbers, or sets them to 0). A key stored
  // since the start of the last flush_past_wals of that engine that
  // succeeded is in the WALs, and was written by the sequence number read
  // after its write; any other by the one read at that flush's start. Any
  // key may be anywhere while no flush has succeeded since this open (a
  // crash's WAL). An erasure flushes the engine only for keys in the WALs,
  // and compacts only the files that can hold one (Db::Impl::erase_ranges):
  // a single purge flushed the engine and rewrote the key store's whole
  // level 0 for keys long in the last level (bench/README.md, "Session 36").
  struct KeysWritten {
    bool in_wals = true;
    std::uint64_t by = std::numeric_limits<std::uint64_t>::max();
  };
  KeysWritten keys_written(const std::vector<std::uint64_t>& buckets);
  // Writes `batch` into the key store (synced when `sync`), and notes the
  // bucket keys of `buckets` it writes for keys_written whether or not the
  // write succeeded (a failed write may still be durable). Past
  // kMaxNotedKeys buckets the notes fold into "any key", so that a Db that
  // never purges keeps no list that grows. Under key_writes_mu.
  Status write_key_store(rocksdb::WriteBatch* batch, const std::vector<std::uint64_t>& buckets, bool sync,
                         const std::string& what);

  // How far the state engine's compactions are behind: what admission
  // control reads (StateStore). RocksDB's own write stalls are off in the
  // state engine (its writer must never meet a stop condition), so this is
  // the only brake: past the start of its range signals from all threads
  // together are held to a byte rate that falls with the square of the
  // debt's place in the range, and at its end they are refused with Busy
  // (StateStore::admit), so the debt stays below the end of the range plus
  // what the write buffers hold.
  struct CompactionDebt {
    std::uint64_t l0_files = 0;        // the most level-0 files of the aggregates or the ledger
    std::uint64_t pending_bytes = 0;   // rocksdb.estimate-pending-compaction-bytes, summed
  };
  CompactionDebt compaction_debt() const;
  // Each batch of the writer adds one L0 file to the aggregates and one to
  // the ledger, however small; an L0->L1 compaction takes every L0 file
  // there is. So the files count only far out (each one costs a point
  // read a bloom filter probe); the bytes to rewrite are the debt.
  // At 1M users and 20M signals the debt sat at ~1.2 GB for the last 40 %
  // of the run, steadily: from 512 MiB admission paused 38 % of the signals
  // and cut the throughput to 33k/s (bench/README.md, issue 21). RocksDB's
  // own defaults start slowing at 64 GiB. The ends are the hard stop: 16 GiB
  // or 400 level-0 files, where admit() returns Busy.
  // How old a file of the sealed ledger may grow before RocksDB compacts it
  // (periodic compaction), which reclaims the purged users' records in it.
  static constexpr std::chrono::seconds kSealedReclaimPeriod{30 * 24 * 3600};
  static constexpr std::uint64_t kDebtStartBytes = std::uint64_t{2} << 30;
  static constexpr std::uint64_t kDebtFullBytes = std::uint64_t{16} << 30;
  static constexpr std::uint64_t kDebtStartL0Files = 100;
  static constexpr std::uint64_t kDebtFullL0Files = 400;
  // Long reads of the state engine (the ledger check of verify() and
  // re-materialization, storage/ledger_scan.h) hold a snapshot and pin the
  // SST files they read. A purge's erasure can finish only once no snapshot
  // older than its batches, and no reader of the files its compaction
  // replaced, is left: it calls ask_scans_to_let_go() before each of its two
  // waits, and a check whose hold began before that call lets go of both
  // within one step and starts over (with a snapshot that sees the purge).
  // A check reads scan_generation() before it takes its snapshot. One that
  // started over kLedgerCheckLetGoes times (storage/ledger_scan.h) holds
  // its next attempt to the end, counted in scans_holding(): an erasure
  // waits for it (one pass of the check) before its own time limit runs.
  void ask_scans_to_let_go() const { scan_generation_.fetch_add(1, std::memory_order_seq_cst); }
  std::uint64_t scan_generation() const { return scan_generation_.load(std::memory_order_seq_cst); }
  std::atomic<int>& scans_holding() const { return scans_holding_; }
  // The sealed records a compaction of the sealed ledger has dropped since
  // the open: records no index key names, a purged user's (storage.cc,
  // SealedRecordReclaim; docs/PURGE.md, "What erased means").
  std::uint64_t sealed_records_reclaimed() const;
  // While one lives, a manual compaction of the bucket keys (the erasure's
  // own, Db::Impl::erase_ranges) drops each value of a key in `ranges`
  // (sorted, disjoint, [begin, end)) that is not the current value of that
  // key: a bucket key that a purge replaced, whose replacement is in a
  // newer file than the compaction's. So the erasure rewrites only the files that
  // hold the values, each at its own level, never the files that RocksDB
  // would add between them and the deletion's. One at a time (the
  // erasure's lock); automatic compactions never drop anything.
  class KeysErased {
   public:
    KeysErased(const Storage& storage, const std::vector<std::pair<std::string, std::string>>& ranges);
    ~KeysErased();
    KeysErased(const KeysErased&) = delete;
    KeysErased& operator=(const KeysErased&) = delete;
    // Values kept because their key's current value could not be read
    // (the erasure is then not done).
    std::uint64_t unread() const;

   private:
    const Storage& storage_;
  };
  // Whether a file of the bucket keys, by its table properties, may hold
  // the key (a value, not a deletion) of a bucket of one of `buckets` (its
  // groups: sealed_ledger.h, key_bucket). Each file of the bucket keys
  // keeps a Bloom filter of the groups whose bucket keys it holds
  // (~1 % false positives, no false negatives), so that an erasure
  // compacts only the files that may hold a replaced key: a level-0 file
  // spans the whole family, and a small one that a purge had compacted
  // in place stayed there, compacted again, for nothing, beside the file
  // with the key in 197 of 500 single purges at 1M users (bench/README.md,
  // "Session 37"). A file without the filter may hold any key.
  static bool may_hold_keys_of(const rocksdb::TableProperties& file, const std::vector<std::uint64_t>& buckets);
  // What the checks under way have done, for Stats.
  struct ScanProgress {
    std::atomic<std::uint64_t> records_read{0};      // by the checks under way
    std::atomic<std::uint64_t> records_estimate{0};  // what they will read, by RocksDB's estimate
    std::atomic<std::uint64_t> restarts{0};          // checks started over at an erasure's request
  };
  ScanProgress& scan_progress() const { return scan_progress_; }

  // Flushes (unless read-only) and closes both databases.
  Status close();

  // Recovery in place from a full disk (docs/CONTRACT.md G6). A failed WAL
  // write or sync, flush or MANIFEST write stops the engine: RocksDB refuses
  // its writes until it recovers. Two faults of RocksDB 7.8.3 stand in the
  // way, and tidal works around both without patching it:
  //   - Its recovery of a NoSpace error (the SstFileManager's, and
  //     DB::Resume()) clears the error but leaves the engine flagged as
  //     stopped: Flush(wait) then returns at once, and an ingestion takes
  //     file number 0 (its second one fails: "File exists"). Its automatic
  //     resume after a *retryable* I/O error clears both. So the engines'
  //     file system reports ENOSPC as a retryable I/O error (storage.cc,
  //     NoSpaceIsRetryable), and RocksDB resumes the engine by itself, one
  //     attempt every kResumeInterval, until one succeeds (the space is back).
  //   - A resume moves the engine off the WAL whose write failed only when
  //     it has a memtable to flush; with every memtable empty the engine
  //     stayed on that WAL, and its next write failed for good ("Writer has
  //     previous error"). So a memtable-only record (the anchor) is written
  //     into the default column family before each WAL write or sync when a
  //     flush may have taken the last one.
  // recover(), which each write, sync, flush and ingestion calls first,
  // returns at once while the engine is not stopped; else it waits until
  // RocksDB's next attempt to resume it ends (at most kRecoveryWait): OK
  // once the engine writes again, else an error that says what to do (free
  // space and call again; a reopen for an error RocksDB does not recover
  // from). A write that failed is not in the engine once it has resumed (the
  // resume flushed the memtables and dropped that WAL); until then a crash
  // may still bring it back from the WAL.
  Status recover(Engine engine, std::string_view what);
  static constexpr std::chrono::milliseconds kResumeInterval{100};
  static constexpr std::chrono::seconds kRecoveryWait{10};
  // How many times an engine recovered in place since the open.
  std::uint64_t recoveries() const;

  // Checks that the state store's records are in this version's format
  // (16-byte integer sums, state meta "state_format" = "2") and marks a
  // state engine that has none yet. Aggregates written by tidal 0.1 (8-byte
  // double scores, no ledger) are InvalidArgument, nothing changed.
  Status check_state_format();

  // Tests only: called at each step of a task, to kill the process there.
  // Set it before the open. The tasks and their steps:
  //   "migrate"         the upgrade to format 3: 1, 2, ..., 5 (storage/migrate.cc)
  //   "index backfill"  after the n-th batch of the by_tag backfill was
  //                     written, before the index's marker (storage/index.cc)
  //   "trim changes"    after a trim_changes through seq n was written
  //                     (feed/change_feed.cc)
  //   "reseed"          1: after a re-seed read the aggregates, before its
  //                     snapshot is written; 2: after its one ingestion
  //                     (feed/change_feed.cc)
  //   "purge"           1: a purge batch ingested, its ledger keys not
  //                     yet deleted (db/purge.cc)
  //   "erasure"         1: the key store's erasure armed, before its
  //                     compactions in place (db/purge.cc)
  //   "aggregate write" 1: a batch of the state store's writer built, not
  //                     yet ingested; the writer holds its drain lock
  //                     (db/state_store.cc)
  //   "finish recovery" 1: the backup's manifest removed, before the
  //                     directory's fsync (db/backup.cc)
  //   "backup"          1: its pending marker written; 2: the state engine
  //                     copied; 3: the users engine copied; 4: assembled
  //                     with its manifest, before the rename into place;
  //                     5: renamed, before the marker is removed (db/backup.cc)
  static inline std::function<void(std::string_view task, int step)> step_for_testing;
  // Calls step_for_testing, if set.
  static void test_step(std::string_view task, int step) {
    if (step_for_testing) step_for_testing(task, step);
  }

 private:
  // The index of the feed's handle in the state engine's (after the
  // families every format-4 state engine has).
  static constexpr std::size_t kFeedHandle = 6;
  struct Instance {
    std::unique_ptr<rocksdb::DB> db;
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
  };
  EngineHealth& health(Engine engine) const { return *health_[engine == Engine::Users ? 0 : 1]; }
  // The error of a failed write, sync, flush or ingestion of `engine`, with
  // what to do.
  Status engine_error(Engine engine, const rocksdb::Status& s, std::string_view what) const;
  // Writes the anchor (recover()) unless the default column family's
  // memtable holds it already. Before each WAL write or sync of `engine`.
  void anchor(Engine engine);
  // Flushes every memtable of `instance`.
  rocksdb::Status flush_instance(const Instance& instance) const;
  Storage() = default;
  rocksdb::DB* db_of(rocksdb::ColumnFamilyHandle* cf) const;
  // Opens the state engine (creating it when `create`), with the feed's
  // column family when it exists.
  Status open_state(const rocksdb::Options& base, bool create);
  // The options of the state engine's column family `name`, as open_state
  // opens it (the upgrade imports with them too).
  rocksdb::ColumnFamilyOptions state_cf_options(const rocksdb::Options& base, const std::string& name) const;
  // storage/migrate.cc: makes state_path() a checkpoint of the format-2
  // database (hard links to its SST files) without the users engine's
  // column families and meta records: the state engine's files.
  Status checkpoint_as_state(const rocksdb::Options& base);
  // Where RocksDB's checkpoint builds state_path() before renaming it.
  std::string checkpoint_tmp_dir() const { return state_path() + ".tmp"; }
  // storage/migrate.cc: makes a users engine opened with the format-2
  // column families `legacy` (aggregates, ledger, feed; some may be absent)
  // a format-3 Db, with its state engine open.
  Status migrate_to_format3(const rocksdb::Options& base, const std::vector<rocksdb::ColumnFamilyHandle*>& legacy);
  // IOError naming the bytes the upgrade needs and those free, when the
  // Db's file system has too little room for it (storage/migrate.cc).
  Status check_upgrade_room(const std::string& what);
  // Drops the format-2 column families from the users engine.
  Status drop_legacy(const std::vector<rocksdb::ColumnFamilyHandle*>& legacy);
  // The format-2 column family `name` of the users engine; null when absent.
  rocksdb::ColumnFamilyHandle* legacy(std::string_view name) const;
  // Destroys the handles of legacy_ (the column families stay, unless dropped).
  void release_legacy();
  // InvalidArgument: `what` needs the state engine, which a pending upgrade has not made yet.
  Status not_upgraded(std::string_view what) const;
  static Status close_instance(Instance* instance, const std::string& path);
  // Closes the state engine, its compactions' reclaim of sealed records
  // stopped first (it reads the engine's handles).
  Status close_state();
  // The thread behind Config::users_wal_sync_period: sync_users_wal() every
  // `period` (start to start) until close().
  void run_wal_syncer(std::chrono::milliseconds period);

  std::string path_;
  mutable std::shared_mutex key_store_mu_;
  mutable std::mutex key_writes_mu_;
  std::optional<std::string> key_shape_;  // guarded by key_writes_mu_
  mutable std::mutex kek_mu_;
  KeyEncryption kek_;  // guarded by kek_mu_
  // The directory's (st_dev, st_ino) in the registry of Dbs open for
  // writing, while this handle holds it.
  std::optional<std::pair<dev_t, ino_t>> registry_id_;
  bool read_only_ = false;
  bool state_manifest_per_edit_ = false;  // Config::state_manifest_per_edit
  std::shared_ptr<rocksdb::Cache> block_cache_;
  // The engines' Env: the base Env, its file system reporting ENOSPC as a
  // retryable error (recover()). Outlives both engines.
  std::unique_ptr<rocksdb::Env> env_;
  // The users engine's Env: env_'s files, background threads of its own
  // (storage.cc, UsersEngineEnv). Outlives the engine.
  std::unique_ptr<rocksdb::Env> users_env_;
  Instance users_;
  Instance state_;
  std::array<std::shared_ptr<EngineHealth>, 2> health_{std::make_shared<EngineHealth>(),
                                                       std::make_shared<EngineHealth>()};

  // Set by every Async write of the users engine once it returned; cleared
  // by the sync that makes it durable.
  std::atomic<bool> users_unsynced_{false};
  std::mutex sync_mu_;  // one sync_users_wal() at a time: a caller that finds
                        // the flag cleared waits for the sync that cleared it
  std::mutex syncer_mu_;
  std::condition_variable syncer_cv_;
  bool syncer_stop_ = false;  // guarded by syncer_mu_
  std::thread wal_syncer_;
  // The format-2 column families found in the users engine (aggregates,
  // ledger, feed), while open: until the upgrade or the end of open.
  std::vector<rocksdb::ColumnFamilyHandle*> legacy_;
  bool upgrade_pending_ = false;
  rocksdb::Options options_;  // the users engine's, for finish_upgrade()
  // The sealed ledger's compaction filter (set on its options by
  // state_cf_options); attached to this Storage while the state engine is
  // open for writing.
  std::shared_ptr<SealedRecordReclaim> reclaim_;
  // The key store's compaction filter (KeysErased), on its options.
  std::shared_ptr<KeyStoreErasure> key_erasure_;
  mutable std::atomic<std::uint64_t> scan_generation_{0};
  mutable std::atomic<int> scans_holding_{0};
  mutable ScanProgress scan_progress_;
  // Keys stored, by the number of flush_past_wals(Users) begun before them:
  // those a flush begun later took out of the WALs (keys_written).
  struct StoredKeys {
    std::uint64_t flushes_begun;
    std::uint64_t by;  // the sequence number read after their write
    bool everyone;     // any key (at open, or the notes folded)
    std::vector<std::uint64_t> buckets;
  };
  static constexpr std::size_t kMaxNotedKeys = std::size_t{1} << 20;  // 8 MiB of buckets
  std::mutex stored_keys_mu_;
  std::uint64_t flushes_begun_ = 0;  // guarded by stored_keys_mu_
  // The last flush that succeeded, by number, and the sequence number at its start.
  std::uint64_t flushed_ = 0;      // guarded by stored_keys_mu_
  std::uint64_t flushed_seq_ = 0;  // guarded by stored_keys_mu_
  std::vector<StoredKeys> stored_keys_{{0, std::numeric_limits<std::uint64_t>::max(), true, {}}};  // guarded
  std::size_t noted_keys_ = 0;                                     // guarded by stored_keys_mu_
};

// The largest timestamp recorded in the clock-floor records of both engines'
// meta (0 when there are none); Corruption for a record that does not decode.
Result<std::uint64_t> read_clock_floor(const Storage& storage);

}  // namespace tidal

#endif  // TIDAL_STORAGE_STORAGE_H_
