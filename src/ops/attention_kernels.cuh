// src/ops/attention_kernels.cuh: FlashAttention-2 style kernels for packed
// (varlen) GQA attention on bf16, head_dim 32, 64, 72, 80, 96, 128 or 256, with
// a mask policy (CausalMask / FullMask from slime/ops/cpu/attention.hpp).
// Included only by the per-variant translation units
// attention_{fwd,bwd}_hd{32,64,72,80,96,128,256}.cu.
//
// Head dims: the tiles are computed at d rounded up to 16 (padded_head_dim;
// only 72 changes, to 80). Columns past d are zero-filled in shared memory by
// the loads, add nothing to any product, and are neither stored nor added to
// the dq accumulator; global strides and the workspace use the real d. Every
// d is a multiple of 8, so a 16-byte chunk is all real or all padding and
// rows stay 16-byte aligned. The shapes per d are in FwdConfig and BwdConfig.
//
// Tensor cores through mma.sync.m16n8k16 (bf16 in, fp32 accumulate), operands
// from shared memory by ldmatrix, tiles loaded by cp.async (double-buffered);
// the PTX wrappers are in ptx.cuh.
// Shared-memory rows are padded by 16 bytes (row stride d + 8 elements), so the
// 8 row addresses of one ldmatrix 8x8 matrix fall in 8 distinct 16-byte bank
// groups (no conflicts) and every 16-byte cp.async destination stays aligned.
//
// Fragment layouts used throughout (g = lane / 4, t = lane % 4), from the PTX
// ISA for mma.m16n8k16 with .bf16:
//   A (16x16, row-major) regs a0..a3: (row g, cols 2t..2t+1), (row g+8, same),
//                                     (row g, cols 2t+8..+9), (row g+8, same)
//   B (16x8, "col")       regs b0, b1: (rows 2t..2t+1, col g), (rows 2t+8..+9, col g)
//   C (16x8 fp32)         c0..c3:      (row g, cols 2t, 2t+1), (row g+8, cols 2t, 2t+1)
// ldmatrix.x4 gives register r the 8x8 matrix whose row addresses come from
// lanes 8r..8r+7; without .trans thread t holds (row t/4, cols 2(t%4)..+1) of
// it, with .trans (rows 2(t%4)..+1, col t/4).
// Two adjacent C tiles (16x8 each) hold exactly the A fragment of the 16x16
// tile they form: c of tile 2k -> a0, a1; c of tile 2k+1 -> a2, a3 (after
// packing to bf16). This is how P (forward) and P^T, dS^T (backward) feed the
// next product without going through shared memory.
//
// Rounding: bf16 operands into fp32 accumulators everywhere. P is rounded to
// bf16 for P V (forward) and P^T dO (backward), dS to bf16 for dS^T Q and
// dS K; the backward forms dS = P (dP - D) from the bf16 P, as FA2 does for
// the products. Softmax statistics (max, sum, lse) and D stay fp32.
//
// Determinism: forward (o, lse), dk and dv are bitwise run-to-run
// deterministic (fixed summation order). dq is accumulated across key blocks
// with fp32 atomics (red.global.add.v2.f32): not run-to-run deterministic (the
// order of additions varies; differences are fp32 rounding), unless
// AttentionOptions::deterministic: then the key-block CTAs of a (sequence,
// query head, query block, column split) add their dq partials in key-block
// order, the last one first. A turn counter per query block (int32 in the
// workspace, zeroed with the accumulator) says whose turn it is: under causal
// and full masks the key blocks that see query block m are 0..n_last(m), and
// the CTA of key block n waits (thread 0, before the barrier that precedes
// its adds) until the counter reads n_last(m) - n, adds, fences, and passes
// the turn on after its next barrier. Why the last first: under the causal
// mask key block n + 1 reaches query block m two steps before key block n
// does (its first query block is two blocks later), so each CTA's turn has
// already come when it asks and nobody waits; in key-block order (0 first,
// as before 2026-12-07) the short last key blocks held their SMs waiting for
// key block 0's whole walk down the sequence, and the deterministic backward
// took 1.6-2.1x the time of the atomic one. No deadlock: the deterministic
// grid maps blockIdx.x to key block gridDim.x - 1 - blockIdx.x, so for each
// (sequence, kv head) the key blocks start last first and a CTA only waits
// for CTAs that started before it. Cost: bench_attention's /det rows.
//
// Resources (ptxas -v, sm_90a, CUDA 13.0; regs / spill bytes / smem / CTAs
// per SM; LDSM = ldmatrix.x4 per warp, counted in the SASS):
//   fwd d 128: 214-216 / 0 / 102 KB / 1 (8 warps); 32 LDSM per 64 HMMA.
//   fwd d 64:  254-255 / 0 / 54 KB / 2 (4 warps each, 8 warps per SM);
//              32 LDSM per 128 HMMA.
//   bwd d 128: 255 / 0 (full), 4 B (causal) / 173 KB / 1; per step 176 LDSM
//              per 320 HMMA, 1 barrier.
//   bwd d 64:  237-242 / 0 / 109 KB / 1; per step 88 LDSM per 160 HMMA,
//              1 barrier.
//   The other head dims (fwd; bwd): d 32: 186-192 / 0 / 30 KB / 2; 172-173 /
//   0 / 77 KB / 1. d 72 (tiles of 80): 178-184 / 0 / 66 KB / 1; 241-255 / 0 /
//   125 KB / 1. d 80: 168-170 / 0 / 66 KB / 1; 248-252 / 0 / 125 KB / 1.
//   d 96: 184-186 / 0 / 78 KB / 1; 246-253 / 0 / 141 KB / 1. d 256: 254-255 /
//   0 (full), 8 B (causal) / 198 KB / 1; 247-249 / 0 / 218.5 KB / 1, two CTAs
//   per key block.
//   The printf of check_sequence costs ~16-24 bytes of stack on the cold path.
// Measured times: README's benchmark table and bench/RESULTS.md.
//
// Design model: a warp's ldmatrix.x4 moves 512 B of shared memory (4 of the
// SM's 128 B/clk), an m16n8k16 mma is 4096 FLOP, and mma.sync peaks at ~2/3
// of the dense bf16 rate, ~1.5 clk per mma per SM, so more than ~0.37 LDSM
// per mma makes a loop shared-memory bound. Hence:
//  1. Forward d = 64: each warp owns 2 m-tiles (32 query rows), BM 128 with 4
//     warps (FA2's d 64 shape), so every K and V fragment feeds 2 mma: 0.25
//     LDSM per mma instead of 0.5 (0.031 instead of 0.0625 B of shared memory
//     per FLOP), within 255 registers and no spill; 8 warps per SM, each with
//     twice the independent mma. d = 128 keeps one m-tile (two would need >
//     255 registers).
//  2. Backward, dQ_partial split 2 x 4 warps (32 x 32 each) at d = 128
//     instead of 4 x 2 (16 x 64): 32 instead of 40 LDSM per 64 mma in that
//     product.
//  3. Backward, one barrier per step: dS^T is double buffered (+18 KB shared
//     memory, still 1 CTA per SM at both d) and the dQ_partial of step it
//     runs after the barrier of step it + 1; the Q / dO refill is issued
//     after that barrier. The dQ product, its 16 (d 128) red.v2 per thread
//     and the next step's S^T / dP^T of other warps overlap instead of all 8
//     warps draining at each barrier.
//  4. Backward d = 64: the warp's K and V A fragments stay in registers (32
//     registers, no spill): 88 instead of 96 LDSM per step.
//  Each choice is one constant: FwdConfig::kMTiles / kWarps / kMinBlocks,
//  BwdConfig::kKVInRegs and kWarpsM.
//
// What would be tuned next: the backward is still shared-memory bound (0.55
// LDSM per mma at d 128: every warp reads the whole Q and dO tile twice, as B
// of S^T / dP^T and as B of dK / dV); FA2's layout (warps 2 x 4 over the 64 x
// 128 S and dP tiles, P and dS through shared memory, dK / dV split 4 x 2 over
// keys x d) needs ~144 LDSM + 32 stores per step instead of 176; a second
// backward CTA per SM is blocked by registers, not shared memory (d 64 at 128
// registers spills ~240 B); BN 128 for the d 64 forward (needs Q out of
// registers); splitting the K and V cp.async groups so that the softmax
// overlaps the V load; staging o through shared memory for 16-byte stores;
// red.v4 for dq (pairs of lanes swap halves: half the red instructions, same
// sectors); a persistent, longest-first tile scheduler for varlen batches (the
// backward grid already starts the longest causal key blocks first); a
// deterministic dq (a second kernel iterating key blocks per query block, at 3
// more products of the 5); and in the end a wgmma (sm_90a) rewrite with TMA
// loads and warp specialisation (FA3).
//
// Host emulation: tests/ops/test_attention.cpp defines SLIME_ATTENTION_EMULATION
// and runs these kernel bodies on the CPU (threads as fibers; ldmatrix, mma,
// shuffles and cp.async emulated from the PTX ISA's definitions), so that CI
// without a GPU checks the fragment index math. Under that macro this file
// leaves out ptx.cuh (the test supplies its own cp_async_*, ldmatrix_x4* and
// mma_bf16) and the launchers, and takes dynamic shared memory from
// SLIME_ATTENTION_DYNAMIC_SMEM. The shuffles here (quad_max, quad_sum, the
// preprocess's row sum) stay in this file for that reason.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "slime/ops/cuda/attention.hpp"

