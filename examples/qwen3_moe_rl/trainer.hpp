// trainer.hpp (qwen3_moe_rl example): the RL trainer, one instance per rank.
// A step (train_step) is seven phases, each a short function below:
//
//   1. rollout     the rank's prompts -> rollout::Engine (the trainer's
//                  kernels; colocated on the rank's device, or on an engine
//                  rank under --rollout disaggregated) -> responses + logprobs
//   2. score       the task's verifier (or reward.hpp's function) per response
//   3. advantages  --advantage: GRPO / Dr. GRPO (group-normalised), REINFORCE++
//                  (token returns) or REINFORCE++ with a group baseline, both
//                  whitened over the global batch; one value per response token
//   4. pack        data::Packer: the responses (prompt + response) into
//                  micro-batches under --max-tokens-per-gpu, balanced, the
//                  same count on every rank (the FSDP gathers are collective)
//   5. train       per micro-batch: policy forward -> token logprobs -> TIS/MIS
//                  weights against the rollout logprobs -> reference logprobs
//                  (KL) -> teacher logprobs (--teacher: the advantages minus
//                  --opd-kl-coef x the reverse KL, rl::apply_opd) ->
//                  rl::policy_loss (--loss, global normalisers) ->
//                  backward through Sharded; then AdamW on the fp32 master
//                  shards (grad-norm clip, LR schedule)
//   6. sync        the new weights into the engine (one parameter gathered at a time)
//   7. log         StepMetrics reduced over the ranks; rank 0 writes JSONL /
//                  TensorBoard / the progress line
// and, every N steps and at the end, a checkpoint; at the end the HF export.
//
// One optimizer step per rollout, so the trainer's "old" logprobs are the
// logprobs of the training forward itself (the PPO ratio starts at 1); the
// importance weights correct the engine/trainer mismatch (rollout vs old).
//
// Parallelism: the mesh dp_shard x ep (ep innermost) is always built; at
// --ep 1 its ep axis has one rank and every code path is the same. The
// experts split over the ep ranks and each slice shards over the dp ranks.
//
// Colocation (--offload): the device holds either the policy's training
// state (train phase, checkpoints) or the engine's weights and KV cache
// (sync and rollout phases); the other waits in pinned host memory
// (Sharded::offload / Engine::offload), as does the reference model outside
// the train phase. metrics.jsonl's peak_memory_bytes is each step's device
// high-water mark (slime's allocator statistics; on the CPU, the process's
// host memory, which the rank threads share).
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

#include "options.hpp"
#include "remote_rollout.hpp"
#include "reward.hpp"
#include "slime/comm/comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/core/memory.hpp"
#include "slime/data/distributed.hpp"
#include "slime/data/packer.hpp"
#include "slime/data/prompt_dataset.hpp"
#include "slime/data/tasks.hpp"
#include "slime/io/metrics_log.hpp"
#include "slime/io/progress.hpp"
#include "slime/io/train_state.hpp"
#include "slime/nn/checkpoint.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/ops/host_checks.hpp"
#include "slime/optim/lr_schedule.hpp"
#include "slime/parallel/context_parallel.hpp"
#include "slime/parallel/expert_parallel.hpp"
#include "slime/parallel/export_hf.hpp"
#include "slime/parallel/sharded.hpp"
#include "slime/parallel/sharded_checkpoint.hpp"
#include "slime/rl/advantages.hpp"
#include "slime/rl/importance_sampler.hpp"
#include "slime/rl/logprob_mismatch.hpp"
#include "slime/rl/policy_loss.hpp"
#include "slime/rl/reference_model.hpp"
#include "slime/rollout/engine.hpp"
#include "slime/rollout/remote.hpp"
#include "slime/rollout/weight_sync.hpp"
#include "step_metrics.hpp"

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
  return rollout::EngineConfig{
      .max_batch = 256, .max_context = context, .kv_capacity = 0, .seed = o.seed, .record_routing = o.routing != "off"};
}

// What rank 0 keeps of a step.
struct StepReport {
  double reward = 0;
  double loss = 0;
};

// This rank's share of a step: its prompts, n responses each (prompt-major),
// and what the phases learn about them.
struct Rollout {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int64_t> dataset_rows;  // --prompts: each prompt's row
  std::vector<rollout::Completion> responses;
  std::vector<float> rewards;                  // per response
  std::vector<std::vector<float>> advantages;  // per response, per response token
};

// One packed micro-batch: the trainer's inputs (prompt + response without its
// last token) and per input position the target (the next token) and what
// the loss needs of it.
struct MicroBatch {
  nn::PackedBatch batch;             // the whole micro-batch (with --cp: its shape; this rank runs local)
  std::vector<int32_t> tokens_host;  // its tokens (--cp: the plan's input)
  Tensor targets;                    // i32 [T] on the device
  Tensor loss_mask;                  // u8 [T] host: 1 where the target is a response token
  Tensor rollout_lp;                 // f32 [T] host (0 outside the loss)
  Tensor advantages;                 // f32 [T] host (0 outside the loss)
  Tensor cu_seqlens;                 // i32 [S + 1] host
  int64_t response_tokens = 0;
  // --routing measure | replay: the engine's experts of every row, one i32
  // [T, k] per decoder layer on the device (undefined for dense layers);
  // rows outside the sequences (an empty micro-batch) go to experts 0..k-1.
  std::vector<Tensor> engine_routing;
  std::vector<uint8_t> routed_rows;  // 1 where a row's experts came from the engine
};

// Wall time of finished work: a lap first waits for the device.
class Stopwatch {
 public:
  explicit Stopwatch(Device device) : device_(device), start_(clock::now()), lap_(start_) {}
  double lap() {
    synchronize_device(device_);
    const clock::time_point now = clock::now();
    const double s = std::chrono::duration<double>(now - lap_).count();
    lap_ = now;
    return s;
  }
  double total() const { return std::chrono::duration<double>(lap_ - start_).count(); }

