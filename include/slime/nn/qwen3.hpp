// slime/nn/qwen3.hpp: Qwen3Model, the Qwen3 dense decoder (HF
// Qwen3ForCausalLM) and Qwen3-MoE (HF Qwen3MoeForCausalLM): embedding,
// decoder layers (dense MLP, or router + experts in the layers
// Qwen3Config::is_sparse_layer picks), final RMSNorm and the LM head (tied to
// the embedding when config.tie_word_embeddings), over packed sequences, with
// explicit forward and backward. forward is the library's one layer loop:
// its K/V source (nn/kv_source.hpp) is SelfKv for training and scoring,
// CachedKv for decode (rollout::Engine runs it over its KV arena).
//
// A step: forward(batch, ctx) -> final-normed hidden [T, D]; then either
// logits(hidden) (f32 [T, V], small models and tests only) or
// token_logprobs(hidden, targets) (the fused lm-head + log-softmax, never
// materialising the logits); token_logprobs_backward turns gradients of the
// log-probabilities (and entropies) into d_hidden, accumulating the lm_head
// gradient; backward(ctx, d_hidden) accumulates every other gradient.
// loss_and_backward does all of it for L = -sum_t logprob_t / normalizer
// (+ router_aux_loss_coef * aux loss for MoE, see below).
//
// MoE load-balancing loss (HF load_balancing_loss_func): after forward,
// aux_loss_and_grad(ctx, scale) evaluates the auxiliary loss once over the
// router outputs of all sparse layers concatenated ([L·T, E]) and returns
// the gradients of scale · aux w.r.t. each sparse layer's router logits;
// pass them to backward(ctx, d_hidden, stream, aux), which feeds each to its
// block (SparseMoeBlock::backward's aux_dlogits). HF adds
// router_aux_loss_coef · aux to the loss only when output_router_logits is
// true; loss_and_backward mirrors that by default (with_aux_loss unset
// follows config.output_router_logits). The aux loss of a micro-batch covers
// that micro-batch's tokens (HF: one forward call's batch).
//
// Qwen3-VL's language model is this class too (model_type qwen3_vl_text /
// qwen3_vl_moe_text, HF prefix "model.language_model"): its attention
// rotates by interleaved MRoPE (batch.positions [T, 3]), and forward takes
// the image features (VisualEmbeds): the merged patch embeddings replace the
// embeddings of the image-pad rows, and deepstack feature j is added to
// those rows after decoder layer j (transformers' Qwen3VLTextModel);
// backward returns their gradients (VisualGrads). nn::Qwen3VLModel
// (nn/qwen3_vl.hpp) runs the vision tower and this model as one.
//
// Dtypes: f32 weights and activations (the CPU reference) or bf16 (the GPU
// model; CUDA attention is bf16 only, for the head dims ops/attention.hpp lists); gradients fp32.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "slime/nn/causal_lm.hpp"
#include "slime/nn/config.hpp"
#include "slime/nn/decoder_layer.hpp"
#include "slime/nn/embedding.hpp"
#include "slime/nn/kv_source.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/moe.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/rms_norm.hpp"
#include "slime/nn/token_dispatcher.hpp"
#include "slime/nn/units.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/ops/host_checks.hpp"
#include "slime/ops/index_rows.hpp"
#include "slime/ops/linear.hpp"
#include "slime/ops/router.hpp"
#include "slime/ops/token_logprobs.hpp"

