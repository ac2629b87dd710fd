#include "db/erasure_ranges.h"

#include <algorithm>
#include <cstdint>

namespace tidal {

std::vector<LevelFiles> ListLevelFiles(rocksdb::DB* db, const std::string& family) {
  std::vector<rocksdb::LiveFileMetaData> files;
  db->GetLiveFilesMetaData(&files);
  std::sort(files.begin(), files.end(), [](const auto& a, const auto& b) { return a.smallestkey < b.smallestkey; });
  std::vector<LevelFiles> levels;
  for (const rocksdb::LiveFileMetaData& f : files) {
    if (f.column_family_name != family || f.level <= 0) continue;
    const auto level = static_cast<std::size_t>(f.level);
    if (levels.size() <= level) levels.resize(level + 1);
    levels[level].smallest.push_back(f.smallestkey);
    levels[level].largest.push_back(f.largestkey);
  }
  return levels;
}

std::vector<KeyRange> JoinRanges(const std::vector<KeyRange>& ranges, const std::vector<LevelFiles>& levels,
                                 std::size_t max_files) {
  // A file in [end, begin): it starts at or after `end` and ends before
  // `begin`; in each level, the first file that starts at or after `end`
  // ends first.
  const auto file_between = [&](const std::string& end, const std::string& begin) {
    for (const LevelFiles& l : levels) {
      const auto it = std::lower_bound(l.smallest.begin(), l.smallest.end(), end);
      if (it != l.smallest.end() && l.largest[static_cast<std::size_t>(it - l.smallest.begin())] < begin) return true;
    }
    return false;
  };
  // The files overlapping [begin, end): per level, those that start before
  // `end` less those that end before `begin`.
  const auto files_in = [&](const std::string& begin, const std::string& end) {
    std::ptrdiff_t n = 0;
    for (const LevelFiles& l : levels) {
      n += (std::lower_bound(l.smallest.begin(), l.smallest.end(), end) - l.smallest.begin()) -
           (std::lower_bound(l.largest.begin(), l.largest.end(), begin) - l.largest.begin());
    }
    return static_cast<std::size_t>(n);
  };
  std::vector<KeyRange> out;
  for (const KeyRange& r : ranges) {
    if (!out.empty() && !file_between(out.back().second, r.first) && files_in(out.back().first, r.second) <= max_files) {
      out.back().second = r.second;
    } else {
      out.push_back(r);
    }
  }
  return out;
}

}  // namespace tidal
