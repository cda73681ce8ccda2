// Hopper (sm_90a) grouped GEMM for slime/ops/cuda/grouped_gemm.hpp: wgmma fed
// by TMA through an mbarrier pipeline, two consumer warpgroups and one
// producer warp per CTA (warp specialisation). The three passes and
// their operand layouts are those of grouped_gemm.cu (the table at its top):
//   pass             A (M x K)              B (N x K)               K summed
//   forward          x_g       K-major      w_e [out, in] K-major    in
//   backward_input   dy_g      K-major      w_e [out, in] MN-major   out
//   backward_weight  dy_gᵀ     MN-major     x_g [n_e, in] MN-major   n_e
//
// CTA tile 128 x BN x 64 (BN = 256, 128 or 64; forward only, for few rows:
// 64 x BN x 64 with BN = 64, 32 or 16 and one consumer warpgroup). Shared memory holds kStages
// stages of [A 128 x 64 | B BN x 64], 128-byte swizzled (sm90.cuh): K-major
// tiles are one TMA box [rows][64 k]; MN-major tiles are boxes [64 k][64 mn]
// side by side, 8 KB each, so the A tile of either layout is two 8 KB halves
// and consumer warpgroup c (c = 0, 1) multiplies rows 64 c .. 64 c + 63 of the
// CTA tile by the whole B tile (wgmma m64nBNk16, BN / 2 fp32 accumulators
// per thread).
//
// Pipeline: full[s] completes when stage s's TMA bytes have landed (one
// arrive with expect_tx by the producer thread); empty[s] completes when all
// 256 consumer threads are done reading it. Consumers keep one k-step of
// wgmma in flight: after issuing step kt they wait for step kt - 1 and free
// its stage.
//
// Ragged groups without host offsets: the tensor maps cover whole tensors
// (x, dy [rows, features]; w [E, out, in] as 3-D, so that a k- or n-tile past
// an expert's extent reads zeros, not the next expert). Forward and dgrad A
// tiles start at any row; rows past the group belong to other groups and are
// computed but never stored. wgrad sums over the group's rows (K): the last
// k-step's rows past the group are zeroed in shared memory by the consumers
// before their wgmma (whole 128-byte rows, so the swizzle does not matter);
// rows past the tensor are zero-filled by TMA.
//
// Scheduling: one CTA per output tile, located from the device offsets as in
// grouped_gemm.cu (no host synchronisation); broken offsets trap, without the
// message that the mma.sync kernels print (see QuietTrap). Determinism: every output
// element is summed by one thread of one CTA in a fixed order: bitwise run to
// run; not bitwise equal to the mma.sync kernels (other k order inside a
// wgmma).
#include <cooperative_groups.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "grouped_gemm_common.cuh"
#include "slime/core/error.hpp"
#include "slime/ops/cuda/grouped_gemm.hpp"
#include "sm90.cuh"
#include "tensor_map.hpp"

