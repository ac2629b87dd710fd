// The state store (issue 11): sustained signal throughput next to two
// baselines, signal latency while flush() runs, open time with many stored
// aggregate entries, and score reads.
//
//   build/bench/bench/state_bench --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
//
// Workload ("demo-like"): kUsers users, each joined 2 of 1,000 communities;
// each signal is one random user, one of 1,000 items and one of 500 cohorts:
// 1 personal + 1 cohort + 2 community cells, and 3 ledger contributions.
// Environment knobs (defaults in brackets):
//   TIDAL_STATE_BENCH_SIGNALS   signals per throughput repetition  [2000000]
//   TIDAL_STATE_BENCH_SECONDS   seconds per latency repetition     [8]
//   TIDAL_STATE_BENCH_BIG_OPEN  entries of the largest open case   [30000000]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cctype>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <libcuckoo/cuckoohash_map.hh>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/sst_file_writer.h>
#include <rocksdb/write_batch.h>

#include "bench_util.h"
#include "inmemory_aggregates.h"
#include "storage/format.h"
#include "storage/state_format.h"
#include "storage/storage.h"

namespace tidal::bench {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kUsers = 100'000;
constexpr std::uint64_t kCommunities = 1'000;
constexpr std::uint64_t kItems = 1'000;
constexpr std::uint64_t kCohorts = 500;
constexpr int kSignalThreads = 2;

std::uint64_t env_or(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::strtoull(v, nullptr, 10) : fallback;
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

void check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "state_bench: %s: %s\n", what, s.to_string().c_str());
    std::abort();
  }
}
void check(const rocksdb::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "state_bench: %s: %s\n", what, s.ToString().c_str());
    std::abort();
  }
}

// splitmix64, one per thread.
struct Rng {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
};

// The two communities of user u (deterministic, distinct).
std::array<std::uint64_t, 2> communities_of(std::uint64_t u) {
  Rng r{u * 7919};
  const std::uint64_t a = 1 + r.next() % kCommunities;
  std::uint64_t b = 1 + r.next() % kCommunities;
  if (b == a) b = a % kCommunities + 1;
  return {a, b};
}

struct DemoSignal {
  std::uint64_t user, item, cohort;
  double weight;
};
DemoSignal next_signal(Rng& rng) {
  const std::uint64_t r = rng.next();
  return {1 + r % kUsers, 1 + (r >> 20) % kItems, 1 + (r >> 40) % kCohorts, 0.5 + static_cast<double>(r >> 58) / 64.0};
}

// Runs `per_thread` signals on each of kSignalThreads threads; `fn(signal)`.
template <typename Fn>
double run_signals(std::uint64_t per_thread, Fn fn) {
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (int t = 0; t < kSignalThreads; ++t) {
    threads.emplace_back([&, t] {
      Rng rng{1000 + static_cast<std::uint64_t>(t) + per_thread};
      for (std::uint64_t n = 0; n < per_thread; ++n) fn(next_signal(rng));
    });
  }
  for (auto& th : threads) th.join();
  return seconds(Clock::now() - start);
}

// ---- the three implementations ----

// tidal's Db: memberships joined without fsync, then reopened with the
// defaults (the state store syncs each batch; aggregate_write_period 1 s).
std::unique_ptr<Db> make_state_store_db(std::size_t write_buffer_bytes, bool change_feed = false) {
  {
    const std::string path =
        scratch_dir("state-" + std::to_string(write_buffer_bytes) + (change_feed ? "-feed" : ""));
    {
      Options bulk;
      bulk.sync_writes = false;
      auto setup = must_open(path, bulk);
      for (std::uint64_t u = 1; u <= kUsers; ++u) {
        for (std::uint64_t c : communities_of(u)) check(setup->join_community(u, c), "join");
      }
      check(setup->close(), "close after setup");
    }
    Options options;
    options.write_buffer_bytes = write_buffer_bytes;
    options.change_feed = change_feed;
    return must_open(path, options);
  }
}

// Every database the benchmarks keep open across repetitions. main() closes
// them before returning: RocksDB must not be closed from a static destructor
// (its own statics may be gone by then; closing there segfaults in EnvLogger).
std::vector<std::pair<std::size_t, std::unique_ptr<Db>>> g_state_dbs;
std::unique_ptr<struct HandWritten> g_hand_written;
std::unique_ptr<struct InMemory> g_in_memory;
std::unique_ptr<struct ReadFixture> g_read_fixtures[2];

