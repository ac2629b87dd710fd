// The leave gate's filter and table on their own: exact answers through
// growth, rejoins and re-leaves, for many users.
#include <gtest/gtest.h>

#include "db/leave_gate.h"

namespace tidal {
namespace {

TEST(LeaveGate, AnswersExactlyThroughGrowthRejoinsAndReleaves) {
  LeaveGate gate;
  EXPECT_FALSE(gate.closed_for(0));
  constexpr std::uint64_t kUsers = 100'000;
  // Left: every third user, sequential and scattered ids alike.
  auto id = [](std::uint64_t i) { return i % 2 == 0 ? i : i * 0x9e3779b97f4a7c15ULL; };
  for (std::uint64_t i = 0; i < kUsers; i += 3) EXPECT_TRUE(gate.close(id(i)));
  EXPECT_FALSE(gate.close(id(0)));  // already closed
  EXPECT_EQ(gate.closed_count(), (kUsers + 2) / 3);
  for (std::uint64_t i = 0; i < kUsers; ++i) ASSERT_EQ(gate.closed_for(id(i)), i % 3 == 0) << i;

  // Rejoin every other Left user; then some of them leave again.
  for (std::uint64_t i = 0; i < kUsers; i += 6) EXPECT_TRUE(gate.open(id(i)));
  EXPECT_FALSE(gate.open(id(0)));  // already open
  EXPECT_FALSE(gate.open(id(1)));  // never closed
  for (std::uint64_t i = 0; i < kUsers; i += 12) EXPECT_TRUE(gate.close(id(i)));
  for (std::uint64_t i = 0; i < kUsers; ++i) {
    const bool closed = i % 3 == 0 && (i % 6 != 0 || i % 12 == 0);
    ASSERT_EQ(gate.closed_for(id(i)), closed) << i;
  }
  std::uint64_t expected = 0;
  for (std::uint64_t i = 0; i < kUsers; ++i) expected += i % 3 == 0 && (i % 6 != 0 || i % 12 == 0);
  EXPECT_EQ(gate.closed_count(), expected);
}

TEST(LeaveGate, ReserveKeepsAnswers) {
  LeaveGate gate;
  for (std::uint64_t u = 1; u <= 500; ++u) gate.close(u);
  gate.reserve(1'000'000);
  for (std::uint64_t u = 1; u <= 1000; ++u) ASSERT_EQ(gate.closed_for(u), u <= 500) << u;
}

}  // namespace
}  // namespace tidal
