// make_format2_db: writes the format-2 Db fixture tests/data/format2_db.tar.gz
// and lists what the format-2 code reads from it (tests/data/format2_expected.txt).
//
// Kept for the record; the project does not build it. It was built and run
// against tidal commit 9dd4519 (the last release of on-disk format 2:
// state_format "2", one RocksDB instance per Db directory), linked with
// tidal's RocksDB 7.8.3 build (scripts/rocksdb.sh, installed in build/rocksdb),
// with these commands (<repo> is the tidal checkout, R=<repo>/build/rocksdb):
//
//   git -C <repo> worktree add --detach /work/fmt2 9dd4519
//   cmake -S /work/fmt2 -B /work/fmt2/build -DCMAKE_BUILD_TYPE=RelWithDebInfo
//         -DTIDAL_ROCKSDB_PREFIX=$R -DTIDAL_BUILD_TESTS=OFF -DTIDAL_BUILD_TOOLS=OFF
//         -DTIDAL_INSTALL=OFF
//   cmake --build /work/fmt2/build -j2 --target tidal
//   g++ -std=c++20 -O1 -g -Wall -Wextra -I/work/fmt2/include make_format2_db.cc
//       /work/fmt2/build/libtidal.a
//       $(PKG_CONFIG_PATH=$R/lib/pkgconfig pkg-config --static --libs rocksdb)
//       -o make_format2_db
//       (pkg-config gives: -L$R/lib -lrocksdb -lsnappy -llz4 -lzstd -lz -lbz2 -lpthread -ldl)
//   ./make_format2_db write out/db        (creates the Db; out/db must not exist)
//   ./make_format2_db read out/db > format2_expected.txt     (read-only open)
//   cd out && tar --no-recursion --sort=name --mtime='2026-12-01 00:00:00Z'
//       --owner=0 --group=0 --numeric-owner --mode='u+rwX,go+rX,go-w' -cf - db
//       db/CURRENT db/IDENTITY db/MANIFEST-* db/OPTIONS-* db/*.sst db/*.log
//       | gzip -9n > format2_db.tar.gz
//       (left out: RocksDB's info log LOG, LOCK and the empty ingest/ directory)
//   Check: extract the tarball in a new directory, run `read` on its db/ and
//   diff with format2_expected.txt: identical.
//
// Everything is deterministic except RocksDB's own file names and contents
// (file numbers, the DB identity): the Db clock is a counter (Options::clock),
// the background writer never runs on its own (aggregate_write_period is an
// hour) and every state-store batch is written by an explicit flush(), so the
// feed's batches and every time the Db stores are the same on every run.
// `read` prints the same listing for any Db written by `write`.
#include <tidal/db.h>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using u64 = std::uint64_t;

[[noreturn]] void die(const std::string& what, const tidal::Status& s) {
  std::fprintf(stderr, "make_format2_db: %s: %s\n", what.c_str(), s.to_string().c_str());
  std::exit(1);
}
[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "make_format2_db: %s\n", what.c_str());
  std::exit(1);
}
void check(const tidal::Status& s, const std::string& what) {
  if (!s.ok()) die(what, s);
}
// The value (moved out), or exit with the error.
template <class T>
T check(tidal::Result<T>&& r, const std::string& what) {
  if (!r.ok()) die(what, r.status());
  return std::move(*r);
}

// ---------------------------------------------------------------- the scenario

constexpr u64 kShard = 7;
// The Db clock's source: 2023-11-14T22:13:20Z, then 1 ms more at every reading.
constexpr u64 kClockBase = 1'700'000'000'000'000'000ULL;
constexpr u64 kClockStep = 1'000'000ULL;

// 40 users: 1001..1038 and two ids that use every byte of the key.
std::vector<u64> all_users() {
  std::vector<u64> users;
  for (u64 u = 1001; u <= 1038; ++u) users.push_back(u);
  users.push_back(0x0123456789ABCDEFULL);
  users.push_back(0xFFFFFFFFFFFFFFFEULL);
  return users;
}

constexpr u64 kBigCommunity = 0x8000000000000005ULL;
const std::vector<u64> kCommunities = {501, 502, 503, 504, kBigCommunity};
const std::vector<u64> kCohorts = {0, 9001, 9002, 9003, 9004, 9005, 0xFFFFFFFFFFFFFFFFULL};
const std::vector<u64> kItems = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1ULL << 32, 0xFFFFFFFFFFFFFFFFULL};