namespace slime::nn {

// Image features a Qwen3-VL language model takes in forward (all on the
// model's device, in its dtype): rows i32 [N] are the packed rows of the
// image-pad tokens (strictly increasing), embeds [N, D] replace their
// embeddings, deepstack[j] [N, D] is added to them after decoder layer j.
// An undefined `rows` means no images.
struct VisualEmbeds {
  Tensor rows;
  Tensor embeds;
  std::vector<Tensor> deepstack;
};

// The gradients of a backward w.r.t. the VisualEmbeds of its forward
// (written): embeds [N, D], deepstack[j] [N, D]. Empty when the forward had
// no images.
struct VisualGrads {
  Tensor embeds;
  std::vector<Tensor> deepstack;
};

class Qwen3Model {
 public:
  struct Context {
    PackedBatch batch;
    Embedding::Context embed_tokens;
    // One per decoder layer; after a forward with a K/V source that is not
    // differentiable (CachedKv), one that every layer reused.
    std::vector<DecoderLayer::Context> layers;
    RMSNorm::Context norm;
    bool differentiable = false;  // from a forward backward may follow (SelfKv)
    Tensor visual_rows;           // VisualEmbeds::rows of the forward (undefined: no images)
    std::size_t deepstack = 0;    // how many deepstack features it added
    // Routing replay (MoE; set before forward, empty: route by the top-k):
    // one i32 [T, num_experts_per_tok] tensor per decoder layer on the
    // model's device, undefined for dense layers; every sparse layer routes
    // its tokens to these experts (SparseMoeBlock::Context::replay_indices),
    // e.g. the ones the rollout engine chose for the same tokens.
    std::vector<Tensor> routing_replay;
    // Routing record: when record_routing is set, forward leaves each sparse
    // layer's experts (i32 [T, k], replayed or chosen) in routing[layer]
    // (undefined for dense layers); also after a forward over a KV cache,
    // whose layers share one context.
    bool record_routing = false;
    std::vector<Tensor> routing;
    // token_logprobs(ctx, ...) and its backward: outputs, workspace, d_hidden.
    ops::TokenLogprobsBuffers logprobs;
    Tensor logits;  // logits(ctx, ...)
  };

  Qwen3Model() = default;

  // Parameters allocated on opt.device in opt.dtype, uninitialised (use
  // init_random or load_hf). Throws for an invalid config. `dispatcher`
  // (optional, MoE only; e.g. a parallel::ExpertParallel) is handed to every
  // sparse block: it moves the tokens to the experts and decides which
  // experts this rank holds (Parameter::first_expert and the stacks' dim 0).
  // `prefix` is the HF module path of the decoder ("model"; a Qwen3-VL
  // language model's is "model.language_model"); the LM head is
  // "lm_head.weight" either way.
  Qwen3Model(const Qwen3Config& config, ModuleOptions opt, DispatcherRef dispatcher = {}, std::string prefix = "model")
      : config_(config), options_(opt), prefix_(std::move(prefix)) {
    config_.validate();
    const std::string where = config.source.empty() ? std::string("Qwen3Model") : "Qwen3Model('" + config.source + "')";
    detail::check_module_options(opt, where);
    if (opt.device.is_cuda()) {
      // ops/attention.hpp: the CUDA kernels are bf16, for the head dims cuda::visit_head_dim lists.
      SLIME_CHECK(opt.dtype == DType::bf16, where, ": a model on ", opt.device,
                  " must be bf16 (the CUDA attention kernels are bf16 only), got ", dtype_name(opt.dtype));
      try {
        ops::check_attention_head_dim(opt.device, config_.head_dim);
      } catch (const Error& e) {
        SLIME_FAIL(where, ": ", e.message());
      }
    }
    AttentionConfig attn;
    attn.hidden_size = config_.hidden_size;
    attn.num_heads = config_.num_attention_heads;
    attn.num_kv_heads = config_.num_key_value_heads;
    attn.head_dim = config_.head_dim;
    attn.rope = config_.rope();
    attn.rms_norm_eps = config_.rms_norm_eps;
    embed_tokens_ = Embedding(prefix_ + ".embed_tokens", config_.vocab_size, config_.hidden_size, opt);
    layers_.reserve(std::size_t(config_.num_hidden_layers));
    MoeBlockConfig moe;
    moe.hidden_size = config_.hidden_size;
    moe.moe_intermediate_size = config_.moe_intermediate_size;
    moe.num_experts = config_.num_experts;
    moe.num_experts_per_tok = config_.num_experts_per_tok;
    moe.norm_topk_prob = config_.norm_topk_prob;
    for (int i = 0; i < config_.num_hidden_layers; ++i) {
      const std::string layer = prefix_ + ".layers." + std::to_string(i);
      if (config_.is_sparse_layer(i)) {
        layers_.emplace_back(layer, attn, moe, opt, dispatcher);
      } else {
        layers_.emplace_back(layer, attn, config_.intermediate_size, opt);
      }
    }
    norm_ = RMSNorm(prefix_ + ".norm", config_.hidden_size, config_.rms_norm_eps, opt);
    if (!config_.tie_word_embeddings) {
      lm_head_.name = "lm_head.weight";
      lm_head_.value = Tensor::empty({config_.vocab_size, config_.hidden_size}, opt.dtype, opt.device);
    }
  }

