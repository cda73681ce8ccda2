// slime/ops/cpu/moe_permute.hpp: CPU reference of the MoE token layout:
// grouping the T·k token copies (token t, slot j) by expert, the permute
// (gather) and unpermute (weighted scatter-sum) and their backwards, on raw
// pointers.
//
// Accumulation contract: parameter gradients accumulate (`+=`) in fp32 (none
// here); activation gradients are written (`=`), or added (`+=`) where a
// function takes `accumulate` and it is true.
//
// Layout (N = tokens · k copies; copy c = t · k + j is token t's j-th choice):
//   counts[e]        copies routed to expert e
//   offsets[e]       Σ_{f < e} counts[f]; offsets[E] = N (E + 1 entries)
//   row_to_copy[r]   the copy in grouped row r
//   copy_to_row[c]   the grouped row of copy c (the inverse permutation)
// Rows of a group are ordered by copy index, i.e. by (token, slot): the
// grouping is a stable counting sort by (expert, token, slot), deterministic.
// Sums over the k slots of a token run in slot order j = 0..k−1 in the
// accumulator type (float for float/bf16, double for double) and round once.
#pragma once

#include <cstdint>

#include "slime/ops/cpu/elementwise.hpp"

namespace slime::ops::cpu {

// Builds the layout from indices [tokens, k] (every id in [0, experts)).
inline void moe_build_layout(const int32_t* indices, int64_t tokens, int64_t k, int64_t experts, int32_t* counts,
                             int32_t* offsets, int32_t* row_to_copy, int32_t* copy_to_row) {
  const int64_t n = tokens * k;
  for (int64_t e = 0; e < experts; ++e) counts[e] = 0;
  for (int64_t c = 0; c < n; ++c) ++counts[indices[c]];
  offsets[0] = 0;
  for (int64_t e = 0; e < experts; ++e) offsets[e + 1] = offsets[e] + counts[e];
  // Place the copies in order: copy c of expert e goes to offsets[e] + (the
  // copies of e placed before it), counted again in counts.
  for (int64_t e = 0; e < experts; ++e) counts[e] = 0;
  for (int64_t c = 0; c < n; ++c) {
    const int32_t e = indices[c];
    const int32_t r = offsets[e] + counts[e]++;
    row_to_copy[r] = int32_t(c);
    copy_to_row[c] = r;
  }
}

// x_grouped[r, :] = x[row_to_copy[r] / k, :] for r < tokens · k.
template <class T>
void moe_permute_forward(const T* x, const int32_t* row_to_copy, int64_t tokens, int64_t k, int64_t hidden,
                         T* x_grouped) {
  for (int64_t r = 0; r < tokens * k; ++r) {
    const T* src = x + (row_to_copy[r] / k) * hidden;
    T* dst = x_grouped + r * hidden;
    for (int64_t h = 0; h < hidden; ++h) dst[h] = src[h];
  }
}

// dx[t, :] = Σ_j dx_grouped[copy_to_row[t·k + j], :] (= or += with accumulate).
template <class T, class TOut>
void moe_permute_backward(const T* dx_grouped, const int32_t* copy_to_row, int64_t tokens, int64_t k, int64_t hidden,
                          TOut* dx, bool accumulate = false) {
  using A = memops::acc_t<T>;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h) {
      A s = accumulate ? memops::to_acc<A>(dx[t * hidden + h]) : A(0);
      for (int64_t j = 0; j < k; ++j) s += memops::to_acc<A>(dx_grouped[copy_to_row[t * k + j] * hidden + h]);
      dx[t * hidden + h] = memops::from_acc<TOut>(s);
    }
}

// y[t, :] = Σ_j weights[t, j] · y_grouped[copy_to_row[t·k + j], :] (written).
template <class T, class TW, class TOut>
void moe_unpermute_forward(const T* y_grouped, const TW* weights, const int32_t* copy_to_row, int64_t tokens, int64_t k,
                           int64_t hidden, TOut* y) {
  using A = memops::acc_t<T>;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h) {
      A s = 0;
      for (int64_t j = 0; j < k; ++j)
        s += memops::to_acc<A>(weights[t * k + j]) * memops::to_acc<A>(y_grouped[copy_to_row[t * k + j] * hidden + h]);
      y[t * hidden + h] = memops::from_acc<TOut>(s);
    }
}

// dy_grouped[copy_to_row[c], :] = weights[c] · dy[t, :]                (written)
// dweights[c] = Σ_h dy[t, h] · y_grouped[copy_to_row[c], h]           (written)
// for every copy c = t·k + j.
template <class T, class TW>
void moe_unpermute_backward(const T* dy, const T* y_grouped, const TW* weights, const int32_t* copy_to_row,
                            int64_t tokens, int64_t k, int64_t hidden, T* dy_grouped, TW* dweights) {
  using A = memops::acc_t<T>;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t c = t * k + j, r = copy_to_row[c];
      const A w = memops::to_acc<A>(weights[c]);
      A dot = 0;
      for (int64_t h = 0; h < hidden; ++h) {
        const A d = memops::to_acc<A>(dy[t * hidden + h]);
        dy_grouped[r * hidden + h] = memops::from_acc<T>(w * d);
        dot += d * memops::to_acc<A>(y_grouped[r * hidden + h]);
      }
      dweights[c] = memops::from_acc<TW>(dot);
    }
}

}  // namespace slime::ops::cpu
