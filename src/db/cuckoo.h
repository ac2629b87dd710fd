// libcuckoo, as tidal builds it: Debian's headers with tidal's fix
// (third_party/libcuckoo), which CMakeLists.txt copies into the build tree and
// patches. Include this instead of <libcuckoo/cuckoohash_map.hh>.
#ifndef TIDAL_DB_CUCKOO_H_
#define TIDAL_DB_CUCKOO_H_

#include <libcuckoo/cuckoohash_map.hh>

#ifndef TIDAL_LIBCUCKOO_LOCKS_EVERY_ARRAY
#error "tidal needs libcuckoo with third_party/libcuckoo/lock-every-locks-array.patch (CMakeLists.txt applies it); \
without it a table that resizes under many threads can read freed memory"
#endif

#endif  // TIDAL_DB_CUCKOO_H_
