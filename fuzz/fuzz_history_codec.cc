// Fuzzes the 0x12 history value codec: exactly one byte, 0 or 1; round-trips.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "storage/format.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const auto s = tidal::deserialize_history_status(bytes);
  const bool valid = size == 1 && data[0] <= 1;
  if (s.has_value() != valid) std::abort();
  if (s && static_cast<unsigned char>(tidal::serialize_history_status(*s)) != data[0]) std::abort();
  return 0;
}
