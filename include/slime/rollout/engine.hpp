// slime/rollout/engine.hpp: Engine, batched generation for Qwen3 with the
// trainer's own kernels (true on-policy): prefill through the packed
// attention, decode against a KV cache (rollout/kv_arena.hpp), continuous
// batching (finished sequences leave, waiting ones join at every step, or
// after every decode run: EngineConfig::decode_steps runs several decode
// steps per read of the host, their tokens fed forward on the device).
//
// A step runs the model once over every running sequence's new tokens (a
// newly admitted sequence's whole prompt, or a decoding sequence's last
// token): Qwen3Model::forward itself, the trainer's layer loop, with the
// arena as its K/V source (nn::CachedKv, from KvArena::source): every
// layer's attention writes the new keys and values into the sequence's arena
// region and attends over the sequence's cached + new keys (bottom-right
// causal alignment). The engine keeps only what is its own: scheduling
// (admission, continuous batching), the arena, and for each sequence's last
// row: logits (f32) -> sampling (rollout/sampling.hpp; on the device when no
// request filters) -> the sampled token's logprob from the fused lm-head op
// (ops::token_logprobs at the request's temperature; temperature 0 reports
// the temperature-1 logprob), the quantity the trainer recomputes. The
// forward keeps one layer's activations at a time (CachedKv is not
// differentiable: no backward context per layer).
//
// On the CPU every op computes each row independently of the others, in the
// same order, so the engine's logprob of a sampled token equals the trainer's
// recompute (Qwen3Model::token_logprobs over the packed prompt + completion)
// bit for bit; test_rollout checks it. On CUDA the GEMMs (cuBLAS) may choose
// different kernels for different row counts and the attention's key-block
// split depends on the query length, so the two agree to bf16 rounding;
// bench/ reports the largest difference measured.
//
// Requests are validated one by one: an empty prompt, a prompt that leaves no
// room for one new token in the context, max_new_tokens < 1, a token id
// outside the vocabulary, or a sequence longer than the KV arena fails that
// request (Completion::error says why) and leaves the others running.
//
// Qwen3-VL (Engine(nn::Qwen3VLModel&)): a request may carry images (grids
// and pixel rows, as nn::VLSequence; its prompt holds their expanded
// image-pad runs). A step's newly admitted prompts' images go through the
// vision tower in one call (its attention is per image), and the merged
// embeddings and deepstack features enter the language model's forward as
// nn::VisualEmbeds at the step's rows of the image-pad tokens. Positions
// are MRoPE [T, 3] in every step: a prompt's from nn::mrope_positions (a
// text-only prompt gets t = h = w = its index), a generated token's
// next_position + k on every axis (transformers' rope delta). So the
// logprobs equal the trainer's recompute (Qwen3VLModel::forward over
// make_vl_batch of prompt + completion with the same images) bit for bit on
// the CPU; test_rollout_vl checks it. A generated image-pad token is
// embedded as text (no image follows it); the trainer's recompute says so
// with VLSequence::prompt_length.
// Images given to a text-only engine, image-pad runs that do not match the
// grids, or pixel rows that do not match them fail that request. Weight
// sync writes the tower and the language model (for_each_parameter).
//
// Randomness: sample s's token at step i uses Philox word i of the stream keyed
// by (seed, s.sample_id), so a completion depends on its request, the weights
// and the seed only, not on the batch it ran in.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "slime/nn/kv_source.hpp"
#include "slime/nn/offload.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/nn/qwen3_vl.hpp"
#include "slime/nn/vl_positions.hpp"
#include "slime/ops/index_rows.hpp"
#include "slime/ops/token_logprobs.hpp"
#include "slime/rollout/cuda/sampling.hpp"
#include "slime/rollout/kv_arena.hpp"
#include "slime/rollout/sampling.hpp"

