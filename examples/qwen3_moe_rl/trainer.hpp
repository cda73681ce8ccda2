// The RL trainer of the example, one instance per rank. A step:
//
//   rollout   the rank's prompts -> rollout::Engine (the trainer's kernels,
//             colocated on the rank's device) -> responses + their logprobs
//   reward    the task's verifier per response
//   advantage GRPO / GSPO (group-normalised) or REINFORCE++ (group baseline,
//             whitened over the global batch)
//   pack      prompt + response sequences into micro-batches (equal count on
//             every rank: the FSDP gathers are collective)
//   loss      policy forward -> token logprobs -> TIS/MIS weights against the
//             rollout logprobs -> reference logprobs (KL) -> rl::policy_loss
//             with global normalisers -> backward through Sharded
//   update    AdamW on the fp32 master shards (grad-norm clip, LR schedule)
//   sync      the new weights into the engine (one parameter gathered at a time)
//   metrics   all-reduced; rank 0 logs JSONL / TensorBoard / the progress line
//   checkpoint every N steps and at the end; HF export at the end.
//
// One optimizer step per rollout, so the trainer's "old" logprobs are the
// logprobs of the training forward itself (the PPO ratio starts at 1); the
// importance weights correct the engine/trainer mismatch (rollout vs old).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "options.hpp"
#include "remote_rollout.hpp"
#include "reward.hpp"
#include "slime/comm/comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/data/prompt_dataset.hpp"
#include "slime/data/tasks.hpp"
#include "slime/io/metrics_log.hpp"
#include "slime/io/progress.hpp"
#include "slime/io/safetensors_writer.hpp"
#include "slime/io/train_state.hpp"
#include "slime/nn/checkpoint.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/optim/lr_schedule.hpp"
#include "slime/parallel/expert_parallel.hpp"
#include "slime/parallel/sharded.hpp"
#include "slime/parallel/sharded_checkpoint.hpp"
#include "slime/rl/advantages.hpp"
#include "slime/rl/importance_sampler.hpp"
#include "slime/rl/policy_loss.hpp"
#include "slime/rl/reference_model.hpp"
#include "slime/rollout/engine.hpp"
#include "slime/rollout/remote.hpp"
#include "slime/rollout/weight_sync.hpp"

namespace rl_example {

using namespace slime;
namespace fs = std::filesystem;

// The built-in model: a tiny Qwen3-MoE (layer 0 dense, layer 1 sparse with 4
// experts, top-2), head_dim 64 so the CUDA attention kernels take it.
inline nn::Qwen3Config tiny_moe_config(int64_t vocab) {
  nn::Qwen3Config c;
  c.model_type = "qwen3_moe";
  c.vocab_size = vocab;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 64;
  c.max_position_embeddings = 64;
  c.rope_theta = 10000.0;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 64;
  c.norm_topk_prob = true;
  c.mlp_only_layers = {0};
  return c;
}

// The model's config: the built-in tiny model, or --model's config.json.
inline nn::Qwen3Config model_config(const Options& o) {
  return o.model.empty() ? tiny_moe_config(32) : nn::Qwen3Config::from_file(fs::path(o.model) / "config.json");
}

// The rollout engine's configuration (colocated on a trainer rank, or on an
// engine rank under --rollout disaggregated).
inline rollout::EngineConfig engine_config(const Options& o, int64_t context) {
  return rollout::EngineConfig{.max_batch = 256, .max_context = context, .kv_capacity = 0, .seed = o.seed};
}

// What rank 0 keeps of a step.
struct StepReport {
  double reward = 0;
  double loss = 0;
};

// One packed micro-batch of samples [first, last) of the rank's rollout.
struct MicroBatch {
  nn::PackedBatch batch;
  Tensor targets;     // i32 [T] on the device
  Tensor loss_mask;   // u8 [T] host
  Tensor rollout_lp;  // f32 [T] host (0 outside the loss)
  Tensor advantages;  // f32 [T] host
  Tensor cu_seqlens;  // i32 [S + 1] host
  int64_t response_tokens = 0;
};

template <class Strategy>
class Trainer {
 public:
  using Policy = parallel::Sharded<nn::Qwen3Model, Strategy>;

