// slime/nn/linear_with_bias.hpp: Linear with bias (HF layout: weight [out,
// in], bias [out]), y = x · weightᵀ + bias, as a module (the Qwen3-VL vision
// tower's projections), and the bias ops it is built from.
//
// The bias is ops::bias_add_ after the GEMM; its gradient ops::bias_backward,
// whose GPU workspace (the fixed-order column sums' partials) the module
// keeps between calls.
#pragma once

#include <cstdint>
#include <string>

#include "slime/nn/module.hpp"
#include "slime/ops/linear.hpp"
#include "slime/ops/row_ops.hpp"

namespace slime::nn {

namespace detail {

// y [..., out] = x [..., in] · wᵀ + b.
inline void linear_bias_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y,
                                const Stream& stream = {}) {
  ops::linear_forward(x, w, y, stream);
  ops::bias_add_(y, b, stream);
}

// dw += dyᵀ · x, db += column sums of dy, dx = dy · w (or += with
// accumulate; skipped when dx is undefined). `workspace` caches
// ops::bias_backward's GPU workspace (grown when too small).
inline void linear_bias_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& dx, const Tensor& dw,
                                 const Tensor& db, bool accumulate, Tensor& workspace, const Stream& stream = {}) {
  ops::linear_backward(dy, x, w, dx, dw, accumulate, stream);
  const int64_t n = db.numel(), rows = n == 0 ? 0 : dy.numel() / n;
  const Tensor& ws = scratch_bytes(workspace, dy.device().is_cuda() ? ops::bias_backward_workspace_bytes(rows, n) : 0,
                                   dy.device(), stream);
  ops::bias_backward(dy, db, /*accumulate=*/true, ws, stream);
}

}  // namespace detail

struct LinearWithBias {
  struct Context {
    Tensor x;  // [..., in]
    // Capacity reused by the next call with this Context (detail::context_buffer).
    Tensor y_buffer;
    mutable Tensor dx_buffer;
  };

  ModuleOptions options;
  Parameter weight;  // [out, in]
  Parameter bias;    // [out]

  LinearWithBias() = default;
  // `prefix` is the HF module path, e.g. "model.visual.blocks.0.attn.proj".
  LinearWithBias(const std::string& prefix, int64_t in_features, int64_t out_features, ModuleOptions opt)
      : options(opt) {
    detail::check_module_options(opt, prefix);
    SLIME_CHECK(in_features > 0 && out_features > 0, prefix, ": in_features and out_features must be positive, got ",
                in_features, " and ", out_features);
    weight.name = prefix + ".weight";
    weight.value = Tensor::empty({out_features, in_features}, opt.dtype, opt.device);
    bias.name = prefix + ".bias";
    bias.value = Tensor::empty({out_features}, opt.dtype, opt.device);
  }

  int64_t in_features() const { return weight.value.size(1); }
  int64_t out_features() const { return weight.value.size(0); }

  // HF order: weight, bias.
  template <class F>
  void for_each_parameter(F&& f) {
    f(weight);
    f(bias);
  }

  // y [..., out] = x [..., in] · weightᵀ + bias.
  Tensor forward(const Tensor& x, Context& ctx, const Stream& stream = {}) {
    detail::check_activation(x, options, in_features(), weight.name + ": x");
    Shape s = x.shape();
    s[-1] = out_features();
    Tensor y = detail::context_buffer(ctx.y_buffer, s, options.dtype, options.device, stream);
    detail::linear_bias_forward(x, weight.value, bias.value, y, stream);
    ctx.x = x;
    return y;
  }

  // weight.grad += dyᵀ · x, bias.grad += column sums of dy; dx = dy · weight
  // written into `dx` (x's shape), or added to it when `accumulate`; no dx
  // when it is undefined (an input without a gradient, e.g. pixels).
  void backward_into(const Context& ctx, const Tensor& dy, const Tensor& dx, bool accumulate,
                     const Stream& stream = {}) {
    detail::check_activation(dy, options, out_features(), weight.name + ": dy");
    detail::linear_bias_backward(dy, ctx.x, weight.value, dx, weight.ensure_grad(stream), bias.ensure_grad(stream),
                                 accumulate, workspace_, stream);
  }

  // As backward_into, returning dx (in the Context's buffer).
  Tensor backward(const Context& ctx, const Tensor& dy, const Stream& stream = {}) {
    Tensor dx = detail::context_buffer(ctx.dx_buffer, ctx.x.shape(), options.dtype, options.device, stream);
    backward_into(ctx, dy, dx, false, stream);
    return dx;
  }

  // The op workspaces this module keeps between calls (nn::release_workspaces).
  template <class F>
  void for_each_workspace(F&& f) {
    f(workspace_);
  }

 private:
  Tensor workspace_;  // ops::bias_backward's GPU workspace
};

}  // namespace slime::nn