// Weights: integers, fractions (0.1, 1e-9, 1/3 rounded to 1e-9), negatives,
// and magnitudes up to the 1e12 limit, whose sums exceed 2^53 nano-units.
const std::vector<double> kWeights = {
    1.0, 0.1, 1e-9, 2.5, 1e12, -0.3, 123456.789, 7e-9, 999999999999.999999999, 1.0 / 3.0,
    -1e12, 0.5, 4503599627.370497, 1e-3, 42.0, 3e-9, 0.2, 1e11, -2e-9, 65536.0};

struct Phase {
  // One signal: user, item, weight, cohorts.
  struct Sig {
    u64 user;
    u64 item;
    double weight;
    std::vector<u64> cohorts;
  };
  std::vector<Sig> signals;
};

// `round` varies the signals from one phase to the next.
std::vector<Phase::Sig> signals_for(const std::vector<u64>& users, int round, int per_user) {
  std::vector<Phase::Sig> out;
  for (std::size_t i = 0; i < users.size(); ++i) {
    for (int k = 0; k < per_user; ++k) {
      const std::size_t n = i * 7 + static_cast<std::size_t>(k) * 3 + static_cast<std::size_t>(round) * 11;
      Phase::Sig s;
      s.user = users[i];
      s.item = kItems[(i * 3 + static_cast<std::size_t>(k) + static_cast<std::size_t>(round) * 5) % kItems.size()];
      s.weight = kWeights[n % kWeights.size()];
      switch (n % 5) {
        case 0: break;  // no cohort
        case 1: s.cohorts = {kCohorts[i % kCohorts.size()]}; break;
        case 2: s.cohorts = {kCohorts[(i + 1) % kCohorts.size()], kCohorts[(i + 3) % kCohorts.size()]}; break;
        case 3: s.cohorts = {kCohorts[(i + k) % kCohorts.size()], kCohorts[(i + k) % kCohorts.size()]}; break;  // listed twice
        default: s.cohorts = {9001, 9005, 0}; break;
      }
      out.push_back(std::move(s));
    }
  }
  return out;
}

// The users of each step.
const std::vector<u64> kLeaveSingle = {1003, 1008, 1013, 1021};
const std::vector<u64> kLeaveBulk = {1030, 0x0123456789ABCDEFULL};
constexpr u64 kRejoiner = 1008;
const std::vector<u64> kPurged = {1003, 1013};  // 1003 by the single form, 1013 by the bulk form

// Users' communities: every user in 501 + (index % 4); every 5th also in the big one;
// every 7th joins 503 too and later exits it (unless 503 is its home); user 1006
// joins and exits 504 only (it ends with no community at all).
void run_joins(tidal::Db& db, const std::vector<u64>& users) {
  for (std::size_t i = 0; i < users.size(); ++i) {
    const u64 u = users[i];
    if (u == 1006) {
      check(db.join_community(u, 504), "join");
      continue;
    }
    check(db.join_community(u, kCommunities[i % 4]), "join");
    if (i % 5 == 0) check(db.join_community(u, kBigCommunity), "join");
    if (i % 7 == 0) check(db.join_community(u, 503), "join");
    check(db.join_community(u, kCommunities[i % 4]), "join twice (a no-op)");
  }
}
void run_exits(tidal::Db& db, const std::vector<u64>& users) {
  for (std::size_t i = 0; i < users.size(); ++i) {
    const u64 u = users[i];
    if (u == 1006) {
      check(db.exit_community(u, 504), "exit");
      continue;
    }
    if (i % 7 == 0 && kCommunities[i % 4] != 503) check(db.exit_community(u, 503), "exit");
    check(db.exit_community(u, 9999), "exit of a community one is not in (a no-op)");
  }
}

void signal_all(tidal::Db& db, const std::vector<Phase::Sig>& sigs) {
  for (const Phase::Sig& s : sigs) {
    tidal::SignalContext ctx;
    ctx.cohort_ids = s.cohorts;
    check(db.signal_with_context({s.user, s.item, s.weight}, ctx),
          "signal of user " + std::to_string(s.user));
  }
}

std::vector<u64> minus(const std::vector<u64>& a, const std::vector<u64>& b) {
  std::vector<u64> out;
  for (u64 x : a)
    if (std::find(b.begin(), b.end(), x) == b.end()) out.push_back(x);
  return out;
}

