// The state store: personal, cohort and community sums and the contribution
// ledger, kept in RocksDB and written behind the signal path.
//
// A signal adds exact deltas (Units) to the *active* in-memory buffer, a
// libcuckoo map of cells; it never waits on RocksDB. A background writer
// drains the buffers at least every `write_period`, or sooner when the active
// buffer passes 3/4 of its bound (the soft bound):
//   1. swap: the other (empty) buffer becomes active and the drained one is
//      *frozen*; a RocksDB snapshot taken at the same instant is what readers
//      pair with the frozen buffer until step 3;
//   2. quiesce: wait out every signal that may still add to the frozen buffer
//      (a grace period of the Db's read sections); a signal reads the active
//      index once, so all of its cells land in one buffer and one batch;
//   3. write the frozen buffer as two SST files, a merge operand per
//      aggregate cell and one ledger record per user named by the batch's
//      epoch (a synced meta record takes it first), and with a change feed
//      a third, its records, built by a second thread meanwhile (from the
//      cohort and community cells, which sort into one run); ingest them into
//      RocksDB in one atomic step that fsyncs the files and the MANIFEST
//      (Storage::ingest); then readers switch to the latest state and the
//      frozen buffer is cleared.
// So every batch holds whole signals, and each aggregate equals the sum of its
// ledger entries after every batch (invariant I1), whatever crashes.
// Ingesting files rather than writing a WriteBatch skips the WAL, the
// memtable's per-key skiplist inserts and the memtable flush, which took
// about half of the CPU at full speed; leaves, which go through the WAL, no
// longer queue behind a batch of 100k+ keys either (docs/ROCKSDB.md).
//
// A read is exact at an instant: stored sum + active + frozen (before the
// write) or stored sum + active (after it), under a shared lock the writer
// takes exclusively only to switch between the two.
//
// The writer starts a batch every write_period (start to start) whatever
// the state engine's compactions are doing: RocksDB's write stalls are off
// there, so no batch is ever held back and the crash window stays
// write_period plus one batch's write. Admission control keeps the
// compactions from falling ever further behind instead, as a rate limit over
// the bytes the batches write (in the spirit of RocksDB's delayed write
// rate), shared by every signalling thread, so that the debt stays bounded
// whatever their number:
//   - the writer looks at the compaction debt (Storage::compaction_debt)
//     every kDebtLookPeriod; x is where the debt stands in its range (0 at
//     its start, 1 at its end, the larger of the bytes' and the L0 files');
//   - it measures, from the batches, the bytes a signal costs (batch bytes
//     over the signals counted between swaps, Config::signals) and the byte
//     rate admitted while no limit was in force (the base rate);
//   - inside the range the allowed rate is base * (1 - x)^2, never below
//     base / kMinRateShare, published as the interval between two signals;
//     admit() spaces the signals of all threads together by that interval
//     on one atomic (a virtual-time token bucket, GCRA), sleeping each
//     signal that would run ahead by more than kAdmissionBurst;
//   - at the end of the range (x >= 1) the hard stop: admit() returns Busy
//     at once, nested or not, until the compactions bring the debt back.
// Below the range a signal pays one relaxed atomic load. So over any time T
// at most rate / bytes per signal * (T + kAdmissionBurst) + 1 signals pass,
// and past the hard stop none: the debt stays under the end of its range
// plus what the two buffers hold (docs/CONTRACT.md "Admission").
//
// Past the buffers' bound, admit() makes signals wait for the writer
// (backpressure); while the writer is failing, they get its error instead of
// waiting forever. A failing writer retries once a period, not at every
// wake of the soft bound (which at a full change feed made it retry, and
// fsync, hundreds of times a second); a trim of the feed brings the retry
// forward (feed_trimmed).
#ifndef TIDAL_DB_STATE_STORE_H_
#define TIDAL_DB_STATE_STORE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "db/cuckoo.h"
#include "db/ledger_key_table.h"

#include "feed/change_feed.h"
#include "storage/sealed_ledger.h"
#include "storage/state_format.h"
#include "storage/storage.h"
#include "tidal/db.h"

