// What the Publisher and the Follower share: the config check, a connection
// to the cluster (RAII over the NATS C client), error text naming the server
// and the stream, the message layout, and the thread that runs their
// sessions with a bounded backoff that stop() can interrupt. Includes only <tidal/...> headers and the NATS C client.
#ifndef TIDAL_SRC_NATS_CLIENT_H_
#define TIDAL_SRC_NATS_CLIENT_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nats/nats.h>

#include "nats/log.h"
#include "tidal/change_batch.h"
#include "tidal/nats.h"
#include "tidal/status.h"

namespace tidal::nats::internal {

// Message headers carrying a batch's shard and seq (docs/SCALE.md, "Messages").
inline constexpr const char* kShardHeader = "Tidal-Shard";
inline constexpr const char* kSeqHeader = "Tidal-Seq";
// The feed's incarnation (ChangeBatch::incarnation); absent when unknown.
inline constexpr const char* kIncarnationHeader = "Tidal-Incarnation";
// Its ordinal (ChangeBatch::incarnation_ordinal, decimal); absent when unknown.
inline constexpr const char* kIncarnationOrdinalHeader = "Tidal-Incarnation-Ordinal";
// Which log a message belongs to: absent on the change feed's messages,
// "journal" on the privacy journal's (JournalPublisher).
inline constexpr const char* kLogHeader = "Tidal-Log";
inline constexpr const char* kJournalMarker = "journal";

// InvalidArgument naming the field for a config no cluster could serve.
Status check_config(const Config& config);
// The config of the privacy journal's stream: `config` with stream and
// subject_prefix set to journal_stream and journal_subject_prefix, which are
// checked (and must differ from the change feed's). InvalidArgument naming
// the field otherwise.
Result<Config> journal_config(const Config& config);

// "<subject_prefix>.<shard>", and the JetStream message id
// "<shard>-<seq>-<incarnation>" ("<shard>-<seq>" when the incarnation is
// unknown): a re-seeded or restored Db reuses seqs the stream's
// de-duplication window may still hold, under another incarnation.
std::string subject_of(const Config& config, std::uint64_t shard);
std::string msg_id_of(const ChangeBatch& b);

// Whether `b` is the first batch of a re-seed (Db::reseed_change_feed): its
// payload's origin byte is 5 (docs/FORMAT.md, "The change feed").
inline bool is_reseed(const ChangeBatch& b) {
  return b.payload.size() >= 6 && b.payload[0] == 1 && b.payload[1] == 5 && !b.incarnation.empty();
}

// A message's batch: shard, seq, incarnation and its ordinal (if any) from its headers
// (checked against the subject), the payload from its data. Corruption
// saying why otherwise.
Result<ChangeBatch> batch_of(natsMsg* msg, const Config& config);
// The same for any log: also Corruption when the message's Tidal-Log header
// is not `marker` (absent for an empty marker), i.e. a record of another log.
Result<LogRecord> record_of(natsMsg* msg, const Config& config, const std::string& marker);

// "<status text>: <the client's last error>" for the calling thread.
std::string nats_error(natsStatus s);

// One connection and its JetStream context; closed and freed on destruction.
// The client's own reconnection is off: a lost connection is closed, and the
// owner reconnects with its own backoff.
class Connection {
 public:
  Connection() = default;
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Connects to one of config.servers within request_timeout in all,
  // whatever the servers do, and returns within ~20 ms once `cancelled`
  // returns true. First a probe of our own on a plain socket (TCP connect,
  // the server's INFO greeting, CONNECT + PING answered), trying the
  // servers in random order, each given an equal share of what is left of
  // the timeout; then the NATS client's own connect to the server that
  // answered, on a helper thread: libnats 3.4's connect does not return
  // (and spins a core) when a server greets and then goes silent, so a
  // connect that outlives the timeout is abandoned to that thread, which
  // frees the connection if it ever returns. IOError naming the servers
  // and what each did on failure.
  Status connect(const Config& config, const std::string& client_name,
                 const std::function<bool()>& cancelled = [] { return false; });
  // Closes the socket (wakes a request in flight) without freeing anything:
  // safe from another thread while the owner is inside a call.
  void interrupt();
  bool connected() const;
  // The URL of the server connected to, or config.servers before connect.
  const std::string& server() const { return server_; }

  natsConnection* nc() const { return nc_; }
  jsCtx* js() const { return js_; }

 private:
  natsConnection* nc_ = nullptr;
  jsCtx* js_ = nullptr;
  std::string server_;
};

// Messages a Pull read: destroyed with it (acknowledged or not).
struct Fetched {
  Fetched() = default;
  ~Fetched();
  Fetched(const Fetched&) = delete;
  Fetched& operator=(const Fetched&) = delete;
  std::vector<natsMsg*> msgs;
};

// Reads a JetStream pull consumer with pull requests of its own, each with
// a reply subject of its own under one inbox subscription, instead of the
// NATS client's natsSubscription_Fetch*. In libnats 3.4 (Debian 12 ships
// 3.4.1) a fetch that finds messages of an earlier request still queued on
// its subscription (delivered after that fetch stopped waiting: an answer
// that came late, a stream leader change) takes them, asks the server for
// the rest of its batch, and then compares the count it holds with that
// smaller remainder: it goes on taking messages past the array it sized
// for the batch, and corrupts the heap (nats.c #749, fixed in 3.10). Here
// a message of an earlier request is simply the next fetch's first.
// One thread at a time; destroy it before its Connection.
class Pull {
 public:
  explicit Pull(Connection& conn) : conn_(conn) {}
  ~Pull();  // unsubscribes, and deletes an ephemeral consumer it created
  Pull(const Pull&) = delete;
  Pull& operator=(const Pull&) = delete;

