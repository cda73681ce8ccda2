// slime/ops/rms_norm.hpp: RMSNorm over the last dim, y = x * rsqrt(mean(x^2)
// + eps) * w, forward (saving rstd) and backward, on the CPU or the GPU.
//
// Accumulation contract: parameter gradients accumulate (+=) into fp32
// tensors (dweight); activation gradients are written (=).
//
// Shapes: x [..., dim] of any rank >= 1 is normalised over its last extent,
// rows = numel / dim; weight [dim]; y and dy like x; rstd f32 with `rows`
// elements. Qwen3's q_norm / k_norm are the same op on q [tokens, heads,
// head_dim] (rows = tokens * heads) with weight [head_dim].
// Dtypes: x, y, dy, dx f32 or bf16 (one dtype); weight f32 or bf16; rstd and
// dweight f32. Math is fp32 (the CPU reference runs in double for double)
// with one rounding of y; HF's Qwen3RMSNorm also rounds x * rstd to bf16
// before the weight product (about one bf16 ulp of difference).
// y may be x, and dx may be x or dy (in place), as the same tensor only.
//
// Determinism (GPU backward): dweight is the same bits run to run on one
// kind of GPU for the same shapes, dtypes and pointer alignment: it is reduced
// in two fixed-order passes (per-block partial sums, then the partials)
// through a workspace of rms_norm_backward_workspace_bytes(rows, dim) bytes;
// the call allocates nothing. dx does not depend on any order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/rms_norm.hpp"
#include "slime/ops/cuda/rms_norm.hpp"
#include "slime/ops/elementwise.hpp"

