// CUDA fills for slime/core/random.hpp: one thread per element, each computing
// its own Philox word, so values do not depend on the launch shape.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "slime/core/random.hpp"

namespace slime::detail::cuda {
namespace {

constexpr int kThreads = 256;

template <class T>
__device__ void store(T* p, float v) {
  if constexpr (std::is_same_v<T, float>) {
    *p = v;
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    // Hardware cvt.rn.bf16.f32: the host BFloat16 conversion matches it bit for bit.
    *reinterpret_cast<__nv_bfloat16*>(p) = __float2bfloat16_rn(v);
  } else {
    *reinterpret_cast<__half*>(p) = __float2half_rn(v);
  }
}

struct UniformParams {
  uint64_t seed, offset;
  float low, high;
};
struct NormalParams {
  uint64_t seed, offset;
  float mean, stddev;
};

template <class T>
__global__ void fill_uniform_kernel(T* out, int64_t n, UniformParams p) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store(out + i, random_uniform(p.seed, p.offset + uint64_t(i), p.low, p.high));
}

template <class T>
__global__ void fill_normal_kernel(T* out, int64_t n, NormalParams p) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store(out + i, fma_f32(p.stddev, random_normal(p.seed, p.offset + uint64_t(i)), p.mean));
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return unsigned(std::min<int64_t>(blocks, 65535 * 8));
}

template <class Launch>
void dispatch_float(DType dtype, Launch&& launch) {
  switch (dtype) {
    case DType::f32: launch(static_cast<float*>(nullptr)); break;
    case DType::bf16: launch(static_cast<BFloat16*>(nullptr)); break;
    case DType::f16: launch(static_cast<Half*>(nullptr)); break;
    default: SLIME_FAIL("random fill needs a floating dtype, got ", dtype_name(dtype));
  }
}

}  // namespace

void fill_uniform(void* data, DType dtype, int64_t n, uint64_t seed, uint64_t offset, float low, float high,
                  StreamHandle stream) {
  if (n == 0) return;
  dispatch_float(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    fill_uniform_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(static_cast<T*>(data), n,
                                                                 UniformParams{seed, offset, low, high});
  });
  SLIME_CUDA_CHECK_LAUNCH();
}

void fill_normal(void* data, DType dtype, int64_t n, uint64_t seed, uint64_t offset, float mean, float stddev,
                 StreamHandle stream) {
  if (n == 0) return;
  dispatch_float(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    fill_normal_kernel<T><<<grid_for(n), kThreads, 0, stream>>>(static_cast<T*>(data), n,
                                                                NormalParams{seed, offset, mean, stddev});
  });
  SLIME_CUDA_CHECK_LAUNCH();
}

}  // namespace slime::detail::cuda
