// CUDA grouped GEMM over experts for slime/ops/cuda/grouped_gemm.hpp: a
// tensor-core kernel (bf16, mma.sync m16n8k16, ldmatrix, cp.async pipeline)
// for the three passes, a simple fallback kernel, and the dispatcher.
//
// Each pass is C[M, N] = Σ_k A[m, k] · B[n, k] per group, with operands
// either K-major (k contiguous in memory) or MN-major (m / n contiguous):
//   pass             M     N    K (summed)  A                      B
//   forward          n_e   out  in          x_g    K-major          w_e [out, in] K-major
//   backward_input   n_e   in   out         dy_g   K-major          w_e [out, in] MN-major
//   backward_weight  out   in   n_e         dy_gᵀ  MN-major         x_g [n_e, in] MN-major
// Shared memory tiles keep the global layout (K-major [rows][BK + 8],
// MN-major [BK][rows + 8]); the 16-byte row padding keeps the 8 row addresses
// of every ldmatrix in distinct bank groups. MN-major operands are read with
// ldmatrix.trans, which yields the same fragments (layouts as in
// attention_kernels.cuh; the PTX wrappers are in ptx.cuh).
//
// Scheduling: one CTA per output tile, no persistent loop, so the hardware
// block scheduler balances tiles of unequal cost (wgrad tiles cost ∝ n_e).
//   forward / backward_input: tiles of all groups are linearised (group-major,
//     then m-tile, then n-tile, so neighbouring CTAs share A rows and sweep
//     w_e, which stays in L2); each CTA finds its group by a block-wide prefix
//     sum of the per-group tile counts read from the device offsets (E loads
//     and a scan, overlapped by the other resident CTAs). The grid is
//     the upper bound ceil(rows / BM) + E m-tiles times the n-tiles; CTAs past
//     the real count exit at once.
//   backward_weight: tile t = (expert, m-tile, n-tile) directly; experts with
//     no rows exit at once and leave dw as it is. Each dw tile is owned by one
//     CTA, which sums all of its group's rows: deterministic, no atomics.
//
// On Hopper the dispatcher takes the wgmma + TMA kernels of
// grouped_gemm_sm90.cu instead (mma.sync peaks at ~2/3 of the dense bf16 rate
// on H200); these stay for other GPUs, builds without sm_90a and shapes the
// Hopper kernels do not take (K = 0, more experts than their tile table).
#include "slime/ops/cuda/grouped_gemm.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "grouped_gemm_common.cuh"
#include "ptx.cuh"
#include "slime/core/error.hpp"

