// Db::replay_journal: a recovering Db (opened from a backup, db/backup.cc)
// re-applies the privacy journal's entries written after the backup, read
// back from wherever the journal was replicated to, so that no leave,
// rejoin or purge acknowledged after the backup is forgotten
// (docs/CONTRACT.md, B3).
//
// Each entry is applied exactly as it was first made, with its original
// times, in the same atomic write as its own journal entry at its own seq
// (consecutive leaves and rejoins share one write, one fsync):
// the restored Db's journal then continues the replicated one without a gap
// or a second numbering, and an entry at or below the Db's last seq is
// already in it (a replay is idempotent).
//   - a leave: Left with the entry's left_at_ns (the exact contribution
//     boundary), the gate closed;
//   - a rejoin: Active, the boundary kept, the gate open;
//   - a purge: re-run against the restored ledger with the entry's boundary
//     and purged_at_ns (the receipt's identity), unless that receipt is in
//     the copy already; consecutive purges of distinct users as one bulk
//     purge (their intents in one write at their own seqs, one erasure).
#include <algorithm>
#include <chrono>
#include <unordered_set>

#include "db/guarded.h"
#include "db/impl.h"
#include "storage/journal_format.h"
#include "storage/receipt.h"

namespace tidal {
namespace {

// How far past this machine's clock a replayed entry's time may be: clocks
// of two machines disagree by far less.
constexpr std::uint64_t kMaxReplayAheadNs = 24ULL * 3600 * 1'000'000'000;

}  // namespace

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
    // Consecutive leaves and rejoins go in one write (one fsync) per run;
    // consecutive purges of distinct users in one bulk purge (one intents
    // write, one erasure of the ledger: 1,000 purges cost about what one
    // does, as a bulk purge's users do).
    std::vector<JournalRecord> run;
    std::vector<const std::string*> run_payloads;
    std::unordered_set<std::uint64_t> run_users;  // of a run of purges
    std::uint64_t run_first = 0;
    bool run_purges = false;
    const auto flush_run = [&]() -> Status {
      if (run.empty()) return Status::OK();
      const std::string what = "replay_journal: entries seq " + std::to_string(run_first) + ".." +
                               std::to_string(run_first + run.size() - 1) + " of shard " +
                               std::to_string(options_.shard_id);
      Status s = run_purges ? replay_purges(run, run_first, what) : replay_memberships(run, run_first, what);
      run.clear();
      run_payloads.clear();
      run_users.clear();
      return s;
    };
    const auto wall_ns = static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                         std::chrono::system_clock::now().time_since_epoch())
                                                         .count());
    for (const JournalEntry& e : entries) {
      const std::string what = "replay_journal: entry seq " + std::to_string(e.seq) + " of shard " +
                                std::to_string(e.shard_id);
      if (e.shard_id != options_.shard_id) {
        if (Status s = flush_run(); !s.ok()) return s;
        return Status::InvalidArgument(what + ": the Db at '" + storage_->path() + "' journals shard " +
                                       std::to_string(options_.shard_id) + "; nothing of it or later applied");
      }
      std::string error;
      std::optional<JournalRecord> rec = decode_journal_payload(e.payload, &error);
      if (!rec) {
        if (Status s = flush_run(); !s.ok()) return s;
        return Status::Corruption(what + ": the payload does not decode: " + error + "; nothing of it or later applied");
      }
      // A time far past this machine's clock would move the Db's clock
      // there for good (every later leave refused once it reaches 2262).
      const std::uint64_t newest = std::max(rec->at_ns, rec->left_at_ns);
      if (newest > wall_ns + kMaxReplayAheadNs) {
        if (Status s = flush_run(); !s.ok()) return s;
        return Status::InvalidArgument(what + ": its time " + std::to_string(newest) + " ns is more than a day past "
                                       "this machine's clock (" + std::to_string(wall_ns) + " ns); the Db's clock "
                                       "would follow it. Check both machines' clocks (or the stream's origin); "
                                       "nothing of it or later applied");
      }
      const std::uint64_t written = journal_->last_seq();
      const std::uint64_t last = written + run.size();
      if (e.seq <= last) {
        // In the Db already (the backup held it, or an earlier replay wrote
        // it) or in the run: it must be the same entry.
        bool differs = false;
        if (e.seq > written) {
          differs = *run_payloads[e.seq - run_first] != e.payload;
        } else {
          Result<std::vector<JournalEntry>> mine = journal_->read(e.seq - 1, 1);
          differs = mine.ok() && !mine->empty() && mine->front().seq == e.seq && mine->front().payload != e.payload;
        }
        if (differs) {
          if (Status s = flush_run(); !s.ok()) return s;
          return Status::Corruption(
              what + " differs from this Db's entry of seq " + std::to_string(e.seq) +
              ": this copy's journal diverged from the shard's after seq " + std::to_string(e.seq - 1) +
              " (a backup taken after an entry that never reached the stream, while the shard went on from an "
              "older copy; or another shard's journal). It stays recovering and serves nothing: restore a "
              "backup of the copy that went on instead (tidalctl --db NEW_PATH restore BACKUP --nats SERVERS); "
              "nothing of it or later applied");
        }
        // A purge whose intent the Db holds is not done until its mark is
        // gone: an earlier replay may have failed after the intent. It is
        // finished here, before any later entry (a rejoin after it would
        // otherwise hide it from every later open).
        if (rec->kind == JournalKind::Purge && e.seq <= written) {
          if (Status s = flush_run(); !s.ok()) return s;
          if (Status s = finish_replayed_purge(*rec, what); !s.ok()) return s;
        }
        continue;
      }
      if (e.seq != last + 1) {
        if (Status s = flush_run(); !s.ok()) return s;
        return Status::Corruption("replay_journal: gap: the Db's journal ends at seq " + std::to_string(last) +
                                  "; entry seq " + std::to_string(e.seq) + " of shard " + std::to_string(e.shard_id) +
                                  ": replay seq " + std::to_string(last + 1) + " first; nothing of it or later applied");
      }
      const bool purge = rec->kind == JournalKind::Purge;
      if (!run.empty() && (purge != run_purges || (purge && run_users.contains(rec->user_id)))) {
        if (Status s = flush_run(); !s.ok()) return s;
      }
      if (purge) {
        // Done already when the copy holds its receipt.
        std::string receipt;
        Status found = storage_->get(storage_->receipts(), encode_receipt_key(rec->user_id, rec->at_ns), &receipt);
        if (!found.ok() && found.code() != StatusCode::NotFound) return found;
        if (found.ok()) {
          if (Status s = flush_run(); !s.ok()) return s;
          if (Status s = replay_purge_done(*rec, e.seq, what); !s.ok()) return s;
          continue;
        }
        run_users.insert(rec->user_id);
      }
      if (run.empty()) {
        run_first = e.seq;
        run_purges = purge;
      }
      run.push_back(*rec);
      run_payloads.push_back(&e.payload);
    }
    if (Status s = flush_run(); !s.ok()) return s;
    return Status::OK();
  });
}

