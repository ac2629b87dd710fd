// tidal::nats::recover_shard against a real 3-node NATS JetStream cluster:
// a Db restored from a backup gets every leave, rejoin and purge journaled
// after the backup back from the journal's stream, then serves again, and
// its JournalPublisher resumes over the stream without a fence.

#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nats/nats.h>

#include "../test_util.h"
#include "nats_cluster.h"
#include "nats_test_util.h"
#include "start_refusal.h"
#include "tidal/nats.h"

namespace tidal::nats {
namespace {

using namespace std::chrono_literals;
using testing::eventually;
using testing::Js;
using testing::NatsCluster;
using tidal::testing::TempDir;

// A test config whose journal stream is "<name>_J" on "tidal.<name>_J.*".
Config journal_test_config(const NatsCluster& cluster, const std::string& name, int replicas) {
  Config config = testing::test_config(cluster, name, replicas);
  config.journal_stream = name + "_J";
  config.journal_subject_prefix = "tidal." + name + "_J";
  return config;
}

Options recover_options(std::uint64_t shard) {
  Options o = testing::shard_options(shard);
  o.journal = true;
  return o;
}

std::unique_ptr<Db> open_recover_db(const std::string& path, std::uint64_t shard) {
  auto db = Db::open(path, recover_options(shard));
  EXPECT_TRUE(db.ok()) << db.status().to_string();
  return db.ok() ? std::move(*db) : nullptr;
}

bool confirmed(Db* db, const JournalPublisher& p) {
  Stats st = db->stats();
  return st.journal_confirmed_seq == st.journal_last_seq && p.stats().published_seq == st.journal_last_seq;
}

// Every user's status and history in `db`, one line each.
std::string statuses(Db* db, std::uint64_t users) {
  std::string out;
  for (std::uint64_t u = 1; u <= users; ++u) {
    Result<CommunityMembership> m = db->community_layer_status(u);
    out += std::to_string(u) + ":" + (m.ok() ? std::to_string(static_cast<int>(m->status)) : m.status().to_string());
    auto h = db->community_layer_history(u);
    out += h.ok() ? " history " + std::to_string(h->size()) : " " + h.status().to_string();
    out += "\n";
  }
  return out;
}

TEST(NatsRecover, ARestoredShardReplaysTheJournalAfterItsBackupAndServesAgain) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = journal_test_config(cluster, "RECOVER", 3);
  constexpr std::uint64_t kUsers = 30;
  auto db = open_recover_db(dir.sub("db"), 5);
  ASSERT_NE(db, nullptr);
  auto started = JournalPublisher::start(db.get(), config);
  ASSERT_TRUE(started.ok()) << started.status().to_string();
  auto p = std::move(*started);
  for (std::uint64_t u = 1; u <= kUsers; ++u) {
    ASSERT_OK(db->join_community(u, 1 + u % 3));
    ASSERT_TRUE(db->signal_with_context({u, 1 + u % 5, 1.0}, {{1 + u % 4}}).ok());
  }
  for (std::uint64_t u = 1; u <= 10; ++u) ASSERT_OK(db->leave_community_layer(u));
  ASSERT_TRUE(eventually([&] { return confirmed(db.get(), *p); }, 30s)) << p->stats().last_error;
  ASSERT_OK(db->backup(dir.sub("backup")));
  const std::uint64_t backed_up = db->stats().journal_last_seq;
  // After the backup: leaves, rejoins and purges the copy lacks.
  for (std::uint64_t u = 11; u <= 20; ++u) ASSERT_OK(db->leave_community_layer(u));
  for (std::uint64_t u = 1; u <= 5; ++u) ASSERT_OK(db->rejoin_community_layer(u));
  for (std::uint64_t u = 6; u <= 8; ++u) {
    auto receipt = db->purge_community_contributions(u);
    ASSERT_TRUE(receipt.ok()) << receipt.status().to_string();
  }
  ASSERT_TRUE(eventually([&] { return confirmed(db.get(), *p); }, 30s)) << p->stats().last_error;
  EXPECT_OK(p->stop());
  const std::uint64_t stream_last = db->stats().journal_last_seq;
  ASSERT_GT(stream_last, backed_up);
  const std::string expected = statuses(db.get(), kUsers);
  ASSERT_OK(db->close());
  db.reset();

  // The shard's machine is lost; its backup is opened: recovering.
  auto restored = open_recover_db(dir.sub("backup"), 5);
  ASSERT_NE(restored, nullptr);
  ASSERT_TRUE(restored->stats().recovering);
  EXPECT_EQ(restored->leave_community_layer(25).code(), StatusCode::Busy);
  // Its journal publisher would halt: the stream is ahead of it.
  EXPECT_EQ(testing::refusal(JournalPublisher::start(restored.get(), config)).code(), StatusCode::InvalidArgument);