namespace slime::ops::cuda {

// The cuBLAS backend (src/ops/grouped_gemm_cublas.cpp), after grouped_gemm's
// checks, and the host offsets' check (throws slime::Error).
void grouped_gemm_cublas(const GroupedGemmParams& p, StreamHandle stream);
// The Hopper kernels (src/ops/grouped_gemm_sm90.cu).
bool grouped_gemm_sm90_device();
bool grouped_gemm_sm90_auto();
bool grouped_gemm_sm90_fits(GroupedGemmTile tile, int64_t experts, DType out_dtype);
GroupedGemmTile grouped_gemm_sm90_plain_tile(int64_t rows, int64_t n);
void grouped_gemm_sm90(GroupedGemmTile tile, const GroupedGemmParams& p, cudaStream_t stream);
void check_grouped_gemm_host_offsets(const int32_t* o, int64_t experts, int64_t rows);

namespace {

using namespace ::slime::ops::detail::ptx;
using namespace ::slime::ops::detail::grouped_gemm_device;
using bf16 = __nv_bfloat16;

using Pass = GroupedGemmPass;

// ---- tile configurations ----------------------------------------------------------

// CTA tile kBM x kBN, k-step kBK, warps kWarpsM x kWarpsN (each owns a
// (kBM / kWarpsM) x (kBN / kWarpsN) block of C), kStages cp.async stages.
template <int BM, int BN, int BK, int WarpsM, int WarpsN, int Stages, int MinBlocks>
struct TileConfig {
  static constexpr int kBM = BM, kBN = BN, kBK = BK, kWarpsM = WarpsM, kWarpsN = WarpsN;
  static constexpr int kStages = Stages, kMinBlocks = MinBlocks;
  static constexpr int kWarps = WarpsM * WarpsN, kThreads = 32 * kWarps;
  static constexpr int kWarpM = BM / WarpsM, kWarpN = BN / WarpsN;
  static constexpr int kMT = kWarpM / 16;  // m16 tiles per warp
  static constexpr int kNT = kWarpN / 8;   // n8 tiles per warp
  static_assert(BM % (16 * WarpsM) == 0 && BN % (16 * WarpsN) == 0, "warp tiles are made of 16 x 16 blocks");
  static_assert(BK % 16 == 0 && Stages >= 2, "k-step of whole mma steps, at least double buffering");
  static_assert(kWarpsM * kWarpM == BM && kWarpsN * kWarpN == BN, "the warps tile the CTA tile");
};

// Shared-memory tile of one operand: K-major [rows][BK + 8] or MN-major
// [BK][rows + 8] (bf16 elements).
template <bool kKMajor, int kRows, int kBK>
struct OperandTile {
  static constexpr int kStride = kKMajor ? kBK + 8 : kRows + 8;
  static constexpr int kElems = (kKMajor ? kRows : kBK) * kStride;
};

template <Pass kPass>
struct PassLayout {
  static constexpr bool kAKMajor = kPass != Pass::backward_weight;
  static constexpr bool kBKMajor = kPass == Pass::forward;
};

template <class Cfg, Pass kPass>
struct Smem {
  using A = OperandTile<PassLayout<kPass>::kAKMajor, Cfg::kBM, Cfg::kBK>;
  using B = OperandTile<PassLayout<kPass>::kBKMajor, Cfg::kBN, Cfg::kBK>;
  static constexpr int kStageElems = A::kElems + B::kElems;
  static constexpr int kBytes = Cfg::kStages * kStageElems * int(sizeof(bf16));
};

// Resources (ptxas -v, sm_90a, CUDA 13.0; registers fwd / dgrad / wgrad, no
// spills anywhere, 24 bytes of stack for the printf of offsets_trap; dynamic
// shared memory fwd / dgrad / wgrad):
//   m128n128k32: 238 / 244 / 236 regs, 80 / 74 / 68 KB, 2 CTAs (8 warps) per SM
//   m128n256k64: 246 / 244 / 246 regs, 162 / 153 / 150 KB, 1 CTA (8 warps) per SM
//   m128n128k64: 250 / 254 / 246 regs, 108 / 105 / 102 KB, 2 CTAs (8 warps) per SM
// All have a 64 x 64 warp tile: per k16 step 4 + 4 ldmatrix.x4 feed 32 mma
// (0.25 LDSM per mma, under the ~0.37 where a loop turns shared-memory bound;
// see attention_kernels.cuh). m128n256k64 moves 3/4 of the global->shared
// bytes per FLOP of the 128 x 128 tiles (1 / BM + 1 / BN per multiply-add) and
// has the fewest barriers per FLOP.
// Measured: README's benchmark table; bench_grouped_gemm's /tile:<name> rows
// time each configuration.
using CfgM128N128K32 = TileConfig<128, 128, 32, 2, 2, 4, 2>;
using CfgM128N256K64 = TileConfig<128, 256, 64, 2, 4, 3, 1>;
using CfgM128N128K64 = TileConfig<128, 128, 64, 2, 2, 3, 2>;

// ---- the tensor-core kernel -----------------------------------------------------

struct KernelParams {
  const bf16* a;
  const bf16* b;
  void* c;
  const int32_t* offsets;  // null: one group of all rows
  int experts, rows, out_f, in_f;
  int m_tiles, n_tiles;  // backward_weight: per expert; others: n-tiles per m-tile
  int64_t ldc;           // forward / backward_input: the row pitch of c
  bool accumulate;
};

// Copies one stage of an operand: tile rows [0, kRows) of the M (or N) extent
// and k [k0, k0 + kBK), from `g` (the element (0, 0) of the tile, also the
// dummy source of zero fills) with row stride ld. Rows at or past mn_valid and
// k at or past k_valid are zero-filled (whole 16-byte chunks: the features are
// multiples of 8).
template <bool kKMajor, int kRows, int kBK, int kThreads>
__device__ __forceinline__ void load_operand(bf16* s, const bf16* __restrict__ g, int64_t ld, int k0, int mn_valid,
                                             int k_valid, int tid) {
  using Tile = OperandTile<kKMajor, kRows, kBK>;
  constexpr int kChunksPerRow = (kKMajor ? kBK : kRows) / 8;
  constexpr int kChunks = (kKMajor ? kRows : kBK) * kChunksPerRow;
  constexpr int kIters = (kChunks + kThreads - 1) / kThreads;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int c = it * kThreads + tid;
    if (kChunks % kThreads == 0 || c < kChunks) {
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      bool ok;
      const bf16* src;
      if constexpr (kKMajor) {
        ok = r < mn_valid && k0 + col < k_valid;
        src = g + int64_t(r) * ld + (k0 + col);
      } else {
        ok = k0 + r < k_valid && col < mn_valid;
        src = g + int64_t(k0 + r) * ld + col;
      }
      cp_async_16(s + r * Tile::kStride + col, ok ? src : g, ok);
    }
  }
}

template <class Cfg, Pass kPass, class TOut>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) grouped_gemm_kernel(const KernelParams p) {
  constexpr int kBM = Cfg::kBM, kBN = Cfg::kBN, kBK = Cfg::kBK, kThreads = Cfg::kThreads, kStages = Cfg::kStages;
  constexpr int kMT = Cfg::kMT, kNT = Cfg::kNT;
  constexpr bool kAK = PassLayout<kPass>::kAKMajor, kBKm = PassLayout<kPass>::kBKMajor;
  using S = Smem<Cfg, kPass>;
  constexpr int kSA = S::A::kStride, kSB = S::B::kStride;

  extern __shared__ __align__(16) unsigned char grouped_gemm_smem[];
  __shared__ int s_scan[Cfg::kWarps + 4];
  bf16* smem = reinterpret_cast<bf16*>(grouped_gemm_smem);

  const int tid = threadIdx.x;
  // ---- which tile, and its operands
  const bf16 *gA, *gB;
  int64_t lda, ldb, ldc;
  int m_valid, n_valid, k_len;
  TOut* gC;
  bool accumulate;
  if constexpr (kPass == Pass::backward_weight) {
    const int per_expert = p.m_tiles * p.n_tiles;
    const int e = int(blockIdx.x) / per_expert, local = int(blockIdx.x) % per_expert;
    const int m_tile = local / p.n_tiles, n_tile = local % p.n_tiles;
    const int r0 = group_offset(p.offsets, e, p.rows), r1 = group_offset(p.offsets, e + 1, p.rows);
    if (tid == 0 && (r0 < 0 || r1 < r0 || r1 > p.rows || (e == 0 && r0 != 0) || (e == p.experts - 1 && r1 != p.rows)))
      offsets_trap("offsets out of order or not ending at the row count", e, r0, r1);
    if (r1 <= r0) return;
    const int m0 = m_tile * kBM, n0 = n_tile * kBN;
    gA = p.a + int64_t(r0) * p.out_f + m0;  // dy [rows, out], A[m = out, k = row]
    lda = p.out_f;
    gB = p.b + int64_t(r0) * p.in_f + n0;  // x [rows, in], B[n = in, k = row]
    ldb = p.in_f;
    m_valid = p.out_f - m0;
    n_valid = p.in_f - n0;
    k_len = r1 - r0;
    ldc = p.in_f;
    gC = static_cast<TOut*>(p.c) + (int64_t(e) * p.out_f + m0) * p.in_f + n0;
    accumulate = true;
  } else {
    const TileCoord tc = locate_tile<kThreads, kBM>(p.offsets, p.experts, p.rows, p.n_tiles, int(blockIdx.x), s_scan);
    if (tc.group < 0) return;
    const int m0 = tc.m_tile * kBM, n0 = tc.n_tile * kBN;
    const int64_t row = int64_t(tc.row0) + m0;
    const bf16* w = p.b + int64_t(tc.group) * p.out_f * p.in_f;
    m_valid = tc.rows - m0;
    accumulate = kPass == Pass::backward_input && p.accumulate;
    if constexpr (kPass == Pass::forward) {
      gA = p.a + row * p.in_f;  // x [rows, in]
      lda = p.in_f;
      gB = w + int64_t(n0) * p.in_f;  // w_e [out, in], B[n = out, k = in]
      ldb = p.in_f;
      n_valid = p.out_f - n0;
      k_len = p.in_f;
      ldc = p.ldc;
    } else {
      gA = p.a + row * p.out_f;  // dy [rows, out]
      lda = p.out_f;
      gB = w + n0;  // w_e [out, in], B[n = in, k = out] stored [k][n]
      ldb = p.in_f;
      n_valid = p.in_f - n0;
      k_len = p.out_f;
      ldc = p.ldc;
    }
    gC = static_cast<TOut*>(p.c) + row * ldc + n0;
  }

  // ---- main loop: kStages - 1 k-steps in flight, one barrier per k-step
  const int warp = tid >> 5, lane = tid & 31;
  const int wm0 = (warp / Cfg::kWarpsN) * Cfg::kWarpM, wn0 = (warp % Cfg::kWarpsN) * Cfg::kWarpN;
  float acc[kMT][kNT][4];
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

  auto load_stage = [&](int stage, int kt) {
    bf16* sA = smem + stage * S::kStageElems;
    bf16* sB = sA + S::A::kElems;
    load_operand<kAK, kBM, kBK, kThreads>(sA, gA, lda, kt * kBK, m_valid, k_len, tid);
    load_operand<kBKm, kBN, kBK, kThreads>(sB, gB, ldb, kt * kBK, n_valid, k_len, tid);
  };

  const int k_tiles = (k_len + kBK - 1) / kBK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s);
    cp_async_commit();
  }

  // Per-lane ldmatrix offsets (elements) within a stage's A and B tiles.
  // K-major A: 16 rows x k 0 / 8 (regs a0..a3); MN-major A (.trans): k rows
  // 0..7 / 8..15 by lane bit 4, m 0 / 8 by lane bit 3. K-major B: 16 n rows
  // (two n8 tiles) x k 0 / 8 by lane bit 3; MN-major B (.trans): k rows 0 / 8
  // by lane bit 3, n 0 / 8 by lane bit 4.
  const int a_lane = kAK ? (wm0 + (lane & 15)) * kSA + (lane >> 4) * 8
                         : ((lane & 7) + ((lane >> 4) << 3)) * kSA + wm0 + ((lane >> 3) & 1) * 8;
  const int b_lane = kBKm ? (wn0 + (lane & 7) + ((lane >> 4) << 3)) * kSB + ((lane >> 3) & 1) * 8
                          : ((lane & 7) + ((lane >> 3) & 1) * 8) * kSB + wn0 + (lane >> 4) * 8;

  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kt landed for every thread; stage kt - 1 is free
    const int pf = kt + kStages - 1;
    if (pf < k_tiles) load_stage(pf % kStages, pf);
    cp_async_commit();

    const bf16* sA = smem + (kt % kStages) * S::kStageElems;
    const bf16* sB = sA + S::A::kElems;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t af[kMT][4], bfr[kNT][2];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        if constexpr (kAK) {
          ldmatrix_x4(af[mt], sA + a_lane + mt * 16 * kSA + kk);
        } else {
          ldmatrix_x4_trans(af[mt], sA + a_lane + kk * kSA + mt * 16);
        }
      }
