#include "db/grace.h"

#include <linux/membarrier.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

namespace tidal::grace {

void release_thread_slots(std::uint64_t token);

// One thread's presence in one Domain. Only the owner thread writes seq,
// user and depth; synchronize reads seq and user from other threads.
struct alignas(64) Domain::Slot {
  std::atomic<std::uint32_t> seq{0};   // odd inside a section (wrap-around only makes a waiter wait longer)
  std::atomic<std::uint64_t> user{0};  // the section's user, or kAnyUser
  std::atomic<std::uint64_t> owner;    // the owner's thread token; 0 when free
  unsigned depth = 0;                  // owner only: nesting of this Domain's sections
  Slot* next = nullptr;

  explicit Slot(std::uint64_t token) : owner(token) {}
};

namespace {

// Each thread's state is trivially destructible and constant-initialized:
// it is never destroyed, so sections opened from any destructor (a host
// thread_local's, a static's) find it intact. Slots are handed back by a
// pthread key destructor, which glibc runs after all C++ thread_local
// destructors of the thread (and again if one of them signals anew).
struct CacheEntry {
  std::uint64_t domain;  // a Domain id, 0 when empty; ids are never reused
  Domain::Slot* slot;    // dereferenced only on an id match, i.e. while that Domain is in use
};
constexpr int kCacheWays = 4;
struct ThreadState {
  unsigned depth;       // sections open in any Domain
  std::uint64_t token;  // 0 until the thread's first slot; never reused
  CacheEntry cache[kCacheWays];
};
static_assert(std::is_trivially_destructible_v<ThreadState>);
constinit thread_local ThreadState t_state{};

std::atomic<std::uint64_t> g_next_domain_id{1};
std::atomic<std::uint64_t> g_next_token{1};

// The live Domains; a thread that exits hands its slots back to these only.
constinit std::mutex g_registry_mu;
Domain* g_domains = nullptr;

// Set once the process is registered for expedited membarrier. A reader that
// sees false uses a fence, which is correct with either kind of writer.
std::atomic<bool> g_membarrier{false};

std::atomic<int> g_fail_membarrier_count{0};
std::atomic<int> g_fail_membarrier_error{0};
std::atomic<bool> g_fail_slot_allocation{false};

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

// Orders a section's slot stores before its gate loads: with membarrier a
// compiler barrier suffices (the writer's membarrier supplies the hardware
// fence on this thread); without it, a full fence.
void enter_fence() {
  if (g_membarrier.load(std::memory_order_relaxed)) {
    std::atomic_signal_fence(std::memory_order_seq_cst);
  } else {
    full_fence();
  }
}

bool register_membarrier() {
  const long supported = syscall(__NR_membarrier, MEMBARRIER_CMD_QUERY, 0, 0);
  if (supported < 0 || (supported & MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0) return false;
  if (syscall(__NR_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) != 0) return false;
  g_membarrier.store(true, std::memory_order_release);
  return true;
}

// The writer's half of the barrier; an IOError when membarrier fails.
Status issue_barrier() {
  if (!init()) {
    full_fence();
    return Status::OK();
  }
  int error = 0;
  if (g_fail_membarrier_count.load(std::memory_order_relaxed) > 0 &&
      g_fail_membarrier_count.fetch_sub(1, std::memory_order_relaxed) > 0) {
    error = g_fail_membarrier_error.load(std::memory_order_relaxed);
  } else if (syscall(__NR_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) != 0) {
    error = errno;
  }
  if (error == 0) return Status::OK();
  full_fence();
  return Status::IOError("grace period: membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED) failed: " +
                         std::generic_category().message(error) +
                         "; a signal that saw the gate open may still be running");
}

void on_thread_exit(void* token);

pthread_key_t thread_exit_key() {
  static const pthread_key_t key = [] {
    pthread_key_t k;
    if (pthread_key_create(&k, &on_thread_exit) != 0) throw std::bad_alloc();
    return k;
  }();
  return key;
}

// Gives the thread its token and arranges for its slots to be handed back
// at exit. Throws with the thread's state unchanged.
void register_thread(ThreadState* t) {
  const std::uint64_t token = g_next_token.fetch_add(1, std::memory_order_relaxed);
  if (pthread_setspecific(thread_exit_key(), reinterpret_cast<void*>(token)) != 0) throw std::bad_alloc();
  t->token = token;
}

void on_thread_exit(void* token) {
  release_thread_slots(reinterpret_cast<std::uintptr_t>(token));
  t_state = ThreadState{};  // a later section (another key destructor) starts afresh
}

// Waits until the section that made the slot's seq `v` has ended.
void wait_out(const Domain::Slot* s, std::uint32_t v) {
  for (unsigned spins = 0; s->seq.load(std::memory_order_acquire) == v; ++spins) {
    if (spins > 64) std::this_thread::yield();
  }
}

}  // namespace

// Hands the exiting thread's slots back to the live Domains. A slot whose
// section is still open (impossible through tidal's RAII sections) is kept.
void release_thread_slots(std::uint64_t token) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  for (Domain* d = g_domains; d != nullptr; d = d->next_) {
    for (Domain::Slot* s = d->slots_.load(std::memory_order_acquire); s != nullptr; s = s->next) {
      if (s->owner.load(std::memory_order_relaxed) == token && s->depth == 0) {
        s->owner.store(0, std::memory_order_release);  // the next owner sees our last seq
      }
    }
  }
}

bool init() {
  static const bool registered = register_membarrier();
  return registered;
}

bool in_read_section() { return t_state.depth != 0; }

// ---- Domain ----

Domain::Domain() : id_(g_next_domain_id.fetch_add(1, std::memory_order_relaxed)) {
  std::lock_guard<std::mutex> lock(g_registry_mu);
  next_ = g_domains;
  if (next_ != nullptr) next_->prev_ = this;
  g_domains = this;
}

Domain::~Domain() {
  {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    if (prev_ != nullptr) prev_->next_ = next_;
    else g_domains = next_;
    if (next_ != nullptr) next_->prev_ = prev_;
  }
  for (Slot* s = slots_.load(std::memory_order_acquire); s != nullptr;) {
    Slot* next = s->next;
    delete s;
    s = next;
  }
}

Domain::Slot* Domain::thread_slot() {
  ThreadState& t = t_state;
  int way = 1;
  while (way < kCacheWays && t.cache[way].domain != id_) ++way;
  Slot* s = nullptr;
  if (way < kCacheWays) {
    s = t.cache[way].slot;
  } else {
    // Everything that can throw comes before the first change to `t`.
    if (t.token == 0) register_thread(&t);
    for (Slot* c = slots_.load(std::memory_order_acquire); c != nullptr && s == nullptr; c = c->next) {
      if (c->owner.load(std::memory_order_relaxed) == t.token) s = c;  // evicted from the cache earlier
    }
    for (Slot* c = slots_.load(std::memory_order_acquire); c != nullptr && s == nullptr; c = c->next) {
      std::uint64_t expected = 0;
      if (c->owner.load(std::memory_order_relaxed) == 0 &&
          c->owner.compare_exchange_strong(expected, t.token, std::memory_order_acquire)) {
        s = c;  // acquire: we continue the previous owner's seq
      }
    }
    if (s == nullptr) {
      if (g_fail_slot_allocation.exchange(false, std::memory_order_relaxed)) throw std::bad_alloc();
      s = new Slot(t.token);
      s->next = slots_.load(std::memory_order_relaxed);
      while (!slots_.compare_exchange_weak(s->next, s, std::memory_order_release, std::memory_order_relaxed)) {
      }
    }
    way = kCacheWays - 1;  // evict the least recently used entry; its slot stays ours
  }
  for (; way > 0; --way) t.cache[way] = t.cache[way - 1];
  t.cache[0] = {id_, s};
  return s;
}

template <class Covers>
Status Domain::wait_for_readers(Covers covers) {
  // A full barrier on every running thread of this process (a context switch
  // is one too), at some point P of each reader: what a reader stored before
  // P is visible to our loads below, and what it loads after P sees every
  // store we made before this call (the closed gate). A reader whose gate
  // load came before P therefore shows its odd seq and its user here.
  const Status barrier = issue_barrier();
  for (Slot* s = slots_.load(std::memory_order_acquire); s != nullptr; s = s->next) {
    const std::uint32_t v = s->seq.load(std::memory_order_acquire);
    if ((v & 1) == 0) continue;
    // The user store precedes the release store of seq = v, so this load
    // sees the user of section v or a later one. A later one is stored with
    // release after section v ended, so then v's effects happen before our
    // return even though we skip it.
    if (!covers(s->user.load(std::memory_order_acquire))) continue;
    // Every seq store is a release store, so whichever later value ends the
    // wait, section v's effects (its sink calls, its aggregate updates)
    // happen before we return.
    wait_out(s, v);
  }
  return barrier;
}

Status Domain::synchronize(std::uint64_t user) {
  return wait_for_readers([user](std::uint64_t u) { return u == user || u == kAnyUser; });
}

Status Domain::synchronize(std::span<const std::uint64_t> users) {
  std::vector<std::uint64_t> sorted(users.begin(), users.end());
  std::sort(sorted.begin(), sorted.end());
  return wait_for_readers(
      [&sorted](std::uint64_t u) { return u == kAnyUser || std::binary_search(sorted.begin(), sorted.end(), u); });
}

Status Domain::synchronize_all() {
  return wait_for_readers([](std::uint64_t) { return true; });
}

// ---- ReadSection ----

ReadSection::ReadSection(Domain& domain, std::uint64_t user) {
  ThreadState& t = t_state;
  // The only step that can throw, before any state changes (a bad_alloc
  // after the depth went up would hide this thread from every later wait).
  Domain::Slot* s = t.cache[0].domain == domain.id_ ? t.cache[0].slot : domain.thread_slot();
  ++t.depth;
  slot_ = s;
  if (s->depth++ != 0) {
    // Nested (a sink callback signaling again): the slot now stands for
    // both users until the outer section ends.
    if (s->user.load(std::memory_order_relaxed) != user) {
      s->user.store(kAnyUser, std::memory_order_release);
      enter_fence();
    }
    return;
  }
  s->user.store(user, std::memory_order_release);  // after the last section's end (see wait_for_readers)
  // A release store, not a relaxed one: since C++20 only read-modify-writes
  // continue a release sequence, so a waiter that reads this odd value must
  // synchronize with this store itself to see the previous section's effects.
  s->seq.store(s->seq.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  enter_fence();  // the stores above before the gate loads that follow
}

ReadSection::~ReadSection() {
  --t_state.depth;
  Domain::Slot* s = slot_;
  if (--s->depth != 0) return;
  s->seq.store(s->seq.load(std::memory_order_relaxed) + 1, std::memory_order_release);
}

namespace testing {

void fail_membarrier(int count, int error) {
  g_fail_membarrier_error.store(error, std::memory_order_relaxed);
  g_fail_membarrier_count.store(count, std::memory_order_relaxed);
}

void fail_next_slot_allocation() { g_fail_slot_allocation.store(true, std::memory_order_relaxed); }

}  // namespace testing

}  // namespace tidal::grace
