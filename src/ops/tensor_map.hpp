// src/ops/tensor_map.hpp: private host helpers of the Hopper (sm_90a)
// kernels: TMA tensor maps (cuTensorMapEncodeTiled, reached through the
// runtime's driver entry points, so that nothing links libcuda) and whether the
// current device runs the sm_90a kernels of this build. Not installed.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "slime/core/error.hpp"

namespace slime::ops::detail::tma {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    SLIME_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    SLIME_CHECK(q == cudaDriverEntryPointSuccess && f != nullptr,
                "the CUDA driver has no cuTensorMapEncodeTiled (driver too old for TMA)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A tensor map with the 128-byte swizzle over `rank` dims (innermost first,
// element counts), byte strides of dims 1.., and a box of `box` elements.
// `what` names the caller in the error.
inline CUtensorMap make_tensor_map(const char* what, const void* base, int rank, const uint64_t* dims,
                                   const uint64_t* strides, const uint32_t* box,
                                   CUtensorMapDataType dtype = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16) {
  CUtensorMap m;
  const uint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(&m, dtype, cuuint32_t(rank), const_cast<void*>(base), dims, strides, box,
                                          elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  SLIME_CHECK(r == CUDA_SUCCESS, what, ": cuTensorMapEncodeTiled failed (error ", int(r), ", rank ", rank, ", dims ",
              dims[0], " x ", dims[1], rank > 2 ? " x ..." : "", ")");
  return m;
}

// A bf16 [tokens, heads, d] tensor (the attention kernels' q, k, v, o, dO) as
// a 3-D map (d, heads, tokens) with boxes of {64, heads_per_box, rows}: with
// one head per box a box never crosses heads, and rows past the tensor are
// zero-filled. (The Hopper forward's packed decode loads {64, group, 1}: one
// token's heads of a kv group.)
inline CUtensorMap make_heads_map(const char* what, const void* base, int64_t tokens, int64_t heads, int d, int rows,
                                  int heads_per_box = 1) {
  const uint64_t dims[3] = {uint64_t(d), uint64_t(heads), uint64_t(tokens)};
  const uint64_t strides[2] = {uint64_t(d) * 2, uint64_t(heads) * uint64_t(d) * 2};
  const uint32_t box[3] = {64, uint32_t(heads_per_box), uint32_t(rows)};
  return make_tensor_map(what, base, 3, dims, strides, box);
}

// Whether this build has sm_90a kernels and the current device is an sm_90
// (Hopper) GPU that runs them; cached per device.
inline bool sm90_device() {
#if defined(SLIME_CUDA_SM90A_BUILT)
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
#else
  return false;
#endif
}

// Multiprocessors of the current device (cached per device): the grid of the
// persistent Hopper kernels.
inline int sm_count() {
  static std::atomic<int> cached[64] = {};
  int dev = 0;
  SLIME_CUDA_CHECK(cudaGetDevice(&dev));
  SLIME_CHECK(dev >= 0 && dev < 64, "sm_count: device index ", dev, " out of range");
  int v = cached[dev].load(std::memory_order_relaxed);
  if (v == 0) {
    SLIME_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    cached[dev].store(v, std::memory_order_relaxed);
  }
  return v;
}

}  // namespace slime::ops::detail::tma
