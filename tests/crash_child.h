// The parent's handle on a tidal_crash_child process (tests/crash_child.cc),
// which the crash and recovery tests run and SIGKILL: its stdout is a pipe
// the test reads line by line; its destructor kills and reaps it.
#ifndef TIDAL_TESTS_CRASH_CHILD_H_
#define TIDAL_TESTS_CRASH_CHILD_H_

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "test_paths.h"

extern char** environ;

namespace tidal::reliability {

// A running tidal_crash_child whose stdout is a pipe we read.
class Child {
 public:
  explicit Child(const std::vector<std::string>& args) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) std::abort();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
    std::vector<std::string> argv_store;
    argv_store.push_back(testing::paths::kCrashChild);
    argv_store.insert(argv_store.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : argv_store) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int rc = ::posix_spawn(&pid_, testing::paths::kCrashChild, &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(fds[1]);
    fd_ = fds[0];
    if (rc != 0) {
      std::cerr << "posix_spawn " << testing::paths::kCrashChild << " failed: " << rc << "\n";
      std::abort();
    }
  }
  ~Child() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      (void)wait();
    }
    if (fd_ >= 0) ::close(fd_);
  }

  // Waits up to `timeout` for complete lines; appends them to `lines`.
  // Returns false at end of file (the child is gone and its output drained).
  bool read_lines(std::chrono::steady_clock::duration timeout, std::vector<std::string>* lines) {
    pollfd p{fd_, POLLIN, 0};
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count();
    const int r = ::poll(&p, 1, static_cast<int>(ms < 0 ? 0 : ms));
    if (r <= 0) return true;
    char buf[4096];
    const ssize_t n = ::read(fd_, buf, sizeof buf);
    if (n <= 0) return false;
    pending_.append(buf, static_cast<std::size_t>(n));
    for (std::size_t nl; (nl = pending_.find('\n')) != std::string::npos;) {
      lines->push_back(pending_.substr(0, nl));
      pending_.erase(0, nl + 1);
    }
    return true;
  }
  void kill() { ::kill(pid_, SIGKILL); }
  // Reaps the child; returns its wait status.
  int wait() {
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    return status;
  }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  std::string pending_;
};

// Waits for `child` to end, failing the test on any line it printed but
// "R" (ready); returns its wait status.
inline int wait_for_kill(Child& child) {
  std::vector<std::string> lines;
  while (child.read_lines(std::chrono::milliseconds(100), &lines)) {
  }
  for (const std::string& line : lines) {
    if (line != "R") ADD_FAILURE() << "child said: " << line;
  }
  return child.wait();
}

}  // namespace tidal::reliability

#endif  // TIDAL_TESTS_CRASH_CHILD_H_
