#include "nats/client.h"

#include <cctype>
#include <charconv>
#include <cstring>
#include <utility>
#include <vector>

namespace tidal::nats::internal {

namespace {

std::vector<std::string> split_servers(const std::string& servers) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= servers.size()) {
    std::size_t comma = servers.find(',', start);
    if (comma == std::string::npos) comma = servers.size();
    std::string url = servers.substr(start, comma - start);
    while (!url.empty() && std::isspace(static_cast<unsigned char>(url.front()))) url.erase(url.begin());
    while (!url.empty() && std::isspace(static_cast<unsigned char>(url.back()))) url.pop_back();
    if (!url.empty()) out.push_back(std::move(url));
    start = comma + 1;
  }
  return out;
}

bool valid_token(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (c == '*' || c == '>' || std::isspace(static_cast<unsigned char>(c)) || c == '\0') return false;
  }
  return true;
}

bool parse_u64(const char* s, std::uint64_t* out) {
  if (s == nullptr || *s == '\0') return false;
  const char* end = s + std::strlen(s);
  auto [p, ec] = std::from_chars(s, end, *out);
  return ec == std::errc() && p == end;
}

}  // namespace

Status check_config(const Config& config) {
  if (split_servers(config.servers).empty()) {
    return Status::InvalidArgument("tidal::nats::Config::servers is empty: give the cluster's URLs, comma-separated");
  }
  if (!valid_token(config.stream) || config.stream.find('.') != std::string::npos) {
    return Status::InvalidArgument("tidal::nats::Config::stream '" + config.stream +
                                   "' is not a JetStream stream name (non-empty, no '.', '*', '>' or whitespace)");
  }
  if (!valid_token(config.subject_prefix) || config.subject_prefix.front() == '.' ||
      config.subject_prefix.back() == '.' || config.subject_prefix.find("..") != std::string::npos) {
    return Status::InvalidArgument("tidal::nats::Config::subject_prefix '" + config.subject_prefix +
                                   "' is not a subject prefix (non-empty tokens separated by '.', no '*', '>' or "
                                   "whitespace)");
  }
  if (config.replicas < 1 || config.replicas > 5) {
    return Status::InvalidArgument("tidal::nats::Config::replicas is " + std::to_string(config.replicas) +
                                   ": JetStream keeps 1 to 5 replicas of a stream");
  }
  if (config.request_timeout.count() <= 0 || config.min_backoff.count() <= 0 ||
      config.max_backoff < config.min_backoff || config.poll_interval.count() <= 0 || config.ack_wait.count() <= 0) {
    return Status::InvalidArgument(
        "tidal::nats::Config: request_timeout, min_backoff, poll_interval and ack_wait must be positive and "
        "max_backoff >= min_backoff");
  }
  if (config.duplicate_window.count() <= 0 || config.stream_max_bytes < 0 || config.stream_max_age.count() < 0) {
    return Status::InvalidArgument(
        "tidal::nats::Config: duplicate_window must be positive, stream_max_bytes and stream_max_age not negative "
        "(0 = unlimited)");
  }
  if (config.stream_max_age.count() > 0 && config.duplicate_window > config.stream_max_age) {
    return Status::InvalidArgument("tidal::nats::Config::duplicate_window (" +
                                   std::to_string(config.duplicate_window.count()) +
                                   " ms) is longer than stream_max_age (" +
                                   std::to_string(config.stream_max_age.count()) + " s): JetStream refuses it");
  }
  if (config.read_max_bytes == 0 || config.fetch_batch < 1 ||
      config.fetch_max_bytes < static_cast<std::int64_t>(kMaxChangePayloadBytes) + (64 << 10)) {
    return Status::InvalidArgument(
        "tidal::nats::Config: read_max_bytes and fetch_batch must be positive and fetch_max_bytes at least "
        "576 KiB (one batch of 512 KiB and its headers)");
  }
  return Status::OK();
}

