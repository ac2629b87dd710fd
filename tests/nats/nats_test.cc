// tidal::nats against a real 3-node NATS JetStream cluster on loopback
// (Debian's nats-server, started and killed by the tests): convergence of
// views through faults, SIGKILLed shard and follower processes, an
// unavailable cluster, a view joining from a checkpoint, gaps reported and
// never skipped, and clear errors for bad configs and mismatched streams.
// docs/CONTRACT.md ("NATS JetStream") lists each guarantee with its test.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nats/nats.h>

#include "../prometheus_parse.h"
#include "../test_util.h"
#include "child_process.h"
#include "fault_fs.h"
#include "nats_cluster.h"
#include "nats_test_util.h"
#include "start_refusal.h"
#include "tidal/nats.h"
#include "view/global_view_impl.h"

namespace tidal::nats {
namespace {

using namespace std::chrono_literals;
using tidal::testing::TempDir;
using testing::Js;
using testing::NatsCluster;
using testing::caught_up;
using testing::compare;
using testing::eventually;
using testing::shard_options;
using testing::test_config;
using testing::Workload;

std::unique_ptr<Db> open_shard(const std::string& path, std::uint64_t shard) {
  auto db = Db::open(path, shard_options(shard));
  EXPECT_TRUE(db.ok()) << db.status().to_string();
  return db.ok() ? std::move(*db) : nullptr;
}

std::unique_ptr<GlobalView> open_view(const std::string& path) {
  auto v = GlobalView::open(path);
  EXPECT_TRUE(v.ok()) << v.status().to_string();
  return v.ok() ? std::move(*v) : nullptr;
}

std::unique_ptr<Publisher> start_publisher(Db* db, const Config& c) {
  auto p = Publisher::start(db, c);
  EXPECT_TRUE(p.ok()) << p.status().to_string();
  return p.ok() ? std::move(*p) : nullptr;
}

std::unique_ptr<Follower> start_follower(GlobalView* v, const Config& c, const std::string& name) {
  auto f = Follower::start(v, c, name);
  EXPECT_TRUE(f.ok()) << f.status().to_string();
  return f.ok() ? std::move(*f) : nullptr;
}

std::vector<Db*> raw(const std::vector<std::unique_ptr<Db>>& dbs) {
  std::vector<Db*> out;
  for (const auto& d : dbs) out.push_back(d.get());
  return out;
}

// Flushes every shard, then waits until `view` applied all of it.
::testing::AssertionResult converge(const std::vector<Db*>& shards, const GlobalView& view, const Follower& f,
                                    std::chrono::milliseconds timeout = 60s) {
  for (Db* db : shards) {
    Status s = db->flush();
    if (!s.ok()) return ::testing::AssertionFailure() << "flush: " << s.to_string();
  }
  if (eventually([&] { return caught_up(shards, view); }, timeout)) return ::testing::AssertionSuccess();
  FollowerStats st = f.stats();
  auto out = ::testing::AssertionFailure() << "the view did not catch up; follower: last_error '" << st.last_error
                                           << "', gaps " << st.gaps << ", applied";
  for (const ShardProgress& p : st.applied) out << " " << p.shard_id << ":" << p.applied_seq;
  out << "; shards";
  for (Db* db : shards) out << " " << db->stats().change_feed_shard_id << ":" << db->stats().change_feed_last_seq;
  return out;
}

// Calls `read` with the stream's info, as the cluster reports it now (not
// at all when it cannot be read).
void read_stream_info(const NatsCluster& cluster, const std::string& stream,
                      const std::function<void(const jsStreamInfo&)>& read) {
  natsConnection* nc = nullptr;
  jsCtx* js = nullptr;
  if (natsConnection_ConnectTo(&nc, cluster.servers().c_str()) != NATS_OK) return;
  jsStreamInfo* si = nullptr;
  if (natsConnection_JetStream(&js, nc, nullptr) == NATS_OK &&
      js_GetStreamInfo(&si, js, stream.c_str(), nullptr, nullptr) == NATS_OK) {
    read(*si);
  }
  if (si != nullptr) jsStreamInfo_Destroy(si);
  if (js != nullptr) jsCtx_Destroy(js);
  natsConnection_Destroy(nc);
}

// The name of the server leading `stream` ("n0", ...), or "" if unknown.
std::string stream_leader(const NatsCluster& cluster, const std::string& stream) {
  std::string leader;
  read_stream_info(cluster, stream, [&](const jsStreamInfo& si) {
    if (si.Cluster != nullptr && si.Cluster->Leader != nullptr) leader = si.Cluster->Leader;
  });
  return leader;
}

// Messages the stream holds.
std::uint64_t stream_messages(const NatsCluster& cluster, const std::string& stream) {
  std::uint64_t n = 0;
  read_stream_info(cluster, stream, [&](const jsStreamInfo& si) { n = si.State.Msgs; });
  return n;
}

// Bytes the stream holds (payloads, headers and JetStream's own).
std::uint64_t stream_bytes(const NatsCluster& cluster, const std::string& stream) {
  std::uint64_t n = 0;
  read_stream_info(cluster, stream, [&](const jsStreamInfo& si) { n = si.State.Bytes; });
  return n;
}

// A child process of tests/nats/nats_child.cc.
class Child : public testing::Child {
 public:
  explicit Child(const std::vector<std::string>& args) : testing::Child(tidal::testing::paths::kNatsChild, args) {}
};

// ---- Bad input: clear errors, no cluster needed ----

TEST(NatsConfig, BadConfigsAreInvalidArgumentNamingTheField) {
  TempDir dir;
  auto db = open_shard(dir.sub("db"), 1);
  ASSERT_NE(db, nullptr);
  auto expect_invalid = [&](const Config& c, const std::string& word) {
    auto p = Publisher::start(db.get(), c);
    ASSERT_FALSE(p.ok());
    EXPECT_EQ(p.status().code(), StatusCode::InvalidArgument);
    EXPECT_NE(p.status().message().find(word), std::string::npos) << p.status().to_string();
  };
  Config c;
  c.servers = " , ";
  expect_invalid(c, "servers");
  c = Config{};
  c.replicas = 0;
  expect_invalid(c, "replicas");
  c.replicas = 6;
  expect_invalid(c, "replicas");
  c = Config{};
  c.stream = "a.b";
  expect_invalid(c, "stream");
  c = Config{};
  c.subject_prefix = "x.*";
  expect_invalid(c, "subject_prefix");

  auto null_db = Publisher::start(nullptr, Config{});
  EXPECT_EQ(null_db.status().code(), StatusCode::InvalidArgument);

  TempDir plain;
  auto no_feed = tidal::testing::open_db(plain.sub("db"));
  ASSERT_NE(no_feed, nullptr);
  auto p = Publisher::start(no_feed.get(), Config{});
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("change feed"), std::string::npos) << p.status().to_string();

  auto view = open_view(dir.sub("view"));
  ASSERT_NE(view, nullptr);
  for (std::string name : {"", "a.b", "a b", "x>"}) {
    auto f = Follower::start(view.get(), Config{}, name);
    EXPECT_EQ(f.status().code(), StatusCode::InvalidArgument) << "'" << name << "'";
  }
  // A read-only view cannot take a Follower (issue 27 item 6: its thread
  // used to start and refuse every message, for ever).
  ASSERT_OK(view->close());
  GlobalViewOptions ro;
  ro.read_only = true;
  Result<std::unique_ptr<GlobalView>> reader = GlobalView::open(dir.sub("view"), ro);
  ASSERT_OK(reader.status());
  EXPECT_TRUE((*reader)->read_only());
  auto f = Follower::start(reader->get(), Config{}, "reader");
  EXPECT_EQ(f.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(f.status().message().find("read-only"), std::string::npos) << f.status().to_string();
}

TEST(NatsStream, AStreamWhoseSubjectsDoNotMatchIsInvalidArgumentNamingServerAndStream) {
  NatsCluster cluster(1);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  // Someone else's stream under the name tidal would use.
  natsConnection* nc = nullptr;
  jsCtx* js = nullptr;
  ASSERT_EQ(natsConnection_ConnectTo(&nc, cluster.servers().c_str()), NATS_OK);
  ASSERT_EQ(natsConnection_JetStream(&js, nc, nullptr), NATS_OK);
  jsStreamConfig sc;
  jsStreamConfig_Init(&sc);
  const char* subjects[] = {"orders.*"};
  sc.Name = "MISMATCH";
  sc.Subjects = subjects;
  sc.SubjectsLen = 1;
  ASSERT_EQ(js_AddStream(nullptr, js, &sc, nullptr, nullptr), NATS_OK);
  jsCtx_Destroy(js);
  natsConnection_Destroy(nc);

  TempDir dir;
  auto db = open_shard(dir.sub("db"), 1);
  Config c = test_config(cluster, "MISMATCH", 1);
  const Status p = testing::refusal(Publisher::start(db.get(), c));
  EXPECT_EQ(p.code(), StatusCode::InvalidArgument) << p.to_string();
  EXPECT_NE(p.message().find("stream MISMATCH"), std::string::npos) << p.to_string();
  EXPECT_NE(p.message().find(cluster.url(0)), std::string::npos) << p.to_string();
  EXPECT_NE(p.message().find("orders.*"), std::string::npos) << p.to_string();

  // A matching stream name is created, with its subjects, and works.
  Config ok = test_config(cluster, "FRESH", 1);
  auto good = Publisher::start(db.get(), ok);
  ASSERT_TRUE(good.ok()) << good.status().to_string();
  EXPECT_TRUE(eventually([&] { return (*good)->stats().connected; }, 10s)) << (*good)->stats().last_error;
  EXPECT_OK((*good)->stop());
}

// ---- Streams that cannot drop an acknowledged batch ----

TEST(NatsStream, ATidalStreamHasLimitsRetentionDiscardNewTheConfiguredReplicasWindowAndLimits) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  auto db = open_shard(dir.sub("db"), 1);
  ASSERT_NE(db, nullptr);
  Config c = test_config(cluster, "MADE", 3);
  c.duplicate_window = 90s;
  c.stream_max_bytes = std::int64_t{1} << 30;
  c.stream_max_age = std::chrono::hours(24 * 7);
  auto p = start_publisher(db.get(), c);
  ASSERT_NE(p, nullptr);
  ASSERT_TRUE(eventually([&] { return p->stats().connected; }, 20s)) << p->stats().last_error;
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  jsStreamInfo* si = js.info("MADE");
  ASSERT_NE(si, nullptr);
  const jsStreamConfig& sc = *si->Config;
  EXPECT_EQ(sc.Retention, js_LimitsPolicy);
  EXPECT_EQ(sc.Storage, js_FileStorage);
  EXPECT_EQ(sc.Discard, js_DiscardNew);
  EXPECT_EQ(sc.Replicas, 3);
  EXPECT_EQ(sc.Duplicates, std::chrono::nanoseconds(90s).count());
  EXPECT_EQ(sc.MaxBytes, std::int64_t{1} << 30);
  EXPECT_EQ(sc.MaxAge, std::chrono::nanoseconds(std::chrono::hours(24 * 7)).count());
  EXPECT_EQ(sc.MaxMsgsPerSubject, -1);
  EXPECT_EQ(sc.MaxMsgs, -1);
  jsStreamInfo_Destroy(si);
  EXPECT_OK(p->stop());

  // The defaults: 3 replicas, a 2 min window, no size or age limit.
  EXPECT_EQ(Config{}.replicas, 3);
  Config d = test_config(cluster, "DEFAULTS", Config{}.replicas);
  auto q = start_publisher(db.get(), d);
  ASSERT_NE(q, nullptr);
  ASSERT_TRUE(eventually([&] { return q->stats().connected; }, 20s)) << q->stats().last_error;
  si = js.info("DEFAULTS");
  ASSERT_NE(si, nullptr);
  EXPECT_EQ(si->Config->Replicas, 3);
  EXPECT_EQ(si->Config->Discard, js_DiscardNew);
  EXPECT_EQ(si->Config->Duplicates, std::chrono::nanoseconds(2min).count());
  EXPECT_LE(si->Config->MaxBytes, 0);
  EXPECT_EQ(si->Config->MaxAge, 0);
  jsStreamInfo_Destroy(si);
  EXPECT_OK(q->stop());

  // A window longer than the max age: refused before any request.
  Config bad = c;
  bad.stream = "LONGWINDOW";
  bad.stream_max_age = 60s;
  bad.duplicate_window = 120s;
  auto r = Publisher::start(db.get(), bad);
  EXPECT_EQ(r.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(r.status().message().find("duplicate_window"), std::string::npos) << r.status().to_string();
}

TEST(NatsStream, AStreamThatCouldDropAnAcknowledgedBatchIsRefusedNamingServerStreamAndSetting) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  TempDir dir;
  auto db = open_shard(dir.sub("db"), 1);
  ASSERT_NE(db, nullptr);
  ASSERT_TRUE(db->signal_with_context({1, 1, 1.0}, {{1}}).ok());
  ASSERT_OK(db->flush());
  ASSERT_EQ(*db->last_change_seq(), 1u);
  struct Case {
    std::string stream;
    std::function<void(jsStreamConfig&)> edit;
    std::string setting;  // a word the error must hold
  };
  const std::int64_t hour = std::chrono::nanoseconds(std::chrono::hours(1)).count();
  const std::vector<Case> cases = {
      {"INTEREST", [](jsStreamConfig& sc) { sc.Retention = js_InterestPolicy; }, "interest retention"},
      {"WORKQ", [](jsStreamConfig& sc) { sc.Retention = js_WorkQueuePolicy; }, "work-queue retention"},
      {"OLDBYTES", [](jsStreamConfig& sc) { sc.Discard = js_DiscardOld; sc.MaxBytes = 1 << 30; }, "max_bytes"},
      {"OLDAGE", [&](jsStreamConfig& sc) { sc.Discard = js_DiscardOld; sc.MaxAge = hour; }, "max_age"},
      {"OLDMSGS", [](jsStreamConfig& sc) { sc.Discard = js_DiscardOld; sc.MaxMsgs = 1000000; }, "max_msgs"},
      {"OLDPERSUBJ", [](jsStreamConfig& sc) { sc.Discard = js_DiscardOld; sc.MaxMsgsPerSubject = 1000; },
       "max_msgs_per_subject"},
      {"NEWPERSUBJ", [](jsStreamConfig& sc) { sc.MaxMsgsPerSubject = 1000; }, "max_msgs_per_subject"},
      {"NEWAGE", [&](jsStreamConfig& sc) { sc.MaxAge = hour; }, "max_age"},
      {"MEMORY", [](jsStreamConfig& sc) { sc.Storage = js_MemoryStorage; }, "memory storage"},
      {"ONEREPLICA", [](jsStreamConfig& sc) { sc.Replicas = 1; }, "1 replicas, fewer than Config::replicas (3)"},
  };
  for (const Case& k : cases) {
    ASSERT_EQ(js.add_stream(k.stream, k.edit), "") << k.stream;
    const Status p = testing::refusal(Publisher::start(db.get(), test_config(cluster, k.stream, 3)));
    if (p.ok()) {
      ADD_FAILURE() << k.stream << " was accepted";
      continue;
    }
    const std::string m = p.message();
    EXPECT_EQ(p.code(), StatusCode::InvalidArgument) << m;
    EXPECT_NE(m.find("stream " + k.stream), std::string::npos) << m;
    EXPECT_NE(m.find("NATS server nats://127.0.0.1:"), std::string::npos) << m;
    EXPECT_NE(m.find(k.setting), std::string::npos) << m;
    EXPECT_EQ(db->stats().change_feed_trimmed_seq, 0u) << k.stream;
  }

  // What can drop nothing is accepted: discard-new with a size limit, and a
  // max_age the config allows.
  ASSERT_EQ(js.add_stream("NEWLIMITS", [&](jsStreamConfig& sc) { sc.MaxBytes = 1 << 30; sc.MaxAge = 48 * hour; }), "");
  Config ok = test_config(cluster, "NEWLIMITS", 3);
  ok.stream_max_age = std::chrono::hours(24);
  auto p = start_publisher(db.get(), ok);
  ASSERT_NE(p, nullptr);
  EXPECT_TRUE(eventually([&] { return p->stats().published_seq == 1; }, 20s)) << p->stats().last_error;
  EXPECT_OK(p->stop());
  EXPECT_EQ(db->stats().change_feed_trimmed_seq, 1u);
}

// ---- Fenced publishing: a twin, a restored Db, a reused message id ----

// Waits until `db` published everything it wrote (after a flush).
::testing::AssertionResult all_published(Db* db, const Publisher& p, std::chrono::milliseconds timeout = 30s) {
  if (Status s = db->flush(); !s.ok()) return ::testing::AssertionFailure() << "flush: " << s.to_string();
  if (eventually([&] { return p.stats().published_seq == *db->last_change_seq(); }, timeout)) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "published " << p.stats().published_seq << " of "
                                       << *db->last_change_seq() << "; last_error: " << p.stats().last_error;
}

// Every batch the Db's feed holds after `after`, concatenated with its seq.
std::string feed_after(Db* db, std::uint64_t after) {
  auto batches = db->read_changes(after, std::size_t{1} << 30);
  if (!batches.ok()) return "error: " + batches.status().to_string();
  std::string out;
  for (const ChangeBatch& b : *batches) out += std::to_string(b.seq) + ":" + b.payload + "|";
  return out;
}

void copy_dir(const std::string& from, const std::string& to) {
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive);
}

