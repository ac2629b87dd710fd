// The privacy journal and recovery (issue 28), in one binary so that every
// ratio comes from one run:
//  - BM_LeaveJournalLocal: leave latency with Options::journal (journal_wait
//    0, nothing replicating) vs without, on two Dbs of the same size, default
//    options (sync_writes), leaves alternating between them in blocks;
//    range(0) signalling threads on each Db meanwhile. Target: ratio of the
//    medians <= 1.2.
//  - BM_BackupUnderSignals: Db::backup of the 1M-user Db below, alone and
//    while range(0) threads signal; signals/s in phases without backups and
//    with backups (range(1) ms apart, 0 = back to back), in the order
//    without, with, with, without (twice); the ratio of the phases' means.
//    Targets: a backup <= 10 s; signals/s with backups >= 0.9 x without.
//  - BM_RecoveryTime: a backup of that Db, then 10,000 journal entries
//    (leaves and rejoins, then range(0) single purges among them), then the restore: the
//    backup linked into a new directory (as `tidalctl restore`), open, the
//    entries replayed (read_journal from the original, Db::replay_journal),
//    finish_recovery (re-seeds the change feed), one signal accepted.
//    Targets: <= 30 s in all; with 1,000 purges <= 10 s (the replay re-runs
//    consecutive purges as one bulk purge).
//
// The big Db: TIDAL_JOURNAL_BENCH_USERS users (default 1,000,000; ids
// 1..N), each in 1-3 of 1,000 communities, 1 % of them Left, and the state
// of TIDAL_JOURNAL_BENCH_SIGNALS_PER_USER signals each (default 20: 20M
// signals) as tidal-demo sends them (1 of 1,000 items, 0-4 of 500 cohorts,
// the user's communities): the ledger records and the aggregates (personal
// and shared) that equal their sums (I1) are written as SST files with the
// state engine's own options and ingested, the users records straight into
// the users engine; then the Db is opened with the journal and a change feed
// (shard 7), whose seed is trimmed as a publisher would. Built once per
// process, or kept in $TIDAL_JOURNAL_BENCH_FIXTURE and reused; every
// benchmark works on a copy (table files hard-linked).
//
//   build/bench/journal_bench --benchmark_filter=LeaveJournalLocal
//   TIDAL_JOURNAL_BENCH_FIXTURE=/tmp/jb1m build/bench/journal_bench --benchmark_filter='Backup|Recovery'
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <rocksdb/sst_file_writer.h>

#include "bench_util.h"
#include "storage/format.h"
#include "storage/state_format.h"
#include "storage/storage.h"

namespace tidal::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

void check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "journal_bench: %s: %s\n", what, s.to_string().c_str());
    std::abort();
  }
}

std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::strtoull(v, nullptr, 10) : fallback;
}

// splitmix64, as tidal-demo's.
struct Rng {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  std::uint64_t below(std::uint64_t n) { return next() % n; }
};

// Copies the directory tree `from` to `to` (which must not exist) as
// `tidalctl restore` does: table files hard-linked (RocksDB never changes
// one), every other file copied. Counts both.
void link_tree(const std::string& from, const std::string& to, std::uint64_t* linked, std::uint64_t* copied) {
  namespace fs = std::filesystem;
  fs::create_directories(to);
  for (auto it = fs::recursive_directory_iterator(from); it != fs::recursive_directory_iterator(); ++it) {
    const fs::path dest = fs::path(to) / fs::relative(it->path(), from);
    if (it->is_directory()) {
      fs::create_directories(dest);
      continue;
    }
    std::error_code ec;
    if (it->path().extension() == ".sst") {
      fs::create_hard_link(it->path(), dest, ec);
      if (!ec) {
        ++*linked;
        continue;
      }
    }
    fs::copy_file(it->path(), dest);
    ++*copied;
  }
}

// ---- 1. a leave with the journal (local mode) vs without ----

