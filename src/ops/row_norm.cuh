// src/ops/row_norm.cuh: private pieces shared by the row-normalisation kernels
// (rms_norm.cu, layer_norm.cu): the launch shapes and their choice by dim, the
// dtype and vector-width dispatch, the persistent grid, and the fixed-order
// column sum of the backward's per-block partial rows of the parameter
// gradients. Not installed; include it only from src/ops/*.cu.
//
// A row of `dim` elements is handled by a group of kGroup threads (a power of
// two; several groups share a block when kGroup < 256), each thread keeping
// kIters vectors of kVec elements of the row in registers. Blocks stride over
// the rows; the backward's grid is persistent (at most the blocks resident at
// once), each block writing one partial row per parameter gradient.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <type_traits>

#include "memops.cuh"
#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"
#include "slime/core/error.hpp"
#include "slime/core/half.hpp"

namespace slime::ops::detail::row_norm {

using memops::Vec;

// At most 2048 / 256 blocks of >= 256 threads are resident per SM, so the
// backward writes at most min(rows, 8 x SMs) partial rows of each parameter
// gradient.
constexpr int kMaxBlocksPerSm = 8;

template <int kGroup_, int kIters_>
struct Config {
  static constexpr int kGroup = kGroup_;  // threads per row
  static constexpr int kIters = kIters_;  // vectors per thread
  static constexpr int kBlock = kGroup >= 256 ? kGroup : 256;
  static constexpr int kRows = kBlock / kGroup;  // rows per block at a time
};

// ---- device helpers ----

// Column of vector `it` of lane `lane`: vectors interleave across the group so
// that a warp's accesses are contiguous.
template <int kGroup, int kVec>
__device__ __forceinline__ int64_t column(int it, int lane) {
  return (int64_t(it) * kGroup + lane) * kVec;
}

// This thread's vectors of a [dim] parameter, kept as stored (bf16 takes half
// the registers) and converted where used; zero past dim.
template <class W, int kVec, int kGroup, int kIters>
__device__ __forceinline__ void load_param(const W* p, int64_t dim, int lane, Vec<W, kVec> (&v)[kIters]) {
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int64_t col = column<kGroup, kVec>(it, lane);
    if (col < dim) {
      v[it] = memops::load_vec<W, kVec>(p + col);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) v[it].v[k] = W(0.f);
    }
  }
}

// grad_i[col] += sum over p of partials[i][p][col] for the kParams parameter
// gradients (grad_0 = dw, grad_1 = db; kParams = 1 or 2) at blockIdx.y = i,
// partials [kParams][parts][dim], in a fixed order: 8 slices of the partial
// rows (p = slice mod 8), each summed in increasing p, then the slices in
// order. A template so that each translation unit's copy is its own
// instantiation.
constexpr int kReduceCols = 32, kReduceSlices = 8;

template <int kParams>
__global__ void __launch_bounds__(kReduceCols* kReduceSlices)
    param_grad_reduce_kernel(const float* __restrict__ partials, int64_t parts, int64_t dim, float* __restrict__ dw,
                             float* __restrict__ db) {
  static_assert(kParams == 1 || kParams == 2, "param_grad_reduce_kernel: dw, or dw and db");
  __shared__ float sums[kReduceSlices][kReduceCols + 1];
  // With one gradient the grid is 1-d (blockIdx.y is not read).
  const float* in = kParams == 1 ? partials : partials + int64_t(blockIdx.y) * parts * dim;
  float* out = kParams == 1 || blockIdx.y == 0 ? dw : db;
  const int64_t col = int64_t(blockIdx.x) * kReduceCols + threadIdx.x;
  float s = 0.f;
  if (col < dim)
    for (int64_t p = threadIdx.y; p < parts; p += kReduceSlices) s += in[p * dim + col];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < dim) {
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < kReduceSlices; ++k) total += sums[k][threadIdx.x];
    out[col] += total;
  }
}

// ---- dispatch ----

// SMs of the current device (queried once per device). op names the caller in
// errors.
inline int sm_count(const char* op) {
  static std::array<int, 64> counts{};
  static std::array<std::once_flag, 64> once;
  int device = 0;
  SLIME_CUDA_CHECK(cudaGetDevice(&device));
  SLIME_CHECK(device >= 0 && device < 64, op, ": device index ", device, " out of range");
  std::call_once(once[std::size_t(device)], [&] {
    SLIME_CUDA_CHECK(cudaDeviceGetAttribute(&counts[std::size_t(device)], cudaDevAttrMultiProcessorCount, device));
  });
  return counts[std::size_t(device)];
}

