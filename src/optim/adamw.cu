// CUDA kernels of slime/optim (declared in slime/optim/cuda/adamw.hpp): the
// multi-tensor AdamW update and the multi-tensor sum of squares of the global
// gradient norm.
//
// Both walk the same table: tensor i owns chunks [chunk_begin_i,
// chunk_begin_{i+1}) of kMultiTensorChunk elements, block b of a launch takes
// chunk b, finds its tensor by binary search (block-uniform reads of the
// __grid_constant__ argument struct), and covers the chunk with 16-byte
// vectors when every pointer of the tensor is aligned for them (4 fp32, the
// bf16 copy 4 x 2 bytes), else one element per thread; the last partial
// vector of a tensor is done element by element.
//
// AdamW math is fp32 with the operations of torch.optim.AdamW
// (_single_tensor_adam, decoupled weight decay) in its order, written with
// explicitly rounded intrinsics (__fmul_rn, __fmaf_rn, ...) so nvcc contracts
// nothing else: the kernel computes, bit for bit, what the CPU reference
// (slime/optim/adamw.hpp, cpu::adamw_update<float>) computes.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../ops/memops.cuh"
#include "slime/core/half.hpp"
#include "slime/optim/cuda/adamw.hpp"

namespace slime::optim::cuda {
namespace {

using namespace ::slime::ops::detail::memops;

constexpr int kThreads = 256;
constexpr int kVec = 4;     // fp32 per 16-byte vector
constexpr int kUnroll = 2;  // vectors in flight per thread per stream
static_assert(kMultiTensorChunk % (kVec * kThreads) == 0, "a chunk is whole vector rows of a block");

// Kernel arguments stay within the classic 4 KiB limit; a Qwen3-0.6B step
// (310 tensors) takes 5 AdamW launches, each of ~10^8 elements.
constexpr int kAdamWTableSize = 64;
constexpr int kSumSqTableSize = 160;

enum class CopyKind : uint8_t { none, f32, bf16 };

struct AdamWEntry {
  float* param;
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* copy;
  int64_t numel;
  int32_t chunk_begin;
  CopyKind copy_kind;
  bool vectorized;
};

struct AdamWLaunch {
  AdamWScalars s;
  int32_t count;
  AdamWEntry t[kAdamWTableSize];
};
static_assert(sizeof(AdamWLaunch) <= 4000, "AdamW kernel arguments must fit in 4 KiB");

struct SumSqEntry {
  const float* data;
  int64_t numel;
  int32_t chunk_begin;
  bool vectorized;
};

struct SumSqLaunch {
  float* partials;  // this launch's first chunk's slot
  int32_t count;
  SumSqEntry t[kSumSqTableSize];
};
static_assert(sizeof(SumSqLaunch) <= 4000, "sum-of-squares kernel arguments must fit in 4 KiB");

// The entry whose chunks hold `chunk`: the last i with t[i].chunk_begin <=
// chunk (entries are in chunk order, the first begins at 0).
template <class Entry>
__device__ __forceinline__ int find_entry(const Entry* t, int count, int32_t chunk) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (t[mid].chunk_begin <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// One element of the AdamW update (the roundings of cpu::adamw_update<float>).
__device__ __forceinline__ void adamw_element(const AdamWScalars& s, float& p, float g, float& m, float& v) {
  g = __fmul_rn(g, s.grad_scale);
  p = __fmul_rn(p, s.decay);
  // exp_avg.lerp_(grad, 1 - beta1) as PyTorch's vectorised lerp.
  if (fabsf(s.lerp_weight) < 0.5f) {
    m = __fmaf_rn(s.lerp_weight, __fsub_rn(g, m), m);
  } else {
    m = __fmaf_rn(__fsub_rn(s.lerp_weight, 1.f), __fsub_rn(g, m), g);
  }
  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
  v = __fmaf_rn(__fmul_rn(s.one_minus_beta2, g), g, __fmul_rn(v, s.beta2));
  // denom = sqrt(exp_avg_sq) / sqrt(bc2) + eps; param.addcdiv_(exp_avg, denom, value=-step_size)
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bias_correction2_sqrt), s.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(-s.step_size, m), denom));
}

