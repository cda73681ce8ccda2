// CUDA kernels of slime/ops/rms_norm.hpp.
//
// A row of `dim` elements is handled by a group of kGroup threads (a power of
// two; several groups share a block when kGroup < 256). Each thread keeps
// kIters vectors of kVec elements of the row in registers, so x (and dy) are
// read from memory once; the row sums are butterfly shuffles within a warp
// and, for groups wider than a warp, one shared-memory step. Blocks stride
// over the rows. The forward loads the weight into registers once per
// thread; the backward re-reads it (from L1) with each row's loads.
//
// Backward dw, deterministic: the backward runs a persistent grid of
// B = min(ceil(rows / rows_per_block), resident blocks per SM x SMs) blocks;
// block b visits the rows b, b + B, ... (in units of rows_per_block) in
// increasing order, sums dy * n per column in registers, combines its groups
// in shared memory in group order and writes one partial row of the
// workspace; a second kernel adds the B partial rows into dw in a fixed
// order. B depends on the shape, the dtypes, the pointers' alignment and the
// GPU model, so dw is the same bits run to run on one kind of GPU. (A fixed B
// independent of the GPU would leave a partial last wave of blocks.)
//
// Backward traffic (bf16 16384 x 4096 on 132 SMs): x, dy read and dx
// written, 3 x 2 x 16384 x 4096 = 402.7 MB (+ w, rstd, dw: 0.1 MB) + the dw
// partials, B x dim x 4 bytes written and read once: B = 264 blocks (2 of 512
// threads per SM), 2 x 4.3 MB = 8.7 MB; 411.4 MB in all.
// Each thread holds at most 8 elements of a row (Config<512, 1> at dim 4096:
// 61 registers, no spill, 1024 threads per SM) and issues every load of a row
// before the math (x, dy: LDG.E.128 from memory; w: LDG.E.128 from L1), so
// 32 KB of x and dy are in flight per SM (about 30 KB are needed to cover the
// memory latency at copy bandwidth).
// Measured: README's benchmark table and bench/RESULTS.md.
//
// Launch shapes (tuning as data): the smallest configuration whose capacity
// kGroup * kIters * kVec covers dim, from the lists in with_config()
// (row_norm.cuh, shared with layer_norm.cu). With 16-byte vectors (kVec = 8
// for bf16, 4 for f32) up to 16384 (bf16) / 8192 (f32) columns; without (dim
// not a multiple of kVec or a misaligned pointer) one element per access up
// to 8192 columns.
#include <cuda_bf16.h>

#include <cstdint>

#include "memops.cuh"
#include "ptx.cuh"
#include "row_norm.cuh"
#include "slime/core/half.hpp"
#include "slime/ops/cuda/rms_norm.hpp"

