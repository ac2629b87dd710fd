// The I1 check in bounded memory (storage/ledger_scan.h): with the cap forced
// down to a few cells, so that the ledger's sums are spilled in many sorted
// runs and merged, verify() and rematerialize_shared_aggregates find exactly
// what they find with every cell in memory, repair the same, read the ledger
// once, hold no more cells than the cap, and leave no run file behind.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <rocksdb/db.h>
#include <rocksdb/env.h>

#include "db/impl.h"
#include "raw_db.h"
#include "storage/ledger_scan.h"
#include "storage/state_format.h"
#include "storage/storage.h"
#include "test_util.h"

namespace tidal {
namespace {

using testing::open_db;
using testing::RawDb;
using testing::ScopedOverride;
using testing::TempDir;
using testing::value_of;

Options manual_writes() {
  Options options;
  options.aggregate_write_period = std::chrono::hours(1);
  return options;
}

// Sets the cap of every check for the scope of a test, and clears the tally.
class PassCells {
 public:
  explicit PassCells(std::size_t cells) {
    set_ledger_pass_cells(cells);
    reset_ledger_pass_tally();
  }
  ~PassCells() { set_ledger_pass_cells(0); }
  PassCells(const PassCells&) = delete;
  PassCells& operator=(const PassCells&) = delete;
};

// Users 1..40 in two of five communities each, 1,200 signals over 30 cohorts
// and 40 items: about 1,000 shared cells.
constexpr std::uint64_t kUsers = 40, kItems = 40, kCohorts = 30, kCommunities = 5;

struct Workload {
  std::vector<std::pair<Signal, SignalContext>> signals;
  // Every shared cell the signals touch: (kind, owner, item).
  std::set<std::tuple<AggregateKind, std::uint64_t, std::uint64_t>> cells;

