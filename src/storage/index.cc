#include "storage/index.h"

#include <rocksdb/write_batch.h>

namespace tidal {
namespace {

constexpr std::size_t kBackfillBatch = 10000;

rocksdb::Slice slice(std::string_view s) { return {s.data(), s.size()}; }
std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

Status iterator_status(const rocksdb::Iterator& it, const Storage& storage, const char* what) {
  return from_rocksdb(it.status(), std::string(what) + " of '" + storage.path() + "'");
}

}  // namespace

Result<bool> index_complete(const Storage& storage) {
  std::string version;
  Status s = storage.get(storage.meta(), kIndexVersionKey, &version);
  if (!s.ok() && s.code() != StatusCode::NotFound) return s;
  return s.ok();
}

Status ensure_index(Storage& storage) {
  if (storage.read_only()) return Status::OK();
  std::string version;
  Status s = storage.get(storage.meta(), kIndexVersionKey, &version);
  if (s.ok()) return Status::OK();
  if (s.code() != StatusCode::NotFound) return s;

  rocksdb::WriteBatch batch;
  int batches = 0;
  auto it = storage.iterator(storage.users(), /*bulk=*/true);
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    auto key = decode_key(view(it->key()));
    if (!key || !is_indexed(static_cast<Tag>(key->tag))) continue;
    batch.Put(storage.by_tag(), slice(encode_index_key(EntityId(key->user_id), static_cast<Tag>(key->tag), key->suffix)),
              it->value());
    if (static_cast<std::size_t>(batch.Count()) >= kBackfillBatch) {
      if (s = storage.write(Storage::Engine::Users, &batch, Storage::WriteMode::Async, "index backfill"); !s.ok()) return s;
      batch.Clear();
      Storage::test_step("index backfill", ++batches);
    }
  }
  if (s = iterator_status(*it, storage, "index backfill scan"); !s.ok()) return s;
  batch.Put(storage.meta(), kIndexVersionKey, kIndexVersion);
  return storage.write(Storage::Engine::Users, &batch, Storage::WriteMode::Sync, "index backfill");
}

Status scan_tag(const Storage& storage, Tag tag,
                const std::function<Status(std::uint64_t, std::string_view, std::string_view)>& fn) {
  Result<bool> complete = index_complete(storage);
  if (!complete.ok()) return complete.status();
  const bool indexed = *complete && is_indexed(tag);

  Status s;
  if (indexed) {
    const char prefix = static_cast<char>(tag);
    auto it = storage.iterator(storage.by_tag(), /*bulk=*/true);
    for (it->Seek(rocksdb::Slice(&prefix, 1)); it->Valid() && it->key()[0] == prefix; it->Next()) {
      auto key = decode_index_key(view(it->key()));
      if (!key) return Status::Corruption("index key " + hex(view(it->key())) + " is shorter than 9 bytes");
      if (s = fn(key->user_id, key->suffix, view(it->value())); !s.ok()) return s;
    }
    return iterator_status(*it, storage, "index scan");
  }
  auto it = storage.iterator(storage.users(), /*bulk=*/true);
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    auto key = decode_key(view(it->key()));
    if (!key || key->tag != static_cast<std::uint8_t>(tag)) continue;  // unknown or other tags: skipped
    if (s = fn(key->user_id, key->suffix, view(it->value())); !s.ok()) return s;
  }
  return iterator_status(*it, storage, "users scan");
}

Status check_index_copy(const Storage& storage, const DecodedKey& key, std::string_view k, std::string_view v,
                        const IndexProblemFn& problem) {
  std::string copy;
  Status g = storage.get(storage.by_tag(), encode_index_key(EntityId(key.user_id), static_cast<Tag>(key.tag), key.suffix),
                         &copy);
  if (g.code() == StatusCode::NotFound) {
    problem("users", k, "record missing from the by_tag index");
  } else if (!g.ok()) {
    return g;
  } else if (copy != v) {
    problem("users", k, "index copy differs: " + hex(copy) + " vs " + hex(v));
  }
  return Status::OK();
}

Status verify_index(const Storage& storage, std::uint64_t* records_checked, const IndexProblemFn& problem) {
  auto ix = storage.iterator(storage.by_tag());
  for (ix->SeekToFirst(); ix->Valid(); ix->Next()) {
    ++*records_checked;
    const std::string_view k = view(ix->key());
    auto key = decode_index_key(k);
    if (!key || !is_indexed(static_cast<Tag>(key->tag))) {
      problem("by_tag", k, "not a key of an indexed tag");
      continue;
    }
    std::string original;
    Status g = storage.get(storage.users(), encode_key(EntityId(key->user_id), static_cast<Tag>(key->tag), key->suffix),
                           &original);
    if (g.code() == StatusCode::NotFound) {
      problem("by_tag", k, "index record without a users record");
    } else if (!g.ok()) {
      return g;
    }
  }
  return from_rocksdb(ix->status(), "verify scan of by_tag");
}

}  // namespace tidal
