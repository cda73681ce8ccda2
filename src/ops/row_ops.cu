// CUDA kernels of slime/ops/row_ops.hpp.
//
// Every kernel moves 16-byte vectors of a row (kVec = 8 for bf16, 4 for f32)
// when the row length is a multiple of kVec and the pointers allow it, else
// one element per access. Rows are split over 2-d blocks: threadIdx.x over
// the vectors of a row (32 lanes: a warp reads 512 contiguous bytes of bf16),
// threadIdx.y over rows.
//
// bias_add: each thread keeps its bias vector in registers and strides over
// rows, loading kUnroll rows before storing any. Traffic: read and write y,
// 2 x rows x n x sizeof(T) bytes (+ the bias).
// bias_backward, deterministic: pass 1, a (column tile, chunk of rows) block
// per BiasBackwardPolicy: each row lane sums its rows of the chunk (increasing
// rows, stride kThreadsY) in fp32 registers; the lanes are added in lane order
// in shared memory into the chunk's partial row [chunks, n] of the workspace.
// Pass 2 adds the partial rows of each column in a fixed order into db
// (row_norm.cuh's param_grad_reduce_kernel, shared with the norms' weight
// gradients; db zeroed first unless accumulating). Traffic: read dy (rows x n x sizeof(T)); the partials,
// chunks x n x 4 bytes, are written and read once (2 MiB at 16384 x 4096).
// pos_embed_interpolate_forward: one patch per row lane; the 4 ids and weights
// are the same for the 32 lanes of a row (one broadcast load each); the 4
// table rows (a 2304 x 1024 bf16 table is 4.5 MiB: L2-resident) are loaded
// before the fmaf chain in k order. Traffic: write out (read it too when
// accumulating), 4 gathered table rows per patch.
// pos_embed_interpolate_backward: one block row (blockIdx.y) per table row,
// threads over its vectors; each thread walks the row's taps in the CSR
// order, kUnroll taps loaded at a time, fmaf into fp32 registers, then adds
// the sums to d_table once. No element has two writers, so no atomics. Each
// d_out row is read by its 4 taps' blocks (4 x P x D x sizeof(T) bytes; the
// neighbouring table rows that share patches run close together, so most of
// it comes from L2).
// Benchmark: bench/bench_row_ops.cu beside bench/torch_row_ops.py.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>

#include "memops.cuh"
#include "row_norm.cuh"
#include "slime/core/half.hpp"
#include "slime/ops/cuda/row_ops.hpp"

namespace slime::ops::cuda {
namespace {

using namespace ::slime::ops::detail::memops;

constexpr int kThreadsX = BiasBackwardPolicy::kThreadsX;  // vectors of a row per block
constexpr int kThreadsY = BiasBackwardPolicy::kThreadsY;  // rows per block at a time
constexpr int kUnroll = 4;                                // rows (taps) in flight per thread
// bias_add's grid: about this many blocks (two waves of 8 resident 256-thread
// blocks on 132 SMs), each thread striding over the rest of the rows.
constexpr int64_t kBiasAddBlocks = 2048;
constexpr int kBackwardThreads = 128;  // pos_embed backward: vectors of a table row per block
constexpr int64_t kMaxGridY = 65535;

// ---- bias_add ----

template <class T, int kVec>
__global__ void __launch_bounds__(kThreadsX* kThreadsY)
    bias_add_kernel(T* __restrict__ y, const T* __restrict__ b, int64_t rows, int64_t vectors_per_row) {
  const int64_t v = int64_t(blockIdx.x) * kThreadsX + threadIdx.x;
  if (v >= vectors_per_row) return;
  const int64_t n = vectors_per_row * kVec;
  const Vec<T, kVec> bv = load_vec<T, kVec>(b, v);
  float bf[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) bf[k] = to_float(bv.v[k]);
  const int64_t stride = int64_t(gridDim.y) * kThreadsY;
  int64_t r = int64_t(blockIdx.y) * kThreadsY + threadIdx.y;
  for (; r + (kUnroll - 1) * stride < rows; r += kUnroll * stride) {
    Vec<T, kVec> yv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) yv[u] = load_vec<T, kVec>(y + (r + u * stride) * n, v);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) yv[u].v[k] = from_float<T>(to_float(yv[u].v[k]) + bf[k]);
      store_vec<T, kVec>(y + (r + u * stride) * n, v, yv[u]);
    }
  }
  for (; r < rows; r += stride) {
    Vec<T, kVec> yv = load_vec<T, kVec>(y + r * n, v);
#pragma unroll
    for (int k = 0; k < kVec; ++k) yv.v[k] = from_float<T>(to_float(yv.v[k]) + bf[k]);
    store_vec<T, kVec>(y + r * n, v, yv);
  }
}

