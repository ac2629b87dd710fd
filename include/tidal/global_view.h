// tidal's global view: the sum of every shard's shared aggregates.
//
// A deployment runs many host instances, each with its own Db holding a
// shard of the users. Each Db keeps a change feed of the exact deltas of its
// cohort and community aggregates (<tidal/change_batch.h>); a GlobalView,
// in a directory of its own (a RocksDB database, docs/FORMAT.md, "The global
// view's directory"), applies every shard's batches and serves the sums. Its
// guarantees are listed with the tests that prove them in docs/CONTRACT.md
// ("Global view").
//
// Exactly once: the view stores, per shard, the seq of the last batch it
// applied, in the same atomic, fsynced write as the batch's deltas. A batch
// delivered again is skipped; a batch that would leave a gap is refused. So
// a consumer may deliver at least once (redeliver after any doubt) and the
// sums count every batch exactly once.
//
// Incarnations are ordered: a shard's feed gets a new incarnation at each
// re-seed (and restore), with an ordinal above the earlier ones
// (ChangeBatch::incarnation_ordinal). The view keeps, per shard, the highest
// ordinal it applied and skips every batch of a lower one, whether or not it
// saw that incarnation, so a late delivery of an older incarnation's batch
// never replaces a newer one's contribution.
//
// Sums are exact integers of 1e-9 units (as in a Db): the order in which the
// shards' batches arrive never changes a score, bit for bit.
//
// Memory: open loads nothing; reads go through a block cache of
// GlobalViewOptions::block_cache_bytes (index and filter blocks included),
// besides RocksDB's memtables (at most 64 MiB).
//
// Thread safety: every method may be called from any number of threads.
// Applies (and checkpoints) run one at a time; reads run alongside them and
// see each batch whole or not at all.
#ifndef TIDAL_GLOBAL_VIEW_H_
#define TIDAL_GLOBAL_VIEW_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tidal/change_batch.h"
#include "tidal/status.h"

namespace tidal {

struct GlobalViewOptions {
  // Create the directory and the view if missing. Default: true.
  bool create_if_missing = true;
  // RocksDB block cache shared by the view's column families, index and
  // filter blocks included: the memory reads use. Default: 64 MiB.
  std::size_t block_cache_bytes = 64 << 20;
  // Open without writing anything, even while another process holds the
  // view (it then sees what that process had written when it opened); never
  // creates one. apply() and checkpoint() return InvalidArgument.
  // Default: false.
  bool read_only = false;
};

// How far the view has applied one shard's feed.
struct ShardProgress {
  std::uint64_t shard_id = 0;
  std::uint64_t applied_seq = 0;  // the seq of the last batch applied
  std::string incarnation;        // the incarnation of the shard's feed it came from (empty: not known)
  // The highest ChangeBatch::incarnation_ordinal applied for the shard
  // (0: none known): every batch of a lower one is skipped as superseded.
  std::uint64_t incarnation_ordinal = 0;
};

// What GlobalView::apply(std::span<const ChangeBatch>) did with a run of
// batches.
struct ApplyOutcome {
  // The first `taken` batches of the span were each applied or skipped (a
  // redelivery), durable on return; the batches from `taken` on were not
  // applied.
  std::size_t taken = 0;
  // How many of the `taken` batches were applied (the others were skipped).
  std::size_t applied = 0;
  // How many of the skipped batches were superseded: of an incarnation
  // older than one the view applied for the shard (a late delivery); the
  // other skipped ones were redeliveries of applied seqs.
  std::size_t superseded = 0;
  // OK when taken == the span's size. Otherwise why batches[taken] was
  // refused, exactly as apply(batch) refuses it: Corruption for a gap, a
  // payload that does not decode or another incarnation, InvalidArgument
  // for seq 0.
  Status refused;
};

class GlobalView {
 public:
  // Opens (or creates) the view in directory `path`. Fails with a Status
  // naming the path and the cause when the path is a file (InvalidArgument),
  // is missing and not to be created (NotFound), is not writable (IOError),
  // or is held by another handle in this process or another one (Busy);
  // with InvalidArgument when the directory holds a tidal Db or any other
  // RocksDB database rather than a view, or a view of another format.
  static Result<std::unique_ptr<GlobalView>> open(const std::string& path, const GlobalViewOptions& options = {});

  // Closes the view if still open (its status is dropped: call close() to see it).
  ~GlobalView();
  GlobalView(const GlobalView&) = delete;
  GlobalView& operator=(const GlobalView&) = delete;

  // Flushes memtables and closes. Idempotent; after it every call returns
  // Closed. Calls that start once close() has begun return Closed at once;
  // close() waits for the calls already in flight. Every apply was durable
  // on its return: close() adds no durability, only a faster next open. A
  // view still open when the process exits (std::exit, or a return from
  // main) is closed by an exit handler, so one held in a global or static
  // std::unique_ptr is safe.
  Status close();

