// tidal::nats::JournalPublisher against a real 3-node NATS JetStream cluster
// on loopback: a Db's privacy journal (leaves, rejoins, purge intents) in a
// stream of its own, confirm_journal after each ack (and journal_wait's
// leaves returning once published), the fence against a restored Db or a
// twin (never confirming), and the change feed's stream refusals.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nats/nats.h>

#include "../test_util.h"
#include "nats/client.h"
#include "nats/journal_stream.h"
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

// The change feed's and the journal's streams: "<name>" and "<name>_J" on
// tidal.<name>.* and tidal.<name>_J.* .
Config journal_test_config(const NatsCluster& cluster, const std::string& name) {
  Config c = testing::test_config(cluster, name, 3);
  c.journal_stream = name + "_J";
  c.journal_subject_prefix = "tidal." + name + "_J";
  return c;
}

Options journal_options(std::uint64_t shard, std::chrono::milliseconds wait = 0ms) {
  Options o = testing::shard_options(shard);
  o.journal = true;
  o.journal_wait = wait;
  return o;
}

std::unique_ptr<Db> open_journal_db(const std::string& path, std::uint64_t shard,
                                    std::chrono::milliseconds wait = 0ms) {
  auto db = Db::open(path, journal_options(shard, wait));
  EXPECT_TRUE(db.ok()) << db.status().to_string();
  return db.ok() ? std::move(*db) : nullptr;
}

// Leaves, rejoins and a purge of users first..first+n-1 (joined first); each
// changes state, so each appends one journal entry (the join none).
void privacy_events(Db* db, std::uint64_t first, std::uint64_t n) {
  for (std::uint64_t u = first; u < first + n; ++u) {
    ASSERT_OK(db->join_community(u, 1 + u % 3));
    ASSERT_TRUE(db->signal_with_context({u, 1 + u % 5, 1.0}, {{1 + u % 4}}).ok());
    ASSERT_OK(db->leave_community_layer(u));
    if (u % 3 == 0) {
      auto receipt = db->purge_community_contributions(u);
      ASSERT_TRUE(receipt.ok()) << receipt.status().to_string();
    } else if (u % 3 == 1) {
      ASSERT_OK(db->rejoin_community_layer(u));
    }
  }
}

// Every entry the Db's journal holds after `after`.
std::vector<JournalEntry> journal_after(Db* db, std::uint64_t after) {
  auto entries = db->read_journal(after, std::size_t{1} << 30);
  EXPECT_TRUE(entries.ok()) << entries.status().to_string();
  return entries.ok() ? std::move(*entries) : std::vector<JournalEntry>{};
}

// One stored message of a stream, as a test sees it.
struct Stored {
  std::string subject, shard, seq, log, msg_id, incarnation, payload;
};

std::string header(natsMsg* m, const char* name) {
  const char* v = nullptr;
  return natsMsgHeader_Get(m, name, &v) == NATS_OK && v != nullptr ? std::string(v) : std::string();
}

// Every message of `stream`, in stream order.
std::vector<Stored> stream_contents(Js& js, const std::string& stream) {
  std::vector<Stored> out;
  jsStreamInfo* si = js.info(stream);
  if (si == nullptr) return out;
  const std::uint64_t last = si->State.LastSeq;
  jsStreamInfo_Destroy(si);
  for (std::uint64_t at = 1; at <= last; ++at) {
    natsMsg* m = nullptr;
    if (js_GetMsg(&m, js.js(), stream.c_str(), at, nullptr, nullptr) != NATS_OK) continue;
    Stored s;
    s.subject = natsMsg_GetSubject(m);
    s.shard = header(m, "Tidal-Shard");
    s.seq = header(m, "Tidal-Seq");
    s.log = header(m, "Tidal-Log");
    s.msg_id = header(m, "Nats-Msg-Id");
    s.incarnation = header(m, "Tidal-Incarnation");
    s.payload.assign(natsMsg_GetData(m), static_cast<std::size_t>(natsMsg_GetDataLength(m)));
    natsMsg_Destroy(m);
    out.push_back(std::move(s));
  }
  return out;
}

