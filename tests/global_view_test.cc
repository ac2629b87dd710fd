// The GlobalView (<tidal/global_view.h>, docs/CONTRACT.md "Global view"):
// exactly-once application of every shard's change feed, gaps and
// undecodable payloads refused with nothing changed, exact sums, durability
// (close/reopen, power cuts, a failure of each file operation), checkpoints,
// clear errors at open, the lifecycle, and reads alongside an applying thread.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include "fault_fs.h"
#include "storage/feed_format.h"
#include "storage/state_format.h"
#include "test_util.h"
#include "tidal/global_view.h"
#include "view/global_view_impl.h"
#include "view/view_format.h"

namespace tidal {
namespace {

using testing::TempDir;
using testing::value_of;
namespace fs = std::filesystem;

// ---- building batches ----

struct Delta {
  AggregateKind kind;
  std::uint64_t owner;
  std::uint64_t item;
  Units units;
};
Delta cohort(std::uint64_t id, std::uint64_t item, Units units) { return {AggregateKind::Cohort, id, item, units}; }
Delta community(std::uint64_t id, std::uint64_t item, Units units) {
  return {AggregateKind::Community, id, item, units};
}
// `w` in units of 1e-9, exactly as a Db rounds a signal's weight.
Units weight(double w) { return *weight_to_units(w); }
constexpr Units kUnitsPerWeight = 1'000'000'000;

// One payload of `deltas` in the order given (FeedEncoder does not sort, so
// a test can build keys out of order).
std::string payload_of(const std::vector<Delta>& deltas, FeedOrigin origin = FeedOrigin::Writer) {
  FeedEncoder encoder(origin);
  for (const Delta& d : deltas) encoder.add(encode_aggregate_key(d.kind, d.owner, d.item), d.units);
  std::vector<std::string> payloads = encoder.finish();
  EXPECT_EQ(payloads.size(), 1u);
  return payloads.empty() ? std::string() : payloads[0];
}

ChangeBatch batch(std::uint64_t shard, std::uint64_t seq, const std::vector<Delta>& deltas,
                  FeedOrigin origin = FeedOrigin::Writer) {
  return {shard, seq, payload_of(deltas, origin), {}};
}

std::unique_ptr<GlobalView> open_view(const std::string& path, const GlobalViewOptions& options = {}) {
  Result<std::unique_ptr<GlobalView>> view = GlobalView::open(path, options);
  EXPECT_TRUE(view.ok()) << view.status().to_string();
  return view.ok() ? std::move(*view) : nullptr;
}

std::unique_ptr<GlobalView> open_view_on(const std::string& path, rocksdb::Env* env) {
  Result<std::unique_ptr<GlobalView>> view = GlobalView::Impl::open(path, {}, env);
  EXPECT_TRUE(view.ok()) << view.status().to_string();
  return view.ok() ? std::move(*view) : nullptr;
}

// true when the batch was applied; false when skipped; fails the test on error.
bool applied(GlobalView& view, const ChangeBatch& b) {
  Result<bool> r = view.apply(b);
  EXPECT_TRUE(r.ok()) << "shard " << b.shard_id << " seq " << b.seq << ": " << r.status().to_string();
  return r.ok() && *r;
}

std::uint64_t seq_of(const GlobalView& view, std::uint64_t shard) {
  Result<std::uint64_t> seq = view.applied_seq(shard);
  EXPECT_TRUE(seq.ok()) << seq.status().to_string();
  return seq.ok() ? *seq : ~std::uint64_t{0};
}

std::vector<std::pair<std::uint64_t, std::uint64_t>> shards_of(const GlobalView& view) {
  Result<std::vector<ShardProgress>> shards = view.applied_shards();
  EXPECT_TRUE(shards.ok()) << shards.status().to_string();
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  if (shards.ok()) {
    for (const ShardProgress& p : *shards) out.emplace_back(p.shard_id, p.applied_seq);
  }
  return out;
}

void expect_has(const Status& s, const std::string& text) {
  EXPECT_NE(s.message().find(text), std::string::npos) << "'" << text << "' not in: " << s.to_string();
}

// Every file under `dir` with its size and modification time.
std::map<std::string, std::pair<std::uintmax_t, long long>> listing(const std::string& dir) {
  std::map<std::string, std::pair<std::uintmax_t, long long>> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    struct stat st {};
    ::stat(e.path().c_str(), &st);
    out[fs::relative(e.path(), dir).string()] = {e.file_size(), st.st_mtim.tv_sec * 1'000'000'000LL + st.st_mtim.tv_nsec};
  }
  return out;
}

// A view's directory opened as a plain RocksDB database, to write stored
// bytes that tidal never writes.
struct RawView {
  explicit RawView(const std::string& path) {
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
    cfs.emplace_back(kViewMetaFamily, rocksdb::ColumnFamilyOptions());
    cfs.emplace_back(kViewAggregatesFamily, rocksdb::ColumnFamilyOptions());
    cfs[1].options.merge_operator = new_units_add_operator();
    cfs.emplace_back(kViewShardsFamily, cfs[1].options);
    rocksdb::Options options;
    options.create_if_missing = true;
    options.create_missing_column_families = true;
    rocksdb::DB* raw = nullptr;
    rocksdb::Status s = rocksdb::DB::Open(options, path, cfs, &handles, &raw);
    if (!s.ok()) {
      ADD_FAILURE() << "raw open of " << path << ": " << s.ToString();
      return;
    }
    db.reset(raw);
  }
  ~RawView() {
    if (!db) return;
    for (auto* h : handles) (void)db->DestroyColumnFamilyHandle(h);
    (void)db->Close();
  }
  RawView(const RawView&) = delete;
  RawView& operator=(const RawView&) = delete;
  rocksdb::ColumnFamilyHandle* meta() const { return handles[0]; }
  rocksdb::ColumnFamilyHandle* aggregates() const { return handles[1]; }

  std::unique_ptr<rocksdb::DB> db;
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
};

// ---- child processes ----

// Runs this test binary again with only GlobalViewChild.Run, which does
// `mode` on `path` (TIDAL_VIEW_CHILD="mode path"); returns its exit status
// and its output.
std::pair<int, std::string> run_child(const std::string& mode, const std::string& path) {
  char self[4096] = {};
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return {-1, "readlink /proc/self/exe failed"};
  const std::string cmd = "TIDAL_VIEW_CHILD='" + mode + " " + path + "' '" + std::string(self, static_cast<std::size_t>(n)) +
                          "' --gtest_filter=GlobalViewChild.Run 2>&1";
  FILE* child = ::popen(cmd.c_str(), "r");
  if (child == nullptr) return {-1, "popen failed"};
  std::string out;
  char buf[1024];
  while (std::fgets(buf, sizeof buf, child) != nullptr) out += buf;
  const int status = ::pclose(child);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

// Held by the "exit-holding" child: constructed before any view is opened,
// so destroyed after the statics RocksDB builds at the first open.
std::unique_ptr<GlobalView> g_view_held_at_exit;

// The other side of run_child; skipped when run on its own.
TEST(GlobalViewChild, Run) {
  const char* spec = std::getenv("TIDAL_VIEW_CHILD");
  if (spec == nullptr) GTEST_SKIP() << "a child process of other GlobalView tests; does nothing on its own";
  const std::string text = spec;
  const std::string mode = text.substr(0, text.find(' '));
  const std::string path = text.substr(text.find(' ') + 1);
  if (mode == "open-as-nobody") {
    ASSERT_EQ(::setgid(65534), 0);
    ASSERT_EQ(::setuid(65534), 0);
    Result<std::unique_ptr<GlobalView>> view = GlobalView::open(path);
    std::printf("open: %s\n", view.ok() ? "Ok" : view.status().to_string().c_str());
    std::exit(view.ok() ? 0 : 1);
  }
  if (mode == "exit-holding") {
    Result<std::unique_ptr<GlobalView>> view = GlobalView::open(path);
    ASSERT_TRUE(view.ok()) << view.status().to_string();
    g_view_held_at_exit = std::move(*view);
    ASSERT_TRUE(applied(*g_view_held_at_exit, batch(1, 1, {cohort(1, 1, weight(2.5))})));
    std::fflush(stdout);
    std::exit(0);  // g_view_held_at_exit still open
  }
  FAIL() << "unknown child mode " << mode;
}

// ---- exactly once ----

TEST(GlobalView, AppliesEachBatchExactlyOnce) {
  TempDir dir;
  auto view = open_view(dir.path());
  ASSERT_NE(view, nullptr);
  EXPECT_EQ(seq_of(*view, 7), 0u);
  EXPECT_TRUE(shards_of(*view).empty());
  const ChangeBatch b1 = batch(7, 1, {cohort(1, 1, weight(1.0))});
  const ChangeBatch b2 = batch(7, 2, {cohort(1, 1, weight(2.0)), community(4, 1, weight(-0.5))});
  const ChangeBatch b3 = batch(7, 3, {cohort(1, 1, weight(4.0))});
  EXPECT_TRUE(applied(*view, b1));
  EXPECT_TRUE(applied(*view, b2));
  EXPECT_TRUE(applied(*view, b3));
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 7.0);
  EXPECT_EQ(value_of(view->community_score(4, 1)), -0.5);
  // Redeliveries, of any earlier batch, change nothing.
  for (const ChangeBatch* again : {&b2, &b1, &b3, &b2}) {
    EXPECT_FALSE(applied(*view, *again)) << "seq " << again->seq;
  }
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 7.0);
  EXPECT_EQ(value_of(view->community_score(4, 1)), -0.5);
  EXPECT_EQ(seq_of(*view, 7), 3u);
  // Each shard has its own sequence.
  EXPECT_TRUE(applied(*view, batch(3, 1, {cohort(1, 1, weight(8.0))})));
  EXPECT_TRUE(applied(*view, batch(0xffffffffffffffffULL, 1, {cohort(1, 1, weight(16.0))})));
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 31.0);
  EXPECT_EQ(shards_of(*view), (std::vector<std::pair<std::uint64_t, std::uint64_t>>{
                                  {3, 1}, {7, 3}, {0xffffffffffffffffULL, 1}}));
  ASSERT_OK(view->close());
}

