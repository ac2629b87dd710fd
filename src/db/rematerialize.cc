// Db::Impl::rematerialize_shared_aggregates: every cohort and community
// aggregate recomputed from the contribution ledger and compared exactly;
// with repair, the differing ones corrected in one synced batch
// (docs/CONTRACT.md, P6). The check reads the ledger once, in bounded
// memory (an external sort: storage/ledger_scan.h).
//
// The scan holds no lock: it reads one snapshot, taken after the write
// buffers were drained (a newer one when a purge's erasure made the check
// start over), while the writer goes on writing batches (each an atomic
// step that adds the same deltas to an aggregate and its ledger, as a
// purge's batch removes the same amounts from both). So a difference found
// at the snapshot is still the difference when the repair lands, and a
// repair is a merge operand of (ledger sum - stored sum) at the snapshot:
// it composes with every batch written since, and takes the drain lock only
// for its one small write (a repair's feed entry must not interleave with a
// writer batch's). One repair at a time: two would each add the correction.
// An aggregate whose stored value does not decode cannot take an operand:
// then the scan is made again under the drain lock, and that one is
// overwritten with its ledger sum.
#include <algorithm>

#include "db/guarded.h"
#include "db/impl.h"
#include "storage/ledger_scan.h"

namespace tidal {
namespace {

// One aggregate the repair corrects.
struct Fix {
  std::string key;
  Units recomputed;
  std::optional<Units> stored;  // empty when the stored value does not decode
};

}  // namespace

Result<RematerializeReport> Db::Impl::rematerialize_shared_aggregates(bool repair) {
  const char* what = "rematerialize_shared_aggregates";
  return guarded(what, [&]() -> Result<RematerializeReport> {
    // Even without repair it drains the write buffers, whose grace period
    // would wait for a sink callback's own signal.
    if (Status busy = check_outside_sink(what); !busy.ok()) return busy;
    Call call(this, what, /*write=*/repair);
    if (!call.status().ok()) return call.status();
    std::unique_lock<std::mutex> one_repair(repair_mu_, std::defer_lock);
    if (repair) one_repair.lock();
    RematerializeReport report;
    std::vector<Fix> fixes;
    // The check holds at most ledger_pass_cells() sums at once; what grows
    // with the state is only the list of fixes, one per mismatch.
    const auto scan = [&]() -> Status {
      const auto reset = [&] {
        report = RematerializeReport{};
        fixes.clear();
      };
      reset();
      LedgerCheck check;
      Status r = check_ledger(
          *storage_, &check, [&](std::string problem) { report.mismatches.push_back(std::move(problem)); },
          [&](const AggregateMismatch& m) {
            report.mismatches.push_back(m.what);
            std::optional<AggregateCell> cell = decode_aggregate_key(m.key);
            if (cell && cell->kind != AggregateKind::Personal) fixes.push_back({m.key, m.recomputed, m.stored});
          },
          reset);
      report.ledger_entries_read = check.ledger_entries;
      report.aggregates_checked = check.aggregates;
      return r;
    };
    // Everything acknowledged before the call is stored first: the check's
    // snapshot is taken after.
    if (Status s = state_->flush(); !s.ok()) return s;
    if (Status s = scan(); !s.ok()) return s;
    if (!repair || report.mismatches.empty()) return report;
    const bool undecodable = std::any_of(fixes.begin(), fixes.end(), [](const Fix& f) { return !f.stored; });
    Status s = state_->exclusive([&]() -> Status {
      // No writer batch lands while fn runs: a scan here sees what the
      // repair overwrites.
      if (undecodable) {
        if (Status r = scan(); !r.ok()) return r;
      }
      // One synced batch: a crash leaves every aggregate repaired or none.
      // With a change feed, each repair enters it as the delta that moves
      // the stored sum to the recomputed one, in the same batch, so views
      // follow (fixes come in key order).
      rocksdb::WriteBatch batch;
      std::optional<ChangeFeed::Appender> feed;
      if (feed_) {
        feed.emplace(feed_.get(), FeedOrigin::Repair, [&](const std::string& k, const std::string& v) {
          return batch.Put(storage_->feed(), k, v);
        });
      }
      std::string value;
      for (const Fix& f : fixes) {
        value.clear();
        if (f.stored) {
          put_units(&value, f.recomputed - *f.stored);
          batch.Merge(storage_->aggregates(), f.key, value);
          if (feed) feed->add(f.key, f.recomputed - *f.stored);
          continue;
        }
        if (feed) {
          return Status::Corruption(std::string(what) + ": aggregate " + hex(f.key) +
                                    " does not decode, so the change feed cannot carry its repair as a delta; "
                                    "nothing repaired");
        }
        put_units(&value, f.recomputed);
        batch.Put(storage_->aggregates(), f.key, value);
      }
      ChangeFeed::Appended appended;
      if (feed) {
        Result<ChangeFeed::Appended> a = feed->finish();
        if (!a.ok()) return a.status();
        appended = *a;
      }
      if (Status r = storage_->write(Storage::Engine::State, &batch, Storage::WriteMode::Sync,
                                     std::string(what) + " repair of " + std::to_string(fixes.size()) + " aggregates");
          !r.ok()) {
        return r;
      }
      if (feed) feed_->committed(appended);
      report.repaired = fixes.size() == report.mismatches.size();
      return Status::OK();
    });
    if (!s.ok()) return s;
    return report;
  });
}

}  // namespace tidal