#pragma unroll
      for (int np = 0; np < kNT / 2; ++np) {
        uint32_t r[4];
        if constexpr (kBKm) {
          ldmatrix_x4(r, sB + b_lane + np * 16 * kSB + kk);
        } else {
          ldmatrix_x4_trans(r, sB + b_lane + kk * kSB + np * 16);
        }
        bfr[2 * np][0] = r[0];
        bfr[2 * np][1] = r[1];
        bfr[2 * np + 1][0] = r[2];
        bfr[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) mma_bf16(acc[mt][nt], af[mt], bfr[nt][0], bfr[nt][1]);
    }
  }
  cp_async_wait<0>();

  // ---- epilogue: thread holds (row g, cols 2t, 2t+1) and (row g + 8, same) of
  // every m16n8 tile. n_valid is a multiple of 8, so both columns are in.
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = wm0 + mt * 16 + (lane >> 2) + 8 * h;
      if (row >= m_valid) continue;
      TOut* crow = gC + int64_t(row) * ldc;
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const int col = wn0 + nt * 8 + 2 * (lane & 3);
        if (col < n_valid) store_pair(crow + col, acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1], accumulate);
      }
    }
}

// ---- the fallback kernel ----------------------------------------------------------

__device__ __forceinline__ float load_f(const float* p) { return *p; }
__device__ __forceinline__ float load_f(const bf16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store_f(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_f(bf16* p, float v) { *p = __float2bfloat16_rn(v); }

// The group of row r: the last e with offsets[e] <= r (offsets[e + 1] > r).
__device__ __forceinline__ int group_of(const int32_t* offsets, int experts, int64_t r) {
  if (offsets == nullptr) return 0;  // one group of all rows
  int lo = 0, hi = experts;          // offsets[lo] <= r < offsets[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (offsets[mid] <= r) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// One thread per output element, fp32 sums in the reference's order.
template <Pass kPass, class T, class TOut>
__global__ void grouped_gemm_simple_kernel(const T* __restrict__ a, const T* __restrict__ b, TOut* c,
                                           const int32_t* __restrict__ offsets, int experts, int64_t rows,
                                           int64_t out_f, int64_t in_f, int64_t ldc, bool accumulate) {
  const int64_t total = kPass == Pass::forward          ? rows * out_f
                        : kPass == Pass::backward_input ? rows * in_f
                                                        : int64_t(experts) * out_f * in_f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.f;
    if constexpr (kPass == Pass::forward) {
      const int64_t r = i / out_f, n = i % out_f;
      const T* x = a + r * in_f;
      const T* w = b + (int64_t(group_of(offsets, experts, r)) * out_f + n) * in_f;
      for (int64_t k = 0; k < in_f; ++k) s = fmaf(load_f(x + k), load_f(w + k), s);
      store_f(c + r * ldc + n, s);
    } else if constexpr (kPass == Pass::backward_input) {
      const int64_t r = i / in_f, k = i % in_f;
      const T* dy = a + r * out_f;
      const T* w = b + int64_t(group_of(offsets, experts, r)) * out_f * in_f + k;
      for (int64_t n = 0; n < out_f; ++n) s = fmaf(load_f(dy + n), load_f(w + n * in_f), s);
      TOut* out = c + r * ldc + k;
      store_f(out, accumulate ? load_f(out) + s : s);
    } else {
      const int64_t e = i / (out_f * in_f), n = (i / in_f) % out_f, k = i % in_f;
      // Clamped, so that broken offsets cannot read out of bounds.
      const int64_t r0 = max(int64_t(group_offset(offsets, int(e), int(rows))), int64_t(0)),
                    r1 = min(int64_t(group_offset(offsets, int(e) + 1, int(rows))), rows);
      for (int64_t r = r0; r < r1; ++r) s = fmaf(load_f(a + r * out_f + n), load_f(b + r * in_f + k), s);
      store_f(c + i, load_f(c + i) + s);
    }
  }
}

// ---- launch -----------------------------------------------------------------------

bool tensor_core_ok(const GroupedGemmParams& p) {
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  // Rows of c start 16-byte aligned (paired stores, TMA strides).
  const bool pitch_ok = grouped_gemm_output_pitch(p) * int64_t(dtype_size(p.out_dtype)) % 16 == 0;
  return p.in_dtype == DType::bf16 && p.out_features % 8 == 0 && p.in_features % 8 == 0 && aligned(p.a) &&
         aligned(p.b) && aligned(p.c) && pitch_ok;
}

// c[r, j] *= alpha for the [rows, cols] block of pitch ldc (GroupedGemmParams::alpha).
template <class T>
__global__ void scale_rows_kernel(T* c, int64_t rows, int64_t cols, int64_t ldc, float alpha) {
  const int64_t total = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    T* q = c + (i / cols) * ldc + i % cols;
    store_f(q, load_f(q) * alpha);
  }
}

void scale_output(const GroupedGemmParams& p, cudaStream_t stream) {
  const int64_t total = p.rows * p.out_features;
  if (total == 0) return;
  constexpr int kThreads = 256;
  const unsigned blocks = unsigned(std::min<int64_t>((total + kThreads - 1) / kThreads, 65535 * 16));
  const int64_t ldc = grouped_gemm_output_pitch(p);
  if (p.out_dtype == DType::f32) {
    scale_rows_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<float*>(p.c), p.rows, p.out_features, ldc, p.alpha);
  } else {
    scale_rows_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<bf16*>(p.c), p.rows, p.out_features, ldc, p.alpha);
  }
  SLIME_CUDA_CHECK_LAUNCH();
}

