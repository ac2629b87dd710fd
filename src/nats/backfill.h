// Cheap backfill: where a new durable consumer starts for a view that
// already holds batches (a view opened from a GlobalView::checkpoint), so
// that it reads only what the view lacks (include/tidal/nats.h, Follower;
// docs/SCALE.md, "A new view from a checkpoint").
#ifndef TIDAL_SRC_NATS_BACKFILL_H_
#define TIDAL_SRC_NATS_BACKFILL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "nats/client.h"
#include "tidal/global_view.h"
#include "tidal/status.h"

namespace tidal::nats::internal {

struct BackfillStart {
  // The stream sequence the consumer starts at (DeliverByStartSequence);
  // 0: from the stream's first message (DeliverAll).
  std::uint64_t stream_seq = 0;
  // Messages read from the stream to find it, and their payload bytes.
  std::uint64_t probes = 0;
  std::uint64_t probe_bytes = 0;
};

// The first stream sequence a view at `applied` may still need: the least,
// over every shard subject the stream holds, of
//  - a subject the view never applied: its first message;
//  - a subject whose last message is of the view's incarnation of the
//    shard: its first message with a seq above the view's applied seq (one
//    past the stream's last message when there is none);
//  - a subject whose last message is of another incarnation (re-seeded
//    since): the first message of that last incarnation, when it is a
//    re-seed's first batch (which replaces everything the view held of the
//    shard); otherwise the stream's first message.
// Found by binary search over stream sequences (each probe reads one
// message of the subject at or after a sequence: O(log n) a subject). When
// anything is uncertain (an unknown incarnation, a message that is not a
// batch, a subject list the server truncated) it starts earlier: at worst
// from the stream's first message, never past a batch the view needs.
// Batches before the start are ones the view holds (or a re-seed it will
// apply supersedes). `where` prefixes errors. IOError when a request fails;
// stream_seq 0 when the view applied nothing or the stream is missing or
// empty.
Result<BackfillStart> backfill_start(Connection& conn, const Config& config, const std::vector<ShardProgress>& applied,
                                     const std::string& where);

}  // namespace tidal::nats::internal

#endif  // TIDAL_SRC_NATS_BACKFILL_H_
