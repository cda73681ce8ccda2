// CUDA kernels of slime/ops/moe_permute.hpp (launchers declared in
// slime/ops/cuda/moe_permute.hpp).
//
// Layout (deterministic, the CPU's bit for bit):
//   1. counts = 0 (memset); layout_keys_kernel: keys[c] = indices[c] (E when
//      outside [0, E)), vals[c] = c, and a shared-memory histogram of the
//      valid ids added to counts with integer atomics (exact);
//   2. cub::DeviceRadixSort::SortPairs over the key bits that occur (stable:
//      each expert's copies stay in copy order) straight into row_to_copy;
//   3. layout_offsets_kernel: one warp scans counts into offsets;
//   4. layout_inverse_kernel: copy_to_row[row_to_copy[r]] = r.
// Workspace: keys in and out and values in (4 N bytes each) and CUB's
// temporary storage, each 256-byte aligned.
//
// Permute / unpermute: one block per token (grid-stride), threads over the
// 16-byte vectors of a row, token t's k grouped rows found through
// copy_to_row; sums over the slots in slot order with IEEE fp32 adds and
// multiplies (__fadd_rn / __fmul_rn: no FMA contraction), so they equal the
// CPU reference bit for bit. The unpermute backward's dweights are block
// reductions (fixed order; not the CPU's order).
//
// Bytes moved (the two numbers; FLOPs negligible), e = element size, N = T k:
//   permute forward   read T H e, write N H e
//   permute backward  read N H e, write T H e' (e' the output's)
//   unpermute forward read N H e, write T H e'
//   unpermute backward read T H e + N H e, write N H e
// (plus the i32 layout and the weights, O(N)).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <initializer_list>
#include <type_traits>

#include "memops.cuh"
#include "ptx.cuh"
#include "slime/core/half.hpp"
#include "slime/ops/cuda/moe_permute.hpp"

namespace slime::ops::cuda {
namespace {

using namespace ::slime::ops::detail::memops;
using ::slime::ops::detail::ptx::warp_inclusive_scan;
using ::slime::ops::detail::ptx::warp_sum;

constexpr int kThreads = 128;  // per token block
constexpr int kWarps = kThreads / 32;
constexpr int kLayoutThreads = 256;
constexpr int kDotSlots = 8;  // dweights reduced 8 slots at a time (one pass when k <= 8)

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// ---- layout --------------------------------------------------------------------

__global__ void __launch_bounds__(kLayoutThreads)
    layout_keys_kernel(const int32_t* indices, int64_t n, int E, uint32_t* keys, int32_t* vals, int32_t* counts) {
  extern __shared__ int hist[];  // [E]
  for (int e = threadIdx.x; e < E; e += kLayoutThreads) hist[e] = 0;
  __syncthreads();
  for (int64_t c = blockIdx.x * int64_t(kLayoutThreads) + threadIdx.x; c < n;
       c += int64_t(gridDim.x) * kLayoutThreads) {
    const int32_t id = indices[c];
    const bool valid = id >= 0 && id < E;
    keys[c] = valid ? uint32_t(id) : uint32_t(E);
    vals[c] = int32_t(c);
    if (valid) atomicAdd(&hist[id], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kLayoutThreads)
    if (hist[e] != 0) atomicAdd(&counts[e], hist[e]);
}

// One warp: offsets[0] = 0, offsets[e + 1] = offsets[e] + counts[e].
__global__ void layout_offsets_kernel(const int32_t* counts, int E, int32_t* offsets) {
  const int lane = threadIdx.x;
  int carry = 0;
  if (lane == 0) offsets[0] = 0;
  for (int base = 0; base < E; base += 32) {
    const int e = base + lane;
    const int v = warp_inclusive_scan(e < E ? counts[e] : 0, lane);
    if (e < E) offsets[e + 1] = carry + v;
    carry += __shfl_sync(0xffffffffu, v, 31);
  }
}

__global__ void __launch_bounds__(kLayoutThreads)
    layout_inverse_kernel(const int32_t* row_to_copy, int64_t n, int32_t* copy_to_row) {
  for (int64_t r = blockIdx.x * int64_t(kLayoutThreads) + threadIdx.x; r < n; r += int64_t(gridDim.x) * kLayoutThreads)
    copy_to_row[row_to_copy[r]] = int32_t(r);
}

// Bits that hold every key 0..E (E is the key of an id outside [0, E)).
int key_bits(int64_t experts) {
  int bits = 1;
  while (bits < 32 && (int64_t(1) << bits) <= experts) ++bits;
  return bits;
}

std::size_t cub_temp_bytes(int64_t n, int end_bit) {
  std::size_t bytes = 0;
  SLIME_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), int(n), 0, end_bit));
  return bytes;
}