// ---- bias_backward ----

// partials[chunk, col] = sum over the chunk's rows of dy[row, col]; grid
// (column tiles, chunks).
template <class T, int kVec>
__global__ void __launch_bounds__(kThreadsX* kThreadsY)
    bias_grad_partial_kernel(const T* __restrict__ dy, int64_t rows, int64_t vectors_per_row, int64_t chunk_rows,
                             float* __restrict__ partials) {
  constexpr int kTileCols = kThreadsX * kVec;
  __shared__ float lanes[kThreadsY][kTileCols];
  const int64_t n = vectors_per_row * kVec;
  const int64_t v = int64_t(blockIdx.x) * kThreadsX + threadIdx.x;
  const bool valid = v < vectors_per_row;
  const int64_t begin = int64_t(blockIdx.y) * chunk_rows;
  const int64_t end = std::min(rows, begin + chunk_rows);
  float acc[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) acc[k] = 0.f;
  if (valid) {
    int64_t r = begin + threadIdx.y;
    for (; r + (kUnroll - 1) * kThreadsY < end; r += kUnroll * kThreadsY) {
      Vec<T, kVec> d[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) d[u] = load_vec<T, kVec>(dy + (r + u * kThreadsY) * n, v);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int k = 0; k < kVec; ++k) acc[k] += to_float(d[u].v[k]);
    }
    for (; r < end; r += kThreadsY) {
      const Vec<T, kVec> d = load_vec<T, kVec>(dy + r * n, v);
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc[k] += to_float(d.v[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) lanes[threadIdx.y][threadIdx.x * kVec + k] = acc[k];
  __syncthreads();
  const int64_t col0 = int64_t(blockIdx.x) * kTileCols;
  for (int c = threadIdx.y * kThreadsX + threadIdx.x; c < kTileCols; c += kThreadsX * kThreadsY) {
    if (col0 + c >= n) break;
    float s = 0.f;
#pragma unroll
    for (int lane = 0; lane < kThreadsY; ++lane) s += lanes[lane][c];
    partials[int64_t(blockIdx.y) * n + col0 + c] = s;
  }
}

// ---- pos_embed_interpolate ----

template <class T, int kVec>
__global__ void __launch_bounds__(kThreadsX* kThreadsY)
    pos_embed_forward_kernel(const T* __restrict__ table, const int32_t* __restrict__ ids,
                             const float* __restrict__ weights, T* __restrict__ out, int64_t table_rows,
                             int64_t vectors_per_row, int64_t patches, bool accumulate) {
  const int64_t v = int64_t(blockIdx.x) * kThreadsX + threadIdx.x;
  if (v >= vectors_per_row) return;
  const int64_t dim = vectors_per_row * kVec;
  for (int64_t p = int64_t(blockIdx.y) * kThreadsY + threadIdx.y; p < patches; p += int64_t(gridDim.y) * kThreadsY) {
    int32_t id[4];
    float w[4];
    bool bad = false;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      id[k] = ids[k * patches + p];
      w[k] = weights[k * patches + p];
      bad |= id[k] < 0 || id[k] >= table_rows;
    }
    Vec<T, kVec> o;
    if (bad) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) o.v[k] = all_ones<T>();
    } else {
      Vec<T, kVec> t[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) t[k] = load_vec<T, kVec>(table + int64_t(id[k]) * dim, v);
      float acc[kVec];
      if (accumulate) {
        const Vec<T, kVec> prev = load_vec<T, kVec>(out + p * dim, v);
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] = to_float(prev.v[e]);
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
      }
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] = fmaf(w[k], to_float(t[k].v[e]), acc[e]);
#pragma unroll
      for (int e = 0; e < kVec; ++e) o.v[e] = from_float<T>(acc[e]);
    }
    store_vec<T, kVec>(out + p * dim, v, o);
  }
}

