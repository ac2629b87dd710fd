// Leave & stop-forward: guarantees G2-G7 of docs/CONTRACT.md, start-up, verify.
// (G1 crash and G6 I/O-fault tests live in the reliability tests.)
#include <atomic>
#include <mutex>
#include <random>
#include <thread>

#include "db/impl.h"
#include "storage/format.h"
#include "storage/storage.h"
#include "test_util.h"

namespace tidal {
namespace {

using testing::TempDir;
using testing::open_db;
using testing::RecordingSink;
using testing::with_sink;
using testing::value_of;

// Writes raw bytes into a closed Db's partitions, as a corrupted disk would.
class RawDb {
 public:
  explicit RawDb(const std::string& path) {
    auto s = Storage::open(path, Storage::Config{});
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    storage_ = std::move(*s);
  }
  // A 0x11 record in the users partition and its index copy.
  void put_leave_record(std::uint64_t user, std::string_view value) {
    rocksdb::WriteBatch batch;
    storage_->put_record(&batch, EntityId(user), Tag::CommunityLeave, {}, value);
    ASSERT_TRUE(storage_->db(Storage::Engine::Users)->Write({}, &batch).ok());
  }
  void put(rocksdb::ColumnFamilyHandle* cf, const std::string& key, std::string_view value) {
    ASSERT_TRUE(storage_->db(Storage::Engine::Users)->Put({}, cf, key, rocksdb::Slice(value.data(), value.size())).ok());
  }
  void drop_index() {
    ASSERT_TRUE(storage_->db(Storage::Engine::Users)->Delete({}, storage_->meta(), kIndexVersionKey).ok());
    ASSERT_TRUE(storage_->db(Storage::Engine::Users)->DeleteRange({}, storage_->by_tag(), std::string(1, '\0'), std::string(9, '\xff')).ok());
  }
  Storage& storage() { return *storage_; }

 private:
  std::unique_ptr<Storage> storage_;
};

std::string leave_value(MembershipStatus status, std::uint64_t at) {
  auto v = serialize_membership({0, status, at});
  return std::string(v.data(), v.size());
}

// ---- G2 / G3 ----

// Signals on many threads while another thread leaves and rejoins the same
// users. A contribution of a user reported while their leave has returned
// (and their rejoin not begun) breaks G2; one stamped inside a
// [left_at_ns, rejoin at_ns] interval of the history breaks G3 or G2.
// Run with 2 signalling threads and at the counts host services run (16-64).
class LeaveStress : public ::testing::TestWithParam<int> {};

TEST_P(LeaveStress, ConcurrentSignalsNeverContributeAfterLeaveReturns) {
  constexpr std::uint64_t kUsers = 16;
  struct GuardSink : ContributionSink {
    std::array<std::atomic<int>, kUsers> left{};
    std::atomic<std::uint64_t> after_leave{0};
    std::mutex mu;
    struct Seen {
      std::uint64_t user_id;
      std::uint64_t forwarded_at_ns;
    };
    std::vector<Seen> seen;  // what the G3 check needs of each contribution
    void on_contribution(const Contribution& c) override {
      if (left[c.user_id].load(std::memory_order_acquire) != 0) after_leave.fetch_add(1);
      std::lock_guard<std::mutex> lock(mu);
      seen.push_back({c.user_id, c.forwarded_at_ns});
    }
  };
  TempDir dir;
  auto sink = std::make_shared<GuardSink>();
  Options options;
  options.contribution_sink = sink;
  options.sync_writes = false;  // many leaves; durability is not under test here
  auto db = open_db(dir.path(), options);
  for (std::uint64_t u = 0; u < kUsers; ++u) ASSERT_OK(db->join_community(u, 1000 + u % 3));

  std::atomic<bool> stop{false};
  std::atomic<int> started{0};  // signalling threads that have signalled
  std::vector<std::thread> signalers;
  for (int t = 0; t < GetParam(); ++t) {
    signalers.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t));
      for (bool first = true; !stop.load(std::memory_order_relaxed); first = false) {
        const std::uint64_t u = rng() % kUsers;
        auto out = db->signal_with_context({u, rng() % 4, 1.0}, {{7, 8}});
        ASSERT_TRUE(out.ok());
        if (first) started.fetch_add(1);
      }
    });
  }
  while (started.load() < GetParam()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::mt19937_64 rng(42);
  int leaves = 0;
  // With many more signalling threads than cores each leave waits longer for
  // preempted signals of its user, and the sink records far more: fewer rounds.
  const int rounds = GetParam() <= 2 ? 3000 : 300;
  for (int round = 0; round < rounds; ++round) {
    const std::uint64_t u = rng() % kUsers;
    if (sink->left[u].load() == 0) {
      ASSERT_OK(db->leave_community_layer(u));
      sink->left[u].store(1, std::memory_order_release);
      ++leaves;
    } else {
      sink->left[u].store(0, std::memory_order_release);
      ASSERT_OK(db->rejoin_community_layer(u));
    }
  }
  stop = true;
  for (auto& th : signalers) th.join();

  EXPECT_EQ(sink->after_leave.load(), 0u) << "contributions after leave returned (G2)";
  std::size_t inside_boundary = 0;
  std::size_t checked = 0;
  for (std::uint64_t u = 0; u < kUsers; ++u) {
    auto history = db->community_layer_history(u);
    ASSERT_OK(history);
    for (const GuardSink::Seen& c : sink->seen) {
      if (c.user_id != u) continue;
      ++checked;
      for (std::size_t i = 0; i < history->size(); ++i) {
        if ((*history)[i].status != MembershipStatus::Left) continue;
        const std::uint64_t from = (*history)[i].at_ns;
        const std::uint64_t to = i + 1 < history->size() ? (*history)[i + 1].at_ns : UINT64_MAX;
        if (c.forwarded_at_ns >= from && c.forwarded_at_ns <= to) ++inside_boundary;
      }
    }
  }
  EXPECT_EQ(inside_boundary, 0u) << "contributions stamped at or after a left_at_ns (G3)";
  EXPECT_GT(leaves, rounds / 3);
  EXPECT_GT(checked, 1000u);
  const Stats stats = db->stats();
  // A leave can land between a signal's two gate checks, so the two paths'
  // counts may differ slightly.
  EXPECT_GT(stats.gated_cohort, 0u);
  EXPECT_GT(stats.gated_community, 0u);
  std::cout << "leaves: " << leaves << ", contributions checked: " << checked
            << ", signals gated: " << stats.gated_cohort << "\n";
}

