# bench_fsdp: the FSDP train step (forward + token log-probabilities +
# backward + AdamW) of a ~0.5B dense Qwen3 and of the Qwen3-MoE benchmark config
# (32 experts top-4, no expert parallelism), Sharded<Qwen3Model, FullShard> on
# 1 and 2 GPUs (NcclComm, ranks as threads): tokens/s and peak device memory.
# Opt-in rows (SLIME_BENCH_FSDP_MODELS, see bench_fsdp.cpp): Qwen3-1.7B's shape
# on 1 and 2 GPUs, the MoE with expert parallelism (mesh dp_shard 1 x ep 2), and
# vl2b_8layers: Sharded<Qwen3VLModel, FullShard> (Qwen3-VL-2B's vision tower +
# 8 of its text layers, 8 x 2048 tokens per GPU, one 448x448 image per sequence)
# beside FSDP2 on transformers' Qwen3VLForConditionalGeneration. The VL row on
# one GPU, both sides (from the repository root, after building bench_fsdp):
#   export SLIME_BENCH_FSDP_MODELS=vl2b_8layers
#   build/gpu/bench/bench_fsdp --benchmark_filter=vl2b_8layers/gpus1 --benchmark_out=bench_fsdp_vl.json
#   python3 bench/torch_fsdp2.py --models vl2b_8layers --out torch_fsdp_vl.json
#   python3 bench/torch_fsdp2.py --table --slime bench_fsdp_vl.json --out torch_fsdp_vl.json
# PyTorch FSDP2 baseline and the side-by-side table: bench/torch_fsdp2.py (run
# by tools/gpu-test.sh, 2 GPUs under torchrun).
add_executable(bench_fsdp bench_fsdp.cpp)
target_link_libraries(bench_fsdp PRIVATE ${SLIME_LIB} benchmark::benchmark)
target_compile_options(bench_fsdp PRIVATE -Wall -Wextra)
