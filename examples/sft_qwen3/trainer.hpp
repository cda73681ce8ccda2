// trainer.hpp (sft_qwen3 example): one rank's SFT loop. Every rank runs
// train_rank with its communicator; the ranks agree on everything without
// talking (the same data order, the same packing plan) except where a step
// needs a collective: the global token count, the FSDP all-gathers and
// reduce-scatters inside Sharded, the attention of context parallelism, the
// gradient norm, the step's loss for the log, checkpoints and the export.
//
// Parallelism: the mesh dp_shard x cp (--cp N; the world is dp x N ranks)
// is always built; at --cp 1 its cp axis has one rank and every code path is
// the same. The N ranks of a cp group share their data-parallel rank's
// micro-batches: parallel::ContextParallel (Ulysses x ring, --ulysses) gives
// each its rows of every sequence (padded to a multiple of 2 x cp, or of cp
// for Ulysses alone; padding of loss weight 0) and runs the attention over
// the whole sequences; Sharded shards over dp_shard x cp and sums the
// gradients of both.
//
// A step:
//   1. draw sequences until the step holds --global-batch-tokens (the same on
//      every rank: a seeded, resumable epoch order);
//   2. data::plan splits them over the data-parallel ranks (balanced tokens)
//      and into micro-batches of at most --max-tokens-per-rank tokens;
//   3. one all_reduce over dp sums the data-parallel ranks' target tokens:
//      every rank's loss is -sum(log p) over its rows / global tokens, so the
//      gradients reduce by a plain sum to the gradient of the mean next-token
//      loss of the whole step;
//   4. per micro-batch: this rank's rows of it, Sharded forward, fused LM
//      head, backward (gradients accumulate; the last micro-batch
//      reduce-scatters them);
//   5. AdamW on the local shards at the schedule's learning rate (with global
//      grad-norm clipping), then metrics (the loss summed over every rank)
//      and, every N steps, a checkpoint.
#pragma once

#include <algorithm>
#include <chrono>
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

#include <nlohmann/json.hpp>

#include "checkpoint.hpp"
#include "slime/comm/comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/core/device.hpp"
#include "slime/data/packer.hpp"
#include "slime/data/shuffle.hpp"
#include "slime/io/metrics_log.hpp"
#include "slime/io/progress.hpp"
#include "slime/nn/checkpoint.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/ops/host_checks.hpp"
#include "slime/optim/lr_schedule.hpp"
#include "slime/parallel/context_parallel.hpp"
#include "slime/parallel/export_hf.hpp"
#include "slime/parallel/sharded.hpp"
#include "token_data.hpp"

