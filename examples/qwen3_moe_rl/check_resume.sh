#!/usr/bin/env bash
# CI check of the RL example (CPU, 2 ranks): a short run of 6 steps with a
# checkpoint every 3 steps, then a second run resuming from step 3. The
# resumed steps 4..6 must log exactly the losses and rewards of the
# uninterrupted run (same prompts, same samples, same weights: bitwise on the CPU).
# The same checkpoint resumed with --ranks 4: the prompts and sample ids
# depend on the global slot only, not on the rank count, so the steps match
# up to f32 rounding (the reductions sum other partial sums).
# Then expert parallelism (--ep 2, with a KL term to the reference model):
# the same numbers as --ep 1 up to f32 rounding, a bitwise resume, a resume
# with --ep 1 (the state reshards: equal up to f32 rounding), and an export
# with every expert.
set -euo pipefail
bin=$1
dir=$2
rm -rf "$dir"
"$bin" --short --device cpu --ranks 2 --checkpoint-every 3 --out "$dir/full"
cp -r "$dir/full" "$dir/resumed"
rm -rf "$dir/resumed/hf"
# Forget the last checkpoint (step 6): resume from step 3.
rm -rf "$dir/resumed/checkpoints/step_6"
echo step_3 > "$dir/resumed/checkpoints/latest"
"$bin" --short --device cpu --ranks 2 --checkpoint-every 3 --out "$dir/resumed" --resume --no-export
python3 - "$dir/full/metrics.jsonl" "$dir/resumed/metrics.jsonl" <<'PY'
import json, sys
full = {r["step"]: r for r in map(json.loads, open(sys.argv[1]))}
res = {r["step"]: r for r in map(json.loads, open(sys.argv[2]))}
assert sorted(full) == list(range(1, 7)), f"uninterrupted run logged steps {sorted(full)}"
assert sorted(res) == list(range(1, 7)), f"resumed run logged steps {sorted(res)}"
for s in range(4, 7):
    for k in ("loss", "reward", "pg_loss", "grad_norm"):
        a, b = full[s][k], res[s][k]
        assert a == b, f"step {s} {k}: uninterrupted {a!r}, resumed {b!r}"
print("resume check: steps 4-6 equal bit for bit (loss, reward, pg_loss, grad_norm)")
PY
# The step-3 checkpoint of 2 ranks resumed by 4 (--prompts-per-rollout 4 of
# --short divides over 4 ranks).
cp -r "$dir/full" "$dir/resumed_r4"
rm -rf "$dir/resumed_r4/hf" "$dir/resumed_r4/checkpoints/step_6"
echo step_3 > "$dir/resumed_r4/checkpoints/latest"
"$bin" --short --device cpu --ranks 4 --out "$dir/resumed_r4" --resume --no-export
python3 - "$dir/full/metrics.jsonl" "$dir/resumed_r4/metrics.jsonl" <<'PY'
import json, sys
full = {r["step"]: r for r in map(json.loads, open(sys.argv[1]))}
res = {r["step"]: r for r in map(json.loads, open(sys.argv[2]))}
assert sorted(res) == list(range(1, 7)), f"resumed run logged steps {sorted(res)}"
for s in range(4, 7):
    for k in ("loss", "reward", "pg_loss", "grad_norm"):
        a, b = full[s][k], res[s][k]
        # f32 on the CPU: 4 ranks add the same gradients in another grouping.
        assert abs(a - b) <= 1e-4 * max(abs(a), 1e-3), f"step {s} {k}: 2 ranks {a!r}, resumed by 4 {b!r}"
