// slime/ops/embedding.hpp: token embedding lookup y[t] = table[ids[t]] and its
// deterministic gradient, on the CPU or the GPU.
//
// Accumulation contract: parameter gradients accumulate (+=) into fp32
// tensors (dtable); activation outputs are written (=).
//
// Shapes and dtypes: ids [tokens] i32 or i64; table [vocab, dim] f32 or bf16;
// y and dy [tokens, dim] of the table's dtype; dtable [vocab, dim] f32.
//
// Ids outside [0, vocab):
//   CPU  both calls throw slime::Error naming the first bad position and id.
//   GPU  checking on the host would need a synchronisation, so the kernels
//        never read out of bounds instead: the forward writes that row as
//        NaN (all bits set, so the loss shows it) and, given a flag tensor,
//        stores 1 into it; the backward skips such ids. The flag can be read
//        whenever the host synchronises anyway; embedding_check_ids()
//        validates on demand and throws like the CPU (it synchronises).
//
// Determinism (GPU backward): run to run and equal to the CPU reference bit
// for bit. The positions are sorted by id with a stable radix sort (CUB), and
// each id's dy rows are summed from zero in increasing token order in fp32,
// then added to dtable once, which is exactly what the CPU reference does.
// The GPU backward needs a workspace of embedding_backward_workspace_bytes(
// tokens) bytes and allocates nothing itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/embedding.hpp"
#include "slime/ops/cuda/embedding.hpp"
#include "slime/ops/elementwise.hpp"