// The signals of every phase, in order (the read mode needs only what they touch).
struct Script {
  std::vector<Phase::Sig> a, b, c, d, e;
};
Script script() {
  const std::vector<u64> users = all_users();
  Script s;
  s.a = signals_for(users, 0, 4);                                   // everyone, before any leave
  // Cohort 7777 hears only from the users purged later: its cell reads 0 afterwards.
  s.a.push_back({1003, 5, 0.1, {7777}});
  s.a.push_back({1013, 5, 1e-9, {7777, 7777}});
  s.b = signals_for(users, 1, 2);                                   // after the leaves: the Left ones are gated
  s.c = signals_for({kRejoiner, 1004, 1021}, 2, 3);                 // after the rejoin
  s.d = signals_for(minus(users, {1005}), 3, 1);                    // after the purges (purged users: gated)
  s.e = signals_for({1001, 1002, 1003, 0xFFFFFFFFFFFFFFFEULL}, 4, 2);  // after the trim
  return s;
}

// ----------------------------------------------------------------- write mode

int write_db(const std::string& dir) {
  if (std::filesystem::exists(dir)) die(dir + " exists; give a new directory");
  tidal::Options options;
  options.change_feed = true;
  options.shard_id = kShard;
  options.clock = [t = kClockBase]() mutable {
    const u64 now = t;
    t += kClockStep;
    return now;
  };
  options.aggregate_write_period = std::chrono::hours(1);  // only flush() writes: deterministic batches
  std::unique_ptr<tidal::Db> db = check(tidal::Db::open(dir, options), "open " + dir);

  const std::vector<u64> users = all_users();
  const Script sc = script();

  run_joins(*db, users);
  signal_all(*db, sc.a);
  check(db->flush(), "flush");                                  // feed batch
  run_exits(*db, users);
  signal_all(*db, signals_for({1001, 1008, 1015}, 5, 2));       // after the exits, before the leaves
  check(db->flush(), "flush");

  for (u64 u : kLeaveSingle) check(db->leave_community_layer(u), "leave");
  check(db->leave_community_layer(std::span<const u64>(kLeaveBulk)), "bulk leave");
  check(db->leave_community_layer(1003), "leave while Left (a no-op)");
  signal_all(*db, sc.b);
  check(db->flush(), "flush");

  check(db->rejoin_community_layer(kRejoiner), "rejoin");
  check(db->rejoin_community_layer(1001), "rejoin while Active (a no-op)");
  signal_all(*db, sc.c);
  check(db->flush(), "flush");

  // The purges: 1003 by the single form, 1013 by the bulk form.
  const tidal::PurgeReceipt r1 = check(db->purge_community_contributions(kPurged[0]), "purge");
  if (r1.entries_removed == 0 || !r1.erasure_complete) die("the purge of 1003 removed nothing or did not erase");
  const std::vector<u64> bulk = {kPurged[1], kPurged[1]};  // a duplicate is purged once
  const std::vector<tidal::PurgeReceipt> r2 =
      check(db->purge_community_contributions(std::span<const u64>(bulk)), "bulk purge");
  if (r2.size() != 1 || r2[0].entries_removed == 0 || !r2[0].erasure_complete)
    die("the bulk purge of 1013 did not give one erasing receipt");
  for (u64 u : kPurged) {
    const std::vector<tidal::PurgeReceipt> rs = check(db->purge_receipts(u), "receipts");
    if (rs.size() != 1 || !rs[0].erasure_complete) die("receipt of " + std::to_string(u) + " not complete");
  }

  signal_all(*db, sc.d);
  check(db->flush(), "flush");
  signal_all(*db, signals_for({1002, 1010}, 6, 2));
  check(db->flush(), "flush");

  // Trim the older half of the feed.
  const u64 last = check(db->last_change_seq(), "last_change_seq");
  if (last < 4) die("expected at least 4 feed batches, got " + std::to_string(last));
  check(db->trim_changes(last / 2), "trim_changes");

  signal_all(*db, sc.e);
  check(db->flush(), "flush");

  const tidal::VerifyReport v = check(db->verify(), "verify");
  if (!v.ok()) die("verify found problems: " + v.problems.front());
  const tidal::RematerializeReport rm = check(db->rematerialize_shared_aggregates(false), "rematerialize");
  if (!rm.mismatches.empty()) die("rematerialize found a mismatch: " + rm.mismatches.front());
  check(db->close(), "close");
  return 0;
}

// ------------------------------------------------------------------ read mode

std::string hex_bits(double d) {
  u64 bits;
  std::memcpy(&bits, &d, sizeof bits);
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, bits);
  return buf;
}
std::string hex_bytes(const std::string& s) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(s.size() * 2);
  for (unsigned char c : s) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}
const char* status_name(tidal::MembershipStatus s) {
  return s == tidal::MembershipStatus::Left ? "Left" : "Active";
}

