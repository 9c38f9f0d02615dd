# mcbridge.cmake: included by llama.cpp's top-level CMakeLists.txt
# (llama-patches/0001-mcbridge-cmake-hook.patch) when it is configured with
# -DMCBRIDGE_ROOT=<this repository>. Unset, nothing here runs
# and the build is stock.
#
# It builds libmcbridge.a (the Go core as a C archive) and adds, without touching any
# other source's compile flags (so ccache serves the unpatched files from the stock
# build):
#   llama          csrc/libllama/llama-mcbridge*.cpp (stage 2, registration, clean marks),
#                  LLAMA_MCBRIDGE on the patched llama-kv-cache.cpp, llama-memory-recurrent.cpp
#                  and llama-context.cpp
#   llama-common   LLAMA_MCBRIDGE on the patched arg.cpp (--mcb-config, --mcb-tenant)
#   server-context csrc/server/server-mcbridge.cpp and LLAMA_MCBRIDGE for every file that
#                  sees server-common.h or server-task.h (they gain members under it)
if (CMAKE_VERSION VERSION_LESS 3.18)
    message(FATAL_ERROR "mcbridge: CMake 3.18 or newer is needed (source properties in other directories)")
endif()

set(MCB_ROOT      ${MCBRIDGE_ROOT})
set(MCB_LIBLLAMA_DIR ${MCB_ROOT}/csrc/libllama)
set(MCB_SERVER_DIR   ${MCB_ROOT}/csrc/server)
set(MCB_INCLUDES     ${MCB_LIBLLAMA_DIR} ${MCB_SERVER_DIR} ${MCB_ROOT}/include)

# The tag the patches are written against keys the state format (internal/llamapin/PIN).
file(STRINGS ${MCB_ROOT}/internal/llamapin/PIN MCB_PIN_TAG REGEX "^LLAMA_TAG=")
string(REGEX REPLACE "^LLAMA_TAG=" "" MCB_LLAMA_TAG "${MCB_PIN_TAG}")
if (NOT MCB_LLAMA_TAG)
    message(FATAL_ERROR "mcbridge: no LLAMA_TAG in ${MCB_ROOT}/internal/llamapin/PIN")
endif()
message(STATUS "mcbridge: ${MCB_ROOT} (llama.cpp ${MCB_LLAMA_TAG})")

find_package(Threads REQUIRED)

# libmcbridge.a, rebuilt when a Go or cgo source of the bridge changes (Go's own build
# cache makes an unchanged rebuild cheap). -DMCBRIDGE_ARCHIVE=<libmcbridge.a> links one
# built elsewhere instead (`go build -buildmode=c-archive -o <it> ./bridge` from the same
# checkout): a build host without Go, such as a GPU machine that builds llama.cpp with
# CUDA, still links the bridge of this tree.
set(MCBRIDGE_ARCHIVE "" CACHE FILEPATH "a prebuilt libmcbridge.a of this checkout (default: go build it)")
if (MCBRIDGE_ARCHIVE)
    if (NOT EXISTS ${MCBRIDGE_ARCHIVE})
        message(FATAL_ERROR "mcbridge: MCBRIDGE_ARCHIVE=${MCBRIDGE_ARCHIVE} does not exist")
    endif()
    set(MCB_ARCHIVE ${MCBRIDGE_ARCHIVE})
    add_custom_target(mcbridge-archive)
