// The publishing engine shared by Publisher (the change feed) and
// JournalPublisher (the privacy journal): one log of a Db -> its JetStream
// stream, fenced, then trimmed or confirmed after the stream's ack
// (include/tidal/nats.h says what each promises). Includes only <tidal/...>
// headers and the NATS C client.
#ifndef TIDAL_SRC_NATS_LOG_PUBLISHER_H_
#define TIDAL_SRC_NATS_LOG_PUBLISHER_H_

#include <cstdint>
#include <memory>

#include "nats/log.h"
#include "tidal/nats.h"
#include "tidal/status.h"

namespace tidal::nats::internal {

class LogPublisher {
 public:
  // `config` names the log's stream and subject prefix in its `stream` and
  // `subject_prefix` (the journal's are copied there by JournalPublisher).
  LogPublisher(std::unique_ptr<Log> log, Config config, std::uint64_t shard);
  ~LogPublisher();
  LogPublisher(const LogPublisher&) = delete;
  LogPublisher& operator=(const LogPublisher&) = delete;

  // Starts the thread (Worker::start): InvalidArgument when the cluster
  // refuses the stream, a fence found at the first attempt.
  Status start();
  // OK, the fence that halted it, or the last error of a failing thread.
  Status stop();
  PublisherStats stats() const;

  class Engine;

 private:
  std::unique_ptr<Engine> engine_;
};

}  // namespace tidal::nats::internal

#endif  // TIDAL_SRC_NATS_LOG_PUBLISHER_H_
