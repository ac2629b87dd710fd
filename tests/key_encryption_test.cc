// The host's key-encryption key (Options::key_encryption_key; docs/FORMAT.md,
// "The key-encryption key"; docs/PURGE.md, "What an attacker holding the
// files can learn"): with one, a copy of the Db directory alone unwraps no
// live user's key; an open without it or with another is refused; a Db is
// given one in place, and rotating it keeps every record readable and
// leaves no value the old key wrapped.
#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "db/impl.h"
#include "erasure_scan.h"
#include "storage/sealed_ledger.h"
#include "storage/storage.h"
#include "test_util.h"

namespace tidal {
namespace {

using testing::open_db;
using testing::TempDir;

const std::string kKeyA(32, 'A');
const std::string kKeyB = [] {
  std::string k(32, '\0');
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<char>(0x80 + 3 * i);
  return k;
}();

Options with_key(std::optional<std::string> kek) {
  Options o;
  o.aggregate_write_period = std::chrono::hours(1);
  o.sync_writes = false;
  if (kek) o.key_encryption_key = [k = *kek]() -> Result<std::string> { return k; };
  return o;
}

// Users 1..n join community 77 and contribute to cohort 4; flushed.
void contribute(Db& db, std::uint64_t from, std::uint64_t n) {
  for (std::uint64_t u = from; u < from + n; ++u) {
    ASSERT_OK(db.join_community(u, 77));
    ASSERT_OK(db.signal_with_context({u, 1000 + u % 5, 1.5}, {{4}}));
  }
  ASSERT_OK(db.flush());
}

void expect_verified(Db& db) {
  Result<VerifyReport> v = db.verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
}

// Every bucket_keys value the Db holds now, and user u's wrapped key.
std::vector<std::string> bucket_values(Db& db) {
  Storage& storage = Db::Impl::storage_for_testing(db);
  std::vector<std::string> out;
  auto it = storage.iterator(storage.bucket_keys());
  for (it->SeekToFirst(); it->Valid(); it->Next()) out.push_back(it->value().ToString());
  return out;
}
std::string wrapped_key_of(Db& db, std::uint64_t u) {
  Storage& storage = Db::Impl::storage_for_testing(db);
  std::string wrapped;
  EXPECT_OK(storage.get(storage.keys(), encode_key_store_key(u), &wrapped));
  return wrapped;
}

// The bytes of every file of the Db directory (both engines).
std::vector<std::pair<std::string, std::string>> every_file(const std::string& path) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(path)) {
    if (e.is_regular_file()) out.emplace_back(e.path().string(), testing::read_file(e.path()));
  }
  return out;
}

// The files that hold one of `values` byte for byte.
std::vector<std::string> files_holding(const std::string& path, const std::vector<std::string>& values) {
  std::vector<std::string> found;
  for (const auto& [name, bytes] : every_file(path)) {
    for (const std::string& v : values) {
      if (bytes.find(v) != std::string::npos) {
        found.push_back(name);
        break;
      }
    }
  }
  return found;
}

// An attacker with the files and nothing else: every 32 bytes at every
// offset of every file of the users engine (where the key store is), as a
// bucket key of any generation up to 4, tried on `wrapped` (user u's
// wrapped key). True when one unwraps it.
bool some_file_unwraps(const std::string& path, std::uint64_t u, const std::string& wrapped) {
  const std::optional<std::uint32_t> generation = wrapped_key_generation(wrapped);
  EXPECT_TRUE(generation.has_value());
  for (const auto& e : std::filesystem::directory_iterator(path)) {
    if (!e.is_regular_file()) continue;
    const std::string bytes = testing::read_file(e.path());
    for (std::size_t at = 0; at + kUserKeySize <= bytes.size(); ++at) {
      std::string value(1, '\x01');
      put_u32_be(&value, *generation);
      value.append(bytes, at, kUserKeySize);
      const std::optional<BucketKey> candidate = BucketKey::decode(value);
      if (candidate && candidate->unwrap(u, wrapped)) return true;
    }
  }
  return false;
}

// Without a key-encryption key the directory's bucket keys unwrap a live
// user's key (the control); with one, neither the key store's records nor
// any 32 bytes anywhere in the users engine's files do, while the Db reads,
// verifies and purges as before.
TEST(KeyEncryption, WithAKeyNoFileOfTheDirectoryUnwrapsALiveUsersKey) {
  for (const bool kek : {false, true}) {
    SCOPED_TRACE(kek ? "with a key-encryption key" : "without one");
    TempDir dir;
    const std::string path = dir.sub("db");
    const std::uint64_t u = 7;
    auto db = open_db(path, with_key(kek ? std::optional<std::string>(kKeyA) : std::nullopt));
    contribute(*db, 1, 40);
    const std::string wrapped = wrapped_key_of(*db, u);
    Storage& storage = Db::Impl::storage_for_testing(*db);
    ASSERT_TRUE(storage.db(Storage::Engine::Users)
                    ->Flush(rocksdb::FlushOptions(), {storage.keys(), storage.bucket_keys()})
                    .ok());
    const testing::ErasureScan held = testing::scan_files_settled(path, u);
    EXPECT_EQ(held.user_keys.empty(), kek) << held.summary();
    expect_verified(*db);
    ASSERT_OK(db->close());
    EXPECT_EQ(some_file_unwraps(path, u, wrapped), !kek);
    db = open_db(path, with_key(kek ? std::optional<std::string>(kKeyA) : std::nullopt));
    expect_verified(*db);
    ASSERT_OK(db->leave_community_layer(u));
    Result<PurgeReceipt> r = db->purge_community_contributions(u);
    ASSERT_OK(r);
    EXPECT_EQ(r->cohort_weight_removed, 1.5);
    EXPECT_TRUE(r->erasure_complete);
    expect_verified(*db);
  }
}