#if !defined(SLIME_ATTENTION_EMULATION)
#include "ptx.cuh"
#define SLIME_ATTENTION_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace slime::ops::cuda::attention_impl {

using bf16 = __nv_bfloat16;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Roundings spelled out where a row's result must not depend on where the
// row sits in its tile: nvcc may contract a * b + c into one fma in one
// unrolled copy of a loop and not in another, so a decode row (row 0 of its
// tile) and the same row in training (row i of a 128-row tile) could differ
// in the last bit of lse. These never contract.
#if defined(SLIME_ATTENTION_EMULATION)
inline float mul_rn(float a, float b) { return a * b; }
inline float add_rn(float a, float b) { return a + b; }
inline float fma_rn(float a, float b, float c) { return std::fma(a, b, c); }
#else
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
#endif

#if !defined(SLIME_ATTENTION_EMULATION)
using namespace ::slime::ops::detail::ptx;  // cp_async_*, ldmatrix_x4*, mma_bf16

// The deterministic dq's turns (see Determinism above); the emulator
// supplies its own.
__device__ __forceinline__ void dq_turn_wait(const int* turn, int mine) {
  int v;
  for (;;) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(turn) : "memory");
    if (v == mine) return;
    __nanosleep(64);
  }
}
__device__ __forceinline__ void dq_turn_pass(int* turn) {
  __threadfence();
  atomicAdd(turn, 1);
}
__device__ __forceinline__ void dq_adds_fence() { __threadfence(); }

// 2^x with subnormal results flushed to 0 (one MUFU.EX2; exp2f's subnormal
// handling adds three instructions around each). P = 2^x below 2^-126 is
// negligible beside the row maximum's 1 in every softmax sum here. The
// emulator supplies its own.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#endif

// Two floats -> bf16x2 (round to nearest even); `lo` in the low half, which is
// the lower column index in every fragment.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t r;
  memcpy(&r, &v, sizeof r);  // no type punning through pointers
  return r;
}

// The two bf16 of a 32-bit word as floats (low half first).
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// The A fragment of the 16x16 tile formed by C tiles c[2k] and c[2k+1].
__device__ __forceinline__ void c_pair_to_a(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack_bf16(lo[0], lo[1]);
  a[1] = pack_bf16(lo[2], lo[3]);
  a[2] = pack_bf16(hi[0], hi[1]);
  a[3] = pack_bf16(hi[2], hi[3]);
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Lane offsets into a tile of row stride `stride` for the three ldmatrix.x4
// patterns (m16 = rows 0..15 at cols 0 / 8, the A pattern and the .trans B
// pattern; n16 = two 8-row groups at cols 0 / 8, the non-trans B pattern for
// two n-tiles; n16t = the .trans A pattern of dS^T).
__device__ __forceinline__ int lane_off_m16(int lane, int stride) { return (lane & 15) * stride + (lane >> 4) * 8; }
__device__ __forceinline__ int lane_off_n16(int lane, int stride) {
  return ((lane & 7) + ((lane >> 4) << 3)) * stride + ((lane >> 3) & 1) * 8;
}

// Copies a kRows x kD bf16 tile (global row stride `stride` elements) into
// shared memory with row stride kD + 8; rows >= valid and columns >= kDValid
// (a multiple of 8: the padding of a head dim that is not a multiple of 16)
// are zero-filled. Row 0 of `g` must be a valid address (it is the dummy
// source of zero fills).
template <int kRows, int kD, int kThreads, int kDValid = kD>
__device__ __forceinline__ void load_tile(bf16* s, const bf16* g, int64_t stride, int valid, int tid) {
  static_assert(kDValid % 8 == 0 && kDValid <= kD, "whole 16-byte chunks are valid or padding");
  constexpr int kChunksPerRow = kD / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  constexpr int kIters = (kChunks + kThreads - 1) / kThreads;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int c = it * kThreads + tid;
    if (kChunks % kThreads == 0 || c < kChunks) {
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
      const bool ok = r < valid && (kDValid == kD || col < kDValid);
      cp_async_16(s + r * (kD + 8) + col, ok ? g + r * stride + col : g, ok);
    }
  }
}

template <class Mask>
__device__ __forceinline__ Mask make_mask(const AttentionOptions& opt, int len_q, int len_k) {
  if constexpr (std::is_same_v<Mask, CausalMask>) {
    return CausalMask{opt.offset_for(len_q, len_k)};
  } else {
    return Mask{};
  }
}

// Cheap device-side checks of cu_seqlens (the host cannot read them without a
// sync): lengths non-negative, within max_seqlen (the grid's extent), first
// entry 0, last entry the token count. A broken invariant traps.
__device__ __forceinline__ void check_sequence(const int32_t* cu, int b, int num_seqs, int total, int len, int max_len,
                                               const char* which) {
  const bool bad = len < 0 || len > max_len || (b == 0 && cu[0] != 0) || (b == num_seqs - 1 && cu[num_seqs] != total);
  if (bad) {
    printf("slime attention: invalid cu_seqlens_%s at sequence %d (length %d, max_seqlen %d, total %d)\n", which, b,
           len, max_len, total);
    __trap();
  }
}

