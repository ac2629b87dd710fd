// The leave gate's lock-free filter: the set of users whose signals must not
// reach a shared aggregate.
//
// closed_for() is the hot-path check. With nobody gated it is one load; for
// any user it takes no lock and writes no memory: a one-hash bit filter (8
// bits per table slot, so it stays in cache) answers "not closed" for most
// users who have not left, and an open-addressing table of (user, state)
// entries, probed with atomic loads, answers exactly for the rest. Writers
// (leave, rejoin, start-up) serialize on a mutex. Entries are never removed
// (a rejoin marks the entry open), so a reader can never see a key move; a
// table that fills up is replaced by one twice its size and the old one is
// kept until the gate is destroyed (all retired tables together are smaller
// than the current one). Exact: a filter false positive costs only the table
// probe, so the libcuckoo map is never consulted on the signal path.
//
// A reader holding a retired table can miss a close made after the swap; the
// grace period that follows every close (see grace.h) waits for such readers.
#ifndef TIDAL_DB_LEAVE_GATE_H_
#define TIDAL_DB_LEAVE_GATE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace tidal {

class LeaveGate {
 public:
  LeaveGate() { table_.store(install(kInitialCapacity), std::memory_order_release); }
  LeaveGate(const LeaveGate&) = delete;
  LeaveGate& operator=(const LeaveGate&) = delete;

  // True when the user's signals must be held back.
  bool closed_for(std::uint64_t user_id) const noexcept {
    if (closed_count_.load(std::memory_order_relaxed) == 0) return false;
    const Table* t = table_.load(std::memory_order_acquire);
    const std::uint64_t h = mix(user_id);
    if (!t->may_be_closed(h)) return false;  // most users who have not left stop here
    for (std::size_t i = static_cast<std::size_t>(h) & t->mask;; i = (i + 1) & t->mask) {
      const std::uint32_t state = t->entries[i].state.load(std::memory_order_acquire);
      if (state == kEmpty) return false;
      if (t->entries[i].key.load(std::memory_order_relaxed) == user_id) return state == kClosed;
    }
  }

  // Closes the gate for the user; returns false when it already was closed.
  bool close(std::uint64_t user_id) {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = find_or_insert(user_id);
    if (e.state.load(std::memory_order_relaxed) == kClosed) return false;
    table_.load(std::memory_order_relaxed)->mark(mix(user_id));
    e.state.store(kClosed, std::memory_order_release);
    closed_count_.fetch_add(1, std::memory_order_release);
    return true;
  }

  // Opens the gate for the user; returns false when it was not closed.
  bool open(std::uint64_t user_id) {
    std::lock_guard<std::mutex> lock(mu_);
    Table* t = table_.load(std::memory_order_relaxed);
    for (std::size_t i = slot_of(user_id, t->mask);; i = (i + 1) & t->mask) {
      Entry& e = t->entries[i];
      const std::uint32_t state = e.state.load(std::memory_order_relaxed);
      if (state == kEmpty) return false;  // its filter bit stays set: bits are shared
      if (e.key.load(std::memory_order_relaxed) != user_id) continue;
      if (state != kClosed) return false;
      e.state.store(kOpen, std::memory_order_release);
      closed_count_.fetch_sub(1, std::memory_order_release);
      return true;
    }
  }

  // Makes room for `n` users without growing on the way.
  void reserve(std::size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    const Table* t = table_.load(std::memory_order_relaxed);
    std::size_t capacity = t->mask + 1;
    while (n * 10 >= capacity * 7) capacity *= 2;
    if (capacity > t->mask + 1) copy_into(t, capacity);
  }

  // Users currently gated.
  std::uint64_t closed_count() const { return closed_count_.load(std::memory_order_relaxed); }

 private:
  static constexpr std::uint32_t kEmpty = 0, kClosed = 1, kOpen = 2;
  static constexpr std::size_t kInitialCapacity = 1024;

