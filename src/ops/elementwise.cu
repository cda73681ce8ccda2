// CUDA kernels of slime/ops/elementwise.hpp: residual add, scale and dtype
// casts. One pass, 16-byte vectors where every pointer allows them (else one
// element per thread), fp32 math, one round-to-nearest-even per output: the
// same operations, in the same order, as the CPU reference, so the results
// are equal bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "memops.cuh"
#include "slime/core/half.hpp"
#include "slime/ops/cuda/elementwise.hpp"

namespace slime::ops::cuda {
namespace {

namespace memops = ::slime::ops::detail::memops;

constexpr int kThreads = 256;

using memops::aligned;
using memops::grid_1d;
using memops::load_vec;
using memops::store_vec;
using memops::to_float;
using memops::Vec;

// ---- conversions: memops::to_float (bf16 keeps NaN payloads, f16 NaN made
// canonical), and fp32 -> storage with the hardware cvt.rn for numbers (IEEE
// round to nearest even, the same as slime::BFloat16 / Half) and NaN made
// canonical explicitly, as half.hpp specifies (f32 -> bf16 / f16: 0x7FFF), so
// the bits never depend on how a GPU generation treats NaN payloads.
template <class T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return BFloat16::from_bits(v != v ? uint16_t(0x7fff) : __bfloat16_as_ushort(__float2bfloat16_rn(v)));
  } else {
    return Half::from_bits(v != v ? uint16_t(0x7fff) : __half_as_ushort(__float2half_rn(v)));
  }
}

unsigned grid_for(int64_t items) { return grid_1d(items, kThreads, int64_t(1) << 20); }

// ---- the ops, in fp32 ----
struct AddOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct ScaleOp {
  float s;
  __device__ float operator()(float a) const { return a * s; }
};
struct IdentityOp {
  __device__ float operator()(float a) const { return a; }
};

// y = op(a, b) over n elements: vectors of N first, then the n % N tail, one
// element per thread. No __restrict__: y may be a or b (in place).
template <class T, int N, class Op>
__global__ void __launch_bounds__(kThreads) binary_kernel(const T* a, const T* b, T* y, int64_t n, Op op) {
  const int64_t vectors = n / N;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < vectors; i += stride) {
    const Vec<T, N> va = load_vec<T, N>(a, i);
    const Vec<T, N> vb = load_vec<T, N>(b, i);
    Vec<T, N> vy;
#pragma unroll
    for (int j = 0; j < N; ++j) vy.v[j] = from_float<T>(op(to_float(va.v[j]), to_float(vb.v[j])));
    store_vec<T, N>(y, i, vy);
  }
  const int64_t t = blockIdx.x * int64_t(kThreads) + threadIdx.x + vectors * N;
  if (t < n) y[t] = from_float<T>(op(to_float(a[t]), to_float(b[t])));
}

// y = Out(op(x)) over n elements, vectors of N then the tail.
template <class In, class Out, int N, class Op>
__global__ void __launch_bounds__(kThreads) unary_kernel(const In* x, Out* y, int64_t n, Op op) {
  const int64_t vectors = n / N;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < vectors; i += stride) {
    const Vec<In, N> vx = load_vec<In, N>(x, i);
    Vec<Out, N> vy;
#pragma unroll
    for (int j = 0; j < N; ++j) vy.v[j] = from_float<Out>(op(to_float(vx.v[j])));
    store_vec<Out, N>(y, i, vy);
  }
  const int64_t t = blockIdx.x * int64_t(kThreads) + threadIdx.x + vectors * N;
  if (t < n) y[t] = from_float<Out>(op(to_float(x[t])));
}

template <class F>
void dispatch_floating(DType t, F&& f) {
  switch (t) {
    case DType::f32:
      f(float{});
      return;
    case DType::bf16:
      f(BFloat16{});
      return;
    case DType::f16:
      f(Half{});
      return;
    default:
      SLIME_FAIL("elementwise: expected f32, bf16 or f16, got ", dtype_name(t));
  }
}

template <class T, class Op>
void launch_binary(const T* a, const T* b, T* y, int64_t n, Op op, StreamHandle stream) {
  constexpr int kVec = 16 / sizeof(T);
  // The tail takes one element per thread after the vectors; the grid must
  // cover it (at most kVec - 1 elements, always inside the first block).
  if (aligned(a, 16) && aligned(b, 16) && aligned(y, 16)) {
    binary_kernel<T, kVec><<<grid_for(std::max<int64_t>(n / kVec, 1)), kThreads, 0, stream>>>(a, b, y, n, op);
  } else {
    binary_kernel<T, 1><<<grid_for(n), kThreads, 0, stream>>>(a, b, y, n, op);
  }
  SLIME_CUDA_CHECK_LAUNCH();
}

template <class In, class Out, class Op>
void launch_unary(const In* x, Out* y, int64_t n, Op op, StreamHandle stream) {
  constexpr int kVec = 16 / (sizeof(In) < sizeof(Out) ? sizeof(In) : sizeof(Out));
  constexpr std::size_t kInAlign = memops::vec_align(sizeof(In), kVec);
  constexpr std::size_t kOutAlign = memops::vec_align(sizeof(Out), kVec);
  if (aligned(x, kInAlign) && aligned(y, kOutAlign)) {
    unary_kernel<In, Out, kVec><<<grid_for(std::max<int64_t>(n / kVec, 1)), kThreads, 0, stream>>>(x, y, n, op);
  } else {
    unary_kernel<In, Out, 1><<<grid_for(n), kThreads, 0, stream>>>(x, y, n, op);
  }
  SLIME_CUDA_CHECK_LAUNCH();
}

}  // namespace

void add(const void* a, const void* b, void* y, DType dtype, int64_t n, StreamHandle stream) {
  if (n == 0) return;
  dispatch_floating(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_binary(static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(y), n, AddOp{}, stream);
  });
}

void scale(const void* a, float s, void* y, DType dtype, int64_t n, StreamHandle stream) {
  if (n == 0) return;
  dispatch_floating(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_unary(static_cast<const T*>(a), static_cast<T*>(y), n, ScaleOp{s}, stream);
  });
}

void cast(const void* x, DType x_dtype, void* y, DType y_dtype, int64_t n, StreamHandle stream) {
  if (n == 0) return;
  if (x_dtype == y_dtype) {
    if (x != y)
      SLIME_CUDA_CHECK(cudaMemcpyAsync(y, x, std::size_t(n) * dtype_size(x_dtype), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  dispatch_floating(x_dtype, [&](auto in_tag) {
    using In = decltype(in_tag);
    dispatch_floating(y_dtype, [&](auto out_tag) {
      using Out = decltype(out_tag);
      if constexpr (!std::is_same_v<In, Out>)
        launch_unary(static_cast<const In*>(x), static_cast<Out*>(y), n, IdentityOp{}, stream);
    });
  });
}

}  // namespace slime::ops::cuda