const char* kHeader =
    "# format2_expected.txt: what tidal at commit 9dd4519 (on-disk format 2) reads from\n"
    "# format2_db.tar.gz (directory db/), opened with Options::read_only = true.\n"
    "# Written by tests/data/make_format2_db.cc (`make_format2_db read db`). Lines starting\n"
    "# with '#' are comments. Every number is decimal unless said hex; a double is the\n"
    "# 16 lowercase hex digits of its IEEE-754 bits (e.g. 1.0 = 3ff0000000000000).\n"
    "#\n"
    "# score <kind> <owner> <item> <double hex>\n"
    "#     kind = personal (owner = user) | cohort (owner = cohort id) | community (owner =\n"
    "#     community id): personal_score / cohort_score / community_score. Personal and cohort:\n"
    "#     one line for every (owner, item) a signal of the generator touched (cohort 7777 item 5\n"
    "#     reads 0: only the purged users fed it). Community: every community of the generator\n"
    "#     times every item any signal used. Sorted by kind (personal, cohort, community), then\n"
    "#     owner, then item, numerically.\n"
    "# status <user> <Active|Left> <left_at_ns|->\n"
    "#     community_layer_status: CommunityMembership{status, left_at_ns} ('-' = no leave time).\n"
    "#     It has no rejoin time: a rejoin's time is in the history lines. Every user, ascending.\n"
    "# history <user> <Active|Left> <at_ns>\n"
    "#     community_layer_history, one line per event, oldest first (Left = a leave,\n"
    "#     Active = a rejoin). Users with no event have no line.\n"
    "# left <user> <left_at_ns>\n"
    "#     for_each_left (reads the by_tag index), ascending user order.\n"
    "# receipt <user> <purged_at_ns> <entries_removed> <left_at_ns> <cohort_weight_removed hex>\n"
    "#         <community_weight_removed hex> <erasure_complete 0|1>\n"
    "#     purge_receipts (PurgeReceipt's fields), oldest first. Users with none have no line.\n"
    "# communities <user> [<community id> ...]\n"
    "#     communities_of, ascending; nothing after the user when it is in no community.\n"
    "# feed shard_id <n> / feed last_seq <n> / feed trimmed_seq <n> / feed pending_bytes <n>\n"
    "#     Stats::change_feed_shard_id, last_change_seq(), Stats::change_feed_trimmed_seq,\n"
    "#     Stats::change_feed_pending_bytes.\n"
    "# feed read_trimmed <StatusCode>\n"
    "#     the code of read_changes(0, ...): NotFound, since seqs 1..trimmed_seq are trimmed.\n"
    "# feed <seq> <payload hex>\n"
    "#     every untrimmed batch (read_changes(trimmed_seq, ...)), oldest first; each batch's\n"
    "#     ChangeBatch::shard_id is the shard_id above (checked). Payload bytes: docs/FORMAT.md.\n"
    "# verify ok <records_checked>\n"
    "#     Db::verify(); when it finds problems, instead:\n"
    "#     verify problems <records_checked> <count> then one 'verify problem <text>' each.\n"
    "#\n"
    "# Generator's ids: users 1001..1038, 81985529216486895 (0x0123456789abcdef),\n"
    "# 18446744073709551614 (0xfffffffffffffffe); communities 501-504 and\n"
    "# 9223372036854775813 (0x8000000000000005); cohorts 0, 9001-9005, 7777 (only purged users'\n"
    "# signals: 0 after the purges) and 2^64-1.\n"
    "# Left: 1003 (purged), 1013 (purged by the bulk form), 1021, 1030 and\n"
    "# 81985529216486895 (bulk leave); 1008 left and rejoined. Feed of shard 7.\n";