// The head dim the tiles are computed at: d rounded up to the mma's k of 16.
// The columns past d (72 -> 80) are zero in shared memory, so they add nothing
// to q k^T, dP or any product, and the results' columns there are not stored.
constexpr int padded_head_dim(int d) { return (d + 15) / 16 * 16; }

// Opt-in dynamic shared memory per block on sm_90 (227 KB).
constexpr int kMaxSmemBytes = 227 * 1024;

// ---- Forward -------------------------------------------------------------------

// Tile shapes. Each warp owns kMTiles m16 tiles of query rows and keeps their
// Q fragments in registers (kQInRegs); BM = 16 * kMTiles * warps. Shared
// memory: Q [BM, d+8] and kStages x (K, V) [BN, d+8] (d padded to 16).
//   d = 128: BM 128, BN 64, 8 warps, 1 CTA/SM: 102 KB smem, <= 255 registers.
//   d = 64:  BM 128 (4 warps x 2 m-tiles), BN 64, 2 CTAs/SM: 54 KB smem,
//            <= 255 registers.
//   d = 32:  the shape of d 64: 30 KB smem.
//   d = 72, 80 (tiles at 80), 96: the shape of d 128: 66, 66, 78 KB smem.
//   d = 256: the shape of d 128 with Q read from shared memory at every key
//            block (its fragments would take 64 more registers beside the
//            128 of the O accumulator): 198 KB smem.
// Chosen by construction (as FA2's shapes).
template <int kD>
struct FwdConfig {
  static constexpr int kHeadDim = kD;                 // of the tensors
  static constexpr int kDim = padded_head_dim(kD);    // of the tiles
  static constexpr int kMTiles = kDim <= 64 ? 2 : 1;  // m-tiles of 16 query rows per warp
  static constexpr int kWarps = kDim <= 64 ? 4 : 8;
  static constexpr bool kQInRegs = kDim <= 128;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockM = 16 * kMTiles * kWarps;
  static constexpr int kBlockN = 64;
  static constexpr int kStages = 2;
  static constexpr int kMinBlocks = kDim <= 64 ? 2 : 1;
  static constexpr int kStride = kDim + 8;  // smem row stride, elements
  static constexpr int kSmemBytes = (kBlockM + 2 * kStages * kBlockN) * kStride * int(sizeof(bf16));
  static_assert(kD % 8 == 0 && kBlockN % 16 == 0, "tiles are made of 16x16 mma steps and 16-byte rows");
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared memory beyond the sm_90 limit");
};

template <class Cfg, class Mask>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) attention_fwd_kernel(const AttentionForwardParams p) {
  // kD: the tensors' head dim (global strides and stores); kDP: the tiles'.
  constexpr int kD = Cfg::kHeadDim, kDP = Cfg::kDim, kBM = Cfg::kBlockM, kBN = Cfg::kBlockN;
  constexpr int kStride = Cfg::kStride, kThreads = Cfg::kThreads;
  SLIME_ATTENTION_DYNAMIC_SMEM(smem_raw);
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sK = sQ + kBM * kStride;                 // [kStages][kBN][kStride]
  bf16* sV = sK + Cfg::kStages * kBN * kStride;  // [kStages][kBN][kStride]

  // The longest causal rows (highest block index) start first.
  const int m_block = int(gridDim.x) - 1 - int(blockIdx.x);
  const int b = blockIdx.y, h = blockIdx.z;
  const int q0 = p.cu_seqlens_q[b], len_q = p.cu_seqlens_q[b + 1] - q0;
  const int k0 = p.cu_seqlens_k[b], len_k = p.cu_seqlens_k[b + 1] - k0;
  if (blockIdx.x == 0 && h == 0) {
    check_sequence(p.cu_seqlens_q, b, p.num_seqs, p.tokens_q, len_q, p.max_seqlen_q, "q");
    check_sequence(p.cu_seqlens_k, b, p.num_seqs, p.tokens_k, len_k, 0x7fffffff, "k");
  }
  const int row0 = m_block * kBM;
  if (row0 >= len_q) return;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int hk = h / (p.heads_q / p.heads_kv);
  const Mask mask = make_mask<Mask>(p.options, len_q, len_k);
  const int rows_here = min(kBM, len_q - row0);
  // Keys [0, key_end) are seen by some row of this block; keys [0, full_end)
  // by every row (prefix masks: key_end is non-decreasing in the row).
  const int key_end = mask.key_end(row0 + rows_here - 1, len_k);
  const int full_end = mask.key_end(row0, len_k);
  const int n_blocks = (key_end + kBN - 1) / kBN;

  const int64_t q_stride = int64_t(p.heads_q) * kD, kv_stride = int64_t(p.heads_kv) * kD;
  const bf16* gQ = static_cast<const bf16*>(p.q) + int64_t(q0 + row0) * q_stride + h * kD;
  const bf16* gK = static_cast<const bf16*>(p.k) + int64_t(k0) * kv_stride + hk * kD;
  const bf16* gV = static_cast<const bf16*>(p.v) + int64_t(k0) * kv_stride + hk * kD;

  // Groups in flight: {Q}, {K0, V0}; then one group per loop iteration.
  load_tile<kBM, kDP, kThreads, kD>(sQ, gQ, q_stride, rows_here, tid);
  cp_async_commit();
  if (n_blocks > 0) {
    load_tile<kBN, kDP, kThreads, kD>(sK, gK, kv_stride, min(kBN, len_k), tid);
    load_tile<kBN, kDP, kThreads, kD>(sV, gV, kv_stride, min(kBN, len_k), tid);
  }
  cp_async_commit();

  const float scale_log2 = p.softmax_scale * kLog2e;
  constexpr int kMT = Cfg::kMTiles;  // m-tiles (16 rows each) per warp
  float acc_o[kMT][kDP / 8][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int i = 0; i < kDP / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][i][e] = 0.f;
  // Per thread and m-tile: rows g and g + 8 of the tile's 16. m_i is the
  // running max of the raw scores (-inf until a visible key), l_i this
  // thread's part of the running sum of exp2(score * scale_log2 - m_i * scale_log2).
  float m_i[kMT][2], l_i[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m_i[mt][r] = -INFINITY;
      l_i[mt][r] = 0.f;
    }
  // Q fragments stay in registers for the whole key loop (kQInRegs), or are
  // read from sQ (never overwritten) one k-step at a time into qf[mt][0].
  constexpr bool kQRegs = Cfg::kQInRegs;
  uint32_t qf[kMT][kQRegs ? kDP / 16 : 1][4];
  cp_async_wait<1>();  // Q landed
  __syncthreads();
  if constexpr (kQRegs) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int ks = 0; ks < kDP / 16; ++ks)
        ldmatrix_x4(qf[mt][ks], sQ + (warp * kMT + mt) * 16 * kStride + lane_off_m16(lane, kStride) + ks * 16);
  }

  for (int n = 0; n < n_blocks; ++n) {
    const int stage = n & 1;
    if (n + 1 < n_blocks) {
      const int next = (n + 1) * kBN;
      const int valid = min(kBN, len_k - next);
      load_tile<kBN, kDP, kThreads, kD>(sK + (stage ^ 1) * kBN * kStride, gK + int64_t(next) * kv_stride, kv_stride,
                                        valid, tid);
      load_tile<kBN, kDP, kThreads, kD>(sV + (stage ^ 1) * kBN * kStride, gV + int64_t(next) * kv_stride, kv_stride,
                                        valid, tid);
    }
    cp_async_commit();
    cp_async_wait<1>();  // everything but the group just committed: tile n landed
    __syncthreads();

    const bf16* sKs = sK + stage * kBN * kStride;
    const bf16* sVs = sV + stage * kBN * kStride;

    // S = Q K^T for the warp's kMT x 16 rows x kBN keys; each K fragment
    // feeds kMT m-tiles.
    float s[kMT][kBN / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int i = 0; i < kBN / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][i][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kDP / 16; ++ks) {
      if constexpr (!kQRegs) {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt)
          ldmatrix_x4(qf[mt][0], sQ + (warp * kMT + mt) * 16 * kStride + lane_off_m16(lane, kStride) + ks * 16);
      }
      const int qk = kQRegs ? ks : 0;
#pragma unroll
      for (int j = 0; j < kBN / 16; ++j) {
        uint32_t kb[4];
        ldmatrix_x4(kb, sKs + 16 * j * kStride + lane_off_n16(lane, kStride) + ks * 16);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_bf16(s[mt][2 * j], qf[mt][qk], kb[0], kb[1]);
          mma_bf16(s[mt][2 * j + 1], qf[mt][qk], kb[2], kb[3]);
        }
      }
    }

    // Mask: only tiles holding a key some row of the block must not see.
    if ((n + 1) * kBN > full_end) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int i = 0; i < kBN / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = row0 + (warp * kMT + mt) * 16 + (lane >> 2) + (e >> 1) * 8;
            const int key = n * kBN + i * 8 + 2 * (lane & 3) + (e & 1);
            if (key >= mask.key_end(row, len_k)) s[mt][i][e] = -INFINITY;
          }
    }

    // Online softmax in the log2 domain.
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      float m_scaled[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = m_i[mt][r];
#pragma unroll
        for (int i = 0; i < kBN / 8; ++i) mx = fmaxf(mx, fmaxf(s[mt][i][2 * r], s[mt][i][2 * r + 1]));
        mx = quad_max(mx);
        // A row with no visible key yet keeps max -inf; subtracting 0 instead
        // keeps every exp2 argument -inf (-> 0) rather than NaN.
        m_scaled[r] = mx == -INFINITY ? 0.f : mul_rn(mx, scale_log2);
        const float corr = exp2f(fma_rn(m_i[mt][r], scale_log2, -m_scaled[r]));  // 0 while m_i = -inf
        m_i[mt][r] = mx;
        l_i[mt][r] = mul_rn(l_i[mt][r], corr);
#pragma unroll
        for (int i = 0; i < kDP / 8; ++i) {
          acc_o[mt][i][2 * r] = mul_rn(acc_o[mt][i][2 * r], corr);
          acc_o[mt][i][2 * r + 1] = mul_rn(acc_o[mt][i][2 * r + 1], corr);
        }
      }
