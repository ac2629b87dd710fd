// Helpers of the NATS tests and the sharded simulation: a random workload
// routed to shard Dbs and mirrored on one reference Db, bit-for-bit
// comparison of views with the reference, and waiting for convergence.
#ifndef TIDAL_TESTS_NATS_NATS_TEST_UTIL_H_
#define TIDAL_TESTS_NATS_NATS_TEST_UTIL_H_

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nats/nats.h>

#include "nats_cluster.h"
#include "tidal/db.h"
#include "tidal/global_view.h"
#include "tidal/nats.h"

namespace tidal::nats::testing {

// The cells a workload touches: cohorts 1..kCohorts, communities
// 1..kCommunities, items 1..kItems.
inline constexpr std::uint64_t kCohorts = 6, kCommunities = 4, kItems = 12;

// Random signals, leaves, rejoins, community joins and purges of users
// 1..users, user u on shard u % shards.size(), every operation done on its
// shard and on the reference (null: none) with the same outcome.
class Workload {
 public:
  Workload(std::uint64_t seed, std::uint64_t users, bool purges = true)
      : rng_(seed), users_(users), purges_(purges) {}

  // Joins every user to one or two communities (call once, first).
  std::string setup(const std::vector<Db*>& shards, Db* reference) {
    for (std::uint64_t u = 1; u <= users_; ++u) {
      for (std::uint64_t c : {1 + u % kCommunities, 1 + (u * 7) % kCommunities}) {
        std::string e = both(shards, reference, u, [&](Db* db) { return db->join_community(u, c); });
        if (!e.empty()) return e;
      }
    }
    return {};
  }

  // One random operation; an error message when a Db refused it.
  std::string step(const std::vector<Db*>& shards, Db* reference) {
    std::uint64_t u = 1 + rng_() % users_;
    unsigned pick = static_cast<unsigned>(rng_() % 1000);
    if (pick < 930) {
      Signal s{u, 1 + rng_() % kItems, kWeights[rng_() % kWeights.size()]};
      SignalContext ctx;
      ctx.cohort_ids.push_back(1 + rng_() % kCohorts);
      if (rng_() % 2) ctx.cohort_ids.push_back(1 + rng_() % kCohorts);
      return both(shards, reference, u, [&](Db* db) -> Status {
        Result<SignalOutcome> r = db->signal_with_context(s, ctx);
        return r.ok() ? Status::OK() : r.status();
      });
    }
    if (pick < 960) {
      left_.insert(u);
      return both(shards, reference, u, [&](Db* db) { return db->leave_community_layer(u); });
    }
    if (pick < 985 || !purges_) {
      left_.erase(u);
      return both(shards, reference, u, [&](Db* db) { return db->rejoin_community_layer(u); });
    }
    if (pick < 995 || left_.count(u) == 0) {
      std::uint64_t c = 1 + rng_() % kCommunities;
      return both(shards, reference, u, [&](Db* db) -> Status {
        Status s = db->join_community(u, c);
        return s.code() == StatusCode::InvalidArgument ? Status::OK() : s;  // at the community limit
      });
    }
    return both(shards, reference, u, [&](Db* db) -> Status {
      Result<PurgeReceipt> r = db->purge_community_contributions(u);
      return r.ok() ? Status::OK() : r.status();
    });
  }

 private:
  template <class F>
  std::string both(const std::vector<Db*>& shards, Db* reference, std::uint64_t u, F&& op) {
    Status a = op(shards[u % shards.size()]);
    if (!a.ok()) return "shard " + std::to_string(u % shards.size()) + ": " + a.to_string();
    if (reference != nullptr) {
      Status b = op(reference);
      if (!b.ok()) return "reference: " + b.to_string();
    }
    return {};
  }

