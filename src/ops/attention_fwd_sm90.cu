// Hopper (sm_90a) attention forward for slime/ops/cuda/attention.hpp, head_dim
// 64 and 128: wgmma fed by TMA through an mbarrier pipeline, two consumer
// warpgroups and one producer warp per CTA (warp specialisation), and the
// softmax of key block i overlapped with the P V product of block i - 1
// inside each warpgroup (FlashAttention-3's intra-warpgroup pipelining).
// Same semantics as the mma.sync forward (attention_kernels.cuh): packed
// varlen sequences, GQA, CausalMask / FullMask with the causal offset, o bf16
// and lse f32 out, a row without a visible key gets o = 0, lse = -inf.
//
// CTA: 128 query rows of one (sequence, head), keys in blocks of kBN = 128.
// Consumer warpgroup c (c = 0, 1) owns rows 64 c .. 64 c + 63; warpgroup 2
// is the producer (one thread issues every copy; setmaxnreg gives its
// registers to the consumers). Per key block, per warpgroup:
//   S = Q K^T    wgmma m64n128k16, Q and K from shared memory (both K-major),
//                d / 16 steps, fp32 accumulators (64 per thread);
//   softmax      online, in the log2 domain, on the accumulators (the layout:
//                warp w holds rows 16 w + lane / 4 (+ 8), s[4 j + {0,1}] are
//                columns 8 j + 2 (lane % 4) + {0, 1}, s[4 j + {2,3}] row + 8);
//   O += P V     wgmma m64n{d}k16 with A = P from registers (the S
//                accumulators packed to bf16 pairs are exactly wgmma's
//                register A fragment) and B = V from shared memory, MN-major.
// Order per iteration i (key block i in the load order): issue S_i, issue
// P_{i-1} V_{i-1}, wait for S_i, softmax of S_i (into new registers P_i
// while P_{i-1} is still being read), wait for P V, rescale O, pack P_i.
//
// Shared memory (128-byte swizzle, sm90.cuh), 1024-byte aligned:
//   Q      [d / 64 boxes][128 rows][128 B]                       16 or 32 KB
//   K[s]   [d / 64 boxes][kBN keys][128 B]  (K-major B of S)     per stage
//   V[s]   [d / 64 boxes][kBN keys][128 B]  (MN-major B of P V: the d-boxes
//          are the 64-wide MN chunks, LBO = kBN * 128 bytes; a k16 step is
//          16 keys = 2048 bytes)
// d 128: 2 stages, 161 KB; d 64: 4 stages, 145 KB. One CTA per SM.
// All three are loaded by TMA from 3-D tensor maps (d, heads, tokens) with a
// box of {64, 1, rows}: a box never crosses heads. Rows past the tensor are
// zero-filled; rows past a sequence belong to the next one: queries there
// are computed and never stored, keys there are masked (-inf) and their
// P = 0 (V rows there must be finite, which activations are).
//
// Causal: key blocks are loaded from the last one down, so the blocks that
// need the mask come first and the rest run unmasked.
// Pipeline barriers: q_full; k_full[s] / v_full[s] complete when the stage's
// bytes land (the producer's arrive with expect_tx); k_empty[s] / v_empty[s]
// when all 8 consumer warps are done with them; q_empty when every Q K^T of
// the tile is done (the next tile's Q may land while P V and the epilogue run).
// Persistent: one CTA per SM walks tiles longest-first (sm90_fwd_tile), the
// K/V stage ring running on across tiles; named barriers 1 and 2 take the two
// consumer warpgroups' GEMM issue in turns (kSchedBarrier).
//
// Determinism: each output element is summed by one thread in a fixed order:
// bitwise run to run; not bitwise equal to the mma.sync kernel (other key
// order and other k order inside a wgmma).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "attention_kernels.cuh"
#include "attention_sm90_common.hpp"
#include "slime/core/error.hpp"
#include "slime/ops/cuda/attention.hpp"
#include "sm90.cuh"
#include "tensor_map.hpp"

