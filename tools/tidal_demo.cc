// tidal-demo: a realistic workload against an embedded Db, then a report.
//
// Users join 1-3 communities; signal threads stream signals with 0-4 cohort
// ids (--light: 2 communities, 1 cohort id) while a third thread makes 1% of the users leave the community layer
// (and a quarter of those rejoin later), and a fourth purges every 10th
// (--single-purges) of the users the demo purges at the end, alone, right
// after their leave,
// timing each purge and the leaves beside it. A ContributionSink watches every
// fan-out, so the report can check the leave guarantees: nothing of a user
// reached a shared aggregate after their leave returned, and every boundary
// is exact (forwarded_at_ns < left_at_ns). The Db is then closed and reopened
// and every status compared. Finally half of the users who are still Left are
// purged: re-materialization finds no mismatch, and every shared score
// equals, bit for bit, that of a second Db fed the same contributions
// without theirs. Uses only the public API.
#include <tidal/db.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <cmath>
#include <cstring>
#include <set>
#include <tuple>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <sys/resource.h>

#include "cli_util.h"

namespace {

constexpr std::uint64_t kItems = 1000;   // item ids 1..kItems
constexpr std::uint64_t kCohorts = 500;  // cohort ids 1..kCohorts

constexpr char kUsage[] = R"(Usage: tidal-demo [--users N] [--communities N] [--signals N] [--threads N] [--single-purges N] [--purge-after-ms N] [--light] [--strict-erasure] [--dir PATH] [--keep]

Runs a workload on an embedded tidal Db and checks the leave guarantees.
  --users N        users (ids 1..N), each joins 1-3 communities   (default 100000)
  --communities N  communities                                    (default 1000)
  --signals N      signals in total, 0-4 cohort ids each          (default 2000000)
  --threads N      signal threads; one more thread makes 1% of the
                   users leave while signals flow, and a quarter
                   of those rejoin later                          (default 2)
  --single-purges N  purge every Nth of the users purged at the end
                   alone, right after its leave, on a thread of its
                   own while signals flow; 0: none                (default 10)
  --purge-after-ms N  purge each of those users N ms after its leave
                   returned (default 0: at once)
  --light          a light fan-out: each user joins 2 communities,
                   each signal names 1 cohort
  --strict-erasure open the Db with Options::strict_erasure (each
                   purge also compacts the cells it touched)
  --dir PATH       Db directory, wiped and recreated at start     (default ./tidal-demo-data)
  --keep           do not wipe --dir first (reuse what is there)
Exit code: 0 all checks PASS, 1 a check FAILED or the Db failed, 2 bad usage.
)";

struct Config {
  std::uint64_t users = 100'000;
  std::uint64_t communities = 1'000;
  std::uint64_t signals = 2'000'000;
  std::uint64_t threads = 2;
  std::uint64_t single_purges = 10;  // every Nth purged user, purged alone while signals flow; 0: none
  std::uint64_t purge_after_ms = 0;  // how long after its leave each single purge starts
  bool light = false;                // 2 communities per user, 1 cohort per signal (else 1-3 and 0-4)
  bool strict_erasure = false;       // Options::strict_erasure
  std::string dir = "./tidal-demo-data";
  bool keep = false;
};

// splitmix64: a small, fast generator; each thread owns one.
struct Rng {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  std::uint64_t below(std::uint64_t n) { return next() % n; }
};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Observes every contribution. Counting is per stripe (no shared writes);
// contributions of the users that will leave are kept for the boundary check.
// A user's flag is set by the leaver once leave_community_layer returned and
// cleared before it calls rejoin: a contribution seen while it is set broke G2.
// Time the calling thread spent in CheckingSink callbacks since it last
// reset it: tells what part of a long signal call was the demo's own sink.
thread_local std::uint64_t t_sink_ns = 0;

class CheckingSink : public tidal::ContributionSink {
 public:
  struct Record {
    std::uint64_t user_id;
    std::uint64_t forwarded_at_ns;
  };

  // A shared aggregate cell: (cohort or community, its id, item).
  using Cell = std::tuple<tidal::ContributionTarget, std::uint64_t, std::uint64_t>;

  // A number per shared cell, dense over the demo's ids (cohorts 1..kCohorts,
  // communities 1..N, items 1..kItems): 12 MB at 1,000 communities, where a
  // std::map of the 1.5M cells took ~120 MB per signal thread.
  class Tally {
   public:
    explicit Tally(std::uint64_t communities) : values_((kCohorts + communities + 2) * (kItems + 1), 0) {}
    void add(const Cell& c, std::int64_t v) { values_[index(c)] += v; }
    std::int64_t get(const Cell& c) const { return values_[index(c)]; }
    void merge(const Tally& o) {
      for (std::size_t i = 0; i < values_.size(); ++i) values_[i] += o.values_[i];
    }
    // Calls fn(cell, value) for every cell whose value is not 0, in cell order.
    template <class Fn>
    void for_each(Fn fn) const {
      for (std::size_t i = 0; i < values_.size(); ++i) {
        if (values_[i] != 0) fn(cell(i), values_[i]);
      }
    }

   private:
    std::size_t index(const Cell& c) const {
      const auto& [target, id, item] = c;
      const std::uint64_t row = target == tidal::ContributionTarget::Cohort ? id : kCohorts + 1 + id;
      return static_cast<std::size_t>(row * (kItems + 1) + item);
    }
    Cell cell(std::size_t i) const {
      const std::uint64_t row = i / (kItems + 1), item = i % (kItems + 1);
      if (row <= kCohorts) return {tidal::ContributionTarget::Cohort, row, item};
      return {tidal::ContributionTarget::Community, row - kCohorts - 1, item};
    }
    std::vector<std::int64_t> values_;
  };