template <class C>
__device__ __forceinline__ void store_copy(void* copy, int64_t i, float p) {
  if constexpr (!std::is_void_v<C>) static_cast<C*>(copy)[i] = from_float<C>(p);
}

// Elements [begin, end) of tensor e, one per thread.
template <class C>
__device__ void adamw_scalar(const AdamWEntry& e, const AdamWScalars& s, int64_t begin, int64_t end) {
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    float p = e.param[i], m = e.exp_avg[i], v = e.exp_avg_sq[i];
    adamw_element(s, p, e.grad[i], m, v);
    e.param[i] = p;
    e.exp_avg[i] = m;
    e.exp_avg_sq[i] = v;
    store_copy<C>(e.copy, i, p);
  }
}

// Elements [begin, end) of tensor e with 16-byte vectors; begin is a multiple
// of kVec and the pointers are aligned; the tail of fewer than kVec elements
// goes element by element.
template <class C>
__device__ void adamw_vector(const AdamWEntry& e, const AdamWScalars& s, int64_t begin, int64_t end) {
  using V = Vec<float, kVec>;
  const int64_t v0 = begin / kVec, v1 = end / kVec;  // whole vectors [v0, v1)
  for (int64_t base = v0 + threadIdx.x; base < v1; base += int64_t(kThreads) * kUnroll) {
    V p[kUnroll], g[kUnroll], m[kUnroll], v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = base + int64_t(u) * kThreads;
      if (j < v1) {
        p[u] = load_vec<float, kVec>(e.param, j);
        g[u] = load_vec<float, kVec>(e.grad, j);
        m[u] = load_vec<float, kVec>(e.exp_avg, j);
        v[u] = load_vec<float, kVec>(e.exp_avg_sq, j);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = base + int64_t(u) * kThreads;
      if (j >= v1) continue;
#pragma unroll
      for (int k = 0; k < kVec; ++k) adamw_element(s, p[u].v[k], g[u].v[k], m[u].v[k], v[u].v[k]);
      store_vec<float, kVec>(e.param, j, p[u]);
      store_vec<float, kVec>(e.exp_avg, j, m[u]);
      store_vec<float, kVec>(e.exp_avg_sq, j, v[u]);
      if constexpr (!std::is_void_v<C>) {
        Vec<C, kVec> c;
#pragma unroll
        for (int k = 0; k < kVec; ++k) c.v[k] = from_float<C>(p[u].v[k]);
        store_vec<C, kVec>(static_cast<C*>(e.copy), j, c);
      }
    }
  }
  adamw_scalar<C>(e, s, v1 * kVec, end);
}

template <class C>
__device__ void adamw_chunk(const AdamWEntry& e, const AdamWScalars& s, int64_t begin, int64_t end) {
  if (e.vectorized) {
    adamw_vector<C>(e, s, begin, end);
  } else {
    adamw_scalar<C>(e, s, begin, end);
  }
}

__global__ void __launch_bounds__(kThreads) adamw_kernel(const __grid_constant__ AdamWLaunch a) {
  const int32_t chunk = int32_t(blockIdx.x);
  const AdamWEntry& e = a.t[find_entry(a.t, a.count, chunk)];
  const int64_t begin = int64_t(chunk - e.chunk_begin) * kMultiTensorChunk;
  const int64_t end = std::min(begin + kMultiTensorChunk, e.numel);
  AdamWScalars s = a.s;
  if (s.device_grad_scale != nullptr) {
    const float f = *s.device_grad_scale;  // block-uniform: every block returns, or none
    if (!isfinite(f)) return;
    s.grad_scale = __fmul_rn(s.grad_scale, f);
  }
  switch (e.copy_kind) {
    case CopyKind::none:
      adamw_chunk<void>(e, s, begin, end);
      break;
    case CopyKind::f32:
      adamw_chunk<float>(e, s, begin, end);
      break;
    case CopyKind::bf16:
      adamw_chunk<BFloat16>(e, s, begin, end);
      break;
  }
}

