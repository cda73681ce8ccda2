// Advantages: GRPO (group mean, unbiased std, groups of one), broadcast to
// response tokens, REINFORCE++ returns and its group-baseline variant, against
// values worked out by hand; bad inputs.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "slime/rl/advantages.hpp"

using namespace slime;
using namespace slime::rl;
using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::WithinAbs;

TEST_CASE("grpo advantages by hand") {
  // Group 0: rewards 1 0 1 0, mean 0.5, deviations ±0.5, unbiased var = 4·0.25/3 = 1/3.
  // Group 1: one sample (3): r − mean = 0, std normalisation off.
  // Group 2: 2 4, mean 3: ∓1, unbiased std = sqrt(2), so ∓1/(sqrt 2 + 1e-6).
  const std::vector<double> r = {1, 0, 1, 0, 3, 2, 4};
  const std::vector<int64_t> groups = {4, 1, 2};
  std::vector<double> a(r.size());
  cpu::grpo_advantages(r.data(), int64_t(r.size()), groups.data(), 3, true, a.data());
  const double s0 = 0.5 / (std::sqrt(1.0 / 3.0) + 1e-6), s2 = 1 / (std::sqrt(2.0) + 1e-6);
  const std::vector<double> expected = {s0, -s0, s0, -s0, 0, -s2, s2};
  for (std::size_t i = 0; i < r.size(); ++i) REQUIRE_THAT(a[i], WithinAbs(expected[i], 1e-12));

  cpu::grpo_advantages(r.data(), int64_t(r.size()), groups.data(), 3, false, a.data());
  const std::vector<double> centred = {0.5, -0.5, 0.5, -0.5, 0, -1, 1};
  for (std::size_t i = 0; i < r.size(); ++i) REQUIRE_THAT(a[i], WithinAbs(centred[i], 1e-15));

  // A group of identical rewards: 0, not NaN (std 0 + 1e-6).
  const std::vector<double> same = {2, 2, 2};
  const std::vector<int64_t> one = {3};
  cpu::grpo_advantages(same.data(), 3, one.data(), 1, true, a.data());
  for (int i = 0; i < 3; ++i) REQUIRE(a[std::size_t(i)] == 0);

  // Tensor API = template in float.
  const Tensor t =
      grpo_advantages(Tensor::from_vector(std::vector<float>{1, 0, 1, 0, 3, 2, 4}, Shape{7}), groups, true);
  const auto v = t.to_vector<float>();
  for (std::size_t i = 0; i < v.size(); ++i) REQUIRE_THAT(double(v[i]), WithinAbs(expected[i], 1e-6));
}

TEST_CASE("grpo advantages reject bad groups") {
  const std::vector<double> r = {1, 2, 3};
  std::vector<double> a(3);
  const std::vector<int64_t> negative = {4, -1};
  REQUIRE_THROWS_WITH(cpu::grpo_advantages(r.data(), 3, negative.data(), 2, true, a.data()),
                      ContainsSubstring("negative size -1"));
  const std::vector<int64_t> short_sum = {2};
  REQUIRE_THROWS_WITH(cpu::grpo_advantages(r.data(), 3, short_sum.data(), 1, true, a.data()),
                      ContainsSubstring("sum to 2 but there are 3 rewards"));
  const std::vector<int64_t> with_empty = {0, 3, 0};
  REQUIRE_NOTHROW(cpu::grpo_advantages(r.data(), 3, with_empty.data(), 3, true, a.data()));
}