namespace tidal {

// What the state store counts (summed into Db::stats()).
struct StateStoreStats {
  std::uint64_t writes = 0;            // batches written
  std::uint64_t write_failures = 0;    // failed batch writes (each retried later)
  std::uint64_t cells_written = 0;     // aggregate cells and ledger records written
  std::uint64_t backpressure_waits = 0;
  std::uint64_t pending_cells = 0;     // cells in memory now
  std::uint64_t admission_delayed_signals = 0;   // signals admit() slept (the rate limit)
  std::uint64_t admission_delay_ns = 0;          // their sleeps, in total
  std::uint64_t admission_delay_max_ns = 0;      // the longest one
  std::uint64_t backpressure_wait_max_ns = 0;    // the longest time one signal spent at the buffers' bound
  std::uint64_t admission_refused_signals = 0;   // signals refused with Busy at the hard stop
  std::uint64_t feed_refused_signals = 0;        // signals refused with Busy at the change feed's bound
  std::uint64_t admission_rate_bytes_per_s = 0;  // the rate in force (0: no limit, or the hard stop)
  std::uint64_t admission_signal_bytes = 0;      // the bytes a signal is counted as
  bool admission_stopped = false;                // at the hard stop now
  std::uint64_t compaction_debt_bytes = 0;
  std::uint64_t compaction_debt_l0_files = 0;
  std::uint64_t write_max_ns = 0;      // the longest batch write (see write time below), one overdue now included
  std::uint64_t write_p99_ns = 0;      // p99 of the last kRecentWrites
};

class StateStore {
 public:
  struct Config {
    std::chrono::milliseconds write_period{1000};
    std::size_t buffer_bytes = 64 << 20;  // both buffers together
    // The signals accepted so far (the Db's counters, summed): the writer
    // reads it at each swap to learn the bytes a signal costs. Null: every
    // signal counts as kDefaultSignalBytes.
    std::function<std::uint64_t()> signals;
  };
  // `quiesce` returns once every signal that read the active buffer index
  // before the call has finished (the Db's grace period), or an error when
  // it could not make sure of that.
  StateStore(Storage* storage, const Config& config, std::function<Status()> quiesce);
  ~StateStore();
  StateStore(const StateStore&) = delete;
  StateStore& operator=(const StateStore&) = delete;

  // Storage::check_state_format.
  static Status check_format(Storage& storage);
  // The stored state_epoch (0 when there is none); Corruption when it is
  // not 8 bytes. Reads only, so a format-2 Db's open checks it before the
  // upgrade.
  static Result<std::uint64_t> stored_epoch(const Storage& storage);

  // Epochs one synced state_epoch mark reserves for the batches that follow
  // (write_frozen_locked). Tests set 1: a mark every batch.
  static inline std::uint64_t epoch_lease = 4096;

  // Every batch also enters `feed` (null: no feed), in the same ingestion.
  // Before start().
  void set_feed(ChangeFeed* feed) { feed_ = feed; }
  // Starts the background writer (not for read-only Dbs).
  Status start();
  // Stops the writer and writes what is pending. Idempotent.
  Status stop();
  // The change feed was trimmed: a writer whose last batch failed (perhaps
  // for want of room in the feed) retries now rather than at its period.
  void feed_trimmed();

  // Before a signal's read section: holds the signal to the admission rate
  // while the compactions are behind, slows it a little past the buffers'
  // soft bound and waits while they are full; the error of the failing
  // writer when it cannot drain. Busy at admission's hard stop (nothing
  // waits there). A `nested` signal (made from inside a ContributionSink
  // callback, so inside a read section the writer's grace period waits for)
  // never sleeps or waits: it is not held to the rate, and past the buffers'
  // hard bound it gets Busy at once instead of waiting for a writer that
  // waits for it; at admission's hard stop it is refused like any other.
  Status admit(bool nested);

  // Admission (see the top of this file). A signal runs ahead of the rate
  // by up to kAdmissionBurst before it sleeps.
  static constexpr std::chrono::microseconds kAdmissionBurst{1000};
  // The bytes a signal counts as before the writer has measured any.
  static constexpr std::uint64_t kDefaultSignalBytes = 128;
  // The base rate before one is measured (RocksDB's default delayed write
  // rate), and the least it falls to.
  static constexpr double kInitialBaseRate = 16 << 20;
  static constexpr double kMinBaseRate = 1 << 20;
  // The allowed rate never falls below base / kMinRateShare in the range.
  static constexpr double kMinRateShare = 100;

  // Inside a signal's read section: the buffer every cell of the signal goes
  // to (read once per signal, so every batch holds whole signals).
  int begin_signal() const { return active_.load(std::memory_order_acquire); }
  void add(int buffer, AggregateKind kind, std::uint64_t owner, std::uint64_t item, Units units) {
    add_cell(buffer, Cell{static_cast<std::uint8_t>(kind), owner, item, 0}, units);
  }
  void add_ledger(int buffer, std::uint64_t user, AggregateKind target, std::uint64_t target_id, std::uint64_t item,
                  Units units) {
    add_cell(buffer, Cell{static_cast<std::uint8_t>(static_cast<int>(target) + kLedgerKindOffset), user, target_id, item},
             units);
  }