// Waits until the journal is confirmed through its last seq, and the
// publisher has counted it (its lag, updated after the confirmation, too).
::testing::AssertionResult all_confirmed(Db* db, const JournalPublisher& p, std::chrono::milliseconds timeout = 30s) {
  if (eventually(
          [&] {
            Stats st = db->stats();
            const PublisherStats ps = p.stats();
            return st.journal_confirmed_seq == st.journal_last_seq && ps.published_seq == st.journal_last_seq &&
                   ps.last_change_seq == st.journal_last_seq && ps.lag_batches == 0;
          },
          timeout)) {
    return ::testing::AssertionSuccess();
  }
  Stats st = db->stats();
  return ::testing::AssertionFailure() << "confirmed " << st.journal_confirmed_seq << " of " << st.journal_last_seq
                                       << ", published " << p.stats().published_seq
                                       << "; last_error: " << p.stats().last_error;
}

TEST(NatsJournal, EveryLeaveRejoinAndPurgeIsPublishedInItsOwnStreamAndConfirmedAfterTheAck) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = journal_test_config(cluster, "JPUB");
  auto db = open_journal_db(dir.sub("db"), 4);
  ASSERT_NE(db, nullptr);
  privacy_events(db.get(), 1, 12);
  const std::vector<JournalEntry> written = journal_after(db.get(), 0);
  ASSERT_EQ(written.size(), 12u + 4u + 4u);  // 12 leaves, 4 rejoins, 4 purge intents
  EXPECT_EQ(db->stats().journal_confirmed_seq, 0u);

  auto started = JournalPublisher::start(db.get(), config);
  ASSERT_TRUE(started.ok()) << started.status().to_string();
  JournalPublisher& p = **started;
  ASSERT_TRUE(all_confirmed(db.get(), p));
  PublisherStats st = p.stats();
  EXPECT_EQ(st.shard_id, 4u);
  EXPECT_EQ(st.published_seq, written.size());
  EXPECT_EQ(st.last_change_seq, written.size());
  EXPECT_EQ(st.lag_batches, 0u);
  EXPECT_EQ(st.lag_bytes, 0u);
  EXPECT_FALSE(st.halted);
  EXPECT_EQ(db->stats().journal_pending_entries, 0u);

  // The journal's stream holds the entries, in order, with their headers;
  // the change feed's stream is not touched (no Publisher runs).
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  jsStreamInfo* si = js.info("JPUB_J");
  ASSERT_NE(si, nullptr);
  EXPECT_EQ(si->Config->Retention, js_LimitsPolicy);
  EXPECT_EQ(si->Config->Storage, js_FileStorage);
  EXPECT_EQ(si->Config->Discard, js_DiscardNew);
  EXPECT_EQ(si->Config->Replicas, 3);
  EXPECT_EQ(si->Config->MaxMsgsPerSubject, -1);
  ASSERT_EQ(si->Config->SubjectsLen, 1);
  EXPECT_EQ(std::string(si->Config->Subjects[0]), "tidal.JPUB_J.*");
  jsStreamInfo_Destroy(si);
  EXPECT_EQ(js.info("JPUB"), nullptr);
  const std::vector<Stored> stored = stream_contents(js, "JPUB_J");
  ASSERT_EQ(stored.size(), written.size());
  for (std::size_t i = 0; i < stored.size(); ++i) {
    const std::string seq = std::to_string(written[i].seq);
    EXPECT_EQ(stored[i].subject, "tidal.JPUB_J.4");
    EXPECT_EQ(stored[i].shard, "4");
    EXPECT_EQ(stored[i].seq, seq);
    EXPECT_EQ(stored[i].log, "journal");
    EXPECT_EQ(stored[i].msg_id, "j-4-" + seq);
    EXPECT_EQ(stored[i].incarnation, "");
    EXPECT_EQ(stored[i].payload, written[i].payload) << "seq " << seq;
  }

  // More events while it runs: confirmed as they are published.
  privacy_events(db.get(), 100, 6);
  ASSERT_TRUE(all_confirmed(db.get(), p));
  EXPECT_EQ(stream_contents(js, "JPUB_J").size(), db->stats().journal_last_seq);
  EXPECT_OK(p.stop());
  // Restarted: it resumes at the stream's end, publishing nothing twice.
  privacy_events(db.get(), 200, 3);
  auto again = JournalPublisher::start(db.get(), config);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  ASSERT_TRUE(all_confirmed(db.get(), **again));
  EXPECT_EQ((*again)->stats().duplicates, 0u);
  EXPECT_EQ(stream_contents(js, "JPUB_J").size(), db->stats().journal_last_seq);
  EXPECT_OK((*again)->stop());
}

