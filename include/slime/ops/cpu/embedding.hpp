// slime/ops/cpu/embedding.hpp: CPU reference for the token embedding lookup
// and its gradient (summed per row in increasing token order).
#pragma once

#include <cstdint>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/ops/cpu/elementwise.hpp"

namespace slime::ops::cpu {

// Throws unless every id is in [0, vocab), naming the first bad position.
template <class I>
void embedding_check_ids(const I* ids, int64_t tokens, int64_t vocab) {
  for (int64_t t = 0; t < tokens; ++t) {
    SLIME_CHECK(ids[t] >= 0 && int64_t(ids[t]) < vocab, "embedding: ids[", t, "] = ", int64_t(ids[t]),
                " is outside [0, ", vocab, ") (the table has ", vocab, " rows)");
  }
}

// y[t, :] = table[ids[t], :]. ids [tokens], table [vocab, dim], y [tokens, dim].
// Throws for an id outside [0, vocab) before writing anything.
template <class I, class T>
void embedding_forward(const I* ids, const T* table, int64_t tokens, int64_t vocab, int64_t dim, T* y) {
  embedding_check_ids(ids, tokens, vocab);
  for (int64_t t = 0; t < tokens; ++t) {
    const T* row = table + int64_t(ids[t]) * dim;
    for (int64_t d = 0; d < dim; ++d) y[t * dim + d] = row[d];
  }
}

// dtable[v, :] += sum over t with ids[t] == v of dy[t, :] (parameter gradient:
// accumulates). The sum of each row starts at zero and adds dy rows in
// increasing token order in the accumulator type (float, or double when
// G = double); the total is then added to dtable once. The GPU kernel follows
// the same order, so in f32 the two agree bit for bit.
template <class I, class T, class G>
void embedding_backward(const I* ids, const T* dy, int64_t tokens, int64_t vocab, int64_t dim, G* dtable) {
  using A = memops::acc_t<G>;
  embedding_check_ids(ids, tokens, vocab);
  // Counting sort of the token positions by id, stable: each id's positions
  // stay in increasing order.
  std::vector<int64_t> start(std::size_t(vocab) + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) ++start[std::size_t(ids[t]) + 1];
  for (int64_t v = 0; v < vocab; ++v) start[std::size_t(v) + 1] += start[std::size_t(v)];
  std::vector<int64_t> order(static_cast<std::size_t>(tokens));
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < tokens; ++t) order[std::size_t(next[std::size_t(ids[t])]++)] = t;

  std::vector<A> acc(static_cast<std::size_t>(dim));
  for (int64_t v = 0; v < vocab; ++v) {
    const int64_t begin = start[std::size_t(v)], end = start[std::size_t(v) + 1];
    if (begin == end) continue;
    for (int64_t d = 0; d < dim; ++d) acc[std::size_t(d)] = A(0);
    for (int64_t j = begin; j < end; ++j) {
      const T* row = dy + order[std::size_t(j)] * dim;
      for (int64_t d = 0; d < dim; ++d) acc[std::size_t(d)] += memops::to_acc<A>(row[d]);
    }
    G* out = dtable + v * dim;
    for (int64_t d = 0; d < dim; ++d) out[d] = G(memops::to_acc<A>(out[d]) + acc[std::size_t(d)]);
  }
}

}  // namespace slime::ops::cpu