  // `purged`: the users whose contributions the demo purges at the end; the
  // sink sums every other contribution (exactly, in hundredths: the demo's
  // weights are 0.50..1.49), and counts the contributions of those users.
  CheckingSink(std::uint64_t users, std::uint64_t communities, const std::vector<std::uint64_t>& watched,
               const std::vector<std::uint64_t>& purged)
      : communities_(communities), watched_(users + 1, 0), left_returned_(users + 1) {
    for (std::uint64_t u : watched) watched_[u] = 1;
    for (std::uint64_t u : purged) watched_[u] = 2;
  }

  void on_contribution(const tidal::Contribution& c) override {
    const auto start = std::chrono::steady_clock::now();
    struct Timed {
      std::chrono::steady_clock::time_point start;
      ~Timed() {
        t_sink_ns += static_cast<std::uint64_t>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
      }
    } timed{start};
    Stripe& s = stripe();
    s.contributions.fetch_add(1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (!s.kept) {
        s.kept = std::make_unique<Tally>(communities_);
        s.purged = std::make_unique<Tally>(communities_);
      }
      const Cell cell{c.target, c.target_id, c.item_id};
      if (c.user_id < watched_.size() && watched_[c.user_id] == 2) {
        s.purged->add(cell, 1);
      } else {
        s.kept->add(cell, std::llround(c.weight * 100));
      }
    }
    if (c.user_id >= watched_.size() || watched_[c.user_id] == 0) return;
    if (left_returned_[c.user_id].load(std::memory_order_acquire)) s.after_leave.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(s.mu);
    s.records.push_back({c.user_id, c.forwarded_at_ns});
  }

  void set_left_returned(std::uint64_t user, bool v) { left_returned_[user].store(v, std::memory_order_release); }

  std::uint64_t contributions() const {
    std::uint64_t n = 0;
    for (const Stripe& s : stripes_) n += s.contributions.load(std::memory_order_relaxed);
    return n;
  }
  std::uint64_t after_leave() const {
    std::uint64_t n = 0;
    for (const Stripe& s : stripes_) n += s.after_leave.load(std::memory_order_relaxed);
    return n;
  }
  // What every contribution of the users not purged added, per cell
  // (`kept`), and how many contributions of the purged users each cell got
  // (`purged`). Call once, after the signal threads have finished.
  void take_tallies(Tally* kept, Tally* purged) {
    for (Stripe& s : stripes_) {
      std::lock_guard<std::mutex> lock(s.mu);
      if (!s.kept) continue;
      kept->merge(*s.kept);
      purged->merge(*s.purged);
      s.kept.reset();
      s.purged.reset();
    }
  }

  // Call once the signal threads have finished.
  std::vector<Record> records() {
    std::vector<Record> all;
    for (Stripe& s : stripes_) {
      std::lock_guard<std::mutex> lock(s.mu);
      all.insert(all.end(), s.records.begin(), s.records.end());
    }
    return all;
  }

 private:
  struct alignas(64) Stripe {
    std::atomic<std::uint64_t> contributions{0};
    std::atomic<std::uint64_t> after_leave{0};
    std::mutex mu;  // uncontended unless two threads share a stripe
    std::vector<Record> records;
    std::unique_ptr<Tally> kept, purged;  // made by the stripe's first contribution
  };

  Stripe& stripe() {
    static std::atomic<unsigned> next{0};
    thread_local const unsigned index = next.fetch_add(1, std::memory_order_relaxed);
    return stripes_[index % kStripes];
  }

  static constexpr unsigned kStripes = 16;
  const std::uint64_t communities_;
  std::vector<std::uint8_t> watched_;  // 1: a leaver, 2: a leaver the demo purges
  std::vector<std::atomic<bool>> left_returned_;
  Stripe stripes_[kStripes];
};

bool check(bool ok, const std::string& what) {
  std::printf("  [%s] %s\n", ok ? "PASS" : "FAIL", what.c_str());
  return ok;
}

std::optional<Config> parse_args(int argc, char** argv, int* exit_code) {
  Config cfg;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    auto number = [&](std::uint64_t* out, bool zero_ok = false) {
      std::optional<std::uint64_t> v;
      if (i + 1 < argc) v = tidal::cli::parse_u64(argv[++i]);
      if (!v || (*v == 0 && !zero_ok)) {
        std::fprintf(stderr, "tidal-demo: %.*s needs a %s integer\n", static_cast<int>(arg.size()), arg.data(),
                     zero_ok ? "non-negative" : "positive");
        return false;
      }
      *out = *v;
      return true;
    };
    bool ok = true;
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      *exit_code = 0;
      return std::nullopt;
    } else if (arg == "--users") {
      ok = number(&cfg.users);
    } else if (arg == "--communities") {
      ok = number(&cfg.communities);
    } else if (arg == "--signals") {
      ok = number(&cfg.signals);
    } else if (arg == "--threads") {
      ok = number(&cfg.threads);
    } else if (arg == "--single-purges") {
      ok = number(&cfg.single_purges, /*zero_ok=*/true);
    } else if (arg == "--purge-after-ms") {
      ok = number(&cfg.purge_after_ms, /*zero_ok=*/true);
    } else if (arg == "--keep") {
      cfg.keep = true;
    } else if (arg == "--light") {
      cfg.light = true;
    } else if (arg == "--strict-erasure") {
      cfg.strict_erasure = true;
    } else if (arg == "--dir" && i + 1 < argc) {
      cfg.dir = argv[++i];
    } else {
      std::fprintf(stderr, "tidal-demo: unknown or incomplete argument '%s'\n", argv[i]);
      ok = false;
    }
    if (!ok) {
      std::fputs(kUsage, stderr);
      *exit_code = 2;
      return std::nullopt;
    }
  }
  return cfg;
}

// Prints the failed call and returns false (the run stops with exit code 1).
bool fail_db(const char* what, const tidal::Status& s) {
  std::fprintf(stderr, "tidal-demo: %s failed: %s\n", what, s.to_string().c_str());
  return false;
}