  // The exact sum of a cell (0 when never touched).
  Result<Units> read(AggregateKind kind, std::uint64_t owner, std::uint64_t item) const;

  // Writes everything pending now. Concurrent calls each return once what was
  // pending when they were called is written.
  Status flush();

  // A batch's *write time*, which stats() reports (the longest and a recent
  // p99): from the moment the batch was due to the moment it is stored. For
  // the writer, due is its period's deadline (or the wake of the soft bound,
  // when earlier): a write that starts late (the last one overran the
  // period, the writer waited for the drain lock or for a CPU) counts its
  // lateness. For flush() and exclusive(), due is the call. So a signal
  // acknowledged at t is stored by t + write_period + the write time of its
  // batch (docs/CONTRACT.md S4). While the writer is past its deadline, the
  // longest write counts that overdue write as far as it got.
  static constexpr std::size_t kRecentWrites = 1000;

  StateStoreStats stats() const;

  // Checks every stored aggregate and ledger record, and invariant I1 (each
  // cohort and community aggregate equals the sum of its ledger entries), at
  // one snapshot. Adds a line per problem to `report`.
  Status verify(VerifyReport* report) const;

  // Writes everything pending (one drain, as flush()), then runs `fn` while
  // holding the drain lock: no batch of the writer lands between fn's reads
  // and its writes (a purge batch, a repair's write). Signals go on meanwhile,
  // into the buffers, up to their bound. The drain's error, fn not run,
  // when the drain fails.
  Status exclusive(const std::function<Status()>& fn);
  // As exclusive(), for a write about `leavers` only (a purge): while a
  // buffer that may hold a contribution of one of them is not yet stored,
  // exactly as exclusive(). Once none may (the purge of users who left a
  // batch ago), fn neither drains nor waits for the writer's batch under
  // way: it runs beside it, holding back only the batch's ingestion (which
  // is ordered after fn's, and readers of the frozen buffer then pair it
  // with a snapshot that includes fn's write). fn must not touch what a
  // batch of the writer may hold: the leavers' cells are all stored, and
  // the writer's copies of their ledger keys are only forgotten (applied
  // at its next batch). A Db with a change feed always takes the drain
  // lock: the feed's seqs are assigned as the writer builds its batch.
  // A leaver's buffer is the one note_leave() named, until its batch is
  // written; a leaver not noted has nothing pending: they left before this
  // StateStore started (its buffers began empty), or while no signal was
  // accepted (a journal's replay, into a recovering Db).
  Status exclusive_for(std::span<const std::uint64_t> leavers, const std::function<Status()>& fn);
  // The number of the buffer signals add to now: 1 at the start, one more
  // at every swap. Read after a leave's grace period, every contribution of
  // the leaver is in a buffer numbered at most that.
  std::uint64_t active_buffer() const { return swaps_.load(std::memory_order_acquire) + 1; }
  // Notes that `user`'s contributions are all in buffers numbered up to
  // `buffer` (a leave, after its grace period: every leave of a Db that
  // accepts signals must note it; a later leave's note replaces it, and the
  // batch that stores the buffer drops it).
  void note_leave(std::uint64_t user, std::uint64_t buffer);
  // Runs `fn` while holding the drain lock, without draining first: fn sees
  // the stored aggregates and the change feed at one batch boundary (what
  // the buffers hold is in neither, and lands after fn). A re-seed's snapshot.
  Status between_batches(const std::function<Status()>& fn);

  // Forgets the writer's copy of `user`'s ledger key, once a purge deleted
  // the stored one: the user's next contribution gets a new key. Inside
  // exclusive() or exclusive_for(); the writer applies it before it looks
  // up the keys of its next batch, which is the first that can hold a
  // contribution of the user's after the purge.
  void forget_ledger_key(std::uint64_t user) { forget_key(user, /*revoke=*/false); }
  // As forget_ledger_key, when the purge could not delete the stored key
  // (or cannot tell whether its batch was written): the writer does not
  // read it again, and the user's next contribution gets a new key that
  // replaces it in the key store. The erasure deletes the old key only
  // while it is still the stored one (Db::Impl::erase_purged).
  void revoke_ledger_key(std::uint64_t user) { forget_key(user, /*revoke=*/true); }

