#include "storage/ledger_scan.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <iterator>
#include <map>
#include <optional>
#include <string_view>
#include <vector>

#include <rocksdb/snapshot.h>

namespace tidal {
namespace {

std::atomic<std::size_t> g_pass_cells{kLedgerPassCells};
std::atomic<std::uint64_t> g_passes{0};
std::atomic<std::size_t> g_peak_cells{0};

std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

// An encoded aggregate key held inline: a std::string of 17 bytes (past the
// short-string buffer) would cost one more allocation per cell.
using AggregateKey = std::array<char, kAggregateKeySize>;
std::string_view view(const AggregateKey& k) { return {k.data(), k.size()}; }

// Bytewise, as RocksDB orders the keys (std::array's own < compares signed chars).
struct KeyLess {
  bool operator()(const AggregateKey& a, const AggregateKey& b) const noexcept {
    return std::memcmp(a.data(), b.data(), a.size()) < 0;
  }
};
// Sums of ledger entries per aggregate, in key order.
using Totals = std::map<AggregateKey, Units, KeyLess>;

// The aggregate keys of one pass, [lo, hi); no hi is the end of the key space.
struct Range {
  std::string lo;  // empty: the start
  std::optional<AggregateKey> hi;
  bool below_hi(std::string_view key) const { return !hi || key < view(*hi); }
};

std::string describe_key(std::string_view key) {
  std::optional<AggregateCell> cell = decode_aggregate_key(key);
  return (cell ? describe(*cell) + " " : std::string()) + "(key " + hex(key) + ")";
}

// Adds `units` to the sum of `key`, a cell in [range->lo, range->hi). When
// the cell is new and `totals` is full, the largest key is dropped (the new
// one or the map's last) and range->hi lowered to it.
void add(Totals* totals, std::size_t max_cells, Range* range, const AggregateKey& key, Units units) {
  auto it = totals->find(key);
  if (it == totals->end()) {
    if (totals->size() >= max_cells) {
      auto last = std::prev(totals->end());
      if (KeyLess{}(last->first, key)) {
        range->hi = key;
        return;
      }
      range->hi = last->first;
      totals->erase(last);
    }
    it = totals->emplace(key, 0).first;
  }
  it->second += units;
}

// Step 1 of a pass: sums the ledger entries of the cells in `range`, lowering
// its hi to stay within `max_cells`. The first pass also counts the records
// and entries and reports the records that do not decode.
Status sum_ledger(const Storage& storage, const rocksdb::Snapshot* snapshot, bool first, std::size_t max_cells,
                  Range* range, Totals* totals, std::size_t* peak, LedgerCheck* out,
                  const std::function<void(std::string)>& problem) {
  auto it = storage.iterator(storage.ledger(), /*bulk=*/true, snapshot);
  std::string encoded;
  AggregateKey key;
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    if (first) ++out->ledger_records;
    std::optional<LedgerKey> k = decode_ledger_key(view(it->key()));
    std::optional<std::vector<LedgerEntry>> entries = decode_ledger_value(view(it->value()));
    if (!k || !entries) {
      if (first) {
        problem("ledger key " + hex(view(it->key())) + ": contribution ledger record (0x13) does not decode (" +
                std::to_string(it->value().size()) + "-byte value; expected a multiple of 33)");
      }
      continue;
    }
    if (first) out->ledger_entries += entries->size();
    for (const LedgerEntry& e : *entries) {
      encoded.clear();
      put_aggregate_key(&encoded, e.target, e.target_id, e.item);
      if (encoded < range->lo || !range->below_hi(encoded)) continue;
      std::memcpy(key.data(), encoded.data(), key.size());
      add(totals, max_cells, range, key, e.units);
      *peak = std::max(*peak, totals->size());
    }
  }
  return from_rocksdb(it->status(), "ledger scan of '" + storage.path() + "'");
}

void report_absent(const AggregateKey& k, Units units, const std::function<void(const AggregateMismatch&)>& fn) {
  if (units == 0) return;
  const std::string key(view(k));
  fn({key, "aggregate " + describe_key(key) + ": stored 0 (absent), ledger " + units_to_string(units) + " (1e-9 units)",
      units, Units{0}});
}

// Step 2 of a pass: walks the stored aggregates in `range` beside `totals`.
Status compare_range(const Storage& storage, const rocksdb::Snapshot* snapshot, const Range& range,
                     const Totals& totals, LedgerCheck* out, const std::function<void(const AggregateMismatch&)>& fn) {
  std::string last_key;
  auto total = totals.begin();
  auto it = storage.iterator(storage.aggregates(), /*bulk=*/true, snapshot);
  for (it->Seek(range.lo); it->Valid(); it->Next()) {
    const std::string_view key = view(it->key());
    if (!range.below_hi(key)) break;
    ++out->aggregates;
    last_key.assign(key);
    for (; total != totals.end() && view(total->first) < key; ++total) report_absent(total->first, total->second, fn);
    Units recomputed = 0;
    if (total != totals.end() && view(total->first) == key) {
      recomputed = total->second;
      ++total;
    }
    std::optional<AggregateCell> cell = decode_aggregate_key(key);
    std::optional<Units> stored = decode_units(view(it->value()));
    if (!cell || !stored) {
      fn({last_key,
          "aggregate " + describe_key(key) + " does not decode (" + std::to_string(it->value().size()) +
              "-byte value; expected 16)",
          recomputed, std::nullopt});
      continue;
    }
    if (cell->kind == AggregateKind::Personal) continue;
    if (*stored != recomputed) {
      fn({last_key,
          "aggregate " + describe_key(key) + ": stored " + units_to_string(*stored) + ", ledger " +
              units_to_string(recomputed) + " (1e-9 units)",
          recomputed, stored});
    }
  }
  if (!it->status().ok()) {
    // A merge operand of the wrong length fails the iterator itself.
    return from_rocksdb(it->status(), "aggregate scan of '" + storage.path() + "' after key " +
                                          (last_key.empty() ? std::string("(none)") : describe_key(last_key)));
  }
  // What is left has no stored aggregate.
  for (; total != totals.end(); ++total) report_absent(total->first, total->second, fn);
  return Status::OK();
}

}  // namespace

