// slime/ops/cpu/row_ops.hpp: CPU reference of the row ops of ops/row_ops.hpp
// (bias add and its gradient, the 4-tap position-embedding resample and its
// gradient), and the host helper that groups the resample's taps by table row.
//
//   bias_add:      y[r, c] = y[r, c] + b[c]
//   bias_backward: db[c] (+)= sum_r dy[r, c]
//   pos_embed_interpolate_forward:
//                  out[p, d] (+)= sum_k w[k, p] * table[ids[k, p], d]      (k = 0..3)
//   pos_embed_interpolate_backward:
//                  d_table[s, d] += sum over taps (k, p) with ids[k, p] = s of w[k, p] * d_out[p, d]
//
// In the accumulator type A (float; double when T = double) with one rounding
// of each output element. Tap t = k * P + p indexes ids and w ([4, P]).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/ops/cpu/elementwise.hpp"

namespace slime::ops::cpu {

inline constexpr int kPosEmbedTaps = 4;  // bilinear: 2 row taps x 2 column taps

// y [rows, n] += b [n], one add in A rounded once.
template <class T>
void bias_add(T* y, const T* b, int64_t rows, int64_t n) {
  using A = memops::acc_t<T>;
  using memops::to_acc;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) y[r * n + c] = memops::from_acc<T>(to_acc<A>(y[r * n + c]) + to_acc<A>(b[c]));
}

// db [n] = (accumulate ? db : 0) + sum_r dy[r, c], the sum from zero in
// increasing r. rows may be 0 (db = 0, or unchanged when accumulating).
template <class T>
void bias_backward(const T* dy, int64_t rows, int64_t n, memops::acc_t<T>* db, bool accumulate) {
  using A = memops::acc_t<T>;
  std::vector<A> sum(static_cast<std::size_t>(n), A(0));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) sum[static_cast<std::size_t>(c)] += memops::to_acc<A>(dy[r * n + c]);
  for (int64_t c = 0; c < n; ++c)
    db[c] = accumulate ? db[c] + sum[static_cast<std::size_t>(c)] : sum[static_cast<std::size_t>(c)];
}

// The first tap t of ids [4 * P] outside [0, table_rows), or -1.
inline int64_t first_bad_tap(const int32_t* ids, int64_t patches, int64_t table_rows) {
  for (int64_t t = 0; t < kPosEmbedTaps * patches; ++t)
    if (ids[t] < 0 || ids[t] >= table_rows) return t;
  return -1;
}

// Throws slime::Error naming the first tap (k, p) whose id is outside [0, table_rows).
inline void check_pos_embed_ids(const int32_t* ids, int64_t patches, int64_t table_rows, std::string_view op) {
  const int64_t t = first_bad_tap(ids, patches, table_rows);
  SLIME_CHECK(t < 0, op, ": ids[", t / std::max<int64_t>(patches, 1), "][", t % std::max<int64_t>(patches, 1),
              "] = ", t < 0 ? 0 : ids[t], " is outside the table's rows [0, ", table_rows, ")");
}

// out [P, D] = (accumulate ? out : 0) + sum_k w[k, p] * table[ids[k, p]],
// table [S, D], ids and w [4, P]; the sum in A in k order, rounded once.
// Throws for an id outside [0, S) before writing anything.
template <class T>
void pos_embed_interpolate_forward(const T* table, int64_t table_rows, int64_t dim, const int32_t* ids,
                                   const memops::acc_t<T>* w, int64_t patches, T* out, bool accumulate) {
  using A = memops::acc_t<T>;
  using memops::to_acc;
  check_pos_embed_ids(ids, patches, table_rows, "pos_embed_interpolate_forward");
  for (int64_t p = 0; p < patches; ++p)
    for (int64_t d = 0; d < dim; ++d) {
      A acc = accumulate ? to_acc<A>(out[p * dim + d]) : A(0);
      for (int64_t k = 0; k < kPosEmbedTaps; ++k) {
        const int64_t t = k * patches + p;
        acc += w[t] * to_acc<A>(table[int64_t(ids[t]) * dim + d]);
      }
      out[p * dim + d] = memops::from_acc<T>(acc);
    }
}

// d_table [S, D] += for each row s, the sum from zero in increasing tap
// t = k * P + p over the taps with ids[t] = s of w[t] * d_out[p] (added once
// per row, also to rows no tap reads: + 0). Throws for an id outside [0, S)
// before writing anything.
template <class T>
void pos_embed_interpolate_backward(const T* d_out, const int32_t* ids, const memops::acc_t<T>* w, int64_t patches,
                                    int64_t table_rows, int64_t dim, memops::acc_t<T>* d_table) {
  using A = memops::acc_t<T>;
  check_pos_embed_ids(ids, patches, table_rows, "pos_embed_interpolate_backward");
  std::vector<A> sum(static_cast<std::size_t>(table_rows * dim), A(0));
  for (int64_t t = 0; t < kPosEmbedTaps * patches; ++t) {
    const int64_t p = t % patches;
    A* row = sum.data() + int64_t(ids[t]) * dim;
    for (int64_t d = 0; d < dim; ++d) row[d] += w[t] * memops::to_acc<A>(d_out[p * dim + d]);
  }
  for (int64_t i = 0; i < table_rows * dim; ++i) d_table[i] += sum[static_cast<std::size_t>(i)];
}

// The taps grouped by table row (CSR): row s's taps are
// taps[offsets[s] .. offsets[s + 1]) in increasing t = k * P + p, the order of
// pos_embed_interpolate_backward's sums. offsets [S + 1], taps [4 * P].
struct PosEmbedCsr {
  std::vector<int32_t> offsets;
  std::vector<int32_t> taps;
};

// From ids [4 * P] (host); throws for an id outside [0, S) or more than
// 2^31 - 1 taps.
inline PosEmbedCsr pos_embed_csr(std::span<const int32_t> ids, int64_t table_rows) {
  SLIME_CHECK(ids.size() % kPosEmbedTaps == 0, "pos_embed_csr: ids must hold 4 taps per patch, got ", ids.size(),
              " ids");
  SLIME_CHECK(table_rows >= 0, "pos_embed_csr: negative table_rows ", table_rows);
  SLIME_CHECK(ids.size() <= std::size_t(std::numeric_limits<int32_t>::max()), "pos_embed_csr: ", ids.size(),
              " taps exceed the i32 tap index");
  const int64_t patches = int64_t(ids.size()) / kPosEmbedTaps;
  check_pos_embed_ids(ids.data(), patches, table_rows, "pos_embed_csr");
  PosEmbedCsr r;
  r.offsets.assign(static_cast<std::size_t>(table_rows + 1), 0);
  for (int32_t id : ids) ++r.offsets[static_cast<std::size_t>(id) + 1];
  for (std::size_t s = 0; s < static_cast<std::size_t>(table_rows); ++s) r.offsets[s + 1] += r.offsets[s];
  r.taps.resize(ids.size());
  std::vector<int32_t> next(r.offsets.begin(), r.offsets.end() - 1);
  for (std::size_t t = 0; t < ids.size(); ++t)
    r.taps[static_cast<std::size_t>(next[std::size_t(ids[t])]++)] = int32_t(t);
  return r;
}

}  // namespace slime::ops::cpu