struct LayoutWorkspace {
  std::size_t array_bytes;  // one of keys in, keys out, values in
  std::size_t temp_bytes;   // CUB's, for a full 32-bit sort (at least any narrower one's)
  std::size_t total() const { return 3 * array_bytes + temp_bytes; }
};

LayoutWorkspace layout_workspace(int64_t n) {
  LayoutWorkspace w;
  w.array_bytes = round_up(std::size_t(n) * 4, 256);
  w.temp_bytes = n == 0 ? 0 : round_up(cub_temp_bytes(n, 32), 256);
  return w;
}

// ---- permute / unpermute -------------------------------------------------------

// Rows [0, valid) hold copies of valid expert ids: min(offsets[E], N), at least 0.
__device__ __forceinline__ int64_t valid_rows(const MoeLayoutView& l) {
  const int64_t n = l.tokens * l.k, v = l.offsets[l.experts];
  return v < 0 ? 0 : (v < n ? v : n);
}

template <class T, int N>
__device__ __forceinline__ Vec<T, N> zero_vec() {
  Vec<T, N> z;
#pragma unroll
  for (int i = 0; i < N; ++i) z.v[i] = from_float<T>(0.f);
  return z;
}

template <class T, int N>
__global__ void __launch_bounds__(kThreads)
    permute_forward_kernel(const MoeLayoutView l, const T* __restrict__ x, int64_t hidden, T* __restrict__ xg) {
  const int64_t nv = valid_rows(l), n = l.tokens * l.k, vecs = hidden / N;
  for (int64_t t = blockIdx.x; t < l.tokens; t += gridDim.x) {
    const int32_t* rows = l.copy_to_row + t * l.k;
    for (int64_t v = threadIdx.x; v < vecs; v += kThreads) {
      const Vec<T, N> xv = load_vec<T, N>(x + t * hidden, v);
#pragma unroll 8
      for (int64_t j = 0; j < l.k; ++j) {
        const int64_t r = rows[j];
        if (r >= 0 && r < nv) {
          store_vec<T, N>(xg + r * hidden, v, xv);
        } else if (r >= 0 && r < n) {
          store_vec<T, N>(xg + r * hidden, v, zero_vec<T, N>());  // a dropped copy
        }
      }
    }
  }
}

template <class T, class TOut, int N>
__global__ void __launch_bounds__(kThreads)
    permute_backward_kernel(const MoeLayoutView l, const T* __restrict__ dxg, int64_t hidden, TOut* __restrict__ dx,
                            bool accumulate) {
  const int64_t nv = valid_rows(l), vecs = hidden / N;
  for (int64_t t = blockIdx.x; t < l.tokens; t += gridDim.x) {
    const int32_t* rows = l.copy_to_row + t * l.k;
    for (int64_t v = threadIdx.x; v < vecs; v += kThreads) {
      float acc[N];
      if (accumulate) {
        const Vec<TOut, N> old = load_vec<TOut, N>(dx + t * hidden, v);
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = to_float(old.v[i]);
      } else {
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = 0.f;
      }
#pragma unroll 8
      for (int64_t j = 0; j < l.k; ++j) {
        const int64_t r = rows[j];
        if (r < 0 || r >= nv) continue;
        const Vec<T, N> g = load_vec<T, N>(dxg + r * hidden, v);
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = __fadd_rn(acc[i], to_float(g.v[i]));
      }
      Vec<TOut, N> out;
#pragma unroll
      for (int i = 0; i < N; ++i) out.v[i] = from_float<TOut>(acc[i]);
      store_vec<TOut, N>(dx + t * hidden, v, out);
    }
  }
}

