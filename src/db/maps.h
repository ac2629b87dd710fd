// The in-memory maps of the community layer, shared by Db::Impl and the
// start-up scans that fill them (db/state_rebuild.h).
#ifndef TIDAL_DB_MAPS_H_
#define TIDAL_DB_MAPS_H_

#include <cstdint>
#include <vector>

#include "db/cuckoo.h"

#include "tidal/db.h"

namespace tidal {

using CommunitiesMap = libcuckoo::cuckoohash_map<std::uint64_t, std::vector<std::uint64_t>>;  // sorted ids
using LeaveStatusMap = libcuckoo::cuckoohash_map<std::uint64_t, CommunityMembership>;      // absent = Active

}  // namespace tidal

#endif  // TIDAL_DB_MAPS_H_
