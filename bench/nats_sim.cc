// The sharded simulation (issue 19, docs/SCALE.md): N shard Dbs, each with a
// Publisher and a thread of signals at full rate (or a given rate), and M
// GlobalViews with Followers, against a 3-node NATS JetStream cluster it
// starts on loopback (or --servers). Reports signal throughput, what was
// published, and end-to-end lag: a probe signal per shard every --probe-ms,
// from accepted by its shard to visible in every view. At the end it replays
// every shard's signals into one reference Db and checks every view against
// it, bit for bit.
//
//   nats_sim [--shards=4] [--views=1] [--replicas=3] [--seconds=30]
//            [--write-period-ms=1000] [--users=8000 (each joins 2 communities, a synced write each)] [--items=1000]
//            [--cohorts=16] [--communities=16] [--cohorts-per-signal=2]
//            [--rate=0 (signals/s per shard, 0 = full rate)] [--probe-ms=100]
//            [--publisher=on|off|compare] [--compare-rounds=2] [--window-s=30]
//            [--check=1] [--servers=URLS] [--dir=DIR] [--reseed-every-s=0]
// --reseed-every-s=N re-seeds a shard (Db::reseed_change_feed, shards in
// turn) every N s under the load and reports, per re-seed, how long the
// call held the shard's writes, the snapshot's size, and when every view had
// applied all of it; the final check then shows every view exact.
// --publisher=compare alternates phases of --seconds with publishers on and
// off (views idle), same Dbs, and reports the throughput ratio.
#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <sys/resource.h>

#include "nats_cluster.h"
#include "tidal/db.h"
#include "tidal/global_view.h"
#include "tidal/nats.h"

using namespace tidal;
using Clock = std::chrono::steady_clock;

namespace {

double peak_rss_mib() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

std::map<std::string, std::string> g_args;
long long arg(const std::string& k, long long d) {
  auto it = g_args.find(k);
  return it == g_args.end() ? d : std::atoll(it->second.c_str());
}
std::string sarg(const std::string& k, const std::string& d) {
  auto it = g_args.find(k);
  return it == g_args.end() ? d : it->second;
}

[[noreturn]] void die(const std::string& what, const Status& s) {
  std::fprintf(stderr, "nats_sim: %s: %s\n", what.c_str(), s.to_string().c_str());
  std::exit(1);
}

constexpr std::uint64_t kProbeCommunity = 1'000'000;  // + shard
constexpr std::uint64_t kProbeItem = 999'999'999;
constexpr std::uint64_t kProbeUserBase = 1'000'000'000;  // + shard

struct Params {
  std::uint64_t shards, users, items, cohorts, communities, cohorts_per_signal;
};

// Shard s's deterministic stream of signals: the k-th signal of shard s is
// the same in the run and in the replay.
class ShardLoad {
 public:
  ShardLoad(const Params& p, std::uint64_t shard) : p_(p), shard_(shard), rng_(0x9e3779b9u * (shard + 1)) {}
  std::uint64_t user_of(std::uint64_t k) const { return k * p_.shards + shard_; }  // users routed by u % shards
  // Communities of user u (joined at setup).
  std::vector<std::uint64_t> communities_of(std::uint64_t u) const {
    return {1 + u % p_.communities, 1 + (u / 7) % p_.communities};
  }
  void next(Signal* s, SignalContext* ctx) {
    s->user_id = user_of(rng_() % (p_.users / p_.shards + 1));
    s->item_id = 1 + rng_() % p_.items;
    s->weight = 0.25 * static_cast<double>(1 + rng_() % 8);
    ctx->cohort_ids.clear();
    for (std::uint64_t i = 0; i < p_.cohorts_per_signal; ++i) ctx->cohort_ids.push_back(1 + rng_() % p_.cohorts);
  }