  const Qwen3Config& config() const { return config_; }
  // The decoder's config (here the model's own; a VLM's is its text model's).
  const Qwen3Config& language_config() const { return config_; }
  const std::string& prefix() const { return prefix_; }
  const ModuleOptions& options() const { return options_; }
  Device device() const { return options_.device; }
  DType dtype() const { return options_.dtype; }

  Embedding& embed_tokens() { return embed_tokens_; }
  std::vector<DecoderLayer>& layers() { return layers_; }
  RMSNorm& norm() { return norm_; }
  // The LM head weight [V, D]: lm_head.weight, or the embedding's weight when
  // tied (which then receives both gradients).
  Parameter& lm_head() { return config_.tie_word_embeddings ? embed_tokens_.weight : lm_head_; }

  // Every parameter once, with its HF name, in the order of HF's state_dict;
  // no lm_head.weight when the embeddings are tied.
  template <class F>
  void for_each_parameter(F&& f) {
    embed_tokens_.for_each_parameter(f);
    for (auto& layer : layers_) layer.for_each_parameter(f);
    norm_.for_each_parameter(f);
    if (!config_.tie_word_embeddings) f(lm_head_);
  }

  // The op workspaces the modules keep between calls (backward scratch,
  // sized by the largest micro-batch seen; nn::release_workspaces).
  template <class F>
  void for_each_workspace(F&& f) {
    embed_tokens_.for_each_workspace(f);
    for (auto& layer : layers_) layer.for_each_workspace(f);
    norm_.for_each_workspace(f);
    // The sequence-parallel attention every layer shares: visited once.
    if (SequenceAttention* sa = sequence_attention()) sa->for_each_workspace([&](Tensor& t) { f(t); });
  }

  // Projections and embeddings ~ N(0, std), norm weights 1 (counter-based:
  // the same values on every device for the same seed).
  void init_random(uint64_t seed, float std = 0.02f, const Stream& stream = {}) {
    init_parameters(*this, seed, std, stream);
  }

  // The units (nn/units.hpp), in forward order ("model" is prefix()):
  // "model.embed_tokens" (with the LM head when tied), per decoder layer
  // "model.layers.<i>" and, for a sparse layer whose experts are split over
  // ranks (a dispatcher of degree > 1), a second unit
  // "model.layers.<i>.mlp.experts" (UnitKind::expert) right after it with the
  // stacked expert weights (this rank's slice; the router gate stays in the
  // layer's unit); last "model.norm" (with the LM head, "model.norm+lm_head",
  // when untied).
  std::vector<Unit> units() {
    std::vector<Unit> u;
    auto add = [&](std::string name) -> Unit& {
      u.push_back(Unit{std::move(name), {}, UnitKind::dense, 1, false});
      return u.back();
    };
    Unit& embed = add(prefix_ + ".embed_tokens");
    embed_tokens_.for_each_parameter([&](Parameter& p) { embed.params.push_back(&p); });
    embed.has_lm_head = config_.tie_word_embeddings;
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      DecoderLayer& layer = layers_[i];
      const std::string name = prefix_ + ".layers." + std::to_string(i);
      add(name);
      if (has_expert_unit(layer)) {
        Unit experts{name + ".mlp.experts", {}, UnitKind::expert, layer.moe->expert_degree(), false};
        layer.for_each_parameter(
            [&](Parameter& p) { (p.is_expert_stack() ? experts : u.back()).params.push_back(&p); });
        u.push_back(std::move(experts));
      } else {
        layer.for_each_parameter([&](Parameter& p) { u.back().params.push_back(&p); });
      }
    }
    Unit& last = add(prefix_ + ".norm");
    norm_.for_each_parameter([&](Parameter& p) { last.params.push_back(&p); });
    if (!config_.tie_word_embeddings) {
      last.name = prefix_ + ".norm+lm_head";
      last.params.push_back(&lm_head_);
      last.has_lm_head = true;
    }
    return u;
  }

