// The fused CUDA policy loss against the CPU reference (rl::policy_loss on f32
// CPU tensors, which computes in double) on fresh random inputs: PPO, GSPO and
// CISPO, every aggregation and KL estimator (k1, k2, unclamped k3,
// low_var_kl), empty sequences counted (slime) or skipped, optional inputs
// present and absent, odd sizes (one token; sequences of 1, 17, 577 tokens;
// 4099 tokens in all; many short sequences, empty ones included), outputs
// poisoned with 0xff (NaN) before each call; slime's definitions on inputs
// that reach them (k3 > 10 where low_var_kl clamps, ratios of 4.5 over a dual
// clip of 3, seq_mean_token_sum with KL and entropy); run-to-run determinism;
// the identical-policies invariant; errors.
//
// Tolerances. The kernel's per-token math is fp32 on the same f32 inputs; the
// reference is double. Per token that is a few fp32 roundings (exp, products):
// ~1e-6 relative, so grad_lp / grad_entropy need ‖gpu − ref‖ / ‖ref‖ ≤ 1e-5 and
// every element within 1e-5 · max|ref|. The metrics are fp64 sums of fp32
// terms: within 1e-5 · max(1, |ref|) (the spiked KL values and the token sums
// of seq_mean_token_sum's pg term exceed 1). Clip decisions must agree exactly: the inputs keep every log-ratio (the
// GSPO sequence mean included) at least 1e-4 (GSPO: 1e-5) away from the clip
// bounds, where fp32 rounding (~1e-7) cannot flip them, so the clip fractions
// (sums of c_t >= 1/4099 each) are compared to 1e-9.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "slime/core/device.hpp"
#include "slime/core/tensor.hpp"
#include "slime/rl/policy_loss.hpp"

using namespace slime;
using namespace slime::rl;
using Catch::Matchers::ContainsSubstring;

