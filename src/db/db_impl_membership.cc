// Db::Impl: community memberships (join_community, exit_community,
// communities_of), the 0x01 records of the users partition.
#include <algorithm>

#include "db/guarded.h"
#include "db/impl.h"
#include "storage/format.h"

namespace tidal {
namespace {

std::string be64(std::uint64_t v) {
  std::string out;
  put_u64_be(&out, v);
  return out;
}

std::string user_text(std::uint64_t user_id) { return "user " + std::to_string(user_id); }

}  // namespace

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
    Call call(this, what, /*write=*/true);
    if (!call.status().ok()) return call.status();
    if (recovering()) return recovering_status(what);
    std::lock_guard<std::mutex> lock(user_lock(user_id));
    bool member = false;
    std::size_t count = 0;
    communities_.find_fn(user_id, [&](const std::vector<std::uint64_t>& ids) {
      member = std::binary_search(ids.begin(), ids.end(), community_id);
      count = ids.size();
    });
    if (member == join) return Status::OK();
    if (join && count >= kMaxCommunitiesPerUser) {
      return Status::InvalidArgument(std::string(what) + "(" + user_text(user_id) + ", community " +
                                     std::to_string(community_id) + "): the user is in " + std::to_string(count) +
                                     " communities, the most kMaxCommunitiesPerUser (" +
                                     std::to_string(kMaxCommunitiesPerUser) + ") allows; nothing changed");
    }

    const std::string suffix = be64(community_id);
    rocksdb::WriteBatch batch;
    if (join) {
      storage_->put_record(&batch, EntityId(user_id), Tag::CommunityMember, suffix, "");
    } else {
      storage_->delete_record(&batch, EntityId(user_id), Tag::CommunityMember, suffix);
    }
    if (Status s = storage_->write(Storage::Engine::Users, &batch, Storage::durable_if(options_.sync_writes),
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

}  // namespace tidal