  static constexpr std::array<double, 5> kWeights{0.1, 0.25, 1.0, 3.7, 1e-9};
  std::mt19937_64 rng_;
  std::uint64_t users_;
  bool purges_;
  std::set<std::uint64_t> left_;
};

// Every workload cell of `view` against `reference`, bit for bit: an empty
// string, or the first differences.
inline std::string compare(const GlobalView& view, const Db& reference) {
  std::string diffs;
  int n = 0;
  auto check = [&](const char* kind, std::uint64_t owner, std::uint64_t item, const Result<double>& v,
                   const Result<double>& r) {
    if (!v.ok() || !r.ok() || std::bit_cast<std::uint64_t>(*v) != std::bit_cast<std::uint64_t>(*r)) {
      if (++n <= 5) {
        diffs += std::string(kind) + " " + std::to_string(owner) + " item " + std::to_string(item) + ": view " +
                 (v.ok() ? std::to_string(*v) : v.status().to_string()) + ", reference " +
                 (r.ok() ? std::to_string(*r) : r.status().to_string()) + "\n";
      }
    }
  };
  for (std::uint64_t i = 1; i <= kItems; ++i) {
    for (std::uint64_t c = 1; c <= kCohorts; ++c) check("cohort", c, i, view.cohort_score(c, i), reference.cohort_score(c, i));
    for (std::uint64_t c = 1; c <= kCommunities; ++c) {
      check("community", c, i, view.community_score(c, i), reference.community_score(c, i));
    }
  }
  if (n > 5) diffs += "... " + std::to_string(n) + " cells differ\n";
  return diffs;
}

// True once every shard's feed is applied by `view` (after a flush of each
// shard, so nothing waits in memory): the view holds the shard's last seq
// of the shard's current incarnation. A seq alone is not enough: a restored
// and re-seeded shard may reach the seq the view applied of the lost copy.
inline bool caught_up(const std::vector<Db*>& shards, const GlobalView& view) {
  Result<std::vector<ShardProgress>> applied = view.applied_shards();
  if (!applied.ok()) return false;
  for (Db* db : shards) {
    const Stats stats = db->stats();
    Result<std::uint64_t> last = db->last_change_seq();
    if (!last.ok()) return false;
    if (*last == 0) continue;  // nothing to apply (the view holds no entry for it)
    auto it = std::find_if(applied->begin(), applied->end(),
                           [&](const ShardProgress& p) { return p.shard_id == stats.change_feed_shard_id; });
    if (it == applied->end() || it->applied_seq != *last ||
        it->incarnation != stats.change_feed_incarnation) {
      return false;
    }
  }
  return true;
}

// A connection to `cluster` and its JetStream context, for a test's own requests.
class Js {
 public:
  explicit Js(const NatsCluster& cluster) {
    ok_ = natsConnection_ConnectTo(&nc_, cluster.servers().c_str()) == NATS_OK &&
          natsConnection_JetStream(&js_, nc_, nullptr) == NATS_OK;
  }
  ~Js() {
    if (js_ != nullptr) jsCtx_Destroy(js_);
    if (nc_ != nullptr) natsConnection_Destroy(nc_);
  }
  Js(const Js&) = delete;
  Js& operator=(const Js&) = delete;
  bool ok() const { return ok_; }
  jsCtx* js() const { return js_; }

  // Creates `name` on tidal.<name>.* with 3 replicas, file storage, limits
  // retention and discard-new unless `edit` changes them; "" or the error.
  template <class Edit>
  std::string add_stream(const std::string& name, Edit&& edit) {
    const std::string wildcard = "tidal." + name + ".*";
    const char* subjects[] = {wildcard.c_str()};
    jsStreamConfig sc;
    jsStreamConfig_Init(&sc);
    sc.Name = name.c_str();
    sc.Subjects = subjects;
    sc.SubjectsLen = 1;
    sc.Replicas = 3;
    sc.Discard = js_DiscardNew;
    edit(sc);
    // A cluster just started may not have placed its JetStream peers yet
    // (10005, no suitable peers): asked again for up to 15 s.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
    for (;;) {
      jsErrCode jerr = static_cast<jsErrCode>(0);
      natsStatus s = js_AddStream(nullptr, js_, &sc, nullptr, &jerr);
      if (s == NATS_OK) return "";
      if (jerr != 10005 || std::chrono::steady_clock::now() > deadline) {
        return std::string(natsStatus_GetText(s)) + " " + std::to_string(jerr);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  // The stream's config and state, or null.
  jsStreamInfo* info(const std::string& name) {
    jsStreamInfo* si = nullptr;
    return js_GetStreamInfo(&si, js_, name.c_str(), nullptr, nullptr) == NATS_OK ? si : nullptr;
  }

 private:
  natsConnection* nc_ = nullptr;
  jsCtx* js_ = nullptr;
  bool ok_ = false;
};

inline Config test_config(const NatsCluster& cluster, const std::string& stream, int replicas) {
  Config c;
  c.servers = cluster.servers();
  c.stream = stream;
  c.subject_prefix = "tidal." + stream;
  c.replicas = replicas;
  c.request_timeout = std::chrono::milliseconds(2000);
  c.min_backoff = std::chrono::milliseconds(50);
  c.max_backoff = std::chrono::milliseconds(500);
  c.ack_wait = std::chrono::milliseconds(1500);
  return c;
}

// How long a publisher may take to count a batch the stream already holds
// (its published_seq, then its lag): a lost ack costs request_timeout, then a
// backoff of up to max_backoff, then the reconnect's request and the
// resend's (up to request_timeout each); a second more for a busy machine.
inline std::chrono::milliseconds ack_bound(const Config& c) {
  return 3 * c.request_timeout + c.max_backoff + std::chrono::milliseconds(1000);
}

// js_PublishMsg retried while the stream's leader is still being elected
// (NATS_NO_RESPONDERS, seen under ASan in ci24), for up to 10 s, as a repair
// tool would; the last status.
inline natsStatus publish_retrying(jsCtx* js, natsMsg* m, jsPubOptions* po) {
  natsStatus ns = NATS_NO_RESPONDERS;
  for (int i = 0; i < 100 && ns == NATS_NO_RESPONDERS; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ns = js_PublishMsg(nullptr, js, m, po, nullptr);
  }
  return ns;
}

inline Options shard_options(std::uint64_t shard) {
  Options o;
  o.change_feed = true;
  o.shard_id = shard;
  o.aggregate_write_period = std::chrono::milliseconds(20);
  return o;
}

}  // namespace tidal::nats::testing

#endif  // TIDAL_TESTS_NATS_NATS_TEST_UTIL_H_
