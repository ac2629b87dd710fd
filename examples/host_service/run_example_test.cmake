# ctest driver (example_host_service_installed): installs the current build
# tree into PREFIX, then configures, builds and runs examples/host_service
# against that installed package, as a host project would.
#   cmake -DBUILD_DIR=... -DPREFIX=... -DEXAMPLE_SOURCE=... -DEXAMPLE_BINARY=...
#         [-DCXX_COMPILER=...] [-DBUILD_TYPE=...] -P run_example_test.cmake
foreach(var BUILD_DIR PREFIX EXAMPLE_SOURCE EXAMPLE_BINARY)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_example_test.cmake: -D${var}=... is required")
  endif()
endforeach()

function(step name)
  message(STATUS "example test: ${name}: ${ARGN}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "example test: ${name} failed (${rc}): ${ARGN}")
  endif()
endfunction()

file(REMOVE_RECURSE ${PREFIX} ${EXAMPLE_BINARY})
step(install ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${PREFIX})

set(configure_args -S ${EXAMPLE_SOURCE} -B ${EXAMPLE_BINARY} -DCMAKE_PREFIX_PATH=${PREFIX})
if(CXX_COMPILER)
  list(APPEND configure_args -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()
if(BUILD_TYPE)
  list(APPEND configure_args -DCMAKE_BUILD_TYPE=${BUILD_TYPE})
endif()
step(configure ${CMAKE_COMMAND} ${configure_args})
step(build ${CMAKE_COMMAND} --build ${EXAMPLE_BINARY} -j2)
file(REMOVE_RECURSE ${EXAMPLE_BINARY}/db)
step(run ${EXAMPLE_BINARY}/host_service ${EXAMPLE_BINARY}/db)
