// CUDA kernels of slime/ops/gelu.hpp: one pass over n contiguous elements,
// 16-byte vectors where every pointer allows them (else one element per
// thread), then the n % kVec tail; fp32 math with the accurate erff, tanhf
// and expf (the formulas of torch's GeluCUDAKernelImpl and of
// ops/cpu/gelu.hpp), one round-to-nearest-even per output. The two forms are
// device-side policy structs (GeluErf, GeluTanh), chosen once per call.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "memops.cuh"
#include "slime/core/half.hpp"
#include "slime/ops/cuda/gelu.hpp"

namespace slime::ops::cuda {
namespace {

using namespace ::slime::ops::detail::memops;

constexpr int kThreads = 256;

// gelu(x) = x * Phi(x); gelu'(x) = Phi(x) + x * phi(x).
struct GeluErf {
  static constexpr float kSqrtHalf = 0.70710678118654752440f;    // 1 / sqrt(2)
  static constexpr float kInvSqrt2Pi = 0.39894228040143267794f;  // 1 / sqrt(2 pi)
  __device__ __forceinline__ float value(float x) const { return 0.5f * x * (1.f + erff(x * kSqrtHalf)); }
  __device__ __forceinline__ float grad(float x) const {
    const float cdf = 0.5f * (1.f + erff(x * kSqrtHalf));
    return cdf + x * (kInvSqrt2Pi * expf(-0.5f * x * x));
  }
};

// gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3).
struct GeluTanh {
  static constexpr float kBeta = 0.79788456080286535588f;  // sqrt(2 / pi)
  static constexpr float kKappa = 0.044715f;
  __device__ __forceinline__ float value(float x) const {
    return 0.5f * x * (1.f + tanhf(kBeta * (x + kKappa * x * x * x)));
  }
  __device__ __forceinline__ float grad(float x) const {
    const float t = tanhf(kBeta * (x + kKappa * x * x * x));
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * kBeta * (1.f + 3.f * kKappa * x * x);
  }
};

// y = gelu(x): vectors of N first, then the n % N tail, one element per
// thread. No __restrict__: y may be x (in place).
template <class T, int N, class Gelu>
__global__ void __launch_bounds__(kThreads) gelu_forward_kernel(const T* x, T* y, int64_t n, Gelu gelu) {
  const int64_t vectors = n / N;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < vectors; i += stride) {
    const Vec<T, N> vx = load_vec<T, N>(x, i);
    Vec<T, N> vy;
#pragma unroll
    for (int j = 0; j < N; ++j) vy.v[j] = from_float<T>(gelu.value(to_float(vx.v[j])));
    store_vec<T, N>(y, i, vy);
  }
  const int64_t t = blockIdx.x * int64_t(kThreads) + threadIdx.x + vectors * N;
  if (t < n) y[t] = from_float<T>(gelu.value(to_float(x[t])));
}

// dx = dy * gelu'(x), vectors then the tail. dx may be x or dy.
template <class T, int N, class Gelu>
__global__ void __launch_bounds__(kThreads) gelu_backward_kernel(const T* x, const T* dy, T* dx, int64_t n, Gelu gelu) {
  const int64_t vectors = n / N;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < vectors; i += stride) {
    const Vec<T, N> vx = load_vec<T, N>(x, i);
    const Vec<T, N> vd = load_vec<T, N>(dy, i);
    Vec<T, N> vg;
#pragma unroll
    for (int j = 0; j < N; ++j) vg.v[j] = from_float<T>(to_float(vd.v[j]) * gelu.grad(to_float(vx.v[j])));
    store_vec<T, N>(dx, i, vg);
  }
  const int64_t t = blockIdx.x * int64_t(kThreads) + threadIdx.x + vectors * N;
  if (t < n) dx[t] = from_float<T>(to_float(dy[t]) * gelu.grad(to_float(x[t])));
}

unsigned grid_for(int64_t items) { return grid_1d(items, kThreads, int64_t(1) << 20); }

// Calls f(T{}, Gelu{}) for the dtype and the form.
template <class F>
void dispatch(DType dtype, GeluApproximation approx, F&& f) {
  auto with_form = [&](auto tag) {
    switch (approx) {
      case GeluApproximation::none:
        f(tag, GeluErf{});
        return;
      case GeluApproximation::tanh:
        f(tag, GeluTanh{});
        return;
    }
    SLIME_FAIL("gelu: unknown GeluApproximation ", int(approx));
  };
  if (dtype == DType::f32) {
    with_form(float{});
  } else if (dtype == DType::bf16) {
    with_form(BFloat16{});
  } else {
    SLIME_FAIL("gelu: expected f32 or bf16, got ", dtype_name(dtype));
  }
}

}  // namespace

void gelu_forward(const GeluForwardArgs& a, StreamHandle stream) {
  if (a.n == 0) return;
  dispatch(a.dtype, a.approx, [&](auto tag, auto gelu) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const T* x = static_cast<const T*>(a.x);
    T* y = static_cast<T*>(a.y);
    // The tail (at most kVec - 1 elements after the vectors) lies inside the
    // first block's threads.
    if (aligned(x, 16) && aligned(y, 16)) {
      gelu_forward_kernel<T, kVec>
          <<<grid_for(std::max<int64_t>(a.n / kVec, 1)), kThreads, 0, stream>>>(x, y, a.n, gelu);
    } else {
      gelu_forward_kernel<T, 1><<<grid_for(a.n), kThreads, 0, stream>>>(x, y, a.n, gelu);
    }
    SLIME_CUDA_CHECK_LAUNCH();
  });
}

void gelu_backward(const GeluBackwardArgs& a, StreamHandle stream) {
  if (a.n == 0) return;
  dispatch(a.dtype, a.approx, [&](auto tag, auto gelu) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const T* x = static_cast<const T*>(a.x);
    const T* dy = static_cast<const T*>(a.dy);
    T* dx = static_cast<T*>(a.dx);
    if (aligned(x, 16) && aligned(dy, 16) && aligned(dx, 16)) {
      gelu_backward_kernel<T, kVec>
          <<<grid_for(std::max<int64_t>(a.n / kVec, 1)), kThreads, 0, stream>>>(x, dy, dx, a.n, gelu);
    } else {
      gelu_backward_kernel<T, 1><<<grid_for(a.n), kThreads, 0, stream>>>(x, dy, dx, a.n, gelu);
    }
    SLIME_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace slime::ops::cuda
