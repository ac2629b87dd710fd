// Key material in memory (storage/secret.h; docs/FORMAT.md, "Keys in
// memory"): the pages that hold keys for long are left out of core dumps,
// and the buffers that held a key are wiped.
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <type_traits>

#include <gtest/gtest.h>

#include "db/ledger_key_table.h"
#include "storage/sealed_ledger.h"
#include "storage/secret.h"

namespace tidal {
namespace {

// The VmFlags of the mapping that holds `p`, from /proc/self/smaps ("" when
// no mapping does).
std::string vm_flags_of(const void* p) {
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    std::uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream range(line);
    if (range >> std::hex >> begin >> dash >> end && dash == '-' && line.find(':') > line.find(' ')) {
      inside = begin <= at && at < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}

bool dont_dump(const void* p) { return vm_flags_of(p).find(" dd") != std::string::npos; }

UserKey new_key() {
  Result<UserKey> k = UserKey::generate();
  EXPECT_TRUE(k.ok()) << k.status().to_string();
  return *k;
}

TEST(KeyMemory, SecretPagesAreLeftOutOfCoreDumpsAndOrdinaryHeapIsNot) {
  SecretVector<UserKey> keys;
  keys.push_back(new_key());
  const std::string flags = vm_flags_of(keys.data());
  ASSERT_FALSE(flags.empty()) << "no mapping of /proc/self/smaps holds the keys";
  EXPECT_TRUE(dont_dump(keys.data())) << flags;
  // The check itself tells the two apart.
  const std::string heap(1 << 20, 'x');
  EXPECT_FALSE(dont_dump(heap.data())) << vm_flags_of(heap.data());
}

// The state store's writer holds every active user's key for as long as
// the Db is open: in pages left out of core dumps, whichever chunk.
TEST(KeyMemory, TheWritersKeyTableIsLeftOutOfCoreDumps) {
  LedgerKeyTable table;
  const UserKey key = new_key();
  for (std::uint64_t u = 0; u < 40'000; ++u) table.insert(u, key);  // three chunks
  for (std::uint64_t u : {0ULL, 20'000ULL, 39'999ULL}) {
    const SealingKey* held = table.find(u);
    ASSERT_NE(held, nullptr);
    EXPECT_TRUE(dont_dump(held)) << "user " << u << ": " << vm_flags_of(held);
  }
}

TEST(KeyMemory, SecretBytesWipesItsBufferWhenClearedOrMovedFrom) {
  static_assert(std::is_same_v<decltype(std::declval<const BucketKey&>().encode()), SecretBytes>,
                "a bucket key's encoding is wiped when dropped");
  static_assert(std::is_same_v<decltype(std::declval<const UserKey&>().encode()), SecretBytes>);
  Result<BucketKey> bucket = BucketKey::generate(1);
  ASSERT_TRUE(bucket.ok());
  const auto zero = [](const char* p, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      if (p[i] != 0) return false;
    }
    return true;
  };
  SecretBytes encoded = bucket->encode();
  ASSERT_EQ(encoded.size(), kBucketValueSize);
  const char* buffer = encoded.view().data();
  ASSERT_FALSE(zero(buffer + 5, kUserKeySize));
  SecretBytes moved = std::move(encoded);
  EXPECT_TRUE(zero(buffer, kBucketValueSize)) << "the moved-from buffer still holds the key";
  EXPECT_EQ(moved.view().substr(5), bucket->bytes_for_testing());
  const char* second = moved.view().data();
  moved.clear();
  EXPECT_TRUE(zero(second, kBucketValueSize)) << "a cleared buffer still holds the key";
  // A value read into it fits the room it reserved: no buffer left behind.
  SecretBytes read;
  const char* reserved = read.view().data();
  read.buffer()->assign(kBucketValueSize, 'k');
  EXPECT_EQ(read.view().data(), reserved);
}

}  // namespace
}  // namespace tidal
