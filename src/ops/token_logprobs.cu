// CUDA implementation of slime/ops/token_logprobs.hpp: cuBLAS GEMMs (through
// ops/cuda/linear.hpp's per-thread handle cache) per (token chunk, vocabulary
// chunk) into an fp32 logits workspace, and kernels of our own:
//   forward_chunk_kernel  one block per token row of a chunk: folds the chunk's
//                         logits into the running (max, sum, sum * z) state and
//                         picks the target logit; the last chunk writes outputs
//   grad_chunk_kernel     one block per row: logits -> dz in place (f32, or bf16
//                         rows packed at the start of each fp32 row)
//   cast_*_kernel         fp32 dh accumulator -> bf16 grad_hidden
//
// A block holds its whole row in registers (kThreads threads x kItems float4),
// which is what makes the in-place bf16 dz safe: every thread has read the row
// before any thread writes it. Hence vocab_chunk <= kThreads * 4 * kMaxItems.
//
// Bytes and FLOPs, per call (T tokens, V vocab, D dim, e = input element size):
//   forward:  GEMM 2 T V D FLOPs; logits 4 T V bytes written by the GEMM and
//             read once by forward_chunk_kernel; W read ceil(T / Tc) times.
//   backward: 3 GEMMs, 6 T V D FLOPs; logits written + read, dz written (e T V)
//             and read by the two GEMMs; W and h read once per chunk pair.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "ptx.cuh"
#include "slime/core/device.hpp"
#include "slime/ops/cuda/linear.hpp"
#include "slime/ops/cuda/token_logprobs.hpp"
#include "slime/ops/token_logprobs.hpp"

namespace slime::ops::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxItems = 8;  // float4 per thread: rows of up to 16384 logits
static_assert(int64_t(kThreads) * 4 * kMaxItems == kTokenLogprobsMaxVocabChunk,
              "kTokenLogprobsMaxVocabChunk must match the kernels' register tile");

// ---- device helpers ------------------------------------------------------------
using ::slime::ops::detail::ptx::MaxOp;
using ::slime::ops::detail::ptx::SumOp;
using ::slime::ops::detail::ptx::warp_reduce;

// Reduces `v` over the block (fixed order: deterministic); every thread gets
// the result. `scratch` holds kWarps floats and may be reused right after.
template <class Op>
__device__ float block_reduce(float v, Op op, float identity, float* scratch, int lane, int warp) {
  v = warp_reduce(v, op);
  __syncthreads();  // the previous use of scratch is over
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < kWarps ? scratch[lane] : identity;
  return warp_reduce(v, op);
}

// Loads one row of a logits chunk into registers: element 4 (tid + k kThreads) + e
// is x[4 k + e]. Rows are 16-byte aligned and logits_ld >= vc rounded up to 4,
// so every float4 that starts before vc lies inside the row.
template <int kItems>
__device__ __forceinline__ void load_row(const float* row, int vc, int tid, float (&x)[4 * kItems]) {
#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int j = (tid + k * kThreads) * 4;
    float4 q = make_float4(0.f, 0.f, 0.f, 0.f);
    if (j < vc) q = *reinterpret_cast<const float4*>(row + j);
    x[4 * k + 0] = q.x;
    x[4 * k + 1] = q.y;
    x[4 * k + 2] = q.z;
    x[4 * k + 3] = q.w;
  }
}

template <class Idx>
__device__ __forceinline__ void check_target(Idx target, int64_t vocab) {
  // Broken invariant (documented in the public header): trap, as a host check
  // would need a device-to-host sync.
  if (int64_t(target) < 0 || int64_t(target) >= vocab) __trap();
}

// ---- forward -------------------------------------------------------------------
template <class Idx>
struct ForwardChunkArgs {
  const float* logits;  // [rows, ld] chunk
  int64_t ld;
  int vc;              // columns of this chunk
  int64_t v0, vocab;   // first column's vocabulary index; vocabulary size
  const Idx* targets;  // [rows], offset to the chunk's first token
  float4* state;       // [rows]: (max, sum exp(z - max), sum exp(z - max)(z - max), target logit)
  bool first, last;
  float* logprobs;  // [rows], offset like targets; written by the last chunk
  float* entropy;
  float* lse;
};

