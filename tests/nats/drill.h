// The disaster drill's shared definitions (tests/nats/drill_test.cc runs
// it; tests/nats/nats_child.cc's "drill" mode is one shard of it): the
// shards, their users, their Options and Config, and the ack log in which
// a shard process writes every leave, rejoin and purge it started and every
// one that returned OK.
#ifndef TIDAL_TESTS_NATS_DRILL_H_
#define TIDAL_TESTS_NATS_DRILL_H_

#include <chrono>
#include <cstdint>
#include <string>

#include "nats_test_util.h"
#include "tidal/db.h"
#include "tidal/nats.h"

namespace tidal::nats::testing::drill {

// Shards 1..kShards; user u (1..kUsers) lives on shard 1 + u % kShards.
inline constexpr std::uint64_t kShards = 3;
inline constexpr std::uint64_t kUsers = 150;
inline std::uint64_t shard_of(std::uint64_t user) { return 1 + user % kShards; }

// How a shard process runs: as it should, or without the journal's wait
// (to see the drill go red: a leave acknowledged before it is replicated
// is lost with the disk).
enum class Mode {
  kNormal,  // journal_wait 10 s
  kNoWait,  // journal_wait 0
};

inline Options shard_options(std::uint64_t shard, Mode mode) {
  Options o = testing::shard_options(shard);
  o.journal = true;
  o.journal_wait = mode == Mode::kNoWait ? std::chrono::milliseconds(0) : std::chrono::milliseconds(10000);
  return o;
}

inline Config config(const std::string& servers, const std::string& stream) {
  Config c;
  c.servers = servers;
  c.stream = stream;
  c.subject_prefix = "tidal." + stream;
  c.journal_stream = stream + "_J";
  c.journal_subject_prefix = "tidal." + stream + "_J";
  c.replicas = 3;
  c.request_timeout = std::chrono::milliseconds(2000);
  c.min_backoff = std::chrono::milliseconds(20);
  c.max_backoff = std::chrono::milliseconds(500);
  c.ack_wait = std::chrono::milliseconds(1500);
  return c;
}

// The ack log: one line per event, each written by one write(2) on an
// O_APPEND file, so a SIGKILL leaves whole lines only.
//   B <kind> <user>                        the call started
//   A L <user> <left_at_ns>                a leave returned OK
//   A R <user>                             a rejoin returned OK
//   A P <user> <purged_at_ns> <left_at_ns> <entries_removed>
//                                          a purge returned OK (one that removed
//                                          nothing writes no receipt)
//   N <kind> <user>                        the call returned NotReplicated or Busy (not acknowledged)
// kind: L (leave), R (rejoin), P (purge).

}  // namespace tidal::nats::testing::drill

#endif  // TIDAL_TESTS_NATS_DRILL_H_
