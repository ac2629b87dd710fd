// Format 4's contribution ledger, sealed per user (docs/FORMAT.md, "The
// sealed ledger"; docs/PURGE.md, "What erased means").
//
// Every user who contributes to a shared aggregate has a 256-bit key of
// their own, drawn from the OS CSPRNG (OpenSSL's RAND_bytes) the first time
// the state store's writer stores a contribution of theirs, and kept in the
// users engine's key store, written (synced) before the first batch it seals
// is ingested into the state engine. The key store holds each user's key
// sealed (wrapped) with the key of the user's bucket: a set of <= ~32 users by
// a hash of their ids, 65,536 buckets at first, split as the key store
// grows (KeyShape). The user's ledger records are
// sealed with the user's key (AES-256-GCM) and named by a pseudonym derived
// from it, so that no key of the ledger names the user in clear:
//
//   bucket_keys CF    key   [group: 2 BE]                  (depth 16, 2 bytes)
//                           [group: 2 BE][depth: 1][the prefix's bits
//                            after the group's: 2 BE]   (depth 17-32, 5 bytes)
//                     value [version: 1 = 0x01][generation: 4 BE][bucket key: 32]
//                                                                 (37 bytes)
//                           or, with a key-encryption key (KeyEncryptionKey),
//                           [0x02][generation: 4 BE][0x01][nonce: 12]
//                           [wrapped bucket key: 32][tag: 16]     (66 bytes)
//   wrapped_keys CF   key   [group: 2 BE][user_id: 8 BE]          (10 bytes)
//                     value [version: 4 = 0x04][depth: 1][generation: 4 BE]
//                           [0x01][nonce: 12][wrapped key: 32][tag: 16]
//                                                                 (67 bytes;
//                           version 3, the same, holds a key stored before
//                           HKDF; version 2, 66 bytes, has no depth: 16)
//   meta (users engine)   "key_store_shape" -> KeyShape::encode
//   sealed_ledger CF  key   [epoch: 8 BE][pseudonym: 16]          (24 bytes)
//                     value [version: 2 = 0x02][nonce: 12][ciphertext][tag: 16]
//                           (version 1: sealed with the raw key, read only)
//   sealed_index CF   key   [pseudonym: 16][epoch: 8 BE]          (24 bytes)
//                     value empty
//
//   group        = the top 16 bits of mix64(user_id) (format.h)
//   bucket       = the top `depth` bits of mix64(user_id) (KeyBucket)
//   wrapped key  = AES-256-GCM(the bucket key of that generation, nonce,
//                  the user's key, aad = the wrapped_keys key + the version
//                  (4 only) + the depth + the generation (BE) + 0x01)
//   subkeys    = HKDF-SHA256(key, info = "tidal ledger seal v2", "tidal
//                ledger pseudonym v2", "tidal erasure mark v2") (KeyDerivation)
//   pseudonym  = the pseudonym subkey (16 bytes); of a key stored before
//                HKDF: HMAC-SHA256(key, "tidal ledger pseudonym v1"), first 16
//   ciphertext = AES-256-GCM(the sealing subkey, nonce, plaintext,
//                            aad = the record's key + the version byte);
//                the nonce is random. One record per user per batch of the
//                writer; its plaintext is the user's entries of the batch
//                (put_sealed_entry), sorted by (target, target id, item),
//                each [target: 1, 0 cohort / 1 community][target id: varint]
//                [item: varint][units: zigzag varint, up to 19 bytes].
//                Ciphertext does not compress, so the entries are made
//                small before they are sealed: ~11 bytes an entry of the
//                demo's instead of format 3's 33 (which RocksDB compressed).
//
// The sealed ledger is laid out for writing: its keys begin with the batch's
// epoch, which only grows, so each batch's file lies past every file before
// it and RocksDB ingests it straight into the last level, where no
// compaction ever rewrites it. The index names each user's records (one
// small key per record, in pseudonym order, no value) so that a purge reads
// one user's records in O(their records): a seek of the index, then a point
// read of each record.
//
// A purge deletes the user's key once its batch is ingested: it deletes
// the wrapped key and gives the user's bucket a new key (the next
// generation), with which it wraps again the keys of the bucket's other
// users, in one batch (delete_user_keys); then it erases the bucket's old
// key physically (the bucket_keys family's files and WAL, in the users
// engine, whose compactions are few and short: in the state engine,
// RocksDB's deletion of the replaced files waited for the ledger's and
// aggregates' compactions under way). From then on the user's wrapped key
// cannot be unwrapped, so the user's records cannot be opened, nor linked
// to the user. The erasure rewrites only bucket keys (~3.2 MB at 1M users),
// and a purge wraps again <= ~32 keys a purged user, whatever the number of
// users: the wrapped keys stay where they are,
// and their files are compacted as RocksDB sees fit. The purge deletes the
// user's index entries; the
// sealed records themselves stay where they are, unreadable ciphertext
// that nothing indexes (deleting them would rewrite the old files they
// lie in, the cost per purge the layout exists to avoid), and a ledger
// scan skips them (LedgerCheck::purged_records), until RocksDB next
// compacts their file (at the latest after Storage::kSealedReclaimPeriod),
// which drops them (storage.cc, SealedRecordReclaim). A user who
// contributes again gets a new key, so a later purge removes only what
// came after.
//
// The "ledger" column family keeps, unsealed, what a Db wrote before it was
// upgraded to format 4 (docs/FORMAT.md, "Upgrading to format 4"): it is read
// beside the sealed ledger and never written again; a purge erases a user's
// records there physically, as format 3 did.
#ifndef TIDAL_STORAGE_SEALED_LEDGER_H_
#define TIDAL_STORAGE_SEALED_LEDGER_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "storage/secret.h"
#include "storage/state_format.h"
#include "tidal/status.h"

