#!/usr/bin/env bash
# The Hugging Face exports of the examples load back in transformers with equal
# weights and equal per-token logprobs (tools/check_hf_export.py).
#
#   tools/check_hf_export.sh BUILD_DIR [WORK_DIR]
#   tools/check_hf_export.sh --logprobs BIN --rl BIN --sft BIN --work DIR   (ctest's form)
#
# Runs the RL example (qwen3_moe_rl: built-in tiny Qwen3-MoE, 6 short steps with --ep 2 on
# 2 CPU ranks; its export is WORK/rl/hf) and the SFT example (sft_qwen3:
# built-in tiny dense Qwen3, 4 short steps on 2 CPU ranks, --export-hf
# WORK/sft_hf), then checks both directories against transformers and
# slime-logprobs. Exits 4 (skipped) before running anything when python
# ($PYTHON, default python3) cannot import torch and transformers, 1 when a
# check fails.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${PYTHON:-python3}
logprobs= rl= sft= work=
if [[ $# -ge 1 && $1 != --* ]]; then
  build=$1
  logprobs=$build/tools/slime-logprobs
  rl=$build/examples/qwen3_moe_rl
  sft=$build/examples/sft_qwen3
  work=${2:-$build/check_hf_export}
else
  while [[ $# -gt 0 ]]; do
    case $1 in
      --logprobs) logprobs=$2 ;;
      --rl) rl=$2 ;;
      --sft) sft=$2 ;;
      --work) work=$2 ;;
      *) echo "check_hf_export.sh: unknown argument '$1'" >&2; exit 2 ;;
    esac
    shift 2
  done
fi
for b in "$logprobs" "$rl" "$sft"; do
  [[ -n $b && -x $b ]] || { echo "check_hf_export.sh: '$b' is not an executable (see the usage)" >&2; exit 2; }
done
[[ -n $work ]] || { echo "check_hf_export.sh: no work directory" >&2; exit 2; }

rc=0
"$py" "$here/check_hf_export.py" --check-imports || rc=$?
[[ $rc -eq 0 ]] || exit "$rc"  # 4: skipped

rm -rf "$work"
mkdir -p "$work"
echo "== qwen3_moe_rl --short (2 CPU ranks, expert parallel 2: the export gathers the experts), export to $work/rl/hf"
"$rl" --short --device cpu --ranks 2 --ep 2 --no-tensorboard --out "$work/rl" > "$work/rl.log" 2>&1 ||
  { tail -n 30 "$work/rl.log"; echo "check_hf_export.sh: qwen3_moe_rl failed" >&2; exit 1; }
echo "== sft_qwen3 --short --steps 4 (2 CPU ranks), export to $work/sft_hf"
"$sft" --short --steps 4 --device cpu --ranks 2 --export-hf "$work/sft_hf" > "$work/sft.log" 2>&1 ||
  { tail -n 30 "$work/sft.log"; echo "check_hf_export.sh: sft_qwen3 failed" >&2; exit 1; }

status=0
for d in "$work/rl/hf" "$work/sft_hf"; do
  "$py" "$here/check_hf_export.py" --dir "$d" --slime-logprobs "$logprobs" || status=1
done
exit "$status"
