// slime/ops/linear.hpp: Linear without bias (PyTorch nn.Linear, HF weight
// layout), forward and backward, on the CPU reference or cuBLAS.
//
// Accumulation contract: parameter gradients accumulate (`+=`) into fp32
// tensors (dw); activation gradients are written (`=`) — or added (`+=`) when
// `accumulate` is true, for a residual branch summing into a gradient that
// already holds the other branch.
//
// Shapes: x [..., in], w [out, in], y [..., out]; the leading extents of x
// (tokens, or tokens × heads) are flattened into one row count T.
//   linear_forward          y  [T, out] = x · wᵀ
//   linear_backward_input   dx [T, in]  = dy · w        (+= with accumulate)
//   linear_backward_weight  dw [out, in] += dyᵀ · x     (dw f32)
// Dtypes: x, w and dy share one dtype, bf16 or f32; y and dx are that dtype
// or f32; dw is f32. Products are summed in fp32 and rounded once (CPU: see
// ops/cpu/linear.hpp; CUDA: cuBLAS with CUBLAS_COMPUTE_32F, no TF32, see
// ops/cuda/linear.hpp). Outputs must not overlap inputs. Outputs are taken by
// const reference: a Tensor is a handle, and views (slice_rows, view) can be
// passed directly.
//
// Determinism: the CPU path is bitwise deterministic; the CUDA path is run to
// run deterministic on one GPU model (cuBLAS's guarantee, fixed workspace).
// Steady-state CUDA calls allocate nothing (the per-thread cuBLAS handle and
// its workspace are created on a thread's first call on a device).
#pragma once

#include <cstdint>
#include <string_view>
#include <type_traits>

#include "slime/core/dtype.hpp"
#include "slime/core/half.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/linear.hpp"
#include "slime/ops/cuda/linear.hpp"