namespace rocksdb {
class Snapshot;
}

namespace tidal {

class Storage;

inline constexpr std::size_t kUserKeySize = 32;
inline constexpr std::size_t kPseudonymSize = 16;
inline constexpr std::size_t kKeyStoreKeySize = 2 + 8;  // a wrapped_keys key
inline constexpr std::size_t kKeyStoreValueSize = 1 + kUserKeySize;  // UserKey::encode
inline constexpr std::size_t kKeyBuckets = 1 << 16;  // groups: the buckets of depth 16
inline constexpr unsigned kMinBucketDepth = 16;
inline constexpr unsigned kMaxBucketDepth = 32;
inline constexpr std::size_t kBucketKeySize = 2;      // a bucket_keys key of depth 16
inline constexpr std::size_t kDeepBucketKeySize = 5;  // of a deeper bucket
inline constexpr std::size_t kBucketValueSize = 1 + 4 + kUserKeySize;
inline constexpr std::size_t kWrappedKeySize = 1 + 1 + 4 + 1 + 12 + kUserKeySize + 16;  // version 3
inline constexpr std::size_t kWrappedKeySizeV2 = 1 + 4 + 1 + 12 + kUserKeySize + 16;
// The stored keys a bucket holds on average before the key store splits
// one (KeyShape). A bulk purge of k users among n wraps again ~k n / B
// keys and its erasure rewrites the B bucket keys: at k = 5,000 the sum is
// least near 14 users a bucket at 1M users and 27 at 4M. At 16 the splits
// (from 1M users) cost the 4M-user demo ~10 % of its signal rate and made
// the erasure the larger half (bench/README.md, "Session 40"); at 32 they
// begin past 2M users.
inline constexpr std::uint64_t kUsersPerBucket = 32;
inline constexpr std::size_t kSealedLedgerKeySize = 8 + kPseudonymSize;
inline constexpr std::size_t kSealedIndexKeySize = kPseudonymSize + 8;
inline constexpr std::size_t kSealVersionSize = 1;
inline constexpr std::size_t kErasureTagSize = 16;
inline constexpr std::size_t kSealNonceSize = 12;
inline constexpr std::size_t kSealTagSize = 16;

// How a user's key derives what it is used for (docs/FORMAT.md, "Key
// derivation"). Hkdf: three subkeys by HKDF-SHA256 with distinct labels, one
// to seal records (version 2), one for the pseudonym, one for the erasure
// tag; the raw key itself serves nothing but the key store's wrapping. Hmac:
// the keys stored before HKDF (wrapped_keys versions 2 and 3), whose
// pseudonym and erasure tag are HMAC-SHA256 of the raw key, so that their
// index stays valid; they seal new records with their HKDF sealing subkey
// too, and open their old records (version 1) with the raw key.
enum class KeyDerivation : unsigned char { Hmac, Hkdf };

// What seals a user's records and names them: the sealing subkey and the
// pseudonym (48 bytes, what the state store's writer holds of each user).
// Wiped when destroyed.
class SealingKey {
 public:
  SealingKey(const SealingKey& other) = default;
  SealingKey& operator=(const SealingKey& other) = default;
  ~SealingKey();