#pragma unroll
      for (int i = 0; i < kBN / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pv = exp2_ftz(fma_rn(s[mt][i][e], scale_log2, -m_scaled[e >> 1]));
          s[mt][i][e] = pv;
          l_i[mt][e >> 1] = add_rn(l_i[mt][e >> 1], pv);
        }
    }

    // O += P V: P straight from the S registers, V by ldmatrix.trans; each V
    // fragment feeds kMT m-tiles.
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      uint32_t pa[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) c_pair_to_a(pa[mt], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
      for (int j = 0; j < kDP / 16; ++j) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, sVs + 16 * kk * kStride + lane_off_m16(lane, kStride) + 16 * j);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma_bf16(acc_o[mt][2 * j], pa[mt], vb[0], vb[1]);
          mma_bf16(acc_o[mt][2 * j + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  cp_async_wait<0>();

  // Epilogue: o = acc / l, lse = ln 2 * (m * scale_log2 + log2 l); a row with
  // no visible key (l = 0) gets o = 0, lse = -inf. Padding columns (>= kD)
  // are not stored.
  bf16* gO = static_cast<bf16*>(p.o) + int64_t(q0) * q_stride + h * kD;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(l_i[mt][r]);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const float lse = l > 0.f ? mul_rn(fma_rn(m_i[mt][r], scale_log2, log2f(l)), kLn2) : -INFINITY;
      const int row = row0 + (warp * kMT + mt) * 16 + (lane >> 2) + 8 * r;
      if (row < len_q) {
        bf16* o_row = gO + int64_t(row) * q_stride;
#pragma unroll
        for (int i = 0; i < kDP / 8; ++i)
          if (i * 8 < kD)
            *reinterpret_cast<uint32_t*>(o_row + i * 8 + 2 * (lane & 3)) =
                pack_bf16(acc_o[mt][i][2 * r] * inv, acc_o[mt][i][2 * r + 1] * inv);
        if ((lane & 3) == 0) p.lse[int64_t(q0 + row) * p.heads_q + h] = lse;
      }
    }
}

#if !defined(SLIME_ATTENTION_EMULATION)
template <class Cfg, class Mask>
void launch_forward(const AttentionForwardParams& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.max_seqlen_q == 0 || p.heads_q == 0) return;
  auto kernel = attention_fwd_kernel<Cfg, Mask>;
  SLIME_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  const dim3 grid(unsigned((p.max_seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM), unsigned(p.num_seqs),
                  unsigned(p.heads_q));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(p);
  SLIME_CUDA_CHECK_LAUNCH();
}

template <int kD>
void forward_launch(const AttentionForwardParams& p, cudaStream_t stream) {
  if (p.options.causal) {
    launch_forward<FwdConfig<kD>, CausalMask>(p, stream);
  } else {
    launch_forward<FwdConfig<kD>, FullMask>(p, stream);
  }
}
#endif  // !SLIME_ATTENTION_EMULATION

// ---- Backward ------------------------------------------------------------------

// Lanes per row of the preprocess: d / 8 (one 16-byte chunk each) rounded up
// to a power of two, so that a row's lanes are an aligned group of a warp.
constexpr int preprocess_lanes(int d) {
  int lanes = 1;
  while (lanes < d / 8) lanes *= 2;
  return lanes;
}

// D = rowsum(do * o) per (token, head), fp32: preprocess_lanes(kD) lanes per
// row, the first kD / 8 of them reading 16 bytes each. rows = T * Hq.
template <int kD>
__global__ void attention_bwd_preprocess_kernel(const bf16* o, const bf16* d_o, float* delta, int64_t rows) {
  constexpr int kChunks = kD / 8, kLanes = preprocess_lanes(kD);
  static_assert(kD % 8 == 0 && 32 % kLanes == 0, "a row's lanes stay inside one warp");
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes;
  const int part = int(threadIdx.x % kLanes);
  float sum = 0.f;
  if (row < rows && (kChunks == kLanes || part < kChunks)) {
    const uint4 a = *reinterpret_cast<const uint4*>(o + row * kD + part * 8);
    const uint4 c = *reinterpret_cast<const uint4*>(d_o + row * kD + part * 8);
    const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, cw[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) sum = fmaf(bf16_lo(aw[i]), bf16_lo(cw[i]), fmaf(bf16_hi(aw[i]), bf16_hi(cw[i]), sum));
  }
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (row < rows && part == 0) delta[row] = sum;
}

