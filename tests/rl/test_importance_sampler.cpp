// ImportanceSampler: TIS and MIS (token, sequence and geometric levels;
// truncate, clip and mask modes; veto; the ±20 log-ratio bound; slime's batch
// renormalisation and ours over kept tokens) and the metrics,
// against values worked out by hand; rejected tokens in the loss; bad inputs.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "slime/rl/importance_sampler.hpp"
#include "slime/rl/policy_loss.hpp"

using namespace slime;
using namespace slime::rl;
using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;

namespace {

struct Out {
  std::vector<double> w;
  std::vector<uint8_t> keep;
  ImportanceMetrics m;
};

// old − rollout = d per token; rollout fixed at -1.
template <class Policy>
Out run(const ImportanceSampler<Policy>& sampler, const std::vector<double>& d, const std::vector<uint8_t>& mask,
        const std::vector<int32_t>& cu) {
  std::vector<double> rollout(d.size(), -1.0), old(d.size());
  for (std::size_t t = 0; t < d.size(); ++t) old[t] = -1 + d[t];
  Out o{std::vector<double>(d.size(), 7), std::vector<uint8_t>(d.size(), 7), {}};
  o.m = sampler.compute(old.data(), rollout.data(), mask.data(), cu.data(), int64_t(cu.size()) - 1, int64_t(d.size()),
                        o.w.data(), o.keep.data());
  return o;
}

const double ln = std::log(1.0);

}  // namespace

TEST_CASE("tis weights and metrics by hand") {
  // Ratios 3, 0.5, 1 (and a prompt token): clamp to [0, 2] → 2, 0.5, 1.
  // clip fraction 1/3; mean weight 3.5/3; mean |w − 1| = (1 + 0.5 + 0)/3 = 0.5.
  const std::vector<double> d = {9, std::log(3.0), std::log(0.5), ln};
  const Out o = run(ImportanceSampler<Tis>(), d, {0, 1, 1, 1}, {0, 4});
  REQUIRE(o.w[0] == 0);
  REQUIRE(o.keep[0] == 0);
  REQUIRE_THAT(o.w[1], WithinAbs(2, 1e-15));
  REQUIRE_THAT(o.w[2], WithinAbs(0.5, 1e-15));
  REQUIRE(o.w[3] == 1);
  REQUIRE(o.keep == std::vector<uint8_t>{0, 1, 1, 1});
  REQUIRE_THAT(o.m.clip_fraction(), WithinAbs(1.0 / 3, 1e-15));
  REQUIRE_THAT(o.m.mean_weight(), WithinAbs(3.5 / 3, 1e-15));
  REQUIRE_THAT(o.m.mean_abs_deviation(), WithinAbs(0.5, 1e-15));
  REQUIRE(o.m.rejected_fraction() == 0);
  // Custom bounds by value: [0.8, 1.5].
  const Out c = run(ImportanceSampler<Tis>({.low = 0.8, .high = 1.5}), d, {0, 1, 1, 1}, {0, 4});
  REQUIRE_THAT(c.w[1], WithinAbs(1.5, 1e-15));
  REQUIRE_THAT(c.w[2], WithinAbs(0.8, 1e-15));
}

TEST_CASE("perplexities and k3 kl between trainer and rollout by hand") {
  // old = -1, -2; rollout = -1.5, -1.5: both perplexities exp(1.5);
  // d = 0.5, -0.5: k3 = exp(d) − d − 1 = 0.14872127070012819, 0.10653065971263342.
  const std::vector<double> old = {-1, -2}, rollout = {-1.5, -1.5};
  const std::vector<uint8_t> mask = {1, 1};
  const std::vector<int32_t> cu = {0, 2};
  std::vector<double> w(2);
  std::vector<uint8_t> keep(2);
  const auto m =
      ImportanceSampler<Tis>().compute(old.data(), rollout.data(), mask.data(), cu.data(), 1, 2, w.data(), keep.data());
  REQUIRE_THAT(m.trainer_perplexity(), WithinAbs(std::exp(1.5), 1e-12));
  REQUIRE_THAT(m.rollout_perplexity(), WithinAbs(std::exp(1.5), 1e-12));
  REQUIRE_THAT(m.kl_k3(), WithinAbs((0.14872127070012819 + 0.10653065971263342) / 2, 1e-15));
}