  Workload() {
    std::mt19937_64 rng(20);
    for (int i = 0; i < 1200; ++i) {
      const std::uint64_t user = 1 + rng() % kUsers, item = rng() % kItems;
      SignalContext ctx;
      for (std::uint64_t c = 0; c < 1 + rng() % 3; ++c) ctx.cohort_ids.push_back(rng() % kCohorts);
      signals.push_back({{user, item, (static_cast<double>(rng() % 1000) - 300) / 3.0 + 0.1}, ctx});
      for (std::uint64_t c : ctx.cohort_ids) cells.emplace(AggregateKind::Cohort, c, item);
      for (std::uint64_t m : communities_of(user)) cells.emplace(AggregateKind::Community, m, item);
    }
  }
  static std::vector<std::uint64_t> communities_of(std::uint64_t user) {
    return {100 + user % kCommunities, 100 + (user + 1) % kCommunities};
  }
  void feed(Db& db) const {
    for (std::uint64_t u = 1; u <= kUsers; ++u) {
      for (std::uint64_t m : communities_of(u)) ASSERT_OK(db.join_community(u, m));
    }
    for (const auto& [signal, ctx] : signals) ASSERT_OK(db.signal_with_context(signal, ctx));
    ASSERT_OK(db.flush());
  }
  std::string key(std::size_t n) const {
    auto [kind, owner, item] = *std::next(cells.begin(), static_cast<std::ptrdiff_t>(n));
    return encode_aggregate_key(kind, owner, item);
  }
};

void build(const std::string& path, const Workload& w) {
  auto db = open_db(path, manual_writes());
  ASSERT_NE(db, nullptr);
  w.feed(*db);
  ASSERT_OK(db->close());
}

// Damages the shared aggregates behind tidal's back, at the first, a middle
// and the last shared key, and with a cell the ledger never saw.
void damage_shared(const std::string& path, const Workload& w) {
  RawDb raw(path);
  rocksdb::WriteOptions wo;
  std::string one, five;
  put_units(&one, 1);
  put_units(&five, 5'000'000'000);
  ASSERT_TRUE(raw.db(RawDb::kAggregates)->Merge(wo, raw.cf(RawDb::kAggregates), w.key(0), one).ok());  // off by 1e-9
  ASSERT_TRUE(raw.db(RawDb::kAggregates)->Delete(wo, raw.cf(RawDb::kAggregates), w.key(w.cells.size() / 2)).ok());  // absent
  ASSERT_TRUE(raw.db(RawDb::kAggregates)->Delete(wo, raw.cf(RawDb::kAggregates), w.key(w.cells.size() - 1)).ok());  // absent, last
  ASSERT_TRUE(raw.db(RawDb::kAggregates)->Put(wo, raw.cf(RawDb::kAggregates), encode_aggregate_key(AggregateKind::Community, 777, 3), five)
                  .ok());  // no ledger entry
}

// Adds what does not decode: a ledger record and a personal cell.
void damage_undecodable(const std::string& path) {
  RawDb raw(path);
  rocksdb::WriteOptions wo;
  ASSERT_TRUE(raw.db(RawDb::kLedger)->Put(wo, raw.cf(RawDb::kLedger), encode_ledger_key(999, 1), std::string(32, 'x')).ok());
  ASSERT_TRUE(
      raw.db(RawDb::kAggregates)->Put(wo, raw.cf(RawDb::kAggregates), encode_aggregate_key(AggregateKind::Personal, 999, 7), "12345678")
          .ok());
}

std::string all(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& l : lines) out += l + "\n";
  return out;
}

// Every cap to try: one cell, a few, and the default (every cell in memory).
const std::size_t kCaps[] = {1, 3, 64, 0};

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return a == 0 ? 1 : (a + b - 1) / b; }

// The directories of runs in the Db's directory.
std::vector<std::string> run_dirs(const std::string& path) {
  std::vector<std::string> out;
  for (const auto& entry : std::filesystem::directory_iterator(path)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("verify-tmp-")) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(LedgerScan, ATinyCapFindsExactlyWhatTheWholeTableFinds) {
  TempDir dir;
  const std::string path = dir.sub("db");
  const Workload w;
  build(path, w);
  damage_shared(path, w);
  damage_undecodable(path);
  auto db = open_db(path, manual_writes());

  Result<VerifyReport> whole = db->verify();
  ASSERT_OK(whole);
  Result<RematerializeReport> remat_whole = db->rematerialize_shared_aggregates();
  ASSERT_OK(remat_whole);
  // The undecodable ledger record first, then the cells in key order.
  ASSERT_EQ(remat_whole->mismatches.size(), 6u) << all(remat_whole->mismatches);
  const std::vector<std::string>& m = remat_whole->mismatches;
  EXPECT_NE(m[0].find("ledger key " + hex(encode_ledger_key(999, 1))), std::string::npos) << m[0];
  EXPECT_NE(m[1].find("personal user 999 item 7"), std::string::npos) << m[1];
  EXPECT_NE(m[1].find("does not decode"), std::string::npos) << m[1];
  EXPECT_NE(m[2].find(hex(w.key(0))), std::string::npos) << m[2];
  EXPECT_NE(m[3].find(hex(w.key(w.cells.size() / 2))), std::string::npos) << m[3];
  EXPECT_NE(m[3].find("stored 0 (absent)"), std::string::npos) << m[3];
  EXPECT_NE(m[4].find(hex(w.key(w.cells.size() - 1))), std::string::npos) << m[4];
  EXPECT_NE(m[5].find("community 777 item 3"), std::string::npos) << m[5];
  EXPECT_NE(m[5].find("stored 5000000000, ledger 0"), std::string::npos) << m[5];
  // verify() reports the same lines (it checks the users partition first, which is healthy).
  EXPECT_EQ(all(whole->problems), all(m));

  for (std::size_t cap : kCaps) {
    SCOPED_TRACE("cap " + std::to_string(cap));
    PassCells cells(cap);
    Result<VerifyReport> v = db->verify();
    ASSERT_OK(v);
    EXPECT_EQ(all(v->problems), all(whole->problems));
    EXPECT_EQ(v->records_checked, whole->records_checked);
    Result<RematerializeReport> r = db->rematerialize_shared_aggregates();
    ASSERT_OK(r);
    EXPECT_EQ(all(r->mismatches), all(m));
    EXPECT_EQ(r->ledger_entries_read, remat_whole->ledger_entries_read);
    EXPECT_EQ(r->aggregates_checked, remat_whole->aggregates_checked);
    EXPECT_FALSE(r->repaired);
    // One read of the ledger per check. A run holds at most `cap` cells and
    // every workload cell is in one (community 777 has no ledger entry).
    const LedgerPassTally tally = ledger_pass_tally();
    EXPECT_EQ(tally.passes, 2u);
    if (cap != 0) {
      EXPECT_GE(tally.runs, 2 * ceil_div(w.cells.size(), cap));
    } else {
      EXPECT_EQ(tally.runs, 0u);
    }
    EXPECT_EQ(run_dirs(path), std::vector<std::string>{});
  }
}

TEST(LedgerScan, RepairUnderATinyCapLeavesEveryScoreAsIfNeverDamaged) {
  TempDir dir;
  const Workload w;
  build(dir.sub("reference"), w);
  build(dir.sub("db"), w);
  damage_shared(dir.sub("db"), w);
  auto db = open_db(dir.sub("db"), manual_writes());
  {
    PassCells cells(3);
    Result<RematerializeReport> fixed = db->rematerialize_shared_aggregates(/*repair=*/true);
    ASSERT_OK(fixed);
    EXPECT_EQ(fixed->mismatches.size(), 4u) << all(fixed->mismatches);
    EXPECT_TRUE(fixed->repaired);
    EXPECT_EQ(ledger_pass_tally().passes, 1u);
    EXPECT_GE(ledger_pass_tally().runs, ceil_div(w.cells.size(), 3));
  }
  ASSERT_OK(db->close());
  db = open_db(dir.sub("db"), manual_writes());
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << all(v->problems);
  auto reference = open_db(dir.sub("reference"), manual_writes());
  std::size_t differ = 0;
  for (const auto& [kind, owner, item] : w.cells) {
    const Result<double> got = kind == AggregateKind::Cohort ? db->cohort_score(owner, item)
                                                            : db->community_score(owner, item);
    const Result<double> want = kind == AggregateKind::Cohort ? reference->cohort_score(owner, item)
                                                             : reference->community_score(owner, item);
    const double a = value_of(got), b = value_of(want);
    differ += std::memcmp(&a, &b, sizeof a) != 0 ? 1u : 0u;
  }
  EXPECT_EQ(differ, 0u);
  EXPECT_EQ(value_of(db->community_score(777, 3)), 0.0);
}

// Sleeps before each write to a file of the I1 check's runs: with a run per
// ledger entry, a check then lasts long enough to watch the writer meanwhile
// (it reads the ledger once, in a few tens of ms here).
class SlowRunsEnv : public rocksdb::EnvWrapper {
 public:
  SlowRunsEnv() : rocksdb::EnvWrapper(rocksdb::Env::Default()) {}
  const char* Name() const override { return "SlowRunsEnv"; }
  rocksdb::Status NewWritableFile(const std::string& name, std::unique_ptr<rocksdb::WritableFile>* file,
                                  const rocksdb::EnvOptions& options) override {
    rocksdb::Status s = target()->NewWritableFile(name, file, options);
    if (s.ok() && name.find("/verify-tmp-") != std::string::npos) *file = std::make_unique<Slow>(std::move(*file));
    return s;
  }

 private:
  class Slow : public rocksdb::WritableFileWrapper {
   public:
    explicit Slow(std::unique_ptr<rocksdb::WritableFile> file)
        : rocksdb::WritableFileWrapper(file.get()), file_(std::move(file)) {}
    using rocksdb::WritableFileWrapper::Append;
    rocksdb::Status Append(const rocksdb::Slice& data) override {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      return rocksdb::WritableFileWrapper::Append(data);
    }

   private:
    std::unique_ptr<rocksdb::WritableFile> file_;
  };
};

// Issue 26, item 3 (S4): a repairing re-materialization scans at a snapshot
// with no lock, so the writer keeps writing batches all through its scan
// (before, it held the drain lock throughout and no batch was written), and
// its repair, a correction added to each damaged cell, stays exact while
// signals keep landing on those very cells: afterwards every score is
// bit-identical to an undamaged Db that got the same signals.
TEST(LedgerScanConcurrentTest, ARepairWhileSignalsFlowNeverStopsTheWriterAndIsExact) {
  TempDir dir;
  const Workload w;
  build(dir.sub("reference"), w);
  build(dir.sub("db"), w);
  damage_shared(dir.sub("db"), w);
  Options options;
  options.aggregate_write_period = std::chrono::milliseconds(5);
  SlowRunsEnv slow;
  Result<std::unique_ptr<Db>> opened = Db::Impl::open(dir.sub("db"), options, &slow);
  ASSERT_OK(opened.status());
  std::unique_ptr<Db> db = std::move(*opened);
  auto reference = open_db(dir.sub("reference"), manual_writes());
  std::optional<PassCells> cells(std::in_place, 1);  // a slow run per entry: a long scan (the repair's only)
  std::atomic<bool> done{false};
  std::chrono::steady_clock::duration took{};
  Result<RematerializeReport> fixed = Status::Busy("not run");
  std::thread repairer([&] {
    const auto start = std::chrono::steady_clock::now();
    fixed = db->rematerialize_shared_aggregates(/*repair=*/true);
    took = std::chrono::steady_clock::now() - start;
    done = true;
  });
  // The same signals again, into both, while the repair runs: they land on
  // the damaged cells too. Count the batches the writer stores meanwhile.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // past the repair's initial drain
  const std::uint64_t writes_before = db->stats().aggregate_writes;
  std::uint64_t writes_during = 0;
  std::size_t replayed = 0;
  // At most 5,000 (a slow sanitizer build would otherwise grow the ledger
  // the final verify() reads without bound); then only watch.
  while (!done.load()) {
    if (replayed < 5'000) {
      const auto& [signal, ctx] = w.signals[replayed % w.signals.size()];
      ASSERT_OK(db->signal_with_context(signal, ctx));
      ASSERT_OK(reference->signal_with_context(signal, ctx));
      ++replayed;
    }
    writes_during = db->stats().aggregate_writes - writes_before;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  repairer.join();
  cells.reset();  // the checks below at the default cap
  ASSERT_OK(fixed);
  EXPECT_TRUE(fixed->repaired);
  EXPECT_EQ(fixed->mismatches.size(), 4u) << all(fixed->mismatches);
  const auto period = options.aggregate_write_period;
  ASSERT_GT(took, 20 * period) << "the scan was too short to show anything";
  EXPECT_GE(writes_during, 3u) << "the writer stored " << writes_during << " batches during a "
                               << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                               << " ms re-materialization (period " << period.count() << " ms)";
  ASSERT_OK(db->flush());
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  EXPECT_TRUE(v->ok()) << all(v->problems);
  std::size_t differ = 0;
  for (const auto& [kind, owner, item] : w.cells) {
    const double a = value_of(kind == AggregateKind::Cohort ? db->cohort_score(owner, item)
                                                            : db->community_score(owner, item));
    const double b = value_of(kind == AggregateKind::Cohort ? reference->cohort_score(owner, item)
                                                            : reference->community_score(owner, item));
    differ += std::memcmp(&a, &b, sizeof a) != 0 ? 1u : 0u;
  }
  EXPECT_EQ(differ, 0u) << "after " << replayed << " signals replayed during the repair";
  EXPECT_EQ(value_of(db->community_score(777, 3)), 0.0);
}

TEST(LedgerScan, AHealthyDbHasNoMismatchUnderAnyCap) {
  TempDir dir;
  const Workload w;
  build(dir.sub("db"), w);
  auto db = open_db(dir.sub("db"), manual_writes());
  ASSERT_OK(db->signal_with_context({1, 1, 0.5}, {{1}}));  // buffered: drained before the check
  for (std::size_t cap : kCaps) {
    SCOPED_TRACE("cap " + std::to_string(cap));
    PassCells cells(cap);
    Result<VerifyReport> v = db->verify();
    ASSERT_OK(v);
    EXPECT_TRUE(v->ok()) << all(v->problems);
    Result<RematerializeReport> r = db->rematerialize_shared_aggregates(/*repair=*/true);
    ASSERT_OK(r);
    EXPECT_TRUE(r->mismatches.empty()) << all(r->mismatches);
    EXPECT_FALSE(r->repaired);
  }
}

TEST(LedgerScan, TheTableNeverHoldsMoreCellsThanTheCapAndTheLedgerIsReadOnce) {
  TempDir dir;
  const Workload w;
  build(dir.sub("db"), w);
  auto db = open_db(dir.sub("db"), manual_writes());
  for (std::size_t cap : {std::size_t{1}, std::size_t{2}, std::size_t{3}, std::size_t{7}, std::size_t{100}}) {
    SCOPED_TRACE("cap " + std::to_string(cap));
    PassCells cells(cap);
    Result<VerifyReport> v = db->verify();
    ASSERT_OK(v);
    EXPECT_TRUE(v->ok()) << all(v->problems);
    const LedgerPassTally tally = ledger_pass_tally();
    EXPECT_EQ(tally.peak_cells, cap);  // the table is full before each run is written
    EXPECT_EQ(tally.passes, 1u);
    EXPECT_GE(tally.runs, ceil_div(w.cells.size(), cap));
  }
  PassCells whole(0);
  ASSERT_OK(db->verify());
  EXPECT_EQ(ledger_pass_tally().peak_cells, w.cells.size());
  EXPECT_EQ(ledger_pass_tally().passes, 1u);
  EXPECT_EQ(ledger_pass_tally().runs, 0u);
}

// check_ledger itself, on the damaged Db: with 2 or 5 cells a run, every
// cell's sum is split over many runs (a user's entries go to other cells),
// yet each mismatch comes in key order with the exact sums, the ones of the
// undamaged Db's aggregates. Red when the merge loses a run or a record.
TEST(LedgerScan, AMismatchInASpilledRunIsFoundInKeyOrderWithItsExactSums) {
  TempDir dir;
  const Workload w;
  build(dir.sub("reference"), w);
  build(dir.sub("db"), w);
  damage_shared(dir.sub("db"), w);
  Result<std::unique_ptr<Storage>> reference = Storage::open(dir.sub("reference"), Storage::Config{});
  ASSERT_OK(reference.status());
  // The undamaged sum of a cell.
  const auto sum_of = [&](const std::string& key) {
    std::string value;
    EXPECT_OK((*reference)->get((*reference)->aggregates(), key, &value));
    std::optional<Units> u = decode_units(value);
    EXPECT_TRUE(u.has_value()) << hex(key);
    return u.value_or(0);
  };
  Result<std::unique_ptr<Storage>> opened = Storage::open(dir.sub("db"), Storage::Config{});
  ASSERT_OK(opened.status());
  const Storage& storage = **opened;
  struct Found {
    std::string key, what;
    Units recomputed;
    std::optional<Units> stored;
  };
  const auto check = [&](std::size_t cap, LedgerCheck* out) {
    std::vector<Found> found;
    EXPECT_OK(check_ledger(
        storage, out, [](std::string p) { ADD_FAILURE() << p; },
        [&](const AggregateMismatch& m) { found.push_back({m.key, m.what, m.recomputed, m.stored}); },
        [] { ADD_FAILURE() << "the check started over"; }, cap));
    return found;
  };
  LedgerCheck whole_check;
  const std::vector<Found> whole = check(kLedgerPassCells, &whole_check);
  EXPECT_EQ(whole_check.runs, 0u);
  ASSERT_EQ(whole.size(), 4u);
  for (std::size_t cap : {std::size_t{2}, std::size_t{5}}) {
    SCOPED_TRACE("cap " + std::to_string(cap));
    LedgerCheck out;
    const std::vector<Found> found = check(cap, &out);
    EXPECT_EQ(out.passes, 1u);
    EXPECT_GE(out.runs, ceil_div(w.cells.size(), cap));
    EXPECT_EQ(out.ledger_entries, whole_check.ledger_entries);
    EXPECT_EQ(out.aggregates, whole_check.aggregates);
    ASSERT_EQ(found.size(), 4u);
    for (std::size_t i = 1; i < found.size(); ++i) EXPECT_LT(found[i - 1].key, found[i].key);
    for (std::size_t i = 0; i < found.size(); ++i) {
      EXPECT_EQ(found[i].what, whole[i].what);
      EXPECT_TRUE(found[i].recomputed == whole[i].recomputed && found[i].stored == whole[i].stored) << found[i].what;
    }
    // Off by 1e-9, absent in the middle, absent at the end, and no ledger entry.
    const Units first = sum_of(w.key(0)), middle = sum_of(w.key(w.cells.size() / 2)),
                last = sum_of(w.key(w.cells.size() - 1));
    EXPECT_EQ(found[0].key, w.key(0));
    EXPECT_TRUE(found[0].recomputed == first && found[0].stored == first + 1) << found[0].what;
    EXPECT_EQ(found[1].key, w.key(w.cells.size() / 2));
    EXPECT_TRUE(found[1].recomputed == middle && found[1].stored == Units{0}) << found[1].what;
    EXPECT_NE(found[1].what.find("stored 0 (absent), ledger " + units_to_string(middle)), std::string::npos);
    EXPECT_EQ(found[2].key, w.key(w.cells.size() - 1));
    EXPECT_TRUE(found[2].recomputed == last && found[2].stored == Units{0}) << found[2].what;
    EXPECT_EQ(found[3].key, encode_aggregate_key(AggregateKind::Community, 777, 3));
    EXPECT_TRUE(found[3].recomputed == 0 && found[3].stored == Units{5'000'000'000}) << found[3].what;
  }
  EXPECT_EQ(run_dirs(dir.sub("db")), std::vector<std::string>{});
}

// More cells than the table's first 2,048 slots (at the default cap) take at
// half load: it grows twice (rehashing every cell) during the scan, and finds
// exactly the mismatches that a cap of 3 cells (the whole table from the
// start, many runs) finds.
TEST(LedgerScan, TheTableGrowsWithoutLosingACell) {
  TempDir dir;
  const std::string path = dir.sub("db");
  std::set<std::string> cells;
  {
    auto db = open_db(path, manual_writes());
    ASSERT_NE(db, nullptr);
    std::mt19937_64 rng(29);
    for (int i = 0; i < 3000; ++i) {
      const std::uint64_t user = 1 + rng() % 200, item = rng() % 100;
      SignalContext ctx;
      ctx.cohort_ids = {rng() % 100, 100 + rng() % 100};
      ASSERT_OK(db->signal_with_context({user, item, 1.5}, ctx));
      for (std::uint64_t c : ctx.cohort_ids) cells.insert(encode_aggregate_key(AggregateKind::Cohort, c, item));
    }
    ASSERT_OK(db->flush());
    ASSERT_OK(db->close());
  }
  ASSERT_GT(cells.size(), 4096u);
  {
    RawDb raw(path);
    std::string one;
    put_units(&one, 1);
    ASSERT_TRUE(raw.db(RawDb::kAggregates)->Merge(rocksdb::WriteOptions(), raw.cf(RawDb::kAggregates), *cells.begin(), one).ok());
    ASSERT_TRUE(raw.db(RawDb::kAggregates)->Delete(rocksdb::WriteOptions(), raw.cf(RawDb::kAggregates), *cells.rbegin()).ok());
  }
  auto db = open_db(path, manual_writes());
  std::vector<std::string> found[2];
  for (std::size_t cap : {std::size_t{0}, std::size_t{3}}) {
    SCOPED_TRACE("cap " + std::to_string(cap));
    PassCells limit(cap);
    Result<VerifyReport> v = db->verify();
    ASSERT_OK(v);
    ASSERT_EQ(v->problems.size(), 2u) << all(v->problems);
    EXPECT_NE(v->problems[0].find(hex(*cells.begin())), std::string::npos) << v->problems[0];
    EXPECT_NE(v->problems[1].find(hex(*cells.rbegin())), std::string::npos) << v->problems[1];
    EXPECT_NE(v->problems[1].find("stored 0 (absent)"), std::string::npos) << v->problems[1];
    EXPECT_EQ(ledger_pass_tally().peak_cells, cap == 0 ? cells.size() : cap);
    EXPECT_EQ(ledger_pass_tally().runs == 0, cap == 0);
    found[cap == 0 ? 0 : 1] = v->problems;
  }
  EXPECT_EQ(all(found[0]), all(found[1]));
}

// The runs' directory is deleted when the check fails too, and one that a
// crash left (of a process that is gone, or of this one but not live) is
// deleted by the next check; one of a running process is left alone.
// A check that a purge's erasure asks to let go (ask_scans_to_let_go) lets
// go of its snapshot within a step, drops what it found, and starts over at
// a snapshot that sees what was written meanwhile; its progress is in
// Stats while it runs and gone after.
TEST(LedgerScan, ACheckAskedToLetGoStartsOverAtANewerSnapshot) {
  TempDir dir;
  const std::string path = dir.sub("db");
  auto db = open_db(path, manual_writes());
  // 3,000 users, one ledger record each: more than two steps of the check.
  for (std::uint64_t u = 1; u <= 3000; ++u) {
    ASSERT_OK(db->signal_with_context({u, u % 40, 1.0 + static_cast<double>(u % 7)}, {{u % 30}}));
  }
  ASSERT_OK(db->flush());
  Storage& storage = Db::Impl::storage_for_testing(*db);
  const std::string damaged = encode_aggregate_key(AggregateKind::Cohort, 7, 7);
  std::atomic<int> asked{0}, steps{0};
  std::uint64_t read_at_first_step = 0, estimate_at_first_step = 0;
  ScopedOverride hook(Storage::step_for_testing, [&](std::string_view task, int step) {
    if (task != "ledger check") return;
    steps.fetch_add(1);
    if (step != 1 || asked.load() != 0) return;
    const Stats st = db->stats();
    read_at_first_step = st.ledger_check_records_read;
    estimate_at_first_step = st.ledger_check_records_estimate;
    // Written after the check's snapshot: only a new attempt sees it.
    std::string one;
    put_units(&one, 1);
    ASSERT_TRUE(storage.db(Storage::Engine::State)->Merge(rocksdb::WriteOptions(), storage.aggregates(), damaged, one).ok());
    asked.fetch_add(1);
    storage.ask_scans_to_let_go();
  });
  Result<VerifyReport> v = db->verify();
  ASSERT_OK(v);
  EXPECT_EQ(asked.load(), 1);
  EXPECT_EQ(read_at_first_step, 1024u);
  EXPECT_GE(estimate_at_first_step, 3000u);
  // The damage, found once: the first attempt's findings were dropped.
  ASSERT_EQ(v->problems.size(), 1u) << all(v->problems);
  EXPECT_NE(v->problems[0].find("cohort 7 item 7"), std::string::npos) << v->problems[0];
  const Stats st = db->stats();
  EXPECT_EQ(st.ledger_check_restarts, 1u);
  EXPECT_EQ(st.ledger_check_records_read, 0u);
  EXPECT_EQ(st.ledger_check_records_estimate, 0u);
  EXPECT_EQ(run_dirs(path), std::vector<std::string>{});

  // rematerialize_shared_aggregates repairs what its last attempt found, once.
  asked.store(0);
  Result<RematerializeReport> r = db->rematerialize_shared_aggregates(/*repair=*/true);
  ASSERT_OK(r);
  EXPECT_EQ(asked.load(), 1);
  ASSERT_EQ(r->mismatches.size(), 1u) << all(r->mismatches);
  EXPECT_NE(r->mismatches[0].find("stored"), std::string::npos) << r->mismatches[0];
  EXPECT_TRUE(r->repaired);
  EXPECT_EQ(db->stats().ledger_check_restarts, 2u);
  Result<VerifyReport> after = db->verify();
  ASSERT_OK(after);
  EXPECT_TRUE(after->ok()) << all(after->problems);
}

// Issue 41 item 9: purges one after another, each asking the checks to let
// go, faster than a check's pass. verify() and rematerialize start over at
// most kLedgerCheckLetGoes times, then hold their pass to the end: the
// purges asking meanwhile wait for it and finish, erasure complete. (A
// check that always let go started over at every purge.)
TEST(LedgerScan, AChecksRestartsAreBoundedUnderSteadyPurges) {
  TempDir dir;
  auto db = open_db(dir.sub("db"), manual_writes());
  constexpr std::uint64_t kSignalled = 3000, kPurged = 400;
  for (std::uint64_t u = 1; u <= kSignalled; ++u) {
    ASSERT_OK(db->join_community(u, 100 + u % 3));
    ASSERT_OK(db->signal_with_context({u, u % 40, 1.0 + static_cast<double>(u % 7)}, {{u % 30}}));
  }
  ASSERT_OK(db->flush());
  std::vector<std::uint64_t> left;
  for (std::uint64_t u = 1; u <= kPurged; ++u) left.push_back(u * 7);
  ASSERT_OK(db->leave_community_layer(std::span<const std::uint64_t>(left)));
  // Each step of a pass (1,024 records) takes 60 ms: a pass takes ~0.4 s,
  // many purges' time.
  ScopedOverride slow(Storage::step_for_testing, [&](std::string_view task, int) {
    if (task == "ledger check") std::this_thread::sleep_for(std::chrono::milliseconds(60));
  });
  for (std::size_t check = 0; check < 2; ++check) {
    const std::uint64_t restarts_before = db->stats().ledger_check_restarts;
    std::atomic<bool> done{false};
    std::atomic<std::size_t> next{check * kPurged / 2}, purged{0};
    std::thread purger([&] {
      while (!done.load() && next.load() < (check + 1) * kPurged / 2) {
        Result<PurgeReceipt> r = db->purge_community_contributions(left[next.fetch_add(1)]);
        EXPECT_OK(r);
        if (r.ok()) {
          EXPECT_TRUE(r->erasure_complete);
        }
        purged.fetch_add(1);
      }
    });
    // Once purges are flowing.
    while (purged.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const std::size_t purged_before = purged.load();
    if (check == 0) {
      Result<VerifyReport> v = db->verify();
      ASSERT_OK(v);
      EXPECT_TRUE(v->ok()) << all(v->problems);
    } else {
      Result<RematerializeReport> r = db->rematerialize_shared_aggregates(/*repair=*/false);
      ASSERT_OK(r);
      EXPECT_TRUE(r->mismatches.empty()) << all(r->mismatches);
    }
    const std::size_t purged_during = purged.load() - purged_before;
    done.store(true);
    purger.join();
    const std::uint64_t restarts = db->stats().ledger_check_restarts - restarts_before;
    std::printf("[ figures ] check %zu: %llu restarts, %zu purges during it\n", check,
                static_cast<unsigned long long>(restarts), purged_during);
    EXPECT_LE(restarts, kLedgerCheckLetGoes) << "check " << check;
    EXPECT_GE(restarts, 1u) << "check " << check << ": no purge made the check start over";
  }
  Result<VerifyReport> after = db->verify();
  ASSERT_OK(after);
  EXPECT_TRUE(after->ok()) << all(after->problems);
}

TEST(LedgerScan, NoRunDirectoryOutlivesItsCheckAndStaleOnesAreRemoved) {
  TempDir dir;
  const Workload w;
  const std::string path = dir.sub("db");
  build(path, w);
  const std::string self = "verify-tmp-" + std::to_string(::getpid()) + "-99999";
  const std::string gone = "verify-tmp-4000000000-0";  // above any pid_max
  const std::string running = "verify-tmp-1-0";  // pid 1 always runs
  for (const std::string& name : {self, gone, running}) {
    std::filesystem::create_directory(path + "/" + name);
    std::ofstream(path + "/" + name + "/runs") << "left by a crash";
  }
  auto db = open_db(path, manual_writes());
  {
    PassCells cells(3);
    Result<VerifyReport> v = db->verify();
    ASSERT_OK(v);
    EXPECT_TRUE(v->ok()) << all(v->problems);
    EXPECT_GT(ledger_pass_tally().runs, 0u);
  }
  EXPECT_EQ(run_dirs(path), std::vector<std::string>{running});
  ASSERT_OK(db->close());
  std::filesystem::remove_all(path + "/" + running);

  // A merge operand of the wrong length fails the aggregates' iterator, in
  // the merge, after the runs were written.
  {
    RawDb raw(path);
    ASSERT_TRUE(raw.db(RawDb::kAggregates)->Merge(rocksdb::WriteOptions(), raw.cf(RawDb::kAggregates), w.key(7), "abc").ok());
  }
  db = open_db(path, manual_writes());
  PassCells cells(3);
  Result<VerifyReport> v = db->verify();
  EXPECT_FALSE(v.ok());
  EXPECT_GT(ledger_pass_tally().runs, 0u);
  EXPECT_EQ(run_dirs(path), std::vector<std::string>{});
}

}  // namespace
}  // namespace tidal
