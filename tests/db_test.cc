// Db lifecycle, G8 errors, community memberships, the signal path, aggregates.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "test_util.h"

namespace tidal {
namespace {

using testing::TempDir;
using testing::open_db;
using testing::RecordingSink;
using testing::with_sink;
using testing::value_of;

// Runs the open_probe program with `args`; returns its exit code and output.
std::pair<int, std::string> run_probe(const std::string& args) {
  std::string cmd = std::string(testing::paths::kOpenProbe) + " " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  const int rc = ::pclose(p);
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, out};
}

// Every file under `dir` with its size.
std::map<std::string, std::uintmax_t> listing(const std::string& dir) {
  std::map<std::string, std::uintmax_t> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    files[e.path().string()] = e.is_regular_file() ? e.file_size() : 0;
  }
  return files;
}

// The names of the files under `dir`.
std::set<std::string> names(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& [path, size] : listing(dir)) out.insert(path);
  return out;
}

TEST(DbLifecycle, OpenWriteCloseReopen) {
  TempDir dir;
  {
    auto db = open_db(dir.path());
    ASSERT_TRUE(db);
    ASSERT_OK(db->join_community(1, 10));
    ASSERT_OK(db->signal_with_context({1, 100, 2.5}, {{7}}));
    ASSERT_OK(db->close());
    ASSERT_OK(db->close());  // idempotent
  }
  auto db = open_db(dir.path());
  ASSERT_TRUE(db);
  EXPECT_EQ(value_of(db->personal_score(1, 100)), 2.5);
  EXPECT_EQ(value_of(db->cohort_score(7, 100)), 2.5);
  EXPECT_EQ(value_of(db->community_score(10, 100)), 2.5);
  auto ids = db->communities_of(1);
  ASSERT_OK(ids);
  EXPECT_EQ(*ids, std::vector<std::uint64_t>{10});
}

TEST(DbLifecycle, CloseFlushesSoReopenDoesNotReplayTheWal) {
  TempDir dir;
  {
    auto db = open_db(dir.path());
    ASSERT_OK(db->leave_community_layer(3));
    ASSERT_OK(db->close());
  }
  // After a flush the live WAL holds no records: every .log file is (near) empty.
  for (const auto& [path, size] : listing(dir.path())) {
    if (path.size() > 4 && path.substr(path.size() - 4) == ".log") {
      EXPECT_EQ(size, 0u) << path;
    }
  }
}

TEST(DbLifecycle, EveryCallOnAClosedDbReturnsClosed) {
  TempDir dir;
  auto db = open_db(dir.path());
  ASSERT_OK(db->signal_with_context({1, 1, 1.0}, {}));
  ASSERT_OK(db->close());
  EXPECT_EQ(db->join_community(1, 1).code(), StatusCode::Closed);
  EXPECT_EQ(db->exit_community(1, 1).code(), StatusCode::Closed);
  EXPECT_EQ(db->communities_of(1).status().code(), StatusCode::Closed);
  EXPECT_EQ(db->signal_with_context({1, 1, 1.0}, {}).status().code(), StatusCode::Closed);
  EXPECT_EQ(db->leave_community_layer(1).code(), StatusCode::Closed);
  EXPECT_EQ(db->rejoin_community_layer(1).code(), StatusCode::Closed);
  EXPECT_EQ(db->community_layer_status(1).status().code(), StatusCode::Closed);
  EXPECT_EQ(db->community_layer_history(1).status().code(), StatusCode::Closed);
  EXPECT_EQ(db->gate_activity(1).status().code(), StatusCode::Closed);
  EXPECT_EQ(db->flush().code(), StatusCode::Closed);
  EXPECT_EQ(db->verify().status().code(), StatusCode::Closed);
  EXPECT_EQ(db->for_each_left([](const CommunityMembership&) { return true; }).code(), StatusCode::Closed);
  EXPECT_EQ(db->personal_score(1, 1).status().code(), StatusCode::Closed);
  EXPECT_EQ(db->cohort_score(1, 1).status().code(), StatusCode::Closed);
  EXPECT_EQ(db->community_score(1, 1).status().code(), StatusCode::Closed);
}

