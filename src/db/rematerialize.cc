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
      std::vector<std::pair<std::string, Units>> fixes;
      LedgerCheck check;
      Status r = check_ledger(
          *storage_, /*snapshot=*/nullptr, &check,
          [&](std::string problem) { report.mismatches.push_back(std::move(problem)); },
          [&](const AggregateMismatch& m) {
            report.mismatches.push_back(m.what);
            std::optional<AggregateCell> cell = decode_aggregate_key(m.key);
            if (cell && cell->kind != AggregateKind::Personal) fixes.emplace_back(m.key, m.recomputed);
          });
      report.ledger_entries_read = check.ledger_entries;
      report.aggregates_checked = check.aggregates;
      if (!r.ok() || !repair || report.mismatches.empty()) return r;
      // One synced batch: a crash leaves every aggregate repaired or none.
      // No writer batch lands between the scan and this write (drain lock).
      rocksdb::WriteBatch batch;
      std::string value;
      for (const auto& [key, units] : fixes) {
        value.clear();
        put_units(&value, units);
        batch.Put(storage_->aggregates(), key, value);
      }
      if (r = storage_->write(&batch, Storage::WriteMode::Sync, std::string(what) + " repair of " +
                                                                  std::to_string(fixes.size()) + " aggregates");
          !r.ok()) {
        return r;
      }
      report.repaired = fixes.size() == report.mismatches.size();
      return Status::OK();
    });
    if (!s.ok()) return s;
    return report;
  });
}

}  // namespace tidal
