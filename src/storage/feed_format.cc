#include "storage/feed_format.h"

#include <algorithm>
#include <cstring>

namespace tidal {
namespace {

// The entry count in a payload's header (at least kFeedHeaderSize bytes).
std::uint32_t feed_entry_count(std::string_view payload) {
  std::uint32_t count = 0;
  for (unsigned i = 0; i < 4; ++i) count |= static_cast<std::uint32_t>(static_cast<std::uint8_t>(payload[2 + i])) << (8 * i);
  return count;
}

}  // namespace

std::string encode_feed_key(std::uint64_t seq) {
  std::string key;
  put_u64_be(&key, seq);
  return key;
}

std::optional<std::uint64_t> decode_feed_key(std::string_view key) {
  if (key.size() != 8) return std::nullopt;
  return get_u64_be(key.data());
}

void FeedEncoder::add(std::string_view encoded_key, Units delta) {
  if (count_ == kMaxFeedEntries) seal();
  if (count_ == 0) start();
  current_.append(encoded_key);
  put_units(&current_, delta);
  ++count_;
}

void FeedEncoder::start() {
  const FeedOrigin origin = origin_ == FeedOrigin::Reseed && sealed_ > 0 ? FeedOrigin::Seed : origin_;
  current_.assign({static_cast<char>(kFeedVersion), static_cast<char>(origin), 0, 0, 0, 0});
}

void FeedEncoder::seal() {
  if (count_ == 0) {
    // A re-seed always has its first batch, entries or not.
    if (origin_ != FeedOrigin::Reseed || sealed_ > 0) return;
    start();
  }
  ++sealed_;
  for (unsigned i = 0; i < 4; ++i) current_[2 + i] = static_cast<char>((count_ >> (8 * i)) & 0xff);
  if (sink_) sink_(std::move(current_));
  else payloads_.push_back(std::move(current_));
  current_.clear();
  count_ = 0;
}

std::vector<std::string> FeedEncoder::finish() {
  seal();
  return std::move(payloads_);
}

bool check_feed_payload(std::string_view payload, std::string* error) {
  if (payload.size() < kFeedHeaderSize) {
    *error = std::to_string(payload.size()) + "-byte payload, shorter than its 6-byte header";
    return false;
  }
  if (static_cast<std::uint8_t>(payload[0]) != kFeedVersion) {
    *error = "payload version " + std::to_string(static_cast<std::uint8_t>(payload[0])) + ", expected 1";
    return false;
  }
  const auto origin = static_cast<std::uint8_t>(payload[1]);
  if (origin < 1 || origin > 5) {
    *error = "payload origin " + std::to_string(origin) + ", expected 1 to 5";
    return false;
  }
  const std::uint32_t count = feed_entry_count(payload);
  if (payload.size() != kFeedHeaderSize + std::size_t{count} * kFeedEntrySize) {
    *error = std::to_string(payload.size()) + "-byte payload for " + std::to_string(count) + " entries; expected " +
             std::to_string(kFeedHeaderSize + std::size_t{count} * kFeedEntrySize);
    return false;
  }
  std::string_view last;
  for (std::uint32_t i = 0; i < count; ++i) {
    const std::string_view key = payload.substr(kFeedHeaderSize + i * kFeedEntrySize, kAggregateKeySize);
    std::optional<AggregateCell> cell = decode_aggregate_key(key);
    if (!cell || cell->kind == AggregateKind::Personal) {
      *error = "entry " + std::to_string(i) + " is not a cohort or community aggregate (key " + hex(key) + ")";
      return false;
    }
    if (i > 0 && !(last < key)) {
      *error = "entry " + std::to_string(i) + " (key " + hex(key) + ") is not above the entry before it";
      return false;
    }
    last = key;
  }
  return true;
}

void merge_feed_payloads(std::span<const std::string_view> payloads,
                         const std::function<void(std::string_view key, Units sum)>& fn) {
  // A min-heap of cursors, one a payload with entries left, by current key.
  struct Cursor {
    const char* entry;
    const char* end;
  };
  auto above = [](const Cursor& a, const Cursor& b) { return std::memcmp(a.entry, b.entry, kAggregateKeySize) > 0; };
  std::vector<Cursor> heap;
  heap.reserve(payloads.size());
  for (std::string_view p : payloads) {
    if (p.size() > kFeedHeaderSize) heap.push_back({p.data() + kFeedHeaderSize, p.data() + p.size()});
  }
  std::make_heap(heap.begin(), heap.end(), above);
  const char* key = nullptr;  // the cell being summed, and its sum
  UUnits sum = 0;
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), above);
    Cursor& c = heap.back();
    if (key != nullptr && std::memcmp(key, c.entry, kAggregateKeySize) != 0) {
      fn(std::string_view(key, kAggregateKeySize), static_cast<Units>(sum));
      sum = 0;
    }
    key = c.entry;
    sum += static_cast<UUnits>(get_units(c.entry + kAggregateKeySize));
    c.entry += kFeedEntrySize;
    if (c.entry == c.end) {
      heap.pop_back();
    } else {
      std::push_heap(heap.begin(), heap.end(), above);
    }
  }
  if (key != nullptr) fn(std::string_view(key, kAggregateKeySize), static_cast<Units>(sum));
}

bool decode_feed_payload(std::string_view payload, const std::function<void(const FeedEntry&)>& fn,
                         std::string* error) {
  if (!check_feed_payload(payload, error)) return false;
  const std::uint32_t count = feed_entry_count(payload);
  for (std::uint32_t i = 0; i < count; ++i) {
    const std::string_view entry = payload.substr(kFeedHeaderSize + i * kFeedEntrySize, kFeedEntrySize);
    const AggregateCell cell = *decode_aggregate_key(entry.substr(0, kAggregateKeySize));
    fn({cell.kind, cell.owner, cell.item, *decode_units(entry.substr(kAggregateKeySize))});
  }
  return true;
}

}  // namespace tidal