  ASSERT_OK(recover_shard(restored.get(), config));
  EXPECT_FALSE(restored->stats().recovering);
  EXPECT_EQ(statuses(restored.get(), kUsers), expected);
  ASSERT_OK(recover_shard(restored.get(), config));  // not recovering: nothing to do
  // The journal goes on where the stream ends, fenced as always.
  auto resumed = JournalPublisher::start(restored.get(), config);
  ASSERT_TRUE(resumed.ok()) << resumed.status().to_string();
  ASSERT_OK(restored->leave_community_layer(25));
  ASSERT_TRUE(eventually([&] { return confirmed(restored.get(), **resumed); }, 30s)) << (*resumed)->stats().last_error;
  EXPECT_EQ(restored->stats().journal_last_seq, stream_last + 1);
  EXPECT_FALSE((*resumed)->stats().halted);
  EXPECT_OK((*resumed)->stop());
}

TEST(NatsRecover, AJournalEntryMissingFromTheStreamLeavesTheShardRecoveringNamingTheSeqs) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = journal_test_config(cluster, "RECHOLE", 3);
  auto db = open_recover_db(dir.sub("db"), 6);
  ASSERT_NE(db, nullptr);
  for (std::uint64_t u = 1; u <= 10; ++u) ASSERT_OK(db->join_community(u, 1));
  ASSERT_OK(db->backup(dir.sub("backup")));
  for (std::uint64_t u = 1; u <= 10; ++u) ASSERT_OK(db->leave_community_layer(u));
  {
    auto p = JournalPublisher::start(db.get(), config);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    ASSERT_TRUE(eventually([&] { return confirmed(db.get(), **p); }, 30s)) << (*p)->stats().last_error;
    EXPECT_OK((*p)->stop());
  }
  ASSERT_OK(db->close());
  db.reset();
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  ASSERT_EQ(js_DeleteMsg(js.js(), "RECHOLE_J", 4, nullptr, nullptr), NATS_OK);

  auto restored = open_recover_db(dir.sub("backup"), 6);
  ASSERT_NE(restored, nullptr);
  Status s = recover_shard(restored.get(), config);
  EXPECT_EQ(s.code(), StatusCode::Corruption) << s.to_string();
  for (const char* word : {"shard 6", "stream RECHOLE_J", "entries 4..4 are missing"}) {
    EXPECT_NE(s.message().find(word), std::string::npos) << word << ": " << s.to_string();
  }
  // Still recovering: it serves nothing rather than forget a leave.
  EXPECT_TRUE(restored->stats().recovering);
  EXPECT_EQ(restored->leave_community_layer(1).code(), StatusCode::Busy);
}

#ifdef TIDAL_HAVE_TIDALCTL
// Runs `command`; its exit code and stdout.
std::pair<int, std::string> run(const std::string& command) {
  std::string out;
  FILE* p = ::popen(command.c_str(), "r");
  if (p == nullptr) return {-1, out};
  char buf[512];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// tidalctl restore --nats runs the whole procedure: the copy, the journal's
// replay from its stream, finish-recovery; a missing range fails closed.
TEST(NatsRecover, TidalctlRestoreWithNatsCopiesReplaysAndServesAgain) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = journal_test_config(cluster, "CTLRESTORE", 3);
  constexpr std::uint64_t kUsers = 20;
  std::string expected;
  {
    auto db = open_recover_db(dir.sub("db"), 8);
    ASSERT_NE(db, nullptr);
    auto p = JournalPublisher::start(db.get(), config);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    for (std::uint64_t u = 1; u <= kUsers; ++u) {
      ASSERT_OK(db->join_community(u, 1 + u % 3));
      ASSERT_TRUE(db->signal_with_context({u, 1 + u % 5, 1.0}, {{1 + u % 4}}).ok());
    }
    ASSERT_OK(db->backup(dir.sub("backup")));
    for (std::uint64_t u = 1; u <= 12; ++u) ASSERT_OK(db->leave_community_layer(u));
    for (std::uint64_t u = 1; u <= 3; ++u) ASSERT_OK(db->rejoin_community_layer(u));
    ASSERT_TRUE(db->purge_community_contributions(10).ok());
    ASSERT_TRUE(eventually([&] { return confirmed(db.get(), **p); }, 30s)) << (*p)->stats().last_error;
    EXPECT_OK((*p)->stop());
    expected = statuses(db.get(), kUsers);
    ASSERT_OK(db->close());
  }
  const std::string ctl = std::string(tidal::testing::paths::kTidalctl) + " --db ";
  const std::string nats = " --nats " + config.servers + " --journal-stream CTLRESTORE_J --journal-subject-prefix "
                           "tidal.CTLRESTORE_J";
  auto [rc, out] = run(ctl + dir.sub("restored") + " restore " + dir.sub("backup") + nats + " 2>&1");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("replayed 16 journal entries of shard 8 (seqs 1..16)"), std::string::npos) << out;
  EXPECT_NE(out.find("the Db serves again"), std::string::npos) << out;
  {
    auto restored = open_recover_db(dir.sub("restored"), 8);
    ASSERT_NE(restored, nullptr);
    EXPECT_FALSE(restored->stats().recovering);
    EXPECT_EQ(statuses(restored.get(), kUsers), expected);
    ASSERT_EQ(restored->purge_receipts(10)->size(), 1u);
  }
  // A stream without the shard's entries: the copy stays recovering.
  auto [rc2, out2] = run(ctl + dir.sub("restored2") + " restore " + dir.sub("backup") + " --nats " + config.servers +
                         " --journal-stream OTHER_J --journal-subject-prefix tidal.OTHER_J 2>&1");
  EXPECT_EQ(rc2, 1) << out2;
  EXPECT_NE(out2.find("is still recovering"), std::string::npos) << out2;
  auto stuck = open_recover_db(dir.sub("restored2"), 8);
  ASSERT_NE(stuck, nullptr);
  EXPECT_TRUE(stuck->stats().recovering);
}
#endif  // TIDAL_HAVE_TIDALCTL

