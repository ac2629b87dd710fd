// Fault-injection tests on tidal's RocksDB file system (fault_fs.h):
//   - G6: WAL append/sync failures during leave and rejoin fail closed;
//   - G1 under simulated power loss: with sync_writes no acknowledged leave or
//     rejoin is lost over 100 cuts; without it the harness sees losses;
//   - SQLite-style sweep: the N-th file operation of leave, rejoin,
//     join_community, flush and open fails (once, then persistently) for
//     N = 1, 2, ... until the call completes without reaching operation N.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "db/impl.h"
#include "fault_fs.h"
#include "reliability_util.h"
#include "tidal/db.h"

namespace tidal::reliability {
namespace {

using SteadyClock = std::chrono::steady_clock;

double seconds_since(SteadyClock::time_point t) {
  return std::chrono::duration<double>(SteadyClock::now() - t).count();
}

std::unique_ptr<Db> open_on(const std::string& path, const Options& options, rocksdb::Env* env) {
  Result<std::unique_ptr<Db>> db = Db::Impl::open(path, options, env);
  EXPECT_TRUE(db.ok()) << db.status().to_string();
  return db.ok() ? std::move(*db) : nullptr;
}

// Appends the last history event of `user` to the model (after an OK call
// that changed state).
void record_last_event(Db& db, AckModel* model, std::uint64_t user) {
  Result<std::vector<MembershipEvent>> h = db.community_layer_history(user);
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_FALSE(h->empty());
  model->events[user].push_back(h->back());
}

std::vector<std::uint64_t> user_range(std::uint64_t first, std::uint64_t last) {
  std::vector<std::uint64_t> v;
  for (std::uint64_t u = first; u <= last; ++u) v.push_back(u);
  return v;
}

// ---- two engines: a leave never waits on the state store ----

// Every fsync under the state engine's directory is held, so the writer's
// batch (its synced epoch mark, its ingestion) cannot finish; meanwhile
// leaves, rejoins and membership changes of other users are synced to the
// users engine and return, and the gate closes. With one RocksDB database
// for both (format 2) the leaves' synced WAL writes queued behind the
// writer's and this test hung (its watchdog then fails it). Once the syncs
// are released the batch lands, and after a reopen every leave is there and
// the aggregates hold the signals made before them.
TEST(TwoEnginesTest, LeavesCompleteWhileTheStateEngineCannotSync) {
  TempDir dir;
  const std::string path = dir.sub("db");
  FaultEnv fault = FaultEnv::make();
  Options options;
  options.aggregate_write_period = std::chrono::milliseconds(5);
  {
    std::unique_ptr<Db> db = open_on(path, options, fault.env.get());
    ASSERT_NE(db, nullptr);
    for (std::uint64_t u = 1; u <= 8; ++u) {
      ASSERT_TRUE(db->join_community(u, 100).ok());
      ASSERT_TRUE(db->signal_with_context({u, 1, 1.0}, {{7}}).ok());
    }
    fault.fs->hold_syncs_under(path + "/state/");
    ASSERT_TRUE(db->signal_with_context({1, 2, 1.0}, {{7}}).ok());  // a batch for the writer
    for (int i = 0; i < 10'000 && fault.fs->held_syncs() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_GT(fault.fs->held_syncs(), 0u) << "the writer never synced under " << path << "/state/";

    std::atomic<bool> done{false};
    std::thread leaver([&] {
      for (std::uint64_t u = 1; u <= 4; ++u) EXPECT_TRUE(db->leave_community_layer(u).ok());
      EXPECT_TRUE(db->rejoin_community_layer(4).ok());
      EXPECT_TRUE(db->join_community(9, 100).ok());
      done = true;
    });
    // A watchdog, not a timing: the leaves either return while the state
    // engine is stuck, or never do.
    for (int i = 0; i < 30'000 && !done; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const bool returned = done;
    EXPECT_GT(fault.fs->held_syncs(), 0u);  // still stuck while they ran
    fault.fs->release_syncs();
    leaver.join();
    ASSERT_TRUE(returned) << "leaves waited for the state engine's fsyncs";
    for (std::uint64_t u = 1; u <= 3; ++u) EXPECT_EQ(db->community_layer_status(u)->status, MembershipStatus::Left);
    ASSERT_TRUE(db->flush().ok());
    ASSERT_TRUE(db->close().ok());
  }
  auto db = Db::open(path);
  ASSERT_TRUE(db.ok()) << db.status().to_string();
  for (std::uint64_t u = 1; u <= 3; ++u) EXPECT_EQ((*db)->community_layer_status(u)->status, MembershipStatus::Left);
  EXPECT_EQ((*db)->community_layer_status(4)->status, MembershipStatus::Active);
  EXPECT_EQ(*(*db)->communities_of(9), std::vector<std::uint64_t>{100});
  EXPECT_EQ(*(*db)->community_score(100, 1), 8.0);
  EXPECT_EQ(*(*db)->cohort_score(7, 2), 1.0);
}

// ---- G6: WAL failures ----

void wal_failure_fails_closed(bool fail_sync) {
  TempDir dir;
  const std::string path = dir.sub("db");
  FaultEnv fault = FaultEnv::make();
  auto sink = std::make_shared<CountingSink>();
  Options options;
  options.contribution_sink = sink;
  AckModel model;
  std::map<std::uint64_t, MembershipStatus> unknown;
  {
    std::unique_ptr<Db> db = open_on(path, options, fault.env.get());
    ASSERT_NE(db, nullptr);
    ASSERT_OK(db->leave_community_layer(1));  // acknowledged Left
    record_last_event(*db, &model, 1);
    ASSERT_OK(db->leave_community_layer(2));  // acknowledged Left, then Active
    record_last_event(*db, &model, 2);
    ASSERT_OK(db->rejoin_community_layer(2));
    record_last_event(*db, &model, 2);
    EXPECT_EQ(probe_gate(*db, *sink, 3), std::optional<bool>(false));

    const std::uint64_t injected_before = fault.fs->faults_injected();
    fail_sync ? fault.fs->set_fail_wal_sync(true) : fault.fs->set_fail_wal_append(true);
    Status leave3 = db->leave_community_layer(3);
    EXPECT_FALSE(leave3.ok()) << "leave with a failing WAL " << (fail_sync ? "sync" : "append") << " returned OK";
    EXPECT_EQ(leave3.code(), StatusCode::IOError) << leave3.to_string();
    unknown[3] = MembershipStatus::Left;
    EXPECT_EQ(probe_gate(*db, *sink, 3), std::optional<bool>(true)) << "G6: the gate opened after a failed leave";
    Status again = db->leave_community_layer(3);  // no false G7 "already Left": the outcome is unknown
    EXPECT_FALSE(again.ok());
    EXPECT_EQ(probe_gate(*db, *sink, 3), std::optional<bool>(true));

    Status rejoin1 = db->rejoin_community_layer(1);
    EXPECT_FALSE(rejoin1.ok());
    unknown[1] = MembershipStatus::Active;
    EXPECT_EQ(probe_gate(*db, *sink, 1), std::optional<bool>(true)) << "G6: the gate opened after a failed rejoin";
    Status leave2 = db->leave_community_layer(2);
    EXPECT_FALSE(leave2.ok());
    unknown[2] = MembershipStatus::Left;
    EXPECT_EQ(probe_gate(*db, *sink, 2), std::optional<bool>(true));
    EXPECT_GT(fault.fs->faults_injected(), injected_before);

    // The fault is gone, but RocksDB stays in its fatal background-error
    // state (a failed WAL write is fatal to it): later writes may fail; the
    // gate never opens by error.
    fault.fs->clear_faults();
    Status leave4 = db->leave_community_layer(4);
    unknown[4] = MembershipStatus::Left;
    EXPECT_EQ(probe_gate(*db, *sink, 4), std::optional<bool>(true)) << leave4.to_string();
    std::cout << "[G6 WAL " << (fail_sync ? "sync" : "append") << " failure] leave: " << leave3.to_string()
              << "\n  after the fault cleared, leave: " << leave4.to_string() << "\n  close: "
              << db->close().to_string() << "\n";
  }
  // Reopens cleanly on the normal Env with every acknowledged record.
  auto sink2 = std::make_shared<CountingSink>();
  options.contribution_sink = sink2;
  Result<std::unique_ptr<Db>> db = Db::open(path, options);
  ASSERT_TRUE(db.ok()) << db.status().to_string();
  ModelCheck check;
  check_against_model(**db, sink2.get(), model, user_range(1, 4), unknown, false, &check);
  EXPECT_EQ(check.users_checked, 4u);
  ASSERT_OK((*db)->leave_community_layer(5));
  Result<CommunityMembership> st = (*db)->community_layer_status(5);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->status, MembershipStatus::Left);
  std::cout << "  reopened: acknowledged events present: " << check.events_checked << ", failed ops found applied: "
            << check.unknown_applied << " of " << unknown.size() << "\n";
}

TEST(FaultTest, WalAppendFailureKeepsGateClosed) { wal_failure_fails_closed(false); }
TEST(FaultTest, WalSyncFailureKeepsGateClosed) { wal_failure_fails_closed(true); }

// ---- simulated power loss ----
//
// Method: the Db runs on a FaultFs. After a batch of acknowledged leaves and
// rejoins, cut_power() makes every later write, sync, rename or delete fail
// without reaching the disk; the Db is then destroyed (its close() fails:
// nothing it tries to write lands), and restore_power() truncates every file
// written since the last cut to its last synced length. The next open sees
// exactly what a machine losing power at the cut would have kept.

struct PowerFigures {
  int cuts = 0;
  std::uint64_t acked = 0, lost = 0, files_truncated = 0, bytes_dropped = 0;
};

PowerFigures power_cuts(bool sync_writes, int cuts, int max_ops_per_cut) {
  TempDir dir;
  const std::string path = dir.sub("db");
  FaultEnv fault = FaultEnv::make();
  const std::vector<std::uint64_t> users = user_range(0, 31);
  std::mt19937_64 rng(sync_writes ? 1 : 2);
  AckModel model;
  PowerFigures fig;
  ModelCheck check;
  for (int cut = 0; cut <= cuts && !::testing::Test::HasFailure(); ++cut) {
    auto sink = std::make_shared<CountingSink>();
    Options options;
    options.sync_writes = sync_writes;
    options.contribution_sink = sink;
    std::unique_ptr<Db> db = open_on(path, options, fault.env.get());
    if (db == nullptr) {
      ADD_FAILURE() << "open after cut " << cut;
      break;
    }
    check_against_model(*db, sink.get(), model, users, {}, /*allow_loss=*/!sync_writes, &check);
    if (cut == cuts) break;  // the final check
    const int ops = 1 + static_cast<int>(rng() % static_cast<std::uint64_t>(max_ops_per_cut));
    for (int i = 0; i < ops; ++i) {
      const std::uint64_t u = users[rng() % users.size()];
      const bool leave = model.status_of(u) == MembershipStatus::Active;
      Status s = leave ? db->leave_community_layer(u) : db->rejoin_community_layer(u);
      if (!s.ok()) {
        ADD_FAILURE() << s.to_string();
        break;
      }
      record_last_event(*db, &model, u);
      ++fig.acked;
    }
    fault.fs->cut_power();
    db.reset();  // close fails: the power is off
    const FaultFs::CutReport r = fault.fs->restore_power();
    ++fig.cuts;
    fig.files_truncated += r.files_truncated;
    fig.bytes_dropped += r.bytes_dropped;
  }
  fig.lost = check.lost;
  return fig;
}

// Signals flow on one thread while the power is cut at a random moment: after
// each cut every signal that returned more than the write period plus one
// write before it is in the aggregates, whole, and I1 holds. "One write" is
// the longest the Db reports (Stats::aggregate_write_max_ns, read right after
// the cut, which counts a write overdue then as far as it got).
// TIDAL_CRASH_ROUNDS (as in crash_test.cc; default 200) / 4 cuts, at most 50.
TEST(PowerLossTest, SignalsOutsideTheWritePeriodSurvive50Cuts) {
  TempDir dir;
  FaultEnv fault = FaultEnv::make();
  const char* rounds_env = std::getenv("TIDAL_CRASH_ROUNDS");
  const int cuts = std::clamp(rounds_env != nullptr ? std::atoi(rounds_env) / 4 : 50, 10, 50);
  constexpr auto kPeriod = std::chrono::milliseconds(20);
  constexpr auto kSlack = std::chrono::milliseconds(20);  // the reading of the clocks around the calls
  std::mt19937_64 rng(7);
  std::uint64_t next_item = 0, required = 0, lost = 0, acked = 0;
  std::chrono::nanoseconds widest{0};
  const auto t = SteadyClock::now();
  for (int cut = 0; cut < cuts && !::testing::Test::HasFailure(); ++cut) {
    const std::string path = dir.sub("db" + std::to_string(cut));  // fresh: verify() stays cheap
    Options options;
    options.aggregate_write_period = kPeriod;
    std::unique_ptr<Db> db = open_on(path, options, fault.env.get());
    ASSERT_NE(db, nullptr);
    struct Ack {
      std::uint64_t item;
      SteadyClock::time_point at;
    };
    std::vector<Ack> acks;
    std::atomic<bool> stop{false};
    const std::uint64_t first = next_item;
    std::thread signaler([&] {
      for (std::uint64_t item = first; !stop.load(); ++item) {
        if (!db->signal_with_context({item % 16, item, 1.0}, SignalContext{{item % 4}}).ok()) break;
        acks.push_back({item, SteadyClock::now()});
        std::this_thread::sleep_for(std::chrono::microseconds(100));  // a steady flow, short rounds
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(550 + rng() % 201));
    fault.fs->cut_power();
    const auto cut_at = SteadyClock::now();
    const auto window = kPeriod + kSlack + std::chrono::nanoseconds(db->stats().aggregate_write_max_ns);
    widest = std::max(widest, std::chrono::duration_cast<std::chrono::nanoseconds>(window));
    stop.store(true);
    signaler.join();
    db.reset();  // its last writes fail: the power is off
    (void)fault.fs->restore_power();
    next_item = acks.empty() ? first : acks.back().item + 1;
    acked += acks.size();

    db = open_on(path, Options(), nullptr);
    ASSERT_NE(db, nullptr);
    for (const Ack& a : acks) {
      const double personal = testing::value_of(db->personal_score(a.item % 16, a.item));
      if (a.at + window < cut_at) {
        ++required;
        if (personal != 1.0) ++lost;
      }
      if (personal == 1.0) {  // the whole signal, never a part of it
        EXPECT_EQ(testing::value_of(db->cohort_score(a.item % 4, a.item)), 1.0);
      }
    }
    Result<VerifyReport> report = db->verify();
    ASSERT_TRUE(report.ok()) << report.status().to_string();
    ASSERT_TRUE(report->ok()) << "cut " << cut << ": " << report->problems.front();
    ASSERT_OK(db->close());
    db.reset();
    std::filesystem::remove_all(path);
  }
  std::cout << "[power loss, signals] cuts: " << cuts << ", acknowledged signals: " << acked
            << ", returned before the window (period + the longest write reported at the cut, widest "
            << widest.count() / 1000000 << " ms): " << required << ", lost: " << lost << "; I1 held after every cut, "
            << seconds_since(t) << " s\n";
  EXPECT_EQ(lost, 0u);
  EXPECT_GT(required, 0u);
}

TEST(PowerLossTest, SyncedLeavesAndRejoinsSurvive100Cuts) {
  const auto t = SteadyClock::now();
  const PowerFigures f = power_cuts(/*sync_writes=*/true, 100, 12);
  std::cout << "[power loss, sync_writes=true] cuts: " << f.cuts << ", acknowledged ops: " << f.acked
            << ", lost: " << f.lost << ", files truncated: " << f.files_truncated << " (" << f.bytes_dropped
            << " unsynced bytes dropped), " << seconds_since(t) << " s\n";
  EXPECT_EQ(f.cuts, 100);
  EXPECT_EQ(f.lost, 0u);
  EXPECT_GT(f.acked, 100u);
}

// The same harness without sync_writes: acknowledged writes are lost, which
// proves the harness can see a loss.
TEST(PowerLossTest, UnsyncedWritesAreLostAndSeen) {
  const auto t = SteadyClock::now();
  const PowerFigures f = power_cuts(/*sync_writes=*/false, 30, 12);
  std::cout << "[power loss, sync_writes=false] cuts: " << f.cuts << ", acknowledged ops: " << f.acked
            << ", lost: " << f.lost << ", files truncated: " << f.files_truncated << " (" << f.bytes_dropped
            << " unsynced bytes dropped), " << seconds_since(t) << " s\n";
  EXPECT_EQ(f.cuts, 30);
  EXPECT_GT(f.lost, 0u) << "the power-cut harness saw no loss even without fsync";
}

// ---- N-th operation sweep ----

enum class SweepOp { Leave, Rejoin, Join, Flush, Open };

const char* name_of(SweepOp op) {
  switch (op) {
    case SweepOp::Leave: return "leave_community_layer";
    case SweepOp::Rejoin: return "rejoin_community_layer";
    case SweepOp::Join: return "join_community";
    case SweepOp::Flush: return "flush";
    case SweepOp::Open: return "open";
  }
  return "?";
}

constexpr std::uint64_t kLeaver = 10;     // the user the Leave sweep leaves
constexpr std::uint64_t kRejoiner = 1;    // Left in the base Db; the Rejoin sweep rejoins
constexpr std::uint64_t kJoiner = 5;      // joins community kCommunity in the Join sweep
constexpr std::uint64_t kCommunity = 77;
constexpr std::uint64_t kScorer = 6;      // signals before the Flush sweep

// The base Db: users 1-3 left, 2 rejoined; 4 in a community; aggregates.
AckModel build_base(const std::string& path) {
  AckModel model;
  auto db = tidal::testing::open_db(path);
  if (db == nullptr) return model;
  for (std::uint64_t u : {1u, 2u, 3u}) {
    EXPECT_OK(db->leave_community_layer(u));
    record_last_event(*db, &model, u);
  }
  EXPECT_OK(db->rejoin_community_layer(2));
  record_last_event(*db, &model, 2);
  EXPECT_OK(db->join_community(4, 9));
  EXPECT_TRUE(db->signal_with_context({kScorer, 1, 1.0}, {{3}}).ok());
  EXPECT_OK(db->close());
  return model;
}

struct SweepFigures {
  std::uint64_t runs = 0, faults = 0, failed_calls = 0, ok_calls = 0, ops_in_call = 0;
  std::map<std::string, std::uint64_t> codes;  // error codes of the failed calls
};

SweepFigures sweep(SweepOp op, bool persistent) {
  namespace fs = std::filesystem;
  TempDir dir;
  const std::string base = dir.sub("base"), work = dir.sub("work");
  const AckModel base_model = build_base(base);
  const std::vector<std::uint64_t> users = user_range(1, 10);
  SweepFigures fig;
  FaultEnv fault = FaultEnv::make();
  for (std::uint64_t n = 1; n < 5000 && !::testing::Test::HasFailure(); ++n) {
    fs::remove_all(work);
    fs::copy(base, work, fs::copy_options::recursive);
    AckModel model = base_model;
    std::map<std::uint64_t, MembershipStatus> unknown;
    auto sink = std::make_shared<CountingSink>();
    Options options;
    options.contribution_sink = sink;
    const std::uint64_t injected_before = fault.fs->faults_injected();
    const auto t0 = SteadyClock::now();

    std::unique_ptr<Db> db;
    Status call;
    std::uint64_t ops_in_call = 0;
    std::optional<std::uint64_t> left_at;  // of an acknowledged leave
    if (op == SweepOp::Open) {
      fault.fs->fail_nth_op(n, persistent);
      Result<std::unique_ptr<Db>> r = Db::Impl::open(work, options, fault.env.get());
      ops_in_call = fault.fs->ops_since_arm();
      call = r.ok() ? Status::OK() : r.status();
      if (r.ok()) db = std::move(*r);
    } else {
      db = open_on(work, options, fault.env.get());
      if (db == nullptr) break;
      if (op == SweepOp::Flush) {
        EXPECT_TRUE(db->signal_with_context({kScorer, 1, 2.5}, {}).ok());
      }
      fault.fs->fail_nth_op(n, persistent);
      switch (op) {
        case SweepOp::Leave: call = db->leave_community_layer(kLeaver); break;
        case SweepOp::Rejoin: call = db->rejoin_community_layer(kRejoiner); break;
        case SweepOp::Join: call = db->join_community(kJoiner, kCommunity); break;
        case SweepOp::Flush: call = db->flush(); break;
        case SweepOp::Open: break;
      }
      ops_in_call = fault.fs->ops_since_arm();
    }
    const std::string ctx = std::string(name_of(op)) + (persistent ? " persistent" : " single") +
                            " failure at op " + std::to_string(n) + " (call: " + call.to_string() + ")";
    call.ok() ? ++fig.ok_calls : ++fig.failed_calls;
    if (!call.ok()) fig.codes[status_code_name(call.code())]++;
    if (std::getenv("TIDAL_SWEEP_DEBUG")) std::cerr << ctx << " t=" << seconds_since(t0) << "\n";
    // The unknown outcome of a failed write may go either way; an OK one must be there.
    if (op == SweepOp::Leave) unknown[kLeaver] = MembershipStatus::Left;
    if (op == SweepOp::Rejoin) unknown[kRejoiner] = MembershipStatus::Active;

    // While still on the faulty file system: the gate is closed for every
    // acknowledged Left user, and after a failed leave or rejoin (G6).
    if (db != nullptr) {
      for (std::uint64_t u : users) {
        bool want_closed = model.status_of(u) == MembershipStatus::Left;
        if (op == SweepOp::Leave && u == kLeaver) want_closed = true;           // done, or failed: closed either way
        if (op == SweepOp::Rejoin && u == kRejoiner) want_closed = !call.ok();  // open only once durable
        std::optional<bool> gated = probe_gate(*db, *sink, u);
        if (gated) {
          EXPECT_EQ(*gated, want_closed) << ctx << ": gate of user " << u;
        }
      }
      if (op == SweepOp::Leave && call.ok()) {
        Result<CommunityMembership> st = db->community_layer_status(kLeaver);
        if (st.ok()) left_at = st->left_at_ns;
      }
      (void)db->close();  // may fail: the Db may be in RocksDB's fatal error state
      db.reset();
    }
    if (std::getenv("TIDAL_SWEEP_DEBUG")) std::cerr << "  closed t=" << seconds_since(t0) << "\n";
    fault.fs->clear_faults();
    const std::uint64_t injected = fault.fs->faults_injected() - injected_before;
    fig.faults += injected;
    ++fig.runs;

    // Reopen on the normal Env: every acknowledged record present, the Db works.
    auto sink2 = std::make_shared<CountingSink>();
    options.contribution_sink = sink2;
    Result<std::unique_ptr<Db>> clean = Db::open(work, options);
    if (!clean.ok()) {
      ADD_FAILURE() << ctx << ": reopen on the normal Env: " << clean.status().to_string();
      break;
    }
    ModelCheck check;
    check_against_model(**clean, sink2.get(), model, users, unknown, false, &check);
    EXPECT_EQ(check.users_checked, users.size()) << ctx;
    if (call.ok()) {
      switch (op) {
        case SweepOp::Leave:
          EXPECT_EQ(model.status_of(kLeaver), MembershipStatus::Left) << ctx << ": acknowledged leave lost";
          EXPECT_EQ(model.left_at_of(kLeaver), left_at) << ctx;
          break;
        case SweepOp::Rejoin:
          EXPECT_EQ(model.status_of(kRejoiner), MembershipStatus::Active) << ctx << ": acknowledged rejoin lost";
          break;
        case SweepOp::Join: {
          Result<std::vector<std::uint64_t>> c = (*clean)->communities_of(kJoiner);
          EXPECT_TRUE(c.ok() && *c == std::vector<std::uint64_t>{kCommunity}) << ctx << ": acknowledged join lost";
          break;
        }
        case SweepOp::Flush:
          EXPECT_EQ(testing::value_of((*clean)->personal_score(kScorer, 1)), 3.5) << ctx << ": flushed aggregate lost";
          break;
        case SweepOp::Open: break;
      }
    }
    Result<std::vector<std::uint64_t>> c4 = (*clean)->communities_of(4);
    EXPECT_TRUE(c4.ok() && *c4 == std::vector<std::uint64_t>{9}) << ctx << ": base membership lost";
    Status leave = (*clean)->leave_community_layer(1000);
    EXPECT_TRUE(leave.ok()) << ctx << ": leave after reopen: " << leave.to_string();
    Result<CommunityMembership> st = (*clean)->community_layer_status(1000);
    EXPECT_TRUE(st.ok() && st->status == MembershipStatus::Left) << ctx;
    Result<VerifyReport> report = (*clean)->verify();
    EXPECT_TRUE(report.ok() && report->ok()) << ctx << ": verify found problems";
    EXPECT_OK((*clean)->close());
    if (std::getenv("TIDAL_SWEEP_DEBUG")) std::cerr << "  checked t=" << seconds_since(t0) << "\n";

    if (call.ok() && ops_in_call < n) {  // the call completed without reaching op n: done
      fig.ops_in_call = ops_in_call;
      break;
    }
  }
  return fig;
}

void run_sweep(SweepOp op, bool persistent) {
  const auto t = SteadyClock::now();
  const SweepFigures f = sweep(op, persistent);
  std::cout << "[sweep " << name_of(op) << (persistent ? ", persistent" : ", single") << "] N = 1.." << f.runs
            << ", file operations in a clean call: " << f.ops_in_call << ", faults injected: " << f.faults
            << ", calls failed: " << f.failed_calls << ", succeeded: " << f.ok_calls << ", " << seconds_since(t)
            << " s; errors:";
  for (const auto& [code, count] : f.codes) std::cout << " " << code << " x" << count;
  std::cout << "\n";
  EXPECT_GT(f.failed_calls, 0u) << "no injected fault made " << name_of(op) << " fail";
}

// One test per operation and kind, so ctest can run them side by side (a
// failed RocksDB flush sleeps 1 s before its close completes).
TEST(FaultSweepTest, LeaveSingle) { run_sweep(SweepOp::Leave, false); }
TEST(FaultSweepTest, LeavePersistent) { run_sweep(SweepOp::Leave, true); }
TEST(FaultSweepTest, RejoinSingle) { run_sweep(SweepOp::Rejoin, false); }
TEST(FaultSweepTest, RejoinPersistent) { run_sweep(SweepOp::Rejoin, true); }
TEST(FaultSweepTest, JoinCommunitySingle) { run_sweep(SweepOp::Join, false); }
TEST(FaultSweepTest, JoinCommunityPersistent) { run_sweep(SweepOp::Join, true); }
TEST(FaultSweepTest, FlushSingle) { run_sweep(SweepOp::Flush, false); }
TEST(FaultSweepTest, FlushPersistent) { run_sweep(SweepOp::Flush, true); }
TEST(FaultSweepTest, OpenSingle) { run_sweep(SweepOp::Open, false); }
TEST(FaultSweepTest, OpenPersistent) { run_sweep(SweepOp::Open, true); }

}  // namespace
}  // namespace tidal::reliability