  // Final-normed hidden states [T, D] of the packed batch (on the model's
  // device). `hooks` are called around every unit (see units()). `kv` gives
  // each layer's attention its keys and values (nn/kv_source.hpp): SelfKv,
  // the batch's own, and ctx keeps what backward needs; CachedKv, a KV cache
  // (decode: the batch holds each sequence's new tokens at their positions,
  // see CachedKv), and ctx keeps one layer's context, reused by every layer,
  // so no backward, aux loss or router logits follow. `visual`: the image
  // features of a Qwen3-VL batch (see VisualEmbeds; default none).
  template <UnitHooks Hooks = NoHooks, KvSource Kv = SelfKv>
  Tensor forward(const PackedBatch& batch, Context& ctx, const Stream& stream, Hooks& hooks, const Kv& kv = {},
                 const VisualEmbeds& visual = {}) {
    check_batch(batch);
    check_visual(visual, batch);
    ctx.batch = batch;
    ctx.differentiable = Kv::differentiable;
    ctx.layers.resize(Kv::differentiable ? layers_.size() : 1);
    ctx.visual_rows = visual.rows;
    ctx.deepstack = visual.rows.defined() ? visual.deepstack.size() : 0;
    hooks.forward_begin(0);
    Tensor h = embed_tokens_.forward(batch.tokens, ctx.embed_tokens, stream);
    hooks.forward_end(0);
    if (visual.rows.defined()) ops::scatter_rows(visual.embeds, visual.rows, h, stream);  // masked_scatter
    std::size_t u = 1;                                                                    // the layer's (first) unit
    const bool replay = !ctx.routing_replay.empty();
    SLIME_CHECK(!replay || ctx.routing_replay.size() == layers_.size(), "Qwen3Model::forward: routing_replay holds ",
                ctx.routing_replay.size(), " tensors, expected one per decoder layer (", layers_.size(), ")");
    ctx.routing.assign(ctx.record_routing ? layers_.size() : 0, Tensor());
    for (std::size_t i = 0; i < layers_.size(); ++i) {
      const bool experts = has_expert_unit(layers_[i]);
      DecoderLayer::Context& lc = ctx.layers[Kv::differentiable ? i : 0];
      if (layers_[i].is_sparse()) {
        SLIME_CHECK(!replay || ctx.routing_replay[i].defined(), "Qwen3Model::forward: routing_replay[", i,
                    "] is undefined but layer ", i, " is sparse");
        lc.moe.replay_indices = replay ? ctx.routing_replay[i] : Tensor();
      }
      hooks.forward_begin(u);
      if (experts) hooks.forward_begin(u + 1);
      h = layers_[i].forward(h, batch, lc, stream, kv.layer(i));
      // A copy: the context's buffer is reused (by the next layer over a KV
      // cache, by the next forward otherwise).
      if (ctx.record_routing && layers_[i].is_sparse()) ctx.routing[i] = lc.moe.indices.clone(stream);
      if (experts) hooks.forward_end(u + 1);
      hooks.forward_end(u);
      u += experts ? 2 : 1;
      if (i < ctx.deepstack) {  // h[rows] += deepstack[i]
        Tensor r = Tensor::empty(visual.deepstack[i].shape(), options_.dtype, options_.device, stream);
        ops::gather_rows(h, visual.rows, r, stream);
        ops::add_(r, visual.deepstack[i], stream);
        ops::scatter_rows(r, visual.rows, h, stream);
      }
    }
    hooks.forward_begin(u);
    h = norm_.forward(h, ctx.norm, stream);
    hooks.forward_end(u);
    return h;
  }
  Tensor forward(const PackedBatch& batch, Context& ctx, const Stream& stream = {}) {
    NoHooks none;
    return forward(batch, ctx, stream, none);
  }

