// trainer.hpp (qwen3_vl_rl example): GRPO on a Qwen3-VL model, one instance
// per rank. A step (train_step) is seven phases, as in the text example
// (examples/qwen3_moe_rl):
//
//   1. rollout     the rank's prompts (an image each, drawn by shapes_task.hpp)
//                  -> rollout::Engine on the rank's device: the vision tower
//                  once per image, prefill with the image features, decode
//                  with MRoPE -> responses + logprobs
//   2. score       the task's verifier: 1 for the right answer token
//   3. advantages  GRPO: group-normalised rewards, one value per response
//   4. pack        the rank's responses as VL sequences (prompt + response,
//                  its image) in one micro-batch, targets and loss masks
//   5. train       forward of the Sharded VLM (tower units, then language
//                  units) -> token logprobs -> rl::policy_loss (PPO-clip,
//                  token mean over the global batch) -> backward; AdamW
//   6. sync        the new weights (tower and language model) into the engine
//   7. log         the step's reward and loss over the ranks; rank 0 writes
//                  metrics.jsonl and the progress line
// and at the end, the HF export (a directory transformers loads).
//
// One optimizer step per rollout, so the "old" logprobs are the training
// forward's own (the PPO ratio starts at 1); on the CPU the engine's
// logprobs equal that recompute bit for bit (logged: max_lp_diff).
#pragma once

#include <algorithm>
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

#include "shapes_task.hpp"
#include "slime/comm/comm.hpp"
#include "slime/io/metrics_log.hpp"
#include "slime/io/progress.hpp"
#include "slime/io/safetensors.hpp"
#include "slime/nn/qwen3_vl.hpp"
#include "slime/nn/qwen3_vl_checkpoint.hpp"
#include "slime/ops/host_checks.hpp"
#include "slime/optim/lr_schedule.hpp"
#include "slime/parallel/export_hf.hpp"
#include "slime/parallel/sharded.hpp"
#include "slime/rl/advantages.hpp"
#include "slime/rl/policy_loss.hpp"
#include "slime/rollout/engine.hpp"
#include "slime/rollout/weight_sync.hpp"

namespace vl_example {

namespace fs = std::filesystem;

struct Options {
  int steps = 200;
  int ranks = 2;
  int prompts_per_step = 16;  // over all ranks
  int samples_per_prompt = 8;
  double lr = 5e-4;
  double max_grad_norm = 1.0;
  double temperature = 1.0;
  std::string task = "colour";  // colour | count
  bool moe = false;
  bool freeze_vision = false;  // the tower keeps its weights (no backward, no optimizer state)
  std::string device = "auto";
  uint64_t seed = 1;
  std::string out_dir = "runs/qwen3_vl_rl";
  bool export_hf = true;
};

// The built-in model: a tiny Qwen3-VL (MoE with --moe: 4 experts, top-2 in
// layer 1). head_dim 64 in the tower and the language model, so the CUDA
// attention takes it; 8x8-patch images (32 px, patch 4) merge to 16 tokens.
inline nn::Qwen3VLConfig tiny_vl_config(bool moe) {
  nn::Qwen3VLConfig c;
  c.model_type = moe ? "qwen3_vl_moe" : "qwen3_vl";
  nn::Qwen3Config& t = c.text;
  t.model_type = moe ? "qwen3_vl_moe_text" : "qwen3_vl_text";
  t.vocab_size = ShapesVocab::kSize;
  t.hidden_size = 64;
  t.intermediate_size = 128;
  t.num_hidden_layers = 2;
  t.num_attention_heads = 2;
  t.num_key_value_heads = 1;
  t.head_dim = 64;
  t.max_position_embeddings = 128;
  t.mrope_section = {12, 10, 10};
  if (moe) {
    t.num_experts = 4;
    t.num_experts_per_tok = 2;
    t.moe_intermediate_size = 64;
    t.norm_topk_prob = true;
    t.mlp_only_layers = {0};
  }
  nn::Qwen3VLVisionConfig& v = c.vision;
  v.depth = 2;
  v.hidden_size = 64;
  v.intermediate_size = 128;
  v.num_heads = 1;
  v.in_channels = 3;
  v.patch_size = 4;
  v.temporal_patch_size = 2;
  v.spatial_merge_size = 2;
  v.out_hidden_size = 64;
  v.num_position_embeddings = 16;
  v.deepstack_visual_indexes = {0};
  c.image_token_id = ShapesVocab::kImagePad;
  c.video_token_id = ShapesVocab::kVideoPad;
  c.vision_start_token_id = ShapesVocab::kVisionStart;
  c.vision_end_token_id = ShapesVocab::kVisionEnd;
  c.validate();
  return c;
}

inline data::QwenVLImageOptions image_options(const nn::Qwen3VLConfig& c) {
  data::QwenVLImageOptions o;
  o.patch_size = c.vision.patch_size;
  o.merge_size = c.vision.spatial_merge_size;
  o.temporal_patch_size = c.vision.temporal_patch_size;
  return o;
}

struct StepReport {
  double reward = 0;
  double loss = 0;
  double max_lp_diff = 0;  // |engine logprob - trainer recompute|, largest over the step's tokens
};

template <class Strategy>
class Trainer {
 public:
  using Policy = parallel::Sharded<nn::Qwen3VLModel, Strategy>;