namespace slime::rollout {

struct EngineConfig {
  int64_t max_batch = 64;   // sequences running at once
  int64_t max_context = 0;  // prompt + completion tokens per sequence; 0: max_position_embeddings
  int64_t kv_capacity = 0;  // KV arena rows per layer; 0: max_batch * max_context
  uint64_t seed = 0;        // sampling seed (with each request's sample_id)
  // MoE models: record the experts every input token went to
  // (Completion::routing), for rollout routing replay in the trainer.
  bool record_routing = false;
  // Decode steps per wait of the host for the GPU (issue 19): when every
  // running sequence decodes (one new token each, one temperature, sampling
  // on the device, no routing recorded), up to this many steps run back to
  // back, each feeding its sampled tokens to the next on the device, and the
  // host reads the run's tokens and logprobs once at its end. A sequence that
  // stops inside a run decodes on to the run's end and those tokens are
  // dropped; waiting requests join after the run. Completions are the same
  // as with 1 (one step at a time): sampling is keyed by token index, and
  // each row's ops do not depend on the batch (bit for bit on the CPU).
  int64_t decode_steps = 8;
};

struct Request {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  uint64_t sample_id = 0;  // keys the sample's random stream; unique per sample of a rollout
  // Images (Qwen3-VL engines only), as nn::VLSequence: per image its grid_thw
  // (patches before merging), in the order of its image-pad run in the
  // prompt; pixel_values f32 [sum t·h·w, patch_dim] on the host, undefined
  // without images.
  std::vector<nn::GridThw> image_grids;
  Tensor pixel_values;
};

enum class FinishReason : uint8_t { stop, length, error };

// What an engine ran, since it was built: single steps (prefill, mixed or
// filtered batches, decode_steps 1) and decode runs (EngineConfig::
// decode_steps); the host reads results back once per step or run.
struct EngineStats {
  int64_t steps = 0;             // single steps
  int64_t decode_runs = 0;       // runs of several decode steps
  int64_t decode_run_steps = 0;  // the steps inside them
};

struct Completion {
  uint64_t sample_id = 0;
  std::vector<int32_t> tokens;  // generated tokens (a stop token included)
  std::vector<float> logprobs;  // log p(token) at the request's temperature, one per token
  FinishReason finish = FinishReason::length;
  std::string error;           // why the request failed (finish == error)
  int64_t weight_version = 0;  // the engine's weight version when the request finished
  // EngineConfig::record_routing (MoE models; empty otherwise): the experts
  // each input token of the sequence went to, i32 [rows][sparse layers][k]
  // flattened, rows = prompt + tokens - 1 (the prompt, then every generated
  // token but the last, which is never an input), the sparse layers in
  // Qwen3Model::sparse_layers() order, each row's k experts in router order.
  // Exactly what the trainer's forward over the same rows replays
  // (Qwen3Model::Context::routing_replay).
  std::vector<int32_t> routing;
};

class Engine {
 public:
  // Generates with `model` (the engine's own weights; weight sync writes into
  // them). The model must outlive the engine.
  Engine(nn::Qwen3Model& model, EngineConfig cfg = {}) : model_(&model), cfg_(cfg) { init_config(); }

  // Generates with a Qwen3-VL model: its language model as above, its vision
  // tower on the requests' images. The model must outlive the engine.
  Engine(nn::Qwen3VLModel& model, EngineConfig cfg = {}) : model_(&model.language()), vl_(&model), cfg_(cfg) {
    init_config();
  }

  const EngineConfig& config() const { return cfg_; }
  const EngineStats& stats() const { return stats_; }
  // The language model (a text-only engine's whole model).
  nn::Qwen3Model& model() { return *model_; }
  // The Qwen3-VL model, or nullptr for a text-only engine.
  nn::Qwen3VLModel* vl_model() { return vl_; }
  // Every parameter of the engine's model (a VL engine's: the tower's, then
  // the language model's), HF names: what weight sync writes into.
  template <class F>
  void for_each_parameter(F&& f) {
    if (vl_ != nullptr) {
      vl_->for_each_parameter(f);
    } else {
      model_->for_each_parameter(f);
    }
  }
  int64_t weight_version() const { return weight_version_; }
  void set_weight_version(int64_t v) { weight_version_ = v; }

  // Runs every request to completion; results in request order.
  std::vector<Completion> generate(const std::vector<Request>& requests, const Stream& stream = {}) {
    SLIME_CHECK(!offloaded(), "Engine::generate: the weights are offloaded; call onload() first");
    ensure_arena();
    std::vector<Completion> out(requests.size());
    std::deque<std::size_t> waiting;
    std::vector<nn::MropePositions> prompt_positions(vl_ != nullptr ? requests.size() : 0);  // VL: per request
    for (std::size_t i = 0; i < requests.size(); ++i) {
      out[i].sample_id = requests[i].sample_id;
      nn::MropePositions* positions = vl_ != nullptr ? &prompt_positions[i] : nullptr;
      if (std::string why = invalid_reason(requests[i], positions); !why.empty()) {
        fail(out[i], why);
      } else {
        waiting.push_back(i);
      }
    }
    std::vector<Running> running;
    while (!waiting.empty() || !running.empty()) {
      admit(requests, prompt_positions, waiting, running, out);
      if (running.empty()) continue;  // everything left failed to fit
      if (const int64_t n = decode_run_length(requests, running, out); n > 1) {
        decode_run(requests, running, out, n, stream);
        ++stats_.decode_runs;
        stats_.decode_run_steps += n;
      } else {
        step(requests, running, out, stream);
        ++stats_.steps;
      }
      // Finished sequences leave; their regions return to the arena.
      std::vector<Running> still;
      for (Running& r : running) {
        if (r.done) {
          alloc_.release(r.start, r.capacity);
        } else {
          still.push_back(std::move(r));
        }
      }
      running = std::move(still);
    }
    return out;
  }

  // Frees the KV arena and the step buffers (colocated training takes the
  // memory); the next generate allocates them again.
  void release_kv_cache() {
    arena_.release();
    buffers_ = {};
  }