// The default Options (64 MiB of write buffers), or `write_buffer_bytes`.
Db& state_store_db(std::size_t write_buffer_bytes = Options{}.write_buffer_bytes) {
  auto& dbs = g_state_dbs;
  for (auto& [bytes, db] : dbs) {
    if (bytes == write_buffer_bytes) return *db;
  }
  dbs.emplace_back(write_buffer_bytes, make_state_store_db(write_buffer_bytes));
  return *dbs.back().second;
}

// What a user would write by hand: one WriteBatch of merges per signal into a
// RocksDB with an int128-add merge operator, WAL on, no sync; the same
// in-memory community lookup as tidal (libcuckoo).
struct HandWritten {
  std::unique_ptr<rocksdb::DB> db;
  libcuckoo::cuckoohash_map<std::uint64_t, std::vector<std::uint64_t>> communities{1 << 14};

  HandWritten() {
    rocksdb::Options options;
    options.create_if_missing = true;
    options.merge_operator = new_units_add_operator();
    rocksdb::DB* raw = nullptr;
    check(rocksdb::DB::Open(options, scratch_dir("handwritten"), &raw), "open hand-written");
    db.reset(raw);
    for (std::uint64_t u = 1; u <= kUsers; ++u) {
      const auto c = communities_of(u);
      communities.insert(u, std::vector<std::uint64_t>{c[0], c[1]});
    }
  }

  static std::string ledger_key(std::uint64_t user, AggregateKind target, std::uint64_t id, std::uint64_t item) {
    std::string k;
    put_u64_be(&k, user);
    k.push_back(0x13);
    k.push_back(static_cast<char>(target));
    put_u64_be(&k, id);
    put_u64_be(&k, item);
    return k;
  }

  void signal(const DemoSignal& s) {
    std::string value;
    put_units(&value, *weight_to_units(s.weight));
    rocksdb::WriteBatch batch;
    batch.Merge(encode_aggregate_key(AggregateKind::Personal, s.user, s.item), value);
    batch.Merge(encode_aggregate_key(AggregateKind::Cohort, s.cohort, s.item), value);
    batch.Merge(ledger_key(s.user, AggregateKind::Cohort, s.cohort, s.item), value);
    std::vector<std::uint64_t> ids;
    communities.find_fn(s.user, [&ids](const std::vector<std::uint64_t>& v) { ids = v; });
    for (std::uint64_t c : ids) {
      batch.Merge(encode_aggregate_key(AggregateKind::Community, c, s.item), value);
      batch.Merge(ledger_key(s.user, AggregateKind::Community, c, s.item), value);
    }
    check(db->Write(rocksdb::WriteOptions(), &batch), "hand-written batch");
  }
};

// The old in-memory design: libcuckoo upserts on the signal path, persist()
// (every changed entry, then a memtable flush) at the end.
struct InMemory {
  std::unique_ptr<Storage> storage;
  libcuckoo::cuckoohash_map<std::uint64_t, std::vector<std::uint64_t>> communities{1 << 14};

  InMemory() {
    auto st = Storage::open(scratch_dir("inmemory"), Storage::Config{});
    check(st.status(), "open in-memory storage");
    storage = std::move(*st);
    for (std::uint64_t u = 1; u <= kUsers; ++u) {
      const auto c = communities_of(u);
      communities.insert(u, std::vector<std::uint64_t>{c[0], c[1]});
    }
  }

  static void signal(Aggregates& agg, const InMemory& self, const DemoSignal& s) {
    agg.add(AggregateKind::Personal, {s.user, s.item}, s.weight);
    agg.add(AggregateKind::Cohort, {s.cohort, s.item}, s.weight);
    std::vector<std::uint64_t> ids;
    self.communities.find_fn(s.user, [&ids](const std::vector<std::uint64_t>& v) { ids = v; });
    for (std::uint64_t c : ids) agg.add(AggregateKind::Community, {c, s.item}, s.weight);
  }
};

// One signal of the demo workload through tidal's Db, with its one cohort.
void signal_state_store(Db& db, const DemoSignal& s) {
  thread_local SignalContext context{{0}};
  context.cohort_ids[0] = s.cohort;
  if (!db.signal_with_context({s.user, s.item, s.weight}, context).ok()) std::abort();
}

