# Install rules: the library, its headers, the CMake package (tidal::tidal)
# and a pkg-config file.
include_guard(GLOBAL)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(TIDAL_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/tidal)

install(TARGETS tidal EXPORT tidalTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/tidal DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT tidalTargets NAMESPACE tidal:: DESTINATION ${TIDAL_CMAKE_DIR})
# tidal::nats (src/nats) in an export set of its own, loaded by tidalConfig.cmake
# when the NATS C client (cnats) is found, so the core package never needs it.
if(TARGET tidal_nats)
  install(TARGETS tidal_nats EXPORT tidalNatsTargets
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(EXPORT tidalNatsTargets NAMESPACE tidal:: DESTINATION ${TIDAL_CMAKE_DIR})
endif()

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/tidalConfig.cmake.in
  ${PROJECT_BINARY_DIR}/tidalConfig.cmake INSTALL_DESTINATION ${TIDAL_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/tidalConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/tidalConfig.cmake ${PROJECT_BINARY_DIR}/tidalConfigVersion.cmake
  DESTINATION ${TIDAL_CMAKE_DIR})

configure_file(${PROJECT_SOURCE_DIR}/cmake/tidal.pc.in ${PROJECT_BINARY_DIR}/tidal.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/tidal.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
