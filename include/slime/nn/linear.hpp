// slime/nn/linear.hpp: Linear without bias (HF layout: weight [out, in]),
// y = x · weightᵀ, as a module.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "slime/nn/module.hpp"
#include "slime/ops/linear.hpp"

namespace slime::nn {

struct Linear {
  struct Context {
    Tensor x;  // [..., in]
    // Capacity reused by the next call with this Context (detail::context_buffer).
    Tensor y_buffer;
    mutable Tensor dx_buffer;
  };

  ModuleOptions options;
  Parameter weight;  // [out, in]

  Linear() = default;
  // `prefix` is the HF module path, e.g. "model.layers.0.mlp.up_proj".
  Linear(const std::string& prefix, int64_t in_features, int64_t out_features, ModuleOptions opt) : options(opt) {
    detail::check_module_options(opt, prefix);
    SLIME_CHECK(in_features > 0 && out_features > 0, prefix, ": in_features and out_features must be positive, got ",
                in_features, " and ", out_features);
    weight.name = prefix + ".weight";
    weight.value = Tensor::empty({out_features, in_features}, opt.dtype, opt.device);
  }

  int64_t in_features() const { return weight.value.size(1); }
  int64_t out_features() const { return weight.value.size(0); }

  template <class F>
  void for_each_parameter(F&& f) {
    f(weight);
  }

  // y [..., out] = x [..., in] · weightᵀ.
  Tensor forward(const Tensor& x, Context& ctx, const Stream& stream = {}) {
    detail::check_activation(x, options, in_features(), weight.name + ": x");
    Shape s = x.shape();
    s[-1] = out_features();
    Tensor y = detail::context_buffer(ctx.y_buffer, s, options.dtype, options.device, stream);
    ops::linear_forward(x, weight.value, y, stream);
    ctx.x = x;
    return y;
  }

  // weight.grad += dyᵀ · x; dx = dy · weight written into `dx` (x's shape),
  // or added to it when `accumulate` (several projections of one input).
  void backward_into(const Context& ctx, const Tensor& dy, const Tensor& dx, bool accumulate,
                     const Stream& stream = {}) {
    detail::check_activation(dy, options, out_features(), weight.name + ": dy");
    ops::linear_backward(dy, ctx.x, weight.value, dx, weight.ensure_grad(stream), accumulate, stream);
  }

  // As backward_into, returning dx (in the Context's buffer).
  Tensor backward(const Context& ctx, const Tensor& dy, const Stream& stream = {}) {
    Tensor dx = detail::context_buffer(ctx.dx_buffer, ctx.x.shape(), options.dtype, options.device, stream);
    backward_into(ctx, dy, dx, false, stream);
    return dx;
  }
};

}  // namespace slime::nn