TEST(NatsJournal, WithJournalWaitALeaveReturnsOkOncePublishedAndNotReplicatedWithoutAPublisher) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = journal_test_config(cluster, "JWAIT");
  auto db = open_journal_db(dir.sub("db"), 2, 5s);
  ASSERT_NE(db, nullptr);
  auto started = JournalPublisher::start(db.get(), config);
  ASSERT_TRUE(started.ok()) << started.status().to_string();
  auto p = std::move(*started);
  // Its stream made (a cluster just started may not place it at once), so
  // that each leave below waits only for its own entry's ack.
  ASSERT_TRUE(eventually([&] { return p->stats().connected; }, 30s)) << p->stats().last_error;
  for (std::uint64_t u = 1; u <= 20; ++u) {
    ASSERT_OK(db->join_community(u, 1));
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_OK(db->leave_community_layer(u));  // OK: the stream acknowledged its entry
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 4s);
    EXPECT_GE(db->stats().journal_confirmed_seq, db->stats().journal_last_seq);
    if (u % 2 == 0) ASSERT_OK(db->rejoin_community_layer(u));
  }
  auto receipt = db->purge_community_contributions(1);
  ASSERT_TRUE(receipt.ok()) << receipt.status().to_string();
  EXPECT_EQ(db->stats().journal_wait_timeouts, 0u);
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  EXPECT_EQ(stream_contents(js, "JWAIT_J").size(), db->stats().journal_last_seq);
  EXPECT_OK(p->stop());
  ASSERT_OK(db->close());
  db.reset();

  // Without a publisher, a short wait ends in NotReplicated (in effect
  // here); the publisher, started again, confirms it.
  db = open_journal_db(dir.sub("db"), 2, 300ms);
  ASSERT_NE(db, nullptr);
  ASSERT_OK(db->join_community(50, 1));
  EXPECT_EQ(db->leave_community_layer(50).code(), StatusCode::NotReplicated);
  const std::uint64_t last = db->stats().journal_last_seq;
  EXPECT_LT(db->stats().journal_confirmed_seq, last);
  auto again = JournalPublisher::start(db.get(), config);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  ASSERT_TRUE(all_confirmed(db.get(), **again));
  EXPECT_EQ(db->stats().journal_confirmed_seq, last);
  EXPECT_OK(db->leave_community_layer(50));  // the retry: nothing to wait for
  EXPECT_OK((*again)->stop());
}

