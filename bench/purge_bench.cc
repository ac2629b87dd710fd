// Purge and re-materialization (issue 12; docs/CONTRACT.md, P1-P7) on a Db
// holding TIDAL_PURGE_BENCH_ENTRIES ledger entries (default 10M):
//   BM_PurgeOneUser/100, /10000   one purge_community_contributions call for a
//                                 Left user with that many ledger entries
//   BM_LeaveInTheStripeDuringErasure  leaves of users in the purged user's
//                                 lock stripe while a 1e4-entry purge erases
//   BM_PurgeOneUserOfAMillionCells  one user with 1M ledger cells: peak RSS
//                                 (run it alone; its own Db)
//   BM_BulkPurge/10000            one bulk call over 10,000 Left users spread
//                                 over the whole key space (10 entries each)
//   BM_Rematerialize              rematerialize_shared_aggregates(false) over
//                                 the whole ledger; counter entries/s
//   BM_LeavesDuringBulkPurge      leave latencies of other users while a bulk
//                                 purge of 5,000 users runs
//   BM_LeavesDuringRematerialize  the same during a re-materialization
//   BM_SealedReclaimPass          a compaction of a format-4 Db's whole
//                                 sealed ledger, which drops the purged
//                                 users' records (what the periodic
//                                 compaction costs once per file in 30
//                                 days): on a copy of a Db given by
//                                 TIDAL_RECLAIM_BENCH_DB (e.g. tidal-demo's
//                                 with --keep), which it changes
// The Db is built once, fast: the ledger records and the aggregates that
// equal their sums (I1) are written as SST files with rocksdb::SstFileWriter
// and ingested, then opened as a tidal Db.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>
#include <rocksdb/db.h>
#include <rocksdb/sst_file_writer.h>

#include "bench_util.h"
#include "db/impl.h"
#include "storage/state_format.h"