  // `remote`: disaggregated rollout (remote_rollout.hpp); null: an engine
  // colocated on this rank's device.
  Trainer(const Options& o, comm::Comm& comm, Device device, const RemoteRollout* remote = nullptr)
      : o_(o), comm_(comm), device_(device), remote_(remote) {
    dtype_ = device.is_cuda() ? DType::bf16 : DType::f32;
    task_ = data::make_task(o.task);
    SLIME_CHECK(o.prompts_per_rollout % comm.size() == 0, "--prompts-per-rollout ", o.prompts_per_rollout,
                " must divide over the ", comm.size(), " ranks");
    SLIME_CHECK(o.samples_per_prompt >= 2, "--samples-per-prompt must be >= 2 (a group needs a baseline)");
    SLIME_CHECK(o.ep >= 1 && comm.size() % o.ep == 0, "--ep ", o.ep, " must be >= 1 and divide the ", comm.size(),
                " ranks");
    config_ = model_config(o);
    if (o.ep > 1) {
      // Mesh dp_shard x ep (ep innermost): the experts split over the ep
      // ranks, and each slice shards over the dp ranks (Sharded's expert units).
      SLIME_CHECK(config_.is_moe(), "--ep ", o.ep, ": the model is not a mixture of experts");
      SLIME_CHECK(config_.num_experts % o.ep == 0, "--ep ", o.ep, " must divide the ", config_.num_experts, " experts");
      mesh_ = std::make_unique<comm::Mesh>(
          comm, comm::MeshShape{.dp_replicate = 1, .dp_shard = comm.size() / o.ep, .cp = 1, .ep = o.ep});
      ep_ = std::make_unique<parallel::ExpertParallel<>>(*mesh_, config_.num_experts);
    }
    // This rank's experts only (all of them without expert parallelism).
    nn::Qwen3Model model(config_, {device, dtype_}, ep_.get());
    if (o.model.empty()) {
      model.init_random(o.seed, o.init_std);
    } else {
      nn::load_hf_weights(model, o.model);
    }
    int64_t context = 0;
    if (o.prompts.empty()) {
      SLIME_CHECK(config_.vocab_size >= task_->vocab().vocab_size, "the model's vocabulary (", config_.vocab_size,
                  ") is smaller than the task's (", task_->vocab().vocab_size, ")");
      context = task_->prompt_length() + task_->answer_length() + 1;
    } else {
      data::JsonlOptions jo;
      jo.vocab_size = config_.vocab_size;
      dataset_.emplace(data::PromptDataset::from_jsonl(o.prompts, o.seed, jo));
      int64_t longest = 0;
      for (int64_t i = 0; i < dataset_->size(); ++i) longest = std::max<int64_t>(longest, (*dataset_)[i].tokens.size());
      context = longest + o.max_new_tokens;
    }
    if (o.kl_coef != 0)
      ref_.emplace(model, ep_.get(), rl::ReferenceModelConfig{.update_every = 0, .offload = o.offload});
    optim::AdamWConfig adamw;
    adamw.weight_decay = o.weight_decay;
    policy_ = mesh_ ? std::make_unique<Policy>(std::move(model), *mesh_, parallel::ShardedOptions{}, adamw)
                    : std::make_unique<Policy>(std::move(model), comm, parallel::ShardedOptions{}, adamw);
    if (remote_) {
      if (remote_->sync) broadcast_command(*remote_->sync, EngineCommand::hello, context, device_);
    } else {
      engine_model_ = std::make_unique<nn::Qwen3Model>(config_, nn::ModuleOptions{device, dtype_});
      engine_ = std::make_unique<rollout::Engine>(*engine_model_, engine_config(o, context));
    }
    schedule_ = o.lr_schedule == "cosine"   ? optim::LrSchedule::cosine(o.lr, o.warmup_steps, o.steps, o.min_lr)
                : o.lr_schedule == "warmup" ? optim::LrSchedule::linear_warmup(o.lr, std::max(o.warmup_steps, 1))
                                            : optim::LrSchedule::constant(o.lr);
    loss_config_ = loss_config(o);
  }

