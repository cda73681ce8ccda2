// slime/ops/layer_norm.hpp: LayerNorm over the last dim with weight and bias,
// y = (x - mean) * rstd * w + b, forward (saving mean and rstd) and backward,
// on the CPU or the GPU. The norms of the Qwen3-VL vision tower (norm1, norm2
// of each block, the patch mergers' norm) are this op.
//
// Accumulation contract: parameter gradients accumulate (+=) into fp32
// tensors (dweight, dbias); activation gradients are written (=).
//
// Shapes: x [..., dim] of any rank >= 1 is normalised over its last extent,
// rows = numel / dim; weight and bias [dim]; y and dy like x; mean and rstd
// f32 with `rows` elements each. The variance is the biased one (divided by
// dim), as torch.nn.LayerNorm's: rstd = 1 / sqrt(mean((x - mean)^2) + eps).
// Dtypes: x, y, dy, dx f32 or bf16 (one dtype); weight and bias f32 or bf16
// (one dtype); mean, rstd, dweight and dbias f32. Math is fp32 (the CPU
// reference runs in double for double) with one rounding of y; the variance
// is the mean of squared deviations from the mean (two passes over the row,
// not E[x^2] - mean^2, which cancels for rows far from zero).
// y may be x, and dx may be x or dy (in place), as the same tensor only.
//
// Determinism (GPU backward): dweight and dbias are the same bits run to run
// on one kind of GPU for the same shapes, dtypes and pointer alignment: they
// are reduced in two fixed-order passes (per-block partial sums, then the
// partials) through a workspace of layer_norm_backward_workspace_bytes(rows,
// dim) bytes; the call allocates nothing. dx does not depend on any order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/layer_norm.hpp"
#include "slime/ops/cuda/layer_norm.hpp"
#include "slime/ops/elementwise.hpp"

