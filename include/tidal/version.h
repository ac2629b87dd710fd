// The version of tidal these headers belong to, for compile-time checks in
// host code (#if TIDAL_VERSION_MAJOR > 0 ...). It matches the CMake package
// version (project(tidal VERSION ...) in CMakeLists.txt; configuring fails
// when they differ). The on-disk format has its own version (docs/FORMAT.md).
#ifndef TIDAL_VERSION_H_
#define TIDAL_VERSION_H_

#define TIDAL_VERSION_MAJOR 0
#define TIDAL_VERSION_MINOR 4
#define TIDAL_VERSION_PATCH 0

#endif  // TIDAL_VERSION_H_
