// slime/ops/elementwise.hpp: residual add (y = a + b, a += b), dtype casts
// between f32, bf16 and f16, and scaling (y = a * s), on the CPU or the GPU.
//
// Accumulation contract of the memory-bound families (embedding, rms_norm,
// rope, swiglu, elementwise): parameter gradients accumulate (+=) into fp32
// tensors; activation gradients and outputs are written (=).
//
// Math is fp32 for f32/bf16/f16 elements with one round-to-nearest-even into
// the output type, so the GPU result equals the CPU result bit for bit for
// every op in this header (fp32 adds and multiplies are exact IEEE on both;
// the conversions are those of slime::BFloat16 and slime::Half).
//
// Outputs are passed as `const Tensor&` (a tensor is a handle; the call
// writes its elements), so views such as `t.reshape({...})` can be outputs.
#pragma once

#include <cstdint>
#include <string_view>

#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/elementwise.hpp"
#include "slime/ops/cuda/elementwise.hpp"

namespace slime::ops {

namespace detail::memops {

// The stream a call on `device` runs on: `stream` when it belongs to that
// device, the device's default stream when `stream` is the CPU stream (the
// default argument). A stream of another device is an error.
inline Stream stream_for(Device device, const Stream& stream, std::string_view op) {
  if (device.is_cpu() || stream.device() == device) return stream;
  SLIME_CHECK(stream.device().is_cpu(), op, ": the tensors are on ", device, " but the stream is on ", stream.device());
  return Stream::default_for(device);
}

inline void check_defined(const Tensor& t, std::string_view name) { SLIME_CHECK(t.defined(), name, " is undefined"); }

// Activations and weights of the memory-bound ops: f32 or bf16.
inline void check_f32_or_bf16(const Tensor& t, std::string_view name) {
  check_defined(t, name);
  SLIME_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, name, " must be f32 or bf16, got ", t.str());
}

inline void check_floating(const Tensor& t, std::string_view name) {
  check_defined(t, name);
  SLIME_CHECK(is_floating(t.dtype()), name, " must be f32, bf16 or f16, got ", t.str());
}

// Calls f(T{}) for the floating element type of `t` (f32, bf16, f16).
template <class F>
void visit_floating(DType t, F&& f) {
  switch (t) {
    case DType::f32:
      f(float{});
      return;
    case DType::bf16:
      f(BFloat16{});
      return;
    case DType::f16:
      f(Half{});
      return;
    default:
      SLIME_FAIL("expected a floating dtype (f32, bf16, f16), got ", dtype_name(t));
  }
}

// Calls f(T{}) for an f32 (float) or bf16 (BFloat16) dtype, checked before.
template <class F>
void visit_f32_bf16(DType t, F&& f) {
  if (t == DType::f32) {
    f(float{});
  } else {
    f(BFloat16{});
  }
}

// Calls f(T{}, W{}) for f32/bf16 activations and f32/bf16 weights.
template <class F>
void visit_act_weight(DType act, DType weight, F&& f) {
  visit_f32_bf16(act, [&](auto act_tag) { visit_f32_bf16(weight, [&](auto weight_tag) { f(act_tag, weight_tag); }); });
}

// True when the two tensors' bytes overlap.
inline bool overlap(const Tensor& a, const Tensor& b) {
  if (!a.shares_storage_with(b) || a.nbytes() == 0 || b.nbytes() == 0) return false;
  const auto* pa = static_cast<const char*>(a.data_ptr());
  const auto* pb = static_cast<const char*>(b.data_ptr());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

// True when the two tensors overlap without being the same elements (an
// elementwise op may write in place, but not into a shifted copy of its input).
inline bool partially_overlap(const Tensor& a, const Tensor& b) {
  return overlap(a, b) && !(a.data_ptr() == b.data_ptr() && a.nbytes() == b.nbytes());
}

[[noreturn]] inline void fail_no_cuda(std::string_view op) {
  SLIME_FAIL(op, ": the tensors are on a CUDA device but slime was built without CUDA (link slime::cuda)");
}

}  // namespace detail::memops

// y = a + b (residual add). a, b, y: same dtype (f32, bf16 or f16), same
// number of elements, same device; y may be a or b (in place).
inline void add(const Tensor& a, const Tensor& b, const Tensor& y, [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  m::check_floating(a, "add: a");
  check_dtype(b, a.dtype(), "add: b");
  check_dtype(y, a.dtype(), "add: y");
  check_shape(b, a.shape(), "add: b");
  check_shape(y, a.shape(), "add: y");
  check_same_device(a, b, "add: a", "b");
  check_same_device(a, y, "add: a", "y");
  SLIME_CHECK(!m::partially_overlap(y, a) && !m::partially_overlap(y, b),
              "add: y partially overlaps an input (in place is allowed only as the same tensor)");
  if (a.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = m::stream_for(a.device(), stream, "add");
    DeviceGuard guard(a.device());
    cuda::add(a.data_ptr(), b.data_ptr(), y.data_ptr(), a.dtype(), a.numel(), s.handle());
    return;
#else
    m::fail_no_cuda("add");
#endif
  }
  m::visit_floating(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    cpu::add(static_cast<const T*>(a.data_ptr()), static_cast<const T*>(b.data_ptr()), a.numel(),
             static_cast<T*>(y.data_ptr()));
  });
}

// a += b (in place residual add).
inline void add_(const Tensor& a, const Tensor& b, [[maybe_unused]] const Stream& stream = {}) { add(a, b, a, stream); }

// y = a * s (fp32 product, rounded once). y may be a (in place).
inline void scale(const Tensor& a, float s, const Tensor& y, [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  m::check_floating(a, "scale: a");
  check_dtype(y, a.dtype(), "scale: y");
  check_shape(y, a.shape(), "scale: y");
  check_same_device(a, y, "scale: a", "y");
  SLIME_CHECK(!m::partially_overlap(y, a),
              "scale: y partially overlaps a (in place is allowed only as the same tensor)");
  if (a.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream st = m::stream_for(a.device(), stream, "scale");
    DeviceGuard guard(a.device());
    cuda::scale(a.data_ptr(), s, y.data_ptr(), a.dtype(), a.numel(), st.handle());
    return;
#else
    m::fail_no_cuda("scale");
#endif
  }
  m::visit_floating(a.dtype(), [&](auto tag) {
    using T = decltype(tag);
    cpu::scale(static_cast<const T*>(a.data_ptr()), s, a.numel(), static_cast<T*>(y.data_ptr()));
  });
}

// y = x converted to y's dtype (f32, bf16, f16 in any pair; the same dtype
// copies). Round to nearest even; NaN becomes the canonical NaN. Same number
// of elements (shapes must match), same device; x and y must not overlap
// unless the dtypes are equal and they are the same tensor.
inline void cast(const Tensor& x, const Tensor& y, [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  m::check_floating(x, "cast: x");
  m::check_floating(y, "cast: y");
  check_shape(y, x.shape(), "cast: y");
  check_same_device(x, y, "cast: x", "y");
  if (x.dtype() == y.dtype() && x.data_ptr() == y.data_ptr()) return;
  SLIME_CHECK(!m::overlap(x, y), "cast: x and y overlap");
  if (x.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = m::stream_for(x.device(), stream, "cast");
    DeviceGuard guard(x.device());
    cuda::cast(x.data_ptr(), x.dtype(), y.data_ptr(), y.dtype(), x.numel(), s.handle());
    return;
#else
    m::fail_no_cuda("cast");
#endif
  }
  m::visit_floating(x.dtype(), [&](auto in_tag) {
    using In = decltype(in_tag);
    m::visit_floating(y.dtype(), [&](auto out_tag) {
      using Out = decltype(out_tag);
      cpu::cast(static_cast<const In*>(x.data_ptr()), x.numel(), static_cast<Out*>(y.data_ptr()));
    });
  });
}

}  // namespace slime::ops
