// slime/comm/detail_reduce.hpp: LocalComm's accumulation rule for one element,
// shared by the CPU fold (src/comm/local_comm.cpp) and the CUDA kernel
// (src/comm/local_comm_cuda.cu) so that the two give the same bits.
//
// The rule (see slime/comm/local_comm.hpp): ranks folded in the order 0, 1,
// ..., n-1; floating types accumulate in f32 and round once to the storage
// type (avg divides the f32 sum by n first); integers accumulate in their own
// type, sums wrapping modulo 2^bits; max and min return the first NaN they
// meet. NaN is tested as `x != x`, which both compilers keep (no fast-math).
#pragma once

#include <cstdint>
#include <type_traits>

#include "slime/comm/comm.hpp"
#include "slime/core/macros.hpp"

namespace slime::comm::detail {

// Combine policies: combine(acc, x) folds the next rank's value x into acc.
struct ReduceSum {
  template <class A>
  SLIME_HOST_DEVICE static A combine(A a, A b) {
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<A>;
      return A(U(a) + U(b));  // unsigned arithmetic wraps; back to A is modular (C++20)
    } else {
      return a + b;
    }
  }
};

struct ReduceMax {
  template <class A>
  SLIME_HOST_DEVICE static A combine(A a, A b) {
    if constexpr (std::is_integral_v<A>) {
      return b > a ? b : a;
    } else {
      return a != a ? a : (b != b || b > a) ? b : a;
    }
  }
};

struct ReduceMin {
  template <class A>
  SLIME_HOST_DEVICE static A combine(A a, A b) {
    if constexpr (std::is_integral_v<A>) {
      return b < a ? b : a;
    } else {
      return a != a ? a : (b != b || b < a) ? b : a;
    }
  }
};

// Element i of the reduction over `ranks` inputs, each a `const T*` of at
// least i + 1 elements, folded with Combine in rank order.
template <class T, class Combine>
SLIME_HOST_DEVICE T reduce_over_ranks(const void* const* inputs, int ranks, int64_t i, bool average) {
  using Acc = std::conditional_t<std::is_integral_v<T>, T, float>;
  Acc acc = Acc(static_cast<const T*>(inputs[0])[i]);
  for (int r = 1; r < ranks; ++r) acc = Combine::combine(acc, Acc(static_cast<const T*>(inputs[r])[i]));
  if constexpr (!std::is_integral_v<T>) {
    if (average) acc /= float(ranks);
  }
  return T(acc);
}

// Calls f(Combine{}, average) for `op` on elements of type T; throws for avg
// of an integer type (Comm::check_reducible rejects it first).
template <class T, class F>
void visit_reduce_op(ReduceOp op, F&& f) {
  switch (op) {
    case ReduceOp::sum:
      return f(ReduceSum{}, false);
    case ReduceOp::avg:
      if constexpr (std::is_integral_v<T>) {
        SLIME_FAIL("LocalComm: avg reduction of ", dtype_name(dtype_of<T>), " is not supported");
      } else {
        return f(ReduceSum{}, true);
      }
    case ReduceOp::max:
      return f(ReduceMax{}, false);
    case ReduceOp::min:
      return f(ReduceMin{}, false);
  }
  SLIME_FAIL("LocalComm: invalid reduce op ", int(op));
}

}  // namespace slime::comm::detail