template <int kItems, class Idx>
__global__ void __launch_bounds__(kThreads) forward_chunk_kernel(ForwardChunkArgs<Idx> a) {
  __shared__ float scratch[kWarps];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t row = blockIdx.x;
  const float* z = a.logits + row * a.ld;
  float x[4 * kItems];
  load_row<kItems>(z, a.vc, tid, x);

  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < 4 * kItems; ++i) {
    const int j = (tid + (i / 4) * kThreads) * 4 + i % 4;
    if (j < a.vc) m = fmaxf(m, x[i]);
  }
  const float chunk_max = block_reduce(m, MaxOp{}, -INFINITY, scratch, lane, warp);
  float s = 0.f, sa = 0.f;
#pragma unroll
  for (int i = 0; i < 4 * kItems; ++i) {
    const int j = (tid + (i / 4) * kThreads) * 4 + i % 4;
    if (j < a.vc) {
      const float d = x[i] - chunk_max;
      const float e = expf(d);
      s += e;
      sa = fmaf(e, d, sa);
    }
  }
  const float chunk_s = block_reduce(s, SumOp{}, 0.f, scratch, lane, warp);
  const float chunk_a = block_reduce(sa, SumOp{}, 0.f, scratch, lane, warp);

  if (tid != 0) return;
  const Idx target = a.targets[row];
  float4 st;
  if (a.first) {
    check_target(target, a.vocab);
    st = make_float4(chunk_max, chunk_s, chunk_a, NAN);
  } else {
    st = a.state[row];
    const float mm = fmaxf(st.x, chunk_max);
    const float e_old = expf(st.x - mm), e_new = expf(chunk_max - mm);
    st.z = e_old * fmaf(st.y, st.x - mm, st.z) + e_new * fmaf(chunk_s, chunk_max - mm, chunk_a);
    st.y = e_old * st.y + e_new * chunk_s;
    st.x = mm;
  }
  const int64_t local = int64_t(target) - a.v0;
  if (local >= 0 && local < a.vc) st.w = z[local];
  if (a.last) {
    const float log_s = logf(st.y);
    const float l = st.x + log_s;
    a.lse[row] = l;
    a.entropy[row] = log_s - st.z / st.y;
    a.logprobs[row] = st.w - l;
  } else {
    a.state[row] = st;
  }
}

// ---- backward ------------------------------------------------------------------
template <class Idx>
struct GradChunkArgs {
  float* logits;  // [rows, ld] chunk; overwritten by dz
  int64_t ld;
  int vc;
  int64_t v0, vocab;
  bool first;
  const Idx* targets;        // [rows], offset to the chunk's first token
  const float* lse;          // [rows]
  const float* entropy;      // [rows]
  const float* maybe_g_lp;   // [rows] or nullptr
  const float* maybe_g_ent;  // [rows] or nullptr
};

// dz_v = g_lp (1[v = target] - p_v) + g_ent p_v (mu - z_v), p_v = exp(z_v - lse),
// mu = lse - entropy. Out = float: in place; Out = __nv_bfloat16: row r's vc
// bf16 values go to the start of fp32 row r (a bf16 matrix of pitch 2 ld).
template <int kItems, class Idx, class Out>
__global__ void __launch_bounds__(kThreads) grad_chunk_kernel(GradChunkArgs<Idx> a) {
  const int tid = threadIdx.x;
  const int64_t row = blockIdx.x;
  float* z = a.logits + row * a.ld;
  float x[4 * kItems];
  load_row<kItems>(z, a.vc, tid, x);

  const Idx target = a.targets[row];
  if (a.first && tid == 0) check_target(target, a.vocab);
  const int64_t local = int64_t(target) - a.v0;
  const float l = a.lse[row];
  const float mu = l - a.entropy[row];
  const float g_lp = a.maybe_g_lp ? a.maybe_g_lp[row] : 0.f;
  const float g_ent = a.maybe_g_ent ? a.maybe_g_ent[row] : 0.f;
  if constexpr (!std::is_same_v<Out, float>) __syncthreads();  // the whole row is read before it is overwritten

#pragma unroll
  for (int k = 0; k < kItems; ++k) {
    const int j = (tid + k * kThreads) * 4;
    if (j >= a.vc) continue;
    float dz[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float zv = x[4 * k + e];
      const float p = expf(zv - l);
      float g = p * fmaf(g_ent, mu - zv, -g_lp);
      if (j + e == local) g += g_lp;
      dz[e] = j + e < a.vc ? g : 0.f;
    }
    if constexpr (std::is_same_v<Out, float>) {
      *reinterpret_cast<float4*>(z + j) = make_float4(dz[0], dz[1], dz[2], dz[3]);
    } else {
      __nv_bfloat162 lo = __floats2bfloat162_rn(dz[0], dz[1]);
      __nv_bfloat162 hi = __floats2bfloat162_rn(dz[2], dz[3]);
      uint2 packed;
      packed.x = *reinterpret_cast<uint32_t*>(&lo);
      packed.y = *reinterpret_cast<uint32_t*>(&hi);
      *reinterpret_cast<uint2*>(reinterpret_cast<__nv_bfloat16*>(z) + j) = packed;
    }
  }
}

