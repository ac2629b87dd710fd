// The upgrade from format 2 (tidal 0.2: one RocksDB database) to format 3
// (users and state engines; docs/FORMAT.md, docs/CONTRACT.md E3), on a real
// format-2 Db written by tidal 0.2 itself (tests/data/README.md): every
// value it held reads back bit for bit, whatever step of the upgrade a
// SIGKILL interrupts.
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstring>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <set>
#include <tuple>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "raw_db.h"
#include "storage/storage.h"
#include "test_util.h"
#include "tidal/db.h"

extern char** environ;

namespace tidal {
namespace {

using testing::RawReader;
using testing::TempDir;

// Extracts the format-2 fixture into `dir` and returns the Db's path.
std::string extract_fixture(const std::string& dir) {
  const std::string command =
      "tar -xzf '" + std::string(testing::paths::kTestData) + "/format2_db.tar.gz' -C '" + dir + "'";
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  return dir + "/db";
}

std::vector<std::string> expected_lines() {
  std::ifstream in(std::string(testing::paths::kTestData) + "/format2_expected.txt");
  EXPECT_TRUE(in.good()) << "cannot read " << testing::paths::kTestData << "/format2_expected.txt";
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line[0] != '#') out.push_back(line);
  }
  return out;
}

std::string bits(double d) {
  std::uint64_t b = 0;
  std::memcpy(&b, &d, sizeof b);
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, b);
  return buf;
}

std::string hex_bytes(const std::string& s) {
  std::string out;
  char buf[3];
  for (char c : s) {
    std::snprintf(buf, sizeof buf, "%02x", static_cast<unsigned>(static_cast<unsigned char>(c)));
    out += buf;
  }
  return out;
}

const char* status_name(MembershipStatus s) { return s == MembershipStatus::Left ? "Left" : "Active"; }

// What `db` reads for everything `expected` names, in the same line forms
// and order as tests/data/make_format2_db.cc's read mode (format2_expected.txt
// documents them).
std::vector<std::string> listing(Db& db, const std::vector<std::string>& expected) {
  std::vector<std::string> out;
  std::vector<std::uint64_t> users;
  for (const std::string& line : expected) {
    std::istringstream in(line);
    std::string kind;
    in >> kind;
    if (kind == "score") {
      std::string what;
      std::uint64_t owner = 0, item = 0;
      in >> what >> owner >> item;
      Result<double> score = what == "personal" ? db.personal_score(owner, item)
                             : what == "cohort" ? db.cohort_score(owner, item)
                                                : db.community_score(owner, item);
      out.push_back("score " + what + " " + std::to_string(owner) + " " + std::to_string(item) + " " +
                    (score.ok() ? bits(*score) : score.status().to_string()));
    } else if (kind == "status") {
      std::uint64_t u = 0;
      in >> u;
      users.push_back(u);
    }
  }
  for (std::uint64_t u : users) {
    Result<CommunityMembership> m = db.community_layer_status(u);
    if (!m.ok()) {
      out.push_back("status " + std::to_string(u) + " " + m.status().to_string());
      continue;
    }
    out.push_back("status " + std::to_string(u) + " " + status_name(m->status) + " " +
                  (m->left_at_ns ? std::to_string(*m->left_at_ns) : "-"));
  }
  for (std::uint64_t u : users) {
    Result<std::vector<MembershipEvent>> h = db.community_layer_history(u);
    if (!h.ok()) out.push_back("history " + h.status().to_string());
    for (const MembershipEvent& e : h.ok() ? *h : std::vector<MembershipEvent>{}) {
      out.push_back("history " + std::to_string(u) + " " + status_name(e.status) + " " + std::to_string(e.at_ns));
    }
  }
  (void)db.for_each_left([&](const CommunityMembership& m) {
    out.push_back("left " + std::to_string(m.user_id) + " " + std::to_string(m.left_at_ns.value_or(0)));
    return true;
  });
  for (std::uint64_t u : users) {
    Result<std::vector<PurgeReceipt>> receipts = db.purge_receipts(u);
    if (!receipts.ok()) out.push_back("receipt " + receipts.status().to_string());
    for (const PurgeReceipt& r : receipts.ok() ? *receipts : std::vector<PurgeReceipt>{}) {
      out.push_back("receipt " + std::to_string(u) + " " + std::to_string(r.purged_at_ns) + " " +
                    std::to_string(r.entries_removed) + " " + std::to_string(r.left_at_ns) + " " +
                    bits(r.cohort_weight_removed) + " " + bits(r.community_weight_removed) + " " +
                    (r.erasure_complete ? "1" : "0"));
    }
  }
  for (std::uint64_t u : users) {
    std::string line = "communities " + std::to_string(u);
    Result<std::vector<std::uint64_t>> c = db.communities_of(u);
    for (std::uint64_t id : c.ok() ? *c : std::vector<std::uint64_t>{}) line += " " + std::to_string(id);
    out.push_back(line);
  }
  const Stats st = db.stats();
  const std::uint64_t last = db.last_change_seq().ok() ? *db.last_change_seq() : 0;
  out.push_back("feed shard_id " + std::to_string(st.change_feed_shard_id));
  out.push_back("feed last_seq " + std::to_string(last));
  out.push_back("feed trimmed_seq " + std::to_string(st.change_feed_trimmed_seq));
  out.push_back("feed pending_bytes " + std::to_string(st.change_feed_pending_bytes));
  {
    auto r = db.read_changes(0, 1 << 20);
    out.push_back(std::string("feed read_trimmed ") + status_code_name(r.ok() ? StatusCode::Ok : r.status().code()));
  }
  for (std::uint64_t after = st.change_feed_trimmed_seq; after < last;) {
    Result<std::vector<ChangeBatch>> batches = db.read_changes(after, 1 << 20);
    if (!batches.ok() || batches->empty()) {
      out.push_back("feed read failed after " + std::to_string(after));
      break;
    }
    for (const ChangeBatch& b : *batches) {
      out.push_back("feed " + std::to_string(b.seq) + " " + hex_bytes(b.payload));
      after = b.seq;
    }
  }
  Result<VerifyReport> v = db.verify();
  if (!v.ok()) out.push_back("verify " + v.status().to_string());
  else if (v->ok()) out.push_back("verify ok " + std::to_string(v->records_checked));
  else for (const std::string& p : v->problems) out.push_back("verify problem " + p);
  return out;
}

