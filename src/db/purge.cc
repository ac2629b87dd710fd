// Retroactive purge (docs/CONTRACT.md, P1-P7; docs/PURGE.md).
//
// A purge of Left users runs in two steps, once the leaves it relies on are
// durable (Storage::sync_users_wal: without sync_writes a leave may not be):
//   1. with the users registered as being purged (a rejoin of one of them
//      waits; their stripes are held only to check that they are Left and
//      register them, so leaves, joins and exits of any user never wait for
//      the state engine), inside StateStore::exclusive_for, once per batch
//      of kPurgeBatchUsers users (so a bulk purge holds the writer back for
//      one batch at a time): while a write buffer may still hold a
//      contribution of one of the users (each leave notes the buffer that
//      can hold its user's last one; its gate is closed and it waited out
//      every signal that passed it, so none arrives after), the pending
//      aggregate updates are written first, under the drain lock; once
//      none may, the batch runs beside the writer's batch under way, ahead
//      of its ingestion. Then the user's ledger is read and one atomic, fsynced
//      write (storage/ingest_batch.h: SST files ingested together, or, for a
//      batch of at most purge_wal_entries entries, one synced write through
//      the state engine's WAL) holds a negative
//      merge operand per cell the user touched (the exact sum of its entries
//      for that cell), a range deletion of the ledger prefix [user BE][0x13],
//      the receipt (0x10), the stripe's clock floor and an erasure mark
//      (naming the user's ledger key by a tag derived from it). The files
//      are built in passes of at most purge_pass_cells cells, so the memory
//      does not grow with the ledger (the WAL's batch is bounded by its
//      entries). Format 4: the batch range-deletes the user's entries in
//      the sealed index; once it is written the user's ledger key is
//      deleted from the key store (users engine), and the writer forgets it.
//      Merge operands commute, so the writer's later batches (other users'
//      cells) compose with it in any order; the state store's store lock
//      keeps the writer's ingestions (and the drain lock, with a change
//      feed, its batches and their seqs) from interleaving with the purge's
//      ledger read and write.
//   2. physical erasure, with no stripe and no drain lock held (a leave or
//      rejoin of the user does not wait for it: a rejoined user's fresh
//      ledger is above the range tombstone, and their new key replaces the
//      purged one), of the users' keys (format 4) and of their format-3
//      records, if any, each in its engine: a key the purge could not delete
//      is deleted now, while it is the one the mark names; every memtable
//      of the engine is flushed (which also retires every WAL holding the
//      keys or records), a bottommost compaction of just the purged users'
//      ranges drops them and the tombstones, the obsolete WALs and SSTs are
//      deleted before the call returns, and the mark goes. The sealed
//      records need no erasure: without the key they cannot be opened, nor
//      linked to the user, and they stay where the writer put them (files
//      that no compaction rewrites: storage/sealed_ledger.h).
// A mark left by an erasure that failed, or by a crash, is finished by the
// user's next purge and by the next writable open.
//
// With a journal, step 0 comes first: under the users' stripes (so the
// intent's seq falls between the user's leave and any later rejoin, and the
// stripes' clock floors only grow), each receipt's time is read and the
// purge's intent is written, durably, with a mark "journal_purge/<user>
// <purged_at>" (storage/journal_format.h). The mark goes once the purge's
// batch is durable; a mark a crash or an error left is finished by the next
// writable open (finish_journaled_purges), with the intent's purged_at, so
// the receipt is the one the journal names.
#include <algorithm>
#include <array>
#include <cassert>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <shared_mutex>
#include <thread>

#include <rocksdb/env.h>
#include <rocksdb/metadata.h>
#include <rocksdb/options.h>
#include <rocksdb/sst_file_reader.h>
#include <rocksdb/table_properties.h>

#include "db/erasure_ranges.h"
#include "db/guarded.h"
#include "db/impl.h"
#include "storage/ingest_batch.h"
#include "storage/journal_format.h"
#include "storage/receipt.h"
#include "storage/sealed_ledger.h"

namespace tidal {
namespace {

// Users per ingested batch of a bulk purge (each user is wholly in one).
constexpr std::size_t kPurgeBatchUsers = 1'000;

// The most ledger files (of ~1 MiB) one forced compaction of an erasure
// rewrites when it joins the ranges of several purged users
// (db/erasure_ranges.h). Within one compaction (exclusive,
// erase_ledger_ranges) RocksDB skips the last-level files it wrote itself,
// so few large ranges rewrite less than many small ones: at 1M users the
// erasure of a bulk purge of 5,000 users took 56.7 s in ranges of at most
// 64 files, 47.2 s in ranges of at most 1,024 (bench/README.md). 1,024
// files, ~1 GiB of ledger: the whole ledger of 1M users (865 MB) in one.
constexpr std::size_t kErasureFilesPerCompaction = 1'024;

std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }
std::string user_text(std::uint64_t user_id) { return "user " + std::to_string(user_id); }

std::string ledger_begin(std::uint64_t user) { return encode_key_prefix(EntityId(user), Tag::ContributionLedger); }
// The first key after every ledger key of `user`.
std::string ledger_end(std::uint64_t user) {
  return encode_key_prefix(EntityId(user), static_cast<Tag>(static_cast<std::uint8_t>(Tag::ContributionLedger) + 1));
}

// What one user's ledger holds, in total.
struct UserTotals {
  std::uint64_t entries = 0;
  Units cohort = 0;
  Units community = 0;
};

}  // namespace

// Reads users' ledgers for one batch of a purge, under the drain lock:
// its iterators are made at the first read and serve every user of the
// batch. Made per user and read, each over every level-0 file of the
// sealed index (~165 at the demo's reopen), they made a bulk purge of
// 5,000 users at 1M take 6–9 s instead of 3.2 (bench/README.md, "Format
// 4"). A batch reads each ledger twice (the totals, then the cells): the
// first read keeps what it decoded, up to kCachedEntryBytes for the batch,
// and the second one reads that instead of the ledger (at 4M users, where
// the reads are of blocks no cache holds, the second read was a third of
// the batch's time). A reader sees the ledger as it was when it first
// read: it must not outlive a write of the purge's batch.
class LedgerReader {
 public:
  explicit LedgerReader(const Storage& storage) : storage_(storage) {}

  // Calls `fn` for every entry of the user's ledger, streaming: the records
  // format 3 wrote before the Db's upgrade (unsealed, keyed [user BE][0x13]),
  // then the sealed ones, opened with the user's key (`key`; null when the
  // key store has none).
  template <class Fn>
  Status for_each(std::uint64_t user, const UserKey* key, Fn&& fn);

 private:
  // The decoded entries a batch keeps (LedgerEntry is 48 bytes): ~10x a
  // batch of 1,000 of the demo's users at 4M.
  static constexpr std::size_t kCachedEntryBytes = 32 << 20;
  // The sealed records one MultiGet reads.
  static constexpr std::size_t kRecordsPerRead = 256;

  template <class Fn>
  Status read(std::uint64_t user, const UserKey* key, Fn&& fn);

  const Storage& storage_;
  std::unique_ptr<rocksdb::Iterator> ledger_, index_;
  std::string plain_;
  std::map<std::uint64_t, std::vector<LedgerEntry>> cached_;
  std::size_t cached_bytes_ = 0;
};

template <class Fn>
Status LedgerReader::for_each(std::uint64_t user, const UserKey* key, Fn&& fn) {
  if (auto it = cached_.find(user); it != cached_.end()) {
    for (const LedgerEntry& e : it->second) fn(e);
    return Status::OK();
  }
  // Kept while the batch's budget allows; dropped (and read again next
  // time) once it does not, or when the read fails.
  std::vector<LedgerEntry> kept;
  bool keep = cached_bytes_ < kCachedEntryBytes;
  Status s = read(user, key, [&](const LedgerEntry& e) {
    fn(e);
    if (!keep) return;
    if (cached_bytes_ + (kept.size() + 1) * sizeof(LedgerEntry) > kCachedEntryBytes) {
      keep = false;
      std::vector<LedgerEntry>().swap(kept);
      return;
    }
    kept.push_back(e);
  });
  if (s.ok() && keep) {
    cached_bytes_ += kept.size() * sizeof(LedgerEntry);
    cached_.emplace(user, std::move(kept));
  }
  return s;
}

