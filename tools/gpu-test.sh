#!/usr/bin/env bash
# tools/gpu-test.sh: build, test and benchmark slime on the GPU machine (H200,
# CUDA 13, 1 or 2 GPUs). Run from the repository root:
#
#   tools/gpu-test.sh            # logs and JSON in ${OUT:-build/gpu/out}
#
# Steps: configure build/gpu (Release, CUDA on, sm_90a), build with every core,
# run all ctest tests (the CPU ones too), run the `gpu` and `multi_gpu` labels
# again for their own summaries, and with 2 GPUs run the NCCL collective
# benchmark, the PyTorch baseline and their comparison; then each op family's
# benchmark beside its baseline (the FSDP one on 1 and 2 GPUs, torch under
# torchrun: fsdp_baseline). A failed step is
# recorded and the script goes on; it exits non-zero if any step failed. Every
# step runs under a deadline so that the whole script ends within about
# 8 minutes (SLIME_GPU_TEST_BUDGET_S, default 470 seconds, for all steps). The
# last thing printed is the summary: each step, tests passed/failed/skipped per
# label, and the bandwidth table.
#
# Selection (to spend scarce GPU time where it is needed):
#   SLIME_GPU_TEST_BENCH=none     build and tests only
#   SLIME_GPU_TEST_BENCH=a,b      only these benchmark families (bench/<family>.cmake;
#                                 "collectives" for the NCCL one); default: all
#                                 but the opt-in ones (BENCH_OPT_IN: they run only
#                                 when named: context_parallel, whose length
#                                 search alone takes up to a minute)
#   SLIME_GPU_TEST_TESTS=none     skip the ctest steps (benchmarks only)
#   SLIME_GPU_TEST_TESTS=gpu      only the gpu and multi_gpu labels (once, all GPUs)
#   SLIME_GPU_TEST_TESTS=re:REGEX only the tests whose names match REGEX (ctest -R)
#   SLIME_GPU_TEST_TARGETS="a b"  build only these targets (default: everything);
#                                 for a kernel's edit-build-measure loop
#
# NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 for every step (slime
# never enables it; on shared hosts a program using it can take the GPUs out
# of service), and likewise PyTorch's and NVSHMEM's multicast.
set -uo pipefail

export NCCL_NVLS_ENABLE=0
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

BUILD=build/gpu
OUT_DIR=${OUT:-$BUILD/out}
BUDGET_S=${SLIME_GPU_TEST_BUDGET_S:-470}
JOBS=$(nproc 2>/dev/null || echo 8)
BENCH_SEL=${SLIME_GPU_TEST_BENCH:-all}
TESTS_SEL=${SLIME_GPU_TEST_TESTS:-all}
# Families "all" leaves out (their time would take the others' budget), and
# the step caps of families that need more than the default 90 s.
BENCH_OPT_IN=",context_parallel,"
bench_cap() {
  case $1 in
    context_parallel) echo 180 ;;
    # 10 rows up to 5.2e13 FLOP a call, after building a 407M-parameter tower
    # and the small tower's CPU f32 reference check.
    vision_tower) echo 150 ;;
    # 6 shapes x 3 passes x 9 rows (every tile, cuBLAS, the dense reference).
    grouped_gemm) echo 150 ;;
    # 3 repetitions x (warm-up + 20 timed steps) per row, each building its model.
    fsdp) echo 150 ;;
    # fwd, bwd and fwd+bwd over every shape of bench/torch_attention.py, both
    # backward modes; 90 s was too short on an H100.
    attention) echo 150 ;;
    *) echo 90 ;;
  esac
}
# bench_wanted FAMILY: true when the selection includes it.
bench_wanted() {
  [[ $BENCH_SEL == none ]] && return 1
  [[ $BENCH_SEL == all && $BENCH_OPT_IN != *",$1,"* ]] && return 0
  [[ ",$BENCH_SEL," == *",$1,"* ]]
}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
START=$SECONDS

step_names=()
step_results=()
step_secs=()
failed=0

# step NAME CAP_SECONDS COMMAND...: runs COMMAND with its output in
# $OUT_DIR/NAME.log (and the last lines on screen when it fails), for at most
# CAP_SECONDS and never past the overall budget.
step() {
  local name=$1 cap=$2
  shift 2
  local left=$((BUDGET_S - (SECONDS - START)))
  local limit=$((cap < left ? cap : left))
  local log="$OUT_DIR/$name.log"
  if ((limit < 15)); then
    echo "== $name: not run, out of time"
    step_names+=("$name"); step_results+=("NOT RUN (out of time)"); step_secs+=(0)
    failed=1
    return 1
  fi
  echo "== $name (limit ${limit}s, log $log)"
  local t0=$SECONDS rc
  timeout --kill-after=15 "$limit" "$@" >"$log" 2>&1
  rc=$?
  local took=$((SECONDS - t0)) result
  if ((rc == 0)); then
    result="ok"
  elif ((rc == 124 || rc == 137)); then
    result="FAILED (timed out after ${limit}s)"
  else
    result="FAILED (exit $rc)"
  fi
  step_names+=("$name"); step_results+=("$result"); step_secs+=("$took")
  echo "   $result in ${took}s"
  if [[ $result != ok ]]; then
    failed=1
    tail -n 40 "$log" | sed 's/^/   | /'
    return 1
  fi
  return 0
}

