#!/usr/bin/env bash
# tools/gpu-decode-gemm.sh: the batch-invariant mode's decode GEMMs on the GPU
# machine in one call (issue 20): build, check the bits, time the GEMMs and
# the mode's cost per decode step, for each setting of the plain GEMM's K
# chunks and cluster K split. Run from the repository root:
#
#   tools/gpu-decode-gemm.sh          # logs and JSON in ${OUT:-build/gpu/decode-gemm}
#
# Settings: "off" (the default: one accumulator), "chunks"
# (SLIME_GEMM_K_CHUNKS=1: chunks side by side in one CTA) and "cluster"
# (SLIME_GEMM_K_CHUNKS=1 SLIME_GEMM_CLUSTER_K=1: the cluster K split). Steps:
#   1. test_ops_batch_invariant_gpu and the bitwise rollout cases of
#      test_rollout_gpu under each setting (the same bits whatever the rows);
#   2. bench_linear's decode rows (1, 32, 256 rows of the rollout config's
#      projections) under each setting, cuBLAS beside them; a table of
#      graph_us (GPU µs per call of a CUDA-graph replay);
#   3. bench_rollout's mode_cost rows (the mode against the default, paired)
#      under each setting.
# Every step runs under a deadline (SLIME_DECODE_GEMM_BUDGET_S, default 420 s
# for all); a failed step is reported and the script goes on; it exits
# non-zero if any failed.
set -uo pipefail
OUT_DIR=${OUT:-build/gpu/decode-gemm}
BUDGET_S=${SLIME_DECODE_GEMM_BUDGET_S:-420}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
T0=$SECONDS
failed=0
left() { echo $((BUDGET_S - (SECONDS - T0))); }
# run NAME CAP CMD...: CMD under min(CAP, what is left), its output in NAME.log.
run() {
  local name=$1 cap=$2
  shift 2
  local t=$(($(left) < cap ? $(left) : cap))
  if ((t <= 5)); then
    echo "$name: skipped (out of time)"
    failed=1
    return
  fi
  timeout "$t" "$@" >"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc ($((SECONDS - T0)) s) $(grep -m1 -E 'All tests passed|test cases:' "$OUT_DIR/$name.log")"
  ((rc != 0)) && failed=1
}
declare -A SETTING=([off]="SLIME_GEMM_K_CHUNKS=0" [chunks]="SLIME_GEMM_K_CHUNKS=1"
  [cluster]="SLIME_GEMM_K_CHUNKS=1 SLIME_GEMM_CLUSTER_K=1")
SETTINGS=(off chunks cluster)

SLIME_GPU_TEST_TARGETS="test_ops_batch_invariant_gpu test_rollout_gpu bench_linear bench_rollout" \
  SLIME_GPU_TEST_TESTS=none SLIME_GPU_TEST_BENCH=none OUT="$OUT_DIR/build" tools/gpu-test.sh >"$OUT_DIR/build.log" 2>&1 ||
  { echo "build failed: $OUT_DIR/build.log"; exit 1; }
echo "build: $((SECONDS - T0)) s"
rollout_test=$(find build/gpu -name test_rollout_gpu -type f | head -n1)
for s in "${SETTINGS[@]}"; do
  # shellcheck disable=SC2086  # the setting's VAR=value words
  run "bits-$s" 90 env ${SETTING[$s]} build/gpu/tests/test_ops_batch_invariant_gpu
  # shellcheck disable=SC2086
  run "rollout-bits-$s" 90 env ${SETTING[$s]} "$rollout_test" "CUDA engine in the batch-invariant mode*"
done
for s in "${SETTINGS[@]}"; do
  filter='linear/decode/.*/batch_invariant'
  [[ $s == off ]] && filter='linear/decode/'  # cuBLAS rows once
  # shellcheck disable=SC2086
  run "linear-$s" 90 env ${SETTING[$s]} build/gpu/bench/bench_linear --benchmark_filter="$filter" \
    --benchmark_out="$OUT_DIR/linear-$s.json" --benchmark_out_format=json
done
python3 tools/decode_gemm_table.py "$OUT_DIR"/linear-{off,chunks,cluster}.json
for s in "${SETTINGS[@]}"; do
  # shellcheck disable=SC2086
  run "mode-cost-$s" 90 env ${SETTING[$s]} build/gpu/bench/bench_rollout --benchmark_filter=mode_cost \
    --benchmark_out="$OUT_DIR/mode-cost-$s.json" --benchmark_out_format=json
done
python3 tools/decode_gemm_table.py --counter cost_pct "$OUT_DIR"/mode-cost-{off,chunks,cluster}.json
echo "done in $((SECONDS - T0)) s"
exit $failed
