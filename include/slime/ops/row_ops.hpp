// slime/ops/row_ops.hpp: ops that combine whole rows, on the CPU or the GPU:
// a bias added to every row and its gradient (the column sums), and the
// Qwen3-VL learned position embedding's bilinear resample as 4 weighted taps
// of table rows per patch, forward and backward.
//
// Accumulation contract: parameter gradients (dbias, d_table) are fp32; d_table
// accumulates (+=), dbias is written or accumulated as the caller asks (the
// bias of a Linear split into slices is summed slice by slice). Activations
// are written (=), or added to (out += ...) where `accumulate` says so.
//
// Shapes and dtypes:
//   bias_add_       y [..., n] f32 or bf16, bias [n] of y's dtype
//   bias_backward   dy [..., n] f32 or bf16, dbias [n] f32
//   pos_embed_*     table [S, D] f32 or bf16, ids [4, P] i32, weights [4, P]
//                   f32, out and d_out [P, D] of the table's dtype, d_table
//                   [S, D] f32
// Math is fp32 (double for double in the CPU templates) with one rounding per
// output element. bias_add_ gives the same bits on both devices; the sums of
// the others are ordered differently on the GPU (fp32 agreement).
//
// Determinism (GPU): every op here is the same bits run to run.
//   bias_backward: a fixed two-pass reduction (per-chunk partial sums of the
//     rows into a workspace, then the partials in a fixed order; the chunking
//     depends on the number of rows only, not on the GPU model or on the
//     pointers' alignment, and neither do the bits). The call allocates nothing: the workspace is a tensor of
//     bias_backward_workspace_bytes(rows, n) bytes (query, then run).
//   pos_embed_interpolate_backward: one thread block per table row sums the
//     row's taps in increasing tap order (no atomics); the grouping of the
//     taps by row is built on the host from the host ids
//     (pos_embed_row_taps), where the ids are also validated.
//
// Ids outside [0, S): the CPU throws slime::Error naming the tap and the id
// (before writing anything); pos_embed_row_taps does the same on the host.
// The GPU forward reads its ids from the device and does not synchronise to
// check them: a patch with a bad id is written as NaN (all bits set) and never
// reads outside the table. Callers build the ids on the host and validate
// them there (pos_embed_row_taps, which the backward needs anyway).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>

#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/row_ops.hpp"
#include "slime/ops/cuda/row_ops.hpp"
#include "slime/ops/elementwise.hpp"

