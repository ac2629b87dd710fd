// Retroactive purge and re-materialization (SPEC §7).
//
// A purge of Left users runs in three steps:
//   1. inside StateStore::exclusive: the pending aggregate updates are
//      written first (a Left user's gate is closed and leave waited out every
//      signal that passed it, so none of the user's contributions is still in
//      memory afterwards and none arrives), then the user's ledger is read
//      and one synced WriteBatch holds a negative merge operand per cell the
//      user touched (the exact sum of its entries for that cell), a range
//      deletion of the ledger prefix [user BE][0x13] and the receipt (0x10).
//      Merge operands commute, so the writer's later batches (other users'
//      cells) compose with it in any order; the drain lock only keeps
//      re-materialization, which overwrites aggregates, from interleaving.
//   2. physical erasure, outside the drain lock: every memtable is flushed
//      (which also retires every WAL holding the user's ledger records or
//      the purge batch), a forced bottommost compaction of just the purged
//      key range drops the entries and the range tombstone, and the obsolete
//      WALs and SSTs are deleted before the call returns.
// The user's lock stripe is held throughout: a rejoin waits for the purge.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <thread>

#include <rocksdb/options.h>

#include "db/guarded.h"
#include "db/impl.h"
#include "storage/ledger_scan.h"
#include "storage/receipt.h"

namespace tidal {
namespace {

// Users per synced WriteBatch of a bulk purge (each user is wholly in one).
constexpr std::size_t kPurgeBatchUsers = 1'000;
// Longest erase_ledger_range waits for RocksDB to delete an obsolete WAL
// that another thread is already deleting.
constexpr int kObsoleteWalWaitMs = 5'000;

std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }
std::string user_text(std::uint64_t user_id) { return "user " + std::to_string(user_id); }

std::string ledger_begin(std::uint64_t user) { return encode_key_prefix(EntityId(user), Tag::ContributionLedger); }
// The first key after every ledger key of `user`.
std::string ledger_end(std::uint64_t user) {
  return encode_key_prefix(EntityId(user), static_cast<Tag>(static_cast<std::uint8_t>(Tag::ContributionLedger) + 1));
}

// What one user's ledger holds: the exact sum per aggregate cell.
struct UserLedger {
  std::uint64_t entries = 0;
  Units cohort = 0;
  Units community = 0;
  std::map<std::string, Units> cells;  // encoded aggregate key -> sum
};

Status read_user_ledger(const Storage& storage, std::uint64_t user, UserLedger* out) {
  const std::string prefix = ledger_begin(user);
  auto it = storage.iterator(storage.ledger());
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    std::optional<std::vector<LedgerEntry>> entries = decode_ledger_value(view(it->value()));
    if (!entries) {
      return Status::Corruption("ledger record " + hex(view(it->key())) + " of " + user_text(user) +
                                " does not decode (" + std::to_string(it->value().size()) +
                                "-byte value; expected a multiple of 33); nothing purged");
    }
    for (const LedgerEntry& e : *entries) {
      out->cells[encode_aggregate_key(e.target, e.target_id, e.item)] += e.units;
      (e.target == AggregateKind::Cohort ? out->cohort : out->community) += e.units;
      ++out->entries;
    }
  }
  return from_rocksdb(it->status(), "ledger read of " + user_text(user) + " in '" + storage.path() + "'");
}

PurgeReceipt to_public(std::uint64_t user, const ReceiptRecord& r) {
  return {user, r.left_at_ns, r.purged_at_ns, r.entries_removed, units_to_double(r.cohort_units),
          units_to_double(r.community_units)};
}

std::string status_text(MembershipStatus s) { return s == MembershipStatus::Left ? "Left" : "Active"; }

}  // namespace

