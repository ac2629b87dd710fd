// The disaster drill (docs/CONTRACT.md R1-R4, docs/SCALE.md "Recovery"):
// three shard processes (tests/nats/nats_child.cc, "drill") signal, leave,
// rejoin and purge with Options::journal_wait, publish their change feeds
// and journals to a real 3-node NATS JetStream cluster, and back themselves
// up every few hundred ms. Each round one shard is SIGKILLed at a random
// point (mid-signal, mid-purge, mid-backup), its whole directory deleted,
// its newest complete backup copied into place and the process restarted:
// it replays the journal stream after the backup (recover_shard), sometimes
// SIGKILLed and restored again mid-replay, and resumes. At the end of every
// round every shard is stopped and checked: each leave, rejoin and purge
// whose call returned OK is in force with its exact boundary (status,
// history, receipt), each shard's aggregates equal its ledger, and the
// follower's view is bit for bit the sum of every shard's current
// aggregates (a fresh view of every shard's re-seed snapshot).
//
// TIDAL_DRILL_ROUNDS sets the rounds (8 in the default tier, 30 under
// scripts/test.sh --soak); TIDAL_DRILL_MODE=no-wait runs the shards without
// the journal's wait, which the drill must find (seen red: docs/SCALE.md,
// "Recovery").

#include <bit>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include "../test_util.h"
#include "child_process.h"
#include "drill.h"
#include "nats_cluster.h"
#include "nats_test_util.h"
#include "storage/format.h"
#include "storage/state_format.h"
#include "tidal/nats.h"

