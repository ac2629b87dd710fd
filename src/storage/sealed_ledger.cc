#include "storage/sealed_ledger.h"

#include <pthread.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>

#include <rocksdb/db.h>
#include <rocksdb/snapshot.h>
#include <rocksdb/write_batch.h>

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/core_names.h>
#include <openssl/params.h>
#include <openssl/rand.h>

#include "storage/format.h"
#include "storage/storage.h"

namespace tidal {
namespace {

constexpr unsigned char kKeyVersion = 1;
constexpr unsigned char kRecordVersion = 1;
constexpr unsigned char kBucketVersion = 1;
constexpr unsigned char kWrappedVersion = 2;
constexpr char kPseudonymLabel[] = "tidal ledger pseudonym v1";
constexpr char kErasureTagLabel[] = "tidal erasure mark v1";

// The reason of libcrypto's last error, for a message.
std::string crypto_error() {
  const unsigned long e = ERR_get_error();
  if (e == 0) return "no reason given";
  char text[256];
  ERR_error_string_n(e, text, sizeof text);
  return text;
}

struct CipherCtxDeleter {
  void operator()(EVP_CIPHER_CTX* ctx) const { EVP_CIPHER_CTX_free(ctx); }
};
// One context per thread, reset by each use: allocating one per record cost
// as much as the sealing itself.
EVP_CIPHER_CTX* cipher_ctx() {
  thread_local std::unique_ptr<EVP_CIPHER_CTX, CipherCtxDeleter> ctx(EVP_CIPHER_CTX_new());
  return ctx.get();
}

const unsigned char* bytes(std::string_view s) { return reinterpret_cast<const unsigned char*>(s.data()); }

// AES-256-GCM, fetched from libcrypto's providers once: with
// EVP_aes_256_gcm() OpenSSL 3 fetched it again by name at each init, under
// its locks, and set up a new cipher context: about a quarter of the
// writer's time at 300k users (bench/README.md, "Format 4"). Null when
// libcrypto has none; each init then fails.
const EVP_CIPHER* aes_256_gcm() {
  static EVP_CIPHER* const cipher = EVP_CIPHER_fetch(nullptr, "AES-256-GCM", nullptr);
  return cipher;
}

// The nonces and new keys, from a per-thread pool of the OS CSPRNG's bytes,
// refilled 4 KiB at a time: RAND_bytes per record (its locks, and a getpid
// system call each) cost more than the sealing. Bytes are wiped from the
// pool as they are taken. A forked child empties the pool of the thread
// that forked (the only one it has), so it never draws the parent's bytes.
struct RandomPool {
  std::array<unsigned char, 4096> bytes{};
  std::size_t used = 4096;
};
RandomPool& random_pool() {
  thread_local RandomPool pool;
  return pool;
}
bool random_bytes(unsigned char* out, std::size_t size) {
  static std::once_flag fork_handler;
  std::call_once(fork_handler, [] { pthread_atfork(nullptr, nullptr, [] { random_pool().used = 4096; }); });
  RandomPool& pool = random_pool();
  if (pool.used + size > pool.bytes.size()) {
    if (RAND_bytes(pool.bytes.data(), static_cast<int>(pool.bytes.size())) != 1) return false;
    pool.used = 0;
  }
  std::memcpy(out, pool.bytes.data() + pool.used, size);
  OPENSSL_cleanse(pool.bytes.data() + pool.used, size);
  pool.used += size;
  return true;
}

// HMAC-SHA256 (the key's derivations), fetched once, with one context per
// thread that each derivation keys anew: HMAC() looked up HMAC and SHA-256
// by name at every call, under libcrypto's locks (with RAND_bytes, a third
// of a new key's cost in the writer at 4M users). Null when libcrypto has
// none; each derivation then fails.
struct MacCtxDeleter {
  void operator()(EVP_MAC_CTX* ctx) const { EVP_MAC_CTX_free(ctx); }
};
EVP_MAC_CTX* hmac_sha256_ctx() {
  static EVP_MAC* const hmac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  thread_local std::unique_ptr<EVP_MAC_CTX, MacCtxDeleter> ctx = []() -> std::unique_ptr<EVP_MAC_CTX, MacCtxDeleter> {
    if (hmac == nullptr) return nullptr;
    std::unique_ptr<EVP_MAC_CTX, MacCtxDeleter> c(EVP_MAC_CTX_new(hmac));
    char digest[] = "SHA256";
    const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                                 OSSL_PARAM_construct_end()};
    if (c == nullptr || EVP_MAC_CTX_set_params(c.get(), params) != 1) return nullptr;
    return c;
  }();
  return ctx.get();
}

}  // namespace