namespace {

struct Case {
  std::vector<int32_t> lengths;
  PolicyLossConfig config;
  bool entropy = true, ref = true, weights = true, keep = true;
  uint32_t seed = 1;
};

struct HostBatch {
  std::vector<float> lp, old_lp, adv, ref, entropy, w;
  std::vector<uint8_t> mask, keep;
  std::vector<int32_t> cu;
};

// Random inputs; every log-ratio kept away from the clip bounds (see the top).
HostBatch make_batch(const Case& c) {
  std::mt19937 gen(c.seed);
  std::uniform_real_distribution<double> u(0, 1);
  const bool gspo = c.config.kind == PolicyLossKind::gspo;
  const double spread = gspo ? 2e-3 : 0.8;  // GSPO bounds are tight (e.g. 3e-4): small log-ratios
  std::vector<double> bounds = {std::log(1 - c.config.eps_clip), std::log(1 + c.config.eps_clip_high)};
  if (c.config.eps_clip_c > 0) bounds.push_back(std::log(c.config.eps_clip_c));
  HostBatch b;
  b.cu.push_back(0);
  for (int32_t len : c.lengths) {
    const int32_t prompt = len <= 1 ? 0 : std::min<int32_t>(len - 1, int32_t(gen() % 4));
    const double adv = u(gen) * 4 - 2;
    const std::size_t begin = b.lp.size();
    for (int32_t t = 0; t < len; ++t) {
      const float old = float(-0.05 - 3 * u(gen));
      double d = (u(gen) - 0.5) * spread;
      if (!gspo) {
        for (double x : bounds) {
          if (std::abs(d - x) < 1e-4) d = x + 2e-4;
        }
      }
      b.old_lp.push_back(old);
      b.lp.push_back(float(double(old) + d));
      b.ref.push_back(float(double(old) + (u(gen) - 0.5)));
      b.entropy.push_back(float(2 * u(gen)));
      b.w.push_back(float(0.5 + u(gen)));
      b.adv.push_back(float(c.lengths.size() > 50 ? adv : adv + 0.3 * (u(gen) - 0.5)));  // per-token advantages too
      b.mask.push_back(t >= prompt);
      b.keep.push_back(u(gen) > 0.1);
    }
    if (gspo) {
      // The sequence's mean log-ratio, as the reference computes it, away from the bounds.
      for (int iter = 0; iter < 4; ++iter) {
        double sum = 0, n = 0;
        for (std::size_t t = begin; t < b.lp.size(); ++t) {
          if (!b.mask[t]) continue;
          sum += double(b.lp[t]) - double(b.old_lp[t]);
          n += 1;
        }
        if (n == 0) break;
        bool near = false;
        for (double x : bounds) near = near || std::abs(sum / n - x) < 1e-5;
        if (!near) break;
        for (std::size_t t = begin; t < b.lp.size(); ++t) b.lp[t] = float(double(b.lp[t]) + 3e-5);
      }
    }
    b.cu.push_back(int32_t(b.lp.size()));
  }
  return b;
}

PolicyLossTensors to_tensors(const HostBatch& b, const Case& c, Device d) {
  const int64_t n = int64_t(b.lp.size());
  auto f = [&](const std::vector<float>& v) { return Tensor::from_vector(v, Shape{n}, d); };
  PolicyLossTensors t;
  t.lp = f(b.lp);
  t.old_lp = f(b.old_lp);
  t.advantages = f(b.adv);
  t.loss_mask = Tensor::from_vector(b.mask, Shape{n}, d);
  t.cu_seqlens = Tensor::from_vector(b.cu, Shape{int64_t(b.cu.size())}, d);
  if (c.ref) t.ref_lp = f(b.ref);
  if (c.entropy) t.entropy = f(b.entropy);
  if (c.weights) t.is_weights = f(b.w);
  if (c.keep) t.keep_mask = Tensor::from_vector(b.keep, Shape{n}, d);
  return t;
}

struct GpuRun {
  PolicyLossMetrics metrics;
  std::vector<float> grad_lp, grad_entropy;
};

// policy_loss_into with every output poisoned (0xff: NaN) first.
GpuRun run_gpu(const Case& c, const LossNormalizer& norm, const PolicyLossTensors& in) {
  const Device d = Device::cuda(0);
  const int64_t n = in.lp.size(0), s = in.cu_seqlens.size(0) - 1;
  PolicyLossOutputs out;
  out.grad_lp = Tensor::empty(Shape{n}, DType::f32, d);
  out.grad_lp.fill_bytes_(0xff);
  if (c.entropy) {
    out.grad_entropy = Tensor::empty(Shape{n}, DType::f32, d);
    out.grad_entropy.fill_bytes_(0xff);
  }
  out.workspace = Tensor::empty(Shape{int64_t(policy_loss_workspace_bytes(s))}, DType::u8, d);
  out.workspace.fill_bytes_(0xff);
  policy_loss_into(c.config, norm, in, out);
  GpuRun r;
  r.metrics = read_policy_loss_metrics(out.workspace);
  r.grad_lp = out.grad_lp.to_vector<float>();
  if (c.entropy) r.grad_entropy = out.grad_entropy.to_vector<float>();
  return r;
}

void compare_grad(const std::vector<float>& gpu, const std::vector<float>& ref, const char* what) {
  INFO(what);
  REQUIRE(gpu.size() == ref.size());
  double num = 0, den = 0, max_ref = 0, worst = 0;
  for (std::size_t i = 0; i < gpu.size(); ++i) {
    REQUIRE(std::isfinite(gpu[i]));  // poisoned and never written, or broken
    const double e = double(gpu[i]) - double(ref[i]);
    num += e * e;
    den += double(ref[i]) * ref[i];
    max_ref = std::max(max_ref, std::abs(double(ref[i])));
    worst = std::max(worst, std::abs(e));
  }
  CHECK(std::sqrt(num) <= 1e-5 * std::sqrt(den) + 1e-30);
  CHECK(worst <= 1e-5 * max_ref + 1e-30);
}

void compare_metrics(const PolicyLossMetrics& g, const PolicyLossMetrics& r) {
  const auto tol = [](double ref) { return 1e-5 * std::max(1.0, std::abs(ref)); };
  CHECK(std::abs(g.loss - r.loss) <= tol(r.loss));
  CHECK(std::abs(g.pg_loss - r.pg_loss) <= tol(r.pg_loss));
  CHECK(std::abs(g.entropy - r.entropy) <= tol(r.entropy));
  CHECK(std::abs(g.kl - r.kl) <= tol(r.kl));
  CHECK(std::abs(g.ppo_kl - r.ppo_kl) <= tol(r.ppo_kl));
  CHECK(std::abs(g.clip_fraction - r.clip_fraction) <= 1e-9);
  CHECK(std::abs(g.dual_clip_fraction - r.dual_clip_fraction) <= 1e-9);
}

// slime's definitions made visible: on sequences of 3+ tokens, the last token's
// ratio exp(1.5) = 4.5 (over a dual clip of 3; not for GSPO, whose sequence
// ratios stay small) and the one before it a reference 3.5 below the policy
// (k3 = e^3.5 − 4.5 = 28.6: low_var_kl clamps it, k3 does not). The log-ratios
// stay far from every clip bound and the KL values far from ±10.
void spike(HostBatch& b, bool ratios) {
  for (std::size_t s = 0; s + 1 < b.cu.size(); ++s) {
    const int32_t begin = b.cu[s], end = b.cu[s + 1];
    if (end - begin < 3) continue;
    if (ratios) b.lp[std::size_t(end - 1)] = b.old_lp[std::size_t(end - 1)] + 1.5f;
    b.ref[std::size_t(end - 2)] = b.lp[std::size_t(end - 2)] + 3.5f;
  }
}

// Runs one case on the CPU and the GPU and compares; returns the reference.
PolicyLossMetrics check_case(const Case& c, const std::function<void(HostBatch&)>& modify = {}) {
  HostBatch b = make_batch(c);
  if (modify) modify(b);
  const PolicyLossTensors cpu_in = to_tensors(b, c, Device::cpu());
  const PolicyLossTensors gpu_in = to_tensors(b, c, Device::cuda(0));
  const LossNormalizer norm = count_normalizer(cpu_in.loss_mask, cpu_in.cu_seqlens);
  // The CUDA count_normalizer (a host copy) agrees.
  const LossNormalizer gnorm = count_normalizer(gpu_in.loss_mask, gpu_in.cu_seqlens);
  REQUIRE(gnorm.tokens == norm.tokens);
  REQUIRE(gnorm.sequences == norm.sequences);
  REQUIRE(gnorm.nonempty_sequences == norm.nonempty_sequences);
  const PolicyLossResult ref = policy_loss(c.config, norm, cpu_in);
  const GpuRun gpu = run_gpu(c, norm, gpu_in);
  compare_metrics(gpu.metrics, ref.metrics);
  compare_grad(gpu.grad_lp, ref.grad_lp.to_vector<float>(), "grad_lp");
  if (c.entropy) compare_grad(gpu.grad_entropy, ref.grad_entropy.to_vector<float>(), "grad_entropy");
  return ref.metrics;
}

std::vector<int32_t> many_short(uint32_t seed, int count) {
  std::mt19937 gen(seed);
  std::vector<int32_t> v;
  for (int i = 0; i < count; ++i) v.push_back(int32_t(gen() % 21));  // 0..20 tokens, empty ones included
  return v;
}

}  // namespace

