#include "nats/client.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
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
  if (config.user.empty() != config.password.empty()) {
    return Status::InvalidArgument("tidal::nats::Config: user and password go together (one of them is empty)");
  }
  if ((!config.user.empty()) + (!config.token.empty()) + (!config.creds_file.empty()) > 1) {
    return Status::InvalidArgument(
        "tidal::nats::Config: user/password, token and creds_file are three ways to authenticate: set one");
  }
  for (const auto& [field, value] : {std::pair<const char*, const std::string*>{"user", &config.user},
                                     {"password", &config.password},
                                     {"token", &config.token}}) {
    // libnats 3.4 writes them into its CONNECT's JSON unescaped: the server
    // then refuses the connection with a JSON syntax error.
    for (char c : *value) {
      if (c == '"' || c == '\\' || static_cast<unsigned char>(c) < 0x20) {
        return Status::InvalidArgument(std::string("tidal::nats::Config::") + field +
                                       " holds a '\"', a '\\' or a control character, which the NATS C client "
                                       "(libnats 3.4) cannot send");
      }
    }
  }
  if (config.tls_cert_file.empty() != config.tls_key_file.empty()) {
    return Status::InvalidArgument(
        "tidal::nats::Config: tls_cert_file and tls_key_file go together (a client certificate and its key)");
  }
  for (const auto& [field, path] : {std::pair<const char*, const std::string*>{"creds_file", &config.creds_file},
                                    {"tls_ca_file", &config.tls_ca_file},
                                    {"tls_cert_file", &config.tls_cert_file},
                                    {"tls_key_file", &config.tls_key_file}}) {
    if (!path->empty() && ::access(path->c_str(), R_OK) != 0) {
      return Status::InvalidArgument(std::string("tidal::nats::Config::") + field + " '" + *path +
                                     "' cannot be read: " + std::strerror(errno));
    }
  }
  if (config.max_ack_pending < config.fetch_batch) {
    return Status::InvalidArgument("tidal::nats::Config::max_ack_pending (" + std::to_string(config.max_ack_pending) +
                                   ") is below fetch_batch (" + std::to_string(config.fetch_batch) +
                                   "): a fetch could never be filled");
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
  const char* ordinal = nullptr;
  if (natsMsgHeader_Get(msg, kIncarnationOrdinalHeader, &ordinal) == NATS_OK && ordinal != nullptr &&
      (!parse_u64(ordinal, &r.incarnation_ordinal) || r.incarnation.empty())) {
    return Status::Corruption(std::string("message on ") + subject + " in stream " + config.stream + " has " +
                              kIncarnationOrdinalHeader + " '" + ordinal + "'" +
                              (r.incarnation.empty() ? std::string(" without a ") + kIncarnationHeader
                                                     : ", not a decimal 64-bit number"));
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
  b.incarnation_ordinal = r->incarnation_ordinal;
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

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kCancelPoll{20};

// host and port of "nats://user:pass@host:port" (scheme, user info and port optional).
bool host_port(const std::string& url, std::string* host, std::string* port) {
  std::string rest = url;
  if (std::size_t scheme = rest.find("://"); scheme != std::string::npos) rest = rest.substr(scheme + 3);
  if (std::size_t at = rest.rfind('@'); at != std::string::npos) rest = rest.substr(at + 1);
  if (std::size_t slash = rest.find('/'); slash != std::string::npos) rest = rest.substr(0, slash);
  *port = "4222";
  if (!rest.empty() && rest.front() == '[') {  // [v6]:port
    std::size_t close = rest.find(']');
    if (close == std::string::npos) return false;
    *host = rest.substr(1, close - 1);
    if (close + 1 < rest.size() && rest[close + 1] == ':') *port = rest.substr(close + 2);
  } else if (std::size_t colon = rest.rfind(':'); colon != std::string::npos) {
    *host = rest.substr(0, colon);
    *port = rest.substr(colon + 1);
  } else {
    *host = rest;
  }
  return !host->empty() && !port->empty();
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// Waits for `events` on fd until `deadline`, in slices so `cancelled` is
// seen within kCancelPoll. "" when ready, else what happened.
std::string wait_fd(int fd, short events, Clock::time_point deadline, const std::function<bool()>& cancelled) {
  for (;;) {
    if (cancelled()) return "stopped";
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return "timed out";
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min(left, kCancelPoll).count()));
    if (r > 0) return {};
    if (r < 0 && errno != EINTR) return std::string("poll: ") + std::strerror(errno);
  }
}

// Reads up to and including "\r\n" (at most 64 KiB) before `deadline`.
std::string read_line(int fd, Clock::time_point deadline, const std::function<bool()>& cancelled, std::string* line) {
  line->clear();
  while (line->size() < (64u << 10)) {
    if (std::string w = wait_fd(fd, POLLIN, deadline, cancelled); !w.empty()) return w;
    char c;
    const ssize_t n = ::recv(fd, &c, 1, 0);
    if (n == 0) return "closed the connection";
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      return std::string("recv: ") + std::strerror(errno);
    }
    line->push_back(c);
    if (line->size() >= 2 && line->compare(line->size() - 2, 2, "\r\n") == 0) return {};
  }
  return "sent a line longer than 64 KiB";
}

