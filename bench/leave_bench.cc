// The leave gate and the leave path, in one binary so ratios come from one run:
//  - the gate check (LeaveGate::closed_for, what try_cohort_attribution and
//    try_community_forwarding run first) for a user who has not left, with
//    0 / 1e4 / 1e6 users Left, and for a Left user; beside libcuckoo find()
//    and std::unordered_map under std::shared_mutex on the same keys;
//  - the read section every signal enters (grace::ReadSection);
//  - the signal path of a not-left user with 1e4 users Left vs none;
//  - a synced leave vs a bare synced RocksDB put of the same bytes;
//  - open with 1e4 / 1e5 / 1e6 leavers, with and without 2M other records;
//  - leave latency (its grace period) with 0 / 2 / 8 / 16 busy signaling
//    threads, and while another Db's sink is slow.
//
//   build/test/bench/leave_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>
#include <vector>
#include <map>
#include <shared_mutex>
#include <unordered_map>

#include <libcuckoo/cuckoohash_map.hh>
#include <rocksdb/db.h>

#include "bench_util.h"
#include "db/grace.h"
#include "db/leave_gate.h"
#include "storage/format.h"

namespace tidal::bench {
namespace {

constexpr std::size_t kProbeKeys = 4096;

// Users 0..n-1 are Left; probes use ids far above them.
std::uint64_t not_left_user(std::size_t i) { return 1'000'000'000ULL + i * 7919; }

struct Population {
  explicit Population(std::uint64_t left) {
    for (std::uint64_t u = 0; u < left; ++u) {
      gate.close(u);
      CommunityMembership m{u, MembershipStatus::Left, 1 + u};
      cuckoo.insert(u, m);
      locked.emplace(u, m);
    }
  }
  LeaveGate gate;
  libcuckoo::cuckoohash_map<std::uint64_t, CommunityMembership> cuckoo;
  std::unordered_map<std::uint64_t, CommunityMembership> locked;
  std::shared_mutex mu;
};

Population& population(std::uint64_t left) {
  static std::map<std::uint64_t, std::unique_ptr<Population>> all;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  auto& p = all[left];
  if (!p) p = std::make_unique<Population>(left);
  return *p;
}

template <class Probe>
void run_probe(benchmark::State& state, Probe probe, bool left_user) {
  std::size_t i = static_cast<std::size_t>(state.thread_index()) * 977;
  std::size_t hits = 0;
  for (auto _ : state) {
    const std::uint64_t user = left_user ? (i % 8192) : not_left_user(i % kProbeKeys);
    hits += probe(user);
    ++i;
  }
  benchmark::DoNotOptimize(hits);
  state.SetItemsProcessed(state.iterations());
}

void BM_GateNotLeft(benchmark::State& state) {
  Population& p = population(static_cast<std::uint64_t>(state.range(0)));
  run_probe(state, [&](std::uint64_t u) { return p.gate.closed_for(u); }, false);
}
void BM_GateLeftUser(benchmark::State& state) {
  Population& p = population(static_cast<std::uint64_t>(state.range(0)));
  run_probe(state, [&](std::uint64_t u) { return p.gate.closed_for(u); }, true);
}
void BM_CuckooFindNotLeft(benchmark::State& state) {
  Population& p = population(static_cast<std::uint64_t>(state.range(0)));
  run_probe(state, [&](std::uint64_t u) { return p.cuckoo.contains(u); }, false);
}
void BM_SharedMutexMapNotLeft(benchmark::State& state) {
  Population& p = population(static_cast<std::uint64_t>(state.range(0)));
  run_probe(state, [&](std::uint64_t u) {
    std::shared_lock lock(p.mu);
    return p.locked.count(u) != 0;
  }, false);
}
void BM_ReadSection(benchmark::State& state) {
  grace::init();
  static grace::Domain domain;
  for (auto _ : state) {
    grace::ReadSection section(domain, 7);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations());
}

#define GATE_ARGS ->ArgName("left")->Arg(0)->Arg(10'000)->Arg(1'000'000)->Threads(1)->Threads(2)->UseRealTime()
BENCHMARK(BM_GateNotLeft) GATE_ARGS;
BENCHMARK(BM_CuckooFindNotLeft) GATE_ARGS;
BENCHMARK(BM_SharedMutexMapNotLeft) GATE_ARGS;
BENCHMARK(BM_GateLeftUser)->ArgName("left")->Arg(10'000)->Threads(1)->Threads(2)->UseRealTime();
BENCHMARK(BM_ReadSection)->Threads(1)->Threads(2)->UseRealTime();

// ---- the signal path with and without leavers ----

Db& signal_db(std::uint64_t left) {
  static std::map<std::uint64_t, std::unique_ptr<Db>> dbs;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  auto& db = dbs[left];
  if (!db) {
    const std::string dir = scratch_dir("signal-left-" + std::to_string(left));
    bulk_load(dir, left, 0);
    Options options;
    options.sync_writes = false;
    db = must_open(dir, options);
    for (std::size_t i = 0; i < kProbeKeys; ++i) {
      if (!db->join_community(not_left_user(i), 1).ok()) std::abort();
    }
  }
  return *db;
}

void BM_SignalNotLeftUser(benchmark::State& state) {
  Db& db = signal_db(static_cast<std::uint64_t>(state.range(0)));
  const SignalContext context{{7}};
  std::size_t i = static_cast<std::size_t>(state.thread_index()) * 977;
  for (auto _ : state) {
    auto out = db.signal_with_context({not_left_user(i % kProbeKeys), i % 1024, 1.0}, context);
    benchmark::DoNotOptimize(out);
    ++i;
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_SignalNotLeftUser)->ArgName("left")->Arg(0)->Arg(10'000)->Threads(1)->Threads(2)->UseRealTime();

// ---- synced leave vs a bare synced put ----

void BM_SyncedLeave(benchmark::State& state) {
  static std::unique_ptr<Db> db = must_open(scratch_dir("leave"));
  static std::uint64_t next_user = 0;
  for (auto _ : state) {
    if (!db->leave_community_layer(next_user++).ok()) state.SkipWithError("leave failed");
  }
  state.SetItemsProcessed(state.iterations());
}
void BM_SyncedBarePut(benchmark::State& state) {
  static rocksdb::DB* raw = [] {
    rocksdb::Options options;
    options.create_if_missing = true;
    rocksdb::DB* db = nullptr;
    if (!rocksdb::DB::Open(options, scratch_dir("bare-put"), &db).ok()) std::abort();
    return db;
  }();
  rocksdb::WriteOptions wo;
  wo.sync = true;
  std::uint64_t user = 0;
  for (auto _ : state) {
    auto value = serialize_membership({user, MembershipStatus::Left, 1 + user});
    const std::string key = encode_key(EntityId(user++), Tag::CommunityLeave);
    if (!raw->Put(wo, key, rocksdb::Slice(value.data(), value.size())).ok()) state.SkipWithError("put failed");
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_SyncedLeave)->Iterations(400)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_SyncedBarePut)->Iterations(400)->Unit(benchmark::kMicrosecond);

// ---- open ----

void BM_Open(benchmark::State& state) {
  const auto leavers = static_cast<std::uint64_t>(state.range(0));
  const auto others = static_cast<std::uint64_t>(state.range(1));
  static std::map<std::pair<std::uint64_t, std::uint64_t>, std::string> built;
  std::string& dir = built[{leavers, others}];
  if (dir.empty()) {
    dir = scratch_dir("open");
    bulk_load(dir, leavers, others);
  }
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    auto db = must_open(dir);
    const auto stop = std::chrono::steady_clock::now();
    state.SetIterationTime(std::chrono::duration<double>(stop - start).count());
    if (db->stats().users_left != leavers) state.SkipWithError("open restored the wrong number of leavers");
    if (!db->close().ok()) state.SkipWithError("close failed");
  }
  state.counters["leavers"] = static_cast<double>(leavers);
}
BENCHMARK(BM_Open)
    ->ArgNames({"leavers", "others"})
    ->Args({10'000, 0})->Args({100'000, 0})->Args({1'000'000, 0})
    ->Args({10'000, 2'000'000})->Args({100'000, 2'000'000})->Args({1'000'000, 2'000'000})
    ->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);


// ---- leave latency under oversubscription ----
//
// `signalers` threads signal without pause (no yield) on a 2-core machine;
// meanwhile one thread leaves user 0 and rejoins it, timing only the leave.
// Odd-numbered signalers send every 16th signal for user 0 (so a leave has
// readers of its own user to wait out), all others signal users 1..1023.
// Every signal reaches a sink (a counter) through a cohort and a community.
// sync_writes is off: the figure is the grace period, not the fsync.
// Reports the median, p99 and max of the leaves (ms) as counters.

struct CountingSink : ContributionSink {
  void on_contribution(const Contribution& c) override {
    thread_local std::uint64_t seen = 0;
    seen += c.user_id;
    benchmark::DoNotOptimize(seen);
  }
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

void run_signalers(Db& db, int count, std::atomic<bool>& stop, std::vector<std::thread>* threads) {
  for (int t = 0; t < count; ++t) {
    threads->emplace_back([&db, &stop, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 1);
      const SignalContext context{{7}};
      for (std::uint64_t k = 0; !stop.load(std::memory_order_relaxed); ++k) {
        const std::uint64_t user = (t % 2 == 1 && k % 16 == 0) ? 0 : 1 + rng() % 1023;
        auto out = db.signal_with_context({user, k % 64, 1.0}, context);
        benchmark::DoNotOptimize(out);
      }
    });
  }
}

std::unique_ptr<Db> latency_db(const std::string& name, std::shared_ptr<ContributionSink> sink) {
  Options options;
  options.sync_writes = false;
  options.contribution_sink = std::move(sink);
  auto db = must_open(scratch_dir(name), options);
  for (std::uint64_t u = 0; u < 1024; ++u) {
    if (!db->join_community(u, 1 + u % 4).ok()) std::abort();
  }
  return db;
}

// Times `leaves` leaves of user 0 (each followed by an untimed rejoin), or
// as many as fit in 10 s.
void time_leaves(benchmark::State& state, Db& db, int leaves) {
  std::vector<double> ms;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (auto _ : state) {
    for (int i = 0; i < leaves && std::chrono::steady_clock::now() < deadline; ++i) {
      const auto start = std::chrono::steady_clock::now();
      if (!db.leave_community_layer(0).ok()) state.SkipWithError("leave failed");
      const auto stop = std::chrono::steady_clock::now();
      ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
      if (!db.rejoin_community_layer(0).ok()) state.SkipWithError("rejoin failed");
    }
    double total = 0;
    for (double m : ms) total += m;
    state.SetIterationTime(total / 1000);
  }
  state.counters["leaves"] = static_cast<double>(ms.size());
  state.counters["median_ms"] = percentile(ms, 0.5);
  state.counters["p99_ms"] = percentile(ms, 0.99);
  state.counters["max_ms"] = percentile(ms, 1.0);
}

void BM_LeaveLatency(benchmark::State& state) {
  auto db = latency_db("leave-latency", std::make_shared<CountingSink>());
  std::atomic<bool> stop{false};
  std::vector<std::thread> signalers;
  run_signalers(*db, static_cast<int>(state.range(0)), stop, &signalers);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let them get going
  time_leaves(state, *db, 400);
  stop = true;
  for (auto& t : signalers) t.join();
}
BENCHMARK(BM_LeaveLatency)
    ->ArgName("signalers")->Arg(0)->Arg(2)->Arg(8)->Arg(16)
    ->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);

// One Db's sink takes 20 ms per contribution (one signaling thread); a leave
// on another Db, with no signals of its own, should not wait for it.
void BM_LeaveBesideSlowSink(benchmark::State& state) {
  struct SlowSink : ContributionSink {
    void on_contribution(const Contribution&) override { std::this_thread::sleep_for(std::chrono::milliseconds(20)); }
  };
  auto slow = latency_db("slow-sink", std::make_shared<SlowSink>());
  auto quiet = latency_db("quiet", nullptr);
  std::atomic<bool> stop{false};
  std::vector<std::thread> signalers;
  run_signalers(*slow, 1, stop, &signalers);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  time_leaves(state, *quiet, 100);
  stop = true;
  for (auto& t : signalers) t.join();
}
BENCHMARK(BM_LeaveBesideSlowSink)->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);

// ---- bulk leave (issue 9 item 9) ----

// 100,000 users left by one bulk call (synced batches of 10,000) on a fresh
// Db, beside the same users left one synced call each (range(1) = 0: only
// the first 2,000, scaled in the items/s counter).
void BM_BulkLeave(benchmark::State& state) {
  const bool bulk = state.range(0) != 0;
  const std::uint64_t users = bulk ? 100'000 : 2'000;
  std::vector<std::uint64_t> ids(users);
  for (std::uint64_t u = 0; u < users; ++u) ids[u] = 1'000'000 + u * 7;
  for (auto _ : state) {
    state.PauseTiming();
    auto db = must_open(scratch_dir("bulk-leave"));
    state.ResumeTiming();
    if (bulk) {
      if (!db->leave_community_layer(std::span<const std::uint64_t>(ids)).ok()) state.SkipWithError("bulk leave failed");
    } else {
      for (std::uint64_t u : ids) {
        if (!db->leave_community_layer(u).ok()) state.SkipWithError("leave failed");
      }
    }
    state.PauseTiming();
    if (db->stats().users_left != users) state.SkipWithError("wrong number of users left");
    (void)db->close();
    state.ResumeTiming();
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(users));
}
BENCHMARK(BM_BulkLeave)->ArgName("bulk")->Arg(1)->Arg(0)->Iterations(3)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace tidal::bench

BENCHMARK_MAIN();