TEST(GlobalView, AGapIsCorruptionNamingTheShardAndBothSeqsWithNothingChanged) {
  TempDir dir;
  auto view = open_view(dir.path());
  ASSERT_NE(view, nullptr);
  ASSERT_TRUE(applied(*view, batch(5, 1, {cohort(1, 1, weight(1.0))})));
  ASSERT_TRUE(applied(*view, batch(5, 2, {cohort(1, 1, weight(2.0))})));

  Result<bool> gap = view->apply(batch(5, 4, {cohort(1, 1, weight(100.0)), cohort(1, 2, weight(100.0))}));
  ASSERT_FALSE(gap.ok());
  EXPECT_EQ(gap.status().code(), StatusCode::Corruption);
  expect_has(gap.status(), "gap: shard 5 has applied through 2; batch seq 4");
  expect_has(gap.status(), dir.path());
  EXPECT_EQ(seq_of(*view, 5), 2u);
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 3.0);
  EXPECT_EQ(value_of(view->cohort_score(1, 2)), 0.0);

  // A shard's first batch must be seq 1.
  Result<bool> first = view->apply(batch(6, 2, {cohort(1, 1, weight(100.0))}));
  ASSERT_FALSE(first.ok());
  EXPECT_EQ(first.status().code(), StatusCode::Corruption);
  expect_has(first.status(), "gap: shard 6 has applied through 0; batch seq 2");
  EXPECT_EQ(shards_of(*view), (std::vector<std::pair<std::uint64_t, std::uint64_t>>{{5, 2}}));
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 3.0);

  // The missing batch applies, then the one refused.
  EXPECT_TRUE(applied(*view, batch(5, 3, {cohort(1, 1, weight(4.0))})));
  EXPECT_TRUE(applied(*view, batch(5, 4, {cohort(1, 1, weight(100.0)), cohort(1, 2, weight(100.0))})));
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 107.0);
  EXPECT_EQ(value_of(view->cohort_score(1, 2)), 100.0);
  EXPECT_EQ(seq_of(*view, 5), 4u);
}

// A run of batches of several shards in one call: each judged as apply(batch)
// would judge it after the ones before it, all in one write.
TEST(GlobalView, ARunOfBatchesAppliesEachAsApplyWouldInOrder) {
  TempDir dir;
  auto view = open_view(dir.path());
  ASSERT_NE(view, nullptr);
  ASSERT_TRUE(applied(*view, batch(1, 1, {cohort(1, 1, weight(1.0))})));
  const std::vector<ChangeBatch> run = {
      batch(1, 2, {cohort(1, 1, weight(2.0))}),
      batch(2, 1, {cohort(1, 1, weight(4.0)), community(3, 1, weight(-1.0))}),
      batch(1, 1, {cohort(1, 1, weight(1000.0))}),  // applied before the call: skipped
      batch(1, 3, {cohort(1, 1, weight(8.0))}),     // follows seq 2 of the same call
      batch(1, 3, {cohort(1, 1, weight(1000.0))}),  // repeated in the call: skipped
      batch(2, 2, {community(3, 1, weight(-2.0))}),
  };
  Result<ApplyOutcome> r = view->apply(std::span<const ChangeBatch>(run));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->taken, 6u);
  EXPECT_EQ(r->applied, 4u);
  EXPECT_OK(r->refused);
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 15.0);
  EXPECT_EQ(value_of(view->community_score(3, 1)), -3.0);
  EXPECT_EQ(shards_of(*view), (std::vector<std::pair<std::uint64_t, std::uint64_t>>{{1, 3}, {2, 2}}));
  // Delivered again whole: every batch skipped, nothing written.
  r = view->apply(std::span<const ChangeBatch>(run));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->taken, 6u);
  EXPECT_EQ(r->applied, 0u);
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 15.0);
  // An empty run takes nothing.
  r = view->apply(std::span<const ChangeBatch>());
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->taken, 0u);
  EXPECT_OK(r->refused);
  // Durable: survives a close and a reopen.
  ASSERT_OK(view->close());
  view = open_view(dir.path());
  ASSERT_NE(view, nullptr);
  EXPECT_EQ(shards_of(*view), (std::vector<std::pair<std::uint64_t, std::uint64_t>>{{1, 3}, {2, 2}}));
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 15.0);
  EXPECT_EQ(value_of(view->community_score(3, 1)), -3.0);
}

// A batch refused in the middle of a run (a gap, a payload that does not
// decode, seq 0): the batches before it are applied, it and every later one
// are not, and the refusal is the one apply(batch) gives.
TEST(GlobalView, ARefusalInTheMiddleOfARunAppliesTheBatchesBeforeItAndNoneAfter) {
  struct Case {
    std::string name;
    ChangeBatch refused;
    StatusCode code;
    std::string text;
  };
  const std::vector<Case> cases = {
      {"a gap", batch(1, 4, {cohort(1, 1, weight(100.0))}), StatusCode::Corruption,
       "gap: shard 1 has applied through 2; batch seq 4"},
      {"an undecodable payload", {1, 3, "not a payload", {}}, StatusCode::Corruption, "does not decode"},
      {"seq 0", batch(2, 0, {cohort(1, 1, weight(100.0))}), StatusCode::InvalidArgument, "seqs start at 1"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TempDir dir;
    auto view = open_view(dir.path());
    ASSERT_NE(view, nullptr);
    ASSERT_TRUE(applied(*view, batch(1, 1, {cohort(1, 1, weight(1.0))})));
    const std::vector<ChangeBatch> run = {
        batch(1, 2, {cohort(1, 1, weight(2.0))}),
        batch(2, 1, {cohort(1, 2, weight(4.0))}),
        c.refused,
        batch(2, 2, {cohort(1, 2, weight(8.0))}),  // would apply: not applied, it follows the refusal
        batch(1, 3, {cohort(1, 1, weight(16.0))}),
    };
    Result<ApplyOutcome> r = view->apply(std::span<const ChangeBatch>(run));
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->taken, 2u);
    EXPECT_EQ(r->applied, 2u);
    EXPECT_EQ(r->refused.code(), c.code) << r->refused.to_string();
    expect_has(r->refused, c.text);
    expect_has(r->refused, "the 2 before it are");
    EXPECT_EQ(shards_of(*view), (std::vector<std::pair<std::uint64_t, std::uint64_t>>{{1, 2}, {2, 1}}));
    EXPECT_EQ(value_of(view->cohort_score(1, 1)), 3.0);
    EXPECT_EQ(value_of(view->cohort_score(1, 2)), 4.0);
    // The rest, delivered again after the refused batch, applies.
    r = view->apply(std::span<const ChangeBatch>(run).subspan(3));
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_EQ(r->taken, 2u);
    EXPECT_EQ(r->applied, 2u);
    EXPECT_EQ(value_of(view->cohort_score(1, 1)), 19.0);
    EXPECT_EQ(value_of(view->cohort_score(1, 2)), 12.0);
  }
  // A refusal first: nothing applied at all.
  TempDir dir;
  auto view = open_view(dir.path());
  ASSERT_NE(view, nullptr);
  const std::vector<ChangeBatch> run = {batch(1, 2, {cohort(1, 1, weight(1.0))}), batch(1, 1, {cohort(1, 1, weight(1.0))})};
  Result<ApplyOutcome> r = view->apply(std::span<const ChangeBatch>(run));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(r->taken, 0u);
  EXPECT_EQ(r->applied, 0u);
  expect_has(r->refused, "gap: shard 1 has applied through 0; batch seq 2");
  EXPECT_TRUE(shards_of(*view).empty());
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 0.0);
}