namespace sft {

namespace comm = slime::comm;
namespace io = slime::io;
namespace nn = slime::nn;
namespace optim = slime::optim;
namespace parallel = slime::parallel;
using slime::Device;
using slime::DType;
using slime::Tensor;

// What the command line sets (main.cpp documents each option).
struct TrainOptions {
  std::string model;  // HF directory; empty: the built-in tiny Qwen3
  int64_t steps = 100;
  double lr = 3e-3;
  std::string schedule = "cosine";  // constant | warmup | cosine
  int64_t warmup = 10;
  double min_lr = 0;
  double weight_decay = 0.01;
  double max_grad_norm = 1.0;  // 0: no clipping
  int64_t max_tokens_per_rank = 1024;
  int64_t global_batch_tokens = 2048;
  std::string strategy = "full";  // full | grad_op | no_shard
  int cp = 1;                     // context-parallel degree: ranks sharing each micro-batch
  int ulysses = 1;                // its Ulysses degree (divides cp; the ring degree is cp / ulysses)
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;  // 0: only at the end (when --checkpoint-dir is set)
  int keep_checkpoints = 2;
  bool resume = false;
  std::string export_hf;
  std::string metrics;      // JSONL path
  std::string tensorboard;  // event-file directory
  uint64_t seed = 0;
  // Set by the program: end the run after this step without the final
  // checkpoint and export, as a preempted job would (--verify-resume).
  int64_t stop_after = 0;
  bool quiet = false;  // no banner and no progress line
};

// The losses rank 0 saw, for --verify-resume and the end-of-run summary.
struct RunResult {
  std::vector<std::pair<int64_t, double>> losses;  // (step, loss)
  int64_t first_step = 1;                          // 1, or the step after the checkpoint resumed from
};

// A small Qwen3 (dense) that trains on a CPU in seconds per step and runs the
// CUDA kernels too (bf16, head_dim 64).
inline nn::Qwen3Config tiny_qwen3_config(int64_t vocab_size) {
  nn::Qwen3Config c;
  c.vocab_size = vocab_size;
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 64;
  c.max_position_embeddings = 4096;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = false;
  return c;
}

namespace detail {

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline optim::LrSchedule make_schedule(const TrainOptions& o) {
  if (o.schedule == "constant") return optim::LrSchedule::constant(o.lr);
  if (o.schedule == "warmup") return optim::LrSchedule::linear_warmup(o.lr, o.warmup);
  return optim::LrSchedule::cosine(o.lr, o.warmup, o.steps, o.min_lr);
}

// The model on this rank's device: bf16 on a GPU, f32 on the CPU. Every rank
// builds the same full model (same seed or same files); Sharded then keeps
// only the rank's shard.
inline nn::Qwen3Model build_model(const TrainOptions& o, const nn::Qwen3Config& config, Device device) {
  const DType dtype = device.is_cuda() ? DType::bf16 : DType::f32;
  if (!o.model.empty()) return nn::load_hf(o.model, device, dtype);
  nn::Qwen3Model model(config, {device, dtype});
  model.init_random(o.seed);
  return model;
}

// The sum of one integer over the ranks (all_reduce on the comm's device).
inline int64_t all_reduce_sum(comm::Comm& comm, int64_t value) {
  Tensor t = Tensor::from_vector(std::vector<int64_t>{value}, slime::Shape{1}, comm.device());
  comm.all_reduce(t);
  return t.to_vector<int64_t>()[0];
}
inline double all_reduce_sum(comm::Comm& comm, double value) {
  Tensor t = Tensor::from_vector(std::vector<float>{float(value)}, slime::Shape{1}, comm.device());
  comm.all_reduce(t);
  return double(t.to_vector<float>()[0]);
}

// A micro-batch's part of the step's loss on this rank.
struct MicroBatchLoss {
  double share = 0;  // -sum over this rank's rows of w log p / normalizer
  double aux = 0;    // the MoE aux-loss term (output_router_logits): the whole micro-batch's, on every rank
};

// One packed micro-batch of this rank's data-parallel rank: this rank's rows
// of it (`cp` plans them; at --cp 1 every row), forward, the fused LM head,
// backward of -sum_t w_t log p(target_t) / normalizer with w = 1 on the
// tokens and 0 on cp padding.
// ctx: one Context for every micro-batch (its buffers, sized by the first,
// hold the activations of the next ones).
template <class ShardedModel>
MicroBatchLoss train_micro_batch(ShardedModel& sh, typename ShardedModel::Context& ctx, parallel::ContextParallel& cp,
                                 const TokenDataset& data, const std::vector<Sequence>& step_sequences,
                                 const slime::data::MicroBatchPlan& mb, double normalizer) {
  std::vector<int32_t> cu{0}, tokens, targets, seq_inputs, seq_targets;
  for (const int32_t i : mb.samples) {
    data.inputs_and_targets(step_sequences[std::size_t(i)], seq_inputs, seq_targets);
    tokens.insert(tokens.end(), seq_inputs.begin(), seq_inputs.end());
    targets.insert(targets.end(), seq_targets.begin(), seq_targets.end());
    cu.push_back(int32_t(tokens.size()));
  }
  if (mb.samples.empty()) {
    // A rank with fewer sequences than the agreed micro-batch count still runs
    // every micro-batch (its collectives must match its peers'): one token
    // of weight 0.
    tokens = targets = {0};
    cu.push_back(1);
  }
  const std::vector<float> weights(targets.size(), mb.samples.empty() ? 0.f : 1.f);
  const parallel::CpPlan& plan = cp.plan(cu);
  const nn::PackedBatch batch = cp.local_batch(tokens);
  const int64_t T = plan.local_tokens();
  // Checked on the host: an out-of-range target traps in the GPU kernel.
  slime::ops::check_token_targets(std::span<const int32_t>(targets), sh.module().config().vocab_size,
                                  "sft_qwen3: micro-batch");
  const Tensor t = Tensor::from_vector(plan.take(targets, 0), {T}, sh.device());
  const Tensor w = Tensor::from_vector(plan.take(weights, 0.f), {T}, sh.device());
  const nn::LossResult r = sh.loss_and_backward(ctx, batch, t, w, 1.f, normalizer);
  const double aux = sh.module().config().router_aux_loss_coef * r.aux_loss;  // 0 when not included
  return {r.loss - aux, aux};
}

// The training loop of one rank with a fixed strategy (see the top of the file).
template <class Strategy>
RunResult train_rank_as(comm::Comm& comm, const TrainOptions& o, const TokenDataset& data,
                        const nn::Qwen3Config& config) {
  const Device device = comm.device();
  const slime::DeviceGuard guard(device);  // work queued without naming a device lands on the rank's GPU
  const bool lead = comm.rank() == 0;
  optim::AdamWConfig adamw;
  adamw.weight_decay = o.weight_decay;
  // The mesh dp_shard x cp and the context parallelism over its cp axis
  // (declared before the model: it keeps pointers to both).
  require(o.cp >= 1 && comm.size() % o.cp == 0, "--cp ", o.cp, " must divide the ", comm.size(), " ranks");
  const comm::Mesh mesh(comm, comm::MeshShape{.dp_replicate = 1, .dp_shard = comm.size() / o.cp, .cp = o.cp, .ep = 1});
  parallel::ContextParallel cp(mesh.comm(comm::Axis::cp), {.ulysses = o.ulysses});
  comm::Comm& dp = mesh.comm(comm::Axis::dp_shard);
  nn::Qwen3Model model = build_model(o, config, device);
  model.set_sequence_attention(&cp);
  parallel::Sharded<nn::Qwen3Model, Strategy> sh(std::move(model), mesh, {}, adamw);
  const optim::LrSchedule schedule = make_schedule(o);
  // The data order: a fresh shuffle of every sequence each epoch, the same
  // on every rank (seeded), resumable from a saved DataPosition.
  slime::data::EpochSampler sampler(data.size(), o.seed);
  int64_t step = 0, tokens_seen = 0;
  std::string run_id;  // the resumed checkpoint's, kept by later saves
  RunResult result;

  if (o.resume) {
    const nlohmann::json meta = load_checkpoint(sh, o.checkpoint_dir);
    step = meta.at("step").get<int64_t>();
    run_id = meta.at("run_id").get<std::string>();
    // Integers checked before reading them (a float would be cast unchecked).
    const auto meta_int = [&](const char* key, int64_t fallback) {
      const auto it = meta.find(key);
      if (it == meta.end()) return fallback;
      require(it->is_number_integer(), "--resume: \"", key,
              "\" in the checkpoint's metadata is not an integer: ", it->dump());
      return it->get<int64_t>();
    };
    const int64_t sequences = meta_int("sequences", -1);
    require(sequences == data.size(), "--resume: the checkpoint in '", o.checkpoint_dir, "' was trained on data of ",
            sequences, " sequences, but --data now gives ", data.size(),
            " (same --data and --max-tokens-per-rank needed)");
    sampler.seek(meta.at("data").get<slime::data::DataPosition>());
    tokens_seen = meta_int("tokens_seen", 0);
    result.first_step = step + 1;
    require(step < o.steps, "--resume: the checkpoint is at step ", step, ", not before --steps ", o.steps,
            "; nothing to train");
  }

  slime::data::PackConfig pack;
  pack.dp_size = dp.size();
  pack.max_tokens_per_gpu = o.max_tokens_per_rank;

  // Console and metrics on rank 0 only.
  std::unique_ptr<io::MetricsLog> metrics;
  std::unique_ptr<io::Progress> progress;
  if (lead) {
    io::MetricsLogOptions mo;
    if (o.resume) mo.resume_step = step + 1;  // drop lines the interrupted run wrote after its checkpoint
    if (!o.tensorboard.empty()) mo.tensorboard_dir = o.tensorboard;
    const std::string path = !o.metrics.empty()       ? o.metrics
                             : !o.tensorboard.empty() ? o.tensorboard + "/metrics.jsonl"
                                                      : std::string();
    if (!path.empty()) metrics = std::make_unique<io::MetricsLog>(path, mo);
    if (!o.quiet) {
      const std::size_t params = sh.parameter_names().size();
      int64_t numel = 0;
      for (std::size_t u = 0; u < sh.num_units(); ++u)
        for (const auto& e : sh.unit_layout(u).entries()) numel += e.numel;
      fmt::print("model: {} ({} tensors, {:.2f}M parameters) on {} ranks ({}, {}), strategy {}, dp {} x cp {}{}\n",
                 o.model.empty() ? "built-in tiny Qwen3" : o.model, params, double(numel) / 1e6, comm.size(),
                 device.is_cuda() ? "cuda" : "cpu", slime::dtype_name(sh.compute_dtype()), o.strategy, dp.size(), o.cp,
                 o.cp > 1 ? fmt::format(" (Ulysses {} x ring {})", cp.ulysses(), cp.ring()) : "");
      fmt::print("data: {} sequences, {} tokens | step: >= {} tokens, <= {} per micro-batch | lr {} ({})\n",
                 data.size(), data.total_tokens(), o.global_batch_tokens, o.max_tokens_per_rank, o.lr, o.schedule);
      if (o.resume) fmt::print("resumed from '{}' at step {}\n", o.checkpoint_dir, step);
      io::ProgressOptions po;
      po.total_steps = o.steps;
      po.print_every = std::max<int64_t>(1, o.steps / 10);
      progress = std::make_unique<io::Progress>(std::cout, po, step);
    }
  }

  const int64_t last = o.stop_after > 0 ? std::min(o.stop_after, o.steps) : o.steps;
  typename decltype(sh)::Context ctx;  // reused by every micro-batch of every step
  while (step < last) {
    ++step;
    const double start = now_seconds();

    // 1-2. The step's sequences and this data-parallel rank's share, packed
    // (the same for every rank of its cp group).
    const std::vector<Sequence> sequences = next_global_batch(sampler, data, o.global_batch_tokens, dp.size());
    std::vector<int64_t> lengths;
    for (const Sequence& s : sequences) lengths.push_back(s.length);
    const slime::data::PackPlan plan = slime::data::plan(pack, lengths);
    const slime::data::RankPlan& mine = plan.steps[0].ranks[std::size_t(dp.rank())];

    // 3. The loss normaliser: every target token of the step, over the
    // data-parallel ranks. (Each rank could read it off the plan; the
    // all_reduce keeps the loop right when ranks read disjoint data and plan
    // only their own.)
    const int64_t step_tokens = all_reduce_sum(dp, mine.tokens);

    // 4. Forward and backward of each micro-batch.
    sh.zero_grad();
    sh.set_micro_batches(int(mine.micro_batches.size()));
    double rank_loss = 0, aux_loss = 0;
    for (const slime::data::MicroBatchPlan& mb : mine.micro_batches) {
      const MicroBatchLoss l = train_micro_batch(sh, ctx, cp, data, sequences, mb, double(step_tokens));
      rank_loss += l.share;
      aux_loss += l.aux;
    }

    // 5. The update: clip to --max-grad-norm (the norm over all shards) and AdamW.
    const double lr = schedule.lr(step);
    double grad_norm = 0;
    if (o.max_grad_norm > 0) {
      grad_norm = *sh.optimizer_step(lr, o.max_grad_norm);
    } else {
      grad_norm = sh.grad_norm();
      sh.optimizer_step(lr);
    }
    // Every rank's share (over dp and cp) once, the aux terms once.
    const double loss = all_reduce_sum(comm, rank_loss) + aux_loss;
    tokens_seen += step_tokens;
    const double seconds = now_seconds() - start;

    if (lead) {
      result.losses.emplace_back(step, loss);
      const double tokens_per_s = double(step_tokens) / std::max(seconds, 1e-9);
      if (metrics)
        metrics->log(step, {{"loss", loss},
                            {"lr", lr},
                            {"grad_norm", grad_norm},
                            {"tokens_per_s", tokens_per_s},
                            {"step_seconds", seconds},
                            {"tokens", double(step_tokens)},
                            {"micro_batches", double(mine.micro_batches.size())},
                            {"epoch", double(sampler.position().epoch)}});
      if (progress) progress->update(step, {{"loss", loss}, {"lr", lr}, {"gnorm", grad_norm}, {"tok/s", tokens_per_s}});
    }

    const bool end_of_run = step == o.steps;
    if (!o.checkpoint_dir.empty() && ((o.checkpoint_every > 0 && step % o.checkpoint_every == 0) || end_of_run)) {
      const nlohmann::json meta = {
          {"data", sampler.position()}, {"sequences", data.size()}, {"tokens_seen", tokens_seen}, {"seed", o.seed}};
      save_checkpoint(sh, comm, o.checkpoint_dir, step, meta, o.keep_checkpoints, run_id);
      if (progress) progress->message(fmt::format("checkpoint: step {} saved to '{}'", step, o.checkpoint_dir));
    }
  }
  if (progress) progress->finish();

  if (!o.export_hf.empty() && step == o.steps) {
    parallel::save_hf(sh, comm, sh.module().config(), o.export_hf);  // fp32 master weights
    if (lead && !o.quiet) fmt::print("exported the model to '{}' (Hugging Face format, fp32)\n", o.export_hf);
  }
  return result;
}

}  // namespace detail

// One rank's run with the strategy --strategy names.
inline RunResult train_rank(comm::Comm& comm, const TrainOptions& o, const TokenDataset& data,
                            const nn::Qwen3Config& config) {
  if (o.strategy == "full") return detail::train_rank_as<parallel::FullShard>(comm, o, data, config);
  if (o.strategy == "grad_op") return detail::train_rank_as<parallel::ShardGradOp>(comm, o, data, config);
  if (o.strategy == "no_shard") return detail::train_rank_as<parallel::NoShard>(comm, o, data, config);
  throw slime::Error("--strategy must be full, grad_op or no_shard, got '" + o.strategy + "'");
}

}  // namespace sft
