// Hopper (sm_90a) grouped GEMM for slime/ops/cuda/grouped_gemm.hpp: wgmma fed
// by TMA through an mbarrier pipeline, one producer warpgroup and two
// consumer warpgroups per CTA (warp specialisation). The three passes and
// their operand layouts are those of grouped_gemm.cu (the table at its top):
//   pass             A (M x K)              B (N x K)               K summed
//   forward          x_g       K-major      w_e [out, in] K-major    in
//   backward_input   dy_g      K-major      w_e [out, in] MN-major   out
//   backward_weight  dy_gᵀ     MN-major     x_g [n_e, in] MN-major   n_e
//
// CTA tile 128 x BN x 64 (BN = 256 or 128). Shared memory holds kStages
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
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <atomic>
#include <climits>
#include <cstdint>

#include "grouped_gemm_common.cuh"
#include "slime/core/error.hpp"
#include "slime/ops/cuda/grouped_gemm.hpp"
#include "sm90.cuh"

namespace slime::ops::cuda {

namespace {

using namespace ::slime::ops::detail::sm90;
using namespace ::slime::ops::detail::grouped_gemm_device;
using bf16 = __nv_bfloat16;
using Pass = GroupedGemmPass;

template <int BN>
struct Sm90Tile {
  static constexpr int kBM = 128, kBN = BN, kBK = 64;
  static constexpr int kThreads = 384;  // warpgroup 0: producer; 1, 2: consumers
  static constexpr int kBox = 64 * 64 * 2;                // one [64][64] bf16 box, 8 KB
  static constexpr int kABytes = kBM * kBK * 2;           // 16 KB
  static constexpr int kBBytes = kBN * kBK * 2;           // 32 or 16 KB
  static constexpr int kStageBytes = kABytes + kBBytes;   // multiple of 1024
  static constexpr int kStages = BN == 256 ? 4 : 6;       // 192 KB either way
  static constexpr int kSmemBytes = kStages * kStageBytes + 1024;  // + alignment slack
  static constexpr int kAcc = BN / 2;                     // fp32 accumulators per consumer thread
  static_assert(kSmemBytes <= 227 * 1024, "fits the 227 KB a Hopper CTA may use");
};

template <Pass kPass>
struct Sm90Layout {
  static constexpr bool kAKMajor = kPass != Pass::backward_weight;
  static constexpr bool kBKMajor = kPass == Pass::forward;
};

struct Sm90Params {
  const int32_t* offsets;
  void* c;
  int experts, rows, out_f, in_f;
  int m_tiles, n_tiles;  // backward_weight: per expert; others: n-tiles per m-tile
  bool accumulate;
};

// c[BN / 2]: one m64nBNk16 step on the operand tiles at a / b.
template <int BN, bool kAK, bool kBK>
__device__ __forceinline__ void mma_step(float (&d)[BN / 2], const unsigned char* a, const unsigned char* b, int kk) {
  // K-major: a k16 step is 32 bytes along the 128-byte row; MN-major: 16 rows.
  const uint64_t da = kAK ? make_desc_sw128(a + kk * 32, 16, 1024) : make_desc_sw128(a + kk * 2048, 8192, 1024);
  const uint64_t db = kBK ? make_desc_sw128(b + kk * 32, 16, 1024) : make_desc_sw128(b + kk * 2048, 8192, 1024);
  if constexpr (BN == 256) {
    wgmma_m64n256k16<kAK ? 0 : 1, kBK ? 0 : 1>(d, da, db, 1);
  } else {
    wgmma_m64n128k16<kAK ? 0 : 1, kBK ? 0 : 1>(d, da, db, 1);
  }
}

template <int BN, Pass kPass, class TOut>
__global__ void __launch_bounds__(384, 1)
    grouped_gemm_sm90_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                             const Sm90Params p) {
#if SLIME_SM90A
  using T = Sm90Tile<BN>;
  constexpr int kBM = T::kBM, kBK = T::kBK, kStages = T::kStages;
  constexpr bool kAK = Sm90Layout<kPass>::kAKMajor, kBKm = Sm90Layout<kPass>::kBKMajor;

  extern __shared__ __align__(1024) unsigned char sm90_smem_raw[];
  __shared__ __align__(8) uint64_t full_bar[kStages];
  __shared__ __align__(8) uint64_t empty_bar[kStages];
  __shared__ int s_scan[T::kThreads / 32 + 4];
  unsigned char* smem = sm90_smem_raw + ((1024 - (smem_u32(sm90_smem_raw) & 1023)) & 1023);

  const int tid = threadIdx.x;
  // ---- the tile: A rows (or wgrad's k rows) start at a_row; C at gC
  int group, m0, n0, a_row, k_len, m_valid, n_valid;
  int64_t ldc;
  TOut* gC;
  bool accumulate;
  if constexpr (kPass == Pass::backward_weight) {
    const int per_expert = p.m_tiles * p.n_tiles;
    group = int(blockIdx.x) / per_expert;
    const int local = int(blockIdx.x) % per_expert;
    m0 = (local / p.n_tiles) * kBM;
    n0 = (local % p.n_tiles) * BN;
    const int r0 = p.offsets[group], r1 = p.offsets[group + 1];
    if (tid == 0 && (r0 < 0 || r1 < r0 || r1 > p.rows || (group == 0 && r0 != 0) ||
                     (group == p.experts - 1 && r1 != p.rows)))
      QuietTrap{}("offsets out of order or not ending at the row count", group, r0, r1);
    if (r1 <= r0) return;  // no rows: dw_e stays as it is
    a_row = r0;
    k_len = r1 - r0;
    m_valid = p.out_f - m0;
    n_valid = p.in_f - n0;
    ldc = p.in_f;
    gC = static_cast<TOut*>(p.c) + (int64_t(group) * p.out_f + m0) * p.in_f + n0;
    accumulate = true;
  } else {
    const TileCoord tc =
        locate_tile<T::kThreads, kBM, QuietTrap>(p.offsets, p.experts, p.rows, p.n_tiles, int(blockIdx.x), s_scan);
    if (tc.group < 0) return;
    group = tc.group;
    m0 = tc.m_tile * kBM;
    n0 = tc.n_tile * BN;
    a_row = tc.row0 + m0;
    m_valid = tc.rows - m0;
    if constexpr (kPass == Pass::forward) {
      k_len = p.in_f;
      n_valid = p.out_f - n0;
      ldc = p.out_f;
      accumulate = false;
    } else {
      k_len = p.out_f;
      n_valid = p.in_f - n0;
      ldc = p.in_f;
      accumulate = p.accumulate;
    }
    gC = static_cast<TOut*>(p.c) + int64_t(a_row) * ldc + n0;
  }
  const int k_tiles = (k_len + kBK - 1) / kBK;

  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full_bar[s], 1);
      mbar_init(&empty_bar[s], 256);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int wg = tid / 128;
  if (wg == 0) {
    // ---- producer: one thread issues every copy
    setmaxnreg_dec<40>();
    if (tid == 0) {
      tma_prefetch_descriptor(&map_a);
      tma_prefetch_descriptor(&map_b);
      for (int kt = 0; kt < k_tiles; ++kt) {
        const int s = kt % kStages;
        mbar_wait(&empty_bar[s], ((kt / kStages) & 1) ^ 1);
        unsigned char* sa = smem + s * T::kStageBytes;
        unsigned char* sb = sa + T::kABytes;
        uint64_t* bar = &full_bar[s];
        mbar_arrive_expect_tx(bar, T::kStageBytes);
        const int k0 = kt * kBK;
        if constexpr (kPass == Pass::forward) {
          tma_load_2d(sa, &map_a, bar, k0, a_row);          // x [rows, in]: box {64 k, 128 rows}
          tma_load_3d(sb, &map_b, bar, k0, n0, group);      // w [E, out, in]: box {64 k, BN n, 1}
        } else if constexpr (kPass == Pass::backward_input) {
          tma_load_2d(sa, &map_a, bar, k0, a_row);          // dy [rows, out]: box {64 k, 128 rows}
#pragma unroll
          for (int j = 0; j < BN / 64; ++j)                  // w [E, out, in]: boxes {64 n, 64 k, 1}
            tma_load_3d(sb + j * T::kBox, &map_b, bar, n0 + 64 * j, k0, group);
        } else {
#pragma unroll
          for (int j = 0; j < 2; ++j)                        // dy [rows, out]: boxes {64 m, 64 k}
            tma_load_2d(sa + j * T::kBox, &map_a, bar, m0 + 64 * j, a_row + k0);
#pragma unroll
          for (int j = 0; j < BN / 64; ++j)                  // x [rows, in]: boxes {64 n, 64 k}
            tma_load_2d(sb + j * T::kBox, &map_b, bar, n0 + 64 * j, a_row + k0);
        }
      }
    }
  } else {
    // ---- consumers: warpgroup c owns rows 64 c .. 64 c + 63 of the tile
    setmaxnreg_inc<232>();
    const int c = wg - 1, ctid = tid - 128;
    float acc[T::kAcc];
#pragma unroll
    for (int i = 0; i < T::kAcc; ++i) acc[i] = 0.f;

    for (int kt = 0; kt < k_tiles; ++kt) {
      const int s = kt % kStages;
      mbar_wait(&full_bar[s], (kt / kStages) & 1);
      unsigned char* sa = smem + s * T::kStageBytes;
      const unsigned char* sb = sa + T::kABytes;
      if constexpr (kPass == Pass::backward_weight) {
        const int valid = k_len - kt * kBK;
        if (valid < kBK) {
          // Zero the k rows past the group in every box of the stage (A's 2
          // and B's BN / 64, contiguous): whole 128-byte rows.
          constexpr int kBoxes = 2 + BN / 64;
          const int chunks_per_box = (kBK - valid) * 8;  // 16-byte chunks
          for (int i = ctid; i < kBoxes * chunks_per_box; i += 256) {
            const int box = i / chunks_per_box, rem = i % chunks_per_box;
            *reinterpret_cast<uint4*>(sa + box * T::kBox + valid * 128 + rem * 16) = make_uint4(0, 0, 0, 0);
          }
          fence_proxy_async();
          named_barrier_sync(1, 256);
        }
      }
      const unsigned char* a = sa + c * T::kBox;  // rows 64 c..: 64 K-major rows or the c-th MN-major box
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) mma_step<BN, kAK, kBKm>(acc, a, sb, kk);
      wgmma_commit();
      wgmma_wait<1>();
      fence_registers(acc);
      if (kt > 0) mbar_arrive(&empty_bar[(kt - 1) % kStages]);
    }
    wgmma_wait<0>();
    fence_registers(acc);

