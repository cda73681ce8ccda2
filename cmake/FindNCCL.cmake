# FindNCCL: locates NCCL (no upstream CMake module exists).
#
# Looks in NCCL_ROOT (variable or environment), then the CUDA toolkit
# (CUDAToolkit_ROOT / CUDA_HOME / /usr/local/cuda), then system paths.
# Provides NCCL::NCCL (imported shared library), NCCL_FOUND, NCCL_INCLUDE_DIR,
# NCCL_LIBRARY and NCCL_VERSION (from nccl.h).

set(_nccl_hints)
foreach(_root IN ITEMS "${NCCL_ROOT}" "$ENV{NCCL_ROOT}" "${CUDAToolkit_ROOT}" "$ENV{CUDA_HOME}"
                       "${CUDAToolkit_LIBRARY_ROOT}")
  if(_root)
    list(APPEND _nccl_hints "${_root}")
  endif()
endforeach()
if(CUDAToolkit_INCLUDE_DIRS)
  foreach(_inc IN LISTS CUDAToolkit_INCLUDE_DIRS)
    get_filename_component(_parent "${_inc}" DIRECTORY)
    list(APPEND _nccl_hints "${_parent}")
  endforeach()
endif()
list(APPEND _nccl_hints /usr/local/cuda)

find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl HINTS ${_nccl_hints}
             PATH_SUFFIXES lib64 lib lib/x86_64-linux-gnu targets/x86_64-linux/lib)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_ver REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${_part} +([0-9]+)" _m "${_nccl_ver}")
    set(NCCL_VERSION_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  set(NCCL_VERSION "${NCCL_VERSION_MAJOR}.${NCCL_VERSION_MINOR}.${NCCL_VERSION_PATCH}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL SHARED IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
