// Attention forward kernels for head_dim 72 (causal and full masks), tiles at 80
// with the columns past 72 zero-filled.
#include "attention_kernels.cuh"

namespace slime::ops::cuda::detail {
template void attention_forward_launch<72>(const AttentionForwardParams& p, StreamHandle stream);
}  // namespace slime::ops::cuda::detail