constexpr std::uint64_t kLeaveMembers = 20'000;

std::unique_ptr<Db> leave_db(bool journal) {
  const std::string dir = scratch_dir(journal ? "leave-journal" : "leave-plain");
  Options setup;
  setup.sync_writes = false;  // the joins only
  setup.journal = journal;
  auto db = must_open(dir, setup);
  for (std::uint64_t u = 0; u < kLeaveMembers; ++u) check(db->join_community(u, 1 + u % 16), "join");
  check(db->close(), "close");
  db.reset();
  Options options;  // the defaults: sync_writes
  options.journal = journal;
  return must_open(dir, options);
}

void signal_loop(Db& db, int t, const std::atomic<bool>& stop) {
  std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 1);
  const SignalContext context{{7}};
  for (std::uint64_t k = 0; !stop.load(std::memory_order_relaxed); ++k) {
    auto out = db.signal_with_context({kLeaveMembers + rng() % 1024, k % 64, 1.0}, context);
    benchmark::DoNotOptimize(out);
  }
}

void BM_LeaveJournalLocal(benchmark::State& state) {
  const int signalers = static_cast<int>(state.range(0));
  auto plain = leave_db(false);
  auto journaled = leave_db(true);
  for (std::uint64_t u = kLeaveMembers; u < kLeaveMembers + 1024; ++u) {
    check(plain->join_community(u, 1), "join");
    check(journaled->join_community(u, 1), "join");
  }
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < signalers; ++t) {
    threads.emplace_back([&, t] { signal_loop(*plain, t, stop); });
    threads.emplace_back([&, t] { signal_loop(*journaled, t, stop); });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  // Blocks of 100 leaves of distinct members, alternating between the Dbs.
  constexpr std::uint64_t kBlock = 100, kBlocks = 20;
  std::vector<double> off_ms, on_ms;
  std::uint64_t next = 0;
  for (auto _ : state) {
    for (std::uint64_t b = 0; b < 2 * kBlocks; ++b) {
      const bool on = b % 2 == 1;
      Db& db = on ? *journaled : *plain;
      const std::uint64_t first = (b / 2) * kBlock;
      for (std::uint64_t i = 0; i < kBlock; ++i) {
        const auto t0 = Clock::now();
        if (!db.leave_community_layer(first + i).ok()) state.SkipWithError("leave failed");
        (on ? on_ms : off_ms).push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      }
      next = first + kBlock;
    }
    double total = 0;
    for (double m : on_ms) total += m;
    state.SetIterationTime(total / 1000);
  }
  stop = true;
  for (auto& t : threads) t.join();
  const Stats js = journaled->stats();
  if (js.journal_last_seq != next) state.SkipWithError("the journal does not hold one entry per leave");
  state.counters["leaves_each"] = static_cast<double>(on_ms.size());
  state.counters["off_p50_ms"] = percentile(off_ms, 0.5);
  state.counters["on_p50_ms"] = percentile(on_ms, 0.5);
  state.counters["off_p99_ms"] = percentile(off_ms, 0.99);
  state.counters["on_p99_ms"] = percentile(on_ms, 0.99);
  state.counters["ratio_p50"] = percentile(on_ms, 0.5) / percentile(off_ms, 0.5);
}
BENCHMARK(BM_LeaveJournalLocal)
    ->ArgName("signalers_per_db")->Arg(0)->Arg(2)
    ->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);

// ---- the big Db ----

constexpr std::uint64_t kItems = 1000, kCohorts = 500, kCommunities = 1000;
constexpr std::uint64_t kShard = 7;

std::uint64_t big_users() { return env_u64("TIDAL_JOURNAL_BENCH_USERS", 1'000'000); }
std::uint64_t signals_per_user() { return env_u64("TIDAL_JOURNAL_BENCH_SIGNALS_PER_USER", 20); }
bool left_at_start(std::uint64_t user) { return user % 100 == 0; }