template <class T, class TW, class TOut, int N>
__global__ void __launch_bounds__(kThreads)
    unpermute_forward_kernel(const MoeLayoutView l, const T* __restrict__ yg, const TW* __restrict__ weights,
                             int64_t hidden, TOut* __restrict__ y) {
  const int64_t nv = valid_rows(l), vecs = hidden / N;
  for (int64_t t = blockIdx.x; t < l.tokens; t += gridDim.x) {
    const int32_t* rows = l.copy_to_row + t * l.k;
    const TW* w = weights + t * l.k;
    for (int64_t v = threadIdx.x; v < vecs; v += kThreads) {
      float acc[N];
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = 0.f;
#pragma unroll 8
      for (int64_t j = 0; j < l.k; ++j) {
        const int64_t r = rows[j];
        if (r < 0 || r >= nv) continue;
        const float wj = to_float(w[j]);
        const Vec<T, N> g = load_vec<T, N>(yg + r * hidden, v);
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(wj, to_float(g.v[i])));
      }
      Vec<TOut, N> out;
#pragma unroll
      for (int i = 0; i < N; ++i) out.v[i] = from_float<TOut>(acc[i]);
      store_vec<TOut, N>(y + t * hidden, v, out);
    }
  }
}

template <class T, class TW, int N>
__global__ void __launch_bounds__(kThreads)
    unpermute_backward_kernel(const MoeLayoutView l, const T* __restrict__ dy, const T* __restrict__ yg,
                              const TW* __restrict__ weights, int64_t hidden, T* __restrict__ dyg,
                              TW* __restrict__ dweights) {
  __shared__ float scratch[kWarps][kDotSlots];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t nv = valid_rows(l), n = l.tokens * l.k, vecs = hidden / N;
  for (int64_t t = blockIdx.x; t < l.tokens; t += gridDim.x) {
    const int32_t* rows = l.copy_to_row + t * l.k;
    const TW* w = weights + t * l.k;
    for (int64_t j0 = 0; j0 < l.k; j0 += kDotSlots) {
      const int slots = int(l.k - j0 < kDotSlots ? l.k - j0 : kDotSlots);
      float dot[kDotSlots];
#pragma unroll
      for (int s = 0; s < kDotSlots; ++s) dot[s] = 0.f;
      for (int64_t v = threadIdx.x; v < vecs; v += kThreads) {
        const Vec<T, N> d = load_vec<T, N>(dy + t * hidden, v);
#pragma unroll
        for (int s = 0; s < kDotSlots; ++s) {
          if (s >= slots) break;
          const int64_t r = rows[j0 + s];
          if (r >= 0 && r < nv) {
            const float wj = to_float(w[j0 + s]);
            const Vec<T, N> g = load_vec<T, N>(yg + r * hidden, v);
            Vec<T, N> out;
#pragma unroll
            for (int i = 0; i < N; ++i) {
              const float df = to_float(d.v[i]);
              out.v[i] = from_float<T>(__fmul_rn(wj, df));
              dot[s] = fmaf(df, to_float(g.v[i]), dot[s]);
            }
            store_vec<T, N>(dyg + r * hidden, v, out);
          } else if (r >= 0 && r < n) {
            store_vec<T, N>(dyg + r * hidden, v, zero_vec<T, N>());  // a dropped copy
          }
        }
      }
      // Block sums of the slots' dot products, in a fixed order.
#pragma unroll
      for (int s = 0; s < kDotSlots; ++s) dot[s] = warp_sum(dot[s]);
      __syncthreads();  // the previous pass's reads of scratch are over
      if (lane == 0)
#pragma unroll
        for (int s = 0; s < kDotSlots; ++s) scratch[warp][s] = dot[s];
      __syncthreads();
      if (threadIdx.x < slots) {
        float s = 0.f;
#pragma unroll
        for (int q = 0; q < kWarps; ++q) s += scratch[q][threadIdx.x];
        dweights[t * l.k + j0 + threadIdx.x] = from_float<TW>(s);
      }
    }
  }
}

