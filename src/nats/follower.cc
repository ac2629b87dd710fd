// Follower: durable JetStream pull consumer -> GlobalView::apply -> ack, a
// refused batch parking its shard only (include/tidal/nats.h, docs/SCALE.md
// "Gaps and parked shards").
#include <algorithm>
#include <cctype>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "nats/backfill.h"
#include "nats/client.h"
#include "tidal/nats.h"

namespace tidal::nats {

using internal::Connection;
using Clock = std::chrono::steady_clock;

namespace {

// A fetch of the consumer waits at most this long for messages (less while
// a parked shard's read is due).
constexpr std::chrono::milliseconds kFetchWait{500};
constexpr std::chrono::milliseconds kMinFetchWait{10};
// The expiry of a no-wait fetch. nats-server 2.9.10 does not always answer
// a no-wait pull request at once when nothing is ready: now and then
// (seen in ~1 of 50 fetches with publishes in flight) it holds it until it
// expires, and with 500 ms every message in flight waited 500 ms more.
constexpr std::chrono::milliseconds kNoWaitExpiry{20};
// How often an idle Follower asks the server how many messages the
// consumer still holds back (lag_messages).
constexpr std::chrono::milliseconds kLagPollInterval{500};
// The server deletes a parked shard's reader (an ephemeral consumer) this
// long after its Follower stopped asking, e.g. died mid-repair.
constexpr std::chrono::seconds kReaderInactive{30};

// One fetched message, decoded once: its batch (or why it is not one) and
// its place in the stream.
struct Delivered {
  natsMsg* msg = nullptr;
  std::optional<ChangeBatch> batch;
  Status not_a_batch;
  std::uint64_t stream_seq = 0;
  std::uint64_t pending = 0;  // messages after it the consumer has not delivered yet
  bool done = false;          // acked or terminated
};

}  // namespace

class Follower::Impl {
 public:
  Impl(GlobalView* view, Config config, std::string consumer)
      : view_(view), config_(std::move(config)), consumer_(std::move(consumer)),
        filter_(config_.subject_prefix + ".*") {}

  // Starts the thread; InvalidArgument when the cluster refuses the config.
  Status start() {
    return worker_.start(config_, [this](internal::Backoff& backoff) { return session(backoff); },
                         [this](const Status& s) { internal::note_failure(stats_mu_, &stats_, s); });
  }

  Status stop() {
    worker_.stop();
    return worker_.last_error();
  }

  FollowerStats stats() const {
    FollowerStats out;
    std::map<std::uint64_t, FollowerShardStats> shards;
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      out = stats_;
      shards = shard_stats_;
    }
    Result<std::vector<ShardProgress>> applied = view_->applied_shards();
    if (applied.ok()) {
      out.applied = std::move(*applied);
      for (const ShardProgress& p : out.applied) {
        FollowerShardStats& s = shards[p.shard_id];
        s.shard_id = p.shard_id;
        s.applied_seq = p.applied_seq;
      }
    }
    for (auto& [id, s] : shards) {
      s.lag_batches = s.stream_seq > s.applied_seq ? s.stream_seq - s.applied_seq : 0;
      out.shards.push_back(std::move(s));
    }
    return out;
  }

 private:
  // What the thread knows of a parked shard's repair (thread-only).
  struct Repair {
    Repair(std::chrono::milliseconds min, std::chrono::milliseconds max) : backoff(min, max) {}
    bool parked = false;
    bool from_taken = false;         // a park: the next reader starts after the shard's Taken (see there)
    std::uint64_t read_from = 0;     // stream seq the reader starts at; 0 = the subject's first message
    bool rewind = true;              // (re)create the reader at read_from before the next read
    std::uint64_t first_refused = 0; // stream seq of the first message refused since the reader started; 0 none
    Clock::time_point next_read{};
    internal::Backoff backoff;
    std::unique_ptr<internal::Pull> reader;  // on the session's connection
  };

  // The batch of a shard this Follower last saw the view take (apply, or
  // skip as held), and the stream seq of its message (thread-only). A
  // Publisher appends a shard's batches in seq order, so every batch of
  // that incarnation after it is at a later stream seq: a park reads the
  // shard's subject from just after it while the view holds it. Not from
  // the refused message: a batch before that one can still be on its way
  // (delivered to a connection that died, or to another client, and
  // redelivered after the ack wait), and the parked shard's consumer
  // delivery of it is terminated.
  struct Taken {
    std::uint64_t seq = 0;
    std::string incarnation;
    std::uint64_t stream_seq = 0;
    std::uint64_t ordinal = 0;  // the incarnation's (0: unknown)
  };

