// Db::Impl::verify: every stored record decodes, the by_tag index agrees with
// the users partition, and invariant I1 holds (docs/CONTRACT.md, S5).
#include "db/guarded.h"
#include "db/impl.h"
#include "storage/format.h"
#include "storage/index.h"
#include "storage/receipt.h"

namespace tidal {
namespace {

std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

// Collects verify()'s problems, one line each, naming the key in hex.
struct Problems {
  VerifyReport* report;
  void add(std::string_view cf, std::string_view key, const std::string& what) const {
    report->problems.push_back(std::string(cf) + " key " + hex(key) + ": " + what);
  }
  // The same, for the index checks of storage/index.h.
  IndexProblemFn fn() const {
    return [p = *this](std::string_view cf, std::string_view key, const std::string& what) { p.add(cf, key, what); };
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
    case Tag::PurgeManifest:
      if (key.suffix.size() != 8 || !decode_receipt(v)) {
        problems.add("receipts", k, "purge receipt (0x10) does not decode: value " + hex(v));
      }
      break;
    default:
      break;  // tags this version does not know
  }
}

// Every users record decodes, and (when the index is complete) every indexed
// one has its index copy. The purge receipts, in the state engine, are
// checked the same way (`receipts`: every record must be one).
Status verify_users(const Storage& storage, bool receipts, bool indexed, VerifyReport* report) {
  const Problems problems{report};
  const char* const family = receipts ? "receipts" : "users";
  auto it = storage.iterator(receipts ? storage.receipts() : storage.users());
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    ++report->records_checked;
    const std::string_view k = view(it->key());
    const std::string_view v = view(it->value());
    auto key = decode_key(k);
    if (!key) {
      problems.add(family, k, "key shorter than 9 bytes");
      continue;
    }
    if (receipts && key->tag != static_cast<std::uint8_t>(Tag::PurgeManifest)) {
      problems.add(family, k, "not a purge receipt (tag " + hex(std::string_view(k).substr(8, 1)) + ")");
      continue;
    }
    check_users_value(*key, k, v, problems);
    if (indexed && is_indexed(static_cast<Tag>(key->tag))) {
      if (Status s = check_index_copy(storage, *key, k, v, problems.fn()); !s.ok()) return s;
    }
  }
  return from_rocksdb(it->status(), std::string("verify scan of ") + family);
}

}  // namespace

// The users partition, the index against it, then invariant I1 (the state store).
Result<VerifyReport> Db::Impl::verify() const {
  return guarded("verify", [&]() -> Result<VerifyReport> {
    Call call(this, "verify", /*write=*/false);
    if (!call.status().ok()) return call.status();
    Result<bool> indexed = index_complete(*storage_);
    if (!indexed.ok()) return indexed.status();

    VerifyReport report;
    Status s = verify_users(*storage_, /*receipts=*/false, *indexed, &report);
    if (!s.ok()) return s;
    if (s = verify_users(*storage_, /*receipts=*/true, *indexed, &report); !s.ok()) return s;
    if (*indexed) {
      if (s = verify_index(*storage_, &report.records_checked, Problems{&report}.fn()); !s.ok()) return s;
    }
    if (s = state_->verify(&report); !s.ok()) return s;
    return report;
  });
}

}  // namespace tidal