int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

template <class Cfg, Pass kPass, class TOut>
void launch_tiles(const GroupedGemmParams& p, cudaStream_t stream) {
  KernelParams kp{};
  kp.a = static_cast<const bf16*>(p.a);
  kp.b = static_cast<const bf16*>(p.b);
  kp.c = p.c;
  kp.offsets = p.offsets;
  kp.experts = int(p.experts);
  kp.rows = int(p.rows);
  kp.out_f = int(p.out_features);
  kp.in_f = int(p.in_features);
  kp.accumulate = p.accumulate;
  kp.ldc = grouped_gemm_output_pitch(p);
  int64_t ctas;
  if constexpr (kPass == Pass::backward_weight) {
    kp.m_tiles = ceil_div(p.out_features, Cfg::kBM);
    kp.n_tiles = ceil_div(p.in_features, Cfg::kBN);
    ctas = p.experts * kp.m_tiles * kp.n_tiles;
  } else {
    kp.n_tiles = ceil_div(kPass == Pass::forward ? p.out_features : p.in_features, Cfg::kBN);
    ctas = (int64_t(ceil_div(p.rows, Cfg::kBM)) + p.experts) * kp.n_tiles;
  }
  SLIME_CHECK(ctas < INT_MAX, "grouped_gemm: ", ctas, " tiles do not fit in int32");
  if (ctas == 0) return;
  auto kernel = grouped_gemm_kernel<Cfg, kPass, TOut>;
  constexpr int kSmem = Smem<Cfg, kPass>::kBytes;
  SLIME_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  kernel<<<unsigned(ctas), Cfg::kThreads, kSmem, stream>>>(kp);
  SLIME_CUDA_CHECK_LAUNCH();
}

