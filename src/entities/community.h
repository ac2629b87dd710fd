// Byte codecs of the community-layer records (docs/FORMAT.md).
#ifndef TIDAL_ENTITIES_COMMUNITY_H_
#define TIDAL_ENTITIES_COMMUNITY_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>

#include "tidal/db.h"

namespace tidal {

inline constexpr std::size_t kMembershipValueSize = 9;

// [status: 1 byte, 0 Active / 1 Left][left_at_ns: 8 bytes LE, 0 = none].
std::array<char, kMembershipValueSize> serialize_membership(const CommunityMembership& m);
// Empty optional for any length but 9, a status byte other than 0 or 1, and
// Left with left_at_ns 0.
std::optional<CommunityMembership> deserialize_membership(std::uint64_t user_id, std::string_view bytes);

// 0x12 history value: one byte, the status entered at the key's at_ns.
char serialize_history_status(MembershipStatus status);
// Empty optional unless exactly one byte of value 0 or 1.
std::optional<MembershipStatus> deserialize_history_status(std::string_view bytes);

}  // namespace tidal

#endif  // TIDAL_ENTITIES_COMMUNITY_H_
