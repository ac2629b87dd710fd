// Start-up scans: the in-memory state rebuilt from the stored records.
//
// Records of the indexed tags (community membership 0x01, community leave
// 0x11) are also kept in the by_tag column family, keyed tag-first, in the
// same WriteBatch as the users record. Start-up reads only that index, so its
// cost grows with the number of such records, not with the users partition.
// A Db without a complete index (meta key "index_version") is scanned in full
// once and backfilled; a read-only open scans in full without writing.
#ifndef TIDAL_DB_STATE_REBUILD_H_
#define TIDAL_DB_STATE_REBUILD_H_

#include <cstdint>
#include <functional>
#include <string_view>

#include "db/impl.h"
#include "storage/format.h"
#include "storage/storage.h"

namespace tidal {

// Backfills the index from a full scan of the users partition when the Db has
// none yet (no-op when complete or read-only).
Status ensure_index(Storage& storage);

// Calls fn(user_id, suffix, value) for every users record with `tag`, in user
// order, through the index when it is complete; stops at the first non-OK
// Status that fn returns, and returns it.
Status scan_tag(const Storage& storage, Tag tag,
                const std::function<Status(std::uint64_t, std::string_view, std::string_view)>& fn);

Status rebuild_community_memberships(const Storage& storage, CommunitiesMap* communities);

struct LeaveRebuildResult {
  std::uint64_t corrupt_treated_as_left = 0;
  std::uint64_t max_timestamp = 0;  // the largest left_at_ns seen
};
// Restores every 0x11 record into `status` and closes the gate for every Left
// user. An undecodable record fails with Corruption naming the user, or under
// TreatAsLeft gates the user and counts it.
Status rebuild_community_leave_status(const Storage& storage, CorruptRecordPolicy policy, LeaveStatusMap* status,
                                      LeaveGate* gate, LeaveRebuildResult* result);

}  // namespace tidal

#endif  // TIDAL_DB_STATE_REBUILD_H_
