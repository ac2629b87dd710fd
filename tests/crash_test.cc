// Crash tests (G1, G5, and a crash during open): a child process
// (tidal_crash_child, fork+exec via posix_spawn) writes to a Db and is
// SIGKILLed at a random moment; the parent reopens the Db and checks every
// acknowledged write. TIDAL_CRASH_ROUNDS sets the number of kill rounds of
// the G1 test (60 in the default tier, 200 under scripts/test.sh --soak:
// crash_rounds()); the other tests run a share of them.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <iostream>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <rocksdb/db.h>
#include <rocksdb/utilities/debug.h>
#include <rocksdb/write_batch.h>

#include "crash_child.h"
#include "db/impl.h"
#include "erasure_scan.h"
#include "feed_util.h"
#include "raw_db.h"
#include "reliability_util.h"
#include "storage/format.h"
#include "storage/journal_format.h"
#include "tidal/db.h"

namespace tidal::reliability {
namespace {

using Clock = std::chrono::steady_clock;

int crash_rounds() { return testing::soak_rounds("TIDAL_CRASH_ROUNDS", 60, 200); }

MembershipStatus target_of(const std::string& op) { return op == "L" ? MembershipStatus::Left : MembershipStatus::Active; }

// ---- G1: SIGKILL during leaves and rejoins ----

// Reads `child`'s lines until it exits, SIGKILLing it `delay` after it
// printed "R" (ready), or, with `arm_on`, after its first line starting
// with `arm_on` (at most 60 s after "R"); every other line goes to
// `on_line`. Returns its wait() status, and when the kill was sent in
// `*killed_at` (if given).
int run_until_killed(Child& child, std::chrono::milliseconds delay,
                     const std::function<void(const std::string&)>& on_line, Clock::time_point* killed_at = nullptr,
                     const std::string& arm_on = {}) {
  bool armed = false, ready = false, killed = false;
  Clock::time_point kill_at{}, give_up{};
  std::vector<std::string> lines;
  for (bool open = true; open;) {
    if (!armed && !killed && ready && Clock::now() >= give_up) {
      kill_at = Clock::now() + delay;
      armed = true;
    }
    if (armed && Clock::now() >= kill_at) {
      child.kill();
      if (killed_at != nullptr) *killed_at = Clock::now();
      armed = false;
      killed = true;
    }
    lines.clear();
    open = child.read_lines(std::chrono::milliseconds(5), &lines);
    for (const std::string& line : lines) {
      if (line == "R") {
        ready = true;
        give_up = Clock::now() + (arm_on.empty() ? std::chrono::milliseconds(0) : std::chrono::milliseconds(60'000));
        continue;
      }
      if (!armed && !killed && !arm_on.empty() && line.rfind(arm_on, 0) == 0) {
        kill_at = Clock::now() + delay;
        armed = true;
      }
      on_line(line);
    }
  }
  return child.wait();
}

TEST(CrashTest, AcknowledgedLeavesAndRejoinsSurviveSigkill) {
  TempDir dir;
  const std::string path = dir.path() + "/db";
  const int rounds = crash_rounds();
  constexpr std::uint64_t kUsers = 48;
  std::vector<std::uint64_t> users;
  for (std::uint64_t u = 0; u < kUsers; ++u) users.push_back(u);

  std::mt19937_64 rng(20261129);
  AckModel model;
  ModelCheck totals;
  std::uint64_t acked = 0, noops = 0, kills = 0, unknown_ops = 0, unknown_lost = 0;
  const auto start = Clock::now();

  for (int round = 0; round < rounds && !::testing::Test::HasFailure(); ++round) {
    std::map<std::uint64_t, MembershipStatus> unknown;  // at most one: the op in flight at the kill
    {
      Child child({"ops", path, std::to_string(rng()), std::to_string(kUsers)});
      const auto spawn = Clock::now();
      std::optional<Clock::time_point> kill_at;
      bool killed = false;
      std::vector<std::string> lines;
      for (bool open = true; open;) {
        const auto now = Clock::now();
        if (!kill_at && now - spawn > std::chrono::seconds(30)) {
          FAIL() << "round " << round << ": the child did not open the Db within 30 s";
        }
        if (kill_at && !killed && now >= *kill_at) {
          child.kill();
          killed = true;
        }
        const auto wait = kill_at && !killed ? *kill_at - now : std::chrono::milliseconds(100);
        lines.clear();
        open = child.read_lines(wait, &lines);
        for (const std::string& line : lines) {
          std::istringstream in(line);
          std::string kind, op;
          std::uint64_t user = 0, size = 0, at = 0;
          in >> kind;
          if (kind == "R") {
            kill_at = Clock::now() + std::chrono::milliseconds(5 + rng() % 46);  // 5-50 ms of writes
          } else if (kind == "B") {
            in >> op >> user;
            unknown = {{user, target_of(op)}};
          } else if (kind == "A") {
            in >> op >> user >> size >> at;
            ASSERT_EQ(unknown.count(user), 1u) << "acknowledged an op never announced: " << line;
            unknown.clear();
            std::vector<MembershipEvent>& ev = model.events[user];
            if (model.status_of(user) == target_of(op)) {  // G7: no change
              ++noops;
              ASSERT_EQ(size, ev.size()) << "a redundant op changed the history: " << line;
            } else {
              ASSERT_EQ(size, ev.size() + 1) << line;
              ev.push_back({target_of(op), at});
            }
            ++acked;
          } else {
            FAIL() << "round " << round << ": child said: " << line;
          }
        }
      }
      const int status = child.wait();
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
          << "round " << round << ": the child ended by itself (status " << status << ")";
      ++kills;
    }
    unknown_ops += unknown.size();

    // Reopen: every acknowledged state is there, the gate is closed for Left users.
    auto sink = std::make_shared<CountingSink>();
    Options options;
    options.contribution_sink = sink;
    Result<std::unique_ptr<Db>> db = Db::open(path, options);
    ASSERT_TRUE(db.ok()) << "round " << round << ": reopen: " << db.status().to_string();
    const std::uint64_t applied_before = totals.unknown_applied;
    check_against_model(**db, sink.get(), model, users, unknown, /*allow_loss=*/false, &totals);
    unknown_lost += unknown.size() - (totals.unknown_applied - applied_before);
    ASSERT_OK((*db)->close());
  }
  const auto secs = std::chrono::duration<double>(Clock::now() - start).count();
  std::cout << "[crash G1] rounds (SIGKILLs): " << kills << ", acknowledged ops: " << acked << " (" << noops
            << " redundant, G7), in flight at the kill: " << unknown_ops << " (" << totals.unknown_applied
            << " applied, " << unknown_lost << " not), acknowledged events in the final history: " << model.size()
            << ", lost: " << totals.lost << ", gate probes: " << totals.gate_probes << ", " << secs << " s\n";
  EXPECT_EQ(kills, static_cast<std::uint64_t>(rounds));
  EXPECT_GT(acked, static_cast<std::uint64_t>(rounds)) << "too few writes per round to mean anything";
}

// ---- compound: SIGKILL while the Db opens (state rebuild, index backfill) ----

using testing::RawDb;

rocksdb::Slice sl(const std::string& s) { return {s.data(), s.size()}; }

// A Db of `n` users who left (every tenth one rejoined since), written raw in
// tidal's format. Without `indexed`, the by_tag index and its marker are
// absent, so the first open backfills it.
AckModel build_big_db(const std::string& path, std::uint64_t n, std::vector<std::uint64_t>* users) {
  {
    auto db = Db::open(path);  // creates the column families
    EXPECT_TRUE(db.ok()) << db.status().to_string();
  }
  AckModel model;
  RawDb raw(path);
  if (!raw.ok()) return model;
  rocksdb::WriteBatch batch;
  const std::uint64_t t0 = 1'700'000'000'000'000'000ULL;
  for (std::uint64_t i = 0; i < n; ++i) {
    const std::uint64_t user = 1'000'000 + i;
    const std::uint64_t left_at = t0 + i * 1000;
    users->push_back(user);
    std::vector<MembershipEvent>& ev = model.events[user];
    ev.push_back({MembershipStatus::Left, left_at});
    if (i % 10 == 9) ev.push_back({MembershipStatus::Active, left_at + 1});
    const CommunityMembership m{user, ev.back().status, left_at};
    const auto value = serialize_membership(m);
    const rocksdb::Slice v(value.data(), value.size());
    batch.Put(raw.cf(RawDb::kUsers), sl(encode_key(EntityId(user), Tag::CommunityLeave)), v);
    batch.Put(raw.cf(RawDb::kByTag), sl(encode_index_key(EntityId(user), Tag::CommunityLeave)), v);
    for (const auto& e : ev) {
      std::string suffix;
      put_u64_be(&suffix, e.at_ns);
      const char h = serialize_history_status(e.status);
      batch.Put(raw.cf(RawDb::kUsers), sl(encode_key(EntityId(user), Tag::CommunityLeaveHistory, suffix)), rocksdb::Slice(&h, 1));
    }
    if (batch.Count() >= 30000) {
      EXPECT_TRUE(raw.db(RawDb::kUsers)->Write(rocksdb::WriteOptions(), &batch).ok());
      batch.Clear();
    }
  }
  EXPECT_TRUE(raw.db(RawDb::kUsers)->Write(rocksdb::WriteOptions(), &batch).ok());
  return model;
}

// Removes the index and its marker, as a Db written before the index had.
void drop_index(const std::string& path) {
  RawDb raw(path);
  if (!raw.ok()) return;
  rocksdb::WriteBatch batch;
  batch.Delete(raw.cf(RawDb::kMeta), kIndexVersionKey);
  const std::string lo(1, '\0'), hi(1, '\xff');
  batch.DeleteRange(raw.cf(RawDb::kByTag), lo, hi + std::string(16, '\xff'));
  EXPECT_TRUE(raw.db(RawDb::kUsers)->Write(rocksdb::WriteOptions(), &batch).ok());
}

struct IndexState {
  bool marker = false;
  std::uint64_t leave_entries = 0;  // 0x11 records in by_tag
};
IndexState index_state(const std::string& path) {
  IndexState st;
  RawDb raw(path);
  if (!raw.ok()) return st;
  std::string v;
  st.marker = raw.db(RawDb::kMeta)->Get(rocksdb::ReadOptions(), raw.cf(RawDb::kMeta), kIndexVersionKey, &v).ok();
  std::unique_ptr<rocksdb::Iterator> it(raw.db(RawDb::kByTag)->NewIterator(rocksdb::ReadOptions(), raw.cf(RawDb::kByTag)));
  const char tag = static_cast<char>(Tag::CommunityLeave);
  for (it->Seek(rocksdb::Slice(&tag, 1)); it->Valid() && it->key()[0] == tag; it->Next()) ++st.leave_entries;
  return st;
}

// Runs `tidal_crash_child open` to the end and returns the time from spawn to "R".
Clock::duration time_open(const std::string& path) {
  Child child({"open", path});
  const auto spawn = Clock::now();
  Clock::duration ready{};
  std::vector<std::string> lines;
  while (child.read_lines(std::chrono::milliseconds(100), &lines)) {
    for (const auto& l : lines) {
      if (l == "R") ready = Clock::now() - spawn;
      if (l[0] == 'E') ADD_FAILURE() << "child: " << l;
    }
    lines.clear();
  }
  EXPECT_EQ(child.wait(), 0);
  return ready;
}

void crash_during_open(bool indexed) {
  TempDir dir;
  const std::string path = dir.path() + "/db";
  constexpr std::uint64_t kLeavers = 50'000;
  std::vector<std::uint64_t> users;
  AckModel model = build_big_db(path, kLeavers, &users);
  std::uint64_t left_count = 0;
  for (const auto& [u, ev] : model.events) left_count += ev.back().status == MembershipStatus::Left ? 1u : 0u;
  if (!indexed) drop_index(path);

  const auto open_time = time_open(path);  // also completes a backfill; redo it below
  const int rounds = std::max(10, crash_rounds() / 10);
  std::mt19937_64 rng(indexed ? 7 : 11);
  int killed_before_ready = 0, killed_after_ready = 0, finished = 0, backfill_interrupted = 0, aimed = 0;
  const auto open_us = std::chrono::duration_cast<std::chrono::microseconds>(open_time).count();
  for (int round = 0; round < rounds && !::testing::Test::HasFailure(); ++round) {
    if (!indexed) drop_index(path);  // every round starts with no index and no marker
    // Every fourth round of a backfill is aimed: the child kills itself right
    // after the backfill's 1st, 2nd or 3rd batch (of at least 4) was written.
    // The others kill at a random time, which only sometimes lands there.
    const int aim = !indexed && round % 4 == 0 ? 1 + (round / 4) % 3 : 0;
    aimed += aim > 0 ? 1 : 0;
    {
      Child child(aim > 0 ? std::vector<std::string>{"open", path, std::to_string(aim)}
                          : std::vector<std::string>{"open", path});
      const auto kill_at = aim > 0 ? Clock::time_point::max()
                                   : Clock::now() + std::chrono::microseconds(
                                                        rng() % static_cast<std::uint64_t>(open_us * 11 / 10 + 1));
      bool ready = false, killed = false;
      std::vector<std::string> lines;
      for (bool open = true; open;) {
        const auto now = Clock::now();
        if (!killed && now >= kill_at) {
          child.kill();
          killed = true;
        }
        lines.clear();
        open = child.read_lines(killed || aim > 0 ? std::chrono::milliseconds(100) : kill_at - now, &lines);
        for (const auto& l : lines) {
          if (l == "R") ready = true;
          if (l[0] == 'E') ADD_FAILURE() << "round " << round << ": child: " << l;
        }
      }
      const int status = child.wait();
      if (WIFSIGNALED(status)) {
        ready ? ++killed_after_ready : ++killed_before_ready;
      } else {
        ++finished;
      }
    }
    if (!indexed) {
      const IndexState st = index_state(path);
      const bool interrupted = !st.marker && st.leave_entries > 0;  // killed mid-backfill: a partial index
      backfill_interrupted += interrupted ? 1 : 0;
      if (aim > 0) {
        EXPECT_TRUE(interrupted) << "round " << round << ": killed after backfill batch " << aim << ", marker "
                                 << st.marker << ", " << st.leave_entries << " leave entries indexed";
      }
    }
    // A read-only open (which writes nothing, so an interrupted backfill stays
    // interrupted) sees every Left user gated.
    Options ro;
    ro.read_only = true;
    auto db = Db::open(path, ro);
    ASSERT_TRUE(db.ok()) << "round " << round << ": " << db.status().to_string();
    EXPECT_EQ((*db)->stats().users_left, left_count) << "round " << round;
  }

  // The clean reopen: everything present, every Left user gated, index complete.
  auto sink = std::make_shared<CountingSink>();
  Options options;
  options.contribution_sink = sink;
  auto db = Db::open(path, options);
  ASSERT_TRUE(db.ok()) << db.status().to_string();
  ModelCheck check;
  check_against_model(**db, sink.get(), model, users, {}, /*allow_loss=*/false, &check);
  EXPECT_EQ(check.users_checked, kLeavers);
  EXPECT_EQ((*db)->stats().users_left, left_count);
  Result<VerifyReport> report = (*db)->verify();
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_TRUE(report->ok()) << report->problems.size() << " problems, first: "
                            << (report->problems.empty() ? "" : report->problems.front());
  ASSERT_OK((*db)->leave_community_layer(1));
  std::cout << "[crash open" << (indexed ? "" : " + backfill") << "] leavers: " << kLeavers << " (" << left_count
            << " Left), open takes " << open_us / 1000 << " ms; rounds: " << rounds << ", killed before ready: "
            << killed_before_ready << ", after: " << killed_after_ready << ", finished: " << finished;
  if (!indexed) {
    std::cout << ", killed mid-backfill (partial index, no marker): " << backfill_interrupted << " (" << aimed
              << " aimed)";
  }
  std::cout << "; lost: " << check.lost << ", users checked: " << check.users_checked << "\n";
  if (!indexed) {
    EXPECT_GT(aimed, 0);
    EXPECT_GE(backfill_interrupted, aimed);
  }
}

// ---- G3 across a crash and a clock step-back (issue 9 item 6) ----

// The child signals with a sink that prints every stamp (forwarded_at_ns)
// it is handed and is SIGKILLed; the parent reopens with a wall clock 10 s
// behind the largest stamp printed, and a leave must still get a left_at_ns
// above every stamp. Only the clock's lease (a floor stored ahead of every
// stamp) carries that across the crash. The child's clock runs 1x or 100x
// (a lease renewal every ~7.5 ms), so kills land right after renewals too.
TEST(CrashTest, StampsStayBelowTheNextLeaveAfterSigkillAndAClockStepBack) {
  TempDir dir;
  const std::string path = dir.path() + "/db";
  const int rounds = std::max(10, crash_rounds() / 10);
  constexpr std::uint64_t kStepBack = 10'000'000'000;  // 10 s
  std::mt19937_64 rng(20261130);
  std::uint64_t stamps = 0, checked_rounds = 0, max_ahead = 0;
  for (int round = 0; round < rounds && !::testing::Test::HasFailure(); ++round) {
    std::uint64_t largest = 0;
    {
      Child child({"stamps", path, round % 2 == 0 ? "100" : "1"});
      std::optional<Clock::time_point> kill_at;
      std::vector<std::string> lines;
      for (bool open = true; open;) {
        const auto now = Clock::now();
        if (kill_at && now >= *kill_at) {
          child.kill();
          kill_at = Clock::time_point::max();
        }
        lines.clear();
        open = child.read_lines(std::chrono::milliseconds(5), &lines);
        for (const auto& l : lines) {
          if (l == "R" && !kill_at) kill_at = Clock::now() + std::chrono::milliseconds(5 + rng() % 46);
          if (l[0] == 'E') ADD_FAILURE() << "round " << round << ": child: " << l;
          if (l[0] == 'S') {
            largest = std::max<std::uint64_t>(largest, std::strtoull(l.c_str() + 2, nullptr, 10));
            ++stamps;
          }
        }
      }
      EXPECT_TRUE(WIFSIGNALED(child.wait())) << "round " << round;
    }
    if (largest == 0) continue;  // killed before the first stamp
    ++checked_rounds;
    Options options;
    options.clock = [t = largest - kStepBack] { return t; };  // the wall clock stepped back 10 s
    auto db = Db::open(path, options);
    ASSERT_TRUE(db.ok()) << "round " << round << ": " << db.status().to_string();
    ASSERT_OK((*db)->leave_community_layer(1));
    const std::uint64_t left_at = *(*db)->community_layer_status(1)->left_at_ns;
    EXPECT_GT(left_at, largest) << "round " << round << ": a leave after the crash sorts below a stamp handed out "
                                << largest - std::min(largest, left_at) << " ns earlier";
    max_ahead = std::max(max_ahead, left_at > largest ? left_at - largest : 0);
    ASSERT_OK((*db)->rejoin_community_layer(1));
    ASSERT_OK((*db)->close());
  }
  std::cout << "[crash stamps] rounds (SIGKILLs): " << rounds << ", with stamps: " << checked_rounds
            << ", stamps reported: " << stamps << ", largest lead of the first leave over the last stamp: "
            << max_ahead / 1000 << " us\n";
  EXPECT_GE(checked_rounds, static_cast<std::uint64_t>(rounds) / 2) << "too few rounds got to signal";
}

TEST(CrashTest, KillDuringOpenOf50kLeavers) { crash_during_open(true); }
TEST(CrashTest, KillDuringIndexBackfillOf50kLeavers) { crash_during_open(false); }

// ---- the state store's crash window ----

std::int64_t ns_of(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// The crash window a child's Db promised (docs/CONTRACT.md S4): every signal
// acknowledged more than aggregate_write_period + W before the kill is
// stored, W being the longest batch write the Db reported (the child's
// "W <ns> <CLOCK_MONOTONIC ns>" lines, a write overdue then counted as far as
// it got). A write still running at the kill may have grown since the last
// report, by at most the time from that report to the kill; kSlack covers
// the reading of the clocks around the calls. So the allowance follows what
// the disk did in that round, never a fixed figure a busy disk exceeds.
struct ReportedWrites {
  static constexpr auto kSlack = std::chrono::milliseconds(20);
  std::int64_t write_ns = 0;     // the longest write reported
  std::int64_t reported_at = 0;  // when it was read (0: no report yet)

  // Takes a "W" line; false for any other.
  bool take(const std::string& line) {
    std::istringstream in(line);
    std::string kind;
    std::int64_t ns = 0, at = 0;
    in >> kind >> ns >> at;
    if (kind != "W") return false;
    write_ns = std::max(write_ns, ns);
    reported_at = std::max(reported_at, at);
    return true;
  }
  // The window for a kill at `killed_at`; nullopt without a report (the
  // round then requires nothing).
  std::optional<std::chrono::nanoseconds> window(std::chrono::milliseconds period, Clock::time_point killed_at) const {
    if (reported_at == 0) return std::nullopt;
    const std::int64_t stale = std::max<std::int64_t>(0, ns_of(killed_at) - reported_at);
    return std::chrono::nanoseconds(period + kSlack) + std::chrono::nanoseconds(write_ns + stale);
  }
};

// A child signals (one new item per signal) with a short write period and is
// SIGKILLed 550-800 ms after it opened (with `scans`, 800-1,300 ms, while
// another of its threads runs re-materializations and bulk purges). After
// each kill, every signal that returned more than the period plus the
// longest write its Db reported before the kill (ReportedWrites) is in the
// personal, cohort and community aggregates, and verify() finds I1 intact.
void signals_survive_sigkill(bool scans) {
  TempDir dir;
  const int rounds = scans ? std::max(10, crash_rounds() * 3 / 20) : std::max(30, crash_rounds() / 2);
  constexpr auto kPeriod = std::chrono::milliseconds(20);
  std::mt19937_64 rng(20261130);
  std::uint64_t acked = 0, required = 0, in_window_found = 0, in_window = 0, lost = 0, scan_pairs = 0;
  std::int64_t longest_write = 0, widest = 0;
  const auto start = Clock::now();
  for (int round = 0; round < rounds && !::testing::Test::HasFailure(); ++round) {
    const std::string path = dir.path() + "/db" + std::to_string(round);
    std::vector<std::int64_t> ack_ns;  // by signal index
    ReportedWrites writes;
    Clock::time_point killed_at;
    {
      std::vector<std::string> args = {"signals", path, std::to_string(kPeriod.count())};
      if (scans) args.push_back("scans");
      Child child(args);
      const int status = run_until_killed(
          child, std::chrono::milliseconds(scans ? 800 + rng() % 501 : 550 + rng() % 251),
          [&](const std::string& line) {
            if (writes.take(line)) return;
            if (line.rfind("M ", 0) == 0) {
              ++scan_pairs;
              return;
            }
            std::istringstream in(line);
            std::string kind;
            std::uint64_t i = 0;
            std::int64_t ns = 0;
            in >> kind >> i >> ns;
            if (kind != "A") {
              ADD_FAILURE() << "round " << round << ": child said: " << line;
            } else {
              EXPECT_EQ(i, ack_ns.size()) << line;
              ack_ns.push_back(ns);
            }
          },
          // With scans, killed only once a re-materialization and bulk
          // purge pair has finished, while the next runs: a format-4
          // purge waits for the state engine's compactions under way, and
          // under the sanitizers a pair can outlast the whole delay.
          &killed_at, scans ? "M " : "");
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "round " << round << ": status " << status;
    }
    const std::optional<std::chrono::nanoseconds> window = writes.window(kPeriod, killed_at);
    const std::int64_t deadline_ns = window ? ns_of(killed_at) - window->count() : 0;
    longest_write = std::max(longest_write, writes.write_ns);
    widest = std::max<std::int64_t>(widest, window ? window->count() : 0);
    auto db = Db::open(path);
    ASSERT_TRUE(db.ok()) << "round " << round << ": reopen: " << db.status().to_string();
    for (std::uint64_t i = 0; i < ack_ns.size(); ++i) {
      Result<double> personal = (*db)->personal_score(i % 64, i);
      ASSERT_TRUE(personal.ok()) << personal.status().to_string();
      const bool found = *personal == 1.0;
      if (ack_ns[i] < deadline_ns) {
        ++required;
        if (!found) ++lost;
        EXPECT_TRUE(found) << "round " << round << ": signal " << i << " returned "
                           << (deadline_ns - ack_ns[i]) / 1000000 << " ms before the window ("
                           << window->count() / 1000000 << " ms: the period + the longest write reported, "
                           << writes.write_ns / 1000000 << " ms, + the report's age) and is lost";
      } else {
        ++in_window;
        in_window_found += found ? 1 : 0;
      }
      if (found) {  // the whole signal, never a part of it
        EXPECT_EQ(*(*db)->cohort_score(i % 8, i), 1.0) << "signal " << i;
        EXPECT_EQ(*(*db)->community_score(1000 + i % 64 % 4, i), 1.0) << "signal " << i;
      }
    }
    acked += ack_ns.size();
    Result<VerifyReport> report = (*db)->verify();
    ASSERT_TRUE(report.ok()) << report.status().to_string();
    ASSERT_TRUE(report->ok()) << "round " << round << ": " << report->problems.front();
    ASSERT_OK((*db)->close());
    db->reset();
    std::filesystem::remove_all(path);
  }
  const auto secs = std::chrono::duration<double>(Clock::now() - start).count();
  std::cout << (scans ? "[crash window, re-materializations and bulk purges running: " +
                            std::to_string(scan_pairs) + " pairs done] "
                      : std::string("[crash window] "))
            << "rounds (SIGKILLs): " << rounds << ", acknowledged signals: " << acked
            << ", returned before the window (period " << kPeriod.count() << " ms + the longest write the Db reported "
            << "that round, up to " << longest_write / 1000000 << " ms; widest window " << widest / 1000000
            << " ms): " << required << " (lost: " << lost << "), within the window: " << in_window << " ("
            << in_window_found << " stored anyway); I1 held after every round; " << secs << " s\n";
  EXPECT_EQ(lost, 0u);
  EXPECT_GT(required, 0u);
  if (scans) {
    EXPECT_GT(scan_pairs, 0u) << "no re-materialization and bulk purge finished: the rounds proved nothing";
  }
}

TEST(CrashTest, SignalsOutsideTheWritePeriodSurviveSigkill) { signals_survive_sigkill(/*scans=*/false); }

// Issue 26, item 3: re-materializations and bulk purges running beside the
// signals never stop the writer for their scans, so the window stays the
// period plus one write (as the Db reports it) and nothing older is lost.
TEST(CrashTest, SignalsOutsideTheWritePeriodSurviveSigkillWhileScansRun) { signals_survive_sigkill(/*scans=*/true); }

// The same under sustained overload: one Db, a child per round signaling
// flat out (a new user per signal, so every signal adds cells and ledger
// records and the state engine's compactions fall behind as the Db grows),
// SIGKILLed 1.5-3 s after it opened (TIDAL_OVERLOAD_ROUNDS rounds). The writer never holds a batch back,
// whatever the compactions do, so every signal acknowledged more than the
// period plus the longest write the Db reported (ReportedWrites) before the
// kill is stored, whole.
TEST(CrashTest, TheCrashWindowHoldsUnderSustainedOverload) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // Under a sanitizer the instrumented writer, on 2 cores shared with a
  // flat-out signaler and the other tests, took longer than the fixed 500 ms
  // allowance of the time (38,529 of 142,848 lost in CI's ASan stage, round
  // 0). The allowance now follows the write time the Db reports, so the skip
  // may go once the test has been run under the sanitizers; the main build
  // runs it.
  GTEST_SKIP() << "a timing window: not meaningful under a sanitizer's slowdown (run in the main build)";
#endif
  TempDir dir;
  // 4 in the default tier, 12 (about a minute) under --soak;
  // tests/RELIABILITY.md has a run of 30.
  const int rounds = testing::soak_rounds("TIDAL_OVERLOAD_ROUNDS", 4, 12);
  constexpr auto kPeriod = std::chrono::milliseconds(200);
  std::mt19937_64 rng(20261201);
  const std::string path = dir.path() + "/db";
  std::uint64_t first = 0, required = 0, lost = 0, acked = 0;
  std::uint64_t delayed = 0, max_l0 = 0, max_debt = 0;
  std::int64_t longest_write = 0, widest = 0;
  const auto start = Clock::now();
  for (int round = 0; round < rounds && !::testing::Test::HasFailure(); ++round) {
    std::vector<std::pair<std::uint64_t, std::int64_t>> acks;  // (last signal index, monotonic ns)
    std::uint64_t round_delayed = 0;
    ReportedWrites writes;
    Clock::time_point killed_at;
    {
      Child child({"overload", path, std::to_string(kPeriod.count()), std::to_string(first)});
      const int status = run_until_killed(
          child, std::chrono::milliseconds(1500 + rng() % 1501),
          [&](const std::string& line) {
            if (writes.take(line)) return;
            std::istringstream in(line);
            std::string kind;
            in >> kind;
            if (kind == "A") {
              std::uint64_t i = 0;
              std::int64_t ns = 0;
              in >> i >> ns;
              acks.emplace_back(i, ns);
            } else if (kind == "S") {
              std::uint64_t l0 = 0, debt = 0, paused = 0;
              in >> l0 >> debt >> paused;
              max_l0 = std::max(max_l0, l0);
              max_debt = std::max(max_debt, debt);
              round_delayed = paused;
            } else {
              ADD_FAILURE() << "round " << round << ": child said: " << line;
            }
          },
          &killed_at);
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "round " << round << ": status " << status;
    }
    const std::optional<std::chrono::nanoseconds> window = writes.window(kPeriod, killed_at);
    longest_write = std::max(longest_write, writes.write_ns);
    widest = std::max<std::int64_t>(widest, window ? window->count() : 0);
    // Every signal up to the last acknowledgement before the deadline.
    std::optional<std::uint64_t> must;
    for (const auto& [i, ns] : acks) {
      if (window && ns < ns_of(killed_at) - window->count()) must = i;
    }
    auto db = Db::open(path);
    ASSERT_TRUE(db.ok()) << "round " << round << ": reopen: " << db.status().to_string();
    const std::uint64_t last = acks.empty() ? first : acks.back().first + 1;
    if (must) {
      for (std::uint64_t i = first; i <= *must; ++i) {
        Result<double> personal = (*db)->personal_score(i, 7);
        ASSERT_TRUE(personal.ok()) << personal.status().to_string();
        ++required;
        if (*personal != 1.0) ++lost;
      }
      EXPECT_EQ(lost, 0u) << "round " << round << ": signals acknowledged more than " << window->count() / 1000000
                          << " ms before the kill (the period + the longest write reported, "
                          << writes.write_ns / 1000000 << " ms, + the report's age) are lost";
    }
    acked += last - first;
    delayed += round_delayed;
    first = last + 1'000'000;  // the next round's users are new ones
    ASSERT_OK((*db)->close());
  }
  Result<std::unique_ptr<Db>> db = Db::open(path);
  ASSERT_TRUE(db.ok()) << db.status().to_string();
  Result<VerifyReport> report = (*db)->verify();
  ASSERT_TRUE(report.ok()) << report.status().to_string();
  EXPECT_TRUE(report->ok()) << report->problems.front();
  const auto secs = std::chrono::duration<double>(Clock::now() - start).count();
  std::cout << "[overload crash window] rounds (SIGKILLs): " << rounds << ", acknowledged signals: " << acked
            << ", returned before the window (period " << kPeriod.count()
            << " ms + the longest write the Db reported that round, up to " << longest_write / 1000000
            << " ms; widest window " << widest / 1000000 << " ms): " << required << " (lost: " << lost
            << "); compaction debt seen by the child: up to " << max_l0 << " L0 files, " << (max_debt >> 20)
            << " MiB; signals paused by admission: " << delayed << "; I1 held at the end; " << secs << " s\n";
  EXPECT_EQ(lost, 0u);
  EXPECT_GT(required, 0u);
}

// ---- §7: SIGKILL during purges ----

// ---- the change feed ----

// A child signals, leaves, purges and rejoins with the change feed on and is
// SIGKILLed at a random moment, many times, on one Db. After each kill the
// reopened Db's feed runs 1, 2, 3, ... with no gap, and the sum of its
// deltas per cell equals every shared aggregate exactly: what the
// aggregates hold, the feed holds, and nothing else (no batch lost or
// written twice, across the writer's batches and the purges).
TEST(CrashTest, TheChangeFeedHoldsExactlyWhatTheAggregatesHoldAfterEverySigkill) {
  TempDir dir;
  const std::string path = dir.path() + "/db";
  constexpr std::uint64_t kShard = 7;
  const int rounds = std::max(10, crash_rounds() / 5);
  std::mt19937_64 rng(20261201);
  std::uint64_t purges = 0, last_seq = 0, seq_growth_rounds = 0;
  for (int round = 0; round < rounds && !::testing::Test::HasFailure(); ++round) {
    {
      Child child({"feed", path, std::to_string(kShard), std::to_string(round)});
      const int status = run_until_killed(child, std::chrono::milliseconds(50 + rng() % 400), [&](const std::string& line) {
        if (line.starts_with("P ")) {
          ++purges;
        } else {
          ADD_FAILURE() << "round " << round << ": child said: " << line;
        }
      });
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "round " << round << ": status " << status;
    }
    const std::string ctx = "round " + std::to_string(round);
    Options options;
    options.change_feed = true;
    options.shard_id = kShard;
    auto db = Db::open(path, options);
    ASSERT_TRUE(db.ok()) << ctx << ": reopen: " << db.status().to_string();
    std::map<std::string, Units> sums;
    const std::uint64_t last = testing::sum_feed(**db, &sums);
    ASSERT_EQ(last, *(*db)->last_change_seq()) << ctx;
    seq_growth_rounds += last > last_seq ? 1 : 0;
    last_seq = last;
    for (std::uint64_t item = 0; item < 50; ++item) {
      for (std::uint64_t c = 0; c < 7; ++c) {
        ASSERT_EQ(units_to_double(sums[encode_aggregate_key(AggregateKind::Cohort, c, item)]),
                  testing::value_of((*db)->cohort_score(c, item)))
            << ctx << ": cohort " << c << " item " << item;
      }
      for (std::uint64_t m = 100; m < 103; ++m) {
        ASSERT_EQ(units_to_double(sums[encode_aggregate_key(AggregateKind::Community, m, item)]),
                  testing::value_of((*db)->community_score(m, item)))
            << ctx << ": community " << m << " item " << item;
      }
    }
    Result<VerifyReport> report = (*db)->verify();
    ASSERT_OK(report);
    ASSERT_TRUE(report->ok()) << ctx << ": " << report->problems.front();
    ASSERT_OK((*db)->close());
  }
  std::cout << "[crash feed] rounds (SIGKILLs): " << rounds << ", feed batches at the end: " << last_seq
            << ", rounds whose feed grew: " << seq_growth_rounds << ", purges acknowledged: " << purges
            << "; after every kill the feed ran 1.." << last_seq
            << " without a gap and summed to every shared aggregate exactly\n";
  EXPECT_GT(purges, 0u);
  EXPECT_GT(seq_growth_rounds, static_cast<std::uint64_t>(rounds) / 2);
}

// One Db across every round; round r purges users r * 100000 + 1, ... Each
// acknowledged purge must have its receipt (4 entries) and leave nothing for
// a second purge; the in-flight one is all or nothing; I1 holds and
// re-materialization finds nothing after every kill. Even rounds write each
// purge's batch through the WAL, odd ones ingest it as files.
TEST(CrashTest, PurgesAreAllOrNothingAndAcknowledgedOnesSurviveSigkill) {
  TempDir dir;
  const std::string path = dir.path() + "/db";
  const int rounds = std::max(1, crash_rounds() / 2);
  std::mt19937_64 rng(20261201);
  std::uint64_t acked = 0, in_flight_done = 0, in_flight_not = 0;
  const auto start = Clock::now();
  for (int round = 0; round < rounds && !::testing::Test::HasFailure(); ++round) {
    const std::uint64_t first = static_cast<std::uint64_t>(round) * 100000 + 1;
    std::set<std::uint64_t> flushed, begun;
    std::map<std::uint64_t, std::uint64_t> done;  // user -> entries removed
    {
      // Every other round, each batch ingested as files instead of written
      // through the WAL (Db::Impl::purge_wal_entries).
      Child child(round % 2 == 0 ? std::vector<std::string>{"purges", path, std::to_string(first)}
                                 : std::vector<std::string>{"purges", path, std::to_string(first), "files"});
      const int status = run_until_killed(child, std::chrono::milliseconds(20 + rng() % 200), [&](const std::string& line) {
        std::istringstream in(line);
        std::string kind;
        std::uint64_t u = 0, n = 0;
        in >> kind >> u >> n;
        if (kind == "F") {
          flushed.insert(u);
        } else if (kind == "B") {
          begun.insert(u);
        } else if (kind == "A") {
          done[u] = n;
        } else {
          ADD_FAILURE() << "round " << round << ": child said: " << line;
        }
      });
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "round " << round << ": status " << status;
    }
    const std::string ctx = "round " + std::to_string(round);
    auto db = Db::open(path);
    ASSERT_TRUE(db.ok()) << ctx << ": reopen: " << db.status().to_string();
    Result<VerifyReport> report = (*db)->verify();
    ASSERT_OK(report);
    ASSERT_TRUE(report->ok()) << ctx << ": " << report->problems.front();
    Result<RematerializeReport> remat = (*db)->rematerialize_shared_aggregates();
    ASSERT_OK(remat);
    ASSERT_TRUE(remat->mismatches.empty()) << ctx << ": " << remat->mismatches.front();
    for (std::uint64_t u : begun) {
      Result<std::vector<PurgeReceipt>> receipts = (*db)->purge_receipts(u);
      ASSERT_OK(receipts);
      const bool purged = !receipts->empty();
      ASSERT_LE(receipts->size(), 1u) << ctx << ": user " << u;
      if (done.count(u) != 0) {
        ++acked;
        EXPECT_EQ(done[u], 4u) << ctx << ": user " << u;
        ASSERT_TRUE(purged) << ctx << ": acknowledged purge of user " << u << " has no receipt";
      } else {
        ++(purged ? in_flight_done : in_flight_not);
      }
      if (purged) {
        EXPECT_EQ((*receipts)[0].entries_removed, 4u) << ctx << ": user " << u;
        // A kill between the purge's batch and the end of its erasure left
        // a mark; the reopen finished the erasure (P4).
        EXPECT_TRUE((*receipts)[0].erasure_complete) << ctx << ": user " << u;
        const testing::ErasureScan after = testing::scan_files(path, u);
        for (const std::string& f : after.found) {
          ADD_FAILURE() << ctx << ": purged user " << u << " after reopen: " << f << "\nThe scan read " << after.summary();
        }
      }
      // All or nothing: both cells of the cohort and of the community.
      for (std::uint64_t item : {std::uint64_t{1}, std::uint64_t{2}}) {
        const double full = item == 1 ? 1.5 : 0.25;
        EXPECT_EQ(testing::value_of((*db)->cohort_score(u, item)), purged ? 0.0 : full) << ctx << ": user " << u;
        EXPECT_EQ(testing::value_of((*db)->community_score(u, item)), purged ? 0.0 : full) << ctx << ": user " << u;
      }
      Result<PurgeReceipt> again = (*db)->purge_community_contributions(u);
      ASSERT_OK(again);
      EXPECT_EQ(again->entries_removed, purged ? 0u : 4u) << ctx << ": second purge of user " << u;
    }
    for (std::uint64_t u : flushed) {
      if (begun.count(u) == 0) {
        EXPECT_EQ(testing::value_of((*db)->cohort_score(u, 1)), 1.5) << ctx << ": user " << u;
      }
    }
    ASSERT_OK((*db)->close());
  }
  const auto secs = std::chrono::duration<double>(Clock::now() - start).count();
  std::cout << "[crash purges] rounds (SIGKILLs): " << rounds << ", acknowledged purges: " << acked
            << " (all with their receipt, a second purge removed nothing), in flight at the kill: "
            << in_flight_done + in_flight_not << " (" << in_flight_done << " done, " << in_flight_not
            << " not done, none half; every purged ledger erased after the reopen); I1 and re-materialization clean "
               "after every round; " << secs << " s\n";
  EXPECT_GT(acked, 0u);
}

// Runs `tidal_crash_child <mode> <path> <user>` (journal-purge, purge-keys)
// to its SIGKILL; true when it printed `marker` (the step it was killed at)
// before. Any other line but "R", or another end, is a failure.
bool purge_child_killed_at(const std::string& mode, const std::string& path, std::uint64_t user,
                           const std::string& marker) {
  Child child({mode, path, std::to_string(user)});
  std::vector<std::string> lines;
  while (child.read_lines(std::chrono::milliseconds(100), &lines)) {
  }
  bool reached = false;
  for (const std::string& line : lines) {
    if (line == marker) reached = true;
    else if (line != "R") ADD_FAILURE() << "child said: " << line;
  }
  const int status = child.wait();
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  return reached && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
}

// J6: a process killed once a purge's intent is journaled (durable) and
// before the purge's batch: the next open finishes the purge, with the
// receipt the intent names, and erases the ledger.
TEST(CrashTest, APurgeKilledBetweenItsJournaledIntentAndItsBatchIsFinishedByTheNextOpen) {
  TempDir dir;
  const std::string path = dir.path() + "/db";
  const std::uint64_t user = 40;
  ASSERT_TRUE(purge_child_killed_at("journal-purge", path, user, "I")) << "the child never reached the purge's intent";
  Options options;
  options.journal = true;
  options.shard_id = 3;
  auto db = Db::open(path, options);
  ASSERT_TRUE(db.ok()) << db.status().to_string();
  Result<std::vector<JournalEntry>> entries = (*db)->read_journal(0, 1 << 20);
  ASSERT_OK(entries);
  ASSERT_EQ(entries->size(), 2u);  // the leave, the purge's intent
  std::optional<JournalRecord> r = decode_journal_payload((*entries)[1].payload);
  ASSERT_TRUE(r.has_value());
  ASSERT_EQ(r->kind, JournalKind::Purge);
  EXPECT_EQ(r->user_id, user);
  Result<std::vector<PurgeReceipt>> receipts = (*db)->purge_receipts(user);
  ASSERT_OK(receipts);
  ASSERT_EQ(receipts->size(), 1u) << "the reopen did not finish the journaled purge";
  EXPECT_EQ((*receipts)[0].purged_at_ns, r->at_ns);
  EXPECT_EQ((*receipts)[0].left_at_ns, r->left_at_ns);
  EXPECT_EQ((*receipts)[0].entries_removed, 4u);
  EXPECT_TRUE((*receipts)[0].erasure_complete);
  for (const std::string& f : testing::scan_files(path, user).found) ADD_FAILURE() << "purged ledger still in " << f;
  // Only user + 1's contribution is left, exactly.
  EXPECT_EQ(testing::value_of((*db)->cohort_score(user, 1)), 0.5);
  EXPECT_EQ(testing::value_of((*db)->community_score(user, 1)), 0.5);
  EXPECT_EQ(testing::value_of((*db)->cohort_score(user, 2)), 0.0);
  Result<RematerializeReport> remat = (*db)->rematerialize_shared_aggregates();
  ASSERT_OK(remat);
  EXPECT_TRUE(remat->mismatches.empty());
  ASSERT_OK((*db)->close());
}

// Format 4: a process killed once a purge's batch is ingested and before
// the user's ledger key is deleted (a step in another engine): the next
// open deletes the key its erasure mark names and erases it from every
// file; the purge itself was whole. A rejoined user's next key is new.
TEST(CrashTest, APurgeKilledBeforeItsKeyIsDeletedHasItErasedByTheNextOpen) {
  TempDir dir;
  const std::string path = dir.path() + "/db";
  const std::uint64_t user = 40;
  ASSERT_TRUE(purge_child_killed_at("purge-keys", path, user, "K")) << "the child never reached the purge's key deletion";
  const testing::ErasureScan before = testing::scan_files(path, user);
  ASSERT_EQ(before.user_keys.size(), 1u) << "the killed purge left no key to erase";
  ASSERT_FALSE(before.found.empty()) << before.summary();
  Options options;
  options.journal = true;
  options.shard_id = 3;
  auto db = Db::open(path, options);
  ASSERT_TRUE(db.ok()) << db.status().to_string();
  Result<std::vector<PurgeReceipt>> receipts = (*db)->purge_receipts(user);
  ASSERT_OK(receipts);
  ASSERT_EQ(receipts->size(), 1u);
  EXPECT_EQ((*receipts)[0].entries_removed, 4u);
  EXPECT_TRUE((*receipts)[0].erasure_complete);
  for (const std::string& f : testing::scan_files(path, user, before.user_keys).found) {
    ADD_FAILURE() << "after the reopen: " << f;
  }
  EXPECT_EQ(testing::value_of((*db)->cohort_score(user, 1)), 0.5);
  EXPECT_EQ(testing::value_of((*db)->cohort_score(user, 2)), 0.0);
  // The user comes back: a new key, which the next purge erases in turn.
  ASSERT_OK((*db)->rejoin_community_layer(user));
  Result<SignalOutcome> signalled = (*db)->signal_with_context({user, 2, 2.0}, SignalContext{{user}});
  ASSERT_OK(signalled.status());
  ASSERT_OK((*db)->flush());
  const testing::ErasureScan rejoined = testing::scan_files(path, user);
  ASSERT_EQ(rejoined.user_keys.size(), 1u);
  EXPECT_NE(rejoined.user_keys, before.user_keys);
  Result<VerifyReport> v = (*db)->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << v->problems.front();
  ASSERT_OK((*db)->leave_community_layer(user));
  Result<PurgeReceipt> again = (*db)->purge_community_contributions(user);
  ASSERT_OK(again);
  EXPECT_EQ(again->entries_removed, 2u);
  for (const std::string& f : testing::scan_files(path, user, rejoined.user_keys).found) {
    ADD_FAILURE() << "after the second purge: " << f;
  }
  EXPECT_EQ(testing::value_of((*db)->cohort_score(user, 2)), 0.0);
  ASSERT_OK((*db)->close());
}

// Options::strict_erasure after a kill between a purge's batch and its
// erasure: the open that finishes the erasure no longer knows which cells
// the batch touched, and compacts every range of the state engine's
// aggregates, receipts and sealed index, so that each cell has one version
// left and the receipt's sequence number is 0.
TEST(CrashTest, AStrictErasureCutShortByAKillIsFinishedByTheNextOpenOverEveryRange) {
  TempDir dir;
  const std::string path = dir.path() + "/db";
  const std::uint64_t user = 40;
  ASSERT_TRUE(purge_child_killed_at("purge-keys", path, user, "K")) << "the child never reached the purge's key deletion";
  Options options;
  options.journal = true;
  options.shard_id = 3;
  options.strict_erasure = true;
  {
    auto db = Db::open(path, options);
    ASSERT_TRUE(db.ok()) << db.status().to_string();
    Result<std::vector<PurgeReceipt>> receipts = (*db)->purge_receipts(user);
    ASSERT_OK(receipts);
    ASSERT_EQ(receipts->size(), 1u);
    EXPECT_TRUE((*receipts)[0].erasure_complete);
    EXPECT_EQ(testing::value_of((*db)->cohort_score(user, 1)), 0.5);
    ASSERT_OK((*db)->close());
  }
  testing::RawReader state(path + "/state");
  for (const char* family : {"aggregates", "receipts"}) {
    std::vector<rocksdb::KeyVersion> versions;
    ASSERT_TRUE(rocksdb::GetAllKeyVersions(state.db(), state.cf(family), rocksdb::Slice(), rocksdb::Slice(),
                                           std::numeric_limits<std::size_t>::max(), &versions)
                    .ok());
    ASSERT_FALSE(versions.empty()) << family;
    std::map<std::string, int> count;
    for (const rocksdb::KeyVersion& v : versions) {
      EXPECT_EQ(++count[v.user_key], 1) << family << " key " << hex(v.user_key) << " has more than one version";
      EXPECT_EQ(v.sequence, 0u) << family << " key " << hex(v.user_key);
    }
  }
}

// A backup SIGKILLed at each of its steps: once the Db is opened again,
// nothing of it is left beside the backup directory (no staging copy
// holding ledger records that later purges erase from the Db, no
// directory without its manifest), and the Db's directory holds no marker;
// killed after its rename, the backup is whole and opens recovering
// (issue 41, item 5).
TEST(CrashTest, ABackupKilledAtAnyStepLeavesNothingButAWholeBackupOnceTheDbIsOpenedAgain) {
  for (int step = 1; step <= 5; ++step) {
    SCOPED_TRACE("killed at backup step " + std::to_string(step));
    TempDir dir;
    const std::string path = dir.path() + "/db";
    const std::string root = dir.path() + "/backups";
    ASSERT_TRUE(std::filesystem::create_directory(root));
    const std::string backup = root + "/b1";
    {
      Child child({"backup", path, backup, std::to_string(step)});
      const int status = wait_for_kill(child);
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
    }
    auto entries = [](const std::string& d) {
      std::set<std::string> names;
      for (const auto& e : std::filesystem::directory_iterator(d)) names.insert(e.path().filename().string());
      return names;
    };
    const std::set<std::string> left_by_kill = entries(root);
    if (step >= 2 && step <= 4) {
      EXPECT_EQ(left_by_kill.size(), 1u) << "the killed backup left no staging copy";
    }
    {
      auto db = Db::open(path);
      ASSERT_TRUE(db.ok()) << db.status().to_string();
      for (const std::string& name : entries(path)) {
        EXPECT_NE(name.rfind("TIDAL_BACKUP_PENDING", 0), 0u) << name << " left in the Db's directory";
      }
      // The users whose records a leftover copy would keep.
      ASSERT_OK((*db)->leave_community_layer(40));
      ASSERT_OK((*db)->purge_community_contributions(40));
      ASSERT_OK((*db)->close());
    }
    if (step < 5) {
      EXPECT_TRUE(entries(root).empty()) << "left beside the backup: " << *entries(root).begin();
      EXPECT_TRUE(testing::scan_files(root, 40).found.empty());
    } else {
      EXPECT_EQ(entries(root), std::set<std::string>{"b1"});
      EXPECT_TRUE(std::filesystem::exists(backup + "/TIDAL_BACKUP"));
      auto copy = Db::open(backup);
      ASSERT_TRUE(copy.ok()) << copy.status().to_string();
      EXPECT_TRUE((*copy)->stats().recovering);
    }
  }
}

}  // namespace
}  // namespace tidal::reliability