  void note_taken(const ChangeBatch& b, std::uint64_t stream_seq) {
    auto [it, fresh] = taken_.try_emplace(b.shard_id);
    Taken& t = it->second;
    // A batch of an older incarnation than the one noted was skipped by the
    // view (superseded): the noted one still says where the view is.
    if (!fresh && b.incarnation != t.incarnation && b.incarnation_ordinal > 0 && b.incarnation_ordinal < t.ordinal) {
      return;
    }
    if (fresh || b.incarnation != t.incarnation || b.seq > t.seq) {
      t = {b.seq, b.incarnation, stream_seq, b.incarnation_ordinal};
    }
  }

  // Where a parked shard's reader starts: after its Taken when the view
  // holds that batch's incarnation through at least its seq; otherwise
  // (this Follower took none of the shard's batches, e.g. a Follower before
  // it terminated them) at the subject's first message.
  std::uint64_t park_read_from(std::uint64_t shard, std::uint64_t applied, const std::string& incarnation) const {
    auto it = taken_.find(shard);
    if (it == taken_.end() || it->second.incarnation != incarnation || it->second.seq > applied) return 0;
    return it->second.stream_seq + 1;
  }

  std::string where(const Connection& c) const {
    return "NATS server " + c.server() + ", stream " + config_.stream + ", consumer " + consumer_;
  }

  // A durable consumer created by an older Follower (the server's default
  // MaxAckPending) or with another ack_wait gets this config's: otherwise
  // the client refuses to bind to it and the view could never follow.
  // Anything else that differs (the filter, push delivery, the ack policy)
  // is left for subscribe() to report. NotFound when the consumer is
  // missing; otherwise sets *deliver and *start_seq to the existing
  // consumer's (binding asks for what it has).
  Status align_consumer(Connection& conn, jsDeliverPolicy* deliver, std::uint64_t* start_seq) {
    jsConsumerInfo* ci = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    natsStatus got = js_GetConsumerInfo(&ci, conn.js(), config_.stream.c_str(), consumer_.c_str(), nullptr, &jerr);
    if (got != NATS_OK) {
      if (got == NATS_NOT_FOUND && jerr != JSStreamNotFoundErr) return Status::NotFound("no consumer");
      return Status::OK();  // subscribe() reports why (a missing stream, the cluster)
    }
    std::unique_ptr<jsConsumerInfo, void (*)(jsConsumerInfo*)> guard(ci, jsConsumerInfo_Destroy);
    const jsConsumerConfig* c = ci->Config;
    if (c != nullptr) {
      *deliver = c->DeliverPolicy;
      *start_seq = c->OptStartSeq;
    }
    const std::int64_t ack_wait = static_cast<std::int64_t>(config_.ack_wait.count()) * 1'000'000;
    if (c == nullptr || c->FilterSubject == nullptr || filter_ != c->FilterSubject || c->DeliverSubject != nullptr ||
        c->AckPolicy != js_AckExplicit || (c->MaxAckPending == config_.max_ack_pending && c->AckWait == ack_wait)) {
      return Status::OK();
    }
    jsConsumerConfig cc = *c;  // points into *ci, alive until the update returns
    cc.MaxAckPending = config_.max_ack_pending;
    cc.AckWait = ack_wait;
    jsConsumerInfo* updated = nullptr;
    natsStatus ns = js_UpdateConsumer(&updated, conn.js(), config_.stream.c_str(), &cc, nullptr, &jerr);
    if (updated != nullptr) jsConsumerInfo_Destroy(updated);
    if (ns != NATS_OK) {
      return Status::IOError(where(conn) + ": cannot set max ack pending " + std::to_string(config_.max_ack_pending) +
                             " and ack wait " + std::to_string(config_.ack_wait.count()) +
                             " ms on the existing durable consumer (it has " + std::to_string(c->MaxAckPending) +
                             " and " + std::to_string(c->AckWait / 1'000'000) + " ms): " + internal::nats_error(ns));
    }
    return Status::OK();
  }