TEST(NatsFence, AMessageIdStoredWithOtherContentIsCorruptionAndNothingIsTrimmed) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  ASSERT_EQ(js.add_stream("DUPID", [](jsStreamConfig&) {}), "");
  TempDir dir;
  auto db = open_shard(dir.sub("db"), 9);
  ASSERT_NE(db, nullptr);
  const std::string id = "9-1-" + db->stats().change_feed_incarnation;
  // Another writer publishes the id of shard 9's first batch with other content.
  natsMsg* m = nullptr;
  ASSERT_EQ(natsMsg_Create(&m, "tidal.DUPID.elsewhere", nullptr, "not the Db's batch", 18), NATS_OK);
  ASSERT_EQ(natsMsgHeader_Set(m, "Tidal-Shard", "9"), NATS_OK);
  ASSERT_EQ(natsMsgHeader_Set(m, "Tidal-Seq", "1"), NATS_OK);
  jsPubOptions po;
  jsPubOptions_Init(&po);
  po.MsgId = id.c_str();
  ASSERT_EQ(testing::publish_retrying(js.js(), m, &po), NATS_OK);
  natsMsg_Destroy(m);

  ASSERT_TRUE(db->signal_with_context({1, 1, 2.5}, {{3}}).ok());
  ASSERT_OK(db->flush());
  const std::string before = feed_after(db.get(), 0);
  ASSERT_NE(before, "");
  auto p = Publisher::start(db.get(), test_config(cluster, "DUPID", 3));
  Status stopped;
  if (p.ok()) {  // the fence is found at the first publish, after start returned
    ASSERT_TRUE(eventually([&] { return (*p)->stats().halted; }, 20s)) << (*p)->stats().last_error;
    PublisherStats st = (*p)->stats();
    EXPECT_EQ(st.published_seq, 0u);
    EXPECT_EQ(st.duplicates, 1u);
    stopped = (*p)->stop();
  } else {
    stopped = p.status();
  }
  EXPECT_EQ(stopped.code(), StatusCode::Corruption) << stopped.to_string();
  for (const std::string& word : {std::string("shard 9"), std::string("stream DUPID"), std::string("seq 1"), "id " + id,
                                 std::string("duplicate"), std::string("nothing trimmed")}) {
    EXPECT_NE(stopped.message().find(word), std::string::npos) << word << ": " << stopped.to_string();
  }
  EXPECT_EQ(db->stats().change_feed_trimmed_seq, 0u);
  EXPECT_EQ(feed_after(db.get(), 0), before);
}

TEST(NatsFence, ATwinWithTheSameShardIdStopsAndNoBatchOfEitherIsLost) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  Config config = test_config(cluster, "TWIN", 3);
  // A short de-duplication window, so that only the fence can tell the twin's
  // batches from the first Db's (their ids are the same).
  config.duplicate_window = 1s;
  auto a = open_shard(dir.sub("a"), 7);
  ASSERT_NE(a, nullptr);
  Workload wa(51, 40);
  ASSERT_EQ(wa.setup({a.get()}, nullptr), "");
  for (int i = 0; i < 300; ++i) ASSERT_EQ(wa.step({a.get()}, nullptr), "");
  {
    auto pa = start_publisher(a.get(), config);
    ASSERT_NE(pa, nullptr);
    ASSERT_TRUE(all_published(a.get(), *pa));
    EXPECT_OK(pa->stop());
  }
  // The twin: a copy of the Db, opened beside it with the same shard id.
  ASSERT_OK(a->close());
  a.reset();
  copy_dir(dir.sub("a"), dir.sub("b"));
  a = open_shard(dir.sub("a"), 7);
  auto b = open_shard(dir.sub("b"), 7);
  ASSERT_TRUE(a && b);
  const std::uint64_t shared = *a->last_change_seq();
  ASSERT_EQ(a->stats().change_feed_trimmed_seq, shared);
  ASSERT_EQ(b->stats().change_feed_trimmed_seq, shared);
  // Both connect while the stream ends where both Dbs agree.
  auto pa = start_publisher(a.get(), config);
  auto pb = start_publisher(b.get(), config);
  ASSERT_TRUE(pa && pb);
  ASSERT_TRUE(eventually([&] { return pa->stats().connected && pb->stats().connected; }, 20s));
  // A goes on and publishes; then, once the window forgot A's ids, B writes other batches.
  for (int i = 0; i < 300; ++i) ASSERT_EQ(wa.step({a.get()}, nullptr), "");
  ASSERT_TRUE(all_published(a.get(), *pa));
  std::this_thread::sleep_for(3s);
  Workload wb(52, 40);
  for (int i = 0; i < 300; ++i) ASSERT_EQ(wb.step({b.get()}, nullptr), "");
  ASSERT_OK(b->flush());
  ASSERT_GT(*b->last_change_seq(), shared);
  ASSERT_TRUE(eventually([&] { return pb->stats().halted; }, 20s)) << pb->stats().last_error;
  Status sb = pb->stop();
  EXPECT_EQ(sb.code(), StatusCode::Corruption) << sb.to_string();
  for (const std::string& word : std::vector<std::string>{"shard 7", "stream TWIN", "seq " + std::to_string(shared + 1), "another writer",
                                 "nothing trimmed"}) {
    EXPECT_NE(sb.message().find(word), std::string::npos) << word << ": " << sb.to_string();
  }
  // Nothing of B's trimmed: its feed holds every batch after what both share.
  EXPECT_EQ(b->stats().change_feed_trimmed_seq, shared);
  EXPECT_EQ(b->read_changes(shared, std::size_t{1} << 30)->size(), *b->last_change_seq() - shared);
  EXPECT_EQ(pb->stats().published_seq, shared);
  // A keeps publishing, and a view of the stream is A, bit for bit: no batch
  // of B's in it (it would be a batch of A's seq, skipped or mixed in).
  for (int i = 0; i < 200; ++i) ASSERT_EQ(wa.step({a.get()}, nullptr), "");
  ASSERT_TRUE(all_published(a.get(), *pa));
  EXPECT_FALSE(pa->stats().halted) << pa->stats().last_error;
  auto view = open_view(dir.sub("view"));
  auto f = start_follower(view.get(), config, "view");
  ASSERT_TRUE(view && f);
  ASSERT_TRUE(converge({a.get()}, *view, *f));
  EXPECT_EQ(compare(*view, *a), "");
  EXPECT_EQ(stream_messages(cluster, config.stream), *a->last_change_seq());
  EXPECT_OK(pa->stop());
}

TEST(NatsFence, ARestoredDbStopsWhereTheStreamIsNoLongerAheadAndNeverTrims) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = test_config(cluster, "RESTORE", 3);
  auto db = open_shard(dir.sub("db"), 3);
  ASSERT_NE(db, nullptr);
  Workload w(61, 40);
  ASSERT_EQ(w.setup({db.get()}, nullptr), "");
  for (int i = 0; i < 300; ++i) ASSERT_EQ(w.step({db.get()}, nullptr), "");
  {
    auto p = start_publisher(db.get(), config);
    ASSERT_NE(p, nullptr);
    ASSERT_TRUE(all_published(db.get(), *p));
    EXPECT_OK(p->stop());
  }
  // The backup: a copy of the closed Db.
  ASSERT_OK(db->close());
  db.reset();
  copy_dir(dir.sub("db"), dir.sub("backup"));
  db = open_shard(dir.sub("db"), 3);
  ASSERT_NE(db, nullptr);
  for (int i = 0; i < 600; ++i) ASSERT_EQ(w.step({db.get()}, nullptr), "");
  std::uint64_t stream_last = 0;
  {
    auto p = start_publisher(db.get(), config);
    ASSERT_NE(p, nullptr);
    ASSERT_TRUE(all_published(db.get(), *p));
    EXPECT_OK(p->stop());
    stream_last = *db->last_change_seq();
  }
  ASSERT_OK(db->close());
  db.reset();

  // The shard is restored from the backup: the stream is ahead of it.
  auto restored = open_shard(dir.sub("backup"), 3);
  ASSERT_NE(restored, nullptr);
  const std::uint64_t trimmed = restored->stats().change_feed_trimmed_seq;
  ASSERT_LT(*restored->last_change_seq(), stream_last);
  const Status refused = testing::refusal(Publisher::start(restored.get(), config));
  EXPECT_EQ(refused.code(), StatusCode::InvalidArgument) << refused.to_string();
  EXPECT_NE(refused.message().find("up to seq " + std::to_string(stream_last)), std::string::npos)
      << refused.to_string();

  // A Publisher started while the cluster is down, so that its refusal
  // comes at a later attempt: meanwhile the restored Db takes new writes,
  // a purge among them, until it has passed the stream's last seq.
  cluster.kill_all();
  auto p = start_publisher(restored.get(), config);
  ASSERT_NE(p, nullptr);
  Workload w2(62, 40);
  for (int i = 0; *restored->last_change_seq() <= stream_last + 2; ++i) {
    ASSERT_EQ(w2.step({restored.get()}, nullptr), "");
    if (i == 100) {
      (void)restored->leave_community_layer(5);  // left already: fine
      auto receipt = restored->purge_community_contributions(5);
      ASSERT_TRUE(receipt.ok()) << receipt.status().to_string();
    }
    if (i % 50 == 0) ASSERT_OK(restored->flush());
  }
  ASSERT_OK(restored->flush());
  const std::string feed = feed_after(restored.get(), trimmed);
  EXPECT_GT(p->stats().errors, 0u);
  EXPECT_FALSE(p->stats().halted);
  ASSERT_TRUE(cluster.start_all(60s)) << cluster.log_tail(0);
  ASSERT_TRUE(eventually([&] { return p->stats().halted; }, 30s)) << p->stats().last_error;
  Status st = p->stop();
  EXPECT_EQ(st.code(), StatusCode::Corruption) << st.to_string();
  for (const std::string& word : std::vector<std::string>{"shard 3", "stream RESTORE", "batch of seq " + std::to_string(stream_last),
                                 "differs", "nothing trimmed"}) {
    EXPECT_NE(st.message().find(word), std::string::npos) << word << ": " << st.to_string();
  }
  EXPECT_EQ(restored->stats().change_feed_trimmed_seq, trimmed);
  EXPECT_EQ(feed_after(restored.get(), trimmed), feed);
  // Started again later: the same refusal at once, still nothing trimmed.
  const Status again = testing::refusal(Publisher::start(restored.get(), config));
  EXPECT_EQ(again.code(), StatusCode::Corruption) << again.to_string();
  EXPECT_EQ(restored->stats().change_feed_trimmed_seq, trimmed);
  // The stream still holds the original shard's batches only.
  EXPECT_EQ(stream_messages(cluster, config.stream), stream_last);
}

// The repair of the case above: the restored Db is re-seeded, its
// Publisher publishes the snapshot over the stream's batches of the lost
// copy, and every view, the one that applied the lost batches and a new one
// that reads the stream from its start, equals the restored shard bit for
// bit, a purge made after the restore included.
TEST(NatsReseed, ARestoredDbReseededMakesEveryViewEqualItsCurrentAggregates) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = test_config(cluster, "RESEED", 3);
  auto db = open_shard(dir.sub("db"), 3);
  ASSERT_NE(db, nullptr);
  auto view = open_view(dir.sub("view"));
  auto f = start_follower(view.get(), config, "view");
  ASSERT_TRUE(view && f);
  Workload w(71, 40);
  ASSERT_EQ(w.setup({db.get()}, nullptr), "");
  for (int i = 0; i < 300; ++i) ASSERT_EQ(w.step({db.get()}, nullptr), "");
  {
    auto p = start_publisher(db.get(), config);
    ASSERT_NE(p, nullptr);
    ASSERT_TRUE(all_published(db.get(), *p));
    EXPECT_OK(p->stop());
  }
  ASSERT_OK(db->close());
  db.reset();
  copy_dir(dir.sub("db"), dir.sub("backup"));
  db = open_shard(dir.sub("db"), 3);
  ASSERT_NE(db, nullptr);
  for (int i = 0; i < 600; ++i) ASSERT_EQ(w.step({db.get()}, nullptr), "");
  {
    auto p = start_publisher(db.get(), config);
    ASSERT_NE(p, nullptr);
    ASSERT_TRUE(all_published(db.get(), *p));
    EXPECT_OK(p->stop());
  }
  ASSERT_TRUE(eventually([&] { return caught_up({db.get()}, *view); }, 20s)) << f->stats().last_error;
  ASSERT_OK(db->close());
  db.reset();

  // Restored from the backup: refused until re-seeded.
  auto restored = open_shard(dir.sub("backup"), 3);
  ASSERT_NE(restored, nullptr);
  const Status refused = testing::refusal(Publisher::start(restored.get(), config));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("re-seed"), std::string::npos) << refused.to_string();
  ASSERT_OK(restored->reseed_change_feed());
  Workload w2(72, 40);
  for (int i = 0; i < 300; ++i) ASSERT_EQ(w2.step({restored.get()}, nullptr), "");
  (void)restored->leave_community_layer(5);
  ASSERT_OK(restored->purge_community_contributions(5));
  ASSERT_OK(restored->flush());
  auto p = start_publisher(restored.get(), config);
  ASSERT_NE(p, nullptr);
  ASSERT_TRUE(all_published(restored.get(), *p)) << p->stats().last_error;
  EXPECT_EQ(p->stats().reseeds, 1u);
  EXPECT_FALSE(p->stats().halted);
  ASSERT_TRUE(eventually([&] { return caught_up({restored.get()}, *view); }, 20s)) << f->stats().last_error;
  EXPECT_EQ(compare(*view, *restored), "");
  // A view that reads the whole stream: the lost copy's batches, then the re-seed.
  auto fresh = open_view(dir.sub("fresh"));
  auto g = start_follower(fresh.get(), config, "fresh");
  ASSERT_TRUE(fresh && g);
  ASSERT_TRUE(eventually([&] { return caught_up({restored.get()}, *fresh); }, 20s)) << g->stats().last_error;
  EXPECT_EQ(compare(*fresh, *restored), "");
  EXPECT_OK(p->stop());
  EXPECT_OK(f->stop());
  EXPECT_OK(g->stop());
}

// A batch of another incarnation of shard 9 (a Db re-created for it) in the
// stream: the view refuses it, naming both incarnations, and the shard's
// own Publisher stops at its next connection.
TEST(NatsFence, ABatchOfAnotherIncarnationIsRefusedByTheViewAndStopsThePublisher) {
  NatsCluster cluster(1);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = test_config(cluster, "INCARN", 1);
  auto db = open_shard(dir.sub("db"), 9);
  ASSERT_NE(db, nullptr);
  const std::string mine = db->stats().change_feed_incarnation;
  ASSERT_EQ(mine.size(), 32u);
  for (std::uint64_t k = 1; k <= 3; ++k) {
    ASSERT_OK(db->join_community(k, 1));
    ASSERT_TRUE(db->signal_with_context({k, k, 1.5}, {{2}}).ok());
    ASSERT_OK(db->flush());
  }
  auto batches = db->read_changes(0, 64 << 20);
  ASSERT_TRUE(batches.ok());
  const ChangeBatch last = batches->back();
  auto view = open_view(dir.sub("view"));
  auto f = start_follower(view.get(), config, "view");
  ASSERT_TRUE(view && f);
  {
    auto p = start_publisher(db.get(), config);
    ASSERT_NE(p, nullptr);
    ASSERT_TRUE(all_published(db.get(), *p));
    EXPECT_OK(p->stop());
  }
  ASSERT_TRUE(eventually([&] { return *view->applied_seq(9) == last.seq; }, 20s)) << f->stats().last_error;
  // Every message carries the feed's incarnation.
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  natsMsg* m = nullptr;
  ASSERT_EQ(js_GetLastMsg(&m, js.js(), "INCARN", "tidal.INCARN.9", nullptr, nullptr), NATS_OK);
  const char* header = nullptr;
  ASSERT_EQ(natsMsgHeader_Get(m, "Tidal-Incarnation", &header), NATS_OK);
  EXPECT_EQ(std::string(header), mine);
  natsMsg_Destroy(m);
  // Another Db's batch seq last + 1 of shard 9 (payload of a real batch).
  const std::string theirs(32, 'e');
  ASSERT_EQ(natsMsg_Create(&m, "tidal.INCARN.9", nullptr, last.payload.data(), static_cast<int>(last.payload.size())),
            NATS_OK);
  ASSERT_EQ(natsMsgHeader_Set(m, "Tidal-Shard", "9"), NATS_OK);
  ASSERT_EQ(natsMsgHeader_Set(m, "Tidal-Seq", std::to_string(last.seq + 1).c_str()), NATS_OK);
  ASSERT_EQ(natsMsgHeader_Set(m, "Tidal-Incarnation", theirs.c_str()), NATS_OK);
  ASSERT_EQ(js_PublishMsg(nullptr, js.js(), m, nullptr, nullptr), NATS_OK);
  natsMsg_Destroy(m);
  ASSERT_TRUE(eventually([&] { return f->stats().gaps >= 1; }, 20s)) << f->stats().last_error;
  const std::string why = f->stats().last_error;
  for (const std::string& word : {std::string("incarnation"), mine, theirs, std::string("shard 9")}) {
    EXPECT_NE(why.find(word), std::string::npos) << word << ": " << why;
  }
  EXPECT_EQ(*view->applied_seq(9), last.seq);
  EXPECT_EQ(compare(*view, *db), "");
  // The shard's own Publisher, started again, finds the other incarnation last.
  ASSERT_TRUE(db->signal_with_context({1, 4, 1.0}, {{2}}).ok());
  ASSERT_OK(db->flush());
  const std::uint64_t trimmed = db->stats().change_feed_trimmed_seq;
  const Status p = testing::refusal(Publisher::start(db.get(), config));
  EXPECT_EQ(p.code(), StatusCode::Corruption) << p.to_string();
  EXPECT_NE(p.message().find("incarnation " + theirs), std::string::npos) << p.to_string();
  EXPECT_EQ(db->stats().change_feed_trimmed_seq, trimmed);
  EXPECT_OK(f->stop());
}