print("resume with --ranks 4 of a --ranks 2 checkpoint: steps 4-6 equal within 1e-4")
PY
# The HF export: config.json and the weights under Hugging Face's names, one
# tensor per expert.
python3 - "$dir/full/hf" <<'PY'
import json, struct, sys, os
d = sys.argv[1]
cfg = json.load(open(os.path.join(d, "config.json")))
assert cfg["model_type"] == "qwen3_moe", cfg.get("model_type")
with open(os.path.join(d, "model.safetensors"), "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    names = set(json.loads(f.read(n))) - {"__metadata__"}
for e in range(cfg["num_experts"]):
    for p in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.1.mlp.experts.{e}.{p}.weight" in names, (e, p)
assert "model.layers.1.mlp.gate.weight" in names and "model.embed_tokens.weight" in names
print(f"HF export: {len(names)} tensors with per-expert names")
PY
# A JSONL prompt dataset with the user's reward function (reward.hpp).
python3 - "$dir/prompts.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(40):
        a, b = 3 + i % 20, 3 + (i * 7) % 20
        f.write(json.dumps({"prompt_tokens": [0, a, b, 2], "label": [3 + (a + b) % 25]}) + "\n")
PY
"$bin" --short --device cpu --ranks 2 --prompts "$dir/prompts.jsonl" --max-new-tokens 3 --out "$dir/jsonl" --no-export
python3 - "$dir/jsonl/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert [r["step"] for r in rows] == list(range(1, 7)), [r["step"] for r in rows]
assert all(0 <= r["reward"] <= 1 for r in rows)
print(f"JSONL prompts: {len(rows)} steps, mean reward {sum(r['reward'] for r in rows) / len(rows):.3f}")
PY

# Expert parallelism: --ep 2 (the 4 experts split over the 2 ranks) against
# --ep 1, both with a KL term (the reference model holds the same slice).
"$bin" --short --device cpu --ranks 2 --kl-coef 0.05 --out "$dir/kl_ep1" --no-export
"$bin" --short --device cpu --ranks 2 --kl-coef 0.05 --ep 2 --checkpoint-every 3 --out "$dir/kl_ep2"
cp -r "$dir/kl_ep2" "$dir/kl_ep2_resumed"
rm -rf "$dir/kl_ep2_resumed/checkpoints/step_6" "$dir/kl_ep2_resumed/hf"
echo step_3 > "$dir/kl_ep2_resumed/checkpoints/latest"
cp -r "$dir/kl_ep2_resumed" "$dir/kl_ep2_as_ep1"
cp -r "$dir/kl_ep2_resumed" "$dir/kl_ep2_as_r4ep4"
"$bin" --short --device cpu --ranks 2 --kl-coef 0.05 --ep 2 --out "$dir/kl_ep2_resumed" --resume --no-export
# The --ranks 2 --ep 2 checkpoint resumed with --ep 1, and with --ranks 4
# --ep 4 (one expert per rank): the state reshards.
"$bin" --short --device cpu --ranks 2 --kl-coef 0.05 --ep 1 --out "$dir/kl_ep2_as_ep1" --resume --no-export
"$bin" --short --device cpu --ranks 4 --kl-coef 0.05 --ep 4 --out "$dir/kl_ep2_as_r4ep4" --resume --no-export
python3 - "$dir" <<'PY'
import json, os, sys
d = sys.argv[1]
def rows(name):
    return {r["step"]: r for r in map(json.loads, open(os.path.join(d, name, "metrics.jsonl")))}
ep1, ep2, resumed = rows("kl_ep1"), rows("kl_ep2"), rows("kl_ep2_resumed")
as_ep1, as_r4ep4 = rows("kl_ep2_as_ep1"), rows("kl_ep2_as_r4ep4")
keys = ("loss", "reward", "pg_loss", "kl", "grad_norm")
for s in range(1, 7):
    for k in keys:
        a, b = ep1[s][k], ep2[s][k]
        # f32 on the CPU: expert parallelism sums the same products in another order.
        assert abs(a - b) <= 1e-4 * max(abs(a), 1e-3), f"step {s} {k}: ep 1 {a!r}, ep 2 {b!r}"
for s in range(4, 7):
    for k in keys:
        assert ep2[s][k] == resumed[s][k], f"step {s} {k}: ep 2 {ep2[s][k]!r}, resumed {resumed[s][k]!r}"
        for name, other in (("--ep 1", as_ep1), ("--ranks 4 --ep 4", as_r4ep4)):
            a, b = ep2[s][k], other[s][k]
            # f32 on the CPU: other reduction and expert orders.
            assert abs(a - b) <= 1e-4 * max(abs(a), 1e-3), f"step {s} {k}: ep 2 {a!r}, resumed with {name} {b!r}"
for other in (as_ep1, as_r4ep4):
    assert sorted(other) == list(range(1, 7)), f"resumed run logged steps {sorted(other)}"
print("expert parallel: ep 2 equals ep 1 (1e-4), resumes bit for bit, and resumes with --ep 1 and with "
      "--ranks 4 --ep 4 (1e-4)")
PY
python3 - "$dir/kl_ep2/hf" <<'PY'
import json, struct, sys, os
d = sys.argv[1]
cfg = json.load(open(os.path.join(d, "config.json")))
with open(os.path.join(d, "model.safetensors"), "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    names = set(json.loads(f.read(n))) - {"__metadata__"}
want = {f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(cfg["num_experts"])
        for p in ("gate_proj", "up_proj", "down_proj")}
assert want <= names, sorted(want - names)
print(f"HF export with --ep 2: all {cfg['num_experts']} experts ({len(names)} tensors)")
PY

# Disaggregated rollout: 2 trainer ranks and 1 or 2 engine ranks (weights by
# broadcast after every step, requests and completions point to point) give
# the colocated run's numbers bit for bit (the same weights, seed and sample
# ids), with and without expert parallelism.
"$bin" --short --device cpu --ranks 3 --rollout disaggregated --out "$dir/dis1" --no-export
"$bin" --short --device cpu --ranks 4 --rollout disaggregated --engine-ranks 2 --out "$dir/dis2" --no-export
"$bin" --short --device cpu --ranks 4 --rollout disaggregated --engine-ranks 2 --kl-coef 0.05 --ep 2 \
  --out "$dir/dis_ep2" --no-export
python3 - "$dir" <<'PY'
import json, os, sys
d = sys.argv[1]
def rows(name):
    return {r["step"]: r for r in map(json.loads, open(os.path.join(d, name, "metrics.jsonl")))}
for colocated, disaggregated in (("full", "dis1"), ("full", "dis2"), ("kl_ep2", "dis_ep2")):
    a, b = rows(colocated), rows(disaggregated)
    assert sorted(a) == sorted(b) == list(range(1, 7)), (sorted(a), sorted(b))
    for s in a:
        for k in ("loss", "reward", "pg_loss", "grad_norm"):
            assert a[s][k] == b[s][k], f"{disaggregated} step {s} {k}: colocated {a[s][k]!r}, disaggregated {b[s][k]!r}"
print("disaggregated rollout (1 and 2 engine ranks, and with --ep 2): equal to colocated bit for bit")
PY

# Colocation: --offload moves the policy's training state, the reference
# model and the engine between the device and pinned host memory around the
# phases; the numbers do not change (bit for bit), and every step logs its
# device high-water mark.
"$bin" --short --device cpu --ranks 2 --offload --checkpoint-every 3 --out "$dir/offload"
"$bin" --short --device cpu --ranks 2 --kl-coef 0.05 --ep 2 --offload --out "$dir/offload_kl_ep2" --no-export
python3 - "$dir" <<'PY'
import json, os, sys
d = sys.argv[1]
def rows(name):
    return {r["step"]: r for r in map(json.loads, open(os.path.join(d, name, "metrics.jsonl")))}
for plain, offloaded in (("full", "offload"), ("kl_ep2", "offload_kl_ep2")):
    a, b = rows(plain), rows(offloaded)
    assert sorted(a) == sorted(b) == list(range(1, 7)), (sorted(a), sorted(b))
    for s in a:
        for k in ("loss", "reward", "pg_loss", "kl", "grad_norm"):
            assert a[s][k] == b[s][k], f"{offloaded} step {s} {k}: {a[s][k]!r}, with --offload {b[s][k]!r}"
        assert b[s]["peak_memory_bytes"] > 0, b[s]
print("--offload: equal to the run without it bit for bit (with and without --ep 2 and a KL term)")
PY

# Context parallelism: --cp 2 (each response's tokens split over the 2 ranks
# of one data rank: zigzag ring attention, both K/V modes; the built-in
# model has one KV head, so no Ulysses; with a KL term and GSPO's sequence-level ratio) against --cp 1 on 2 data ranks
# (the same global batch): f32 on the CPU, the blockwise softmax and another
# reduction order.
"$bin" --short --device cpu --ranks 2 --kl-coef 0.05 --loss gspo --out "$dir/cp1" --no-export --no-tensorboard
for args in "--ring-kv p2p" "--ring-kv all-gather"; do
  name=$(echo "$args" | tr -c 'a-z0-9+\n' '_')
  # shellcheck disable=SC2086
  "$bin" --short --device cpu --ranks 2 --cp 2 $args --kl-coef 0.05 --loss gspo --out "$dir/cp2_$name" --no-export \
    --no-tensorboard
done
"$bin" --short --device cpu --ranks 4 --cp 2 --kl-coef 0.05 --loss gspo --out "$dir/cp2_dp2" --no-export --no-tensorboard
python3 - "$dir" <<'PY'
import json, os, sys
d = sys.argv[1]
def rows(name):
    return {r["step"]: r for r in map(json.loads, open(os.path.join(d, name, "metrics.jsonl")))}
base = rows("cp1")
runs = sorted(n for n in os.listdir(d) if n.startswith("cp2_"))
assert len(runs) == 3, runs
for n in runs:
    other = rows(n)
    assert sorted(other) == list(range(1, 7)), (n, sorted(other))
    for s in base:
        assert base[s]["reward"] == other[s]["reward"], f"{n} step {s}: reward {base[s]['reward']!r} vs {other[s]['reward']!r}"
        for k in ("loss", "pg_loss", "kl", "grad_norm"):
            a, b = base[s][k], other[s][k]
            # relative 1e-5, absolute 1e-7 for near-zero terms (pg_loss of GRPO's zero-mean advantages)
            assert abs(a - b) <= max(1e-5 * abs(a), 1e-7), f"{n} step {s} {k}: --cp 1 {a!r}, {b!r}"
print(f"--cp 2 ({', '.join(runs)}): equal to --cp 1 within 1e-5 (1e-7 absolute), rewards bit for bit")
PY

# Every policy loss and advantage estimator runs from the command line, and
# the older spelling --advantage gspo is --loss gspo with GRPO advantages.
for args in "--loss gspo" "--loss cispo" "--loss ppo --eps-clip-c 3 --loss-agg seq_mean_token_mean" \
  "--advantage dr-grpo --loss-agg seq_mean_token_sum" "--advantage reinforce++ --gamma 0.9" \
  "--advantage reinforce++-baseline --kl-coef 0.05 --unbiased-kl" "--advantage gspo"; do
  name=$(echo "$args" | tr -c 'a-z0-9+\n' '_')
  # shellcheck disable=SC2086
  "$bin" --short --device cpu --ranks 2 $args --out "$dir/objective_$name" --no-export --no-tensorboard > /dev/null
done
python3 - "$dir" <<'PY'
import json, math, os, sys
d = sys.argv[1]
runs = sorted(n for n in os.listdir(d) if n.startswith("objective_"))
rows = {n: [json.loads(l) for l in open(os.path.join(d, n, "metrics.jsonl"))] for n in runs}
for n, rs in rows.items():
    assert [r["step"] for r in rs] == list(range(1, 7)), n
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rs), n
alias, gspo = rows["objective___advantage_gspo"], rows["objective___loss_gspo"]
assert [r["loss"] for r in alias] == [r["loss"] for r in gspo], "--advantage gspo differs from --loss gspo"
print(f"objectives: {len(runs)} loss / advantage choices ran 6 steps each; --advantage gspo equals --loss gspo")
PY