  // Runs the steps; rank 0 logs. Returns the per-step mean rewards (every rank).
  std::vector<StepReport> run() {
    std::vector<StepReport> reports = run_steps();
    if (remote_ && remote_->sync) broadcast_command(*remote_->sync, EngineCommand::stop, 0, device_);
    return reports;
  }

 private:
  std::vector<StepReport> run_steps() {
    const fs::path out = o_.out_dir, ckpt = out / "checkpoints";
    int64_t start = 0;
    if (o_.resume) start = resume(ckpt);
    if (dataset_ && start > 0) (void)dataset_->next_batch(start * o_.prompts_per_rollout);  // the data position
    sync_engine(start);
    std::unique_ptr<io::MetricsLog> log;
    std::unique_ptr<io::Progress> progress;
    if (comm_.rank() == 0) {
      fs::create_directories(out);
      io::MetricsLogOptions lo;
      if (o_.resume) lo.resume_step = start + 1;  // steps are logged 1-based: keep 1..start
      if (o_.tensorboard) lo.tensorboard_dir = out / "tensorboard";
      log = std::make_unique<io::MetricsLog>(out / "metrics.jsonl", lo);
      io::ProgressOptions po;
      po.total_steps = o_.steps;
      po.print_every = std::max(1, o_.steps / 10);
      progress = std::make_unique<io::Progress>(std::cout, po, start);
    }
    std::vector<StepReport> reports;
    for (int64_t step = start; step < o_.steps; ++step) {
      const auto t0 = std::chrono::steady_clock::now();
      io::Scalars m = train_step(step);
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      m.emplace_back("step_seconds", secs);
      double tokens = 0;
      for (const auto& [k, v] : m)
        if (k == "tokens") tokens = v;
      m.emplace_back("tokens_per_s", tokens / secs);
      reports.push_back({value(m, "reward"), value(m, "loss")});
      if (log) {
        log->log(step + 1, m);
        progress->update(step + 1, {{"reward", value(m, "reward")},
                                    {"loss", value(m, "loss")},
                                    {"kl", value(m, "kl")},
                                    {"tis_w", value(m, "importance_weight_mean")},
                                    {"tok/s", value(m, "tokens_per_s")}});
      }
      const bool last = step + 1 == o_.steps;
      if (last || (o_.checkpoint_every > 0 && (step + 1) % o_.checkpoint_every == 0)) save(ckpt, step + 1);
    }
    if (progress) progress->finish();
    if (o_.export_hf) export_hf(out / "hf");
    return reports;
  }

  static double value(const io::Scalars& m, std::string_view key) {
    for (const auto& [k, v] : m)
      if (k == key) return v;
    return 0;
  }

  static rl::PolicyLossConfig loss_config(const Options& o) {
    rl::PolicyLossConfig c;
    SLIME_CHECK(o.advantage == "grpo" || o.advantage == "gspo" || o.advantage == "reinforce++", "--advantage '",
                o.advantage, "': expected grpo, gspo or reinforce++");
    c.kind = o.advantage == "gspo" ? rl::PolicyLossKind::gspo : rl::PolicyLossKind::ppo;
    c.eps_clip = o.eps_clip;
    c.eps_clip_high = o.eps_clip_high;
    c.eps_clip_c = o.eps_clip_c;
    c.entropy_coef = o.entropy_coef;
    c.kl_coef = o.kl_coef;
    SLIME_CHECK(o.kl_type == "k1" || o.kl_type == "k2" || o.kl_type == "k3", "--kl-type '", o.kl_type,
                "': expected k1, k2 or k3");
    c.kl_estimator = o.kl_type == "k1"   ? rl::KlEstimator::k1
                     : o.kl_type == "k2" ? rl::KlEstimator::k2
                                         : rl::KlEstimator::k3;
    c.aggregation = rl::Aggregation::token_mean;
    return c;
  }

