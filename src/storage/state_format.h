// The byte formats of the state store: exact weights, aggregate cells and
// contribution-ledger records (docs/FORMAT.md describes them byte by byte).
//
//   aggregates CF  key   [kind: 1][owner: 8 BE][item: 8 BE]   (17 bytes)
//                  value Units, 16 bytes LE two's complement; written as
//                        merge operands of an integer add (never read first)
//   ledger CF      key   [user_id: 8 BE][0x13][epoch: 8 BE]   (17 bytes)
//                  value one or more 33-byte entries, sorted by (target, id, item):
//                        [target: 1, 0 cohort / 1 community][target_id: 8 BE]
//                        [item: 8 BE][Units: 16 LE]
//
// A weight is a signed count of 1e-9 units (Units). Every sum is an exact
// integer, so the order in which signals arrive never changes a score.
// Bound: |weight| <= 1e12, so one signal adds less than 2^70 units; a cell
// would need more than 2^57 signals (1.4e17) to overflow 127 bits.
#ifndef TIDAL_STORAGE_STATE_FORMAT_H_
#define TIDAL_STORAGE_STATE_FORMAT_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <rocksdb/merge_operator.h>

#include "storage/format.h"

namespace tidal {

// The state engine's directory inside the Db directory at `db_path`.
inline std::string state_engine_dir(const std::string& db_path) { return db_path + "/state"; }

__extension__ typedef __int128 Units;  // 1e-9 weight units
__extension__ typedef unsigned __int128 UUnits;  // for sums modulo 2^128, as the merge operator adds

// The largest weight magnitude a signal may carry.
inline constexpr double kMaxWeight = 1e12;

// `weight` rounded to the nearest 1e-9 (ties away from zero), exactly: the
// double's mantissa is scaled in integer arithmetic, with no intermediate
// rounding. Empty when the weight is not finite or exceeds kMaxWeight.
std::optional<Units> weight_to_units(double weight);
// The double nearest to units * 1e-9.
double units_to_double(Units units);
// Decimal text of `units` ("-12"), for messages.
std::string units_to_string(Units units);

inline constexpr std::size_t kUnitsSize = 16;
void put_units(std::string* out, Units units);
Units get_units(const char* p);
// Empty when `bytes` is not exactly 16 bytes.
std::optional<Units> decode_units(std::string_view bytes);

// ---- aggregate cells ----

enum class AggregateKind : std::uint8_t { Personal = 1, Cohort = 2, Community = 3 };

inline constexpr std::size_t kAggregateKeySize = 17;
std::string encode_aggregate_key(AggregateKind kind, std::uint64_t owner, std::uint64_t item);
// Appends the same 17 bytes to `out` (no allocation of its own).
void put_aggregate_key(std::string* out, AggregateKind kind, std::uint64_t owner, std::uint64_t item);
struct AggregateCell {
  AggregateKind kind;
  std::uint64_t owner;
  std::uint64_t item;
};
// Empty unless 17 bytes with a known kind.
std::optional<AggregateCell> decode_aggregate_key(std::string_view key);
// "cohort 7 item 9" style name of a cell, for messages.
std::string describe(const AggregateCell& cell);

// The associative integer add that RocksDB applies to aggregate cells. A
// stored operand or base value that is not 16 bytes fails the read with
// Corruption (RocksDB reports the merge failure).
std::shared_ptr<rocksdb::MergeOperator> new_units_add_operator();

// ---- contribution ledger (tag 0x13) ----

inline constexpr std::size_t kLedgerKeySize = 17;
inline constexpr std::size_t kLedgerEntrySize = 33;

struct LedgerEntry {
  AggregateKind target;  // Cohort or Community
  std::uint64_t target_id;
  std::uint64_t item;
  Units units;
};

// [user_id BE][0x13][epoch BE]; all of a user's ledger records share the
// 9-byte prefix encode_key_prefix(EntityId(user), Tag::ContributionLedger).
std::string encode_ledger_key(std::uint64_t user_id, std::uint64_t epoch);
struct LedgerKey {
  std::uint64_t user_id;
  std::uint64_t epoch;
};
std::optional<LedgerKey> decode_ledger_key(std::string_view key);

void put_ledger_entry(std::string* out, const LedgerEntry& entry);
// Empty when the value is empty, not a multiple of 33 bytes, or names a
// target other than cohort or community.
std::optional<std::vector<LedgerEntry>> decode_ledger_value(std::string_view value);

}  // namespace tidal

#endif  // TIDAL_STORAGE_STATE_FORMAT_H_