TEST(DbErrors, SecondOpenInTheSameProcessIsBusyAndNamesThePath) {
  TempDir dir;
  auto db = open_db(dir.path());
  ASSERT_OK(db->leave_community_layer(9));
  const auto before = names(dir.path());
  auto second = Db::open(dir.path());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::Busy);
  EXPECT_NE(second.status().message().find(dir.path()), std::string::npos) << second.status().message();
  EXPECT_NE(second.status().message().find("already open"), std::string::npos) << second.status().message();
  EXPECT_EQ(names(dir.path()), before);  // not even the holder's info LOG was rotated
  auto status = db->community_layer_status(9);  // the first handle is untouched
  ASSERT_OK(status);
  EXPECT_EQ(status->status, MembershipStatus::Left);
}

TEST(DbErrors, SecondOpenFromAnotherProcessIsBusyAndNamesThePath) {
  TempDir dir;
  {
    auto db = open_db(dir.path());
    ASSERT_OK(db->close());
  }
  // We hold it; a child process tries.
  auto db = open_db(dir.path());
  const auto before = names(dir.path());
  auto [rc, out] = run_probe(dir.path());
  EXPECT_EQ(names(dir.path()), before);
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("Busy"), std::string::npos) << out;
  EXPECT_NE(out.find(dir.path()), std::string::npos) << out;
  ASSERT_OK(db->close());

  // A child holds it; we try.
  std::string cmd = std::string(testing::paths::kOpenProbe) + " " + dir.path() + " --hold 3000";
  FILE* child = ::popen(cmd.c_str(), "r");
  ASSERT_NE(child, nullptr);
  char line[512] = {};
  ASSERT_NE(std::fgets(line, sizeof line, child), nullptr);  // "held"
  EXPECT_STREQ(line, "held\n");
  auto second = Db::open(dir.path());
  ::pclose(child);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::Busy);
  EXPECT_NE(second.status().message().find(dir.path()), std::string::npos) << second.status().message();
}

