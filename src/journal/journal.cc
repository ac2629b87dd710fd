#include "journal/journal.h"

#include <algorithm>
#include <limits>

#include "storage/format.h"
#include "storage/numbered_log.h"

namespace tidal {
namespace {

std::string_view view(const rocksdb::Slice& s) { return {s.data(), s.size()}; }

std::string be64(std::uint64_t v) {
  std::string out;
  put_u64_be(&out, v);
  return out;
}

// The journal's entry records (storage/numbered_log.h).
NumberedLog journal_log(const Storage& storage) {
  return {&storage, "privacy journal", "confirmed point", encode_journal_key, decode_journal_key};
}

// A group stops growing past this many entries (one bulk call of 10,000
// users is always written whole): a batch stays near a few MB.
constexpr std::size_t kMaxGroupEntries = 20'000;
// A confirm that removes more entries than this writes one range deletion
// instead of a deletion per entry.
constexpr std::uint64_t kPointDeletes = 1024;

}  // namespace

Result<std::optional<std::uint64_t>> Journal::stored_shard(const Storage& storage) {
  return journal_log(storage).stored_shard(storage.meta(), kJournalShardKey);
}

Status Journal::check(const Storage& storage, std::uint64_t shard_id) {
  Result<std::optional<std::uint64_t>> stored = stored_shard(storage);
  if (!stored.ok()) return stored.status();
  if (Status s = journal_log(storage).check_shard(*stored, shard_id); !s.ok() || !*stored) return s;
  Journal probe(const_cast<Storage*>(&storage), shard_id, Storage::WriteMode::Sync);
  return probe.load();
}

Result<std::unique_ptr<Journal>> Journal::open(Storage* storage, std::uint64_t shard_id, Storage::WriteMode mode) {
  Result<std::optional<std::uint64_t>> stored = stored_shard(*storage);
  if (!stored.ok()) return stored.status();
  if (Status s = journal_log(*storage).check_shard(*stored, shard_id); !s.ok()) return s;
  std::unique_ptr<Journal> journal(new Journal(storage, shard_id, mode));
  if (!*stored) {
    if (storage->read_only()) {
      return Status::InvalidArgument("cannot open tidal Db at '" + storage->path() +
                                     "' read-only with Options::journal: it keeps no privacy journal yet");
    }
    // Synced: once the shard id is stored, every writable open must keep
    // the journal (and the same shard id), so no leave escapes it.
    rocksdb::WriteBatch batch;
    batch.Put(storage->meta(), kJournalShardKey, be64(shard_id));
    if (Status s = storage->write(Storage::Engine::Users, &batch, Storage::WriteMode::Sync,
                                  "creating the privacy journal of '" + storage->path() + "'");
        !s.ok()) {
      return s;
    }
  }
  if (Status s = journal->load(); !s.ok()) return s;
  return journal;
}

Status Journal::load() {
  const NumberedLog log = journal_log(*storage_);
  Result<LogPoint> confirmed = log.removed(storage_->meta(), kJournalConfirmedKey);
  if (!confirmed.ok()) return confirmed.status();
  auto it = storage_->iterator(storage_->meta());
  it->SeekForPrev(encode_journal_key(std::numeric_limits<std::uint64_t>::max()));
  if (Status s = from_rocksdb(it->status(), "reading the privacy journal of '" + storage_->path() + "'"); !s.ok()) {
    return s;
  }
  const bool any = it->Valid() && view(it->key()).starts_with(kJournalEntryPrefix);
  Result<LogPoint> end = log.end(any ? it.get() : nullptr, *confirmed);
  if (!end.ok()) return end.status();
  std::lock_guard<std::mutex> lock(mu_);
  confirmed_seq_ = confirmed->seq;
  replicated_seq_ = confirmed_seq_;
  confirmed_offset_ = confirmed->offset;
  replicated_offset_ = confirmed_offset_;
  last_seq_ = end->seq;
  end_offset_ = end->offset;
  return Status::OK();
}

Result<std::uint64_t> Journal::write(const Fill& fill, std::span<const JournalRecord> entries,
                                     const std::string& what) {
  Writer w{&fill, entries, &what, Status::OK()};
  std::unique_lock<std::mutex> lock(mu_);
  queue_.push_back(&w);
  written_.wait(lock, [&] { return w.done || (!leading_ && queue_.front() == &w); });
  if (!w.done) {
    // The leader: the group is this writer and those queued behind it.
    leading_ = true;
    std::vector<Writer*> group;
    std::size_t total = 0;
    while (!queue_.empty() && (group.empty() || total + queue_.front()->entries.size() <= kMaxGroupEntries)) {
      total += queue_.front()->entries.size();
      group.push_back(queue_.front());
      queue_.pop_front();
    }
    std::uint64_t seq = last_seq_, offset = end_offset_;
    lock.unlock();
    const Status s = write_group(group, &seq, &offset);
    lock.lock();
    if (s.ok()) {
      last_seq_ = seq;
      end_offset_ = offset;
    }
    for (Writer* g : group) {
      g->status = s.ok() || group.size() == 1
                      ? s
                      : Status(s.code(), *g->what + ": the journal's write of a group of " +
                                             std::to_string(group.size()) + " calls failed: " + s.message());
      g->done = true;
    }
    leading_ = false;
    written_.notify_all();
  }
  if (!w.status.ok()) return w.status;
  return w.last_seq;
}

Status Journal::write_group(const std::vector<Writer*>& group, std::uint64_t* seq, std::uint64_t* offset) {
  // No exception may leave the leader: its followers would wait forever.
  try {
    rocksdb::WriteBatch batch;
    for (Writer* g : group) {
      (*g->fill)(&batch, *seq + 1);
      for (const JournalRecord& r : g->entries) {
        const std::string payload = encode_journal_payload(r);
        *offset += payload.size();
        ++*seq;
        batch.Put(storage_->meta(), encode_journal_key(*seq), encode_log_value(*offset, payload));
      }
      g->last_seq = *seq;
    }
    return storage_->write(Storage::Engine::Users, &batch, mode_, *group.front()->what);
  } catch (const std::exception& e) {
    return Status::IOError(*group.front()->what + ": building the journal's write failed: " + e.what());
  }
}

Result<std::vector<JournalEntry>> Journal::read(std::uint64_t after_seq, std::size_t max_bytes) const {
  std::uint64_t confirmed = 0, last = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    confirmed = confirmed_seq_;
    last = last_seq_;
  }
  if (after_seq < confirmed) {
    return Status::NotFound("read_journal(after " + std::to_string(after_seq) + "): the privacy journal of shard " +
                            std::to_string(shard_id_) + " is confirmed through seq " + std::to_string(confirmed) +
                            "; entries " + std::to_string(after_seq + 1) + ".." + std::to_string(confirmed) +
                            " are removed");
  }
  const NumberedLog log = journal_log(*storage_);
  std::vector<JournalEntry> out;
  std::size_t bytes = 0;
  if (after_seq >= last) return out;
  // Without sync_writes an entry is written before it is durable: it is
  // read (and published) only once it is, or a power cut could take back
  // an entry the stream holds, and the Db would write its seq again with
  // other content. The entries through `last` were written before this
  // sync began (it waits for one under way).
  if (mode_ == Storage::WriteMode::Async) {
    if (Status s = storage_->sync_users_wal(); !s.ok()) return s;
  }
  auto it = storage_->iterator(storage_->meta());
  for (it->Seek(encode_journal_key(after_seq + 1));
       it->Valid() && after_seq + out.size() < last && (out.empty() || bytes < max_bytes); it->Next()) {
    const std::uint64_t seq = after_seq + 1 + out.size();
    Result<std::string_view> payload = log.payload(*it, seq);
    if (!payload.ok()) return payload.status();
    JournalEntry& e = out.emplace_back();
    e.shard_id = shard_id_;
    e.seq = seq;
    e.payload.assign(*payload);
    bytes += e.payload.size();
  }
  if (Status s = from_rocksdb(it->status(), "reading the privacy journal of '" + storage_->path() + "'"); !s.ok()) {
    return s;
  }
  if (out.empty()) {
    return Status::Corruption("the privacy journal of '" + storage_->path() + "' has no record of seq " +
                              std::to_string(after_seq + 1) + " (it ends at seq " + std::to_string(last) + ")");
  }
  return out;
}