  // Colocated memory: the KV arena is freed and the weights move to pinned
  // host memory (weight sync still writes into them there); onload brings
  // the weights back. generate needs the weights on the device.
  void offload(const Stream& stream = {}) {
    release_kv_cache();
    if (vl_ != nullptr) {
      weights_offload_.offload(*vl_, stream);
    } else {
      weights_offload_.offload(*model_, stream);
    }
  }
  void onload(const Stream& stream = {}) {
    if (vl_ != nullptr) {
      weights_offload_.onload(*vl_, vl_->device(), stream);
    } else {
      weights_offload_.onload(*model_, model_->device(), stream);
    }
  }
  bool offloaded() const { return weights_offload_.offloaded(); }
  std::size_t kv_cache_bytes() const { return arena_.nbytes(); }

 private:
  struct Running {
    std::size_t request = 0;
    int64_t start = 0, capacity = 0;  // arena region (capacity >= prompt + max_new_tokens - 1 rows)
    int64_t cached = 0;               // tokens with keys in the arena
    std::vector<int32_t> pending;     // tokens to run this step
    // MRoPE of a VL engine: the prompt's (t, h, w) [prompt, 3] until its
    // prefill ran; then token i of the sequence sits at i + position_delta
    // on every axis (nn::MropePositions::next_position - prompt length).
    std::vector<int32_t> prompt_positions;
    int64_t position_delta = 0;
    bool done = false;
  };

  void init_config() {
    const auto& c = model_->config();
    if (cfg_.max_context <= 0) cfg_.max_context = c.max_position_embeddings;
    SLIME_CHECK(cfg_.max_batch >= 1, "Engine: max_batch must be >= 1, got ", cfg_.max_batch);
    SLIME_CHECK(cfg_.max_context >= 2, "Engine: max_context must be >= 2, got ", cfg_.max_context);
    SLIME_CHECK(cfg_.decode_steps >= 1, "Engine: decode_steps must be >= 1, got ", cfg_.decode_steps);
    if (cfg_.kv_capacity <= 0) cfg_.kv_capacity = cfg_.max_batch * cfg_.max_context;
    SLIME_CHECK(cfg_.kv_capacity <= int64_t(INT32_MAX), "Engine: kv_capacity ", cfg_.kv_capacity,
                " rows does not fit the i32 cu_seqlens");
  }

  void ensure_arena() {
    if (arena_.allocated()) return;
    const auto& c = model_->config();
    arena_.allocate(c.num_hidden_layers, cfg_.kv_capacity, c.num_key_value_heads, c.head_dim, model_->dtype(),
                    model_->device());
    alloc_ = RegionAllocator(cfg_.kv_capacity);
  }

  // Why request `r` cannot run (empty: it can). A VL engine also gets the
  // prompt's MRoPE positions in *positions (which checks the image-pad runs
  // against the grids).
  std::string invalid_reason(const Request& r, nn::MropePositions* positions) const {
    const int64_t vocab = model_->config().vocab_size;
    try {
      r.sampling.validate("request " + std::to_string(r.sample_id));
    } catch (const Error& e) {
      return e.what();
    }
    if (r.prompt.empty()) return "empty prompt";
    if (int64_t(r.prompt.size()) + 1 > cfg_.max_context)
      return "prompt of " + std::to_string(r.prompt.size()) +
             " tokens leaves no room for a new token in the context of " + std::to_string(cfg_.max_context);
    for (std::size_t i = 0; i < r.prompt.size(); ++i)
      if (r.prompt[i] < 0 || r.prompt[i] >= vocab)
        return "prompt token " + std::to_string(i) + " = " + std::to_string(r.prompt[i]) +
               " is outside the vocabulary [0, " + std::to_string(vocab) + ")";
    const bool pixels = r.pixel_values.defined() && r.pixel_values.numel() > 0;
    if (vl_ == nullptr) {
      if (!r.image_grids.empty() || pixels)
        return "the request has images (" + std::to_string(r.image_grids.size()) +
               " grids) but the engine's model is text-only (construct the Engine from a Qwen3VLModel)";
      return {};
    }
    // make_vl_batch's rules, for one sequence.
    const nn::Qwen3VLConfig& c = vl_->config();
    try {
      *positions = nn::mrope_positions(r.prompt, r.image_grids, c.image_token_id, c.vision.spatial_merge_size);
    } catch (const Error& e) {
      return e.message();
    }
    if (r.image_grids.empty()) return pixels ? "the request has pixel rows but no images (image_grids is empty)" : "";
    int64_t want = 0;
    for (const nn::GridThw& g : r.image_grids) want += g[0] * g[1] * g[2];
    const int64_t patch_dim = c.vision.patch_dim();
    if (!r.pixel_values.defined() || r.pixel_values.dtype() != DType::f32 || !r.pixel_values.device().is_cpu() ||
        r.pixel_values.shape() != Shape{want, patch_dim})
      return "pixel_values must be f32 [" + std::to_string(want) + ", " + std::to_string(patch_dim) +
             "] on the CPU (sum t·h·w of the request's " + std::to_string(r.image_grids.size()) +
             " image(s), in_channels·temporal·patch²), got " +
             (r.pixel_values.defined() ? r.pixel_values.str() : std::string("none"));
    return {};
  }