INSTANTIATE_TEST_SUITE_P(Threads, LeaveStress, ::testing::Values(2, 16, 32, 64),
                         [](const ::testing::TestParamInfo<int>& param) { return std::to_string(param.param); });

TEST(Leave, GatesBothPathsAndKeepsThePersonalLayer) {
  TempDir dir;
  auto sink = std::make_shared<RecordingSink>();
  auto db = open_db(dir.path(), with_sink(sink));
  ASSERT_OK(db->join_community(1, 10));
  ASSERT_OK(db->signal_with_context({1, 5, 1.0}, {{3}}));
  ASSERT_OK(db->leave_community_layer(1));
  auto out = db->signal_with_context({1, 5, 1.0}, {{3}});
  ASSERT_OK(out);
  EXPECT_TRUE(out->gated);
  EXPECT_TRUE(out->personal_applied);
  EXPECT_EQ(out->cohorts_attributed, 0u);
  EXPECT_EQ(out->communities_forwarded, 0u);
  EXPECT_EQ(value_of(db->personal_score(1, 5)), 2.0);
  EXPECT_EQ(value_of(db->cohort_score(3, 5)), 1.0);
  EXPECT_EQ(value_of(db->community_score(10, 5)), 1.0);
  EXPECT_EQ(sink->count_for(1), 2u);
  // Other users are not gated.
  ASSERT_OK(db->join_community(2, 10));
  out = db->signal_with_context({2, 5, 1.0}, {{3}});
  ASSERT_OK(out);
  EXPECT_FALSE(out->gated);
  EXPECT_EQ(out->communities_forwarded, 1u);
  // The boundary is exact: earlier contributions are stamped before it.
  const std::uint64_t left_at = *db->community_layer_status(1)->left_at_ns;
  for (auto& c : sink->seen) {
    if (c.user_id == 1) {
      EXPECT_LT(c.forwarded_at_ns, left_at);
    }
  }
}

TEST(Leave, GateActivityCountsHeldBackSignalsSinceTheLastLeave) {
  TempDir dir;
  auto db = open_db(dir.path());
  EXPECT_EQ(db->gate_activity(1)->held_back_signals, 0u);
  ASSERT_OK(db->leave_community_layer(1));
  for (int i = 0; i < 3; ++i) ASSERT_OK(db->signal_with_context({1, 1, 1.0}, {}));
  auto a = db->gate_activity(1);
  ASSERT_OK(a);
  EXPECT_EQ(a->held_back_signals, 3u);
  ASSERT_TRUE(a->last_held_back_ns);
  EXPECT_GT(*a->last_held_back_ns, *db->community_layer_status(1)->left_at_ns);
  ASSERT_OK(db->rejoin_community_layer(1));
  ASSERT_OK(db->signal_with_context({1, 1, 1.0}, {}));
  EXPECT_EQ(db->gate_activity(1)->held_back_signals, 3u);  // kept until the next leave
  ASSERT_OK(db->leave_community_layer(1));
  EXPECT_EQ(db->gate_activity(1)->held_back_signals, 0u);
}

