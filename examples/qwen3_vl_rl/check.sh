#!/usr/bin/env bash
# CI check of the qwen3_vl_rl example (ctest example_qwen3_vl_rl):
#   1. the default run shortened to 120 of its 200 steps (2 CPU ranks, the
#      colour task; its reward passes 0.5 by step 60, 0.6 by step 80) learns
#      (mean reward of the last 10 steps >= the first 10's + 0.1) and the
#      engine's logprobs equal the trainer's recompute at every step (0);
#   2. a short --moe --freeze-vision run (Qwen3-VL-MoE, frozen tower) does the
#      same bitwise check;
#   3. both HF exports load in transformers with equal tensors and logprobs
#      (tools/check_vl_export.py; skipped, not failed, without torch).
#   check.sh BIN WORK_DIR
set -euo pipefail
bin=$1
work=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
rm -rf "$work"
mkdir -p "$work"
fail() { echo "check.sh: $*" >&2; exit 1; }

echo "== qwen3_vl_rl (the default run, 120 steps: 2 CPU ranks)"
"$bin" --device cpu --steps 120 --out "$work/dense" | tee "$work/dense.log" | tail -n 3
grep -q "learned (>= +0.1): yes" "$work/dense.log" || fail "the default run did not learn"
grep -q "largest difference 0 over" "$work/dense.log" || fail "engine and trainer logprobs differ on the CPU"

echo "== qwen3_vl_rl --moe --freeze-vision --steps 8"
"$bin" --device cpu --moe --freeze-vision --steps 8 --out "$work/moe" | tee "$work/moe.log" | tail -n 2
grep -q "largest difference 0 over" "$work/moe.log" || fail "engine and trainer logprobs differ on the CPU (MoE)"

py=${PYTHON:-python3}
rc=0
"$py" "$here/../../tools/check_vl_export.py" --check-imports || rc=$?
if [[ $rc -eq 4 ]]; then
  echo "== HF export check skipped (no torch / transformers)"
  exit 0
fi
[[ $rc -eq 0 ]] || fail "check_vl_export.py --check-imports failed ($rc)"
for d in "$work/dense/hf" "$work/moe/hf"; do
  "$py" "$here/../../tools/check_vl_export.py" --dir "$d" || fail "$d does not load in transformers"
done
echo "check.sh: ok"