Result<std::vector<PurgeReceipt>> Db::Impl::purge(const char* what, std::span<const std::uint64_t> user_ids) {
  return guarded(what, [&]() -> Result<std::vector<PurgeReceipt>> {
    Call call(this, what, /*write=*/true);
    if (!call.status().ok()) return call.status();
    std::vector<std::uint64_t> users(user_ids.begin(), user_ids.end());
    std::sort(users.begin(), users.end());
    users.erase(std::unique(users.begin(), users.end()), users.end());
    // Stripes in ascending order, as the bulk leave: no cycle with it.
    std::vector<bool> touched(user_locks_.size(), false);
    for (std::uint64_t u : users) touched[u % user_locks_.size()] = true;
    std::vector<std::unique_lock<std::mutex>> locks;
    for (std::size_t i = 0; i < touched.size(); ++i) {
      if (touched[i]) locks.emplace_back(user_locks_[i]);
    }
    return purge_locked(what, users);
  });
}

Result<std::vector<PurgeReceipt>> Db::Impl::purge_locked(const char* what, const std::vector<std::uint64_t>& users) {
  std::vector<std::uint64_t> left_at(users.size());
  for (std::size_t i = 0; i < users.size(); ++i) {
    CommunityMembership m{users[i], MembershipStatus::Active, std::nullopt};
    leave_status_.find(users[i], m);
    if (m.status != MembershipStatus::Left) {
      return Status::InvalidArgument(std::string(what) + "(" + user_text(users[i]) + "): " + user_text(users[i]) +
                                     " is " + status_text(m.status) +
                                     "; only a user who left the community layer can be purged; nothing changed");
    }
    left_at[i] = m.left_at_ns.value_or(0);
  }
  std::vector<PurgeReceipt> receipts;
  receipts.reserve(users.size());
  std::optional<std::pair<std::uint64_t, std::uint64_t>> erased;  // first and last user with entries removed
  Status s = state_->exclusive([&]() -> Status {
    for (std::size_t begin = 0; begin < users.size(); begin += kPurgeBatchUsers) {
      const std::size_t end = std::min(users.size(), begin + kPurgeBatchUsers);
      rocksdb::WriteBatch batch;
      std::map<std::string, Units> deltas;  // one operand per cell for the whole batch
      std::vector<std::uint64_t> floors(user_locks_.size(), 0);
      std::vector<PurgeReceipt> pending;
      for (std::size_t i = begin; i < end; ++i) {
        const std::uint64_t u = users[i];
        UserLedger ledger;
        if (Status r = read_user_ledger(*storage_, u, &ledger); !r.ok()) return r;
        const Result<std::uint64_t> now = clock_.now();
        if (!now.ok()) return Status(now.status().code(), std::string(what) + "(" + user_text(u) + "): " + now.status().message());
        const ReceiptRecord record{left_at[i], *now, ledger.entries, ledger.cohort, ledger.community};
        pending.push_back(to_public(u, record));
        if (ledger.entries == 0) continue;  // nothing to remove: nothing written
        for (const auto& [key, units] : ledger.cells) deltas[key] -= units;
        batch.DeleteRange(storage_->ledger(), ledger_begin(u), ledger_end(u));
        std::string suffix;
        put_u64_be(&suffix, *now);
        storage_->put_record(&batch, EntityId(u), Tag::PurgeManifest, suffix, encode_receipt(record));
        floors[u % floors.size()] = *now;
        if (!erased) erased.emplace(u, u);
        erased->second = u;
      }
      if (batch.Count() != 0) {
        std::string operand;
        for (const auto& [key, units] : deltas) {
          operand.clear();
          put_units(&operand, units);
          batch.Merge(storage_->aggregates(), key, operand);
        }
        put_clock_floors(&batch, floors);
        const std::string where = std::string(what) + " of " + std::to_string(end - begin) + " users (ids " +
                                  std::to_string(users[begin]) + ".." + std::to_string(users[end - 1]) + ")";
        if (Status w = storage_->write(&batch, Storage::WriteMode::Sync, where); !w.ok()) {
          return Status(w.code(), w.message() + "; " + std::to_string(begin) + " of " + std::to_string(users.size()) +
                                      " users were purged before the error (see purge_receipts), the rest are "
                                      "untouched");
        }
      }
      receipts.insert(receipts.end(), pending.begin(), pending.end());
    }
    return Status::OK();
  });
  if (!s.ok()) return s;
  if (erased) {
    if (Status e = erase_ledger_range(ledger_begin(erased->first), ledger_end(erased->second)); !e.ok()) {
      return Status(e.code(), std::string(what) + ": the purge is done and durable (see purge_receipts), but the "
                                                  "physical erasure of the ledger bytes did not finish: " +
                                  e.message());
    }
  }
  return receipts;
}

