// Policy losses and KL estimators: PPO-clip (asymmetric, dual clip), GSPO,
// CISPO, aggregation modes, empty sequences in the normalisers (slime's count,
// our skip), seq_mean_token_sum reducing the pg term only, and rejected tokens
// against hand-computed values;
// finite-difference gradients in double; split invariance over 1, 2 and 5
// micro-batches and over 1, 2 and 4 ranks (LocalComm, global normaliser by one
// all_reduce); the identical-policies invariant; bad inputs.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "slime/comm/local_comm.hpp"
#include "slime/rl/importance_sampler.hpp"
#include "slime/rl/kl.hpp"
#include "slime/rl/policy_loss.hpp"

using namespace slime;
using namespace slime::rl;
using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;

namespace {

struct Batch {
  std::vector<double> lp, old_lp, adv, ref, entropy, w;
  std::vector<uint8_t> mask, keep;
  std::vector<int32_t> cu;

  int64_t tokens() const { return int64_t(lp.size()); }
  int64_t seqs() const { return int64_t(cu.size()) - 1; }

  cpu::PolicyLossArgs<double> args(bool with_extras) const {
    cpu::PolicyLossArgs<double> a;
    a.lp = lp.data();
    a.old_lp = old_lp.data();
    a.advantages = adv.data();
    a.loss_mask = mask.data();
    a.cu_seqlens = cu.data();
    a.num_seqs = seqs();
    a.tokens = tokens();
    if (with_extras) {
      a.maybe_ref_lp = ref.data();
      a.maybe_entropy = entropy.data();
      a.maybe_is_weights = w.empty() ? nullptr : w.data();
      a.maybe_keep = keep.empty() ? nullptr : keep.data();
    }
    return a;
  }
};

// Sequences of random lengths (one empty, one without response tokens), a
// prompt of 1-3 tokens then the response; log-ratios up to ±0.4 so that PPO
// clips some tokens; advantages of both signs.
Batch random_batch(uint32_t seed, int num_seqs) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> u(0, 1);
  Batch b;
  b.cu.push_back(0);
  for (int s = 0; s < num_seqs; ++s) {
    const int len = s == 1 ? 0 : 1 + int(gen() % 9);
    const int prompt = std::min(len, 1 + int(gen() % 3));
    const double adv = u(gen) * 4 - 2;
    for (int t = 0; t < len; ++t) {
      const double old = -0.2 - 3 * u(gen);
      b.old_lp.push_back(old);
      b.lp.push_back(old + (u(gen) - 0.5) * 0.8);
      b.ref.push_back(old + (u(gen) - 0.5) * 1.0);
      b.entropy.push_back(2 * u(gen));
      b.w.push_back(0.5 + u(gen));
      b.adv.push_back(adv);
      b.mask.push_back(s == 2 ? 0 : t >= prompt);
      b.keep.push_back(u(gen) > 0.15);
    }
    b.cu.push_back(int32_t(b.lp.size()));
  }
  return b;
}

// Sequences [s0, s1) of `all` as a batch of their own.
Batch sequences(const Batch& all, int s0, int s1) {
  Batch mb;
  const int32_t b0 = all.cu[std::size_t(s0)], b1 = all.cu[std::size_t(s1)];
  auto cut = [&](const auto& v) { return std::decay_t<decltype(v)>(v.begin() + b0, v.begin() + b1); };
  mb.lp = cut(all.lp);
  mb.old_lp = cut(all.old_lp);
  mb.adv = cut(all.adv);
  mb.ref = cut(all.ref);
  mb.entropy = cut(all.entropy);
  mb.w = cut(all.w);
  mb.mask = cut(all.mask);
  mb.keep = cut(all.keep);
  for (int s = s0; s <= s1; ++s) mb.cu.push_back(all.cu[std::size_t(s)] - b0);
  return mb;
}

double loss_of(const PolicyLossConfig& c, const LossNormalizer& n, const Batch& b) {
  std::vector<double> g(std::size_t(b.tokens()));
  return cpu::policy_loss(c, n, b.args(true), g.data(), nullptr).loss;
}

}  // namespace