TEST_CASE("mis token level truncate clip and mask by hand") {
  // Ratios 3 and 0.25, bounds [0.5, 2]:
  //   truncate: 2, 0.25 (no lower bound)   clip: 2, 0.5   mask: both rejected
  const std::vector<double> d = {std::log(3.0), std::log(0.25)};
  const std::vector<uint8_t> mask = {1, 1};
  const std::vector<int32_t> cu = {0, 2};
  const Out t = run(ImportanceSampler<Mis<Token, Truncate>>({.low = 0.5, .high = 2}), d, mask, cu);
  REQUIRE_THAT(t.w[0], WithinAbs(2, 1e-15));
  REQUIRE_THAT(t.w[1], WithinAbs(0.25, 1e-15));
  REQUIRE_THAT(t.m.clip_fraction(), WithinAbs(0.5, 1e-15));
  const Out c = run(ImportanceSampler<Mis<Token, Clip>>({.low = 0.5, .high = 2}), d, mask, cu);
  REQUIRE_THAT(c.w[0], WithinAbs(2, 1e-15));
  REQUIRE_THAT(c.w[1], WithinAbs(0.5, 1e-15));
  REQUIRE(c.m.clip_fraction() == 1);
  const Out m = run(ImportanceSampler<Mis<Token, Mask>>({.low = 0.5, .high = 2}), d, mask, cu);
  REQUIRE(m.w == std::vector<double>{0, 0});
  REQUIRE(m.keep == std::vector<uint8_t>{0, 0});
  REQUIRE(m.m.rejected_fraction() == 1);
  // Inside the bounds the mask mode keeps the raw ratio.
  const Out in = run(ImportanceSampler<Mis<Token, Mask>>({.low = 0.5, .high = 2}), {std::log(1.5)}, {1}, {0, 1});
  REQUIRE_THAT(in.w[0], WithinAbs(1.5, 1e-15));
  REQUIRE(in.keep[0] == 1);
}

TEST_CASE("mis sequence and geometric levels by hand") {
  // Sequence 0: d = ln 2, ln 2 → sequence ratio 4, geometric ratio 2.
  // Sequence 1: d = ln 1.5, ln 0.5 → sequence ratio 0.75, geometric sqrt(0.75).
  const std::vector<double> d = {std::log(2.0), std::log(2.0), std::log(1.5), std::log(0.5)};
  const std::vector<uint8_t> mask = {1, 1, 1, 1};
  const std::vector<int32_t> cu = {0, 2, 4};
  const Out s = run(ImportanceSampler<Mis<Sequence, Clip>>({.low = 0.5, .high = 5}), d, mask, cu);
  for (int t = 0; t < 2; ++t) REQUIRE_THAT(s.w[std::size_t(t)], WithinAbs(4, 1e-14));
  for (int t = 2; t < 4; ++t) REQUIRE_THAT(s.w[std::size_t(t)], WithinAbs(0.75, 1e-14));
  const Out g = run(ImportanceSampler<Mis<Geometric, Clip>>({.low = 0.5, .high = 5}), d, mask, cu);
  for (int t = 0; t < 2; ++t) REQUIRE_THAT(g.w[std::size_t(t)], WithinAbs(2, 1e-14));
  for (int t = 2; t < 4; ++t) REQUIRE_THAT(g.w[std::size_t(t)], WithinAbs(std::sqrt(0.75), 1e-14));
  // Geometric mask with [0.5, 1.5]: sequence 0 (ratio 2) rejected whole, sequence 1 kept.
  const Out gm = run(ImportanceSampler<Mis<Geometric, Mask>>({.low = 0.5, .high = 1.5}), d, mask, cu);
  REQUIRE(gm.keep == std::vector<uint8_t>{0, 0, 1, 1});
  REQUIRE(gm.w[0] == 0);
  REQUIRE_THAT(gm.w[3], WithinAbs(std::sqrt(0.75), 1e-14));
  REQUIRE(gm.m.rejected_fraction() == 0.5);
  REQUIRE_THAT(gm.m.mean_weight(), WithinAbs(std::sqrt(0.75), 1e-14));
}

