// slime/ops/cpu/elementwise.hpp: CPU reference for residual add, dtype casts
// and scaling, plus the accumulator helpers the memory-bound op families
// (embedding, rms_norm, rope, swiglu, elementwise) share.
//
// Math happens in float for float/bf16/f16 elements and in double for double
// elements (the finite-difference tests); results are rounded once, to
// nearest even, into the element type.
#pragma once

#include <cstdint>
#include <type_traits>

#include "slime/core/half.hpp"

namespace slime::ops::cpu {

// Helpers of the memory-bound op families (a family-specific namespace, so
// other op families' helpers of the same name cannot collide).
namespace memops {

// The accumulator of element type T: double for double, float otherwise.
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Element -> accumulator (exact: every bf16, f16 and f32 value is a float).
template <class A, class T>
inline A to_acc(T v) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) {
    return A(v);
  } else {
    return A(float(v));
  }
}

// Accumulator -> element, rounding to nearest even once.
template <class T, class A>
inline T from_acc(A v) {
  if constexpr (std::is_same_v<T, double> || std::is_same_v<T, float>) {
    return T(v);
  } else {
    return T(float(v));
  }
}

}  // namespace memops

// y[i] = a[i] + b[i]. y may alias a or b.
template <class T>
void add(const T* a, const T* b, int64_t n, T* y) {
  using A = memops::acc_t<T>;
  for (int64_t i = 0; i < n; ++i) y[i] = memops::from_acc<T>(memops::to_acc<A>(a[i]) + memops::to_acc<A>(b[i]));
}

// y[i] = a[i] * s. y may alias a.
template <class T>
void scale(const T* a, memops::acc_t<T> s, int64_t n, T* y) {
  using A = memops::acc_t<T>;
  for (int64_t i = 0; i < n; ++i) y[i] = memops::from_acc<T>(memops::to_acc<A>(a[i]) * s);
}

// y[i] = Out(x[i]): exact widening to float, then one round-to-nearest-even
// narrowing (bf16 -> f16 goes through float, which is exact).
template <class In, class Out>
void cast(const In* x, int64_t n, Out* y) {
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<In, Out>) {
      y[i] = x[i];
    } else {
      y[i] = memops::from_acc<Out>(memops::to_acc<float>(x[i]));
    }
  }
}

}  // namespace slime::ops::cpu
