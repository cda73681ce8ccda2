// slime/nn/causal_lm.hpp: what a causal language model's next-token loss
// shares, whoever runs it (nn::Qwen3Model, or a wrapper such as
// parallel::Sharded around it): LossResult, AuxLoss and
// causal_lm_loss_and_backward, one forward + fused LM head + backward.
//
// L = -Σ_t w_t · log p(targets[t] | tokens[..t]) / normalizer
//     (+ aux.scale · aux loss when with_aux_loss; MoE models only)
// with w_t = 1 without loss weights (normalizer default: the token count) or
// the given per-token weights (f32 [T], e.g. a 0/1 loss mask of a packed SFT
// batch; normalizer default: Σ_t w_t). Gradients of every parameter
// accumulate (`+=`); returns L (one host synchronisation).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/ops/token_logprobs.hpp"

namespace slime::nn {

// What loss_and_backward returns: the loss and the per-token values.
struct LossResult {
  double loss = 0;      // -sum_t w_t logprobs[t] / normalizer (+ router_aux_loss_coef * aux_loss when included)
  Tensor logprobs;      // f32 [T]
  Tensor entropy;       // f32 [T]
  double aux_loss = 0;  // the load-balancing loss, unscaled; 0 when not included (dense models)
};

// The MoE load-balancing loss of one forward and its gradient.
struct AuxLoss {
  double value = 0;  // aux loss over all sparse layers' router outputs, unscaled (HF's aux_loss)
  double scale = 0;  // the factor its gradients carry (router_aux_loss_coef by default)
  // Per decoder layer: f32 [T, num_experts] = scale · ∂aux/∂router_logits for
  // sparse layers, undefined for dense ones. Empty when nothing was computed.
  std::vector<Tensor> dlogits;
};

// Sums the MoE aux loss statistics (ops::router_aux_stats, f32 [2E + 1], in
// place) over the ranks whose tokens make up the batch, so that the loss and
// the gradients are those of the whole batch; empty: this rank's tokens are
// the batch. parallel::Sharded passes an all_reduce over its data-parallel
// ranks.
using AuxStatsReduce = std::function<void(const Tensor& stats, const Stream& stream)>;

// The calls of a causal LM the loss needs (Qwen3Model, Sharded<Qwen3Model>),
// over batches of type Batch (PackedBatch; a VLM's nn::VLBatch).
template <class LM, class Batch = PackedBatch>
concept CausalLM = requires(LM& lm, const typename LM::Context& cctx, typename LM::Context& ctx, const Batch& b,
                            const Tensor& t, const ops::TokenLogprobs& lp, const AuxLoss& aux, const Stream& s) {
  { lm.forward(b, ctx, s) } -> std::convertible_to<Tensor>;
  { lm.token_logprobs(t, t, 1.f, s) } -> std::convertible_to<ops::TokenLogprobs>;
  { lm.token_logprobs_backward(t, t, 1.f, lp, t, t, s) } -> std::convertible_to<Tensor>;
  { lm.aux_loss_and_grad(cctx, std::optional<double>{}, s) } -> std::convertible_to<AuxLoss>;
  lm.backward(cctx, t, s, aux);
  { lm.device() } -> std::convertible_to<Device>;
};

// See the top of this file. loss_weights: undefined, or f32 [T] on any device.
// reuse: a Context the caller keeps across micro-batches (its buffers hold
// the activations and, where the model has token_logprobs(ctx, ...), the LM
// head's outputs: the returned logprobs and entropy are then views, valid
// until the next call with it); null: a fresh one.
template <class LM, class Batch>
requires CausalLM<LM, Batch> LossResult causal_lm_loss_and_backward(LM& lm, const Batch& batch, const Tensor& targets,
                                                                    const Tensor& loss_weights, float temperature,
                                                                    std::optional<double> normalizer,
                                                                    const Stream& stream, bool with_aux_loss,
                                                                    typename LM::Context* reuse = nullptr) {
  const int64_t T = batch.num_tokens();
  std::vector<float> w;
  if (loss_weights.defined()) {
    SLIME_CHECK(loss_weights.dtype() == DType::f32 && loss_weights.shape() == Shape{T},
                "loss_and_backward: loss_weights must be f32 [", T, "] (one per token of the batch), got ",
                loss_weights.str());
    w = loss_weights.to_vector<float>(stream);
  }
  double n = double(T);
  if (!w.empty()) {
    n = 0;
    for (float v : w) n += double(v);
  }
  n = normalizer.value_or(n);
  SLIME_CHECK(n > 0, "loss_and_backward: normalizer must be positive, got ", n);
  typename LM::Context fresh;
  typename LM::Context& ctx = reuse ? *reuse : fresh;
  constexpr bool buffered_head = requires(const Tensor& t) { lm.token_logprobs(ctx, t, t, temperature, stream); };
  Tensor hidden = lm.forward(batch, ctx, stream);
  ops::TokenLogprobs lp;
  if constexpr (buffered_head) {
    lp = lm.token_logprobs(ctx, hidden, targets, temperature, stream);
  } else {
    lp = lm.token_logprobs(hidden, targets, temperature, stream);
  }
  std::vector<float> grad(std::size_t(T), float(-1.0 / n));
  for (std::size_t t = 0; t < w.size(); ++t) grad[t] = float(-double(w[t]) / n);
  Tensor grad_lp = Tensor::from_vector(grad, {T}, lm.device(), stream);
  Tensor d_hidden;
  if constexpr (buffered_head) {
    d_hidden = lm.token_logprobs_backward(ctx, hidden, targets, temperature, lp, grad_lp, Tensor{}, stream);
  } else {
    d_hidden = lm.token_logprobs_backward(hidden, targets, temperature, lp, grad_lp, Tensor{}, stream);
  }
  AuxLoss aux;
  if (with_aux_loss) aux = lm.aux_loss_and_grad(ctx, std::nullopt, stream);
  lm.backward(ctx, d_hidden, stream, aux);
  double sum = 0;
  const std::vector<float> v = lp.logprobs.to_vector<float>(stream);
  if (w.empty()) {
    for (float x : v) sum += double(x);
  } else {
    for (std::size_t t = 0; t < v.size(); ++t) sum += double(w[t]) * double(v[t]);
  }
  return {-sum / n + aux.scale * aux.value, lp.logprobs, lp.entropy, aux.value};
}

}  // namespace slime::nn