  // Accumulates the gradients of every parameter but the LM head from
  // d_hidden [T, D] (the gradient of forward's output) and, when `aux` holds
  // gradients (aux_loss_and_grad of the same ctx), of the load-balancing loss.
  // `hooks` are called around every unit, in reverse order. When the forward
  // took VisualEmbeds, their gradients are written into *visual_grads (if
  // given; a frozen vision tower passes none).
  template <UnitHooks Hooks>
  void backward(const Context& ctx, const Tensor& d_hidden, const Stream& stream, Hooks& hooks, const AuxLoss& aux = {},
                VisualGrads* visual_grads = nullptr) {
    check_context(ctx, "backward");
    SLIME_CHECK(aux.dlogits.empty() || aux.dlogits.size() == layers_.size(), "Qwen3Model::backward: aux.dlogits holds ",
                aux.dlogits.size(), " tensors, expected none or one per layer (", layers_.size(),
                "; from aux_loss_and_grad)");
    std::size_t u = 1;
    for (const DecoderLayer& l : layers_) u += has_expert_unit(l) ? 2 : 1;
    hooks.backward_begin(u);
    Tensor d = norm_.backward(ctx.norm, d_hidden, stream);
    hooks.backward_end(u);
    const bool images = ctx.visual_rows.defined();
    const int64_t n_image = images ? ctx.visual_rows.numel() : 0;
    const auto gather_image_rows = [&](const Tensor& d) {
      Tensor g = Tensor::empty({n_image, config_.hidden_size}, options_.dtype, options_.device, stream);
      ops::gather_rows(d, ctx.visual_rows, g, stream);
      return g;
    };
    if (visual_grads != nullptr) *visual_grads = VisualGrads{};
    if (visual_grads != nullptr && images) visual_grads->deepstack.resize(ctx.deepstack);
    for (std::size_t i = layers_.size(); i-- > 0;) {
      const bool experts = has_expert_unit(layers_[i]);
      u -= experts ? 2 : 1;
      // deepstack[i] was added to layer i's output: its gradient is d there.
      if (visual_grads != nullptr && i < ctx.deepstack) visual_grads->deepstack[i] = gather_image_rows(d);
      if (experts) hooks.backward_begin(u + 1);
      hooks.backward_begin(u);
      d = layers_[i].backward(ctx.layers[i], d, stream, aux.dlogits.empty() ? Tensor{} : aux.dlogits[i]);
      if (experts) hooks.backward_end(u + 1);
      hooks.backward_end(u);
    }
    if (images) {
      // The image rows' embeddings were replaced: their gradient goes to the
      // tower, none to the embedding table.
      if (visual_grads != nullptr) visual_grads->embeds = gather_image_rows(d);
      ops::scatter_rows(Tensor::zeros({n_image, config_.hidden_size}, options_.dtype, options_.device, stream),
                        ctx.visual_rows, d, stream);
    }
    hooks.backward_begin(0);
    embed_tokens_.backward(ctx.embed_tokens, d, stream);
    hooks.backward_end(0);
  }
  void backward(const Context& ctx, const Tensor& d_hidden, const Stream& stream = {}, const AuxLoss& aux = {},
                VisualGrads* visual_grads = nullptr) {
    NoHooks none;
    backward(ctx, d_hidden, stream, none, aux, visual_grads);
  }

  // Sequence parallelism: every layer's attention runs through `sa`
  // (nn/sequence_attention.hpp, e.g. parallel::ContextParallel; not owned,
  // must outlive its use) in forwards over the batch's own keys; nullptr
  // (default): local attention. The batches forward then takes are this
  // rank's part of each sequence, as `sa` planned them.
  void set_sequence_attention(SequenceAttention* sa) {
    for (DecoderLayer& l : layers_) l.self_attn.sequence_attention = sa;
  }
  SequenceAttention* sequence_attention() const {
    return layers_.empty() ? nullptr : layers_.front().self_attn.sequence_attention;
  }

  // Indices of the decoder layers with experts (empty for dense models).
  std::vector<int> sparse_layers() const {
    std::vector<int> out;
    for (int i = 0; i < int(layers_.size()); ++i)
      if (layers_[std::size_t(i)].is_sparse()) out.push_back(i);
    return out;
  }

  // The router logits [T, num_experts] (the model's dtype) of each sparse
  // layer, in layer order (sparse_layers()), from the forward that filled ctx
  // (HF: outputs.router_logits).
  std::vector<Tensor> router_logits(const Context& ctx) const {
    check_context(ctx, "router_logits");
    std::vector<Tensor> out;
    for (int i : sparse_layers()) out.push_back(ctx.layers[std::size_t(i)].moe.router_logits);
    return out;
  }