Result<UserKey> UserKey::generate() {
  UserKey key;
  if (!random_bytes(key.key_.data(), key.key_.size())) {
    return Status::IOError("the OS random number generator gave no key for a user's ledger (OpenSSL RAND_bytes: " +
                           crypto_error() + ")");
  }
  key.derive_pseudonym();
  return key;
}

std::optional<UserKey> UserKey::decode(std::string_view stored) {
  if (stored.size() != kKeyStoreValueSize || static_cast<unsigned char>(stored[0]) != kKeyVersion) return std::nullopt;
  UserKey key;
  std::memcpy(key.key_.data(), stored.data() + 1, kUserKeySize);
  key.derive_pseudonym();
  return key;
}

UserKey::~UserKey() {
  OPENSSL_cleanse(key_.data(), key_.size());
  OPENSSL_cleanse(pseudonym_.data(), pseudonym_.size());
}

namespace {

// HMAC-SHA256(key, label), its first `out.size()` bytes. HMAC cannot fail
// with a valid digest and key; a failure leaves `out` zero.
template <std::size_t N>
void derive(const std::array<unsigned char, kUserKeySize>& key, std::string_view label,
            std::array<unsigned char, N>* out) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  std::size_t size = 0;
  EVP_MAC_CTX* ctx = hmac_sha256_ctx();
  if (ctx != nullptr && EVP_MAC_init(ctx, key.data(), key.size(), nullptr) == 1 &&
      EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(label.data()), label.size()) == 1 &&
      EVP_MAC_final(ctx, mac, &size, sizeof mac) == 1 && size >= N) {
    std::memcpy(out->data(), mac, N);
  }
  OPENSSL_cleanse(mac, sizeof mac);
}

}  // namespace

// (A zero pseudonym, were HMAC to fail, is one every open refuses to
// authenticate.)
void UserKey::derive_pseudonym() { derive(key_, kPseudonymLabel, &pseudonym_); }

std::string UserKey::erasure_tag() const {
  std::array<unsigned char, kErasureTagSize> tag{};
  derive(key_, kErasureTagLabel, &tag);
  return {reinterpret_cast<const char*>(tag.data()), tag.size()};
}

std::string UserKey::encode() const {
  std::string out(1, static_cast<char>(kKeyVersion));
  out.append(reinterpret_cast<const char*>(key_.data()), key_.size());
  return out;
}

std::array<char, kSealedLedgerKeySize> UserKey::record_name(std::uint64_t epoch) const {
  std::array<char, kSealedLedgerKeySize> out;
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>(epoch >> (56 - 8 * i));
  std::memcpy(out.data() + 8, pseudonym_.data(), kPseudonymSize);
  return out;
}

std::string UserKey::record_key(std::uint64_t epoch) const {
  const std::array<char, kSealedLedgerKeySize> name = record_name(epoch);
  return {name.data(), name.size()};
}

std::string UserKey::index_key(std::uint64_t epoch) const {
  std::string out(pseudonym());
  put_u64_be(&out, epoch);
  return out;
}

Status UserKey::seal(std::string_view record_key, std::string_view plaintext, std::string* value) const {
  const std::size_t at = value->size();
  value->resize(at + kSealVersionSize + kSealNonceSize + plaintext.size() + kSealTagSize);
  (*value)[at] = static_cast<char>(kRecordVersion);
  auto* out = reinterpret_cast<unsigned char*>(value->data()) + at + kSealVersionSize;
  if (!random_bytes(out, kSealNonceSize)) {
    return Status::IOError("the OS random number generator gave no nonce to seal a ledger record (OpenSSL RAND_bytes: " +
                           crypto_error() + ")");
  }
  EVP_CIPHER_CTX* ctx = cipher_ctx();
  int n = 0;
  int total = 0;
  const bool ok =
      ctx != nullptr && EVP_EncryptInit_ex(ctx, aes_256_gcm(), nullptr, key_.data(), out) == 1 &&
      EVP_EncryptUpdate(ctx, nullptr, &n, bytes(record_key), static_cast<int>(record_key.size())) == 1 &&
      EVP_EncryptUpdate(ctx, nullptr, &n, &kRecordVersion, 1) == 1 &&
      EVP_EncryptUpdate(ctx, out + kSealNonceSize, &n, bytes(plaintext), static_cast<int>(plaintext.size())) == 1 &&
      (total = n, EVP_EncryptFinal_ex(ctx, out + kSealNonceSize + total, &n) == 1) &&
      EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, static_cast<int>(kSealTagSize),
                          out + kSealNonceSize + plaintext.size()) == 1;
  if (!ok) return Status::IOError("sealing a ledger record failed (OpenSSL AES-256-GCM: " + crypto_error() + ")");
  return Status::OK();
}

