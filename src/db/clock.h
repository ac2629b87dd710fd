// The Db clock: wall-clock ns since the Unix epoch, made strictly increasing
// within a Db and never below a floor (the largest timestamp already stored),
// so a wall clock that steps back cannot reorder history (G3).
#ifndef TIDAL_DB_CLOCK_H_
#define TIDAL_DB_CLOCK_H_

#include <atomic>
#include <cstdint>
#include <functional>

namespace tidal {

class Clock {
 public:
  // `source` returns wall-clock ns; empty means the system clock.
  explicit Clock(std::function<std::uint64_t()> source);

  // A reading strictly greater than every earlier reading and the floor.
  std::uint64_t now();
  // Later readings will be greater than `ts`.
  void raise_floor(std::uint64_t ts);
  // The largest reading (or floor) so far.
  std::uint64_t last() const { return last_.load(std::memory_order_acquire); }

 private:
  std::function<std::uint64_t()> source_;
  std::atomic<std::uint64_t> last_{0};
};

}  // namespace tidal

#endif  // TIDAL_DB_CLOCK_H_
