// The Db clock: wall-clock ns since the Unix epoch, made strictly increasing
// within a Db and never below a floor (every timestamp already stored or
// handed out), so a wall clock that steps back cannot reorder history (G3).
//
// Two rules make it safe at its edges:
// - It never wraps. Times stop at kMaxTimestamp: a wall-clock reading above
//   it is refused, and once the clock has reached it every request fails.
//   The caller then writes and forwards nothing (a leave keeps its gate
//   closed, G6).
// - It survives a crash. Times handed out without being stored with a
//   record (the stamps of contributions, given to the ContributionSink) are
//   covered by a lease: before leased_now() returns a time above the stored
//   floor, it stores a floor kLeaseMargin ahead. A Db reopened after a crash
//   starts above the stored floor, so above every time ever handed out, even
//   when the wall clock has stepped back.
#ifndef TIDAL_DB_CLOCK_H_
#define TIDAL_DB_CLOCK_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <thread>

#include "tidal/status.h"

namespace tidal {

class Clock {
 public:
  // The largest time the clock issues: 2^63 - 1 ns, 2262-04-11, where a
  // signed 64-bit ns count (std::chrono::system_clock, most hosts) ends.
  // Anything above it is not a wall-clock time but a bug or a corrupt value.
  static constexpr std::uint64_t kMaxTimestamp = std::numeric_limits<std::int64_t>::max();
  // How far ahead of a reading a lease renewal sets the stored floor. One
  // renewal (one floor write, fsynced when sync_writes) per margin of wall
  // time; the cost is that a reopen after a crash may start up to a margin
  // ahead of the wall clock.
  static constexpr std::uint64_t kLeaseMargin = 1'000'000'000;  // 1 s
  // A reading this close to the lease's end renews it early, by the first
  // thread to get the renewal lock (or, once start_renewing() was called, by
  // the clock's own thread); the others go on under the old lease. So, at a
  // steady rate, no caller waits for another's renewal.
  static constexpr std::uint64_t kRenewAhead = kLeaseMargin / 4;

  // Returns the wall clock in ns since the Unix epoch.
  using Source = std::function<std::uint64_t()>;
  // Stores `floor` (as durably as the Db's writes): a Db reopened after a
  // crash starts above it.
  using StoreFloor = std::function<Status(std::uint64_t floor)>;

  // An empty `source` means the system clock.
  Clock(Source source, StoreFloor store_floor);
  ~Clock();
  Clock(const Clock&) = delete;
  Clock& operator=(const Clock&) = delete;

  // A time strictly greater than every earlier one and the floor, for a
  // caller that stores it (with its record) before anyone sees it.
  // InvalidArgument naming the value when the wall clock reads above
  // kMaxTimestamp (the clock does not move) or the clock has reached it.
  Result<std::uint64_t> now();
  // now(), covered by the lease: when it returns a time, the stored floor is
  // at or above it. Also fails with store_floor's error; then no time is
  // handed out (the clock itself has moved on, which is harmless).
  Result<std::uint64_t> leased_now();

  // At open, before any reading: `stored` is the largest time stored (the
  // floor, lease included). Later readings exceed it. A stored value at or
  // above kMaxTimestamp leaves an exhausted clock: every request fails.
  void start_above(std::uint64_t stored);
  // Later readings exceed `t` (a time stored by another Db, replayed into
  // this one). Only raises the clock; the lease is renewed as usual.
  void advance_past(std::uint64_t t);
  // At a clean close, once no time will be handed out: stores last() as the
  // floor when the lease reaches beyond it, so that a reopen does not start
  // up to a margin ahead of the wall clock. The only write that lowers the
  // stored lease, and safe because nothing above last() was handed out.
  Status release_lease();

  // From here on an early renewal (a reading within kRenewAhead of the
  // lease's end) is made by a thread of the clock's own, which the reading
  // wakes: no reading waits for a floor write that its time does not need.
  // Done in line, the reading that renewed paid the write, fsync included:
  // on a busy disk one signal call in a 1M-user run took 198 ms, none of it
  // in admission or at the write buffers' bound (bench/README.md, "Three
  // runs at 1M users"). A reading past the lease still renews, and waits.
  // stop_renewing() (or the destructor) ends the thread; both are called by
  // one thread, with no reading under way for stop_renewing().
  void start_renewing();
  void stop_renewing();

  // The largest time issued (or the floor).
  std::uint64_t last() const { return last_.load(std::memory_order_acquire); }
  // Renewals that stored a floor (for tests and benchmarks).
  std::uint64_t lease_renewals() const { return renewals_.load(std::memory_order_relaxed); }

 private:
  // Stores a floor above `t` unless the lease already reaches kRenewAhead
  // beyond it. Requires lease_mu_.
  Status renew(std::uint64_t t);
  // The early renewals of start_renewing().
  void run_renewer();

  Source source_;
  StoreFloor store_floor_;
  std::atomic<std::uint64_t> last_{0};
  // The largest floor known stored. Written only under lease_mu_, so the
  // stored lease only ever grows (until release_lease); read without it.
  std::atomic<std::uint64_t> lease_{0};
  std::mutex lease_mu_;
  std::atomic<std::uint64_t> renewals_{0};

  std::atomic<bool> renewing_{false};       // start_renewing() .. stop_renewing()
  std::atomic<bool> renew_wanted_{false};  // a reading asked; cleared after the renewal
  std::mutex renewer_mu_;
  std::condition_variable renewer_cv_;
  bool renewer_stop_ = false;  // guarded by renewer_mu_
  std::thread renewer_;
};

}  // namespace tidal

#endif  // TIDAL_DB_CLOCK_H_
