// Start-up scans: the in-memory state rebuilt from the stored records, read
// through the by_tag index when it is complete (storage/index.h).
#ifndef TIDAL_DB_STATE_REBUILD_H_
#define TIDAL_DB_STATE_REBUILD_H_

#include <cstdint>

#include "db/leave_gate.h"
#include "db/maps.h"
#include "storage/storage.h"
#include "tidal/db.h"

namespace tidal {

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