TEST_CASE("mis veto and renormalisation by hand") {
  // Veto 0.1: sequence 0 holds a token of ratio 0.05 → rejected whole, although its other
  // token (ratio 1) is fine; sequence 1 (ratios 2, 0.5) is kept.
  const std::vector<double> d = {std::log(0.05), ln, std::log(2.0), std::log(0.5)};
  const std::vector<uint8_t> mask = {1, 1, 1, 1};
  const std::vector<int32_t> cu = {0, 2, 4};
  const Out v = run(ImportanceSampler<Mis<Token, Clip>>({.low = 0, .high = 3, .veto = 0.1}), d, mask, cu);
  REQUIRE(v.keep == std::vector<uint8_t>{0, 0, 1, 1});
  REQUIRE(v.m.rejected == 2);
  // Renormalised to mean 1 over kept tokens: ratios 1, 2, 0.5 (mean 3.5/3) → scale 3/3.5.
  const std::vector<double> d2 = {ln, std::log(2.0), std::log(0.5)};
  const Out r = run(ImportanceSampler<Mis<Token, Clip>>({.low = 0, .high = 3, .renormalize = MisRenormalize::kept}), d2,
                    {1, 1, 1}, {0, 3});
  REQUIRE_THAT(r.w[0], WithinAbs(3 / 3.5, 1e-14));
  REQUIRE_THAT(r.w[1], WithinAbs(6 / 3.5, 1e-14));
  REQUIRE_THAT(r.m.mean_weight(), WithinAbs(1, 1e-14));
}

TEST_CASE("mis bounds the pooled log-ratio to plus or minus 20 before exp, as slime") {
  // Sequence level: Σ d = -25 → exp(-20) (not exp(-25)) under truncate; Σ d = +25 →
  // exp(20) kept by a mask mode whose bounds admit it.
  const std::vector<double> d = {-15, -10, 15, 10};
  const std::vector<uint8_t> mask = {1, 1, 1, 1};
  const std::vector<int32_t> cu = {0, 2, 4};
  const Out t = run(ImportanceSampler<Mis<Sequence, Truncate>>({.low = 0, .high = 2}), d, mask, cu);
  REQUIRE_THAT(t.w[0], WithinRel(std::exp(-20.0), 1e-14));
  REQUIRE_THAT(t.w[1], WithinRel(std::exp(-20.0), 1e-14));
  REQUIRE(t.w[2] == 2);
  const Out m = run(ImportanceSampler<Mis<Sequence, Mask>>({.low = 0, .high = 1e10}), d, mask, cu);
  REQUIRE(m.keep == std::vector<uint8_t>{1, 1, 1, 1});
  REQUIRE_THAT(m.w[2], WithinRel(std::exp(20.0), 1e-14));
  // Token and geometric levels too: d = 30 → exp(20) under a wide clip.
  const Out tok = run(ImportanceSampler<Mis<Token, Clip>>({.low = 0, .high = 1e10}), {30.0, -30.0}, {1, 1}, {0, 2});
  REQUIRE_THAT(tok.w[0], WithinRel(std::exp(20.0), 1e-14));
  REQUIRE_THAT(tok.w[1], WithinRel(std::exp(-20.0), 1e-14));
  const Out geo = run(ImportanceSampler<Mis<Geometric, Clip>>({.low = 0, .high = 1e10}), {30.0, 24.0}, {1, 1}, {0, 2});
  REQUIRE_THAT(geo.w[0], WithinRel(std::exp(20.0), 1e-14));
  // TIS (slime's vanilla_tis_function) has no bound: exp(-25) clipped at low = 0 stays exp(-25).
  const Out tis = run(ImportanceSampler<Tis>({.low = 0, .high = 2}), {-25.0}, {1}, {0, 1});
  REQUIRE_THAT(tis.w[0], WithinRel(std::exp(-25.0), 1e-14));
}

