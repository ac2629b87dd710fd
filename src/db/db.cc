// The Db facade (each call forwards to Db::Impl, whose methods live in the
// db_impl_*.cc files named after what they do), stats and score reads.
#include "db/guarded.h"
#include "db/impl.h"

namespace tidal {

// ---- stats and score reads ----

CounterStripe& Db::Impl::counters() {
  static std::atomic<unsigned> next_thread{0};
  thread_local const unsigned index = next_thread.fetch_add(1, std::memory_order_relaxed);
  return stripes_[index % stripes_.size()];
}

std::uint64_t Db::Impl::signals_accepted() const {
  std::uint64_t n = 0;
  for (const CounterStripe& c : stripes_) n += c.signals.load(std::memory_order_relaxed);
  return n;
}

Stats Db::Impl::stats() const {
  Stats out;
  for (const CounterStripe& c : stripes_) {
    out.signals += c.signals.load(std::memory_order_relaxed);
    out.cohort_attributions += c.cohort_attributions.load(std::memory_order_relaxed);
    out.community_forwards += c.community_forwards.load(std::memory_order_relaxed);
    out.gated_cohort += c.gated_cohort.load(std::memory_order_relaxed);
    out.gated_community += c.gated_community.load(std::memory_order_relaxed);
  }
  out.personal_updates = out.signals;  // every accepted signal updates the personal layer
  out.leaves = leaves_.load(std::memory_order_relaxed);
  out.rejoins = rejoins_.load(std::memory_order_relaxed);
  out.users_left = gate_.closed_count();
  out.corrupt_records_treated_as_left = corrupt_treated_as_left_.load(std::memory_order_relaxed);
  const StateStoreStats st = state_->stats();
  out.aggregate_writes = st.writes;
  out.aggregate_write_failures = st.write_failures;
  out.aggregate_cells_written = st.cells_written;
  out.aggregate_cells_pending = st.pending_cells;
  out.backpressure_waits = st.backpressure_waits;
  out.backpressure_wait_max_ns = st.backpressure_wait_max_ns;
  out.aggregate_write_max_ns = st.write_max_ns;
  out.aggregate_write_p99_ns = st.write_p99_ns;
  out.admission_delayed_signals = st.admission_delayed_signals;
  out.admission_delay_ns = st.admission_delay_ns;
  out.admission_delay_max_ns = st.admission_delay_max_ns;
  out.admission_refused_signals = st.admission_refused_signals;
  out.admission_rate_bytes_per_s = st.admission_rate_bytes_per_s;
  out.admission_signal_bytes = st.admission_signal_bytes;
  out.admission_stopped = st.admission_stopped;
  out.compaction_debt_bytes = st.compaction_debt_bytes;
  out.compaction_debt_l0_files = st.compaction_debt_l0_files;
  out.recovering = recovering();
  if (feed_) {
    const ChangeFeed::Stats f = feed_->stats();
    out.change_feed = true;
    out.change_feed_shard_id = f.shard_id;
    out.change_feed_last_seq = f.last_seq;
    out.change_feed_trimmed_seq = f.trimmed_through;
    out.change_feed_pending_bytes = f.pending_bytes;
    out.change_feed_refused_signals = st.feed_refused_signals;
    out.change_feed_incarnation = f.incarnation;
    out.change_feed_incarnation_ordinal = f.incarnation_ordinal;
  }
  if (journal_) {
    const Journal::Stats j = journal_->stats();
    out.journal = true;
    out.journal_shard_id = j.shard_id;
    out.journal_last_seq = j.last_seq;
    out.journal_confirmed_seq = j.confirmed_seq;
    out.journal_pending_entries = j.last_seq - j.confirmed_seq;
    out.journal_pending_bytes = j.pending_bytes;
    out.journal_wait_timeouts = journal_wait_timeouts_.load(std::memory_order_relaxed);
  }
  const Storage::ScanProgress& scans = storage_->scan_progress();
  out.ledger_check_records_read = scans.records_read.load(std::memory_order_relaxed);
  out.ledger_check_records_estimate = scans.records_estimate.load(std::memory_order_relaxed);
  out.ledger_check_restarts = scans.restarts.load(std::memory_order_relaxed);
  return out;
}

Status Db::Impl::check_feed(const char* what) const {
  if (feed_) return Status::OK();
  return Status::InvalidArgument(std::string(what) + ": the Db at '" + storage_->path() +
                                 "' keeps no change feed (open it with Options::change_feed)");
}

Result<std::vector<ChangeBatch>> Db::Impl::read_changes(std::uint64_t after_seq, std::size_t max_bytes) const {
  return guarded("read_changes", [&]() -> Result<std::vector<ChangeBatch>> {
    Call call(this, "read_changes", /*write=*/false);
    if (!call.status().ok()) return call.status();
    if (Status s = check_feed("read_changes"); !s.ok()) return s;
    return feed_->read(after_seq, max_bytes);
  });
}

Result<std::uint64_t> Db::Impl::last_change_seq() const {
  return guarded("last_change_seq", [&]() -> Result<std::uint64_t> {
    Call call(this, "last_change_seq", /*write=*/false);
    if (!call.status().ok()) return call.status();
    if (Status s = check_feed("last_change_seq"); !s.ok()) return s;
    return feed_->last_seq();
  });
}

Status Db::Impl::trim_changes(std::uint64_t through_seq) {
  return guarded("trim_changes", [&]() -> Status {
    Call call(this, "trim_changes", /*write=*/true);
    if (!call.status().ok()) return call.status();
    if (Status s = check_feed("trim_changes"); !s.ok()) return s;
    // A recovering Db's feed is the backup's: what consumers hold of the
    // shard's later batches is not in it (issue 41 item 8).
    if (recovering()) return recovering_status("trim_changes");
    if (Status s = feed_->trim(through_seq); !s.ok()) return s;
    state_->feed_trimmed();  // a batch the full feed held back goes now
    return Status::OK();
  });
}

Result<std::uint64_t> Db::Impl::reseed_change_feed() {
  return guarded("reseed_change_feed", [&]() -> Result<std::uint64_t> {
    Call call(this, "reseed_change_feed", /*write=*/true);
    if (!call.status().ok()) return call.status();
    if (Status s = check_feed("reseed_change_feed"); !s.ok()) return s;
    // A snapshot of a recovering Db is the backup's state, before the
    // journal's purges are replayed: a view re-seeded from it would hold a
    // purged user's contributions (issue 41 item 8). finish_recovery
    // re-seeds the feed itself, once the journal is replayed.
    if (recovering()) return recovering_status("reseed_change_feed");
    std::uint64_t first = 0;
    // Under the drain lock: no writer batch, purge or repair lands between
    // the snapshot's read of the aggregates and its write. No drain first:
    // what the buffers hold is neither in the aggregates nor in the feed,
    // and lands after the snapshot.
    Status s = state_->between_batches([&]() -> Status {
      Result<std::uint64_t> r = feed_->reseed();
      if (!r.ok()) return r.status();
      first = *r;
      return Status::OK();
    });
    if (!s.ok()) return s;
    return first;
  });
}

Result<double> Db::Impl::score(AggregateKind kind, std::uint64_t owner, std::uint64_t item) const {
  return guarded("score read", [&]() -> Result<double> {
    Call call(this, "score read", /*write=*/false);
    if (!call.status().ok()) return call.status();
    Result<Units> sum = state_->read(kind, owner, item);
    if (!sum.ok()) return sum.status();
    return units_to_double(*sum);
  });
}

// ---- Db facade ----

Result<std::unique_ptr<Db>> Db::open(const std::string& path, const Options& options) {
  return Impl::open(path, options, nullptr);
}
Status Db::close() { return impl_->close(); }
Status Db::flush() { return impl_->flush(); }
Status Db::rotate_key_encryption_key(const std::string& new_key) { return impl_->rotate_key_encryption_key(new_key); }
Status Db::join_community(std::uint64_t user_id, std::uint64_t community_id) {
  return impl_->join_community(user_id, community_id);
}
Status Db::exit_community(std::uint64_t user_id, std::uint64_t community_id) {
  return impl_->exit_community(user_id, community_id);
}
Result<std::vector<std::uint64_t>> Db::communities_of(std::uint64_t user_id) const {
  return impl_->communities_of(user_id);
}
Result<SignalOutcome> Db::signal_with_context(const Signal& signal, const SignalContext& context) {
  return impl_->signal_with_context(signal, context);
}
Result<double> Db::personal_score(std::uint64_t user_id, std::uint64_t item_id) const {
  return impl_->score(AggregateKind::Personal, user_id, item_id);
}
Result<double> Db::cohort_score(std::uint64_t cohort_id, std::uint64_t item_id) const {
  return impl_->score(AggregateKind::Cohort, cohort_id, item_id);
}
Result<double> Db::community_score(std::uint64_t community_id, std::uint64_t item_id) const {
  return impl_->score(AggregateKind::Community, community_id, item_id);
}
Status Db::leave_community_layer(std::uint64_t user_id) { return impl_->leave_community_layer(user_id); }
Status Db::rejoin_community_layer(std::uint64_t user_id) { return impl_->rejoin_community_layer(user_id); }
Status Db::leave_community_layer(std::span<const std::uint64_t> user_ids) {
  return impl_->leave_community_layer(user_ids);
}
Status Db::rejoin_community_layer(std::span<const std::uint64_t> user_ids) {
  return impl_->rejoin_community_layer(user_ids);
}
Result<CommunityMembership> Db::community_layer_status(std::uint64_t user_id) const {
  return impl_->community_layer_status(user_id);
}
Result<std::vector<MembershipEvent>> Db::community_layer_history(std::uint64_t user_id) const {
  return impl_->community_layer_history(user_id);
}
Result<GateActivity> Db::gate_activity(std::uint64_t user_id) const { return impl_->gate_activity(user_id); }
Status Db::for_each_left(const std::function<bool(const CommunityMembership&)>& fn) const {
  return impl_->for_each_left(fn);
}
Result<VerifyReport> Db::verify() const { return impl_->verify(); }
Result<PurgeReceipt> Db::purge_community_contributions(std::uint64_t user_id) {
  Result<std::vector<PurgeReceipt>> r = impl_->purge("purge_community_contributions", {&user_id, 1});
  if (!r.ok()) return r.status();
  return r->front();
}
Result<std::vector<PurgeReceipt>> Db::purge_community_contributions(std::span<const std::uint64_t> user_ids) {
  return impl_->purge("purge_community_contributions", user_ids);
}
Result<std::vector<PurgeReceipt>> Db::purge_receipts(std::uint64_t user_id) const {
  return impl_->purge_receipts(user_id);
}
Result<RematerializeReport> Db::rematerialize_shared_aggregates(bool repair) {
  return impl_->rematerialize_shared_aggregates(repair);
}
Stats Db::stats() const { return impl_->stats(); }
Result<std::vector<ChangeBatch>> Db::read_changes(std::uint64_t after_seq, std::size_t max_bytes) const {
  return impl_->read_changes(after_seq, max_bytes);
}
Result<std::uint64_t> Db::last_change_seq() const { return impl_->last_change_seq(); }
Status Db::trim_changes(std::uint64_t through_seq) { return impl_->trim_changes(through_seq); }
Result<std::uint64_t> Db::reseed_change_feed() { return impl_->reseed_change_feed(); }
Status Db::backup(const std::string& dir) const { return impl_->backup(dir); }
Status Db::finish_recovery() { return impl_->finish_recovery(); }
Status Db::replay_journal(std::span<const JournalEntry> entries) { return impl_->replay_journal(entries); }
Result<std::vector<JournalEntry>> Db::read_journal(std::uint64_t after_seq, std::size_t max_bytes) const {
  return impl_->read_journal(after_seq, max_bytes);
}
Result<std::uint64_t> Db::last_journal_seq() const { return impl_->last_journal_seq(); }
Result<std::uint64_t> Db::wait_journal(std::uint64_t after_seq, std::chrono::milliseconds wait) const {
  return impl_->wait_journal(after_seq, wait);
}
Status Db::confirm_journal(std::uint64_t through_seq) { return impl_->confirm_journal(through_seq); }

}  // namespace tidal