  // The load-balancing loss of the forward that filled ctx (HF
  // load_balancing_loss_func over all sparse layers' router outputs
  // concatenated, no padding mask: every packed token counts), unscaled, and
  // the gradients of scale · aux w.r.t. each sparse layer's router logits, for
  // backward. scale defaults to config.router_aux_loss_coef (times 1 / the
  // number of micro-batches, say, when the trainer averages). A dense model
  // gives value 0 and no gradients. Runs on the model's device (the layers'
  // probs and indices copied into one [L·T, E] / [L·T, k] buffer; the
  // gradients are row views of one [L·T, E] f32 tensor) and reads the loss
  // back (a host synchronisation). With `reduce` (the batch's tokens spread
  // over ranks) the statistics of every rank's rows are summed first, so the
  // loss and the gradients of this rank's rows are those of the whole batch
  // (ops::router_aux_stats; equal to the unsplit batch's to f32 rounding of
  // the probability sums).
  AuxLoss aux_loss_and_grad(const Context& ctx, std::optional<double> scale = std::nullopt, const Stream& stream = {},
                            const AuxStatsReduce& reduce = {}) const {
    check_context(ctx, "aux_loss_and_grad");
    AuxLoss aux;
    aux.scale = scale.value_or(config_.router_aux_loss_coef);
    SLIME_CHECK(std::isfinite(aux.scale), "Qwen3Model::aux_loss_and_grad: scale = ", aux.scale, " is not finite");
    const std::vector<int> sparse = sparse_layers();
    if (sparse.empty()) return aux;
    const int64_t T = ctx.batch.num_tokens(), E = config_.num_experts, k = config_.num_experts_per_tok;
    const int64_t rows = T * int64_t(sparse.size());
    const Device dev = options_.device;
    Tensor probs = Tensor::empty({rows, E}, DType::f32, dev, stream);
    Tensor indices = Tensor::empty({rows, k}, DType::i32, dev, stream);
    for (std::size_t l = 0; l < sparse.size(); ++l) {
      const SparseMoeBlock::Context& m = ctx.layers[std::size_t(sparse[l])].moe;
      check_shape(m.probs, Shape{T, E}, "Qwen3Model::aux_loss_and_grad: router probs");
      check_shape(m.indices, Shape{T, k}, "Qwen3Model::aux_loss_and_grad: router indices");
      probs.slice_rows(int64_t(l) * T, T).copy_from(m.probs, stream);
      indices.slice_rows(int64_t(l) * T, T).copy_from(m.indices, stream);
    }
    Tensor loss = Tensor::empty({1}, DType::f32, dev, stream);
    Tensor dlogits = Tensor::empty({rows, E}, DType::f32, dev, stream);
    if (reduce) {
      Tensor stats = Tensor::empty({ops::router_aux_stats_size(E)}, DType::f32, dev, stream);
      ops::router_aux_stats(probs, indices, stats, /*accumulate=*/false, stream);
      reduce(stats, stream);
      ops::router_aux_loss_from_stats(stats, E, loss, stream);
      ops::router_aux_loss_backward_from_stats(probs, stats, float(aux.scale), dlogits, /*accumulate=*/false, stream);
    } else {
      ops::router_aux_loss_forward(probs, indices, loss, stream);
      ops::router_aux_loss_backward(probs, indices, float(aux.scale), dlogits, /*accumulate=*/false, stream);
    }
    aux.dlogits.resize(layers_.size());
    for (std::size_t l = 0; l < sparse.size(); ++l)
      aux.dlogits[std::size_t(sparse[l])] = dlogits.slice_rows(int64_t(l) * T, T);
    aux.value = double(loss.to_vector<float>(stream)[0]);
    return aux;
  }

  // logits [T, V] f32 = hidden · lm_headᵀ. Materialises [T, V]: for small
  // models and tests; training and scoring use token_logprobs.
  Tensor logits(const Tensor& hidden, const Stream& stream = {}) {
    check_hidden(hidden, "logits");
    Tensor y = Tensor::empty({hidden.size(0), config_.vocab_size}, DType::f32, options_.device, stream);
    ops::linear_forward(hidden, lm_head().value, y, stream);
    return y;
  }
  // As above, into ctx.logits (a view, valid until the next call with ctx).
  Tensor logits(Context& ctx, const Tensor& hidden, const Stream& stream = {}) {
    check_hidden(hidden, "logits");
    const Tensor y =
        reuse_buffer(ctx.logits, {hidden.size(0), config_.vocab_size}, DType::f32, options_.device, stream);
    ops::linear_forward(hidden, lm_head().value, y, stream);
    return y;
  }

  // log p(targets[t] | hidden[t]) and the entropy of each next-token
  // distribution at `temperature` (ops::token_logprobs with the LM head).
  ops::TokenLogprobs token_logprobs(const Tensor& hidden, const Tensor& targets, float temperature = 1.f,
                                    const Stream& stream = {}) {
    check_hidden(hidden, "token_logprobs");
    return ops::token_logprobs(hidden, lm_head().value, targets, temperature, stream);
  }

