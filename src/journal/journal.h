// The Db's privacy journal (docs/CONTRACT.md J1-J6; docs/FORMAT.md, "The
// privacy journal"): every leave, rejoin and purge intent as an entry
// numbered 1, 2, 3, ... per shard, written in the same atomic write of the
// users engine as the record it journals, and kept until confirm_journal.
// The change feed's sibling (feed/change_feed.h), with the same read and
// confirm (trim) shape; it lives in the users engine, as the records it
// journals do, and never touches the state engine.
//
// Writers (leaves, rejoins, purge intents, on any thread, each holding its
// users' lock stripes) commit in groups: the first caller to find no write
// under way becomes the leader, takes every caller queued so far, gives
// their entries the next seqs in queue order, adds their records and their
// entries to one WriteBatch and writes it once (one fsync for the group:
// RocksDB's own group commit, which a mutex around each write would lose).
// A failed write commits nothing, so its seqs are used again; a write whose
// outcome RocksDB cannot tell leaves RocksDB refusing every later write
// until a reopen, which reads the last seq from disk. So a seq is never
// skipped and never reused, and entries land in seq order.
//
// Lock order: a caller's stripes, then mu_ (never the other way); the
// leader writes holding no lock but its callers' stripes (its own and, by
// proxy, those of the callers it writes for, who wait).
#ifndef TIDAL_JOURNAL_JOURNAL_H_
#define TIDAL_JOURNAL_JOURNAL_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <rocksdb/write_batch.h>

#include "storage/journal_format.h"
#include "storage/storage.h"
#include "tidal/journal_entry.h"

namespace tidal {

class Journal {
 public:
  struct Stats {
    std::uint64_t shard_id = 0;
    std::uint64_t last_seq = 0;
    std::uint64_t confirmed_seq = 0;  // the last confirm()'s (its write may be under way)
    std::uint64_t pending_bytes = 0;  // payload bytes of the unconfirmed entries
  };
  // Adds the caller's own records (the ones the entries journal) to the
  // batch; `first_seq` is the seq its first entry gets.
  using Fill = std::function<void(rocksdb::WriteBatch* batch, std::uint64_t first_seq)>;

  // The shard id stored in a Db, if it keeps a journal.
  static Result<std::optional<std::uint64_t>> stored_shard(const Storage& storage);
  // What open() can refuse, found by reading only: a stored shard id other
  // than `shard_id` (InvalidArgument, nothing changed), a confirmed point or
  // last entry that does not decode (Corruption).
  static Status check(const Storage& storage, std::uint64_t shard_id);
  // The journal of a Db opened with Options::journal (or read-only, one that
  // keeps it): at the first writable open, stores the shard id (synced).
  static Result<std::unique_ptr<Journal>> open(Storage* storage, std::uint64_t shard_id, Storage::WriteMode mode);

  // One atomic write of the users engine: `fill`'s records and one entry per
  // record of `entries`, numbered from the next seq. The seq of the last
  // entry on success (written, durable per the mode, readable); the write's
  // error otherwise (nothing committed; the outcome of a failed write is
  // unknown, as RocksDB's). `what` names the caller's call, for errors.
  Result<std::uint64_t> write(const Fill& fill, std::span<const JournalRecord> entries, const std::string& what);

  // Entries with seq > after_seq, oldest first, up to about max_bytes of
  // payload (at least one when there is one). NotFound when entries after
  // after_seq were confirmed and removed already.
  Result<std::vector<JournalEntry>> read(std::uint64_t after_seq, std::size_t max_bytes) const;
  std::uint64_t last_seq() const;
  // Waits until the journal holds an entry past `after_seq`, for at most
  // `wait` or until shutdown(); the last seq then (after_seq or less when
  // none came). For the journal's publisher: it wakes at a new entry.
  std::uint64_t wait_written(std::uint64_t after_seq, std::chrono::milliseconds wait) const;
  // Durable on return. Wakes every waiter it covers before its write: the
  // caller's word that the entries are replicated is what they wait for.
  Status confirm(std::uint64_t through_seq);
  // Waits until a confirm() covered `seq` (its write need not have ended),
  // for at most `wait` or until shutdown(). True when one did.
  bool wait_confirmed(std::uint64_t seq, std::chrono::milliseconds wait) const;
  // Wakes every waiter (close()): they return at once, unconfirmed.
  void shutdown();
  // What the last confirm() named (its write may be under way).
  std::uint64_t confirmed_seq() const;
  Stats stats() const;

 private:
  Journal(Storage* storage, std::uint64_t shard_id, Storage::WriteMode mode)
      : storage_(storage), shard_id_(shard_id), mode_(mode) {}
  Status load();  // last seq, confirmed point and offsets, from disk
  // A caller of write(), queued until its group is written.
  struct Writer {
    const Fill* fill;
    std::span<const JournalRecord> entries;
    const std::string* what;
    Status status;
    std::uint64_t last_seq = 0;
    bool done = false;
  };
  // The leader's part: writes `group` (seqs from `seq` + 1, bytes from
  // `offset`) in one batch; sets each writer's last_seq; the write's status.
  Status write_group(const std::vector<Writer*>& group, std::uint64_t* seq, std::uint64_t* offset);

  Storage* const storage_;
  const std::uint64_t shard_id_;
  const Storage::WriteMode mode_;
  // Serializes confirm() from its check of the confirmed point to its write
  // of the record, so that the record never goes backwards.
  std::mutex confirm_mu_;
  mutable std::mutex mu_;
  mutable std::condition_variable written_;    // a group was written (queued writers and wait_written look), or shutdown
  mutable std::condition_variable confirmed_;  // confirmed_seq_ grew, or shutdown
  std::deque<Writer*> queue_;                  // writers waiting for a leader
  bool leading_ = false;                       // a leader is writing a group
  bool shutdown_ = false;
  std::uint64_t last_seq_ = 0;
  std::uint64_t end_offset_ = 0;        // payload bytes ever appended, through last_seq_
  std::uint64_t confirmed_seq_ = 0;     // stored by confirm()
  std::uint64_t replicated_seq_ = 0;    // named by a confirm() (>= confirmed_seq_): what waiters wait for
  std::uint64_t confirmed_offset_ = 0;  // payload bytes ever appended, through confirmed_seq_
  std::uint64_t replicated_offset_ = 0;  // the same, through replicated_seq_
};

}  // namespace tidal

#endif  // TIDAL_JOURNAL_JOURNAL_H_
