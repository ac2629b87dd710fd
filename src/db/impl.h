// Db::Impl: the state behind the tidal::Db facade. Internal; tests include
// it to inject a fault-injecting RocksDB Env (Db::Impl::open).
#ifndef TIDAL_DB_IMPL_H_
#define TIDAL_DB_IMPL_H_

#include <array>
#include <chrono>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <span>
#include <string>
#include <vector>

#include "db/cuckoo.h"
#include <rocksdb/env.h>

#include "db/clock.h"
#include "db/erasure_ranges.h"
#include "db/grace.h"
#include "db/leave_gate.h"
#include "db/maps.h"
#include "db/state_store.h"
#include "db/writer_first_mutex.h"
#include "feed/change_feed.h"
#include "journal/journal.h"
#include "storage/receipt.h"
#include "storage/sealed_ledger.h"
#include "storage/storage.h"
#include "tidal/db.h"

namespace tidal {

class LedgerReader;  // purge.cc

// Hot-path counters, striped by thread so signaling threads do not share a
// cache line. Relaxed; summed by stats().
struct alignas(64) CounterStripe {
  std::atomic<std::uint64_t> signals{0};  // each one also updated the personal layer
  std::atomic<std::uint64_t> cohort_attributions{0};
  std::atomic<std::uint64_t> community_forwards{0};
  std::atomic<std::uint64_t> gated_cohort{0};
  std::atomic<std::uint64_t> gated_community{0};
};

class Db::Impl {
 public:
  // Db::open with an optional RocksDB Env (fault injection in tests).
  static Result<std::unique_ptr<Db>> open(const std::string& path, const Options& options, rocksdb::Env* env);

  Impl(const Options& options, std::unique_ptr<Storage> storage);
  ~Impl();

  Status close();
  Status flush();
  Status rotate_key_encryption_key(const std::string& new_key);
  // At open, before anything is written: the host's key-encryption key
  // checked against the Db (storage/sealed_ledger.h, open_key_encryption).
  Status check_key_encryption();
  Status backup(const std::string& dir) const;
  Status finish_recovery();
  // The bytes a backup into `parent`'s file system writes there: the
  // memtables it flushes, and the engines' files it copies (all of them on
  // another file system; else all but the hard-linked table files).
  std::uintmax_t backup_bytes_needed(const std::string& parent) const;
  Status replay_journal(std::span<const JournalEntry> entries);
  bool recovering() const { return recovering_.load(std::memory_order_acquire); }
  // Busy naming `what` and the steps that end a recovery (db/backup.cc).
  Status recovering_status(const char* what) const;
  // At open: a backup's manifest in the directory makes the Db recovering.
  Status load_recovery_state();
  // At a writable open: removes what backups killed mid-way left (their
  // staging directories, which hold ledger records later purges erased).
  void remove_unfinished_backups();
  // Runs of replay_journal's entries (db/replay.cc), seqs first_seq..:
  // leaves and rejoins in one write; purges of distinct users whose
  // receipts the copy does not hold as one bulk purge (one intents write,
  // one erasure).
  Status replay_memberships(std::span<const JournalRecord> run, std::uint64_t first_seq, const std::string& what);
  Status replay_purges(std::span<const JournalRecord> run, std::uint64_t first_seq, const std::string& what);
  // A purge entry whose receipt the copy holds: journaled at `seq`, nothing redone.
  Status replay_purge_done(const JournalRecord& rec, std::uint64_t seq, const std::string& what);
  // The purges of replayed entries whose intents (and marks) are written:
  // purged, receipts written, the marks deleted, the users' records erased.
  // On failure the users are in unfinished_purges_ (finish_recovery refuses).
  Status purge_after_intents(std::span<const JournalRecord> run, const std::string& what);
  // A replayed purge entry the Db holds already: finished (purge_after_intents)
  // when its mark is still there and the purge not done.
  Status finish_replayed_purge(const JournalRecord& rec, const std::string& what);

  Status join_community(std::uint64_t user_id, std::uint64_t community_id);
  Status exit_community(std::uint64_t user_id, std::uint64_t community_id);
  Result<std::vector<std::uint64_t>> communities_of(std::uint64_t user_id) const;