// A Db restored from an older copy (or a twin): the stream is ahead of its
// journal, then holds another entry at the same seq. Either halts the
// publisher and nothing is confirmed.
TEST(NatsJournal, ARestoredDbHaltsThePublisherAndNeverConfirms) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = journal_test_config(cluster, "JFENCE");
  auto db = open_journal_db(dir.sub("db"), 6);
  ASSERT_NE(db, nullptr);
  privacy_events(db.get(), 1, 6);
  {
    auto p = JournalPublisher::start(db.get(), config);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    ASSERT_TRUE(all_confirmed(db.get(), **p));
    EXPECT_OK((*p)->stop());
  }
  // The backup: a copy of the closed Db, holding a journal confirmed through backed_up.
  const std::uint64_t backed_up = db->stats().journal_last_seq;
  ASSERT_OK(db->close());
  db.reset();
  std::filesystem::copy(dir.sub("db"), dir.sub("backup"), std::filesystem::copy_options::recursive);
  db = open_journal_db(dir.sub("db"), 6);
  ASSERT_NE(db, nullptr);
  privacy_events(db.get(), 10, 6);
  std::uint64_t stream_last = 0;
  {
    auto p = JournalPublisher::start(db.get(), config);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    ASSERT_TRUE(all_confirmed(db.get(), **p));
    EXPECT_OK((*p)->stop());
    stream_last = db->stats().journal_last_seq;
  }
  ASSERT_OK(db->close());
  db.reset();
  ASSERT_GT(stream_last, backed_up);

  // Restored: the stream holds seqs its journal never reached.
  auto restored = open_journal_db(dir.sub("backup"), 6);
  ASSERT_NE(restored, nullptr);
  const Status refused = testing::refusal(JournalPublisher::start(restored.get(), config));
  EXPECT_EQ(refused.code(), StatusCode::InvalidArgument) << refused.to_string();
  for (const std::string& word : std::vector<std::string>{"stream JFENCE_J", "shard 6", "up to seq " + std::to_string(stream_last),
                                  "privacy journal ends at seq " + std::to_string(backed_up), "nothing confirmed",
                                  "recover_shard"}) {
    EXPECT_NE(refused.message().find(word), std::string::npos) << word << ": " << refused.to_string();
  }

  // It takes new leaves (other users) until its journal passes the
  // stream's end: now the stream's entry of stream_last differs from its own.
  for (std::uint64_t u = 500; restored->stats().journal_last_seq <= stream_last; ++u) {
    ASSERT_OK(restored->join_community(u, 1));
    ASSERT_OK(restored->leave_community_layer(u));
  }
  const std::uint64_t restored_last = restored->stats().journal_last_seq;
  const std::vector<JournalEntry> unconfirmed = journal_after(restored.get(), backed_up);
  ASSERT_EQ(unconfirmed.size(), restored_last - backed_up);
  auto halted = JournalPublisher::start(restored.get(), config);
  Status st;
  if (halted.ok()) {  // found after start returned: halted all the same
    ASSERT_TRUE(eventually([&] { return (*halted)->stats().halted; }, 20s)) << (*halted)->stats().last_error;
    st = (*halted)->stop();
  } else {
    st = halted.status();
  }
  EXPECT_EQ(st.code(), StatusCode::Corruption) << st.to_string();
  for (const std::string& word : std::vector<std::string>{std::string("shard 6"), std::string("stream JFENCE_J"),
                                  "entry of seq " + std::to_string(stream_last), std::string("differs"),
                                  std::string("nothing confirmed")}) {
    EXPECT_NE(st.message().find(word), std::string::npos) << word << ": " << st.to_string();
  }
  // Never confirmed: the restored Db keeps every entry after the backup.
  EXPECT_EQ(restored->stats().journal_confirmed_seq, backed_up);
  const std::vector<JournalEntry> kept = journal_after(restored.get(), backed_up);
  ASSERT_EQ(kept.size(), unconfirmed.size());
  for (std::size_t i = 0; i < kept.size(); ++i) EXPECT_EQ(kept[i].payload, unconfirmed[i].payload);
  // The stream still holds the original Db's entries only.
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  EXPECT_EQ(stream_contents(js, "JFENCE_J").size(), stream_last);
}

