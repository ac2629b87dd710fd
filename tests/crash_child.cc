// The writer process of the crash tests (tests/crash_test.cc). The parent
// SIGKILLs it at a random moment; every line it writes to stdout (a pipe the
// parent reads continuously) is one write(2), so a line is either whole or
// absent.
//
//   tidal_crash_child ops <db-path> <seed> <users>
//     Opens the Db with default Options (sync_writes on), prints "R", then
//     forever: picks a random user and a leave or rejoin (mostly the one that
//     changes state, sometimes the redundant one, G7), prints
//       "B <L|J> <user>"                         before the call, then
//       "A <L|J> <user> <history size> <at_ns>"  after it returned OK, with
//     the size of the user's history and the at_ns of its last entry.
//     On an error prints "E <message>" and exits 3.
//   tidal_crash_child signals <db-path> <period-ms>
//     Opens the Db with aggregate_write_period = <period-ms>, user u (0-63)
//     joined to community 1000 + u % 4, prints "R", then for i = 0, 1, ...
//     signals user i % 64 on item i with weight 1 and cohort i % 8, and after
//     each returned prints "A <i> <CLOCK_MONOTONIC ns>" and pauses 100 us
//     (a steady few thousand signals a second, so rounds stay short).
//     Meanwhile, every 5 ms, prints "W <write ns> <CLOCK_MONOTONIC ns>": the
//     longest batch write the Db reports (Stats::aggregate_write_max_ns, a
//     write overdue then counted as far as it got) and when it was read.
//   tidal_crash_child signals <db-path> <period-ms> scans
//     The same, while another thread runs, in turn, a re-materialization
//     (no repair) and a bulk purge of 2,000 new users (ids from 1,000,000,
//     each signalled once on item 1,000,000,000 + its id with cohort 99,
//     then left in bulk), printing "M <n>" after the n-th of each pair
//     (issue 26, item 3: neither may stop the writer).
//   tidal_crash_child stamps <db-path> <speed>
//     Opens the Db with a ContributionSink that prints "S <forwarded_at_ns>"
//     for every contribution it is handed, and a clock running `speed` times
//     faster than the wall clock from the current time (so the clock's lease
//     is renewed often), prints "R", joins users 1 and 2 to community 10,
//     then signals them from two threads forever (each signal: one cohort
//     and one community contribution).
//   tidal_crash_child purges <db-path> <first-user> [files]
//     Opens the Db, prints "R", then for u = first-user, first-user + 1, ...:
//     joins u to community u, signals u on items 1 (weight 1.5) and 2
//     (0.25) with cohort u, flushes and prints "F <u>", leaves and prints
//     "B <u>", purges u and prints "A <u> <entries removed>" (4 expected).
//     Each purge's batch goes through the WAL, or with "files" is ingested
//     as files (Db::Impl::purge_wal_entries).
//   tidal_crash_child feed <db-path> <shard> <seed>
//     Opens the Db with the change feed on (shard <shard>), joins users
//     0-39 to communities 100-102, prints "R", then signals random users on
//     items 0-49 with two of cohorts 0-6 (the writer writes every 20 ms), and
//     every 300 signals leaves, purges and rejoins a user, printing "P <u>".
//   tidal_crash_child overload <db-path> <period-ms> <first>
//     Opens the Db with aggregate_write_period = <period-ms>, prints "R",
//     then signals flat out on one thread, for i = first, first + 1, ...: a
//     new user i on item 7 with weight 1 and cohort i % 1000; after each
//     signal with i % 256 == 255 returned prints "A <i> <CLOCK_MONOTONIC ns>"
//     (every signal up to i had returned then), and every 4096 signals
//     "S <compaction debt L0 files> <debt bytes> <signals paused so far>";
//     and "W ..." lines as in signals mode.
//   tidal_crash_child migrate <db-path> <step>
//     Opens the Db (a format-2 one, with the change feed of shard 7), and
//     SIGKILLs itself when the upgrade to format 3 reaches <step>
//     (Storage::step_for_testing); exits 0 if it never does.
//   tidal_crash_child upgrade4 <db-path> <step>
//     Opens the Db (a format-3 one) and SIGKILLs itself when the upgrade to
//     format 4 reaches <step> (Storage::step_for_testing "upgrade4": 1 once
//     the sealed ledger's family exists, 2 once the key store's does, 3 once
//     the format is written); exits 0 if it never does.
//   tidal_crash_child journal-purge <db-path> <user>
//     Opens the Db with the privacy journal on (shard 3), joins <user> and
//     <user> + 1 to community <user>, signals <user> on items 1 (weight 1.5)
//     and 2 (0.25) and <user> + 1 on item 1 (0.5), each with cohort <user>,
//     flushes, leaves <user>, prints "R", and purges it with a hook
//     (Db::Impl::after_purge_intent_for_testing) that prints "I" and SIGKILLs
//     the process once the purge's intent is durable, before its batch.
//   tidal_crash_child purge-keys <db-path> <user>
//     As journal-purge, but prints "K" and SIGKILLs the process once the
//     purge's batch is ingested, before its ledger keys are deleted
//     (Storage::step_for_testing "purge" 1).
//   tidal_crash_child backup <db-path> <backup-dir> <step>
//     Opens the Db, joins users 40 and 41 to community 40, signals each on
//     item 1 (weight 1.5) with cohort 40, flushes, prints "R", and backs up
//     into <backup-dir>, SIGKILLing itself when the backup reaches <step>
//     (Storage::step_for_testing "backup"); prints "E ..." and exits 3 if
//     it never does.
//   tidal_crash_child reseed <db-path> <shard> <task> <step>
//     Opens the Db with the change feed on (shard <shard>) and re-seeds its
//     feed, SIGKILLing itself when task <task> reaches <step>
//     (Storage::step_for_testing); prints "E ..." and exits 3 if it never
//     does.
//   tidal_crash_child finish <db-path> <shard> <task> <step>
//     Opens the Db (a restored backup whose journal was replayed) with the
//     change feed and the privacy journal on (shard <shard>) and calls
//     finish_recovery, SIGKILLing itself as reseed does.
//   tidal_crash_child open <db-path> [<backfill-batch>]
//     Opens the Db, prints "R", closes it, prints "C" and exits 0 (the parent
//     kills it while it opens: the start-up scan and the index backfill).
//     With <backfill-batch> n > 0 it SIGKILLs itself right after the n-th
//     batch of an index backfill was written (Storage::step_for_testing).
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "db/impl.h"
#include "storage/storage.h"
#include "tidal/db.h"

