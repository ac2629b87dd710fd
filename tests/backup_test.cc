// Backups (Db::backup) and the recovering state of a Db opened from one
// (docs/CONTRACT.md, "Backup and restore").
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "db/impl.h"
#include "storage/journal_format.h"
#include "test_util.h"
#include "tidal/db.h"
#include "tidal/journal_entry.h"

namespace tidal {
namespace {

using testing::open_db;
using testing::TempDir;
using testing::value_of;

Options feed_options(std::uint64_t shard) {
  Options options;
  options.change_feed = true;
  options.shard_id = shard;
  options.aggregate_write_period = std::chrono::milliseconds(5);
  return options;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Users 1..3 in community 100, each with 2.0 on item 1 of cohort 7; user 1
// has left, for a purge during a backup.
void three_members_one_left(Db* db) {
  for (std::uint64_t u = 1; u <= 3; ++u) {
    ASSERT_OK(db->join_community(u, 100));
    ASSERT_OK(db->signal_with_context({u, 1, 2.0}, {{7}}));
  }
  ASSERT_OK(db->leave_community_layer(1));
}

void expect_has(const Status& s, const std::string& text) {
  EXPECT_NE(s.message().find(text), std::string::npos) << "'" << text << "' in: " << s.to_string();
}

TEST(Backup, ACopyOfBothEnginesOpensRecoveringAndServesNothingUntilFinished) {
  TempDir dir;
  auto db = open_db(dir.sub("db"), feed_options(3));
  ASSERT_NE(db, nullptr);
  for (std::uint64_t u = 1; u <= 8; ++u) {
    ASSERT_OK(db->join_community(u, 100));
    for (std::uint64_t i = 0; i < 5; ++i) ASSERT_OK(db->signal_with_context({u, i, 1.25 * static_cast<double>(u)}, {{7}}));
  }
  ASSERT_OK(db->leave_community_layer(1));
  ASSERT_OK(db->purge_community_contributions(1));
  // Accepted before the call, not yet written by the writer: in the copy too.
  ASSERT_OK(db->signal_with_context({2, 9, 4.0}, {{7}}));
  const double cohort = value_of(db->cohort_score(7, 9));
  const double community = value_of(db->community_score(100, 2));
  const Stats at_backup = db->stats();

  ASSERT_OK(db->backup(dir.sub("b1")));
  const std::string manifest = read_file(dir.sub("b1") + "/TIDAL_BACKUP");
  EXPECT_EQ(manifest.rfind("tidal backup\n", 0), 0u) << manifest;
  EXPECT_NE(manifest.find("files linked\n"), std::string::npos) << manifest;
  EXPECT_NE(manifest.find("feed_incarnation " + at_backup.change_feed_incarnation + "\n"), std::string::npos)
      << manifest;
  EXPECT_NE(manifest.find("feed_last_seq " + std::to_string(db->stats().change_feed_last_seq) + "\n"),
            std::string::npos)
      << manifest;
  // Hard links: the copy's table files are the Db's.
  bool linked = false;
  for (const auto& e : std::filesystem::directory_iterator(dir.sub("b1") + "/state")) {
    struct stat st {};
    if (e.path().extension() == ".sst" && ::stat(e.path().c_str(), &st) == 0) linked = linked || st.st_nlink > 1;
  }
  EXPECT_TRUE(linked);

  // Refusals name what was wrong; nothing is left behind.
  Status exists = db->backup(dir.sub("b1"));
  EXPECT_EQ(exists.code(), StatusCode::InvalidArgument);
  expect_has(exists, "already exists");
  Status orphan = db->backup(dir.sub("nowhere") + "/b");
  EXPECT_EQ(orphan.code(), StatusCode::InvalidArgument);
  expect_has(orphan, "does not exist");
  EXPECT_FALSE(std::filesystem::exists(dir.sub("nowhere")));

  // After the backup: a leave the copy does not hold.
  ASSERT_OK(db->leave_community_layer(2));
  ASSERT_OK(db->close());
  db.reset();

  auto restored = open_db(dir.sub("b1"), feed_options(3));
  ASSERT_NE(restored, nullptr);
  EXPECT_TRUE(restored->stats().recovering);
  // What it holds is the Db at the call, bit for bit.
  EXPECT_EQ(value_of(restored->cohort_score(7, 9)), cohort);
  EXPECT_EQ(value_of(restored->community_score(100, 2)), community);
  // Nothing that reads or changes a user's status, and no signal, until finished.
  const Result<SignalOutcome> signal = restored->signal_with_context({2, 1, 1.0}, {{7}});
  EXPECT_EQ(signal.status().code(), StatusCode::Busy);
  expect_has(signal.status(), "recovering from a backup");
  expect_has(signal.status(), "finish_recovery");
  EXPECT_EQ(restored->leave_community_layer(3).code(), StatusCode::Busy);
  EXPECT_EQ(restored->rejoin_community_layer(1).code(), StatusCode::Busy);
  EXPECT_EQ(restored->community_layer_status(2).status().code(), StatusCode::Busy);
  EXPECT_EQ(restored->community_layer_history(2).status().code(), StatusCode::Busy);
  EXPECT_EQ(restored->join_community(3, 101).code(), StatusCode::Busy);
  EXPECT_EQ(restored->purge_community_contributions(1).status().code(), StatusCode::Busy);
  const std::vector<std::uint64_t> both{3, 4};
  EXPECT_EQ(restored->leave_community_layer(both).code(), StatusCode::Busy);
  EXPECT_EQ(restored->backup(dir.sub("b2")).code(), StatusCode::Busy);
  // A reopen is still recovering.
  ASSERT_OK(restored->close());
  restored = open_db(dir.sub("b1"), feed_options(3));
  ASSERT_NE(restored, nullptr);
  EXPECT_TRUE(restored->stats().recovering);

  // Finished: a new incarnation (the views' re-seed), and it serves again.
  ASSERT_OK(restored->finish_recovery());
  EXPECT_FALSE(restored->stats().recovering);
  EXPECT_NE(restored->stats().change_feed_incarnation, at_backup.change_feed_incarnation);
  EXPECT_FALSE(std::filesystem::exists(dir.sub("b1") + "/TIDAL_BACKUP"));
  ASSERT_OK(restored->finish_recovery());  // idempotent
  Result<CommunityMembership> one = restored->community_layer_status(1);
  ASSERT_OK(one);
  EXPECT_EQ(one->status, MembershipStatus::Left);
  ASSERT_OK(restored->signal_with_context({3, 1, 1.0}, {{7}}));
  ASSERT_OK(restored->close());
  restored = open_db(dir.sub("b1"), feed_options(3));
  ASSERT_NE(restored, nullptr);
  EXPECT_FALSE(restored->stats().recovering);
}

// A backup taken while 16 threads signal, leave, rejoin and purge is one
// consistent state of both engines: the invariant holds in the copy
// (aggregates equal their ledger) and every purge receipt in it cites a
// leave that is in it (the state engine is copied first, the users engine
// after).
TEST(Backup, ABackupUnderLoadIsConsistentAcrossTheEngines) {
  TempDir dir;
  Options options = feed_options(1);
  options.aggregate_write_period = std::chrono::milliseconds(2);
  auto db = open_db(dir.sub("db"), options);
  ASSERT_NE(db, nullptr);
  constexpr std::uint64_t kThreads = 16, kUsersEach = 8;
  for (std::uint64_t u = 0; u < kThreads * kUsersEach; ++u) ASSERT_OK(db->join_community(u, 100 + u % 3));
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (std::uint64_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(t);
      while (!stop.load()) {
        const std::uint64_t u = t * kUsersEach + rng() % kUsersEach;
        const unsigned pick = static_cast<unsigned>(rng() % 100);
        if (pick < 90) {
          (void)db->signal_with_context({u, rng() % 10, 0.5 + static_cast<double>(rng() % 7)}, {{rng() % 4}});
        } else if (pick < 95) {
          (void)db->leave_community_layer(u);
          (void)db->purge_community_contributions(u);
        } else {
          (void)db->rejoin_community_layer(u);
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  for (int b = 0; b < 3; ++b) {
    ASSERT_OK(db->backup(dir.sub("b" + std::to_string(b))));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  stop.store(true);
  for (std::thread& t : threads) t.join();
  ASSERT_OK(db->close());

  std::size_t receipts = 0;
  for (int b = 0; b < 3; ++b) {
    auto copy = open_db(dir.sub("b" + std::to_string(b)), options);
    ASSERT_NE(copy, nullptr);
    Result<VerifyReport> report = copy->verify();
    ASSERT_OK(report);
    EXPECT_TRUE(report->ok()) << report->problems.front();
    ASSERT_OK(copy->finish_recovery());
    for (std::uint64_t u = 0; u < kThreads * kUsersEach; ++u) {
      Result<std::vector<PurgeReceipt>> rs = copy->purge_receipts(u);
      ASSERT_OK(rs);
      Result<std::vector<MembershipEvent>> history = copy->community_layer_history(u);
      ASSERT_OK(history);
      for (const PurgeReceipt& r : *rs) {
        ++receipts;
        bool cited = false;
        for (const MembershipEvent& e : *history) cited = cited || (e.status == MembershipStatus::Left && e.at_ns == r.left_at_ns);
        EXPECT_TRUE(cited) << "backup " << b << ": user " << u << "'s receipt cites a leave at " << r.left_at_ns
                           << " the users engine's copy does not hold";
      }
    }
  }
  EXPECT_GT(receipts, 0u) << "no purge ran during the backups";
}

// The journal's entries after a backup, replayed into the restored copy:
// every leave (its exact boundary), rejoin and purge (its receipt's
// identity) made after the backup is there again, the journal continues
// without a gap, and a second replay changes nothing.
TEST(Backup, ARestoreReplaysTheJournalAndForgetsNoLeaveRejoinOrPurge) {
  TempDir dir;
  Options options = feed_options(3);
  options.journal = true;
  auto db = open_db(dir.sub("db"), options);
  ASSERT_NE(db, nullptr);
  for (std::uint64_t u = 1; u <= 6; ++u) {
    ASSERT_OK(db->join_community(u, 100 + u % 2));
    for (std::uint64_t i = 0; i < 4; ++i) ASSERT_OK(db->signal_with_context({u, i, 0.5 * static_cast<double>(u + i)}, {{7}}));
  }
  ASSERT_OK(db->leave_community_layer(4));
  ASSERT_OK(db->backup(dir.sub("b")));
  const std::uint64_t at_backup = *db->last_journal_seq();
  // After the backup: leaves, a purge, a rejoin (no signal: the copy lacks
  // signals, which the journal does not carry).
  ASSERT_OK(db->leave_community_layer(2));
  ASSERT_OK(db->leave_community_layer(3));
  ASSERT_OK(db->purge_community_contributions(3));
  ASSERT_OK(db->rejoin_community_layer(4));
  ASSERT_OK(db->leave_community_layer(5));
  const std::uint64_t last = *db->last_journal_seq();
  ASSERT_GT(last, at_backup);
  Result<std::vector<JournalEntry>> journal = db->read_journal(0, 1 << 20);
  ASSERT_OK(journal);
  ASSERT_OK(db->flush());
  ASSERT_OK(db->close());
  auto original = open_db(dir.sub("db"), options);
  ASSERT_NE(original, nullptr);

  auto restored = open_db(dir.sub("b"), options);
  ASSERT_NE(restored, nullptr);
  EXPECT_TRUE(restored->stats().recovering);
  EXPECT_EQ(*restored->last_journal_seq(), at_backup);
  // A gap is refused, naming both seqs.
  const std::vector<JournalEntry> tail(journal->begin() + static_cast<std::ptrdiff_t>(at_backup + 1), journal->end());
  Status gap = restored->replay_journal(tail);
  EXPECT_EQ(gap.code(), StatusCode::Corruption);
  expect_has(gap, "ends at seq " + std::to_string(at_backup));
  // The whole journal: what the copy holds is skipped, the rest applied.
  ASSERT_OK(restored->replay_journal(*journal));
  EXPECT_EQ(*restored->last_journal_seq(), last);
  ASSERT_OK(restored->replay_journal(*journal));  // again: nothing changes
  EXPECT_EQ(*restored->last_journal_seq(), last);
  ASSERT_OK(restored->finish_recovery());
  Status late = restored->replay_journal(*journal);
  EXPECT_EQ(late.code(), StatusCode::InvalidArgument);
  expect_has(late, "not recovering");

  for (std::uint64_t u = 1; u <= 6; ++u) {
    Result<CommunityMembership> want = original->community_layer_status(u);
    Result<CommunityMembership> got = restored->community_layer_status(u);
    ASSERT_OK(want);
    ASSERT_OK(got);
    EXPECT_EQ(got->status, want->status) << "user " << u;
    EXPECT_EQ(got->left_at_ns, want->left_at_ns) << "user " << u;
    Result<std::vector<MembershipEvent>> h1 = original->community_layer_history(u);
    Result<std::vector<MembershipEvent>> h2 = restored->community_layer_history(u);
    ASSERT_OK(h1);
    ASSERT_OK(h2);
    ASSERT_EQ(h2->size(), h1->size()) << "user " << u;
    for (std::size_t k = 0; k < h1->size(); ++k) EXPECT_EQ((*h2)[k].at_ns, (*h1)[k].at_ns) << "user " << u;
    Result<std::vector<PurgeReceipt>> r1 = original->purge_receipts(u);
    Result<std::vector<PurgeReceipt>> r2 = restored->purge_receipts(u);
    ASSERT_OK(r1);
    ASSERT_OK(r2);
    ASSERT_EQ(r2->size(), r1->size()) << "user " << u;
    for (std::size_t k = 0; k < r1->size(); ++k) {
      EXPECT_EQ((*r2)[k].purged_at_ns, (*r1)[k].purged_at_ns);
      EXPECT_EQ((*r2)[k].left_at_ns, (*r1)[k].left_at_ns);
      EXPECT_EQ((*r2)[k].entries_removed, (*r1)[k].entries_removed);
      EXPECT_EQ((*r2)[k].cohort_weight_removed, (*r1)[k].cohort_weight_removed);
    }
  }
  for (std::uint64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(value_of(restored->cohort_score(7, i)), value_of(original->cohort_score(7, i))) << "item " << i;
    EXPECT_EQ(value_of(restored->community_score(101, i)), value_of(original->community_score(101, i)));
  }
  Result<VerifyReport> report = restored->verify();
  ASSERT_OK(report);
  EXPECT_TRUE(report->ok());
  // The gate holds for the replayed leaves: a signal of user 2 reaches no shared aggregate.
  Result<SignalOutcome> gated = restored->signal_with_context({2, 0, 5.0}, {{7}});
  ASSERT_OK(gated);
  EXPECT_EQ(value_of(restored->cohort_score(7, 0)), value_of(original->cohort_score(7, 0)));
}

// B1: a journaled purge that starts while a backup copies its two engines
// waits for the copy. Before, it could run whole between the state copy and
// the users copy: the copy then held its intent (so the replay skipped it)
// and not its marks (so the open did not finish it), and the state copy
// lacked it: the restored Db still counted the purged user's contributions.
TEST(Backup, APurgeDuringABackupIsReplayedAfterTheRestore) {
  TempDir dir;
  Options options = feed_options(4);
  options.journal = true;
  auto db = open_db(dir.sub("db"), options);
  ASSERT_NE(db, nullptr);
  ASSERT_NO_FATAL_FAILURE(three_members_one_left(db.get()));
  std::thread purger;
  std::atomic<bool> purged{false};
  Db::Impl::between_backup_copies_for_testing = [&] {
    purger = std::thread([&] {
      EXPECT_OK(db->purge_community_contributions(1));
      purged = true;
    });
    // Long enough for a purge that does not wait for the backup (a few ms).
    for (int i = 0; i < 1000 && !purged; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  Status backed_up = db->backup(dir.sub("b"));
  Db::Impl::between_backup_copies_for_testing = nullptr;
  purger.join();
  ASSERT_OK(backed_up);
  ASSERT_EQ(db->purge_receipts(1)->size(), 1u);
  EXPECT_EQ(*db->cohort_score(7, 1), 4.0);
  Result<std::vector<JournalEntry>> journal = db->read_journal(0, 1 << 20);
  ASSERT_OK(journal);
  ASSERT_OK(db->close());

  auto restored = open_db(dir.sub("b"), options);
  ASSERT_NE(restored, nullptr);
  ASSERT_OK(restored->replay_journal(*journal));
  ASSERT_OK(restored->finish_recovery());
  ASSERT_EQ(restored->purge_receipts(1)->size(), 1u) << "the purge during the backup is lost";
  EXPECT_EQ(*restored->cohort_score(7, 1), 4.0);
  Result<RematerializeReport> rm = restored->rematerialize_shared_aggregates(false);
  ASSERT_OK(rm);
  EXPECT_TRUE(rm->mismatches.empty());
}

// Without the journal too, a purge that starts while a backup copies the
// users engine waits for the copy before it drains the state store, so
// signals flow meanwhile. Before, it waited inside its drain for the key
// store lock the backup holds through that copy, and every signal waited
// with it.
TEST(Backup, APurgeWaitingForABackupDoesNotHoldUpSignals) {
  TempDir dir;
  Options options = feed_options(4);
  options.write_buffer_bytes = 8 << 10;  // 32 cells a buffer: signals wait for the writer within a few
  auto db = open_db(dir.sub("db"), options);
  ASSERT_NE(db, nullptr);
  ASSERT_NO_FATAL_FAILURE(three_members_one_left(db.get()));
  constexpr std::uint64_t kItems = 200;  // 400 cells: past both buffers unless the writer drains
  std::thread purger, signaller;
  std::atomic<bool> purged{false}, signalled{false};
  Db::Impl::between_backup_copies_for_testing = [&] {
    purger = std::thread([&] {
      EXPECT_OK(db->purge_community_contributions(1));
      purged = true;
    });
    // Long enough for the purge to reach its wait (it takes a few ms).
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    signaller = std::thread([&] {
      for (std::uint64_t item = 0; item < kItems; ++item) EXPECT_OK(db->signal_with_context({2, item, 1.0}, {{7}}));
      signalled = true;
    });
    // The backup holds its copy until the signal is done, or 20 s: a
    // signal held up by the purge never is.
    for (int i = 0; i < 2000 && !signalled; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_TRUE(signalled.load()) << "signals waited for a purge that waits for the backup";
    EXPECT_FALSE(purged.load()) << "the purge did not wait for the backup's copy";
  };
  Status backed_up = db->backup(dir.sub("b"));
  Db::Impl::between_backup_copies_for_testing = nullptr;
  purger.join();
  signaller.join();
  ASSERT_OK(backed_up);
  EXPECT_TRUE(purged.load());
  ASSERT_EQ(db->purge_receipts(1)->size(), 1u);
  ASSERT_OK(db->flush());
  EXPECT_EQ(*db->cohort_score(7, 1), 5.0);  // users 2 and 3, and user 2's signal during the backup
  EXPECT_EQ(*db->cohort_score(7, kItems - 1), 1.0);
}

// Issue 41 item 8: a recovering Db's feed holds the backup's state, before
// the journal's purges are replayed. A re-seed from it gave a view the
// purged user's contributions until finish_recovery; a trim could drop what
// the shard's consumers need. Both are refused until the recovery is over.
TEST(Backup, ARecoveringDbNeitherReseedsNorTrimsItsChangeFeed) {
  TempDir dir;
  Options options = feed_options(8);
  options.journal = true;
  std::vector<JournalEntry> journal;
  {
    auto db = open_db(dir.sub("db"), options);
    ASSERT_NE(db, nullptr);
    for (std::uint64_t u = 1; u <= 2; ++u) {
      ASSERT_OK(db->join_community(u, 100));
      ASSERT_OK(db->signal_with_context({u, 1, 1.5}, {{7}}));
    }
    ASSERT_OK(db->leave_community_layer(1));
    ASSERT_OK(db->backup(dir.sub("b")));
    ASSERT_OK(db->purge_community_contributions(1));
    journal = *db->read_journal(0, 1 << 20);
    ASSERT_OK(db->close());
  }
  auto restored = open_db(dir.sub("b"), options);
  ASSERT_NE(restored, nullptr);
  ASSERT_TRUE(restored->stats().recovering);
  const std::uint64_t last = *restored->last_change_seq();
  ASSERT_GT(last, 0u);
  Result<std::uint64_t> reseed = restored->reseed_change_feed();
  EXPECT_EQ(reseed.status().code(), StatusCode::Busy) << reseed.status().to_string();
  expect_has(reseed.status(), "recovering from a backup");
  Status trim = restored->trim_changes(last);
  EXPECT_EQ(trim.code(), StatusCode::Busy) << trim.to_string();
  expect_has(trim, "recovering from a backup");
  EXPECT_EQ(*restored->last_change_seq(), last) << "nothing of the feed changed";
  ASSERT_OK(restored->replay_journal(journal));
  ASSERT_OK(restored->finish_recovery());
  ASSERT_OK(restored->reseed_change_feed());
  ASSERT_OK(restored->trim_changes(1));
}

// Issue 41 item 7: an entry whose time is past any clock (~2^64) or far past
// this machine's was accepted, and every later leave failed "Db clock
// exhausted", across reopens. It is refused, and the Db's clock is as it was.
TEST(Backup, AReplayedEntryFarPastThisMachinesClockIsRefusedAndLeavesNoTrace) {
  TempDir dir;
  Options options = feed_options(6);
  options.journal = true;
  {
    auto db = open_db(dir.sub("db"), options);
    ASSERT_NE(db, nullptr);
    ASSERT_OK(db->join_community(1, 100));
    ASSERT_OK(db->backup(dir.sub("b")));
    ASSERT_OK(db->close());
  }
  auto restored = open_db(dir.sub("b"), options);
  ASSERT_NE(restored, nullptr);
  const std::uint64_t next = *restored->last_journal_seq() + 1;
  const auto now = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
  const auto leave_at = [&](std::uint64_t t) {
    return std::vector<JournalEntry>{{6, next, encode_journal_payload({JournalKind::Leave, 1, t, t})}};
  };
  constexpr std::uint64_t kDay = 24ULL * 3600 * 1'000'000'000;
  for (std::uint64_t t : {std::numeric_limits<std::uint64_t>::max() - 1,
                          static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()), now + 2 * kDay}) {
    Status s = restored->replay_journal(leave_at(t));
    EXPECT_FALSE(s.ok()) << "time " << t;
    expect_has(s, "entry seq " + std::to_string(next));
    expect_has(s, "nothing of it or later applied");
    EXPECT_EQ(*restored->last_journal_seq(), next - 1);
  }
  ASSERT_OK(restored->replay_journal(leave_at(now)));
  ASSERT_OK(restored->finish_recovery());
  ASSERT_OK(restored->join_community(2, 100));
  ASSERT_OK(restored->leave_community_layer(2));
  ASSERT_OK(restored->close());
  auto reopened = open_db(dir.sub("b"), options);
  ASSERT_NE(reopened, nullptr);
  ASSERT_OK(reopened->leave_community_layer(3));
  Result<CommunityMembership> st = reopened->community_layer_status(3);
  ASSERT_OK(st);
  EXPECT_LT(st->left_at_ns.value_or(0), now + kDay);
}

// B3: the replay writes a run of leaves and rejoins at once; a user's last
// entry in the run decides their status, history and gate.
TEST(Backup, AReplayedRunOfLeavesAndRejoinsLeavesEachUserAsTheirLastEntry) {
  TempDir dir;
  Options options = feed_options(5);
  options.journal = true;
  auto db = open_db(dir.sub("db"), options);
  ASSERT_NE(db, nullptr);
  for (std::uint64_t u = 1; u <= 3; ++u) ASSERT_OK(db->join_community(u, 100));
  ASSERT_OK(db->backup(dir.sub("b")));
  ASSERT_OK(db->leave_community_layer(1));
  ASSERT_OK(db->leave_community_layer(3));
  ASSERT_OK(db->rejoin_community_layer(1));
  ASSERT_OK(db->leave_community_layer(2));
  ASSERT_OK(db->rejoin_community_layer(3));
  ASSERT_OK(db->leave_community_layer(3));
  Result<std::vector<JournalEntry>> journal = db->read_journal(0, 1 << 20);
  ASSERT_OK(journal);
  ASSERT_EQ(journal->size(), 6u);
  std::vector<CommunityMembership> want;
  std::vector<std::size_t> history;
  for (std::uint64_t u = 1; u <= 3; ++u) {
    want.push_back(*db->community_layer_status(u));
    history.push_back(db->community_layer_history(u)->size());
  }
  ASSERT_OK(db->close());

  auto restored = open_db(dir.sub("b"), options);
  ASSERT_NE(restored, nullptr);
  ASSERT_OK(restored->replay_journal(*journal));
  EXPECT_EQ(*restored->last_journal_seq(), 6u);
  ASSERT_OK(restored->finish_recovery());
  for (std::uint64_t u = 1; u <= 3; ++u) {
    EXPECT_EQ(restored->community_layer_status(u)->status, want[u - 1].status) << "user " << u;
    EXPECT_EQ(restored->community_layer_status(u)->left_at_ns, want[u - 1].left_at_ns) << "user " << u;
    EXPECT_EQ(restored->community_layer_history(u)->size(), history[u - 1]) << "user " << u;
    ASSERT_OK(restored->signal_with_context({u, 1, 1.0}, {{7}}));
  }
  ASSERT_OK(restored->flush());
  // Only user 1 (rejoined last) reaches the shared aggregates.
  EXPECT_EQ(*restored->cohort_score(7, 1), 1.0);
  EXPECT_EQ(*restored->community_score(100, 1), 1.0);
}

}  // namespace
}  // namespace tidal
