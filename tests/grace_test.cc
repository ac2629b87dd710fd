// Grace periods (src/db/grace.h): per-Db, per-user waits, thread exit,
// allocation and membarrier failures, forced unwinding in a sink (issue 9
// items 8, 11, 12, 14, 15).
#include <pthread.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "db/grace.h"
#include "test_util.h"

namespace tidal {
namespace {

using testing::TempDir;
using testing::open_db;
using testing::with_sink;

// Waits for `flag` for up to 5 s and returns whether it was set. Not a timing
// assertion: a correct run sets the flag far sooner; a false return means the
// other side was blocked (by a grace period that should not have waited).
bool wait_for(const std::atomic<bool>& flag) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!flag.load(std::memory_order_acquire)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

void pause_briefly() { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }

// A sink that runs a test's function.
struct FnSink : ContributionSink {
  std::function<void(const Contribution&)> fn;
  void on_contribution(const Contribution& c) override { fn(c); }
};

// ---- grace::Domain on its own ----

TEST(GraceDomain, SynchronizeDoesNotWaitForSectionsOfOtherUsersOrDomains) {
  grace::Domain domain, other;
  std::atomic<bool> inside{false}, released{false};
  bool held_until_released = false;
  std::thread reader([&] {
    grace::ReadSection section(domain, 5);
    inside = true;
    held_until_released = wait_for(released);
  });
  ASSERT_TRUE(wait_for(inside));
  EXPECT_OK(domain.synchronize(6));
  const std::uint64_t users[] = {6, 7, 8};
  EXPECT_OK(domain.synchronize(users));
  EXPECT_OK(other.synchronize_all());
  released = true;
  reader.join();
  EXPECT_TRUE(held_until_released) << "a grace period waited for a section it need not wait for";
}

TEST(GraceDomain, SynchronizeWaitsForSectionsOfItsUsersNestedOnesAndAll) {
  grace::Domain domain;
  enum Mode { kUser, kSet, kAll, kNestedUser };
  for (Mode mode : {kUser, kSet, kAll, kNestedUser}) {
    std::atomic<bool> inside{false}, done{false};
    std::thread reader([&] {
      grace::ReadSection outer(domain, mode == kNestedUser ? 9 : 5);
      // A nested section for user 5 (a sink signaling another user) makes
      // the slot stand for both users.
      std::unique_ptr<grace::ReadSection> inner;
      if (mode == kNestedUser) inner = std::make_unique<grace::ReadSection>(domain, 5);
      inside = true;
      pause_briefly();
      done = true;
    });
    ASSERT_TRUE(wait_for(inside));
    const std::uint64_t users[] = {1, 5, 1000};
    switch (mode) {
      case kUser: case kNestedUser: EXPECT_OK(domain.synchronize(5)); break;
      case kSet: EXPECT_OK(domain.synchronize(users)); break;
      case kAll: EXPECT_OK(domain.synchronize_all()); break;
    }
    EXPECT_TRUE(done.load()) << "synchronize returned during a section it must wait for (mode " << mode << ")";
    reader.join();
  }
}

// A thread keeps slots in more Domains than it caches, the Domains die in
// another order, the thread exits: nothing of a dead Domain is touched
// (ASan) and the surviving Domain's waits still see the thread.
TEST(GraceDomain, SlotsOfDestroyedDomainsAreNeverTouched) {
  auto survivor = std::make_unique<grace::Domain>();
  for (int round = 0; round < 3; ++round) {
    std::vector<std::unique_ptr<grace::Domain>> domains;
    for (int i = 0; i < 7; ++i) domains.push_back(std::make_unique<grace::Domain>());
    std::thread t([&] {
      for (int k = 0; k < 50; ++k) {
        for (auto& d : domains) grace::ReadSection section(*d, static_cast<std::uint64_t>(k));
        grace::ReadSection section(*survivor, 1);
      }
    });
    t.join();
    for (std::size_t i = 0; i < domains.size(); i += 2) domains[i].reset();
    std::thread u([&] {
      for (auto& d : domains) {
        if (d) grace::ReadSection section(*d, 3);
      }
    });
    u.join();
    EXPECT_OK(survivor->synchronize_all());
  }
  EXPECT_FALSE(grace::in_read_section());
}

// Item 12: the allocation of a thread's first slot fails; nothing changes,
// and the thread's later sections are waited for.
TEST(GraceDomain, BadAllocClaimingTheFirstSlotChangesNothing) {
  grace::Domain domain;
  std::atomic<bool> inside{false}, done{false};
  bool threw = false, in_section_after = true;
  std::thread t([&] {
    grace::testing::fail_next_slot_allocation();
    try {
      grace::ReadSection section(domain, 5);
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    in_section_after = grace::in_read_section();
    grace::ReadSection section(domain, 5);
    inside = true;
    pause_briefly();
    done = true;
  });
  ASSERT_TRUE(wait_for(inside));
  EXPECT_OK(domain.synchronize(5));
  EXPECT_TRUE(done.load()) << "a section after the failed claim was not waited for";
  t.join();
  EXPECT_TRUE(threw);
  EXPECT_FALSE(in_section_after) << "the failed claim left the thread inside a section";
}

// ---- through the Db ----

class GraceDb : public ::testing::Test {
 protected:
  void SetUp() override {
    sink_ = std::make_shared<FnSink>();
    sink_->fn = [](const Contribution&) {};
    Options options = with_sink(sink_);
    options.sync_writes = false;
    db_ = open_db(dir_.path(), options);
    ASSERT_NE(db_, nullptr);
    for (std::uint64_t u = 1; u <= 4; ++u) ASSERT_OK(db_->join_community(u, 100));
  }
  Result<SignalOutcome> signal(std::uint64_t user) { return db_->signal_with_context({user, 1, 1.0}, {{7}}); }

  TempDir dir_;
  std::shared_ptr<FnSink> sink_;
  std::unique_ptr<Db> db_;
};

// Item 8: a sink stuck on user 1 delays neither a leave of user 2 on the same
// Db nor a leave on another Db.
TEST_F(GraceDb, LeaveDoesNotWaitForAnotherUsersOrAnotherDbsSink) {
  TempDir other_dir;
  auto other = open_db(other_dir.path());
  ASSERT_NE(other, nullptr);
  std::atomic<bool> in_sink{false}, released{false};
  bool held_until_released = false;
  sink_->fn = [&](const Contribution& c) {
    if (c.user_id != 1 || in_sink.exchange(true)) return;
    held_until_released = wait_for(released);
  };
  std::thread t([&] { EXPECT_OK(signal(1)); });
  ASSERT_TRUE(wait_for(in_sink));
  EXPECT_OK(db_->leave_community_layer(2));
  EXPECT_OK(other->leave_community_layer(2));
  released = true;
  t.join();
  EXPECT_TRUE(held_until_released) << "a leave waited for a sink of another user or Db";
}

// G2 through a nested signal: a sink of user 1 signals user 2; a leave of
// user 2 waits for that nested signal.
TEST_F(GraceDb, LeaveWaitsForANestedSignalOfItsUser) {
  std::atomic<bool> in_nested{false}, nested_done{false}, left{false};
  std::atomic<int> after_leave{0};
  sink_->fn = [&](const Contribution& c) {
    if (c.user_id == 2 && left.load()) after_leave.fetch_add(1);
    if (c.user_id == 1 && c.target == ContributionTarget::Cohort) {
      EXPECT_OK(signal(2));
    } else if (c.user_id == 2 && c.target == ContributionTarget::Cohort) {
      in_nested = true;
      pause_briefly();
      nested_done = true;
    }
  };
  std::thread t([&] { EXPECT_OK(signal(1)); });
  ASSERT_TRUE(wait_for(in_nested));
  ASSERT_OK(db_->leave_community_layer(2));
  left = true;
  EXPECT_TRUE(nested_done.load()) << "leave returned while a nested signal of its user ran";
  t.join();
  EXPECT_EQ(after_leave.load(), 0) << "contributions after leave returned (G2)";
}

// Item 11: a host thread_local, constructed before the thread's first signal
// (so destroyed after tidal's own thread state would be), signals from its
// destructor while a leave of the same user runs and another thread
// signals. No contribution may arrive after the leave returned.
constexpr std::uint64_t kExitUser = 3;
thread_local bool t_on_exiting_thread = false;
thread_local bool t_on_helper_thread = false;
struct SignalAtThreadExit {
  Db* db = nullptr;
  ~SignalAtThreadExit() {
    if (db == nullptr) return;
    t_on_exiting_thread = true;
    EXPECT_OK(db->signal_with_context({kExitUser, 1, 1.0}, {{7}}));
  }
};
thread_local SignalAtThreadExit t_signal_at_exit;

TEST_F(GraceDb, SignalsFromAHostThreadLocalDestructorAreCovered) {
  std::atomic<bool> exiting_in_sink{false}, helper_inside{false}, leave_returned{false}, left{false};
  std::atomic<bool> waits_ok{true};
  std::atomic<int> after_leave{0};
  sink_->fn = [&](const Contribution& c) {
    if (c.user_id == kExitUser && left.load()) after_leave.fetch_add(1);
    if (t_on_exiting_thread && c.target == ContributionTarget::Cohort) {
      exiting_in_sink = true;
      if (!wait_for(helper_inside)) waits_ok = false;
      pause_briefly();  // the Community contribution follows, after a leave that did not wait
    } else if (t_on_helper_thread && c.target == ContributionTarget::Cohort) {
      helper_inside = true;
      if (!wait_for(leave_returned)) waits_ok = false;
    }
  };
  std::thread exiting([&] {
    t_signal_at_exit.db = db_.get();  // constructed before the first signal
    EXPECT_OK(signal(4));
  });
  ASSERT_TRUE(wait_for(exiting_in_sink));
  std::thread helper([&] {
    t_on_helper_thread = true;
    EXPECT_OK(signal(4));
  });
  ASSERT_TRUE(wait_for(helper_inside));
  ASSERT_OK(db_->leave_community_layer(kExitUser));
  left = true;
  leave_returned = true;
  exiting.join();
  helper.join();
  EXPECT_TRUE(waits_ok.load());
  EXPECT_EQ(after_leave.load(), 0) << "a signal from a thread_local destructor escaped the grace period (G2)";
}

// Item 12 through the Db: the failed signal is an IOError, and the thread
// can still write (not Busy) and signal.
TEST_F(GraceDb, BadAllocOnTheFirstSignalLeavesTheThreadUsable) {
  std::thread t([&] {
    grace::testing::fail_next_slot_allocation();
    auto failed = signal(1);
    ASSERT_FALSE(failed.ok());
    EXPECT_EQ(failed.status().code(), StatusCode::IOError) << failed.status().to_string();
    EXPECT_FALSE(grace::in_read_section());
    EXPECT_OK(db_->join_community(1, 101));
    EXPECT_OK(signal(1));
    EXPECT_OK(db_->leave_community_layer(1));
  });
  t.join();
}

// Item 14: a failed membarrier fails the leave closed (gate stays closed,
// IOError naming membarrier); a retry succeeds. A close reports it too.
TEST_F(GraceDb, MembarrierFailureFailsTheLeaveClosed) {
  if (!grace::init()) GTEST_SKIP() << "membarrier is unavailable here; readers use fences instead";
  grace::testing::fail_membarrier(1, EPERM);
  Status s = db_->leave_community_layer(1);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::IOError);
  EXPECT_NE(s.message().find("membarrier"), std::string::npos) << s.to_string();
  auto out = signal(1);
  ASSERT_OK(out);
  EXPECT_TRUE(out->gated) << "the gate reopened after a failed grace period";
  ASSERT_OK(db_->leave_community_layer(1));
  auto status = db_->community_layer_status(1);
  ASSERT_OK(status);
  EXPECT_EQ(status->status, MembershipStatus::Left);

  grace::testing::fail_membarrier(1, ENOSYS);
  Status closed = db_->close();
  EXPECT_EQ(closed.code(), StatusCode::IOError);
  EXPECT_NE(closed.message().find("membarrier"), std::string::npos) << closed.to_string();
  EXPECT_EQ(signal(2).status().code(), StatusCode::Closed);
}

// Item 15: pthread_exit inside a sink ends that thread only; its section
// ends with it, so a later leave of its user is not blocked.
TEST_F(GraceDb, PthreadExitInASinkEndsOnlyThatThread) {
  thread_local bool exit_here = false;
  sink_->fn = [](const Contribution&) {
    if (exit_here) pthread_exit(nullptr);
  };
  std::atomic<bool> returned{false};
  std::thread t([&] {
    exit_here = true;
    (void)signal(1);
    returned = true;
  });
  t.join();
  EXPECT_FALSE(returned.load());
  EXPECT_FALSE(grace::in_read_section());
  ASSERT_OK(db_->leave_community_layer(1));
  ASSERT_OK(signal(2));
  ASSERT_OK(db_->close());
}

}  // namespace
}  // namespace tidal
