# bench_context_parallel: what sequence parallelism (parallel/context_parallel.hpp)
# costs, on one GPU: the zigzag ring's block attentions against one full causal
# attention (ring 2, 4, 8; one 32k sequence and a packed varlen batch), Ulysses'
# all-to-all bytes per layer against the attention they feed (16k .. 64k tokens,
# degree 2, 4, 8), and the longest sequence the Qwen3-MoE benchmark model trains
# at cp = 1. No PyTorch baseline.
add_executable(bench_context_parallel bench_context_parallel.cpp)
target_link_libraries(bench_context_parallel PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_context_parallel PRIVATE -Wall -Wextra)
