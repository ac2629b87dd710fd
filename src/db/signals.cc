// The signal path (SPEC §2) and the leave gate.
#include <cmath>

#include "db/grace.h"
#include "db/guarded.h"
#include "db/impl.h"

namespace tidal {

Result<SignalOutcome> Db::Impl::signal_with_context(const Signal& signal, const SignalContext& context) {
  if (!std::isfinite(signal.weight)) {
    return Status::InvalidArgument("signal_with_context: weight of the signal of user " +
                                   std::to_string(signal.user_id) + " on item " + std::to_string(signal.item_id) +
                                   " is not finite (" + std::to_string(signal.weight) + ")");
  }
  return guarded("signal_with_context", [&]() -> Result<SignalOutcome> {
    // Everything from here to the return runs inside a read section, which a
    // leave (and close) waits out after closing the gate.
    grace::ReadSection section;
    if (closed_.load(std::memory_order_relaxed)) return closed_status("signal_with_context");
    if (options_.read_only) {
      return Status::InvalidArgument("signal_with_context: the Db at '" + storage_->path() + "' is open read-only");
    }
    CounterStripe& c = counters();
    SignalOutcome outcome;
    aggregates_.add(AggregateKind::Personal, {signal.user_id, signal.item_id}, signal.weight);  // user-owned: never gated
    outcome.personal_applied = true;

    std::uint64_t stamp = 0;  // one Db clock reading per signal, taken at its first contribution
    try_cohort_attribution(signal, context, &outcome, &stamp, &c);
    try_community_forwarding(signal, &outcome, &stamp, &c);
    c.signals.fetch_add(1, std::memory_order_relaxed);
    if (outcome.gated) {
      const std::uint64_t now = clock_.now();
      held_back_.upsert(
          signal.user_id,
          [now](GateActivity& a) {
            ++a.held_back_signals;
            a.last_held_back_ns = now;
          },
          GateActivity{1, now});
    }
    return outcome;
  });
}

void Db::Impl::try_cohort_attribution(const Signal& signal, const SignalContext& context, SignalOutcome* outcome,
                                      std::uint64_t* stamp, CounterStripe* counters) {
  if (gate_.closed_for(signal.user_id)) {  // the leave gate
    outcome->gated = true;
    counters->gated_cohort.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  for (std::uint64_t cohort : context.cohort_ids) {
    aggregates_.add(AggregateKind::Cohort, {cohort, signal.item_id}, signal.weight);
    ++outcome->cohorts_attributed;
    report(signal, ContributionTarget::Cohort, cohort, stamp);
  }
  if (outcome->cohorts_attributed != 0) {
    counters->cohort_attributions.fetch_add(outcome->cohorts_attributed, std::memory_order_relaxed);
  }
}

void Db::Impl::try_community_forwarding(const Signal& signal, SignalOutcome* outcome, std::uint64_t* stamp,
                                        CounterStripe* counters) {
  if (gate_.closed_for(signal.user_id)) {  // the leave gate
    outcome->gated = true;
    counters->gated_community.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // Copy the ids out so no bucket lock is held while forwarding or calling
  // the sink. The buffer is borrowed from the thread (a nested signal from a
  // sink callback finds it taken and allocates its own), so steady state
  // does not allocate.
  thread_local std::vector<std::uint64_t> spare;
  std::vector<std::uint64_t> ids = std::move(spare);
  ids.clear();
  communities_.find_fn(signal.user_id,
                       [&ids](const std::vector<std::uint64_t>& found) { ids.assign(found.begin(), found.end()); });
  for (std::uint64_t community : ids) {
    aggregates_.add(AggregateKind::Community, {community, signal.item_id}, signal.weight);
    ++outcome->communities_forwarded;
    report(signal, ContributionTarget::Community, community, stamp);
  }
  if (outcome->communities_forwarded != 0) {
    counters->community_forwards.fetch_add(outcome->communities_forwarded, std::memory_order_relaxed);
  }
  spare = std::move(ids);
}

void Db::Impl::report(const Signal& signal, ContributionTarget target, std::uint64_t target_id,
                      std::uint64_t* stamp) {
  ContributionSink* sink = options_.contribution_sink.get();
  if (sink == nullptr) return;
  if (*stamp == 0) *stamp = clock_.now();
  sink->on_contribution({signal.user_id, target, target_id, signal.item_id, signal.weight, *stamp});
}

}  // namespace tidal
