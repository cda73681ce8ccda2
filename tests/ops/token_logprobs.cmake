# token_logprobs: fused lm-head + log-softmax + entropy (CPU reference tests,
# and the GPU-vs-CPU tests where the CUDA backend is built).
slime_add_test(test_ops_token_logprobs LABELS ops SOURCES ops/test_token_logprobs.cpp)
if(SLIME_GPU_TESTS)
  slime_add_test(test_ops_token_logprobs_gpu LABELS ops gpu SOURCES ops/test_token_logprobs_gpu.cu)
endif()
