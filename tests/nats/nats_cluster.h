// A real NATS JetStream cluster on loopback for tests and the sharded
// simulation: `nodes` nats-server processes (Debian's /usr/sbin/nats-server),
// free ports, store directories in a temporary directory, one cluster.
// Every server is SIGKILLed by the destructor, and dies with the process
// that started it (PR_SET_PDEATHSIG), so none outlives a test on any exit
// path. Construct and use from the main thread: PR_SET_PDEATHSIG follows the
// thread that forked.
#ifndef TIDAL_TESTS_NATS_NATS_CLUSTER_H_
#define TIDAL_TESTS_NATS_NATS_CLUSTER_H_

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <nats/nats.h>

namespace tidal::nats::testing {

class NatsCluster {
 public:
  // Picks ports and writes the config files; starts nothing. `extra_config`
  // is appended to every server's file (e.g. an authorization or tls
  // block); `client_options` sets what a client then needs on the options
  // wait_jetstream() connects with.
  explicit NatsCluster(int nodes = 3, const std::string& extra_config = "",
                       std::function<void(natsOptions*)> client_options = {});
  ~NatsCluster();  // SIGKILLs every server, removes the directory
  NatsCluster(const NatsCluster&) = delete;
  NatsCluster& operator=(const NatsCluster&) = delete;

  // Starts every server that is not running and waits until JetStream
  // answers (a meta leader is elected). False after `timeout`.
  bool start_all(std::chrono::milliseconds timeout = std::chrono::seconds(30));
  void start(int node);                 // starts one server (no wait)
  void kill(int node);                  // SIGKILL and reap
  void kill_all();
  // SIGSTOP / SIGCONT: a server frozen with its sockets open (the kernel
  // still accepts connections on its port; nothing answers).
  void freeze(int node);
  void thaw(int node);
  bool running(int node) const { return pids_[static_cast<std::size_t>(node)] > 0; }
  // Waits until JetStream answers through `servers()`.
  bool wait_jetstream(std::chrono::milliseconds timeout);

  int size() const { return static_cast<int>(pids_.size()); }
  // "nats://127.0.0.1:P0,nats://127.0.0.1:P1,...": every node's client URL.
  std::string servers() const;
  std::string url(int node) const;
  const std::string& dir() const { return dir_; }
  std::string log_tail(int node) const;  // the last lines a server logged

 private:
  std::string dir_;
  std::vector<int> client_ports_, route_ports_, http_ports_;
  std::vector<pid_t> pids_;
  std::function<void(natsOptions*)> client_options_;
};

// Polls `done` every 20 ms until it is true or `timeout` passes.
bool eventually(const std::function<bool()>& done, std::chrono::milliseconds timeout);

}  // namespace tidal::nats::testing

#endif  // TIDAL_TESTS_NATS_NATS_CLUSTER_H_
