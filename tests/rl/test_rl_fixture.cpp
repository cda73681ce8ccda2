// The CPU reference of the RL objectives against an independent PyTorch
// implementation (tools/make_rl_fixture.py, float64 and autograd) on a fixed
// random packed batch of 281 tokens in 10 sequences: GRPO and REINFORCE++
// advantages, the on-policy distillation penalty, TIS and MIS weights with their metrics (the ±20 log-ratio
// bound, slime's batch renormalisation and ours), and fourteen policy-loss
// configurations (PPO / GSPO / CISPO, every aggregation and KL estimator k1,
// k2, k3, low_var_kl, unbiased KL, dual clip with ratios above its threshold,
// importance weights, rejected tokens, empty sequences counted as slime does or
// skipped): the loss, every metric and the gradients with respect to lp and
// entropy.
//
// Tolerances: both sides compute in double from the same double inputs; the
// differences are summation order (~1e-16 relative per sum), so 1e-12
// (relative to max(1, |value|)) is strict. The f32 Tensor API is checked
// against the fixture at 1e-5 (float inputs and outputs).
#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "slime/io/safetensors.hpp"
#include "slime/rl/advantages.hpp"
#include "slime/rl/importance_sampler.hpp"
#include "slime/rl/policy_loss.hpp"

using namespace slime;
using namespace slime::rl;

namespace {

const io::SafetensorsFile& fixture() {
  static const io::SafetensorsFile f(std::string(SLIME_RL_TEST_DATA) + "/rl_fixture.safetensors");
  return f;
}

std::vector<double> f64(const std::string& name) {
  const auto& info = fixture().info(name);
  REQUIRE(info.dtype_name == "F64");
  const auto bytes = fixture().raw_bytes(name);
  std::vector<double> out(bytes.size() / sizeof(double));
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

template <class T>
std::vector<T> ints(const std::string& name) {
  return fixture().read(name).to_vector<T>();
}

// max_i |a_i − b_i| / max(1, |b_i|).
double max_rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(1.0, std::abs(b[i])));
  }
  return worst;
}

struct Inputs {
  std::vector<int32_t> cu = ints<int32_t>("cu_seqlens");
  std::vector<uint8_t> mask = ints<uint8_t>("loss_mask");
  std::vector<int64_t> groups = ints<int64_t>("group_sizes");
  std::vector<double> lp = f64("lp"), old_lp = f64("old_lp"), ref_lp = f64("ref_lp"), rollout_lp = f64("rollout_lp"),
                      entropy = f64("entropy"), kl_shaping = f64("kl_shaping"), rewards = f64("rewards"),
                      adv = f64("adv.tokens");
  int64_t tokens() const { return int64_t(lp.size()); }
  int64_t seqs() const { return int64_t(cu.size()) - 1; }
};

constexpr double kTol = 1e-12;

}  // namespace

TEST_CASE("advantages match the pytorch fixture") {
  const Inputs in;
  REQUIRE(in.tokens() == 281);
  REQUIRE(in.seqs() == 10);
  const int64_t n = int64_t(in.rewards.size());
  std::vector<double> a(std::size_t(n), 7.0), tok(std::size_t(in.tokens()), 7.0);
  cpu::grpo_advantages(in.rewards.data(), n, in.groups.data(), int64_t(in.groups.size()), true, a.data());
  CHECK(max_rel_error(a, f64("adv.grpo_std")) < kTol);
  cpu::broadcast_to_tokens(a.data(), n, nullptr, in.cu.data(), in.seqs(), in.mask.data(), in.tokens(), tok.data());
  CHECK(max_rel_error(tok, in.adv) < kTol);
  cpu::grpo_advantages(in.rewards.data(), n, in.groups.data(), int64_t(in.groups.size()), false, a.data());
  CHECK(max_rel_error(a, f64("adv.grpo")) < kTol);
  // REINFORCE++: shaping kl_coef 0.05, gamma 0.97, whitened (the script's constants).
  cpu::reinforce_pp_advantages(in.rewards.data(), in.kl_shaping.data(), in.mask.data(), in.cu.data(), in.seqs(),
                               in.tokens(), 0.05, 0.97, true, tok.data());
  CHECK(max_rel_error(tok, f64("adv.reinforce_pp")) < kTol);
  cpu::reinforce_pp_baseline_advantages(in.rewards.data(), in.groups.data(), int64_t(in.groups.size()),
                                        in.kl_shaping.data(), in.mask.data(), in.cu.data(), in.seqs(), in.tokens(),
                                        0.05, true, tok.data());
  CHECK(max_rel_error(tok, f64("adv.reinforce_pp_baseline")) < kTol);
  // On-policy distillation: coefficient 0.7, the student's logprobs are old_lp.
  std::vector<double> opd = in.adv, rkl(std::size_t(in.tokens()), 7.0);
  const std::vector<double> teacher = f64("teacher_lp");
  cpu::apply_opd(in.old_lp.data(), teacher.data(), in.mask.data(), in.tokens(), 0.7, opd.data(), rkl.data());
  CHECK(max_rel_error(opd, f64("adv.opd")) < kTol);
  CHECK(max_rel_error(rkl, f64("opd.reverse_kl")) < kTol);
}

