#include "storage/state_format.h"

#include <bit>
#include <cmath>

#include <rocksdb/slice.h>

namespace tidal {
namespace {

constexpr std::uint64_t kUnitsPerWeight = 1'000'000'000;

std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

// The number of significant bits of `x` (0 for 0).
int bit_width(UUnits x) {
  const auto high = static_cast<std::uint64_t>(x >> 64);
  return static_cast<int>(high != 0 ? 64 + std::bit_width(high) : std::bit_width(static_cast<std::uint64_t>(x)));
}

// Adds each operand to `sum`; false when one is not 16 bytes.
template <class Operands>
bool add_operands(const Operands& operands, Units* sum) {
  for (const rocksdb::Slice& op : operands) {
    std::optional<Units> u = decode_units(view(op));
    if (!u) return false;
    *sum = static_cast<Units>(static_cast<UUnits>(*sum) + static_cast<UUnits>(*u));
  }
  return true;
}

class UnitsAddOperator : public rocksdb::MergeOperator {
 public:
  const char* Name() const override { return "tidal.UnitsAdd"; }

  bool FullMergeV2(const MergeOperationInput& in, MergeOperationOutput* out) const override {
    Units sum = 0;
    if (in.existing_value != nullptr) {
      std::optional<Units> base = decode_units(view(*in.existing_value));
      if (!base) return false;
      sum = *base;
    }
    if (!add_operands(in.operand_list, &sum)) return false;
    out->new_value.clear();
    put_units(&out->new_value, sum);
    return true;
  }

  bool PartialMergeMulti(const rocksdb::Slice&, const std::deque<rocksdb::Slice>& operands, std::string* new_value,
                         rocksdb::Logger*) const override {
    Units sum = 0;
    if (!add_operands(operands, &sum)) return false;
    new_value->clear();
    put_units(new_value, sum);
    return true;
  }
};

}  // namespace

std::optional<Units> weight_to_units(double weight) {
  if (!std::isfinite(weight) || std::fabs(weight) > kMaxWeight) return std::nullopt;
  if (weight == 0) return Units{0};
  // weight = mantissa * 2^exp exactly, with a 53-bit integer mantissa.
  int exp = 0;
  const double fraction = std::frexp(std::fabs(weight), &exp);
  const auto mantissa = static_cast<std::uint64_t>(std::ldexp(fraction, 53));
  exp -= 53;  // |weight| <= 1e12 < 2^40, so exp <= -13: a right shift
  const UUnits scaled = static_cast<UUnits>(mantissa) * kUnitsPerWeight;  // < 2^83: exact
  const int shift = -exp;
  UUnits q = 0;
  if (shift < 100) {
    q = scaled >> shift;
    const UUnits rem = scaled - (q << shift);
    if (rem >= (static_cast<UUnits>(1) << (shift - 1))) ++q;  // ties away from zero
  }
  const auto units = static_cast<Units>(q);
  return weight < 0 ? -units : units;
}

double units_to_double(Units units) {
  const bool negative = units < 0;
  const UUnits magnitude = negative ? static_cast<UUnits>(0) - static_cast<UUnits>(units) : static_cast<UUnits>(units);
  double out;
  if (magnitude < (static_cast<UUnits>(1) << 53)) {
    // Both operands are exact doubles, and IEEE division rounds correctly.
    out = static_cast<double>(static_cast<std::uint64_t>(magnitude)) / static_cast<double>(kUnitsPerWeight);
  } else {
    // One rounding, in integer arithmetic: magnitude / 1e9 = (n / 1e9) * 2^-shift
    // with n = magnitude << shift, its top bit at bit 127. The quotient q of
    // n / 1e9 has 98 or 99 bits (2^97 < 2^127 / 1e9); the double keeps its
    // top 53, and the dropped bits and the remainder (strictly less than
    // one unit of q's last bit) decide the rounding: half to even.
    const int shift = 128 - bit_width(magnitude);
    const UUnits n = magnitude << shift;
    const UUnits q = n / kUnitsPerWeight;
    const bool inexact = n - q * kUnitsPerWeight != 0;
    const int drop = bit_width(q) - 53;
    auto mantissa = static_cast<std::uint64_t>(q >> drop);
    const UUnits dropped = q & ((static_cast<UUnits>(1) << drop) - 1);
    const UUnits half = static_cast<UUnits>(1) << (drop - 1);
    if (dropped > half || (dropped == half && (inexact || (mantissa & 1) != 0))) ++mantissa;
    out = std::ldexp(static_cast<double>(mantissa), drop - shift);  // mantissa <= 2^53: exact
  }
  return negative ? -out : out;
}

std::string units_to_string(Units units) {
  const bool negative = units < 0;
  UUnits magnitude = negative ? static_cast<UUnits>(0) - static_cast<UUnits>(units) : static_cast<UUnits>(units);
  std::string digits;
  do {
    digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(magnitude % 10)));
    magnitude /= 10;
  } while (magnitude != 0);
  return negative ? "-" + digits : digits;
}

