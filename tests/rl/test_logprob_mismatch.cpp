// rl::logprob_mismatch: the engine/trainer logprob gap over the loss tokens
// (max, mean, fraction of tokens whose bits differ), against values worked out
// by hand; combining micro-batches; bad inputs.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "slime/core/tensor.hpp"
#include "slime/rl/logprob_mismatch.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::WithinAbs;

TEST_CASE("logprob_mismatch by hand: only loss tokens count, bits decide a mismatch") {
  // Token 0 is a prompt token (mask 0) with a huge gap that must not count.
  // Loss tokens: equal, 0.25 apart, -0 vs +0 (equal values, different bits), 0.5 apart.
  const std::vector<float> trainer = {-9.f, -1.f, -2.f, -0.f, -3.f};
  const std::vector<float> rollout = {0.f, -1.f, -2.25f, 0.f, -2.5f};
  const std::vector<uint8_t> mask = {0, 1, 1, 1, 1};
  const rl::LogprobMismatch m = rl::logprob_mismatch(Tensor::from_vector(trainer, {5}),
                                                     Tensor::from_vector(rollout, {5}), Tensor::from_vector(mask, {5}));
  REQUIRE(m.tokens == 4);
  REQUIRE(m.mismatched == 3);
  REQUIRE(m.max_abs_diff() == 0.5);
  REQUIRE_THAT(m.mean_abs_diff(), WithinAbs(0.75 / 4, 1e-15));
  REQUIRE(m.mismatch_fraction() == 0.75);
}

TEST_CASE("logprob_mismatch is zero for identical logprobs and counts a NaN as an infinite gap") {
  const std::vector<float> lp = {-0.5f, -1.5f, -7.f};
  const std::vector<uint8_t> mask = {1, 1, 1};
  const rl::LogprobMismatch same = rl::logprob_mismatch(lp.data(), lp.data(), mask.data(), 3);
  REQUIRE(same.tokens == 3);
  REQUIRE(same.mismatched == 0);
  REQUIRE(same.max_abs_diff() == 0);
  REQUIRE(same.mean_abs_diff() == 0);
  std::vector<float> nan = lp;
  nan[1] = std::numeric_limits<float>::quiet_NaN();
  const rl::LogprobMismatch bad = rl::logprob_mismatch(nan.data(), lp.data(), mask.data(), 3);
  REQUIRE(bad.mismatched == 1);
  REQUIRE(std::isinf(bad.max_abs_diff()));
}

TEST_CASE("logprob_mismatch of micro-batches combines to the whole batch's") {
  std::vector<float> a(37), b(37);
  std::vector<uint8_t> mask(37);
  for (int i = 0; i < 37; ++i) {
    a[std::size_t(i)] = -0.1f * float(i);
    b[std::size_t(i)] = a[std::size_t(i)] + (i % 3 == 0 ? 0.f : 0.01f * float(i % 7));
    mask[std::size_t(i)] = i % 5 != 0;
  }
  const rl::LogprobMismatch whole = rl::logprob_mismatch(a.data(), b.data(), mask.data(), 37);
  rl::LogprobMismatch parts = rl::logprob_mismatch(a.data(), b.data(), mask.data(), 20);
  parts += rl::logprob_mismatch(a.data() + 20, b.data() + 20, mask.data() + 20, 17);
  REQUIRE(parts.tokens == whole.tokens);
  REQUIRE(parts.mismatched == whole.mismatched);
  REQUIRE(parts.max_abs_diff() == whole.max_abs_diff());
  REQUIRE_THAT(parts.abs_diff_sum, WithinAbs(whole.abs_diff_sum, 1e-12));
  REQUIRE(whole.mismatched > 0);
  REQUIRE(whole.mismatched < whole.tokens);
}

TEST_CASE("logprob_mismatch refuses tensors it cannot compare") {
  const Tensor lp = Tensor::from_vector(std::vector<float>{-1.f, -2.f}, {2});
  const Tensor mask = Tensor::from_vector(std::vector<uint8_t>{1, 1}, {2});
  const Tensor short_lp = Tensor::from_vector(std::vector<float>{-1.f}, {1});
  const Tensor i32 = Tensor::from_vector(std::vector<int32_t>{-1, -2}, {2});
  REQUIRE_THROWS_WITH(rl::logprob_mismatch(lp, short_lp, mask), ContainsSubstring("rollout_lp"));
  REQUIRE_THROWS_WITH(rl::logprob_mismatch(lp, i32, mask), ContainsSubstring("f32"));
  REQUIRE_THROWS_WITH(rl::logprob_mismatch(lp, lp, lp), ContainsSubstring("loss_mask"));
  REQUIRE_THROWS_WITH(rl::logprob_mismatch(Tensor(), lp, mask), ContainsSubstring("undefined"));
}
