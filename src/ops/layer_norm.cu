// CUDA kernels of slime/ops/layer_norm.hpp.
//
// The layout of src/ops/rms_norm.cu (its header comment gives the reasons):
// a row of `dim` elements is handled by a group of kGroup threads (a power of
// two; several groups share a block when kGroup < 256), each thread keeping
// kIters vectors of kVec elements of the row in registers, so x (and dy) are
// read from memory once; row sums are butterfly shuffles within a warp and,
// for groups wider than a warp, one shared-memory step. Blocks stride over
// the rows.
//
// Forward: two row sums over the registers, the mean first, then the sum of
// squared deviations from it (the biased variance, as torch.nn.LayerNorm;
// from registers the second pass costs no memory traffic and does not cancel
// the way E[x^2] - mean^2 does). Weight and bias are loaded into registers
// once per thread.
// Backward: one row sum of two values (sum g and sum g * n, g = dy * w,
// n = (x - mean) * rstd); the weight is re-read (from L1) with each row's
// loads, as in rms_norm's backward.
//
// Backward dw and db, deterministic: a persistent grid of
// B = min(ceil(rows / rows_per_block), resident blocks per SM x SMs) blocks;
// block b visits the rows b, b + B, ... (in units of rows_per_block) in
// increasing order, sums dy * n and dy per column in registers, combines its
// groups in shared memory in group order and writes one partial row of dw and
// one of db into the workspace ([2][B][dim] fp32); a second kernel adds the B
// partial rows of each into dw and db in a fixed order. B depends on the
// shape, the dtypes, the pointers' alignment and the GPU model, so dw and db
// are the same bits run to run on one kind of GPU.
//
// Traffic (bf16, rows x dim): forward reads x, writes y: 4 x rows x dim bytes
// (+ w, b, mean, rstd); backward reads x, dy, writes dx: 6 x rows x dim bytes
// (+ w, mean, rstd, dw, db) + the partials, 2 x B x dim x 4 bytes written and
// read once.
//
// Launch shapes (tuning as data): the smallest configuration whose capacity
// kGroup * kIters * kVec covers dim, from the lists in with_config()
// (row_norm.cuh, shared with rms_norm.cu). With 16-byte vectors (kVec = 8 for
// bf16, 4 for f32) up to 16384 (bf16) / 8192 (f32) columns; without (dim not
// a multiple of kVec or a misaligned pointer) one element per access up to
// 8192 columns.
// Benchmark: bench/bench_vision_ops.cu beside bench/torch_vision_ops.py.
#include <cuda_bf16.h>

#include <cstdint>

#include "memops.cuh"
#include "ptx.cuh"
#include "row_norm.cuh"
#include "slime/core/half.hpp"
#include "slime/ops/cuda/layer_norm.hpp"