namespace slime::ops {

namespace detail::memops {

// rows and n of t [..., n] (rows = 0 when n = 0).
inline void row_extents(const Tensor& t, std::string_view name, int64_t& rows, int64_t& n) {
  check_f32_or_bf16(t, name);
  SLIME_CHECK(t.dim() >= 1, name, " must have at least 1 dim [..., n], got ", t.str());
  n = t.size(-1);
  rows = n == 0 ? 0 : t.numel() / n;
}

// ids [4, P] i32 and weights [4, P] f32 on one device; returns P.
inline int64_t check_pos_embed_taps(const Tensor& ids, const Tensor& weights, std::string_view op) {
  check_dtype(ids, DType::i32, ::slime::detail::concat(op, ": ids"));
  SLIME_CHECK(ids.dim() == 2 && ids.size(0) == cpu::kPosEmbedTaps, op,
              ": ids must be [4, patches] (4 bilinear taps per patch), got ", ids.str());
  const int64_t patches = ids.size(1);
  SLIME_CHECK(patches * cpu::kPosEmbedTaps <= std::numeric_limits<int32_t>::max(), op, ": ", patches,
              " patches exceed the i32 tap index (at most 2^31 - 1 taps)");
  check_dtype(weights, DType::f32, ::slime::detail::concat(op, ": weights"));
  check_shape(weights, ids.shape(), ::slime::detail::concat(op, ": weights (ids' shape)"));
  check_same_device(ids, weights, ::slime::detail::concat(op, ": ids"), "weights");
  return patches;
}

}  // namespace detail::memops

// y [..., n] += bias [n]: one fp32 add per element, rounded once.
inline void bias_add_(const Tensor& y, const Tensor& bias, [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  int64_t rows = 0, n = 0;
  m::row_extents(y, "bias_add_: y", rows, n);
  check_dtype(bias, y.dtype(), "bias_add_: bias (y's dtype)");
  check_shape(bias, Shape{n}, "bias_add_: bias (y's last dim)");
  check_same_device(y, bias, "bias_add_: y", "bias");
  SLIME_CHECK(!m::overlap(y, bias), "bias_add_: y overlaps bias");
  if (rows == 0) return;
  if (y.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = m::stream_for(y.device(), stream, "bias_add_");
    DeviceGuard guard(y.device());
    cuda::bias_add({y.data_ptr(), bias.data_ptr(), rows, n, y.dtype()}, s.handle());
    return;
#else
    m::fail_no_cuda("bias_add_");
#endif
  }
  m::visit_f32_bf16(y.dtype(), [&](auto tag) {
    using T = decltype(tag);
    cpu::bias_add(static_cast<T*>(y.data_ptr()), static_cast<const T*>(bias.data_ptr()), rows, n);
  });
}

// Bytes of workspace bias_backward needs on a GPU for dy [rows, n] (any GPU
// model; the CPU needs none).
inline std::size_t bias_backward_workspace_bytes(int64_t rows, int64_t n) {
  SLIME_CHECK(rows >= 0 && n >= 0, "bias_backward_workspace_bytes: negative extent (rows ", rows, ", n ", n, ")");
  return cuda::BiasBackwardPolicy::workspace_bytes(rows, n);
}

// dbias [n] (f32) = column sums of dy [..., n], or += them when `accumulate`.
// workspace: on the GPU a tensor of any dtype on dy's device with at least
// bias_backward_workspace_bytes(rows, n) bytes; ignored on the CPU (may be
// undefined there).
inline void bias_backward(const Tensor& dy, const Tensor& dbias, bool accumulate, const Tensor& workspace,
                          [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  int64_t rows = 0, n = 0;
  m::row_extents(dy, "bias_backward: dy", rows, n);
  check_dtype(dbias, DType::f32, "bias_backward: dbias");
  check_shape(dbias, Shape{n}, "bias_backward: dbias (dy's last dim)");
  check_same_device(dy, dbias, "bias_backward: dy", "dbias");
  SLIME_CHECK(!m::overlap(dy, dbias), "bias_backward: dbias overlaps dy");
  if (dy.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = m::stream_for(dy.device(), stream, "bias_backward");
    DeviceGuard guard(dy.device());
    const std::size_t need = bias_backward_workspace_bytes(rows, n);
    if (need > 0) {
      m::check_defined(workspace, "bias_backward: workspace");
      check_same_device(dy, workspace, "bias_backward: dy", "workspace");
      SLIME_CHECK(workspace.nbytes() >= need, "bias_backward: workspace has ", workspace.nbytes(),
                  " bytes, needs bias_backward_workspace_bytes(", rows, ", ", n, ") = ", need);
      SLIME_CHECK(!m::overlap(workspace, dy) && !m::overlap(workspace, dbias),
                  "bias_backward: workspace overlaps dy or dbias");
    }
    cuda::BiasBackwardArgs args{};
    args.dy = dy.data_ptr();
    args.db = static_cast<float*>(dbias.data_ptr());
    args.workspace = need > 0 ? workspace.data_ptr() : nullptr;
    args.workspace_bytes = need > 0 ? workspace.nbytes() : 0;
    args.rows = rows;
    args.n = n;
    args.dtype = dy.dtype();
    args.accumulate = accumulate;
    cuda::bias_backward(args, s.handle());
    return;
#else
    (void)workspace;
    m::fail_no_cuda("bias_backward");
#endif
  }
  m::visit_f32_bf16(dy.dtype(), [&](auto tag) {
    using T = decltype(tag);
    cpu::bias_backward(static_cast<const T*>(dy.data_ptr()), rows, n, static_cast<float*>(dbias.data_ptr()),
                       accumulate);
  });
}

// out [P, D] = sum_k weights[k, p] * table[ids[k, p]], or out += that when
// `accumulate` (fp32, one rounding of the result). See the top of this file
// for bad ids.
inline void pos_embed_interpolate_forward(const Tensor& table, const Tensor& ids, const Tensor& weights,
                                          const Tensor& out, bool accumulate,
                                          [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  constexpr std::string_view op = "pos_embed_interpolate_forward";
  m::check_f32_or_bf16(table, "pos_embed_interpolate_forward: table");
  SLIME_CHECK(table.dim() == 2, op, ": table must be 2-d [rows, dim], got ", table.str());
  const int64_t patches = m::check_pos_embed_taps(ids, weights, op);
  const int64_t rows = table.size(0), dim = table.size(1);
  check_dtype(out, table.dtype(), "pos_embed_interpolate_forward: out (the table's dtype)");
  check_shape(out, Shape{patches, dim}, "pos_embed_interpolate_forward: out [patches, dim]");
  check_same_device(table, ids, "pos_embed_interpolate_forward: table", "ids");
  check_same_device(table, out, "pos_embed_interpolate_forward: table", "out");
  SLIME_CHECK(!m::overlap(out, table) && !m::overlap(out, ids) && !m::overlap(out, weights), op,
              ": out overlaps an input");
  if (table.device().is_cuda()) {
#if SLIME_HAS_CUDA
    if (patches == 0 || dim == 0) return;
    const Stream s = m::stream_for(table.device(), stream, op);
    DeviceGuard guard(table.device());
    cuda::PosEmbedForwardArgs args{};
    args.table = table.data_ptr();
    args.ids = static_cast<const int32_t*>(ids.data_ptr());
    args.weights = static_cast<const float*>(weights.data_ptr());
    args.out = out.data_ptr();
    args.table_rows = rows;
    args.dim = dim;
    args.patches = patches;
    args.dtype = table.dtype();
    args.accumulate = accumulate;
    cuda::pos_embed_interpolate_forward(args, s.handle());
    return;
#else
    m::fail_no_cuda(op);
#endif
  }
  m::visit_f32_bf16(table.dtype(), [&](auto tag) {
    using T = decltype(tag);
    cpu::pos_embed_interpolate_forward(
        static_cast<const T*>(table.data_ptr()), rows, dim, static_cast<const int32_t*>(ids.data_ptr()),
        static_cast<const float*>(weights.data_ptr()), patches, static_cast<T*>(out.data_ptr()), accumulate);
  });
}

// The taps of ids [4, P] grouped by table row, for the GPU backward (CSR):
// row s's taps t = k * P + p are taps[offsets[s] .. offsets[s + 1]), in
// increasing t. offsets i32 [S + 1], taps i32 [4 * P].
struct PosEmbedRowTaps {
  Tensor offsets;
  Tensor taps;
};

// Built on the host from ids [4, P] i32 on the CPU (throws naming the tap
// for an id outside [0, table_rows)), then copied to `device` on `stream`.
inline PosEmbedRowTaps pos_embed_row_taps(const Tensor& ids, int64_t table_rows, Device device = Device::cpu(),
                                          const Stream& stream = {}) {
  check_dtype(ids, DType::i32, "pos_embed_row_taps: ids");
  SLIME_CHECK(ids.device().is_cpu(), "pos_embed_row_taps: ids must be on the CPU (the host builds the grouping), got ",
              ids.str());
  SLIME_CHECK(ids.dim() == 2 && ids.size(0) == cpu::kPosEmbedTaps, "pos_embed_row_taps: ids must be [4, patches], got ",
              ids.str());
  const cpu::PosEmbedCsr csr = cpu::pos_embed_csr(
      std::span<const int32_t>(ids.data<int32_t>(), static_cast<std::size_t>(ids.numel())), table_rows);
  PosEmbedRowTaps r;
  r.offsets = Tensor::from_vector(csr.offsets, {table_rows + 1}, device, stream);
  r.taps = Tensor::from_vector(csr.taps, {ids.numel()}, device, stream);
  return r;
}

// d_table [S, D] (f32) += sum over taps (k, p) with ids[k, p] = s of
// weights[k, p] * d_out[p], per row summed from zero in increasing tap order
// t = k * P + p, then added once. row_taps: on the GPU, pos_embed_row_taps of
// these ids (the kernel reads the taps from it, not ids), on d_out's device;
// ignored on the CPU (may be empty there).
inline void pos_embed_interpolate_backward(const Tensor& d_out, const Tensor& ids, const Tensor& weights,
                                           const PosEmbedRowTaps& row_taps, const Tensor& d_table,
                                           [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  constexpr std::string_view op = "pos_embed_interpolate_backward";
  m::check_f32_or_bf16(d_out, "pos_embed_interpolate_backward: d_out");
  const int64_t patches = m::check_pos_embed_taps(ids, weights, op);
  SLIME_CHECK(d_out.dim() == 2 && d_out.size(0) == patches, op, ": d_out must be [patches = ", patches, ", dim], got ",
              d_out.str());
  check_dtype(d_table, DType::f32, "pos_embed_interpolate_backward: d_table");
  SLIME_CHECK(d_table.dim() == 2 && d_table.size(1) == d_out.size(1), op, ": d_table must be [rows, ", d_out.size(1),
              "] (d_out's dim), got ", d_table.str());
  const int64_t rows = d_table.size(0), dim = d_table.size(1);
  check_same_device(d_out, ids, "pos_embed_interpolate_backward: d_out", "ids");
  check_same_device(d_out, d_table, "pos_embed_interpolate_backward: d_out", "d_table");
  SLIME_CHECK(!m::overlap(d_table, d_out) && !m::overlap(d_table, ids) && !m::overlap(d_table, weights), op,
              ": d_table overlaps an input");
  if (d_out.device().is_cuda()) {
#if SLIME_HAS_CUDA
    check_dtype(row_taps.offsets, DType::i32, "pos_embed_interpolate_backward: row_taps.offsets");
    check_shape(row_taps.offsets, Shape{rows + 1},
                "pos_embed_interpolate_backward: row_taps.offsets (table rows + 1; pos_embed_row_taps)");
    check_dtype(row_taps.taps, DType::i32, "pos_embed_interpolate_backward: row_taps.taps");
    check_shape(row_taps.taps, Shape{patches * cpu::kPosEmbedTaps},
                "pos_embed_interpolate_backward: row_taps.taps (4 x patches; pos_embed_row_taps)");
    check_same_device(d_out, row_taps.offsets, "pos_embed_interpolate_backward: d_out", "row_taps.offsets");
    check_same_device(d_out, row_taps.taps, "pos_embed_interpolate_backward: d_out", "row_taps.taps");
    SLIME_CHECK(!m::overlap(d_table, row_taps.offsets) && !m::overlap(d_table, row_taps.taps), op,
                ": d_table overlaps row_taps");
    if (rows == 0 || dim == 0) return;
    const Stream s = m::stream_for(d_out.device(), stream, op);
    DeviceGuard guard(d_out.device());
    cuda::PosEmbedBackwardArgs args{};
    args.d_out = d_out.data_ptr();
    args.weights = static_cast<const float*>(weights.data_ptr());
    args.row_offsets = static_cast<const int32_t*>(row_taps.offsets.data_ptr());
    args.row_taps = static_cast<const int32_t*>(row_taps.taps.data_ptr());
    args.d_table = static_cast<float*>(d_table.data_ptr());
    args.table_rows = rows;
    args.dim = dim;
    args.patches = patches;
    args.dtype = d_out.dtype();
    cuda::pos_embed_interpolate_backward(args, s.handle());
    return;
#else
    (void)row_taps;
    m::fail_no_cuda(op);
#endif
  }
  m::visit_f32_bf16(d_out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    cpu::pos_embed_interpolate_backward(
        static_cast<const T*>(d_out.data_ptr()), static_cast<const int32_t*>(ids.data_ptr()),
        static_cast<const float*>(weights.data_ptr()), patches, rows, dim, static_cast<float*>(d_table.data_ptr()));
  });
}

}  // namespace slime::ops