  // Reads the existing consumer `consumer` of `stream`.
  Status open(const std::string& stream, const std::string& consumer);
  // Creates an ephemeral pull consumer of `stream` with `cc` (no Durable,
  // no DeliverSubject) and reads it. The destructor deletes it; the server
  // does too, cc.InactiveThreshold after the last read, when that fails.
  Status open_ephemeral(const std::string& stream, const jsConsumerConfig& cc);

  // Asks for up to `batch` messages (at most max_bytes in all; 0: no
  // limit) and waits up to `wait` for them; with no_wait the server answers
  // at once with what is ready. Appends at most `batch` messages to *out:
  // first any an earlier request left queued, then this request's. OK with
  // none appended when none was ready; IOError naming the consumer when the
  // request fails or the server ends it with an error before any message.
  Status fetch(int batch, std::int64_t max_bytes, bool no_wait, std::chrono::milliseconds wait, Fetched* out);
  // How many messages the consumer has not delivered yet.
  Result<std::uint64_t> num_pending();
  // The inbox subject the requests' replies go under ("<inbox>.<n>").
  const std::string& inbox() const { return inbox_; }
  const std::string& consumer() const { return consumer_; }

 private:
  std::string where() const;

  Connection& conn_;
  std::string stream_, consumer_;
  bool ephemeral_ = false;
  std::string inbox_, next_subject_;
  natsSubscription* sub_ = nullptr;
  std::uint64_t requests_ = 0;
};

// What a reader of a Pull's messages replies to one (JetStream's ack
// protocol): processed, hand it back for redelivery now, or never deliver
// it again.
inline constexpr const char* kAck = "+ACK";
inline constexpr const char* kNak = "-NAK";
inline constexpr const char* kTerm = "+TERM";
// Sends `reply` for `msg`, a message a Pull read on `conn`.
natsStatus reply_to(Connection& conn, natsMsg* msg, const char* reply);

// Doubling delays from min to max; reset after a success.
class Backoff {
 public:
  Backoff(std::chrono::milliseconds min, std::chrono::milliseconds max) : min_(min), max_(max), next_(min) {}
  std::chrono::milliseconds next();
  void reset() { next_ = min_; }

 private:
  std::chrono::milliseconds min_, max_, next_;
};

// A failed session, in a PublisherStats or FollowerStats guarded by `mu`:
// counted, the last error, and not connected.
template <class Stats>
void note_failure(std::mutex& mu, Stats* stats, const Status& s) {
  std::lock_guard<std::mutex> lock(mu);
  ++stats->errors;
  stats->connected = false;
  stats->last_error = s.to_string();
}

// The thread a Publisher or a Follower runs: a session (connect, then work
// until an error) again and again, with a bounded backoff between them,
// until stop(). Thread-safe.
class Worker {
 public:
  Worker() = default;
  ~Worker() { stop(); }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Runs `session` on a new thread; after each session that returned
  // without stop(), hands its status to `failed`, waits the backoff
  // (config.min_backoff doubling to config.max_backoff, reset by the
  // session) and runs it again. Waits up to config.request_timeout + 1 s
  // for the first session to call ready() or return: an InvalidArgument
  // from it (a config no cluster could serve), or any status of a session
  // that called halt(), stops the thread and is returned. Anything else is
  // OK, and the thread keeps retrying.
  Status start(const Config& config, std::function<Status(Backoff&)> session,
               std::function<void(const Status&)> failed);
  // Called by a session that is connected and working: start() returns OK.
  void ready();
  // Called by a session that found an error no retry can fix (the stream
  // and the Db disagree): the thread ends once that session returns, after
  // handing its status to `failed`; start() returns it when it is the first
  // session's.
  void halt();
  bool halted() const;
  // Interrupts the attached connection, wakes wait_for() and joins the
  // thread. Bounded by how long a session takes to notice (at most one
  // request_timeout; a connect notices within ~20 ms). Idempotent.
  void stop();
  // The status of the last session that failed, unless a session called
  // ready() since: what the thread was retrying when it stopped; OK when
  // it was connected and working.
  Status last_error() const;
  bool stopping() const;
  // Sleeps for `d` unless stop() cuts it short; false once stopping.
  bool wait_for(std::chrono::milliseconds d);

  // While it lives, stop() interrupts `conn` (closes its socket, waking a
  // request in flight). ok() is false when stop() came first.
  class Attach {
   public:
    Attach(Worker& worker, Connection& conn);
    ~Attach();
    Attach(const Attach&) = delete;
    Attach& operator=(const Attach&) = delete;
    bool ok() const { return ok_; }

   private:
    Worker& worker_;
    bool ok_;
  };

 private:
  void run(const Config& config, const std::function<Status(Backoff&)>& session,
           const std::function<void(const Status&)>& failed);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;               // guarded by mu_
  bool halted_ = false;                 // guarded by mu_
  std::optional<Status> first_;         // the first session's outcome; guarded by mu_
  Status last_error_;                   // see last_error(); guarded by mu_
  Connection* live_ = nullptr;          // the connection stop() interrupts; guarded by mu_
  std::mutex stop_mu_;                  // one stop() joins at a time
  std::thread thread_;
};

}  // namespace tidal::nats::internal

#endif  // TIDAL_SRC_NATS_CLIENT_H_