 private:
  using clock = std::chrono::steady_clock;
  Device device_;
  clock::time_point start_, lap_;
};

template <class Strategy>
class Trainer {
 public:
  using Policy = parallel::Sharded<nn::Qwen3Model, Strategy>;

  // `remote`: disaggregated rollout (remote_rollout.hpp); null: an engine
  // colocated on this rank's device. `comm`: the trainer ranks.
  Trainer(const Options& o, comm::Comm& comm, const RemoteRollout* remote = nullptr)
      : o_(o), comm_(comm), device_(comm.device()), remote_(remote) {
    dtype_ = device_.is_cuda() ? DType::bf16 : DType::f32;
    task_ = data::make_task(o.task);
    config_ = model_config(o);
    check_options();
    // The mesh dp_shard x cp x ep; experts only for a mixture of experts.
    mesh_ = std::make_unique<comm::Mesh>(
        comm, comm::MeshShape{.dp_replicate = 1, .dp_shard = comm.size() / (o.ep * o.cp), .cp = o.cp, .ep = o.ep});
    if (config_.is_moe()) ep_ = std::make_unique<parallel::ExpertParallel<>>(*mesh_, config_.num_experts);
    // --cp: the cp ranks of a data rank share its micro-batches, each holding
    // its plan's rows of every sequence; the model's attention (policy and
    // reference copies alike) runs through the ContextParallel.
    if (o.cp > 1)
      cp_ = std::make_unique<parallel::ContextParallel>(
          mesh_->comm(comm::Axis::cp), parallel::ContextParallelOptions{.ulysses = o.ulysses, .ring_kv = ring_kv(o)});
    // This rank's experts only (all of them at --ep 1).
    nn::Qwen3Model model(config_, {device_, dtype_}, ep_.get());
    model.set_sequence_attention(cp_.get());
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
      for (int64_t i = 0; i < dataset_->size(); ++i) check_label((*dataset_)[i].label, o.prompts, (*dataset_)[i].line);
      int64_t longest = 0;
      for (int64_t i = 0; i < dataset_->size(); ++i) longest = std::max<int64_t>(longest, (*dataset_)[i].tokens.size());
      context = longest + o.max_new_tokens;
    }
    if (o.kl_coef != 0) ref_.emplace(model, *mesh_, rl::ReferenceModelConfig{.update_every = 0, .offload = o.offload});
    if (!o.teacher.empty()) make_teacher();
    optim::AdamWConfig adamw;
    adamw.weight_decay = o.weight_decay;
    policy_ = std::make_unique<Policy>(std::move(model), *mesh_, parallel::ShardedOptions{}, adamw);
    if (remote_) {
      if (remote_->sync) broadcast_command(*remote_->sync, EngineCommand::hello, context, device_);
    } else {
      engine_model_ = std::make_unique<nn::Qwen3Model>(config_, nn::ModuleOptions{device_, dtype_});
      engine_ = std::make_unique<rollout::Engine>(*engine_model_, engine_config(o, context));
    }
    schedule_ = o.lr_schedule == "cosine"   ? optim::LrSchedule::cosine(o.lr, o.warmup_steps, o.steps, o.min_lr)
                : o.lr_schedule == "warmup" ? optim::LrSchedule::linear_warmup(o.lr, std::max(o.warmup_steps, 1))
                                            : optim::LrSchedule::constant(o.lr);
    // --cp: a micro-batch of the whole cp group (each rank holds 1/cp of its
    // tokens), each sample padded to the layout's multiple (its zigzag chunks
    // and Ulysses parts; the padding is outside the loss).
    packer_.emplace(data::PackConfig{
        .dp_size = 1,
        .max_tokens_per_gpu = o.max_tokens_per_gpu * o.cp,
        .pad_sequence_to = o.cp > 1 ? int(parallel::CpPlan::multiple(o.ulysses, o.cp / o.ulysses)) : 1});
  }

  // Runs the steps; rank 0 logs. Returns the per-step reports (every rank).
  std::vector<StepReport> run() {
    std::vector<StepReport> reports = run_steps();
    if (remote_ && remote_->sync) broadcast_command(*remote_->sync, EngineCommand::stop, 0, device_);
    return reports;
  }

 private:
  // --teacher: a frozen model over the policy's mesh (any config with the
  // policy's vocabulary; its own expert split under --ep), offloaded outside
  // the train phase like the reference.
  void make_teacher() {
    const nn::Qwen3Config tc = nn::Qwen3Config::from_file(fs::path(o_.teacher) / "config.json");
    SLIME_CHECK(tc.vocab_size == config_.vocab_size, "--teacher ", o_.teacher, ": vocabulary of ", tc.vocab_size,
                " tokens, the policy's has ", config_.vocab_size);
    SLIME_CHECK(!tc.is_moe() || tc.num_experts % o_.ep == 0, "--teacher ", o_.teacher, ": --ep ", o_.ep,
                " must divide its ", tc.num_experts, " experts");
    if (tc.is_moe()) teacher_ep_ = std::make_unique<parallel::ExpertParallel<>>(*mesh_, tc.num_experts);
    nn::Qwen3Model t(tc, {device_, dtype_}, teacher_ep_.get());
    t.set_sequence_attention(cp_.get());
    nn::load_hf_weights(t, o_.teacher);
    teacher_.emplace(std::move(t), *mesh_, rl::ReferenceModelConfig{.update_every = 0, .offload = o_.offload});
  }

  // Every option the trainer reads, checked before anything is built.
  void check_options() const {
    SLIME_CHECK(o_.cp >= 1 && comm_.size() % (o_.cp * o_.ep) == 0, "--cp ", o_.cp, " x --ep ", o_.ep,
                " must divide the ", comm_.size(), " ranks");
    SLIME_CHECK(o_.ulysses >= 1 && o_.cp % o_.ulysses == 0, "--ulysses ", o_.ulysses, " must divide --cp ", o_.cp);
    SLIME_CHECK(config_.num_attention_heads % o_.ulysses == 0 && config_.num_key_value_heads % o_.ulysses == 0,
                "--ulysses ", o_.ulysses, " must divide the model's ", config_.num_attention_heads,
                " attention heads and ", config_.num_key_value_heads, " KV heads");
    SLIME_CHECK(o_.cp == 1 || o_.rollout_mode == "colocated", "--cp ", o_.cp,
                " needs --rollout colocated (disaggregated engines serve data-parallel ranks only)");
    (void)ring_kv(o_);
    const int W = comm_.size() / o_.cp;  // data ranks: the cp ranks of one share its prompts
    SLIME_CHECK(o_.prompts_per_rollout % W == 0, "--prompts-per-rollout ", o_.prompts_per_rollout,
                " must divide over the ", W, " data-parallel ranks");
    SLIME_CHECK(o_.samples_per_prompt >= 2, "--samples-per-prompt must be >= 2 (a group needs a baseline)");
    SLIME_CHECK(o_.ep >= 1 && W % o_.ep == 0, "--ep ", o_.ep, " must be >= 1 and divide the ", W, " ranks");
    SLIME_CHECK(config_.is_moe() || o_.ep == 1, "--ep ", o_.ep, ": the model is not a mixture of experts");
    SLIME_CHECK(!config_.is_moe() || config_.num_experts % o_.ep == 0, "--ep ", o_.ep, " must divide the ",
                config_.num_experts, " experts");
    (void)advantage_kind();
    (void)loss_config(o_);
    (void)parse_choice<int>("--is", o_.is_correction,
                            {{"none", 0}, {"tis", 0}, {"mis-token", 0}, {"mis-sequence", 0}, {"mis-geometric", 0}});
    (void)parse_choice<int>("--mis-mode", o_.mis_mode, {{"truncate", 0}, {"clip", 0}, {"mask", 0}});
    (void)is_renormalize();
    (void)parse_choice<int>("--lr-schedule", o_.lr_schedule, {{"constant", 0}, {"warmup", 0}, {"cosine", 0}});
    (void)routing_mode();
    SLIME_CHECK(config_.is_moe() || o_.routing == "off", "--routing ", o_.routing,
                ": the model is not a mixture of experts (it has no routing to record or replay)");
  }

  enum class RoutingMode { off, measure, replay };
  RoutingMode routing_mode() const {
    return parse_choice<RoutingMode>(
        "--routing", o_.routing,
        {{"off", RoutingMode::off}, {"measure", RoutingMode::measure}, {"replay", RoutingMode::replay}});
  }

  static parallel::RingKv ring_kv(const Options& o) {
    return parse_choice<parallel::RingKv>("--ring-kv", o.ring_kv,
                                          {{"p2p", parallel::RingKv::p2p},
                                           {"all-gather", parallel::RingKv::all_gather},
                                           {"auto", parallel::RingKv::automatic}});
  }

  // The data-parallel ranks (dp_shard x ep: each has its own prompts) and
  // this rank's index among them; the cp ranks of one share its data.
  int data_ranks() const { return comm_.size() / o_.cp; }
  int data_rank() const {
    return mesh_->coord(comm::Axis::dp_shard) * mesh_->size(comm::Axis::ep) + mesh_->coord(comm::Axis::ep);
  }

  std::vector<StepReport> run_steps() {
    const fs::path out = o_.out_dir, ckpt = out / "checkpoints";
    int64_t start = 0;
    if (o_.resume) start = resume(ckpt);
    if (dataset_ && start > 0) (void)dataset_->next_batch(start * o_.prompts_per_rollout);  // the data position
    sync_engine(start);
    if (comm_.rank() == 0) {
      fs::create_directories(out);
      io::MetricsLogOptions lo;
      if (o_.resume) lo.resume_step = start + 1;  // steps are logged 1-based: keep 1..start
      if (o_.tensorboard) lo.tensorboard_dir = out / "tensorboard";
      log_ = std::make_unique<io::MetricsLog>(out / "metrics.jsonl", lo);
      io::ProgressOptions po;
      po.total_steps = o_.steps;
      po.print_every = std::max(1, o_.steps / 10);
      progress_ = std::make_unique<io::Progress>(std::cout, po, start);
    }
    std::vector<StepReport> reports;
    for (int64_t step = start; step < o_.steps; ++step) {
      reports.push_back(train_step(step));
      const bool last = step + 1 == o_.steps;
      if (last || (o_.checkpoint_every > 0 && (step + 1) % o_.checkpoint_every == 0)) save(ckpt, step + 1);
    }
    if (progress_) progress_->finish();
    if (o_.export_hf) parallel::save_hf(*policy_, comm_, config_, out / "hf", {.dtype = dtype_, .ep = ep_.get()});
    return reports;
  }

  // ---- one step ----------------------------------------------------------

  // The seven phases (see the top of the file).
  StepReport train_step(int64_t step) {
    StepMetrics m;
    Stopwatch watch(device_);
    reset_peak_memory_stats(device_);
    Rollout r = rollout(step);
    m.rollout_seconds = watch.lap();
    score(r, m);
    advantages(r);
    std::vector<MicroBatch> mbs = pack(r);
    train(mbs, step, m);
    m.train_seconds = watch.lap();
    sync_engine(step + 1);
    m.sync_seconds = watch.lap();
    m.step_seconds = watch.total();
    return log_step(step, m);
  }

  // 1. This rank's prompts (every rank draws the step's whole batch in the
  // same order and takes its slice), n samples each, keyed by their global
  // slot: the same samples whatever the rank count.
  Rollout rollout(int64_t step) {
    const int64_t per_rank = o_.prompts_per_rollout / data_ranks(), n = o_.samples_per_prompt;
    Rollout r;
    std::vector<int64_t> batch;  // dataset rows of the step's prompts
    if (dataset_) batch = dataset_->next_batch(o_.prompts_per_rollout);
    std::vector<rollout::Request> requests;
    for (int64_t i = 0; i < per_rank; ++i) {
      const int64_t slot = data_rank() * per_rank + i;
      const uint64_t g = uint64_t(step) * uint64_t(o_.prompts_per_rollout) + uint64_t(slot);
      if (dataset_) r.dataset_rows.push_back(batch[std::size_t(slot)]);
      r.prompts.push_back(dataset_ ? (*dataset_)[r.dataset_rows.back()].tokens : task_->prompt(o_.seed, g));
      for (int64_t j = 0; j < n; ++j) {
        rollout::Request q;
        q.prompt = r.prompts.back();
        q.sample_id = g * uint64_t(n) + uint64_t(j);
        q.sampling.temperature = o_.temperature;
        q.sampling.max_new_tokens = dataset_ ? o_.max_new_tokens : task_->answer_length() + 1;
        q.sampling.stop_tokens = {dataset_ ? int32_t(o_.eos_token) : data::TaskVocab::kEos};
        requests.push_back(std::move(q));
      }
    }
    r.responses = generate(requests);
    for (const rollout::Completion& c : r.responses)
      SLIME_CHECK(c.finish != rollout::FinishReason::error && !c.tokens.empty(), "rollout failed: ", c.error);
    if (cp_) check_same_over_cp(r);
    return r;
  }

  // The cp ranks of a data rank generated its responses each (same
  // weights, prompts and sample keys: the same tokens); a hash of them must
  // agree, or the cp ranks would train on different sequences.
  void check_same_over_cp(const Rollout& r) const {
    uint64_t h = 1469598103934665603ull;
    for (const rollout::Completion& c : r.responses)
      for (int32_t t : c.tokens) h = (h ^ uint64_t(uint32_t(t))) * 1099511628211ull;
    const int64_t v = int64_t(h >> 1);
    // One all_reduce: max of v and of -v (the min) over the cp ranks.
    Tensor t = Tensor::from_vector(std::vector<int64_t>{v, -v}, {2}, device_);
    mesh_->comm(comm::Axis::cp).all_reduce(t, comm::ReduceOp::max);
    const std::vector<int64_t> m = t.to_vector<int64_t>();
    SLIME_CHECK(m[0] == -m[1],
                "--cp: the cp ranks of a data rank generated different responses (their engines differ)");
  }

  // 2. Rewards: the task's verifier, or the user's function for a dataset.
  void score(Rollout& r, StepMetrics& m) {
    const std::size_t n = std::size_t(o_.samples_per_prompt);
    r.rewards.resize(r.responses.size());
    for (std::size_t s = 0; s < r.responses.size(); ++s) {
      const std::vector<int32_t>& prompt = r.prompts[s / n];
      const std::vector<int32_t>& response = r.responses[s].tokens;
      r.rewards[s] = float(dataset_ ? user_reward(prompt, response, (*dataset_)[r.dataset_rows[s / n]].label)
                                    : task_->reward(prompt, response));
      m.reward += r.rewards[s];
    }
    m.samples = int64_t(r.responses.size());
  }

  enum class AdvantageKind { grpo, dr_grpo, reinforce_pp, reinforce_pp_baseline };
  AdvantageKind advantage_kind() const {
    return parse_choice<AdvantageKind>("--advantage", o_.advantage,
                                       {{"grpo", AdvantageKind::grpo},
                                        {"dr-grpo", AdvantageKind::dr_grpo},
                                        {"reinforce++", AdvantageKind::reinforce_pp},
                                        {"reinforce++-baseline", AdvantageKind::reinforce_pp_baseline}});
  }

  // 3. Advantages (rl/advantages.hpp) of the rank's responses, groups of n
  // consecutive ones (a prompt's group never straddles ranks). GRPO's are
  // per response; REINFORCE++'s per token, on the responses packed as
  // sequences of their tokens, then whitened over the global batch.
  void advantages(Rollout& r) {
    const int64_t N = int64_t(r.responses.size()), n = o_.samples_per_prompt;
    const std::vector<int64_t> groups(std::size_t(N / n), n);
    const AdvantageKind kind = advantage_kind();
    r.advantages.resize(std::size_t(N));
    if (kind == AdvantageKind::grpo || kind == AdvantageKind::dr_grpo) {
      const std::vector<float> a = rl::grpo_advantages(Tensor::from_vector(r.rewards, {N}), groups,
                                                       /*normalize_std=*/kind == AdvantageKind::grpo)
                                       .template to_vector<float>();
      for (int64_t s = 0; s < N; ++s)
        r.advantages[std::size_t(s)].assign(r.responses[std::size_t(s)].tokens.size(), a[std::size_t(s)]);
      return;
    }
    std::vector<int32_t> cu = {0};
    for (const rollout::Completion& c : r.responses) cu.push_back(cu.back() + int32_t(c.tokens.size()));
    const int64_t T = cu.back();
    const std::vector<uint8_t> mask(std::size_t(T), 1);
    std::vector<float> a(std::size_t(T), 0.f);
    // The KL to the reference enters through the loss (--kl-coef), not the returns.
    if (kind == AdvantageKind::reinforce_pp) {
      rl::cpu::reinforce_pp_advantages<float>(r.rewards.data(), nullptr, mask.data(), cu.data(), N, T, 0.0, o_.gamma,
                                              /*whiten_batch=*/false, a.data());
    } else {
      rl::cpu::reinforce_pp_baseline_advantages<float>(r.rewards.data(), groups.data(), int64_t(groups.size()), nullptr,
                                                       mask.data(), cu.data(), N, T, 0.0, /*whiten_batch=*/false,
                                                       a.data());
    }
    whiten_over_ranks(a);
    for (int64_t s = 0; s < N; ++s)
      r.advantages[std::size_t(s)].assign(a.begin() + cu[std::size_t(s)], a.begin() + cu[std::size_t(s + 1)]);
  }

  // x <- (x - mean) / sqrt(var + 1e-8), mean and population variance over
  // every rank's values (rl::cpu::whiten's formula on the global batch).
  void whiten_over_ranks(std::vector<float>& x) {
    double moments[2] = {double(x.size()), 0};
    for (float v : x) moments[1] += v;
    sum_over_ranks(comm_, moments);
    const double mean = moments[0] > 0 ? moments[1] / moments[0] : 0;
    double ss[1] = {0};
    for (float v : x) ss[0] += (double(v) - mean) * (double(v) - mean);
    sum_over_ranks(comm_, ss);
    const double inv = 1 / std::sqrt((moments[0] > 0 ? ss[0] / moments[0] : 0) + rl::whiten_eps);
    for (float& v : x) v = float((double(v) - mean) * inv);
  }

  // 4. The rank's responses as data::Samples (inputs: prompt + response
  // without its last token; the last |response| inputs predict the response),
  // split by the Packer into as many micro-batches as the rank that needs most.
  std::vector<MicroBatch> pack(const Rollout& r) {
    const std::size_t n = std::size_t(o_.samples_per_prompt);
    std::vector<data::Sample> samples(r.responses.size());
    std::vector<int64_t> lengths;
    for (std::size_t s = 0; s < samples.size(); ++s) {
      const rollout::Completion& c = r.responses[s];
      data::Sample& x = samples[s];
      x.tokens = r.prompts[s / n];
      x.tokens.insert(x.tokens.end(), c.tokens.begin(), c.tokens.end());
      x.tokens.pop_back();
      x.response_length = int32_t(c.tokens.size());
      x.loss_mask.assign(c.tokens.size(), 1);
      x.rollout_log_probs = c.logprobs;
      x.reward = r.rewards[s];
      x.group_index = int64_t(s / n);
      lengths.push_back(x.length());
    }
    const data::PackConfig& pc = packer_->config();
    const int count = data::agree_micro_batch_count(comm_, data::local_micro_batch_count(pc, lengths));
    std::vector<MicroBatch> mbs;
    for (const data::MicroBatchPlan& plan : data::split_micro_batches(pc, lengths, count))
      mbs.push_back(to_micro_batch(packer_->pack(plan, samples), r, samples));
    return mbs;
  }

  // The tensors of one packed micro-batch. An empty one (a rank with fewer
  // responses than the agreed count) is one token outside the loss: its
  // forward and backward still run, to match the peers' collectives.
  MicroBatch to_micro_batch(data::MicroBatch p, const Rollout& r, const std::vector<data::Sample>& samples) const {
    if (p.sample_index.empty()) {
      p.tokens = p.positions = {0};
      p.loss_mask = {0};
      p.cu_seqlens = {0, 1};
      p.max_seqlen = 1;
    }
    const int64_t T = p.num_tokens();
    std::vector<int32_t> targets(std::size_t(T), 0);
    std::vector<float> rollout_lp(std::size_t(T), 0.f), adv(std::size_t(T), 0.f);
    MicroBatch mb;
    for (int q = 0; q < p.num_sequences(); ++q) {
      const std::size_t i = std::size_t(p.sample_index[std::size_t(q)]);
      const data::Sample& x = samples[i];
      const int64_t begin = p.cu_seqlens[std::size_t(q)], len = x.length(), first = begin + len - x.response_length;
      for (int64_t t = 0; t + 1 < len; ++t) targets[std::size_t(begin + t)] = x.tokens[std::size_t(t + 1)];
      targets[std::size_t(begin + len - 1)] = r.responses[i].tokens.back();
      for (int64_t j = 0; j < x.response_length; ++j) {
        rollout_lp[std::size_t(first + j)] = x.rollout_log_probs[std::size_t(j)];
        adv[std::size_t(first + j)] = r.advantages[i][std::size_t(j)];
      }
      mb.response_tokens += x.response_length;
    }
    const int64_t S = int64_t(p.cu_seqlens.size()) - 1;
    mb.batch.tokens = Tensor::from_vector(p.tokens, {T}, device_);
    mb.batch.positions = Tensor::from_vector(p.positions, {T}, device_);
    mb.batch.cu_seqlens = Tensor::from_vector(p.cu_seqlens, {S + 1}, device_);
    mb.batch.cu_seqlens_host = p.cu_seqlens;
    mb.batch.max_seqlen = p.max_seqlen;
    // Checked on the host: an out-of-range target traps in the GPU kernel.
    ops::check_token_targets(std::span<const int32_t>(targets), config_.vocab_size, "qwen3_moe_rl: micro-batch");
    mb.targets = Tensor::from_vector(targets, {T}, device_);
    mb.tokens_host = p.tokens;
    mb.loss_mask = Tensor::from_vector(p.loss_mask, {T});
    mb.rollout_lp = Tensor::from_vector(rollout_lp, {T});
    mb.advantages = Tensor::from_vector(adv, {T});
    mb.cu_seqlens = Tensor::from_vector(p.cu_seqlens, {S + 1});
    if (routing_mode() != RoutingMode::off) engine_routing(p, r, samples, mb);
    return mb;
  }

  // The engine's experts (Completion::routing: [rows][sparse layers][k],
  // rows = the sample's inputs) laid out as the micro-batch's rows, one
  // [T, k] tensor per sparse layer.
  void engine_routing(const data::MicroBatch& p, const Rollout& r, const std::vector<data::Sample>& samples,
                      MicroBatch& mb) const {
    const int64_t T = p.num_tokens(), k = config_.num_experts_per_tok;
    std::vector<int> sparse;
    for (int i = 0; i < config_.num_hidden_layers; ++i)
      if (config_.is_sparse_layer(i)) sparse.push_back(i);
    const int64_t L = int64_t(sparse.size());
    std::vector<std::vector<int32_t>> ids(std::size_t(L), std::vector<int32_t>(std::size_t(T * k)));
    for (std::vector<int32_t>& v : ids)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < k; ++j) v[std::size_t(t * k + j)] = int32_t(j);
    mb.routed_rows.assign(std::size_t(T), 0);
    for (int q = 0; q < p.num_sequences(); ++q) {
      const std::size_t i = std::size_t(p.sample_index[std::size_t(q)]);
      const std::vector<int32_t>& rec = r.responses[i].routing;
      const int64_t begin = p.cu_seqlens[std::size_t(q)], len = samples[i].length();
      SLIME_CHECK(int64_t(rec.size()) == len * L * k, "--routing: the engine recorded ", rec.size(),
                  " expert ids for response ", i, ", expected ", len, " rows x ", L, " sparse layers x ", k);
      for (int64_t t = 0; t < len; ++t) {
        mb.routed_rows[std::size_t(begin + t)] = 1;
        for (int64_t l = 0; l < L; ++l)
          std::copy_n(rec.begin() + (t * L + l) * k, k, ids[std::size_t(l)].begin() + (begin + t) * k);
      }
    }
    mb.engine_routing.assign(std::size_t(config_.num_hidden_layers), Tensor());
    for (int64_t l = 0; l < L; ++l)
      mb.engine_routing[std::size_t(sparse[std::size_t(l)])] =
          Tensor::from_vector(ids[std::size_t(l)], {T, k}, device_);
  }

  // --routing measure: over the micro-batch's sequence rows and sparse
  // layers, the (row, layer) pairs whose k experts the trainer's router chose
  // as the engine did (as sets: the order of equal-weight experts may differ).
  void count_routing_agreement(const MicroBatch& mb, const std::vector<Tensor>& trainer, StepMetrics& m) const {
    const int64_t k = config_.num_experts_per_tok;
    for (std::size_t l = 0; l < trainer.size(); ++l) {
      if (!trainer[l].defined()) continue;
      const Tensor whole = cp_ ? cp_->gather(trainer[l]) : trainer[l];
      const std::vector<int32_t> mine = whole.to_vector<int32_t>(), theirs = mb.engine_routing[l].to_vector<int32_t>();
      for (std::size_t t = 0; t < mb.routed_rows.size(); ++t) {
        if (mb.routed_rows[t] == 0) continue;
        std::vector<int32_t> a(mine.begin() + int64_t(t) * k, mine.begin() + int64_t(t + 1) * k);
        std::vector<int32_t> b(theirs.begin() + int64_t(t) * k, theirs.begin() + int64_t(t + 1) * k);
        std::sort(a.begin(), a.end());
        std::sort(b.begin(), b.end());
        ++m.routing_rows;
        if (a == b) ++m.routing_agreed;
      }
    }
  }

  // 5. Loss and backward, micro-batch by micro-batch, with the normalisers
  // of the global batch; then the optimizer step.
  void train(std::vector<MicroBatch>& mbs, int64_t step, StepMetrics& m) {
    device_to_trainer();
    const rl::LossNormalizer norm = global_normalizer(mbs);
    policy_->zero_grad();
    policy_->set_micro_batches(int(mbs.size()));
    if (ref_ && o_.offload) ref_->onload();
    if (teacher_ && o_.offload) teacher_->onload();
    for (MicroBatch& mb : mbs) {
      train_micro_batch(mb, norm, m);
      m.tokens += mb.batch.num_tokens();
      m.response_tokens += mb.response_tokens;
    }
    if (ref_ && o_.offload) ref_->offload();
    if (teacher_ && o_.offload) teacher_->offload();
    if (o_.offload) ctx_ = {};  // the activation buffers leave the device with the training state
    m.lr = schedule_.lr(step + 1);
    m.grad_norm = policy_->optimizer_step(m.lr, o_.max_grad_norm).value_or(0.0);
  }

  // The loss's token and sequence counts over every micro-batch of every rank;
  // a padding micro-batch (no response) is no sample and is not counted.
  rl::LossNormalizer global_normalizer(const std::vector<MicroBatch>& mbs) {
    rl::LossNormalizer norm;
    for (const MicroBatch& mb : mbs) {
      if (mb.response_tokens > 0) norm += rl::count_normalizer(mb.loss_mask, mb.cu_seqlens);
    }
    Tensor t =
        Tensor::from_vector(std::vector<int64_t>{norm.tokens, norm.sequences, norm.nonempty_sequences}, {3}, device_);
    comm_.all_reduce(t);
    const std::vector<int64_t> v = t.to_vector<int64_t>();
    return {v[0] / o_.cp, v[1] / o_.cp, v[2] / o_.cp};  // every cp rank counted its data rank's micro-batches
  }

  // With --cp the forward runs on this rank's rows (cp_->local_batch); the
  // per-token logprobs, entropies and reference logprobs are gathered to the
  // whole micro-batch, the loss is computed there (the same on every cp rank:
  // sequence-level terms see whole sequences), and its gradients go back to
  // this rank's rows for the backward.
  void train_micro_batch(MicroBatch& mb, const rl::LossNormalizer& norm, StepMetrics& m) {
    nn::PackedBatch local = mb.batch;
    Tensor targets = mb.targets;
    if (cp_) {
      cp_->plan(mb.batch.cu_seqlens_host);
      local = cp_->local_batch(mb.tokens_host);
      targets = cp_->local_rows(mb.targets);
    }
    const auto whole = [&](const Tensor& t) { return cp_ ? cp_->gather(t) : t; };
    typename Policy::Context& ctx = ctx_;  // reused: its buffers hold every micro-batch's activations
    const RoutingMode routing = routing_mode();
    ctx.routing_replay.clear();
    if (routing == RoutingMode::replay)
      for (const Tensor& ids : mb.engine_routing)
        ctx.routing_replay.push_back(cp_ && ids.defined() ? cp_->local_rows(ids) : ids);
    ctx.record_routing = routing == RoutingMode::measure;
    const Tensor hidden = policy_->forward(local, ctx);
    if (routing == RoutingMode::measure) count_routing_agreement(mb, ctx.routing, m);
    const ops::TokenLogprobs fwd = policy_->token_logprobs(ctx, hidden, targets, o_.temperature);
    rl::PolicyLossTensors in;
    in.lp = whole(fwd.logprobs);
    in.old_lp = in.lp;  // one update per rollout: old = current (detached)
    in.advantages = mb.advantages.to(device_);
    in.loss_mask = mb.loss_mask.to(device_);
    in.cu_seqlens = mb.batch.cu_seqlens;
    if (o_.entropy_coef != 0) in.entropy = whole(fwd.entropy);
    if (ref_) in.ref_lp = whole(ref_->logprobs(local, targets, o_.temperature));
    if (teacher_) in.advantages = distill(in.lp, whole(teacher_->logprobs(local, targets, o_.temperature)), mb, m);
    const Tensor lp_host = in.lp.to(Device::cpu());
    m.on_policy += rl::logprob_mismatch(lp_host, mb.rollout_lp, mb.loss_mask);  // the engine/trainer gap
    if (o_.is_correction != "none") {
      const rl::ImportanceResult w = importance(lp_host, mb);
      m.importance += w.metrics;
      in.is_weights = w.weights.to(device_);
      in.keep_mask = w.keep_mask.to(device_);
    }
    const rl::PolicyLossResult res = rl::policy_loss(loss_config(o_), norm, in);
    m.loss += res.metrics;
    const auto mine = [&](const Tensor& g) { return cp_ && g.defined() ? cp_->local_rows(g) : g; };
    policy_->backward(ctx, policy_->token_logprobs_backward(ctx, hidden, targets, o_.temperature, fwd,
                                                            mine(res.grad_lp), mine(res.grad_entropy)));
  }

  // On-policy distillation (rl::apply_opd, as slime's --opd-kl-coef): the
  // micro-batch's advantages minus opd_kl_coef x (student lp - teacher lp),
  // the student's being this forward's (= old: one update per rollout). With
  // the reinforce++ estimators it comes after their whitening (slime: before
  // --normalize-advantages); with GRPO the two orders agree.
  Tensor distill(const Tensor& lp, const Tensor& teacher_lp, const MicroBatch& mb, StepMetrics& m) const {
    const int64_t T = mb.advantages.size(0);
    Tensor adv = Tensor::from_vector(mb.advantages.to_vector<float>(), {T});
    const Tensor rkl =
        rl::apply_opd(adv, lp.to(Device::cpu()), teacher_lp.to(Device::cpu()), mb.loss_mask, o_.opd_kl_coef);
    for (float v : rkl.to_vector<float>()) m.opd_reverse_kl += v;
    return adv.to(device_);
  }

  static rl::PolicyLossConfig loss_config(const Options& o) {
    rl::PolicyLossConfig c;
    c.kind = parse_choice<rl::PolicyLossKind>(
        "--loss", o.loss,
        {{"ppo", rl::PolicyLossKind::ppo}, {"gspo", rl::PolicyLossKind::gspo}, {"cispo", rl::PolicyLossKind::cispo}});
    c.aggregation = parse_choice<rl::Aggregation>("--loss-agg", o.loss_aggregation,
                                                  {{"token_mean", rl::Aggregation::token_mean},
                                                   {"seq_mean_token_mean", rl::Aggregation::seq_mean_token_mean},
                                                   {"seq_mean_token_sum", rl::Aggregation::seq_mean_token_sum}});
    c.eps_clip = o.eps_clip;
    c.eps_clip_high = o.eps_clip_high;
    c.eps_clip_c = o.eps_clip_c;
    c.entropy_coef = o.entropy_coef;
    c.kl_coef = o.kl_coef;
    c.kl_estimator = parse_choice<rl::KlEstimator>("--kl-type", o.kl_type,
                                                   {{"k1", rl::KlEstimator::k1},
                                                    {"k2", rl::KlEstimator::k2},
                                                    {"k3", rl::KlEstimator::k3},
                                                    {"low_var_kl", rl::KlEstimator::low_var_kl}});
    c.unbiased_kl = o.unbiased_kl;
    c.empty_sequences = parse_choice<rl::EmptySequences>(
        "--loss-empty", o.empty_sequences, {{"count", rl::EmptySequences::count}, {"skip", rl::EmptySequences::skip}});
    return c;
  }

  rl::MisRenormalize is_renormalize() const {
    return parse_choice<rl::MisRenormalize>(
        "--is-renormalize", o_.is_renormalize,
        {{"off", rl::MisRenormalize::off}, {"batch", rl::MisRenormalize::batch}, {"kept", rl::MisRenormalize::kept}});
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
        p.renormalize = is_renormalize();
        return rl::ImportanceSampler<rl::Mis<Level, Mode>>(p)(lp_host, mb.rollout_lp, mb.loss_mask, mb.cu_seqlens);
      };
      if (o_.mis_mode == "clip") return run(rl::Clip{});
      if (o_.mis_mode == "mask") return run(rl::Mask{});
      return run(rl::Truncate{});  // --mis-mode truncate
    };
    if (c == "mis-token") return with_mode(rl::Token{});
    if (c == "mis-sequence") return with_mode(rl::Sequence{});
    return with_mode(rl::Geometric{});  // --is mis-geometric
  }

  // 7. The step's metrics over every rank; rank 0 writes them.
  StepReport log_step(int64_t step, StepMetrics& m) {
    m.peak_memory_bytes = memory_stats(device_).peak_bytes;
    if (cp_ && mesh_->coord(comm::Axis::cp) != 0) {  // the cp ranks of a data rank measured the same step
      StepMetrics peak;
      peak.peak_memory_bytes = m.peak_memory_bytes;
      m = peak;
    }
    m.reduce(comm_);
    const io::Scalars s = m.scalars();
    const auto value = [&](std::string_view key) {
      for (const auto& [k, v] : s)
        if (k == key) return v;
      return 0.0;
    };
    if (log_) {
      log_->log(step + 1, s);
      progress_->update(step + 1, {{"reward", value("reward")},
                                   {"loss", value("loss")},
                                   {"kl", value("kl")},
                                   {"tis_w", value("importance_weight_mean")},
                                   {"tok/s", value("tokens_per_s")}});
    }
    return {value("reward"), value("loss")};
  }

  // ---- the engine, colocation ---------------------------------------------

  // --offload, colocated: which of the two holds the device (see the top).
  void device_to_engine() {
    if (!o_.offload || !engine_ || engine_on_device_) return;
    policy_->offload();
    engine_->onload();
    engine_on_device_ = true;
  }
  void device_to_trainer() {
    if (!o_.offload || !engine_ || !engine_on_device_) return;
    engine_->offload();
    policy_->onload();
    engine_on_device_ = false;
  }

  // This rank's completions: from the colocated engine, or from its engine rank.
  std::vector<rollout::Completion> generate(const std::vector<rollout::Request>& requests) {
    if (remote_) {
      if (remote_->sync) broadcast_command(*remote_->sync, EngineCommand::rollout, 0, device_);
      const int engine = remote_->engine_of(comm_.rank());
      rollout::send_requests(*remote_->world, engine, requests, device_);
      return rollout::recv_completions(*remote_->world, engine, device_);
    }
    device_to_engine();
    return engine_->generate(requests);
  }

  // 6. The policy's weights into the engine, one whole parameter gathered at a
  // time (collective: every rank runs the same gathers). Disaggregated:
  // trainer rank 0 broadcasts them to the engine ranks in buckets.
  void sync_engine(int64_t version) {
    const rollout::ShardedWeights<Policy> weights{policy_.get(), ep_.get()};
    if (remote_) {
      if (remote_->sync) {
        broadcast_command(*remote_->sync, EngineCommand::weights, version, device_);
        rollout::send_weights(*remote_->sync, weights, version, dtype_, device_);
      } else {
        weights.for_each([](const std::string&, const Tensor&) {});  // the gathers are collective
      }
      return;
    }
    device_to_engine();  // gathers from the offloaded policy's host masters
    rollout::sync_colocated(weights, *engine_, version);
  }

  // ---- checkpoints -------------------------------------------------------

  // The policy's training state (parallel::save_sharded_state: masters and
  // AdamW moments as ranges of the full tensors, expert stacks in whole-stack
  // coordinates), so a run with other --ranks or --ep resumes it.
  void save(const fs::path& dir, int64_t step) {
    device_to_trainer();
    io::TrainStateSaveOptions so;
    so.keep_last = 2;
    so.run_id = run_id_;  // empty until a resume: this process's
    // "ranks" and "ep" for the record: a resume may use others.
    parallel::save_sharded_state(*policy_, comm_, dir, step, {{"step", step}, {"ranks", comm_.size()}, {"ep", o_.ep}},
                                 so);
  }

  // Any --ranks and --ep: the state reshards on load.
  int64_t resume(const fs::path& dir) {
    const nlohmann::json meta = parallel::load_sharded_state(*policy_, dir);
    run_id_ = meta.at("run_id").template get<std::string>();
    return meta.at("step").template get<int64_t>();
  }

  const Options& o_;
  // The run id of the checkpoint resumed from (kept by later saves).
  std::string run_id_;
  comm::Comm& comm_;
  Device device_;
  const RemoteRollout* remote_ = nullptr;           // disaggregated rollout
  std::unique_ptr<comm::Mesh> mesh_;                // dp_shard x cp x ep
  std::unique_ptr<parallel::ExpertParallel<>> ep_;  // the mesh's ep axis, MoE models (outlives the models)
  // The policy's forward context, reused by every micro-batch and step (its
  // buffers keep their capacity; released with the training state under --offload).
  typename Policy::Context ctx_;
  DType dtype_ = DType::f32;
  nn::Qwen3Config config_;
  std::unique_ptr<data::Task> task_;
  std::optional<data::PromptDataset> dataset_;  // --prompts
  std::unique_ptr<Policy> policy_;
  // The KL reference: a frozen Sharded model over the policy's mesh (its
  // shards, its expert slices), offloaded outside the training phase.
  std::optional<rl::ShardedReferenceModel<nn::Qwen3Model>> ref_;
  // --teacher: the on-policy distillation teacher, frozen like the reference.
  std::unique_ptr<parallel::ExpertParallel<>> teacher_ep_;  // its expert split (a MoE teacher; outlives it)
  std::optional<rl::ShardedReferenceModel<nn::Qwen3Model>> teacher_;
  std::unique_ptr<nn::Qwen3Model> engine_model_;
  std::unique_ptr<rollout::Engine> engine_;
  bool engine_on_device_ = false;  // --offload: the engine, not the policy, holds the device
  optim::LrSchedule schedule_ = optim::LrSchedule::constant(1e-3);
  std::optional<data::Packer> packer_;
  std::unique_ptr<parallel::ContextParallel> cp_;  // --cp > 1
  std::unique_ptr<io::MetricsLog> log_;            // rank 0
  std::unique_ptr<io::Progress> progress_;
};

}  // namespace rl_example