TEST_CASE("fused policy loss matches the cpu reference on odd sizes") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const std::vector<std::vector<int32_t>> shapes = {
      {1}, {1, 17, 577}, {1, 17, 577, 0, 3504} /* 4099 tokens */, many_short(3, 700)};
  int cases = 0;
  double clipped = 0, dual = 0;
  for (const auto& lengths : shapes) {
    for (auto kind : {PolicyLossKind::ppo, PolicyLossKind::gspo, PolicyLossKind::cispo}) {
      for (auto agg : {Aggregation::token_mean, Aggregation::seq_mean_token_mean, Aggregation::seq_mean_token_sum}) {
        Case c;
        c.lengths = lengths;
        c.seed = uint32_t(100 + cases);
        c.config.kind = kind;
        c.config.aggregation = agg;
        c.config.kl_estimator =
            std::array{KlEstimator::k1, KlEstimator::k2, KlEstimator::k3, KlEstimator::low_var_kl}[cases % 4];
        c.config.unbiased_kl = cases % 2 == 1;
        c.config.empty_sequences = cases % 3 == 2 ? EmptySequences::skip : EmptySequences::count;
        c.config.kl_coef = 0.1;
        c.config.entropy_coef = 0.01;
        if (kind == PolicyLossKind::gspo) {
          c.config.eps_clip = 3e-4;
          c.config.eps_clip_high = 4e-4;
          c.config.eps_clip_c = 1.0005;
        } else {
          c.config.eps_clip = 0.2;
          c.config.eps_clip_high = 0.28;
          c.config.eps_clip_c = kind == PolicyLossKind::ppo ? 1.3 : 0;
        }
        // Optional inputs dropped in turn.
        c.entropy = cases % 4 != 1;
        c.weights = cases % 4 != 2;
        c.keep = cases % 4 != 3;
        c.ref = cases % 5 != 4;
        if (!c.entropy) c.config.entropy_coef = 0;
        if (!c.ref) c.config.kl_coef = 0;
        INFO("case " << cases << ": " << lengths.size() << " sequences, kind " << int(kind) << ", aggregation "
                     << int(agg));
        const PolicyLossMetrics m = check_case(c);
        clipped += m.clip_fraction;
        dual += m.dual_clip_fraction;
        ++cases;
      }
    }
  }
  REQUIRE(cases == 36);
  REQUIRE(clipped > 0);  // the random inputs reach the clipped
  REQUIRE(dual > 0);     // and dual-clipped branches
}