  // ---- one step ----------------------------------------------------------

  io::Scalars train_step(int64_t step) {
    const int W = comm_.size(), r = comm_.rank();
    const int64_t per_rank = o_.prompts_per_rollout / W, n = o_.samples_per_prompt;
    // Rollout: this rank's prompts (every rank draws the step's whole batch in
    // the same order and takes its slice), n samples each.
    std::vector<int64_t> batch;  // dataset indices of the step's prompts
    if (dataset_) batch = dataset_->next_batch(o_.prompts_per_rollout);
    std::vector<std::vector<int32_t>> prompts;
    std::vector<rollout::Request> requests;
    for (int64_t i = 0; i < per_rank; ++i) {
      const int64_t slot = r * per_rank + i;
      const uint64_t g = uint64_t(step) * uint64_t(o_.prompts_per_rollout) + uint64_t(slot);
      prompts.push_back(dataset_ ? (*dataset_)[batch[std::size_t(slot)]].tokens : task_->prompt(o_.seed, g));
      for (int64_t j = 0; j < n; ++j) {
        rollout::Request q;
        q.prompt = prompts.back();
        q.sample_id = g * uint64_t(n) + uint64_t(j);
        q.sampling.temperature = o_.temperature;
        q.sampling.max_new_tokens = dataset_ ? o_.max_new_tokens : task_->answer_length() + 1;
        q.sampling.stop_tokens = {dataset_ ? int32_t(o_.eos_token) : data::TaskVocab::kEos};
        requests.push_back(std::move(q));
      }
    }
    using clock = std::chrono::steady_clock;
    const auto seconds = [](clock::time_point a, clock::time_point b) {
      return std::chrono::duration<double>(b - a).count();
    };
    const auto rollout_start = clock::now();
    const std::vector<rollout::Completion> done = generate(requests);
    const auto rollout_end = clock::now();
    // Rewards: the task's verifier, or the user's function for a dataset.
    const int64_t N = int64_t(done.size());
    std::vector<float> rewards(static_cast<std::size_t>(N));
    for (int64_t s = 0; s < N; ++s) {
      SLIME_CHECK(done[s].finish != rollout::FinishReason::error, "rollout failed: ", done[s].error);
      const auto& prompt = prompts[std::size_t(s / n)];
      const auto& response = done[std::size_t(s)].tokens;
      rewards[std::size_t(s)] =
          float(dataset_ ? user_reward(prompt, response, (*dataset_)[batch[std::size_t(r * per_rank + s / n)]].label)
                         : task_->reward(prompt, response));
    }
    const std::vector<float> adv = advantages(rewards);
    // Micro-batches: the same count on every rank.
    std::vector<MicroBatch> mbs = pack(prompts, done, adv);
    // The global normaliser of the loss.
    rl::LossNormalizer norm;
    for (const MicroBatch& mb : mbs) {
      const rl::LossNormalizer c = rl::count_normalizer(mb.loss_mask, mb.cu_seqlens);
      norm.tokens += c.tokens;
      norm.sequences += c.sequences;
    }
    {
      std::vector<float> v = {float(norm.tokens), float(norm.sequences)};
      Tensor t = Tensor::from_vector(v, {2}, device_);
      comm_.all_reduce(t);
      v = t.to_vector<float>();
      norm.tokens = int64_t(v[0]);
      norm.sequences = int64_t(v[1]);
    }
    // Loss and backward, micro-batch by micro-batch.
    policy_->zero_grad();
    policy_->set_micro_batches(int(mbs.size()));
    rl::PolicyLossMetrics lm;
    rl::ImportanceMetrics im;
    int64_t tokens = 0, response_tokens = 0;
    if (ref_ && o_.offload) ref_->onload();
    for (MicroBatch& mb : mbs) {
      typename Policy::Context ctx;
      const Tensor hidden = policy_->forward(mb.batch, ctx);
      const ops::TokenLogprobs fwd = policy_->token_logprobs(hidden, mb.targets, o_.temperature);
      const Tensor lp_host = fwd.logprobs.to(Device::cpu());
      rl::PolicyLossTensors in;
      in.lp = fwd.logprobs;
      in.old_lp = fwd.logprobs;  // one update per rollout: old = current (detached)
      in.advantages = mb.advantages.to(device_);
      in.loss_mask = mb.loss_mask.to(device_);
      in.cu_seqlens = mb.batch.cu_seqlens;
      if (o_.entropy_coef != 0) in.entropy = fwd.entropy;
      if (ref_) in.ref_lp = ref_->logprobs(mb.batch, mb.targets, o_.temperature);
      if (o_.is_correction != "none") {
        const rl::ImportanceResult w = importance(lp_host, mb);
        im += w.metrics;
        in.is_weights = w.weights.to(device_);
        in.keep_mask = w.keep_mask.to(device_);
      }
      const rl::PolicyLossResult res = rl::policy_loss(loss_config_, norm, in);
      lm += res.metrics;
      const Tensor d_hidden =
          policy_->token_logprobs_backward(hidden, mb.targets, o_.temperature, fwd, res.grad_lp, res.grad_entropy);
      policy_->backward(ctx, d_hidden);
      tokens += mb.batch.num_tokens();
      response_tokens += mb.response_tokens;
    }
    if (ref_ && o_.offload) ref_->offload();
    const std::optional<double> grad_norm = policy_->optimizer_step(schedule_.lr(step + 1), o_.max_grad_norm);
    synchronize_device(device_);  // the phase timings below are of finished work
    const auto train_end = clock::now();
    sync_engine(step + 1);
    synchronize_device(device_);
    const auto sync_end = clock::now();
    // Metrics: sums over ranks.
    double reward_sum = 0;
    for (float x : rewards) reward_sum += x;
    std::vector<float> sums = {float(reward_sum),
                               float(N),
                               float(lm.loss),
                               float(lm.pg_loss),
                               float(lm.kl),
                               float(lm.entropy),
                               float(lm.clip_fraction),
                               float(im.weight_sum),
                               float(im.kept),
                               float(im.clipped),
                               float(im.tokens),
                               float(im.k3_sum),
                               float(tokens),
                               float(response_tokens)};
    Tensor t = Tensor::from_vector(sums, {int64_t(sums.size())}, device_);
    comm_.all_reduce(t);
    sums = t.to_vector<float>();
    io::Scalars m = {{"reward", sums[0] / sums[1]},
                     {"loss", sums[2]},
                     {"pg_loss", sums[3]},
                     {"kl", sums[4]},
                     {"entropy", sums[5]},
                     {"clip_fraction", sums[6]},
                     {"importance_weight_mean", sums[8] > 0 ? sums[7] / sums[8] : 1.0},
                     {"importance_clip_fraction", sums[10] > 0 ? sums[9] / sums[10] : 0.0},
                     {"kl_rollout_k3", sums[10] > 0 ? sums[11] / sums[10] : 0.0},
                     {"tokens", sums[12]},
                     {"response_length", sums[13] / sums[1]},
                     {"lr", schedule_.lr(step + 1)},
                     {"grad_norm", grad_norm.value_or(0.0)},
                     // rank 0's wall time of the step's phases
                     {"rollout_seconds", seconds(rollout_start, rollout_end)},
                     {"train_seconds", seconds(rollout_end, train_end)},
                     {"sync_seconds", seconds(train_end, sync_end)}};
    return m;
  }

