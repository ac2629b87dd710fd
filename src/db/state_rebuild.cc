#include "db/state_rebuild.h"

#include <algorithm>
#include <string>

#include "storage/format.h"

namespace tidal {
namespace {

constexpr std::size_t kBackfillBatch = 10000;

rocksdb::Slice slice(std::string_view s) { return {s.data(), s.size()}; }
std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

Status iterator_status(const rocksdb::Iterator& it, const Storage& storage, const char* what) {
  return from_rocksdb(it.status(), std::string(what) + " of '" + storage.path() + "'");
}

}  // namespace

Status ensure_index(Storage& storage) {
  if (storage.read_only()) return Status::OK();
  std::string version;
  Status s = storage.get(storage.meta(), kIndexVersionKey, &version);
  if (s.ok()) return Status::OK();
  if (s.code() != StatusCode::NotFound) return s;

  rocksdb::WriteBatch batch;
  auto it = storage.iterator(storage.users(), /*bulk=*/true);
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    auto key = decode_key(view(it->key()));
    if (!key || !is_indexed(static_cast<Tag>(key->tag))) continue;
    batch.Put(storage.by_tag(), slice(encode_index_key(EntityId(key->user_id), static_cast<Tag>(key->tag), key->suffix)),
              it->value());
    if (static_cast<std::size_t>(batch.Count()) >= kBackfillBatch) {
      if (s = storage.write(&batch, Storage::WriteMode::Async, "index backfill"); !s.ok()) return s;
      batch.Clear();
    }
  }
  if (s = iterator_status(*it, storage, "index backfill scan"); !s.ok()) return s;
  batch.Put(storage.meta(), kIndexVersionKey, kIndexVersion);
  return storage.write(&batch, Storage::WriteMode::Sync, "index backfill");
}

Status scan_tag(const Storage& storage, Tag tag,
                const std::function<Status(std::uint64_t, std::string_view, std::string_view)>& fn) {
  std::string version;
  Status s = storage.get(storage.meta(), kIndexVersionKey, &version);
  if (!s.ok() && s.code() != StatusCode::NotFound) return s;
  const bool indexed = s.ok() && is_indexed(tag);

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

Status rebuild_community_memberships(const Storage& storage, CommunitiesMap* communities) {
  return scan_tag(storage, Tag::CommunityMember,
                  [&](std::uint64_t user, std::string_view suffix, std::string_view) -> Status {
                    if (suffix.size() != 8) {
                      return Status::Corruption("community membership record of user " + std::to_string(user) +
                                                " has a " + std::to_string(suffix.size()) +
                                                "-byte suffix; expected an 8-byte community id");
                    }
                    const std::uint64_t community = get_u64_be(suffix.data());
                    // Records arrive in key order, so each user's list stays sorted.
                    communities->upsert(
                        user, [&](std::vector<std::uint64_t>& ids) { ids.push_back(community); },
                        std::vector<std::uint64_t>{community});
                    return Status::OK();
                  });
}

Status rebuild_community_leave_status(const Storage& storage, CorruptRecordPolicy policy, LeaveStatusMap* status,
                                      LeaveGate* gate, LeaveRebuildResult* result) {
  // Size the map and the gate once instead of growing them record by record.
  const std::uint64_t estimate = storage.estimate_keys(storage.by_tag());
  status->reserve(estimate);
  gate->reserve(estimate);
  return scan_tag(storage, Tag::CommunityLeave,
                  [&](std::uint64_t user, std::string_view suffix, std::string_view value) -> Status {
                    // A 0x11 key has no suffix: one that does is not a record of
                    // this format and must not override the user's real one.
                    std::optional<CommunityMembership> m =
                        suffix.empty() ? deserialize_membership(user, value) : std::nullopt;
                    if (!m) {
                      if (policy == CorruptRecordPolicy::Fail) {
                        return Status::Corruption("community leave record (0x11) of user " + std::to_string(user) +
                                                  " does not decode: " + (suffix.empty() ? "" : "key suffix " + hex(suffix) + ", ") +
                                                  "value " + hex(value) + " (" +
                                                  std::to_string(value.size()) +
                                                  " bytes); open with CorruptRecordPolicy::TreatAsLeft to gate the "
                                                  "user instead");
                      }
                      m = CommunityMembership{user, MembershipStatus::Left, std::nullopt};
                      ++result->corrupt_treated_as_left;
                    }
                    if (m->left_at_ns) result->max_timestamp = std::max(result->max_timestamp, *m->left_at_ns);
                    if (m->status == MembershipStatus::Left) gate->close(user);
                    status->insert_or_assign(user, *m);
                    return Status::OK();
                  });
}

}  // namespace tidal