  // As above with the outputs (and the GPU workspace) in ctx's buffers: a
  // Context reused across steps allocates nothing here once sized. The
  // results are views, valid until the next call with the same Context.
  ops::TokenLogprobs token_logprobs(Context& ctx, const Tensor& hidden, const Tensor& targets, float temperature = 1.f,
                                    const Stream& stream = {}) {
    check_hidden(hidden, "token_logprobs");
    return ops::token_logprobs(hidden, lm_head().value, targets, temperature, ctx.logprobs, stream);
  }

  // d_hidden [T, D] (written) from the gradients of token_logprobs' outputs
  // (grad_logprobs / grad_entropy f32 [T], either may be undefined); the LM
  // head gradient accumulates.
  Tensor token_logprobs_backward(const Tensor& hidden, const Tensor& targets, float temperature,
                                 const ops::TokenLogprobs& fwd, const Tensor& grad_logprobs, const Tensor& grad_entropy,
                                 const Stream& stream = {}) {
    check_hidden(hidden, "token_logprobs_backward");
    Tensor d_hidden = Tensor::empty(hidden.shape(), options_.dtype, options_.device, stream);
    Parameter& head = lm_head();
    ops::token_logprobs_backward(hidden, head.value, targets, temperature, fwd.lse, fwd.entropy, grad_logprobs,
                                 grad_entropy, d_hidden, head.ensure_grad(stream), Tensor{}, {}, stream);
    return d_hidden;
  }
  // As above with d_hidden (and the GPU workspace) in ctx's buffers.
  Tensor token_logprobs_backward(Context& ctx, const Tensor& hidden, const Tensor& targets, float temperature,
                                 const ops::TokenLogprobs& fwd, const Tensor& grad_logprobs, const Tensor& grad_entropy,
                                 const Stream& stream = {}) {
    check_hidden(hidden, "token_logprobs_backward");
    Parameter& head = lm_head();
    return ops::token_logprobs_backward(hidden, head.value, targets, temperature, fwd, grad_logprobs, grad_entropy,
                                        head.ensure_grad(stream), ctx.logprobs, stream);
  }

  // L = -sum_t log p(targets[t] | tokens[..t]) / normalizer (default: the
  // batch's token count), plus router_aux_loss_coef · aux loss when
  // with_aux_loss (default: config.output_router_logits, as HF; only MoE
  // models have one): forward, fused LM head, backward. Gradients of every
  // parameter accumulate; returns L (a host synchronisation), the per-token
  // logprobs and entropies, and the unscaled aux loss.
  LossResult loss_and_backward(const PackedBatch& batch, const Tensor& targets, float temperature = 1.f,
                               std::optional<double> normalizer = std::nullopt, const Stream& stream = {},
                               std::optional<bool> with_aux_loss = std::nullopt) {
    return causal_lm_loss_and_backward(*this, batch, targets, Tensor{}, temperature, normalizer, stream,
                                       with_aux_loss.value_or(config_.output_router_logits));
  }
  // The same with per-token loss weights (f32 [T], e.g. a 0/1 mask of the
  // tokens that count; normalizer default: their sum): nn/causal_lm.hpp.
  LossResult loss_and_backward(const PackedBatch& batch, const Tensor& targets, const Tensor& loss_weights,
                               float temperature = 1.f, std::optional<double> normalizer = std::nullopt,
                               const Stream& stream = {}, std::optional<bool> with_aux_loss = std::nullopt) {
    return causal_lm_loss_and_backward(*this, batch, targets, loss_weights, temperature, normalizer, stream,
                                       with_aux_loss.value_or(config_.output_router_logits));
  }

 private:
  // Whether layer l's expert stack is a unit of its own (split over ranks).
  static bool has_expert_unit(const DecoderLayer& l) { return l.is_sparse() && l.moe->expert_degree() > 1; }