TEST_CASE("kl estimators by hand") {
  // lp = -1, ref = -1.5: lp − ref = 0.5.
  // k1 = 0.5 (grad 1); k2 = 0.125 (grad 0.5);
  // k3: d = ref − lp = -0.5, exp(-0.5) + 0.5 − 1 = 0.10653065971263342, grad 1 − exp(-0.5).
  auto k1 = kl_term<double>(KlEstimator::k1, -1, -1.5);
  auto k2 = kl_term<double>(KlEstimator::k2, -1, -1.5);
  auto k3 = kl_term<double>(KlEstimator::k3, -1, -1.5);
  REQUIRE(k1.value == 0.5);
  REQUIRE(k1.grad == 1);
  REQUIRE(k2.value == 0.125);
  REQUIRE(k2.grad == 0.5);
  REQUIRE_THAT(k3.value, WithinAbs(0.10653065971263342, 1e-15));
  REQUIRE_THAT(k3.grad, WithinAbs(1 - std::exp(-0.5), 1e-15));
  // k3 is unclamped (slime's k3): d = 20 gives exp(20) − 21 with its gradient;
  // low_var_kl is k3 clamped to [−10, 10]: value 10, no gradient.
  auto big = kl_term<double>(KlEstimator::k3, 0, 20);
  REQUIRE(big.value == std::exp(20.0) - 21);
  REQUIRE(big.grad == 1 - std::exp(20.0));
  auto low_var = kl_term<double>(KlEstimator::low_var_kl, 0, 20);
  REQUIRE(low_var.value == 10);
  REQUIRE(low_var.grad == 0);
  auto low_var_small = kl_term<double>(KlEstimator::low_var_kl, -1, -1.5);
  REQUIRE(low_var_small.value == k3.value);
  REQUIRE(low_var_small.grad == k3.grad);
  // low_var_kl clamps after the unbiased ratio (slime's order): d = ref − lp = 2,
  // k3 = e² − 3 = 4.39 < 10, times r = exp(lp − old) = e²: 32.4 > 10.
  auto ub_clamped = kl_term_unbiased<double>(KlEstimator::low_var_kl, -3, -1, -5);
  REQUIRE(ub_clamped.value == 10);
  REQUIRE(ub_clamped.grad == 0);
  auto ub_k3 = kl_term_unbiased<double>(KlEstimator::k3, -3, -1, -5);
  REQUIRE_THAT(ub_k3.value, WithinRel((std::exp(2.0) - 3) * std::exp(2.0), 1e-14));
  // The default estimator is slime's --kl-loss-type default, k1.
  REQUIRE(PolicyLossConfig{}.kl_estimator == KlEstimator::k1);
  // Unbiased: k1 · exp(lp − old) with old = -1.2: 0.5 · exp(0.2).
  auto ub = kl_term_unbiased<double>(KlEstimator::k1, -1, -1.5, -1.2);
  REQUIRE_THAT(ub.value, WithinAbs(0.5 * std::exp(0.2), 1e-15));
  REQUIRE_THAT(ub.grad, WithinAbs(std::exp(0.2) * 1.5, 1e-15));
  // Identical policies: every estimator is exactly 0.
  for (auto e : {KlEstimator::k1, KlEstimator::k2, KlEstimator::k3, KlEstimator::low_var_kl}) {
    REQUIRE(kl_term<double>(e, -0.7, -0.7).value == 0);
    REQUIRE(kl_term<float>(e, -0.7f, -0.7f).value == 0);
  }
  // Tensor API = template.
  const Tensor kl = kl_per_token(KlEstimator::k2, Tensor::from_vector(std::vector<float>{-1, -2}, Shape{2}),
                                 Tensor::from_vector(std::vector<float>{-1.5f, -2}, Shape{2}));
  REQUIRE(kl.to_vector<float>() == std::vector<float>{0.125f, 0});
  REQUIRE_THROWS_WITH(kl_per_token(KlEstimator::k1, Tensor::from_vector(std::vector<float>{-1, -2}, Shape{2}),
                                   Tensor::from_vector(std::vector<float>{-1.5f}, Shape{1})),
                      ContainsSubstring("ref must have shape (2)"));
}

TEST_CASE("kl estimator gradients by finite differences") {
  const double h = 1e-6;
  for (auto e : {KlEstimator::k1, KlEstimator::k2, KlEstimator::k3, KlEstimator::low_var_kl}) {
    for (double lp : {-2.0, -0.7, -0.1}) {
      const double ref = -1.1, old = -0.9;
      const double fd = (kl_term(e, lp + h, ref).value - kl_term(e, lp - h, ref).value) / (2 * h);
      REQUIRE_THAT(kl_term(e, lp, ref).grad, WithinAbs(fd, 1e-8));
      const double fdu =
          (kl_term_unbiased(e, lp + h, ref, old).value - kl_term_unbiased(e, lp - h, ref, old).value) / (2 * h);
      REQUIRE_THAT(kl_term_unbiased(e, lp, ref, old).grad, WithinAbs(fdu, 1e-8));
    }
  }
}

TEST_CASE("ppo clip and dual clip by hand") {
  // Four one-token sequences, old = -1, eps_clip 0.2, eps_clip_high 0.28, token mean over 4:
  //  a) A = 1,  r = 1.5: pg1 = -1.5, pg2 = -1.28 → -1.28, clipped, grad 0
  //  b) A = 1,  r = 1.1: pg = -1.1, grad = -A·r = -1.1
  //  c) A = -1, r = 0.5: pg1 = 0.5, pg2 = 0.8 → 0.8, clipped, grad 0
  //  d) A = -1, r = 4:   pg1 = 4, pg2 = 1.28 → 4; dual clip c = 3: min(4, 3) = 3, grad 0
  // loss = (-1.28 - 1.1 + 0.8 + 3) / 4 = 0.355; clip fraction 2/4; dual 1/4;
  // ppo_kl = -(ln 1.5 + ln 1.1 + ln 0.5 + ln 4) / 4.
  Batch b;
  const std::vector<double> ratio = {1.5, 1.1, 0.5, 4};
  b.adv = {1, 1, -1, -1};
  for (double r : ratio) {
    b.old_lp.push_back(-1);
    b.lp.push_back(-1 + std::log(r));
    b.mask.push_back(1);
  }
  b.cu = {0, 1, 2, 3, 4};
  PolicyLossConfig c;
  c.eps_clip = 0.2;
  c.eps_clip_high = 0.28;
  c.eps_clip_c = 3;
  const LossNormalizer n{4, 4, 4};
  std::vector<double> g(4);
  auto m = cpu::policy_loss(c, n, b.args(false), g.data(), nullptr);
  REQUIRE_THAT(m.loss, WithinAbs(0.355, 1e-12));
  REQUIRE_THAT(m.pg_loss, WithinAbs(0.355, 1e-12));
  REQUIRE_THAT(m.clip_fraction, WithinAbs(0.5, 1e-15));
  REQUIRE_THAT(m.dual_clip_fraction, WithinAbs(0.25, 1e-15));
  REQUIRE_THAT(m.ppo_kl, WithinAbs(-(std::log(1.5) + std::log(1.1) + std::log(0.5) + std::log(4.0)) / 4, 1e-12));
  REQUIRE(g[0] == 0);
  REQUIRE_THAT(g[1], WithinAbs(-1.1 / 4, 1e-12));
  REQUIRE(g[2] == 0);
  REQUIRE(g[3] == 0);
  // Without dual clip, d) is pg = 4 with grad -A·r / 4 = 1.
  c.eps_clip_c = 0;
  m = cpu::policy_loss(c, n, b.args(false), g.data(), nullptr);
  REQUIRE_THAT(m.loss, WithinAbs((-1.28 - 1.1 + 0.8 + 4) / 4, 1e-12));
  REQUIRE_THAT(g[3], WithinAbs(1.0, 1e-12));
  REQUIRE(m.dual_clip_fraction == 0);
}

