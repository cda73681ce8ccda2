// Hopper (sm_90a) attention backward for slime/ops/cuda/attention.hpp, head_dim
// 64 and 128: the five products of the backward as wgmma fed by TMA, two
// consumer warpgroups and a producer warpgroup per CTA (FlashAttention-3's
// backward layout). Same semantics as the mma.sync backward
// (attention_kernels.cuh): packed varlen sequences, GQA, CausalMask / FullMask
// with the causal offset; its preprocess (D = rowsum(dO o)), dq accumulator
// and dq conversion are shared: this file replaces only the main kernel.
//
// CTA: one (key block of kBN = 128 keys, sequence, kv head); consumer
// warpgroup c (c = 0, 1) owns keys 64 c .. 64 c + 63; warpgroup 2 produces
// (warp 0, one thread: TMA copies; warp 1: lse and D). K and V stay in shared
// memory; dK and dV accumulate in registers over every query head of the kv
// head's group and every query block of kBM = 64 rows that sees a key of the
// block, then are written once (deterministic). Per step (one query block of
// one head), per warpgroup, with the roles of the mma.sync backward:
//   S^T  = K Q^T    m64n64, A = the warpgroup's K rows, B = Q (both K-major)
//   dP^T = V dO^T   m64n64, A = its V rows, B = dO
//   P^T  = exp2(S^T scale_log2 - lse_log2), masked; dS^T = P^T (dP^T - D)
//        (P^T rounded to bf16 first, as the mma.sync kernel)
//   dV  += P^T dO   m64n{d}, A = P^T from registers (the accumulators of
//                   S^T packed to bf16 pairs are wgmma's A fragment), B = dO
//                   MN-major
//   dK  += dS^T Q   the same with dS^T and Q
//   dQ   = dS K     dS^T goes to shared memory (two buffers), read back as
//                   an MN-major A; d 128: warpgroup c computes columns
//                   64 c .. 64 c + 63 over all 128 keys (a named barrier
//                   joins the two warpgroups' halves of dS^T); d 64:
//                   warpgroup c computes all 64 columns over its own 64 keys
//                   (no barrier between the warpgroups, twice the adds)
//                   and adds them to the fp32 dq accumulator (red.v2).
// Shared memory (128-byte swizzle, sm90.cuh), 1024-byte aligned:
//   K, V   [d / 64 boxes][128 keys][128 B]                          2 x 32 KB
//   Q, dO  [2 stages][d / 64 boxes][64 rows][128 B]                 2 x 32 KB
//   dS^T   [2 buffers][128 keys][64 queries x 2 B]                  32 KB
//   lse, D [2 stages][64] f32 each
// d 128: 161 KB; d 64: 97 KB. One CTA per SM (384 threads, 240 registers
// per consumer thread).
// Pipeline: kv_full (K and V, once); qdo_full[s] completes when the stage's
// Q and dO bytes landed and the 32 lanes of the stats warp stored its lse and
// D; qdo_empty[s] when the 8 consumer warps are done with the stage.
// Rows past the sequence read the next sequence's (or TMA's zero-filled) Q
// and dO: their lse is +inf, so their P and dS are 0 and they add nothing;
// their dq is not added. Keys past the sequence are masked (P = 0) and not
// written.
//
// Not deterministic (dq by fp32 atomics): AttentionOptions::deterministic runs
// the mma.sync backward. Chosen by AttentionOptions::kernel = sm90 (and, in
// automatic mode, by SLIME_ATTENTION_SM90_BWD=1) until its speed is measured
// on the H200; see attention_backward_sm90.
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
using attention_impl::bf16;
using attention_impl::bf16_hi;
using attention_impl::bf16_lo;
using attention_impl::exp2_ftz;
using attention_impl::kLog2e;
using attention_impl::make_mask;
using attention_impl::pack_bf16;

