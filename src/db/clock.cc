#include "db/clock.h"

#include <algorithm>
#include <chrono>
#include <string>

namespace tidal {
namespace {

std::uint64_t system_now() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

const std::string& limit_text() {
  static const std::string text = std::to_string(Clock::kMaxTimestamp) + " ns (2262-04-11)";
  return text;
}

}  // namespace

Clock::Clock(Source source, StoreFloor store_floor)
    : source_(source ? std::move(source) : Source(system_now)), store_floor_(std::move(store_floor)) {}

Clock::~Clock() { stop_renewing(); }

Result<std::uint64_t> Clock::now() {
  const std::uint64_t wall = source_();
  if (wall > kMaxTimestamp) {
    return Status::InvalidArgument("Db clock: the wall clock read " + std::to_string(wall) +
                                   " ns, beyond the largest time the Db issues, " + limit_text());
  }
  // A read-modify-write, so readings are totally ordered and each exceeds
  // the one before it in that order. G3 needs no more: a leave reads the
  // clock after a grace period that every earlier stamp happens-before, and
  // coherence puts a happens-before-earlier RMW first in the order.
  std::uint64_t prev = last_.load(std::memory_order_relaxed);
  std::uint64_t next;
  do {
    if (prev >= kMaxTimestamp) {
      return Status::InvalidArgument("Db clock exhausted: its last time is " + std::to_string(prev) +
                                     " ns, and it issues none beyond " + limit_text());
    }
    next = std::max(wall, prev + 1);  // prev < kMaxTimestamp < UINT64_MAX: no wrap
  } while (!last_.compare_exchange_weak(prev, next, std::memory_order_acq_rel, std::memory_order_relaxed));
  return next;
}

Result<std::uint64_t> Clock::leased_now() {
  Result<std::uint64_t> t = now();
  if (!t.ok()) return t;
  // Acquire pairs with renew's release store: a lease value seen was stored
  // before it was published. *t <= kMaxTimestamp, so the sums cannot wrap.
  const std::uint64_t lease = lease_.load(std::memory_order_acquire);
  if (*t + kRenewAhead <= lease) return t;  // the common path: one load
  if (*t <= lease) {
    // Covered already: renew early if no one else is, and never wait. A
    // failed renewal is retried by a later reading; this one stands.
    if (renewing_.load(std::memory_order_acquire)) {
      // The first reading to ask wakes the renewer; the others see it asked.
      if (!renew_wanted_.exchange(true, std::memory_order_acq_rel)) {
        std::lock_guard<std::mutex> wake(renewer_mu_);
        renewer_cv_.notify_one();
      }
      return t;
    }
    std::unique_lock<std::mutex> lock(lease_mu_, std::try_to_lock);
    if (lock.owns_lock()) (void)renew(*t);
    return t;
  }
  std::lock_guard<std::mutex> lock(lease_mu_);
  if (Status s = renew(*t); !s.ok()) return s;
  return t;
}

Status Clock::renew(std::uint64_t t) {
  const std::uint64_t lease = lease_.load(std::memory_order_relaxed);
  if (t + kRenewAhead <= lease) return Status::OK();  // renewed while we waited
  // Writers hold lease_mu_ and store only a larger value, so the stored
  // lease never goes backwards, however many threads renew at once.
  const std::uint64_t until = std::min(t + kLeaseMargin, kMaxTimestamp);
  if (until <= lease) return Status::OK();  // the lease already ends at the limit
  if (Status s = store_floor_(until); !s.ok()) return s;
  lease_.store(until, std::memory_order_release);
  renewals_.fetch_add(1, std::memory_order_relaxed);
  return Status::OK();
}

void Clock::start_renewing() {
  if (renewer_.joinable()) return;
  renewer_stop_ = false;
  renewer_ = std::thread([this] { run_renewer(); });
  renewing_.store(true, std::memory_order_release);
}

void Clock::stop_renewing() {
  if (!renewer_.joinable()) return;
  renewing_.store(false, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lock(renewer_mu_);
    renewer_stop_ = true;
  }
  renewer_cv_.notify_one();
  renewer_.join();
  renew_wanted_.store(false, std::memory_order_relaxed);
}

void Clock::run_renewer() {
  std::unique_lock<std::mutex> lock(renewer_mu_);
  for (;;) {
    renewer_cv_.wait(lock, [&] { return renewer_stop_ || renew_wanted_.load(std::memory_order_acquire); });
    if (renewer_stop_) return;
    lock.unlock();
    {
      // From the later of the wall clock and the last time issued, as a
      // reading's renewal would. A failure is retried at the next request.
      std::lock_guard<std::mutex> lease(lease_mu_);
      (void)renew(std::min(std::max(source_(), last()), kMaxTimestamp));
    }
    renew_wanted_.store(false, std::memory_order_release);
    lock.lock();
  }
}

void Clock::start_above(std::uint64_t stored) {
  last_.store(std::max(last_.load(std::memory_order_relaxed), stored), std::memory_order_release);
  lease_.store(stored, std::memory_order_release);
}

void Clock::advance_past(std::uint64_t t) {
  std::uint64_t last = last_.load(std::memory_order_acquire);
  while (last < t && !last_.compare_exchange_weak(last, t, std::memory_order_acq_rel)) {
  }
}

Status Clock::release_lease() {
  std::lock_guard<std::mutex> lock(lease_mu_);
  const std::uint64_t last = last_.load(std::memory_order_acquire);
  if (lease_.load(std::memory_order_relaxed) <= last) return Status::OK();
  if (Status s = store_floor_(last); !s.ok()) return s;
  lease_.store(last, std::memory_order_release);
  return Status::OK();
}

}  // namespace tidal
