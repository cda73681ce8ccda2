// src/ops/memops.cuh: private device helpers shared by the memory-bound op
// kernels (elementwise, embedding, rms_norm, rope, row_ops, swiglu): bf16 /
// f16 / f32 conversions, the all-bits-set NaN, the 16-byte vector type with
// its loads and stores, alignment tests and grid shapes. Not installed;
// include it only from src/ops/*.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "slime/core/half.hpp"

namespace slime::ops::detail::memops {

// Element -> fp32. bf16 -> f32 is a shift (NaN payloads kept, as on the
// host); f16 -> f32 makes NaN canonical (0x7FFFFFFF), as half.hpp specifies.
template <class T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return __bfloat162float(__ushort_as_bfloat16(v.bits));
  } else {
    static_assert(std::is_same_v<T, Half>, "to_float: float, BFloat16 or Half");
    const float f = __half2float(__ushort_as_half(v.bits));
    return f != f ? __uint_as_float(0x7fffffffu) : f;
  }
}

// fp32 -> float or bf16 with one round to nearest even (hardware cvt.rn).
template <class T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    static_assert(std::is_same_v<T, BFloat16>, "from_float: float or BFloat16");
    return BFloat16::from_bits(__bfloat16_as_ushort(__float2bfloat16_rn(v)));
  }
}

// All bits set: NaN in every float type (as Tensor::fill_bytes_(0xff)).
template <class T>
__device__ __forceinline__ T all_ones() {
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(0xffffffffu);
  } else {
    return BFloat16::from_bits(0xffffu);
  }
}

// Alignment of n elements of `elem` bytes loaded together: 16 bytes at most
// (sm_90 has no wider per-thread access, so larger vectors become several
// 16-byte ones).
constexpr std::size_t vec_align(std::size_t elem, int n) { return elem * n < 16 ? elem * n : 16; }

// N elements loaded or stored together.
template <class T, int N>
struct alignas(vec_align(sizeof(T), N)) Vec {
  T v[N];
};

// Vector i of base, or the vector at p: base and p must be aligned to
// vec_align(sizeof(T), N). Index a Vec pointer (base, i) where the offset
// is not a compile-time multiple of N: nvcc 13.0 splits a copy through
// Vec* cast from `T* + row * ld + c * N` into element-wise stores, but keeps
// one 16-byte access for `(Vec*)(T* + row * ld)[c]`.
template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* base, int64_t i) {
  return reinterpret_cast<const Vec<T, N>*>(base)[i];
}

template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}

template <class T, int N>
__device__ __forceinline__ void store_vec(T* base, int64_t i, const Vec<T, N>& v) {
  reinterpret_cast<Vec<T, N>*>(base)[i] = v;
}

template <class T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

inline bool aligned(const void* p, std::size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Blocks of `threads` threads for n items of a grid-stride loop, at least
// one, at most max_blocks.
inline unsigned grid_1d(int64_t n, int threads, int64_t max_blocks = 65535 * 16) {
  return unsigned(std::clamp<int64_t>((n + threads - 1) / threads, 1, max_blocks));
}

// A 2-d grid: x over the vectors of a row (`threads` per block), y over rows
// (at most 65535; the kernels stride over the rest).
inline dim3 grid_rows(int64_t vectors_per_row, int64_t rows, int threads) {
  constexpr int64_t kMaxGridY = 65535;
  return dim3(unsigned((vectors_per_row + threads - 1) / threads), unsigned(std::min<int64_t>(rows, kMaxGridY)));
}

}  // namespace slime::ops::detail::memops