// The hand-written baseline, opened at its first use.
HandWritten& hand_written() {
  if (!g_hand_written) g_hand_written = std::make_unique<HandWritten>();
  return *g_hand_written;
}

// ---- 1. sustained throughput ----

// One iteration = TIDAL_STATE_BENCH_SIGNALS signals from 2 threads, then what
// makes them stored: flush() (state store), nothing (hand-written: already
// in the WAL), persist() (in-memory). items/s counts both phases.
void BM_Throughput(benchmark::State& state) {
  const int impl = static_cast<int>(state.range(0));
  // Each implementation runs alone: the databases of the one before are
  // closed first, which waits for their running compactions. (Left open, the
  // state store's compaction debt ran on during the hand-written baseline's
  // repetitions and slowed it by up to a third.)
  if (impl != 0) g_state_dbs.clear();
  if (impl != 1) g_hand_written.reset();
  const std::uint64_t total = env_or("TIDAL_STATE_BENCH_SIGNALS", 2'000'000);
  const std::uint64_t per_thread = total / kSignalThreads;
  for (auto _ : state) {
    double signal_s = 0, finish_s = 0;
    if (impl == 0) {
      Db& db = state_store_db();
      const Stats before = db.stats();
      signal_s = run_signals(per_thread, [&db](const DemoSignal& s) { signal_state_store(db, s); });
      const auto t = Clock::now();
      check(db.flush(), "flush");
      finish_s = seconds(Clock::now() - t);
      const Stats after = db.stats();
      state.counters["writer_batches"] = static_cast<double>(after.aggregate_writes - before.aggregate_writes);
      state.counters["cells_per_signal"] =
          static_cast<double>(after.aggregate_cells_written - before.aggregate_cells_written) /
          static_cast<double>(total);
      state.counters["backpressure_waits"] =
          static_cast<double>(after.backpressure_waits - before.backpressure_waits);
    } else if (impl == 1) {
      HandWritten& hw = hand_written();
      signal_s = run_signals(per_thread, [&hw](const DemoSignal& s) { hw.signal(s); });
    } else {
      if (!g_in_memory) g_in_memory = std::make_unique<InMemory>();
      InMemory& im = *g_in_memory;
      Aggregates agg;
      signal_s = run_signals(per_thread, [&agg, &im](const DemoSignal& s) { InMemory::signal(agg, im, s); });
      const auto t = Clock::now();
      rocksdb::WriteBatch extra;
      check(agg.persist(*im.storage, &extra), "persist");
      finish_s = seconds(Clock::now() - t);
    }
    state.SetIterationTime(signal_s + finish_s);
    state.counters["signal_phase_per_s"] = static_cast<double>(per_thread * kSignalThreads) / signal_s;
    state.counters["finish_s"] = finish_s;
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(per_thread * kSignalThreads));
}
BENCHMARK(BM_Throughput)
    ->ArgName("impl_0store_1handwritten_2inmemory")
    ->Arg(0)->Arg(1)->Arg(2)
    ->Iterations(1)->UseManualTime()->Unit(benchmark::kSecond);

// The target ratio, measured so that the machine's drift cancels: each
// iteration runs TIDAL_STATE_BENCH_SIGNALS signals through the state store
// (then flush()), then as many through the hand-written baseline, both on
// databases that keep every earlier iteration's data, and reports the ratio
// of the two rates. Whatever compaction one phase leaves behind runs during
// the next; the baseline's phase writes ~45 % more keys than the state
// store's, so that favours the baseline.
void BM_ThroughputRatio(benchmark::State& state) {
  const std::uint64_t per_thread = env_or("TIDAL_STATE_BENCH_SIGNALS", 2'000'000) / kSignalThreads;
  const double total = static_cast<double>(per_thread * kSignalThreads);
  HandWritten& hw = hand_written();
  Db& db = state_store_db();
  for (auto _ : state) {
    const auto start = Clock::now();
    run_signals(per_thread, [&db](const DemoSignal& s) { signal_state_store(db, s); });
    check(db.flush(), "flush");
    const double store_s = seconds(Clock::now() - start);
    const double hand_s = run_signals(per_thread, [&hw](const DemoSignal& s) { hw.signal(s); });
    state.SetIterationTime(store_s + hand_s);
    state.counters["store_per_s"] = total / store_s;
    state.counters["handwritten_per_s"] = total / hand_s;
    state.counters["ratio"] = hand_s / store_s;
  }
}
BENCHMARK(BM_ThroughputRatio)->Iterations(1)->UseManualTime()->Unit(benchmark::kSecond);