TEST_CASE("cispo and gspo by hand") {
  // CISPO: A = 1, old = -1, r = 1.5 → clip 1.28; pg = -1.28·lp with lp = -1 + ln 1.5; grad -1.28.
  Batch b;
  b.old_lp = {-1};
  b.lp = {-1 + std::log(1.5)};
  b.adv = {1};
  b.mask = {1};
  b.cu = {0, 1};
  PolicyLossConfig c;
  c.kind = PolicyLossKind::cispo;
  c.eps_clip_high = 0.28;
  std::vector<double> g(1);
  auto m = cpu::policy_loss(c, LossNormalizer{1, 1, 1}, b.args(false), g.data(), nullptr);
  REQUIRE_THAT(m.loss, WithinAbs(-1.28 * (-1 + std::log(1.5)), 1e-12));
  REQUIRE_THAT(g[0], WithinAbs(-1.28, 1e-12));
  REQUIRE(m.clip_fraction == 1);

  // GSPO: one sequence, a prompt token then two response tokens with lp − old = 0.1, -0.3;
  // sequence ratio exp(-0.1) inside [0.8, 1.2]; A = 2; token mean over 2:
  // loss = -2·exp(-0.1); d loss / d lp_u = Σ_t (1/2)·(-2)·exp(-0.1)·(1/2) = -exp(-0.1) for both tokens.
  Batch s;
  s.old_lp = {-5, -1, -2};
  s.lp = {-4, -0.9, -2.3};
  s.adv = {2, 2, 2};
  s.mask = {0, 1, 1};
  s.cu = {0, 3};
  c = {};
  c.kind = PolicyLossKind::gspo;
  g.assign(3, 7);
  m = cpu::policy_loss(c, LossNormalizer{2, 1, 1}, s.args(false), g.data(), nullptr);
  REQUIRE_THAT(m.loss, WithinAbs(-2 * std::exp(-0.1), 1e-12));
  REQUIRE_THAT(m.ppo_kl, WithinAbs(0.1, 1e-12));
  REQUIRE(g[0] == 0);
  REQUIRE_THAT(g[1], WithinAbs(-std::exp(-0.1), 1e-12));
  REQUIRE_THAT(g[2], WithinAbs(-std::exp(-0.1), 1e-12));
}

TEST_CASE("aggregation modes and rejected tokens by hand") {
  // lp = old (ratio 1), so pg = -A. Sequence 0: A = 1, 3; sequence 1: A = 5.
  // token_mean: -(1 + 3 + 5)/3 = -3; seq_mean_token_mean: (-2 - 5)/2 = -3.5;
  // seq_mean_token_sum: (-4 - 5)/2 = -4.5.
  Batch b;
  b.old_lp = b.lp = {-1, -1, -1};
  b.adv = {1, 3, 5};
  b.mask = {1, 1, 1};
  b.cu = {0, 2, 3};
  const LossNormalizer n{3, 2, 2};
  std::vector<double> g(3);
  PolicyLossConfig c;
  c.aggregation = Aggregation::token_mean;
  REQUIRE_THAT(cpu::policy_loss(c, n, b.args(false), g.data(), nullptr).loss, WithinAbs(-3, 1e-12));
  c.aggregation = Aggregation::seq_mean_token_mean;
  REQUIRE_THAT(cpu::policy_loss(c, n, b.args(false), g.data(), nullptr).loss, WithinAbs(-3.5, 1e-12));
  REQUIRE_THAT(g[0], WithinAbs(-0.25, 1e-12));  // -A·r / (n_s·N_seqs) = -1/(2·2)
  c.aggregation = Aggregation::seq_mean_token_sum;
  REQUIRE_THAT(cpu::policy_loss(c, n, b.args(false), g.data(), nullptr).loss, WithinAbs(-4.5, 1e-12));

  // The second token rejected: it leaves the numerator, the denominators keep 3 tokens
  // and n_0 = 2: token_mean -(1 + 5)/3 = -2; seq_mean_token_mean (-1/2 - 5)/2 = -2.75.
  b.keep = {1, 0, 1};
  b.ref = b.lp;
  b.entropy = {0, 0, 0};
  c.aggregation = Aggregation::token_mean;
  REQUIRE_THAT(cpu::policy_loss(c, n, b.args(true), g.data(), nullptr).loss, WithinAbs(-2, 1e-12));
  REQUIRE(g[1] == 0);
  c.aggregation = Aggregation::seq_mean_token_mean;
  REQUIRE_THAT(cpu::policy_loss(c, n, b.args(true), g.data(), nullptr).loss, WithinAbs(-2.75, 1e-12));

  // Importance weights multiply pg: w = 2, 1, 0.5 → token_mean -(2 + 3 + 2.5)/3.
  b.keep.clear();
  b.w = {2, 1, 0.5};
  c.aggregation = Aggregation::token_mean;
  REQUIRE_THAT(cpu::policy_loss(c, n, b.args(true), g.data(), nullptr).loss, WithinAbs(-7.5 / 3, 1e-12));
  REQUIRE_THAT(g[0], WithinAbs(-2.0 / 3, 1e-12));
}

