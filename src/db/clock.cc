#include "db/clock.h"

#include <algorithm>
#include <chrono>

namespace tidal {

Clock::Clock(std::function<std::uint64_t()> source) : source_(std::move(source)) {
  if (!source_) {
    source_ = [] {
      return static_cast<std::uint64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
              .count());
    };
  }
}

std::uint64_t Clock::now() {
  const std::uint64_t wall = source_();
  std::uint64_t prev = last_.load(std::memory_order_relaxed);
  std::uint64_t next;
  do {
    next = std::max(wall, prev + 1);
  } while (!last_.compare_exchange_weak(prev, next, std::memory_order_acq_rel, std::memory_order_relaxed));
  return next;
}

void Clock::raise_floor(std::uint64_t ts) {
  std::uint64_t prev = last_.load(std::memory_order_relaxed);
  while (prev < ts && !last_.compare_exchange_weak(prev, ts, std::memory_order_acq_rel, std::memory_order_relaxed)) {
  }
}

}  // namespace tidal
