// tidal::nats: a Db's change feed carried over NATS JetStream to every
// GlobalView (library target tidal::nats; links Debian's libnats, the NATS C
// client; the core tidal::tidal has no NATS dependency).
//
//   shard Db --read_changes--> Publisher --JetStream stream--> Follower --apply--> GlobalView
//            <--trim_changes--  (after the stream's ack)        (ack after apply returned)
//
// One stream (Config::stream) holds every shard's batches, one message per
// ChangeBatch on subject "<subject_prefix>.<shard_id>". The message's data is
// the batch's payload, unchanged (docs/FORMAT.md, "The change feed"); its
// headers carry the shard, the seq and the feed's incarnation
// (ChangeBatch::incarnation), and its JetStream message id is
// "<shard>-<seq>" (docs/SCALE.md, "Messages"). Publishing is at least once
// (JetStream de-duplicates within the stream's duplicate window) and fenced:
// each publish expects the shard subject's last message to be the one this
// Publisher knows of, so a second writer for a shard (a twin Db with the
// same shard_id, a Db restored from an older copy) stops with an error
// instead of interleaving. Applying is exactly once (the view skips a seq it
// has applied), a gap is reported and never skipped. The guarantees and
// their tests: docs/CONTRACT.md ("NATS JetStream").
//
//   shard Db --read_journal--> JournalPublisher --journal stream
//            <--confirm_journal-- (after the stream's ack)
//
// A Db's privacy journal (Options::journal: leaves, rejoins, purge intents)
// goes the same way, with the same engine, to a stream of its own
// (Config::journal_stream, subject "<journal_subject_prefix>.<shard_id>"):
// JournalPublisher below; docs/SCALE.md, "The privacy journal's stream".
//
// Thread safety: start, stop and stats may be called from any thread; each
// Publisher and Follower runs one background thread of its own.
#ifndef TIDAL_NATS_H_
#define TIDAL_NATS_H_

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tidal/db.h"
#include "tidal/global_view.h"
#include "tidal/metrics.h"
#include "tidal/status.h"

namespace tidal::nats {

struct Config {
  // Comma-separated URLs of the cluster's servers (any one is enough to
  // connect; the client learns the others). Default: nats://127.0.0.1:4222.
  std::string servers = "nats://127.0.0.1:4222";
  // The JetStream stream holding every shard's batches. Default: TIDAL_CHANGES.
  std::string stream = "TIDAL_CHANGES";
  // Shard s publishes on <subject_prefix>.<s>; the stream's subjects must
  // include <subject_prefix>.* . Default: tidal.changes.
  std::string subject_prefix = "tidal.changes";
  // The privacy journal's stream (JournalPublisher, recover_shard), created
  // and checked as the change feed's is, and its subject prefix: shard s's
  // entries go on <journal_subject_prefix>.<s>. Both must differ from the
  // change feed's. Default: TIDAL_JOURNAL, tidal.journal.
  std::string journal_stream = "TIDAL_JOURNAL";
  std::string journal_subject_prefix = "tidal.journal";
  // Replicas of the stream when the Publisher creates it (1 to 5), and the
  // fewest an existing stream may have: a Publisher refuses a stream with
  // fewer. 3 survive the loss of a server (a cluster of fewer than 3 servers
  // needs replicas set to its size). Default: 3.
  int replicas = 3;

  // -- Authentication and TLS (optional; docs/SCALE.md, "Authentication and
  // TLS"). Without them anyone who can publish on <subject_prefix>.* can
  // inject deltas into every view. --
  // User and password (the server's `authorization { user, password }`);
  // both or neither. Default: none.
  std::string user;
  std::string password;
  // A token (`authorization { token }`), instead of user and password.
  // Default: none.
  std::string token;
  // A NATS credentials file (JWT and NKey seed, decentralized
  // authentication), instead of the two above. Default: none.
  std::string creds_file;
  // TLS: on when `tls` is true, when any file below is set, or for tls://
  // URLs. tls_ca_file: the PEM CA certificates the servers' certificates
  // must chain to (empty: the client's default); tls_cert_file and
  // tls_key_file: a client certificate for servers that verify clients
  // (both or neither). The server's certificate must name the host of the
  // URL. Default: off, none.
  bool tls = false;
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;

