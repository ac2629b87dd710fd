// Faults inside recovery (SQLite's Nth-I/O method, as FaultSweepTest does
// for the Db's own calls): a restore's replay_journal fails at its N-th file
// operation, for every N up to the replay's count; the operator then does
// what the error says (replay again on the same handle; when the handle
// refuses, reopen and replay), then finish_recovery. After each N nothing
// acknowledged is forgotten: every purge has its receipt (identity and exact
// weights), every status is the original's, the shared scores are the
// original's, I1 holds.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <utility>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "crash_child.h"
#include "db/impl.h"
#include "fault_fs.h"
#include "test_util.h"
#include "tidal/db.h"
#include "tidal/global_view.h"
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

// Replaces each `to` with a copy of its `from`.
void copy_fresh(std::initializer_list<std::pair<std::string, std::string>> from_to) {
  for (const auto& [from, to] : from_to) {
    fs::remove_all(to);
    fs::copy(from, to, fs::copy_options::recursive);
  }
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

// A journalled Db's backup, the journal entries after it (a purge and the
// rejoin of the same user; leaves of the others, then four purge entries
// in a row, not in user order: a single, a bulk purge of two, a single,
// users 5, 3, 4, 2, which a replay re-runs as one bulk purge), what the
// original answered at the end, and a view that applied the original's
// whole change feed (all closed), with a last signal no journal keeps (a
// restore loses it: the restored Db's re-seed takes it out of the view).
struct JournalBase {
  std::string backup, view;
  Expected expected;
  std::vector<JournalEntry> journal;
};

JournalBase make_journal_base(const TempDir& dir) {
  JournalBase base{dir.sub("backup"), dir.sub("base-view"), {}, {}};
  auto db = open_db(dir.sub("db"), journal_options());
  EXPECT_NE(db, nullptr);
  if (db == nullptr) return base;
  for (std::uint64_t u = 1; u <= kUsers; ++u) {
    EXPECT_OK(db->join_community(u, 100));
    for (std::uint64_t i = 0; i < kItems; ++i) {
      EXPECT_OK(db->signal_with_context({u, i, 0.25 * static_cast<double>(u + 2 * i + 1)}, {{kCohort}}));
    }
  }
  EXPECT_OK(db->leave_community_layer(1));
  EXPECT_OK(db->backup(base.backup));
  const std::vector<std::uint64_t> pair{3, 4};
  EXPECT_OK(db->purge_community_contributions(1));
  EXPECT_OK(db->rejoin_community_layer(1));
  EXPECT_OK(db->leave_community_layer(2));
  EXPECT_OK(db->leave_community_layer(std::span<const std::uint64_t>(pair)));
  EXPECT_OK(db->leave_community_layer(5));
  EXPECT_OK(db->purge_community_contributions(5));
  EXPECT_OK(db->purge_community_contributions(std::span<const std::uint64_t>(pair)));
  EXPECT_OK(db->purge_community_contributions(2));
  EXPECT_OK(db->flush());
  base.expected = expected_of(*db);
  for (std::uint64_t u = 1; u <= kUsers; ++u) EXPECT_EQ(base.expected.receipts[u - 1].size(), 1u) << "user " << u;
  EXPECT_OK(db->signal_with_context({kUsers + 1, 0, 8.0}, {{kCohort}}));
  EXPECT_OK(db->flush());
  Result<std::vector<JournalEntry>> read = db->read_journal(0, 1 << 20);
  EXPECT_OK(read);
  if (read.ok()) base.journal = *read;
  Result<std::unique_ptr<GlobalView>> view = GlobalView::open(base.view);
  EXPECT_OK(view);
  if (view.ok()) {
    Result<std::vector<ChangeBatch>> batches = db->read_changes(0, 64 << 20);
    EXPECT_OK(batches);
    if (batches.ok()) {
      Result<ApplyOutcome> out = (*view)->apply(std::span<const ChangeBatch>(*batches));
      EXPECT_OK(out);
      if (out.ok()) EXPECT_OK(out->refused);
    }
    EXPECT_OK((*view)->close());
  }
  EXPECT_OK(db->close());
  return base;
}

// Issue 41 item 1: a replayed purge that failed after its intent was written
// was skipped by the retry (its seq is the Db's already), the rejoin after it
// applied, and the next open deleted its mark: the acknowledged purge never
// happened.
TEST(RecoverySweep, AReplayFailingAtAnyFileOperationForgetsNoPurgeOnceRetried) {
  TempDir dir;
  const Options options = journal_options();
  const JournalBase jb = make_journal_base(dir);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const std::string& base = jb.backup;
  const Expected& expected = jb.expected;
  const std::vector<JournalEntry>& journal = jb.journal;

  const std::string work = dir.sub("work");
  FaultEnv fault = FaultEnv::make();
  int failed_replays = 0, reopened = 0, refused_finishes = 0;
  // Every 4th operation in the default tier (each costs two opens of both
  // engines, ~0.2 s), every one under --soak (testing::sweep_stride).
  const std::uint64_t stride = testing::sweep_stride(4);
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

// ---- the change feed's recovery steps: reseed_change_feed, trim_changes ----

constexpr std::uint64_t kFeedShard = 6;
constexpr std::uint64_t kFeedUsers = 24, kFeedItems = 6, kFeedCohorts = 3, kFeedCommunity = 200;

Options feed_options() {
  Options options;
  options.change_feed = true;
  options.shard_id = kFeedShard;
  return options;
}

// Every cell the feed sweeps touch, as the Db answers.
std::vector<double> feed_cells(const Db& db) {
  std::vector<double> out;
  for (std::uint64_t item = 0; item < kFeedItems; ++item) {
    for (std::uint64_t c = 0; c < kFeedCohorts; ++c) out.push_back(testing::value_of(db.cohort_score(c, item)));
    out.push_back(testing::value_of(db.community_score(kFeedCommunity, item)));
  }
  return out;
}
std::vector<double> feed_cells(const GlobalView& view) {
  std::vector<double> out;
  for (std::uint64_t item = 0; item < kFeedItems; ++item) {
    for (std::uint64_t c = 0; c < kFeedCohorts; ++c) out.push_back(testing::value_of(view.cohort_score(c, item)));
    out.push_back(testing::value_of(view.community_score(kFeedCommunity, item)));
  }
  return out;
}

// Carries every batch of `db`'s feed after the view's applied seq to it, as
// a consumer does: from the trim point when the view's cursor is of another
// incarnation (a re-seed's snapshot follows the trim point and replaces it)
// or when the batches after it were trimmed. Every batch must be taken.
Status carry_feed(Db& db, GlobalView& view) {
  const Stats st = db.stats();
  Result<std::vector<ShardProgress>> shards = view.applied_shards();
  if (!shards.ok()) return shards.status();
  std::uint64_t after = st.change_feed_trimmed_seq;
  for (const ShardProgress& p : *shards) {
    if (p.shard_id == st.change_feed_shard_id && p.incarnation == st.change_feed_incarnation) after = p.applied_seq;
  }
  for (;;) {
    Result<std::vector<ChangeBatch>> batches = db.read_changes(after, 64 << 10);
    if (!batches.ok() && batches.status().code() == StatusCode::NotFound && after < db.stats().change_feed_trimmed_seq) {
      after = db.stats().change_feed_trimmed_seq;
      continue;
    }
    if (!batches.ok()) return batches.status();
    if (batches->empty()) return Status::OK();
    Result<ApplyOutcome> out = view.apply(*batches);
    if (!out.ok()) return out.status();
    if (!out->refused.ok()) return out->refused;
    after = batches->back().seq;
  }
}

// A shard with a feed, signalled and flushed, and a view that applied all
// of it (both closed): the starting point of each run of a feed sweep.
struct FeedBase {
  std::string db, view;
  std::vector<double> cells;
};

FeedBase make_feed_base(const TempDir& dir, std::uint64_t applied_fraction_percent) {
  FeedBase base{dir.sub("base-db"), dir.sub("base-view"), {}};
  auto db = open_db(base.db, feed_options());
  EXPECT_NE(db, nullptr);
  if (db == nullptr) return base;
  for (std::uint64_t u = 1; u <= kFeedUsers; ++u) {
    EXPECT_OK(db->join_community(u, kFeedCommunity));
    for (std::uint64_t i = 0; i < kFeedItems; ++i) {
      EXPECT_OK(db->signal_with_context({u, i, 0.125 * static_cast<double>((u * 7 + i * 3) % 17) - 1.0},
                                        {{u % kFeedCohorts}}));
    }
    if (u % 6 == 0) EXPECT_OK(db->flush());  // several batches
  }
  EXPECT_OK(db->leave_community_layer(3));
  EXPECT_OK(db->purge_community_contributions(3));
  EXPECT_OK(db->flush());
  base.cells = feed_cells(*db);
  Result<std::unique_ptr<GlobalView>> view = GlobalView::open(base.view);
  EXPECT_OK(view);
  if (!view.ok()) return base;
  // The view applies the first part of the feed.
  const std::uint64_t last = db->stats().change_feed_last_seq;
  Result<std::vector<ChangeBatch>> batches = db->read_changes(0, 64 << 20);
  EXPECT_OK(batches);
  if (!batches.ok()) return base;
  std::vector<ChangeBatch> part;
  for (const ChangeBatch& b : *batches) {
    if (b.seq * 100 <= last * applied_fraction_percent) part.push_back(b);
  }
  Result<ApplyOutcome> out = (*view)->apply(part);
  EXPECT_OK(out);
  EXPECT_OK((*view)->close());
  EXPECT_OK(db->close());
  return base;
}

// Runs `op` on a copy of `base` whose file operation n fails (every n up to
// 16, then every `stride`-th n until op completes without reaching it: a
// trim has ~13 operations in all); the operator then
// retries on the same handle and, when the handle refuses, reopens and
// retries. After each n: the Db's shared scores are the base's, and a view
// that carries the feed from where it stopped equals them, bit for bit,
// before and after a reopen. Returns the runs whose op failed.
int sweep_feed_step(const TempDir& dir, const FeedBase& base, const char* name,
                    const std::function<Status(Db&)>& op) {
  const std::string work = dir.sub("work"), view_dir = dir.sub("work-view");
  FaultEnv fault = FaultEnv::make();
  const std::uint64_t stride = testing::sweep_stride(2);
  int failed = 0, reopened = 0;
  std::uint64_t n = 1, runs = 0;
  for (; n < 2000 && !::testing::Test::HasFailure(); n += n < 16 ? 1 : stride, ++runs) {
    copy_fresh({{base.db, work}, {base.view, view_dir}});
    Result<std::unique_ptr<Db>> opened = Db::Impl::open(work, feed_options(), fault.env.get());
    EXPECT_OK(opened);
    if (!opened.ok()) break;
    std::unique_ptr<Db> db = std::move(*opened);
    fault.fs->fail_nth_op(n, /*persistent=*/false);
    const Status first = op(*db);
    const std::uint64_t ops = fault.fs->ops_since_arm();
    fault.fs->clear_faults();
    const std::string ctx = std::string(name) + " failing at op " + std::to_string(n) + " (" + first.to_string() + ")";
    if (!first.ok()) {
      ++failed;
      if (!op(*db).ok()) {  // this handle refuses: reopen and retry
        (void)db->close();
        db.reset();
        ++reopened;
        Result<std::unique_ptr<Db>> again = Db::open(work, feed_options());
        EXPECT_TRUE(again.ok()) << ctx << ": reopen: " << again.status().to_string();
        if (!again.ok()) break;
        db = std::move(*again);
        const Status retried = op(*db);
        EXPECT_TRUE(retried.ok()) << ctx << ": retry after the reopen: " << retried.to_string();
      }
    }
    EXPECT_EQ(feed_cells(*db), base.cells) << ctx << ": the Db's shared scores changed";
    for (int reopen = 0; reopen < 2; ++reopen) {
      Result<std::unique_ptr<GlobalView>> view = GlobalView::open(view_dir);
      EXPECT_OK(view);
      if (!view.ok()) break;
      const Status carried = carry_feed(*db, **view);
      EXPECT_TRUE(carried.ok()) << ctx << (reopen ? ", reopened" : "") << ": carrying the feed: " << carried.to_string();
      EXPECT_EQ(feed_cells(**view), base.cells) << ctx << (reopen ? ", reopened" : "") << ": the view differs";
      EXPECT_OK((*view)->close());
      (void)db->close();
      db.reset();
      Result<std::unique_ptr<Db>> again = Db::open(work, feed_options());
      EXPECT_TRUE(again.ok()) << ctx << ": reopen after the step: " << again.status().to_string();
      if (!again.ok()) break;
      db = std::move(*again);
    }
    if (db) EXPECT_OK(db->close());
    if (first.ok() && ops < n) break;  // the step completed without reaching op n
  }
  std::printf("[ figures ] %s sweep: every one to 16, then every %llu of %llu operations (%llu runs): %d failed, %d reopened\n", name,
              static_cast<unsigned long long>(stride), static_cast<unsigned long long>(n),
              static_cast<unsigned long long>(runs + 1), failed, reopened);
  return failed;
}

// Issue 41: a re-seed that fails at any file operation, then retried (after
// a reopen when the handle refuses): the feed's snapshot brings a view that
// applied half the old incarnation to the shard's scores exactly.
TEST(RecoverySweep, AReseedFailingAtAnyFileOperationLeavesEveryViewExactOnceRetried) {
  TempDir dir;
  const FeedBase base = make_feed_base(dir, 50);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const int failed = sweep_feed_step(dir, base, "reseed_change_feed", [](Db& db) {
    return db.reseed_change_feed().status();
  });
  EXPECT_GT(failed, 0) << "no injected fault reached the re-seed";
}

// Issue 41: trim_changes failing at any file operation, then retried: the
// batches after the trim point are kept whole, and a view that applied
// through it carries the rest to the shard's scores exactly.
TEST(RecoverySweep, ATrimFailingAtAnyFileOperationKeepsEveryBatchAfterItOnceRetried) {
  TempDir dir;
  const FeedBase base = make_feed_base(dir, 50);
  ASSERT_FALSE(::testing::Test::HasFailure());
  std::uint64_t through = 0;
  {
    auto db = open_db(base.db, feed_options());
    ASSERT_NE(db, nullptr);
    through = db->stats().change_feed_last_seq / 2;
    ASSERT_GT(through, 0u);
    ASSERT_OK(db->close());
  }
  const int failed = sweep_feed_step(dir, base, "trim_changes", [through](Db& db) {
    return db.trim_changes(through);
  });
  EXPECT_GT(failed, 0) << "no injected fault reached the trim";
}

// The view at `view_dir`, carried from the restored `db`'s feed, holds the
// original's cohort scores and the restored Db's community scores.
void expect_view_carried(Db& db, const std::string& view_dir, const Expected& e, const std::string& at) {
  Result<std::unique_ptr<GlobalView>> view = GlobalView::open(view_dir);
  ASSERT_OK(view);
  const Status carried = carry_feed(db, **view);
  EXPECT_TRUE(carried.ok()) << at << ": carrying the feed: " << carried.to_string();
  for (std::uint64_t i = 0; i < kItems; ++i) {
    EXPECT_EQ(testing::value_of((*view)->cohort_score(kCohort, i)), e.cohort_scores[i])
        << at << ": the view's cohort score of item " << i;
    EXPECT_EQ(testing::value_of((*view)->community_score(100, i)), testing::value_of(db.community_score(100, i)))
        << at << ": the view's community score of item " << i;
  }
  EXPECT_OK((*view)->close());
}

// Issue 41: finish_recovery failing at any file operation after a whole
// replay (its re-seed of the change feed is what writes). Until it returns
// OK the Db serves nothing; the operator calls it again and, when the handle
// refuses, reopens (still recovering: the backup's manifest is removed
// last), replays and finishes. After each N nothing acknowledged is
// forgotten, and a view that applied the original's whole feed, carried
// from the restored Db's re-seed, equals the restored Db's shared scores.
TEST(RecoverySweep, AFinishRecoveryFailingAtAnyFileOperationServesOnlyOnceWholeAndRetried) {
  TempDir dir;
  const Options options = journal_options();
  const JournalBase jb = make_journal_base(dir);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const std::string work = dir.sub("work"), view_dir = dir.sub("work-view");
  FaultEnv fault = FaultEnv::make();
  const std::uint64_t stride = testing::sweep_stride(2);
  int failed = 0, reopened = 0;
  std::uint64_t n = 1, runs = 0;
  for (; n < 2000 && !::testing::Test::HasFailure(); n += stride, ++runs) {
    copy_fresh({{jb.backup, work}, {jb.view, view_dir}});
    Result<std::unique_ptr<Db>> opened = Db::Impl::open(work, options, fault.env.get());
    ASSERT_OK(opened);
    std::unique_ptr<Db> db = std::move(*opened);
    ASSERT_OK(db->replay_journal(jb.journal));
    fault.fs->fail_nth_op(n, /*persistent=*/false);
    const Status first = db->finish_recovery();
    const std::uint64_t ops = fault.fs->ops_since_arm();
    fault.fs->clear_faults();
    const std::string ctx = "finish_recovery failing at op " + std::to_string(n) + " (" + first.to_string() + ")";
    if (!first.ok()) {
      ++failed;
      EXPECT_TRUE(db->stats().recovering) << ctx << ": the Db serves after a failed finish_recovery";
      const Status signal = db->signal_with_context({1, 0, 1.0}, {{kCohort}}).status();
      EXPECT_EQ(signal.code(), StatusCode::Busy) << ctx << ": a signal: " << signal.to_string();
      if (!db->finish_recovery().ok()) {  // this handle refuses: reopen, replay, finish
        (void)db->close();
        db.reset();
        ++reopened;
        Result<std::unique_ptr<Db>> again = Db::open(work, options);
        ASSERT_TRUE(again.ok()) << ctx << ": reopen: " << again.status().to_string();
        db = std::move(*again);
        EXPECT_TRUE(db->stats().recovering) << ctx << ": reopened";
        Status s = db->replay_journal(jb.journal);
        if (s.ok()) s = db->finish_recovery();
        ASSERT_TRUE(s.ok()) << ctx << ": replay and finish after the reopen: " << s.to_string();
      }
    }
    EXPECT_FALSE(db->stats().recovering) << ctx;
    expect_matches(*db, jb.expected, ctx);
    for (int reopen = 0; reopen < 2 && !::testing::Test::HasFailure(); ++reopen) {
      const std::string at = ctx + (reopen ? ", reopened" : "");
      expect_view_carried(*db, view_dir, jb.expected, at);
      (void)db->close();
      db.reset();
      Result<std::unique_ptr<Db>> again = Db::open(work, options);
      ASSERT_TRUE(again.ok()) << at << ": reopen after the recovery: " << again.status().to_string();
      db = std::move(*again);
      EXPECT_FALSE(db->stats().recovering) << at;
      expect_matches(*db, jb.expected, at + ", reopened");
    }
    if (db) EXPECT_OK(db->close());
    if (first.ok() && ops < n) break;  // finish_recovery completed without reaching op n
  }
  std::printf("[ figures ] finish_recovery sweep: every %llu of %llu operations (%llu runs): %d failed, %d "
              "reopened\n",
              static_cast<unsigned long long>(stride), static_cast<unsigned long long>(n),
              static_cast<unsigned long long>(runs + 1), failed, reopened);
  EXPECT_GT(failed, 0) << "no injected fault reached finish_recovery";
}

// ---- SIGKILL at each step of a re-seed and of finish_recovery ----

// Runs tidal_crash_child `mode` on `db` until it kills itself at `task`'s `step`.
void kill_child_at(const std::string& mode, const std::string& db, std::uint64_t shard, const std::string& task,
                   int step) {
  Child child({mode, db, std::to_string(shard), task, std::to_string(step)});
  const int status = wait_for_kill(child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
      << mode << " killed at " << task << " step " << step << ": wait status " << status;
}

// Issue 41: a re-seed SIGKILLed before its one ingestion (step 1) and after
// it (step 2): the reopened Db holds the old feed whole or the new one, its
// scores unchanged; a view that applied half the old incarnation carries
// the feed to them exactly, before and after the operator's retry.
TEST(RecoverySweep, AReseedKilledAtAnyStepLeavesEveryViewExactOnceRetried) {
  TempDir dir;
  const FeedBase base = make_feed_base(dir, 50);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const std::string work = dir.sub("work"), view_dir = dir.sub("work-view");
  for (int step = 1; step <= 2; ++step) {
    SCOPED_TRACE("re-seed killed at step " + std::to_string(step));
    copy_fresh({{base.db, work}, {base.view, view_dir}});
    std::string incarnation;
    {
      auto db = open_db(work, feed_options());
      ASSERT_NE(db, nullptr);
      incarnation = db->stats().change_feed_incarnation;
      ASSERT_OK(db->close());
    }
    kill_child_at("reseed", work, kFeedShard, "reseed", step);
    for (int retried = 0; retried < 2; ++retried) {
      auto db = open_db(work, feed_options());
      ASSERT_NE(db, nullptr);
      if (retried == 0) {
        EXPECT_EQ(db->stats().change_feed_incarnation == incarnation, step == 1) << "the re-seed's ingestion is whole";
      }
      EXPECT_EQ(feed_cells(*db), base.cells) << "the Db's shared scores changed";
      Result<std::unique_ptr<GlobalView>> view = GlobalView::open(view_dir);
      ASSERT_OK(view);
      const Status carried = carry_feed(*db, **view);
      EXPECT_TRUE(carried.ok()) << "carrying the feed: " << carried.to_string();
      EXPECT_EQ(feed_cells(**view), base.cells) << (retried ? "after the retry" : "after the kill") << ": the view differs";
      EXPECT_OK((*view)->close());
      if (retried == 0) EXPECT_OK(db->reseed_change_feed());  // the operator's retry
      EXPECT_OK(db->close());
    }
  }
}

// Issue 41: finish_recovery SIGKILLed inside its re-seed (before and after
// the ingestion) and after it removed the backup's manifest. Until the
// manifest is gone the reopened Db is recovering and serves nothing; the
// operator replays and finishes. Then nothing acknowledged is forgotten,
// and a view that applied the original's feed, carried, equals the Db.
TEST(RecoverySweep, AFinishRecoveryKilledAtAnyStepServesOnlyOnceWholeAndRetried) {
  TempDir dir;
  const Options options = journal_options();
  const JournalBase jb = make_journal_base(dir);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const std::string work = dir.sub("work"), view_dir = dir.sub("work-view");
  const std::vector<std::pair<std::string, int>> steps{{"reseed", 1}, {"reseed", 2}, {"finish recovery", 1}};
  for (const auto& [task, step] : steps) {
    const std::string at = "finish_recovery killed at " + task + " step " + std::to_string(step);
    SCOPED_TRACE(at);
    copy_fresh({{jb.backup, work}, {jb.view, view_dir}});
    {
      auto db = open_db(work, options);
      ASSERT_NE(db, nullptr);
      ASSERT_OK(db->replay_journal(jb.journal));
      ASSERT_OK(db->close());
    }
    kill_child_at("finish", work, options.shard_id, task, step);
    auto db = open_db(work, options);
    ASSERT_NE(db, nullptr);
    const bool manifest_left = task == "reseed";
    EXPECT_EQ(db->stats().recovering, manifest_left);
    if (db->stats().recovering) {
      const Status signal = db->signal_with_context({1, 0, 1.0}, {{kCohort}}).status();
      EXPECT_EQ(signal.code(), StatusCode::Busy) << "a signal: " << signal.to_string();
      ASSERT_OK(db->replay_journal(jb.journal));
      ASSERT_OK(db->finish_recovery());
    }
    expect_matches(*db, jb.expected, at);
    expect_view_carried(*db, view_dir, jb.expected, at);
    ASSERT_OK(db->close());
    db = open_db(work, options);
    ASSERT_NE(db, nullptr);
    EXPECT_FALSE(db->stats().recovering);
    expect_matches(*db, jb.expected, at + ", reopened");
    ASSERT_OK(db->close());
  }
}

}  // namespace
}  // namespace tidal::reliability
