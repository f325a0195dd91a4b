# The native edit runtime inside the Python module: libcurl for the receive stage, the
# executorch wheel's C++ runtime (_portable_lib, XNNPACK registered) for the execute stage.
#
# The wheel ships headers under executorch/include and needs torch's headers for c10; both
# are found through the interpreter the build runs with, so the module is built with
# `pip install --no-build-isolation ./native` into the environment that has executorch and
# torch (scripts/_env.sh). Without them the module builds without the edit runtime and
# `sakura_native.edit_runtime_available()` says why.
#
# A cross build (edge/backends/arm64_edge.py: sakura-edge for arm64) names the runtime instead
# of asking the interpreter: -DSAKURA_EXECUTORCH_DIR (the target's executorch package: headers
# and extension/pybindings/_portable_lib*.so), -DSAKURA_TORCH_DIR (a torch package whose
# include/ has the c10 headers; they do not depend on the architecture) and
# -DSAKURA_EXECUTORCH_VERSION.
set(SAKURA_EDIT_REASON "")
set(_sakura_given OFF)
if(SAKURA_EXECUTORCH_DIR AND SAKURA_TORCH_DIR AND SAKURA_EXECUTORCH_VERSION)
  set(_sakura_given ON)
endif()
if(NOT SAKURA_EDIT_RUNTIME)
  set(SAKURA_EDIT_REASON "built with -DSAKURA_EDIT_RUNTIME=OFF")
elseif(_sakura_given)
  find_package(CURL)
  find_package(OpenSSL COMPONENTS Crypto)
  if(NOT CURL_FOUND)
    set(SAKURA_EDIT_REASON "libcurl development files not found for ${CMAKE_SYSTEM_PROCESSOR}")
  elseif(NOT OpenSSL_FOUND)
    set(SAKURA_EDIT_REASON "OpenSSL development files not found for ${CMAKE_SYSTEM_PROCESSOR}")
  endif()
else()
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import os, executorch, torch; print(list(executorch.__path__)[0]); print(os.path.dirname(torch.__file__)); from importlib.metadata import version; print(version('executorch'))"
    OUTPUT_VARIABLE _sakura_paths RESULT_VARIABLE _sakura_rc ERROR_QUIET
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  find_package(CURL)
  find_package(OpenSSL COMPONENTS Crypto)
  if(NOT _sakura_rc EQUAL 0)
    set(SAKURA_EDIT_REASON "executorch and torch are not importable by ${Python_EXECUTABLE} (build with --no-build-isolation in the project's environment)")
  elseif(NOT CURL_FOUND)
    set(SAKURA_EDIT_REASON "libcurl development files not found (apt-get install libcurl4-openssl-dev)")
  elseif(NOT OpenSSL_FOUND)
    set(SAKURA_EDIT_REASON "OpenSSL development files not found (apt-get install libssl-dev)")
  endif()
endif()

if(SAKURA_EDIT_REASON STREQUAL "" AND _sakura_given)
  set(_sakura_pybind_dir "${SAKURA_EXECUTORCH_DIR}/extension/pybindings")
  file(GLOB _sakura_portable "${_sakura_pybind_dir}/_portable_lib*.so")
  list(LENGTH _sakura_portable _sakura_n)
  if(NOT _sakura_n EQUAL 1)
    message(FATAL_ERROR "expected one _portable_lib*.so in ${_sakura_pybind_dir}")
  endif()
  get_filename_component(_sakura_portable_name "${_sakura_portable}" NAME)
  string(REGEX REPLACE "^_portable_lib" "" _sakura_ext "${_sakura_portable_name}")
elseif(SAKURA_EDIT_REASON STREQUAL "")
  string(REPLACE "\n" ";" _sakura_paths "${_sakura_paths}")
  list(GET _sakura_paths 0 SAKURA_EXECUTORCH_DIR)
  list(GET _sakura_paths 1 SAKURA_TORCH_DIR)
  list(GET _sakura_paths 2 SAKURA_EXECUTORCH_VERSION)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"
    OUTPUT_VARIABLE _sakura_ext OUTPUT_STRIP_TRAILING_WHITESPACE)
  set(_sakura_pybind_dir "${SAKURA_EXECUTORCH_DIR}/extension/pybindings")
  set(_sakura_portable "${_sakura_pybind_dir}/_portable_lib${_sakura_ext}")
endif()
if(SAKURA_EDIT_REASON STREQUAL "")
  if(NOT EXISTS "${_sakura_portable}")
    message(FATAL_ERROR "ExecuTorch runtime library not found: ${_sakura_portable}")
  endif()
  message(STATUS "sakura: edit runtime with ExecuTorch at ${SAKURA_EXECUTORCH_DIR}")

  add_library(sakura_edit STATIC
    src/sakura/graph.cpp
    src/sakura/http.cpp
    src/sakura/edit.cpp)
  set_target_properties(sakura_edit PROPERTIES CXX_STANDARD 20 CXX_STANDARD_REQUIRED ON)
  target_include_directories(sakura_edit PUBLIC src)
  target_include_directories(sakura_edit SYSTEM PRIVATE
    "${SAKURA_EXECUTORCH_DIR}/include"
    "${SAKURA_EXECUTORCH_DIR}/include/executorch/runtime/core/portable_type/c10"
    "${SAKURA_TORCH_DIR}/include")
  target_compile_definitions(sakura_edit PRIVATE C10_USING_CUSTOM_GENERATED_MACROS)
  target_compile_options(sakura_edit PRIVATE -O3 -Wall -Wextra -Wno-unused-parameter)
  target_link_libraries(sakura_edit PUBLIC sakura_core CURL::libcurl OpenSSL::Crypto
                        Threads::Threads)
  # link the wheel's runtime by its SONAME, found at run time next to the module
  target_link_directories(sakura_edit PUBLIC "${_sakura_pybind_dir}")
  target_link_libraries(sakura_edit PUBLIC "-l:_portable_lib${_sakura_ext}")

  # the ExecuTorch include paths of what else runs graphs (the text encoder runner)
  set(SAKURA_EXECUTORCH_INCLUDES "${SAKURA_EXECUTORCH_DIR}/include"
      "${SAKURA_EXECUTORCH_DIR}/include/executorch/runtime/core/portable_type/c10"
      "${SAKURA_TORCH_DIR}/include")
  set(SAKURA_PORTABLE_DIR "${_sakura_pybind_dir}")
endif()

if(SAKURA_EDIT_REASON STREQUAL "" AND TARGET sakura_native)
  set_target_properties(sakura_native PROPERTIES CXX_STANDARD 20 CXX_STANDARD_REQUIRED ON)
  target_sources(sakura_native PRIVATE src/python/bind_edit.cpp)
  target_link_libraries(sakura_native PRIVATE sakura_edit)
  target_compile_definitions(sakura_native PRIVATE SAKURA_EDIT_RUNTIME=1)
  # the module sits in site-packages; the runtime library in site-packages/executorch/...
  file(RELATIVE_PATH _sakura_rel "${Python_SITELIB}" "${_sakura_pybind_dir}")
  set_target_properties(sakura_native PROPERTIES
    INSTALL_RPATH "$ORIGIN/${_sakura_rel};${_sakura_pybind_dir}"
    BUILD_RPATH "${_sakura_pybind_dir}")
elseif(TARGET sakura_native)
  message(STATUS "sakura: no edit runtime: ${SAKURA_EDIT_REASON}")
  target_compile_definitions(sakura_native PRIVATE
    SAKURA_EDIT_UNAVAILABLE="${SAKURA_EDIT_REASON}")
endif()