  // -- Beyond the pinned fields --
  // The stream the Publisher creates: limits retention, file storage,
  // discard-new (a full stream refuses a publish, the Publisher retries and
  // the Db keeps the batch; it never drops a stored one), no per-subject
  // limit, and these limits (docs/SCALE.md, "Stream settings"):
  // JetStream's de-duplication window for message ids (at most
  // stream_max_age when that is set). Default: 2 min.
  std::chrono::milliseconds duplicate_window{120000};
  // Bytes the stream may hold; 0 = unlimited. A full stream refuses new
  // batches until older ones expire or an operator raises the limit.
  // Default: 0.
  std::int64_t stream_max_bytes = 0;
  // Age after which the stream deletes a batch (whatever the discard
  // policy: a view further behind than this finds a gap, reported, and
  // joins from a newer checkpoint); 0 = never. An existing stream with a
  // max_age below this (or any max_age when this is 0) is refused.
  // Default: 0.
  std::chrono::seconds stream_max_age{0};
  // Longest wait for one request to the cluster (a publish's ack, a stream
  // lookup, a connect attempt over every server, whatever they do: silent,
  // frozen, greeting and then silent); also the bound of stop().
  // Default: 5 s.
  std::chrono::milliseconds request_timeout{5000};
  // Retry delays after a failure: doubling from min_backoff up to
  // max_backoff. Default: 50 ms to 2 s.
  std::chrono::milliseconds min_backoff{50};
  std::chrono::milliseconds max_backoff{2000};
  // Publisher: how often it looks for new batches when the feed is drained.
  // A JournalPublisher instead waits on the Db (Db::wait_journal) and wakes
  // at a new entry; this is then the longest it waits at once (so also how
  // long stop() may wait for it). Default: 5 ms.
  std::chrono::milliseconds poll_interval{5};
  // Publisher: bound on the payload bytes read from the feed at once (at
  // least one batch is read). Default: 4 MiB.
  std::size_t read_max_bytes = 4 << 20;
  // Follower: messages (and bytes) asked for in one fetch: the bound on
  // what a Follower holds in memory. Default: 64 messages, 8 MiB.
  int fetch_batch = 64;
  std::int64_t fetch_max_bytes = 8 << 20;
  // Follower: how long the cluster waits for an ack before it delivers a
  // message again (after a Follower died holding it). Set on the durable
  // consumer when the Follower creates it, and on an existing one that has
  // another (with max_ack_pending). Default: 30 s.
  std::chrono::milliseconds ack_wait{30000};
  // Follower: the most messages the durable consumer hands out unacked
  // (MaxAckPending, set when the Follower creates it or binds to one that
  // has another, e.g. the server's default 1,000 an older tidal left;
  // at least fetch_batch).
  // The Follower acks or terminates every message of a fetch before the
  // next, so it holds at most fetch_batch; the bound matters for a Follower
  // that died holding messages. Default: 1024.
  int max_ack_pending = 1024;
};

// A publisher's progress, for a host to export.
struct PublisherStats {
  std::uint64_t shard_id = 0;
  std::uint64_t published_seq = 0;      // the last seq the stream acknowledged (the feed is trimmed through it)
  std::uint64_t last_change_seq = 0;    // the Db's last seq, when last read
  std::uint64_t lag_batches = 0;        // last_change_seq - published_seq
  std::uint64_t lag_bytes = 0;          // payload bytes not yet trimmed (Stats::change_feed_pending_bytes)
  std::uint64_t published_batches = 0;  // acknowledged publishes since start, duplicates included
  std::uint64_t duplicates = 0;         // acks that JetStream flagged as duplicates (a batch sent again)
  std::uint64_t errors = 0;             // failed attempts (connect, stream check, publish, trim), each retried
  std::uint64_t connects = 0;           // connections made
  std::uint64_t reseeds = 0;            // re-seeds published over another incarnation (Db::reseed_change_feed)
  bool connected = false;               // connected now, with the stream checked
  bool halted = false;                  // stopped for good by a fence (last_error and stop() say why)
  std::string last_error;               // the most recent failure, naming the server and the stream; empty if none
};

// One shard as a follower sees it.
struct FollowerShardStats {
  std::uint64_t shard_id = 0;
  std::uint64_t applied_seq = 0;   // the view's applied seq of the shard
  std::uint64_t stream_seq = 0;    // the highest seq of the shard this Follower has seen in the stream
  std::uint64_t lag_batches = 0;   // stream_seq - applied_seq (0 when not ahead)
  bool parked = false;             // a refused batch parked the shard: its batches wait, the others flow
  std::uint64_t refused = 0;       // messages of the shard refused since start (a gap, another incarnation, undecodable)
  std::string last_error;          // the shard's most recent refusal (naming server, stream, consumer, shard, seqs);
                                   // kept after the shard caught up; empty if none
};

// A follower's progress, for a host to export.
struct FollowerStats {
  std::vector<ShardProgress> applied;    // the view's applied seq of every shard it has seen
  std::vector<FollowerShardStats> shards;  // per shard: applied, seen, lag, parked, refusals (by shard_id)
  std::uint64_t applied_batches = 0;     // messages applied since start
  std::uint64_t redeliveries_skipped = 0;  // messages the view had applied already (acked, nothing changed)
  std::uint64_t superseded_skipped = 0;  // messages of an incarnation older than one the view applied for their
                                         //   shard (ApplyOutcome::superseded; acked, nothing changed)
  std::uint64_t gaps = 0;                // messages refused (a gap, another incarnation, undecodable), every shard
  std::uint64_t errors = 0;              // failed attempts (connect, consumer, fetch, apply), each retried
  std::uint64_t lag_messages = 0;        // stream messages the consumer has not delivered yet (asked of the
                                         // server after an empty fetch, so messages held back count)
  std::uint64_t connects = 0;            // connections made
  bool connected = false;                // connected now, with the consumer bound
  bool stalled_on_gap = false;           // some shard is parked (shards[].parked says which)
  std::string last_error;                // the most recent failure or refusal, any shard; empty if none
  // Where a follower's time goes (cumulative since start):
  std::uint64_t view_writes = 0;         // GlobalView::apply calls: one fsynced write each, for a run of messages
  std::uint64_t apply_micros = 0;        // time spent in those calls
  std::uint64_t first_deliveries = 0;    // messages delivered to this consumer for the first time
  std::uint64_t stored_to_fetched_micros = 0;  // summed over those: from stored in the stream to fetched here
  // What this Follower read from the stream (cumulative since start): every
  // message fetched, by the consumer, by parked shards' reads and by the
  // backfill probes below, and their payload bytes. A view opened from a
  // checkpoint reads about what the checkpoint lacks.
  std::uint64_t fetched_messages = 0;
  std::uint64_t fetched_bytes = 0;
  // Set when this Follower created the durable consumer: the stream seq it
  // starts at (0: the stream's first message: the view held nothing, or
  // nothing could be skipped), and the messages read to find it.
  std::uint64_t backfill_start_seq = 0;
  std::uint64_t backfill_probes = 0;
};

// The stats above in the Prometheus text format (tidal/metrics.h), `labels`
// on every sample: tidal_publisher_* (shard="<id>" on each) and
// tidal_follower_* (tidal_follower_shard_* per shard="<id>": applied seq,
// seen seq, lag, parked, refusals). What to
// alert on: docs/SCALE.md, "What to monitor". InvalidArgument for a bad label.
Result<std::string> prometheus_text(const PublisherStats& stats, const MetricLabels& labels = {});
Result<std::string> prometheus_text(const FollowerStats& stats, const MetricLabels& labels = {});

// Background thread: Db change feed -> JetStream, then trim_changes after the
// stream's ack. Batches are published one at a time in seq order; a batch is
// trimmed only once the stream acknowledged it. After any failure (no
// server, lost connection, leader change, timeout) it waits (bounded
// backoff) and resumes from the first batch not acknowledged; the Db keeps
// every batch meanwhile; at Options::change_feed_max_bytes its signals get Busy
// (nothing accepted is lost, purges still go in: docs/CONTRACT.md F4).
//
// Fencing (docs/SCALE.md, "Fencing"): on every connection the Publisher
// reads the last message of the shard's subject; each publish carries
// Nats-Expected-Last-Subject-Sequence (that message's stream sequence, then
// each ack's) and the message id. It stops for good (stats().halted,
// last_error, stop() returns the error), never trimming, when the stream
// and the Db disagree about the shard:
//  - the stream holds a seq of this shard the Db never wrote
//    (InvalidArgument), or its batch of the last seq differs from the Db's
//    (Corruption): a Db restored from an older copy, or a twin;
//  - a publish is refused because another writer published on the subject
//    since (Corruption), unless the subject's last message is this very
//    batch (a publish whose ack was lost);
//  - a Duplicate ack names a stored message that is not this batch (same
//    subject, shard, seq, incarnation and payload): Corruption;
//  - the stream's last batch of the shard is of another incarnation than
//    the Db's feed (a Db re-created for the shard): Corruption.
class Publisher {
 public:
  // Checks the config and the Db, then starts the thread. InvalidArgument
  // for a null Db, a Db without a change feed, empty servers/stream/prefix,
  // replicas outside 1..5, a non-positive timeout or bound. It makes one
  // first attempt before returning (at most request_timeout). A missing
  // stream is created (limits retention, file storage, discard-new,
  // Config::replicas, duplicate_window, stream_max_bytes, stream_max_age,
  // no per-subject limit). An existing stream is checked on every
  // connection: when its subjects do not include <subject_prefix>.*, or it
  // could drop a batch it acknowledged (memory storage, interest or
  // work-queue retention, discard-old with any of max_msgs, max_bytes,
  // max_age, max_msgs_per_subject, a max_msgs_per_subject, a max_age the
  // config does not allow, fewer replicas than Config::replicas), or holds
  // more of this shard than the Db ever wrote, it returns InvalidArgument
  // naming the server, the stream and the setting; a fence found at that
  // first attempt (below) is returned too. An unreachable cluster is not an
  // error: the thread keeps trying (stats().last_error).
  // `db` must outlive the Publisher.
  static Result<std::unique_ptr<Publisher>> start(Db* db, const Config& config);