namespace {

void say(const std::string& line) {
  const std::string out = line + "\n";
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::write(STDOUT_FILENO, out.data() + done, out.size() - done);
    if (n <= 0) std::_Exit(4);
    done += static_cast<std::size_t>(n);
  }
}

[[noreturn]] void fail(const std::string& what, const tidal::Status& s) {
  say("E " + what + ": " + s.to_string());
  std::_Exit(3);
}

int run_ops(const std::string& path, std::uint64_t seed, std::uint64_t users) {
  auto db = tidal::Db::open(path);
  if (!db.ok()) fail("open", db.status());
  say("R");
  std::mt19937_64 rng(seed);
  for (;;) {
    const std::uint64_t user = rng() % users;
    auto status = (*db)->community_layer_status(user);
    if (!status.ok()) fail("status", status.status());
    const bool left = status->status == tidal::MembershipStatus::Left;
    const bool redundant = rng() % 8 == 0;
    const bool leave = left == redundant;  // toggle, or repeat the current state
    say(std::string("B ") + (leave ? "L " : "J ") + std::to_string(user));
    tidal::Status s = leave ? (*db)->leave_community_layer(user) : (*db)->rejoin_community_layer(user);
    if (!s.ok()) fail(leave ? "leave" : "rejoin", s);
    auto history = (*db)->community_layer_history(user);
    if (!history.ok()) fail("history", history.status());
    const std::uint64_t at = history->empty() ? 0 : history->back().at_ns;
    say(std::string("A ") + (leave ? "L " : "J ") + std::to_string(user) + " " + std::to_string(history->size()) +
        " " + std::to_string(at));
  }
}

