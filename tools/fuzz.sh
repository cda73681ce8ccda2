#!/usr/bin/env bash
# Fuzzes the readers of user files with libFuzzer (tests/fuzz): configures a separate clang build
# (build/fuzz, SLIME_BUILD_FUZZERS=ON, ASan + UBSan), builds the harnesses, replays every seed
# corpus (tests/fuzz/corpus/<harness>/), then fuzzes each harness for SECONDS (default 60).
# Fails on any finding: a crash, a sanitizer report, a leak, a timeout, or an exception other
# than slime::Error. Findings are written to build/fuzz/findings/<harness>-*; inputs the fuzzer
# finds interesting go to build/fuzz/corpus/<harness>/, never into the repository.
#   tools/fuzz.sh [SECONDS]        SLIME_FUZZ_JOBS (default 2): build and fuzzing parallelism
#   SLIME_FUZZ_HARNESSES="config jsonl": a subset
set -euo pipefail
seconds=${1:-60}
root=$(cd "$(dirname "$0")/.." && pwd)
build=${SLIME_FUZZ_BUILD_DIR:-$root/build/fuzz}
harnesses=(${SLIME_FUZZ_HARNESSES:-safetensors config jsonl token_file train_state})
command -v clang++ >/dev/null || { echo "tools/fuzz.sh: clang++ is needed (Debian: apt-get install clang)" >&2; exit 2; }

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_CXX_COMPILER=clang++ \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSLIME_ENABLE_CUDA=OFF -DSLIME_WITH_IMAGES=OFF -DSLIME_BUILD_TESTS=OFF \
  -DSLIME_BUILD_BENCHMARKS=OFF -DSLIME_BUILD_EXAMPLES=OFF -DSLIME_BUILD_TOOLS=OFF -DSLIME_BUILD_FUZZERS=ON >/dev/null
cmake --build "$build" -j "${SLIME_FUZZ_JOBS:-2}" --target "${harnesses[@]/#/fuzz_}"

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
mkdir -p "$build/findings"
# One harness: replay its seeds (files as arguments run each exactly once), then fuzz.
fuzz_one() {
  local h=$1 bin=$build/tests/fuzz/fuzz_$1 seeds=$root/tests/fuzz/corpus/$1 work=$build/corpus/$1
  mkdir -p "$work"
  if ! "$bin" -artifact_prefix="$build/findings/$h-" "$seeds"/* >"$build/findings/$h-replay.log" 2>&1; then
    tail -40 "$build/findings/$h-replay.log"
    echo "tools/fuzz.sh: $h: a seed input fails (see $build/findings/)" >&2
    return 1
  fi
  if ((seconds == 0)); then
    echo "fuzz_$h: $(ls "$seeds" | wc -l) seeds replayed, no finding"
    return 0
  fi
  if ! "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=16384 -print_final_stats=1 \
    -artifact_prefix="$build/findings/$h-" "$work" "$seeds" >"$build/findings/$h.log" 2>&1; then
    tail -60 "$build/findings/$h.log"
    echo "tools/fuzz.sh: $h: finding (see $build/findings/)" >&2
    return 1
  fi
  echo "fuzz_$h: $(grep -m1 'stat::number_of_executed_units' "$build/findings/$h.log" | awk '{print $2}')" \
    "executions in $seconds s, no finding"
}

# SLIME_FUZZ_JOBS harnesses at a time (default 2: the 2-core CI machine); 5 harnesses of 60 s
# take about 3 minutes after the build.
jobs=${SLIME_FUZZ_JOBS:-2}
failed=0
running=0
for h in "${harnesses[@]}"; do
  if ((running >= jobs)); then
    wait -n || failed=1
    running=$((running - 1))
  fi
  fuzz_one "$h" &
  running=$((running + 1))
done
while ((running > 0)); do
  wait -n || failed=1
  running=$((running - 1))
done
if ((failed)); then
  echo "tools/fuzz.sh: FAILED" >&2
  exit 1
fi
echo "tools/fuzz.sh: ${#harnesses[@]} harnesses, no finding"
