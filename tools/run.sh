#!/usr/bin/env bash
# Builds and runs the main example, the Qwen3-MoE GRPO trainer
# (examples/qwen3_moe_rl). Extra arguments go to the example (try --help).
# Without a GPU it trains the built-in tiny Qwen3-MoE on the CPU with 2 ranks
# (about 20 s on 2 cores after the build) and prints whether the mean reward
# rose; with GPUs the same command uses CUDA and NCCL.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh >/dev/null
cmake --preset default >/dev/null
cmake --build --preset default --target qwen3_moe_rl
exec build/default/examples/qwen3_moe_rl "$@"