// Does the NATS server at `url` answer before `deadline`? "" when it
// greeted and answered a PING (or greeted asking for TLS, which this probe
// does not speak), else what it did.
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned char>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

bool wants_tls(const Config& config) {
  return config.tls || !config.tls_ca_file.empty() || !config.tls_cert_file.empty() ||
         config.servers.find("tls://") != std::string::npos;
}

std::string probe(const std::string& url, const Config& config, Clock::time_point deadline,
                  const std::function<bool()>& cancelled) {
  std::string host, port;
  if (!host_port(url, &host, &port)) return "not a server URL";
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (int e = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found); e != 0) {
    return std::string("cannot resolve: ") + ::gai_strerror(e);
  }
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> addrs(found, ::freeaddrinfo);
  std::string why = "no address";
  for (addrinfo* ai = addrs.get(); ai != nullptr; ai = ai->ai_next) {
    Fd sock{::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol)};
    if (sock.fd < 0) {
      why = std::string("socket: ") + std::strerror(errno);
      continue;
    }
    if (::connect(sock.fd, ai->ai_addr, ai->ai_addrlen) != 0 && errno != EINPROGRESS) {
      why = std::string("connect: ") + std::strerror(errno);
      continue;
    }
    if (std::string w = wait_fd(sock.fd, POLLOUT, deadline, cancelled); !w.empty()) return "TCP connect " + w;
    int err = 0;
    socklen_t len = sizeof(err);
    if (::getsockopt(sock.fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) {
      why = std::string("connect: ") + std::strerror(err);
      continue;
    }
    std::string line;
    if (std::string w = read_line(sock.fd, deadline, cancelled, &line); !w.empty()) {
      return "accepted the connection, then sent no greeting: " + w;
    }
    if (line.rfind("INFO ", 0) != 0) return "greeted with something other than NATS INFO";
    // The probe speaks neither TLS nor the signed nonce of a creds file,
    // and never sends credentials in clear to a TLS setup: a greeting is
    // all it can check there.
    if (line.find("\"tls_required\":true") != std::string::npos || wants_tls(config) ||
        !config.creds_file.empty()) {
      return {};
    }
    std::string hello = "CONNECT {\"verbose\":false,\"pedantic\":false,\"protocol\":1,\"name\":\"tidal-probe\"";
    if (!config.user.empty()) hello += ",\"user\":" + json_string(config.user) + ",\"pass\":" + json_string(config.password);
    if (!config.token.empty()) hello += ",\"auth_token\":" + json_string(config.token);
    hello += "}\r\nPING\r\n";
    if (::send(sock.fd, hello.data(), hello.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(hello.size())) {
      return "greeted, then the probe's CONNECT could not be sent";
    }
    // Any answer (PONG, or -ERR for a server that wants credentials) shows
    // a server at work; the client's connect reports the real outcome.
    if (std::string w = read_line(sock.fd, deadline, cancelled, &line); !w.empty()) {
      return "greeted, then did not answer a PING: " + w;
    }
    return {};
  }
  return why;
}