TEST(NatsJournal, TheJournalStreamIsRefusedAsTheChangeFeedsIsAndNeedsANameOfItsOwn) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  auto db = open_journal_db(dir.sub("db"), 1);
  ASSERT_NE(db, nullptr);
  ASSERT_OK(db->join_community(1, 1));
  ASSERT_OK(db->leave_community_layer(1));
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  ASSERT_EQ(js.add_stream("JINTEREST", [](jsStreamConfig& sc) { sc.Retention = js_InterestPolicy; }), "");
  Config c = testing::test_config(cluster, "FEED", 3);
  c.journal_stream = "JINTEREST";
  c.journal_subject_prefix = "tidal.JINTEREST";
  const Status p = testing::refusal(JournalPublisher::start(db.get(), c));
  const std::string m = p.message();
  EXPECT_EQ(p.code(), StatusCode::InvalidArgument) << m;
  EXPECT_NE(m.find("stream JINTEREST"), std::string::npos) << m;
  EXPECT_NE(m.find("NATS server nats://127.0.0.1:"), std::string::npos) << m;
  EXPECT_NE(m.find("interest retention"), std::string::npos) << m;
  EXPECT_EQ(db->stats().journal_confirmed_seq, 0u);

  // The change feed's stream or prefix: refused before any request.
  Config same = c;
  same.journal_stream = same.stream;
  EXPECT_EQ(JournalPublisher::start(db.get(), same).status().code(), StatusCode::InvalidArgument);
  same = c;
  same.journal_subject_prefix = same.subject_prefix;
  auto r = JournalPublisher::start(db.get(), same);
  EXPECT_EQ(r.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(r.status().message().find("journal_subject_prefix"), std::string::npos) << r.status().to_string();
  Config bad = c;
  bad.journal_stream = "A.B";
  r = JournalPublisher::start(db.get(), bad);
  EXPECT_NE(r.status().message().find("journal_stream 'A.B'"), std::string::npos) << r.status().to_string();
  // A Db without a journal.
  auto plain = Db::open(dir.sub("plain"), testing::shard_options(2));
  ASSERT_TRUE(plain.ok());
  r = JournalPublisher::start(plain->get(), c);
  EXPECT_EQ(r.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(r.status().message().find("Options::journal"), std::string::npos) << r.status().to_string();
  EXPECT_EQ(JournalPublisher::start(nullptr, c).status().code(), StatusCode::InvalidArgument);
}

// Publishes `data` on `subject` with tidal's headers (`log`: the Tidal-Log
// header, none if empty) and message id `id`, as another writer would.
void publish_foreign(Js& js, const std::string& subject, const std::string& data, const std::string& shard,
                     const std::string& seq, const std::string& log, const std::string& id) {
  natsMsg* m = nullptr;
  ASSERT_EQ(natsMsg_Create(&m, subject.c_str(), nullptr, data.data(), static_cast<int>(data.size())), NATS_OK);
  ASSERT_EQ(natsMsgHeader_Set(m, "Tidal-Shard", shard.c_str()), NATS_OK);
  ASSERT_EQ(natsMsgHeader_Set(m, "Tidal-Seq", seq.c_str()), NATS_OK);
  if (!log.empty()) {
    ASSERT_EQ(natsMsgHeader_Set(m, "Tidal-Log", log.c_str()), NATS_OK);
  }
  jsPubOptions po;
  jsPubOptions_Init(&po);
  po.MsgId = id.c_str();
  ASSERT_EQ(testing::publish_retrying(js.js(), m, &po), NATS_OK);
  natsMsg_Destroy(m);
}

TEST(NatsJournal, AReusedIdOrAMessageOfAnotherLogOnTheSubjectHaltsItAndNothingIsConfirmed) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  TempDir dir;
  auto db = open_journal_db(dir.sub("db"), 9);
  ASSERT_NE(db, nullptr);
  ASSERT_OK(db->join_community(1, 1));
  ASSERT_OK(db->leave_community_layer(1));
  ASSERT_EQ(db->stats().journal_last_seq, 1u);

  // Another writer stored the id of shard 9's first entry with other content.
  ASSERT_EQ(js.add_stream("JDUP", [](jsStreamConfig&) {}), "");
  publish_foreign(js, "tidal.JDUP.elsewhere", "not the Db's entry", "9", "1", "journal", "j-9-1");
  Config c = testing::test_config(cluster, "FEED", 3);
  c.journal_stream = "JDUP";
  c.journal_subject_prefix = "tidal.JDUP";
  Status dup = testing::refusal(JournalPublisher::start(db.get(), c));
  EXPECT_EQ(dup.code(), StatusCode::Corruption) << dup.to_string();
  for (const char* word : {"shard 9", "stream JDUP", "id j-9-1", "duplicate", "nothing confirmed"}) {
    EXPECT_NE(dup.message().find(word), std::string::npos) << word << ": " << dup.to_string();
  }
  EXPECT_EQ(db->stats().journal_confirmed_seq, 0u);

  // A change feed's batch (no Tidal-Log header) last on the shard's subject.
  ASSERT_EQ(js.add_stream("JOTHER", [](jsStreamConfig&) {}), "");
  publish_foreign(js, "tidal.JOTHER.9", "a batch", "9", "1", "", "9-1");
  c.journal_stream = "JOTHER";
  c.journal_subject_prefix = "tidal.JOTHER";
  Status other = testing::refusal(JournalPublisher::start(db.get(), c));
  EXPECT_EQ(other.code(), StatusCode::Corruption) << other.to_string();
  for (const char* word : {"shard 9", "stream JOTHER", "Tidal-Log ''", "another tidal log", "nothing confirmed"}) {
    EXPECT_NE(other.message().find(word), std::string::npos) << word << ": " << other.to_string();
  }
  EXPECT_EQ(db->stats().journal_confirmed_seq, 0u);
  EXPECT_EQ(db->read_journal(0, 1 << 20)->size(), 1u);
}

