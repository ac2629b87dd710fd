// units_to_double: every exact sum (a count of 1e-9 units, 128 bits) reads as
// the double nearest to units / 1e9, ties to even (docs/CONTRACT.md, S1).
// Checked against exact rational arithmetic over a million sums of every
// magnitude, exact ties built on purpose among them.
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <random>
#include <string>

#include <gtest/gtest.h>

#include "storage/state_format.h"

namespace tidal {
namespace {

__extension__ typedef unsigned __int128 UUnits;

constexpr std::uint64_t kUnitsPerWeight = 1'000'000'000;
constexpr std::uint64_t kFivePowNine = 1'953'125;  // 1e9 = 2^9 * 5^9
constexpr Units kMinUnits = static_cast<Units>(static_cast<UUnits>(1) << 127);
constexpr Units kMaxUnits = static_cast<Units>((static_cast<UUnits>(1) << 127) - 1);

// An unsigned 256-bit integer, little-endian 64-bit limbs: room for every
// product the exact check below forms (at most ~2^130).
struct Wide {
  std::array<std::uint64_t, 4> limb{};
};

Wide wide(UUnits x) { return {{static_cast<std::uint64_t>(x), static_cast<std::uint64_t>(x >> 64), 0, 0}}; }

Wide shifted_left(const Wide& x, int bits) {
  Wide out;
  const auto words = static_cast<std::size_t>(bits / 64);
  const int rest = bits % 64;
  for (std::size_t i = words; i < 4; ++i) {
    out.limb[i] = x.limb[i - words] << rest;
    if (rest != 0 && i > words) out.limb[i] |= x.limb[i - words - 1] >> (64 - rest);
  }
  return out;
}

Wide times(const Wide& x, std::uint64_t factor) {
  Wide out;
  UUnits carry = 0;
  for (std::size_t i = 0; i < 4; ++i) {
    const UUnits product = static_cast<UUnits>(x.limb[i]) * factor + carry;
    out.limb[i] = static_cast<std::uint64_t>(product);
    carry = product >> 64;
  }
  return out;
}

int compare(const Wide& a, const Wide& b) {
  for (std::size_t i = 4; i-- > 0;) {
    if (a.limb[i] != b.limb[i]) return a.limb[i] < b.limb[i] ? -1 : 1;
  }
  return 0;
}

// The sign of magnitude / 1e9 - odd * 2^exp, exactly.
int compare_with_dyadic(UUnits magnitude, std::uint64_t odd, int exp) {
  if (exp < 0) return compare(shifted_left(wide(magnitude), -exp), times(wide(odd), kUnitsPerWeight));
  return compare(wide(magnitude), shifted_left(times(wide(odd), kUnitsPerWeight), exp));
}

// Whether `d` is the double nearest to magnitude / 1e9 (magnitude > 0), ties
// to the even mantissa: strictly between the midpoints to its neighbours, or
// on one of them with an even mantissa.
bool is_nearest(UUnits magnitude, double d) {
  if (!(d > 0) || !std::isfinite(d)) return false;
  int exp = 0;
  const auto mantissa = static_cast<std::uint64_t>(std::ldexp(std::frexp(d, &exp), 53));
  exp -= 53;  // d = mantissa * 2^exp, 2^52 <= mantissa < 2^53
  const bool even = mantissa % 2 == 0;
  const int above = compare_with_dyadic(magnitude, 2 * mantissa + 1, exp - 1);
  // Below a power of two the neighbour is half as far.
  const int below = mantissa == (std::uint64_t{1} << 52) ? compare_with_dyadic(magnitude, 4 * mantissa - 1, exp - 2)
                                                         : compare_with_dyadic(magnitude, 2 * mantissa - 1, exp - 1);
  return (above < 0 || (above == 0 && even)) && (below > 0 || (below == 0 && even));
}

UUnits magnitude_of(Units units) {
  return units < 0 ? static_cast<UUnits>(0) - static_cast<UUnits>(units) : static_cast<UUnits>(units);
}

// Checks units_to_double(units) against the exact rounding; the neighbours
// of the answer must fail the same check (the check can say no).
void expect_nearest(Units units) {
  const double d = units_to_double(units);
  const UUnits magnitude = magnitude_of(units);
  const std::string name = units_to_string(units);
  if (magnitude == 0) {
    EXPECT_EQ(d, 0.0) << name;
    return;
  }
  ASSERT_EQ(d < 0, units < 0) << name;
  const double m = std::fabs(d);
  ASSERT_TRUE(is_nearest(magnitude, m)) << name << " units read as " << std::hexfloat << d;
  ASSERT_FALSE(is_nearest(magnitude, std::nextafter(m, 0.0))) << name;
  ASSERT_FALSE(is_nearest(magnitude, std::nextafter(m, HUGE_VAL))) << name;
}

TEST(UnitsToDouble, IsTheNearestDoubleAtTheEdges) {
  // Sums that read one ulp off through two roundings (issue 20).
  EXPECT_EQ(units_to_double(39'997'093'948'616'568), 39997093.948616568);
  EXPECT_EQ(units_to_double(-39'997'093'948'616'568), -39997093.948616568);
  const Units just_above_a_tie = Units{9'007'199'254'740'993} * kUnitsPerWeight + 1;  // 2^53 + 1 + 1e-9
  EXPECT_EQ(units_to_double(just_above_a_tie), 9007199254740994.0);
  EXPECT_EQ(units_to_double(-just_above_a_tie), -9007199254740994.0);
  // Exact ties go to the even mantissa: 2^53 + 1 down, 2^53 + 3 up.
  EXPECT_EQ(units_to_double(Units{9'007'199'254'740'993} * kUnitsPerWeight), 9007199254740992.0);
  EXPECT_EQ(units_to_double(Units{9'007'199'254'740'995} * kUnitsPerWeight), 9007199254740996.0);
  EXPECT_EQ(units_to_double(just_above_a_tie - 2), 9007199254740992.0);
  // Either side of 2^53 units, where the conversion changes method.
  EXPECT_EQ(units_to_double((Units{1} << 53) - 1), 9007199.254740991);
  EXPECT_EQ(units_to_double(Units{1} << 53), 9007199.254740992);
  EXPECT_EQ(units_to_double((Units{1} << 53) + 1), 9007199.254740993);
  // The ends of the 128-bit range.
  EXPECT_EQ(units_to_double(kMinUnits), -170141183460469231731687303715.884105728);
  EXPECT_EQ(units_to_double(kMaxUnits), 170141183460469231731687303715.884105727);
  EXPECT_EQ(units_to_double(kMinUnits + 1), -170141183460469231731687303715.884105727);
  EXPECT_EQ(units_to_double(0), 0.0);
  EXPECT_FALSE(std::signbit(units_to_double(0)));
  EXPECT_EQ(units_to_double(1), 1e-9);
  EXPECT_EQ(units_to_double(-1), -1e-9);
  for (Units u : {Units{0}, Units{1}, Units{-1}, kMinUnits, kMinUnits + 1, kMaxUnits, kMaxUnits - 1, just_above_a_tie}) {
    expect_nearest(u);
  }
}

TEST(UnitsToDouble, IsTheNearestDoubleForAMillionSumsTiesToEven) {
  std::mt19937_64 rng(20);
  auto random_units = [&] { return static_cast<UUnits>(rng()) << 64 | rng(); };
  auto random_sign = [&](UUnits magnitude) {
    const auto units = static_cast<Units>(magnitude);
    return rng() % 2 == 0 ? units : -units;
  };
  for (int i = 0; i < 1'000'000; ++i) {
    switch (i % 4) {
      case 0: {  // any magnitude: 1 to 127 significant bits
        const int bits = 1 + static_cast<int>(rng() % 127);
        const UUnits top = static_cast<UUnits>(1) << (bits - 1);
        expect_nearest(random_sign(top | (random_units() & (top - 1))));
        break;
      }
      case 1: {  // an exact tie, odd * 2^(shift - 9) with a 54-bit odd, and its neighbours
        const std::uint64_t odd = (std::uint64_t{1} << 53) | (rng() >> 11) | 1;
        const int shift = static_cast<int>(rng() % 53);  // 54 + 21 + 52 bits < 2^127
        const UUnits tie = static_cast<UUnits>(odd) * kFivePowNine << shift;
        const int delta = static_cast<int>(rng() % 3) - 1;
        expect_nearest(random_sign(tie + static_cast<UUnits>(static_cast<Units>(delta))));
        break;
      }
      case 2: {  // a few units either side of a power of two, 2^50 to 2^126
        const int bits = 50 + static_cast<int>(rng() % 77);
        const auto delta = static_cast<Units>(rng() % 2001) - 1000;
        expect_nearest(random_sign((static_cast<UUnits>(1) << bits) + static_cast<UUnits>(delta)));
        break;
      }
      default: {  // near a power of two read as a double: 1e9 * 2^k, k to 96
        const int k = static_cast<int>(rng() % 97);
        const auto delta = static_cast<Units>(rng() % 2001) - 1000;
        const UUnits near = (static_cast<UUnits>(kUnitsPerWeight) << k) + static_cast<UUnits>(delta);
        expect_nearest(random_sign(near));
        break;
      }
    }
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace tidal