bool UserKey::open(std::string_view record_key, std::string_view value, std::string* plaintext) const {
  plaintext->clear();
  if (value.size() < kSealVersionSize + kSealNonceSize + kSealTagSize ||
      static_cast<unsigned char>(value[0]) != kRecordVersion) {
    return false;
  }
  value.remove_prefix(kSealVersionSize);
  const std::size_t size = value.size() - kSealNonceSize - kSealTagSize;
  plaintext->resize(size);
  const auto* in = bytes(value);
  EVP_CIPHER_CTX* ctx = cipher_ctx();
  int n = 0;
  // The tag is given before the final step checks it; libcrypto takes it
  // as non-const.
  unsigned char tag[kSealTagSize];
  std::memcpy(tag, in + kSealNonceSize + size, kSealTagSize);
  const bool ok = ctx != nullptr && EVP_DecryptInit_ex(ctx, aes_256_gcm(), nullptr, key_.data(), in) == 1 &&
         EVP_DecryptUpdate(ctx, nullptr, &n, bytes(record_key), static_cast<int>(record_key.size())) == 1 &&
         EVP_DecryptUpdate(ctx, nullptr, &n, &kRecordVersion, 1) == 1 &&
         EVP_DecryptUpdate(ctx, reinterpret_cast<unsigned char*>(plaintext->data()), &n, in + kSealNonceSize,
                           static_cast<int>(size)) == 1 &&
         EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, static_cast<int>(kSealTagSize), tag) == 1 &&
         EVP_DecryptFinal_ex(ctx, reinterpret_cast<unsigned char*>(plaintext->data()) + n, &n) == 1;
  if (!ok) plaintext->clear();  // nothing of an unauthenticated record is handed out
  return ok;
}

