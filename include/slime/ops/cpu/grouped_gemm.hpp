// slime/ops/cpu/grouped_gemm.hpp: CPU reference of the grouped GEMM over
// experts with ragged group sizes (the expert projections of a MoE layer), on
// raw pointers, one linear.hpp GEMM per group.
//
// Accumulation contract: parameter gradients accumulate (`+=`) into fp32
// (double when T = double); activation outputs are written (`=`), or added
// (`+=`) where a function takes `accumulate` and it is true.
//
// Shapes (row-major): x [N, K] with rows grouped by expert, group e being rows
// [offsets[e], offsets[e+1]); W [E, Nout, K] (per expert the HF layout
// out × in); y [N, Nout].
//   forward          y_g  = x_g · W_eᵀ
//   backward_input   dx_g = dy_g · W_e           (or dx_g += dy_g · W_e)
//   backward_weight  dW_e += dy_gᵀ · x_g
// A group with no rows is normal (its dW_e is left as is). Sums in float for
// float/bf16, double for double, rounded once. Deterministic.
#pragma once

#include <cstdint>

#include "slime/ops/cpu/linear.hpp"

namespace slime::ops::cpu {

template <class T, class TOut>
void grouped_gemm_forward(const T* x, const T* w, const int32_t* offsets, int64_t experts, int64_t out_features,
                          int64_t in_features, TOut* y) {
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    gemm_nt(rows, out_features, in_features, x + r0 * in_features, in_features, 1, w + e * out_features * in_features,
            in_features, 1, y + r0 * out_features, out_features, false);
  }
}

template <class T, class TOut>
void grouped_gemm_backward_input(const T* dy, const T* w, const int32_t* offsets, int64_t experts, int64_t out_features,
                                 int64_t in_features, TOut* dx, bool accumulate = false) {
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    gemm_nt(rows, in_features, out_features, dy + r0 * out_features, out_features, 1,
            w + e * out_features * in_features, 1, in_features, dx + r0 * in_features, in_features, accumulate);
  }
}

template <class T>
void grouped_gemm_backward_weight(const T* dy, const T* x, const int32_t* offsets, int64_t experts,
                                  int64_t out_features, int64_t in_features, linear_acc_t<T>* dw) {
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
    gemm_nt(out_features, in_features, rows, dy + r0 * out_features, 1, out_features, x + r0 * in_features, 1,
            in_features, dw + e * out_features * in_features, in_features, true);
  }
}

}  // namespace slime::ops::cpu