// fail_db for the steps that return std::optional<bool> (empty: a call failed).
std::optional<bool> failed(const char* what, const tidal::Status& s) {
  fail_db(what, s);
  return std::nullopt;
}

using SteadyClock = std::chrono::steady_clock;

// ---- step 1: memberships, bulk-loaded without fsync ----

// A synced join costs ~200 us; 200k of them would take a minute. The
// memberships are loaded with sync_writes = false, the Db closed (which
// flushes everything to disk), then reopened with the defaults.
bool load_memberships(const Config& cfg) {
  if (!cfg.keep) {
    std::error_code ec;
    std::filesystem::remove_all(cfg.dir, ec);
    if (ec) {
      std::fprintf(stderr, "tidal-demo: cannot wipe '%s': %s\n", cfg.dir.c_str(), ec.message().c_str());
      return false;
    }
  }
  const auto start = SteadyClock::now();
  tidal::Options bulk;
  bulk.sync_writes = false;
  tidal::Result<std::unique_ptr<tidal::Db>> db = tidal::Db::open(cfg.dir, bulk);
  if (!db.ok()) return fail_db("open for setup", db.status());
  Rng rng{42};
  tidal::cli::ProgressBar progress("setup", cfg.users, /*lines_when_not_tty=*/false);
  for (std::uint64_t u = 1; u <= cfg.users; ++u) {
    const std::uint64_t joins = cfg.light ? 2 : 1 + rng.below(3);
    std::uint64_t first = 0;
    for (std::uint64_t j = 0; j < joins; ++j) {
      std::uint64_t c = 1 + rng.below(cfg.communities);
      // --light: two different communities (where there are two).
      if (cfg.light && j == 1 && cfg.communities > 1) c = 1 + (first + rng.below(cfg.communities - 1)) % cfg.communities;
      if (j == 0) first = c;
      if (tidal::Status s = (*db)->join_community(u, c); !s.ok()) {
        return fail_db("join_community", s);
      }
    }
    if (u % 1024 == 0) progress.update(u);
  }
  progress.finish(cfg.users);
  if (tidal::Status s = (*db)->close(); !s.ok()) return fail_db("close after setup", s);
  std::printf("setup: memberships bulk-loaded with Options::sync_writes = false, then closed (flushed) and\n"
              "       reopened with default options (synced leaves/rejoins) for the workload: %.2f s\n",
              seconds_since(start));
  return true;
}

// Users who will leave: 1%, at least one, in random order; the first quarter
// of them rejoin later.
std::vector<std::uint64_t> pick_leavers(const Config& cfg) {
  std::vector<std::uint64_t> leavers(cfg.users);
  std::iota(leavers.begin(), leavers.end(), 1);
  Rng rng{7};
  for (std::size_t i = leavers.size() - 1; i > 0; --i) std::swap(leavers[i], leavers[rng.below(i + 1)]);
  leavers.resize(std::max<std::uint64_t>(1, cfg.users / 100));
  return leavers;
}

// Reports the memberships the reopened Db restored.
bool report_memberships(const Config& cfg, const tidal::Db& db) {
  std::uint64_t memberships = 0, users_with_communities = 0;
  for (std::uint64_t u = 1; u <= cfg.users; ++u) {
    tidal::Result<std::vector<std::uint64_t>> c = db.communities_of(u);
    if (!c.ok()) return fail_db("communities_of", c.status());
    memberships += c->size();
    if (!c->empty()) ++users_with_communities;
  }
  std::printf("setup: %llu memberships of %llu users restored at reopen\n",
              static_cast<unsigned long long>(memberships), static_cast<unsigned long long>(users_with_communities));
  return true;
}

// ---- step 2: the workload (signal threads and the leaver) ----

// What the signal threads and the leaver share while the workload runs.
struct Workload {
  // The first quarter of `leavers` rejoin.
  Workload(const Config& c, tidal::Db& d, CheckingSink& s, const std::vector<std::uint64_t>& l)
      : cfg(c), db(d), sink(s), leavers(l), rejoiners(l.size() / 4) {}

  const Config& cfg;
  tidal::Db& db;
  CheckingSink& sink;
  const std::vector<std::uint64_t>& leavers;
  std::size_t rejoiners;

  std::atomic<std::uint64_t> signals_done{0};
  std::atomic<std::uint64_t> signal_errors{0};
  std::atomic<std::uint64_t> leaves_while_flowing{0};
  std::atomic<bool> leaver_failed{false};
  std::string leaver_error;  // written by the leaver before leaver_failed
  // The leaver's phase; signal threads wait at 60% of the signals until the
  // leaves are done and at 85% until the rejoins are, so every leave and
  // rejoin happens while signals flow, whatever the machine's speed.
  enum Phase : int { kLeaving, kRejoining, kDone };
  std::atomic<int> phase{kLeaving};
  std::vector<double> leave_ms;             // latency of each leave, written by the leaver only
  std::vector<double> leave_during_purge_ms;  // those of leaves while a single purge ran
  // Single purges while signals flow (purger_thread): every 10th user the
  // demo purges at the end is purged alone right after its leave, on a
  // thread of its own, so leaves run beside purges.
  std::mutex purge_mu;
  std::condition_variable purge_cv;
  std::deque<std::pair<std::uint64_t, SteadyClock::time_point>> to_purge;  // (user, when); guarded by purge_mu
  bool leaves_over = false;            // guarded by purge_mu
  std::atomic<std::uint64_t> purges_started{0}, purges_ended{0};
  std::vector<double> purge_ms;        // written by the purger only
  std::uint64_t purges_while_flowing = 0, purged_entries = 0;
  std::string purger_error;            // written by the purger before purger_failed
  std::atomic<bool> purger_failed{false};
  std::atomic<std::uint64_t> waited_us{0};  // time signal threads spent waiting for the leaver
  // The longest signal_with_context call of any thread, and the time it
  // spent in the demo's sink (set together under longest_mu).
  std::mutex longest_mu;
  std::uint64_t longest_signal_ns = 0, longest_signal_sink_ns = 0;
  std::atomic<std::uint64_t> busy_retries{0};       // signals refused with Busy (admission's hard stop) and retried
  double signal_secs = 0;
  // Admission, from stats() every 50 ms while signals flow (run_workload).
  std::uint64_t samples = 0, samples_limited = 0, samples_stopped = 0;
  std::uint64_t max_l0_files = 0, max_debt_bytes = 0;
  std::uint64_t min_rate = 0;  // the lowest admission rate in force seen (0: never limited)

