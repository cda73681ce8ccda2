// slime/core/half.hpp: host/device bf16 and fp16 storage types with
// round-to-nearest-even conversion, bit-compatible with CUDA's __nv_bfloat16
// and __half (same layout, same rounding, NaN -> canonical 0x7FFF).
#pragma once

#include <cstdint>
#include <cstring>

#include "slime/core/macros.hpp"

namespace slime {

namespace detail {

SLIME_HOST_DEVICE uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

SLIME_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// fp32 -> bf16 bits, round to nearest, ties to even. NaN maps to 0x7FFF as
// CUDA does (sign dropped); overflow rounds to +-inf naturally.
SLIME_HOST_DEVICE uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  const uint32_t lsb = (u >> 16) & 1u;
  return static_cast<uint16_t>((u + 0x7fffu + lsb) >> 16);
}

SLIME_HOST_DEVICE float bf16_bits_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

// fp32 -> fp16 bits, round to nearest, ties to even, with fp16 subnormals,
// overflow to +-inf, and NaN -> 0x7FFF as CUDA does.
SLIME_HOST_DEVICE uint16_t float_to_fp16_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fffu;             // NaN
  if (a >= 0x47800000u) return uint16_t(sign | 0x7c00u);  // >= 65536 -> inf (65520 handled below)
  if (a >= 0x38800000u) {                          // normal fp16 range: >= 2^-14
    // Re-bias the exponent (127 -> 15) and round the 13 dropped mantissa bits.
    const uint32_t lsb = (a >> 13) & 1u;
    const uint32_t r = (a - 0x38000000u + 0xfffu + lsb) >> 13;  // may carry into inf: correct
    return uint16_t(sign | r);
  }
  if (a < 0x33000000u) return uint16_t(sign);       // < 2^-25: rounds to zero
  // Subnormal fp16: value = m * 2^-24 with m < 1024. Shift the full 24-bit
  // significand right and round to nearest even.
  const uint32_t exp = a >> 23;                     // 102..112
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exp;                // 14..24
  const uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  const uint32_t r = q + ((rem > half || (rem == half && (q & 1u))) ? 1u : 0u);
  return uint16_t(sign | r);
}

// fp16 bits -> fp32, exact; every NaN maps to the canonical 0x7FFFFFFF (sign
// dropped) as CUDA's conversion does.
SLIME_HOST_DEVICE float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(mant ? 0x7fffffffu : (sign | 0x7f800000u));
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return bits_float(sign);
  // Subnormal: normalise.
  uint32_t e = 113u;
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return bits_float(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

}  // namespace detail

// bf16 storage type: 1 sign, 8 exponent, 7 mantissa bits. Arithmetic happens
// in fp32; the type only stores.
struct BFloat16 {
  uint16_t bits = 0;

  BFloat16() = default;
  SLIME_HOST_DEVICE explicit BFloat16(float f) : bits(detail::float_to_bf16_bits(f)) {}
  SLIME_HOST_DEVICE static BFloat16 from_bits(uint16_t b) {
    BFloat16 r;
    r.bits = b;
    return r;
  }
  SLIME_HOST_DEVICE explicit operator float() const { return detail::bf16_bits_to_float(bits); }
  SLIME_HOST_DEVICE float to_float() const { return detail::bf16_bits_to_float(bits); }
};

// fp16 storage type: 1 sign, 5 exponent, 10 mantissa bits.
struct Half {
  uint16_t bits = 0;

  Half() = default;
  SLIME_HOST_DEVICE explicit Half(float f) : bits(detail::float_to_fp16_bits(f)) {}
  SLIME_HOST_DEVICE static Half from_bits(uint16_t b) {
    Half r;
    r.bits = b;
    return r;
  }
  SLIME_HOST_DEVICE explicit operator float() const { return detail::fp16_bits_to_float(bits); }
  SLIME_HOST_DEVICE float to_float() const { return detail::fp16_bits_to_float(bits); }
};

static_assert(sizeof(BFloat16) == 2 && sizeof(Half) == 2, "16-bit storage types must be 2 bytes");

}  // namespace slime