// ---- Convergence through the cluster, with a server SIGKILLed and a publisher stopped abruptly ----

TEST(NatsCluster, ViewsConvergeBitForBitThroughServerKillAndPublisherRestart) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = test_config(cluster, "CONVERGE", 3);
  constexpr int kShards = 3;
  std::vector<std::unique_ptr<Db>> shards;
  std::vector<std::unique_ptr<Publisher>> pubs;
  for (int s = 0; s < kShards; ++s) {
    shards.push_back(open_shard(dir.sub("shard" + std::to_string(s)), static_cast<std::uint64_t>(s)));
    ASSERT_NE(shards.back(), nullptr);
    pubs.push_back(start_publisher(shards.back().get(), config));
    ASSERT_NE(pubs.back(), nullptr);
  }
  auto reference = tidal::testing::open_db(dir.sub("reference"));
  auto view_a = open_view(dir.sub("view_a"));
  auto view_b = open_view(dir.sub("view_b"));
  auto fa = start_follower(view_a.get(), config, "view-a");
  auto fb = start_follower(view_b.get(), config, "view-b");
  ASSERT_TRUE(reference && view_a && view_b && fa && fb);

  Workload w(19, 120);
  ASSERT_EQ(w.setup(raw(shards), reference.get()), "");
  std::string killed;
  for (int i = 0; i < 6000; ++i) {
    ASSERT_EQ(w.step(raw(shards), reference.get()), "") << "op " << i;
    if (i % 50 == 0) std::this_thread::sleep_for(2ms);
    if (i == 1500) {  // the stream's leader dies mid-stream: a leader change
      // (None is known while the stream is still electing one, or when the
      // info request times out on a loaded machine: ask again.)
      ASSERT_TRUE(eventually([&] { return !(killed = stream_leader(cluster, config.stream)).empty(); }, 20s))
          << "the stream never reported a leader";
      cluster.kill(killed[1] - '0');
    }
    if (i == 3000) {  // a publisher stopped abruptly (its publish in flight abandoned) and restarted
      pubs[0].reset();
      pubs[0] = start_publisher(shards[0].get(), config);
      ASSERT_NE(pubs[0], nullptr);
    }
    if (i == 4000) cluster.start(killed[1] - '0');
  }
  ASSERT_TRUE(converge(raw(shards), *view_a, *fa, 90s));
  ASSERT_TRUE(converge(raw(shards), *view_b, *fb, 30s));
  EXPECT_EQ(compare(*view_a, *reference), "");
  EXPECT_EQ(compare(*view_b, *reference), "");
  for (int s = 0; s < kShards; ++s) {
    // The views applied the shard's last batch, read from the stream; its
    // publisher counts it published once the stream's ack reaches it, which
    // can come after (ci27: published 32 of 33 when the views had 33).
    const std::uint64_t last = *shards[static_cast<std::size_t>(s)]->last_change_seq();
    EXPECT_TRUE(eventually([&] { return pubs[static_cast<std::size_t>(s)]->stats().published_seq == last; },
                           testing::ack_bound(config)))
        << "shard " << s << ": published " << pubs[static_cast<std::size_t>(s)]->stats().published_seq << " of " << last;
    EXPECT_TRUE(eventually([&] { return pubs[static_cast<std::size_t>(s)]->stats().lag_batches == 0; },
                           testing::ack_bound(config)));
  }
  EXPECT_EQ(fa->stats().stalled_on_gap, false);
  EXPECT_OK(fa->stop());
  EXPECT_OK(fb->stop());
}

// ---- A shard process SIGKILLed mid-stream, many times ----

TEST(NatsCrash, AShardKilledMidPublishLosesNoBatchAndPublishesNoneTwice) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = test_config(cluster, "SHARDKILL", 3);
  const int rounds = tidal::testing::soak_rounds("TIDAL_NATS_KILL_ROUNDS", 6, 12);
  std::mt19937_64 rng(7);
  for (int r = 0; r < rounds; ++r) {
    if (r % 3 == 2) {
      // Aimed: killed right after its n-th trim was written. A Publisher
      // that trimmed a batch before the stream acknowledged it would lose
      // that batch here.
      const std::string trims = std::to_string(1 + rng() % 4);
      Child child({"shard", dir.sub("db"), "5", config.servers, config.stream, std::to_string(100 + r), trims});
      ASSERT_TRUE(child.killed_itself(std::chrono::seconds(60)))
          << "round " << r << ": the shard process did not kill itself after trim " << trims;
      continue;
    }
    Child child({"shard", dir.sub("db"), "5", config.servers, config.stream, std::to_string(100 + r)});
    // 300-800 ms of work from its start (on a busy machine the open alone
    // can take that long, and rounds killed before any work purged nothing).
    ASSERT_TRUE(child.ready(60s)) << "the shard process did not start in round " << r;
    std::this_thread::sleep_for(std::chrono::milliseconds(300 + rng() % 500));
    ASSERT_TRUE(child.kill()) << "the shard process failed on its own in round " << r;
  }
  auto db = open_shard(dir.sub("db"), 5);
  ASSERT_NE(db, nullptr);
  const std::uint64_t trimmed_before = db->stats().change_feed_trimmed_seq;
  EXPECT_GT(trimmed_before, 0u) << "no round published anything";
  std::size_t receipts = 0;  // the rounds purged (their deltas are in the feed like any other)
  for (std::uint64_t u = 1; u <= 50; ++u) receipts += db->purge_receipts(u).ok() ? db->purge_receipts(u)->size() : 0;
  EXPECT_GT(receipts, 0u) << "no round purged anything";
  auto pub = start_publisher(db.get(), config);
  auto view = open_view(dir.sub("view"));
  auto f = start_follower(view.get(), config, "view");
  ASSERT_TRUE(pub && view && f);
  ASSERT_TRUE(converge({db.get()}, *view, *f));
  // The view is the Db's own aggregates, bit for bit: no batch lost, none applied twice.
  EXPECT_EQ(compare(*view, *db), "");
  EXPECT_EQ(f->stats().gaps, 0u) << f->stats().last_error;
  // The stream holds each seq once: the restarted publishers resumed after what it held.
  EXPECT_EQ(stream_messages(cluster, config.stream), *db->last_change_seq());
}

// ---- A follower process SIGKILLed mid-apply ----

TEST(NatsCrash, AFollowerKilledMidApplyLeavesTheViewExactAfterRestart) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = test_config(cluster, "FOLLOWKILL", 3);
  std::vector<std::unique_ptr<Db>> shards;
  std::vector<std::unique_ptr<Publisher>> pubs;
  for (std::uint64_t s = 0; s < 2; ++s) {
    shards.push_back(open_shard(dir.sub("shard" + std::to_string(s)), s));
    ASSERT_NE(shards.back(), nullptr);
    pubs.push_back(start_publisher(shards.back().get(), config));
    ASSERT_NE(pubs.back(), nullptr);
  }
  auto reference = tidal::testing::open_db(dir.sub("reference"));
  Workload w(23, 80);
  ASSERT_EQ(w.setup(raw(shards), reference.get()), "");
  std::atomic<bool> done{false};
  std::string error;
  std::thread load([&] {
    for (int i = 0; !done.load(); ++i) {
      error = w.step(raw(shards), reference.get());
      if (!error.empty()) return;
      if (i % 20 == 0) std::this_thread::sleep_for(1ms);
    }
  });
  const int rounds = tidal::testing::soak_rounds("TIDAL_NATS_KILL_ROUNDS", 5, 10);
  std::mt19937_64 rng(11);
  for (int r = 0; r < rounds; ++r) {
    Child child({"follower", dir.sub("view"), config.servers, config.stream, "view"});
    if (!child.ready(60s)) {  // then 400-1000 ms of work (the load thread must be joined: no ASSERT)
      ADD_FAILURE() << "the follower process did not start in round " << r;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(400 + rng() % 600));
    EXPECT_TRUE(child.kill()) << "the follower process failed on its own in round " << r;
  }
  done = true;
  load.join();
  ASSERT_EQ(error, "");
  auto view = open_view(dir.sub("view"));
  ASSERT_NE(view, nullptr);
  EXPECT_GT(view->applied_shards()->size(), 0u) << "the killed followers applied nothing";
  auto f = start_follower(view.get(), config, "view");
  ASSERT_NE(f, nullptr);
  ASSERT_TRUE(converge(raw(shards), *view, *f));
  EXPECT_EQ(compare(*view, *reference), "");
}

// With Config's default ack_wait (30 s), a Follower killed holding messages
// it had not acknowledged: while the shards go on publishing, its successor
// does not wait for the server to deliver them again (the next batch of the
// shard shows the gap, and the parked shard reads its subject from the
// stream), so the view catches up well within ack_wait, exactly.
TEST(NatsCrash, AFollowerKilledWithTheDefaultAckWaitCatchesUpWithoutWaitingForIt) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  Config config = test_config(cluster, "ACKWAIT", 3);
  config.ack_wait = Config{}.ack_wait;
  ASSERT_GE(config.ack_wait, 10s);
  std::vector<std::unique_ptr<Db>> shards;
  std::vector<std::unique_ptr<Publisher>> pubs;
  for (std::uint64_t s = 0; s < 2; ++s) {
    shards.push_back(open_shard(dir.sub("shard" + std::to_string(s)), s));
    ASSERT_NE(shards.back(), nullptr);
    pubs.push_back(start_publisher(shards.back().get(), config));
    ASSERT_NE(pubs.back(), nullptr);
  }
  auto reference = tidal::testing::open_db(dir.sub("reference"));
  Workload w(29, 80);
  ASSERT_EQ(w.setup(raw(shards), reference.get()), "");
  std::atomic<bool> done{false};
  std::string error;
  std::thread load([&] {
    for (int i = 0; !done.load(); ++i) {
      error = w.step(raw(shards), reference.get());
      if (!error.empty()) return;
      if (i % 20 == 0) std::this_thread::sleep_for(1ms);
    }
  });
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  // Kill followers until one dies holding unacknowledged messages.
  std::mt19937_64 rng(13);
  std::int64_t pending = 0;
  for (int r = 0; r < 20 && pending == 0; ++r) {
    Child child({"follower", dir.sub("view"), config.servers, config.stream, "view", "default-ack-wait"});
    if (!child.ready(60s)) {  // the load thread must be joined: no ASSERT
      ADD_FAILURE() << "the follower process did not start in round " << r;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300 + rng() % 500));
    ASSERT_TRUE(child.kill()) << "the follower process failed on its own in round " << r;
    jsConsumerInfo* ci = nullptr;
    if (js_GetConsumerInfo(&ci, js.js(), config.stream.c_str(), "view", nullptr, nullptr) == NATS_OK) {
      pending = ci->NumAckPending;
      jsConsumerInfo_Destroy(ci);
    }
  }
  done = true;
  load.join();
  ASSERT_EQ(error, "");
  ASSERT_GT(pending, 0) << "no killed follower held an unacknowledged message";
  auto view = open_view(dir.sub("view"));
  ASSERT_NE(view, nullptr);
  const auto start = std::chrono::steady_clock::now();
  auto f = start_follower(view.get(), config, "view");
  ASSERT_NE(f, nullptr);
  // The shards go on publishing (a later batch of a shard is what shows the
  // successor that one is missing; a shard that publishes nothing more
  // waits for ack_wait: docs/SCALE.md, "Settings").
  for (int i = 0; i < 400; ++i) ASSERT_EQ(w.step(raw(shards), reference.get()), "");
  for (auto& db : shards) ASSERT_OK(db->flush());
  for (int i = 0; i < 400; ++i) ASSERT_EQ(w.step(raw(shards), reference.get()), "");
  const auto bound = std::chrono::duration_cast<std::chrono::milliseconds>(config.ack_wait / 2);
  ASSERT_TRUE(converge(raw(shards), *view, *f, bound)) << pending << " messages were unacknowledged";
  EXPECT_LT(std::chrono::steady_clock::now() - start, config.ack_wait / 2);
  EXPECT_EQ(compare(*view, *reference), "");
}

// ---- The cluster unavailable at start and for a while mid-run ----

// docs/SCALE.md's runbook, "the stream is full (discard-new)": publishes are
// refused and the Publisher says so in last_error; the repair as written,
// a larger max_bytes on the stream (`nats stream edit`, here the same
// js_UpdateStream), and the Publisher goes on from where it stopped: no
// batch lost, the view equals the reference.
TEST(NatsRunbook, AFullStreamRefusesPublishesUntilItsMaxBytesIsRaisedAndLosesNothing) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  Config config = test_config(cluster, "FULLSTREAM", 3);
  config.stream_max_bytes = 32 << 10;
  std::vector<std::unique_ptr<Db>> shards;
  shards.push_back(open_shard(dir.sub("shard0"), 0));
  auto reference = tidal::testing::open_db(dir.sub("reference"));
  auto view = open_view(dir.sub("view"));
  auto pub = start_publisher(shards[0].get(), config);
  auto f = start_follower(view.get(), config, "view");
  ASSERT_TRUE(pub && f && reference && view && shards[0]);
  Workload w(41, 40);
  ASSERT_EQ(w.setup(raw(shards), reference.get()), "");
  // Until the stream refuses for its size. (Another error comes first when
  // the publisher's creation of the stream meets a cluster that has not
  // placed its JetStream peers yet, "no suitable peers for placement" (ci28);
  // the publisher tries again.)
  const auto give_up = std::chrono::steady_clock::now() + 60s;
  // ("maximum bytes exceeded": the server's refusal; every publish error
  // names the batch's size in bytes.)
  while (pub->stats().last_error.find("maximum bytes") == std::string::npos &&
         std::chrono::steady_clock::now() < give_up) {
    for (int i = 0; i < 50; ++i) ASSERT_EQ(w.step(raw(shards), reference.get()), "");
    ASSERT_OK(shards[0]->flush());
    std::this_thread::sleep_for(20ms);
  }
  const PublisherStats full = pub->stats();
  ASSERT_FALSE(full.last_error.empty()) << "the 32 KiB stream never refused a publish";
  std::printf("[ figures ] full stream: %s\n", full.last_error.c_str());
  EXPECT_NE(full.last_error.find("maximum bytes"), std::string::npos) << full.last_error;
  // More signals meanwhile: the Db keeps them; nothing is trimmed past what the stream holds.
  for (int i = 0; i < 200; ++i) ASSERT_EQ(w.step(raw(shards), reference.get()), "");
  ASSERT_OK(shards[0]->flush());
  EXPECT_LT(pub->stats().published_seq, *shards[0]->last_change_seq());
  EXPECT_EQ(shards[0]->stats().change_feed_trimmed_seq, pub->stats().published_seq);

  // The repair: a larger max_bytes on the stream.
  {
    Js js(cluster);
    ASSERT_TRUE(js.ok());
    jsStreamInfo* si = js.info(config.stream);
    ASSERT_NE(si, nullptr);
    jsStreamConfig sc = *si->Config;
    sc.MaxBytes = std::int64_t{64} << 20;
    jsStreamInfo* updated = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    const natsStatus ns = js_UpdateStream(&updated, js.js(), &sc, nullptr, &jerr);
    if (updated != nullptr) jsStreamInfo_Destroy(updated);
    jsStreamInfo_Destroy(si);
    ASSERT_EQ(ns, NATS_OK) << natsStatus_GetText(ns) << " (" << jerr << ")";
  }
  ASSERT_TRUE(converge(raw(shards), *view, *f, 90s));
  EXPECT_EQ(compare(*view, *reference), "");
  // The view read the last batch from the stream; the publisher counts it
  // once the ack reaches it, which can come after (as in the test above).
  const std::uint64_t last = *shards[0]->last_change_seq();
  EXPECT_TRUE(eventually([&] { return pub->stats().published_seq == last; }, testing::ack_bound(config)))
      << "published " << pub->stats().published_seq << " of " << last;
  EXPECT_OK(pub->stop());
  EXPECT_OK(f->stop());
}

