// src/ops/ptx.cuh: private device helpers shared by the op kernels: inline-PTX
// wrappers for the tensor-core path (cp.async, ldmatrix, mma.sync m16n8k16
// bf16) and warp collectives (butterfly reductions, an inclusive scan). Not
// installed; include it only from src/ops/*.cu and src/ops/*.cuh.
//
// Fragment layouts of ldmatrix and mma.m16n8k16: attention_kernels.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace slime::ops::detail::ptx {

// ---- cp.async, ldmatrix, mma.sync (sm_80 and later) ------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared; when !full the destination is zero-filled and
// nothing is read (src must still be a valid address).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool full) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(full ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices from shared memory; register r gets the matrix whose
// row addresses come from lanes 8r..8r+7 (p is this lane's row address).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// c += a * b for one m16n8k16 tile (bf16 in, fp32 accumulate).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- warp collectives (all 32 lanes take part) -------------------------------------

// op over each aligned group of kWidth lanes (a power of two, at most 32):
// butterfly with lane distances kWidth / 2, ..., 2, 1, in that order, so every
// lane of a group gets the same bits and the result is the same run to run.
template <int kWidth = 32, class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
  static_assert(kWidth >= 1 && kWidth <= 32 && (kWidth & (kWidth - 1)) == 0, "kWidth: a power of two up to 32");
#pragma unroll
  for (int o = kWidth / 2; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <int kWidth = 32>
__device__ __forceinline__ float warp_sum(float v) {
  return warp_reduce<kWidth>(v, SumOp{});
}
template <int kWidth = 32>
__device__ __forceinline__ float warp_max(float v) {
  return warp_reduce<kWidth>(v, MaxOp{});
}

// Inclusive prefix sum of v over the warp's lanes (lane = this lane's index).
__device__ __forceinline__ int warp_inclusive_scan(int v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

}  // namespace slime::ops::detail::ptx