namespace {

void put_varint(std::string* out, UUnits v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(static_cast<unsigned char>(v) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// False when `in` ends first or the number takes more than `max_bytes`.
bool get_varint(std::string_view* in, std::size_t max_bytes, UUnits* v) {
  *v = 0;
  for (std::size_t i = 0; i < max_bytes && i < in->size(); ++i) {
    const auto byte = static_cast<unsigned char>((*in)[i]);
    *v |= static_cast<UUnits>(byte & 0x7f) << (7 * i);
    if ((byte & 0x80) == 0) {
      in->remove_prefix(i + 1);
      return true;
    }
  }
  return false;
}

constexpr std::size_t kMaxVarint64 = 10;
constexpr std::size_t kMaxVarint128 = 19;

}  // namespace

void put_sealed_entry(std::string* out, const LedgerEntry& entry) {
  out->push_back(entry.target == AggregateKind::Cohort ? '\0' : '\1');
  put_varint(out, entry.target_id);
  put_varint(out, entry.item);
  // Zigzag: small magnitudes of either sign take few bytes.
  const auto u = static_cast<UUnits>(entry.units);
  put_varint(out, (u << 1) ^ (entry.units < 0 ? ~UUnits{0} : UUnits{0}));
}

std::optional<std::vector<LedgerEntry>> decode_sealed_entries(std::string_view plaintext) {
  if (plaintext.empty()) return std::nullopt;
  std::vector<LedgerEntry> entries;
  while (!plaintext.empty()) {
    const char target = plaintext[0];
    if (target != 0 && target != 1) return std::nullopt;
    plaintext.remove_prefix(1);
    UUnits id, item, zigzag;
    if (!get_varint(&plaintext, kMaxVarint64, &id) || id > std::numeric_limits<std::uint64_t>::max() ||
        !get_varint(&plaintext, kMaxVarint64, &item) || item > std::numeric_limits<std::uint64_t>::max() ||
        !get_varint(&plaintext, kMaxVarint128, &zigzag)) {
      return std::nullopt;
    }
    const UUnits magnitude = zigzag >> 1;
    const Units units = static_cast<Units>((zigzag & 1) != 0 ? ~magnitude : magnitude);
    entries.push_back({target == 0 ? AggregateKind::Cohort : AggregateKind::Community, static_cast<std::uint64_t>(id),
                       static_cast<std::uint64_t>(item), units});
  }
  return entries;
}

std::uint16_t key_bucket(std::uint64_t user) { return static_cast<std::uint16_t>(mix64(user) >> 48); }

std::string encode_bucket_key(std::uint16_t bucket) {
  return {static_cast<char>(bucket >> 8), static_cast<char>(bucket & 0xff)};
}

std::string encode_key_store_key(std::uint64_t user_id) {
  std::string out = encode_bucket_key(key_bucket(user_id));
  put_u64_be(&out, user_id);
  return out;
}

std::optional<std::uint32_t> wrapped_key_generation(std::string_view value) {
  if (value.size() != kWrappedKeySize || static_cast<unsigned char>(value[0]) != kWrappedVersion) return std::nullopt;
  return get_u32_be(value.data() + 1);
}

Result<BucketKey> BucketKey::generate(std::uint32_t generation) {
  Result<UserKey> key = UserKey::generate();
  if (!key.ok()) return key.status();
  return BucketKey(generation, std::move(*key));
}

std::optional<BucketKey> BucketKey::decode(std::string_view stored) {
  if (stored.size() != kBucketValueSize || static_cast<unsigned char>(stored[0]) != kBucketVersion) return std::nullopt;
  UserKey key;
  std::memcpy(key.key_.data(), stored.data() + 5, kUserKeySize);
  return BucketKey(get_u32_be(stored.data() + 1), std::move(key));
}

std::string BucketKey::encode() const {
  std::string out(1, static_cast<char>(kBucketVersion));
  put_u32_be(&out, generation_);
  out.append(key_.bytes_for_testing());
  return out;
}

namespace {

// What a wrapped key is sealed under: its wrapped_keys key and the
// generation of the bucket key.
std::string wrap_aad(std::uint64_t user, std::uint32_t generation) {
  std::string aad = encode_key_store_key(user);
  put_u32_be(&aad, generation);
  return aad;
}

}  // namespace

Status BucketKey::wrap(std::uint64_t user, const UserKey& user_key, std::string* value) const {
  value->assign(1, static_cast<char>(kWrappedVersion));
  put_u32_be(value, generation_);
  return key_.seal(wrap_aad(user, generation_), user_key.bytes_for_testing(), value);
}

Status BucketKey::rewrap(const BucketKey& next, const std::vector<std::uint64_t>& users,
                         const std::vector<std::string>& values, std::vector<std::string>* out) const {
  out->assign(values.size(), std::string());
  const std::unique_ptr<EVP_CIPHER_CTX, CipherCtxDeleter> open(EVP_CIPHER_CTX_new()), seal(EVP_CIPHER_CTX_new());
  if (open == nullptr || seal == nullptr ||
      EVP_DecryptInit_ex(open.get(), aes_256_gcm(), nullptr, key_.key_.data(), nullptr) != 1 ||
      EVP_EncryptInit_ex(seal.get(), aes_256_gcm(), nullptr, next.key_.key_.data(), nullptr) != 1) {
    return Status::IOError("wrapping ledger keys again failed (OpenSSL AES-256-GCM: " + crypto_error() + ")");
  }
  // The same bytes as wrap() and unwrap(): [version][generation] and what
  // UserKey::seal makes of the key under the additional data.
  std::array<unsigned char, kUserKeySize> plain{};
  unsigned char tag[kSealTagSize];
  int n = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const std::string_view value = values[i];
    const std::string aad = wrap_aad(users[i], generation_);
    const auto* in = bytes(value) + 5 + kSealVersionSize;
    bool ok = wrapped_key_generation(value) == generation_ &&
              static_cast<unsigned char>(value[5]) == kRecordVersion;
    if (ok) {
      std::memcpy(tag, in + kSealNonceSize + kUserKeySize, kSealTagSize);
      ok = EVP_DecryptInit_ex(open.get(), nullptr, nullptr, nullptr, in) == 1 &&
           EVP_DecryptUpdate(open.get(), nullptr, &n, bytes(aad), static_cast<int>(aad.size())) == 1 &&
           EVP_DecryptUpdate(open.get(), nullptr, &n, &kRecordVersion, 1) == 1 &&
           EVP_DecryptUpdate(open.get(), plain.data(), &n, in + kSealNonceSize, static_cast<int>(kUserKeySize)) == 1 &&
           EVP_CIPHER_CTX_ctrl(open.get(), EVP_CTRL_GCM_SET_TAG, static_cast<int>(kSealTagSize), tag) == 1 &&
           EVP_DecryptFinal_ex(open.get(), plain.data() + n, &n) == 1;
    }
    if (!ok) {
      OPENSSL_cleanse(plain.data(), plain.size());
      return Status::Corruption("the ledger key of user " + std::to_string(users[i]) + " (key store key " +
                                hex(encode_key_store_key(users[i])) + ") does not unwrap with generation " +
                                std::to_string(generation_) + " of its bucket's key");
    }
    std::string& w = (*out)[i];
    w.assign(1, static_cast<char>(kWrappedVersion));
    put_u32_be(&w, next.generation_);
    w.push_back(static_cast<char>(kRecordVersion));
    w.resize(kWrappedKeySize);
    auto* o = reinterpret_cast<unsigned char*>(w.data()) + 5 + kSealVersionSize;
    const std::string next_aad = wrap_aad(users[i], next.generation_);
    ok = random_bytes(o, kSealNonceSize) && EVP_EncryptInit_ex(seal.get(), nullptr, nullptr, nullptr, o) == 1 &&
         EVP_EncryptUpdate(seal.get(), nullptr, &n, bytes(next_aad), static_cast<int>(next_aad.size())) == 1 &&
         EVP_EncryptUpdate(seal.get(), nullptr, &n, &kRecordVersion, 1) == 1 &&
         EVP_EncryptUpdate(seal.get(), o + kSealNonceSize, &n, plain.data(), static_cast<int>(kUserKeySize)) == 1 &&
         EVP_EncryptFinal_ex(seal.get(), o + kSealNonceSize + n, &n) == 1 &&
         EVP_CIPHER_CTX_ctrl(seal.get(), EVP_CTRL_GCM_GET_TAG, static_cast<int>(kSealTagSize),
                             o + kSealNonceSize + kUserKeySize) == 1;
    OPENSSL_cleanse(plain.data(), plain.size());
    if (!ok) return Status::IOError("wrapping a ledger key again failed (OpenSSL AES-256-GCM: " + crypto_error() + ")");
  }
  return Status::OK();
}

std::optional<UserKey> BucketKey::unwrap(std::uint64_t user, std::string_view value) const {
  if (wrapped_key_generation(value) != generation_) return std::nullopt;
  std::string plain;
  if (!key_.open(wrap_aad(user, generation_), value.substr(5), &plain) || plain.size() != kUserKeySize) {
    OPENSSL_cleanse(plain.data(), plain.size());
    return std::nullopt;
  }
  UserKey key;
  std::memcpy(key.key_.data(), plain.data(), kUserKeySize);
  OPENSSL_cleanse(plain.data(), plain.size());
  key.derive_pseudonym();
  return key;
}

namespace {

std::string user_key_text(std::uint64_t user) { return "the ledger key of user " + std::to_string(user); }

std::string bucket_text(std::uint16_t bucket) { return "the key of bucket " + std::to_string(bucket); }

// The bucket key a bucket_keys value holds; Corruption when it does not
// decode.
Result<BucketKey> decode_bucket_key(const Storage& storage, std::uint16_t bucket, std::string_view stored) {
  std::optional<BucketKey> k = BucketKey::decode(stored);
  if (!k) {
    return Status::Corruption(bucket_text(bucket) + " in '" + storage.path() + "' does not decode (" +
                              std::to_string(stored.size()) + "-byte value; expected " +
                              std::to_string(kBucketValueSize) + " of version 1)");
  }
  return std::move(*k);
}

// The key `wrapped` (user's wrapped_keys value) holds, unwrapped with
// `bucket`'s key (null: the bucket has none); Corruption when it does not
// unwrap.
Result<std::optional<UserKey>> unwrap_user_key(const Storage& storage, std::uint64_t user, std::string_view wrapped,
                                               const BucketKey* bucket) {
  std::optional<UserKey> k = bucket == nullptr ? std::nullopt : bucket->unwrap(user, wrapped);
  if (!k) {
    const std::optional<std::uint32_t> g = wrapped_key_generation(wrapped);
    return Status::Corruption(
        user_key_text(user) + " (key store key " + hex(encode_key_store_key(user)) + ") in '" + storage.path() +
        "' does not unwrap: " +
        (!g ? std::to_string(wrapped.size()) + "-byte value; expected " + std::to_string(kWrappedKeySize) +
                  " of version 2"
            : "wrapped with generation " + std::to_string(*g) + " of " + bucket_text(key_bucket(user)) + ", which " +
                  (bucket == nullptr ? std::string("is not stored")
                                     : "is at generation " + std::to_string(bucket->generation()) +
                                           (bucket->generation() == *g ? " (the value was changed)" : ""))));
  }
  return k;
}

// One MultiGet of `keys` in the key store's column family `cf` (of the
// users engine) as of `snapshot`: values[i] and statuses[i] are keys[i]'s.
struct KeyStoreReads {
  KeyStoreReads(const Storage& storage, rocksdb::ColumnFamilyHandle* cf, const std::vector<std::string>& keys,
                const rocksdb::Snapshot* snapshot, bool sorted)
      : values(keys.size()), statuses(keys.size()) {
    std::vector<rocksdb::Slice> slices(keys.begin(), keys.end());
    rocksdb::ReadOptions read;
    read.snapshot = snapshot;
    storage.db(Storage::Engine::Users)
        ->MultiGet(read, cf, slices.size(), slices.data(), values.data(), statuses.data(), sorted);
  }
  std::vector<rocksdb::PinnableSlice> values;
  std::vector<rocksdb::Status> statuses;
};

// The current keys of `buckets` (sorted, distinct) as of `snapshot`, in one
// MultiGet: (*keys)[i] empty when buckets[i] has none.
Status read_bucket_keys(const Storage& storage, const std::vector<std::uint16_t>& buckets,
                        const rocksdb::Snapshot* snapshot, std::vector<std::optional<BucketKey>>* keys) {
  keys->clear();
  keys->resize(buckets.size());
  std::vector<std::string> encoded;
  encoded.reserve(buckets.size());
  for (std::uint16_t b : buckets) encoded.push_back(encode_bucket_key(b));
  const KeyStoreReads reads(storage, storage.bucket_keys(), encoded, snapshot, /*sorted=*/true);
  const std::vector<rocksdb::PinnableSlice>& values = reads.values;
  const std::vector<rocksdb::Status>& statuses = reads.statuses;
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    if (statuses[i].IsNotFound()) continue;
    if (!statuses[i].ok()) return from_rocksdb(statuses[i], "read of " + bucket_text(buckets[i]));
    Result<BucketKey> k = decode_bucket_key(storage, buckets[i], values[i].ToStringView());
    if (!k.ok()) return k.status();
    (*keys)[i] = std::move(*k);
  }
  return Status::OK();
}

const BucketKey* find_bucket(const std::vector<std::uint16_t>& buckets, const std::vector<std::optional<BucketKey>>& keys,
                             std::uint16_t bucket) {
  const auto at = std::lower_bound(buckets.begin(), buckets.end(), bucket);
  if (at == buckets.end() || *at != bucket) return nullptr;
  const std::optional<BucketKey>& k = keys[static_cast<std::size_t>(at - buckets.begin())];
  return k ? &*k : nullptr;
}

// The snapshot given, or a snapshot of the users engine of its own.
class ReadPoint {
 public:
  ReadPoint(const Storage& storage, const rocksdb::Snapshot* given) : snapshot_(given) {
    if (given == nullptr) snapshot_ = own_.emplace(storage.db(Storage::Engine::Users)).snapshot();
  }
  const rocksdb::Snapshot* snapshot() const { return snapshot_; }