TEST(GlobalView, AnUndecodablePayloadIsCorruptionWithNothingChanged) {
  TempDir dir;
  auto view = open_view(dir.path());
  ASSERT_NE(view, nullptr);
  ASSERT_TRUE(applied(*view, batch(1, 1, {cohort(1, 1, weight(1.0))})));

  const std::string good = payload_of({cohort(1, 1, weight(2.0)), cohort(1, 2, weight(3.0))});
  std::string bad_version = good;
  bad_version[0] = 2;
  std::string bad_origin = good;
  bad_origin[1] = 9;
  std::string truncated = good.substr(0, good.size() - 1);
  std::string bad_count = good;
  bad_count[2] = 3;
  // kMaxFeedEntries + 1 entries, well formed but one entry too many.
  std::string too_big;
  {
    FeedEncoder encoder(FeedOrigin::Writer);
    for (std::uint64_t i = 0; i <= kMaxFeedEntries; ++i) {
      encoder.add(encode_aggregate_key(AggregateKind::Cohort, 1, 100 + i), weight(1.0));
    }
    std::vector<std::string> two = encoder.finish();
    ASSERT_EQ(two.size(), 2u);
    const std::uint32_t count = kMaxFeedEntries + 1;
    too_big = two[0] + two[1].substr(kFeedHeaderSize);
    for (unsigned i = 0; i < 4; ++i) too_big[2 + i] = static_cast<char>((count >> (8 * i)) & 0xff);
    ASSERT_GT(too_big.size(), kMaxChangePayloadBytes);
  }
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"bad version", bad_version},
      {"bad origin", bad_origin},
      {"truncated", truncated},
      {"count that does not match the length", bad_count},
      {"empty", ""},
      {"above kMaxChangePayloadBytes", too_big},
      {"a personal cell", payload_of({cohort(1, 1, weight(2.0)), {AggregateKind::Personal, 1, 2, weight(3.0)}})},
      {"keys out of order", payload_of({cohort(1, 2, weight(3.0)), cohort(1, 1, weight(2.0))})},
      {"a key twice", payload_of({cohort(1, 1, weight(3.0)), cohort(1, 1, weight(2.0))})},
  };
  for (const auto& [name, payload] : cases) {
    SCOPED_TRACE(name);
    // Refused at the next seq, and at an applied one too: the payload is
    // checked before the seq.
    for (std::uint64_t seq : {2u, 1u}) {
      Result<bool> r = view->apply({1, seq, payload, {}});
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.status().code(), StatusCode::Corruption);
      expect_has(r.status(), "shard 1 seq " + std::to_string(seq));
      expect_has(r.status(), "does not decode");
    }
    EXPECT_EQ(seq_of(*view, 1), 1u);
    EXPECT_EQ(value_of(view->cohort_score(1, 1)), 1.0);
    EXPECT_EQ(value_of(view->cohort_score(1, 2)), 0.0);
  }
  // The decoder's own words name the fault.
  Result<bool> r = view->apply({1, 2, bad_version, {}});
  expect_has(r.status(), "payload version 2, expected 1");
  r = view->apply({1, 2, payload_of({cohort(1, 2, weight(3.0)), cohort(1, 1, weight(2.0))}), {}});
  expect_has(r.status(), "is not above the entry before it");
  EXPECT_TRUE(applied(*view, {1, 2, good, {}}));
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 3.0);
  EXPECT_EQ(value_of(view->cohort_score(1, 2)), 3.0);
}

TEST(GlobalView, SeqZeroIsInvalidArgumentWithNothingChanged) {
  TempDir dir;
  auto view = open_view(dir.path());
  ASSERT_NE(view, nullptr);
  Result<bool> r = view->apply(batch(2, 0, {cohort(1, 1, weight(1.0))}));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::InvalidArgument);
  expect_has(r.status(), "shard 2 seq 0");
  EXPECT_EQ(seq_of(*view, 2), 0u);
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 0.0);
  EXPECT_TRUE(shards_of(*view).empty());
}

// ---- exact sums ----

TEST(GlobalView, SumsAreExactWhateverTheOrderOfTheShards) {
  TempDir dir;
  // What three shards send: 0.1 each to one cell; values past 2^53 units
  // (where a double sum would lose the last unit); the negative deltas of a
  // purge and of a repair.
  const Units big = static_cast<Units>(1) << 62;
  const Units huge = static_cast<Units>(1) << 100;
  std::vector<ChangeBatch> feed = {
      batch(1, 1, {cohort(9, 9, weight(0.1)), community(2, 2, big + 1)}),
      batch(2, 1, {cohort(9, 9, weight(0.1)), community(2, 2, -big), community(3, 3, huge)}),
      batch(3, 1, {cohort(9, 9, weight(0.1)), community(3, 3, huge), community(4, 4, weight(2.5))}),
      batch(1, 2, {community(3, 3, -2 * huge - 5)}, FeedOrigin::Repair),
      batch(3, 2, {community(4, 4, weight(-2.5))}, FeedOrigin::Purge),
  };
  auto check = [](GlobalView& view) {
    // 0.1 three times reads 0.3 bit for bit (a double sum reads 0.30000000000000004).
    EXPECT_EQ(value_of(view.cohort_score(9, 9)), 0.3);
    EXPECT_NE(0.1 + 0.1 + 0.1, 0.3);
    EXPECT_EQ(value_of(view.community_score(2, 2)), 1e-9);   // (2^62 + 1) - 2^62
    EXPECT_EQ(value_of(view.community_score(3, 3)), -5e-9);  // 2^100 + 2^100 - 2^101 - 5
    EXPECT_EQ(value_of(view.community_score(4, 4)), 0.0);    // purged
    EXPECT_EQ(value_of(view.cohort_score(2, 2)), 0.0);       // a cohort is not the community of the same id
  };
  {
    auto view = open_view(dir.sub("in-order"));
    ASSERT_NE(view, nullptr);
    for (const ChangeBatch& b : feed) EXPECT_TRUE(applied(*view, b));
    check(*view);
    EXPECT_EQ(value_of(view->community_score(2, 2)), units_to_double(1));
  }
  // Any interleaving that keeps each shard's order reads the same, bit for bit.
  std::mt19937 rng(7);
  for (int round = 0; round < 5; ++round) {
    std::vector<ChangeBatch> shuffled = feed;
    std::shuffle(shuffled.begin(), shuffled.end(), rng);
    // The shuffled order of shards, each shard's batches in seq order.
    std::map<std::uint64_t, std::vector<ChangeBatch>> by_shard;
    for (const ChangeBatch& b : feed) by_shard[b.shard_id].push_back(b);
    std::vector<ChangeBatch> order;
    std::map<std::uint64_t, std::size_t> next;
    for (const ChangeBatch& b : shuffled) order.push_back(by_shard[b.shard_id][next[b.shard_id]++]);
    auto view = open_view(dir.sub("order-" + std::to_string(round)));
    ASSERT_NE(view, nullptr);
    for (const ChangeBatch& b : order) EXPECT_TRUE(applied(*view, b));
    check(*view);
  }
}

// ---- durability ----

TEST(GlobalView, AppliedBatchesSurviveCloseAndReopen) {
  TempDir dir;
  {
    auto view = open_view(dir.path());
    ASSERT_NE(view, nullptr);
    ASSERT_TRUE(applied(*view, batch(1, 1, {cohort(1, 1, weight(1.5))})));
    ASSERT_TRUE(applied(*view, batch(2, 1, {community(2, 1, weight(-4.0))})));
    ASSERT_OK(view->close());
  }
  {
    auto view = open_view(dir.path());
    ASSERT_NE(view, nullptr);
    EXPECT_EQ(seq_of(*view, 1), 1u);
    EXPECT_EQ(seq_of(*view, 2), 1u);
    EXPECT_EQ(value_of(view->cohort_score(1, 1)), 1.5);
    EXPECT_EQ(value_of(view->community_score(2, 1)), -4.0);
    EXPECT_FALSE(applied(*view, batch(1, 1, {cohort(1, 1, weight(1.5))})));
    ASSERT_TRUE(applied(*view, batch(1, 2, {cohort(1, 1, weight(1.0))})));
    // Dropped without close(): the destructor closes.
  }
  auto view = open_view(dir.path());
  ASSERT_NE(view, nullptr);
  EXPECT_EQ(seq_of(*view, 1), 2u);
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 2.5);
  EXPECT_EQ(shards_of(*view), (std::vector<std::pair<std::uint64_t, std::uint64_t>>{{1, 2}, {2, 1}}));
}

// A view in a global std::unique_ptr, still open at std::exit: the exit
// handler closes it while RocksDB is whole (no crash at exit), and what it
// applied is there.
TEST(GlobalView, AViewStillOpenAtExitIsClosedByTheExitHandler) {
  TempDir dir;
  auto [rc, out] = run_child("exit-holding", dir.sub("view"));
  EXPECT_EQ(rc, 0) << out;
  auto view = open_view(dir.sub("view"));
  ASSERT_NE(view, nullptr);
  EXPECT_EQ(seq_of(*view, 1), 1u);
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 2.5);
}

