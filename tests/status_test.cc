// Status and Result, and the version macros of the public headers. This file
// is also built without NDEBUG (tidal_status_debug_tests) so the debug-build
// assertions are tested too.
#include <string>

#include <gtest/gtest.h>

#include "tidal/db.h"

namespace tidal {
namespace {

// A type of this file only: the Result<Value> below is instantiated here, with
// this file's NDEBUG, and nowhere in the library.
struct Value {
  int v = 0;
};

TEST(Result, HoldsAValueOrAnError) {
  Result<Value> good(Value{7});
  ASSERT_TRUE(good.ok());
  EXPECT_EQ(good->v, 7);
  Result<Value> bad(Status::NotFound("user 1"));
  EXPECT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::NotFound);
  EXPECT_EQ(bad.status().to_string(), "NotFound: user 1");
}

#ifdef NDEBUG
// Release builds: never an OK Result without a value.
TEST(Result, BuiltFromAnOkStatusIsAnErrorInRelease) {
  Result<Value> r(Status::OK());
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::InvalidArgument);
  EXPECT_NE(r.status().message().find("OK Status"), std::string::npos) << r.status().message();
}
#else
// Debug builds: the programming error stops the program where it happened.
TEST(ResultDeathTest, BuiltFromAnOkStatusAssertsInDebug) {
  EXPECT_DEATH({ Result<Value> r(Status::OK()); (void)r; }, "must carry an error");
}
TEST(ResultDeathTest, ValueOfAnErrorAssertsInDebug) {
  EXPECT_DEATH({
    Result<Value> r(Status::IOError("disk"));
    (void)r.value();
  }, "ok\\(\\)");
}
#endif

// db.h brings the version macros, and they match the CMake project version.
TEST(Version, MacrosMatchTheCMakePackageVersion) {
  EXPECT_EQ(TIDAL_VERSION_MAJOR, TIDAL_PROJECT_VERSION_MAJOR);
  EXPECT_EQ(TIDAL_VERSION_MINOR, TIDAL_PROJECT_VERSION_MINOR);
  EXPECT_EQ(TIDAL_VERSION_PATCH, TIDAL_PROJECT_VERSION_PATCH);
}

}  // namespace
}  // namespace tidal