Options feed_options(bool read_only = false) {
  Options options;
  options.create_if_missing = false;
  options.read_only = read_only;
  options.change_feed = !read_only;
  options.shard_id = 7;
  return options;
}

// The column families of the RocksDB database in `path` (its root).
std::vector<std::string> families(const std::string& path) {
  std::vector<std::string> names;
  EXPECT_TRUE(rocksdb::DB::ListColumnFamilies(rocksdb::Options(), path, &names).ok());
  std::sort(names.begin(), names.end());
  return names;
}

void expect_all_values(const std::string& path, const std::vector<std::string>& expected, const char* when) {
  for (bool read_only : {false, true}) {
    Result<std::unique_ptr<Db>> db = Db::open(path, feed_options(read_only));
    ASSERT_TRUE(db.ok()) << when << ": " << db.status().to_string();
    const std::vector<std::string> got = listing(**db, expected);
    ASSERT_EQ(got.size(), expected.size()) << when;
    for (std::size_t i = 0; i < got.size(); ++i) {
      ASSERT_EQ(got[i], expected[i]) << when << (read_only ? " (read-only open)" : " (writable open)") << ", line " << i;
    }
    ASSERT_OK((*db)->close());
  }
  EXPECT_EQ(families(path), (std::vector<std::string>{"bucket_keys", "by_tag", "default", "users", "wrapped_keys"})) << when;
}

TEST(MigrationTest, AReadOnlyOpenOfFormat2IsRefusedNamingTheCommand) {
  TempDir dir;
  const std::string path = extract_fixture(dir.path());
  const std::vector<std::string> before = families(path);
  Result<std::unique_ptr<Db>> db = Db::open(path, feed_options(/*read_only=*/true));
  ASSERT_EQ(db.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(db.status().message().find("format 2"), std::string::npos) << db.status().message();
  EXPECT_NE(db.status().message().find("tidalctl migrate " + path), std::string::npos) << db.status().message();
  EXPECT_FALSE(std::filesystem::exists(path + "/state"));
  EXPECT_EQ(families(path), before);
}

TEST(MigrationTest, AFormat2DbWrittenByTidal02ReadsBackBitForBit) {
  TempDir dir;
  const std::string path = extract_fixture(dir.path());
  const std::vector<std::string> expected = expected_lines();
  ASSERT_GT(expected.size(), 500u);
  EXPECT_EQ(families(path), (std::vector<std::string>{"aggregates", "by_tag", "default", "feed", "ledger", "users"}));
  expect_all_values(path, expected, "after the upgrade");
  // The upgraded Db goes on: a new batch continues the feed at seq 10.
  Result<std::unique_ptr<Db>> db = Db::open(path, feed_options());
  ASSERT_OK(db.status());
  Result<SignalOutcome> signaled = (*db)->signal_with_context({1001, 3, 1.0}, {{9001}});
  ASSERT_OK(signaled.status());
  ASSERT_OK((*db)->flush());
  Result<std::uint64_t> last = (*db)->last_change_seq();
  ASSERT_OK(last.status());
  EXPECT_EQ(*last, 10u);
  Result<VerifyReport> v = (*db)->verify();
  ASSERT_OK(v.status());
  EXPECT_TRUE(v->ok()) << v->problems.front();
}

// Runs `tidal_crash_child migrate <path> <step>`; true when it was SIGKILLed.
bool killed_at_step(const std::string& path, int step) {
  const std::string step_text = std::to_string(step);
  std::vector<char*> argv = {const_cast<char*>(testing::paths::kCrashChild), const_cast<char*>("migrate"),
                             const_cast<char*>(path.c_str()), const_cast<char*>(step_text.c_str()), nullptr};
  pid_t pid = 0;
  EXPECT_EQ(::posix_spawn(&pid, testing::paths::kCrashChild, nullptr, nullptr, argv.data(), environ), 0);
  int status = 0;
  EXPECT_EQ(::waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) == 0)) << "status " << status;
  return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
}