namespace tidal::nats {
namespace {

using namespace std::chrono_literals;
using testing::eventually;
using testing::NatsCluster;
using tidal::testing::TempDir;
namespace drill = testing::drill;
namespace fs = std::filesystem;

// What the ack logs say one user's state must be.
struct Acknowledged {
  bool known = false;    // a leave or rejoin returned OK, and no later one is in doubt
  bool left = false;     // the last acknowledged was a leave ...
  std::uint64_t left_at_ns = 0;  // ... with this boundary
  // The boundary (left_at_ns) of the last acknowledged purge; 0: none.
  std::uint64_t purged_through_ns = 0;
  std::size_t purges = 0;  // acknowledged purges
};

std::map<std::uint64_t, Acknowledged> read_ack_log(const std::string& path) {
  std::map<std::uint64_t, Acknowledged> users;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string state, kind;
    std::uint64_t user = 0, a = 0, b = 0;
    words >> state >> kind >> user >> a >> b;
    Acknowledged& u = users[user];
    if (kind == "P") {
      if (state == "A") {
        u.purged_through_ns = b;
        ++u.purges;
      }
      continue;
    }
    if (state == "A") {
      u.known = true;
      u.left = kind == "L";
      if (u.left) u.left_at_ns = a;
    } else if (state == "B") {
      u.known = false;  // in doubt until a later call returns OK
    }
  }
  return users;
}

// Each acknowledged privacy event of the shard's users that `db` does not
// hold, one line each.
// `purged_left` gets the users whose last acknowledged purge must have left
// them no ledger record (ledger_violations checks them once the Db is closed).
std::vector<std::string> lost_events(Db* db, std::uint64_t shard, const std::map<std::uint64_t, Acknowledged>& log,
                                     std::vector<std::uint64_t>* purged_left) {
  std::vector<std::string> lost;
  const std::string on = " on shard " + std::to_string(shard) + ": ";
  for (const auto& [user, ack] : log) {
    const std::string who = "user " + std::to_string(user);
    if (ack.known) {
      Result<CommunityMembership> m = db->community_layer_status(user);
      Result<std::vector<MembershipEvent>> h = db->community_layer_history(user);
      if (!m.ok() || !h.ok()) {
        lost.push_back(who + on + (m.ok() ? h.status() : m.status()).to_string());
      } else if (ack.left) {
        bool in_history = false;
        for (const MembershipEvent& e : *h) in_history |= e.status == MembershipStatus::Left && e.at_ns == ack.left_at_ns;
        if (m->status != MembershipStatus::Left || m->left_at_ns != ack.left_at_ns || !in_history) {
          lost.push_back("lost leave of " + who + on + "acknowledged with left_at_ns " + std::to_string(ack.left_at_ns) +
                         ", the Db says " + (m->status == MembershipStatus::Left ? "Left" : "Active") + " left_at_ns " +
                         std::to_string(m->left_at_ns.value_or(0)) + (in_history ? "" : ", not in its history"));
        }
      } else if (m->status != MembershipStatus::Active) {
        lost.push_back("lost rejoin of " + who + on + "the Db says Left");
      }
    }
    if (ack.purged_through_ns == 0) continue;
    // A purge removes the user's whole ledger, and a Left user adds to it
    // no more: still Left since the boundary of their last acknowledged
    // purge, they must have no ledger record, in this copy or any other
    // (the receipt alone proves less: a purge replayed into a copy that
    // lacks the contributions it removed, lost with the disk, rightly finds
    // nothing and writes none).
    Result<CommunityMembership> m = db->community_layer_status(user);
    if (m.ok() && m->status == MembershipStatus::Left && m->left_at_ns == ack.purged_through_ns) {
      purged_left->push_back(user);
    }
  }
  return lost;
}

// The users of `users` that still have contribution-ledger records in the
// closed Db at `db_dir` (its state engine opened read-only as plain RocksDB).
std::vector<std::string> ledger_violations(const std::string& db_dir, std::uint64_t shard,
                                           const std::vector<std::uint64_t>& users) {
  std::vector<std::string> out;
  if (users.empty()) return out;
  const std::string state = state_engine_dir(db_dir);
  std::vector<std::string> names;
  rocksdb::Status s = rocksdb::DB::ListColumnFamilies(rocksdb::DBOptions(), state, &names);
  std::vector<rocksdb::ColumnFamilyDescriptor> families;
  for (const std::string& n : names) families.emplace_back(n, rocksdb::ColumnFamilyOptions());
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  if (s.ok()) s = rocksdb::DB::OpenForReadOnly(rocksdb::DBOptions(), state, families, &handles, &raw);
  if (!s.ok()) return {"reading the ledger of shard " + std::to_string(shard) + ": " + s.ToString()};
  std::unique_ptr<rocksdb::DB> db(raw);
  rocksdb::ColumnFamilyHandle* ledger = nullptr;
  for (auto* h : handles) {
    if (h->GetName() == "ledger") ledger = h;
  }
  for (std::uint64_t user : users) {
    const std::string prefix = encode_ledger_key(user, 0).substr(0, 9);
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions(), ledger));
    std::size_t records = 0;
    for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) ++records;
    if (records > 0) {
      out.push_back("lost purge of user " + std::to_string(user) + " on shard " + std::to_string(shard) + ": Left since " +
                    "the boundary of their last acknowledged purge, yet " + std::to_string(records) +
                    " ledger records of theirs remain");
    }
  }
  for (auto* h : handles) (void)db->DestroyColumnFamilyHandle(h);
  return out;
}

// Every workload cell of `a` and `b`, bit for bit: the first differences.
std::string differences(const GlobalView& a, const GlobalView& b) {
  std::string diffs;
  int n = 0;
  auto check = [&](const char* kind, std::uint64_t owner, std::uint64_t item, const Result<double>& x,
                   const Result<double>& y) {
    if (x.ok() && y.ok() && std::bit_cast<std::uint64_t>(*x) == std::bit_cast<std::uint64_t>(*y)) return;
    if (++n <= 5) {
      diffs += std::string(kind) + " " + std::to_string(owner) + " item " + std::to_string(item) + ": view " +
               (x.ok() ? std::to_string(*x) : x.status().to_string()) + ", shards " +
               (y.ok() ? std::to_string(*y) : y.status().to_string()) + "\n";
    }
  };
  for (std::uint64_t i = 1; i <= testing::kItems; ++i) {
    for (std::uint64_t c = 1; c <= testing::kCohorts; ++c) check("cohort", c, i, a.cohort_score(c, i), b.cohort_score(c, i));
    for (std::uint64_t c = 1; c <= testing::kCommunities; ++c) {
      check("community", c, i, a.community_score(c, i), b.community_score(c, i));
    }
  }
  if (n > 5) diffs += "... " + std::to_string(n) + " cells differ\n";
  return diffs;
}

