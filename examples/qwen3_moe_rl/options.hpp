// The RL example's options: every knob of the trainer, with its default, in
// one struct that --help documents (CLI11).
#pragma once

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>

#include "slime/core/error.hpp"

namespace rl_example {

struct Options {
  // What to train.
  std::string model;               // HF directory (config.json + safetensors); empty: the built-in tiny Qwen3-MoE
  std::string task = "successor";  // a built-in task of slime/data/tasks.hpp
  std::string prompts;             // JSONL prompts (prompt_tokens, label): replaces --task; reward.hpp scores
  int max_new_tokens = 16;         // --prompts only (a task knows its answer length)
  int eos_token = 1;               // --prompts only: generation stops after it
  float init_std = 0.1f;           // built-in model: N(0, init_std) weights
  int steps = 200;
  uint64_t seed = 1;
  // Rollout.
  int prompts_per_rollout = 32;  // over all ranks
  int samples_per_prompt = 8;    // the GRPO group size
  float temperature = 1.f;
  // Advantages and loss.
  std::string advantage = "grpo";  // grpo | dr-grpo | reinforce++ | reinforce++-baseline (gspo: grpo + --loss gspo)
  double gamma = 1.0;              // reinforce++: discount of the token returns
  std::string loss = "ppo";        // ppo | gspo | cispo
  std::string loss_aggregation = "token_mean";  // token_mean | seq_mean_token_mean | seq_mean_token_sum
  double eps_clip = 0.2, eps_clip_high = 0.28, eps_clip_c = 0;
  std::string is_correction = "tis";   // none | tis | mis-token | mis-sequence | mis-geometric
  std::string mis_mode = "truncate";   // truncate | clip | mask
  std::string is_renormalize = "off";  // MIS: off | batch (slime's --tis-batch-normalize) | kept (ours)
  double is_low = 0, is_high = 2;
  std::string kl_type = "k1";  // k1 | k2 | k3 | low_var_kl (slime's --kl-loss-type, default k1)
  bool unbiased_kl = false;    // KL x exp(lp - old)
  double kl_coef = 0;
  double entropy_coef = 0;
  // MoE rollout routing (as slime's --use-rollout-routing-replay): off | measure
  // (the engine records each input token's experts; the metrics report how
  // often the trainer's router picks the same ones) | replay (the trainer
  // routes every token to the engine's experts).
  std::string routing = "off";
  // The batch-invariant numerics mode (slime/ops/batch_invariant.hpp): on
  // CUDA the engine's logprobs then equal the trainer's bit for bit (the CPU
  // is batch-invariant either way). on | off.
  std::string batch_invariant = "on";
  std::string empty_sequences = "count";  // count (slime's) | skip: responses without loss tokens in the normalisers
  // On-policy distillation (slime's --opd-kl-coef): a frozen teacher.
  std::string teacher;       // HF directory; empty: no distillation
  double opd_kl_coef = 1.0;  // advantages -= opd_kl_coef x (student lp - teacher lp)
  // Optimisation.
  double lr = 3e-3, min_lr = 0;
  std::string lr_schedule = "constant";  // constant | warmup | cosine
  int warmup_steps = 0;
  double max_grad_norm = 1.0;
  double weight_decay = 0.0;
  int64_t max_tokens_per_gpu = 4096;  // packing budget of one micro-batch
  // Parallelism and devices.
  std::string fsdp = "full";               // full | grad_op | no_shard
  int ep = 1;                              // expert-parallel degree (must divide the ranks and the experts)
  int cp = 1;                              // context-parallel degree: each response split over cp ranks
  int ulysses = 1;                         // of cp, the Ulysses (head) degree; the rest is ring attention
  std::string ring_kv = "auto";            // p2p | all-gather | auto: how ring attention moves K/V
  std::string rollout_mode = "colocated";  // colocated | disaggregated
  int engine_ranks = 1;                    // disaggregated: the last engine_ranks ranks run engines
  bool offload = false;  // colocated: the policy's training state leaves the GPU while the engine generates, the
                         // engine's weights and the reference model while the policy trains
  int ranks = 2;
  bool share_gpu = false;       // CUDA: all ranks on one GPU through LocalComm (comm::LaunchOptions::share_device)
  std::string device = "auto";  // auto | cpu | cuda
  // Output.
  std::string out_dir = "runs/qwen3_moe_rl";
  int checkpoint_every = 0;  // 0: only at the end
  bool resume = false;
  bool export_hf = true;
  bool tensorboard = true;
  bool short_run = false;  // CI: a few steps, small batches

