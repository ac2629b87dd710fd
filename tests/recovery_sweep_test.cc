// Faults inside recovery (SQLite's Nth-I/O method, as FaultSweepTest does
// for the Db's own calls): a restore's replay_journal fails at its N-th file
// operation, for every N up to the replay's count; the operator then does
// what the error says (replay again on the same handle; when the handle
// refuses, reopen and replay), then finish_recovery. After each N nothing
// acknowledged is forgotten: every purge has its receipt (identity and exact
// weights), every status is the original's, the shared scores are the
// original's, I1 holds.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "db/impl.h"
#include "fault_fs.h"
#include "test_util.h"
#include "tidal/db.h"
#include "tidal/journal_entry.h"

namespace tidal::reliability {
namespace {

namespace fs = std::filesystem;
using testing::open_db;
using testing::TempDir;

constexpr std::uint64_t kCohort = 7;
constexpr std::uint64_t kItems = 3;

Options journal_options() {
  Options options;
  options.journal = true;
  options.change_feed = true;
  options.shard_id = 5;
  return options;
}

// What the original Db answers, to compare a restored one with.
struct Expected {
  std::vector<std::vector<PurgeReceipt>> receipts;  // per user 1..kUsers
  std::vector<CommunityMembership> statuses;
  std::vector<double> cohort_scores;  // per item
};

constexpr std::uint64_t kUsers = 5;

Expected expected_of(Db& db) {
  Expected e;
  for (std::uint64_t u = 1; u <= kUsers; ++u) {
    e.receipts.push_back(*db.purge_receipts(u));
    e.statuses.push_back(*db.community_layer_status(u));
  }
  for (std::uint64_t i = 0; i < kItems; ++i) e.cohort_scores.push_back(testing::value_of(db.cohort_score(kCohort, i)));
  return e;
}

void expect_matches(Db& db, const Expected& e, const std::string& ctx) {
  for (std::uint64_t u = 1; u <= kUsers; ++u) {
    Result<std::vector<PurgeReceipt>> got = db.purge_receipts(u);
    ASSERT_OK(got);
    const std::vector<PurgeReceipt>& want = e.receipts[u - 1];
    ASSERT_EQ(got->size(), want.size()) << ctx << ": receipts of user " << u << " (an acknowledged purge forgotten?)";
    for (std::size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ((*got)[i].purged_at_ns, want[i].purged_at_ns) << ctx << ": user " << u;
      EXPECT_EQ((*got)[i].left_at_ns, want[i].left_at_ns) << ctx << ": user " << u;
      EXPECT_EQ((*got)[i].entries_removed, want[i].entries_removed) << ctx << ": user " << u;
      EXPECT_EQ((*got)[i].cohort_weight_removed, want[i].cohort_weight_removed) << ctx << ": user " << u;
      EXPECT_EQ((*got)[i].community_weight_removed, want[i].community_weight_removed) << ctx << ": user " << u;
    }
    Result<CommunityMembership> status = db.community_layer_status(u);
    ASSERT_OK(status);
    EXPECT_EQ(status->status, e.statuses[u - 1].status) << ctx << ": status of user " << u;
    EXPECT_EQ(status->left_at_ns, e.statuses[u - 1].left_at_ns) << ctx << ": left_at of user " << u;
  }
  for (std::uint64_t i = 0; i < kItems; ++i) {
    EXPECT_EQ(testing::value_of(db.cohort_score(kCohort, i)), e.cohort_scores[i]) << ctx << ": cohort score of item " << i;
  }
  Result<VerifyReport> report = db.verify();
  ASSERT_OK(report);
  EXPECT_TRUE(report->ok()) << ctx << ": verify found problems";
}

// Issue 41 item 1: a replayed purge that failed after its intent was written
// was skipped by the retry (its seq is the Db's already), the rejoin after it
// applied, and the next open deleted its mark: the acknowledged purge never
// happened.
TEST(RecoverySweep, AReplayFailingAtAnyFileOperationForgetsNoPurgeOnceRetried) {
  TempDir dir;
  const Options options = journal_options();
  const std::string base = dir.sub("backup");
  Expected expected;
  std::vector<JournalEntry> journal;
  {
    auto db = open_db(dir.sub("db"), options);
    ASSERT_NE(db, nullptr);
    for (std::uint64_t u = 1; u <= kUsers; ++u) {
      ASSERT_OK(db->join_community(u, 100));
      for (std::uint64_t i = 0; i < kItems; ++i) {
        ASSERT_OK(db->signal_with_context({u, i, 0.25 * static_cast<double>(u + 2 * i + 1)}, {{kCohort}}));
      }
    }
    ASSERT_OK(db->leave_community_layer(1));
    ASSERT_OK(db->backup(base));
    // After the backup, in the journal only: a purge followed by the
    // rejoin of the same user; leaves of the others, then four purge
    // entries in a row (a single, a bulk purge of two, a single), which
    // the replay re-runs as one bulk purge.
    const std::vector<std::uint64_t> pair{3, 4};
    ASSERT_OK(db->purge_community_contributions(1));
    ASSERT_OK(db->rejoin_community_layer(1));
    ASSERT_OK(db->leave_community_layer(2));
    ASSERT_OK(db->leave_community_layer(std::span<const std::uint64_t>(pair)));
    ASSERT_OK(db->leave_community_layer(5));
    ASSERT_OK(db->purge_community_contributions(2));
    ASSERT_OK(db->purge_community_contributions(std::span<const std::uint64_t>(pair)));
    ASSERT_OK(db->purge_community_contributions(5));
    ASSERT_OK(db->flush());
    expected = expected_of(*db);
    for (std::uint64_t u = 1; u <= kUsers; ++u) ASSERT_EQ(expected.receipts[u - 1].size(), 1u) << "user " << u;
    Result<std::vector<JournalEntry>> read = db->read_journal(0, 1 << 20);
    ASSERT_OK(read);
    journal = *read;
    ASSERT_OK(db->close());
  }

  const std::string work = dir.sub("work");
  FaultEnv fault = FaultEnv::make();
  int failed_replays = 0, reopened = 0, refused_finishes = 0;
  // Every 4th operation in the default tier (each costs two opens of both
  // engines, ~0.2 s), every one under --soak; TIDAL_RECOVERY_SWEEP_STRIDE
  // sets it.
  const auto stride = static_cast<std::uint64_t>(testing::soak_rounds("TIDAL_RECOVERY_SWEEP_STRIDE", 4, 1));
  std::uint64_t n = 1, runs = 0;
  for (; n < 2000 && !::testing::Test::HasFailure(); n += stride, ++runs) {
    fs::remove_all(work);
    fs::copy(base, work, fs::copy_options::recursive);
    Result<std::unique_ptr<Db>> opened = Db::Impl::open(work, options, fault.env.get());
    ASSERT_OK(opened);
    std::unique_ptr<Db> db = std::move(*opened);
    fault.fs->fail_nth_op(n, /*persistent=*/false);
    const Status first = db->replay_journal(journal);
    const std::uint64_t ops = fault.fs->ops_since_arm();
    fault.fs->clear_faults();
    const std::string ctx = "replay failing at op " + std::to_string(n) + " (" + first.to_string() + ")";
    const auto recover = [&]() -> Status {
      Status s = db->replay_journal(journal);
      return s.ok() ? db->finish_recovery() : s;
    };
    Status done = first.ok() ? db->finish_recovery() : first;
    if (!first.ok()) {
      ++failed_replays;
      // A purge that failed after its intent: finish_recovery is refused
      // until a replay finishes it.
      if (first.message().find("call replay_journal again (it finishes this purge first)") != std::string::npos) {
        const Status early = db->finish_recovery();
        EXPECT_EQ(early.code(), StatusCode::Busy) << ctx << ": " << early.to_string();
        ++refused_finishes;
      }
      done = recover();  // what the error says: replay again on the same handle
    }
    if (!done.ok()) {
      // This handle refuses (RocksDB stops writing after a failed write or
      // flush): reopen, replay, finish.
      (void)db->close();
      db.reset();
      ++reopened;
      Result<std::unique_ptr<Db>> again = Db::open(work, options);
      ASSERT_TRUE(again.ok()) << ctx << ": reopen: " << again.status().to_string();
      db = std::move(*again);
      const Status recovered = recover();
      ASSERT_TRUE(recovered.ok()) << ctx << ": replay and finish after the reopen: " << recovered.to_string();
    }
    expect_matches(*db, expected, ctx);
    // And after a reopen on the normal Env (the close may report the fault
    // RocksDB met in the background: the reopen decides what is durable).
    (void)db->close();
    db.reset();
    Result<std::unique_ptr<Db>> reopened_db = Db::open(work, options);
    ASSERT_TRUE(reopened_db.ok()) << ctx << ": reopen after the recovery: " << reopened_db.status().to_string();
    EXPECT_FALSE((*reopened_db)->stats().recovering) << ctx;
    expect_matches(**reopened_db, expected, ctx + ", reopened");
    ASSERT_OK((*reopened_db)->close());
    if (first.ok() && ops < n) break;  // the replay completed without reaching op n
  }
  std::printf("[ figures ] replay sweep: every %llu of %llu operations (%llu runs): %d failed replays, %d refused "
              "finish_recovery, %d reopened\n",
              static_cast<unsigned long long>(stride), static_cast<unsigned long long>(n),
              static_cast<unsigned long long>(runs + 1), failed_replays, refused_finishes, reopened);
  EXPECT_GT(failed_replays, 0) << "no injected fault reached the replay";
}

}  // namespace
}  // namespace tidal::reliability