 private:
  // kind 1-3: an aggregate (a = owner, b = item). kind 4-5 (cohort or
  // community + kLedgerKindOffset): a ledger cell (a = user, b = target id, c = item).
  struct Cell {
    std::uint8_t kind;
    std::uint64_t a, b, c;
    bool operator==(const Cell&) const = default;
  };
  struct CellHash {
    std::size_t operator()(const Cell& k) const noexcept {
      std::uint64_t h = (k.a * 0x9e3779b97f4a7c15ULL) ^ (k.b * 0xc2b2ae3d27d4eb4fULL) ^ (k.c * 0x165667b19e3779f9ULL) ^ k.kind;
      return static_cast<std::size_t>(h ^ (h >> 29));
    }
  };
  using Buffer = libcuckoo::cuckoohash_map<Cell, Units, CellHash>;
  static constexpr int kLedgerKindOffset = 2;

  void add_cell(int buffer, const Cell& cell, Units units) {
    if (buffers_[buffer].upsert(cell, [units](Units& v) { v += units; }, units)) {
      if (entries_[buffer].fetch_add(1, std::memory_order_relaxed) + 1 == soft_limit_) wake_writer();
    }
  }
  void wake_writer();
  void run_writer();
  void forget_key(std::uint64_t user, bool revoke);
  // Sets frozen_snapshot_ to one taken now, while the frozen buffer is live:
  // after a write beside the writer's batch (exclusive_for), before the
  // batch's ingestion. Caller holds store_mu_.
  void refresh_frozen_snapshot();
  // Reads the compaction debt, measures the base rate and publishes the
  // interval admit() spaces signals by (or the hard stop). Writer thread only.
  void look_at_debt();
  // Holds a signal to the published interval (admit()).
  void pace(std::uint64_t interval_ns);
  // The hard stop's Busy, naming the debt and where the stop is.
  Status refused() const;
  // One drain: swap (unless a failed batch is still frozen), quiesce, write.
  // Caller holds drain_mu_.
  Status drain_locked();
  // Drains until nothing acknowledged before the call is left in memory (a
  // failed batch, then the active buffer), keeps the outcome in last_error_
  // and, when it stored a batch, its write time from `due`. Caller holds
  // drain_mu_.
  Status drain_all_locked(std::chrono::steady_clock::time_point due);
  // flush(), for a drain that was due at `due`.
  Status flush_due(std::chrono::steady_clock::time_point due);
  Status write_frozen_locked(int frozen);
  // Writes the frozen buffer's cells (sorting them into key order) as one
  // SST file per column family and ingests them together, taking `store`
  // (store_mu_) for the ingestion and leaving it held; counts the keys and
  // the bytes (keys and values) of the aggregates and the ledger.
  Status write_batch_files(std::vector<std::pair<Cell, Units>>* cells, std::uint64_t epoch, const std::string& what,
                           std::unique_lock<std::mutex>* store, std::uint64_t* keys, std::uint64_t* bytes);
  // The ledger keys of `users` (ascending, distinct), in (*keys)[i]: the
  // writer's copy, else the key store's (read in one MultiGet), else a new
  // one (added to `created`, which the batch stores; the copy is kept only
  // once the batch is ingested). Caller holds drain_mu_; the pointers stay
  // valid until the next forget_ledger_key().
  Status resolve_ledger_keys(const std::vector<std::uint64_t>& users, std::vector<const SealingKey*>* keys,
                             std::vector<std::pair<std::uint64_t, UserKey>>* created);

  Storage* const storage_;
  ChangeFeed* feed_ = nullptr;
  const Config config_;
  const std::function<Status()> quiesce_;
  const std::uint64_t soft_limit_;  // cells in the active buffer that wake the writer and slow signals
  const std::uint64_t hard_limit_;  // cells past which admit() waits

  Buffer buffers_[2];
  std::atomic<std::uint64_t> entries_[2] = {0, 0};
  std::atomic<int> active_{0};

  // Readers hold it shared; the writer holds it exclusively to swap buffers
  // and to retire the frozen buffer after its batch is written.
  mutable std::shared_mutex view_mu_;
  bool frozen_live_ = false;                  // the frozen buffer is not yet in storage
  const rocksdb::Snapshot* frozen_snapshot_ = nullptr;  // storage without the frozen buffer

