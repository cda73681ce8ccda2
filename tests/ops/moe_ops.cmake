# MoE ops (ops/router.hpp, ops/moe_permute.hpp, ops/grouped_gemm.hpp): CPU
# reference tests. The CUDA path and its tests come later.
slime_add_test(test_ops_moe LABELS ops moe SOURCES ops/test_moe_ops.cpp)