// Durable on return: every acknowledged apply survives a power cut (the
// file system drops whatever was not fsynced).
TEST(GlobalViewPowerLoss, EveryAcknowledgedApplySurvivesAPowerCut) {
  TempDir dir;
  const std::string path = dir.sub("view");
  std::mt19937 rng(42);
  std::uint64_t acked = 0;
  Units sum = 0;
  std::uint64_t dropped_bytes = 0;
  for (int cut = 0; cut < 20; ++cut) {
    {
      reliability::FaultEnv fault = reliability::FaultEnv::make();
      auto view = open_view_on(path, fault.env.get());
      ASSERT_NE(view, nullptr);
      const int n = 1 + static_cast<int>(rng() % 4);
      for (int i = 0; i < n; ++i) {
        const Units delta = weight(static_cast<double>(acked + 1));
        ASSERT_TRUE(applied(*view, batch(1, acked + 1, {cohort(1, 1, delta), community(2, acked % 3, -delta)})));
        ++acked;
        sum += delta;
      }
      fault.fs->cut_power();
      view.reset();  // its close fails: the power is off
      dropped_bytes += fault.fs->restore_power().bytes_dropped;
    }
    auto view = open_view(path);
    ASSERT_NE(view, nullptr);
    ASSERT_EQ(seq_of(*view, 1), acked) << "cut " << cut;
    ASSERT_EQ(value_of(view->cohort_score(1, 1)), units_to_double(sum)) << "cut " << cut;
    ASSERT_OK(view->close());
  }
  std::cout << "[global view power loss] 20 cuts, " << acked << " acknowledged applies, " << dropped_bytes
            << " unsynced bytes dropped\n";
}

// The N-th file operation of an apply fails (once, or from then on), for
// N = 1, 2, ... until the apply no longer reaches it. After each, a reopened
// view holds the batch whole or not at all, its applied seq says which, and
// delivering the batch again completes it exactly once.
// A fault sweep of one apply: on a copy of the view at `base`, the n-th
// file operation fails (once, then from then on) while `b` is applied, for
// every n until one is no longer reached. After each, `check` gets the view
// reopened on the normal Env and what the apply returned (an error must
// not be Corruption), and says whether the batch is stored. Returns
// the failed applies and, of them, those stored after all.
std::pair<int, int> sweep_apply(const TempDir& dir, const std::string& base, const ChangeBatch& b,
                                const std::function<bool(GlobalView&, const Status&)>& check) {
  int failed_applies = 0, stored_anyway = 0;
  for (bool persistent : {false, true}) {
    for (std::uint64_t n = 1;; ++n) {
      SCOPED_TRACE("operation " + std::to_string(n) + (persistent ? " and every later one" : " once"));
      EXPECT_LT(n, 200u) << "the sweep does not end";
      if (n >= 200u) return {failed_applies, stored_anyway};
      const std::string work = dir.sub("work");
      fs::remove_all(work);
      fs::copy(base, work, fs::copy_options::recursive);
      bool reached = false;
      Result<bool> r = false;
      {
        reliability::FaultEnv fault = reliability::FaultEnv::make();
        auto view = open_view_on(work, fault.env.get());
        if (view == nullptr) return {failed_applies, stored_anyway};
        const std::uint64_t injected = fault.fs->faults_injected();
        fault.fs->fail_nth_op(n, persistent);
        r = view->apply(b);
        reached = fault.fs->faults_injected() > injected;
        fault.fs->clear_faults();
        view.reset();
      }
      if (!r.ok()) {
        ++failed_applies;
        EXPECT_NE(r.status().code(), StatusCode::Corruption) << r.status().to_string();
      }
      auto view = open_view(work);
      if (view == nullptr) return {failed_applies, stored_anyway};
      const bool stored = check(*view, r.status());
      if (!r.ok() && stored) ++stored_anyway;
      EXPECT_OK(view->close());
      if (!reached) break;
    }
  }
  EXPECT_GT(failed_applies, 0) << "no fault reached the apply: the sweep tested nothing";
  return {failed_applies, stored_anyway};
}

// Issue 41 (the Follower's re-seed apply): the view's write of a re-seed's
// first batch fails at any file operation (once, or from then on). After a
// reopen the view holds the shard's old contribution or the new one whole,
// with the applied record to match, never a mix; applying the batch again
// ends with the new one, and a late batch of the replaced incarnation is
// skipped.
TEST(GlobalViewFaultSweep, AReseedApplyIsAllOrNothingWhateverFileOperationFails) {
  TempDir dir;
  const std::string base = dir.sub("base");
  const std::string old_inc(32, 'a'), new_inc(32, 'b'), other_inc(32, 'c');
  {
    auto view = open_view(base);
    ASSERT_NE(view, nullptr);
    ASSERT_TRUE(applied(*view, {1, 1, payload_of({cohort(1, 1, weight(1.0)), community(5, 6, weight(2.0))}), old_inc}));
    ASSERT_TRUE(applied(*view, {2, 1, payload_of({cohort(1, 1, weight(0.5))}), other_inc}));
    ASSERT_OK(view->close());
  }
  const ChangeBatch reseed{1, 7, payload_of({cohort(1, 1, weight(4.0)), cohort(2, 2, weight(8.0))}, FeedOrigin::Reseed),
                           new_inc};
  const ChangeBatch late{1, 2, payload_of({cohort(1, 1, weight(100.0))}), old_inc};
  const auto [failed, stored_anyway] = sweep_apply(dir, base, reseed, [&](GlobalView& view, const Status& r) {
    const std::uint64_t seq = seq_of(view, 1);
    EXPECT_TRUE(seq == 1 || seq == 7) << seq;
    if (r.ok()) {
      EXPECT_EQ(seq, 7u);
    }
    // Whole or not at all, as its applied record says.
    const bool replaced = seq == 7;
    EXPECT_EQ(value_of(view.cohort_score(1, 1)), replaced ? 4.5 : 1.5);
    EXPECT_EQ(value_of(view.community_score(5, 6)), replaced ? 0.0 : 2.0);
    EXPECT_EQ(value_of(view.cohort_score(2, 2)), replaced ? 8.0 : 0.0);
    EXPECT_EQ(applied(view, reseed), !replaced);
    EXPECT_FALSE(applied(view, late));  // the replaced incarnation's, late: skipped
    EXPECT_EQ(value_of(view.cohort_score(1, 1)), 4.5);
    EXPECT_EQ(value_of(view.community_score(5, 6)), 0.0);
    EXPECT_EQ(value_of(view.cohort_score(2, 2)), 8.0);
    EXPECT_EQ(seq_of(view, 1), 7u);
    return replaced;
  });
  std::cout << "[global view re-seed fault sweep] " << failed << " failed applies, " << stored_anyway
            << " of them stored after all\n";
}

TEST(GlobalViewFaultSweep, AnApplyIsAllOrNothingWhateverFileOperationFails) {
  TempDir dir;
  const std::string base = dir.sub("base");
  {
    auto view = open_view(base);
    ASSERT_NE(view, nullptr);
    ASSERT_TRUE(applied(*view, batch(1, 1, {cohort(1, 1, weight(1.0))})));
    ASSERT_OK(view->close());
  }
  const ChangeBatch next = batch(1, 2, {cohort(1, 1, weight(2.0)), community(5, 6, weight(-3.0))});
  const auto [failed, stored_anyway] = sweep_apply(dir, base, next, [&](GlobalView& view, const Status& r) {
    const std::uint64_t seq = seq_of(view, 1);
    EXPECT_TRUE(seq == 1 || seq == 2) << seq;
    if (r.ok()) {
      EXPECT_EQ(seq, 2u);
    } else {
      expect_has(r, "may or may not be stored");
    }
    // Whole or not at all, as its applied seq says.
    EXPECT_EQ(value_of(view.cohort_score(1, 1)), seq == 2 ? 3.0 : 1.0);
    EXPECT_EQ(value_of(view.community_score(5, 6)), seq == 2 ? -3.0 : 0.0);
    EXPECT_EQ(applied(view, next), seq == 1);
    EXPECT_EQ(value_of(view.cohort_score(1, 1)), 3.0);
    EXPECT_EQ(value_of(view.community_score(5, 6)), -3.0);
    return seq == 2;
  });
  std::cout << "[global view fault sweep] " << failed << " failed applies, " << stored_anyway
            << " of them stored after all\n";
}

// ---- checkpoint ----

TEST(GlobalView, ACheckpointOpensAsAViewThatContinuesIndependently) {
  TempDir dir;
  auto original = open_view(dir.sub("original"));
  ASSERT_NE(original, nullptr);
  ASSERT_TRUE(applied(*original, batch(1, 1, {cohort(1, 1, weight(1.0))})));
  ASSERT_TRUE(applied(*original, batch(1, 2, {cohort(1, 1, weight(2.0))})));
  ASSERT_TRUE(applied(*original, batch(2, 1, {community(3, 1, weight(0.25))})));
  ASSERT_OK(original->checkpoint(dir.sub("copy")));

  auto copy = open_view(dir.sub("copy"));
  ASSERT_NE(copy, nullptr);
  EXPECT_EQ(shards_of(*copy), (std::vector<std::pair<std::uint64_t, std::uint64_t>>{{1, 2}, {2, 1}}));
  EXPECT_EQ(value_of(copy->cohort_score(1, 1)), 3.0);
  EXPECT_EQ(value_of(copy->community_score(3, 1)), 0.25);
  // The copy continues from its copied seqs: old batches are skipped, a gap refused.
  EXPECT_FALSE(applied(*copy, batch(1, 2, {cohort(1, 1, weight(2.0))})));
  EXPECT_EQ(copy->apply(batch(1, 4, {cohort(1, 1, weight(8.0))})).status().code(), StatusCode::Corruption);
  EXPECT_TRUE(applied(*copy, batch(1, 3, {cohort(1, 1, weight(4.0))})));
  EXPECT_EQ(value_of(copy->cohort_score(1, 1)), 7.0);
  // Independent: neither sees the other's applies.
  EXPECT_EQ(seq_of(*original, 1), 2u);
  EXPECT_EQ(value_of(original->cohort_score(1, 1)), 3.0);
  EXPECT_TRUE(applied(*original, batch(2, 2, {community(3, 1, weight(0.5))})));
  EXPECT_EQ(value_of(original->community_score(3, 1)), 0.75);
  EXPECT_EQ(value_of(copy->community_score(3, 1)), 0.25);
  EXPECT_EQ(seq_of(*copy, 2), 1u);
  // Both reopen as they were left.
  ASSERT_OK(copy->close());
  ASSERT_OK(original->close());
  copy = open_view(dir.sub("copy"));
  ASSERT_NE(copy, nullptr);
  EXPECT_EQ(shards_of(*copy), (std::vector<std::pair<std::uint64_t, std::uint64_t>>{{1, 3}, {2, 1}}));
  original = open_view(dir.sub("original"));
  ASSERT_NE(original, nullptr);
  EXPECT_EQ(shards_of(*original), (std::vector<std::pair<std::uint64_t, std::uint64_t>>{{1, 2}, {2, 2}}));
}

