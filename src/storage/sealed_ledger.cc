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
#include "storage/secret.h"
#include "storage/storage.h"

namespace tidal {
namespace {

constexpr unsigned char kKeyVersionHmac = 1;  // UserKey::encode
constexpr unsigned char kKeyVersionHkdf = 2;
// A record sealed with a raw key: an Hmac key's records before HKDF, and
// the user's key inside a wrapped key (sealed with the bucket's raw key).
constexpr unsigned char kRecordVersion = 1;
constexpr unsigned char kRecordVersionHkdf = 2;  // sealed with the sealing subkey
constexpr unsigned char kBucketVersion = 1;
constexpr unsigned char kWrappedVersionHkdf = 4;  // an Hkdf key
constexpr unsigned char kWrappedVersion = 3;      // an Hmac key
constexpr unsigned char kWrappedVersionV2 = 2;  // an Hmac key, depth 16: read, no longer written
constexpr unsigned char kShapeVersion = 1;
// The HMAC derivations of an Hmac key.
constexpr char kPseudonymLabel[] = "tidal ledger pseudonym v1";
constexpr char kErasureTagLabel[] = "tidal erasure mark v1";
// The HKDF-SHA256 labels (info; no salt): one subkey each (hkdf_expand).
constexpr char kSealInfo[] = "tidal ledger seal v2";
constexpr char kPseudonymInfo[] = "tidal ledger pseudonym v2";
constexpr char kErasureTagInfo[] = "tidal erasure mark v2";

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
// The pool lies in pages of its own (secret_allocate: left out of core
// dumps, wiped when the thread ends): it holds the bytes of keys to come.
struct RandomPool {
  std::array<unsigned char, 4096> bytes{};
  std::size_t used = 4096;
};
struct RandomPoolPages {
  void operator()(RandomPool* pool) const {
    pool->~RandomPool();
    secret_free(pool, sizeof(RandomPool));
  }
};
RandomPool& random_pool() {
  thread_local std::unique_ptr<RandomPool, RandomPoolPages> pool = [] {
    void* p = secret_allocate(sizeof(RandomPool));
    if (p == nullptr) throw std::bad_alloc();
    return std::unique_ptr<RandomPool, RandomPoolPages>(new (p) RandomPool);
  }();
  return *pool;
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

// HKDF-SHA256 (RFC 5869) without salt, in its two steps, with the thread's
// HMAC context: PRK = HMAC(32 zero bytes, key), and each output of at most
// 32 bytes T(1) = HMAC(PRK, label || 0x01), truncated. libcrypto's EVP_KDF
// "HKDF" took ~5 us a derivation here (its parameters parsed and its
// contexts set up at each call), ten times the three HMACs a key needs.
// False (out zeroed) when libcrypto fails.
bool hkdf_extract(const std::array<unsigned char, kUserKeySize>& key, std::array<unsigned char, kUserKeySize>* prk) {
  const std::array<unsigned char, kUserKeySize> salt{};
  unsigned char mac[EVP_MAX_MD_SIZE];
  std::size_t size = 0;
  EVP_MAC_CTX* ctx = hmac_sha256_ctx();
  const bool ok = ctx != nullptr && EVP_MAC_init(ctx, salt.data(), salt.size(), nullptr) == 1 &&
                  EVP_MAC_update(ctx, key.data(), key.size()) == 1 && EVP_MAC_final(ctx, mac, &size, sizeof mac) == 1 &&
                  size == prk->size();
  if (ok) std::memcpy(prk->data(), mac, prk->size());
  else OPENSSL_cleanse(prk->data(), prk->size());
  OPENSSL_cleanse(mac, sizeof mac);
  return ok;
}
bool hkdf_expand(const std::array<unsigned char, kUserKeySize>& prk, std::string_view label, unsigned char* out,
                 std::size_t out_size) {
  const unsigned char counter = 1;
  unsigned char mac[EVP_MAX_MD_SIZE];
  std::size_t size = 0;
  EVP_MAC_CTX* ctx = hmac_sha256_ctx();
  const bool ok = ctx != nullptr && out_size <= kUserKeySize &&
                  EVP_MAC_init(ctx, prk.data(), prk.size(), nullptr) == 1 &&
                  EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(label.data()), label.size()) == 1 &&
                  EVP_MAC_update(ctx, &counter, 1) == 1 && EVP_MAC_final(ctx, mac, &size, sizeof mac) == 1 &&
                  size >= out_size;
  if (ok) std::memcpy(out, mac, out_size);
  else OPENSSL_cleanse(out, out_size);
  OPENSSL_cleanse(mac, sizeof mac);
  return ok;
}

std::atomic<bool> g_hmac_keys{false};

}  // namespace

std::atomic<bool>& hmac_keys_for_testing() { return g_hmac_keys; }

Result<UserKey> UserKey::generate() {
  UserKey key;
  if (!random_bytes(key.key_.data(), key.key_.size())) {
    return Status::IOError("the OS random number generator gave no key for a user's ledger (OpenSSL RAND_bytes: " +
                           crypto_error() + ")");
  }
  if (g_hmac_keys.load(std::memory_order_relaxed)) key.derivation_ = KeyDerivation::Hmac;
  if (!key.derive()) {
    return Status::IOError("deriving the subkeys of a user's ledger key failed (OpenSSL HKDF: " + crypto_error() + ")");
  }
  return key;
}

std::optional<UserKey> UserKey::decode(std::string_view stored) {
  if (stored.size() != kKeyStoreValueSize) return std::nullopt;
  const auto version = static_cast<unsigned char>(stored[0]);
  if (version != kKeyVersionHmac && version != kKeyVersionHkdf) return std::nullopt;
  UserKey key;
  key.derivation_ = version == kKeyVersionHmac ? KeyDerivation::Hmac : KeyDerivation::Hkdf;
  std::memcpy(key.key_.data(), stored.data() + 1, kUserKeySize);
  if (!key.derive()) return std::nullopt;
  return key;
}

SealingKey::~SealingKey() {
  OPENSSL_cleanse(seal_key_.data(), seal_key_.size());
  OPENSSL_cleanse(pseudonym_.data(), pseudonym_.size());
}

UserKey::~UserKey() { OPENSSL_cleanse(key_.data(), key_.size()); }

namespace {

// HMAC-SHA256(key, label), its first `out.size()` bytes. HMAC cannot fail
// with a valid digest and key; a failure leaves `out` zero.
template <std::size_t N>
void hmac_derive(const std::array<unsigned char, kUserKeySize>& key, std::string_view label,
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

bool UserKey::derive() {
  std::array<unsigned char, kUserKeySize> prk{};
  bool ok = hkdf_extract(key_, &prk);
  if (derivation_ == KeyDerivation::Hmac && g_hmac_keys.load(std::memory_order_relaxed)) {
    seal_key_ = key_;  // seal() then writes what a key before HKDF wrote
  } else {
    ok = ok && hkdf_expand(prk, kSealInfo, seal_key_.data(), seal_key_.size());
  }
  if (derivation_ == KeyDerivation::Hkdf) {
    ok = ok && hkdf_expand(prk, kPseudonymInfo, pseudonym_.data(), pseudonym_.size());
  } else {
    hmac_derive(key_, kPseudonymLabel, &pseudonym_);
  }
  OPENSSL_cleanse(prk.data(), prk.size());
  return ok;
}

std::string UserKey::erasure_tag() const {
  std::array<unsigned char, kErasureTagSize> tag{};
  if (derivation_ == KeyDerivation::Hkdf) {
    std::array<unsigned char, kUserKeySize> prk{};
    if (hkdf_extract(key_, &prk)) hkdf_expand(prk, kErasureTagInfo, tag.data(), tag.size());
    OPENSSL_cleanse(prk.data(), prk.size());
  } else {
    hmac_derive(key_, kErasureTagLabel, &tag);
  }
  return {reinterpret_cast<const char*>(tag.data()), tag.size()};
}

SecretBytes UserKey::encode() const {
  SecretBytes out;
  out.buffer()->assign(1, static_cast<char>(derivation_ == KeyDerivation::Hmac ? kKeyVersionHmac : kKeyVersionHkdf));
  out.buffer()->append(reinterpret_cast<const char*>(key_.data()), key_.size());
  return out;
}

std::array<char, kSealedLedgerKeySize> SealingKey::record_name(std::uint64_t epoch) const {
  std::array<char, kSealedLedgerKeySize> out;
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>(epoch >> (56 - 8 * i));
  std::memcpy(out.data() + 8, pseudonym_.data(), kPseudonymSize);
  return out;
}

std::string SealingKey::record_key(std::uint64_t epoch) const {
  const std::array<char, kSealedLedgerKeySize> name = record_name(epoch);
  return {name.data(), name.size()};
}

std::string SealingKey::index_key(std::uint64_t epoch) const {
  std::string out(pseudonym());
  put_u64_be(&out, epoch);
  return out;
}

namespace {

// AES-256-GCM under `key` of `plaintext`, as a record of version `version`
// (its byte first, in the AAD after `aad`), appended to *value.
Status seal_with(const unsigned char* key, unsigned char version, std::string_view aad, std::string_view plaintext,
                 std::string* value) {
  const std::size_t at = value->size();
  value->resize(at + kSealVersionSize + kSealNonceSize + plaintext.size() + kSealTagSize);
  (*value)[at] = static_cast<char>(version);
  auto* out = reinterpret_cast<unsigned char*>(value->data()) + at + kSealVersionSize;
  if (!random_bytes(out, kSealNonceSize)) {
    return Status::IOError("the OS random number generator gave no nonce to seal a ledger record (OpenSSL RAND_bytes: " +
                           crypto_error() + ")");
  }
  EVP_CIPHER_CTX* ctx = cipher_ctx();
  int n = 0;
  int total = 0;
  const bool ok =
      ctx != nullptr && EVP_EncryptInit_ex(ctx, aes_256_gcm(), nullptr, key, out) == 1 &&
      EVP_EncryptUpdate(ctx, nullptr, &n, bytes(aad), static_cast<int>(aad.size())) == 1 &&
      EVP_EncryptUpdate(ctx, nullptr, &n, &version, 1) == 1 &&
      EVP_EncryptUpdate(ctx, out + kSealNonceSize, &n, bytes(plaintext), static_cast<int>(plaintext.size())) == 1 &&
      (total = n, EVP_EncryptFinal_ex(ctx, out + kSealNonceSize + total, &n) == 1) &&
      EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, static_cast<int>(kSealTagSize),
                          out + kSealNonceSize + plaintext.size()) == 1;
  if (!ok) return Status::IOError("sealing a ledger record failed (OpenSSL AES-256-GCM: " + crypto_error() + ")");
  return Status::OK();
}

// Opens what seal_with(key, value's version byte, aad, ...) made; false
// (nothing in *plaintext) when it does not authenticate.
bool open_with(const unsigned char* key, std::string_view aad, std::string_view value, std::string* plaintext) {
  plaintext->clear();
  if (value.size() < kSealVersionSize + kSealNonceSize + kSealTagSize) return false;
  const auto version = static_cast<unsigned char>(value[0]);
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
  const bool ok = ctx != nullptr && EVP_DecryptInit_ex(ctx, aes_256_gcm(), nullptr, key, in) == 1 &&
         EVP_DecryptUpdate(ctx, nullptr, &n, bytes(aad), static_cast<int>(aad.size())) == 1 &&
         EVP_DecryptUpdate(ctx, nullptr, &n, &version, 1) == 1 &&
         EVP_DecryptUpdate(ctx, reinterpret_cast<unsigned char*>(plaintext->data()), &n, in + kSealNonceSize,
                           static_cast<int>(size)) == 1 &&
         EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, static_cast<int>(kSealTagSize), tag) == 1 &&
         EVP_DecryptFinal_ex(ctx, reinterpret_cast<unsigned char*>(plaintext->data()) + n, &n) == 1;
  if (!ok) {  // nothing of an unauthenticated record is handed out
    OPENSSL_cleanse(plaintext->data(), plaintext->size());
    plaintext->clear();
  }
  return ok;
}

}  // namespace

Status SealingKey::seal(std::string_view record_key, std::string_view plaintext, std::string* value) const {
  const unsigned char version = g_hmac_keys.load(std::memory_order_relaxed) ? kRecordVersion : kRecordVersionHkdf;
  return seal_with(seal_key_.data(), version, record_key, plaintext, value);
}

bool UserKey::open(std::string_view record_key, std::string_view value, std::string* plaintext) const {
  plaintext->clear();
  if (value.empty()) return false;
  const auto version = static_cast<unsigned char>(value[0]);
  if (version == kRecordVersionHkdf) return open_with(seal_key_.data(), record_key, value, plaintext);
  if (version == kRecordVersion && derivation_ == KeyDerivation::Hmac) {
    return open_with(key_.data(), record_key, value, plaintext);
  }
  return false;
}

Status seal_v1_for_testing(std::string_view key, std::string_view record_key, std::string_view plaintext,
                           std::string* value) {
  if (key.size() != kUserKeySize) return Status::InvalidArgument("not a 32-byte key");
  return seal_with(bytes(key), kRecordVersion, record_key, plaintext, value);
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

std::string encode_bucket_key(std::uint16_t group) {
  return {static_cast<char>(group >> 8), static_cast<char>(group & 0xff)};
}

std::optional<std::uint16_t> bucket_key_group(std::string_view key) {
  if (key.size() < 2) return std::nullopt;
  return static_cast<std::uint16_t>(static_cast<unsigned char>(key[0]) << 8 | static_cast<unsigned char>(key[1]));
}

KeyBucket KeyBucket::of(std::uint64_t user, unsigned depth) {
  return {depth, static_cast<std::uint32_t>((mix64(user) >> 32) >> (32 - depth))};
}

std::optional<KeyBucket> KeyBucket::decode(std::string_view key) {
  const std::optional<std::uint16_t> group = bucket_key_group(key);
  if (!group) return std::nullopt;
  if (key.size() == kBucketKeySize) return KeyBucket{kMinBucketDepth, *group};
  if (key.size() != kDeepBucketKeySize) return std::nullopt;
  const unsigned depth = static_cast<unsigned char>(key[2]);
  const std::uint32_t low = *bucket_key_group(key.substr(3));
  if (depth <= kMinBucketDepth || depth > kMaxBucketDepth || low >> (depth - kMinBucketDepth) != 0) {
    return std::nullopt;
  }
  return KeyBucket{depth, static_cast<std::uint32_t>(*group) << (depth - kMinBucketDepth) | low};
}

std::string KeyBucket::key() const {
  std::string out = encode_bucket_key(group());
  if (depth == kMinBucketDepth) return out;
  out.push_back(static_cast<char>(depth));
  out.append(encode_bucket_key(static_cast<std::uint16_t>(prefix & ((std::uint32_t{1} << (depth - kMinBucketDepth)) - 1))));
  return out;
}

std::string KeyBucket::text() const {
  std::string out = "bucket " + std::to_string(group());
  if (depth == kMinBucketDepth) return out;
  return out + "." + std::to_string(prefix & ((std::uint32_t{1} << (depth - kMinBucketDepth)) - 1)) + "/" +
         std::to_string(depth);
}

KeyBucket KeyShape::bucket_of(std::uint64_t user) const {
  const KeyBucket b = KeyBucket::of(user, depth);
  return b.prefix < split ? KeyBucket::of(user, depth + 1) : b;
}

std::string KeyShape::encode() const {
  std::string out(1, static_cast<char>(kShapeVersion));
  out.push_back(static_cast<char>(depth));
  put_u32_be(&out, split);
  put_u64_be(&out, keys);
  return out;
}

std::optional<KeyShape> KeyShape::decode(std::string_view stored) {
  if (stored.size() != 14 || static_cast<unsigned char>(stored[0]) != kShapeVersion) return std::nullopt;
  KeyShape shape{static_cast<unsigned char>(stored[1]), get_u32_be(stored.data() + 2), get_u64_be(stored.data() + 6)};
  // Depth 32 is split no further; a split bucket is one of depth's.
  if (shape.depth < kMinBucketDepth || shape.depth > kMaxBucketDepth ||
      (shape.depth == kMaxBucketDepth ? shape.split != 0 : shape.split >= (std::uint64_t{1} << shape.depth))) {
    return std::nullopt;
  }
  return shape;
}

std::string encode_key_store_key(std::uint64_t user_id) {
  std::string out = encode_bucket_key(key_bucket(user_id));
  put_u64_be(&out, user_id);
  return out;
}

std::optional<WrappedHeader> wrapped_key_header(std::string_view value) {
  if (value.empty()) return std::nullopt;
  const unsigned version = static_cast<unsigned char>(value[0]);
  if (version == kWrappedVersionV2 && value.size() == kWrappedKeySizeV2) {
    return WrappedHeader{version, kMinBucketDepth, get_u32_be(value.data() + 1), 5};
  }
  if ((version != kWrappedVersion && version != kWrappedVersionHkdf) || value.size() != kWrappedKeySize) {
    return std::nullopt;
  }
  const unsigned depth = static_cast<unsigned char>(value[1]);
  if (depth < kMinBucketDepth || depth > kMaxBucketDepth) return std::nullopt;
  return WrappedHeader{version, depth, get_u32_be(value.data() + 2), 6};
}

std::optional<std::uint32_t> wrapped_key_generation(std::string_view value) {
  const std::optional<WrappedHeader> h = wrapped_key_header(value);
  if (!h) return std::nullopt;
  return h->generation;
}

Result<BucketKey> BucketKey::generate(std::uint32_t generation) {
  BucketKey key(generation);
  if (!random_bytes(key.key_.data(), key.key_.size())) {
    return Status::IOError("the OS random number generator gave no key for a bucket of the key store (OpenSSL "
                           "RAND_bytes: " + crypto_error() + ")");
  }
  return key;
}

std::optional<BucketKey> BucketKey::decode(std::string_view stored) {
  if (stored.size() != kBucketValueSize || static_cast<unsigned char>(stored[0]) != kBucketVersion) return std::nullopt;
  BucketKey key(get_u32_be(stored.data() + 1));
  std::memcpy(key.key_.data(), stored.data() + 5, kUserKeySize);
  return key;
}

BucketKey::~BucketKey() { OPENSSL_cleanse(key_.data(), key_.size()); }

namespace {

constexpr unsigned char kBucketVersionWrapped = 2;
constexpr char kKeyEncryptionCheckLabel[] = "tidal key-encryption check v1";

// What a wrapped bucket key is sealed under: its bucket_keys key, the
// version and the generation (BE).
std::string bucket_aad(std::string_view bucket_key, std::uint32_t generation) {
  std::string aad(bucket_key);
  aad.push_back(static_cast<char>(kBucketVersionWrapped));
  put_u32_be(&aad, generation);
  return aad;
}

}  // namespace

Result<KeyEncryptionKey> KeyEncryptionKey::from(std::string_view bytes) {
  if (bytes.size() != kUserKeySize) {
    return Status::InvalidArgument("a key-encryption key is 32 bytes (AES-256); " + std::to_string(bytes.size()) +
                                   " given");
  }
  KeyEncryptionKey key;
  std::memcpy(key.key_.data(), bytes.data(), kUserKeySize);
  return key;
}

KeyEncryptionKey::~KeyEncryptionKey() { OPENSSL_cleanse(key_.data(), key_.size()); }

Result<std::string> KeyEncryptionKey::check_value() const {
  std::string value;
  const std::array<unsigned char, kUserKeySize> zero{};
  if (Status s = seal_with(key_.data(), kRecordVersion, kKeyEncryptionCheckLabel,
                           {reinterpret_cast<const char*>(zero.data()), zero.size()}, &value);
      !s.ok()) {
    return s;
  }
  return value;
}

bool KeyEncryptionKey::opens_check(std::string_view stored) const {
  std::string plain;
  return !stored.empty() && static_cast<unsigned char>(stored[0]) == kRecordVersion &&
         open_with(key_.data(), kKeyEncryptionCheckLabel, stored, &plain) && plain.size() == kUserKeySize;
}

Result<std::string> BucketKey::encode(const KeyEncryptionKey& kek, std::string_view bucket_key) const {
  std::string out(1, static_cast<char>(kBucketVersionWrapped));
  put_u32_be(&out, generation_);
  if (Status s = seal_with(kek.key_.data(), kRecordVersion, bucket_aad(bucket_key, generation_), bytes_for_testing(),
                           &out);
      !s.ok()) {
    return s;
  }
  return out;
}

std::optional<BucketKey> BucketKey::decode(std::string_view stored, const KeyEncryptionKey& kek,
                                           std::string_view bucket_key) {
  if (stored.size() != kWrappedBucketValueSize || static_cast<unsigned char>(stored[0]) != kBucketVersionWrapped ||
      static_cast<unsigned char>(stored[5]) != kRecordVersion) {
    return std::nullopt;
  }
  BucketKey key(get_u32_be(stored.data() + 1));
  SecretBytes plain;
  if (!open_with(kek.key_.data(), bucket_aad(bucket_key, key.generation_), stored.substr(5), plain.buffer()) ||
      plain.size() != kUserKeySize) {
    return std::nullopt;
  }
  std::memcpy(key.key_.data(), plain.view().data(), kUserKeySize);
  return key;
}

std::optional<BucketKey> decode_bucket_value(const Storage& storage, const KeyBucket& bucket, std::string_view stored) {
  const Storage::KeyEncryption kek = storage.key_encryption();
  if (kek.current == nullptr || kek.pending) return BucketKey::decode(stored);
  const std::string key = bucket.key();
  for (const auto& k : {kek.current, kek.previous}) {
    if (k == nullptr) continue;
    if (std::optional<BucketKey> b = BucketKey::decode(stored, *k, key)) return b;
  }
  return std::nullopt;
}

SecretBytes BucketKey::encode() const {
  SecretBytes out;
  out.buffer()->assign(1, static_cast<char>(kBucketVersion));
  put_u32_be(out.buffer(), generation_);
  out.buffer()->append(bytes_for_testing());
  return out;
}

namespace {

// What a wrapped key is sealed under: its wrapped_keys key, the version
// (4 only), the depth of its bucket (versions 3 and 4) and the generation
// of the bucket key.
std::string wrap_aad(std::uint64_t user, const WrappedHeader& h) {
  std::string aad = encode_key_store_key(user);
  if (h.version == kWrappedVersionHkdf) aad.push_back(static_cast<char>(h.version));
  if (h.version != kWrappedVersionV2) aad.push_back(static_cast<char>(h.depth));
  put_u32_be(&aad, h.generation);
  return aad;
}

unsigned wrapped_version(KeyDerivation d) { return d == KeyDerivation::Hkdf ? kWrappedVersionHkdf : kWrappedVersion; }
KeyDerivation derivation_of(const WrappedHeader& h) {
  return h.version == kWrappedVersionHkdf ? KeyDerivation::Hkdf : KeyDerivation::Hmac;
}

// The header of a value wrapped now, and its bytes.
WrappedHeader new_header(KeyDerivation d, unsigned depth, std::uint32_t generation) {
  return {wrapped_version(d), depth, generation, 6};
}
void put_header(std::string* value, const WrappedHeader& h) {
  value->assign(1, static_cast<char>(h.version));
  value->push_back(static_cast<char>(h.depth));
  put_u32_be(value, h.generation);
}

}  // namespace

Status BucketKey::wrap(std::uint64_t user, unsigned depth, const UserKey& user_key, std::string* value) const {
  const WrappedHeader h = new_header(user_key.derivation(), depth, generation_);
  put_header(value, h);
  return seal_with(key_.data(), kRecordVersion, wrap_aad(user, h), user_key.bytes_for_testing(), value);
}

Status BucketKey::rewrap(const BucketKey& next, unsigned depth, const std::vector<std::uint64_t>& users,
                         const std::vector<std::string>& values, std::vector<std::string>* out) const {
  out->assign(values.size(), std::string());
  const std::unique_ptr<EVP_CIPHER_CTX, CipherCtxDeleter> open(EVP_CIPHER_CTX_new()), seal(EVP_CIPHER_CTX_new());
  if (open == nullptr || seal == nullptr ||
      EVP_DecryptInit_ex(open.get(), aes_256_gcm(), nullptr, key_.data(), nullptr) != 1 ||
      EVP_EncryptInit_ex(seal.get(), aes_256_gcm(), nullptr, next.key_.data(), nullptr) != 1) {
    return Status::IOError("wrapping ledger keys again failed (OpenSSL AES-256-GCM: " + crypto_error() + ")");
  }
  // The same bytes as wrap() and unwrap(): the header and what
  // UserKey::seal makes of the key under the additional data.
  std::array<unsigned char, kUserKeySize> plain{};
  unsigned char tag[kSealTagSize];
  int n = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const std::string_view value = values[i];
    const std::optional<WrappedHeader> h = wrapped_key_header(value);
    bool ok = h && h->generation == generation_ && static_cast<unsigned char>(value[h->size]) == kRecordVersion;
    if (ok) {
      const std::string aad = wrap_aad(users[i], *h);
      const auto* in = bytes(value) + h->size + kSealVersionSize;
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
    const WrappedHeader next_header = new_header(derivation_of(*h), depth, next.generation_);
    put_header(&w, next_header);
    w.push_back(static_cast<char>(kRecordVersion));
    w.resize(kWrappedKeySize);
    auto* o = reinterpret_cast<unsigned char*>(w.data()) + next_header.size + kSealVersionSize;
    const std::string next_aad = wrap_aad(users[i], next_header);
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
  const std::optional<WrappedHeader> h = wrapped_key_header(value);
  if (!h || h->generation != generation_) return std::nullopt;
  SecretBytes plain;
  const std::string_view sealed = value.substr(h->size);
  if (sealed.empty() || static_cast<unsigned char>(sealed[0]) != kRecordVersion ||
      !open_with(key_.data(), wrap_aad(user, *h), sealed, plain.buffer()) || plain.size() != kUserKeySize) {
    return std::nullopt;
  }
  UserKey key;
  key.derivation_ = derivation_of(*h);
  std::memcpy(key.key_.data(), plain.view().data(), kUserKeySize);
  if (!key.derive()) return std::nullopt;
  return key;
}

namespace {

std::string user_key_text(std::uint64_t user) { return "the ledger key of user " + std::to_string(user); }

std::string bucket_text(const KeyBucket& bucket) { return "the key of " + bucket.text(); }

// The bucket key a bucket_keys value holds; Corruption when it does not
// decode.
Result<BucketKey> decode_bucket_key(const Storage& storage, const KeyBucket& bucket, std::string_view stored) {
  std::optional<BucketKey> k = decode_bucket_value(storage, bucket, stored);
  if (!k) {
    const bool wrapped = storage.key_encryption().current != nullptr;
    return Status::Corruption(bucket_text(bucket) + " in '" + storage.path() + "' does not decode (" +
                              std::to_string(stored.size()) + "-byte value; expected " +
                              (wrapped ? std::to_string(kWrappedBucketValueSize) +
                                             " of version 2 that the key-encryption key opens"
                                       : std::to_string(kBucketValueSize) + " of version 1") +
                              ")");
  }
  return std::move(*k);
}

// The bucket_keys value of `key` for `bucket`, as the Db stores it: wrapped
// with its key-encryption key when it has one.
Result<SecretBytes> bucket_value(const Storage& storage, const KeyBucket& bucket, const BucketKey& key) {
  const Storage::KeyEncryption kek = storage.key_encryption();
  if (kek.current == nullptr || kek.pending) return key.encode();
  Result<std::string> wrapped = key.encode(*kek.current, bucket.key());
  if (!wrapped.ok()) return wrapped.status();
  SecretBytes out;
  out.buffer()->assign(*wrapped);
  return out;
}

// The bucket whose key wrapped `wrapped` (a wrapped_keys value of `user`);
// empty when the value does not decode.
std::optional<KeyBucket> wrapping_bucket(std::uint64_t user, std::string_view wrapped) {
  const std::optional<WrappedHeader> h = wrapped_key_header(wrapped);
  if (!h) return std::nullopt;
  return KeyBucket::of(user, h->depth);
}

// The key `wrapped` (user's wrapped_keys value) holds, unwrapped with its
// bucket's key (`bucket`; null: the bucket has none, or the value does not
// decode); Corruption when it does not unwrap.
Result<std::optional<UserKey>> unwrap_user_key(const Storage& storage, std::uint64_t user, std::string_view wrapped,
                                               const BucketKey* bucket) {
  std::optional<UserKey> k = bucket == nullptr ? std::nullopt : bucket->unwrap(user, wrapped);
  if (!k) {
    const std::optional<WrappedHeader> h = wrapped_key_header(wrapped);
    return Status::Corruption(
        user_key_text(user) + " (key store key " + hex(encode_key_store_key(user)) + ") in '" + storage.path() +
        "' does not unwrap: " +
        (!h ? std::to_string(wrapped.size()) + "-byte value; expected " + std::to_string(kWrappedKeySize) +
                  " of version 3 or 4 (or " + std::to_string(kWrappedKeySizeV2) + " of version 2)"
            : "wrapped with generation " + std::to_string(h->generation) + " of " +
                  bucket_text(KeyBucket::of(user, h->depth)) + ", which " +
                  (bucket == nullptr ? std::string("is not stored")
                                     : "is at generation " + std::to_string(bucket->generation()) +
                                           (bucket->generation() == h->generation ? " (the value was changed)" : ""))));
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
  // A value not pinned in RocksDB's memory was copied into the slice's own
  // buffer: a bucket key in clear, or a wrapped key.
  ~KeyStoreReads() {
    for (rocksdb::PinnableSlice& v : values) {
      if (!v.IsPinned()) wipe(v.GetSelf());
      v.Reset();
    }
  }
  KeyStoreReads(const KeyStoreReads&) = delete;
  KeyStoreReads& operator=(const KeyStoreReads&) = delete;
  std::vector<rocksdb::PinnableSlice> values;
  std::vector<rocksdb::Status> statuses;
};

void sort_unique(std::vector<KeyBucket>* buckets) {
  std::sort(buckets->begin(), buckets->end());
  buckets->erase(std::unique(buckets->begin(), buckets->end()), buckets->end());
}

// The current keys of `buckets` (sorted, distinct) as of `snapshot` (null:
// the latest), in one MultiGet: (*keys)[i] empty when buckets[i] has none.
Status read_bucket_keys(const Storage& storage, const std::vector<KeyBucket>& buckets,
                        const rocksdb::Snapshot* snapshot, std::vector<std::optional<BucketKey>>* keys) {
  keys->clear();
  keys->resize(buckets.size());
  std::vector<std::string> encoded;
  encoded.reserve(buckets.size());
  for (const KeyBucket& b : buckets) encoded.push_back(b.key());
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

const BucketKey* find_bucket(const std::vector<KeyBucket>& buckets, const std::vector<std::optional<BucketKey>>& keys,
                             const KeyBucket& bucket) {
  const auto at = std::lower_bound(buckets.begin(), buckets.end(), bucket);
  if (at == buckets.end() || !(*at == bucket)) return nullptr;
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

// The key store's shape: Storage::key_shape_cache, read from the users
// engine's meta family the first time. A key store written before buckets
// split has none stored: its buckets are the 65,536 of depth 16, and its
// keys are counted once (a scan of the wrapped keys). Under key_writes_mu.
Status load_shape(Storage& storage, KeyShape* shape) {
  std::optional<std::string>& cached = storage.key_shape_cache();
  if (!cached) {
    std::string stored;
    Status s = storage.get(storage.meta(), kKeyShapeKey, &stored);
    if (s.code() == StatusCode::NotFound) {
      KeyShape first;
      auto it = storage.iterator(storage.keys(), /*bulk=*/true);
      for (it->SeekToFirst(); it->Valid(); it->Next()) ++first.keys;
      if (Status c = from_rocksdb(it->status(), "count of the key store's keys in '" + storage.path() + "'");
          !c.ok()) {
        return c;
      }
      stored = first.encode();
    } else if (!s.ok()) {
      return Status(s.code(), "read of the key store's shape: " + s.message());
    }
    if (!KeyShape::decode(stored)) {
      return Status::Corruption("the key store's shape (meta key '" + std::string(kKeyShapeKey) + "') in '" +
                                storage.path() + "' does not decode (" + std::to_string(stored.size()) +
                                "-byte value " + hex(stored) + "; expected 14 bytes of version 1)");
    }
    cached = std::move(stored);
  }
  *shape = *KeyShape::decode(*cached);
  return Status::OK();
}

// Writes `batch` and `shape` into the key store, synced, noting `groups`
// (Storage::write_key_store), and keeps `shape` as the key store's once
// written; a failed write (which may still be durable) makes the next one
// read the shape again.
Status write_key_batch(Storage& storage, rocksdb::WriteBatch* batch, const KeyShape& shape,
                       std::vector<std::uint64_t> groups, const std::string& what) {
  std::string encoded = shape.encode();
  if (rocksdb::Status p = batch->Put(storage.meta(), kKeyShapeKey, encoded); !p.ok()) return from_rocksdb(p, what);
  std::sort(groups.begin(), groups.end());
  groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
  Status s = storage.write_key_store(batch, groups, /*sync=*/true, what);
  // The batch held the bucket keys it wrote: its buffer is wiped (the
  // const view RocksDB gives of it is of the batch's own string).
  wipe(&const_cast<std::string&>(batch->Data()));
  batch->Clear();
  if (s.ok()) storage.key_shape_cache() = std::move(encoded);
  else storage.key_shape_cache().reset();
  return s;
}

// The users of `group` whose keys the key store holds (in user order), and
// their wrapped keys, as `it` sees them.
struct GroupKeys {
  std::vector<std::uint64_t> users;
  std::vector<std::string> values;
};
Status read_group(const Storage& storage, rocksdb::Iterator* it, std::uint16_t group, GroupKeys* out) {
  out->users.clear();
  out->values.clear();
  const std::string prefix = encode_bucket_key(group);
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    const std::optional<std::uint64_t> user = decode_key_store_key(it->key().ToStringView());
    if (!user) {
      return Status::Corruption("key store key " + hex(it->key().ToStringView()) + " in '" + storage.path() +
                                "' does not decode (expected 10 bytes: the group, then the user id)");
    }
    out->users.push_back(*user);
    out->values.push_back(it->value().ToString());
  }
  return from_rocksdb(it->status(), "read of the key store's group " + std::to_string(group));
}

// The most buckets one write of new keys splits: fewer than a depth's
// 65,536, so that no split reads a bucket that an earlier split of the same
// write made (and wrote only into the batch).
constexpr int kMaxSplitsPerWrite = 1024;

// Splits the bucket `shape` splits next into its two halves of the next
// depth, into `batch`: each half that holds users gets a new key (the next
// generation), their keys are wrapped again with it, and the bucket's key
// is deleted; the erasure of a later purge in the group drops it from the
// files (Storage::KeysErased). `made` gets the halves' keys, `groups` the
// bucket's group, and `shape` moves on. On an error (a key of the bucket
// that does not unwrap, a failed read) none of them changes.
Status split_bucket(Storage& storage, rocksdb::Iterator* it, KeyShape* shape, rocksdb::WriteBatch* batch,
                    std::map<KeyBucket, BucketKey>* made, std::vector<std::uint64_t>* groups) {
  const KeyBucket bucket{shape->depth, shape->split};
  const auto advance = [&] {
    if (++shape->split == (std::uint64_t{1} << shape->depth)) {
      ++shape->depth;
      shape->split = 0;
    }
  };
  std::vector<std::optional<BucketKey>> old;
  if (Status s = read_bucket_keys(storage, {bucket}, nullptr, &old); !s.ok()) return s;
  if (!old[0]) {  // never given a key: no user of it has one
    advance();
    return Status::OK();
  }
  GroupKeys group;
  if (Status s = read_group(storage, it, bucket.group(), &group); !s.ok()) return s;
  std::vector<std::uint64_t> users;
  std::vector<std::string> values, rewrapped;
  std::vector<std::pair<std::string, std::string>> puts;  // the users' keys wrapped again
  std::vector<std::pair<KeyBucket, BucketKey>> halves;
  for (std::uint32_t half = 0; half < 2; ++half) {
    const KeyBucket child{bucket.depth + 1, bucket.prefix << 1 | half};
    users.clear();
    values.clear();
    for (std::size_t i = 0; i < group.users.size(); ++i) {
      if (!(KeyBucket::of(group.users[i], child.depth) == child)) continue;
      users.push_back(group.users[i]);
      values.push_back(std::move(group.values[i]));
    }
    if (users.empty()) continue;
    Result<BucketKey> next = BucketKey::generate(old[0]->generation() + 1);
    if (!next.ok()) return next.status();
    if (Status s = old[0]->rewrap(*next, child.depth, users, values, &rewrapped); !s.ok()) {
      return Status(s.code(), s.message() + " in '" + storage.path() + "' (splitting " + bucket.text() + ")");
    }
    for (std::size_t i = 0; i < users.size(); ++i) puts.emplace_back(encode_key_store_key(users[i]), std::move(rewrapped[i]));
    halves.emplace_back(child, std::move(*next));
  }
  for (const auto& [key, value] : puts) batch->Put(storage.keys(), key, value);
  for (auto& [child, key] : halves) {
    Result<SecretBytes> value = bucket_value(storage, child, key);
    if (!value.ok()) return value.status();
    batch->Put(storage.bucket_keys(), child.key(), value->view());
    made->emplace(child, std::move(key));
  }
  batch->Delete(storage.bucket_keys(), bucket.key());
  groups->push_back(bucket.group());
  advance();
  return Status::OK();
}

}  // namespace

Result<std::optional<UserKey>> read_user_key(const Storage& storage, std::uint64_t user,
                                             const rocksdb::Snapshot* snapshot) {
  if (storage.keys() == nullptr || storage.bucket_keys() == nullptr) return std::optional<UserKey>();  // format 3
  // The wrapped key and its bucket's key as of one moment: a purge replaces
  // the bucket key and wraps the key again in one write, and so does a
  // split.
  const ReadPoint point(storage, snapshot);
  std::string stored;
  Status s = storage.get(storage.keys(), encode_key_store_key(user), &stored, point.snapshot());
  if (s.code() == StatusCode::NotFound) return std::optional<UserKey>();
  if (!s.ok()) return Status(s.code(), "read of " + user_key_text(user) + ": " + s.message());
  const std::optional<KeyBucket> bucket = wrapping_bucket(user, stored);
  if (!bucket) return unwrap_user_key(storage, user, stored, nullptr);
  std::vector<std::optional<BucketKey>> bucket_key;
  if (Status b = read_bucket_keys(storage, {*bucket}, point.snapshot(), &bucket_key); !b.ok()) return b;
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
  // Not in key order: a key begins with the user's group.
  const KeyStoreReads reads(storage, storage.keys(), encoded, point.snapshot(), /*sorted=*/false);
  const std::vector<rocksdb::PinnableSlice>& values = reads.values;
  const std::vector<rocksdb::Status>& statuses = reads.statuses;
  std::vector<KeyBucket> buckets;
  for (std::size_t i = 0; i < users.size(); ++i) {
    if (statuses[i].IsNotFound()) continue;
    if (!statuses[i].ok()) return from_rocksdb(statuses[i], "read of " + user_key_text(users[i]));
    if (std::optional<KeyBucket> b = wrapping_bucket(users[i], values[i].ToStringView())) buckets.push_back(*b);
  }
  sort_unique(&buckets);
  std::vector<std::optional<BucketKey>> bucket_keys;
  if (Status s = read_bucket_keys(storage, buckets, point.snapshot(), &bucket_keys); !s.ok()) return s;
  for (std::size_t i = 0; i < users.size(); ++i) {
    if (!statuses[i].ok()) continue;
    const std::string_view value = values[i].ToStringView();
    const std::optional<KeyBucket> b = wrapping_bucket(users[i], value);
    Result<std::optional<UserKey>> k =
        unwrap_user_key(storage, users[i], value, b ? find_bucket(buckets, bucket_keys, *b) : nullptr);
    if (!k.ok()) return k.status();
    (*keys)[i] = std::move(*k);
  }
  return Status::OK();
}

std::atomic<std::uint64_t>& split_to_buckets_for_testing() {
  static std::atomic<std::uint64_t> buckets{0};
  return buckets;
}

Status store_user_keys(Storage& storage, const std::vector<std::pair<std::uint64_t, UserKey>>& created,
                       const std::string& what) {
  if (created.empty()) return Status::OK();
  std::lock_guard<std::mutex> lock(storage.key_writes_mu());
  KeyShape shape;
  if (Status s = load_shape(storage, &shape); !s.ok()) return s;
  rocksdb::WriteBatch batch;
  std::vector<std::uint64_t> groups;    // whose bucket keys the write writes or deletes
  std::map<KeyBucket, BucketKey> made;  // the keys the write's splits make
  // The splits first, while the keys pass kUsersPerBucket a bucket: the
  // new keys are then wrapped in the buckets of the new shape.
  shape.keys += created.size();
  std::unique_ptr<rocksdb::Iterator> it;
  for (int n = 0; n < kMaxSplitsPerWrite && shape.depth < kMaxBucketDepth &&
                  (shape.keys > kUsersPerBucket * shape.buckets() ||
                   shape.buckets() < split_to_buckets_for_testing().load(std::memory_order_relaxed));
       ++n) {
    if (it == nullptr) it = storage.iterator(storage.keys());
    // A bucket that does not split (a key of it that does not unwrap, which
    // verify() reports; a failed read) stops the splits, not the new keys:
    // they are stored in the shape as it is, and the next write tries again.
    if (!split_bucket(storage, it.get(), &shape, &batch, &made, &groups).ok()) break;
  }
  std::vector<KeyBucket> buckets;
  for (const auto& [user, key] : created) {
    const KeyBucket b = shape.bucket_of(user);
    if (made.find(b) == made.end()) buckets.push_back(b);
  }
  sort_unique(&buckets);
  std::vector<std::optional<BucketKey>> bucket_keys;
  if (Status s = read_bucket_keys(storage, buckets, nullptr, &bucket_keys); !s.ok()) return s;
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    if (bucket_keys[i]) continue;
    Result<BucketKey> k = BucketKey::generate(1);
    if (!k.ok()) return k.status();
    Result<SecretBytes> value = bucket_value(storage, buckets[i], *k);
    if (!value.ok()) return value.status();
    batch.Put(storage.bucket_keys(), buckets[i].key(), value->view());
    bucket_keys[i] = std::move(*k);
    groups.push_back(buckets[i].group());
  }
  std::string wrapped;
  for (const auto& [user, key] : created) {
    const KeyBucket b = shape.bucket_of(user);
    const auto m = made.find(b);
    const BucketKey* k = m != made.end() ? &m->second : find_bucket(buckets, bucket_keys, b);
    if (Status s = k->wrap(user, b.depth, key, &wrapped); !s.ok()) return s;
    batch.Put(storage.keys(), encode_key_store_key(user), wrapped);
  }
  return write_key_batch(storage, &batch, shape, std::move(groups), what);
}

Status delete_user_keys(Storage& storage, const std::vector<std::uint64_t>& users,
                        const std::vector<std::uint64_t>& replaced, const std::string& what) {
  if (storage.keys() == nullptr || storage.bucket_keys() == nullptr || (users.empty() && replaced.empty())) {
    return Status::OK();
  }
  std::lock_guard<std::mutex> lock(storage.key_writes_mu());
  KeyShape shape;
  if (Status s = load_shape(storage, &shape); !s.ok()) return s;
  // By group: the users to delete, and those whose buckets get a new key
  // whatever they hold (each sorted).
  std::map<std::uint16_t, std::pair<std::vector<std::uint64_t>, std::vector<std::uint64_t>>> by_group;
  for (std::uint64_t u : users) by_group[key_bucket(u)].first.push_back(u);
  for (std::uint64_t u : replaced) by_group[key_bucket(u)].second.push_back(u);
  rocksdb::WriteBatch batch;
  std::vector<std::uint64_t> groups;  // those with a bucket given a new key
  std::uint64_t deleted_keys = 0;
  std::vector<std::uint64_t> kept;  // a bucket's other users, and their wrapped keys
  std::vector<std::string> kept_values, rewrapped;
  GroupKeys group;
  auto it = storage.iterator(storage.keys());
  for (auto& [g, todo] : by_group) {
    auto& [deleted, renewed] = todo;
    std::sort(deleted.begin(), deleted.end());
    if (Status s = read_group(storage, it.get(), g, &group); !s.ok()) return s;
    // The group's stored keys by the bucket that wrapped each.
    std::map<KeyBucket, std::vector<std::size_t>> by_bucket;
    for (std::size_t i = 0; i < group.users.size(); ++i) {
      const std::optional<KeyBucket> b = wrapping_bucket(group.users[i], group.values[i]);
      if (!b) return unwrap_user_key(storage, group.users[i], group.values[i], nullptr).status();
      by_bucket[*b].push_back(i);
    }
    // The buckets to renew: each renewed user's, by its stored key (the
    // shape's bucket when it has none).
    std::vector<KeyBucket> renew;
    for (std::uint64_t u : renewed) {
      const auto at = std::lower_bound(group.users.begin(), group.users.end(), u);
      const bool stored = at != group.users.end() && *at == u;
      std::optional<KeyBucket> b =
          stored ? wrapping_bucket(u, group.values[static_cast<std::size_t>(at - group.users.begin())]) : std::nullopt;
      renew.push_back(b ? *b : shape.bucket_of(u));
    }
    sort_unique(&renew);
    for (const auto& [bucket, members] : by_bucket) {
      kept.clear();
      kept_values.clear();
      bool found = false;
      for (std::size_t i : members) {
        if (std::binary_search(deleted.begin(), deleted.end(), group.users[i])) {
          batch.Delete(storage.keys(), encode_key_store_key(group.users[i]));
          found = true;
          ++deleted_keys;
        } else {
          kept.push_back(group.users[i]);
          kept_values.push_back(std::move(group.values[i]));
        }
      }
      if (!found && !(std::binary_search(renew.begin(), renew.end(), bucket) && !kept.empty())) continue;
      std::vector<std::optional<BucketKey>> old;
      if (Status s = read_bucket_keys(storage, {bucket}, nullptr, &old); !s.ok()) return s;
      if (!old[0]) {
        return Status::Corruption("the key store of '" + storage.path() + "' holds wrapped keys of " + bucket.text() +
                                  " (user " + std::to_string(group.users[members.front()]) +
                                  "'s among them) but no key of that bucket");
      }
      Result<BucketKey> next = BucketKey::generate(old[0]->generation() + 1);
      if (!next.ok()) return next.status();
      if (Status s = old[0]->rewrap(*next, bucket.depth, kept, kept_values, &rewrapped); !s.ok()) {
        return Status(s.code(), s.message() + " in '" + storage.path() + "'");
      }
      for (std::size_t i = 0; i < kept.size(); ++i) {
        batch.Put(storage.keys(), encode_key_store_key(kept[i]), rewrapped[i]);
      }
      Result<SecretBytes> value = bucket_value(storage, bucket, *next);
      if (!value.ok()) return value.status();
      batch.Put(storage.bucket_keys(), bucket.key(), value->view());
      groups.push_back(g);
    }
  }
  if (groups.empty()) return Status::OK();
  shape.keys -= std::min(shape.keys, deleted_keys);
  return write_key_batch(storage, &batch, shape, std::move(groups), what);
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


namespace {

// Every bucket key wrapped with `next`, and its check value, in one synced
// write of the key store (under key_writes_mu); the Db's keys become
// `next` (and `previous`, for reads at older snapshots) before the write,
// so that a reader decodes either value. Then the users engine is flushed
// past its WALs and the bucket_keys family compacted, so that no WAL or
// SST of the Db holds a value `next` did not wrap (a bucket key in clear,
// or wrapped with a replaced key-encryption key).
Status wrap_bucket_keys(Storage& storage, const KeyEncryptionKey& next, const std::string& what) {
  std::unique_lock<std::mutex> lock(storage.key_writes_mu());
  const Storage::KeyEncryption before = storage.key_encryption();
  rocksdb::WriteBatch batch;
  auto it = storage.iterator(storage.bucket_keys(), /*bulk=*/true);
  std::uint64_t n = 0;
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const std::string_view key = it->key().ToStringView();
    const std::optional<KeyBucket> bucket = KeyBucket::decode(key);
    if (!bucket) {
      return Status::Corruption(what + ": bucket_keys key " + hex(key) + " in '" + storage.path() +
                                "' is no bucket's (expected 2 or 5 bytes)");
    }
    Result<BucketKey> k = decode_bucket_key(storage, *bucket, it->value().ToStringView());
    if (!k.ok()) return Status(k.status().code(), what + ": " + k.status().message());
    Result<std::string> wrapped = k->encode(next, key);
    if (!wrapped.ok()) return wrapped.status();
    batch.Put(storage.bucket_keys(), key, *wrapped);
    ++n;
  }
  if (Status s = from_rocksdb(it->status(), what + ": read of the bucket keys"); !s.ok()) return s;
  it.reset();
  Result<std::string> check = next.check_value();
  if (!check.ok()) return check.status();
  batch.Put(storage.meta(), kKeyEncryptionCheckKey, *check);
  storage.set_key_encryption({std::make_shared<const KeyEncryptionKey>(next),
                              before.pending ? nullptr : before.current, false});
  Status s = storage.write_key_store(&batch, {}, /*sync=*/true, what);
  wipe(&const_cast<std::string&>(batch.Data()));
  batch.Clear();
  if (!s.ok()) {
    storage.set_key_encryption(before);
    return s;
  }
  lock.unlock();
  if (Status f = storage.flush_past_wals(Storage::Engine::Users); !f.ok()) {
    return Status(f.code(), what + " (" + std::to_string(n) + " bucket keys wrapped and stored): " + f.message());
  }
  rocksdb::CompactRangeOptions compact;
  compact.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForce;
  rocksdb::ColumnFamilyHandle* cf = storage.bucket_keys();
  return from_rocksdb(storage.db(Storage::Engine::Users)->CompactRange(compact, cf, nullptr, nullptr),
                      what + " (" + std::to_string(n) + " bucket keys wrapped and stored): the compaction of the "
                      "bucket keys");
}

}  // namespace

Status open_key_encryption(Storage& storage, const std::optional<std::string>& kek, bool read_only) {
  const std::string where = "cannot open tidal Db at '" + storage.path() + "'";
  std::string check;
  const Status g = storage.get(storage.meta(), kKeyEncryptionCheckKey, &check);
  if (!g.ok() && g.code() != StatusCode::NotFound) return g;
  const bool wrapped = g.ok();
  if (!kek) {
    if (!wrapped) return Status::OK();
    return Status::InvalidArgument(where + ": its bucket keys are wrapped with a key-encryption key, and "
                                   "Options::key_encryption_key is missing (nothing changed)");
  }
  Result<KeyEncryptionKey> k = KeyEncryptionKey::from(*kek);
  if (!k.ok()) return Status::InvalidArgument(where + ": Options::key_encryption_key: " + k.status().message());
  if (wrapped) {
    if (!k->opens_check(check)) {
      return Status::InvalidArgument(where + ": the key-encryption key given (Options::key_encryption_key) is not "
                                     "the one that wraps its bucket keys (nothing changed)");
    }
    storage.set_key_encryption({std::make_shared<const KeyEncryptionKey>(std::move(*k)), nullptr, false});
    return Status::OK();
  }
  if (read_only) {
    return Status::InvalidArgument(where + " read-only with Options::key_encryption_key: its bucket keys are not "
                                   "wrapped with a key-encryption key yet; a writable open with the key wraps them");
  }
  storage.set_key_encryption({std::make_shared<const KeyEncryptionKey>(std::move(*k)), nullptr, true});
  return Status::OK();
}

Status finish_key_encryption(Storage& storage) {
  const Storage::KeyEncryption kek = storage.key_encryption();
  if (!kek.pending || storage.bucket_keys() == nullptr) return Status::OK();
  return wrap_bucket_keys(storage, *kek.current,
                          "wrapping the bucket keys of '" + storage.path() + "' with the key-encryption key");
}

Status rotate_key_encryption(Storage& storage, std::string_view next) {
  Result<KeyEncryptionKey> k = KeyEncryptionKey::from(next);
  if (!k.ok()) return Status::InvalidArgument("rotate_key_encryption_key: " + k.status().message() + " (nothing changed)");
  if (storage.bucket_keys() == nullptr) {
    return Status::InvalidArgument("rotate_key_encryption_key: '" + storage.path() + "' has no key store yet");
  }
  return wrap_bucket_keys(storage, *k, "rotate_key_encryption_key of '" + storage.path() + "'");
}

}  // namespace tidal
