// The processes the NATS crash tests SIGKILL (tests/nats/nats_test.cc):
//   nats_child shard DB_DIR SHARD SERVERS STREAM SEED [TRIMS]
//     a shard: Db with a change feed, a Publisher, random operations until
//     killed; with TRIMS, it SIGKILLs itself right after its TRIMS-th
//     trim_changes was written (Storage::step_for_testing)
//   nats_child follower VIEW_DIR SERVERS STREAM CONSUMER [default-ack-wait]
//     a view: GlobalView and a Follower until killed (with
//     default-ack-wait: Config's default ack_wait, not the tests' 1.5 s)
//   nats_child drill DB_DIR SHARD SERVERS STREAM SEED BACKUPS ACK_LOG MODE
//     one shard of the disaster drill (tests/nats/drill_test.cc, drill.h):
//     a journaled Db (recovered first when it is a restored backup), its
//     Publisher and JournalPublisher, backups into BACKUPS every few
//     hundred ms (the newest 3 kept), and random signals, leaves, rejoins,
//     joins and purges of its users, each privacy call in ACK_LOG; MODE is
//     normal or no-wait (drill.h)
// Writes "ready\n" to stdout once started.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "drill.h"
#include "nats_test_util.h"
#include "storage/format.h"
#include "storage/storage.h"

using namespace tidal;
using namespace tidal::nats;

namespace {

// The drill's Config (drill.h), with the crash tests' 50 ms first backoff.
Config config_of(const std::string& servers, const std::string& stream) {
  Config c = tidal::nats::testing::drill::config(servers, stream);
  c.min_backoff = std::chrono::milliseconds(50);
  return c;
}

int fail(const std::string& what, const Status& s) {
  std::fprintf(stderr, "nats_child: %s: %s\n", what.c_str(), s.to_string().c_str());
  return 1;
}


// ---- drill ----

namespace drill = tidal::nats::testing::drill;
namespace fs = std::filesystem;

// Appends whole lines to the ack log (drill.h).
class AckLog {
 public:
  explicit AckLog(const std::string& path) : fd_(::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644)) {}
  ~AckLog() {
    if (fd_ >= 0) ::close(fd_);
  }
  AckLog(const AckLog&) = delete;
  AckLog& operator=(const AckLog&) = delete;
  bool ok() const { return fd_ >= 0; }
  void line(const std::string& text) {
    const std::string l = text + "\n";
    if (::write(fd_, l.data(), l.size()) != static_cast<ssize_t>(l.size())) std::abort();
  }

 private:
  int fd_;
};

bool complete(const fs::path& backup) {
  std::error_code ec;
  return fs::exists(backup / tidal::kBackupManifest, ec);
}

// Backups b1, b2, ... in `dir`: the next number, after removing what a
// killed backup left (a staging directory, which the Db's next open removes
// as well, or a backup of an older tidal without its manifest).
std::uint64_t clean_backups(const fs::path& dir) {
  std::uint64_t last = 0;
  std::error_code ec;
  fs::create_directories(dir, ec);
  std::vector<fs::path> partial;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() < 2 || name[0] != 'b') continue;
    if (name.find('.') != std::string::npos || !complete(e.path())) {
      partial.push_back(e.path());
      continue;
    }
    last = std::max<std::uint64_t>(last, std::strtoull(name.c_str() + 1, nullptr, 10));
  }
  for (const auto& p : partial) fs::remove_all(p, ec);
  return last + 1;
}

void prune_backups(const fs::path& dir, std::uint64_t newest, std::uint64_t keep) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() < 2 || name[0] != 'b' || name.find('.') != std::string::npos) continue;
    if (std::strtoull(name.c_str() + 1, nullptr, 10) + keep <= newest) fs::remove_all(e.path(), ec);
  }
}