TEST(KeyEncryption, AnOpenWithoutTheKeyOrWithAnotherIsRefusedAndChangesNothing) {
  TempDir dir;
  const std::string path = dir.sub("db");
  std::vector<std::string> before;
  {
    auto db = open_db(path, with_key(kKeyA));
    contribute(*db, 1, 20);
    before = bucket_values(*db);
    ASSERT_OK(db->close());
  }
  const auto refused = [&](const Options& o, const std::string& says) {
    Result<std::unique_ptr<Db>> db = Db::open(path, o);
    ASSERT_FALSE(db.ok());
    EXPECT_EQ(db.status().code(), StatusCode::InvalidArgument) << db.status().to_string();
    EXPECT_NE(db.status().message().find(says), std::string::npos) << db.status().message();
  };
  refused(with_key(std::nullopt), "Options::key_encryption_key is missing");
  refused(with_key(kKeyB), "is not the one that wraps its bucket keys");
  refused(with_key(std::string(31, 'A')), "32 bytes");
  Options read_only = with_key(std::nullopt);
  read_only.read_only = true;
  refused(read_only, "Options::key_encryption_key is missing");
  Options failing = with_key(std::nullopt);
  failing.key_encryption_key = []() -> Result<std::string> { return Status::IOError("the KMS is down"); };
  {
    Result<std::unique_ptr<Db>> db = Db::open(path, failing);
    ASSERT_FALSE(db.ok());
    EXPECT_EQ(db.status().code(), StatusCode::IOError);
    EXPECT_NE(db.status().message().find("the KMS is down"), std::string::npos) << db.status().message();
  }
  // Nothing changed: the same bucket keys, wrapped the same way, and the
  // same key opens the Db.
  auto db = open_db(path, with_key(kKeyA));
  EXPECT_EQ(bucket_values(*db), before);
  expect_verified(*db);
}

// A Db without a key is given one by an open (its bucket keys wrapped in
// place, none left in clear in any file), and rotating the key keeps every
// record readable, leaves no value the old key wrapped in any file, and
// makes the old key useless for an open.
TEST(KeyEncryption, ADbIsGivenAKeyInPlaceAndRotationKeepsEveryRecordReadable) {
  TempDir dir;
  const std::string path = dir.sub("db");
  std::vector<std::string> clear;
  {
    auto db = open_db(path, with_key(std::nullopt));
    contribute(*db, 1, 30);
    clear = bucket_values(*db);
    ASSERT_FALSE(clear.empty());
    ASSERT_OK(db->close());
  }
  ASSERT_FALSE(files_holding(path, clear).empty()) << "the search finds no bucket key even in clear";
  {
    Options read_only = with_key(kKeyA);
    read_only.read_only = true;
    Result<std::unique_ptr<Db>> db = Db::open(path, read_only);
    ASSERT_FALSE(db.ok());
    EXPECT_EQ(db.status().code(), StatusCode::InvalidArgument);
  }
  auto db = open_db(path, with_key(kKeyA));
  for (const std::string& f : files_holding(path, clear)) ADD_FAILURE() << f << " holds a bucket key in clear";
  for (const std::string& v : bucket_values(*db)) EXPECT_EQ(v.size(), kWrappedBucketValueSize);
  expect_verified(*db);
  contribute(*db, 31, 10);
  const std::vector<std::string> under_a = bucket_values(*db);
  ASSERT_FALSE(files_holding(path, under_a).empty()) << "the search finds no value even before the rotation";
  EXPECT_EQ(db->rotate_key_encryption_key(std::string(5, 'x')).code(), StatusCode::InvalidArgument);
  ASSERT_OK(db->rotate_key_encryption_key(kKeyB));
  for (const std::string& f : files_holding(path, under_a)) ADD_FAILURE() << f << " holds a value the old key wrapped";
  expect_verified(*db);
  contribute(*db, 41, 5);
  ASSERT_OK(db->close());
  {
    Result<std::unique_ptr<Db>> old = Db::open(path, with_key(kKeyA));
    ASSERT_FALSE(old.ok());
    EXPECT_EQ(old.status().code(), StatusCode::InvalidArgument);
  }
  db = open_db(path, with_key(kKeyB));
  expect_verified(*db);
  for (std::uint64_t u : {3ULL, 35ULL, 43ULL}) {
    ASSERT_OK(db->leave_community_layer(u));
    Result<PurgeReceipt> r = db->purge_community_contributions(u);
    ASSERT_OK(r);
    EXPECT_EQ(r->cohort_weight_removed, 1.5) << "user " << u;
    EXPECT_TRUE(r->erasure_complete);
  }
  expect_verified(*db);
}

}  // namespace
}  // namespace tidal