TEST(Leave, CallingLeaveFromASinkCallbackIsBusy) {
  struct LeavingSink : ContributionSink {
    Db* db = nullptr;
    Status result;
    void on_contribution(const Contribution& c) override { result = db->leave_community_layer(c.user_id); }
  };
  TempDir dir;
  auto sink = std::make_shared<LeavingSink>();
  Options options;
  options.contribution_sink = sink;
  auto db = open_db(dir.path(), options);
  sink->db = db.get();
  ASSERT_OK(db->signal_with_context({1, 1, 1.0}, {{2}}));
  EXPECT_EQ(sink->result.code(), StatusCode::Busy);
  EXPECT_EQ(db->community_layer_status(1)->status, MembershipStatus::Active);
}

// ---- G4 / G7 ----

TEST(Leave, RejoinKeepsHistory) {
  TempDir dir;
  auto db = open_db(dir.path());
  EXPECT_EQ(db->community_layer_status(9)->status, MembershipStatus::Active);
  EXPECT_FALSE(db->community_layer_status(9)->left_at_ns);
  EXPECT_TRUE(db->community_layer_history(9)->empty());

  ASSERT_OK(db->leave_community_layer(9));
  const std::uint64_t first = *db->community_layer_status(9)->left_at_ns;
  ASSERT_OK(db->rejoin_community_layer(9));
  auto status = db->community_layer_status(9);
  EXPECT_EQ(status->status, MembershipStatus::Active);
  EXPECT_EQ(status->left_at_ns, first);
  ASSERT_OK(db->leave_community_layer(9));
  const std::uint64_t second = *db->community_layer_status(9)->left_at_ns;
  EXPECT_GT(second, first);
  ASSERT_OK(db->rejoin_community_layer(9));

  auto history = db->community_layer_history(9);
  ASSERT_OK(history);
  ASSERT_EQ(history->size(), 4u);
  EXPECT_EQ((*history)[0].status, MembershipStatus::Left);
  EXPECT_EQ((*history)[0].at_ns, first);
  EXPECT_EQ((*history)[1].status, MembershipStatus::Active);
  EXPECT_EQ((*history)[2].status, MembershipStatus::Left);
  EXPECT_EQ((*history)[2].at_ns, second);
  EXPECT_EQ((*history)[3].status, MembershipStatus::Active);
  for (std::size_t i = 1; i < history->size(); ++i) EXPECT_LT((*history)[i - 1].at_ns, (*history)[i].at_ns);
  EXPECT_EQ(db->stats().leaves, 2u);
  EXPECT_EQ(db->stats().rejoins, 2u);
}

TEST(Leave, LeaveWhileLeftAndRejoinWhileActiveChangeNothing) {
  TempDir dir;
  auto db = open_db(dir.path());
  ASSERT_OK(db->rejoin_community_layer(3));  // Active: no-op
  EXPECT_TRUE(db->community_layer_history(3)->empty());
  ASSERT_OK(db->leave_community_layer(3));
  const auto first = db->community_layer_status(3)->left_at_ns;
  ASSERT_OK(db->leave_community_layer(3));  // Left: no-op, the first left_at_ns stands
  EXPECT_EQ(db->community_layer_status(3)->left_at_ns, first);
  EXPECT_EQ(db->community_layer_history(3)->size(), 1u);
  ASSERT_OK(db->rejoin_community_layer(3));
  ASSERT_OK(db->rejoin_community_layer(3));
  EXPECT_EQ(db->community_layer_history(3)->size(), 2u);
  const Stats stats = db->stats();
  EXPECT_EQ(stats.leaves, 1u);
  EXPECT_EQ(stats.rejoins, 1u);
  EXPECT_EQ(stats.users_left, 0u);
}

// ---- G5 ----

