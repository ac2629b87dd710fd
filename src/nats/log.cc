#include "nats/log.h"

#include <utility>

#include "nats/client.h"
#include "tidal/change_batch.h"
#include "tidal/journal_entry.h"

namespace tidal::nats::internal {

namespace {

class ChangeFeedLog final : public Log {
 public:
  explicit ChangeFeedLog(Db* db) : db_(db) {}

  const char* name() const override { return "change feed"; }
  const char* unit() const override { return "batch"; }
  const char* done_word() const override { return "trimmed"; }
  const char* read_call() const override { return "read_changes"; }
  const char* done_call() const override { return "trim_changes"; }
  std::string marker() const override { return {}; }
  std::string msg_id(const LogRecord& r) const override {
    ChangeBatch b;
    b.shard_id = r.shard_id;
    b.seq = r.seq;
    b.incarnation = r.incarnation;
    return msg_id_of(b);
  }
  std::size_t max_payload_bytes() const override { return kMaxChangePayloadBytes; }
  std::string fence_advice() const override {
    return "If this Db is the shard's owner now, re-seed it (Db::reseed_change_feed, tidalctl reseed) and start the "
           "publisher again";
  }

  LogPosition position() const override {
    Stats st = db_->stats();
    LogPosition p;
    p.last_seq = st.change_feed_last_seq;
    p.done_seq = st.change_feed_trimmed_seq;
    p.pending_bytes = st.change_feed_pending_bytes;
    p.incarnation = std::move(st.change_feed_incarnation);
    return p;
  }
  Result<std::vector<LogRecord>> read(std::uint64_t after_seq, std::size_t max_bytes) const override {
    Result<std::vector<ChangeBatch>> batches = db_->read_changes(after_seq, max_bytes);
    if (!batches.ok()) return batches.status();
    std::vector<LogRecord> out;
    out.reserve(batches->size());
    for (ChangeBatch& b : *batches) {
      out.push_back(
          LogRecord{b.shard_id, b.seq, std::move(b.incarnation), std::move(b.payload), b.incarnation_ordinal});
    }
    return out;
  }
  Status done_through(std::uint64_t seq) override { return db_->trim_changes(seq); }
  bool is_reseed(const LogRecord& r) const override {
    ChangeBatch b;
    b.incarnation = r.incarnation;
    b.payload = r.payload;
    return internal::is_reseed(b);
  }

 private:
  Db* const db_;
};

class JournalLog final : public Log {
 public:
  explicit JournalLog(Db* db) : db_(db) {}

  const char* name() const override { return "privacy journal"; }
  const char* unit() const override { return "entry"; }
  const char* done_word() const override { return "confirmed"; }
  const char* read_call() const override { return "read_journal"; }
  const char* done_call() const override { return "confirm_journal"; }
  std::string marker() const override { return kJournalMarker; }
  std::string msg_id(const LogRecord& r) const override {
    return "j-" + std::to_string(r.shard_id) + "-" + std::to_string(r.seq);
  }
  // An entry is one leave, rejoin or purge intent: tens of bytes. The bound
  // is the feed's, so one stream setting serves both.
  std::size_t max_payload_bytes() const override { return kMaxChangePayloadBytes; }
  std::string fence_advice() const override {
    return "A Db restored from a backup replays the stream's entries first (tidal::nats::recover_shard); a twin "
           "with the same shard_id must be stopped";
  }

  LogPosition position() const override {
    Stats st = db_->stats();
    LogPosition p;
    p.last_seq = st.journal_last_seq;
    p.done_seq = st.journal_confirmed_seq;
    p.pending_bytes = st.journal_pending_bytes;
    return p;
  }
  Result<std::vector<LogRecord>> read(std::uint64_t after_seq, std::size_t max_bytes) const override {
    Result<std::vector<JournalEntry>> entries = db_->read_journal(after_seq, max_bytes);
    if (!entries.ok()) return entries.status();
    std::vector<LogRecord> out;
    out.reserve(entries->size());
    for (JournalEntry& e : *entries) out.push_back(LogRecord{e.shard_id, e.seq, {}, std::move(e.payload)});
    return out;
  }
  // A leave waiting for its confirmation (Options::journal_wait) is
  // published as soon as its entry is written, not at the next poll.
  bool wait_for_record(std::uint64_t after_seq, std::chrono::milliseconds wait) const override {
    return db_->wait_journal(after_seq, wait).ok();
  }
  Status done_through(std::uint64_t seq) override { return db_->confirm_journal(seq); }
  bool is_reseed(const LogRecord&) const override { return false; }

 private:
  Db* const db_;
};

}  // namespace

std::unique_ptr<Log> change_feed_log(Db* db) { return std::make_unique<ChangeFeedLog>(db); }
std::unique_ptr<Log> journal_log(Db* db) { return std::make_unique<JournalLog>(db); }

}  // namespace tidal::nats::internal