TEST(NatsOutage, PublisherAndFollowerRetryWithBoundedBackoffAndCatchUp) {
  NatsCluster cluster(3);  // not started yet
  TempDir dir;
  const Config config = test_config(cluster, "OUTAGE", 3);
  std::vector<std::unique_ptr<Db>> shards;
  for (std::uint64_t s = 0; s < 2; ++s) shards.push_back(open_shard(dir.sub("shard" + std::to_string(s)), s));
  auto reference = tidal::testing::open_db(dir.sub("reference"));
  auto view = open_view(dir.sub("view"));
  std::vector<std::unique_ptr<Publisher>> pubs;
  for (auto& db : shards) pubs.push_back(start_publisher(db.get(), config));
  auto f = start_follower(view.get(), config, "view");
  ASSERT_TRUE(pubs[0] && pubs[1] && f && reference && view);

  Workload w(31, 60);
  ASSERT_EQ(w.setup(raw(shards), reference.get()), "");
  auto run_for = [&](std::chrono::milliseconds d) {
    const auto until = std::chrono::steady_clock::now() + d;
    while (std::chrono::steady_clock::now() < until) {
      for (int i = 0; i < 20; ++i) ASSERT_EQ(w.step(raw(shards), reference.get()), "");
      std::this_thread::sleep_for(2ms);
    }
  };
  run_for(1000ms);  // the Db keeps accepting signals while no server runs; the backoff reaches 500 ms
  const std::uint64_t pub_errors = pubs[0]->stats().errors, follower_errors = f->stats().errors;
  const auto window_start = std::chrono::steady_clock::now();
  EXPECT_GE(pub_errors, 4u);  // 50 + 100 + 200 + 400 ms
  run_for(2000ms);
  for (auto& db : shards) ASSERT_OK(db->flush());
  PublisherStats ps = pubs[0]->stats();
  const std::uint64_t follower_tries = f->stats().errors - follower_errors;
  // The window as it ran: the workload's steps overrun 2 s on a busy machine
  // (under ASan in CI: 8 tries, about 4 s).
  const auto window = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - window_start);
  EXPECT_FALSE(ps.connected);
  EXPECT_EQ(ps.published_seq, 0u);
  EXPECT_GT(shards[0]->stats().change_feed_last_seq, 0u);
  EXPECT_NE(ps.last_error.find(config.servers), std::string::npos) << ps.last_error;
  // Still retrying, at most every max_backoff (500 ms): one try per 500 ms
  // of the window, give or take one (3 to 5 in 2 s).
  const std::uint64_t periods = static_cast<std::uint64_t>(window.count()) / 500;
  const std::uint64_t least = periods > 1 ? periods - 1 : 1, most = periods + 2;
  EXPECT_GE(ps.errors - pub_errors, least) << "window " << window.count() << " ms";
  EXPECT_LE(ps.errors - pub_errors, most) << "window " << window.count() << " ms";
  EXPECT_GE(follower_tries, least) << "window " << window.count() << " ms";
  EXPECT_LE(follower_tries, most) << "window " << window.count() << " ms";
  EXPECT_FALSE(f->stats().connected);

  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  ASSERT_TRUE(converge(raw(shards), *view, *f, 60s));
  EXPECT_EQ(compare(*view, *reference), "");

  // Every server down for a while mid-run.
  cluster.kill_all();
  run_for(3000ms);
  for (auto& db : shards) ASSERT_OK(db->flush());
  EXPECT_TRUE(eventually([&] { return !pubs[0]->stats().connected; }, 5s));
  std::uint64_t last = *shards[0]->last_change_seq();
  EXPECT_LT(pubs[0]->stats().published_seq, last);  // waiting, nothing lost: the Db keeps the batches
  EXPECT_EQ(shards[0]->stats().change_feed_trimmed_seq, pubs[0]->stats().published_seq);
  ASSERT_TRUE(cluster.start_all(60s)) << cluster.log_tail(0);
  ASSERT_TRUE(converge(raw(shards), *view, *f, 90s));
  EXPECT_EQ(compare(*view, *reference), "");

  // stop() is prompt while the cluster is down, and says what the thread
  // was retrying (issue 27 item 6: it returned OK).
  cluster.kill_all();
  EXPECT_TRUE(eventually([&] { return !pubs[1]->stats().connected && !f->stats().connected; }, 5s));
  auto t0 = std::chrono::steady_clock::now();
  Status pub_stop = pubs[1]->stop();
  Status follower_stop = f->stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, config.request_timeout + 1s);
  for (const Status* s : {&pub_stop, &follower_stop}) {
    EXPECT_EQ(s->code(), StatusCode::IOError) << s->to_string();
    EXPECT_NE(s->message().find("127.0.0.1"), std::string::npos) << s->to_string();
  }
}

// ---- stop() is bounded whatever the servers do ----

// A TCP listener on loopback that accepts connections and then never
// answers, or sends a NATS INFO greeting and then nothing (a server frozen
// mid-handshake). A real socket, not a mock server. Its destructor closes
// every accepted socket, which also releases a client stuck on it.
class FakeServer {
 public:
  // pong_once: greets every connection, and answers the first one's PING
  // (a server alive for tidal's probe that freezes before the client's
  // own handshake).
  explicit FakeServer(bool greet, bool pong_once = false) : greet_(greet), pong_once_(pong_once) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    ok_ = fd_ >= 0 && ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
          ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0 && ::listen(fd_, 64) == 0;
    port_ = ntohs(addr.sin_port);
    if (ok_) thread_ = std::thread([this] { serve(); });
  }
  ~FakeServer() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    for (int c : accepted_) ::close(c);
    if (fd_ >= 0) ::close(fd_);
  }
  FakeServer(const FakeServer&) = delete;
  FakeServer& operator=(const FakeServer&) = delete;
  bool ok() const { return ok_; }
  std::string url() const { return "nats://127.0.0.1:" + std::to_string(port_); }

 private:
  void serve() {
    static constexpr char kInfo[] =
        "INFO {\"server_id\":\"FAKE\",\"server_name\":\"fake\",\"version\":\"2.9.10\",\"proto\":1,"
        "\"host\":\"127.0.0.1\",\"port\":4222,\"headers\":true,\"max_payload\":1048576,\"jetstream\":true}\r\n";
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;
      accepted_.push_back(c);
      if (greet_ || pong_once_) (void)::send(c, kInfo, sizeof(kInfo) - 1, MSG_NOSIGNAL);
      if (pong_once_ && !ponged_) {
        std::string got;
        char buf[512];
        for (int i = 0; i < 100 && got.find("PING\r\n") == std::string::npos; ++i) {
          pollfd q{c, POLLIN, 0};
          if (::poll(&q, 1, 20) <= 0) continue;
          const ssize_t n = ::recv(c, buf, sizeof(buf), 0);
          if (n <= 0) break;
          got.append(buf, static_cast<std::size_t>(n));
        }
        (void)::send(c, "PONG\r\n", 6, MSG_NOSIGNAL);
        ponged_ = true;
      }
    }
  }

  bool greet_;
  bool pong_once_;
  bool ponged_ = false;  // the serving thread's
  bool ok_ = false;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::vector<int> accepted_;  // the serving thread's, then the destructor's
  std::thread thread_;
};

// Calls stop() on another thread and waits at most `limit` for it: how
// long it took, or nullopt when it had not returned (the call is then left
// to finish when the servers let go, which `release` makes them do).
template <class T>
std::optional<std::chrono::milliseconds> timed_stop(T* t, Status* out, std::chrono::milliseconds limit,
                                                    std::shared_future<Status>* pending) {
  const auto t0 = std::chrono::steady_clock::now();
  *pending = std::async(std::launch::async, [t] { return t->stop(); }).share();
  if (pending->wait_for(limit) != std::future_status::ready) return std::nullopt;
  *out = pending->get();
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
}

// Issue 27 items 6 and 9: a connect is interruptible. Four servers that
// accept and never answer, or greet and then go silent: start() returns
// after one attempt of at most request_timeout (not one per server),
// stop() within request_timeout plus a small margin, and stop() returns
// what the thread was retrying, naming the servers. Red with the former
// connect (natsConnection_Connect on the caller's thread): silent servers
// took request_timeout each (start() waited request_timeout + 1 s, stop()
// another 2 s); after a greeting the connect never returned (stop() still
// blocked after 10 s, a core spinning).
TEST(NatsLifecycle, StopIsBoundedByRequestTimeoutWhenServersAreSilentOrGreetAndFreeze) {
  for (bool greet : {false, true}) {
    SCOPED_TRACE(greet ? "servers greet, then go silent" : "servers accept, never answer");
    std::vector<std::unique_ptr<FakeServer>> fakes;
    std::string servers;
    for (int i = 0; i < 4; ++i) {
      fakes.push_back(std::make_unique<FakeServer>(greet));
      ASSERT_TRUE(fakes.back()->ok());
      servers += (servers.empty() ? "" : ",") + fakes.back()->url();
    }
    TempDir dir;
    Config config;
    config.servers = servers;
    config.stream = "SILENT";
    config.subject_prefix = "tidal.SILENT";
    config.replicas = 1;
    config.request_timeout = 1000ms;
    config.min_backoff = 50ms;
    config.max_backoff = 200ms;
    const auto bound = config.request_timeout + config.min_backoff + 250ms;
    auto db = open_shard(dir.sub("db"), 1);
    auto view = open_view(dir.sub("view"));
    ASSERT_TRUE(db && view);

    auto t0 = std::chrono::steady_clock::now();
    auto p = Publisher::start(db.get(), config);
    const auto publisher_start = std::chrono::steady_clock::now() - t0;
    ASSERT_TRUE(p.ok()) << p.status().to_string();  // an unreachable cluster is not an error
    t0 = std::chrono::steady_clock::now();
    auto f = Follower::start(view.get(), config, "view");
    const auto follower_start = std::chrono::steady_clock::now() - t0;
    ASSERT_TRUE(f.ok()) << f.status().to_string();
    EXPECT_LT(publisher_start, config.request_timeout + 500ms);
    EXPECT_LT(follower_start, config.request_timeout + 500ms);

    // Mid-attempt (the threads retry at once after 50 ms): stop is prompt.
    std::this_thread::sleep_for(300ms);
    Status ps, fs;
    std::shared_future<Status> p_pending, f_pending;
    auto p_took = timed_stop(p->get(), &ps, 10s, &p_pending);
    auto f_took = timed_stop(f->get(), &fs, 10s, &f_pending);
    const bool hung = !p_took || !f_took;
    fakes.clear();  // closes the accepted sockets: a stuck connect fails now
    if (p_pending.valid()) p_pending.wait();
    if (f_pending.valid()) f_pending.wait();
    ASSERT_FALSE(hung) << "stop() had not returned after 10 s (publisher " << (p_took ? "returned" : "blocked")
                       << ", follower " << (f_took ? "returned" : "blocked") << ")";
    EXPECT_LT(*p_took, bound);
    EXPECT_LT(*f_took, bound);
    // What the thread was retrying: the servers, and what they did.
    const std::string did = greet ? "did not answer a PING" : "sent no greeting";
    for (const Status* s : {&ps, &fs}) {
      EXPECT_EQ(s->code(), StatusCode::IOError) << s->to_string();
      EXPECT_NE(s->message().find(did), std::string::npos) << s->to_string();
      EXPECT_NE(s->message().find("127.0.0.1"), std::string::npos) << s->to_string();
    }
  }
}

// A server that answers tidal's probe and then freezes in the client's own
// handshake (libnats 3.4 never returns there, spinning a core): the
// client's connect is abandoned at the timeout (its thread frees the
// connection when the server lets go), start() and stop() stay bounded.
TEST(NatsLifecycle, AConnectThatHangsAfterTheProbeIsAbandonedAtTheTimeout) {
  auto fake = std::make_unique<FakeServer>(/*greet=*/true, /*pong_once=*/true);
  ASSERT_TRUE(fake->ok());
  TempDir dir;
  Config config;
  config.servers = fake->url();
  config.stream = "HANG";
  config.subject_prefix = "tidal.HANG";
  config.replicas = 1;
  config.request_timeout = 1000ms;
  config.min_backoff = 50ms;
  config.max_backoff = 200ms;
  auto view = open_view(dir.sub("view"));
  ASSERT_NE(view, nullptr);
  const auto t0 = std::chrono::steady_clock::now();
  auto f = Follower::start(view.get(), config, "view");
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  EXPECT_LT(took, config.request_timeout + 500ms);
  EXPECT_TRUE(eventually([&] { return (*f)->stats().last_error.find("abandoned") != std::string::npos; }, 1s))
      << (*f)->stats().last_error;
  Status st;
  std::shared_future<Status> pending;
  auto stop_took = timed_stop(f->get(), &st, 10s, &pending);
  fake.reset();  // lets the abandoned connect return
  if (pending.valid()) pending.wait();
  ASSERT_TRUE(stop_took.has_value());
  EXPECT_LT(*stop_took, config.request_timeout + config.min_backoff + 250ms);
  EXPECT_EQ(st.code(), StatusCode::IOError) << st.to_string();
}

// The same with real nats-servers frozen by SIGSTOP (the kernel still
// accepts on their ports): a Publisher and a Follower that were working
// stop within the bound (a publish in flight is abandoned), and new ones
// start after one attempt and stop within the bound. Red with the former
// connect: start() took request_timeout + 1 s (three servers tried in turn).
TEST(NatsLifecycle, StopIsBoundedWhenEveryServerIsFrozenBySigstop) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  Config config = test_config(cluster, "FROZEN", 3);
  config.request_timeout = 1000ms;
  const auto bound = config.request_timeout + config.min_backoff + 250ms;
  auto db = open_shard(dir.sub("db"), 1);
  auto view = open_view(dir.sub("view"));
  ASSERT_TRUE(db && view);
  auto p = start_publisher(db.get(), config);
  auto f = start_follower(view.get(), config, "view");
  ASSERT_TRUE(p && f);
  ASSERT_OK(db->join_community(1, 1));
  ASSERT_TRUE(db->signal_with_context({1, 1, 1.0}, {{1}}).ok());
  ASSERT_TRUE(converge({db.get()}, *view, *f));

  for (int n = 0; n < 3; ++n) cluster.freeze(n);
  // A batch to publish: its ack never comes.
  ASSERT_TRUE(db->signal_with_context({1, 2, 1.0}, {{1}}).ok());
  ASSERT_OK(db->flush());
  std::this_thread::sleep_for(300ms);
  Status ps, fs;
  std::shared_future<Status> p_pending, f_pending;
  auto p_took = timed_stop(p.get(), &ps, 10s, &p_pending);
  auto f_took = timed_stop(f.get(), &fs, 10s, &f_pending);
  const bool hung = !p_took || !f_took;
  if (hung) {
    for (int n = 0; n < 3; ++n) cluster.kill(n);
    if (p_pending.valid()) p_pending.wait();
    if (f_pending.valid()) f_pending.wait();
  }
  ASSERT_FALSE(hung);
  EXPECT_LT(*p_took, bound);
  EXPECT_LT(*f_took, bound);

  // New ones, while every server is frozen.
  auto t0 = std::chrono::steady_clock::now();
  auto p2 = Publisher::start(db.get(), config);
  const auto publisher_start = std::chrono::steady_clock::now() - t0;
  t0 = std::chrono::steady_clock::now();
  auto f2 = Follower::start(view.get(), config, "view");
  const auto follower_start = std::chrono::steady_clock::now() - t0;
  ASSERT_TRUE(p2.ok() && f2.ok());
  EXPECT_LT(publisher_start, config.request_timeout + 500ms);
  EXPECT_LT(follower_start, config.request_timeout + 500ms);
  std::this_thread::sleep_for(300ms);
  p_took = timed_stop(p2->get(), &ps, 10s, &p_pending);
  f_took = timed_stop(f2->get(), &fs, 10s, &f_pending);
  if (!p_took || !f_took) {
    for (int n = 0; n < 3; ++n) cluster.kill(n);
    if (p_pending.valid()) p_pending.wait();
    if (f_pending.valid()) f_pending.wait();
  }
  ASSERT_TRUE(p_took && f_took);
  EXPECT_LT(*p_took, bound);
  EXPECT_LT(*f_took, bound);
  for (const Status* s : {&ps, &fs}) {
    EXPECT_EQ(s->code(), StatusCode::IOError) << s->to_string();
    EXPECT_NE(s->message().find("sent no greeting"), std::string::npos) << s->to_string();
  }
  for (int n = 0; n < 3; ++n) cluster.thaw(n);
}

