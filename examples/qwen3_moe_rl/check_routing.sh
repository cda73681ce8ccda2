#!/usr/bin/env bash
# CI check of rollout routing (--routing) in the RL example (CPU, 2 ranks,
# the built-in Qwen3-MoE):
#   1. --routing measure: the engine records each input token's experts and
#      the trainer compares its router's choice with them. On the CPU the
#      engine runs the trainer's kernels on the trainer's weights, so
#      routing_agreement is 1 at every step; recording changes nothing else
#      (the losses equal a run without it, bit for bit).
#   2. --routing replay: the trainer routes every token to the engine's
#      experts. They are its own choice here, so the losses equal the plain
#      run bit for bit: a row of the replay laid out against the wrong token
#      would route it elsewhere and change them. The same with --ep 2 (the
#      replayed experts cross the expert-parallel all-to-all) and with --cp 2
#      (each cp rank replays its rows of the sequences), and under --rollout
#      disaggregated (the routing crosses ranks with the completions).
#   3. Every run is on-policy: logprob_diff_max is 0 at every step.
#   4. --routing on a dense model and an unknown mode are clear errors.
set -euo pipefail
bin=$1
dir=$2
rm -rf "$dir"
common=(--short --device cpu --ranks 2 --no-tensorboard --no-export --steps 3)
"$bin" "${common[@]}" --out "$dir/plain" > /dev/null
"$bin" "${common[@]}" --routing measure --out "$dir/measure" > /dev/null
"$bin" "${common[@]}" --routing replay --out "$dir/replay" > /dev/null
"$bin" "${common[@]}" --ep 2 --out "$dir/plain_ep2" > /dev/null
"$bin" "${common[@]}" --ep 2 --routing replay --out "$dir/replay_ep2" > /dev/null
"$bin" "${common[@]}" --cp 2 --out "$dir/plain_cp2" > /dev/null
"$bin" "${common[@]}" --cp 2 --routing replay --out "$dir/replay_cp2" > /dev/null
"$bin" "${common[@]}" --cp 2 --routing measure --out "$dir/measure_cp2" > /dev/null
# Disaggregated: 2 trainer ranks and an engine rank; the routing crosses ranks with the completions.
dis=(--short --device cpu --ranks 3 --rollout disaggregated --no-tensorboard --no-export --steps 3)
"$bin" "${dis[@]}" --routing replay --out "$dir/replay_dis" > /dev/null
"$bin" "${dis[@]}" --routing measure --out "$dir/measure_dis" > /dev/null
python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
def load(name):
    return {r["step"]: r for r in map(json.loads, open(f"{d}/{name}/metrics.jsonl"))}
runs = {n: load(n) for n in ("plain", "measure", "replay", "plain_ep2", "replay_ep2", "plain_cp2", "replay_cp2",
                             "measure_cp2", "replay_dis", "measure_dis")}
for name, run in runs.items():
    assert sorted(run) == [1, 2, 3], (name, sorted(run))
    for step, r in run.items():
        assert r["logprob_diff_max"] == 0, f"{name} step {step}: logprob_diff_max {r['logprob_diff_max']!r}"
        measured = name.startswith("measure")
        assert ("routing_agreement" in r) == measured, f"{name} step {step}: routing_agreement logged: {not measured}"
        if measured:
            assert r["routing_agreement"] == 1, f"{name} step {step}: routing_agreement {r['routing_agreement']!r}"
for a, b in (("plain", "measure"), ("plain", "replay"), ("plain_ep2", "replay_ep2"), ("plain_cp2", "replay_cp2"),
             ("plain_cp2", "measure_cp2"), ("plain", "replay_dis"), ("plain", "measure_dis")):
    for s in (1, 2, 3):
        for k in ("loss", "pg_loss", "reward", "grad_norm"):
            x, y = runs[a][s][k], runs[b][s][k]
            assert x == y, f"step {s} {k}: {a} {x!r}, {b} {y!r}"
print("routing check: agreement 1 at every step (measure, --cp 2); replay equals routing by the top-k bit for bit "
      "(--ep 1, --ep 2, --cp 2, disaggregated); logprob_diff_max 0 everywhere")
PY
# Bad choices end in an error naming the option.
expect_error() {
  local want=$1
  shift
  if out=$("$bin" "$@" 2>&1); then
    echo "expected an error for: $*" >&2
    exit 1
  fi
  if ! grep -q -- "$want" <<< "$out"; then
    echo "error for '$*' does not say '$want':" >&2
    echo "$out" >&2
    exit 1
  fi
}
expect_error "--routing 'sometimes'" "${common[@]}" --routing sometimes --out "$dir/bad"
echo "routing check: bad --routing values are errors"
