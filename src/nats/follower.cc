// Follower: durable JetStream pull consumer -> GlobalView::apply -> ack
// (include/tidal/nats.h).
#include <algorithm>
#include <cctype>
#include <memory>
#include <span>
#include <vector>
#include <mutex>
#include <string>
#include <utility>

#include "nats/client.h"
#include "tidal/nats.h"

namespace tidal::nats {

using internal::Connection;

namespace {

// How long a refused message (a gap, an undecodable message) waits before
// the stream delivers it again.
constexpr std::chrono::milliseconds kRefusedRedeliveryDelay{500};
// A fetch waits at most this long for messages.
constexpr std::chrono::milliseconds kFetchWait{500};

struct MsgList {
  natsMsgList list{nullptr, 0};
  ~MsgList() {
    if (list.Msgs != nullptr) natsMsgList_Destroy(&list);
  }
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
    return Status::OK();
  }

  FollowerStats stats() const {
    FollowerStats out;
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      out = stats_;
    }
    Result<std::vector<ShardProgress>> shards = view_->applied_shards();
    if (shards.ok()) out.applied = std::move(*shards);
    return out;
  }

 private:
  std::string where(const Connection& c) const {
    return "NATS server " + c.server() + ", stream " + config_.stream + ", consumer " + consumer_;
  }

