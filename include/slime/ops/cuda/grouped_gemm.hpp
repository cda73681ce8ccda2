// slime/ops/cuda/grouped_gemm.hpp: host-callable CUDA grouped GEMM over experts
// with ragged group sizes read from DEVICE offsets (defined in
// src/ops/grouped_gemm.cu); slime/ops/grouped_gemm.hpp dispatches here.
//
// Accumulation contract: parameter gradients accumulate (`+=`) into fp32 (dw);
// activation outputs are written (`=`), or added (`+=`) for backward_input
// with `accumulate`.
//
// Passes (group e = rows [offsets[e], offsets[e+1]), w [E, out, in]):
//   forward          a = x [rows, in],   b = w,             c = y  [rows, out]   y_g  = x_g · w_eᵀ
//   backward_input   a = dy [rows, out], b = w,             c = dx [rows, in]    dx_g = dy_g · w_e
//   backward_weight  a = dy [rows, out], b = x [rows, in],  c = dw [E, out, in]  dw_e += dy_gᵀ · x_g (f32)
//
// Kernels: bf16 inputs with in and out features multiples of 8 and 16-byte
// aligned pointers take a tensor-core kernel: on Hopper (an sm_90a build on a
// compute capability 9.0 device) wgmma fed by TMA with warp-specialised
// warpgroups (grouped_gemm_sm90.cu), elsewhere mma.sync m16n8k16 with a
// cp.async multi-stage pipeline (grouped_gemm.cu); both accumulate in fp32,
// one CTA per output tile, tiles of all groups linearised and located from
// the device offsets, so the host never reads them. Anything else (f32 inputs, odd feature counts, unaligned
// views) takes a simple one-thread-per-output kernel with fp32 sums.
// Numerics: products summed in fp32, rounded once into c (bf16 or f32).
// Determinism: bitwise run to run (every output element is owned by one
// thread of one CTA; fixed summation order; no atomics).
// No host synchronisation, no allocation. The offsets are checked on the
// device where it is free (offsets[0] = 0, non-decreasing, offsets[E] = rows);
// a broken invariant prints and traps (the context is lost).
// Limits: rows, features and experts fit in int32 (offsets are i32).
//
// cuBLAS backend (src/ops/grouped_gemm_cublas.cpp), for when the group sizes
// are known on the host (GroupedGemmParams::host_offsets, a host copy of the
// device offsets, which the caller promises are equal; the device offsets are
// then not read). Experts with no rows are skipped; experts with the same row
// count share one cuBLAS group (problems of one shape), so uniform routing is
// one group. Per pass:
//   forward, backward_input with c of the input dtype (bf16 -> bf16, f32 ->
//     f32): one cublasGemmGroupedBatchedEx (CUBLAS_COMPUTE_32F, no TF32;
//     beta 1 for accumulate). Its A/B/C pointer arrays live in device memory:
//     a ring of kGroupedGemmPointerSlots slots per (thread, device), each
//     filled by one cudaMemcpyAsync from a pinned staging slot, reused once an
//     event recorded after its GEMM has completed (the host blocks only when
//     it runs that many grouped calls ahead of the GPU). The ring grows (all
//     slots at once, after waiting for them) when a call has more experts than
//     it holds; steady state allocates nothing.
//   forward, backward_input with bf16 inputs and an f32 c, and backward_weight
//     (f32 dw, beta 1): cublasGemmGroupedBatchedEx has no bf16 -> f32 type
//     combination, so one cublasGemmEx per expert with rows (ops::cuda::gemm
//     of slime/ops/cuda/linear.hpp). The grouped call also falls back to
//     this loop if cuBLAS reports CUBLAS_STATUS_NOT_SUPPORTED.
// Numerics: fp32 sums with reduced-precision split-K reductions disallowed,
// rounded once into c; deterministic run to run (cuBLAS's guarantee for one
// GPU model, stream and workspace), not bitwise equal to the kernels.
// Handles: the grouped call uses its own cuBLAS handle per (thread, device)
// with a kCublasWorkspaceBytes workspace; the per-expert loop uses Linear's.
#pragma once

