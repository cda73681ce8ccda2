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
// kGroup * kIters * kVec covers dim, from the lists in with_config() (those of
// rms_norm). With 16-byte vectors (kVec = 8 for bf16, 4 for f32) up to 16384
// (bf16) / 8192 (f32) columns; without (dim not a multiple of kVec or a
// misaligned pointer) one element per access up to 8192 columns.
// Benchmark: bench/bench_vision_ops.cu beside bench/torch_vision_ops.py.
#include <cuda_bf16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <mutex>

#include "memops.cuh"
#include "ptx.cuh"
#include "slime/core/half.hpp"
#include "slime/ops/cuda/layer_norm.hpp"

namespace slime::ops::cuda {
namespace {

using namespace ::slime::ops::detail::memops;

// At most 2048 / 256 blocks of >= 256 threads are resident per SM, so the
// backward writes at most min(rows, 8 x SMs) partial rows of dw (and of db).
constexpr int kMaxBlocksPerSm = 8;

template <int kGroup_, int kIters_>
struct Config {
  static constexpr int kGroup = kGroup_;  // threads per row
  static constexpr int kIters = kIters_;  // vectors per thread
  static constexpr int kBlock = kGroup >= 256 ? kGroup : 256;
  static constexpr int kRows = kBlock / kGroup;  // rows per block at a time
};

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
      v[it] = load_vec<W, kVec>(p + col);
    } else {
#pragma unroll
      for (int k = 0; k < kVec; ++k) v[it].v[k] = W(0.f);
    }
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

// out[col] += sum over p of partials[p, col] for (partials, out) = (the dw
// partials, dw) at blockIdx.y = 0 and (the db partials, db) at 1, in a fixed
// order: 8 slices of the partial rows (p = slice mod 8), each summed in
// increasing p, then the slices in order.
constexpr int kReduceCols = 32, kReduceSlices = 8;

__global__ void __launch_bounds__(kReduceCols* kReduceSlices)
    param_grad_reduce_kernel(const float* __restrict__ partials, int64_t parts, int64_t dim, float* __restrict__ dw,
                             float* __restrict__ db) {
  __shared__ float sums[kReduceSlices][kReduceCols + 1];
  const float* in = partials + int64_t(blockIdx.y) * parts * dim;
  float* out = blockIdx.y == 0 ? dw : db;
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

int sm_count() {
  static std::array<int, 64> counts{};
  static std::array<std::once_flag, 64> once;
  int device = 0;
  SLIME_CUDA_CHECK(cudaGetDevice(&device));
  SLIME_CHECK(device >= 0 && device < 64, "layer_norm: device index ", device, " out of range");
  std::call_once(once[std::size_t(device)], [&] {
    SLIME_CUDA_CHECK(cudaDeviceGetAttribute(&counts[std::size_t(device)], cudaDevAttrMultiProcessorCount, device));
  });
  return counts[std::size_t(device)];
}

// Calls launch(Config<G, I>{}) with the smallest listed configuration whose
// capacity G * I * kVec covers dim: rms_norm's lists (its with_config gives
// the reasons), the backward at most 8 elements of a row per thread.
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
    SLIME_FAIL("layer_norm: dim ", dim, " exceeds the GPU kernels' limit of ", 2048 * kVec, " for this dtype");
  } else if constexpr (kVec > 1) {
    if (fits(16, 1)) return launch(Config<16, 1>{});
    if (fits(32, 1)) return launch(Config<32, 1>{});
    if (fits(32, 2)) return launch(Config<32, 2>{});
    if (fits(64, 2)) return launch(Config<64, 2>{});
    if (fits(128, 2)) return launch(Config<128, 2>{});
    if (fits(128, 4)) return launch(Config<128, 4>{});
    if (fits(256, 4)) return launch(Config<256, 4>{});
    if (fits(512, 4)) return launch(Config<512, 4>{});
    SLIME_FAIL("layer_norm: dim ", dim, " exceeds the GPU kernels' limit of ", 2048 * kVec, " for this dtype");
  } else {
    if (fits(32, 4)) return launch(Config<32, 4>{});
    if (fits(128, 4)) return launch(Config<128, 4>{});
    if (fits(256, 8)) return launch(Config<256, 8>{});
    if (fits(1024, 8)) return launch(Config<1024, 8>{});
    SLIME_FAIL("layer_norm: dim ", dim,
               " exceeds the GPU kernels' limit of 8192 when it is not a multiple of 8 (bf16) "
               "or 4 (f32), or a pointer is not 16-byte aligned");
  }
}