  // Per-sample advantages of this rank's samples (groups of n consecutive).
  std::vector<float> advantages(const std::vector<float>& rewards) {
    const int64_t N = int64_t(rewards.size()), n = o_.samples_per_prompt;
    const Tensor r = Tensor::from_vector(rewards, {N});
    std::vector<int64_t> groups(static_cast<std::size_t>(N / n), n);
    if (o_.advantage != "reinforce++") return rl::grpo_advantages(r, groups, /*normalize_std=*/true).to_vector<float>();
    // REINFORCE++ with a group baseline: r - mean_group(r), whitened with the
    // mean and standard deviation of the global batch (one all-reduce).
    std::vector<float> a = rl::grpo_advantages(r, groups, /*normalize_std=*/false).to_vector<float>();
    double s = 0, s2 = 0;
    for (float x : a) {
      s += x;
      s2 += double(x) * x;
    }
    Tensor t = Tensor::from_vector(std::vector<float>{float(s), float(s2), float(N)}, {3}, device_);
    comm_.all_reduce(t);
    const auto g = t.to_vector<float>();
    const double mean = g[0] / g[2], var = std::max(0.0, g[1] / g[2] - mean * mean);
    for (float& x : a) x = float((x - mean) / (std::sqrt(var) + 1e-8));
    return a;
  }

