#!/usr/bin/env bash
# CI check (issue 21): hostile files through the real entry points end in a clear error naming
# the file, within seconds, with a normal exit (no crash, no hang):
#   qwen3_moe_rl --prompts (float label, FIFO, 66k-deep line), --model (deep / FIFO config.json),
#   --resume (deep checkpoint metadata); sft_qwen3 --model (eos_token_id = 2^32 + 1), --data
#   (FIFO); slime-logprobs --model (deep config.json), --tokens (FIFO) when given.
# Usage: check_hostile_input.sh RL_BIN SFT_BIN WORK_DIR [LOGPROBS_BIN]
set -uo pipefail
rl=$1 sft=$2 dir=$3 logprobs=${4:-}
rm -rf "$dir" && mkdir -p "$dir"
failures=0

deep=$(python3 -c 'print("[" * 66000 + "]" * 66000)')
config='{"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8'

# expect NAME "PATTERN..." -- COMMAND...: the command exits 1..123 (not a signal, not the timeout)
# and its output holds every pattern.
expect() {
  local name=$1
  shift
  local patterns=()
  while [[ $1 != -- ]]; do patterns+=("$1"); shift; done
  shift
  timeout 120 "$@" >"$dir/$name.log" 2>&1
  local rc=$?
  local ok=1
  if ((rc == 0 || rc >= 124)); then ok=0; fi
  for p in "${patterns[@]}"; do grep -qF -- "$p" "$dir/$name.log" || ok=0; done
  if ((ok)); then
    echo "ok   $name (exit $rc): $(grep -m1 -F -- "${patterns[0]}" "$dir/$name.log" | cut -c1-160)"
  else
    echo "FAIL $name (exit $rc), expected: ${patterns[*]}"
    tail -5 "$dir/$name.log"
    failures=$((failures + 1))
  fi
}

rl_args=(--short --device cpu --ranks 1 --no-tensorboard --no-export)

printf '{"prompt_tokens": [1, 2, 3], "label": [4, 5.7]}\n' >"$dir/float_label.jsonl"
expect rl_float_label "float_label.jsonl:1" "not an integer" -- "$rl" "${rl_args[@]}" --prompts "$dir/float_label.jsonl" --out "$dir/o1"
mkfifo "$dir/prompts_fifo.jsonl"
expect rl_fifo_prompts "prompts_fifo.jsonl" "FIFO" -- "$rl" "${rl_args[@]}" --prompts "$dir/prompts_fifo.jsonl" --out "$dir/o2"
printf '{"prompt_tokens": [1], "label": [1]}\n{"prompt_tokens": [1], "label": %s}\n' "$deep" >"$dir/deep.jsonl"
expect rl_deep_jsonl "deep.jsonl:2" "deeper than 128" -- "$rl" "${rl_args[@]}" --prompts "$dir/deep.jsonl" --out "$dir/o3"
mkdir -p "$dir/deep_model" "$dir/fifo_model"
printf '%s, "eos_token_id": %s}' "$config" "$deep" >"$dir/deep_model/config.json"
expect rl_deep_config "deep_model/config.json" "deeper than 128" -- "$rl" "${rl_args[@]}" --model "$dir/deep_model" --out "$dir/o4"
mkfifo "$dir/fifo_model/config.json"
expect rl_fifo_config "fifo_model/config.json" "FIFO" -- "$rl" "${rl_args[@]}" --model "$dir/fifo_model" --out "$dir/o5"
mkdir -p "$dir/o6/checkpoints/step_2"
for d in "$dir/o6" "$dir/o6/checkpoints"; do echo step_2 >"$d/latest"; mkdir -p "$d/step_2"; printf '{"format": "x", "m": %s}' "$deep" >"$d/step_2/metadata.json"; done
expect rl_deep_metadata "metadata.json" "deeper than 128" -- "$rl" "${rl_args[@]}" --resume --out "$dir/o6"

mkdir -p "$dir/eos_model"
printf '%s, "eos_token_id": 4294967297}' "$config" >"$dir/eos_model/config.json"
printf 'x' >"$dir/data.u32"
expect sft_eos_overflow "eos_token_id = 4294967297 is out of range" "eos_model/config.json" -- "$sft" --device cpu --ranks 1 --model "$dir/eos_model" --data "$dir/data.u32"
mkfifo "$dir/data_fifo.u32"
expect sft_fifo_data "data_fifo.u32" "FIFO" -- "$sft" --device cpu --ranks 1 --eos-id 0 --data "$dir/data_fifo.u32"

if [[ -n $logprobs ]]; then
  expect logprobs_deep_config "config.json" "deeper than 128" -- "$logprobs" --model "$dir/deep_model" --tokens "$dir/data.u32"
  mkfifo "$dir/tokens_fifo.txt"
  tiny=$(cd "$(dirname "$0")/../tests/nn/data/qwen3_tiny" && pwd)  # a real checkpoint: the model loads first
  expect logprobs_fifo_tokens "tokens_fifo.txt" "FIFO" -- "$logprobs" --model "$tiny" --tokens "$dir/tokens_fifo.txt"
fi

if ((failures)); then
  echo "check_hostile_input: $failures case(s) failed"
  exit 1
fi
echo "check_hostile_input: every hostile input ended in a clear error"