TEST_CASE("mis renormalisation: slime's batch mean and ours over kept tokens") {
  // Token level, mask [0.5, 3]: ratios 1, 2, 4; 4 is rejected.
  //   batch (slime's --tis-batch-normalize): mean over every loss token of the weights
  //     before rejection, (1 + 2 + 4) / 3 → w = 3/7, 6/7;
  //   kept (ours): mean over the kept weights, 1.5 → w = 2/3, 4/3 (they average 1).
  const std::vector<double> d = {ln, std::log(2.0), std::log(4.0)};
  const Out b = run(ImportanceSampler<Mis<Token, Mask>>({.low = 0.5, .high = 3, .renormalize = MisRenormalize::batch}),
                    d, {1, 1, 1}, {0, 3});
  REQUIRE(b.keep == std::vector<uint8_t>{1, 1, 0});
  REQUIRE_THAT(b.w[0], WithinAbs(3.0 / 7, 1e-14));
  REQUIRE_THAT(b.w[1], WithinAbs(6.0 / 7, 1e-14));
  REQUIRE(b.w[2] == 0);
  const Out k = run(ImportanceSampler<Mis<Token, Mask>>({.low = 0.5, .high = 3, .renormalize = MisRenormalize::kept}),
                    d, {1, 1, 1}, {0, 3});
  REQUIRE_THAT(k.w[0], WithinAbs(2.0 / 3, 1e-14));
  REQUIRE_THAT(k.w[1], WithinAbs(4.0 / 3, 1e-14));
  REQUIRE_THAT(k.m.mean_weight(), WithinAbs(1, 1e-14));
  // Sequence level, clip [0, 3]: s0 two tokens, Σ d = ln 2 → 2; s1 one token 0.5; s2 no loss token.
  //   batch: the mean over the 3 sequences of each one's mean weight, (2 + 0.5 + 0) / 3 → × 1.2;
  //   kept: over the 3 kept tokens, (2 + 2 + 0.5) / 3 = 1.5 → × 2/3.
  const std::vector<double> ds = {std::log(2.0), ln, std::log(0.5), 0.3};
  const std::vector<uint8_t> ms = {1, 1, 1, 0};
  const std::vector<int32_t> cs = {0, 2, 3, 4};
  const Out sb = run(
      ImportanceSampler<Mis<Sequence, Clip>>({.low = 0, .high = 3, .renormalize = MisRenormalize::batch}), ds, ms, cs);
  REQUIRE_THAT(sb.w[0], WithinAbs(2.4, 1e-14));
  REQUIRE_THAT(sb.w[2], WithinAbs(0.6, 1e-14));
  REQUIRE(sb.w[3] == 0);
  const Out sk = run(ImportanceSampler<Mis<Sequence, Clip>>({.low = 0, .high = 3, .renormalize = MisRenormalize::kept}),
                     ds, ms, cs);
  REQUIRE_THAT(sk.w[0], WithinAbs(4.0 / 3, 1e-14));
  REQUIRE_THAT(sk.w[2], WithinAbs(1.0 / 3, 1e-14));
  // slime divides only when the mean exceeds 1e-8: weights of exp(-20) stay as they are.
  const Out tiny =
      run(ImportanceSampler<Mis<Token, Truncate>>({.low = 0, .high = 2, .renormalize = MisRenormalize::batch}), {-30.0},
          {1}, {0, 1});
  REQUIRE_THAT(tiny.w[0], WithinRel(std::exp(-20.0), 1e-14));
  // Off by default (both in slime and here).
  REQUIRE(Mis<Token, Clip>{}.renormalize == MisRenormalize::off);
}