template <int kD>
struct Sm90BwdTile {
  static_assert(kD == 64 || kD == 128, "the Hopper backward runs head_dim 64 and 128");
  static constexpr int kBM = 64, kBN = 128, kStages = 2;
  static constexpr int kBoxes = kD / 64;          // 128-byte column boxes of a row
  static constexpr int kKVBytes = kBN * kD * 2;   // K or V
  static constexpr int kQBytes = kBM * kD * 2;    // one stage of Q or dO
  static constexpr int kDSBytes = kBN * kBM * 2;  // one dS^T buffer
  static constexpr int kOffV = kKVBytes, kOffQ = 2 * kKVBytes, kOffDO = kOffQ + kStages * kQBytes;
  static constexpr int kOffDS = kOffDO + kStages * kQBytes, kOffStats = kOffDS + 2 * kDSBytes;
  static constexpr int kSmemBytes = kOffStats + kStages * 2 * kBM * 4 + 1024;  // + alignment slack
  static constexpr int kConsumers = 256, kConsumerWarps = kConsumers / 32, kThreads = kConsumers + 128;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  // d 128: dQ columns split over the warpgroups (all keys each); d 64: keys.
  static constexpr bool kDqSplitsColumns = kD == 128;
  static_assert(kSmemBytes <= 227 * 1024, "fits the 227 KB of shared memory of a Hopper SM");
};

// Named barrier of the dS^T hand-off (d 128: both consumer warpgroups; d 64:
// barrier kDsBarrier + c of warpgroup c alone).
constexpr int kDsBarrier = 1;

// Broken cu_seqlens trap (as in the Hopper forward, without a printf: ptxas
// serialises the wgmmas of a kernel that calls one; the host API validates
// cu_seqlens before the launch).
__device__ __forceinline__ void check_sequence(const int32_t* cu, int b, int num_seqs, int total, int len,
                                               int max_len) {
  const bool bad = len < 0 || len > max_len || (b == 0 && cu[0] != 0) || (b == num_seqs - 1 && cu[num_seqs] != total);
  if (bad) __trap();
}

// acc[32] (m64n64, fp32) = A B over the d of a row: A = 64 rows of a K-major
// [d / 64 boxes][a_rows][128 B] tile starting at `a`, B = the 64 rows of a
// K-major [boxes][64][128 B] tile.
template <int kD>
__device__ __forceinline__ void issue_rows_by_d(float (&acc)[32], const unsigned char* a, int a_rows,
                                                const unsigned char* b) {
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint64_t da = make_desc_sw128(a + (kk / 4) * (a_rows * 128) + (kk % 4) * 32, 16, 1024);
    const uint64_t db = make_desc_sw128(b + (kk / 4) * (64 * 128) + (kk % 4) * 32, 16, 1024);
    wgmma_m64n64k16<0, 0>(acc, da, db, kk > 0 ? 1 : 0);
  }
}

// acc[kD / 2] += A B: A = 64 x 64 from registers (4 k16 fragments), B = a
// [boxes][64 rows][128 B] tile read MN-major (rows are k, the d boxes n).
template <int kD>
__device__ __forceinline__ void issue_acc_rs(float (&acc)[kD / 2], const uint32_t (&a)[4][4], const unsigned char* b) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint64_t db = make_desc_sw128(b + kk * 2048, 64 * 128, 1024);
    if constexpr (kD == 128) {
      wgmma_m64n128k16_rs<1>(acc, a[kk], db, 1);
    } else {
      wgmma_m64n64k16_rs<1>(acc, a[kk], db, 1);
    }
  }
}