namespace slime::ops::cuda {

GroupedGemmTile plain_tile_override();  // below: SLIME_GEMM_PLAIN_TILE

namespace {

using namespace ::slime::ops::detail::sm90;
using namespace ::slime::ops::detail::grouped_gemm_device;
using bf16 = __nv_bfloat16;
using Pass = GroupedGemmPass;

// CTA tile BM x BN x 64 with Stages pipeline stages and CtasPerSm CTAs
// resident per SM (2: one CTA's epilogue overlaps the other's main loop).
// BM / 64 consumer warpgroups (288 threads for BM = 128: consumer warpgroups
// 0 and 1, as wgmma needs warpgroups aligned to 4 warps), then one producer
// warp. No setmaxnreg: the register cap at entry
// (65536 / (288 * CtasPerSm)) already fits the consumers' BN / 2
// accumulators, and ptxas compiles the whole kernel to that cap.
// StagedStore: the epilogue writes full tiles through a shared-memory buffer
// and TMA stores (coalesced, asynchronous: the consumers go on with the next
// tile while the copy engine drains it), where the buffer fits in 64 KB.
// K chunks of a plain GEMM (the batch-invariant Linear, null offsets; opt-in,
// SLIME_GEMM_K_CHUNKS=1, see plain_k_chunks): each
// chunk of kKChunkTiles k-steps (256 of K) is summed in a fresh accumulator
// and the chunk sums are added in order, ((0 + c0) + c1) + ..., so that a call
// of few rows can give each chunk its own CTA (an f32 partial per chunk, then
// sum_k_splits_kernel adds them in the same order) and still equal, bit for
// bit, a call of many rows in which one CTA sums all chunks of a tile.
constexpr int kKChunkTiles = 4;

template <int BN, int Stages, int CtasPerSm, bool StagedStore, bool Chunked = false, int BM = 128>
struct Sm90Tile {
  static constexpr int kBM = BM, kBN = BN, kBK = 64;
  // Chunked: a second accumulator set (the running total), BN / 2 more
  // registers: BN <= 128.
  static constexpr bool kChunked = Chunked;
  static constexpr int kConsumers = 2 * BM, kThreads = kConsumers + 32;  // 128 threads per 64 rows
  static constexpr int kCtasPerSm = CtasPerSm;
  static constexpr int kBox = 64 * 64 * 2;               // one [64][64] bf16 box, 8 KB
  static constexpr int kABytes = kBM * kBK * 2;          // 16 or 8 KB
  static constexpr int kBBytes = kBN * kBK * 2;          // 32 to 2 KB
  static constexpr int kStageBytes = kABytes + kBBytes;  // multiple of 1024
  static constexpr int kStages = Stages;
  static constexpr int kAcc = BN / 2;  // fp32 accumulators per consumer thread
  // The staging buffer: for each consumer warpgroup, 64 rows x up to 32 KB
  // of its tile's columns as boxes of [64 rows][128 bytes], 128-byte
  // swizzled; a wider tile (BN = 256 of f32) is stored in c_passes passes
  // over column blocks (0: no staging, direct stores).
  template <class TOut>
  static constexpr int c_bytes() {
    constexpr int bytes = kBM * BN * int(sizeof(TOut));
    return StagedStore ? (bytes < 65536 ? bytes : 65536) : 0;
  }
  template <class TOut>
  static constexpr int c_passes() {
    return c_bytes<TOut>() == 0 ? 1 : kBM * BN * int(sizeof(TOut)) / c_bytes<TOut>();
  }
  template <class TOut>
  static constexpr int smem_bytes() {
    return kStages * kStageBytes + c_bytes<TOut>() + 1024;  // + alignment slack
  }
  static_assert(BN == 16 || BN == 32 || BN == 64 || BN == 128 || BN == 256, "wgmma m64nBNk16 per consumer warpgroup");
  static_assert(BM == 128 || (BM == 64 && !StagedStore && !Chunked), "64-row tiles: direct stores, one accumulator");
  static_assert(!Chunked || BN <= 128, "the chunked sum keeps two accumulator sets: BN <= 128");
  static_assert(smem_bytes<__nv_bfloat16>() * CtasPerSm <= 227 * 1024 && smem_bytes<float>() * CtasPerSm <= 227 * 1024,
                "fits the 227 KB of shared memory of a Hopper SM");
};
// Resources (ptxas -v, CUDA 13.0, sm_90a): 90-167 registers, no spills.
using Sm90M128N256 = Sm90Tile<256, 3, 1, true>;  // 144 KB of stages + 64 KB of staging (f32: 2 passes)
using Sm90M128N128 = Sm90Tile<128, 4, 1, true>;  // 128 KB + 32 (bf16) or 64 (f32) KB of staging
// Few rows (decode): each CTA streams its 64 weight rows alone, so it keeps
// 7 stages (56 KB of weights) in flight.
using Sm90M128N64 = Sm90Tile<64, 7, 1, true>;  // 168 KB + 16 (bf16) or 32 (f32) KB of staging
// The plain GEMM's tiles (K chunks, above).
using Sm90M128N128Chunked = Sm90Tile<128, 4, 1, true, true>;
using Sm90M128N64Chunked = Sm90Tile<64, 7, 1, true, true>;
// Forward only, few rows: one consumer warpgroup; a stage is 8 KB of x and
// 8, 4 or 2 KB of weights, and 12-16 of them keep 160-192 KB in flight per SM.
using Sm90M64N64 = Sm90Tile<64, 12, 1, false, false, 64>;
using Sm90M64N32 = Sm90Tile<32, 16, 1, false, false, 64>;
using Sm90M64N16 = Sm90Tile<16, 16, 1, false, false, 64>;

template <Pass kPass>
struct Sm90Layout {
  static constexpr bool kAKMajor = kPass != Pass::backward_weight;
  static constexpr bool kBKMajor = kPass == Pass::forward;
};

struct Sm90Params {
  const int32_t* offsets;  // null: one group of all rows
  void* c;
  int experts, rows, out_f, in_f;
  int m_tiles, n_tiles;  // backward_weight: per expert; others: n-tiles per m-tile (and the m-tiles of a plain GEMM)
  int64_t ldc;           // forward / backward_input: the row pitch of c
  bool accumulate;
  // forward: CTAs per output tile along K (1: one sums all of K; > 1: split
  // s sums K chunk s alone into partial [k_splits][rows][out_f] f32).
  int k_splits;
  float* partial;
  // forward, a plain GEMM of at most kMFastestTiles m-tiles (a decode step):
  // tiles in m-tile order first, so that the CTAs of one round share each
  // weight slab in L2 rather than re-reading it in the next round (lm_head at
  // 256 rows reads 65 MB of weights, more than L2 holds).
  bool m_fastest;
};
constexpr int kMFastestTiles = 8;

// Bytes of the per-CTA tile table (tile_start and row_start, E + 1 ints each)
// that follows the pipeline stages in dynamic shared memory.
inline int tile_table_bytes(int64_t experts) { return int(2 * (experts + 1) * sizeof(int)); }

// c[BN / 2]: one m64nBNk16 step on the operand tiles at a / b.
template <int BN, bool kAK, bool kBK>
__device__ __forceinline__ void mma_step(float (&d)[BN / 2], const unsigned char* a, const unsigned char* b, int kk) {
  // K-major: a k16 step is 32 bytes along the 128-byte row; MN-major: 16 rows.
  const uint64_t da = kAK ? make_desc_sw128(a + kk * 32, 16, 1024) : make_desc_sw128(a + kk * 2048, 8192, 1024);
  const uint64_t db = kBK ? make_desc_sw128(b + kk * 32, 16, 1024) : make_desc_sw128(b + kk * 2048, 8192, 1024);
  if constexpr (BN == 256) {
    wgmma_m64n256k16<kAK ? 0 : 1, kBK ? 0 : 1>(d, da, db, 1);
  } else if constexpr (BN == 128) {
    wgmma_m64n128k16<kAK ? 0 : 1, kBK ? 0 : 1>(d, da, db, 1);
  } else if constexpr (BN == 64) {
    wgmma_m64n64k16<kAK ? 0 : 1, kBK ? 0 : 1>(d, da, db, 1);
  } else if constexpr (BN == 32) {
    wgmma_m64n32k16<kAK ? 0 : 1, kBK ? 0 : 1>(d, da, db, 1);
  } else {
    wgmma_m64n16k16<kAK ? 0 : 1, kBK ? 0 : 1>(d, da, db, 1);
  }
}

// Where linear tile t lies: its group, the first row of A (wgrad: the first
// k row), the m / n origin and the extents left past them.
struct Sm90TileCoord {
  int group, m0, n0, a_row, k_len, m_valid, n_valid;
  int split, kt_begin, kt_end;  // the K split and its k-steps [kt_begin, kt_end)
};

// tile_start[e] = tiles of the groups before e (tile_start[E] = all);
// row_start[e] = offsets[e]. The group of tile t is the last e with
// tile_start[e] <= t (a group without tiles shares its start with the next).
template <class T, Pass kPass>
__device__ __forceinline__ Sm90TileCoord locate(const int* tile_start, const int* row_start, const Sm90Params& p,
                                                int t) {
  int lo = 0, hi = p.experts;  // tile_start[lo] <= t < tile_start[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (tile_start[mid] <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  Sm90TileCoord c;
  c.group = lo;
  int local = t - tile_start[lo];
  const int r0 = row_start[lo], n_e = row_start[lo + 1] - r0;
  c.split = 0;
  if constexpr (kPass == Pass::forward) {
    c.split = local % p.k_splits;
    local /= p.k_splits;
  }
  if (kPass == Pass::forward && p.m_fastest) {
    c.m0 = (local % p.m_tiles) * T::kBM;
    c.n0 = (local / p.m_tiles) * T::kBN;
  } else {
    c.m0 = (local / p.n_tiles) * T::kBM;
    c.n0 = (local % p.n_tiles) * T::kBN;
  }
  if constexpr (kPass == Pass::backward_weight) {
    c.a_row = r0;
    c.k_len = n_e;
    c.m_valid = p.out_f - c.m0;
    c.n_valid = p.in_f - c.n0;
  } else {
    c.a_row = r0 + c.m0;
    c.k_len = kPass == Pass::forward ? p.in_f : p.out_f;
    c.m_valid = n_e - c.m0;
    c.n_valid = (kPass == Pass::forward ? p.out_f : p.in_f) - c.n0;
  }
  const int k_tiles = (c.k_len + T::kBK - 1) / T::kBK;
  c.kt_begin = 0;
  c.kt_end = k_tiles;
  if (kPass == Pass::forward && p.k_splits > 1) {
    c.kt_begin = min(c.split * kKChunkTiles, k_tiles);
    c.kt_end = min(c.kt_begin + kKChunkTiles, k_tiles);
  }
  return c;
}

// Persistent: CTA b runs tiles b, b + gridDim.x, ... of the linearised list
// (group-major, then m-tile, then n-tile, so that neighbouring tiles share A
// rows or weights in L2). The producer runs ahead into the next tile while
// the consumers store the last one.
template <class T, Pass kPass, class TOut>
__global__ void __launch_bounds__(T::kThreads, T::kCtasPerSm)
    grouped_gemm_sm90_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                             const __grid_constant__ CUtensorMap map_c, const Sm90Params p) {
#if SLIME_SM90A
  constexpr int BN = T::kBN;
  constexpr int kBM = T::kBM, kBK = T::kBK, kStages = T::kStages;
  constexpr bool kAK = Sm90Layout<kPass>::kAKMajor, kBKm = Sm90Layout<kPass>::kBKMajor;

  extern __shared__ __align__(1024) unsigned char sm90_smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[kStages];
  __shared__ __align__(8) uint64_t empty_bar[kStages];
  __shared__ int s_scan[T::kThreads / 32];
  unsigned char* smem = sm90_smem_raw + ((1024 - (smem_u32(sm90_smem_raw) & 1023)) & 1023);
  constexpr int kCBytes = T::template c_bytes<TOut>();
  unsigned char* smem_c = smem + kStages * T::kStageBytes;  // [2 warpgroups][boxes][64][128 bytes]
  int* tile_start = reinterpret_cast<int*>(smem_c + kCBytes);
  int* row_start = tile_start + p.experts + 1;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full_bar[s], 1);
      mbar_init(&empty_bar[s], T::kConsumers);
    }
    mbar_init_fence();
    if (group_offset(p.offsets, 0, p.rows) != 0 || group_offset(p.offsets, p.experts, p.rows) != p.rows)
      QuietTrap{}("offsets[0] or offsets[E]", 0, 0, 0);
  }
  // ---- the tile table: a block-wide scan of the tiles per group
  int carry = 0;
  for (int base = 0; base < p.experts; base += T::kThreads) {
    const int e = base + tid;
    int tiles = 0;
    if (e < p.experts) {
      const int r0 = group_offset(p.offsets, e, p.rows), n = group_offset(p.offsets, e + 1, p.rows) - r0;
      if (n < 0) QuietTrap{}("offsets decrease", e, r0, r0 + n);
      row_start[e] = r0;
      tiles = kPass == Pass::backward_weight
                  ? (n > 0 ? p.m_tiles * p.n_tiles : 0)
                  : (n + kBM - 1) / kBM * p.n_tiles * (kPass == Pass::forward ? p.k_splits : 1);
    }
    const int incl = warp_inclusive_scan(tiles, lane);
    if (lane == 31) s_scan[warp] = incl;
    __syncthreads();
    int before = carry, chunk = 0;
#pragma unroll
    for (int w = 0; w < T::kThreads / 32; ++w) {
      const int v = s_scan[w];
      before += w < warp ? v : 0;
      chunk += v;
    }
    if (e < p.experts) tile_start[e] = before + incl - tiles;
    carry += chunk;
    __syncthreads();
  }
  if (tid == 0) {
    tile_start[p.experts] = carry;
    row_start[p.experts] = p.rows;
  }
  __syncthreads();
  const int total_tiles = carry;

  if (tid >= T::kConsumers) {
    // ---- producer: one thread issues every copy
    if (tid == T::kConsumers) {
      tma_prefetch_descriptor(&map_a);
      tma_prefetch_descriptor(&map_b);
      int it = 0;  // k-steps this CTA has issued: the position in the stage ring
      for (int t = int(blockIdx.x); t < total_tiles; t += int(gridDim.x)) {
        const Sm90TileCoord tc = locate<T, kPass>(tile_start, row_start, p, t);
        for (int kt = tc.kt_begin; kt < tc.kt_end; ++kt, ++it) {
          const int s = it % kStages;
          mbar_wait(&empty_bar[s], ((it / kStages) & 1) ^ 1);
          unsigned char* sa = smem + s * T::kStageBytes;
          unsigned char* sb = sa + T::kABytes;
          uint64_t* bar = &full_bar[s];
          mbar_arrive_expect_tx(bar, T::kStageBytes);
          const int k0 = kt * kBK;
          if constexpr (kPass == Pass::forward) {
            tma_load_2d(sa, &map_a, bar, k0, tc.a_row);         // x [rows, in]: box {64 k, BM rows}
            tma_load_3d(sb, &map_b, bar, k0, tc.n0, tc.group);  // w [E, out, in]: box {64 k, BN n, 1}
          } else if constexpr (kPass == Pass::backward_input) {
            tma_load_2d(sa, &map_a, bar, k0, tc.a_row);  // dy [rows, out]: box {64 k, 128 rows}
#pragma unroll
            for (int j = 0; j < BN / 64; ++j)  // w [E, out, in]: boxes {64 n, 64 k, 1}
              tma_load_3d(sb + j * T::kBox, &map_b, bar, tc.n0 + 64 * j, k0, tc.group);
          } else {
#pragma unroll
            for (int j = 0; j < 2; ++j)  // dy [rows, out]: boxes {64 m, 64 k}
              tma_load_2d(sa + j * T::kBox, &map_a, bar, tc.m0 + 64 * j, tc.a_row + k0);
#pragma unroll
            for (int j = 0; j < BN / 64; ++j)  // x [rows, in]: boxes {64 n, 64 k}
              tma_load_2d(sb + j * T::kBox, &map_b, bar, tc.n0 + 64 * j, tc.a_row + k0);
          }
        }
      }
    }
  } else {
    // ---- consumers: warpgroup c owns rows 64 c .. 64 c + 63 of each tile (c = 0 only for BM = 64)
    const int c = tid / 128, wq = warp & 3;
    int it = 0;
    for (int t = int(blockIdx.x); t < total_tiles; t += int(gridDim.x)) {
      const Sm90TileCoord tc = locate<T, kPass>(tile_start, row_start, p, t);
      const int k_steps = tc.kt_end - tc.kt_begin;
      float acc[T::kAcc];
      float total[T::kChunked ? T::kAcc : 1];  // chunked: the sum of the finished chunks
#pragma unroll
      for (int i = 0; i < T::kAcc; ++i) acc[i] = 0.f;
      if constexpr (T::kChunked) {
#pragma unroll
        for (int i = 0; i < T::kAcc; ++i) total[i] = 0.f;
      }
      for (int kt = tc.kt_begin; kt < tc.kt_end; ++kt, ++it) {
        if constexpr (T::kChunked) {
          // A new chunk: add the last one (all its wgmmas done) to the total
          // and start from zeros.
          if (kt > tc.kt_begin && kt % kKChunkTiles == 0) {
            wgmma_wait<0>();
            fence_registers(acc);
#pragma unroll
            for (int i = 0; i < T::kAcc; ++i) {
              total[i] += acc[i];
              acc[i] = 0.f;
            }
          }
        }
        const int s = it % kStages;
        mbar_wait(&full_bar[s], (it / kStages) & 1);
        unsigned char* sa = smem + s * T::kStageBytes;
        const unsigned char* sb = sa + T::kABytes;
        if constexpr (kPass == Pass::backward_weight) {
          const int valid = tc.k_len - kt * kBK;
          if (valid < kBK) {
            // Zero the k rows past the group in every box of the stage (A's 2
            // and B's BN / 64, contiguous): whole 128-byte rows.
            constexpr int kBoxes = 2 + BN / 64;
            const int chunks_per_box = (kBK - valid) * 8;  // 16-byte chunks
            for (int i = tid; i < kBoxes * chunks_per_box; i += T::kConsumers) {
              const int box = i / chunks_per_box, rem = i % chunks_per_box;
              *reinterpret_cast<uint4*>(sa + box * T::kBox + valid * 128 + rem * 16) = make_uint4(0, 0, 0, 0);
            }
            fence_proxy_async();
            named_barrier_sync(1, T::kConsumers);
          }
        }
        const unsigned char* a = sa + c * T::kBox;  // rows 64 c..: 64 K-major rows or the c-th MN-major box
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) mma_step<BN, kAK, kBKm>(acc, a, sb, kk);
        wgmma_commit();
        wgmma_wait<1>();
        fence_registers(acc);
        if (kt > tc.kt_begin) mbar_arrive(&empty_bar[(it - 1) % kStages]);
      }
      wgmma_wait<0>();
      fence_registers(acc);
      if (k_steps > 0) mbar_arrive(&empty_bar[(it - 1) % kStages]);
      if constexpr (T::kChunked) {
#pragma unroll
        for (int i = 0; i < T::kAcc; ++i) acc[i] = total[i] + acc[i];  // the last chunk; acc holds the result
      }

      // ---- a K split's partial: f32, direct stores (sum_k_splits_kernel adds them in order)
      if (kPass == Pass::forward && p.k_splits > 1) {
        float* gP = p.partial + (int64_t(tc.split) * p.rows + tc.a_row) * p.out_f + tc.n0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = 64 * c + 16 * wq + (lane >> 2) + 8 * h;
          if (row >= tc.m_valid) continue;
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) {
            const int col = 8 * j + 2 * (lane & 3);
            if (col < tc.n_valid)
              *reinterpret_cast<float2*>(gP + int64_t(row) * p.out_f + col) =
                  make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
          }
        }
        continue;
      }

      // ---- epilogue
      // Staged (full tiles; wgrad's 3-D dw map clips rows and columns past
      // the expert): registers -> the warpgroup's swizzled boxes -> one TMA
      // store (add for f32 accumulation). A partial m-tile of forward / dgrad
      // would overwrite the next group's rows, and bf16 accumulation must
      // round once: those store from registers.
      constexpr bool kAddF32 = std::is_same_v<TOut, float>;
      const bool accumulate = kPass == Pass::backward_weight || (kPass == Pass::backward_input && p.accumulate);
      const bool staged =
          kCBytes > 0 && (kPass == Pass::backward_weight || tc.m_valid >= kBM) && (!accumulate || kAddF32);
      if (staged) {
        constexpr int kBoxCols = 128 / int(sizeof(TOut));  // columns per box
        constexpr int kPasses = T::template c_passes<TOut>();
        constexpr int kPassCols = BN / kPasses;  // columns per pass
        constexpr int kBoxes = kPassCols / kBoxCols;
        unsigned char* cbuf = smem_c + c * (kCBytes / 2);
        const bool leader = (tid & 127) == 0;
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass) {
          if (leader) bulk_wait_read<0>();  // the last store has read the buffer
          named_barrier_sync(2 + c, 128);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = 16 * wq + (lane >> 2) + 8 * h;  // row within the warpgroup's 64
#pragma unroll
            for (int jj = 0; jj < kPassCols / 8; ++jj) {
              const int j = pass * (kPassCols / 8) + jj;
              const int col = 8 * jj + 2 * (lane & 3);  // column within the pass
              const int box = col / kBoxCols, byte = (col % kBoxCols) * int(sizeof(TOut));
              unsigned char* dst = cbuf + box * 8192 + r * 128 + (((byte >> 4) ^ (r & 7)) << 4) + (byte & 15);
              if constexpr (kAddF32) {
                *reinterpret_cast<float2*>(dst) = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
              } else {
                *reinterpret_cast<__nv_bfloat162*>(dst) =
                    __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
              }
            }
          }
          fence_proxy_async();
          named_barrier_sync(2 + c, 128);
          if (leader) {
#pragma unroll
            for (int b = 0; b < kBoxes; ++b) {
              const unsigned char* src = cbuf + b * 8192;
              const int col0 = tc.n0 + pass * kPassCols + b * kBoxCols;
              if constexpr (kPass == Pass::backward_weight) {
                tma_store_add_3d(&map_c, src, col0, tc.m0 + 64 * c, tc.group);  // dw [E, out, in]
              } else if (accumulate) {
                tma_store_add_2d(&map_c, src, col0, tc.a_row + 64 * c);
              } else {
                tma_store_2d(&map_c, src, col0, tc.a_row + 64 * c);
              }
            }
            bulk_commit();
          }
        }
        continue;
      }
      // Direct: registers to global, 2 columns per store.
      int64_t ldc;
      TOut* gC;
      if constexpr (kPass == Pass::backward_weight) {
        ldc = p.in_f;
        gC = static_cast<TOut*>(p.c) + (int64_t(tc.group) * p.out_f + tc.m0) * p.in_f + tc.n0;
      } else {
        ldc = p.ldc;
        gC = static_cast<TOut*>(p.c) + int64_t(tc.a_row) * ldc + tc.n0;
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = 64 * c + 16 * wq + (lane >> 2) + 8 * h;
        if (row >= tc.m_valid) continue;
        TOut* crow = gC + int64_t(row) * ldc;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const int col = 8 * j + 2 * (lane & 3);
          if (col < tc.n_valid) store_pair(crow + col, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1], accumulate);
        }
      }
    }
    if (kCBytes > 0 && (tid & 127) == 0) bulk_wait<0>();  // the stores are done before the CTA exits
  }