TEST(GlobalView, ACheckpointNeedsANewDirectory) {
  TempDir dir;
  auto view = open_view(dir.sub("view"));
  ASSERT_NE(view, nullptr);
  ASSERT_TRUE(applied(*view, batch(1, 1, {cohort(1, 1, weight(1.0))})));
  fs::create_directory(dir.sub("existing"));
  { std::ofstream(dir.sub("existing/keep")) << "precious"; }
  { std::ofstream(dir.sub("a-file")) << "precious"; }
  for (const std::string& target : {dir.sub("existing"), dir.sub("a-file"), dir.sub("view")}) {
    Status s = view->checkpoint(target);
    ASSERT_FALSE(s.ok()) << target;
    EXPECT_EQ(s.code(), StatusCode::InvalidArgument);
    expect_has(s, "'" + target + "' already exists");
  }
  Status s = view->checkpoint("");
  EXPECT_EQ(s.code(), StatusCode::InvalidArgument) << s.to_string();
  s = view->checkpoint(dir.sub("no-such-parent/copy"));
  EXPECT_FALSE(s.ok());
  expect_has(s, dir.sub("no-such-parent/copy"));
  std::string content;
  std::getline(std::ifstream(dir.sub("existing/keep")), content);
  EXPECT_EQ(content, "precious");
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 1.0);
}

// ---- reads report errors ----

TEST(GlobalView, MalformedStoredValuesAreCorruptionNamingTheKeyNeverZero) {
  TempDir dir;
  {
    auto view = open_view(dir.path());
    ASSERT_NE(view, nullptr);
    ASSERT_TRUE(applied(*view, batch(1, 1, {cohort(1, 2, weight(1.0)), cohort(4, 4, weight(1.0))})));
    ASSERT_OK(view->close());
  }
  {
    RawView raw(dir.path());
    ASSERT_TRUE(raw.db);
    rocksdb::WriteOptions wo;
    ASSERT_TRUE(raw.db->Put(wo, raw.aggregates(), encode_aggregate_key(AggregateKind::Cohort, 1, 1), "abc").ok());
    ASSERT_TRUE(raw.db->Merge(wo, raw.aggregates(), encode_aggregate_key(AggregateKind::Cohort, 1, 2), "abc").ok());
    ASSERT_TRUE(raw.db->Put(wo, raw.meta(), encode_applied_key(9), "abc").ok());
  }
  auto view = open_view(dir.path());
  ASSERT_NE(view, nullptr);
  // A 3-byte value; a 3-byte merge operand on a good value.
  for (std::uint64_t item : {1u, 2u}) {
    Result<double> r = view->cohort_score(1, item);
    ASSERT_FALSE(r.ok()) << "item " << item << " read " << *r;
    EXPECT_EQ(r.status().code(), StatusCode::Corruption) << r.status().to_string();
    expect_has(r.status(), hex(encode_aggregate_key(AggregateKind::Cohort, 1, item)));
  }
  EXPECT_EQ(value_of(view->cohort_score(4, 4)), 1.0);  // other cells read on
  Result<std::uint64_t> seq = view->applied_seq(9);
  ASSERT_FALSE(seq.ok());
  EXPECT_EQ(seq.status().code(), StatusCode::Corruption);
  expect_has(seq.status(), hex(encode_applied_key(9)));
  Result<std::vector<ShardProgress>> shards = view->applied_shards();
  ASSERT_FALSE(shards.ok());
  EXPECT_EQ(shards.status().code(), StatusCode::Corruption);
  expect_has(shards.status(), hex(encode_applied_key(9)));
  // A shard whose applied seq does not read takes no batch.
  Result<bool> r = view->apply(batch(9, 1, {cohort(4, 4, weight(1.0))}));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::Corruption);
  EXPECT_EQ(value_of(view->cohort_score(4, 4)), 1.0);
}

// ---- what open accepts ----

TEST(GlobalViewFormat, AViewOfAnotherFormatOrWithoutItsMarkIsRefused) {
  TempDir dir;
  {
    auto view = open_view(dir.sub("v2"));
    ASSERT_NE(view, nullptr);
    ASSERT_OK(view->close());
    RawView raw(dir.sub("v2"));
    ASSERT_TRUE(raw.db->Put(rocksdb::WriteOptions(), raw.meta(), kViewFormatKey, "4").ok());
  }
  Result<std::unique_ptr<GlobalView>> v = GlobalView::open(dir.sub("v2"));
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), StatusCode::InvalidArgument);
  expect_has(v.status(), "view_format is '4'");
  expect_has(v.status(), dir.sub("v2"));

  // The view's column families and records, but no mark: not written by tidal.
  {
    RawView raw(dir.sub("unmarked"));
    ASSERT_TRUE(raw.db->Put(rocksdb::WriteOptions(), raw.meta(), encode_applied_key(1), encode_applied({1, "", ""})).ok());
  }
  v = GlobalView::open(dir.sub("unmarked"));
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.status().code(), StatusCode::InvalidArgument);
  expect_has(v.status(), "no view_format mark");

  // Nothing stored and no mark: a creation cut short; it opens as a new view.
  { RawView raw(dir.sub("cut-short")); }
  auto view = open_view(dir.sub("cut-short"));
  ASSERT_NE(view, nullptr);
  EXPECT_TRUE(applied(*view, batch(1, 1, {cohort(1, 1, weight(1.0))})));
  ASSERT_OK(view->close());
  RawView raw(dir.sub("cut-short"));
  std::string mark;
  ASSERT_TRUE(raw.db->Get(rocksdb::ReadOptions(), raw.meta(), kViewFormatKey, &mark).ok());
  EXPECT_EQ(mark, "3");
}

// Issue 27: a view stores the incarnation of each shard's feed beside its
// applied seq and refuses a batch of another incarnation, at any seq (one
// at an applied seq would otherwise be skipped as a redelivery).
TEST(GlobalView, ABatchOfAnotherIncarnationIsCorruptionNamingShardIncarnationsAndSeqs) {
  TempDir dir;
  const std::string a(32, 'a'), b = "0123456789abcdef0123456789abcdef";
  auto with = [](ChangeBatch x, const std::string& inc) {
    x.incarnation = inc;
    return x;
  };
  {
    auto view = open_view(dir.path());
    ASSERT_NE(view, nullptr);
    ASSERT_TRUE(applied(*view, with(batch(3, 1, {cohort(1, 1, weight(1.0))}), a)));
    ASSERT_TRUE(applied(*view, with(batch(3, 2, {cohort(1, 1, weight(2.0))}), a)));
    ASSERT_TRUE(applied(*view, batch(4, 1, {cohort(1, 1, weight(4.0))})));  // no incarnation: not checked
    ASSERT_OK(view->close());
  }
  auto view = open_view(dir.path());  // stored with the seq
  ASSERT_NE(view, nullptr);
  for (std::uint64_t seq : {1u, 2u, 3u}) {
    Result<bool> r = view->apply(with(batch(3, seq, {cohort(1, 1, weight(8.0))}), b));
    ASSERT_FALSE(r.ok()) << "seq " << seq;
    EXPECT_EQ(r.status().code(), StatusCode::Corruption);
    for (const std::string& word : {std::string("shard 3"), a, b, std::string("through seq 2"),
                                    "batch seq " + std::to_string(seq)}) {
      expect_has(r.status(), word);
    }
  }
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 7.0);
  EXPECT_EQ(*view->applied_seq(3), 2u);
  // In a run: the batches before it applied, it and those after it not.
  std::vector<ChangeBatch> run = {with(batch(3, 3, {cohort(1, 1, weight(16.0))}), a),
                                  with(batch(3, 4, {cohort(1, 1, weight(32.0))}), b),
                                  with(batch(3, 4, {cohort(1, 1, weight(64.0))}), a)};
  Result<ApplyOutcome> out = view->apply(std::span<const ChangeBatch>(run));
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->taken, 1u);
  EXPECT_EQ(out->refused.code(), StatusCode::Corruption);
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 23.0);
  // A batch without an incarnation is taken; a shard first applied without
  // one keeps the first incarnation it sees.
  EXPECT_TRUE(applied(*view, batch(3, 4, {cohort(1, 1, weight(1.0))})));
  EXPECT_TRUE(applied(*view, with(batch(4, 2, {cohort(1, 1, weight(1.0))}), b)));
  EXPECT_FALSE(view->apply(with(batch(4, 3, {cohort(1, 1, weight(1.0))}), a)).ok());
  auto shards = view->applied_shards();
  ASSERT_TRUE(shards.ok());
  ASSERT_EQ(shards->size(), 2u);
  EXPECT_EQ((*shards)[0].incarnation, a);
  EXPECT_EQ((*shards)[1].incarnation, b);
  // Not 32 lowercase hex digits: refused.
  EXPECT_EQ(view->apply(with(batch(5, 1, {cohort(1, 1, weight(1.0))}), "xyz")).status().code(),
            StatusCode::Corruption);
}