// dq = bf16(scale * dq_accum), 4 elements per thread (n % 4 == 0). A
// template so that each translation unit's copy is its own instantiation.
template <int kD>
__global__ void attention_bwd_dq_kernel(const float* acc, bf16* dq, int64_t n, float scale) {
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 4; i < n;
       i += int64_t(gridDim.x) * blockDim.x * 4) {
    const float4 a = *reinterpret_cast<const float4*>(acc + i);
    uint2 out;
    out.x = pack_bf16(a.x * scale, a.y * scale);
    out.y = pack_bf16(a.z * scale, a.w * scale);
    *reinterpret_cast<uint2*>(dq + i) = out;
  }
}

// One CTA per (key block, sequence, kv head): K and V of kBN keys stay in
// shared memory, dK and dV accumulate in registers over every query head of
// the kv head's group and every query block that sees a key of the block,
// then are written once (deterministic; GQA sums inside the CTA). Warp w owns
// keys 16w..16w+15 and computes, per query block of kBM rows:
//   S^T = K Q^T, dP^T = V dO^T                      (A = K, V; B = Q, dO rows)
//   P^T = exp2(S^T scale_log2 - lse_log2) (kept as bf16), dS^T = P^T (dP^T - D)
//   dV += P^T dO, dK += dS^T Q                      (A = P^T, dS^T registers)
// dS^T goes to shared memory (two buffers); dQ_partial = dS K over the kBN
// keys, split over the warps by rows and columns, is computed at the start of
// the next step (after its barrier) and added to the fp32 dq accumulator with
// atomics.
//   d = 128: BN 128 (8 warps), BM 64: 173 KB smem, 1 CTA/SM (FA2's shape).
//   d = 64:  BN 128 (8 warps), BM 64: 109 KB smem, 1 CTA/SM (registers).
//   d = 32:  the shape of d 64: 77 KB smem.
//   d = 72, 80 (tiles at 80), 96: the shape of d 128 but dQ split 4 x 2
//            warps (at 80 the second column warp has 2 of the 5 16-column
//            chunks, the first 3): 125, 125, 141 KB smem.
//   d = 256: dK and dV of 16 keys x 256 columns would take 256 registers per
//            thread, so the output columns are split over two CTAs per (key
//            block, kv head) (kColSplits): each computes S^T and dP^T over all
//            of d and dK, dV and dQ for its 128 columns (as at d 128); BM 32
//            keeps K, V, Q, dO at d 256 within the limit: 218.5 KB smem.
template <int kD>
struct BwdConfig {
  static constexpr int kHeadDim = kD;               // of the tensors
  static constexpr int kDim = padded_head_dim(kD);  // of the tiles
  static constexpr int kColSplits = kDim > 128 ? 2 : 1;
  static constexpr int kDimOut = kDim / kColSplits;  // dK, dV, dQ columns per CTA
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockN = 16 * kWarps;           // keys per CTA
  static constexpr int kBlockM = kDim > 128 ? 32 : 64;  // query rows per step
  static constexpr int kMinBlocks = 1;
  static constexpr bool kKVInRegs = kDim <= 64;
  static constexpr int kStride = kDim + 8;
  static constexpr int kStrideS = kBlockM + 8;  // dS^T [2][kBlockN][kBlockM + 8]
  // dQ_partial [kBlockM, kDimOut]: warps kWarpsM (query rows) x kWarpsN
  // (columns), each kDqTiles m-tiles of 16 rows x kDqCols columns. d = 128: 2
  // x 4 warps, 32 x 32 per warp (16 + 16 ldmatrix.x4 per 64 mma instead of 8
  // + 32 for 16 x 64); d = 64: 4 x 2, 16 x 32 (24 per 32 mma either way).
  // Where the 16-column chunks do not split evenly (d 80), the last column
  // warp's kDqCols run past kDimOut and its chunks there are skipped.
  static constexpr int kWarpsM = kDimOut == 128 ? 2 : kBlockM / 16;
  static constexpr int kWarpsN = kWarps / kWarpsM;
  static constexpr int kDqTiles = kBlockM / 16 / kWarpsM;
  static constexpr int kDqChunks = (kDimOut / 16 + kWarpsN - 1) / kWarpsN;  // 16-column chunks per warp
  static constexpr int kDqCols = 16 * kDqChunks;
  // Every warp's dQ columns are real ones (no chunk to skip, no padding).
  static constexpr bool kDqExact = kDqCols * kWarpsN == kDimOut && kDim == kD;
  static constexpr int kSmemBytes =
      ((2 * kBlockN + 4 * kBlockM) * kStride + 2 * kBlockN * kStrideS) * int(sizeof(bf16)) +
      4 * kBlockM * int(sizeof(float));
  static_assert(kD % 8 == 0 && kDimOut % 16 == 0, "tiles are made of 16x16 mma steps and 16-byte rows");
  static_assert(kWarps % kWarpsM == 0 && kDqTiles * kWarpsM * 16 == kBlockM && kDqCols * (kWarpsN - 1) < kDimOut,
                "dQ tile must split over the warps, each with some columns");
  static_assert(kBlockM % 16 == 0 && kBlockM <= kThreads, "one thread per query row loads lse and D");
  static_assert(kSmemBytes <= kMaxSmemBytes, "shared memory beyond the sm_90 limit");
  static_assert(kColSplits == 1 || kDim == kD, "padding columns only where one CTA owns all columns (c0 = 0)");
};

