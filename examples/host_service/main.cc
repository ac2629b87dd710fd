// A minimal host service embedding tidal: open a Db, join users to
// communities, stream signals from worker threads, handle a user's request
// to leave the community layer, and export counters. Copy and adapt.
//
//   host_service [DB_DIR]     (default ./host-service-db)
#include <tidal/db.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr std::uint64_t kUsers = 100;
constexpr std::uint64_t kCommunities = 5;

// Exports the Db's counters in the Prometheus text format.
void export_stats(const tidal::Db& db) {
  const tidal::Stats s = db.stats();
  std::printf("tidal_signals_total %llu\n", static_cast<unsigned long long>(s.signals));
  std::printf("tidal_community_forwards_total %llu\n", static_cast<unsigned long long>(s.community_forwards));
  std::printf("tidal_cohort_attributions_total %llu\n", static_cast<unsigned long long>(s.cohort_attributions));
  std::printf("tidal_gated_signals_total %llu\n", static_cast<unsigned long long>(s.gated_community));
  std::printf("tidal_users_left %llu\n", static_cast<unsigned long long>(s.users_left));
}

// What a request handler does with "stop sharing my activity": the leave is
// durable and in force when the call returns, so the reply can say so.
bool handle_leave_request(tidal::Db& db, std::uint64_t user_id) {
  if (tidal::Status s = db.leave_community_layer(user_id); !s.ok()) {
    std::fprintf(stderr, "leave of user %llu failed: %s\n", static_cast<unsigned long long>(user_id),
                 s.to_string().c_str());
    return false;  // reply 503; the user can retry (leave is idempotent)
  }
  tidal::Result<tidal::CommunityMembership> m = db.community_layer_status(user_id);
  if (!m.ok() || m->status != tidal::MembershipStatus::Left || !m->left_at_ns) return false;
  std::printf("user %llu left the community layer at %llu ns\n", static_cast<unsigned long long>(user_id),
              static_cast<unsigned long long>(*m->left_at_ns));
  return true;
}

// Streams `count` signals of users 1..kUsers, each attributed to one cohort.
void stream_signals(tidal::Db& db, std::uint64_t seed, int count, std::atomic<int>* errors) {
  for (int i = 0; i < count; ++i) {
    const std::uint64_t n = seed + static_cast<std::uint64_t>(i) * 7919;
    const tidal::Signal signal{1 + n % kUsers, 1 + n % 50, 1.0};
    const tidal::SignalContext context{{1 + n % 3}};
    if (!db.signal_with_context(signal, context).ok()) ++*errors;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : "./host-service-db";
  tidal::Result<std::unique_ptr<tidal::Db>> opened = tidal::Db::open(path);
  if (!opened.ok()) {
    std::fprintf(stderr, "cannot open the Db: %s\n", opened.status().to_string().c_str());
    return 1;
  }
  tidal::Db& db = **opened;

  for (std::uint64_t user = 1; user <= kUsers; ++user) {
    if (tidal::Status s = db.join_community(user, 1 + user % kCommunities); !s.ok()) {
      std::fprintf(stderr, "join failed: %s\n", s.to_string().c_str());
      return 1;
    }
  }

  // Signals flow from two workers while a leave request arrives.
  std::atomic<int> errors{0};
  std::vector<std::thread> workers;
  for (std::uint64_t t = 0; t < 2; ++t) {
    workers.emplace_back([&db, &errors, t] { stream_signals(db, t, 5000, &errors); });
  }
  const bool left = handle_leave_request(db, 42);
  for (std::thread& w : workers) w.join();

  // From now on user 42's signals stay personal: nothing reaches a community.
  tidal::Result<tidal::SignalOutcome> outcome = db.signal_with_context({42, 7, 1.0}, {{1}});
  const bool gated = outcome.ok() && outcome->gated && outcome->communities_forwarded == 0 &&
                     outcome->personal_applied;
  std::printf("user 42's next signal: personal %s, held back from communities and cohorts: %s\n",
              outcome.ok() && outcome->personal_applied ? "applied" : "not applied", gated ? "yes" : "no");

  export_stats(db);
  if (tidal::Status s = db.close(); !s.ok()) {
    std::fprintf(stderr, "close failed: %s\n", s.to_string().c_str());
    return 1;
  }
  const bool ok = left && gated && errors.load() == 0;
  std::printf("%s\n", ok ? "host_service: OK" : "host_service: FAILED");
  return ok ? 0 : 1;
}