 private:
  std::optional<rocksdb::ManagedSnapshot> own_;
  const rocksdb::Snapshot* snapshot_;
};

}  // namespace

Result<std::optional<UserKey>> read_user_key(const Storage& storage, std::uint64_t user,
                                             const rocksdb::Snapshot* snapshot) {
  if (storage.keys() == nullptr || storage.bucket_keys() == nullptr) return std::optional<UserKey>();  // format 3
  // The wrapped key and its bucket's key as of one moment: a purge replaces
  // the bucket key and wraps the key again in one write.
  const ReadPoint point(storage, snapshot);
  std::string stored;
  Status s = storage.get(storage.keys(), encode_key_store_key(user), &stored, point.snapshot());
  if (s.code() == StatusCode::NotFound) return std::optional<UserKey>();
  if (!s.ok()) return Status(s.code(), "read of " + user_key_text(user) + ": " + s.message());
  const std::vector<std::uint16_t> bucket{key_bucket(user)};
  std::vector<std::optional<BucketKey>> bucket_key;
  if (Status b = read_bucket_keys(storage, bucket, point.snapshot(), &bucket_key); !b.ok()) return b;
  return unwrap_user_key(storage, user, stored, bucket_key[0] ? &*bucket_key[0] : nullptr);
}

Status read_user_keys(const Storage& storage, std::span<const std::uint64_t> users,
                      std::vector<std::optional<UserKey>>* keys) {
  keys->clear();
  keys->resize(users.size());
  if (storage.keys() == nullptr || storage.bucket_keys() == nullptr || users.empty()) return Status::OK();
  const ReadPoint point(storage, nullptr);
  std::vector<std::string> encoded;
  encoded.reserve(users.size());
  for (std::uint64_t u : users) encoded.push_back(encode_key_store_key(u));
  // Not in key order: a key begins with the user's bucket.
  const KeyStoreReads reads(storage, storage.keys(), encoded, point.snapshot(), /*sorted=*/false);
  const std::vector<rocksdb::PinnableSlice>& values = reads.values;
  const std::vector<rocksdb::Status>& statuses = reads.statuses;
  std::vector<std::uint16_t> buckets;
  for (std::size_t i = 0; i < users.size(); ++i) {
    if (statuses[i].IsNotFound()) continue;
    if (!statuses[i].ok()) return from_rocksdb(statuses[i], "read of " + user_key_text(users[i]));
    buckets.push_back(key_bucket(users[i]));
  }
  std::sort(buckets.begin(), buckets.end());
  buckets.erase(std::unique(buckets.begin(), buckets.end()), buckets.end());
  std::vector<std::optional<BucketKey>> bucket_keys;
  if (Status s = read_bucket_keys(storage, buckets, point.snapshot(), &bucket_keys); !s.ok()) return s;
  for (std::size_t i = 0; i < users.size(); ++i) {
    if (!statuses[i].ok()) continue;
    Result<std::optional<UserKey>> k = unwrap_user_key(storage, users[i], values[i].ToStringView(),
                                                       find_bucket(buckets, bucket_keys, key_bucket(users[i])));
    if (!k.ok()) return k.status();
    (*keys)[i] = std::move(*k);
  }
  return Status::OK();
}