Result<Config> journal_config(const Config& config) {
  if (Status s = check_config(config); !s.ok()) return s;
  if (!valid_token(config.journal_stream) || config.journal_stream.find('.') != std::string::npos) {
    return Status::InvalidArgument("tidal::nats::Config::journal_stream '" + config.journal_stream +
                                   "' is not a JetStream stream name (non-empty, no '.', '*', '>' or whitespace)");
  }
  if (!valid_token(config.journal_subject_prefix) || config.journal_subject_prefix.front() == '.' ||
      config.journal_subject_prefix.back() == '.' || config.journal_subject_prefix.find("..") != std::string::npos) {
    return Status::InvalidArgument("tidal::nats::Config::journal_subject_prefix '" + config.journal_subject_prefix +
                                   "' is not a subject prefix (non-empty tokens separated by '.', no '*', '>' or "
                                   "whitespace)");
  }
  if (config.journal_stream == config.stream || config.journal_subject_prefix == config.subject_prefix) {
    return Status::InvalidArgument(
        "tidal::nats::Config: the privacy journal needs a stream and a subject prefix of its own "
        "(journal_stream '" + config.journal_stream + "', journal_subject_prefix '" + config.journal_subject_prefix +
        "'; the change feed's are '" + config.stream + "' and '" + config.subject_prefix + "')");
  }
  Config jc = config;
  jc.stream = config.journal_stream;
  jc.subject_prefix = config.journal_subject_prefix;
  return jc;
}

std::string subject_of(const Config& config, std::uint64_t shard) {
  return config.subject_prefix + "." + std::to_string(shard);
}

std::string msg_id_of(const ChangeBatch& b) {
  std::string id = std::to_string(b.shard_id) + "-" + std::to_string(b.seq);
  if (!b.incarnation.empty()) id += "-" + b.incarnation;
  return id;
}

Result<LogRecord> record_of(natsMsg* msg, const Config& config, const std::string& marker) {
  const char* subject = natsMsg_GetSubject(msg);
  const char* shard_text = nullptr;
  const char* seq_text = nullptr;
  LogRecord r;
  if (natsMsgHeader_Get(msg, kShardHeader, &shard_text) != NATS_OK || !parse_u64(shard_text, &r.shard_id) ||
      natsMsgHeader_Get(msg, kSeqHeader, &seq_text) != NATS_OK || !parse_u64(seq_text, &r.seq) || r.seq == 0) {
    return Status::Corruption(std::string("message on ") + (subject ? subject : "?") + " in stream " +
                              config.stream + " is not a tidal " + (marker.empty() ? "batch" : marker + " entry") +
                              ": no valid " + kShardHeader + " and " + kSeqHeader + " headers");
  }
  if (subject == nullptr || subject_of(config, r.shard_id) != subject) {
    return Status::Corruption(std::string("message on ") + (subject ? subject : "?") + " in stream " +
                              config.stream + " says shard " + std::to_string(r.shard_id) +
                              ", which publishes on " + subject_of(config, r.shard_id));
  }
  const char* log = nullptr;
  std::string found;
  if (natsMsgHeader_Get(msg, kLogHeader, &log) == NATS_OK && log != nullptr) found = log;
  if (found != marker) {
    return Status::Corruption(std::string("message on ") + subject + " in stream " + config.stream + " has " +
                              kLogHeader + " '" + found + "', expected '" + marker +
                              "': a record of another tidal log (the change feed and the privacy journal need "
                              "streams and subjects of their own)");
  }
  const char* incarnation = nullptr;
  if (natsMsgHeader_Get(msg, kIncarnationHeader, &incarnation) == NATS_OK && incarnation != nullptr) {
    r.incarnation = incarnation;
  }
  const int len = natsMsg_GetDataLength(msg);
  if (len > 0) r.payload.assign(natsMsg_GetData(msg), static_cast<std::size_t>(len));
  return r;
}

Result<ChangeBatch> batch_of(natsMsg* msg, const Config& config) {
  Result<LogRecord> r = record_of(msg, config, {});
  if (!r.ok()) return r.status();
  ChangeBatch b;
  b.shard_id = r->shard_id;
  b.seq = r->seq;
  b.incarnation = std::move(r->incarnation);
  b.payload = std::move(r->payload);
  return b;
}

std::string nats_error(natsStatus s) {
  natsStatus last = NATS_OK;
  const char* text = nats_GetLastError(&last);
  std::string out = natsStatus_GetText(s);
  if (text != nullptr && *text != '\0' && std::strstr(out.c_str(), text) == nullptr) out += std::string(" (") + text + ")";
  return out;
}

Connection::~Connection() {
  if (js_ != nullptr) jsCtx_Destroy(js_);
  if (nc_ != nullptr) {
    natsConnection_Close(nc_);
    natsConnection_Destroy(nc_);
  }
}