#else
  __trap();  // built without sm_90a; the dispatcher never launches this
#endif
}

// ---- tensor maps --------------------------------------------------------------------

// A bf16 (or f32) tensor map, 128-byte swizzle (tensor_map.hpp).
CUtensorMap make_tensor_map(const void* base, int rank, const uint64_t* dims, const uint64_t* strides,
                            const uint32_t* box, CUtensorMapDataType dtype = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16) {
  return ::slime::ops::detail::tma::make_tensor_map("grouped_gemm", base, rank, dims, strides, box, dtype);
}
// pitch: elements per row (0: inner).
CUtensorMap map_2d(const void* base, uint64_t inner, uint64_t outer, uint32_t box_inner, uint32_t box_outer,
                   bool f32 = false, uint64_t pitch = 0) {
  const uint64_t dims[2] = {inner, outer}, strides[1] = {(pitch != 0 ? pitch : inner) * (f32 ? 4 : 2)};
  const uint32_t box[2] = {box_inner, box_outer};
  return make_tensor_map(base, 2, dims, strides, box,
                         f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16);
}

// w [E, out, in] as 3-D (in, out, E).
CUtensorMap map_weights(const void* base, uint64_t in_f, uint64_t out_f, uint64_t experts, uint32_t box_in,
                        uint32_t box_out) {
  const uint64_t dims[3] = {in_f, out_f, experts}, strides[2] = {in_f * 2, in_f * out_f * 2};
  const uint32_t box[3] = {box_in, box_out, 1};
  return make_tensor_map(base, 3, dims, strides, box);
}