template <class Fn>
Status LedgerReader::read(std::uint64_t user, const UserKey* key, Fn&& fn) {
  const Storage& storage = storage_;
  const auto entries_of = [&](std::string_view record_key, const std::optional<std::vector<LedgerEntry>>& entries,
                              const std::string& expected) -> Status {
    if (!entries) {
      return Status::Corruption("ledger record " + hex(record_key) + " of " + user_text(user) + " does not decode (" +
                                expected + "); nothing purged");
    }
    for (const LedgerEntry& e : *entries) fn(e);
    return Status::OK();
  };
  const std::string prefix = ledger_begin(user);
  if (ledger_ == nullptr) ledger_ = storage.iterator(storage.ledger());
  auto& it = ledger_;
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    if (Status s = entries_of(view(it->key()), decode_ledger_value(view(it->value())),
                              std::to_string(it->value().size()) + "-byte value; expected a multiple of 33");
        !s.ok()) {
      return s;
    }
  }
  if (Status s = from_rocksdb(it->status(), "ledger read of " + user_text(user) + " in '" + storage.path() + "'");
      !s.ok() || key == nullptr) {
    return s;
  }
  // The index names the user's records (storage/sealed_ledger.h), in
  // epoch order; they are read kRecordsPerRead at a time, each MultiGet's
  // keys in order.
  const rocksdb::Slice pseudonym(key->pseudonym().data(), key->pseudonym().size());
  if (index_ == nullptr) index_ = storage.prefix_iterator(storage.sealed_index());
  auto& index = index_;
  std::string& plain = plain_;
  std::vector<std::string> records;
  std::vector<rocksdb::PinnableSlice> values;
  std::vector<rocksdb::Status> statuses;
  const auto open_records = [&]() -> Status {
    if (records.empty()) return Status::OK();
    std::vector<rocksdb::Slice> keys(records.begin(), records.end());
    values.clear();
    values.resize(records.size());
    statuses.assign(records.size(), rocksdb::Status());
    storage.db(Storage::Engine::State)
        ->MultiGet(rocksdb::ReadOptions(), storage.sealed_ledger(), keys.size(), keys.data(), values.data(),
                   statuses.data(), /*sorted_input=*/true);
    for (std::size_t i = 0; i < records.size(); ++i) {
      const std::string& record = records[i];
      if (!statuses[i].ok()) {
        const Status s = statuses[i].IsNotFound() ? Status::Corruption("no record")
                                                  : from_rocksdb(statuses[i], "read from '" + storage.state_path() + "'");
        return Status(s.code(), "sealed ledger record " + hex(record) + " of " + user_text(user) +
                                    ", named by the index: " + s.message() + "; nothing purged");
      }
      if (!key->open(record, values[i].ToStringView(), &plain)) {
        return Status::Corruption("sealed ledger record " + hex(record) + " of " + user_text(user) +
                                  " does not open with the user's key (" + std::to_string(values[i].size()) +
                                  "-byte value: changed, or not the user's); nothing purged");
      }
      if (Status s = entries_of(record, decode_sealed_entries(plain), "its sealed entries are malformed"); !s.ok()) {
        return s;
      }
    }
    records.clear();
    return Status::OK();
  };
  for (index->Seek(pseudonym); index->Valid() && index->key().starts_with(pseudonym); index->Next()) {
    std::optional<std::string> record = sealed_record_of(view(index->key()));
    if (!record) {
      return Status::Corruption("sealed index key " + hex(view(index->key())) + " of " + user_text(user) + " has " +
                                std::to_string(index->key().size()) + " bytes; expected " +
                                std::to_string(kSealedIndexKeySize) + "; nothing purged");
    }
    records.push_back(std::move(*record));
    if (records.size() == kRecordsPerRead) {
      if (Status s = open_records(); !s.ok()) return s;
    }
  }
  if (Status s = from_rocksdb(index->status(), "sealed index read of " + user_text(user) + " in '" + storage.path() + "'");
      !s.ok()) {
    return s;
  }
  return open_records();
}

namespace {

// An encoded aggregate key, ordered as RocksDB orders it (unsigned bytes).
using CellKey = std::array<unsigned char, kAggregateKeySize>;
std::string_view view(const CellKey& k) { return {reinterpret_cast<const char*>(k.data()), k.size()}; }

PurgeReceipt to_public(std::uint64_t user, const ReceiptRecord& r, bool erasure_complete) {
  return {user,
          r.left_at_ns,
          r.purged_at_ns,
          r.entries_removed,
          units_to_double(r.cohort_units),
          units_to_double(r.community_units),
          erasure_complete};
}

std::string status_text(MembershipStatus s) { return s == MembershipStatus::Left ? "Left" : "Active"; }

}  // namespace

Result<std::vector<PurgeReceipt>> Db::Impl::purge(const char* what, std::span<const std::uint64_t> user_ids) {
  return guarded(what, [&]() -> Result<std::vector<PurgeReceipt>> {
    Call call(this, what, /*write=*/true);
    if (!call.status().ok()) return call.status();
    if (recovering()) return recovering_status(what);
    std::vector<std::uint64_t> users(user_ids.begin(), user_ids.end());
    std::sort(users.begin(), users.end());
    users.erase(std::unique(users.begin(), users.end()), users.end());
    std::vector<std::uint64_t> to_erase;  // users whose ledger bytes may still be in a file
    std::uint64_t intent_seq = 0;         // the last intent's journal seq (0: none written)
    Result<std::vector<PurgeReceipt>> receipts = [&]() -> Result<std::vector<PurgeReceipt>> {
      // Under the users' stripes, only long enough to check that each is
      // Left and register it in purging_: from then on a rejoin of one of
      // them waits for this purge, and nobody else does (no leave, join or
      // exit waits for the state engine).
      std::vector<std::uint64_t> left_at(users.size());
      std::vector<std::uint64_t> purged_at(users.size());  // the receipts' times, named by the intents
      // From the intents' write until the purge is durable, an error (or an
      // exception) leaves intents the journal holds and this Db has not
      // done: their users cannot rejoin until a purge or a reopen finishes
      // them (a rejoin would let the next open think them done).
      struct Unfinished {
        Impl* impl;
        const std::vector<std::uint64_t>& users;
        bool armed = false;
        ~Unfinished() {
          if (!armed) return;
          std::lock_guard<std::mutex> lock(impl->unfinished_mu_);
          impl->unfinished_purges_.insert(users.begin(), users.end());
        }
      } unfinished{this, users};
      // No backup between the intents and the marks' deletion (backup_mu_).
      // Without the journal too: a backup holds the key store's lock while
      // it copies the users engine, and a purge that waited for that lock
      // inside its drain (below) would hold up every signal for the copy.
      // Waited for here, before the drain, the backup holds up only the purge.
      std::shared_lock<WriterFirstMutex> no_backup(backup_mu_);
      {
        const auto locks = lock_stripes(users, /*wait_for_purges=*/false);
        for (std::size_t i = 0; i < users.size(); ++i) {
          CommunityMembership m{users[i], MembershipStatus::Active, std::nullopt};
          leave_status_.find(users[i], m);
          if (m.status != MembershipStatus::Left) {
            return Status::InvalidArgument(std::string(what) + "(" + user_text(users[i]) + "): " +
                                           user_text(users[i]) + " is " + status_text(m.status) +
                                           "; only a user who left the community layer can be purged; nothing "
                                           "changed");
          }
          left_at[i] = m.left_at_ns.value_or(0);
        }
        for (std::size_t i = 0; i < users.size(); ++i) {
          const Result<std::uint64_t> now = clock_.now();
          if (!now.ok()) {
            return Status(now.status().code(), std::string(what) + "(" + user_text(users[i]) + "): " +
                                                   now.status().message() + "; nothing changed");
          }
          purged_at[i] = *now;
        }
        unfinished.armed = journal_ != nullptr;
        if (Status s = write_purge_intents(what, users, left_at, purged_at, &intent_seq); !s.ok()) return s;
        std::lock_guard<std::mutex> lock(purging_mu_);
        for (std::uint64_t u : users) ++purging_[u];
      }
      // Unregistered however purge_registered ends (an exception included).
      struct Unregister {
        Impl* impl;
        const std::vector<std::uint64_t>& users;
        ~Unregister() {
          {
            std::lock_guard<std::mutex> lock(impl->purging_mu_);
            for (std::uint64_t u : users) {
              if (auto it = impl->purging_.find(u); --it->second == 0) impl->purging_.erase(it);
            }
          }
          impl->purge_ended_.notify_all();
        }
      } unregister{this, users};
      if (after_purge_intent_for_testing) after_purge_intent_for_testing();
      Result<std::vector<PurgeReceipt>> done = purge_registered(what, users, left_at, purged_at, &to_erase);
      // Durable: the intents are done, and so is every earlier unfinished
      // one of these users (this purge removed everything before the same
      // boundary). A mark a crash keeps is checked again at the next open,
      // which finds the receipt or the empty ledger and changes nothing.
      if (done.ok() && journal_) {
        unfinished.armed = false;
        (void)delete_purge_marks(users);
      }
      return done;
    }();
    // Erase what the batches made durable, even when a later batch failed:
    // what is not erased now stays marked for the next purge or open.
    if (before_erasure_for_testing && !to_erase.empty()) before_erasure_for_testing();
    const Status erased = erase_purged(to_erase);
    if (!receipts.ok()) return receipts;
    if (!erased.ok()) {
      return Status(erased.code(), std::string(what) + ": the purge is done and durable (see purge_receipts), but "
                                                       "the physical erasure of the ledger bytes did not finish; it "
                                                       "stays marked and the next purge of the user or the next open "
                                                       "completes it: " + erased.message());
    }
    // The purge is done whatever the wait returns; a retry writes another
    // intent, which removes nothing more.
    if (Status s = await_replication(intent_seq, std::string(what) + " (purge intents through journal seq " +
                                                     std::to_string(intent_seq) + ")");
        !s.ok()) {
      return s;
    }
    return receipts;
  });
}

namespace {

// Users per intent batch of a bulk purge.
constexpr std::size_t kIntentBatchUsers = 10'000;

}  // namespace