// ---- dispatch ------------------------------------------------------------------

template <class F>
void with_type(DType t, const char* what, F&& f) {
  if (t == DType::f32) {
    f(float{});
  } else if (t == DType::bf16) {
    f(BFloat16{});
  } else {
    SLIME_FAIL("moe_permute: ", what, " must be f32 or bf16, got ", dtype_name(t));
  }
}

// The output type of a sum over rows of T: T itself or float.
template <class T, class F>
void with_out_type(DType out, F&& f) {
  if (out == DType::f32) {
    f(float{});
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    SLIME_CHECK(out == DType::bf16, "moe_permute: output must be bf16 or f32, got ", dtype_name(out));
    f(BFloat16{});
  } else {
    SLIME_FAIL("moe_permute: an f32 input needs an f32 output, got ", dtype_name(out));
  }
}

// 16-byte vectors of T when hidden and every row pointer allow them: calls
// f(std::integral_constant<int, N>) with N = 16 / sizeof(T) or 1.
template <class T, class F>
void with_vec(int64_t hidden, std::initializer_list<std::pair<const void*, std::size_t>> ptrs, F&& f) {
  constexpr int kVec = 16 / sizeof(T);
  bool ok = hidden % kVec == 0;
  for (auto [p, elem] : ptrs) ok = ok && aligned(p, 16) && (hidden * int64_t(elem)) % 16 == 0;
  if (ok) {
    f(std::integral_constant<int, kVec>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

unsigned token_blocks(int64_t tokens) { return unsigned(std::clamp<int64_t>(tokens, 1, int64_t(1) << 20)); }

}  // namespace

std::size_t moe_layout_workspace_bytes(int64_t tokens, int64_t k, int64_t experts) {
  (void)experts;
  return layout_workspace(tokens * k).total();
}

void moe_build_layout(const MoeLayoutParams& p, StreamHandle stream) {
  const int64_t n = p.tokens * p.k;
  const int E = int(p.experts);
  SLIME_CHECK(p.experts >= 1 && p.experts <= kMoeLayoutMaxExperts, "moe_build_layout: the CUDA path takes 1 to ",
              kMoeLayoutMaxExperts, " experts, got ", p.experts);
  const LayoutWorkspace w = layout_workspace(n);
  SLIME_CHECK(n == 0 || (p.workspace != nullptr && p.workspace_bytes >= w.total()), "moe_build_layout: workspace of ",
              p.workspace_bytes, " bytes, needs ", w.total(), " (moe_layout_workspace_bytes)");
  SLIME_CUDA_CHECK(cudaMemsetAsync(p.counts, 0, std::size_t(E) * 4, stream));
  if (n > 0) {
    auto* base = static_cast<char*>(p.workspace);
    auto* keys_in = reinterpret_cast<uint32_t*>(base);
    auto* keys_out = reinterpret_cast<uint32_t*>(base + w.array_bytes);
    auto* vals_in = reinterpret_cast<int32_t*>(base + 2 * w.array_bytes);
    void* temp = base + 3 * w.array_bytes;
    layout_keys_kernel<<<grid_1d(n, kLayoutThreads, 1024), kLayoutThreads, std::size_t(E) * 4, stream>>>(
        p.indices, n, E, keys_in, vals_in, p.counts);
    SLIME_CUDA_CHECK_LAUNCH();
    int end_bit = key_bits(p.experts);
    if (cub_temp_bytes(n, end_bit) > w.temp_bytes) end_bit = 32;
    std::size_t temp_bytes = w.temp_bytes;
    SLIME_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, vals_in, p.row_to_copy,
                                                     int(n), 0, end_bit, stream));
  }
  layout_offsets_kernel<<<1, 32, 0, stream>>>(p.counts, E, p.offsets);
  SLIME_CUDA_CHECK_LAUNCH();
  if (n > 0) {
    layout_inverse_kernel<<<grid_1d(n, kLayoutThreads, 4096), kLayoutThreads, 0, stream>>>(p.row_to_copy, n,
                                                                                           p.copy_to_row);
    SLIME_CUDA_CHECK_LAUNCH();
  }
}

