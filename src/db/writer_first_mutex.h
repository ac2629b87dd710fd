// A shared mutex whose exclusive waiter goes before shared lockers that come
// after it. glibc's std::shared_mutex prefers its shared holders: while their
// holds overlap, as steady purges' holds of Db::Impl::backup_mu_ do, an
// exclusive locker (a backup) would wait for ever. Here a waiting exclusive
// locker holds back new shared ones, and gets in once those already holding
// release. Meets the SharedMutex requirements used with std::unique_lock and
// std::shared_lock; not recursive (a shared holder must not lock again).
#ifndef TIDAL_DB_WRITER_FIRST_MUTEX_H_
#define TIDAL_DB_WRITER_FIRST_MUTEX_H_

#include <condition_variable>
#include <mutex>

namespace tidal {

class WriterFirstMutex {
 public:
  WriterFirstMutex() = default;
  WriterFirstMutex(const WriterFirstMutex&) = delete;
  WriterFirstMutex& operator=(const WriterFirstMutex&) = delete;

  void lock() {
    std::unique_lock<std::mutex> l(mu_);
    ++writers_waiting_;
    cv_.wait(l, [&] { return !writer_ && readers_ == 0; });
    --writers_waiting_;
    writer_ = true;
  }
  void unlock() {
    {
      std::lock_guard<std::mutex> l(mu_);
      writer_ = false;
    }
    cv_.notify_all();
  }
  void lock_shared() {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return !writer_ && writers_waiting_ == 0; });
    ++readers_;
  }
  void unlock_shared() {
    bool last;
    {
      std::lock_guard<std::mutex> l(mu_);
      last = --readers_ == 0;
    }
    if (last) cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  unsigned readers_ = 0;          // shared holders
  unsigned writers_waiting_ = 0;  // exclusive lockers waiting
  bool writer_ = false;           // held exclusively
};

}  // namespace tidal

#endif  // TIDAL_DB_WRITER_FIRST_MUTEX_H_
