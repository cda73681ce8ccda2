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
// kGroup * kIters * kVec covers dim, from the list in with_config(). With
// 16-byte vectors (kVec = 8 for bf16, 4 for f32) up to 16384 (bf16) / 8192
// (f32) columns; without (dim not a multiple of kVec or a misaligned
// pointer) one element per access up to 8192 columns.
#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>

#include "memops.cuh"
#include "ptx.cuh"
#include "slime/core/half.hpp"
#include "slime/ops/cuda/rms_norm.hpp"

namespace slime::ops::cuda {
namespace {

using namespace ::slime::ops::detail::memops;

// At most 2048 / 256 blocks of >= 256 threads are resident per SM, so the
// backward writes at most min(rows, 8 x SMs) partial rows of dw.
constexpr int kMaxBlocksPerSm = 8;

template <int kGroup_, int kIters_>
struct Config {
  static constexpr int kGroup = kGroup_;  // threads per row
  static constexpr int kIters = kIters_;  // vectors per thread
  static constexpr int kBlock = kGroup >= 256 ? kGroup : 256;
  static constexpr int kRows = kBlock / kGroup;  // rows per block at a time
};

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

// Column of vector `it` of lane `lane`: vectors interleave across the group so
// that a warp's accesses are contiguous.
template <int kGroup, int kVec>
__device__ __forceinline__ int64_t column(int it, int lane) {
  return (int64_t(it) * kGroup + lane) * kVec;
}

// This thread's weight vectors, kept as stored (bf16 weights take half the
// registers) and converted where used; zero past dim.
template <class W, int kVec, int kGroup, int kIters>
__device__ __forceinline__ void load_weight(const W* w, int64_t dim, int lane, Vec<W, kVec> (&wv)[kIters]) {
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int64_t col = column<kGroup, kVec>(it, lane);
    if (col < dim) {
      wv[it] = load_vec<W, kVec>(w + col);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) wv[it].v[k] = W(0.f);
    }
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
  load_weight<W, kVec, kGroup, kIters>(static_cast<const W*>(a.w), dim, lane, wv);

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

// dw[col] += sum over p of partials[p, col], in a fixed order: 8 slices of
// the partial rows (p = slice mod 8), each summed in increasing p, then the
// slices in order.
constexpr int kReduceCols = 32, kReduceSlices = 8;

__global__ void __launch_bounds__(kReduceCols* kReduceSlices)
    dw_reduce_kernel(const float* __restrict__ partials, int64_t parts, int64_t dim, float* __restrict__ dw) {
  __shared__ float sums[kReduceSlices][kReduceCols + 1];
  const int64_t col = int64_t(blockIdx.x) * kReduceCols + threadIdx.x;
  float s = 0.f;
  if (col < dim)
    for (int64_t p = threadIdx.y; p < parts; p += kReduceSlices) s += partials[p * dim + col];
  sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < dim) {
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < kReduceSlices; ++k) total += sums[k][threadIdx.x];
    dw[col] += total;
  }
}

// ---- dispatch ----

int sm_count() {
  static std::array<int, 64> counts{};
  static std::array<std::once_flag, 64> once;
  int device = 0;
  SLIME_CUDA_CHECK(cudaGetDevice(&device));
  SLIME_CHECK(device >= 0 && device < 64, "rms_norm: device index ", device, " out of range");
  std::call_once(once[std::size_t(device)], [&] {
    SLIME_CUDA_CHECK(cudaDeviceGetAttribute(&counts[std::size_t(device)], cudaDevAttrMultiProcessorCount, device));
  });
  return counts[std::size_t(device)];
}

// Calls launch(Config<G, I>{}) with the smallest listed configuration whose
// capacity G * I * kVec covers dim.
// The backward (kBackward) holds at most 8 elements of a row per thread (2
// vectors of f32, 1 of bf16; 2 of bf16 only past 8192 columns) under a
// 64-register cap: with 32 (dim 4096 at Config<128, 4>) the fp32 x, dy and w
// values live across the row sum beside 32 dw accumulators did not fit in
// 128 registers and spilled.
template <int kVec, bool kBackward = false, class Launch>
void with_config(int64_t dim, Launch&& launch) {
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
    SLIME_FAIL("rms_norm: dim ", dim, " exceeds the GPU kernels' limit of ", 2048 * kVec, " for this dtype");
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
    SLIME_FAIL("rms_norm: dim ", dim, " exceeds the GPU kernels' limit of ", 2048 * kVec, " for this dtype");
  } else {
    if (fits(32, 4)) return launch(Config<32, 4>{});
    if (fits(128, 4)) return launch(Config<128, 4>{});
    if (fits(256, 8)) return launch(Config<256, 8>{});
    if (fits(1024, 8)) return launch(Config<1024, 8>{});
    SLIME_FAIL("rms_norm: dim ", dim,
               " exceeds the GPU kernels' limit of 8192 when it is not a multiple of 8 (bf16) "
               "or 4 (f32), or a pointer is not 16-byte aligned");
  }
}