TEST(DbErrors, PathThatIsARegularFile) {
  TempDir dir;
  const std::string file = dir.sub("plain-file");
  { std::ofstream(file) << "precious"; }
  auto db = Db::open(file);
  ASSERT_FALSE(db.ok());
  EXPECT_EQ(db.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(db.status().message().find(file), std::string::npos) << db.status().message();
  EXPECT_NE(db.status().message().find("regular file"), std::string::npos) << db.status().message();
  std::ifstream in(file);
  std::string content;
  std::getline(in, content);
  EXPECT_EQ(content, "precious");
}

TEST(DbErrors, DirectoryWithoutWritePermission) {
  TempDir dir;
  const std::string path = dir.sub("db");
  {
    auto db = open_db(path);
    ASSERT_OK(db->leave_community_layer(4));
    ASSERT_OK(db->close());
  }
  const auto before = listing(path);
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  ASSERT_EQ(::chmod(path.c_str(), 0555), 0);
  if (::geteuid() == 0) {
    // Root writes anywhere: ask an unprivileged process to open it.
    auto [rc, out] = run_probe(path + " --as-nobody");
    EXPECT_EQ(rc, 1) << out;
    EXPECT_NE(out.find("IOError"), std::string::npos) << out;
    EXPECT_NE(out.find(path), std::string::npos) << out;
    EXPECT_NE(out.find("not writable"), std::string::npos) << out;
  } else {
    auto db = Db::open(path);
    ASSERT_FALSE(db.ok());
    EXPECT_EQ(db.status().code(), StatusCode::IOError);
    EXPECT_NE(db.status().message().find(path), std::string::npos);
  }
  EXPECT_EQ(listing(path), before);
  ASSERT_EQ(::chmod(path.c_str(), 0755), 0);
  auto db = open_db(path);
  auto status = db->community_layer_status(4);
  ASSERT_OK(status);
  EXPECT_EQ(status->status, MembershipStatus::Left);
}

TEST(DbErrors, MissingDirectoryWithoutCreateIfMissing) {
  TempDir dir;
  Options options;
  options.create_if_missing = false;
  auto db = Db::open(dir.sub("absent"), options);
  ASSERT_FALSE(db.ok());
  EXPECT_EQ(db.status().code(), StatusCode::NotFound);
  EXPECT_NE(db.status().message().find(dir.sub("absent")), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(dir.sub("absent")));
}

TEST(DbErrors, DirectoryWithoutADatabaseIsNotFoundWhenNotCreating) {
  TempDir dir;
  Options ro;
  ro.read_only = true;
  Options no_create;
  no_create.create_if_missing = false;
  for (const Options& options : {ro, no_create}) {
    auto db = Db::open(dir.path(), options);
    ASSERT_FALSE(db.ok());
    EXPECT_EQ(db.status().code(), StatusCode::NotFound);
    EXPECT_NE(db.status().message().find(dir.path()), std::string::npos);
    EXPECT_NE(db.status().message().find("no CURRENT file"), std::string::npos) << db.status().message();
    EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  }
}

TEST(DbReadOnly, ReadsWhileHeldAndRefusesWrites) {
  TempDir dir;
  auto writer = open_db(dir.path());
  ASSERT_OK(writer->leave_community_layer(5));
  ASSERT_OK(writer->join_community(5, 50));
  ASSERT_OK(writer->signal_with_context({5, 1, 4.0}, {{9}}));  // user 5 has left: personal only
  ASSERT_OK(writer->signal_with_context({7, 1, 2.0}, {{9}}));
  ASSERT_OK(writer->flush());
  Options ro;
  ro.read_only = true;
  auto reader = open_db(dir.path(), ro);
  ASSERT_TRUE(reader);
  auto status = reader->community_layer_status(5);
  ASSERT_OK(status);
  EXPECT_EQ(status->status, MembershipStatus::Left);
  EXPECT_EQ(reader->leave_community_layer(6).code(), StatusCode::InvalidArgument);
  EXPECT_EQ(reader->join_community(6, 1).code(), StatusCode::InvalidArgument);
  EXPECT_EQ(reader->signal_with_context({6, 1, 1.0}, {}).status().code(), StatusCode::InvalidArgument);
  EXPECT_EQ(*reader->communities_of(5), std::vector<std::uint64_t>{50});
  // Scores come from storage: what the writer flushed.
  EXPECT_EQ(value_of(reader->personal_score(5, 1)), 4.0);
  EXPECT_EQ(value_of(reader->cohort_score(9, 1)), 2.0);
  EXPECT_EQ(value_of(reader->personal_score(6, 1)), 0.0);
  ASSERT_OK(reader->close());
}

// ---- community memberships ----

TEST(Memberships, JoinExitAndIdempotence) {
  TempDir dir;
  auto db = open_db(dir.path());
  ASSERT_OK(db->join_community(1, 30));
  ASSERT_OK(db->join_community(1, 10));
  ASSERT_OK(db->join_community(1, 20));
  ASSERT_OK(db->join_community(1, 10));  // twice: OK, no change
  EXPECT_EQ(*db->communities_of(1), (std::vector<std::uint64_t>{10, 20, 30}));
  ASSERT_OK(db->exit_community(1, 20));
  ASSERT_OK(db->exit_community(1, 99));  // not a member: OK, no change
  EXPECT_EQ(*db->communities_of(1), (std::vector<std::uint64_t>{10, 30}));
  EXPECT_TRUE(db->communities_of(2)->empty());
  ASSERT_OK(db->close());
  db = open_db(dir.path());
  EXPECT_EQ(*db->communities_of(1), (std::vector<std::uint64_t>{10, 30}));
}

TEST(Memberships, ExitStopsForwardingToThatCommunityOnly) {
  TempDir dir;
  auto db = open_db(dir.path());
  ASSERT_OK(db->join_community(1, 10));
  ASSERT_OK(db->join_community(1, 20));
  ASSERT_OK(db->signal_with_context({1, 5, 1.0}, {}));
  ASSERT_OK(db->exit_community(1, 10));
  auto out = db->signal_with_context({1, 5, 1.0}, {});
  ASSERT_OK(out);
  EXPECT_EQ(out->communities_forwarded, 1u);
  EXPECT_EQ(value_of(db->community_score(10, 5)), 1.0);
  EXPECT_EQ(value_of(db->community_score(20, 5)), 2.0);
}

// ---- signal path ----

TEST(Signals, OutcomeCountsCohortsAndCommunities) {
  TempDir dir;
  auto sink = std::make_shared<RecordingSink>();
  auto db = open_db(dir.path(), with_sink(sink));
  for (std::uint64_t c : {1u, 2u, 3u, 4u}) ASSERT_OK(db->join_community(44, c));
  ASSERT_OK(db->join_community(11, 9));

  struct Case {
    std::uint64_t user;
    std::vector<std::uint64_t> cohorts;
    std::size_t communities;
  };
  const Case cases[] = {{0, {}, 0}, {0, {7}, 0}, {0, {1, 2, 3, 4}, 0}, {11, {}, 1},
                        {11, {7}, 1}, {44, {}, 4}, {44, {5, 6, 7, 8}, 4}};
  std::size_t expected_contributions = 0;
  for (const Case& c : cases) {
    auto out = db->signal_with_context({c.user, 500, 1.0}, {c.cohorts});
    ASSERT_OK(out);
    EXPECT_TRUE(out->personal_applied);
    EXPECT_FALSE(out->gated);
    EXPECT_EQ(out->cohorts_attributed, c.cohorts.size());
    EXPECT_EQ(out->communities_forwarded, c.communities);
    expected_contributions += c.cohorts.size() + c.communities;
  }
  EXPECT_EQ(sink->seen.size(), expected_contributions);
  std::uint64_t last = 0;
  for (const Contribution& c : sink->seen) {
    EXPECT_GE(c.forwarded_at_ns, last);
    last = c.forwarded_at_ns;
  }
  EXPECT_EQ(value_of(db->cohort_score(7, 500)), 3.0);
  EXPECT_EQ(value_of(db->community_score(1, 500)), 2.0);
  EXPECT_EQ(value_of(db->personal_score(44, 500)), 2.0);
  EXPECT_EQ(value_of(db->personal_score(44, 501)), 0.0);
  EXPECT_EQ(value_of(db->community_score(12345, 500)), 0.0);
}

TEST(Signals, NonFiniteWeightsAreRejectedWithNothingChanged) {
  TempDir dir;
  auto sink = std::make_shared<RecordingSink>();
  auto db = open_db(dir.path(), with_sink(sink));
  ASSERT_OK(db->join_community(1, 10));
  for (double w : {std::nan(""), std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()}) {
    auto out = db->signal_with_context({1, 2, w}, {{3}});
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.status().code(), StatusCode::InvalidArgument);
    EXPECT_NE(out.status().message().find("not finite"), std::string::npos);
  }
  EXPECT_EQ(value_of(db->personal_score(1, 2)), 0.0);
  EXPECT_EQ(value_of(db->cohort_score(3, 2)), 0.0);
  EXPECT_EQ(value_of(db->community_score(10, 2)), 0.0);
  EXPECT_TRUE(sink->seen.empty());
  EXPECT_EQ(db->stats().signals, 0u);
}

