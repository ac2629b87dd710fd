// Keeps exceptions (std::bad_alloc, libcuckoo's) from crossing the public API.
#ifndef TIDAL_DB_GUARDED_H_
#define TIDAL_DB_GUARDED_H_

#include <cxxabi.h>

#include <exception>
#include <string>

#include "tidal/status.h"

namespace tidal {

// Catching abi::__forced_unwind binds a reference to an exception object the
// runtime does not have (a foreign exception): UBSan's null check reports it,
// though it is how glibc documents catching forced unwinding. Functions that
// do so opt out of that check (GCC only offers it for all of UBSan).
#if defined(__clang__)
#define TIDAL_CATCHES_FORCED_UNWIND __attribute__((no_sanitize("null")))
#else
#define TIDAL_CATCHES_FORCED_UNWIND __attribute__((no_sanitize_undefined))
#endif

// Runs `fn`; an exception becomes an IOError Status naming `what`. Forced
// unwinding (pthread_exit or pthread_cancel, e.g. from a ContributionSink)
// is not an error of `fn`: it is rethrown, as the runtime requires, and the
// thread ends.
template <class F>
TIDAL_CATCHES_FORCED_UNWIND auto guarded(const char* what, F&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (abi::__forced_unwind&) {
    throw;
  } catch (const std::exception& e) {
    return Status::IOError(std::string(what) + " failed: " + e.what());
  } catch (...) {
    return Status::IOError(std::string(what) + " failed: unknown exception");
  }
}

inline Status closed_status(const char* what) { return Status::Closed(std::string(what) + " on a closed Db"); }

}  // namespace tidal

#endif  // TIDAL_DB_GUARDED_H_