template <Pass kPass, class T, class TOut>
void launch_simple(const GroupedGemmParams& p, cudaStream_t stream) {
  const int64_t total = kPass == Pass::forward          ? p.rows * p.out_features
                        : kPass == Pass::backward_input ? p.rows * p.in_features
                                                        : p.experts * p.out_features * p.in_features;
  if (total == 0) return;
  constexpr int kThreads = 256;
  const unsigned blocks = unsigned(std::min<int64_t>((total + kThreads - 1) / kThreads, 65535 * 16));
  grouped_gemm_simple_kernel<kPass, T, TOut><<<blocks, kThreads, 0, stream>>>(
      static_cast<const T*>(p.a), static_cast<const T*>(p.b), static_cast<TOut*>(p.c), p.offsets, int(p.experts),
      p.rows, p.out_features, p.in_features, grouped_gemm_output_pitch(p), p.accumulate);
  SLIME_CUDA_CHECK_LAUNCH();
}

template <Pass kPass, class TOut>
void launch_tile_config(GroupedGemmTile tile, const GroupedGemmParams& p, cudaStream_t stream) {
  switch (tile) {
    case GroupedGemmTile::m128n128k32:
      return launch_tiles<CfgM128N128K32, kPass, TOut>(p, stream);
    case GroupedGemmTile::m128n256k64:
      return launch_tiles<CfgM128N256K64, kPass, TOut>(p, stream);
    case GroupedGemmTile::m128n128k64:
      return launch_tiles<CfgM128N128K64, kPass, TOut>(p, stream);
    default:
      SLIME_FAIL("grouped_gemm: unknown tile configuration ", int(tile));
  }
}

