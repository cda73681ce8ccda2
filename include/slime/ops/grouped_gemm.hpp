// slime/ops/grouped_gemm.hpp: the grouped GEMM over experts with ragged group
// sizes (a MoE layer's expert projections), forward, input gradient and
// weight gradient, on the CPU (reference) or CUDA (slime/ops/cuda/grouped_gemm.hpp).
//
// Accumulation contract: parameter gradients accumulate (`+=`) into fp32
// tensors (dw); activation gradients are written (`=`), or added (`+=`) when
// `accumulate` is true.
//
// Shapes: x [N, K], rows grouped by expert: group e is rows [offsets[e],
// offsets[e+1]) with offsets i32 [E + 1] (MoeLayout::offsets), offsets[0] = 0,
// non-decreasing, offsets[E] = N; w [E, Nout, K] (per expert nn.Linear's
// out × in); y [N, Nout].
//   grouped_gemm_forward          y_g  = x_g · w_eᵀ
//   grouped_gemm_backward_input   dx_g = dy_g · w_e       (+= with accumulate)
//   grouped_gemm_backward_weight  dw_e += dy_gᵀ · x_g     (dw f32)
// x, w and dy share one dtype, bf16 or f32; y and dx are that dtype or f32.
// A group with no rows is normal. Sums in fp32, rounded once; deterministic
// (bitwise run to run on both backends).
// The CPU path validates the offsets' contents. On CUDA the offsets stay on
// the device (no host synchronisation; the calls allocate nothing): the
// kernels check them where it is free and trap on a broken invariant. CUDA
// runs bf16 inputs with K and Nout multiples of 8 (and 16-byte aligned data)
// on tensor cores, anything else on a slower fallback kernel.
//
// Host offsets: every function takes an optional `host_offsets`, a host copy
// of `offsets` (i32, E + 1 entries) for callers that know the group sizes on
// the host (e.g. after expert-parallel dispatch). It is validated on the host
// (offsets[0] = 0, non-decreasing, offsets[E] = rows; on the CPU also equal to
// `offsets`); on CUDA it must equal the device offsets (not checked: that would
// need a synchronisation) and selects the cuBLAS backend
// (cublasGemmGroupedBatchedEx, see slime/ops/cuda/grouped_gemm.hpp), which is
// not bitwise equal to the kernels, except where the Hopper kernels take the
// inputs (sm_90: they are faster than cuBLAS; grouped_gemm_wants_host_offsets
// says which). Without it CUDA runs the kernels over the device offsets. cuda::set_grouped_gemm_backend or the environment variable
// SLIME_GROUPED_GEMM_BACKEND=kernel|cublas force either backend (benchmarks).
// The CPU path is the same with or without it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/grouped_gemm.hpp"
#include "slime/ops/cuda/grouped_gemm.hpp"
#include "slime/ops/elementwise.hpp"