namespace slime::ops {

namespace detail {

// Rows of a [..., features] tensor: the product of all extents but the last.
inline int64_t linear_rows(const Tensor& t) {
  int64_t rows = 1;
  for (int d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return rows;
}

inline Shape linear_with_last(Shape s, int64_t last) {
  s[-1] = last;
  return s;
}

inline bool linear_overlap(const Tensor& a, const Tensor& b) {
  if (!a.shares_storage_with(b) || a.nbytes() == 0 || b.nbytes() == 0) return false;
  const char* pa = static_cast<const char*>(a.data_ptr());
  const char* pb = static_cast<const char*>(b.data_ptr());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

inline void linear_check_weight(const Tensor& w, std::string_view op) {
  SLIME_CHECK(w.defined(), op, ": w is undefined");
  SLIME_CHECK(w.dim() == 2, op, ": w must be 2-D [out_features, in_features], got ", w.str());
}

// `t` is [..., features] with the same dtype and device as w.
inline void linear_check_input(const Tensor& t, std::string_view name, int64_t features, std::string_view dim_name,
                               const Tensor& w, std::string_view op) {
  SLIME_CHECK(t.defined(), op, ": ", name, " is undefined");
  SLIME_CHECK(t.dim() >= 1 && t.size(-1) == features, op, ": ", name, " must have shape (..., ", features, ") (",
              dim_name, " of w ", w.shape(), "), got ", t.str());
  SLIME_CHECK(t.dtype() == w.dtype(), op, ": ", name, " and w must have the same dtype, got ", name, " ", t.str(),
              ", w ", w.str());
  SLIME_CHECK(t.dtype() == DType::bf16 || t.dtype() == DType::f32, op, ": unsupported input dtype ",
              dtype_name(t.dtype()), " (supported: bf16, f32)");
  check_same_device(t, w, name, "w");
}

// An activation output: shape `expected`, dtype the input dtype or f32, on the
// inputs' device, overlapping neither input.
inline void linear_check_output(const Tensor& out, std::string_view name, const Shape& expected, DType in_dtype,
                                const Tensor& in0, std::string_view in0_name, const Tensor& in1,
                                std::string_view in1_name, std::string_view op) {
  SLIME_CHECK(out.defined(), op, ": ", name, " is undefined");
  SLIME_CHECK(out.shape() == expected, op, ": ", name, " must have shape ", expected, ", got ", out.str());
  SLIME_CHECK(out.dtype() == in_dtype || out.dtype() == DType::f32, op, ": ", name, " must be ",
              in_dtype == DType::f32 ? "f32" : "bf16 or f32", " for ", dtype_name(in_dtype), " inputs, got ",
              out.str());
  check_same_device(out, in0, name, in0_name);
  SLIME_CHECK(!linear_overlap(out, in0) && !linear_overlap(out, in1), op, ": ", name, " overlaps ", in0_name, " or ",
              in1_name);
}

// Calls f(T{}, TOut{}) for the supported (input, output) type pairs.
template <class F>
void linear_visit(DType in, DType out, std::string_view op, F&& f) {
  if (in == DType::f32 && out == DType::f32) return f(float{}, float{});
  if (in == DType::bf16 && out == DType::bf16) return f(BFloat16{}, BFloat16{});
  if (in == DType::bf16 && out == DType::f32) return f(BFloat16{}, float{});
  SLIME_FAIL(op, ": unsupported dtypes: inputs ", dtype_name(in), ", output ", dtype_name(out),
             " (supported: bf16 or f32 inputs; output the input dtype or f32)");
}

#if SLIME_HAS_CUDA
inline cudaStream_t linear_stream(const Stream& stream, Device d) {
  return (stream.device() == d ? stream : Stream::default_for(d)).handle();
}
#endif

[[noreturn]] inline void linear_no_cuda(std::string_view op, const Tensor& t) {
  SLIME_FAIL(op, ": ", t.str(), " is on a CUDA device but slime was built without CUDA");
}

}  // namespace detail

// y [..., out] = x [..., in] · w [out, in]ᵀ. y is x's dtype or f32.
inline void linear_forward(const Tensor& x, const Tensor& w, const Tensor& y, const Stream& stream = {}) {
  constexpr std::string_view op = "linear_forward";
  detail::linear_check_weight(w, op);
  const int64_t out_features = w.size(0), in_features = w.size(1);
  detail::linear_check_input(x, "x", in_features, "in_features = dim 1", w, op);
  detail::linear_check_output(y, "y", detail::linear_with_last(x.shape(), out_features), x.dtype(), x, "x", w, "w", op);
  const int64_t tokens = detail::linear_rows(x);
  if (y.device().is_cuda()) {
#if SLIME_HAS_CUDA
    cuda::linear_forward(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.dtype(), y.dtype(), tokens, in_features,
                         out_features, y.device().index, detail::linear_stream(stream, y.device()));
    return;
#else
    (void)stream;
    detail::linear_no_cuda(op, y);
#endif
  }
  detail::linear_visit(x.dtype(), y.dtype(), op, [&](auto in_tag, auto out_tag) {
    using T = decltype(in_tag);
    using TOut = decltype(out_tag);
    cpu::linear_forward(x.data<T>(), w.data<T>(), tokens, in_features, out_features, y.data<TOut>());
  });
}

// dx [..., in] = dy [..., out] · w [out, in], or dx += dy · w when `accumulate`
// (added in fp32, rounded once). dx is dy's dtype or f32.
inline void linear_backward_input(const Tensor& dy, const Tensor& w, const Tensor& dx, bool accumulate = false,
                                  const Stream& stream = {}) {
  constexpr std::string_view op = "linear_backward_input";
  detail::linear_check_weight(w, op);
  const int64_t out_features = w.size(0), in_features = w.size(1);
  detail::linear_check_input(dy, "dy", out_features, "out_features = dim 0", w, op);
  detail::linear_check_output(dx, "dx", detail::linear_with_last(dy.shape(), in_features), dy.dtype(), dy, "dy", w, "w",
                              op);
  const int64_t tokens = detail::linear_rows(dy);
  if (dx.device().is_cuda()) {
#if SLIME_HAS_CUDA
    cuda::linear_backward_input(dy.data_ptr(), w.data_ptr(), dx.data_ptr(), dy.dtype(), dx.dtype(), tokens, in_features,
                                out_features, accumulate, dx.device().index,
                                detail::linear_stream(stream, dx.device()));
    return;
#else
    (void)stream;
    detail::linear_no_cuda(op, dx);
#endif
  }
  detail::linear_visit(dy.dtype(), dx.dtype(), op, [&](auto in_tag, auto out_tag) {
    using T = decltype(in_tag);
    using TOut = decltype(out_tag);
    cpu::linear_backward_input(dy.data<T>(), w.data<T>(), tokens, in_features, out_features, dx.data<TOut>(),
                               accumulate);
  });
}

// dw [out, in] += dy [..., out]ᵀ · x [..., in], dw f32 (the parameter-gradient
// contract: it always accumulates; zero it before the first micro-batch).
inline void linear_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& dw, const Stream& stream = {}) {
  constexpr std::string_view op = "linear_backward_weight";
  SLIME_CHECK(dw.defined(), op, ": dw is undefined");
  SLIME_CHECK(dw.dim() == 2, op, ": dw must be 2-D [out_features, in_features] f32, got ", dw.str());
  SLIME_CHECK(dw.dtype() == DType::f32, op, ": dw must be f32 (parameter gradients accumulate in fp32), got ",
              dw.str());
  const int64_t out_features = dw.size(0), in_features = dw.size(1);
  SLIME_CHECK(x.defined(), op, ": x is undefined");
  SLIME_CHECK(x.dim() >= 1 && x.size(-1) == in_features, op, ": x must have shape (..., ", in_features,
              ") (in_features = dim 1 of dw ", dw.shape(), "), got ", x.str());
  SLIME_CHECK(x.dtype() == DType::bf16 || x.dtype() == DType::f32, op, ": unsupported input dtype ",
              dtype_name(x.dtype()), " (supported: bf16, f32)");
  SLIME_CHECK(dy.defined(), op, ": dy is undefined");
  SLIME_CHECK(dy.shape() == detail::linear_with_last(x.shape(), out_features), op, ": dy must have shape ",
              detail::linear_with_last(x.shape(), out_features), " (x's leading extents, out_features of dw ",
              dw.shape(), "), got ", dy.str());
  SLIME_CHECK(dy.dtype() == x.dtype(), op, ": dy and x must have the same dtype, got dy ", dy.str(), ", x ", x.str());
  check_same_device(dy, x, "dy", "x");
  check_same_device(dw, x, "dw", "x");
  SLIME_CHECK(!detail::linear_overlap(dw, dy) && !detail::linear_overlap(dw, x), op, ": dw overlaps dy or x");
  const int64_t tokens = detail::linear_rows(x);
  if (dw.device().is_cuda()) {
#if SLIME_HAS_CUDA
    cuda::linear_backward_weight(dy.data_ptr(), x.data_ptr(), dw.data<float>(), x.dtype(), tokens, in_features,
                                 out_features, dw.device().index, detail::linear_stream(stream, dw.device()));
    return;
#else
    (void)stream;
    detail::linear_no_cuda(op, dw);
#endif
  }
  detail::linear_visit(x.dtype(), x.dtype(), op, [&](auto in_tag, auto) {
    using T = decltype(in_tag);
    cpu::linear_backward_weight(dy.data<T>(), x.data<T>(), tokens, in_features, out_features, dw.data<float>());
  });
}

// Both gradients of y = x · wᵀ: dx (=, or += with accumulate_dx) and dw (+=).
// An undefined dx or dw is skipped (an input that needs no gradient, a frozen
// weight).
inline void linear_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& dx, const Tensor& dw,
                            bool accumulate_dx = false, const Stream& stream = {}) {
  constexpr std::string_view op = "linear_backward";
  detail::linear_check_weight(w, op);
  detail::linear_check_input(x, "x", w.size(1), "in_features = dim 1", w, op);
  SLIME_CHECK(dy.defined(), op, ": dy is undefined");
  SLIME_CHECK(dy.shape() == detail::linear_with_last(x.shape(), w.size(0)), op, ": dy must have shape ",
              detail::linear_with_last(x.shape(), w.size(0)), " (x's leading extents, out_features of w ", w.shape(),
              "), got ", dy.str());
  if (dw.defined()) {
    SLIME_CHECK(dw.shape() == w.shape(), op, ": dw must have w's shape ", w.shape(), ", got ", dw.str());
    linear_backward_weight(dy, x, dw, stream);
  }
  if (dx.defined()) {
    SLIME_CHECK(dx.shape() == x.shape(), op, ": dx must have x's shape ", x.shape(), ", got ", dx.str());
    linear_backward_input(dy, w, dx, accumulate_dx, stream);
  }
}

}  // namespace slime::ops
