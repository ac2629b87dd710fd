// close() against sinks, callbacks and busy callers; a Db open at process
// exit; the bulk leave and rejoin; a throwing sink (issue 9 items 1, 2, 7,
// 9, 10).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <mutex>
#include <numeric>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "db/impl.h"
#include "fault_fs.h"
#include "test_util.h"
#include "tidal/db.h"

namespace tidal::testing {
namespace {

// Aborts the test binary with a message when the scope is not left within
// `limit`: a deadlock or starvation fails the test instead of hanging it.
// The limit only detects a hang; it is not a timing assertion.
class Watchdog {
 public:
  Watchdog(std::string what, std::chrono::seconds limit)
      : thread_([this, what = std::move(what), limit] {
          std::unique_lock<std::mutex> lock(mu_);
          if (!cv_.wait_for(lock, limit, [this] { return done_; })) {
            std::fprintf(stderr, "WATCHDOG: %s did not finish within %lld s: deadlock or starvation\n", what.c_str(),
                         static_cast<long long>(limit.count()));
            std::abort();
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

constexpr std::chrono::seconds kHang{10};

std::vector<std::uint64_t> range(std::uint64_t first, std::uint64_t count) {
  std::vector<std::uint64_t> v(count);
  std::iota(v.begin(), v.end(), first);
  return v;
}

// ---- item 1: a sink that calls the Db while close() runs ----

// One public method, called from inside a sink callback.
struct SinkCall {
  const char* name;
  std::function<Status(Db&)> call;
  StatusCode while_closing;  // what it returns once close() has begun (writes: Closed, except close)
  StatusCode while_open;     // what it returns on an open Db
};

// A directory a backup may be made into (a new one each time).
std::string new_backup_dir() {
  static TempDir backups;
  static std::atomic<int> next{0};
  return backups.sub("b" + std::to_string(next.fetch_add(1)));
}

std::vector<SinkCall> sink_calls() {
  static const std::vector<std::uint64_t> kUsers = {9, 10};
  auto status_of = [](auto&& r) { return r.ok() ? Status::OK() : r.status(); };
  return {
      {"leave_community_layer", [](Db& db) { return db.leave_community_layer(9); }, StatusCode::Closed,
       StatusCode::Busy},
      {"rejoin_community_layer", [](Db& db) { return db.rejoin_community_layer(9); }, StatusCode::Closed,
       StatusCode::Busy},
      {"bulk leave", [](Db& db) { return db.leave_community_layer(std::span<const std::uint64_t>(kUsers)); },
       StatusCode::Closed, StatusCode::Busy},
      {"bulk rejoin", [](Db& db) { return db.rejoin_community_layer(std::span<const std::uint64_t>(kUsers)); },
       StatusCode::Closed, StatusCode::Busy},
      {"join_community", [](Db& db) { return db.join_community(9, 3); }, StatusCode::Closed, StatusCode::Busy},
      {"exit_community", [](Db& db) { return db.exit_community(1, 7); }, StatusCode::Closed, StatusCode::Busy},
      {"flush", [](Db& db) { return db.flush(); }, StatusCode::Closed, StatusCode::Busy},
      {"close", [](Db& db) { return db.close(); }, StatusCode::Busy, StatusCode::Busy},
      {"community_layer_history", [=](Db& db) { return status_of(db.community_layer_history(9)); },
       StatusCode::Closed, StatusCode::Ok},
      {"for_each_left", [](Db& db) { return db.for_each_left([](const CommunityMembership&) { return true; }); },
       StatusCode::Closed, StatusCode::Ok},
      {"verify", [=](Db& db) { return status_of(db.verify()); }, StatusCode::Closed, StatusCode::Ok},
      {"community_layer_status", [=](Db& db) { return status_of(db.community_layer_status(9)); },
       StatusCode::Closed, StatusCode::Ok},
      {"gate_activity", [=](Db& db) { return status_of(db.gate_activity(9)); }, StatusCode::Closed,
       StatusCode::Ok},
      {"communities_of", [=](Db& db) { return status_of(db.communities_of(1)); }, StatusCode::Closed,
       StatusCode::Ok},
      {"personal_score", [=](Db& db) { return status_of(db.personal_score(1, 100)); }, StatusCode::Closed,
       StatusCode::Ok},
      {"cohort_score", [=](Db& db) { return status_of(db.cohort_score(5, 100)); }, StatusCode::Closed,
       StatusCode::Ok},
      {"community_score", [=](Db& db) { return status_of(db.community_score(7, 100)); }, StatusCode::Closed,
       StatusCode::Ok},
      // A nested signal of another user (user 9 has no community: no
      // further callback).
      {"signal_with_context", [=](Db& db) { return status_of(db.signal_with_context({9, 101, 1.0}, {{6}})); },
       StatusCode::Closed, StatusCode::Ok},
      {"purge_community_contributions",
       [=](Db& db) { return status_of(db.purge_community_contributions(9)); }, StatusCode::Closed,
       StatusCode::Busy},
      {"bulk purge",
       [=](Db& db) { return status_of(db.purge_community_contributions(std::span<const std::uint64_t>(kUsers))); },
       StatusCode::Closed, StatusCode::Busy},
      {"purge_receipts", [=](Db& db) { return status_of(db.purge_receipts(9)); }, StatusCode::Closed,
       StatusCode::Ok},
      // Re-materialization drains the write buffers, whose grace period
      // would wait for the callback's own signal: Busy, repair or not.
      {"rematerialize_shared_aggregates",
       [=](Db& db) { return status_of(db.rematerialize_shared_aggregates(false)); }, StatusCode::Busy,
       StatusCode::Busy},
      {"rematerialize_shared_aggregates(repair)",
       [=](Db& db) { return status_of(db.rematerialize_shared_aggregates(true)); }, StatusCode::Busy,
       StatusCode::Busy},
      // The change feed, the privacy journal, backup and recovery (the Db
      // keeps a feed and a journal). A backup flushes and wait_journal
      // waits: Busy, as writes (backup never returned: issue 41 item 6).
      {"backup", [](Db& db) { return db.backup(new_backup_dir()); }, StatusCode::Closed, StatusCode::Busy},
      {"read_changes", [=](Db& db) { return status_of(db.read_changes(0, 1 << 20)); }, StatusCode::Closed,
       StatusCode::Ok},
      {"trim_changes", [](Db& db) { return db.trim_changes(0); }, StatusCode::Closed, StatusCode::Busy},
      {"reseed_change_feed", [=](Db& db) { return status_of(db.reseed_change_feed()); }, StatusCode::Closed,
       StatusCode::Busy},
      {"read_journal", [=](Db& db) { return status_of(db.read_journal(0, 1 << 20)); }, StatusCode::Closed,
       StatusCode::Ok},
      {"last_journal_seq", [=](Db& db) { return status_of(db.last_journal_seq()); }, StatusCode::Closed,
       StatusCode::Ok},
      {"wait_journal", [=](Db& db) { return status_of(db.wait_journal(1000, std::chrono::seconds(30))); },
       StatusCode::Closed, StatusCode::Busy},
      {"confirm_journal", [](Db& db) { return db.confirm_journal(0); }, StatusCode::Closed, StatusCode::Busy},
      {"replay_journal", [](Db& db) { return db.replay_journal({}); }, StatusCode::Closed, StatusCode::Busy},
      {"finish_recovery", [](Db& db) { return db.finish_recovery(); }, StatusCode::Closed, StatusCode::Busy},
  };
}

// On its first contribution: tells the test it is inside, optionally waits
// until close() has begun (community_layer_status turns Closed), then makes
// its call.
class CallingSink : public ContributionSink {
 public:
  CallingSink(std::function<Status(Db&)> call, bool wait_for_close)
      : call_(std::move(call)), wait_for_close_(wait_for_close) {}
  void on_contribution(const Contribution&) override {
    if (fired_.exchange(true)) return;
    entered.store(true);
    if (wait_for_close_) {
      while (db.load()->community_layer_status(1).ok()) std::this_thread::yield();
    }
    result = call_(*db.load());
  }
  std::atomic<Db*> db{nullptr};
  std::atomic<bool> entered{false};
  Status result;  // read after the signal returned

 private:
  std::function<Status(Db&)> call_;
  bool wait_for_close_;
  std::atomic<bool> fired_{false};
};

// The options of the sink tests' Dbs: `sink`, a change feed and a privacy
// journal (so that every call of sink_calls() does its work).
Options sink_options(std::shared_ptr<CallingSink> sink) {
  Options options = with_sink(std::move(sink));
  options.change_feed = true;
  options.shard_id = 1;
  options.journal = true;
  return options;
}

// Opens a Db where user 1 is in community 7 and user 9 Active, with `sink`.
std::unique_ptr<Db> open_with(const TempDir& dir, std::shared_ptr<CallingSink> sink) {
  auto db = open_db(dir.path(), sink_options(sink));
  if (db == nullptr) return nullptr;
  EXPECT_OK(db->join_community(1, 7));
  sink->db.store(db.get());
  return db;
}

TEST(LifecycleConcurrentTest, SinkCallsDuringCloseReturnAtOnce) {
  for (const SinkCall& c : sink_calls()) {
    SCOPED_TRACE(c.name);
    TempDir dir;
    auto sink = std::make_shared<CallingSink>(c.call, /*wait_for_close=*/true);
    auto db = open_with(dir, sink);
    ASSERT_NE(db, nullptr);
    Watchdog watchdog(std::string("close() while a sink calls ") + c.name, kHang);
    std::thread signaler([&] { (void)db->signal_with_context({1, 100, 1.0}, {{5}}); });
    while (!sink->entered.load()) std::this_thread::yield();
    EXPECT_OK(db->close());
    signaler.join();
    EXPECT_EQ(sink->result.code(), c.while_closing) << sink->result.to_string();
  }
}

TEST(LifecycleTest, SinkCallsOnAnOpenDbWritesBusyReadsServed) {
  for (const SinkCall& c : sink_calls()) {
    SCOPED_TRACE(c.name);
    TempDir dir;
    auto sink = std::make_shared<CallingSink>(c.call, /*wait_for_close=*/false);
    auto db = open_with(dir, sink);
    ASSERT_NE(db, nullptr);
    Watchdog watchdog(std::string("a sink calling ") + c.name, kHang);
    ASSERT_TRUE(db->signal_with_context({1, 100, 1.0}, {{5}}).ok());
    EXPECT_EQ(sink->result.code(), c.while_open) << sink->result.to_string();
    EXPECT_EQ(db->community_layer_status(9)->status, MembershipStatus::Active);  // no write went through
  }
}

// close() leaves the state engine's compaction statistics of every column
// family in state/LOG (a run's bytes ingested and written per column family,
// which bench/README.md reads write amplification from), not the default
// column family's alone.
TEST(LifecycleTest, CloseLogsTheCompactionStatisticsOfEveryStateColumnFamily) {
  TempDir dir;
  const std::string path = dir.sub("db");
  {
    auto db = Db::open(path);
    ASSERT_TRUE(db.ok()) << db.status().to_string();
    ASSERT_TRUE((*db)->join_community(1, 100).ok());
    ASSERT_TRUE((*db)->signal_with_context({1, 100, 1.0}, {{5}}).ok());
    ASSERT_TRUE((*db)->close().ok());
  }
  std::ifstream in(path + "/state/LOG");
  const std::string log((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::size_t at = log.rfind("tidal: statistics at close");
  ASSERT_NE(at, std::string::npos) << path << "/state/LOG";
  for (const char* cf : {"default", "aggregates", "ledger", "receipts", "sealed_ledger", "sealed_index"}) {
    EXPECT_NE(log.find(std::string("** Compaction Stats [") + cf + "] **", at), std::string::npos) << cf;
  }
}

// Every public call from inside a sink while the write buffers are full:
// the callback's signal holds a read section, the writer has swapped the
// buffers and waits for it, and two other threads have filled the new
// buffer to its bound (they wait for the writer). A call that waited for
// the writer or for a grace period would wait for itself: each must be
// served at once or return Busy.
TEST(LifecycleConcurrentTest, SinkCallsUnderFullWriteBuffersNeverWait) {
  for (const SinkCall& c : sink_calls()) {
    SCOPED_TRACE(c.name);
    TempDir dir;
    auto sink = std::make_shared<CallingSink>(
        [&c](Db& db) {
          std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the others fill the buffers
          return c.call(db);
        },
        /*wait_for_close=*/false);
    Options options = sink_options(sink);
    options.write_buffer_bytes = 8 << 10;  // 32 cells a buffer
    options.aggregate_write_period = std::chrono::milliseconds(5);
    auto db = open_db(dir.path(), options);
    ASSERT_NE(db, nullptr);
    ASSERT_OK(db->join_community(1, 7));
    sink->db.store(db.get());
    std::atomic<bool> stop{false};
    std::atomic<std::uint64_t> others{0};
    std::vector<std::thread> fillers;
    for (std::uint64_t t = 0; t < 2; ++t) {
      fillers.emplace_back([&, t] {
        for (std::uint64_t i = 0; !stop.load(); ++i) {
          if (db->signal_with_context({20 + t, i, 1.0}, {}).ok()) others.fetch_add(1);
        }
      });
    }
    {
      Watchdog watchdog(std::string("a sink calling ") + c.name + " under full write buffers", kHang);
      ASSERT_TRUE(db->signal_with_context({1, 100, 1.0}, {{5}}).ok());
      stop.store(true);
      for (std::thread& t : fillers) t.join();
      const bool nested_signal = std::string(c.name) == "signal_with_context";
      if (nested_signal) {
        // Served when the buffers had room again, else refused at once.
        EXPECT_TRUE(sink->result.ok() || sink->result.code() == StatusCode::Busy) << sink->result.to_string();
      } else {
        EXPECT_EQ(sink->result.code(), c.while_open) << sink->result.to_string();
      }
      EXPECT_GT(others.load(), 0u);
      const std::uint64_t writes = db->stats().aggregate_writes;
      ASSERT_TRUE(db->signal_with_context({30, 1, 1.0}, {}).ok());
      EXPECT_OK(db->flush());  // the writer is not stuck
      EXPECT_GT(db->stats().aggregate_writes, writes);
      EXPECT_OK(db->close());
    }
  }
}

TEST(LifecycleTest, CloseFromForEachLeftCallbackIsBusy) {
  TempDir dir;
  auto db = open_db(dir.path());
  ASSERT_NE(db, nullptr);
  ASSERT_OK(db->leave_community_layer(1));
  Status inner_close, inner_leave;
  {
    Watchdog watchdog("close() from a for_each_left callback", kHang);
    ASSERT_OK(db->for_each_left([&](const CommunityMembership&) {
      inner_close = db->close();
      inner_leave = db->leave_community_layer(2);  // other calls nest fine
      return false;
    }));
  }
  EXPECT_EQ(inner_close.code(), StatusCode::Busy) << inner_close.to_string();
  EXPECT_OK(inner_leave);
  EXPECT_EQ(db->community_layer_status(2)->status, MembershipStatus::Left);
  EXPECT_OK(db->close());
  EXPECT_EQ(db->leave_community_layer(3).code(), StatusCode::Closed);
}

// ---- item 2: close() is not starved ----

TEST(LifecycleConcurrentTest, CloseIsNotStarvedByBusyCallers) {
  TempDir dir;
  auto db = open_db(dir.path());
  ASSERT_NE(db, nullptr);
  std::atomic<bool> close_returned{false};
  std::atomic<int> open_after_close{0};
  std::vector<std::atomic<std::uint64_t>> calls(5);
  auto hammer = [&](std::size_t index, std::function<Status()> call) {
    for (;;) {
      const bool after = close_returned.load();
      const Status s = call();
      calls[index].fetch_add(1);
      if (s.code() == StatusCode::Closed) return;
      if (after) open_after_close.fetch_add(1);
    }
  };
  std::vector<std::thread> threads;
  for (std::uint64_t t = 0; t < 3; ++t) {
    threads.emplace_back(hammer, t, [&db, t, n = std::uint64_t{0}]() mutable {
      const std::uint64_t user = 1000 * t + (n++ / 2) % 50;
      return n % 2 == 1 ? db->leave_community_layer(user) : db->rejoin_community_layer(user);
    });
  }
  threads.emplace_back(hammer, 3, [&db] { return db->flush(); });
  threads.emplace_back(hammer, 4, [&db, i = std::uint64_t{0}]() mutable {
    Result<SignalOutcome> r = db->signal_with_context({i % 3000, i % 64, 1.0}, {{1}});
    ++i;
    return r.ok() ? Status::OK() : r.status();
  });
  // Every caller is running before close() starts.
  for (auto& c : calls) {
    while (c.load() < 5) std::this_thread::yield();
  }
  {
    Watchdog watchdog("close() with 3 leave/rejoin threads, a flusher and a signaler", kHang);
    EXPECT_OK(db->close());
  }
  close_returned.store(true);
  for (auto& t : threads) t.join();
  EXPECT_EQ(open_after_close.load(), 0) << "calls started after close() returned did not return Closed";
  EXPECT_EQ(db->leave_community_layer(1).code(), StatusCode::Closed);
  EXPECT_EQ(db->flush().code(), StatusCode::Closed);
  EXPECT_EQ(db->community_layer_history(1).status().code(), StatusCode::Closed);
  EXPECT_OK(db->close());  // idempotent
}

// ---- item 7: a Db still open at process exit ----

void run_exit_child(const std::string& mode) {
  TempDir dir;
  const std::string path = dir.sub("db");
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    execl(testing::paths::kExitChild, testing::paths::kExitChild, mode.c_str(), path.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the host process was killed by signal " << WTERMSIG(status)
                                 << " at exit with its Db open (" << mode << ")";
  ASSERT_EQ(WEXITSTATUS(status), 0);
  auto db = open_db(path);
  ASSERT_NE(db, nullptr);
  Result<CommunityMembership> m = db->community_layer_status(42);
  ASSERT_OK(m);
  EXPECT_EQ(m->status, MembershipStatus::Left);
  EXPECT_EQ(testing::value_of(db->personal_score(42, 99)), 1.0);  // the aggregates were persisted by the exit-time close
  EXPECT_EQ(testing::value_of(db->cohort_score(1, 99)), 1.0);
}

TEST(ExitTest, DbInGlobalUniquePtr) { run_exit_child("global"); }
TEST(ExitTest, DbInFunctionLocalStatic) { run_exit_child("static"); }
TEST(ExitTest, StdExitFromAnotherThread) { run_exit_child("exit"); }

// ---- item 9: bulk leave and rejoin ----

TEST(BulkTest, LeaveAndRejoinAreExactAndDurable) {
  TempDir dir;
  const std::vector<std::uint64_t> users = range(1, 25'000);  // three batches
  std::uint64_t first_left_at = 0;
  {
    auto db = open_db(dir.path());
    ASSERT_NE(db, nullptr);
    ASSERT_OK(db->leave_community_layer(7));  // already Left: keeps its left_at_ns (G7)
    first_left_at = *db->community_layer_status(7)->left_at_ns;
    std::vector<std::uint64_t> with_duplicates = users;
    with_duplicates.insert(with_duplicates.end(), {5, 5, 24'999, 7});
    std::reverse(with_duplicates.begin(), with_duplicates.end());
    ASSERT_OK(db->leave_community_layer(std::span<const std::uint64_t>(with_duplicates)));
    EXPECT_EQ(db->stats().leaves, 25'000u);  // 1 single + 24,999 new in the bulk call
    EXPECT_EQ(db->stats().users_left, 25'000u);
    ASSERT_OK(db->leave_community_layer(std::span<const std::uint64_t>(users)));  // all Left: a no-op
    EXPECT_EQ(db->stats().leaves, 25'000u);
    ASSERT_OK(db->leave_community_layer(std::span<const std::uint64_t>()));
    const std::vector<std::uint64_t> evens = [] {
      std::vector<std::uint64_t> v;
      for (std::uint64_t u = 2; u <= 25'000; u += 2) v.push_back(u);
      return v;
    }();
    ASSERT_OK(db->rejoin_community_layer(std::span<const std::uint64_t>(evens)));
    ASSERT_OK(db->rejoin_community_layer(std::span<const std::uint64_t>(evens)));  // a no-op
    EXPECT_EQ(db->stats().rejoins, 12'500u);
  }
  auto db = open_db(dir.path());  // everything below is read back after a reopen
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(db->stats().users_left, 12'500u);
  std::vector<std::uint64_t> left_ats;
  for (std::uint64_t u : users) {
    Result<CommunityMembership> m = db->community_layer_status(u);
    ASSERT_OK(m);
    ASSERT_TRUE(m->left_at_ns.has_value()) << "user " << u;
    EXPECT_EQ(m->status, u % 2 == 0 ? MembershipStatus::Active : MembershipStatus::Left) << "user " << u;
    Result<std::vector<MembershipEvent>> h = db->community_layer_history(u);
    ASSERT_OK(h);
    ASSERT_EQ(h->size(), u % 2 == 0 ? 2u : 1u) << "user " << u;
    EXPECT_EQ((*h)[0].status, MembershipStatus::Left);
    EXPECT_EQ((*h)[0].at_ns, *m->left_at_ns) << "user " << u;
    if (u % 2 == 0) {
      EXPECT_EQ((*h)[1].status, MembershipStatus::Active);
      EXPECT_GT((*h)[1].at_ns, (*h)[0].at_ns);
    }
    if (u == 7) {
      EXPECT_EQ(*m->left_at_ns, first_left_at);
    } else {
      left_ats.push_back(*m->left_at_ns);
    }
  }
  // One distinct reading each, all after the earlier single leave.
  std::sort(left_ats.begin(), left_ats.end());
  EXPECT_EQ(std::adjacent_find(left_ats.begin(), left_ats.end()), left_ats.end());
  EXPECT_GT(left_ats.front(), first_left_at);
  Result<VerifyReport> report = db->verify();
  ASSERT_OK(report);
  EXPECT_TRUE(report->ok());
}

// A sink that checks G2 and G3 for the users of one bulk leave.
class BulkWatchSink : public ContributionSink {
 public:
  explicit BulkWatchSink(std::uint64_t users) : last_stamp(users) {}
  void on_contribution(const Contribution& c) override {
    if (c.user_id < listed && returned.load(std::memory_order_acquire)) after_return.fetch_add(1);
    std::atomic<std::uint64_t>& last = last_stamp[c.user_id];
    std::uint64_t seen = last.load();
    while (seen < c.forwarded_at_ns && !last.compare_exchange_weak(seen, c.forwarded_at_ns)) {
    }
    total.fetch_add(1);
  }
  std::uint64_t listed = 0;  // users [0, listed) are in the bulk leave
  std::atomic<bool> returned{false};
  std::atomic<std::uint64_t> after_return{0}, total{0};
  std::vector<std::atomic<std::uint64_t>> last_stamp;
};

TEST(BulkConcurrentTest, NoContributionAfterReturnForAnyListedUser) {
  constexpr std::uint64_t kUsers = 2000;
  TempDir dir;
  auto sink = std::make_shared<BulkWatchSink>(kUsers);
  sink->listed = kUsers / 2;
  auto db = open_db(dir.path(), with_sink(sink));
  ASSERT_NE(db, nullptr);
  std::atomic<bool> stop{false};
  std::vector<std::thread> signalers;
  for (std::uint64_t t = 0; t < 3; ++t) {
    signalers.emplace_back([&, t] {
      for (std::uint64_t i = t; !stop.load(); i += 7) {
        (void)db->signal_with_context({i % kUsers, i, 1.0}, {{1, 2}});
      }
    });
  }
  while (sink->total.load() < 20'000) std::this_thread::yield();
  const std::vector<std::uint64_t> listed = range(0, sink->listed);
  const Status left = db->leave_community_layer(std::span<const std::uint64_t>(listed));
  sink->returned.store(true, std::memory_order_release);
  const std::uint64_t at_return = sink->total.load();
  while (left.ok() && sink->total.load() < at_return + 20'000) std::this_thread::yield();
  stop.store(true);
  for (auto& t : signalers) t.join();  // before any assertion can return: they use this frame
  ASSERT_OK(left);
  EXPECT_EQ(sink->after_return.load(), 0u) << "contributions of listed users reached the sink after the bulk leave";
  for (std::uint64_t u : listed) {
    const std::uint64_t left_at = *db->community_layer_status(u)->left_at_ns;
    EXPECT_LT(sink->last_stamp[u].load(), left_at) << "G3 broken for user " << u;
  }
}

// A storage error part-way: the error names how many users were written;
// those keep their leave, every other listed user stays gated (G6), and the
// same call completes the job after a reopen.
TEST(BulkTest, StorageErrorKeepsEveryListedUserGated) {
  TempDir dir;
  const std::vector<std::uint64_t> users = range(100, 25'000);
  {
    reliability::FaultEnv fault = reliability::FaultEnv::make();
    Result<std::unique_ptr<Db>> opened = Db::Impl::open(dir.path(), {}, fault.env.get());
    ASSERT_OK(opened);
    std::unique_ptr<Db> db = std::move(*opened);
    // A synced batch is one WAL Append and one Sync: the first batch of
    // 10,000 is written, the second fails.
    fault.fs->fail_nth_op(3, /*persistent=*/true);
    Status s = db->leave_community_layer(std::span<const std::uint64_t>(users));
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.message().find("10000 of 25000 users were written before the error"),
              std::string::npos)
        << s.to_string();
    EXPECT_EQ(db->stats().users_left, 25'000u);  // G6: every listed user gated
    for (std::uint64_t u : {std::uint64_t{100}, std::uint64_t{12'000}, std::uint64_t{25'099}}) {
      Result<SignalOutcome> r = db->signal_with_context({u, 1, 1.0}, {{3}});
      ASSERT_OK(r);
      EXPECT_TRUE(r->gated) << "user " << u;
    }
    Status rejoin = db->rejoin_community_layer(std::span<const std::uint64_t>(users));
    EXPECT_FALSE(rejoin.ok());
    EXPECT_EQ(db->stats().users_left, 25'000u);  // a failed rejoin opens no gate
    (void)db->close();
  }
  auto db = open_db(dir.path());
  ASSERT_NE(db, nullptr);
  ASSERT_OK(db->leave_community_layer(std::span<const std::uint64_t>(users)));  // the retry completes it
  EXPECT_EQ(db->stats().users_left, 25'000u);
  EXPECT_EQ(db->community_layer_status(25'099)->status, MembershipStatus::Left);
}

// ---- item 10: a throwing sink ----

class ThrowingSink : public ContributionSink {
 public:
  explicit ThrowingSink(int throw_on) : throw_on_(throw_on) {}
  void on_contribution(const Contribution&) override {
    if (++calls_ == throw_on_) throw std::runtime_error("sink is full");
  }

 private:
  int throw_on_;
  int calls_ = 0;
};

TEST(ThrowingSinkTest, SignalStopsAtTheThrowAndCountsWhatWasApplied) {
  struct Case {
    int throw_on;
    double cohort_a, cohort_b, community;
    std::uint64_t cohort_count, community_count;
  };
  // Contributions in order: cohort 10, cohort 11, community 7.
  for (const Case& c : {Case{1, 1, 0, 0, 1, 0}, Case{3, 1, 1, 1, 2, 1}}) {
    SCOPED_TRACE(c.throw_on);
    TempDir dir;
    auto db = open_db(dir.path(), with_sink(std::make_shared<ThrowingSink>(c.throw_on)));
    ASSERT_NE(db, nullptr);
    ASSERT_OK(db->join_community(1, 7));
    Result<SignalOutcome> r = db->signal_with_context({1, 100, 1.0}, {{10, 11}});
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::IOError);
    EXPECT_NE(r.status().message().find("ContributionSink threw (sink is full)"), std::string::npos)
        << r.status().to_string();
    EXPECT_EQ(testing::value_of(db->personal_score(1, 100)), 1.0);
    EXPECT_EQ(testing::value_of(db->cohort_score(10, 100)), c.cohort_a);
    EXPECT_EQ(testing::value_of(db->cohort_score(11, 100)), c.cohort_b);
    EXPECT_EQ(testing::value_of(db->community_score(7, 100)), c.community);
    const Stats stats = db->stats();
    EXPECT_EQ(stats.signals, 1u);
    EXPECT_EQ(stats.personal_updates, 1u);
    EXPECT_EQ(stats.cohort_attributions, c.cohort_count);
    EXPECT_EQ(stats.community_forwards, c.community_count);
    // The Db stays usable: the next signal goes through in full.
    ASSERT_OK(db->signal_with_context({1, 101, 1.0}, {{10, 11}}));
    EXPECT_EQ(testing::value_of(db->community_score(7, 101)), 1.0);
  }
}

}  // namespace
}  // namespace tidal::testing