std::size_t ledger_pass_cells() { return g_pass_cells.load(std::memory_order_relaxed); }

void set_ledger_pass_cells(std::size_t cells) {
  g_pass_cells.store(cells == 0 ? kLedgerPassCells : cells, std::memory_order_relaxed);
}

LedgerPassTally ledger_pass_tally() {
  return {g_passes.load(std::memory_order_relaxed), g_peak_cells.load(std::memory_order_relaxed)};
}

void reset_ledger_pass_tally() {
  g_passes.store(0, std::memory_order_relaxed);
  g_peak_cells.store(0, std::memory_order_relaxed);
}

Status check_ledger(const Storage& storage, const rocksdb::Snapshot* snapshot, LedgerCheck* out,
                    const std::function<void(std::string)>& problem,
                    const std::function<void(const AggregateMismatch&)>& mismatch, std::size_t max_cells) {
  std::optional<rocksdb::ManagedSnapshot> own;
  if (snapshot == nullptr) snapshot = own.emplace(storage.db(Storage::Engine::State)).snapshot();
  max_cells = std::max<std::size_t>(max_cells, 1);
  Range range;
  Totals totals;
  for (bool first = true;; first = false) {
    std::size_t peak = 0;
    Status s = sum_ledger(storage, snapshot, first, max_cells, &range, &totals, &peak, out, problem);
    if (s.ok()) s = compare_range(storage, snapshot, range, totals, out, mismatch);
    ++out->passes;
    g_passes.fetch_add(1, std::memory_order_relaxed);
    for (std::size_t seen = g_peak_cells.load(std::memory_order_relaxed);
         peak > seen && !g_peak_cells.compare_exchange_weak(seen, peak, std::memory_order_relaxed);) {
    }
    if (!s.ok() || !range.hi) return s;
    range.lo.assign(view(*range.hi));
    range.hi.reset();
    totals.clear();
  }
}

}  // namespace tidal
