// slime/ops/cpu/gelu.hpp: CPU reference for GELU, forward and backward, on n
// contiguous elements, in its two forms:
//
//   erf   gelu(x) = x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))
//         gelu'(x) = Phi(x) + x * phi(x),   phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
//   tanh  gelu(x) = 0.5 x (1 + tanh(u)),    u = sqrt(2 / pi) (x + 0.044715 x^3)
//         gelu'(x) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) sqrt(2 / pi) (1 + 3 * 0.044715 x^2)
//
// The tanh form is torch's gelu(approximate="tanh") (HF's gelu_pytorch_tanh,
// Qwen3-VL's vision MLP), the erf form nn.GELU() (the patch merger's). Math in
// the accumulator type (float; double when T = double), one rounding per output.
#pragma once

#include <cmath>
#include <cstdint>

#include "slime/ops/cpu/elementwise.hpp"

namespace slime::ops {

// Which GELU: torch's `approximate` argument ("none": the exact erf form).
enum class GeluApproximation { none, tanh };

constexpr const char* gelu_approximation_name(GeluApproximation a) {
  return a == GeluApproximation::tanh ? "tanh" : "none";
}

}  // namespace slime::ops

namespace slime::ops::cpu {

namespace memops {

// GELU and its derivative at x in A, for one form.
template <class A>
struct GeluErfMath {
  static A value(A x) { return A(0.5) * x * (A(1) + std::erf(x * A(0.70710678118654752440))); }
  static A grad(A x) {
    const A cdf = A(0.5) * (A(1) + std::erf(x * A(0.70710678118654752440)));
    const A pdf = A(0.39894228040143267794) * std::exp(A(-0.5) * x * x);
    return cdf + x * pdf;
  }
};

template <class A>
struct GeluTanhMath {
  static constexpr A kBeta = A(0.79788456080286535588);  // sqrt(2 / pi)
  static constexpr A kKappa = A(0.044715);
  static A value(A x) { return A(0.5) * x * (A(1) + std::tanh(kBeta * (x + kKappa * x * x * x))); }
  static A grad(A x) {
    const A t = std::tanh(kBeta * (x + kKappa * x * x * x));
    return A(0.5) * (A(1) + t) + A(0.5) * x * (A(1) - t * t) * kBeta * (A(1) + A(3) * kKappa * x * x);
  }
};

template <class A, class F>
void visit_gelu_math(GeluApproximation approx, F&& f) {
  if (approx == GeluApproximation::tanh) {
    f(GeluTanhMath<A>{});
  } else {
    f(GeluErfMath<A>{});
  }
}

}  // namespace memops

// y[i] = gelu(x[i]). y may alias x.
template <class T>
void gelu_forward(const T* x, int64_t n, GeluApproximation approx, T* y) {
  using A = memops::acc_t<T>;
  memops::visit_gelu_math<A>(approx, [&](auto math) {
    for (int64_t i = 0; i < n; ++i) y[i] = memops::from_acc<T>(math.value(memops::to_acc<A>(x[i])));
  });
}

// dx[i] = dy[i] * gelu'(x[i])   (written). dx may alias x or dy.
template <class T>
void gelu_backward(const T* x, const T* dy, int64_t n, GeluApproximation approx, T* dx) {
  using A = memops::acc_t<T>;
  memops::visit_gelu_math<A>(approx, [&](auto math) {
    for (int64_t i = 0; i < n; ++i)
      dx[i] = memops::from_acc<T>(memops::to_acc<A>(dy[i]) * math.grad(memops::to_acc<A>(x[i])));
  });
}

}  // namespace slime::ops::cpu