  std::uint64_t leaves_done_mark() const { return cfg.signals * 6 / 10; }
  std::uint64_t rejoins_done_mark() const { return cfg.signals * 85 / 100; }
};

// Holds a signal thread while the leaver is behind its phase's mark.
void wait_for_leaver(Workload& w) {
  for (bool waited = false;; waited = true) {
    const std::uint64_t done = w.signals_done.load(std::memory_order_relaxed);
    const int p = w.phase.load(std::memory_order_acquire);
    const bool may_pass_leaves = p >= Workload::kRejoining || done < w.leaves_done_mark();
    const bool may_pass_rejoins = p >= Workload::kDone || done < w.rejoins_done_mark();
    if ((may_pass_leaves && may_pass_rejoins) || w.leaver_failed.load()) return;
    if (waited) w.waited_us.fetch_add(100, std::memory_order_relaxed);
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// Signal thread `t`: its share of the signals, 0-4 cohort ids each (--light: 1).
void signal_thread(Workload& w, std::uint64_t t) {
  const Config& cfg = w.cfg;
  Rng rng{1000 + t};
  const std::uint64_t share = cfg.signals / cfg.threads + (t < cfg.signals % cfg.threads ? 1 : 0);
  tidal::SignalContext context;
  std::uint64_t unreported = 0;
  std::uint64_t longest_ns = 0, longest_sink_ns = 0;
  for (std::uint64_t n = 0; n < share; ++n) {
    if (unreported == 0) wait_for_leaver(w);
    const tidal::Signal signal{1 + rng.below(cfg.users), 1 + rng.below(kItems),
                               0.5 + static_cast<double>(rng.below(100)) / 100.0};
    context.cohort_ids.resize(cfg.light ? 1 : rng.below(5));
    for (std::uint64_t& c : context.cohort_ids) c = 1 + rng.below(kCohorts);
    for (;;) {
      // Each call is timed alone: the demo's own sleeps between Busy
      // retries are not part of any call.
      t_sink_ns = 0;
      const auto start = SteadyClock::now();
      const tidal::Status s = w.db.signal_with_context(signal, context).status();
      const auto took = static_cast<std::uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now() - start).count());
      if (took > longest_ns) {
        longest_ns = took;
        longest_sink_ns = t_sink_ns;
      }
      // Busy: admission's hard stop (compactions far behind); a host retries
      // later. (No sink here signals, so no nested signal meets full buffers.)
      if (s.code() == tidal::StatusCode::Busy) {
        w.busy_retries.fetch_add(1, std::memory_order_relaxed);
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      if (!s.ok()) w.signal_errors.fetch_add(1, std::memory_order_relaxed);
      break;
    }
    if (++unreported == 256) {
      w.signals_done.fetch_add(unreported, std::memory_order_relaxed);
      unreported = 0;
    }
  }
  w.signals_done.fetch_add(unreported, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(w.longest_mu);
  if (longest_ns > w.longest_signal_ns) {
    w.longest_signal_ns = longest_ns;
    w.longest_signal_sink_ns = longest_sink_ns;
  }
}

// The leaver: leave i when 20%..60% of the signals are done, then the
// rejoins at 65%..85%; if signals finish first it simply catches up.
void leaver_thread(Workload& w) {
  auto wait_for = [&](double fraction) {
    const auto target = static_cast<std::uint64_t>(fraction * static_cast<double>(w.cfg.signals));
    while (w.signals_done.load(std::memory_order_relaxed) < target) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  };
  auto give_up = [&](const tidal::Status& s) {
    w.leaver_error = s.to_string();
    w.leaver_failed = true;
  };
  const auto close_purges = [&] {
    {
      std::lock_guard<std::mutex> lock(w.purge_mu);
      w.leaves_over = true;
    }
    w.purge_cv.notify_all();
  };
  for (std::size_t i = 0; i < w.leavers.size(); ++i) {
    wait_for(0.2 + 0.4 * static_cast<double>(i) / static_cast<double>(w.leavers.size()));
    const std::uint64_t ended = w.purges_ended.load(), started = w.purges_started.load();
    const auto start = SteadyClock::now();
    tidal::Status s = w.db.leave_community_layer(w.leavers[i]);
    const double ms = seconds_since(start) * 1000.0;
    w.leave_ms.push_back(ms);
    if (started != ended || w.purges_started.load() != started) w.leave_during_purge_ms.push_back(ms);
    if (!s.ok()) {
      close_purges();
      return give_up(s);
    }
    w.sink.set_left_returned(w.leavers[i], true);
    if (w.signals_done.load(std::memory_order_relaxed) < w.cfg.signals) w.leaves_while_flowing.fetch_add(1, std::memory_order_relaxed);
    // Every 10th of the users purged at the end (pick_purged): purged now too.
    const std::size_t first = w.leavers.size() / 4;
    if (w.cfg.single_purges != 0 && i >= first && i < first + w.leavers.size() / 2 &&
        (i - first) % w.cfg.single_purges == 0) {
      {
        std::lock_guard<std::mutex> lock(w.purge_mu);
        w.to_purge.emplace_back(w.leavers[i], SteadyClock::now() + std::chrono::milliseconds(w.cfg.purge_after_ms));
      }
      w.purge_cv.notify_all();
    }
  }
  close_purges();
  w.phase.store(Workload::kRejoining, std::memory_order_release);
  for (std::size_t i = 0; i < w.rejoiners; ++i) {
    wait_for(0.65 + 0.2 * static_cast<double>(i) / static_cast<double>(w.rejoiners));
    w.sink.set_left_returned(w.leavers[i], false);  // contributions may resume from here
    if (tidal::Status s = w.db.rejoin_community_layer(w.leavers[i]); !s.ok()) return give_up(s);
  }
  w.phase.store(Workload::kDone, std::memory_order_release);
}

// The purger: purges each user the leaver hands it, alone, as soon as it
// can (--purge-after-ms after the leave), timing each call.
void purger_thread(Workload& w) {
  for (;;) {
    std::uint64_t user;
    SteadyClock::time_point when;
    {
      std::unique_lock<std::mutex> lock(w.purge_mu);
      w.purge_cv.wait(lock, [&] { return !w.to_purge.empty() || w.leaves_over; });
      if (w.to_purge.empty()) return;
      std::tie(user, when) = w.to_purge.front();
      w.to_purge.pop_front();
    }
    std::this_thread::sleep_until(when);
    w.purges_started.fetch_add(1);
    const auto start = SteadyClock::now();
    tidal::Result<tidal::PurgeReceipt> r = w.db.purge_community_contributions(user);
    const double ms = seconds_since(start) * 1000.0;
    w.purges_ended.fetch_add(1);
    if (!r.ok()) {
      w.purger_error = r.status().to_string();
      w.purger_failed = true;
      return;
    }
    w.purge_ms.push_back(ms);
    w.purged_entries += r->entries_removed;
    if (w.signals_done.load(std::memory_order_relaxed) < w.cfg.signals) ++w.purges_while_flowing;
  }
}

// Runs the signal threads, the leaver and the purger with a progress bar;
// false when a leave, rejoin or purge failed.
bool run_workload(Workload& w) {
  const auto start = SteadyClock::now();
  std::vector<std::thread> threads;
  for (std::uint64_t t = 0; t < w.cfg.threads; ++t) threads.emplace_back([&w, t] { signal_thread(w, t); });
  threads.emplace_back([&w] { leaver_thread(w); });
  threads.emplace_back([&w] { purger_thread(w); });
  {
    tidal::cli::ProgressBar progress("signals", w.cfg.signals, /*lines_when_not_tty=*/true);
    while (w.signals_done.load(std::memory_order_relaxed) < w.cfg.signals && w.signal_errors.load() == 0) {
      progress.update(w.signals_done.load(std::memory_order_relaxed));
      const tidal::Stats st = w.db.stats();
      ++w.samples;
      w.max_l0_files = std::max(w.max_l0_files, st.compaction_debt_l0_files);
      w.max_debt_bytes = std::max(w.max_debt_bytes, st.compaction_debt_bytes);
      if (st.admission_stopped) ++w.samples_stopped;
      if (st.admission_rate_bytes_per_s != 0) {
        ++w.samples_limited;
        if (w.min_rate == 0 || st.admission_rate_bytes_per_s < w.min_rate) w.min_rate = st.admission_rate_bytes_per_s;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    progress.finish(w.signals_done.load());
  }
  w.signal_secs = seconds_since(start);
  for (std::thread& t : threads) t.join();
  if (w.leaver_failed) std::fprintf(stderr, "tidal-demo: leave/rejoin failed: %s\n", w.leaver_error.c_str());
  if (w.purger_failed) std::fprintf(stderr, "tidal-demo: single purge failed: %s\n", w.purger_error.c_str());
  return !w.leaver_failed && !w.purger_failed;
}

// ---- step 3: the report and the checks ----

void print_report(Workload& w, const tidal::Stats& st) {
  std::printf("\nworkload: %llu signals in %.2f s = %.0f signals/s (%llu threads); %llu errors\n",
              static_cast<unsigned long long>(st.signals), w.signal_secs,
              static_cast<double>(st.signals) / w.signal_secs, static_cast<unsigned long long>(w.cfg.threads),
              static_cast<unsigned long long>(w.signal_errors.load()));
  std::printf("  (signal threads paused ~%.2f s in total so that every leave and rejoin happened while\n"
              "   signals flowed; the leaver runs on its own thread on the same cores)\n",
              static_cast<double>(w.waited_us.load()) / 1e6);
  std::printf("  leaves: %llu (%llu while signals flowed), rejoins: %llu, users Left now: %llu\n",
              static_cast<unsigned long long>(st.leaves), static_cast<unsigned long long>(w.leaves_while_flowing.load()),
              static_cast<unsigned long long>(st.rejoins), static_cast<unsigned long long>(st.users_left));
  if (!w.leave_ms.empty()) {
    std::vector<double>& ms = w.leave_ms;
    std::sort(ms.begin(), ms.end());
    std::printf("  leave latency (durable + effective on return): p50 %.2f ms, p99 %.2f ms, max %.2f ms\n",
                ms[ms.size() / 2], ms[ms.size() * 99 / 100], ms.back());
  }
  if (!w.purge_ms.empty()) {
    std::vector<double>& ms = w.purge_ms;
    std::sort(ms.begin(), ms.end());
    std::printf("  single purges (one user a call, on their own thread, %llu ms after its leave): %zu (%llu while "
                "signals flowed), %llu ledger entries removed; latency p50 %.2f ms, p99 %.2f ms, max %.2f ms\n",
                static_cast<unsigned long long>(w.cfg.purge_after_ms), ms.size(),
                static_cast<unsigned long long>(w.purges_while_flowing),
                static_cast<unsigned long long>(w.purged_entries), ms[ms.size() / 2], ms[ms.size() * 99 / 100],
                ms.back());
  }
  if (!w.leave_during_purge_ms.empty()) {
    std::vector<double>& ms = w.leave_during_purge_ms;
    std::sort(ms.begin(), ms.end());
    std::printf("  leaves while a single purge ran: %zu, latency p50 %.2f ms, p99 %.2f ms, max %.2f ms\n", ms.size(),
                ms[ms.size() / 2], ms[ms.size() * 99 / 100], ms.back());
  }
  // What a long call can wait for, each the longest of its kind in this
  // run (docs/CONTRACT.md S4): an admission sleep, a stay at the write
  // buffers' bound, and this demo's own sink. The rest is the Db's work and
  // the wait for a CPU.
  std::printf("  longest signal_with_context call: %.2f ms (%.2f ms of it in the demo's sink); the longest admission "
              "sleep %.2f ms, the longest wait at the write buffers' bound %.2f ms\n",
              static_cast<double>(w.longest_signal_ns) / 1e6, static_cast<double>(w.longest_signal_sink_ns) / 1e6,
              static_cast<double>(st.admission_delay_max_ns) / 1e6,
              static_cast<double>(st.backpressure_wait_max_ns) / 1e6);
  std::printf("  compaction debt (stats() every 50 ms, %llu samples): at most %llu MiB to compact and %llu level-0 "
              "files; at the end %llu MiB, %llu files\n",
              static_cast<unsigned long long>(w.samples), static_cast<unsigned long long>(w.max_debt_bytes >> 20),
              static_cast<unsigned long long>(w.max_l0_files),
              static_cast<unsigned long long>(st.compaction_debt_bytes >> 20),
              static_cast<unsigned long long>(st.compaction_debt_l0_files));
  std::printf("  admission: a rate limit in %llu samples (lowest %.2f MiB/s at %llu bytes a signal), the hard stop in "
              "%llu; %llu signals slept %.2f s in total, %llu refused with Busy (retried)\n",
              static_cast<unsigned long long>(w.samples_limited), static_cast<double>(w.min_rate) / (1 << 20),
              static_cast<unsigned long long>(st.admission_signal_bytes),
              static_cast<unsigned long long>(w.samples_stopped),
              static_cast<unsigned long long>(st.admission_delayed_signals),
              static_cast<double>(st.admission_delay_ns) / 1e9,
              static_cast<unsigned long long>(st.admission_refused_signals));
  std::printf("  contributions forwarded: %llu to communities, %llu to cohorts\n",
              static_cast<unsigned long long>(st.community_forwards),
              static_cast<unsigned long long>(st.cohort_attributions));
  std::printf("  signals held back by the leave gate: %llu (from communities), %llu (from cohorts)\n",
              static_cast<unsigned long long>(st.gated_community), static_cast<unsigned long long>(st.gated_cohort));
}

// Every signal accepted, every contribution seen, none after a leave returned.
bool check_counts(const Workload& w, const tidal::Stats& st) {
  bool ok = check(w.signal_errors.load() == 0 && st.signals == w.cfg.signals,
                  "every signal accepted (" + std::to_string(st.signals) + ")");
  ok &= check(w.sink.contributions() == st.community_forwards + st.cohort_attributions,
              "the sink saw every contribution the stats count (" + std::to_string(w.sink.contributions()) + ")");
  ok &= check(w.sink.after_leave() == 0, "no contribution of a Left user arrived after its leave returned (" +
                                             std::to_string(w.sink.after_leave()) + " did)");
  return ok;
}

// [left_at_ns, rejoin at_ns] of each leave in `history` (UINT64_MAX: still Left).
std::vector<std::pair<std::uint64_t, std::uint64_t>> left_intervals(const std::vector<tidal::MembershipEvent>& history) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  for (const tidal::MembershipEvent& e : history) {
    if (e.status == tidal::MembershipStatus::Left) {
      out.emplace_back(e.at_ns, UINT64_MAX);
    } else if (!out.empty()) {
      out.back().second = e.at_ns;
    }
  }
  return out;
}

struct BoundaryCount {
  std::uint64_t inside = 0, before_leave = 0, after_rejoin = 0, status_mismatches = 0;
};

// Classifies one leaver's contributions against its Left intervals and checks
// its status; `records` sorted by user.
bool count_boundaries(const Workload& w, std::size_t i, const std::vector<CheckingSink::Record>& records,
                      BoundaryCount* n) {
  const std::uint64_t u = w.leavers[i];
  tidal::Result<std::vector<tidal::MembershipEvent>> history = w.db.community_layer_history(u);
  if (!history.ok()) return fail_db("community_layer_history", history.status());
  tidal::Result<tidal::CommunityMembership> status = w.db.community_layer_status(u);
  if (!status.ok()) return fail_db("community_layer_status", status.status());
  const auto intervals = left_intervals(*history);
  const auto expected = i < w.rejoiners ? tidal::MembershipStatus::Active : tidal::MembershipStatus::Left;
  if (status->status != expected || intervals.empty() ||
      status->left_at_ns != std::optional<std::uint64_t>(intervals.back().first)) {
    ++n->status_mismatches;
  }
  auto it = std::lower_bound(records.begin(), records.end(), u,
                             [](const CheckingSink::Record& r, std::uint64_t v) { return r.user_id < v; });
  for (; it != records.end() && it->user_id == u; ++it) {
    const std::uint64_t f = it->forwarded_at_ns;
    bool in_left = false;
    for (const auto& [from, to] : intervals) in_left |= f >= from && f <= to;
    if (in_left) ++n->inside;
    else if (intervals.empty() || f < intervals.front().first) ++n->before_leave;
    else ++n->after_rejoin;
  }
  return true;
}

// Exact boundaries: no contribution of a leaver is stamped inside one of
// their Left intervals [left_at_ns, rejoin at_ns] (or after a last leave).
// Empty when a read failed.
std::optional<bool> check_boundaries(const Workload& w) {
  std::vector<CheckingSink::Record> records = w.sink.records();
  std::sort(records.begin(), records.end(), [](const auto& a, const auto& b) { return a.user_id < b.user_id; });
  BoundaryCount n;
  for (std::size_t i = 0; i < w.leavers.size(); ++i) {
    if (!count_boundaries(w, i, records, &n)) return std::nullopt;
  }
  bool ok = check(n.inside == 0, "every boundary exact: of " + std::to_string(records.size()) +
                                     " contributions of leaving users, " + std::to_string(n.before_leave) +
                                     " stamped before the leave, " + std::to_string(n.after_rejoin) +
                                     " after a rejoin, " + std::to_string(n.inside) +
                                     " inside a Left interval [left_at_ns, rejoin at_ns]");
  ok &= check(n.status_mismatches == 0,
              "status and history of all " + std::to_string(w.leavers.size()) + " leavers as expected (" +
                  std::to_string(w.leavers.size() - w.rejoiners) + " Left, " + std::to_string(w.rejoiners) +
                  " rejoined with left_at_ns kept)");
  return ok;
}

// ---- step 4: close and reopen: every status restored ----

// Closes `db`, reopens the directory and compares every status. Empty when a
// call failed.
// ---- step 5: purge half of the leavers (on the reopened Db), re-materialize, compare ----

// The leavers the demo purges at the end: half of them, all still Left (the
// first quarter of the leavers rejoin).
std::vector<std::uint64_t> pick_purged(const std::vector<std::uint64_t>& leavers) {
  const auto first = leavers.begin() + static_cast<std::ptrdiff_t>(leavers.size() / 4);
  return {first, first + static_cast<std::ptrdiff_t>(leavers.size() / 2)};
}

// A second Db fed exactly the contributions of the users not purged: one
// signal per shared cell carrying that cell's sum, from synthetic users (one
// in no community for cohorts, one per community joined to it alone).
std::optional<bool> feed_reference(const Config& cfg, const CheckingSink::Tally& kept,
                                   std::unique_ptr<tidal::Db>* out) {
  const std::string dir = cfg.dir + "-reference";
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  tidal::Options options;
  options.sync_writes = false;
  options.write_buffer_bytes = 8 << 20;  // a second Db in the same process: keep it small
  options.block_cache_bytes = 8 << 20;
  tidal::Result<std::unique_ptr<tidal::Db>> opened = tidal::Db::open(dir, options);
  if (!opened.ok()) return failed("open of the reference Db", opened.status());
  tidal::Db& ref = **opened;
  constexpr std::uint64_t kFeeder = 1ULL << 62;  // above every demo user id
  std::set<std::uint64_t> joined;
  tidal::SignalContext context;
  bool failure = false;  // reported by failed()
  kept.for_each([&](const CheckingSink::Cell& cell, std::int64_t hundredths) {
    if (failure) return;
    const auto& [target, id, item] = cell;
    tidal::Signal signal{kFeeder, item, static_cast<double>(hundredths) / 100.0};
    context.cohort_ids.clear();
    if (target == tidal::ContributionTarget::Cohort) {
      context.cohort_ids.push_back(id);
    } else {
      signal.user_id = kFeeder + 1 + id;
      if (joined.insert(id).second) {
        if (tidal::Status s = ref.join_community(signal.user_id, id); !s.ok()) {
          failed("reference join", s);
          failure = true;
          return;
        }
      }
    }
    if (tidal::Result<tidal::SignalOutcome> r = ref.signal_with_context(signal, context); !r.ok()) {
      failed("reference signal", r.status());
      failure = true;
    }
  });
  if (failure) return std::nullopt;
  *out = std::move(*opened);
  return true;
}

// Purges the contributions of `purged`, re-materializes, and compares every
// shared cell the workload touched with the reference Db, bit for bit.
std::optional<bool> check_purge(const Config& cfg, tidal::Db& db, CheckingSink& sink,
                                const std::vector<std::uint64_t>& purged) {
  auto start = SteadyClock::now();
  tidal::Result<std::vector<tidal::PurgeReceipt>> receipts = db.purge_community_contributions(purged);
  if (!receipts.ok()) return failed("purge_community_contributions", receipts.status());
  const double purge_secs = seconds_since(start);
  std::uint64_t entries = 0;
  for (const tidal::PurgeReceipt& r : *receipts) entries += r.entries_removed;
  start = SteadyClock::now();
  tidal::Result<tidal::RematerializeReport> remat = db.rematerialize_shared_aggregates(/*repair=*/false);
  if (!remat.ok()) return failed("rematerialize_shared_aggregates", remat.status());
  const double remat_secs = seconds_since(start);

  CheckingSink::Tally kept(cfg.communities), touched(cfg.communities);
  sink.take_tallies(&kept, &touched);
  std::unique_ptr<tidal::Db> ref;
  if (std::optional<bool> fed = feed_reference(cfg, kept, &ref); !fed) return std::nullopt;
  // Every cell the workload touched: kept ones, and those only purged users touched.
  touched.merge(kept);
  std::uint64_t cells = 0, differ = 0;
  bool failure = false;  // reported by failed()
  touched.for_each([&](const CheckingSink::Cell& cell, std::int64_t) {
    if (failure) return;
    const auto& [target, id, item] = cell;
    const bool cohort = target == tidal::ContributionTarget::Cohort;
    tidal::Result<double> a = cohort ? db.cohort_score(id, item) : db.community_score(id, item);
    tidal::Result<double> b = cohort ? ref->cohort_score(id, item) : ref->community_score(id, item);
    if (!a.ok() || !b.ok()) {
      failed(!a.ok() ? "score read" : "reference score read", !a.ok() ? a.status() : b.status());
      failure = true;
      return;
    }
    ++cells;
    if (std::memcmp(&*a, &*b, sizeof(double)) != 0) ++differ;
  });
  if (failure) return std::nullopt;
  if (tidal::Status s = ref->close(); !s.ok()) return failed("reference close", s);
  std::printf("\npurge: %zu users, %llu ledger entries removed in %.2f s; re-materialization read %llu ledger entries "
              "in %.2f s\n",
              purged.size(), static_cast<unsigned long long>(entries), purge_secs,
              static_cast<unsigned long long>(remat->ledger_entries_read), remat_secs);
  bool ok = check(receipts->size() == purged.size(), "one purge receipt per purged user (" +
                                                           std::to_string(receipts->size()) + ")");
  ok &= check(remat->mismatches.empty(), "re-materialization after the purge: " +
                                             std::to_string(remat->aggregates_checked) + " aggregates checked, " +
                                             std::to_string(remat->mismatches.size()) + " mismatches");
  ok &= check(differ == 0, "every shared score equals a Db fed the same signals without the purged users: " +
                               std::to_string(cells) + " cells compared, " + std::to_string(differ) +
                               " differ");
  return ok;
}

// ---- step 4: close and reopen: every status restored ----

std::optional<bool> check_reopen(const Config& cfg, std::unique_ptr<tidal::Db>& db, std::uint64_t users_left) {
  std::vector<tidal::CommunityMembership> before(cfg.users + 1);
  for (std::uint64_t u = 1; u <= cfg.users; ++u) {
    tidal::Result<tidal::CommunityMembership> m = db->community_layer_status(u);
    if (!m.ok()) return failed("community_layer_status", m.status());
    before[u] = *m;
  }
  auto start = SteadyClock::now();
  if (tidal::Status s = db->close(); !s.ok()) return failed("close", s);
  const double close_secs = seconds_since(start);
  db.reset();
  start = SteadyClock::now();
  tidal::Options options;
  options.strict_erasure = cfg.strict_erasure;
  tidal::Result<std::unique_ptr<tidal::Db>> opened = tidal::Db::open(cfg.dir, options);
  if (!opened.ok()) return failed("reopen", opened.status());
  const double open_secs = seconds_since(start);
  db = std::move(*opened);
  std::uint64_t differ = 0, left_after = 0;
  for (std::uint64_t u = 1; u <= cfg.users; ++u) {
    tidal::Result<tidal::CommunityMembership> m = db->community_layer_status(u);
    if (!m.ok()) return failed("community_layer_status after reopen", m.status());
    if (m->status != before[u].status || m->left_at_ns != before[u].left_at_ns) ++differ;
    if (m->status == tidal::MembershipStatus::Left) ++left_after;
  }
  std::printf("\nclose %.2f s, reopen %.2f s\n", close_secs, open_secs);
  bool ok = check(differ == 0, "every status restored after close/reopen: " + std::to_string(cfg.users) +
                                   " users compared, " + std::to_string(differ) + " differ, " +
                                   std::to_string(left_after) + " Left");
  ok &= check(db->stats().users_left == users_left,
              "users_left after reopen = before (" + std::to_string(db->stats().users_left) + ")");
  return ok;
}

// The demo, step by step; 0 when every check passed.
int run(const Config& cfg) {
  std::printf("tidal-demo: %llu users, %llu communities, %llu signals from %llu threads, %s fan-out, Db in '%s'\n",
              static_cast<unsigned long long>(cfg.users), static_cast<unsigned long long>(cfg.communities),
              static_cast<unsigned long long>(cfg.signals), static_cast<unsigned long long>(cfg.threads),
              cfg.light ? "light (2 communities per user, 1 cohort per signal)"
                        : "the demo's (1-3 communities per user, 0-4 cohorts per signal)",
              cfg.dir.c_str());
  if (!load_memberships(cfg)) return 1;
  const std::vector<std::uint64_t> leavers = pick_leavers(cfg);
  const std::vector<std::uint64_t> purged = pick_purged(leavers);
  auto sink = std::make_shared<CheckingSink>(cfg.users, cfg.communities, leavers, purged);
  tidal::Options options;
  options.create_if_missing = false;
  options.contribution_sink = sink;
  options.strict_erasure = cfg.strict_erasure;
  tidal::Result<std::unique_ptr<tidal::Db>> opened = tidal::Db::open(cfg.dir, options);
  if (!opened.ok()) {
    fail_db("open", opened.status());
    return 1;
  }
  std::unique_ptr<tidal::Db> db = std::move(*opened);
  if (!report_memberships(cfg, *db)) return 1;

  Workload w(cfg, *db, *sink, leavers);
  if (!run_workload(w)) return 1;
  const tidal::Stats st = db->stats();
  print_report(w, st);
  std::printf("\nchecks:\n");
  bool all_ok = check_counts(w, st);
  const std::optional<bool> boundaries = check_boundaries(w);
  if (!boundaries) return 1;
  all_ok &= *boundaries;
  const std::optional<bool> reopen = check_reopen(cfg, db, st.users_left);
  if (!reopen) return 1;
  all_ok &= *reopen;
  const std::optional<bool> purge = check_purge(cfg, *db, *sink, purged);
  if (!purge) return 1;
  all_ok &= *purge;
  if (tidal::Status s = db->close(); !s.ok()) {
    fail_db("final close", s);
    return 1;
  }

  std::printf("\n%s\n", all_ok ? "PASS" : "FAIL");
  return all_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int exit_code = 0;
  std::optional<Config> cfg = parse_args(argc, argv, &exit_code);
  if (!cfg) return exit_code;
  const auto start = std::chrono::steady_clock::now();
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // keep the report in order with stderr progress
  const int rc = run(*cfg);
  std::printf("total %.2f s\n", seconds_since(start));
  rusage usage{};
  if (::getrusage(RUSAGE_SELF, &usage) == 0) {
    // ru_maxrss is in KiB on Linux: the high-water mark of the whole run.
    std::printf("peak RSS %.1f MiB\n", static_cast<double>(usage.ru_maxrss) / 1024.0);
  }
  return rc;
}
