// verify() and rematerialize_shared_aggregates(false) on a Db of
// TIDAL_SCAN_BENCH_CELLS shared cells (default 2M: half cohort, half
// community cells, two ledger entries each, 20 entries per ledger record),
// with the I1 check's cap on the cells it holds (storage/ledger_scan.h) as
// the argument (0: the default, 2^21 cells):
//   BM_Verify/<cap>, BM_Rematerialize/<cap>   counters passes (reads of the
//       ledger), runs (sorted runs written), peak_cells, rss_before_MiB
//       (after open) and peak_rss_MiB (the process's ru_maxrss)
// Peak RSS is per process: run one benchmark per process, on a Db built once
// by an earlier run with TIDAL_SCAN_BENCH_DIR set (kept, and reused when it
// holds a Db of the same size):
//   TIDAL_SCAN_BENCH_DIR=/tmp/scan scan_bench --benchmark_filter=BM_Build
//   TIDAL_SCAN_BENCH_DIR=/tmp/scan /usr/bin/time -v scan_bench --benchmark_filter='BM_Verify/0/'
// The Db is written as SST files in key order, streaming: each cell's sum is
// known from its index, so building it holds no map of the cells.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include <benchmark/benchmark.h>
#include <rocksdb/db.h>
#include <rocksdb/sst_file_writer.h>

#include "bench_util.h"
#include "storage/ledger_scan.h"
#include "storage/state_format.h"

