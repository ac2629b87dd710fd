// Replicated leaves (issue 28): a leave on a Db with Options::journal and
// journal_wait returns once tidal::nats::JournalPublisher had the entry
// acknowledged by a 3-node JetStream cluster (3 replicas) on loopback, which
// this program starts (tests/nats/nats_cluster.h) before the benchmarks.
//
// BM_ReplicatedLeave: three Dbs of the same size, default options
// (sync_writes): "local" without the journal, "journal" with it and
// journal_wait 0 (nothing replicating), "replicated" with journal_wait 5 s
// and a JournalPublisher (replicas 3, Config::poll_interval = range(0) ms:
// since the publisher wakes at a new entry, only the longest it waits at once).
// In each of 3 rounds, for each Db in turn: range(1) threads call
// signal_with_context on it without pause while this thread times 150
// leaves, each of another user, each followed by an untimed rejoin of it.
// Reports p50 / p99 / max of each kind, from all rounds. Targets: replicated
// p50 <= local p50 + 2 ms, replicated p99 <= 25 ms.
//
// BM_RecoverShardStreamRead: the stream read of a restore. A Db (1,024
// users, each with a ledger record) is backed up, then writes 10,000
// journal entries its JournalPublisher has replicated: leaves and rejoins
// in bulk calls, then a bulk purge of 1,000 users (1,000 entries). The
// backup, copied, is recovered with nats::recover_shard: the 10,000
// entries read from the stream, replayed (the purges as one bulk purge)
// and the change feed re-seeded. At this size the replay is small: the
// time is the stream read's, to add to journal_bench's BM_RecoveryTime
// (the replay at 1M users).
//
//   build/bench/journal_nats_bench
//   build/bench/journal_nats_bench --benchmark_filter=RecoverShard
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "nats_cluster.h"
#include "tidal/db.h"
#include "tidal/nats.h"

