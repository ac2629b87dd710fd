#include "nats/journal_stream.h"

#include <algorithm>
#include <chrono>
#include <string>
#include <utility>

namespace tidal::nats::internal {

namespace {

// The server deletes the reader's ephemeral consumer this long after the
// reader stopped asking (a recovery that died mid-read).
constexpr std::chrono::seconds kReaderInactive{30};

}  // namespace

Result<std::vector<JournalEntry>> read_journal_stream(Connection& conn, const Config& journal, std::uint64_t shard,
                                                      std::uint64_t after_seq) {
  const std::string subject = subject_of(journal, shard);
  const std::string where = "NATS server " + conn.server() + ", stream " + journal.stream + ", shard " +
                            std::to_string(shard) + " (" + subject + ")";
  std::vector<JournalEntry> out;
  // Where the subject ends now: what the read must reach.
  natsMsg* last = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus ns = js_GetLastMsg(&last, conn.js(), journal.stream.c_str(), subject.c_str(), nullptr, &jerr);
  // A recovery that reads nothing must not pass for a wrong stream name. A
  // stream that ends before the Db's journal (or holds none of the shard's
  // entries) is not an error: the backup may hold entries that were never
  // replicated (written, not yet acknowledged, when the machine was lost);
  // the restored Db keeps them and its JournalPublisher publishes them.
  if (jerr == JSStreamNotFoundErr) {
    return Status::NotFound(where + ": the stream does not exist (a wrong journal_stream, or a cluster that lost "
                                    "it): nothing can be read back");
  }
  if (ns == NATS_NOT_FOUND || jerr == JSNoMessageFoundErr) return out;
  if (ns != NATS_OK) return Status::IOError(where + ": cannot read the last entry: " + nats_error(ns));
  const std::uint64_t end_at = natsMsg_GetSequence(last);
  Result<LogRecord> end = record_of(last, journal, kJournalMarker);
  natsMsg_Destroy(last);
  if (!end.ok()) return Status::Corruption(where + ": " + end.status().message());
  if (end->seq <= after_seq) return out;

  jsConsumerConfig cc;
  jsConsumerConfig_Init(&cc);
  cc.DeliverPolicy = js_DeliverAll;
  cc.AckPolicy = js_AckNone;
  cc.FilterSubject = subject.c_str();
  cc.InactiveThreshold = std::chrono::duration_cast<std::chrono::nanoseconds>(kReaderInactive).count();
  Pull reader(conn);  // deletes its consumer when it goes
  if (Status s = reader.open_ephemeral(journal.stream, cc); !s.ok()) {
    return Status::IOError(where + ": cannot read the entries: " + s.message());
  }
  // The subject's messages still to deliver, as the consumer counts them:
  // each fetch asks for no more than remain, so it returns once they came (a
  // fetch for more waits until it expires). The count only sizes the
  // fetches: the read goes on to the last entry's stream sequence, one
  // message a fetch once the count is used up. (A read that stopped when
  // the count ran out reported entries missing that the stream held: seen
  // once, under load, right after a message was deleted from the stream.)
  Result<std::uint64_t> pending = reader.num_pending();
  if (!pending.ok()) return Status::IOError(where + ": " + pending.status().message());
  std::uint64_t remaining = *pending;
  std::uint64_t next = after_seq + 1;
  std::uint64_t read_to = 0;  // the stream sequence read through
  while (read_to < end_at) {
    Fetched got;
    const int batch = static_cast<int>(std::min<std::uint64_t>(
        static_cast<std::uint64_t>(std::max(journal.fetch_batch, 1)), std::max<std::uint64_t>(remaining, 1)));
    Status s = reader.fetch(batch, journal.fetch_max_bytes, /*no_wait=*/false, journal.request_timeout, &got);
    // None came within the request's time once the count was used up:
    // nothing more to come (the check below names what is missing).
    if (got.msgs.empty() && s.ok() && remaining == 0) break;
    if (got.msgs.empty()) {
      return Status::IOError(where + ": reading the entries after seq " + std::to_string(next - 1) + " (through seq " +
                             std::to_string(end->seq) + ") failed: " + (s.ok() ? std::string("timed out") : s.message()));
    }
    remaining -= std::min<std::uint64_t>(remaining, got.msgs.size());
    for (natsMsg* m : got.msgs) {
      jsMsgMetaData* meta = nullptr;
      if (natsMsg_GetMetaData(&meta, m) == NATS_OK) {
        read_to = std::max<std::uint64_t>(read_to, meta->Sequence.Stream);
        jsMsgMetaData_Destroy(meta);
      }
      Result<LogRecord> r = record_of(m, journal, kJournalMarker);
      if (!r.ok()) return Status::Corruption(where + ": " + r.status().message());
      if (r->shard_id != shard) {
        return Status::Corruption(where + ": an entry of shard " + std::to_string(r->shard_id) + " on this subject");
      }
      if (r->seq < next) continue;  // the Db has it already (or a republish of an earlier one)
      if (r->seq > next) {
        return Status::Corruption(where + ": entries " + std::to_string(next) + ".." + std::to_string(r->seq - 1) +
                                  " are missing (the stream holds seq " + std::to_string(r->seq) +
                                  " next; purged or aged out of the stream): the shard cannot be recovered from "
                                  "this stream without them");
      }
      out.push_back(JournalEntry{r->shard_id, r->seq, std::move(r->payload)});
      ++next;
    }
  }
  if (next <= end->seq) {
    return Status::Corruption(where + ": the stream's last entry is seq " + std::to_string(end->seq) +
                              " but the read ended at seq " + std::to_string(next - 1));
  }
  return out;
}

}  // namespace tidal::nats::internal