namespace tidal::bench {
namespace {

constexpr std::uint64_t kEntriesPerCell = 2, kEntriesPerRecord = 20, kItems = 1000;
// Coprime with any cell count that is not a multiple of it: spreads each
// user's entries over the whole key space.
constexpr std::uint64_t kStride = 1'000'003;

std::uint64_t cells() {
  const char* v = std::getenv("TIDAL_SCAN_BENCH_CELLS");
  return v != nullptr ? std::strtoull(v, nullptr, 10) : 2'000'000;
}

void check(const rocksdb::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::abort();
  }
}

// Cell n of `total`: the first half cohort cells, the second community cells,
// in key order.
LedgerEntry cell(std::uint64_t n, std::uint64_t total) {
  const std::uint64_t half = total / 2, m = n < half ? n : n - half;
  return {n < half ? AggregateKind::Cohort : AggregateKind::Community, m / kItems, m % kItems,
          static_cast<Units>(1'000'000'000 + n % 7)};
}

// Writes the ledger (each cell gets kEntriesPerCell entries, from different
// users) and the aggregates that equal their sums, as ingested SST files.
void build(const std::string& path, std::uint64_t total) {
  if (!must_open(path)->close().ok()) std::abort();  // column families and the format mark
  rocksdb::Options options;  // the SST writers'
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = open_raw_state(path, &handles);
  {
    rocksdb::SstFileWriter writer(rocksdb::EnvOptions(), options, handles[2]);
    const std::string file = path + "/../ledger.sst";
    check(writer.Open(file), "sst open");
    const std::uint64_t users = total * kEntriesPerCell / kEntriesPerRecord;
    std::vector<LedgerEntry> entries;
    std::string value;
    for (std::uint64_t u = 0; u < users; ++u) {
      entries.clear();
      for (std::uint64_t j = 0; j < kEntriesPerRecord; ++j) {
        entries.push_back(cell((u * kEntriesPerRecord + j) * kStride % total, total));
      }
      std::sort(entries.begin(), entries.end(), [](const LedgerEntry& a, const LedgerEntry& b) {
        return std::tie(a.target, a.target_id, a.item) < std::tie(b.target, b.target_id, b.item);
      });
      value.clear();
      for (const LedgerEntry& e : entries) put_ledger_entry(&value, e);
      check(writer.Put(encode_ledger_key(u, 1), value), "sst put");
    }
    check(writer.Finish(), "sst finish");
    check(raw->IngestExternalFile(handles[2], {file}, rocksdb::IngestExternalFileOptions()), "ingest ledger");
  }
  {
    rocksdb::SstFileWriter writer(rocksdb::EnvOptions(), options, handles[1]);
    const std::string file = path + "/../aggregates.sst";
    check(writer.Open(file), "sst open");
    std::string value;
    for (std::uint64_t n = 0; n < total; ++n) {
      const LedgerEntry c = cell(n, total);
      value.clear();
      put_units(&value, c.units * kEntriesPerCell);
      check(writer.Put(encode_aggregate_key(c.target, c.target_id, c.item), value), "sst put");
    }
    check(writer.Finish(), "sst finish");
    check(raw->IngestExternalFile(handles[1], {file}, rocksdb::IngestExternalFileOptions()), "ingest aggregates");
  }
  for (auto* h : handles) check(raw->DestroyColumnFamilyHandle(h), "handle");
  check(raw->Close(), "close");
  delete raw;
}

// The Db's path, built on first use (or found from an earlier run).
const std::string& db_path() {
  static const std::string path = [] {
    const char* dir = std::getenv("TIDAL_SCAN_BENCH_DIR");
    const std::string base = dir != nullptr ? std::string(dir) : scratch_dir("scan_bench");
    const std::string db = base + "/db", mark = base + "/built-" + std::to_string(cells());
    if (std::filesystem::exists(mark)) return db;
    std::filesystem::remove_all(db);
    std::filesystem::create_directories(base);
    const auto t0 = std::chrono::steady_clock::now();
    build(db, cells());
    std::ofstream(mark) << "built\n";
    std::fprintf(stderr, "scan_bench: Db of %llu shared cells, %llu ledger entries built in %.1f s\n",
                 static_cast<unsigned long long>(cells()), static_cast<unsigned long long>(cells() * kEntriesPerCell),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return db;
  }();
  return path;
}

void BM_Build(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(db_path());
}
BENCHMARK(BM_Build)->Iterations(1);

// Runs `call` (verify or rematerialize) once per iteration on the opened Db.
template <class Call>
void run(benchmark::State& state, Call call) {
  auto db = must_open(db_path());
  set_ledger_pass_cells(static_cast<std::size_t>(state.range(0)));
  reset_ledger_pass_tally();
  const double before = rss_mib();
  for (auto _ : state) {
    if (Status s = call(*db); !s.ok()) state.SkipWithError(s.to_string().c_str());
  }
  const LedgerPassTally tally = ledger_pass_tally();
  state.counters["passes"] = static_cast<double>(tally.passes) / static_cast<double>(state.iterations());
  state.counters["runs"] = static_cast<double>(tally.runs) / static_cast<double>(state.iterations());
  state.counters["peak_cells"] = static_cast<double>(tally.peak_cells);
  state.counters["rss_before_MiB"] = before;
  state.counters["peak_rss_MiB"] = peak_rss_mib();
  set_ledger_pass_cells(0);
  if (!db->close().ok()) std::abort();
}

void BM_Verify(benchmark::State& state) {
  std::uint64_t checked = 0;
  run(state, [&](Db& db) -> Status {
    Result<VerifyReport> r = db.verify();
    if (!r.ok()) return r.status();
    if (!r->ok()) return Status::Corruption(r->problems.front());
    checked = r->records_checked;
    return Status::OK();
  });
  state.counters["records_checked"] = static_cast<double>(checked);
}
BENCHMARK(BM_Verify)->Arg(0)->Arg(1 << 18)->Arg(1 << 22)->Iterations(1)->Unit(benchmark::kSecond);

void BM_Rematerialize(benchmark::State& state) {
  std::uint64_t entries = 0;
  run(state, [&](Db& db) -> Status {
    Result<RematerializeReport> r = db.rematerialize_shared_aggregates(false);
    if (!r.ok()) return r.status();
    if (!r->mismatches.empty()) return Status::Corruption(r->mismatches.front());
    entries = r->ledger_entries_read;
    return Status::OK();
  });
  state.counters["ledger_entries"] = static_cast<double>(entries);
}
BENCHMARK(BM_Rematerialize)->Arg(0)->Arg(1 << 18)->Arg(1 << 22)->Iterations(1)->Unit(benchmark::kSecond);

}  // namespace
}  // namespace tidal::bench

BENCHMARK_MAIN();
