// Fuzzes Db::open over arbitrary 0x11 (CommunityLeave) values (G6).
//
// Input: [flags][len0][bytes0][len1][bytes1]... Each length-prefixed chunk
// becomes the 0x11 value of one user (up to 4), written with raw RocksDB into
// the users column family and its by_tag index copy. flags bit 0 drops the
// index marker (so open backfills the index from users); bit 1 opens
// read-only (the full users scan). The Db is then opened under both
// CorruptRecordPolicy values and the target aborts unless, for each user:
//   - a value that decodes is restored exactly (status and left_at_ns), and
//     a Left user is gated;
//   - a malformed value fails the open with Corruption naming the user (Fail)
//     or reads as Left and is gated (TreatAsLeft); never Active.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <rocksdb/db.h>
#include <rocksdb/write_batch.h>

#include "db/impl.h"
#include "storage/format.h"
#include "tidal/db.h"

namespace {

[[noreturn]] void violation(const std::string& what) {
  std::fprintf(stderr, "G6 violation: %s\n", what.c_str());
  std::abort();
}

// Scratch directories on tmpfs when there is one ($TIDAL_FUZZ_DIR overrides):
// RocksDB fsyncs on every open, which a disk makes slow.
std::string scratch_base() {
  if (const char* d = std::getenv("TIDAL_FUZZ_DIR"); d != nullptr && *d != '\0') return d;
  if (std::filesystem::is_directory("/dev/shm")) return "/dev/shm";
  const char* tmp = std::getenv("TMPDIR");
  return tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
}

const std::string& db_path() {
  static const std::string path = scratch_base() + "/tidal-fuzz-open-" + std::to_string(::getpid());
  return path;
}

// A fresh Db with its column families and index marker, closed: a copy of a
// template created once.
void create_db(const std::string& path) {
  static const std::string templ = [] {
    const std::string t = db_path() + "-template";
    std::filesystem::remove_all(t);
    auto db = tidal::Db::open(t);
    if (!db.ok()) violation("cannot create the Db: " + db.status().to_string());
    std::atexit([] { std::filesystem::remove_all(db_path() + "-template"); });
    return t;
  }();
  std::filesystem::remove_all(path);
  std::filesystem::copy(templ, path, std::filesystem::copy_options::recursive);
  std::filesystem::remove(path + "/LOCK");
}

struct Record {
  std::uint64_t user;
  std::string value;
};

void write_raw(const std::string& path, const std::vector<Record>& records, bool drop_marker) {
  rocksdb::Options o;
  std::vector<rocksdb::ColumnFamilyDescriptor> d;
  // The users engine (the Db directory); the state engine is in state/.
  // Format 4's key store (wrapped_keys, bucket_keys) is in the users engine too.
  for (const char* n : {"default", "users", "by_tag", "wrapped_keys", "bucket_keys"}) {
    d.emplace_back(n, rocksdb::ColumnFamilyOptions());
  }
  std::vector<rocksdb::ColumnFamilyHandle*> cfs;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(o, path, d, &cfs, &raw);
  if (!s.ok()) violation("raw open: " + s.ToString());
  rocksdb::WriteBatch batch;
  for (const Record& r : records) {
    const std::string k = tidal::encode_key(tidal::EntityId(r.user), tidal::Tag::CommunityLeave);
    const std::string ik = tidal::encode_index_key(tidal::EntityId(r.user), tidal::Tag::CommunityLeave);
    batch.Put(cfs[1], k, r.value);
    batch.Put(cfs[2], ik, r.value);
  }
  if (drop_marker) batch.Delete(cfs[0], tidal::kIndexVersionKey);
  if (!raw->Write(rocksdb::WriteOptions(), &batch).ok()) violation("raw write");
  for (auto* h : cfs) (void)raw->DestroyColumnFamilyHandle(h);
  (void)raw->Close();
  delete raw;
}

void check_open(const std::string& path, const std::vector<Record>& records, tidal::CorruptRecordPolicy policy,
                bool read_only) {
  tidal::Options options;
  options.corrupt_record_policy = policy;
  options.read_only = read_only;
  auto db = tidal::Db::open(path, options);
  bool any_bad = false;
  for (const Record& r : records) any_bad |= !tidal::deserialize_membership(r.user, r.value).has_value();
  if (!db.ok()) {
    if (policy == tidal::CorruptRecordPolicy::Fail && any_bad && db.status().code() == tidal::StatusCode::Corruption) {
      bool named = false;
      for (const Record& r : records) {
        if (!tidal::deserialize_membership(r.user, r.value) &&
            db.status().message().find("user " + std::to_string(r.user)) != std::string::npos) {
          named = true;
        }
      }
      if (!named) violation("Corruption does not name a user with a bad record: " + db.status().to_string());
      return;
    }
    violation("open failed: " + db.status().to_string());
  }
  if (policy == tidal::CorruptRecordPolicy::Fail && any_bad) violation("open accepted a malformed 0x11 record");
  std::uint64_t want_left = 0;
  for (const Record& r : records) {
    auto st = (*db)->community_layer_status(r.user);
    if (!st.ok()) violation("status: " + st.status().to_string());
    const auto decoded = tidal::deserialize_membership(r.user, r.value);
    const tidal::MembershipStatus want = decoded ? decoded->status : tidal::MembershipStatus::Left;
    if (st->status != want) violation("user " + std::to_string(r.user) + " reads " + (st->status == tidal::MembershipStatus::Left ? "Left" : "Active"));
    if (decoded && st->left_at_ns != decoded->left_at_ns) violation("left_at_ns differs");
    if (want == tidal::MembershipStatus::Left) ++want_left;
    if (read_only) continue;  // a read-only Db takes no signals; the gate count is checked below
    auto out = (*db)->signal_with_context({r.user, 1, 1.0}, tidal::SignalContext{{5}});
    if (!out.ok()) violation("signal: " + out.status().to_string());
    if (out->gated != (want == tidal::MembershipStatus::Left)) violation("gate of user " + std::to_string(r.user));
  }
  if ((*db)->stats().users_left != want_left) violation("gated users: " + std::to_string((*db)->stats().users_left));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t flags = data[0];
  std::vector<Record> records;
  std::size_t i = 1;
  while (i < size && records.size() < 4) {
    const std::size_t len = std::min<std::size_t>(data[i], size - i - 1);
    records.push_back({100 + records.size() * 7, std::string(reinterpret_cast<const char*>(data + i + 1), len)});
    i += 1 + len;
  }
  const std::string& path = db_path();
  create_db(path);
  write_raw(path, records, (flags & 1) != 0);
  const bool read_only = (flags & 2) != 0;
  check_open(path, records, tidal::CorruptRecordPolicy::Fail, read_only);
  check_open(path, records, tidal::CorruptRecordPolicy::TreatAsLeft, read_only);
  std::filesystem::remove_all(path);
  return 0;
}
