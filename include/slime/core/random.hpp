// slime/core/random.hpp: counter-based random numbers (Philox4x32-10) that
// give the same values on the CPU and the GPU for the same (seed, offset), and
// tensor fills built on them.
//
// Element j of a stream keyed by `seed` is lane j % 4 of the Philox block at
// counter j / 4. A fill of n elements at `offset` takes elements offset ..
// offset + n - 1, so sharded fills (rank r at offset r * n) reproduce one
// unsharded fill exactly, and a fill never depends on the launch shape.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

#include "slime/core/macros.hpp"
#include "slime/core/tensor.hpp"

namespace slime {

struct PhiloxBlock {
  uint32_t v[4];
};

namespace detail {

SLIME_HOST_DEVICE uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = uint64_t(a) * uint64_t(b);
  *hi = uint32_t(p >> 32);
  return uint32_t(p);
}

SLIME_HOST_DEVICE float fma_f32(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

}  // namespace detail

// Philox4x32 with 10 rounds (Salmon et al., SC'11), counter (c0..c3), key
// (k0, k1). Pure integer arithmetic: bitwise identical on host and device.
SLIME_HOST_DEVICE PhiloxBlock philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                           uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = detail::mulhilo32(kM0, c0, &hi0);
    const uint32_t lo1 = detail::mulhilo32(kM1, c2, &hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kW0;
    k1 += kW1;
  }
  return {{c0, c1, c2, c3}};
}

// The 32-bit random word at position `index` of the stream keyed by `seed`.
SLIME_HOST_DEVICE uint32_t philox_word(uint64_t seed, uint64_t index) {
  const uint64_t block = index >> 2;
  const PhiloxBlock b = philox4x32_10(uint32_t(block), uint32_t(block >> 32), 0u, 0u, uint32_t(seed),
                                      uint32_t(seed >> 32));
  return b.v[index & 3u];
}

// A word to [0, 1): the top 24 bits, so every value is an exact float.
SLIME_HOST_DEVICE float uniform01(uint32_t word) { return float(word >> 8) * (1.0f / 16777216.0f); }
// A word to (0, 1]: safe for log().
SLIME_HOST_DEVICE float uniform01_open_low(uint32_t word) { return float((word >> 8) + 1u) * (1.0f / 16777216.0f); }

// Uniform in [low, high) at stream position `index`; one correctly rounded fma,
// so host and device agree bit for bit.
SLIME_HOST_DEVICE float random_uniform(uint64_t seed, uint64_t index, float low, float high) {
  return detail::fma_f32(high - low, uniform01(philox_word(seed, index)), low);
}

// Standard normal at stream position `index` by Box-Muller over the word pair
// (index & ~1, index | 1), in double precision. Host libm and CUDA's log/cos
// may differ in the last double bit, so a value can differ by one float ulp
// between CPU and GPU (rarely); uniforms never differ.
SLIME_HOST_DEVICE float random_normal(uint64_t seed, uint64_t index) {
  const uint64_t pair = index & ~uint64_t(1);
  const double u1 = double(uniform01_open_low(philox_word(seed, pair)));
  const double u2 = double(uniform01(philox_word(seed, pair + 1)));
  const double r = sqrt(-2.0 * log(u1));
  const double theta = 6.283185307179586476925286766559 * u2;
  return float((index & 1u) ? r * sin(theta) : r * cos(theta));
}

#if SLIME_HAS_CUDA
namespace detail::cuda {
// Defined in src/core/random.cu.
void fill_uniform(void* data, DType dtype, int64_t n, uint64_t seed, uint64_t offset, float low, float high,
                  StreamHandle stream);
void fill_normal(void* data, DType dtype, int64_t n, uint64_t seed, uint64_t offset, float mean, float stddev,
                 StreamHandle stream);
}  // namespace detail::cuda
#endif

namespace detail {
template <class T>
void store_float(T* p, float v) {
  if constexpr (std::is_same_v<T, float>) {
    *p = v;
  } else {
    *p = T(v);
  }
}

inline void check_random_fill(const Tensor& t, const char* what) {
  SLIME_CHECK(t.defined(), what, " on an undefined tensor");
  SLIME_CHECK(is_floating(t.dtype()), what, " needs a floating tensor (f32, bf16, f16), got ", t.str());
}
}  // namespace detail

// Fills `t` with uniform values in [low, high), rounded to its dtype.
inline void fill_uniform(Tensor& t, uint64_t seed, uint64_t offset, float low, float high,
                         [[maybe_unused]] const Stream& stream = {}) {
  detail::check_random_fill(t, "fill_uniform");
  SLIME_CHECK(low <= high, "fill_uniform: low ", low, " > high ", high);
  if (t.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = stream.device() == t.device() ? stream : Stream::default_for(t.device());
    DeviceGuard guard(t.device());
    detail::cuda::fill_uniform(t.data_ptr(), t.dtype(), t.numel(), seed, offset, low, high, s.handle());
#endif
    return;
  }
  visit_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
      T* p = t.data<T>();
      for (int64_t i = 0; i < t.numel(); ++i) detail::store_float(p + i, random_uniform(seed, offset + uint64_t(i), low, high));
    }
  });
}

// Fills `t` with normal values: mean + stddev * N(0, 1), rounded to its dtype.
inline void fill_normal(Tensor& t, uint64_t seed, uint64_t offset, float mean, float stddev,
                        [[maybe_unused]] const Stream& stream = {}) {
  detail::check_random_fill(t, "fill_normal");
  SLIME_CHECK(stddev >= 0.f, "fill_normal: negative stddev ", stddev);
  if (t.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = stream.device() == t.device() ? stream : Stream::default_for(t.device());
    DeviceGuard guard(t.device());
    detail::cuda::fill_normal(t.data_ptr(), t.dtype(), t.numel(), seed, offset, mean, stddev, s.handle());
#endif
    return;
  }
  visit_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
      T* p = t.data<T>();
      for (int64_t i = 0; i < t.numel(); ++i)
        detail::store_float(p + i, detail::fma_f32(stddev, random_normal(seed, offset + uint64_t(i)), mean));
    }
  });
}

}  // namespace slime
