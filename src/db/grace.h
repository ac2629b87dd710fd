// Read-side critical sections with a grace period, for the leave gate (G2).
//
// Every signal runs inside a ReadSection of its Db's Domain, tagged with the
// user it signals for. Entering costs the calling thread two stores to its
// own slot (a cache line only it writes; other threads only read it) and no
// lock; leaving costs one store. Domain::synchronize(user) returns once every
// ReadSection of that Domain which was in progress when it was called and
// may be for `user` has ended, so after
//     close the gate for user; synchronize(user);
// no signal of that user that could have seen the gate open is still running.
// A section for another user is not waited for: a leave does not wait out
// threads preempted while signaling someone else.
//
// Ordering between a reader's slot stores and its gate load, and the
// writer's gate store and its slot loads, comes from sys_membarrier
// (MEMBARRIER_CMD_PRIVATE_EXPEDITED), which runs a full barrier on every
// running thread of the process; the readers then need only a compiler
// barrier. Where membarrier is unavailable, readers use a seq_cst fence. If
// membarrier fails after registration (a seccomp filter installed later),
// synchronize reports an IOError instead of silently skipping the barrier.
//
// Slots: a thread gets one slot per Domain it enters, on first use (the only
// step that allocates; it may throw std::bad_alloc and then changes nothing).
// A Domain's slots live until the Domain does; a thread's slots go back to
// their Domains when the thread exits, after every C++ thread_local
// destructor of that thread has run (a pthread key destructor), so a host
// thread_local whose destructor signals is still covered. Domain ids are
// never reused, and a thread never touches its slot of a destroyed Domain.
#ifndef TIDAL_DB_GRACE_H_
#define TIDAL_DB_GRACE_H_

#include <atomic>
#include <cstdint>
#include <span>

#include "tidal/status.h"

namespace tidal::grace {

// A section tagged with kAnyUser (or nested sections for different users) is
// waited for by every synchronize. User id kAnyUser itself is waited for by
// every leave, which costs time, never correctness.
inline constexpr std::uint64_t kAnyUser = UINT64_MAX;

class Domain {
 public:
  Domain();
  ~Domain();  // no ReadSection of this Domain may be running
  Domain(const Domain&) = delete;
  Domain& operator=(const Domain&) = delete;

  // Waits until every ReadSection of this Domain that was in progress when
  // the call began, and that may be for `user` (or for any of `users`), has
  // ended. Must not be called inside a ReadSection (it would wait for
  // itself); callers return Busy there. A non-OK Status (IOError naming
  // membarrier) means the barrier failed: a signal that saw the gate open
  // may still be running, so the caller must fail closed.
  Status synchronize(std::uint64_t user);
  Status synchronize(std::span<const std::uint64_t> users);
  // Waits for every ReadSection of this Domain in progress at the call.
  Status synchronize_all();

  struct Slot;

 private:
  friend class ReadSection;
  friend void release_thread_slots(std::uint64_t token);

  // The calling thread's slot; claims or allocates one on first use.
  // Throws std::bad_alloc with the thread's state unchanged.
  Slot* thread_slot();
  template <class Covers>
  Status wait_for_readers(Covers covers);

  const std::uint64_t id_;
  std::atomic<Slot*> slots_{nullptr};  // append-only until ~Domain
  Domain* next_ = nullptr;             // in the registry of live Domains
  Domain* prev_ = nullptr;
};

class ReadSection {
 public:
  // May throw std::bad_alloc (the thread's first section in `domain`); the
  // thread's state is then unchanged.
  ReadSection(Domain& domain, std::uint64_t user);
  ~ReadSection();
  ReadSection(const ReadSection&) = delete;
  ReadSection& operator=(const ReadSection&) = delete;

 private:
  Domain::Slot* slot_;
};

// Registers the process for expedited membarrier (once; cheap afterwards).
// Returns whether readers may rely on it.
bool init();

// True when the calling thread is inside a ReadSection of any Domain (e.g.
// in a ContributionSink callback): a leave or close there could wait for
// itself, or for a thread waiting for it.
bool in_read_section();

// Fault injection for tests; not thread-safe with respect to each other.
namespace testing {
// Makes the next `count` membarrier calls of synchronize fail with `error`.
void fail_membarrier(int count, int error);
// Makes the next slot allocation throw std::bad_alloc.
void fail_next_slot_allocation();
}  // namespace testing

}  // namespace tidal::grace

#endif  // TIDAL_DB_GRACE_H_
