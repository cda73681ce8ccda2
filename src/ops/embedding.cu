// CUDA kernels of slime/ops/embedding.hpp.
//
// Forward: a 2-d grid, x over 16-byte column vectors of a row, y over tokens;
// a row copy per (token, column block). Bad ids write NaN and set the flag.
//
// Backward (deterministic, no atomics):
//   1. keys[t] = ids[t] (vocab for a bad id), vals[t] = t;
//   2. cub::DeviceRadixSort::SortPairs (stable: each id's positions stay in
//      increasing token order);
//   3. one block column per distinct id (the first position of its run in
//      the sorted keys) sums the run's dy rows from zero in that order in
//      fp32 and adds the total to dtable once: the CPU reference's order.
// Workspace: keys and values in and out (4 x 4 x tokens bytes) and CUB's
// temporary storage, each 256-byte aligned.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>

#include "memops.cuh"
#include "slime/core/half.hpp"
#include "slime/ops/cuda/embedding.hpp"

namespace slime::ops::cuda {
namespace {

using namespace ::slime::ops::detail::memops;

constexpr int kThreads = 128;

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

template <class I, class T, int N>
__global__ void __launch_bounds__(kThreads)
    embedding_forward_kernel(const I* __restrict__ ids, const T* __restrict__ table, T* __restrict__ y, int64_t tokens,
                             int64_t vocab, int64_t dim, int32_t* bad_flag) {
  const int64_t c = blockIdx.x * int64_t(kThreads) + threadIdx.x;  // column vector
  if (c >= dim / N) return;
  for (int64_t t = blockIdx.y; t < tokens; t += gridDim.y) {
    const int64_t id = int64_t(ids[t]);
    Vec<T, N>* out = reinterpret_cast<Vec<T, N>*>(y + t * dim) + c;
    if (id < 0 || id >= vocab) [[unlikely]] {
      Vec<T, N> nan;
#pragma unroll
      for (int k = 0; k < N; ++k) nan.v[k] = all_ones<T>();
      *out = nan;
      if (bad_flag != nullptr) *bad_flag = 1;
      continue;
    }
    *out = load_vec<T, N>(table + id * dim, c);
  }
}

template <class I>
__global__ void find_bad_id_kernel(const I* __restrict__ ids, int64_t tokens, int64_t vocab,
                                   unsigned long long* first_bad) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < tokens; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t id = int64_t(ids[t]);
    if (id < 0 || id >= vocab) atomicMin(first_bad, static_cast<unsigned long long>(t));
  }
}

template <class I>
__global__ void sort_keys_kernel(const I* __restrict__ ids, int64_t tokens, int64_t vocab, uint32_t* __restrict__ keys,
                                 int32_t* __restrict__ vals) {
  for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < tokens; t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t id = int64_t(ids[t]);
    keys[t] = (id >= 0 && id < vocab) ? uint32_t(id) : uint32_t(vocab);
    vals[t] = int32_t(t);
  }
}

// keys / positions: sorted by id, stable. Block row i works only when i starts
// a run of a valid id.
template <class T, int N>
__global__ void __launch_bounds__(kThreads)
    embedding_backward_kernel(const uint32_t* __restrict__ keys, const int32_t* __restrict__ positions,
                              const T* __restrict__ dy, float* __restrict__ dtable, int64_t tokens, int64_t vocab,
                              int64_t dim) {
  const int64_t c = blockIdx.x * int64_t(kThreads) + threadIdx.x;
  if (c >= dim / N) return;
  for (int64_t i = blockIdx.y; i < tokens; i += gridDim.y) {
    const uint32_t key = keys[i];
    if (key >= vocab || (i > 0 && keys[i - 1] == key)) continue;
    float acc[N];
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = 0.f;
    for (int64_t j = i; j < tokens && keys[j] == key; ++j) {
      const Vec<T, N> v = load_vec<T, N>(dy + int64_t(positions[j]) * dim, c);
#pragma unroll
      for (int k = 0; k < N; ++k) acc[k] += to_float(v.v[k]);
    }
    float* out = dtable + int64_t(key) * dim;
    Vec<float, N> o = load_vec<float, N>(out, c);
#pragma unroll
    for (int k = 0; k < N; ++k) o.v[k] += acc[k];
    store_vec<float, N>(out, c, o);
  }
}

template <class F>
void dispatch(DType id_dtype, DType dtype, F&& f) {
  auto with_ids = [&](auto tag) {
    if (id_dtype == DType::i32) {
      f(int32_t{}, tag);
    } else if (id_dtype == DType::i64) {
      f(int64_t{}, tag);
    } else {
      SLIME_FAIL("embedding: ids must be i32 or i64, got ", dtype_name(id_dtype));
    }
  };
  if (dtype == DType::f32) {
    with_ids(float{});
  } else if (dtype == DType::bf16) {
    with_ids(BFloat16{});
  } else {
    SLIME_FAIL("embedding: table / dy must be f32 or bf16, got ", dtype_name(dtype));
  }
}

// Number of bits that hold every key 0..vocab (vocab is the bad-id key).
int key_bits(int64_t vocab) {
  int bits = 1;
  while (bits < 32 && (int64_t(1) << bits) <= vocab) ++bits;
  return bits;
}

std::size_t cub_temp_bytes(int64_t tokens, int end_bit) {
  std::size_t bytes = 0;
  SLIME_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), int(tokens), 0, end_bit));
  return bytes;
}

struct Layout {
  std::size_t array_bytes;  // one of the four key / value arrays, rounded up
  std::size_t temp_bytes;   // CUB's, for a full 32-bit sort
  std::size_t total() const { return 4 * array_bytes + temp_bytes; }
};

