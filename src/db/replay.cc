// Db::replay_journal: a recovering Db (opened from a backup, db/backup.cc)
// re-applies the privacy journal's entries written after the backup, read
// back from wherever the journal was replicated to, so that no leave,
// rejoin or purge acknowledged after the backup is forgotten
// (docs/CONTRACT.md, B3).
//
// Each entry is applied exactly as it was first made, with its original
// times, in the same atomic write as its own journal entry at its own seq:
// the restored Db's journal then continues the replicated one without a gap
// or a second numbering, and an entry at or below the Db's last seq is
// already in it (a replay is idempotent).
//   - a leave: Left with the entry's left_at_ns (the exact contribution
//     boundary), the gate closed;
//   - a rejoin: Active, the boundary kept, the gate open;
//   - a purge: re-run against the restored ledger with the entry's boundary
//     and purged_at_ns (the receipt's identity), unless that receipt is in
//     the copy already.
#include <algorithm>

#include "db/guarded.h"
#include "db/impl.h"
#include "storage/journal_format.h"
#include "storage/receipt.h"

namespace tidal {

Status Db::Impl::replay_journal(std::span<const JournalEntry> entries) {
  return guarded("replay_journal", [&]() -> Status {
    Call call(this, "replay_journal", /*write=*/true);
    if (!call.status().ok()) return call.status();
    if (Status s = check_journal("replay_journal"); !s.ok()) return s;
    std::lock_guard<std::mutex> one(recovery_mu_);
    if (!recovering()) {
      return Status::InvalidArgument("replay_journal: the Db at '" + storage_->path() +
                                     "' is not recovering from a backup; a journal is replayed only into a Db opened "
                                     "from one (its entries would otherwise be applied twice); nothing changed");
    }
    for (const JournalEntry& e : entries) {
      const std::string what = "replay_journal: entry seq " + std::to_string(e.seq) + " of shard " +
                                std::to_string(e.shard_id);
      if (e.shard_id != options_.shard_id) {
        return Status::InvalidArgument(what + ": the Db at '" + storage_->path() + "' journals shard " +
                                       std::to_string(options_.shard_id) + "; nothing of it or later applied");
      }
      std::string error;
      std::optional<JournalRecord> rec = decode_journal_payload(e.payload, &error);
      if (!rec) return Status::Corruption(what + ": the payload does not decode: " + error + "; nothing of it or later applied");
      const std::uint64_t last = journal_->last_seq();
      if (e.seq <= last) {
        // In the Db already (the backup held it, or an earlier replay wrote
        // it). While the Db still holds it, it must be the same entry.
        Result<std::vector<JournalEntry>> mine = journal_->read(e.seq - 1, 1);
        if (mine.ok() && !mine->empty() && mine->front().seq == e.seq && mine->front().payload != e.payload) {
          return Status::Corruption(what + " differs from this Db's entry of that seq (another shard's journal, or "
                                           "a Db that diverged from the backup); nothing of it or later applied");
        }
        continue;
      }
      if (e.seq != last + 1) {
        return Status::Corruption("replay_journal: gap: the Db's journal ends at seq " + std::to_string(last) +
                                  "; entry seq " + std::to_string(e.seq) + " of shard " + std::to_string(e.shard_id) +
                                  ": replay seq " + std::to_string(last + 1) + " first; nothing of it or later applied");
      }
      if (Status s = replay_entry(*rec, e.seq, what); !s.ok()) return s;
    }
    return Status::OK();
  });
}

Status Db::Impl::replay_entry(const JournalRecord& rec, std::uint64_t seq, const std::string& what) {
  const std::uint64_t user = rec.user_id;
  // Every later time of this Db is above the replayed ones (G3, G5).
  clock_.advance_past(std::max(rec.at_ns, rec.left_at_ns));
  auto check_seq = [&](const Result<std::uint64_t>& written) -> Status {
    if (!written.ok()) return Status(written.status().code(), what + ": " + written.status().message());
    if (*written != seq) {
      return Status::Corruption(what + ": written as seq " + std::to_string(*written) +
                                " of this Db's journal (another write interleaved)");
    }
    return Status::OK();
  };
  if (rec.kind == JournalKind::Leave || rec.kind == JournalKind::Rejoin) {
    const auto lock = lock_stripes({&user, 1}, /*wait_for_purges=*/true);
    const bool leave = rec.kind == JournalKind::Leave;
    const CommunityMembership m{user, leave ? MembershipStatus::Left : MembershipStatus::Active,
                                rec.left_at_ns == 0 ? std::nullopt : std::optional<std::uint64_t>(rec.left_at_ns)};
    const Journal::Fill fill = [&](rocksdb::WriteBatch* batch, std::uint64_t) {
      put_membership(batch, user, m, rec.at_ns);
      put_clock_floor(batch, user, rec.at_ns);
    };
    if (leave) gate_.close(user);  // before the write, as a leave closes it (G6)
    if (Status s = check_seq(write_journaled(fill, {&rec, 1}, what)); !s.ok()) return s;
    leave_status_.insert_or_assign(user, m);
    if (leave) {
      held_back_.erase(user);
      leaves_.fetch_add(1, std::memory_order_relaxed);
    } else {
      gate_.open(user);
      rejoins_.fetch_add(1, std::memory_order_relaxed);
    }
    return Status::OK();
  }

  // A purge: done already when the copy holds its receipt.
  std::string receipt;
  Status found = storage_->get(storage_->receipts(), encode_receipt_key(user, rec.at_ns), &receipt);
  if (!found.ok() && found.code() != StatusCode::NotFound) return found;
  const std::vector<std::uint64_t> users{user}, left_at{rec.left_at_ns}, purged_at{rec.at_ns};
  if (found.ok()) {
    const std::vector<std::uint64_t> floors = [&] {
      std::vector<std::uint64_t> f(user_locks_.size(), 0);
      f[user % f.size()] = rec.at_ns;
      return f;
    }();
    const Journal::Fill fill = [&](rocksdb::WriteBatch* batch, std::uint64_t) { put_clock_floors(batch, floors); };
    return check_seq(write_journaled(fill, {&rec, 1}, what));
  }
  {
    const auto lock = lock_stripes(users, /*wait_for_purges=*/true);
    CommunityMembership m{user, MembershipStatus::Active, std::nullopt};
    leave_status_.find(user, m);
    if (m.status != MembershipStatus::Left || m.left_at_ns.value_or(0) != rec.left_at_ns) {
      return Status::Corruption(what + ": a purge of " + std::to_string(user) + " with boundary " +
                                std::to_string(rec.left_at_ns) + ", but the user is " +
                                (m.status == MembershipStatus::Left
                                     ? "Left since " + std::to_string(m.left_at_ns.value_or(0))
                                     : std::string("Active")) +
                                " here: the journal and the backup do not fit together; nothing of it or later applied");
    }
    std::uint64_t intent = 0;
    if (Status s = write_purge_intents("replay_journal", users, left_at, purged_at, &intent); !s.ok()) return s;
    if (intent != seq) {
      return Status::Corruption(what + ": its intent was written as seq " + std::to_string(intent) +
                                " of this Db's journal (another write interleaved)");
    }
  }
  std::vector<std::uint64_t> to_erase;
  Result<std::vector<PurgeReceipt>> done = purge_registered("replay_journal", users, left_at, purged_at, &to_erase);
  if (!done.ok()) return done.status();
  (void)delete_purge_marks(users);
  return erase_purged(to_erase);
}

}  // namespace tidal