// Block-wide sum of one value per thread, in a fixed tree; the total is
// valid in thread 0.
template <class A>
__device__ __forceinline__ A block_sum(A x, A* shared) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x += __shfl_down_sync(0xffffffffu, x, o);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = A(0);
  if (warp == 0) {
    if (lane < int(blockDim.x) / 32) x = shared[lane];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) x += __shfl_down_sync(0xffffffffu, x, o);
  }
  return x;
}

// partials[chunk] = sum of x^2 over the chunk (fp32: four running sums per
// thread over at most kMultiTensorChunk / (kVec * kThreads) = 64 vectors each,
// then the block tree).
__global__ void __launch_bounds__(kThreads) sum_of_squares_kernel(const __grid_constant__ SumSqLaunch a) {
  __shared__ float shared[kThreads / 32];
  const int32_t chunk = int32_t(blockIdx.x);
  const SumSqEntry& e = a.t[find_entry(a.t, a.count, chunk)];
  const int64_t begin = int64_t(chunk - e.chunk_begin) * kMultiTensorChunk;
  const int64_t end = std::min(begin + kMultiTensorChunk, e.numel);
  float acc[kVec] = {0.f, 0.f, 0.f, 0.f};
  int64_t tail = begin;
  if (e.vectorized) {
    const int64_t v0 = begin / kVec, v1 = end / kVec;
    for (int64_t j = v0 + threadIdx.x; j < v1; j += kThreads) {
      const Vec<float, kVec> x = load_vec<float, kVec>(e.data, j);
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc[k] = fmaf(x.v[k], x.v[k], acc[k]);
    }
    tail = v1 * kVec;
  }
  for (int64_t i = tail + threadIdx.x; i < end; i += kThreads) acc[0] = fmaf(e.data[i], e.data[i], acc[0]);
  const float total = block_sum((acc[0] + acc[1]) + (acc[2] + acc[3]), shared);
  if (threadIdx.x == 0) a.partials[chunk] = total;
}

// *out = sum of partials[0, n) in fp64: thread t adds partials t, t + 1024,
// ... in order, then a fixed tree.
constexpr int kFinalThreads = 1024;
__global__ void __launch_bounds__(kFinalThreads)
    sum_partials_kernel(const float* partials, int64_t n, double* out, float* out_f32) {
  __shared__ double shared[kFinalThreads / 32];
  double x = 0;
  for (int64_t i = threadIdx.x; i < n; i += kFinalThreads) x += double(partials[i]);
  x = block_sum(x, shared);
  if (threadIdx.x == 0) {
    *out = x;
    if (out_f32 != nullptr) *out_f32 = float(x);
  }
}

// optim::clip_coefficient on the device: the same fp64 operations, written
// with rounded intrinsics so that nothing is contracted into an fma.
__device__ __forceinline__ double group_norm(const NormSums& s, int i) {
  return sqrt(s.f64[i] != nullptr ? *s.f64[i] : double(*s.f32[i]));
}
__global__ void clip_factor_kernel(const NormSums s, double max_norm, double* norm_out, float* factor_out) {
  double norm = group_norm(s, 0);
  if (s.count == 2) {
    const double e = group_norm(s, 1);
    norm = sqrt(__dadd_rn(__dmul_rn(norm, norm), __dmul_rn(e, e)));
  }
  float factor = __int_as_float(0x7fc00000);  // NaN: the update is skipped
  if (isfinite(norm)) {
    const double c = __ddiv_rn(max_norm, __dadd_rn(norm, 1e-6));
    factor = c < 1 ? float(c) : 1.f;
  }
  *norm_out = norm;
  *factor_out = factor;
}

int64_t chunks_of(int64_t numel) { return (numel + kMultiTensorChunk - 1) / kMultiTensorChunk; }

// The fp32 partials follow the fp64 result in the workspace.
constexpr std::size_t kPartialsOffset = 16;

}  // namespace