TEST_CASE("fused policy loss matches the cpu reference on slime's definitions") {
  // Every kind x aggregation x estimator x empty-sequence mode x unbiased, on
  // many short sequences (empty ones included) plus a long one, with the
  // spikes above: unclamped k3 against low_var_kl, dual clip reached by ratios
  // far above it, seq_mean_token_sum's pg-only token sums beside
  // sequence-mean KL and entropy, and slime's normalisers with empty samples.
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  std::vector<int32_t> lengths = many_short(11, 300);
  lengths.push_back(0);
  lengths.push_back(1500);
  int cases = 0;
  double dual = 0, kl_k3 = 0, kl_low_var = 0;
  for (auto kind : {PolicyLossKind::ppo, PolicyLossKind::gspo, PolicyLossKind::cispo}) {
    for (auto agg : {Aggregation::token_mean, Aggregation::seq_mean_token_mean, Aggregation::seq_mean_token_sum}) {
      for (auto est : {KlEstimator::k3, KlEstimator::low_var_kl}) {
        for (auto empty : {EmptySequences::count, EmptySequences::skip}) {
          for (bool unbiased : {false, true}) {
            Case c;
            c.lengths = lengths;
            c.seed = uint32_t(500 + cases);
            c.config.kind = kind;
            c.config.aggregation = agg;
            c.config.kl_estimator = est;
            c.config.unbiased_kl = unbiased;
            c.config.empty_sequences = empty;
            c.config.kl_coef = 0.1;
            c.config.entropy_coef = 0.05;
            if (kind == PolicyLossKind::gspo) {
              c.config.eps_clip = 3e-4;
              c.config.eps_clip_high = 4e-4;
            } else {
              c.config.eps_clip = 0.2;
              c.config.eps_clip_high = 0.28;
              c.config.eps_clip_c = kind == PolicyLossKind::ppo ? 3 : 0;
            }
            INFO("case " << cases << ": kind " << int(kind) << ", aggregation " << int(agg) << ", estimator "
                         << int(est) << ", empty " << int(empty) << ", unbiased " << unbiased);
            const PolicyLossMetrics m = check_case(c, [&](HostBatch& b) { spike(b, kind != PolicyLossKind::gspo); });
            CHECK(m.clip_fraction <= 1);
            dual += m.dual_clip_fraction;
            (est == KlEstimator::k3 ? kl_k3 : kl_low_var) += m.kl;
            ++cases;
          }
        }
      }
    }
  }
  REQUIRE(cases == 72);
  REQUIRE(dual > 0);            // ratios of 4.5 over the dual clip of 3
  REQUIRE(kl_k3 > kl_low_var);  // the spikes' k3 of 28.6 is clamped to 10 by low_var_kl only
}

