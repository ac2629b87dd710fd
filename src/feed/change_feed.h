// The Db's change feed (docs/CONTRACT.md, "Change feed"; docs/FORMAT.md,
// "The change feed"): every change to a shared aggregate, as exact deltas in
// batches numbered 1, 2, 3, ... per shard, written in the same atomic step
// as the change itself and kept on disk until trimmed.
//
// Writers (the state store's writer, a purge, a repair) are serialized by
// the state store's drain lock: each appends the next seqs to the batch it
// is about to write (`append`), and calls `committed` once the write
// landed. A failed write commits nothing, so its seqs are used again; a
// write whose outcome RocksDB cannot tell leaves RocksDB refusing every
// later write until a reopen, which reads the last seq from disk. So a seq
// is never skipped and never reused. Readers (read, last_seq, stats) take
// the feed's mutex only.
#ifndef TIDAL_FEED_CHANGE_FEED_H_
#define TIDAL_FEED_CHANGE_FEED_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include <rocksdb/write_batch.h>

#include "storage/feed_format.h"
#include "storage/ingest_batch.h"
#include "storage/storage.h"
#include "tidal/change_batch.h"

namespace tidal {

class ChangeFeed {
 public:
  // What one append added, to pass to committed() after the write.
  struct Appended {
    std::uint64_t last_seq = 0;  // 0: nothing appended
    std::uint64_t end_offset = 0;
  };
  struct Stats {
    std::uint64_t shard_id = 0;
    std::uint64_t last_seq = 0;
    std::uint64_t trimmed_through = 0;
    std::uint64_t pending_bytes = 0;  // payload bytes of the untrimmed batches
    std::string incarnation;          // 32 hex digits (ChangeBatch::incarnation)
    std::uint64_t incarnation_ordinal = 0;  // ChangeBatch::incarnation_ordinal (0: unknown)
  };

  // The feed of a Db opened with Options::change_feed: checks the stored
  // shard id (InvalidArgument, nothing changed, when it differs), or at the
  // first such open creates the feed and seeds it (see FORMAT.md) with the
  // Db's current shared aggregates and a new random incarnation with its
  // ordinal (a feed without one, or without an ordinal, made by an older
  // version, gets it here). `storage` is
  // writable and its state store's writer is not running yet.
  static Result<std::unique_ptr<ChangeFeed>> open(Storage* storage, std::uint64_t shard_id, std::uint64_t max_bytes);
  // The shard id stored in a Db, if it keeps a feed.
  static Result<std::optional<std::uint64_t>> stored_shard(const Storage& storage);
  // What open() can refuse, found by reading only (so a format-2 Db is
  // checked before its upgrade): a stored shard id other than `shard_id`
  // (InvalidArgument), a trim point or last record that does not decode
  // (Corruption).
  static Status check(Storage* storage, std::uint64_t shard_id);

  // Builds the feed records of one write: entries added in ascending key
  // order become payloads numbered from the next seq, each put into the
  // write's batch as soon as it is full (`put`: an IngestBatch's or a
  // WriteBatch's), so the memory is one payload.
  class Appender {
   public:
    using Put = std::function<rocksdb::Status(const std::string& key, const std::string& value)>;
    // Never refused for want of room: what was accepted (a batch's signals,
    // a purge, a repair) is always written; the bound holds back signals
    // before they are accepted instead (full(), StateStore::admit).
    Appender(ChangeFeed* feed, FeedOrigin origin, Put put);
    void add(std::string_view encoded_key, Units delta) { encoder_.add(encoded_key, delta); }
    // Seals the last payload. What to pass to committed() once the write
    // landed, or the batch's error.
    Result<Appended> finish();

   private:
    void on_payload(std::string payload);
    ChangeFeed* const feed_;
    const Put put_;
    FeedEncoder encoder_;
    Appended next_;
    Status error_;
  };
  void committed(const Appended& a);
  // True while the untrimmed batches hold max_bytes of payload or more:
  // signals are then refused before they are accepted (StateStore::admit),
  // so the writes of what was accepted pass the bound by at most the write
  // buffers' cells, and purges and repairs by their own deltas. One relaxed
  // load: the signal path asks.
  bool full() const { return full_.load(std::memory_order_relaxed); }
  // OK below the bound; Busy naming it (and what to do) at or above it.
  Status room() const;

  // Batches with seq > after_seq, oldest first, up to about max_bytes of
  // payload (at least one when there is one). NotFound when batches after
  // after_seq were trimmed already.
  Result<std::vector<ChangeBatch>> read(std::uint64_t after_seq, std::size_t max_bytes) const;
  std::uint64_t last_seq() const;
  Status trim(std::uint64_t through_seq);
  Stats stats() const;

  // Re-seeds the feed (docs/SCALE.md, "Re-seeding a shard"): in one atomic,
  // durable step, a new random incarnation (its ordinal above the one it
  // replaces, ChangeBatch::incarnation_ordinal), the untrimmed batches trimmed,
  // and a snapshot of every nonzero shared aggregate appended as the next
  // batches (the first of origin Reseed, FeedOrigin), so a view replaces
  // what it holds of this shard by the shard's current aggregates. Returns
  // the seq of the snapshot's first batch. The caller holds the state
  // store's drain lock (no writer batch lands meanwhile) and no trim runs.
  Result<std::uint64_t> reseed();

 private:
  ChangeFeed(Storage* storage, std::uint64_t shard_id, std::uint64_t max_bytes)
      : storage_(storage), shard_id_(shard_id), max_bytes_(max_bytes) {}
  Status load();  // last seq, trim point and offsets, from disk
  static Status add_shared_aggregates(const Storage& storage, Appender* to, const std::string& what);
  // The stored incarnation and its ordinal, or a new one written (a feed
  // made before incarnations), or a new ordinal written for the stored one
  // (a feed made or re-seeded by a version before ordinals); left unknown
  // (empty, 0) on a read-only open.
  Status load_incarnation();

  Storage* const storage_;
  const std::uint64_t shard_id_;
  const std::uint64_t max_bytes_;
  // Guarded by mu_ once open() returned: hex (empty: unknown) and ordinal
  // (0: unknown); changed by reseed().
  std::string incarnation_;
  std::uint64_t incarnation_ordinal_ = 0;
  // Held shared by read() throughout, and exclusively by reseed() from its
  // ingestion to its new incarnation: a read sees the records and the
  // incarnation of one feed. Taken before mu_.
  mutable std::shared_mutex reseed_mu_;
  // Serializes trim() from its check of the trim point to its write of the
  // trim record, so the record never goes backwards (two trims racing wrote
  // "through 6" after "through 10" had deleted 7..10). Not mu_, which the
  // writer's appends take: a trim's synced write would hold them up.
  std::mutex trim_mu_;
  mutable std::mutex mu_;
  std::uint64_t last_seq_ = 0;
  std::uint64_t end_offset_ = 0;       // payload bytes ever appended, through last_seq_
  std::uint64_t trimmed_through_ = 0;
  std::uint64_t trimmed_offset_ = 0;   // payload bytes ever appended, through trimmed_through_
  std::atomic<bool> full_{false};      // end_offset_ - trimmed_offset_ >= max_bytes_; changed under mu_
  void update_full_locked() { full_.store(end_offset_ - trimmed_offset_ >= max_bytes_, std::memory_order_relaxed); }
};

}  // namespace tidal

#endif  // TIDAL_FEED_CHANGE_FEED_H_
