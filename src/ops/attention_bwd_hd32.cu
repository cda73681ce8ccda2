// Attention backward kernels for head_dim 32 (causal and full masks).
#include "attention_kernels.cuh"

namespace slime::ops::cuda::detail {
template void attention_backward_launch<32>(const AttentionBackwardParams& p, StreamHandle stream);
}  // namespace slime::ops::cuda::detail
