// slime/ops/moe_permute.hpp: the MoE token layout. Groups the T·k token copies
// (token t, slot j) by expert, gathers them (permute) and scatters the expert
// outputs back weighted by the router weights (unpermute), with both
// backwards, on the CPU or the GPU.
//
// Accumulation contract: parameter gradients accumulate (`+=`) into fp32
// tensors (none here); activation gradients are written (`=`), or added
// (`+=`) when `accumulate` is true.
//
// MoeLayout (all i32, on the data's device; N = tokens · topk; copy c = t·k + j):
//   counts      [E]      copies routed to each expert
//   offsets     [E + 1]  group e is grouped rows [offsets[e], offsets[e+1]);
//                        pass it to grouped_gemm_* as is
//   row_to_copy [N]      the copy in each grouped row (the permutation)
//   copy_to_row [N]      the grouped row of each copy (its inverse)
// Built by moe_build_layout from the router's indices: a stable counting sort
// by (expert, token, slot), so the layout is deterministic. It serves the
// permute, the unpermute and both backwards. A hand-made layout is validated
// on every CPU call (offsets consistent with counts, ending at N; the two
// permutations inverse of each other) in O(N + E).
//
//   moe_permute_forward     x_grouped [N, H] = x [T, H] gathered
//   moe_permute_backward    dx [T, H] = Σ_j dx_grouped of t's k copies
//   moe_unpermute_forward   y [T, H] = Σ_j weights[t, j] · y_grouped[row of (t, j)]
//   moe_unpermute_backward  dy_grouped = weights · dy; dweights = ⟨dy, y_grouped⟩
// Sums over the k slots run in slot order in fp32 (double in the CPU
// templates' double instantiation) and round once. HF (Qwen3MoeSparseMoeBlock)
// instead multiplies each expert's output by its weight in the hidden dtype
// and index_add_s the products expert by expert, rounding at each step; the
// results differ by bf16 rounding only.
//
// GPU (src/ops/moe_permute.cu): the same layout bit for bit (a stable CUB
// radix sort), built with a workspace of moe_layout_workspace_bytes(T, k, E)
// bytes that MoeLayout::empty allocates once on a CUDA device (layout.workspace;
// a layout without one gets a temporary per build), so steady-state builds
// allocate nothing; E <= 8192. The permute, unpermute and backwards are
// gathers through copy_to_row (no atomics, deterministic) with 16-byte
// vectors where hidden allows; permute forward/backward and unpermute forward
// equal the CPU bit for bit (slot-order fp32 sums, IEEE adds and multiplies);
// dweights are block reductions (fp32, another order).
// The GPU does not validate ids or layouts (that would need device-to-host
// copies), but stays in bounds: an id outside [0, E) is not counted, its copy
// goes to the tail rows [offsets[E], N) (so offsets[E] < N tells), and the
// kernels drop every copy whose row is not below min(offsets[E], N): it adds
// nothing to dx or y, gets dweight 0, and its grouped row is written with
// zeros by moe_permute_forward and moe_unpermute_backward. grouped_gemm_*
// covers rows [0, offsets[E]) only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/moe_permute.hpp"
#include "slime/ops/cuda/moe_permute.hpp"
#include "slime/ops/elementwise.hpp"

namespace slime::ops {

// Bytes of GPU workspace moe_build_layout needs (0 without CUDA; the CPU
// path needs none). Queries CUB on the current CUDA device.
inline std::size_t moe_layout_workspace_bytes(int64_t tokens, int64_t topk, int64_t num_experts) {
  SLIME_CHECK(tokens >= 0 && topk >= 1 && num_experts >= 1, "moe_layout_workspace_bytes: need tokens >= 0, ",
              "topk >= 1, num_experts >= 1, got ", tokens, ", ", topk, ", ", num_experts);
#if SLIME_HAS_CUDA
  return cuda::moe_layout_workspace_bytes(tokens, topk, num_experts);
#else
  return 0;
#endif
}

struct MoeLayout {
  int64_t tokens = 0, topk = 0, num_experts = 0;
  Tensor counts, offsets, row_to_copy, copy_to_row;
  Tensor workspace;  // u8, moe_build_layout's scratch on a CUDA device (undefined on the CPU)

  int64_t rows() const { return tokens * topk; }

