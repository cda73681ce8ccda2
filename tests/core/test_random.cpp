// Philox4x32-10 against the published known-answer vectors, and the fill
// contract: values depend only on (seed, element index), never on how a fill
// is split.
#include <catch2/catch_test_macros.hpp>

#include <cmath>

#include "slime/core/random.hpp"

using namespace slime;

TEST_CASE("philox4x32-10 known-answer vectors (Random123)", "[core][random]") {
  auto check = [](PhiloxBlock b, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3) {
    CHECK(b.v[0] == a0);
    CHECK(b.v[1] == a1);
    CHECK(b.v[2] == a2);
    CHECK(b.v[3] == a3);
  };
  check(philox4x32_10(0, 0, 0, 0, 0, 0), 0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u);
  check(philox4x32_10(0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu), 0x408f276du,
        0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu);
  check(philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u), 0xd16cfe09u,
        0x94fdccebu, 0x5001e420u, 0x24126ea1u);
}

TEST_CASE("a sharded fill reproduces the unsharded fill", "[core][random]") {
  const int64_t n = 1001;  // odd: shards straddle Philox blocks
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    Tensor full = Tensor::empty({n}, dt);
    fill_uniform(full, 42, 7, -2.f, 3.f);
    const int64_t cut = 333;
    Tensor a = Tensor::empty({cut}, dt), b = Tensor::empty({n - cut}, dt);
    fill_uniform(a, 42, 7, -2.f, 3.f);
    fill_uniform(b, 42, 7 + cut, -2.f, 3.f);
    const auto* pf = static_cast<const uint8_t*>(full.data_ptr());
    CHECK(std::memcmp(pf, a.data_ptr(), a.nbytes()) == 0);
    CHECK(std::memcmp(pf + a.nbytes(), b.data_ptr(), b.nbytes()) == 0);

    Tensor nf = Tensor::empty({n}, dt), nb = Tensor::empty({n - cut}, dt);
    fill_normal(nf, 5, 0, 1.f, 2.f);
    fill_normal(nb, 5, cut, 1.f, 2.f);
    CHECK(std::memcmp(static_cast<const uint8_t*>(nf.data_ptr()) + cut * dtype_size(dt), nb.data_ptr(),
                      nb.nbytes()) == 0);
  }
}

TEST_CASE("uniform and normal fills have the right range and moments", "[core][random]") {
  const int64_t n = 200000;
  Tensor u = Tensor::empty({n}, DType::f32);
  fill_uniform(u, 1, 0, -1.f, 1.f);
  Tensor g = Tensor::empty({n}, DType::f32);
  fill_normal(g, 2, 0, 3.f, 0.5f);
  double su = 0, sg = 0, sg2 = 0;
  const float* pu = u.data<float>();
  const float* pg = g.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    REQUIRE(pu[i] >= -1.f);
    REQUIRE(pu[i] < 1.f);
    REQUIRE(std::isfinite(pg[i]));
    su += pu[i];
    sg += pg[i];
    sg2 += double(pg[i]) * pg[i];
  }
  const double mean_g = sg / n, var_g = sg2 / n - mean_g * mean_g;
  CHECK(std::fabs(su / n) < 0.01);              // uniform mean 0, sd of the mean ~0.0013
  CHECK(std::fabs(mean_g - 3.0) < 0.01);        // sd of the mean ~0.0011
  CHECK(std::fabs(std::sqrt(var_g) - 0.5) < 0.01);
}

TEST_CASE("different seeds and offsets give different streams", "[core][random]") {
  CHECK(philox_word(1, 0) != philox_word(2, 0));
  CHECK(philox_word(1, 0) != philox_word(1, 1));
  CHECK(philox_word(1, 4) != philox_word(1, 0));
  CHECK(philox_word(uint64_t(1) << 32, 0) != philox_word(0, 0));  // the seed's high word is used
  CHECK(philox_word(0, uint64_t(4) << 32) != philox_word(0, 0));  // the index's high word is used
}

TEST_CASE("random fills reject bad input", "[core][random]") {
  Tensor i = Tensor::empty({4}, DType::i32);
  CHECK_THROWS_AS(fill_uniform(i, 0, 0, 0.f, 1.f), Error);
  Tensor f = Tensor::empty({4}, DType::f32);
  CHECK_THROWS_AS(fill_uniform(f, 0, 0, 1.f, 0.f), Error);
  CHECK_THROWS_AS(fill_normal(f, 0, 0, 0.f, -1.f), Error);
  Tensor undefined;
  CHECK_THROWS_AS(fill_uniform(undefined, 0, 0, 0.f, 1.f), Error);
}
