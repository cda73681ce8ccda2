# The row ops (bias_add_, bias_backward, pos_embed_interpolate): CPU reference
# and finite-difference tests, and GPU-vs-CPU tests.
slime_add_test(test_ops_row LABELS ops SOURCES ops/test_row_ops.cpp)
if(SLIME_GPU_TESTS)
  slime_add_test(test_ops_row_gpu LABELS ops gpu SOURCES ops/test_row_ops_gpu.cu)
endif()