// ---- Authentication and TLS ----

// A Publisher and a Follower against a server that requires a user and a
// password: without them (or with a wrong password) they never connect and
// say why; with them the view converges. Bad combinations are refused.
TEST(NatsSecurity, AServerThatRequiresUserAndPasswordIsServedWithThem) {
  const std::string password = "s3cr3t P@ss!";
  NatsCluster cluster(1, "authorization {\n  user: tidal\n  password: \"" + password + "\"\n}\n",
                      [&](natsOptions* o) { natsOptions_SetUserInfo(o, "tidal", password.c_str()); });
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  Config config = test_config(cluster, "AUTH", 1);
  config.request_timeout = 1000ms;
  auto db = open_shard(dir.sub("db"), 4);
  auto view = open_view(dir.sub("view"));
  ASSERT_TRUE(db && view);
  ASSERT_OK(db->join_community(1, 1));
  ASSERT_TRUE(db->signal_with_context({1, 3, 1.25}, {{2}}).ok());
  ASSERT_OK(db->flush());

  for (const std::string& wrong : {std::string(), std::string("wrong")}) {
    Config c = config;
    if (!wrong.empty()) {
      c.user = "tidal";
      c.password = wrong;
    }
    auto p = Publisher::start(db.get(), c);
    ASSERT_TRUE(p.ok()) << p.status().to_string();  // retried: a server may be reconfigured
    auto f = Follower::start(view.get(), c, "view");
    ASSERT_TRUE(f.ok()) << f.status().to_string();
    EXPECT_FALSE((*p)->stats().connected);
    EXPECT_FALSE((*f)->stats().connected);
    const Status ps = (*p)->stop();
    const Status fs = (*f)->stop();
    for (const Status* st : {&ps, &fs}) {
      EXPECT_EQ(st->code(), StatusCode::IOError) << st->to_string();
      EXPECT_NE(st->message().find("Authorization"), std::string::npos) << st->to_string();
    }
  }
  EXPECT_EQ(db->stats().change_feed_trimmed_seq, 0u);

  config.user = "tidal";
  config.password = password;
  auto p = start_publisher(db.get(), config);
  auto f = start_follower(view.get(), config, "view");
  ASSERT_TRUE(p && f);
  ASSERT_TRUE(db->signal_with_context({1, 4, 2.5}, {{2}}).ok());
  ASSERT_TRUE(converge({db.get()}, *view, *f));
  EXPECT_EQ(compare(*view, *db), "");
  EXPECT_OK(f->stop());
  EXPECT_OK(p->stop());

  // Combinations no server could serve: InvalidArgument naming the fields.
  Config half = config;
  half.password.clear();
  Result<std::unique_ptr<Publisher>> r = Publisher::start(db.get(), half);
  ASSERT_EQ(r.status().code(), StatusCode::InvalidArgument) << r.status().to_string();
  EXPECT_NE(r.status().message().find("password"), std::string::npos) << r.status().to_string();
  Config both = config;
  both.token = "t0ken";
  Result<std::unique_ptr<Follower>> rf = Follower::start(view.get(), both, "view");
  ASSERT_EQ(rf.status().code(), StatusCode::InvalidArgument) << rf.status().to_string();
  EXPECT_NE(rf.status().message().find("token"), std::string::npos) << rf.status().to_string();
  Config quoted = config;
  quoted.password = "a\"b";
  r = Publisher::start(db.get(), quoted);
  ASSERT_EQ(r.status().code(), StatusCode::InvalidArgument) << r.status().to_string();
  EXPECT_NE(r.status().message().find("password"), std::string::npos) << r.status().to_string();
  Config missing = config;
  missing.user.clear();
  missing.password.clear();
  missing.creds_file = dir.sub("no-such.creds");
  r = Publisher::start(db.get(), missing);
  ASSERT_EQ(r.status().code(), StatusCode::InvalidArgument) << r.status().to_string();
  EXPECT_NE(r.status().message().find("creds_file"), std::string::npos) << r.status().to_string();
}

// A server that requires TLS and verifies client certificates (a CA, a
// server and a client certificate made with the openssl CLI): served with
// the CA and the client certificate; refused, and said so, without TLS,
// without the client certificate, or without the CA.
TEST(NatsSecurity, AServerThatRequiresTlsAndClientCertificatesIsServedWithThem) {
  if (std::system("command -v openssl > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "the openssl command-line tool is not installed: cannot make the test certificates";
  }
  TempDir certs;
  const std::string d = certs.sub("");
  const std::string ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";
  const std::string make =
      "cd '" + d + "' && "
      "openssl req -x509 " + ec + " -keyout ca.key -out ca.pem -days 2 -subj /CN=tidal-test-ca && "
      "openssl req " + ec + " -keyout server.key -out server.csr -subj /CN=127.0.0.1 && "
      "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nextendedKeyUsage=serverAuth\\n' > server.ext && "
      "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 "
      "-extfile server.ext && "
      "openssl req " + ec + " -keyout client.key -out client.csr -subj /CN=tidal-client && "
      "printf 'extendedKeyUsage=clientAuth\\n' > client.ext && "
      "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out client.pem -days 2 "
      "-extfile client.ext";
  ASSERT_EQ(std::system(("(" + make + ") > '" + d + "/openssl.log' 2>&1").c_str()), 0)
      << "openssl failed; see " << d << "/openssl.log";
  const std::string ca = d + "/ca.pem", cert = d + "/client.pem", key = d + "/client.key";
  const std::string tls = "tls {\n  cert_file: \"" + d + "/server.pem\"\n  key_file: \"" + d +
                          "/server.key\"\n  ca_file: \"" + ca + "\"\n  verify: true\n  timeout: 2\n}\n";
  NatsCluster cluster(1, tls, [&](natsOptions* o) {
    natsOptions_SetSecure(o, true);
    natsOptions_LoadCATrustedCertificates(o, ca.c_str());
    natsOptions_LoadCertificatesChain(o, cert.c_str(), key.c_str());
  });
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  Config config = test_config(cluster, "TLS", 1);
  config.request_timeout = 1000ms;
  auto db = open_shard(dir.sub("db"), 5);
  auto view = open_view(dir.sub("view"));
  ASSERT_TRUE(db && view);
  ASSERT_OK(db->join_community(1, 1));
  ASSERT_TRUE(db->signal_with_context({1, 3, 1.25}, {{2}}).ok());
  ASSERT_OK(db->flush());

  struct Case {
    const char* what;
    std::function<void(Config&)> edit;
  };
  const std::vector<Case> refused = {
      {"no TLS", [](Config&) {}},
      {"no client certificate", [&](Config& c) { c.tls_ca_file = ca; }},
      {"no CA (the server's certificate is not trusted)", [&](Config& c) {
         c.tls = true;
         c.tls_cert_file = cert;
         c.tls_key_file = key;
       }},
  };
  for (const Case& k : refused) {
    SCOPED_TRACE(k.what);
    Config c = config;
    k.edit(c);
    auto p = Publisher::start(db.get(), c);
    ASSERT_TRUE(p.ok()) << p.status().to_string();
    EXPECT_FALSE((*p)->stats().connected);
    const Status ps = (*p)->stop();
    EXPECT_EQ(ps.code(), StatusCode::IOError) << ps.to_string();
    EXPECT_NE(ps.message().find("127.0.0.1"), std::string::npos) << ps.to_string();
    std::cerr << k.what << ": " << ps.to_string() << "\n";
  }
  EXPECT_EQ(db->stats().change_feed_trimmed_seq, 0u);

  config.tls_ca_file = ca;
  config.tls_cert_file = cert;
  config.tls_key_file = key;
  auto p = start_publisher(db.get(), config);
  auto f = start_follower(view.get(), config, "view");
  ASSERT_TRUE(p && f);
  ASSERT_TRUE(db->signal_with_context({1, 4, 2.5}, {{2}}).ok());
  ASSERT_TRUE(converge({db.get()}, *view, *f));
  EXPECT_EQ(compare(*view, *db), "");
  EXPECT_OK(f->stop());
  EXPECT_OK(p->stop());
  // A certificate without its key is refused before any connection.
  Config half = config;
  half.tls_key_file.clear();
  Result<std::unique_ptr<Publisher>> r = Publisher::start(db.get(), half);
  ASSERT_EQ(r.status().code(), StatusCode::InvalidArgument) << r.status().to_string();
  EXPECT_NE(r.status().message().find("tls_key_file"), std::string::npos) << r.status().to_string();
}

// ---- A new view joins from another view's checkpoint ----

TEST(NatsCheckpoint, ANewViewJoinsFromACheckpointAndConvergesWithoutAGap) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = test_config(cluster, "JOIN", 3);
  std::vector<std::unique_ptr<Db>> shards;
  std::vector<std::unique_ptr<Publisher>> pubs;
  for (std::uint64_t s = 0; s < 2; ++s) {
    shards.push_back(open_shard(dir.sub("shard" + std::to_string(s)), s));
    pubs.push_back(start_publisher(shards.back().get(), config));
  }
  auto reference = tidal::testing::open_db(dir.sub("reference"));
  auto view_a = open_view(dir.sub("view_a"));
  auto fa = start_follower(view_a.get(), config, "view-a");
  ASSERT_TRUE(pubs[0] && pubs[1] && reference && view_a && fa);
  Workload w(41, 60);
  ASSERT_EQ(w.setup(raw(shards), reference.get()), "");
  for (int i = 0; i < 1500; ++i) ASSERT_EQ(w.step(raw(shards), reference.get()), "");
  ASSERT_TRUE(converge(raw(shards), *view_a, *fa));
  ASSERT_OK(view_a->checkpoint(dir.sub("view_b")));
  // Batches published after the checkpoint, before the new view's consumer exists.
  for (int i = 0; i < 1500; ++i) ASSERT_EQ(w.step(raw(shards), reference.get()), "");
  ASSERT_TRUE(converge(raw(shards), *view_a, *fa));

  auto view_b = open_view(dir.sub("view_b"));
  auto fb = start_follower(view_b.get(), config, "view-b");
  ASSERT_TRUE(view_b && fb);
  for (int i = 0; i < 1500; ++i) ASSERT_EQ(w.step(raw(shards), reference.get()), "");
  ASSERT_TRUE(converge(raw(shards), *view_b, *fb));
  ASSERT_TRUE(converge(raw(shards), *view_a, *fa));
  EXPECT_EQ(compare(*view_a, *reference), "");
  EXPECT_EQ(compare(*view_b, *reference), "");
  FollowerStats sb = fb->stats();
  EXPECT_EQ(sb.gaps, 0u) << sb.last_error;
  EXPECT_GT(sb.backfill_start_seq, 1u);  // the new consumer skipped what the checkpoint held
}

// Runs `steps` workload steps, flushing every shard every other step: a
// batch a flush, so thousands of batches in seconds.
std::string batches(Workload& w, const std::vector<Db*>& shards, Db* reference, int steps) {
  for (int i = 0; i < steps; ++i) {
    if (std::string e = w.step(shards, reference); !e.empty()) return e;
    if (i % 2 == 1) {
      for (Db* db : shards) {
        if (Status s = db->flush(); !s.ok()) return "flush: " + s.to_string();
      }
    }
  }
  return {};
}

// Sum over the shards of their feed's last seq.
std::uint64_t total_seq(const std::vector<Db*>& shards) {
  std::uint64_t n = 0;
  for (Db* db : shards) n += db->stats().change_feed_last_seq;
  return n;
}

// Probes the backfill may make: per subject, the last message, two binary
// searches over the stream's sequences and one more read.
std::uint64_t probe_bound(std::uint64_t subjects, std::uint64_t stream_total) {
  std::uint64_t log2 = 1;
  while ((std::uint64_t{1} << log2) < stream_total) ++log2;
  return subjects * (2 * (log2 + 1) + 2);
}

TEST(NatsCheckpoint, ANewViewFromACheckpointReadsOnlyWhatTheCheckpointLacks) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = test_config(cluster, "BACKFILL", 3);
  constexpr std::uint64_t kShards = 4;
  std::vector<std::unique_ptr<Db>> shards;
  std::vector<std::unique_ptr<Publisher>> pubs;
  for (std::uint64_t s = 0; s < kShards; ++s) {
    shards.push_back(open_shard(dir.sub("shard" + std::to_string(s)), s));
    pubs.push_back(start_publisher(shards.back().get(), config));
    ASSERT_TRUE(shards.back() && pubs.back());
  }
  auto reference = tidal::testing::open_db(dir.sub("reference"));
  auto view_a = open_view(dir.sub("view_a"));
  auto fa = start_follower(view_a.get(), config, "view-a");
  ASSERT_TRUE(reference && view_a && fa);
  Workload w(43, 80);
  ASSERT_EQ(w.setup(raw(shards), reference.get()), "");
  ASSERT_EQ(batches(w, raw(shards), reference.get(), 2000), "");
  ASSERT_TRUE(converge(raw(shards), *view_a, *fa));
  // Every published batch is applied by view A: the checkpoints hold the
  // stream's first `held` messages (~1,100), and nothing else.
  const std::uint64_t held = stream_messages(cluster, config.stream);
  ASSERT_EQ(held, total_seq(raw(shards)));
  ASSERT_GE(held, 800u);
  ASSERT_OK(view_a->checkpoint(dir.sub("view_b")));
  ASSERT_OK(view_a->checkpoint(dir.sub("view_c")));
  ASSERT_EQ(batches(w, raw(shards), reference.get(), 300), "");
  ASSERT_TRUE(converge(raw(shards), *view_a, *fa));
  const std::uint64_t total_b = stream_messages(cluster, config.stream);
  const std::uint64_t lacks_b = total_b - held;
  ASSERT_GE(lacks_b, 100u);

  // A new view from the checkpoint: its consumer starts right after what
  // the checkpoint holds, and it reads about what it lacks.
  {
    auto view_b = open_view(dir.sub("view_b"));
    auto fb = start_follower(view_b.get(), config, "view-b");
    ASSERT_TRUE(view_b && fb);
    ASSERT_TRUE(converge(raw(shards), *view_b, *fb));
    EXPECT_EQ(compare(*view_b, *reference), "");
    FollowerStats sb = fb->stats();
    std::cout << "backfill: stream " << total_b << " messages (" << stream_bytes(cluster, config.stream)
              << " bytes stored), the checkpoint lacks " << lacks_b << "; fetched "
              << sb.fetched_messages << " messages (" << sb.backfill_probes << " probes), " << sb.fetched_bytes
              << " bytes; starts at stream seq " << sb.backfill_start_seq << std::endl;
    EXPECT_EQ(sb.gaps, 0u) << sb.last_error;
    EXPECT_EQ(sb.backfill_start_seq, held + 1);
    EXPECT_LE(sb.backfill_probes, probe_bound(kShards, total_b));
    EXPECT_LE(sb.fetched_messages, lacks_b + sb.backfill_probes);
    EXPECT_LT(sb.fetched_messages * 4, total_b);  // far below the stream's total
    // The consumer keeps its position: a restarted Follower binds to it
    // and reads on from there.
    EXPECT_OK(fb->stop());
    fb.reset();
    ASSERT_EQ(batches(w, raw(shards), reference.get(), 100), "");
    fb = start_follower(view_b.get(), config, "view-b");
    ASSERT_NE(fb, nullptr);
    ASSERT_TRUE(converge(raw(shards), *view_b, *fb));
    EXPECT_EQ(compare(*view_b, *reference), "");
    sb = fb->stats();
    EXPECT_EQ(sb.backfill_probes, 0u);
    EXPECT_LE(sb.fetched_messages, stream_messages(cluster, config.stream) - total_b);
    EXPECT_OK(fb->stop());
  }

  // Shard 1 re-seeded after the checkpoint: a new view from the checkpoint
  // applies the re-seed's snapshot in place of what it held of shard 1.
  auto incarnation = [](const GlobalView& v, std::uint64_t shard) {
    Result<std::vector<ShardProgress>> all = v.applied_shards();
    EXPECT_TRUE(all.ok()) << all.status().to_string();
    for (const ShardProgress& p : all.ok() ? *all : std::vector<ShardProgress>{}) {
      if (p.shard_id == shard) return p.incarnation;
    }
    return std::string();
  };
  const std::string old_incarnation = incarnation(*view_a, 1);
  ASSERT_FALSE(old_incarnation.empty());
  ASSERT_TRUE(shards[1]->reseed_change_feed().ok());
  ASSERT_EQ(batches(w, raw(shards), reference.get(), 300), "");
  ASSERT_TRUE(converge(raw(shards), *view_a, *fa));
  ASSERT_NE(incarnation(*view_a, 1), old_incarnation);
  const std::uint64_t total_c = stream_messages(cluster, config.stream);
  {
    auto view_c = open_view(dir.sub("view_c"));
    auto fc = start_follower(view_c.get(), config, "view-c");
    ASSERT_TRUE(view_c && fc);
    ASSERT_TRUE(converge(raw(shards), *view_c, *fc));
    EXPECT_EQ(compare(*view_c, *reference), "");
    EXPECT_EQ(incarnation(*view_c, 1), incarnation(*view_a, 1));
    FollowerStats sc = fc->stats();
    std::cout << "backfill after a re-seed: stream " << total_c << " messages (" << stream_bytes(cluster, config.stream)
              << " bytes stored), the checkpoint lacks "
              << total_c - held << "; fetched " << sc.fetched_messages << " messages (" << sc.backfill_probes
              << " probes), " << sc.fetched_bytes << " bytes; starts at stream seq " << sc.backfill_start_seq
              << std::endl;
    EXPECT_EQ(sc.gaps, 0u) << sc.last_error;
    EXPECT_EQ(sc.backfill_start_seq, held + 1);
    EXPECT_LE(sc.fetched_messages, total_c - held + sc.backfill_probes);
    EXPECT_OK(fc->stop());
  }
  EXPECT_EQ(compare(*view_a, *reference), "");
  EXPECT_OK(fa->stop());
  for (auto& p : pubs) EXPECT_OK(p->stop());
}