class Drill {
 public:
  Drill(NatsCluster& cluster, TempDir& dir, const std::string& stream, drill::Mode mode)
      : dir_(dir), config_(drill::config(cluster.servers(), stream)), mode_(mode) {
    for (std::uint64_t s = 1; s <= drill::kShards; ++s) fs::create_directories(backups(s));
  }

  const Config& config() const { return config_; }

  // Creates the change feed's and the journal's streams, as a deployment
  // has them before its shards run: a shard restored before any publisher
  // created the journal's stream would find none and stay recovering
  // (recover_shard: NotFound; seen under ASan, round 0).
  ::testing::AssertionResult create_streams() {
    auto db = Db::open(dir_.sub("streams"), drill::shard_options(99, drill::Mode::kNormal));
    if (!db.ok()) return ::testing::AssertionFailure() << db.status().to_string();
    auto p = Publisher::start(db->get(), config_);
    auto j = JournalPublisher::start(db->get(), config_);
    if (!p.ok() || !j.ok()) return ::testing::AssertionFailure() << (p.ok() ? j.status() : p.status()).to_string();
    const bool connected =
        eventually([&] { return (*p)->stats().connected && (*j)->stats().connected; }, std::chrono::seconds(120));
    (void)(*p)->stop();
    (void)(*j)->stop();
    if (connected) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "the streams were not created: " << (*p)->stats().last_error << " / "
                                         << (*j)->stats().last_error;
  }
  std::string db_dir(std::uint64_t s) const { return dir_.sub("shard" + std::to_string(s)); }
  std::string backups(std::uint64_t s) const { return dir_.sub("backups" + std::to_string(s)); }
  std::string ack_log(std::uint64_t s) const { return dir_.sub("acks" + std::to_string(s)); }

  // Starts shard s's process; true once it is serving (recovered first
  // when its directory is a restored backup).
  ::testing::AssertionResult start(std::uint64_t s, std::uint64_t seed) {
    children_[s] = std::make_unique<testing::Child>(
        tidal::testing::paths::kNatsChild, std::vector<std::string>{"drill", db_dir(s), std::to_string(s), config_.servers, config_.stream,
                                                   std::to_string(seed), backups(s), ack_log(s),
                                                   mode_ == drill::Mode::kNoWait ? "no-wait" : "normal"});
    if (children_[s]->ready(120s)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "shard " << s << "'s process did not start (its stderr is above)";
  }
  // SIGKILL; a failure when the process had ended by itself (it failed).
  ::testing::AssertionResult kill(std::uint64_t s) {
    const bool alive = children_[s]->kill();
    children_.erase(s);
    if (alive) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "shard " << s << "'s process had failed on its own (its stderr is above)";
  }

  // The newest (or oldest) backup of shard s with a manifest; empty when
  // there is none.
  std::string newest_backup(std::uint64_t s, bool oldest = false) const {
    std::string best;
    std::uint64_t best_n = 0;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(backups(s), ec)) {
      const std::string name = e.path().filename().string();
      if (name.size() < 2 || name[0] != 'b' || name.find('.') != std::string::npos) continue;
      if (!fs::exists(e.path() / kBackupManifest, ec)) continue;
      const std::uint64_t n = std::strtoull(name.c_str() + 1, nullptr, 10);
      if (best.empty() || (oldest ? n < best_n : n > best_n)) best_n = n, best = e.path().string();
    }
    return best;
  }

