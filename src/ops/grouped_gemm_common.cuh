// src/ops/grouped_gemm_common.cuh: device pieces shared by the grouped GEMM
// kernels (grouped_gemm.cu: mma.sync; grouped_gemm_sm90.cu: wgmma + TMA):
// the device check of the offsets, the tile locator over ragged groups and
// the epilogue's paired store. Not installed.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "ptx.cuh"

namespace slime::ops::detail::grouped_gemm_device {

using namespace ::slime::ops::detail::ptx;

// ---- device checks of the offsets ------------------------------------------------

static __device__ __noinline__ void offsets_trap(const char* what, int e, int a, int b) {
  printf("slime grouped_gemm: invalid offsets: %s (expert %d: %d, %d)\n", what, e, a, b);
  __trap();
}

// The same check's failure without the message: a kernel that issues wgmma
// must make no function call (printf included), or ptxas serialises every
// wgmma in it (warning C7510).
struct QuietTrap {
  __device__ __forceinline__ void operator()(const char*, int, int, int) const { __trap(); }
};
struct PrintingTrap {
  __device__ __forceinline__ void operator()(const char* what, int e, int a, int b) const {
    offsets_trap(what, e, a, b);
  }
};

// offsets[e], or the single group [0, rows) of null offsets (one expert).
__device__ __forceinline__ int group_offset(const int32_t* offsets, int e, int rows) {
  return offsets != nullptr ? offsets[e] : (e == 0 ? 0 : rows);
}

// ---- tile location ----------------------------------------------------------------

struct TileCoord {
  int group = -1, m_tile = 0, n_tile = 0, row0 = 0, rows = 0;
};

// forward / backward_input: the group, m-tile and n-tile of linear tile t,
// from a block-wide prefix sum of ceil(n_e / kBM) * n_tiles over the groups
// (chunks of kThreads groups). group = -1 when t is past the last tile.
// Checks offsets[0] = 0, n_e >= 0 and offsets[E] = rows on the way.
template <int kThreads, int kBM, class Trap = PrintingTrap>
__device__ TileCoord locate_tile(const int32_t* __restrict__ offsets, int experts, int rows, int n_tiles, int t,
                                 int* s_scan /* kThreads / 32 + 4 ints */) {
  constexpr int kWarps = kThreads / 32;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    s_scan[kWarps] = -1;
    const int first = group_offset(offsets, 0, rows), last = group_offset(offsets, experts, rows);
    if (first != 0) Trap{}("offsets[0] is not 0", 0, first, 0);
    if (last != rows) Trap{}("offsets[E] is not the row count", experts, last, rows);
  }
  int carry = 0;
  for (int base = 0; base < experts; base += kThreads) {
    const int e = base + tid;
    int tiles = 0, r0 = 0, n = 0;
    if (e < experts) {
      r0 = group_offset(offsets, e, rows);
      n = group_offset(offsets, e + 1, rows) - r0;
      if (n < 0) Trap{}("offsets decrease", e, r0, r0 + n);
      tiles = (n + kBM - 1) / kBM * n_tiles;
    }
    const int incl = warp_inclusive_scan(tiles, lane);
    if (lane == 31) s_scan[warp] = incl;
    __syncthreads();
    int before = carry, chunk = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const int s = s_scan[w];
      before += w < warp ? s : 0;
      chunk += s;
    }
    const int start = before + incl - tiles;
    if (tiles > 0 && t >= start && t < start + tiles) {
      s_scan[kWarps] = e;
      s_scan[kWarps + 1] = t - start;
      s_scan[kWarps + 2] = r0;
      s_scan[kWarps + 3] = n;
    }
    carry += chunk;
    __syncthreads();
    if (s_scan[kWarps] >= 0) break;  // uniform: every thread reads it after the barrier
  }
  TileCoord c;
  c.group = s_scan[kWarps];
  if (c.group >= 0) {
    const int local = s_scan[kWarps + 1];
    c.m_tile = local / n_tiles;
    c.n_tile = local % n_tiles;
    c.row0 = s_scan[kWarps + 2];
    c.rows = s_scan[kWarps + 3];
  }
  return c;
}

template <class T>
__device__ __forceinline__ void store_pair(T* p, float v0, float v1, bool accumulate) {
  if constexpr (std::is_same_v<T, float>) {
    float2* q = reinterpret_cast<float2*>(p);
    if (accumulate) {
      const float2 old = *q;
      v0 += old.x;
      v1 += old.y;
    }
    *q = make_float2(v0, v1);
  } else {
    __nv_bfloat162* q = reinterpret_cast<__nv_bfloat162*>(p);
    if (accumulate) {
      const float2 old = __bfloat1622float2(*q);
      v0 += old.x;
      v1 += old.y;
    }
    *q = __floats2bfloat162_rn(v0, v1);
  }
}

}  // namespace slime::ops::detail::grouped_gemm_device