Status store_user_keys(Storage& storage, const std::vector<std::pair<std::uint64_t, UserKey>>& created,
                       const std::string& what) {
  if (created.empty()) return Status::OK();
  std::lock_guard<std::mutex> lock(storage.key_writes_mu());
  std::vector<std::uint16_t> buckets;
  for (const auto& [user, key] : created) buckets.push_back(key_bucket(user));
  std::sort(buckets.begin(), buckets.end());
  buckets.erase(std::unique(buckets.begin(), buckets.end()), buckets.end());
  std::vector<std::optional<BucketKey>> bucket_keys;
  if (Status s = read_bucket_keys(storage, buckets, nullptr, &bucket_keys); !s.ok()) return s;
  rocksdb::WriteBatch batch;
  std::vector<std::uint64_t> made;  // buckets given their first key
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    if (bucket_keys[i]) continue;
    Result<BucketKey> k = BucketKey::generate(1);
    if (!k.ok()) return k.status();
    batch.Put(storage.bucket_keys(), encode_bucket_key(buckets[i]), k->encode());
    bucket_keys[i] = std::move(*k);
    made.push_back(buckets[i]);
  }
  std::string wrapped;
  for (const auto& [user, key] : created) {
    if (Status s = find_bucket(buckets, bucket_keys, key_bucket(user))->wrap(user, key, &wrapped); !s.ok()) return s;
    batch.Put(storage.keys(), encode_key_store_key(user), wrapped);
  }
  return storage.write_key_store(&batch, made, /*sync=*/true, what);
}