// One shard, re-seeded after the checkpoint: the new consumer starts at the
// re-seed's first batch, which replaces all the view held of the shard, and
// skips the old incarnation's batches after the checkpoint too.
TEST(NatsCheckpoint, AShardReseededAfterTheCheckpointIsReadFromItsReseed) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = test_config(cluster, "BACKFILL1", 3);
  auto db = open_shard(dir.sub("shard"), 7);
  auto pub = start_publisher(db.get(), config);
  auto reference = tidal::testing::open_db(dir.sub("reference"));
  auto view_a = open_view(dir.sub("view_a"));
  auto fa = start_follower(view_a.get(), config, "view-a");
  ASSERT_TRUE(db && pub && reference && view_a && fa);
  Workload w(44, 40);
  ASSERT_EQ(w.setup({db.get()}, reference.get()), "");
  ASSERT_EQ(batches(w, {db.get()}, reference.get(), 1500), "");
  ASSERT_TRUE(converge({db.get()}, *view_a, *fa));
  ASSERT_OK(view_a->checkpoint(dir.sub("view_b")));
  const std::uint64_t held = stream_messages(cluster, config.stream);
  ASSERT_EQ(batches(w, {db.get()}, reference.get(), 400), "");
  ASSERT_TRUE(converge({db.get()}, *view_a, *fa));
  const std::uint64_t before_reseed = stream_messages(cluster, config.stream);
  ASSERT_GT(before_reseed, held + 50);
  ASSERT_TRUE(db->reseed_change_feed().ok());
  ASSERT_EQ(batches(w, {db.get()}, reference.get(), 200), "");
  ASSERT_TRUE(converge({db.get()}, *view_a, *fa));
  const std::uint64_t total = stream_messages(cluster, config.stream);

  auto view_b = open_view(dir.sub("view_b"));
  auto fb = start_follower(view_b.get(), config, "view-b");
  ASSERT_TRUE(view_b && fb);
  ASSERT_TRUE(converge({db.get()}, *view_b, *fb));
  EXPECT_EQ(compare(*view_b, *reference), "");
  FollowerStats sb = fb->stats();
  std::cout << "backfill of a re-seeded shard: stream " << total << " messages (" << stream_bytes(cluster, config.stream)
            << " bytes stored), the checkpoint holds " << held << ", re-seed at stream seq "
            << before_reseed + 1 << "; fetched " << sb.fetched_messages << " messages (" << sb.backfill_probes
            << " probes), " << sb.fetched_bytes << " bytes; starts at stream seq " << sb.backfill_start_seq
            << std::endl;
  EXPECT_EQ(sb.gaps, 0u) << sb.last_error;
  EXPECT_EQ(sb.backfill_start_seq, before_reseed + 1);
  EXPECT_LE(sb.fetched_messages, total - before_reseed + sb.backfill_probes);
  EXPECT_LE(sb.backfill_probes, probe_bound(1, total));
  EXPECT_OK(fb->stop());
  EXPECT_OK(fa->stop());
  EXPECT_OK(pub->stop());
}

// ---- A gap is reported and never skipped ----

// Batch `seq` of shard `shard` published by hand (no message id, no
// fence): what a repair tool or a test does; with the feed's incarnation
// and its ordinal when given, as the shard's Publisher would.
void publish_by_hand(jsCtx* js, const Config& config, std::uint64_t shard, std::uint64_t seq,
                     const std::string& payload, const std::string& incarnation = "", std::uint64_t ordinal = 0) {
  natsMsg* m = nullptr;
  const std::string subject = config.subject_prefix + "." + std::to_string(shard);
  ASSERT_EQ(natsMsg_Create(&m, subject.c_str(), nullptr, payload.data(), static_cast<int>(payload.size())), NATS_OK);
  ASSERT_EQ(natsMsgHeader_Set(m, "Tidal-Shard", std::to_string(shard).c_str()), NATS_OK);
  ASSERT_EQ(natsMsgHeader_Set(m, "Tidal-Seq", std::to_string(seq).c_str()), NATS_OK);
  if (!incarnation.empty()) {
    ASSERT_EQ(natsMsgHeader_Set(m, "Tidal-Incarnation", incarnation.c_str()), NATS_OK);
  }
  if (ordinal > 0) {
    ASSERT_EQ(natsMsgHeader_Set(m, "Tidal-Incarnation-Ordinal", std::to_string(ordinal).c_str()), NATS_OK);
  }
  const natsStatus ns = testing::publish_retrying(js, m, nullptr);
  natsMsg_Destroy(m);
  ASSERT_EQ(ns, NATS_OK) << natsStatus_GetText(ns);
}

// Batches 1..5 (or more) of `db`: five users joined to community 1, each
// signalled once with cohort 2, a flush after each.
std::vector<ChangeBatch> five_batches(Db* db) {
  for (std::uint64_t k = 1; k <= 5; ++k) {
    EXPECT_OK(db->join_community(k, 1));
    EXPECT_TRUE(db->signal_with_context({k, k, 1.5}, {{2}}).ok());
    EXPECT_OK(db->flush());
  }
  auto batches = db->read_changes(0, 64 << 20);
  EXPECT_TRUE(batches.ok() && batches->size() >= 5u);
  return batches.ok() ? std::move(*batches) : std::vector<ChangeBatch>();
}

TEST(NatsGap, AGapIsReportedNotAckedAndAppliedOnceTheMissingBatchArrives) {
  NatsCluster cluster(1);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  Config config = test_config(cluster, "GAP", 1);
  // Batches 1..5 of shard 9, from a real Db.
  auto db = open_shard(dir.sub("db"), 9);
  ASSERT_NE(db, nullptr);
  const std::vector<ChangeBatch> batches = five_batches(db.get());
  ASSERT_GE(batches.size(), 5u);
  // Publish the last batch first, by hand: the stream now has a gap at its start.
  natsConnection* nc = nullptr;
  jsCtx* js = nullptr;
  ASSERT_EQ(natsConnection_ConnectTo(&nc, cluster.servers().c_str()), NATS_OK);
  ASSERT_EQ(natsConnection_JetStream(&js, nc, nullptr), NATS_OK);
  jsStreamConfig sc;
  jsStreamConfig_Init(&sc);
  const std::string wildcard = config.subject_prefix + ".*";
  const char* subjects[] = {wildcard.c_str()};
  sc.Name = config.stream.c_str();
  sc.Subjects = subjects;
  sc.SubjectsLen = 1;
  ASSERT_EQ(js_AddStream(nullptr, js, &sc, nullptr, nullptr), NATS_OK);
  auto publish = [&](const ChangeBatch& b) { publish_by_hand(js, config, 9, b.seq, b.payload); };
  const ChangeBatch& last = batches.back();
  publish(last);
  auto view = open_view(dir.sub("view"));
  auto f = start_follower(view.get(), config, "view");
  ASSERT_TRUE(view && f);
  ASSERT_TRUE(eventually([&] { return f->stats().gaps >= 2; }, 10s)) << f->stats().last_error;  // refused, and again
  FollowerStats st = f->stats();
  EXPECT_TRUE(st.stalled_on_gap);
  EXPECT_NE(st.last_error.find("shard 9"), std::string::npos) << st.last_error;
  EXPECT_NE(st.last_error.find(std::to_string(last.seq)), std::string::npos) << st.last_error;
  EXPECT_NE(st.last_error.find("stream GAP"), std::string::npos) << st.last_error;
  EXPECT_EQ(*view->applied_seq(9), 0u);
  // The missing batches arrive: all are applied, the refused one too.
  for (std::size_t i = 0; i + 1 < batches.size(); ++i) publish(batches[i]);
  ASSERT_TRUE(eventually([&] { return *view->applied_seq(9) == last.seq; }, 10s)) << f->stats().last_error;
  EXPECT_EQ(compare(*view, *db), "");
  // The Follower's stats follow the view's applied seq a moment later
  // (failed once under ASan in a fresh-clone CI run when read at once).
  EXPECT_TRUE(eventually([&] { return !f->stats().stalled_on_gap; }, 10s)) << f->stats().last_error;
  jsCtx_Destroy(js);
  natsConnection_Destroy(nc);
}

// Issue 41 item 4: a shard parked on a gap no republish fills (the batch
// is gone), re-seeded by its operator as docs/SCALE.md says: the parked
// shard's repair applies the re-seed's first batch (of a new incarnation,
// at whatever seq), unparks the shard, and the view equals the shard's
// aggregates. Red with the former repair, which took only seq applied + 1:
// the re-seed was refused as one more gap and the shard stayed parked.
TEST(NatsGap, ReseedingAParkedShardUnparksItAndTheViewEqualsTheShard) {
  NatsCluster cluster(1);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = test_config(cluster, "GAPRESEED", 1);
  auto db = open_shard(dir.sub("db"), 9);
  ASSERT_NE(db, nullptr);
  const std::vector<ChangeBatch> batches = five_batches(db.get());
  ASSERT_GE(batches.size(), 5u);
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  ASSERT_EQ(js.add_stream("GAPRESEED", [](jsStreamConfig& sc) { sc.Replicas = 1; }), "");
  // Every batch but the third, as the shard's Publisher would have (with
  // the feed's incarnation): the third is lost for good.
  for (const ChangeBatch& b : batches) {
    if (b.seq != 3) {
      ASSERT_NO_FATAL_FAILURE(publish_by_hand(js.js(), config, 9, b.seq, b.payload, b.incarnation));
    }
  }
  auto view = open_view(dir.sub("view"));
  auto f = start_follower(view.get(), config, "view");
  ASSERT_TRUE(view && f);
  ASSERT_TRUE(eventually([&] { return f->stats().stalled_on_gap && *view->applied_seq(9) == 2; }, 10s))
      << f->stats().last_error;
  // The operator re-seeds the shard and starts its Publisher, which
  // publishes the snapshot over the old incarnation.
  Result<std::uint64_t> first = db->reseed_change_feed();
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  auto p = start_publisher(db.get(), config);
  ASSERT_NE(p, nullptr);
  ASSERT_TRUE(eventually([&] { return p->stats().published_seq == *db->last_change_seq(); }, 10s))
      << p->stats().last_error;
  EXPECT_EQ(p->stats().reseeds, 1u);
  ASSERT_TRUE(eventually([&] { return *view->applied_seq(9) == *db->last_change_seq(); }, 20s))
      << "applied " << *view->applied_seq(9) << " of " << *db->last_change_seq() << "; " << f->stats().last_error;
  EXPECT_TRUE(eventually([&] { return !f->stats().stalled_on_gap; }, 10s)) << f->stats().last_error;
  EXPECT_EQ(compare(*view, *db), "");
  // The shard flows again through the consumer.
  ASSERT_TRUE(db->signal_with_context({1, 77, 2.0}, {{2}}).ok());
  ASSERT_TRUE(converge({db.get()}, *view, *f, 20s));
  EXPECT_EQ(compare(*view, *db), "");
  EXPECT_OK(p->stop());
  EXPECT_OK(f->stop());
}

// Issue 64 item 6 through the Follower: shard 5 re-seeds three times (I0 ->
// I1 -> I2 -> I3) and its stream holds I0's batches, then I3's, then I1's
// and I2's published late (a stale writer's), then more of I3's. A view
// reading the stream applies I0 and I3 and skips every batch of I1 and I2
// (counted as superseded), through the consumer; and through a parked
// shard's repair, which reads the subject from its start, when one of I0's
// batches is lost. Both views end equal to the shard. (Red before views
// ordered incarnations: I1's late re-seed replaced the shard's
// contribution, and I3's later batches were skipped as of a replaced
// incarnation.)
TEST(NatsReseed, ALateViewSkipsEveryBatchOfAnOlderIncarnationPublishedAfterANewerOne) {
  NatsCluster cluster(1);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  auto db = open_shard(dir.sub("db"), 5);
  ASSERT_NE(db, nullptr);
  // Each incarnation's batches: a few users signalled, a flush after each.
  std::uint64_t user = 0;
  auto grow = [&](int n) {
    for (int k = 0; k < n; ++k) {
      ++user;
      EXPECT_OK(db->join_community(user, 1 + user % 3));
      EXPECT_TRUE(db->signal_with_context({user, user % 7, 1.5 + static_cast<double>(user)}, {{2 + user % 4}}).ok());
      EXPECT_OK(db->flush());
    }
  };
  auto read_from = [&](std::uint64_t after) {
    Result<std::vector<ChangeBatch>> batches = db->read_changes(after, 64 << 20);
    EXPECT_TRUE(batches.ok()) << batches.status().to_string();
    return batches.ok() ? std::move(*batches) : std::vector<ChangeBatch>();
  };
  std::vector<std::vector<ChangeBatch>> inc(4);
  grow(3);
  inc[0] = read_from(0);
  ASSERT_GE(inc[0].size(), 3u);
  for (std::size_t i = 1; i < inc.size(); ++i) {
    Result<std::uint64_t> first = db->reseed_change_feed();
    ASSERT_TRUE(first.ok()) << first.status().to_string();
    grow(2);
    inc[i] = read_from(*first - 1);
    ASSERT_GE(inc[i].size(), 2u);
    EXPECT_GT(inc[i].front().incarnation_ordinal, inc[i - 1].front().incarnation_ordinal);
  }
  const std::uint64_t i3_before = *db->last_change_seq();
  grow(2);
  // I3's batches after its first ones, as published so far (each stream's
  // round adds one).
  std::vector<ChangeBatch> i3_later = read_from(i3_before);
  ASSERT_FALSE(i3_later.empty());
  const std::size_t stale = inc[1].size() + inc[2].size();

  Js js(cluster);
  ASSERT_TRUE(js.ok());
  for (const char* stream : {"LATE", "LATEPARK"}) {
    SCOPED_TRACE(stream);
    const Config config = test_config(cluster, stream, 1);
    ASSERT_EQ(js.add_stream(stream, [](jsStreamConfig& sc) { sc.Replicas = 1; }), "");
    const bool lose_one = std::string(stream) == "LATEPARK";
    auto publish = [&](const std::vector<ChangeBatch>& run) {
      for (const ChangeBatch& b : run) {
        if (lose_one && b.incarnation == inc[0].front().incarnation && b.seq == 2) continue;  // lost for good
        ASSERT_NO_FATAL_FAILURE(
            publish_by_hand(js.js(), config, 5, b.seq, b.payload, b.incarnation, b.incarnation_ordinal));
      }
    };
    for (const std::vector<ChangeBatch>* run :
         std::initializer_list<const std::vector<ChangeBatch>*>{&inc[0], &inc[3], &inc[1], &inc[2], &i3_later}) {
      publish(*run);
    }
    auto view = open_view(dir.sub(std::string("view-") + stream));
    auto f = start_follower(view.get(), config, "view");
    ASSERT_TRUE(view && f);
    ASSERT_TRUE(eventually([&] { return caught_up({db.get()}, *view) && !f->stats().stalled_on_gap; }, 30s))
        << "applied " << *view->applied_seq(5) << " of " << *db->last_change_seq() << "; "
        << f->stats().last_error;
    EXPECT_EQ(compare(*view, *db), "");
    const FollowerStats st = f->stats();
    EXPECT_GE(st.superseded_skipped, stale) << st.last_error;  // a redelivery counts again
    Result<std::vector<ShardProgress>> progress = view->applied_shards();
    ASSERT_TRUE(progress.ok());
    ASSERT_EQ(progress->size(), 1u);
    EXPECT_EQ((*progress)[0].incarnation_ordinal, inc[3].front().incarnation_ordinal);
    // The shard flows on.
    ASSERT_TRUE(db->signal_with_context({1, 77, 2.0}, {{2}}).ok());
    ASSERT_OK(db->flush());
    const std::vector<ChangeBatch> next = read_from(i3_later.back().seq);
    ASSERT_FALSE(next.empty());
    publish(next);
    i3_later.insert(i3_later.end(), next.begin(), next.end());
    ASSERT_TRUE(eventually([&] { return caught_up({db.get()}, *view); }, 30s)) << f->stats().last_error;
    EXPECT_EQ(compare(*view, *db), "");
    EXPECT_OK(f->stop());
  }
}