  // Stops the thread: returns within about request_timeout (at once when
  // idle; a publish in flight is abandoned by closing the connection, and
  // is sent again by the next Publisher, which JetStream de-duplicates).
  // Idempotent. Returns the error that halted the publisher (a fence, see
  // above); else the thread's last error when it stopped while failing (no
  // connection, a stream check or publish that failed: what
  // stats().last_error said, not yet overcome); OK when it was connected
  // and working. The Db is left open.
  Status stop();

  PublisherStats stats() const;

  ~Publisher();  // stop()
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  class Impl;

 private:
  explicit Publisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Background thread: the Db's privacy journal (Options::journal) ->
// JetStream -> confirm_journal after the stream's ack, so that leaves,
// rejoins and purges waiting for replication (Options::journal_wait) return
// OK. The same engine as Publisher's, over the journal instead of the
// change feed: its own stream (Config::journal_stream, created and checked
// exactly as Publisher's stream is, with the same refusals), one message per
// JournalEntry on "<journal_subject_prefix>.<shard_id>", its data the
// entry's payload (docs/FORMAT.md, "The privacy journal"), headers
// Tidal-Shard, Tidal-Seq and Tidal-Log: journal, message id
// "j-<shard>-<seq>" (docs/SCALE.md, "The privacy journal's stream").
// Entries are published one at a time in seq order and confirmed only once
// the stream acknowledged them; after a failure it resumes from the first
// entry not acknowledged, and the Db keeps every unconfirmed entry.
//
// Fenced like Publisher (there is no incarnation and no re-seed): on every
// connection it reads the last entry of the shard's subject, and each
// publish expects the subject's last message. It halts for good
// (stats().halted, last_error, stop() returns the error), never
// confirming, when the stream holds a seq of this shard the Db's journal
// never reached (InvalidArgument: a Db restored from a backup and not yet
// recovered with recover_shard, or a twin), its entry of the Db's seq
// differs from the Db's (Corruption), another writer published on the
// subject since, or a Duplicate ack names a stored message that is not this
// entry (Corruption).
//
// stats() is a PublisherStats: published_seq is the last entry the stream
// acknowledged (the journal is confirmed through it), last_change_seq the
// journal's last seq, lag_batches the entries not yet acknowledged,
// lag_bytes their payload bytes (Stats::journal_pending_bytes), reseeds 0.
// Thread safety as Publisher's.
class JournalPublisher {
 public:
  // InvalidArgument for a null Db, a Db without a journal, a config that
  // Publisher::start refuses, a bad journal_stream or journal_subject_prefix,
  // or one equal to the change feed's. Then as Publisher::start: one first
  // attempt before returning; a missing stream is created, an existing one
  // checked (the same refusals), a fence found at that attempt returned.
  // `db` must outlive the JournalPublisher.
  static Result<std::unique_ptr<JournalPublisher>> start(Db* db, const Config& config);

