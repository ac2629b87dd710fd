// The two logs of a Db that a publisher carries to JetStream, behind one
// small interface: the change feed (read_changes / trim_changes, with the
// feed's incarnation and its re-seeds) and the privacy journal
// (read_journal / confirm_journal). The publishing engine
// (nats/log_publisher.h) knows only this interface, so the fencing, the
// duplicate check and the resume point are one piece of code for both.
// Includes only <tidal/...> headers.
#ifndef TIDAL_SRC_NATS_LOG_H_
#define TIDAL_SRC_NATS_LOG_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tidal/db.h"
#include "tidal/status.h"

namespace tidal::nats::internal {

// One numbered record of a log: a ChangeBatch or a JournalEntry.
struct LogRecord {
  std::uint64_t shard_id = 0;
  std::uint64_t seq = 0;
  std::string incarnation;  // the feed's incarnation; empty for the journal
  std::string payload;
  std::uint64_t incarnation_ordinal = 0;  // ChangeBatch::incarnation_ordinal; 0 for the journal
};

// Where a log stands, from Db::stats().
struct LogPosition {
  std::uint64_t last_seq = 0;       // the last record written
  std::uint64_t done_seq = 0;       // trimmed (feed) or confirmed (journal) through this seq
  std::uint64_t pending_bytes = 0;  // payload bytes written and not yet done
  std::string incarnation;          // the feed's; empty for the journal
};

// A Db's log, as the publisher sees it. Not thread-safe beyond the Db's own
// guarantees; one publisher thread calls it.
class Log {
 public:
  virtual ~Log() = default;

  // Words for the errors: the log ("change feed", "privacy journal"), one
  // record ("batch", "entry"), what done means ("trimmed", "confirmed") and
  // the Db calls that read and finish records.
  virtual const char* name() const = 0;
  virtual const char* unit() const = 0;
  virtual const char* done_word() const = 0;
  virtual const char* read_call() const = 0;
  virtual const char* done_call() const = 0;
  // The value of the Tidal-Log header on this log's messages; empty: none
  // (the change feed, whose messages predate the header).
  virtual std::string marker() const = 0;
  // The JetStream message id of a record.
  virtual std::string msg_id(const LogRecord& r) const = 0;
  // The largest payload of one record (a stream's max_msg_size must allow it).
  virtual std::size_t max_payload_bytes() const = 0;
  // What an operator does when the stream and the Db disagree (a restore or
  // a twin): appended to the fence's error.
  virtual std::string fence_advice() const = 0;

  virtual LogPosition position() const = 0;
  virtual Result<std::vector<LogRecord>> read(std::uint64_t after_seq, std::size_t max_bytes) const = 0;
  // When the log can tell its publisher of a new record: waits until a
  // record past `after_seq` exists, for at most `wait`, and returns true;
  // false when it cannot (the publisher then sleeps Config::poll_interval).
  virtual bool wait_for_record(std::uint64_t /*after_seq*/, std::chrono::milliseconds /*wait*/) const {
    return false;
  }
  // The stream acknowledged every record through `seq`: trim or confirm.
  virtual Status done_through(std::uint64_t seq) = 0;
  // Whether `r` may be published over the stream's records of another
  // incarnation (the first batch of a feed's re-seed). Never for the journal.
  virtual bool is_reseed(const LogRecord& r) const = 0;
};

// The Db's change feed (Options::change_feed); null Db not allowed.
std::unique_ptr<Log> change_feed_log(Db* db);
// The Db's privacy journal (Options::journal).
std::unique_ptr<Log> journal_log(Db* db);

}  // namespace tidal::nats::internal

#endif  // TIDAL_SRC_NATS_LOG_H_
