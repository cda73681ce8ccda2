# MoE ops (ops/router.hpp, ops/moe_permute.hpp, ops/grouped_gemm.hpp): CPU
# reference tests, and the router / layout / permute GPU paths against them.
slime_add_test(test_ops_moe LABELS ops moe SOURCES ops/test_moe_ops.cpp)
if(SLIME_GPU_TESTS)
  slime_add_test(test_ops_moe_gpu LABELS ops moe gpu SOURCES ops/test_moe_ops_gpu.cu)
endif()
