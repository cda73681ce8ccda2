// slime/ops/cuda/attention.hpp: host-callable launchers of the CUDA attention
// kernels (src/ops/attention*.cu) and their Params; declarations only.
#pragma once

#include <cstdint>
#include <type_traits>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"
#include "slime/ops/cpu/attention.hpp"

#if SLIME_HAS_CUDA
namespace slime::ops::cuda {

// Pointers and sizes of one forward call, built by the host API and passed by
// value to the kernel. Tensors are bf16 and contiguous: q, o [T, Hq, d];
// k, v [Tk, Hkv, d]; lse f32 [T, Hq]; cu_seqlens i32 [num_seqs + 1] on the GPU.
// max_seqlen_q must be >= every query length (the grid is sized by it; a
// longer sequence traps in the kernel rather than being silently cut).
struct AttentionForwardParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  int num_seqs = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  int tokens_q = 0, tokens_k = 0;
  int max_seqlen_q = 0, max_seqlen_k = 0;
  float softmax_scale = 0.f;  // resolved (> 0)
  AttentionOptions options;
};

// The forward's fields plus the gradients. d_o is bf16 [T, Hq, d]; dq the same;
// dk, dv bf16 [Tk, Hkv, d]. workspace: attention_backward_workspace_elems()
// f32 elements, 16-byte aligned (dq accumulator [T, Hq, d], then
// D = rowsum(do * o) [T, Hq], then the deterministic mode's turn counters,
// int32 [T, Hq, 2]). max_seqlen_k must be >= every key length.
struct AttentionBackwardParams {
  AttentionForwardParams fwd;  // o and lse are read, not written
  const void* d_o = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* workspace = nullptr;
};

inline int64_t attention_backward_workspace_elems(int64_t tokens_q, int64_t heads_q, int64_t head_dim) {
  return tokens_q * heads_q * (head_dim + 3);
}

// Runtime head_dim -> compile-time constant: the one place that says which
// head dims the kernels are instantiated for. 32, 64, 80, 96, 128 and 256 run
// at their own size; 72 (Qwen3-VL's vision tower) runs in tiles of 80 with the
// columns past 72 zero-filled (src/ops/attention_kernels.cuh).
template <class F>
decltype(auto) visit_head_dim(int64_t head_dim, F&& f) {
  switch (head_dim) {
    case 32:
      return f(std::integral_constant<int, 32>{});
    case 64:
      return f(std::integral_constant<int, 64>{});
    case 72:
      return f(std::integral_constant<int, 72>{});
    case 80:
      return f(std::integral_constant<int, 80>{});
    case 96:
      return f(std::integral_constant<int, 96>{});
    case 128:
      return f(std::integral_constant<int, 128>{});
    case 256:
      return f(std::integral_constant<int, 256>{});
    default:
      break;
  }
  SLIME_FAIL("attention on CUDA supports head_dim 32, 64, 72, 80, 96, 128 and 256, got ", head_dim);
}

// Whether the Hopper forward kernel (AttentionKernel::sm90) can run on the
// current device: an sm_90 GPU and a build for sm_90a.
bool attention_sm90_available();

// Dispatch on head_dim (visit_head_dim) and mask (options.causal); the
// forward runs the Hopper kernel where options.kernel and the call allow.
void attention_forward(const AttentionForwardParams& p, StreamHandle stream);
void attention_backward(const AttentionBackwardParams& p, StreamHandle stream);

// rows = T * H; o1, o2 and o may be bf16 or f32 each (dtypes given); lse f32.
// o may alias o1 or o2 and lse may alias lse1 or lse2.
void merge_attention_partials(const void* o1, DType o1_dtype, const float* lse1, const void* o2, DType o2_dtype,
                              const float* lse2, void* o, DType o_dtype, float* lse, int64_t rows, int64_t head_dim,
                              StreamHandle stream);

namespace detail {
// The Hopper forward (src/ops/attention_fwd_sm90.cu): runs p and returns true
// when p.options.kernel and the call allow it (AttentionKernel), else false
// (the caller runs the mma.sync kernels); throws for a forced sm90 kernel
// that cannot run p.
bool attention_forward_sm90(const AttentionForwardParams& p, StreamHandle stream);
// The Hopper backward's main kernel (src/ops/attention_bwd_sm90.cu), called by
// the head-dim launchers between D = rowsum(dO o) and the dq conversion: runs
// p and returns true when p.options.kernel selects it (sm90; automatic only
// with SLIME_ATTENTION_SM90_BWD=1 until its speed is measured), else false
// (the mma.sync main kernel runs); the deterministic backward is always the
// mma.sync one. Throws for a forced sm90 kernel that cannot run p.
bool attention_backward_sm90(const AttentionBackwardParams& p, StreamHandle stream);
// One explicit instantiation per head dim, each in its own translation unit
// (src/ops/attention_fwd_hd<D>.cu, attention_bwd_hd<D>.cu).
template <int kHeadDim>
void attention_forward_launch(const AttentionForwardParams& p, StreamHandle stream);
template <int kHeadDim>
void attention_backward_launch(const AttentionBackwardParams& p, StreamHandle stream);
}  // namespace detail

}  // namespace slime::ops::cuda
#endif