// What the change feed costs the signal path's throughput: each iteration
// runs TIDAL_STATE_BENCH_SIGNALS signals (then flush()) through a Db
// without the feed, then through one with it, which a consumer then trims
// (as a publisher does once its batches are acknowledged). Reports the
// ratio of the two rates (1.0: free).
std::unique_ptr<Db> g_feed_db;

void BM_ChangeFeedThroughputRatio(benchmark::State& state) {
  const std::uint64_t per_thread = env_or("TIDAL_STATE_BENCH_SIGNALS", 2'000'000) / kSignalThreads;
  const double total = static_cast<double>(per_thread * kSignalThreads);
  Db& plain = state_store_db();
  if (!g_feed_db) g_feed_db = make_state_store_db(Options{}.write_buffer_bytes, /*change_feed=*/true);
  Db& fed = *g_feed_db;
  for (auto _ : state) {
    auto start = Clock::now();
    run_signals(per_thread, [&plain](const DemoSignal& s) { signal_state_store(plain, s); });
    check(plain.flush(), "flush");
    const double plain_s = seconds(Clock::now() - start);
    const Stats before = fed.stats();
    start = Clock::now();
    run_signals(per_thread, [&fed](const DemoSignal& s) { signal_state_store(fed, s); });
    check(fed.flush(), "flush");
    const double feed_s = seconds(Clock::now() - start);
    const Stats after = fed.stats();
    check(fed.trim_changes(after.change_feed_last_seq), "trim");
    state.SetIterationTime(plain_s + feed_s);
    state.counters["plain_per_s"] = total / plain_s;
    state.counters["feed_per_s"] = total / feed_s;
    state.counters["ratio"] = plain_s / feed_s;
    state.counters["feed_batches"] = static_cast<double>(after.change_feed_last_seq - before.change_feed_last_seq);
    state.counters["feed_MiB"] = static_cast<double>(after.change_feed_pending_bytes) / (1 << 20);
  }
}
BENCHMARK(BM_ChangeFeedThroughputRatio)->Iterations(1)->Repetitions(3)->UseManualTime()->Unit(benchmark::kSecond);

// ---- 1b. the cost as the state grows ----

// The Sum row of the last "** Compaction Stats [<cf>] **" table in `log`
// (RocksDB writes one per column family at every stats dump, and tidal at
// close): bytes written by flushes and compactions (GB column "Write") and
// the compaction seconds.
struct CompactionSum {
  double write_gb = 0, comp_s = 0;
  bool found = false;
};
CompactionSum last_compaction_sum(const std::string& log, const std::string& cf) {
  CompactionSum out;
  FILE* f = std::fopen(log.c_str(), "r");
  if (f == nullptr) return out;
  const std::string header = "** Compaction Stats [" + cf + "] **";
  bool in_table = false;
  int write_col = -1, comp_col = -1;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, f) != nullptr) {
    const std::string line(buf);
    if (line.find("** Compaction Stats [") != std::string::npos) {
      in_table = line.find(header) != std::string::npos;
      write_col = comp_col = -1;
      continue;
    }
    if (!in_table) continue;
    std::vector<std::string> tokens;
    for (std::size_t i = 0; i < line.size();) {
      while (i < line.size() && std::isspace(static_cast<unsigned char>(line[i]))) ++i;
      std::size_t j = i;
      while (j < line.size() && !std::isspace(static_cast<unsigned char>(line[j]))) ++j;
      if (j > i) tokens.push_back(line.substr(i, j - i));
      i = j;
    }
    if (!tokens.empty() && tokens[0] == "Level") {
      // The Size column is two tokens in the rows ("1.23 MB"): +1.
      for (std::size_t c = 0; c < tokens.size(); ++c) {
        if (tokens[c] == "Write(GB)") write_col = static_cast<int>(c) + 1;
        if (tokens[c] == "Comp(sec)") comp_col = static_cast<int>(c) + 1;
      }
    } else if (!tokens.empty() && tokens[0] == "Sum" && write_col >= 0 &&
               static_cast<int>(tokens.size()) > std::max(write_col, comp_col)) {
      out.write_gb = std::strtod(tokens[static_cast<std::size_t>(write_col)].c_str(), nullptr);
      out.comp_s = std::strtod(tokens[static_cast<std::size_t>(comp_col)].c_str(), nullptr);
      out.found = true;
      in_table = false;
    }
  }
  std::fclose(f);
  return out;
}

