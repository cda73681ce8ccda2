#!/usr/bin/env bash
# tools/bench-ab.sh: benchmark this tree against a baseline tree in the same
# run on the GPU machine, each beside its PyTorch baseline.
#
#   BASE=<dir with the baseline sources> tools/bench-ab.sh fsdp moe rollout
#
# (e.g. `git archive <commit> | tar -x -C .base` before the call, with .base
# ignored by git and carried). Builds bench_<family> of both trees (Release,
# sm_90a, in parallel), runs them alternately (base, head, then head, base: ROUNDS,
# default 2) so drift of the machine hits both, runs each family's PyTorch
# baseline once, and prints per benchmark the median time of each tree over
# the rounds, head / base, and torch / slime for both (> 1: slime faster).
# JSON and logs go to ${OUT:-build/ab}. BENCH_ARGS (e.g. a
# --benchmark_filter) go to every benchmark binary; PIN=<cpu list> runs them
# under taskset (host-bound benchmarks, e.g. batch-1 decode, vary less when
# the process does not migrate between cores).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

: "${BASE:?set BASE to the baseline source tree}"
BASE=$(cd "$BASE" && pwd)
OUT_DIR=${OUT:-build/ab}
ROUNDS=${ROUNDS:-2}
JOBS=$(nproc 2>/dev/null || echo 8)
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
families=("$@")
((${#families[@]})) || families=(fsdp moe rollout)
targets=()
for f in "${families[@]}"; do targets+=("bench_$f"); done

build() {  # build SRC DIR: configure and build the benchmark targets
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSLIME_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DSLIME_BUILD_TESTS=OFF -DSLIME_BUILD_EXAMPLES=OFF >"$OUT_DIR/configure-$3.log" 2>&1 &&
    cmake --build "$2" -j $((JOBS / 2)) --target "${targets[@]}" >"$OUT_DIR/build-$3.log" 2>&1
}
t0=$SECONDS
build . build/ab-head head &
head_pid=$!
build "$BASE" "$BASE/build/ab-base" base &
base_pid=$!
wait $head_pid || { echo "head build failed:"; tail -n 30 "$OUT_DIR/build-head.log"; exit 1; }
wait $base_pid || { echo "base build failed:"; tail -n 30 "$OUT_DIR/build-base.log"; exit 1; }
echo "built both trees in $((SECONDS - t0)) s"

# Every run gets at most CAP_S seconds and none starts past BUDGET_S (whole
# script): round 1 of every family first, then the PyTorch baselines, then the
# remaining rounds, so a short budget still gives one comparison.
CAP_S=${CAP_S:-120}
BUDGET_S=${BUDGET_S:-540}
left() { echo $((BUDGET_S - SECONDS)); }
limit() { local l; l=$(left); echo $((l < CAP_S ? l : CAP_S)); }
run_round() {
  local r=$1 f side dir json t lim
  local sides=(base head)
  ((r % 2 == 0)) && sides=(head base)  # alternate who runs first: drift of the machine within a round cancels
  for f in "${families[@]}"; do
    for side in "${sides[@]}"; do
      lim=$(limit)
      if ((lim < 10)); then echo "round $r $f $side: not run (out of time)"; continue; fi
      dir=$PWD/build/ab-head
      [[ $side == base ]] && dir=$BASE/build/ab-base
      json="$OUT_DIR/${side}_${f}_$r.json"
      t=$SECONDS
      (cd "$([[ $side == base ]] && echo "$BASE" || echo .)" &&
        timeout "$lim" ${PIN:+taskset -c "$PIN"} "$dir/bench/bench_$f" ${BENCH_ARGS:-} --benchmark_out="$json" \
          --benchmark_out_format=json) \
        >"$OUT_DIR/${side}_${f}_$r.log" 2>&1 || echo "bench_$f ($side, round $r) failed or timed out: $OUT_DIR/${side}_${f}_$r.log"
      echo "round $r $f $side: $((SECONDS - t)) s"
    done
  done
}
torch_baselines() {
  local f lim
  for f in "${families[@]}"; do
    lim=$(limit)
    ((lim < 10)) && { echo "torch $f: not run (out of time)"; continue; }
    if [[ $f == fsdp ]]; then
      timeout "$lim" python3 bench/torch_fsdp2.py --out "$OUT_DIR/torch_fsdp.json" >"$OUT_DIR/torch_fsdp.log" 2>&1 ||
        echo "torch_fsdp2 failed: $OUT_DIR/torch_fsdp.log"
    elif [[ -f bench/torch_$f.py ]]; then
      timeout "$lim" python3 "bench/torch_$f.py" --out "$OUT_DIR/torch_$f.json" >"$OUT_DIR/torch_$f.log" 2>&1 ||
        echo "torch_$f failed: $OUT_DIR/torch_$f.log"
    fi
  done
}
run_round 1
torch_baselines
for ((r = 2; r <= ROUNDS; ++r)); do run_round "$r"; done
last=1
for ((r = ROUNDS; r >= 1; --r)); do [[ -f $OUT_DIR/head_${families[0]}_$r.json ]] && { last=$r; break; }; done

for f in "${families[@]}"; do
  echo "==== $f: torch beside head (round $last)"
  if [[ $f == fsdp ]]; then
    python3 bench/torch_fsdp2.py --table --slime "$OUT_DIR/head_fsdp_$last.json" --out "$OUT_DIR/torch_fsdp.json"
    echo "==== $f: torch beside base (round $last)"
    python3 bench/torch_fsdp2.py --table --slime "$OUT_DIR/base_fsdp_$last.json" --out "$OUT_DIR/torch_fsdp.json"
  elif [[ -f $OUT_DIR/torch_$f.json ]]; then
    python3 bench/compare_ops.py --slime "$OUT_DIR/head_${f}_$last.json" --torch "$OUT_DIR/torch_$f.json"
    echo "==== $f: torch beside base (round $last)"
    python3 bench/compare_ops.py --slime "$OUT_DIR/base_${f}_$last.json" --torch "$OUT_DIR/torch_$f.json"
  fi
done

echo "==== head / base, median real time over $ROUNDS rounds (< 1: head faster)"
python3 - "$OUT_DIR" "$ROUNDS" "${families[@]}" <<'EOF'
import json, statistics, sys
out, rounds, fams = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def times(path):
    try:
        rows = [b for b in json.load(open(path))["benchmarks"] if not b.get("error_occurred")]
    except Exception:
        return {}
    out = {}
    for b in rows:  # plain runs, or the median of repeated ones (--benchmark_repetitions)
        if b.get("run_type", "iteration") == "iteration":
            out.setdefault(b["name"], b["real_time"])
        elif b.get("aggregate_name") == "median":
            out[b["name"][: -len("_median")]] = b["real_time"]
    return out
print(f"{'benchmark':64s} {'base':>12s} {'head':>12s} {'head/base':>9s}")
for f in fams:
    base = [times(f"{out}/base_{f}_{r}.json") for r in range(1, rounds + 1)]
    head = [times(f"{out}/head_{f}_{r}.json") for r in range(1, rounds + 1)]
    for name in sorted(set().union(*head) if head else []):
        b = [t[name] for t in base if name in t]
        h = [t[name] for t in head if name in t]
        if not b or not h:
            print(f"{name[:64]:64s} {'-':>12s} {statistics.median(h):12.1f} {'(new)':>9s}")
            continue
        mb, mh = statistics.median(b), statistics.median(h)
        ratio = f"{mh / mb:9.3f}" if mb > 0 else f"{'-':>9s}"
        print(f"{name[:64]:64s} {mb:12.1f} {mh:12.1f} {ratio}")
EOF

# One archive of every JSON and log (the GPU machine returns few files).
tar -czf "$OUT_DIR/../bench-ab.tgz" -C "$OUT_DIR" . && mv "$OUT_DIR/../bench-ab.tgz" "$OUT_DIR/"
