// CUDA kernel of slime/rollout/cuda/sampling.hpp. The score of token v is
// computed with the same float operations as the host sampler (no FMA
// contraction: __fmul_rn then __fadd_rn), so host and device pick the same
// token from the same logits.
#include <cstdint>

#include "slime/core/cuda_runtime.hpp"
#include "slime/rollout/cuda/sampling.hpp"
#include "slime/rollout/sampling.hpp"

namespace slime::rollout::cuda {
namespace {

constexpr int kThreads = 256;

struct Best {
  float score;
  int32_t id;
};

__device__ __forceinline__ Best better(Best a, Best b) {
  return (b.score > a.score || (b.score == a.score && b.id < a.id)) ? b : a;
}

__global__ void sample_rows_kernel(const float* __restrict__ logits, int64_t vocab, const uint64_t* __restrict__ keys,
                                   const int64_t* __restrict__ steps, const float* __restrict__ temperatures,
                                   int32_t* __restrict__ tokens) {
  const int64_t row = blockIdx.x;
  const float* z = logits + row * vocab;
  const float t = temperatures[row];
  const bool greedy = t == 0.f;
  const float inv_t = greedy ? 0.f : __fdiv_rn(1.f, t);
  const uint64_t key = keys[row];
  const int64_t step = steps[row];
  Best best{-INFINITY, INT32_MAX};
  for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
    const float s = greedy ? z[v] : __fadd_rn(__fmul_rn(z[v], inv_t), gumbel_noise(key, step, vocab, v));
    best = better(best, Best{s, int32_t(v)});
  }
  for (int off = 16; off > 0; off >>= 1) {
    Best o{__shfl_xor_sync(0xffffffffu, best.score, off), __shfl_xor_sync(0xffffffffu, best.id, off)};
    best = better(best, o);
  }
  __shared__ Best warp_best[kThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_best[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    Best b = warp_best[0];
    for (int w = 1; w < kThreads / 32; ++w) b = better(b, warp_best[w]);
    // A row of NaNs keeps the INT32_MAX id: report token 0 rather than an id
    // outside the vocabulary (the host checks logits for finiteness itself).
    tokens[row] = b.id == INT32_MAX ? 0 : b.id;
  }
}

}  // namespace

void sample_rows(const float* logits, int64_t rows, int64_t vocab, const uint64_t* keys, const int64_t* steps,
                 const float* temperatures, int32_t* tokens, StreamHandle stream) {
  if (rows == 0) return;
  sample_rows_kernel<<<unsigned(rows), kThreads, 0, stream>>>(logits, vocab, keys, steps, temperatures, tokens);
  SLIME_CUDA_CHECK_LAUNCH();
}

}  // namespace slime::rollout::cuda