  // The machine and disk of shard s are lost: its directory is replaced by
  // a copy of its newest backup (or its oldest kept one).
  ::testing::AssertionResult restore(std::uint64_t s, bool oldest = false) {
    const std::string backup = newest_backup(s, oldest);
    if (backup.empty()) return ::testing::AssertionFailure() << "shard " << s << " has no complete backup";
    std::error_code ec;
    fs::remove_all(db_dir(s), ec);
    fs::copy(backup, db_dir(s), fs::copy_options::recursive, ec);
    if (ec) return ::testing::AssertionFailure() << "copying " << backup << ": " << ec.message();
    ++restores_;
    return ::testing::AssertionSuccess();
  }
  int restores() const { return restores_; }
  // Purged users found with an empty ledger, over every check.
  std::size_t purges_checked() const { return purges_checked_; }

  // Opens every shard (every process is stopped), publishes what is left,
  // waits for the follower's view, and returns every violation: acknowledged
  // events not in force, aggregates that differ from the ledger, and view
  // cells that differ from the sum of the shards' current aggregates.
  std::vector<std::string> check(GlobalView& view, int round) {
    std::vector<std::string> violations;
    std::vector<std::unique_ptr<Db>> dbs;
    std::vector<Db*> shards;
    for (std::uint64_t s = 1; s <= drill::kShards; ++s) {
      auto db = Db::open(db_dir(s), drill::shard_options(s, drill::Mode::kNormal));
      if (!db.ok()) {
        violations.push_back("opening shard " + std::to_string(s) + ": " + db.status().to_string());
        return violations;
      }
      if ((*db)->stats().recovering) {
        if (Status r = recover_shard(db->get(), config_); !r.ok()) violations.push_back(r.to_string());
      }
      shards.push_back(db->get());
      dbs.push_back(std::move(*db));
    }
    std::map<std::uint64_t, std::vector<std::uint64_t>> purged_left;
    for (std::uint64_t s = 1; s <= drill::kShards; ++s) {
      for (const std::string& lost : lost_events(shards[s - 1], s, read_ack_log(ack_log(s)), &purged_left[s])) {
        violations.push_back(lost);
      }
      purges_checked_ += purged_left[s].size();
      Result<RematerializeReport> rm = shards[s - 1]->rematerialize_shared_aggregates(false);
      if (!rm.ok() || !rm->mismatches.empty()) {
        violations.push_back("shard " + std::to_string(s) + "'s aggregates differ from its ledger: " +
                             (rm.ok() ? rm->mismatches.front() : rm.status().to_string()));
      }
    }
    {
      // What the processes had not published yet.
      std::vector<std::unique_ptr<Publisher>> pubs;
      std::vector<std::unique_ptr<JournalPublisher>> journals;
      for (Db* db : shards) {
        auto p = Publisher::start(db, config_);
        auto j = JournalPublisher::start(db, config_);
        if (!p.ok() || !j.ok()) {
          violations.push_back("publishing shard " + std::to_string(db->stats().change_feed_shard_id) + ": " +
                               (p.ok() ? j.status() : p.status()).to_string());
          return violations;
        }
        pubs.push_back(std::move(*p));
        journals.push_back(std::move(*j));
      }
      const bool published = eventually(
          [&] {
            for (Db* db : shards) {
              const Stats st = db->stats();
              if (st.journal_confirmed_seq != st.journal_last_seq) return false;
            }
            return testing::caught_up(shards, view);
          },
          120s);
      if (!published) violations.push_back("round " + std::to_string(round) + ": the view did not catch up");
      for (auto& p : pubs) (void)p->stop();
      for (auto& j : journals) (void)j->stop();
    }
    // The sum of the shards' current aggregates: a fresh view of each
    // shard's re-seed snapshot (published by the next round's processes).
    TempDir ref_dir;
    auto ref = GlobalView::open(ref_dir.sub("ref"));
    if (!ref.ok()) {
      violations.push_back(ref.status().to_string());
      return violations;
    }
    for (Db* db : shards) {
      Result<std::uint64_t> before = db->last_change_seq();
      Result<std::uint64_t> reseeded = db->reseed_change_feed();
      Result<std::vector<ChangeBatch>> snapshot =
          before.ok() ? db->read_changes(*before, std::size_t{1} << 30) : Result<std::vector<ChangeBatch>>(before.status());
      if (!reseeded.ok() || !snapshot.ok()) {
        violations.push_back("re-seeding: " + (reseeded.ok() ? snapshot.status() : reseeded.status()).to_string());
        return violations;
      }
      Result<ApplyOutcome> applied = (*ref)->apply(std::span<const ChangeBatch>(*snapshot));
      if (!applied.ok()) violations.push_back("applying a snapshot: " + applied.status().to_string());
    }
    if (std::string d = differences(view, **ref); !d.empty()) {
      violations.push_back("round " + std::to_string(round) + ": the view differs from the sum of the shards:\n" + d);
    }
    for (auto& db : dbs) {
      if (Status c = db->close(); !c.ok()) violations.push_back(c.to_string());
    }
    for (std::uint64_t s = 1; s <= drill::kShards; ++s) {
      for (const std::string& v : ledger_violations(db_dir(s), s, purged_left[s])) violations.push_back(v);
    }
    return violations;
  }

