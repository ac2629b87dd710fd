// Where a test binary's helper programs and data are. The build defines
// these in one generated source file per test binary (tests/CMakeLists.txt,
// tidal_test_paths), the only file compiled with the checkout's absolute
// paths: every test source then compiles to the same object in a clone at
// any path, and ccache serves it (tests/RELIABILITY.md, "Caches"). A binary
// defines only the paths it uses.
#ifndef TIDAL_TESTS_TEST_PATHS_H_
#define TIDAL_TESTS_TEST_PATHS_H_

namespace tidal::testing::paths {

extern const char* const kCrashChild;    // tidal_crash_child (tests/crash_child.cc)
extern const char* const kExitChild;     // tidal_exit_child (tests/exit_child.cc)
extern const char* const kHostileChild;  // tidal_hostile_child (tests/hostile_fs_child.cc)
extern const char* const kOpenProbe;     // tidal_open_probe (tests/open_probe.cc)
extern const char* const kTestData;      // tests/data
extern const char* const kNatsChild;     // tidal_nats_child (tests/nats/nats_child.cc)
extern const char* const kTidalctl;      // tidalctl, when built (TIDAL_HAVE_TIDALCTL)

}  // namespace tidal::testing::paths

#endif  // TIDAL_TESTS_TEST_PATHS_H_
