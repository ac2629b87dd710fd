// What the Publisher and the Follower share: the config check, a connection
// to the cluster (RAII over the NATS C client), error text naming the server
// and the stream, the message layout and a bounded backoff that stop() can
// interrupt. Includes only <tidal/...> headers and the NATS C client.
#ifndef TIDAL_SRC_NATS_CLIENT_H_
#define TIDAL_SRC_NATS_CLIENT_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

#include <nats/nats.h>

#include "tidal/change_batch.h"
#include "tidal/nats.h"
#include "tidal/status.h"

namespace tidal::nats::internal {

// Message headers carrying a batch's shard and seq (docs/SCALE.md, "Messages").
inline constexpr const char* kShardHeader = "Tidal-Shard";
inline constexpr const char* kSeqHeader = "Tidal-Seq";

// InvalidArgument naming the field for a config no cluster could serve.
Status check_config(const Config& config);

// "<subject_prefix>.<shard>" and the JetStream message id "<shard>-<seq>".
std::string subject_of(const Config& config, std::uint64_t shard);
std::string msg_id_of(std::uint64_t shard, std::uint64_t seq);

// A message's batch: shard and seq from its headers (checked against the
// subject), the payload from its data. Corruption saying why otherwise.
Result<ChangeBatch> batch_of(natsMsg* msg, const Config& config);

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

  // Connects to one of config.servers (request_timeout each). IOError naming
  // the servers on failure.
  Status connect(const Config& config, const std::string& client_name);
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

// Sleeps that stop() cuts short. wait_for returns false once stopping.
class StopFlag {
 public:
  void request_stop();
  bool stopping() const;
  bool wait_for(std::chrono::milliseconds d);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
};

// Doubling delays from min to max; reset after a success.
class Backoff {
 public:
  Backoff(std::chrono::milliseconds min, std::chrono::milliseconds max) : min_(min), max_(max), next_(min) {}
  std::chrono::milliseconds next();
  void reset() { next_ = min_; }

 private:
  std::chrono::milliseconds min_, max_, next_;
};

// The outcome of a component's first attempt, which start() waits for.
class FirstAttempt {
 public:
  void set(Status s);
  // The first attempt's outcome, or nullopt when it took longer than `d`.
  std::optional<Status> wait_for(std::chrono::milliseconds d);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Status> outcome_;
};

}  // namespace tidal::nats::internal

#endif  // TIDAL_SRC_NATS_CLIENT_H_