namespace slime::ops {

namespace detail::memops {

inline void check_ids(const Tensor& ids, std::string_view op) {
  SLIME_CHECK(ids.defined(), op, ": ids is undefined");
  SLIME_CHECK(ids.dtype() == DType::i32 || ids.dtype() == DType::i64, op, ": ids must be i32 or i64, got ", ids.str());
  SLIME_CHECK(ids.dim() == 1, op, ": ids must be 1-d [tokens], got ", ids.str());
}

template <class F>
void visit_ids(DType t, F&& f) {
  if (t == DType::i32) {
    f(int32_t{});
  } else {
    f(int64_t{});
  }
}

}  // namespace detail::memops

// Throws slime::Error unless every id is in [0, num_embeddings), naming the
// first bad position and its id. On the GPU this synchronises `stream` and
// allocates a few bytes: a debugging and validation tool, not for the step.
inline void embedding_check_ids(const Tensor& ids, int64_t num_embeddings, [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  m::check_ids(ids, "embedding_check_ids");
  SLIME_CHECK(num_embeddings >= 0, "embedding_check_ids: negative num_embeddings ", num_embeddings);
  if (ids.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = m::stream_for(ids.device(), stream, "embedding_check_ids");
    DeviceGuard guard(ids.device());
    Tensor first = Tensor::empty({1}, DType::i64, ids.device(), s);
    cuda::embedding_find_bad_id(ids.data_ptr(), ids.dtype(), ids.numel(), num_embeddings,
                                static_cast<uint64_t*>(first.data_ptr()), s.handle());
    const int64_t pos = first.to_vector<int64_t>(s)[0];  // UINT64_MAX reads as -1
    if (pos < 0) return;
    int64_t id = 0;
    m::visit_ids(ids.dtype(), [&](auto tag) {
      using I = decltype(tag);
      id = int64_t(ids.view(pos, {1}).to_vector<I>(s)[0]);
    });
    SLIME_FAIL("embedding: ids[", pos, "] = ", id, " is outside [0, ", num_embeddings, ") (the table has ",
               num_embeddings, " rows)");
#else
    m::fail_no_cuda("embedding_check_ids");
#endif
  }
  m::visit_ids(ids.dtype(), [&](auto tag) {
    using I = decltype(tag);
    cpu::embedding_check_ids(static_cast<const I*>(ids.data_ptr()), ids.numel(), num_embeddings);
  });
}

namespace detail::memops {

inline void embedding_forward_impl(const Tensor& ids, const Tensor& table, const Tensor& y, const Tensor* bad_flag,
                                   [[maybe_unused]] const Stream& stream) {
  check_ids(ids, "embedding_forward");
  check_f32_or_bf16(table, "embedding_forward: table");
  SLIME_CHECK(table.dim() == 2, "embedding_forward: table must be 2-d [vocab, dim], got ", table.str());
  const int64_t tokens = ids.numel(), vocab = table.size(0), dim = table.size(1);
  check_dtype(y, table.dtype(), "embedding_forward: y");
  check_shape(y, Shape{tokens, dim}, "embedding_forward: y");
  check_same_device(ids, table, "embedding_forward: ids", "table");
  check_same_device(ids, y, "embedding_forward: ids", "y");
  SLIME_CHECK(!overlap(y, table) && !overlap(y, ids), "embedding_forward: y overlaps an input");
  if (bad_flag != nullptr) {
    check_dtype(*bad_flag, DType::i32, "embedding_forward: bad_id_flag");
    check_shape(*bad_flag, Shape{1}, "embedding_forward: bad_id_flag");
    check_same_device(ids, *bad_flag, "embedding_forward: ids", "bad_id_flag");
  }
  if (ids.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = stream_for(ids.device(), stream, "embedding_forward");
    DeviceGuard guard(ids.device());
    cuda::embedding_forward(ids.data_ptr(), ids.dtype(), table.data_ptr(), table.dtype(), tokens, vocab, dim,
                            y.data_ptr(), bad_flag ? static_cast<int32_t*>(bad_flag->data_ptr()) : nullptr, s.handle());
    return;
#else
    fail_no_cuda("embedding_forward");
#endif
  }
  visit_ids(ids.dtype(), [&](auto id_tag) {
    using I = decltype(id_tag);
    visit_f32_bf16(table.dtype(), [&](auto tag) {
      using T = decltype(tag);
      cpu::embedding_forward(static_cast<const I*>(ids.data_ptr()), static_cast<const T*>(table.data_ptr()), tokens,
                             vocab, dim, static_cast<T*>(y.data_ptr()));
    });
  });
}

}  // namespace detail::memops

// y [tokens, dim] = table[ids]. See the top of this file for bad ids.
inline void embedding_forward(const Tensor& ids, const Tensor& table, const Tensor& y, const Stream& stream = {}) {
  detail::memops::embedding_forward_impl(ids, table, y, nullptr, stream);
}

// As above; on the GPU a bad id also stores 1 into bad_id_flag (i32 [1] on
// the ids' device, zeroed by the caller; never reset by the kernel). The CPU
// throws instead and leaves the flag alone.
inline void embedding_forward(const Tensor& ids, const Tensor& table, const Tensor& y, const Tensor& bad_id_flag,
                              const Stream& stream = {}) {
  detail::memops::embedding_forward_impl(ids, table, y, &bad_id_flag, stream);
}

// Bytes of workspace embedding_backward needs on the current GPU for
// `tokens` ids (0 without a GPU; the CPU needs none).
inline std::size_t embedding_backward_workspace_bytes(int64_t tokens) {
  SLIME_CHECK(tokens >= 0, "embedding_backward_workspace_bytes: negative tokens ", tokens);
#if SLIME_HAS_CUDA
  if (cuda_device_count() == 0) return 0;  // no GPU: only the CPU path can run
  return cuda::embedding_backward_workspace_bytes(tokens);
#else
  return 0;
#endif
}

// dtable [vocab, dim] f32 += the rows of dy [tokens, dim] gathered by id (see
// the top of this file for the order of the sums). workspace: on the GPU a
// tensor of any dtype on the same device with at least
// embedding_backward_workspace_bytes(tokens) bytes; ignored on the CPU (may
// be undefined).
inline void embedding_backward(const Tensor& ids, const Tensor& dy, const Tensor& dtable, const Tensor& workspace,
                               [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  m::check_ids(ids, "embedding_backward");
  m::check_f32_or_bf16(dy, "embedding_backward: dy");
  check_dtype(dtable, DType::f32, "embedding_backward: dtable");
  SLIME_CHECK(dtable.dim() == 2, "embedding_backward: dtable must be 2-d [vocab, dim], got ", dtable.str());
  const int64_t tokens = ids.numel(), vocab = dtable.size(0), dim = dtable.size(1);
  check_shape(dy, Shape{tokens, dim}, "embedding_backward: dy");
  check_same_device(ids, dy, "embedding_backward: ids", "dy");
  check_same_device(ids, dtable, "embedding_backward: ids", "dtable");
  SLIME_CHECK(!m::overlap(dtable, dy) && !m::overlap(dtable, ids), "embedding_backward: dtable overlaps an input");
  if (ids.device().is_cuda()) {
#if SLIME_HAS_CUDA
    SLIME_CHECK(tokens <= std::numeric_limits<int32_t>::max(), "embedding_backward: ", tokens,
                " tokens exceed the GPU limit of 2^31 - 1");
    SLIME_CHECK(vocab < (int64_t(1) << 31), "embedding_backward: vocab ", vocab, " exceeds the GPU limit of 2^31 - 1");
    const Stream s = m::stream_for(ids.device(), stream, "embedding_backward");
    DeviceGuard guard(ids.device());
    const std::size_t need = cuda::embedding_backward_workspace_bytes(tokens);
    if (need > 0) {
      m::check_defined(workspace, "embedding_backward: workspace");
      check_same_device(ids, workspace, "embedding_backward: ids", "workspace");
      SLIME_CHECK(workspace.nbytes() >= need, "embedding_backward: workspace has ", workspace.nbytes(),
                  " bytes, needs embedding_backward_workspace_bytes(", tokens, ") = ", need);
      SLIME_CHECK(!m::overlap(workspace, dtable) && !m::overlap(workspace, dy) && !m::overlap(workspace, ids),
                  "embedding_backward: workspace overlaps a tensor of the call");
    }
    cuda::embedding_backward(ids.data_ptr(), ids.dtype(), dy.data_ptr(), dy.dtype(), tokens, vocab, dim,
                             static_cast<float*>(dtable.data_ptr()), need > 0 ? workspace.data_ptr() : nullptr,
                             need > 0 ? workspace.nbytes() : 0, s.handle());
    return;
#else
    (void)workspace;
    m::fail_no_cuda("embedding_backward");
#endif
  }
  m::visit_ids(ids.dtype(), [&](auto id_tag) {
    using I = decltype(id_tag);
    m::visit_f32_bf16(dy.dtype(), [&](auto tag) {
      using T = decltype(tag);
      cpu::embedding_backward(static_cast<const I*>(ids.data_ptr()), static_cast<const T*>(dy.data_ptr()), tokens,
                              vocab, dim, static_cast<float*>(dtable.data_ptr()));
    });
  });
}

}  // namespace slime::ops