// dw [E, out, in] f32 as 3-D, boxes {32 in, 64 out, 1} (the staged epilogue's).
CUtensorMap map_dw(void* base, uint64_t in_f, uint64_t out_f, uint64_t experts) {
  const uint64_t dims[3] = {in_f, out_f, experts}, strides[2] = {in_f * 4, in_f * out_f * 4};
  const uint32_t box[3] = {32, 64, 1};
  return make_tensor_map(base, 3, dims, strides, box, CU_TENSOR_MAP_DATA_TYPE_FLOAT32);
}

int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

template <class T, Pass kPass, class TOut>
void launch_sm90(const GroupedGemmParams& p, cudaStream_t stream, int k_splits = 1, float* partial = nullptr) {
  constexpr int BN = T::kBN;
  const uint64_t rows = uint64_t(p.rows), in_f = uint64_t(p.in_features), out_f = uint64_t(p.out_features),
                 experts = uint64_t(p.experts);
  CUtensorMap ma, mb, mc{};
  constexpr bool kF32 = std::is_same_v<TOut, float>;
  if constexpr (T::template c_bytes<TOut>() > 0) {  // the staged epilogue's map of c: boxes of [64 rows][128 bytes]
    if constexpr (kPass == Pass::backward_weight)
      mc = map_dw(p.c, in_f, out_f, experts);
    else
      mc = map_2d(p.c, kPass == Pass::forward ? out_f : in_f, rows, kF32 ? 32 : 64, 64, kF32,
                  uint64_t(grouped_gemm_output_pitch(p)));
  }
  Sm90Params kp{};
  kp.offsets = p.offsets;
  kp.c = p.c;
  kp.experts = int(p.experts);
  kp.rows = int(p.rows);
  kp.out_f = int(p.out_features);
  kp.in_f = int(p.in_features);
  kp.accumulate = p.accumulate;
  kp.k_splits = k_splits;
  kp.partial = partial;
  kp.ldc = grouped_gemm_output_pitch(p);
  int64_t ctas;  // an upper bound of the tiles
  if constexpr (kPass == Pass::forward) {
    ma = map_2d(p.a, in_f, rows, 64, T::kBM);
    mb = map_weights(p.b, in_f, out_f, experts, 64, BN);
  } else if constexpr (kPass == Pass::backward_input) {
    ma = map_2d(p.a, out_f, rows, 64, 128);
    mb = map_weights(p.b, in_f, out_f, experts, 64, 64);
  } else {
    ma = map_2d(p.a, out_f, rows, 64, 64);
    mb = map_2d(p.b, in_f, rows, 64, 64);
  }
  if constexpr (kPass == Pass::backward_weight) {
    kp.m_tiles = ceil_div(p.out_features, T::kBM);
    kp.n_tiles = ceil_div(p.in_features, BN);
    ctas = p.experts * kp.m_tiles * kp.n_tiles;
  } else {
    kp.n_tiles = ceil_div(kPass == Pass::forward ? p.out_features : p.in_features, BN);
    ctas = (int64_t(ceil_div(p.rows, T::kBM)) + p.experts) * kp.n_tiles * k_splits;
    if (kPass == Pass::forward && p.offsets == nullptr && ceil_div(p.rows, T::kBM) <= kMFastestTiles) {
      kp.m_tiles = ceil_div(p.rows, T::kBM);
      kp.m_fastest = true;
    }
  }
  SLIME_CHECK(ctas < INT_MAX, "grouped_gemm: ", ctas, " tiles do not fit in int32");
  if (ctas == 0) return;
  const int grid = int(std::min<int64_t>(ctas, int64_t(::slime::ops::detail::tma::sm_count()) * T::kCtasPerSm));
  const int smem = T::template smem_bytes<TOut>() + tile_table_bytes(p.experts);
  auto kernel = grouped_gemm_sm90_kernel<T, kPass, TOut>;
  SLIME_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<unsigned(grid), T::kThreads, smem, stream>>>(ma, mb, mc, kp);
  SLIME_CUDA_CHECK_LAUNCH();
}

// c[r, j] = (0 + partial[0][r][j]) + partial[1][r][j] + ... (the order in
// which one CTA adds its chunk sums), rounded once to TOut.
template <class TOut>
__global__ void sum_k_splits_kernel(const float* __restrict__ partial, TOut* c, int splits, int64_t rows, int64_t n,
                                    int64_t ldc) {
  const int64_t total = rows * n;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    float t = 0.f;
    for (int s = 0; s < splits; ++s) t += partial[int64_t(s) * total + i];
    TOut* dst = c + (i / n) * ldc + i % n;
    if constexpr (std::is_same_v<TOut, float>) {
      *dst = t;
    } else {
      *dst = __float2bfloat16_rn(t);
    }
  }
}