namespace {

template <class Policy>
void check_importance(const Inputs& in, const std::string& name, Policy policy) {
  INFO("importance case " << name);
  const ImportanceSampler<Policy> sampler(policy);
  std::vector<double> w(std::size_t(in.tokens()), 7.0);
  std::vector<uint8_t> keep(std::size_t(in.tokens()), 7);
  const ImportanceMetrics m = sampler.compute(in.old_lp.data(), in.rollout_lp.data(), in.mask.data(), in.cu.data(),
                                              in.seqs(), in.tokens(), w.data(), keep.data());
  CHECK(max_rel_error(w, f64("is." + name + ".weights")) < kTol);
  CHECK(keep == ints<uint8_t>("is." + name + ".keep"));
  const std::vector<double> got = {
      m.mean_weight(),        m.clip_fraction(), m.rejected_fraction(), m.mean_abs_deviation(), m.trainer_perplexity(),
      m.rollout_perplexity(), m.kl_k3()};
  CHECK(max_rel_error(got, f64("is." + name + ".metrics")) < kTol);
}

template <class Level>
void check_mis(const Inputs& in, const std::string& name, int mode, double low, double high, double veto,
               MisRenormalize renorm) {
  switch (mode) {
    case 0:
      return check_importance(in, name, Mis<Level, Truncate>{low, high, veto, renorm});
    case 1:
      return check_importance(in, name, Mis<Level, Clip>{low, high, veto, renorm});
    default:
      return check_importance(in, name, Mis<Level, Mask>{low, high, veto, renorm});
  }
}

}  // namespace

TEST_CASE("importance weights match the pytorch fixture") {
  const Inputs in;
  int cases = 0;
  for (const std::string& name : fixture().names()) {
    if (name.rfind("is.", 0) != 0 || name.find(".config") == std::string::npos) continue;
    const std::string is = name.substr(3, name.size() - 3 - 7);
    const auto c = f64(name);
    REQUIRE(c.size() == 6);
    const int level = int(c[0]), mode = int(c[1]);
    const MisRenormalize renorm =
        std::array{MisRenormalize::off, MisRenormalize::batch, MisRenormalize::kept}[std::size_t(c[5])];
    if (level == 0) {
      REQUIRE(mode == 1);
      REQUIRE(c[4] == 0);
      check_importance(in, is, Tis{c[2], c[3]});
    } else if (level == 1) {
      check_mis<Token>(in, is, mode, c[2], c[3], c[4], renorm);
    } else if (level == 2) {
      check_mis<Sequence>(in, is, mode, c[2], c[3], c[4], renorm);
    } else {
      check_mis<Geometric>(in, is, mode, c[2], c[3], c[4], renorm);
    }
    ++cases;
  }
  REQUIRE(cases == 10);
}

namespace {

struct LossCase {
  PolicyLossConfig config;
  bool use_weights = false, use_keep = false;
};

LossCase loss_case(int i) {
  const auto c = f64("loss." + std::to_string(i) + ".config");
  REQUIRE(c.size() == 12);
  LossCase lc;
  lc.config.kind = std::array{PolicyLossKind::ppo, PolicyLossKind::gspo, PolicyLossKind::cispo}[std::size_t(c[0])];
  lc.config.aggregation = std::array{Aggregation::token_mean, Aggregation::seq_mean_token_mean,
                                     Aggregation::seq_mean_token_sum}[std::size_t(c[1])];
  lc.config.kl_estimator =
      std::array{KlEstimator::k1, KlEstimator::k2, KlEstimator::k3, KlEstimator::low_var_kl}[std::size_t(c[2])];
  lc.config.unbiased_kl = c[3] != 0;
  lc.config.eps_clip = c[4];
  lc.config.eps_clip_high = c[5];
  lc.config.eps_clip_c = c[6];
  lc.config.entropy_coef = c[7];
  lc.config.kl_coef = c[8];
  lc.use_weights = c[9] != 0;
  lc.use_keep = c[10] != 0;
  lc.config.empty_sequences = std::array{EmptySequences::count, EmptySequences::skip}[std::size_t(c[11])];
  return lc;
}

constexpr int kLossCases = 14;

}  // namespace

