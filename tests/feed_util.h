// Helpers of the change feed tests: a Db's feed summed per cell, and a
// GlobalView fed every batch of a Db.
#ifndef TIDAL_TESTS_FEED_UTIL_H_
#define TIDAL_TESTS_FEED_UTIL_H_

#include <cstdint>
#include <map>
#include <string>

#include <gtest/gtest.h>

#include "storage/feed_format.h"
#include "storage/state_format.h"
#include "tidal/db.h"
#include "tidal/global_view.h"

namespace tidal::testing {

// Every batch of `db`'s feed after `after`, in order, checking the seqs run
// on without a gap; the deltas summed per encoded aggregate key into `sums`.
// Returns the last seq read.
inline std::uint64_t sum_feed(const Db& db, std::map<std::string, Units>* sums, std::uint64_t after = 0) {
  for (;;) {
    Result<std::vector<ChangeBatch>> batches = db.read_changes(after, 256 << 10);
    EXPECT_TRUE(batches.ok()) << batches.status().to_string();
    if (!batches.ok() || batches->empty()) return after;
    for (const ChangeBatch& b : *batches) {
      EXPECT_EQ(b.seq, after + 1) << "a gap in the feed";
      EXPECT_LE(b.payload.size(), kMaxChangePayloadBytes);
      std::string error;
      EXPECT_TRUE(decode_feed_payload(
          b.payload, [&](const FeedEntry& e) { (*sums)[encode_aggregate_key(e.kind, e.owner, e.item)] += e.delta; },
          &error))
          << "seq " << b.seq << ": " << error;
      after = b.seq;
    }
  }
}

// Applies to `view` every batch of `db`'s feed (shard `shard`) after the
// view's applied seq for it, reading up to `max_bytes` at a time. Returns
// the number applied; a batch the view refuses fails the test.
inline std::uint64_t follow(const Db& db, std::uint64_t shard, GlobalView& view, std::size_t max_bytes = 64 << 10) {
  std::uint64_t applied = 0;
  for (;;) {
    Result<std::uint64_t> after = view.applied_seq(shard);
    EXPECT_TRUE(after.ok()) << after.status().to_string();
    if (!after.ok()) return applied;
    Result<std::vector<ChangeBatch>> batches = db.read_changes(*after, max_bytes);
    EXPECT_TRUE(batches.ok()) << batches.status().to_string();
    if (!batches.ok() || batches->empty()) return applied;
    for (const ChangeBatch& b : *batches) {
      EXPECT_EQ(b.shard_id, shard);
      Result<bool> r = view.apply(b);
      EXPECT_TRUE(r.ok() && *r) << "shard " << shard << " seq " << b.seq << ": "
                                << (r.ok() ? std::string("not applied") : r.status().to_string());
      if (!r.ok() || !*r) return applied;
      ++applied;
    }
  }
}

}  // namespace tidal::testing

#endif  // TIDAL_TESTS_FEED_UTIL_H_