TEST_CASE("rejected tokens leave the numerator but keep the denominator") {
  // Token-level mask [0.5, 2]: the second response token (ratio 3) is rejected.
  // lp = old (trainer ratio 1), A = 1 → pg = -w; token_mean over the original 3 tokens:
  // -(1 + 0 + 1)/3.
  const std::vector<float> old = {-1, -1, -1}, rollout = {-1, float(-1 - std::log(3.0)), -1};
  const Tensor old_t = Tensor::from_vector(old, Shape{3});
  const Tensor mask = Tensor::from_vector(std::vector<uint8_t>{1, 1, 1}, Shape{3});
  const Tensor cu = Tensor::from_vector(std::vector<int32_t>{0, 3}, Shape{2});
  const ImportanceResult is = ImportanceSampler<Mis<Token, Mask>>({.low = 0.5, .high = 2})(
      old_t, Tensor::from_vector(rollout, Shape{3}), mask, cu);
  REQUIRE(is.keep_mask.to_vector<uint8_t>() == std::vector<uint8_t>{1, 0, 1});
  PolicyLossTensors in;
  in.lp = old_t;
  in.old_lp = old_t;
  in.advantages = Tensor::from_vector(std::vector<float>{1, 1, 1}, Shape{3});
  in.loss_mask = mask;
  in.cu_seqlens = cu;
  in.is_weights = is.weights;
  in.keep_mask = is.keep_mask;
  const PolicyLossResult r = policy_loss({}, count_normalizer(mask, cu), in);
  REQUIRE_THAT(r.metrics.loss, WithinAbs(-2.0 / 3, 1e-6));
  REQUIRE(r.grad_lp.to_vector<float>()[1] == 0);
}

TEST_CASE("importance sampler rejects bad inputs") {
  REQUIRE_THROWS_WITH(ImportanceSampler<Tis>({.low = 3, .high = 2}), ContainsSubstring("bounds low > high"));
  REQUIRE_THROWS_WITH((ImportanceSampler<Mis<Token, Clip>>({.low = 2, .high = 1})),
                      ContainsSubstring("bounds low > high"));
  REQUIRE_THROWS_WITH(ImportanceSampler<Tis>({.low = -1, .high = 2}), ContainsSubstring("low must be >= 0"));
  REQUIRE_THROWS_WITH((ImportanceSampler<Mis<Sequence, Mask>>({.low = 0.5, .high = 2, .veto = -1})),
                      ContainsSubstring("veto must be >= 0"));
  const ImportanceSampler<Tis> tis;
  const Tensor a = Tensor::from_vector(std::vector<float>{-1, -2}, Shape{2});
  const Tensor b = Tensor::from_vector(std::vector<float>{-1}, Shape{1});
  const Tensor mask = Tensor::from_vector(std::vector<uint8_t>{1, 1}, Shape{2});
  const Tensor cu = Tensor::from_vector(std::vector<int32_t>{0, 2}, Shape{2});
  REQUIRE_THROWS_WITH(tis(a, b, mask, cu), ContainsSubstring("rollout_lp must have shape (2)"));
  REQUIRE_THROWS_WITH(tis(a, a, mask, Tensor::from_vector(std::vector<int32_t>{0, 1}, Shape{2})),
                      ContainsSubstring("must equal the number of tokens 2"));
  REQUIRE_THROWS_WITH(tis(a, a, Tensor::from_vector(std::vector<int32_t>{1, 1}, Shape{2}), cu),
                      ContainsSubstring("loss_mask must be u8"));
  // Tensor API = template.
  const ImportanceResult r = tis(a, Tensor::from_vector(std::vector<float>{-2, -1}, Shape{2}), mask, cu);
  REQUIRE(r.weights.to_vector<float>() == std::vector<float>{2, std::exp(-1.0f)});
}
