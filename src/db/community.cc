// Community memberships and the community layer: join/exit, leave, rejoin,
// status, history, and the operator reads (for_each_left, verify).
#include <algorithm>

#include "db/grace.h"
#include "db/guarded.h"
#include "db/impl.h"
#include "db/state_rebuild.h"
#include "entities/community.h"
#include "storage/keys.h"

namespace tidal {
namespace {

rocksdb::Slice slice(std::string_view s) { return {s.data(), s.size()}; }
std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

std::string be64(std::uint64_t v) {
  std::string out;
  put_u64_be(&out, v);
  return out;
}

std::string user_text(std::uint64_t user_id) { return "user " + std::to_string(user_id); }

Status annotate(const Status& s, const std::string& where) { return {s.code(), where + ": " + s.message()}; }

}  // namespace

// ---- community memberships ----

Status Db::Impl::join_community(std::uint64_t user_id, std::uint64_t community_id) {
  return change_membership(user_id, community_id, /*join=*/true);
}

Status Db::Impl::exit_community(std::uint64_t user_id, std::uint64_t community_id) {
  return change_membership(user_id, community_id, /*join=*/false);
}

// Writes the 0x01 record (and its index copy) or deletes it, then updates
// the map; a join of a member or an exit of a non-member changes nothing.
Status Db::Impl::change_membership(std::uint64_t user_id, std::uint64_t community_id, bool join) {
  const char* what = join ? "join_community" : "exit_community";
  return guarded(what, [&]() -> Status {
    std::shared_lock lifecycle(lifecycle_);
    if (Status s = check_writable(what); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(user_lock(user_id));
    bool member = false;
    communities_.find_fn(user_id, [&](const std::vector<std::uint64_t>& ids) {
      member = std::binary_search(ids.begin(), ids.end(), community_id);
    });
    if (member == join) return Status::OK();

    const std::string suffix = be64(community_id);
    rocksdb::WriteBatch batch;
    if (join) {
      storage_->put_record(&batch, EntityId(user_id), Tag::CommunityMember, suffix, "");
    } else {
      storage_->delete_record(&batch, EntityId(user_id), Tag::CommunityMember, suffix);
    }
    if (Status s = storage_->write(&batch, Storage::durable_if(options_.sync_writes),
                                   std::string(what) + "(" + user_text(user_id) + ", community " +
                                       std::to_string(community_id) + ")");
        !s.ok()) {
      return s;
    }
    if (join) {
      communities_.upsert(
          user_id,
          [&](std::vector<std::uint64_t>& ids) {
            ids.insert(std::upper_bound(ids.begin(), ids.end(), community_id), community_id);
          },
          std::vector<std::uint64_t>{community_id});
    } else {
      communities_.erase_fn(user_id, [&](std::vector<std::uint64_t>& ids) {
        ids.erase(std::lower_bound(ids.begin(), ids.end(), community_id));
        return ids.empty();
      });
    }
    return Status::OK();
  });
}

Result<std::vector<std::uint64_t>> Db::Impl::communities_of(std::uint64_t user_id) const {
  return guarded("communities_of", [&]() -> Result<std::vector<std::uint64_t>> {
    if (closed_.load(std::memory_order_acquire)) return closed_status("communities_of");
    std::vector<std::uint64_t> ids;
    communities_.find(user_id, ids);
    return ids;
  });
}

// ---- leave & rejoin ----

// One atomic WriteBatch: the 0x11 record, its index copy, the 0x12 history
// entry and the stripe's clock floor; fsynced when sync_writes.
Status Db::Impl::write_membership(std::uint64_t user_id, const CommunityMembership& m, std::uint64_t at_ns,
                                  const char* what) {
  const auto value = serialize_membership(m);
  const char history = serialize_history_status(m.status);
  rocksdb::WriteBatch batch;
  storage_->put_record(&batch, EntityId(user_id), Tag::CommunityLeave, {}, {value.data(), value.size()});
  storage_->put_record(&batch, EntityId(user_id), Tag::CommunityLeaveHistory, be64(at_ns), {&history, 1});
  put_clock_floor(&batch, user_id, at_ns);
  return storage_->write(&batch, Storage::durable_if(options_.sync_writes), std::string(what) + "(" + user_text(user_id) + ")");
}

Status Db::Impl::leave_community_layer(std::uint64_t user_id) {
  return guarded("leave_community_layer", [&]() -> Status {
    std::shared_lock lifecycle(lifecycle_);
    if (Status s = check_writable("leave_community_layer"); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(user_lock(user_id));
    CommunityMembership current{user_id, MembershipStatus::Active, std::nullopt};
    leave_status_.find(user_id, current);
    if (current.status == MembershipStatus::Left) return Status::OK();  // G7: the first left_at_ns stands

    // Close the gate, then wait out every signal that may have passed it
    // while open (G2). Only then read the clock: every contribution already
    // forwarded carries an earlier reading (G3).
    held_back_.erase(user_id);
    gate_.close(user_id);
    grace::synchronize();
    // On error (here: a clock that cannot issue a later time; below: the
    // write) the gate stays closed (G6) and the map keeps the last durable
    // state, so a retry writes again instead of reporting a no-op.
    const Result<std::uint64_t> left_at = clock_.now();
    if (!left_at.ok()) return annotate(left_at.status(), "leave_community_layer(" + user_text(user_id) + ")");
    const CommunityMembership left{user_id, MembershipStatus::Left, *left_at};
    if (Status s = write_membership(user_id, left, *left_at, "leave_community_layer"); !s.ok()) return s;
    leave_status_.insert_or_assign(user_id, left);
    leaves_.fetch_add(1, std::memory_order_relaxed);
    return Status::OK();
  });
}

Status Db::Impl::rejoin_community_layer(std::uint64_t user_id) {
  return guarded("rejoin_community_layer", [&]() -> Status {
    std::shared_lock lifecycle(lifecycle_);
    if (Status s = check_writable("rejoin_community_layer"); !s.ok()) return s;
    std::lock_guard<std::mutex> lock(user_lock(user_id));
    CommunityMembership current{user_id, MembershipStatus::Active, std::nullopt};
    leave_status_.find(user_id, current);
    // Active and ungated: nothing to do (G7). Active but gated happens only
    // after a failed leave; the rejoin is then written, as its outcome is unknown.
    if (current.status == MembershipStatus::Active && !gate_.closed_for(user_id)) return Status::OK();

    const Result<std::uint64_t> at = clock_.now();  // on error nothing is written and the gate stays closed
    if (!at.ok()) return annotate(at.status(), "rejoin_community_layer(" + user_text(user_id) + ")");
    const CommunityMembership active{user_id, MembershipStatus::Active, current.left_at_ns};
    if (Status s = write_membership(user_id, active, *at, "rejoin_community_layer"); !s.ok()) return s;
    leave_status_.insert_or_assign(user_id, active);
    gate_.open(user_id);
    rejoins_.fetch_add(1, std::memory_order_relaxed);
    return Status::OK();
  });
}

Result<CommunityMembership> Db::Impl::community_layer_status(std::uint64_t user_id) const {
  return guarded("community_layer_status", [&]() -> Result<CommunityMembership> {
    if (closed_.load(std::memory_order_acquire)) return closed_status("community_layer_status");
    CommunityMembership m{user_id, MembershipStatus::Active, std::nullopt};
    leave_status_.find(user_id, m);
    return m;
  });
}

Result<std::vector<MembershipEvent>> Db::Impl::community_layer_history(std::uint64_t user_id) const {
  return guarded("community_layer_history", [&]() -> Result<std::vector<MembershipEvent>> {
    std::shared_lock lifecycle(lifecycle_);
    if (closed_.load(std::memory_order_acquire)) return closed_status("community_layer_history");
    const std::string prefix = encode_key_prefix(EntityId(user_id), Tag::CommunityLeaveHistory);
    std::vector<MembershipEvent> events;
    auto it = storage_->iterator(storage_->users());
    for (it->Seek(slice(prefix)); it->Valid() && it->key().starts_with(slice(prefix)); it->Next()) {
      const std::string_view suffix = view(it->key()).substr(prefix.size());
      std::optional<MembershipStatus> status = deserialize_history_status(view(it->value()));
      if (suffix.size() != 8 || !status) {
        return Status::Corruption("community leave history record " + hex(view(it->key())) + " of " +
                                  user_text(user_id) + " does not decode");
      }
      events.push_back({*status, get_u64_be(suffix.data())});
    }
    if (Status s = from_rocksdb(it->status(), "history read of " + user_text(user_id)); !s.ok()) return s;
    return events;
  });
}

Result<GateActivity> Db::Impl::gate_activity(std::uint64_t user_id) const {
  return guarded("gate_activity", [&]() -> Result<GateActivity> {
    if (closed_.load(std::memory_order_acquire)) return closed_status("gate_activity");
    GateActivity a;
    held_back_.find(user_id, a);
    return a;
  });
}

Status Db::Impl::for_each_left(const std::function<bool(const CommunityMembership&)>& fn) const {
  return guarded("for_each_left", [&]() -> Status {
    std::shared_lock lifecycle(lifecycle_);
    if (closed_.load(std::memory_order_acquire)) return closed_status("for_each_left");
    bool stopped = false;
    Status s = scan_tag(*storage_, Tag::CommunityLeave,
                        [&](std::uint64_t user, std::string_view suffix, std::string_view value) -> Status {
                          if (stopped) return Status::OK();
                          std::optional<CommunityMembership> m =
                              suffix.empty() ? deserialize_membership(user, value) : std::nullopt;
                          if (!m) {
                            return Status::Corruption("community leave record (0x11) of " + user_text(user) +
                                                      " does not decode: value " + hex(value));
                          }
                          if (m->status == MembershipStatus::Left && !fn(*m)) stopped = true;
                          return Status::OK();
                        });
    return s;
  });
}

// ---- verify ----

Result<VerifyReport> Db::Impl::verify() const {
  return guarded("verify", [&]() -> Result<VerifyReport> {
    std::shared_lock lifecycle(lifecycle_);
    if (closed_.load(std::memory_order_acquire)) return closed_status("verify");
    VerifyReport report;
    auto problem = [&](std::string_view cf, std::string_view key, const std::string& what) {
      report.problems.push_back(std::string(cf) + " key " + hex(key) + ": " + what);
    };
    std::string index_version;
    Status s = storage_->get(storage_->meta(), kIndexVersionKey, &index_version);
    if (!s.ok() && s.code() != StatusCode::NotFound) return s;
    const bool indexed = s.ok();

    // Every users record decodes, and every indexed one has its index copy.
    auto it = storage_->iterator(storage_->users());
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      ++report.records_checked;
      const std::string_view k = view(it->key());
      const std::string_view v = view(it->value());
      auto key = decode_key(k);
      if (!key) {
        problem("users", k, "key shorter than 9 bytes");
        continue;
      }
      const Tag tag = static_cast<Tag>(key->tag);
      switch (tag) {
        case Tag::CommunityMember:
          if (key->suffix.size() != 8 || !v.empty()) problem("users", k, "malformed community membership record");
          break;
        case Tag::CommunityLeave:
          if (!key->suffix.empty() || !deserialize_membership(key->user_id, v)) {
            problem("users", k, "community leave record (0x11) does not decode: value " + hex(v));
          }
          break;
        case Tag::CommunityLeaveHistory:
          if (key->suffix.size() != 8 || !deserialize_history_status(v)) {
            problem("users", k, "community leave history record (0x12) does not decode: value " + hex(v));
          }
          break;
        default:
          break;  // PurgeManifest and tags this version does not know
      }
      if (indexed && is_indexed(tag)) {
        std::string copy;
        Status g = storage_->get(storage_->by_tag(), encode_index_key(EntityId(key->user_id), tag, key->suffix), &copy);
        if (g.code() == StatusCode::NotFound) {
          problem("users", k, "record missing from the by_tag index");
        } else if (!g.ok()) {
          return g;
        } else if (copy != v) {
          problem("users", k, "index copy differs: " + hex(copy) + " vs " + hex(v));
        }
      }
    }
    if (s = from_rocksdb(it->status(), "verify scan of users"); !s.ok()) return s;

    // Every index record has its users original.
    if (indexed) {
      auto ix = storage_->iterator(storage_->by_tag());
      for (ix->SeekToFirst(); ix->Valid(); ix->Next()) {
        ++report.records_checked;
        const std::string_view k = view(ix->key());
        auto key = decode_index_key(k);
        if (!key || !is_indexed(static_cast<Tag>(key->tag))) {
          problem("by_tag", k, "not a key of an indexed tag");
          continue;
        }
        std::string original;
        Status g = storage_->get(storage_->users(), encode_key(EntityId(key->user_id), static_cast<Tag>(key->tag), key->suffix), &original);
        if (g.code() == StatusCode::NotFound) {
          problem("by_tag", k, "index record without a users record");
        } else if (!g.ok()) {
          return g;
        }
      }
      if (s = from_rocksdb(ix->status(), "verify scan of by_tag"); !s.ok()) return s;
    }
    return report;
  });
}

}  // namespace tidal