  void check_batch(const PackedBatch& b) const {
    SLIME_CHECK(b.tokens.defined() && b.cu_seqlens.defined() && b.positions.defined(),
                "Qwen3Model::forward: the batch is incomplete (use make_packed_batch)");
    SLIME_CHECK(b.tokens.device() == options_.device && b.cu_seqlens.device() == options_.device &&
                    b.positions.device() == options_.device,
                "Qwen3Model::forward: the batch must be on ", options_.device, " (the model's device), got tokens ",
                b.tokens.str(), ", cu_seqlens ", b.cu_seqlens.str(), ", positions ", b.positions.str());
    check_dtype(b.tokens, DType::i32, "Qwen3Model::forward: batch.tokens");
    SLIME_CHECK(b.num_tokens() > 0 && b.tokens.dim() == 1 && b.tokens.numel() == b.num_tokens(),
                "Qwen3Model::forward: batch.tokens must be [", b.num_tokens(), "] (cu_seqlens_host.back()), got ",
                b.tokens.str());
    // The host copy of cu_seqlens, checked before any launch: on a GPU a
    // broken one traps in the attention kernel and takes the context with it.
    const int64_t longest = ops::check_cu_seqlens(b.cu_seqlens_host, b.tokens.numel(), "Qwen3Model::forward: batch");
    SLIME_CHECK(b.max_seqlen >= longest, "Qwen3Model::forward: batch.max_seqlen = ", b.max_seqlen,
                " is shorter than the longest sequence in cu_seqlens_host (", longest, ")");
    if (config_.uses_mrope()) {
      check_shape(b.positions, Shape{b.num_tokens(), 3},
                  "Qwen3Model::forward: batch.positions (MRoPE: (t, h, w) per token, nn::mrope_positions)");
    } else {
      check_shape(b.positions, b.tokens.shape(), "Qwen3Model::forward: batch.positions");
    }
    check_shape(b.cu_seqlens, Shape{int64_t(b.cu_seqlens_host.size())}, "Qwen3Model::forward: batch.cu_seqlens");
  }

  void check_visual(const VisualEmbeds& v, const PackedBatch& b) const {
    if (!v.rows.defined()) return;
    const char* w = "Qwen3Model::forward: visual";
    SLIME_CHECK(config_.uses_mrope(), w, ": image features need a Qwen3-VL language model (MRoPE), this one is '",
                config_.model_type, "'");
    check_dtype(v.rows, DType::i32, std::string(w) + ".rows");
    SLIME_CHECK(v.rows.dim() == 1 && v.rows.numel() <= b.num_tokens() && v.rows.device() == options_.device, w,
                ".rows must be i32 [N <= ", b.num_tokens(), "] on ", options_.device, ", got ", v.rows.str());
    const int64_t n = v.rows.numel();
    detail::check_activation(v.embeds, options_, config_.hidden_size, std::string(w) + ".embeds");
    check_shape(v.embeds, Shape{n, config_.hidden_size}, std::string(w) + ".embeds (one row per image-pad token)");
    SLIME_CHECK(v.deepstack.size() <= layers_.size(), w, ": ", v.deepstack.size(),
                " deepstack features, more than the ", layers_.size(), " decoder layers");
    for (std::size_t j = 0; j < v.deepstack.size(); ++j) {
      const std::string what = std::string(w) + ".deepstack[" + std::to_string(j) + "]";
      detail::check_activation(v.deepstack[j], options_, config_.hidden_size, what);
      check_shape(v.deepstack[j], Shape{n, config_.hidden_size}, what);
    }
  }

  void check_context(const Context& ctx, const char* op) const {
    SLIME_CHECK(ctx.differentiable || ctx.layers.empty(), "Qwen3Model::", op,
                ": the context is from a forward with a K/V source that is not differentiable (CachedKv), which "
                "keeps no per-layer activations");
    SLIME_CHECK(ctx.layers.size() == layers_.size(), "Qwen3Model::", op, ": the context holds ", ctx.layers.size(),
                " layers, the model ", layers_.size(), " (was forward called with it?)");
  }

  void check_hidden(const Tensor& hidden, const char* op) const {
    detail::check_activation(hidden, options_, config_.hidden_size, std::string("Qwen3Model::") + op + ": hidden");
    SLIME_CHECK(hidden.dim() == 2, "Qwen3Model::", op, ": hidden must be [tokens, ", config_.hidden_size, "], got ",
                hidden.str());
  }

  Qwen3Config config_;
  ModuleOptions options_;
  std::string prefix_ = "model";
  Embedding embed_tokens_;
  std::vector<DecoderLayer> layers_;
  RMSNorm norm_;
  Parameter lm_head_;  // unused (undefined) when tied
};

}  // namespace slime::nn