void adamw_multi_tensor(std::span<const AdamWTensorArgs> tensors, const AdamWScalars& scalars, StreamHandle stream) {
  AdamWLaunch a{};
  a.s = scalars;
  int64_t chunks = 0;
  auto flush = [&] {
    if (a.count == 0) return;
    SLIME_CHECK(chunks <= INT32_MAX, "adamw: ", chunks, " chunks in one launch");
    adamw_kernel<<<unsigned(chunks), kThreads, 0, stream>>>(a);
    SLIME_CUDA_CHECK_LAUNCH();
    a.count = 0;
    chunks = 0;
  };
  for (const AdamWTensorArgs& t : tensors) {
    if (t.numel == 0) continue;
    const bool copy = t.maybe_param_copy != nullptr;
    const std::size_t copy_align = vec_align(dtype_size(t.copy_dtype), kVec);
    AdamWEntry& e = a.t[a.count];
    e.param = t.param;
    e.grad = t.grad;
    e.exp_avg = t.exp_avg;
    e.exp_avg_sq = t.exp_avg_sq;
    e.copy = t.maybe_param_copy;
    e.numel = t.numel;
    e.chunk_begin = int32_t(chunks);
    e.copy_kind = !copy ? CopyKind::none : t.copy_dtype == DType::bf16 ? CopyKind::bf16 : CopyKind::f32;
    e.vectorized = aligned(t.param, 16) && aligned(t.grad, 16) && aligned(t.exp_avg, 16) && aligned(t.exp_avg_sq, 16) &&
                   (!copy || aligned(t.maybe_param_copy, copy_align));
    ++a.count;
    chunks += chunks_of(t.numel);
    if (a.count == kAdamWTableSize) flush();
  }
  flush();
}

std::size_t sum_of_squares_workspace_bytes(std::span<const int64_t> numels) {
  int64_t chunks = 0;
  for (int64_t n : numels) chunks += chunks_of(n);
  return kPartialsOffset + std::size_t(std::max<int64_t>(chunks, 1)) * sizeof(float);
}

void sum_of_squares_multi_tensor(std::span<const float* const> data, std::span<const int64_t> numels, void* workspace,
                                 StreamHandle stream, float* sum_f32) {
  SLIME_CHECK(data.size() == numels.size(), "sum_of_squares: ", data.size(), " pointers for ", numels.size(), " sizes");
  SLIME_CHECK(aligned(workspace, 8), "sum_of_squares: the workspace must be 8-byte aligned");
  float* partials = reinterpret_cast<float*>(static_cast<char*>(workspace) + kPartialsOffset);
  SumSqLaunch a{};
  int64_t chunks = 0, launch_begin = 0;
  auto flush = [&] {
    if (a.count == 0) return;
    a.partials = partials + launch_begin;
    const int64_t n = chunks - launch_begin;
    SLIME_CHECK(n <= INT32_MAX, "sum_of_squares: ", n, " chunks in one launch");
    sum_of_squares_kernel<<<unsigned(n), kThreads, 0, stream>>>(a);
    SLIME_CUDA_CHECK_LAUNCH();
    a.count = 0;
    launch_begin = chunks;
  };
  for (std::size_t i = 0; i < data.size(); ++i) {
    if (numels[i] == 0) continue;
    SumSqEntry& e = a.t[a.count];
    e.data = data[i];
    e.numel = numels[i];
    e.chunk_begin = int32_t(chunks - launch_begin);
    e.vectorized = aligned(data[i], 16);
    ++a.count;
    chunks += chunks_of(numels[i]);
    if (a.count == kSumSqTableSize) flush();
  }
  flush();
  sum_partials_kernel<<<1, kFinalThreads, 0, stream>>>(partials, chunks, static_cast<double*>(workspace), sum_f32);
  SLIME_CUDA_CHECK_LAUNCH();
}

void clip_factor_on_device(const NormSums& sums, double max_norm, double* norm, float* factor, StreamHandle stream) {
  SLIME_CHECK(sums.count == 1 || sums.count == 2, "clip_factor_on_device: 1 or 2 groups, got ", sums.count);
  for (int i = 0; i < sums.count; ++i)
    SLIME_CHECK(sums.f32[i] != nullptr || sums.f64[i] != nullptr, "clip_factor_on_device: group ", i, " has no sum");
  clip_factor_kernel<<<1, 1, 0, stream>>>(sums, max_norm, norm, factor);
  SLIME_CUDA_CHECK_LAUNCH();
}

}  // namespace slime::optim::cuda