  // Uninitialised i32 tensors for a layout of these sizes, to be filled by
  // moe_build_layout (allocate once, rebuild every step).
  static MoeLayout empty(int64_t tokens, int64_t topk, int64_t num_experts, Device device = Device::cpu(),
                         const Stream& stream = {}) {
    SLIME_CHECK(tokens >= 0 && topk >= 1 && num_experts >= 1, "MoeLayout::empty: need tokens >= 0, topk >= 1, ",
                "num_experts >= 1, got tokens ", tokens, ", topk ", topk, ", num_experts ", num_experts);
    SLIME_CHECK(tokens * topk <= std::numeric_limits<int32_t>::max(),
                "MoeLayout::empty: tokens * topk = ", tokens * topk, " does not fit the i32 layout");
    MoeLayout l;
    l.tokens = tokens;
    l.topk = topk;
    l.num_experts = num_experts;
    l.counts = Tensor::empty(Shape{num_experts}, DType::i32, device, stream);
    l.offsets = Tensor::empty(Shape{num_experts + 1}, DType::i32, device, stream);
    l.row_to_copy = Tensor::empty(Shape{tokens * topk}, DType::i32, device, stream);
    l.copy_to_row = Tensor::empty(Shape{tokens * topk}, DType::i32, device, stream);
#if SLIME_HAS_CUDA
    if (device.is_cuda()) {
      DeviceGuard guard(device);
      const std::size_t bytes = moe_layout_workspace_bytes(tokens, topk, num_experts);
      l.workspace = Tensor::empty(Shape{int64_t(std::max<std::size_t>(bytes, 1))}, DType::u8, device, stream);
    }
#endif
    return l;
  }
};

// The CUDA scratch moe_build_layout needs for `l`'s sizes, as a view of
// `cache` (kept by the caller, grown when too small: a layout rebuilt every
// step then allocates nothing once it is sized); undefined on the CPU, which
// needs none. The view starts at the buffer's start (the pool's alignment,
// at least the 256 bytes the CUDA path asks for).
inline Tensor moe_layout_workspace(Tensor& cache, const MoeLayout& l, Device device, const Stream& stream = {}) {
#if SLIME_HAS_CUDA
  if (device.is_cuda()) {
    const std::size_t bytes = cuda::moe_layout_workspace_bytes(l.tokens, l.topk, l.num_experts);
    return reuse_buffer(cache, Shape{int64_t(std::max<std::size_t>(bytes, 1))}, DType::u8, device, stream);
  }
#endif
  (void)cache;
  (void)l;
  (void)device;
  (void)stream;
  return Tensor{};
}

namespace detail::moe_permute {

// The layout's tensors exist with the right shapes, dtype i32, one device;
// on the CPU their contents are consistent.
inline void check_layout(const MoeLayout& l, std::string_view op) {
  SLIME_CHECK(l.tokens >= 0 && l.topk >= 1 && l.num_experts >= 1, op, ": layout sizes invalid: tokens ", l.tokens,
              ", topk ", l.topk, ", num_experts ", l.num_experts);
  SLIME_CHECK(l.topk <= l.num_experts, op, ": layout topk = ", l.topk, " exceeds num_experts = ", l.num_experts);
  SLIME_CHECK(l.rows() <= std::numeric_limits<int32_t>::max(), op, ": layout rows ", l.rows(), " do not fit in i32");
  const int64_t n = l.rows(), e = l.num_experts;
  const std::pair<const Tensor*, std::pair<const char*, int64_t>> parts[] = {
      {&l.counts, {"layout.counts", e}},
      {&l.offsets, {"layout.offsets", e + 1}},
      {&l.row_to_copy, {"layout.row_to_copy", n}},
      {&l.copy_to_row, {"layout.copy_to_row", n}}};
  for (const auto& [t, info] : parts) {
    SLIME_CHECK(t->defined(), op, ": ", info.first, " is undefined");
    SLIME_CHECK(t->dtype() == DType::i32 && t->shape() == Shape{info.second}, op, ": ", info.first, " must be i32 [",
                info.second, "], got ", t->str());
    check_same_device(*t, l.offsets, std::string(op) + ": " + info.first, "layout.offsets");
  }
  if (l.offsets.device().is_cuda()) return;
  const int32_t* counts = l.counts.data<int32_t>();
  const int32_t* off = l.offsets.data<int32_t>();
  const int32_t* r2c = l.row_to_copy.data<int32_t>();
  const int32_t* c2r = l.copy_to_row.data<int32_t>();
  SLIME_CHECK(off[0] == 0, op, ": layout.offsets[0] = ", off[0], ", expected 0");
  for (int64_t i = 0; i < e; ++i)
    SLIME_CHECK(counts[i] >= 0 && int64_t(off[i + 1]) == int64_t(off[i]) + counts[i], op, ": layout.offsets[", i + 1,
                "] = ", off[i + 1], " != offsets[", i, "] + counts[", i, "] = ", off[i], " + ", counts[i]);
  SLIME_CHECK(off[e] == n, op, ": layout.offsets[", e, "] = ", off[e], ", expected tokens * topk = ", n);
  for (int64_t r = 0; r < n; ++r)
    SLIME_CHECK(r2c[r] >= 0 && r2c[r] < n && c2r[r2c[r]] == r, op, ": layout.row_to_copy[", r, "] = ", r2c[r],
                " is not a copy in [0, ", n, ") whose copy_to_row is ", r);
}

// `t` is [rows, hidden] on the layout's device.
inline void check_rows(const Tensor& t, std::string_view name, int64_t rows, int64_t hidden, const MoeLayout& l,
                       std::string_view op) {
  SLIME_CHECK(t.defined(), op, ": ", name, " is undefined");
  SLIME_CHECK(t.dim() == 2 && t.size(0) == rows && (hidden < 0 || t.size(1) == hidden), op, ": ", name,
              " must have shape [", rows, ", ", hidden < 0 ? std::string("hidden") : std::to_string(hidden), "], got ",
              t.str());
  check_same_device(t, l.offsets, std::string(op) + ": " + std::string(name), "layout.offsets");
}

inline void check_f32_bf16(const Tensor& t, std::string_view op, std::string_view name) {
  SLIME_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, op, ": ", name, " must be f32 or bf16, got ",
              t.str());
}

using detail::memops::visit_f32_bf16;  // f32 or bf16, checked before

using detail::memops::overlap;

#if SLIME_HAS_CUDA
// The layout as the GPU kernels read it.
inline cuda::MoeLayoutView gpu_view(const MoeLayout& l) {
  return {l.offsets.data<int32_t>(), l.copy_to_row.data<int32_t>(), l.tokens, l.topk, l.num_experts};
}

// The stream of a GPU call on the layout's device.
inline Stream gpu_stream(const MoeLayout& l, const Stream& stream, std::string_view op) {
  return detail::memops::stream_for(l.offsets.device(), stream, op);
}
#endif

}  // namespace detail::moe_permute