template <int kD, class Mask>
__global__ void __launch_bounds__(Sm90BwdTile<kD>::kThreads, 1)
    attention_bwd_sm90_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                              const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_do,
                              const AttentionBackwardParams bp) {
#if SLIME_SM90A
  using T = Sm90BwdTile<kD>;
  constexpr int kBM = T::kBM, kBN = T::kBN, kStages = T::kStages, kBoxes = T::kBoxes;
  const AttentionForwardParams& p = bp.fwd;
  extern __shared__ __align__(1024) unsigned char bwd_smem_raw[];
  __shared__ __align__(8) uint64_t kv_full, qdo_full[kStages], qdo_empty[kStages];
  unsigned char* smem = bwd_smem_raw + ((1024 - (smem_u32(bwd_smem_raw) & 1023)) & 1023);
  unsigned char* sK = smem;
  unsigned char* sV = smem + T::kOffV;
  unsigned char* sQ = smem + T::kOffQ;                          // [kStages][kQBytes]
  unsigned char* sdO = smem + T::kOffDO;                        // [kStages][kQBytes]
  unsigned char* sdS = smem + T::kOffDS;                        // [2][kDSBytes]
  float* sLse = reinterpret_cast<float*>(smem + T::kOffStats);  // [kStages][kBM], log2 domain
  float* sDelta = sLse + kStages * kBM;                         // [kStages][kBM]

  const int n_block = blockIdx.x, b = blockIdx.y, hk = blockIdx.z;
  const int q0 = p.cu_seqlens_q[b], len_q = p.cu_seqlens_q[b + 1] - q0;
  const int k0 = p.cu_seqlens_k[b], len_k = p.cu_seqlens_k[b + 1] - k0;
  const int tid = threadIdx.x;
  if (n_block == 0 && hk == 0 && tid == 0) {
    check_sequence(p.cu_seqlens_q, b, p.num_seqs, p.tokens_q, len_q, 0x7fffffff);
    check_sequence(p.cu_seqlens_k, b, p.num_seqs, p.tokens_k, len_k, p.max_seqlen_k);
  }
  const int key0 = n_block * kBN;
  if (key0 >= len_k) return;  // the whole CTA, before any barrier

  const int group = p.heads_q / p.heads_kv;
  const Mask mask = make_mask<Mask>(p.options, len_q, len_k);
  const int keys_here = min(kBN, len_k - key0);
  // Query rows [first, len_q) see some key of this block; step it is query
  // head hk * group + it / n_m, query block m_begin + it % n_m.
  const int first = max(0, mask.first_row(key0));
  const int m_begin = first / kBM;
  const int m_end = first < len_q ? (len_q + kBM - 1) / kBM : m_begin;
  const int n_m = m_end - m_begin;
  const int n_iter = n_m * group;
  const int64_t q_stride = int64_t(p.heads_q) * kD, kv_stride = int64_t(p.heads_kv) * kD;

  if (tid == 0) {
    mbar_init(&kv_full, 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&qdo_full[s], 1 + 32);  // the copies' expect_tx arrival + the stats warp's lanes
      mbar_init(&qdo_empty[s], T::kConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (tid >= T::kConsumers) {
    // ---- producer
    setmaxnreg_dec<T::kProducerRegs>();
    const int pw = (tid - T::kConsumers) / 32, lane = tid & 31;
    if (n_iter == 0) return;
    if (pw == 0 && lane == 0) {
      tma_prefetch_descriptor(&map_q);
      tma_prefetch_descriptor(&map_k);
      tma_prefetch_descriptor(&map_v);
      tma_prefetch_descriptor(&map_do);
      mbar_arrive_expect_tx(&kv_full, 2 * T::kKVBytes);
#pragma unroll
      for (int j = 0; j < kBoxes; ++j) {
        tma_load_3d(sK + j * (kBN * 128), &map_k, &kv_full, 64 * j, hk, k0 + key0);
        tma_load_3d(sV + j * (kBN * 128), &map_v, &kv_full, 64 * j, hk, k0 + key0);
      }
      for (int it = 0; it < n_iter; ++it) {
        const int s = it % kStages;
        const int h = hk * group + it / n_m, row0 = (m_begin + it % n_m) * kBM;
        mbar_wait(&qdo_empty[s], ((it / kStages) & 1) ^ 1);
        mbar_arrive_expect_tx(&qdo_full[s], 2 * T::kQBytes);
#pragma unroll
        for (int j = 0; j < kBoxes; ++j) {
          tma_load_3d(sQ + s * T::kQBytes + j * (kBM * 128), &map_q, &qdo_full[s], 64 * j, h, q0 + row0);
          tma_load_3d(sdO + s * T::kQBytes + j * (kBM * 128), &map_do, &qdo_full[s], 64 * j, h, q0 + row0);
        }
      }
    } else if (pw == 1) {
      // lse in the log2 domain and D of the step's rows; rows past the
      // sequence and rows that saw no key (lse = -inf) get lse = +inf, so
      // every P of theirs is exp2(-inf) = 0.
      const float* delta = bp.workspace + int64_t(p.tokens_q) * q_stride + int64_t(q0) * p.heads_q;
      for (int it = 0; it < n_iter; ++it) {
        const int s = it % kStages;
        const int h = hk * group + it / n_m, row0 = (m_begin + it % n_m) * kBM;
        mbar_wait(&qdo_empty[s], ((it / kStages) & 1) ^ 1);
#pragma unroll
        for (int r = lane; r < kBM; r += 32) {
          const int row = row0 + r;
          float l2 = INFINITY, dl = 0.f;
          if (row < len_q) {
            const float l = p.lse[int64_t(q0 + row) * p.heads_q + h];
            l2 = l == -INFINITY ? INFINITY : l * kLog2e;
            dl = delta[int64_t(row) * p.heads_q + h];
          }
          sLse[s * kBM + r] = l2;
          sDelta[s * kBM + r] = dl;
        }
        mbar_arrive(&qdo_full[s]);  // release: the stores above before the consumers' reads
      }
    }
    return;
  }

  // ---- consumers
  setmaxnreg_inc<T::kConsumerRegs>();
  const int c = tid / 128, wq = (tid / 32) & 3, lane = tid & 31;
  // This thread's accumulator rows within the warpgroup's 64: r and r + 8.
  const int r_base = 16 * wq + (lane >> 2);
  float acc_dk[kD / 2], acc_dv[kD / 2];
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) acc_dk[i] = acc_dv[i] = 0.f;

  if (n_iter > 0) {
    const float scale_log2 = p.softmax_scale * kLog2e;
    float* const dq_acc = bp.workspace + int64_t(q0) * q_stride;
    const unsigned char* kc = sK + c * (64 * 128);  // the warpgroup's 64 keys of box 0
    const unsigned char* vc = sV + c * (64 * 128);
    const int key_base = key0 + 64 * c + r_base;  // this thread's keys: key_base, key_base + 8
    auto release = [&](uint64_t* bar) { mbar_arrive_if(bar, lane == 0); };
    mbar_wait(&kv_full, 0);

    for (int it = 0; it < n_iter; ++it) {
      const int s = it % kStages;
      const int h = hk * group + it / n_m, row0 = (m_begin + it % n_m) * kBM;
      const unsigned char* q = sQ + s * T::kQBytes;
      const unsigned char* dO = sdO + s * T::kQBytes;
      const float* ls = sLse + s * kBM;
      const float* ds = sDelta + s * kBM;
      unsigned char* dS = sdS + (it & 1) * T::kDSBytes;
      mbar_wait(&qdo_full[s], (it / kStages) & 1);

      // S^T and dP^T (keys x queries). Element i of either: key r_base + 8
      // ((i / 2) % 2) of the warpgroup, query 8 (i / 4) + 2 (lane % 4) + i % 2.
      float st[32], dpt[32];
      wgmma_fence();
      issue_rows_by_d<kD>(st, kc, kBN, q);
      wgmma_commit();
      issue_rows_by_d<kD>(dpt, vc, kBN, dO);
      wgmma_commit();
      wgmma_wait<1>();
      fence_registers(st);

      // P^T, packed to bf16 A fragments (k16 step kk: queries 16 kk ..).
      const bool need_mask = key0 + kBN > mask.key_end(row0, len_k);
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int qc = 8 * (i / 4) + 2 * (lane & 3) + (i & 1);
        float pv = exp2_ftz(fmaf(st[i], scale_log2, -ls[qc]));
        if (need_mask) {
          const int key = key_base + 8 * ((i >> 1) & 1);
          if (key >= mask.key_end(row0 + qc, len_k)) pv = 0.f;
        }
        st[i] = pv;
      }
      uint32_t pa[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) pa[kk][e] = pack_bf16(st[8 * kk + 2 * e], st[8 * kk + 2 * e + 1]);

      // dS^T = P^T (dP^T - D) with the bf16 P^T (element i is half i % 2 of
      // register (i / 2) % 4 of pa[i / 8]).
      wgmma_wait<0>();
      fence_registers(dpt);
      uint32_t dsa[4][4];
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const uint32_t w = pa[i / 8][(i / 2) % 4];
        const float pv = (i & 1) ? bf16_hi(w) : bf16_lo(w);
        dpt[i] = pv * (dpt[i] - ds[8 * (i / 4) + 2 * (lane & 3) + (i & 1)]);
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) dsa[kk][e] = pack_bf16(dpt[8 * kk + 2 * e], dpt[8 * kk + 2 * e + 1]);

      // dV += P^T dO, dK += dS^T Q.
      wgmma_fence();
      issue_acc_rs<kD>(acc_dv, pa, dO);
      issue_acc_rs<kD>(acc_dk, dsa, q);
      wgmma_commit();

      // dS^T -> shared memory while they run: row = the key in the CTA's 128,
      // 128 bytes of 64 queries, 16-byte chunk j (queries 8 j ..) stored at
      // chunk j ^ (row % 8) (the 128-byte swizzle wgmma reads). The pair of
      // accumulator block j, row half hh is register 2 (j % 2) + hh of
      // dsa[j / 2].
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = 64 * c + r_base + 8 * hh;
          *reinterpret_cast<uint32_t*>(dS + row * 128 + ((j ^ (row & 7)) * 16) + 4 * (lane & 3)) =
              dsa[j / 2][2 * (j % 2) + hh];
        }
      fence_proxy_async();  // the stores before the wgmma reads below
      if constexpr (T::kDqSplitsColumns) {
        named_barrier_sync(kDsBarrier, T::kConsumers);
      } else {
        named_barrier_sync(kDsBarrier + c, 128);
      }

      // dQ = dS K for the warpgroup's share (see the top of the file): A =
      // dS^T read MN-major (16 keys = 2048 bytes per k16 step), B = K read
      // MN-major (the d boxes are n).
      float acc_dq[32];
      wgmma_fence();
      if constexpr (T::kDqSplitsColumns) {
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk) {
          const uint64_t da = make_desc_sw128(dS + kk * 2048, 64 * 128, 1024);
          const uint64_t db = make_desc_sw128(sK + c * (kBN * 128) + kk * 2048, kBN * 128, 1024);
          wgmma_m64n64k16<1, 1>(acc_dq, da, db, kk > 0 ? 1 : 0);
        }
      } else {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          const uint64_t da = make_desc_sw128(dS + c * (64 * 128) + kk * 2048, 64 * 128, 1024);
          const uint64_t db = make_desc_sw128(sK + c * (64 * 128) + kk * 2048, kBN * 128, 1024);
          wgmma_m64n64k16<1, 1>(acc_dq, da, db, kk > 0 ? 1 : 0);
        }
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(acc_dq);
      fence_registers(acc_dk);
      fence_registers(acc_dv);
      release(&qdo_empty[s]);  // this step's Q, dO, lse and D are no longer read

      // dq += dQ (unscaled: the dq conversion multiplies by the softmax scale).
      // Accumulator element 4 j + 2 hh + e: query r_base + 8 hh, column 8 j +
      // 2 (lane % 4) + e of the warpgroup's columns.
      const int col0 = T::kDqSplitsColumns ? 64 * c : 0;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = row0 + r_base + 8 * hh;
        if (row < len_q) {
          float* dst = dq_acc + int64_t(row) * q_stride + int64_t(h) * kD + col0 + 2 * (lane & 3);
#pragma unroll
          for (int j = 0; j < 8; ++j)
            atomicAdd(reinterpret_cast<float2*>(dst + 8 * j),
                      make_float2(acc_dq[4 * j + 2 * hh], acc_dq[4 * j + 2 * hh + 1]));
        }
      }
    }
  }

  // dK = scale * dS^T Q summed, dV = P^T dO summed; keys past the sequence
  // are not written, keys no row sees get zeros.
  bf16* gdK = static_cast<bf16*>(bp.dk) + int64_t(k0 + key0) * kv_stride + int64_t(hk) * kD;
  bf16* gdV = static_cast<bf16*>(bp.dv) + int64_t(k0 + key0) * kv_stride + int64_t(hk) * kD;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int key = 64 * c + r_base + 8 * hh;
    if (key < keys_here) {
#pragma unroll
      for (int j = 0; j < kD / 8; ++j) {
        const int64_t off = int64_t(key) * kv_stride + 8 * j + 2 * (lane & 3);
        *reinterpret_cast<uint32_t*>(gdK + off) =
            pack_bf16(acc_dk[4 * j + 2 * hh] * p.softmax_scale, acc_dk[4 * j + 2 * hh + 1] * p.softmax_scale);
        *reinterpret_cast<uint32_t*>(gdV + off) = pack_bf16(acc_dv[4 * j + 2 * hh], acc_dv[4 * j + 2 * hh + 1]);
      }
    }
  }
