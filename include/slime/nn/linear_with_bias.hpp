// slime/nn/linear_with_bias.hpp: Linear with bias (HF layout: weight [out,
// in], bias [out]), y = x · weightᵀ + bias, as a module (the Qwen3-VL vision
// tower's projections), and the bias ops it is built from.
//
// Bias ops: ops::bias_add_ / ops::bias_backward (ops/row_ops.hpp, branch
// vl-rowops) had not landed when this was written, so detail::bias_add_ and
// detail::bias_backward express them with the existing GEMMs, on either
// device: y += ones [rows, 1] · bias [1, n] (linear_backward_input with
// accumulate) and dbias += dyᵀ · ones (linear_backward_weight). Both need a
// cached column of ones of the activations' dtype (one element per row), the
// module's only workspace. Swap them for the row ops once those are merged.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "slime/core/random.hpp"
#include "slime/nn/module.hpp"
#include "slime/ops/linear.hpp"

namespace slime::nn {

namespace detail {

// A [rows, 1] view of ones in `dtype` on `device` from `cache`, which is
// reallocated (to max(rows, 1.5 x its size)) and refilled only when too small
// or of another dtype or device.
inline Tensor ones_column(Tensor& cache, int64_t rows, DType dtype, Device device, const Stream& stream) {
  const bool same_kind = cache.defined() && cache.dtype() == dtype && cache.device() == device;
  if (!same_kind || cache.numel() < rows) {
    const int64_t grown = same_kind ? cache.numel() + cache.numel() / 2 : 0;
    cache = Tensor::empty(Shape{std::max({rows, grown, int64_t(1)})}, dtype, device, stream);
    fill_uniform(cache, 0, 0, 1.f, 1.f, stream);  // low = high = 1: exactly 1
  }
  return cache.view(0, Shape{rows, 1});
}

// y [..., n] += bias [n] (bias of y's dtype; one fp32 add per element, rounded once).
inline void bias_add_(const Tensor& y, const Tensor& bias, Tensor& ones_cache, const Stream& stream = {}) {
  const int64_t n = bias.numel();
  SLIME_CHECK(y.defined() && y.dim() >= 1 && y.size(-1) == n, "bias_add_: y must be [..., ", n, "] (bias ", bias.str(),
              "), got ", y.str());
  const int64_t rows = y.numel() / n;
  if (rows == 0) return;
  ops::linear_backward_input(ones_column(ones_cache, rows, bias.dtype(), y.device(), stream), bias.reshape({1, n}),
                             y.reshape({rows, n}), /*accumulate=*/true, stream);
}

// dbias [n] (f32) += sum over rows of dy [..., n].
inline void bias_backward(const Tensor& dy, const Tensor& dbias, Tensor& ones_cache, const Stream& stream = {}) {
  const int64_t n = dbias.numel();
  SLIME_CHECK(dy.defined() && dy.dim() >= 1 && dy.size(-1) == n, "bias_backward: dy must be [..., ", n, "] (dbias ",
              dbias.str(), "), got ", dy.str());
  const int64_t rows = dy.numel() / n;
  if (rows == 0) return;
  ops::linear_backward_weight(dy.reshape({rows, n}), ones_column(ones_cache, rows, dy.dtype(), dy.device(), stream),
                              dbias.reshape({n, 1}), stream);
}

// y [..., out] = x [..., in] · wᵀ + b.
inline void linear_bias_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y, Tensor& ones_cache,
                                const Stream& stream = {}) {
  ops::linear_forward(x, w, y, stream);
  bias_add_(y, b, ones_cache, stream);
}

// dw += dyᵀ · x, db += column sums of dy, dx = dy · w (or += with
// accumulate; skipped when dx is undefined).
inline void linear_bias_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& dx, const Tensor& dw,
                                 const Tensor& db, bool accumulate, Tensor& ones_cache, const Stream& stream = {}) {
  ops::linear_backward(dy, x, w, dx, dw, accumulate, stream);
  bias_backward(dy, db, ones_cache, stream);
}

}  // namespace detail

struct LinearWithBias {
  struct Context {
    Tensor x;  // [..., in]
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
    Tensor y = Tensor::empty(s, options.dtype, options.device, stream);
    detail::linear_bias_forward(x, weight.value, bias.value, y, ones_, stream);
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
                                 accumulate, ones_, stream);
  }

  // As backward_into, returning a new dx.
  Tensor backward(const Context& ctx, const Tensor& dy, const Stream& stream = {}) {
    Tensor dx = Tensor::empty(ctx.x.shape(), options.dtype, options.device, stream);
    backward_into(ctx, dy, dx, false, stream);
    return dx;
  }

  // The op workspaces this module keeps between calls (nn::release_workspaces).
  template <class F>
  void for_each_workspace(F&& f) {
    f(ones_);
  }

 private:
  Tensor ones_;  // the bias ops' column of ones (see the file comment)
};

}  // namespace slime::nn