// fp32 -> bf16, 8 per thread where both ends allow 16-byte access, else 1.
__global__ void cast_vec8_kernel(const float* in, __nv_bfloat16* out, int64_t n8) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n8; i += int64_t(gridDim.x) * blockDim.x) {
    const float4 a = reinterpret_cast<const float4*>(in)[2 * i];
    const float4 b = reinterpret_cast<const float4*>(in)[2 * i + 1];
    __nv_bfloat162 r[4] = {__floats2bfloat162_rn(a.x, a.y), __floats2bfloat162_rn(a.z, a.w),
                           __floats2bfloat162_rn(b.x, b.y), __floats2bfloat162_rn(b.z, b.w)};
    reinterpret_cast<uint4*>(out)[i] = *reinterpret_cast<uint4*>(r);
  }
}
__global__ void cast_scalar_kernel(const float* in, __nv_bfloat16* out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}

void cast_to_bf16(const float* in, void* out, int64_t n, StreamHandle stream) {
  constexpr int kCastThreads = 256;
  auto grid = [](int64_t work) {
    return unsigned(std::clamp<int64_t>((work + kCastThreads - 1) / kCastThreads, 1, 65535 * 8));
  };
  const bool aligned =
      reinterpret_cast<std::uintptr_t>(in) % 16 == 0 && reinterpret_cast<std::uintptr_t>(out) % 16 == 0;
  if (aligned && n % 8 == 0) {
    cast_vec8_kernel<<<grid(n / 8), kCastThreads, 0, stream>>>(in, static_cast<__nv_bfloat16*>(out), n / 8);
  } else {
    cast_scalar_kernel<<<grid(n), kCastThreads, 0, stream>>>(in, static_cast<__nv_bfloat16*>(out), n);
  }
  SLIME_CUDA_CHECK_LAUNCH();
}

// ---- dispatch ------------------------------------------------------------------
// Calls f(std::integral_constant<int, kItems>) with the smallest power of two
// items per thread that covers vc columns.
template <class F>
void with_items(int64_t vc, F&& f) {
  const int64_t groups = (vc + 3) / 4;
  const int64_t need = (groups + kThreads - 1) / kThreads;
  if (need <= 1) {
    f(std::integral_constant<int, 1>{});
  } else if (need <= 2) {
    f(std::integral_constant<int, 2>{});
  } else if (need <= 4) {
    f(std::integral_constant<int, 4>{});
  } else {
    SLIME_CHECK(need <= kMaxItems, "token_logprobs: vocabulary chunk ", vc, " exceeds ", kTokenLogprobsMaxVocabChunk);
    f(std::integral_constant<int, 8>{});
  }
}

template <class F>
void with_index_type(DType t, F&& f) {
  switch (t) {
    case DType::i32:
      f(int32_t{});
      break;
    case DType::i64:
      f(int64_t{});
      break;
    default:
      SLIME_FAIL("token_logprobs: targets must be i32 or i64, got ", dtype_name(t));
  }
}

