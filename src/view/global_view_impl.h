// GlobalView::Impl: the view's RocksDB database and the state of one handle
// (view/global_view.cc). Tests open a view on a fault-injecting Env through
// Impl::open.
#ifndef TIDAL_VIEW_GLOBAL_VIEW_IMPL_H_
#define TIDAL_VIEW_GLOBAL_VIEW_IMPL_H_

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <rocksdb/db.h>
#include <rocksdb/env.h>

#include "storage/state_format.h"
#include "tidal/global_view.h"
#include "view/view_format.h"

namespace tidal {

class GlobalView::Impl {
 public:
  // GlobalView::open, on `env` (null: RocksDB's default).
  static Result<std::unique_ptr<GlobalView>> open(const std::string& path, const GlobalViewOptions& options,
                                                  rocksdb::Env* env);
  ~Impl();
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  Status close();
  Result<bool> apply(const ChangeBatch& batch);
  Result<ApplyOutcome> apply(std::span<const ChangeBatch> batches);
  Result<std::uint64_t> applied_seq(std::uint64_t shard_id) const;
  Result<std::vector<ShardProgress>> applied_shards() const;
  bool read_only() const { return options_.read_only; }
  Result<double> score(AggregateKind kind, std::uint64_t owner, std::uint64_t item) const;
  Status checkpoint(const std::string& dir) const;

 private:
  class Call;

  Impl(std::string path, const GlobalViewOptions& options);
  rocksdb::ColumnFamilyHandle* meta() const { return handles_[0]; }
  rocksdb::ColumnFamilyHandle* aggregates() const { return handles_[1]; }
  // Null on a read-only open of a view made before per-shard sums.
  rocksdb::ColumnFamilyHandle* shards() const { return handles_.size() > 2 ? handles_[2] : nullptr; }
  // The applied seq stored for the shard (0 when none); no Call of its own.
  Result<std::uint64_t> read_applied(std::uint64_t shard_id) const;
  // The shard's applied record: seq, incarnations and ordinal (a zero seq
  // when none).
  Result<AppliedRecord> read_applied_record(std::uint64_t shard_id) const;
  // The shard's highest incarnation ordinal applied (0: none known).
  Result<std::uint64_t> read_ordinal(std::uint64_t shard_id) const;
  // Whether a re-seed of the shard replaced `incarnation` (32 hex digits):
  // the record's last retired one, or a "retired/" record.
  Result<bool> is_retired(std::uint64_t shard_id, const std::string& incarnation, const AppliedRecord& record) const;
  // Checks the format mark; writes it on a new view, and on one whose
  // creation stopped before the mark (nothing else stored); sets per_shard_.
  Status check_format(bool created);
  // Closes RocksDB: with `flush`, first writes the memtables to SST files.
  Status shut_down(bool flush);

  const std::string path_;
  const GlobalViewOptions options_;
  std::unique_ptr<rocksdb::DB> db_;
  std::vector<rocksdb::ColumnFamilyHandle*> handles_;  // default (meta), aggregates, shards
  // Format 3: every applied delta is also kept per shard (the shards
  // family), so a re-seed can replace one shard's contribution. Set by
  // check_format.
  bool per_shard_ = false;
  // The directory's (st_dev, st_ino) in the registry of views open for
  // writing in this process, while this handle holds it.
  std::optional<std::pair<dev_t, ino_t>> registry_id_;

  // Set first thing by close(); every later call returns Closed. close() then
  // waits for calls_ to drain, so new callers cannot starve it.
  std::atomic<bool> closed_{false};
  mutable std::atomic<std::uint64_t> calls_{0};  // Calls in flight
  mutable std::mutex drain_mu_;                 // with drained_: close() sleeps until calls_ is 0
  mutable std::condition_variable drained_;
  std::mutex close_mu_;          // a second close() returns once the first has finished
  mutable std::mutex apply_mu_;  // one apply (or checkpoint) at a time
};

}  // namespace tidal

#endif  // TIDAL_VIEW_GLOBAL_VIEW_IMPL_H_
