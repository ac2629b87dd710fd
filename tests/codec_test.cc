// Byte codecs and key encoding (docs/FORMAT.md).
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "storage/format.h"

namespace tidal {
namespace {

constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();

std::string bytes(const std::array<char, kMembershipValueSize>& a) { return std::string(a.data(), a.size()); }

TEST(MembershipCodec, RoundTripsAtTheEdges) {
  for (std::uint64_t user : {std::uint64_t{0}, std::uint64_t{1}, kMax}) {
    for (std::uint64_t at : {std::uint64_t{1}, std::uint64_t{1700000000000000000}, kMax}) {
      for (MembershipStatus status : {MembershipStatus::Active, MembershipStatus::Left}) {
        const CommunityMembership m{user, status, at};
        const std::string encoded = bytes(serialize_membership(m));
        ASSERT_EQ(encoded.size(), 9u);
        auto decoded = deserialize_membership(user, encoded);
        ASSERT_TRUE(decoded.has_value());
        EXPECT_EQ(decoded->user_id, user);
        EXPECT_EQ(decoded->status, status);
        EXPECT_EQ(decoded->left_at_ns, at);
      }
    }
  }
}

TEST(MembershipCodec, ActiveWithoutLeaveTimeRoundTrips) {
  const CommunityMembership m{7, MembershipStatus::Active, std::nullopt};
  auto decoded = deserialize_membership(7, bytes(serialize_membership(m)));
  ASSERT_TRUE(decoded);
  EXPECT_EQ(decoded->status, MembershipStatus::Active);
  EXPECT_FALSE(decoded->left_at_ns.has_value());
}

TEST(MembershipCodec, LayoutIsStatusThenLittleEndianTime) {
  const std::string encoded = bytes(serialize_membership({1, MembershipStatus::Left, 0x0102030405060708ULL}));
  EXPECT_EQ(encoded, std::string("\x01\x08\x07\x06\x05\x04\x03\x02\x01", 9));
}

TEST(MembershipCodec, RejectsMalformedValues) {
  const std::string good = bytes(serialize_membership({1, MembershipStatus::Left, 42}));
  EXPECT_FALSE(deserialize_membership(1, ""));
  EXPECT_FALSE(deserialize_membership(1, good.substr(0, 8)));                 // short
  EXPECT_FALSE(deserialize_membership(1, good + "x"));                        // long
  EXPECT_FALSE(deserialize_membership(1, std::string(1, '\x01')));            // status only
  for (int status : {2, 3, 0x7f, 0x80, 0xff}) {                               // bad status byte
    std::string bad = good;
    bad[0] = static_cast<char>(status);
    EXPECT_FALSE(deserialize_membership(1, bad)) << status;
  }
  EXPECT_FALSE(deserialize_membership(1, std::string("\x01", 1) + std::string(8, '\0')));  // Left, time 0
  EXPECT_TRUE(deserialize_membership(1, std::string(9, '\0')));                            // Active, no time
}

TEST(HistoryCodec, RoundTripsAndRejects) {
  for (MembershipStatus s : {MembershipStatus::Active, MembershipStatus::Left}) {
    EXPECT_EQ(deserialize_history_status(std::string(1, serialize_history_status(s))), s);
  }
  EXPECT_FALSE(deserialize_history_status(""));
  EXPECT_FALSE(deserialize_history_status(std::string("\x01\x01", 2)));
  EXPECT_FALSE(deserialize_history_status(std::string(1, '\x02')));
  EXPECT_FALSE(deserialize_history_status(std::string(1, '\xff')));
}

TEST(Keys, EncodeAndDecode) {
  const std::string key = encode_key(EntityId(0x0102030405060708ULL), Tag::CommunityLeave);
  EXPECT_EQ(key, std::string("\x01\x02\x03\x04\x05\x06\x07\x08\x11", 9));
  auto decoded = decode_key(key);
  ASSERT_TRUE(decoded);
  EXPECT_EQ(decoded->user_id, 0x0102030405060708ULL);
  EXPECT_EQ(decoded->tag, 0x11);
  EXPECT_TRUE(decoded->suffix.empty());

  const std::string with_suffix = encode_key(EntityId(kMax), Tag::CommunityLeaveHistory, "abcdefgh");
  decoded = decode_key(with_suffix);
  ASSERT_TRUE(decoded);
  EXPECT_EQ(decoded->user_id, kMax);
  EXPECT_EQ(decoded->tag, 0x12);
  EXPECT_EQ(decoded->suffix, "abcdefgh");

  EXPECT_FALSE(decode_key(""));
  EXPECT_FALSE(decode_key(std::string(8, '\0')));
  EXPECT_EQ(static_cast<int>(Tag::PurgeManifest), 0x10);
  EXPECT_EQ(static_cast<int>(Tag::CommunityLeave), 0x11);
  EXPECT_EQ(static_cast<int>(Tag::CommunityLeaveHistory), 0x12);
  EXPECT_LT(static_cast<int>(Tag::CommunityMember), 0x10);
}

TEST(Keys, IndexKeysPutTheTagFirst) {
  const std::string key = encode_index_key(EntityId(5), Tag::CommunityLeave);
  EXPECT_EQ(key, std::string("\x11\0\0\0\0\0\0\0\x05", 9));
  auto decoded = decode_index_key(key);
  ASSERT_TRUE(decoded);
  EXPECT_EQ(decoded->user_id, 5u);
  EXPECT_EQ(decoded->tag, 0x11);
  EXPECT_FALSE(decode_index_key("short"));
}

TEST(Keys, UserRecordsAreContiguousAndSortedByTagThenUsersNumerically) {
  const std::vector<std::uint64_t> users = {0, 1, 255, 256, 65535, 1ULL << 32, kMax - 1, kMax};
  const std::vector<Tag> tags = {Tag::CommunityMember, Tag::PurgeManifest, Tag::CommunityLeave,
                                 Tag::CommunityLeaveHistory};
  std::vector<std::pair<std::string, std::pair<std::uint64_t, int>>> keys;
  for (auto u : users) {
    for (auto t : tags) {
      std::string suffix;
      if (t == Tag::CommunityLeaveHistory || t == Tag::CommunityMember) put_u64_be(&suffix, 99);
      keys.push_back({encode_key(EntityId(u), t, suffix), {u, static_cast<int>(t)}});
    }
  }
  std::vector<std::pair<std::uint64_t, int>> expected;
  for (auto& k : keys) expected.push_back(k.second);
  std::sort(expected.begin(), expected.end());
  std::sort(keys.begin(), keys.end());  // bytewise, as RocksDB orders them
  std::vector<std::pair<std::uint64_t, int>> actual;
  for (auto& k : keys) actual.push_back(k.second);
  EXPECT_EQ(actual, expected);
}

TEST(Keys, BigEndianHelpersRoundTrip) {
  for (std::uint64_t v : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{0x0102030405060708}, kMax}) {
    std::string be, le;
    put_u64_be(&be, v);
    put_u64_le(&le, v);
    EXPECT_EQ(get_u64_be(be.data()), v);
    EXPECT_EQ(get_u64_le(le.data()), v);
  }
}

}  // namespace
}  // namespace tidal
