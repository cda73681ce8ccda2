# Attention over packed sequences (slime/ops/attention.hpp). Included from
# tests/CMakeLists.txt: source paths are relative to tests/.
slime_add_test(test_ops_attention LABELS ops SOURCES ops/test_attention.cpp)
# With CUDA, test_attention.cpp also compiles src/ops/attention_kernels.cuh as
# host code (the kernels on a CPU emulator); GCC warns about its #pragma unroll.
target_compile_options(test_ops_attention PRIVATE -Wno-unknown-pragmas)
if(SLIME_GPU_TESTS)
  slime_add_test(test_ops_attention_gpu LABELS ops gpu SOURCES ops/test_attention_gpu.cu)
endif()
