#!/usr/bin/env bash
# tools/gpu-vl-check.sh: the Qwen3-VL checks on the GPU machine, after
# tools/gpu-test.sh has built build/gpu (run it with SLIME_GPU_TEST_BENCH=none
# first, or any selection):
#   1. the VL example on CUDA (one rank per GPU, bf16): 200 steps of the
#      colour task, its reward and the engine-vs-trainer logprob gap;
#   2. the Qwen3-VL train step against FSDP2 on transformers' model
#      (bench_fsdp's opt-in vl2b_8layers row, 1 GPU) and the table.
# Logs in ${OUT:-build/gpu/out}.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
out=${OUT:-build/gpu/out}
mkdir -p "$out"
rc=0
echo "== qwen3_vl_rl on CUDA (200 steps)"
timeout 150 build/gpu/examples/qwen3_vl_rl --device cuda --out "$out/vl_rl" > "$out/vl_rl.log" 2>&1 || rc=1
tail -n 4 "$out/vl_rl.log"
echo "== bench_fsdp vl2b_8layers (slime) and torch_fsdp2.py (FSDP2)"
SLIME_BENCH_FSDP_MODELS=vl2b_8layers timeout 150 build/gpu/bench/bench_fsdp --benchmark_filter=vl2b_8layers/gpus1 \
  --benchmark_out="$out/bench_fsdp_vl.json" > "$out/bench_fsdp_vl.log" 2>&1 || rc=1
tail -n 5 "$out/bench_fsdp_vl.log"
timeout 150 python3 bench/torch_fsdp2.py --models vl2b_8layers --out "$out/torch_fsdp_vl.json" > "$out/torch_fsdp_vl.log" 2>&1 || rc=1
tail -n 5 "$out/torch_fsdp_vl.log"
python3 bench/torch_fsdp2.py --table --slime "$out/bench_fsdp_vl.json" --out "$out/torch_fsdp_vl.json" || rc=1
exit $rc