  void fail(Completion& c, std::string why) {
    c.finish = FinishReason::error;
    c.error = std::move(why);
    c.weight_version = weight_version_;
  }

  // Admits waiting requests in order while a slot and an arena region exist.
  // A request larger than the whole arena fails; one that merely does not fit
  // now waits (requests behind it wait too, keeping the order).
  void admit(const std::vector<Request>& requests, std::vector<nn::MropePositions>& prompt_positions,
             std::deque<std::size_t>& waiting, std::vector<Running>& running, std::vector<Completion>& out) {
    while (!waiting.empty() && int64_t(running.size()) < cfg_.max_batch) {
      const std::size_t i = waiting.front();
      const Request& r = requests[i];
      // The sequence's final token is never an input: it needs one row less
      // than its longest length.
      const int64_t cap = std::min<int64_t>(int64_t(r.prompt.size()) + r.sampling.max_new_tokens, cfg_.max_context) - 1;
      if (cap > alloc_.capacity()) {
        fail(out[i], "the sequence needs " + std::to_string(cap) + " KV rows, more than the arena's " +
                         std::to_string(alloc_.capacity()));
        waiting.pop_front();
        continue;
      }
      const auto start = alloc_.allocate(cap);
      if (!start) break;
      waiting.pop_front();
      Running run;
      run.request = i;
      run.start = *start;
      run.capacity = cap;
      run.pending = r.prompt;
      if (vl_ != nullptr) {
        run.prompt_positions = std::move(prompt_positions[i].positions);
        run.position_delta = int64_t(prompt_positions[i].next_position) - int64_t(r.prompt.size());
      }
      running.push_back(std::move(run));
    }
  }