// ---- K chunks side by side: the plain GEMM of few rows with K chunks ----------------
// A 64 x BN output tile per CTA whose K chunks (kKChunkTiles k-steps, 256 of
// K) go round-robin to kWG consumer warpgroups: chunk i to warpgroup i % kWG,
// each warpgroup with its own stage ring fed by its own producer warp, so that
// kWG chunks' wgmma chains (16 dependent m64nBNk16 steps each) run at once
// where one CTA would run them one after another. Each chunk is summed in a
// fresh accumulator; the chunk sums are added in order, ((0 + c0) + c1) + ...,
// in a shared f32 tile that a turn counter hands from the warpgroup of chunk i
// to that of chunk i + 1; the warpgroup of the last chunk stores the result
// from its registers. Those are the sums of the chunked one-CTA tiles above,
// bit for bit, without the K split's f32 partials in global memory and second
// kernel. Shared memory: kWG rings of Stages x [x 64 x 64 | w BN x 64] and the
// running total (128 threads x BN / 2 floats, thread-major).
template <int BN, int WG, int Stages>
struct Sm90ChunkTile {
  static constexpr int kBM = 64, kBN = BN, kBK = 64, kWG = WG, kStages = Stages;
  static constexpr int kThreads = WG * (128 + 32);  // WG consumer warpgroups, then WG producer warps
  static constexpr int kABytes = kBM * kBK * 2, kBBytes = BN * kBK * 2, kStageBytes = kABytes + kBBytes;
  static constexpr int kRingBytes = Stages * kStageBytes;
  static constexpr int kAcc = BN / 2;
  static constexpr int kTotalBytes = 128 * kAcc * 4;
  static constexpr int smem_bytes() { return WG * kRingBytes + kTotalBytes + 1024; }
  static_assert(kStageBytes % 1024 == 0, "128-byte swizzled stages start at 1024-byte boundaries");
  static_assert(smem_bytes() <= 227 * 1024, "fits the 227 KB of shared memory of a Hopper SM");
};
using Sm90ChunkN64 = Sm90ChunkTile<64, 4, 3>;  // 192 KB of rings + 16 KB of total
using Sm90ChunkN32 = Sm90ChunkTile<32, 4, 4>;  // 192 + 8
using Sm90ChunkN16 = Sm90ChunkTile<16, 4, 4>;  // 160 + 4

// One K chunk of a 64-row K-major tile: k-steps [kt_begin, kt_end) summed
// into acc from zeros, read from a ring of kStages stages (x [64][64], then
// the weights [BN][64]) behind full / empty barriers; `it` counts the ring's
// k-steps. Every stage read is freed by the time it returns.
template <int BN, int kStages, int kStageBytes>
__device__ __forceinline__ void sum_chunk(float (&acc)[BN / 2], const unsigned char* ring, uint64_t* full,
                                          uint64_t* empty, int kt_begin, int kt_end, int& it) {
  constexpr int kABytes = 64 * 64 * 2;
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  for (int kt = kt_begin; kt < kt_end; ++kt, ++it) {
    const int s = it % kStages;
    mbar_wait(&full[s], (it / kStages) & 1);
    const unsigned char* sa = ring + s * kStageBytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) mma_step<BN, true, true>(acc, sa, sa + kABytes, kk);
    wgmma_commit();
    wgmma_wait<1>();
    fence_registers(acc);
    if (kt > kt_begin) mbar_arrive(&empty[(it - 1) % kStages]);
  }
  wgmma_wait<0>();
  fence_registers(acc);
  if (kt_end > kt_begin) mbar_arrive(&empty[(it - 1) % kStages]);
}

template <class T, class TOut>
__global__ void __launch_bounds__(T::kThreads, 1)
    plain_chunks_sm90_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                             const Sm90Params p) {
#if SLIME_SM90A
  constexpr int BN = T::kBN, kStages = T::kStages, kWG = T::kWG;
  extern __shared__ __align__(1024) unsigned char sm90_smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[kWG][kStages];
  __shared__ __align__(8) uint64_t empty_bar[kWG][kStages];
  __shared__ int turn_storage;  // chunks handed on so far (over this CTA's tiles)
  volatile int* turn = &turn_storage;
  unsigned char* smem = sm90_smem_raw + ((1024 - (smem_u32(sm90_smem_raw) & 1023)) & 1023);
  float* total = reinterpret_cast<float*>(smem + kWG * T::kRingBytes);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
    for (int w = 0; w < kWG; ++w)
      for (int s = 0; s < kStages; ++s) {
        mbar_init(&full_bar[w][s], 1);
        mbar_init(&empty_bar[w][s], 128);
      }
    *turn = 0;
    mbar_init_fence();
  }
  __syncthreads();
  const int k_tiles = (p.in_f + T::kBK - 1) / T::kBK;
  const int chunks = (k_tiles + kKChunkTiles - 1) / kKChunkTiles;
  const int total_tiles = p.m_tiles * p.n_tiles;

  if (warp >= 4 * kWG) {
    // ---- producer warp w: ring w, the k-steps of chunks w, w + kWG, ...
    const int w = warp - 4 * kWG;
    if (lane == 0) {
      tma_prefetch_descriptor(&map_a);
      tma_prefetch_descriptor(&map_b);
      int it = 0;
      for (int t = int(blockIdx.x); t < total_tiles; t += int(gridDim.x)) {
        const int m0 = (t / p.n_tiles) * T::kBM, n0 = (t % p.n_tiles) * BN;
        for (int ch = w; ch < chunks; ch += kWG) {
          const int kt_end = min((ch + 1) * kKChunkTiles, k_tiles);
          for (int kt = ch * kKChunkTiles; kt < kt_end; ++kt, ++it) {
            const int s = it % kStages;
            mbar_wait(&empty_bar[w][s], ((it / kStages) & 1) ^ 1);
            unsigned char* sa = smem + w * T::kRingBytes + s * T::kStageBytes;
            uint64_t* bar = &full_bar[w][s];
            mbar_arrive_expect_tx(bar, T::kStageBytes);
            tma_load_2d(sa, &map_a, bar, kt * T::kBK, m0);                  // x [rows, in]: box {64 k, 64 rows}
            tma_load_3d(sa + T::kABytes, &map_b, bar, kt * T::kBK, n0, 0);  // w [1, out, in]: box {64 k, BN n, 1}
          }
        }
      }
    }
    return;
  }
  // ---- consumer warpgroup w
  const int w = warp / 4, wq = warp & 3, t128 = tid & 127;
  float* my_total = total + t128;  // element j of this thread's part: my_total[128 j]
  int it = 0, base = 0;            // base: *turn at the start of this tile
  for (int t = int(blockIdx.x); t < total_tiles; t += int(gridDim.x), base += chunks) {
    const int m0 = (t / p.n_tiles) * T::kBM, n0 = (t % p.n_tiles) * BN;
    float acc[T::kAcc];
    bool stores = false;
    for (int ch = w; ch < chunks; ch += kWG) {
      const int kt_begin = ch * kKChunkTiles, kt_end = min(kt_begin + kKChunkTiles, k_tiles);
      sum_chunk<BN, kStages, T::kStageBytes>(acc, smem + w * T::kRingBytes, full_bar[w], empty_bar[w], kt_begin, kt_end,
                                             it);
      // Chunk ch's turn: the total holds (0 + c0) + ... + c(ch-1).
      while (*turn != base + ch) {
      }
      __threadfence_block();
#pragma unroll
      for (int j = 0; j < T::kAcc; ++j) {
        acc[j] = (ch == 0 ? 0.f : my_total[128 * j]) + acc[j];
        if (ch + 1 < chunks) my_total[128 * j] = acc[j];
      }
      named_barrier_sync(2 + w, 128);  // the warpgroup's part of the total is written
      if (t128 == 0) {
        __threadfence_block();
        *turn = base + ch + 1;
      }
      stores = ch == chunks - 1;
    }
    if (!stores) continue;
    // ---- epilogue (the warpgroup of the last chunk): registers to global
    const int m_valid = p.rows - m0, n_valid = p.out_f - n0;
    TOut* gC = static_cast<TOut*>(p.c) + int64_t(m0) * p.ldc + n0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 16 * wq + (lane >> 2) + 8 * h;
      if (row >= m_valid) continue;
      TOut* crow = gC + int64_t(row) * p.ldc;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int col = 8 * j + 2 * (lane & 3);
        if (col < n_valid) store_pair(crow + col, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1], false);
      }
    }
  }
#else
  __trap();  // built without sm_90a; the dispatcher never launches this
#endif
}

// The kernel parameters of a plain GEMM (one group, null offsets) on tiles T.
template <class T>
Sm90Params plain_params(const GroupedGemmParams& p, int k_splits) {
  Sm90Params kp{};
  kp.c = p.c;
  kp.experts = 1;
  kp.rows = int(p.rows);
  kp.out_f = int(p.out_features);
  kp.in_f = int(p.in_features);
  kp.ldc = grouped_gemm_output_pitch(p);
  kp.m_tiles = ceil_div(p.rows, T::kBM);
  kp.n_tiles = ceil_div(p.out_features, T::kBN);
  kp.k_splits = k_splits;
  return kp;
}

