#include "inmemory_aggregates.h"

#include <cstring>
#include <utility>
#include <vector>

#include "storage/format.h"

namespace tidal {
namespace {

// Enough buckets (and bucket locks) that two threads rarely contend, without
// libcuckoo's 2^16-bucket default per map.
constexpr std::size_t kInitialCapacity = 1 << 14;

// [kind: 1][owner: 8 BE][item: 8 BE] -> the score's IEEE-754 bits, 8 bytes LE.
std::string encode_key(AggregateKind kind, AggregateKey key) {
  std::string out;
  out.reserve(17);
  out.push_back(static_cast<char>(kind));
  put_u64_be(&out, key.owner);
  put_u64_be(&out, key.item);
  return out;
}

std::string encode_value(double score) {
  std::uint64_t bits;
  std::memcpy(&bits, &score, sizeof bits);
  std::string out;
  put_u64_le(&out, bits);
  return out;
}

double decode_value(const char* p) {
  const std::uint64_t bits = get_u64_le(p);
  double score;
  std::memcpy(&score, &bits, sizeof score);
  return score;
}

}  // namespace

Aggregates::Aggregates() : personal_(kInitialCapacity), cohort_(kInitialCapacity), community_(kInitialCapacity) {}

double Aggregates::score(AggregateKind kind, AggregateKey key) const {
  Value v{0.0, 0.0};
  map(kind).find(key, v);
  return v.score;
}

Status Aggregates::restore(const Storage& storage) {
  auto it = storage.iterator(storage.aggregates(), /*bulk=*/true);
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const rocksdb::Slice k = it->key();
    const rocksdb::Slice v = it->value();
    if (k.size() != 17 || v.size() != 8 || k[0] < 1 || k[0] > 3) {
      return Status::Corruption("aggregate record " + hex({k.data(), k.size()}) + " of '" + storage.path() +
                                "' is malformed");
    }
    const double score = decode_value(v.data());
    map(static_cast<AggregateKind>(k[0])).insert_or_assign(AggregateKey{get_u64_be(k.data() + 1), get_u64_be(k.data() + 9)},
                                                           Value{score, score});
  }
  return from_rocksdb(it->status(), "aggregate restore of '" + storage.path() + "'");
}

Status Aggregates::persist(Storage& storage, rocksdb::WriteBatch* extra) {
  struct Written {
    AggregateKind kind;
    AggregateKey key;
    double score;
  };
  std::vector<Written> written;
  rocksdb::WriteBatch& batch = *extra;
  for (AggregateKind kind : {AggregateKind::Personal, AggregateKind::Cohort, AggregateKind::Community}) {
    auto locked = map(kind).lock_table();
    for (const auto& [key, value] : locked) {
      if (value.score == value.persisted) continue;  // NaN (never written) compares unequal
      batch.Put(storage.aggregates(), encode_key(kind, key), encode_value(value.score));
      written.push_back({kind, key, value.score});
    }
  }
  if (Status s = storage.write(Storage::Engine::State, &batch, Storage::WriteMode::NoWal, "aggregate flush of '" + storage.path() + "'");
      !s.ok()) {
    return s;
  }
  if (Status s = storage.flush(); !s.ok()) return s;
  // Only now is it durable: remember what was written (a signal since then
  // leaves the entry unequal, so the next persist writes it again).
  for (const Written& w : written) {
    map(w.kind).update_fn(w.key, [&w](Value& v) { v.persisted = w.score; });
  }
  return Status::OK();
}

Result<double> Aggregates::read_stored(const Storage& storage, AggregateKind kind, AggregateKey key) {
  std::string value;
  Status s = storage.get(storage.aggregates(), encode_key(kind, key), &value);
  if (s.code() == StatusCode::NotFound) return 0.0;
  if (!s.ok()) return s;
  if (value.size() != 8) return Status::Corruption("aggregate record of '" + storage.path() + "' is malformed");
  return decode_value(value.data());
}

}  // namespace tidal