TEST_CASE("empty sequences in the normalisers: slime's count, our skip") {
  // Three sequences: s0 two loss tokens A = 1, 3; s1 fully masked (a removed
  // sample); s2 one loss token A = 5; lp = old, so pg = -A.
  //   count (slime): token_mean -(1 + 3 + 5) / (2 + 1 + 1) = -2.25;
  //                  seq_mean_token_mean (-2 - 5) / 3; seq_mean_token_sum (-4 - 5) / 3
  //   skip (ours):   -9 / 3 = -3; (-2 - 5) / 2 = -3.5; (-4 - 5) / 2 = -4.5
  Batch b;
  b.old_lp = b.lp = {-1, -1, -1, -1, -1};
  b.adv = {1, 3, 7, 7, 5};
  b.mask = {1, 1, 0, 0, 1};
  b.cu = {0, 2, 4, 5};
  const LossNormalizer n = cpu::count_normalizer(b.mask.data(), b.cu.data(), b.seqs(), b.tokens());
  REQUIRE(n.tokens == 3);
  REQUIRE(n.sequences == 3);
  REQUIRE(n.nonempty_sequences == 2);
  REQUIRE(loss_denominators(EmptySequences::count, n).tokens == 4);
  REQUIRE(loss_denominators(EmptySequences::count, n).sequences == 3);
  REQUIRE(loss_denominators(EmptySequences::skip, n).tokens == 3);
  REQUIRE(loss_denominators(EmptySequences::skip, n).sequences == 2);
  std::vector<double> g(5);
  PolicyLossConfig c;
  REQUIRE(c.empty_sequences == EmptySequences::count);  // slime's default
  const auto loss = [&](Aggregation agg, EmptySequences empty) {
    c.aggregation = agg;
    c.empty_sequences = empty;
    return cpu::policy_loss(c, n, b.args(false), g.data(), nullptr).loss;
  };
  REQUIRE_THAT(loss(Aggregation::token_mean, EmptySequences::count), WithinAbs(-2.25, 1e-12));
  REQUIRE_THAT(g[0], WithinAbs(-0.25, 1e-12));
  REQUIRE(g[2] == 0);
  REQUIRE(g[3] == 0);
  REQUIRE_THAT(loss(Aggregation::seq_mean_token_mean, EmptySequences::count), WithinAbs(-7.0 / 3, 1e-12));
  REQUIRE_THAT(loss(Aggregation::seq_mean_token_sum, EmptySequences::count), WithinAbs(-3, 1e-12));
  REQUIRE_THAT(loss(Aggregation::token_mean, EmptySequences::skip), WithinAbs(-3, 1e-12));
  REQUIRE_THAT(loss(Aggregation::seq_mean_token_mean, EmptySequences::skip), WithinAbs(-3.5, 1e-12));
  REQUIRE_THAT(loss(Aggregation::seq_mean_token_sum, EmptySequences::skip), WithinAbs(-4.5, 1e-12));
  REQUIRE_THAT(g[4], WithinAbs(-2.5, 1e-12));  // -A / N_seqs
  // Under count, only empty sequences make the step: the normaliser is positive and the loss 0.
  Batch e;
  e.old_lp = e.lp = e.adv = {-1, -1};
  e.mask = {0, 0};
  e.cu = {0, 1, 2};
  const LossNormalizer ne = cpu::count_normalizer(e.mask.data(), e.cu.data(), e.seqs(), e.tokens());
  c.empty_sequences = EmptySequences::count;
  for (auto agg : {Aggregation::token_mean, Aggregation::seq_mean_token_mean, Aggregation::seq_mean_token_sum}) {
    c.aggregation = agg;
    REQUIRE(cpu::policy_loss(c, ne, e.args(false), g.data(), nullptr).loss == 0);
  }
  REQUIRE_THROWS_WITH(cpu::policy_loss(c, LossNormalizer{1, 1, 2}, e.args(false), g.data(), nullptr),
                      ContainsSubstring("inconsistent LossNormalizer"));
}