Status Connection::connect(const Config& config, const std::string& client_name) {
  server_ = config.servers;
  std::vector<std::string> urls = split_servers(config.servers);
  std::vector<const char*> url_ptrs;
  for (const std::string& u : urls) url_ptrs.push_back(u.c_str());
  natsOptions* opts = nullptr;
  natsStatus s = natsOptions_Create(&opts);
  if (s == NATS_OK) s = natsOptions_SetServers(opts, url_ptrs.data(), static_cast<int>(url_ptrs.size()));
  if (s == NATS_OK) s = natsOptions_SetTimeout(opts, config.request_timeout.count());
  if (s == NATS_OK) s = natsOptions_SetName(opts, client_name.c_str());
  if (s == NATS_OK) s = natsOptions_SetAllowReconnect(opts, false);
  if (s == NATS_OK) s = natsOptions_SetNoRandomize(opts, false);
  if (s == NATS_OK) s = natsOptions_SetPingInterval(opts, 2000);
  if (s == NATS_OK) s = natsOptions_SetMaxPingsOut(opts, 3);
  if (s == NATS_OK) s = natsConnection_Connect(&nc_, opts);
  std::string error = s == NATS_OK ? std::string() : nats_error(s);
  natsOptions_Destroy(opts);
  if (s != NATS_OK) {
    nc_ = nullptr;
    return Status::IOError("cannot connect to NATS at " + config.servers + ": " + error);
  }
  char url[256] = {0};
  if (natsConnection_GetConnectedUrl(nc_, url, sizeof(url)) == NATS_OK && url[0] != '\0') server_ = url;
  jsOptions jo;
  jsOptions_Init(&jo);
  jo.Wait = config.request_timeout.count();
  s = natsConnection_JetStream(&js_, nc_, &jo);
  if (s != NATS_OK) {
    js_ = nullptr;
    return Status::IOError("NATS server " + server_ + ": no JetStream context: " + nats_error(s));
  }
  return Status::OK();
}

void Connection::interrupt() {
  if (nc_ != nullptr) natsConnection_Close(nc_);
}

bool Connection::connected() const {
  return nc_ != nullptr && natsConnection_Status(nc_) == NATS_CONN_STATUS_CONNECTED;
}

std::chrono::milliseconds Backoff::next() {
  std::chrono::milliseconds d = next_;
  next_ = std::min(max_, next_ * 2);
  return d;
}

Status Worker::start(const Config& config, std::function<Status(Backoff&)> session,
                     std::function<void(const Status&)> failed) {
  thread_ = std::thread([this, config, session = std::move(session), failed = std::move(failed)] {
    run(config, session, failed);
  });
  std::optional<Status> first;
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, config.request_timeout + std::chrono::seconds(1), [&] { return first_.has_value(); });
    first = first_;
  }
  if (first && (first->code() == StatusCode::InvalidArgument || halted())) {
    stop();
    return *first;
  }
  return Status::OK();
}

void Worker::run(const Config& config, const std::function<Status(Backoff&)>& session,
                 const std::function<void(const Status&)>& failed) {
  Backoff backoff(config.min_backoff, config.max_backoff);
  while (!stopping()) {
    Status s = session(backoff);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!first_) first_ = s;
    }
    cv_.notify_all();
    if (stopping()) break;
    failed(s);
    if (halted()) break;
    if (!wait_for(backoff.next())) break;
  }
}

void Worker::ready() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!first_) first_ = Status::OK();
  }
  cv_.notify_all();
}

void Worker::halt() {
  std::lock_guard<std::mutex> lock(mu_);
  halted_ = true;
}

bool Worker::halted() const {
  std::lock_guard<std::mutex> lock(mu_);
  return halted_;
}

void Worker::stop() {
  std::lock_guard<std::mutex> once(stop_mu_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    if (live_ != nullptr) live_->interrupt();
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool Worker::stopping() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stopping_;
}

bool Worker::wait_for(std::chrono::milliseconds d) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, d, [&] { return stopping_; });
  return !stopping_;
}

Worker::Attach::Attach(Worker& worker, Connection& conn) : worker_(worker) {
  std::lock_guard<std::mutex> lock(worker_.mu_);
  ok_ = !worker_.stopping_;
  if (ok_) worker_.live_ = &conn;
}

Worker::Attach::~Attach() {
  if (!ok_) return;
  std::lock_guard<std::mutex> lock(worker_.mu_);
  worker_.live_ = nullptr;
}

}  // namespace tidal::nats::internal