// The most blocks any configuration runs for `rows` rows: min(rows,
// kMaxBlocksPerSm x SMs), the partial rows the backward's workspace holds per
// parameter gradient.
inline int64_t max_blocks(const char* op, int64_t rows) {
  return std::min<int64_t>(rows, int64_t(kMaxBlocksPerSm) * sm_count(op));
}

// The backward's workspace as its fp32 partial rows, once checked to hold
// `need` bytes, 4-byte aligned.
inline float* workspace_partials(const char* op, void* workspace, std::size_t bytes, std::size_t need) {
  SLIME_CHECK(workspace != nullptr && bytes >= need, op, ": workspace of ", bytes, " bytes, needs ", need);
  SLIME_CHECK(memops::aligned(workspace, sizeof(float)), op, ": workspace must be 4-byte aligned");
  return static_cast<float*>(workspace);
}

// Calls launch(Config<G, I>{}) with the smallest listed configuration whose
// capacity G * I * kVec covers dim: with 16-byte vectors (kVec = 8 for bf16,
// 4 for f32) up to 16384 (bf16) / 8192 (f32) columns; with kVec = 1 up to
// 8192 columns.
// The backward (kBackward) holds at most 8 elements of a row per thread (2
// vectors of f32, 1 of bf16; 2 of bf16 only past 8192 columns) under a
// 64-register cap: with 32 (dim 4096 at Config<128, 4>) rms_norm's fp32 x, dy
// and w values live across the row sum beside 32 dw accumulators did not fit
// in 128 registers and spilled.
template <int kVec, bool kBackward = false, class Launch>
void with_config(const char* op, int64_t dim, Launch&& launch) {
  auto fits = [dim](int g, int i) { return dim <= int64_t(g) * i * kVec; };
  if constexpr (kVec > 1 && kBackward) {
    constexpr int kI = kVec >= 8 ? 1 : 2;
    if (fits(16, kI)) return launch(Config<16, kI>{});
    if (fits(32, kI)) return launch(Config<32, kI>{});
    if (fits(64, kI)) return launch(Config<64, kI>{});
    if (fits(128, kI)) return launch(Config<128, kI>{});
    if (fits(256, kI)) return launch(Config<256, kI>{});
    if (fits(512, kI)) return launch(Config<512, kI>{});
    if (fits(1024, kI)) return launch(Config<1024, kI>{});
    if (fits(1024, 2)) return launch(Config<1024, 2>{});
    SLIME_FAIL(op, ": dim ", dim, " exceeds the GPU kernels' limit of ", 2048 * kVec, " for this dtype");
  } else if constexpr (kVec > 1) {
    // 128 threads per row from dim 2048 on, 4 vectors each at 4096 (as
    // TransformerEngine's tuned norms for bf16 hidden 4096): two rows per
    // 256-thread block, 64 bytes of x (and of dy) in flight per thread.
    if (fits(16, 1)) return launch(Config<16, 1>{});
    if (fits(32, 1)) return launch(Config<32, 1>{});
    if (fits(32, 2)) return launch(Config<32, 2>{});
    if (fits(64, 2)) return launch(Config<64, 2>{});
    if (fits(128, 2)) return launch(Config<128, 2>{});
    if (fits(128, 4)) return launch(Config<128, 4>{});
    if (fits(256, 4)) return launch(Config<256, 4>{});
    if (fits(512, 4)) return launch(Config<512, 4>{});
    SLIME_FAIL(op, ": dim ", dim, " exceeds the GPU kernels' limit of ", 2048 * kVec, " for this dtype");
  } else {
    if (fits(32, 4)) return launch(Config<32, 4>{});
    if (fits(128, 4)) return launch(Config<128, 4>{});
    if (fits(256, 8)) return launch(Config<256, 8>{});
    if (fits(1024, 8)) return launch(Config<1024, 8>{});
    SLIME_FAIL(op, ": dim ", dim,
               " exceeds the GPU kernels' limit of 8192 when it is not a multiple of 8 (bf16) "
               "or 4 (f32), or a pointer is not 16-byte aligned");
  }
}

