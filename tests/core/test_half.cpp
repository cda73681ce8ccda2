// bf16 / fp16 host conversions: round-to-nearest-even against an independent
// reference (exact arithmetic on doubles), edge cases, and, when the CUDA
// toolkit is present, bit equality with CUDA's own host conversions.
#include <catch2/catch_test_macros.hpp>

#include <cmath>
#include <cstdint>
#include <limits>

#include "slime/core/half.hpp"

#if SLIME_HAS_CUDA
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

using slime::BFloat16;
using slime::Half;
using slime::detail::bits_float;
using slime::detail::float_bits;

namespace {

// Reference rounding of a finite float to a format with `mant_bits` explicit
// mantissa bits, minimum normal exponent `emin` and max finite `max_finite`:
// picks the nearer of the two neighbours by exact double arithmetic, ties to
// the even one. Independent of the bit tricks in half.hpp.
double round_to_format(double x, int mant_bits, int emin, double max_finite) {
  if (x == 0) return x;
  const double ax = std::fabs(x);
  int e = std::ilogb(ax);
  if (e < emin) e = emin;  // subnormal spacing
  const double ulp = std::ldexp(1.0, e - mant_bits);
  const double lo = std::floor(ax / ulp) * ulp;
  const double hi = lo + ulp;
  double r;
  if (ax - lo < hi - ax) {
    r = lo;
  } else if (ax - lo > hi - ax) {
    r = hi;
  } else {
    r = (std::fmod(lo / ulp, 2.0) == 0.0) ? lo : hi;
  }
  // Overflow: anything that rounds past the largest finite value is inf
  // (IEEE: values >= max + ulp/2 round to inf).
  if (r > max_finite) r = std::numeric_limits<double>::infinity();
  return std::copysign(r, x);
}

double bf16_reference(float f) { return round_to_format(f, 7, -126, 0x1.fep127); }
double fp16_reference(float f) { return round_to_format(f, 10, -14, 65504.0); }

// Deterministic sweep over float bit patterns: all exponents, many mantissas.
template <class F>
void sweep_floats(uint32_t stride, F&& f) {
  for (uint64_t u = 0; u <= 0xffffffffull; u += stride) f(uint32_t(u));
}

}  // namespace

TEST_CASE("bf16 round-to-nearest-even matches exact reference", "[core][half]") {
  int64_t checked = 0;
  sweep_floats(9973, [&](uint32_t u) {
    const float f = bits_float(u);
    if (std::isnan(f)) return;
    const float got = BFloat16(f).to_float();
    const double want = bf16_reference(f);
    if (double(got) != want) {
      INFO("bits 0x" << std::hex << u << " value " << f);
      REQUIRE(double(got) == want);
    }
    ++checked;
  });
  CHECK(checked > 400000);
}

TEST_CASE("fp16 round-to-nearest-even matches exact reference", "[core][half]") {
  int64_t checked = 0;
  sweep_floats(9973, [&](uint32_t u) {
    const float f = bits_float(u);
    if (std::isnan(f)) return;
    const float got = Half(f).to_float();
    const double want = fp16_reference(f);
    if (double(got) != want) {
      INFO("bits 0x" << std::hex << u << " value " << f);
      REQUIRE(double(got) == want);
    }
    ++checked;
  });
  CHECK(checked > 400000);
}