TEST_CASE("broadcast to response tokens") {
  // Two sequences [0, 3) and [3, 5); mask 0 1 1 | 0 1; values 2, -1.
  const std::vector<int32_t> cu = {0, 3, 5};
  const std::vector<uint8_t> mask = {0, 1, 1, 0, 1};
  const std::vector<double> v = {2, -1};
  std::vector<double> out(5, 99);
  cpu::broadcast_to_tokens(v.data(), 2, nullptr, cu.data(), 2, mask.data(), 5, out.data());
  REQUIRE(out == std::vector<double>{0, 2, 2, 0, -1});
  // Sequence 0 holds sample 1, sequence 1 is padding.
  const std::vector<int32_t> index = {1, -1};
  cpu::broadcast_to_tokens(v.data(), 2, index.data(), cu.data(), 2, mask.data(), 5, out.data());
  REQUIRE(out == std::vector<double>{0, -1, -1, 0, 0});
  const std::vector<int32_t> bad_index = {2, 0};
  REQUIRE_THROWS_WITH(cpu::broadcast_to_tokens(v.data(), 2, bad_index.data(), cu.data(), 2, mask.data(), 5, out.data()),
                      ContainsSubstring("out of range"));
  const std::vector<int32_t> bad_cu = {0, 3, 4};
  REQUIRE_THROWS_WITH(cpu::broadcast_to_tokens(v.data(), 2, nullptr, bad_cu.data(), 2, mask.data(), 5, out.data()),
                      ContainsSubstring("must equal the number of tokens 5"));
  const std::vector<int32_t> decreasing = {0, 4, 3, 5};
  REQUIRE_THROWS_WITH(cpu::broadcast_to_tokens(v.data(), 2, nullptr, decreasing.data(), 3, mask.data(), 5, out.data()),
                      ContainsSubstring("non-decreasing"));

  const Tensor t = broadcast_to_tokens(Tensor::from_vector(std::vector<float>{2, -1}, Shape{2}),
                                       Tensor::from_vector(cu, Shape{3}), Tensor::from_vector(mask, Shape{5}));
  REQUIRE(t.to_vector<float>() == std::vector<float>{0, 2, 2, 0, -1});
  REQUIRE_THROWS_WITH(
      broadcast_to_tokens(Tensor::from_vector(std::vector<float>{2, -1}, Shape{2}), Tensor::from_vector(cu, Shape{3}),
                          Tensor::from_vector(std::vector<uint8_t>{0, 1, 1, 0}, Shape{4})),
      ContainsSubstring("must equal the number of tokens 4"));
}

TEST_CASE("reinforce++ returns by hand") {
  // One sequence of 4 tokens, a prompt token then 3 response tokens; kl 0.1 0.2 0.3,
  // kl_coef 0.5, reward 1 on the last response token.
  // Token rewards: -0.05, -0.1, -0.15 + 1 = 0.85.
  // gamma 1:   returns 0.70, 0.75, 0.85.
  // gamma 0.5: 0.85; -0.1 + 0.425 = 0.325; -0.05 + 0.1625 = 0.1125.
  const std::vector<int32_t> cu = {0, 4};
  const std::vector<uint8_t> mask = {0, 1, 1, 1};
  const std::vector<double> kl = {7, 0.1, 0.2, 0.3};
  const std::vector<double> reward = {1};
  std::vector<double> out(4);
  cpu::reinforce_pp_advantages(reward.data(), kl.data(), mask.data(), cu.data(), 1, 4, 0.5, 1.0, false, out.data());
  const std::vector<double> g1 = {0, 0.70, 0.75, 0.85};
  for (std::size_t i = 0; i < 4; ++i) REQUIRE_THAT(out[i], WithinAbs(g1[i], 1e-12));
  cpu::reinforce_pp_advantages(reward.data(), kl.data(), mask.data(), cu.data(), 1, 4, 0.5, 0.5, false, out.data());
  const std::vector<double> g5 = {0, 0.1125, 0.325, 0.85};
  for (std::size_t i = 0; i < 4; ++i) REQUIRE_THAT(out[i], WithinAbs(g5[i], 1e-12));

  // Whitened over the batch: masked mean 0, population variance 1 (up to the 1e-8 eps).
  cpu::reinforce_pp_advantages(reward.data(), kl.data(), mask.data(), cu.data(), 1, 4, 0.5, 0.5, true, out.data());
  REQUIRE(out[0] == 0);
  const double mean = (out[1] + out[2] + out[3]) / 3;
  const double var = (out[1] * out[1] + out[2] * out[2] + out[3] * out[3]) / 3;
  REQUIRE_THAT(mean, WithinAbs(0, 1e-12));
  REQUIRE_THAT(var, WithinAbs(1, 1e-6));
  // Whitening preserves order: 0.1125 < 0.325 < 0.85.
  REQUIRE(out[1] < out[2]);
  REQUIRE(out[2] < out[3]);
}