namespace slime::ops::cuda {
namespace {

using namespace ::slime::ops::detail::memops;
using namespace ::slime::ops::detail::row_norm;  // Config, column, load_param, dispatch, ...

// Sum of v over the kGroup threads of a group; every thread of the group
// gets the same bits. red: kBlock / 32 floats of shared memory.
template <int kGroup, int kBlock>
__device__ __forceinline__ float group_sum(float v, float* red) {
  v = ::slime::ops::detail::ptx::warp_sum<(kGroup < 32 ? kGroup : 32)>(v);
  if constexpr (kGroup <= 32) {
    return v;
  } else {
    constexpr int kWarps = kGroup / 32;  // per group
    const int warp = threadIdx.x / 32;
    __syncthreads();  // the previous call's reads of red are done
    if (threadIdx.x % 32 == 0) red[warp] = v;
    __syncthreads();
    const int first = warp / kWarps * kWarps;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += red[first + w];
    return s;
  }
}

template <class T, class W, int kVec, class C>
__global__ void __launch_bounds__(C::kBlock) rms_norm_forward_kernel(const RmsNormForwardArgs a) {
  constexpr int kGroup = C::kGroup, kIters = C::kIters, kBlock = C::kBlock, kRows = C::kRows;
  __shared__ float red[kBlock / 32];
  const int group = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  // No __restrict__: y may be x (in place).
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  const int64_t rows = a.rows, dim = a.dim;

  Vec<W, kVec> wv[kIters];
  load_param<W, kVec, kGroup, kIters>(static_cast<const W*>(a.w), dim, lane, wv);

  // The loop bound is uniform over the block (group_sum synchronises it).
  for (int64_t base = int64_t(blockIdx.x) * kRows; base < rows; base += int64_t(gridDim.x) * kRows) {
    const int64_t row = base + group;
    const bool valid = row < rows;
    Vec<T, kVec> xv[kIters];
    float ss = 0.f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int64_t col = column<kGroup, kVec>(it, lane);
      if (valid && col < dim) {
        xv[it] = load_vec<T, kVec>(x + row * dim + col);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float f = to_float(xv[it].v[k]);
          ss += f * f;
        }
      }
    }
    ss = group_sum<kGroup, kBlock>(ss, red);
    const float rs = 1.f / sqrtf(ss / float(dim) + a.eps);
    if (!valid) continue;
    if (lane == 0) a.rstd[row] = rs;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int64_t col = column<kGroup, kVec>(it, lane);
      if (col < dim) {
        Vec<T, kVec> yv;
#pragma unroll
        for (int k = 0; k < kVec; ++k) yv.v[k] = from_float<T>(to_float(xv[it].v[k]) * rs * to_float(wv[it].v[k]));
        store_vec<T, kVec>(y + row * dim + col, yv);
      }
    }
  }
}

// At least 1024 threads per SM (a 64-register cap): with loads of 2 x 2
// vectors per thread, 64 KB of x and dy in flight per SM.
template <class T, class W, int kVec, class C>
__global__ void __launch_bounds__(C::kBlock, C::kBlock < 1024 ? 1024 / C::kBlock : 1)
    rms_norm_backward_kernel(const RmsNormBackwardArgs a, float* partials) {
  constexpr int kGroup = C::kGroup, kIters = C::kIters, kBlock = C::kBlock, kRows = C::kRows;
  __shared__ float red[kBlock / 32];
  const int group = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  // No __restrict__: dx may be x or dy (in place).
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  const int64_t rows = a.rows, dim = a.dim;
  const float inv_dim = 1.f / float(dim);

  // The weight is re-read for every row (from L1: 2 x dim bytes or less)
  // rather than held: held, its fp32 conversions were hoisted out of the row
  // loop and spilled (84 bytes at dim 4096 under the 128-register cap).
  const W* w = static_cast<const W*>(a.w);
  float dw[kIters][kVec];
#pragma unroll
  for (int it = 0; it < kIters; ++it)
#pragma unroll
    for (int k = 0; k < kVec; ++k) dw[it][k] = 0.f;

  for (int64_t base = int64_t(blockIdx.x) * kRows; base < rows; base += int64_t(gridDim.x) * kRows) {
    const int64_t row = base + group;
    const bool valid = row < rows;
    // Every load of the row first, then the math: all 2 x kIters vectors of
    // x and dy are in flight at once (with the loads inside the math loop
    // they went out one pair at a time, a memory round trip per pair).
    Vec<T, kVec> xv[kIters], dyv[kIters];
    Vec<W, kVec> wv[kIters];
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int64_t col = column<kGroup, kVec>(it, lane);
      if (valid && col < dim) {
        xv[it] = load_vec<T, kVec>(x + row * dim + col);
        dyv[it] = load_vec<T, kVec>(dy + row * dim + col);
        wv[it] = load_vec<W, kVec>(w + col);
      }
    }
    const float rs = valid ? a.rstd[row] : 0.f;
    float dot = 0.f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int64_t col = column<kGroup, kVec>(it, lane);
      if (valid && col < dim) {
#pragma unroll
        for (int k = 0; k < kVec; ++k)
          dot += to_float(dyv[it].v[k]) * to_float(wv[it].v[k]) * (to_float(xv[it].v[k]) * rs);
      }
    }
    dot = group_sum<kGroup, kBlock>(dot, red);
    const float c = dot * inv_dim;
    if (!valid) continue;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int64_t col = column<kGroup, kVec>(it, lane);
      if (col < dim) {
        Vec<T, kVec> dxv;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float d = to_float(dyv[it].v[k]);
          const float n = to_float(xv[it].v[k]) * rs;
          dxv.v[k] = from_float<T>(rs * (d * to_float(wv[it].v[k]) - n * c));
          dw[it][k] += d * n;
        }
        store_vec<T, kVec>(dx + row * dim + col, dxv);
      }
    }
  }

  float* out = partials + int64_t(blockIdx.x) * dim;
  if constexpr (kRows == 1) {
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int64_t col = column<kGroup, kVec>(it, lane);
      if (col < dim)
#pragma unroll
        for (int k = 0; k < kVec; ++k) out[col + k] = dw[it][k];
    }
  } else {
    // The groups' sums, combined in group order.
    constexpr int kCap = kGroup * kIters * kVec;
    __shared__ float buf[kRows][kCap];
#pragma unroll
    for (int it = 0; it < kIters; ++it)
#pragma unroll
      for (int k = 0; k < kVec; ++k) buf[group][column<kGroup, kVec>(it, lane) + k] = dw[it][k];
    __syncthreads();
    for (int col = threadIdx.x; col < dim; col += kBlock) {
      float s = 0.f;
#pragma unroll
      for (int g = 0; g < kRows; ++g) s += buf[g][col];
      out[col] = s;
    }
  }
}

}  // namespace