  // One model pass over every running sequence's pending tokens, then one
  // sampled token each.
  void step(const std::vector<Request>& requests, std::vector<Running>& running, std::vector<Completion>& out,
            const Stream& stream) {
    const auto& c = model_->config();
    const Device dev = model_->device();
    // The arena layout wants segments in row order; rows of the step follow it.
    std::sort(running.begin(), running.end(), [](const Running& a, const Running& b) { return a.start < b.start; });
    const bool mrope = c.uses_mrope();  // positions [T, 3], else [T]
    std::vector<ArenaSegment> segs;
    std::vector<int32_t> tokens, positions, last_rows, image_rows;
    std::vector<std::pair<int64_t, int64_t>> step_rows;  // per running sequence: its first row, its row count
    std::vector<std::size_t> with_images;                // requests whose prompt (and images) this step prefills
    for (const Running& r : running) {
      segs.push_back({r.start, r.cached, int64_t(r.pending.size())});
      const int64_t row0 = int64_t(tokens.size());
      step_rows.emplace_back(row0, int64_t(r.pending.size()));
      tokens.insert(tokens.end(), r.pending.begin(), r.pending.end());
      if (!r.prompt_positions.empty()) {  // a VL prefill
        positions.insert(positions.end(), r.prompt_positions.begin(), r.prompt_positions.end());
        if (!requests[r.request].image_grids.empty()) {
          with_images.push_back(r.request);
          for (std::size_t j = 0; j < r.pending.size(); ++j)
            if (r.pending[j] == vl_->config().image_token_id) image_rows.push_back(int32_t(row0 + int64_t(j)));
        }
      } else {
        for (std::size_t j = 0; j < r.pending.size(); ++j) {
          const int32_t p = int32_t(r.cached + int64_t(j) + r.position_delta);
          positions.insert(positions.end(), mrope ? 3u : 1u, p);
        }
      }
      last_rows.push_back(int32_t(tokens.size() - 1));
    }
    const ArenaLayout lay = arena_layout(segs, arena_.capacity);
    const int64_t T = int64_t(tokens.size()), B = int64_t(running.size());
    // Every index of the step goes up in one copy (a decode step is bound by
    // the host: each upload costs as much as several kernel launches):
    // [tokens T | positions T or 3T | cu_q B'+1 | cu_k B'+1 | write_rows T |
    //  last_rows B | image_rows N].
    std::vector<int32_t> idx;
    idx.reserve(std::size_t(2 * T + B) + positions.size() + lay.cu_q.size() + lay.cu_k.size() + image_rows.size());
    for (const std::vector<int32_t>* part : std::initializer_list<const std::vector<int32_t>*>{
             &tokens, &positions, &lay.cu_q, &lay.cu_k, &lay.write_rows, &last_rows, &image_rows})
      idx.insert(idx.end(), part->begin(), part->end());
    const Tensor uploaded = upload(idx, buffers_.indices, buffers_.indices_host, dev, stream);
    int64_t at = 0;
    const auto next = [&](std::size_t n) {
      Tensor t = uploaded.view(at, Shape{int64_t(n)});
      at += int64_t(n);
      return t;
    };
    // The step's batch: sequence b of the arena's layout holds the new tokens
    // of its region (none in the gaps), at their positions in the sequence.
    nn::PackedBatch batch;
    batch.tokens = next(tokens.size());
    batch.positions = uploaded.view(at, mrope ? Shape{T, 3} : Shape{T});
    at += int64_t(positions.size());
    batch.cu_seqlens_host = lay.cu_q;
    batch.cu_seqlens = next(lay.cu_q.size());
    batch.max_seqlen = lay.max_q;
    const Tensor cu_k = next(lay.cu_k.size());
    const Tensor write_rows = next(lay.write_rows.size());
    const Tensor last_index = next(last_rows.size());
    const nn::VisualEmbeds visual = with_images.empty()
                                        ? nn::VisualEmbeds{}
                                        : encode_images(requests, with_images, next(image_rows.size()), stream);

    // The model's own layers, their attention over the arena (the new keys
    // and values are written into it).
    nn::Qwen3Model::Context& ctx = buffers_.ctx;  // reused: its buffers hold every step's activations
    nn::NoHooks no_hooks;
    const std::vector<int> sparse = model_->sparse_layers();
    ctx.record_routing = cfg_.record_routing && !sparse.empty();
    const Tensor hidden = model_->forward(batch, ctx, stream, no_hooks, arena_.source(lay, write_rows, cu_k), visual);
    const Tensor last = reuse_buffer(buffers_.last, {B, c.hidden_size}, model_->dtype(), dev, stream);
    ops::gather_rows(hidden, last_index, last, stream);
    const Tensor logits = model_->logits(ctx, last, stream);
    const Tensor sampled_tokens = sample(requests, running, out, logits, stream);  // i32 [B]
    std::map<float, std::vector<int32_t>> by_temperature;                          // temperature -> rows of `last`
    for (int64_t b = 0; b < B; ++b) {
      const float t = requests[running[std::size_t(b)].request].sampling.temperature;
      by_temperature[t == 0.f ? 1.f : t].push_back(int32_t(b));
    }
    std::vector<int32_t> sampled;
    std::vector<float> lp(static_cast<std::size_t>(B));
    if (by_temperature.size() == 1) {
      // One temperature (the usual case): the logprobs of every row follow the
      // sampling on the device, and one wait brings both back.
      const Tensor targets = sampled_tokens.device() == dev ? sampled_tokens : sampled_tokens.to(dev, stream);
      const ops::TokenLogprobs res = model_->token_logprobs(ctx, last, targets, by_temperature.begin()->first, stream);
      sampled = sampled_tokens.to_vector<int32_t>(stream);
      lp = res.logprobs.to_vector<float>(stream);
    } else {
      sampled = sampled_tokens.to_vector<int32_t>(stream);
      for (const auto& [temperature, rows] : by_temperature) {
        const int64_t n = int64_t(rows.size());
        const Tensor sub = Tensor::empty({n, c.hidden_size}, model_->dtype(), dev, stream);
        ops::gather_rows(last, Tensor::from_vector(rows, {n}, dev, stream), sub, stream);
        std::vector<int32_t> targets;
        for (int32_t b : rows) targets.push_back(sampled[std::size_t(b)]);
        const ops::TokenLogprobs res =
            model_->token_logprobs(sub, Tensor::from_vector(targets, {n}, dev, stream), temperature, stream);
        const std::vector<float> v = res.logprobs.to_vector<float>(stream);
        for (int64_t j = 0; j < n; ++j) lp[std::size_t(rows[std::size_t(j)])] = v[std::size_t(j)];
      }
    }

    // The step's routing, per sparse layer [T, k] on the host (after the
    // wait for the sampled tokens: no extra stall).
    std::vector<std::vector<int32_t>> routing;
    if (ctx.record_routing)
      for (int l : sparse) routing.push_back(ctx.routing[std::size_t(l)].to_vector<int32_t>(stream));
    const int64_t k = c.num_experts_per_tok;

    for (int64_t b = 0; b < B; ++b) {
      Running& r = running[std::size_t(b)];
      const Request& req = requests[r.request];
      Completion& done = out[r.request];
      if (ctx.record_routing) {
        const auto [row0, rows] = step_rows[std::size_t(b)];
        for (int64_t row = row0; row < row0 + rows; ++row)
          for (const std::vector<int32_t>& ids : routing)
            done.routing.insert(done.routing.end(), ids.begin() + row * k, ids.begin() + (row + 1) * k);
      }
      finish_token(req, r, done, sampled[std::size_t(b)], lp[std::size_t(b)]);
    }
  }