namespace slime::ops {

namespace detail::memops {

// rows and dim of x [..., dim]; checks weight [dim].
inline void rms_norm_extents(const Tensor& x, const Tensor& weight, std::string_view op, int64_t& rows, int64_t& dim) {
  check_f32_or_bf16(x, ::slime::detail::concat(op, ": x"));
  check_f32_or_bf16(weight, ::slime::detail::concat(op, ": weight"));
  SLIME_CHECK(x.dim() >= 1, op, ": x must have at least 1 dim, got ", x.str());
  dim = x.size(-1);
  SLIME_CHECK(dim > 0, op, ": x has an empty last dim: ", x.str());
  rows = x.numel() / dim;
  check_shape(weight, Shape{dim}, ::slime::detail::concat(op, ": weight"));
}

inline void check_rstd(const Tensor& rstd, int64_t rows, std::string_view op) {
  check_dtype(rstd, DType::f32, ::slime::detail::concat(op, ": rstd"));
  SLIME_CHECK(rstd.numel() == rows, op, ": rstd must have ", rows, " elements (one per row), got ", rstd.str());
}

}  // namespace detail::memops

// y = x * rstd * weight with rstd = 1 / sqrt(mean(x^2) + eps), saved per row.
inline void rms_norm_forward(const Tensor& x, const Tensor& weight, float eps, const Tensor& y, const Tensor& rstd,
                             [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  int64_t rows = 0, dim = 0;
  m::rms_norm_extents(x, weight, "rms_norm_forward", rows, dim);
  SLIME_CHECK(eps >= 0.f, "rms_norm_forward: negative eps ", eps);
  check_dtype(y, x.dtype(), "rms_norm_forward: y");
  check_shape(y, x.shape(), "rms_norm_forward: y");
  m::check_rstd(rstd, rows, "rms_norm_forward");
  check_same_device(x, weight, "rms_norm_forward: x", "weight");
  check_same_device(x, y, "rms_norm_forward: x", "y");
  check_same_device(x, rstd, "rms_norm_forward: x", "rstd");
  SLIME_CHECK(!m::partially_overlap(y, x) && !m::overlap(y, weight) && !m::overlap(y, rstd) && !m::overlap(rstd, x) &&
                  !m::overlap(rstd, weight),
              "rms_norm_forward: an output overlaps another tensor of the call (only y = x is allowed)");
  if (x.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = m::stream_for(x.device(), stream, "rms_norm_forward");
    DeviceGuard guard(x.device());
    cuda::rms_norm_forward({x.data_ptr(), weight.data_ptr(), y.data_ptr(), static_cast<float*>(rstd.data_ptr()), rows,
                            dim, eps, x.dtype(), weight.dtype()},
                           s.handle());
    return;
#else
    m::fail_no_cuda("rms_norm_forward");
#endif
  }
  m::visit_act_weight(x.dtype(), weight.dtype(), [&](auto act_tag, auto weight_tag) {
    using T = decltype(act_tag);
    using W = decltype(weight_tag);
    cpu::rms_norm_forward(static_cast<const T*>(x.data_ptr()), static_cast<const W*>(weight.data_ptr()), rows, dim,
                          double(eps), static_cast<T*>(y.data_ptr()), static_cast<float*>(rstd.data_ptr()));
  });
}

// Bytes of workspace rms_norm_backward needs on the current GPU (0 without a
// GPU; the CPU needs none).
inline std::size_t rms_norm_backward_workspace_bytes(int64_t rows, int64_t dim) {
  SLIME_CHECK(rows >= 0 && dim >= 0, "rms_norm_backward_workspace_bytes: negative extent (rows ", rows, ", dim ", dim,
              ")");
#if SLIME_HAS_CUDA
  if (cuda_device_count() == 0) return 0;  // no GPU: only the CPU path can run
  return cuda::rms_norm_backward_workspace_bytes(rows, dim);
#else
  return 0;
#endif
}

// dx = rstd * (g - n * mean(g * n)) with n = x * rstd, g = dy * weight
// (written); dweight += sum over rows of dy * n (f32, accumulated).
// workspace: on the GPU a tensor of any dtype on the same device with at least
// rms_norm_backward_workspace_bytes(rows, dim) bytes; ignored on the CPU.
inline void rms_norm_backward(const Tensor& x, const Tensor& weight, const Tensor& rstd, const Tensor& dy,
                              const Tensor& dx, const Tensor& dweight, const Tensor& workspace,
                              [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  int64_t rows = 0, dim = 0;
  m::rms_norm_extents(x, weight, "rms_norm_backward", rows, dim);
  m::check_rstd(rstd, rows, "rms_norm_backward");
  check_dtype(dy, x.dtype(), "rms_norm_backward: dy");
  check_shape(dy, x.shape(), "rms_norm_backward: dy");
  check_dtype(dx, x.dtype(), "rms_norm_backward: dx");
  check_shape(dx, x.shape(), "rms_norm_backward: dx");
  check_dtype(dweight, DType::f32, "rms_norm_backward: dweight");
  check_shape(dweight, Shape{dim}, "rms_norm_backward: dweight");
  for (auto [t, name] : {std::pair{&weight, "weight"}, std::pair{&rstd, "rstd"}, std::pair{&dy, "dy"},
                         std::pair{&dx, "dx"}, std::pair{&dweight, "dweight"}})
    check_same_device(x, *t, "rms_norm_backward: x", name);
  SLIME_CHECK(!m::partially_overlap(dx, x) && !m::partially_overlap(dx, dy) && !m::overlap(dx, weight) &&
                  !m::overlap(dx, rstd) && !m::overlap(dx, dweight),
              "rms_norm_backward: dx overlaps another tensor of the call (only dx = x or dx = dy is allowed)");
  SLIME_CHECK(
      !m::overlap(dweight, x) && !m::overlap(dweight, dy) && !m::overlap(dweight, weight) && !m::overlap(dweight, rstd),
      "rms_norm_backward: dweight overlaps another tensor of the call");
  if (x.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = m::stream_for(x.device(), stream, "rms_norm_backward");
    DeviceGuard guard(x.device());
    const std::size_t need = cuda::rms_norm_backward_workspace_bytes(rows, dim);
    if (need > 0) {
      m::check_defined(workspace, "rms_norm_backward: workspace");
      check_same_device(x, workspace, "rms_norm_backward: x", "workspace");
      SLIME_CHECK(workspace.nbytes() >= need, "rms_norm_backward: workspace has ", workspace.nbytes(),
                  " bytes, needs rms_norm_backward_workspace_bytes(", rows, ", ", dim, ") = ", need);
      for (const Tensor* t : {&x, &weight, &rstd, &dy, &dx, &dweight})
        SLIME_CHECK(!m::overlap(workspace, *t), "rms_norm_backward: workspace overlaps a tensor of the call");
    }
    cuda::RmsNormBackwardArgs args{};
    args.x = x.data_ptr();
    args.w = weight.data_ptr();
    args.rstd = static_cast<const float*>(rstd.data_ptr());
    args.dy = dy.data_ptr();
    args.dx = dx.data_ptr();
    args.dw = static_cast<float*>(dweight.data_ptr());
    args.workspace = need > 0 ? workspace.data_ptr() : nullptr;
    args.workspace_bytes = need > 0 ? workspace.nbytes() : 0;
    args.rows = rows;
    args.dim = dim;
    args.x_dtype = x.dtype();
    args.w_dtype = weight.dtype();
    cuda::rms_norm_backward(args, s.handle());
    return;
#else
    (void)workspace;
    m::fail_no_cuda("rms_norm_backward");
#endif
  }
  m::visit_act_weight(x.dtype(), weight.dtype(), [&](auto act_tag, auto weight_tag) {
    using T = decltype(act_tag);
    using W = decltype(weight_tag);
    cpu::rms_norm_backward(static_cast<const T*>(x.data_ptr()), static_cast<const W*>(weight.data_ptr()),
                           static_cast<const float*>(rstd.data_ptr()), static_cast<const T*>(dy.data_ptr()), rows, dim,
                           static_cast<T*>(dx.data_ptr()), static_cast<float*>(dweight.data_ptr()));
  });
}

}  // namespace slime::ops
