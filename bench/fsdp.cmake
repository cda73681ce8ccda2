# bench_fsdp: the FSDP train step (forward + token log-probabilities +
# backward + AdamW) of a ~0.5B dense Qwen3 and of the Qwen3-MoE benchmark config
# (32 experts top-4, no expert parallelism), Sharded<Qwen3Model, FullShard> on
# 1 and 2 GPUs (NcclComm, ranks as threads): tokens/s and peak device memory.
# Opt-in rows (SLIME_BENCH_FSDP_MODELS, see bench_fsdp.cpp): Qwen3-1.7B's shape
# on 1 and 2 GPUs, and the MoE with expert parallelism (mesh dp_shard 1 x ep 2).
# PyTorch FSDP2 baseline and the side-by-side table: bench/torch_fsdp2.py (run
# by tools/gpu-test.sh, 2 GPUs under torchrun).
add_executable(bench_fsdp bench_fsdp.cpp)
target_link_libraries(bench_fsdp PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_fsdp PRIVATE -Wall -Wextra)