  // Binds the durable consumer, creating it when missing: for a view that
  // holds batches already (opened from a checkpoint) it then starts at the
  // first stream seq the view may need (internal::backfill_start), else at
  // the stream's first message. An existing consumer keeps its position.
  Status subscribe(Connection& conn, natsSubscription** sub) {
    Status last;
    for (int attempt = 0; attempt < 2; ++attempt) {
      jsDeliverPolicy deliver = js_DeliverAll;
      std::uint64_t start_seq = 0;
      Status s = align_consumer(conn, &deliver, &start_seq);
      const bool missing = s.code() == StatusCode::NotFound;
      if (!s.ok() && !missing) return s;
      if (missing) {
        Result<std::vector<ShardProgress>> applied = view_->applied_shards();
        if (!applied.ok()) return applied.status();
        Result<internal::BackfillStart> from = internal::backfill_start(conn, config_, *applied, where(conn));
        if (!from.ok()) return from.status();
        {
          std::lock_guard<std::mutex> lock(stats_mu_);
          stats_.backfill_probes += from->probes;
          stats_.fetched_messages += from->probes;
          stats_.fetched_bytes += from->probe_bytes;
          stats_.backfill_start_seq = from->stream_seq;
        }
        if (from->stream_seq > 0) {
          deliver = js_DeliverByStartSequence;
          start_seq = from->stream_seq;
        }
      }
      last = bind(conn, sub, deliver, start_seq);
      // A consumer another Follower of the same name created meanwhile
      // (with another start): bind to it as it is.
      if (last.ok() || !missing || deliver == js_DeliverAll) return last;
    }
    return last;
  }

  Status bind(Connection& conn, natsSubscription** sub, jsDeliverPolicy deliver, std::uint64_t start_seq) {
    jsSubOptions so;
    jsSubOptions_Init(&so);
    so.Stream = config_.stream.c_str();
    so.Config.Durable = consumer_.c_str();
    so.Config.DeliverPolicy = deliver;
    so.Config.OptStartSeq = start_seq;
    so.Config.AckPolicy = js_AckExplicit;
    so.Config.AckWait = static_cast<std::int64_t>(config_.ack_wait.count()) * 1'000'000;
    // A message is delivered again until it is acked (a Follower that died
    // holding it): a refused one is terminated instead, and read again from
    // the stream by its shard's repair, so nothing is redelivered forever.
    so.Config.MaxDeliver = -1;
    so.Config.MaxAckPending = config_.max_ack_pending;
    so.Config.FilterSubject = filter_.c_str();
    jsErrCode jerr = static_cast<jsErrCode>(0);
    natsStatus ns = js_PullSubscribe(sub, conn.js(), filter_.c_str(), consumer_.c_str(), nullptr, &so, &jerr);
    if (ns == NATS_OK) return Status::OK();
    *sub = nullptr;
    std::string why = internal::nats_error(ns);
    if (jerr == JSStreamNotFoundErr || ns == NATS_NOT_FOUND) {
      return Status::NotFound(where(conn) + ": the stream does not exist yet (a Publisher creates it): " + why);
    }
    if (why.find("filter") != std::string::npos || why.find("subject") != std::string::npos ||
        why.find("configuration") != std::string::npos || why.find("config") != std::string::npos) {
      return Status::InvalidArgument(where(conn) + ": the durable consumer exists with another configuration (not "
                                     "a pull consumer of " + filter_ + " with explicit acks and max ack pending " +
                                     std::to_string(config_.max_ack_pending) + "): " + why);
    }
    return Status::IOError(where(conn) + ": cannot bind the durable pull consumer: " + why);
  }