// The upgrade's steps (storage/migrate.cc): 1 before state/ is cleared,
// 2 before the state engine is created, 3 after the copy, 4 before the
// commit, 5 after it (the format-2 column families not yet dropped).
TEST(MigrationTest, ASigkillAtEveryStepOfTheUpgradeLosesNothing) {
  const std::vector<std::string> expected = expected_lines();
  for (int step = 1; step <= 5; ++step) {
    TempDir dir;
    const std::string path = extract_fixture(dir.path());
    ASSERT_TRUE(killed_at_step(path, step)) << "the upgrade never reached step " << step;
    // Before the commit the Db is format 2 as it was (a read-only open
    // refuses it); after it, format 3 with the old column families still there.
    {
      Result<std::unique_ptr<Db>> ro = Db::open(path, feed_options(/*read_only=*/true));
      if (step <= 4) EXPECT_EQ(ro.status().code(), StatusCode::InvalidArgument) << "step " << step;
      else EXPECT_OK(ro.status());
      EXPECT_EQ(families(path), (std::vector<std::string>{"aggregates", "by_tag", "default", "feed", "ledger", "users"}));
    }
    if (step == 3) {  // killed twice: once more at an earlier step of the next attempt
      ASSERT_TRUE(killed_at_step(path, 2));
    }
    expect_all_values(path, expected, ("after a SIGKILL at step " + std::to_string(step)).c_str());
    if (::testing::Test::HasFailure()) return;
  }
}

// ---- every format-2 layout tidal 0.2 wrote, and the epochs of its ledger ----

// The layouts of format 2 that tidal 0.2 wrote. The fixture was written at
// 9dd4519 (the last format-2 commit): a state_epoch record (from cbd41e6
// on) and a change feed (from 615c6e1 on). tidal 0.2.0 before cbd41e6 wrote
// each batch's ledger records under the engine's next sequence number and
// stored no state_epoch; before 615c6e1 there was no feed column family and
// no feed_* meta record.
struct Format2Layout {
  const char* name;
  bool state_epoch;
  bool feed;
};
constexpr Format2Layout kFormat2Layouts[] = {
    {"as written at 9dd4519 (state_epoch, change feed)", true, true},
    {"without state_epoch (tidal 0.2.0 before cbd41e6), with a change feed", false, true},
    {"without state_epoch or change feed (tidal 0.2.0 as released)", false, false},
    {"with state_epoch, without change feed (cbd41e6 to 615c6e1)", true, false},
};

// Rewrites the extracted fixture at `path` into `layout`, with RocksDB's own
// API: what 0.2 would have written, but for what the layout lacks.
void reshape(const std::string& path, const Format2Layout& layout) {
  std::vector<std::string> names;
  ASSERT_TRUE(rocksdb::DB::ListColumnFamilies(rocksdb::Options(), path, &names).ok());
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
  for (const std::string& name : names) {
    cfs.emplace_back(name, rocksdb::ColumnFamilyOptions());
    if (name == "aggregates") cfs.back().options.merge_operator = new_units_add_operator();
  }
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), path, cfs, &handles, &raw).ok());
  std::unique_ptr<rocksdb::DB> db(raw);
  rocksdb::WriteOptions sync;
  sync.sync = true;
  std::string epoch;
  ASSERT_TRUE(db->Get(rocksdb::ReadOptions(), handles[0], kStateEpochKey, &epoch).ok()) << "the fixture has a state_epoch";
  if (!layout.state_epoch) {
    ASSERT_TRUE(db->Delete(sync, handles[0], kStateEpochKey).ok());
  }
  ASSERT_TRUE(db->Flush(rocksdb::FlushOptions(), handles).ok());
  if (!layout.feed) {
    ASSERT_TRUE(db->Delete(sync, handles[0], kFeedShardKey).ok());
    ASSERT_TRUE(db->Delete(sync, handles[0], kFeedTrimmedKey).ok());
    for (auto* h : handles) {
      if (h->GetName() == "feed") {
        ASSERT_TRUE(db->DropColumnFamily(h).ok());
      }
    }
    ASSERT_TRUE(db->Flush(rocksdb::FlushOptions(), handles[0]).ok());
  }
  for (auto* h : handles) ASSERT_TRUE(db->DestroyColumnFamilyHandle(h).ok());
  ASSERT_TRUE(db->Close().ok());
}

