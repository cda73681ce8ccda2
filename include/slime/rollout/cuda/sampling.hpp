// slime/rollout/cuda/sampling.hpp: the CUDA sampler of the rollout engine
// (src/rollout/sampling.cu): per row, greedy (temperature 0) or Gumbel-max
// over the whole vocabulary, the same argmax as rollout::sample_token without
// top-k / top-p. Device pointers; one block per row.
#pragma once

#include <cstdint>

#include "slime/core/cuda_runtime.hpp"

#if SLIME_HAS_CUDA
namespace slime::rollout::cuda {

// tokens[b] = argmax_v (temperatures[b] == 0 ? logits[b, v]
//                       : logits[b, v] * (1 / temperatures[b]) + gumbel(keys[b], steps[b], vocab, v)),
// ties to the lower id. logits f32 [rows, vocab].
void sample_rows(const float* logits, int64_t rows, int64_t vocab, const uint64_t* keys, const int64_t* steps,
                 const float* temperatures, int32_t* tokens, StreamHandle stream);

}  // namespace slime::rollout::cuda
#endif
