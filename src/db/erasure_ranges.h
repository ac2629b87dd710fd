// The key ranges a purge's physical erasure force-compacts (db/purge.cc).
//
// A forced compaction rewrites every SST file its range overlaps. A bulk
// purge of users spread over the ledger (a few in each file) once compacted
// each user's range alone, which rewrote each file once per purged user in
// it: 5,000 users at 1M users made 5,000 compactions. JoinRanges joins the
// ranges of neighbouring users into one compaction when no ledger file lies
// wholly between them, up to a number of files a compaction: each file is
// then rewritten once, and a file that holds none of the users is not
// pulled in by the joining. The ranges only grow, so what the erasure
// covers does not depend on the files' layout, which compactions may change
// between the listing and the compaction.
#ifndef TIDAL_DB_ERASURE_RANGES_H_
#define TIDAL_DB_ERASURE_RANGES_H_

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include <rocksdb/db.h>

namespace tidal {

using KeyRange = std::pair<std::string, std::string>;  // [begin, end)

// A column family's files at levels 1 and up, by level: each level's files
// are sorted and disjoint, so both their smallest and their largest keys
// are in order. (Level-0 files overlap any range and are compacted either
// way: they are left out.)
struct LevelFiles {
  std::vector<std::string> smallest, largest;  // user keys, both inclusive
};
std::vector<LevelFiles> ListLevelFiles(rocksdb::DB* db, const std::string& family);

// Joins neighbouring ranges of `ranges` (sorted, disjoint) when no file of
// `levels` lies wholly between them and the joined range overlaps at most
// `max_files` of them.
std::vector<KeyRange> JoinRanges(const std::vector<KeyRange>& ranges, const std::vector<LevelFiles>& levels,
                                 std::size_t max_files);

}  // namespace tidal

#endif  // TIDAL_DB_ERASURE_RANGES_H_
