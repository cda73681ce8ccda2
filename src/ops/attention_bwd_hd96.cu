// Attention backward kernels for head_dim 96 (causal and full masks).
#include "attention_kernels.cuh"

namespace slime::ops::cuda::detail {
template void attention_backward_launch<96>(const AttentionBackwardParams& p, StreamHandle stream);
}  // namespace slime::ops::cuda::detail
