// The purge receipt (tag 0x10 PurgeManifest): its bytes are in docs/FORMAT.md,
// its guarantees in docs/CONTRACT.md, P5.
//
//   users CF  key   [user_id: 8 BE][0x10][purged_at_ns: 8 BE]        (17 bytes)
//             value exactly 57 bytes:
//               [version: 1 = 0x01]
//               [left_at_ns: 8 LE]        the boundary of the purged leave
//               [purged_at_ns: 8 LE]      equal to the key's suffix
//               [entries_removed: 8 LE]   ledger entries (33-byte cells) removed
//               [cohort_units: 16 LE]     exact sum removed from cohorts (Units)
//               [community_units: 16 LE]  exact sum removed from communities
//
// A receipt with entries_removed == 0 is never written (such a purge writes
// nothing). Keys sort by purged_at_ns, so a user's receipts read oldest first.
#ifndef TIDAL_STORAGE_RECEIPT_H_
#define TIDAL_STORAGE_RECEIPT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "storage/state_format.h"

namespace tidal {

inline constexpr std::uint8_t kReceiptVersion = 1;
inline constexpr std::size_t kReceiptSize = 57;

struct ReceiptRecord {
  std::uint64_t left_at_ns = 0;
  std::uint64_t purged_at_ns = 0;
  std::uint64_t entries_removed = 0;
  Units cohort_units = 0;
  Units community_units = 0;
  bool operator==(const ReceiptRecord&) const = default;
};

std::string encode_receipt_key(std::uint64_t user_id, std::uint64_t purged_at_ns);
std::string encode_receipt(const ReceiptRecord& r);
// Empty unless exactly 57 bytes of version 1.
std::optional<ReceiptRecord> decode_receipt(std::string_view value);

}  // namespace tidal

#endif  // TIDAL_STORAGE_RECEIPT_H_