  Trainer(const Options& o, comm::Comm& comm)
      : o_(o),
        comm_(comm),
        device_(comm.device()),
        dtype_(device_.is_cuda() ? DType::bf16 : DType::f32),
        config_(tiny_vl_config(o.moe)),
        task_(o.task == "count" ? ShapesQuestion::count : ShapesQuestion::colour, 32, image_options(config_)),
        engine_model_(config_, {device_, dtype_}) {
    SLIME_CHECK(o.task == "colour" || o.task == "count", "--task '", o.task, "': expected colour or count");
    SLIME_CHECK(o.prompts_per_step % comm.size() == 0, "--prompts-per-step ", o.prompts_per_step,
                " must be a multiple of the ranks (", comm.size(), ")");
    SLIME_CHECK(o.samples_per_prompt >= 2, "--samples-per-prompt must be >= 2 (GRPO normalises within a group)");
    nn::Qwen3VLModel model(config_, {device_, dtype_});
    model.init_random(o.seed, 0.05f);  // counter-based: the same weights on every rank
    model.set_vision_trainable(!o.freeze_vision);
    optim::AdamWConfig adam;
    adam.weight_decay = 0.0;
    policy_ = std::make_unique<Policy>(std::move(model), comm, parallel::ShardedOptions{}, adam);
    engine_ = std::make_unique<rollout::Engine>(
        engine_model_, rollout::EngineConfig{.max_batch = 256, .max_context = 64, .kv_capacity = 0, .seed = o.seed});
  }

  std::vector<StepReport> run() {
    const fs::path out = o_.out_dir;
    if (comm_.rank() == 0) {
      fs::create_directories(out);
      log_ = std::make_unique<io::MetricsLog>(out / "metrics.jsonl", io::MetricsLogOptions{});
      io::ProgressOptions po;
      po.total_steps = o_.steps;
      po.print_every = std::max(1, o_.steps / 10);
      progress_ = std::make_unique<io::Progress>(std::cout, po, 0);
    }
    sync_engine(0);
    std::vector<StepReport> reports;
    for (int64_t step = 0; step < o_.steps; ++step) reports.push_back(train_step(step));
    if (progress_) progress_->finish();
    if (o_.export_hf) export_hf(out / "hf");
    return reports;
  }

 private:
  struct Rollout {
    std::vector<ShapesPrompt> prompts;
    std::vector<rollout::Completion> responses;  // samples_per_prompt per prompt, prompt-major
    std::vector<float> rewards, advantages;      // per response
  };

  StepReport train_step(int64_t step) {
    Rollout r = rollout(step);
    double reward = 0;
    for (std::size_t s = 0; s < r.responses.size(); ++s) {  // 2. score
      r.rewards.push_back(
          float(ShapesTask::reward(r.prompts[s / std::size_t(o_.samples_per_prompt)], r.responses[s].tokens)));
      reward += r.rewards.back();
    }
    const int64_t N = int64_t(r.responses.size());  // 3. advantages
    const std::vector<int64_t> groups(std::size_t(N / o_.samples_per_prompt), o_.samples_per_prompt);
    r.advantages = rl::grpo_advantages(Tensor::from_vector(r.rewards, {N}), groups, true).template to_vector<float>();
    const auto [loss, lp_diff] = train(r);  // 4. pack, 5. train
    sync_engine(step + 1);                  // 6. sync
    // 7. log: sums over the ranks.
    Tensor t = Tensor::from_vector(std::vector<float>{float(reward), float(N), float(loss)}, {3}, device_);
    comm_.all_reduce(t, comm::ReduceOp::sum);
    Tensor d = Tensor::from_vector(std::vector<float>{float(lp_diff)}, {1}, device_);
    comm_.all_reduce(d, comm::ReduceOp::max);
    const std::vector<float> v = t.to_vector<float>();
    StepReport rep{double(v[0]) / double(v[1]), double(v[2]), double(d.to_vector<float>()[0])};
    if (log_) {
      log_->log(step + 1, {{"reward", rep.reward}, {"loss", rep.loss}, {"max_lp_diff", rep.max_lp_diff}});
      progress_->update(step + 1, {{"reward", rep.reward}, {"loss", rep.loss}});
    }
    return rep;
  }

