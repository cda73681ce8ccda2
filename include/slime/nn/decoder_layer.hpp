// slime/nn/decoder_layer.hpp: one pre-norm Qwen3 dense decoder layer:
//   h = x + self_attn(input_layernorm(x))
//   y = h + mlp(post_attention_layernorm(h))
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "slime/nn/attention.hpp"
#include "slime/nn/mlp.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/rms_norm.hpp"
#include "slime/ops/elementwise.hpp"

namespace slime::nn {

struct DecoderLayer {
  struct Context {
    RMSNorm::Context input_layernorm, post_attention_layernorm;
    Attention::Context self_attn;
    MLP::Context mlp;
  };

  ModuleOptions options;
  RMSNorm input_layernorm;
  Attention self_attn;
  RMSNorm post_attention_layernorm;
  MLP mlp;

  DecoderLayer() = default;
  // `prefix` is the HF module path, e.g. "model.layers.3".
  DecoderLayer(const std::string& prefix, const AttentionConfig& attn, int64_t intermediate_size, ModuleOptions opt)
      : options(opt),
        input_layernorm(prefix + ".input_layernorm", attn.hidden_size, attn.rms_norm_eps, opt),
        self_attn(prefix + ".self_attn", attn, opt),
        post_attention_layernorm(prefix + ".post_attention_layernorm", attn.hidden_size, attn.rms_norm_eps, opt),
        mlp(prefix + ".mlp", attn.hidden_size, intermediate_size, opt) {}

  // HF order (Qwen3DecoderLayer's state_dict).
  template <class F>
  void for_each_parameter(F&& f) {
    self_attn.for_each_parameter(f);
    mlp.for_each_parameter(f);
    input_layernorm.for_each_parameter(f);
    post_attention_layernorm.for_each_parameter(f);
  }

  // x [T, hidden] -> [T, hidden].
  Tensor forward(const Tensor& x, const PackedBatch& batch, Context& ctx, const Stream& stream = {}) {
    Tensor a = self_attn.forward(input_layernorm.forward(x, ctx.input_layernorm, stream), batch, ctx.self_attn, stream);
    ops::add_(a, x, stream);  // a = x + attn: the residual stream after attention
    Tensor y = mlp.forward(post_attention_layernorm.forward(a, ctx.post_attention_layernorm, stream), ctx.mlp, stream);
    ops::add_(y, a, stream);
    return y;
  }

  // dx (written) from dy; every parameter gradient of the layer accumulates.
  Tensor backward(const Context& ctx, const Tensor& dy, const Stream& stream = {}) {
    // dh = dy + post_norm'(mlp'(dy))
    Tensor dh = post_attention_layernorm.backward(ctx.post_attention_layernorm, mlp.backward(ctx.mlp, dy, stream),
                                                  stream, /*dy_is_scratch=*/true);
    ops::add_(dh, dy, stream);
    // dx = dh + input_norm'(attn'(dh))
    Tensor dx = input_layernorm.backward(ctx.input_layernorm, self_attn.backward(ctx.self_attn, dh, stream), stream,
                                         /*dy_is_scratch=*/true);
    ops::add_(dx, dh, stream);
    return dx;
  }
};

}  // namespace slime::nn