Layout layout_for(int64_t tokens) {
  Layout l;
  l.array_bytes = round_up(std::size_t(tokens) * 4, 256);
  l.temp_bytes = round_up(cub_temp_bytes(tokens, 32), 256);
  return l;
}

}  // namespace

void embedding_forward(const void* ids, DType id_dtype, const void* table, DType dtype, int64_t tokens, int64_t vocab,
                       int64_t dim, void* y, int32_t* maybe_bad_flag, StreamHandle stream) {
  if (tokens == 0 || dim == 0) return;
  dispatch(id_dtype, dtype, [&](auto id_tag, auto tag) {
    using I = decltype(id_tag);
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const auto* ip = static_cast<const I*>(ids);
    const auto* tp = static_cast<const T*>(table);
    auto* yp = static_cast<T*>(y);
    if (dim % kVec == 0 && aligned(table, 16) && aligned(y, 16)) {
      embedding_forward_kernel<I, T, kVec><<<grid_rows(dim / kVec, tokens, kThreads), kThreads, 0, stream>>>(
          ip, tp, yp, tokens, vocab, dim, maybe_bad_flag);
    } else {
      embedding_forward_kernel<I, T, 1>
          <<<grid_rows(dim, tokens, kThreads), kThreads, 0, stream>>>(ip, tp, yp, tokens, vocab, dim, maybe_bad_flag);
    }
    SLIME_CUDA_CHECK_LAUNCH();
  });
}

void embedding_find_bad_id(const void* ids, DType id_dtype, int64_t tokens, int64_t vocab, uint64_t* first_bad,
                           StreamHandle stream) {
  SLIME_CUDA_CHECK(cudaMemsetAsync(first_bad, 0xff, sizeof(uint64_t), stream));
  if (tokens == 0) return;
  auto* out = reinterpret_cast<unsigned long long*>(first_bad);
  if (id_dtype == DType::i32) {
    find_bad_id_kernel<<<grid_1d(tokens, 256), 256, 0, stream>>>(static_cast<const int32_t*>(ids), tokens, vocab, out);
  } else {
    find_bad_id_kernel<<<grid_1d(tokens, 256), 256, 0, stream>>>(static_cast<const int64_t*>(ids), tokens, vocab, out);
  }
  SLIME_CUDA_CHECK_LAUNCH();
}

std::size_t embedding_backward_workspace_bytes(int64_t tokens) {
  if (tokens == 0) return 0;
  SLIME_CHECK(tokens <= INT32_MAX, "embedding_backward: ", tokens, " tokens exceed the GPU limit of 2^31 - 1");
  return layout_for(tokens).total();
}

void embedding_backward(const void* ids, DType id_dtype, const void* dy, DType dtype, int64_t tokens, int64_t vocab,
                        int64_t dim, float* dtable, void* workspace, std::size_t workspace_bytes, StreamHandle stream) {
  if (tokens == 0 || dim == 0 || vocab == 0) return;
  SLIME_CHECK(tokens <= INT32_MAX && vocab <= INT32_MAX, "embedding_backward: tokens ", tokens, " or vocab ", vocab,
              " exceed the GPU limit of 2^31 - 1");
  const Layout l = layout_for(tokens);
  SLIME_CHECK(workspace != nullptr && workspace_bytes >= l.total(), "embedding_backward: workspace of ",
              workspace_bytes, " bytes, needs ", l.total());
  SLIME_CHECK(aligned(workspace, 16),
              "embedding_backward: the workspace must be 16-byte aligned (a tensor's own "
              "storage is; a view at an odd offset may not be)");
  char* base = static_cast<char*>(workspace);
  auto* keys_in = reinterpret_cast<uint32_t*>(base);
  auto* keys_out = reinterpret_cast<uint32_t*>(base + l.array_bytes);
  auto* vals_in = reinterpret_cast<int32_t*>(base + 2 * l.array_bytes);
  auto* vals_out = reinterpret_cast<int32_t*>(base + 3 * l.array_bytes);
  void* temp = base + 4 * l.array_bytes;

  if (id_dtype == DType::i32) {
    sort_keys_kernel<<<grid_1d(tokens, 256), 256, 0, stream>>>(static_cast<const int32_t*>(ids), tokens, vocab, keys_in,
                                                               vals_in);
  } else {
    sort_keys_kernel<<<grid_1d(tokens, 256), 256, 0, stream>>>(static_cast<const int64_t*>(ids), tokens, vocab, keys_in,
                                                               vals_in);
  }
  SLIME_CUDA_CHECK_LAUNCH();

  // Sort only the bits a key can have (fewer passes); the workspace was sized
  // for all 32, which needs at least as much temporary storage.
  int end_bit = key_bits(vocab);
  if (cub_temp_bytes(tokens, end_bit) > l.temp_bytes) end_bit = 32;
  std::size_t temp_bytes = l.temp_bytes;
  SLIME_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys_out, vals_in, vals_out, int(tokens),
                                                   0, end_bit, stream));

  dispatch(id_dtype, dtype, [&](auto, auto tag) {
    using T = decltype(tag);
    constexpr int kVec = 16 / sizeof(T);
    const auto* dp = static_cast<const T*>(dy);
    if (dim % kVec == 0 && aligned(dy, 16) && aligned(dtable, 16)) {
      embedding_backward_kernel<T, kVec><<<grid_rows(dim / kVec, tokens, kThreads), kThreads, 0, stream>>>(
          keys_out, vals_out, dp, dtable, tokens, vocab, dim);
    } else {
      embedding_backward_kernel<T, 1><<<grid_rows(dim, tokens, kThreads), kThreads, 0, stream>>>(
          keys_out, vals_out, dp, dtable, tokens, vocab, dim);
    }
    SLIME_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace slime::ops::cuda