  // Splits the rank's samples into micro-batches of at most
  // max_tokens_per_gpu tokens, as many as the rank that needs most.
  std::vector<MicroBatch> pack(const std::vector<std::vector<int32_t>>& prompts,
                               const std::vector<rollout::Completion>& done, const std::vector<float>& adv) {
    const int64_t N = int64_t(done.size()), n = o_.samples_per_prompt;
    std::vector<int64_t> len(static_cast<std::size_t>(N));
    int64_t needed = 1, budget = 0;
    for (int64_t s = 0; s < N; ++s) {
      len[std::size_t(s)] = int64_t(prompts[std::size_t(s / n)].size() + done[std::size_t(s)].tokens.size()) - 1;
      SLIME_CHECK(len[std::size_t(s)] <= o_.max_tokens_per_gpu, "a sequence of ", len[std::size_t(s)],
                  " tokens exceeds --max-tokens-per-gpu ", o_.max_tokens_per_gpu);
      if (budget + len[std::size_t(s)] > o_.max_tokens_per_gpu) {
        ++needed;
        budget = 0;
      }
      budget += len[std::size_t(s)];
    }
    Tensor t = Tensor::from_vector(std::vector<float>{float(needed)}, {1}, device_);
    comm_.all_reduce(t, comm::ReduceOp::max);
    const int64_t count = std::min<int64_t>(int64_t(t.to_vector<float>()[0]), N);
    std::vector<MicroBatch> mbs;
    for (int64_t c = 0; c < count; ++c) {
      const int64_t first = N * c / count, last = N * (c + 1) / count;
      std::vector<std::vector<int32_t>> inputs;
      std::vector<int32_t> targets, cu = {0};
      std::vector<uint8_t> mask;
      std::vector<float> rollout_lp, token_adv;
      int64_t response = 0;
      for (int64_t s = first; s < last; ++s) {
        const auto& p = prompts[std::size_t(s / n)];
        const auto& d = done[std::size_t(s)];
        std::vector<int32_t> seq = p;
        seq.insert(seq.end(), d.tokens.begin(), d.tokens.end());
        inputs.emplace_back(seq.begin(), seq.end() - 1);
        for (std::size_t i = 1; i < seq.size(); ++i) {
          targets.push_back(seq[i]);
          const bool resp = i >= p.size();  // predicts a response token
          mask.push_back(resp ? 1 : 0);
          rollout_lp.push_back(resp ? d.logprobs[i - p.size()] : 0.f);
          token_adv.push_back(resp ? adv[std::size_t(s)] : 0.f);
          response += resp;
        }
        cu.push_back(int32_t(targets.size()));
      }
      MicroBatch mb;
      const int64_t T = int64_t(targets.size());
      mb.batch = nn::make_packed_batch(inputs, device_);
      mb.targets = Tensor::from_vector(targets, {T}, device_);
      mb.loss_mask = Tensor::from_vector(mask, {T});
      mb.rollout_lp = Tensor::from_vector(rollout_lp, {T});
      mb.advantages = Tensor::from_vector(token_adv, {T});
      mb.cu_seqlens = Tensor::from_vector(cu, {int64_t(cu.size())});
      mb.response_tokens = response;
      mbs.push_back(std::move(mb));
    }
    return mbs;
  }