  std::mutex drain_mu_;  // one drain at a time
  // One store into the state engine at a time: a batch's ingestion and the
  // readers' switch to it, or all of a write under exclusive() or
  // exclusive_for(). Taken after drain_mu_.
  std::mutex store_mu_;
  // Swaps so far (active_buffer()), and the number of the last buffer whose
  // batch was written (guarded by store_mu_): batches are written in the
  // order of their swaps, so every buffer up to it is stored.
  std::atomic<std::uint64_t> swaps_{0};
  std::uint64_t frozen_buffer_ = 0;  // the frozen buffer's number; under drain_mu_
  std::uint64_t stored_through_ = 0;
  // note_leave(): the last buffer each leaver may have contributed to, until
  // it is stored.
  std::mutex leavers_mu_;
  std::unordered_map<std::uint64_t, std::uint64_t> leavers_;
  // The last batch's epoch, and the highest the stored state_epoch record
  // reserves (write_frozen_locked); guarded by drain_mu_ (and set before the
  // writer starts).
  std::uint64_t last_epoch_ = 0;
  std::uint64_t reserved_epoch_ = 0;
  // The ledger keys of the users the writer has sealed records of, read or
  // made as they first contribute (storage/sealed_ledger.h); guarded by
  // drain_mu_. About 90 bytes a user (db/ledger_key_table.h).
  LedgerKeyTable ledger_keys_;
  // Users whose stored key the writer must not use (revoke_ledger_key);
  // guarded by drain_mu_.
  std::unordered_set<std::uint64_t> revoked_keys_;
  // forget_ledger_key() and revoke_ledger_key() calls (user, revoke) not
  // yet applied to ledger_keys_ and revoked_keys_: a purge beside the
  // writer's batch must not move the keys the batch is sealing with.
  std::mutex forgotten_mu_;
  std::vector<std::pair<std::uint64_t, bool>> forgotten_;

  // Writer thread control and backpressure.
  std::mutex writer_mu_;
  std::condition_variable writer_cv_;    // wakes the writer
  std::condition_variable drained_cv_;   // wakes signals waiting in admit()
  bool stop_ = false;
  bool wake_ = false;                    // the soft bound was reached
  bool retry_ = false;                   // feed_trimmed(): retry a failed batch now
  Status last_error_;                    // of the last drain; OK once one succeeds
  std::thread writer_;

  std::atomic<std::uint64_t> writes_{0}, write_failures_{0}, cells_written_{0}, backpressure_waits_{0};
  // Write times: the longest and the last kRecentWrites (a ring), in ns;
  // and the steady-clock ns at which the writer's next batch is due (0: no
  // writer), which stats() compares with the time now.
  mutable std::mutex write_times_mu_;
  std::uint64_t write_max_ns_ = 0;
  std::vector<std::uint64_t> recent_writes_;
  std::size_t recent_next_ = 0;
  std::atomic<std::int64_t> writer_due_ns_{0};
  // Admission. interval_ns_: the time between two admitted signals (0: no
  // limit, kStopped: the hard stop), set by the writer; tat_ns_: the
  // steady-clock ns at which the next signal may pass (the bucket).
  static constexpr std::uint64_t kStopped = ~std::uint64_t{0};
  std::atomic<std::uint64_t> interval_ns_{0};
  alignas(64) std::atomic<std::int64_t> tat_ns_{0};
  alignas(64) std::atomic<std::uint64_t> rate_bytes_{0};
  std::atomic<std::uint64_t> debt_bytes_{0}, debt_l0_files_{0};
  std::atomic<std::uint64_t> delayed_signals_{0}, delay_ns_{0}, refused_signals_{0};
  // The longest admission sleep and the longest stay at the buffers' bound
  // (a soft-bound pause or a wait for the writer), in ns.
  std::atomic<std::uint64_t> delay_max_ns_{0}, backpressure_max_ns_{0};
  std::atomic<std::uint64_t> feed_refused_signals_{0};  // at the change feed's bound (admit)
  // What the batches wrote (bytes, in total) and the bytes a signal costs
  // (smoothed over batches; 0 until measured), set under drain_mu_.
  std::atomic<std::uint64_t> batch_bytes_{0};
  std::atomic<double> signal_bytes_{0};
  std::uint64_t frozen_signals_ = 0;   // Config::signals at the frozen buffer's swap; under drain_mu_
  std::uint64_t written_signals_ = 0;  // and at the last written batch's
  // The writer's measure of the base rate: a window of kRateWindow, whether
  // a limit was in force in it, and the rate (bytes/s).
  std::chrono::steady_clock::time_point window_start_;
  std::uint64_t window_bytes_ = 0;
  bool window_limited_ = false;
  double base_rate_ = kInitialBaseRate;
};

}  // namespace tidal

#endif  // TIDAL_DB_STATE_STORE_H_
