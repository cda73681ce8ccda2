// slime/nn/qwen3.hpp: Qwen3Model, the Qwen3 dense decoder (HF
// Qwen3ForCausalLM): embedding, decoder layers, final RMSNorm and the LM head
// (tied to the embedding when config.tie_word_embeddings), over packed
// sequences, with explicit forward and backward.
//
// A step: forward(batch, ctx) -> final-normed hidden [T, D]; then either
// logits(hidden) (f32 [T, V], small models and tests only) or
// token_logprobs(hidden, targets) (the fused lm-head + log-softmax, never
// materialising the logits); token_logprobs_backward turns gradients of the
// log-probabilities (and entropies) into d_hidden, accumulating the lm_head
// gradient; backward(ctx, d_hidden) accumulates every other gradient.
// loss_and_backward does all of it for L = -sum_t logprob_t / normalizer.
//
// Dtypes: f32 weights and activations (the CPU reference) or bf16 (the GPU
// model; CUDA attention is bf16 only, head_dim 64 or 128); gradients fp32.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "slime/nn/config.hpp"
#include "slime/nn/decoder_layer.hpp"
#include "slime/nn/embedding.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/rms_norm.hpp"
#include "slime/ops/linear.hpp"
#include "slime/ops/token_logprobs.hpp"

namespace slime::nn {

// What loss_and_backward returns: the loss and the per-token values.
struct LossResult {
  double loss = 0;  // -sum_t logprobs[t] / normalizer
  Tensor logprobs;  // f32 [T]
  Tensor entropy;   // f32 [T]
};

class Qwen3Model {
 public:
  struct Context {
    PackedBatch batch;
    Embedding::Context embed_tokens;
    std::vector<DecoderLayer::Context> layers;
    RMSNorm::Context norm;
  };

  Qwen3Model() = default;

  // Parameters allocated on opt.device in opt.dtype, uninitialised (use
  // init_random or load_hf). Throws for an invalid or MoE config.
  Qwen3Model(const Qwen3Config& config, ModuleOptions opt) : config_(config), options_(opt) {
    config_.validate();
    const std::string where = config.source.empty() ? std::string("Qwen3Model") : "Qwen3Model('" + config.source + "')";
    SLIME_CHECK(!config_.is_moe(), where, ": the config is a Qwen3-MoE model (model_type '", config_.model_type,
                "', num_experts = ", config_.num_experts,
                "); MoE layers come with the MoE issue: only dense Qwen3 is implemented");
    detail::check_module_options(opt, where);
    if (opt.device.is_cuda()) {
      // ops/attention.hpp: the CUDA kernels are bf16 with head_dim 64 or 128.
      SLIME_CHECK(opt.dtype == DType::bf16, where, ": a model on ", opt.device,
                  " must be bf16 (the CUDA attention kernels are bf16 only), got ", dtype_name(opt.dtype));
      SLIME_CHECK(config_.head_dim == 64 || config_.head_dim == 128, where, ": head_dim = ", config_.head_dim,
                  " is not supported on CUDA (the attention kernels support 64 and 128)");
    }
    AttentionConfig attn;
    attn.hidden_size = config_.hidden_size;
    attn.num_heads = config_.num_attention_heads;
    attn.num_kv_heads = config_.num_key_value_heads;
    attn.head_dim = config_.head_dim;
    attn.rope_theta = config_.rope_theta;
    attn.rms_norm_eps = config_.rms_norm_eps;
    embed_tokens_ = Embedding("model.embed_tokens", config_.vocab_size, config_.hidden_size, opt);
    layers_.reserve(std::size_t(config_.num_hidden_layers));
    for (int i = 0; i < config_.num_hidden_layers; ++i)
      layers_.emplace_back("model.layers." + std::to_string(i), attn, config_.intermediate_size, opt);
    norm_ = RMSNorm("model.norm", config_.hidden_size, config_.rms_norm_eps, opt);
    if (!config_.tie_word_embeddings) {
      lm_head_.name = "lm_head.weight";
      lm_head_.value = Tensor::empty({config_.vocab_size, config_.hidden_size}, opt.dtype, opt.device);
    }
  }

  const Qwen3Config& config() const { return config_; }
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