  // 1. The rank's prompts of the step (global prompt index: the same prompts
  // whatever the rank count), samples_per_prompt requests each.
  Rollout rollout(int64_t step) {
    const int per_rank = o_.prompts_per_step / comm_.size(), n = o_.samples_per_prompt;
    Rollout r;
    std::vector<rollout::Request> requests;
    for (int i = 0; i < per_rank; ++i) {
      const uint64_t g = uint64_t(step) * uint64_t(o_.prompts_per_step) + uint64_t(comm_.rank() * per_rank + i);
      r.prompts.push_back(task_.prompt(o_.seed, g));
      const ShapesPrompt& p = r.prompts.back();
      for (int j = 0; j < n; ++j) {
        rollout::Request q;
        q.prompt = p.tokens;
        q.image_grids = {{p.image.grid_thw[0].t, p.image.grid_thw[0].h, p.image.grid_thw[0].w}};
        q.pixel_values = Tensor::from_vector(p.image.pixel_values, {p.image.rows(), p.image.patch_dim});
        q.sample_id = g * uint64_t(n) + uint64_t(j);
        q.sampling.temperature = float(o_.temperature);
        q.sampling.max_new_tokens = 2;
        q.sampling.stop_tokens = {ShapesVocab::kEos};
        requests.push_back(std::move(q));
      }
    }
    r.responses = engine_->generate(requests);
    for (const rollout::Completion& c : r.responses)
      SLIME_CHECK(c.finish != rollout::FinishReason::error && !c.tokens.empty(), "rollout failed: ", c.error);
    return r;
  }

  // 4 + 5. One micro-batch of the rank's responses: inputs prompt + response
  // without its last token, each input predicting the next token; the loss
  // on the response's tokens, token mean over every rank's response tokens.
  std::pair<double, double> train(const Rollout& r) {
    const std::size_t n = std::size_t(o_.samples_per_prompt);
    std::vector<nn::VLSequence> seqs;
    std::vector<int32_t> targets, cu = {0};
    std::vector<uint8_t> mask;
    std::vector<float> adv, rollout_lp;
    for (std::size_t s = 0; s < r.responses.size(); ++s) {
      const ShapesPrompt& p = r.prompts[s / n];
      const rollout::Completion& c = r.responses[s];
      nn::VLSequence q;
      q.tokens = p.tokens;
      q.tokens.insert(q.tokens.end(), c.tokens.begin(), c.tokens.end() - 1);
      q.prompt_length = int64_t(p.tokens.size());  // a sampled image-pad token is text
      q.grids = {{p.image.grid_thw[0].t, p.image.grid_thw[0].h, p.image.grid_thw[0].w}};
      q.pixel_values = Tensor::from_vector(p.image.pixel_values, {p.image.rows(), p.image.patch_dim});
      const std::size_t len = q.tokens.size(), first = p.tokens.size() - 1;  // the input predicting response token 0
      for (std::size_t t = 0; t < len; ++t) {
        targets.push_back(t + 1 < len ? q.tokens[t + 1] : c.tokens.back());
        const bool response = t >= first;
        mask.push_back(response ? 1 : 0);
        adv.push_back(response ? r.advantages[s] : 0.f);
        rollout_lp.push_back(response ? c.logprobs[t - first] : 0.f);
      }
      cu.push_back(int32_t(targets.size()));
      seqs.push_back(std::move(q));
    }
    const int64_t T = int64_t(targets.size()), S = int64_t(seqs.size());
    const nn::VLBatch batch = nn::make_vl_batch(seqs, config_, device_, dtype_);
    // Checked on the host: an out-of-range target traps in the GPU kernel.
    ops::check_token_targets(std::span<const int32_t>(targets), config_.text.vocab_size, "qwen3_vl_rl: batch");
    const Tensor tgt = Tensor::from_vector(targets, {T}, device_);

    // The loss's normaliser: response tokens and sequences over every rank.
    const Tensor mask_host = Tensor::from_vector(mask, {T}), cu_host = Tensor::from_vector(cu, {S + 1});
    rl::LossNormalizer norm = rl::count_normalizer(mask_host, cu_host);
    Tensor counts =
        Tensor::from_vector(std::vector<int64_t>{norm.tokens, norm.sequences, norm.nonempty_sequences}, {3}, device_);
    comm_.all_reduce(counts, comm::ReduceOp::sum);
    const std::vector<int64_t> c = counts.to_vector<int64_t>();
    norm = {c[0], c[1], c[2]};

    policy_->zero_grad();
    typename Policy::Context ctx;
    const Tensor hidden = policy_->forward(batch, ctx);
    const ops::TokenLogprobs fwd = policy_->token_logprobs(hidden, tgt, float(o_.temperature));
    rl::PolicyLossTensors in;
    in.lp = fwd.logprobs;
    in.old_lp = in.lp;
    in.advantages = Tensor::from_vector(adv, {T}, device_);
    in.loss_mask = mask_host.to(device_);
    in.cu_seqlens = batch.text.cu_seqlens;
    const rl::PolicyLossResult res = rl::policy_loss(rl::PolicyLossConfig{}, norm, in);
    policy_->backward(ctx, policy_->token_logprobs_backward(hidden, tgt, float(o_.temperature), fwd, res.grad_lp, {}));
    policy_->optimizer_step(o_.lr, o_.max_grad_norm);

    double diff = 0;  // engine vs trainer logprobs of the sampled tokens
    const std::vector<float> lp = fwd.logprobs.to_vector<float>();
    for (int64_t t = 0; t < T; ++t)
      if (mask[std::size_t(t)])
        diff = std::max(diff, double(std::abs(lp[std::size_t(t)] - rollout_lp[std::size_t(t)])));
    return {res.metrics.loss, diff};
  }