  // How many decode steps can run back to back now (EngineConfig::
  // decode_steps); 1 or less: take one step. Every running sequence must be
  // decoding (one pending token, its prompt done), sample at one temperature
  // (0 counts as 1, as in step) and, on the GPU, on the device; no routing is
  // recorded. The run is no longer than any sequence's remaining tokens, so
  // no region overflows.
  int64_t decode_run_length(const std::vector<Request>& requests, const std::vector<Running>& running,
                            const std::vector<Completion>& out) const {
    if (cfg_.decode_steps <= 1 || (cfg_.record_routing && !model_->sparse_layers().empty())) return 1;
    const int64_t vocab = model_->config().vocab_size;
    const bool gpu = model_->device().is_cuda();
    int64_t n = cfg_.decode_steps;
    std::optional<float> temperature;
    for (const Running& r : running) {
      const Request& req = requests[r.request];
      if (r.pending.size() != 1 || !r.prompt_positions.empty() || r.cached == 0) return 1;
      if (gpu && has_filter(req.sampling, vocab)) return 1;
      const float t = req.sampling.temperature == 0.f ? 1.f : req.sampling.temperature;
      if (temperature && *temperature != t) return 1;
      temperature = t;
      const int64_t made = int64_t(out[r.request].tokens.size());
      n = std::min({n, req.sampling.max_new_tokens - made, cfg_.max_context - int64_t(req.prompt.size()) - made});
    }
    return n;
  }

  // `steps` decode steps of every running sequence with one wait of the host
  // at the end (see EngineConfig::decode_steps): the steps' indices and the
  // sampler's inputs do not depend on the sampled tokens, so they are
  // computed here and go up in one copy each; step j's input tokens are step
  // j - 1's sampled tokens on the device. Then the host walks the steps in
  // order as step() would: a sequence that stopped keeps none of its later
  // tokens.
  void decode_run(const std::vector<Request>& requests, std::vector<Running>& running, std::vector<Completion>& out,
                  int64_t steps, const Stream& stream) {
    const auto& c = model_->config();
    const Device dev = model_->device();
    std::sort(running.begin(), running.end(), [](const Running& a, const Running& b) { return a.start < b.start; });
    const bool mrope = c.uses_mrope();
    const int64_t B = int64_t(running.size());
    const float temperature = [&] {
      const float t = requests[running[0].request].sampling.temperature;
      return t == 0.f ? 1.f : t;
    }();
    // One i32 upload: [first tokens B | last rows B | per step: positions B or
    // 3B, cu_q, cu_k, write_rows B]; the layouts differ from step to step
    // (every sequence's keys grow by one, the gaps shrink).
    std::vector<int32_t> idx;
    for (const Running& r : running) idx.push_back(r.pending[0]);
    for (int64_t b = 0; b < B; ++b) idx.push_back(int32_t(b));
    struct StepIndex {
      ArenaLayout layout;
      int64_t positions, cu_q, cu_k, write_rows;  // offsets into the upload
    };
    std::vector<StepIndex> at(static_cast<std::size_t>(steps));
    for (int64_t j = 0; j < steps; ++j) {
      std::vector<ArenaSegment> segs;
      for (const Running& r : running) segs.push_back({r.start, r.cached + j, 1});
      StepIndex& a = at[std::size_t(j)];
      a.layout = arena_layout(segs, arena_.capacity);
      const ArenaLayout& lay = a.layout;
      a.positions = int64_t(idx.size());
      for (const Running& r : running) idx.insert(idx.end(), mrope ? 3u : 1u, int32_t(r.cached + j + r.position_delta));
      a.cu_q = int64_t(idx.size());
      idx.insert(idx.end(), lay.cu_q.begin(), lay.cu_q.end());
      a.cu_k = int64_t(idx.size());
      idx.insert(idx.end(), lay.cu_k.begin(), lay.cu_k.end());
      a.write_rows = int64_t(idx.size());
      idx.insert(idx.end(), lay.write_rows.begin(), lay.write_rows.end());
    }
    const Tensor uploaded = upload(idx, buffers_.indices, buffers_.indices_host, dev, stream);
    const Tensor last_index = uploaded.view(B, Shape{B});
    // The run's sampled tokens and logprobs, [steps, B] each.
    const Tensor tokens = reuse_buffer(buffers_.run_tokens, {steps, B}, DType::i32, dev, stream);
    const Tensor logprobs = reuse_buffer(buffers_.run_logprobs, {steps, B}, DType::f32, dev, stream);
    // The device sampler's inputs for every step, one upload (sampler_words).
    const bool device_sampling = dev.is_cuda();
    Tensor sampler_inputs;
    if (device_sampling)
      sampler_inputs =
          upload(sampler_words(requests, running, out, steps), buffers_.sampling, buffers_.sampling_host, dev, stream);

    nn::Qwen3Model::Context& ctx = buffers_.ctx;
    ctx.record_routing = false;
    nn::NoHooks no_hooks;
    for (int64_t j = 0; j < steps; ++j) {
      const StepIndex& a = at[std::size_t(j)];
      nn::PackedBatch batch;
      batch.tokens = j == 0 ? uploaded.view(0, Shape{B}) : tokens.view((j - 1) * B, Shape{B});
      batch.positions = uploaded.view(a.positions, mrope ? Shape{B, 3} : Shape{B});
      const int64_t n_cu = int64_t(a.layout.cu_q.size());
      batch.cu_seqlens_host = a.layout.cu_q;
      batch.cu_seqlens = uploaded.view(a.cu_q, Shape{n_cu});
      batch.max_seqlen = a.layout.max_q;
      const Tensor cu_k = uploaded.view(a.cu_k, Shape{n_cu});
      const Tensor write_rows = uploaded.view(a.write_rows, Shape{B});
      const Tensor hidden =
          model_->forward(batch, ctx, stream, no_hooks, arena_.source(a.layout, write_rows, cu_k), {});
      const Tensor last = reuse_buffer(buffers_.last, {B, c.hidden_size}, model_->dtype(), dev, stream);
      ops::gather_rows(hidden, last_index, last, stream);
      const Tensor logits = model_->logits(ctx, last, stream);
      Tensor sampled = tokens.view(j * B, Shape{B});
      if (device_sampling) {
#if SLIME_HAS_CUDA
        DeviceGuard guard(dev);
        const int64_t* w = sampler_inputs.data<int64_t>();
        cuda::sample_rows(logits.data<float>(), B, c.vocab_size, reinterpret_cast<const uint64_t*>(w), w + B + j * B,
                          reinterpret_cast<const float*>(w + B + steps * B), sampled.data<int32_t>(),
                          (stream.device() == dev ? stream : Stream::default_for(dev)).handle());
#endif
      } else {
        sample_on_host(requests, running, out, logits.data<float>(), c.vocab_size, j, sampled.data<int32_t>());
      }
      const ops::TokenLogprobs res = model_->token_logprobs(ctx, last, sampled, temperature, stream);
      logprobs.view(j * B, Shape{B}).copy_from(res.logprobs, stream);
    }
    // The one wait of the run.
    const std::vector<int32_t> sampled = tokens.to_vector<int32_t>(stream);
    const std::vector<float> lp = logprobs.to_vector<float>(stream);
    for (int64_t j = 0; j < steps; ++j)
      for (int64_t b = 0; b < B; ++b) {
        Running& r = running[std::size_t(b)];
        if (r.done) continue;
        finish_token(requests[r.request], r, out[r.request], sampled[std::size_t(j * B + b)],
                     lp[std::size_t(j * B + b)]);
      }
  }