  // The 16 bytes that name the user's records: the end of each of their
  // sealed ledger keys, the start of each of their index keys.
  std::string_view pseudonym() const {
    return {reinterpret_cast<const char*>(pseudonym_.data()), pseudonym_.size()};
  }
  // The sealed ledger key of the user's record of batch `epoch`, and its
  // index key.
  std::string record_key(std::uint64_t epoch) const;
  // The same name, without an allocation (the writer makes one a record).
  std::array<char, kSealedLedgerKeySize> record_name(std::uint64_t epoch) const;
  std::string index_key(std::uint64_t epoch) const;
  // Seals `plaintext` as the value of the record named `record_key` (a
  // version-2 record, under the sealing subkey), appended to *value.
  // IOError when libcrypto fails (it does not, short of memory).
  Status seal(std::string_view record_key, std::string_view plaintext, std::string* value) const;

 protected:
  SealingKey() = default;

  std::array<unsigned char, kUserKeySize> seal_key_{};
  std::array<unsigned char, kPseudonymSize> pseudonym_{};
};

// One user's ledger key, and what is derived from it. The key's bytes are
// wiped when the object is destroyed; they are never printed (a message
// names the user, never the key).
class UserKey : public SealingKey {
 public:
  // A new key from the OS CSPRNG (derived with HKDF); IOError when it has
  // none to give.
  static Result<UserKey> generate();
  // From encode()'s bytes; empty unless 33 bytes of version 1 (Hmac) or 2
  // (Hkdf).
  static std::optional<UserKey> decode(std::string_view stored);

  UserKey(const UserKey& other) = default;
  UserKey& operator=(const UserKey& other) = default;
  ~UserKey();

  KeyDerivation derivation() const { return derivation_; }
  // [version: 1 = Hmac, 2 = Hkdf][key: 32]: what tests hold of a user's
  // key. Never stored (BucketKey::wrap).
  SecretBytes encode() const;
  // What a purge's erasure mark holds to name this key (16 bytes, another
  // derivation of it), so that the mark, which names the user, does not
  // name the user's sealed records too, as the pseudonym would.
  std::string erasure_tag() const;
  // Opens a value sealed under `record_key`: false when it is not this
  // key's (the tag does not authenticate), or the record was changed. A
  // version-1 record opens with the raw key of an Hmac key only.
  bool open(std::string_view record_key, std::string_view value, std::string* plaintext) const;

  // The raw key, for tests that look for it in files (tests/erasure_scan.h).
  std::string_view bytes_for_testing() const {
    return {reinterpret_cast<const char*>(key_.data()), key_.size()};
  }

 private:
  friend class BucketKey;
  UserKey() = default;
  // Fills the subkeys and the pseudonym from key_ and derivation_; false
  // when libcrypto fails (the key is then not used).
  bool derive();

  std::array<unsigned char, kUserKeySize> key_{};
  KeyDerivation derivation_ = KeyDerivation::Hkdf;
};

// For tests of the keys stored before HKDF: while set, new keys derive as
// Hmac keys and seal version-1 records with the raw key, as the format-4
// Dbs written before HKDF did, and are stored as such (wrapped_keys version
// 3), so that a test writes such a Db and then opens it without the flag.
std::atomic<bool>& hmac_keys_for_testing();

// The host's key-encryption key (Options::key_encryption_key; docs/FORMAT.md,
// "The key-encryption key"): an AES-256 key that wraps each bucket key in
// the bucket_keys family, so that the Db's files alone unwrap no user's key.
// Wiped when destroyed.
class KeyEncryptionKey {
 public:
  // From the host's 32 bytes; InvalidArgument naming the length otherwise.
  static Result<KeyEncryptionKey> from(std::string_view bytes);
  KeyEncryptionKey(const KeyEncryptionKey& other) = default;
  KeyEncryptionKey& operator=(const KeyEncryptionKey& other) = default;
  ~KeyEncryptionKey();

