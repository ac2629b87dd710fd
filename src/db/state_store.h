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
//      epoch (a synced meta record takes it first), and ingest them into
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
// compactions from falling ever further behind instead: the writer looks at
// the compaction debt (Storage::compaction_debt) every kDebtLookPeriod and
// sets a pause that every signal then takes in admit(), zero below the
// start of the debt range and growing with the square of the debt across it
// (in the spirit of RocksDB's delayed write rate), so that throughput
// settles where the disk keeps up and no signal call waits long.
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
#include <thread>
#include <vector>

#include "db/cuckoo.h"

#include "feed/change_feed.h"
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
  std::uint64_t admission_delayed_signals = 0;
  std::uint64_t admission_delay_ns = 0;
  std::uint64_t admission_pause_ns = 0;
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

  // Before a signal's read section: slows the signal a little past the soft
  // bound and waits while the buffers are full; the error of the failing
  // writer when it cannot drain. A `nested` signal (made from inside a
  // ContributionSink callback, so inside a read section the writer's grace
  // period waits for) never sleeps or waits: past the hard bound it gets
  // Busy at once instead of waiting for a writer that waits for it.
  Status admit(bool nested);

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
  // Reads the compaction debt and sets the pause admit() gives each signal.
  void look_at_debt();
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
  // SST file per column family and ingests them together; counts the keys.
  Status write_batch_files(std::vector<std::pair<Cell, Units>>* cells, std::uint64_t epoch, const std::string& what,
                           std::uint64_t* keys) const;

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
  // The last batch's epoch, and the highest the stored state_epoch record
  // reserves (write_frozen_locked); guarded by drain_mu_ (and set before the
  // writer starts).
  std::uint64_t last_epoch_ = 0;
  std::uint64_t reserved_epoch_ = 0;

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
  // Admission: the pause each signal takes now, and the debt it comes from.
  std::atomic<std::uint64_t> pause_ns_{0};
  std::atomic<std::uint64_t> debt_bytes_{0}, debt_l0_files_{0};
  std::atomic<std::uint64_t> delayed_signals_{0}, delay_ns_{0};
};

}  // namespace tidal

#endif  // TIDAL_DB_STATE_STORE_H_
