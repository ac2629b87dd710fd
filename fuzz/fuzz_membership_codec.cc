// Fuzzes the 0x11 value codec (docs/FORMAT.md): deserialize_membership accepts
// exactly the 9-byte values with status 0/1 and no Left without a time, and
// round-trips what it accepts.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "storage/format.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const auto m = tidal::deserialize_membership(42, bytes);
  bool valid = size == tidal::kMembershipValueSize && data[0] <= 1;
  std::uint64_t at = 0;
  if (size == tidal::kMembershipValueSize) {
    for (int i = 8; i >= 1; --i) at = (at << 8) | data[i];
    if (data[0] == 1 && at == 0) valid = false;
  }
  if (m.has_value() != valid) std::abort();
  if (!m) return 0;
  if (m->user_id != 42) std::abort();
  if (static_cast<std::uint8_t>(m->status) != data[0]) std::abort();
  if (m->left_at_ns.value_or(0) != at) std::abort();
  if (m->status == tidal::MembershipStatus::Left && !m->left_at_ns) std::abort();  // never Left without a time
  const auto round = tidal::serialize_membership(*m);
  if (std::memcmp(round.data(), data, size) != 0) std::abort();
  return 0;
}