TEST_CASE("reinforce++ with a group baseline by hand") {
  // One group of two samples, rewards 1 and 3: centred -1, +1.
  // Sequence 0: tokens [0, 2), both response, kl 0.2 0.4, kl_coef 0.5: -1.1, -1.2.
  // Sequence 1: tokens [2, 4), prompt then response, kl 0: 0, 1.
  const std::vector<int32_t> cu = {0, 2, 4};
  const std::vector<uint8_t> mask = {1, 1, 0, 1};
  const std::vector<double> kl = {0.2, 0.4, 9, 0};
  const std::vector<double> rewards = {1, 3};
  const std::vector<int64_t> groups = {2};
  std::vector<double> out(4);
  cpu::reinforce_pp_baseline_advantages(rewards.data(), groups.data(), 1, kl.data(), mask.data(), cu.data(), 2, 4, 0.5,
                                        false, out.data());
  const std::vector<double> expected = {-1.1, -1.2, 0, 1};
  for (std::size_t i = 0; i < 4; ++i) REQUIRE_THAT(out[i], WithinAbs(expected[i], 1e-12));
  const std::vector<int64_t> bad = {3};
  REQUIRE_THROWS_WITH(cpu::reinforce_pp_baseline_advantages(rewards.data(), bad.data(), 1, kl.data(), mask.data(),
                                                            cu.data(), 2, 4, 0.5, false, out.data()),
                      ContainsSubstring("sum to 3"));
}

TEST_CASE("on-policy distillation penalty on the advantages by hand") {
  // slime's apply_opd_kl_to_advantages: A ← A − coef · (student − teacher) on loss tokens.
  // Tokens: a prompt token, then three response tokens with student − teacher = 0.5, -0.2, 0.
  const std::vector<double> student = {-9, -1.0, -2.0, -0.3};
  const std::vector<double> teacher = {-1, -1.5, -1.8, -0.3};
  const std::vector<uint8_t> mask = {0, 1, 1, 1};
  std::vector<double> adv = {0, 1, 1, -2};
  std::vector<double> rkl(4, 7);
  const double sum = cpu::apply_opd(student.data(), teacher.data(), mask.data(), 4, 2.0, adv.data(), rkl.data());
  const std::vector<double> expected_adv = {0, 1 - 2 * 0.5, 1 + 2 * 0.2, -2};
  const std::vector<double> expected_rkl = {0, 0.5, -0.2, 0};
  for (std::size_t i = 0; i < 4; ++i) {
    REQUIRE_THAT(adv[i], WithinAbs(expected_adv[i], 1e-15));
    REQUIRE_THAT(rkl[i], WithinAbs(expected_rkl[i], 1e-15));
  }
  REQUIRE_THAT(sum, WithinAbs(0.3, 1e-15));
  // A teacher equal to the student changes nothing.
  std::vector<double> same = {0.25, 1, -1, 3};
  const std::vector<double> before = same;
  REQUIRE(cpu::apply_opd(student.data(), student.data(), mask.data(), 4, 5.0, same.data(), nullptr) == 0);
  REQUIRE(same == before);
  // Tensor API = template; shapes are checked.
  Tensor a = Tensor::from_vector(std::vector<float>{0, 1, 1, -2}, Shape{4});
  const auto f32 = [](const std::vector<double>& v) {
    return Tensor::from_vector(std::vector<float>(v.begin(), v.end()), Shape{int64_t(v.size())});
  };
  const Tensor r = apply_opd(a, f32(student), f32(teacher), Tensor::from_vector(mask, Shape{4}), 2.0);
  REQUIRE_THAT(double(a.to_vector<float>()[1]), WithinAbs(0, 1e-6));
  REQUIRE_THAT(double(r.to_vector<float>()[1]), WithinAbs(0.5, 1e-6));
  REQUIRE_THROWS_WITH(apply_opd(a, f32({-1}), f32(teacher), Tensor::from_vector(mask, Shape{4}), 1.0),
                      ContainsSubstring("student_lp must have shape (4)"));
}