  // 6. Every parameter (tower and language model) into the engine, one
  // gathered at a time (collective: every rank gathers).
  void sync_engine(int64_t version) {
    rollout::sync_colocated(rollout::ShardedWeights<Policy>{policy_.get()}, *engine_, version);
  }

  // The trained model as a Hugging Face directory (rank 0 writes; every rank
  // takes part in the gathers).
  void export_hf(const fs::path& dir) {
    // The whole model on rank 0 (f32, CPU): written, then run for the check.
    std::optional<nn::Qwen3VLModel> full = parallel::gather_vl_model(*policy_, comm_);
    if (full) {
      nn::save_hf_vl(*full, dir);
      write_export_check(*full, dir / "export_check.safetensors");
      std::cout << "exported the trained model to " << dir.string() << "\n";
    }
  }

  // What tools/check_vl_export.py compares transformers against: prompt 0
  // with its answer and EOS, its image, and the exported model's per-token
  // logprobs (f32 on the CPU; position t scores token t + 1, the last 0).
  void write_export_check(nn::Qwen3VLModel& full, const fs::path& path) {
    const ShapesPrompt p = task_.prompt(o_.seed, 0);
    nn::VLSequence s;
    s.tokens = p.tokens;
    s.tokens.push_back(p.answer);
    s.tokens.push_back(ShapesVocab::kEos);
    const data::GridTHW& g = p.image.grid_thw[0];
    s.grids = {{g.t, g.h, g.w}};
    s.pixel_values = Tensor::from_vector(p.image.pixel_values, {p.image.rows(), p.image.patch_dim});
    const int64_t L = int64_t(s.tokens.size());
    std::vector<int32_t> targets(s.tokens.begin() + 1, s.tokens.end());
    targets.push_back(0);
    const nn::VLBatch b = nn::make_vl_batch(std::span<const nn::VLSequence>(&s, 1), config_, Device::cpu(), DType::f32);
    nn::Qwen3VLModel::Context ctx;
    const Tensor h = full.forward(b, ctx);
    const Tensor lp = full.token_logprobs(h, Tensor::from_vector(targets, {L})).logprobs;
    std::vector<int64_t> tokens(s.tokens.begin(), s.tokens.end());
    io::write_safetensors(path, {{"tokens", Tensor::from_vector(tokens, {L})},
                                 {"pixel_values", s.pixel_values},
                                 {"image_grid_thw", Tensor::from_vector(std::vector<int64_t>{g.t, g.h, g.w}, {1, 3})},
                                 {"logprobs", lp}});
  }

  Options o_;
  comm::Comm& comm_;
  Device device_;
  DType dtype_;
  nn::Qwen3VLConfig config_;
  ShapesTask task_;
  nn::Qwen3VLModel engine_model_;
  std::unique_ptr<Policy> policy_;
  std::unique_ptr<rollout::Engine> engine_;
  std::unique_ptr<io::MetricsLog> log_;
  std::unique_ptr<io::Progress> progress_;
};

}  // namespace vl_example
