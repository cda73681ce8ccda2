# Grouped GEMM (ops/grouped_gemm.hpp): the CUDA kernels against the CPU
# reference. The CPU tests live in ops/test_moe_ops.cpp (moe_ops.cmake).
if(SLIME_GPU_TESTS)
  slime_add_test(test_ops_grouped_gemm_gpu LABELS ops gpu SOURCES ops/test_grouped_gemm_gpu.cu)
endif()