  // Importance weights of the trainer's logprobs against the engine's.
  rl::ImportanceResult importance(const Tensor& lp_host, const MicroBatch& mb) const {
    const std::string& c = o_.is_correction;
    if (c == "tis")
      return rl::ImportanceSampler<rl::Tis>(rl::Tis{o_.is_low, o_.is_high})(lp_host, mb.rollout_lp, mb.loss_mask,
                                                                            mb.cu_seqlens);
    auto with_mode = [&]<class Level>(Level) {
      auto run = [&]<class Mode>(Mode) {
        rl::Mis<Level, Mode> p;
        p.low = o_.is_low;
        p.high = o_.is_high;
        return rl::ImportanceSampler<rl::Mis<Level, Mode>>(p)(lp_host, mb.rollout_lp, mb.loss_mask, mb.cu_seqlens);
      };
      if (o_.mis_mode == "clip") return run(rl::Clip{});
      if (o_.mis_mode == "mask") return run(rl::Mask{});
      SLIME_CHECK(o_.mis_mode == "truncate", "--mis-mode '", o_.mis_mode, "': expected truncate, clip or mask");
      return run(rl::Truncate{});
    };
    if (c == "mis-token") return with_mode(rl::Token{});
    if (c == "mis-sequence") return with_mode(rl::Sequence{});
    SLIME_CHECK(c == "mis-geometric", "--is '", c, "': expected none, tis, mis-token, mis-sequence or mis-geometric");
    return with_mode(rl::Geometric{});
  }

  // ---- weights, checkpoints, export ------------------------------------------

  // The policy as a weight source (whole parameters, every expert).
  rollout::ShardedWeights<Policy> weights() const { return {policy_.get(), ep_.get()}; }

  // This rank's completions: from the colocated engine, or from its engine rank.
  std::vector<rollout::Completion> generate(const std::vector<rollout::Request>& requests) {
    if (remote_) {
      if (remote_->sync) broadcast_command(*remote_->sync, EngineCommand::rollout, 0, device_);
      const int engine = remote_->engine_of(comm_.rank());
      rollout::send_requests(*remote_->world, engine, requests, device_);
      return rollout::recv_completions(*remote_->world, engine, device_);
    }
    if (o_.offload) engine_->onload();
    std::vector<rollout::Completion> done = engine_->generate(requests);
    if (o_.offload) engine_->offload();
    return done;
  }

  // The policy's weights into the engine, one parameter gathered at a time
  // (collective: every rank runs the same gathers). Disaggregated: trainer
  // rank 0 broadcasts them to the engine ranks in buckets.
  void sync_engine(int64_t version) {
    const rollout::ShardedWeights<Policy> weights = this->weights();
    if (remote_) {
      if (remote_->sync) {
        broadcast_command(*remote_->sync, EngineCommand::weights, version, device_);
        rollout::send_weights(*remote_->sync, weights, version, dtype_, device_);
      } else {
        weights.for_each([](const std::string&, const Tensor&) {});  // the gathers are collective
      }
      return;
    }
    if (o_.offload) engine_->onload();
    rollout::sync_colocated(weights, *engine_, version);
    if (o_.offload) engine_->offload();
  }

