// One batch of a Db's change feed: exact deltas of shared (cohort and
// community) aggregates, in the order the Db stored them. A Db with
// Options::change_feed writes them (Db::read_changes); a GlobalView sums
// them over every shard (<tidal/global_view.h>). The payload's bytes are
// documented in docs/FORMAT.md ("The change feed"), so a consumer in any
// language can decode it; it never holds a user id or a personal-layer cell.
#ifndef TIDAL_CHANGE_BATCH_H_
#define TIDAL_CHANGE_BATCH_H_

#include <cstddef>
#include <cstdint>
#include <string>

namespace tidal {

struct ChangeBatch {
  std::uint64_t shard_id = 0;
  std::uint64_t seq = 0;  // 1, 2, 3, ... per shard: never a gap, never reused
  std::string payload;    // at most kMaxChangePayloadBytes
  // The feed's incarnation: 32 lowercase hex digits (128 random bits), fixed
  // when the Db's feed was created; a Db re-created for a shard has another.
  // A GlobalView refuses a batch of another incarnation than the one it
  // applied for the shard. Empty: unknown (a batch of an older writer).
  std::string incarnation;
  // The incarnation's place in the shard's order: each new incarnation of a
  // feed (a re-seed, a restore's finish_recovery) gets one above every
  // earlier one, wall-clock ns at its making or the previous one + 1,
  // whichever is larger. A GlobalView skips every batch of an incarnation
  // older than one it applied for the shard, also one it never saw
  // (docs/CONTRACT.md, V10). 0: not known (a batch of an older writer,
  // judged by its incarnation alone).
  std::uint64_t incarnation_ordinal = 0;
};

// The largest payload of one batch: a larger write becomes several
// consecutive batches, written in the same atomic step.
inline constexpr std::size_t kMaxChangePayloadBytes = 512 << 10;

}  // namespace tidal

#endif  // TIDAL_CHANGE_BATCH_H_