template <class F>
void dispatch_types(DType x_dtype, DType w_dtype, F&& f) {
  SLIME_CHECK(x_dtype == DType::f32 || x_dtype == DType::bf16, "rms_norm: x must be f32 or bf16, got ",
              dtype_name(x_dtype));
  SLIME_CHECK(w_dtype == DType::f32 || w_dtype == DType::bf16, "rms_norm: w must be f32 or bf16, got ",
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

// The vector width usable for these pointers: 16 bytes of T, or 1.
template <class T, class W>
bool vectorizable(int64_t dim, std::initializer_list<const void*> act, const void* w) {
  constexpr int kVec = 16 / sizeof(T);
  if (dim % kVec != 0 || !aligned(w, vec_align(sizeof(W), kVec))) return false;
  for (const void* p : act)
    if (!aligned(p, 16)) return false;
  return true;
}

// Resident blocks per SM of `kernel` with `threads` threads (queried once per
// kernel).
template <class Kernel>
int64_t resident_blocks(Kernel kernel, int threads) {
  int n = 0;
  SLIME_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
  return std::clamp(n, 1, kMaxBlocksPerSm);
}

}  // namespace

void rms_norm_forward(const RmsNormForwardArgs& args, StreamHandle stream) {
  if (args.rows == 0) return;
  SLIME_CHECK(args.dim > 0, "rms_norm_forward: dim must be positive");
  dispatch_types(args.x_dtype, args.w_dtype, [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    auto run = [&](auto vec_tag) {
      constexpr int kVec = decltype(vec_tag)::value;
      with_config<kVec>(args.dim, [&](auto cfg) {
        using C = decltype(cfg);
        auto kernel = rms_norm_forward_kernel<T, W, kVec, C>;
        static const int64_t per_sm = resident_blocks(kernel, C::kBlock);
        const int64_t blocks = std::min<int64_t>((args.rows + C::kRows - 1) / C::kRows, per_sm * sm_count());
        kernel<<<unsigned(blocks), C::kBlock, 0, stream>>>(args);
        SLIME_CUDA_CHECK_LAUNCH();
      });
    };
    if (vectorizable<T, W>(args.dim, {args.x, args.y}, args.w)) {
      run(std::integral_constant<int, 16 / sizeof(T)>{});
    } else {
      run(std::integral_constant<int, 1>{});
    }
  });
}

std::size_t rms_norm_backward_workspace_bytes(int64_t rows, int64_t dim) {
  // Every configuration runs at most min(rows, kMaxBlocksPerSm x SMs) blocks.
  if (rows == 0 || dim == 0) return 0;
  return std::size_t(std::min<int64_t>(rows, int64_t(kMaxBlocksPerSm) * sm_count())) * std::size_t(dim) * sizeof(float);
}

void rms_norm_backward(const RmsNormBackwardArgs& args, StreamHandle stream) {
  if (args.rows == 0) return;
  SLIME_CHECK(args.dim > 0, "rms_norm_backward: dim must be positive");
  const std::size_t need = rms_norm_backward_workspace_bytes(args.rows, args.dim);
  SLIME_CHECK(args.workspace != nullptr && args.workspace_bytes >= need, "rms_norm_backward: workspace of ",
              args.workspace_bytes, " bytes, needs ", need);
  SLIME_CHECK(aligned(args.workspace, sizeof(float)), "rms_norm_backward: workspace must be 4-byte aligned");
  auto* partials = static_cast<float*>(args.workspace);
  dispatch_types(args.x_dtype, args.w_dtype, [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    auto run = [&](auto vec_tag) {
      constexpr int kVec = decltype(vec_tag)::value;
      with_config<kVec, true>(args.dim, [&](auto cfg) {
        using C = decltype(cfg);
        auto kernel = rms_norm_backward_kernel<T, W, kVec, C>;
        static const int64_t per_sm = resident_blocks(kernel, C::kBlock);
        const int64_t blocks = std::min<int64_t>((args.rows + C::kRows - 1) / C::kRows, per_sm * sm_count());
        kernel<<<unsigned(blocks), C::kBlock, 0, stream>>>(args, partials);
        SLIME_CUDA_CHECK_LAUNCH();
        const dim3 grid(unsigned((args.dim + kReduceCols - 1) / kReduceCols));
        dw_reduce_kernel<<<grid, dim3(kReduceCols, kReduceSlices), 0, stream>>>(partials, blocks, args.dim, args.dw);
        SLIME_CUDA_CHECK_LAUNCH();
      });
    };
    if (vectorizable<T, W>(args.dim, {args.x, args.dy, args.dx}, args.w)) {
      run(std::integral_constant<int, 16 / sizeof(T)>{});
    } else {
      run(std::integral_constant<int, 1>{});
    }
  });
}

}  // namespace slime::ops::cuda