// What recover_shard reads: a shard's entries after a seq, in order, from
// the journal's stream; a hole in them is Corruption naming the seqs.
TEST(NatsJournal, TheStreamReadsBackAShardsEntriesAfterASeqAndAHoleIsCorruption) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = journal_test_config(cluster, "JREAD");
  auto db = open_journal_db(dir.sub("db"), 8);
  ASSERT_NE(db, nullptr);
  privacy_events(db.get(), 1, 12);
  const std::vector<JournalEntry> written = journal_after(db.get(), 0);
  ASSERT_EQ(written.size(), 20u);
  {
    auto p = JournalPublisher::start(db.get(), config);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    ASSERT_TRUE(all_confirmed(db.get(), **p));
    EXPECT_OK((*p)->stop());
  }
  Result<Config> jc = internal::journal_config(config);
  ASSERT_TRUE(jc.ok());
  internal::Connection conn;
  ASSERT_OK(conn.connect(*jc, "test-reader"));
  auto same = [&](const std::vector<JournalEntry>& got, std::size_t from) {
    ASSERT_EQ(got.size(), written.size() - from);
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].shard_id, 8u);
      EXPECT_EQ(got[i].seq, written[from + i].seq);
      EXPECT_EQ(got[i].payload, written[from + i].payload);
    }
  };
  for (std::size_t after : {0u, 7u, 19u, 20u}) {
    auto got = internal::read_journal_stream(conn, *jc, 8, after);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    same(*got, after);
  }
  // Another shard has nothing, and a Db ahead of the stream reads nothing:
  // entries it holds that the stream lacks were never replicated (a backup
  // taken before they were published), and its publisher sends them. A
  // stream that does not exist is NotFound, never an empty read (a
  // recovery with a wrong stream name would pass).
  for (std::uint64_t after : {0u, 3u}) {
    auto none = internal::read_journal_stream(conn, *jc, 9, after);
    ASSERT_TRUE(none.ok()) << none.status().to_string();
    EXPECT_TRUE(none->empty());
  }
  auto none = internal::read_journal_stream(conn, *jc, 8, 25);
  ASSERT_TRUE(none.ok()) << none.status().to_string();
  EXPECT_TRUE(none->empty());
  Config missing = *jc;
  missing.stream = "NOSUCH";
  none = internal::read_journal_stream(conn, missing, 8, 0);
  EXPECT_EQ(none.status().code(), StatusCode::NotFound) << none.status().to_string();
  EXPECT_NE(none.status().message().find("stream NOSUCH"), std::string::npos) << none.status().to_string();

  // Entry 10 deleted from the stream: a read that needs it is Corruption.
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  ASSERT_EQ(js_DeleteMsg(js.js(), "JREAD_J", 10, nullptr, nullptr), NATS_OK);
  auto holed = internal::read_journal_stream(conn, *jc, 8, 5);
  ASSERT_FALSE(holed.ok());
  EXPECT_EQ(holed.status().code(), StatusCode::Corruption) << holed.status().to_string();
  for (const char* word : {"stream JREAD_J", "shard 8", "entries 10..10 are missing"}) {
    EXPECT_NE(holed.status().message().find(word), std::string::npos) << word << ": " << holed.status().to_string();
  }
  auto past = internal::read_journal_stream(conn, *jc, 8, 10);
  ASSERT_TRUE(past.ok()) << past.status().to_string();
  same(*past, 10);
}

}  // namespace
}  // namespace tidal::nats