namespace slime::ops::cuda {
namespace {

using namespace ::slime::ops::detail::memops;
using namespace ::slime::ops::detail::row_norm;  // Config, column, load_param, dispatch, ...

// Sums of a and b over the kGroup threads of a group; every thread of the
// group gets the same bits. red: kBlock / 32 float2 of shared memory. With
// kOne, only a is summed (b is returned as given).
template <int kGroup, int kBlock, bool kOne = false>
__device__ __forceinline__ float2 group_sum(float a, float b, float2* red) {
  constexpr int kWidth = kGroup < 32 ? kGroup : 32;
  a = ::slime::ops::detail::ptx::warp_sum<kWidth>(a);
  if constexpr (!kOne) b = ::slime::ops::detail::ptx::warp_sum<kWidth>(b);
  if constexpr (kGroup <= 32) {
    return make_float2(a, b);
  } else {
    constexpr int kWarps = kGroup / 32;  // per group
    const int warp = threadIdx.x / 32;
    __syncthreads();  // the previous call's reads of red are done
    if (threadIdx.x % 32 == 0) red[warp] = make_float2(a, b);
    __syncthreads();
    const int first = warp / kWarps * kWarps;
    float sa = 0.f, sb = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      sa += red[first + w].x;
      if constexpr (!kOne) sb += red[first + w].y;
    }
    return make_float2(sa, kOne ? b : sb);
  }
}

template <class T, class W, int kVec, class C>
__global__ void __launch_bounds__(C::kBlock) layer_norm_forward_kernel(const LayerNormForwardArgs a) {
  constexpr int kGroup = C::kGroup, kIters = C::kIters, kBlock = C::kBlock, kRows = C::kRows;
  __shared__ float2 red[kBlock / 32];
  const int group = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  // No __restrict__: y may be x (in place).
  const T* x = static_cast<const T*>(a.x);
  T* y = static_cast<T*>(a.y);
  const int64_t rows = a.rows, dim = a.dim;
  const float inv_dim = 1.f / float(dim);

  Vec<W, kVec> wv[kIters], bv[kIters];
  load_param<W, kVec, kGroup, kIters>(static_cast<const W*>(a.w), dim, lane, wv);
  load_param<W, kVec, kGroup, kIters>(static_cast<const W*>(a.b), dim, lane, bv);

  // The loop bound is uniform over the block (group_sum synchronises it).
  for (int64_t base = int64_t(blockIdx.x) * kRows; base < rows; base += int64_t(gridDim.x) * kRows) {
    const int64_t row = base + group;
    const bool valid = row < rows;
    Vec<T, kVec> xv[kIters];
    float s = 0.f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int64_t col = column<kGroup, kVec>(it, lane);
      if (valid && col < dim) {
        xv[it] = load_vec<T, kVec>(x + row * dim + col);
#pragma unroll
        for (int k = 0; k < kVec; ++k) s += to_float(xv[it].v[k]);
      }
    }
    const float mu = group_sum<kGroup, kBlock, true>(s, 0.f, red).x * inv_dim;
    float ss = 0.f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int64_t col = column<kGroup, kVec>(it, lane);
      if (valid && col < dim) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float c = to_float(xv[it].v[k]) - mu;
          ss += c * c;
        }
      }
    }
    ss = group_sum<kGroup, kBlock, true>(ss, 0.f, red).x;
    const float rs = 1.f / sqrtf(ss * inv_dim + a.eps);
    if (!valid) continue;
    if (lane == 0) {
      a.mean[row] = mu;
      a.rstd[row] = rs;
    }
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int64_t col = column<kGroup, kVec>(it, lane);
      if (col < dim) {
        Vec<T, kVec> yv;
#pragma unroll
        for (int k = 0; k < kVec; ++k)
          yv.v[k] = from_float<T>((to_float(xv[it].v[k]) - mu) * rs * to_float(wv[it].v[k]) + to_float(bv[it].v[k]));
        store_vec<T, kVec>(y + row * dim + col, yv);
      }
    }
  }
}