Status Db::Impl::write_purge_intents(const char* what, const std::vector<std::uint64_t>& users,
                                     const std::vector<std::uint64_t>& left_at,
                                     const std::vector<std::uint64_t>& purged_at, std::uint64_t* seq) {
  if (!journal_) return Status::OK();
  std::vector<JournalRecord> entries;
  for (std::size_t begin = 0; begin < users.size(); begin += kIntentBatchUsers) {
    const std::size_t end = std::min(users.size(), begin + kIntentBatchUsers);
    entries.clear();
    std::vector<std::uint64_t> floors(user_locks_.size(), 0);
    for (std::size_t i = begin; i < end; ++i) {
      entries.push_back({JournalKind::Purge, users[i], purged_at[i], left_at[i]});
      std::uint64_t& floor = floors[users[i] % floors.size()];
      floor = std::max(floor, purged_at[i]);
    }
    // The marks and the stripes' clock floors (a reopened clock starts
    // above every purged_at an intent names), in the intents' write.
    const Journal::Fill fill = [&](rocksdb::WriteBatch* batch, std::uint64_t first_seq) {
      for (std::size_t i = begin; i < end; ++i) {
        batch->Put(storage_->meta(), encode_journal_purge_key(users[i], purged_at[i]),
                   encode_journal_purge_value(first_seq + (i - begin), left_at[i]));
      }
      put_clock_floors(batch, floors);
    };
    const std::string ids = end - begin == 1 ? user_text(users[begin])
                                             : std::to_string(end - begin) + " users (ids " +
                                                   std::to_string(users[begin]) + ".." + std::to_string(users[end - 1]) + ")";
    Result<std::uint64_t> w = journal_->write(fill, entries, std::string(what) + ": the purge intent of " + ids);
    if (!w.ok()) {
      return Status(w.status().code(),
                    w.status().message() + "; nothing purged" +
                        (begin == 0 ? std::string()
                                    : " (the intents of the " + std::to_string(begin) +
                                          " users before them are journaled: the next open purges them)"));
    }
    *seq = *w;
  }
  return Status::OK();
}

Status Db::Impl::delete_purge_marks(const std::vector<std::uint64_t>& users) {
  if (!journal_ || users.empty()) return Status::OK();
  rocksdb::WriteBatch batch;
  {
    auto it = storage_->iterator(storage_->meta());
    for (std::uint64_t u : users) {
      const std::string prefix = encode_journal_purge_key(u, 0).substr(0, std::string_view(kJournalPurgePrefix).size() + 8);
      for (it->Seek(prefix); it->Valid() && view(it->key()).starts_with(prefix); it->Next()) {
        batch.Delete(storage_->meta(), it->key());
      }
    }
    if (Status s = from_rocksdb(it->status(), "scan of the journaled purge marks of '" + storage_->path() + "'");
        !s.ok()) {
      return s;
    }
  }
  if (Status s = storage_->write(Storage::Engine::Users, &batch, Storage::WriteMode::Async,
                                 "deleting the journaled purge marks of " + std::to_string(users.size()) + " users");
      !s.ok()) {
    return s;
  }
  std::lock_guard<std::mutex> lock(unfinished_mu_);
  for (std::uint64_t u : users) unfinished_purges_.erase(u);
  return Status::OK();
}

Status Db::Impl::check_no_unfinished_purge(const char* what, std::uint64_t user) const {
  if (!journal_) return Status::OK();
  std::lock_guard<std::mutex> lock(unfinished_mu_);
  if (!unfinished_purges_.contains(user)) return Status::OK();
  return Status::Busy(std::string(what) + "(" + user_text(user) + "): a purge of " + user_text(user) +
                      " whose intent is in the privacy journal did not finish (its call returned the error); purge "
                      "the user again, or reopen the Db (which finishes it), then rejoin; nothing changed");
}

Result<bool> Db::Impl::journaled_purge_pending(std::uint64_t user, std::uint64_t purged_at, std::uint64_t left_at) {
  std::string receipt;
  Status found = storage_->get(storage_->receipts(), encode_receipt_key(user, purged_at), &receipt);
  if (!found.ok() && found.code() != StatusCode::NotFound) return found;
  CommunityMembership status{user, MembershipStatus::Active, std::nullopt};
  leave_status_.find(user, status);
  // Not done when its receipt is missing and the user is still Left since
  // the intent's boundary: nothing else can have happened to the user in
  // between (a rejoin waits for the purge; the open, or the replay, is not
  // over). A purge that had nothing to remove wrote no receipt: it runs
  // again and finds nothing again.
  return found.code() == StatusCode::NotFound && status.status == MembershipStatus::Left &&
         status.left_at_ns.value_or(0) == left_at;
}

Status Db::Impl::finish_journaled_purges() {
  if (!journal_) return Status::OK();
  std::vector<JournalPurgeMark> marks;
  {
    auto it = storage_->iterator(storage_->meta());
    const std::string_view prefix(kJournalPurgePrefix);
    for (it->Seek(rocksdb::Slice(prefix.data(), prefix.size())); it->Valid() && view(it->key()).starts_with(prefix);
         it->Next()) {
      std::optional<JournalPurgeMark> m = decode_journal_purge(view(it->key()), view(it->value()));
      if (!m) {
        return Status::Corruption("cannot open tidal Db at '" + storage_->path() + "': journaled purge mark " +
                                  hex(view(it->key())) + " does not decode (" + std::to_string(it->value().size()) +
                                  "-byte value; expected 16)");
      }
      marks.push_back(*m);
    }
    if (Status s = from_rocksdb(it->status(), "scan of the journaled purge marks of '" + storage_->path() + "'");
        !s.ok()) {
      return s;
    }
  }
  for (const JournalPurgeMark& m : marks) {
    const std::string what = "finishing the purge of " + user_text(m.user_id) + " journaled as seq " +
                             std::to_string(m.seq) + " (purged_at_ns " + std::to_string(m.purged_at_ns) + ")";
    Result<bool> pending = journaled_purge_pending(m.user_id, m.purged_at_ns, m.left_at_ns);
    if (!pending.ok()) return pending.status();
    if (*pending) {
      std::vector<std::uint64_t> to_erase;
      Result<std::vector<PurgeReceipt>> r =
          purge_registered(what.c_str(), {m.user_id}, {m.left_at_ns}, {m.purged_at_ns}, &to_erase);
      if (!r.ok()) {
        return Status(r.status().code(), "cannot open tidal Db at '" + storage_->path() + "': " + what +
                                             " failed (the journal holds its intent, so the Db does not open "
                                             "without it; a read-only open works): " + r.status().message());
      }
      // An erasure that fails stays marked for the next purge or open, as always.
      (void)erase_purged(to_erase);
    }
    rocksdb::WriteBatch batch;
    batch.Delete(storage_->meta(), encode_journal_purge_key(m.user_id, m.purged_at_ns));
    if (Status s = storage_->write(Storage::Engine::Users, &batch, Storage::WriteMode::Async, what); !s.ok()) return s;
  }
  return Status::OK();
}