void moe_permute_forward(const MoeLayoutView& l, const void* x, DType dtype, int64_t hidden, void* x_grouped,
                         StreamHandle stream) {
  if (l.tokens == 0 || hidden == 0) return;
  with_type(dtype, "x", [&](auto tag) {
    using T = decltype(tag);
    with_vec<T>(hidden, {{x, sizeof(T)}, {x_grouped, sizeof(T)}}, [&](auto vec) {
      permute_forward_kernel<T, decltype(vec)::value><<<token_blocks(l.tokens), kThreads, 0, stream>>>(
          l, static_cast<const T*>(x), hidden, static_cast<T*>(x_grouped));
    });
  });
  SLIME_CUDA_CHECK_LAUNCH();
}

void moe_permute_backward(const MoeLayoutView& l, const void* dx_grouped, DType dtype, int64_t hidden, void* dx,
                          DType out_dtype, bool accumulate, StreamHandle stream) {
  if (l.tokens == 0 || hidden == 0) return;
  with_type(dtype, "dx_grouped", [&](auto tag) {
    using T = decltype(tag);
    with_out_type<T>(out_dtype, [&](auto out_tag) {
      using TOut = decltype(out_tag);
      with_vec<T>(hidden, {{dx_grouped, sizeof(T)}, {dx, sizeof(TOut)}}, [&](auto vec) {
        permute_backward_kernel<T, TOut, decltype(vec)::value><<<token_blocks(l.tokens), kThreads, 0, stream>>>(
            l, static_cast<const T*>(dx_grouped), hidden, static_cast<TOut*>(dx), accumulate);
      });
    });
  });
  SLIME_CUDA_CHECK_LAUNCH();
}

void moe_unpermute_forward(const MoeLayoutView& l, const void* y_grouped, DType dtype, const void* weights,
                           DType weights_dtype, int64_t hidden, void* y, DType out_dtype, StreamHandle stream) {
  if (l.tokens == 0 || hidden == 0) return;
  with_type(dtype, "y_grouped", [&](auto tag) {
    using T = decltype(tag);
    with_type(weights_dtype, "weights", [&](auto w_tag) {
      using TW = decltype(w_tag);
      with_out_type<T>(out_dtype, [&](auto out_tag) {
        using TOut = decltype(out_tag);
        with_vec<T>(hidden, {{y_grouped, sizeof(T)}, {y, sizeof(TOut)}}, [&](auto vec) {
          unpermute_forward_kernel<T, TW, TOut, decltype(vec)::value><<<token_blocks(l.tokens), kThreads, 0, stream>>>(
              l, static_cast<const T*>(y_grouped), static_cast<const TW*>(weights), hidden, static_cast<TOut*>(y));
        });
      });
    });
  });
  SLIME_CUDA_CHECK_LAUNCH();
}

void moe_unpermute_backward(const MoeLayoutView& l, const void* dy, const void* y_grouped, DType dtype,
                            const void* weights, DType weights_dtype, int64_t hidden, void* dy_grouped, void* dweights,
                            StreamHandle stream) {
  if (l.tokens == 0) return;
  with_type(dtype, "dy", [&](auto tag) {
    using T = decltype(tag);
    with_type(weights_dtype, "weights", [&](auto w_tag) {
      using TW = decltype(w_tag);
      with_vec<T>(hidden, {{dy, sizeof(T)}, {y_grouped, sizeof(T)}, {dy_grouped, sizeof(T)}}, [&](auto vec) {
        unpermute_backward_kernel<T, TW, decltype(vec)::value><<<token_blocks(l.tokens), kThreads, 0, stream>>>(
            l, static_cast<const T*>(dy), static_cast<const T*>(y_grouped), static_cast<const TW*>(weights), hidden,
            static_cast<T*>(dy_grouped), static_cast<TW*>(dweights));
      });
    });
  });
  SLIME_CUDA_CHECK_LAUNCH();
}

}  // namespace slime::ops::cuda