// User u's communities: 1-3 distinct of 1..kCommunities, ascending.
std::vector<std::uint64_t> communities_of(std::uint64_t user) {
  Rng rng{user * 0x2545f4914f6cdd1dULL};
  std::vector<std::uint64_t> out;
  const std::uint64_t n = 1 + rng.below(3);
  while (out.size() < n) {
    const std::uint64_t c = 1 + rng.below(kCommunities);
    if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  }
  std::sort(out.begin(), out.end());
  return out;
}

Options big_options() {
  Options o;
  o.journal = true;
  o.change_feed = true;
  o.shard_id = kShard;
  return o;
}

struct Cell {
  std::uint64_t item;
  Units units;
};

void build_big_db(const std::string& path) {
  const auto t0 = Clock::now();
  const std::uint64_t users = big_users(), per_user = signals_per_user();
  must_open(path).reset();  // both engines, the layout and the format mark
  auto storage = Storage::open(path, Storage::Config{});
  check(storage.status(), "storage open");
  Storage& st = **storage;

  // Users engine: memberships and the 1 % Left (with their history entry).
  rocksdb::WriteBatch batch;
  const std::uint64_t at = 1'700'000'000'000'000'000ULL;
  auto put_users = [&](bool force) {
    if (batch.Count() >= 10'000 || (force && batch.Count() > 0)) {
      check(st.write(Storage::Engine::Users, &batch, Storage::WriteMode::Async, "bulk load"), "users write");
      batch.Clear();
    }
  };
  for (std::uint64_t u = 1; u <= users; ++u) {
    for (std::uint64_t c : communities_of(u)) {
      std::string suffix;
      put_u64_be(&suffix, c);
      st.put_record(&batch, EntityId(u), Tag::CommunityMember, suffix, {});
    }
    if (left_at_start(u)) {
      put_left(st, &batch, u, at + u);
    }
    put_users(false);
  }
  put_users(true);

  // State engine: one ledger record per user (its signals' shared cells) and
  // its personal cells, in files of 100,000 users; then the shared totals.
  std::vector<Units> cohort_total((kCohorts + 1) * (kItems + 1), 0), community_total((kCommunities + 1) * (kItems + 1), 0);
  std::uint64_t ledger_entries = 0, personal_cells = 0, files = 0;
  const std::string ledger_file = st.ingest_dir() + "/bench-ledger.sst";
  const std::string personal_file = st.ingest_dir() + "/bench-personal.sst";
  std::vector<LedgerEntry> entries;
  std::vector<Cell> personal;
  std::string value, key;
  for (std::uint64_t first = 1; first <= users; first += 100'000) {
    auto ledger = st.sst_writer(st.ledger());
    auto aggregates = st.sst_writer(st.aggregates());
    check(ledger->Open(ledger_file).ok() ? Status::OK() : Status::IOError("sst open"), "ledger sst");
    check(aggregates->Open(personal_file).ok() ? Status::OK() : Status::IOError("sst open"), "personal sst");
    const std::uint64_t last = std::min(users, first + 99'999);
    for (std::uint64_t u = first; u <= last; ++u) {
      Rng rng{u * 0x9e3779b97f4a7c15ULL + 1};
      const std::vector<std::uint64_t> communities = communities_of(u);
      entries.clear();
      personal.clear();
      for (std::uint64_t k = 0; k < per_user; ++k) {
        const std::uint64_t item = 1 + rng.below(kItems);
        const Units units = static_cast<Units>(250'000'000) * static_cast<Units>(1 + rng.below(8));
        personal.push_back({item, units});
        const std::uint64_t cohorts = rng.below(5);
        for (std::uint64_t c = 0; c < cohorts; ++c) {
          entries.push_back({AggregateKind::Cohort, 1 + rng.below(kCohorts), item, units});
        }
        for (std::uint64_t c : communities) entries.push_back({AggregateKind::Community, c, item, units});
      }
      // One ledger entry per cell, sorted by (target, id, item).
      std::sort(entries.begin(), entries.end(), [](const LedgerEntry& a, const LedgerEntry& b) {
        return std::tie(a.target, a.target_id, a.item) < std::tie(b.target, b.target_id, b.item);
      });
      value.clear();
      for (std::size_t i = 0; i < entries.size();) {
        LedgerEntry e = entries[i++];
        while (i < entries.size() && entries[i].target == e.target && entries[i].target_id == e.target_id &&
               entries[i].item == e.item) {
          e.units += entries[i++].units;
        }
        put_ledger_entry(&value, e);
        ++ledger_entries;
        auto& total = e.target == AggregateKind::Cohort ? cohort_total : community_total;
        total[e.target_id * (kItems + 1) + e.item] += e.units;
      }
      if (!value.empty() && !ledger->Put(encode_ledger_key(u, 1), value).ok()) check(Status::IOError("put"), "ledger");
      std::sort(personal.begin(), personal.end(), [](const Cell& a, const Cell& b) { return a.item < b.item; });
      for (std::size_t i = 0; i < personal.size();) {
        Cell c = personal[i++];
        while (i < personal.size() && personal[i].item == c.item) c.units += personal[i++].units;
        value.clear();
        put_units(&value, c.units);
        if (!aggregates->Put(encode_aggregate_key(AggregateKind::Personal, u, c.item), value).ok()) {
          check(Status::IOError("put"), "personal");
        }
        ++personal_cells;
      }
    }
    check(ledger->Finish().ok() ? Status::OK() : Status::IOError("sst finish"), "ledger finish");
    check(aggregates->Finish().ok() ? Status::OK() : Status::IOError("sst finish"), "personal finish");
    check(st.ingest({{st.ledger(), ledger_file}, {st.aggregates(), personal_file}}, "bench ingest"), "ingest");
    st.delete_file(ledger_file);
    st.delete_file(personal_file);
    files += 2;
  }
  std::uint64_t shared_cells = 0;
  {
    auto aggregates = st.sst_writer(st.aggregates());
    check(aggregates->Open(personal_file).ok() ? Status::OK() : Status::IOError("sst open"), "shared sst");
    for (AggregateKind kind : {AggregateKind::Cohort, AggregateKind::Community}) {
      const auto& total = kind == AggregateKind::Cohort ? cohort_total : community_total;
      for (std::size_t i = 0; i < total.size(); ++i) {
        if (total[i] == 0) continue;
        value.clear();
        put_units(&value, total[i]);
        if (!aggregates->Put(encode_aggregate_key(kind, i / (kItems + 1), i % (kItems + 1)), value).ok()) {
          check(Status::IOError("put"), "shared");
        }
        ++shared_cells;
      }
    }
    check(aggregates->Finish().ok() ? Status::OK() : Status::IOError("sst finish"), "shared finish");
    check(st.ingest({{st.aggregates(), personal_file}}, "bench ingest"), "ingest shared");
    st.delete_file(personal_file);
  }
  check(st.close(), "storage close");
  storage->reset();

  // The journal and the change feed: the feed's seed (every shared cell)
  // trimmed, as a publisher would have.
  auto db = must_open(path, big_options());
  check(db->trim_changes(*db->last_change_seq()), "trim");
  const Stats s = db->stats();
  check(db->close(), "close");
  std::fprintf(stderr,
               "journal_bench: big Db of %llu users (%llu Left), %llu signals: %llu ledger entries, %llu personal and "
               "%llu shared cells, %llu ingested files; built in %.1f s\n",
               static_cast<unsigned long long>(users), static_cast<unsigned long long>(s.users_left),
               static_cast<unsigned long long>(users * per_user), static_cast<unsigned long long>(ledger_entries),
               static_cast<unsigned long long>(personal_cells), static_cast<unsigned long long>(shared_cells),
               static_cast<unsigned long long>(files + 1), seconds_since(t0));
}

// The built Db's directory: $TIDAL_JOURNAL_BENCH_FIXTURE (built there once,
// reused while it holds the marker of the same sizes), else a scratch one.
const std::string& big_db() {
  static const std::string path = [] {
    const std::string marker_text = std::to_string(big_users()) + " users, " + std::to_string(signals_per_user()) +
                                    " signals each\n";
    const char* keep = std::getenv("TIDAL_JOURNAL_BENCH_FIXTURE");
    if (keep == nullptr) {
      const std::string p = scratch_dir("big") + "/db";
      build_big_db(p);
      return p;
    }
    const std::string p = std::string(keep) + "/db", marker = std::string(keep) + "/BUILT";
    std::ifstream in(marker);
    std::string seen((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (seen == marker_text) {
      std::fprintf(stderr, "journal_bench: reusing the big Db in %s (%s)\n", keep, marker_text.c_str());
      return p;
    }
    std::filesystem::remove_all(keep);
    std::filesystem::create_directories(keep);
    build_big_db(p);
    std::ofstream(marker) << marker_text;
    return p;
  }();
  return path;
}

// A working copy of the big Db, opened.
std::unique_ptr<Db> open_copy(const std::string& name, std::string* dir) {
  *dir = scratch_dir(name) + "/db";
  std::uint64_t linked = 0, copied = 0;
  link_tree(big_db(), *dir, &linked, &copied);
  return must_open(*dir, big_options());
}

// A signal as tidal-demo sends them.
void next_signal(Rng& rng, std::uint64_t users, Signal* s, SignalContext* ctx) {
  s->user_id = 1 + rng.below(users);
  s->item_id = 1 + rng.below(kItems);
  s->weight = 1.0;
  ctx->cohort_ids.resize(rng.below(5));
  for (std::uint64_t& c : ctx->cohort_ids) c = 1 + rng.below(kCohorts);
}

// Trims the change feed every 100 ms, as a publisher would.
class Trimmer {
 public:
  explicit Trimmer(Db& db)
      : thread_([this, &db] {
          while (!stop_.load()) {
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
            Result<std::uint64_t> last = db.last_change_seq();
            if (last.ok() && *last > 0) (void)db.trim_changes(*last);
          }
        }) {}
  ~Trimmer() {
    stop_ = true;
    thread_.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// ---- 3. backup at 1M users, and the signal path meanwhile ----

void BM_BackupUnderSignals(benchmark::State& state) {
  const int threads_n = static_cast<int>(state.range(0));
  const auto spacing = std::chrono::milliseconds(state.range(1));
  std::string dir;
  auto db = open_copy("backup", &dir);
  const std::string backups = scratch_dir("backups");
  std::atomic<std::uint64_t> backup_n{0};
  auto one_backup = [&](std::vector<double>* secs) {
    const std::string to = backups + "/b" + std::to_string(backup_n.fetch_add(1));
    const auto t0 = Clock::now();
    const Status s = db->backup(to);
    secs->push_back(seconds_since(t0));
    std::filesystem::remove_all(to);  // keep one at a time, as --keep 1 would
    return s;
  };

  // Alone.
  std::vector<double> idle;
  for (int i = 0; i < 5; ++i) {
    if (Status s = one_backup(&idle); !s.ok()) state.SkipWithError(s.to_string().c_str());
  }

  Trimmer trimmer(*db);
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> signals{0}, failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < threads_n; ++t) {
    threads.emplace_back([&, t] {
      Rng rng{static_cast<std::uint64_t>(t) * 7919 + 11};
      Signal s;
      SignalContext ctx;
      while (!stop.load(std::memory_order_relaxed)) {
        next_signal(rng, big_users(), &s, &ctx);
        if (db->signal_with_context(s, ctx).ok()) {
          signals.fetch_add(1, std::memory_order_relaxed);
        } else {
          failed.fetch_add(1, std::memory_order_relaxed);
        }
      }
    });
  }
  std::atomic<bool> backing_up{false};
  std::vector<double> loaded;  // the backups' times under the load
  std::thread backer([&] {
    std::vector<double> mine;
    while (!stop.load()) {
      if (!backing_up.load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
      if (Status s = one_backup(&mine); !s.ok()) std::fprintf(stderr, "backup: %s\n", s.to_string().c_str());
      const auto until = Clock::now() + spacing;
      while (backing_up.load() && Clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    loaded = mine;
  });
  std::this_thread::sleep_for(std::chrono::seconds(3));  // warm up

  // Phases of 5 s in the order without, with, with, without (twice): the
  // signal rate drifts as the state engine grows and compacts, and this
  // order cancels a linear drift out of the means.
  std::vector<double> without, with;
  for (auto _ : state) {
    for (int phase = 0; phase < 8; ++phase) {
      const bool on = phase % 4 == 1 || phase % 4 == 2;
      backing_up = on;
      const std::uint64_t n0 = signals.load();
      const auto t0 = Clock::now();
      std::this_thread::sleep_for(std::chrono::seconds(5));
      const double rate = static_cast<double>(signals.load() - n0) / seconds_since(t0);
      (on ? with : without).push_back(rate);
      std::fprintf(stderr, "  phase %d (%s backups): %.0f signals/s\n", phase, on ? "with" : "without", rate);
    }
    backing_up = false;
    state.SetIterationTime(percentile(idle, 0.5));
  }
  stop = true;
  for (auto& t : threads) t.join();
  backer.join();
  if (failed.load() > 0) state.SkipWithError("some signals failed");
  state.counters["backup_idle_p50_s"] = percentile(idle, 0.5);
  state.counters["backup_idle_max_s"] = percentile(idle, 1.0);
  state.counters["backups_loaded"] = static_cast<double>(loaded.size());
  state.counters["backup_loaded_p50_s"] = percentile(loaded, 0.5);
  state.counters["backup_loaded_max_s"] = percentile(loaded, 1.0);
  auto mean = [](const std::vector<double>& v) {
    double sum = 0;
    for (double x : v) sum += x;
    return v.empty() ? 0 : sum / static_cast<double>(v.size());
  };
  state.counters["signals_s_without"] = mean(without);
  state.counters["signals_s_with"] = mean(with);
  state.counters["ratio"] = mean(with) / mean(without);
  check(db->close(), "close");
}
BENCHMARK(BM_BackupUnderSignals)
    ->ArgNames({"threads", "spacing_ms"})->Args({2, 0})->Args({2, 1000})
    ->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);

// ---- 4. the time to recover: restore + 10,000 journal entries ----

void BM_RecoveryTime(benchmark::State& state) {
  const std::uint64_t purges = static_cast<std::uint64_t>(state.range(0));
  const std::uint64_t users = big_users();
  std::string dir;
  auto db = open_copy("recovery", &dir);
  const std::string bk = scratch_dir("recovery-backup") + "/bk";
  const auto tb = Clock::now();
  check(db->backup(bk), "backup");
  const double backup_s = seconds_since(tb);
  const std::uint64_t seq0 = *db->last_journal_seq();

  // 10,000 entries after the backup: 6,000 users left in one bulk call,
  // 2,000 of them rejoined in another, 2,000 single leaves (each synced),
  // then `purges` single purges of users left among them.
  std::vector<std::uint64_t> bulk, back;
  std::uint64_t u = 1;
  auto next_active = [&] {
    while (left_at_start(u)) ++u;
    return u++;
  };
  for (int i = 0; i < 6000; ++i) bulk.push_back(next_active() * 97 % users + 1);
  std::sort(bulk.begin(), bulk.end());
  bulk.erase(std::unique(bulk.begin(), bulk.end()), bulk.end());
  bulk.erase(std::remove_if(bulk.begin(), bulk.end(), left_at_start), bulk.end());
  const auto tw = Clock::now();
  check(db->leave_community_layer(std::span<const std::uint64_t>(bulk)), "bulk leave");
  for (std::size_t i = 0; i < 2000 && i < bulk.size(); ++i) back.push_back(bulk[i * 3 % bulk.size()]);
  std::sort(back.begin(), back.end());
  back.erase(std::unique(back.begin(), back.end()), back.end());
  check(db->rejoin_community_layer(std::span<const std::uint64_t>(back)), "bulk rejoin");
  std::vector<std::uint64_t> singles;
  while (*db->last_journal_seq() - seq0 + purges < 10'000) {
    std::uint64_t v = next_active() * 97 % users + 1;
    if (left_at_start(v) || std::binary_search(bulk.begin(), bulk.end(), v)) continue;
    check(db->leave_community_layer(v), "leave");
    singles.push_back(v);
  }
  for (std::uint64_t i = 0; i < purges && i < singles.size(); ++i) {
    check(db->purge_community_contributions(singles[i]).status(), "purge");
  }
  const double writes_s = seconds_since(tw);
  const std::uint64_t last = *db->last_journal_seq();
  std::vector<JournalEntry> entries;
  for (std::uint64_t after = seq0; after < last;) {
    Result<std::vector<JournalEntry>> chunk = db->read_journal(after, 16 << 20);
    check(chunk.status(), "read_journal");
    if (chunk->empty()) break;
    after = chunk->back().seq;
    for (JournalEntry& e : *chunk) entries.push_back(std::move(e));
  }
  if (entries.size() != last - seq0) state.SkipWithError("read_journal returned fewer entries than written");
  const Stats original = db->stats();

  double link_s = 0, open_s = 0, replay_s = 0, finish_s = 0, signal_s = 0;
  std::uint64_t linked = 0, copied = 0;
  for (auto _ : state) {
    const std::string restored_dir = scratch_dir("restored") + "/db";
    const auto t0 = Clock::now();
    link_tree(bk, restored_dir, &linked, &copied);
    const auto t1 = Clock::now();
    auto restored = must_open(restored_dir, big_options());
    const auto t2 = Clock::now();
    check(restored->replay_journal(entries), "replay_journal");
    const auto t3 = Clock::now();
    check(restored->finish_recovery(), "finish_recovery");
    const auto t4 = Clock::now();
    check(restored->signal_with_context({2, 1, 1.0}, {{1, 2}}).status(), "first signal");
    const auto t5 = Clock::now();
    auto d = [](Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); };
    link_s = d(t0, t1), open_s = d(t1, t2), replay_s = d(t2, t3), finish_s = d(t3, t4), signal_s = d(t4, t5);
    state.SetIterationTime(d(t0, t5));
    const Stats r = restored->stats();
    if (r.journal_last_seq != original.journal_last_seq || r.users_left != original.users_left || r.recovering) {
      state.SkipWithError("the restored Db differs from the original (journal seq, users Left or recovering)");
    }
    check(restored->close(), "close restored");
  }
  state.counters["entries"] = static_cast<double>(entries.size());
  state.counters["purges"] = static_cast<double>(std::min<std::uint64_t>(purges, singles.size()));
  state.counters["backup_s"] = backup_s;
  state.counters["writes_s"] = writes_s;
  state.counters["files_linked"] = static_cast<double>(linked);
  state.counters["restore_link_s"] = link_s;
  state.counters["open_s"] = open_s;
  state.counters["replay_s"] = replay_s;
  state.counters["finish_recovery_s"] = finish_s;
  state.counters["first_signal_s"] = signal_s;
  check(db->close(), "close");
}
BENCHMARK(BM_RecoveryTime)
    ->ArgName("purges")->Arg(0)->Arg(20)->Arg(1000)
    ->Iterations(1)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace tidal::bench

BENCHMARK_MAIN();
