// slime/nn/mlp.hpp: the Qwen3 SwiGLU MLP, y = down(silu(gate(x)) * up(x)).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "slime/nn/linear.hpp"
#include "slime/nn/module.hpp"
#include "slime/ops/swiglu.hpp"

namespace slime::nn {

struct MLP {
  struct Context {
    Linear::Context gate_proj, up_proj, down_proj;
    Tensor gate, up;  // [T, intermediate]
    // Capacity reused by the next call with this Context (detail::context_buffer).
    Tensor h_buffer;
    mutable Tensor dgate_buffer, dx_buffer;
  };

  ModuleOptions options;
  Linear gate_proj, up_proj, down_proj;

  MLP() = default;
  // `prefix` is the HF module path, e.g. "model.layers.0.mlp".
  MLP(const std::string& prefix, int64_t hidden_size, int64_t intermediate_size, ModuleOptions opt)
      : options(opt),
        gate_proj(prefix + ".gate_proj", hidden_size, intermediate_size, opt),
        up_proj(prefix + ".up_proj", hidden_size, intermediate_size, opt),
        down_proj(prefix + ".down_proj", intermediate_size, hidden_size, opt) {}

  int64_t hidden_size() const { return gate_proj.in_features(); }
  int64_t intermediate_size() const { return gate_proj.out_features(); }

  template <class F>
  void for_each_parameter(F&& f) {
    gate_proj.for_each_parameter(f);
    up_proj.for_each_parameter(f);
    down_proj.for_each_parameter(f);
  }

  // x [..., hidden] -> [..., hidden].
  Tensor forward(const Tensor& x, Context& ctx, const Stream& stream = {}) {
    Tensor gate = gate_proj.forward(x, ctx.gate_proj, stream);
    Tensor up = up_proj.forward(x, ctx.up_proj, stream);
    Tensor h = detail::context_buffer(ctx.h_buffer, gate.shape(), options.dtype, options.device, stream);
    ops::swiglu_forward(gate, up, h, stream);
    ctx.gate = gate;
    ctx.up = up;
    return down_proj.forward(h, ctx.down_proj, stream);
  }

  // dx (written); the three weights' gradients accumulate.
  Tensor backward(const Context& ctx, const Tensor& dy, const Stream& stream = {}) {
    Tensor dh = down_proj.backward(ctx.down_proj, dy, stream);
    Tensor dgate = detail::context_buffer(ctx.dgate_buffer, ctx.gate.shape(), options.dtype, options.device, stream);
    ops::swiglu_backward(ctx.gate, ctx.up, dh, dgate, dh, stream);  // dup overwrites dh (in place)
    Tensor dx = detail::context_buffer(ctx.dx_buffer, ctx.gate_proj.x.shape(), options.dtype, options.device, stream);
    gate_proj.backward_into(ctx.gate_proj, dgate, dx, false, stream);
    up_proj.backward_into(ctx.up_proj, dh, dx, true, stream);
    return dx;
  }
};

}  // namespace slime::nn
