#!/usr/bin/env bash
# tools/gpu-sanitize.sh: compute-sanitizer memcheck and racecheck over the
# focused GPU test cases of the Hopper kernels (small shapes: racecheck is
# slow). Run on the GPU machine after tools/gpu-test.sh has built build/gpu:
#
#   tools/gpu-sanitize.sh        # logs in ${OUT:-build/gpu/out}/sanitize-*.log
#
# For the whole GPU suite (every test case of the gpu label, memcheck or
# racecheck, several at a time) see tools/gpu-sanitize-suite.py.
#
# Prints one line per (case, tool) with the sanitizer's error summary; exits
# non-zero if any run failed, timed out or reported an error.
set -uo pipefail
BUILD=${BUILD:-build/gpu}
OUT_DIR=${OUT:-$BUILD/out}
mkdir -p "$OUT_DIR"
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# "test binary|test case name[|VAR=value ...]" (the variables set for that run)
CASES=(
  "test_ops_grouped_gemm_gpu|grouped GEMM Hopper kernels on ragged partial tiles"
  "test_ops_batch_invariant_gpu|a plain GEMM on Hopper: tile width and K split leave the bits unchanged|SLIME_GEMM_K_CHUNKS=1 SLIME_GEMM_CLUSTER_K=1"
  "test_ops_attention_gpu|attention on CUDA: the deterministic backward gives the same dq bits every run"
  "test_ops_attention_gpu|attention on CUDA: the mma.sync and the Hopper (sm90) kernels each match the CPU reference"
)
failed=0
for entry in "${CASES[@]}"; do
  IFS='|' read -r bin name vars <<<"$entry"
  for tool in memcheck racecheck; do
    log="$OUT_DIR/sanitize-$bin-$tool${vars:+-env}.log"
    # shellcheck disable=SC2086  # vars: VAR=value words for env
    timeout "${SLIME_SANITIZE_TIMEOUT_S:-240}" env $vars "$CS" --tool "$tool" --error-exitcode 9 "$BUILD/tests/$bin" \
      "$name" >"$log" 2>&1
    rc=$?
    echo "$tool  $bin: '$name'${vars:+ ($vars)}: rc=$rc; $(grep -m1 'SUMMARY' "$log" || echo 'no summary')"
    ((rc != 0)) && failed=1
  done
done
exit $failed