Result<std::vector<PurgeReceipt>> Db::Impl::purge_registered(const char* what, const std::vector<std::uint64_t>& users,
                                                             const std::vector<std::uint64_t>& left_at,
                                                             const std::vector<std::uint64_t>& purged_at,
                                                             std::vector<std::uint64_t>* to_erase) {
  // The leave each receipt cites must outlive the purge (E2): without
  // sync_writes it may still be an unsynced write of the users engine,
  // and the purge is a synced one of the state engine.
  if (Status s = storage_->sync_users_wal(); !s.ok()) {
    return Status(s.code(), std::string(what) + ": making the leave durable before the purge failed; nothing purged: " +
                                s.message());
  }
  std::vector<PurgeReceipt> receipts;
  receipts.reserve(users.size());
  // The drain lock is held for one batch of kPurgeBatchUsers at a time (its
  // ledger reads and its write), and a batch begins by storing what is
  // pending when one of its users may still have a contribution there
  // (exclusive_for): signals wait for one batch of a bulk purge, not for all
  // of it (S4).
  for (std::size_t begin = 0; begin < users.size(); begin += kPurgeBatchUsers) {
    const std::size_t end = std::min(users.size(), begin + kPurgeBatchUsers);
    const std::span<const std::uint64_t> batch_users(users.data() + begin, end - begin);
    Status s = state_->exclusive_for(batch_users, [&]() -> Status {
      const std::string ids = batch_users.size() == 1 ? user_text(batch_users.front())
                                                      : std::to_string(batch_users.size()) + " users (ids " +
                                                            std::to_string(batch_users.front()) + ".." +
                                                            std::to_string(batch_users.back()) + ")";
      std::vector<std::uint64_t> purged;  // users of the batch with entries to remove
      std::vector<std::optional<UserKey>> keys;  // their ledger keys (same order)
      std::vector<ReceiptRecord> records;
      std::vector<std::uint64_t> marks;  // each purged user's erasure mark value
      std::vector<std::uint64_t> erase;
      std::vector<PurgeReceipt> pending;
      std::vector<std::uint64_t> orphaned;  // users whose keys seal no record
      LedgerReader ledger(*storage_);
      for (std::size_t i = begin; i < end; ++i) {
        const std::uint64_t u = users[i];
        Result<std::optional<UserKey>> key = read_user_key(*storage_, u);
        if (!key.ok()) return key.status();
        UserTotals totals;
        if (Status r = ledger.for_each(u, key->has_value() ? &**key : nullptr, [&](const LedgerEntry& e) {
              (e.target == AggregateKind::Cohort ? totals.cohort : totals.community) += e.units;
              ++totals.entries;
            });
            !r.ok()) {
          return r;
        }
        Result<std::optional<std::uint64_t>> marked = erasure_pending_since(u);
        if (!marked.ok()) return marked.status();
        const std::uint64_t* now = &purged_at[i];
        const ReceiptRecord record{left_at[i], *now, totals.entries, totals.cohort, totals.community};
        pending.push_back(to_public(u, record, /*erasure_complete=*/true));  // returned once erased
        // Nothing to remove, no receipt; an earlier purge's erasure that did
        // not finish is finished now. A key with no record (stored by a
        // batch of the writer whose ingestion then failed) seals nothing,
        // and goes too.
        if (totals.entries == 0) {
          if (key->has_value()) orphaned.push_back(u);
          if (*marked || key->has_value()) erase.push_back(u);
          continue;
        }
        purged.push_back(u);
        keys.push_back(std::move(*key));
        records.push_back(record);
        marks.push_back(marked->value_or(*now));
        erase.push_back(u);
      }
      if (!orphaned.empty()) {
        if (Status d = delete_user_keys(*storage_, orphaned, {},
                                        std::string(what) + ": deleting ledger keys that seal no record");
            !d.ok()) {
          return d;
        }
        for (std::uint64_t u : orphaned) state_->forget_ledger_key(u);
      }
      if (!purged.empty()) {
        {
          // Before the batch: an erasure that began earlier keeps the marks
          // this batch writes (erase_purged).
          std::lock_guard<std::mutex> lock(marks_mu_);
          for (std::uint64_t u : purged) purge_generation_[u] = ++generation_;
        }
        Status w = write_purge_batch(purged, keys, records, marks, &ledger, std::string(what) + " of " + ids);
        if (!w.ok()) {
          // A failed write may still have reached the disk (RocksDB cannot
          // tell): its users' outcome is unknown, not "untouched".
          return Status(w.code(), w.message() + "; the purge of " + ids +
                                      " may or may not be durable (a failed write's outcome is unknown until "
                                      "the Db has recovered from the error, by itself once the cause is gone, or "
                                      "been reopened: purge_receipts tells from then on; a retry of the purge is "
                                      "safe either way); " +
                                      (begin == 0 ? std::string("no earlier batch was written")
                                                  : std::to_string(begin) + " users before them were purged") +
                                      (end == users.size() ? std::string()
                                                           : ", the " + std::to_string(users.size() - end) +
                                                                 " after them are untouched"));
        }
      }
      to_erase->insert(to_erase->end(), erase.begin(), erase.end());
      receipts.insert(receipts.end(), pending.begin(), pending.end());
      return Status::OK();
    });
    if (!s.ok()) return s;
  }
  return receipts;
}

Status Db::Impl::write_purge_batch(const std::vector<std::uint64_t>& users, const std::vector<std::optional<UserKey>>& keys,
                                   const std::vector<ReceiptRecord>& records, const std::vector<std::uint64_t>& marks,
                                   LedgerReader* ledger, const std::string& what) {
  // A batch of few entries (a single purge's, typically) goes through the
  // state engine's WAL, in one synced write; a larger one as files, which
  // stream to disk (IngestBatch).
  std::uint64_t entries = 0;
  for (const ReceiptRecord& r : records) entries += r.entries_removed;
  const IngestBatch::Via via = entries <= purge_wal_entries ? IngestBatch::Via::Wal : IngestBatch::Via::Files;
  IngestBatch batch(storage_.get(), "purge." + std::to_string(records.front().purged_at_ns), via);
  // The subtraction also enters the change feed, in the same write, so the
  // purge reaches every view.
  std::optional<ChangeFeed::Appender> feed;
  if (feed_) {
    feed.emplace(feed_.get(), FeedOrigin::Purge,
                 [&](const std::string& k, const std::string& v) { return batch.put(storage_->feed(), k, v); });
  }
  // The aggregates' operands, in key order, in passes over the users'
  // ledgers that each sum the cells of one key range [lo, cut): at most
  // purge_pass_cells cells in memory, whatever the ledgers hold.
  std::optional<CellKey> lo;
  std::string encoded, operand;
  PurgeImage image;  // what the batch writes, for the strict erasure
  for (;;) {
    std::map<CellKey, Units> cells;
    std::optional<CellKey> cut;  // the first key of the next pass
    for (std::size_t i = 0; i < users.size(); ++i) {
      Status r = ledger->for_each(users[i], keys[i] ? &*keys[i] : nullptr, [&](const LedgerEntry& e) {
        encoded.clear();
        put_aggregate_key(&encoded, e.target, e.target_id, e.item);
        CellKey k;
        std::memcpy(k.data(), encoded.data(), k.size());
        if ((lo && k < *lo) || (cut && !(k < *cut))) return;
        cells[k] += e.units;
        if (cells.size() > purge_pass_cells) {
          auto last = std::prev(cells.end());
          cut = last->first;
          cells.erase(last);
        }
      });
      if (!r.ok()) return r;
    }
    if (!cells.empty()) {
      // [first cell, the key right after the last one)
      image.aggregates.emplace_back(std::string(view(cells.begin()->first)),
                                    std::string(view(std::prev(cells.end())->first)) + '\0');
    }
    for (const auto& [k, units] : cells) {
      operand.clear();
      put_units(&operand, -units);
      if (rocksdb::Status m = batch.merge(storage_->aggregates(), view(k), operand); !m.ok()) return from_rocksdb(m, what);
      if (feed) feed->add(view(k), -units);
    }
    if (!cut) break;
    lo = cut;
  }
  // The ledgers' range deletions (format 3's, by user; the sealed index's,
  // by pseudonym), the keys' (which erase_purged then erases from the
  // files), the receipts, then the meta
  // records: the stripes' clock floors ("clock_floor/..."), and the
  // erasure marks ("erasure_pending/...") in a file of their own (below),
  // each in key order.
  std::vector<std::uint64_t> floors(user_locks_.size(), 0);
  for (std::size_t i = 0; i < users.size(); ++i) {
    std::uint64_t& floor = floors[users[i] % floors.size()];
    floor = std::max(floor, records[i].purged_at_ns);
  }
  rocksdb::Status w;
  // Format 3's records, only of users who have some: a tombstone of its own
  // would make an SST file in a ledger that format 4 never writes.
  {
    auto it = storage_->iterator(storage_->ledger());
    for (std::size_t i = 0; i < users.size() && w.ok(); ++i) {
      const std::string begin = ledger_begin(users[i]);
      it->Seek(begin);
      if (it->Valid() && it->key().starts_with(begin)) w = batch.delete_range(storage_->ledger(), begin, ledger_end(users[i]));
    }
    if (Status s = from_rocksdb(it->status(), what); !s.ok()) return s;
  }
  std::vector<std::string_view> pseudonyms;
  for (const std::optional<UserKey>& k : keys) {
    if (k) pseudonyms.push_back(k->pseudonym());
  }
  std::sort(pseudonyms.begin(), pseudonyms.end());
  // The index entries only: the sealed records stay, unreadable once the
  // keys are erased (storage/sealed_ledger.h).
  for (std::string_view p : pseudonyms) {
    if (w.ok()) w = batch.delete_range(storage_->sealed_index(), p, pseudonym_end(p));
    image.sealed_index.emplace_back(std::string(p), pseudonym_end(p));
  }
  for (std::size_t i = 0; i < users.size() && w.ok(); ++i) {
    std::string key = encode_receipt_key(users[i], records[i].purged_at_ns);
    w = batch.put(storage_->receipts(), key, encode_receipt(records[i]));
    image.receipts.emplace_back(key, key + '\0');
  }
  for (std::size_t stripe = 0; stripe < floors.size() && w.ok(); ++stripe) {
    if (floors[stripe] != 0) {
      w = batch.put(storage_->state_meta(), clock_floor_stripe_key(stripe), serialize_clock_floor(floors[stripe]));
    }
  }
  // The marks in a file of their own, whose keys span only the batch's
  // users: RocksDB flushes a memtable before ingesting a file whose key
  // range overlaps it, and the meta column family's memtable holds the
  // marks that earlier erasures deleted (erase_purged). In one file with
  // the clock floors, whose keys sort before every mark, the batch's range
  // took in those deletions: a single purge waited for that flush in 67 of
  // 500 at 1M users with signals flowing, 4.5 ms at p50 and 13 ms at most
  // besides its wait for the flush thread (bench/README.md, "Session 39").
  // Through the WAL they go in the batch's own write: a memtable takes them
  // whatever it holds.
  IngestBatch mark_file(storage_.get(), "purge." + std::to_string(records.front().purged_at_ns) + ".marks");
  IngestBatch* const marks_file = via == IngestBatch::Via::Files ? &mark_file : nullptr;
  for (std::size_t i = 0; i < users.size() && w.ok(); ++i) {
    w = (marks_file != nullptr ? *marks_file : batch).put(storage_->state_meta(), erasure_pending_key(users[i]),
                      encode_erasure_mark({marks[i], keys[i] ? keys[i]->erasure_tag() : std::string()}));
  }
  if (!w.ok()) return from_rocksdb(w, what);
  ChangeFeed::Appended appended;
  if (feed) {
    Result<ChangeFeed::Appended> a = feed->finish();
    if (!a.ok()) return a.status();
    appended = *a;
  }
  // The keys, in the users engine, once the batch is durable: a crash in
  // between leaves each key and its user's erasure mark, which names the
  // key (UserKey::erasure_tag), and the next open deletes it (erase_purged). A
  // reader of both engines sees the two steps as one (key_store_mu).
  std::unique_lock<std::shared_mutex> key_store(storage_->key_store_mu());
  if (Status s = batch.ingest(what, marks_file); !s.ok()) {
    // Not applied, though it may be durable after a crash (RocksDB cannot
    // tell): the records are still there, and so are their keys, which the
    // writer reads again. Should the batch turn out durable, its marks name
    // keys that later records may use; the erasure then keeps such a key
    // (delete_marked_keys).
    for (std::uint64_t u : users) state_->forget_ledger_key(u);
    return s;
  }
  if (feed) feed_->committed(appended);
  if (options_.strict_erasure) {
    std::lock_guard<std::mutex> lock(marks_mu_);
    purge_image_.add(image);
  }
  Storage::test_step("purge", 1);
  std::vector<std::uint64_t> keyed;
  for (std::size_t i = 0; i < users.size(); ++i) {
    if (keys[i]) keyed.push_back(users[i]);
  }
  // Synced (delete_user_keys): the erasure drops the bucket keys this
  // replaces.
  Status d = delete_user_keys(*storage_, keyed, {}, what + ": deleting the ledger keys");
  // The purge is done either way; an undeleted key is the erasure's to
  // delete (erase_purged), and is never used again.
  for (std::uint64_t u : users) {
    if (d.ok()) state_->forget_ledger_key(u);
    else state_->revoke_ledger_key(u);
  }
  return Status::OK();
}