Status Db::Impl::erase_ledger_range(const std::string& begin, const std::string& end) {
  // Every memtable to SST: the WALs that held the purged ledger records (and
  // the purge batch itself, whose range tombstone starts with the prefix)
  // are then no longer needed by any column family.
  if (Status s = storage_->flush(); !s.ok()) return s;
  rocksdb::CompactRangeOptions options;
  options.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForce;
  // Exclusive: RocksDB first waits for the compactions under way. One that
  // started before the purge batch was flushed can write the purged records
  // into a new file after a concurrent manual compaction has passed its
  // range (seen once in CI with compactions starting at 2 L0 files).
  options.exclusive_manual_compaction = true;
  const rocksdb::Slice b(begin), e(end);
  rocksdb::DB* db = storage_->db();
  if (Status s = from_rocksdb(db->CompactRange(options, storage_->ledger(), &b, &e),
                              "compaction of the purged ledger range of '" + storage_->path() + "'");
      !s.ok()) {
    return s;
  }
  // RocksDB deletes obsolete files in a background job that may end after
  // Flush and CompactRange return; re-enabling deletions runs a full purge
  // of obsolete files in this thread.
  if (Status s = from_rocksdb(db->DisableFileDeletions(), "disable file deletions"); !s.ok()) return s;
  if (Status s = from_rocksdb(db->EnableFileDeletions(/*force=*/false), "enable file deletions"); !s.ok()) return s;
  // A WAL another thread is deleting right now is skipped by that purge:
  // wait until no WAL older than the oldest one still needed is on disk.
  std::uint64_t keep = 0;
  if (!db->GetIntProperty(rocksdb::DB::Properties::kMinLogNumberToKeep, &keep)) {
    return Status::IOError("cannot read rocksdb.min-log-number-to-keep of '" + storage_->path() + "'");
  }
  for (int waited = 0;; ++waited) {
    std::string stale;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(storage_->path(), ec)) {
      const std::string name = entry.path().filename().string();
      if (name.size() > 4 && name.ends_with(".log") && std::strtoull(name.c_str(), nullptr, 10) < keep) stale = name;
    }
    if (ec) return Status::IOError("listing '" + storage_->path() + "': " + ec.message());
    if (stale.empty()) return Status::OK();
    if (waited == kObsoleteWalWaitMs) {
      return Status::IOError("obsolete WAL '" + storage_->path() + "/" + stale + "' was not deleted within " +
                             std::to_string(kObsoleteWalWaitMs) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Result<std::vector<PurgeReceipt>> Db::Impl::purge_receipts(std::uint64_t user_id) const {
  return guarded("purge_receipts", [&]() -> Result<std::vector<PurgeReceipt>> {
    Call call(this, "purge_receipts", /*write=*/false);
    if (!call.status().ok()) return call.status();
    const std::string prefix = encode_key_prefix(EntityId(user_id), Tag::PurgeManifest);
    std::vector<PurgeReceipt> out;
    auto it = storage_->iterator(storage_->users());
    for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
      const std::string_view key = view(it->key());
      std::optional<ReceiptRecord> r = decode_receipt(view(it->value()));
      if (key.size() != prefix.size() + 8 || !r || r->purged_at_ns != get_u64_be(key.data() + 9)) {
        return Status::Corruption("purge receipt " + hex(key) + " of " + user_text(user_id) + " in '" +
                                  storage_->path() + "' does not decode (" + std::to_string(it->value().size()) +
                                  "-byte value; expected " + std::to_string(kReceiptSize) +
                                  " bytes of version 1 whose purged_at_ns matches the key)");
      }
      out.push_back(to_public(user_id, *r));
    }
    if (Status s = from_rocksdb(it->status(), "purge_receipts(" + user_text(user_id) + ")"); !s.ok()) return s;
    return out;
  });
}

}  // namespace tidal
