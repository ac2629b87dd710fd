// Fuzzes the 0x10 purge receipt codec (storage/receipt.h): a value decodes
// exactly when it is 57 bytes of version 1, and re-encodes to the same bytes.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "storage/receipt.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const auto r = tidal::decode_receipt(bytes);
  const bool valid = size == tidal::kReceiptSize && data[0] == tidal::kReceiptVersion;
  if (r.has_value() != valid) std::abort();
  if (r && tidal::encode_receipt(*r) != bytes) std::abort();
  return 0;
}