// A Publisher does not publish a re-seed over a stream whose last batch of
// the shard has a higher ordinal (a host clock behind the one that made
// it): every view would skip it as older. It stops, naming both ordinals.
TEST(NatsFence, AReseedWhoseOrdinalIsNotAboveTheStreamsIsRefusedNamingBoth) {
  NatsCluster cluster(1);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = test_config(cluster, "ORDINAL", 1);
  auto db = open_shard(dir.sub("db"), 9);
  ASSERT_NE(db, nullptr);
  const std::vector<ChangeBatch> batches = five_batches(db.get());
  ASSERT_GE(batches.size(), 5u);
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  ASSERT_EQ(js.add_stream("ORDINAL", [](jsStreamConfig& sc) { sc.Replicas = 1; }), "");
  // Another incarnation's batch, of an ordinal far ahead of this host's clock.
  const std::string theirs(32, 'e');
  const std::uint64_t ahead = std::uint64_t{1} << 63;
  ASSERT_NO_FATAL_FAILURE(publish_by_hand(js.js(), config, 9, 1, batches[0].payload, theirs, ahead));
  ASSERT_TRUE(db->reseed_change_feed().ok());
  const std::uint64_t mine = db->stats().change_feed_incarnation_ordinal;
  ASSERT_LT(mine, ahead);
  const Status refused = testing::refusal(Publisher::start(db.get(), config));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.code(), StatusCode::Corruption) << refused.to_string();
  for (const std::string& word : {std::to_string(mine), std::to_string(ahead), theirs, db->stats().change_feed_incarnation,
                                  std::string("older")}) {
    EXPECT_NE(refused.message().find(word), std::string::npos) << word << ": " << refused.to_string();
  }
}

// Issue 41 (the follower's repair under file faults): the parked shard of
// the test above, re-seeded while the view's n-th file operation fails
// (once, then from then on), for every n the repair's apply reaches. The
// Follower either repairs the shard or refuses visibly (an error counted,
// its last_error naming the failure), never a silently wrong view; when it
// refuses, the operator restarts it on the view reopened. Then the shard is
// unparked and the view equals the shard, bit for bit, also after the view
// is reopened. Red before the Follower's start looked for shards left
// behind: the restarted Follower never read the re-seed its predecessor had
// terminated while the shard was parked (the view stayed at seq 2 of 6,
// with no error, no lag and no parked shard reported).
TEST(NatsGap, AParkedShardsRepairFailingAtAnyFileOperationOfTheViewEndsExactOnceRestarted) {
  NatsCluster cluster(1);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  int refused = 0, repaired = 0, runs = 0;
  for (bool persistent : {false, true}) {
  for (std::uint64_t n = 1; n < 200 && !::testing::Test::HasFailure(); ++n) {
    ++runs;
    SCOPED_TRACE("the view's file operation " + std::to_string(n) + " fails" + (persistent ? ", and every later one" : ""));
    const std::string stream = "GAPFAULT" + std::to_string(runs), run = dir.sub("run" + std::to_string(runs));
    std::filesystem::create_directories(run);
    const Config config = test_config(cluster, stream, 1);
    auto db = open_shard(run + "/db", 9);
    ASSERT_NE(db, nullptr);
    const std::vector<ChangeBatch> batches = five_batches(db.get());
    ASSERT_GE(batches.size(), 5u);
    ASSERT_EQ(js.add_stream(stream, [](jsStreamConfig& sc) { sc.Replicas = 1; }), "");
    for (const ChangeBatch& b : batches) {
      if (b.seq != 3) {
        ASSERT_NO_FATAL_FAILURE(publish_by_hand(js.js(), config, 9, b.seq, b.payload, b.incarnation));
      }
    }
    reliability::FaultEnv fault = reliability::FaultEnv::make();
    std::unique_ptr<GlobalView> view;
    {
      Result<std::unique_ptr<GlobalView>> opened = GlobalView::Impl::open(run + "/view", {}, fault.env.get());
      ASSERT_TRUE(opened.ok()) << opened.status().to_string();
      view = std::move(*opened);
    }
    auto f = start_follower(view.get(), config, "view");
    ASSERT_NE(f, nullptr);
    ASSERT_TRUE(eventually([&] { return f->stats().stalled_on_gap && *view->applied_seq(9) == 2; }, 10s))
        << f->stats().last_error;
    const std::uint64_t errors_before = f->stats().errors;
    fault.fs->fail_nth_op(n, persistent);
    ASSERT_OK(db->reseed_change_feed());
    auto p = start_publisher(db.get(), config);
    ASSERT_NE(p, nullptr);
    const auto repaired_now = [&] { return caught_up({db.get()}, *view) && !f->stats().stalled_on_gap; };
    const auto failed_now = [&] { return f->stats().errors > errors_before; };
    ASSERT_TRUE(eventually([&] { return repaired_now() || failed_now(); }, 20s))
        << "neither repaired nor refused: " << f->stats().last_error;
    const bool reached = fault.fs->faults_injected() > 0;
    fault.fs->clear_faults();
    if (!repaired_now() && failed_now()) {
      const FollowerStats st = f->stats();
      EXPECT_FALSE(st.last_error.empty()) << "an error counted, none reported";
      // A failure the next attempt gets past repairs on its own; one that
      // leaves the view's handle refusing waits for the operator.
      if (!eventually(repaired_now, 3s)) {
        ++refused;
        (void)f->stop();
        f.reset();
        (void)view->close();
        view = open_view(run + "/view");
        ASSERT_NE(view, nullptr);
        f = start_follower(view.get(), config, "view");
        ASSERT_NE(f, nullptr);
      }
    } else {
      ++repaired;
    }
    ASSERT_TRUE(eventually(repaired_now, 20s)) << "applied " << *view->applied_seq(9) << " of "
                                               << *db->last_change_seq() << "; " << f->stats().last_error;
    EXPECT_EQ(compare(*view, *db), "");
    EXPECT_OK(p->stop());
    EXPECT_OK(f->stop());
    f.reset();
    EXPECT_OK(view->close());
    view = open_view(run + "/view");
    ASSERT_NE(view, nullptr);
    EXPECT_EQ(compare(*view, *db), "") << "after the view's reopen";
    EXPECT_OK(view->close());
    EXPECT_OK(db->close());
    if (!reached) break;  // the repair no longer reaches operation n
  }
  }
  std::printf("[ figures ] follower repair sweep: %d runs: %d refused (restarted), %d repaired on their own or "
              "unhurt\n",
              runs, refused, repaired);
  EXPECT_GT(refused, 0) << "no injected fault made the follower refuse";
}

// Not on a temporary: the pointer would dangle (ASan caught one).
const FollowerShardStats* shard_stats(const FollowerStats&& st, std::uint64_t shard) = delete;
const FollowerShardStats* shard_stats(const FollowerStats& st, std::uint64_t shard) {
  for (const FollowerShardStats& s : st.shards) {
    if (s.shard_id == shard) return &s;
  }
  return nullptr;
}

// Issue 27 item 3: more refused messages in one of 4 shards than the consumer's
// MaxAckPending (the server's default of 1,000, which the Follower used to
// leave in place, and Config::max_ack_pending) must not freeze the other
// shards, and the missing batch, republished after them, must be applied.
// Red with the former Follower (one consumer, refused messages NAKed and
// left pending): shards 0 to 2 stopped applying once 1,000 refusals of
// shard 9 were pending, and the republished batch was never delivered.
TEST(NatsGap, AGapParksItsShardOnlyWhileTheOthersFlowAndTheRepublishedBatchIsApplied) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = test_config(cluster, "PARK", 3);
  constexpr std::uint64_t kGapShard = 9, kRefused = 1100;
  ASSERT_GT(kRefused, static_cast<std::uint64_t>(config.max_ack_pending));
  ASSERT_GT(kRefused, 1000u);
  // Shard 9's batch payload: one signal on cells the workload never reads
  // (cohort 50, item 99), so compare() checks shards 0 and 1 alone. A
  // payload does not carry its seq: the same one serves every seq.
  auto db9 = open_shard(dir.sub("db9"), kGapShard);
  ASSERT_NE(db9, nullptr);
  ASSERT_OK(db9->join_community(1, 1));
  ASSERT_TRUE(db9->signal_with_context({1, 99, 2.5}, {{50}}).ok());
  ASSERT_OK(db9->flush());
  auto batches = db9->read_changes(0, 64 << 20);
  ASSERT_TRUE(batches.ok());
  ASSERT_EQ(batches->size(), 1u);
  const std::string payload = batches->front().payload;

  std::vector<std::unique_ptr<Db>> shards;
  std::vector<std::unique_ptr<Publisher>> pubs;
  for (std::uint64_t s = 0; s < 3; ++s) {
    shards.push_back(open_shard(dir.sub("shard" + std::to_string(s)), s));
    pubs.push_back(start_publisher(shards.back().get(), config));
  }
  auto reference = tidal::testing::open_db(dir.sub("reference"));
  auto view = open_view(dir.sub("view"));
  auto f = start_follower(view.get(), config, "view");
  ASSERT_TRUE(pubs[0] && pubs[1] && pubs[2] && reference && view && f);
  Workload w(77, 60);
  ASSERT_EQ(w.setup(raw(shards), reference.get()), "");
  ASSERT_TRUE(converge(raw(shards), *view, *f));

  // Shard 9's seqs 2..1101 reach the stream; seq 1 never did (lost).
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  for (std::uint64_t seq = 2; seq <= kRefused + 1; ++seq) {
    ASSERT_NO_FATAL_FAILURE(publish_by_hand(js.js(), config, kGapShard, seq, payload));
  }
  ASSERT_TRUE(eventually([&] { return f->stats().stalled_on_gap; }, 20s)) << f->stats().last_error;

  // The other shards keep applying: each round, from the shards' flush to
  // the view holding all of it (the former Follower never caught up once
  // 1,000 refusals were pending). How fast is a measurement, not asserted
  // here (a test runs beside others): 30-60 ms a round on 2 busy cores
  // while shard 9's repair reads its 1,100 messages, against SCALE.md's p99
  // lag target of 2 x period + 500 ms; printed below.
  std::string took;
  for (int round = 0; round < 6; ++round) {
    for (int i = 0; i < 300; ++i) ASSERT_EQ(w.step(raw(shards), reference.get()), "");
    const auto t0 = std::chrono::steady_clock::now();
    ASSERT_TRUE(converge(raw(shards), *view, *f, 10s)) << "round " << round;
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
    took += " " + std::to_string(ms.count());
  }
  std::cerr << "converged in (ms):" << took << "\n";
  EXPECT_EQ(compare(*view, *reference), "");
  FollowerStats st = f->stats();
  const FollowerShardStats* gap = shard_stats(st, kGapShard);
  ASSERT_NE(gap, nullptr);
  EXPECT_TRUE(gap->parked);
  EXPECT_TRUE(st.stalled_on_gap);
  EXPECT_EQ(gap->applied_seq, 0u);
  EXPECT_EQ(gap->stream_seq, kRefused + 1);
  EXPECT_EQ(gap->lag_batches, kRefused + 1);
  EXPECT_GE(gap->refused, 1u);
  for (const std::string& word : {std::string("shard 9"), std::string("stream PARK"), std::string("consumer view"),
                                  std::string("applied through 0")}) {
    EXPECT_NE(gap->last_error.find(word), std::string::npos) << word << ": " << gap->last_error;
  }
  for (std::uint64_t s = 0; s < 3; ++s) {
    const FollowerShardStats* ok = shard_stats(st, s);
    ASSERT_NE(ok, nullptr) << s;
    EXPECT_FALSE(ok->parked) << s;
    EXPECT_EQ(ok->lag_batches, 0u) << s;
    EXPECT_EQ(ok->applied_seq, *shards[s]->last_change_seq()) << s;
    EXPECT_EQ(ok->last_error, "") << s;  // shard 9's refusals are its own
  }
  EXPECT_EQ(*view->applied_seq(kGapShard), 0u);

  // The missing batch is republished, after the 1,100 it precedes: shard 9
  // catches up, every one of its batches applied once, while the others flow.
  ASSERT_NO_FATAL_FAILURE(publish_by_hand(js.js(), config, kGapShard, 1, payload));
  for (int i = 0; i < 300; ++i) ASSERT_EQ(w.step(raw(shards), reference.get()), "");
  ASSERT_TRUE(eventually([&] { return *view->applied_seq(kGapShard) == kRefused + 1; }, 30s))
      << "applied " << *view->applied_seq(kGapShard) << "; " << f->stats().last_error;
  ASSERT_TRUE(converge(raw(shards), *view, *f, 10s));
  EXPECT_EQ(compare(*view, *reference), "");
  Result<double> one = db9->cohort_score(50, 99);
  Result<double> all = view->cohort_score(50, 99);
  ASSERT_TRUE(one.ok() && all.ok());
  EXPECT_NEAR(*all, *one * static_cast<double>(kRefused + 1), 1e-9 * *all);
  // Unparked once its read reached the stream's end (seq 1, last there).
  EXPECT_TRUE(eventually([&] { return !f->stats().stalled_on_gap; }, 5s));
  st = f->stats();
  gap = shard_stats(st, kGapShard);
  ASSERT_NE(gap, nullptr);
  EXPECT_FALSE(gap->parked);
  EXPECT_EQ(gap->lag_batches, 0u);
  // A later batch of shard 9 flows through the consumer again.
  ASSERT_NO_FATAL_FAILURE(publish_by_hand(js.js(), config, kGapShard, kRefused + 2, payload));
  ASSERT_TRUE(eventually([&] { return *view->applied_seq(kGapShard) == kRefused + 2; }, 10s)) << f->stats().last_error;
  EXPECT_FALSE(f->stats().stalled_on_gap);
  EXPECT_OK(f->stop());
}

// A view whose durable consumer an older Follower created (server defaults:
// MaxAckPending 1,000) keeps working: the Follower sets its settings on it.
TEST(NatsGap, AConsumerCreatedByAnOlderFollowerGetsTheExplicitSettings) {
  NatsCluster cluster(1);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  Config config = test_config(cluster, "OLDCONS", 1);
  config.max_ack_pending = 256;
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  ASSERT_EQ(js.add_stream("OLDCONS", [](jsStreamConfig& sc) { sc.Replicas = 1; }), "");
  // The former Follower's consumer: no MaxAckPending.
  const std::string filter = config.subject_prefix + ".*";
  jsConsumerConfig cc;
  jsConsumerConfig_Init(&cc);
  cc.Durable = "view";
  cc.DeliverPolicy = js_DeliverAll;
  cc.AckPolicy = js_AckExplicit;
  cc.AckWait = static_cast<std::int64_t>(config.ack_wait.count()) * 1'000'000;
  cc.MaxDeliver = -1;
  cc.FilterSubject = filter.c_str();
  jsConsumerInfo* ci = nullptr;
  ASSERT_EQ(js_AddConsumer(&ci, js.js(), "OLDCONS", &cc, nullptr, nullptr), NATS_OK);
  EXPECT_NE(ci->Config->MaxAckPending, 256);
  jsConsumerInfo_Destroy(ci);
  auto db = open_shard(dir.sub("db"), 2);
  auto view = open_view(dir.sub("view"));
  ASSERT_TRUE(db && view);
  auto p = start_publisher(db.get(), config);
  auto f = start_follower(view.get(), config, "view");
  ASSERT_TRUE(p && f);
  ASSERT_OK(db->join_community(1, 1));
  ASSERT_TRUE(db->signal_with_context({1, 1, 1.0}, {{1}}).ok());
  ASSERT_TRUE(converge({db.get()}, *view, *f));
  ci = nullptr;
  ASSERT_EQ(js_GetConsumerInfo(&ci, js.js(), "OLDCONS", "view", nullptr, nullptr), NATS_OK);
  EXPECT_EQ(ci->Config->MaxAckPending, 256);
  jsConsumerInfo_Destroy(ci);
  EXPECT_OK(f->stop());
  EXPECT_OK(p->stop());
}

