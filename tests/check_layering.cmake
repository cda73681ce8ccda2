# ctest -P script: the include graph follows docs/DESIGN.md's layers.
#   nn/ includes only core/, ops/, io/ and nn/ (never parallel/, comm/, rollout/);
#   core/, ops/ and io/ include nothing above them (so nn/ cannot reach those
#   layers through them either);
#   parallel/sharded.hpp does not include nn/qwen3.hpp (it wraps any module).
# Run as: cmake -DROOT=<source dir> -P check_layering.cmake
cmake_policy(SET CMP0057 NEW)
set(errors "")
function(check_folder folder allowed)
  file(GLOB_RECURSE headers "${ROOT}/include/slime/${folder}/*.hpp")
  foreach(h IN LISTS headers)
    file(STRINGS "${h}" includes REGEX "^#include \"slime/")
    foreach(line IN LISTS includes)
      string(REGEX REPLACE "^#include \"slime/([a-z_]+)/.*" "\\1" layer "${line}")
      if(NOT layer IN_LIST allowed)
        file(RELATIVE_PATH rel "${ROOT}" "${h}")
        set(errors "${errors}\n  ${rel}: ${line} (${folder}/ may include only ${allowed})")
      endif()
    endforeach()
  endforeach()
  set(errors "${errors}" PARENT_SCOPE)
endfunction()
check_folder(core "core")
check_folder(ops "core;ops")
check_folder(io "core;io")
check_folder(nn "core;ops;io;nn")
file(STRINGS "${ROOT}/include/slime/parallel/sharded.hpp" qwen REGEX "^#include \"slime/nn/qwen3.hpp\"")
if(qwen)
  set(errors "${errors}\n  include/slime/parallel/sharded.hpp includes slime/nn/qwen3.hpp (Sharded wraps any module)")
endif()
if(errors)
  message(FATAL_ERROR "layering violations:${errors}")
endif()
message(STATUS "layering: nn/, core/, ops/ and io/ include only their allowed layers")