  struct Entry {
    std::atomic<std::uint64_t> key{0};
    std::atomic<std::uint32_t> state{kEmpty};
  };
  // Entries plus a one-hash filter of 8 bits per entry slot (1 KiB per 1,024
  // slots), indexed by the hash's upper half: a clear bit proves the user
  // was not closed in this table, without touching the larger entry array.
  struct Table {
    explicit Table(std::size_t capacity)
        : mask(capacity - 1), entries(new Entry[capacity]), filter(new std::atomic<std::uint64_t>[capacity / 8]()) {}
    bool may_be_closed(std::uint64_t h) const noexcept {
      const std::uint64_t f = h >> 32;
      return (filter[(f >> 6) & (mask >> 3)].load(std::memory_order_relaxed) >> (f & 63)) & 1;
    }
    void mark(std::uint64_t h) {
      const std::uint64_t f = h >> 32;
      filter[(f >> 6) & (mask >> 3)].fetch_or(std::uint64_t{1} << (f & 63), std::memory_order_release);
    }
    std::size_t mask;
    std::unique_ptr<Entry[]> entries;
    std::unique_ptr<std::atomic<std::uint64_t>[]> filter;  // capacity / 8 words
    std::size_t used = 0;
  };

  // splitmix64 finalizer: user ids are often sequential.
  static std::uint64_t mix(std::uint64_t key) {
    key ^= key >> 30;
    key *= 0xbf58476d1ce4e5b9ULL;
    key ^= key >> 27;
    key *= 0x94d049bb133111ebULL;
    key ^= key >> 31;
    return key;
  }
  static std::size_t slot_of(std::uint64_t key, std::size_t mask) { return static_cast<std::size_t>(mix(key)) & mask; }

  Table* install(std::size_t capacity) {
    tables_.push_back(std::make_unique<Table>(capacity));
    return tables_.back().get();
  }

  // Requires mu_.
  Entry& find_or_insert(std::uint64_t user_id) {
    Table* t = table_.load(std::memory_order_relaxed);
    for (std::size_t i = slot_of(user_id, t->mask);; i = (i + 1) & t->mask) {
      Entry& e = t->entries[i];
      const std::uint32_t state = e.state.load(std::memory_order_relaxed);
      if (state != kEmpty && e.key.load(std::memory_order_relaxed) == user_id) return e;
      if (state != kEmpty) continue;
      if ((t->used + 1) * 10 > (t->mask + 1) * 7) {  // keep the load factor under 0.7
        copy_into(t, (t->mask + 1) * 2);
        return find_or_insert(user_id);
      }
      e.key.store(user_id, std::memory_order_relaxed);
      e.state.store(kOpen, std::memory_order_release);  // published; the caller sets the real state
      ++t->used;
      return e;
    }
  }

  // Requires mu_. Copies every entry into a larger table and publishes it.
  void copy_into(const Table* old, std::size_t capacity) {
    Table* bigger = install(capacity);
    for (std::size_t j = 0; j <= old->mask; ++j) {
      const std::uint32_t state = old->entries[j].state.load(std::memory_order_relaxed);
      if (state == kEmpty) continue;
      const std::uint64_t key = old->entries[j].key.load(std::memory_order_relaxed);
      std::size_t i = slot_of(key, bigger->mask);
      while (bigger->entries[i].state.load(std::memory_order_relaxed) != kEmpty) i = (i + 1) & bigger->mask;
      bigger->entries[i].key.store(key, std::memory_order_relaxed);
      bigger->entries[i].state.store(state, std::memory_order_relaxed);
      if (state == kClosed) bigger->mark(mix(key));
      ++bigger->used;
    }
    table_.store(bigger, std::memory_order_release);
  }

  std::atomic<std::uint64_t> closed_count_{0};
  std::atomic<Table*> table_{nullptr};
  std::mutex mu_;
  std::vector<std::unique_ptr<Table>> tables_;  // the current one last; retired ones kept alive
};

}  // namespace tidal

#endif  // TIDAL_DB_LEAVE_GATE_H_