TEST_CASE("seq_mean_token_sum reduces the pg term only, as slime's custom pg reducer") {
  // Two sequences, lp = old (ratio 1, pg = -A), entropy H, k1 KL = lp − ref.
  // s0: 2 tokens, A = 1, H = 0.5, 0.7, lp − ref = 0.2, 0.4; s1: 1 token, A = 2, H = 1, lp − ref = -0.1.
  // pg by token sums over N_seqs = 2: (-2 - 2) / 2 = -2.
  // KL and entropy by sequence means: KL ((0.2 + 0.4)/2 - 0.1) / 2 = 0.1; H ((0.6) + 1) / 2 = 0.8.
  // loss = -2 + kl_coef·0.1 − entropy_coef·0.8 with kl_coef 0.5, entropy_coef 0.1: -2 + 0.05 − 0.08.
  Batch b;
  b.old_lp = b.lp = {-1, -2, -0.5};
  b.ref = {-1.2, -2.4, -0.4};
  b.entropy = {0.5, 0.7, 1};
  b.adv = {1, 1, 2};
  b.mask = {1, 1, 1};
  b.cu = {0, 2, 3};
  PolicyLossConfig c;
  c.aggregation = Aggregation::seq_mean_token_sum;
  c.kl_coef = 0.5;
  c.entropy_coef = 0.1;
  c.eps_clip = 0.1;
  c.eps_clip_high = 0.1;
  const LossNormalizer n = cpu::count_normalizer(b.mask.data(), b.cu.data(), b.seqs(), b.tokens());
  std::vector<double> g(3), ge(3);
  const PolicyLossMetrics m = cpu::policy_loss(c, n, b.args(true), g.data(), ge.data());
  REQUIRE_THAT(m.pg_loss, WithinAbs(-2, 1e-12));
  REQUIRE_THAT(m.kl, WithinAbs(0.1, 1e-12));
  REQUIRE_THAT(m.entropy, WithinAbs(0.8, 1e-12));
  REQUIRE_THAT(m.loss, WithinAbs(-2 + 0.05 - 0.08, 1e-12));
  // d/dlp: pg -A·r / N_seqs, KL kl_coef / (n_s·N_seqs); d/dH: −entropy_coef / (n_s·N_seqs).
  REQUIRE_THAT(g[0], WithinAbs(-0.5 + 0.5 / 4, 1e-12));
  REQUIRE_THAT(g[2], WithinAbs(-1 + 0.5 / 2, 1e-12));
  REQUIRE_THAT(ge[0], WithinAbs(-0.1 / 4, 1e-12));
  REQUIRE_THAT(ge[2], WithinAbs(-0.1 / 2, 1e-12));
  // Every token clipped (ratio 1.5 ≫ 1.1, A > 0): the clip fraction is the mean over
  // sequences of each one's fraction, 1 (token sums over N_seqs would give 1.5).
  b.lp = {-1 + std::log(1.5), -2 + std::log(1.5), -0.5 + std::log(1.5)};
  const PolicyLossMetrics mc = cpu::policy_loss(c, n, b.args(true), g.data(), ge.data());
  REQUIRE_THAT(mc.clip_fraction, WithinAbs(1, 1e-12));
  REQUIRE_THAT(mc.ppo_kl, WithinAbs(-std::log(1.5), 1e-12));
}

TEST_CASE("dual clip with ratios far above its threshold") {
  // A < 0 and r = 5, 10, 50 over eps_clip_c = 3: pg = -A·3 whatever r, no gradient;
  // r = 2 < 3 keeps the unclipped pg = -A·r, with gradient -A·r / 4.
  Batch b;
  const std::vector<double> ratio = {5, 10, 50, 2};
  for (double r : ratio) {
    b.old_lp.push_back(-4);
    b.lp.push_back(-4 + std::log(r));
    b.mask.push_back(1);
    b.adv.push_back(-0.5);
  }
  b.cu = {0, 4};
  PolicyLossConfig c;
  c.eps_clip_c = 3;
  std::vector<double> g(4);
  const PolicyLossMetrics m = cpu::policy_loss(c, LossNormalizer{4, 1, 1}, b.args(false), g.data(), nullptr);
  REQUIRE_THAT(m.pg_loss, WithinAbs((1.5 * 3 + 1.0) / 4, 1e-12));
  REQUIRE_THAT(m.dual_clip_fraction, WithinAbs(0.75, 1e-15));
  REQUIRE(m.clip_fraction == 0);  // -A·r > -A·clip(r): the unclipped branch is the max
  REQUIRE(g[0] == 0);
  REQUIRE(g[1] == 0);
  REQUIRE(g[2] == 0);
  REQUIRE_THAT(g[3], WithinAbs(0.5 * 2 / 4, 1e-12));
  // Positive advantages are never dual-clipped.
  b.adv = {0.5, 0.5, 0.5, 0.5};
  REQUIRE(cpu::policy_loss(c, LossNormalizer{4, 1, 1}, b.args(false), g.data(), nullptr).dual_clip_fraction == 0);
}