  Status subscribe(Connection& conn, natsSubscription** sub) {
    jsSubOptions so;
    jsSubOptions_Init(&so);
    so.Stream = config_.stream.c_str();
    so.Config.Durable = consumer_.c_str();
    so.Config.DeliverPolicy = js_DeliverAll;
    so.Config.AckPolicy = js_AckExplicit;
    so.Config.AckWait = static_cast<std::int64_t>(config_.ack_wait.count()) * 1'000'000;
    so.Config.MaxDeliver = -1;
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
                                     "a pull consumer of " + filter_ + " with explicit acks): " + why);
    }
    return Status::IOError(where(conn) + ": cannot bind the durable pull consumer: " + why);
  }

  Status session(internal::Backoff& backoff) {
    Connection conn;
    Status s = conn.connect(config_, "tidal-follower-" + consumer_);
    if (!s.ok()) return s;
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++stats_.connects;
    }
    natsSubscription* sub = nullptr;
    s = subscribe(conn, &sub);
    if (!s.ok()) return s;
    struct SubGuard {
      natsSubscription* sub;
      ~SubGuard() { natsSubscription_Destroy(sub); }  // leaves the durable consumer on the server
    } guard{sub};
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      stats_.connected = true;
    }
    worker_.ready();
    backoff.reset();

    while (!worker_.stopping()) {
      // Wait (at most kFetchWait) for one message, then take whatever else
      // the stream has ready, up to fetch_batch, without waiting: a long
      // poll for a whole batch would hold the first message until the batch
      // filled or the wait ran out.
      MsgList first, more;
      natsStatus ns = fetch(sub, 1, /*no_wait=*/false, &first);
      if (ns == NATS_TIMEOUT || (ns == NATS_NOT_FOUND && first.list.Count == 0)) {
        if (!conn.connected()) return Status::IOError(where(conn) + ": connection lost");
        std::lock_guard<std::mutex> lock(stats_mu_);
        stats_.lag_messages = 0;
        continue;
      }
      if (ns != NATS_OK && first.list.Count == 0) {
        return Status::IOError(where(conn) + ": fetch failed: " + internal::nats_error(ns));
      }
      if (config_.fetch_batch > 1) (void)fetch(sub, config_.fetch_batch - 1, /*no_wait=*/true, &more);
      std::vector<natsMsg*> msgs;
      for (int i = 0; i < first.list.Count; ++i) msgs.push_back(first.list.Msgs[i]);
      for (int i = 0; i < more.list.Count; ++i) msgs.push_back(more.list.Msgs[i]);
      if (worker_.stopping()) {
        for (natsMsg* m : msgs) (void)natsMsg_Nak(m, nullptr);  // hand them back at once for the next Follower
        break;
      }
      s = handle(conn, msgs);
      if (!s.ok()) return s;
    }
    return Status::OK();
  }

  natsStatus fetch(natsSubscription* sub, int batch, bool no_wait, MsgList* out) {
    jsFetchRequest req;
    jsFetchRequest_Init(&req);
    req.Batch = batch;
    req.MaxBytes = config_.fetch_max_bytes;
    req.NoWait = no_wait;
    req.Expires = static_cast<std::int64_t>(kFetchWait.count()) * 1'000'000;
    return natsSubscription_FetchRequest(&out->list, sub, &req);
  }

  // Applies the fetched messages, in order, with as few view writes as the
  // refusals allow: each run of batches up to the next refused message is
  // one GlobalView::apply (one fsynced write), and its messages are acked
  // after that write returned. A refused message (a gap, a message that is
  // not a batch) is not acked and asked for again later; the messages after
  // it are still applied. A non-OK return is a failure of the view or the
  // connection; the messages not yet acked are then handed back.
  Status handle(Connection& conn, const std::vector<natsMsg*>& msgs) {
    const auto fetched_at = std::chrono::system_clock::now();
    std::vector<ChangeBatch> batches;
    std::vector<natsMsg*> run;  // the messages of `batches`
    std::size_t next = 0;       // first message not yet applied, acked or refused
    auto nak_rest = [&](std::size_t from) {
      for (std::size_t j = from; j < msgs.size(); ++j) (void)natsMsg_Nak(msgs[j], nullptr);
    };
    while (next < msgs.size()) {
      batches.clear();
      run.clear();
      Status not_a_batch;
      for (std::size_t j = next; j < msgs.size(); ++j) {
        note_delivery(msgs[j], fetched_at);
        Result<ChangeBatch> b = internal::batch_of(msgs[j], config_);
        if (!b.ok()) {
          not_a_batch = b.status();
          break;
        }
        batches.push_back(std::move(*b));
        run.push_back(msgs[j]);
      }
      std::size_t taken = 0;
      Status refused = not_a_batch;
      if (!batches.empty()) {
        const auto t0 = std::chrono::steady_clock::now();
        Result<ApplyOutcome> outcome = view_->apply(std::span<const ChangeBatch>(batches));
        const auto micros =
            std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count();
        if (!outcome.ok()) {
          nak_rest(next);
          return Status(outcome.status().code(), where(conn) + ": GlobalView::apply of " +
                                                     std::to_string(batches.size()) + " batches (shard " +
                                                     std::to_string(batches[0].shard_id) + " seq " +
                                                     std::to_string(batches[0].seq) + " first): " +
                                                     outcome.status().message());
        }
        taken = outcome->taken;
        if (!outcome->refused.ok()) refused = outcome->refused;
        {
          std::lock_guard<std::mutex> lock(stats_mu_);
          ++stats_.view_writes;
          stats_.apply_micros += static_cast<std::uint64_t>(micros);
          stats_.applied_batches += outcome->applied;
          stats_.redeliveries_skipped += outcome->taken - outcome->applied;
          if (taken > 0) stats_.stalled_on_gap = false;
        }
        // Applied (durable) or already applied: either way the stream may
        // forget them for this consumer. A lost ack only means a
        // redelivery, which the view skips.
        for (std::size_t j = 0; j < taken; ++j) {
          natsStatus ns = natsMsg_Ack(run[j], nullptr);
          if (ns != NATS_OK) {
            nak_rest(next + j + 1);
            return Status::IOError(where(conn) + ": ack failed: " + internal::nats_error(ns));
          }
        }
      }
      next += taken;
      if (next == msgs.size()) break;
      // msgs[next] is refused: a gap or undecodable payload (the view said
      // so), or not a batch at all.
      if (Status s = refuse(conn, msgs[next], refused); !s.ok()) {
        nak_rest(next + 1);
        return s;
      }
      ++next;
    }
    return Status::OK();
  }

  // Lag (messages still to come) and the time from the stream's store to
  // this fetch, from the message's JetStream metadata.
  void note_delivery(natsMsg* msg, std::chrono::system_clock::time_point fetched_at) {
    jsMsgMetaData* meta = nullptr;
    if (natsMsg_GetMetaData(&meta, msg) != NATS_OK) return;
    const std::int64_t now_ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(fetched_at.time_since_epoch()).count();
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_.lag_messages = meta->NumPending;
    if (meta->NumDelivered == 1 && now_ns > meta->Timestamp) {
      stats_.stored_to_fetched_micros += static_cast<std::uint64_t>((now_ns - meta->Timestamp) / 1000);
      ++stats_.first_deliveries;
    }
    jsMsgMetaData_Destroy(meta);
  }

  Status refuse(Connection& conn, natsMsg* msg, const Status& why) {
    {
      std::lock_guard<std::mutex> lock(stats_mu_);
      ++stats_.gaps;
      stats_.stalled_on_gap = true;
      stats_.last_error = Status(why.code(), where(conn) + ": not applied, delivered again later: " + why.message())
                              .to_string();
    }
    natsStatus ns = natsMsg_NakWithDelay(msg, kRefusedRedeliveryDelay.count(), nullptr);
    if (ns != NATS_OK) return Status::IOError(where(conn) + ": nak failed: " + internal::nats_error(ns));
    return Status::OK();
  }

  GlobalView* const view_;
  const Config config_;
  const std::string consumer_;
  const std::string filter_;
  mutable std::mutex stats_mu_;
  FollowerStats stats_;
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