TEST(Signals, UserInNoCommunityWithNoCohortsStillUpdatesPersonalLayer) {
  TempDir dir;
  auto db = open_db(dir.path());
  auto out = db->signal_with_context({77, 8, -1.5}, {});
  ASSERT_OK(out);
  EXPECT_TRUE(out->personal_applied);
  EXPECT_EQ(out->cohorts_attributed, 0u);
  EXPECT_EQ(out->communities_forwarded, 0u);
  EXPECT_EQ(value_of(db->personal_score(77, 8)), -1.5);
}

TEST(Signals, ConcurrentSignalsSumExactly) {
  TempDir dir;
  auto sink = std::make_shared<RecordingSink>();
  auto db = open_db(dir.path(), with_sink(sink));
  ASSERT_OK(db->join_community(1, 100));
  ASSERT_OK(db->join_community(2, 100));
  ASSERT_OK(db->join_community(2, 200));
  constexpr int kThreads = 4, kPerThread = 5000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const std::uint64_t user = 1 + static_cast<std::uint64_t>((t + i) % 2);
        auto out = db->signal_with_context({user, static_cast<std::uint64_t>(i % 3), 2.0}, {{5, 6}});
        ASSERT_TRUE(out.ok());
      }
    });
  }
  for (auto& th : threads) th.join();
  const double total = 2.0 * kThreads * kPerThread;
  double personal = 0, cohort5 = 0, c100 = 0, c200 = 0;
  for (std::uint64_t item = 0; item < 3; ++item) {
    personal += value_of(db->personal_score(1, item)) + value_of(db->personal_score(2, item));
    cohort5 += value_of(db->cohort_score(5, item));
    c100 += value_of(db->community_score(100, item));
    c200 += value_of(db->community_score(200, item));
  }
  EXPECT_EQ(personal, total);
  EXPECT_EQ(cohort5, total);
  EXPECT_EQ(c100, total);
  EXPECT_EQ(c200, total / 2);
  // Each signal: 2 cohorts + 1 community (user 1) or 2 communities (user 2).
  EXPECT_EQ(sink->seen.size(), static_cast<std::size_t>(kThreads * kPerThread / 2 * (3 + 4)));
  const Stats stats = db->stats();
  EXPECT_EQ(stats.signals, static_cast<std::uint64_t>(kThreads * kPerThread));
  EXPECT_EQ(stats.personal_updates, stats.signals);
  EXPECT_EQ(stats.cohort_attributions, 2 * stats.signals);
  EXPECT_EQ(stats.community_forwards, stats.signals / 2 * 3);
}

