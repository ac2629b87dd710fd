// The records of a global view's directory (docs/FORMAT.md, "The global
// view's directory"). One RocksDB database with two column families:
//
//   default     "view_format"                -> ASCII "1"
//               "applied/" + [shard_id: 8 BE] -> [seq: 8 BE]
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
inline constexpr char kViewFormat[] = "1";

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

// [seq: 8 BE].
inline std::string encode_applied_seq(std::uint64_t seq) {
  std::string value;
  put_u64_be(&value, seq);
  return value;
}
// Empty unless exactly 8 bytes.
inline std::optional<std::uint64_t> decode_applied_seq(std::string_view value) {
  if (value.size() != 8) return std::nullopt;
  return get_u64_be(value.data());
}

}  // namespace tidal

#endif  // TIDAL_VIEW_VIEW_FORMAT_H_
