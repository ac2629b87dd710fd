// The Db clock (issue 9 items 5, 6, 13): strictly increasing, never wrapping
// at the top of its range, and leased so that a stamp handed out stays below
// every later time after a crash. The crash itself is in crash_test.cc.
#include "db/clock.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "db/impl.h"
#include "fault_fs.h"
#include "storage/format.h"
#include "storage/storage.h"
#include "test_util.h"
#include "tidal/db.h"

namespace tidal {
namespace {

using testing::open_db;
using testing::RecordingSink;
using testing::TempDir;
using testing::with_sink;

constexpr std::uint64_t kU64Max = std::numeric_limits<std::uint64_t>::max();
constexpr std::uint64_t kT0 = 1'700'000'000'000'000'000ULL;  // 2023-11-14

bool mentions(const Status& s, const std::string& text) { return s.message().find(text) != std::string::npos; }

// The floors a Clock stored, in the order it stored them.
struct FloorLog {
  std::mutex mu;
  std::vector<std::uint64_t> floors;
  Status next_error;  // returned (and not stored) by the next store when not OK

  Clock::StoreFloor store() {
    return [this](std::uint64_t floor) {
      std::lock_guard<std::mutex> lock(mu);
      if (!next_error.ok()) return std::exchange(next_error, Status::OK());
      floors.push_back(floor);
      return Status::OK();
    };
  }
  std::uint64_t stored() {
    std::lock_guard<std::mutex> lock(mu);
    return floors.empty() ? 0 : floors.back();
  }
};

// ---- Clock ----

TEST(Clock, ReadingsIncreaseStrictlyWhenTheWallClockStandsStillOrStepsBack) {
  std::uint64_t wall = 1000;
  Clock clock([&] { return wall; }, nullptr);
  EXPECT_EQ(*clock.now(), 1000u);
  EXPECT_EQ(*clock.now(), 1001u);  // stands still
  wall = 10;
  EXPECT_EQ(*clock.now(), 1002u);  // steps back
  wall = 5000;
  EXPECT_EQ(*clock.now(), 5000u);
  clock.start_above(9000);
  EXPECT_EQ(*clock.now(), 9001u);
}

TEST(Clock, RefusesAReadingAboveTheLimitWithoutMoving) {
  std::uint64_t wall = kU64Max;
  Clock clock([&] { return wall; }, nullptr);
  Result<std::uint64_t> r = clock.now();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::InvalidArgument);
  EXPECT_TRUE(mentions(r.status(), "Db clock")) << r.status().to_string();
  EXPECT_TRUE(mentions(r.status(), std::to_string(kU64Max))) << r.status().to_string();
  EXPECT_EQ(clock.last(), 0u);
  wall = Clock::kMaxTimestamp + 1;
  EXPECT_FALSE(clock.now().ok());
  wall = 0;
  EXPECT_EQ(*clock.now(), 1u);  // never 0: a left_at_ns of 0 means none
}

TEST(Clock, IsExhaustedAtTheLimitInsteadOfWrapping) {
  Clock clock([] { return Clock::kMaxTimestamp - 1; }, nullptr);
  EXPECT_EQ(*clock.now(), Clock::kMaxTimestamp - 1);
  EXPECT_EQ(*clock.now(), Clock::kMaxTimestamp);
  for (int i = 0; i < 3; ++i) {
    Result<std::uint64_t> r = clock.now();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::InvalidArgument);
    EXPECT_TRUE(mentions(r.status(), "exhausted")) << r.status().to_string();
    EXPECT_TRUE(mentions(r.status(), std::to_string(Clock::kMaxTimestamp))) << r.status().to_string();
  }
  EXPECT_EQ(clock.last(), Clock::kMaxTimestamp);
}

TEST(Clock, AStoredFloorBeyondTheLimitExhaustsIt) {
  Clock clock([] { return kT0; }, nullptr);
  clock.start_above(kU64Max - 5);
  Result<std::uint64_t> r = clock.now();
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(mentions(r.status(), std::to_string(kU64Max - 5))) << r.status().to_string();
  EXPECT_FALSE(clock.leased_now().ok());
}

// ---- the lease ----

