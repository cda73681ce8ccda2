// CUDA kernels of slime/ops/rope.hpp.
//
// One thread per (token, chunk of N frequencies): it computes the N angles
// pos * inv_freq[i] in fp32 and their sincosf once, then rotates those pairs
// (x[i], x[i + d/2]) in every q head and every k head of the token, with
// 16-byte vectors (N = 8 for bf16, 4 for f32) where head_dim / 2 is a
// multiple of N and every pointer is 16-byte aligned, else N = 1.
// inv_freq comes from the host (computed as the CPU reference does), in the
// launch parameters, with each pair's position axis (multi-axis RopeSpecs:
// positions [tokens, axes]; the text kind's kernel reads one position per
// token). Every pair is read and written by the same thread, so the output
// may be the input (in place).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "memops.cuh"
#include "slime/core/half.hpp"
#include "slime/ops/cpu/rope.hpp"
#include "slime/ops/cuda/rope.hpp"

namespace slime::ops::cuda {
namespace {

using namespace ::slime::ops::detail::memops;

constexpr int kThreads = 256;

struct RopeParams {
  const void* q;
  void* q_out;
  const void* k;
  void* k_out;
  const int32_t* positions;
  int64_t tokens;
  int q_heads, k_heads, head_dim;
  int axes;  // positions per token
  float sign;
  float inv_freq[kRopeMaxHeadDim / 2];
  uint8_t axis[kRopeMaxHeadDim / 2];  // pair i reads positions[t * axes + axis[i]]
};

// Rotates the N pairs starting at column i0 of every head of token t.
template <class T, int N>
__device__ __forceinline__ void rotate_heads(const T* x, T* y, int heads, int head_dim, int64_t t, int i0,
                                             const float (&c)[N], const float (&s)[N]) {
  const int half = head_dim / 2;
#pragma unroll 4
  for (int h = 0; h < heads; ++h) {
    const int64_t base = (t * heads + h) * head_dim + i0;
    const Vec<T, N> a = load_vec<T, N>(x + base);
    const Vec<T, N> b = load_vec<T, N>(x + base + half);
    Vec<T, N> ya, yb;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float x1 = to_float(a.v[k]), x2 = to_float(b.v[k]);
      ya.v[k] = from_float<T>(x1 * c[k] - x2 * s[k]);
      yb.v[k] = from_float<T>(x2 * c[k] + x1 * s[k]);
    }
    store_vec<T, N>(y + base, ya);
    store_vec<T, N>(y + base + half, yb);
  }
}

template <class T, int N, bool kMultiAxis>
__global__ void __launch_bounds__(kThreads) rope_kernel(const __grid_constant__ RopeParams p) {
  const int chunks = p.head_dim / 2 / N;
  const int64_t idx = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (idx >= p.tokens * chunks) return;
  const int64_t t = idx / chunks;
  const int i0 = int(idx % chunks) * N;
  const int32_t* pos_t = p.positions + t * p.axes;
  const float pos0 = float(pos_t[0]);
  float c[N], s[N];
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float pos = kMultiAxis ? float(pos_t[p.axis[i0 + k]]) : pos0;
    const float angle = pos * p.inv_freq[i0 + k];
    sincosf(angle, &s[k], &c[k]);
    s[k] *= p.sign;
  }
  rotate_heads<T, N>(static_cast<const T*>(p.q), static_cast<T*>(p.q_out), p.q_heads, p.head_dim, t, i0, c, s);
  if (p.k_heads > 0)
    rotate_heads<T, N>(static_cast<const T*>(p.k), static_cast<T*>(p.k_out), p.k_heads, p.head_dim, t, i0, c, s);
}

// Last s in [0, num_seqs - 1] with cu_seqlens[s] <= t (binary search); reads
// stay in bounds whatever cu_seqlens holds.
__global__ void positions_kernel(const int32_t* __restrict__ cu_seqlens, int64_t num_seqs, int64_t tokens,
                                 int32_t* __restrict__ positions) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < tokens; t += int64_t(gridDim.x) * blockDim.x) {
    int64_t lo = 0, hi = num_seqs > 0 ? num_seqs - 1 : 0;
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (cu_seqlens[mid] <= t) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    positions[t] = int32_t(t - cu_seqlens[lo]);
  }
}

template <class T, int N>
void launch(const RopeParams& p, StreamHandle stream) {
  const int64_t items = p.tokens * (p.head_dim / 2 / N);
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  SLIME_CHECK(blocks <= INT32_MAX, "rope: ", p.tokens, " tokens are too many for one launch");
  if (p.axes > 1) {
    rope_kernel<T, N, true><<<unsigned(blocks), kThreads, 0, stream>>>(p);
  } else {
    rope_kernel<T, N, false><<<unsigned(blocks), kThreads, 0, stream>>>(p);
  }
  SLIME_CUDA_CHECK_LAUNCH();
}

}  // namespace

void rope(const RopeArgs& args, StreamHandle stream) {
  if (args.tokens == 0 || (args.q_heads == 0 && args.k_heads == 0)) return;
  SLIME_CHECK(args.head_dim > 0 && args.head_dim % 2 == 0 && args.head_dim <= kRopeMaxHeadDim,
              "rope: head_dim must be even and at most ", kRopeMaxHeadDim, ", got ", args.head_dim);
  SLIME_CHECK(args.q_heads <= INT32_MAX && args.k_heads <= INT32_MAX, "rope: too many heads");
  SLIME_CHECK(args.dtype == DType::f32 || args.dtype == DType::bf16, "rope: q and k must be f32 or bf16, got ",
              dtype_name(args.dtype));
  RopeParams p{};
  p.q = args.q;
  p.q_out = args.q_out;
  p.k = args.k;
  p.k_out = args.k_out;
  p.positions = args.positions;
  p.tokens = args.tokens;
  p.q_heads = int(args.q_heads);
  p.k_heads = args.k == nullptr ? 0 : int(args.k_heads);
  p.head_dim = int(args.head_dim);
  p.sign = args.sign < 0 ? -1.f : 1.f;
  args.spec.check(args.head_dim, "rope");
  p.axes = args.spec.axes();
  for (int64_t i = 0; i < args.head_dim / 2; ++i) {
    p.inv_freq[i] = cpu::rope_pair_inv_freq_f32(args.spec, args.head_dim, i);
    p.axis[i] = uint8_t(cpu::rope_pair_axis(args.spec, args.head_dim, i));
  }

  auto run = [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    bool vec = (args.head_dim / 2) % kVec == 0 && aligned(p.q, 16) && aligned(p.q_out, 16);
    if (p.k_heads > 0) vec = vec && aligned(p.k, 16) && aligned(p.k_out, 16);
    if (vec) {
      launch<T, kVec>(p, stream);
    } else {
      launch<T, 1>(p, stream);
    }
  };
  if (args.dtype == DType::f32) {
    run(float{});
  } else {
    run(BFloat16{});
  }
}

void positions_from_cu_seqlens(const int32_t* cu_seqlens, int64_t num_seqs, int64_t tokens, int32_t* positions,
                               StreamHandle stream) {
  if (tokens == 0) return;
  positions_kernel<<<grid_1d(tokens, 256), 256, 0, stream>>>(cu_seqlens, num_seqs, tokens, positions);
  SLIME_CUDA_CHECK_LAUNCH();
}

}  // namespace slime::ops::cuda
