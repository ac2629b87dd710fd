#include "db/grace.h"

#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <thread>

namespace tidal::grace {
namespace {

// seq is even outside a section and odd inside; only the owner writes it.
struct alignas(64) Slot {
  std::atomic<std::uint64_t> seq{0};
  std::atomic<bool> claimed{true};
  Slot* next = nullptr;
};

std::atomic<Slot*> g_slots{nullptr};
// Set once the process is registered for expedited membarrier. A reader that
// sees false uses a fence, which is correct with either kind of writer.
std::atomic<bool> g_membarrier{false};

Slot* claim_slot() {
  for (Slot* s = g_slots.load(std::memory_order_acquire); s != nullptr; s = s->next) {
    bool expected = false;
    if (!s->claimed.load(std::memory_order_relaxed) &&
        s->claimed.compare_exchange_strong(expected, true, std::memory_order_acquire)) {
      return s;
    }
  }
  auto* s = new Slot();  // never freed: slots outlive every thread and Db
  s->next = g_slots.load(std::memory_order_relaxed);
  while (!g_slots.compare_exchange_weak(s->next, s, std::memory_order_release, std::memory_order_relaxed)) {
  }
  return s;
}

struct ThreadState {
  Slot* slot = nullptr;
  unsigned depth = 0;
  ~ThreadState() {
    if (slot != nullptr) slot->claimed.store(false, std::memory_order_release);
  }
};

thread_local ThreadState t_state;

// A full memory barrier. GCC's ThreadSanitizer rejects atomic_thread_fence;
// a seq_cst read-modify-write is a full barrier on the targets tidal builds for.
void full_fence() {
#if defined(__SANITIZE_THREAD__)
  static std::atomic<int> fence_word{0};
  fence_word.fetch_add(0, std::memory_order_seq_cst);
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}

bool register_membarrier() {
  const long supported = syscall(__NR_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
  if (supported < 0 || (supported & MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) return false;
  if (syscall(__NR_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) != 0) return false;
  g_membarrier.store(true, std::memory_order_release);
  return true;
}

}  // namespace

bool init() {
  static const bool registered = register_membarrier();
  return registered;
}

ReadSection::ReadSection() {
  ThreadState& t = t_state;
  if (t.depth++ != 0) return;
  if (t.slot == nullptr) t.slot = claim_slot();
  const std::uint64_t v = t.slot->seq.load(std::memory_order_relaxed);
  if (g_membarrier.load(std::memory_order_relaxed)) {
    t.slot->seq.store(v + 1, std::memory_order_relaxed);
    std::atomic_signal_fence(std::memory_order_seq_cst);
  } else {
    t.slot->seq.store(v + 1, std::memory_order_relaxed);
    full_fence();
  }
}

ReadSection::~ReadSection() {
  ThreadState& t = t_state;
  if (--t.depth != 0) return;
  const std::uint64_t v = t.slot->seq.load(std::memory_order_relaxed);
  t.slot->seq.store(v + 1, std::memory_order_release);
}

bool in_read_section() { return t_state.depth != 0; }

void synchronize() {
  if (init()) {
    // A full barrier on every running thread of this process: each reader's
    // slot store is visible below, or that reader sees our earlier stores.
    syscall(__NR_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0);
  } else {
    full_fence();
  }
  const Slot* own = t_state.slot;
  for (Slot* s = g_slots.load(std::memory_order_acquire); s != nullptr; s = s->next) {
    if (s == own) continue;
    const std::uint64_t v = s->seq.load(std::memory_order_acquire);
    if ((v & 1) == 0) continue;
    for (unsigned spins = 0; s->seq.load(std::memory_order_acquire) == v; ++spins) {
      if (spins > 64) std::this_thread::yield();
    }
  }
}

}  // namespace tidal::grace