// A Follower stopped while a shard is parked has terminated that shard's
// messages on the consumer; the next Follower of the view, whose consumer
// delivers only later ones, still finds them: its first park of the shard
// reads the shard's subject from its first message.
TEST(NatsGap, AFollowerRestartedWhileAShardIsParkedStillAppliesEveryBatch) {
  NatsCluster cluster(1);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const Config config = test_config(cluster, "REPARK", 1);
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  ASSERT_EQ(js.add_stream("REPARK", [](jsStreamConfig& sc) { sc.Replicas = 1; }), "");
  auto db = open_shard(dir.sub("db"), 9);
  ASSERT_NE(db, nullptr);
  ASSERT_OK(db->join_community(1, 1));
  ASSERT_TRUE(db->signal_with_context({1, 99, 2.5}, {{50}}).ok());
  ASSERT_OK(db->flush());
  auto batches = db->read_changes(0, 64 << 20);
  ASSERT_TRUE(batches.ok() && batches->size() == 1u);
  const std::string payload = batches->front().payload;
  auto view = open_view(dir.sub("view"));
  ASSERT_NE(view, nullptr);
  for (std::uint64_t seq = 2; seq <= 50; ++seq) ASSERT_NO_FATAL_FAILURE(publish_by_hand(js.js(), config, 9, seq, payload));
  {
    auto f = start_follower(view.get(), config, "view");
    ASSERT_NE(f, nullptr);
    ASSERT_TRUE(eventually([&] {
      const FollowerStats st_1 = f->stats();
      const FollowerShardStats* s = shard_stats(st_1, 9);
      return s != nullptr && s->parked && s->stream_seq == 50;
    }, 10s));
    std::this_thread::sleep_for(500ms);  // the consumer has delivered (and terminated) 2..50
    EXPECT_OK(f->stop());
  }
  for (std::uint64_t seq = 51; seq <= 60; ++seq) ASSERT_NO_FATAL_FAILURE(publish_by_hand(js.js(), config, 9, seq, payload));
  auto f = start_follower(view.get(), config, "view");
  ASSERT_NE(f, nullptr);
  ASSERT_TRUE(eventually([&] { return f->stats().stalled_on_gap; }, 10s));
  ASSERT_NO_FATAL_FAILURE(publish_by_hand(js.js(), config, 9, 1, payload));
  ASSERT_TRUE(eventually([&] { return *view->applied_seq(9) == 60; }, 20s))
      << "applied " << *view->applied_seq(9) << ": " << f->stats().last_error;
  // The view's seq is durable before the Follower's stats say so.
  EXPECT_TRUE(eventually([&] { return !f->stats().stalled_on_gap; }, 10s));
  EXPECT_OK(f->stop());
}

// A batch delivered to another client of the consumer (or to a connection
// that died) comes back only after the batches behind it: the shard parks
// on the next one, and its repair must read the held-back batch from the
// stream, since the consumer's redelivery of it is terminated while the
// shard is parked. Here shard 9 has parked once already (on 3, before 2
// arrived); then another client holds 4 unacked while 5 parks the shard,
// and hands 4 back. Red with the former repair, whose later parks read from
// the refused message (5): parked for good, applied through 3 (the cluster
// test's failure in CI: "shard 2 has applied through 21; batch seq 57").
TEST(NatsGap, ABatchHeldBackPastALaterParkIsReadByTheRepair) {
  NatsCluster cluster(1);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  Config config = test_config(cluster, "HELDBACK", 1);
  config.ack_wait = 30s;  // the other client's message comes back when it says so
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  ASSERT_EQ(js.add_stream("HELDBACK", [](jsStreamConfig& sc) { sc.Replicas = 1; }), "");
  auto db = open_shard(dir.sub("db"), 9);
  ASSERT_NE(db, nullptr);
  const std::vector<ChangeBatch> batches = five_batches(db.get());
  ASSERT_EQ(batches.size(), 5u);
  auto publish = [&](std::uint64_t seq) {
    publish_by_hand(js.js(), config, 9, seq, batches[seq - 1].payload, batches[seq - 1].incarnation);
  };
  auto view = open_view(dir.sub("view"));
  auto f = start_follower(view.get(), config, "view");
  ASSERT_TRUE(view && f);
  // A first park and its repair: 1 and 3, then 2.
  ASSERT_NO_FATAL_FAILURE(publish(1));
  ASSERT_NO_FATAL_FAILURE(publish(3));
  ASSERT_TRUE(eventually([&] { return f->stats().stalled_on_gap; }, 10s)) << f->stats().last_error;
  ASSERT_NO_FATAL_FAILURE(publish(2));
  ASSERT_TRUE(eventually([&] { return *view->applied_seq(9) == 3 && !f->stats().stalled_on_gap; }, 10s))
      << f->stats().last_error;
  // Another client of the consumer asks for one message; once the
  // Follower's pull request of that moment has expired (500 ms), the other
  // client's request is the oldest waiting, and 4 goes to it.
  natsSubscription* other = nullptr;
  jsSubOptions so;
  jsSubOptions_Init(&so);
  so.Stream = "HELDBACK";
  so.Consumer = "view";
  const std::string filter = config.subject_prefix + ".*";
  ASSERT_EQ(js_PullSubscribe(&other, js.js(), filter.c_str(), "view", nullptr, &so, nullptr), NATS_OK);
  natsMsgList held{nullptr, 0};
  natsStatus fetched = NATS_OK;
  std::thread thief([&] { fetched = natsSubscription_Fetch(&held, other, 1, 10000, nullptr); });
  std::this_thread::sleep_for(1500ms);
  ASSERT_NO_FATAL_FAILURE(publish(4));
  thief.join();
  ASSERT_EQ(fetched, NATS_OK) << natsStatus_GetText(fetched);
  ASSERT_EQ(held.Count, 1);
  const char* seq = nullptr;
  ASSERT_EQ(natsMsgHeader_Get(held.Msgs[0], "Tidal-Seq", &seq), NATS_OK);
  ASSERT_STREQ(seq, "4") << "the other client was to hold batch 4";
  // 5 arrives first: the shard parks.
  ASSERT_NO_FATAL_FAILURE(publish(5));
  ASSERT_TRUE(eventually([&] { return f->stats().stalled_on_gap; }, 10s)) << f->stats().last_error;
  EXPECT_EQ(*view->applied_seq(9), 3u);
  // 4 comes back (its consumer delivery is terminated: the shard is parked).
  EXPECT_EQ(natsMsg_Nak(held.Msgs[0], nullptr), NATS_OK);
  natsMsgList_Destroy(&held);
  natsSubscription_Destroy(other);
  ASSERT_TRUE(eventually([&] { return *view->applied_seq(9) == 5; }, 15s))
      << "applied through " << *view->applied_seq(9) << ": " << f->stats().last_error;
  EXPECT_EQ(compare(*view, *db), "");
  EXPECT_TRUE(eventually([&] { return !f->stats().stalled_on_gap; }, 10s)) << f->stats().last_error;
  EXPECT_OK(f->stop());
}

// An empty fetch is not "no lag": while the server holds messages back (here
// another client of the same durable consumer holds MaxAckPending of them
// unacked), lag_messages counts what the consumer has not delivered. Red
// with the former Follower: it reported 0 after each empty fetch.
TEST(NatsGap, LagCountsWhatTheServerHoldsBackWhenAFetchIsEmpty) {
  NatsCluster cluster(1);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  Config config = test_config(cluster, "HELD", 1);
  config.max_ack_pending = 64;
  config.fetch_batch = 64;
  config.ack_wait = 30s;
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  ASSERT_EQ(js.add_stream("HELD", [](jsStreamConfig& sc) { sc.Replicas = 1; }), "");
  const std::string filter = config.subject_prefix + ".*";
  jsConsumerConfig cc;
  jsConsumerConfig_Init(&cc);
  cc.Durable = "view";
  cc.DeliverPolicy = js_DeliverAll;
  cc.AckPolicy = js_AckExplicit;
  cc.AckWait = static_cast<std::int64_t>(config.ack_wait.count()) * 1'000'000;
  cc.MaxDeliver = -1;
  cc.MaxAckPending = config.max_ack_pending;
  cc.FilterSubject = filter.c_str();
  ASSERT_EQ(js_AddConsumer(nullptr, js.js(), "HELD", &cc, nullptr, nullptr), NATS_OK);
  auto db = open_shard(dir.sub("db"), 3);
  ASSERT_NE(db, nullptr);
  ASSERT_OK(db->join_community(1, 1));
  ASSERT_TRUE(db->signal_with_context({1, 99, 2.5}, {{50}}).ok());
  ASSERT_OK(db->flush());
  auto batches = db->read_changes(0, 64 << 20);
  ASSERT_TRUE(batches.ok() && batches->size() == 1u);
  constexpr std::uint64_t kBatches = 200;
  for (std::uint64_t seq = 1; seq <= kBatches; ++seq) {
    ASSERT_NO_FATAL_FAILURE(publish_by_hand(js.js(), config, 3, seq, batches->front().payload));
  }
  // Another client takes 64 messages of the consumer and holds them.
  natsSubscription* other = nullptr;
  jsSubOptions so;
  jsSubOptions_Init(&so);
  so.Stream = "HELD";
  so.Consumer = "view";
  ASSERT_EQ(js_PullSubscribe(&other, js.js(), filter.c_str(), "view", nullptr, &so, nullptr), NATS_OK);
  natsMsgList held{nullptr, 0};
  ASSERT_EQ(natsSubscription_Fetch(&held, other, config.max_ack_pending, 2000, nullptr), NATS_OK);
  ASSERT_EQ(held.Count, config.max_ack_pending);

  auto view = open_view(dir.sub("view"));
  auto f = start_follower(view.get(), config, "view");
  ASSERT_TRUE(view && f);
  // Its fetches come back empty; after one, at most every half second, it
  // reads the consumer's pending count into lag_messages.
  const std::uint64_t unheld = kBatches - static_cast<std::uint64_t>(config.max_ack_pending);
  EXPECT_TRUE(eventually([&] { return f->stats().lag_messages >= unheld; }, 10s))
      << "lag_messages " << f->stats().lag_messages << ", expected at least " << unheld;
  EXPECT_EQ(*view->applied_seq(3), 0u);
  // The other client hands its messages back: everything is applied, lag 0.
  for (int i = 0; i < held.Count; ++i) EXPECT_EQ(natsMsg_Nak(held.Msgs[i], nullptr), NATS_OK);
  natsMsgList_Destroy(&held);
  natsSubscription_Destroy(other);
  ASSERT_TRUE(eventually([&] { return *view->applied_seq(3) == kBatches; }, 20s)) << f->stats().last_error;
  EXPECT_TRUE(eventually([&] { return f->stats().lag_messages == 0; }, 5s)) << f->stats().lag_messages;
  EXPECT_OK(f->stop());
}

// PublisherStats and FollowerStats in the Prometheus text format: the text
// parses by the format's rules and each value is the field it names
// (no cluster needed: the stats are what a host would read).
TEST(NatsMetrics, PublisherAndFollowerStatsRenderAsPrometheusText) {
  PublisherStats p;
  p.shard_id = 7;
  p.published_seq = 41;
  p.last_change_seq = 45;
  p.lag_batches = 4;
  p.lag_bytes = 1234;
  p.published_batches = 40;
  p.duplicates = 2;
  p.errors = 3;
  p.connects = 1;
  p.reseeds = 6;
  p.connected = true;
  p.halted = true;
  Result<std::string> text = prometheus_text(p, {{"host", "a"}});
  ASSERT_TRUE(text.ok()) << text.status().to_string();
  std::vector<tidal::testing::Sample> samples = tidal::testing::parse(*text);
  ASSERT_FALSE(::testing::Test::HasFailure()) << *text;
  EXPECT_EQ(samples.size(), 11u);
  for (const auto& s : samples) EXPECT_EQ(s.labels, (MetricLabels{{"host", "a"}, {"shard", "7"}})) << s.name;
  EXPECT_EQ(tidal::testing::one(samples, "tidal_publisher_reseeds_total").value, 6u);
  EXPECT_EQ(tidal::testing::one(samples, "tidal_publisher_published_seq").value, 41u);
  EXPECT_EQ(tidal::testing::one(samples, "tidal_publisher_lag_batches").value, 4u);
  EXPECT_EQ(tidal::testing::one(samples, "tidal_publisher_lag_bytes").value, 1234u);
  EXPECT_EQ(tidal::testing::one(samples, "tidal_publisher_duplicates_total").value, 2u);
  EXPECT_EQ(tidal::testing::one(samples, "tidal_publisher_errors_total").value, 3u);
  EXPECT_EQ(tidal::testing::one(samples, "tidal_publisher_halted").value, 1u);

  FollowerStats f;
  f.applied = {{1, 10, ""}, {3, 2, ""}};
  f.applied_batches = 12;
  f.gaps = 5;
  f.lag_messages = 9;
  f.stalled_on_gap = true;
  f.fetched_messages = 1507;
  f.fetched_bytes = 123456789;
  f.backfill_start_seq = 4001;
  f.backfill_probes = 31;
  FollowerShardStats parked_shard;
  parked_shard.shard_id = 3;
  parked_shard.applied_seq = 2;
  parked_shard.stream_seq = 1102;
  parked_shard.lag_batches = 1100;
  parked_shard.parked = true;
  parked_shard.refused = 1100;
  parked_shard.last_error = "gap \"quoted\"\n";  // never rendered: text is no sample
  FollowerShardStats flowing;
  flowing.shard_id = 1;
  flowing.applied_seq = 10;
  flowing.stream_seq = 10;
  f.shards = {flowing, parked_shard};
  text = prometheus_text(f);
  ASSERT_TRUE(text.ok()) << text.status().to_string();
  samples = tidal::testing::parse(*text);
  ASSERT_FALSE(::testing::Test::HasFailure()) << *text;
  EXPECT_EQ(tidal::testing::one(samples, "tidal_follower_applied_batches_total").value, 12u);
  EXPECT_EQ(tidal::testing::one(samples, "tidal_follower_gaps_total").value, 5u);
  EXPECT_EQ(tidal::testing::one(samples, "tidal_follower_lag_messages").value, 9u);
  EXPECT_EQ(tidal::testing::one(samples, "tidal_follower_stalled_on_gap").value, 1u);
  EXPECT_EQ(tidal::testing::one(samples, "tidal_follower_fetched_messages_total").value, 1507u);
  EXPECT_EQ(tidal::testing::one(samples, "tidal_follower_fetched_bytes_total").value, 123456789u);
  EXPECT_EQ(tidal::testing::one(samples, "tidal_follower_backfill_start_seq").value, 4001u);
  EXPECT_EQ(tidal::testing::one(samples, "tidal_follower_backfill_probes_total").value, 31u);
  std::map<std::string, std::uint64_t> applied;
  for (const auto& s : samples) {
    if (s.name == "tidal_follower_applied_seq") applied[s.labels.at(0).second] = s.value;
  }
  EXPECT_EQ(applied, (std::map<std::string, std::uint64_t>{{"1", 10}, {"3", 2}}));
  // Per shard: seen seq, lag, parked and refusals, one sample per shard each.
  std::map<std::string, std::map<std::string, std::uint64_t>> per_shard;
  for (const auto& s : samples) {
    if (s.name.rfind("tidal_follower_shard_", 0) == 0) {
      ASSERT_EQ(s.labels.size(), 1u) << s.name;
      EXPECT_EQ(s.labels.at(0).first, "shard");
      per_shard[s.name][s.labels.at(0).second] = s.value;
    }
  }
  EXPECT_EQ(per_shard["tidal_follower_shard_stream_seq"], (std::map<std::string, std::uint64_t>{{"1", 10}, {"3", 1102}}));
  EXPECT_EQ(per_shard["tidal_follower_shard_lag_batches"], (std::map<std::string, std::uint64_t>{{"1", 0}, {"3", 1100}}));
  EXPECT_EQ(per_shard["tidal_follower_shard_parked"], (std::map<std::string, std::uint64_t>{{"1", 0}, {"3", 1}}));
  EXPECT_EQ(per_shard["tidal_follower_shard_refused_total"], (std::map<std::string, std::uint64_t>{{"1", 0}, {"3", 1100}}));
  EXPECT_EQ(per_shard.size(), 4u);
  // A label clashing with the per-shard one is refused.
  Result<std::string> clash = prometheus_text(p, {{"shard", "x"}});
  EXPECT_EQ(clash.status().code(), StatusCode::InvalidArgument);
}

}  // namespace
}  // namespace tidal::nats