  Status session(internal::Backoff& backoff) {
    Connection conn;
    Status s = conn.connect(config_, "tidal-follower-" + consumer_, [this] { return worker_.stopping(); });
    if (!s.ok()) return s;
    internal::Worker::Attach attach(worker_, conn);
    if (!attach.ok()) return Status::OK();
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++stats_.connects;
    }
    natsSubscription* sub = nullptr;
    s = subscribe(conn, &sub);
    if (!s.ok()) return s;
    // The durable consumer stays on the server; the readers of parked
    // shards (ephemeral) go with the connection and start again next time.
    struct SubGuard {
      Impl* impl;
      natsSubscription* sub;
      ~SubGuard() {
        natsSubscription_Destroy(sub);
        for (auto& [id, r] : impl->repairs_) impl->drop_reader(r);
      }
    } guard{this, sub};
    internal::Pull pull(conn);  // read with our own pull requests (internal::Pull says why)
    s = pull.open(config_.stream, consumer_);
    if (!s.ok()) return s;
    s = park_shards_left_behind(conn);
    if (!s.ok()) return s;
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      stats_.connected = true;
    }
    worker_.ready();
    backoff.reset();

    while (!worker_.stopping()) {
      // Wait (at most kFetchWait, less when a parked shard's read is due)
      // for one message, then take whatever else the stream has ready, up
      // to fetch_batch, without waiting: a long poll for a whole batch
      // would hold the first message until the batch filled or the wait
      // ran out.
      internal::Fetched got;
      s = pull.fetch(1, config_.fetch_max_bytes, /*no_wait=*/false, fetch_wait(), &got);
      if (!s.ok()) return s;
      if (got.msgs.empty()) {
        if (!conn.connected()) return Status::IOError(where(conn) + ": connection lost");
        note_idle(conn);
      } else {
        if (config_.fetch_batch > 1) {
          (void)pull.fetch(config_.fetch_batch - 1, config_.fetch_max_bytes, /*no_wait=*/true, kNoWaitExpiry, &got);
        }
        if (worker_.stopping()) {
          // hand them back at once for the next Follower
          for (natsMsg* m : got.msgs) (void)internal::reply_to(conn, m, internal::kNak);
          break;
        }
        s = handle(conn, got.msgs);
        if (!s.ok()) return s;
      }
      for (auto& [id, r] : repairs_) {
        if (worker_.stopping()) break;
        if (!r.parked || Clock::now() < r.next_read) continue;
        s = repair(conn, id, r);
        if (!s.ok()) return s;
      }
    }
    return Status::OK();
  }

  // How long the next fetch of the consumer may wait: until the earliest
  // parked shard's read is due.
  std::chrono::milliseconds fetch_wait() const {
    std::chrono::milliseconds wait = kFetchWait;
    const auto now = Clock::now();
    for (const auto& [id, r] : repairs_) {
      if (!r.parked) continue;
      auto until = std::chrono::duration_cast<std::chrono::milliseconds>(r.next_read - now);
      wait = std::min(wait, std::max(until, kMinFetchWait));
    }
    return wait;
  }

  // Each message decoded once, its delivery noted.
  std::vector<Delivered> decode(natsMsg* const* msgs, std::size_t n, bool from_consumer) {
    const auto fetched_at = std::chrono::system_clock::now();
    std::vector<Delivered> out(n);
    note_fetched(msgs, n);
    for (std::size_t i = 0; i < n; ++i) {
      Delivered& d = out[i];
      d.msg = msgs[i];
      note_delivery(&d, fetched_at, from_consumer);
      Result<ChangeBatch> b = internal::batch_of(d.msg, config_);
      if (b.ok()) {
        d.batch = std::move(*b);
        note_seen(d.batch->shard_id, d.batch->seq);
      } else {
        d.not_a_batch = b.status();
      }
    }
    return out;
  }

  // Applies the fetched messages, in order, with as few view writes as the
  // refusals allow: a message of a parked shard is terminated (its shard's
  // repair reads it from the stream); the rest go to GlobalView::apply as
  // one span and are acked once that write returned. When the view refuses
  // a batch of shard s, s is parked: that message and the span's later ones
  // of s are terminated, and the other shards' are applied in the next
  // span. A message that is not a batch at all (no shard in its headers) is
  // terminated too: it belongs to no shard, so nothing waits for it. A
  // non-OK return is a failure of the view or the connection; the messages
  // not yet acked or terminated are then handed back.
  Status handle(Connection& conn, const std::vector<natsMsg*>& msgs) {
    std::vector<Delivered> items = decode(msgs.data(), msgs.size(), /*from_consumer=*/true);
    auto hand_back = [&] {
      for (Delivered& d : items) {
        if (!d.done) (void)internal::reply_to(conn, d.msg, internal::kNak);
      }
    };
    std::vector<std::size_t> todo;  // indexes of the batches to apply, in order
    for (std::size_t i = 0; i < items.size(); ++i) {
      Delivered& d = items[i];
      Status s;
      if (!d.batch) {
        note_refusal(conn, std::nullopt, Status(d.not_a_batch.code(), d.not_a_batch.message() +
                                                                          " (stream seq " + std::to_string(d.stream_seq) +
                                                                          "; terminated: it belongs to no shard)"));
        s = terminate(conn, &d);
      } else if (parked(d.batch->shard_id)) {
        s = terminate(conn, &d);
      } else {
        todo.push_back(i);
      }
      if (!s.ok()) {
        hand_back();
        return s;
      }
    }
    while (!todo.empty()) {
      std::vector<ChangeBatch> run;
      run.reserve(todo.size());
      for (std::size_t i : todo) run.push_back(std::move(*items[i].batch));
      const auto t0 = Clock::now();
      Result<ApplyOutcome> outcome = view_->apply(std::span<const ChangeBatch>(run));
      const auto micros = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
      if (!outcome.ok()) {
        hand_back();
        return Status(outcome.status().code(), where(conn) + ": GlobalView::apply of " + std::to_string(run.size()) +
                                                   " batches (shard " + std::to_string(run[0].shard_id) + " seq " +
                                                   std::to_string(run[0].seq) + " first): " +
                                                   outcome.status().message());
      }
      const std::size_t taken = outcome->taken;
      {
        std::lock_guard<std::mutex> lock(stats_mu_);
        ++stats_.view_writes;
        stats_.apply_micros += static_cast<std::uint64_t>(micros);
        stats_.applied_batches += outcome->applied;
        stats_.redeliveries_skipped += outcome->taken - outcome->applied - outcome->superseded;
        stats_.superseded_skipped += outcome->superseded;
      }
      // Applied (durable) or already applied: either way the stream may
      // forget them for this consumer. A lost ack only means a
      // redelivery, which the view skips.
      for (std::size_t j = 0; j < taken; ++j) {
        Delivered& d = items[todo[j]];
        note_taken(run[j], d.stream_seq);
        natsStatus ns = internal::reply_to(conn, d.msg, internal::kAck);
        if (ns != NATS_OK) {
          hand_back();
          return Status::IOError(where(conn) + ": ack failed: " + internal::nats_error(ns));
        }
        d.done = true;
      }
      if (taken == todo.size()) break;
      // run[taken] is refused: park its shard, terminate it and the later
      // messages of that shard; the others go to the next span.
      const std::uint64_t shard = run[taken].shard_id;
      park(conn, shard, outcome->refused);
      std::vector<std::size_t> rest;
      for (std::size_t j = taken; j < todo.size(); ++j) {
        Delivered& d = items[todo[j]];
        if (run[j].shard_id == shard) {
          if (Status s = terminate(conn, &d); !s.ok()) {
            hand_back();
            return s;
          }
        } else {
          d.batch = std::move(run[j]);
          rest.push_back(todo[j]);
        }
      }
      todo = std::move(rest);
    }
    return Status::OK();
  }

  // One read of a parked shard's subject from the stream (at most
  // fetch_batch messages, no waiting): applies what continues the view's
  // seq of the shard, and decides what next (include/tidal/nats.h):
  //  - something new applied after a refusal since the reader started: read
  //    again at once from the first refused message (the missing batch
  //    arrived after batches it precedes);
  //  - read to the stream's end, nothing refused since the reader started:
  //    the shard is whole, unpark it;
  //  - read to the end with refusals: follow the tail after a backoff;
  //  - nothing read: read again after a backoff;
  //  - more to read: read on at once.
  // Only a message with nothing pending after it shows the end: nats-server
  // 2.9.10 now and then holds a no-wait request until it expires
  // (kNoWaitExpiry), so an empty read may come from a reader that still
  // has the batches the view lacks.
  Status repair(Connection& conn, std::uint64_t shard, Repair& r) {
    const std::string subject = internal::subject_of(config_, shard);
    Result<std::vector<ShardProgress>> progress = view_->applied_shards();
    if (!progress.ok()) return progress.status();
    std::uint64_t applied = 0;
    std::string incarnation;  // of the shard's feed the view applied (empty: not known)
    std::uint64_t ordinal = 0;  // the highest incarnation ordinal the view applied for the shard (0: none known)
    for (const ShardProgress& p : *progress) {
      if (p.shard_id == shard) {
        applied = p.applied_seq;
        incarnation = p.incarnation;
        ordinal = p.incarnation_ordinal;
      }
    }
    if (r.from_taken) {
      r.read_from = park_read_from(shard, applied, incarnation);
      r.from_taken = false;
    }
    if (r.rewind || r.reader == nullptr) {
      drop_reader(r);
      jsConsumerConfig cc;
      jsConsumerConfig_Init(&cc);
      cc.DeliverPolicy = r.read_from == 0 ? js_DeliverAll : js_DeliverByStartSequence;
      cc.OptStartSeq = r.read_from;
      cc.AckPolicy = js_AckNone;
      cc.FilterSubject = subject.c_str();
      cc.InactiveThreshold = std::chrono::duration_cast<std::chrono::nanoseconds>(kReaderInactive).count();
      auto reader = std::make_unique<internal::Pull>(conn);
      if (Status s = reader->open_ephemeral(config_.stream, cc); !s.ok()) {
        return Status::IOError(where(conn) + ": cannot read parked shard " + std::to_string(shard) + " (" + subject +
                               " from stream seq " + std::to_string(r.read_from) + "): " + s.message());
      }
      r.reader = std::move(reader);
      r.rewind = false;
      r.first_refused = 0;
    }
    internal::Fetched got;
    if (Status s = r.reader->fetch(config_.fetch_batch, config_.fetch_max_bytes, /*no_wait=*/true, kNoWaitExpiry, &got);
        !s.ok()) {
      return Status::IOError(where(conn) + ": reading parked shard " + std::to_string(shard) + " (" + subject +
                             ") failed: " + s.message());
    }
    std::vector<Delivered> items = decode(got.msgs.data(), got.msgs.size(), /*from_consumer=*/false);
    const bool at_end = !items.empty() && items.back().pending == 0;
    // The run that continues the view's seq; a message past it is a gap for
    // now (judged without a view call), one before it already applied.
    std::vector<ChangeBatch> run;
    std::vector<std::uint64_t> run_stream_seqs;
    std::uint64_t next = applied + 1;
    std::optional<Status> refusal;
    std::uint64_t superseded = 0;  // batches of an older incarnation, skipped here as the view would
    auto refuse = [&](std::uint64_t stream_seq, Status why) {
      if (r.first_refused == 0 || stream_seq < r.first_refused) r.first_refused = stream_seq;
      if (!refusal) refusal = std::move(why);
    };
    for (Delivered& d : items) {
      if (!d.batch) {
        // not a batch of any shard: nothing waits for it (as on the consumer)
      } else if (!d.batch->incarnation.empty() && d.batch->incarnation != incarnation &&
                 d.batch->incarnation_ordinal > 0 && d.batch->incarnation_ordinal < ordinal) {
        // Of an incarnation older than one the view applied (published late,
        // after a newer one): the view skips it (GlobalView::apply), so
        // nothing waits for it.
        ++superseded;
      } else if (internal::is_reseed(*d.batch) && d.batch->incarnation != incarnation) {
        // A re-seed's first batch of another incarnation: at whatever seq it
        // replaces all the view holds of the shard (the gap with it), and
        // its incarnation's batches continue from it.
        next = d.batch->seq + 1;
        incarnation = d.batch->incarnation;
        ordinal = std::max(ordinal, d.batch->incarnation_ordinal);
        run_stream_seqs.push_back(d.stream_seq);
        run.push_back(std::move(*d.batch));
      } else if (d.batch->seq < next) {
        // applied already
      } else if (d.batch->seq == next) {
        run_stream_seqs.push_back(d.stream_seq);
        run.push_back(std::move(*d.batch));
        ++next;
      } else {
        refuse(d.stream_seq, Status::Corruption("gap: shard " + std::to_string(shard) + " has applied through " +
                                                std::to_string(next - 1) + "; batch seq " +
                                                std::to_string(d.batch->seq) + " (stream seq " +
                                                std::to_string(d.stream_seq) + ")"));
      }
    }
    if (superseded > 0) {
      std::lock_guard<std::mutex> lock(stats_mu_);
      stats_.superseded_skipped += superseded;
    }
    bool progressed = false;
    if (!run.empty()) {
      const auto t0 = Clock::now();
      Result<ApplyOutcome> outcome = view_->apply(std::span<const ChangeBatch>(run));
      const auto micros = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
      if (!outcome.ok()) {
        return Status(outcome.status().code(), where(conn) + ": GlobalView::apply of parked shard " +
                                                   std::to_string(shard) + " seq " + std::to_string(run[0].seq) +
                                                   " to " + std::to_string(run.back().seq) + ": " +
                                                   outcome.status().message());
      }
      progressed = outcome->applied > 0;
      for (std::size_t j = 0; j < outcome->taken; ++j) note_taken(run[j], run_stream_seqs[j]);
      if (outcome->taken < run.size()) refuse(run_stream_seqs[outcome->taken], outcome->refused);
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++stats_.view_writes;
      stats_.apply_micros += static_cast<std::uint64_t>(micros);
      stats_.applied_batches += outcome->applied;
      stats_.superseded_skipped += outcome->superseded;
    }
    if (refusal) note_refusal(conn, shard, *refusal, /*count=*/!progressed && at_end);
    const auto now = Clock::now();
    if (progressed) r.backoff.reset();
    if (progressed && r.first_refused != 0) {
      r.read_from = r.first_refused;
      r.rewind = true;
      r.next_read = now;
    } else if (at_end && r.first_refused == 0) {
      unpark(shard, r);
    } else if (at_end || items.empty()) {
      r.next_read = now + r.backoff.next();
    } else {
      r.next_read = now;
    }
    return Status::OK();
  }

  bool parked(std::uint64_t shard) const {
    auto it = repairs_.find(shard);
    return it != repairs_.end() && it->second.parked;
  }

  // A Follower that stopped or failed while a shard was parked had
  // terminated messages of that shard, which the durable consumer never
  // delivers again: the next Follower would leave the shard behind,
  // silently, until the shard published more. So at every start, each shard
  // the view holds whose last message in the stream is one the view lacks,
  // and which the consumer delivered already, is parked: its repair reads
  // the shard's subject (all of it, as a first park does). One request per
  // shard the view holds, and one for the consumer's position.
  Status park_shards_left_behind(Connection& conn) {
    Result<std::vector<ShardProgress>> applied = view_->applied_shards();
    if (!applied.ok()) return applied.status();
    if (applied->empty()) return Status::OK();
    std::uint64_t delivered = 0;
    {
      jsConsumerInfo* ci = nullptr;
      jsErrCode jerr = static_cast<jsErrCode>(0);
      natsStatus ns = js_GetConsumerInfo(&ci, conn.js(), config_.stream.c_str(), consumer_.c_str(), nullptr, &jerr);
      if (ns != NATS_OK) {
        return Status::IOError(where(conn) + ": cannot read the consumer's position: " + internal::nats_error(ns));
      }
      delivered = ci->Delivered.Stream;
      jsConsumerInfo_Destroy(ci);
    }
    for (const ShardProgress& p : *applied) {
      if (parked(p.shard_id)) continue;
      const std::string subject = config_.subject_prefix + "." + std::to_string(p.shard_id);
      natsMsg* m = nullptr;
      jsErrCode jerr = static_cast<jsErrCode>(0);
      natsStatus ns = js_GetLastMsg(&m, conn.js(), config_.stream.c_str(), subject.c_str(), nullptr, &jerr);
      if (ns == NATS_NOT_FOUND || jerr == JSNoMessageFoundErr) continue;
      if (ns != NATS_OK) {
        return Status::IOError(where(conn) + ": cannot read the last message on " + subject + ": " +
                               internal::nats_error(ns));
      }
      std::unique_ptr<natsMsg, void (*)(natsMsg*)> guard(m, natsMsg_Destroy);
      const std::uint64_t stream_seq = natsMsg_GetSequence(m);
      Result<ChangeBatch> last = internal::batch_of(m, config_);
      if (!last.ok() || stream_seq > delivered) continue;  // no batch; or the consumer delivers it
      // The last message of an older incarnation (published late) says
      // nothing of whether the view holds the newer one's: parked too; the
      // repair skips the older batches.
      if (last->incarnation == p.incarnation && last->seq <= p.applied_seq) continue;  // the view holds it
      park_quietly(p.shard_id);
    }
    return Status::OK();
  }

  void park(Connection& conn, std::uint64_t shard, const Status& why) {
    park_quietly(shard);
    note_refusal(conn, shard, why);
  }

  // park() without a refusal to report.
  void park_quietly(std::uint64_t shard) {
    Repair& r = repairs_.try_emplace(shard, config_.min_backoff, config_.max_backoff).first->second;
    if (!r.parked) {
      r.parked = true;
      r.from_taken = true;
      r.rewind = true;
      r.first_refused = 0;
      r.backoff.reset();
      r.next_read = Clock::now() + config_.min_backoff;
    }
    std::lock_guard<std::mutex> lock(stats_mu_);
    shard_stats_[shard].parked = true;
    stats_.stalled_on_gap = true;
  }

  void unpark(std::uint64_t shard, Repair& r) {
    drop_reader(r);
    r.parked = false;
    std::lock_guard<std::mutex> lock(stats_mu_);
    shard_stats_[shard].parked = false;
    stats_.stalled_on_gap = false;
    for (const auto& [id, other] : repairs_) stats_.stalled_on_gap = stats_.stalled_on_gap || other.parked;
  }

  void drop_reader(Repair& r) {
    if (r.reader == nullptr) return;
    r.reader.reset();  // deletes the ephemeral consumer
    r.rewind = true;
  }

  Status terminate(Connection& conn, Delivered* d) {
    natsStatus ns = internal::reply_to(conn, d->msg, internal::kTerm);
    if (ns != NATS_OK) return Status::IOError(where(conn) + ": terminating a refused message failed: " +
                                              internal::nats_error(ns));
    d->done = true;
    return Status::OK();
  }

  // A refusal, in the shard's stats (none for a message of no shard) and
  // the follower's; counted unless `count` is false (a repair read that
  // only finds the gap still open counts once per pass).
  void note_refusal(Connection& conn, std::optional<std::uint64_t> shard, const Status& why, bool count = true) {
    const std::string text =
        Status(why.code(), where(conn) + (shard ? ": not applied, the shard is parked until the missing batch is in "
                                                  "the stream: "
                                                : ": not applied: ") +
                               why.message())
            .to_string();
    std::lock_guard<std::mutex> lock(stats_mu_);
    if (count) ++stats_.gaps;
    stats_.last_error = text;
    if (shard) {
      FollowerShardStats& s = shard_stats_[*shard];
      s.shard_id = *shard;
      if (count) ++s.refused;
      s.last_error = text;
    }
  }

  // Messages read from the stream (the consumer's and parked shards' reads).
  void note_fetched(natsMsg* const* msgs, std::size_t n) {
    std::uint64_t bytes = 0;
    for (std::size_t i = 0; i < n; ++i) bytes += static_cast<std::uint64_t>(std::max(natsMsg_GetDataLength(msgs[i]), 0));
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.fetched_messages += n;
    stats_.fetched_bytes += bytes;
  }

  void note_seen(std::uint64_t shard, std::uint64_t seq) {
    std::lock_guard<std::mutex> lock(stats_mu_);
    FollowerShardStats& s = shard_stats_[shard];
    s.shard_id = shard;
    s.stream_seq = std::max(s.stream_seq, seq);
  }

  // Lag (messages still to come) and the time from the stream's store to
  // this fetch, from the message's JetStream metadata.
  void note_delivery(Delivered* d, std::chrono::system_clock::time_point fetched_at, bool from_consumer) {
    jsMsgMetaData* meta = nullptr;
    if (natsMsg_GetMetaData(&meta, d->msg) != NATS_OK) return;
    d->stream_seq = meta->Sequence.Stream;
    d->pending = meta->NumPending;
    if (from_consumer) {
      const std::int64_t now_ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(fetched_at.time_since_epoch()).count();
      std::lock_guard<std::mutex> lock(stats_mu_);
      stats_.lag_messages = meta->NumPending;
      if (meta->NumDelivered == 1 && now_ns > meta->Timestamp) {
        stats_.stored_to_fetched_micros += static_cast<std::uint64_t>((now_ns - meta->Timestamp) / 1000);
        ++stats_.first_deliveries;
      }
    }
    jsMsgMetaData_Destroy(meta);
  }

  // An empty fetch says nothing about the stream: the server may hold
  // messages back (MaxAckPending reached by another Follower of the same
  // consumer). Ask it how many the consumer has not delivered yet.
  void note_idle(Connection& conn) {
    const auto now = Clock::now();
    if (now - last_lag_poll_ < kLagPollInterval) return;
    last_lag_poll_ = now;
    jsConsumerInfo* ci = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    if (js_GetConsumerInfo(&ci, conn.js(), config_.stream.c_str(), consumer_.c_str(), nullptr, &jerr) != NATS_OK) {
      return;
    }
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      stats_.lag_messages = ci->NumPending;
    }
    jsConsumerInfo_Destroy(ci);
  }

  GlobalView* const view_;
  const Config config_;
  const std::string consumer_;
  const std::string filter_;
  std::map<std::uint64_t, Repair> repairs_;  // the follower thread's only
  std::map<std::uint64_t, Taken> taken_;     // the follower thread's only
  Clock::time_point last_lag_poll_{};        // the follower thread's only
  mutable std::mutex stats_mu_;
  FollowerStats stats_;                                     // guarded by stats_mu_
  std::map<std::uint64_t, FollowerShardStats> shard_stats_;  // guarded by stats_mu_
  internal::Worker worker_;  // last: destroyed (joined) first
};