TEST(ClockLease, EveryLeasedTimeIsAtOrBelowTheStoredFloor) {
  FloorLog log;
  std::uint64_t wall = kT0;
  Clock clock([&] { return wall; }, log.store());
  clock.start_above(kT0 - 1);
  // 10 s of clock at one reading per 100 us.
  constexpr std::uint64_t kStep = 100'000, kSeconds = 10;
  for (std::uint64_t i = 0; i < kSeconds * 1'000'000'000 / kStep; ++i, wall += kStep) {
    Result<std::uint64_t> t = clock.leased_now();
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    ASSERT_LE(*t, log.stored()) << "reading " << i;
  }
  // Rare: one renewal per (margin - renew-ahead) of clock time, plus the first.
  const std::uint64_t bound = kSeconds * 1'000'000'000 / (Clock::kLeaseMargin - Clock::kRenewAhead) + 1;
  EXPECT_LE(clock.lease_renewals(), bound);
  EXPECT_EQ(clock.lease_renewals(), log.floors.size());
  std::cout << "lease renewals over " << kSeconds << " s of readings: " << clock.lease_renewals() << "\n";
}

TEST(ClockLease, AFailedRenewalHandsOutNoTimeBeyondTheFloor) {
  FloorLog log;
  std::uint64_t wall = kT0;
  Clock clock([&] { return wall; }, log.store());
  clock.start_above(kT0 - 1);
  log.next_error = Status::IOError("disk full");
  Result<std::uint64_t> t = clock.leased_now();
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::IOError);
  EXPECT_TRUE(log.floors.empty());
  ASSERT_OK(clock.leased_now());  // the next reading renews
  ASSERT_EQ(log.floors.size(), 1u);

  // Inside the renew-ahead window the time is already covered: a failed
  // early renewal still hands it out, and a later reading retries.
  const std::uint64_t lease = log.stored();
  wall = lease - Clock::kRenewAhead / 2;
  log.next_error = Status::IOError("disk full");
  t = clock.leased_now();
  ASSERT_OK(t);
  EXPECT_LE(*t, lease);
  EXPECT_EQ(log.floors.size(), 1u);
  ASSERT_OK(clock.leased_now());
  EXPECT_EQ(log.floors.size(), 2u);
  EXPECT_GT(log.stored(), lease);
}

