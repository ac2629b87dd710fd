#include "db/ledger_key_table.h"

#include <utility>

namespace tidal {

std::size_t LedgerKeyTable::probe(std::uint64_t user) const {
  const std::size_t mask = slots_.size() - 1;
  std::size_t i = home(user);
  while (slots_[i].entry != kEmpty && slots_[i].user != user) i = (i + 1) & mask;
  return i;
}

const SealingKey* LedgerKeyTable::find(std::uint64_t user) const {
  if (slots_.empty()) return nullptr;
  const Slot& slot = slots_[probe(user)];
  return slot.entry == kEmpty ? nullptr : &entry(slot.entry).key;
}

const SealingKey* LedgerKeyTable::insert(std::uint64_t user, const SealingKey& key) {
  // At most half full: a probe then reads about two slots, often in one line.
  if (2 * (size_ + 1) > slots_.size()) rehash(slots_.empty() ? 1024 : 2 * slots_.size());
  Slot& slot = slots_[probe(user)];
  if (slot.entry != kEmpty) {
    Entry& held = entry(slot.entry);
    held.key = key;
    return &held.key;
  }
  if (chunks_.empty() || chunks_.back().size() == kChunkEntries) {
    chunks_.emplace_back();
    chunks_.back().reserve(kChunkEntries);
  }
  chunks_.back().push_back(Entry{user, key});
  slot = Slot{user, static_cast<std::uint32_t>(size_)};
  ++size_;
  return &chunks_.back().back().key;
}

void LedgerKeyTable::erase(std::uint64_t user) {
  if (slots_.empty()) return;
  const std::size_t mask = slots_.size() - 1;
  std::size_t hole = probe(user);
  if (slots_[hole].entry == kEmpty) return;
  // The last entry moves into the erased one's place.
  const std::uint32_t gone = slots_[hole].entry;
  const std::uint32_t last = static_cast<std::uint32_t>(size_ - 1);
  if (gone != last) {
    Entry& moved = entry(last);
    entry(gone) = moved;
    slots_[probe(moved.user)].entry = gone;
  }
  chunks_.back().pop_back();
  if (chunks_.back().empty()) chunks_.pop_back();
  --size_;
  // Backward-shift deletion: each later slot of the run whose home is not
  // between the hole and it moves into the hole, so no probe stops early.
  slots_[hole] = Slot{};
  for (std::size_t i = (hole + 1) & mask; slots_[i].entry != kEmpty; i = (i + 1) & mask) {
    const std::size_t h = home(slots_[i].user);
    // Moves unless h lies cyclically in (hole, i].
    const bool stays = hole <= i ? (hole < h && h <= i) : (hole < h || h <= i);
    if (stays) continue;
    slots_[hole] = slots_[i];
    slots_[i] = Slot{};
    hole = i;
  }
}

void LedgerKeyTable::rehash(std::size_t slots) {
  std::vector<Slot> old = std::exchange(slots_, std::vector<Slot>(slots));
  shift_ = 64;
  for (std::size_t n = slots; n > 1; n >>= 1) --shift_;
  for (const Slot& s : old) {
    if (s.entry != kEmpty) slots_[probe(s.user)] = s;
  }
}

}  // namespace tidal
