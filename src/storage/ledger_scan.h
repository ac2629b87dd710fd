// Invariant I1 over a whole Db: every cohort and community aggregate equals
// the sum of the contribution-ledger entries for it. verify() checks it;
// re-materialization recomputes aggregates from the same scan.
#ifndef TIDAL_STORAGE_LEDGER_SCAN_H_
#define TIDAL_STORAGE_LEDGER_SCAN_H_

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "storage/state_format.h"
#include "storage/storage.h"

namespace tidal {

// An encoded aggregate key held inline: at 1.5M shared cells a std::string
// key (17 bytes, past the short-string buffer) cost one more allocation each.
using AggregateKey = std::array<char, kAggregateKeySize>;
struct AggregateKeyHash {
  std::size_t operator()(const AggregateKey& k) const noexcept {
    return std::hash<std::string_view>{}(std::string_view(k.data(), k.size()));
  }
};
// Sums of ledger entries per aggregate.
using LedgerTotals = std::unordered_map<AggregateKey, Units, AggregateKeyHash>;

struct LedgerScan {
  LedgerTotals totals;
  std::uint64_t records = 0;  // ledger records read
  std::uint64_t entries = 0;  // entries in them
  std::vector<std::string> problems;  // records that do not decode, naming the key
};

// Reads the whole ledger column family as of `snapshot` (null: latest).
Status scan_ledger(const Storage& storage, const rocksdb::Snapshot* snapshot, LedgerScan* out);

// One shared aggregate that differs from its ledger sum (or does not decode).
struct AggregateMismatch {
  std::string key;  // encoded aggregate key
  std::string what;  // "cohort 7 item 9 (key 02...): stored 5, ledger 3" style
  Units recomputed;
};

// Compares every stored cohort and community aggregate, as of `snapshot`,
// with `totals`, and each total with its aggregate; personal cells are
// checked only to decode. Calls `fn` per mismatch; counts cells in `checked`.
// Consumes `totals` (each total is erased once its aggregate is seen, so the
// memory shrinks as the scan goes).
Status compare_with_ledger(const Storage& storage, const rocksdb::Snapshot* snapshot, LedgerTotals totals,
                           std::uint64_t* checked, const std::function<void(const AggregateMismatch&)>& fn);

}  // namespace tidal

#endif  // TIDAL_STORAGE_LEDGER_SCAN_H_