  Result<SignalOutcome> signal_with_context(const Signal& signal, const SignalContext& context);
  // The exact sum as the nearest double; 0 for what was never touched.
  Result<double> score(AggregateKind kind, std::uint64_t owner, std::uint64_t item) const;

  Status leave_community_layer(std::uint64_t user_id);
  Status rejoin_community_layer(std::uint64_t user_id);
  Status leave_community_layer(std::span<const std::uint64_t> user_ids);
  Status rejoin_community_layer(std::span<const std::uint64_t> user_ids);
  Result<CommunityMembership> community_layer_status(std::uint64_t user_id) const;
  Result<std::vector<MembershipEvent>> community_layer_history(std::uint64_t user_id) const;
  Result<GateActivity> gate_activity(std::uint64_t user_id) const;
  Status for_each_left(const std::function<bool(const CommunityMembership&)>& fn) const;
  Result<VerifyReport> verify() const;
  // §7, in db/purge.cc.
  Result<std::vector<PurgeReceipt>> purge(const char* what, std::span<const std::uint64_t> user_ids);
  Result<std::vector<PurgeReceipt>> purge_receipts(std::uint64_t user_id) const;
  Result<RematerializeReport> rematerialize_shared_aggregates(bool repair);
  Stats stats() const;
  // The change feed (feed/change_feed.h).
  Result<std::vector<ChangeBatch>> read_changes(std::uint64_t after_seq, std::size_t max_bytes) const;
  Result<std::uint64_t> last_change_seq() const;
  Status trim_changes(std::uint64_t through_seq);
  Result<std::uint64_t> reseed_change_feed();
  // The privacy journal (journal/journal.h).
  Result<std::vector<JournalEntry>> read_journal(std::uint64_t after_seq, std::size_t max_bytes) const;
  Result<std::uint64_t> last_journal_seq() const;
  Result<std::uint64_t> wait_journal(std::uint64_t after_seq, std::chrono::milliseconds wait) const;
  Status confirm_journal(std::uint64_t through_seq);

  // Closes every Db still open; run once by std::atexit (see db_impl_open.cc).
  static void close_all_at_exit();