TEST_CASE("policy loss gradients by finite differences in double") {
  const double h = 1e-6;
  int checked = 0;
  double clipped = 0, dual_clipped = 0;
  for (auto kind : {PolicyLossKind::ppo, PolicyLossKind::gspo, PolicyLossKind::cispo}) {
    for (auto agg : {Aggregation::token_mean, Aggregation::seq_mean_token_mean, Aggregation::seq_mean_token_sum}) {
      for (auto est : {KlEstimator::k1, KlEstimator::k2, KlEstimator::k3, KlEstimator::low_var_kl}) {
        for (bool unbiased : {false, true}) {
          // CISPO stops the gradient through clip(r): moving old with lp keeps r (and the
          // stopped factor) fixed, so the finite difference sees only the differentiated
          // terms. The unbiased KL's exp(lp − old) would be frozen too: not checked for CISPO.
          const bool cispo = kind == PolicyLossKind::cispo;
          if (cispo && unbiased) {
            ++checked;
            continue;
          }
          Batch b = random_batch(17 + checked, 7);
          PolicyLossConfig c;
          c.kind = kind;
          c.eps_clip = 0.2;
          c.eps_clip_high = 0.28;
          c.eps_clip_c = 1.25;  // reached by ratios up to exp(0.4)
          c.entropy_coef = 0.01;
          c.kl_coef = 0.1;
          c.kl_estimator = est;
          c.unbiased_kl = unbiased;
          c.aggregation = agg;
          const LossNormalizer n = cpu::count_normalizer(b.mask.data(), b.cu.data(), b.seqs(), b.tokens());
          std::vector<double> g(std::size_t(b.tokens())), ge(std::size_t(b.tokens()));
          const PolicyLossMetrics m = cpu::policy_loss(c, n, b.args(true), g.data(), ge.data());
          clipped += m.clip_fraction;
          dual_clipped += m.dual_clip_fraction;
          double err = 0, norm = 0, err_e = 0;
          for (std::size_t t = 0; t < g.size(); ++t) {
            Batch p = b, q = b;
            p.lp[t] += h;
            q.lp[t] -= h;
            if (cispo) {
              p.old_lp[t] += h;
              q.old_lp[t] -= h;
            }
            const double fd = (loss_of(c, n, p) - loss_of(c, n, q)) / (2 * h);
            err += (fd - g[t]) * (fd - g[t]);
            norm += g[t] * g[t];
            p = b;
            q = b;
            p.entropy[t] += h;
            q.entropy[t] -= h;
            const double fde = (loss_of(c, n, p) - loss_of(c, n, q)) / (2 * h);
            err_e = std::max(err_e, std::abs(fde - ge[t]));
          }
          INFO("kind " << int(kind) << " aggregation " << int(agg) << " kl " << int(est) << " unbiased " << unbiased);
          REQUIRE(norm > 0);
          REQUIRE(std::sqrt(err / norm) < 1e-7);
          REQUIRE(err_e < 1e-9);
          ++checked;
        }
      }
    }
  }
  REQUIRE(checked == 72);
  // The random batches reach the clipped and dual-clipped branches.
  REQUIRE(clipped > 0);
  REQUIRE(dual_clipped > 0);
}

TEST_CASE("policy loss is invariant to the micro-batch split") {
  // 10 sequences split into 1, 2 and 5 contiguous micro-batches: with the global
  // normaliser, the summed loss and metrics and the concatenated gradients agree.
  const Batch all = random_batch(5, 10);
  for (auto kind : {PolicyLossKind::ppo, PolicyLossKind::gspo, PolicyLossKind::cispo}) {
    for (auto agg : {Aggregation::token_mean, Aggregation::seq_mean_token_mean, Aggregation::seq_mean_token_sum})
      for (auto empty : {EmptySequences::count, EmptySequences::skip}) {
        PolicyLossConfig c;
        c.kind = kind;
        c.aggregation = agg;
        c.empty_sequences = empty;
        c.eps_clip_c = 3;
        c.entropy_coef = 0.01;
        c.kl_coef = 0.1;
        LossNormalizer n;
        std::vector<double> ref_grad;
        double ref_loss = 0, ref_clip = 0;
        for (int parts : {1, 2, 5}) {
          // The global normaliser is the sum of the micro-batches' counts.
          std::vector<Batch> mbs;
          const int per = 10 / parts;
          for (int p = 0; p < parts; ++p) mbs.push_back(sequences(all, p * per, (p + 1) * per));
          LossNormalizer total;
          for (const Batch& mb : mbs)
            total += cpu::count_normalizer(mb.mask.data(), mb.cu.data(), mb.seqs(), mb.tokens());
          if (parts == 1) n = total;
          REQUIRE(total.tokens == n.tokens);
          REQUIRE(total.sequences == n.sequences);
          REQUIRE(total.nonempty_sequences == n.nonempty_sequences);
          REQUIRE(n.sequences == 10);
          REQUIRE(n.nonempty_sequences < n.sequences);  // random_batch: empty ones and ones without response tokens
          PolicyLossMetrics m;
          std::vector<double> grad;
          for (const Batch& mb : mbs) {
            std::vector<double> g(std::size_t(mb.tokens()));
            m += cpu::policy_loss(c, n, mb.args(true), g.data(), nullptr);
            grad.insert(grad.end(), g.begin(), g.end());
          }
          if (parts == 1) {
            ref_grad = grad;
            ref_loss = m.loss;
            ref_clip = m.clip_fraction;
            continue;
          }
          INFO("kind " << int(kind) << " aggregation " << int(agg) << " empty " << int(empty) << " parts " << parts);
          REQUIRE_THAT(m.loss, WithinAbs(ref_loss, 1e-12));
          REQUIRE_THAT(m.clip_fraction, WithinAbs(ref_clip, 1e-12));
          REQUIRE(grad.size() == ref_grad.size());
          double worst = 0;
          for (std::size_t t = 0; t < grad.size(); ++t) worst = std::max(worst, std::abs(grad[t] - ref_grad[t]));
          REQUIRE(worst <= 1e-12);
        }
      }
  }
}