namespace slime::ops {

namespace detail::memops {

// rows and dim of x [..., dim]; checks weight [dim] (and bias [dim] of the
// weight's dtype when given).
inline void layer_norm_extents(const Tensor& x, const Tensor& weight, const Tensor* bias, std::string_view op,
                               int64_t& rows, int64_t& dim) {
  check_f32_or_bf16(x, ::slime::detail::concat(op, ": x"));
  check_f32_or_bf16(weight, ::slime::detail::concat(op, ": weight"));
  SLIME_CHECK(x.dim() >= 1, op, ": x must have at least 1 dim, got ", x.str());
  dim = x.size(-1);
  SLIME_CHECK(dim > 0, op, ": x has an empty last dim: ", x.str());
  rows = x.numel() / dim;
  check_shape(weight, Shape{dim}, ::slime::detail::concat(op, ": weight"));
  if (bias != nullptr) {
    check_defined(*bias, ::slime::detail::concat(op, ": bias"));
    check_dtype(*bias, weight.dtype(), ::slime::detail::concat(op, ": bias (the weight's dtype)"));
    check_shape(*bias, Shape{dim}, ::slime::detail::concat(op, ": bias"));
  }
}

// mean or rstd: f32, one element per row.
inline void check_layer_norm_stat(const Tensor& t, int64_t rows, std::string_view op, std::string_view name) {
  check_defined(t, ::slime::detail::concat(op, ": ", name));
  check_dtype(t, DType::f32, ::slime::detail::concat(op, ": ", name));
  SLIME_CHECK(t.numel() == rows, op, ": ", name, " must have ", rows, " elements (one per row), got ", t.str());
}

}  // namespace detail::memops

// y = (x - mean) * rstd * weight + bias with mean and rstd = 1 / sqrt(var +
// eps) saved per row.
inline void layer_norm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps, const Tensor& y,
                               const Tensor& mean, const Tensor& rstd, [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  constexpr std::string_view op = "layer_norm_forward";
  int64_t rows = 0, dim = 0;
  m::layer_norm_extents(x, weight, &bias, op, rows, dim);
  SLIME_CHECK(eps >= 0.f, "layer_norm_forward: negative eps ", eps);
  m::check_defined(y, "layer_norm_forward: y");
  check_dtype(y, x.dtype(), "layer_norm_forward: y");
  check_shape(y, x.shape(), "layer_norm_forward: y");
  m::check_layer_norm_stat(mean, rows, op, "mean");
  m::check_layer_norm_stat(rstd, rows, op, "rstd");
  for (auto [t, name] : {std::pair{&weight, "weight"}, std::pair{&bias, "bias"}, std::pair{&y, "y"},
                         std::pair{&mean, "mean"}, std::pair{&rstd, "rstd"}})
    check_same_device(x, *t, "layer_norm_forward: x", name);
  SLIME_CHECK(!m::partially_overlap(y, x) && !m::overlap(y, weight) && !m::overlap(y, bias) && !m::overlap(y, mean) &&
                  !m::overlap(y, rstd),
              "layer_norm_forward: y overlaps another tensor of the call (only y = x is allowed)");
  for (const Tensor* t : {&x, &weight, &bias})
    SLIME_CHECK(!m::overlap(mean, *t) && !m::overlap(rstd, *t),
                "layer_norm_forward: mean or rstd overlaps an input of the call");
  SLIME_CHECK(!m::overlap(mean, rstd), "layer_norm_forward: mean and rstd overlap");
  if (x.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = m::stream_for(x.device(), stream, "layer_norm_forward");
    DeviceGuard guard(x.device());
    cuda::LayerNormForwardArgs args{};
    args.x = x.data_ptr();
    args.w = weight.data_ptr();
    args.b = bias.data_ptr();
    args.y = y.data_ptr();
    args.mean = static_cast<float*>(mean.data_ptr());
    args.rstd = static_cast<float*>(rstd.data_ptr());
    args.rows = rows;
    args.dim = dim;
    args.eps = eps;
    args.x_dtype = x.dtype();
    args.w_dtype = weight.dtype();
    cuda::layer_norm_forward(args, s.handle());
    return;
#else
    m::fail_no_cuda("layer_norm_forward");
#endif
  }
  m::visit_act_weight(x.dtype(), weight.dtype(), [&](auto act_tag, auto weight_tag) {
    using T = decltype(act_tag);
    using W = decltype(weight_tag);
    cpu::layer_norm_forward(static_cast<const T*>(x.data_ptr()), static_cast<const W*>(weight.data_ptr()),
                            static_cast<const W*>(bias.data_ptr()), rows, dim, double(eps),
                            static_cast<T*>(y.data_ptr()), static_cast<float*>(mean.data_ptr()),
                            static_cast<float*>(rstd.data_ptr()));
  });
}

// Bytes of workspace layer_norm_backward needs on the current GPU (0 without
// a GPU; the CPU needs none).
inline std::size_t layer_norm_backward_workspace_bytes(int64_t rows, int64_t dim) {
  SLIME_CHECK(rows >= 0 && dim >= 0, "layer_norm_backward_workspace_bytes: negative extent (rows ", rows, ", dim ", dim,
              ")");
#if SLIME_HAS_CUDA
  if (cuda_device_count() == 0) return 0;  // no GPU: only the CPU path can run
  return cuda::layer_norm_backward_workspace_bytes(rows, dim);
#else
  return 0;
#endif
}

// With n = (x - mean) * rstd and g = dy * weight:
//   dx = rstd * (g - mean(g) - n * mean(g * n))           (written)
//   dweight += sum over rows of dy * n, dbias += sum over rows of dy
//                                                          (f32, accumulated)
// The bias does not enter the backward. workspace: on the GPU a tensor of any
// dtype on the same device with at least layer_norm_backward_workspace_bytes(
// rows, dim) bytes; ignored on the CPU.
inline void layer_norm_backward(const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                                const Tensor& dy, const Tensor& dx, const Tensor& dweight, const Tensor& dbias,
                                const Tensor& workspace, [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  constexpr std::string_view op = "layer_norm_backward";
  int64_t rows = 0, dim = 0;
  m::layer_norm_extents(x, weight, nullptr, op, rows, dim);
  m::check_layer_norm_stat(mean, rows, op, "mean");
  m::check_layer_norm_stat(rstd, rows, op, "rstd");
  for (auto [t, name] : {std::pair{&dy, "layer_norm_backward: dy"}, std::pair{&dx, "layer_norm_backward: dx"}}) {
    m::check_defined(*t, name);
    check_dtype(*t, x.dtype(), name);
    check_shape(*t, x.shape(), name);
  }
  for (auto [t, name] :
       {std::pair{&dweight, "layer_norm_backward: dweight"}, std::pair{&dbias, "layer_norm_backward: dbias"}}) {
    m::check_defined(*t, name);
    check_dtype(*t, DType::f32, name);
    check_shape(*t, Shape{dim}, name);
  }
  for (auto [t, name] :
       {std::pair{&weight, "weight"}, std::pair{&mean, "mean"}, std::pair{&rstd, "rstd"}, std::pair{&dy, "dy"},
        std::pair{&dx, "dx"}, std::pair{&dweight, "dweight"}, std::pair{&dbias, "dbias"}})
    check_same_device(x, *t, "layer_norm_backward: x", name);
  SLIME_CHECK(!m::partially_overlap(dx, x) && !m::partially_overlap(dx, dy) && !m::overlap(dx, weight) &&
                  !m::overlap(dx, mean) && !m::overlap(dx, rstd) && !m::overlap(dx, dweight) && !m::overlap(dx, dbias),
              "layer_norm_backward: dx overlaps another tensor of the call (only dx = x or dx = dy is allowed)");
  for (const Tensor* t : {&x, &dy, &weight, &mean, &rstd})
    SLIME_CHECK(!m::overlap(dweight, *t) && !m::overlap(dbias, *t),
                "layer_norm_backward: dweight or dbias overlaps another tensor of the call");
  SLIME_CHECK(!m::overlap(dweight, dbias), "layer_norm_backward: dweight and dbias overlap");
  if (x.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = m::stream_for(x.device(), stream, "layer_norm_backward");
    DeviceGuard guard(x.device());
    const std::size_t need = cuda::layer_norm_backward_workspace_bytes(rows, dim);
    if (need > 0) {
      m::check_defined(workspace, "layer_norm_backward: workspace");
      check_same_device(x, workspace, "layer_norm_backward: x", "workspace");
      SLIME_CHECK(workspace.nbytes() >= need, "layer_norm_backward: workspace has ", workspace.nbytes(),
                  " bytes, needs layer_norm_backward_workspace_bytes(", rows, ", ", dim, ") = ", need);
      for (const Tensor* t : {&x, &weight, &mean, &rstd, &dy, &dx, &dweight, &dbias})
        SLIME_CHECK(!m::overlap(workspace, *t), "layer_norm_backward: workspace overlaps a tensor of the call");
    }
    cuda::LayerNormBackwardArgs args{};
    args.x = x.data_ptr();
    args.w = weight.data_ptr();
    args.mean = static_cast<const float*>(mean.data_ptr());
    args.rstd = static_cast<const float*>(rstd.data_ptr());
    args.dy = dy.data_ptr();
    args.dx = dx.data_ptr();
    args.dw = static_cast<float*>(dweight.data_ptr());
    args.db = static_cast<float*>(dbias.data_ptr());
    args.workspace = need > 0 ? workspace.data_ptr() : nullptr;
    args.workspace_bytes = need > 0 ? workspace.nbytes() : 0;
    args.rows = rows;
    args.dim = dim;
    args.x_dtype = x.dtype();
    args.w_dtype = weight.dtype();
    cuda::layer_norm_backward(args, s.handle());
    return;
#else
    (void)workspace;
    m::fail_no_cuda("layer_norm_backward");
#endif
  }
  m::visit_act_weight(x.dtype(), weight.dtype(), [&](auto act_tag, auto weight_tag) {
    using T = decltype(act_tag);
    using W = decltype(weight_tag);
    cpu::layer_norm_backward(static_cast<const T*>(x.data_ptr()), static_cast<const W*>(weight.data_ptr()),
                             static_cast<const float*>(mean.data_ptr()), static_cast<const float*>(rstd.data_ptr()),
                             static_cast<const T*>(dy.data_ptr()), rows, dim, static_cast<T*>(dx.data_ptr()),
                             static_cast<float*>(dweight.data_ptr()), static_cast<float*>(dbias.data_ptr()));
  });
}

}  // namespace slime::ops