// Issue 64 item 6 (V10): a shard's incarnations are ordered by
// ChangeBatch::incarnation_ordinal. Every batch of an incarnation older than
// one the view applied for the shard is skipped and counted as superseded,
// also one the view never saw and a re-seed's first batch; a newer one's
// re-seed replaces the shard and its other batches are refused until then;
// a re-seed without an ordinal, which cannot be ordered, is refused. The
// highest ordinal survives a reopen.
TEST(GlobalView, EveryBatchOfAnIncarnationOlderThanOneAppliedIsSkippedAsSuperseded) {
  TempDir dir;
  auto of = [](ChangeBatch x, char inc, std::uint64_t ordinal) {
    x.incarnation = std::string(32, inc);
    x.incarnation_ordinal = ordinal;
    return x;
  };
  auto ordinal_of = [](const GlobalView& view, std::uint64_t shard) -> std::uint64_t {
    Result<std::vector<ShardProgress>> shards = view.applied_shards();
    EXPECT_TRUE(shards.ok());
    for (const ShardProgress& p : shards.ok() ? *shards : std::vector<ShardProgress>{}) {
      if (p.shard_id == shard) return p.incarnation_ordinal;
    }
    return ~std::uint64_t{0};
  };
  const ChangeBatch a3 = of(batch(7, 3, {cohort(1, 1, weight(100.0))}), 'a', 100);
  const ChangeBatch c_reseed = of(batch(7, 5, {cohort(1, 1, weight(1000.0))}, FeedOrigin::Reseed), 'c', 200);
  const ChangeBatch c6 = of(batch(7, 6, {cohort(1, 1, weight(10000.0))}), 'c', 200);
  const ChangeBatch d40 = of(batch(7, 40, {cohort(1, 1, weight(5.0))}), 'd', 250);
  auto view = open_view(dir.path());
  ASSERT_NE(view, nullptr);
  ASSERT_TRUE(applied(*view, of(batch(7, 1, {cohort(1, 1, weight(1.0))}), 'a', 100)));
  ASSERT_TRUE(applied(*view, of(batch(7, 2, {cohort(1, 1, weight(2.0))}), 'a', 100)));
  EXPECT_EQ(ordinal_of(*view, 7), 100u);
  // B (ordinal 300) re-seeds; C (200) was made between A and B, never seen.
  ASSERT_TRUE(applied(*view, of(batch(7, 10, {cohort(1, 1, weight(4.0))}, FeedOrigin::Reseed), 'b', 300)));
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 4.0);
  EXPECT_EQ(ordinal_of(*view, 7), 300u);
  for (int round = 0; round < 2; ++round) {
    for (const ChangeBatch* late : {&c_reseed, &c6, &a3, &d40}) {
      Result<ApplyOutcome> out = view->apply(std::span<const ChangeBatch>(late, 1));
      ASSERT_OK(out);
      EXPECT_OK(out->refused);
      EXPECT_EQ(out->taken, 1u) << "incarnation " << late->incarnation << " seq " << late->seq;
      EXPECT_EQ(out->applied, 0u) << "incarnation " << late->incarnation << " seq " << late->seq;
      EXPECT_EQ(out->superseded, 1u) << "incarnation " << late->incarnation << " seq " << late->seq;
    }
    EXPECT_EQ(value_of(view->cohort_score(1, 1)), 4.0);
    EXPECT_EQ(seq_of(*view, 7), 10u);
    ASSERT_OK(view->close());
    view = open_view(dir.path());  // the ordinal is stored
    ASSERT_NE(view, nullptr);
    EXPECT_EQ(ordinal_of(*view, 7), 300u);
  }
  // In a run: the older ones skipped, B's next applied, a redelivery of it skipped.
  const ChangeBatch b11 = of(batch(7, 11, {cohort(1, 1, weight(8.0))}), 'b', 300);
  std::vector<ChangeBatch> run = {c_reseed, b11, a3, b11, c6};
  Result<ApplyOutcome> out = view->apply(std::span<const ChangeBatch>(run));
  ASSERT_OK(out);
  EXPECT_OK(out->refused);
  EXPECT_EQ(out->taken, 5u);
  EXPECT_EQ(out->applied, 1u);
  EXPECT_EQ(out->superseded, 3u);
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 12.0);
  // A newer incarnation's batch other than its re-seed: refused until the re-seed.
  Result<bool> twin = view->apply(of(batch(7, 12, {cohort(1, 1, weight(1.0))}), 'e', 400));
  EXPECT_EQ(twin.status().code(), StatusCode::Corruption);
  ASSERT_TRUE(applied(*view, of(batch(7, 20, {cohort(1, 1, weight(16.0))}, FeedOrigin::Reseed), 'e', 400)));
  EXPECT_EQ(ordinal_of(*view, 7), 400u);
  EXPECT_FALSE(applied(*view, of(batch(7, 12, {cohort(1, 1, weight(1.0))}), 'b', 300)));
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 16.0);

  // Shard 8, fed by writers without ordinals: as before (a re-seed of
  // another incarnation replaces the shard; a replaced one is skipped) until
  // an ordered incarnation arrives.
  ASSERT_TRUE(applied(*view, of(batch(8, 1, {cohort(2, 1, weight(1.0))}), '1', 0)));
  ASSERT_TRUE(applied(*view, of(batch(8, 4, {cohort(2, 1, weight(2.0))}, FeedOrigin::Reseed), '2', 0)));
  EXPECT_FALSE(applied(*view, of(batch(8, 2, {cohort(2, 1, weight(4.0))}), '1', 0)));
  EXPECT_EQ(ordinal_of(*view, 8), 0u);
  ASSERT_TRUE(applied(*view, of(batch(8, 9, {cohort(2, 1, weight(8.0))}, FeedOrigin::Reseed), '3', 50)));
  // A re-seed without an ordinal now cannot be ordered: refused, naming it.
  Result<bool> unordered = view->apply(of(batch(8, 3, {cohort(2, 1, weight(16.0))}, FeedOrigin::Reseed), '9', 0));
  ASSERT_FALSE(unordered.ok());
  EXPECT_EQ(unordered.status().code(), StatusCode::Corruption);
  for (const std::string& word : {std::string("shard 8"), std::string(32, '9'), std::string(32, '3'),
                                  std::string("ordinal 50"), std::string("no ordinal")}) {
    expect_has(unordered.status(), word);
  }
  EXPECT_FALSE(applied(*view, of(batch(8, 5, {cohort(2, 1, weight(16.0))}), '2', 0)));
  EXPECT_EQ(value_of(view->cohort_score(2, 1)), 8.0);
  EXPECT_EQ(ordinal_of(*view, 8), 50u);

  // Shard 9: a feed made before ordinals gets one for its incarnation; the
  // same incarnation's batches apply with or without it.
  ASSERT_TRUE(applied(*view, of(batch(9, 1, {cohort(3, 1, weight(1.0))}), '4', 0)));
  ASSERT_TRUE(applied(*view, of(batch(9, 2, {cohort(3, 1, weight(2.0))}), '4', 70)));
  ASSERT_TRUE(applied(*view, of(batch(9, 3, {cohort(3, 1, weight(4.0))}), '4', 0)));
  EXPECT_EQ(ordinal_of(*view, 9), 70u);
  EXPECT_EQ(value_of(view->cohort_score(3, 1)), 7.0);
}

TEST(GlobalViewFormat, AViewOfFormatOneOpensAndIsMarkedTwo) {
  TempDir dir;
  {
    auto view = open_view(dir.path());
    ASSERT_NE(view, nullptr);
    ASSERT_TRUE(applied(*view, batch(1, 1, {cohort(1, 1, weight(1.0))})));
    ASSERT_OK(view->close());
    RawView raw(dir.path());
    ASSERT_TRUE(raw.db->Put(rocksdb::WriteOptions(), raw.meta(), kViewFormatKey, "1").ok());
  }
  {
    auto view = open_view(dir.path());
    ASSERT_NE(view, nullptr);
    EXPECT_EQ(*view->applied_seq(1), 1u);
    ASSERT_OK(view->close());
  }
  RawView raw(dir.path());
  std::string mark;
  ASSERT_TRUE(raw.db->Get(rocksdb::ReadOptions(), raw.meta(), kViewFormatKey, &mark).ok());
  EXPECT_EQ(mark, "2");
}

