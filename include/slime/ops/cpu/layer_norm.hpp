// slime/ops/cpu/layer_norm.hpp: CPU reference for LayerNorm over the last
// dim with weight and bias, forward and backward.
//
//   mean[r] = mean_d(x[r, d])
//   rstd[r] = 1 / sqrt(mean_d((x[r, d] - mean[r])^2) + eps)      (biased variance)
//   y[r, d] = (x[r, d] - mean[r]) * rstd[r] * w[d] + b[d]
//
// In the accumulator type A (float; double when T = double): eps is rounded to
// A first, as torch adds a Python float to an fp32 tensor.
#pragma once

#include <cmath>
#include <cstdint>

#include "slime/ops/cpu/elementwise.hpp"

namespace slime::ops::cpu {

// x [rows, dim], w [dim], b [dim] -> y [rows, dim] (may alias x), mean [rows],
// rstd [rows].
template <class T, class W>
void layer_norm_forward(const T* x, const W* w, const W* b, int64_t rows, int64_t dim, double eps, T* y,
                        memops::acc_t<T>* mean, memops::acc_t<T>* rstd) {
  using A = memops::acc_t<T>;
  using memops::to_acc;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    A sum = A(0);
    for (int64_t d = 0; d < dim; ++d) sum += to_acc<A>(xr[d]);
    const A mu = sum / A(dim);
    A sumsq = A(0);
    for (int64_t d = 0; d < dim; ++d) {
      const A c = to_acc<A>(xr[d]) - mu;
      sumsq += c * c;
    }
    const A rs = A(1) / std::sqrt(sumsq / A(dim) + A(eps));
    mean[r] = mu;
    rstd[r] = rs;
    for (int64_t d = 0; d < dim; ++d)
      y[r * dim + d] = memops::from_acc<T>((to_acc<A>(xr[d]) - mu) * rs * to_acc<A>(w[d]) + to_acc<A>(b[d]));
  }
}

// Backward from the saved mean and rstd. With n = (x - mean) * rstd and
// g = dy * w:
//   dx[r, d] = rstd[r] * (g[r, d] - mean_d(g[r, :]) - n[r, d] * mean_d(g[r, :] * n[r, :]))   (written)
//   dw[d]   += sum_r dy[r, d] * n[r, d]                                                   (accumulated)
//   db[d]   += sum_r dy[r, d]                                                             (accumulated)
// dx may alias x or dy.
template <class T, class W>
void layer_norm_backward(const T* x, const W* w, const memops::acc_t<T>* mean, const memops::acc_t<T>* rstd,
                         const T* dy, int64_t rows, int64_t dim, T* dx, memops::acc_t<T>* dw, memops::acc_t<T>* db) {
  using A = memops::acc_t<T>;
  using memops::to_acc;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * dim;
    const T* dyr = dy + r * dim;
    const A mu = mean[r], rs = rstd[r];
    A sum_g = A(0), sum_gn = A(0);
    for (int64_t d = 0; d < dim; ++d) {
      const A g = to_acc<A>(dyr[d]) * to_acc<A>(w[d]);
      sum_g += g;
      sum_gn += g * ((to_acc<A>(xr[d]) - mu) * rs);
    }
    const A c1 = sum_g / A(dim), c2 = sum_gn / A(dim);
    for (int64_t d = 0; d < dim; ++d) {
      // Read x and dy before writing dx: dx may be x or dy (in place).
      const A n = (to_acc<A>(xr[d]) - mu) * rs;
      const A dyd = to_acc<A>(dyr[d]);
      const A g = dyd * to_acc<A>(w[d]);
      dx[r * dim + d] = memops::from_acc<T>(rs * (g - c1 - n * c2));
      dw[d] += dyd * n;
      db[d] += dyd;
    }
  }
}

}  // namespace slime::ops::cpu