Status delete_user_keys(Storage& storage, const std::vector<std::uint64_t>& users,
                        const std::vector<std::uint64_t>& replaced, const std::string& what) {
  if (storage.keys() == nullptr || storage.bucket_keys() == nullptr || (users.empty() && replaced.empty())) {
    return Status::OK();
  }
  std::lock_guard<std::mutex> lock(storage.key_writes_mu());
  std::map<std::uint16_t, std::vector<std::uint64_t>> by_bucket;  // the users to delete, sorted in each
  for (std::uint64_t u : users) by_bucket[key_bucket(u)].push_back(u);
  std::vector<std::uint16_t> renew;  // buckets given a new key whatever they hold
  for (std::uint64_t u : replaced) {
    by_bucket[key_bucket(u)];
    renew.push_back(key_bucket(u));
  }
  std::sort(renew.begin(), renew.end());
  rocksdb::WriteBatch batch;
  std::vector<std::uint64_t> buckets;  // those given a new key
  std::vector<std::string> rewrapped;
  auto it = storage.iterator(storage.keys());
  for (auto& [bucket, deleted] : by_bucket) {
    std::sort(deleted.begin(), deleted.end());
    // The bucket's stored keys: those of `deleted` go, the others are
    // wrapped again.
    const std::string prefix = encode_bucket_key(bucket);
    std::vector<std::uint64_t> kept;  // the other users, and their wrapped keys
    std::vector<std::string> kept_values;
    bool found = false;
    for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
      const std::optional<std::uint64_t> user = decode_key_store_key(it->key().ToStringView());
      if (!user) {
        return Status::Corruption("key store key " + hex(it->key().ToStringView()) + " in '" + storage.path() +
                                  "' does not decode (expected 10 bytes: the bucket, then the user id)");
      }
      if (std::binary_search(deleted.begin(), deleted.end(), *user)) {
        batch.Delete(storage.keys(), it->key());
        found = true;
      } else {
        kept.push_back(*user);
        kept_values.push_back(it->value().ToString());
      }
    }
    if (Status s = from_rocksdb(it->status(), "read of the key store's " + bucket_text(bucket)); !s.ok()) return s;
    if (!found && !(std::binary_search(renew.begin(), renew.end(), bucket) && !kept.empty())) continue;
    std::vector<std::optional<BucketKey>> old;
    if (Status s = read_bucket_keys(storage, {bucket}, nullptr, &old); !s.ok()) return s;
    if (!old[0]) {
      return Status::Corruption("the key store of '" + storage.path() + "' holds wrapped keys of bucket " +
                                std::to_string(bucket) + " (user " + std::to_string(deleted.front()) +
                                "'s among them) but no key of that bucket");
    }
    Result<BucketKey> next = BucketKey::generate(old[0]->generation() + 1);
    if (!next.ok()) return next.status();
    if (Status s = old[0]->rewrap(*next, kept, kept_values, &rewrapped); !s.ok()) {
      return Status(s.code(), s.message() + " in '" + storage.path() + "'");
    }
    for (std::size_t i = 0; i < kept.size(); ++i) {
      batch.Put(storage.keys(), encode_key_store_key(kept[i]), rewrapped[i]);
    }
    batch.Put(storage.bucket_keys(), prefix, next->encode());
    buckets.push_back(bucket);
  }
  if (buckets.empty()) return Status::OK();
  return storage.write_key_store(&batch, buckets, /*sync=*/true, what);
}

