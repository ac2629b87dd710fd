// Format 4: the ledger sealed per user (storage/sealed_ledger.h,
// docs/PURGE.md "What erased means"): the sealing itself, what the Db's
// files hold before and after a purge, a rejoin's new key, and the upgrade
// of a format-3 Db, whose unsealed ledger is carried and still purged
// exactly.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/kdf.h>
#include <rocksdb/db.h>
#include <rocksdb/write_batch.h>

#include "crash_child.h"
#include "db/impl.h"
#include "db/ledger_key_table.h"
#include "erasure_scan.h"
#include "raw_db.h"
#include "storage/format.h"
#include "storage/sealed_ledger.h"
#include "storage/state_format.h"
#include "test_util.h"

namespace tidal {
namespace {

using testing::open_db;
using testing::RawDb;
using testing::scan_files;
using testing::stored_format;
using testing::TempDir;
using testing::value_of;

Options manual_writes() {
  Options options;
  options.aggregate_write_period = std::chrono::hours(1);
  return options;
}

UserKey new_key() {
  Result<UserKey> k = UserKey::generate();
  EXPECT_TRUE(k.ok()) << k.status().to_string();
  return *k;
}

TEST(SealedLedger, ARecordOpensOnlyWithItsKeyUnderItsNameUnchanged) {
  const UserKey key = new_key();
  const UserKey other = new_key();
  std::string plain;
  put_sealed_entry(&plain, {AggregateKind::Cohort, 7, 9, 1'500'000'000});
  put_sealed_entry(&plain, {AggregateKind::Community, 3, 9, -2});
  const std::string name = key.record_key(42);
  ASSERT_EQ(name.size(), kSealedLedgerKeySize);
  EXPECT_EQ(name.substr(8), key.pseudonym());
  EXPECT_EQ(sealed_ledger_epoch(name), 42u);
  EXPECT_EQ(sealed_ledger_pseudonym(name), key.pseudonym());
  // Write order: a later batch's record sorts after every earlier one's,
  // whoever's they are.
  for (int i = 0; i < 20; ++i) EXPECT_LT(new_key().record_key(41), new_key().record_key(42));
  const std::string index = key.index_key(42);
  EXPECT_EQ(index.substr(0, kPseudonymSize), key.pseudonym());
  EXPECT_EQ(sealed_index_epoch(index), 42u);
  EXPECT_EQ(sealed_record_of(index), name);
  std::string index_of_name;
  ASSERT_TRUE(sealed_index_key_of(name, &index_of_name));
  EXPECT_EQ(index_of_name, index);
  std::string sealed;
  ASSERT_OK(key.seal(name, plain, &sealed));
  EXPECT_EQ(sealed.size(), kSealVersionSize + kSealNonceSize + plain.size() + kSealTagSize);
  EXPECT_EQ(sealed.find(plain), std::string::npos) << "the entries are in clear";

  std::string out;
  ASSERT_TRUE(key.open(name, sealed, &out));
  EXPECT_EQ(out, plain);
  EXPECT_FALSE(other.open(name, sealed, &out)) << "opened with another user's key";
  EXPECT_TRUE(out.empty()) << "a refused open handed out bytes";
  EXPECT_FALSE(key.open(key.record_key(43), sealed, &out)) << "opened under another record's name";
  for (std::size_t i = 0; i < sealed.size(); ++i) {
    std::string changed = sealed;
    changed[i] = static_cast<char>(changed[i] ^ 0x01);
    EXPECT_FALSE(key.open(name, changed, &out)) << "byte " << i << " changed and the record still opened";
  }
  EXPECT_FALSE(key.open(name, sealed.substr(0, kSealVersionSize + kSealNonceSize + kSealTagSize - 1), &out));
  // Two seals of the same entries differ (a fresh nonce each).
  std::string again;
  ASSERT_OK(key.seal(name, plain, &again));
  EXPECT_NE(again, sealed);
}

// The sealed entries' compact encoding reads back exactly, at every
// extreme (ids of 64 bits, units of 127 bits and either sign), and refuses
// what is cut short or names another target.
TEST(SealedLedger, SealedEntriesReadBackExactlyAndRefuseWhatIsMalformed) {
  const Units max = static_cast<Units>(~UUnits{0} >> 1);
  const std::vector<LedgerEntry> entries = {
      {AggregateKind::Cohort, 0, 0, 0},
      {AggregateKind::Cohort, 7, 9, 1'500'000'000},
      {AggregateKind::Community, 3, 9, -2},
      {AggregateKind::Community, ~std::uint64_t{0}, ~std::uint64_t{0}, max},
      {AggregateKind::Community, 1ULL << 63, 127, -max - 1},
      {AggregateKind::Cohort, 128, 16384, -1},
  };
  std::string plain;
  for (const LedgerEntry& e : entries) put_sealed_entry(&plain, e);
  const std::optional<std::vector<LedgerEntry>> back = decode_sealed_entries(plain);
  ASSERT_TRUE(back.has_value());
  ASSERT_EQ(back->size(), entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i) {
    EXPECT_EQ((*back)[i].target, entries[i].target) << i;
    EXPECT_EQ((*back)[i].target_id, entries[i].target_id) << i;
    EXPECT_EQ((*back)[i].item, entries[i].item) << i;
    EXPECT_TRUE((*back)[i].units == entries[i].units) << i << ": " << units_to_string((*back)[i].units);
  }
  // The demo's kind of entry (ids below 2^14 and 2^21, ~1e9 units): 11 bytes, not 33.
  std::string small;
  put_sealed_entry(&small, {AggregateKind::Community, 999, 1'000'000, 1'000'000'000});
  EXPECT_EQ(small.size(), 11u);
  EXPECT_FALSE(decode_sealed_entries("").has_value());
  for (std::size_t cut = 1; cut < small.size(); ++cut) {
    EXPECT_FALSE(decode_sealed_entries(small.substr(0, cut)).has_value()) << "cut at " << cut;
  }
  std::string other = small;
  other[0] = 2;
  EXPECT_FALSE(decode_sealed_entries(other).has_value());
}

TEST(SealedLedger, KeysAreFreshAndStoredKeysDecodeToTheSamePseudonym) {
  std::set<std::string> pseudonyms;
  for (int i = 0; i < 1000; ++i) pseudonyms.insert(std::string(new_key().pseudonym()));
  EXPECT_EQ(pseudonyms.size(), 1000u);
  const UserKey key = new_key();
  const std::string stored(key.encode().view());
  ASSERT_EQ(stored.size(), kKeyStoreValueSize);
  const std::optional<UserKey> back = UserKey::decode(stored);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->pseudonym(), key.pseudonym());
  EXPECT_EQ(back->bytes_for_testing(), key.bytes_for_testing());
  EXPECT_FALSE(UserKey::decode(stored.substr(1)).has_value());
  EXPECT_EQ(stored[0], '\x02') << "a new key is not an HKDF key";
  std::string v3 = stored;
  v3[0] = 3;
  EXPECT_FALSE(UserKey::decode(v3).has_value()) << "an unknown key version decoded";
}

// The derivations are part of the format (docs/FORMAT.md, "Key
// derivation"), computed here with libcrypto's other HKDF and HMAC
// interfaces. A new key derives its sealing subkey, pseudonym and erasure
// tag with HKDF-SHA256 under three labels, and its records are AES-256-GCM
// under the sealing subkey (version 2), never under the raw key; a key
// stored before HKDF (version 1 of encode(), wrapped_keys 2 and 3) keeps
// its HMAC pseudonym and tag, opens its version-1 records with the raw key,
// and seals new records as version 2 under its HKDF sealing subkey.
TEST(SealedLedger, KeysDeriveSubkeysWithHkdfAndKeysBeforeHkdfKeepTheirPseudonym) {
  const UserKey key = new_key();
  ASSERT_EQ(key.derivation(), KeyDerivation::Hkdf);
  const auto hkdf = [](std::string_view k, std::string_view label, std::size_t size) {
    EVP_PKEY_CTX* ctx = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, nullptr);
    std::string out(size, '\0');
    std::size_t n = size;
    EXPECT_TRUE(ctx != nullptr && EVP_PKEY_derive_init(ctx) == 1 && EVP_PKEY_CTX_set_hkdf_md(ctx, EVP_sha256()) == 1 &&
                EVP_PKEY_CTX_set1_hkdf_key(ctx, reinterpret_cast<const unsigned char*>(k.data()),
                                           static_cast<int>(k.size())) == 1 &&
                EVP_PKEY_CTX_add1_hkdf_info(ctx, reinterpret_cast<const unsigned char*>(label.data()),
                                            static_cast<int>(label.size())) == 1 &&
                EVP_PKEY_derive(ctx, reinterpret_cast<unsigned char*>(out.data()), &n) == 1 && n == size);
    EVP_PKEY_CTX_free(ctx);
    return out;
  };
  const auto hmac = [](std::string_view k, std::string_view label, std::size_t size) {
    unsigned char mac[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    EXPECT_NE(HMAC(EVP_sha256(), k.data(), static_cast<int>(k.size()),
                   reinterpret_cast<const unsigned char*>(label.data()), label.size(), mac, &n),
              nullptr);
    return std::string(reinterpret_cast<const char*>(mac), size);
  };
  const std::string_view raw = key.bytes_for_testing();
  EXPECT_EQ(key.pseudonym(), hkdf(raw, "tidal ledger pseudonym v2", kPseudonymSize));
  EXPECT_EQ(key.erasure_tag(), hkdf(raw, "tidal erasure mark v2", kErasureTagSize));
  EXPECT_NE(key.pseudonym(), hmac(raw, "tidal ledger pseudonym v1", kPseudonymSize));
  std::string plain;
  put_sealed_entry(&plain, {AggregateKind::Cohort, 7, 9, 1'500'000'000});
  const std::string name = key.record_key(42);
  std::string sealed;
  ASSERT_OK(key.seal(name, plain, &sealed));
  EXPECT_EQ(sealed[0], '\x02');
  const std::string subkey = hkdf(raw, "tidal ledger seal v2", kUserKeySize);
  std::string out;
  std::string resealed;  // version 1 under the subkey
  ASSERT_OK(seal_v1_for_testing(subkey, name, plain, &resealed));
  EXPECT_FALSE(key.open(name, resealed, &out)) << "an HKDF key opened a version-1 record";
  std::string under_raw;
  ASSERT_OK(seal_v1_for_testing(raw, name, plain, &under_raw));
  EXPECT_FALSE(key.open(name, under_raw, &out)) << "an HKDF key's raw key opened a record";
  EXPECT_TRUE(key.open(name, sealed, &out));
  EXPECT_EQ(out, plain);
  {
    // The record is AES-256-GCM under the subkey: decrypted here directly.
    EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
    const auto* in = reinterpret_cast<const unsigned char*>(sealed.data()) + 1;
    const std::size_t size = sealed.size() - 1 - kSealNonceSize - kSealTagSize;
    std::string got(size, '\0');
    unsigned char tag[kSealTagSize];
    std::memcpy(tag, in + kSealNonceSize + size, kSealTagSize);
    int n = 0;
    const unsigned char version = 2;
    EXPECT_TRUE(EVP_DecryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr,
                                   reinterpret_cast<const unsigned char*>(subkey.data()), in) == 1 &&
                EVP_DecryptUpdate(ctx, nullptr, &n, reinterpret_cast<const unsigned char*>(name.data()),
                                  static_cast<int>(name.size())) == 1 &&
                EVP_DecryptUpdate(ctx, nullptr, &n, &version, 1) == 1 &&
                EVP_DecryptUpdate(ctx, reinterpret_cast<unsigned char*>(got.data()), &n, in + kSealNonceSize,
                                  static_cast<int>(size)) == 1 &&
                EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, static_cast<int>(kSealTagSize), tag) == 1 &&
                EVP_DecryptFinal_ex(ctx, reinterpret_cast<unsigned char*>(got.data()) + n, &n) == 1)
        << "the record is not AES-256-GCM under HKDF(key, \"tidal ledger seal v2\")";
    EVP_CIPHER_CTX_free(ctx);
    EXPECT_EQ(got, plain);
  }
  // A key stored before HKDF.
  const std::optional<UserKey> old = UserKey::decode("\x01" + std::string(raw));
  ASSERT_TRUE(old.has_value());
  EXPECT_EQ(old->derivation(), KeyDerivation::Hmac);
  EXPECT_EQ(old->pseudonym(), hmac(raw, "tidal ledger pseudonym v1", kPseudonymSize));
  EXPECT_EQ(old->erasure_tag(), hmac(raw, "tidal erasure mark v1", kErasureTagSize));
  EXPECT_TRUE(old->open(name, under_raw, &out)) << "a key before HKDF does not open its own old record";
  EXPECT_EQ(out, plain);
  std::string fresh;
  ASSERT_OK(old->seal(name, plain, &fresh));
  EXPECT_EQ(fresh[0], '\x02');
  EXPECT_TRUE(old->open(name, fresh, &out));
  EXPECT_FALSE(old->open(name, resealed, &out)) << "opened a record sealed under another key";
  std::string changed = under_raw;
  changed[0] = '\x02';
  EXPECT_FALSE(old->open(name, changed, &out)) << "a version-1 record opened as version 2";
}

// The writer's table of keys holds what a map holds, through inserts,
// replacements, erases (which move the last key and shift slots back) and
// growth, and a key it returned stays where it was while others come in.
TEST(LedgerKeyTable, HoldsWhatAMapHoldsThroughInsertsErasesAndGrowth) {
  LedgerKeyTable table;
  std::unordered_map<std::uint64_t, std::string> expected;  // user -> pseudonym
  std::mt19937_64 rng(7);
  std::vector<UserKey> pool;
  for (int i = 0; i < 64; ++i) pool.push_back(new_key());
  const UserKey& first = pool[0];
  const SealingKey* held = table.insert(~0ULL, first);  // the largest id, kept throughout
  const auto check = [&](std::uint64_t u) {
    const SealingKey* k = table.find(u);
    auto it = expected.find(u);
    if (it == expected.end()) {
      EXPECT_EQ(k, nullptr) << "user " << u << " was erased or never inserted";
    } else {
      ASSERT_NE(k, nullptr) << "user " << u << " lost";
      EXPECT_EQ(k->pseudonym(), it->second) << "user " << u;
    }
  };
  for (int round = 0; round < 200'000; ++round) {
    // Ids from a small range (many collide in the slots) and dense runs.
    const std::uint64_t u = round % 3 == 0 ? rng() % 5'000 : (rng() % 40) << 20;
    const UserKey& k = pool[rng() % pool.size()];
    if (rng() % 3 == 0) {
      table.erase(u);
      expected.erase(u);
    } else {
      table.insert(u, k);
      expected[u] = std::string(k.pseudonym());
    }
    if (round % 97 == 0) check(rng() % 5'000);
  }
  ASSERT_EQ(table.size(), expected.size() + 1);
  for (std::uint64_t u = 0; u < 5'000; ++u) check(u);
  for (std::uint64_t u = 0; u < 40; ++u) check(u << 20);
  // Growth moved slots, not keys.
  for (std::uint64_t u = 1'000'000; u < 1'200'000; ++u) table.insert(u, pool[u % pool.size()]);
  EXPECT_EQ(table.find(~0ULL), held);
  EXPECT_EQ(held->pseudonym(), first.pseudonym());
  for (std::uint64_t u = 1'000'000; u < 1'200'000; u += 997) {
    ASSERT_NE(table.find(u), nullptr);
    EXPECT_EQ(table.find(u)->pseudonym(), pool[u % pool.size()].pseudonym());
  }
}

// No ledger key names a user in clear: every key of the sealed ledger is a
// pseudonym and an epoch, and the user's 8-byte id is in none of them.
TEST(SealedLedger, NoLedgerKeyOrValueHoldsAUsersIdOrEntriesInClear) {
  TempDir dir;
  const std::string path = dir.sub("db");
  const std::uint64_t u = 0xA1B2C3D4E5F60718ULL;
  {
    auto db = open_db(path, manual_writes());
    ASSERT_OK(db->join_community(u, 77));
    for (std::uint64_t i = 0; i < 50; ++i) {
      ASSERT_OK(db->signal_with_context({u, i, 1.5}, {{4}}));
      if (i % 10 == 9) ASSERT_OK(db->flush());
    }
    ASSERT_OK(db->close());
  }
  std::string id;
  put_u64_be(&id, u);
  RawDb raw(path);
  ASSERT_TRUE(raw.ok());
  std::size_t records = 0;
  std::unique_ptr<rocksdb::Iterator> it(
      raw.db(RawDb::kSealedLedger)->NewIterator(rocksdb::ReadOptions(), raw.cf(RawDb::kSealedLedger)));
  for (it->SeekToFirst(); it->Valid(); it->Next(), ++records) {
    EXPECT_EQ(it->key().size(), kSealedLedgerKeySize);
    EXPECT_EQ(it->key().ToString().find(id), std::string::npos) << "the user's id is in a ledger key";
    EXPECT_EQ(it->value().ToString().find(id), std::string::npos);
  }
  EXPECT_EQ(records, 5u);  // one record per user per batch
  std::unique_ptr<rocksdb::Iterator> legacy(raw.db(RawDb::kLedger)->NewIterator(rocksdb::ReadOptions(), raw.cf(RawDb::kLedger)));
  legacy->SeekToFirst();
  EXPECT_FALSE(legacy->Valid()) << "format 4 wrote to format 3's ledger";
}

// The sealed ledger is laid out for writing: each batch's records sort
// after every earlier batch's, so RocksDB ingests each batch's file into the
// last level, beside the others, and no compaction ever rewrites one. The
// index names every record.
TEST(SealedLedger, EachBatchsRecordsGoToTheLastLevelAndTheIndexNamesEachRecord) {
  TempDir dir;
  const std::string path = dir.sub("db");
  constexpr int kBatches = 8;
  {
    auto db = open_db(path, manual_writes());
    for (std::uint64_t u = 1; u <= 40; ++u) ASSERT_OK(db->join_community(u, 77));
    for (int b = 0; b < kBatches; ++b) {
      for (std::uint64_t u = 1; u <= 40; ++u) ASSERT_OK(db->signal_with_context({u, 1000 + u, 1.5}, {{4, 5}}));
      ASSERT_OK(db->flush());
    }
    ASSERT_OK(db->close());
  }
  RawDb raw(path);
  ASSERT_TRUE(raw.ok());
  rocksdb::ColumnFamilyMetaData meta;
  raw.db(RawDb::kSealedLedger)->GetColumnFamilyMetaData(raw.cf(RawDb::kSealedLedger), &meta);
  ASSERT_FALSE(meta.levels.empty());
  std::string where;
  for (const auto& level : meta.levels) where += " L" + std::to_string(level.level) + ":" + std::to_string(level.files.size());
  EXPECT_EQ(meta.levels.back().files.size(), static_cast<std::size_t>(kBatches)) << where;
  EXPECT_EQ(meta.file_count, static_cast<std::size_t>(kBatches)) << "a batch's file is not in the last level:" << where;
  std::size_t records = 0, indexed = 0;
  std::unique_ptr<rocksdb::Iterator> it(
      raw.db(RawDb::kSealedLedger)->NewIterator(rocksdb::ReadOptions(), raw.cf(RawDb::kSealedLedger)));
  for (it->SeekToFirst(); it->Valid(); it->Next()) ++records;
  std::unique_ptr<rocksdb::Iterator> index(
      raw.db(RawDb::kSealedIndex)->NewIterator(rocksdb::ReadOptions(), raw.cf(RawDb::kSealedIndex)));
  for (index->SeekToFirst(); index->Valid(); index->Next(), ++indexed) {
    EXPECT_TRUE(index->value().empty());
    const std::optional<std::string> record = sealed_record_of(index->key().ToString());
    ASSERT_TRUE(record.has_value());
    std::string value;
    EXPECT_TRUE(raw.db(RawDb::kSealedLedger)->Get(rocksdb::ReadOptions(), raw.cf(RawDb::kSealedLedger), *record, &value).ok())
        << "the index names a record that is not there: " << hex(*record);
  }
  EXPECT_EQ(records, 40u * kBatches);  // one record per user per batch
  EXPECT_EQ(indexed, records);
}

// A purged user's sealed records stay in their files, unreadable, until
// RocksDB compacts those files (periodically, or by hand), and that
// compaction drops them: every record no index key names, and only those.
// While a ledger check that holds its snapshot runs, nothing is dropped (it
// may read the compaction's files at a snapshot from before the purge).
TEST(SealedLedger, ACompactionDropsThePurgedUsersRecordsAndKeepsEveryOther) {
  TempDir dir;
  auto db = open_db(dir.sub("db"), manual_writes());
  Storage& storage = Db::Impl::storage_for_testing(*db);
  rocksdb::DB* state = storage.db(Storage::Engine::State);
  // Only the compactions below: RocksDB's own may compact some of the files
  // at any time, and drop records of theirs.
  ASSERT_TRUE(state->SetOptions(storage.sealed_ledger(), {{"disable_auto_compactions", "true"}}).ok());
  constexpr std::uint64_t kUsers = 40;
  constexpr int kBatches = 4;
  for (std::uint64_t u = 1; u <= kUsers; ++u) ASSERT_OK(db->join_community(u, 77));
  for (int b = 0; b < kBatches; ++b) {
    for (std::uint64_t u = 1; u <= kUsers; ++u) {
      ASSERT_OK(db->signal_with_context({u, 1000 + u % 5, 1.5 + static_cast<double>(b)}, {{4, 5}}));
    }
    ASSERT_OK(db->flush());
  }
  const std::vector<std::uint64_t> purged = {3, 8, 13, 21, 34};
  for (std::uint64_t u : purged) {
    ASSERT_OK(db->leave_community_layer(u));
    ASSERT_OK(db->purge_community_contributions(u));
  }
  std::vector<double> scores;
  for (std::uint64_t item = 1000; item < 1005; ++item) {
    scores.push_back(value_of(db->cohort_score(4, item)));
    scores.push_back(value_of(db->community_score(77, item)));
  }

  // The records on disk, and how many of them the index names.
  const auto count = [&](std::size_t* named) {
    std::size_t records = 0;
    *named = 0;
    auto it = storage.iterator(storage.sealed_ledger());
    std::string index_key, value;
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      ++records;
      EXPECT_TRUE(sealed_index_key_of(it->key().ToString(), &index_key));
      if (state->Get(rocksdb::ReadOptions(), storage.sealed_index(), index_key, &value).ok()) ++*named;
    }
    EXPECT_TRUE(it->status().ok()) << it->status().ToString();
    return records;
  };
  const auto compact = [&] {
    rocksdb::CompactRangeOptions options;
    options.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForce;
    ASSERT_TRUE(state->CompactRange(options, storage.sealed_ledger(), nullptr, nullptr).ok());
  };
  std::size_t named = 0;
  ASSERT_EQ(count(&named), kUsers * kBatches) << "a purge deleted sealed records itself";
  EXPECT_EQ(named, (kUsers - purged.size()) * kBatches);
  EXPECT_EQ(storage.sealed_records_reclaimed(), 0u);

  // A check that holds its snapshot: the compaction drops nothing.
  storage.scans_holding().fetch_add(1);
  compact();
  storage.scans_holding().fetch_sub(1);
  EXPECT_EQ(count(&named), kUsers * kBatches) << "records dropped while a check held its snapshot";
  EXPECT_EQ(storage.sealed_records_reclaimed(), 0u);

  compact();
  EXPECT_EQ(count(&named), (kUsers - purged.size()) * kBatches);
  EXPECT_EQ(named, (kUsers - purged.size()) * kBatches) << "a record the index names was dropped";
  EXPECT_EQ(storage.sealed_records_reclaimed(), purged.size() * kBatches);
  std::size_t i = 0;
  for (std::uint64_t item = 1000; item < 1005; ++item) {
    EXPECT_EQ(value_of(db->cohort_score(4, item)), scores[i++]);
    EXPECT_EQ(value_of(db->community_score(77, item)), scores[i++]);
  }
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
  // The others' purges still find and subtract exactly their records.
  ASSERT_OK(db->leave_community_layer(1));
  Result<PurgeReceipt> r = db->purge_community_contributions(1);
  ASSERT_OK(r);
  EXPECT_GT(r->entries_removed, 0u);
  v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
}

// RocksDB's periodic compaction reaches every file of the sealed ledger
// (Storage::kSealedReclaimPeriod: 30 days; 1 s here), and drops the purged
// users' records with no other compaction asked for.
TEST(SealedLedger, PeriodicCompactionReclaimsThePurgedUsersRecords) {
  TempDir dir;
  auto db = open_db(dir.sub("db"), manual_writes());
  for (std::uint64_t u = 1; u <= 20; ++u) ASSERT_OK(db->join_community(u, 77));
  for (int b = 0; b < 3; ++b) {
    for (std::uint64_t u = 1; u <= 20; ++u) ASSERT_OK(db->signal_with_context({u, 1000, 1.5}, {{4}}));
    ASSERT_OK(db->flush());
  }
  Storage& storage = Db::Impl::storage_for_testing(*db);
  rocksdb::DB* state = storage.db(Storage::Engine::State);
  EXPECT_EQ(state->GetOptions(storage.sealed_ledger()).periodic_compaction_seconds,
            static_cast<std::uint64_t>(Storage::kSealedReclaimPeriod.count()));
  for (const std::uint64_t u : {std::uint64_t{2}, std::uint64_t{5}}) {
    ASSERT_OK(db->leave_community_layer(u));
    ASSERT_OK(db->purge_community_contributions(u));
  }
  ASSERT_TRUE(state->SetOptions(storage.sealed_ledger(), {{"periodic_compaction_seconds", "1"}}).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(2100));
  // RocksDB looks for files due at its next change of the family's files.
  ASSERT_OK(db->signal_with_context({1, 1000, 1.5}, {{4}}));
  ASSERT_OK(db->flush());
  const auto records = [&] {
    std::size_t n = 0;
    auto it = storage.iterator(storage.sealed_ledger());
    for (it->SeekToFirst(); it->Valid(); it->Next()) ++n;
    return n;
  };
  constexpr std::size_t kKept = 18 * 3 + 1;  // the 18 others' 3 batches, and user 1's last
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (records() > kKept && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(records(), kKept);
  EXPECT_EQ(storage.sealed_records_reclaimed(), 6u);  // 2 users, 3 batches
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
}

// A closed Db at `path` holding one user's contribution.
void make_db_with_a_contribution(const std::string& path) {
  auto db = open_db(path, manual_writes());
  ASSERT_OK(db->join_community(1, 77));
  ASSERT_OK(db->signal_with_context({1, 2, 1.5}, {{4}}));
  ASSERT_OK(db->close());
}

// The column families of the RocksDB database in `dir`, sorted.
std::vector<std::string> column_families(const std::string& dir) {
  std::vector<std::string> names;
  EXPECT_TRUE(rocksdb::DB::ListColumnFamilies(rocksdb::Options(), dir, &names).ok());
  std::sort(names.begin(), names.end());
  return names;
}

// A Db written by format 4's first development builds keyed the sealed
// ledger by pseudonym, with no index: this version would find none of its
// records, so it refuses the Db, and changes nothing.
TEST(SealedLedger, ADbOfTheDevelopmentLayoutIsRefused) {
  TempDir dir;
  const std::string path = dir.sub("db");
  make_db_with_a_contribution(path);
  {
    RawDb raw(path);
    ASSERT_TRUE(raw.ok());
    ASSERT_TRUE(raw.db(RawDb::kSealedIndex)->DropColumnFamily(raw.cf(RawDb::kSealedIndex)).ok());
  }
  const std::vector<std::string> before = column_families(path + "/state");
  Result<std::unique_ptr<Db>> db = Db::open(path, manual_writes());
  ASSERT_FALSE(db.ok());
  EXPECT_EQ(db.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(db.status().message().find("development build of format 4"), std::string::npos) << db.status().message();
  EXPECT_EQ(column_families(path + "/state"), before) << "the refused open created a column family";
}

// The key store of development builds before the bucket keys kept each
// user's key unwrapped, in a column family "keys": refused, unchanged.
TEST(SealedLedger, ADbOfTheUnwrappedKeyStoreIsRefused) {
  TempDir dir;
  const std::string path = dir.sub("db");
  make_db_with_a_contribution(path);
  {
    RawDb raw(path);
    ASSERT_TRUE(raw.ok());
    rocksdb::ColumnFamilyHandle* keys = nullptr;
    ASSERT_TRUE(raw.db(RawDb::kMeta)->CreateColumnFamily(rocksdb::ColumnFamilyOptions(), "keys", &keys).ok());
    EXPECT_TRUE(raw.db(RawDb::kMeta)->DestroyColumnFamilyHandle(keys).ok());
  }
  const std::vector<std::string> before = column_families(path);
  Result<std::unique_ptr<Db>> db = Db::open(path, manual_writes());
  ASSERT_FALSE(db.ok());
  EXPECT_EQ(db.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(db.status().message().find("key store was written by a development build of format 4"), std::string::npos)
      << db.status().message();
  EXPECT_NE(db.status().message().find(path), std::string::npos) << db.status().message();
  EXPECT_EQ(column_families(path), before) << "the refused open changed the column families";
  Options read_only = manual_writes();
  read_only.read_only = true;
  EXPECT_EQ(Db::open(path, read_only).status().code(), StatusCode::InvalidArgument);
}

// A bucket key unwraps only what it wrapped, for the user it was wrapped
// for: not another generation's key, not another user's record, not a
// changed byte.
TEST(SealedLedger, AWrappedKeyUnwrapsOnlyWithItsBucketKeyForItsUser) {
  Result<UserKey> key = UserKey::generate();
  ASSERT_OK(key);
  Result<BucketKey> bucket = BucketKey::generate(7);
  ASSERT_OK(bucket);
  const std::uint64_t u = 0x0102030405060708ULL;
  std::string wrapped;
  ASSERT_OK(bucket->wrap(u, kMinBucketDepth, *key, &wrapped));
  ASSERT_EQ(wrapped.size(), kWrappedKeySize);
  EXPECT_EQ(wrapped_key_generation(wrapped), 7u);
  std::optional<UserKey> back = bucket->unwrap(u, wrapped);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->bytes_for_testing(), key->bytes_for_testing());
  EXPECT_EQ(back->pseudonym(), key->pseudonym());
  EXPECT_EQ(wrapped.find(key->bytes_for_testing()), std::string::npos) << "the wrapped value holds the key in clear";
  // Another user's key-store record, another key of the same generation,
  // the next generation, a changed byte anywhere: nothing.
  EXPECT_FALSE(bucket->unwrap(u + 1, wrapped).has_value());
  Result<BucketKey> other = BucketKey::generate(7);
  ASSERT_OK(other);
  EXPECT_FALSE(other->unwrap(u, wrapped).has_value());
  Result<BucketKey> next = BucketKey::generate(8);
  ASSERT_OK(next);
  EXPECT_FALSE(next->unwrap(u, wrapped).has_value());
  for (std::size_t i = 0; i < wrapped.size(); ++i) {
    std::string changed = wrapped;
    changed[i] = static_cast<char>(changed[i] ^ 0x20);
    EXPECT_FALSE(bucket->unwrap(u, changed).has_value()) << "byte " << i << " changed";
  }
  // Wrapped again with the next generation's key: it unwraps to the same
  // key with that one only; a value that does not unwrap is refused.
  std::vector<std::string> again;
  EXPECT_EQ(bucket->rewrap(*next, kMinBucketDepth, {u, u + 1}, {wrapped, wrapped}, &again).code(), StatusCode::Corruption)
      << "a value of another user was wrapped again";
  ASSERT_OK(bucket->rewrap(*next, kMinBucketDepth, {u}, {wrapped}, &again));
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(wrapped_key_generation(again[0]), 8u);
  const std::optional<UserKey> rewrapped = next->unwrap(u, again[0]);
  ASSERT_TRUE(rewrapped.has_value());
  EXPECT_EQ(rewrapped->bytes_for_testing(), key->bytes_for_testing());
  EXPECT_FALSE(bucket->unwrap(u, again[0]).has_value());
  EXPECT_FALSE(next->unwrap(u + 1, again[0]).has_value());
  std::string changed = wrapped;
  changed[30] = static_cast<char>(changed[30] ^ 1);
  EXPECT_EQ(bucket->rewrap(*next, kMinBucketDepth, {u}, {changed}, &again).code(), StatusCode::Corruption);
  // The stored bucket key decodes to one that unwraps the same.
  const std::optional<BucketKey> decoded = BucketKey::decode(bucket->encode().view());
  ASSERT_TRUE(decoded.has_value());
  EXPECT_EQ(decoded->generation(), 7u);
  EXPECT_TRUE(decoded->unwrap(u, wrapped).has_value());
  EXPECT_FALSE(BucketKey::decode(bucket->encode().view().substr(1)).has_value());
  // Every user id maps to one bucket, whose key begins its key-store key.
  EXPECT_EQ(encode_key_store_key(u).substr(0, 2), encode_bucket_key(key_bucket(u)));
  EXPECT_EQ(decode_key_store_key(encode_key_store_key(u)), u);
  std::string wrong_bucket = encode_key_store_key(u);
  wrong_bucket[0] = static_cast<char>(wrong_bucket[0] ^ 1);
  EXPECT_FALSE(decode_key_store_key(wrong_bucket).has_value());
}

// The scan itself (tests/erasure_scan.h) reads a WAL's batches whole: the
// key-store put here starts 4 bytes before the end of the log's first
// 32 KiB block, so its key is split by the next fragment's header, where a
// search of the bytes does not find it; the ledger prefix comes in the
// second fragment.
TEST(SealedLedger, TheErasureScanReadsAWalsBatchesAcrossItsBlocks) {
  TempDir dir;
  const std::uint64_t u = 0x0102030405060708ULL;
  rocksdb::Options options;
  options.create_if_missing = true;
  rocksdb::DB* raw = nullptr;
  ASSERT_TRUE(rocksdb::DB::Open(options, dir.path(), &raw).ok());
  std::unique_ptr<rocksdb::DB> db(raw);
  Result<UserKey> key = UserKey::generate();
  ASSERT_OK(key);
  Result<BucketKey> bucket = BucketKey::generate(3);
  ASSERT_OK(bucket);
  std::string wrapped;
  ASSERT_OK(bucket->wrap(u, kMinBucketDepth, *key, &wrapped));
  // Batch: a 12-byte header, then [type][3-byte length][filler][0-byte
  // value's length] and [type][10][the key-store key]...: that key starts at
  // 12 + (1 + 3 + 32738 + 1) + 2 = 32757 of the block's 32761 bytes.
  rocksdb::WriteBatch batch;
  ASSERT_TRUE(batch.Put(std::string(32738, 'x'), "").ok());
  ASSERT_TRUE(batch.Put(encode_key_store_key(u), wrapped).ok());
  ASSERT_TRUE(batch.Put(encode_key_prefix(EntityId(u), Tag::ContributionLedger) + "entry", "1").ok());
  ASSERT_TRUE(batch.Put(encode_bucket_key(key_bucket(u)), bucket->encode().view()).ok());
  ASSERT_TRUE(db->Write(rocksdb::WriteOptions(), &batch).ok());
  std::string wal;  // the one WAL
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    if (entry.path().extension() == ".log") wal = entry.path().filename().string();
  }
  ASSERT_FALSE(wal.empty());
  const testing::ErasureScan scan = scan_files(dir.path(), u);
  ASSERT_EQ(scan.user_keys, std::vector<std::string>{testing::held_key_text(*key, *bucket)}) << scan.summary();
  std::vector<std::string> found = scan.found;
  std::sort(found.begin(), found.end());
  EXPECT_EQ(found, (std::vector<std::string>{wal + ": WAL holds the prefix",
                                             wal + ": holds the bucket key (generation 3) that wrapped the user's "
                                                   "ledger key",
                                             "the files hold the user's ledger key, wrapped, and the bucket key that "
                                             "unwraps it"}))
      << scan.summary();
  // A search of the bytes for the put ([10][the key-store key][66]) would
  // not have found it.
  EXPECT_EQ(testing::read_file(dir.path() + "/" + wal).find("\x0a" + encode_key_store_key(u) + "\x42"),
            std::string::npos);
}

// docs/CONTRACT.md, P7 in format 4: a rejoined user's new contributions are
// sealed with a new key, so the later purge erases that key, and the first
// key is not made again.
TEST(SealedLedger, ARejoinedUserGetsANewKeyAndEachPurgeErasesItsOwn) {
  TempDir dir;
  const std::string path = dir.sub("db");
  const std::uint64_t u = 0xA1B2C3D4E5F60718ULL;
  auto db = open_db(path, manual_writes());
  ASSERT_OK(db->join_community(u, 77));
  ASSERT_OK(db->signal_with_context({u, 1, 1.5}, {{4}}));
  ASSERT_OK(db->flush());
  const testing::ErasureScan first = scan_files(path, u);
  ASSERT_EQ(first.user_keys.size(), 1u);
  // The key store is not flushed: its put is read from the WAL's batches.
  EXPECT_TRUE(std::any_of(first.wal_records.begin(), first.wal_records.end(), [](const std::string& r) {
    return r.find(": P of the user's key-store key") != std::string::npos;
  })) << first.summary();
  ASSERT_OK(db->leave_community_layer(u));
  ASSERT_OK(db->purge_community_contributions(u));
  for (const std::string& f : scan_files(path, u, first.user_keys).found) ADD_FAILURE() << "after the purge: " << f;

  ASSERT_OK(db->rejoin_community_layer(u));
  ASSERT_OK(db->signal_with_context({u, 1, 0.25}, {{4}}));
  ASSERT_OK(db->flush());
  const testing::ErasureScan second = scan_files(path, u);
  ASSERT_EQ(second.user_keys.size(), 1u);
  EXPECT_NE(second.user_keys, first.user_keys) << "the rejoined user's key is the purged one";
  EXPECT_EQ(value_of(db->cohort_score(4, 1)), 0.25);
  ASSERT_OK(db->leave_community_layer(u));
  Result<PurgeReceipt> r = db->purge_community_contributions(u);
  ASSERT_OK(r);
  EXPECT_EQ(r->entries_removed, 2u);  // cohort 4 and community 77, of the second key only
  EXPECT_EQ(value_of(db->cohort_score(4, 1)), 0.0);
  std::vector<std::string> both = first.user_keys;
  both.insert(both.end(), second.user_keys.begin(), second.user_keys.end());
  for (const std::string& f : scan_files(path, u, both).found) ADD_FAILURE() << "after the second purge: " << f;
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
}

// The key store's tests: a Db of manual writes, not synced (the setups'
// many joins), its storage and the engine of its key store.
class KeyStore : public ::testing::Test {
 protected:
  // `x` joins community 77 and contributes `w` to cohort 4.
  void signal(std::uint64_t x, double w) {
    ASSERT_OK(db->join_community(x, 77));
    ASSERT_OK(db->signal_with_context({x, 1000 + x % 5, w}, {{4}}));
  }

  // `u` leaves and is purged (its receipt names `cohort_removed` of cohort
  // weight removed, when given); on return no file holds what `held` found
  // of its key (scan_files).
  void purge_erasing(std::uint64_t u, const testing::ErasureScan& held,
                     std::optional<double> cohort_removed = std::nullopt) {
    ASSERT_OK(db->leave_community_layer(u));
    Result<PurgeReceipt> r = db->purge_community_contributions(u);
    ASSERT_OK(r);
    if (cohort_removed) {
      EXPECT_EQ(r->cohort_weight_removed, *cohort_removed);
    }
    EXPECT_TRUE(r->erasure_complete);
    for (const std::string& f : scan_files(path, u, held.user_keys).found) ADD_FAILURE() << "after the purge: " << f;
  }

  TempDir dir;
  const std::string path = dir.sub("db");
  const Options options = [] {
    Options o = manual_writes();
    o.sync_writes = false;
    return o;
  }();
  std::unique_ptr<Db> db = open_db(path, options);
  Storage& storage = Db::Impl::storage_for_testing(*db);
  rocksdb::DB* users = storage.db(Storage::Engine::Users);
};

// A user of `bucket` (key_bucket), the first at or after `from`.
std::uint64_t user_in_bucket(std::uint16_t bucket, std::uint64_t from) {
  while (key_bucket(from) != bucket) ++from;
  return from;
}

// A bucket is the users the top `depth` bits of whose hash are its prefix;
// its key names its group, then (deeper than 16) its depth and the
// prefix's other bits. The shape splits buckets in order (linear hashing):
// a user's bucket is one of the next depth once the split has passed its
// bucket of the shape's depth.
TEST(SealedLedger, BucketsAndTheKeyStoresShapeEncodeAndSplitByLinearHashing) {
  for (const std::uint64_t u : std::vector<std::uint64_t>{1, 77, 0xA1B2C3D4E5F60718ULL, ~std::uint64_t{0}}) {
    EXPECT_EQ(KeyBucket::of(u, kMinBucketDepth).key(), encode_bucket_key(key_bucket(u)));
    for (unsigned depth = kMinBucketDepth; depth <= kMaxBucketDepth; ++depth) {
      const KeyBucket b = KeyBucket::of(u, depth);
      EXPECT_EQ(b.group(), key_bucket(u)) << depth;
      EXPECT_EQ(b.key().size(), depth == kMinBucketDepth ? kBucketKeySize : kDeepBucketKeySize);
      EXPECT_EQ(KeyBucket::decode(b.key()), b) << "depth " << depth;
      if (depth > kMinBucketDepth) {
        EXPECT_EQ(KeyBucket::of(u, depth - 1).prefix, b.prefix >> 1);
      }
    }
  }
  // Keys of another length, depth or prefix are no bucket's.
  std::string deep = KeyBucket{17, 5}.key();
  EXPECT_EQ(deep, std::string("\x00\x02\x11\x00\x01", 5));
  EXPECT_FALSE(KeyBucket::decode(deep.substr(0, 3)));
  for (char depth : {'\x10', '\x21', '\x00'}) {
    std::string bad = deep;
    bad[2] = depth;
    EXPECT_FALSE(KeyBucket::decode(bad)) << int(depth);
  }
  std::string wide = deep;
  wide[4] = '\x02';  // 2 is not a 1-bit suffix
  EXPECT_FALSE(KeyBucket::decode(wide));
  // Ordered as their keys are.
  std::vector<KeyBucket> buckets{{16, 3}, {17, 6}, {17, 7}, {18, 12}, {16, 4}, {32, 0x00030001}, {17, 9}};
  std::vector<KeyBucket> by_key = buckets;
  std::sort(buckets.begin(), buckets.end());
  std::sort(by_key.begin(), by_key.end(), [](const KeyBucket& x, const KeyBucket& y) { return x.key() < y.key(); });
  EXPECT_EQ(buckets, by_key);

  const KeyShape none;
  EXPECT_EQ(none.buckets(), 65'536u);
  const KeyShape shape{16, 100, 7};
  EXPECT_EQ(shape.buckets(), 65'636u);
  std::size_t split = 0;
  for (std::uint64_t u = 1; u < 200'000; ++u) {
    EXPECT_EQ(none.bucket_of(u), KeyBucket::of(u, 16));
    const bool passed = KeyBucket::of(u, 16).prefix < 100;
    split += passed;
    ASSERT_EQ(shape.bucket_of(u), KeyBucket::of(u, passed ? 17 : 16)) << u;
  }
  EXPECT_GT(split, 0u);
  EXPECT_EQ(KeyShape::decode(shape.encode())->split, 100u);
  EXPECT_EQ(KeyShape::decode(shape.encode())->keys, 7u);
  EXPECT_EQ(shape.encode().size(), 14u);
  for (const KeyShape& bad : {KeyShape{15, 0, 0}, KeyShape{33, 0, 0}, KeyShape{16, 65'536, 0}, KeyShape{32, 1, 0}}) {
    EXPECT_FALSE(KeyShape::decode(bad.encode())) << bad.depth << " " << bad.split;
  }
  std::string v2 = shape.encode();
  v2[0] = '\x02';
  EXPECT_FALSE(KeyShape::decode(v2));
  EXPECT_FALSE(KeyShape::decode(shape.encode().substr(1)));
}

// A key wrapped for a bucket of one depth unwraps only as that depth's
// (the depth is in the additional data); a value of version 2 (written
// before buckets split, depth 16) still unwraps, and is wrapped again as
// version 3.
TEST(SealedLedger, AWrappedKeyIsBoundToItsBucketsDepthAndVersion2StillUnwraps) {
  const UserKey key = new_key();
  Result<BucketKey> bucket = BucketKey::generate(4);
  ASSERT_OK(bucket);
  const std::uint64_t u = 0x0102030405060709ULL;
  std::string wrapped;
  ASSERT_OK(bucket->wrap(u, 17, key, &wrapped));
  ASSERT_EQ(wrapped.size(), kWrappedKeySize);
  EXPECT_EQ(wrapped_key_header(wrapped)->depth, 17u);
  EXPECT_EQ(wrapped_key_header(wrapped)->generation, 4u);
  ASSERT_TRUE(bucket->unwrap(u, wrapped).has_value());
  for (char depth : {'\x10', '\x12'}) {
    std::string other = wrapped;
    other[1] = depth;
    EXPECT_FALSE(bucket->unwrap(u, other).has_value()) << "unwrapped as depth " << int(depth);
  }
  // Version 2: [0x02][generation], the key sealed under its key store key
  // and the generation.
  std::string v2(1, '\x02');
  put_u32_be(&v2, 4);
  std::string aad = encode_key_store_key(u);
  put_u32_be(&aad, 4);
  ASSERT_OK(seal_v1_for_testing(bucket->bytes_for_testing(), aad, key.bytes_for_testing(), &v2));
  ASSERT_EQ(v2.size(), kWrappedKeySizeV2);
  EXPECT_EQ(wrapped_key_header(v2)->depth, kMinBucketDepth);
  std::optional<UserKey> back = bucket->unwrap(u, v2);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->bytes_for_testing(), key.bytes_for_testing());
  Result<BucketKey> next = BucketKey::generate(5);
  ASSERT_OK(next);
  std::vector<std::string> again;
  ASSERT_OK(bucket->rewrap(*next, 17, {u}, {v2}, &again));
  ASSERT_EQ(again[0].size(), kWrappedKeySize);
  EXPECT_EQ(wrapped_key_header(again[0])->depth, 17u);
  back = next->unwrap(u, again[0]);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->bytes_for_testing(), key.bytes_for_testing());
  EXPECT_FALSE(wrapped_key_header(v2.substr(1)));
  EXPECT_FALSE(wrapped_key_header(wrapped + "x"));
}

// Sets split_to_buckets_for_testing while it lives.
class SplitTo {
 public:
  explicit SplitTo(std::uint64_t buckets) { split_to_buckets_for_testing().store(buckets); }
  ~SplitTo() { split_to_buckets_for_testing().store(0); }
  SplitTo(const SplitTo&) = delete;
  SplitTo& operator=(const SplitTo&) = delete;
};

// The key store's shape as stored in the users engine.
KeyShape stored_shape(Storage& storage) {
  std::string stored;
  EXPECT_OK(storage.get(storage.meta(), kKeyShapeKey, &stored));
  const std::optional<KeyShape> shape = KeyShape::decode(stored);
  EXPECT_TRUE(shape.has_value()) << hex(stored);
  return shape.value_or(KeyShape{});
}

// The bucket keys stored now, decoded.
std::vector<KeyBucket> stored_buckets(Storage& storage) {
  std::vector<KeyBucket> out;
  auto it = storage.iterator(storage.bucket_keys());
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const std::optional<KeyBucket> b = KeyBucket::decode(it->key().ToStringView());
    EXPECT_TRUE(b.has_value()) << hex(it->key().ToStringView());
    if (b) out.push_back(*b);
  }
  return out;
}

// The buckets split as the key store grows (here: forced, so that 300
// users reach them): every user's key stays what it was, each bucket's
// users are wrapped with its own key, and a purge after the splits erases
// from every file the user's key and every bucket key that ever wrapped it,
// the buckets' split away included; the bucket's other users stay readable.
TEST_F(KeyStore, SplitBucketsKeepEveryKeyAndAPurgeErasesEveryBucketKeyThatWrappedIt) {
  const auto flush_keys = [&] {
    ASSERT_TRUE(users->Flush(rocksdb::FlushOptions(), {storage.keys(), storage.bucket_keys()}).ok());
  };
  // u (an id whose bytes occur nowhere by chance) and 40 users of its
  // group, 3: a low group, whose depth-17 buckets 65,536 + 8 splits reach.
  constexpr std::uint16_t kGroup = 3;
  const std::uint64_t u = user_in_bucket(kGroup, 0xA1B2C3D4E5F60000ULL);
  std::vector<std::uint64_t> all{u};
  for (std::uint64_t from = 1; all.size() < 41; from = all.back() + 1) all.push_back(user_in_bucket(kGroup, from));
  for (std::uint64_t x = 1; x <= 200; ++x) all.push_back(x);
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  for (std::uint64_t x : all) signal(x, x == u ? 2.0 : 1.5);
  ASSERT_OK(db->flush());
  flush_keys();
  EXPECT_EQ(stored_shape(storage).depth, kMinBucketDepth);
  EXPECT_EQ(stored_shape(storage).split, 0u);
  std::vector<std::optional<UserKey>> before;
  ASSERT_OK(read_user_keys(storage, all, &before));

  // Every bucket of depth 16 split, then those of groups 0 to 3 of depth 17:
  // each write of a new key splits up to 1,024.
  {
    const SplitTo split(2 * 65'536 + 8);
    bool flushed = false;
    for (std::uint64_t i = 0; stored_shape(storage).buckets() < 2 * 65'536 + 8; ++i) {
      ASSERT_LT(i, 200u) << "the buckets do not split";
      signal(20'000'000 + i, 0.5);
      ASSERT_OK(db->flush());
      if (!flushed && stored_shape(storage).depth == 17) {
        flush_keys();  // the keys of depth 17 in files too
        flushed = true;
      }
    }
  }
  const KeyShape shape = stored_shape(storage);
  EXPECT_EQ(shape.depth, 17u);
  EXPECT_EQ(shape.split, 8u);
  std::vector<std::optional<UserKey>> after;
  ASSERT_OK(read_user_keys(storage, all, &after));
  for (std::size_t i = 0; i < all.size(); ++i) {
    ASSERT_TRUE(before[i] && after[i]) << all[i];
    EXPECT_EQ(after[i]->bytes_for_testing(), before[i]->bytes_for_testing()) << "user " << all[i];
  }
  std::string wrapped;
  ASSERT_OK(storage.get(storage.keys(), encode_key_store_key(u), &wrapped));
  EXPECT_EQ(wrapped_key_header(wrapped)->depth, 18u);
  // Group 3 holds keys of depth 18 only: its keys of depth 16 and 17 went.
  for (const KeyBucket& b : stored_buckets(storage)) {
    if (b.group() == kGroup) {
      EXPECT_EQ(b.depth, 18u) << b.text();
    } else {
      EXPECT_GE(b.depth, 17u) << b.text();
    }
  }
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();

  // The files still hold u's key wrapped at depths 16 and 17 (flushed),
  // and the bucket keys that wrapped it.
  const testing::ErasureScan held = testing::scan_files_settled(path, u);
  ASSERT_GE(held.user_keys.size(), 2u) << held.summary();
  ASSERT_OK(db->leave_community_layer(u));
  Result<PurgeReceipt> r = db->purge_community_contributions(u);
  ASSERT_OK(r);
  EXPECT_EQ(r->entries_removed, 2u);
  EXPECT_EQ(r->cohort_weight_removed, 2.0);
  EXPECT_TRUE(r->erasure_complete);
  for (const std::string& f : scan_files(path, u, held.user_keys).found) ADD_FAILURE() << "after the purge: " << f;
  // A user of u's bucket, wrapped again with its new key: still exact.
  const auto sibling = std::find_if(all.begin(), all.end(), [&](std::uint64_t x) {
    return x != u && KeyBucket::of(x, 18) == KeyBucket::of(u, 18);
  });
  ASSERT_NE(sibling, all.end()) << "no other user in u's bucket";
  v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
  ASSERT_OK(db->leave_community_layer(*sibling));
  Result<PurgeReceipt> o = db->purge_community_contributions(*sibling);
  ASSERT_OK(o);
  EXPECT_EQ(o->entries_removed, 2u);
  EXPECT_EQ(o->cohort_weight_removed, 1.5);

  // The shape outlives the handle: a new key after a reopen splits nothing
  // and is counted.
  ASSERT_OK(db->close());
  db = open_db(path, options);
  Storage& reopened = Db::Impl::storage_for_testing(*db);
  const std::uint64_t keys = stored_shape(reopened).keys;
  signal(30'000'000, 0.5);
  ASSERT_OK(db->flush());
  EXPECT_EQ(stored_shape(reopened).depth, 17u);
  EXPECT_EQ(stored_shape(reopened).split, 8u);
  EXPECT_EQ(stored_shape(reopened).keys, keys + 1);
}

// The keys a split writes are noted (Storage::write_key_store) like a
// purge's: a purge of a user the split wrapped again flushes them out of
// the WALs, also once an earlier erasure has cleared the open's "any key"
// note (without the split's note: the child's replaced key stayed in a
// WAL).
TEST_F(KeyStore, ASplitsKeysStillInTheWalsAreErasedAfterAnEarlierErasure) {
  const std::uint64_t u = user_in_bucket(0, 0xA1B2C3D4E5F60000ULL);
  const std::uint64_t w = user_in_bucket(0, u + 1);
  const std::uint64_t x = user_in_bucket(9, 0x77);
  signal(u, 2.0);
  signal(w, 1.5);
  signal(x, 1.5);
  ASSERT_OK(db->flush());
  // A first purge: its erasure flushes the engine past its WALs.
  ASSERT_OK(db->leave_community_layer(x));
  ASSERT_OK(db->purge_community_contributions(x));
  {
    const SplitTo split(65'537);
    signal(0x5151515151ULL, 0.5);
    ASSERT_OK(db->flush());
  }
  ASSERT_EQ(stored_shape(storage).split, 1u);
  std::string wrapped;
  ASSERT_OK(storage.get(storage.keys(), encode_key_store_key(u), &wrapped));
  ASSERT_EQ(wrapped_key_header(wrapped)->depth, 17u);
  const testing::ErasureScan held = testing::scan_files_settled(path, u);
  ASSERT_GE(held.user_keys.size(), 2u) << held.summary();
  purge_erasing(u, held);
}

// The last group's erasure range takes in its deeper buckets' keys too
// (they sort after [0xffff]; the range ended at [0xffff 0x00] before).
TEST_F(KeyStore, TheLastGroupsSplitKeysAreErased) {
  const std::uint64_t u = user_in_bucket(0xffff, 0xA1B2C3D4E5F60000ULL);
  std::uint64_t w = user_in_bucket(0xffff, u + 1);
  while (!(KeyBucket::of(w, 17) == KeyBucket::of(u, 17))) w = user_in_bucket(0xffff, w + 1);
  signal(u, 2.0);
  signal(w, 1.5);
  ASSERT_OK(db->flush());
  {
    const SplitTo split(2 * 65'536);
    for (std::uint64_t i = 0; stored_shape(storage).buckets() < 2 * 65'536; ++i) {
      ASSERT_LT(i, 100u) << "the buckets do not split";
      signal(20'000'000 + i, 0.5);
      ASSERT_OK(db->flush());
    }
  }
  std::string wrapped;
  ASSERT_OK(storage.get(storage.keys(), encode_key_store_key(u), &wrapped));
  ASSERT_EQ(wrapped_key_header(wrapped)->depth, 17u);
  // The old and the new keys in separate files of the last level.
  ASSERT_TRUE(users->Flush(rocksdb::FlushOptions(), {storage.keys(), storage.bucket_keys()}).ok());
  ASSERT_TRUE(users->CompactRange(rocksdb::CompactRangeOptions(), storage.bucket_keys(), nullptr, nullptr).ok());
  const testing::ErasureScan held = testing::scan_files_settled(path, u);
  ASSERT_GE(held.user_keys.size(), 2u) << held.summary();
  purge_erasing(u, held);
}

// A bucket that cannot split (a stored key of it that does not unwrap)
// stops the splits, not the new users: their keys are stored in the shape
// as it is, verify() names the bad key, and once it is whole again the
// next write splits the bucket. (Before, every write of a new key failed,
// in every group.)
TEST_F(KeyStore, ABucketThatCannotSplitStopsTheSplitsNotTheNewUsers) {
  const std::uint64_t u = user_in_bucket(0, 0xA1B2C3D4E5F60000ULL);
  signal(u, 1.0);
  ASSERT_OK(db->flush());
  std::string wrapped;
  ASSERT_OK(storage.get(storage.keys(), encode_key_store_key(u), &wrapped));
  std::string bad = wrapped;
  bad[40] = static_cast<char>(bad[40] ^ 1);
  ASSERT_TRUE(users->Put(rocksdb::WriteOptions(), storage.keys(), encode_key_store_key(u), bad).ok());
  const SplitTo split(65'537);
  for (std::uint16_t g = 1000; g < 1005; ++g) {
    const std::uint64_t x = user_in_bucket(g, 77);
    signal(x, 1.0);
    ASSERT_OK(db->flush());  // a new user of another group
    Result<std::optional<UserKey>> k = read_user_key(storage, x);
    ASSERT_OK(k);
    EXPECT_TRUE(k->has_value()) << x;
  }
  EXPECT_EQ(stored_shape(storage).split, 0u);
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  ASSERT_FALSE(v->ok());
  EXPECT_NE(v->problems.front().find("user " + std::to_string(u) + "'s ledger key does not unwrap"), std::string::npos)
      << v->problems.front();
  ASSERT_TRUE(users->Put(rocksdb::WriteOptions(), storage.keys(), encode_key_store_key(u), wrapped).ok());
  signal(user_in_bucket(1005, 77), 1.0);
  ASSERT_OK(db->flush());
  EXPECT_EQ(stored_shape(storage).split, 1u);
  v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
}

// A split during a purge's erasure deletes a key of a group the erasure is
// compacting: a reader at a snapshot taken before the split still finds
// it (RocksDB applies the erasure's filter whatever the snapshots; the
// filter keeps what was current when the erasure began), and the purged
// user's keys are gone all the same.
TEST_F(KeyStore, ASplitDuringAnErasureKeepsTheKeysASnapshotTakenBeforeItReads) {
  const std::uint64_t u = user_in_bucket(0, 0xA1B2C3D4E5F60000ULL);
  const std::uint64_t w = user_in_bucket(0, u + 1);
  signal(u, 2.0);
  signal(w, 1.5);
  ASSERT_OK(db->flush());
  ASSERT_TRUE(users->Flush(rocksdb::FlushOptions(), {storage.keys(), storage.bucket_keys()}).ok());
  const testing::ErasureScan held = testing::scan_files_settled(path, u);
  ASSERT_OK(db->leave_community_layer(u));
  const rocksdb::Snapshot* before_split = nullptr;
  Status split_status;
  bool done = false;
  Storage::step_for_testing = [&](std::string_view task, int step) {
    if (task != "erasure" || step != 1 || done) return;
    done = true;
    before_split = users->GetSnapshot();
    const SplitTo split(65'537);
    split_status = store_user_keys(storage, {{0x5151515151ULL, new_key()}}, "a split during the erasure");
  };
  Result<PurgeReceipt> r = db->purge_community_contributions(u);
  Storage::step_for_testing = nullptr;
  ASSERT_OK(r);
  ASSERT_TRUE(done);
  ASSERT_OK(split_status);
  EXPECT_EQ(stored_shape(storage).split, 1u);
  Result<std::optional<UserKey>> then = read_user_key(storage, w, before_split);
  EXPECT_TRUE(then.ok() && then->has_value()) << "w's key at a snapshot taken before the split: "
                                               << then.status().message();
  Result<std::optional<UserKey>> now = read_user_key(storage, w);
  EXPECT_TRUE(now.ok() && now->has_value()) << now.status().message();
  users->ReleaseSnapshot(before_split);
  for (const std::string& f : scan_files(path, u, held.user_keys).found) ADD_FAILURE() << "after the purge: " << f;
}

// The records' versions in the sealed ledger: [version 1, version 2].
std::array<int, 2> record_versions(Storage& storage) {
  std::array<int, 2> n{};
  auto it = storage.iterator(storage.sealed_ledger());
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const auto v = static_cast<unsigned char>(it->value()[0]);
    EXPECT_TRUE(v == 1 || v == 2) << "record version " << int(v);
    if (v == 1 || v == 2) ++n[v - 1];
  }
  return n;
}

// A Db whose keys were stored before HKDF (Hmac keys, wrapped_keys version
// 3, records of version 1 sealed with the raw key) is upgraded in place: it
// opens and verifies as it was; each old key keeps its pseudonym (the index
// still finds the user's old records) and seals its new records as version
// 2 under its HKDF subkey; a new user's key is an HKDF key (version 4); a
// purge of an old user subtracts both versions exactly and erases the key;
// re-materialization reads both.
TEST_F(KeyStore, KeysStoredBeforeHkdfAreReadAndUpgradedInPlace) {
  const std::uint64_t u = 0xA1B2C3D4E5F60718ULL, w = 31;
  hmac_keys_for_testing() = true;
  signal(u, 2.0);
  signal(w, 1.0);
  ASSERT_OK(db->flush());
  EXPECT_EQ(record_versions(storage), (std::array<int, 2>{2, 0}));
  {
    // What the Dbs before HKDF wrote: the pseudonym is HMAC-SHA256(raw key,
    // "tidal ledger pseudonym v1"), the record AES-256-GCM under the raw key.
    Result<std::optional<UserKey>> k = read_user_key(storage, u);
    ASSERT_TRUE(k.ok() && k->has_value());
    const std::string_view raw = (*k)->bytes_for_testing();
    unsigned char mac[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    const std::string label = "tidal ledger pseudonym v1";
    ASSERT_NE(HMAC(EVP_sha256(), raw.data(), static_cast<int>(raw.size()),
                   reinterpret_cast<const unsigned char*>(label.data()), label.size(), mac, &n),
              nullptr);
    const std::string pseudonym(reinterpret_cast<const char*>(mac), kPseudonymSize);
    EXPECT_EQ((*k)->pseudonym(), pseudonym);
    int found = 0;
    auto it = storage.iterator(storage.sealed_ledger());
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      if (it->key().ToStringView().substr(8) != pseudonym) continue;
      ++found;
      std::string plain, resealed;
      const std::optional<UserKey> as_raw = UserKey::decode("\x01" + std::string(raw));
      EXPECT_TRUE(as_raw->open(it->key().ToStringView(), it->value().ToStringView(), &plain));
    }
    EXPECT_EQ(found, 1);
  }
  ASSERT_OK(db->close());
  hmac_keys_for_testing() = false;
  db = open_db(path, options);
  Storage& reopened = Db::Impl::storage_for_testing(*db);
  std::string wrapped;
  ASSERT_OK(reopened.get(reopened.keys(), encode_key_store_key(u), &wrapped));
  EXPECT_EQ(wrapped_key_header(wrapped)->version, 3u);
  Result<std::optional<UserKey>> old = read_user_key(reopened, u);
  ASSERT_TRUE(old.ok() && old->has_value());
  EXPECT_EQ((*old)->derivation(), KeyDerivation::Hmac);
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
  signal(u, 3.0);  // the old key's next record
  signal(77, 4.0);  // a new user's
  ASSERT_OK(db->flush());
  EXPECT_EQ(record_versions(reopened), (std::array<int, 2>{2, 2}));
  ASSERT_OK(reopened.get(reopened.keys(), encode_key_store_key(77), &wrapped));
  EXPECT_EQ(wrapped_key_header(wrapped)->version, 4u);
  Result<std::optional<UserKey>> fresh = read_user_key(reopened, 77);
  ASSERT_TRUE(fresh.ok() && fresh->has_value());
  EXPECT_EQ((*fresh)->derivation(), KeyDerivation::Hkdf);
  v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
  Result<RematerializeReport> re = db->rematerialize_shared_aggregates();
  ASSERT_OK(re);
  ASSERT_TRUE(reopened.db(Storage::Engine::Users)
                  ->Flush(rocksdb::FlushOptions(), {reopened.keys(), reopened.bucket_keys()})
                  .ok());
  const testing::ErasureScan held = testing::scan_files_settled(path, u);
  ASSERT_GE(held.user_keys.size(), 1u) << held.summary();
  purge_erasing(u, held, 5.0);  // both records, the old and the new
  v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
  old = read_user_key(reopened, u);
  ASSERT_OK(old);
  EXPECT_FALSE(old->has_value());
}

// A key store written before buckets split (each key wrapped as version 2,
// no shape stored): its keys read as before, the first write of a new key
// counts them, its buckets split, and a purge erases every key that wrapped
// the purged user's; the count follows the purge.
TEST_F(KeyStore, AKeyStoreWrittenBeforeBucketsSplitIsCountedSplitAndErased) {
  hmac_keys_for_testing() = true;  // its keys were stored before HKDF too
  const std::uint64_t u = user_in_bucket(2, 0xA1B2C3D4E5F60000ULL);
  std::vector<std::uint64_t> all{u};
  for (std::uint64_t from = 1; all.size() < 30; from = all.back() + 1) all.push_back(user_in_bucket(2, from));
  for (std::uint64_t x = 1; x <= 50; ++x) all.push_back(x);
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  for (std::uint64_t x : all) signal(x, x == u ? 2.0 : 1.5);
  ASSERT_OK(db->flush());
  std::vector<std::optional<UserKey>> before;
  ASSERT_OK(read_user_keys(storage, all, &before));
  ASSERT_OK(db->close());
  hmac_keys_for_testing() = false;
  {
    // As a build before the splits left it.
    RawDb raw(path);
    ASSERT_TRUE(raw.ok());
    rocksdb::WriteBatch batch;
    for (std::size_t i = 0; i < all.size(); ++i) {
      std::string stored;
      ASSERT_TRUE(raw.db(RawDb::kBucketKeys)
                      ->Get(rocksdb::ReadOptions(), raw.cf(RawDb::kBucketKeys), encode_bucket_key(key_bucket(all[i])),
                            &stored)
                      .ok());
      const std::optional<BucketKey> bucket = BucketKey::decode(stored);
      ASSERT_TRUE(bucket && before[i]);
      std::string v2(1, '\x02');
      put_u32_be(&v2, bucket->generation());
      std::string aad = encode_key_store_key(all[i]);
      put_u32_be(&aad, bucket->generation());
      ASSERT_OK(seal_v1_for_testing(bucket->bytes_for_testing(), aad, before[i]->bytes_for_testing(), &v2));
      ASSERT_TRUE(batch.Put(raw.cf(RawDb::kKeys), encode_key_store_key(all[i]), v2).ok());
    }
    ASSERT_TRUE(batch.Delete(raw.cf(RawDb::kMeta), kKeyShapeKey).ok());
    ASSERT_TRUE(raw.db(RawDb::kKeys)->Write(rocksdb::WriteOptions(), &batch).ok());
  }
  db = open_db(path, options);
  Storage& reopened = Db::Impl::storage_for_testing(*db);
  std::string wrapped;
  ASSERT_OK(reopened.get(reopened.keys(), encode_key_store_key(u), &wrapped));
  ASSERT_EQ(wrapped.size(), kWrappedKeySizeV2);
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
  {
    const SplitTo split(65'536 + 3);  // buckets 0, 1 and 2 (u's group)
    signal(30'000'000, 0.5);
    ASSERT_OK(db->flush());
  }
  EXPECT_EQ(stored_shape(reopened).split, 3u);
  EXPECT_EQ(stored_shape(reopened).keys, all.size() + 1);
  ASSERT_OK(reopened.get(reopened.keys(), encode_key_store_key(u), &wrapped));
  EXPECT_EQ(wrapped_key_header(wrapped)->version, 3u);
  EXPECT_EQ(wrapped_key_header(wrapped)->depth, 17u);
  std::vector<std::optional<UserKey>> after;
  ASSERT_OK(read_user_keys(reopened, all, &after));
  for (std::size_t i = 0; i < all.size(); ++i) {
    ASSERT_TRUE(after[i].has_value()) << all[i];
    EXPECT_EQ(after[i]->bytes_for_testing(), before[i]->bytes_for_testing()) << "user " << all[i];
  }
  ASSERT_TRUE(reopened.db(Storage::Engine::Users)
                  ->Flush(rocksdb::FlushOptions(), {reopened.keys(), reopened.bucket_keys()})
                  .ok());
  const testing::ErasureScan held = testing::scan_files_settled(path, u);
  ASSERT_GE(held.user_keys.size(), 2u) << held.summary();
  purge_erasing(u, held, 2.0);
  EXPECT_EQ(stored_shape(reopened).keys, all.size());
  v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
}

// A bulk purge's erasure compacts a level of many bucket-key files in two
// halves side by side: the keys the purge replaced are gone from the files
// of both halves (the first file's and the last file's users' here), and
// every file that held one was replaced.
TEST_F(KeyStore, ABulkPurgesErasureOfALevelInTwoHalvesErasesTheKeysOfBoth) {
  constexpr std::uint64_t kUsers = 100'000;
  for (std::uint64_t i = 1; i <= kUsers; ++i) {
    signal(i, 1.5);
    if (i % 10'000 == 0) ASSERT_OK(db->flush());
  }
  ASSERT_OK(db->flush());
  ASSERT_TRUE(users->Flush(rocksdb::FlushOptions(), storage.bucket_keys()).ok());
  rocksdb::CompactRangeOptions all;
  all.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForce;
  ASSERT_TRUE(users->CompactRange(all, storage.bucket_keys(), nullptr, nullptr).ok());
  rocksdb::ColumnFamilyMetaData meta;
  users->GetColumnFamilyMetaData(storage.bucket_keys(), &meta);
  const rocksdb::LevelMetaData& last = meta.levels.back();
  ASSERT_GE(last.files.size(), 8u) << "the bucket keys should fill a level of many files";
  // A user of the level's first file and one of its last, and users of
  // every other file between.
  std::vector<std::uint64_t> purged;
  const auto user_of = [&](const std::string& smallest) {
    return user_in_bucket(*bucket_key_group(smallest), 1);
  };
  for (const rocksdb::SstFileMetaData& f : last.files) purged.push_back(user_of(f.smallestkey));
  std::sort(purged.begin(), purged.end());
  purged.erase(std::unique(purged.begin(), purged.end()), purged.end());
  const std::uint64_t first = user_of(last.files.front().smallestkey);
  const std::uint64_t end = user_of(last.files.back().smallestkey);
  const testing::ErasureScan held_first = testing::scan_files_settled(path, first);
  const testing::ErasureScan held_end = testing::scan_files_settled(path, end);
  ASSERT_EQ(held_first.user_keys.size(), 1u) << held_first.summary();
  ASSERT_EQ(held_end.user_keys.size(), 1u) << held_end.summary();
  for (std::uint64_t u : purged) ASSERT_OK(db->leave_community_layer(u));
  Result<std::vector<PurgeReceipt>> r = db->purge_community_contributions(std::span<const std::uint64_t>(purged));
  ASSERT_OK(r);
  for (const PurgeReceipt& p : *r) EXPECT_TRUE(p.erasure_complete) << p.user_id;
  for (const std::string& f : scan_files(path, first, held_first.user_keys).found) ADD_FAILURE() << "first file's user: " << f;
  for (const std::string& f : scan_files(path, end, held_end.user_keys).found) ADD_FAILURE() << "last file's user: " << f;
  rocksdb::ColumnFamilyMetaData after;
  users->GetColumnFamilyMetaData(storage.bucket_keys(), &after);
  std::set<std::string> live;
  for (const auto& level : after.levels) {
    for (const auto& f : level.files) live.insert(f.name);
  }
  for (const rocksdb::SstFileMetaData& f : last.files) EXPECT_EQ(live.count(f.name), 0u) << f.name << " was not rewritten";
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
}

// New users signalling from many threads while their keys' writes split
// buckets, and purges beside them: every score exact, every key readable,
// the ledger whole.
class SplitStress : public ::testing::TestWithParam<int> {};

TEST_P(SplitStress, ConcurrentNewUsersSplittingBucketsAndPurgesStayExact) {
  const int threads = GetParam();
  TempDir dir;
  auto db = open_db(dir.sub("db"), [] {
    Options o;
    o.aggregate_write_period = std::chrono::milliseconds(2);
    o.sync_writes = false;
    return o;
  }());
  Storage& storage = Db::Impl::storage_for_testing(*db);
  constexpr std::uint64_t kLeavers = 8;
  for (std::uint64_t u = 1; u <= kLeavers; ++u) {
    for (std::uint64_t i = 0; i < 20; ++i) ASSERT_OK(db->signal_with_context({u, i % 5, 0.5}, {{1}}));
  }
  ASSERT_OK(db->flush());
  const SplitTo split(65'536 + 60'000);
  constexpr std::uint64_t kUsersEach = 60;
  std::vector<std::thread> signalers;
  for (int t = 0; t < threads; ++t) {
    signalers.emplace_back([&db, t] {
      for (std::uint64_t i = 0; i < kUsersEach; ++i) {
        const std::uint64_t user = 1'000'000 + static_cast<std::uint64_t>(t) * kUsersEach + i;
        EXPECT_TRUE(db->signal_with_context({user, i % 5, 0.25}, {{1}}).ok());
      }
    });
  }
  for (std::uint64_t u = 1; u <= kLeavers; ++u) {
    ASSERT_OK(db->leave_community_layer(u));
    Result<PurgeReceipt> r = db->purge_community_contributions(u);
    ASSERT_OK(r);
    EXPECT_EQ(r->cohort_weight_removed, 10.0) << u;
  }
  for (auto& t : signalers) t.join();
  ASSERT_OK(db->flush());
  EXPECT_GT(stored_shape(storage).buckets(), 65'536u) << "no bucket split";
  for (std::uint64_t item = 0; item < 5; ++item) {
    // threads x kUsersEach / 5 signals of 0.25 on each item, exact.
    EXPECT_EQ(value_of(db->cohort_score(1, item)), 0.25 * threads * kUsersEach / 5) << "item " << item;
  }
  std::vector<std::uint64_t> users;
  for (std::uint64_t i = 0; i < static_cast<std::uint64_t>(threads) * kUsersEach; ++i) users.push_back(1'000'000 + i);
  std::vector<std::optional<UserKey>> keys;
  ASSERT_OK(read_user_keys(storage, users, &keys));
  for (std::size_t i = 0; i < users.size(); ++i) EXPECT_TRUE(keys[i].has_value()) << users[i];
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
  Result<RematerializeReport> m = db->rematerialize_shared_aggregates(false);
  ASSERT_OK(m);
  EXPECT_TRUE(m->mismatches.empty());
}

INSTANTIATE_TEST_SUITE_P(Threads, SplitStress, ::testing::Values(16, 64),
                         [](const ::testing::TestParamInfo<int>& p) { return std::to_string(p.param); });

// A single purge's erasure rewrites only the bucket keys' files that hold
// the replaced key of the purged user's bucket, each at its own level: not
// the files under a level-0 file's range, which spans nearly all buckets.
// Every other file stays as it was, the old key is gone from every file,
// and the bucket's other users' keys, wrapped again with its new key,
// still open their records.
TEST_F(KeyStore, APurgesErasureRewritesOnlyTheBucketKeyFilesThatHoldTheKey) {
  // Users in most buckets, each with a key (their first contribution), the
  // bucket keys compacted into files of the last level.
  constexpr std::uint64_t kUsers = 100'000;
  for (std::uint64_t i = 1; i <= kUsers; ++i) {
    signal(i, 1.5);
    if (i % 10'000 == 0) ASSERT_OK(db->flush());
  }
  const std::uint64_t u = kUsers / 2;
  const std::uint16_t bucket = key_bucket(u);
  const std::uint64_t sibling = user_in_bucket(bucket, kUsers + 1);  // u's bucket, u's key store neighbour
  signal(sibling, 2.5);
  ASSERT_OK(db->flush());
  ASSERT_TRUE(users->Flush(rocksdb::FlushOptions(), storage.bucket_keys()).ok());
  rocksdb::CompactRangeOptions all;
  all.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForce;
  ASSERT_TRUE(users->CompactRange(all, storage.bucket_keys(), nullptr, nullptr).ok());
  // Then new keys of buckets on both sides of u's (one purge gives both
  // one, and its erasure flushes them into a level-0 file).
  std::vector<std::uint64_t> sides{user_in_bucket(static_cast<std::uint16_t>(bucket - 700), 1),
                                   user_in_bucket(static_cast<std::uint16_t>(bucket + 700), 1)};
  std::sort(sides.begin(), sides.end());
  for (std::uint64_t x : sides) ASSERT_OK(db->leave_community_layer(x));
  ASSERT_OK(db->purge_community_contributions(std::span<const std::uint64_t>(sides)));
  ASSERT_TRUE(users->Flush(rocksdb::FlushOptions(), storage.bucket_keys()).ok());
  const auto files = [&] {
    rocksdb::ColumnFamilyMetaData meta;
    users->GetColumnFamilyMetaData(storage.bucket_keys(), &meta);
    std::vector<std::pair<int, rocksdb::SstFileMetaData>> out;
    for (const auto& level : meta.levels) {
      for (const auto& f : level.files) out.emplace_back(level.level, f);
    }
    return out;
  };
  const auto before = files();
  std::size_t deepest = 0, level0 = 0;
  for (const auto& [level, f] : before) (level == 0 ? level0 : deepest) += 1;
  ASSERT_GE(deepest, 4u) << "the bucket keys should span several files";
  ASSERT_GE(level0, 1u);
  const std::string key = encode_bucket_key(bucket);
  ASSERT_TRUE(std::any_of(before.begin(), before.end(), [&](const auto& lf) {
    return lf.first == 0 && lf.second.smallestkey < key && key < lf.second.largestkey;
  })) << "a level-0 file should span the purged user's bucket";

  const testing::ErasureScan held = testing::scan_files_settled(path, u);
  ASSERT_EQ(held.user_keys.size(), 1u) << held.summary();
  ASSERT_OK(db->leave_community_layer(u));
  Result<PurgeReceipt> r = db->purge_community_contributions(u);
  ASSERT_OK(r);
  EXPECT_EQ(r->entries_removed, 2u);  // cohort 4 and community 77
  EXPECT_TRUE(r->erasure_complete);
  for (const std::string& f : scan_files(path, u, held.user_keys).found) ADD_FAILURE() << "after the purge: " << f;

  // Below level 0, only the file whose range holds the bucket is rewritten.
  std::set<std::string> now;
  for (const auto& [level, f] : files()) now.insert(f.name);
  std::size_t kept = 0;
  for (const auto& [level, f] : before) {
    if (level == 0) continue;
    const bool holds = f.smallestkey <= key && key <= f.largestkey;
    if (holds) {
      EXPECT_EQ(now.count(f.name), 0u) << "the file that held the bucket's key, " << f.name << ", is still live";
    } else {
      EXPECT_EQ(now.count(f.name), 1u) << "level-" << level << " file " << f.name
                                       << ", which does not hold the bucket's key, was rewritten";
      ++kept;
    }
  }
  EXPECT_EQ(kept, deepest - 1);
  // Everyone else's key still opens their records: the sibling's too,
  // wrapped again with the bucket's new key.
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
  ASSERT_OK(db->leave_community_layer(sibling));
  Result<PurgeReceipt> o = db->purge_community_contributions(sibling);
  ASSERT_OK(o);
  EXPECT_EQ(o->entries_removed, 2u);
  EXPECT_EQ(o->cohort_weight_removed, 2.5);
}

// A key that a purge could not delete (here: another user of the bucket has
// a wrapped key that does not unwrap, so the bucket cannot get a new key),
// then replaced by the user's next contribution after a rejoin, wrapped
// with the same bucket key: the purged key's wrapped copy is still in the
// files, and so is that bucket key. The erasure gives the bucket a new key
// all the same, and erases the old one: on return the purged key cannot be
// unwrapped from the files. (Before, the erasure left a replaced key alone,
// and the purged records opened with the key the files still held.)
TEST(SealedLedger, AKeyThatReplacedAnUndeletedPurgedKeyGetsItsBucketANewKey) {
  TempDir dir;
  const std::string path = dir.sub("db");
  const std::uint64_t u = 0xA1B2C3D4E5F60721ULL;
  const std::uint64_t sibling = user_in_bucket(key_bucket(u), 1);
  {
    auto db = open_db(path, manual_writes());
    for (std::uint64_t x : {u, sibling}) {
      ASSERT_OK(db->join_community(x, 77));
      ASSERT_OK(db->signal_with_context({x, 1, 1.5}, {{4}}));
    }
    ASSERT_OK(db->close());  // the keys in SST files
  }
  std::string sibling_key;  // the sibling's wrapped key, set aside
  const auto put_sibling = [&](const std::string& value) {
    RawDb raw(path);
    ASSERT_TRUE(raw.ok());
    ASSERT_TRUE(raw.db(RawDb::kKeys)
                    ->Put(rocksdb::WriteOptions(), raw.cf(RawDb::kKeys), encode_key_store_key(sibling), value)
                    .ok());
  };
  {
    RawDb raw(path);
    ASSERT_TRUE(raw.ok());
    ASSERT_TRUE(raw.db(RawDb::kKeys)
                    ->Get(rocksdb::ReadOptions(), raw.cf(RawDb::kKeys), encode_key_store_key(sibling), &sibling_key)
                    .ok());
  }
  std::string broken = sibling_key;
  broken[30] = static_cast<char>(broken[30] ^ 1);
  put_sibling(broken);
  const testing::ErasureScan held = testing::scan_files_settled(path, u);
  ASSERT_EQ(held.user_keys.size(), 1u) << held.summary();
  {
    auto db = open_db(path, manual_writes());
    ASSERT_OK(db->leave_community_layer(u));
    Result<PurgeReceipt> r = db->purge_community_contributions(u);
    ASSERT_FALSE(r.ok()) << "the key was deleted although its bucket could not get a new key";
    EXPECT_EQ(value_of(db->cohort_score(4, 1)), 1.5) << "the purge's subtraction is done";
    ASSERT_OK(db->rejoin_community_layer(u));
    ASSERT_OK(db->signal_with_context({u, 1, 0.25}, {{4}}));
    ASSERT_OK(db->flush());
    (void)db->close();
  }
  put_sibling(sibling_key);
  auto db = open_db(path, manual_writes());  // finishes the erasure
  Result<std::vector<PurgeReceipt>> receipts = db->purge_receipts(u);
  ASSERT_OK(receipts);
  ASSERT_EQ(receipts->size(), 1u);
  EXPECT_TRUE(receipts->front().erasure_complete);
  // The purged key only (u's key since the rejoin is rightly there): the
  // scan is of a user with no record of its own, given that key to find.
  constexpr std::uint64_t kNobody = 0xFFFF'FFFF'FFFF'FFF0ULL;
  for (const std::string& f : scan_files(path, kNobody, held.user_keys).found) {
    ADD_FAILURE() << "after the erasure, the purged key: " << f;
  }
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
  EXPECT_EQ(value_of(db->cohort_score(4, 1)), 1.75);  // the sibling's 1.5 and u's 0.25 after the rejoin
}

// A purge flushes the users engine (its WALs, its memtables) only while they
// may hold a bucket key it replaces: one stored since the last such flush
// (a bucket's first key, stored with its first user's), or any key in the
// first purge after an open. The purge's own new bucket key is not one. A
// purge of a user whose bucket's key is in SST files already leaves the
// WAL and the memtables as they are, and the replaced key is gone from
// every file all the same.
TEST(SealedLedger, APurgeFlushesTheUsersEngineOnlyWhileItsWalsMayHoldAPurgedKey) {
  TempDir dir;
  const std::string path = dir.sub("db");
  auto db = open_db(path, manual_writes());
  Storage& storage = Db::Impl::storage_for_testing(*db);
  rocksdb::DB* users = storage.db(Storage::Engine::Users);
  // The users engine's WAL now: a flush switches to a new one.
  const auto wal = [&] {
    std::unique_ptr<rocksdb::LogFile> log;
    EXPECT_TRUE(users->GetCurrentWalFile(&log).ok());
    return log == nullptr ? 0 : log->LogNumber();
  };
  const auto signal = [&](std::uint64_t u) {
    ASSERT_OK(db->join_community(u, 77));
    ASSERT_OK(db->signal_with_context({u, 1, 1.5}, {{4}}));
  };
  // Purges `u`; true when it flushed the users engine. Its key is gone.
  const auto purge = [&](std::uint64_t u) {
    const testing::ErasureScan held = testing::scan_files_settled(path, u);
    EXPECT_EQ(held.user_keys.size(), 1u) << held.summary();
    EXPECT_OK(db->leave_community_layer(u));
    const std::uint64_t before = wal();
    Result<PurgeReceipt> r = db->purge_community_contributions(u);
    EXPECT_OK(r);
    if (r.ok()) {
      EXPECT_EQ(r->entries_removed, 2u);
    }
    for (const std::string& f : scan_files(path, u, held.user_keys).found) {
      ADD_FAILURE() << "user " << u << ", after the purge: " << f;
    }
    return wal() != before;
  };
  const std::uint64_t a = 11, b = 12, c = 13, d = 14;
  signal(a);
  signal(b);
  ASSERT_OK(db->flush());  // a's and b's keys and their buckets' keys stored, in the WAL
  EXPECT_TRUE(purge(a)) << "a's bucket's key was in the WAL, and the purge did not flush it";
  EXPECT_FALSE(purge(b)) << "b's bucket's key was in an SST file since a's purge, and b's purge flushed the users engine";
  signal(c);
  ASSERT_OK(db->flush());  // c's bucket's key, in the WAL
  EXPECT_TRUE(purge(c)) << "c's bucket's key was in the WAL, and the purge did not flush it";
  signal(d);
  ASSERT_OK(db->flush());
  db.reset();  // a clean close flushes: d's key is in an SST file
  db = open_db(path, manual_writes());
  users = Db::Impl::storage_for_testing(*db).db(Storage::Engine::Users);
  EXPECT_TRUE(purge(d)) << "the first purge after an open did not flush the users engine";
}

// The erasure compacts only the bucket keys' files that can hold a replaced
// key. Two rules tell it a file cannot:
//   - its filter of the buckets whose keys it holds rules the purged user's
//     bucket out (a level-0 file written before the bucket's key, spanning
//     its range);
//   - all of its entries came after the bucket's replaced key was written
//     (a level-0 file of keys made later, spanning its range), which the
//     erasure needs when the filter does not rule the bucket out (~1 %).
// Such a file stays as it is; one that holds the replaced key is replaced.
TEST_F(KeyStore, AnErasureLeavesAloneTheBucketKeyFilesThatCannotHoldAReplacedKey) {
  // Users of buckets no earlier user has, so that each first signal writes
  // its bucket's first key.
  std::set<std::uint16_t> used;
  std::uint64_t next_id = 1;
  const auto fresh_user = [&] {
    while (used.count(key_bucket(next_id)) != 0) ++next_id;
    used.insert(key_bucket(next_id));
    return next_id++;
  };
  const auto signal = [&](std::uint64_t u) {
    ASSERT_OK(db->join_community(u, 77));
    ASSERT_OK(db->signal_with_context({u, 1, 1.5}, {{4}}));
  };
  const auto purge = [&](std::uint64_t u) {
    const testing::ErasureScan held = testing::scan_files_settled(path, u);
    ASSERT_EQ(held.user_keys.size(), 1u) << held.summary();
    ASSERT_OK(db->leave_community_layer(u));
    Result<PurgeReceipt> r = db->purge_community_contributions(u);
    ASSERT_OK(r);
    EXPECT_EQ(r->entries_removed, 2u);
    for (const std::string& f : scan_files(path, u, held.user_keys).found) {
      ADD_FAILURE() << "user " << u << ", after the purge: " << f;
    }
  };
  const auto level0 = [&] {
    rocksdb::ColumnFamilyMetaData meta;
    users->GetColumnFamilyMetaData(storage.bucket_keys(), &meta);
    std::set<std::string> out;
    for (const auto& f : meta.levels[0].files) out.insert(f.name);
    return out;
  };
  // Into SST files, out of the WALs: the purges then do not flush (a
  // fourth level-0 file would have RocksDB compact them all away).
  const auto flush_keys = [&] {
    ASSERT_OK(db->flush());
    ASSERT_OK(storage.flush_past_wals(Storage::Engine::Users));
  };
  // How many of `files` their filters leave open to hold the key of u's bucket.
  const auto filters_allowing = [&](const std::set<std::string>& files, std::uint64_t u) {
    rocksdb::TablePropertiesCollection properties;
    EXPECT_TRUE(users->GetPropertiesOfAllTables(storage.bucket_keys(), &properties).ok());
    std::size_t allow = 0, seen = 0;
    for (const auto& [file, p] : properties) {
      if (files.count("/" + std::filesystem::path(file).filename().string()) == 0) continue;
      ++seen;
      EXPECT_TRUE(p->user_collected_properties.count("tidal.bucket_values.v2")) << file << " has no filter";
      if (Storage::may_hold_keys_of(*p, {key_bucket(u)})) ++allow;
    }
    EXPECT_EQ(seen, files.size());
    return allow;
  };
  const auto after = [&](const std::set<std::string>& before) {
    std::set<std::string> out;
    for (const std::string& f : level0()) {
      if (before.count(f) == 0) out.insert(f);
    }
    return out;
  };
  // Old bucket keys, in level-0 files after a first purge.
  std::vector<std::uint64_t> old_users;
  for (int i = 0; i < 1'000; ++i) {
    old_users.push_back(fresh_user());
    signal(old_users.back());
  }
  flush_keys();
  purge(old_users[500]);
  const std::set<std::string> older = level0();
  ASSERT_FALSE(older.empty());
  // A bucket key written after them, in their range, which their filters
  // rule out (as they do ~99 % of buckets), in a level-0 file of its own.
  std::uint64_t p = 0;
  for (int i = 0; p == 0 && i < 100; ++i) {
    const std::uint64_t candidate = fresh_user();
    if (filters_allowing(older, candidate) == 0) p = candidate;
  }
  ASSERT_NE(p, 0u) << "the older files' filters rule out none of 100 buckets";
  // What a filter cannot vouch for rules nothing out: one that counted
  // fewer values than its file holds, or one under another layout's name.
  {
    rocksdb::TablePropertiesCollection properties;
    ASSERT_TRUE(users->GetPropertiesOfAllTables(storage.bucket_keys(), &properties).ok());
    for (const auto& [file, held] : properties) {
      if (older.count("/" + std::filesystem::path(file).filename().string()) == 0) continue;
      rocksdb::TableProperties copy = *held;
      ++copy.num_entries;
      EXPECT_TRUE(Storage::may_hold_keys_of(copy, {key_bucket(p)}))
          << file << ": a filter that missed a value ruled out a key";
      copy = *held;
      auto filter = copy.user_collected_properties.extract("tidal.bucket_values.v2");
      ASSERT_FALSE(filter.empty()) << file;
      copy.user_collected_properties.emplace("tidal.bucket_values.v3", filter.mapped());
      EXPECT_TRUE(Storage::may_hold_keys_of(copy, {key_bucket(p)}))
          << file << ": a filter of another layout ruled out a key";
    }
  }
  signal(p);
  flush_keys();
  const std::set<std::string> with_p = after(older);
  ASSERT_FALSE(with_p.empty());
  purge(p);
  for (const std::string& f : older) {
    EXPECT_EQ(level0().count(f), 1u) << "level-0 file " << f << ", whose filter rules out the purged bucket, was rewritten";
  }
  for (const std::string& f : with_p) {
    EXPECT_EQ(level0().count(f), 0u) << "level-0 file " << f << ", which held the replaced key, is still live";
  }
  // New bucket keys, spread the same way, flushed into a level-0 file,
  // after the others went to the last level.
  ASSERT_TRUE(users->CompactRange(rocksdb::CompactRangeOptions(), storage.bucket_keys(), nullptr, nullptr).ok());
  ASSERT_TRUE(level0().empty());
  // (Not past the WALs: the purges' bound on when the older keys were
  // written stays before these.)
  std::vector<std::uint64_t> new_users;
  for (int i = 0; i < 1'000; ++i) {
    new_users.push_back(fresh_user());
    signal(new_users.back());
  }
  ASSERT_OK(db->flush());
  ASSERT_TRUE(users->Flush(rocksdb::FlushOptions(), storage.bucket_keys()).ok());
  const std::set<std::string> newer = level0();
  ASSERT_FALSE(newer.empty());
  // An old bucket that the newer file's filter does not rule out (a false
  // positive): only the order of the writes tells the erasure to leave it.
  std::uint64_t q = 0;
  for (std::size_t i = 0; q == 0 && i < old_users.size(); ++i) {
    if (i != 500 && filters_allowing(newer, old_users[i]) == newer.size()) q = old_users[i];
  }
  ASSERT_NE(q, 0u) << "the newer file's filter ruled out all 999 older buckets (expected ~1 % false positives)";
  purge(q);
  for (const std::string& f : newer) {
    EXPECT_EQ(level0().count(f), 1u) << "level-0 file " << f << ", written after the replaced key, was rewritten";
  }
  purge(new_users[700]);
  for (const std::string& f : newer) {
    EXPECT_EQ(level0().count(f), 0u) << "level-0 file " << f << ", which held the replaced key, is still live";
  }
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
}

// Backups carry the key store of their moment: one made after a purge holds
// no trace of the purged user's key; one made before holds it, and its
// restore erases it again (the journal's purge, replayed) before it serves.
TEST(SealedLedger, ABackupAfterAPurgeHoldsNoKeyAndARestoreOfAnEarlierOneErasesIt) {
  TempDir dir;
  Options options = manual_writes();
  options.journal = true;
  const std::uint64_t u = 0xA1B2C3D4E5F60718ULL, other = 0x1122334455667788ULL;
  auto db = open_db(dir.sub("db"), options);
  for (std::uint64_t user : {u, other}) {
    ASSERT_OK(db->join_community(user, 77));
    for (std::uint64_t i = 0; i < 5; ++i) ASSERT_OK(db->signal_with_context({user, i, 1.5}, {{4}}));
  }
  ASSERT_OK(db->flush());
  ASSERT_OK(db->backup(dir.sub("before")));
  const testing::ErasureScan in_backup = scan_files(dir.sub("before"), u);
  ASSERT_EQ(in_backup.user_keys.size(), 1u) << "the backup lacks the user's key";
  ASSERT_FALSE(in_backup.found.empty()) << in_backup.summary();
  ASSERT_OK(db->leave_community_layer(u));
  ASSERT_OK(db->purge_community_contributions(u));
  ASSERT_OK(db->backup(dir.sub("after")));
  for (const std::string& f : scan_files(dir.sub("after"), u, in_backup.user_keys).found) {
    ADD_FAILURE() << "in the backup made after the purge: " << f;
  }
  Result<std::vector<JournalEntry>> journal = db->read_journal(0, 1 << 20);
  ASSERT_OK(journal);
  ASSERT_OK(db->close());

  auto restored = open_db(dir.sub("before"), options);
  ASSERT_OK(restored->replay_journal(*journal));
  ASSERT_OK(restored->finish_recovery());
  for (const std::string& f : scan_files(dir.sub("before"), u, in_backup.user_keys).found) {
    ADD_FAILURE() << "in the restored Db: " << f;
  }
  EXPECT_EQ(value_of(restored->cohort_score(4, 1)), 1.5);  // the other user's
  EXPECT_FALSE(scan_files(dir.sub("before"), other).found.empty());
}

// A sealed record that no longer opens is reported by verify() naming the
// record; a purge of its user refuses with Corruption and nothing purged,
// and so does one of a user whose record the index names but is gone.
TEST(SealedLedger, ARecordThatDoesNotOpenOrIsGoneStopsItsUsersPurge) {
  for (const bool gone : {false, true}) {
    SCOPED_TRACE(gone ? "the record is gone" : "the record does not open");
    TempDir dir;
    const std::string path = dir.sub("db");
    const std::uint64_t u = 5;
    {
      auto db = open_db(path, manual_writes());
      ASSERT_OK(db->join_community(u, 77));
      ASSERT_OK(db->signal_with_context({u, 1, 1.5}, {{4}}));
      ASSERT_OK(db->close());
    }
    std::string record_key;
    {
      RawDb raw(path);
      ASSERT_TRUE(raw.ok());
      std::unique_ptr<rocksdb::Iterator> it(
          raw.db(RawDb::kSealedLedger)->NewIterator(rocksdb::ReadOptions(), raw.cf(RawDb::kSealedLedger)));
      it->SeekToFirst();
      ASSERT_TRUE(it->Valid());
      record_key = it->key().ToString();
      std::string value = it->value().ToString();
      value[kSealNonceSize] = static_cast<char>(value[kSealNonceSize] ^ 0x40);
      it.reset();
      rocksdb::DB* sealed = raw.db(RawDb::kSealedLedger);
      ASSERT_TRUE((gone ? sealed->Delete(rocksdb::WriteOptions(), raw.cf(RawDb::kSealedLedger), record_key)
                        : sealed->Put(rocksdb::WriteOptions(), raw.cf(RawDb::kSealedLedger), record_key, value))
                      .ok());
    }
    auto db = open_db(path, manual_writes());
    if (!gone) {
      Result<VerifyReport> v = db->verify();
      ASSERT_OK(v);
      ASSERT_FALSE(v->ok());
      std::string all;
      for (const std::string& p : v->problems) all += p + "\n";
      EXPECT_NE(all.find("sealed ledger key " + hex(record_key)), std::string::npos) << all;
    }
    ASSERT_OK(db->leave_community_layer(u));
    Result<PurgeReceipt> r = db->purge_community_contributions(u);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::Corruption);
    const std::string why = gone ? "sealed ledger record " + hex(record_key) + " of user 5, named by the index"
                                 : std::string("does not open with the user's key");
    EXPECT_NE(r.status().message().find(why), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("nothing purged"), std::string::npos);
    EXPECT_TRUE(db->purge_receipts(u)->empty());
    EXPECT_EQ(value_of(db->cohort_score(4, 1)), 1.5);
  }
}

// verify() reports an index that does not name exactly the records the
// users' keys open: one index key missing (a purge would leave that record
// behind), one too many (naming no record), and one replaced by another
// (the same count). Untouched, the same Db verifies clean.
TEST(SealedLedger, VerifyReportsAnIndexThatDoesNotNameExactlyTheLiveRecords) {
  enum class Damage { None, Missing, Extra, Replaced };
  for (const Damage damage : {Damage::None, Damage::Missing, Damage::Extra, Damage::Replaced}) {
    SCOPED_TRACE(static_cast<int>(damage));
    TempDir dir;
    const std::string path = dir.sub("db");
    {
      auto db = open_db(path, manual_writes());
      for (std::uint64_t u = 1; u <= 3; ++u) {
        ASSERT_OK(db->join_community(u, 77));
        ASSERT_OK(db->signal_with_context({u, 1, 1.5}, {{4}}));
      }
      ASSERT_OK(db->flush());
      ASSERT_OK(db->signal_with_context({1, 2, 0.5}, {{4}}));
      ASSERT_OK(db->close());
    }
    {
      RawDb raw(path);
      ASSERT_TRUE(raw.ok());
      rocksdb::DB* index = raw.db(RawDb::kSealedIndex);
      rocksdb::ColumnFamilyHandle* cf = raw.cf(RawDb::kSealedIndex);
      std::unique_ptr<rocksdb::Iterator> it(index->NewIterator(rocksdb::ReadOptions(), cf));
      it->SeekToFirst();
      ASSERT_TRUE(it->Valid());
      std::string first = it->key().ToString();
      it.reset();
      ASSERT_EQ(first.size(), kSealedIndexKeySize);
      std::string other = first;
      other.back() = static_cast<char>(other.back() ^ 0x7f);  // another epoch, no such record
      const rocksdb::WriteOptions wo;
      if (damage == Damage::Missing || damage == Damage::Replaced) {
        ASSERT_TRUE(index->Delete(wo, cf, first).ok());
      }
      if (damage == Damage::Extra || damage == Damage::Replaced) {
        ASSERT_TRUE(index->Put(wo, cf, other, "").ok());
      }
    }
    auto db = open_db(path, manual_writes());
    Result<VerifyReport> v = db->verify();
    ASSERT_OK(v);
    std::string all;
    for (const std::string& p : v->problems) all += p + "\n";
    if (damage == Damage::None) {
      EXPECT_TRUE(v->ok()) << all;
      continue;
    }
    EXPECT_FALSE(v->ok());
    const std::string named = damage == Damage::Missing ? "names 3 records" : damage == Damage::Extra ? "names 5" : "names 4";
    EXPECT_NE(all.find("sealed index: it " + named), std::string::npos) << all;
    EXPECT_NE(all.find("the users' keys open 4"), std::string::npos) << all;
    EXPECT_EQ(damage == Damage::Replaced, all.find("(other ones)") != std::string::npos) << all;
  }
}

// Writes at `path` a format-3 Db as tidal 0.3 left it: `user` a member of
// community 77, one unsealed ledger record of theirs (cohort 4 and
// community 77, item 1, weight 2 each) and the aggregates it sums to; no
// key store, no sealed ledger.
void write_format3_db(const std::string& path, std::uint64_t user) {
  {
    auto db = open_db(path, manual_writes());
    ASSERT_OK(db->join_community(user, 77));
    ASSERT_OK(db->close());
    RawDb raw(path);
    ASSERT_TRUE(raw.ok());
    ASSERT_TRUE(raw.db(RawDb::kMeta)->Put(rocksdb::WriteOptions(), raw.cf(RawDb::kMeta), kDbFormatKey, kDbFormat3).ok());
    std::string record, units;
    put_ledger_entry(&record, {AggregateKind::Cohort, 4, 1, 2'000'000'000});
    put_ledger_entry(&record, {AggregateKind::Community, 77, 1, 2'000'000'000});
    put_units(&units, 2'000'000'000);
    rocksdb::WriteBatch batch;
    ASSERT_TRUE(batch.Put(raw.cf(RawDb::kLedger), encode_ledger_key(user, 1), record).ok());
    ASSERT_TRUE(batch.Merge(raw.cf(RawDb::kAggregates), encode_aggregate_key(AggregateKind::Cohort, 4, 1), units).ok());
    ASSERT_TRUE(batch.Merge(raw.cf(RawDb::kAggregates), encode_aggregate_key(AggregateKind::Community, 77, 1), units).ok());
    ASSERT_TRUE(raw.db(RawDb::kLedger)->Write(rocksdb::WriteOptions(), &batch).ok());
  }
  RawDb raw(path);
  ASSERT_TRUE(raw.ok());
  for (RawDb::Cf cf : {RawDb::kKeys, RawDb::kSealedLedger, RawDb::kSealedIndex}) {
    ASSERT_TRUE(raw.db(cf)->DropColumnFamily(raw.cf(cf)).ok());
  }
}

// A format-3 Db whose upgrade a crash cut short after RocksDB created the
// sealed ledger's family and before the index's is in format 3 still: the
// next open finishes the upgrade (the refusal of format 4's development
// layout, the sealed ledger without its index, is for format-4 Dbs).
TEST(SealedLedger, AnUpgradeCutShortBetweenTheTwoFamiliesIsFinished) {
  TempDir dir;
  const std::string path = dir.sub("db");
  write_format3_db(path, 5);
  {
    std::vector<std::string> names;
    ASSERT_TRUE(rocksdb::DB::ListColumnFamilies(rocksdb::Options(), path + "/state", &names).ok());
    names.push_back("sealed_ledger");
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
    for (const std::string& n : names) {
      cfs.emplace_back(n, rocksdb::ColumnFamilyOptions());
      if (n == "aggregates") cfs.back().options.merge_operator = new_units_add_operator();
    }
    rocksdb::Options options;
    options.create_missing_column_families = true;
    rocksdb::DB* raw = nullptr;
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    ASSERT_TRUE(rocksdb::DB::Open(options, path + "/state", cfs, &handles, &raw).ok());
    for (auto* h : handles) ASSERT_TRUE(raw->DestroyColumnFamilyHandle(h).ok());
    delete raw;
  }
  EXPECT_EQ(stored_format(path), kDbFormat3);
  auto db = open_db(path, manual_writes());
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(value_of(db->cohort_score(4, 1)), 2.0);
  ASSERT_OK(db->signal_with_context({6, 1, 0.5}, {{4}}));
  ASSERT_OK(db->close());
  EXPECT_EQ(stored_format(path), kDbFormat);
}

// A format-3 Db (its ledger unsealed, keyed [user][0x13][epoch]) opened by
// this version: upgraded in place to format 4 (the families created, the
// format written), its ledger carried as it is; verify() and a purge of a
// format-3 user stay exact, and the purge erases that user's unsealed
// records physically, as format 3 did. New contributions are sealed.
TEST(SealedLedger, AFormat3DbIsUpgradedInPlaceItsLedgerCarriedAndPurgedExactly) {
  TempDir dir;
  const std::string path = dir.sub("db");
  const std::uint64_t old_user = 0xA1B2C3D4E5F60718ULL, new_user = 0x1122334455667788ULL;
  write_format3_db(path, old_user);
  ASSERT_FALSE(::testing::Test::HasFailure());
  {
    // A read-only open reads it as it is (no families created).
    Options ro = manual_writes();
    ro.read_only = true;
    auto db = open_db(path, ro);
    EXPECT_EQ(value_of(db->cohort_score(4, 1)), 2.0);
    Result<VerifyReport> v = db->verify();
    ASSERT_OK(v);
    EXPECT_TRUE(v->ok()) << v->problems.front();
    ASSERT_OK(db->close());
  }
  auto db = open_db(path, manual_writes());
  EXPECT_EQ(value_of(db->cohort_score(4, 1)), 2.0);
  ASSERT_OK(db->join_community(new_user, 77));
  ASSERT_OK(db->signal_with_context({new_user, 1, 0.5}, {{4}}));
  ASSERT_OK(db->signal_with_context({old_user, 1, 0.25}, {{4}}));  // sealed beside the carried record
  ASSERT_OK(db->flush());
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
  // Settled: a compaction of the open Db can move the carried record into a
  // file made after a single scan listed the directory (seen under ASan on a
  // busy machine: the record was found nowhere).
  const testing::ErasureScan before = testing::scan_files_settled(path, old_user);
  EXPECT_FALSE(before.found.empty()) << "the carried record is not where the scan looks: " << before.summary();

  ASSERT_OK(db->leave_community_layer(old_user));
  Result<PurgeReceipt> r = db->purge_community_contributions(old_user);
  ASSERT_OK(r);
  EXPECT_EQ(r->entries_removed, 4u);  // two carried, two sealed
  EXPECT_DOUBLE_EQ(r->cohort_weight_removed, 2.25);
  EXPECT_EQ(value_of(db->cohort_score(4, 1)), 0.5);
  EXPECT_EQ(value_of(db->community_score(77, 1)), 0.5);
  for (const std::string& f : scan_files(path, old_user, before.user_keys).found) {
    ADD_FAILURE() << "after the purge: " << f;
  }
  v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
  ASSERT_OK(db->close());
  RawDb raw(path);
  ASSERT_TRUE(raw.ok());
  std::string format;
  ASSERT_TRUE(raw.db(RawDb::kMeta)->Get(rocksdb::ReadOptions(), raw.cf(RawDb::kMeta), kDbFormatKey, &format).ok());
  EXPECT_EQ(format, kDbFormat);
}

// The upgrade from format 3 resumes after a SIGKILL: a real process opening
// a format-3 Db is killed at each step of the upgrade (1: the sealed
// ledger's family created; 2: the key store's; 3: the format written). Until
// step 3 the Db is still format 3; the next open finishes the upgrade, and
// the carried record sums, verifies and purges exactly beside new sealed
// contributions.
TEST(SealedLedger, AnUpgradeFromFormat3KilledAtEveryStepIsFinishedByTheNextOpen) {
  const std::uint64_t old_user = 0xA1B2C3D4E5F60718ULL, new_user = 0x1122334455667788ULL;
  for (int step = 1; step <= 3; ++step) {
    SCOPED_TRACE("killed at step " + std::to_string(step));
    TempDir dir;
    const std::string path = dir.sub("db");
    write_format3_db(path, old_user);
    ASSERT_FALSE(::testing::Test::HasFailure());
    {
      reliability::Child child({"upgrade4", path, std::to_string(step)});
      const int status = reliability::wait_for_kill(child);
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
          << "the upgrade never reached step " << step << " (wait status " << status << ")";
    }
    EXPECT_EQ(stored_format(path), step < 3 ? kDbFormat3 : kDbFormat);
    auto db = open_db(path, manual_writes());
    ASSERT_NE(db, nullptr);
    EXPECT_EQ(value_of(db->cohort_score(4, 1)), 2.0);
    ASSERT_OK(db->join_community(new_user, 77));
    ASSERT_OK(db->signal_with_context({new_user, 1, 0.5}, {{4}}));
    ASSERT_OK(db->flush());
    Result<VerifyReport> v = db->verify();
    ASSERT_OK(v);
    EXPECT_TRUE(v->ok()) << v->problems.front();
    const testing::ErasureScan before = testing::scan_files_settled(path, old_user);  // as above
    EXPECT_FALSE(before.found.empty()) << "the carried record is not where the scan looks: " << before.summary();
    ASSERT_OK(db->leave_community_layer(old_user));
    Result<PurgeReceipt> r = db->purge_community_contributions(old_user);
    ASSERT_OK(r);
    EXPECT_EQ(r->entries_removed, 2u);
    EXPECT_EQ(value_of(db->cohort_score(4, 1)), 0.5);
    EXPECT_EQ(value_of(db->community_score(77, 1)), 0.5);
    for (const std::string& f : scan_files(path, old_user, before.user_keys).found) {
      ADD_FAILURE() << "after the purge: " << f;
    }
    ASSERT_OK(db->close());
    EXPECT_EQ(stored_format(path), kDbFormat);
  }
}

// A Db in a format this version does not know is refused naming it, as
// tidal 0.3 refuses format 4 ("it is in format 4; this version reads format
// 3"), with nothing changed.
TEST(SealedLedger, AnUnknownFormatIsRefusedNamingIt) {
  TempDir dir;
  const std::string path = dir.sub("db");
  {
    auto db = open_db(path, manual_writes());
    ASSERT_OK(db->close());
  }
  {
    RawDb raw(path);
    ASSERT_TRUE(raw.ok());
    ASSERT_TRUE(raw.db(RawDb::kMeta)->Put(rocksdb::WriteOptions(), raw.cf(RawDb::kMeta), kDbFormatKey, "5").ok());
  }
  Result<std::unique_ptr<Db>> db = Db::open(path, manual_writes());
  ASSERT_FALSE(db.ok());
  EXPECT_EQ(db.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(db.status().message().find("it is in format 5; this version reads format 4"), std::string::npos)
      << db.status().message();
}

}  // namespace
}  // namespace tidal
