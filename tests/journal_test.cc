// The privacy journal (docs/CONTRACT.md J1-J6): numbering under concurrent
// leaves and rejoins, read and confirm, journal_wait (confirmed, not
// replicated, closed), durability across reopen, a purge cut off between its
// intent and its batch, and the privacy scan of every payload. The killed
// process variant of the purge test is in crash_test.cc.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "db/impl.h"
#include "erasure_scan.h"
#include "fault_fs.h"
#include "storage/journal_format.h"
#include "test_util.h"
#include "tidal/db.h"

namespace tidal {
namespace {

using testing::TempDir;
using testing::open_db;
using testing::value_of;
using SteadyClock = std::chrono::steady_clock;

Options journal_options(std::uint64_t shard = 7, std::chrono::milliseconds wait = std::chrono::milliseconds(0)) {
  Options o;
  o.journal = true;
  o.shard_id = shard;
  o.journal_wait = wait;
  return o;
}

// Every entry of the journal after `after`, read in small pages (so the
// paging is exercised too).
std::vector<JournalEntry> read_all(Db& db, std::uint64_t after = 0) {
  std::vector<JournalEntry> out;
  for (;;) {
    Result<std::vector<JournalEntry>> page = db.read_journal(after, 100);
    EXPECT_TRUE(page.ok()) << page.status().to_string();
    if (!page.ok() || page->empty()) return out;
    after = page->back().seq;
    out.insert(out.end(), page->begin(), page->end());
  }
}

JournalRecord decoded(const JournalEntry& e) {
  std::string error;
  std::optional<JournalRecord> r = decode_journal_payload(e.payload, &error);
  EXPECT_TRUE(r.has_value()) << "seq " << e.seq << ": " << error;
  return r.value_or(JournalRecord{});
}

// ---- J1, J2: numbering under concurrency, one entry per change, in each user's order ----

TEST(JournalTest, SeqsHaveNoGapAndFollowEachUsersHistoryUnder24Threads) {
  TempDir dir;
  auto db = open_db(dir.path(), journal_options());
  ASSERT_NE(db, nullptr);
  constexpr int kThreads = 24, kUsersPerThread = 4, kRounds = 12;
  std::atomic<int> errors{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        for (int k = 0; k < kUsersPerThread; ++k) {
          const std::uint64_t u = static_cast<std::uint64_t>(t * 100 + k);
          // Leaves and rejoins, single and bulk, and redundant ones (G7: no entry).
          const bool leave = round % 2 == 0;
          const std::uint64_t one[] = {u};
          const auto single = [&] { return leave ? db->leave_community_layer(u) : db->rejoin_community_layer(u); };
          const auto bulk = [&] {
            return leave ? db->leave_community_layer(std::span<const std::uint64_t>(one))
                         : db->rejoin_community_layer(std::span<const std::uint64_t>(one));
          };
          Status s = (round + k) % 2 == 0 ? bulk() : single();
          if (s.ok() && (round + k) % 3 == 0) s = (round + k) % 2 == 0 ? single() : bulk();
          if (!s.ok()) {
            ADD_FAILURE() << s.to_string();
            ++errors;
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_EQ(errors.load(), 0);
  const Stats st = db->stats();
  const std::uint64_t changes = st.leaves + st.rejoins;
  ASSERT_EQ(changes, std::uint64_t{kThreads} * kUsersPerThread * kRounds);
  Result<std::uint64_t> last = db->last_journal_seq();
  ASSERT_OK(last);
  EXPECT_EQ(*last, changes) << "one entry per change of state, none for a redundant call";
  const std::vector<JournalEntry> entries = read_all(*db);
  ASSERT_EQ(entries.size(), changes);
  std::map<std::uint64_t, std::vector<MembershipEvent>> journaled;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    ASSERT_EQ(entries[i].seq, i + 1) << "a gap or a reordering at index " << i;
    EXPECT_EQ(entries[i].shard_id, 7u);
    const JournalRecord r = decoded(entries[i]);
    ASSERT_NE(r.kind, JournalKind::Purge);
    journaled[r.user_id].push_back(
        {r.kind == JournalKind::Leave ? MembershipStatus::Left : MembershipStatus::Active, r.at_ns});
  }
  ASSERT_EQ(journaled.size(), std::size_t{kThreads} * kUsersPerThread);
  for (const auto& [user, events] : journaled) {
    Result<std::vector<MembershipEvent>> history = db->community_layer_history(user);
    ASSERT_OK(history);
    ASSERT_EQ(history->size(), events.size()) << "user " << user;
    for (std::size_t i = 0; i < events.size(); ++i) {
      EXPECT_EQ(events[i].status, (*history)[i].status) << "user " << user << " event " << i;
      EXPECT_EQ(events[i].at_ns, (*history)[i].at_ns) << "user " << user << " event " << i;
    }
  }
  EXPECT_EQ(st.journal_last_seq, changes);
  EXPECT_EQ(st.journal_pending_entries, changes);
  EXPECT_EQ(st.journal_pending_bytes, changes * kJournalPayloadSize);
  ASSERT_OK(db->close());
}

// ---- J3: read and confirm, mirroring read_changes and trim_changes ----

TEST(JournalTest, ReadAndConfirmMirrorTheChangeFeed) {
  TempDir dir;
  {
    auto plain = open_db(dir.sub("plain"));
    ASSERT_NE(plain, nullptr);
    EXPECT_EQ(plain->read_journal(0, 100).status().code(), StatusCode::InvalidArgument);
    EXPECT_EQ(plain->last_journal_seq().status().code(), StatusCode::InvalidArgument);
    Status s = plain->confirm_journal(0);
    EXPECT_EQ(s.code(), StatusCode::InvalidArgument);
    EXPECT_NE(s.message().find("keeps no privacy journal"), std::string::npos) << s.message();
  }
  const std::string path = dir.sub("db");
  auto db = open_db(path, journal_options(3));
  ASSERT_NE(db, nullptr);
  ASSERT_OK(db->last_journal_seq());
  EXPECT_EQ(*db->last_journal_seq(), 0u);
  ASSERT_OK(db->read_journal(0, 100));
  EXPECT_TRUE(db->read_journal(0, 100)->empty());
  ASSERT_OK(db->leave_community_layer(1));
  ASSERT_OK(db->leave_community_layer(1));  // G7: no second entry
  ASSERT_OK(db->rejoin_community_layer(1));
  ASSERT_OK(db->leave_community_layer(2));
  EXPECT_EQ(*db->last_journal_seq(), 3u);
  Result<std::vector<JournalEntry>> one = db->read_journal(0, 1);  // at least one, about max_bytes
  ASSERT_OK(one);
  ASSERT_EQ(one->size(), 1u);
  EXPECT_EQ((*one)[0].seq, 1u);
  Result<std::vector<JournalEntry>> rest = db->read_journal(1, 1 << 20);
  ASSERT_OK(rest);
  ASSERT_EQ(rest->size(), 2u);
  EXPECT_EQ((*rest)[0].seq, 2u);
  EXPECT_EQ(decoded((*rest)[0]).kind, JournalKind::Rejoin);
  EXPECT_TRUE(db->read_journal(3, 100)->empty());
  EXPECT_TRUE(db->read_journal(99, 100)->empty());

  Status past = db->confirm_journal(4);
  EXPECT_EQ(past.code(), StatusCode::InvalidArgument);
  EXPECT_NE(past.message().find("ends at seq 3"), std::string::npos) << past.message();
  ASSERT_OK(db->confirm_journal(2));
  ASSERT_OK(db->confirm_journal(1));  // below the point: nothing changes
  Result<std::vector<JournalEntry>> gone = db->read_journal(0, 100);
  EXPECT_EQ(gone.status().code(), StatusCode::NotFound);
  EXPECT_NE(gone.status().message().find("confirmed through seq 2"), std::string::npos) << gone.status().message();
  EXPECT_EQ(db->read_journal(1, 100).status().code(), StatusCode::NotFound);
  Result<std::vector<JournalEntry>> after = db->read_journal(2, 100);
  ASSERT_OK(after);
  ASSERT_EQ(after->size(), 1u);
  EXPECT_EQ((*after)[0].seq, 3u);
  Stats st = db->stats();
  EXPECT_TRUE(st.journal);
  EXPECT_EQ(st.journal_shard_id, 3u);
  EXPECT_EQ(st.journal_last_seq, 3u);
  EXPECT_EQ(st.journal_confirmed_seq, 2u);
  EXPECT_EQ(st.journal_pending_entries, 1u);
  EXPECT_EQ(st.journal_pending_bytes, kJournalPayloadSize);
  ASSERT_OK(db->close());

  // The confirmed point is durable; the seqs go on from the last one.
  db = open_db(path, journal_options(3));
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(*db->last_journal_seq(), 3u);
  EXPECT_EQ(db->read_journal(1, 100).status().code(), StatusCode::NotFound);
  EXPECT_EQ(db->stats().journal_confirmed_seq, 2u);
  ASSERT_OK(db->leave_community_layer(3));
  EXPECT_EQ(*db->last_journal_seq(), 4u);
  ASSERT_OK(db->confirm_journal(4));
  EXPECT_EQ(db->stats().journal_pending_entries, 0u);
  EXPECT_EQ(db->stats().journal_pending_bytes, 0u);
  ASSERT_OK(db->close());
  EXPECT_EQ(db->read_journal(4, 100).status().code(), StatusCode::Closed);
  EXPECT_EQ(db->last_journal_seq().status().code(), StatusCode::Closed);
  EXPECT_EQ(db->confirm_journal(4).code(), StatusCode::Closed);

  // Opens that would break the journal are refused, naming why.
  Options other = journal_options(4);
  Result<std::unique_ptr<Db>> wrong = Db::open(path, other);
  ASSERT_EQ(wrong.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(wrong.status().message().find("belongs to shard 3"), std::string::npos) << wrong.status().message();
  Result<std::unique_ptr<Db>> without = Db::open(path, Options{});
  ASSERT_EQ(without.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(without.status().message().find("keeps a privacy journal (shard 3)"), std::string::npos)
      << without.status().message();
  Options wait_alone;
  wait_alone.journal_wait = std::chrono::milliseconds(100);
  EXPECT_EQ(Db::open(dir.sub("other"), wait_alone).status().code(), StatusCode::InvalidArgument);
  Options read_only;
  read_only.read_only = true;
  auto reader = open_db(path, read_only);  // reads the stored journal
  ASSERT_NE(reader, nullptr);
  EXPECT_EQ(*reader->last_journal_seq(), 4u);
  EXPECT_EQ(reader->confirm_journal(4).code(), StatusCode::InvalidArgument);  // read-only
  ASSERT_OK(reader->close());
}

// ---- J4: journal_wait ----

// A publisher stand-in: confirms whatever the journal holds, every 10 ms
// (slow enough that a call that did not wait returns before it confirms).
class Confirmer {
 public:
  explicit Confirmer(Db* db) : thread_([this, db] {
    while (!stop_.load()) {
      Result<std::uint64_t> last = db->last_journal_seq();
      if (last.ok() && *last > 0) {
        named_.store(*last);
        (void)db->confirm_journal(*last);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }) {}
  ~Confirmer() {
    stop_.store(true);
    thread_.join();
  }
  // The highest seq a confirm_journal call named (set before the call).
  std::uint64_t named() const { return named_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> named_{0};
  std::thread thread_;
};

TEST(JournalTest, JournalWaitReturnsOkOnceAnotherThreadConfirms) {
  TempDir dir;
  // Generous: the calls return as soon as the confirmer catches up, long before it.
  const auto wait = std::chrono::milliseconds(30'000);
  auto db = open_db(dir.path(), journal_options(1, wait));
  ASSERT_NE(db, nullptr);
  ASSERT_OK(db->join_community(5, 50));
  ASSERT_OK(db->signal_with_context({5, 1, 2.0}, SignalContext{{9}}));
  ASSERT_OK(db->flush());
  {
    Confirmer confirmer(db.get());
    const auto start = SteadyClock::now();
    const std::uint64_t bulk[] = {6, 7, 8};
    const std::vector<std::pair<const char*, std::function<Status()>>> calls = {
        {"leave", [&] { return db->leave_community_layer(5); }},
        {"purge", [&] { return db->purge_community_contributions(5).status(); }},
        {"rejoin", [&] { return db->rejoin_community_layer(5); }},
        {"bulk leave", [&] { return db->leave_community_layer(std::span<const std::uint64_t>(bulk)); }},
        {"bulk rejoin", [&] { return db->rejoin_community_layer(std::span<const std::uint64_t>(bulk)); }},
    };
    for (const auto& [name, call] : calls) {
      ASSERT_OK(call());
      // It returned only once a confirm named its entries (the last ones:
      // nobody else writes); that confirm's write may still be under way.
      EXPECT_GE(confirmer.named(), *db->last_journal_seq()) << name;
    }
    EXPECT_LT(SteadyClock::now() - start, wait) << "no call may have run out its wait";
  }
  EXPECT_EQ(db->stats().journal_wait_timeouts, 0u);
  EXPECT_EQ(*db->last_journal_seq(), 9u);  // leave, purge, rejoin, 3 leaves, 3 rejoins
  ASSERT_OK(db->close());
}

// A waiting leave returns as soon as confirm_journal names its entry, and
// the confirm's own write (the confirmed point, the entries dropped) is not
// synced: it is the publisher's bookkeeping, and its fsync sat in front of
// the next leave's write on the one WAL. With the users engine's syncs
// held, the leave returns and the confirm finishes without an fsync. A
// power cut before the next sync takes the bookkeeping back, nothing else:
// the entry is there again, unconfirmed, and is confirmed again. Red with a
// synced confirm: it waits on the held fsync.
TEST(JournalTest, AConfirmReleasesItsCallsAtOnceAndItsWriteWaitsForNoFsync) {
  TempDir dir;
  const std::string path = dir.path();
  reliability::FaultEnv fault = reliability::FaultEnv::make();
  std::uint64_t at_ns = 0;
  {
    Result<std::unique_ptr<Db>> opened =
        Db::Impl::open(path, journal_options(3, std::chrono::milliseconds(30'000)), fault.env.get());
    ASSERT_OK(opened);
    Db& db = **opened;
    std::promise<Status> left;
    std::future<Status> leave_done = left.get_future();
    std::thread leaver([&] { left.set_value(db.leave_community_layer(11)); });
    // The leave's entry is written (and synced) before it waits.
    Result<std::uint64_t> seq = db.wait_journal(0, std::chrono::milliseconds(30'000));
    ASSERT_OK(seq);
    ASSERT_EQ(*seq, 1u);
    fault.fs->hold_syncs_under(path);
    std::promise<Status> confirmed;
    std::future<Status> confirm_done = confirmed.get_future();
    std::thread confirmer([&] { confirmed.set_value(db.confirm_journal(1)); });
    const bool leave_returned = leave_done.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
    const bool confirm_returned = confirm_done.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
    const std::uint64_t held = fault.fs->held_syncs();
    fault.fs->release_syncs();
    confirmer.join();
    leaver.join();
    EXPECT_TRUE(leave_returned) << "the leave waited for the confirm's write";
    EXPECT_TRUE(confirm_returned) << "the confirm waited for an fsync";
    EXPECT_EQ(held, 0u) << "the confirm synced the WAL";
    EXPECT_OK(leave_done.get());
    EXPECT_OK(confirm_done.get());
    EXPECT_EQ(db.stats().journal_confirmed_seq, 1u);
    EXPECT_TRUE(read_all(db, 1).empty());
    Result<std::vector<MembershipEvent>> history = db.community_layer_history(11);
    ASSERT_OK(history);
    ASSERT_EQ(history->size(), 1u);
    at_ns = history->front().at_ns;
    // The power goes before anything syncs the confirm's write.
    fault.fs->cut_power();
    (void)db.close();
  }
  fault.fs->restore_power();
  {
    // Only the bookkeeping is gone: the leave and its entry are there,
    // unconfirmed, and a confirm (the publisher's, on finding the entry in
    // the stream) confirms it again.
    auto db = open_db(path, journal_options(3));
    ASSERT_NE(db, nullptr);
    EXPECT_EQ(db->stats().journal_confirmed_seq, 0u);
    const std::vector<JournalEntry> entries = read_all(*db);
    ASSERT_EQ(entries.size(), 1u);
    EXPECT_EQ(decoded(entries[0]).user_id, 11u);
    EXPECT_EQ(decoded(entries[0]).at_ns, at_ns);
    Result<CommunityMembership> status = db->community_layer_status(11);
    ASSERT_OK(status);
    EXPECT_EQ(status->status, MembershipStatus::Left);
    EXPECT_EQ(status->left_at_ns, at_ns);
    ASSERT_OK(db->confirm_journal(1));
    ASSERT_OK(db->close());
  }
  auto db = open_db(path, journal_options(3));
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(db->stats().journal_confirmed_seq, 1u);
  EXPECT_TRUE(read_all(*db, 1).empty());
  EXPECT_EQ(*db->last_journal_seq(), 1u);
  ASSERT_OK(db->close());
}

// What a journal's publisher waits on instead of polling (Db::wait_journal):
// it returns at a new entry written by another thread, long before its
// wait; after its wait when none comes; at once when one is there already;
// and when close() begins.
TEST(JournalTest, WaitJournalReturnsAtANewEntryAfterItsWaitOrAtClose) {
  TempDir dir;
  auto db = open_db(dir.path(), journal_options());
  ASSERT_NE(db, nullptr);
  const auto long_wait = std::chrono::milliseconds(30'000);

  auto start = SteadyClock::now();
  Result<std::uint64_t> none = db->wait_journal(0, std::chrono::milliseconds(50));
  ASSERT_OK(none.status());
  EXPECT_EQ(*none, 0u);
  EXPECT_GE(SteadyClock::now() - start, std::chrono::milliseconds(50));

  std::thread leaver([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_OK(db->leave_community_layer(5));
  });
  start = SteadyClock::now();
  Result<std::uint64_t> woken = db->wait_journal(0, long_wait);
  leaver.join();
  ASSERT_OK(woken.status());
  EXPECT_EQ(*woken, 1u);
  EXPECT_LT(SteadyClock::now() - start, std::chrono::seconds(10)) << "woken by the entry, not by the wait";

  start = SteadyClock::now();
  Result<std::uint64_t> there = db->wait_journal(0, long_wait);  // entry 1 is there already
  ASSERT_OK(there.status());
  EXPECT_EQ(*there, 1u);
  EXPECT_LT(SteadyClock::now() - start, std::chrono::seconds(10));

  Result<std::uint64_t> at_close = std::uint64_t{999};
  std::thread waiter([&] { at_close = db->wait_journal(1, long_wait); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  start = SteadyClock::now();
  ASSERT_OK(db->close());
  waiter.join();
  EXPECT_LT(SteadyClock::now() - start, std::chrono::seconds(10)) << "close waited for the waiter's whole wait";
  // Either woken by the close (the last seq) or refused as Closed when it started after it.
  if (at_close.ok()) {
    EXPECT_EQ(*at_close, 1u);
  } else {
    EXPECT_EQ(at_close.status().code(), StatusCode::Closed) << at_close.status().to_string();
  }
  EXPECT_EQ(db->wait_journal(0, long_wait).status().code(), StatusCode::Closed);

  TempDir plain;
  auto no_journal = open_db(plain.path(), Options{});
  ASSERT_NE(no_journal, nullptr);
  EXPECT_EQ(no_journal->wait_journal(0, std::chrono::milliseconds(1)).status().code(), StatusCode::InvalidArgument);
}

TEST(JournalTest, JournalWaitReturnsNotReplicatedWhenNobodyConfirmsAndARetryIsSafe) {
  TempDir dir;
  const auto wait = std::chrono::milliseconds(200);
  auto db = open_db(dir.path(), journal_options(1, wait));
  ASSERT_NE(db, nullptr);
  ASSERT_OK(db->join_community(5, 50));
  ASSERT_OK(db->signal_with_context({5, 1, 2.0}, SignalContext{{9}}));
  ASSERT_OK(db->flush());

  auto start = SteadyClock::now();
  Status s = db->leave_community_layer(5);
  auto took = SteadyClock::now() - start;
  ASSERT_EQ(s.code(), StatusCode::NotReplicated) << s.to_string();
  EXPECT_EQ(s.to_string().rfind("NotReplicated: leave_community_layer(user 5): ", 0), 0u) << s.to_string();
  EXPECT_NE(s.message().find("durable and in effect"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("seq 1 of shard 1"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("retry of the same call is safe"), std::string::npos) << s.message();
  EXPECT_GE(took, wait);
  // Bounded by the wait, not by anything else: allow the scheduler plenty.
  EXPECT_LT(took, wait * 25);
  // In effect (G2) and durable (G1) all the same.
  EXPECT_EQ(db->community_layer_status(5)->status, MembershipStatus::Left);
  Result<SignalOutcome> gated = db->signal_with_context({5, 2, 1.0}, SignalContext{{9}});
  ASSERT_OK(gated);
  EXPECT_TRUE(gated->gated);
  // A retry writes no second entry, and waits for the first.
  EXPECT_EQ(db->leave_community_layer(5).code(), StatusCode::NotReplicated);
  EXPECT_EQ(*db->last_journal_seq(), 1u);
  ASSERT_OK(db->confirm_journal(1));
  start = SteadyClock::now();
  ASSERT_OK(db->leave_community_layer(5));
  EXPECT_LT(SteadyClock::now() - start, wait) << "a retry of a confirmed leave returns at once";
  EXPECT_EQ(*db->last_journal_seq(), 1u);

  // A purge is done, and says it is not replicated.
  Result<PurgeReceipt> purged = db->purge_community_contributions(5);
  ASSERT_EQ(purged.status().code(), StatusCode::NotReplicated) << purged.status().to_string();
  EXPECT_NE(purged.status().message().find("durable and in effect"), std::string::npos);
  Result<std::vector<PurgeReceipt>> receipts = db->purge_receipts(5);
  ASSERT_OK(receipts);
  ASSERT_EQ(receipts->size(), 1u);
  EXPECT_EQ((*receipts)[0].entries_removed, 2u);  // cohort 9 and community 50
  EXPECT_EQ(value_of(db->cohort_score(9, 1)), 0.0);
  EXPECT_EQ(db->stats().journal_wait_timeouts, 3u);
  EXPECT_EQ(db->stats().journal_pending_entries, 1u);

  // close() does not wait out journal_wait: a waiting call returns at once.
  Options long_wait = journal_options(1, std::chrono::milliseconds(60'000));
  ASSERT_OK(db->close());
  db = open_db(dir.path(), long_wait);
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(db->community_layer_status(5)->status, MembershipStatus::Left);  // durable
  Status in_flight;
  std::thread leaver([&] { in_flight = db->leave_community_layer(6); });
  while (*db->last_journal_seq() < 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  start = SteadyClock::now();
  ASSERT_OK(db->close());
  leaver.join();
  EXPECT_LT(SteadyClock::now() - start, long_wait.journal_wait / 2);
  EXPECT_EQ(in_flight.code(), StatusCode::NotReplicated) << in_flight.to_string();
  EXPECT_NE(in_flight.message().find("before the Db was closed"), std::string::npos) << in_flight.message();
}

// ---- J1: durable across reopen, seqs never reused ----

TEST(JournalTest, EntriesSurviveReopenByteForByteAndSeqsAreNeverReused) {
  TempDir dir;
  std::vector<JournalEntry> before;
  for (bool sync : {true, false}) {
    const std::string path = dir.sub(sync ? "sync" : "nosync");
    Options o = journal_options(11);
    o.sync_writes = sync;
    {
      auto db = open_db(path, o);
      ASSERT_NE(db, nullptr);
      ASSERT_OK(db->join_community(1, 10));
      ASSERT_OK(db->signal_with_context({1, 1, 1.0}, SignalContext{{2}}));
      ASSERT_OK(db->leave_community_layer(1));
      ASSERT_OK(db->purge_community_contributions(1));
      ASSERT_OK(db->rejoin_community_layer(1));
      const std::uint64_t bulk[] = {2, 3};
      ASSERT_OK(db->leave_community_layer(std::span<const std::uint64_t>(bulk)));
      before = read_all(*db);
      ASSERT_EQ(before.size(), 5u);
      ASSERT_OK(db->close());
    }
    auto db = open_db(path, o);
    ASSERT_NE(db, nullptr);
    const std::vector<JournalEntry> after = read_all(*db);
    ASSERT_EQ(after.size(), before.size());
    for (std::size_t i = 0; i < after.size(); ++i) {
      EXPECT_EQ(after[i].seq, before[i].seq);
      EXPECT_EQ(after[i].shard_id, 11u);
      EXPECT_EQ(after[i].payload, before[i].payload) << "seq " << after[i].seq;
    }
    ASSERT_OK(db->leave_community_layer(9));
    EXPECT_EQ(*db->last_journal_seq(), 6u);
    ASSERT_OK(db->close());
  }
}

// ---- J1: an entry and its record are one write, through faults and power cuts ----

TEST(JournalTest, AnEntryAndItsRecordSurviveOrVanishTogetherThroughAFailedSyncAndAPowerCut) {
  TempDir dir;
  const std::string path = dir.path();
  reliability::FaultEnv fault = reliability::FaultEnv::make();
  {
    Result<std::unique_ptr<Db>> db = Db::Impl::open(path, journal_options(4), fault.env.get());
    ASSERT_OK(db);
    for (std::uint64_t u = 1; u <= 20; ++u) ASSERT_OK((*db)->leave_community_layer(u));  // acknowledged
    ASSERT_OK((*db)->rejoin_community_layer(1));
    fault.fs->set_fail_wal_sync(true);
    // Not acknowledged: each write fails (and RocksDB refuses every write after it).
    for (std::uint64_t u = 21; u <= 24; ++u) EXPECT_FALSE((*db)->leave_community_layer(u).ok()) << "user " << u;
    EXPECT_FALSE((*db)->rejoin_community_layer(2).ok());
    fault.fs->cut_power();
    (void)(*db)->close();
  }
  fault.fs->restore_power();
  fault.fs->set_fail_wal_sync(false);
  auto db = open_db(path, journal_options(4));
  ASSERT_NE(db, nullptr);
  const std::vector<JournalEntry> entries = read_all(*db);
  std::map<std::uint64_t, std::vector<MembershipEvent>> journaled;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    ASSERT_EQ(entries[i].seq, i + 1);
    const JournalRecord r = decoded(entries[i]);
    journaled[r.user_id].push_back(
        {r.kind == JournalKind::Leave ? MembershipStatus::Left : MembershipStatus::Active, r.at_ns});
  }
  EXPECT_GE(entries.size(), 21u) << "an acknowledged change lost its entry";
  for (std::uint64_t u = 1; u <= 24; ++u) {
    Result<std::vector<MembershipEvent>> history = db->community_layer_history(u);
    ASSERT_OK(history);
    if (u <= 20) {
      EXPECT_FALSE(history->empty()) << "acknowledged leave of user " << u << " lost";
    }
    const std::vector<MembershipEvent>& events = journaled[u];
    ASSERT_EQ(history->size(), events.size()) << "user " << u << ": a record without its entry, or the reverse";
    for (std::size_t i = 0; i < events.size(); ++i) {
      EXPECT_EQ((*history)[i].status, events[i].status) << "user " << u;
      EXPECT_EQ((*history)[i].at_ns, events[i].at_ns) << "user " << u;
    }
  }
  // The seqs go on after the last durable one.
  ASSERT_OK(db->leave_community_layer(99));
  EXPECT_EQ(*db->last_journal_seq(), entries.size() + 1);
  ASSERT_OK(db->close());
}

// ---- J6: a purge cut off between its intent and its batch ----

TEST(JournalTest, APurgeThatFailsAfterItsIntentIsFinishedByTheNextOpen) {
  TempDir dir;
  const std::string path = dir.path();
  std::vector<std::uint64_t> users = {21, 22, 23};
  {
    auto db = open_db(path, journal_options(2));
    ASSERT_NE(db, nullptr);
    for (std::uint64_t u : users) {
      ASSERT_OK(db->join_community(u, 77));
      ASSERT_OK(db->signal_with_context({u, 1, 0.5}, SignalContext{{8}}));
    }
    ASSERT_OK(db->signal_with_context({99, 1, 0.25}, SignalContext{{8}}));  // stays
    ASSERT_OK(db->flush());
    ASSERT_OK(db->leave_community_layer(std::span<const std::uint64_t>(users)));
    Db::Impl::after_purge_intent_for_testing = [] { throw std::runtime_error("injected failure after the intents"); };
    Result<std::vector<PurgeReceipt>> failed = db->purge_community_contributions(std::span<const std::uint64_t>(users));
    Db::Impl::after_purge_intent_for_testing = nullptr;
    ASSERT_FALSE(failed.ok());
    EXPECT_NE(failed.status().message().find("injected failure"), std::string::npos) << failed.status().message();
    // Not purged yet: the intents are durable, the batch was never written.
    EXPECT_EQ(value_of(db->cohort_score(8, 1)), 1.75);
    for (std::uint64_t u : users) EXPECT_TRUE(db->purge_receipts(u)->empty()) << "user " << u;
    ASSERT_OK(db->close());
  }
  auto db = open_db(path, journal_options(2));
  ASSERT_NE(db, nullptr);
  const std::vector<JournalEntry> entries = read_all(*db);
  ASSERT_EQ(entries.size(), 6u);  // 3 leaves, 3 intents
  for (std::size_t i = 3; i < 6; ++i) {
    const JournalRecord r = decoded(entries[i]);
    ASSERT_EQ(r.kind, JournalKind::Purge);
    EXPECT_EQ(r.user_id, users[i - 3]);
    Result<std::vector<PurgeReceipt>> receipts = db->purge_receipts(r.user_id);
    ASSERT_OK(receipts);
    ASSERT_EQ(receipts->size(), 1u) << "the open did not finish the purge of user " << r.user_id;
    EXPECT_EQ((*receipts)[0].purged_at_ns, r.at_ns) << "the receipt is the one the intent names";
    EXPECT_EQ((*receipts)[0].left_at_ns, r.left_at_ns);
    EXPECT_EQ((*receipts)[0].entries_removed, 2u);
    EXPECT_TRUE((*receipts)[0].erasure_complete);
    EXPECT_TRUE(testing::scan_files(path, r.user_id).found.empty()) << "user " << r.user_id;
  }
  EXPECT_EQ(value_of(db->cohort_score(8, 1)), 0.25);
  EXPECT_EQ(value_of(db->community_score(77, 1)), 0.0);
  Result<RematerializeReport> remat = db->rematerialize_shared_aggregates();
  ASSERT_OK(remat);
  EXPECT_TRUE(remat->mismatches.empty());
  ASSERT_OK(db->close());
  // The marks are gone: another open finds nothing to finish, and a rejoin
  // and fresh signals of a purged user are never removed by it.
  db = open_db(path, journal_options(2));
  ASSERT_NE(db, nullptr);
  ASSERT_OK(db->rejoin_community_layer(21));
  ASSERT_OK(db->signal_with_context({21, 1, 4.0}, SignalContext{{8}}));
  ASSERT_OK(db->close());
  db = open_db(path, journal_options(2));
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(value_of(db->cohort_score(8, 1)), 4.25);
  EXPECT_EQ(db->purge_receipts(21)->size(), 1u);
  ASSERT_OK(db->close());
}

// A purge that failed after its intent, in a Db that stays open: its users
// cannot rejoin (the next open would take the purge for done) until a purge
// finishes it; the retry does, and then the marks are gone for good.
TEST(JournalTest, AfterAPurgeFailsPastItsIntentItsUsersRejoinOnlyOnceAPurgeFinishesIt) {
  TempDir dir;
  const std::string path = dir.path();
  auto db = open_db(path, journal_options(2));
  ASSERT_NE(db, nullptr);
  for (std::uint64_t u : {std::uint64_t{31}, std::uint64_t{32}}) {
    ASSERT_OK(db->join_community(u, 77));
    ASSERT_OK(db->signal_with_context({u, 1, 0.5}, SignalContext{{8}}));
    ASSERT_OK(db->leave_community_layer(u));
  }
  Db::Impl::after_purge_intent_for_testing = [] { throw std::runtime_error("injected failure after the intent"); };
  EXPECT_FALSE(db->purge_community_contributions(31).ok());
  Db::Impl::after_purge_intent_for_testing = nullptr;
  Status refused = db->rejoin_community_layer(31);
  ASSERT_EQ(refused.code(), StatusCode::Busy) << refused.to_string();
  EXPECT_NE(refused.message().find("purge the user again"), std::string::npos) << refused.message();
  const std::uint64_t both[] = {31, 32};
  EXPECT_EQ(db->rejoin_community_layer(std::span<const std::uint64_t>(both)).code(), StatusCode::Busy);
  EXPECT_EQ(db->community_layer_status(31)->status, MembershipStatus::Left);  // nothing changed
  EXPECT_EQ(db->community_layer_status(32)->status, MembershipStatus::Left);
  ASSERT_OK(db->rejoin_community_layer(32));  // other users are not held back
  Result<PurgeReceipt> again = db->purge_community_contributions(31);
  ASSERT_OK(again);
  EXPECT_EQ(again->entries_removed, 2u);
  ASSERT_OK(db->rejoin_community_layer(31));
  ASSERT_OK(db->signal_with_context({31, 1, 4.0}, SignalContext{{8}}));
  ASSERT_OK(db->close());
  db = open_db(path, journal_options(2));  // finds no mark: changes nothing
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(value_of(db->cohort_score(8, 1)), 4.5);
  EXPECT_EQ(db->purge_receipts(31)->size(), 1u);
  ASSERT_OK(db->close());
}

// ---- J5: the journal carries nothing but what a deletion log must ----

// Every 8-byte encoding (both byte orders) of `v`.
std::vector<std::string> encodings(std::uint64_t v) {
  std::string le(8, '\0'), be(8, '\0');
  for (int i = 0; i < 8; ++i) {
    le[static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
    be[static_cast<std::size_t>(7 - i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  }
  return {le, be};
}

TEST(JournalTest, PayloadsHoldNoSignalItemCohortCommunityOrWeight) {
  TempDir dir;
  Options o = journal_options(5);
  o.aggregate_write_period = std::chrono::milliseconds(5);
  auto db = open_db(dir.path(), o);
  ASSERT_NE(db, nullptr);
  // Distinctive values, so that any of them in a payload is found.
  const std::uint64_t item_base = 0x1717171700000000, cohort_base = 0xC0C0C0C000000000,
                      community_base = 0xCAFECAFE00000000;
  const std::vector<double> weights = {12345.678901, 0.123456789, 777.5};
  std::vector<std::uint64_t> users;
  for (std::uint64_t u = 1; u <= 16; ++u) {
    users.push_back(u);
    ASSERT_OK(db->join_community(u, community_base + u % 3));
  }
  std::uint64_t n = 0;
  const auto signal_all = [&] {
    for (std::uint64_t u : users) {
      for (int k = 0; k < 3; ++k, ++n) {
        ASSERT_OK(db->signal_with_context({u, item_base + n % 7, weights[n % weights.size()]},
                                          SignalContext{{cohort_base + n % 5, cohort_base + 100 + u}}));
      }
    }
  };
  signal_all();
  ASSERT_OK(db->flush());
  for (std::uint64_t u = 1; u <= 8; ++u) ASSERT_OK(db->leave_community_layer(u));
  const std::uint64_t bulk[] = {9, 10, 11, 12};
  ASSERT_OK(db->leave_community_layer(std::span<const std::uint64_t>(bulk)));
  ASSERT_OK(db->purge_community_contributions(1));
  ASSERT_OK(db->purge_community_contributions(std::span<const std::uint64_t>(bulk)));
  ASSERT_OK(db->rejoin_community_layer(1));
  ASSERT_OK(db->rejoin_community_layer(std::span<const std::uint64_t>(bulk)));
  signal_all();
  ASSERT_OK(db->flush());
  ASSERT_OK(db->leave_community_layer(1));
  ASSERT_OK(db->purge_community_contributions(1));  // a second purge: only what came after the rejoin
  ASSERT_OK(db->purge_community_contributions(2));

  std::vector<std::string> forbidden;
  for (std::uint64_t i = 0; i < 7; ++i) for (auto& e : encodings(item_base + i)) forbidden.push_back(e);
  for (std::uint64_t i = 0; i < 5; ++i) for (auto& e : encodings(cohort_base + i)) forbidden.push_back(e);
  for (std::uint64_t u : users) for (auto& e : encodings(cohort_base + 100 + u)) forbidden.push_back(e);
  for (std::uint64_t c = 0; c < 3; ++c) for (auto& e : encodings(community_base + c)) forbidden.push_back(e);
  for (double w : weights) {
    std::uint64_t bits = 0;
    std::memcpy(&bits, &w, 8);
    for (auto& e : encodings(bits)) forbidden.push_back(e);
    // The exact units (1e-9) a weight is kept as, and their low half as in a 16-byte sum.
    for (auto& e : encodings(static_cast<std::uint64_t>(w * 1e9 + 0.5))) forbidden.push_back(e);
  }

  const std::vector<JournalEntry> entries = read_all(*db);
  ASSERT_EQ(entries.size(), 12u + 1 + 4 + 1 + 4 + 1 + 1 + 1);
  std::map<std::uint64_t, std::set<std::uint64_t>> leave_times, rejoin_times, purge_times;
  for (std::uint64_t u : users) {
    const Result<std::vector<MembershipEvent>> history = db->community_layer_history(u);
    ASSERT_OK(history);
    for (const MembershipEvent& e : *history) {
      (e.status == MembershipStatus::Left ? leave_times : rejoin_times)[u].insert(e.at_ns);
    }
    const Result<std::vector<PurgeReceipt>> receipts = db->purge_receipts(u);
    ASSERT_OK(receipts);
    for (const PurgeReceipt& r : *receipts) purge_times[u].insert(r.purged_at_ns);
  }
  std::size_t purges = 0;
  for (const JournalEntry& e : entries) {
    // Decoded whole: 26 bytes, every field accounted for by a membership event.
    ASSERT_EQ(e.payload.size(), kJournalPayloadSize) << "seq " << e.seq;
    const JournalRecord r = decoded(e);
    ASSERT_NE(std::find(users.begin(), users.end(), r.user_id), users.end()) << "seq " << e.seq;
    switch (r.kind) {
      case JournalKind::Leave:
        EXPECT_TRUE(leave_times[r.user_id].contains(r.at_ns)) << "seq " << e.seq;
        EXPECT_EQ(r.left_at_ns, r.at_ns);
        break;
      case JournalKind::Rejoin:
        EXPECT_TRUE(rejoin_times[r.user_id].contains(r.at_ns)) << "seq " << e.seq;
        EXPECT_TRUE(leave_times[r.user_id].contains(r.left_at_ns)) << "seq " << e.seq;
        break;
      case JournalKind::Purge:
        ++purges;
        EXPECT_TRUE(purge_times[r.user_id].contains(r.at_ns)) << "seq " << e.seq << ": no receipt named by it";
        EXPECT_TRUE(leave_times[r.user_id].contains(r.left_at_ns)) << "seq " << e.seq;
        break;
    }
    for (const std::string& f : forbidden) {
      EXPECT_EQ(e.payload.find(f), std::string::npos) << "seq " << e.seq << " holds a signal's value";
    }
  }
  EXPECT_EQ(purges, 7u);
  ASSERT_OK(db->close());
}

}  // namespace
}  // namespace tidal
