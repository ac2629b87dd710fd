// The signal path: ns per signal with 0/1/4 cohorts x 0/1/4 communities, on
// 1 and 2 threads, without and with a ContributionSink.
//
//   build/test/bench/signal_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <atomic>
#include <random>

#include "bench_util.h"
#include "db/impl.h"

namespace tidal::bench {
namespace {

constexpr std::uint64_t kUsersPerShape = 1024;
constexpr std::uint64_t kItems = 1024;

// The cheapest sink a host could write: a per-thread counter.
class CountingSink : public ContributionSink {
 public:
  void on_contribution(const Contribution& c) override {
    thread_local std::uint64_t seen = 0;
    seen += c.item_id;
    benchmark::DoNotOptimize(seen);
  }
};

// Users n * 1e6 + [0, 1024) belong to n communities (n = 0, 1, 4).
std::unique_ptr<Db> make_db(bool with_sink) {
  Options options;
  options.sync_writes = false;
  if (with_sink) options.contribution_sink = std::make_shared<CountingSink>();
  auto db = must_open(scratch_dir(with_sink ? "signal-sink" : "signal"), options);
  for (std::uint64_t n : {1u, 4u}) {
    for (std::uint64_t u = 0; u < kUsersPerShape; ++u) {
      for (std::uint64_t c = 1; c <= n; ++c) {
        if (!db->join_community(n * 1'000'000 + u, c).ok()) std::abort();
      }
    }
  }
  return db;
}

Db& db_for(bool with_sink) {
  static std::unique_ptr<Db> plain = make_db(false);
  static std::unique_ptr<Db> sinked = make_db(true);
  return with_sink ? *sinked : *plain;
}

void BM_Signal(benchmark::State& state) {
  const auto cohorts = static_cast<std::size_t>(state.range(0));
  const auto communities = static_cast<std::uint64_t>(state.range(1));
  const bool with_sink = state.range(2) != 0;
  Db& db = db_for(with_sink);
  SignalContext context;
  for (std::size_t i = 0; i < cohorts; ++i) context.cohort_ids.push_back(100 + i);
  std::mt19937_64 rng(static_cast<std::uint64_t>(state.thread_index()));
  for (auto _ : state) {
    const std::uint64_t r = rng();
    auto out = db.signal_with_context({communities * 1'000'000 + r % kUsersPerShape, (r >> 20) % kItems, 1.0}, context);
    benchmark::DoNotOptimize(out);
  }
  state.SetItemsProcessed(state.iterations());
  state.counters["contributions/signal"] =
      benchmark::Counter(static_cast<double>(cohorts + communities), benchmark::Counter::kAvgThreads);
}

void Shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"cohorts", "communities", "sink"});
  for (int sink : {0, 1}) {
    for (int cohorts : {0, 1, 4}) {
      for (int communities : {0, 1, 4}) b->Args({cohorts, communities, sink});
    }
  }
}
BENCHMARK(BM_Signal)->Apply(Shapes)->Threads(1)->Threads(2)->UseRealTime();

// The stats counters on the hot path: tidal stripes them per thread (one
// relaxed add to a cache line no other thread writes); beside them, the
// naive single shared atomic.
void BM_StatsCounterStriped(benchmark::State& state) {
  static std::array<CounterStripe, 16> stripes;
  CounterStripe& mine = stripes[static_cast<std::size_t>(state.thread_index()) % stripes.size()];
  for (auto _ : state) mine.signals.fetch_add(1, std::memory_order_relaxed);
  state.SetItemsProcessed(state.iterations());
}
void BM_StatsCounterShared(benchmark::State& state) {
  static std::atomic<std::uint64_t> shared{0};
  for (auto _ : state) shared.fetch_add(1, std::memory_order_relaxed);
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_StatsCounterStriped)->Threads(1)->Threads(2)->UseRealTime();
BENCHMARK(BM_StatsCounterShared)->Threads(1)->Threads(2)->UseRealTime();

}  // namespace
}  // namespace tidal::bench

BENCHMARK_MAIN();
