// Reading a shard's privacy journal back from its JetStream stream (the
// input of recover_shard). Includes only <tidal/...> headers and the NATS C
// client.
#ifndef TIDAL_SRC_NATS_JOURNAL_STREAM_H_
#define TIDAL_SRC_NATS_JOURNAL_STREAM_H_

#include <cstdint>
#include <vector>

#include "nats/client.h"
#include "tidal/journal_entry.h"
#include "tidal/nats.h"
#include "tidal/status.h"

namespace tidal::nats::internal {

// The entries of `shard` with seq > after_seq that the journal's stream
// holds (`journal` is the config from journal_config: its stream and
// subject_prefix are the journal's), in seq order, read through an
// ephemeral pull consumer filtered on the shard's subject (DeliverAll, no
// acks) up to the subject's last message as it was when the read started.
// Empty when the stream holds nothing of the shard newer than after_seq
// (entries the Db holds and the stream lacks were never replicated; its
// publisher sends them). NotFound when the stream does not exist.
// Corruption naming the shard and the seqs when an entry is missing (the
// stream holds seq after_seq + 1 .. last with a hole, or starts past
// after_seq + 1: purged or aged out) or a message is not a journal entry of
// this shard; IOError when the cluster does not answer (naming the server,
// the stream and the subject).
Result<std::vector<JournalEntry>> read_journal_stream(Connection& conn, const Config& journal, std::uint64_t shard,
                                                      std::uint64_t after_seq);

}  // namespace tidal::nats::internal

#endif  // TIDAL_SRC_NATS_JOURNAL_STREAM_H_