Result<std::optional<ErasureMark>> Db::Impl::erasure_mark(std::uint64_t user) const {
  std::string value;
  Status s = storage_->get(storage_->state_meta(), erasure_pending_key(user), &value);
  if (s.code() == StatusCode::NotFound) return std::optional<ErasureMark>();
  if (!s.ok()) return s;
  std::optional<ErasureMark> mark = decode_erasure_mark(value);
  if (!mark) {
    return Status::Corruption("erasure mark of " + user_text(user) + " in '" + storage_->path() + "' has a " +
                              std::to_string(value.size()) + "-byte value; expected 8 or 24");
  }
  return mark;
}

Result<std::optional<std::uint64_t>> Db::Impl::erasure_pending_since(std::uint64_t user) const {
  Result<std::optional<ErasureMark>> mark = erasure_mark(user);
  if (!mark.ok()) return mark.status();
  return *mark ? std::optional<std::uint64_t>((*mark)->since) : std::nullopt;
}

Status Db::Impl::delete_marked_keys(const std::vector<std::uint64_t>& users, std::vector<std::uint64_t>* in_use) {
  in_use->clear();
  if (storage_->keys() == nullptr) return Status::OK();
  // The users whose stored key is the one their mark names: a purge that
  // failed to delete it, or a crash before it did. A key made after the
  // purge, for a contribution after a rejoin, is kept, but its bucket gets
  // a new key all the same (`replaced`): the writer stored it, wrapped with
  // the bucket's key of the moment, over the purged key, whose wrapped copy
  // with that same bucket key may still be in the files. A key that seals a
  // record the index still names is kept, and so is the mark: after a
  // purge batch whose ingestion failed (so the writer used the key again)
  // turned out durable at the next open. The purged records then stay
  // readable until the user's next purge deletes the key (purge_receipts
  // says the erasure is not complete).
  std::vector<std::uint64_t> replaced;
  const auto marked_keys = [&](std::vector<std::uint64_t>* out) -> Status {
    out->clear();
    in_use->clear();
    replaced.clear();
    for (std::uint64_t u : users) {
      Result<std::optional<ErasureMark>> mark = erasure_mark(u);
      if (!mark.ok()) return mark.status();
      if (!*mark || (*mark)->key_tag.empty()) continue;
      Result<std::optional<UserKey>> key = read_user_key(*storage_, u);
      if (!key.ok()) return key.status();
      if (!*key) continue;
      if ((*key)->erasure_tag() != (*mark)->key_tag) {
        replaced.push_back(u);
        continue;
      }
      const rocksdb::Slice pseudonym((*key)->pseudonym().data(), (*key)->pseudonym().size());
      auto it = storage_->prefix_iterator(storage_->sealed_index());
      it->Seek(pseudonym);
      if (Status s = from_rocksdb(it->status(), "sealed index read of " + user_text(u)); !s.ok()) return s;
      (it->Valid() && it->key().starts_with(pseudonym) ? in_use : out)->push_back(u);
    }
    return Status::OK();
  };
  std::vector<std::uint64_t> found;
  if (Status s = marked_keys(&found); !s.ok() || (found.empty() && replaced.empty())) return s;
  // Again with the writer held back, which could store a new key meanwhile.
  return state_->exclusive([&]() -> Status {
    if (Status s = marked_keys(&found); !s.ok() || (found.empty() && replaced.empty())) return s;
    Status s = delete_user_keys(*storage_, found, replaced,
                                "deleting the ledger keys of " + std::to_string(found.size()) +
                                    " purged users, and renewing the bucket keys of " +
                                    std::to_string(replaced.size()) + " whose keys replaced purged ones");
    for (std::uint64_t u : found) {
      if (s.ok()) state_->forget_ledger_key(u);
      else state_->revoke_ledger_key(u);
    }
    return s;
  });
}

Status Db::Impl::erase_purged(const std::vector<std::uint64_t>& users) {
  if (users.empty()) return Status::OK();
  // One erasure at a time: each waits for every obsolete file to go, and
  // two would hold each other's file deletions disabled.
  std::lock_guard<std::mutex> lock(erase_mu_);
  std::uint64_t generation;  // purge batches written before this erasure began
  {
    std::lock_guard<std::mutex> marks(marks_mu_);
    generation = generation_;
  }
  // A key the purge could not delete, or a crash kept.
  std::vector<std::uint64_t> in_use;
  if (Status s = delete_marked_keys(users, &in_use); !s.ok()) return s;
  // The replaced keys of the users' buckets (format 4), and the users'
  // records of format 3's ledger. Adjacent users share one range: a bulk
  // purge compacts only their ranges.
  std::vector<KeyRange> ledger_ranges, bucket_ranges;
  const auto add = [](std::vector<KeyRange>* ranges, std::string begin, std::string end) {
    if (!ranges->empty() && ranges->back().second == begin) ranges->back().second = std::move(end);
    else ranges->emplace_back(std::move(begin), std::move(end));
  };
  std::vector<std::uint64_t> buckets;
  for (std::uint64_t u : users) {
    add(&ledger_ranges, ledger_begin(u), ledger_end(u));
    buckets.push_back(key_bucket(u));
  }
  std::sort(buckets.begin(), buckets.end());
  buckets.erase(std::unique(buckets.begin(), buckets.end()), buckets.end());
  for (std::uint64_t b : buckets) {
    // The keys of the group's buckets, of every depth: [b] to [b + 1], or
    // past the last group: [0xffff] and 0xff (a deeper bucket's third byte
    // is its depth, at most 32).
    add(&bucket_ranges, encode_bucket_key(static_cast<std::uint16_t>(b)),
        b + 1 < kKeyBuckets ? encode_bucket_key(static_cast<std::uint16_t>(b + 1))
                            : encode_bucket_key(static_cast<std::uint16_t>(b)) + '\xff');
  }
  // The key store's WALs are flushed only when one may still hold a
  // replaced bucket key (the current keys are not erased), and only its
  // files that can hold one are compacted.
  if (Status s = erase_ranges(storage_->bucket_keys(), bucket_ranges, buckets, storage_->keys_written(buckets));
      !s.ok()) {
    return s;
  }
  if (Status s = erase_ranges(storage_->ledger(), ledger_ranges, users, Storage::KeysWritten{}); !s.ok()) return s;
  // The purge's own write, when it went through the state engine's WAL: the
  // receipt beside the subtraction (docs/PURGE.md, "What an attacker holding
  // the files can learn").
  if (Status s = retire_state_wals(); !s.ok()) return s;
  if (Status s = erase_purge_image(); !s.ok()) return s;
  // Erased: the marks go, except those of users whose next purge wrote its
  // batch (and its mark) after this erasure began: that purge's own
  // erasure removes it. Under marks_mu_, which a purge takes before its
  // batch, so such a batch's mark always lands after this delete. Not
  // synced: a deletion lost to a crash only makes the next open erase again.
  std::lock_guard<std::mutex> marks(marks_mu_);
  rocksdb::WriteBatch done;
  for (std::uint64_t u : users) {
    if (std::find(in_use.begin(), in_use.end(), u) != in_use.end()) continue;
    auto g = purge_generation_.find(u);
    if (g != purge_generation_.end() && g->second > generation) continue;
    done.Delete(storage_->state_meta(), erasure_pending_key(u));
    if (g != purge_generation_.end()) purge_generation_.erase(g);
  }
  return storage_->write(Storage::Engine::State, &done, Storage::WriteMode::Async, "erasure marks of " + std::to_string(users.size()) + " users");
}

