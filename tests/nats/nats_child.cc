// The processes the NATS crash tests SIGKILL (tests/nats/nats_test.cc):
//   nats_child shard DB_DIR SHARD SERVERS STREAM SEED [TRIMS]
//     a shard: Db with a change feed, a Publisher, random operations until
//     killed; with TRIMS, it SIGKILLs itself right after its TRIMS-th
//     trim_changes was written (Storage::step_for_testing)
//   nats_child follower VIEW_DIR SERVERS STREAM CONSUMER [default-ack-wait]
//     a view: GlobalView and a Follower until killed (with
//     default-ack-wait: Config's default ack_wait, not the tests' 1.5 s)
// Writes "ready\n" to stdout once started.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "nats_test_util.h"
#include "storage/storage.h"

using namespace tidal;
using namespace tidal::nats;

namespace {

Config config_of(const std::string& servers, const std::string& stream) {
  Config c;
  c.servers = servers;
  c.stream = stream;
  c.subject_prefix = "tidal." + stream;
  c.replicas = 3;
  c.request_timeout = std::chrono::milliseconds(2000);
  c.min_backoff = std::chrono::milliseconds(50);
  c.max_backoff = std::chrono::milliseconds(500);
  c.ack_wait = std::chrono::milliseconds(1500);
  return c;
}

int fail(const std::string& what, const Status& s) {
  std::fprintf(stderr, "nats_child: %s: %s\n", what.c_str(), s.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 7 && std::string(argv[1]) == "shard") {
    if (argc >= 8) {
      static std::atomic<int> trims_left{std::atoi(argv[7])};
      tidal::Storage::step_for_testing = [](std::string_view task, int) {
        if (task == "trim changes" && trims_left.fetch_sub(1) == 1) ::raise(SIGKILL);
      };
    }
    Options o = testing::shard_options(std::strtoull(argv[3], nullptr, 10));
    o.aggregate_write_period = std::chrono::milliseconds(1);
    auto db = Db::open(argv[2], o);
    if (!db.ok()) return fail("open", db.status());
    auto pub = Publisher::start(db->get(), config_of(argv[4], argv[5]));
    if (!pub.ok()) return fail("publisher", pub.status());
    std::printf("ready\n");
    std::fflush(stdout);
    testing::Workload w(std::strtoull(argv[6], nullptr, 10), 50);  // purges among the operations
    std::vector<Db*> shards{db->get()};
    for (std::uint64_t i = 0;; ++i) {
      std::string e = w.step(shards, nullptr);
      if (!e.empty()) {
        std::fprintf(stderr, "nats_child: %s\n", e.c_str());
        return 1;
      }
      if (i % 64 == 0) std::this_thread::sleep_for(std::chrono::microseconds(500));
    }
  }
  if (argc >= 6 && std::string(argv[1]) == "follower") {
    auto view = GlobalView::open(argv[2]);
    if (!view.ok()) return fail("view", view.status());
    Config config = config_of(argv[3], argv[4]);
    if (argc >= 7 && std::string(argv[6]) == "default-ack-wait") config.ack_wait = Config{}.ack_wait;
    auto follower = Follower::start(view->get(), config, argv[5]);
    if (!follower.ok()) return fail("follower", follower.status());
    std::printf("ready\n");
    std::fflush(stdout);
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  std::fprintf(stderr, "usage: nats_child shard DB SHARD SERVERS STREAM SEED [TRIMS] | follower VIEW SERVERS STREAM CONSUMER\n");
  return 2;
}