 private:
  TempDir& dir_;
  Config config_;
  drill::Mode mode_;
  std::map<std::uint64_t, std::unique_ptr<testing::Child>> children_;
  int restores_ = 0;
  std::size_t purges_checked_ = 0;
};

TEST(NatsDrill, LosingAShardsMachineAndDiskForgetsNoAcknowledgedLeaveRejoinOrPurgeAndKeepsEveryViewExact) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  const char* mode_env = std::getenv("TIDAL_DRILL_MODE");
  const drill::Mode mode =
      mode_env != nullptr && std::string(mode_env) == "no-wait" ? drill::Mode::kNoWait : drill::Mode::kNormal;
  Drill d(cluster, dir, "DRILL", mode);
  ASSERT_TRUE(d.create_streams());
  auto view = GlobalView::open(dir.sub("view"));
  ASSERT_TRUE(view.ok()) << view.status().to_string();
  auto follower = Follower::start(view->get(), d.config(), "drill");
  ASSERT_TRUE(follower.ok()) << follower.status().to_string();

  const int rounds = tidal::testing::soak_rounds("TIDAL_DRILL_ROUNDS", 8, 30);
  std::mt19937_64 rng(20261202);
  int mid_replay = 0, rounds_run = 0;
  std::vector<std::string> violations;
  const auto started = std::chrono::steady_clock::now();
  for (std::uint64_t r = 0; r < static_cast<std::uint64_t>(rounds) && violations.empty(); ++r) {
    for (std::uint64_t s = 1; s <= drill::kShards; ++s) ASSERT_TRUE(d.start(s, 1000 * r + s)) << "round " << r;
    std::this_thread::sleep_for(std::chrono::milliseconds(600 + rng() % 1000));
    const std::uint64_t victim = 1 + rng() % drill::kShards;
    ASSERT_TRUE(eventually([&] { return !d.newest_backup(victim).empty(); }, 30s)) << "round " << r;
    ASSERT_TRUE(d.kill(victim)) << "round " << r;
    ASSERT_TRUE(d.restore(victim)) << "round " << r;
    ASSERT_TRUE(d.start(victim, 1000 * r + 10 + victim)) << "round " << r;
    if (rng() % 3 == 0) {
      // Killed again while it replays (or just after), restored again.
      std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 150));
      ASSERT_TRUE(d.kill(victim)) << "round " << r;
      ASSERT_TRUE(d.restore(victim)) << "round " << r;
      ASSERT_TRUE(d.start(victim, 1000 * r + 20 + victim)) << "round " << r;
      ++mid_replay;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300 + rng() % 700));
    for (std::uint64_t s = 1; s <= drill::kShards; ++s) ASSERT_TRUE(d.kill(s)) << "round " << r;
    violations = d.check(**view, static_cast<int>(r));
    ++rounds_run;
    if (!violations.empty()) ADD_FAILURE() << "round " << r << " (shard " << victim << " lost and restored)";
  }
  std::size_t acknowledged = 0, purges = 0;
  for (std::uint64_t s = 1; s <= drill::kShards; ++s) {
    for (const auto& [user, ack] : read_ack_log(d.ack_log(s))) {
      acknowledged += ack.known ? 1 : 0;
      purges += ack.purges;
    }
  }
  std::string all;
  for (std::size_t i = 0; i < violations.size() && i < 10; ++i) all += violations[i] + "\n";
  EXPECT_TRUE(violations.empty()) << violations.size() << " violations:\n" << all;
  EXPECT_GT(d.purges_checked(), 0u) << "no purged user was checked: the drill tested no purge";
  std::printf("drill: %d rounds, %d restores (%d mid-replay) in %.1f s; %zu users with a known status, %zu "
              "acknowledged purges, %zu purged users' ledgers checked empty; %zu violations\n",
              rounds_run, d.restores(), mid_replay,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(), acknowledged, purges,
              d.purges_checked(), violations.size());
}

