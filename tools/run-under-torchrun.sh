#!/usr/bin/env bash
# Usage: tools/run-under-torchrun.sh TORCHRUN BINARY [ARGS...] (ctest runs the multi-process tests through it).
# Runs BINARY as 2 processes on one node (one GPU each, LOCAL_RANK picks it).
# Exits 4 (ctest: skipped) when fewer than 2 GPUs are visible.
set -u
torchrun="$1"
binary="$2"
shift 2

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ') || gpus=0
elif command -v python3 >/dev/null 2>&1; then
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null) || gpus=0
fi
if [ "${CUDA_VISIBLE_DEVICES+set}" = set ]; then
  visible=$(printf '%s\n' "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c '[^[:space:]]')
  if [ "$visible" -lt "$gpus" ]; then gpus=$visible; fi
fi
if [ "$gpus" -lt 2 ]; then
  echo "skipped: $gpus GPU(s) visible, the multi-process NCCL test needs 2"
  exit 4
fi

# A port P with P and P+1 free: torchrun's store binds P, slime's bootstrap P+1.
port=$(python3 "$(dirname "$0")/free-port-pair.py" 2>/dev/null)
if [ -z "$port" ]; then port=$((20000 + RANDOM % 40000)); fi

# NVLink multicast stays off (shared hosts); slime never turns it on.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
echo "torchrun: 2 processes, MASTER_PORT=$port, NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
exec "$torchrun" --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$port" \
  --no-python "$binary" "$@"
