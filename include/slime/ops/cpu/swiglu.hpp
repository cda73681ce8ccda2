// slime/ops/cpu/swiglu.hpp: CPU reference for the SwiGLU gate of the MLP,
// h = silu(gate) * up with silu(g) = g * sigmoid(g), forward and backward, on
// n contiguous elements (the Tensor API calls it per row for the fused
// [tokens, 2F] layout).
#pragma once

#include <cmath>
#include <cstdint>

#include "slime/ops/cpu/elementwise.hpp"

namespace slime::ops::cpu {

// sigmoid(g) = 1 / (1 + exp(-g)), in the accumulator type.
template <class A>
inline A swiglu_sigmoid(A g) {
  return A(1) / (A(1) + std::exp(-g));
}

// h[i] = silu(gate[i]) * up[i].
template <class T>
void swiglu_forward(const T* gate, const T* up, int64_t n, T* h) {
  using A = memops::acc_t<T>;
  using memops::to_acc;
  for (int64_t i = 0; i < n; ++i) {
    const A g = to_acc<A>(gate[i]);
    h[i] = memops::from_acc<T>(g * swiglu_sigmoid(g) * to_acc<A>(up[i]));
  }
}

// dgate[i] = dh[i] * up[i] * sigmoid(g) * (1 + g * (1 - sigmoid(g)))   (written)
// dup[i]   = dh[i] * silu(g)                                           (written)
template <class T>
void swiglu_backward(const T* gate, const T* up, const T* dh, int64_t n, T* dgate, T* dup) {
  using A = memops::acc_t<T>;
  using memops::to_acc;
  for (int64_t i = 0; i < n; ++i) {
    const A g = to_acc<A>(gate[i]), u = to_acc<A>(up[i]), d = to_acc<A>(dh[i]);
    const A s = swiglu_sigmoid(g);
    dgate[i] = memops::from_acc<T>(d * u * (s * (A(1) + g * (A(1) - s))));
    dup[i] = memops::from_acc<T>(d * (g * s));
  }
}

}  // namespace slime::ops::cpu