template <class Cfg, class Mask>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    attention_bwd_kernel(const AttentionBackwardParams bp) {
  // kD: the tensors' head dim (global strides and stores); kDP: the tiles';
  // kDO: the dK, dV and dQ columns of this CTA, [c0, c0 + kDO).
  constexpr int kD = Cfg::kHeadDim, kDP = Cfg::kDim, kDO = Cfg::kDimOut, kBM = Cfg::kBlockM, kBN = Cfg::kBlockN;
  constexpr int kStride = Cfg::kStride, kStrideS = Cfg::kStrideS, kThreads = Cfg::kThreads;
  constexpr int kSplits = Cfg::kColSplits;
  const AttentionForwardParams& p = bp.fwd;
  SLIME_ATTENTION_DYNAMIC_SMEM(smem_raw);
  bf16* sK = reinterpret_cast<bf16*>(smem_raw);                      // [kBN][kStride]
  bf16* sV = sK + kBN * kStride;                                     // [kBN][kStride]
  bf16* sQ = sV + kBN * kStride;                                     // [2][kBM][kStride]
  bf16* sdO = sQ + 2 * kBM * kStride;                                // [2][kBM][kStride]
  bf16* sdS = sdO + 2 * kBM * kStride;                               // [2][kBN][kStrideS]
  float* sLse = reinterpret_cast<float*>(sdS + 2 * kBN * kStrideS);  // [2][kBM], log2 domain
  float* sDelta = sLse + 2 * kBM;                                    // [2][kBM]

  // blockIdx.z = kv head * kSplits + column split. blockIdx.x: key block
  // (the deterministic dq: the last key block first; see Determinism above).
  const int n_block = p.options.deterministic ? int(gridDim.x - 1 - blockIdx.x) : int(blockIdx.x);
  const int b = blockIdx.y;
  const int hk = kSplits == 1 ? int(blockIdx.z) : int(blockIdx.z) / kSplits;
  const int c0 = kSplits == 1 ? 0 : int(blockIdx.z) % kSplits * kDO;
  const int q0 = p.cu_seqlens_q[b], len_q = p.cu_seqlens_q[b + 1] - q0;
  const int k0 = p.cu_seqlens_k[b], len_k = p.cu_seqlens_k[b + 1] - k0;
  if (n_block == 0 && hk == 0) {
    check_sequence(p.cu_seqlens_q, b, p.num_seqs, p.tokens_q, len_q, 0x7fffffff, "q");
    check_sequence(p.cu_seqlens_k, b, p.num_seqs, p.tokens_k, len_k, p.max_seqlen_k, "k");
  }
  const int key0 = n_block * kBN;
  if (key0 >= len_k) return;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int group = p.heads_q / p.heads_kv;
  const Mask mask = make_mask<Mask>(p.options, len_q, len_k);
  const int keys_here = min(kBN, len_k - key0);
  // Query rows [first, len_q) see some key of this block.
  const int first = max(0, mask.first_row(key0));
  const int m_begin = first / kBM;
  const int m_end = first < len_q ? (len_q + kBM - 1) / kBM : m_begin;
  const int n_m = m_end - m_begin;
  const int n_iter = n_m * group;

  const int64_t q_stride = int64_t(p.heads_q) * kD, kv_stride = int64_t(p.heads_kv) * kD;
  const bf16* gK = static_cast<const bf16*>(p.k) + int64_t(k0 + key0) * kv_stride + hk * kD;
  const bf16* gV = static_cast<const bf16*>(p.v) + int64_t(k0 + key0) * kv_stride + hk * kD;
  const bf16* gQ = static_cast<const bf16*>(p.q) + int64_t(q0) * q_stride;
  const bf16* gdO = static_cast<const bf16*>(bp.d_o) + int64_t(q0) * q_stride;
  float* dq_acc = bp.workspace + int64_t(q0) * q_stride;
  const float* delta = bp.workspace + int64_t(p.tokens_q) * q_stride + int64_t(q0) * p.heads_q;
  // Deterministic dq: the turn counters [T, Hq, 2] after D (null: atomics in
  // any order). Step s's counter is its query block's first row, head, split.
  int* const dq_turns = p.options.deterministic
                            ? reinterpret_cast<int*>(bp.workspace + int64_t(p.tokens_q) * p.heads_q * (kD + 1))
                            : nullptr;
  auto turn_of = [&](int s) {
    const int h = hk * group + s / n_m;
    const int row0 = (m_begin + s % n_m) * kBM;
    return dq_turns + (int64_t(q0 + row0) * p.heads_q + h) * 2 + (kSplits == 1 ? 0 : int(blockIdx.z) % kSplits);
  };
  // This key block's turn at step s: the key blocks after it that see the
  // step's query block, whose last row R sees keys [0, key_end(R)), add first.
  auto my_turn = [&](int s) {
    const int last_row = min((m_begin + s % n_m) * kBM + kBM - 1, len_q - 1);
    return (mask.key_end(last_row, len_k) - 1) / kBN - n_block;
  };
  const float scale_log2 = p.softmax_scale * kLog2e;

  // Step `it` is query head hk * group + it / n_m, query block m_begin + it % n_m.
  // Q and dO of a step go to buffer `buf` by cp.async.
  auto load_tiles = [&](int it, int buf) {
    const int h = hk * group + it / n_m;
    const int row0 = (m_begin + it % n_m) * kBM;
    const int valid = min(kBM, len_q - row0);
    load_tile<kBM, kDP, kThreads, kD>(sQ + buf * kBM * kStride, gQ + int64_t(row0) * q_stride + h * kD, q_stride, valid,
                                      tid);
    load_tile<kBM, kDP, kThreads, kD>(sdO + buf * kBM * kStride, gdO + int64_t(row0) * q_stride + h * kD, q_stride,
                                      valid, tid);
  };
  // lse (log2 domain) and D of row `tid` of a step, read into registers early
  // and stored to shared memory late, so the loads' latency hides behind a
  // step of compute. Rows past the sequence and rows that saw no key
  // (lse = -inf) get lse = +inf: every P of theirs is exp2(-inf) = 0.
  auto load_row_stats = [&](int it, float& lse, float& dlt) {
    lse = INFINITY;
    dlt = 0.f;
    const int h = hk * group + it / n_m;
    const int row = (m_begin + it % n_m) * kBM + tid;
    if (tid < kBM && row < len_q) {
      const float l = p.lse[int64_t(q0 + row) * p.heads_q + h];
      lse = l == -INFINITY ? INFINITY : l * kLog2e;
      dlt = delta[int64_t(row) * p.heads_q + h];
    }
  };
  auto store_row_stats = [&](int buf, float lse, float dlt) {
    if (tid < kBM) {
      sLse[buf * kBM + tid] = lse;
      sDelta[buf * kBM + tid] = dlt;
    }
  };

  float acc_dk[kDO / 8][4], acc_dv[kDO / 8][4];
#pragma unroll
  for (int i = 0; i < kDO / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[i][e] = acc_dv[i][e] = 0.f;

  if (n_iter > 0) {
    load_tile<kBN, kDP, kThreads, kD>(sK, gK, kv_stride, keys_here, tid);
    load_tile<kBN, kDP, kThreads, kD>(sV, gV, kv_stride, keys_here, tid);
    load_tiles(0, 0);
    float lse, dlt;
    load_row_stats(0, lse, dlt);
    store_row_stats(0, lse, dlt);
  }
  cp_async_commit();

  constexpr int kWarpsM = Cfg::kWarpsM, kDqCols = Cfg::kDqCols, kDqTiles = Cfg::kDqTiles;
  constexpr int kDqChunks = Cfg::kDqChunks;
  constexpr bool kDqExact = Cfg::kDqExact;
  const int wm = warp % kWarpsM, wn = warp / kWarpsM;
  // d <= 64: the warp's K and V A fragments (16 keys x d) stay in registers
  // for the whole loop (32 registers at d 64); at d = 128 they would take 64.
  constexpr bool kKVRegs = Cfg::kKVInRegs;
  uint32_t kvf[kKVRegs ? 2 : 1][kKVRegs ? kDP / 16 : 1][4];

  // One barrier per step: step it's dQ_partial (which needs every warp's
  // dS^T) is computed at the start of step it + 1, after its barrier, from the
  // other dS^T buffer; the loop runs one extra step for the last dQ.
  //   Q, dO of buffer b: refilled (for step it + 1) after the barrier of step
  //     it; last read by step it - 1, before that barrier.
  //   lse, D of buffer b: stored at the end of step it for step it + 1; last
  //     read by step it - 1; read after the barrier of step it + 1.
  //   dS^T of buffer b: written in step it, read (dQ) in step it + 1 after
  //     its barrier, rewritten in step it + 2 after the next barrier.
  for (int it = 0; it <= n_iter; ++it) {
    const int buf = it & 1;
    // Deterministic dq: step it - 1's adds (after this barrier) wait for
    // their turn; step it - 2's, fenced before it, pass the turn on.
    if (dq_turns != nullptr && tid == 0 && it > 0) dq_turn_wait(turn_of(it - 1), my_turn(it - 1));
    cp_async_wait<0>();  // this thread's copies for step it landed
    __syncthreads();
    if (dq_turns != nullptr && tid == 0 && it > 1) dq_turn_pass(turn_of(it - 2));
    if constexpr (kKVRegs) {
      if (it == 0) {
#pragma unroll
        for (int ks = 0; ks < kDP / 16; ++ks) {
          ldmatrix_x4(kvf[0][ks], sK + warp * 16 * kStride + lane_off_m16(lane, kStride) + ks * 16);
          ldmatrix_x4(kvf[1][ks], sV + warp * 16 * kStride + lane_off_m16(lane, kStride) + ks * 16);
        }
      }
    }
    float next_lse = INFINITY, next_dlt = 0.f;
    if (it + 1 < n_iter) {
      load_tiles(it + 1, buf ^ 1);
      load_row_stats(it + 1, next_lse, next_dlt);
    }
    cp_async_commit();

    if (it > 0) {
      const int itq = it - 1;
      const int h = hk * group + itq / n_m;
      const int row0 = (m_begin + itq % n_m) * kBM;
      const bf16* sdSq = sdS + (itq & 1) * kBN * kStrideS;
      // dQ_partial [kBM, kDO] = dS [kBM, kBN] K [kBN, c0..c0+kDO); warp (wm, wn)
      // owns rows 16 (kDqTiles wm + mt)..+15 for mt < kDqTiles and columns
      // c0 + kDqCols wn..+kDqCols (16-column chunk j exists iff kDqChunks wn +
      // j < kDO / 16; warp-uniform), so each K fragment feeds kDqTiles
      // m-tiles. A = dS from dS^T by ldmatrix.trans (matrices: keys 0-7 /
      // queries 0-7, keys 0-7 / queries 8-15, keys 8-15 / queries 0-7, keys
      // 8-15 / queries 8-15), B = K by .trans.
      float acc_dq[kDqTiles][kDqCols / 8][4];
#pragma unroll
      for (int mt = 0; mt < kDqTiles; ++mt)
#pragma unroll
        for (int i = 0; i < kDqCols / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_dq[mt][i][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk) {
        uint32_t kb[kDqCols / 16][4];
#pragma unroll
        for (int j = 0; j < kDqCols / 16; ++j)
          if (kDqExact || wn * kDqChunks + j < kDO / 16)
            ldmatrix_x4_trans(kb[j], sK + 16 * kk * kStride + lane_off_m16(lane, kStride) + c0 + wn * kDqCols + 16 * j);
#pragma unroll
        for (int mt = 0; mt < kDqTiles; ++mt) {
          uint32_t a[4];
          ldmatrix_x4_trans(a, sdSq + 16 * kk * kStrideS + lane_off_n16(lane, kStrideS) + (wm * kDqTiles + mt) * 16);
#pragma unroll
          for (int j = 0; j < kDqCols / 16; ++j) {
            if (kDqExact || wn * kDqChunks + j < kDO / 16) {
              mma_bf16(acc_dq[mt][2 * j], a, kb[j][0], kb[j][1]);
              mma_bf16(acc_dq[mt][2 * j + 1], a, kb[j][2], kb[j][3]);
            }
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < kDqTiles; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = row0 + (wm * kDqTiles + mt) * 16 + (lane >> 2) + 8 * r;
          if (row < len_q) {
            // Columns past kD (padding, or a chunk the warp does not own) are
            // not added: they are the next head's or past the accumulator.
            const int col = c0 + wn * kDqCols;
            float* dst = dq_acc + int64_t(row) * q_stride + h * kD + col + 2 * (lane & 3);
#pragma unroll
            for (int i = 0; i < kDqCols / 8; ++i)
              if (kDqExact || col + i * 8 < min(kD, c0 + kDO))
                atomicAdd(reinterpret_cast<float2*>(dst + i * 8),
                          make_float2(acc_dq[mt][i][2 * r], acc_dq[mt][i][2 * r + 1]));
          }
        }
      if (dq_turns != nullptr) dq_adds_fence();  // before the barrier after which the turn passes
    }

    if (it < n_iter) {
      const int m = m_begin + it % n_m;
      const int row0 = m * kBM;
      const bf16* sQs = sQ + buf * kBM * kStride;
      const bf16* sdOs = sdO + buf * kBM * kStride;
      const float* sLs = sLse + buf * kBM;
      const float* sDs = sDelta + buf * kBM;
      bf16* sdSs = sdS + buf * kBN * kStrideS;

      // S^T = K Q^T for the warp's 16 keys x kBM queries, turned in place into
      // P^T and kept only as bf16 A fragments (the operand of dV and, read back,
      // of dS), so that S^T and dP^T in fp32 are never live together (register
      // pressure: dK and dV take 128 registers at d = 128). Element (i, e) of a
      // C tile array: key 16 warp + g + 8 (e / 2), query 8 i + 2 t + e % 2.
      uint32_t pa[kBM / 16][4];
      {
        float st[kBM / 8][4];
#pragma unroll
        for (int i = 0; i < kBM / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) st[i][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < kDP / 16; ++ks) {
          uint32_t ka[4];
          if constexpr (kKVRegs) {
#pragma unroll
            for (int e = 0; e < 4; ++e) ka[e] = kvf[0][ks][e];
          } else {
            ldmatrix_x4(ka, sK + warp * 16 * kStride + lane_off_m16(lane, kStride) + ks * 16);
          }
#pragma unroll
          for (int j = 0; j < kBM / 16; ++j) {
            uint32_t qb[4];
            ldmatrix_x4(qb, sQs + 16 * j * kStride + lane_off_n16(lane, kStride) + ks * 16);
            mma_bf16(st[2 * j], ka, qb[0], qb[1]);
            mma_bf16(st[2 * j + 1], ka, qb[2], qb[3]);
          }
        }
        const bool need_mask = key0 + kBN > mask.key_end(row0, len_k);
#pragma unroll
        for (int i = 0; i < kBM / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int qc = i * 8 + 2 * (lane & 3) + (e & 1);
            float pv = exp2_ftz(fmaf(st[i][e], scale_log2, -sLs[qc]));
            if (need_mask) {
              const int key = key0 + warp * 16 + (lane >> 2) + (e >> 1) * 8;
              if (key >= mask.key_end(row0 + qc, len_k)) pv = 0.f;
            }
            st[i][e] = pv;
          }
#pragma unroll
        for (int kk = 0; kk < kBM / 16; ++kk) c_pair_to_a(pa[kk], st[2 * kk], st[2 * kk + 1]);
      }

      // dV += P^T dO (B = dO by ldmatrix.trans), the CTA's columns.
#pragma unroll
      for (int kk = 0; kk < kBM / 16; ++kk)
#pragma unroll
        for (int j = 0; j < kDO / 16; ++j) {
          uint32_t ob[4];
          ldmatrix_x4_trans(ob, sdOs + 16 * kk * kStride + lane_off_m16(lane, kStride) + c0 + 16 * j);
          mma_bf16(acc_dv[2 * j], pa[kk], ob[0], ob[1]);
          mma_bf16(acc_dv[2 * j + 1], pa[kk], ob[2], ob[3]);
        }

      // dP^T = V dO^T, then dS^T = P^T (dP^T - D) without the softmax scale, P^T
      // read back from its bf16 fragments (element (i, e) is in register
      // 2 (i % 2) + e / 2 of pa[i / 2], half e % 2).
      float dpt[kBM / 8][4];
#pragma unroll
      for (int i = 0; i < kBM / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) dpt[i][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < kDP / 16; ++ks) {
        uint32_t va[4];
        if constexpr (kKVRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) va[e] = kvf[1][ks][e];
        } else {
          ldmatrix_x4(va, sV + warp * 16 * kStride + lane_off_m16(lane, kStride) + ks * 16);
        }
#pragma unroll
        for (int j = 0; j < kBM / 16; ++j) {
          uint32_t ob[4];
          ldmatrix_x4(ob, sdOs + 16 * j * kStride + lane_off_n16(lane, kStride) + ks * 16);
          mma_bf16(dpt[2 * j], va, ob[0], ob[1]);
          mma_bf16(dpt[2 * j + 1], va, ob[2], ob[3]);
        }
      }
#pragma unroll
      for (int i = 0; i < kBM / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const uint32_t w = pa[i / 2][2 * (i % 2) + (e >> 1)];
          const float pv = (e & 1) ? bf16_hi(w) : bf16_lo(w);
          dpt[i][e] = pv * (dpt[i][e] - sDs[i * 8 + 2 * (lane & 3) + (e & 1)]);
        }

        // dK += dS^T Q (B = Q by ldmatrix.trans), the CTA's columns.
#pragma unroll
      for (int kk = 0; kk < kBM / 16; ++kk) {
        uint32_t dsa[4];
        c_pair_to_a(dsa, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
        for (int j = 0; j < kDO / 16; ++j) {
          uint32_t qb[4];
          ldmatrix_x4_trans(qb, sQs + 16 * kk * kStride + lane_off_m16(lane, kStride) + c0 + 16 * j);
          mma_bf16(acc_dk[2 * j], dsa, qb[0], qb[1]);
          mma_bf16(acc_dk[2 * j + 1], dsa, qb[2], qb[3]);
        }
      }

      // dS^T -> shared memory, bf16 (the same rounding as the dK product).
#pragma unroll
      for (int i = 0; i < kBM / 8; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int key = warp * 16 + (lane >> 2) + 8 * r;
          *reinterpret_cast<uint32_t*>(sdSs + key * kStrideS + i * 8 + 2 * (lane & 3)) =
              pack_bf16(dpt[i][2 * r], dpt[i][2 * r + 1]);
        }
    }
    if (it + 1 < n_iter) store_row_stats(buf ^ 1, next_lse, next_dlt);
  }
  cp_async_wait<0>();
  if (dq_turns != nullptr && n_iter > 0) {  // the last step's turn (its adds ran in step n_iter)
    __syncthreads();
    if (tid == 0) dq_turn_pass(turn_of(n_iter - 1));
  }

  // dK = scale * dS^T Q summed, dV = P^T dO summed, columns [c0, c0 + kDO)
  // less the padding past kD; keys past the sequence are not written. Keys
  // no row sees get zeros.
  bf16* gdK = static_cast<bf16*>(bp.dk) + int64_t(k0 + key0) * kv_stride + hk * kD + c0;
  bf16* gdV = static_cast<bf16*>(bp.dv) + int64_t(k0 + key0) * kv_stride + hk * kD + c0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = warp * 16 + (lane >> 2) + 8 * r;
    if (key < keys_here) {
#pragma unroll
      for (int i = 0; i < kDO / 8; ++i) {
        if (kDP != kD && i * 8 >= kD) continue;  // padding (kDP != kD only with kSplits 1: c0 = 0)
        const int64_t off = int64_t(key) * kv_stride + i * 8 + 2 * (lane & 3);
        *reinterpret_cast<uint32_t*>(gdK + off) =
            pack_bf16(acc_dk[i][2 * r] * p.softmax_scale, acc_dk[i][2 * r + 1] * p.softmax_scale);
        *reinterpret_cast<uint32_t*>(gdV + off) = pack_bf16(acc_dv[i][2 * r], acc_dv[i][2 * r + 1]);
      }
    }
  }
}

#if !defined(SLIME_ATTENTION_EMULATION)
template <class Cfg, class Mask>
void launch_backward_main(const AttentionBackwardParams& bp, cudaStream_t stream) {
  auto kernel = attention_bwd_kernel<Cfg, Mask>;
  SLIME_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  const AttentionForwardParams& p = bp.fwd;
  const dim3 grid(unsigned((p.max_seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN), unsigned(p.num_seqs),
                  unsigned(p.heads_kv * Cfg::kColSplits));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(bp);
  SLIME_CUDA_CHECK_LAUNCH();
}

// Zero the dq accumulator, D = rowsum(do * o), the main kernel, then dq.
template <int kD>
void backward_launch(const AttentionBackwardParams& bp, cudaStream_t stream) {
  const AttentionForwardParams& p = bp.fwd;
  const int64_t rows = int64_t(p.tokens_q) * p.heads_q;
  const int64_t n = rows * kD;
  if (p.num_seqs == 0 || p.heads_q == 0) return;
  if (n > 0) {
    SLIME_CUDA_CHECK(cudaMemsetAsync(bp.workspace, 0, std::size_t(n) * sizeof(float), stream));
    if (p.options.deterministic)  // the turn counters after D: int32 [T, Hq, 2]
      SLIME_CUDA_CHECK(cudaMemsetAsync(bp.workspace + n + rows, 0, std::size_t(rows) * 2 * sizeof(int), stream));
    constexpr int kThreads = 256;
    const int64_t blocks = (rows * preprocess_lanes(kD) + kThreads - 1) / kThreads;
    attention_bwd_preprocess_kernel<kD><<<unsigned(blocks), kThreads, 0, stream>>>(
        static_cast<const bf16*>(p.o), static_cast<const bf16*>(bp.d_o), bp.workspace + n, rows);
    SLIME_CUDA_CHECK_LAUNCH();
  }
  if (p.max_seqlen_k > 0 && p.tokens_k > 0 && !::slime::ops::cuda::detail::attention_backward_sm90(bp, stream)) {
    if (p.options.causal) {
      launch_backward_main<BwdConfig<kD>, CausalMask>(bp, stream);
    } else {
      launch_backward_main<BwdConfig<kD>, FullMask>(bp, stream);
    }
  }
  if (n > 0) {
    constexpr int kThreads = 256;
    const int64_t blocks = std::min<int64_t>((n / 4 + kThreads - 1) / kThreads, 132 * 16);
    attention_bwd_dq_kernel<kD>
        <<<unsigned(blocks), kThreads, 0, stream>>>(bp.workspace, static_cast<bf16*>(bp.dq), n, p.softmax_scale);
    SLIME_CUDA_CHECK_LAUNCH();
  }
}

#endif  // !SLIME_ATTENTION_EMULATION

}  // namespace slime::ops::cuda::attention_impl

#if !defined(SLIME_ATTENTION_EMULATION)
namespace slime::ops::cuda::detail {
// Defined here, explicitly instantiated once per head dim in
// attention_{fwd,bwd}_hd<D>.cu; src/ops/attention.cu dispatches to them.
template <int kHeadDim>
void attention_forward_launch(const AttentionForwardParams& p, StreamHandle stream) {
  attention_impl::forward_launch<kHeadDim>(p, stream);
}
template <int kHeadDim>
void attention_backward_launch(const AttentionBackwardParams& p, StreamHandle stream) {
  attention_impl::backward_launch<kHeadDim>(p, stream);
}
}  // namespace slime::ops::cuda::detail
#endif  // !SLIME_ATTENTION_EMULATION