// grid (column tiles, min(S, 65535)): blockIdx.y strides over the table rows.
template <class T, int kVec>
__global__ void __launch_bounds__(kBackwardThreads)
    pos_embed_backward_kernel(const T* __restrict__ d_out, const float* __restrict__ weights,
                              const int32_t* __restrict__ row_offsets, const int32_t* __restrict__ row_taps,
                              float* __restrict__ d_table, int64_t table_rows, int64_t vectors_per_row,
                              int32_t patches) {
  const int64_t v = int64_t(blockIdx.x) * kBackwardThreads + threadIdx.x;
  if (v >= vectors_per_row) return;
  const int64_t dim = vectors_per_row * kVec;
  for (int64_t s = blockIdx.y; s < table_rows; s += gridDim.y) {
    const int32_t begin = row_offsets[s], end = row_offsets[s + 1];
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.f;
    int32_t i = begin;
    for (; i + kUnroll <= end; i += kUnroll) {
      float w[kUnroll];
      Vec<T, kVec> d[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int32_t t = row_taps[i + u];
        w[u] = weights[t];
        d[u] = load_vec<T, kVec>(d_out + int64_t(t % patches) * dim, v);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] = fmaf(w[u], to_float(d[u].v[e]), acc[e]);
    }
    for (; i < end; ++i) {
      const int32_t t = row_taps[i];
      const float w = weights[t];
      const Vec<T, kVec> d = load_vec<T, kVec>(d_out + int64_t(t % patches) * dim, v);
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] = fmaf(w, to_float(d.v[e]), acc[e]);
    }
    Vec<float, kVec> g = load_vec<float, kVec>(d_table + s * dim, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) g.v[e] += acc[e];
    store_vec<float, kVec>(d_table + s * dim, v, g);
  }
}

// Calls f(T{}) for f32 or bf16.
template <class F>
void visit_dtype(const char* op, DType dtype, F&& f) {
  if (dtype == DType::f32) {
    f(float{});
  } else {
    SLIME_CHECK(dtype == DType::bf16, op, ": dtype must be f32 or bf16, got ", dtype_name(dtype));
    f(BFloat16{});
  }
}

