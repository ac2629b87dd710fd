// The upgrade from format 2 (tidal 0.2: one RocksDB database) to format 3
// (users and state engines; docs/FORMAT.md, docs/CONTRACT.md E3), on a real
// format-2 Db written by tidal 0.2 itself (tests/data/README.md): every
// value it held reads back bit for bit, whatever step of the upgrade a
// SIGKILL interrupts.
#include <spawn.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstring>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "raw_db.h"
#include "test_util.h"
#include "tidal/db.h"

extern char** environ;

#ifndef TIDAL_TEST_DATA
#error "TIDAL_TEST_DATA must name tests/data"
#endif
#ifndef TIDAL_CRASH_CHILD
#error "TIDAL_CRASH_CHILD must name the tidal_crash_child executable"
#endif

namespace tidal {
namespace {

using testing::TempDir;

// Extracts the format-2 fixture into `dir` and returns the Db's path.
std::string extract_fixture(const std::string& dir) {
  const std::string command =
      "tar -xzf '" + std::string(TIDAL_TEST_DATA) + "/format2_db.tar.gz' -C '" + dir + "'";
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  return dir + "/db";
}

std::vector<std::string> expected_lines() {
  std::ifstream in(std::string(TIDAL_TEST_DATA) + "/format2_expected.txt");
  EXPECT_TRUE(in.good()) << "cannot read " << TIDAL_TEST_DATA << "/format2_expected.txt";
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
  EXPECT_EQ(families(path), (std::vector<std::string>{"by_tag", "default", "users"})) << when;
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
  std::vector<char*> argv = {const_cast<char*>(TIDAL_CRASH_CHILD), const_cast<char*>("migrate"),
                             const_cast<char*>(path.c_str()), const_cast<char*>(step_text.c_str()), nullptr};
  pid_t pid = 0;
  EXPECT_EQ(::posix_spawn(&pid, TIDAL_CRASH_CHILD, nullptr, nullptr, argv.data(), environ), 0);
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

}  // namespace
}  // namespace tidal