template <class T, class TOut>
void launch_plain_chunks_sm90(const GroupedGemmParams& p, cudaStream_t stream) {
  const Sm90Params kp = plain_params<T>(p, 1);
  const int64_t tiles = int64_t(kp.m_tiles) * kp.n_tiles;
  SLIME_CHECK(tiles < INT_MAX, "grouped_gemm: ", tiles, " tiles do not fit in int32");
  const CUtensorMap ma = map_2d(p.a, uint64_t(p.in_features), uint64_t(p.rows), 64, T::kBM);
  const CUtensorMap mb = map_weights(p.b, uint64_t(p.in_features), uint64_t(p.out_features), 1, 64, T::kBN);
  const int grid = int(std::min<int64_t>(tiles, ::slime::ops::detail::tma::sm_count()));
  auto kernel = plain_chunks_sm90_kernel<T, TOut>;
  SLIME_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::smem_bytes()));
  kernel<<<unsigned(grid), T::kThreads, T::smem_bytes(), stream>>>(ma, mb, kp);
  SLIME_CUDA_CHECK_LAUNCH();
}

// SLIME_GEMM_K_CHUNKS=1 runs the plain GEMM on the chunked tiles (the
// 64-row ones with their chunks side by side; n64 splits K over CTAs for
// more rows); by default it sums K in one accumulator. Opt-in: on an H100
// the chunks cost the mode's FSDP step about 1.5 points more and left decode
// within noise, even side by side in one CTA (bench/RESULTS.md, "64-row tiles
// for a decode step's GEMMs").
bool plain_k_chunks() {
  static const bool on = [] {
    const char* v = std::getenv("SLIME_GEMM_K_CHUNKS");
    return v != nullptr && std::string_view(v) == "1";
  }();
  return on;
}

// ---- K chunks over a cluster: the plain GEMM of few rows ------------------------------
// A 64 x BN output tile per cluster of C CTAs (cluster dims (C, 1, 1), C = p.k_splits,
// 2..8). CTA r of the cluster sums the tile's K chunks [r q, (r + 1) q)
// (q = ceil(chunks / C); kKChunkTiles k-steps, 256 of K, per chunk), each in a
// fresh accumulator, and sends each chunk sum's rows to the CTA that finishes
// them: CTA o owns rows [o R, (o + 1) R) of the tile (R = ceil(64 / C)) and
// receives every chunk's sum of its rows into its shared memory, f32
// [chunks][R][BN + 8], by stores into distributed shared memory (pushed, so
// that no CTA waits on a remote load). After a cluster barrier each CTA adds
// its rows' chunk sums in chunk order, ((0 + c0) + c1) + ..., from its own
// shared memory and rounds once. Those are the sums of the chunked one-CTA
// tiles bit for bit. Each CTA loads only its chunks' share of x and of the
// weights: a call with fewer tiles than SMs (a decode step) spreads its
// loading over C times as many SMs, with no f32 partials in global memory and
// no second kernel (the K split above needs both).
template <int BN, int Stages>
struct Sm90ClusterKTile {
  static constexpr int kBM = 64, kBN = BN, kBK = 64, kStages = Stages;
  static constexpr int kThreads = 128 + 32;  // one consumer warpgroup, one producer warp
  static constexpr int kABytes = kBM * kBK * 2, kBBytes = BN * kBK * 2, kStageBytes = kABytes + kBBytes;
  static constexpr int kAcc = BN / 2;
  // Row pitch of a received chunk sum in floats (+ 8: a warp's float2 stores
  // of 8 rows fall in different banks).
  static constexpr int kSumPitch = BN + 8;
  // Dynamic shared memory: 227 KB per SM less 1 KB for the static barriers.
  static constexpr int kMaxSmem = 227 * 1024 - 1024;
  // The stages, the received chunk sums of R rows, the alignment slack.
  static constexpr int smem_bytes(int chunks, int rows_owned) {
    return Stages * kStageBytes + chunks * rows_owned * kSumPitch * 4 + 1024;
  }
  static_assert(kStageBytes % 1024 == 0, "128-byte swizzled stages start at 1024-byte boundaries");
};
using Sm90ClusterKN128 = Sm90ClusterKTile<128, 4>;  // 96 KB of stages
using Sm90ClusterKN64 = Sm90ClusterKTile<64, 6>;    // 96 KB
using Sm90ClusterKN32 = Sm90ClusterKTile<32, 8>;    // 96 KB

template <class T, class TOut>
__global__ void __launch_bounds__(T::kThreads, 1)
    plain_cluster_k_sm90_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                                const Sm90Params p) {
#if SLIME_SM90A
  namespace cg = cooperative_groups;
  constexpr int BN = T::kBN, kStages = T::kStages, kPitch = T::kSumPitch;
  extern __shared__ __align__(1024) unsigned char sm90_smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[kStages];
  __shared__ __align__(8) uint64_t empty_bar[kStages];
  unsigned char* smem = sm90_smem_raw + ((1024 - (smem_u32(sm90_smem_raw) & 1023)) & 1023);
  float* received = reinterpret_cast<float*>(smem + kStages * T::kStageBytes);  // [chunks][R][kPitch]

  const cg::cluster_group cluster = cg::this_cluster();
  const int C = p.k_splits, rank = int(cluster.block_rank());
  const int R = (T::kBM + C - 1) / C;  // rows owned per CTA
  // Tiles m fastest: neighbouring clusters share a slab of weights in L2.
  const int tile = int(blockIdx.x) / C;
  const int m0 = (tile % p.m_tiles) * T::kBM, n0 = (tile / p.m_tiles) * BN;
  const int m_valid = p.rows - m0, n_valid = p.out_f - n0;
  const int k_tiles = (p.in_f + T::kBK - 1) / T::kBK;
  const int chunks = (k_tiles + kKChunkTiles - 1) / kKChunkTiles, q = (chunks + C - 1) / C;
  const int ch_begin = min(rank * q, chunks), ch_end = min(ch_begin + q, chunks);
  const int kt_begin = ch_begin * kKChunkTiles, kt_end = min(ch_end * kKChunkTiles, k_tiles);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full_bar[s], 1);
      mbar_init(&empty_bar[s], 128);
    }
    mbar_init_fence();
  }
  // Every CTA of the cluster has started (its shared memory may take the
  // peers' stores) and its barriers are initialised.
  cluster.sync();

  if (warp == 4) {
    // ---- producer: this CTA's k-steps, x [rows, in] box {64 k, 64 rows}, w [1, out, in] box {64 k, BN n, 1}
    if (lane == 0) {
      tma_prefetch_descriptor(&map_a);
      tma_prefetch_descriptor(&map_b);
      for (int kt = kt_begin, it = 0; kt < kt_end; ++kt, ++it) {
        const int s = it % kStages;
        mbar_wait(&empty_bar[s], ((it / kStages) & 1) ^ 1);
        unsigned char* sa = smem + s * T::kStageBytes;
        uint64_t* bar = &full_bar[s];
        mbar_arrive_expect_tx(bar, T::kStageBytes);
        tma_load_2d(sa, &map_a, bar, kt * T::kBK, m0);
        tma_load_3d(sa + T::kABytes, &map_b, bar, kt * T::kBK, n0, 0);
      }
    }
    __syncwarp();
  } else {
    // ---- consumers: one chunk sum at a time, each valid row sent to its owner
    const int wq = warp & 3;
    int it = 0;
    for (int ch = ch_begin; ch < ch_end; ++ch) {
      float acc[T::kAcc];
      const int kb = ch * kKChunkTiles;
      sum_chunk<BN, kStages, T::kStageBytes>(acc, smem, full_bar, empty_bar, kb, min(kb + kKChunkTiles, k_tiles), it);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = 16 * wq + (lane >> 2) + 8 * h, owner = row / R;
        if (row >= m_valid) continue;
        float* dst = cluster.map_shared_rank(received, owner) + (ch * R + row - owner * R) * kPitch;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
          *reinterpret_cast<float2*>(dst + 8 * j + 2 * (lane & 3)) =
              make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      }
    }
  }
  cluster.sync();  // every chunk sum of this CTA's rows has arrived

  // ---- this CTA's rows: the chunk sums in chunk order, then one rounding
  const int r_begin = rank * R, rows = min(R, min(T::kBM, m_valid) - r_begin);
  TOut* gC = static_cast<TOut*>(p.c) + int64_t(m0) * p.ldc + n0;
  constexpr int kQuads = BN / 4;
  for (int i = tid; i < rows * kQuads; i += T::kThreads) {
    const int r = i / kQuads, col = 4 * (i % kQuads);
    if (col >= n_valid) continue;
    const float* src = received + r * kPitch + col;
    float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int ch = 0; ch < chunks; ++ch) {
      const float4 v = *reinterpret_cast<const float4*>(src + ch * R * kPitch);
      t.x += v.x;
      t.y += v.y;
      t.z += v.z;
      t.w += v.w;
    }
    TOut* crow = gC + int64_t(r_begin + r) * p.ldc + col;
    store_pair(crow, t.x, t.y, false);
    if (col + 2 < n_valid) store_pair(crow + 2, t.z, t.w, false);
  }
