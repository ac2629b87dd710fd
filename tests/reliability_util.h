// Helpers shared by the reliability tests (crash, fault, power-loss, sweep),
// on top of test_util.h (TempDir, ASSERT_OK): a counting ContributionSink and
// the model of acknowledged leaves/rejoins that every harness checks a
// reopened Db against.
#ifndef TIDAL_TESTS_RELIABILITY_UTIL_H_
#define TIDAL_TESTS_RELIABILITY_UTIL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "test_util.h"
#include "tidal/db.h"

namespace tidal::reliability {

using tidal::testing::TempDir;

// Every contribution each user made, counted per user.
using CountingSink = tidal::testing::RecordingSink;

// Sends one signal of `user` attributed to one cohort and reports whether
// the leave gate held it back, checking the outcome and the sink agree:
// gated <=> no contribution reached the sink. Returns nullopt (and records a
// test failure) when the signal call failed or the outcome is inconsistent.
inline std::optional<bool> probe_gate(Db& db, CountingSink& sink, std::uint64_t user) {
  const std::uint64_t before = sink.count_for(user);
  Result<SignalOutcome> out = db.signal_with_context({user, 7, 1.0}, SignalContext{{42}});
  // On a failing disk a signal past an open gate fails whole when its stamp
  // cannot be leased (the clock's floor is not stored): the gate was open.
  if (!out.ok() && out.status().code() == StatusCode::IOError &&
      out.status().message().find("clock lease") != std::string::npos && sink.count_for(user) == before) {
    return false;
  }
  if (!out.ok()) {
    ADD_FAILURE() << "signal of user " << user << ": " << out.status().to_string();
    return std::nullopt;
  }
  const std::uint64_t delta = sink.count_for(user) - before;
  if (out->gated) {
    if (delta != 0 || out->cohorts_attributed != 0 || out->communities_forwarded != 0) {
      ADD_FAILURE() << "user " << user << " gated yet " << delta << " contributions reached the sink";
      return std::nullopt;
    }
    return true;
  }
  if (out->cohorts_attributed != 1 || delta != out->cohorts_attributed + out->communities_forwarded) {
    ADD_FAILURE() << "user " << user << " not gated but " << delta << " contributions reached the sink";
    return std::nullopt;
  }
  return false;
}

// What the harness knows was acknowledged: for every user, the leave/rejoin
// events that returned OK, oldest first (at_ns as the writer saw them).
struct AckModel {
  std::map<std::uint64_t, std::vector<MembershipEvent>> events;

  MembershipStatus status_of(std::uint64_t user) const {
    auto it = events.find(user);
    return it == events.end() || it->second.empty() ? MembershipStatus::Active : it->second.back().status;
  }
  std::optional<std::uint64_t> left_at_of(std::uint64_t user) const {
    auto it = events.find(user);
    if (it == events.end()) return std::nullopt;
    for (auto e = it->second.rbegin(); e != it->second.rend(); ++e) {
      if (e->status == MembershipStatus::Left) return e->at_ns;
    }
    return std::nullopt;
  }
  std::size_t size() const {
    std::size_t n = 0;
    for (const auto& [user, ev] : events) n += ev.size();
    return n;
  }
};

inline const char* status_name(MembershipStatus s) { return s == MembershipStatus::Left ? "Left" : "Active"; }

// Outcome of comparing a reopened Db with the model.
struct ModelCheck {
  std::uint64_t users_checked = 0;
  std::uint64_t events_checked = 0;  // acknowledged events found, in order
  std::uint64_t lost = 0;            // acknowledged events missing (allow_loss only)
  std::uint64_t unknown_applied = 0; // unacknowledged ops found applied
  std::uint64_t gate_probes = 0;
};

// Checks every user in `users` of a reopened Db against `model`:
//   - history: the acknowledged events, in order, same status and at_ns;
//   - status and left_at_ns: what the last acknowledged events imply (G4);
//   - the gate (when `sink` is the Db's sink): closed exactly for Left users,
//     checked with a signal (outcome.gated, no sink contribution) (G5).
// `unknown` holds, per user, the target state of an operation whose outcome
// is unknown (announced but not acknowledged, or failed): the Db may hold one
// more event of that state, which is then adopted into the model.
// With `allow_loss` the history may be any prefix of the model's: the missing
// events are counted in `lost` and dropped from the model.
inline void check_against_model(Db& db, CountingSink* sink, AckModel& model, const std::vector<std::uint64_t>& users,
                                const std::map<std::uint64_t, MembershipStatus>& unknown, bool allow_loss,
                                ModelCheck* out) {
  for (std::uint64_t u : users) {
    Result<std::vector<MembershipEvent>> hist = db.community_layer_history(u);
    Result<CommunityMembership> st = db.community_layer_status(u);
    if (!hist.ok() || !st.ok()) {
      ADD_FAILURE() << "user " << u << ": history " << hist.status().to_string() << ", status "
                    << st.status().to_string();
      continue;
    }
    std::vector<MembershipEvent>& expected = model.events[u];
    const std::vector<MembershipEvent>& actual = *hist;
    auto same = [](const MembershipEvent& a, const MembershipEvent& b) {
      return a.status == b.status && a.at_ns == b.at_ns;
    };
    const std::size_t common = std::min(actual.size(), expected.size());
    std::size_t prefix = 0;
    while (prefix < common && same(actual[prefix], expected[prefix])) ++prefix;
    auto it = unknown.find(u);
    if (prefix == expected.size() && actual.size() == expected.size() + 1 && it != unknown.end() &&
        actual.back().status == it->second) {
      expected.push_back(actual.back());  // the unacknowledged op took effect
      ++out->unknown_applied;
    } else if (allow_loss && prefix == actual.size()) {
      out->lost += expected.size() - actual.size();
      expected.resize(actual.size());
    } else if (prefix != expected.size() || actual.size() != expected.size()) {
      std::string detail;
      for (const auto& e : expected) detail += std::string(" ") + status_name(e.status) + "@" + std::to_string(e.at_ns);
      detail += " | stored:";
      for (const auto& e : actual) detail += std::string(" ") + status_name(e.status) + "@" + std::to_string(e.at_ns);
      ADD_FAILURE() << "user " << u << ": history differs from the acknowledged one (first " << prefix
                    << " agree); acknowledged:" << detail;
      expected = actual;  // report each divergence once
      continue;
    }
    out->events_checked += expected.size();
    ++out->users_checked;
    const MembershipStatus want = model.status_of(u);
    EXPECT_EQ(static_cast<int>(st->status), static_cast<int>(want)) << "status of user " << u;
    EXPECT_EQ(st->left_at_ns, model.left_at_of(u)) << "left_at_ns of user " << u;
    if (sink != nullptr) {
      std::optional<bool> gated = probe_gate(db, *sink, u);
      ++out->gate_probes;
      if (gated) {
        EXPECT_EQ(*gated, want == MembershipStatus::Left) << "gate of user " << u << " after reopen";
      }
    }
  }
}

}  // namespace tidal::reliability

#endif  // TIDAL_TESTS_RELIABILITY_UTIL_H_
