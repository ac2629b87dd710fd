#include "storage/ledger_scan.h"

#include <cstring>

namespace tidal {
namespace {

std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

// `encoded` is kAggregateKeySize bytes.
AggregateKey inline_key(std::string_view encoded) {
  AggregateKey k;
  std::memcpy(k.data(), encoded.data(), k.size());
  return k;
}

std::string describe_key(std::string_view key) {
  std::optional<AggregateCell> cell = decode_aggregate_key(key);
  return (cell ? describe(*cell) + " " : std::string()) + "(key " + hex(key) + ")";
}

}  // namespace

Status scan_ledger(const Storage& storage, const rocksdb::Snapshot* snapshot, LedgerScan* out) {
  auto it = storage.iterator(storage.ledger(), /*bulk=*/true, snapshot);
  std::string encoded;
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    ++out->records;
    const std::string_view key = view(it->key());
    std::optional<LedgerKey> k = decode_ledger_key(key);
    std::optional<std::vector<LedgerEntry>> entries = decode_ledger_value(view(it->value()));
    if (!k || !entries) {
      out->problems.push_back("ledger key " + hex(key) + ": contribution ledger record (0x13) does not decode (" +
                              std::to_string(it->value().size()) + "-byte value; expected a multiple of 33)");
      continue;
    }
    for (const LedgerEntry& e : *entries) {
      encoded.clear();
      put_aggregate_key(&encoded, e.target, e.target_id, e.item);
      out->totals[inline_key(encoded)] += e.units;
      ++out->entries;
    }
  }
  return from_rocksdb(it->status(), "ledger scan of '" + storage.path() + "'");
}

Status compare_with_ledger(const Storage& storage, const rocksdb::Snapshot* snapshot, LedgerTotals totals,
                           std::uint64_t* checked, const std::function<void(const AggregateMismatch&)>& fn) {
  std::string last_key;
  auto it = storage.iterator(storage.aggregates(), /*bulk=*/true, snapshot);
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    ++*checked;
    const std::string key(view(it->key()));
    last_key = key;
    std::optional<AggregateCell> cell = decode_aggregate_key(key);
    std::optional<Units> stored = decode_units(view(it->value()));
    auto total = key.size() == kAggregateKeySize ? totals.find(inline_key(key)) : totals.end();
    const Units recomputed = total == totals.end() ? 0 : total->second;
    if (total != totals.end()) totals.erase(total);  // seen
    if (!cell || !stored) {
      fn({key,
          "aggregate " + describe_key(key) + " does not decode (" + std::to_string(it->value().size()) +
              "-byte value; expected 16)",
          recomputed});
      continue;
    }
    if (cell->kind == AggregateKind::Personal) continue;
    if (*stored != recomputed) {
      fn({key,
          "aggregate " + describe_key(key) + ": stored " + units_to_string(*stored) + ", ledger " +
              units_to_string(recomputed) + " (1e-9 units)",
          recomputed});
    }
  }
  if (!it->status().ok()) {
    // A merge operand of the wrong length fails the iterator itself.
    return from_rocksdb(it->status(), "aggregate scan of '" + storage.path() + "' after key " +
                                          (last_key.empty() ? std::string("(none)") : describe_key(last_key)));
  }
  // What is left has no stored aggregate.
  for (const auto& [k, units] : totals) {
    if (units == 0) continue;
    const std::string key(k.data(), k.size());
    fn({key, "aggregate " + describe_key(key) + ": stored 0 (absent), ledger " + units_to_string(units) + " (1e-9 units)",
        units});
  }
  return Status::OK();
}

}  // namespace tidal