TEST_CASE("bf16 and fp16 edge cases", "[core][half]") {
  // Ties go to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 in bf16.
  CHECK(BFloat16(1.0f + 0x1p-8f).bits == 0x3f80);
  CHECK(BFloat16(1.0f + 3 * 0x1p-8f).bits == 0x3f82);   // tie between 0x3f81 and 0x3f82 -> even
  CHECK(BFloat16(1.0f + 0x1p-8f + 0x1p-20f).bits == 0x3f81);  // just above the tie
  CHECK(BFloat16(-0.0f).bits == 0x8000);
  CHECK(BFloat16(std::numeric_limits<float>::infinity()).bits == 0x7f80);
  CHECK(BFloat16(-std::numeric_limits<float>::infinity()).bits == 0xff80);
  CHECK(BFloat16(std::numeric_limits<float>::quiet_NaN()).bits == 0x7fff);
  CHECK(BFloat16(bits_float(0xffc00001u)).bits == 0x7fff);  // negative NaN -> canonical
  CHECK(BFloat16(std::numeric_limits<float>::max()).bits == 0x7f80);  // rounds up to inf
  CHECK(BFloat16(bits_float(0x00000001u)).bits == 0x0000);  // smallest subnormal
  CHECK(BFloat16(bits_float(0x00008000u)).bits == 0x0000);  // tie to even 0
  CHECK(BFloat16(bits_float(0x00018000u)).bits == 0x0002);  // tie to even 2

  CHECK(Half(65504.0f).bits == 0x7bff);
  CHECK(Half(65519.99f).bits == 0x7bff);
  CHECK(Half(65520.0f).bits == 0x7c00);  // the tie above max finite goes to inf
  CHECK(Half(1e9f).bits == 0x7c00);
  CHECK(Half(-1e9f).bits == 0xfc00);
  CHECK(Half(0x1p-24f).bits == 0x0001);   // smallest subnormal
  CHECK(Half(0x1p-25f).bits == 0x0000);   // tie between 0 and 2^-24 -> 0
  CHECK(Half(0x1.8p-24f).bits == 0x0002); // tie between 1 and 2 ulps -> 2
  CHECK(Half(0x1p-14f).bits == 0x0400);   // smallest normal
  CHECK(Half(0x1.ff8p-15f).bits == 0x03ff);  // largest subnormal
  CHECK(Half(0x1.ffcp-15f).bits == 0x0400);  // ... + half an ulp: tie, rounds up to the smallest normal
  CHECK(Half(-0.0f).bits == 0x8000);
  CHECK(Half(std::numeric_limits<float>::quiet_NaN()).bits == 0x7fff);
  CHECK(Half(1.0f + 0x1p-11f).bits == 0x3c00);       // tie -> even
  CHECK(Half(1.0f + 3 * 0x1p-11f).bits == 0x3c02);   // tie -> even
}

TEST_CASE("every bf16 and fp16 value converts to float and back exactly", "[core][half]") {
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const auto h = uint16_t(b);
    const float fb = BFloat16::from_bits(h).to_float();
    const float fh = Half::from_bits(h).to_float();
    if (std::isnan(fb)) {
      CHECK(BFloat16(fb).bits == 0x7fff);
    } else if (BFloat16(fb).bits != h) {
      FAIL("bf16 0x" << std::hex << b << " does not round-trip");
    }
    if (std::isnan(fh)) {
      CHECK(float_bits(fh) == 0x7fffffffu);
      CHECK(Half(fh).bits == 0x7fff);
    } else {
      if (Half(fh).bits != h) FAIL("fp16 0x" << std::hex << b << " does not round-trip");
      // fp16 -> float is exact: compare with the value by its definition.
      const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
      const double mag = e == 0 ? std::ldexp(m, -24) : e == 31 ? INFINITY : std::ldexp(1024 + m, e - 25);
      if (double(fh) != ((h & 0x8000) ? -mag : mag)) FAIL("fp16 0x" << std::hex << b << " decodes wrong");
    }
  }
}

#if SLIME_HAS_CUDA
TEST_CASE("host conversions are bit-identical to CUDA's host conversions", "[core][half]") {
  // CUDA's cuda_bf16.h / cuda_fp16.h host paths implement the same RNE rules
  // as the hardware cvt instructions; the GPU test compares against those.
  sweep_floats(4099, [&](uint32_t u) {
    const float f = bits_float(u);
    const __nv_bfloat16 cb = __float2bfloat16_rn(f);
    const __half ch = __float2half_rn(f);
    uint16_t cbb, chb;
    std::memcpy(&cbb, &cb, 2);
    std::memcpy(&chb, &ch, 2);
    if (BFloat16(f).bits != cbb) FAIL("bf16 mismatch at 0x" << std::hex << u);
    if (Half(f).bits != chb) FAIL("fp16 mismatch at 0x" << std::hex << u);
  });
  for (uint32_t b = 0; b <= 0xffff; ++b) {
    const uint16_t hb = uint16_t(b);
    __half_raw raw;
    raw.x = hb;
    const float want = __half2float(__half(raw));
    if (float_bits(Half::from_bits(hb).to_float()) != float_bits(want)) FAIL("fp16->f32 mismatch at 0x" << std::hex << b);
  }
  SUCCEED();
}
#endif
