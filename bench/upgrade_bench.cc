// The upgrade of a format-2 Db (tidal 0.2: one RocksDB database) to format 3
// (issue 26, item 9): its disk and its time at TIDAL_UPGRADE_BENCH_USERS
// users (default 1M) with TIDAL_UPGRADE_BENCH_RECORDS ledger records each
// (default 4), and whether it holds up other opens in the process.
//   BM_UpgradeFormat2   one Db::open of a format-2 Db, which upgrades it.
//     state_mib         the Db directory's disk before the open (blocks, each
//                       inode once)
//     peak_ratio        the most disk the directory used during the open,
//                       sampled every 5 ms, over state_mib
//     seconds           the open, upgrade included
//     other_open_ms     the longest open (and close) of another, new Db in
//                       the same process while the upgrade ran, and
//     other_open_alone_ms  the longest such open before it
// The format-2 Db is written with RocksDB's API, as tidal 0.2 laid it out:
// column families default (meta, state_format "2", state_epoch), users,
// by_tag, aggregates and ledger; the ledger records of each user (epochs
// 1, 3, 5, ...) of 3 entries over 100 cohorts and 1,000 communities x 1,000
// items, and the aggregates that equal their sums (I1). Its users partition
// is empty: the upgrade leaves it where it is.
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <benchmark/benchmark.h>
#include <rocksdb/db.h>

#include "bench_util.h"
#include "storage/format.h"
#include "storage/state_format.h"

namespace tidal::bench {
namespace {

constexpr std::uint64_t kEntriesPerRecord = 3;
constexpr std::uint64_t kCohorts = 100, kCommunities = 1000, kItems = 1000;

std::uint64_t users() {
  const char* v = std::getenv("TIDAL_UPGRADE_BENCH_USERS");
  return v != nullptr ? std::strtoull(v, nullptr, 10) : 1'000'000;
}

// Ledger records per user (TIDAL_UPGRADE_BENCH_RECORDS, default 4).
std::uint64_t records_per_user() {
  const char* v = std::getenv("TIDAL_UPGRADE_BENCH_RECORDS");
  return v != nullptr ? std::strtoull(v, nullptr, 10) : 4;
}

void check(const rocksdb::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::abort();
  }
}

// The disk a directory tree uses: allocated blocks, each inode once (hard
// links shared between the two engines count once, as on the disk).
std::uint64_t disk_bytes(const std::string& dir) {
  std::set<std::pair<dev_t, ino_t>> seen;
  std::uint64_t total = 0;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0) continue;  // deleted meanwhile
    if (seen.insert({st.st_dev, st.st_ino}).second) total += static_cast<std::uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

void write_format2(const std::string& path) {
  rocksdb::Options options;
  options.create_if_missing = true;
  options.create_missing_column_families = true;
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
  for (const char* n : {"default", "users", "by_tag", "aggregates", "ledger"}) {
    cfs.emplace_back(n, rocksdb::ColumnFamilyOptions());
  }
  cfs[3].options.merge_operator = new_units_add_operator();
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  check(rocksdb::DB::Open(options, path, cfs, &handles, &raw), "open format 2");
  std::unique_ptr<rocksdb::DB> db(raw);
  rocksdb::WriteOptions no_wal;
  no_wal.disableWAL = true;
  std::map<std::string, Units> totals;
  const std::uint64_t n = users();
  const std::uint64_t records = records_per_user();
  rocksdb::WriteBatch batch;
  std::string value;
  for (std::uint64_t u = 0; u < n; ++u) {
    for (std::uint64_t r = 0; r < records; ++r) {
      value.clear();
      for (std::uint64_t e = 0; e < kEntriesPerRecord; ++e) {
        const std::uint64_t k = u * 31 + r * 7 + e;
        const bool community = e == 2;
        const LedgerEntry entry{community ? AggregateKind::Community : AggregateKind::Cohort,
                                community ? (u + r) % kCommunities : k % kCohorts, (k * 13 + u) % kItems,
                                static_cast<Units>(1'000'000'000 + k % 7)};
        put_ledger_entry(&value, entry);
        totals[encode_aggregate_key(entry.target, entry.target_id, entry.item)] += entry.units;
      }
      batch.Put(handles[4], encode_ledger_key(u, 2 * r + 1), value);
    }
    if (batch.Count() >= 4096) {
      check(db->Write(no_wal, &batch), "write ledger");
      batch.Clear();
    }
  }
  for (const auto& [key, units] : totals) {
    value.clear();
    put_units(&value, units);
    batch.Put(handles[3], key, value);
    if (batch.Count() >= 4096) {
      check(db->Write(no_wal, &batch), "write aggregates");
      batch.Clear();
    }
  }
  value.clear();
  put_u64_be(&value, 2 * records + 1);
  batch.Put(handles[0], kStateEpochKey, value);
  batch.Put(handles[0], kStateFormatKey, kStateFormat);
  check(db->Write(no_wal, &batch), "write meta");
  check(db->Flush(rocksdb::FlushOptions(), handles), "flush");
  for (auto* h : handles) check(db->DestroyColumnFamilyHandle(h), "destroy handle");
  check(db->Close(), "close format 2");
}

// Opens and closes new Dbs under `dir` until `stop`; the longest, in ms.
double longest_other_open(const std::string& dir, const std::atomic<bool>& stop, std::chrono::milliseconds at_least) {
  double longest = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; !stop.load() || std::chrono::steady_clock::now() - start < at_least; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    {
      std::unique_ptr<Db> db = must_open(dir + "/" + std::to_string(i));
      if (!db->close().ok()) std::abort();
    }
    longest = std::max(longest, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    std::filesystem::remove_all(dir + "/" + std::to_string(i));
    if (stop.load() && std::chrono::steady_clock::now() - start >= at_least) break;
  }
  return longest;
}

void BM_UpgradeFormat2(benchmark::State& state) {
  const std::string root = scratch_dir("upgrade_bench");
  const std::string path = root + "/db";
  write_format2(path);
  const std::uint64_t before = disk_bytes(path);
  const std::string others = root + "/others";
  std::filesystem::create_directories(others);
  std::atomic<bool> stop{true};
  const double alone = longest_other_open(others, stop, std::chrono::seconds(1));
  for (auto _ : state) {
    std::atomic<bool> done{false};
    std::uint64_t peak = before;
    std::thread sampler([&] {
      while (!done.load()) {
        peak = std::max(peak, disk_bytes(path));
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
    double during = 0;
    std::thread opener([&] { during = longest_other_open(others, done, std::chrono::milliseconds(0)); });
    const auto t0 = std::chrono::steady_clock::now();
    std::unique_ptr<Db> db = must_open(path);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    done = true;
    sampler.join();
    opener.join();
    peak = std::max(peak, disk_bytes(path));
    state.counters["state_mib"] = static_cast<double>(before) / (1 << 20);
    state.counters["peak_mib"] = static_cast<double>(peak) / (1 << 20);
    state.counters["peak_ratio"] = static_cast<double>(peak) / static_cast<double>(before);
    state.counters["after_mib"] = static_cast<double>(disk_bytes(path)) / (1 << 20);
    state.counters["seconds"] = seconds;
    state.counters["other_open_ms"] = during;
    state.counters["other_open_alone_ms"] = alone;
    if (!db->close().ok()) std::abort();
  }
}
BENCHMARK(BM_UpgradeFormat2)->Iterations(1)->Unit(benchmark::kSecond)->UseRealTime();

}  // namespace
}  // namespace tidal::bench

BENCHMARK_MAIN();