template <Pass kPass>
void dispatch_pass(GroupedGemmTile tile, const GroupedGemmParams& p, cudaStream_t stream) {
  if (tile == GroupedGemmTile::simple) {
    if (p.in_dtype == DType::f32) return launch_simple<kPass, float, float>(p, stream);
    if (p.out_dtype == DType::f32) return launch_simple<kPass, bf16, float>(p, stream);
    return launch_simple<kPass, bf16, bf16>(p, stream);
  }
  if (p.out_dtype == DType::f32) return launch_tile_config<kPass, float>(tile, p, stream);
  if constexpr (kPass != Pass::backward_weight) return launch_tile_config<kPass, bf16>(tile, p, stream);
}

}  // namespace

// The dispatcher's table. Chosen by construction (a 64 x 64 warp tile: 0.25
// ldmatrix.x4 per mma; the widest CTA tile that the N extent fills);
// bench_grouped_gemm's "/tile:<name>" rows compare all of them on the
// Qwen3-30B-A3B shapes.
GroupedGemmTile grouped_gemm_tile_for(const GroupedGemmParams& p) {
  if (p.tile != GroupedGemmTile::automatic) return p.tile;
  if (!tensor_core_ok(p)) return GroupedGemmTile::simple;
  const int64_t n_extent = p.pass == Pass::forward ? p.out_features : p.in_features;
  if (grouped_gemm_sm90_auto()) {
    if (p.offsets == nullptr && p.pass == Pass::forward) return grouped_gemm_sm90_plain_tile(p.rows, n_extent);
    const GroupedGemmTile t =
        n_extent >= 256 && n_extent % 256 == 0 ? GroupedGemmTile::sm90_m128n256 : GroupedGemmTile::sm90_m128n128;
    if (grouped_gemm_sm90_fits(t, p.experts, p.out_dtype)) return t;
  }
  if (n_extent >= 256 && n_extent % 256 == 0) return GroupedGemmTile::m128n256k64;
  return GroupedGemmTile::m128n128k32;
}

