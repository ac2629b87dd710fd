// Publisher (the change feed) and JournalPublisher (the privacy journal):
// each a LogPublisher over one of the Db's logs (include/tidal/nats.h).
#include <memory>
#include <utility>

#include "nats/client.h"
#include "nats/log.h"
#include "nats/log_publisher.h"
#include "tidal/nats.h"

namespace tidal::nats {

class Publisher::Impl : public internal::LogPublisher {
 public:
  using LogPublisher::LogPublisher;
};

class JournalPublisher::Impl : public internal::LogPublisher {
 public:
  using LogPublisher::LogPublisher;
};

Result<std::unique_ptr<Publisher>> Publisher::start(Db* db, const Config& config) {
  if (db == nullptr) return Status::InvalidArgument("tidal::nats::Publisher::start: db is null");
  if (Status s = internal::check_config(config); !s.ok()) return s;
  Stats st = db->stats();
  if (!st.change_feed) {
    return Status::InvalidArgument("tidal::nats::Publisher::start: the Db keeps no change feed (open it with "
                                   "Options::change_feed = true)");
  }
  auto impl = std::make_unique<Impl>(internal::change_feed_log(db), config, st.change_feed_shard_id);
  if (Status s = impl->start(); !s.ok()) return s;
  return std::unique_ptr<Publisher>(new Publisher(std::move(impl)));
}

Publisher::Publisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Publisher::~Publisher() {
  if (impl_) (void)impl_->stop();
}
Status Publisher::stop() { return impl_->stop(); }
PublisherStats Publisher::stats() const { return impl_->stats(); }

Result<std::unique_ptr<JournalPublisher>> JournalPublisher::start(Db* db, const Config& config) {
  if (db == nullptr) return Status::InvalidArgument("tidal::nats::JournalPublisher::start: db is null");
  Result<Config> jc = internal::journal_config(config);
  if (!jc.ok()) return jc.status();
  Stats st = db->stats();
  if (!st.journal) {
    return Status::InvalidArgument("tidal::nats::JournalPublisher::start: the Db keeps no privacy journal (open it "
                                   "with Options::journal = true)");
  }
  auto impl = std::make_unique<Impl>(internal::journal_log(db), std::move(*jc), st.journal_shard_id);
  if (Status s = impl->start(); !s.ok()) return s;
  return std::unique_ptr<JournalPublisher>(new JournalPublisher(std::move(impl)));
}

JournalPublisher::JournalPublisher(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
JournalPublisher::~JournalPublisher() {
  if (impl_) (void)impl_->stop();
}
Status JournalPublisher::stop() { return impl_->stop(); }
PublisherStats JournalPublisher::stats() const { return impl_->stats(); }

}  // namespace tidal::nats