#else
  __trap();  // built without sm_90a; the dispatcher never launches this
#endif
}

template <int kD, class Mask>
void launch_bwd_sm90(const AttentionBackwardParams& bp, cudaStream_t stream) {
  using T = Sm90BwdTile<kD>;
  using ::slime::ops::detail::tma::make_heads_map;
  const AttentionForwardParams& p = bp.fwd;
  constexpr const char* what = "attention (Hopper backward)";
  const CUtensorMap mq = make_heads_map(what, p.q, p.tokens_q, p.heads_q, kD, T::kBM);
  const CUtensorMap mk = make_heads_map(what, p.k, p.tokens_k, p.heads_kv, kD, T::kBN);
  const CUtensorMap mv = make_heads_map(what, p.v, p.tokens_k, p.heads_kv, kD, T::kBN);
  const CUtensorMap mdo = make_heads_map(what, bp.d_o, p.tokens_q, p.heads_q, kD, T::kBM);
  auto kernel = attention_bwd_sm90_kernel<kD, Mask>;
  SLIME_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes));
  // Key blocks in increasing blockIdx.x: under the causal mask the first ones
  // see the most query rows and start first.
  const dim3 grid(unsigned((p.max_seqlen_k + T::kBN - 1) / T::kBN), unsigned(p.num_seqs), unsigned(p.heads_kv));
  kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(mq, mk, mv, mdo, bp);
  SLIME_CUDA_CHECK_LAUNCH();
}