namespace slime::ops {

namespace detail::grouped_gemm {

#if SLIME_HAS_CUDA
using cuda_pass_tag = cuda::GroupedGemmPass;
inline constexpr cuda_pass_tag kForward = cuda::GroupedGemmPass::forward;
inline constexpr cuda_pass_tag kBackwardInput = cuda::GroupedGemmPass::backward_input;
inline constexpr cuda_pass_tag kBackwardWeight = cuda::GroupedGemmPass::backward_weight;
#else
enum class cuda_pass_tag { forward, backward_input, backward_weight };
inline constexpr cuda_pass_tag kForward = cuda_pass_tag::forward;
inline constexpr cuda_pass_tag kBackwardInput = cuda_pass_tag::backward_input;
inline constexpr cuda_pass_tag kBackwardWeight = cuda_pass_tag::backward_weight;
#endif

// Runs the CUDA kernel on `stream` (or the tensors' device's default stream).
inline void run_cuda([[maybe_unused]] cuda_pass_tag pass, [[maybe_unused]] const Tensor& a,
                     [[maybe_unused]] const Tensor& b, [[maybe_unused]] const Tensor& c,
                     [[maybe_unused]] const Tensor& offsets, [[maybe_unused]] int64_t experts,
                     [[maybe_unused]] int64_t rows, [[maybe_unused]] int64_t out_features,
                     [[maybe_unused]] int64_t in_features, [[maybe_unused]] bool accumulate,
                     [[maybe_unused]] std::span<const int32_t> host_offsets, [[maybe_unused]] const Stream& stream,
                     [[maybe_unused]] std::string_view op) {
#if SLIME_HAS_CUDA
  cuda::GroupedGemmParams p;
  p.pass = pass;
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.c = c.data_ptr();
  p.offsets = offsets.data<int32_t>();
  p.in_dtype = a.dtype();
  p.out_dtype = c.dtype();
  p.experts = experts;
  p.rows = rows;
  p.out_features = out_features;
  p.in_features = in_features;
  p.accumulate = accumulate;
  p.host_offsets = host_offsets.empty() ? nullptr : host_offsets.data();
  const Device d = c.device();
  DeviceGuard guard(d);
  cuda::grouped_gemm(p, (stream.device() == d ? stream : Stream::default_for(d)).handle());
#else
  SLIME_FAIL(op, ": ", c.str(), " is on a CUDA device but slime was built without CUDA");
#endif
}

using detail::memops::overlap;

// w [E, Nout, K] bf16 or f32 (or dw f32 when `is_grad`).
inline void check_weight(const Tensor& w, std::string_view name, std::string_view op) {
  SLIME_CHECK(w.defined(), op, ": ", name, " is undefined");
  SLIME_CHECK(w.dim() == 3 && w.size(0) >= 1, op, ": ", name,
              " must be 3-D [experts, out_features, in_features] with at least one expert, got ", w.str());
}

// offsets i32 [E + 1] on `like`'s device; on the CPU, 0 = offsets[0] <= ... <=
// offsets[E] = rows.
inline void check_offsets(const Tensor& offsets, int64_t experts, int64_t rows, const Tensor& like,
                          std::string_view op) {
  SLIME_CHECK(offsets.defined(), op, ": offsets is undefined");
  SLIME_CHECK(offsets.dtype() == DType::i32 && offsets.shape() == Shape{experts + 1}, op,
              ": offsets must be i32 [experts + 1 = ", experts + 1, "], got ", offsets.str());
  check_same_device(offsets, like, std::string(op) + ": offsets", "the data");
  if (offsets.device().is_cuda()) return;
  const int32_t* o = offsets.data<int32_t>();
  SLIME_CHECK(o[0] == 0, op, ": offsets[0] = ", o[0], ", expected 0");
  for (int64_t e = 0; e < experts; ++e)
    SLIME_CHECK(o[e + 1] >= o[e], op, ": offsets must be non-decreasing, got offsets[", e, "] = ", o[e], " > offsets[",
                e + 1, "] = ", o[e + 1]);
  SLIME_CHECK(o[experts] == rows, op, ": offsets[", experts, "] = ", o[experts], ", expected the row count ", rows);
}

// host_offsets: empty (not given) or E + 1 entries, 0 = o[0] <= ... <= o[E] =
// rows; equal to `offsets` when those are on the CPU.
inline void check_host_offsets(std::span<const int32_t> host_offsets, const Tensor& offsets, int64_t experts,
                               int64_t rows, std::string_view op) {
  if (host_offsets.empty()) return;
  SLIME_CHECK(int64_t(host_offsets.size()) == experts + 1, op, ": host_offsets must have experts + 1 = ", experts + 1,
              " entries, got ", host_offsets.size());
  const int32_t* o = host_offsets.data();
  SLIME_CHECK(o[0] == 0, op, ": host_offsets[0] = ", o[0], ", expected 0");
  for (int64_t e = 0; e < experts; ++e)
    SLIME_CHECK(o[e + 1] >= o[e], op, ": host_offsets must be non-decreasing, got host_offsets[", e, "] = ", o[e],
                " > host_offsets[", e + 1, "] = ", o[e + 1]);
  SLIME_CHECK(o[experts] == rows, op, ": host_offsets[", experts, "] = ", o[experts], ", expected the row count ",
              rows);
  if (offsets.device().is_cuda()) return;
  const int32_t* d = offsets.data<int32_t>();
  for (int64_t e = 0; e <= experts; ++e)
    SLIME_CHECK(o[e] == d[e], op, ": host_offsets[", e, "] = ", o[e], " differs from offsets[", e, "] = ", d[e]);
}

// t [rows, features] of dtype `dt` on w's device.
inline void check_act(const Tensor& t, std::string_view name, int64_t rows, int64_t features, DType dt, const Tensor& w,
                      std::string_view op) {
  SLIME_CHECK(t.defined(), op, ": ", name, " is undefined");
  SLIME_CHECK(t.dim() == 2 && (rows < 0 || t.size(0) == rows) && t.size(1) == features, op, ": ", name,
              " must have shape [", rows < 0 ? std::string("rows") : std::to_string(rows), ", ", features, "], got ",
              t.str());
  SLIME_CHECK(t.dtype() == dt, op, ": ", name, " must be ", dtype_name(dt), ", got ", t.str());
  check_same_device(t, w, std::string(op) + ": " + std::string(name), "w");
}

inline void check_in_dtype(const Tensor& t, std::string_view name, std::string_view op) {
  SLIME_CHECK(t.dtype() == DType::bf16 || t.dtype() == DType::f32, op, ": ", name, " must be bf16 or f32, got ",
              t.str());
}

// Calls f(T{}, TOut{}) for (f32, f32), (bf16, bf16), (bf16, f32).
template <class F>
void visit(DType in, DType out, std::string_view op, F&& f) {
  if (in == DType::f32 && out == DType::f32) return f(float{}, float{});
  if (in == DType::bf16 && out == DType::bf16) return f(BFloat16{}, BFloat16{});
  if (in == DType::bf16 && out == DType::f32) return f(BFloat16{}, float{});
  SLIME_FAIL(op, ": unsupported dtypes: inputs ", dtype_name(in), ", output ", dtype_name(out),
             " (supported: bf16 or f32 inputs; output the input dtype or f32)");
}

}  // namespace detail::grouped_gemm

// y [N, Nout] = per group x_g [n_e, K] · w[e]ᵀ.
inline void grouped_gemm_forward(const Tensor& x, const Tensor& w, const Tensor& offsets, const Tensor& y,
                                 const Stream& stream = {}, std::span<const int32_t> host_offsets = {}) {
  constexpr std::string_view op = "grouped_gemm_forward";
  namespace g = detail::grouped_gemm;
  g::check_weight(w, "w", op);
  g::check_in_dtype(w, "w", op);
  const int64_t experts = w.size(0), out_f = w.size(1), in_f = w.size(2);
  g::check_act(x, "x", -1, in_f, w.dtype(), w, op);
  const int64_t rows = x.size(0);
  SLIME_CHECK(y.defined() && y.dim() == 2 && y.size(0) == rows && y.size(1) == out_f, op, ": y must have shape [", rows,
              ", ", out_f, "], got ", y.str());
  check_same_device(y, w, "grouped_gemm_forward: y", "w");
  SLIME_CHECK(!g::overlap(y, x) && !g::overlap(y, w), op, ": y overlaps x or w");
  g::check_offsets(offsets, experts, rows, w, op);
  g::check_host_offsets(host_offsets, offsets, experts, rows, op);
  if (w.device().is_cuda()) {
    g::visit(w.dtype(), y.dtype(), op, [](auto, auto) {});
    return g::run_cuda(g::kForward, x, w, y, offsets, experts, rows, out_f, in_f, false, host_offsets, stream, op);
  }
  g::visit(w.dtype(), y.dtype(), op, [&](auto in_tag, auto out_tag) {
    using T = decltype(in_tag);
    using TOut = decltype(out_tag);
    cpu::grouped_gemm_forward(x.data<T>(), w.data<T>(), offsets.data<int32_t>(), experts, out_f, in_f, y.data<TOut>());
  });
}

// dx [N, K] = per group dy_g [n_e, Nout] · w[e] (dx += with accumulate).
inline void grouped_gemm_backward_input(const Tensor& dy, const Tensor& w, const Tensor& offsets, const Tensor& dx,
                                        bool accumulate = false, const Stream& stream = {},
                                        std::span<const int32_t> host_offsets = {}) {
  constexpr std::string_view op = "grouped_gemm_backward_input";
  namespace g = detail::grouped_gemm;
  g::check_weight(w, "w", op);
  g::check_in_dtype(w, "w", op);
  const int64_t experts = w.size(0), out_f = w.size(1), in_f = w.size(2);
  g::check_act(dy, "dy", -1, out_f, w.dtype(), w, op);
  const int64_t rows = dy.size(0);
  SLIME_CHECK(dx.defined() && dx.dim() == 2 && dx.size(0) == rows && dx.size(1) == in_f, op, ": dx must have shape [",
              rows, ", ", in_f, "], got ", dx.str());
  check_same_device(dx, w, "grouped_gemm_backward_input: dx", "w");
  SLIME_CHECK(!g::overlap(dx, dy) && !g::overlap(dx, w), op, ": dx overlaps dy or w");
  g::check_offsets(offsets, experts, rows, w, op);
  g::check_host_offsets(host_offsets, offsets, experts, rows, op);
  if (w.device().is_cuda()) {
    g::visit(w.dtype(), dx.dtype(), op, [](auto, auto) {});
    return g::run_cuda(g::kBackwardInput, dy, w, dx, offsets, experts, rows, out_f, in_f, accumulate, host_offsets,
                       stream, op);
  }
  g::visit(w.dtype(), dx.dtype(), op, [&](auto in_tag, auto out_tag) {
    using T = decltype(in_tag);
    using TOut = decltype(out_tag);
    cpu::grouped_gemm_backward_input(dy.data<T>(), w.data<T>(), offsets.data<int32_t>(), experts, out_f, in_f,
                                     dx.data<TOut>(), accumulate);
  });
}

// dw [E, Nout, K] f32 += per group dy_gᵀ · x_g (always accumulates; zero it
// before the first micro-batch). Experts with no rows are left as they are.
inline void grouped_gemm_backward_weight(const Tensor& dy, const Tensor& x, const Tensor& offsets, const Tensor& dw,
                                         const Stream& stream = {}, std::span<const int32_t> host_offsets = {}) {
  constexpr std::string_view op = "grouped_gemm_backward_weight";
  namespace g = detail::grouped_gemm;
  g::check_weight(dw, "dw", op);
  SLIME_CHECK(dw.dtype() == DType::f32, op, ": dw must be f32 (parameter gradients accumulate in fp32), got ",
              dw.str());
  const int64_t experts = dw.size(0), out_f = dw.size(1), in_f = dw.size(2);
  SLIME_CHECK(x.defined(), op, ": x is undefined");
  g::check_in_dtype(x, "x", op);
  g::check_act(x, "x", -1, in_f, x.dtype(), dw, op);
  const int64_t rows = x.size(0);
  g::check_act(dy, "dy", rows, out_f, x.dtype(), dw, op);
  SLIME_CHECK(!g::overlap(dw, dy) && !g::overlap(dw, x), op, ": dw overlaps dy or x");
  g::check_offsets(offsets, experts, rows, dw, op);
  g::check_host_offsets(host_offsets, offsets, experts, rows, op);
  if (dw.device().is_cuda())
    return g::run_cuda(g::kBackwardWeight, dy, x, dw, offsets, experts, rows, out_f, in_f, true, host_offsets, stream,
                       op);
  g::visit(x.dtype(), x.dtype(), op, [&](auto in_tag, auto) {
    using T = decltype(in_tag);
    cpu::grouped_gemm_backward_weight(dy.data<T>(), x.data<T>(), offsets.data<int32_t>(), experts, out_f, in_f,
                                      dw.data<float>());
  });
}

// Whether host offsets would change the backend on device `d`: true where
// the cuBLAS backend is the faster one (CUDA devices without the Hopper
// kernels: cuBLAS's grouped GEMM beats the mma.sync kernels there), false on
// the CPU and where the sm90 kernels run (they beat cuBLAS on every measured
// shape, bench/RESULTS.md). Callers that would synchronise to fetch the group
// sizes (nn::SparseMoeBlock) skip it when this is false.
inline bool grouped_gemm_wants_host_offsets([[maybe_unused]] Device d) {
#if SLIME_HAS_CUDA
  if (!d.is_cuda()) return false;
  DeviceGuard guard(d);
  return !cuda::grouped_gemm_hopper_kernels();
#else
  return false;
#endif
}

}  // namespace slime::ops