#include <cstdint>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"

#if SLIME_HAS_CUDA
namespace slime::ops::cuda {

enum class GroupedGemmPass { forward, backward_input, backward_weight };

// The kernel configurations (CTA tile BM x BN x BK; warps; pipeline stages).
// `automatic` lets grouped_gemm_tile_for pick; the others force one (the
// benchmark compares them). `simple` is the fallback kernel.
enum class GroupedGemmTile : int {
  automatic = -1,
  m128n128k32 = 0,  // 4 warps (2 x 2, warp tile 64 x 64), 4 stages, 2 CTAs / SM
  m128n256k64 = 1,  // 8 warps (2 x 4, warp tile 64 x 64), 3 stages, 1 CTA / SM
  m128n128k64 = 2,  // 4 warps (2 x 2, warp tile 64 x 64), 3 stages, 2 CTAs / SM
  simple = 3,       // fallback: one thread per output element, no tensor cores
  // Hopper (sm_90a build, compute capability 9.0): wgmma + TMA, 1 producer and
  // 2 consumer warpgroups, CTA tile 128 x N x 64 (src/ops/grouped_gemm_sm90.cu)
  sm90_m128n256 = 4,  // 3 stages + a 64 KB epilogue staging buffer, persistent, 1 CTA / SM
  sm90_m128n128 = 5,  // 4 stages + a 32 / 64 KB staging buffer, persistent, 1 CTA / SM
  // 7 stages + a 16 / 32 KB staging buffer, 1 CTA / SM: four times the n256
  // tile's CTAs, for a plain GEMM of few rows (a decode step's projections
  // in the batch-invariant mode, whose sums it leaves unchanged: see
  // grouped_gemm_tile_for)
  sm90_m128n64 = 6,
  // Forward only: one consumer warpgroup on a 64-row tile, 12-16 stages,
  // direct stores. For a plain GEMM of at most a few hundred rows (a decode
  // step), where even n64 leaves most SMs idle: n / 16 CTAs stream the
  // weights of a 1024-wide projection instead of n / 64.
  sm90_m64n64 = 7,
  sm90_m64n32 = 8,
  sm90_m64n16 = 9,
};
inline constexpr GroupedGemmTile kGroupedGemmTiles[] = {
    GroupedGemmTile::m128n128k32,   GroupedGemmTile::m128n256k64,   GroupedGemmTile::m128n128k64,
    GroupedGemmTile::sm90_m128n256, GroupedGemmTile::sm90_m128n128, GroupedGemmTile::sm90_m128n64,
    GroupedGemmTile::sm90_m64n64,   GroupedGemmTile::sm90_m64n32,   GroupedGemmTile::sm90_m64n16};

// Whether `tile` is one of the Hopper (wgmma + TMA) tiles.
inline constexpr bool grouped_gemm_tile_is_sm90(GroupedGemmTile t) {
  return t == GroupedGemmTile::sm90_m128n256 || t == GroupedGemmTile::sm90_m128n128 ||
         t == GroupedGemmTile::sm90_m128n64 || t == GroupedGemmTile::sm90_m64n64 || t == GroupedGemmTile::sm90_m64n32 ||
         t == GroupedGemmTile::sm90_m64n16;
}

// Whether `tile` runs the forward pass only (the 64-row Hopper tiles).
inline constexpr bool grouped_gemm_tile_forward_only(GroupedGemmTile t) {
  return t == GroupedGemmTile::sm90_m64n64 || t == GroupedGemmTile::sm90_m64n32 || t == GroupedGemmTile::sm90_m64n16;
}

// Whether `tile` can run on the current device: the sm90 tiles need this
// library built for sm_90a and a device of compute capability 9.0; every
// other tile runs anywhere.
bool grouped_gemm_tile_supported(GroupedGemmTile tile);

// Which implementation runs (see the top of this file). `automatic`: the
// cuBLAS backend when host offsets are given, else the kernels.
enum class GroupedGemmBackend : int { automatic = 0, kernel = 1, cublas = 2 };

// Pointer slots per (thread, device) of the cuBLAS backend's ring.
inline constexpr int kGroupedGemmPointerSlots = 64;

struct GroupedGemmParams {
  GroupedGemmPass pass = GroupedGemmPass::forward;
  const void* a = nullptr;  // see the table above
  const void* b = nullptr;  //
  void* c = nullptr;        //
  // [experts + 1], device; null: one group of all rows (experts must be 1),
  // a plain GEMM on the kernels (the batch-invariant Linear forward; on
  // Hopper its sums over K run in chunks: see grouped_gemm_tile_for).
  const int32_t* offsets = nullptr;
  DType in_dtype = DType::bf16;   // a and b: bf16 or f32
  DType out_dtype = DType::bf16;  // c: in_dtype or f32 (f32 for backward_weight)
  int64_t experts = 0, rows = 0, out_features = 0, in_features = 0;
  bool accumulate = false;  // backward_input: dx += (backward_weight always adds)
  // forward / backward_input: the row pitch of c in elements (0: its row
  // length, out_features or in_features). A pitch whose bytes are not a
  // multiple of 16 takes the fallback kernel. Runs the kernels, not cuBLAS.
  int64_t ldc = 0;
  // forward only: c = alpha · (a · bᵀ), alpha applied to the stored result
  // in a second pass (for bf16 c: a second rounding). Runs the kernels.
  float alpha = 1.f;
  GroupedGemmTile tile = GroupedGemmTile::automatic;
  // Host copy of `offsets` ([experts + 1], equal to it), or null. Validated on
  // the host (offsets[0] = 0, non-decreasing, offsets[experts] = rows).
  const int32_t* host_offsets = nullptr;
  // Forces a backend for this call (over set_grouped_gemm_backend and the
  // environment). A forced tile always runs the kernels.
  GroupedGemmBackend backend = GroupedGemmBackend::automatic;
  // forward plain GEMM (null offsets) on the Hopper kernels with
  // SLIME_GEMM_K_CHUNKS=1 only: device scratch, ordered on the call's
  // stream, for the f32 partials of a K split (chunks x rows x out_features
  // x 4 bytes). A split that does not fit, or no workspace, runs unsplit:
  // the same bits.
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

// The row pitch of c in elements that p asks for: p.ldc, or the row length
// (backward_weight: in_features, dw being [experts, out, in]).
inline int64_t grouped_gemm_output_pitch(const GroupedGemmParams& p) {
  if (p.ldc != 0) return p.ldc;
  return p.pass == GroupedGemmPass::forward ? p.out_features : p.in_features;
}

// Runs on `stream` of the current device, on the backend that
// grouped_gemm_backend_for(p) names. Throws slime::Error for unsupported
// dtypes, sizes past int32, a tensor-core tile forced on inputs that need the
// fallback, invalid host offsets, or a cuBLAS failure.
void grouped_gemm(const GroupedGemmParams& p, StreamHandle stream);

// The process-wide backend choice for calls whose p.backend is automatic
// (benchmarking knob). Initially read from the environment variable
// SLIME_GROUPED_GEMM_BACKEND ("kernel", "cublas"; unset, empty or "auto" =
// automatic; anything else throws on first use); set_grouped_gemm_backend
// replaces it (automatic restores the default rule, not the environment).
// Forcing cublas on a call without host offsets copies the device offsets to
// the host and synchronises `stream` (for benchmarks, not training).
void set_grouped_gemm_backend(GroupedGemmBackend b);
GroupedGemmBackend grouped_gemm_backend();

// The backend grouped_gemm(p) runs: kernel or cublas (never automatic). The
// kernels always run null offsets, a custom ldc or alpha, and every call in
// the batch-invariant mode (slime/ops/batch_invariant.hpp) whose p.backend is
// automatic, over set_grouped_gemm_backend: their results do not depend on
// the group sizes.
GroupedGemmBackend grouped_gemm_backend_for(const GroupedGemmParams& p);

// How the cuBLAS backend runs the forward and dgrad passes: one
// cublasGemmGroupedBatchedEx (true, the default) or one cublasGemmEx per
// expert with rows (false; the wgrad pass always loops). bench_grouped_gemm's
// /cublas rows time the grouped call, its /cublas_loop rows the loop
// (measured: bench/RESULTS.md).
void set_grouped_gemm_cublas_grouped_api(bool on);
bool grouped_gemm_cublas_grouped_api();

// How many cuBLAS-backend calls cublasGemmGroupedBatchedEx refused with
// CUBLAS_STATUS_NOT_SUPPORTED (they ran the per-expert loop), process-wide.
int64_t grouped_gemm_cublas_fallbacks();

// "automatic", "kernel", "cublas".
const char* grouped_gemm_backend_name(GroupedGemmBackend b);

// Whether the automatic choice takes the Hopper (sm90) kernels on the
// current device: an sm_90a build, a compute capability 9.0 device, and not
// turned off by SLIME_GROUPED_GEMM_SM90=0 (for before/after benchmarks).
bool grouped_gemm_hopper_kernels();

// The kernel grouped_gemm(p) runs: p.tile when forced, else the dispatcher's
// choice by pass and shape (simple when the inputs need the fallback). On the
// Hopper kernels a plain forward GEMM (null offsets: the batch-invariant
// Linear) of few rows takes a narrower tile (n128, n64, then the 64-row
// m64n64 / m64n32 / m64n16) where the n256 tiles would leave most SMs idle
// (SLIME_GEMM_PLAIN_TILE=<tile name> forces one, for benchmarks): the tile
// changes which CTA sums an element, never the order of its sum over K
// (64-wide k-steps in order, each four wgmma k16 steps into one fp32
// accumulator). With SLIME_GEMM_K_CHUNKS=1
// (opt-in) it sums K in chunks of 256 instead (each chunk in a fresh fp32
// accumulator, the chunk sums added in order) on n128, n64 or the 64-row
// tiles, which run a tile's chunks side by side on four warpgroups of one
// CTA; with fewer n64 tiles than SMs (more than 256 rows) each chunk gets its
// own CTA and an f32 partial in p.workspace, added in the same order
// afterwards. Either way the bits do not depend on the rows
// (test_batch_invariant_gpu checks the calls against each other, in both
// settings).
GroupedGemmTile grouped_gemm_tile_for(const GroupedGemmParams& p);

// The cluster K split (opt-in: SLIME_GEMM_K_CHUNKS=1 and
// SLIME_GEMM_CLUSTER_K=1): an automatic plain forward GEMM of at most 256
// rows whose tiles leave SMs idle runs a 64 x `width` tile per cluster of
// `cluster` CTAs instead of the tile that grouped_gemm_tile_for names; each
// CTA sums `chunks_per_cta` of the tile's K chunks and stores the chunk sums'
// rows into the shared memory of the CTA that finishes them, which adds them
// in order (the same bits as the one-CTA kernels).
struct GroupedGemmClusterKPlan {
  int width = 0;           // 128, 64 or 32; 0: no split
  int cluster = 0;         // CTAs per cluster (2..8)
  int chunks_per_cta = 0;  // K chunks (256 of K each) summed by one CTA
  int ctas = 0;            // tiles x cluster, at most the SMs
  int smem_bytes = 0;      // dynamic shared memory per CTA
};
// The split for a plain GEMM of rows x k -> n on `sms` SMs, whether or not
// the switches are on: the width with the most CTAs (the wider on a tie),
// the largest cluster that keeps every CTA busy. Host code; no device needed.
GroupedGemmClusterKPlan grouped_gemm_sm90_cluster_k_plan(int64_t rows, int64_t n, int64_t k, int64_t sms);
// The cluster size that p runs with on this device, 0 when it does not.
int grouped_gemm_sm90_cluster_k(const GroupedGemmParams& p);

// "m128n256k64", ..., "simple", "automatic".
const char* grouped_gemm_tile_name(GroupedGemmTile t);

}  // namespace slime::ops::cuda
#endif
