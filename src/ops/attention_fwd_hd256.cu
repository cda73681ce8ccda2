// Attention forward kernels for head_dim 256 (causal and full masks).
#include "attention_kernels.cuh"

namespace slime::ops::cuda::detail {
template void attention_forward_launch<256>(const AttentionForwardParams& p, StreamHandle stream);
}  // namespace slime::ops::cuda::detail