std::int64_t monotonic_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Prints "W <longest write ns> <CLOCK_MONOTONIC ns>" every 5 ms, forever
// (the parent kills the process).
void report_write_times(tidal::Db* db) {
  std::thread([db] {
    for (;;) {
      const tidal::Stats st = db->stats();
      say("W " + std::to_string(st.aggregate_write_max_ns) + " " + std::to_string(monotonic_ns()));
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }).detach();
}

// Re-materializations and bulk purges of new users, in turn, forever (the
// "scans" of signals mode); their signals touch no cell the parent checks.
void run_scans(tidal::Db* db) {
  std::thread([db] {
    constexpr std::uint64_t kUsers = 2'000;
    std::vector<std::uint64_t> users(kUsers);
    for (std::uint64_t n = 1;; ++n) {
      auto report = db->rematerialize_shared_aggregates(false);
      if (!report.ok()) fail("rematerialize", report.status());
      if (!report->mismatches.empty()) fail("rematerialize", tidal::Status::Corruption(report->mismatches.front()));
      for (std::uint64_t k = 0; k < kUsers; ++k) {
        users[k] = 1'000'000 + n * kUsers + k;
        auto out = db->signal_with_context({users[k], 1'000'000'000 + users[k], 1.0}, tidal::SignalContext{{99}});
        if (!out.ok()) fail("signal", out.status());
      }
      if (tidal::Status s = db->leave_community_layer(users); !s.ok()) fail("bulk leave", s);
      auto purged = db->purge_community_contributions(users);
      if (!purged.ok()) fail("bulk purge", purged.status());
      say("M " + std::to_string(n));
    }
  }).detach();
}

int run_signals(const std::string& path, std::uint64_t period_ms, bool scans) {
  tidal::Options options;
  options.aggregate_write_period = std::chrono::milliseconds(period_ms);
  auto db = tidal::Db::open(path, options);
  if (!db.ok()) fail("open", db.status());
  for (std::uint64_t u = 0; u < 64; ++u) {
    if (tidal::Status s = (*db)->join_community(u, 1000 + u % 4); !s.ok()) fail("join", s);
  }
  say("R");
  report_write_times(db->get());
  if (scans) run_scans(db->get());
  for (std::uint64_t i = 0;; ++i) {
    auto out = (*db)->signal_with_context({i % 64, i, 1.0}, tidal::SignalContext{{i % 8}});
    if (!out.ok()) fail("signal", out.status());
    const auto now = std::chrono::steady_clock::now().time_since_epoch();
    say("A " + std::to_string(i) + " " +
        std::to_string(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count()));
    ::usleep(100);
  }
}

int run_overload(const std::string& path, std::uint64_t period_ms, std::uint64_t first) {
  tidal::Options options;
  options.aggregate_write_period = std::chrono::milliseconds(period_ms);
  auto db = tidal::Db::open(path, options);
  if (!db.ok()) fail("open", db.status());
  say("R");
  report_write_times(db->get());
  for (std::uint64_t i = first;; ++i) {
    auto out = (*db)->signal_with_context({i, 7, 1.0}, tidal::SignalContext{{i % 1000}});
    // Busy: admission's hard stop (compactions far behind); retry, as a host would.
    while (out.status().code() == tidal::StatusCode::Busy) {
      ::usleep(10'000);
      out = (*db)->signal_with_context({i, 7, 1.0}, tidal::SignalContext{{i % 1000}});
    }
    if (!out.ok()) fail("signal", out.status());
    if (i % 4096 == 4095) {
      const tidal::Stats st = (*db)->stats();
      say("S " + std::to_string(st.compaction_debt_l0_files) + " " + std::to_string(st.compaction_debt_bytes) + " " +
          std::to_string(st.admission_delayed_signals));
    }
    if (i % 256 == 255) {
      const auto now = std::chrono::steady_clock::now().time_since_epoch();
      say("A " + std::to_string(i) + " " +
          std::to_string(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count()));
    }
  }
}

// Kills this process when the start-up task `task` reaches `step` (see
// Storage::step_for_testing).
void kill_at_step(std::string task, int step) {
  tidal::Storage::step_for_testing = [task = std::move(task), step](std::string_view at_task, int at) {
    if (at_task == task && at == step) ::raise(SIGKILL);
  };
}

// Opens the Db at `path`, SIGKILLed when `task` (an upgrade) reaches `step`.
int run_upgrade(const std::string& path, const char* task, int step) {
  kill_at_step(task, step);
  tidal::Options options;
  if (std::string_view(task) == "migrate") {  // the format-2 fixture's change feed
    options.change_feed = true;
    options.shard_id = 7;
  }
  auto db = tidal::Db::open(path, options);
  if (!db.ok()) fail("open", db.status());
  if (tidal::Status s = (*db)->close(); !s.ok()) fail("close", s);
  return 0;
}

// Signals users 0..39 (joined to communities 100..102) on items 0..49 with
// cohorts 0..6, with the change feed on; every 300 signals leaves, purges
// and rejoins one user. The writer writes every 20 ms.
int run_feed(const std::string& path, std::uint64_t shard, std::uint64_t seed) {
  tidal::Options options;
  options.change_feed = true;
  options.shard_id = shard;
  options.aggregate_write_period = std::chrono::milliseconds(20);
  auto db = tidal::Db::open(path, options);
  if (!db.ok()) fail("open", db.status());
  for (std::uint64_t u = 0; u < 40; ++u) {
    if (tidal::Status s = (*db)->join_community(u, 100 + u % 3); !s.ok()) fail("join", s);
  }
  say("R");
  std::mt19937_64 rng(seed);
  for (std::uint64_t i = 1;; ++i) {
    const std::uint64_t user = rng() % 40;
    const double weight = static_cast<double>(rng() % 1000) / 7.0 - 40.0;
    auto out = (*db)->signal_with_context({user, rng() % 50, weight}, tidal::SignalContext{{rng() % 7, rng() % 7}});
    if (!out.ok()) fail("signal", out.status());
    if (i % 300 == 0) {
      const std::uint64_t leaver = rng() % 40;
      if (tidal::Status s = (*db)->leave_community_layer(leaver); !s.ok()) fail("leave", s);
      auto purged = (*db)->purge_community_contributions(leaver);
      if (!purged.ok()) fail("purge", purged.status());
      if (tidal::Status s = (*db)->rejoin_community_layer(leaver); !s.ok()) fail("rejoin", s);
      say("P " + std::to_string(leaver));
    }
  }
}

class PrintingSink : public tidal::ContributionSink {
 public:
  void on_contribution(const tidal::Contribution& c) override { say("S " + std::to_string(c.forwarded_at_ns)); }
};

int run_stamps(const std::string& path, std::uint64_t speed) {
  const auto start = std::chrono::steady_clock::now();
  const auto wall0 = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
  tidal::Options options;
  options.contribution_sink = std::make_shared<PrintingSink>();
  options.clock = [start, wall0, speed] {
    const auto elapsed = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
    return wall0 + static_cast<std::uint64_t>(elapsed.count()) * speed;
  };
  auto db = tidal::Db::open(path, options);
  if (!db.ok()) fail("open", db.status());
  say("R");
  for (std::uint64_t user : {1u, 2u}) {
    if (tidal::Status s = (*db)->join_community(user, 10); !s.ok()) fail("join", s);
  }
  auto signal_forever = [&](std::uint64_t user) {
    for (std::uint64_t item = 0;; ++item) {
      auto out = (*db)->signal_with_context({user, item % 100, 1.0}, tidal::SignalContext{{42}});
      if (!out.ok()) fail("signal", out.status());
    }
  };
  std::thread other(signal_forever, 2);
  signal_forever(1);
  other.join();
  return 0;  // not reached: the parent kills the child
}

int run_open(const std::string& path, int backfill_batch) {
  if (backfill_batch > 0) kill_at_step("index backfill", backfill_batch);
  auto db = tidal::Db::open(path);
  if (!db.ok()) fail("open", db.status());
  say("R");
  if (tidal::Status s = (*db)->close(); !s.ok()) fail("close", s);
  say("C");
  return 0;
}

int run_purges(const std::string& path, std::uint64_t first) {
  auto db = tidal::Db::open(path);
  if (!db.ok()) fail("open", db.status());
  say("R");
  for (std::uint64_t u = first;; ++u) {
    if (tidal::Status s = (*db)->join_community(u, u); !s.ok()) fail("join", s);
    for (auto [item, weight] : {std::pair<std::uint64_t, double>{1, 1.5}, {2, 0.25}}) {
      auto out = (*db)->signal_with_context({u, item, weight}, tidal::SignalContext{{u}});
      if (!out.ok()) fail("signal", out.status());
    }
    if (tidal::Status s = (*db)->flush(); !s.ok()) fail("flush", s);
    say("F " + std::to_string(u));
    if (tidal::Status s = (*db)->leave_community_layer(u); !s.ok()) fail("leave", s);
    say("B " + std::to_string(u));
    auto receipt = (*db)->purge_community_contributions(u);
    if (!receipt.ok()) fail("purge", receipt.status());
    say("A " + std::to_string(u) + " " + std::to_string(receipt->entries_removed));
  }
}

// journal-purge and purge-keys: `where` is "intent" or "keys".
int run_killed_purge(const std::string& path, std::uint64_t user, const std::string& where) {
  tidal::Options options;
  options.journal = true;
  options.shard_id = 3;
  auto db = tidal::Db::open(path, options);
  if (!db.ok()) fail("open", db.status());
  for (std::uint64_t u : {user, user + 1}) {
    if (tidal::Status s = (*db)->join_community(u, user); !s.ok()) fail("join", s);
  }
  for (auto [u, item, weight] : {std::tuple<std::uint64_t, std::uint64_t, double>{user, 1, 1.5}, {user, 2, 0.25},
                                 {user + 1, 1, 0.5}}) {
    auto out = (*db)->signal_with_context({u, item, weight}, tidal::SignalContext{{user}});
    if (!out.ok()) fail("signal", out.status());
  }
  if (tidal::Status s = (*db)->flush(); !s.ok()) fail("flush", s);
  if (tidal::Status s = (*db)->leave_community_layer(user); !s.ok()) fail("leave", s);
  say("R");
  if (where == "intent") {
    tidal::Db::Impl::after_purge_intent_for_testing = [] {
      say("I");
      ::raise(SIGKILL);
    };
  } else {
    tidal::Storage::step_for_testing = [](std::string_view task, int step) {
      if (task == "purge" && step == 1) {
        say("K");
        ::raise(SIGKILL);
      }
    };
  }
  auto receipt = (*db)->purge_community_contributions(user);
  say(receipt.ok() ? "E the purge returned without running the hook" : "E purge: " + receipt.status().to_string());
  return 3;
}

int run_backup(const std::string& path, const std::string& backup_dir, int step) {
  auto db = tidal::Db::open(path);
  if (!db.ok()) fail("open", db.status());
  for (std::uint64_t u : {std::uint64_t{40}, std::uint64_t{41}}) {
    if (tidal::Status s = (*db)->join_community(u, 40); !s.ok()) fail("join", s);
    auto out = (*db)->signal_with_context({u, 1, 1.5}, tidal::SignalContext{{40}});
    if (!out.ok()) fail("signal", out.status());
  }
  if (tidal::Status s = (*db)->flush(); !s.ok()) fail("flush", s);
  say("R");
  kill_at_step("backup", step);
  tidal::Status s = (*db)->backup(backup_dir);
  say("E the backup returned (" + s.to_string() + ") without reaching step " + std::to_string(step));
  return 3;
}

// reseed and finish: one recovery step of an existing Db, killed at a step.
int run_recovery_step(const std::string& mode, const std::string& path, std::uint64_t shard, const std::string& task,
                      int step) {
  tidal::Options options;
  options.change_feed = true;
  options.shard_id = shard;
  options.journal = mode == "finish";
  auto db = tidal::Db::open(path, options);
  if (!db.ok()) fail("open", db.status());
  kill_at_step(task, step);
  const tidal::Status s = mode == "finish" ? (*db)->finish_recovery() : (*db)->reseed_change_feed().status();
  say("E " + mode + " returned (" + s.to_string() + ") without reaching " + task + " step " + std::to_string(step));
  return 3;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "ops" && argc == 5) {
    return run_ops(argv[2], std::strtoull(argv[3], nullptr, 10), std::strtoull(argv[4], nullptr, 10));
  }
  if (mode == "stamps" && argc == 4) return run_stamps(argv[2], std::strtoull(argv[3], nullptr, 10));
  if (mode == "backup" && argc == 5) return run_backup(argv[2], argv[3], std::atoi(argv[4]));
  if (mode == "open" && (argc == 3 || argc == 4)) return run_open(argv[2], argc == 4 ? std::atoi(argv[3]) : 0);
  if (mode == "purges" && (argc == 4 || (argc == 5 && std::string(argv[4]) == "files"))) {
    // "files": every purge batch ingested as files, none through the WAL.
    if (argc == 5) tidal::Db::Impl::purge_wal_entries = 0;
    return run_purges(argv[2], std::strtoull(argv[3], nullptr, 10));
  }
  if (mode == "journal-purge" && argc == 4) return run_killed_purge(argv[2], std::strtoull(argv[3], nullptr, 10), "intent");
  if (mode == "purge-keys" && argc == 4) return run_killed_purge(argv[2], std::strtoull(argv[3], nullptr, 10), "keys");
  if (mode == "signals" && (argc == 4 || (argc == 5 && std::string(argv[4]) == "scans"))) {
    return run_signals(argv[2], std::strtoull(argv[3], nullptr, 10), argc == 5);
  }
  if (mode == "overload" && argc == 5) {
    return run_overload(argv[2], std::strtoull(argv[3], nullptr, 10), std::strtoull(argv[4], nullptr, 10));
  }
  if ((mode == "reseed" || mode == "finish") && argc == 6) {
    return run_recovery_step(mode, argv[2], std::strtoull(argv[3], nullptr, 10), argv[4], std::atoi(argv[5]));
  }
  if ((mode == "migrate" || mode == "upgrade4") && argc == 4) return run_upgrade(argv[2], argv[1], std::atoi(argv[3]));
  if (mode == "feed" && argc == 5) {
    return run_feed(argv[2], std::strtoull(argv[3], nullptr, 10), std::strtoull(argv[4], nullptr, 10));
  }
  say("E usage: tidal_crash_child ops <db> <seed> <users> | stamps <db> <speed> | signals <db> <period-ms> | open <db> [<backfill-batch>] | purges <db> <first-user> [files] | journal-purge|purge-keys <db> <user> | feed <db> <shard> <seed> | overload <db> <period-ms> <first> | migrate|upgrade4 <db> <step> | reseed|finish <db> <shard> <task> <step>");
  return 2;
}
