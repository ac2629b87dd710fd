// Db::Impl::verify: every stored record decodes, the by_tag index agrees with
// the users partition, and invariant I1 holds (docs/CONTRACT.md, S5).
#include "db/guarded.h"
#include "db/impl.h"
#include "storage/format.h"

namespace tidal {
namespace {

std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

}  // namespace

namespace {

// Collects verify()'s problems, one line each, naming the key in hex.
struct Problems {
  VerifyReport* report;
  void add(std::string_view cf, std::string_view key, const std::string& what) const {
    report->problems.push_back(std::string(cf) + " key " + hex(key) + ": " + what);
  }
};

// The value of a users record of a tag this version knows decodes.
void check_users_value(const DecodedKey& key, std::string_view k, std::string_view v, const Problems& problems) {
  switch (static_cast<Tag>(key.tag)) {
    case Tag::CommunityMember:
      if (key.suffix.size() != 8 || !v.empty()) problems.add("users", k, "malformed community membership record");
      break;
    case Tag::CommunityLeave:
      if (!key.suffix.empty() || !deserialize_membership(key.user_id, v)) {
        problems.add("users", k, "community leave record (0x11) does not decode: value " + hex(v));
      }
      break;
    case Tag::CommunityLeaveHistory:
      if (key.suffix.size() != 8 || !deserialize_history_status(v)) {
        problems.add("users", k, "community leave history record (0x12) does not decode: value " + hex(v));
      }
      break;
    default:
      break;  // PurgeManifest and tags this version does not know
  }
}

// The by_tag copy of an indexed users record exists and holds the same value.
Status check_index_copy(const Storage& storage, const DecodedKey& key, std::string_view k, std::string_view v,
                        const Problems& problems) {
  std::string copy;
  Status g = storage.get(storage.by_tag(), encode_index_key(EntityId(key.user_id), static_cast<Tag>(key.tag), key.suffix),
                         &copy);
  if (g.code() == StatusCode::NotFound) {
    problems.add("users", k, "record missing from the by_tag index");
  } else if (!g.ok()) {
    return g;
  } else if (copy != v) {
    problems.add("users", k, "index copy differs: " + hex(copy) + " vs " + hex(v));
  }
  return Status::OK();
}

// Every users record decodes, and (when the index is complete) every indexed
// one has its index copy.
Status verify_users(const Storage& storage, bool indexed, VerifyReport* report) {
  const Problems problems{report};
  auto it = storage.iterator(storage.users());
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    ++report->records_checked;
    const std::string_view k = view(it->key());
    const std::string_view v = view(it->value());
    auto key = decode_key(k);
    if (!key) {
      problems.add("users", k, "key shorter than 9 bytes");
      continue;
    }
    check_users_value(*key, k, v, problems);
    if (indexed && is_indexed(static_cast<Tag>(key->tag))) {
      if (Status s = check_index_copy(storage, *key, k, v, problems); !s.ok()) return s;
    }
  }
  return from_rocksdb(it->status(), "verify scan of users");
}

// Every index record is of an indexed tag and has its users original.
Status verify_index(const Storage& storage, VerifyReport* report) {
  const Problems problems{report};
  auto ix = storage.iterator(storage.by_tag());
  for (ix->SeekToFirst(); ix->Valid(); ix->Next()) {
    ++report->records_checked;
    const std::string_view k = view(ix->key());
    auto key = decode_index_key(k);
    if (!key || !is_indexed(static_cast<Tag>(key->tag))) {
      problems.add("by_tag", k, "not a key of an indexed tag");
      continue;
    }
    std::string original;
    Status g = storage.get(storage.users(), encode_key(EntityId(key->user_id), static_cast<Tag>(key->tag), key->suffix),
                           &original);
    if (g.code() == StatusCode::NotFound) {
      problems.add("by_tag", k, "index record without a users record");
    } else if (!g.ok()) {
      return g;
    }
  }
  return from_rocksdb(ix->status(), "verify scan of by_tag");
}

}  // namespace

// The users partition, the index against it, then invariant I1 (the state store).
Result<VerifyReport> Db::Impl::verify() const {
  return guarded("verify", [&]() -> Result<VerifyReport> {
    Call call(this, "verify", /*write=*/false);
    if (!call.status().ok()) return call.status();
    std::string index_version;
    Status s = storage_->get(storage_->meta(), kIndexVersionKey, &index_version);
    if (!s.ok() && s.code() != StatusCode::NotFound) return s;
    const bool indexed = s.ok();

    VerifyReport report;
    if (s = verify_users(*storage_, indexed, &report); !s.ok()) return s;
    if (indexed) {
      if (s = verify_index(*storage_, &report); !s.ok()) return s;
    }
    if (s = state_->verify(&report); !s.ok()) return s;
    return report;
  });
}

}  // namespace tidal
