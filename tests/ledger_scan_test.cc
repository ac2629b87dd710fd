// The I1 check in passes of bounded memory (storage/ledger_scan.h): with the
// cap forced down to a few cells, verify() and rematerialize_shared_aggregates
// find exactly what they find in one pass, repair the same, and no pass holds
// more cells than the cap.
#include <atomic>
#include <chrono>
#include <cstring>
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

#include "raw_db.h"
#include "storage/ledger_scan.h"
#include "storage/state_format.h"
#include "test_util.h"

namespace tidal {
namespace {

using testing::open_db;
using testing::RawDb;
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

// Every cap to try: one cell, a few, and the default (one pass).
const std::size_t kCaps[] = {1, 3, 64, 0};

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) { return a == 0 ? 1 : (a + b - 1) / b; }

TEST(LedgerScan, ATinyCapFindsExactlyWhatOnePassFinds) {
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
    if (cap != 0) {
      // The ledger holds every workload cell; community 777 has none.
      EXPECT_EQ(ledger_pass_tally().passes, 2 * ceil_div(w.cells.size(), cap));
    }
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
    EXPECT_GT(ledger_pass_tally().passes, w.cells.size() / 3);
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
  auto db = open_db(dir.sub("db"), options);
  auto reference = open_db(dir.sub("reference"), manual_writes());
  ASSERT_NE(db, nullptr);
  std::optional<PassCells> cells(std::in_place, 1);  // one pass per cell: a long scan (the repair's only)
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

TEST(LedgerScan, APassNeverHoldsMoreCellsThanTheCap) {
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
    EXPECT_EQ(tally.peak_cells, cap);  // every pass but the last is full
    EXPECT_EQ(tally.passes, ceil_div(w.cells.size(), cap));
  }
  PassCells whole(0);
  ASSERT_OK(db->verify());
  EXPECT_EQ(ledger_pass_tally().peak_cells, w.cells.size());
  EXPECT_EQ(ledger_pass_tally().passes, 1u);
}

}  // namespace
}  // namespace tidal