  // The value of the users engine's meta key kKeyEncryptionCheckKey that
  // this key opens (61 bytes), and whether `stored` is one that it opens.
  Result<std::string> check_value() const;
  bool opens_check(std::string_view stored) const;

 private:
  friend class BucketKey;
  KeyEncryptionKey() = default;
  std::array<unsigned char, kUserKeySize> key_{};
};
// Users-engine meta key: present when the Db's bucket keys are wrapped with
// a key-encryption key, holding a check value sealed with it.
inline constexpr char kKeyEncryptionCheckKey[] = "key_encryption_check";
inline constexpr std::size_t kWrappedBucketValueSize = 1 + 4 + 1 + 12 + kUserKeySize + 16;  // version 2

// One bucket's key and its generation: the key that wraps the keys of the
// bucket's users in the key store. A purge replaces it with a new one of
// the next generation and erases the old one. Wiped when destroyed.
class BucketKey {
 public:
  // A new key from the OS CSPRNG, of generation `generation`.
  static Result<BucketKey> generate(std::uint32_t generation);
  // From a bucket_keys value; empty unless 37 bytes of version 1.
  static std::optional<BucketKey> decode(std::string_view stored);

  BucketKey(const BucketKey& other) = default;
  BucketKey& operator=(const BucketKey& other) = default;
  ~BucketKey();

  std::uint32_t generation() const { return generation_; }
  // The bucket_keys value in clear (version 1; wiped when the result is
  // destroyed).
  SecretBytes encode() const;
  // The bucket_keys value of bucket `bucket_key` (its bucket_keys key),
  // wrapped with `kek` (version 2, 66 bytes).
  Result<std::string> encode(const KeyEncryptionKey& kek, std::string_view bucket_key) const;
  // From a version-2 value of bucket `bucket_key`; empty unless 66 bytes
  // that `kek` opens under that key.
  static std::optional<BucketKey> decode(std::string_view stored, const KeyEncryptionKey& kek,
                                         std::string_view bucket_key);
  // `user_key` of `user`, wrapped for the wrapped_keys family by this key
  // of a bucket of depth `depth` (67 bytes: version 4 for an Hkdf key, 3
  // for an Hmac one).
  Status wrap(std::uint64_t user, unsigned depth, const UserKey& user_key, std::string* value) const;
  // The key a wrapped_keys value (version 2, 3 or 4) holds: empty when it
  // is not this key's (another generation or bucket, another user's
  // record, or changed).
  std::optional<UserKey> unwrap(std::uint64_t user, std::string_view value) const;
  // Each of `values` (the wrapped_keys values of `users`, wrapped with this
  // key) unwrapped and wrapped again with `next`, the key of a bucket of
  // depth `depth`, into (*out)[i] (keeping each key's derivation), with one
  // context keyed once each way: keying one per key cost as much as the
  // wrapping itself. Corruption naming the user when one does not unwrap.
  Status rewrap(const BucketKey& next, unsigned depth, const std::vector<std::uint64_t>& users,
                const std::vector<std::string>& values, std::vector<std::string>* out) const;
  // The raw key, for tests that look for it in files (tests/erasure_scan.h).
  std::string_view bytes_for_testing() const {
    return {reinterpret_cast<const char*>(key_.data()), key_.size()};
  }

 private:
  BucketKey(std::uint32_t generation) : generation_(generation) {}
  std::uint32_t generation_;
  std::array<unsigned char, kUserKeySize> key_{};  // AES-256, used as is
};

// A version-1 record (or wrapped key) sealed with `key` (32 raw bytes) as
// AES-256-GCM key, as the keys stored before HKDF sealed their records: for
// tests that write what those wrote.
Status seal_v1_for_testing(std::string_view key, std::string_view record_key, std::string_view plaintext,
                           std::string* value);

// The group of `user` (the top 16 bits of mix64(user)): the first two
// bytes of the user's wrapped_keys key, and of the key of each bucket that
// can hold the user, whatever its depth.
std::uint16_t key_bucket(std::uint64_t user);
// [group BE]: the key of the group's bucket of depth 16, and where the
// group's keys begin in both key-store families.
std::string encode_bucket_key(std::uint16_t group);
// The group of a bucket_keys key (its first two bytes); empty when shorter.
std::optional<std::uint16_t> bucket_key_group(std::string_view key);

// A bucket of the key store: the users the top `depth` bits of whose hash
// (mix64) are `prefix`. Depth 16 is a whole group; a deeper bucket is part
// of one (KeyShape).
struct KeyBucket {
  unsigned depth = kMinBucketDepth;
  std::uint32_t prefix = 0;