Options layout_options(const Format2Layout& layout) {
  Options options;
  options.create_if_missing = false;
  options.change_feed = layout.feed;
  options.shard_id = 7;
  options.aggregate_write_period = std::chrono::hours(1);  // only flush() writes a batch
  return options;
}

// A user Active in the fixture, with ledger records from several of 0.2's
// batches and two communities (501 and 0x8000000000000005).
constexpr std::uint64_t kUser = 1001;
// Cells no signal of the fixture touched.
constexpr std::uint64_t kNewCohort = 424242;
constexpr std::uint64_t kNewItem = 777;
// Batches written after the upgrade: enough for a state engine whose
// sequence restarted near 0 (each batch takes two sequence numbers) to reach
// epochs that 0.2 gave kUser's records (without the fix: 22 I1 mismatches).
constexpr int kBatches = 64;
constexpr Units kOne = 1'000'000'000;  // weight 1.0 in 1e-9 units

using CellId = std::tuple<AggregateKind, std::uint64_t, std::uint64_t>;  // target kind, target id, item

// What the fixture's ledger (read raw, before the upgrade) says.
struct FixtureLedger {
  std::map<CellId, Units> others;     // every cell a ledger entry names: the sum over users other than kUser
  Units user_cohort = 0;              // kUser's contributions to cohorts
  Units user_community = 0;           // and to communities
  std::set<std::uint64_t> user_epochs;
  std::uint64_t max_epoch = 0;        // of any ledger key
  std::uint64_t last_sequence = 0;    // the format-2 engine's
};

FixtureLedger read_fixture_ledger(const std::string& path) {
  FixtureLedger out;
  RawReader raw(path);
  if (raw.db() == nullptr) return out;
  out.last_sequence = raw.db()->GetLatestSequenceNumber();
  std::unique_ptr<rocksdb::Iterator> it(raw.db()->NewIterator(rocksdb::ReadOptions(), raw.cf("ledger")));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const std::optional<LedgerKey> key = decode_ledger_key({it->key().data(), it->key().size()});
    const std::optional<std::vector<LedgerEntry>> entries = decode_ledger_value({it->value().data(), it->value().size()});
    EXPECT_TRUE(key && entries) << "ledger record " << hex_bytes(it->key().ToString()) << " does not decode";
    if (!key || !entries) continue;
    out.max_epoch = std::max(out.max_epoch, key->epoch);
    if (key->user_id == kUser) out.user_epochs.insert(key->epoch);
    for (const LedgerEntry& e : *entries) {
      Units& others = out.others[{e.target, e.target_id, e.item}];
      if (key->user_id != kUser) others += e.units;
      else (e.target == AggregateKind::Cohort ? out.user_cohort : out.user_community) += e.units;
    }
  }
  EXPECT_TRUE(it->status().ok()) << it->status().ToString();
  return out;
}

std::string problems(const VerifyReport& v) {
  std::string out = std::to_string(v.problems.size()) + " verify problems, the first: ";
  return v.problems.empty() ? "none" : out + v.problems.front();
}

// Opens the (upgraded or to be upgraded) Db at `path`, writes kBatches
// batches of one kUser signal each (cohort kNewCohort, item kNewItem), then
// checks I1 (verify), and that a purge of kUser once Left removes exactly
// what kUser ever gave: every cell the fixture's ledger names reads the sum
// of the other users' entries, bit for bit, and the new cells read 0.
void batches_then_exact_purge(const std::string& path, const Options& options, const FixtureLedger& ledger) {
  ASSERT_FALSE(ledger.user_epochs.empty()) << "user " << kUser << " has no ledger record in the fixture";
  Result<std::unique_ptr<Db>> opened = Db::open(path, options);
  ASSERT_OK(opened.status());
  Db& db = **opened;
  Result<std::vector<std::uint64_t>> communities = db.communities_of(kUser);
  ASSERT_OK(communities.status());
  ASSERT_EQ(communities->size(), 2u);
  for (int b = 0; b < kBatches; ++b) {
    Result<SignalOutcome> signaled = db.signal_with_context({kUser, kNewItem, 1.0}, {{kNewCohort}});
    ASSERT_OK(signaled.status());
    ASSERT_OK(db.flush());
  }
  EXPECT_EQ(db.stats().aggregate_writes, static_cast<std::uint64_t>(kBatches));
  Result<double> fresh = db.cohort_score(kNewCohort, kNewItem);
  ASSERT_OK(fresh.status());
  EXPECT_EQ(*fresh, static_cast<double>(kBatches));
  Result<VerifyReport> v = db.verify();
  ASSERT_OK(v.status());
  EXPECT_TRUE(v->ok()) << "after " << kBatches << " batches: " << problems(*v);

  ASSERT_OK(db.leave_community_layer(kUser));
  Result<PurgeReceipt> receipt = db.purge_community_contributions(kUser);
  ASSERT_OK(receipt.status());
  EXPECT_EQ(receipt->cohort_weight_removed, units_to_double(ledger.user_cohort + kBatches * kOne));
  EXPECT_EQ(receipt->community_weight_removed,
            units_to_double(ledger.user_community + 2 * kBatches * kOne));
  int wrong = 0;
  for (const auto& [cell, units] : ledger.others) {
    const auto& [kind, target, item] = cell;
    Result<double> score = kind == AggregateKind::Cohort ? db.cohort_score(target, item) : db.community_score(target, item);
    ASSERT_OK(score.status());
    if (*score != units_to_double(units) && ++wrong <= 5) {
      ADD_FAILURE() << (kind == AggregateKind::Cohort ? "cohort " : "community ") << target << " item " << item
                    << " reads " << bits(*score) << " after the purge of " << kUser << "; expected "
                    << bits(units_to_double(units)) << " (" << units_to_string(units) << " units)";
    }
  }
  EXPECT_EQ(wrong, 0) << "of " << ledger.others.size() << " cells the fixture's ledger names";
  Result<double> cleared = db.cohort_score(kNewCohort, kNewItem);
  ASSERT_OK(cleared.status());
  EXPECT_EQ(*cleared, 0.0);
  for (std::uint64_t c : *communities) {
    Result<double> community = db.community_score(c, kNewItem);
    ASSERT_OK(community.status());
    EXPECT_EQ(*community, 0.0) << "community " << c;
  }
  v = db.verify();
  ASSERT_OK(v.status());
  EXPECT_TRUE(v->ok()) << "after the purge: " << problems(*v);
  ASSERT_OK(db.close());
}

