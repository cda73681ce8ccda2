#!/usr/bin/env bash
# CI check of on-policy distillation in the RL example (CPU, 2 ranks, short):
#   1. --steps 0 exports the built-in model's initial weights (seed 1) and a
#      second, sharper random model (seed 2, --init-std 1) as HF directories.
#   2. A run whose teacher is the student's own initial weights: at step 1
#      the reverse KL to the teacher is 0 (same weights, same kernels) and
#      the loss equals a run without a teacher; after the first
#      update the student has moved, so step 2's reverse KL is not 0.
#   3. A run with the other teacher: the reverse KL is logged and non-zero
#      from step 1, and the loss differs from the run without a teacher.
#   4. Every run is true on-policy on the CPU: the engine's logprobs of the
#      sampled tokens equal the trainer's bit for bit (logprob_diff_max and
#      logprob_mismatch_fraction 0 at every step, over a non-zero count).
set -euo pipefail
bin=$1
dir=$2
rm -rf "$dir"
common=(--short --device cpu --ranks 2 --no-tensorboard --steps 2)
"$bin" --short --device cpu --ranks 2 --no-tensorboard --steps 0 --out "$dir/init"
"$bin" --short --device cpu --ranks 2 --no-tensorboard --steps 0 --seed 2 --init-std 1 --out "$dir/other"
"$bin" "${common[@]}" --no-export --out "$dir/plain"
"$bin" "${common[@]}" --no-export --teacher "$dir/init/hf" --opd-kl-coef 1 --out "$dir/self"
"$bin" "${common[@]}" --no-export --teacher "$dir/other/hf" --opd-kl-coef 0.5 --out "$dir/other_teacher"
python3 - "$dir" <<'PY'
import json, math, sys
d = sys.argv[1]
def load(name):
    return {r["step"]: r for r in map(json.loads, open(f"{d}/{name}/metrics.jsonl"))}
plain, self_t, other = load("plain"), load("self"), load("other_teacher")
for run in (plain, self_t, other):
    assert sorted(run) == [1, 2], sorted(run)
    assert "opd_reverse_kl" in run[1], "opd_reverse_kl is not logged"
assert plain[1]["opd_reverse_kl"] == 0 and plain[2]["opd_reverse_kl"] == 0
kl1, kl2 = self_t[1]["opd_reverse_kl"], self_t[2]["opd_reverse_kl"]
assert abs(kl1) < 1e-6, f"teacher = the initial student: step 1 reverse KL {kl1!r}, expected 0"
l1, l0 = self_t[1]["loss"], plain[1]["loss"]
assert abs(l1 - l0) <= 1e-6 * max(1.0, abs(l0)), f"step 1 loss {l1!r} vs {l0!r} without teacher"
assert abs(kl2) > 1e-7 and math.isfinite(kl2), f"step 2 reverse KL {kl2!r}: the student moved, expected non-zero"
ko = other[1]["opd_reverse_kl"]
assert math.isfinite(ko) and abs(ko) > 1e-4, f"another teacher: step 1 reverse KL {ko!r}, expected non-zero"
assert other[1]["loss"] != plain[1]["loss"], "the OPD term did not change the loss"
for name, run in (("plain", plain), ("self", self_t), ("other", other)):
    for step, r in run.items():
        for key in ("logprob_diff_max", "logprob_diff_mean", "logprob_mismatch_fraction"):
            assert key in r, f"{name} step {step}: {key} is not logged"
            assert r[key] == 0, f"{name} step {step}: {key} = {r[key]!r}, expected 0 (CPU engine = trainer)"
print(f"opd check: self-teacher reverse KL {kl1!r} at step 1, {kl2!r} at step 2; other teacher {ko!r} at step 1")
PY
