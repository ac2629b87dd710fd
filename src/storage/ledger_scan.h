// Invariant I1 over a whole Db: every cohort and community aggregate equals
// the sum of the contribution-ledger entries for it. verify() checks it;
// re-materialization recomputes aggregates from the same check.
//
// In bounded memory and in time linear in the state. The ledger is keyed by
// user and the aggregates by cell, so the sums cannot be formed in one walk
// beside the aggregates. They are formed by an external sort instead:
//   1. one read of the whole ledger adds each entry to its cell's sum in a
//      hash table of at most `max_cells` cells; when a new cell would not
//      fit, the cells are sorted by key in place and written out as a
//      sorted run of (key, sum) records, and the table emptied. If any run
//      was written, the table's last cells are one more;
//   2. a k-way merge of the runs (a min-heap on each run's next key) yields
//      every cell's total, added up over the runs, in key order; with no run
//      the table, sorted, is that sequence;
//   3. one read of the stored aggregates beside it compares, in key order.
// Both reads are of one RocksDB snapshot (a purge's erasure can make the
// check let go of it and start over: check_ledger below). The runs are
// records of a 17-byte key and a 16-byte sum (Units, little-endian, as
// aggregates store them) back to back, all in one file, each run a range
// of it: a plain file read with positioned reads, not an SST file, since
// nothing looks a key up in it. The file is written through the Db's Env in a directory of its own,
// <db path>/verify-tmp-<pid>-<n>, made at the first run and deleted on
// every return, errors included. One that a crash left is deleted at the
// start of the next check (in any process: one whose pid no longer runs).
// Cost: one read of the ledger, one write and one read of the runs (at
// most 33 bytes per ledger entry, none when the shared cells fit in the
// table), one read of the aggregates. Memory: during the ledger read the
// table, slots of 40 bytes (a 17-byte key, a 16-byte sum, a flag), at most
// half full, grown fourfold as cells arrive up to 2 * `max_cells` slots
// (rounded up to a power of two): 80 MiB at the default of 2^20 cells, 100
// MiB while its last growth copies. A std::map held about 96 bytes a cell,
// and each of its lookups cost ~20 dependent loads. During the merge the table is
// freed and each run is read through a buffer of its share of `max_cells`
// records (at least 16, at most 1 MiB): about 33 MiB at 2^20.
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

// The most cells the table of sums holds, by default: 2^21 (102 MiB),
// more than the shared cells of the demo's Db at any size (1.5M), which are
// then summed without a run.
inline constexpr std::size_t kLedgerPassCells = std::size_t{1} << 21;

// The cap of the checks that start from now on: kLedgerPassCells unless
// set_ledger_pass_cells changed it. Thread-safe.
std::size_t ledger_pass_cells();
// For tests and benchmarks, process-wide: sets the cap of every check that
// starts from now on (0: back to kLedgerPassCells). Thread-safe.
void set_ledger_pass_cells(std::size_t cells);

// What the checks of this process did since the last reset, for tests and
// benchmarks. Thread-safe.
struct LedgerPassTally {
  std::uint64_t passes = 0;  // reads of the whole ledger: one per check
  std::uint64_t runs = 0;  // sorted runs written (0 for a check whose cells fit in the table)
  std::size_t peak_cells = 0;  // the most cells the table held at once
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

// How many times a check lets go for purges before it holds (above).
inline constexpr std::uint64_t kLedgerCheckLetGoes = 3;

struct LedgerCheck {
  std::uint64_t ledger_records = 0;  // ledger records read
  // Format 4's sealed records whose pseudonym no key names: records of
  // purged users, unreadable, left where they are (storage/sealed_ledger.h);
  // counted in ledger_records, not read.
  std::uint64_t purged_records = 0;
  std::uint64_t ledger_entries = 0;  // entries in them
  std::uint64_t aggregates = 0;  // stored cells checked, personal ones included
  std::uint64_t passes = 0;  // reads of the whole ledger (1)
  std::uint64_t runs = 0;  // sorted runs written
  std::uint64_t restarts = 0;  // attempts given up because a purge's erasure asked (below)
};

// Checks I1 as of a snapshot of its own.
// Calls `problem` once per ledger record that does not decode (naming the
// key), all before the first call of `mismatch`; then `mismatch` per shared
// aggregate that differs from its ledger sum or does not decode, in key
// order (a sum with no stored aggregate reads "stored 0 (absent)"). Personal
// cells are checked only to decode. Holds at most `max_cells` cells at once
// (at least 1). Non-OK when a read fails, naming what was being read, or
// when the runs cannot be written or read back (in the Db's directory, or
// for a read-only open in the system's temporary directory, once the shared
// cells outnumber `max_cells`).
// Lets go of its snapshot, and of the files it reads, within one record of
// a purge's request (Storage::ask_scans_to_let_go): it calls `restarted`
// (the caller drops every problem and mismatch reported so far) and starts
// over with a new snapshot, which sees the purge. After kLedgerCheckLetGoes
// such restarts it holds its next attempt to the end (Storage::
// scans_holding()), and the purges asking meanwhile wait for it, so a check
// finishes under steady purges. Each restart is counted in
// LedgerCheck::restarts and Storage::scan_progress().
Status check_ledger(const Storage& storage, LedgerCheck* out, const std::function<void(std::string)>& problem,
                    const std::function<void(const AggregateMismatch&)>& mismatch,
                    const std::function<void()>& restarted, std::size_t max_cells = ledger_pass_cells());

}  // namespace tidal

#endif  // TIDAL_STORAGE_LEDGER_SCAN_H_