TEST_CASE("policy loss is invariant to the rank and micro-batch split") {
  // 40 sequences over 1, 2 or 4 ranks (LocalComm threads), each rank's share in
  // 1, 2 or 5 micro-batches. Each rank counts its own tokens and sequences; one
  // all_reduce makes the global normaliser. The loss and metrics summed over
  // ranks and micro-batches, and the gradients, equal the single-batch ones.
  const Batch all = random_batch(23, 40);
  int compared = 0;
  for (auto kind : {PolicyLossKind::ppo, PolicyLossKind::gspo, PolicyLossKind::cispo}) {
    for (auto agg : {Aggregation::token_mean, Aggregation::seq_mean_token_mean, Aggregation::seq_mean_token_sum}) {
      PolicyLossConfig c;
      c.kind = kind;
      c.aggregation = agg;
      c.eps_clip_c = 3;
      c.entropy_coef = 0.01;
      c.kl_coef = 0.1;
      c.unbiased_kl = kind == PolicyLossKind::ppo;
      std::vector<double> ref_grad, ref_grad_entropy;
      PolicyLossMetrics ref;
      {
        const LossNormalizer n = cpu::count_normalizer(all.mask.data(), all.cu.data(), all.seqs(), all.tokens());
        ref_grad.resize(std::size_t(all.tokens()));
        ref_grad_entropy.resize(ref_grad.size());
        ref = cpu::policy_loss(c, n, all.args(true), ref_grad.data(), ref_grad_entropy.data());
      }
      for (int ranks : {1, 2, 4}) {
        for (int parts : {1, 2, 5}) {
          const int per_rank = 40 / ranks, per_mb = per_rank / parts;
          std::vector<double> grad(ref_grad.size(), NAN), grad_entropy(ref_grad.size(), NAN);
          std::vector<PolicyLossMetrics> rank_metrics(static_cast<std::size_t>(ranks));
          std::vector<LossNormalizer> rank_norm(static_cast<std::size_t>(ranks));
          comm::run_local_ranks(ranks, [&](comm::Comm& comm) {
            const int r = comm.rank();
            std::vector<Batch> mbs;
            for (int p = 0; p < parts; ++p)
              mbs.push_back(sequences(all, r * per_rank + p * per_mb, r * per_rank + (p + 1) * per_mb));
            LossNormalizer part;
            for (const Batch& mb : mbs)
              part += cpu::count_normalizer(mb.mask.data(), mb.cu.data(), mb.seqs(), mb.tokens());
            Tensor global = Tensor::from_vector(
                std::vector<int64_t>{part.tokens, part.sequences, part.nonempty_sequences}, Shape{3});
            comm.all_reduce(global);
            const auto g = global.to_vector<int64_t>();
            const LossNormalizer n{g[0], g[1], g[2]};
            rank_norm[std::size_t(r)] = n;
            std::size_t at = std::size_t(all.cu[std::size_t(r * per_rank)]);
            for (const Batch& mb : mbs) {
              rank_metrics[std::size_t(r)] +=
                  cpu::policy_loss(c, n, mb.args(true), grad.data() + at, grad_entropy.data() + at);
              at += std::size_t(mb.tokens());
            }
          });
          INFO("kind " << int(kind) << " aggregation " << int(agg) << " ranks " << ranks << " micro-batches " << parts);
          PolicyLossMetrics m;
          for (int r = 0; r < ranks; ++r) {
            REQUIRE(rank_norm[std::size_t(r)].tokens == rank_norm[0].tokens);
            REQUIRE(rank_norm[std::size_t(r)].sequences == rank_norm[0].sequences);
            m += rank_metrics[std::size_t(r)];
          }
          REQUIRE_THAT(m.loss, WithinAbs(ref.loss, 1e-12));
          REQUIRE_THAT(m.pg_loss, WithinAbs(ref.pg_loss, 1e-12));
          REQUIRE_THAT(m.kl, WithinAbs(ref.kl, 1e-12));
          REQUIRE_THAT(m.ppo_kl, WithinAbs(ref.ppo_kl, 1e-12));
          REQUIRE_THAT(m.clip_fraction, WithinAbs(ref.clip_fraction, 1e-12));
          double worst = 0;
          for (std::size_t t = 0; t < grad.size(); ++t) {
            worst = std::max(worst, std::abs(grad[t] - ref_grad[t]));
            worst = std::max(worst, std::abs(grad_entropy[t] - ref_grad_entropy[t]));
          }
          REQUIRE(worst <= 1e-12);  // NaN (a token no rank wrote) fails too
          ++compared;
        }
      }
    }
  }
  REQUIRE(compared == 81);
}

TEST_CASE("identical policy reference and rollout give zero kl and clipping and unit weights") {
  // The first step of on-policy training: lp = old = ref = rollout.
  std::vector<float> lp = {-0.3f, -1.7f, -2.25f, -0.01f, -4.5f, -0.9f};
  const std::vector<uint8_t> mask = {0, 1, 1, 1, 0, 1};
  const std::vector<int32_t> cu = {0, 4, 6};
  PolicyLossTensors in;
  in.lp = Tensor::from_vector(lp, Shape{6});
  in.old_lp = Tensor::from_vector(lp, Shape{6});
  in.ref_lp = Tensor::from_vector(lp, Shape{6});
  in.advantages = Tensor::from_vector(std::vector<float>{1, 1, -2, 0.5f, 3, -1}, Shape{6});
  in.loss_mask = Tensor::from_vector(mask, Shape{6});
  in.cu_seqlens = Tensor::from_vector(cu, Shape{3});
  const ImportanceResult is = ImportanceSampler<Tis>()(in.old_lp, in.lp, in.loss_mask, in.cu_seqlens);
  for (std::size_t t = 0; t < mask.size(); ++t) REQUIRE(is.weights.to_vector<float>()[t] == (mask[t] ? 1.0f : 0.0f));
  REQUIRE(is.metrics.clip_fraction() == 0);
  REQUIRE(is.metrics.kl_k3() == 0);
  REQUIRE(is.metrics.mean_weight() == 1);
  REQUIRE(is.metrics.mean_abs_deviation() == 0);
  in.is_weights = is.weights;
  in.keep_mask = is.keep_mask;
  const LossNormalizer n = count_normalizer(in.loss_mask, in.cu_seqlens);
  REQUIRE(n.tokens == 4);
  REQUIRE(n.sequences == 2);
  for (auto kind : {PolicyLossKind::ppo, PolicyLossKind::gspo, PolicyLossKind::cispo}) {
    for (auto est : {KlEstimator::k1, KlEstimator::k2, KlEstimator::k3, KlEstimator::low_var_kl}) {
      PolicyLossConfig c;
      c.kind = kind;
      c.kl_coef = 0.5;
      c.kl_estimator = est;
      c.eps_clip_c = 3;
      const PolicyLossResult r = policy_loss(c, n, in);
      REQUIRE(r.metrics.ppo_kl == 0);
      REQUIRE(r.metrics.kl == 0);
      REQUIRE(r.metrics.clip_fraction == 0);
      REQUIRE(r.metrics.dual_clip_fraction == 0);
    }
  }
}

