# Memory-bound op families (embedding, rms_norm, rope, swiglu, elementwise):
# CPU reference and finite-difference tests, and GPU-vs-CPU tests.
slime_add_test(test_ops_elementwise LABELS ops SOURCES ops/test_elementwise_ops.cpp)
if(SLIME_GPU_TESTS)
  slime_add_test(test_ops_elementwise_gpu LABELS ops gpu SOURCES ops/test_elementwise_ops_gpu.cu)
endif()