// Signals on two threads while a third joins and exits communities, flushes
// and reads stats: nothing fails, the personal and cohort sums stay exact, and
// the sink saw exactly what the stats count. (Also run under TSan.)
TEST(Signals, ConcurrentSignalsWithMembershipChangesAndFlushes) {
  TempDir dir;
  auto sink = std::make_shared<RecordingSink>();
  Options options = with_sink(sink);
  options.sync_writes = false;
  auto db = open_db(dir.path(), options);
  constexpr int kPerThread = 4000;
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const auto user = static_cast<std::uint64_t>((i + t) % 8);
        ASSERT_TRUE(db->signal_with_context({user, static_cast<std::uint64_t>(i % 5), 1.0}, {{1}}).ok());
      }
    });
  }
  std::thread admin([&] {
    for (std::uint64_t i = 0; !done.load(); ++i) {
      ASSERT_OK(db->join_community(i % 8, 100 + i % 3));
      ASSERT_OK(db->exit_community((i + 3) % 8, 100 + (i + 1) % 3));
      if (i % 16 == 0) ASSERT_OK(db->flush());
      (void)db->stats();
    }
  });
  for (auto& th : threads) th.join();
  done = true;
  admin.join();
  double personal = 0, cohort = 0, community = 0;
  for (std::uint64_t item = 0; item < 5; ++item) {
    for (std::uint64_t u = 0; u < 8; ++u) personal += value_of(db->personal_score(u, item));
    cohort += value_of(db->cohort_score(1, item));
    for (std::uint64_t c = 100; c < 103; ++c) community += value_of(db->community_score(c, item));
  }
  EXPECT_EQ(personal, 2.0 * kPerThread);
  EXPECT_EQ(cohort, 2.0 * kPerThread);
  const Stats stats = db->stats();
  EXPECT_EQ(stats.community_forwards, static_cast<std::uint64_t>(community));
  EXPECT_EQ(sink->seen.size(), stats.cohort_attributions + stats.community_forwards);
  ASSERT_OK(db->close());
  db = open_db(dir.path());
  EXPECT_EQ(value_of(db->cohort_score(1, 0)) + value_of(db->cohort_score(1, 1)) + value_of(db->cohort_score(1, 2)) + value_of(db->cohort_score(1, 3)) +
                value_of(db->cohort_score(1, 4)),
            2.0 * kPerThread);
}

