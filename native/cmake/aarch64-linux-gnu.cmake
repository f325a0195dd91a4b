# CMake toolchain file: Linux arm64 (aarch64) with Debian's cross compiler
# (apt: g++-aarch64-linux-gnu). Builds the same targets as the Android NDK toolchain
# (sakura_core, sakura-native) for a generic arm64 Linux; run the result on an x86 host
# with qemu-user (apt: qemu-user): `qemu-aarch64 -L /usr/aarch64-linux-gnu BINARY ...`.
#
#   cmake -S native -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=native/cmake/aarch64-linux-gnu.cmake \
#         -DSAKURA_PYTHON=OFF -DSAKURA_TOOL=ON
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(SAKURA_CROSS_PREFIX aarch64-linux-gnu- CACHE STRING "cross toolchain prefix")
set(CMAKE_C_COMPILER ${SAKURA_CROSS_PREFIX}gcc)
set(CMAKE_CXX_COMPILER ${SAKURA_CROSS_PREFIX}g++)

# the target's libraries and headers, never the host's: Debian's cross root, and the
# multiarch arm64 packages (dpkg --add-architecture arm64; libcurl4-openssl-dev:arm64 ...),
# whose libraries live in /usr/lib/aarch64-linux-gnu and arch-specific headers in
# /usr/include/aarch64-linux-gnu (searched through CMAKE_LIBRARY_ARCHITECTURE)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu /)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# how CMake (try_run, tests) and the tests run target binaries on the host
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64;-L;/usr/aarch64-linux-gnu)

# pkg-config (FindCURL, FindOpenSSL, FindPNG hints): the arm64 packages' .pc files only
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")
