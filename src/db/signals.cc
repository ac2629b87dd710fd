// Db::Impl: the signal path and the leave gate (docs/CONTRACT.md: G2, G3, S1).
#include <cxxabi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <optional>
#include <span>

#include "db/grace.h"
#include "db/guarded.h"
#include "db/impl.h"

namespace tidal {

Result<SignalOutcome> Db::Impl::signal_with_context(const Signal& signal, const SignalContext& context) {
  const std::optional<Units> units = weight_to_units(signal.weight);
  if (!units) {
    char weight[32];
    std::snprintf(weight, sizeof weight, "%g", signal.weight);
    return Status::InvalidArgument("signal_with_context: weight " + std::string(weight) + " of the signal of user " +
                                   std::to_string(signal.user_id) + " on item " + std::to_string(signal.item_id) +
                                   (std::isfinite(signal.weight) ? " exceeds 1e12 in magnitude" : " is not finite"));
  }
  if (context.cohort_ids.size() > kMaxCohortsPerSignal) {
    return Status::InvalidArgument("signal_with_context: the context of the signal of user " +
                                   std::to_string(signal.user_id) + " on item " + std::to_string(signal.item_id) +
                                   " lists " + std::to_string(context.cohort_ids.size()) +
                                   " cohorts; at most kMaxCohortsPerSignal (" + std::to_string(kMaxCohortsPerSignal) +
                                   ") are accepted; nothing changed");
  }
  return guarded("signal_with_context", [&]() -> Result<SignalOutcome> {
    if (options_.read_only) {
      return Status::InvalidArgument("signal_with_context: the Db at '" + storage_->path() + "' is open read-only");
    }
    // Backpressure comes first, outside the read section: the writer waits
    // out read sections, so a signal must not wait for it inside one. A
    // signal made from a sink callback is inside one already (the outer
    // signal's): it never waits, and past the hard bound it is Busy.
    if (closed_.load(std::memory_order_relaxed)) return closed_status("signal_with_context");
    if (recovering_.load(std::memory_order_relaxed)) return recovering_status("signal_with_context");
    if (Status s = state_->admit(grace::in_read_section()); !s.ok()) return s;
    // Everything from here to the return runs inside a read section, which a
    // leave (and close, and the state store's writer) waits out.
    grace::ReadSection section(grace_, signal.user_id);
    if (closed_.load(std::memory_order_relaxed)) return closed_status("signal_with_context");
    FanOut fan_out{{}, &counters()};
    // Stamp before anything changes: a signal whose contributions cannot
    // carry a time below every later leave (G3) fails whole, with nothing
    // applied, rather than reach the sink unstamped. The stamp is leased, so
    // it stays below every leave after a crash too.
    if (options_.contribution_sink && !leave_gate_closed(signal, &fan_out)) {
      Result<std::uint64_t> stamp = clock_.leased_now();
      if (!stamp.ok()) {
        return Status(stamp.status().code(), "signal_with_context: the signal of user " +
                                                 std::to_string(signal.user_id) + " on item " +
                                                 std::to_string(signal.item_id) + " was not applied: " +
                                                 stamp.status().message());
      }
      fan_out.stamp = *stamp;
    }
    fan_out.units = *units;
    fan_out.buffer = state_->begin_signal();
    state_->add(fan_out.buffer, AggregateKind::Personal, signal.user_id, signal.item_id, *units);  // never gated
    fan_out.outcome.personal_applied = true;
    try_cohort_attribution(signal, context, &fan_out);
    if (fan_out.sink_error.empty()) try_community_forwarding(signal, &fan_out);
    fan_out.counters->signals.fetch_add(1, std::memory_order_relaxed);
    if (!fan_out.sink_error.empty()) {
      return Status::IOError("signal_with_context: the ContributionSink threw (" + fan_out.sink_error +
                             ") on the signal of user " + std::to_string(signal.user_id) + " on item " +
                             std::to_string(signal.item_id) + "; the personal layer, " +
                             std::to_string(fan_out.outcome.cohorts_attributed) + " cohort and " +
                             std::to_string(fan_out.outcome.communities_forwarded) +
                             " community additions were applied, the rest of the fan-out was not");
    }
    if (fan_out.outcome.gated) {
      // In memory only, so not leased; an exhausted clock leaves the last time as it was.
      const Result<std::uint64_t> now = clock_.now();
      const std::optional<std::uint64_t> at = now.ok() ? std::optional<std::uint64_t>(*now) : std::nullopt;
      held_back_.upsert(
          signal.user_id,
          [at](GateActivity& a) {
            ++a.held_back_signals;
            if (at) a.last_held_back_ns = at;
          },
          GateActivity{1, at});
    }
    return fan_out.outcome;
  });
}

// Probing once per signal is as safe as probing in each path: both paths run
// inside the signal's read section, and a leave closes the gate, waits for
// every read section in progress, and only then takes left_at_ns. A signal
// that saw the gate open therefore finishes before the leave returns (G2),
// with contributions stamped below left_at_ns (G3), whichever path asked.
bool Db::Impl::leave_gate_closed(const Signal& signal, FanOut* fan_out) const noexcept {
  if (fan_out->gate < 0) fan_out->gate = gate_.closed_for(signal.user_id) ? 1 : 0;
  return fan_out->gate != 0;
}

void Db::Impl::try_cohort_attribution(const Signal& signal, const SignalContext& context, FanOut* fan_out) {
  if (leave_gate_closed(signal, fan_out)) {
    fan_out->outcome.gated = true;
    fan_out->counters->gated_cohort.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  for (std::uint64_t cohort : context.cohort_ids) {
    state_->add(fan_out->buffer, AggregateKind::Cohort, cohort, signal.item_id, fan_out->units);
    state_->add_ledger(fan_out->buffer, signal.user_id, AggregateKind::Cohort, cohort, signal.item_id, fan_out->units);
    ++fan_out->outcome.cohorts_attributed;
    if (!report(signal, ContributionTarget::Cohort, cohort, fan_out)) break;
  }
  if (fan_out->outcome.cohorts_attributed != 0) {
    fan_out->counters->cohort_attributions.fetch_add(fan_out->outcome.cohorts_attributed, std::memory_order_relaxed);
  }
}

void Db::Impl::try_community_forwarding(const Signal& signal, FanOut* fan_out) {
  if (leave_gate_closed(signal, fan_out)) {
    fan_out->outcome.gated = true;
    fan_out->counters->gated_community.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // Copy the ids out so no bucket lock is held while forwarding or calling
  // the sink: onto the stack, or for a user in many communities into a
  // vector. No thread_local buffer: a signal from a host thread_local's
  // destructor may run after such a buffer was destroyed.
  constexpr std::size_t kInlineIds = 16;
  std::uint64_t inline_ids[kInlineIds];
  std::vector<std::uint64_t> overflow;
  std::span<const std::uint64_t> ids;
  communities_.find_fn(signal.user_id, [&](const std::vector<std::uint64_t>& found) {
    if (found.size() <= kInlineIds) {
      std::copy(found.begin(), found.end(), inline_ids);
      ids = {inline_ids, found.size()};
    } else {
      overflow.assign(found.begin(), found.end());
      ids = overflow;
    }
  });
  for (std::uint64_t community : ids) {
    state_->add(fan_out->buffer, AggregateKind::Community, community, signal.item_id, fan_out->units);
    state_->add_ledger(fan_out->buffer, signal.user_id, AggregateKind::Community, community, signal.item_id,
                       fan_out->units);
    ++fan_out->outcome.communities_forwarded;
    if (!report(signal, ContributionTarget::Community, community, fan_out)) break;
  }
  if (fan_out->outcome.communities_forwarded != 0) {
    fan_out->counters->community_forwards.fetch_add(fan_out->outcome.communities_forwarded,
                                                    std::memory_order_relaxed);
  }
}

TIDAL_CATCHES_FORCED_UNWIND bool Db::Impl::report(const Signal& signal, ContributionTarget target,
                                                  std::uint64_t target_id, FanOut* fan_out) {
  ContributionSink* sink = options_.contribution_sink.get();
  if (sink == nullptr) return true;  // with a sink, fan_out->stamp was taken before the fan-out
  try {
    sink->on_contribution({signal.user_id, target, target_id, signal.item_id, signal.weight, fan_out->stamp});
    return true;
  } catch (abi::__forced_unwind&) {
    throw;  // thread cancellation / pthread_exit must keep unwinding
  } catch (const std::exception& e) {
    fan_out->sink_error = e.what();
  } catch (...) {
    fan_out->sink_error = "an exception not derived from std::exception";
  }
  if (fan_out->sink_error.empty()) fan_out->sink_error = "an exception with an empty message";
  return false;
}

}  // namespace tidal
