// One entry of a Db's privacy journal (Options::journal): a leave, a rejoin
// or a purge's intent, numbered 1, 2, 3, ... per shard, written in the same
// atomic, durable step as the record it journals. The journal is the
// deletion log that a restore re-applies; its payload's bytes are in
// docs/FORMAT.md ("The privacy journal"), so a consumer in any language can
// decode it. It carries what a deletion log must and nothing more: the user,
// the kind and the boundary times; never a signal, an item, a cohort, a
// weight or a contribution (docs/CONTRACT.md J5).
#ifndef TIDAL_JOURNAL_ENTRY_H_
#define TIDAL_JOURNAL_ENTRY_H_

#include <cstdint>
#include <string>

namespace tidal {

struct JournalEntry {
  std::uint64_t shard_id = 0;
  std::uint64_t seq = 0;  // 1, 2, 3, ... per shard: never a gap, never reused
  std::string payload;    // one leave, rejoin or purge intent (docs/FORMAT.md); no weights
};

}  // namespace tidal

#endif  // TIDAL_JOURNAL_ENTRY_H_
