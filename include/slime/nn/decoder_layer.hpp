// slime/nn/decoder_layer.hpp: one pre-norm Qwen3 / Qwen3-MoE decoder layer:
//   h = x + self_attn(input_layernorm(x))
//   y = h + mlp(post_attention_layernorm(h))
// where mlp is the dense SwiGLU MLP, or the sparse MoE block (router +
// experts) in the layers Qwen3Config::is_sparse_layer picks. x and y are
// [T, hidden]; self_attn's keys and values come from the layer K/V source
// forward is given (nn/kv_source.hpp: SelfKv by default, CachedKv::Layer for
// decode), the rest of the layer is the same for every source.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include "slime/nn/attention.hpp"
#include "slime/nn/kv_source.hpp"
#include "slime/nn/mlp.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/moe.hpp"
#include "slime/nn/rms_norm.hpp"
#include "slime/ops/elementwise.hpp"

namespace slime::nn {

struct DecoderLayer {
  struct Context {
    RMSNorm::Context input_layernorm, post_attention_layernorm;
    Attention::Context self_attn;
    MLP::Context mlp;             // dense layers
    SparseMoeBlock::Context moe;  // sparse layers (router_logits, probs, indices, ...)
  };

  ModuleOptions options;
  RMSNorm input_layernorm;
  Attention self_attn;
  RMSNorm post_attention_layernorm;
  MLP mlp;                            // dense layers only (no parameters in sparse ones)
  std::optional<SparseMoeBlock> moe;  // sparse layers only: HF's "<prefix>.mlp" with gate and experts

  DecoderLayer() = default;
  // A dense layer. `prefix` is the HF module path, e.g. "model.layers.3".
  DecoderLayer(const std::string& prefix, const AttentionConfig& attn, int64_t intermediate_size, ModuleOptions opt)
      : options(opt),
        input_layernorm(prefix + ".input_layernorm", attn.hidden_size, attn.rms_norm_eps, opt),
        self_attn(prefix + ".self_attn", attn, opt),
        post_attention_layernorm(prefix + ".post_attention_layernorm", attn.hidden_size, attn.rms_norm_eps, opt),
        mlp(prefix + ".mlp", attn.hidden_size, intermediate_size, opt) {}
  // A sparse (MoE) layer; `dispatcher` (optional) moves its tokens to the
  // experts and may place a slice of them on this rank (see SparseMoeBlock).
  DecoderLayer(const std::string& prefix, const AttentionConfig& attn, const MoeBlockConfig& moe_config,
               ModuleOptions opt, DispatcherRef dispatcher = {})
      : options(opt),
        input_layernorm(prefix + ".input_layernorm", attn.hidden_size, attn.rms_norm_eps, opt),
        self_attn(prefix + ".self_attn", attn, opt),
        post_attention_layernorm(prefix + ".post_attention_layernorm", attn.hidden_size, attn.rms_norm_eps, opt),
        moe(std::in_place, prefix + ".mlp", moe_config, opt, dispatcher) {}

  bool is_sparse() const { return moe.has_value(); }

  // The op workspaces this layer keeps between calls (nn::release_workspaces).
  template <class F>
  void for_each_workspace(F&& f) {
    input_layernorm.for_each_workspace(f);
    self_attn.for_each_workspace(f);
    post_attention_layernorm.for_each_workspace(f);
  }

  // HF order (Qwen3DecoderLayer / Qwen3MoeDecoderLayer's state_dict).
  template <class F>
  void for_each_parameter(F&& f) {
    self_attn.for_each_parameter(f);
    if (moe) {
      moe->for_each_parameter(f);
    } else {
      mlp.for_each_parameter(f);
    }
    input_layernorm.for_each_parameter(f);
    post_attention_layernorm.for_each_parameter(f);
  }

  // x [T, hidden] -> [T, hidden]; attention over the keys and values of `kv`.
  // backward needs the context of a differentiable source (SelfKv).
  template <LayerKvSource Kv = SelfKv>
  Tensor forward(const Tensor& x, const PackedBatch& batch, Context& ctx, const Stream& stream = {},
                 const Kv& kv = {}) {
    Tensor a =
        self_attn.forward(input_layernorm.forward(x, ctx.input_layernorm, stream), batch, ctx.self_attn, stream, kv);
    ops::add_(a, x, stream);  // a = x + attn: the residual stream after attention
    Tensor n = post_attention_layernorm.forward(a, ctx.post_attention_layernorm, stream);
    Tensor y = moe ? moe->forward(n, ctx.moe, stream) : mlp.forward(n, ctx.mlp, stream);
    ops::add_(y, a, stream);
    return y;
  }

  // dx (written) from dy; every parameter gradient of the layer accumulates.
  // aux_dlogits (sparse layers, optional): f32 [T, num_experts], a gradient
  // of the router logits from outside the layer (the load-balancing loss),
  // added to the router's own.
  Tensor backward(const Context& ctx, const Tensor& dy, const Stream& stream = {}, const Tensor& aux_dlogits = {}) {
    SLIME_CHECK(moe || !aux_dlogits.defined(),
                "DecoderLayer::backward: aux_dlogits given for a dense layer (it has no router)");
    // dh = dy + post_norm'(mlp'(dy))
    Tensor dmlp = moe ? moe->backward(ctx.moe, dy, stream, aux_dlogits) : mlp.backward(ctx.mlp, dy, stream);
    Tensor dh = post_attention_layernorm.backward(ctx.post_attention_layernorm, dmlp, stream, /*dy_is_scratch=*/true);
    ops::add_(dh, dy, stream);
    // dx = dh + input_norm'(attn'(dh))
    Tensor dx = input_layernorm.backward(ctx.input_layernorm, self_attn.backward(ctx.self_attn, dh, stream), stream,
                                         /*dy_is_scratch=*/true);
    ops::add_(dx, dh, stream);
    return dx;
  }
};

}  // namespace slime::nn
