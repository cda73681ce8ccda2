// slime/ops/gelu.hpp: GELU, y = gelu(x), forward and backward, in the exact
// erf form or torch's tanh approximation (GeluApproximation), on the CPU or
// the GPU. Qwen3-VL's vision MLPs use the tanh form (gelu_pytorch_tanh), its
// patch mergers the erf form (nn.GELU()).
//
// Accumulation contract: parameter gradients accumulate (+=) into fp32
// tensors (GELU has none); activation gradients are written (=).
//
// Shapes: x, y, dy, dx of one shape (any rank), elementwise. Dtypes: f32 or
// bf16, one dtype. Math is fp32 (erff / tanhf / expf on the GPU, std::erf /
// std::tanh / std::exp on the CPU; both accurate to a few fp32 ulp, so the
// two backends agree to fp32 rounding, not bit for bit), one rounding per
// output, as torch computes bf16 GELU in fp32.
// y may be x, and dx may be x or dy (in place), as the same tensor only.
#pragma once

#include <cstdint>
#include <utility>

#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/gelu.hpp"
#include "slime/ops/cuda/gelu.hpp"
#include "slime/ops/elementwise.hpp"

namespace slime::ops {

namespace detail::memops {

inline void check_gelu_approximation(GeluApproximation approx, std::string_view op) {
  SLIME_CHECK(approx == GeluApproximation::none || approx == GeluApproximation::tanh, op,
              ": unknown GeluApproximation ", int(approx), " (none or tanh)");
}

}  // namespace detail::memops

// y = gelu(x).
inline void gelu_forward(const Tensor& x, GeluApproximation approx, const Tensor& y,
                         [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  m::check_f32_or_bf16(x, "gelu_forward: x");
  m::check_gelu_approximation(approx, "gelu_forward");
  m::check_defined(y, "gelu_forward: y");
  check_dtype(y, x.dtype(), "gelu_forward: y");
  check_shape(y, x.shape(), "gelu_forward: y");
  check_same_device(x, y, "gelu_forward: x", "y");
  SLIME_CHECK(!m::partially_overlap(y, x),
              "gelu_forward: y partially overlaps x (in place is allowed only as the same tensor)");
  if (x.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = m::stream_for(x.device(), stream, "gelu_forward");
    DeviceGuard guard(x.device());
    cuda::gelu_forward({x.data_ptr(), y.data_ptr(), x.numel(), approx, x.dtype()}, s.handle());
    return;
#else
    m::fail_no_cuda("gelu_forward");
#endif
  }
  m::visit_f32_bf16(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    cpu::gelu_forward(static_cast<const T*>(x.data_ptr()), x.numel(), approx, static_cast<T*>(y.data_ptr()));
  });
}

// y = gelu(x) in place.
inline void gelu_forward_(const Tensor& x, GeluApproximation approx, [[maybe_unused]] const Stream& stream = {}) {
  gelu_forward(x, approx, x, stream);
}

// dx = dy * gelu'(x) (written), from the forward's input x.
inline void gelu_backward(const Tensor& x, const Tensor& dy, GeluApproximation approx, const Tensor& dx,
                          [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  m::check_f32_or_bf16(x, "gelu_backward: x");
  m::check_gelu_approximation(approx, "gelu_backward");
  for (auto [t, name] : {std::pair{&dy, "gelu_backward: dy"}, std::pair{&dx, "gelu_backward: dx"}}) {
    m::check_defined(*t, name);
    check_dtype(*t, x.dtype(), name);
    check_shape(*t, x.shape(), name);
  }
  check_same_device(x, dy, "gelu_backward: x", "dy");
  check_same_device(x, dx, "gelu_backward: x", "dx");
  SLIME_CHECK(!m::partially_overlap(dx, x) && !m::partially_overlap(dx, dy),
              "gelu_backward: dx partially overlaps an input (in place is allowed only as the same tensor)");
  if (x.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = m::stream_for(x.device(), stream, "gelu_backward");
    DeviceGuard guard(x.device());
    cuda::gelu_backward({x.data_ptr(), dy.data_ptr(), dx.data_ptr(), x.numel(), approx, x.dtype()}, s.handle());
    return;
#else
    m::fail_no_cuda("gelu_backward");
#endif
  }
  m::visit_f32_bf16(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    cpu::gelu_backward(static_cast<const T*>(x.data_ptr()), static_cast<const T*>(dy.data_ptr()), x.numel(), approx,
                       static_cast<T*>(dx.data_ptr()));
  });
}

}  // namespace slime::ops