int read_db(const std::string& dir) {
  tidal::Options options;
  options.read_only = true;
  options.create_if_missing = false;
  std::unique_ptr<tidal::Db> db = check(tidal::Db::open(dir, options), "read-only open of " + dir);

  const std::vector<u64> users = all_users();
  const Script sc = script();
  // Every cell the generator's signals touched (also those of the unnamed phases).
  std::set<std::pair<u64, u64>> personal, cohort, community_items;
  std::set<u64> items_any;
  std::vector<std::vector<Phase::Sig>> phases = {sc.a, signals_for({1001, 1008, 1015}, 5, 2), sc.b, sc.c,
                                                 sc.d, signals_for({1002, 1010}, 6, 2), sc.e};
  for (const auto& ph : phases) {
    for (const Phase::Sig& s : ph) {
      personal.insert({s.user, s.item});
      for (u64 c : s.cohorts) cohort.insert({c, s.item});
      items_any.insert(s.item);
    }
  }
  // Communities: every community the generator used, with every item a signal touched.
  for (u64 c : kCommunities)
    for (u64 i : items_any) community_items.insert({c, i});

  std::printf("%s", kHeader);
  for (const auto& [u, i] : personal)
    std::printf("score personal %" PRIu64 " %" PRIu64 " %s\n", u, i,
                hex_bits(check(db->personal_score(u, i), "personal_score")).c_str());
  for (const auto& [c, i] : cohort)
    std::printf("score cohort %" PRIu64 " %" PRIu64 " %s\n", c, i,
                hex_bits(check(db->cohort_score(c, i), "cohort_score")).c_str());
  for (const auto& [c, i] : community_items)
    std::printf("score community %" PRIu64 " %" PRIu64 " %s\n", c, i,
                hex_bits(check(db->community_score(c, i), "community_score")).c_str());

  std::vector<u64> sorted_users = users;
  std::sort(sorted_users.begin(), sorted_users.end());
  for (u64 u : sorted_users) {
    const tidal::CommunityMembership m = check(db->community_layer_status(u), "status");
    if (m.user_id != u) die("status of " + std::to_string(u) + " names another user");
    if (m.left_at_ns)
      std::printf("status %" PRIu64 " %s %" PRIu64 "\n", u, status_name(m.status), *m.left_at_ns);
    else
      std::printf("status %" PRIu64 " %s -\n", u, status_name(m.status));
  }
  for (u64 u : sorted_users)
    for (const tidal::MembershipEvent& e : check(db->community_layer_history(u), "history"))
      std::printf("history %" PRIu64 " %s %" PRIu64 "\n", u, status_name(e.status), e.at_ns);
  check(db->for_each_left([](const tidal::CommunityMembership& m) {
          std::printf("left %" PRIu64 " %" PRIu64 "\n", m.user_id, m.left_at_ns.value_or(0));
          return true;
        }),
        "for_each_left");
  for (u64 u : sorted_users)
    for (const tidal::PurgeReceipt& r : check(db->purge_receipts(u), "purge_receipts")) {
      if (r.user_id != u) die("a receipt of " + std::to_string(u) + " names another user");
      std::printf("receipt %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 " %s %s %d\n", u, r.purged_at_ns,
                  r.entries_removed, r.left_at_ns, hex_bits(r.cohort_weight_removed).c_str(),
                  hex_bits(r.community_weight_removed).c_str(), r.erasure_complete ? 1 : 0);
    }
  for (u64 u : sorted_users) {
    std::printf("communities %" PRIu64, u);
    for (u64 c : check(db->communities_of(u), "communities_of")) std::printf(" %" PRIu64, c);
    std::printf("\n");
  }

  const tidal::Stats st = db->stats();
  const u64 last = check(db->last_change_seq(), "last_change_seq");
  if (!st.change_feed) die("the Db keeps no change feed");
  std::printf("feed shard_id %" PRIu64 "\n", st.change_feed_shard_id);
  std::printf("feed last_seq %" PRIu64 "\n", last);
  std::printf("feed trimmed_seq %" PRIu64 "\n", st.change_feed_trimmed_seq);
  std::printf("feed pending_bytes %" PRIu64 "\n", st.change_feed_pending_bytes);
  {
    const auto r = db->read_changes(0, 1 << 20);
    std::printf("feed read_trimmed %s\n", tidal::status_code_name(r.ok() ? tidal::StatusCode::Ok : r.status().code()));
  }
  u64 after = st.change_feed_trimmed_seq;
  while (after < last) {
    const std::vector<tidal::ChangeBatch> batches = check(db->read_changes(after, 1 << 20), "read_changes");
    if (batches.empty()) die("read_changes returned nothing before the last seq");
    for (const tidal::ChangeBatch& b : batches) {
      if (b.seq != after + 1) die("feed seq " + std::to_string(b.seq) + " after " + std::to_string(after));
      if (b.shard_id != st.change_feed_shard_id) die("a batch of another shard");
      std::printf("feed %" PRIu64 " %s\n", b.seq, hex_bytes(b.payload).c_str());
      after = b.seq;
    }
  }

  const tidal::VerifyReport v = check(db->verify(), "verify");
  if (v.ok()) {
    std::printf("verify ok %" PRIu64 "\n", v.records_checked);
  } else {
    std::printf("verify problems %" PRIu64 " %zu\n", v.records_checked, v.problems.size());
    for (const std::string& p : v.problems) std::printf("verify problem %s\n", p.c_str());
  }
  check(db->close(), "close");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || (std::strcmp(argv[1], "write") != 0 && std::strcmp(argv[1], "read") != 0)) {
    std::fprintf(stderr, "usage: %s write|read <db directory>\n", argv[0]);
    return 2;
  }
  return std::strcmp(argv[1], "write") == 0 ? write_db(argv[2]) : read_db(argv[2]);
}