#else
  __trap();  // built without sm_90a; the dispatcher never launches this
#endif
}

// The cluster K split of a plain GEMM on tile T: the cluster size that
// gives the most CTAs (at most one per SM, at most 8 per cluster, every CTA
// with a chunk); width 0 where fewer than 2 CTAs per tile fit or the
// received chunk sums do not fit in shared memory.
template <class T>
GroupedGemmClusterKPlan plan_cluster_k(int64_t rows, int64_t n, int64_t chunks, int64_t sms) {
  const int64_t tiles = ((rows + T::kBM - 1) / T::kBM) * ((n + T::kBN - 1) / T::kBN);
  const int64_t c_max = std::min<int64_t>({8, chunks, sms / std::max<int64_t>(tiles, 1)});
  GroupedGemmClusterKPlan plan;
  if (c_max < 2) return plan;
  const int64_t q = (chunks + c_max - 1) / c_max, c = (chunks + q - 1) / q;  // every CTA gets a chunk
  const int64_t smem = T::smem_bytes(int(chunks), int((T::kBM + c - 1) / c));
  if (c < 2 || smem > T::kMaxSmem) return plan;
  plan.width = T::kBN;
  plan.cluster = int(c);
  plan.chunks_per_cta = int(q);
  plan.ctas = int(tiles * c);
  plan.smem_bytes = int(smem);
  return plan;
}

template <class T, class TOut>
void launch_plain_cluster_k_sm90(const GroupedGemmParams& p, const GroupedGemmClusterKPlan& plan, cudaStream_t stream) {
  const Sm90Params kp = plain_params<T>(p, plan.cluster);
  const CUtensorMap ma = map_2d(p.a, uint64_t(p.in_features), uint64_t(p.rows), 64, T::kBM);
  const CUtensorMap mb = map_weights(p.b, uint64_t(p.in_features), uint64_t(p.out_features), 1, 64, T::kBN);
  auto kernel = plain_cluster_k_sm90_kernel<T, TOut>;
  // The shared-memory attribute once per kernel and device (devices 0-63):
  // its host cost would count in every call of a decode step.
  static std::atomic<uint64_t> attribute_set{0};
  int device = 0;
  SLIME_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
  if (bit == 0 || (attribute_set.load(std::memory_order_relaxed) & bit) == 0) {
    SLIME_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kMaxSmem));
    attribute_set.fetch_or(bit, std::memory_order_relaxed);
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(plan.ctas));
  cfg.blockDim = dim3(T::kThreads);
  cfg.dynamicSmemBytes = std::size_t(plan.smem_bytes);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(plan.cluster);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  SLIME_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, ma, mb, kp));
}

// SLIME_GEMM_CLUSTER_K=1 (with SLIME_GEMM_K_CHUNKS=1) runs the chunked
// plain GEMM of few rows on the cluster K split. Opt-in until its version
// with pushed chunk sums has run on a GPU: the first version (remote loads)
// lost at 32-256 rows (bench/RESULTS.md, "Decode GEMMs in m-tile order, and
// the cluster K split").
bool plain_cluster_k() {
  static const bool on = [] {
    const char* v = std::getenv("SLIME_GEMM_CLUSTER_K");
    return v != nullptr && std::string_view(v) == "1";
  }();
  return on;
}

// The cluster K split of p, width 0 where it does not run: K chunks or the
// split off, a forced tile, not a plain forward GEMM, or no plan
// (grouped_gemm_sm90_cluster_k_plan).
GroupedGemmClusterKPlan choose_cluster_k(const GroupedGemmParams& p) {
  if (p.pass != Pass::forward || p.offsets != nullptr || !plain_k_chunks() || !plain_cluster_k() ||
      p.tile != GroupedGemmTile::automatic || plain_tile_override() != GroupedGemmTile::automatic)
    return {};
  return grouped_gemm_sm90_cluster_k_plan(p.rows, p.out_features, p.in_features, ::slime::ops::detail::tma::sm_count());
}

template <class TOut>
bool try_plain_cluster_k(const GroupedGemmParams& p, cudaStream_t stream) {
  const GroupedGemmClusterKPlan plan = choose_cluster_k(p);
  switch (plan.width) {
    case 128:
      launch_plain_cluster_k_sm90<Sm90ClusterKN128, TOut>(p, plan, stream);
      return true;
    case 64:
      launch_plain_cluster_k_sm90<Sm90ClusterKN64, TOut>(p, plan, stream);
      return true;
    case 32:
      launch_plain_cluster_k_sm90<Sm90ClusterKN32, TOut>(p, plan, stream);
      return true;
    default:
      return false;
  }
}

// Most K splits of a plain GEMM (their f32 partials: splits x rows x n x 4
// bytes of p.workspace); a longer K runs unsplit.
constexpr int kMaxKSplits = 32;

// A plain forward GEMM (null offsets: the batch-invariant Linear) on the
// chunked tiles: the 64-row tiles with their chunks side by side (above);
// n128; n64, which with fewer tiles than SMs gives each K chunk its own CTA
// (f32 partials in p.workspace where they fit, then sum_k_splits_kernel).
template <class TOut>
void launch_plain_sm90(GroupedGemmTile tile, const GroupedGemmParams& p, cudaStream_t stream) {
  if (try_plain_cluster_k<TOut>(p, stream)) return;
  switch (tile) {
    case GroupedGemmTile::sm90_m64n64:
      return launch_plain_chunks_sm90<Sm90ChunkN64, TOut>(p, stream);
    case GroupedGemmTile::sm90_m64n32:
      return launch_plain_chunks_sm90<Sm90ChunkN32, TOut>(p, stream);
    case GroupedGemmTile::sm90_m64n16:
      return launch_plain_chunks_sm90<Sm90ChunkN16, TOut>(p, stream);
    case GroupedGemmTile::sm90_m128n128:
      return launch_sm90<Sm90M128N128Chunked, Pass::forward, TOut>(p, stream);
    case GroupedGemmTile::sm90_m128n64:
      break;
    default:
      SLIME_FAIL("grouped_gemm: with K chunks a plain GEMM (null offsets) runs the sm90_m128n128, sm90_m128n64 or a ",
                 "64-row tile (the others keep one accumulator set), not ", grouped_gemm_tile_name(tile));
  }
  using T = Sm90M128N64Chunked;
  const int64_t tiles = ceil_div(p.rows, T::kBM) * int64_t(ceil_div(p.out_features, T::kBN));
  const int64_t chunks = ceil_div(ceil_div(p.in_features, T::kBK), kKChunkTiles);
  const std::size_t bytes = std::size_t(chunks) * std::size_t(p.rows) * std::size_t(p.out_features) * sizeof(float);
  const bool split = tiles < ::slime::ops::detail::tma::sm_count() && chunks >= 2 && chunks <= kMaxKSplits &&
                     p.workspace != nullptr && bytes <= p.workspace_bytes;
  if (!split) return launch_sm90<T, Pass::forward, TOut>(p, stream);
  float* partial = static_cast<float*>(p.workspace);
  launch_sm90<T, Pass::forward, TOut>(p, stream, int(chunks), partial);
  constexpr int kThreads = 256;
  const int64_t total = p.rows * p.out_features;
  const unsigned blocks = unsigned(
      std::min<int64_t>((total + kThreads - 1) / kThreads, int64_t(::slime::ops::detail::tma::sm_count()) * 8));
  sum_k_splits_kernel<TOut><<<blocks, kThreads, 0, stream>>>(partial, static_cast<TOut*>(p.c), int(chunks), p.rows,
                                                             p.out_features, grouped_gemm_output_pitch(p));
  SLIME_CUDA_CHECK_LAUNCH();
}