  // Tests only: the Db's two engines (to flush or compact one of them).
  static Storage& storage_for_testing(Db& db) { return *db.impl_->storage_; }
  // Tests only: run by every purge between its durable batches and their
  // physical erasure, with no lock held. Set it while no purge runs.
  static inline std::function<void()> before_erasure_for_testing;
  // Tests only: run by every purge once its users are registered (a rejoin
  // of them now waits for it) and, with a journal, its intents are durable,
  // before its first batch, with no lock held (a test kills the process or
  // throws there). Set it while no purge runs.
  static inline std::function<void()> after_purge_intent_for_testing;
  // Tests only: run by backup() between its state engine's copy and its
  // users engine's, with the backup's exclusion of purges held.
  static inline std::function<void()> between_backup_copies_for_testing;
  // Aggregate cells a purge batch sums in memory at once (one pass over the
  // purged users' ledgers per this many cells). Tests lower it.
  static inline std::size_t purge_pass_cells = 1 << 18;
  // A purge batch that removes at most this many ledger entries is one
  // synced write through the state engine's WAL; a larger one is ingested
  // as files (IngestBatch::Via). Its cells (<= its entries) are then held in
  // memory: at most ~4,096 merge operands, ~0.2 MB. Tests set it to 0 (every
  // batch as files) or raise it.
  static inline std::uint64_t purge_wal_entries = 4'096;
  // Longest an erasure waits for a snapshot older than the purge, then for
  // RocksDB to delete the obsolete files that may hold a purged record
  // (another thread deleting them, a reader still holding them). Tests
  // lower it.
  static inline std::chrono::milliseconds erasure_wait{10'000};
  // Whether backup() checks the room it needs first. Tests turn it off to
  // reach the failures of a disk that fills up during the copy.
  static inline bool backup_checks_space = true;

 private:
  class Call;
  // Ends a Call: the last one out after close() began wakes close().
  void end_call() const;
  // True when the calling thread is inside a Call of this Db (in a
  // for_each_left callback): close() would then wait for itself.
  bool in_call_on_this_thread() const;
  // What one signal's fan-out carries from path to path.
  struct FanOut {
    SignalOutcome outcome;
    CounterStripe* counters;
    Units units = 0;            // the weight, exact
    int buffer = 0;             // the state store buffer every cell of the signal goes to
    std::uint64_t stamp = 0;    // leased time of its contributions, taken before the fan-out (sink set)
    std::int8_t gate = -1;      // the leave gate's answer for this signal; -1 until asked
    std::string sink_error{};   // set when the sink threw: the fan-out stops there
  };
  // The leave gate: true when the user's signal must not reach a shared
  // aggregate. Probed once per signal, by whichever path asks first.
  bool leave_gate_closed(const Signal& signal, FanOut* fan_out) const noexcept;
  // The two fan-out paths of the signal path; each begins with the leave gate.
  void try_cohort_attribution(const Signal& signal, const SignalContext& context, FanOut* fan_out);
  void try_community_forwarding(const Signal& signal, FanOut* fan_out);
  // Reports an addition to the sink; false when the sink threw (the error is
  // in fan_out->sink_error) and the fan-out must stop.
  bool report(const Signal& signal, ContributionTarget target, std::uint64_t target_id, FanOut* fan_out);

  Status change_membership(std::uint64_t user_id, std::uint64_t community_id, bool join);
  // At open, before anything is written: what open_feed() can refuse (the
  // Options against the stored feed), reading only.
  Status check_feed_options();
  // At open, before the writer starts: the change feed, when the Db keeps
  // one or Options::change_feed asks for it (feed/change_feed.h).
  Status open_feed();
  // InvalidArgument naming `what` when the Db keeps no change feed.
  Status check_feed(const char* what) const;
  // At open, before anything is written: what open_journal() can refuse.
  Status check_journal_options();
  // At open: the privacy journal, when the Db keeps one or Options::journal asks for it.
  Status open_journal();
  // At a writable open, once the writer runs: finishes every purge whose
  // intent is journaled and whose batch a crash (or an error) cut off.
  Status finish_journaled_purges();
  // Whether the purge a journaled mark names is still to be done: its
  // receipt missing and the user Left since `left_at` (the open's and the
  // replay's rule).
  Result<bool> journaled_purge_pending(std::uint64_t user, std::uint64_t purged_at, std::uint64_t left_at);
  // InvalidArgument naming `what` when the Db keeps no journal.
  Status check_journal(const char* what) const;
  // Writes `fill`'s records with one journal entry per record of `entries`
  // in one atomic write (the journal's group commit), or `fill`'s records
  // alone without a journal. The last entry's seq (0 without a journal).
  Result<std::uint64_t> write_journaled(const Journal::Fill& fill, std::span<const JournalRecord> entries,
                                        const std::string& what);
  // With Options::journal_wait: waits until confirm_journal covers `seq`;
  // NotReplicated naming `what` after journal_wait. OK at once otherwise.
  // Called holding no lock stripe.
  Status await_replication(std::uint64_t seq, const std::string& what);
  // What a call that changes nothing waits for (a retry after
  // NotReplicated): every entry written before it.
  std::uint64_t journal_retry_seq() const { return journal_ ? journal_->last_seq() : 0; }
  // Checks that apply to every write: open, writable, not inside a sink callback.
  Status check_writable(const char* what) const;
  // Busy when the calling thread is inside a ContributionSink callback (a
  // read section): for every call that waits for a grace period, which
  // would include the caller's own section.
  static Status check_outside_sink(const char* what);
  std::mutex& user_lock(std::uint64_t user_id) { return user_locks_[user_id % user_locks_.size()]; }
  // Locks the stripes of `users` (sorted) in ascending order, as every call
  // that holds more than one does (no cycle between them). With
  // `wait_for_purges`, first waits, holding no stripe, until no purge is
  // working on any of them (a rejoin: its new signals must not land in a
  // ledger the purge is removing); nothing else waits for a purge.
  std::vector<std::unique_lock<std::mutex>> lock_stripes(std::span<const std::uint64_t> users, bool wait_for_purges);
  // Appends the clock floor record of the user's lock stripe to `batch`.
  void put_clock_floor(rocksdb::WriteBatch* batch, std::uint64_t user_id, std::uint64_t ts);
  // Writes the clock's lease record (Clock::StoreFloor).
  Status store_clock_lease(std::uint64_t floor);
  // `seq`: the journal entry's seq (0 without a journal).
  Status write_membership(std::uint64_t user_id, const CommunityMembership& m, std::uint64_t at_ns, const char* what,
                          std::uint64_t* seq);
  // Appends the 0x11 record (and its index copy) and the 0x12 history entry.
  void put_membership(rocksdb::WriteBatch* batch, std::uint64_t user_id, const CommunityMembership& m,
                      std::uint64_t at_ns) const;
  // The bulk forms: sorts and dedups the ids, locks their stripes in
  // ascending order and runs leave_locked or rejoin_locked.
  Status bulk(const char* what, std::span<const std::uint64_t> user_ids, bool leave);
  // `users` sorted and distinct, their stripes locked.
  // `seq`: the seq the call's replication waits for (journal_wait).
  Status leave_locked(const std::vector<std::uint64_t>& users, std::uint64_t* seq);
  Status rejoin_locked(const std::vector<std::uint64_t>& users, std::uint64_t* seq);
  // The batched write both bulk forms share; `seq`: the last entry's.
  Status write_bulk(const std::vector<std::uint64_t>& todo, MembershipStatus status, const char* what,
                    std::uint64_t* seq);
  // Appends the clock floor records of the stripes in `floors` (0 = untouched).
  void put_clock_floors(rocksdb::WriteBatch* batch, const std::vector<std::uint64_t>& floors);
  CounterStripe& counters();
  // The signals accepted since open (the stripes' sum).
  std::uint64_t signals_accepted() const;
  // db/purge.cc: with a journal, writes the purge intents of `users`
  // (their boundary `left_at`, their receipts' `purged_at`) and their
  // marks, durably, before anything is purged; `seq`: the last entry's.
  Status write_purge_intents(const char* what, const std::vector<std::uint64_t>& users,
                             const std::vector<std::uint64_t>& left_at, const std::vector<std::uint64_t>& purged_at,
                             std::uint64_t* seq);
  // Deletes every intent mark of `users` once a purge of them is durable
  // (not synced: a mark a crash keeps makes the next open check that purge
  // again), and forgets them in unfinished_purges_.
  Status delete_purge_marks(const std::vector<std::uint64_t>& users);
  // Busy naming `what` when a purge of the user with a journaled intent
  // failed in this session and was not finished since: a rejoin then would
  // hide it from the next open.
  Status check_no_unfinished_purge(const char* what, std::uint64_t user) const;
  // db/purge.cc: `users` sorted, distinct, Left since `left_at` (same
  // order), registered in purging_; each receipt's time is `purged_at`
  // (same order, chosen before the intent). Writes the durable batches; adds to
  // `to_erase` every user whose ledger bytes may still be in a file
  // (including on error).
  Result<std::vector<PurgeReceipt>> purge_registered(const char* what, const std::vector<std::uint64_t>& users,
                                                     const std::vector<std::uint64_t>& left_at,
                                                     const std::vector<std::uint64_t>& purged_at,
                                                     std::vector<std::uint64_t>* to_erase);
  // One purge batch, ingested atomically (storage/ingest_batch.h): per
  // aggregate cell the users touched a merge operand of minus their exact
  // sum, a range deletion of each user's ledger, each user's receipt
  // (`records`, same order), the stripes' clock floors and the erasure
  // marks (`marks`: the mark value of each user).
  // `keys`: each user's ledger key, when the key store holds one (same
  // order); the batch deletes the user's index keys of the sealed ledger,
  // and once it is ingested the keys are deleted from the key store (users
  // engine). The writer forgets them (or, where the deletion failed,
  // revokes them). `ledger` reads the users' ledgers (purge.cc), as of
  // before the batch.
  Status write_purge_batch(const std::vector<std::uint64_t>& users, const std::vector<std::optional<UserKey>>& keys,
                           const std::vector<ReceiptRecord>& records, const std::vector<std::uint64_t>& marks,
                           LedgerReader* ledger, const std::string& what);
  // The purged_at_ns of the user's earliest receipt whose erasure has not
  // finished, if any (the erasure mark).
  Result<std::optional<std::uint64_t>> erasure_pending_since(std::uint64_t user) const;
  Result<std::optional<ErasureMark>> erasure_mark(std::uint64_t user) const;
  // Deletes the stored key of each of `users` whose erasure mark names it
  // (a purge's deletion that failed, or that a crash lost), unless a live
  // sealed record still uses it: those users are `in_use`, their marks kept.
  Status delete_marked_keys(const std::vector<std::uint64_t>& users, std::vector<std::uint64_t>* in_use);
  // Physical erasure of the users' purged ledgers (sorted), then their marks.
  Status erase_purged(const std::vector<std::uint64_t>& users);
  // At a writable open: finishes every erasure still marked.
  Status complete_pending_erasures();
  // Makes sure no SST or WAL file holds a record in the ranges of `cf` that
  // is not its current one (the bucket keys: those a purge replaced), nor
  // any record of them (format 3's ledger): flushes its engine (unless no
  // memtable or live WAL can hold one: `written`), force-compacts the files
  // that can hold them (of the bucket keys, only those that may hold a key
  // of `ids`, the ranges' buckets, sorted), and waits until the files that
  // held them are deleted.
  Status erase_ranges(rocksdb::ColumnFamilyHandle* cf, const std::vector<KeyRange>& ranges,
                      const std::vector<std::uint64_t>& ids, const Storage::KeysWritten& written);
  // The engine's SST files that are not live (sorted names).
  Result<std::vector<std::string>> obsolete_files(Storage::Engine engine) const;
  // The newest of the engine's WAL files that RocksDB no longer needs
  // (older than rocksdb.min-log-number-to-keep) but has not deleted yet, or
  // "" when there is none.
  Result<std::string> stale_wal(Storage::Engine engine) const;
  // Options::strict_erasure: compacts the purge batches' key ranges
  // (purge_image_) in the state engine's last level, so that no file keeps
  // a version of a touched cell from before the purge, the subtraction's
  // operands, the receipt at its sequence number or the sealed index's
  // range deletion (docs/PURGE.md, "Strict erasure").
  Status erase_purge_image();
  // Takes every write made so far out of the state engine's WALs: flushes
  // its memtables and waits until RocksDB has deleted every WAL that held
  // them. A purge's batch through the WAL holds the receipt (which names
  // the user) beside minus the user's exact sum for each cell they touched.
  Status retire_state_wals();
  // The name of a MANIFEST of the state engine other than the current one,
  // or "" when there is none.
  Result<std::string> stale_state_manifest() const;
  // Deletes the state engine's obsolete files (re-enabling file deletions)
  // until `stale` names none, for at most erasure_wait.
  Status await_state_deletions(const std::function<Result<std::string>()>& stale, std::string_view what);

  const Options options_;
  std::unique_ptr<Storage> storage_;
  Clock clock_;
  // Set first thing by close(); every later call returns Closed. close()
  // then waits for calls_ to drain, so it is never starved by new callers.
  // The signal path does not count itself in calls_: close waits it out with
  // a grace period instead.
  std::atomic<bool> closed_{false};
  mutable std::atomic<std::uint64_t> calls_{0};  // Calls in flight
  mutable std::mutex drain_mu_;                 // with drained_: close() sleeps until calls_ is 0
  mutable std::condition_variable drained_;
  std::mutex close_mu_;  // a second close() returns once the first has finished
  std::array<std::mutex, 64> user_locks_;  // serializes membership changes of one user
  // The users a purge is working on (registered under their stripes, while
  // they are Left), with the number of purges of each: a purge holds no
  // stripe while it works, so leaves, joins and exits never wait for one.
  std::mutex purging_mu_;
  std::condition_variable purge_ended_;
  std::unordered_map<std::uint64_t, unsigned> purging_;
  std::mutex erase_mu_;  // one physical erasure at a time (db/purge.cc)
  // A purge holds this shared from its intents' write until its marks are
  // deleted, and a backup holds it exclusively across its two checkpoints:
  // no copy holds a purge's intent without its mark unless its state-engine
  // part is in the copy too (db/backup.cc). Writer first: under steady
  // purges a backup still starts.
  mutable WriterFirstMutex backup_mu_;
  std::mutex repair_mu_;  // one repairing re-materialization at a time (db/rematerialize.cc)
  // Which purge batch last wrote each user's erasure mark, so that an
  // erasure deletes only marks of batches it covered (db/purge.cc).
  std::mutex marks_mu_;
  std::uint64_t generation_ = 0;
  std::unordered_map<std::uint64_t, std::uint64_t> purge_generation_;
  // Options::strict_erasure: the key ranges of the state engine that purge
  // batches wrote and no erasure has compacted yet (under marks_mu_). After
  // an open that found an unfinished erasure, every range (`everything`):
  // the crash took the list.
  struct PurgeImage {
    std::vector<KeyRange> aggregates, receipts, sealed_index;
    bool everything = false;
    void add(const PurgeImage& other) {
      aggregates.insert(aggregates.end(), other.aggregates.begin(), other.aggregates.end());
      receipts.insert(receipts.end(), other.receipts.begin(), other.receipts.end());
      sealed_index.insert(sealed_index.end(), other.sealed_index.begin(), other.sealed_index.end());
      everything = everything || other.everything;
    }
  };
  PurgeImage purge_image_;

  CommunitiesMap communities_;
  LeaveStatusMap leave_status_;
  libcuckoo::cuckoohash_map<std::uint64_t, GateActivity> held_back_;
  LeaveGate gate_;
  grace::Domain grace_;  // this Db's read sections: one per signal, tagged with its user
  std::unique_ptr<ChangeFeed> feed_;   // null without Options::change_feed
  std::unique_ptr<Journal> journal_;   // null without Options::journal (or, read-only, a stored one)
  std::array<CounterStripe, 16> stripes_;  // before state_: its writer reads them (signals_accepted)
  std::unique_ptr<StateStore> state_;  // after grace_ and feed_: its writer waits out read sections and writes the feed

  std::atomic<std::uint64_t> leaves_{0}, rejoins_{0}, corrupt_treated_as_left_{0};
  std::atomic<std::uint64_t> journal_wait_timeouts_{0};
  // Users of a purge that failed after its intents were written (db/purge.cc).
  mutable std::mutex unfinished_mu_;
  std::unordered_set<std::uint64_t> unfinished_purges_;

  // Opened from a backup (its manifest in the directory) and not yet
  // finished: signals and user-status calls are Busy (db/backup.cc).
  std::atomic<bool> recovering_{false};
  std::string recovery_manifest_;  // the manifest's text, set at open
  std::mutex recovery_mu_;         // one finish_recovery at a time
};

// One public call that touches storage, counted in calls_ while it runs;
// close() publishes closed_ and then waits until no Call is left. A Call
// that is refused (status() not OK) counts nothing. Never blocks.
//   - closed_ and calls_ are seq_cst on both sides (Dekker): either the
//     caller sees closed_ and returns Closed, or close() sees the caller
//     counted and waits for it.
//   - A write (`write`) also runs check_writable(): Busy from inside a
//     ContributionSink callback, whose signal close() and leave wait out.
class Db::Impl::Call {
 public:
  Call(const Impl* impl, const char* what, bool write);
  ~Call();
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  const Status& status() const { return status_; }
  // The thread's innermost Call (calls nest through for_each_left callbacks).
  static const Call* innermost();
  const Impl* impl() const { return impl_; }
  const Call* outer() const { return outer_; }

 private:
  static thread_local const Call* innermost_;
  const Impl* impl_;
  Status status_;
  const Call* outer_ = nullptr;
  bool counted_ = false;
};

}  // namespace tidal

#endif  // TIDAL_DB_IMPL_H_