namespace {

using namespace tidal;
using Clock = std::chrono::steady_clock;

std::string g_servers;  // the cluster's URLs, set by main
std::string g_root;     // the Dbs' parent directory

[[noreturn]] void die(const std::string& what, const Status& s) {
  std::fprintf(stderr, "journal_nats_bench: %s: %s\n", what.c_str(), s.to_string().c_str());
  std::exit(1);
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

constexpr std::uint64_t kMembers = 1024;

// A fresh Db whose users 0..kMembers-1 are in a community each.
std::unique_ptr<Db> make_db(const std::string& name, bool journal, std::uint64_t shard,
                            std::chrono::milliseconds wait) {
  std::string dir = g_root;
  dir += "/";
  dir += name;
  std::filesystem::remove_all(dir);
  Options setup;
  setup.sync_writes = false;  // the joins only
  setup.journal = journal;
  setup.shard_id = shard;
  {
    auto db = Db::open(dir, setup);
    if (!db.ok()) die("open " + dir, db.status());
    for (std::uint64_t u = 0; u < kMembers; ++u) {
      if (Status s = (*db)->join_community(u, 1 + u % 4); !s.ok()) die("join", s);
    }
    if (Status s = (*db)->close(); !s.ok()) die("close", s);
  }
  Options options;  // the defaults: sync_writes
  options.journal = journal;
  options.shard_id = shard;
  options.journal_wait = wait;
  auto db = Db::open(dir, options);
  if (!db.ok()) die("open " + dir, db.status());
  return std::move(*db);
}

struct Timed {
  std::vector<double> ms;
  std::uint64_t not_replicated = 0, failed = 0;
};

// `signalers` threads signal `db` flat out while `leaves` leaves (each of
// another user, each followed by an untimed rejoin) are timed.
void time_leaves(Db& db, int signalers, int leaves, std::uint64_t* next_user, Timed* out) {
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < signalers; ++t) {
    threads.emplace_back([&db, &stop, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 1);
      const SignalContext context{{7}};
      for (std::uint64_t k = 0; !stop.load(std::memory_order_relaxed); ++k) {
        auto r = db.signal_with_context({rng() % (2 * kMembers), k % 64, 1.0}, context);
        benchmark::DoNotOptimize(r);
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // let them get going
  for (int i = 0; i < leaves; ++i) {
    const std::uint64_t user = (*next_user)++ % kMembers;
    const auto t0 = Clock::now();
    const Status s = db.leave_community_layer(user);
    out->ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    if (s.code() == StatusCode::NotReplicated) {
      ++out->not_replicated;
    } else if (!s.ok()) {
      ++out->failed;
    }
    Status r = db.rejoin_community_layer(user);
    if (!r.ok() && r.code() != StatusCode::NotReplicated) ++out->failed;
  }
  stop = true;
  for (auto& t : threads) t.join();
}

void BM_ReplicatedLeave(benchmark::State& state) {
  static std::uint64_t next_shard = 100;  // a subject of its own for each run: no fence on an earlier run's entries
  const auto poll = std::chrono::milliseconds(state.range(0));
  const int signalers = static_cast<int>(state.range(1));
  const std::uint64_t shard = next_shard++;
  auto local = make_db("local", false, shard, std::chrono::milliseconds(0));
  auto journal = make_db("journal", true, shard, std::chrono::milliseconds(0));
  auto replicated = make_db("replicated", true, shard, std::chrono::milliseconds(5000));
  nats::Config config;
  config.servers = g_servers;
  config.replicas = 3;
  config.poll_interval = poll;
  auto pub = nats::JournalPublisher::start(replicated.get(), config);
  if (!pub.ok()) die("JournalPublisher::start", pub.status());

  Timed t_local, t_journal, t_repl;
  std::uint64_t next_user = 0;
  for (auto _ : state) {
    for (int round = 0; round < 3; ++round) {
      Timed l, j, r;
      time_leaves(*local, signalers, 150, &next_user, &l);
      time_leaves(*journal, signalers, 150, &next_user, &j);
      time_leaves(*replicated, signalers, 150, &next_user, &r);
      std::fprintf(stderr,
                   "  round %d: p50 / p99 / max ms: local %.2f / %.2f / %.2f, journal %.2f / %.2f / %.2f, "
                   "replicated %.2f / %.2f / %.2f\n",
                   round + 1, percentile(l.ms, 0.5), percentile(l.ms, 0.99), percentile(l.ms, 1.0),
                   percentile(j.ms, 0.5), percentile(j.ms, 0.99), percentile(j.ms, 1.0), percentile(r.ms, 0.5),
                   percentile(r.ms, 0.99), percentile(r.ms, 1.0));
      for (auto [from, to] : {std::pair{&l, &t_local}, std::pair{&j, &t_journal}, std::pair{&r, &t_repl}}) {
        to->ms.insert(to->ms.end(), from->ms.begin(), from->ms.end());
        to->not_replicated += from->not_replicated;
        to->failed += from->failed;
      }
    }
    double total = 0;
    for (double m : t_repl.ms) total += m;
    state.SetIterationTime(total / 1000);
  }
  const nats::PublisherStats ps = (*pub)->stats();
  if (Status s = (*pub)->stop(); !s.ok()) state.SkipWithError(s.to_string().c_str());
  if (t_local.failed + t_journal.failed + t_repl.failed > 0) state.SkipWithError("a leave or rejoin failed");
  state.counters["leaves_each"] = static_cast<double>(t_repl.ms.size());
  state.counters["local_p50_ms"] = percentile(t_local.ms, 0.5);
  state.counters["local_p99_ms"] = percentile(t_local.ms, 0.99);
  state.counters["local_max_ms"] = percentile(t_local.ms, 1.0);
  state.counters["journal_p50_ms"] = percentile(t_journal.ms, 0.5);
  state.counters["journal_p99_ms"] = percentile(t_journal.ms, 0.99);
  state.counters["repl_p50_ms"] = percentile(t_repl.ms, 0.5);
  state.counters["repl_p99_ms"] = percentile(t_repl.ms, 0.99);
  state.counters["repl_max_ms"] = percentile(t_repl.ms, 1.0);
  state.counters["repl_minus_local_p50_ms"] = percentile(t_repl.ms, 0.5) - percentile(t_local.ms, 0.5);
  state.counters["not_replicated"] = static_cast<double>(t_repl.not_replicated);
  state.counters["publisher_errors"] = static_cast<double>(ps.errors);
  for (auto* db : {local.get(), journal.get(), replicated.get()}) {
    if (Status s = db->close(); !s.ok()) state.SkipWithError(s.to_string().c_str());
  }
}
BENCHMARK(BM_ReplicatedLeave)
    ->ArgNames({"poll_ms", "signalers"})->Args({5, 8})->Args({5, 2})->Args({5, 0})
    ->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);

void BM_RecoverShardStreamRead(benchmark::State& state) {
  static std::uint64_t next_shard = 500;
  const std::uint64_t shard = next_shard++;
  constexpr std::uint64_t kPurges = 1000, kEntries = 10'000;
  auto db = make_db("recover", true, shard, std::chrono::milliseconds(0));
  for (std::uint64_t u = 0; u < kMembers; ++u) {
    if (Status s = db->signal_with_context({u, u % 64, 1.0}, {{7}}).status(); !s.ok()) die("signal", s);
  }
  if (Status s = db->flush(); !s.ok()) die("flush", s);
  const std::string backup = g_root + "/recover-backup";
  std::filesystem::remove_all(backup);
  if (Status s = db->backup(backup); !s.ok()) die("backup", s);
  const std::uint64_t seq0 = db->stats().journal_last_seq;

  // Leaves and rejoins of everyone, then of a prefix, then everyone leaves
  // and 1,000 of them are purged: 10,000 entries after the backup.
  std::vector<std::uint64_t> all(kMembers);
  for (std::uint64_t u = 0; u < kMembers; ++u) all[u] = u;
  const std::uint64_t other = kEntries - kPurges - kMembers;  // leaves and rejoins before the last leave
  for (std::uint64_t written = 0; written < other;) {
    const std::uint64_t n = std::min<std::uint64_t>(kMembers, (other - written) / 2);
    const std::span<const std::uint64_t> users(all.data(), n);
    if (Status s = db->leave_community_layer(users); !s.ok()) die("bulk leave", s);
    if (Status s = db->rejoin_community_layer(users); !s.ok()) die("bulk rejoin", s);
    written += 2 * n;
  }
  if (Status s = db->leave_community_layer(std::span<const std::uint64_t>(all)); !s.ok()) die("bulk leave", s);
  const std::span<const std::uint64_t> purged(all.data(), kPurges);
  if (Status s = db->purge_community_contributions(purged).status(); !s.ok()) die("bulk purge", s);
  const std::uint64_t last = db->stats().journal_last_seq;

  nats::Config config;
  config.servers = g_servers;
  config.replicas = 3;
  {
    auto pub = nats::JournalPublisher::start(db.get(), config);
    if (!pub.ok()) die("JournalPublisher::start", pub.status());
    const auto give_up = Clock::now() + std::chrono::seconds(120);
    while (db->stats().journal_confirmed_seq < last && Clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (db->stats().journal_confirmed_seq < last) die("replication", Status::Busy((*pub)->stats().last_error));
    if (Status s = (*pub)->stop(); !s.ok()) die("JournalPublisher::stop", s);
  }
  if (Status s = db->close(); !s.ok()) die("close", s);

  double read_and_replay_s = 0;
  for (auto _ : state) {
    const std::string restored_dir = g_root + "/recover-restored";
    std::filesystem::remove_all(restored_dir);
    std::filesystem::copy(backup, restored_dir, std::filesystem::copy_options::recursive);
    Options options;
    options.journal = true;
    options.shard_id = shard;
    auto restored = Db::open(restored_dir, options);
    if (!restored.ok()) die("open the backup", restored.status());
    const auto t0 = Clock::now();
    if (Status s = nats::recover_shard(restored->get(), config); !s.ok()) die("recover_shard", s);
    read_and_replay_s = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(read_and_replay_s);
    const Stats st = (*restored)->stats();
    if (st.recovering || st.journal_last_seq != last) {
      state.SkipWithError("the restored Db is still recovering, or its journal does not end at the original's");
    }
    if (Status s = (*restored)->close(); !s.ok()) die("close restored", s);
  }
  state.counters["entries"] = static_cast<double>(last - seq0);
  state.counters["purges"] = static_cast<double>(kPurges);
  state.counters["recover_shard_s"] = read_and_replay_s;
}
BENCHMARK(BM_RecoverShardStreamRead)->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  // The cluster is started from the main thread (its servers die with it).
  tidal::nats::testing::NatsCluster cluster(3);
  if (!cluster.start_all()) {
    std::fprintf(stderr, "journal_nats_bench: the 3-node cluster did not start\n");
    return 1;
  }
  g_servers = cluster.servers();
  g_root = (std::filesystem::temp_directory_path() / "tidal-journal-nats-bench").string();
  std::filesystem::create_directories(g_root);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  std::filesystem::remove_all(g_root);
  return 0;
}
