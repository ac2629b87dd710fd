#include "nats_cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <nats/nats.h>

namespace tidal::nats::testing {

namespace {

constexpr const char* kServerBinary = "/usr/sbin/nats-server";

int free_port(std::set<int>* taken) {
  for (;;) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) throw std::runtime_error("socket failed");
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      ::close(fd);
      throw std::runtime_error("bind to a free port failed");
    }
    ::close(fd);
    int port = ntohs(addr.sin_port);
    if (taken->insert(port).second) return port;
  }
}

}  // namespace

NatsCluster::NatsCluster(int nodes, const std::string& extra_config, std::function<void(natsOptions*)> client_options)
    : client_options_(std::move(client_options)) {
  std::string pattern = (std::filesystem::temp_directory_path() / "tidal-nats-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  dir_ = pattern;
  std::set<int> taken;
  for (int i = 0; i < nodes; ++i) {
    client_ports_.push_back(free_port(&taken));
    route_ports_.push_back(free_port(&taken));
    http_ports_.push_back(free_port(&taken));
    pids_.push_back(0);
  }
  for (int i = 0; i < nodes; ++i) {
    std::ofstream conf(dir_ + "/n" + std::to_string(i) + ".conf");
    conf << "server_name: n" << i << "\n"
         << "listen: 127.0.0.1:" << client_ports_[static_cast<std::size_t>(i)] << "\n"
         << "http: 127.0.0.1:" << http_ports_[static_cast<std::size_t>(i)] << "\n"
         << "jetstream {\n  store_dir: \"" << dir_ << "/store" << i << "\"\n  max_memory_store: 64MB\n"
         << "  max_file_store: 8GB\n}\n";
    if (nodes > 1) {
      conf << "cluster {\n  name: tidal_test\n  listen: 127.0.0.1:" << route_ports_[static_cast<std::size_t>(i)]
           << "\n  routes: [";
      for (int j = 0; j < nodes; ++j) {
        conf << (j ? ", " : "") << "nats-route://127.0.0.1:" << route_ports_[static_cast<std::size_t>(j)];
      }
      conf << "]\n}\n";
    }
    conf << extra_config << "\n";
  }
}

NatsCluster::~NatsCluster() {
  kill_all();
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

void NatsCluster::start(int node) {
  auto n = static_cast<std::size_t>(node);
  if (pids_[n] > 0) return;
  const std::string conf = dir_ + "/n" + std::to_string(node) + ".conf";
  const std::string log = dir_ + "/n" + std::to_string(node) + ".log";
  const pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    // Dies with the thread that started it, whatever way the test ends.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      ::close(fd);
    }
    ::execl(kServerBinary, "nats-server", "-c", conf.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  pids_[n] = pid;
}

void NatsCluster::kill(int node) {
  auto n = static_cast<std::size_t>(node);
  if (pids_[n] <= 0) return;
  ::kill(pids_[n], SIGKILL);
  int status = 0;
  ::waitpid(pids_[n], &status, 0);
  pids_[n] = 0;
}

void NatsCluster::freeze(int node) {
  const std::size_t n = static_cast<std::size_t>(node);
  if (pids_[n] > 0) ::kill(pids_[n], SIGSTOP);
}

void NatsCluster::thaw(int node) {
  const std::size_t n = static_cast<std::size_t>(node);
  if (pids_[n] > 0) ::kill(pids_[n], SIGCONT);
}

void NatsCluster::kill_all() {
  for (int i = 0; i < size(); ++i) kill(i);
}

bool NatsCluster::start_all(std::chrono::milliseconds timeout) {
  for (int i = 0; i < size(); ++i) start(i);
  return wait_jetstream(timeout);
}

bool NatsCluster::wait_jetstream(std::chrono::milliseconds timeout) {
  return eventually(
      [&] {
        natsOptions* opts = nullptr;
        natsConnection* nc = nullptr;
        jsCtx* js = nullptr;
        std::vector<std::string> urls;
        for (int i = 0; i < size(); ++i) {
          if (running(i)) urls.push_back(url(i));
        }
        if (urls.empty()) return false;
        std::vector<const char*> ptrs;
        for (const auto& u : urls) ptrs.push_back(u.c_str());
        bool ok = natsOptions_Create(&opts) == NATS_OK;
        if (ok && client_options_) client_options_(opts);
        ok = ok &&
                  natsOptions_SetServers(opts, ptrs.data(), static_cast<int>(ptrs.size())) == NATS_OK &&
                  natsOptions_SetTimeout(opts, 1000) == NATS_OK && natsOptions_SetAllowReconnect(opts, false) == NATS_OK &&
                  natsConnection_Connect(&nc, opts) == NATS_OK;
        if (ok) {
          jsOptions jo;
          jsOptions_Init(&jo);
          jo.Wait = 1000;
          jsAccountInfo* ai = nullptr;
          ok = natsConnection_JetStream(&js, nc, &jo) == NATS_OK && js_GetAccountInfo(&ai, js, nullptr, nullptr) == NATS_OK;
          if (ai != nullptr) jsAccountInfo_Destroy(ai);
        }
        if (js != nullptr) jsCtx_Destroy(js);
        if (nc != nullptr) natsConnection_Destroy(nc);
        if (opts != nullptr) natsOptions_Destroy(opts);
        return ok;
      },
      timeout);
}

std::string NatsCluster::servers() const {
  std::string out;
  for (int i = 0; i < size(); ++i) out += (i ? "," : "") + url(i);
  return out;
}

std::string NatsCluster::url(int node) const {
  return "nats://127.0.0.1:" + std::to_string(client_ports_[static_cast<std::size_t>(node)]);
}

std::string NatsCluster::log_tail(int node) const {
  std::ifstream in(dir_ + "/n" + std::to_string(node) + ".log");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  std::ostringstream out;
  for (std::size_t i = lines.size() > 20 ? lines.size() - 20 : 0; i < lines.size(); ++i) out << lines[i] << "\n";
  return out.str();
}

bool eventually(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (done()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace tidal::nats::testing