skip_step() {  # skip_step NAME REASON
  echo "== $1: skipped ($2)"
  step_names+=("$1"); step_results+=("skipped ($2)"); step_secs+=(0)
}

gpu_count() {
  local n=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ') || n=0
  fi
  if ((n == 0)) && command -v python3 >/dev/null 2>&1; then
    n=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null) || n=0
  fi
  echo "${n:-0}"
}

# A port P with P and P+1 free (torchrun's store on P, slime's bootstrap on P+1).
free_port_pair() {
  python3 tools/free-port-pair.py 2>/dev/null || echo $((20000 + RANDOM % 40000))
}

GPUS=$(gpu_count)
{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(hostname)"
  echo "gpus: $GPUS"
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi topo -m
  nvcc --version 2>&1 | tail -n 2
  cmake --version | head -n 1
  python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())' 2>&1
  ls /usr/lib/x86_64-linux-gnu/libnccl.so* 2>/dev/null
  echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
} >"$OUT_DIR/environment.txt" 2>&1
echo "slime gpu-test: $GPUS GPU(s), $JOBS cores, budget ${BUDGET_S}s, output in $OUT_DIR"

# ---- configure and build --------------------------------------------------------
step configure 120 cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSLIME_ENABLE_CUDA=ON \
  -DSLIME_BUILD_GPU_TESTS=ON -DCMAKE_CUDA_ARCHITECTURES=90a
# -k 0: build every target that can be built, so one broken file does not
# keep the other tests from running.
if [[ -n ${SLIME_GPU_TEST_TARGETS:-} ]]; then
  # shellcheck disable=SC2086 # a space-separated list of targets
  step build 300 cmake --build "$BUILD" -j "$JOBS" --target $SLIME_GPU_TEST_TARGETS -- -k 0
else
  step build 300 cmake --build "$BUILD" -j "$JOBS" -- -k 0
fi

# ---- tests ----------------------------------------------------------------------
if [[ $TESTS_SEL == all ]]; then
# ctest's JUnit files carry each test's labels; summarize() counts them.
step ctest-all 240 ctest --test-dir "$BUILD" --output-on-failure --no-tests=error -j 4 \
  --output-junit "$OUT_DIR/ctest-all.xml"
fi
if [[ $TESTS_SEL == re:* ]]; then
step ctest-selected 240 ctest --test-dir "$BUILD" --output-on-failure --no-tests=error -R "${TESTS_SEL#re:}" \
  --output-junit "$OUT_DIR/ctest-selected.xml"
elif [[ $TESTS_SEL != none ]]; then
step ctest-gpu 150 ctest --test-dir "$BUILD" --output-on-failure --no-tests=error -j 4 -L '^gpu$' \
  --output-junit "$OUT_DIR/ctest-gpu.xml"
# The gpu tests once more on a single GPU, as a one-GPU machine sees them.
if ((GPUS >= 2)) && [[ $TESTS_SEL == all ]]; then
  step ctest-gpu-1dev 150 env CUDA_VISIBLE_DEVICES=0 ctest --test-dir "$BUILD" --output-on-failure --no-tests=error \
    -j 4 -L '^gpu$' --output-junit "$OUT_DIR/ctest-gpu-1dev.xml"
fi
step ctest-multi_gpu 120 ctest --test-dir "$BUILD" --output-on-failure --no-tests=error -L '^multi_gpu$' \
  --output-junit "$OUT_DIR/ctest-multi_gpu.xml"
fi

# ---- benchmarks -----------------------------------------------------------------
BENCH="$BUILD/bench/bench_collectives"
if ! bench_wanted collectives; then
  skip_step bench-collectives "not selected"
elif ((GPUS < 2)); then
  skip_step bench-collectives "needs 2 GPUs, found $GPUS"
  skip_step bench-torch "needs 2 GPUs, found $GPUS"
  skip_step bench-compare "needs 2 GPUs"
else
  if [[ -x $BENCH ]]; then
    step bench-collectives 150 "$BENCH" --benchmark_out="$OUT_DIR/bench_collectives.json" \
      --benchmark_out_format=json
  else
    skip_step bench-collectives "$BENCH was not built"
    failed=1
  fi
  if command -v torchrun >/dev/null 2>&1; then
    TORCHRUN=(torchrun)
  else
    TORCHRUN=(python3 -m torch.distributed.run)
  fi
  PORT=$(free_port_pair)
  step bench-torch 150 "${TORCHRUN[@]}" --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 \
    --master-port "$PORT" bench/torch_collectives.py --out "$OUT_DIR/torch_collectives.json"
  step bench-compare 30 python3 bench/compare_collectives.py --slime "$OUT_DIR/bench_collectives.json" \
    --torch "$OUT_DIR/torch_collectives.json"
fi