 private:
  Params p_;
  std::uint64_t shard_;
  std::mt19937_64 rng_;
};

struct Probes {
  std::mutex mu;
  std::vector<Clock::time_point> sent;           // accept time of probe k (k = index + 1)
  std::vector<std::vector<Clock::time_point>> seen;  // per view: when probe k became visible
  // Where the time goes, per probe: the shard's last_change_seq right after
  // the probe was accepted (seq0), and when seq0 + 1 (the first batch the
  // writer wrote after it) was in the feed, acknowledged by the stream
  // (PublisherStats::published_seq) and applied by every view.
  std::vector<std::uint64_t> seq0;
  std::vector<Clock::time_point> in_feed, published, applied;
};

double pct(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))];
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || a.find('=') == std::string::npos) {
      std::fprintf(stderr, "usage: see the comment at the top of bench/nats_sim.cc\n");
      return 2;
    }
    g_args[a.substr(2, a.find('=') - 2)] = a.substr(a.find('=') + 1);
  }
  Params p{static_cast<std::uint64_t>(arg("shards", 4)), static_cast<std::uint64_t>(arg("users", 8000)),
           static_cast<std::uint64_t>(arg("items", 1000)), static_cast<std::uint64_t>(arg("cohorts", 16)),
           static_cast<std::uint64_t>(arg("communities", 16)), static_cast<std::uint64_t>(arg("cohorts-per-signal", 2))};
  const int views_n = static_cast<int>(arg("views", 1));
  const int seconds = static_cast<int>(arg("seconds", 30));
  const auto period = std::chrono::milliseconds(arg("write-period-ms", 1000));
  const long long rate = arg("rate", 0);
  const auto probe_every = std::chrono::milliseconds(arg("probe-ms", 100));
  const std::string mode = sarg("publisher", "on");
  const int window_s = static_cast<int>(arg("window-s", 30));
  const std::string root = sarg("dir", (std::filesystem::temp_directory_path() / "tidal-nats-sim").string());
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);

  std::unique_ptr<nats::testing::NatsCluster> cluster;
  nats::Config config;
  config.servers = sarg("servers", "");
  if (config.servers.empty()) {
    cluster = std::make_unique<nats::testing::NatsCluster>(3);
    if (!cluster->start_all()) die("cluster", Status::IOError("the 3-node cluster did not start"));
    config.servers = cluster->servers();
  }
  config.stream = "SIM";
  config.subject_prefix = "tidal.sim";
  config.replicas = static_cast<int>(arg("replicas", 3));

  // Shards, each with its probe user in its probe community.
  std::vector<std::unique_ptr<Db>> shards;
  std::vector<ShardLoad> loads;
  for (std::uint64_t s = 0; s < p.shards; ++s) {
    Options o;
    o.change_feed = true;
    o.shard_id = s;
    o.aggregate_write_period = period;
    auto db = Db::open(root + "/shard" + std::to_string(s), o);
    if (!db.ok()) die("open shard", db.status());
    loads.emplace_back(p, s);
    for (std::uint64_t k = 0; k <= p.users / p.shards; ++k) {
      std::uint64_t u = loads.back().user_of(k);
      for (std::uint64_t c : loads.back().communities_of(u)) {
        if (Status st = (*db)->join_community(u, c); !st.ok()) die("join", st);
      }
    }
    if (Status st = (*db)->join_community(kProbeUserBase + s, kProbeCommunity + s); !st.ok()) die("join", st);
    shards.push_back(std::move(*db));
  }
  std::vector<std::unique_ptr<GlobalView>> views;
  std::vector<std::unique_ptr<nats::Follower>> followers;
  for (int v = 0; v < views_n; ++v) {
    auto view = GlobalView::open(root + "/view" + std::to_string(v));
    if (!view.ok()) die("open view", view.status());
    auto f = nats::Follower::start(view->get(), config, "view" + std::to_string(v));
    if (!f.ok()) die("follower", f.status());
    views.push_back(std::move(*view));
    followers.push_back(std::move(*f));
  }

  std::vector<std::unique_ptr<nats::Publisher>> pubs(p.shards);
  std::mutex pubs_mu;  // pubs[] is replaced by start_pubs/stop_pubs while the watcher reads it
  auto start_pubs = [&] {
    for (std::uint64_t s = 0; s < p.shards; ++s) {
      auto pub = nats::Publisher::start(shards[s].get(), config);
      if (!pub.ok()) die("publisher", pub.status());
      std::lock_guard<std::mutex> lock(pubs_mu);
      pubs[s] = std::move(*pub);
    }
  };
  auto stop_pubs = [&] {
    for (auto& pub : pubs) {
      if (pub) (void)pub->stop();
      std::lock_guard<std::mutex> lock(pubs_mu);
      pub.reset();
    }
  };

  std::vector<Probes> probes(p.shards);
  for (auto& pr : probes) pr.seen.resize(static_cast<std::size_t>(views_n));
  std::vector<std::atomic<std::uint64_t>> signals(p.shards);  // counted per shard, probes included
  std::atomic<bool> running{true};

  // Lag watcher: the probe community's score in each view counts the visible
  // probes; the shard's feed, its publisher and the views' applied seqs time
  // each probe's stages.
  std::thread watcher([&] {
    while (running.load()) {
      for (std::uint64_t s = 0; s < p.shards; ++s) {
        const auto now = Clock::now();
        const std::uint64_t feed = shards[s]->last_change_seq().ok() ? *shards[s]->last_change_seq() : 0;
        std::uint64_t published = 0;
        {
          std::lock_guard<std::mutex> lock(pubs_mu);
          if (pubs[s]) published = pubs[s]->stats().published_seq;
        }
        std::uint64_t applied = ~std::uint64_t{0};
        for (auto& v : views) {
          Result<std::uint64_t> a = v->applied_seq(s);
          applied = std::min(applied, a.ok() ? *a : 0);
        }
        std::lock_guard<std::mutex> lock(probes[s].mu);
        Probes& pr = probes[s];
        auto advance = [&](std::vector<Clock::time_point>& stage, std::uint64_t reached) {
          while (stage.size() < pr.seq0.size() && pr.seq0[stage.size()] + 1 <= reached) stage.push_back(now);
        };
        advance(pr.in_feed, feed);
        advance(pr.published, std::min(published, feed));
        advance(pr.applied, std::min(applied, std::min(published, feed)));
      }
      for (std::uint64_t s = 0; s < p.shards; ++s) {
        for (int v = 0; v < views_n; ++v) {
          Result<double> seen = views[static_cast<std::size_t>(v)]->community_score(kProbeCommunity + s, kProbeItem);
          if (!seen.ok()) continue;
          auto n = static_cast<std::size_t>(*seen + 0.5);
          auto now = Clock::now();
          std::lock_guard<std::mutex> lock(probes[s].mu);
          auto& vs = probes[s].seen[static_cast<std::size_t>(v)];
          while (vs.size() < n && vs.size() < probes[s].sent.size()) vs.push_back(now);
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  });

  // One signal thread per shard.
  std::atomic<bool> load_on{false};
  std::vector<std::thread> loaders;
  for (std::uint64_t s = 0; s < p.shards; ++s) {
    loaders.emplace_back([&, s] {
      Signal sig;
      SignalContext ctx;
      auto next_probe = Clock::now();
      auto t0 = Clock::now();
      std::uint64_t mine = 0;
      while (running.load()) {
        if (!load_on.load()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
          t0 = Clock::now();
          mine = 0;
          continue;
        }
        if (Clock::now() >= next_probe) {
          next_probe += probe_every;
          auto r = shards[s]->signal_with_context({kProbeUserBase + s, kProbeItem, 1.0}, {{}});
          if (!r.ok()) die("probe", r.status());
          const auto accepted = Clock::now();
          Result<std::uint64_t> seq0 = shards[s]->last_change_seq();
          if (!seq0.ok()) die("last_change_seq", seq0.status());
          std::lock_guard<std::mutex> lock(probes[s].mu);
          probes[s].sent.push_back(accepted);
          probes[s].seq0.push_back(*seq0);
        }
        loads[s].next(&sig, &ctx);
        auto r = shards[s]->signal_with_context(sig, ctx);
        if (!r.ok()) die("signal", r.status());
        signals[s].fetch_add(1, std::memory_order_relaxed);
        ++mine;
        if (rate > 0) {
          auto due = t0 + std::chrono::nanoseconds(static_cast<long long>(1e9 * static_cast<double>(mine) / static_cast<double>(rate)));
          if (due > Clock::now()) std::this_thread::sleep_until(due);
        }
      }
    });
  }

  auto total_signals = [&] {
    std::uint64_t n = 0;
    for (auto& c : signals) n += c.load();
    return n;
  };
  auto run_phase = [&](int secs) {
    std::uint64_t before = total_signals();
    auto t0 = Clock::now();
    load_on = true;
    std::this_thread::sleep_for(std::chrono::seconds(secs));
    load_on = false;
    double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    return static_cast<double>(total_signals() - before) / dt;
  };

  std::printf("nats_sim: %llu shards, %d views, %d replicas, write period %lld ms, %llu users, %llu items, %llu "
              "cohorts (%llu a signal), %llu communities, rate %s, servers %s\n",
              (unsigned long long)p.shards, views_n, config.replicas, (long long)period.count(),
              (unsigned long long)p.users, (unsigned long long)p.items, (unsigned long long)p.cohorts,
              (unsigned long long)p.cohorts_per_signal, (unsigned long long)p.communities,
              rate ? (std::to_string(rate) + "/s a shard").c_str() : "full", config.servers.c_str());
  // Re-seeds under the load (--reseed-every-s).
  struct Reseed {
    std::uint64_t shard = 0, first = 0, last = 0, bytes = 0;
    double call_ms = 0, applied_s = -1;
  };
  std::vector<Reseed> reseeds;
  std::thread reseeder;
  if (const long long every = arg("reseed-every-s", 0); every > 0) {
    reseeder = std::thread([&, every] {
      for (std::uint64_t k = 0; running.load(); ++k) {
        for (int i = 0; i < every * 10 && running.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
        if (!running.load() || !load_on.load()) continue;
        Reseed r;
        r.shard = k % p.shards;
        Db& db = *shards[r.shard];
        const auto t0 = Clock::now();
        Result<std::uint64_t> first = db.reseed_change_feed();
        if (!first.ok()) die("reseed", first.status());
        r.call_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        const Stats st = db.stats();
        r.first = *first;
        r.last = st.change_feed_last_seq;
        r.bytes = st.change_feed_pending_bytes;
        const std::string incarnation = st.change_feed_incarnation;
        for (;;) {
          bool all = true;
          for (auto& v : views) {
            Result<std::vector<ShardProgress>> progress = v->applied_shards();
            bool mine = false;
            if (progress.ok()) {
              for (const ShardProgress& sp : *progress) {
                if (sp.shard_id == r.shard && sp.incarnation == incarnation && sp.applied_seq >= r.last) mine = true;
              }
            }
            all = all && mine;
          }
          if (all) break;
          if (Clock::now() - t0 > std::chrono::seconds(120)) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        if (Clock::now() - t0 <= std::chrono::seconds(120)) {
          r.applied_s = std::chrono::duration<double>(Clock::now() - t0).count();
        }
        reseeds.push_back(r);
      }
    });
  }
  const auto run_start = Clock::now();
  if (mode == "compare") {
    std::vector<double> on, off;
    for (int r = 0; r < static_cast<int>(arg("compare-rounds", 2)); ++r) {
      start_pubs();
      on.push_back(run_phase(seconds));
      stop_pubs();
      off.push_back(run_phase(seconds));
      std::printf("round %d: publishers on %.0f signals/s, off %.0f signals/s\n", r + 1, on.back(), off.back());
      std::fflush(stdout);
    }
    double son = 0, soff = 0;
    for (double x : on) son += x;
    for (double x : off) soff += x;
    std::printf("publisher cost: on/off throughput ratio %.3f (on %.0f, off %.0f signals/s, all shards)\n",
                son / soff, son / static_cast<double>(on.size()), soff / static_cast<double>(off.size()));
    start_pubs();
  } else {
    if (mode == "on") start_pubs();
    double r = run_phase(seconds);
    std::printf("throughput: %.0f signals/s all shards (%.0f a shard), peak RSS %.0f MiB\n", r,
                r / static_cast<double>(p.shards), peak_rss_mib());
    if (mode == "off") start_pubs();
  }
  const double run_secs = std::chrono::duration<double>(Clock::now() - run_start).count();

  // Drain: every shard flushed and applied by every view.
  for (auto& db : shards) {
    if (Status st = db->flush(); !st.ok()) die("flush", st);
  }
  auto drain_start = Clock::now();
  for (;;) {
    bool done = true;
    for (std::uint64_t s = 0; s < p.shards; ++s) {
      for (auto& v : views) {
        if (*v->applied_seq(s) != *shards[s]->last_change_seq()) done = false;
      }
    }
    if (done) break;
    if (Clock::now() - drain_start > std::chrono::seconds(300)) {
      std::printf("drain: views did not catch up in 300 s: %s\n", followers[0]->stats().last_error.c_str());
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::printf("drain after the load stopped: %.2f s\n", std::chrono::duration<double>(Clock::now() - drain_start).count());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  running = false;
  watcher.join();
  for (auto& t : loaders) t.join();
  if (reseeder.joinable()) reseeder.join();
  for (const Reseed& r : reseeds) {
    std::printf("reseed of shard %llu: the call took %.1f ms (writer waits for its read and ingestion); snapshot seqs %llu..%llu (%llu bytes); in "
                "every view %s\n",
                (unsigned long long)r.shard, r.call_ms, (unsigned long long)r.first, (unsigned long long)r.last,
                (unsigned long long)r.bytes,
                r.applied_s < 0 ? "not within 120 s" : (std::to_string(r.applied_s) + " s after the call").c_str());
  }

  // Lag: accepted -> visible in every view, per probe, in windows of window_s.
  std::vector<double> lags;
  std::map<int, std::vector<double>> windows;
  std::uint64_t unseen = 0;
  for (std::uint64_t s = 0; s < p.shards; ++s) {
    for (std::size_t k = 0; k < probes[s].sent.size(); ++k) {
      Clock::time_point all_seen{};
      bool ok = views_n > 0;
      for (int v = 0; v < views_n; ++v) {
        auto& vs = probes[s].seen[static_cast<std::size_t>(v)];
        if (k >= vs.size()) {
          ok = false;
          break;
        }
        all_seen = std::max(all_seen, vs[k]);
      }
      if (!ok) {
        ++unseen;
        continue;
      }
      double ms = std::chrono::duration<double, std::milli>(all_seen - probes[s].sent[k]).count();
      lags.push_back(ms);
      int w = static_cast<int>(std::chrono::duration<double>(probes[s].sent[k] - run_start).count()) / window_s;
      windows[w].push_back(ms);
    }
  }
  std::printf("end-to-end lag (signal accepted -> visible in all %d views), %zu probes: p50 %.0f ms, p90 %.0f ms, "
              "p99 %.0f ms, max %.0f ms (%llu probes never seen)\n",
              views_n, lags.size(), pct(lags, 0.5), pct(lags, 0.9), pct(lags, 0.99), pct(lags, 1.0),
              (unsigned long long)unseen);
  {
    // Stages of each probe seen everywhere: writer (accepted -> its batch in
    // the feed), publish (feed -> acknowledged by the stream), deliver+apply
    // (acknowledged -> applied by every view), visible (applied -> the
    // probe's score read; > 0 when the probe was in a later batch than
    // seq0 + 1, i.e. the writer was mid-write when it was accepted).
    std::vector<double> writer, publish, apply, visible;
    for (std::uint64_t s = 0; s < p.shards; ++s) {
      Probes& pr = probes[s];
      for (std::size_t k = 0; k < pr.applied.size(); ++k) {
        Clock::time_point all_seen{};
        bool ok = views_n > 0;
        for (int v = 0; v < views_n; ++v) {
          auto& vs = pr.seen[static_cast<std::size_t>(v)];
          if (k >= vs.size()) ok = false;
          else all_seen = std::max(all_seen, vs[k]);
        }
        if (!ok) continue;
        auto ms = [](Clock::time_point a, Clock::time_point b) {
          return std::chrono::duration<double, std::milli>(b - a).count();
        };
        writer.push_back(ms(pr.sent[k], pr.in_feed[k]));
        publish.push_back(ms(pr.in_feed[k], pr.published[k]));
        apply.push_back(ms(pr.published[k], pr.applied[k]));
        visible.push_back(ms(pr.applied[k], std::max(all_seen, pr.applied[k])));
      }
    }
    auto line = [&](const char* name, const std::vector<double>& v) {
      std::printf("  stage %-26s p50 %6.0f ms, p90 %6.0f ms, p99 %6.0f ms, max %6.0f ms\n", name, pct(v, 0.5),
                  pct(v, 0.9), pct(v, 0.99), pct(v, 1.0));
    };
    line("writer (accepted->feed)", writer);
    line("publish (feed->stream ack)", publish);
    line("deliver+apply (->applied)", apply);
    line("visible (applied->read)", visible);
  }
  for (auto& [w, v] : windows) {
    std::printf("  lag in [%d s, %d s): p50 %.0f ms, p99 %.0f ms, max %.0f ms (%zu probes)\n", w * window_s,
                (w + 1) * window_s, pct(v, 0.5), pct(v, 0.99), pct(v, 1.0), v.size());
  }
  std::uint64_t batches = 0, bytes_est = 0;
  for (std::uint64_t s = 0; s < p.shards; ++s) {
    auto st = pubs[s]->stats();
    batches += st.published_batches;
    std::printf("shard %llu: %llu signals, feed last seq %llu, published %llu, publisher errors %llu, last error '%s'\n",
                (unsigned long long)s, (unsigned long long)signals[s].load(),
                (unsigned long long)shards[s]->stats().change_feed_last_seq, (unsigned long long)st.published_seq,
                (unsigned long long)st.errors, st.last_error.c_str());
  }
  (void)bytes_est;
  std::printf("published: %llu batches in %.0f s of load (%.1f batches/s)\n", (unsigned long long)batches, run_secs,
              static_cast<double>(batches) / run_secs);
  for (int v = 0; v < views_n; ++v) {
    auto st = followers[static_cast<std::size_t>(v)]->stats();
    std::printf("view %d: applied %llu batches in %llu writes (%.1f ms a write), stream->fetched %.0f ms a message, "
                "redeliveries skipped %llu, gaps %llu, errors %llu, last error '%s'\n",
                v, (unsigned long long)st.applied_batches, (unsigned long long)st.view_writes,
                st.view_writes ? static_cast<double>(st.apply_micros) / 1000.0 / static_cast<double>(st.view_writes) : 0.0,
                st.first_deliveries ? static_cast<double>(st.stored_to_fetched_micros) / 1000.0 /
                                          static_cast<double>(st.first_deliveries)
                                    : 0.0,
                (unsigned long long)st.redeliveries_skipped, (unsigned long long)st.gaps, (unsigned long long)st.errors,
                st.last_error.c_str());
  }
  std::printf("peak RSS (shards, views, publishers, followers in one process): %.0f MiB\n", peak_rss_mib());

  if (arg("check", 1)) {
    // Replay every shard's signals into one reference Db and compare every cell.
    Options o;
    o.aggregate_write_period = std::chrono::milliseconds(1000);
    auto ref = Db::open(root + "/reference", o);
    if (!ref.ok()) die("reference", ref.status());
    for (std::uint64_t s = 0; s < p.shards; ++s) {
      ShardLoad replay(p, s);
      for (std::uint64_t k = 0; k <= p.users / p.shards; ++k) {
        std::uint64_t u = replay.user_of(k);
        for (std::uint64_t c : replay.communities_of(u)) (void)(*ref)->join_community(u, c);
      }
      (void)(*ref)->join_community(kProbeUserBase + s, kProbeCommunity + s);
      Signal sig;
      SignalContext ctx;
      for (std::uint64_t i = 0; i < signals[s].load(); ++i) {
        replay.next(&sig, &ctx);
        for (;;) {  // the reference meets backpressure (Busy) when the replay outruns its writer
          auto r = (*ref)->signal_with_context(sig, ctx);
          if (r.ok()) break;
          if (r.status().code() != StatusCode::Busy) die("replay", r.status());
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      }
      for (std::size_t k = 0; k < probes[s].sent.size(); ++k) {
        (void)(*ref)->signal_with_context({kProbeUserBase + s, kProbeItem, 1.0}, {{}});
      }
    }
    if (Status st = (*ref)->flush(); !st.ok()) die("reference flush", st);
    std::uint64_t cells = 0, diffs = 0;
    auto same = [&](const Result<double>& a, const Result<double>& b) {
      ++cells;
      if (!a.ok() || !b.ok() || std::bit_cast<std::uint64_t>(*a) != std::bit_cast<std::uint64_t>(*b)) ++diffs;
    };
    for (auto& v : views) {
      for (std::uint64_t i = 1; i <= p.items; ++i) {
        for (std::uint64_t c = 1; c <= p.cohorts; ++c) same(v->cohort_score(c, i), (*ref)->cohort_score(c, i));
        for (std::uint64_t c = 1; c <= p.communities; ++c) same(v->community_score(c, i), (*ref)->community_score(c, i));
      }
      for (std::uint64_t s = 0; s < p.shards; ++s) {
        same(v->community_score(kProbeCommunity + s, kProbeItem), (*ref)->community_score(kProbeCommunity + s, kProbeItem));
      }
    }
    std::printf("check: %llu cells of %d views against a reference Db: %llu differ\n", (unsigned long long)cells,
                views_n, (unsigned long long)diffs);
    if (diffs != 0) return 1;
  }
  stop_pubs();
  for (auto& f : followers) (void)f->stop();
  return 0;
}
