// Re-seeding a shard (Db::reseed_change_feed; docs/SCALE.md, "Re-seeding a
// shard"): a new incarnation whose first batches are a snapshot of the
// shard's shared aggregates, and a view that replaces the shard's whole
// contribution by it. Every test compares a view, bit for bit, with one Db
// that received exactly what the shards hold now.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include "feed_util.h"
#include "storage/feed_format.h"
#include "storage/state_format.h"
#include "storage/storage.h"
#include "test_util.h"
#include "tidal/db.h"
#include "tidal/global_view.h"
#include "view/view_format.h"

namespace tidal {
namespace {

using testing::open_db;
using testing::ScopedOverride;
using testing::sum_feed;
using testing::TempDir;
using testing::value_of;

constexpr std::uint64_t kItems = 12, kCohorts = 5, kCommunities = 3;

std::uint64_t bits(double d) {
  std::uint64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

Options feed_options(std::uint64_t shard) {
  Options options;
  options.change_feed = true;
  options.shard_id = shard;
  options.aggregate_write_period = std::chrono::milliseconds(5);
  return options;
}

// Sends the same signals to `dbs`: users u0..u0+n, a few items, cohorts.
void signal_all(std::initializer_list<Db*> dbs, std::uint64_t u0, std::uint64_t n, std::uint64_t seed, int count) {
  std::mt19937_64 rng(seed);
  for (int i = 0; i < count; ++i) {
    const Signal signal{u0 + rng() % n, rng() % kItems, static_cast<double>(rng() % 2001) / 7.0 - 100.0};
    SignalContext ctx;
    for (std::uint64_t c = 0; c < rng() % 3; ++c) ctx.cohort_ids.push_back(rng() % kCohorts);
    for (Db* db : dbs) ASSERT_OK(db->signal_with_context(signal, ctx));
  }
}

void join_all(std::initializer_list<Db*> dbs, std::uint64_t u0, std::uint64_t n) {
  for (std::uint64_t u = u0; u < u0 + n; ++u) {
    for (Db* db : dbs) ASSERT_OK(db->join_community(u, 100 + u % kCommunities));
  }
}

// Applies every batch of `db`'s feed after *cursor to `view`, as a
// publisher would carry them: from where the Db's feed starts when batches
// after the cursor were trimmed (a re-seed trims what it supersedes).
// Every batch must be taken.
void carry(Db& db, std::uint64_t* cursor, GlobalView& view) {
  ASSERT_OK(db.flush());
  for (;;) {
    Result<std::vector<ChangeBatch>> batches = db.read_changes(*cursor, 64 << 10);
    if (!batches.ok() && batches.status().code() == StatusCode::NotFound) {
      *cursor = db.stats().change_feed_trimmed_seq;
      continue;
    }
    ASSERT_OK(batches);
    if (batches->empty()) return;
    Result<ApplyOutcome> out = view.apply(*batches);
    ASSERT_OK(out);
    ASSERT_OK(out->refused);
    *cursor = batches->back().seq;
  }
}

// Every cell the tests touch: the view equals `reference`, bit for bit.
// Returns how many of them are nonzero.
std::size_t expect_view_equals(const GlobalView& view, const Db& reference) {
  std::size_t nonzero = 0;
  for (std::uint64_t item = 0; item < kItems; ++item) {
    for (std::uint64_t c = 0; c < kCohorts; ++c) {
      const double want = value_of(reference.cohort_score(c, item));
      EXPECT_EQ(bits(value_of(view.cohort_score(c, item))), bits(want)) << "cohort " << c << " item " << item;
      nonzero += want != 0 ? 1u : 0u;
    }
    for (std::uint64_t m = 100; m < 100 + kCommunities; ++m) {
      const double want = value_of(reference.community_score(m, item));
      EXPECT_EQ(bits(value_of(view.community_score(m, item))), bits(want)) << "community " << m << " item " << item;
      nonzero += want != 0 ? 1u : 0u;
    }
  }
  return nonzero;
}

TEST(Reseed, ANewIncarnationWhoseSnapshotHoldsEveryNonzeroSharedAggregate) {
  TempDir dir;
  auto db = open_db(dir.sub("db"), feed_options(4));
  ASSERT_NE(db, nullptr);
  join_all({db.get()}, 0, 20);
  signal_all({db.get()}, 0, 20, 1, 300);
  ASSERT_OK(db->flush());
  const Stats before = db->stats();
  ASSERT_GT(before.change_feed_last_seq, 0u);

  Result<std::uint64_t> first = db->reseed_change_feed();
  ASSERT_OK(first);
  EXPECT_EQ(*first, before.change_feed_last_seq + 1);
  const Stats after = db->stats();
  EXPECT_NE(after.change_feed_incarnation, before.change_feed_incarnation);
  EXPECT_EQ(after.change_feed_incarnation.size(), 32u);
  EXPECT_EQ(after.change_feed_trimmed_seq, before.change_feed_last_seq);
  // The superseded batches are gone; the snapshot is read from its first seq.
  EXPECT_EQ(db->read_changes(0, 1).status().code(), StatusCode::NotFound);
  Result<std::vector<ChangeBatch>> snapshot = db->read_changes(*first - 1, 64 << 20);
  ASSERT_OK(snapshot);
  ASSERT_FALSE(snapshot->empty());
  for (std::size_t i = 0; i < snapshot->size(); ++i) {
    const ChangeBatch& b = (*snapshot)[i];
    EXPECT_EQ(b.incarnation, after.change_feed_incarnation);
    EXPECT_EQ(feed_origin(b.payload), i == 0 ? FeedOrigin::Reseed : FeedOrigin::Seed) << "batch " << i;
  }
  // Its values are the aggregates (as deltas from 0).
  std::map<std::string, Units> sums;
  sum_feed(*db, &sums, *first - 1);
  std::size_t nonzero = 0;
  for (std::uint64_t item = 0; item < kItems; ++item) {
    for (std::uint64_t c = 0; c < kCohorts; ++c) {
      const double score = value_of(db->cohort_score(c, item));
      auto it = sums.find(encode_aggregate_key(AggregateKind::Cohort, c, item));
      EXPECT_EQ(bits(it == sums.end() ? 0.0 : units_to_double(it->second)), bits(score));
      nonzero += score != 0 ? 1u : 0u;
    }
  }
  EXPECT_GT(nonzero, 0u);
  // Reopened: the same incarnation, trim point and batches.
  ASSERT_OK(db->close());
  db = open_db(dir.sub("db"), feed_options(4));
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(db->stats().change_feed_incarnation, after.change_feed_incarnation);
  EXPECT_EQ(db->stats().change_feed_trimmed_seq, after.change_feed_trimmed_seq);
  EXPECT_EQ(db->stats().change_feed_last_seq, after.change_feed_last_seq);

  // A Db with no shared aggregate re-seeds to one empty first batch: the
  // shard contributes nothing.
  auto empty = open_db(dir.sub("empty"), feed_options(5));
  ASSERT_NE(empty, nullptr);
  Result<std::uint64_t> e = empty->reseed_change_feed();
  ASSERT_OK(e);
  Result<std::vector<ChangeBatch>> one = empty->read_changes(*e - 1, 1 << 20);
  ASSERT_OK(one);
  ASSERT_EQ(one->size(), 1u);
  EXPECT_EQ(feed_origin(one->front().payload), FeedOrigin::Reseed);
  EXPECT_EQ(one->front().payload.size(), kFeedHeaderSize);

  // Without a feed: refused, naming why.
  auto plain = open_db(dir.sub("plain"));
  ASSERT_NE(plain, nullptr);
  Result<std::uint64_t> none = plain->reseed_change_feed();
  EXPECT_EQ(none.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(none.status().message().find("keeps no change feed"), std::string::npos) << none.status().to_string();
}

// A shard restored from an older copy, then replaced by a fresh Db: each
// re-seed makes the view equal the sum of the shards' current aggregates,
// including a purge made after the restore; the old incarnation's batches
// delivered late change nothing.
TEST(Reseed, ARestoredOrFreshShardReseededLeavesTheViewEqualToTheShardsCurrentAggregates) {
  TempDir dir;
  auto a = open_db(dir.sub("a"), feed_options(0));
  auto b = open_db(dir.sub("b"), feed_options(1));
  auto reference = open_db(dir.sub("reference"));
  ASSERT_TRUE(a && b && reference);
  join_all({a.get(), reference.get()}, 0, 20);
  join_all({b.get(), reference.get()}, 20, 20);
  auto view = GlobalView::open(dir.sub("view"));
  ASSERT_OK(view);
  std::uint64_t cursor_a = 0, cursor_b = 0;

  // Phase 1: both shards; then an offline copy of shard 0.
  signal_all({a.get(), reference.get()}, 0, 20, 11, 400);
  signal_all({b.get(), reference.get()}, 20, 20, 12, 400);
  carry(*a, &cursor_a, **view);
  ASSERT_OK(a->close());
  std::filesystem::copy(dir.sub("a"), dir.sub("a-copy"), std::filesystem::copy_options::recursive);
  a = open_db(dir.sub("a"), feed_options(0));
  ASSERT_NE(a, nullptr);

  // Phase 2: shard 0 goes on and the view applies it; then its disk is
  // lost. The reference never sees these signals (no shard holds them now).
  signal_all({a.get()}, 0, 20, 13, 400);
  carry(*a, &cursor_a, **view);
  std::vector<ChangeBatch> lost;
  {
    Result<std::vector<ChangeBatch>> tail = a->read_changes(cursor_a - 1, 1);
    ASSERT_OK(tail);
    lost = *tail;
  }
  ASSERT_OK(a->close());
  a.reset();

  // Restore the copy and re-seed it; then more signals and a purge.
  auto restored = open_db(dir.sub("a-copy"), feed_options(0));
  ASSERT_NE(restored, nullptr);
  Result<std::uint64_t> first = restored->reseed_change_feed();
  ASSERT_OK(first);
  std::uint64_t cursor_r = *first - 1;
  signal_all({restored.get(), reference.get()}, 0, 20, 14, 400);
  signal_all({b.get(), reference.get()}, 20, 20, 15, 400);
  for (Db* db : {restored.get(), reference.get()}) {
    ASSERT_OK(db->leave_community_layer(5));
    ASSERT_OK(db->purge_community_contributions(5));
  }
  carry(*restored, &cursor_r, **view);
  carry(*b, &cursor_b, **view);
  EXPECT_GT(expect_view_equals(**view, *reference), 10u);

  // The lost shard's last batch, delivered late: superseded, nothing changed.
  Result<ApplyOutcome> late = (*view)->apply(lost);
  ASSERT_OK(late);
  EXPECT_OK(late->refused);
  EXPECT_EQ(late->taken, 1u);
  EXPECT_EQ(late->applied, 0u);
  expect_view_equals(**view, *reference);
  Result<std::vector<ShardProgress>> progress = (*view)->applied_shards();
  ASSERT_OK(progress);
  ASSERT_EQ(progress->size(), 2u);
  EXPECT_EQ((*progress)[0].incarnation, restored->stats().change_feed_incarnation);
  EXPECT_EQ((*progress)[0].applied_seq, restored->stats().change_feed_last_seq);

  // Shard 0 replaced by a fresh, empty Db: after its re-seed the view holds
  // shard 1 alone. The reference is rebuilt from shard 1's signals.
  auto fresh = open_db(dir.sub("fresh"), feed_options(0));
  auto reference_b = open_db(dir.sub("reference-b"));
  ASSERT_TRUE(fresh && reference_b);
  join_all({reference_b.get()}, 20, 20);
  signal_all({reference_b.get()}, 20, 20, 12, 400);
  signal_all({reference_b.get()}, 20, 20, 15, 400);
  Result<std::uint64_t> f = fresh->reseed_change_feed();
  ASSERT_OK(f);
  std::uint64_t cursor_f = *f - 1;
  carry(*fresh, &cursor_f, **view);
  EXPECT_GT(expect_view_equals(**view, *reference_b), 5u);
}

// Issue 41 item 3: a shard re-seeded three times. Every batch of the three
// replaced incarnations delivered late (the re-seeds' own snapshots
// included) is skipped, before and after the view is reopened, and the
// current incarnation's batches go on applying: the view stays equal to the
// shard. (A view that remembered only the last replaced incarnation took the
// first re-seed's snapshot again and skipped the current one's batches.)
TEST(Reseed, BatchesOfEveryReplacedIncarnationDeliveredLateAreSkipped) {
  TempDir dir;
  auto db = open_db(dir.sub("db"), feed_options(0));
  ASSERT_NE(db, nullptr);
  join_all({db.get()}, 0, 20);
  auto view = GlobalView::open(dir.sub("view"));
  ASSERT_OK(view);
  std::uint64_t cursor = 0;
  // Each replaced incarnation's batches, as carried to the view.
  std::vector<std::vector<ChangeBatch>> replaced(3);
  for (std::uint64_t i = 0; i < replaced.size(); ++i) {
    if (i > 0) {
      Result<std::uint64_t> reseed = db->reseed_change_feed();
      ASSERT_OK(reseed);
      cursor = *reseed - 1;
    }
    const std::uint64_t from = cursor;
    signal_all({db.get()}, 0, 20, 21 + i, 300);
    carry(*db, &cursor, **view);
    Result<std::vector<ChangeBatch>> read = db->read_changes(from, 64 << 20);
    ASSERT_OK(read);
    ASSERT_FALSE(read->empty());
    EXPECT_EQ(feed_origin(read->front().payload) == FeedOrigin::Reseed, i > 0) << "incarnation " << i;
    replaced[i] = *read;
  }
  Result<std::uint64_t> reseed = db->reseed_change_feed();
  ASSERT_OK(reseed);
  cursor = *reseed - 1;
  signal_all({db.get()}, 0, 20, 24, 300);
  carry(*db, &cursor, **view);
  ASSERT_GT(expect_view_equals(**view, *db), 10u);

  for (std::uint64_t round = 0; round < 2; ++round) {
    for (std::size_t i : {std::size_t{1}, std::size_t{0}, std::size_t{2}}) {
      Result<ApplyOutcome> out = (*view)->apply(replaced[i]);
      ASSERT_OK(out);
      EXPECT_OK(out->refused);
      EXPECT_EQ(out->taken, replaced[i].size()) << "incarnation " << i << ", round " << round;
      EXPECT_EQ(out->applied, 0u) << "incarnation " << i << ", round " << round;
    }
    // The current incarnation goes on applying.
    signal_all({db.get()}, 0, 20, 25 + round, 300);
    carry(*db, &cursor, **view);
    expect_view_equals(**view, *db);
    Result<std::vector<ShardProgress>> progress = (*view)->applied_shards();
    ASSERT_OK(progress);
    ASSERT_EQ(progress->size(), 1u);
    EXPECT_EQ((*progress)[0].incarnation, db->stats().change_feed_incarnation);
    EXPECT_EQ((*progress)[0].applied_seq, db->stats().change_feed_last_seq);
    // Reopened: the replaced incarnations are still known.
    ASSERT_OK((*view)->close());
    view = GlobalView::open(dir.sub("view"));
    ASSERT_OK(view);
  }
}

// Issue 64 item 6: shard 5 re-seeds three times (I0 -> I1 -> I2 -> I3), and
// a view applies I0 and then I3: it never saw I1 or I2. Every batch of I0,
// I1 and I2 delivered late, in every order (one at a time and as one run),
// is skipped, and I3's batches go on applying: the view stays equal to the
// shard. (A view that knew only the incarnations it had replaced took I1's
// re-seed as a new incarnation, replacing the shard's contribution, and
// then skipped I3's batches as of a replaced incarnation.)
TEST(Reseed, AViewThatMissedIncarnationsSkipsEveryOlderBatchInEveryOrder) {
  TempDir dir;
  Options options = feed_options(5);
  options.aggregate_write_period = std::chrono::hours(1);  // a batch per flush
  auto db = open_db(dir.sub("db"), options);
  ASSERT_NE(db, nullptr);
  join_all({db.get()}, 0, 20);
  auto view = GlobalView::open(dir.sub("view"));
  ASSERT_OK(view);
  // Each incarnation's batches: I0 one writer batch, I1 and I2 their
  // re-seed's snapshot and two writer batches.
  std::vector<std::vector<ChangeBatch>> older(3);
  std::uint64_t cursor = 0;
  for (std::uint64_t i = 0; i < older.size(); ++i) {
    std::uint64_t from = 0;
    if (i > 0) {
      Result<std::uint64_t> reseed = db->reseed_change_feed();
      ASSERT_OK(reseed);
      from = *reseed - 1;
    }
    for (int flushes = 0; flushes < (i == 0 ? 1 : 2); ++flushes) {
      signal_all({db.get()}, 0, 20, 31 + 2 * i + static_cast<std::uint64_t>(flushes), 60);
      ASSERT_OK(db->flush());
    }
    Result<std::vector<ChangeBatch>> read = db->read_changes(from, 64 << 20);
    ASSERT_OK(read);
    ASSERT_EQ(read->size(), i == 0 ? 1u : 3u) << "incarnation " << i;
    EXPECT_EQ(feed_origin(read->front().payload) == FeedOrigin::Reseed, i > 0) << "incarnation " << i;
    older[i] = *read;
    if (i == 0) carry(*db, &cursor, **view);  // the view applies I0 only
  }
  Result<std::uint64_t> reseed = db->reseed_change_feed();
  ASSERT_OK(reseed);
  cursor = *reseed - 1;
  signal_all({db.get()}, 0, 20, 41, 60);
  carry(*db, &cursor, **view);  // I3: its re-seed, then a writer batch
  ASSERT_GT(expect_view_equals(**view, *db), 20u);

  // I1's and I2's re-seeds delivered late, in the order they were made,
  // then I3 goes on.
  for (std::size_t i : {std::size_t{1}, std::size_t{2}}) {
    Result<bool> late = (*view)->apply(older[i].front());
    ASSERT_OK(late);
    EXPECT_FALSE(*late) << "incarnation " << i << "'s re-seed, delivered late, was applied";
  }
  signal_all({db.get()}, 0, 20, 42, 60);
  carry(*db, &cursor, **view);
  ASSERT_GT(expect_view_equals(**view, *db), 20u);
  ASSERT_FALSE(::testing::Test::HasFailure());

  // Every older batch, in every order, one at a time: each is skipped.
  std::vector<const ChangeBatch*> all;
  for (const auto& run : older) {
    for (const ChangeBatch& b : run) all.push_back(&b);
  }
  ASSERT_EQ(all.size(), 7u);
  std::vector<std::size_t> order(all.size());
  for (std::size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::size_t orders = 0;
  do {
    ++orders;
    for (std::size_t k : order) {
      Result<bool> r = (*view)->apply(*all[k]);
      ASSERT_OK(r);
      ASSERT_FALSE(*r) << "order " << orders << ": the older batch seq " << all[k]->seq << " of incarnation "
                       << all[k]->incarnation << " was applied";
    }
  } while (std::next_permutation(order.begin(), order.end()));
  EXPECT_EQ(orders, 5040u);
  // As runs (one write a run), in the reverse order of their making, then
  // all at once; again after a reopen.
  for (int round = 0; round < 2; ++round) {
    for (std::size_t i : {std::size_t{2}, std::size_t{0}, std::size_t{1}}) {
      Result<ApplyOutcome> out = (*view)->apply(older[i]);
      ASSERT_OK(out);
      EXPECT_OK(out->refused);
      EXPECT_EQ(out->taken, older[i].size()) << "incarnation " << i;
      EXPECT_EQ(out->applied, 0u) << "incarnation " << i;
    }
    std::vector<ChangeBatch> mixed;
    for (std::size_t k = all.size(); k-- > 0;) mixed.push_back(*all[k]);
    Result<ApplyOutcome> out = (*view)->apply(mixed);
    ASSERT_OK(out);
    EXPECT_OK(out->refused);
    EXPECT_EQ(out->taken, mixed.size());
    EXPECT_EQ(out->applied, 0u);
    signal_all({db.get()}, 0, 20, 43 + static_cast<std::uint64_t>(round), 60);
    carry(*db, &cursor, **view);
    EXPECT_GT(expect_view_equals(**view, *db), 20u);
    Result<std::vector<ShardProgress>> progress = (*view)->applied_shards();
    ASSERT_OK(progress);
    ASSERT_EQ(progress->size(), 1u);
    EXPECT_EQ((*progress)[0].incarnation, db->stats().change_feed_incarnation);
    EXPECT_EQ((*progress)[0].applied_seq, db->stats().change_feed_last_seq);
    ASSERT_OK((*view)->close());
    view = GlobalView::open(dir.sub("view"));
    ASSERT_OK(view);
  }
}

// Issue 64 item 6: a shard's incarnations only grow, across re-seeds, a
// reopen and a restore from a backup older than the shard's last re-seeds
// (finish_recovery's new incarnation is above every one the lost original
// made after the backup), and every batch carries its incarnation's ordinal.
TEST(Reseed, EveryNewIncarnationOfAShardHasAnOrdinalAboveEveryEarlierOne) {
  TempDir dir;
  auto db = open_db(dir.sub("db"), feed_options(6));
  ASSERT_NE(db, nullptr);
  join_all({db.get()}, 0, 20);
  signal_all({db.get()}, 0, 20, 51, 100);
  ASSERT_OK(db->flush());
  std::uint64_t last = db->stats().change_feed_incarnation_ordinal;
  EXPECT_GT(last, 0u);
  auto expect_batches_carry = [&](const Db& d) {
    const Stats st = d.stats();
    Result<std::vector<ChangeBatch>> batches = d.read_changes(st.change_feed_trimmed_seq, 64 << 20);
    ASSERT_OK(batches);
    ASSERT_FALSE(batches->empty());
    for (const ChangeBatch& b : *batches) {
      EXPECT_EQ(b.incarnation, st.change_feed_incarnation) << b.seq;
      EXPECT_EQ(b.incarnation_ordinal, st.change_feed_incarnation_ordinal) << b.seq;
    }
  };
  expect_batches_carry(*db);
  ASSERT_OK(db->backup(dir.sub("backup")));
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(db->reseed_change_feed());
    const std::uint64_t now = db->stats().change_feed_incarnation_ordinal;
    EXPECT_GT(now, last) << "re-seed " << i;
    last = now;
    expect_batches_carry(*db);
  }
  ASSERT_OK(db->close());
  db = open_db(dir.sub("db"), feed_options(6));
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(db->stats().change_feed_incarnation_ordinal, last);  // stored
  ASSERT_OK(db->close());
  db.reset();
  // The backup knows none of the three re-seeds; its restore's incarnation
  // is above them all.
  auto restored = open_db(dir.sub("backup"), feed_options(6));
  ASSERT_NE(restored, nullptr);
  ASSERT_TRUE(restored->stats().recovering);
  EXPECT_LT(restored->stats().change_feed_incarnation_ordinal, last);
  ASSERT_OK(restored->finish_recovery());
  EXPECT_GT(restored->stats().change_feed_incarnation_ordinal, last);
  expect_batches_carry(*restored);
}

// Re-seeds while 16 threads signal and a consumer keeps applying: every
// snapshot is one consistent point of the shard, and the view ends equal to
// the shard (the drain lock holds off every write between the snapshot's
// read and its write).
TEST(Reseed, UnderSixteenSignallingThreadsEveryReseedLeavesTheViewExact) {
  TempDir dir;
  Options options = feed_options(0);
  options.aggregate_write_period = std::chrono::milliseconds(2);
  auto db = open_db(dir.sub("db"), options);
  auto reference = open_db(dir.sub("reference"));
  ASSERT_TRUE(db && reference);
  join_all({db.get(), reference.get()}, 0, 64);
  auto view = GlobalView::open(dir.sub("view"));
  ASSERT_OK(view);

  // Each re-seed dawdles between its read of the aggregates and its write,
  // so that a write landing in between (without the drain lock) is seen.
  ScopedOverride hook(Storage::step_for_testing, [](std::string_view task, int) {
    if (task == "reseed") std::this_thread::sleep_for(std::chrono::milliseconds(20));
  });
  constexpr std::uint64_t kThreads = 16;
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  std::atomic<bool> stop_signals{false};
  for (std::uint64_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (std::uint64_t round = 0; !stop_signals.load(); ++round) {
        signal_all({db.get(), reference.get()}, 4 * t, 4, 1000 * t + round, 20);
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    });
  }
  std::uint64_t cursor = 0;
  std::thread consumer([&] {
    while (!done.load()) carry(*db, &cursor, **view);
  });
  int reseeds = 0;
  for (; reseeds < 5; ++reseeds) {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    ASSERT_OK(db->reseed_change_feed());
  }
  EXPECT_GT(db->stats().signals, 5000u) << "the signals did not overlap the re-seeds";
  stop_signals.store(true);
  for (std::thread& t : threads) t.join();
  done.store(true);
  consumer.join();
  carry(*db, &cursor, **view);
  EXPECT_GT(expect_view_equals(**view, *reference), 10u);
  Result<std::uint64_t> applied = (*view)->applied_seq(0);
  ASSERT_OK(applied);
  EXPECT_EQ(*applied, db->stats().change_feed_last_seq);
}

// A read that runs while a re-seed is ingesting its snapshot sees the old
// feed or the new one, each labelled with its own incarnation. (A read
// between the ingestion and the new incarnation labelled the snapshot's
// first batch with the old one; the view then refused the next batch as
// one of a new incarnation that was no re-seed: CI, session 32.)
TEST(Reseed, AReadDuringTheReseedsIngestionLabelsEachBatchWithItsOwnIncarnation) {
  TempDir dir;
  auto db = open_db(dir.sub("db"), feed_options(5));
  ASSERT_NE(db, nullptr);
  join_all({db.get()}, 0, 10);
  signal_all({db.get()}, 0, 10, 8, 100);
  ASSERT_OK(db->flush());
  const Stats before = db->stats();

  std::atomic<bool> ingested{false}, read_done{false};
  Result<std::vector<ChangeBatch>> read = Status::NotFound("not read");
  std::thread reader([&] {
    while (!ingested.load()) std::this_thread::yield();
    read = db->read_changes(before.change_feed_last_seq, 64 << 20);
    read_done.store(true);
  });
  // Between the re-seed's ingestion and its new incarnation: the read runs
  // (or waits) here.
  ScopedOverride hook(Storage::step_for_testing, [&](std::string_view task, int step) {
    if (task != "reseed" || step != 2) return;
    ingested.store(true);
    for (int i = 0; i < 200 && !read_done.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  Result<std::uint64_t> first = db->reseed_change_feed();
  reader.join();
  ASSERT_OK(first);
  const std::string incarnation = db->stats().change_feed_incarnation;
  ASSERT_NE(incarnation, before.change_feed_incarnation);
  ASSERT_OK(read);
  ASSERT_FALSE(read->empty());
  EXPECT_EQ(read->front().seq, *first);
  EXPECT_EQ(feed_origin(read->front().payload), FeedOrigin::Reseed);
  for (const ChangeBatch& b : *read) {
    EXPECT_EQ(b.incarnation, incarnation) << "batch " << b.seq << " of the re-seed is labelled with the old incarnation";
  }
}

// A view made before per-shard sums (view_format 2) cannot take a shard's
// old contribution out: a re-seed of a shard it applied is refused, naming
// the format; one that applied nothing becomes format 3 at its next open.
TEST(Reseed, AViewOfFormatTwoRefusesAReseedOfAShardItApplied) {
  TempDir dir;
  auto db = open_db(dir.sub("db"), feed_options(2));
  ASSERT_NE(db, nullptr);
  join_all({db.get()}, 0, 10);
  signal_all({db.get()}, 0, 10, 3, 100);
  auto mark = [](const std::string& path, const char* format) {
    std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
    cfs.emplace_back(kViewMetaFamily, rocksdb::ColumnFamilyOptions());
    cfs.emplace_back(kViewAggregatesFamily, rocksdb::ColumnFamilyOptions());
    cfs.emplace_back(kViewShardsFamily, rocksdb::ColumnFamilyOptions());
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::DB* raw = nullptr;
    ASSERT_TRUE(rocksdb::DB::Open(rocksdb::Options(), path, cfs, &handles, &raw).ok());
    ASSERT_TRUE(raw->Put(rocksdb::WriteOptions(), handles[0], kViewFormatKey, format).ok());
    for (auto* h : handles) (void)raw->DestroyColumnFamilyHandle(h);
    delete raw;
  };
  std::uint64_t cursor = 0;
  {
    auto view = GlobalView::open(dir.sub("old"));
    ASSERT_OK(view);
    carry(*db, &cursor, **view);
    ASSERT_OK((*view)->close());
  }
  mark(dir.sub("old"), "2");
  {
    auto view = GlobalView::open(dir.sub("empty"));
    ASSERT_OK(view);
    ASSERT_OK((*view)->close());
  }
  mark(dir.sub("empty"), "2");

  Result<std::uint64_t> first = db->reseed_change_feed();
  ASSERT_OK(first);
  Result<std::vector<ChangeBatch>> snapshot = db->read_changes(*first - 1, 64 << 20);
  ASSERT_OK(snapshot);
  auto old = GlobalView::open(dir.sub("old"));
  ASSERT_OK(old);
  const double before = value_of((*old)->cohort_score(0, 0)) + value_of((*old)->cohort_score(1, 1));
  Result<ApplyOutcome> out = (*old)->apply(*snapshot);
  ASSERT_OK(out);
  EXPECT_EQ(out->taken, 0u);
  EXPECT_EQ(out->refused.code(), StatusCode::Corruption);
  EXPECT_NE(out->refused.message().find("view_format 2"), std::string::npos) << out->refused.to_string();
  EXPECT_EQ(value_of((*old)->cohort_score(0, 0)) + value_of((*old)->cohort_score(1, 1)), before);

  auto empty = GlobalView::open(dir.sub("empty"));
  ASSERT_OK(empty);
  cursor = *first - 1;
  carry(*db, &cursor, **empty);
  expect_view_equals(**empty, *db);
}

}  // namespace
}  // namespace tidal