Result<std::unique_ptr<Follower>> Follower::start(GlobalView* view, const Config& config,
                                                  const std::string& consumer_name) {
  if (view == nullptr) return Status::InvalidArgument("tidal::nats::Follower::start: view is null");
  if (view->read_only()) {
    return Status::InvalidArgument("tidal::nats::Follower::start: the view is open read-only, and a Follower "
                                   "applies batches to it; open it without GlobalViewOptions::read_only");
  }
  if (Status s = internal::check_config(config); !s.ok()) return s;
  bool bad_name = consumer_name.empty();
  for (char c : consumer_name) {
    if (c == '.' || c == '*' || c == '>' || std::isspace(static_cast<unsigned char>(c)) || c == '\0') bad_name = true;
  }
  if (bad_name) {
    return Status::InvalidArgument("tidal::nats::Follower::start: consumer name '" + consumer_name +
                                   "' is not a durable consumer name (non-empty, no '.', '*', '>' or whitespace)");
  }
  auto impl = std::make_unique<Impl>(view, config, consumer_name);
  if (Status s = impl->start(); !s.ok()) return s;
  return std::unique_ptr<Follower>(new Follower(std::move(impl)));
}

Follower::Follower(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Follower::~Follower() {
  if (impl_) (void)impl_->stop();
}
Status Follower::stop() { return impl_->stop(); }
FollowerStats Follower::stats() const { return impl_->stats(); }

}  // namespace tidal::nats
