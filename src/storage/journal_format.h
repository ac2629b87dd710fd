// The privacy journal's bytes (docs/FORMAT.md, "The privacy journal"). All
// of them live in the users engine's meta (default) column family, beside
// the records they journal, so an entry and its record are one WriteBatch:
//
//   "journal_shard_id"                  -> [shard_id: 8 BE]
//       written at the first open with Options::journal; its presence means
//       the Db keeps a journal
//   "journal_confirmed"                 -> [through_seq: 8 BE][end_offset: 8 BE]
//       confirm_journal's point, with the payload bytes ever appended through it
//   "journal/" [seq: 8 BE]              -> [end_offset: 8 BE][payload]
//       an entry not yet confirmed; end_offset counts the payload bytes ever
//       appended through this entry
//   "journal_purge/" [user: 8 BE][purged_at_ns: 8 BE] -> [seq: 8 BE][left_at_ns: 8 BE]
//       a purge whose intent is journaled and whose purge batch may not be
//       written yet: written with the intent, deleted once the purge's batch
//       is durable; a writable open finishes every purge still marked
//
//   payload (version 1, exactly 26 bytes):
//     [version: 1 = 0x01]
//     [kind: 1]        1 a leave, 2 a rejoin, 3 a purge's intent
//     [user_id: 8 LE]
//     [at_ns: 8 LE]    leave: its left_at_ns; rejoin: its time (the 0x12
//                      history entry's at_ns); purge: the receipt's
//                      purged_at_ns (with the user, its identity: the 0x10 key)
//     [left_at_ns: 8 LE]  the boundary: leave: = at_ns; rejoin: the
//                      left_at_ns the record keeps (0: none); purge: the
//                      receipt's left_at_ns (what it removes was forwarded
//                      before it)
// No other field exists: the journal carries no signal, item, cohort,
// community, weight or contribution (docs/CONTRACT.md J5).
#ifndef TIDAL_STORAGE_JOURNAL_FORMAT_H_
#define TIDAL_STORAGE_JOURNAL_FORMAT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace tidal {

inline constexpr char kJournalShardKey[] = "journal_shard_id";
inline constexpr char kJournalConfirmedKey[] = "journal_confirmed";
inline constexpr char kJournalEntryPrefix[] = "journal/";
inline constexpr char kJournalPurgePrefix[] = "journal_purge/";

inline constexpr std::uint8_t kJournalVersion = 1;
inline constexpr std::size_t kJournalPayloadSize = 26;

enum class JournalKind : std::uint8_t { Leave = 1, Rejoin = 2, Purge = 3 };

// One decoded payload.
struct JournalRecord {
  JournalKind kind = JournalKind::Leave;
  std::uint64_t user_id = 0;
  std::uint64_t at_ns = 0;
  std::uint64_t left_at_ns = 0;
};

// "journal/" + [seq: 8 BE].
std::string encode_journal_key(std::uint64_t seq);
// The seq of a "journal/" key; empty optional for any other key.
std::optional<std::uint64_t> decode_journal_key(std::string_view key);

std::string encode_journal_payload(const JournalRecord& r);
// Empty optional for any length but 26, a version other than 1, a kind
// other than 1-3, and a leave whose at_ns is not its left_at_ns or is 0;
// `error` (when given) then says which.
std::optional<JournalRecord> decode_journal_payload(std::string_view payload, std::string* error = nullptr);

// "journal_purge/" + [user: 8 BE][purged_at_ns: 8 BE].
std::string encode_journal_purge_key(std::uint64_t user_id, std::uint64_t purged_at_ns);
struct JournalPurgeMark {
  std::uint64_t user_id = 0;
  std::uint64_t purged_at_ns = 0;
  std::uint64_t seq = 0;
  std::uint64_t left_at_ns = 0;
};
std::string encode_journal_purge_value(std::uint64_t seq, std::uint64_t left_at_ns);
// Empty optional unless the key is a whole "journal_purge/" key and the
// value is 16 bytes.
std::optional<JournalPurgeMark> decode_journal_purge(std::string_view key, std::string_view value);

}  // namespace tidal

#endif  // TIDAL_STORAGE_JOURNAL_FORMAT_H_