  // A sequence's new token: appended with its logprob; the sequence stops at
  // a stop token, at max_new_tokens or at the context's end.
  void finish_token(const Request& req, Running& r, Completion& done, int32_t t, float lp) {
    r.cached += int64_t(r.pending.size());
    r.prompt_positions.clear();
    done.tokens.push_back(t);
    done.logprobs.push_back(lp);
    r.pending.assign(1, t);
    const auto& stops = req.sampling.stop_tokens;
    if (std::find(stops.begin(), stops.end(), t) != stops.end()) {
      r.done = true;
      done.finish = FinishReason::stop;
    } else if (int64_t(done.tokens.size()) >= req.sampling.max_new_tokens ||
               int64_t(req.prompt.size() + done.tokens.size()) >= cfg_.max_context) {
      r.done = true;
      done.finish = FinishReason::length;
    }
    if (r.done) done.weight_version = weight_version_;
  }

  // The tower over the images of `prompts` (requests, in the step's row
  // order) in one call: their pixel rows concatenated in that order, as
  // make_vl_batch packs them; `rows` i32 [N] are the step's image-pad rows.
  nn::VisualEmbeds encode_images(const std::vector<Request>& requests, const std::vector<std::size_t>& prompts,
                                 const Tensor& rows, const Stream& stream) {
    const int64_t patch_dim = vl_->config().vision.patch_dim();
    std::vector<nn::GridThw> grids;
    int64_t patches = 0;
    for (std::size_t i : prompts) {
      grids.insert(grids.end(), requests[i].image_grids.begin(), requests[i].image_grids.end());
      patches += requests[i].pixel_values.size(0);
    }
    Tensor pixels = Tensor::empty({patches, patch_dim}, DType::f32);
    int64_t at = 0;
    for (std::size_t i : prompts) {
      const Tensor& p = requests[i].pixel_values;
      pixels.slice_rows(at, p.size(0)).copy_from(p);
      at += p.size(0);
    }
    if (vl_->dtype() != DType::f32) {
      Tensor cast = Tensor::empty({patches, patch_dim}, vl_->dtype());
      ops::cast(pixels, cast);
      pixels = cast;
    }
    if (!vl_->device().is_cpu()) pixels = pixels.to(vl_->device(), stream);
    nn::Qwen3VLVisionModel::Context ctx;
    nn::VisionOutput out = vl_->visual().forward(pixels, grids, ctx, stream);
    return nn::VisualEmbeds{rows, std::move(out.embeds), std::move(out.deepstack)};
  }

