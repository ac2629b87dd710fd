// Retroactive purge and re-materialization (docs/CONTRACT.md, P1-P7):
// exactness, atomicity, receipts, physical erasure, rejoin, bulk, and an
// Nth-I/O fault sweep.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <future>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <rocksdb/db.h>
#include <rocksdb/sst_file_reader.h>
#include <rocksdb/table_properties.h>
#include <rocksdb/utilities/debug.h>

#include "db/erasure_ranges.h"
#include "db/impl.h"
#include "erasure_scan.h"
#include "fault_fs.h"
#include "raw_db.h"
#include "storage/format.h"
#include "storage/ingest_batch.h"
#include "storage/receipt.h"
#include "storage/state_format.h"
#include "test_util.h"

namespace tidal {
namespace {

using testing::open_db;
using testing::ScopedOverride;
using testing::TempDir;
using testing::value_of;
using testing::ErasureScan;
using testing::scan_files;
namespace fs = std::filesystem;

Options manual_writes(Options options = {}) {
  options.aggregate_write_period = std::chrono::hours(1);
  return options;
}

std::uint64_t bits(double d) {
  std::uint64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

// How many times `text` occurs in the state engine's info LOG of the Db at
// `path` (what RocksDB did: a flush and its reason, an ingested file).
std::size_t count_in_state_log(const std::string& path, std::string_view text) {
  std::ifstream log(path + "/state/LOG");
  const std::string all((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  std::size_t n = 0;
  for (std::size_t at = all.find(text); at != std::string::npos; at = all.find(text, at + 1)) ++n;
  return n;
}

// A deterministic workload: users 1..kUsers, each in two of four
// communities, signalling items 0..kItems-1 into cohorts 0..kCohorts-1 with
// weights that do not sum exactly as doubles (0.1, 1/3, ...).
constexpr std::uint64_t kUsers = 40, kItems = 12, kCohorts = 5, kCommunities = 4;

struct Workload {
  std::vector<std::pair<Signal, SignalContext>> signals;
  Workload() {
    std::mt19937_64 rng(1234);
    for (int i = 0; i < 2000; ++i) {
      const std::uint64_t user = 1 + rng() % kUsers;
      const double weight = (static_cast<double>(rng() % 1000) - 300) / 3.0 + 0.1;
      SignalContext ctx;
      for (std::uint64_t c = 0; c < 1 + rng() % 3; ++c) ctx.cohort_ids.push_back(rng() % kCohorts);
      signals.push_back({{user, rng() % kItems, weight}, ctx});
    }
  }
};

void join_all(Db& db) {
  for (std::uint64_t u = 1; u <= kUsers; ++u) {
    ASSERT_OK(db.join_community(u, 100 + u % kCommunities));
    ASSERT_OK(db.join_community(u, 100 + (u + 1) % kCommunities));
  }
}

// Feeds the workload; signals of users in `skip` are not sent at all.
void feed(Db& db, const Workload& w, const std::set<std::uint64_t>& skip) {
  for (const auto& [signal, ctx] : w.signals) {
    if (skip.count(signal.user_id) == 0) ASSERT_OK(db.signal_with_context(signal, ctx));
  }
}

// Every shared score of `a` and `b` the workload can touch, bit for bit.
std::size_t count_shared_differences(Db& a, Db& b) {
  std::size_t differ = 0;
  for (std::uint64_t item = 0; item < kItems; ++item) {
    for (std::uint64_t c = 0; c < kCohorts; ++c) {
      differ += bits(value_of(a.cohort_score(c, item))) != bits(value_of(b.cohort_score(c, item))) ? 1u : 0u;
    }
    for (std::uint64_t m = 0; m < kCommunities; ++m) {
      differ += bits(value_of(a.community_score(100 + m, item))) != bits(value_of(b.community_score(100 + m, item)))
                    ? 1u : 0u;
    }
  }
  return differ;
}

void expect_healthy(Db& db, const std::string& ctx) {
  Result<VerifyReport> v = db.verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << ctx << ": " << v->problems.front();
  Result<RematerializeReport> r = db.rematerialize_shared_aggregates();
  ASSERT_OK(r);
  EXPECT_TRUE(r->mismatches.empty()) << ctx << ": " << r->mismatches.front();
}

TEST(Purge, AUserWhoIsNotLeftIsRefusedNamingTheUserWithNothingChanged) {
  TempDir dir;
  auto db = open_db(dir.sub("db"), manual_writes());
  ASSERT_OK(db->signal_with_context({7, 1, 2.0}, {{3}}));
  ASSERT_OK(db->flush());
  Result<PurgeReceipt> r = db->purge_community_contributions(7);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(r.status().message().find("user 7 is Active"), std::string::npos) << r.status().message();
  EXPECT_EQ(value_of(db->cohort_score(3, 1)), 2.0);
  EXPECT_TRUE(db->purge_receipts(7)->empty());
  // The bulk form refuses the whole list when one user is not Left.
  ASSERT_OK(db->signal_with_context({8, 1, 1.0}, {{3}}));
  ASSERT_OK(db->leave_community_layer(8));
  const std::vector<std::uint64_t> both{8, 7};
  Result<std::vector<PurgeReceipt>> bulk = db->purge_community_contributions(both);
  ASSERT_FALSE(bulk.ok());
  EXPECT_NE(bulk.status().message().find("user 7"), std::string::npos) << bulk.status().message();
  EXPECT_EQ(value_of(db->cohort_score(3, 1)), 3.0);
  EXPECT_TRUE(db->purge_receipts(8)->empty());
  ASSERT_OK(db->close());
  EXPECT_EQ(db->purge_community_contributions(8).status().code(), StatusCode::Closed);
}

// The purge batch is built in passes over the ledgers, each summing one key
// range of at most Db::Impl::purge_pass_cells cells (bounded memory): with
// 3 cells a pass, a bulk purge of several users takes dozens of passes and
// is still exact, bit for bit.
TEST(Purge, ABatchBuiltInManySmallPassesIsBitIdenticalToADbThatNeverSawTheUsers) {
  TempDir dir;
  const Workload w;
  const std::set<std::uint64_t> leavers = {3, 13, 14, 27};
  auto purged = open_db(dir.sub("purged"), manual_writes());
  auto reference = open_db(dir.sub("reference"), manual_writes());
  join_all(*purged);
  join_all(*reference);
  feed(*purged, w, {});
  feed(*reference, w, leavers);
  ASSERT_OK(purged->flush());
  const std::vector<std::uint64_t> ids(leavers.begin(), leavers.end());
  ASSERT_OK(purged->leave_community_layer(std::span<const std::uint64_t>(ids)));
  const std::size_t saved = Db::Impl::purge_pass_cells;
  Db::Impl::purge_pass_cells = 3;
  Result<std::vector<PurgeReceipt>> r = purged->purge_community_contributions(std::span<const std::uint64_t>(ids));
  Db::Impl::purge_pass_cells = saved;
  ASSERT_OK(r);
  ASSERT_EQ(r->size(), leavers.size());
  for (const PurgeReceipt& receipt : *r) EXPECT_GT(receipt.entries_removed, 3u) << receipt.user_id;
  EXPECT_EQ(count_shared_differences(*purged, *reference), 0u);
  expect_healthy(*purged, "after the purge in small passes");
}

// docs/CONTRACT.md, P2: afterwards every shared score is bit-identical to a
// Db that never received the user's contributions; the personal layer is
// untouched. Part of the user's signals are still in the write buffer when
// purge is called.
TEST(Purge, SharedScoresAreBitIdenticalToADbThatNeverSawTheUser) {
  TempDir dir;
  const Workload w;
  const std::uint64_t u = 13;
  auto purged = open_db(dir.sub("purged"), manual_writes());
  auto reference = open_db(dir.sub("reference"), manual_writes());
  join_all(*purged);
  join_all(*reference);
  const std::size_t half = w.signals.size() / 2;
  for (std::size_t i = 0; i < w.signals.size(); ++i) {
    if (i == half) ASSERT_OK(purged->flush());  // half stored, half buffered
    ASSERT_OK(purged->signal_with_context(w.signals[i].first, w.signals[i].second));
    if (w.signals[i].first.user_id != u) ASSERT_OK(reference->signal_with_context(w.signals[i].first, w.signals[i].second));
  }
  std::map<std::uint64_t, double> personal;
  for (std::uint64_t item = 0; item < kItems; ++item) personal[item] = value_of(purged->personal_score(u, item));
  ASSERT_GT(count_shared_differences(*purged, *reference), 0u);  // the user did contribute

  ASSERT_OK(purged->leave_community_layer(u));
  Result<PurgeReceipt> r = purged->purge_community_contributions(u);
  ASSERT_OK(r);
  EXPECT_EQ(r->user_id, u);
  EXPECT_GT(r->entries_removed, 0u);
  EXPECT_EQ(r->left_at_ns, *purged->community_layer_status(u)->left_at_ns);
  EXPECT_GT(r->purged_at_ns, r->left_at_ns);
  EXPECT_EQ(count_shared_differences(*purged, *reference), 0u);
  for (std::uint64_t item = 0; item < kItems; ++item) {
    EXPECT_EQ(bits(value_of(purged->personal_score(u, item))), bits(personal[item])) << "item " << item;
  }
  expect_healthy(*purged, "after the purge");
  // And after a restart.
  ASSERT_OK(purged->close());
  purged = open_db(dir.sub("purged"), manual_writes());
  EXPECT_EQ(count_shared_differences(*purged, *reference), 0u);
  expect_healthy(*purged, "after a restart");
}

// A purge stores the write buffers first only while one of its users may
// still have a contribution in them (StateStore::exclusive_for): right after
// the leave it does; once a batch has been written since, it writes nothing
// of the others' pending signals, and is exact all the same. A user who
// rejoins, signals and leaves again has pending contributions again.
TEST(Purge, APurgeStoresThePendingSignalsOnlyWhileOneOfItsUsersMayHaveSomeThere) {
  TempDir dir;
  const Workload w;
  const std::uint64_t at_once = 13, later = 14, again = 27;
  auto purged = open_db(dir.sub("purged"), manual_writes());
  auto reference = open_db(dir.sub("reference"), manual_writes());
  join_all(*purged);
  join_all(*reference);
  // The workload in four parts, each sent to both Dbs (the reference never
  // sees the purged users' signals).
  const std::size_t part = w.signals.size() / 4;
  const auto send = [&](std::size_t p, std::uint64_t returning) {
    for (std::size_t i = p * part; i < (p + 1) * part; ++i) {
      const auto& [signal, ctx] = w.signals[i];
      if (signal.user_id == returning) continue;  // sent by the caller, after its rejoin
      ASSERT_OK(purged->signal_with_context(signal, ctx));
      if (signal.user_id != at_once && signal.user_id != later && signal.user_id != again) {
        ASSERT_OK(reference->signal_with_context(signal, ctx));
      }
    }
  };
  const auto writes = [&] { return purged->stats().aggregate_writes; };
  const auto pending = [&] { return purged->stats().aggregate_cells_pending; };

  // Right after the leave: the user's signals are pending, and are stored first.
  send(0, 0);
  ASSERT_OK(purged->leave_community_layer(at_once));
  std::uint64_t before = writes();
  Result<PurgeReceipt> r = purged->purge_community_contributions(at_once);
  ASSERT_OK(r);
  EXPECT_GT(r->entries_removed, 0u);
  EXPECT_EQ(writes(), before + 1) << "the purge right after the leave did not store the pending signals first";
  EXPECT_EQ(pending(), 0u);

  // A batch after the leave: the others' pending signals stay pending.
  send(1, 0);
  ASSERT_OK(purged->leave_community_layer(later));
  ASSERT_OK(purged->flush());
  send(2, 0);
  const std::uint64_t waiting = pending();
  ASSERT_GT(waiting, 0u);
  before = writes();
  r = purged->purge_community_contributions(later);
  ASSERT_OK(r);
  EXPECT_GT(r->entries_removed, 0u);
  EXPECT_EQ(writes(), before) << "the purge wrote a batch, though everything of the user was stored";
  EXPECT_EQ(pending(), waiting);

  // Left, stored, rejoined, signals pending again, left: stored first again.
  ASSERT_OK(purged->leave_community_layer(again));
  ASSERT_OK(purged->flush());
  ASSERT_OK(purged->rejoin_community_layer(again));
  send(3, again);
  for (std::size_t i = 3 * part; i < 4 * part; ++i) {
    if (w.signals[i].first.user_id == again) ASSERT_OK(purged->signal_with_context(w.signals[i].first, w.signals[i].second));
  }
  ASSERT_OK(purged->leave_community_layer(again));
  before = writes();
  r = purged->purge_community_contributions(again);
  ASSERT_OK(r);
  EXPECT_EQ(writes(), before + 1) << "the purge after a rejoin did not store the user's new signals first";
  // Every contribution of the three users is gone, of `again` from before
  // its rejoin and after.
  EXPECT_EQ(count_shared_differences(*purged, *reference), 0u);
  ASSERT_OK(purged->flush());
  EXPECT_EQ(count_shared_differences(*purged, *reference), 0u);
  expect_healthy(*purged, "after the purges");
}

// A purge of a user whose contributions are all stored does not wait for
// the writer's batch under way (StateStore::exclusive_for): here the batch
// is held, built and not ingested, for as long as the test likes. The purge
// returns meanwhile, and reads, which pair the held batch's buffer with a
// snapshot of the stored state, already leave the user out; once the batch
// lands, nothing of it was lost.
TEST(PurgeConcurrentTest, APurgeOfAStoredUserDoesNotWaitForTheWritersBatchUnderWay) {
  TempDir dir;
  const Workload w;
  const std::uint64_t u = 13;
  auto purged = open_db(dir.sub("purged"), manual_writes());
  auto reference = open_db(dir.sub("reference"), manual_writes());
  join_all(*purged);
  join_all(*reference);
  const std::size_t half = w.signals.size() / 2;
  for (std::size_t i = 0; i < w.signals.size(); ++i) {
    const auto& [signal, ctx] = w.signals[i];
    if (i == half) {
      ASSERT_OK(purged->leave_community_layer(u));
      ASSERT_OK(purged->flush());  // everything of the user's is stored
    }
    if (signal.user_id == u && i >= half) continue;  // gated anyway; not sent
    ASSERT_OK(purged->signal_with_context(signal, ctx));
    if (signal.user_id != u) ASSERT_OK(reference->signal_with_context(signal, ctx));
  }
  ASSERT_GT(purged->stats().aggregate_cells_pending, 0u);

  std::mutex mu;
  std::condition_variable cv;
  bool held = false, release = false;
  ScopedOverride hook(Storage::step_for_testing, [&](std::string_view task, int) {
    if (task != "aggregate write") return;
    std::unique_lock<std::mutex> lock(mu);
    held = true;
    cv.notify_all();
    cv.wait(lock, [&] { return release; });
  });
  const auto let_go = [&] {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
    cv.notify_all();
  };
  std::future<Status> batch = std::async(std::launch::async, [&] { return purged->flush(); });
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return held; }));
  }
  std::future<Result<PurgeReceipt>> purge =
      std::async(std::launch::async, [&] { return purged->purge_community_contributions(u); });
  const bool returned = purge.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  const std::size_t differ_while_held = returned ? count_shared_differences(*purged, *reference) : 0;
  const std::uint64_t writes_while_held = purged->stats().aggregate_writes;
  let_go();
  ASSERT_TRUE(returned) << "the purge waited for the writer's batch";
  Result<PurgeReceipt> r = purge.get();
  ASSERT_OK(r);
  EXPECT_GT(r->entries_removed, 0u);
  EXPECT_EQ(differ_while_held, 0u) << "reads during the held batch still counted the purged user";
  EXPECT_EQ(writes_while_held, 1u);  // only the flush at the leave; the held batch had not landed
  ASSERT_OK(batch.get());
  EXPECT_EQ(purged->stats().aggregate_cells_pending, 0u);
  EXPECT_EQ(count_shared_differences(*purged, *reference), 0u);
  expect_healthy(*purged, "after the purge beside the batch");
  ASSERT_OK(purged->close());
  purged = open_db(dir.sub("purged"), manual_writes());
  EXPECT_EQ(count_shared_differences(*purged, *reference), 0u);
}

TEST(Purge, ReceiptsAreKeptOldestFirstAcrossRestartsAndASecondPurgeWritesNothing) {
  TempDir dir;
  const std::string path = dir.sub("db");
  PurgeReceipt first;
  {
    auto db = open_db(path, manual_writes());
    ASSERT_OK(db->join_community(5, 50));
    ASSERT_OK(db->signal_with_context({5, 1, 0.1}, {{1, 2}}));
    ASSERT_OK(db->signal_with_context({5, 2, 0.2}, {{1}}));
    ASSERT_OK(db->leave_community_layer(5));
    Result<PurgeReceipt> r = db->purge_community_contributions(5);
    ASSERT_OK(r);
    first = *r;
    EXPECT_EQ(r->entries_removed, 5u);  // cohorts 1, 2 item 1; cohort 1 item 2; community 50 items 1, 2
    EXPECT_EQ(r->cohort_weight_removed, 0.4);
    EXPECT_EQ(r->community_weight_removed, 0.3);  // the exact sum, not 0.1 + 0.2 in doubles
    Result<PurgeReceipt> again = db->purge_community_contributions(5);
    ASSERT_OK(again);
    EXPECT_EQ(again->entries_removed, 0u);
    EXPECT_EQ(db->purge_receipts(5)->size(), 1u) << "a purge with nothing to remove wrote a receipt";
    ASSERT_OK(db->close());
  }
  auto db = open_db(path, manual_writes());
  Result<std::vector<PurgeReceipt>> receipts = db->purge_receipts(5);
  ASSERT_OK(receipts);
  ASSERT_EQ(receipts->size(), 1u);
  EXPECT_EQ((*receipts)[0].purged_at_ns, first.purged_at_ns);
  EXPECT_EQ((*receipts)[0].left_at_ns, first.left_at_ns);
  EXPECT_EQ((*receipts)[0].entries_removed, 5u);
  EXPECT_EQ((*receipts)[0].cohort_weight_removed, 0.4);
  EXPECT_EQ(value_of(db->cohort_score(1, 1)), 0.0);
  EXPECT_EQ(value_of(db->community_score(50, 2)), 0.0);
  EXPECT_EQ(value_of(db->personal_score(5, 2)), 0.2);
}

// docs/CONTRACT.md, P7: a rejoin starts a fresh ledger; a later purge removes
// only what came after, and the receipts list both purges, oldest first.
TEST(Purge, ARejoinStartsAFreshLedgerAndALaterPurgeRemovesOnlyWhatCameAfter) {
  TempDir dir;
  auto db = open_db(dir.sub("db"), manual_writes());
  ASSERT_OK(db->signal_with_context({3, 1, 1.0}, {{9}}));
  ASSERT_OK(db->signal_with_context({4, 1, 10.0}, {{9}}));
  ASSERT_OK(db->leave_community_layer(3));
  ASSERT_OK(db->purge_community_contributions(3));
  EXPECT_EQ(value_of(db->cohort_score(9, 1)), 10.0);
  ASSERT_OK(db->rejoin_community_layer(3));
  ASSERT_OK(db->signal_with_context({3, 1, 2.0}, {{9}}));
  ASSERT_OK(db->signal_with_context({3, 2, 4.0}, {{9}}));
  EXPECT_EQ(value_of(db->cohort_score(9, 1)), 12.0);
  ASSERT_OK(db->leave_community_layer(3));
  Result<PurgeReceipt> second = db->purge_community_contributions(3);
  ASSERT_OK(second);
  EXPECT_EQ(second->entries_removed, 2u);
  EXPECT_EQ(second->cohort_weight_removed, 6.0);
  EXPECT_EQ(value_of(db->cohort_score(9, 1)), 10.0);
  EXPECT_EQ(value_of(db->cohort_score(9, 2)), 0.0);
  Result<std::vector<PurgeReceipt>> receipts = db->purge_receipts(3);
  ASSERT_OK(receipts);
  ASSERT_EQ(receipts->size(), 2u);
  EXPECT_EQ((*receipts)[0].cohort_weight_removed, 1.0);
  EXPECT_EQ((*receipts)[1].cohort_weight_removed, 6.0);
  EXPECT_LT((*receipts)[0].purged_at_ns, (*receipts)[1].purged_at_ns);
  EXPECT_LT((*receipts)[0].left_at_ns, (*receipts)[1].left_at_ns);
  expect_healthy(*db, "after two purges");
}

// ---- physical erasure ----

TEST(Purge, NoSstOrWalFileHoldsAKeyOfThePurgedLedgerOnReturn) {
  TempDir dir;
  const std::string path = dir.sub("db");
  // Ids whose bytes do not occur by chance in other records.
  const std::uint64_t u = 0xA1B2C3D4E5F60718ULL, other = 0x1122334455667788ULL;
  auto db = open_db(path, manual_writes());
  ASSERT_OK(db->join_community(u, 77));
  ASSERT_OK(db->join_community(other, 77));
  for (std::uint64_t i = 0; i < 200; ++i) {
    ASSERT_OK(db->signal_with_context({u, i, 1.5}, {{4}}));
    ASSERT_OK(db->signal_with_context({other, i, 2.5}, {{4}}));
    if (i % 50 == 49) ASSERT_OK(db->flush());  // several ledger records, several ingested files
  }
  ASSERT_OK(db->close());
  db = open_db(path, manual_writes());
  for (std::uint64_t i = 0; i < 20; ++i) ASSERT_OK(db->signal_with_context({u, 1000 + i, 1.0}, {{4}}));
  ASSERT_OK(db->flush());  // one more, after the reopen
  ErasureScan before = testing::scan_files_settled(path, u);
  ASSERT_GE(before.found.size(), 5u) << "the test found too few ledger records of the user to erase";
  ASSERT_EQ(before.user_keys.size(), 1u) << "the user's ledger key is not in the key store's files";
  ASSERT_GE(before.sealed_records, 5u);

  ASSERT_OK(db->leave_community_layer(u));
  ASSERT_OK(db->purge_community_contributions(u));
  // Looked for by its bytes too, wherever they are (the scan finds no key
  // store record of the user any more).
  ErasureScan after = scan_files(path, u, before.user_keys);
  EXPECT_GT(after.ssts, 0u);
  EXPECT_GT(after.wals, 0u);
  for (const std::string& f : after.found) ADD_FAILURE() << "after the purge: " << f;
  // The other user's ledger is still there, and the Db reads right.
  EXPECT_FALSE(scan_files(path, other).found.empty());
  EXPECT_EQ(value_of(db->cohort_score(4, 3)), 2.5);
  EXPECT_EQ(value_of(db->community_score(77, 3)), 2.5);
  expect_healthy(*db, "after the purge");
  ASSERT_OK(db->close());
  for (const std::string& f : scan_files(path, u, before.user_keys).found) ADD_FAILURE() << "after close: " << f;
}

// ---- what an attacker holding the files can learn (docs/PURGE.md) ----

// The receipt key prefix [user BE][0x10] in any operation of any WAL of the
// state engine: the purge's batch through the WAL holds the receipt beside
// minus the user's exact sum for each cell, and a WAL holds whole batches.
std::vector<std::string> wal_batches_naming(const std::string& state_dir, std::uint64_t user) {
  const std::string prefix = encode_key_prefix(EntityId(user), Tag::PurgeManifest);
  std::vector<std::string> found;
  for (const auto& entry : fs::directory_iterator(state_dir)) {
    if (entry.path().extension() != ".log") continue;
    std::string error;
    std::size_t end = 0;
    for (const testing::WalOp& op : testing::wal_ops(testing::read_file(entry.path()), &error, &end)) {
      if (op.key.starts_with(prefix)) {
        found.push_back(entry.path().filename().string() + ": the batch at sequence " + std::to_string(op.sequence));
      }
    }
  }
  return found;
}

TEST(Purge, NoStateWalHoldsThePurgesBatchOnceItsErasureIsComplete) {
  TempDir dir;
  const std::string path = dir.sub("db");
  const std::uint64_t u = 0xA1B2C3D4E5F60718ULL, other = 0x1122334455667788ULL;
  auto db = open_db(path, manual_writes());
  ASSERT_OK(db->join_community(u, 77));
  ASSERT_OK(db->join_community(other, 77));
  for (std::uint64_t i = 0; i < 30; ++i) {
    ASSERT_OK(db->signal_with_context({u, i, 1.5}, {{4}}));
    ASSERT_OK(db->signal_with_context({other, i, 2.5}, {{4}}));
  }
  ASSERT_OK(db->flush());
  ASSERT_OK(db->leave_community_layer(u));
  Result<PurgeReceipt> receipt = db->purge_community_contributions(u);
  ASSERT_OK(receipt.status());
  ASSERT_EQ(receipt->entries_removed, 60u) << "the batch must be small enough to go through the WAL";
  Result<std::vector<PurgeReceipt>> receipts = db->purge_receipts(u);
  ASSERT_OK(receipts.status());
  ASSERT_EQ(receipts->size(), 1u);
  ASSERT_TRUE(receipts->front().erasure_complete);
  // With the Db still open, and after more writes of the state engine.
  for (const std::string& f : wal_batches_naming(path + "/state", u)) ADD_FAILURE() << "open: " << f;
  for (std::uint64_t i = 0; i < 30; ++i) ASSERT_OK(db->signal_with_context({other, 100 + i, 1.0}, {{4}}));
  ASSERT_OK(db->flush());
  for (const std::string& f : wal_batches_naming(path + "/state", u)) ADD_FAILURE() << "after a flush: " << f;
  EXPECT_EQ(value_of(db->cohort_score(4, 3)), 2.5);
  expect_healthy(*db, "after the purge");
  ASSERT_OK(db->close());
}

// Options::strict_erasure: once the purge returns, every cell the user
// touched has one version in the state engine's files (the subtraction
// merged into it, no value from before the purge), the receipt's sequence
// number is 0 (no longer beside the subtraction's), and no range deletion of
// the sealed index is left. Read as an attacker would, with RocksDB's
// GetAllKeyVersions over every file (the WALs replayed) and every SST's
// table properties, after a close and after a bulk purge too.
TEST(Purge, AStrictErasureLeavesOneVersionOfEachTouchedCellAndNoImageOfThePurge) {
  for (const bool bulk : {false, true}) {
    SCOPED_TRACE(bulk ? "bulk purge" : "single purge");
    TempDir dir;
    const std::string path = dir.sub("db");
    const std::uint64_t u = 0xA1B2C3D4E5F60718ULL;
    const std::vector<std::uint64_t> others{0x1122334455667788ULL, 0x1122334455667799ULL};
    Options options = manual_writes();
    options.strict_erasure = true;
    auto db = open_db(path, options);
    std::vector<std::string> touched;
    for (std::uint64_t user : {u, others[0], others[1]}) ASSERT_OK(db->join_community(user, 77));
    for (int round = 0; round < 3; ++round) {
      for (std::uint64_t i = 0; i < 30; ++i) {
        ASSERT_OK(db->signal_with_context({u, i, 1.5}, {{4}}));
        for (std::uint64_t o : others) ASSERT_OK(db->signal_with_context({o, i, 2.5}, {{4}}));
      }
      ASSERT_OK(db->flush());  // several versions of each cell, in several files
    }
    const ErasureScan before = testing::scan_files_settled(path, u);
    ASSERT_EQ(before.user_keys.size(), 1u);
    const std::optional<UserKey> key =
        UserKey::decode(std::string_view(before.user_keys.front()).substr(0, kKeyStoreValueSize));
    ASSERT_TRUE(key.has_value());
    const std::string pseudonym(key->pseudonym());
    // No MANIFEST of the state engine holds a key that begins with the
    // pseudonym (a sealed index file's boundary: its range deletion, or an
    // entry of it), which an edit would tie to the receipt's. A boundary key
    // is written as its length (a varint: 24 for [pseudonym] + the 8-byte
    // trailer, 32 for an index key) and its bytes; the sealed ledger's keys
    // ([epoch: 8][pseudonym]) hold it after their epoch, beside its records'
    // files from before the purge, which are not the purge's.
    const auto manifests_naming_pseudonym = [&] {
      std::vector<std::string> found;
      for (const auto& entry : fs::directory_iterator(path + "/state")) {
        const std::string name = entry.path().filename().string();
        if (!name.starts_with("MANIFEST-")) continue;
        const std::string bytes = testing::read_file(entry.path());
        for (std::size_t at = bytes.find(pseudonym); at != std::string::npos; at = bytes.find(pseudonym, at + 1)) {
          const bool key_begins = at >= 1 && (bytes[at - 1] == 24 || bytes[at - 1] == 32);
          const bool ledger_key = at >= 9 && bytes[at - 9] == 32;
          if (key_begins && !ledger_key) {
            found.push_back(name + " at byte " + std::to_string(at) + ": " +
                            hex(std::string_view(bytes).substr(at - 12, 12 + 16 + 12)));
          }
        }
      }
      return found;
    };
    for (std::uint64_t i = 0; i < 30; ++i) {
      touched.push_back(encode_aggregate_key(AggregateKind::Cohort, 4, i));
      touched.push_back(encode_aggregate_key(AggregateKind::Community, 77, i));
    }
    ASSERT_OK(db->leave_community_layer(u));
    if (bulk) ASSERT_OK(db->leave_community_layer(others[1]));
    if (bulk) {
      Result<std::vector<PurgeReceipt>> r = db->purge_community_contributions(std::vector<std::uint64_t>{u, others[1]});
      ASSERT_OK(r.status());
    } else {
      Result<PurgeReceipt> r = db->purge_community_contributions(u);
      ASSERT_OK(r.status());
    }
    Result<std::vector<PurgeReceipt>> receipts = db->purge_receipts(u);
    ASSERT_OK(receipts.status());
    ASSERT_EQ(receipts->size(), 1u);
    EXPECT_TRUE(receipts->front().erasure_complete);
    for (const std::string& m : manifests_naming_pseudonym()) ADD_FAILURE() << m << " names the purged pseudonym";
    EXPECT_EQ(value_of(db->cohort_score(4, 3)), bulk ? 7.5 : 15.0);
    expect_healthy(*db, "after the purge");
    ASSERT_OK(db->close());
    for (const std::string& m : manifests_naming_pseudonym()) ADD_FAILURE() << "closed: " << m << " names the pseudonym";

    testing::RawReader state(path + "/state");
    std::vector<rocksdb::KeyVersion> versions;
    ASSERT_TRUE(rocksdb::GetAllKeyVersions(state.db(), state.cf("aggregates"), rocksdb::Slice(), rocksdb::Slice(),
                                           std::numeric_limits<std::size_t>::max(), &versions)
                    .ok());
    std::map<std::string, std::vector<const rocksdb::KeyVersion*>> by_key;
    for (const rocksdb::KeyVersion& v : versions) by_key[v.user_key].push_back(&v);
    for (const std::string& k : touched) {
      const auto& kv = by_key[k];
      ASSERT_EQ(kv.size(), 1u) << "cell " << hex(k) << " has " << kv.size()
                               << " versions in the state engine's files (the first of type " << kv.front()->type
                               << ")";
      EXPECT_EQ(kv.front()->sequence, 0u) << hex(k);
    }
    versions.clear();
    ASSERT_TRUE(rocksdb::GetAllKeyVersions(state.db(), state.cf("receipts"), rocksdb::Slice(), rocksdb::Slice(),
                                           std::numeric_limits<std::size_t>::max(), &versions)
                    .ok());
    ASSERT_EQ(versions.size(), bulk ? 2u : 1u);
    for (const rocksdb::KeyVersion& v : versions) EXPECT_EQ(v.sequence, 0u) << "receipt " << hex(v.user_key);
    rocksdb::TablePropertiesCollection index_files;
    ASSERT_TRUE(state.db()->GetPropertiesOfAllTables(state.cf("sealed_index"), &index_files).ok());
    for (const auto& [file, props] : index_files) {
      EXPECT_EQ(props->num_range_deletions, 0u) << file << " keeps the purge's range deletion of the sealed index";
    }
  }
}

// A purge's ingestion does not wait for a flush of what earlier erasures
// deleted: an erasure deletes its users' marks with a write to the meta
// column family's memtable, and RocksDB flushes a memtable before it
// ingests a file whose key range overlaps it. The marks are ingested in a
// file of their own, whose range holds only its users' marks; in one file
// with the stripes' clock floors (which sort before every mark), user 7's
// purge took in user 5's deleted mark, and the state engine's LOG shows
// the flush.
TEST(Purge, APurgesIngestionWaitsForNoFlushOfTheMarksAnEarlierErasureDeleted) {
  TempDir dir;
  const std::string path = dir.sub("db");
  ScopedOverride as_files(Db::Impl::purge_wal_entries, 0);  // every batch ingested
  auto db = open_db(path, manual_writes());
  for (const std::uint64_t u : {std::uint64_t{5}, std::uint64_t{7}}) {
    ASSERT_OK(db->join_community(u, 50));
    ASSERT_OK(db->signal_with_context({u, 1, 0.5}, {{1}}));
    ASSERT_OK(db->leave_community_layer(u));
  }
  ASSERT_OK(db->purge_community_contributions(5));
  const auto flushes_for_ingestion = [&] { return count_in_state_log(path, "External File Ingestion"); };
  ASSERT_TRUE(fs::exists(path + "/state/LOG"));
  const std::size_t before = flushes_for_ingestion();
  Result<PurgeReceipt> r = db->purge_community_contributions(7);
  ASSERT_OK(r);
  EXPECT_EQ(r->entries_removed, 2u);
  EXPECT_EQ(flushes_for_ingestion(), before) << "user 7's purge flushed the state engine before its ingestion";
  EXPECT_EQ(value_of(db->cohort_score(1, 1)), 0.0);
  ASSERT_OK(db->close());
}

// A purge batch of at most Db::Impl::purge_wal_entries ledger entries is
// one synced write through the state engine's WAL (one fsync, where an
// ingestion costs one a file and RocksDB's own); a larger one is ingested
// as files, which stream to disk. Both are exact and durable: the WAL's
// outlives a power cut (PowerLossTest.APurgeNeverOutlivesTheUnsyncedLeave-
// ItCites, Purge.APowerCutAfterAPurgeKeepsTheKeysOfItsBucketsOtherUsers),
// and the sweeps and the SIGKILL rounds run both.
TEST(Purge, ABatchOfFewEntriesIsWrittenThroughTheWalAndALargerOneIngestedAsFiles) {
  TempDir dir;
  const std::string path = dir.sub("db");
  ScopedOverride few(Db::Impl::purge_wal_entries, 3);
  auto db = open_db(path, manual_writes());
  // Each signal is one cohort and one community entry: user 5 has 2 (item
  // 50), user 7 has 6 (items 70-72); another user's signals are kept.
  const auto items = [](std::uint64_t u) { return u == 5 ? std::vector<std::uint64_t>{50} : std::vector<std::uint64_t>{70, 71, 72}; };
  for (const std::uint64_t u : {std::uint64_t{5}, std::uint64_t{7}}) {
    ASSERT_OK(db->join_community(u, 50));
    for (std::uint64_t item : items(u)) {
      ASSERT_OK(db->signal_with_context({u, item, 0.5}, {{1}}));
      ASSERT_OK(db->signal_with_context({100 + u, item, 2.0}, {{1}}));
    }
    ASSERT_OK(db->leave_community_layer(u));
  }
  ASSERT_OK(db->flush());
  // The files a purge ingested, as the state engine's LOG names them.
  const auto ingested_purge_files = [&] { return count_in_state_log(path, "/ingest/purge."); };
  ASSERT_EQ(ingested_purge_files(), 0u);
  Result<PurgeReceipt> wal = db->purge_community_contributions(5);
  ASSERT_OK(wal);
  EXPECT_EQ(wal->entries_removed, 2u);
  EXPECT_EQ(ingested_purge_files(), 0u) << "a purge of 2 entries ingested files";
  Result<PurgeReceipt> files = db->purge_community_contributions(7);
  ASSERT_OK(files);
  EXPECT_EQ(files->entries_removed, 6u);
  EXPECT_GT(ingested_purge_files(), 0u) << "a purge of 6 entries wrote no file";
  for (int reopen = 0; reopen < 2; ++reopen) {
    for (const std::uint64_t u : {std::uint64_t{5}, std::uint64_t{7}}) {
      for (std::uint64_t item : items(u)) {
        EXPECT_EQ(value_of(db->cohort_score(1, item)), 2.0) << "item " << item << ", reopened " << reopen;
        EXPECT_EQ(value_of(db->community_score(50, item)), 0.0) << "item " << item << ", reopened " << reopen;
      }
      Result<std::vector<PurgeReceipt>> receipts = db->purge_receipts(u);
      ASSERT_OK(receipts);
      ASSERT_EQ(receipts->size(), 1u) << "user " << u << ", reopened " << reopen;
      EXPECT_EQ(receipts->front().entries_removed, u == 5 ? 2u : 6u);
      EXPECT_TRUE(receipts->front().erasure_complete);
    }
    expect_healthy(*db, "reopened " + std::to_string(reopen));
    ASSERT_OK(db->close());
    db = open_db(path, manual_writes());
  }
  ASSERT_OK(db->close());
}

// Storage::ingest takes several files of one column family (the purge's
// marks beside its clock floors), and so refuses one file named twice: two
// batches of the same name have written the same file, each over the other.
// A batch through the WAL refuses another batch.
TEST(Purge, AnIngestionOfTwoBatchesOfOneNameIsRefusedWithNothingIngested) {
  TempDir dir;
  const std::string path = dir.sub("db");
  ASSERT_OK(open_db(path)->close());
  Result<std::unique_ptr<Storage>> st = Storage::open(path, Storage::Config{});
  ASSERT_OK(st);
  Storage& storage = **st;
  {  // the batches delete what is left of their files: before the close
    IngestBatch a(&storage, "twice"), b(&storage, "twice");
    ASSERT_TRUE(a.put(storage.state_meta(), "test/a", "1").ok());
    ASSERT_TRUE(b.put(storage.state_meta(), "test/b", "2").ok());
    const Status s = a.ingest("test ingestion", &b);
    EXPECT_EQ(s.code(), StatusCode::InvalidArgument) << s.message();
    EXPECT_NE(s.message().find("twice.default.sst' is named twice"), std::string::npos) << s.message();
    std::string value;
    EXPECT_EQ(storage.get(storage.state_meta(), "test/a", &value).code(), StatusCode::NotFound);
    EXPECT_EQ(storage.get(storage.state_meta(), "test/b", &value).code(), StatusCode::NotFound);
    // Two batches of distinct names, one column family: one atomic ingestion.
    IngestBatch c(&storage, "one"), d(&storage, "two");
    ASSERT_TRUE(c.put(storage.state_meta(), "test/c", "3").ok());
    ASSERT_TRUE(d.put(storage.state_meta(), "test/d", "4").ok());
    ASSERT_OK(c.ingest("test ingestion", &d));
    ASSERT_OK(storage.get(storage.state_meta(), "test/c", &value));
    EXPECT_EQ(value, "3");
    ASSERT_OK(storage.get(storage.state_meta(), "test/d", &value));
    EXPECT_EQ(value, "4");
    // A batch through the WAL is one write of its own: it takes no other.
    IngestBatch e(&storage, "e", IngestBatch::Via::Wal), f(&storage, "f", IngestBatch::Via::Wal);
    ASSERT_TRUE(e.put(storage.state_meta(), "test/e", "5").ok());
    ASSERT_TRUE(f.put(storage.state_meta(), "test/f", "6").ok());
    const Status joined = e.ingest("test write", &f);
    EXPECT_EQ(joined.code(), StatusCode::InvalidArgument) << joined.message();
    EXPECT_EQ(storage.get(storage.state_meta(), "test/e", &value).code(), StatusCode::NotFound);
    ASSERT_OK(e.ingest("test write"));
    ASSERT_OK(storage.get(storage.state_meta(), "test/e", &value));
    EXPECT_EQ(value, "5");
  }
  ASSERT_OK(storage.close());
}

// ---- re-materialization ----

TEST(Rematerialize, FindsAndRepairsEveryAggregateThatDisagreesWithTheLedger) {
  TempDir dir;
  const std::string path = dir.sub("db");
  {
    auto db = open_db(path, manual_writes());
    ASSERT_OK(db->join_community(1, 10));
    ASSERT_OK(db->signal_with_context({1, 5, 2.0}, {{7}}));
    ASSERT_OK(db->signal_with_context({2, 5, 1.0}, {{7}}));
    ASSERT_OK(db->leave_community_layer(2));
    ASSERT_OK(db->purge_community_contributions(2));
    Result<RematerializeReport> r = db->rematerialize_shared_aggregates();
    ASSERT_OK(r);
    EXPECT_TRUE(r->mismatches.empty()) << r->mismatches.front();
    EXPECT_EQ(r->ledger_entries_read, 2u);  // user 1: cohort 7 and community 10
    EXPECT_GE(r->aggregates_checked, 2u);
    EXPECT_FALSE(r->repaired);
    ASSERT_OK(db->close());
  }
  {  // Damage two aggregates behind tidal's back: one off by 1e-9, one that has no ledger entry.
    rocksdb::Options options;
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
    for (const char* n : {"default", "aggregates", "ledger", "receipts", "sealed_ledger", "sealed_index"}) cfs.emplace_back(n, rocksdb::ColumnFamilyOptions());
    cfs[1].options.merge_operator = new_units_add_operator();
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(options, state_engine_dir(path), cfs, &handles, &raw).ok());
    std::string one, five;
    put_units(&one, 1);
    put_units(&five, 5'000'000'000);
    ASSERT_TRUE(raw->Merge({}, handles[1], encode_aggregate_key(AggregateKind::Cohort, 7, 5), one).ok());
    ASSERT_TRUE(raw->Put({}, handles[1], encode_aggregate_key(AggregateKind::Community, 11, 5), five).ok());
    for (auto* h : handles) (void)raw->DestroyColumnFamilyHandle(h);
    delete raw;
  }
  auto db = open_db(path, manual_writes());
  ASSERT_OK(db->signal_with_context({1, 5, 1.0}, {{7}}));  // buffered: written before the scan
  Result<RematerializeReport> r = db->rematerialize_shared_aggregates();
  ASSERT_OK(r);
  ASSERT_EQ(r->mismatches.size(), 2u);
  EXPECT_NE(r->mismatches[0].find("cohort 7 item 5"), std::string::npos) << r->mismatches[0];
  EXPECT_NE(r->mismatches[0].find("stored 3000000001, ledger 3000000000"), std::string::npos) << r->mismatches[0];
  EXPECT_NE(r->mismatches[1].find("community 11 item 5"), std::string::npos) << r->mismatches[1];
  EXPECT_FALSE(r->repaired);
  EXPECT_EQ(value_of(db->cohort_score(7, 5)), 3.000000001);  // report only: nothing changed

  Result<RematerializeReport> fixed = db->rematerialize_shared_aggregates(/*repair=*/true);
  ASSERT_OK(fixed);
  EXPECT_EQ(fixed->mismatches.size(), 2u);
  EXPECT_TRUE(fixed->repaired);
  EXPECT_EQ(value_of(db->cohort_score(7, 5)), 3.0);
  EXPECT_EQ(value_of(db->community_score(11, 5)), 0.0);
  EXPECT_EQ(value_of(db->community_score(10, 5)), 3.0);
  ASSERT_OK(db->signal_with_context({1, 5, 1.0}, {{7}}));  // later merges add to the repaired value
  EXPECT_EQ(value_of(db->cohort_score(7, 5)), 4.0);
  ASSERT_OK(db->close());
  db = open_db(path, manual_writes());
  expect_healthy(*db, "after the repair and a restart");
  EXPECT_EQ(value_of(db->cohort_score(7, 5)), 4.0);
}

// ---- bulk ----

TEST(Purge, BulkPurgeIsExactForEveryListedUserWithOneReceiptEach) {
  TempDir dir;
  const Workload w;
  const std::set<std::uint64_t> gone{2, 3, 5, 8, 13, 21, 34};
  auto purged = open_db(dir.sub("purged"), manual_writes());
  auto reference = open_db(dir.sub("reference"), manual_writes());
  join_all(*purged);
  join_all(*reference);
  feed(*purged, w, {});
  feed(*reference, w, gone);
  std::vector<std::uint64_t> ids(gone.begin(), gone.end());
  ids.push_back(8);  // a duplicate: purged once
  ASSERT_OK(purged->leave_community_layer(ids));
  Result<std::vector<PurgeReceipt>> r = purged->purge_community_contributions(ids);
  ASSERT_OK(r);
  ASSERT_EQ(r->size(), gone.size());
  auto g = gone.begin();
  for (const PurgeReceipt& receipt : *r) {
    EXPECT_EQ(receipt.user_id, *g++);
    EXPECT_GT(receipt.entries_removed, 0u);
    EXPECT_EQ(purged->purge_receipts(receipt.user_id)->size(), 1u);
  }
  EXPECT_EQ(count_shared_differences(*purged, *reference), 0u);
  expect_healthy(*purged, "after the bulk purge");
  for (std::uint64_t u : gone) {
    for (const auto& f : scan_files(dir.sub("purged"), u).found) ADD_FAILURE() << "user " << u << ": " << f;
  }
}

// The ranges an erasure force-compacts: neighbours are joined, so a file
// holding several purged users is rewritten once, unless a file lies wholly
// between them (it would be rewritten for nothing) or the joined range would
// overlap more than the cap's files.
TEST(ErasureRanges, NeighboursAreJoinedUnlessAFileLiesBetweenOrTheCapIsReached) {
  std::vector<LevelFiles> levels(7);
  levels[6] = {{"10", "30", "50"}, {"19", "39", "59"}};  // three files: [10, 19], [30, 39], [50, 59]
  levels[5] = {{"60"}, {"65"}};                          // one file above them: [60, 65]
  const std::vector<KeyRange> ranges = {{"12", "13"}, {"15", "16"}, {"35", "36"}, {"55", "56"}, {"70", "71"}};
  // Up to 2 files a range: [12, 36) overlaps the first two files; adding
  // [55, 56) would make three. [60, 65] lies between 56 and 70.
  EXPECT_EQ(JoinRanges(ranges, levels, 2),
            (std::vector<KeyRange>{{"12", "36"}, {"55", "56"}, {"70", "71"}}));
  EXPECT_EQ(JoinRanges(ranges, levels, 8), (std::vector<KeyRange>{{"12", "56"}, {"70", "71"}}));
  // A cap of 1: the two ranges inside the first file only.
  EXPECT_EQ(JoinRanges(ranges, levels, 1),
            (std::vector<KeyRange>{{"12", "16"}, {"35", "36"}, {"55", "56"}, {"70", "71"}}));
  // Ends are exclusive: a file that starts where a range ends lies between
  // it and the next; one the range reaches into does not.
  EXPECT_EQ(JoinRanges({{"20", "30"}, {"40", "41"}}, levels, 8),
            (std::vector<KeyRange>{{"20", "30"}, {"40", "41"}}));
  EXPECT_EQ(JoinRanges({{"20", "31"}, {"40", "41"}}, levels, 8), (std::vector<KeyRange>{{"20", "41"}}));
  // No files at levels 1 and up (everything in memtables or level 0): one range.
  EXPECT_EQ(JoinRanges(ranges, {}, 2), (std::vector<KeyRange>{{"12", "71"}}));
  EXPECT_TRUE(JoinRanges({}, levels, 2).empty());
}

// Purges while other users signal from several threads: the signals keep
// flowing through the write-behind buffers, and every score stays exact.
TEST(Purge, ConcurrentSignalsOfOtherUsersStayExact) {
  TempDir dir;
  auto db = open_db(dir.sub("db"), [] {
    Options o;
    o.aggregate_write_period = std::chrono::milliseconds(2);
    return o;
  }());
  constexpr std::uint64_t kLeavers = 6;
  for (std::uint64_t u = 1; u <= kLeavers; ++u) {
    for (std::uint64_t i = 0; i < 50; ++i) ASSERT_OK(db->signal_with_context({u, i % 5, 0.5}, {{1}}));
    ASSERT_OK(db->leave_community_layer(u));
  }
  std::vector<std::thread> threads;
  for (std::uint64_t t = 0; t < 2; ++t) {
    threads.emplace_back([&db, t] {
      for (std::uint64_t i = 0; i < 3000; ++i) {
        EXPECT_TRUE(db->signal_with_context({100 + t, i % 5, 0.1}, {{1}}).ok());
      }
    });
  }
  for (std::uint64_t u = 1; u <= kLeavers; ++u) ASSERT_OK(db->purge_community_contributions(u));
  for (auto& t : threads) t.join();
  for (std::uint64_t item = 0; item < 5; ++item) {
    // 2 threads x 600 signals of 0.1 on each item, exact.
    EXPECT_EQ(value_of(db->cohort_score(1, item)), 120.0) << "item " << item;
  }
  expect_healthy(*db, "after concurrent purges");
}

// ---- receipt codec ----

TEST(ReceiptCodec, RoundTripsAndRejectsAnyOtherLengthOrVersion) {
  const ReceiptRecord r{11, 22, 33, -Units{5} << 90, Units{7}};
  const std::string bytes = encode_receipt(r);
  ASSERT_EQ(bytes.size(), kReceiptSize);
  EXPECT_EQ(decode_receipt(bytes), r);
  EXPECT_FALSE(decode_receipt(bytes.substr(1)));
  EXPECT_FALSE(decode_receipt(bytes + "x"));
  std::string v2 = bytes;
  v2[0] = 2;
  EXPECT_FALSE(decode_receipt(v2));
  EXPECT_EQ(encode_receipt_key(0x0102030405060708ULL, 9), std::string("\x01\x02\x03\x04\x05\x06\x07\x08\x10", 9) +
                                                             std::string("\0\0\0\0\0\0\0\x09", 8));
}

// ---- Nth-I/O fault sweep ----

// A purge on a file system that fails its n-th file operation (n = 1, 2,
// ... until the purge completes): reported failed or done, never half.
// After a reopen on the normal file system the user is either purged
// (receipt, scores without the user) or untouched (no receipt, scores with
// the user), I1 holds, re-materialization finds nothing, and a purge then
// succeeds. For each way a purge's batch is written (Db::Impl::
// purge_wal_entries: 0, every batch ingested as files).
void sweep_purge_faults(std::uint64_t wal_entries) {
  ScopedOverride write_path(Db::Impl::purge_wal_entries, wal_entries);
  TempDir dir;
  const std::string base = dir.sub("base"), work = dir.sub("work");
  // A leaver id whose bytes occur nowhere by chance (the erasure scan).
  constexpr std::uint64_t kLeaver = 0xA1B2C3D4E5F60703ULL, kOther = 4;
  {
    auto db = open_db(base, manual_writes());
    ASSERT_OK(db->join_community(kLeaver, 30));
    for (std::uint64_t i = 0; i < 20; ++i) {
      ASSERT_OK(db->signal_with_context({kLeaver, i, 1.25}, {{8}}));
      ASSERT_OK(db->signal_with_context({kOther, i, 2.0}, {{8}}));
    }
    ASSERT_OK(db->flush());
    ASSERT_OK(db->signal_with_context({kLeaver, 0, 1.25}, {{8}}));  // one buffered
    ASSERT_OK(db->leave_community_layer(kLeaver));
    ASSERT_OK(db->close());
  }
  auto fault = reliability::FaultEnv::make();
  std::size_t done = 0, failed = 0, failed_but_durable = 0, runs = 0, erasure_failed = 0, finished_by_retry = 0;
  // Every n up to 16 (the purge batch and its sync come early), then every
  // stride-th (6 in the default tier, every one under --soak;
  // testing::sweep_stride): a failed flush costs RocksDB a 1 s wait at
  // close, and the erasure phase alone has ~60 file operations.
  const std::uint64_t stride = testing::sweep_stride(6);
  for (std::uint64_t n = 1; n < 3000 && !::testing::Test::HasFailure(); n += n < 16 ? 1 : stride) {
    fs::remove_all(work);
    fs::copy(base, work, fs::copy_options::recursive);
    Result<std::unique_ptr<Db>> opened = Db::Impl::open(work, manual_writes(), fault.env.get());
    ASSERT_OK(opened);
    fault.fs->fail_nth_op(n, /*persistent=*/false);
    Result<PurgeReceipt> r = (*opened)->purge_community_contributions(kLeaver);
    const std::uint64_t ops = fault.fs->ops_since_arm();
    fault.fs->clear_faults();
    const std::string message = r.ok() ? std::string() : r.status().message();
    if (message.find("physical erasure") != std::string::npos) {
      // The batch is durable, the erasure is not: the receipt says so, and
      // the next purge of the user finishes it, unless RocksDB itself is in
      // its error state after a failed flush or compaction, which only a
      // reopen clears (Purge.AnErasureThatDidNotFinishIsFinishedByTheNextPurge
      // covers a fault RocksDB survives).
      ++erasure_failed;
      Result<std::vector<PurgeReceipt>> marked = (*opened)->purge_receipts(kLeaver);
      ASSERT_OK(marked);
      ASSERT_EQ(marked->size(), 1u) << "fault at op " << n << ": " << message;
      EXPECT_FALSE(marked->front().erasure_complete) << "fault at op " << n;
      if (Result<PurgeReceipt> retry = (*opened)->purge_community_contributions(kLeaver); retry.ok()) {
        ++finished_by_retry;
        EXPECT_EQ(retry->entries_removed, 0u);
        for (const std::string& f : scan_files(work, kLeaver).found) {
          ADD_FAILURE() << "fault at op " << n << ", after the retry: " << f;
        }
        marked = (*opened)->purge_receipts(kLeaver);
        ASSERT_OK(marked);
        EXPECT_TRUE(marked->front().erasure_complete) << "fault at op " << n;
      }
    }
    (void)(*opened)->close();
    opened->reset();
    ++runs;
    const std::string ctx = "fault at op " + std::to_string(n) + " (" + (r.ok() ? "OK" : r.status().to_string()) + ")";
    r.ok() ? ++done : ++failed;

    auto db = open_db(work, manual_writes());
    ASSERT_NE(db, nullptr) << ctx;
    Result<std::vector<PurgeReceipt>> receipts = db->purge_receipts(kLeaver);
    ASSERT_OK(receipts);
    const bool purged = !receipts->empty();
    if (r.ok()) {
      EXPECT_TRUE(purged) << ctx << ": acknowledged purge without a receipt";
      // 21 signals, each one cohort and one community entry of 1.25.
      EXPECT_EQ(r->entries_removed, 42u) << ctx;
      EXPECT_EQ(r->cohort_weight_removed, 26.25) << ctx;
      EXPECT_EQ(r->community_weight_removed, 26.25) << ctx;
    }
    if (!r.ok() && purged) {
      ++failed_but_durable;
      // Never "untouched" for a purge that is durable.
      EXPECT_TRUE(message.find("may or may not be durable") != std::string::npos ||
                  message.find("the purge is done and durable") != std::string::npos)
          << ctx;
    }
    EXPECT_LE(receipts->size(), 1u) << ctx;
    if (purged) {
      // The open finished whatever erasure the fault cut short.
      EXPECT_TRUE(receipts->front().erasure_complete) << ctx;
      for (const std::string& f : scan_files(work, kLeaver).found) ADD_FAILURE() << ctx << ", after reopen: " << f;
    }
    for (std::uint64_t i = 0; i < 20; ++i) {
      const double expect = (purged ? 0.0 : 1.25 * (i == 0 ? 2 : 1)) + 2.0;
      ASSERT_EQ(value_of(db->cohort_score(8, i)), expect) << ctx << ": item " << i << (purged ? " (purged)" : " (not purged)");
      ASSERT_EQ(value_of(db->community_score(30, i)), purged ? 0.0 : 1.25 * (i == 0 ? 2 : 1)) << ctx;
    }
    expect_healthy(*db, ctx);
    Result<PurgeReceipt> again = db->purge_community_contributions(kLeaver);
    ASSERT_OK(again);
    EXPECT_EQ(again->entries_removed == 0, purged) << ctx;
    EXPECT_EQ(value_of(db->cohort_score(8, 0)), 2.0) << ctx;
    ASSERT_OK(db->close());
    if (r.ok() && ops < n) break;  // completed without reaching op n
  }
  std::cout << "[purge fault sweep, " << (wal_entries == 0 ? "batch ingested as files" : "batch through the WAL")
            << "] runs: " << runs << ", purges done: " << done << ", failed: " << failed
            << " (of which durable and reported as such: " << failed_but_durable << "; erasure cut short: "
            << erasure_failed << ", finished by the next purge on the same handle: " << finished_by_retry << ")\n";
  EXPECT_GT(failed, 0u);
  EXPECT_GT(erasure_failed, 0u);
  EXPECT_GT(done, 0u);
}

// The leaver's 42 entries go through the WAL (Db::Impl::purge_wal_entries).
TEST(PurgeFaultSweep, APurgeIsDoneOrNotDoneWhateverFileOperationFails) {
  sweep_purge_faults(Db::Impl::purge_wal_entries);
}

TEST(PurgeFaultSweep, APurgeIngestedAsFilesIsDoneOrNotDoneWhateverFileOperationFails) { sweep_purge_faults(0); }


// ---- the erasure holds no stripe; P4 under concurrent writers and readers ----

// While a purge erases, a leave of another user of the same lock stripe goes
// through, and the purged user can rejoin and contribute again: the fresh
// ledger is above the range tombstone and survives the erasure.
TEST(Purge, TheErasureHoldsNoLockStripeAndARejoinDuringItKeepsItsFreshLedger) {
  TempDir dir;
  const std::string path = dir.sub("db");
  constexpr std::uint64_t kLeaver = 0xA1B2C3D4E5F60740ULL;  // stripe kLeaver % 64 = 0
  constexpr std::uint64_t kSameStripe = kLeaver + 64;
  auto db = open_db(path, manual_writes());
  ASSERT_OK(db->join_community(kLeaver, 9));
  for (std::uint64_t i = 0; i < 50; ++i) ASSERT_OK(db->signal_with_context({kLeaver, i, 1.5}, {{4}}));
  ASSERT_OK(db->flush());
  ASSERT_OK(db->leave_community_layer(kLeaver));
  // On another thread, joined after the purge returned: a stripe still held
  // shows as a timeout here rather than as a deadlock.
  std::atomic<bool> leave_went_through{false}, rejoined{false};
  std::thread during;
  Db::Impl::before_erasure_for_testing = [&] {
    std::promise<void> done;
    std::future<void> finished = done.get_future();
    during = std::thread([&, done = std::move(done)]() mutable {
      leave_went_through = db->leave_community_layer(kSameStripe).ok();
      rejoined = db->rejoin_community_layer(kLeaver).ok() && db->signal_with_context({kLeaver, 7, 0.25}, {{4}}).ok() &&
                 db->flush().ok();
      done.set_value();
    });
    if (finished.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      ADD_FAILURE() << "a leave and a rejoin in the purged user's stripe waited for the erasure";
    }
  };
  Result<PurgeReceipt> r = db->purge_community_contributions(kLeaver);
  Db::Impl::before_erasure_for_testing = nullptr;
  if (during.joinable()) during.join();
  ASSERT_OK(r);
  EXPECT_EQ(r->entries_removed, 100u);
  EXPECT_TRUE(r->erasure_complete);
  EXPECT_TRUE(leave_went_through.load());
  ASSERT_TRUE(rejoined.load());
  // What the user gave after the rejoin is there, in the scores and in the ledger.
  EXPECT_EQ(value_of(db->cohort_score(4, 7)), 0.25);
  EXPECT_EQ(value_of(db->community_score(9, 7)), 0.25);
  EXPECT_EQ(value_of(db->cohort_score(4, 8)), 0.0);
  expect_healthy(*db, "after the rejoin during the erasure");
  ASSERT_OK(db->leave_community_layer(kLeaver));
  Result<PurgeReceipt> again = db->purge_community_contributions(kLeaver);
  ASSERT_OK(again);
  EXPECT_EQ(again->entries_removed, 2u);  // the fresh ledger: one cohort and one community entry
  for (const std::string& f : scan_files(path, kLeaver).found) ADD_FAILURE() << "after the second purge: " << f;
}

// A Db on `fault`'s Env (manual writes) in which `user`, in community 9,
// has 30 signals stored (cohort 4: 60 ledger entries in all); null, with
// the failure reported, when a step fails.
std::unique_ptr<Db> open_with_stored_user(reliability::FaultEnv& fault, const std::string& path, std::uint64_t user) {
  Result<std::unique_ptr<Db>> opened = Db::Impl::open(path, manual_writes(), fault.env.get());
  EXPECT_OK(opened);
  if (!opened.ok()) return nullptr;
  Status s = (*opened)->join_community(user, 9);
  for (std::uint64_t i = 0; i < 30 && s.ok(); ++i) s = (*opened)->signal_with_context({user, i, 1.5}, {{4}}).status();
  if (s.ok()) s = (*opened)->flush();
  EXPECT_OK(s);
  return s.ok() ? std::move(*opened) : nullptr;
}

// An erasure that did not finish (here: RocksDB cannot delete the obsolete
// files, a fault it survives) is reported, marked on the receipt, and
// finished by the user's next purge, which has nothing left to remove.
TEST(Purge, AnErasureThatDidNotFinishIsFinishedByTheNextPurge) {
  TempDir dir;
  const std::string path = dir.sub("db");
  constexpr std::uint64_t kLeaver = 0xA1B2C3D4E5F60750ULL;
  auto fault = reliability::FaultEnv::make();
  std::unique_ptr<Db> opened = open_with_stored_user(fault, path, kLeaver);
  ASSERT_NE(opened, nullptr);
  Db& db = *opened;
  // The key in an SST file, which the erasure then compacts (a key still in
  // a memtable leaves no file with its value: the flush drops it there).
  ASSERT_OK(Db::Impl::storage_for_testing(db).flush(Storage::Engine::Users));
  ASSERT_OK(db.leave_community_layer(kLeaver));
  const auto saved = Db::Impl::erasure_wait;
  Db::Impl::erasure_wait = std::chrono::milliseconds(300);
  fault.fs->set_fail_deletes(true);
  Result<PurgeReceipt> first = db.purge_community_contributions(kLeaver);
  fault.fs->clear_faults();
  ASSERT_FALSE(first.ok());
  EXPECT_NE(first.status().message().find("the purge is done and durable"), std::string::npos)
      << first.status().to_string();
  // The erasure deletes the key store's files it replaced itself when
  // RocksDB could not (storage: erase_ranges), and names the one it could not.
  EXPECT_NE(first.status().message().find("deleting the replaced key-store file '" + path + "/"), std::string::npos)
      << first.status().to_string();
  Result<std::vector<PurgeReceipt>> receipts = db.purge_receipts(kLeaver);
  ASSERT_OK(receipts);
  ASSERT_EQ(receipts->size(), 1u);
  EXPECT_EQ(receipts->front().entries_removed, 60u);
  EXPECT_FALSE(receipts->front().erasure_complete);
  EXPECT_FALSE(scan_files(path, kLeaver).found.empty()) << "the test left no file to erase";
  EXPECT_EQ(value_of(db.cohort_score(4, 3)), 0.0);  // the purge itself is complete

  Result<PurgeReceipt> second = db.purge_community_contributions(kLeaver);
  Db::Impl::erasure_wait = saved;
  ASSERT_OK(second);
  EXPECT_EQ(second->entries_removed, 0u);
  EXPECT_TRUE(second->erasure_complete);
  for (const std::string& f : scan_files(path, kLeaver).found) ADD_FAILURE() << "after the second purge: " << f;
  receipts = db.purge_receipts(kLeaver);
  ASSERT_OK(receipts);
  ASSERT_EQ(receipts->size(), 1u);  // the second purge removed nothing and wrote no receipt
  EXPECT_TRUE(receipts->front().erasure_complete);
  expect_healthy(db, "after the finished erasure");
  ASSERT_OK(db.close());
}

// The key store's erasure keeps a bucket key when it cannot read the
// bucket's current one (it cannot tell a replaced key from the current
// one): the erasure is then not done, the purge says so, and the next purge
// finishes it. Here every read of the bucket keys' newest file, which holds
// the bucket's new key, fails during the erasure's compactions in place.
// Reported done before: the value was in the compaction's output (seen in
// PurgeFaultSweep at every file operation).
TEST(Purge, AnErasureThatCannotReadTheKeyStoreKeepsTheValueAndStaysMarked) {
  TempDir dir;
  const std::string path = dir.sub("db");
  constexpr std::uint64_t kLeaver = 0xA1B2C3D4E5F60751ULL;
  auto fault = reliability::FaultEnv::make();
  std::unique_ptr<Db> opened = open_with_stored_user(fault, path, kLeaver);
  ASSERT_NE(opened, nullptr);
  Db& db = *opened;
  Storage& storage = Db::Impl::storage_for_testing(db);
  // The bucket's key in an SST file, out of the WALs: the erasure then
  // compacts only files written before the bucket's new key.
  ASSERT_OK(storage.flush_past_wals(Storage::Engine::Users));
  ASSERT_OK(db.leave_community_layer(kLeaver));
  std::string unreadable;
  Storage::step_for_testing = [&](std::string_view task, int step) {
    if (task != "erasure" || step != 1) return;
    // The new key into a file of its own (as a flush of RocksDB's own
    // would put it), the one the erasure's filter reads it from.
    ASSERT_TRUE(storage.db(Storage::Engine::Users)->Flush(rocksdb::FlushOptions(), storage.bucket_keys()).ok());
    rocksdb::ColumnFamilyMetaData meta;
    storage.db(Storage::Engine::Users)->GetColumnFamilyMetaData(storage.bucket_keys(), &meta);
    rocksdb::SequenceNumber newest = 0;
    for (const rocksdb::LevelMetaData& level : meta.levels) {
      for (const rocksdb::SstFileMetaData& f : level.files) {
        if (f.largest_seqno >= newest) {
          newest = f.largest_seqno;
          unreadable = f.db_path + f.name;
        }
      }
    }
    fault.fs->fail_reads_of(unreadable);
  };
  Result<PurgeReceipt> first = db.purge_community_contributions(kLeaver);
  Storage::step_for_testing = nullptr;
  fault.fs->clear_faults();
  ASSERT_FALSE(unreadable.empty()) << "the erasure compacted nothing in place";
  ASSERT_FALSE(first.ok()) << "the erasure could not read " << unreadable << " and reported the purge's erasure done";
  EXPECT_NE(first.status().message().find("the physical erasure of the ledger bytes did not finish"), std::string::npos)
      << first.status().to_string();
  EXPECT_NE(first.status().message().find("could not be read"), std::string::npos) << first.status().to_string();
  Result<std::vector<PurgeReceipt>> receipts = db.purge_receipts(kLeaver);
  ASSERT_OK(receipts);
  ASSERT_EQ(receipts->size(), 1u);
  EXPECT_FALSE(receipts->front().erasure_complete);
  EXPECT_FALSE(scan_files(path, kLeaver).found.empty()) << "the kept value is on disk";

  Result<PurgeReceipt> second = db.purge_community_contributions(kLeaver);
  ASSERT_OK(second);
  EXPECT_EQ(second->entries_removed, 0u);
  EXPECT_TRUE(second->erasure_complete);
  for (const std::string& f : scan_files(path, kLeaver).found) ADD_FAILURE() << "after the second purge: " << f;
  expect_healthy(db, "after the finished erasure");
  ASSERT_OK(db.close());
}

// A purge gives the purged user's bucket a new key and wraps the bucket's
// other users' keys again with it; its erasure then drops the bucket's old
// key from the files, here without a flush (the old key was in an SST file
// already). A power cut right after the purge returns keeps the new key and
// the keys wrapped again: the write was synced. (Unsynced, the cut took
// them back after the erasure had dropped the old key, and the other user's
// key could not be unwrapped any more.)
TEST(Purge, APowerCutAfterAPurgeKeepsTheKeysOfItsBucketsOtherUsers) {
  TempDir dir;
  const std::string path = dir.sub("db");
  constexpr std::uint64_t kLeaver = 0xA1B2C3D4E5F60752ULL;
  std::uint64_t sibling = 1;
  while (key_bucket(sibling) != key_bucket(kLeaver)) ++sibling;
  auto fault = reliability::FaultEnv::make();
  {
    std::unique_ptr<Db> db = open_with_stored_user(fault, path, kLeaver);
    ASSERT_NE(db, nullptr);
    ASSERT_OK(db->join_community(sibling, 9));
    ASSERT_OK(db->signal_with_context({sibling, 1000, 2.5}, {{4}}));
    ASSERT_OK(db->flush());
    // The bucket's key in an SST file, out of the WALs: the erasure does not flush.
    ASSERT_OK(Db::Impl::storage_for_testing(*db).flush_past_wals(Storage::Engine::Users));
    ASSERT_OK(db->leave_community_layer(kLeaver));
    Result<PurgeReceipt> r = db->purge_community_contributions(kLeaver);
    ASSERT_OK(r);
    EXPECT_TRUE(r->erasure_complete);
    fault.fs->cut_power();
    db.reset();  // close fails: the power is off
  }
  fault.fs->restore_power();
  Result<std::unique_ptr<Db>> reopened = Db::Impl::open(path, manual_writes(), fault.env.get());
  ASSERT_OK(reopened);
  Db& db = **reopened;
  Result<VerifyReport> v = db.verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
  ASSERT_OK(db.leave_community_layer(sibling));
  Result<PurgeReceipt> o = db.purge_community_contributions(sibling);
  ASSERT_OK(o);
  EXPECT_EQ(o->entries_removed, 2u);
  EXPECT_EQ(o->cohort_weight_removed, 2.5);
  ASSERT_OK(db.close());
}

// A compaction of all of `cf` into the last level, in a thread of its own,
// stalled at its first output's sync (`fault`'s file system holds it) until
// release(); join() waits for its end.
class StalledCompaction {
 public:
  StalledCompaction(reliability::FaultEnv& fault, const std::string& path, rocksdb::DB* db,
                    rocksdb::ColumnFamilyHandle* cf)
      : fault_(fault) {
    fault_.fs->hold_syncs_under(path + "/0", /*first_sst_only=*/true);
    thread_ = std::thread([this, db, cf] {
      rocksdb::CompactRangeOptions options;
      options.exclusive_manual_compaction = false;
      options.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForce;
      status_ = db->CompactRange(options, cf, nullptr, nullptr);
    });
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (fault_.fs->held_syncs() == 0 && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  ~StalledCompaction() {
    release();
    join();
  }
  bool stalled() const { return fault_.fs->held_syncs() > 0; }
  void release() { fault_.fs->release_syncs(); }
  // The compaction's status, once ended.
  rocksdb::Status join() {
    if (thread_.joinable()) thread_.join();
    return status_;
  }

 private:
  reliability::FaultEnv& fault_;
  std::thread thread_;
  rocksdb::Status status_;
};

// RocksDB keeps a file a compaction replaced while a compaction of the same
// engine that began before the file was written is under way (its "pending
// outputs"): in the users engine, the users partition's, which run for
// seconds at 1M users. The erasure deletes the key store's files it replaced
// itself: a purge neither waits for such a compaction nor leaves the files.
TEST(Purge, TheErasureDoesNotWaitForAUsersPartitionCompactionUnderWay) {
  TempDir dir;
  const std::string path = dir.sub("db");
  constexpr std::uint64_t kLeaver = 0xA1B2C3D4E5F60760ULL;
  auto fault = reliability::FaultEnv::make();
  std::unique_ptr<Db> opened = open_with_stored_user(fault, path, kLeaver);
  ASSERT_NE(opened, nullptr);
  Db& db = *opened;
  Storage& storage = Db::Impl::storage_for_testing(db);
  rocksdb::DB* users = storage.db(Storage::Engine::Users);
  for (std::uint64_t u = 1; u <= 200; ++u) ASSERT_OK(db.join_community(u, 9));
  ASSERT_TRUE(users->Flush(rocksdb::FlushOptions(), storage.users()).ok());
  for (std::uint64_t u = 201; u <= 400; ++u) ASSERT_OK(db.join_community(u, 9));
  ASSERT_OK(db.leave_community_layer(kLeaver));
  ASSERT_TRUE(users->Flush(rocksdb::FlushOptions(), storage.users()).ok());
  StalledCompaction compaction(fault, path, users, storage.users());
  ASSERT_TRUE(compaction.stalled()) << "the users partition's compaction never reached its sync";
  const auto saved = Db::Impl::erasure_wait;
  Db::Impl::erasure_wait = std::chrono::milliseconds(2'000);
  Result<PurgeReceipt> r = db.purge_community_contributions(kLeaver);
  Db::Impl::erasure_wait = saved;
  const bool still_held = compaction.stalled();
  compaction.release();
  const rocksdb::Status compacted = compaction.join();
  ASSERT_OK(r);
  EXPECT_EQ(r->entries_removed, 60u);
  EXPECT_TRUE(r->erasure_complete);
  EXPECT_TRUE(still_held) << "the compaction ended before the purge did: the test proved nothing";
  EXPECT_TRUE(compacted.ok()) << compacted.ToString();
  for (const std::string& f : scan_files(path, kLeaver).found) ADD_FAILURE() << "after the purge: " << f;
  expect_healthy(db, "after the purge beside the stalled compaction");
  ASSERT_OK(db.close());
}

// The key store's erasure runs beside the bucket keys' other compactions.
// One under way that holds the file with the replaced bucket key (here
// stalled at its output's sync, having read the key before the purge)
// makes the erasure's compaction of that file give up; the erasure picks
// its files again once that compaction is done, and compacts what it
// wrote: on return no file holds the key.
TEST(Purge, TheKeyStoresErasureCompactsAgainWhatACompactionBesideItWrote) {
  TempDir dir;
  const std::string path = dir.sub("db");
  constexpr std::uint64_t kLeaver = 0xA1B2C3D4E5F60761ULL;
  auto fault = reliability::FaultEnv::make();
  std::unique_ptr<Db> opened = open_with_stored_user(fault, path, kLeaver);
  ASSERT_NE(opened, nullptr);
  Db& db = *opened;
  Storage& storage = Db::Impl::storage_for_testing(db);
  rocksdb::DB* users = storage.db(Storage::Engine::Users);
  ASSERT_TRUE(users->Flush(rocksdb::FlushOptions(), storage.bucket_keys()).ok());
  ASSERT_OK(db.leave_community_layer(kLeaver));
  const testing::ErasureScan held = testing::scan_files_settled(path, kLeaver);
  ASSERT_EQ(held.user_keys.size(), 1u) << held.summary();
  StalledCompaction compaction(fault, path, users, storage.bucket_keys());
  ASSERT_TRUE(compaction.stalled()) << "the key store's compaction never reached its sync";
  std::atomic<bool> released{false};
  std::thread release([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    released = true;
    compaction.release();
  });
  Result<PurgeReceipt> r = db.purge_community_contributions(kLeaver);
  const bool returned_after_release = released;
  release.join();
  const rocksdb::Status compacted = compaction.join();
  ASSERT_OK(r);
  EXPECT_EQ(r->entries_removed, 60u);
  EXPECT_TRUE(r->erasure_complete);
  EXPECT_TRUE(returned_after_release) << "the purge returned while the compaction beside it still held the key";
  EXPECT_TRUE(compacted.ok()) << compacted.ToString();
  for (const std::string& f : scan_files(path, kLeaver, held.user_keys).found) ADD_FAILURE() << "after the purge: " << f;
  expect_healthy(db, "after the purge beside the key store's compaction");
  ASSERT_OK(db.close());
}

// A purge during a verify() neither waits for the check nor fails: the
// erasure asks the check to let go of its snapshot (and then of the files
// it reads), and the check starts over. Here every step of the check (1,024
// records) dawdles 50 ms until the purge has returned, so one attempt takes
// far longer than the erasure's wait of 300 ms; before, the erasure waited
// for the check's snapshot and failed with "a snapshot older than the purge".
TEST(PurgeConcurrentTest, APurgeDuringAVerifyNeitherWaitsForItNorFails) {
  TempDir dir;
  const std::string path = dir.sub("db");
  ScopedOverride wait(Db::Impl::erasure_wait, std::chrono::milliseconds(300));
  std::atomic<bool> checking{false}, purged{false};
  ScopedOverride hook(Storage::step_for_testing, [&](std::string_view task, int) {
    if (task != "ledger check") return;
    checking.store(true);
    if (!purged.load()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  });
  auto db = open_db(path, manual_writes());
  constexpr std::uint64_t kLeaver = 0xA1B2C3D4E5F60900ULL;
  ASSERT_OK(db->join_community(kLeaver, 9));
  for (std::uint64_t i = 0; i < 30; ++i) {
    ASSERT_OK(db->signal_with_context({kLeaver, i, 1.5}, {{4}}));
    if (i % 10 == 9) ASSERT_OK(db->flush());
  }
  for (std::uint64_t u = 1; u <= 8000; ++u) {
    ASSERT_OK(db->signal_with_context({u, u % 40, 1.0}, {{u % 30}}));
  }
  ASSERT_OK(db->flush());
  ASSERT_OK(db->leave_community_layer(kLeaver));

  Result<VerifyReport> verified = Status::IOError("not run");
  std::thread verifier([&] { verified = db->verify(); });
  while (!checking.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  Result<PurgeReceipt> receipt = db->purge_community_contributions(kLeaver);
  purged.store(true);
  verifier.join();
  ASSERT_OK(receipt);
  EXPECT_EQ(receipt->entries_removed, 60u);
  EXPECT_TRUE(receipt->erasure_complete);
  for (const std::string& f : scan_files(path, kLeaver).found) ADD_FAILURE() << "after the purge: " << f;
  ASSERT_OK(verified);
  EXPECT_TRUE(verified->ok());
  EXPECT_GE(db->stats().ledger_check_restarts, 1u);
  EXPECT_EQ(value_of(db->cohort_score(4, 3)), 0.0);
  ASSERT_OK(db->close());
}

// P4 on return while the writer ingests other users' batches every few ms
// and readers read scores and verify: RocksDB may still be deleting, or a
// reader may still hold, an obsolete file with the purged ledger; the purge
// returns only once no such file is left.
TEST(PurgeConcurrentTest, NoFileHoldsThePurgedLedgerOnReturnUnderConcurrentWritersAndReaders) {
  TempDir dir;
  const std::string path = dir.sub("db");
  // Under TSan an erasure here once took longer than the default 10 s (the
  // erasure then fails, by design, and this test saw its leftover), when a
  // reader's verify() held its snapshot for its whole scan.
  ScopedOverride wait(Db::Impl::erasure_wait, std::chrono::milliseconds(120'000));
  Options options;
  options.aggregate_write_period = std::chrono::milliseconds(5);
  auto db = open_db(path, options);
  constexpr int kLeavers = 12;
  auto leaver = [](int k) { return std::uint64_t{0xA1B2C3D4E5F60800ULL} + static_cast<std::uint64_t>(k); };
  for (int k = 0; k < kLeavers; ++k) {
    ASSERT_OK(db->join_community(leaver(k), 9));
    for (std::uint64_t i = 0; i < 40; ++i) {
      ASSERT_OK(db->signal_with_context({leaver(k), i, 1.5}, {{4, 5}}));
      if (i % 10 == 9) ASSERT_OK(db->flush());
    }
    ASSERT_OK(db->leave_community_layer(leaver(k)));
  }
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> writes{0}, reads{0};
  // Paced (at most ~13,000 signals a second: 64 per write period of 5 ms,
  // so every batch the writer ingests holds some), so that the state, and a
  // verify() and a scan over it, stay small under the sanitizers too: a
  // verify() that began before a purge holds its snapshot, which the
  // erasure waits for. Paced at 64 a millisecond, the ledger grew with each
  // slower purge, and the test took 6 s in the main build, 133 s under ASan
  // and 170 s under TSan. Both threads also wait while this thread reads
  // every file after a purge: under TSan those reads took ~9 s each by the
  // last purge, the signaller kept writing, and each read was longer than
  // the last (114 s for the test, of which the purges ~4 s).
  std::atomic<bool> checking{false};
  const auto wait_for_check = [&] {
    while (checking.load() && !stop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  std::thread signaler([&] {
    for (std::uint64_t i = 0; !stop.load(); ++i) {
      wait_for_check();
      if (db->signal_with_context({1 + i % 500, i % 97, 1.0}, {{4}}).ok()) writes.fetch_add(1);
      if (i % 64 == 63) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  });
  std::thread reader([&] {
    for (std::uint64_t i = 0; !stop.load(); ++i) {
      wait_for_check();
      (void)db->cohort_score(4, i % 97);
      if (i % 200 == 0) (void)db->verify();
      reads.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  });
  std::size_t clean = 0;
  for (int k = 0; k < kLeavers; ++k) {
    Result<PurgeReceipt> r = db->purge_community_contributions(leaver(k));
    EXPECT_OK(r);
    if (!r.ok()) continue;
    EXPECT_EQ(r->entries_removed, 120u);
    checking.store(true);
    const ErasureScan scan = scan_files(path, leaver(k));
    checking.store(false);
    for (const std::string& f : scan.found) ADD_FAILURE() << "purge " << k << " returned, yet " << f;
    clean += scan.found.empty() ? 1u : 0u;
  }
  stop.store(true);
  signaler.join();
  reader.join();
  std::cout << "[purge under load] " << clean << " of " << kLeavers << " purges left no file with the ledger; "
            << writes.load() << " signals and " << reads.load() << " reads ran meanwhile; "
            << db->stats().aggregate_writes << " batches written\n";
  EXPECT_GT(db->stats().aggregate_writes, static_cast<std::uint64_t>(kLeavers));
  expect_healthy(*db, "after the purges under load");
}

}  // namespace
}  // namespace tidal