// Fills `layout` (sized by MoeLayout::empty(T, k, num_experts)) from the
// router's indices [T, k] i32; every id must be in [0, num_experts) (checked
// on the CPU; on the GPU see the top of this file). On the GPU it uses
// layout.workspace (moe_layout_workspace_bytes; MoeLayout::empty allocates
// it), or a temporary when that is undefined.
inline void moe_build_layout(const Tensor& indices, const MoeLayout& layout,
                             [[maybe_unused]] const Stream& stream = {}) {
  constexpr std::string_view op = "moe_build_layout";
  namespace p = detail::moe_permute;
  SLIME_CHECK(indices.defined(), op, ": indices is undefined");
  SLIME_CHECK(indices.dim() == 2 && indices.dtype() == DType::i32, op, ": indices must be i32 [tokens, k], got ",
              indices.str());
  SLIME_CHECK(layout.num_experts >= 1 && indices.size(1) <= layout.num_experts, op, ": k = ", indices.size(1),
              " exceeds num_experts = ", layout.num_experts);
  SLIME_CHECK(indices.size(0) == layout.tokens && indices.size(1) == layout.topk, op, ": indices ", indices.str(),
              " do not match the layout's [tokens, topk] = [", layout.tokens, ", ", layout.topk, "]");
  SLIME_CHECK(layout.counts.defined() && layout.offsets.defined() && layout.row_to_copy.defined() &&
                  layout.copy_to_row.defined(),
              op, ": layout tensors are undefined (allocate them with MoeLayout::empty)");
  check_same_device(indices, layout.offsets, "moe_build_layout: indices", "layout.offsets");
  // Shapes of the outputs (the contents are about to be written).
  const int64_t n = layout.rows(), e = layout.num_experts;
  check_shape(layout.counts, Shape{e}, "moe_build_layout: layout.counts");
  check_shape(layout.offsets, Shape{e + 1}, "moe_build_layout: layout.offsets");
  check_shape(layout.row_to_copy, Shape{n}, "moe_build_layout: layout.row_to_copy");
  check_shape(layout.copy_to_row, Shape{n}, "moe_build_layout: layout.copy_to_row");
  for (const Tensor* t : {&layout.counts, &layout.offsets, &layout.row_to_copy, &layout.copy_to_row}) {
    check_dtype(*t, DType::i32, "moe_build_layout: layout tensor");
    check_same_device(*t, indices, "moe_build_layout: layout tensor", "indices");
  }
  if (indices.device().is_cuda()) {
#if SLIME_HAS_CUDA
    SLIME_CHECK(e <= cuda::kMoeLayoutMaxExperts, op, ": the CUDA path takes at most ", cuda::kMoeLayoutMaxExperts,
                " experts, got ", e);
    const Stream s = p::gpu_stream(layout, stream, op);
    DeviceGuard guard(indices.device());
    const std::size_t need = cuda::moe_layout_workspace_bytes(layout.tokens, layout.topk, e);
    Tensor ws = layout.workspace;
    if (!ws.defined()) {
      ws = Tensor::empty(Shape{int64_t(std::max<std::size_t>(need, 1))}, DType::u8, indices.device(), s);
    } else {
      check_same_device(ws, indices, "moe_build_layout: layout.workspace", "indices");
      SLIME_CHECK(ws.nbytes() >= need, op, ": layout.workspace has ", ws.nbytes(), " bytes, needs ", need,
                  " (moe_layout_workspace_bytes)");
      SLIME_CHECK(reinterpret_cast<std::uintptr_t>(ws.data_ptr()) % 256 == 0, op,
                  ": layout.workspace must be 256-byte aligned");
      for (const Tensor* t : {&indices, &layout.counts, &layout.offsets, &layout.row_to_copy, &layout.copy_to_row})
        SLIME_CHECK(!p::overlap(ws, *t), op, ": layout.workspace overlaps indices or a layout tensor");
    }
    cuda::moe_build_layout({indices.data<int32_t>(), layout.tokens, layout.topk, e, layout.counts.data<int32_t>(),
                            layout.offsets.data<int32_t>(), layout.row_to_copy.data<int32_t>(),
                            layout.copy_to_row.data<int32_t>(), ws.data_ptr(), ws.nbytes()},
                           s.handle());
    return;
#else
    detail::memops::fail_no_cuda(op);
#endif
  }
  const int32_t* ids = indices.data<int32_t>();
  for (int64_t i = 0; i < indices.numel(); ++i)
    SLIME_CHECK(ids[i] >= 0 && ids[i] < layout.num_experts, op, ": indices[", i / indices.size(1), ", ",
                i % indices.size(1), "] = ", ids[i], " is not an expert id in [0, ", layout.num_experts, ")");
  cpu::moe_build_layout(ids, layout.tokens, layout.topk, e, layout.counts.data<int32_t>(),
                        layout.offsets.data<int32_t>(), layout.row_to_copy.data<int32_t>(),
                        layout.copy_to_row.data<int32_t>());
}