TEST(Restart, RestoresStatusesHistoryAndTheClosedGate) {
  TempDir dir;
  std::map<std::uint64_t, CommunityMembership> before;
  {
    auto db = open_db(dir.path());
    for (std::uint64_t u = 1; u <= 50; ++u) {
      ASSERT_OK(db->join_community(u, 7));
      ASSERT_OK(db->leave_community_layer(u));
      if (u % 3 == 0) ASSERT_OK(db->rejoin_community_layer(u));
      if (u % 6 == 0) ASSERT_OK(db->leave_community_layer(u));
      before[u] = *db->community_layer_status(u);
    }
    ASSERT_OK(db->close());
  }
  auto sink = std::make_shared<RecordingSink>();
  auto db = open_db(dir.path(), with_sink(sink));
  std::uint64_t left = 0;
  for (const auto& [u, m] : before) {
    auto now = db->community_layer_status(u);
    ASSERT_OK(now);
    EXPECT_EQ(now->status, m.status) << u;
    EXPECT_EQ(now->left_at_ns, m.left_at_ns) << u;
    const std::size_t events = 1u + (u % 3 == 0 ? 1u : 0u) + (u % 6 == 0 ? 1u : 0u);
    EXPECT_EQ(db->community_layer_history(u)->size(), events) << u;
    auto out = db->signal_with_context({u, 1, 1.0}, {{2}});
    ASSERT_OK(out);
    EXPECT_EQ(out->gated, m.status == MembershipStatus::Left) << u;
    left += m.status == MembershipStatus::Left;
  }
  EXPECT_EQ(db->stats().users_left, left);
  for (auto& c : sink->seen) EXPECT_EQ(before[c.user_id].status, MembershipStatus::Active) << c.user_id;
}

TEST(Restart, ForEachLeftStreamsLeftUsersInOrder) {
  TempDir dir;
  auto db = open_db(dir.path());
  for (std::uint64_t u : {30u, 10u, 20u, 40u}) ASSERT_OK(db->leave_community_layer(u));
  ASSERT_OK(db->rejoin_community_layer(20));
  std::vector<std::uint64_t> seen;
  ASSERT_OK(db->for_each_left([&](const CommunityMembership& m) {
    EXPECT_EQ(m.status, MembershipStatus::Left);
    EXPECT_TRUE(m.left_at_ns);
    seen.push_back(m.user_id);
    return true;
  }));
  EXPECT_EQ(seen, (std::vector<std::uint64_t>{10, 30, 40}));
  seen.clear();
  ASSERT_OK(db->for_each_left([&](const CommunityMembership& m) {
    seen.push_back(m.user_id);
    return seen.size() < 2;
  }));
  EXPECT_EQ(seen.size(), 2u);
}

// ---- G6: corrupt records at open ----

class CorruptRecord : public ::testing::TestWithParam<std::string> {};

TEST_P(CorruptRecord, FailsTheOpenNamingTheUserOrGatesPerPolicy) {
  TempDir dir;
  {
    auto db = open_db(dir.path());
    ASSERT_OK(db->leave_community_layer(5));
    ASSERT_OK(db->close());
  }
  {
    RawDb raw(dir.path());
    raw.put_leave_record(123456789, GetParam());
  }
  auto failed = Db::open(dir.path());
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::Corruption);
  EXPECT_NE(failed.status().message().find("user 123456789"), std::string::npos) << failed.status().message();

  auto sink = std::make_shared<RecordingSink>();
  Options options;
  options.corrupt_record_policy = CorruptRecordPolicy::TreatAsLeft;
  options.contribution_sink = sink;
  auto db = open_db(dir.path(), options);
  ASSERT_TRUE(db);
  EXPECT_EQ(db->community_layer_status(123456789)->status, MembershipStatus::Left);
  auto out = db->signal_with_context({123456789, 1, 1.0}, {{1}});
  ASSERT_OK(out);
  EXPECT_TRUE(out->gated);
  EXPECT_TRUE(sink->seen.empty());
  EXPECT_EQ(db->stats().corrupt_records_treated_as_left, 1u);
  EXPECT_EQ(db->community_layer_status(5)->status, MembershipStatus::Left);  // the good record too
  auto report = db->verify();
  ASSERT_OK(report);
  ASSERT_EQ(report->problems.size(), 1u);
  EXPECT_NE(report->problems[0].find(hex(encode_key(EntityId(123456789), Tag::CommunityLeave))), std::string::npos)
      << report->problems[0];
}

INSTANTIATE_TEST_SUITE_P(Values, CorruptRecord,
                         ::testing::Values(std::string("\x01\x02\x03", 3),             // short
                                           std::string(10, '\x01'),                    // long
                                           leave_value(MembershipStatus::Left, 9).replace(0, 1, "\x02"),  // bad status
                                           leave_value(MembershipStatus::Left, 9).replace(0, 1, "\xff"),
                                           std::string("\x01", 1) + std::string(8, '\0'),  // Left, time 0
                                           std::string()));