# ---- FSDP baseline: PyTorch FSDP2 on 1 GPU (a process group of one), then on 2
# under torchrun (appending to the same JSON), then the table beside bench_fsdp.
fsdp_baseline() {
  local json="$OUT_DIR/torch_fsdp.json" runner=(torchrun)
  command -v torchrun >/dev/null 2>&1 || runner=(python3 -m torch.distributed.run)
  rm -f "$json"
  step torch-fsdp2-gpus1 150 python3 bench/torch_fsdp2.py --out "$json"
  if ((GPUS >= 2)); then
    step torch-fsdp2-gpus2 150 "${runner[@]}" --nnodes 1 --nproc-per-node 2 --master-addr 127.0.0.1 \
      --master-port "$(free_port_pair)" bench/torch_fsdp2.py --append --out "$json"
  else
    skip_step torch-fsdp2-gpus2 "needs 2 GPUs, found $GPUS"
  fi
  step compare-fsdp 30 python3 bench/torch_fsdp2.py --table --slime "$OUT_DIR/bench_fsdp.json" --out "$json"
}

# ---- op benchmarks: bench_<family> (Google Benchmark) beside bench/torch_<family>.py
for list in bench/*.cmake; do
  family=$(basename "$list" .cmake)
  bench_wanted "$family" || continue
  bin="$BUILD/bench/bench_$family"
  if [[ ! -x $bin ]]; then
    skip_step "bench-$family" "$bin was not built"
    failed=1
    continue
  fi
  step "bench-$family" "$(bench_cap "$family")" "$bin" --benchmark_out="$OUT_DIR/bench_$family.json" \
    --benchmark_out_format=json
  if [[ $family == fsdp ]]; then
    fsdp_baseline  # its baseline needs 2 processes (torchrun), not one python3
    continue
  fi
  if [[ -f bench/torch_$family.py ]]; then
    step "torch-$family" 90 python3 "bench/torch_$family.py" --out "$OUT_DIR/torch_$family.json"
    step "compare-$family" 30 python3 bench/compare_ops.py --slime "$OUT_DIR/bench_$family.json" \
      --torch "$OUT_DIR/torch_$family.json"
  fi
done

# ---- summary ----------------------------------------------------------------------
summarize() {
  python3 - "$OUT_DIR" <<'PY'
import os, sys, xml.etree.ElementTree as ET
out = sys.argv[1]
rows = []
for run in ("all", "gpu", "gpu-1dev", "multi_gpu"):
    path = os.path.join(out, f"ctest-{run}.xml")
    if not os.path.exists(path):
        rows.append((f"ctest -L {run}" if run != "all" else "ctest (all)", "all", None))
        continue
    try:
        cases = ET.parse(path).getroot().iter("testcase")
    except ET.ParseError as e:
        rows.append((f"ctest {run}", "all", f"unreadable: {e}"))
        continue
    counts = {}
    for case in cases:
        labels = []
        for prop in case.iter("property"):
            if prop.get("name") == "cmake_labels":
                labels = [l for l in (prop.get("value") or "").split(";") if l]
        status = case.get("status", "")
        kind = "passed" if status == "run" else "skipped" if status in ("notrun", "disabled") else "failed"
        if status == "notrun" and case.find("skipped") is None:
            kind = "failed"  # not run for another reason (e.g. not built)
        where = ["(total)"] + (["gpu"] if "gpu" in labels else []) + (["multi_gpu"] if "multi_gpu" in labels else [])
        if not any(l in ("gpu", "multi_gpu") for l in labels):
            where.append("cpu")
        for w in where:
            c = counts.setdefault(w, {"passed": 0, "failed": 0, "skipped": 0})
            c[kind] += 1
    name = "ctest (all)" if run == "all" else f"ctest -L {run}"
    if not counts:
        rows.append((name, run, "no tests"))
    for label in ("(total)", "cpu", "gpu", "multi_gpu"):
        if label in counts:
            rows.append((name, label, counts[label]))
print(f"{'run':<18} {'label':<10} {'passed':>7} {'failed':>7} {'skipped':>8}")
for name, label, c in rows:
    if c is None:
        print(f"{name:<18} {label:<10} {'(no result)':>24}")
    elif isinstance(c, str):
        print(f"{name:<18} {label:<10} {c}")
    else:
        print(f"{name:<18} {label:<10} {c['passed']:>7} {c['failed']:>7} {c['skipped']:>8}")
PY
}

{
  echo
  echo "================ slime gpu-test summary ================"
  echo "GPUs: $GPUS   total time: $((SECONDS - START))s   output: $OUT_DIR"
  echo
  printf '%-18s %-40s %6s\n' step result seconds
  for i in "${!step_names[@]}"; do
    printf '%-18s %-40s %6s\n' "${step_names[$i]}" "${step_results[$i]}" "${step_secs[$i]}"
  done
  echo
  summarize 2>&1 || echo "(test summary unavailable)"
  for log in "$OUT_DIR"/bench-compare.log "$OUT_DIR"/compare-*.log; do
    if [[ -f $log ]]; then
      echo
      cat "$log"
    fi
  done
  echo
  if ((failed)); then echo "RESULT: FAILED (see the logs above)"; else echo "RESULT: OK"; fi
} | tee "$OUT_DIR/summary.txt"
exit $failed