  // The bucket of depth `depth` that holds `user`.
  static KeyBucket of(std::uint64_t user, unsigned depth);
  // From a bucket_keys key: [group BE] (depth 16), or [group BE][depth]
  // [the prefix's bits after the group's, BE16] (depth 17 to 32); empty
  // for anything else.
  static std::optional<KeyBucket> decode(std::string_view key);
  std::string key() const;
  std::uint16_t group() const { return static_cast<std::uint16_t>(prefix >> (depth - kMinBucketDepth)); }
  // "bucket 1234" (depth 16) or "bucket 1234.5/18" (the bits past the group's).
  std::string text() const;
  // In the order of their keys.
  friend bool operator<(const KeyBucket& x, const KeyBucket& y) {
    if (x.group() != y.group()) return x.group() < y.group();
    if (x.depth != y.depth) return x.depth < y.depth;
    return x.prefix < y.prefix;
  }
  friend bool operator==(const KeyBucket& x, const KeyBucket& y) = default;
};

// How the key store spreads its users over buckets, by linear hashing: the
// buckets are those of depth `depth`, but that the first `split` of them
// are split into two of the next depth each. When the stored keys pass
// kUsersPerBucket a bucket, the next one is split (store_user_keys), so
// that a bucket holds <= ~32 users however many the Db has, and a purge
// wraps again <= ~32 keys a user purged (docs/FORMAT.md, "The key store").
// Kept in the users engine's meta family (kKeyShapeKey), written with each
// change of the key store.
struct KeyShape {
  unsigned depth = kMinBucketDepth;
  std::uint32_t split = 0;
  std::uint64_t keys = 0;  // the stored keys (drives the splits only)