// Signals/s flat out (2 threads) into a new Db of range(0) users, each
// getting TIDAL_GROWTH_SIGNALS_PER_USER signals (default 5) on one of 1,000
// items with one of 500 cohorts (no communities: no setup), then flush().
// After close, what RocksDB's compactions of each column family wrote
// (state/LOG's compaction statistics), per signal.
void BM_ThroughputAsStateGrows(benchmark::State& state) {
  g_state_dbs.clear();
  g_hand_written.reset();
  const auto users = static_cast<std::uint64_t>(state.range(0));
  const std::uint64_t per_user = env_or("TIDAL_GROWTH_SIGNALS_PER_USER", 5);
  const std::uint64_t per_thread = users * per_user / kSignalThreads;
  const double total = static_cast<double>(per_thread * kSignalThreads);
  for (auto _ : state) {
    const std::string path = scratch_dir("growth-" + std::to_string(users));
    auto db = must_open(path);
    const auto start = Clock::now();
    std::atomic<std::uint64_t> longest_ns{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kSignalThreads; ++t) {
      threads.emplace_back([&, t] {
        Rng rng{77 + static_cast<std::uint64_t>(t)};
        std::uint64_t longest = 0;
        for (std::uint64_t n = 0; n < per_thread; ++n) {
          const std::uint64_t r = rng.next();
          const auto t0 = Clock::now();
          const Result<SignalOutcome> out = db->signal_with_context(
              {1 + r % users, 1 + (r >> 32) % kItems, 1.0}, SignalContext{{1 + (r >> 48) % kCohorts}});
          longest = std::max<std::uint64_t>(
              longest, static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count()));
          check(out.status(), "signal");
        }
        for (std::uint64_t seen = longest_ns.load(); seen < longest && !longest_ns.compare_exchange_weak(seen, longest);) {
        }
      });
    }
    for (auto& th : threads) th.join();
    check(db->flush(), "flush");
    const double secs = seconds(Clock::now() - start);
    const Stats st = db->stats();
    check(db->close(), "close");
    state.SetIterationTime(secs);
    state.counters["signals_per_s"] = total / secs;
    state.counters["longest_signal_ms"] = static_cast<double>(longest_ns.load()) / 1e6;
    state.counters["paused_signals"] = static_cast<double>(st.admission_delayed_signals);
    state.counters["pause_s"] = static_cast<double>(st.admission_delay_ns) / 1e9;
    for (const char* cf : {"aggregates", "ledger"}) {
      const CompactionSum sum = last_compaction_sum(path + "/state/LOG", cf);
      if (!sum.found) continue;
      state.counters[std::string(cf) + "_written_B_per_signal"] = sum.write_gb * 1e9 / total;
      state.counters[std::string(cf) + "_comp_s"] = sum.comp_s;
    }
  }
}
BENCHMARK(BM_ThroughputAsStateGrows)
    ->ArgName("users")
    ->Arg(100'000)->Arg(1'000'000)->Arg(4'000'000)
    ->Iterations(1)->UseManualTime()->Unit(benchmark::kSecond);

// ---- 2. signal latency while flush() runs ----

// One thread signals for TIDAL_STATE_BENCH_SECONDS and times every call;
// with flusher = 1 another thread calls flush() back to back meanwhile (the
// background writer runs in both cases). buffer_mib: Options::write_buffer_bytes.
void BM_SignalLatencyDuringFlush(benchmark::State& state) {
  const bool flusher = state.range(0) != 0;
  const auto buffer_bytes = static_cast<std::size_t>(state.range(1)) << 20;
  const double duration = static_cast<double>(env_or("TIDAL_STATE_BENCH_SECONDS", 8));
  Db& db = state_store_db(buffer_bytes);
  for (auto _ : state) {
    const std::uint64_t waits_before = db.stats().backpressure_waits;
    std::atomic<bool> stop{false};
    std::uint64_t flushes = 0;
    double flush_max_s = 0;
    std::thread flush_thread;
    if (flusher) {
      flush_thread = std::thread([&] {
        while (!stop.load(std::memory_order_relaxed)) {
          const auto t = Clock::now();
          check(db.flush(), "flush");
          flush_max_s = std::max(flush_max_s, seconds(Clock::now() - t));
          ++flushes;
        }
      });
    }
    std::vector<std::uint64_t> ns;  // per call
    ns.reserve(20'000'000);
    Rng rng{77};
    SignalContext context{{0}};
    const auto start = Clock::now();
    while (seconds(Clock::now() - start) < duration) {
      for (int i = 0; i < 256; ++i) {
        const DemoSignal s = next_signal(rng);
        context.cohort_ids[0] = s.cohort;
        const auto t = Clock::now();
        if (!db.signal_with_context({s.user, s.item, s.weight}, context).ok()) std::abort();
        const auto d = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t).count();
        ns.push_back(static_cast<std::uint64_t>(d));
      }
    }
    const double elapsed = seconds(Clock::now() - start);
    stop = true;
    if (flush_thread.joinable()) flush_thread.join();
    std::sort(ns.begin(), ns.end());
    state.SetIterationTime(elapsed);
    state.counters["max_ms"] = static_cast<double>(ns.back()) / 1e6;
    state.counters["p99_us"] = static_cast<double>(ns[ns.size() * 99 / 100]) / 1e3;
    state.counters["p999_us"] = static_cast<double>(ns[ns.size() * 999 / 1000]) / 1e3;
    state.counters["p50_us"] = static_cast<double>(ns[ns.size() / 2]) / 1e3;
    state.counters["over_1ms"] = static_cast<double>(ns.end() - std::lower_bound(ns.begin(), ns.end(), std::uint64_t{1'000'000}));
    state.counters["signals"] = static_cast<double>(ns.size());
    state.counters["flushes"] = static_cast<double>(flushes);
    state.counters["flush_max_ms"] = flush_max_s * 1e3;
    state.counters["backpressure_waits"] = static_cast<double>(db.stats().backpressure_waits - waits_before);
  }
}
BENCHMARK(BM_SignalLatencyDuringFlush)
    ->ArgNames({"flusher", "buffer_mib"})
    ->Args({0, 64})->Args({1, 64})->Args({0, 4})->Args({1, 4})
    ->Iterations(1)->UseManualTime()->Unit(benchmark::kSecond);

