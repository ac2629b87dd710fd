#include "entities/community.h"

#include <string>

#include "storage/format.h"

namespace tidal {

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

}  // namespace tidal