// The drill's checks go red when a restore forgets: a shard restored from
// its backup whose journal is not replayed (finish_recovery() called
// directly) has lost the leaves, rejoins and purges acknowledged after the
// backup, and the check names them.
TEST(NatsDrill, ARestoreThatSkipsTheJournalIsCaughtByTheDrillsChecks) {
  NatsCluster cluster(3);
  ASSERT_TRUE(cluster.start_all()) << cluster.log_tail(0);
  TempDir dir;
  Drill d(cluster, dir, "DRILLRED", drill::Mode::kNormal);
  ASSERT_TRUE(d.create_streams());
  ASSERT_TRUE(d.start(1, 7));
  // Long enough for three backups; the oldest kept one is then hundreds of
  // ms old (the newest may have been taken just before the kill, with no
  // privacy event after it to lose).
  ASSERT_TRUE(eventually([&] { return !d.newest_backup(1).empty(); }, 30s));
  std::this_thread::sleep_for(1500ms);
  ASSERT_TRUE(d.kill(1));
  ASSERT_TRUE(d.restore(1, /*oldest=*/true));
  auto restored = Db::open(d.db_dir(1), drill::shard_options(1, drill::Mode::kNormal));
  ASSERT_TRUE(restored.ok()) << restored.status().to_string();
  ASSERT_TRUE((*restored)->stats().recovering);
  ASSERT_OK((*restored)->finish_recovery());  // the replay skipped
  std::vector<std::uint64_t> purged_left;
  std::vector<std::string> lost = lost_events(restored->get(), 1, read_ack_log(d.ack_log(1)), &purged_left);
  ASSERT_OK((*restored)->close());
  for (const std::string& v : ledger_violations(d.db_dir(1), 1, purged_left)) lost.push_back(v);
  ASSERT_FALSE(lost.empty()) << "a restore without the journal's replay lost nothing: the drill cannot fail";
  EXPECT_NE(lost.front().find("lost "), std::string::npos) << lost.front();
  std::printf("without the replay: %zu acknowledged events lost, e.g. %s\n", lost.size(), lost.front().c_str());

  // And the replay finds each of them again.
  ASSERT_TRUE(d.restore(1, /*oldest=*/true));
  auto replayed = Db::open(d.db_dir(1), drill::shard_options(1, drill::Mode::kNormal));
  ASSERT_TRUE(replayed.ok()) << replayed.status().to_string();
  ASSERT_OK(recover_shard(replayed->get(), d.config()));
  purged_left.clear();
  lost = lost_events(replayed->get(), 1, read_ack_log(d.ack_log(1)), &purged_left);
  ASSERT_OK((*replayed)->close());
  for (const std::string& v : ledger_violations(d.db_dir(1), 1, purged_left)) lost.push_back(v);
  EXPECT_EQ(lost, std::vector<std::string>{});
  EXPECT_FALSE(purged_left.empty()) << "no purged user to check";
}

}  // namespace
}  // namespace tidal::nats
