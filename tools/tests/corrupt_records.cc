// Test helper for the tidalctl CLI tests: writes undecodable records into a
// closed tidal Db with RocksDB directly (the only program here that goes
// around the public API, as tests may to corrupt stored bytes). Keys follow
// the format of docs/FORMAT.md: [user_id 8 bytes BE][tag][suffix] in the
// "users" column family; the leave record's mirror is [tag][user_id] in "by_tag".
//
//   corrupt_records PATH history   user 7: a 0x12 history entry with status byte 7
//   corrupt_records PATH leave     user 8: a 0x11 leave record with status byte 2
#include <rocksdb/db.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace {

std::string be64(std::uint64_t v) {
  std::string out;
  for (int shift = 56; shift >= 0; shift -= 8) out.push_back(static_cast<char>((v >> shift) & 0xff));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string what = argc == 3 ? argv[2] : "";
  if (what != "history" && what != "leave") {
    std::fprintf(stderr, "usage: corrupt_records PATH history|leave\n");
    return 2;
  }
  rocksdb::Options options;
  std::vector<std::string> names;
  rocksdb::Status s = rocksdb::DB::ListColumnFamilies(options, argv[1], &names);
  std::vector<rocksdb::ColumnFamilyDescriptor> descriptors;
  for (const std::string& n : names) descriptors.emplace_back(n, rocksdb::ColumnFamilyOptions());
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  if (s.ok()) s = rocksdb::DB::Open(options, argv[1], descriptors, &handles, &raw);
  if (!s.ok()) {
    std::fprintf(stderr, "corrupt_records: %s\n", s.ToString().c_str());
    return 1;
  }
  std::unique_ptr<rocksdb::DB> db(raw);
  rocksdb::ColumnFamilyHandle* users = nullptr;
  rocksdb::ColumnFamilyHandle* by_tag = nullptr;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i] == "users") users = handles[i];
    if (names[i] == "by_tag") by_tag = handles[i];
  }
  if (users == nullptr || by_tag == nullptr) {
    std::fprintf(stderr, "corrupt_records: not a tidal Db (no users/by_tag column family)\n");
    return 1;
  }
  const std::string bad_leave = std::string("\x02", 1) + std::string(8, '\0');
  rocksdb::WriteOptions wo;
  wo.sync = true;
  if (what == "history") {
    s = db->Put(wo, users, be64(7) + '\x12' + be64(12345), std::string("\x07", 1));
  } else {
    s = db->Put(wo, users, be64(8) + '\x11', bad_leave);
    if (s.ok()) s = db->Put(wo, by_tag, std::string("\x11", 1) + be64(8), bad_leave);
  }
  if (s.ok()) s = db->Flush(rocksdb::FlushOptions(), handles);
  for (auto* h : handles) (void)db->DestroyColumnFamilyHandle(h);
  if (s.ok()) s = db->Close();
  if (!s.ok()) {
    std::fprintf(stderr, "corrupt_records: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