namespace slime::ops::cuda {

namespace {

using namespace ::slime::ops::detail::sm90;
// Shared with the mma.sync kernels (attention_kernels.cuh).
using attention_impl::bf16;
using attention_impl::exp2_ftz;
using attention_impl::kLn2;
using attention_impl::kLog2e;
using attention_impl::make_mask;
using attention_impl::pack_bf16;
using attention_impl::quad_max;
using attention_impl::quad_sum;

template <int kD, int kStagesT>
struct Sm90FwdTile {
  static_assert(kD == 64 || kD == 128, "the Hopper forward runs head_dim 64 and 128");
  static constexpr int kBM = 128, kBN = 128;
  static constexpr int kStages = kStagesT;
  static constexpr int kBoxes = kD / 64;         // 128-byte column boxes of a row
  static constexpr int kQBytes = kBM * kD * 2;   // 16 or 32 KB
  static constexpr int kKVBytes = kBN * kD * 2;  // one K or V stage
  // Warpgroups 0 and 1 consume, warpgroup 2 produces (one thread issues the
  // copies). setmaxnreg moves registers from the producer (24) to the
  // consumers (240): 128 x 24 + 256 x 240 <= 65536.
  static constexpr int kConsumers = 256, kConsumerWarps = kConsumers / 32, kThreads = kConsumers + 128;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kKVBytes + 1024;  // + alignment slack
  static_assert(kSmemBytes <= 227 * 1024, "fits the 227 KB of shared memory of a Hopper SM");
};

// As the mma.sync forward's check, a broken cu_seqlens invariant traps, but
// without its message: a printf is a function call, and ptxas serialises
// every wgmma of a kernel that makes one (the host API validates
// cu_seqlens before it launches; ops/host_checks.hpp).
__device__ __forceinline__ void check_sequence(const int32_t* cu, int b, int num_seqs, int total, int len,
                                               int max_len) {
  const bool bad = len < 0 || len > max_len || (b == 0 && cu[0] != 0) || (b == num_seqs - 1 && cu[num_seqs] != total);
  if (bad) __trap();
}

// S = Q K^T for this warpgroup's 64 rows: q = its rows in box 0, k = the stage.
template <class T>
__device__ __forceinline__ void issue_qk(float (&s)[T::kBN / 2], const unsigned char* q, const unsigned char* k) {
#pragma unroll
  for (int kk = 0; kk < T::kBoxes * 4; ++kk) {
    const uint64_t da = make_desc_sw128(q + (kk / 4) * (T::kBM * 128) + (kk % 4) * 32, 16, 1024);
    const uint64_t db = make_desc_sw128(k + (kk / 4) * (T::kBN * 128) + (kk % 4) * 32, 16, 1024);
    wgmma_m64n128k16<0, 0>(s, da, db, kk > 0 ? 1 : 0);
  }
}

// O += P V: p = P as register A fragments (one per 16 keys), v = the stage.
template <class T, int kD>
__device__ __forceinline__ void issue_pv(float (&o)[kD / 2], const uint32_t (&p)[T::kBN / 16][4],
                                         const unsigned char* v) {
#pragma unroll
  for (int kk = 0; kk < T::kBN / 16; ++kk) {
    const uint64_t db = make_desc_sw128(v + kk * 2048, T::kBN * 128, 1024);
    if constexpr (kD == 128) {
      wgmma_m64n128k16_rs<1>(o, p[kk], db, 1);
    } else {
      wgmma_m64n64k16_rs<1>(o, p[kk], db, 1);
    }
  }
}

// One work tile: 128 query rows (m_block) of one (sequence, head). Tiles are
// numbered longest-first: tile t has m_block = m_blocks - 1 - t / (seqs x
// heads), then sequence, then head; CTAs take them in rounds of gridDim.x,
// in a snake order (snake_tile), which hands every CTA about the same causal
// work. The producer and
// the consumers walk the same tiles and compute the same Tile, so they agree
// on which tiles load anything.
struct Sm90FwdTileInfo {
  int b, h, q0, len_q, k0, len_k, row0;  // packed: h is the kv head
  int rows;                              // the tile's sequence's rows: len_q, or len_q x group when packed
  int full_end, n_blocks;                // keys [0, full_end) seen by every row; key blocks to visit
  bool has_rows;                         // row0 < len_q: the tile stores rows
};

template <int kBM, int kBN, class Mask>
__device__ __forceinline__ Sm90FwdTileInfo sm90_fwd_tile(const AttentionForwardParams& p, int t, int m_blocks,
                                                         int group) {
  Sm90FwdTileInfo ti;
  const int heads = group > 0 ? p.heads_kv : p.heads_q;
  const int per_m = p.num_seqs * heads;
  const int m_block = m_blocks - 1 - t / per_m;
  const int r = t % per_m;
  ti.b = r / heads;
  ti.h = r % heads;
  ti.q0 = p.cu_seqlens_q[ti.b];
  ti.len_q = p.cu_seqlens_q[ti.b + 1] - ti.q0;
  ti.k0 = p.cu_seqlens_k[ti.b];
  ti.len_k = p.cu_seqlens_k[ti.b + 1] - ti.k0;
  ti.rows = group > 0 ? ti.len_q * group : ti.len_q;
  ti.row0 = m_block * kBM;
  ti.has_rows = ti.row0 < ti.rows;
  ti.full_end = 0;
  ti.n_blocks = 0;
  if (ti.has_rows) {
    // Packed, every row is query row 0 of its (one-row) sequence.
    const Mask mask = make_mask<Mask>(p.options, ti.len_q, ti.len_k);
    const int rows_here = min(kBM, ti.rows - ti.row0);
    const int key_end = mask.key_end(group > 0 ? 0 : ti.row0 + rows_here - 1, ti.len_k);
    ti.full_end = mask.key_end(group > 0 ? 0 : ti.row0, ti.len_k);
    ti.n_blocks = (key_end + kBN - 1) / kBN;
  }
  return ti;
}

// Named barriers 1 and 2 order the two consumer warpgroups' wgmma issue
// (FlashAttention-3's "ping-pong"): warpgroup c issues a key block's two
// GEMMs only after barrier 1 + c, then opens the other's, so one warpgroup's
// softmax runs while the other's GEMMs use the tensor cores.
constexpr int kSchedBarrier = 1, kSchedThreads = 256;

template <int kD, int kStagesT, class Mask>
__global__ void __launch_bounds__(Sm90FwdTile<kD, kStagesT>::kThreads, 1)
    attention_fwd_sm90_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                              const __grid_constant__ CUtensorMap map_v, const AttentionForwardParams p,
                              const int m_blocks, const int num_tiles, const int group) {
#if SLIME_SM90A
  using T = Sm90FwdTile<kD, kStagesT>;
  constexpr int kBM = T::kBM, kBN = T::kBN, kStages = T::kStages, kBoxes = T::kBoxes;
  extern __shared__ __align__(1024) unsigned char fwd_smem_raw[];
  __shared__ __align__(8) uint64_t q_full, q_empty;
  __shared__ __align__(8) uint64_t k_full[kStages], v_full[kStages], k_empty[kStages], v_empty[kStages];
  unsigned char* smem = fwd_smem_raw + ((1024 - (smem_u32(fwd_smem_raw) & 1023)) & 1023);
  unsigned char* sQ = smem;
  unsigned char* sK = sQ + T::kQBytes;             // [kStages][kKVBytes]
  unsigned char* sV = sK + kStages * T::kKVBytes;  // [kStages][kKVBytes]
  const int tid = threadIdx.x;
  // This CTA's tile of round r: the tiles of a round go to the CTAs in
  // alternating directions (a snake), so that the CTA that got the longest
  // tile of one round gets the shortest of the next; a plain stride gives CTA
  // 0 the longest tile of every round.
  auto snake_tile = [&](int round) {
    const int j = (round & 1) ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
    return int(min(int64_t(round) * gridDim.x + j, int64_t(0x7fffffff)));
  };

  if (tid == 0) {
    mbar_init(&q_full, 1);
    mbar_init(&q_empty, T::kConsumerWarps);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&k_full[s], 1);
      mbar_init(&v_full[s], 1);
      mbar_init(&k_empty[s], T::kConsumerWarps);
      mbar_init(&v_empty[s], T::kConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (tid >= T::kConsumers) {
    // ---- producer: per tile, Q (once the consumers are done with the last
    // one), then K and V of key block n_blocks - 1 down to 0. The stage ring
    // runs on across tiles (kv counts every block loaded), so the next tile's
    // first blocks load while the consumers finish this one.
    setmaxnreg_dec<T::kProducerRegs>();
    if (tid == T::kConsumers) {
      tma_prefetch_descriptor(&map_q);
      tma_prefetch_descriptor(&map_k);
      tma_prefetch_descriptor(&map_v);
      uint32_t kv = 0, q_loads = 0;
      for (int round = 0;; ++round) {
        const int t = snake_tile(round);
        if (t >= num_tiles) break;
        const Sm90FwdTileInfo ti = sm90_fwd_tile<kBM, kBN, Mask>(p, t, m_blocks, group);
        if (ti.row0 == 0 && ti.h == 0) {
          check_sequence(p.cu_seqlens_q, ti.b, p.num_seqs, p.tokens_q, ti.len_q, p.max_seqlen_q);
          check_sequence(p.cu_seqlens_k, ti.b, p.num_seqs, p.tokens_k, ti.len_k, 0x7fffffff);
        }
        if (ti.n_blocks == 0) continue;
        const int hk = group > 0 ? ti.h : ti.h / (p.heads_q / p.heads_kv);
        mbar_wait(&q_empty, (q_loads & 1) ^ 1);
        ++q_loads;
        if (group > 0) {
          // The query row's heads hk x group ... + group - 1: boxes of {64, group, 1}
          // (rows past them in sQ keep stale values: computed, never stored).
          mbar_arrive_expect_tx(&q_full, kBoxes * group * 128);
#pragma unroll
          for (int j = 0; j < kBoxes; ++j)
            tma_load_3d(sQ + j * (kBM * 128), &map_q, &q_full, 64 * j, hk * group, ti.q0);
        } else {
          mbar_arrive_expect_tx(&q_full, T::kQBytes);
#pragma unroll
          for (int j = 0; j < kBoxes; ++j)
            tma_load_3d(sQ + j * (kBM * 128), &map_q, &q_full, 64 * j, ti.h, ti.q0 + ti.row0);
        }
        for (int i = 0; i < ti.n_blocks; ++i, ++kv) {
          const int s = kv % kStages;
          const uint32_t parity = ((kv / kStages) & 1) ^ 1;
          const int key0 = ti.k0 + (ti.n_blocks - 1 - i) * kBN;
          unsigned char* k = sK + s * T::kKVBytes;
          unsigned char* v = sV + s * T::kKVBytes;
          mbar_wait(&k_empty[s], parity);
          mbar_arrive_expect_tx(&k_full[s], T::kKVBytes);
#pragma unroll
          for (int j = 0; j < kBoxes; ++j) tma_load_3d(k + j * (kBN * 128), &map_k, &k_full[s], 64 * j, hk, key0);
          mbar_wait(&v_empty[s], parity);
          mbar_arrive_expect_tx(&v_full[s], T::kKVBytes);
#pragma unroll
          for (int j = 0; j < kBoxes; ++j) tma_load_3d(v + j * (kBN * 128), &map_v, &v_full[s], 64 * j, hk, key0);
        }
      }
    }
    return;
  }

  // ---- consumers
  setmaxnreg_inc<T::kConsumerRegs>();
  const int c = tid / 128, wq = (tid / 32) & 3, lane = tid & 31;
  const float scale_log2 = p.softmax_scale * kLog2e;
  const unsigned char* q = sQ + c * (64 * 128);
  // One arrival per warp on the empty barriers: a warp's wgmma wait covers
  // its lanes.
  auto release = [&](uint64_t* bar) { mbar_arrive_if(bar, lane == 0); };
  // Warpgroup 0 issues first: warpgroup 1 opens its barrier once.
  if (c == 1) named_barrier_arrive(kSchedBarrier, kSchedThreads);
  uint32_t kv = 0, q_loads = 0;

  for (int round = 0;; ++round) {
    const int t = snake_tile(round);
    if (t >= num_tiles) break;
    const Sm90FwdTileInfo ti = sm90_fwd_tile<kBM, kBN, Mask>(p, t, m_blocks, group);
    if (!ti.has_rows) continue;  // the same on every thread
    const Mask mask = make_mask<Mask>(p.options, ti.len_q, ti.len_k);
    const int n_blocks = ti.n_blocks, full_end = ti.full_end, len_k = ti.len_k;
    // This thread's rows in the sequence: row_base and row_base + 8.
    const int row_base = ti.row0 + 64 * c + 16 * wq + (lane >> 2);
    float o[kD / 2];
#pragma unroll
    for (int i = 0; i < kD / 2; ++i) o[i] = 0.f;
    // m_i: running max of the raw scores of rows +0 / +8 (-inf until a visible
    // key); l_i: this thread's part of the running sum of exp2(s * scale_log2 -
    // m_i * scale_log2).
    float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};

    if (n_blocks > 0) {
      float s[kBN / 2];
      uint32_t pa[kBN / 16][4];

      // Mask (when block n holds a key some row must not see), then the online
      // softmax of s in place: s becomes P; returns the rescale of O and l.
      auto softmax = [&](int n, float(&corr)[2]) {
        if ((n + 1) * kBN > full_end) {
#pragma unroll
          for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int row = row_base + 8 * (e >> 1);
              const int key = n * kBN + 8 * j + 2 * (lane & 3) + (e & 1);
              if (key >= mask.key_end(group > 0 ? 0 : row, len_k)) s[4 * j + e] = -INFINITY;
            }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = m_i[r];
#pragma unroll
          for (int j = 0; j < kBN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
          mx = quad_max(mx);
          // A row with no visible key yet keeps max -inf; subtracting 0 keeps
          // every exp2 argument -inf (-> 0) rather than NaN.
          const float m_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
          corr[r] = exp2f(m_i[r] * scale_log2 - m_scaled);  // 0 while m_i = -inf
          m_i[r] = mx;
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float pv = exp2_ftz(fmaf(s[4 * j + 2 * r + e], scale_log2, -m_scaled));
              s[4 * j + 2 * r + e] = pv;
              sum += pv;
            }
          l_i[r] = l_i[r] * corr[r] + sum;
        }
      };
      auto pack = [&] {
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk)
#pragma unroll
          for (int e = 0; e < 4; ++e) pa[kk][e] = pack_bf16(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
      };
      auto rescale = [&](const float(&corr)[2]) {
#pragma unroll
        for (int j = 0; j < kD / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[4 * j + e] *= corr[e >> 1];
      };
      auto stage = [&](uint32_t block) { return int(block % kStages); };
      auto phase = [&](uint32_t block) { return (block / kStages) & 1; };

      mbar_wait(&q_full, q_loads & 1);
      ++q_loads;
      // Block 0 of the load order (key block n_blocks - 1).
      mbar_wait(&k_full[stage(kv)], phase(kv));
      wgmma_fence();
      issue_qk<T>(s, q, sK + stage(kv) * T::kKVBytes);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(s);
      release(&k_empty[stage(kv)]);
      float corr[2];
      softmax(n_blocks - 1, corr);  // O is still 0: no rescale
      pack();

      for (int i = 1; i < n_blocks; ++i) {
        const uint32_t cur = kv + i, prev = kv + i - 1;
        mbar_wait(&k_full[stage(cur)], phase(cur));
        named_barrier_sync(kSchedBarrier + c, kSchedThreads);
        wgmma_fence();
        issue_qk<T>(s, q, sK + stage(cur) * T::kKVBytes);
        wgmma_commit();
        mbar_wait(&v_full[stage(prev)], phase(prev));
        issue_pv<T, kD>(o, pa, sV + stage(prev) * T::kKVBytes);
        wgmma_commit();
        named_barrier_arrive(kSchedBarrier + (c ^ 1), kSchedThreads);
        wgmma_wait<1>();  // S_i landed; P_{i-1} V_{i-1} may still run
        fence_registers(s);
        release(&k_empty[stage(cur)]);
        softmax(n_blocks - 1 - i, corr);
        wgmma_wait<0>();
        fence_registers(o);
        fence_registers(pa);
        release(&v_empty[stage(prev)]);
        rescale(corr);
        pack();
      }
      // Every Q K^T of this tile is done: the producer may load the next Q.
      release(&q_empty);
      const uint32_t last = kv + n_blocks - 1;
      mbar_wait(&v_full[stage(last)], phase(last));
      wgmma_fence();
      issue_pv<T, kD>(o, pa, sV + stage(last) * T::kKVBytes);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(o);
      fence_registers(pa);
      release(&v_empty[stage(last)]);
      kv += n_blocks;
    }

    // Epilogue: o = acc / l, lse = ln 2 * (m * scale_log2 + log2 l); a row with
    // no visible key (l = 0) gets o = 0, lse = -inf. Rows past the sequence
    // are not stored.
    // Row r of the tile is query row r of head h, or (packed) row 0 of head
    // h x group + r.
    const int64_t q_stride = int64_t(p.heads_q) * kD;
    const int64_t row_pitch = group > 0 ? kD : q_stride;
    const int head0 = group > 0 ? ti.h * group : ti.h;
    bf16* gO = static_cast<bf16*>(p.o) + int64_t(ti.q0) * q_stride + int64_t(head0) * kD;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(l_i[r]);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const float lse = l > 0.f ? (m_i[r] * scale_log2 + log2f(l)) * kLn2 : -INFINITY;
      const int row = row_base + 8 * r;
      if (row < ti.rows) {
        bf16* o_row = gO + int64_t(row) * row_pitch;
#pragma unroll
        for (int j = 0; j < kD / 8; ++j)
          *reinterpret_cast<uint32_t*>(o_row + 8 * j + 2 * (lane & 3)) =
              pack_bf16(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
        if ((lane & 3) == 0)
          p.lse[group > 0 ? int64_t(ti.q0) * p.heads_q + head0 + row : int64_t(ti.q0 + row) * p.heads_q + ti.h] = lse;
      }
    }
  }
  // Warpgroup 1's last arrival at barrier 1 has no matching sync (warpgroup 0
  // got one opening more than it used): take it, so no barrier is left
  // half-arrived when the CTA exits.
  if (c == 0) named_barrier_sync(kSchedBarrier, kSchedThreads);
#else
  __trap();  // built without sm_90a; the dispatcher never launches this
#endif
}

CUtensorMap map_heads(const void* base, int64_t tokens, int64_t heads, int d, int rows) {
  return ::slime::ops::detail::tma::make_heads_map("attention (Hopper forward)", base, tokens, heads, d, rows);
}

// The query heads packed into one tile (AttentionOptions::pack_gqa): a call
// of at most one query row per sequence (a decode step) with heads_q / heads_kv
// = group > 1 runs one tile per (sequence, kv head) whose rows are that row
// of the group's heads, instead of a 128-row tile per query head holding one
// row: group x fewer tiles, and each K/V block is read once per kv head. 0:
// not packed.
// SLIME_ATTENTION_PACK_GQA=0 turns it off in every call (for A/B timing).
int packed_group(const AttentionForwardParams& p, int bm) {
  static const bool env_on = ::slime::ops::detail::attention_sm90::env_switch("SLIME_ATTENTION_PACK_GQA", true);
  if (!env_on || !p.options.pack_gqa || p.max_seqlen_q != 1 || p.heads_kv <= 0) return 0;
  const int group = p.heads_q / p.heads_kv;
  return group > 1 && group <= bm ? group : 0;
}

template <int kD, int kStages, class Mask>
void launch_sm90(const AttentionForwardParams& p, cudaStream_t stream) {
  using T = Sm90FwdTile<kD, kStages>;
  const int group = packed_group(p, T::kBM);
  const CUtensorMap mq = group > 0 ? ::slime::ops::detail::tma::make_heads_map(
                                         "attention (Hopper forward, packed heads)", p.q, p.tokens_q, p.heads_q, kD,
                                         /*rows=*/1, /*heads_per_box=*/group)
                                   : map_heads(p.q, p.tokens_q, p.heads_q, kD, T::kBM);
  const CUtensorMap mk = map_heads(p.k, p.tokens_k, p.heads_kv, kD, T::kBN);
  const CUtensorMap mv = map_heads(p.v, p.tokens_k, p.heads_kv, kD, T::kBN);
  auto kernel = attention_fwd_sm90_kernel<kD, kStages, Mask>;
  SLIME_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes));
  // Persistent: one CTA per SM (its shared memory allows no second), each
  // taking one tile per round of gridDim.x tiles.
  const int64_t m_blocks = group > 0 ? 1 : (int64_t(p.max_seqlen_q) + T::kBM - 1) / T::kBM;
  const int64_t tiles = m_blocks * p.num_seqs * (group > 0 ? p.heads_kv : p.heads_q);
  SLIME_CHECK(tiles <= 0x7fffffff, "attention (Hopper forward): ", tiles, " tiles of ", T::kBM,
              " query rows exceed the kernel's int tile index");
  const int grid = int(std::min<int64_t>(tiles, ::slime::ops::detail::tma::sm_count()));
  kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(mq, mk, mv, p, int(m_blocks), int(tiles), group);
  SLIME_CUDA_CHECK_LAUNCH();
}