    // ---- epilogue: registers to global, 2 columns per store
    const int warp = (ctid >> 5) & 3, lane = ctid & 31;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = 64 * c + 16 * warp + (lane >> 2) + 8 * h;
      if (row >= m_valid) continue;
      TOut* crow = gC + int64_t(row) * ldc;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int col = 8 * j + 2 * (lane & 3);
        if (col < n_valid) store_pair(crow + col, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1], accumulate);
      }
    }
  }
#else
  __trap();  // built without sm_90a; the dispatcher never launches this
#endif
}

// ---- tensor maps --------------------------------------------------------------------

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    SLIME_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    SLIME_CHECK(q == cudaDriverEntryPointSuccess && f != nullptr,
                "grouped_gemm: the CUDA driver has no cuTensorMapEncodeTiled (driver too old for TMA)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A bf16 tensor map, 128-byte swizzle, over `rank` dims (innermost first,
// element counts) with byte strides of dims 1.. and a box of `box` elements.
CUtensorMap make_tensor_map(const void* base, int rank, const uint64_t* dims, const uint64_t* strides,
                            const uint32_t* box) {
  CUtensorMap m;
  const uint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(
      &m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, cuuint32_t(rank), const_cast<void*>(base), dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  SLIME_CHECK(r == CUDA_SUCCESS, "grouped_gemm: cuTensorMapEncodeTiled failed (error ", int(r), ", rank ", rank,
              ", dims ", dims[0], " x ", dims[1], rank > 2 ? " x ..." : "", ")");
  return m;
}

CUtensorMap map_2d(const void* base, uint64_t inner, uint64_t outer, uint32_t box_inner, uint32_t box_outer) {
  const uint64_t dims[2] = {inner, outer}, strides[1] = {inner * 2};
  const uint32_t box[2] = {box_inner, box_outer};
  return make_tensor_map(base, 2, dims, strides, box);
}

// w [E, out, in] as 3-D (in, out, E).
CUtensorMap map_weights(const void* base, uint64_t in_f, uint64_t out_f, uint64_t experts, uint32_t box_in,
                        uint32_t box_out) {
  const uint64_t dims[3] = {in_f, out_f, experts}, strides[2] = {in_f * 2, in_f * out_f * 2};
  const uint32_t box[3] = {box_in, box_out, 1};
  return make_tensor_map(base, 3, dims, strides, box);
}

int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

template <int BN, Pass kPass, class TOut>
void launch_sm90(const GroupedGemmParams& p, cudaStream_t stream) {
  using T = Sm90Tile<BN>;
  const uint64_t rows = uint64_t(p.rows), in_f = uint64_t(p.in_features), out_f = uint64_t(p.out_features),
                 experts = uint64_t(p.experts);
  CUtensorMap ma, mb;
  Sm90Params kp{};
  kp.offsets = p.offsets;
  kp.c = p.c;
  kp.experts = int(p.experts);
  kp.rows = int(p.rows);
  kp.out_f = int(p.out_features);
  kp.in_f = int(p.in_features);
  kp.accumulate = p.accumulate;
  int64_t ctas;
  if constexpr (kPass == Pass::forward) {
    ma = map_2d(p.a, in_f, rows, 64, 128);
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
    ctas = (int64_t(ceil_div(p.rows, T::kBM)) + p.experts) * kp.n_tiles;
  }
  SLIME_CHECK(ctas < INT_MAX, "grouped_gemm: ", ctas, " tiles do not fit in int32");
  if (ctas == 0) return;
  auto kernel = grouped_gemm_sm90_kernel<BN, kPass, TOut>;
  SLIME_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, T::kSmemBytes));
  kernel<<<unsigned(ctas), T::kThreads, T::kSmemBytes, stream>>>(ma, mb, kp);
  SLIME_CUDA_CHECK_LAUNCH();
}

template <Pass kPass, class TOut>
void dispatch_sm90_tile(GroupedGemmTile tile, const GroupedGemmParams& p, cudaStream_t stream) {
  if (tile == GroupedGemmTile::sm90_m128n256) return launch_sm90<256, kPass, TOut>(p, stream);
  return launch_sm90<128, kPass, TOut>(p, stream);
}

}  // namespace

bool grouped_gemm_sm90_built() {
#if defined(SLIME_CUDA_SM90A_BUILT)
  return true;
#else
  return false;
#endif
}

bool grouped_gemm_sm90_device() {
  if (!grouped_gemm_sm90_built()) return false;
  static std::atomic<int> cached[64] = {};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  SLIME_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) return false;
  int v = cached[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    int major = 0, minor = 0;
    SLIME_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    SLIME_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    v = major == 9 && minor == 0 ? 1 : 2;
    cached[dev].store(v, std::memory_order_relaxed);
  }
  return v == 1;
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
