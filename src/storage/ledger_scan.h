// Invariant I1 over a whole Db: every cohort and community aggregate equals
// the sum of the contribution-ledger entries for it. verify() checks it;
// re-materialization recomputes aggregates from the same check.
//
// In bounded memory, whatever the size of the state. The ledger is keyed by
// user and the aggregates by cell, so the sums cannot be formed in one walk
// beside the aggregates. They are formed in passes over ranges [lo, hi) of
// aggregate keys instead:
//   1. read the whole ledger, summing only the entries whose cell is in
//      [lo, hi), in an ordered map of at most `max_cells` cells. When a new
//      cell would not fit, the largest key (the new one or the map's last)
//      is dropped and hi lowered to it, so hi ends at the smallest key
//      dropped and every cell below it is summed whole;
//   2. read the stored aggregates in [lo, hi) and compare, in key order;
//   3. the next pass starts at lo = hi; the pass whose hi was never lowered
//      (it reached the end of the key space) is the last.
// Every pass reads one RocksDB snapshot, so together they check one state.
// Cost: max(1, ceil(shared cells / max_cells)) reads of the whole ledger,
// one read of the aggregates. Memory: at most `max_cells` map nodes, about
// 96 bytes each (a 17-byte key and a 16-byte sum in a std::map node, as
// glibc allocates it): about 96 MiB at the default of 2^20 cells.
#ifndef TIDAL_STORAGE_LEDGER_SCAN_H_
#define TIDAL_STORAGE_LEDGER_SCAN_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "storage/state_format.h"
#include "storage/storage.h"

namespace tidal {

// The most cells one pass holds, by default.
inline constexpr std::size_t kLedgerPassCells = std::size_t{1} << 20;

// The cap of the checks that start from now on: kLedgerPassCells unless
// set_ledger_pass_cells changed it. Thread-safe.
std::size_t ledger_pass_cells();
// For tests and benchmarks, process-wide: sets the cap of every check that
// starts from now on (0: back to kLedgerPassCells). Thread-safe.
void set_ledger_pass_cells(std::size_t cells);

// What the checks of this process did since the last reset, for tests and
// benchmarks. Thread-safe.
struct LedgerPassTally {
  std::uint64_t passes = 0;
  std::size_t peak_cells = 0;  // the most cells one pass held at once
};
LedgerPassTally ledger_pass_tally();
void reset_ledger_pass_tally();

// One shared aggregate that differs from its ledger sum (or does not decode).
struct AggregateMismatch {
  std::string key;  // encoded aggregate key
  std::string what;  // "cohort 7 item 9 (key 02...): stored 5, ledger 3" style
  Units recomputed;
  std::optional<Units> stored;  // 0 when absent; empty when the stored value does not decode
};

struct LedgerCheck {
  std::uint64_t ledger_records = 0;  // ledger records read (counted in the first pass only)
  std::uint64_t ledger_entries = 0;  // entries in them
  std::uint64_t aggregates = 0;  // stored cells checked, personal ones included
  std::uint64_t passes = 0;
};

// Checks I1 as of `snapshot` (null: a snapshot of its own, for every pass).
// Calls `problem` once per ledger record that does not decode (naming the
// key), all before the first call of `mismatch`; then `mismatch` per shared
// aggregate that differs from its ledger sum or does not decode, in key
// order (a sum with no stored aggregate reads "stored 0 (absent)"). Personal
// cells are checked only to decode. Holds at most `max_cells` cells at once
// (at least 1). Non-OK when a read fails, naming what was being read.
Status check_ledger(const Storage& storage, const rocksdb::Snapshot* snapshot, LedgerCheck* out,
                    const std::function<void(std::string)>& problem,
                    const std::function<void(const AggregateMismatch&)>& mismatch,
                    std::size_t max_cells = ledger_pass_cells());

}  // namespace tidal

#endif  // TIDAL_STORAGE_LEDGER_SCAN_H_
