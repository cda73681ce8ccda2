// Host dispatch of the attention kernels (head_dim -> the per-variant
// translation units) and the merge of partial attention results.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "slime/ops/cuda/attention.hpp"

namespace slime::ops::cuda {

void attention_forward(const AttentionForwardParams& p, StreamHandle stream) {
  if (detail::attention_forward_sm90(p, stream)) return;
  visit_head_dim(p.head_dim, [&](auto hd) { detail::attention_forward_launch<decltype(hd)::value>(p, stream); });
}

void attention_backward(const AttentionBackwardParams& p, StreamHandle stream) {
  visit_head_dim(p.fwd.head_dim, [&](auto hd) { detail::attention_backward_launch<decltype(hd)::value>(p, stream); });
}

namespace {

__device__ __forceinline__ float load_f(const float* p) { return *p; }
__device__ __forceinline__ float load_f(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store_f(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_f(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// One warp per row (token, head): every lane reads lse1 and lse2 before lane 0
// writes lse, so lse may alias either input; o[i] is written by the thread
// that read o1[i] and o2[i], so o may alias either too. A part with
// lse = -inf (no key) contributes nothing, whatever its o holds.
template <class T1, class T2, class TO>
__global__ void merge_partials_kernel(const T1* o1, const float* lse1, const T2* o2, const float* lse2, TO* o,
                                      float* lse, int64_t rows, int64_t d) {
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = int(threadIdx.x % 32);
  if (row >= rows) return;  // uniform per warp
  const float a = lse1[row], b = lse2[row];
  const float m = fmaxf(a, b);
  float w1 = 0.f, w2 = 0.f, out = -INFINITY;
  if (m != -INFINITY) {
    w1 = expf(a - m);
    w2 = expf(b - m);
    const float s = w1 + w2;
    out = m + logf(s);
    w1 /= s;
    w2 /= s;
  }
  for (int64_t c = lane; c < d; c += 32) {
    const int64_t i = row * d + c;
    float v = 0.f;
    if (w1 != 0.f) v += w1 * load_f(o1 + i);
    if (w2 != 0.f) v += w2 * load_f(o2 + i);
    store_f(o + i, v);
  }
  __syncwarp();
  if (lane == 0) lse[row] = out;
}

template <class F>
void visit_float_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32:
      f(static_cast<float*>(nullptr));
      return;
    case DType::bf16:
      f(static_cast<__nv_bfloat16*>(nullptr));
      return;
    default:
      break;
  }
  SLIME_FAIL("merge_attention_partials on CUDA needs f32 or bf16 outputs, got ", dtype_name(t));
}

}  // namespace

void merge_attention_partials(const void* o1, DType o1_dtype, const float* lse1, const void* o2, DType o2_dtype,
                              const float* lse2, void* o, DType o_dtype, float* lse, int64_t rows, int64_t head_dim,
                              StreamHandle stream) {
  if (rows == 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = (rows * 32 + kThreads - 1) / kThreads;
  SLIME_CHECK(blocks <= 0x7fffffff, "merge_attention_partials: ", rows, " rows is too many for one launch");
  visit_float_dtype(o1_dtype, [&](auto* t1) {
    visit_float_dtype(o2_dtype, [&](auto* t2) {
      visit_float_dtype(o_dtype, [&](auto* to) {
        using T1 = std::remove_pointer_t<decltype(t1)>;
        using T2 = std::remove_pointer_t<decltype(t2)>;
        using TO = std::remove_pointer_t<decltype(to)>;
        merge_partials_kernel<T1, T2, TO>
            <<<unsigned(blocks), kThreads, 0, stream>>>(static_cast<const T1*>(o1), lse1, static_cast<const T2*>(o2),
                                                        lse2, static_cast<TO*>(o), lse, rows, head_dim);
      });
    });
  });
  SLIME_CUDA_CHECK_LAUNCH();
}

}  // namespace slime::ops::cuda
