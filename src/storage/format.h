// The on-disk format in code, as LevelDB's dbformat.h: tags, keys, the
// users-record codecs, the meta keys and the clock floor. docs/FORMAT.md
// describes the same bytes for a reader without the code. The state store's
// records (weights, aggregate cells, ledger) are in storage/state_format.h and
// the purge receipt (0x10) in storage/receipt.h; both build on this header,
// and no other file defines a byte of the format.
//
// Keys of the users partition: [user_id: 8 bytes BE][tag: 1 byte][suffix].
// All of a user's records are contiguous and sorted by tag; users sort
// numerically.
#ifndef TIDAL_STORAGE_FORMAT_H_
#define TIDAL_STORAGE_FORMAT_H_

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "tidal/db.h"

namespace tidal {

enum class Tag : std::uint8_t {
  CommunityMember = 0x01,        // suffix: community id (8 bytes BE); value empty
  PurgeManifest = 0x10,          // suffix: purged_at_ns (8 bytes BE); value: a receipt (storage/receipt.h)
  CommunityLeave = 0x11,         // no suffix; value: 9-byte CommunityMembership
  CommunityLeaveHistory = 0x12,  // suffix: at_ns (8 bytes BE); value: 1 status byte
  ContributionLedger = 0x13,     // in the ledger column family; see storage/state_format.h
};

struct EntityId {
  explicit EntityId(std::uint64_t v) : value(v) {}
  std::uint64_t value;
};

struct DecodedKey {
  std::uint64_t user_id;
  std::uint8_t tag;  // raw byte: the partition may hold tags this version does not know
  std::string_view suffix;
};

void put_u64_be(std::string* out, std::uint64_t v);
void put_u64_le(std::string* out, std::uint64_t v);
void put_u32_be(std::string* out, std::uint32_t v);
std::uint32_t get_u32_be(const char* p);
std::uint64_t get_u64_be(const char* p);
std::uint64_t get_u64_le(const char* p);
// SplitMix64's finalizer: a hash of an id that spreads sequential ids.
inline std::uint64_t mix64(std::uint64_t v) {
  v = (v ^ (v >> 30)) * 0xbf58476d1ce4e5b9ULL;
  v = (v ^ (v >> 27)) * 0x94d049bb133111ebULL;
  return v ^ (v >> 31);
}

std::string encode_key(EntityId id, Tag tag, std::string_view suffix = {});
// The 9-byte prefix shared by every key of `id` with `tag`.
std::string encode_key_prefix(EntityId id, Tag tag);
// Empty optional when `key` is shorter than 9 bytes.
std::optional<DecodedKey> decode_key(std::string_view key);

// Index keys (the "by_tag" column family) put the tag first, so all records of
// one tag can be read without touching the rest of the users partition:
// [tag: 1 byte][user_id: 8 bytes BE][suffix].
std::string encode_index_key(EntityId id, Tag tag, std::string_view suffix = {});
std::optional<DecodedKey> decode_index_key(std::string_view key);

// "0000000000002a11" style hex of a key, for messages.
std::string hex(std::string_view bytes);

// ---- users records of the community layer (0x11, 0x12) ----

inline constexpr std::size_t kMembershipValueSize = 9;

// [status: 1 byte, 0 Active / 1 Left][left_at_ns: 8 bytes LE, 0 = none].
std::array<char, kMembershipValueSize> serialize_membership(const CommunityMembership& m);
// Empty optional for any length but 9, a status byte other than 0 or 1, and
// Left with left_at_ns 0.
std::optional<CommunityMembership> deserialize_membership(std::uint64_t user_id, std::string_view bytes);

// 0x12 history value: one byte, the status entered at the key's at_ns.
char serialize_history_status(MembershipStatus status);
// Empty optional unless exactly one byte of value 0 or 1.
std::optional<MembershipStatus> deserialize_history_status(std::string_view bytes);

// ---- meta records (the default column family of each engine) ----

// The layout of the Db directory, in the users engine's meta: "4" for two
// engines (the users engine in the directory, the state engine in state/)
// whose ledger is sealed per user (storage/sealed_ledger.h); "3" for the
// same without the sealed ledger, upgraded to "4" by a writable open.
// Absent in format 2, where one RocksDB database held every column family;
// written last by the migration (storage/migrate.cc), as its commit point.
// tidal 0.3 reads only "3" and refuses any other value, naming it.
inline constexpr char kDbFormatKey[] = "db_format";
inline constexpr char kDbFormat[] = "4";
inline constexpr char kDbFormat3[] = "3";

// Present, with value kIndexVersion, once the by_tag index is complete
// (storage/index.h).
inline constexpr char kIndexVersionKey[] = "index_version";
inline constexpr char kIndexVersion[] = "1";
// The format of the state store's records (storage/state_format.h); checked
// and written by StateStore::check_format.
inline constexpr char kStateFormatKey[] = "state_format";
inline constexpr char kStateFormat[] = "2";
// The users engine's own "state_format" record in format 3, written with
// db_format: a value tidal 0.2 refuses. Every 0.2 open (read-only too) first
// reads "state_format" from its one engine's meta and refuses any value but
// "2" with "its aggregates are in format <value>; this version reads format
// 2", so 0.2 never runs a format-3 Db on empty aggregates. Format 3 reads
// the state engine's record, never this one.
inline constexpr char kUsersStateFormatMark[] =
    "3 (db_format 3: written by tidal 0.3 or newer, its aggregates are in the state/ directory)";
// The epoch of the state store's latest batch (8 bytes BE), written synced
// before the batch is ingested: it takes a sequence number, so every later
// batch's epoch is above it, even after a crash (StateStore).
inline constexpr char kStateEpochKey[] = "state_epoch";
// Empty value, written memtable-only by Storage::close so that its flush
// moves every column family past the WAL; never read.
inline constexpr char kCleanCloseKey[] = "clean_close";
// Clock floors: every record under the prefix holds 8 bytes LE, and a
// reopened Db's clock starts above the largest. One record per user lock
// stripe (the last leave/rejoin time of the stripe, written with it), and
// the lease (Clock::leased_now), written alone. Older versions also wrote
// "clock_floor/flush"; it is still read.
inline constexpr char kClockFloorPrefix[] = "clock_floor/";
inline constexpr char kClockLeaseKey[] = "clock_floor/lease";
inline constexpr std::size_t kClockFloorValueSize = 8;

// Purges whose physical erasure has not finished: "erasure_pending/" +
// [user_id: 8 bytes BE] -> [purged_at_ns: 8 bytes BE] of the user's earliest
// receipt not yet erased, then (format 4, when the purge deleted a ledger
// key) the 16-byte erasure tag of the last key purged (UserKey::erasure_tag:
// a derivation of the key other than its pseudonym, so that the mark does
// not name the user's sealed records). Written in the purge's
// batch, deleted once no SST or WAL file holds the purged key or format-3
// ledger; a writable open finishes every erasure still marked
// (docs/PURGE.md).
inline constexpr char kErasurePendingPrefix[] = "erasure_pending/";
std::string erasure_pending_key(std::uint64_t user_id);
struct ErasureMark {
  std::uint64_t since = 0;  // purged_at_ns
  std::string key_tag;      // empty, or the purged key's erasure tag (16 bytes)
};
std::string encode_erasure_mark(const ErasureMark& mark);
// Null unless 8 or 24 bytes.
std::optional<ErasureMark> decode_erasure_mark(std::string_view value);

// The change feed (docs/FORMAT.md, "The change feed"): the shard id, stored
// at the first open with Options::change_feed ([shard_id: 8 BE]), and the
// trim point ([through_seq: 8 BE][end_offset: 8 BE], the payload bytes ever
// appended through it).
inline constexpr char kFeedShardKey[] = "feed_shard_id";
inline constexpr char kFeedTrimmedKey[] = "feed_trimmed";
// The feed's incarnation: 16 random bytes, written with the shard id when
// the feed is created (or at the first writable open of a feed made before
// incarnations) and replaced by each re-seed; ChangeBatch::incarnation is
// their hex.
inline constexpr char kFeedIncarnationKey[] = "feed_incarnation";
// Its ordinal (ChangeBatch::incarnation_ordinal): [incarnation: 16 bytes]
// [ordinal: 8 BE], written with each new incarnation. One that names
// another incarnation than kFeedIncarnationKey's (a re-seed by a version
// before ordinals), or none (a feed made before them), is replaced by a new
// ordinal at the next writable open.
inline constexpr char kFeedOrdinalKey[] = "feed_incarnation_ordinal";

// The manifest of a backup (Db::backup), in its directory: a Db directory
// that holds it is recovering until finish_recovery() removes it.
inline constexpr char kBackupManifest[] = "TIDAL_BACKUP";
// A backup is assembled in "<dir>" + kBackupStagingSuffix and renamed to
// <dir> once whole; while it runs, a file named kBackupPendingPrefix + a
// hash of that path in the Db's directory names it, so that an open after
// a crash removes what a killed backup left (db/backup.cc).
inline constexpr char kBackupStagingSuffix[] = ".tidal-backup-tmp";
inline constexpr char kBackupPendingPrefix[] = "TIDAL_BACKUP_PENDING-";
inline constexpr std::size_t kIncarnationBytes = 16;
inline constexpr std::size_t kIncarnationOrdinalBytes = 8;

// "clock_floor/" + [stripe: 8 bytes BE].
std::string clock_floor_stripe_key(std::uint64_t stripe);
// [ts: 8 bytes LE].
std::string serialize_clock_floor(std::uint64_t ts);
// Empty optional for any length but 8.
std::optional<std::uint64_t> deserialize_clock_floor(std::string_view bytes);

}  // namespace tidal

#endif  // TIDAL_STORAGE_FORMAT_H_