TEST_CASE("policy loss tensor api matches the template") {
  const Batch b = random_batch(3, 6);
  auto f32 = [](const std::vector<double>& v) {
    return Tensor::from_vector(std::vector<float>(v.begin(), v.end()), Shape{int64_t(v.size())});
  };
  Batch bf = b;  // the double batch rounded to float, for a like-for-like comparison
  for (auto* v : {&bf.lp, &bf.old_lp, &bf.adv, &bf.ref, &bf.entropy, &bf.w}) {
    for (double& x : *v) x = double(float(x));
  }
  PolicyLossTensors in;
  in.lp = f32(b.lp);
  in.old_lp = f32(b.old_lp);
  in.advantages = f32(b.adv);
  in.ref_lp = f32(b.ref);
  in.entropy = f32(b.entropy);
  in.is_weights = f32(b.w);
  in.loss_mask = Tensor::from_vector(b.mask, Shape{b.tokens()});
  in.keep_mask = Tensor::from_vector(b.keep, Shape{b.tokens()});
  in.cu_seqlens = Tensor::from_vector(b.cu, Shape{b.seqs() + 1});
  PolicyLossConfig c;
  c.kl_coef = 0.1;
  c.entropy_coef = 0.01;
  c.aggregation = Aggregation::seq_mean_token_mean;
  const LossNormalizer n = count_normalizer(in.loss_mask, in.cu_seqlens);
  const PolicyLossResult r = policy_loss(c, n, in);
  std::vector<double> g(std::size_t(b.tokens())), ge(g.size());
  const auto m = cpu::policy_loss(c, n, bf.args(true), g.data(), ge.data());
  REQUIRE_THAT(r.metrics.loss, WithinAbs(m.loss, 1e-6));
  const auto rg = r.grad_lp.to_vector<float>(), rge = r.grad_entropy.to_vector<float>();
  for (std::size_t t = 0; t < g.size(); ++t) {
    REQUIRE_THAT(double(rg[t]), WithinAbs(g[t], 1e-6));
    REQUIRE_THAT(double(rge[t]), WithinAbs(ge[t], 1e-7));
  }
}

TEST_CASE("policy loss rejects bad inputs") {
  Batch b;
  b.old_lp = b.lp = b.adv = {-1, -1, -1};
  b.mask = {1, 1, 1};
  b.cu = {0, 2, 3};
  std::vector<double> g(3);
  PolicyLossConfig c;
  const LossNormalizer n{3, 2, 2};
  c.kl_coef = 0.1;
  REQUIRE_THROWS_WITH(cpu::policy_loss(c, n, b.args(false), g.data(), nullptr), ContainsSubstring("needs ref_lp"));
  c = {};
  c.entropy_coef = 0.1;
  REQUIRE_THROWS_WITH(cpu::policy_loss(c, n, b.args(false), g.data(), nullptr), ContainsSubstring("needs entropy"));
  c = {};
  c.eps_clip_c = 0.5;
  REQUIRE_THROWS_WITH(cpu::policy_loss(c, n, b.args(false), g.data(), nullptr),
                      ContainsSubstring("eps_clip_c must be 0 (off) or > 1"));
  c = {};
  c.eps_clip = -0.1;
  REQUIRE_THROWS_WITH(cpu::policy_loss(c, n, b.args(false), g.data(), nullptr), ContainsSubstring(">= 0"));
  c = {};
  REQUIRE_THROWS_WITH(cpu::policy_loss(c, LossNormalizer{0, 0, 0}, b.args(false), g.data(), nullptr),
                      ContainsSubstring("global normaliser is 0"));
  b.cu = {0, 2, 4};
  REQUIRE_THROWS_WITH(cpu::policy_loss(c, n, b.args(false), g.data(), nullptr),
                      ContainsSubstring("must equal the number of tokens 3"));

  PolicyLossTensors in;
  in.lp = Tensor::from_vector(std::vector<float>{-1, -1, -1}, Shape{3});
  in.old_lp = Tensor::from_vector(std::vector<float>{-1, -1}, Shape{2});
  in.advantages = in.lp;
  in.loss_mask = Tensor::from_vector(std::vector<uint8_t>{1, 1, 1}, Shape{3});
  in.cu_seqlens = Tensor::from_vector(std::vector<int32_t>{0, 3}, Shape{2});
  REQUIRE_THROWS_WITH(policy_loss(c, n, in), ContainsSubstring("old_lp must have shape (3)"));
  in.old_lp = in.lp;
  in.loss_mask = Tensor::from_vector(std::vector<float>{1, 1, 1}, Shape{3});
  REQUIRE_THROWS_WITH(policy_loss(c, n, in), ContainsSubstring("loss_mask must be u8"));
}