// Issue 41 item 2: a backup of a dead lineage. B_dead was taken after a
// leave whose journal entry never reached the stream; the shard was then
// restored from an older backup and went on, and another leave was
// acknowledged and replicated at the seq B_dead's unreplicated leave holds.
// Restoring B_dead must not silently win: recover_shard compares the
// entries the copy holds but the stream never confirmed with the stream's,
// and refuses, naming the seq, with the copy still recovering (serving
// nothing). Red with the former recover_shard, which read the stream only
// after the copy's last seq: it returned OK and the copy served without the
// live lineage's leave.
TEST(NatsRecover, ABackupOfADeadLineageIsRefusedNamingTheSeqAndServesNothing) {
  NatsCluster cluster(1);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = journal_test_config(cluster, "LINEAGE", 1);
  auto db = open_recover_db(dir.sub("db"), 4);
  ASSERT_NE(db, nullptr);
  for (std::uint64_t u = 1; u <= 4; ++u) ASSERT_OK(db->join_community(u, 1));
  {
    auto p = JournalPublisher::start(db.get(), config);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    ASSERT_OK(db->leave_community_layer(1));  // seq 1, replicated
    ASSERT_TRUE(eventually([&] { return confirmed(db.get(), **p); }, 30s)) << (*p)->stats().last_error;
    EXPECT_OK((*p)->stop());
  }
  ASSERT_OK(db->backup(dir.sub("b_old")));
  ASSERT_OK(db->leave_community_layer(2));  // seq 2: never replicated
  ASSERT_OK(db->backup(dir.sub("b_dead")));
  ASSERT_OK(db->close());
  db.reset();

  // The shard is restored from the older backup and goes on: user 3's
  // leave is acknowledged and replicated at seq 2.
  {
    auto live = open_recover_db(dir.sub("b_old"), 4);
    ASSERT_NE(live, nullptr);
    ASSERT_OK(recover_shard(live.get(), config));
    auto p = JournalPublisher::start(live.get(), config);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    ASSERT_OK(live->leave_community_layer(3));
    ASSERT_EQ(live->stats().journal_last_seq, 2u);
    ASSERT_TRUE(eventually([&] { return confirmed(live.get(), **p); }, 30s)) << (*p)->stats().last_error;
    EXPECT_OK((*p)->stop());
    ASSERT_OK(live->close());
  }

  // The dead lineage's backup restored: refused, still recovering.
  auto dead = open_recover_db(dir.sub("b_dead"), 4);
  ASSERT_NE(dead, nullptr);
  ASSERT_TRUE(dead->stats().recovering);
  Status s = recover_shard(dead.get(), config);
  EXPECT_EQ(s.code(), StatusCode::Corruption) << s.to_string();
  EXPECT_NE(s.message().find("seq 2"), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find("tidalctl"), std::string::npos) << s.to_string();
  EXPECT_TRUE(dead->stats().recovering);
  EXPECT_EQ(dead->community_layer_status(3).status().code(), StatusCode::Busy);
  ASSERT_OK(dead->close());
}

}  // namespace
}  // namespace tidal::nats