const char* grouped_gemm_tile_name(GroupedGemmTile t) {
  switch (t) {
    case GroupedGemmTile::automatic:
      return "automatic";
    case GroupedGemmTile::m128n128k32:
      return "m128n128k32";
    case GroupedGemmTile::m128n256k64:
      return "m128n256k64";
    case GroupedGemmTile::m128n128k64:
      return "m128n128k64";
    case GroupedGemmTile::simple:
      return "simple";
    case GroupedGemmTile::sm90_m128n256:
      return "sm90_m128n256";
    case GroupedGemmTile::sm90_m128n128:
      return "sm90_m128n128";
    case GroupedGemmTile::sm90_m128n64:
      return "sm90_m128n64";
    case GroupedGemmTile::sm90_m64n64:
      return "sm90_m64n64";
    case GroupedGemmTile::sm90_m64n32:
      return "sm90_m64n32";
    case GroupedGemmTile::sm90_m64n16:
      return "sm90_m64n16";
  }
  return "unknown";
}

bool grouped_gemm_tile_supported(GroupedGemmTile tile) {
  return !grouped_gemm_tile_is_sm90(tile) || grouped_gemm_sm90_device();
}

namespace {

// The kernels' part of grouped_gemm (after its checks).
void run_kernels(const GroupedGemmParams& p, StreamHandle stream) {
  GroupedGemmTile tile = grouped_gemm_tile_for(p);
  SLIME_CHECK(tile == GroupedGemmTile::simple || tensor_core_ok(p), "grouped_gemm: tile ", grouped_gemm_tile_name(tile),
              " needs bf16 inputs, in and out features multiples of 8 and 16-byte aligned pointers");
  SLIME_CHECK(grouped_gemm_tile_supported(tile), "grouped_gemm: tile ", grouped_gemm_tile_name(tile),
              " needs a GPU of compute capability 9.0 and slime built for sm_90a (CMAKE_CUDA_ARCHITECTURES 90a)");
  SLIME_CHECK(p.pass == Pass::forward || !grouped_gemm_tile_forward_only(tile), "grouped_gemm: tile ",
              grouped_gemm_tile_name(tile), " runs the forward pass only");
  if (p.rows == 0 || p.out_features == 0 || p.in_features == 0) {
    // Nothing to sum: y / dx are [rows, 0] or get zeros (in_features = 0).
    if (p.pass == Pass::backward_weight || p.rows == 0 || p.accumulate) return;
    if (grouped_gemm_tile_is_sm90(tile)) tile = GroupedGemmTile::m128n128k32;  // zeros: nothing for TMA to load
  }
  if (grouped_gemm_tile_is_sm90(tile)) {
    SLIME_CHECK(grouped_gemm_sm90_fits(tile, p.experts, p.out_dtype), "grouped_gemm: tile ",
                grouped_gemm_tile_name(tile),
                " supports up to about 1000-8000 experts (its shared-memory tile table), got ", p.experts);
    return grouped_gemm_sm90(tile, p, stream);
  }
  switch (p.pass) {
    case Pass::forward:
      return dispatch_pass<Pass::forward>(tile, p, stream);
    case Pass::backward_input:
      return dispatch_pass<Pass::backward_input>(tile, p, stream);
    case Pass::backward_weight:
      return dispatch_pass<Pass::backward_weight>(tile, p, stream);
  }
}

}  // namespace

