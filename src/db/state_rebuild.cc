#include "db/state_rebuild.h"

#include <algorithm>
#include <string>

#include "storage/format.h"
#include "storage/index.h"

namespace tidal {

Status rebuild_community_memberships(const Storage& storage, CommunitiesMap* communities) {
  return scan_tag(storage, Tag::CommunityMember,
                  [&](std::uint64_t user, std::string_view suffix, std::string_view) -> Status {
                    if (suffix.size() != 8) {
                      return Status::Corruption("community membership record of user " + std::to_string(user) +
                                                " has a " + std::to_string(suffix.size()) +
                                                "-byte suffix; expected an 8-byte community id");
                    }
                    const std::uint64_t community = get_u64_be(suffix.data());
                    // Records arrive in key order, so each user's list stays sorted.
                    communities->upsert(
                        user, [&](std::vector<std::uint64_t>& ids) { ids.push_back(community); },
                        std::vector<std::uint64_t>{community});
                    return Status::OK();
                  });
}

Status rebuild_community_leave_status(const Storage& storage, CorruptRecordPolicy policy, LeaveStatusMap* status,
                                      LeaveGate* gate, LeaveRebuildResult* result) {
  // Size the map and the gate once instead of growing them record by record.
  const std::uint64_t estimate = storage.estimate_keys(storage.by_tag());
  status->reserve(estimate);
  gate->reserve(estimate);
  return scan_tag(storage, Tag::CommunityLeave,
                  [&](std::uint64_t user, std::string_view suffix, std::string_view value) -> Status {
                    // A 0x11 key has no suffix: one that does is not a record of
                    // this format and must not override the user's real one.
                    std::optional<CommunityMembership> m =
                        suffix.empty() ? deserialize_membership(user, value) : std::nullopt;
                    if (!m) {
                      if (policy == CorruptRecordPolicy::Fail) {
                        return Status::Corruption("community leave record (0x11) of user " + std::to_string(user) +
                                                  " does not decode: " + (suffix.empty() ? "" : "key suffix " + hex(suffix) + ", ") +
                                                  "value " + hex(value) + " (" +
                                                  std::to_string(value.size()) +
                                                  " bytes); open with CorruptRecordPolicy::TreatAsLeft to gate the "
                                                  "user instead");
                      }
                      m = CommunityMembership{user, MembershipStatus::Left, std::nullopt};
                      ++result->corrupt_treated_as_left;
                    }
                    if (m->left_at_ns) result->max_timestamp = std::max(result->max_timestamp, *m->left_at_ns);
                    if (m->status == MembershipStatus::Left) gate->close(user);
                    status->insert_or_assign(user, *m);
                    return Status::OK();
                  });
}

}  // namespace tidal