namespace tidal::bench {
namespace {

constexpr std::uint64_t kEntriesPerBackgroundUser = 10;
constexpr std::uint64_t kTargets = 1000, kItems = 100;
// Special users, above every background user: 20 with 1e2 entries, 20 with 1e4.
constexpr std::uint64_t kSmallBase = 1ULL << 40, kLargeBase = 2ULL << 40, kSpecialUsers = 20;

std::uint64_t total_entries() {
  const char* v = std::getenv("TIDAL_PURGE_BENCH_ENTRIES");
  return v != nullptr ? std::strtoull(v, nullptr, 10) : 10'000'000;
}
std::uint64_t background_users() { return total_entries() / kEntriesPerBackgroundUser; }

void check(const rocksdb::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::abort();
  }
}

// One ledger record of `n` entries for `user`, epoch `epoch`; adds them to `totals`.
std::string make_record(std::uint64_t user, std::uint64_t n, std::uint64_t salt, std::map<std::string, Units>* totals) {
  std::vector<LedgerEntry> entries;
  entries.reserve(n);
  for (std::uint64_t j = 0; j < n; ++j) {
    const std::uint64_t k = salt + j;
    entries.push_back({j % 2 ? AggregateKind::Community : AggregateKind::Cohort, (user + k) % kTargets,
                       (k / kTargets + user * 7) % kItems, static_cast<Units>(1'000'000'000 + (k % 7))});
  }
  std::sort(entries.begin(), entries.end(), [](const LedgerEntry& a, const LedgerEntry& b) {
    return std::tie(a.target, a.target_id, a.item) < std::tie(b.target, b.target_id, b.item);
  });
  // Distinct cells only (a record holds one entry per cell).
  entries.erase(std::unique(entries.begin(), entries.end(),
                            [](const LedgerEntry& a, const LedgerEntry& b) {
                              return a.target == b.target && a.target_id == b.target_id && a.item == b.item;
                            }),
                entries.end());
  std::string value;
  for (const LedgerEntry& e : entries) {
    put_ledger_entry(&value, e);
    (*totals)[encode_aggregate_key(e.target, e.target_id, e.item)] += e.units;
  }
  return value;
}

struct Fixture {
  std::string path;
  std::unique_ptr<Db> db;
  std::uint64_t next_small = 0, next_large = 0;
};

Fixture* g_fixture = nullptr;  // built by the first benchmark that needs it

Fixture& fixture() {
  static Fixture* f = g_fixture = [] {
    auto* out = new Fixture();
    out->path = scratch_dir("purge_bench") + "/db";
    const auto t0 = std::chrono::steady_clock::now();
    if (!must_open(out->path)->close().ok()) std::abort();  // column families and the format mark
    rocksdb::Options options;  // the SST writers'
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::DB* raw = open_raw_state(out->path, &handles);
    std::map<std::string, Units> totals;
    std::uint64_t entries = 0;
    {
      rocksdb::SstFileWriter writer(rocksdb::EnvOptions(), options, handles[2]);
      const std::string file = out->path + "/../ledger.sst";
      check(writer.Open(file), "sst open");
      const std::uint64_t users = background_users();
      for (std::uint64_t u = 0; u < users; ++u) {
        const std::string v = make_record(u, kEntriesPerBackgroundUser, 0, &totals);
        entries += v.size() / kLedgerEntrySize;
        check(writer.Put(encode_ledger_key(u, 1), v), "sst put");
      }
      for (std::uint64_t base : {kSmallBase, kLargeBase}) {
        const std::uint64_t n = base == kSmallBase ? 100 : 10'000;
        for (std::uint64_t s = 0; s < kSpecialUsers; ++s) {
          // In records of at most 100 entries, as the writer's batches would make them.
          for (std::uint64_t r = 0; r < n / 100; ++r) {
            const std::string v = make_record(base + s, 100, r * 100, &totals);
            entries += v.size() / kLedgerEntrySize;
            check(writer.Put(encode_ledger_key(base + s, r + 1), v), "sst put");
          }
        }
      }
      check(writer.Finish(), "sst finish");
      check(raw->IngestExternalFile(handles[2], {file}, rocksdb::IngestExternalFileOptions()), "ingest ledger");
    }
    {
      rocksdb::SstFileWriter writer(rocksdb::EnvOptions(), options, handles[1]);
      const std::string file = out->path + "/../aggregates.sst";
      check(writer.Open(file), "sst open");
      std::string v;
      for (const auto& [key, units] : totals) {
        v.clear();
        put_units(&v, units);
        check(writer.Put(key, v), "sst put");
      }
      check(writer.Finish(), "sst finish");
      check(raw->IngestExternalFile(handles[1], {file}, rocksdb::IngestExternalFileOptions()), "ingest aggregates");
    }
    for (auto* h : handles) check(raw->DestroyColumnFamilyHandle(h), "handle");
    check(raw->Close(), "close");
    delete raw;
    out->db = must_open(out->path);
    std::vector<std::uint64_t> special;
    for (std::uint64_t s = 0; s < kSpecialUsers; ++s) {
      special.push_back(kSmallBase + s);
      special.push_back(kLargeBase + s);
    }
    if (!out->db->leave_community_layer(special).ok()) std::abort();
    std::fprintf(stderr, "purge_bench: Db of %llu ledger entries (%llu aggregates) built in %.1f s\n",
                 static_cast<unsigned long long>(entries), static_cast<unsigned long long>(totals.size()),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return out;
  }();
  return *f;
}

void BM_PurgeOneUser(benchmark::State& state) {
  Fixture& f = fixture();
  const bool large = state.range(0) == 10'000;
  std::uint64_t removed = 0;
  for (auto _ : state) {
    std::uint64_t& next = large ? f.next_large : f.next_small;
    if (next == kSpecialUsers) {
      state.SkipWithError("out of prepared users");
      break;
    }
    const auto t = std::chrono::steady_clock::now();
    Result<PurgeReceipt> r = f.db->purge_community_contributions((large ? kLargeBase : kSmallBase) + next++);
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
    if (!r.ok()) state.SkipWithError(r.status().to_string().c_str());
    removed = r.ok() ? r->entries_removed : 0;
  }
  state.counters["entries_removed"] = static_cast<double>(removed);
}
BENCHMARK(BM_PurgeOneUser)->Arg(100)->Arg(10'000)->UseManualTime()->Iterations(1)->Repetitions(9)
    ->Unit(benchmark::kMillisecond)->ReportAggregatesOnly(true);

// Leaves of users in the purged user's lock stripe while the purge erases
// (flush, the forced compaction of the user's ledger range, the wait for the
// obsolete files): the erasure holds no stripe, so each leave costs what a
// leave costs (docs/CONTRACT.md, P4). One purge of a 1e4-entry user per
// iteration; the leave latencies are those measured between the end of the
// purge's durable batch and the purge's return.
void BM_LeaveInTheStripeDuringErasure(benchmark::State& state) {
  Fixture& f = fixture();
  std::vector<double> leave_ms;
  double erasure_ms_total = 0;
  for (auto _ : state) {
    if (f.next_large == kSpecialUsers) {
      state.SkipWithError("out of prepared users");
      break;
    }
    const std::uint64_t purged = kLargeBase + f.next_large++;
    std::atomic<bool> erasing{false}, done{false};
    std::chrono::steady_clock::time_point erase_start;
    Db::Impl::before_erasure_for_testing = [&] {
      erase_start = std::chrono::steady_clock::now();
      erasing.store(true);
    };
    Status purge_status;
    std::thread purger([&] {
      Result<PurgeReceipt> r = f.db->purge_community_contributions(purged);
      purge_status = r.ok() ? Status::OK() : r.status();
      done.store(true);
    });
    while (!erasing.load() && !done.load()) std::this_thread::yield();
    // Users of the same stripe (id % 64), never seen before: Active.
    for (std::uint64_t k = 1; !done.load(); ++k) {
      const std::uint64_t u = purged + 64 * 1'000'000 * f.next_large + 64 * k;
      const auto t = std::chrono::steady_clock::now();
      if (!f.db->leave_community_layer(u).ok()) std::abort();
      if (!done.load()) leave_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count());
    }
    purger.join();
    Db::Impl::before_erasure_for_testing = nullptr;
    const double erasure_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - erase_start).count();
    erasure_ms_total += erasure_ms;
    state.SetIterationTime(erasure_ms / 1e3);
    if (!purge_status.ok()) state.SkipWithError(purge_status.to_string().c_str());
  }
  std::sort(leave_ms.begin(), leave_ms.end());
  state.counters["leaves_during_erasure"] = static_cast<double>(leave_ms.size());
  state.counters["leave_p50_ms"] = leave_ms.empty() ? 0 : leave_ms[leave_ms.size() / 2];
  state.counters["leave_max_ms"] = leave_ms.empty() ? 0 : leave_ms.back();
  state.counters["erasure_ms"] = erasure_ms_total / static_cast<double>(std::max<std::int64_t>(1, state.iterations()));
}
BENCHMARK(BM_LeaveInTheStripeDuringErasure)->UseManualTime()->Iterations(1)->Repetitions(5)
    ->Unit(benchmark::kMillisecond);

// One user whose ledger holds 1M cells (1,000 cohorts x 1,000 items, one
// record per cohort): the purge builds its batch in passes of at most
// 262,144 cells, so its memory stays bounded. Run it alone (peak RSS is per
// process): purge_bench --benchmark_filter=MillionCells. The Db is written
// as SST files in key order, streaming (no map of the cells).
void BM_PurgeOneUserOfAMillionCells(benchmark::State& state) {
  constexpr std::uint64_t kUser = 7, kCohorts = 1000, kCellItems = 1000;
  const std::string path = scratch_dir("purge_million") + "/db";
  if (!must_open(path)->close().ok()) std::abort();
  {
    rocksdb::Options options;  // the SST writers'
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::DB* raw = open_raw_state(path, &handles);
    rocksdb::SstFileWriter ledger(rocksdb::EnvOptions(), options, handles[2]);
    rocksdb::SstFileWriter aggregates(rocksdb::EnvOptions(), options, handles[1]);
    check(ledger.Open(path + "/../ledger.sst"), "sst open");
    check(aggregates.Open(path + "/../aggregates.sst"), "sst open");
    std::string record, units;
    for (std::uint64_t c = 0; c < kCohorts; ++c) {
      record.clear();
      for (std::uint64_t i = 0; i < kCellItems; ++i) {
        const Units u = 1'000'000'000 + static_cast<Units>((c + i) % 7);
        put_ledger_entry(&record, {AggregateKind::Cohort, c, i, u});
        units.clear();
        put_units(&units, u);
        check(aggregates.Put(encode_aggregate_key(AggregateKind::Cohort, c, i), units), "sst put");
      }
      check(ledger.Put(encode_ledger_key(kUser, c + 1), record), "sst put");
    }
    check(ledger.Finish(), "sst finish");
    check(aggregates.Finish(), "sst finish");
    check(raw->IngestExternalFile(handles[2], {path + "/../ledger.sst"}, rocksdb::IngestExternalFileOptions()), "ingest");
    check(raw->IngestExternalFile(handles[1], {path + "/../aggregates.sst"}, rocksdb::IngestExternalFileOptions()),
          "ingest");
    for (auto* h : handles) check(raw->DestroyColumnFamilyHandle(h), "handle");
    check(raw->Close(), "close");
    delete raw;
  }
  std::unique_ptr<Db> db = must_open(path);
  if (!db->leave_community_layer(kUser).ok()) std::abort();
  const double before = rss_mib();
  std::uint64_t removed = 0;
  for (auto _ : state) {
    Result<PurgeReceipt> r = db->purge_community_contributions(kUser);
    if (!r.ok()) state.SkipWithError(r.status().to_string().c_str());
    removed = r.ok() ? r->entries_removed : 0;
  }
  state.counters["entries_removed"] = static_cast<double>(removed);
  state.counters["rss_before_MiB"] = before;
  state.counters["peak_rss_MiB"] = peak_rss_mib();
  if (!db->close().ok()) std::abort();
}
BENCHMARK(BM_PurgeOneUserOfAMillionCells)->Iterations(1)->Unit(benchmark::kSecond);

void BM_BulkPurge(benchmark::State& state) {
  Fixture& f = fixture();
  const auto n = static_cast<std::uint64_t>(state.range(0));
  const std::uint64_t users = background_users();
  std::vector<std::uint64_t> ids;
  for (std::uint64_t i = 0; i < n; ++i) ids.push_back(i * (users / n) + 3);  // spread over the key space
  if (!f.db->leave_community_layer(ids).ok()) std::abort();
  for (auto _ : state) {
    Result<std::vector<PurgeReceipt>> r = f.db->purge_community_contributions(ids);
    if (!r.ok()) state.SkipWithError(r.status().to_string().c_str());
  }
}
BENCHMARK(BM_BulkPurge)->Arg(10'000)->Iterations(1)->Unit(benchmark::kSecond);

// Leaves of other users (never seen before, in every lock stripe) made one
// after another while `op` runs on another thread; their latencies go to
// the counters leave_p50/p99/max_ms (issue 26, item 2: a leave never waits
// for a purge or a scan; target p99 <= 20 ms, max <= 100 ms).
template <class Op>
void leaves_during(benchmark::State& state, std::uint64_t first_user, Op op) {
  Fixture& f = fixture();
  std::vector<double> leave_ms;
  std::uint64_t next = first_user;
  for (auto _ : state) {
    std::atomic<bool> done{false};
    Status op_status;
    const auto start = std::chrono::steady_clock::now();
    std::thread worker([&] {
      op_status = op(f);
      done.store(true);
    });
    while (!done.load()) {
      const auto t = std::chrono::steady_clock::now();
      if (!f.db->leave_community_layer(next++).ok()) std::abort();
      if (!done.load()) leave_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count());
    }
    worker.join();
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (!op_status.ok()) state.SkipWithError(op_status.to_string().c_str());
  }
  std::sort(leave_ms.begin(), leave_ms.end());
  const auto at = [&](double q) { return leave_ms.empty() ? 0 : leave_ms[static_cast<std::size_t>(q * static_cast<double>(leave_ms.size() - 1))]; };
  state.counters["leaves"] = static_cast<double>(leave_ms.size());
  state.counters["leave_p50_ms"] = at(0.5);
  state.counters["leave_p99_ms"] = at(0.99);
  state.counters["leave_max_ms"] = leave_ms.empty() ? 0 : leave_ms.back();
}

// A bulk purge of 5,000 Left users spread over the key space (every stripe).
void BM_LeavesDuringBulkPurge(benchmark::State& state) {
  const std::uint64_t users = background_users();
  leaves_during(state, kSmallBase + (1ULL << 30), [users](Fixture& f) -> Status {
    std::vector<std::uint64_t> ids;
    for (std::uint64_t i = 0; i < 5'000; ++i) ids.push_back(i * (users / 5'000) + 5);
    if (Status s = f.db->leave_community_layer(ids); !s.ok()) return s;
    Result<std::vector<PurgeReceipt>> r = f.db->purge_community_contributions(ids);
    return r.ok() ? Status::OK() : r.status();
  });
}
BENCHMARK(BM_LeavesDuringBulkPurge)->UseManualTime()->Iterations(1)->Unit(benchmark::kSecond);

// rematerialize_shared_aggregates(false) over the whole ledger.
void BM_LeavesDuringRematerialize(benchmark::State& state) {
  leaves_during(state, kSmallBase + (2ULL << 30), [](Fixture& f) -> Status {
    Result<RematerializeReport> r = f.db->rematerialize_shared_aggregates(false);
    return r.ok() ? Status::OK() : r.status();
  });
}
BENCHMARK(BM_LeavesDuringRematerialize)->UseManualTime()->Iterations(1)->Unit(benchmark::kSecond);

void BM_SealedReclaimPass(benchmark::State& state) {
  const char* path = std::getenv("TIDAL_RECLAIM_BENCH_DB");
  if (path == nullptr) {
    state.SkipWithError("set TIDAL_RECLAIM_BENCH_DB to a copy of a format-4 Db (it is changed)");
    return;
  }
  Result<std::unique_ptr<Db>> db = Db::open(path, Options());
  if (!db.ok()) {
    state.SkipWithError(db.status().to_string().c_str());
    return;
  }
  Storage& storage = Db::Impl::storage_for_testing(**db);
  rocksdb::DB* engine = storage.db(Storage::Engine::State);
  const auto live_bytes = [&] {
    rocksdb::ColumnFamilyMetaData meta;
    engine->GetColumnFamilyMetaData(storage.sealed_ledger(), &meta);
    return meta.size;
  };
  const std::uint64_t before = live_bytes();
  for (auto _ : state) {
    rocksdb::CompactRangeOptions options;
    options.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForce;
    check(engine->CompactRange(options, storage.sealed_ledger(), nullptr, nullptr), "CompactRange");
  }
  state.counters["records_dropped"] = static_cast<double>(storage.sealed_records_reclaimed());
  state.counters["sealed_MB_before"] = static_cast<double>(before) / 1e6;
  state.counters["sealed_MB_after"] = static_cast<double>(live_bytes()) / 1e6;
  if (Status s = (*db)->close(); !s.ok()) state.SkipWithError(s.to_string().c_str());
}
BENCHMARK(BM_SealedReclaimPass)->Iterations(1)->Unit(benchmark::kSecond);

void BM_Rematerialize(benchmark::State& state) {
  Fixture& f = fixture();
  std::uint64_t entries = 0, mismatches = 0;
  for (auto _ : state) {
    Result<RematerializeReport> r = f.db->rematerialize_shared_aggregates(false);
    if (!r.ok()) state.SkipWithError(r.status().to_string().c_str());
    entries = r.ok() ? r->ledger_entries_read : 0;
    mismatches = r.ok() ? r->mismatches.size() : 0;
  }
  state.counters["entries/s"] =
      benchmark::Counter(static_cast<double>(entries), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["ledger_entries"] = static_cast<double>(entries);
  state.counters["mismatches"] = static_cast<double>(mismatches);
}
BENCHMARK(BM_Rematerialize)->Iterations(1)->Repetitions(3)->Unit(benchmark::kSecond);

}  // namespace

void close_fixture() {
  if (g_fixture != nullptr) (void)g_fixture->db->close();
}

}  // namespace tidal::bench

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  tidal::bench::close_fixture();
  benchmark::Shutdown();
  return 0;
}