  // One token per running sequence from logits [B, V] f32, as i32 [B]: on
  // the device when every request samples without top-k / top-p (nothing
  // comes back to the host here), else on the host from a copy of the logits
  // (a CPU tensor).
  Tensor sample(const std::vector<Request>& requests, const std::vector<Running>& running,
                const std::vector<Completion>& out, const Tensor& logits, const Stream& stream) {
    const int64_t B = logits.size(0), V = logits.size(1);
    bool on_device = logits.device().is_cuda();
    for (const Running& r : running) on_device = on_device && !has_filter(requests[r.request].sampling, V);
#if SLIME_HAS_CUDA
    if (on_device) {
      const std::vector<int64_t> words = sampler_words(requests, running, out, 1);
      const Device d = logits.device();
      const Tensor up = upload(words, buffers_.sampling, buffers_.sampling_host, d, stream);
      const Tensor tok = reuse_buffer(buffers_.sampled, {B}, DType::i32, d, stream);
      DeviceGuard guard(d);
      const int64_t* w = up.data<int64_t>();
      cuda::sample_rows(logits.data<float>(), B, V, reinterpret_cast<const uint64_t*>(w), w + B,
                        reinterpret_cast<const float*>(w + 2 * B), tok.data<int32_t>(),
                        (stream.device() == d ? stream : Stream::default_for(d)).handle());
      return tok;
    }
#endif
    const std::vector<float> host = logits.to_vector<float>(stream);
    const Tensor tok = reuse_buffer(buffers_.sampled, {B}, DType::i32, Device::cpu(), Stream{});
    sample_on_host(requests, running, out, host.data(), V, 0, tok.data<int32_t>());
    return tok;
  }

  // The device sampler's inputs for `steps` consecutive tokens of every
  // running sequence, one i64 upload: [keys B | per step: token indices B |
  // temperatures (f32 bits, 2 per word)].
  std::vector<int64_t> sampler_words(const std::vector<Request>& requests, const std::vector<Running>& running,
                                     const std::vector<Completion>& out, int64_t steps) const {
    const std::size_t B = running.size();
    std::vector<int64_t> words;
    words.reserve(B * std::size_t(1 + steps) + (B + 1) / 2);
    for (const Running& r : running)  // the bits, read back as uint64_t
      words.push_back(int64_t(sample_stream_key(cfg_.seed, requests[r.request].sample_id)));
    for (int64_t j = 0; j < steps; ++j)
      for (const Running& r : running) words.push_back(int64_t(out[r.request].tokens.size()) + j);
    std::vector<float> temps;
    for (const Running& r : running) temps.push_back(requests[r.request].sampling.temperature);
    const std::size_t t0 = words.size();
    words.resize(t0 + (B + 1) / 2, 0);
    std::memcpy(words.data() + t0, temps.data(), temps.size() * sizeof(float));
    return words;
  }

  // Host sampling of every running sequence's token `ahead` tokens past its
  // completion so far, from logits [B, V] f32 on the host, into tokens[B].
  void sample_on_host(const std::vector<Request>& requests, const std::vector<Running>& running,
                      const std::vector<Completion>& out, const float* logits, int64_t V, int64_t ahead,
                      int32_t* tokens) {
    for (std::size_t b = 0; b < running.size(); ++b) {
      const Request& req = requests[running[b].request];
      tokens[b] = sample_token(logits + int64_t(b) * V, V, req.sampling, cfg_.seed, req.sample_id,
                               int64_t(out[running[b].request].tokens.size()) + ahead, scratch_);
    }
  }

  // `values` as a 1-D tensor on `device`, through buffers kept across steps
  // (`host`: the staging of a device upload; a pageable source, so the copy
  // has read it when it returns and the next step may overwrite it).
  template <class T>
  static Tensor upload(const std::vector<T>& values, Tensor& cache, Tensor& host, Device device, const Stream& stream) {
    const Shape shape{int64_t(values.size())};
    const Tensor h = reuse_buffer(device.is_cpu() ? cache : host, shape, dtype_of<T>, Device::cpu(), Stream{});
    if (!values.empty()) std::memcpy(h.data_ptr(), values.data(), values.size() * sizeof(T));
    if (device.is_cpu()) return h;
    Tensor d = reuse_buffer(cache, shape, dtype_of<T>, device, stream);
    d.copy_from(h, stream);
    return d;
  }

  // What a step writes, kept from one step to the next (issue 19: a decode
  // step allocates nothing once they are sized); freed with the KV arena.
  struct StepBuffers {
    nn::Qwen3Model::Context ctx;      // activations; the LM head's logits and logprobs
    Tensor indices, indices_host;     // the step's uploaded indices (see step)
    Tensor last;                      // the hidden rows of each sequence's last token
    Tensor sampling, sampling_host;   // the device sampler's keys, steps and temperatures
    Tensor sampled;                   // the sampled tokens
    Tensor run_tokens, run_logprobs;  // a decode run's sampled tokens and logprobs [steps, B]
  };

  nn::Qwen3Model* model_;
  nn::Qwen3VLModel* vl_ = nullptr;  // a VL engine's model (model_ is its language model)
  EngineConfig cfg_;
  KvArena arena_;
  RegionAllocator alloc_;
  int64_t weight_version_ = 0;
  std::vector<int32_t> scratch_;
  StepBuffers buffers_;
  EngineStats stats_;
  nn::ParameterOffload weights_offload_;
};

}  // namespace slime::rollout