else()
    find_program(MCB_GO go HINTS /usr/local/go/bin REQUIRED)
    file(GLOB_RECURSE MCB_GO_SOURCES CONFIGURE_DEPENDS
        ${MCB_ROOT}/bridge/*.go ${MCB_ROOT}/bridge/*.c ${MCB_ROOT}/internal/*.go ${MCB_ROOT}/internal/llamapin/PIN)
    list(FILTER MCB_GO_SOURCES EXCLUDE REGEX "_test\\.go$")
    set(MCB_ARCHIVE ${CMAKE_BINARY_DIR}/mcbridge/libmcbridge.a)
    add_custom_command(
        OUTPUT  ${MCB_ARCHIVE}
        COMMAND ${CMAKE_COMMAND} -E env CGO_ENABLED=1
                ${MCB_GO} build -buildmode=c-archive -trimpath -o ${MCB_ARCHIVE} ./bridge
        WORKING_DIRECTORY ${MCB_ROOT}
        DEPENDS ${MCB_GO_SOURCES} ${MCB_ROOT}/include/mcbridge.h ${MCB_ROOT}/go.mod ${MCB_ROOT}/go.sum
        COMMENT "mcbridge: go build -buildmode=c-archive -> ${MCB_ARCHIVE}"
        VERBATIM)
    add_custom_target(mcbridge-archive DEPENDS ${MCB_ARCHIVE})
endif()
add_library(mcbridge-go STATIC IMPORTED GLOBAL)
set_target_properties(mcbridge-go PROPERTIES
    IMPORTED_LOCATION ${MCB_ARCHIVE}
    INTERFACE_LINK_LIBRARIES "Threads::Threads;${CMAKE_DL_LIBS};m")
add_dependencies(mcbridge-go mcbridge-archive)

# mcb_patched_source(<target> <file>...): the patched files of <target> see the bridge.
function(mcb_patched_source target)
    foreach(f ${ARGN})
        set_property(SOURCE ${f} TARGET_DIRECTORY ${target} APPEND PROPERTY COMPILE_DEFINITIONS LLAMA_MCBRIDGE)
        set_property(SOURCE ${f} TARGET_DIRECTORY ${target} APPEND PROPERTY INCLUDE_DIRECTORIES ${MCB_INCLUDES})
    endforeach()
endfunction()

# libllama
set(MCB_LLAMA_SOURCES ${MCB_LIBLLAMA_DIR}/llama-mcbridge.cpp ${MCB_LIBLLAMA_DIR}/llama-mcbridge-io.cpp
    ${MCB_LIBLLAMA_DIR}/llama-mcbridge-device.cpp)
target_sources(llama PRIVATE ${MCB_LLAMA_SOURCES})
mcb_patched_source(llama ${MCB_LLAMA_SOURCES} ${CMAKE_SOURCE_DIR}/src/llama-kv-cache.cpp
    ${CMAKE_SOURCE_DIR}/src/llama-memory-recurrent.cpp ${CMAKE_SOURCE_DIR}/src/llama-context.cpp)
set_property(SOURCE ${MCB_LLAMA_SOURCES} TARGET_DIRECTORY llama PROPERTY SKIP_UNITY_BUILD_INCLUSION ON)
set_property(SOURCE ${MCB_LLAMA_SOURCES} TARGET_DIRECTORY llama APPEND PROPERTY
    COMPILE_DEFINITIONS MCB_LLAMA_TAG="${MCB_LLAMA_TAG}")
target_link_libraries(llama PUBLIC mcbridge-go)

# llama-common: the command-line options
if (TARGET llama-common)
    mcb_patched_source(llama-common ${CMAKE_SOURCE_DIR}/common/arg.cpp)
endif()

# llama-server
if (TARGET server-context)
    target_sources(server-context PRIVATE ${MCB_SERVER_DIR}/server-mcbridge.cpp)
    target_compile_definitions(server-context PUBLIC LLAMA_MCBRIDGE)
    target_include_directories(server-context PUBLIC ${MCB_INCLUDES})
endif()

# Stage 2 against real contexts (scripts/deps.sh builds it, tests/e2e runs it).
add_executable(llama-mcbridge-test EXCLUDE_FROM_ALL ${MCB_ROOT}/csrc/testing/llama-mcbridge-test.cpp)
target_include_directories(llama-mcbridge-test PRIVATE ${MCB_INCLUDES} ${MCB_ROOT}/csrc/testing)
target_link_libraries(llama-mcbridge-test PRIVATE llama)
target_compile_features(llama-mcbridge-test PRIVATE cxx_std_17)
