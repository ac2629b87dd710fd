#include "storage/receipt.h"

#include "storage/format.h"

namespace tidal {

std::string encode_receipt_key(std::uint64_t user_id, std::uint64_t purged_at_ns) {
  std::string suffix;
  put_u64_be(&suffix, purged_at_ns);
  return encode_key(EntityId(user_id), Tag::PurgeManifest, suffix);
}

std::string encode_receipt(const ReceiptRecord& r) {
  std::string out;
  out.reserve(kReceiptSize);
  out.push_back(static_cast<char>(kReceiptVersion));
  put_u64_le(&out, r.left_at_ns);
  put_u64_le(&out, r.purged_at_ns);
  put_u64_le(&out, r.entries_removed);
  put_units(&out, r.cohort_units);
  put_units(&out, r.community_units);
  return out;
}

std::optional<ReceiptRecord> decode_receipt(std::string_view value) {
  if (value.size() != kReceiptSize || static_cast<std::uint8_t>(value[0]) != kReceiptVersion) return std::nullopt;
  const char* p = value.data() + 1;
  ReceiptRecord r;
  r.left_at_ns = get_u64_le(p);
  r.purged_at_ns = get_u64_le(p + 8);
  r.entries_removed = get_u64_le(p + 16);
  r.cohort_units = get_units(p + 24);
  r.community_units = get_units(p + 40);
  return r;
}

}  // namespace tidal