// ---- 3. open with many stored aggregate entries ----

// A Db whose aggregates column family holds `entries` stored cells, written
// in tidal's key format as sorted SST files of 2M entries (the size of
// compaction output) and ingested: 95 % personal cells (user x 1,000 items),
// the rest cohort and community cells.
std::string db_with_entries(std::uint64_t entries) {
  const std::string path = scratch_dir("open-" + std::to_string(entries));
  must_open(path).reset();  // the layout
  if (entries == 0) return path;
  auto opened = Storage::open(path, Storage::Config{});
  check(opened.status(), "storage open");
  Storage& st = **opened;
  const std::uint64_t cohort_cells = entries / 60;
  const std::uint64_t community_cells = entries / 30;
  const std::uint64_t personal_cells = entries - cohort_cells - community_cells;
  std::vector<std::string> files;
  std::unique_ptr<rocksdb::SstFileWriter> writer;
  std::uint64_t in_file = 0;
  std::string value;
  const auto start = Clock::now();
  auto add = [&](AggregateKind kind, std::uint64_t n) {
    for (std::uint64_t i = 0; i < n; ++i) {
      if (!writer) {
        writer = std::make_unique<rocksdb::SstFileWriter>(rocksdb::EnvOptions(), rocksdb::Options());
        files.push_back(path + "/bulk-" + std::to_string(files.size()) + ".sst");
        check(writer->Open(files.back()), "sst open");
      }
      value.clear();
      put_units(&value, static_cast<Units>(i + 1) * 1'000'000'000);
      check(writer->Put(encode_aggregate_key(kind, 1 + i / kItems, 1 + i % kItems), value), "sst put");
      if (++in_file == 2'000'000) {
        check(writer->Finish(), "sst finish");
        writer.reset();
        in_file = 0;
      }
    }
  };
  add(AggregateKind::Personal, personal_cells);
  add(AggregateKind::Cohort, cohort_cells);
  add(AggregateKind::Community, community_cells);
  if (writer) check(writer->Finish(), "sst finish");
  rocksdb::IngestExternalFileOptions ingest;
  ingest.move_files = true;
  check(st.db(Storage::Engine::State)->IngestExternalFile(st.aggregates(), files, ingest), "ingest");
  check(st.close(), "storage close");
  std::fprintf(stderr, "state_bench: %llu aggregate entries in %zu SST files written in %.1f s\n",
               static_cast<unsigned long long>(entries), files.size(), seconds(Clock::now() - start));
  return path;
}

void BM_Open(benchmark::State& state) {
  const auto entries = static_cast<std::uint64_t>(state.range(0));
  static std::vector<std::pair<std::uint64_t, std::string>> built;
  std::string path;
  for (const auto& [n, p] : built) {
    if (n == entries) path = p;
  }
  if (path.empty()) {
    path = db_with_entries(entries);
    built.emplace_back(entries, path);
  }
  for (auto _ : state) {
    const auto t = Clock::now();
    auto db = Db::open(path);
    const double open_s = seconds(Clock::now() - t);
    check(db.status(), "open");
    check((*db)->close(), "close");
    state.SetIterationTime(open_s);
  }
}
BENCHMARK(BM_Open)
    ->ArgName("entries")
    ->Apply([](benchmark::internal::Benchmark* b) {
      b->Arg(0)->Arg(3'000'000)->Arg(static_cast<std::int64_t>(env_or("TIDAL_STATE_BENCH_BIG_OPEN", 30'000'000)));
    })
    ->Iterations(5)->UseManualTime()->Unit(benchmark::kMillisecond);

// ---- 4. score reads ----

// Cells written by 300k signals of 10k users x 100 items (1 cohort of 50 each),
// then flush(): in_sst = 0 reads them with the merge operands still in the
// memtable; in_sst = 1 after close + reopen (flushed to SST files), from the
// block cache once warm. Reads cycle over 4,096 stored cells, alternating
// personal and cohort; p50/p99 are sampled per call (clock overhead included).
struct ReadFixture {
  std::unique_ptr<Db> db;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> cells;  // (user, item); cohort = user % 50 + 1
};

ReadFixture make_read_fixture(bool in_sst) {
  ReadFixture f;
  const std::string path = scratch_dir(in_sst ? "read-sst" : "read-mem");
  f.db = must_open(path);
  Rng rng{5};
  SignalContext context{{0}};
  for (int i = 0; i < 300'000; ++i) {
    const std::uint64_t r = rng.next();
    const std::uint64_t user = 1 + r % 10'000, item = 1 + (r >> 20) % 100;
    context.cohort_ids[0] = user % 50 + 1;
    if (!f.db->signal_with_context({user, item, 1.0}, context).ok()) std::abort();
    if (f.cells.size() < 4096) f.cells.emplace_back(user, item);
  }
  check(f.db->flush(), "flush");
  if (in_sst) {
    check(f.db->close(), "close");
    f.db.reset();
    f.db = must_open(path);
  }
  return f;
}

void BM_ScoreRead(benchmark::State& state) {
  const bool in_sst = state.range(0) != 0;
  auto& fixture = g_read_fixtures[in_sst ? 1 : 0];
  if (!fixture) fixture = std::make_unique<ReadFixture>(make_read_fixture(in_sst));
  Db* db = fixture->db.get();
  const auto& cells = fixture->cells;
  std::vector<std::uint32_t> ns;
  ns.reserve(1 << 22);
  std::size_t i = 0;
  for (auto _ : state) {
    const auto& [user, item] = cells[i % cells.size()];
    const auto t = Clock::now();
    Result<double> r = (i & 1) != 0 ? db->cohort_score(user % 50 + 1, item) : db->personal_score(user, item);
    const auto d = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t).count();
    if (!r.ok() || *r <= 0) std::abort();
    if (ns.size() < ns.capacity()) ns.push_back(static_cast<std::uint32_t>(d));
    ++i;
  }
  std::sort(ns.begin(), ns.end());
  state.counters["p50_us"] = static_cast<double>(ns[ns.size() / 2]) / 1e3;
  state.counters["p99_us"] = static_cast<double>(ns[ns.size() * 99 / 100]) / 1e3;
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_ScoreRead)->ArgName("in_sst")->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace tidal::bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  using namespace tidal::bench;
  g_state_dbs.clear();
  g_feed_db.reset();
  g_hand_written.reset();
  g_in_memory.reset();
  for (auto& f : g_read_fixtures) f.reset();
  return 0;
}