// Allocates and builds the layout of indices [T, k] for num_experts experts.
inline MoeLayout moe_make_layout(const Tensor& indices, int64_t num_experts, const Stream& stream = {}) {
  SLIME_CHECK(indices.defined() && indices.dim() == 2, "moe_make_layout: indices must be i32 [tokens, k], got ",
              indices.str());
  SLIME_CHECK(num_experts >= 1 && indices.size(1) >= 1 && indices.size(1) <= num_experts,
              "moe_make_layout: k = ", indices.size(1), " (indices dim 1) must be in [1, num_experts = ", num_experts,
              "]");
  MoeLayout l = MoeLayout::empty(indices.size(0), indices.size(1), num_experts, indices.device(), stream);
  moe_build_layout(indices, l, stream);
  return l;
}

// x_grouped [N, H] (x's dtype): row r = x[row_to_copy[r] / k].
inline void moe_permute_forward(const Tensor& x, const MoeLayout& layout, const Tensor& x_grouped,
                                [[maybe_unused]] const Stream& stream = {}) {
  constexpr std::string_view op = "moe_permute_forward";
  namespace p = detail::moe_permute;
  p::check_layout(layout, op);
  p::check_rows(x, "x", layout.tokens, -1, layout, op);
  p::check_f32_bf16(x, op, "x");
  const int64_t hidden = x.size(1);
  p::check_rows(x_grouped, "x_grouped", layout.rows(), hidden, layout, op);
  check_dtype(x_grouped, x.dtype(), "moe_permute_forward: x_grouped");
  SLIME_CHECK(!p::overlap(x, x_grouped), op, ": x_grouped overlaps x");
  if (x.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = p::gpu_stream(layout, stream, op);
    DeviceGuard guard(x.device());
    cuda::moe_permute_forward(p::gpu_view(layout), x.data_ptr(), x.dtype(), hidden, x_grouped.data_ptr(), s.handle());
    return;
#else
    detail::memops::fail_no_cuda(op);
#endif
  }
  p::visit_f32_bf16(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    cpu::moe_permute_forward(x.data<T>(), layout.row_to_copy.data<int32_t>(), layout.tokens, layout.topk, hidden,
                             x_grouped.data<T>());
  });
}

