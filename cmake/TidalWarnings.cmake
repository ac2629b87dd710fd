include_guard(GLOBAL)
include(GNUInstallDirs)

# Applies tidal's warning flags (and TIDAL_WERROR / TIDAL_SANITIZE) to one
# target, PRIVATE so they never leak into a host project.
function(tidal_set_warnings target)
  target_compile_options(${target} PRIVATE
    -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wsign-conversion -Wnon-virtual-dtor)
  if(TIDAL_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
  if(TIDAL_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=${TIDAL_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
    target_link_options(${target} PRIVATE -fsanitize=${TIDAL_SANITIZE})
  endif()
endfunction()

# tidal_set_warnings for code that is not the library's (tests, test helpers,
# benchmarks), less GCC 12's false -Wrestrict inside libstdc++'s
# std::string operator+ at -O2/-O3 where that code inlines it (GCC PR 105651;
# the main test build is -O3). The library and tools keep every warning.
function(tidal_set_test_warnings target)
  tidal_set_warnings(${target})
  target_compile_options(${target} PRIVATE $<$<CXX_COMPILER_ID:GNU>:-Wno-restrict>)
endfunction()