// With start_renewing() (as a Db with a ContributionSink runs it), a
// reading inside the renew-ahead window is not the one that writes the new
// floor: it returns while that write is held up (an fsync on a busy disk),
// and the clock's thread stores the floor. A reading past the lease still
// renews itself. Inline, the reading that renewed waited for the write.
TEST(ClockLease, AnEarlyRenewalIsNotWrittenByTheReadingThatAsksForIt) {
  FloorLog log;
  std::atomic<std::uint64_t> wall{kT0};
  std::mutex held_mu;
  std::condition_variable held_cv;
  bool hold = false, holding = false;  // guarded by held_mu
  Clock::StoreFloor store = log.store();
  Clock clock([&] { return wall.load(); },
              [&](std::uint64_t floor) {
                std::unique_lock<std::mutex> lock(held_mu);
                if (hold) {
                  holding = true;
                  held_cv.notify_all();
                  held_cv.wait(lock, [&] { return !hold; });
                  holding = false;
                }
                lock.unlock();
                return store(floor);
              });
  clock.start_above(kT0 - 1);
  clock.start_renewing();
  ASSERT_OK(clock.leased_now());  // past the lease: renews itself
  ASSERT_EQ(log.floors.size(), 1u);
  const std::uint64_t lease = log.stored();

  {
    std::lock_guard<std::mutex> lock(held_mu);
    hold = true;
  }
  wall = lease - Clock::kRenewAhead / 2;
  auto reading = std::async(std::launch::async, [&] { return clock.leased_now(); });
  ASSERT_EQ(reading.wait_for(std::chrono::seconds(30)), std::future_status::ready)
      << "the reading in the renew-ahead window waited for the renewal's write";
  Result<std::uint64_t> t = reading.get();
  ASSERT_OK(t);
  EXPECT_LE(*t, lease);
  {
    // The clock's thread is the one writing the floor.
    std::unique_lock<std::mutex> lock(held_mu);
    ASSERT_TRUE(held_cv.wait_for(lock, std::chrono::seconds(30), [&] { return holding; }))
        << "no renewal was started after a reading in the renew-ahead window";
    hold = false;
  }
  held_cv.notify_all();
  for (int i = 0; i < 30'000 && log.stored() == lease; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_GT(log.stored(), lease);
  EXPECT_EQ(log.floors.size(), 2u);
  clock.stop_renewing();
}

TEST(ClockLease, ConcurrentRenewalsNeverLowerTheStoredFloor) {
  FloorLog log;
  std::atomic<std::uint64_t> wall{kT0};
  std::atomic<std::uint64_t> lowered{0}, uncovered{0};
  std::uint64_t previous = 0;
  // Every reading jumps a third of a margin, so renewals are frequent and
  // race; the store checks that each floor exceeds the one before.
  Clock clock([&] { return wall.fetch_add(Clock::kLeaseMargin / 3); },
              [&](std::uint64_t floor) {
                std::this_thread::sleep_for(std::chrono::microseconds(5));  // widen the race window
                std::lock_guard<std::mutex> lock(log.mu);
                if (floor <= previous) lowered.fetch_add(1);
                previous = floor;
                log.floors.push_back(floor);
                return Status::OK();
              });
  clock.start_above(kT0 - 1);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&] {
      for (int n = 0; n < 3000; ++n) {
        Result<std::uint64_t> t = clock.leased_now();
        if (!t.ok() || *t > log.stored()) uncovered.fetch_add(1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(lowered.load(), 0u);
  EXPECT_EQ(uncovered.load(), 0u);
  EXPECT_GT(log.floors.size(), 100u);
}

TEST(ClockLease, ReleaseStoresTheLastTimeOnlyWhenTheLeaseReachesBeyondIt) {
  FloorLog log;
  Clock clock([] { return kT0; }, log.store());
  clock.start_above(kT0 - 1);
  ASSERT_OK(clock.release_lease());
  EXPECT_TRUE(log.floors.empty());  // nothing leased: nothing to release
  ASSERT_OK(clock.leased_now());
  ASSERT_OK(clock.leased_now());
  ASSERT_EQ(log.floors.size(), 1u);
  EXPECT_EQ(log.stored(), kT0 + Clock::kLeaseMargin);
  ASSERT_OK(clock.release_lease());
  EXPECT_EQ(log.stored(), kT0 + 1);  // the last time handed out
  ASSERT_OK(clock.release_lease());
  EXPECT_EQ(log.floors.size(), 2u);
}

// ---- through a Db (Options::clock) ----

// A signal of `user` attributed to cohort 42.
Result<SignalOutcome> cohort_signal(Db& db, std::uint64_t user) {
  return db.signal_with_context({user, 7, 1.0}, SignalContext{{42}});
}

TEST(DbClock, ReadingsIncreaseStrictlyEvenWhenTheWallClockStepsBack) {
  TempDir dir;
  std::atomic<std::uint64_t> wall{1'000'000};
  Options options;
  options.clock = [&] { return wall.load(); };
  std::uint64_t first_leave = 0;
  {
    auto db = open_db(dir.path(), options);
    ASSERT_OK(db->leave_community_layer(1));
    first_leave = *db->community_layer_status(1)->left_at_ns;
    EXPECT_EQ(first_leave, 1'000'000u);
    wall = 10;  // the wall clock steps back
    ASSERT_OK(db->leave_community_layer(2));
    EXPECT_GT(*db->community_layer_status(2)->left_at_ns, first_leave);
    ASSERT_OK(db->close());
  }
  // After a reopen the clock never goes below what is stored.
  auto db = open_db(dir.path(), options);
  ASSERT_OK(db->leave_community_layer(3));
  EXPECT_GT(*db->community_layer_status(3)->left_at_ns, first_leave + 1);
}

// Item 5, first reproduction: a wall clock stuck at UINT64_MAX used to give
// a contribution and the next leave the same time, and a leave, rejoin and
// leave one history entry. Now the clock refuses the reading: the calls
// fail, nothing is forwarded or written, and the failed leave's gate stays
// closed (G6).
TEST(DbClock, AWallClockStuckAtTheMaximumFailsInsteadOfRepeatingATime) {
  TempDir dir;
  auto sink = std::make_shared<RecordingSink>();
  Options options = with_sink(sink);
  options.clock = [] { return kU64Max; };
  auto db = open_db(dir.path(), options);
  ASSERT_OK(db->join_community(1, 10));

  Result<SignalOutcome> out = cohort_signal(*db, 1);
  ASSERT_FALSE(out.ok()) << "a signal whose contributions cannot be stamped was applied";
  EXPECT_EQ(out.status().code(), StatusCode::InvalidArgument);
  EXPECT_TRUE(mentions(out.status(), "clock") && mentions(out.status(), std::to_string(kU64Max)))
      << out.status().to_string();
  EXPECT_TRUE(sink->seen.empty());
  EXPECT_EQ(testing::value_of(db->personal_score(1, 7)), 0.0);  // nothing applied
  EXPECT_EQ(testing::value_of(db->cohort_score(42, 7)), 0.0);
  EXPECT_EQ(db->stats().signals, 0u);

  for (int i = 0; i < 2; ++i) {
    Status s = db->leave_community_layer(1);
    EXPECT_EQ(s.code(), StatusCode::InvalidArgument) << s.to_string();
    EXPECT_TRUE(mentions(s, "leave_community_layer(user 1)") && mentions(s, "clock")) << s.to_string();
    s = db->rejoin_community_layer(1);
    EXPECT_EQ(s.code(), StatusCode::InvalidArgument) << s.to_string();
  }
  EXPECT_TRUE(db->community_layer_history(1)->empty());
  EXPECT_EQ(db->community_layer_status(1)->status, MembershipStatus::Active);  // nothing written
  out = cohort_signal(*db, 1);  // the gate stayed closed: held back, no stamp needed
  ASSERT_OK(out);
  EXPECT_TRUE(out->gated);
  EXPECT_TRUE(sink->seen.empty());
  EXPECT_EQ(db->gate_activity(1)->held_back_signals, 1u);
  EXPECT_FALSE(db->gate_activity(1)->last_held_back_ns.has_value());
}

// A clock that reached the limit, then reopened: every call that needs a
// new time fails, however many times it is retried.
TEST(DbClock, AClockAtTheLimitIsExhaustedAcrossAReopen) {
  TempDir dir;
  auto sink = std::make_shared<RecordingSink>();
  Options options = with_sink(sink);
  options.clock = [] { return Clock::kMaxTimestamp; };
  {
    auto db = open_db(dir.path(), options);
    ASSERT_OK(db->leave_community_layer(1));
    EXPECT_EQ(*db->community_layer_status(1)->left_at_ns, Clock::kMaxTimestamp);
    Status s = db->rejoin_community_layer(1);
    EXPECT_TRUE(mentions(s, "exhausted")) << s.to_string();
    EXPECT_FALSE(cohort_signal(*db, 2).ok());
    ASSERT_OK(db->close());
  }
  auto db = open_db(dir.path(), options);
  Status s = db->leave_community_layer(3);
  EXPECT_TRUE(mentions(s, "exhausted")) << s.to_string();
  EXPECT_EQ(db->community_layer_history(1)->size(), 1u);
  EXPECT_TRUE(sink->seen.empty());
}

// Item 5, second reproduction: a reading of UINT64_MAX then 0 used to store
// left_at_ns 0 ("none"), and the Db no longer opened.
TEST(DbClock, AReadingOfTheMaximumThenZeroNeverStoresLeftAtZero) {
  TempDir dir;
  std::atomic<std::uint64_t> wall{kU64Max};
  Options options;
  options.clock = [&] { return wall.exchange(0); };  // the maximum once, then 0
  {
    auto db = open_db(dir.path(), options);
    Status s = db->leave_community_layer(1);
    EXPECT_EQ(s.code(), StatusCode::InvalidArgument) << s.to_string();
    ASSERT_OK(db->leave_community_layer(2));
    ASSERT_OK(db->leave_community_layer(1));  // the retry writes
    const std::uint64_t left2 = *db->community_layer_status(2)->left_at_ns;
    const std::uint64_t left1 = *db->community_layer_status(1)->left_at_ns;
    EXPECT_GT(left2, 0u);
    EXPECT_GT(left1, left2);
    ASSERT_OK(db->close());
  }
  Result<std::unique_ptr<Db>> db = Db::open(dir.path(), options);
  ASSERT_OK(db);
  for (std::uint64_t user : {1u, 2u}) {
    Result<CommunityMembership> m = (*db)->community_layer_status(user);
    ASSERT_OK(m);
    EXPECT_EQ(m->status, MembershipStatus::Left);
    ASSERT_TRUE(m->left_at_ns.has_value());
    EXPECT_GT(*m->left_at_ns, 0u);
  }
  ASSERT_OK((*db)->leave_community_layer(3));
  EXPECT_GT(*(*db)->community_layer_status(3)->left_at_ns, *(*db)->community_layer_status(1)->left_at_ns);
}

// Writes a clock floor record directly, as a Db written by an older version
// (whose clock wrapped) may hold.
void store_floor_record(const std::string& path, std::uint64_t floor) {
  Result<std::unique_ptr<Storage>> st = Storage::open(path, Storage::Config{});
  ASSERT_OK(st);
  std::string value;
  put_u64_le(&value, floor);
  rocksdb::WriteBatch batch;
  batch.Put((*st)->meta(), "clock_floor/flush", value);
  ASSERT_OK((*st)->write(Storage::Engine::Users, &batch, Storage::WriteMode::Sync, "test floor"));
  ASSERT_OK((*st)->close());
}

// Item 5, third reproduction: a stored time of UINT64_MAX - 5 became a floor
// whose sixth successor wrapped to 0, so a new leave sorted below earlier
// times. Now the Db still opens (G5: every status is restored), and every
// call that needs a new time fails.
TEST(DbClock, AStoredTimeNearTheMaximumNeverWrapsAfterReopen) {
  TempDir dir;
  auto sink = std::make_shared<RecordingSink>();
  Options options = with_sink(sink);
  options.clock = [] { return kT0; };
  {
    auto db = open_db(dir.path(), options);
    ASSERT_OK(db->leave_community_layer(100));
    ASSERT_OK(db->close());
  }
  store_floor_record(dir.path(), kU64Max - 5);
  auto db = open_db(dir.path(), options);
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(db->community_layer_status(100)->status, MembershipStatus::Left);
  for (std::uint64_t user = 1; user <= 10; ++user) {
    Status s = db->leave_community_layer(user);
    if (s.ok()) {
      EXPECT_GT(*db->community_layer_status(user)->left_at_ns, kU64Max - 5) << "user " << user;
    } else {
      EXPECT_EQ(s.code(), StatusCode::InvalidArgument) << s.to_string();
      EXPECT_TRUE(mentions(s, "exhausted") && mentions(s, std::to_string(kU64Max - 5))) << s.to_string();
    }
  }
  EXPECT_FALSE(cohort_signal(*db, 50).ok());
  EXPECT_TRUE(sink->seen.empty());
  ASSERT_OK(db->close());
  EXPECT_OK(Db::open(dir.path(), options));
}

// A clean close releases the lease: reopening does not start a margin ahead
// of the wall clock (no drift over open/close cycles).
TEST(DbClock, ACleanCloseReleasesTheLease) {
  TempDir dir;
  auto sink = std::make_shared<RecordingSink>();
  Options options = with_sink(sink);
  std::atomic<std::uint64_t> wall{kT0};
  options.clock = [&] { return wall.load(); };
  for (int cycle = 0; cycle < 5; ++cycle) {
    auto db = open_db(dir.path(), options);
    ASSERT_OK(cohort_signal(*db, 1));
    ASSERT_OK(db->close());
    wall += 10;
  }
  auto db = open_db(dir.path(), options);
  ASSERT_OK(db->leave_community_layer(2));
  const std::uint64_t left_at = *db->community_layer_status(2)->left_at_ns;
  EXPECT_EQ(left_at, wall.load());
  for (const Contribution& c : sink->seen) EXPECT_LT(c.forwarded_at_ns, left_at);
}

// Stamps are leased through the Db: after a flush-less, close-less end (the
// stored state is what a crash leaves; see crash_test.cc for a real one),
// the lease record already covers every stamp handed out.
TEST(DbClock, TheStoredLeaseCoversEveryStampHandedOut) {
  TempDir dir;
  auto sink = std::make_shared<RecordingSink>();
  Options options = with_sink(sink);
  std::atomic<std::uint64_t> wall{kT0};
  options.clock = [&] { return wall.fetch_add(Clock::kLeaseMargin / 7); };
  auto db = open_db(dir.path(), options);
  ASSERT_OK(db->join_community(1, 10));
  for (int i = 0; i < 100; ++i) ASSERT_OK(cohort_signal(*db, 1));
  // Read the lease record while the Db is open (a second, read-only handle
  // on the RocksDB files sees the WAL).
  std::uint64_t lease = 0;
  {
    Storage::Config config;
    config.read_only = true;
    Result<std::unique_ptr<Storage>> st = Storage::open(dir.path(), config);
    ASSERT_OK(st);
    std::string value;
    ASSERT_OK((*st)->get((*st)->meta(), kClockLeaseKey, &value));
    ASSERT_EQ(value.size(), 8u);
    lease = get_u64_le(value.data());
  }
  ASSERT_EQ(sink->seen.size(), 200u);
  for (const Contribution& c : sink->seen) EXPECT_LE(c.forwarded_at_ns, lease);
}

// A lease that cannot be stored fails the signal whole: no stamp is handed
// out, nothing is applied.
TEST(DbClock, ASignalWhoseLeaseCannotBeStoredFailsWithNothingApplied) {
  TempDir dir;
  auto sink = std::make_shared<RecordingSink>();
  reliability::FaultEnv fault = reliability::FaultEnv::make();
  Result<std::unique_ptr<Db>> db = Db::Impl::open(dir.path(), with_sink(sink), fault.env.get());
  ASSERT_OK(db);
  fault.fs->set_fail_wal_append(true);
  Result<SignalOutcome> out = cohort_signal(**db, 1);
  fault.fs->clear_faults();
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), StatusCode::IOError) << out.status().to_string();
  EXPECT_TRUE(mentions(out.status(), "clock lease")) << out.status().to_string();
  EXPECT_TRUE(sink->seen.empty());
  EXPECT_EQ(testing::value_of((*db)->personal_score(1, 7)), 0.0);
  EXPECT_EQ(testing::value_of((*db)->cohort_score(42, 7)), 0.0);
  EXPECT_EQ((*db)->stats().signals, 0u);
}

// Counts contributions without keeping them.
class CountingSink : public ContributionSink {
 public:
  void on_contribution(const Contribution&) override { seen.fetch_add(1, std::memory_order_relaxed); }
  std::atomic<std::uint64_t> seen{0};
};

// The figure for tests/RELIABILITY.md: lease writes per second of signaling
// with the system clock. The state store's writer does not run (its period
// is an hour, its buffers far from full), so signals write nothing else and
// every file operation of the Db during the run (a WAL Append and Sync per
// synced write) belongs to a lease renewal.
TEST(DbClock, LeaseWritesPerSecondOfSignaling) {
  TempDir dir;
  reliability::FaultEnv fault = reliability::FaultEnv::make();
  Options options = with_sink(std::make_shared<CountingSink>());
  options.aggregate_write_period = std::chrono::hours(1);
  Result<std::unique_ptr<Db>> db = Db::Impl::open(dir.path(), options, fault.env.get());
  ASSERT_OK(db);
  ASSERT_OK((*db)->join_community(1, 10));
  ASSERT_OK((*db)->join_community(2, 10));
  fault.fs->clear_faults();  // starts the operation count
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> signals{0}, failures{0};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (std::uint64_t user : {1u, 2u}) {
    threads.emplace_back([&, user] {
      std::uint64_t n = 0;
      for (; !stop.load(std::memory_order_relaxed); ++n) {
        // No cohort: the sink stays small; the community contribution is stamped.
        if (!(*db)->signal_with_context({user, n % 64, 1.0}, {}).ok()) failures.fetch_add(1);
      }
      signals.fetch_add(n);
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  stop = true;
  for (auto& t : threads) t.join();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::uint64_t ops = fault.fs->ops_since_arm();
  EXPECT_EQ(failures.load(), 0u);
  // At most one renewal per (margin - renew-ahead) of wall time, plus the first.
  const double bound = seconds * 1e9 / static_cast<double>(Clock::kLeaseMargin - Clock::kRenewAhead) + 1;
  EXPECT_LE(static_cast<double>(ops) / 2, bound + 1) << ops << " file operations in " << seconds << " s";
  std::cout << "[lease] " << signals.load() << " signals on 2 threads in " << seconds << " s; file operations: " << ops
            << " (lease writes: " << ops / 2 << ", " << static_cast<double>(ops) / 2 / seconds << "/s)\n";
}

}  // namespace
}  // namespace tidal