// Calls f(std::integral_constant<int, kVec>{}): 16 bytes of T per access when
// n is a multiple of the vector and every pointer is 16-byte aligned, else 1.
template <class T, class F>
void visit_vec(int64_t n, std::initializer_list<const void*> ptrs, F&& f) {
  constexpr int kVec = 16 / sizeof(T);
  bool ok = n % kVec == 0;
  for (const void* p : ptrs) ok = ok && aligned(p, 16);
  if (ok) {
    f(std::integral_constant<int, kVec>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

}  // namespace

void bias_add(const BiasAddArgs& a, StreamHandle stream) {
  if (a.rows == 0 || a.n == 0) return;
  visit_dtype("bias_add", a.dtype, [&](auto tag) {
    using T = decltype(tag);
    visit_vec<T>(a.n, {a.y, a.b}, [&](auto vec_tag) {
      constexpr int kVec = decltype(vec_tag)::value;
      const int64_t vpr = a.n / kVec;
      const int64_t gx = (vpr + kThreadsX - 1) / kThreadsX;
      const int64_t gy =
          std::clamp<int64_t>(std::min((a.rows + kThreadsY - 1) / kThreadsY, kBiasAddBlocks / gx), 1, kMaxGridY);
      bias_add_kernel<T, kVec><<<dim3(unsigned(gx), unsigned(gy)), dim3(kThreadsX, kThreadsY), 0, stream>>>(
          static_cast<T*>(a.y), static_cast<const T*>(a.b), a.rows, vpr);
      SLIME_CUDA_CHECK_LAUNCH();
    });
  });
}

void bias_backward(const BiasBackwardArgs& a, StreamHandle stream) {
  if (a.n == 0) return;
  if (a.rows == 0) {
    if (!a.accumulate) SLIME_CUDA_CHECK(cudaMemsetAsync(a.db, 0, std::size_t(a.n) * sizeof(float), stream));
    return;
  }
  const std::size_t need = BiasBackwardPolicy::workspace_bytes(a.rows, a.n);
  SLIME_CHECK(a.workspace != nullptr && a.workspace_bytes >= need, "bias_backward: workspace of ", a.workspace_bytes,
              " bytes, needs ", need);
  SLIME_CHECK(aligned(a.workspace, sizeof(float)), "bias_backward: workspace must be 4-byte aligned");
  float* partials = static_cast<float*>(a.workspace);
  const int64_t chunks = BiasBackwardPolicy::chunks(a.rows), chunk_rows = BiasBackwardPolicy::chunk_rows(a.rows);
  SLIME_CHECK(chunks <= kMaxGridY, "bias_backward: ", chunks, " row chunks exceed the grid");
  visit_dtype("bias_backward", a.dtype, [&](auto tag) {
    using T = decltype(tag);
    visit_vec<T>(a.n, {a.dy}, [&](auto vec_tag) {
      constexpr int kVec = decltype(vec_tag)::value;
      const int64_t vpr = a.n / kVec;
      const int64_t gx = (vpr + kThreadsX - 1) / kThreadsX;
      bias_grad_partial_kernel<T, kVec>
          <<<dim3(unsigned(gx), unsigned(chunks)), dim3(kThreadsX, kThreadsY), 0, stream>>>(
              static_cast<const T*>(a.dy), a.rows, vpr, chunk_rows, partials);
      SLIME_CUDA_CHECK_LAUNCH();
    });
  });
  if (!a.accumulate) SLIME_CUDA_CHECK(cudaMemsetAsync(a.db, 0, std::size_t(a.n) * sizeof(float), stream));
  ::slime::ops::detail::row_norm::reduce_param_grads<1>(partials, chunks, a.n, a.db, nullptr, stream);
}

void pos_embed_interpolate_forward(const PosEmbedForwardArgs& a, StreamHandle stream) {
  if (a.patches == 0 || a.dim == 0) return;
  visit_dtype("pos_embed_interpolate_forward", a.dtype, [&](auto tag) {
    using T = decltype(tag);
    visit_vec<T>(a.dim, {a.table, a.out}, [&](auto vec_tag) {
      constexpr int kVec = decltype(vec_tag)::value;
      const int64_t vpr = a.dim / kVec;
      const int64_t gx = (vpr + kThreadsX - 1) / kThreadsX;
      const int64_t gy = std::min((a.patches + kThreadsY - 1) / kThreadsY, kMaxGridY);
      pos_embed_forward_kernel<T, kVec><<<dim3(unsigned(gx), unsigned(gy)), dim3(kThreadsX, kThreadsY), 0, stream>>>(
          static_cast<const T*>(a.table), a.ids, a.weights, static_cast<T*>(a.out), a.table_rows, vpr, a.patches,
          a.accumulate);
      SLIME_CUDA_CHECK_LAUNCH();
    });
  });
}

void pos_embed_interpolate_backward(const PosEmbedBackwardArgs& a, StreamHandle stream) {
  if (a.table_rows == 0 || a.dim == 0) return;
  SLIME_CHECK(a.patches * 4 <= std::numeric_limits<int32_t>::max(), "pos_embed_interpolate_backward: ", a.patches,
              " patches exceed the i32 tap index");
  visit_dtype("pos_embed_interpolate_backward", a.dtype, [&](auto tag) {
    using T = decltype(tag);
    visit_vec<T>(a.dim, {a.d_out, a.d_table}, [&](auto vec_tag) {
      constexpr int kVec = decltype(vec_tag)::value;
      const int64_t vpr = a.dim / kVec;
      const int64_t gx = (vpr + kBackwardThreads - 1) / kBackwardThreads;
      const int64_t gy = std::min(a.table_rows, kMaxGridY);
      // patches = 0 leaves every row without taps (t % patches is never taken).
      pos_embed_backward_kernel<T, kVec><<<dim3(unsigned(gx), unsigned(gy)), kBackwardThreads, 0, stream>>>(
          static_cast<const T*>(a.d_out), a.weights, a.row_offsets, a.row_taps, a.d_table, a.table_rows, vpr,
          int32_t(std::max<int64_t>(a.patches, 1)));
      SLIME_CUDA_CHECK_LAUNCH();
    });
  });
}

}  // namespace slime::ops::cuda