TEST_CASE("fused policy loss is deterministic run to run") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  for (auto kind : {PolicyLossKind::ppo, PolicyLossKind::gspo}) {
    Case c;
    c.lengths = many_short(9, 400);
    c.lengths.push_back(4000);
    c.config.kind = kind;
    c.config.aggregation = Aggregation::seq_mean_token_mean;
    c.config.kl_coef = 0.1;
    c.config.entropy_coef = 0.01;
    const HostBatch b = make_batch(c);
    const PolicyLossTensors in = to_tensors(b, c, Device::cuda(0));
    const LossNormalizer norm = count_normalizer(in.loss_mask, in.cu_seqlens);
    const GpuRun a = run_gpu(c, norm, in), d = run_gpu(c, norm, in);
    CHECK(std::memcmp(&a.metrics, &d.metrics, sizeof(PolicyLossMetrics)) == 0);
    CHECK(std::memcmp(a.grad_lp.data(), d.grad_lp.data(), a.grad_lp.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(a.grad_entropy.data(), d.grad_entropy.data(), a.grad_entropy.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("fused policy loss with identical policy reference and rollout gives zero kl and clipping") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  Case c;
  c.lengths = {1, 17, 577, 5};
  const HostBatch b = make_batch(c);
  PolicyLossTensors in = to_tensors(b, c, Device::cuda(0));
  in.old_lp = in.lp;
  in.ref_lp = in.lp;
  in.is_weights =
      Tensor::from_vector(std::vector<float>(b.lp.size(), 1.f), Shape{int64_t(b.lp.size())}, Device::cuda(0));
  const LossNormalizer norm = count_normalizer(in.loss_mask, in.cu_seqlens);
  for (auto kind : {PolicyLossKind::ppo, PolicyLossKind::gspo, PolicyLossKind::cispo}) {
    for (auto est : {KlEstimator::k1, KlEstimator::k2, KlEstimator::k3, KlEstimator::low_var_kl}) {
      c.config.kind = kind;
      c.config.kl_estimator = est;
      c.config.kl_coef = 0.5;
      c.config.eps_clip_c = 3;
      c.config.unbiased_kl = est == KlEstimator::k3 || est == KlEstimator::low_var_kl;
      const PolicyLossResult r = policy_loss(c.config, norm, in);
      CHECK(r.metrics.ppo_kl == 0);
      CHECK(r.metrics.kl == 0);
      CHECK(r.metrics.clip_fraction == 0);
      CHECK(r.metrics.dual_clip_fraction == 0);
    }
  }
}

TEST_CASE("fused policy loss rejects bad inputs") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  Case c;
  c.lengths = {3, 4};
  const HostBatch b = make_batch(c);
  PolicyLossTensors in = to_tensors(b, c, Device::cuda(0));
  const LossNormalizer norm = count_normalizer(in.loss_mask, in.cu_seqlens);
  CHECK_THROWS_WITH(policy_loss(c.config, LossNormalizer{0, 0, 0}, in), ContainsSubstring("must be > 0"));
  CHECK_THROWS_WITH(policy_loss(c.config, LossNormalizer{5, 1, 2}, in), ContainsSubstring("inconsistent"));
  PolicyLossTensors mixed = in;
  mixed.old_lp = in.old_lp.to(Device::cpu());
  CHECK_THROWS_WITH(policy_loss(c.config, norm, mixed), ContainsSubstring("old_lp must be on cuda:0"));
  mixed = in;
  mixed.cu_seqlens = in.cu_seqlens.to(Device::cpu());
  CHECK_THROWS_WITH(policy_loss(c.config, norm, mixed), ContainsSubstring("cu_seqlens must be on cuda:0"));
  PolicyLossOutputs out;
  out.grad_lp = Tensor::empty(Shape{7}, DType::f32, Device::cuda(0));
  out.grad_entropy = Tensor::empty(Shape{7}, DType::f32, Device::cuda(0));
  out.workspace = Tensor::empty(Shape{8}, DType::u8, Device::cuda(0));
  CHECK_THROWS_WITH(policy_loss_into(c.config, norm, in, out), ContainsSubstring("workspace must be u8"));
}
