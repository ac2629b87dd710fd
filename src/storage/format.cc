#include "storage/format.h"

namespace tidal {

// One append of 8 bytes, not 8 push_backs (which the writer's batches,
// and the change feed's payloads, spent a measurable share of their time on).
void put_u64_be(std::string* out, std::uint64_t v) {
  char bytes[8];
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((v >> (56 - 8 * i)) & 0xff);
  out->append(bytes, 8);
}

void put_u32_be(std::string* out, std::uint32_t v) {
  char bytes[4];
  for (int i = 0; i < 4; ++i) bytes[i] = static_cast<char>((v >> (24 - 8 * i)) & 0xff);
  out->append(bytes, 4);
}

std::uint32_t get_u32_be(const char* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = v << 8 | static_cast<unsigned char>(p[i]);
  return v;
}

void put_u64_le(std::string* out, std::uint64_t v) {
  char bytes[8];
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  out->append(bytes, 8);
}

std::uint64_t get_u64_be(const char* p) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

std::uint64_t get_u64_le(const char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

std::string encode_key(EntityId id, Tag tag, std::string_view suffix) {
  std::string key = encode_key_prefix(id, tag);
  key.append(suffix);
  return key;
}

std::string encode_key_prefix(EntityId id, Tag tag) {
  std::string key;
  key.reserve(9 + 8);
  put_u64_be(&key, id.value);
  key.push_back(static_cast<char>(tag));
  return key;
}

std::optional<DecodedKey> decode_key(std::string_view key) {
  if (key.size() < 9) return std::nullopt;
  return DecodedKey{get_u64_be(key.data()), static_cast<std::uint8_t>(key[8]), key.substr(9)};
}

std::string encode_index_key(EntityId id, Tag tag, std::string_view suffix) {
  std::string key;
  key.reserve(9 + suffix.size());
  key.push_back(static_cast<char>(tag));
  put_u64_be(&key, id.value);
  key.append(suffix);
  return key;
}

std::optional<DecodedKey> decode_index_key(std::string_view key) {
  if (key.size() < 9) return std::nullopt;
  return DecodedKey{get_u64_be(key.data() + 1), static_cast<std::uint8_t>(key[0]), key.substr(9)};
}

std::string hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) {
    auto b = static_cast<unsigned char>(c);
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 0xf]);
  }
  return out;
}

// ---- users records of the community layer ----

std::array<char, kMembershipValueSize> serialize_membership(const CommunityMembership& m) {
  std::array<char, kMembershipValueSize> out{};
  out[0] = static_cast<char>(m.status);
  const std::uint64_t at = m.left_at_ns.value_or(0);
  for (std::size_t i = 0; i < 8; ++i) out[1 + i] = static_cast<char>((at >> (8 * i)) & 0xff);
  return out;
}

std::optional<CommunityMembership> deserialize_membership(std::uint64_t user_id, std::string_view bytes) {
  if (bytes.size() != kMembershipValueSize) return std::nullopt;
  const auto status_byte = static_cast<unsigned char>(bytes[0]);
  if (status_byte > 1) return std::nullopt;
  const std::uint64_t at = get_u64_le(bytes.data() + 1);
  CommunityMembership m;
  m.user_id = user_id;
  m.status = static_cast<MembershipStatus>(status_byte);
  if (m.status == MembershipStatus::Left && at == 0) return std::nullopt;
  if (at != 0) m.left_at_ns = at;
  return m;
}

char serialize_history_status(MembershipStatus status) { return static_cast<char>(status); }

std::optional<MembershipStatus> deserialize_history_status(std::string_view bytes) {
  if (bytes.size() != 1) return std::nullopt;
  const auto b = static_cast<unsigned char>(bytes[0]);
  if (b > 1) return std::nullopt;
  return static_cast<MembershipStatus>(b);
}


// ---- meta records ----

std::string erasure_pending_key(std::uint64_t user_id) {
  std::string key(kErasurePendingPrefix);
  put_u64_be(&key, user_id);
  return key;
}

std::string encode_erasure_mark(const ErasureMark& mark) {
  std::string value;
  put_u64_be(&value, mark.since);
  return value + mark.key_tag;
}

std::optional<ErasureMark> decode_erasure_mark(std::string_view value) {
  if (value.size() != 8 && value.size() != 24) return std::nullopt;
  return ErasureMark{get_u64_be(value.data()), std::string(value.substr(8))};
}

std::string clock_floor_stripe_key(std::uint64_t stripe) {
  std::string key = kClockFloorPrefix;
  put_u64_be(&key, stripe);
  return key;
}

std::string serialize_clock_floor(std::uint64_t ts) {
  std::string value;
  put_u64_le(&value, ts);
  return value;
}

std::optional<std::uint64_t> deserialize_clock_floor(std::string_view bytes) {
  if (bytes.size() != kClockFloorValueSize) return std::nullopt;
  return get_u64_le(bytes.data());
}

}  // namespace tidal