template <Pass kPass, class TOut>
void dispatch_sm90_tile(GroupedGemmTile tile, const GroupedGemmParams& p, cudaStream_t stream) {
  constexpr bool kForward = kPass == Pass::forward;
  if constexpr (kForward) {
    if (p.offsets == nullptr && plain_k_chunks()) return launch_plain_sm90<TOut>(tile, p, stream);
  }
  switch (tile) {
    case GroupedGemmTile::sm90_m128n256:
      return launch_sm90<Sm90M128N256, kPass, TOut>(p, stream);
    case GroupedGemmTile::sm90_m128n128:
      return launch_sm90<Sm90M128N128, kPass, TOut>(p, stream);
    case GroupedGemmTile::sm90_m128n64:
      return launch_sm90<Sm90M128N64, kPass, TOut>(p, stream);
    // The 64-row tiles: forward only (no backward instantiations).
    case GroupedGemmTile::sm90_m64n64:
      if constexpr (kForward) return launch_sm90<Sm90M64N64, kPass, TOut>(p, stream);
      break;
    case GroupedGemmTile::sm90_m64n32:
      if constexpr (kForward) return launch_sm90<Sm90M64N32, kPass, TOut>(p, stream);
      break;
    case GroupedGemmTile::sm90_m64n16:
      if constexpr (kForward) return launch_sm90<Sm90M64N16, kPass, TOut>(p, stream);
      break;
    default:
      SLIME_FAIL("grouped_gemm: ", grouped_gemm_tile_name(tile), " is not a Hopper tile");
  }
  SLIME_FAIL("grouped_gemm: tile ", grouped_gemm_tile_name(tile), " runs the forward pass only");
}

}  // namespace

bool grouped_gemm_sm90_built() {
#if defined(SLIME_CUDA_SM90A_BUILT)
  return true;
#else
  return false;
#endif
}

bool grouped_gemm_sm90_device() { return ::slime::ops::detail::tma::sm90_device(); }
// SLIME_GROUPED_GEMM_SM90=0 keeps the automatic choice on the mma.sync
// kernels (the before/after benchmarks); forced sm90 tiles still run.
bool grouped_gemm_sm90_auto() {
  static const bool on = [] {
    const char* v = std::getenv("SLIME_GROUPED_GEMM_SM90");
    return v == nullptr || std::string_view(v) != "0";
  }();
  return on && grouped_gemm_sm90_device();
}

bool grouped_gemm_hopper_kernels() { return grouped_gemm_sm90_auto(); }

// Whether the persistent kernel's shared memory (stages, staging buffer and a
// tile table of 2 (E + 1) ints) fits beside its CTAs per SM: E up to about
// 1000 (sm90_m128n256 with bf16 out) to 8000.
bool grouped_gemm_sm90_fits(GroupedGemmTile tile, int64_t experts, DType out_dtype) {
  const bool f32 = out_dtype == DType::f32;
  auto fits = [&](auto tile_type) {
    using T = decltype(tile_type);
    const int smem = f32 ? T::template smem_bytes<float>() : T::template smem_bytes<bf16>();
    return experts < (1 << 20) && (smem + tile_table_bytes(experts)) * T::kCtasPerSm <= 227 * 1024;
  };
  switch (tile) {
    case GroupedGemmTile::sm90_m128n256:
      return fits(Sm90M128N256{});
    case GroupedGemmTile::sm90_m128n128:
      return fits(Sm90M128N128{});
    case GroupedGemmTile::sm90_m128n64:
      return fits(Sm90M128N64{});
    case GroupedGemmTile::sm90_m64n64:
      return fits(Sm90M64N64{});
    case GroupedGemmTile::sm90_m64n32:
      return fits(Sm90M64N32{});
    case GroupedGemmTile::sm90_m64n16:
      return fits(Sm90M64N16{});
    default:
      return false;
  }
}

// SLIME_GEMM_PLAIN_TILE=<tile name> (e.g. sm90_m64n16): the plain GEMM's
// tile for every call, over the choice below (benchmarks compare them on a
// whole decode step; the bits are the same whichever runs). Unset: automatic.
GroupedGemmTile plain_tile_override() {
  static const GroupedGemmTile tile = [] {
    const char* v = std::getenv("SLIME_GEMM_PLAIN_TILE");
    if (v == nullptr || *v == 0 || std::string_view(v) == "automatic") return GroupedGemmTile::automatic;
    for (GroupedGemmTile t : kGroupedGemmTiles)
      if (grouped_gemm_tile_is_sm90(t) && std::string_view(v) == grouped_gemm_tile_name(t)) return t;
    SLIME_FAIL("SLIME_GEMM_PLAIN_TILE=", v, " is not a Hopper tile (sm90_m128n256, sm90_m128n128, sm90_m128n64, ",
               "sm90_m64n64, sm90_m64n32, sm90_m64n16 or automatic)");
  }();
  return tile;
}

// The tile of a plain forward GEMM (one group, no offsets) of `rows` x n.
// Many rows: the widest of n256 (n a multiple of 256; not with K chunks),
// n128 and n64 whose 128-row tiles cover the SMs (else n64). Up to 256 rows
// (a decode step), where a call's time is its CTAs loading their tiles
// rather than computing (bench/RESULTS.md): up to 64 rows the 64-row tiles (a 128-row tile would be half empty);
// 65-256 rows the 128-row n128 / n64 tiles where they cover the SMs, else
// the 64-row ones; among those the widest of n64, n32 and n16 with at least
// a quarter as many tiles as SMs (narrower tiles re-read x more often: on
// an H100 at 256 rows n16 took 1.5-2.7x as long as n64; bench/RESULTS.md).
// With K chunks the same, without n256; the 64-row tiles then run their
// chunks side by side (plain_chunks_sm90_kernel), and n64 with fewer tiles
// than SMs splits K over CTAs (launch_plain_sm90). The tile changes which
// CTA (or warpgroup) sums an output element or chunk, not the order of the
// sum over K, so the bits do not depend on the choice (the batch-invariant
// mode relies on it; grouped_gemm.hpp).
GroupedGemmTile grouped_gemm_sm90_plain_tile(int64_t rows, int64_t n) {
  const int64_t m_tiles = (rows + 127) / 128, sms = ::slime::ops::detail::tma::sm_count();
  if (plain_tile_override() != GroupedGemmTile::automatic) return plain_tile_override();
  if (rows > 64) {
    if (!plain_k_chunks() && n % 256 == 0 && m_tiles * (n / 256) >= sms) return GroupedGemmTile::sm90_m128n256;
    if (m_tiles * ((n + 127) / 128) >= sms) return GroupedGemmTile::sm90_m128n128;
    if (rows > 256 || m_tiles * ((n + 63) / 64) >= sms) return GroupedGemmTile::sm90_m128n64;
  }
  const int64_t m64_tiles = (rows + 63) / 64;
  if (4 * m64_tiles * ((n + 63) / 64) >= sms) return GroupedGemmTile::sm90_m64n64;
  if (4 * m64_tiles * ((n + 31) / 32) >= sms) return GroupedGemmTile::sm90_m64n32;
  return GroupedGemmTile::sm90_m64n16;
}

GroupedGemmClusterKPlan grouped_gemm_sm90_cluster_k_plan(int64_t rows, int64_t n, int64_t k, int64_t sms) {
  if (rows <= 0 || rows > 256 || n <= 0 || k <= 0 || sms <= 0) return {};
  const int64_t chunks = ceil_div(ceil_div(k, 64), kKChunkTiles);
  const GroupedGemmClusterKPlan n128 = plan_cluster_k<Sm90ClusterKN128>(rows, n, chunks, sms);
  const GroupedGemmClusterKPlan n64 = plan_cluster_k<Sm90ClusterKN64>(rows, n, chunks, sms);
  const GroupedGemmClusterKPlan n32 = plan_cluster_k<Sm90ClusterKN32>(rows, n, chunks, sms);
  const int best = std::max({n128.ctas, n64.ctas, n32.ctas});
  if (best == 0) return {};
  return n128.ctas == best ? n128 : n64.ctas == best ? n64 : n32;  // the wider on a tie: it re-reads x less
}

int grouped_gemm_sm90_cluster_k(const GroupedGemmParams& p) {
  if (!grouped_gemm_sm90_built() || !grouped_gemm_sm90_device()) return 0;
  return choose_cluster_k(p).cluster;
}

// Called by grouped_gemm (grouped_gemm.cu) after its checks, for a sm90 tile,
// with every extent > 0 and bf16 inputs meeting tensor_core_ok.
void grouped_gemm_sm90(GroupedGemmTile tile, const GroupedGemmParams& p, cudaStream_t stream) {
  const bool f32_out = p.out_dtype == DType::f32;
  switch (p.pass) {
    case Pass::forward:
      return f32_out ? dispatch_sm90_tile<Pass::forward, float>(tile, p, stream)
                     : dispatch_sm90_tile<Pass::forward, bf16>(tile, p, stream);
    case Pass::backward_input:
      return f32_out ? dispatch_sm90_tile<Pass::backward_input, float>(tile, p, stream)
                     : dispatch_sm90_tile<Pass::backward_input, bf16>(tile, p, stream);
    case Pass::backward_weight:
      return dispatch_sm90_tile<Pass::backward_weight, float>(tile, p, stream);
  }
}

}  // namespace slime::ops::cuda
