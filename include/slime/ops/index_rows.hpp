// slime/ops/index_rows.hpp: row gather and scatter by an i32 index, for any
// dtype (rows are copied as bytes): the KV-cache writes and the selection of
// each sequence's last hidden row in the rollout engine.
//
//   gather_rows   dst [N, ...] : dst[i] = src[index[i]],  src [M, ...]
//   scatter_rows  dst [M, ...] : dst[index[i]] = src[i],  src [N, ...]
// index i32 [N] on the data's device; a row is everything after dim 0, and
// src and dst share the row shape and dtype. scatter_rows with a repeated
// index is an error on the CPU (checked) and unspecified on the GPU.
// Index values are checked on the CPU; on the GPU an index outside [0, M)
// traps the kernel (the next synchronisation reports it) instead of touching
// memory outside the tensor.
//
// Accumulation contract: outputs are written (=); nothing accumulates.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/tensor.hpp"

#if SLIME_HAS_CUDA
namespace slime::ops::cuda {
// Copies n rows of row_bytes bytes: dst row (scatter ? index[i] : i) = src row
// (scatter ? i : index[i]); index values must be in [0, bound).
void index_rows(const void* src, void* dst, const int32_t* index, int64_t n, int64_t row_bytes, int64_t bound,
                bool scatter, StreamHandle stream);
}  // namespace slime::ops::cuda
#endif

namespace slime::ops {

namespace detail::index_rows {

inline int64_t row_elems(const Tensor& t) { return t.dim() == 0 ? 1 : (t.size(0) == 0 ? 0 : t.numel() / t.size(0)); }

// src/dst/index checks; returns the row size in bytes.
inline int64_t check(const Tensor& src, const Tensor& index, const Tensor& dst, bool scatter, std::string_view op) {
  SLIME_CHECK(src.defined() && dst.defined() && index.defined(), op, ": src, index and dst must be defined");
  SLIME_CHECK(src.dim() >= 1 && dst.dim() >= 1, op, ": src and dst need a row dim, got ", src.str(), " and ",
              dst.str());
  SLIME_CHECK(src.dtype() == dst.dtype(), op, ": src ", src.str(), " and dst ", dst.str(), " must share a dtype");
  SLIME_CHECK(index.dtype() == DType::i32 && index.dim() == 1, op, ": index must be i32 [N], got ", index.str());
  const Tensor& indexed = scatter ? src : dst;  // the side with N rows
  SLIME_CHECK(indexed.size(0) == index.size(0), op, ": ", scatter ? "src" : "dst", " must have ", index.size(0),
              " rows (index's length), got ", indexed.str());
  for (int d = 1; d < std::max(src.dim(), dst.dim()); ++d)
    SLIME_CHECK(src.dim() == dst.dim() && src.size(d) == dst.size(d), op, ": src ", src.str(), " and dst ", dst.str(),
                " must have the same row shape");
  check_same_device(src, dst, std::string(op) + ": src", "dst");
  check_same_device(src, index, std::string(op) + ": src", "index");
  SLIME_CHECK(!src.shares_storage_with(dst), op, ": src and dst must not share storage");
  return row_elems(src) * int64_t(dtype_size(src.dtype()));
}

inline void run(const Tensor& src, const Tensor& index, const Tensor& dst, bool scatter, std::string_view op,
                [[maybe_unused]] const Stream& stream) {
  const int64_t row_bytes = check(src, index, dst, scatter, op);
  const int64_t n = index.numel();
  const int64_t bound = scatter ? dst.size(0) : src.size(0);
  if (n == 0 || row_bytes == 0) return;
  if (src.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = stream.device() == src.device() ? stream : Stream::default_for(src.device());
    DeviceGuard guard(src.device());
    cuda::index_rows(src.data_ptr(), dst.data_ptr(), index.data<int32_t>(), n, row_bytes, bound, scatter, s.handle());
    return;
#else
    SLIME_FAIL(op, ": a CUDA tensor in a build without CUDA");
#endif
  }
  const int32_t* idx = index.data<int32_t>();
  std::vector<bool> seen(scatter ? std::size_t(bound) : 0);
  for (int64_t i = 0; i < n; ++i) {
    SLIME_CHECK(idx[i] >= 0 && idx[i] < bound, op, ": index[", i, "] = ", idx[i], " is outside [0, ", bound, ")");
    if (scatter) {
      SLIME_CHECK(!seen[std::size_t(idx[i])], op, ": index[", i, "] = ", idx[i], " repeats (a row written twice)");
      seen[std::size_t(idx[i])] = true;
    }
  }
  const auto* s = static_cast<const char*>(src.data_ptr());
  auto* d = static_cast<char*>(dst.data_ptr());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t from = scatter ? i : idx[i], to = scatter ? idx[i] : i;
    std::memcpy(d + to * row_bytes, s + from * row_bytes, std::size_t(row_bytes));
  }
}

}  // namespace detail::index_rows

// dst[i] = src[index[i]] for every i < index.numel().
inline void gather_rows(const Tensor& src, const Tensor& index, const Tensor& dst, const Stream& stream = {}) {
  detail::index_rows::run(src, index, dst, false, "gather_rows", stream);
}

// dst[index[i]] = src[i] for every i < index.numel(); other rows of dst keep
// their values.
inline void scatter_rows(const Tensor& src, const Tensor& index, const Tensor& dst, const Stream& stream = {}) {
  detail::index_rows::run(src, index, dst, true, "scatter_rows", stream);
}

}  // namespace slime::ops