int run_drill(char** argv) {
  const std::string db_dir = argv[2];
  const std::uint64_t shard = std::strtoull(argv[3], nullptr, 10);
  const Config config = drill::config(argv[4], argv[5]);
  std::mt19937_64 rng(std::strtoull(argv[6], nullptr, 10));
  const fs::path backups = argv[7];
  const std::string mode_name = argv[9];
  const drill::Mode mode = mode_name == "no-wait" ? drill::Mode::kNoWait : drill::Mode::kNormal;
  AckLog log(argv[8]);
  if (!log.ok()) return fail("ack log", Status::IOError(argv[8]));
  auto opened = Db::open(db_dir, drill::shard_options(shard, mode));
  if (!opened.ok()) return fail("open", opened.status());
  Db* db = opened->get();
  if (db->stats().recovering) {
    if (Status s = recover_shard(db, config); !s.ok()) return fail("recovery", s);
  }
  auto journal = JournalPublisher::start(db, config);
  if (!journal.ok()) return fail("journal publisher", journal.status());
  auto pub = Publisher::start(db, config);
  if (!pub.ok()) return fail("publisher", pub.status());
  std::vector<std::uint64_t> users;
  for (std::uint64_t u = 1; u <= drill::kUsers; ++u) {
    if (drill::shard_of(u) != shard) continue;
    users.push_back(u);
    for (std::uint64_t c : {1 + u % testing::kCommunities, 1 + (u * 7) % testing::kCommunities}) {
      if (Status s = db->join_community(u, c); !s.ok() && s.code() != StatusCode::InvalidArgument) {
        return fail("join_community", s);
      }
    }
  }
  std::printf("ready\n");
  std::fflush(stdout);

  std::thread backup([&, seed = rng()] {
    std::mt19937_64 brng(seed);
    for (std::uint64_t n = clean_backups(backups);; ++n) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100 + brng() % 400));
      Status s = db->backup((backups / ("b" + std::to_string(n))).string());
      if (!s.ok()) {
        std::fprintf(stderr, "nats_child: backup: %s\n", s.to_string().c_str());
        std::_Exit(1);
      }
      prune_backups(backups, n, 3);
    }
  });
  backup.detach();

  auto fail_call = [&](const char* what, std::uint64_t u, const Status& s) {
    return fail(std::string(what) + " of user " + std::to_string(u), s);
  };
  for (std::uint64_t i = 0;; ++i) {
    if (i % 16 == 0) std::this_thread::sleep_for(std::chrono::microseconds(500));
    const std::uint64_t u = users[rng() % users.size()];
    const unsigned pick = static_cast<unsigned>(rng() % 1000);
    const std::string who = " " + std::to_string(u);
    if (pick < 880) {
      SignalContext ctx;
      ctx.cohort_ids.push_back(1 + rng() % testing::kCohorts);
      Result<SignalOutcome> r = db->signal_with_context({u, 1 + rng() % testing::kItems, 0.25 * static_cast<double>(1 + rng() % 8)}, ctx);
      if (!r.ok() && r.status().code() != StatusCode::Busy) std::_Exit(fail_call("signal", u, r.status()));
    } else if (pick < 930) {
      log.line("B L" + who);
      Status s = db->leave_community_layer(u);
      if (s.ok()) {
        Result<CommunityMembership> m = db->community_layer_status(u);
        if (!m.ok()) std::_Exit(fail_call("community_layer_status", u, m.status()));
        log.line("A L" + who + " " + std::to_string(m->left_at_ns.value_or(0)));
      } else if (s.code() == StatusCode::NotReplicated || s.code() == StatusCode::Busy) {
        log.line("N L" + who);
      } else {
        std::_Exit(fail_call("leave", u, s));
      }
    } else if (pick < 970) {
      log.line("B R" + who);
      Status s = db->rejoin_community_layer(u);
      if (s.ok()) {
        log.line("A R" + who);
      } else if (s.code() == StatusCode::NotReplicated || s.code() == StatusCode::Busy) {
        log.line("N R" + who);
      } else {
        std::_Exit(fail_call("rejoin", u, s));
      }
    } else if (pick < 980) {
      Status s = db->join_community(u, 1 + rng() % testing::kCommunities);
      if (!s.ok() && s.code() != StatusCode::InvalidArgument) std::_Exit(fail_call("join_community", u, s));
    } else {
      Result<CommunityMembership> m = db->community_layer_status(u);
      if (!m.ok()) std::_Exit(fail_call("community_layer_status", u, m.status()));
      if (m->status != MembershipStatus::Left) continue;
      log.line("B P" + who);
      Result<PurgeReceipt> r = db->purge_community_contributions(u);
      if (r.ok()) {
        log.line("A P" + who + " " + std::to_string(r->purged_at_ns) + " " + std::to_string(r->left_at_ns) + " " +
                 std::to_string(r->entries_removed));
      } else if (r.status().code() == StatusCode::NotReplicated || r.status().code() == StatusCode::Busy) {
        log.line("N P" + who);
      } else {
        std::_Exit(fail_call("purge", u, r.status()));
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 10 && std::string(argv[1]) == "drill") return run_drill(argv);
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
  std::fprintf(stderr,
               "usage: nats_child shard DB SHARD SERVERS STREAM SEED [TRIMS] | follower VIEW SERVERS STREAM CONSUMER | "
               "drill DB SHARD SERVERS STREAM SEED BACKUPS ACK_LOG normal|no-wait\n");
  return 2;
}