  KeyBucket bucket_of(std::uint64_t user) const;
  std::uint64_t buckets() const { return (std::uint64_t{1} << depth) + split; }
  // [version: 1 = 0x01][depth: 1][split: 4 BE][keys: 8 BE] (14 bytes).
  std::string encode() const;
  static std::optional<KeyShape> decode(std::string_view stored);
};
inline constexpr char kKeyShapeKey[] = "key_store_shape";
// For tests: while nonzero, each write of new keys also splits buckets
// until the key store has this many (at most 1,024 a write), so that a test
// reaches deeper buckets without a million users.
std::atomic<std::uint64_t>& split_to_buckets_for_testing();

// The generation a wrapped_keys value was wrapped with, and the depth of
// the bucket whose key wrapped it; empty unless 67 bytes of version 3 or 4,
// or 66 of version 2 (depth 16, written before buckets split). Version 4
// holds an Hkdf key; 2 and 3 an Hmac one.
struct WrappedHeader {
  unsigned version;
  unsigned depth;
  std::uint32_t generation;
  std::size_t size;  // the header's bytes, before the sealed key
};
std::optional<WrappedHeader> wrapped_key_header(std::string_view value);
std::optional<std::uint32_t> wrapped_key_generation(std::string_view value);

// The bucket key `stored` (the bucket_keys value of `bucket`) holds, read
// with the Db's key-encryption keys (Storage::key_encryption): a version-1
// value when the Db has none (or its open is still to wrap them), a
// version-2 value wrapped with the current or the previous one when it has.
// Empty when it does not decode.
std::optional<BucketKey> decode_bucket_value(const Storage& storage, const KeyBucket& bucket, std::string_view stored);

// Checks `kek` (the host's key-encryption key, when given) against the Db
// before the open changes anything, and keeps it in `storage`:
// InvalidArgument when the Db's bucket keys are wrapped and no key is given
// ("Options::key_encryption_key is missing"), when the key given does not
// open the Db's check value (another key), when it is not 32 bytes, or when
// a read-only open is given a key for a Db that has none (only a writable
// open can wrap its bucket keys).
Status open_key_encryption(Storage& storage, const std::optional<std::string>& kek, bool read_only);
// A writable open given a key for a Db that had none wraps every bucket key
// with it and stores its check value, in one synced write, then flushes and
// compacts the bucket_keys family so that no SST of it holds a bucket key in
// clear. Nothing to do otherwise.
Status finish_key_encryption(Storage& storage);
// Db::rotate_key_encryption_key: every bucket key wrapped again with `next`
// (32 bytes) and its check value, in one synced write (under key_writes_mu),
// then the bucket_keys family flushed and compacted, so that no SST of it
// holds a value the old key wrapped. A Db without a key gets one the same
// way. InvalidArgument when `next` is not 32 bytes.
Status rotate_key_encryption(Storage& storage, std::string_view next);

// Stores the new keys `created` (synced), each wrapped with its bucket's
// current key; a bucket with none gets one (generation 1) in the same
// write. Under Storage::key_writes_mu, as every write of the key store is.
Status store_user_keys(Storage& storage, const std::vector<std::pair<std::uint64_t, UserKey>>& created,
                       const std::string& what);
// Deletes the stored keys of `users` (those that have one): in one synced
// write, each of their buckets, and each bucket of `replaced` (users whose
// stored key replaced one that a purge could not delete: the replaced key's
// wrapped copy may still be in the files), gets a key of the next
// generation, the keys of the bucket's other users are wrapped again with
// it, and those of `users` are deleted. The old bucket keys are then what
// the erasure removes from the files (Db::Impl::erase_purged), and it drops
// every key that is not its bucket's current one: synced, so that a power
// cut cannot take back the new key after the erasure dropped the old one.
Status delete_user_keys(Storage& storage, const std::vector<std::uint64_t>& users,
                        const std::vector<std::uint64_t>& replaced, const std::string& what);

// The stored ledger key of `user` (as of `snapshot`, when given); empty
// when the key store holds none (the user never contributed since the
// Db's format-4 upgrade, or was purged since). Corruption when the record
// does not decode.
Result<std::optional<UserKey>> read_user_key(const Storage& storage, std::uint64_t user,
                                             const rocksdb::Snapshot* snapshot = nullptr);
// The stored keys of `users` (ascending), in two MultiGets of the key
// store (the wrapped keys, then their buckets' keys) at one snapshot:
// (*keys)[i] is empty when users[i] has none.
Status read_user_keys(const Storage& storage, std::span<const std::uint64_t> users,
                      std::vector<std::optional<UserKey>>* keys);

// Appends one entry of a sealed record's plaintext (see the top).
void put_sealed_entry(std::string* out, const LedgerEntry& entry);
// The entries of a sealed record's plaintext; empty when it is empty,
// truncated, or names a target other than cohort or community.
std::optional<std::vector<LedgerEntry>> decode_sealed_entries(std::string_view plaintext);

// [bucket BE][user_id BE]: the wrapped_keys key of `user_id`.
std::string encode_key_store_key(std::uint64_t user_id);
// The user id; empty unless 10 bytes whose bucket is the user's.
std::optional<std::uint64_t> decode_key_store_key(std::string_view key);
// The first key after every index key that starts with `pseudonym`.
std::string pseudonym_end(std::string_view pseudonym);
// The epoch and the pseudonym of a sealed ledger key; empty unless 24 bytes.
std::optional<std::uint64_t> sealed_ledger_epoch(std::string_view key);
std::optional<std::string_view> sealed_ledger_pseudonym(std::string_view key);
// The epoch of an index key, and the sealed ledger key it names; empty
// unless 24 bytes.
std::optional<std::uint64_t> sealed_index_epoch(std::string_view index_key);
std::optional<std::string> sealed_record_of(std::string_view index_key);
// The index key of a sealed ledger key, into *out (replacing what it held);
// false when `record_key` is not one.
bool sealed_index_key_of(std::string_view record_key, std::string* out);

}  // namespace tidal

#endif  // TIDAL_STORAGE_SEALED_LEDGER_H_
