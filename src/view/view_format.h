// The records of a global view's directory (docs/FORMAT.md, "The global
// view's directory"). One RocksDB database with two column families:
//
//   default     "view_format"                -> ASCII "2" ("1": before
//                                               incarnations; read, and
//                                               marked "2" at a writable open)
//               "applied/" + [shard_id: 8 BE] -> [seq: 8 BE]
//                                               [incarnation: 16 bytes]
//                                               (absent: not known yet)
//               "clean_close"                -> empty (memtable only; never read)
//   aggregates  [kind: 1, 2 cohort / 3 community][owner: 8 BE][item: 8 BE]
//               -> Units, 16 bytes LE (storage/state_format.h), merge operands
//                  of tidal.UnitsAdd
//
// The aggregate keys and values are the Db's (storage/state_format.h), so a
// change feed's entries (storage/feed_format.h) are stored as they arrive.
#ifndef TIDAL_VIEW_VIEW_FORMAT_H_
#define TIDAL_VIEW_VIEW_FORMAT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "storage/format.h"

namespace tidal {

// The column families, in the order the view opens them.
inline constexpr char kViewMetaFamily[] = "default";
inline constexpr char kViewAggregatesFamily[] = "aggregates";

// Written when the view is created, checked at every open.
inline constexpr char kViewFormatKey[] = "view_format";
inline constexpr char kViewFormat[] = "2";
inline constexpr char kViewFormatBeforeIncarnations[] = "1";
inline constexpr std::size_t kIncarnationSize = 16;  // bytes; 32 hex digits in ChangeBatch::incarnation

inline constexpr char kAppliedPrefix[] = "applied/";
inline constexpr std::size_t kAppliedPrefixSize = sizeof(kAppliedPrefix) - 1;

// "applied/" + [shard_id: 8 BE].
inline std::string encode_applied_key(std::uint64_t shard_id) {
  std::string key(kAppliedPrefix);
  put_u64_be(&key, shard_id);
  return key;
}
// The shard of an "applied/" key; empty unless the prefix and 8 bytes.
inline std::optional<std::uint64_t> decode_applied_key(std::string_view key) {
  if (key.size() != kAppliedPrefixSize + 8 || !key.starts_with(kAppliedPrefix)) return std::nullopt;
  return get_u64_be(key.data() + kAppliedPrefixSize);
}

// A shard's applied record: its last applied seq and the incarnation of the
// feed it came from (32 lowercase hex digits; empty when not known).
struct AppliedRecord {
  std::uint64_t seq = 0;
  std::string incarnation;
};

// The 16 bytes of 32 lowercase hex digits; empty unless exactly that.
inline std::optional<std::string> incarnation_bytes(std::string_view hex_digits) {
  if (hex_digits.size() != 2 * kIncarnationSize) return std::nullopt;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::string out;
  for (std::size_t i = 0; i < hex_digits.size(); i += 2) {
    const int hi = nibble(hex_digits[i]), lo = nibble(hex_digits[i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out.push_back(static_cast<char>(hi * 16 + lo));
  }
  return out;
}

// [seq: 8 BE], then the incarnation's 16 bytes when it is known (valid hex).
inline std::string encode_applied(const AppliedRecord& r) {
  std::string value;
  put_u64_be(&value, r.seq);
  if (std::optional<std::string> bytes = incarnation_bytes(r.incarnation)) value += *bytes;
  return value;
}
// Empty unless 8 or 24 bytes.
inline std::optional<AppliedRecord> decode_applied(std::string_view value) {
  if (value.size() != 8 && value.size() != 8 + kIncarnationSize) return std::nullopt;
  AppliedRecord r;
  r.seq = get_u64_be(value.data());
  static constexpr char kDigits[] = "0123456789abcdef";
  for (std::size_t i = 8; i < value.size(); ++i) {
    const auto c = static_cast<unsigned char>(value[i]);
    r.incarnation.push_back(kDigits[c >> 4]);
    r.incarnation.push_back(kDigits[c & 15]);
  }
  return r;
}

}  // namespace tidal

#endif  // TIDAL_VIEW_VIEW_FORMAT_H_
