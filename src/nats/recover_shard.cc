// recover_shard: a Db restored from a backup gets the journal entries the
// stream holds after its position, replayed, then finishes its recovery
// (include/tidal/nats.h).

#include <algorithm>
#include <span>
#include <string>
#include <vector>

#include "nats/client.h"
#include "nats/journal_stream.h"
#include "tidal/nats.h"

namespace tidal::nats {

namespace {

// Entries handed to one replay_journal call.
constexpr std::size_t kReplayChunk = 1024;

}  // namespace

Status recover_shard(Db* db, const Config& config) {
  if (db == nullptr) return Status::InvalidArgument("tidal::nats::recover_shard: db is null");
  Result<Config> journal = internal::journal_config(config);
  if (!journal.ok()) return journal.status();
  Stats st = db->stats();
  if (!st.journal) {
    return Status::InvalidArgument("tidal::nats::recover_shard: the Db keeps no privacy journal (open it with "
                                   "Options::journal = true)");
  }
  if (!st.recovering) return Status::OK();  // nothing to replay, as finish_recovery()
  const std::uint64_t shard = st.journal_shard_id;
  const std::string who = "tidal::nats::recover_shard: shard " + std::to_string(shard) + ": ";
  Result<std::uint64_t> last = db->last_journal_seq();
  if (!last.ok()) return Status(last.status().code(), who + "last_journal_seq: " + last.status().message());
  // From the confirmed point, not the last seq: the entries the copy holds
  // but the stream never confirmed to it are compared with the stream's
  // (replay_journal refuses one that differs). A copy of a lineage that did
  // not go on (a backup taken after an entry that never reached the
  // stream, while the shard went on from an older copy) never serves
  // silently over the stream's entries of those seqs.
  const std::uint64_t from = std::min(st.journal_confirmed_seq, *last);
  internal::Connection conn;
  if (Status s = conn.connect(*journal, "tidal-recover-" + std::to_string(shard)); !s.ok()) {
    return Status(s.code(), who + s.message());
  }
  Result<std::vector<JournalEntry>> entries = internal::read_journal_stream(conn, *journal, shard, from);
  if (!entries.ok()) {
    return Status(entries.status().code(), who + "the Db's journal ends at seq " + std::to_string(*last) + ": " +
                                               entries.status().message());
  }
  const std::span<const JournalEntry> all(*entries);
  for (std::size_t i = 0; i < all.size(); i += kReplayChunk) {
    const std::span<const JournalEntry> chunk = all.subspan(i, std::min(kReplayChunk, all.size() - i));
    if (Status s = db->replay_journal(chunk); !s.ok()) {
      return Status(s.code(), who + "replay_journal of seqs " + std::to_string(chunk.front().seq) + ".." +
                                  std::to_string(chunk.back().seq) + ": " + s.message());
    }
  }
  if (Status s = db->finish_recovery(); !s.ok()) return Status(s.code(), who + "finish_recovery: " + s.message());
  return Status::OK();
}

}  // namespace tidal::nats