  void add_to(CLI::App& app) {
    auto* g = "What to train";
    app.add_option("--model", model, "HF model directory (config.json + safetensors); default: built-in tiny Qwen3-MoE")
        ->group(g);
    app.add_option("--init-std", init_std, "built-in model: standard deviation of the random initial weights")
        ->capture_default_str()
        ->group(g);
    app.add_option("--task", task, "built-in task with a verifier: successor, copy, reverse, sum")
        ->capture_default_str()
        ->group(g);
    app.add_option("--prompts", prompts,
                   "JSONL prompt dataset ({\"prompt_tokens\": [...], \"label\": ...} per line) instead of --task; "
                   "rewards from examples/qwen3_moe_rl/reward.hpp")
        ->group(g);
    app.add_option("--max-new-tokens", max_new_tokens, "with --prompts: the longest response")
        ->capture_default_str()
        ->group(g);
    app.add_option("--eos-token", eos_token, "with --prompts: the stop token")->capture_default_str()->group(g);
    app.add_option("--steps", steps, "optimizer steps (one rollout each)")->capture_default_str()->group(g);
    app.add_option("--seed", seed, "seed of prompts, sampling and initialisation")->capture_default_str()->group(g);
    g = "Rollout";
    app.add_option("--prompts-per-rollout", prompts_per_rollout, "prompts per step, over all ranks")
        ->capture_default_str()
        ->group(g);
    app.add_option("--samples-per-prompt", samples_per_prompt, "samples per prompt (the GRPO group)")
        ->capture_default_str()
        ->group(g);
    app.add_option("--temperature", temperature, "sampling temperature")->capture_default_str()->group(g);
    g = "Objective";
    app.add_option("--advantage", advantage,
                   "advantage estimator: grpo (group mean and std) | dr-grpo (group mean only) | reinforce++ "
                   "(discounted token returns, whitened over the global batch) | reinforce++-baseline (group mean, "
                   "whitened over the global batch); gspo: grpo with --loss gspo (the older spelling)")
        ->capture_default_str()
        ->group(g);
    app.add_option("--gamma", gamma, "reinforce++: discount of the token returns")->capture_default_str()->group(g);
    app.add_option("--loss", loss,
                   "policy loss: ppo (token ratios, clipped; dual clip with --eps-clip-c) | gspo (sequence ratios) | "
                   "cispo (clipped, detached importance weights times logprob)")
        ->capture_default_str()
        ->group(g);
    app.add_option("--loss-agg", loss_aggregation,
                   "loss aggregation: token_mean | seq_mean_token_mean | seq_mean_token_sum (global normalisers)")
        ->capture_default_str()
        ->group(g);
    app.add_option("--eps-clip", eps_clip, "lower clip (1 - eps); --loss gspo defaults to 3e-4")
        ->capture_default_str()
        ->group(g);
    app.add_option("--eps-clip-high", eps_clip_high, "upper clip (1 + eps_high); --loss gspo defaults to 4e-4")
        ->capture_default_str()
        ->group(g);
    app.add_option("--eps-clip-c", eps_clip_c, "dual clip for negative advantages (> 1; 0 off)")
        ->capture_default_str()
        ->group(g);
    app.add_option("--is", is_correction,
                   "rollout/trainer mismatch correction: none | tis | mis-token | "
                   "mis-sequence | mis-geometric")
        ->capture_default_str()
        ->group(g);
    app.add_option("--mis-mode", mis_mode, "MIS outside the bounds: truncate | clip | mask")
        ->capture_default_str()
        ->group(g);
    app.add_option("--is-renormalize", is_renormalize,
                   "MIS weights divided by their mean over the micro-batch: off | batch (slime's "
                   "--tis-batch-normalize: the bounded weights of every loss token, rejected ones included; per "
                   "sequence for the sequence and geometric levels) | kept (the kept weights only, so the weights "
                   "in the loss average 1)")
        ->capture_default_str()
        ->group(g);
    app.add_option("--routing", routing,
                   "MoE rollout routing: off | measure (the engine records each token's experts; metrics.jsonl's "
                   "routing_agreement is the fraction of (token, sparse layer) pairs whose experts the trainer's "
                   "router picks too) | replay (the trainer routes every token to the engine's experts, as "
                   "slime's --use-rollout-routing-replay)")
        ->capture_default_str()
        ->group(g);
    app.add_option("--batch-invariant", batch_invariant,
                   "on | off: the batch-invariant numerics mode (CUDA: the engine's logprobs equal the trainer's "
                   "recompute bit for bit, at some cost in speed; no effect on the CPU)")
        ->check(CLI::IsMember({"on", "off"}))
        ->capture_default_str()
        ->group(g);
    app.add_option("--is-low", is_low, "importance weight lower bound")->capture_default_str()->group(g);
    app.add_option("--is-high", is_high, "importance weight upper bound")->capture_default_str()->group(g);
    app.add_option("--kl-type", kl_type,
                   "KL estimator to the reference, as slime's --kl-loss-type: k1 | k2 | k3 (unclamped) | low_var_kl "
                   "(k3 clamped to [-10, 10])")
        ->capture_default_str()
        ->group(g);
    app.add_flag("--unbiased-kl", unbiased_kl, "KL term times the ratio exp(lp - old)")->group(g);
    app.add_option("--kl-coef", kl_coef, "KL coefficient (0: no reference model)")->capture_default_str()->group(g);
    app.add_option("--entropy-coef", entropy_coef, "entropy bonus coefficient")->capture_default_str()->group(g);
    app.add_option("--loss-empty", empty_sequences,
                   "responses without loss tokens: count (slime's: every sample in the sequence count, one token "
                   "each in token_mean's) | skip (only responses with loss tokens)")
        ->capture_default_str()
        ->group(g);
    app.add_option("--teacher", teacher,
                   "on-policy distillation: HF directory of a frozen teacher (same vocabulary, any size; sharded "
                   "like the policy, no optimizer) that scores the sampled tokens")
        ->group(g);
    app.add_option("--opd-kl-coef", opd_kl_coef,
                   "with --teacher: advantages -= coef x (student lp - teacher lp) per response token (slime's "
                   "--opd-kl-coef: the k1 reverse KL, through the advantage, after the estimator)")
        ->capture_default_str()
        ->group(g);
    g = "Optimisation";
    app.add_option("--lr", lr, "AdamW learning rate")->capture_default_str()->group(g);
    app.add_option("--lr-schedule", lr_schedule, "constant | warmup | cosine")->capture_default_str()->group(g);
    app.add_option("--warmup-steps", warmup_steps, "linear warm-up steps")->capture_default_str()->group(g);
    app.add_option("--min-lr", min_lr, "cosine floor")->capture_default_str()->group(g);
    app.add_option("--max-grad-norm", max_grad_norm, "global grad-norm clip (0: off)")->capture_default_str()->group(g);
    app.add_option("--weight-decay", weight_decay, "AdamW decoupled weight decay")->capture_default_str()->group(g);
    app.add_option("--max-tokens-per-gpu", max_tokens_per_gpu, "tokens per packed micro-batch")
        ->capture_default_str()
        ->group(g);
    g = "Parallelism";
    app.add_option("--fsdp", fsdp, "full | grad_op | no_shard")->capture_default_str()->group(g);
    app.add_option("--ep", ep,
                   "expert-parallel degree: the experts split over ep ranks, each slice sharded over ranks / ep (1: "
                   "experts shard like the rest)")
        ->capture_default_str()
        ->group(g);
    app.add_option("--cp", cp,
                   "context-parallel degree: every micro-batch's sequences split over cp ranks (zigzag ring "
                   "attention and/or Ulysses); the ranks are dp x cp x ep")
        ->capture_default_str()
        ->group(g);
    app.add_option("--ulysses", ulysses, "of --cp, the Ulysses degree (divides cp and the heads); cp / ulysses is ring")
        ->capture_default_str()
        ->group(g);
    app.add_option("--ring-kv", ring_kv, "p2p | all-gather | auto (all-gather for short micro-batches)")
        ->capture_default_str()
        ->group(g);
    app.add_option("--rollout", rollout_mode,
                   "colocated (an engine shares each rank's device) | disaggregated (the last --engine-ranks ranks "
                   "run engines; the weights travel by NCCL broadcast after every step)")
        ->capture_default_str()
        ->group(g);
    app.add_option("--engine-ranks", engine_ranks, "disaggregated: how many of the ranks run engines")
        ->capture_default_str()
        ->group(g);
    app.add_flag("--offload", offload,
                 "colocated: the policy's training state (Sharded::offload) goes to pinned host memory while the "
                 "engine generates and takes the weights, the engine's weights and KV cache and the reference model "
                 "while the policy trains; metrics.jsonl's peak_memory_bytes is the step's device high-water mark")
        ->group(g);
    app.add_option("--ranks", ranks, "ranks as threads of this process (ignored under torchrun/mpirun/srun)")
        ->capture_default_str()
        ->group(g);
    app.add_flag("--share-gpu", share_gpu,
                 "CUDA: run the --ranks ranks as threads on one GPU (LocalComm) instead of one GPU each")
        ->group(g);
    app.add_option("--device", device, "auto | cpu | cuda")->capture_default_str()->group(g);
    g = "Output";
    app.add_option("--out", out_dir, "metrics.jsonl, TensorBoard events, checkpoints, HF export")
        ->capture_default_str()
        ->group(g);
    app.add_option("--checkpoint-every", checkpoint_every, "checkpoint interval in steps (0: at the end only)")
        ->capture_default_str()
        ->group(g);
    app.add_flag("--resume", resume, "continue from the latest checkpoint in --out")->group(g);
    app.add_flag("!--no-export", export_hf, "skip the HF export at the end")->group(g);
    app.add_flag("!--no-tensorboard", tensorboard, "no TensorBoard event file")->group(g);
    app.add_flag("--short", short_run, "CI: 6 steps, 4 prompts x 4 samples")->group(g);
  }

  // After parsing: the older spelling --advantage gspo (GRPO advantages with
  // the GSPO loss), GSPO's default clips (its sequence ratios need much
  // tighter ones), --short's sizes. Options given on the command line win.
  void resolve(const CLI::App& app) {
    const auto given = [&](const char* name) { return app.count(name) > 0; };
    if (advantage == "gspo") {
      advantage = "grpo";
      if (!given("--loss")) loss = "gspo";
    }
    if (loss == "gspo") {
      if (!given("--eps-clip")) eps_clip = 3e-4;
      if (!given("--eps-clip-high")) eps_clip_high = 4e-4;
    }
    if (short_run) {
      steps = std::min(steps, 6);
      prompts_per_rollout = 4;
      samples_per_prompt = 4;
    }
  }
};

// The value `choices` maps `value` to; an error naming the option and the
// choices for any other.
template <class T>
T parse_choice(std::string_view option, const std::string& value,
               std::initializer_list<std::pair<std::string_view, T>> choices) {
  std::string names;
  for (const auto& [name, v] : choices) {
    if (name == value) return v;
    names += (names.empty() ? "" : ", ") + std::string(name);
  }
  SLIME_FAIL(option, " '", value, "': expected one of ", names);
}

}  // namespace rl_example
