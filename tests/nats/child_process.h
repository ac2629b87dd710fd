// A child process of the NATS tests (tests/nats/nats_child.cc), SIGKILLed by
// its destructor and by the death of the test process (PR_SET_PDEATHSIG).
// Its stdout is a pipe: ready() waits for the "ready" line the child
// prints once started; its stderr is the test's.
#ifndef TIDAL_TESTS_NATS_CHILD_PROCESS_H_
#define TIDAL_TESTS_NATS_CHILD_PROCESS_H_

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace tidal::nats::testing {

class Child {
 public:
  // Runs `program` with `args`; construct from the main thread
  // (PR_SET_PDEATHSIG follows the thread that forked).
  Child(const char* program, const std::vector<std::string>& args) {
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(program));
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    int out[2] = {-1, -1};
    if (::pipe2(out, O_CLOEXEC) != 0) return;
    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      ::dup2(out[1], 1);
      ::execv(program, argv.data());
      ::_exit(127);
    }
    ::close(out[1]);
    out_ = out[0];
  }
  ~Child() {
    kill();
    if (out_ >= 0) ::close(out_);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  // True once the child printed "ready" within `limit`; false when it
  // exited (or closed its stdout) first, or the time ran out.
  bool ready(std::chrono::milliseconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    while (seen_.find("ready\n") == std::string::npos) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0 || out_ < 0) return false;
      pollfd p{out_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char buf[256];
      const ssize_t n = ::read(out_, buf, sizeof buf);
      if (n <= 0) return false;  // the child closed its stdout: it exited
      seen_.append(buf, static_cast<std::size_t>(n));
    }
    return true;
  }

  // SIGKILL; false when the child had exited by itself before (it failed).
  bool kill() {
    if (pid_ <= 0) return true;
    int status = 0;
    bool alive = ::waitpid(pid_, &status, WNOHANG) == 0;
    if (alive) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
    }
    pid_ = 0;
    return alive;
  }

  // Waits (at most `limit`) for the child to end by itself: true when it
  // SIGKILLed itself.
  bool killed_itself(std::chrono::seconds limit) {
    int status = 0;
    for (auto until = std::chrono::steady_clock::now() + limit; std::chrono::steady_clock::now() < until;) {
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = 0;
        return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }

 private:
  pid_t pid_ = 0;
  int out_ = -1;
  std::string seen_;
};

}  // namespace tidal::nats::testing

#endif  // TIDAL_TESTS_NATS_CHILD_PROCESS_H_