TEST(Signals, ASinkMaySignalAnotherDb) {
  // A sink that mirrors every contribution into a second Db, as a host
  // replicating aggregates might: the nested signal must not disturb the outer one.
  struct MirrorSink : ContributionSink {
    Db* other = nullptr;
    int nested_ok = 0;
    void on_contribution(const Contribution& c) override {
      nested_ok += other->signal_with_context({c.user_id, c.item_id, c.weight}, {}).ok();
    }
  };
  TempDir dir;
  auto other = open_db(dir.sub("other"));
  ASSERT_OK(other->join_community(1, 77));
  ASSERT_OK(other->join_community(1, 78));
  auto sink = std::make_shared<MirrorSink>();
  sink->other = other.get();
  Options options;
  options.contribution_sink = sink;
  auto db = open_db(dir.sub("main"), options);
  for (std::uint64_t c : {10u, 11u, 12u}) ASSERT_OK(db->join_community(1, c));
  auto out = db->signal_with_context({1, 5, 1.0}, {});
  ASSERT_OK(out);
  EXPECT_EQ(out->communities_forwarded, 3u);
  EXPECT_EQ(sink->nested_ok, 3);
  for (std::uint64_t c : {10u, 11u, 12u}) EXPECT_EQ(value_of(db->community_score(c, 5)), 1.0);
  EXPECT_EQ(value_of(other->community_score(77, 5)), 3.0);
}

TEST(Signals, ScoresSurviveFlushAndCloseReopen) {
  TempDir dir;
  {
    auto db = open_db(dir.path());
    ASSERT_OK(db->join_community(1, 10));
    ASSERT_OK(db->signal_with_context({1, 2, 0.25}, {{3}}));
    ASSERT_OK(db->flush());
    ASSERT_OK(db->signal_with_context({1, 2, 0.5}, {{3}}));   // changes persisted entries
    ASSERT_OK(db->signal_with_context({1, 9, 1.0}, {{3}}));   // adds new ones
    ASSERT_OK(db->flush());
    ASSERT_OK(db->flush());  // nothing changed
    ASSERT_OK(db->signal_with_context({1, 2, 2.0}, {}));
    ASSERT_OK(db->close());
  }
  {
    auto db = open_db(dir.path());
    EXPECT_EQ(value_of(db->personal_score(1, 2)), 2.75);
    EXPECT_EQ(value_of(db->cohort_score(3, 2)), 0.75);
    EXPECT_EQ(value_of(db->community_score(10, 2)), 2.75);
    EXPECT_EQ(value_of(db->personal_score(1, 9)), 1.0);
    ASSERT_OK(db->signal_with_context({1, 2, 0.25}, {}));  // a restored entry changes again
    ASSERT_OK(db->close());
  }
  auto db = open_db(dir.path());
  EXPECT_EQ(value_of(db->personal_score(1, 2)), 3.0);
  EXPECT_EQ(value_of(db->community_score(10, 9)), 1.0);
}

}  // namespace
}  // namespace tidal