TEST(CorruptRecordKey, ASuffixedLeaveKeyNeverOverridesTheRealRecord) {
  TempDir dir;
  {
    auto db = open_db(dir.path());
    ASSERT_OK(db->leave_community_layer(8));
    ASSERT_OK(db->close());
  }
  {
    // A well-formed Active value under a 0x11 key with a suffix sorts after
    // user 8's real Left record.
    RawDb raw(dir.path());
    const std::string active = leave_value(MembershipStatus::Active, 5);
    raw.put(raw.storage().users(), encode_key(EntityId(8), Tag::CommunityLeave, "x"), active);
    raw.put(raw.storage().by_tag(), encode_index_key(EntityId(8), Tag::CommunityLeave, "x"), active);
  }
  auto failed = Db::open(dir.path());
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::Corruption);
  EXPECT_NE(failed.status().message().find("user 8"), std::string::npos) << failed.status().message();
  Options options;
  options.corrupt_record_policy = CorruptRecordPolicy::TreatAsLeft;
  auto db = open_db(dir.path(), options);
  EXPECT_EQ(db->community_layer_status(8)->status, MembershipStatus::Left);
  EXPECT_TRUE(db->signal_with_context({8, 1, 1.0}, {{1}})->gated);
}

// ---- start-up: index and unknown tags ----

TEST(Startup, UnknownTagsAreSkippedAndAMissingIndexIsBackfilled) {
  TempDir dir;
  {
    auto db = open_db(dir.path());
    ASSERT_OK(db->join_community(1, 10));
    ASSERT_OK(db->leave_community_layer(1));
    ASSERT_OK(db->leave_community_layer(2));
    ASSERT_OK(db->rejoin_community_layer(2));
    ASSERT_OK(db->close());
  }
  {
    RawDb raw(dir.path());
    raw.drop_index();
    for (int tag : {0x05, 0x0f, 0x13, 0x20, 0xff}) {
      raw.put(raw.storage().users(), encode_key(EntityId(1), static_cast<Tag>(tag), "xyz"), "future data");
    }
    raw.put(raw.storage().users(), std::string("\x00\x01", 2), "a key too short to decode");
  }
  auto db = open_db(dir.path());
  ASSERT_TRUE(db);
  EXPECT_EQ(db->community_layer_status(1)->status, MembershipStatus::Left);
  EXPECT_EQ(db->community_layer_status(2)->status, MembershipStatus::Active);
  EXPECT_TRUE(db->community_layer_status(2)->left_at_ns);
  EXPECT_EQ(*db->communities_of(1), std::vector<std::uint64_t>{10});
  auto report = db->verify();
  ASSERT_OK(report);
  ASSERT_EQ(report->problems.size(), 1u);  // only the undecodable key
  EXPECT_NE(report->problems[0].find("0001"), std::string::npos);
  ASSERT_OK(db->close());

  // The backfill wrote the index: the next open reads only the index.
  RawDb raw(dir.path());
  std::string version;
  EXPECT_OK(raw.storage().get(raw.storage().meta(), kIndexVersionKey, &version));
  std::string copy;
  EXPECT_OK(raw.storage().get(raw.storage().by_tag(), encode_index_key(EntityId(1), Tag::CommunityLeave), &copy));
}

TEST(Verify, ReportsIndexRecordsThatDisagreeWithTheUsersPartition) {
  TempDir dir;
  {
    auto db = open_db(dir.path());
    ASSERT_OK(db->leave_community_layer(1));
    ASSERT_OK(db->leave_community_layer(2));
    ASSERT_OK(db->join_community(3, 4));
    auto report = db->verify();
    ASSERT_OK(report);
    EXPECT_TRUE(report->ok());
    EXPECT_GT(report->records_checked, 0u);
    ASSERT_OK(db->close());
  }
  {
    RawDb raw(dir.path());
    // user 1: the index copy says Active; user 7: only in the index.
    raw.put(raw.storage().by_tag(), encode_index_key(EntityId(1), Tag::CommunityLeave),
            leave_value(MembershipStatus::Active, 5));
    raw.put(raw.storage().by_tag(), encode_index_key(EntityId(7), Tag::CommunityLeave),
            leave_value(MembershipStatus::Left, 5));
  }
  auto db = open_db(dir.path());
  auto report = db->verify();
  ASSERT_OK(report);
  ASSERT_EQ(report->problems.size(), 2u);
  EXPECT_NE(report->problems[0].find(hex(encode_key(EntityId(1), Tag::CommunityLeave))), std::string::npos);
  EXPECT_NE(report->problems[0].find("differs"), std::string::npos);
  EXPECT_NE(report->problems[1].find(hex(encode_index_key(EntityId(7), Tag::CommunityLeave))), std::string::npos);
}

}  // namespace
}  // namespace tidal