Status Db::Impl::replay_memberships(std::span<const JournalRecord> run, std::uint64_t first_seq,
                                     const std::string& what) {
  // Every later time of this Db is above the replayed ones (G3, G5).
  std::uint64_t newest = 0;
  std::vector<std::uint64_t> users;
  std::vector<std::uint64_t> floors(user_locks_.size(), 0);
  for (const JournalRecord& rec : run) {
    newest = std::max({newest, rec.at_ns, rec.left_at_ns});
    users.push_back(rec.user_id);
    std::uint64_t& floor = floors[rec.user_id % floors.size()];
    floor = std::max(floor, rec.at_ns);
  }
  clock_.advance_past(newest);
  const auto membership = [](const JournalRecord& rec) {
    return CommunityMembership{rec.user_id,
                               rec.kind == JournalKind::Leave ? MembershipStatus::Left : MembershipStatus::Active,
                               rec.left_at_ns == 0 ? std::nullopt : std::optional<std::uint64_t>(rec.left_at_ns)};
  };
  const auto lock = lock_stripes(users, /*wait_for_purges=*/true);
  for (const JournalRecord& rec : run) {
    if (rec.kind == JournalKind::Leave) gate_.close(rec.user_id);  // before the write, as a leave closes it (G6)
  }
  // A user twice in the run: their record is put twice (the later wins),
  // each history entry once (keyed by its time).
  const Journal::Fill fill = [&](rocksdb::WriteBatch* batch, std::uint64_t) {
    for (const JournalRecord& rec : run) put_membership(batch, rec.user_id, membership(rec), rec.at_ns);
    put_clock_floors(batch, floors);
  };
  Result<std::uint64_t> written = write_journaled(fill, run, what);
  if (!written.ok()) return Status(written.status().code(), what + ": " + written.status().message());
  if (*written != first_seq + run.size() - 1) {
    return Status::Corruption(what + ": written through seq " + std::to_string(*written) +
                              " of this Db's journal (another write interleaved)");
  }
  for (const JournalRecord& rec : run) {  // in order: the last entry of a user decides their gate
    leave_status_.insert_or_assign(rec.user_id, membership(rec));
    if (rec.kind == JournalKind::Leave) {
      gate_.close(rec.user_id);
      held_back_.erase(rec.user_id);
      leaves_.fetch_add(1, std::memory_order_relaxed);
    } else {
      gate_.open(rec.user_id);
      rejoins_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  return Status::OK();
}

Status Db::Impl::replay_purge_done(const JournalRecord& rec, std::uint64_t seq, const std::string& what) {
  clock_.advance_past(std::max(rec.at_ns, rec.left_at_ns));
  std::vector<std::uint64_t> floors(user_locks_.size(), 0);
  floors[rec.user_id % floors.size()] = rec.at_ns;
  const Journal::Fill fill = [&](rocksdb::WriteBatch* batch, std::uint64_t) { put_clock_floors(batch, floors); };
  Result<std::uint64_t> written = write_journaled(fill, {&rec, 1}, what);
  if (!written.ok()) return Status(written.status().code(), what + ": " + written.status().message());
  if (*written != seq) {
    return Status::Corruption(what + ": written as seq " + std::to_string(*written) +
                              " of this Db's journal (another write interleaved)");
  }
  return Status::OK();
}

Status Db::Impl::replay_purges(std::span<const JournalRecord> run, std::uint64_t first_seq, const std::string& what) {
  std::uint64_t newest = 0;
  std::vector<std::uint64_t> users, left_at, purged_at;  // in the entries' order: the intents get their seqs
  for (const JournalRecord& rec : run) {
    newest = std::max({newest, rec.at_ns, rec.left_at_ns});
    users.push_back(rec.user_id);
    left_at.push_back(rec.left_at_ns);
    purged_at.push_back(rec.at_ns);
  }
  clock_.advance_past(newest);
  {
    const auto lock = lock_stripes(users, /*wait_for_purges=*/true);
    for (const JournalRecord& rec : run) {
      CommunityMembership m{rec.user_id, MembershipStatus::Active, std::nullopt};
      leave_status_.find(rec.user_id, m);
      if (m.status != MembershipStatus::Left || m.left_at_ns.value_or(0) != rec.left_at_ns) {
        return Status::Corruption(what + ": a purge of " + std::to_string(rec.user_id) + " with boundary " +
                                  std::to_string(rec.left_at_ns) + ", but the user is " +
                                  (m.status == MembershipStatus::Left
                                       ? "Left since " + std::to_string(m.left_at_ns.value_or(0))
                                       : std::string("Active")) +
                                  " here: the journal and the backup do not fit together; nothing of the run or "
                                  "later applied");
      }
    }
    std::uint64_t intent = 0;
    if (Status s = write_purge_intents("replay_journal", users, left_at, purged_at, &intent); !s.ok()) return s;
    if (intent != first_seq + run.size() - 1) {
      return Status::Corruption(what + ": its intents were written through seq " + std::to_string(intent) +
                                " of this Db's journal (another write interleaved)");
    }
  }
  return purge_after_intents(run, what);
}

Status Db::Impl::purge_after_intents(std::span<const JournalRecord> run, const std::string& what) {
  // In ascending user order, as a bulk purge's: its batches are written as
  // sorted files (the entries' order is the journal's, any).
  std::vector<const JournalRecord*> sorted;
  for (const JournalRecord& rec : run) sorted.push_back(&rec);
  std::sort(sorted.begin(), sorted.end(),
            [](const JournalRecord* a, const JournalRecord* b) { return a->user_id < b->user_id; });
  std::vector<std::uint64_t> users, left_at, purged_at;
  for (const JournalRecord* rec : sorted) {
    users.push_back(rec->user_id);
    left_at.push_back(rec->left_at_ns);
    purged_at.push_back(rec->at_ns);
  }
  std::vector<std::uint64_t> to_erase;
  Result<std::vector<PurgeReceipt>> done = purge_registered("replay_journal", users, left_at, purged_at, &to_erase);
  if (!done.ok()) {
    {
      std::lock_guard<std::mutex> lock(unfinished_mu_);
      unfinished_purges_.insert(users.begin(), users.end());
    }
    return Status(done.status().code(),
                  what + ": the purge failed after its intent was written (" + done.status().message() +
                      "); nothing of it or later applied: call replay_journal again (it finishes this purge first), "
                      "then finish_recovery");
  }
  (void)delete_purge_marks(users);
  return erase_purged(to_erase);
}

Status Db::Impl::finish_replayed_purge(const JournalRecord& rec, const std::string& what) {
  std::string mark;
  Status marked = storage_->get(storage_->meta(), encode_journal_purge_key(rec.user_id, rec.at_ns), &mark);
  if (marked.code() == StatusCode::NotFound) return Status::OK();  // finished
  if (!marked.ok()) return marked;
  Result<bool> pending = journaled_purge_pending(rec.user_id, rec.at_ns, rec.left_at_ns);
  if (!pending.ok()) return pending.status();
  return *pending ? purge_after_intents({&rec, 1}, what) : delete_purge_marks({rec.user_id});
}

}  // namespace tidal
