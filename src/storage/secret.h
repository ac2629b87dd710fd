// Key material in memory (docs/FORMAT.md, "Keys in memory").
//
// Every buffer tidal fills with a key (a user's, a bucket's) is wiped with
// OPENSSL_cleanse before it is freed, so that no freed page holds one. The
// long-lived ones (the state store's writer's table of user keys, the keys a
// ledger scan holds, the pool of CSPRNG bytes new keys are drawn from) live in
// pages of their own, mapped with mmap and marked MADV_DONTDUMP, so that a
// core dump of the host leaves them out.
#ifndef TIDAL_STORAGE_SECRET_H_
#define TIDAL_STORAGE_SECRET_H_

#include <cstddef>
#include <new>
#include <string>
#include <string_view>
#include <vector>

namespace tidal {

// `bytes` (> 0) of zeroed memory in pages of their own, marked
// MADV_DONTDUMP; null when the OS maps none. Whole pages: an allocation of
// less than a page costs one.
void* secret_allocate(std::size_t bytes) noexcept;
// Wipes and unmaps what secret_allocate(bytes) returned.
void secret_free(void* p, std::size_t bytes) noexcept;
// Wipes `size` bytes at `p` (OPENSSL_cleanse: not optimized away).
void wipe(void* p, std::size_t size) noexcept;
// Wipes the whole buffer of `s` (its capacity) and empties it.
void wipe(std::string* s) noexcept;

// A standard allocator over secret_allocate, for containers of keys.
template <typename T>
struct SecretAllocator {
  using value_type = T;
  SecretAllocator() = default;
  template <typename U>
  SecretAllocator(const SecretAllocator<U>& /*other*/) noexcept {}
  T* allocate(std::size_t n) {
    void* p = secret_allocate(n * sizeof(T));
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t n) noexcept { secret_free(p, n * sizeof(T)); }
  template <typename U>
  friend bool operator==(const SecretAllocator& /*x*/, const SecretAllocator<U>& /*y*/) noexcept {
    return true;
  }
};

template <typename T>
using SecretVector = std::vector<T, SecretAllocator<T>>;

// Bytes of key material (a bucket_keys value in clear, a key read back):
// a string that wipes its buffer when it is destroyed, moved from or
// assigned. Room for kReserved bytes is taken up front, so that filling it
// with a stored value (<= kReserved bytes) never leaves a copy in a buffer
// it outgrew.
class SecretBytes {
 public:
  static constexpr std::size_t kReserved = 96;

  SecretBytes() { bytes_.reserve(kReserved); }
  SecretBytes(const SecretBytes&) = delete;
  SecretBytes& operator=(const SecretBytes&) = delete;
  SecretBytes(SecretBytes&& other) noexcept : SecretBytes() { take(&other); }
  SecretBytes& operator=(SecretBytes&& other) noexcept {
    if (this != &other) {
      wipe(&bytes_);
      take(&other);
    }
    return *this;
  }
  ~SecretBytes() { wipe(&bytes_); }

  std::string_view view() const { return bytes_; }
  std::size_t size() const { return bytes_.size(); }
  // The buffer, for a read or an encoder to fill (within kReserved bytes,
  // or a copy may be left behind where the string grew).
  std::string* buffer() { return &bytes_; }
  void clear() { wipe(&bytes_); }

 private:
  // Copies `other`'s bytes (a move of a short string copies them too) and
  // wipes them there.
  void take(SecretBytes* other) noexcept {
    bytes_.assign(other->bytes_);
    wipe(&other->bytes_);
  }
  std::string bytes_;
};

}  // namespace tidal

#endif  // TIDAL_STORAGE_SECRET_H_