// "" when the Hopper forward can run p, else why not.
const char* sm90_refusal(const AttentionForwardParams& p) {
  if (p.tokens_q == 0 || p.tokens_k == 0) return "it needs at least one query and one key token";
  return ::slime::ops::detail::attention_sm90::refusal(p.head_dim, {p.q, p.k, p.v, p.o},
                                                       "its tensor maps need q, k, v and o 16-byte aligned");
}

// SLIME_ATTENTION_SM90=0 turns the automatic choice of the Hopper forward off.
bool sm90_env_allows() {
  static const bool on = ::slime::ops::detail::attention_sm90::env_switch("SLIME_ATTENTION_SM90", true);
  return on;
}

}  // namespace

bool attention_sm90_available() { return ::slime::ops::detail::tma::sm90_device(); }

bool detail::attention_forward_sm90(const AttentionForwardParams& p, StreamHandle stream) {
  const AttentionKernel want = p.options.kernel;
  if (want == AttentionKernel::mma_sync) return false;
  const char* refusal = sm90_refusal(p);
  if (want == AttentionKernel::sm90) {
    SLIME_CHECK(*refusal == '\0',
                "attention: the Hopper forward kernel (AttentionKernel::sm90) cannot run this call: ", refusal);
  } else if (*refusal != '\0' || !sm90_env_allows()) {
    return false;
  }
  if (p.num_seqs == 0 || p.max_seqlen_q == 0 || p.heads_q == 0) return true;
  const bool causal = p.options.causal;
  if (p.head_dim == 128) {
    causal ? launch_sm90<128, 2, CausalMask>(p, stream) : launch_sm90<128, 2, FullMask>(p, stream);
  } else {
    causal ? launch_sm90<64, 4, CausalMask>(p, stream) : launch_sm90<64, 4, FullMask>(p, stream);
  }
  return true;
}

}  // namespace slime::ops::cuda