// The converse: a writable Db::open on a view's directory would add tidal's
// column families to it. It is refused, and the view still opens and reads.
TEST(GlobalViewErrors, ADbOpenOnAViewDirectoryIsRefusedAndTheViewLeftUntouched) {
  TempDir dir;
  const std::string path = dir.sub("view");
  {
    auto view = open_view(path);
    ASSERT_NE(view, nullptr);
    ASSERT_OK(view->apply(batch(1, 1, {cohort(3, 4, weight(2.5))})));
    ASSERT_OK(view->close());
  }
  const auto before = listing(path);
  Options options;
  options.create_if_missing = true;
  Result<std::unique_ptr<Db>> db = Db::open(path, options);
  ASSERT_FALSE(db.ok());
  EXPECT_EQ(db.status().code(), StatusCode::InvalidArgument);
  expect_has(db.status(), "holds another RocksDB database, not a tidal Db");
  EXPECT_EQ(listing(path), before);
  auto view = open_view(path);
  ASSERT_NE(view, nullptr);
  EXPECT_EQ(testing::value_of(view->cohort_score(3, 4)), 2.5);
}

TEST(GlobalViewErrors, ADbDirectoryIsInvalidArgumentAndLeftUntouched) {
  TempDir dir;
  const std::string path = dir.sub("db");
  {
    auto db = testing::open_db(path);
    ASSERT_NE(db, nullptr);
    ASSERT_OK(db->leave_community_layer(4));
    ASSERT_OK(db->close());
  }
  const auto before = listing(path);
  for (bool read_only : {false, true}) {
    GlobalViewOptions options;
    options.read_only = read_only;
    Result<std::unique_ptr<GlobalView>> view = GlobalView::open(path, options);
    ASSERT_FALSE(view.ok());
    EXPECT_EQ(view.status().code(), StatusCode::InvalidArgument);
    expect_has(view.status(), path);
    expect_has(view.status(), "holds a tidal Db");
  }
  EXPECT_EQ(listing(path), before);
  auto db = testing::open_db(path);
  ASSERT_NE(db, nullptr);
  Result<CommunityMembership> m = db->community_layer_status(4);
  ASSERT_OK(m);
  EXPECT_EQ(m->status, MembershipStatus::Left);

  // Any other RocksDB database is not a view either.
  {
    rocksdb::Options options;
    options.create_if_missing = true;
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(options, dir.sub("other"), &raw).ok());
    ASSERT_TRUE(raw->Put(rocksdb::WriteOptions(), "k", "v").ok());
    delete raw;
  }
  Result<std::unique_ptr<GlobalView>> view = GlobalView::open(dir.sub("other"));
  ASSERT_FALSE(view.ok());
  EXPECT_EQ(view.status().code(), StatusCode::InvalidArgument);
  expect_has(view.status(), "not a tidal global view");
}

TEST(GlobalViewErrors, PathThatIsARegularFile) {
  TempDir dir;
  const std::string file = dir.sub("plain-file");
  { std::ofstream(file) << "precious"; }
  Result<std::unique_ptr<GlobalView>> view = GlobalView::open(file);
  ASSERT_FALSE(view.ok());
  EXPECT_EQ(view.status().code(), StatusCode::InvalidArgument);
  expect_has(view.status(), file);
  expect_has(view.status(), "regular file");
  std::string content;
  std::getline(std::ifstream(file), content);
  EXPECT_EQ(content, "precious");
}

TEST(GlobalViewErrors, MissingDirectoryIsNotFoundUnlessCreated) {
  TempDir dir;
  GlobalViewOptions no_create;
  no_create.create_if_missing = false;
  GlobalViewOptions read_only;
  read_only.read_only = true;
  for (const GlobalViewOptions& options : {no_create, read_only}) {
    Result<std::unique_ptr<GlobalView>> view = GlobalView::open(dir.sub("absent"), options);
    ASSERT_FALSE(view.ok());
    EXPECT_EQ(view.status().code(), StatusCode::NotFound);
    expect_has(view.status(), dir.sub("absent"));
    EXPECT_FALSE(fs::exists(dir.sub("absent")));
    view = GlobalView::open(dir.path(), options);  // exists, empty
    ASSERT_FALSE(view.ok());
    EXPECT_EQ(view.status().code(), StatusCode::NotFound);
    expect_has(view.status(), "no CURRENT file");
    EXPECT_TRUE(fs::is_empty(dir.path()));
  }
}

TEST(GlobalViewErrors, ASecondHandleInThisProcessIsBusyThroughAnySpelling) {
  TempDir dir;
  const std::string path = dir.sub("view");
  auto view = open_view(path);
  ASSERT_NE(view, nullptr);
  ASSERT_TRUE(applied(*view, batch(1, 1, {cohort(1, 1, weight(1.0))})));
  fs::create_directory_symlink(path, dir.sub("alias"));
  const auto before = listing(path);
  for (const std::string& spelling : {path, dir.sub("alias"), path + "/", path + "/.", dir.sub("./view")}) {
    Result<std::unique_ptr<GlobalView>> second = GlobalView::open(spelling);
    ASSERT_FALSE(second.ok()) << spelling;
    EXPECT_EQ(second.status().code(), StatusCode::Busy) << second.status().to_string();
    expect_has(second.status(), spelling);
    expect_has(second.status(), "already open");
  }
  EXPECT_EQ(listing(path), before);
  EXPECT_TRUE(applied(*view, batch(1, 2, {cohort(1, 1, weight(1.0))})));  // the holder is untouched
  ASSERT_OK(view->close());
  auto again = open_view(dir.sub("alias"));  // free once closed
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(value_of(again->cohort_score(1, 1)), 2.0);
}

TEST(GlobalViewErrors, AViewHeldByAnotherProcessIsBusyNamingItsPid) {
  TempDir dir;
  const std::string path = dir.sub("view");
  ASSERT_OK(open_view(path)->close());
  // The child holds the directory's LOCK as RocksDB does (an fcntl write
  // lock); it makes only system calls after fork.
  int ready[2], release[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(release), 0);
  const std::string lock_file = path + "/LOCK";
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const int fd = ::open(lock_file.c_str(), O_RDWR);
    struct flock lock {};
    lock.l_type = F_WRLCK;
    lock.l_whence = SEEK_SET;
    const char ok = fd >= 0 && ::fcntl(fd, F_SETLK, &lock) == 0 ? 'y' : 'n';
    (void)!::write(ready[1], &ok, 1);
    char c;
    (void)!::read(release[0], &c, 1);
    ::_exit(0);
  }
  char ok = 0;
  ASSERT_EQ(::read(ready[0], &ok, 1), 1);
  EXPECT_EQ(ok, 'y');
  const auto before = listing(path);
  Result<std::unique_ptr<GlobalView>> view = GlobalView::open(path);
  // The read-only open reads while the directory is held.
  GlobalViewOptions read_only;
  read_only.read_only = true;
  Result<std::unique_ptr<GlobalView>> reader = GlobalView::open(path, read_only);
  (void)!::write(release[1], "x", 1);
  int status = 0;
  ::waitpid(child, &status, 0);
  for (int fd : {ready[0], ready[1], release[0], release[1]}) ::close(fd);
  ASSERT_FALSE(view.ok());
  EXPECT_EQ(view.status().code(), StatusCode::Busy);
  expect_has(view.status(), path);
  expect_has(view.status(), "pid " + std::to_string(child));
  EXPECT_EQ(listing(path), before);  // not even an info LOG was started
  EXPECT_TRUE(reader.ok()) << reader.status().to_string();
}

TEST(GlobalViewErrors, DirectoryWithoutWritePermission) {
  TempDir dir;
  const std::string path = dir.sub("view");
  {
    auto view = open_view(path);
    ASSERT_NE(view, nullptr);
    ASSERT_TRUE(applied(*view, batch(1, 1, {cohort(1, 1, weight(1.0))})));
    ASSERT_OK(view->close());
  }
  const auto before = listing(path);
  ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
  ASSERT_EQ(::chmod(path.c_str(), 0555), 0);
  if (::geteuid() == 0) {
    // Root writes anywhere: an unprivileged child process tries.
    auto [rc, out] = run_child("open-as-nobody", path);
    EXPECT_EQ(rc, 1) << out;
    EXPECT_NE(out.find("open: IOError"), std::string::npos) << out;
    EXPECT_NE(out.find(path), std::string::npos) << out;
    EXPECT_NE(out.find("not writable"), std::string::npos) << out;
  } else {
    Result<std::unique_ptr<GlobalView>> view = GlobalView::open(path);
    ASSERT_FALSE(view.ok());
    EXPECT_EQ(view.status().code(), StatusCode::IOError);
    expect_has(view.status(), path);
    expect_has(view.status(), "not writable");
  }
  EXPECT_EQ(listing(path), before);
  ASSERT_EQ(::chmod(path.c_str(), 0755), 0);
  auto view = open_view(path);
  ASSERT_NE(view, nullptr);
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), 1.0);
}