// dx [T, H] (dx_grouped's dtype or f32) = Σ_j dx_grouped[row of (t, j)], or
// dx += that with accumulate: the permute's backward.
inline void moe_permute_backward(const Tensor& dx_grouped, const MoeLayout& layout, const Tensor& dx,
                                 bool accumulate = false, [[maybe_unused]] const Stream& stream = {}) {
  constexpr std::string_view op = "moe_permute_backward";
  namespace p = detail::moe_permute;
  p::check_layout(layout, op);
  p::check_rows(dx_grouped, "dx_grouped", layout.rows(), -1, layout, op);
  p::check_f32_bf16(dx_grouped, op, "dx_grouped");
  const int64_t hidden = dx_grouped.size(1);
  p::check_rows(dx, "dx", layout.tokens, hidden, layout, op);
  SLIME_CHECK(dx.dtype() == dx_grouped.dtype() || dx.dtype() == DType::f32, op,
              ": dx must be dx_grouped's dtype or f32, got ", dx.str());
  SLIME_CHECK(!p::overlap(dx, dx_grouped), op, ": dx overlaps dx_grouped");
  if (dx.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = p::gpu_stream(layout, stream, op);
    DeviceGuard guard(dx.device());
    cuda::moe_permute_backward(p::gpu_view(layout), dx_grouped.data_ptr(), dx_grouped.dtype(), hidden, dx.data_ptr(),
                               dx.dtype(), accumulate, s.handle());
    return;
#else
    detail::memops::fail_no_cuda(op);
#endif
  }
  p::visit_f32_bf16(dx_grouped.dtype(), [&](auto tag) {
    using T = decltype(tag);
    p::visit_f32_bf16(dx.dtype(), [&](auto out_tag) {
      using TOut = decltype(out_tag);
      if constexpr (std::is_same_v<T, TOut> || std::is_same_v<TOut, float>)
        cpu::moe_permute_backward(dx_grouped.data<T>(), layout.copy_to_row.data<int32_t>(), layout.tokens, layout.topk,
                                  hidden, dx.data<TOut>(), accumulate);
    });
  });
}