void put_units(std::string* out, Units units) {
  const auto u = static_cast<UUnits>(units);
  char bytes[kUnitsSize];  // 16 LE bytes, in one append (a feed entry's and every aggregate value's)
  for (unsigned i = 0; i < kUnitsSize; ++i) bytes[i] = static_cast<char>(static_cast<std::uint8_t>(u >> (8 * i)));
  out->append(bytes, kUnitsSize);
}

Units get_units(const char* p) {
  const UUnits lo = get_u64_le(p);
  const UUnits hi = get_u64_le(p + 8);
  return static_cast<Units>((hi << 64) | lo);
}

std::optional<Units> decode_units(std::string_view bytes) {
  if (bytes.size() != kUnitsSize) return std::nullopt;
  return get_units(bytes.data());
}

void put_aggregate_key(std::string* out, AggregateKind kind, std::uint64_t owner, std::uint64_t item) {
  out->push_back(static_cast<char>(kind));
  put_u64_be(out, owner);
  put_u64_be(out, item);
}

std::string encode_aggregate_key(AggregateKind kind, std::uint64_t owner, std::uint64_t item) {
  std::string out;
  out.reserve(kAggregateKeySize);
  put_aggregate_key(&out, kind, owner, item);
  return out;
}

std::optional<AggregateCell> decode_aggregate_key(std::string_view key) {
  if (key.size() != kAggregateKeySize || key[0] < 1 || key[0] > 3) return std::nullopt;
  return AggregateCell{static_cast<AggregateKind>(key[0]), get_u64_be(key.data() + 1), get_u64_be(key.data() + 9)};
}

std::string describe(const AggregateCell& cell) {
  const char* kind = cell.kind == AggregateKind::Personal ? "personal user "
                     : cell.kind == AggregateKind::Cohort ? "cohort "
                                                          : "community ";
  return kind + std::to_string(cell.owner) + " item " + std::to_string(cell.item);
}

std::shared_ptr<rocksdb::MergeOperator> new_units_add_operator() { return std::make_shared<UnitsAddOperator>(); }

std::string encode_ledger_key(std::uint64_t user_id, std::uint64_t epoch) {
  std::string out = encode_key_prefix(EntityId(user_id), Tag::ContributionLedger);
  put_u64_be(&out, epoch);
  return out;
}

std::optional<LedgerKey> decode_ledger_key(std::string_view key) {
  if (key.size() != kLedgerKeySize || static_cast<Tag>(key[8]) != Tag::ContributionLedger) return std::nullopt;
  return LedgerKey{get_u64_be(key.data()), get_u64_be(key.data() + 9)};
}

void put_ledger_entry(std::string* out, const LedgerEntry& entry) {
  out->push_back(entry.target == AggregateKind::Cohort ? '\0' : '\1');
  put_u64_be(out, entry.target_id);
  put_u64_be(out, entry.item);
  put_units(out, entry.units);
}

std::optional<std::vector<LedgerEntry>> decode_ledger_value(std::string_view value) {
  if (value.empty() || value.size() % kLedgerEntrySize != 0) return std::nullopt;
  std::vector<LedgerEntry> entries;
  entries.reserve(value.size() / kLedgerEntrySize);
  for (const char* p = value.data(); p != value.data() + value.size(); p += kLedgerEntrySize) {
    if (p[0] != 0 && p[0] != 1) return std::nullopt;
    entries.push_back({p[0] == 0 ? AggregateKind::Cohort : AggregateKind::Community, get_u64_be(p + 1),
                       get_u64_be(p + 9), get_units(p + 17)});
  }
  return entries;
}

}  // namespace tidal