Status Db::Impl::complete_pending_erasures() {
  std::vector<std::uint64_t> users;
  auto it = storage_->iterator(storage_->state_meta());
  const std::string_view prefix(kErasurePendingPrefix);
  for (it->Seek(rocksdb::Slice(prefix.data(), prefix.size())); it->Valid() && view(it->key()).starts_with(prefix);
       it->Next()) {
    if (it->key().size() == prefix.size() + 8) users.push_back(get_u64_be(it->key().data() + prefix.size()));
  }
  if (Status s = from_rocksdb(it->status(), "scan of the erasure marks of '" + storage_->path() + "'"); !s.ok()) return s;
  it.reset();
  if (!users.empty() && options_.strict_erasure) {
    std::lock_guard<std::mutex> lock(marks_mu_);
    purge_image_.everything = true;
  }
  return erase_purged(users);
}

namespace {

// Whether every file of `names` is still a live file of `cf` at `level`.
bool still_at(rocksdb::DB* db, rocksdb::ColumnFamilyHandle* cf, const std::vector<std::string>& names, int level) {
  rocksdb::ColumnFamilyMetaData meta;
  db->GetColumnFamilyMetaData(cf, &meta);
  return std::all_of(names.begin(), names.end(), [&](const std::string& name) {
    const auto& files = meta.levels[static_cast<std::size_t>(level)].files;
    return std::any_of(files.begin(), files.end(), [&](const rocksdb::SstFileMetaData& f) { return f.name == name; });
  });
}

// The files of one level below 0 from which compact_in_place compacts
// them in two halves.
constexpr std::size_t kHalvedLevelFiles = 8;

// The bucket keys' erasure, in the calling thread: compacts in place, each
// at its own level, every file of `cf` whose keys overlap one of `ranges`
// (sorted, disjoint; the keys of `buckets`, sorted) and that may hold one
// of their keys by its filter (Storage::may_hold_keys_of), and the replaced
// keys in them are dropped (Storage::KeysErased). The current keys stay
// where they are (level 0 or a memtable): a compaction of the old values'
// files together with theirs into the last level had RocksDB add every
// file under the range of each level-0 input, and a level-0 file spans
// nearly all of it (the keys written since the last flush, anywhere): a
// single purge at 1M users then rewrote the whole key store (47 MB) in a
// tenth of its erasures, its p99 step (bench/README.md, "Session 34"). A
// file whose entries all came after `written_by` holds no replaced key, and
// is left alone: once a purge no longer flushed the engine, the level-0 files
// (each a flush of keys made anywhere) were compacted in place into one
// that grew to 9 MB and that each single purge rewrote (bench/README.md,
// "Session 36"). `replaced` gets the names of the files the compactions
// replaced.
Status compact_in_place(const Storage& storage, rocksdb::DB* db, rocksdb::ColumnFamilyHandle* cf,
                        const std::vector<KeyRange>& ranges, const std::vector<std::uint64_t>& buckets,
                        std::uint64_t written_by, std::chrono::milliseconds wait, std::vector<std::string>* replaced) {
  const auto name_of = [](const std::string& path) { return std::filesystem::path(path).filename().string(); };
  std::vector<std::string> ours;  // the files these compactions wrote: they hold no purged key (sorted)
  std::map<std::string, std::shared_ptr<const rocksdb::TableProperties>> properties;  // of the live files, by name
  assert(std::is_sorted(buckets.begin(), buckets.end()));
  const auto overlaps = [&](const rocksdb::SstFileMetaData& f) {
    if (f.smallest_seqno > written_by || std::binary_search(ours.begin(), ours.end(), name_of(f.name))) return false;
    // The first range that ends after the file's smallest key.
    auto r = std::upper_bound(ranges.begin(), ranges.end(), f.smallestkey,
                              [](const std::string& key, const KeyRange& range) { return key < range.second; });
    if (r == ranges.end() || r->first > f.largestkey) return false;
    // The users whose keys can be in the file's key range, and whether its
    // filter rules them all out (unknown file: compacted).
    auto p = properties.find(name_of(f.name));
    if (p == properties.end() || p->second == nullptr) return true;
    // (The groups from the smallest key's to the largest's: a group's
    // deeper buckets' keys sort after its own two bytes.)
    const std::uint64_t smallest = bucket_key_group(f.smallestkey).value_or(0);
    const std::uint64_t largest = bucket_key_group(f.largestkey).value_or(kKeyBuckets - 1);
    auto first = std::lower_bound(buckets.begin(), buckets.end(), smallest);
    auto last = std::upper_bound(first, buckets.end(), largest);
    return Storage::may_hold_keys_of(*p->second, std::vector<std::uint64_t>(first, last));
  };
  rocksdb::ColumnFamilyMetaData before;
  db->GetColumnFamilyMetaData(cf, &before);
  // Output files of the column family's target size, as its own
  // compactions make them (CompactFiles makes one file by default).
  rocksdb::CompactionOptions options;
  options.output_file_size_limit = db->GetOptions(cf).target_file_size_base;
  Storage::KeysErased erasing(storage, ranges);
  Storage::test_step("erasure", 1);
  // RocksDB's own compactions of the column family run beside these. One
  // that holds a file named here, or writes into its range, makes
  // CompactFiles give up (Aborted); one that has replaced a file named here,
  // or moved it to another level, makes it refuse the name
  // (InvalidArgument). The files are then picked again, from what that
  // compaction wrote. Once a CompactFiles has its
  // files, no other compaction takes them, and the files it was not given
  // hold no purged key: no compaction can write one into a new file.
  // (Holding RocksDB's compactions back instead took two SetOptions
  // calls, each a MANIFEST and an OPTIONS file written and synced while
  // the engine's writes waited: 16.6 ms of a single purge at p50, 60 ms at
  // p99; bench/README.md, "Session 36".)
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (;;) {
    // Unreadable properties (of any file): every file that overlaps the
    // ranges is compacted.
    rocksdb::TablePropertiesCollection by_path;
    properties.clear();
    if (db->GetPropertiesOfAllTables(cf, &by_path).ok()) {
      for (auto& [path, p] : by_path) properties.emplace(name_of(path), std::move(p));
    }
    rocksdb::ColumnFamilyMetaData now;
    db->GetColumnFamilyMetaData(cf, &now);
    // The levels' compactions run side by side, each on its own level's
    // files: a single purge waits for the slowest, not for the sum of
    // their writes and fsyncs. A level below 0 with many files (a bulk
    // purge's) is compacted in two halves of adjacent files, side by side
    // too, their outputs in disjoint ranges: at 4M users a bulk purge's
    // 24 files took 109-138 ms instead of 179-211 (bench/README.md,
    // "Session 40"). (Level-0 files overlap: one compaction.)
    struct Level {
      int at;
      std::vector<std::string> inputs;
      std::vector<std::string> written;
      std::future<rocksdb::Status> done;
    };
    std::vector<Level> levels;
    levels.reserve(now.levels.size() * 2);
    for (const rocksdb::LevelMetaData& level : now.levels) {
      std::vector<std::string> inputs;
      for (const rocksdb::SstFileMetaData& f : level.files) {
        if (overlaps(f)) inputs.push_back(f.name);
      }
      if (inputs.empty()) continue;
      const std::size_t half = level.level > 0 && inputs.size() >= kHalvedLevelFiles ? (inputs.size() + 1) / 2
                                                                                      : inputs.size();
      for (std::size_t from = 0; from < inputs.size(); from += half) {
        std::vector<std::string> part(inputs.begin() + static_cast<std::ptrdiff_t>(from),
                                      inputs.begin() + static_cast<std::ptrdiff_t>(std::min(inputs.size(), from + half)));
        Level& l = levels.emplace_back(Level{level.level, std::move(part), {}, {}});
        l.done = std::async(std::launch::async, [&, l = &l] {
          return db->CompactFiles(options, cf, l->inputs, l->at, /*output_path_id=*/-1, &l->written);
        });
      }
    }
    if (levels.empty()) break;
    Status failed;
    bool again = false;
    for (Level& l : levels) {
      const rocksdb::Status s = l.done.get();
      for (const std::string& f : l.written) ours.push_back(name_of(f));
      if (s.ok()) continue;
      if (s.IsAborted() || (s.IsInvalidArgument() && !still_at(db, cf, l.inputs, l.at))) {
        again = true;
      } else if (failed.ok()) {
        failed = from_rocksdb(s, "compaction of the purged " + cf->GetName() + " ranges at level " +
                                     std::to_string(l.at) + " (" + std::to_string(l.inputs.size()) + " files)");
      }
    }
    std::sort(ours.begin(), ours.end());
    if (!failed.ok()) return failed;
    if (erasing.unread() > 0) {
      return Status::IOError("compaction of the purged " + cf->GetName() + " ranges: " +
                             std::to_string(erasing.unread()) +
                             " values were kept because the key store could not be read for their current value");
    }
    if (!again) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::IOError("compaction of the purged " + cf->GetName() + " ranges: RocksDB's own compactions kept "
                             "their files for more than " + std::to_string(wait.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Replaced: the files of before that are gone from the column family
  // (replaced by these compactions, or by RocksDB's beside them; a flush
  // only adds files).
  rocksdb::ColumnFamilyMetaData after;
  db->GetColumnFamilyMetaData(cf, &after);
  std::vector<std::string> live;
  for (const rocksdb::LevelMetaData& level : after.levels) {
    for (const rocksdb::SstFileMetaData& f : level.files) live.push_back(name_of(f.name));
  }
  std::sort(live.begin(), live.end());
  for (const rocksdb::LevelMetaData& level : before.levels) {
    for (const rocksdb::SstFileMetaData& f : level.files) {
      std::string name = name_of(f.name);
      if (!std::binary_search(live.begin(), live.end(), name)) replaced->push_back(std::move(name));
    }
  }
  std::sort(replaced->begin(), replaced->end());
  return Status::OK();
}

}  // namespace

Status Db::Impl::erase_ranges(rocksdb::ColumnFamilyHandle* cf, const std::vector<KeyRange>& ranges,
                              const std::vector<std::uint64_t>& ids, const Storage::KeysWritten& written) {
  if (cf == nullptr || ranges.empty()) return Status::OK();
  const bool key_store = cf == storage_->bucket_keys();
  const Storage::Engine engine = key_store ? Storage::Engine::Users : Storage::Engine::State;
  rocksdb::DB* db = storage_->db(engine);
  const std::string dir = key_store ? storage_->path() : storage_->state_path();
  // Format 3's ledger has no file in a Db created in format 4, and format 4
  // never writes it (a purge ingests its range deletions as files): nothing
  // to erase there.
  if (!key_store) {
    rocksdb::ColumnFamilyMetaData files;
    db->GetColumnFamilyMetaData(cf, &files);
    if (files.file_count == 0) return Status::OK();
  }
  // Every memtable to SST: the WALs that held the purged keys (and the
  // purge's key deletions) are then no longer needed by any column family.
  // The flush must also record that in RocksDB's min-log-number-to-keep,
  // which decides when a WAL is deleted, even when every memtable is empty:
  // an open that replayed no data (a crash after the flush that ended
  // them, before RocksDB deleted them) leaves that number where it was, and
  // the logs stayed on disk, the purged key in them, until some later
  // flush (seen in CrashTest.PurgesAreAllOrNothing...). Not needed when the
  // purged keys were all in SST files already (Storage::keys_written):
  // a WAL that held one was then behind the last flush, and the wait for
  // the stale WALs below still sees it deleted.
  if (written.in_wals) {
    if (Status s = storage_->flush_past_wals(engine); !s.ok()) return s;
  }
  // A compaction keeps what a snapshot older than the purge can still see:
  // wait until every such snapshot is released. Later snapshots (the
  // writer's) see the deletion. A verify() or re-materialization under way
  // lets go of its own at once and starts over (storage/ledger_scan.h).
  const rocksdb::SequenceNumber purged = db->GetLatestSequenceNumber();
  storage_->ask_scans_to_let_go();
  // A check that has started over kLedgerCheckLetGoes times holds its
  // snapshot to the end of its pass: the time limit starts once none holds.
  auto deadline = std::chrono::steady_clock::now() + erasure_wait;
  const auto hold_on = [&](std::chrono::steady_clock::time_point* limit) {
    if (storage_->scans_holding().load(std::memory_order_seq_cst) > 0) {
      *limit = std::chrono::steady_clock::now() + erasure_wait;
    }
  };
  for (;;) {
    hold_on(&deadline);
    std::uint64_t oldest = 0;
    if (!db->GetIntProperty(rocksdb::DB::Properties::kOldestSnapshotSequence, &oldest)) {
      return Status::IOError("cannot read rocksdb.oldest-snapshot-sequence of '" + dir + "'");
    }
    if (oldest == 0 || oldest >= purged) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      return Status::IOError("a snapshot older than the purge (sequence " + std::to_string(oldest) + " < " +
                             std::to_string(purged) + ") was not released within " +
                             std::to_string(erasure_wait.count()) + " ms");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::vector<std::string> replaced;  // the key store's files its erasure compacted (sorted)
  if (key_store) {
    // The key store: compacted in this thread (CompactFiles), file by file.
    if (Status s = compact_in_place(*storage_, db, cf, ranges, ids, written.by, erasure_wait, &replaced); !s.ok()) {
      return s;
    }
  } else {
    // Format 3's ledger: exclusive (RocksDB waits for every compaction
    // under way), on the engine's compaction thread: no compaction of the
    // column family may run beside a CompactRange's, as one that started
    // before the purge was flushed can write the purged records into a new
    // file after the manual compaction has passed its range (seen once in
    // CI with compactions starting at 2 L0 files).
    rocksdb::CompactRangeOptions options;
    // Every file of the range at the last level is rewritten, except those
    // this same compaction has just written there: they came out of the
    // compaction of the purge's range tombstones into the last level, which
    // dropped the records the tombstones cover (and, with no older
    // snapshot, the tombstones). kForce rewrote those a second time: at 1M
    // users the erasure of a bulk purge of 5,000 users (in ranges of at
    // most 64 files) took 62.6 s with it, 56.7 s without (bench/README.md).
    options.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForceOptimized;
    options.exclusive_manual_compaction = true;
    for (const auto& [begin, end] : JoinRanges(ranges, ListLevelFiles(db, cf->GetName()), kErasureFilesPerCompaction)) {
      const rocksdb::Slice b(begin), e(end);
      if (Status s = from_rocksdb(db->CompactRange(options, cf, &b, &e),
                                  "compaction of the purged " + cf->GetName() + " range of '" + storage_->path() + "'");
          !s.ok()) {
        return s;
      }
    }
  }
  // No live file holds a purged record now; obsolete ones still may, until
  // RocksDB deletes them. Those on disk now (and not live) are the ones to
  // wait for: a file created later is made from live files, or is a batch
  // of the writer, and holds none. RocksDB deletes a file only once every
  // compaction of the engine that began before it was written has ended:
  // in the users engine, the key store's own and the users partition's,
  // of small files. (In the state engine the aggregates' and
  // the sealed ledger's ran for seconds: the erasure of a bulk purge at 1M
  // users waited 9.7 s there; bench/README.md, "Format 4".)
  // A ledger check under way lets go of the files it reads, which may be
  // the ones the compaction replaced.
  storage_->ask_scans_to_let_go();
  Result<std::vector<std::string>> obsolete = obsolete_files(engine);
  if (!obsolete.ok()) return obsolete.status();
  // Only the erased column family's files can hold what it erased: the
  // obsolete files of the engine's other families are not waited for, nor
  // are the outputs its flushes and compactions are writing (on disk, not
  // live yet, and with no table footer until they are complete): a
  // compaction of the users partition writes its output for up to seconds
  // at 1M users, and a single purge waited for it (bench/README.md,
  // "Session 34"). No output being written holds an erased record: a
  // compaction of the family under way took none of the files that held
  // one (those were the erasure's own, compact_in_place; or the erasure was
  // exclusive), and its flushes write what came after the flush above.
  std::vector<std::string> waiting;
  const rocksdb::Options cf_options = db->GetOptions(cf);
  for (std::string& name : *obsolete) {
    rocksdb::SstFileReader reader(cf_options);
    const rocksdb::Status opened = reader.Open(dir + "/" + name);
    if (opened.IsCorruption()) continue;  // being written
    // Unreadable (or deleted meanwhile: the loop below sees it gone): waited for.
    const std::shared_ptr<const rocksdb::TableProperties> properties =
        opened.ok() ? reader.GetTableProperties() : nullptr;
    if (properties != nullptr && properties->column_family_name != cf->GetName()) continue;
    waiting.push_back(std::move(name));
  }
  std::string stale_wal;
  auto give_up = std::chrono::steady_clock::now() + erasure_wait;
  for (;;) {
    hold_on(&give_up);
    // Re-enabling deletions runs a full purge of obsolete files in this
    // thread (erase_mu_ keeps other erasures from holding them disabled).
    if (Status s = from_rocksdb(db->DisableFileDeletions(), "disable file deletions"); !s.ok()) return s;
    if (Status s = from_rocksdb(db->EnableFileDeletions(/*force=*/false), "enable file deletions"); !s.ok()) return s;
    // Still waiting for: what is still on disk and not live (a file another
    // thread is deleting, or one a reader's iterator still holds).
    Result<std::vector<std::string>> now = obsolete_files(engine);
    if (!now.ok()) return now.status();
    std::vector<std::string> still;
    std::set_intersection(waiting.begin(), waiting.end(), now->begin(), now->end(), std::back_inserter(still));
    waiting = std::move(still);
    // The key store's files that the erasure itself replaced, when RocksDB
    // kept them: it keeps a file newer than the start of any compaction of
    // the engine under way until that compaction ends (the users
    // partition's run for seconds: a single purge at 1M users waited up to
    // 1.5 s here). No reader needs them by name: RocksDB opens each table
    // file once, as it is written (max_open_files -1), and a reader of an
    // older version reads it through that descriptor; a backup, which
    // links files by name, does so under key_store_mu, taken here.
    std::vector<std::string> ours;
    std::set_intersection(waiting.begin(), waiting.end(), replaced.begin(), replaced.end(), std::back_inserter(ours));
    if (!ours.empty()) {
      std::unique_lock<std::shared_mutex> no_copy(storage_->key_store_mu());
      for (const std::string& name : ours) {
        const std::string file = dir + "/" + name;
        // RocksDB may have deleted it meanwhile (its compaction ended).
        const rocksdb::Status d = db->GetEnv()->DeleteFile(file);
        if (!d.ok() && !db->GetEnv()->FileExists(file).IsNotFound()) {
          return from_rocksdb(d, "deleting the replaced key-store file '" + file + "'");
        }
      }
      std::vector<std::string> rest;
      std::set_difference(waiting.begin(), waiting.end(), ours.begin(), ours.end(), std::back_inserter(rest));
      waiting = std::move(rest);
    }
    Result<std::string> wal = this->stale_wal(engine);
    if (!wal.ok()) return wal.status();
    stale_wal = std::move(*wal);
    if (waiting.empty() && stale_wal.empty()) return Status::OK();
    if (std::chrono::steady_clock::now() >= give_up) {
      return Status::IOError("obsolete file '" + dir + "/" +
                             (waiting.empty() ? stale_wal : waiting.front()) + "' was not deleted within " +
                             std::to_string(erasure_wait.count()) +
                             " ms (an iterator still open on the engine holds the files it reads)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Result<std::string> Db::Impl::stale_wal(Storage::Engine engine) const {
  const std::string dir = engine == Storage::Engine::Users ? storage_->path() : storage_->state_path();
  std::uint64_t keep = 0;
  if (!storage_->db(engine)->GetIntProperty(rocksdb::DB::Properties::kMinLogNumberToKeep, &keep)) {
    return Status::IOError("cannot read rocksdb.min-log-number-to-keep of '" + dir + "'");
  }
  std::string stale;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 4 && name.ends_with(".log") && std::strtoull(name.c_str(), nullptr, 10) < keep) stale = name;
  }
  if (ec) return Status::IOError("listing '" + dir + "': " + ec.message());
  return stale;
}

Status Db::Impl::erase_purge_image() {
  if (!options_.strict_erasure) return Status::OK();
  PurgeImage image;
  {
    std::lock_guard<std::mutex> lock(marks_mu_);
    std::swap(image, purge_image_);
  }
  if (image.everything) {
    // Past every key of the three families (none is longer than 64 bytes).
    const KeyRange all{std::string(), std::string(64, '\xff')};
    image.aggregates.assign(1, all);
    image.receipts.assign(1, all);
    image.sealed_index.assign(1, all);
  }
  // Sorted and disjoint, as erase_ranges takes them.
  const auto merged = [](std::vector<KeyRange> ranges) {
    std::sort(ranges.begin(), ranges.end());
    std::vector<KeyRange> out;
    for (KeyRange& r : ranges) {
      if (!out.empty() && r.first <= out.back().second) out.back().second = std::max(out.back().second, r.second);
      else out.push_back(std::move(r));
    }
    return out;
  };
  // Every purge batch whose ranges these are is in SST files already:
  // retire_state_wals flushed the engine after them, so erase_ranges need
  // not flush it again for each column family.
  const Storage::KeysWritten flushed{/*in_wals=*/false};
  Status s;
  for (auto [cf, ranges] : {std::pair{storage_->aggregates(), &image.aggregates},
                            std::pair{storage_->receipts(), &image.receipts},
                            std::pair{storage_->sealed_index(), &image.sealed_index}}) {
    if (s.ok()) s = erase_ranges(cf, merged(*ranges), {}, flushed);
  }
  // The MANIFESTs so far recorded the files the purge's batch went into,
  // which tie the receipts' keys to the purged pseudonyms by their sequence
  // numbers. Each edit begins a new MANIFEST (Storage::Config::
  // state_manifest_per_edit) with the live files as they were before it,
  // then the edit: one more edit after the compactions' (a flush) begins
  // one that lists the files they left, and the ones before are deleted.
  if (s.ok()) s = storage_->flush_past_wals(Storage::Engine::State);
  if (s.ok()) s = await_state_deletions([this] { return stale_state_manifest(); }, "MANIFEST");
  if (!s.ok()) {
    // The next erasure compacts these again (the marks stay meanwhile).
    std::lock_guard<std::mutex> lock(marks_mu_);
    purge_image_.add(image);
  }
  return s;
}

Status Db::Impl::retire_state_wals() {
  if (storage_->db(Storage::Engine::State) == nullptr) return Status::OK();
  if (Status s = storage_->flush_past_wals(Storage::Engine::State); !s.ok()) return s;
  return await_state_deletions([this] { return stale_wal(Storage::Engine::State); },
                               "WAL, which may hold the purge's batch,");
}

Result<std::string> Db::Impl::stale_state_manifest() const {
  const std::string dir = storage_->state_path();
  std::ifstream in(dir + "/CURRENT");
  std::string current;
  if (!std::getline(in, current)) return Status::IOError("cannot read '" + dir + "/CURRENT'");
  std::string stale;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    if (name.starts_with("MANIFEST-") && name != current) stale = std::move(name);
  }
  if (ec) return Status::IOError("listing '" + dir + "': " + ec.message());
  return stale;
}

Status Db::Impl::await_state_deletions(const std::function<Result<std::string>()>& stale, std::string_view what) {
  rocksdb::DB* db = storage_->db(Storage::Engine::State);
  // RocksDB deletes obsolete files in the background; re-enabling file
  // deletions deletes them in this thread (erase_mu_ keeps other erasures
  // from holding deletions disabled meanwhile).
  const auto give_up = std::chrono::steady_clock::now() + erasure_wait;
  for (;;) {
    Result<std::string> file = stale();
    if (!file.ok()) return file.status();
    if (file->empty()) return Status::OK();
    if (std::chrono::steady_clock::now() >= give_up) {
      return Status::IOError("the state engine's " + std::string(what) + " '" + storage_->state_path() + "/" + *file +
                             "' was not deleted within " + std::to_string(erasure_wait.count()) + " ms");
    }
    if (Status s = from_rocksdb(db->DisableFileDeletions(), "disable file deletions"); !s.ok()) return s;
    if (Status s = from_rocksdb(db->EnableFileDeletions(/*force=*/false), "enable file deletions"); !s.ok()) return s;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Result<std::vector<std::string>> Db::Impl::obsolete_files(Storage::Engine engine) const {
  const std::string dir = engine == Storage::Engine::Users ? storage_->path() : storage_->state_path();
  std::vector<rocksdb::LiveFileMetaData> live_meta;
  storage_->db(engine)->GetLiveFilesMetaData(&live_meta);
  std::vector<std::string> live;
  for (const rocksdb::LiveFileMetaData& f : live_meta) live.push_back(std::filesystem::path(f.name).filename().string());
  std::sort(live.begin(), live.end());
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::string name = entry.path().filename().string();
    if (name.ends_with(".sst") && !std::binary_search(live.begin(), live.end(), name)) out.push_back(std::move(name));
  }
  if (ec) return Status::IOError("listing '" + dir + "': " + ec.message());
  std::sort(out.begin(), out.end());
  return out;
}

Result<std::vector<PurgeReceipt>> Db::Impl::purge_receipts(std::uint64_t user_id) const {
  return guarded("purge_receipts", [&]() -> Result<std::vector<PurgeReceipt>> {
    Call call(this, "purge_receipts", /*write=*/false);
    if (!call.status().ok()) return call.status();
    const std::string prefix = encode_key_prefix(EntityId(user_id), Tag::PurgeManifest);
    std::vector<PurgeReceipt> out;
    auto it = storage_->iterator(storage_->receipts());
    for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
      const std::string_view key = view(it->key());
      std::optional<ReceiptRecord> r = decode_receipt(view(it->value()));
      if (key.size() != prefix.size() + 8 || !r || r->purged_at_ns != get_u64_be(key.data() + 9)) {
        return Status::Corruption("purge receipt " + hex(key) + " of " + user_text(user_id) + " in '" +
                                  storage_->path() + "' does not decode (" + std::to_string(it->value().size()) +
                                  "-byte value; expected " + std::to_string(kReceiptSize) +
                                  " bytes of version 1 whose purged_at_ns matches the key)");
      }
      out.push_back(to_public(user_id, *r, /*erasure_complete=*/true));
    }
    if (Status s = from_rocksdb(it->status(), "purge_receipts(" + user_text(user_id) + ")"); !s.ok()) return s;
    Result<std::optional<std::uint64_t>> marked = erasure_pending_since(user_id);
    if (!marked.ok()) return marked.status();
    for (PurgeReceipt& r : out) r.erasure_complete = !*marked || r.purged_at_ns < **marked;
    return out;
  });
}

}  // namespace tidal