  // Applies one batch of a shard's change feed, exactly once, durable on
  // return (its deltas and the shard's new applied seq in one atomic,
  // fsynced write):
  //   - true: applied (batch.seq was applied_seq(batch.shard_id) + 1);
  //   - false, nothing changed: batch.seq <= the shard's applied seq (a
  //     redelivery; the payload is not compared with what was applied);
  //   - Corruption, nothing changed: a gap (batch.seq > applied + 1: the
  //     message names the shard, the applied seq and the batch's seq), or a
  //     payload that does not decode (the message names the shard, the seq
  //     and why), checked before the seq is compared (so also at a seq
  //     already applied);
  //   - Corruption, nothing changed: batch.incarnation is not the one the
  //     view applied for the shard and not older than it (both known, the
  //     shard applied at least once; the message names the shard, both
  //     incarnations and both seqs), also at a seq already applied: another
  //     Db published the shard, which must be re-seeded. A batch with an
  //     empty incarnation is not checked; the first known one is stored with
  //     the shard's applied seq;
  //   - true: the first batch of a re-seed (Db::reseed_change_feed: its
  //     payload's origin is 5, docs/FORMAT.md) of an incarnation other than
  //     the shard's and not older than it, at whatever seq: the shard's
  //     whole contribution is taken out of the sums and replaced by the batch's values, and the
  //     batch's incarnation and seq become the shard's (the view keeps each
  //     shard's sums apart for this). Corruption, nothing changed, in a view
  //     made before per-shard sums that applied the shard (view_format 2);
  //   - false, nothing changed: a batch of an incarnation older than one the
  //     view applied for the shard (superseded, ApplyOutcome::superseded),
  //     whether or not the view saw that incarnation: its nonzero
  //     incarnation_ordinal is below the shard's (ShardProgress), or a
  //     re-seed the view applied replaced it. This is checked first, so a
  //     superseded re-seed's first batch replaces nothing;
  //   - Corruption, nothing changed: a re-seed's first batch without an
  //     ordinal (an older writer) of an incarnation the view does not know,
  //     for a shard whose applied ordinal is known: it cannot be ordered, so
  //     it may be older (the message names the shard, both incarnations and
  //     the ordinal);
  //   - InvalidArgument, nothing changed: batch.seq == 0, or a read-only view;
  //   - another error of the write: the batch may or may not be stored (a
  //     failed fsync may still have reached the disk); applied_seq tells,
  //     after a reopen, and delivering the batch again is safe either way.
  // Applies of any shards run one at a time.
  Result<bool> apply(const ChangeBatch& batch);

  // Applies a run of batches, of any shards, in the span's order, in ONE
  // atomic, fsynced write: one fsync for the run instead of one a batch
  // (a re-seed's first batch is written on its own: the batches before it,
  // it, and those after it, each in one atomic write).
  // Each batch is judged exactly as apply(batch) would judge it right after
  // the batches before it in the span (so a batch at seq n + 1 of a shard may
  // follow that shard's seq n in the same span, and a batch repeated in the
  // span is skipped the second time). The run stops at the first batch
  // apply(batch) would refuse (a gap, a payload that does not decode, seq
  // 0): the batches before it are written, it and every later batch of the
  // span are not (deliver them again, after the missing batch for a gap).
  //   - OK: ApplyOutcome says how many batches were taken (applied or
  //     skipped, durable on return), how many of those applied, and, when
  //     not all were taken, why the next one was refused;
  //   - InvalidArgument, nothing changed: a read-only view;
  //   - another error (a read of an applied seq, the write): none of the
  //     span is applied, or (a failed fsync may still have reached the disk)
  //     all of what would have been taken (with a re-seed in the span: the
  //     writes before the failed one are applied); applied_seq tells, after
  //     a reopen, and delivering the span again is safe either way.
  // An empty span is OK with nothing taken. Applies of any shards run one
  // at a time.
  Result<ApplyOutcome> apply(std::span<const ChangeBatch> batches);

  // The seq of the shard's last applied batch; 0 before its first.
  // Corruption naming the key when the stored record does not decode.
  Result<std::uint64_t> applied_seq(std::uint64_t shard_id) const;

  // Every shard with at least one applied batch, in ascending shard_id
  // order. Corruption naming the key when a stored record does not decode.
  Result<std::vector<ShardProgress>> applied_shards() const;

  // The sum over every shard of the cohort's (community's) aggregate for the
  // item: exact, converted to the nearest double. 0 for what no applied batch
  // ever touched; a non-OK Status when the read failed (Corruption naming the
  // key for a malformed stored value), never a silent 0.
  Result<double> cohort_score(std::uint64_t cohort_id, std::uint64_t item_id) const;
  Result<double> community_score(std::uint64_t community_id, std::uint64_t item_id) const;

  // Writes a consistent copy of the view into directory `dir`, which must
  // not exist (InvalidArgument naming it otherwise); its parent must. The
  // copy holds exactly the batches applied before the call (applies wait for
  // it) and opens as a view that continues from its copied applied seqs:
  // how a new host instance joins without replaying every feed from seq 1.
  // Files are hard-linked where the file system allows. InvalidArgument on a
  // read-only view.
  Status checkpoint(const std::string& dir) const;

  // True for a view opened with GlobalViewOptions::read_only (it applies nothing).
  bool read_only() const;

  class Impl;

 private:
  explicit GlobalView(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tidal

#endif  // TIDAL_GLOBAL_VIEW_H_