// Calls f(T{}, W{}) for x's dtype T and the parameters' dtype W, each float
// or BFloat16.
template <class F>
void dispatch_types(const char* op, DType x_dtype, DType w_dtype, F&& f) {
  SLIME_CHECK(x_dtype == DType::f32 || x_dtype == DType::bf16, op, ": x must be f32 or bf16, got ",
              dtype_name(x_dtype));
  SLIME_CHECK(w_dtype == DType::f32 || w_dtype == DType::bf16, op, ": w must be f32 or bf16, got ",
              dtype_name(w_dtype));
  auto with_w = [&](auto t_tag) {
    if (w_dtype == DType::f32) {
      f(t_tag, float{});
    } else {
      f(t_tag, BFloat16{});
    }
  };
  if (x_dtype == DType::f32) {
    with_w(float{});
  } else {
    with_w(BFloat16{});
  }
}

// Whether 16 bytes of T per access suit these pointers: dim a multiple of the
// vector, the [rows, dim] activations 16-byte aligned, the [dim] parameters
// aligned to a vector of W.
template <class T, class W>
bool vectorizable(int64_t dim, std::initializer_list<const void*> act, std::initializer_list<const void*> params) {
  constexpr int kVec = 16 / sizeof(T);
  if (dim % kVec != 0) return false;
  for (const void* p : params)
    if (!memops::aligned(p, memops::vec_align(sizeof(W), kVec))) return false;
  for (const void* p : act)
    if (!memops::aligned(p, 16)) return false;
  return true;
}

// Calls launch(T{}, W{}, std::integral_constant<int, kVec>{}, Config<G, I>{})
// with the dtypes of x and of the parameters, the vector width these pointers
// allow (16 bytes of T, or 1) and the configuration with_config picks.
template <bool kBackward, class Launch>
void dispatch(const char* op, DType x_dtype, DType w_dtype, int64_t dim, std::initializer_list<const void*> act,
              std::initializer_list<const void*> params, Launch&& launch) {
  dispatch_types(op, x_dtype, w_dtype, [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    auto run = [&](auto vec_tag) {
      with_config<decltype(vec_tag)::value, kBackward>(op, dim, [&](auto cfg) { launch(t_tag, w_tag, vec_tag, cfg); });
    };
    if (vectorizable<T, W>(dim, act, params)) {
      run(std::integral_constant<int, 16 / sizeof(T)>{});
    } else {
      run(std::integral_constant<int, 1>{});
    }
  });
}

// Resident blocks per SM of `kernel` with `threads` threads.
template <class Kernel>
int64_t resident_blocks(Kernel kernel, int threads) {
  int n = 0;
  SLIME_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
  return std::clamp(n, 1, kMaxBlocksPerSm);
}

// Launches kKernel(args...) with C::kBlock threads on a grid over `rows`
// rows: one block per C::kRows rows, at most the blocks resident at once (the
// occupancy query runs once per kernel). Returns the grid's blocks.
template <auto kKernel, class C, class... Args>
int64_t launch_rows(const char* op, int64_t rows, StreamHandle stream, const Args&... args) {
  static const int64_t per_sm = resident_blocks(kKernel, C::kBlock);
  const int64_t blocks = std::min<int64_t>((rows + C::kRows - 1) / C::kRows, per_sm * sm_count(op));
  kKernel<<<unsigned(blocks), C::kBlock, 0, stream>>>(args...);
  SLIME_CUDA_CHECK_LAUNCH();
  return blocks;
}

// Adds the backward's partial rows, partials [kParams][parts][dim], into dw
// (kParams = 1) or dw and db (kParams = 2); see param_grad_reduce_kernel.
template <int kParams>
void reduce_param_grads(const float* partials, int64_t parts, int64_t dim, float* dw, float* db, StreamHandle stream) {
  const dim3 grid(unsigned((dim + kReduceCols - 1) / kReduceCols), kParams);
  param_grad_reduce_kernel<kParams>
      <<<grid, dim3(kReduceCols, kReduceSlices), 0, stream>>>(partials, parts, dim, dw, db);
  SLIME_CUDA_CHECK_LAUNCH();
}

}  // namespace slime::ops::detail::row_norm