// "" when the Hopper backward can run bp, else why not.
const char* sm90_bwd_refusal(const AttentionBackwardParams& bp) {
  const AttentionForwardParams& p = bp.fwd;
  return ::slime::ops::detail::attention_sm90::refusal(p.head_dim, {p.q, p.k, p.v, bp.d_o},
                                                       "its tensor maps need q, k, v and d_o 16-byte aligned");
}

// SLIME_ATTENTION_SM90_BWD=1: the automatic choice takes the Hopper backward.
bool sm90_bwd_env_wants() {
  static const bool on = ::slime::ops::detail::attention_sm90::env_switch("SLIME_ATTENTION_SM90_BWD", false);
  return on;
}

}  // namespace

bool detail::attention_backward_sm90(const AttentionBackwardParams& bp, StreamHandle stream) {
  const AttentionForwardParams& p = bp.fwd;
  const AttentionKernel want = p.options.kernel;
  if (want == AttentionKernel::mma_sync) return false;
  if (want == AttentionKernel::automatic && !sm90_bwd_env_wants()) return false;
  // The deterministic backward (dq in a fixed order) is the mma.sync one; so
  // is a call without tokens (nothing to map; the caller zero-fills).
  if (p.options.deterministic || p.tokens_q == 0 || p.tokens_k == 0) return false;
  const char* refusal = sm90_bwd_refusal(bp);
  if (want == AttentionKernel::sm90) {
    SLIME_CHECK(*refusal == '\0',
                "attention: the Hopper backward kernel (AttentionKernel::sm90) cannot run this call: ", refusal);
  } else if (*refusal != '\0') {
    return false;
  }
  if (p.num_seqs == 0 || p.max_seqlen_k == 0 || p.heads_q == 0) return true;
  const bool causal = p.options.causal;
  if (p.head_dim == 128) {
    causal ? launch_bwd_sm90<128, CausalMask>(bp, stream) : launch_bwd_sm90<128, FullMask>(bp, stream);
  } else {
    causal ? launch_bwd_sm90<64, CausalMask>(bp, stream) : launch_bwd_sm90<64, FullMask>(bp, stream);
  }
  return true;
}

}  // namespace slime::ops::cuda
