// Db::Impl::rematerialize_shared_aggregates: every cohort and community
// aggregate recomputed from the contribution ledger and compared exactly;
// with repair, the differing ones rewritten in one synced batch
// (docs/CONTRACT.md, P6). The check runs in passes of bounded memory
// (storage/ledger_scan.h).
#include "db/guarded.h"
#include "db/impl.h"
#include "storage/ledger_scan.h"

namespace tidal {

Result<RematerializeReport> Db::Impl::rematerialize_shared_aggregates(bool repair) {
  const char* what = "rematerialize_shared_aggregates";
  return guarded(what, [&]() -> Result<RematerializeReport> {
    // Even without repair it drains the write buffers, whose grace period
    // would wait for a sink callback's own signal.
    if (Status busy = check_outside_sink(what); !busy.ok()) return busy;
    Call call(this, what, /*write=*/repair);
    if (!call.status().ok()) return call.status();
    RematerializeReport report;
    Status s = state_->exclusive([&]() -> Status {
      // The check holds at most ledger_pass_cells() sums at once
      // (storage/ledger_scan.h); what grows with the state is only the list
      // of fixes, one per mismatch, kept for the one batch below.
      struct Fix {
        std::string key;
        Units recomputed;
        std::optional<Units> stored;
      };
      std::vector<Fix> fixes;
      LedgerCheck check;
      Status r = check_ledger(
          *storage_, /*snapshot=*/nullptr, &check,
          [&](std::string problem) { report.mismatches.push_back(std::move(problem)); },
          [&](const AggregateMismatch& m) {
            report.mismatches.push_back(m.what);
            std::optional<AggregateCell> cell = decode_aggregate_key(m.key);
            if (cell && cell->kind != AggregateKind::Personal) fixes.push_back({m.key, m.recomputed, m.stored});
          });
      report.ledger_entries_read = check.ledger_entries;
      report.aggregates_checked = check.aggregates;
      if (!r.ok() || !repair || report.mismatches.empty()) return r;
      // One synced batch: a crash leaves every aggregate repaired or none.
      // No writer batch lands between the scan and this write (drain lock).
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
        put_units(&value, f.recomputed);
        batch.Put(storage_->aggregates(), f.key, value);
        if (!feed) continue;
        if (!f.stored) {
          return Status::Corruption(std::string(what) + ": aggregate " + hex(f.key) +
                                    " does not decode, so the change feed cannot carry its repair as a delta; "
                                    "nothing repaired");
        }
        feed->add(f.key, f.recomputed - *f.stored);
      }
      ChangeFeed::Appended appended;
      if (feed) {
        Result<ChangeFeed::Appended> a = feed->finish();
        if (!a.ok()) return a.status();
        appended = *a;
      }
      if (r = storage_->write(Storage::Engine::State, &batch, Storage::WriteMode::Sync, std::string(what) + " repair of " +
                                                                  std::to_string(fixes.size()) + " aggregates");
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