// Issue 26 item 1: an upgrade that leaves the state store's epoch below the
// epochs of the copied ledger makes new batches replace ledger records.
TEST(MigrationTest, EveryFormat2LayoutKeepsI1AndPurgesExactlyAfterManyBatches) {
  for (const Format2Layout& layout : kFormat2Layouts) {
    SCOPED_TRACE(layout.name);
    TempDir dir;
    const std::string path = extract_fixture(dir.path());
    reshape(path, layout);
    if (::testing::Test::HasFatalFailure()) return;
    const FixtureLedger ledger = read_fixture_ledger(path);
    batches_then_exact_purge(path, layout_options(layout), ledger);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// The upgrade stores a state_epoch at or above every epoch a copied ledger
// key names and the format-2 engine's latest sequence number, whether or not
// the format-2 Db had one.
TEST(MigrationTest, TheUpgradeStoresAStateEpochAboveEveryCopiedLedgerEpoch) {
  for (const Format2Layout& layout : kFormat2Layouts) {
    SCOPED_TRACE(layout.name);
    TempDir dir;
    const std::string path = extract_fixture(dir.path());
    reshape(path, layout);
    if (::testing::Test::HasFatalFailure()) return;
    const FixtureLedger ledger = read_fixture_ledger(path);
    ASSERT_GT(ledger.max_epoch, 0u);
    {
      Result<std::unique_ptr<Db>> db = Db::open(path, layout_options(layout));
      ASSERT_OK(db.status());
      ASSERT_OK((*db)->close());
    }
    RawReader state(state_engine_dir(path));
    ASSERT_NE(state.db(), nullptr);
    std::string epoch;
    ASSERT_TRUE(state.db()->Get(rocksdb::ReadOptions(), state.cf("default"), kStateEpochKey, &epoch).ok())
        << "no state_epoch in the state engine";
    ASSERT_EQ(epoch.size(), 8u);
    EXPECT_GE(get_u64_be(epoch.data()), ledger.max_epoch);
    EXPECT_GE(get_u64_be(epoch.data()), ledger.last_sequence);
  }
}

// The second line of defence: a format-3 Db that an upgrade left with no
// state_epoch at all (as tidal 0.3.0 left an upgraded 0.2.0 Db) still never
// reuses an epoch of its format-2 ledger.
TEST(MigrationTest, AnUpgradedDbThatLostItsStateEpochStillNeverReusesAnEpoch) {
  const Format2Layout& layout = kFormat2Layouts[1];
  TempDir dir;
  const std::string path = extract_fixture(dir.path());
  reshape(path, layout);
  if (::testing::Test::HasFatalFailure()) return;
  const FixtureLedger ledger = read_fixture_ledger(path);
  {
    Result<std::unique_ptr<Db>> db = Db::open(path, layout_options(layout));
    ASSERT_OK(db.status());
    ASSERT_OK((*db)->close());
  }
  {
    testing::RawDb raw(path);
    ASSERT_TRUE(raw.ok());
    rocksdb::WriteOptions sync;
    sync.sync = true;
    ASSERT_TRUE(raw.db(testing::RawDb::kStateMeta)->Delete(sync, raw.cf(testing::RawDb::kStateMeta), kStateEpochKey).ok());
  }
  batches_then_exact_purge(path, layout_options(layout), ledger);
}

// ---- rollback: tidal 0.2 refuses a format-3 Db ----

// What tidal 0.2 did first on every open (StateStore::check_format, the
// same from 0.2.0 to 9dd4519), on the RocksDB database in the Db directory:
// read "state_format" from its default column family; refuse any value but
// "2"; when absent, refuse a non-empty "aggregates" column family (tidal
// 0.1's), else mark it "2" and run. Returns 0.2's refusal, or "" when 0.2
// would have run.
std::string tidal02_refusal(const std::string& path) {
  RawReader raw(path);
  if (raw.db() == nullptr) return "cannot open";
  std::string format;
  rocksdb::Status s = raw.db()->Get(rocksdb::ReadOptions(), raw.cf("default"), "state_format", &format);
  if (s.ok()) {
    if (format == "2") return "";
    return "cannot open tidal Db at '" + path + "': its aggregates are in format " + format +
           "; this version reads format 2";
  }
  EXPECT_TRUE(s.IsNotFound()) << s.ToString();
  if (raw.cf("aggregates") != nullptr) {
    std::unique_ptr<rocksdb::Iterator> it(raw.db()->NewIterator(rocksdb::ReadOptions(), raw.cf("aggregates")));
    it->SeekToFirst();
    if (it->Valid()) return "its aggregates were written by tidal 0.1";
  }
  return "";
}

// Issue 26 item 6: after the upgrade (and in a new Db) the users engine
// carries a state_format that tidal 0.2 refuses, so a rollback to 0.2 fails
// its open with a clear error instead of running on empty aggregates; and
// format 3 opens its own Db with the mark, read-only and writable.
TEST(MigrationTest, Tidal02RefusesAnUpgradedOrNewFormat3Db) {
  TempDir dir;
  const std::string path = extract_fixture(dir.path());
  ASSERT_EQ(tidal02_refusal(path), "") << "0.2 opens its own fixture";
  {
    Result<std::unique_ptr<Db>> db = Db::open(path, feed_options());
    ASSERT_OK(db.status());
    ASSERT_OK((*db)->close());
  }
  const std::string refusal = tidal02_refusal(path);
  EXPECT_NE(refusal.find("its aggregates are in format 3"), std::string::npos) << refusal;
  EXPECT_NE(refusal.find("tidal 0.3 or newer"), std::string::npos) << refusal;
  EXPECT_NE(refusal.find("state/"), std::string::npos) << refusal;
  expect_all_values(path, expected_lines(), "with the rollback mark");

  const std::string fresh = dir.sub("new");
  {
    Result<std::unique_ptr<Db>> db = Db::open(fresh);
    ASSERT_OK(db.status());
    ASSERT_OK((*db)->leave_community_layer(5));
    ASSERT_OK((*db)->close());
  }
  EXPECT_NE(tidal02_refusal(fresh).find("its aggregates are in format 3"), std::string::npos);
  // A format-3 Db written before the mark existed gets it at its next writable open.
  {
    testing::RawDb raw(fresh);
    ASSERT_TRUE(raw.ok());
    ASSERT_TRUE(raw.db(testing::RawDb::kMeta)->Delete(rocksdb::WriteOptions(), raw.cf(testing::RawDb::kMeta), "state_format").ok());
  }
  ASSERT_EQ(tidal02_refusal(fresh), "");
  for (bool read_only : {true, false}) {
    Options options;
    options.read_only = read_only;
    Result<std::unique_ptr<Db>> db = Db::open(fresh, options);
    ASSERT_OK(db.status());
    Result<CommunityMembership> m = (*db)->community_layer_status(5);
    ASSERT_OK(m.status());
    EXPECT_EQ(m->status, MembershipStatus::Left);
    ASSERT_OK((*db)->close());
  }
  EXPECT_NE(tidal02_refusal(fresh).find("its aggregates are in format 3"), std::string::npos);
}

// ---- an open that fails does not upgrade ----

// Issue 26 item 6: every check that can refuse the open of a format-2 Db
// runs before the upgrade, so a refused open leaves it in format 2 with
// every record as it was, and no state engine.
TEST(MigrationTest, AnOpenRefusedForAnyReasonLeavesFormat2AsItWas) {
  struct Case {
    const char* name;
    std::function<void(const std::string& path)> damage;  // before the open
    std::function<void(Options*)> options;
    StatusCode code;
    const char* message;
  };
  const std::uint64_t corrupt_user = 1021;  // Left in the fixture
  const std::vector<Case> cases = {
      {"another shard id", nullptr, [](Options* o) { o->shard_id = 8; }, StatusCode::InvalidArgument,
       "its change feed belongs to shard 7"},
      {"no change feed in Options", nullptr, [](Options* o) { o->change_feed = false; }, StatusCode::InvalidArgument,
       "it keeps a change feed (shard 7)"},
      {"a corrupt leave record",
       [&](const std::string& path) {
         testing::RawDb raw(path, testing::RawDb::Layout::Format2);
         ASSERT_TRUE(raw.ok());
         const std::string bad = "\x01\x02\x03";
         ASSERT_TRUE(raw.db(testing::RawDb::kUsers)
                         ->Put(rocksdb::WriteOptions(), raw.cf(testing::RawDb::kUsers),
                               encode_key(EntityId(corrupt_user), Tag::CommunityLeave), bad)
                         .ok());
         ASSERT_TRUE(raw.db(testing::RawDb::kByTag)
                         ->Put(rocksdb::WriteOptions(), raw.cf(testing::RawDb::kByTag),
                               encode_index_key(EntityId(corrupt_user), Tag::CommunityLeave), bad)
                         .ok());
       },
       nullptr, StatusCode::Corruption, "1021"},
      {"a corrupt clock floor",
       [](const std::string& path) {
         testing::RawDb raw(path, testing::RawDb::Layout::Format2);
         ASSERT_TRUE(raw.ok());
         ASSERT_TRUE(raw.db(testing::RawDb::kMeta)
                         ->Put(rocksdb::WriteOptions(), raw.cf(testing::RawDb::kMeta), clock_floor_stripe_key(3), "abc")
                         .ok());
       },
       nullptr, StatusCode::Corruption, "clock floor"},
      {"a corrupt state_epoch",
       [](const std::string& path) {
         testing::RawDb raw(path, testing::RawDb::Layout::Format2);
         ASSERT_TRUE(raw.ok());
         ASSERT_TRUE(raw.db(testing::RawDb::kMeta)
                         ->Put(rocksdb::WriteOptions(), raw.cf(testing::RawDb::kMeta), kStateEpochKey, "abc")
                         .ok());
       },
       nullptr, StatusCode::Corruption, "epoch"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TempDir dir;
    const std::string path = extract_fixture(dir.path());
    if (c.damage) c.damage(path);
    if (::testing::Test::HasFatalFailure()) return;
    std::map<std::string, std::vector<std::pair<std::string, std::string>>> before;
    {
      RawReader raw(path);
      before = raw.contents();
    }
    ASSERT_EQ(before.size(), 6u);  // default, users, by_tag, aggregates, ledger, feed
    Options options = feed_options();
    if (c.options) c.options(&options);
    Result<std::unique_ptr<Db>> db = Db::open(path, options);
    ASSERT_EQ(db.status().code(), c.code) << db.status().to_string();
    EXPECT_NE(db.status().message().find(c.message), std::string::npos) << db.status().message();
    EXPECT_FALSE(std::filesystem::exists(state_engine_dir(path))) << "the refused open created the state engine";
    RawReader raw(path);
    const auto after = raw.contents();
    EXPECT_EQ(after.size(), before.size()) << "column families changed";
    for (const auto& [cf, rows] : before) {
      auto it = after.find(cf);
      if (it == after.end()) {
        ADD_FAILURE() << "column family " << cf << " is gone";
        continue;
      }
      EXPECT_TRUE(it->second == rows) << "column family " << cf << " changed: " << rows.size() << " records before, "
                                      << it->second.size() << " after";
    }
    std::string format;
    EXPECT_TRUE(raw.db()->Get(rocksdb::ReadOptions(), raw.cf("default"), "db_format", &format).IsNotFound());
  }
}

// ---- what the upgrade costs: disk, and other opens ----

// The upgrade gives the state engine the format-2 database's SST files by
// hard links (a RocksDB checkpoint), not copies: killed just before its
// commit, every file of state/'s aggregates, ledger and change feed is the
// same inode as a file of the format-2 database, so the upgrade wrote no
// second copy of the state (issue 26, item 9: a copy needed up to 3x).
TEST(MigrationTest, TheUpgradeLinksTheStateEnginesFilesInsteadOfCopyingThem) {
  TempDir dir;
  const std::string path = extract_fixture(dir.path());
  std::set<std::pair<dev_t, ino_t>> format2_files;
  for (const auto& entry : std::filesystem::directory_iterator(path)) {
    struct stat st {};
    if (entry.path().extension() == ".sst" && ::stat(entry.path().c_str(), &st) == 0) {
      format2_files.insert({st.st_dev, st.st_ino});
    }
  }
  ASSERT_FALSE(format2_files.empty());
  ASSERT_TRUE(killed_at_step(path, 4)) << "the upgrade never reached step 4";
  std::vector<rocksdb::LiveFileMetaData> files;
  {
    RawReader state(state_engine_dir(path));
    ASSERT_NE(state.db(), nullptr);
    state.db()->GetLiveFilesMetaData(&files);
  }
  int linked = 0;
  std::map<std::string, int> per_family;
  for (const rocksdb::LiveFileMetaData& f : files) {
    if (f.column_family_name != "aggregates" && f.column_family_name != "ledger" && f.column_family_name != "feed") {
      continue;
    }
    ++per_family[f.column_family_name];
    const std::string file = state_engine_dir(path) + f.name;
    struct stat st {};
    ASSERT_EQ(::stat(file.c_str(), &st), 0) << file;
    EXPECT_TRUE(format2_files.count({st.st_dev, st.st_ino}) == 1)
        << f.column_family_name << " file " << file << " (" << f.size << " bytes) is a copy, not a link to the "
        << "format-2 database's file (links: " << st.st_nlink << ")";
    linked += format2_files.count({st.st_dev, st.st_ino}) == 1 ? 1 : 0;
  }
  EXPECT_EQ(per_family.size(), 3u) << "state/ lacks the aggregates, the ledger or the feed";
  EXPECT_GT(linked, 0);
  // And the next open finishes the upgrade from scratch, every value intact.
  expect_all_values(path, expected_lines(), "after a SIGKILL before the commit of a linked upgrade");
}

// The upgrade runs outside the process-wide lock of opens: while one Db is
// being upgraded (held at step 3), a Db in another directory opens. Both
// through Db::open (which upgrades after its checks) and a plain
// Storage::open (which upgrades at once).
TEST(MigrationTest, AnUpgradeHoldsUpNoOtherOpenInTheProcess) {
  for (bool through_db : {true, false}) {
    SCOPED_TRACE(through_db ? "Db::open" : "Storage::open");
    TempDir dir;
    const std::string path = extract_fixture(dir.path());
    std::promise<Status> other;
    std::future<Status> other_done = other.get_future();
    bool waited = false;
    std::thread opener;
    Storage::step_for_testing = [&](std::string_view task, int step) {
      if (task != "migrate" || step != 3 || waited) return;
      waited = true;
      opener = std::thread([&] {
        Result<std::unique_ptr<Db>> db = Db::open(dir.sub("other"), Options{});
        other.set_value(db.status());
      });
      // Generous: an open takes milliseconds; a held lock never ends.
      if (other_done.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
        ADD_FAILURE() << "another Db's open did not finish while this Db was being upgraded";
      }
    };
    if (through_db) {
      Result<std::unique_ptr<Db>> db = Db::open(path, feed_options());
      EXPECT_OK(db.status());
    } else {
      Result<std::unique_ptr<Storage>> storage = Storage::open(path, Storage::Config{});
      EXPECT_OK(storage.status());
    }
    Storage::step_for_testing = nullptr;
    if (opener.joinable()) opener.join();
    EXPECT_TRUE(waited) << "the upgrade never reached step 3";
    if (other_done.wait_for(std::chrono::seconds(0)) == std::future_status::ready) EXPECT_OK(other_done.get());
  }
}

// No line of either engine's info LOG names a key (docs/PURGE.md, "What an
// attacker holding the files can learn"): the erasure of records carried
// from format 3 compacts each purged user's ledger range ([user][0x13]...),
// which RocksDB logs as quoted hex.
TEST(MigrationTest, APurgeOfCarriedRecordsLogsNoKey) {
  TempDir dir;
  const std::string path = extract_fixture(dir.path());
  std::vector<std::uint64_t> users;
  for (const std::string& line : expected_lines()) {
    std::istringstream in(line);
    std::string kind;
    std::uint64_t user = 0;
    if (in >> kind >> user && kind == "status") users.push_back(user);
  }
  ASSERT_GE(users.size(), 4u);
  users.resize(4);
  {
    auto db = testing::open_db(path, feed_options());
    ASSERT_OK(db->leave_community_layer(std::span<const std::uint64_t>(users)));
    for (std::uint64_t u : users) {
      Result<PurgeReceipt> receipt = db->purge_community_contributions(u);
      ASSERT_OK(receipt.status());
    }
    ASSERT_OK(db->close());
  }
  const auto quoted_key = [](const std::string& line) {
    for (std::size_t q = line.find('\''); q != std::string::npos; q = line.find('\'', q + 1)) {
      std::size_t end = q + 1;
      while (end < line.size() && std::isxdigit(static_cast<unsigned char>(line[end]))) ++end;
      if (end < line.size() && line[end] == '\'' && end - q - 1 >= 2) return true;
    }
    return false;
  };
  std::size_t compactions = 0;
  for (const std::string& log : {path + "/LOG", path + "/state/LOG"}) {
    std::ifstream in(log);
    ASSERT_TRUE(in) << log;
    for (std::string line; std::getline(in, line);) {
      if (line.find("Manual compaction") != std::string::npos) ++compactions;
      if (quoted_key(line)) ADD_FAILURE() << log << " names a key: " << line;
    }
  }
  EXPECT_GT(compactions, 0u) << "the purges compacted no carried ledger range";
}

}  // namespace
}  // namespace tidal
