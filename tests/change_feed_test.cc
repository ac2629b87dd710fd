// The change feed (docs/CONTRACT.md, "Change feed"): what enters it, its
// numbering, its bound, trimming, and the convergence of a GlobalView fed
// by several shards with one Db that received everything.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <span>
#include <tuple>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <rocksdb/db.h>

#include "db/impl.h"
#include "db/state_store.h"
#include "feed_util.h"
#include "raw_db.h"
#include "storage/feed_format.h"
#include "storage/format.h"
#include "storage/state_format.h"
#include "test_util.h"
#include "tidal/db.h"
#include "tidal/global_view.h"

namespace tidal {
namespace {

using testing::follow;
using testing::open_db;
using testing::sum_feed;
using testing::TempDir;
using testing::value_of;

std::uint64_t bits(double d) {
  std::uint64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

Options feed_options(std::uint64_t shard, Options options = {}) {
  options.change_feed = true;
  options.shard_id = shard;
  options.aggregate_write_period = std::chrono::hours(1);  // batches only at flush
  return options;
}

// Every shared cell of `db` the feed's sums name equals its score, and every
// cell in `cells` is named.
void expect_feed_equals_scores(Db& db, const std::map<std::string, Units>& sums) {
  for (const auto& [key, units] : sums) {
    std::optional<AggregateCell> cell = decode_aggregate_key(key);
    ASSERT_TRUE(cell);
    const double score = cell->kind == AggregateKind::Cohort ? value_of(db.cohort_score(cell->owner, cell->item))
                                                              : value_of(db.community_score(cell->owner, cell->item));
    EXPECT_EQ(bits(units_to_double(units)), bits(score)) << describe(*cell);
  }
}

// merge_feed_payloads (the view's one merge operand a cell): random
// payloads, overlapping and not, against sums per key in a std::map. Each
// key comes once, ascending, with every delta summed modulo 2^128.
TEST(ChangeFeed, MergingPayloadsSumsEachCellOnceInKeyOrder) {
  std::mt19937_64 rng(7);
  const Units big = static_cast<Units>(static_cast<UUnits>(1) << 126);  // sums wrap around 2^127
  for (int round = 0; round < 50; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    std::vector<std::string> payloads;
    std::map<std::string, UUnits> expected;
    const int n = static_cast<int>(rng() % 8);  // 0 to 7 payloads
    for (int p = 0; p < n; ++p) {
      std::map<std::string, Units> entries;  // ascending keys, as a payload holds them
      const int count = static_cast<int>(rng() % 40);
      for (int e = 0; e < count; ++e) {
        const AggregateKind kind = rng() % 2 == 0 ? AggregateKind::Cohort : AggregateKind::Community;
        const Units delta = rng() % 5 == 0 ? big : static_cast<Units>(static_cast<std::int64_t>(rng() % 2001) - 1000);
        entries[encode_aggregate_key(kind, rng() % 3, rng() % 10)] = delta;
      }
      FeedEncoder encoder(FeedOrigin::Writer);
      for (const auto& [key, delta] : entries) {
        encoder.add(key, delta);
        expected[key] += static_cast<UUnits>(delta);
      }
      std::vector<std::string> sealed = encoder.finish();
      ASSERT_LE(sealed.size(), 1u);
      payloads.insert(payloads.end(), sealed.begin(), sealed.end());
    }
    std::vector<std::string_view> views(payloads.begin(), payloads.end());
    for (std::string_view v : views) {
      std::string error;
      ASSERT_TRUE(check_feed_payload(v, &error)) << error;
    }
    std::vector<std::pair<std::string, UUnits>> got;
    merge_feed_payloads(views, [&](std::string_view key, Units sum) {
      got.emplace_back(std::string(key), static_cast<UUnits>(sum));
    });
    const std::vector<std::pair<std::string, UUnits>> want(expected.begin(), expected.end());
    EXPECT_TRUE(got == want) << got.size() << " cells merged, " << expected.size() << " expected";
  }
}

TEST(ChangeFeed, SharedChangesEnterTheFeedPersonalOnesNeverAndSeqsRunWithoutAGap) {
  TempDir dir;
  auto db = open_db(dir.path(), feed_options(3));
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(*db->last_change_seq(), 0u);
  EXPECT_TRUE(db->read_changes(0, 1 << 20)->empty());
  ASSERT_OK(db->join_community(1, 50));
  ASSERT_OK(db->signal_with_context({1, 9, 0.1}, {{4}}));
  ASSERT_OK(db->signal_with_context({2, 9, 0.2}, {}));  // personal only: nothing for the feed
  ASSERT_OK(db->flush());
  ASSERT_EQ(*db->last_change_seq(), 1u);
  Result<std::vector<ChangeBatch>> batches = db->read_changes(0, 1 << 20);
  ASSERT_OK(batches);
  ASSERT_EQ(batches->size(), 1u);
  EXPECT_EQ((*batches)[0].shard_id, 3u);
  EXPECT_EQ((*batches)[0].seq, 1u);
  std::vector<FeedEntry> entries;
  std::string error;
  ASSERT_TRUE(decode_feed_payload((*batches)[0].payload, [&](const FeedEntry& e) { entries.push_back(e); }, &error))
      << error;
  ASSERT_EQ(entries.size(), 2u);  // cohort 4 and community 50, item 9; never a personal cell or a user id
  EXPECT_EQ(entries[0].kind, AggregateKind::Cohort);
  EXPECT_EQ(entries[0].owner, 4u);
  EXPECT_EQ(entries[0].delta, Units{100'000'000});
  EXPECT_EQ(entries[1].kind, AggregateKind::Community);
  EXPECT_EQ(entries[1].owner, 50u);
  EXPECT_EQ(static_cast<std::uint8_t>((*batches)[0].payload[1]), static_cast<std::uint8_t>(FeedOrigin::Writer));
  // A leave and a purge: the subtraction enters the feed too.
  ASSERT_OK(db->leave_community_layer(1));
  ASSERT_OK(db->purge_community_contributions(1));
  EXPECT_EQ(*db->last_change_seq(), 2u);
  batches = db->read_changes(1, 1 << 20);
  ASSERT_OK(batches);
  ASSERT_EQ(batches->size(), 1u);
  EXPECT_EQ(static_cast<std::uint8_t>((*batches)[0].payload[1]), static_cast<std::uint8_t>(FeedOrigin::Purge));
  std::map<std::string, Units> sums;
  EXPECT_EQ(sum_feed(*db, &sums), 2u);
  EXPECT_EQ(sums[encode_aggregate_key(AggregateKind::Cohort, 4, 9)], 0);
  expect_feed_equals_scores(*db, sums);
  // Seqs go on after a reopen, and after a trim and a reopen.
  ASSERT_OK(db->close());
  db = open_db(dir.path(), feed_options(3));
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(*db->last_change_seq(), 2u);
  ASSERT_OK(db->trim_changes(2));
  ASSERT_OK(db->close());
  db = open_db(dir.path(), feed_options(3));
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(*db->last_change_seq(), 2u);
  ASSERT_OK(db->signal_with_context({5, 9, 1.0}, {{4}}));
  ASSERT_OK(db->flush());
  batches = db->read_changes(2, 1 << 20);
  ASSERT_OK(batches);
  ASSERT_EQ(batches->size(), 1u);
  EXPECT_EQ((*batches)[0].seq, 3u);  // never 1 again
  EXPECT_EQ(db->stats().change_feed_last_seq, 3u);
  EXPECT_EQ(db->stats().change_feed_trimmed_seq, 2u);
  EXPECT_EQ(db->stats().change_feed_pending_bytes, (*batches)[0].payload.size());
}

TEST(ChangeFeed, ABatchOfMoreThan512KiBBecomesConsecutiveBatchesOfOneStep) {
  TempDir dir;
  auto db = open_db(dir.path(), feed_options(1));
  ASSERT_NE(db, nullptr);
  SignalContext wide;
  for (std::uint64_t c = 0; c < kMaxCohortsPerSignal; ++c) wide.cohort_ids.push_back(c);
  for (std::uint64_t item = 0; item < 20; ++item) ASSERT_OK(db->signal_with_context({1, item, 1.0}, wide));
  ASSERT_OK(db->flush());  // 20,480 shared cells in one writer batch
  EXPECT_EQ(*db->last_change_seq(), 2u);
  Result<std::vector<ChangeBatch>> batches = db->read_changes(0, 1);  // at least one, even below max_bytes
  ASSERT_OK(batches);
  ASSERT_EQ(batches->size(), 1u);
  EXPECT_EQ((*batches)[0].payload.size(), kFeedHeaderSize + kMaxFeedEntries * kFeedEntrySize);
  EXPECT_LE((*batches)[0].payload.size(), kMaxChangePayloadBytes);
  std::map<std::string, Units> sums;
  EXPECT_EQ(sum_feed(*db, &sums), 2u);
  EXPECT_EQ(sums.size(), 20'480u);
  expect_feed_equals_scores(*db, sums);
}

TEST(ChangeFeed, TheShardIdIsFixedAndAFeedDbMustBeOpenedWithTheFeed) {
  TempDir dir;
  {
    auto db = open_db(dir.path(), feed_options(4));
    ASSERT_NE(db, nullptr);
    ASSERT_OK(db->signal_with_context({1, 1, 1.0}, {{2}}));
    ASSERT_OK(db->close());
  }
  Result<std::unique_ptr<Db>> other = Db::open(dir.path(), feed_options(5));
  ASSERT_EQ(other.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(other.status().message().find("belongs to shard 4"), std::string::npos) << other.status().to_string();
  Result<std::unique_ptr<Db>> without = Db::open(dir.path());
  ASSERT_EQ(without.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(without.status().message().find("change_feed = true and shard_id = 4"), std::string::npos)
      << without.status().to_string();
  // Nothing changed; a read-only open without the option reads the feed.
  Options ro;
  ro.read_only = true;
  auto reader = open_db(dir.path(), ro);
  ASSERT_NE(reader, nullptr);
  EXPECT_EQ(*reader->last_change_seq(), 1u);
  EXPECT_EQ(value_of(reader->cohort_score(2, 1)), 1.0);
  ASSERT_OK(reader->close());
  // A Db without a feed: the calls say so.
  TempDir plain_dir;
  auto plain = open_db(plain_dir.path());
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(plain->read_changes(0, 10).status().code(), StatusCode::InvalidArgument);
  EXPECT_EQ(plain->last_change_seq().status().code(), StatusCode::InvalidArgument);
  EXPECT_EQ(plain->trim_changes(1).code(), StatusCode::InvalidArgument);
}

// Rewrites the meta record `key` of the (closed) Db at `path`'s state
// engine: its value becomes what `edit` returns, or is deleted when that is
// empty.
void edit_meta(const std::string& path, const char* key,
               const std::function<std::string(const std::string& value)>& edit) {
  const std::string dir = state_engine_dir(path);
  std::vector<std::string> names;
  ASSERT_TRUE(rocksdb::DB::ListColumnFamilies(rocksdb::Options(), dir, &names).ok());
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
  for (const std::string& name : names) cfs.emplace_back(name, rocksdb::ColumnFamilyOptions());
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  rocksdb::DBOptions o;
  rocksdb::Options opts(o, rocksdb::ColumnFamilyOptions());
  opts.disable_auto_compactions = true;
  opts.avoid_flush_during_shutdown = true;
  rocksdb::Status s = rocksdb::DB::Open(rocksdb::DBOptions(opts), dir, cfs, &handles, &raw);
  ASSERT_TRUE(s.ok()) << s.ToString();
  std::unique_ptr<rocksdb::DB> db(raw);
  std::string value;
  ASSERT_TRUE(db->Get(rocksdb::ReadOptions(), handles[0], key, &value).ok()) << key;
  const std::string edited = edit(value);
  rocksdb::WriteOptions wo;
  wo.sync = true;
  s = edited.empty() ? db->Delete(wo, handles[0], key) : db->Put(wo, handles[0], key, edited);
  ASSERT_TRUE(s.ok()) << s.ToString();
  for (auto* h : handles) (void)db->DestroyColumnFamilyHandle(h);
}

// A feed made before incarnations.
void drop_incarnation(const std::string& path) {
  edit_meta(path, kFeedIncarnationKey, [](const std::string& value) {
    EXPECT_EQ(value.size(), 16u);
    return std::string();
  });
}

// Issue 27: every feed has a random 128-bit incarnation, fixed when it is
// created, carried by every batch; a feed made before incarnations gets one
// at its next writable open.
TEST(ChangeFeed, EveryFeedHasItsOwnIncarnationFixedAtCreationAndCarriedByEveryBatch) {
  TempDir dir, other_dir;
  std::string incarnation;
  {
    auto db = open_db(dir.path(), feed_options(4));
    ASSERT_NE(db, nullptr);
    incarnation = db->stats().change_feed_incarnation;
    ASSERT_EQ(incarnation.size(), 32u);
    EXPECT_EQ(incarnation.find_first_not_of("0123456789abcdef"), std::string::npos) << incarnation;
    ASSERT_OK(db->signal_with_context({1, 1, 1.0}, {{2}}));
    ASSERT_OK(db->flush());
    Result<std::vector<ChangeBatch>> batches = db->read_changes(0, 1 << 20);
    ASSERT_TRUE(batches.ok());
    ASSERT_FALSE(batches->empty());
    for (const ChangeBatch& b : *batches) EXPECT_EQ(b.incarnation, incarnation) << b.seq;
    ASSERT_OK(db->close());
  }
  {
    auto db = open_db(dir.path(), feed_options(4));
    ASSERT_NE(db, nullptr);
    EXPECT_EQ(db->stats().change_feed_incarnation, incarnation);  // fixed
    ASSERT_OK(db->close());
  }
  {
    auto other = open_db(other_dir.path(), feed_options(4));  // a Db re-created for the same shard
    ASSERT_NE(other, nullptr);
    EXPECT_EQ(other->stats().change_feed_incarnation.size(), 32u);
    EXPECT_NE(other->stats().change_feed_incarnation, incarnation);
  }
  // A feed without one (made before incarnations): unknown read-only, a new
  // one at the next writable open, kept from then on.
  drop_incarnation(dir.path());
  {
    Options ro;
    ro.read_only = true;
    auto reader = open_db(dir.path(), ro);
    ASSERT_NE(reader, nullptr);
    EXPECT_EQ(reader->stats().change_feed_incarnation, "");
    EXPECT_EQ(reader->read_changes(0, 1 << 20)->front().incarnation, "");
  }
  std::string given;
  {
    auto db = open_db(dir.path(), feed_options(4));
    ASSERT_NE(db, nullptr);
    given = db->stats().change_feed_incarnation;
    EXPECT_EQ(given.size(), 32u);
    EXPECT_NE(given, incarnation);
    EXPECT_EQ(db->read_changes(0, 1 << 20)->front().incarnation, given);
    ASSERT_OK(db->close());
  }
  auto db = open_db(dir.path(), feed_options(4));
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(db->stats().change_feed_incarnation, given);
}

// Issue 64 item 6: every incarnation has an ordinal (ChangeBatch::
// incarnation_ordinal), stored beside it and carried by every batch. A feed
// made before ordinals (no ordinal record) keeps its incarnation: unknown
// ordinal on a read-only open, one given at the next writable open, kept
// from then on; one re-seeded by a version before ordinals (the record names
// the incarnation it replaced) gets a new ordinal above the stored one.
TEST(ChangeFeed, AFeedMadeBeforeOrdinalsKeepsItsIncarnationAndGetsAnOrdinalAtItsNextWritableOpen) {
  TempDir dir;
  std::string incarnation;
  std::uint64_t ordinal = 0;
  auto open_stats = [&](bool read_only) {
    Options options = feed_options(4);
    if (read_only) {
      options = Options();
      options.read_only = true;
    }
    auto db = open_db(dir.path(), options);
    EXPECT_NE(db, nullptr);
    if (db == nullptr) return std::make_pair(Stats(), std::uint64_t{0});
    Result<std::vector<ChangeBatch>> batches = db->read_changes(0, 1 << 20);
    EXPECT_TRUE(batches.ok() && !batches->empty());
    const std::uint64_t carried = batches.ok() && !batches->empty() ? batches->front().incarnation_ordinal : 0;
    return std::make_pair(db->stats(), carried);
  };
  {
    auto db = open_db(dir.path(), feed_options(4));
    ASSERT_NE(db, nullptr);
    incarnation = db->stats().change_feed_incarnation;
    ordinal = db->stats().change_feed_incarnation_ordinal;
    EXPECT_GT(ordinal, 0u);
    ASSERT_OK(db->signal_with_context({1, 1, 1.0}, {{2}}));
    ASSERT_OK(db->flush());
    Result<std::vector<ChangeBatch>> batches = db->read_changes(0, 1 << 20);
    ASSERT_OK(batches);
    ASSERT_FALSE(batches->empty());
    for (const ChangeBatch& b : *batches) EXPECT_EQ(b.incarnation_ordinal, ordinal) << b.seq;
  }
  auto [st, carried] = open_stats(false);
  EXPECT_EQ(st.change_feed_incarnation_ordinal, ordinal);  // stored
  // Made before ordinals.
  edit_meta(dir.path(), kFeedOrdinalKey, [](const std::string& value) {
    EXPECT_EQ(value.size(), 24u);
    return std::string();
  });
  std::tie(st, carried) = open_stats(true);
  EXPECT_EQ(st.change_feed_incarnation, incarnation);
  EXPECT_EQ(st.change_feed_incarnation_ordinal, 0u);
  EXPECT_EQ(carried, 0u);
  std::tie(st, carried) = open_stats(false);
  EXPECT_EQ(st.change_feed_incarnation, incarnation);
  const std::uint64_t given = st.change_feed_incarnation_ordinal;
  EXPECT_GT(given, 0u);
  EXPECT_EQ(carried, given);
  std::tie(st, carried) = open_stats(false);
  EXPECT_EQ(st.change_feed_incarnation_ordinal, given);  // kept
  // Re-seeded by a version before ordinals: another incarnation, the ordinal
  // record still naming the one it replaced.
  edit_meta(dir.path(), kFeedIncarnationKey, [](const std::string&) { return std::string(16, '\x5a'); });
  std::tie(st, carried) = open_stats(true);
  EXPECT_EQ(st.change_feed_incarnation, "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a");
  EXPECT_EQ(st.change_feed_incarnation_ordinal, 0u);
  std::tie(st, carried) = open_stats(false);
  EXPECT_EQ(st.change_feed_incarnation, "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a");
  EXPECT_GT(st.change_feed_incarnation_ordinal, given);
  EXPECT_EQ(carried, st.change_feed_incarnation_ordinal);
  // A record of another length: Corruption.
  edit_meta(dir.path(), kFeedOrdinalKey, [](const std::string& value) { return value + "x"; });
  Result<std::unique_ptr<Db>> bad = Db::open(dir.path(), feed_options(4));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::Corruption);
  EXPECT_NE(bad.status().message().find("expected 24"), std::string::npos) << bad.status().to_string();
}

TEST(ChangeFeed, TurningTheFeedOnSeedsItWithTheSharedAggregatesSoAViewFromSeqOneIsComplete) {
  TempDir dir;
  {
    auto db = open_db(dir.path());
    ASSERT_NE(db, nullptr);
    ASSERT_OK(db->join_community(1, 70));
    for (std::uint64_t i = 0; i < 30; ++i) ASSERT_OK(db->signal_with_context({1, i, 0.1 * static_cast<double>(i)}, {{8}}));
    ASSERT_OK(db->close());
  }
  auto db = open_db(dir.path(), feed_options(2));
  ASSERT_NE(db, nullptr);
  ASSERT_EQ(*db->last_change_seq(), 1u);
  Result<std::vector<ChangeBatch>> seed = db->read_changes(0, 1 << 20);
  ASSERT_OK(seed);
  EXPECT_EQ(static_cast<std::uint8_t>((*seed)[0].payload[1]), static_cast<std::uint8_t>(FeedOrigin::Seed));
  ASSERT_OK(db->signal_with_context({1, 3, 5.0}, {{8}}));
  ASSERT_OK(db->flush());
  TempDir view_dir;
  auto view = GlobalView::open(view_dir.path());
  ASSERT_OK(view);
  EXPECT_EQ(follow(*db, 2, **view), 2u);
  for (std::uint64_t i = 0; i < 30; ++i) {
    EXPECT_EQ(bits(value_of((*view)->cohort_score(8, i))), bits(value_of(db->cohort_score(8, i)))) << i;
    EXPECT_EQ(bits(value_of((*view)->community_score(70, i))), bits(value_of(db->community_score(70, i)))) << i;
  }
}

// At its bound the feed refuses signals before they are accepted, and
// everything accepted is written (issue 27, item 5): the writer's batches,
// purges and repairs always go in, a close writes what is pending, and a
// reopen reads every accepted signal back. Before, a full feed refused the
// writer's batch, which stayed in memory and was lost at close, and a purge
// (a privacy erasure) returned Busy while the consumers were down.
TEST(ChangeFeed, AtItsBoundSignalsAreRefusedBeforeTheyAreAcceptedAndNothingAcceptedIsLost) {
  TempDir dir;
  Options options = feed_options(1);
  options.change_feed_max_bytes = 150;  // three batches of one cell (39 bytes each)
  std::vector<std::uint64_t> accepted;
  std::uint64_t refused = 0;
  {
    auto db = open_db(dir.path(), options);
    ASSERT_NE(db, nullptr);
    ASSERT_OK(db->join_community(1, 70));
    for (std::uint64_t i = 0; i < 10; ++i) {
      Result<SignalOutcome> out = db->signal_with_context({1, i, 1.0}, {{4}});
      if (out.ok()) {
        accepted.push_back(i);
      } else {
        ++refused;
        EXPECT_EQ(out.status().code(), StatusCode::Busy) << out.status().to_string();
        EXPECT_NE(out.status().message().find("at or above Options::change_feed_max_bytes (150)"), std::string::npos)
            << out.status().to_string();
        EXPECT_NE(out.status().message().find("the signal was not applied"), std::string::npos);
        EXPECT_EQ(value_of(db->personal_score(1, i)), 0.0) << "a refused signal was applied";
      }
      ASSERT_OK(db->flush());  // the writer is never refused
    }
    EXPECT_GT(refused, 0u);
    EXPECT_FALSE(accepted.empty());
    EXPECT_EQ(db->stats().change_feed_refused_signals, refused);
    EXPECT_EQ(db->stats().aggregate_write_failures, 0u);
    EXPECT_LE(db->stats().change_feed_pending_bytes, 150u + 2 * 80u);  // past the bound by what was accepted
    // A purge past the bound is written: an erasure never waits for the
    // consumers. Its deltas enter the feed, past the bound.
    const std::uint64_t before = db->stats().change_feed_last_seq;
    ASSERT_OK(db->leave_community_layer(1));
    Result<PurgeReceipt> purge = db->purge_community_contributions(1);
    ASSERT_OK(purge.status());
    EXPECT_EQ(purge->cohort_weight_removed, static_cast<double>(accepted.size()));
    EXPECT_GT(db->stats().change_feed_last_seq, before);
    ASSERT_OK(db->rejoin_community_layer(1));
    // Accepted, not yet written, when the Db closes: written by the close.
    ASSERT_OK(db->trim_changes(*db->last_change_seq()));
    for (std::uint64_t i = 100; i < 103; ++i) ASSERT_OK(db->signal_with_context({2, i, 1.0}, {{4}}));
    ASSERT_OK(db->close());
  }
  auto db = open_db(dir.path(), options);
  ASSERT_NE(db, nullptr);
  for (std::uint64_t i : accepted) EXPECT_EQ(value_of(db->personal_score(1, i)), 1.0) << i;
  for (std::uint64_t i = 100; i < 103; ++i) EXPECT_EQ(value_of(db->cohort_score(4, i)), 1.0) << i;
  Result<VerifyReport> report = db->verify();
  ASSERT_OK(report);
  EXPECT_TRUE(report->ok()) << report->problems.front();
}

// A trim lets signals in again at once, and a full feed never makes the
// writer fail or retry: with the write buffers' soft bound reached at once,
// the writer wrote on time and no batch write failed.
TEST(ChangeFeed, ATrimLetsSignalsInAgainAndAFullFeedNeverFailsTheWriter) {
  TempDir dir;
  Options options = feed_options(1);  // period: an hour
  options.change_feed_max_bytes = 1;  // full after one batch
  options.write_buffer_bytes = 256 << 10;
  auto db = open_db(dir.path(), options);
  ASSERT_NE(db, nullptr);
  ASSERT_OK(db->signal_with_context({1, 0, 1.0}, {{4}}));
  ASSERT_OK(db->flush());
  std::uint64_t busy = 0;
  for (std::uint64_t i = 1; i < 2000; ++i) {
    Result<SignalOutcome> out = db->signal_with_context({1 + i % 50, i, 1.0}, {{4}});
    if (!out.ok()) {
      ++busy;
      ASSERT_EQ(out.status().code(), StatusCode::Busy) << out.status().to_string();
    }
  }
  EXPECT_EQ(busy, 1999u) << "signals were accepted into a full feed";
  EXPECT_EQ(db->stats().aggregate_write_failures, 0u);
  EXPECT_EQ(db->stats().aggregate_cells_pending, 0u);
  ASSERT_OK(db->trim_changes(*db->last_change_seq()));
  Result<SignalOutcome> after = db->signal_with_context({1, 5000, 1.0}, {{4}});
  EXPECT_OK(after.status());
}

TEST(ChangeFeed, ReadChangesHonoursMaxBytesAndSaysWhatWasTrimmed) {
  TempDir dir;
  auto db = open_db(dir.path(), feed_options(1));
  ASSERT_NE(db, nullptr);
  for (std::uint64_t i = 0; i < 5; ++i) {
    ASSERT_OK(db->signal_with_context({1, i, 1.0}, {{4}}));
    ASSERT_OK(db->flush());
  }
  Result<std::vector<ChangeBatch>> two = db->read_changes(0, 1);
  ASSERT_OK(two);
  EXPECT_EQ(two->size(), 1u);
  Result<std::vector<ChangeBatch>> all = db->read_changes(0, 1 << 20);
  ASSERT_OK(all);
  EXPECT_EQ(all->size(), 5u);
  EXPECT_TRUE(db->read_changes(5, 1 << 20)->empty());
  // Past the last seq there can be (issue 41 item 7: after_seq + 1 wrapped
  // to 0 and the read returned Corruption).
  for (std::uint64_t after : {std::uint64_t{6}, std::numeric_limits<std::uint64_t>::max() - 1,
                              std::numeric_limits<std::uint64_t>::max()}) {
    Result<std::vector<ChangeBatch>> none = db->read_changes(after, 1 << 20);
    ASSERT_OK(none);
    EXPECT_TRUE(none->empty()) << "after " << after;
  }
  ASSERT_OK(db->trim_changes(3));
  ASSERT_OK(db->trim_changes(2));  // below the trim point: nothing changes
  Result<std::vector<ChangeBatch>> gone = db->read_changes(1, 1 << 20);
  EXPECT_EQ(gone.status().code(), StatusCode::NotFound);
  EXPECT_NE(gone.status().message().find("trimmed through seq 3"), std::string::npos) << gone.status().to_string();
  EXPECT_EQ(db->read_changes(3, 1 << 20)->size(), 2u);
  EXPECT_EQ(db->trim_changes(9).code(), StatusCode::InvalidArgument);
}

// The live SST files of the change feed's column family of the (closed) Db
// at `path`, from its state engine opened read-only.
std::size_t feed_files(const std::string& path) {
  const std::string dir = state_engine_dir(path);
  std::vector<std::string> names;
  EXPECT_TRUE(rocksdb::DB::ListColumnFamilies(rocksdb::Options(), dir, &names).ok());
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs;
  for (const std::string& name : names) cfs.emplace_back(name, rocksdb::ColumnFamilyOptions());
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::OpenForReadOnly(rocksdb::Options(), dir, cfs, &handles, &raw);
  EXPECT_TRUE(s.ok()) << s.ToString();
  if (!s.ok()) return 0;
  std::unique_ptr<rocksdb::DB> db(raw);
  std::vector<rocksdb::LiveFileMetaData> files;
  db->GetLiveFilesMetaData(&files);
  for (auto* h : handles) (void)db->DestroyColumnFamilyHandle(h);
  return static_cast<std::size_t>(
      std::count_if(files.begin(), files.end(), [](const auto& f) { return f.column_family_name == "feed"; }));
}

// Trimmed batches leave no files behind. Feed keys only grow, so each
// ingested feed file landed at the bottom level, where no compaction by
// size reaches it, and a trim's range deletion stayed above them: 400 files
// after 400 batches, all trimmed (issue 26, item 10). A file that holds
// trimmed and untrimmed seqs stays, and reads past the trim point go on
// after a reopen.
TEST(ChangeFeed, TrimmedBatchesLeaveNoFilesBehind) {
  TempDir dir;
  std::uint64_t trimmed = 0;
  {
    auto db = open_db(dir.path(), feed_options(1));
    ASSERT_NE(db, nullptr);
    for (std::uint64_t i = 0; i < 400; ++i) {
      ASSERT_OK(db->signal_with_context({1 + i % 7, i, 1.0}, {{4}}));
      ASSERT_OK(db->flush());
      ASSERT_OK(db->trim_changes(*db->last_change_seq()));
    }
    // One write of three payloads (one file), trimmed through its first.
    for (std::uint64_t i = 0; i < 2 * kMaxFeedEntries + 10; ++i) {
      ASSERT_OK(db->signal_with_context({1, 1000 + i, 1.0}, {{5}}));
    }
    ASSERT_OK(db->flush());
    ASSERT_EQ(*db->last_change_seq(), 403u);
    trimmed = 401;
    ASSERT_OK(db->trim_changes(trimmed));
    ASSERT_OK(db->close());
  }
  const std::size_t files = feed_files(dir.path());
  std::cout << "[feed files] after 400 trimmed batches and a partly trimmed one: " << files << " feed files\n";
  EXPECT_LE(files, 10u);
  auto db = open_db(dir.path(), feed_options(1));
  ASSERT_NE(db, nullptr);
  EXPECT_EQ(*db->last_change_seq(), 403u);
  EXPECT_EQ(db->read_changes(0, 1 << 20).status().code(), StatusCode::NotFound);
  std::map<std::string, Units> sums;
  EXPECT_EQ(sum_feed(*db, &sums, trimmed), 403u);
  // Seqs 402 and 403 hold the last 2 * kMaxFeedEntries + 10 - kMaxFeedEntries
  // cells of cohort 5, each 1.0.
  EXPECT_EQ(sums.size(), kMaxFeedEntries + 10);
  for (const auto& [key, units] : sums) EXPECT_EQ(units_to_double(units), 1.0) << hex(key);
  Result<VerifyReport> report = db->verify();
  ASSERT_OK(report);
  EXPECT_TRUE(report->ok()) << report->problems.front();
}

// Two trims racing never move the stored trim point backwards (issue 27,
// item 7): in each round one thread trims through 2r and another through
// 2r - 1 at once; the record on disk (what a read-only open reads) must then
// say 2r, and reads after it go on. Before the trims were serialized, the
// later write of "2r - 1" replaced "2r" after 2r's records were deleted,
// and a reopened Db read Corruption.
TEST(ChangeFeed, ConcurrentTrimsNeverMoveTheTrimPointBackwards) {
  TempDir dir;
  constexpr std::uint64_t kRounds = 40;
  auto db = open_db(dir.path(), feed_options(1));
  ASSERT_NE(db, nullptr);
  for (std::uint64_t i = 0; i < 2 * kRounds + 2; ++i) {
    ASSERT_OK(db->signal_with_context({1, i, 1.0}, {{4}}));
    ASSERT_OK(db->flush());
  }
  int backwards = 0;
  for (std::uint64_t r = 1; r <= kRounds; ++r) {
    std::atomic<int> ready{0};
    std::vector<std::thread> trimmers;
    Status results[2];
    for (int t = 0; t < 2; ++t) {
      trimmers.emplace_back([&, t] {
        ready.fetch_add(1);
        while (ready.load() < 2) {
        }
        results[t] = db->trim_changes(2 * r - static_cast<std::uint64_t>(t));
      });
    }
    for (auto& th : trimmers) th.join();
    ASSERT_OK(results[0]);
    ASSERT_OK(results[1]);
    // The trim record as stored (what the next open reads).
    std::string record;
    ASSERT_OK(Db::Impl::storage_for_testing(*db).get(Db::Impl::storage_for_testing(*db).state_meta(),
                                                     kFeedTrimmedKey, &record));
    ASSERT_EQ(record.size(), 16u);
    const std::uint64_t stored = get_u64_be(record.data());
    if (stored != 2 * r) {
      ++backwards;
      ADD_FAILURE() << "round " << r << ": the stored trim point is " << stored << " after trims through " << 2 * r
                    << " and " << 2 * r - 1;
    }
  }
  ASSERT_OK(db->close());
  // A reopen reads on from the stored trim point.
  db = open_db(dir.path(), feed_options(1));
  ASSERT_NE(db, nullptr);
  const std::uint64_t trimmed = db->stats().change_feed_trimmed_seq;
  Result<std::vector<ChangeBatch>> after = db->read_changes(trimmed, 1 << 20);
  EXPECT_OK(after.status());
  if (after.ok()) {
    EXPECT_EQ(after->size(), 2 * kRounds + 2 - trimmed);
  }
  std::cout << "[concurrent trims] " << backwards << " of " << kRounds << " rounds left the trim point behind\n";
}

TEST(ChangeFeed, ARepairEntersTheFeedAsTheDeltaThatMovesTheStoredSum) {
  TempDir dir;
  {
    auto db = open_db(dir.path(), feed_options(1));
    ASSERT_NE(db, nullptr);
    ASSERT_OK(db->signal_with_context({1, 2, 1.5}, {{4}}));
    ASSERT_OK(db->close());
  }
  {
    testing::RawDb raw(dir.path());
    std::string value;
    put_units(&value, Units{7'000'000'000});  // 7.0 instead of 1.5
    ASSERT_TRUE(raw.db(testing::RawDb::kAggregates)->Put({}, raw.cf(testing::RawDb::kAggregates), encode_aggregate_key(AggregateKind::Cohort, 4, 2),
                            value)
                    .ok());
  }
  auto db = open_db(dir.path(), feed_options(1));
  ASSERT_NE(db, nullptr);
  Result<RematerializeReport> r = db->rematerialize_shared_aggregates(true);
  ASSERT_OK(r);
  EXPECT_TRUE(r->repaired);
  EXPECT_EQ(*db->last_change_seq(), 2u);
  std::map<std::string, Units> sums;
  sum_feed(*db, &sums, 1);
  EXPECT_EQ(sums[encode_aggregate_key(AggregateKind::Cohort, 4, 2)], Units{-5'500'000'000});
  EXPECT_EQ(value_of(db->cohort_score(4, 2)), 1.5);
}

// Several shards, each a Db with its own users, feed one view; a reference
// Db receives everything. After random signals, leaves, rejoins and purges,
// with the shards' feeds applied in changing orders and some batches
// delivered twice, every shared score of the view equals the reference's,
// bit for bit.
TEST(ChangeFeed, AViewOfEveryShardEqualsOneDbThatReceivedEverythingBitForBit) {
  TempDir dir;
  constexpr std::uint64_t kShards = 3, kUsers = 60, kItems = 15, kCohorts = 6, kCommunities = 4;
  std::vector<std::unique_ptr<Db>> shards;
  for (std::uint64_t s = 0; s < kShards; ++s) {
    Options options = feed_options(s);
    options.aggregate_write_period = std::chrono::milliseconds(5);
    shards.push_back(open_db(dir.sub("shard" + std::to_string(s)), options));
    ASSERT_NE(shards.back(), nullptr);
  }
  auto reference = open_db(dir.sub("reference"));
  ASSERT_NE(reference, nullptr);
  auto shard_of = [&](std::uint64_t u) -> Db& { return *shards[u % kShards]; };
  for (std::uint64_t u = 0; u < kUsers; ++u) {
    for (Db* db : {&shard_of(u), reference.get()}) {
      ASSERT_OK(db->join_community(u, 100 + u % kCommunities));
      ASSERT_OK(db->join_community(u, 100 + (u + 1) % kCommunities));
    }
  }
  auto view = GlobalView::open(dir.sub("view"));
  ASSERT_OK(view);
  std::mt19937_64 rng(42);
  std::set<std::uint64_t> left;
  for (int step = 0; step < 4000; ++step) {
    const std::uint64_t u = rng() % kUsers;
    const std::uint64_t dice = rng() % 100;
    if (dice < 2 && left.count(u) == 0) {
      ASSERT_OK(shard_of(u).leave_community_layer(u));
      ASSERT_OK(reference->leave_community_layer(u));
      left.insert(u);
    } else if (dice < 3 && left.count(u) != 0) {
      ASSERT_OK(shard_of(u).purge_community_contributions(u));
      ASSERT_OK(reference->purge_community_contributions(u));
      if (rng() % 2 == 0) {
        ASSERT_OK(shard_of(u).rejoin_community_layer(u));
        ASSERT_OK(reference->rejoin_community_layer(u));
        left.erase(u);
      }
    } else {
      const Signal signal{u, rng() % kItems, static_cast<double>(rng() % 2001) / 3.0 - 300.0};
      SignalContext ctx;
      for (std::uint64_t c = 0; c < rng() % 3; ++c) ctx.cohort_ids.push_back(rng() % kCohorts);
      ASSERT_OK(shard_of(u).signal_with_context(signal, ctx));
      ASSERT_OK(reference->signal_with_context(signal, ctx));
    }
    if (step % 500 == 499) {
      // Follow the shards in a changing order, redelivering a batch now and then.
      for (std::uint64_t k = 0; k < kShards; ++k) {
        const std::uint64_t s = (k + static_cast<std::uint64_t>(step)) % kShards;
        follow(*shards[s], s, **view, 1 + rng() % 4096);
        Result<std::uint64_t> applied = (*view)->applied_seq(s);
        ASSERT_OK(applied);
        if (*applied > 0) {
          Result<std::vector<ChangeBatch>> again = shards[s]->read_changes(*applied - 1, 1);
          ASSERT_OK(again);
          Result<bool> r = (*view)->apply(again->front());
          ASSERT_OK(r);
          EXPECT_FALSE(*r) << "a redelivered batch was applied twice";
        }
      }
    }
  }
  for (auto& shard : shards) ASSERT_OK(shard->flush());
  for (std::uint64_t s = 0; s < kShards; ++s) follow(*shards[s], s, **view);
  std::size_t compared = 0, nonzero = 0;
  for (std::uint64_t item = 0; item < kItems; ++item) {
    for (std::uint64_t c = 0; c < kCohorts; ++c) {
      const double want = value_of(reference->cohort_score(c, item));
      EXPECT_EQ(bits(value_of((*view)->cohort_score(c, item))), bits(want)) << "cohort " << c << " item " << item;
      ++compared;
      nonzero += want != 0 ? 1u : 0u;
    }
    for (std::uint64_t m = 100; m < 100 + kCommunities; ++m) {
      const double want = value_of(reference->community_score(m, item));
      EXPECT_EQ(bits(value_of((*view)->community_score(m, item))), bits(want)) << "community " << m << " item " << item;
      ++compared;
      nonzero += want != 0 ? 1u : 0u;
    }
  }
  EXPECT_GT(nonzero, compared / 2);
}

}  // namespace
}  // namespace tidal