std::uint64_t Journal::last_seq() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_seq_;
}

std::uint64_t Journal::confirmed_seq() const {
  std::lock_guard<std::mutex> lock(mu_);
  return replicated_seq_;
}

Status Journal::confirm(std::uint64_t through_seq) {
  std::lock_guard<std::mutex> one_confirm(confirm_mu_);
  std::uint64_t last = 0, confirmed = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    last = last_seq_;
    confirmed = confirmed_seq_;
  }
  if (through_seq > last) {
    return Status::InvalidArgument("confirm_journal(" + std::to_string(through_seq) +
                                   "): the privacy journal of shard " + std::to_string(shard_id_) +
                                   " ends at seq " + std::to_string(last) + "; nothing confirmed");
  }
  if (through_seq <= confirmed) return Status::OK();
  Result<std::uint64_t> offset = journal_log(*storage_).end_offset(storage_->meta(), through_seq);
  if (!offset.ok()) return offset.status();
  // The caller says the stream holds the entries: their waiters are
  // replicated now, whatever becomes of the write below, which only keeps
  // the point and drops the entries (a failed one is retried by the next
  // confirm; the publisher confirms again what it finds in the stream).
  // Woken before it, a replicated leave does not wait for it. The write is
  // not synced: it is durable with the users engine's next WAL sync (the
  // next synced leave, rejoin or purge; the periodic sync without
  // sync_writes) or memtable flush, and a power cut before that takes back
  // only this bookkeeping: the entries are read again, and the publisher,
  // finding them in the stream, confirms them again. Synced, its fsync sat
  // in front of the next leave's own write (one WAL), on every replicated
  // leave's path.
  {
    std::lock_guard<std::mutex> lock(mu_);
    replicated_seq_ = std::max(replicated_seq_, through_seq);
    replicated_offset_ = std::max(replicated_offset_, *offset);
  }
  confirmed_.notify_all();
  rocksdb::WriteBatch batch;
  if (through_seq - confirmed > kPointDeletes) {
    batch.DeleteRange(storage_->meta(), encode_journal_key(confirmed + 1), encode_journal_key(through_seq + 1));
  } else {
    for (std::uint64_t seq = confirmed + 1; seq <= through_seq; ++seq) batch.Delete(storage_->meta(), encode_journal_key(seq));
  }
  batch.Put(storage_->meta(), kJournalConfirmedKey, encode_log_point({through_seq, *offset}));
  if (Status s = storage_->write(Storage::Engine::Users, &batch, Storage::WriteMode::Async,
                                 "confirm_journal(" + std::to_string(through_seq) + ") of '" + storage_->path() + "'");
      !s.ok()) {
    return s;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    confirmed_seq_ = std::max(confirmed_seq_, through_seq);
    confirmed_offset_ = std::max(confirmed_offset_, *offset);
  }
  return Status::OK();
}

bool Journal::wait_confirmed(std::uint64_t seq, std::chrono::milliseconds wait) const {
  std::unique_lock<std::mutex> lock(mu_);
  confirmed_.wait_for(lock, wait, [&] { return replicated_seq_ >= seq || shutdown_; });
  return replicated_seq_ >= seq;
}

std::uint64_t Journal::wait_written(std::uint64_t after_seq, std::chrono::milliseconds wait) const {
  std::unique_lock<std::mutex> lock(mu_);
  written_.wait_for(lock, wait, [&] { return last_seq_ > after_seq || shutdown_; });
  return last_seq_;
}

void Journal::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
  }
  confirmed_.notify_all();
  written_.notify_all();  // wait_written returns; queued writers look again and wait on
}

Journal::Stats Journal::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {shard_id_, last_seq_, replicated_seq_, end_offset_ - replicated_offset_};
}

}  // namespace tidal
