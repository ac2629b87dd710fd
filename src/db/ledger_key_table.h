// The ledger keys the state store's writer holds, by user (db/state_store.h).
//
// A batch of the writer seals one record for each user it holds entries of
// (tens of thousands of users a batch at 1M users), so it looks up that many
// keys, each in a table of up to millions: with std::unordered_map each
// lookup was a walk of a bucket and a node, two or three cache misses one
// after the other, and the lookups took an eighth of the writer's time at 4M
// users (bench/README.md, "Format 4"). Here the slots are small (user and
// entry number, 16 bytes, linear probing, at most half full) and the keys are
// dense, in chunks that never move; a batch asks for a user's slot well
// before it reads it (prefetch), so the misses of a batch overlap.
//
// Not thread-safe: the writer uses it under the state store's drain lock.
#ifndef TIDAL_DB_LEDGER_KEY_TABLE_H_
#define TIDAL_DB_LEDGER_KEY_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "storage/sealed_ledger.h"
#include "storage/secret.h"

namespace tidal {

class LedgerKeyTable {
 public:
  LedgerKeyTable() = default;
  LedgerKeyTable(const LedgerKeyTable&) = delete;
  LedgerKeyTable& operator=(const LedgerKeyTable&) = delete;

  std::size_t size() const { return size_; }

  // Brings `user`'s first slot towards the cache, for a find() soon after.
  void prefetch(std::uint64_t user) const {
    if (!slots_.empty()) __builtin_prefetch(&slots_[home(user)]);
  }
  // The user's key, or null. The keys never move when others are
  // inserted: what find() and insert() return stays valid until the next
  // erase().
  const SealingKey* find(std::uint64_t user) const;
  // Stores `key` as the user's, replacing one held; returns where it is.
  const SealingKey* insert(std::uint64_t user, const SealingKey& key);
  // Forgets the user's key, if held (the last key moves into its place).
  void erase(std::uint64_t user);

 private:
  struct Slot {
    std::uint64_t user = 0;
    std::uint32_t entry = kEmpty;  // into entries_
  };
  struct Entry {
    std::uint64_t user;
    SealingKey key;
  };
  static constexpr std::uint32_t kEmpty = 0xffffffff;
  static constexpr std::size_t kChunkEntries = std::size_t{1} << 14;  // ~0.9 MiB a chunk

  std::size_t home(std::uint64_t user) const {
    // Fibonacci hashing: user ids are often dense or sequential.
    return static_cast<std::size_t>((user * 0x9e3779b97f4a7c15ULL) >> shift_);
  }
  // The slot holding `user`, or the empty slot where it would go.
  std::size_t probe(std::uint64_t user) const;
  Entry& entry(std::uint32_t n) { return chunks_[n / kChunkEntries][n % kChunkEntries]; }
  const Entry& entry(std::uint32_t n) const { return chunks_[n / kChunkEntries][n % kChunkEntries]; }
  void rehash(std::size_t slots);

  std::vector<Slot> slots_;  // a power of two, or empty
  int shift_ = 64;           // 64 - log2(slots_.size())
  std::size_t size_ = 0;
  // The keys, densely: entry n in chunks_[n / kChunkEntries]; each chunk is
  // reserved whole, so an insert never moves an entry. In pages left out of
  // core dumps and wiped when freed (storage/secret.h).
  std::vector<SecretVector<Entry>> chunks_;
};

}  // namespace tidal

#endif  // TIDAL_DB_LEDGER_KEY_TABLE_H_
