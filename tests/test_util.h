// Shared test fixtures: temporary directories and Status assertions.
#ifndef TIDAL_TESTS_TEST_UTIL_H_
#define TIDAL_TESTS_TEST_UTIL_H_

#include <stdlib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "test_paths.h"
#include "tidal/db.h"

#define ASSERT_OK(expr)                                              \
  do {                                                               \
    const auto& tidal_status_ = (expr);                              \
    ASSERT_TRUE(tidal_status_.ok()) << #expr << ": " << tidal::testing::describe(tidal_status_); \
  } while (0)
#define EXPECT_OK(expr)                                              \
  do {                                                               \
    const auto& tidal_status_ = (expr);                              \
    EXPECT_TRUE(tidal_status_.ok()) << #expr << ": " << tidal::testing::describe(tidal_status_); \
  } while (0)

namespace tidal::testing {

// The size of a soak test (SIGKILL rounds, power cuts, drills, long NATS
// runs): `tier` in the default tier, which CI runs inside its time budget,
// and `soak` under scripts/test.sh --soak (TIDAL_SOAK=1). A value in the
// test's own variable `env` (e.g. TIDAL_CRASH_ROUNDS) wins over both; 0 or
// garbage there is refused rather than read as "no rounds".
inline int soak_rounds(const char* env, int tier, int soak) {
  if (const char* v = std::getenv(env); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (*end != '\0' || n <= 0 || n > 1'000'000) {
      throw std::invalid_argument(std::string(env) + "=" + v + ": expected a round count from 1 to 1000000");
    }
    return static_cast<int>(n);
  }
  const char* all = std::getenv("TIDAL_SOAK");
  return all != nullptr && std::string(all) == "1" ? soak : tier;
}

// The step of a fault sweep (a call run once per file operation n, failing
// at n): every `tier`-th n in the default tier, every n under --soak. Two
// variables change it: TIDAL_SWEEP_STRIDE sets the step of every sweep
// (1: every operation), and TIDAL_SWEEP_SCALE multiplies the default tier's
// (scripts/test.sh sets 3 for the sanitizer builds, whose every operation
// costs ~2.5x the main build's). Garbage in either is refused.
inline std::uint64_t sweep_stride(int tier) {
  const int scale = soak_rounds("TIDAL_SWEEP_SCALE", 1, 1);
  return static_cast<std::uint64_t>(soak_rounds("TIDAL_SWEEP_STRIDE", tier * scale, 1));
}

inline std::string describe(const Status& s) { return s.to_string(); }
template <class T>
std::string describe(const Result<T>& r) { return r.status().to_string(); }

// A fresh directory under $TMPDIR, removed with everything in it on destruction.
// Sets `target` (a test hook or a tunable static such as
// Storage::step_for_testing or Db::Impl::erasure_wait) to `value` for the
// scope and puts the old value back at its end, however the test leaves it:
// a failed ASSERT returns early, and a hook left set would run in every test
// after it.
template <class T>
class ScopedOverride {
 public:
  ScopedOverride(T& target, std::type_identity_t<T> value) : target_(target), saved_(std::exchange(target, std::move(value))) {}
  ~ScopedOverride() { target_ = std::move(saved_); }
  ScopedOverride(const ScopedOverride&) = delete;
  ScopedOverride& operator=(const ScopedOverride&) = delete;

 private:
  T& target_;
  T saved_;
};

class TempDir {
 public:
  TempDir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "tidal-test-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  // A path inside the directory.
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// The value of a score read, failing the test (and returning NaN) on error.
inline double value_of(const Result<double>& score) {
  EXPECT_TRUE(score.ok()) << score.status().to_string();
  return score.ok() ? *score : std::numeric_limits<double>::quiet_NaN();
}

// Opens a Db, failing the test on error.
inline std::unique_ptr<Db> open_db(const std::string& path, const Options& options = {}) {
  Result<std::unique_ptr<Db>> db = Db::open(path, options);
  EXPECT_TRUE(db.ok()) << db.status().to_string();
  return db.ok() ? std::move(*db) : nullptr;
}

// A ContributionSink that records every contribution and counts them per
// user (thread-safe).
class RecordingSink : public ContributionSink {
 public:
  void on_contribution(const Contribution& c) override {
    std::lock_guard<std::mutex> lock(mu_);
    seen.push_back(c);
    ++by_user_[c.user_id];
  }
  std::uint64_t count_for(std::uint64_t user) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = by_user_.find(user);
    return it == by_user_.end() ? 0 : it->second;
  }
  std::vector<Contribution> seen;  // read it once the signaling threads are done

 private:
  std::mutex mu_;
  std::map<std::uint64_t, std::uint64_t> by_user_;
};

// `options` with `sink` as the contribution sink.
inline Options with_sink(std::shared_ptr<ContributionSink> sink, Options options = {}) {
  options.contribution_sink = std::move(sink);
  return options;
}

}  // namespace tidal::testing

#endif  // TIDAL_TESTS_TEST_UTIL_H_