// ---- lifecycle and read-only ----

TEST(GlobalViewLifecycle, EveryCallAfterCloseReturnsClosed) {
  TempDir dir;
  auto view = open_view(dir.sub("view"));
  ASSERT_NE(view, nullptr);
  ASSERT_TRUE(applied(*view, batch(1, 1, {cohort(1, 1, weight(1.0))})));
  ASSERT_OK(view->close());
  ASSERT_OK(view->close());  // idempotent
  EXPECT_EQ(view->apply(batch(1, 2, {cohort(1, 1, weight(1.0))})).status().code(), StatusCode::Closed);
  EXPECT_EQ(view->applied_seq(1).status().code(), StatusCode::Closed);
  EXPECT_EQ(view->applied_shards().status().code(), StatusCode::Closed);
  EXPECT_EQ(view->cohort_score(1, 1).status().code(), StatusCode::Closed);
  EXPECT_EQ(view->community_score(1, 1).status().code(), StatusCode::Closed);
  EXPECT_EQ(view->checkpoint(dir.sub("copy")).code(), StatusCode::Closed);
  EXPECT_FALSE(fs::exists(dir.sub("copy")));
  view.reset();
  auto again = open_view(dir.sub("view"));  // the closed handle let go of the directory
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(seq_of(*again, 1), 1u);
}

TEST(GlobalViewReadOnly, ReadsWhileHeldAndRefusesWrites) {
  TempDir dir;
  const std::string path = dir.sub("view");
  auto writer = open_view(path);
  ASSERT_NE(writer, nullptr);
  ASSERT_TRUE(applied(*writer, batch(1, 1, {cohort(1, 1, weight(1.0))})));
  ASSERT_TRUE(applied(*writer, batch(2, 1, {community(2, 2, weight(-2.0))})));
  const auto before = listing(path);
  GlobalViewOptions read_only;
  read_only.read_only = true;
  auto reader = open_view(path, read_only);
  ASSERT_NE(reader, nullptr);
  EXPECT_EQ(shards_of(*reader), (std::vector<std::pair<std::uint64_t, std::uint64_t>>{{1, 1}, {2, 1}}));
  EXPECT_EQ(value_of(reader->cohort_score(1, 1)), 1.0);
  EXPECT_EQ(value_of(reader->community_score(2, 2)), -2.0);
  Result<bool> r = reader->apply(batch(1, 2, {cohort(1, 1, weight(1.0))}));
  EXPECT_EQ(r.status().code(), StatusCode::InvalidArgument);
  expect_has(r.status(), "read-only");
  EXPECT_EQ(reader->checkpoint(dir.sub("copy")).code(), StatusCode::InvalidArgument);
  ASSERT_OK(reader->close());
  EXPECT_EQ(listing(path), before);  // the read-only handle wrote nothing
  EXPECT_TRUE(applied(*writer, batch(1, 2, {cohort(1, 1, weight(1.0))})));
  EXPECT_EQ(value_of(writer->cohort_score(1, 1)), 2.0);
}

// ---- concurrency (run under TSan in CI) ----

// Batch k of shard 1 adds k to cell A and -k to cell B. A reader reads the
// applied seq, A, B and the applied seq again, one after the other: with
// whole batches (the deltas and the seq in one atomic write) A holds the
// first n_a batches and B the first n_b, with seq1 <= n_a <= n_b <= seq2.
TEST(GlobalViewConcurrentTest, ReadsWhileOneThreadApplies) {
  TempDir dir;
  auto view = open_view(dir.path());
  ASSERT_NE(view, nullptr);
  constexpr std::uint64_t kBatches = 200;
  // The number of batches whose sum 1 + 2 + ... + n is `score`; -1 if none.
  auto batches_in = [](double score) -> std::int64_t {
    const auto total = static_cast<std::uint64_t>(std::llround(score));
    if (static_cast<double>(total) != score) return -1;
    const auto n = static_cast<std::uint64_t>((std::sqrt(8.0 * static_cast<double>(total) + 1) - 1) / 2 + 0.5);
    return n * (n + 1) / 2 == total ? static_cast<std::int64_t>(n) : -1;
  };
  std::atomic<bool> done{false};
  std::atomic<std::uint64_t> reads{0}, torn{0}, errors{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 3; ++t) {
    readers.emplace_back([&] {
      while (!done.load(std::memory_order_acquire)) {
        Result<std::uint64_t> s1 = view->applied_seq(1);
        Result<double> a = view->cohort_score(1, 1);
        Result<double> b = view->cohort_score(1, 2);
        Result<std::uint64_t> s2 = view->applied_seq(1);
        if (!s1.ok() || !a.ok() || !b.ok() || !s2.ok()) {
          errors.fetch_add(1);
          continue;
        }
        const std::int64_t na = batches_in(*a), nb = batches_in(-*b);
        const auto seq1 = static_cast<std::int64_t>(*s1), seq2 = static_cast<std::int64_t>(*s2);
        if (na < 0 || nb < 0 || !(seq1 <= na && na <= nb && nb <= seq2)) torn.fetch_add(1);
        reads.fetch_add(1);
      }
    });
  }
  for (std::uint64_t k = 1; k <= kBatches; ++k) {
    const Units delta = static_cast<Units>(k) * kUnitsPerWeight;
    EXPECT_TRUE(applied(*view, batch(1, k, {cohort(1, 1, delta), cohort(1, 2, -delta)})));
  }
  done.store(true, std::memory_order_release);
  for (auto& t : readers) t.join();
  EXPECT_EQ(torn.load(), 0u) << "a reader saw part of a batch";
  EXPECT_EQ(errors.load(), 0u);
  EXPECT_GT(reads.load(), 0u);
  EXPECT_EQ(seq_of(*view, 1), kBatches);
  EXPECT_EQ(value_of(view->cohort_score(1, 1)), static_cast<double>(kBatches * (kBatches + 1) / 2));
  EXPECT_EQ(value_of(view->cohort_score(1, 2)), -static_cast<double>(kBatches * (kBatches + 1) / 2));
  std::cout << "[global view] " << reads.load() << " consistent reads during " << kBatches << " applies\n";
}

// Two consumers deliver the same feed at once (as after a failover): each
// batch is applied by exactly one of them.
TEST(GlobalViewConcurrentTest, TwoConsumersOfTheSameFeedApplyEachBatchOnce) {
  TempDir dir;
  auto view = open_view(dir.path());
  ASSERT_NE(view, nullptr);
  constexpr std::uint64_t kBatches = 100;
  std::vector<ChangeBatch> feed;
  for (std::uint64_t k = 1; k <= kBatches; ++k) feed.push_back(batch(4, k, {community(1, 1, weight(0.1))}));
  std::atomic<std::uint64_t> applied_count{0}, errors{0};
  std::vector<std::thread> consumers;
  for (int t = 0; t < 2; ++t) {
    consumers.emplace_back([&] {
      for (const ChangeBatch& b : feed) {
        Result<bool> r = view->apply(b);
        if (!r.ok()) errors.fetch_add(1);
        else if (*r) applied_count.fetch_add(1);
      }
    });
  }
  for (auto& t : consumers) t.join();
  EXPECT_EQ(errors.load(), 0u);
  EXPECT_EQ(applied_count.load(), kBatches);
  EXPECT_EQ(seq_of(*view, 4), kBatches);
  EXPECT_EQ(value_of(view->community_score(1, 1)), units_to_double(weight(0.1) * kBatches));
}

// A checkpoint taken while batches are applied holds a whole prefix of them:
// its applied seq s, and exactly the deltas of batches 1..s.
TEST(GlobalViewConcurrentTest, ACheckpointDuringAppliesHoldsAWholePrefix) {
  TempDir dir;
  auto view = open_view(dir.sub("view"));
  ASSERT_NE(view, nullptr);
  constexpr std::uint64_t kBatches = 150;
  std::atomic<std::uint64_t> next{1};
  std::thread applier([&] {
    for (std::uint64_t k = 1; k <= kBatches; ++k) {
      const Units delta = static_cast<Units>(k) * kUnitsPerWeight;
      EXPECT_TRUE(applied(*view, batch(1, k, {cohort(1, 1, delta), community(1, 1, -delta)})));
      next.store(k + 1, std::memory_order_release);
    }
  });
  std::vector<std::string> copies;
  for (std::uint64_t i = 0; i < 3; ++i) {
    while (next.load(std::memory_order_acquire) < (i + 1) * kBatches / 4) std::this_thread::yield();
    copies.push_back(dir.sub("copy-" + std::to_string(i)));
    EXPECT_OK(view->checkpoint(copies.back()));
  }
  applier.join();
  for (const std::string& path : copies) {
    auto copy = open_view(path);
    ASSERT_NE(copy, nullptr);
    const std::uint64_t s = seq_of(*copy, 1);
    EXPECT_GT(s, 0u) << path;
    const double prefix = static_cast<double>(s * (s + 1) / 2);
    EXPECT_EQ(value_of(copy->cohort_score(1, 1)), prefix) << path;
    EXPECT_EQ(value_of(copy->community_score(1, 1)), -prefix) << path;
  }
}

}  // namespace
}  // namespace tidal