  // As Publisher::stop: within about request_timeout; the fence that halted
  // it, else OK (an entry in flight is sent again by the next
  // JournalPublisher and de-duplicated). Idempotent. The Db is left open.
  Status stop();

  PublisherStats stats() const;

  ~JournalPublisher();  // stop()
  JournalPublisher(const JournalPublisher&) = delete;
  JournalPublisher& operator=(const JournalPublisher&) = delete;

  class Impl;

 private:
  explicit JournalPublisher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// For a Db opened from a backup (Stats::recovering): reads the shard's
// entries with seq > the Db's confirmed point (Stats::journal_confirmed_seq)
// from Config::journal_stream
// (through an ephemeral pull consumer on the shard's subject, up to the
// subject's last entry when the read started), in seq order, replays them
// (Db::replay_journal, in chunks of 1,024), then calls
// Db::finish_recovery(), which re-seeds the change feed (a new
// incarnation). OK and nothing done when the Db is not recovering.
// InvalidArgument for a null Db, one without a journal, a bad config;
// Corruption naming the shard, the stream and the seqs when the stream lacks
// an entry the Db needs (purged or aged out of it), holds something else
// on the shard's subject, or holds at a seq the Db holds unconfirmed an
// entry other than the Db's (a backup of a copy that did not go on: restore
// one of the copy that did); NotFound when the stream does not exist (a wrong
// name): the Db stays recovering
// (it serves nothing rather than forget a leave; after a recovery that
// truly has nothing to replay, call Db::finish_recovery()); IOError when the cluster does not answer (call
// again: what was replayed stays replayed, and is skipped). Start the
// JournalPublisher after it: it resumes where the stream ends. Blocking;
// about request_timeout per call to the cluster.
Status recover_shard(Db* db, const Config& config);

// Background thread: a durable JetStream pull consumer named consumer_name
// (one per view, over <subject_prefix>.*) -> GlobalView::apply -> ack, only
// after apply returned. It waits for one message, then takes whatever else
// is ready (up to fetch_batch), decodes each message once and applies the
// run in one GlobalView::apply of a span (one fsynced write), acking each
// message once that write returned. A message the view applied already is
// acked (exactly once).
//
// A gap parks its shard only (docs/SCALE.md, "Gaps and parked shards"):
// when the view refuses a batch of shard s (a gap, another incarnation, a
// payload that does not decode), shard s is parked: that message and every
// later one of s the consumer delivers are terminated on the consumer (so
// they never fill MaxAckPending and never hold back other shards), and the
// Follower reads s from the stream itself, on a consumer of its own over
// <subject_prefix>.<s> (ephemeral, no acks), from just after the last
// message of s this Follower saw the view take, while the view still holds
// it (else from the subject's first message: an earlier Follower may have
// terminated some of s). Not from the refused message: a batch before it
// may still come back late (delivered to a connection that died and
// redelivered after ack_wait). It applies whatever
// continues the view's seq of s, reads again from the first refused message
// whenever something new was applied after a refusal, and otherwise follows
// the subject's tail with a bounded backoff (min_backoff doubling to
// max_backoff) until the missing batch appears (a republish); it unparks s
// once it read to the stream's end (a message with nothing pending after
// it: an empty read is not the end) with nothing refused. A batch is never
// skipped: the stream keeps every terminated message for that read. Other
// shards keep applying meanwhile. At every start (and reconnect) the
// Follower parks each shard the view holds whose last message in the stream
// is one the view lacks and the consumer delivered already (a Follower
// before it may have terminated it while the shard was parked): one request
// per shard the view holds.
//
// The consumer, created when missing, has explicit acks (MaxAckPending =
// Config::max_ack_pending, AckWait = Config::ack_wait, redelivered until
// acked). For an empty view it delivers the stream from its first message.
// For a view that holds batches already (opened from another view's
// GlobalView::checkpoint) it starts at the first stream sequence the view
// may still need (docs/SCALE.md, "A new view from a checkpoint"): the least,
// over the shard subjects in the stream, of the first message of a shard
// the view never applied, of the first message of the view's incarnation of
// a shard with a seq above the view's applied seq, or, for a shard
// re-seeded since, of the re-seed's first batch (which replaces all the view
// held of the shard). Found by binary search over stream sequences, a few
// one-message reads per subject (FollowerStats::backfill_probes); where
// anything is uncertain it starts earlier, at worst at the stream's first
// message, never past a batch the view needs. An existing consumer keeps
// its position.
class Follower {
 public:
  // InvalidArgument for a null or read-only view, an empty consumer name or
  // one with '.', '*', '>' or whitespace, a bad config (as for Publisher).
  // Makes one first attempt before returning (at most request_timeout):
  // when the cluster answers and the stream is missing, it is NOT an error
  // (the publishers create it); a consumer of that name bound to other
  // subjects is InvalidArgument naming the server, the stream and the
  // consumer. `view` must outlive the Follower.
  static Result<std::unique_ptr<Follower>> start(GlobalView* view, const Config& config,
                                                 const std::string& consumer_name);

  // Stops the thread: returns within about request_timeout (a fetch waits
  // at most 500 ms; an apply in flight finishes, durable, and the messages
  // fetched but not applied are handed back to the stream at once; a
  // connect in flight is abandoned). Idempotent. Returns the thread's last
  // error when it stopped while failing (no connection, no consumer, a
  // failed apply: what stats().last_error said), OK when it was connected
  // and working; refusals (parked shards) are in stats(), not here.
  Status stop();

  FollowerStats stats() const;

  ~Follower();  // stop()
  Follower(const Follower&) = delete;
  Follower& operator=(const Follower&) = delete;

  class Impl;

 private:
  explicit Follower(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tidal::nats

#endif  // TIDAL_NATS_H_
