// slime/ops/cpu/linear.hpp: the CPU reference of Linear (y = x·Wᵀ, no bias)
// and its backward, as one cache-blocked GEMM on raw pointers.
//
// Accumulation contract: parameter gradients accumulate (`+=`) into fp32
// (double when T = double); activation outputs are written (`=`), or added
// (`+=`) where a function takes `accumulate` and it is true.
//
// Shapes (row-major, HF layout): x [tokens, in], W [out, in], y [tokens, out].
//   forward          y  [tokens, out] = x · Wᵀ
//   backward_input   dx [tokens, in]  = dy · W        (or dx += dy · W)
//   backward_weight  dW [out, in]    += dyᵀ · x
// Sums run in float for float and bf16 inputs, in double for double (the
// finite-difference tests), and round once into the output. Every size works,
// 0 included (a sum over 0 terms is 0). Single-threaded and deterministic.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "slime/core/macros.hpp"

namespace slime::ops::cpu {

// The type sums run in, and the type of parameter gradients, for inputs T.
template <class T>
using linear_acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

namespace detail {

template <class Acc, class T>
inline Acc linear_to_acc(T v) {
  if constexpr (std::is_arithmetic_v<T>) {
    return Acc(v);
  } else {
    return Acc(float(v));  // BFloat16 / Half: exact widening
  }
}

template <class TOut, class Acc>
inline TOut linear_from_acc(Acc v) {
  if constexpr (std::is_arithmetic_v<TOut>) {
    return TOut(v);
  } else {
    return TOut(float(v));  // one round to nearest even
  }
}

// Block sizes: an MB × PB panel of A and an NB × PB panel of B (64 KiB each in
// float) stay in L2; the MR × NR micro-tile's sums stay in registers. 2 × 8
// measured fastest at -O2 on x86-64 (GCC 12, SSE2 autovectorised): ~33 GFLOP/s
// on one core, [512, 1024] × [1024, 1024] in 0.03 s; 4 × 8 reached 16.
struct GemmBlocking {
  static constexpr int64_t kMB = 64, kNB = 64, kPB = 256;
  static constexpr int kMR = 2, kNR = 8;
  static_assert(kMB % kMR == 0 && kNB % kNR == 0, "block sizes must be multiples of the micro-tile");
};

// tile[r][j] += Σ_p a[p][r] · b[p][j] over a packed MR-row micro-panel of A and
// NR-column micro-panel of B ([pb][MR] and [pb][NR]). Not inlined: inlined into
// gemm_nt, GCC 12 -O2 keeps `sum` in memory and runs 3x slower. Compiled at -O2
// whatever the build's level (GCC): at -O0 (the sanitizer build, a user's
// Debug build) this loop is 88% of a CPU training step and runs 2.5x slower
// than at -O1; -O2 changes no result (each sum still adds in p order, and x86-64
// has no FMA to contract into without -mfma).
template <class Acc, int MR, int NR>
[[gnu::noinline]] SLIME_CPU_HOT_LOOP void gemm_micro_tile(const Acc* a, const Acc* b, int64_t pb, Acc* tile, int64_t ld_tile) {
  Acc sum[MR][NR] = {};
  for (int64_t p = 0; p < pb; ++p) {
    const Acc* ap = a + p * MR;
    const Acc* bp = b + p * NR;
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j) sum[r][j] += ap[r] * bp[j];
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) tile[r * ld_tile + j] += sum[r][j];
}

// Copies rows [r0, r0 + rows) and reduction indices [p0, p0 + pb) of the
// strided operand X(r, p) = x[r·row_stride + p·red_stride] into micro-panels of
// R rows: out[(i / R)·pb·R + p·R + i % R], converted to Acc; rows past `rows`
// up to a multiple of R are zero.
template <class Acc, int R, class T>
void gemm_pack(const T* x, int64_t row_stride, int64_t red_stride, int64_t r0, int64_t rows, int64_t p0, int64_t pb,
               Acc* out) {
  const int64_t padded = (rows + R - 1) / R * R;
  auto at = [&](int64_t i, int64_t p) -> Acc& { return out[(i / R) * pb * R + p * R + i % R]; };
  if (red_stride == 1 || row_stride != 1) {
    for (int64_t i = 0; i < rows; ++i) {
      const T* src = x + (r0 + i) * row_stride + p0 * red_stride;
      for (int64_t p = 0; p < pb; ++p) at(i, p) = linear_to_acc<Acc>(src[p * red_stride]);
    }
  } else {  // rows are contiguous: walk them innermost
    for (int64_t p = 0; p < pb; ++p) {
      const T* src = x + r0 + (p0 + p) * red_stride;
      for (int64_t i = 0; i < rows; ++i) at(i, p) = linear_to_acc<Acc>(src[i]);
    }
  }
  for (int64_t i = rows; i < padded; ++i)
    for (int64_t p = 0; p < pb; ++p) at(i, p) = Acc(0);
}

}  // namespace detail