// The NATS client's connect, on a thread of its own so that it can be
// abandoned: when the caller gives up, the thread frees whatever the
// client returns, whenever it returns.
struct Attempt {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;       // guarded by mu
  bool abandoned = false;  // guarded by mu
  natsConnection* nc = nullptr;
  natsStatus status = NATS_OK;
  std::string error;
};

}  // namespace

Status Connection::connect(const Config& config, const std::string& client_name,
                           const std::function<bool()>& cancelled) {
  server_ = config.servers;
  const auto deadline = Clock::now() + config.request_timeout;
  std::vector<std::string> urls = split_servers(config.servers);
  {
    thread_local std::mt19937 rng{std::random_device{}()};
    std::shuffle(urls.begin(), urls.end(), rng);  // spread the clients over the servers
  }
  std::string url, tried;
  for (std::size_t i = 0; i < urls.size() && url.empty(); ++i) {
    const auto share = (deadline - Clock::now()) / static_cast<int>(urls.size() - i);
    std::string why = probe(urls[i], config, Clock::now() + share, cancelled);
    if (cancelled()) return Status::IOError("cannot connect to NATS at " + config.servers + ": stopped");
    if (why.empty()) {
      url = urls[i];
    } else {
      tried += (tried.empty() ? "" : "; ") + urls[i] + " " + why;
    }
  }
  if (url.empty()) return Status::IOError("cannot connect to NATS at " + config.servers + ": " + tried);

  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  natsOptions* opts = nullptr;
  const char* one[] = {url.c_str()};
  natsStatus s = natsOptions_Create(&opts);
  if (s == NATS_OK) s = natsOptions_SetServers(opts, one, 1);
  if (s == NATS_OK) s = natsOptions_SetTimeout(opts, std::max<std::int64_t>(left.count(), 1));
  if (s == NATS_OK) s = natsOptions_SetName(opts, client_name.c_str());
  if (s == NATS_OK) s = natsOptions_SetAllowReconnect(opts, false);
  if (s == NATS_OK) s = natsOptions_SetPingInterval(opts, 2000);
  if (s == NATS_OK) s = natsOptions_SetMaxPingsOut(opts, 3);
  if (s == NATS_OK && !config.user.empty()) {
    s = natsOptions_SetUserInfo(opts, config.user.c_str(), config.password.c_str());
  }
  if (s == NATS_OK && !config.token.empty()) s = natsOptions_SetToken(opts, config.token.c_str());
  if (s == NATS_OK && !config.creds_file.empty()) {
    s = natsOptions_SetUserCredentialsFromFiles(opts, config.creds_file.c_str(), nullptr);
  }
  if (s == NATS_OK && wants_tls(config)) s = natsOptions_SetSecure(opts, true);
  if (s == NATS_OK && !config.tls_ca_file.empty()) {
    s = natsOptions_LoadCATrustedCertificates(opts, config.tls_ca_file.c_str());
  }
  if (s == NATS_OK && !config.tls_cert_file.empty()) {
    s = natsOptions_LoadCertificatesChain(opts, config.tls_cert_file.c_str(), config.tls_key_file.c_str());
  }
  if (s != NATS_OK) {
    std::string error = nats_error(s);
    natsOptions_Destroy(opts);
    return Status::IOError("cannot connect to NATS at " + url + ": " + error);
  }
  auto attempt = std::make_shared<Attempt>();
  std::thread([attempt, opts] {
    natsConnection* nc = nullptr;
    natsStatus st = natsConnection_Connect(&nc, opts);
    std::string error = st == NATS_OK ? std::string() : nats_error(st);
    natsOptions_Destroy(opts);
    std::lock_guard<std::mutex> lock(attempt->mu);
    if (attempt->abandoned) {
      if (nc != nullptr) {
        natsConnection_Close(nc);
        natsConnection_Destroy(nc);
      }
    } else {
      attempt->nc = st == NATS_OK ? nc : nullptr;
      attempt->status = st;
      attempt->error = std::move(error);
    }
    attempt->done = true;
    attempt->cv.notify_all();
  }).detach();
  {
    std::unique_lock<std::mutex> lock(attempt->mu);
    // The client's own timeout, plus a little for its thread to return.
    const auto give_up = deadline + std::chrono::milliseconds(200);
    while (!attempt->done && !cancelled() && Clock::now() < give_up) attempt->cv.wait_for(lock, kCancelPoll);
    if (!attempt->done) {
      attempt->abandoned = true;
      return Status::IOError("cannot connect to NATS at " + url + ": " +
                             (cancelled() ? std::string("stopped") : std::string("the server answered a probe, then the "
                                                                                 "client's handshake did not finish in " +
                                                                                 std::to_string(config.request_timeout.count()) +
                                                                                 " ms (abandoned)")));
    }
    if (attempt->status != NATS_OK) {
      return Status::IOError("cannot connect to NATS at " + url + ": " + attempt->error);
    }
    nc_ = attempt->nc;
  }
  server_ = url;
  char connected_url[256] = {0};
  if (natsConnection_GetConnectedUrl(nc_, connected_url, sizeof(connected_url)) == NATS_OK && connected_url[0] != '\0') {
    server_ = connected_url;
  }
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

Fetched::~Fetched() {
  for (natsMsg* m : msgs) natsMsg_Destroy(m);
}

Pull::~Pull() {
  if (sub_ != nullptr) {
    (void)natsSubscription_Unsubscribe(sub_);
    natsSubscription_Destroy(sub_);
  }
  if (ephemeral_ && conn_.connected()) {
    (void)js_DeleteConsumer(conn_.js(), stream_.c_str(), consumer_.c_str(), nullptr, nullptr);
  }
}

std::string Pull::where() const {
  return "NATS server " + conn_.server() + ", stream " + stream_ + ", consumer " + consumer_;
}

Status Pull::open(const std::string& stream, const std::string& consumer) {
  stream_ = stream;
  consumer_ = consumer;
  next_subject_ = "$JS.API.CONSUMER.MSG.NEXT." + stream + "." + consumer;
  natsInbox* inbox = nullptr;
  natsStatus ns = natsInbox_Create(&inbox);
  if (ns == NATS_OK) {
    inbox_ = inbox;
    natsInbox_Destroy(inbox);
    ns = natsConnection_SubscribeSync(&sub_, conn_.nc(), (inbox_ + ".*").c_str());
  }
  if (ns != NATS_OK) {
    sub_ = nullptr;
    return Status::IOError(where() + ": cannot subscribe an inbox to read it: " + nats_error(ns));
  }
  return Status::OK();
}

Status Pull::open_ephemeral(const std::string& stream, const jsConsumerConfig& cc) {
  jsConsumerConfig config = cc;
  jsConsumerInfo* ci = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus ns = js_AddConsumer(&ci, conn_.js(), stream.c_str(), &config, nullptr, &jerr);
  if (ns != NATS_OK || ci == nullptr || ci->Name == nullptr) {
    if (ci != nullptr) jsConsumerInfo_Destroy(ci);
    stream_ = stream;
    return Status::IOError("NATS server " + conn_.server() + ", stream " + stream +
                           ": cannot create a consumer to read it: " + nats_error(ns));
  }
  const std::string name = ci->Name;
  jsConsumerInfo_Destroy(ci);
  ephemeral_ = true;
  return open(stream, name);
}

namespace {

// The status code of a JetStream status message ("404" no messages, "408"
// request expired, "409" ended for another reason, "100" heartbeat): a
// message with headers and no data whose Status header is set. nullptr for
// a message of the stream (the NATS client's own rule).
const char* status_of(natsMsg* m) {
  if (natsMsg_GetDataLength(m) > 0) return nullptr;
  const char* code = nullptr;
  if (natsMsgHeader_Get(m, "Status", &code) != NATS_OK || code == nullptr) return nullptr;
  return code;
}

}  // namespace

Status Pull::fetch(int batch, std::int64_t max_bytes, bool no_wait, std::chrono::milliseconds wait, Fetched* out) {
  if (sub_ == nullptr) return Status::IOError(where() + ": not open");
  const std::string reply = inbox_ + "." + std::to_string(++requests_);
  // The server's expiry a little before ours (as the NATS client does), so
  // that its answer to an unfilled request arrives before we stop waiting.
  const auto expires = wait >= std::chrono::milliseconds(20) ? wait - std::chrono::milliseconds(10) : wait;
  std::string request = "{\"batch\":" + std::to_string(batch);
  if (max_bytes > 0) request += ",\"max_bytes\":" + std::to_string(max_bytes);
  request += ",\"expires\":" + std::to_string(std::chrono::nanoseconds(expires).count());
  if (no_wait) request += ",\"no_wait\":true";
  request += "}";
  natsStatus ns = natsConnection_PublishRequest(conn_.nc(), next_subject_.c_str(), reply.c_str(), request.data(),
                                                static_cast<int>(request.size()));
  if (ns != NATS_OK) return Status::IOError(where() + ": pull request failed: " + nats_error(ns));
  const auto deadline = Clock::now() + wait;
  for (int got = 0; got < batch;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    natsMsg* m = nullptr;
    ns = natsSubscription_NextMsg(&m, sub_, left.count());
    if (ns == NATS_TIMEOUT) break;
    if (ns != NATS_OK) {
      if (got > 0) break;
      return Status::IOError(where() + ": fetch failed: " + nats_error(ns));
    }
    const char* code = status_of(m);
    if (code == nullptr) {
      out->msgs.push_back(m);
      ++got;
      continue;
    }
    // A status ends the request whose reply subject it came on; one of an
    // earlier request (which this client stopped waiting for) means nothing now.
    const char* subject = natsMsg_GetSubject(m);
    const bool mine = subject != nullptr && reply == subject;
    std::string why = code;
    const char* description = nullptr;
    if (natsMsgHeader_Get(m, "Description", &description) == NATS_OK && description != nullptr) {
      why += std::string(" ") + description;
    }
    natsMsg_Destroy(m);
    if (!mine || why.compare(0, 3, "100") == 0) continue;
    if (why.compare(0, 3, "404") == 0 || why.compare(0, 3, "408") == 0 || got > 0) break;
    return Status::IOError(where() + ": the server ended the pull request: " + why);
  }
  return Status::OK();
}

Result<std::uint64_t> Pull::num_pending() {
  jsConsumerInfo* ci = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus ns = js_GetConsumerInfo(&ci, conn_.js(), stream_.c_str(), consumer_.c_str(), nullptr, &jerr);
  if (ns != NATS_OK) return Status::IOError(where() + ": cannot read the consumer's state: " + nats_error(ns));
  const std::uint64_t pending = ci->NumPending;
  jsConsumerInfo_Destroy(ci);
  return pending;
}

natsStatus reply_to(Connection& conn, natsMsg* msg, const char* reply) {
  const char* to = natsMsg_GetReply(msg);
  if (to == nullptr || *to == '\0') return NATS_INVALID_ARG;
  return natsConnection_PublishString(conn.nc(), to, reply);
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
      // Noted before start() can return it and a stop() can follow: a
      // session cut short by stop() is not the thread's error.
      std::lock_guard<std::mutex> lock(mu_);
      if (!first_) first_ = s;
      if (!s.ok() && !stopping_) last_error_ = s;
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
    last_error_ = Status::OK();
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

Status Worker::last_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_error_;
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
