// Fuzzes the users-partition and by_tag index key codecs: a key decodes iff
// it has at least 9 bytes, and re-encoding the decoded parts gives it back.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "storage/format.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view key(reinterpret_cast<const char*>(data), size);
  const auto k = tidal::decode_key(key);
  if (k.has_value() != (size >= 9)) std::abort();
  if (k) {
    const std::string again = tidal::encode_key(tidal::EntityId(k->user_id), static_cast<tidal::Tag>(k->tag), k->suffix);
    if (again != key) std::abort();
    const std::string prefix = tidal::encode_key_prefix(tidal::EntityId(k->user_id), static_cast<tidal::Tag>(k->tag));
    if (key.substr(0, 9) != prefix) std::abort();
  }
  const auto ix = tidal::decode_index_key(key);
  if (ix.has_value() != (size >= 9)) std::abort();
  if (ix) {
    const std::string again =
        tidal::encode_index_key(tidal::EntityId(ix->user_id), static_cast<tidal::Tag>(ix->tag), ix->suffix);
    if (again != key) std::abort();
  }
  if (tidal::hex(key).size() != 2 * size) std::abort();
  return 0;
}
