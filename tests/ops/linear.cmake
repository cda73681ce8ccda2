# Linear (ops/linear.hpp): CPU reference tests, and the cuBLAS path against it.
slime_add_test(test_ops_linear LABELS ops SOURCES ops/test_linear.cpp)
if(SLIME_GPU_TESTS)
  slime_add_test(test_ops_linear_gpu LABELS ops gpu SOURCES ops/test_linear_gpu.cu)
endif()
