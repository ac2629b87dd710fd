#include "storage/journal_format.h"

#include <cstdint>
#include <limits>

#include "storage/format.h"

namespace tidal {

std::string encode_journal_key(std::uint64_t seq) {
  std::string out(kJournalEntryPrefix);
  put_u64_be(&out, seq);
  return out;
}

std::optional<std::uint64_t> decode_journal_key(std::string_view key) {
  const std::string_view prefix(kJournalEntryPrefix);
  if (key.size() != prefix.size() + 8 || !key.starts_with(prefix)) return std::nullopt;
  return get_u64_be(key.data() + prefix.size());
}

std::string encode_journal_payload(const JournalRecord& r) {
  std::string out;
  out.reserve(kJournalPayloadSize);
  out.push_back(static_cast<char>(kJournalVersion));
  out.push_back(static_cast<char>(r.kind));
  put_u64_le(&out, r.user_id);
  put_u64_le(&out, r.at_ns);
  put_u64_le(&out, r.left_at_ns);
  return out;
}

std::optional<JournalRecord> decode_journal_payload(std::string_view payload, std::string* error) {
  const auto fail = [&](std::string why) -> std::optional<JournalRecord> {
    if (error) *error = std::move(why);
    return std::nullopt;
  };
  if (payload.size() != kJournalPayloadSize) {
    return fail("a journal payload has " + std::to_string(payload.size()) + " bytes; expected " +
                std::to_string(kJournalPayloadSize));
  }
  if (static_cast<std::uint8_t>(payload[0]) != kJournalVersion) {
    return fail("journal payload version " + std::to_string(static_cast<std::uint8_t>(payload[0])) +
                "; this version reads version 1");
  }
  const auto kind = static_cast<std::uint8_t>(payload[1]);
  if (kind < 1 || kind > 3) return fail("journal payload kind " + std::to_string(kind) + "; expected 1, 2 or 3");
  JournalRecord r{static_cast<JournalKind>(kind), get_u64_le(payload.data() + 2), get_u64_le(payload.data() + 10),
                  get_u64_le(payload.data() + 18)};
  if (r.at_ns == 0) return fail("journal payload of user " + std::to_string(r.user_id) + " has at_ns 0");
  // No Db clock gives a time past INT64_MAX ns (2262-04-11).
  constexpr std::uint64_t kLastTime = std::numeric_limits<std::int64_t>::max();
  if (r.at_ns > kLastTime || r.left_at_ns > kLastTime) {
    return fail("journal payload of user " + std::to_string(r.user_id) + " has a time past " +
                std::to_string(kLastTime) + " ns (at_ns " + std::to_string(r.at_ns) + ", left_at_ns " +
                std::to_string(r.left_at_ns) + ")");
  }
  if (r.kind == JournalKind::Leave && r.left_at_ns != r.at_ns) {
    return fail("journal leave of user " + std::to_string(r.user_id) + " has left_at_ns " +
                std::to_string(r.left_at_ns) + " other than its at_ns " + std::to_string(r.at_ns));
  }
  return r;
}

std::string encode_journal_purge_key(std::uint64_t user_id, std::uint64_t purged_at_ns) {
  std::string out(kJournalPurgePrefix);
  put_u64_be(&out, user_id);
  put_u64_be(&out, purged_at_ns);
  return out;
}

std::string encode_journal_purge_value(std::uint64_t seq, std::uint64_t left_at_ns) {
  std::string out;
  put_u64_be(&out, seq);
  put_u64_be(&out, left_at_ns);
  return out;
}

std::optional<JournalPurgeMark> decode_journal_purge(std::string_view key, std::string_view value) {
  const std::string_view prefix(kJournalPurgePrefix);
  if (key.size() != prefix.size() + 16 || !key.starts_with(prefix) || value.size() != 16) return std::nullopt;
  return JournalPurgeMark{get_u64_be(key.data() + prefix.size()), get_u64_be(key.data() + prefix.size() + 8),
                          get_u64_be(value.data()), get_u64_be(value.data() + 8)};
}

}  // namespace tidal
