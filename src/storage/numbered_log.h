// What the change feed (feed/change_feed.h) and the privacy journal
// (journal/journal.h) store alike: a log of records numbered 1, 2, 3, ...
// per shard, each record's value [end_offset: 8 BE][payload] (end_offset:
// the payload bytes ever appended, through this record); a point record
// [seq: 8 BE][offset: 8 BE] through which records were removed (the feed's
// trim, the journal's confirm); and the shard id that owns the log, an
// 8-byte record. docs/FORMAT.md has both layouts.
#ifndef TIDAL_STORAGE_NUMBERED_LOG_H_
#define TIDAL_STORAGE_NUMBERED_LOG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include <rocksdb/iterator.h>

#include "storage/storage.h"

namespace tidal {

// A place in a log: a seq, and the payload bytes ever appended through it.
struct LogPoint {
  std::uint64_t seq = 0;
  std::uint64_t offset = 0;
};

// One log's records, for reading and for messages. `name` is what errors
// call it ("change feed", "privacy journal"); `removed_name` its point
// record ("trim record", "confirmed point").
struct NumberedLog {
  const Storage* storage;
  const char* name;
  const char* removed_name;
  std::string (*encode_key)(std::uint64_t seq);
  std::optional<std::uint64_t> (*decode_key)(std::string_view key);

  // The shard id stored under `key` in `cf`, if any.
  Result<std::optional<std::uint64_t>> stored_shard(rocksdb::ColumnFamilyHandle* cf, std::string_view key) const;
  // InvalidArgument, naming both shards, when `stored` is another shard's.
  Status check_shard(std::optional<std::uint64_t> stored, std::uint64_t shard_id) const;
  // The point through which records were removed ({0, 0} before the first).
  Result<LogPoint> removed(rocksdb::ColumnFamilyHandle* cf, std::string_view key) const;
  // The log's end: the last record, `last` (null when the log has none),
  // when it is past `removed`; `removed` otherwise. Corruption when the
  // record does not decode.
  Result<LogPoint> end(const rocksdb::Iterator* last, LogPoint removed) const;
  // The seq of the record `it` is at, and its payload, when it is seq
  // `expected`. Corruption naming it otherwise.
  Result<std::string_view> payload(const rocksdb::Iterator& it, std::uint64_t expected) const;
  // The end offset stored in the record of `seq` (for a removal through it).
  Result<std::uint64_t> end_offset(rocksdb::ColumnFamilyHandle* cf, std::uint64_t seq) const;
};

// A record's value.
std::string encode_log_value(std::uint64_t end_offset, std::string_view payload);
// A point record's value.
std::string encode_log_point(LogPoint p);

}  // namespace tidal

#endif  // TIDAL_STORAGE_NUMBERED_LOG_H_