// At least 1024 threads per SM (a 64-register cap), as rms_norm's backward.
// Up to 8 elements of a row per thread (every configuration the vision
// tower's widths 1024 .. 4096 take) fit without spilling; Config<1024, 2>
// (bf16 past 8192 columns, 16 elements) spills about 400 bytes per thread.
template <class T, class W, int kVec, class C>
__global__ void __launch_bounds__(C::kBlock, C::kBlock < 1024 ? 1024 / C::kBlock : 1)
    layer_norm_backward_kernel(const LayerNormBackwardArgs a, float* partials) {
  constexpr int kGroup = C::kGroup, kIters = C::kIters, kBlock = C::kBlock, kRows = C::kRows;
  __shared__ float2 red[kBlock / 32];
  const int group = threadIdx.x / kGroup, lane = threadIdx.x % kGroup;
  // No __restrict__: dx may be x or dy (in place).
  const T* x = static_cast<const T*>(a.x);
  const T* dy = static_cast<const T*>(a.dy);
  T* dx = static_cast<T*>(a.dx);
  const W* w = static_cast<const W*>(a.w);
  const int64_t rows = a.rows, dim = a.dim;
  const float inv_dim = 1.f / float(dim);

  float dw[kIters][kVec], db[kIters][kVec];
#pragma unroll
  for (int it = 0; it < kIters; ++it)
#pragma unroll
    for (int k = 0; k < kVec; ++k) dw[it][k] = db[it][k] = 0.f;

  for (int64_t base = int64_t(blockIdx.x) * kRows; base < rows; base += int64_t(gridDim.x) * kRows) {
    const int64_t row = base + group;
    const bool valid = row < rows;
    // Every load of the row first, then the math (all vectors in flight).
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
    const float mu = valid ? a.mean[row] : 0.f;
    const float rs = valid ? a.rstd[row] : 0.f;
    float sg = 0.f, sgn = 0.f;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int64_t col = column<kGroup, kVec>(it, lane);
      if (valid && col < dim) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float g = to_float(dyv[it].v[k]) * to_float(wv[it].v[k]);
          sg += g;
          sgn += g * ((to_float(xv[it].v[k]) - mu) * rs);
        }
      }
    }
    const float2 sums = group_sum<kGroup, kBlock>(sg, sgn, red);
    const float c1 = sums.x * inv_dim, c2 = sums.y * inv_dim;
    if (!valid) continue;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int64_t col = column<kGroup, kVec>(it, lane);
      if (col < dim) {
        Vec<T, kVec> dxv;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float d = to_float(dyv[it].v[k]);
          const float n = (to_float(xv[it].v[k]) - mu) * rs;
          dxv.v[k] = from_float<T>(rs * (d * to_float(wv[it].v[k]) - c1 - n * c2));
          dw[it][k] += d * n;
          db[it][k] += d;
        }
        store_vec<T, kVec>(dx + row * dim + col, dxv);
      }
    }
  }

  // partials [2][gridDim.x][dim]: dw's rows, then db's.
  float* out_w = partials + int64_t(blockIdx.x) * dim;
  float* out_b = partials + (int64_t(gridDim.x) + blockIdx.x) * dim;
  if constexpr (kRows == 1) {
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int64_t col = column<kGroup, kVec>(it, lane);
      if (col < dim)
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          out_w[col + k] = dw[it][k];
          out_b[col + k] = db[it][k];
        }
    }
  } else {
    // The groups' sums, combined in group order.
    constexpr int kCap = kGroup * kIters * kVec;
    __shared__ float buf[2][kRows][kCap];
#pragma unroll
    for (int it = 0; it < kIters; ++it)
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        buf[0][group][column<kGroup, kVec>(it, lane) + k] = dw[it][k];
        buf[1][group][column<kGroup, kVec>(it, lane) + k] = db[it][k];
      }
    __syncthreads();
    for (int col = threadIdx.x; col < dim; col += kBlock) {
      float sw = 0.f, sb = 0.f;
#pragma unroll
      for (int g = 0; g < kRows; ++g) {
        sw += buf[0][g][col];
        sb += buf[1][g][col];
      }
      out_w[col] = sw;
      out_b[col] = sb;
    }
  }
}

}  // namespace

void layer_norm_forward(const LayerNormForwardArgs& args, StreamHandle stream) {
  if (args.rows == 0) return;
  SLIME_CHECK(args.dim > 0, "layer_norm_forward: dim must be positive");
  dispatch<false>("layer_norm", args.x_dtype, args.w_dtype, args.dim, {args.x, args.y}, {args.w, args.b},
                  [&](auto t_tag, auto w_tag, auto vec_tag, auto cfg) {
                    using C = decltype(cfg);
                    constexpr auto kernel =
                        layer_norm_forward_kernel<decltype(t_tag), decltype(w_tag), decltype(vec_tag)::value, C>;
                    launch_rows<kernel, C>("layer_norm", args.rows, stream, args);
                  });
}

std::size_t layer_norm_backward_workspace_bytes(int64_t rows, int64_t dim) {
  // Every configuration runs at most max_blocks(rows) blocks; [2][blocks][dim].
  if (rows == 0 || dim == 0) return 0;
  return 2 * std::size_t(max_blocks("layer_norm", rows)) * std::size_t(dim) * sizeof(float);
}

void layer_norm_backward(const LayerNormBackwardArgs& args, StreamHandle stream) {
  if (args.rows == 0) return;
  SLIME_CHECK(args.dim > 0, "layer_norm_backward: dim must be positive");
  const std::size_t need = layer_norm_backward_workspace_bytes(args.rows, args.dim);
  float* partials = workspace_partials("layer_norm_backward", args.workspace, args.workspace_bytes, need);
  dispatch<true>("layer_norm", args.x_dtype, args.w_dtype, args.dim, {args.x, args.dy, args.dx}, {args.w},
                 [&](auto t_tag, auto w_tag, auto vec_tag, auto cfg) {
                   using C = decltype(cfg);
                   constexpr auto kernel =
                       layer_norm_backward_kernel<decltype(t_tag), decltype(w_tag), decltype(vec_tag)::value, C>;
                   const int64_t blocks = launch_rows<kernel, C>("layer_norm", args.rows, stream, args, partials);
                   reduce_param_grads<2>(partials, blocks, args.dim, args.dw, args.db, stream);
                 });
}

}  // namespace slime::ops::cuda
