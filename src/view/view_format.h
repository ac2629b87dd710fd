// The records of a global view's directory (docs/FORMAT.md, "The global
// view's directory"). One RocksDB database with three column families:
//
//   default     "view_format"                -> ASCII "3" ("2": made before
//                                               per-shard sums, which it
//                                               lacks; "1": before
//                                               incarnations too. Both read;
//                                               a writable open marks an empty
//                                               one "3", a "1" with records "2")
//               "applied/" + [shard_id: 8 BE] -> [seq: 8 BE]
//                                               [incarnation: 16 bytes]
//                                               (absent: not known yet)
//                                               [retired: 16 bytes] (the
//                                               incarnation a re-seed replaced;
//                                               absent: none)
//               "retired/" + [shard_id: 8 BE] + [incarnation: 16 bytes]
//                                            -> empty: every incarnation a
//                                               re-seed of the shard replaced
//                                               (older versions ignore these)
//               "ordinal/" + [shard_id: 8 BE] -> [ordinal: 8 BE]: the highest
//                                               incarnation ordinal applied
//                                               for the shard (absent: none
//                                               known; older versions ignore
//                                               these), written with "applied/"
//               "clean_close"                -> empty (memtable only; never read)
//   aggregates  [kind: 1, 2 cohort / 3 community][owner: 8 BE][item: 8 BE]
//               -> Units, 16 bytes LE (storage/state_format.h), merge operands
//                  of tidal.UnitsAdd: the sum over every shard
//   shards      [shard_id: 8 BE][aggregate key: 17, as above]
//               -> Units, as above: the shard's own contribution (format 3),
//                  which a re-seed of the shard subtracts and replaces
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
inline constexpr char kViewShardsFamily[] = "shards";

// Written when the view is created, checked at every open.
inline constexpr char kViewFormatKey[] = "view_format";
inline constexpr char kViewFormat[] = "3";
inline constexpr char kViewFormatBeforePerShardSums[] = "2";
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

inline constexpr char kRetiredPrefix[] = "retired/";
inline constexpr char kOrdinalPrefix[] = "ordinal/";

// "ordinal/" + [shard_id: 8 BE].
inline std::string encode_ordinal_key(std::uint64_t shard_id) {
  std::string key(kOrdinalPrefix);
  put_u64_be(&key, shard_id);
  return key;
}
// An "ordinal/" record's value: [ordinal: 8 BE].
inline std::string encode_ordinal(std::uint64_t ordinal) {
  std::string value;
  put_u64_be(&value, ordinal);
  return value;
}

// "retired/" + [shard_id: 8 BE] + the incarnation's 16 bytes.
inline std::string encode_retired_key(std::uint64_t shard_id, std::string_view incarnation) {
  std::string key(kRetiredPrefix);
  put_u64_be(&key, shard_id);
  key.append(incarnation);
  return key;
}

// "shards" key: [shard_id: 8 BE][aggregate key: 17].
inline std::string encode_shard_cell_key(std::uint64_t shard_id, std::string_view aggregate_key) {
  std::string key;
  put_u64_be(&key, shard_id);
  key.append(aggregate_key);
  return key;
}

// A shard's applied record: its last applied seq, the incarnation of the
// feed it came from and the one a re-seed replaced (32 lowercase hex
// digits; empty when not known, or none); and, from its own "ordinal/"
// record (not in encode_applied), the highest incarnation ordinal applied
// for the shard (0: none known).
struct AppliedRecord {
  std::uint64_t seq = 0;
  std::string incarnation;
  std::string retired;
  std::uint64_t ordinal = 0;
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

// [seq: 8 BE], then the incarnation's 16 bytes when it is known (valid hex),
// then the retired one's when there is one.
inline std::string encode_applied(const AppliedRecord& r) {
  std::string value;
  put_u64_be(&value, r.seq);
  if (std::optional<std::string> bytes = incarnation_bytes(r.incarnation)) {
    value += *bytes;
    if (std::optional<std::string> retired = incarnation_bytes(r.retired)) value += *retired;
  }
  return value;
}
// Empty unless 8, 24 or 40 bytes.
inline std::optional<AppliedRecord> decode_applied(std::string_view value) {
  if (value.size() != 8 && value.size() != 8 + kIncarnationSize && value.size() != 8 + 2 * kIncarnationSize) {
    return std::nullopt;
  }
  AppliedRecord r;
  r.seq = get_u64_be(value.data());
  static constexpr char kDigits[] = "0123456789abcdef";
  for (std::size_t i = 8; i < value.size(); ++i) {
    const auto c = static_cast<unsigned char>(value[i]);
    std::string& out = i < 8 + kIncarnationSize ? r.incarnation : r.retired;
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return r;
}

}  // namespace tidal

#endif  // TIDAL_VIEW_VIEW_FORMAT_H_