// y [T, H] (y_grouped's dtype or f32) = Σ_j weights[t, j] · y_grouped[row of
// (t, j)]; weights [T, k] bf16 or f32 (router_forward's).
inline void moe_unpermute_forward(const Tensor& y_grouped, const Tensor& weights, const MoeLayout& layout,
                                  const Tensor& y, [[maybe_unused]] const Stream& stream = {}) {
  constexpr std::string_view op = "moe_unpermute_forward";
  namespace p = detail::moe_permute;
  p::check_layout(layout, op);
  p::check_rows(y_grouped, "y_grouped", layout.rows(), -1, layout, op);
  p::check_f32_bf16(y_grouped, op, "y_grouped");
  const int64_t hidden = y_grouped.size(1);
  p::check_rows(weights, "weights", layout.tokens, layout.topk, layout, op);
  p::check_f32_bf16(weights, op, "weights");
  p::check_rows(y, "y", layout.tokens, hidden, layout, op);
  SLIME_CHECK(y.dtype() == y_grouped.dtype() || y.dtype() == DType::f32, op,
              ": y must be y_grouped's dtype or f32, got ", y.str());
  SLIME_CHECK(!p::overlap(y, y_grouped) && !p::overlap(y, weights), op, ": y overlaps y_grouped or weights");
  if (y.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = p::gpu_stream(layout, stream, op);
    DeviceGuard guard(y.device());
    cuda::moe_unpermute_forward(p::gpu_view(layout), y_grouped.data_ptr(), y_grouped.dtype(), weights.data_ptr(),
                                weights.dtype(), hidden, y.data_ptr(), y.dtype(), s.handle());
    return;
#else
    detail::memops::fail_no_cuda(op);
#endif
  }
  p::visit_f32_bf16(y_grouped.dtype(), [&](auto tag) {
    using T = decltype(tag);
    p::visit_f32_bf16(weights.dtype(), [&](auto w_tag) {
      using TW = decltype(w_tag);
      p::visit_f32_bf16(y.dtype(), [&](auto out_tag) {
        using TOut = decltype(out_tag);
        if constexpr (std::is_same_v<T, TOut> || std::is_same_v<TOut, float>)
          cpu::moe_unpermute_forward(y_grouped.data<T>(), weights.data<TW>(), layout.copy_to_row.data<int32_t>(),
                                     layout.tokens, layout.topk, hidden, y.data<TOut>());
      });
    });
  });
}

// The unpermute's backward, both written: dy_grouped [N, H] (dy's dtype) =
// weights[t, j] · dy[t] in the row of (t, j); dweights [T, k] (weights' dtype)
// = ⟨dy[t], y_grouped[row of (t, j)]⟩. dy and y_grouped share a dtype.
inline void moe_unpermute_backward(const Tensor& dy, const Tensor& y_grouped, const Tensor& weights,
                                   const MoeLayout& layout, const Tensor& dy_grouped, const Tensor& dweights,
                                   [[maybe_unused]] const Stream& stream = {}) {
  constexpr std::string_view op = "moe_unpermute_backward";
  namespace p = detail::moe_permute;
  p::check_layout(layout, op);
  p::check_rows(dy, "dy", layout.tokens, -1, layout, op);
  p::check_f32_bf16(dy, op, "dy");
  const int64_t hidden = dy.size(1);
  p::check_rows(y_grouped, "y_grouped", layout.rows(), hidden, layout, op);
  check_dtype(y_grouped, dy.dtype(), "moe_unpermute_backward: y_grouped");
  p::check_rows(weights, "weights", layout.tokens, layout.topk, layout, op);
  p::check_f32_bf16(weights, op, "weights");
  p::check_rows(dy_grouped, "dy_grouped", layout.rows(), hidden, layout, op);
  check_dtype(dy_grouped, dy.dtype(), "moe_unpermute_backward: dy_grouped");
  p::check_rows(dweights, "dweights", layout.tokens, layout.topk, layout, op);
  check_dtype(dweights, weights.dtype(), "moe_unpermute_backward: dweights");
  for (const Tensor* in : {&dy, &y_grouped, &weights})
    SLIME_CHECK(!p::overlap(dy_grouped, *in) && !p::overlap(dweights, *in), op, ": an output overlaps an input");
  SLIME_CHECK(!p::overlap(dy_grouped, dweights), op, ": dy_grouped overlaps dweights");
  if (dy.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = p::gpu_stream(layout, stream, op);
    DeviceGuard guard(dy.device());
    cuda::moe_unpermute_backward(p::gpu_view(layout), dy.data_ptr(), y_grouped.data_ptr(), dy.dtype(),
                                 weights.data_ptr(), weights.dtype(), hidden, dy_grouped.data_ptr(),
                                 dweights.data_ptr(), s.handle());
    return;
#else
    detail::memops::fail_no_cuda(op);
#endif
  }
  p::visit_f32_bf16(dy.dtype(), [&](auto tag) {
    using T = decltype(tag);
    p::visit_f32_bf16(weights.dtype(), [&](auto w_tag) {
      using TW = decltype(w_tag);
      cpu::moe_unpermute_backward(dy.data<T>(), y_grouped.data<T>(), weights.data<TW>(),
                                  layout.copy_to_row.data<int32_t>(), layout.tokens, layout.topk, hidden,
                                  dy_grouped.data<T>(), dweights.data<TW>());
    });
  });
}

}  // namespace slime::ops