void rms_norm_forward(const RmsNormForwardArgs& args, StreamHandle stream) {
  if (args.rows == 0) return;
  SLIME_CHECK(args.dim > 0, "rms_norm_forward: dim must be positive");
  dispatch<false>("rms_norm", args.x_dtype, args.w_dtype, args.dim, {args.x, args.y}, {args.w},
                  [&](auto t_tag, auto w_tag, auto vec_tag, auto cfg) {
                    using C = decltype(cfg);
                    constexpr auto kernel =
                        rms_norm_forward_kernel<decltype(t_tag), decltype(w_tag), decltype(vec_tag)::value, C>;
                    launch_rows<kernel, C>("rms_norm", args.rows, stream, args);
                  });
}

std::size_t rms_norm_backward_workspace_bytes(int64_t rows, int64_t dim) {
  // Every configuration runs at most max_blocks(rows) blocks.
  if (rows == 0 || dim == 0) return 0;
  return std::size_t(max_blocks("rms_norm", rows)) * std::size_t(dim) * sizeof(float);
}

void rms_norm_backward(const RmsNormBackwardArgs& args, StreamHandle stream) {
  if (args.rows == 0) return;
  SLIME_CHECK(args.dim > 0, "rms_norm_backward: dim must be positive");
  const std::size_t need = rms_norm_backward_workspace_bytes(args.rows, args.dim);
  float* partials = workspace_partials("rms_norm_backward", args.workspace, args.workspace_bytes, need);
  dispatch<true>("rms_norm", args.x_dtype, args.w_dtype, args.dim, {args.x, args.dy, args.dx}, {args.w},
                 [&](auto t_tag, auto w_tag, auto vec_tag, auto cfg) {
                   using C = decltype(cfg);
                   constexpr auto kernel =
                       rms_norm_backward_kernel<decltype(t_tag), decltype(w_tag), decltype(vec_tag)::value, C>;
                   const int64_t blocks = launch_rows<kernel, C>("rms_norm", args.rows, stream, args, partials);
                   reduce_param_grads<1>(partials, blocks, args.dim, args.dw, nullptr, stream);
                 });
}

}  // namespace slime::ops::cuda
