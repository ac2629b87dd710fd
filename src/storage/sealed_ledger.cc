#include "storage/sealed_ledger.h"

#include <pthread.h>

#include <array>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "storage/format.h"
#include "storage/storage.h"

namespace tidal {
namespace {

constexpr unsigned char kKeyVersion = 1;
constexpr unsigned char kRecordVersion = 1;
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

// The nonces, from a per-thread pool of the OS CSPRNG's bytes, refilled
// 4 KiB at a time: RAND_bytes per record (its locks, and a getpid system
// call each) cost more than the sealing. A forked child empties the pool
// of the thread that forked (the only one it has), so it never draws the
// parent's nonces.
struct NoncePool {
  std::array<unsigned char, 4096> bytes{};
  std::size_t used = 4096;
};
NoncePool& nonce_pool() {
  thread_local NoncePool pool;
  return pool;
}
bool next_nonce(unsigned char* out) {
  static std::once_flag fork_handler;
  std::call_once(fork_handler, [] { pthread_atfork(nullptr, nullptr, [] { nonce_pool().used = 4096; }); });
  NoncePool& pool = nonce_pool();
  if (pool.used + kSealNonceSize > pool.bytes.size()) {
    if (RAND_bytes(pool.bytes.data(), static_cast<int>(pool.bytes.size())) != 1) return false;
    pool.used = 0;
  }
  std::memcpy(out, pool.bytes.data() + pool.used, kSealNonceSize);
  pool.used += kSealNonceSize;
  return true;
}

}  // namespace

Result<UserKey> UserKey::generate() {
  UserKey key;
  if (RAND_bytes(key.key_.data(), static_cast<int>(key.key_.size())) != 1) {
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
// with a valid digest and key; a null result leaves `out` zero.
template <std::size_t N>
void derive(const std::array<unsigned char, kUserKeySize>& key, std::string_view label,
            std::array<unsigned char, N>* out) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int size = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(label.data()),
           label.size(), mac, &size) != nullptr &&
      size >= N) {
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

std::string UserKey::record_key(std::uint64_t epoch) const {
  std::string out;
  out.reserve(kSealedLedgerKeySize);
  put_u64_be(&out, epoch);
  out.append(pseudonym());
  return out;
}

std::string UserKey::index_key(std::uint64_t epoch) const {
  std::string out(pseudonym());
  put_u64_be(&out, epoch);
  return out;
}

Status UserKey::seal(std::string_view record_key, std::string_view plaintext, std::string* value) const {
  value->resize(kSealVersionSize + kSealNonceSize + plaintext.size() + kSealTagSize);
  (*value)[0] = static_cast<char>(kRecordVersion);
  auto* out = reinterpret_cast<unsigned char*>(value->data()) + kSealVersionSize;
  if (!next_nonce(out)) {
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

std::string encode_key_store_key(std::uint64_t user_id) {
  std::string out;
  put_u64_be(&out, user_id);
  return out;
}

std::string key_store_end(std::uint64_t user_id) {
  std::string out = encode_key_store_key(user_id);
  out.push_back('\0');  // the next key of any length: below [user_id + 1 BE]
  return out;
}

Result<std::optional<UserKey>> read_user_key(const Storage& storage, std::uint64_t user,
                                             const rocksdb::Snapshot* snapshot) {
  if (storage.keys() == nullptr) return std::optional<UserKey>();  // format 3, read-only
  const std::string key = encode_key_store_key(user);
  std::string stored;
  Status s = storage.get(storage.keys(), key, &stored, snapshot);
  if (s.code() == StatusCode::NotFound) return std::optional<UserKey>();
  if (!s.ok()) return Status(s.code(), "read of the ledger key of user " + std::to_string(user) + ": " + s.message());
  std::optional<UserKey> k = UserKey::decode(stored);
  if (!k) {
    return Status::Corruption("the ledger key of user " + std::to_string(user) + " (key store key " + hex(key) +
                              ") in '" + storage.path() + "' does not decode (" + std::to_string(stored.size()) +
                              "-byte value; expected 33 of version 1)");
  }
  return k;
}

std::optional<std::uint64_t> decode_key_store_key(std::string_view key) {
  if (key.size() != kKeyStoreKeySize) return std::nullopt;
  return get_u64_be(key.data());
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

std::optional<std::string> sealed_index_key_of(std::string_view record_key) {
  if (record_key.size() != kSealedLedgerKeySize) return std::nullopt;
  std::string out(record_key.substr(8));
  out.append(record_key.substr(0, 8));
  return out;
}

}  // namespace tidal
