// LogPublisher: a Db's log (the change feed or the privacy journal) ->
// JetStream -> trim_changes / confirm_journal (include/tidal/nats.h).
#include "nats/log_publisher.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "nats/client.h"
#include "tidal/nats.h"

namespace tidal::nats::internal {

class LogPublisher::Engine {
 public:
  Engine(std::unique_ptr<Log> log, Config config, std::uint64_t shard)
      : log_(std::move(log)), config_(std::move(config)), shard_(shard), subject_(subject_of(config_, shard)) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.shard_id = shard;
  }

  // Starts the thread; InvalidArgument when the cluster refuses the config.
  Status start() {
    return worker_.start(config_, [this](Backoff& backoff) { return session(backoff); },
                         [this](const Status& s) { note_failure(stats_mu_, &stats_, s); });
  }

  // The error that stopped the publisher for good (a fence), else what the
  // thread was retrying when it stopped, else OK.
  Status stop() {
    worker_.stop();
    std::lock_guard<std::mutex> lock(stats_mu_);
    return halt_status_.ok() ? worker_.last_error() : halt_status_;
  }

  PublisherStats stats() const {
    std::lock_guard<std::mutex> lock(stats_mu_);
    return stats_;
  }

 private:
  // Where the stream and the Db stand: what names them in every error.
  std::string where(const Connection& c) const {
    return "NATS server " + c.server() + ", stream " + config_.stream + ", shard " + std::to_string(shard_);
  }