std::optional<std::uint64_t> decode_key_store_key(std::string_view key) {
  if (key.size() != kKeyStoreKeySize) return std::nullopt;
  const std::uint64_t user = get_u64_be(key.data() + 2);
  if (key.substr(0, 2) != encode_bucket_key(key_bucket(user))) return std::nullopt;
  return user;
}

std::string pseudonym_end(std::string_view pseudonym) {
  std::string out(pseudonym);
  out.append(9, '\xff');  // above every 24-byte key with the prefix, below the next prefix
  return out;
}

std::optional<std::uint64_t> sealed_ledger_epoch(std::string_view key) {
  if (key.size() != kSealedLedgerKeySize) return std::nullopt;
  return get_u64_be(key.data());
}

std::optional<std::string_view> sealed_ledger_pseudonym(std::string_view key) {
  if (key.size() != kSealedLedgerKeySize) return std::nullopt;
  return key.substr(8);
}

std::optional<std::uint64_t> sealed_index_epoch(std::string_view index_key) {
  if (index_key.size() != kSealedIndexKeySize) return std::nullopt;
  return get_u64_be(index_key.data() + kPseudonymSize);
}

// The two keys hold the same 24 bytes, turned around the pseudonym.
std::optional<std::string> sealed_record_of(std::string_view index_key) {
  if (index_key.size() != kSealedIndexKeySize) return std::nullopt;
  std::string out(index_key.substr(kPseudonymSize));
  out.append(index_key.substr(0, kPseudonymSize));
  return out;
}

bool sealed_index_key_of(std::string_view record_key, std::string* out) {
  if (record_key.size() != kSealedLedgerKeySize) return false;
  out->assign(record_key.substr(8));
  out->append(record_key.substr(0, 8));
  return true;
}


}  // namespace tidal