  // Projections and embeddings ~ N(0, std), norm weights 1 (counter-based:
  // the same values on every device for the same seed).
  void init_random(uint64_t seed, float std = 0.02f, const Stream& stream = {}) {
    init_parameters(*this, seed, std, stream);
  }

  // Final-normed hidden states [T, D] of the packed batch (on the model's
  // device). ctx keeps what backward needs.
  Tensor forward(const PackedBatch& batch, Context& ctx, const Stream& stream = {}) {
    check_batch(batch);
    ctx.batch = batch;
    ctx.layers.resize(layers_.size());
    Tensor h = embed_tokens_.forward(batch.tokens, ctx.embed_tokens, stream);
    for (std::size_t i = 0; i < layers_.size(); ++i) h = layers_[i].forward(h, batch, ctx.layers[i], stream);
    return norm_.forward(h, ctx.norm, stream);
  }

  // Accumulates the gradients of every parameter but the LM head from
  // d_hidden [T, D] (the gradient of forward's output).
  void backward(const Context& ctx, const Tensor& d_hidden, const Stream& stream = {}) {
    SLIME_CHECK(ctx.layers.size() == layers_.size(), "Qwen3Model::backward: the context holds ", ctx.layers.size(),
                " layers, the model ", layers_.size(), " (was forward called with it?)");
    Tensor d = norm_.backward(ctx.norm, d_hidden, stream);
    for (std::size_t i = layers_.size(); i-- > 0;) d = layers_[i].backward(ctx.layers[i], d, stream);
    embed_tokens_.backward(ctx.embed_tokens, d, stream);
  }

  // logits [T, V] f32 = hidden · lm_headᵀ. Materialises [T, V]: for small
  // models and tests; training and scoring use token_logprobs.
  Tensor logits(const Tensor& hidden, const Stream& stream = {}) {
    check_hidden(hidden, "logits");
    Tensor y = Tensor::empty({hidden.size(0), config_.vocab_size}, DType::f32, options_.device, stream);
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

  // L = -sum_t log p(targets[t] | tokens[..t]) / normalizer (default: the
  // batch's token count): forward, fused LM head, backward. Gradients of every
  // parameter accumulate; returns L (a host synchronisation) and the
  // per-token logprobs and entropies.
  LossResult loss_and_backward(const PackedBatch& batch, const Tensor& targets, float temperature = 1.f,
                               std::optional<double> normalizer = std::nullopt, const Stream& stream = {}) {
    const int64_t T = batch.num_tokens();
    const double n = normalizer.value_or(double(T));
    SLIME_CHECK(n > 0, "loss_and_backward: normalizer must be positive, got ", n);
    Context ctx;
    Tensor hidden = forward(batch, ctx, stream);
    ops::TokenLogprobs lp = token_logprobs(hidden, targets, temperature, stream);
    Tensor grad_lp =
        Tensor::from_vector(std::vector<float>(std::size_t(T), float(-1.0 / n)), {T}, options_.device, stream);
    Tensor d_hidden = token_logprobs_backward(hidden, targets, temperature, lp, grad_lp, Tensor{}, stream);
    backward(ctx, d_hidden, stream);
    double sum = 0;
    for (float v : lp.logprobs.to_vector<float>(stream)) sum += double(v);
    return {-sum / n, lp.logprobs, lp.entropy};
  }

 private:
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
    check_shape(b.positions, b.tokens.shape(), "Qwen3Model::forward: batch.positions");
    check_shape(b.cu_seqlens, Shape{int64_t(b.cu_seqlens_host.size())}, "Qwen3Model::forward: batch.cu_seqlens");
  }

  void check_hidden(const Tensor& hidden, const char* op) const {
    detail::check_activation(hidden, options_, config_.hidden_size, std::string("Qwen3Model::") + op + ": hidden");
    SLIME_CHECK(hidden.dim() == 2, "Qwen3Model::", op, ": hidden must be [tokens, ", config_.hidden_size, "], got ",
                hidden.str());
  }

  Qwen3Config config_;
  ModuleOptions options_;
  Embedding embed_tokens_;
  std::vector<DecoderLayer> layers_;
  RMSNorm norm_;
  Parameter lm_head_;  // unused (undefined) when tied
};

}  // namespace slime::nn
