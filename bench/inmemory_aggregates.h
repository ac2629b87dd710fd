// The personal, cohort and community aggregates: sums of signal weights per
// (owner, item), held in libcuckoo maps (exact under concurrent signals) and
// persisted to the `aggregates` column family by persist() (Db::flush and
// Db::close). A crash loses what changed since the last persist.
#ifndef TIDAL_BENCH_INMEMORY_AGGREGATES_H_
#define TIDAL_BENCH_INMEMORY_AGGREGATES_H_

#include <cstdint>
#include <string>

#include <libcuckoo/cuckoohash_map.hh>
#include <rocksdb/write_batch.h>

#include "storage/state_format.h"  // AggregateKind
#include "storage/storage.h"
#include "tidal/status.h"

namespace tidal {

// Key of an aggregate: (user | cohort | community id, item id).
struct AggregateKey {
  std::uint64_t owner;
  std::uint64_t item;
  bool operator==(const AggregateKey&) const = default;
};

class Aggregates {
 public:
  Aggregates();

  void add(AggregateKind kind, AggregateKey key, double weight) {
    map(kind).upsert(key, [weight](Value& v) { v.score += weight; }, Value{weight, kNeverPersisted});
  }
  // 0 for what was never touched.
  double score(AggregateKind kind, AggregateKey key) const;

  // Loads every stored aggregate (at open).
  Status restore(const Storage& storage);
  // Writes every aggregate changed since the last successful persist, with
  // `extra` in the same batch, then flushes the memtables. The batch skips
  // the WAL: the flush makes it durable.
  Status persist(Storage& storage, rocksdb::WriteBatch* extra);

  // Reads one aggregate straight from storage (read-only Dbs, which do not
  // load the maps).
  static Result<double> read_stored(const Storage& storage, AggregateKind kind, AggregateKey key);

 private:
  struct Value {
    double score;
    double persisted;  // the score as last written; NaN when never written
  };
  struct KeyHash {
    std::size_t operator()(const AggregateKey& k) const noexcept {
      return std::hash<std::uint64_t>()(k.owner * 0x9e3779b97f4a7c15ULL ^ k.item);
    }
  };
  using Map = libcuckoo::cuckoohash_map<AggregateKey, Value, KeyHash>;
  static constexpr double kNeverPersisted = __builtin_nan("");

  Map& map(AggregateKind kind) { return kind == AggregateKind::Personal ? personal_ : kind == AggregateKind::Cohort ? cohort_ : community_; }
  const Map& map(AggregateKind kind) const { return const_cast<Aggregates*>(this)->map(kind); }

  Map personal_, cohort_, community_;
};

}  // namespace tidal

#endif  // TIDAL_BENCH_INMEMORY_AGGREGATES_H_