  // The policy's training state (parallel::save_sharded_state: masters and
  // AdamW moments as ranges of the full tensors, expert stacks in whole-stack
  // coordinates), so a run with other --ranks or --ep resumes it.
  void save(const fs::path& dir, int64_t step) {
    io::TrainStateSaveOptions so;
    so.keep_last = 2;
    // "ranks" and "ep" for the record: a resume may use others.
    parallel::save_sharded_state(*policy_, comm_, dir, step, {{"step", step}, {"ranks", comm_.size()}, {"ep", o_.ep}},
                                 so);
  }

  // Any --ranks and --ep: the state reshards on load.
  int64_t resume(const fs::path& dir) {
    const nlohmann::json meta = parallel::load_sharded_state(*policy_, dir);
    return meta.at("step").template get<int64_t>();
  }

  // A Hugging Face directory of the current weights: rank 0 writes, every
  // rank takes part in the gathers (one parameter at a time).
  void export_hf(const fs::path& dir) {
    const std::vector<std::string> names = policy_->parameter_names();
    if (comm_.rank() != 0) {
      for (const std::string& name : names) (void)weights().whole(name);
      return;
    }
    std::vector<io::SafetensorsEntry> entries;
    std::vector<std::pair<std::size_t, int64_t>> source;  // (parameter, expert or -1) per entry
    nn::Qwen3Model& m = policy_->module();
    std::vector<nn::Parameter*> params;
    m.for_each_parameter([&](nn::Parameter& p) { params.push_back(&p); });
    std::size_t pi = 0;
    for (const std::string& name : names) {
      const auto it = std::find_if(params.begin(), params.end(), [&](nn::Parameter* p) { return p->name == name; });
      SLIME_CHECK(it != params.end(), "export: no parameter '", name, "'");
      const nn::Parameter& p = **it;
      const Shape shape = policy_->parameter_shape(name);
      if (p.is_expert_stack()) {  // every expert (the ep ranks' slices gathered)
        const std::vector<int64_t> dims(shape.begin() + 1, shape.end());
        for (int64_t e = 0; e < config_.num_experts; ++e) {
          entries.push_back({p.expert_name(e - p.first_expert), dtype_, Shape(std::span<const int64_t>(dims))});
          source.emplace_back(pi, e);
        }
      } else {
        entries.push_back({name, dtype_, shape});
        source.emplace_back(pi, -1);
      }
      ++pi;
    }
    std::size_t cached = SIZE_MAX, next = 0;
    Tensor full;
    io::export_hf_directory(dir, config_.to_json(), entries, [&](const io::SafetensorsEntry&) {
      const auto [p, e] = source[next++];
      if (cached != p) {
        full = weights().whole(names[p]);
        cached = p;
      }
      const std::vector<int64_t> row(full.shape().begin() + 1, full.shape().end());
      const Tensor t =
          e < 0 ? full : full.view(e * (full.numel() / full.size(0)), Shape(std::span<const int64_t>(row)));
      Tensor out = Tensor::empty(t.shape(), dtype_, t.device());
      ops::cast(t, out);
      return out.to(Device::cpu());
    });
  }

  const Options& o_;
  comm::Comm& comm_;
  Device device_;
  const RemoteRollout* remote_ = nullptr;           // disaggregated rollout
  std::unique_ptr<comm::Mesh> mesh_;                // --ep > 1: dp_shard x ep
  std::unique_ptr<parallel::ExpertParallel<>> ep_;  // --ep > 1 (outlives the models)
  DType dtype_ = DType::f32;
  nn::Qwen3Config config_;
  std::unique_ptr<data::Task> task_;
  std::optional<data::PromptDataset> dataset_;  // --prompts
  std::unique_ptr<Policy> policy_;
  std::optional<rl::ReferenceModel<>> ref_;
  std::unique_ptr<nn::Qwen3Model> engine_model_;
  std::unique_ptr<rollout::Engine> engine_;
  optim::LrSchedule schedule_ = optim::LrSchedule::constant(1e-3);
  rl::PolicyLossConfig loss_config_;
};

}  // namespace rl_example
