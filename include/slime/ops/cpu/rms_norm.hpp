// slime/ops/cpu/rms_norm.hpp: CPU reference for RMSNorm over the last dim,
// forward and backward.
//
//   rstd[r] = 1 / sqrt(mean_d(x[r, d]^2) + eps)
//   y[r, d] = x[r, d] * rstd[r] * w[d]
//
// In the accumulator type A (float; double when T = double): eps is rounded to
// A first, as torch adds a Python float to an fp32 tensor.
#pragma once

#include <cmath>
#include <cstdint>

#include "slime/ops/cpu/elementwise.hpp"

namespace slime::ops::cpu {

// x [rows, dim], w [dim] -> y [rows, dim] (may alias x), rstd [rows].
template <class T, class W>
void rms_norm_forward(const T* x, const W* w, int64_t rows, int64_t dim, double eps, T* y, memops::acc_t<T>* rstd) {
  using A = memops::acc_t<T>;
  using memops::to_acc;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    A sumsq = A(0);
    for (int64_t d = 0; d < dim; ++d) {
      const A v = to_acc<A>(xr[d]);
      sumsq += v * v;
    }
    const A rs = A(1) / std::sqrt(sumsq / A(dim) + A(eps));
    rstd[r] = rs;
    for (int64_t d = 0; d < dim; ++d) y[r * dim + d] = memops::from_acc<T>(to_acc<A>(xr[d]) * rs * to_acc<A>(w[d]));
  }
}

// Backward from the saved rstd. With n = x * rstd and g = dy * w:
//   dx[r, d] = rstd[r] * (g[r, d] - n[r, d] * mean_d(g[r, :] * n[r, :]))   (written)
//   dw[d]   += sum_r dy[r, d] * n[r, d]                                     (accumulated)
// dx may alias x or dy.
template <class T, class W>
void rms_norm_backward(const T* x, const W* w, const memops::acc_t<T>* rstd, const T* dy, int64_t rows, int64_t dim,
                       T* dx, memops::acc_t<T>* dw) {
  using A = memops::acc_t<T>;
  using memops::to_acc;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const T* dyr = dy + r * dim;
    const A rs = rstd[r];
    A dot = A(0);
    for (int64_t d = 0; d < dim; ++d) dot += to_acc<A>(dyr[d]) * to_acc<A>(w[d]) * (to_acc<A>(xr[d]) * rs);
    const A c = dot / A(dim);
    for (int64_t d = 0; d < dim; ++d) {
      // Read x and dy before writing dx: dx may be x or dy (in place).
      const A n = to_acc<A>(xr[d]) * rs;
      const A dyd = to_acc<A>(dyr[d]);
      const A g = dyd * to_acc<A>(w[d]);
      dx[r * dim + d] = memops::from_acc<T>(rs * (g - n * c));
      dw[d] += dyd * n;
    }
  }
}

}  // namespace slime::ops::cpu