template <class Params>
TokenLogprobsWorkspaceLayout checked_layout(const Params& p) {
  const TokenLogprobsWorkspaceLayout l = token_logprobs_workspace_layout(
      p.tokens, p.dim, p.vocab, p.dtype, TokenLogprobsChunks{p.token_chunk, p.vocab_chunk});
  SLIME_CHECK(p.workspace_bytes >= l.total_bytes, "token_logprobs: workspace of ", p.workspace_bytes, " bytes, needs ",
              l.total_bytes);
  SLIME_CHECK(reinterpret_cast<std::uintptr_t>(p.workspace) % 16 == 0, "token_logprobs: workspace not 16-byte aligned");
  SLIME_CHECK(p.dtype == DType::bf16 || p.dtype == DType::f32, "token_logprobs: the GPU path takes bf16 or f32, got ",
              dtype_name(p.dtype));
  return l;
}

int current_device() {
  int device = 0;
  SLIME_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

// logits [tc, vc] (row stride ld, fp32) = h_chunk [tc, D] . W_chunk [vc, D]^T / temperature
GemmParams logits_gemm(const void* h, const void* w, float* logits, DType dtype, int64_t tc, int64_t vc, int64_t dim,
                       int64_t ld, float inv_temperature) {
  GemmParams g;
  g.a = h;
  g.b = w;
  g.c = logits;
  g.ab_dtype = dtype;
  g.c_dtype = DType::f32;
  g.m = tc, g.n = vc, g.k = dim;
  g.lda = dim, g.ldb = dim, g.ldc = ld;
  g.trans_b = true;
  g.alpha = inv_temperature;
  return g;
}

}  // namespace

void token_logprobs_forward(const TokenLogprobsForwardParams& p, StreamHandle stream) {
  if (p.tokens == 0) return;
  const TokenLogprobsWorkspaceLayout l = checked_layout(p);
  const std::size_t esize = dtype_size(p.dtype);
  const int device = current_device();
  float* logits = static_cast<float*>(p.workspace);
  float4* state = reinterpret_cast<float4*>(static_cast<char*>(p.workspace) + l.scratch_offset);
  const float inv_temperature = 1.f / p.temperature;
  with_index_type(p.target_dtype, [&](auto index) {
    using Idx = decltype(index);
    for (int64_t t0 = 0; t0 < p.tokens; t0 += l.token_chunk) {
      const int64_t tc = std::min(l.token_chunk, p.tokens - t0);
      const auto* h = static_cast<const char*>(p.hidden) + std::size_t(t0 * p.dim) * esize;
      for (int64_t v0 = 0; v0 < p.vocab; v0 += l.vocab_chunk) {
        const int64_t vc = std::min(l.vocab_chunk, p.vocab - v0);
        const auto* w = static_cast<const char*>(p.weight) + std::size_t(v0 * p.dim) * esize;
        gemm(logits_gemm(h, w, logits, p.dtype, tc, vc, p.dim, l.logits_ld, inv_temperature), device, stream);
        ForwardChunkArgs<Idx> a{logits,
                                l.logits_ld,
                                int(vc),
                                v0,
                                p.vocab,
                                static_cast<const Idx*>(p.targets) + t0,
                                state,
                                v0 == 0,
                                v0 + vc == p.vocab,
                                p.logprobs + t0,
                                p.entropy + t0,
                                p.lse + t0};
        with_items(vc, [&](auto items) {
          forward_chunk_kernel<decltype(items)::value, Idx><<<unsigned(tc), kThreads, 0, stream>>>(a);
        });
        SLIME_CUDA_CHECK_LAUNCH();
      }
    }
  });
}

