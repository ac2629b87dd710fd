#include "storage/secret.h"

#include <sys/mman.h>
#include <unistd.h>

#include <openssl/crypto.h>

namespace tidal {
namespace {

std::size_t whole_pages(std::size_t bytes) {
  static const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

}  // namespace

void* secret_allocate(std::size_t bytes) noexcept {
  if (bytes == 0) bytes = 1;
  const std::size_t size = whole_pages(bytes);
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  // A kernel without MADV_DONTDUMP (before 3.4) still gets the memory;
  // only core dumps then hold it.
  (void)madvise(p, size, MADV_DONTDUMP);
  return p;
}

void secret_free(void* p, std::size_t bytes) noexcept {
  if (p == nullptr) return;
  if (bytes == 0) bytes = 1;
  OPENSSL_cleanse(p, bytes);
  munmap(p, whole_pages(bytes));
}

void wipe(void* p, std::size_t size) noexcept {
  if (size != 0) OPENSSL_cleanse(p, size);
}

void wipe(std::string* s) noexcept {
  OPENSSL_cleanse(s->data(), s->capacity());
  s->clear();
}

}  // namespace tidal
