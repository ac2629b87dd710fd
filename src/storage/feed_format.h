// The change feed's bytes (docs/FORMAT.md, "The change feed").
//
//   feed CF   key   [seq: 8 BE]                     (8 bytes)
//             value the payload:
//               [version: 1 = 0x01]
//               [origin: 1]  1 the writer's batch, 2 a purge, 3 a repair,
//                            4 the seed, 5 a re-seed's first batch
//                            (FeedOrigin)
//               [count: 4 LE]
//               count entries of 33 bytes, keys strictly ascending:
//                 [aggregate key: 17] = [kind: 1, 2 cohort / 3 community]
//                                       [owner: 8 BE][item: 8 BE]
//                 [delta: 16 LE]      Units, two's complement
//
// A payload is at most kMaxChangePayloadBytes (15,887 entries); a larger set
// of deltas is split into consecutive payloads (FeedEncoder).
#ifndef TIDAL_STORAGE_FEED_FORMAT_H_
#define TIDAL_STORAGE_FEED_FORMAT_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "storage/state_format.h"
#include "tidal/change_batch.h"

namespace tidal {

inline constexpr std::uint8_t kFeedVersion = 1;
inline constexpr std::size_t kFeedHeaderSize = 6;
inline constexpr std::size_t kFeedEntrySize = kAggregateKeySize + kUnitsSize;  // 33
inline constexpr std::size_t kMaxFeedEntries = (kMaxChangePayloadBytes - kFeedHeaderSize) / kFeedEntrySize;

// What wrote a batch: the state store's writer, a purge, a repair of
// re-materialization, or the seed written when the feed was turned on for a
// Db that already held shared aggregates (their values, as deltas from 0).
// A re-seed (ChangeFeed::reseed) is a snapshot too, under a new
// incarnation: its first batch has origin Reseed (a view then drops what
// it holds of the shard and starts from this batch's values, at any seq),
// the rest of the snapshot origin Seed.
enum class FeedOrigin : std::uint8_t { Writer = 1, Purge = 2, Repair = 3, Seed = 4, Reseed = 5 };

// The origin of a payload that check_feed_payload accepted.
inline FeedOrigin feed_origin(std::string_view payload) { return static_cast<FeedOrigin>(payload[1]); }

// [seq: 8 BE].
std::string encode_feed_key(std::uint64_t seq);
std::optional<std::uint64_t> decode_feed_key(std::string_view key);

// One delta of a shared aggregate.
struct FeedEntry {
  AggregateKind kind;  // Cohort or Community
  std::uint64_t owner;
  std::uint64_t item;
  Units delta;
};

// Builds payloads from entries added in ascending key order: each payload
// holds at most kMaxFeedEntries. Without a sink `finish` returns them all;
// with one, each payload goes to the sink as soon as it is full (and the
// last at `finish`), so the memory is one payload. With origin Reseed the
// first payload has origin Reseed and the later ones Seed, and there is
// always one (with no entries when none were added: the shard contributes
// nothing).
class FeedEncoder {
 public:
  explicit FeedEncoder(FeedOrigin origin, std::function<void(std::string payload)> sink = nullptr)
      : origin_(origin), sink_(std::move(sink)) {}
  // `encoded_key` is a 17-byte aggregate key of a cohort or community cell.
  void add(std::string_view encoded_key, Units delta);
  bool empty() const { return payloads_.empty() && count_ == 0; }
  std::vector<std::string> finish();

 private:
  void seal();
  void start();
  const FeedOrigin origin_;
  std::size_t sealed_ = 0;  // payloads sealed so far
  const std::function<void(std::string payload)> sink_;
  std::vector<std::string> payloads_;
  std::string current_;
  std::uint32_t count_ = 0;
};

// Checks a payload whole: true when it decodes (see decode_feed_payload);
// otherwise false, and `error` says why. Its entries are then the runs of
// kFeedEntrySize bytes from kFeedHeaderSize on, keys strictly ascending.
bool check_feed_payload(std::string_view payload, std::string* error);

// Merges payloads that check_feed_payload accepted: calls `fn` once per
// distinct key, in ascending key order, with the key (17 bytes) and the sum,
// modulo 2^128 as the merge operator adds, of its deltas in all of them.
void merge_feed_payloads(std::span<const std::string_view> payloads,
                         const std::function<void(std::string_view key, Units sum)>& fn);

// Decodes a payload: calls `fn` per entry, in order. False (after calling
// `fn` for none of them) when the payload does not decode: wrong version or
// origin, a length that does not match its count, a kind other than cohort
// or community, or keys that are not strictly ascending; `error` then says
// which.
bool decode_feed_payload(std::string_view payload, const std::function<void(const FeedEntry&)>& fn,
                         std::string* error);

}  // namespace tidal

#endif  // TIDAL_STORAGE_FEED_FORMAT_H_