void grouped_gemm(const GroupedGemmParams& p, StreamHandle stream) {
  SLIME_CHECK(p.in_dtype == DType::bf16 || p.in_dtype == DType::f32, "grouped_gemm: inputs must be bf16 or f32, got ",
              dtype_name(p.in_dtype));
  SLIME_CHECK(p.out_dtype == p.in_dtype || p.out_dtype == DType::f32, "grouped_gemm: output must be ",
              dtype_name(p.in_dtype), " or f32, got ", dtype_name(p.out_dtype));
  SLIME_CHECK(p.pass != Pass::backward_weight || p.out_dtype == DType::f32, "grouped_gemm: dw must be f32");
  SLIME_CHECK(p.experts >= 1 && p.experts < INT_MAX && p.rows >= 0 && p.rows < INT_MAX && p.out_features >= 0 &&
                  p.out_features < INT_MAX - 256 && p.in_features >= 0 && p.in_features < INT_MAX - 256,
              "grouped_gemm: sizes must fit in int32 (experts ", p.experts, ", rows ", p.rows, ", out ", p.out_features,
              ", in ", p.in_features, ")");
  SLIME_CHECK(p.offsets != nullptr || (p.experts == 1 && p.host_offsets == nullptr),
              "grouped_gemm: null offsets stand for one group of all rows: they need experts = 1 (got ", p.experts,
              ") and no host offsets");
  const int64_t row_length = p.pass == Pass::forward ? p.out_features : p.in_features;
  SLIME_CHECK(p.ldc == 0 || (p.pass != Pass::backward_weight && p.ldc >= row_length && p.ldc < INT_MAX),
              "grouped_gemm: ldc ", p.ldc, " must be 0 or, for forward and backward_input, at least the row length ",
              row_length, " (and fit in int32)");
  SLIME_CHECK(p.alpha == 1.f || p.pass == Pass::forward, "grouped_gemm: alpha ", p.alpha,
              " is for the forward pass only");
  if (p.host_offsets != nullptr) check_grouped_gemm_host_offsets(p.host_offsets, p.experts, p.rows);
  if (grouped_gemm_backend_for(p) == GroupedGemmBackend::cublas) return grouped_gemm_cublas(p, stream);
  run_kernels(p, stream);
  if (p.alpha != 1.f) scale_output(p, stream);
}

}  // namespace slime::ops::cuda
