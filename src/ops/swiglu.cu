// CUDA kernels of slime/ops/swiglu.hpp: one pass over [rows, cols] operands
// with leading dimensions (the fused gate_up layout reads both halves of a
// row in place). A 2-d grid: x over 16-byte column vectors (8 bf16 / 4 f32)
// where cols, every leading dimension and every pointer allow them (else one
// element per thread), y over rows. fp32 math with an accurate expf.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "memops.cuh"
#include "slime/core/half.hpp"
#include "slime/ops/cuda/swiglu.hpp"

namespace slime::ops::cuda {
namespace {

using namespace ::slime::ops::detail::memops;

constexpr int kThreads = 256;

// The vector c of row `row` of a [rows, ld] operand.
template <class T, int N>
__device__ __forceinline__ Vec<T, N> load(const void* base, int64_t row, int64_t ld, int64_t c) {
  return load_vec<T, N>(static_cast<const T*>(base) + row * ld, c);
}

template <class T, int N>
__device__ __forceinline__ void store(void* base, int64_t row, int64_t ld, int64_t c, const Vec<T, N>& v) {
  store_vec<T, N>(static_cast<T*>(base) + row * ld, c, v);
}

__device__ __forceinline__ float sigmoid(float g) { return 1.f / (1.f + expf(-g)); }

template <class T, int N>
__global__ void __launch_bounds__(kThreads) swiglu_forward_kernel(const SwigluForwardArgs a) {
  const int64_t c = blockIdx.x * int64_t(kThreads) + threadIdx.x;  // column vector
  if (c >= a.cols / N) return;
  for (int64_t r = blockIdx.y; r < a.rows; r += gridDim.y) {
    const Vec<T, N> g = load<T, N>(a.gate, r, a.ld_gate, c);
    const Vec<T, N> u = load<T, N>(a.up, r, a.ld_up, c);
    Vec<T, N> h;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float gf = to_float(g.v[k]);
      h.v[k] = from_float<T>(gf * sigmoid(gf) * to_float(u.v[k]));
    }
    store<T, N>(a.h, r, a.ld_h, c, h);
  }
}

template <class T, int N>
__global__ void __launch_bounds__(kThreads) swiglu_backward_kernel(const SwigluBackwardArgs a) {
  const int64_t c = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (c >= a.cols / N) return;
  for (int64_t r = blockIdx.y; r < a.rows; r += gridDim.y) {
    const Vec<T, N> g = load<T, N>(a.gate, r, a.ld_gate, c);
    const Vec<T, N> u = load<T, N>(a.up, r, a.ld_up, c);
    const Vec<T, N> d = load<T, N>(a.dh, r, a.ld_dh, c);
    Vec<T, N> dg, du;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      const float gf = to_float(g.v[k]), uf = to_float(u.v[k]), df = to_float(d.v[k]);
      const float s = sigmoid(gf);
      dg.v[k] = from_float<T>(df * uf * (s * (1.f + gf * (1.f - s))));
      du.v[k] = from_float<T>(df * (gf * s));
    }
    store<T, N>(a.dgate, r, a.ld_dgate, c, dg);
    store<T, N>(a.dup, r, a.ld_dup, c, du);
  }
}

// 16-byte vectors of T when cols, the leading dimensions and the pointers
// allow them.
template <class T>
bool vectorizable(int64_t cols, std::initializer_list<int64_t> lds, std::initializer_list<const void*> ptrs) {
  constexpr int kVec = 16 / sizeof(T);
  if (cols % kVec != 0) return false;
  for (int64_t ld : lds)
    if (ld % kVec != 0) return false;
  for (const void* p : ptrs)
    if (!aligned(p, 16)) return false;
  return true;
}

dim3 grid_for(int64_t vectors_per_row, int64_t rows) { return grid_rows(vectors_per_row, rows, kThreads); }

template <class F>
void dispatch(DType t, F&& f) {
  if (t == DType::f32) {
    f(float{});
  } else if (t == DType::bf16) {
    f(BFloat16{});
  } else {
    SLIME_FAIL("swiglu: expected f32 or bf16, got ", dtype_name(t));
  }
}

}  // namespace

void swiglu_forward(const SwigluForwardArgs& a, StreamHandle stream) {
  if (a.rows == 0 || a.cols == 0) return;
  dispatch(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    if (vectorizable<T>(a.cols, {a.ld_gate, a.ld_up, a.ld_h}, {a.gate, a.up, a.h})) {
      swiglu_forward_kernel<T, kVec><<<grid_for(a.cols / kVec, a.rows), kThreads, 0, stream>>>(a);
    } else {
      swiglu_forward_kernel<T, 1><<<grid_for(a.cols, a.rows), kThreads, 0, stream>>>(a);
    }
    SLIME_CUDA_CHECK_LAUNCH();
  });
}

void swiglu_backward(const SwigluBackwardArgs& a, StreamHandle stream) {
  if (a.rows == 0 || a.cols == 0) return;
  dispatch(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    if (vectorizable<T>(a.cols, {a.ld_gate, a.ld_up, a.ld_dh, a.ld_dgate, a.ld_dup},
                        {a.gate, a.up, a.dh, a.dgate, a.dup})) {
      swiglu_backward_kernel<T, kVec><<<grid_for(a.cols / kVec, a.rows), kThreads, 0, stream>>>(a);
    } else {
      swiglu_backward_kernel<T, 1><<<grid_for(a.cols, a.rows), kThreads, 0, stream>>>(a);
    }
    SLIME_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace slime::ops::cuda
