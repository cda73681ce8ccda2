# bench_moe: the MoE layer end to end. nn::SparseMoeBlock forward + backward
# on one GPU (moe/block/<shape>/fwd_bwd; PyTorch baseline: transformers'
# Qwen3MoeSparseMoeBlock in bench/torch_moe.py) and ExpertParallel<> dispatch +
# combine over NCCL on 2 GPUs (moe/ep2/dispatch_combine/<shape>; no baseline).
add_executable(bench_moe bench_moe.cpp)
target_link_libraries(bench_moe PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_moe PRIVATE -Wall -Wextra)