TEST_CASE("policy losses match the pytorch fixture") {
  const Inputs in;
  const std::vector<double> w = f64("is.tis.weights");
  const std::vector<uint8_t> keep = ints<uint8_t>("is.mis_token_mask.keep");
  const LossNormalizer norm = cpu::count_normalizer(in.mask.data(), in.cu.data(), in.seqs(), in.tokens());
  REQUIRE(norm.tokens == 252);
  REQUIRE(norm.sequences == 10);
  REQUIRE(norm.nonempty_sequences == 9);
  double clipped = 0, dual = 0;
  for (int i = 0; i < kLossCases; ++i) {
    INFO("loss case " << i);
    const LossCase lc = loss_case(i);
    cpu::PolicyLossArgs<double> a;
    a.lp = in.lp.data();
    a.old_lp = in.old_lp.data();
    a.advantages = in.adv.data();
    a.loss_mask = in.mask.data();
    a.cu_seqlens = in.cu.data();
    a.num_seqs = in.seqs();
    a.tokens = in.tokens();
    a.maybe_ref_lp = in.ref_lp.data();
    a.maybe_entropy = in.entropy.data();
    a.maybe_is_weights = lc.use_weights ? w.data() : nullptr;
    a.maybe_keep = lc.use_keep ? keep.data() : nullptr;
    std::vector<double> g(std::size_t(in.tokens()), 7.0), ge(g.size(), 7.0);
    const PolicyLossMetrics m = cpu::policy_loss(lc.config, norm, a, g.data(), ge.data());
    const std::vector<double> got = {m.loss,   m.pg_loss,       m.entropy,           m.kl,
                                     m.ppo_kl, m.clip_fraction, m.dual_clip_fraction};
    const std::string p = "loss." + std::to_string(i);
    CHECK(max_rel_error(got, f64(p + ".metrics")) < kTol);
    CHECK(max_rel_error(g, f64(p + ".grad_lp")) < kTol);
    CHECK(max_rel_error(ge, f64(p + ".grad_entropy")) < kTol);
    clipped += m.clip_fraction;
    dual += m.dual_clip_fraction;
  }
  // The fixture reaches the clipped and dual-clipped branches.
  REQUIRE(clipped > 0);
  REQUIRE(dual > 0);
  REQUIRE(f64("loss.0.metrics")[6] > 0);  // dual clip 3, ratios of 4.5
}

TEST_CASE("policy loss f32 tensor api matches the pytorch fixture") {
  const Inputs in;
  auto f32 = [](const std::vector<double>& v) {
    return Tensor::from_vector(std::vector<float>(v.begin(), v.end()), Shape{int64_t(v.size())});
  };
  PolicyLossTensors t;
  t.lp = f32(in.lp);
  t.old_lp = f32(in.old_lp);
  t.advantages = f32(in.adv);
  t.ref_lp = f32(in.ref_lp);
  t.entropy = f32(in.entropy);
  t.is_weights = f32(f64("is.tis.weights"));
  t.keep_mask = Tensor::from_vector(ints<uint8_t>("is.mis_token_mask.keep"), Shape{in.tokens()});
  t.loss_mask = Tensor::from_vector(in.mask, Shape{in.tokens()});
  t.cu_seqlens = Tensor::from_vector(in.cu, Shape{in.seqs() + 1});
  const LossNormalizer norm = count_normalizer(t.loss_mask, t.cu_seqlens);
  for (int i : {0, 4, 7, 10, 12}) {  // PPO, GSPO and CISPO with weights, rejected tokens, KL and entropy
    INFO("loss case " << i);
    const LossCase lc = loss_case(i);
    REQUIRE(lc.use_weights);
    REQUIRE(lc.use_keep);
    const PolicyLossResult r = policy_loss(lc.config, norm, t);
    const std::string p = "loss." + std::to_string(i);
    const auto gl = r.grad_lp.to_vector<float>(), ge = r.grad_entropy.to_vector<float>();
    CHECK(max_rel_error(std::vector<double>(gl.begin(), gl.end()), f64(p + ".grad_lp")) < 1e-5);
    CHECK(max_rel_error(std::vector<double>(ge.begin(), ge.end()), f64(p + ".grad_entropy")) < 1e-5);
    CHECK(std::abs(r.metrics.loss - f64(p + ".metrics")[0]) < 1e-5);
  }
}
