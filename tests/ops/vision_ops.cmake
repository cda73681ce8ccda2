# The Qwen3-VL vision tower's op families (layer_norm, gelu): CPU reference
# and finite-difference tests, and GPU-vs-CPU tests.
slime_add_test(test_ops_vision LABELS ops SOURCES ops/test_vision_ops.cpp)
if(SLIME_GPU_TESTS)
  slime_add_test(test_ops_vision_gpu LABELS ops gpu SOURCES ops/test_vision_ops_gpu.cu)
endif()
