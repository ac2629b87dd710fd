// internal::Pull, the Follower's and the recovery's reader of a JetStream
// pull consumer, against a real nats-server: a fetch never returns more
// than its batch, however many messages of earlier requests are queued or
// still arriving, and every message is read exactly once.
//
// libnats 3.4's own fetch (natsSubscription_FetchRequest), which tidal
// used before, writes past its array in exactly this situation (nats.c
// #749): in the first test's set-up it returned 90 messages in the array
// it had sized for 40, and a Follower through a stream leader change
// aborted in CI with "malloc(): invalid size".
#include <chrono>
#include <set>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <nats/nats.h>

#include "../test_util.h"
#include "nats/client.h"
#include "nats_cluster.h"
#include "nats_test_util.h"

namespace tidal::nats {
namespace {

using namespace std::chrono_literals;
using internal::Connection;
using internal::Fetched;
using internal::Pull;
using testing::Js;
using testing::NatsCluster;
using testing::test_config;

constexpr const char* kSubject = "tidal.PULL.1";

void publish(jsCtx* js, int from, int to) {
  for (int i = from; i <= to; ++i) {
    const std::string data = "message " + std::to_string(i);
    ASSERT_EQ(js_Publish(nullptr, js, kSubject, data.data(), static_cast<int>(data.size()), nullptr, nullptr), NATS_OK);
  }
}

// A pull request of `batch` for the consumer "c" of PULL, answered on
// `reply`: the request of an earlier fetch whose messages reach the inbox
// when no fetch waits for them.
void pull_request(natsConnection* nc, const std::string& reply, int batch, std::chrono::milliseconds expires) {
  const std::string req = "{\"batch\":" + std::to_string(batch) +
                          ",\"expires\":" + std::to_string(std::chrono::nanoseconds(expires).count()) + "}";
  ASSERT_EQ(natsConnection_PublishRequest(nc, "$JS.API.CONSUMER.MSG.NEXT.PULL.c", reply.c_str(), req.data(),
                                          static_cast<int>(req.size())),
            NATS_OK);
  ASSERT_EQ(natsConnection_Flush(nc), NATS_OK);
}

std::uint64_t ack_pending(jsCtx* js) {
  jsConsumerInfo* ci = nullptr;
  if (js_GetConsumerInfo(&ci, js, "PULL", "c", nullptr, nullptr) != NATS_OK) return 0;
  const std::uint64_t n = static_cast<std::uint64_t>(ci->NumAckPending);
  jsConsumerInfo_Destroy(ci);
  return n;
}

TEST(NatsPull, AFetchNeverReturnsMoreThanItsBatchWhileMessagesOfEarlierRequestsArrive) {
  NatsCluster cluster(1);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  ASSERT_EQ(js.add_stream("PULL", [](jsStreamConfig& sc) { sc.Replicas = 1; }), "");
  jsConsumerConfig cc;
  jsConsumerConfig_Init(&cc);
  cc.Durable = "c";
  cc.AckPolicy = js_AckExplicit;
  cc.AckWait = std::chrono::nanoseconds(60s).count();  // nothing is redelivered during the test
  ASSERT_EQ(js_AddConsumer(nullptr, js.js(), "PULL", &cc, nullptr, nullptr), NATS_OK);
  ASSERT_NO_FATAL_FAILURE(publish(js.js(), 1, 30));

  Connection conn;
  ASSERT_OK(conn.connect(test_config(cluster, "PULL", 1), "pull-test"));
  Pull pull(conn);
  ASSERT_OK(pull.open("PULL", "c"));
  // An earlier request's 30 messages wait in the inbox; a second earlier
  // request waits on the server and is answered while the next fetch runs.
  ASSERT_NO_FATAL_FAILURE(pull_request(conn.nc(), pull.inbox() + ".early1", 30, 5s));
  ASSERT_TRUE(testing::eventually([&] { return ack_pending(js.js()) == 30; }, 5s));
  ASSERT_NO_FATAL_FAILURE(pull_request(conn.nc(), pull.inbox() + ".early2", 60, 10s));
  std::thread late([&] {
    std::this_thread::sleep_for(200ms);
    publish(js.js(), 31, 90);
  });

  std::set<std::string> seen;
  std::size_t duplicates = 0;
  auto take = [&](Fetched& got) {
    for (natsMsg* m : got.msgs) {
      const std::string data(natsMsg_GetData(m), static_cast<std::size_t>(natsMsg_GetDataLength(m)));
      if (!seen.insert(data).second) ++duplicates;
      EXPECT_EQ(internal::reply_to(conn, m, internal::kAck), NATS_OK);
    }
  };
  {
    Fetched got;
    ASSERT_OK(pull.fetch(40, 0, /*no_wait=*/false, 3s, &got));
    EXPECT_EQ(got.msgs.size(), 40u) << "30 queued, then the next 10 to arrive";
    take(got);
  }
  late.join();
  // The rest, in fetches of 7 (the late ones queued, then new requests').
  for (int i = 0; i < 50 && seen.size() < 90; ++i) {
    Fetched got;
    ASSERT_OK(pull.fetch(7, 0, /*no_wait=*/false, 1s, &got));
    EXPECT_LE(got.msgs.size(), 7u);
    take(got);
  }
  EXPECT_EQ(seen.size(), 90u);
  EXPECT_EQ(duplicates, 0u);
  EXPECT_TRUE(testing::eventually([&] { return ack_pending(js.js()) == 0; }, 5s)) << ack_pending(js.js());
  // Nothing is left: a no-wait fetch says so at once.
  Fetched none;
  ASSERT_OK(pull.fetch(5, 0, /*no_wait=*/true, 1s, &none));
  EXPECT_TRUE(none.msgs.empty());
}

TEST(NatsPull, AnEphemeralReaderIsDeletedWithItAndAnErrorNamesTheConsumer) {
  NatsCluster cluster(1);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  Js js(cluster);
  ASSERT_TRUE(js.ok());
  ASSERT_EQ(js.add_stream("PULL", [](jsStreamConfig& sc) { sc.Replicas = 1; }), "");
  ASSERT_NO_FATAL_FAILURE(publish(js.js(), 1, 5));
  Connection conn;
  ASSERT_OK(conn.connect(test_config(cluster, "PULL", 1), "pull-test"));
  std::string name;
  {
    jsConsumerConfig cc;
    jsConsumerConfig_Init(&cc);
    cc.AckPolicy = js_AckNone;
    cc.FilterSubject = kSubject;
    Pull reader(conn);
    ASSERT_OK(reader.open_ephemeral("PULL", cc));
    name = reader.consumer();
    auto pending = reader.num_pending();
    ASSERT_TRUE(pending.ok()) << pending.status().to_string();
    EXPECT_EQ(*pending, 5u);
    Fetched got;
    ASSERT_OK(reader.fetch(10, 0, /*no_wait=*/true, 1s, &got));
    EXPECT_EQ(got.msgs.size(), 5u);
  }
  jsConsumerInfo* ci = nullptr;
  EXPECT_EQ(js_GetConsumerInfo(&ci, js.js(), "PULL", name.c_str(), nullptr, nullptr), NATS_NOT_FOUND) << name;
  if (ci != nullptr) jsConsumerInfo_Destroy(ci);

  // A fetch on a connection that is gone fails, naming the consumer.
  Pull pull(conn);
  ASSERT_OK(pull.open("PULL", "c1"));
  conn.interrupt();
  Fetched got;
  Status s = pull.fetch(1, 0, /*no_wait=*/false, 1s, &got);
  EXPECT_EQ(s.code(), StatusCode::IOError) << s.to_string();
  EXPECT_NE(s.message().find("stream PULL, consumer c1"), std::string::npos) << s.to_string();
  EXPECT_TRUE(got.msgs.empty());
}

}  // namespace
}  // namespace tidal::nats
