// slime/nn/layer_norm.hpp: LayerNorm over the last dim with weight and bias
// as a module (torch.nn.LayerNorm; the Qwen3-VL vision tower's norm1, norm2
// and patch-merger norms).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "slime/nn/module.hpp"
#include "slime/ops/layer_norm.hpp"

namespace slime::nn {

struct LayerNorm {
  struct Context {
    Tensor x;           // [..., dim]
    Tensor mean, rstd;  // f32, one per row
    // Capacity reused by the next call with this Context (detail::context_buffer).
    Tensor y_buffer, mean_buffer, rstd_buffer;
    mutable Tensor dx_buffer;
  };

  ModuleOptions options;
  Parameter weight;  // [dim], init ones
  Parameter bias;    // [dim], init N(0, std) (random init only; HF starts it at 0)
  float eps = 1e-6f;

  LayerNorm() = default;
  // `prefix` is the HF module path, e.g. "model.visual.blocks.0.norm1".
  LayerNorm(const std::string& prefix, int64_t dim, double epsilon, ModuleOptions opt)
      : options(opt), eps(float(epsilon)) {
    detail::check_module_options(opt, prefix);
    SLIME_CHECK(dim > 0, prefix, ": dim must be positive, got ", dim);
    SLIME_CHECK(epsilon >= 0, prefix, ": eps must be >= 0, got ", epsilon);
    weight.name = prefix + ".weight";
    weight.value = Tensor::empty({dim}, opt.dtype, opt.device);
    weight.init = ParamInit::ones;
    bias.name = prefix + ".bias";
    bias.value = Tensor::empty({dim}, opt.dtype, opt.device);
  }

  int64_t dim() const { return weight.value.size(0); }

  // HF order: weight, bias.
  template <class F>
  void for_each_parameter(F&& f) {
    f(weight);
    f(bias);
  }

  // y = (x - mean) * rstd * weight + bias over the last dim of x [..., dim].
  Tensor forward(const Tensor& x, Context& ctx, const Stream& stream = {}) {
    detail::check_activation(x, options, dim(), weight.name + ": x");
    Tensor y = detail::context_buffer(ctx.y_buffer, x.shape(), options.dtype, options.device, stream);
    const int64_t rows = x.numel() / dim();
    ctx.mean = detail::context_buffer(ctx.mean_buffer, {rows}, DType::f32, options.device, stream);
    ctx.rstd = detail::context_buffer(ctx.rstd_buffer, {rows}, DType::f32, options.device, stream);
    ops::layer_norm_forward(x, weight.value, bias.value, eps, y, ctx.mean, ctx.rstd, stream);
    ctx.x = x;
    return y;
  }

  // dx written; weight.grad and bias.grad accumulate. `dy` may be overwritten
  // when `dy_is_scratch` (dx then reuses its memory).
  Tensor backward(const Context& ctx, const Tensor& dy, const Stream& stream = {}, bool dy_is_scratch = false) {
    detail::check_activation(dy, options, dim(), weight.name + ": dy");
    Tensor dx = dy_is_scratch
                    ? dy
                    : detail::context_buffer(ctx.dx_buffer, ctx.x.shape(), options.dtype, options.device, stream);
    const int64_t rows = ctx.x.numel() / dim();
    const Tensor& ws = detail::scratch_bytes(
        workspace_, options.device.is_cuda() ? ops::layer_norm_backward_workspace_bytes(rows, dim()) : 0,
        options.device, stream);
    ops::layer_norm_backward(ctx.x, weight.value, ctx.mean, ctx.rstd, dy, dx, weight.ensure_grad(stream),
                             bias.ensure_grad(stream), ws, stream);
    return dx;
  }

  // The op workspaces this module keeps between calls (nn::release_workspaces).
  template <class F>
  void for_each_workspace(F&& f) {
    f(workspace_);
  }

 private:
  Tensor workspace_;
};

}  // namespace slime::nn