template <class F>
void dispatch_types(DType x_dtype, DType w_dtype, F&& f) {
  SLIME_CHECK(x_dtype == DType::f32 || x_dtype == DType::bf16, "layer_norm: x must be f32 or bf16, got ",
              dtype_name(x_dtype));
  SLIME_CHECK(w_dtype == DType::f32 || w_dtype == DType::bf16, "layer_norm: w must be f32 or bf16, got ",
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
bool vectorizable(int64_t dim, std::initializer_list<const void*> act, std::initializer_list<const void*> params) {
  constexpr int kVec = 16 / sizeof(T);
  if (dim % kVec != 0) return false;
  for (const void* p : params)
    if (!aligned(p, vec_align(sizeof(W), kVec))) return false;
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

void layer_norm_forward(const LayerNormForwardArgs& args, StreamHandle stream) {
  if (args.rows == 0) return;
  SLIME_CHECK(args.dim > 0, "layer_norm_forward: dim must be positive");
  dispatch_types(args.x_dtype, args.w_dtype, [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    auto run = [&](auto vec_tag) {
      constexpr int kVec = decltype(vec_tag)::value;
      with_config<kVec>(args.dim, [&](auto cfg) {
        using C = decltype(cfg);
        auto kernel = layer_norm_forward_kernel<T, W, kVec, C>;
        static const int64_t per_sm = resident_blocks(kernel, C::kBlock);
        const int64_t blocks = std::min<int64_t>((args.rows + C::kRows - 1) / C::kRows, per_sm * sm_count());
        kernel<<<unsigned(blocks), C::kBlock, 0, stream>>>(args);
        SLIME_CUDA_CHECK_LAUNCH();
      });
    };
    if (vectorizable<T, W>(args.dim, {args.x, args.y}, {args.w, args.b})) {
      run(std::integral_constant<int, 16 / sizeof(T)>{});
    } else {
      run(std::integral_constant<int, 1>{});
    }
  });
}

std::size_t layer_norm_backward_workspace_bytes(int64_t rows, int64_t dim) {
  // Every configuration runs at most min(rows, kMaxBlocksPerSm x SMs) blocks.
  if (rows == 0 || dim == 0) return 0;
  return 2 * std::size_t(std::min<int64_t>(rows, int64_t(kMaxBlocksPerSm) * sm_count())) * std::size_t(dim) *
         sizeof(float);
}

void layer_norm_backward(const LayerNormBackwardArgs& args, StreamHandle stream) {
  if (args.rows == 0) return;
  SLIME_CHECK(args.dim > 0, "layer_norm_backward: dim must be positive");
  const std::size_t need = layer_norm_backward_workspace_bytes(args.rows, args.dim);
  SLIME_CHECK(args.workspace != nullptr && args.workspace_bytes >= need, "layer_norm_backward: workspace of ",
              args.workspace_bytes, " bytes, needs ", need);
  SLIME_CHECK(aligned(args.workspace, sizeof(float)), "layer_norm_backward: workspace must be 4-byte aligned");
  auto* partials = static_cast<float*>(args.workspace);
  dispatch_types(args.x_dtype, args.w_dtype, [&](auto t_tag, auto w_tag) {
    using T = decltype(t_tag);
    using W = decltype(w_tag);
    auto run = [&](auto vec_tag) {
      constexpr int kVec = decltype(vec_tag)::value;
      with_config<kVec, true>(args.dim, [&](auto cfg) {
        using C = decltype(cfg);
        auto kernel = layer_norm_backward_kernel<T, W, kVec, C>;
        static const int64_t per_sm = resident_blocks(kernel, C::kBlock);
        const int64_t blocks = std::min<int64_t>((args.rows + C::kRows - 1) / C::kRows, per_sm * sm_count());
        kernel<<<unsigned(blocks), C::kBlock, 0, stream>>>(args, partials);
        SLIME_CUDA_CHECK_LAUNCH();
        const dim3 grid(unsigned((args.dim + kReduceCols - 1) / kReduceCols), 2);
        param_grad_reduce_kernel<<<grid, dim3(kReduceCols, kReduceSlices), 0, stream>>>(partials, blocks, args.dim,
                                                                                        args.dw, args.db);
        SLIME_CUDA_CHECK_LAUNCH();
      });
    };
    if (vectorizable<T, W>(args.dim, {args.x, args.dy, args.dx}, {args.w})) {
      run(std::integral_constant<int, 16 / sizeof(T)>{});
    } else {
      run(std::integral_constant<int, 1>{});
    }
  });
}

}  // namespace slime::ops::cuda