  // One connection's life: connect, check the stream, find where to resume,
  // then publish until an error (returned) or stop (OK).
  Status session(Backoff& backoff) {
    Connection conn;
    const std::string marker = log_->marker();
    Status s = conn.connect(config_, "tidal-" + (marker.empty() ? std::string() : marker + "-") + "publisher-" +
                                         std::to_string(shard_),
                            [this] { return worker_.stopping(); });
    if (!s.ok()) return s;
    Worker::Attach attach(worker_, conn);
    if (!attach.ok()) return Status::OK();  // stopping
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++stats_.connects;
    }
    s = ensure_stream(conn);
    if (!s.ok()) return s;
    Result<Position> resume = resume_point(conn);
    if (!resume.ok()) return resume.status();
    std::uint64_t published = resume->seq;
    std::uint64_t subject_seq = resume->subject_seq;
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      stats_.connected = true;
      stats_.published_seq = published;
    }
    worker_.ready();
    backoff.reset();

    while (!worker_.stopping()) {
      if (!conn.connected()) return Status::IOError(where(conn) + ": connection lost");
      if (log_->position().last_seq <= published) {
        update_lag(published);
        if (!idle_wait(published)) break;
        continue;
      }
      Result<std::vector<LogRecord>> batches = log_->read(published, config_.read_max_bytes);
      if (!batches.ok()) return db_error(conn, log_->read_call(), batches.status());
      if (batches->empty()) {
        update_lag(published);
        if (!idle_wait(published)) break;
        continue;
      }
      for (const LogRecord& b : *batches) {
        if (worker_.stopping()) break;
        if (b.seq != published + 1) {
          return Status::Corruption(where(conn) + ": the Db's " + log_->name() + " skips from seq " +
                                    std::to_string(published) + " to " + std::to_string(b.seq));
        }
        s = publish(conn, b, &subject_seq);
        if (!s.ok()) {
          // What was acknowledged; a failure is retried next session. After
          // a fence nothing is trimmed (confirmed): the next start checks it again.
          if (!worker_.halted()) (void)trim(published);
          return s;
        }
        published = b.seq;
        std::lock_guard<std::mutex> lock(stats_mu_);
        stats_.published_seq = published;
        ++stats_.published_batches;
      }
      s = trim(published);
      if (!s.ok()) return db_error(conn, log_->done_call(), s);
      update_lag(published);
    }
    return Status::OK();
  }

  // With nothing to publish: waits for the log's next record where the log
  // can tell (the journal), at most poll_interval, else sleeps
  // poll_interval. False when stopping.
  bool idle_wait(std::uint64_t published) {
    if (log_->wait_for_record(published, config_.poll_interval)) return !worker_.stopping();
    return worker_.wait_for(config_.poll_interval);
  }

  // A failed Db call, with the call's name and where.
  Status db_error(const Connection& conn, const char* call, const Status& s) const {
    return Status(s.code(), where(conn) + ": " + call + ": " + s.message());
  }

  // The stream acknowledged everything through `through`: trim the feed or
  // confirm the journal.
  Status trim(std::uint64_t through) {
    if (through == 0) return Status::OK();
    return log_->done_through(through);
  }

  void update_lag(std::uint64_t published) {
    LogPosition pos = log_->position();
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.last_change_seq = pos.last_seq;
    stats_.lag_batches = pos.last_seq > published ? pos.last_seq - published : 0;
    stats_.lag_bytes = pos.pending_bytes;
  }

  // Creates the stream when missing; checks it when present.
  Status ensure_stream(Connection& conn) {
    jsStreamInfo* si = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    natsStatus ns = js_GetStreamInfo(&si, conn.js(), config_.stream.c_str(), nullptr, &jerr);
    if (ns == NATS_NOT_FOUND || jerr == JSStreamNotFoundErr) {
      const std::string wildcard = config_.subject_prefix + ".*";
      const char* subjects[] = {wildcard.c_str()};
      jsStreamConfig sc;
      jsStreamConfig_Init(&sc);
      sc.Name = config_.stream.c_str();
      sc.Subjects = subjects;
      sc.SubjectsLen = 1;
      sc.Storage = js_FileStorage;
      sc.Retention = js_LimitsPolicy;
      sc.Replicas = config_.replicas;
      // Never drop a stored batch to make room: a full stream refuses the
      // publish (the Db keeps the batch); no per-subject limit.
      sc.Discard = js_DiscardNew;
      sc.MaxMsgs = -1;
      sc.MaxMsgsPerSubject = -1;
      sc.MaxBytes = config_.stream_max_bytes > 0 ? config_.stream_max_bytes : -1;
      sc.MaxAge = std::chrono::duration_cast<std::chrono::nanoseconds>(config_.stream_max_age).count();
      sc.Duplicates = std::chrono::duration_cast<std::chrono::nanoseconds>(config_.duplicate_window).count();
      jerr = static_cast<jsErrCode>(0);
      ns = js_AddStream(&si, conn.js(), &sc, nullptr, &jerr);
      if (si != nullptr) jsStreamInfo_Destroy(si);
      if (ns == NATS_OK) return Status::OK();
      std::string why = nats_error(ns);
      if (jerr == 10065 /* subjects overlap */) {
        return Status::InvalidArgument(where(conn) + ": cannot create the stream: its subjects " + wildcard +
                                       " overlap another stream's: " + why);
      }
      if (jerr == 10074 /* replicas > 1 not supported in non-clustered mode */) {
        return Status::InvalidArgument(where(conn) + ": cannot create the stream with " +
                                       std::to_string(config_.replicas) +
                                       " replicas (Config::replicas) on a server that is not clustered: " + why);
      }
      return Status::IOError(where(conn) + ": cannot create the stream (" + std::to_string(config_.replicas) +
                             " replicas, file storage, subjects " + wildcard + "): " + why);
    }
    if (ns != NATS_OK) {
      if (si != nullptr) jsStreamInfo_Destroy(si);
      return Status::IOError(where(conn) + ": stream lookup failed: " + nats_error(ns));
    }
    Status s = check_stream(conn, *si->Config);
    jsStreamInfo_Destroy(si);
    return s;
  }

  // InvalidArgument for an existing stream that does not carry this
  // shard's subject or could drop a batch it acknowledged (which the Db
  // then trims): every setting that could, named, with what to do.
  Status check_stream(const Connection& conn, const jsStreamConfig& sc) const {
    const std::string star = config_.subject_prefix + ".*";
    const std::string gt = config_.subject_prefix + ".>";
    bool covered = false;
    std::string listed;
    for (int i = 0; i < sc.SubjectsLen; ++i) {
      const std::string sub = sc.Subjects[i] ? sc.Subjects[i] : "";
      listed += (i ? ", " : "") + sub;
      if (sub == star || sub == gt || sub == ">" || sub == subject_) covered = true;
    }
    if (!covered) {
      return Status::InvalidArgument(where(conn) + ": the existing stream's subjects [" + listed +
                                     "] do not include " + star + " (Config::subject_prefix '" +
                                     config_.subject_prefix + "'): use another stream name or prefix");
    }
    auto refuse = [&](const std::string& why) {
      return Status::InvalidArgument(where(conn) + ": the existing stream " + why +
                                     ": tidal refuses a stream that could drop " + (log_->unit()[0] == 'e' ? "an " : "a ") +
                                     log_->unit() + " it acknowledged (the Db's " + log_->done_call() +
                                     " lets it go); fix the stream's settings or use another stream");
    };
    // "a batch" / "an entry", "batches" / "entries".
    const std::string unit = log_->unit();
    const std::string a_unit = (unit[0] == 'e' ? "an " : "a ") + unit;
    const std::string units = unit == "entry" ? "entries" : unit + "es";
    if (sc.Storage != js_FileStorage) {
      return refuse("has memory storage (a server restart loses its messages)");
    }
    if (sc.Retention == js_WorkQueuePolicy) {
      return refuse("has work-queue retention (one reader's ack removes " + a_unit + " every other reader still needs)");
    }
    if (sc.Retention == js_InterestPolicy) {
      return refuse("has interest retention (a " + std::string(log_->unit()) +
                    " no consumer is interested in yet is removed at once)");
    }
    if (sc.Discard == js_DiscardOld) {
      std::string limits;
      auto add = [&](const char* name, std::int64_t v) {
        if (v > 0) limits += std::string(limits.empty() ? "" : ", ") + name + " " + std::to_string(v);
      };
      add("max_msgs", sc.MaxMsgs);
      add("max_bytes", sc.MaxBytes);
      add("max_age (ns)", sc.MaxAge);
      add("max_msgs_per_subject", sc.MaxMsgsPerSubject);
      if (!limits.empty()) {
        return refuse("has discard policy old with " + limits +
                      " (at the limit it deletes the oldest " + units + ", unread by a reader behind)");
      }
    }
    if (sc.MaxMsgsPerSubject > 0 && !sc.DiscardNewPerSubject) {
      return refuse("has max_msgs_per_subject " + std::to_string(sc.MaxMsgsPerSubject) +
                    " (it deletes a shard's oldest " + units + ")");
    }
    const std::int64_t allowed_age =
        std::chrono::duration_cast<std::chrono::nanoseconds>(config_.stream_max_age).count();
    if (sc.MaxAge > 0 && (allowed_age == 0 || sc.MaxAge < allowed_age)) {
      return refuse("has max_age " + std::to_string(sc.MaxAge / 1000000000) + " s (Config::stream_max_age is " +
                    std::to_string(config_.stream_max_age.count()) +
                    " s: " + a_unit + " older than the stream's max_age is deleted, read or not)");
    }
    if (sc.Replicas < config_.replicas) {
      return refuse("has " + std::to_string(sc.Replicas) + " replicas, fewer than Config::replicas (" +
                    std::to_string(config_.replicas) + ")");
    }
    if (sc.MaxMsgSize > 0 && sc.MaxMsgSize < static_cast<std::int32_t>(log_->max_payload_bytes() + 4096)) {
      return Status::InvalidArgument(where(conn) + ": the existing stream's max_msg_size " +
                                     std::to_string(sc.MaxMsgSize) + " is below one " + log_->unit() + " (" +
                                     std::to_string(log_->max_payload_bytes() >> 10) + " KiB)");
    }
    return Status::OK();
  }

  // Stops the publisher for good with `s` (a fence: the stream and the Db
  // disagree about this shard, and no retry can fix that).
  Status halt(Status s) {
    worker_.halt();
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.halted = true;
    halt_status_ = s;
    return s;
  }

  // What the Db and the stream say a stored message is: shard, seq, size.
  static std::string describe(const LogRecord& b) {
    return "shard " + std::to_string(b.shard_id) + " seq " + std::to_string(b.seq) + ", " +
           std::to_string(b.payload.size()) + " bytes";
  }

  // Where to resume: the last seq of this shard the stream holds (never
  // below what the Db trimmed or confirmed), and the stream sequence of the
  // subject's last message (0 if none), which the next publish expects.
  struct Position {
    std::uint64_t seq = 0;
    std::uint64_t subject_seq = 0;
  };

  // ", nothing trimmed" / ", nothing confirmed": how every fence ends.
  std::string nothing_done() const { return std::string("publisher stopped, nothing ") + log_->done_word(); }

  // Reads the last message of this shard's subject and checks it against
  // the Db, on every connection: a stream that holds a seq the Db never
  // wrote, or a record that differs from the Db's record of that seq, stops
  // the publisher (another Db with this shard_id, or a Db restored from an
  // older copy, wrote it) and nothing is trimmed (confirmed). Otherwise the
  // Db is trimmed (confirmed) through the stream's last seq.
  Result<Position> resume_point(Connection& conn) {
    const LogPosition pos = log_->position();
    const std::string unit = log_->unit();
    Position at;
    std::optional<LogRecord> stored;
    natsMsg* last = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    natsStatus ns = js_GetLastMsg(&last, conn.js(), config_.stream.c_str(), subject_.c_str(), nullptr, &jerr);
    if (ns == NATS_OK) {
      at.subject_seq = natsMsg_GetSequence(last);
      Result<LogRecord> b = record_of(last, config_, log_->marker());
      natsMsg_Destroy(last);
      if (!b.ok()) {
        return halt(Status::Corruption(where(conn) + ": the last message on " + subject_ + " (stream seq " +
                                       std::to_string(at.subject_seq) + "): " + b.status().message() +
                                       ": something other than this Db publishes on its subject; " + nothing_done()));
      }
      stored = std::move(*b);
    } else if (ns != NATS_NOT_FOUND && jerr != JSNoMessageFoundErr) {
      return Status::IOError(where(conn) + ": cannot read the last message on " + subject_ + ": " +
                             nats_error(ns));
    }
    const std::uint64_t in_stream = stored ? stored->seq : 0;
    if (stored && stored->incarnation != pos.incarnation) {
      // The stream's last batch of this shard is of another feed. Publishing
      // over it is right only for a re-seed of this Db (its first batch, not
      // yet trimmed, is next): the snapshot replaces the old incarnation in
      // every view. Anything else is a twin or a restore: stop. (The journal
      // has no incarnation and no re-seed.)
      Result<std::vector<LogRecord>> next = log_->read(pos.done_seq, 1);
      if (!next.ok()) return db_error(conn, log_->read_call(), next.status());
      if (!next->empty() && log_->is_reseed(next->front())) {
        const std::uint64_t mine = next->front().incarnation_ordinal, theirs = stored->incarnation_ordinal;
        if (theirs > 0 && mine <= theirs) {
          // Every view would skip the re-seed as older than the stream's
          // incarnation (the ordinals are wall-clock ns: this host's clock
          // is behind the one that made the stream's).
          return halt(Status::Corruption(
              where(conn) + ": the re-seed's incarnation " + next->front().incarnation + " has ordinal " +
              std::to_string(mine) + ", not above ordinal " + std::to_string(theirs) + " of incarnation " +
              stored->incarnation + " that the stream's last batch of this shard (seq " + std::to_string(in_stream) +
              ", stream seq " + std::to_string(at.subject_seq) + ") is of: every view would skip it as older; " +
              nothing_done() + ". Re-seed again (Db::reseed_change_feed, tidalctl reseed) once this host's clock "
              "(ns since the epoch) is past " + std::to_string(theirs) + ", and start the publisher again"));
        }
        at.seq = pos.done_seq;
        std::lock_guard<std::mutex> lock(stats_mu_);
        ++stats_.reseeds;
        return at;
      }
    }
    if (in_stream > pos.last_seq) {
      return halt(Status::InvalidArgument(
          where(conn) + ": the stream holds this shard up to seq " + std::to_string(in_stream) + " (stream seq " +
          std::to_string(at.subject_seq) + ") but the Db's " + log_->name() + " ends at seq " +
          std::to_string(pos.last_seq) +
          " (another Db with the same shard_id, or a Db restored from an older copy): its new " + unit +
          " would reuse seqs the stream holds; " + nothing_done() + ". " + log_->fence_advice()));
    }
    if (stored && !stored->incarnation.empty() && !pos.incarnation.empty() &&
        stored->incarnation != pos.incarnation) {
      return halt(Status::Corruption(
          where(conn) + ": the stream's last batch of this shard (seq " + std::to_string(in_stream) + ", stream seq " +
          std::to_string(at.subject_seq) + ") is of incarnation " + stored->incarnation +
          ", the Db's feed is incarnation " + pos.incarnation + " (seq " + std::to_string(pos.last_seq) +
          "): another Db published this shard (a Db re-created or restored for it, or a twin); views would refuse "
          "or skip this Db's batches: " + nothing_done() + ". " + log_->fence_advice()));
    }
    if (in_stream > pos.done_seq) {
      // The Db still holds the record the stream has last: they must be the same.
      Result<std::vector<LogRecord>> mine = log_->read(in_stream - 1, 1);
      if (!mine.ok()) return db_error(conn, log_->read_call(), mine.status());
      if (mine->empty() || mine->front().seq != in_stream || mine->front().payload != stored->payload) {
        return halt(Status::Corruption(
            where(conn) + ": the stream's " + unit + " of seq " + std::to_string(in_stream) + " (stream seq " +
            std::to_string(at.subject_seq) + ", " + describe(*stored) + ") differs from the Db's (" +
            (mine->empty() ? std::string("none") : describe(mine->front())) +
            "): another Db with the same shard_id, or a Db restored from an older copy, published this shard; "
            "going on would lose the Db's " + log_->name() + " " + std::to_string(in_stream) + ".." +
            std::to_string(pos.last_seq) + ": " + nothing_done() + ". " + log_->fence_advice()));
      }
      Status s = log_->done_through(in_stream);
      if (!s.ok()) return db_error(conn, log_->done_call(), s);
    } else if (in_stream < pos.done_seq && pos.done_seq > 0) {
      // Not fatal: the records after in_stream were acknowledged once; a
      // reader that did not read them will report the gap.
      std::lock_guard<std::mutex> lock(stats_mu_);
      stats_.last_error = where(conn) + ": the stream holds this shard only up to seq " + std::to_string(in_stream) +
                          " but the Db " + log_->done_word() + " through " + std::to_string(pos.done_seq) +
                          " (the stream was purged, recreated or aged them out)";
    }
    at.seq = std::max(in_stream, pos.done_seq);
    return at;
  }

  // Publishes `b` fenced: JetStream stores it only if the subject's last
  // message is still *subject_seq (the one this publisher knows of), with
  // the log's message id. On success *subject_seq is the stream sequence of
  // `b`'s message.
  Status publish(Connection& conn, const LogRecord& b, std::uint64_t* subject_seq) {
    natsMsg* msg = nullptr;
    natsStatus ns = natsMsg_Create(&msg, subject_.c_str(), nullptr, b.payload.data(), static_cast<int>(b.payload.size()));
    const std::string shard = std::to_string(b.shard_id);
    const std::string seq = std::to_string(b.seq);
    const std::string id = log_->msg_id(b);
    const std::string marker = log_->marker();
    if (ns == NATS_OK) ns = natsMsgHeader_Set(msg, kShardHeader, shard.c_str());
    if (ns == NATS_OK) ns = natsMsgHeader_Set(msg, kSeqHeader, seq.c_str());
    if (ns == NATS_OK && !b.incarnation.empty()) {
      ns = natsMsgHeader_Set(msg, kIncarnationHeader, b.incarnation.c_str());
    }
    const std::string ordinal = std::to_string(b.incarnation_ordinal);
    if (ns == NATS_OK && !b.incarnation.empty() && b.incarnation_ordinal > 0) {
      ns = natsMsgHeader_Set(msg, kIncarnationOrdinalHeader, ordinal.c_str());
    }
    if (ns == NATS_OK && !marker.empty()) ns = natsMsgHeader_Set(msg, kLogHeader, marker.c_str());
    jsPubOptions po;
    jsPubOptions_Init(&po);
    po.MsgId = id.c_str();
    po.ExpectStream = config_.stream.c_str();
    if (*subject_seq == 0) {
      po.ExpectNoMessage = true;
    } else {
      po.ExpectLastSubjectSeq = *subject_seq;
    }
    po.MaxWait = config_.request_timeout.count();
    jsPubAck* ack = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    if (ns == NATS_OK) ns = js_PublishMsg(&ack, conn.js(), msg, &po, &jerr);
    std::string why = ns == NATS_OK ? std::string() : nats_error(ns);
    if (msg != nullptr) natsMsg_Destroy(msg);
    if (ns != NATS_OK) {
      if (ack != nullptr) jsPubAck_Destroy(ack);
      if (jerr == JSStreamWrongLastSequenceErr) return after_wrong_last(conn, b, subject_seq);
      return Status::IOError(where(conn) + ": publish of seq " + seq + " (" + std::to_string(b.payload.size()) +
                             " bytes) not acknowledged: " + why);
    }
    const bool dup = ack->Duplicate;
    const std::uint64_t stored_at = ack->Sequence;
    jsPubAck_Destroy(ack);
    if (dup) {
      {
        std::lock_guard<std::mutex> lock(stats_mu_);
        ++stats_.duplicates;
      }
      // The id was stored before: by this Db (a publish whose ack was lost),
      // or by another writer with other content.
      Status s = check_duplicate(conn, b, stored_at);
      if (!s.ok()) return s;
    }
    *subject_seq = stored_at;
    return Status::OK();
  }

  // The stored message at stream sequence `at`, or an IOError (retried).
  Result<LogRecord> stored_record(Connection& conn, std::uint64_t at, std::string* subject) {
    natsMsg* m = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    natsStatus ns = at == 0 ? NATS_NOT_FOUND : js_GetMsg(&m, conn.js(), config_.stream.c_str(), at, nullptr, &jerr);
    if (ns != NATS_OK) {
      return Status::IOError(where(conn) + ": cannot read stream seq " + std::to_string(at) + ": " + nats_error(ns));
    }
    const char* subj = natsMsg_GetSubject(m);
    *subject = subj != nullptr ? subj : "";
    Result<LogRecord> b = record_of(m, config_, log_->marker());
    natsMsg_Destroy(m);
    return b;
  }

  static bool same(const LogRecord& a, const LogRecord& b) {
    // The ordinal is not compared: the incarnation names it, and a batch
    // published before its feed had one is stored without it.
    return a.shard_id == b.shard_id && a.seq == b.seq && a.incarnation == b.incarnation && a.payload == b.payload;
  }

  // A Duplicate ack naming stream sequence `at`: OK when the message stored
  // there is `b` (same subject, shard, seq, incarnation, payload and log);
  // otherwise another writer used this message id: Corruption, the
  // publisher stops, nothing is trimmed (confirmed).
  Status check_duplicate(Connection& conn, const LogRecord& b, std::uint64_t at) {
    std::string subject;
    Result<LogRecord> stored = stored_record(conn, at, &subject);
    if (!stored.ok() && stored.status().code() == StatusCode::IOError) return stored.status();
    if (stored.ok() && subject == subject_ && same(*stored, b)) return Status::OK();
    return halt(Status::Corruption(
        where(conn) + ": the publish of seq " + std::to_string(b.seq) + " (id " + log_->msg_id(b) + ", " +
        describe(b) + ") was acknowledged as a duplicate of stream seq " + std::to_string(at) + ", which holds " +
        (stored.ok() ? describe(*stored) + " on " + subject : stored.status().message()) +
        ": another writer published this id with other content; " + nothing_done()));
  }

  // The stream refused `b` because the subject's last message is not
  // *subject_seq. If that last message is `b` itself (a publish whose ack
  // was lost), it is acknowledged; if it is older, retried;
  // otherwise another writer published on this shard's subject: the
  // publisher stops, nothing trimmed (confirmed).
  Status after_wrong_last(Connection& conn, const LogRecord& b, std::uint64_t* subject_seq) {
    natsMsg* m = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    natsStatus ns = js_GetLastMsg(&m, conn.js(), config_.stream.c_str(), subject_.c_str(), nullptr, &jerr);
    if (ns != NATS_OK) {
      return Status::IOError(where(conn) + ": publish of seq " + std::to_string(b.seq) +
                             " refused (the subject's last message is not stream seq " +
                             std::to_string(*subject_seq) + ") and the last message cannot be read: " +
                             nats_error(ns));
    }
    const std::uint64_t last_at = natsMsg_GetSequence(m);
    Result<LogRecord> last = record_of(m, config_, log_->marker());
    natsMsg_Destroy(m);
    if (last.ok() && same(*last, b) && last_at > *subject_seq) {
      *subject_seq = last_at;
      return Status::OK();
    }
    if (last_at < *subject_seq) {
      return Status::IOError(where(conn) + ": the subject's last message is stream seq " + std::to_string(last_at) +
                             ", older than stream seq " + std::to_string(*subject_seq) +
                             " this publisher wrote (a new stream leader still catching up, or messages deleted from the stream): "
                             "retried");
    }
    return halt(Status::Corruption(
        where(conn) + ": the publish of seq " + std::to_string(b.seq) +
        " was refused: the subject's last message is stream seq " + std::to_string(last_at) + " (" +
        (last.ok() ? describe(*last) : last.status().message()) + "), not stream seq " +
        std::to_string(*subject_seq) +
        " this publisher wrote last: another writer (a Db with the same shard_id, or a Db restored from an older "
        "copy) publishes this shard; " + nothing_done()));
  }

  const std::unique_ptr<Log> log_;
  const Config config_;
  const std::uint64_t shard_;
  const std::string subject_;
  mutable std::mutex stats_mu_;
  PublisherStats stats_;
  Status halt_status_;  // the fence that stopped the publisher, OK if none; guarded by stats_mu_
  Worker worker_;  // last: destroyed (joined) first
};

LogPublisher::LogPublisher(std::unique_ptr<Log> log, Config config, std::uint64_t shard)
    : engine_(std::make_unique<Engine>(std::move(log), std::move(config), shard)) {}
LogPublisher::~LogPublisher() { (void)engine_->stop(); }
Status LogPublisher::start() { return engine_->start(); }
Status LogPublisher::stop() { return engine_->stop(); }
PublisherStats LogPublisher::stats() const { return engine_->stats(); }

}  // namespace tidal::nats::internal