void token_logprobs_backward(const TokenLogprobsBackwardParams& p, StreamHandle stream) {
  if (p.tokens == 0 || (p.maybe_grad_hidden == nullptr && p.maybe_grad_weight == nullptr)) return;
  const TokenLogprobsWorkspaceLayout l = checked_layout(p);
  const std::size_t esize = dtype_size(p.dtype);
  const bool bf16 = p.dtype == DType::bf16;
  const int device = current_device();
  float* logits = static_cast<float*>(p.workspace);
  float* dh_acc = reinterpret_cast<float*>(static_cast<char*>(p.workspace) + l.scratch_offset);
  // dz has the input dtype; bf16 rows keep the fp32 pitch in bytes.
  const int64_t dz_ld = bf16 ? 2 * l.logits_ld : l.logits_ld;
  const float inv_temperature = 1.f / p.temperature;
  with_index_type(p.target_dtype, [&](auto index) {
    using Idx = decltype(index);
    for (int64_t t0 = 0; t0 < p.tokens; t0 += l.token_chunk) {
      const int64_t tc = std::min(l.token_chunk, p.tokens - t0);
      const auto* h = static_cast<const char*>(p.hidden) + std::size_t(t0 * p.dim) * esize;
      // dh chunk [tc, D]: accumulated over vocabulary chunks straight into an
      // f32 grad_hidden, or into the fp32 accumulator and cast at the end.
      float* dh = nullptr;
      if (p.maybe_grad_hidden != nullptr) dh = bf16 ? dh_acc : static_cast<float*>(p.maybe_grad_hidden) + t0 * p.dim;
      for (int64_t v0 = 0; v0 < p.vocab; v0 += l.vocab_chunk) {
        const int64_t vc = std::min(l.vocab_chunk, p.vocab - v0);
        const auto* w = static_cast<const char*>(p.weight) + std::size_t(v0 * p.dim) * esize;
        gemm(logits_gemm(h, w, logits, p.dtype, tc, vc, p.dim, l.logits_ld, inv_temperature), device, stream);
        GradChunkArgs<Idx> a{logits,
                             l.logits_ld,
                             int(vc),
                             v0,
                             p.vocab,
                             v0 == 0,
                             static_cast<const Idx*>(p.targets) + t0,
                             p.lse + t0,
                             p.entropy + t0,
                             p.maybe_grad_logprobs ? p.maybe_grad_logprobs + t0 : nullptr,
                             p.maybe_grad_entropy ? p.maybe_grad_entropy + t0 : nullptr};
        with_items(vc, [&](auto items) {
          constexpr int kItems = decltype(items)::value;
          if (bf16) {
            grad_chunk_kernel<kItems, Idx, __nv_bfloat16><<<unsigned(tc), kThreads, 0, stream>>>(a);
          } else {
            grad_chunk_kernel<kItems, Idx, float><<<unsigned(tc), kThreads, 0, stream>>>(a);
          }
        });
        SLIME_CUDA_CHECK_LAUNCH();
        if (dh != nullptr) {
          // dh [tc, D] (+)= dz [tc, vc] . W_chunk [vc, D] / temperature; the
          // first vocabulary chunk writes.
          GemmParams g;
          g.a = logits;
          g.b = w;
          g.c = dh;
          g.ab_dtype = p.dtype;
          g.c_dtype = DType::f32;
          g.m = tc, g.n = p.dim, g.k = vc;
          g.lda = dz_ld, g.ldb = p.dim, g.ldc = p.dim;
          g.alpha = inv_temperature;
          g.beta = v0 == 0 ? 0.f : 1.f;
          gemm(g, device, stream);
        }
        if (p.maybe_grad_weight != nullptr) {
          // dW_chunk [vc, D] += dz [tc, vc]^T . h_chunk [tc, D] / temperature
          GemmParams g;
          g.a = logits;
          g.b = h;
          g.c = p.maybe_grad_weight + v0 * p.dim;
          g.ab_dtype = p.dtype;
          g.c_dtype = DType::f32;
          g.m = vc, g.n = p.dim, g.k = tc;
          g.lda = dz_ld, g.ldb = p.dim, g.ldc = p.dim;
          g.trans_a = true;
          g.alpha = inv_temperature;
          g.beta = 1.f;
          gemm(g, device, stream);
        }
      }
      if (dh != nullptr && bf16)
        cast_to_bf16(dh_acc, static_cast<char*>(p.maybe_grad_hidden) + std::size_t(t0 * p.dim) * esize, tc * p.dim,
                     stream);
    }
  });
}

}  // namespace slime::ops::cuda