// The one GEMM under every Linear: for m < M, n < N,
//   C[m·ldc + n] = Σ_{p < P} A(m, p) · B(n, p)        (accumulate = false)
//   C[m·ldc + n] = C[m·ldc + n] + Σ_p A(m, p) · B(n, p)  (accumulate = true)
// with A(m, p) = a[m·a_row + p·a_red] and B(n, p) = b[n·b_row + p·b_red]: any
// strides, so transposed operands need no copy. The sum runs in
// linear_acc_t<T> and is rounded once into TC. C must not overlap A or B.
template <class T, class TC>
void gemm_nt(int64_t M, int64_t N, int64_t P, const T* a, int64_t a_row, int64_t a_red, const T* b, int64_t b_row,
             int64_t b_red, TC* c, int64_t ldc, bool accumulate) {
  using Acc = linear_acc_t<T>;
  using B = detail::GemmBlocking;
  if (M <= 0 || N <= 0) return;
  std::vector<Acc> a_pack(std::size_t(B::kMB * B::kPB)), b_pack(std::size_t(B::kNB * B::kPB));
  std::vector<Acc> tile(std::size_t(B::kMB * B::kNB));
  for (int64_t m0 = 0; m0 < M; m0 += B::kMB) {
    const int64_t mb = std::min(B::kMB, M - m0);
    for (int64_t n0 = 0; n0 < N; n0 += B::kNB) {
      const int64_t nb = std::min(B::kNB, N - n0);
      std::fill(tile.begin(), tile.end(), Acc(0));
      for (int64_t p0 = 0; p0 < P; p0 += B::kPB) {
        const int64_t pb = std::min(B::kPB, P - p0);
        detail::gemm_pack<Acc, B::kMR>(a, a_row, a_red, m0, mb, p0, pb, a_pack.data());
        detail::gemm_pack<Acc, B::kNR>(b, b_row, b_red, n0, nb, p0, pb, b_pack.data());
        for (int64_t i = 0; i < mb; i += B::kMR)
          for (int64_t j = 0; j < nb; j += B::kNR)
            detail::gemm_micro_tile<Acc, B::kMR, B::kNR>(a_pack.data() + i * pb, b_pack.data() + j * pb, pb,
                                                         tile.data() + i * B::kNB + j, B::kNB);
      }
      for (int64_t i = 0; i < mb; ++i) {
        TC* row = c + (m0 + i) * ldc + n0;
        const Acc* sums = tile.data() + i * B::kNB;
        for (int64_t j = 0; j < nb; ++j)
          row[j] = accumulate ? detail::linear_from_acc<TC>(detail::linear_to_acc<Acc>(row[j]) + sums[j])
                              : detail::linear_from_acc<TC>(sums[j]);
      }
    }
  }
}

// y [tokens, out] = x [tokens, in] · W [out, in]ᵀ. TOut is T or float.
template <class T, class TOut>
void linear_forward(const T* x, const T* w, int64_t tokens, int64_t in_features, int64_t out_features, TOut* y) {
  gemm_nt(tokens, out_features, in_features, x, in_features, 1, w, in_features, 1, y, out_features, false);
}

// dx [tokens, in] = dy [tokens, out] · W [out, in]; with accumulate, dx += dy · W
// (the sum is added to dx in Acc and rounded once).
template <class T, class TOut>
void linear_backward_input(const T* dy, const T* w, int64_t tokens, int64_t in_features, int64_t out_features, TOut* dx,
                           bool accumulate = false) {
  gemm_nt(tokens, in_features, out_features, dy, out_features, 1, w, 1, in_features, dx, in_features, accumulate);
}

// dW [out, in] += dy [tokens, out]ᵀ · x [tokens, in], in fp32 (double for T = double).
template <class T>
void linear_backward_weight(const T* dy, const T* x, int64_t tokens, int64_t in_features, int64_t out_features,
                            linear_acc_t<T>* dw) {
  gemm_nt(out_features, in_features, tokens, dy, 1, out_features, x, 1, in_features, dw, in_features, true);
}

}  // namespace slime::ops::cpu
