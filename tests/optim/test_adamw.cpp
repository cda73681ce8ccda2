// AdamW on the CPU: against torch.optim.AdamW (foreach=False) step by step on
// the fixture written by tools/make_adamw_fixture.py (fp32, odd sizes, a new
// gradient and learning rate every step, weight decay 0, grad_scale != 1,
// beta1 < 0.5), against the textbook closed form in double, the bf16 copy,
// grad_scale, the AdamW class (state, step counter, resuming) and bad input.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "slime/io/safetensors.hpp"
#include "slime/optim/adamw.hpp"
#include "slime/optim/optimizer.hpp"

using namespace slime;
using namespace slime::optim;
using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::WithinAbs;

namespace {

// ||got - want|| / ||want|| over n elements (||got - want|| when want is 0).
template <class A, class B>
double rel_err(const A* got, const B* want, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double g = double(got[i]), w = double(want[i]);
    if (!std::isfinite(g)) return INFINITY;
    num += (g - w) * (g - w);
    den += w * w;
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

std::vector<double> parse_list(const std::string& s) {
  std::vector<double> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stod(item));
  return out;
}

struct FixtureCase {
  AdamWConfig cfg;
  std::vector<double> lrs;
  float grad_scale = 1.f;
  int64_t steps = 0, tensors = 0;
};

FixtureCase read_case(const io::SafetensorsFile& f, int c) {
  const auto& m = f.metadata();
  const std::string p = "c" + std::to_string(c) + ".";
  FixtureCase fc;
  fc.cfg.beta1 = std::stod(m.at(p + "beta1"));
  fc.cfg.beta2 = std::stod(m.at(p + "beta2"));
  fc.cfg.eps = std::stod(m.at(p + "eps"));
  fc.cfg.weight_decay = std::stod(m.at(p + "weight_decay"));
  fc.grad_scale = float(std::stod(m.at(p + "grad_scale")));
  fc.lrs = parse_list(m.at(p + "lr"));
  fc.steps = std::stoll(m.at(p + "steps"));
  fc.tensors = std::stoll(m.at(p + "tensors"));
  return fc;
}

std::string fixture_path() { return std::string(SLIME_OPTIM_TEST_DATA) + "/adamw_fixture.safetensors"; }

}  // namespace

TEST_CASE("AdamW matches torch.optim.AdamW step by step (fixture)", "[optim][adamw]") {
  const io::SafetensorsFile f(fixture_path());
  const int cases = std::stoi(f.metadata().at("cases"));
  REQUIRE(cases == 3);
  double worst = 0, worst_double = 0;
  for (int c = 0; c < cases; ++c) {
    const FixtureCase fc = read_case(f, c);
    REQUIRE(int64_t(fc.lrs.size()) == fc.steps);
    const std::string p = "c" + std::to_string(c) + ".t";
    std::vector<Tensor> params, grads;
    // The double-precision reference on the same inputs, beside the fp32 one.
    std::vector<std::vector<double>> dp, dm, dv;
    for (int64_t i = 0; i < fc.tensors; ++i) {
      params.push_back(f.read(p + std::to_string(i) + ".init"));
      grads.push_back(Tensor::empty(params.back().shape(), DType::f32));
      const std::vector<float> init = params.back().to_vector<float>();
      dp.emplace_back(init.begin(), init.end());
      dm.emplace_back(init.size(), 0.0);
      dv.emplace_back(init.size(), 0.0);
    }
    AdamW opt(fc.cfg);
    for (int64_t s = 0; s < fc.steps; ++s) {
      for (int64_t i = 0; i < fc.tensors; ++i) {
        const Tensor g = f.read(p + std::to_string(i) + ".grad");
        const int64_t n = params[std::size_t(i)].numel();
        std::memcpy(grads[std::size_t(i)].data_ptr(), g.data<float>() + s * n, std::size_t(n) * sizeof(float));
      }
      opt.step(params, grads, fc.lrs[std::size_t(s)], fc.grad_scale);
      REQUIRE(opt.step_count() == s + 1);
      const auto state = opt.state_tensors();
      const AdamWCoefficients k = adamw_coefficients(fc.cfg, fc.lrs[std::size_t(s)], s + 1, fc.grad_scale);
      for (int64_t i = 0; i < fc.tensors; ++i) {
        const std::size_t u = std::size_t(i);
        const int64_t n = params[u].numel();
        const std::string t = p + std::to_string(i);
        const Tensor want_p_t = f.read(t + ".param"), want_m_t = f.read(t + ".exp_avg"),
                     want_v_t = f.read(t + ".exp_avg_sq");
        const float* want_p = want_p_t.data<float>() + s * n;
        const float* want_m = want_m_t.data<float>() + s * n;
        const float* want_v = want_v_t.data<float>() + s * n;
        const double ep = rel_err(params[u].data<float>(), want_p, n);
        const double em = rel_err(state[2 * u].second.data<float>(), want_m, n);
        const double ev = rel_err(state[2 * u + 1].second.data<float>(), want_v, n);
        INFO("case " << c << " step " << s + 1 << " tensor " << i << " (" << n << " elements)");
        CHECK(ep <= 1e-6);
        CHECK(em <= 1e-6);
        CHECK(ev <= 1e-6);
        worst = std::max({worst, ep, em, ev});

        // The double reference from the same (fp32) gradients.
        const float* g32 = grads[u].data<float>();
        std::vector<double> gd(g32, g32 + n);
        cpu::adamw_update<double, double>(dp[u].data(), gd.data(), dm[u].data(), dv[u].data(), nullptr, n, k);
        const double dd = rel_err(dp[u].data(), want_p, n);
        CHECK(dd <= 1e-6);  // fp32 rounding of torch's result: ~1e-7
        worst_double = std::max(worst_double, dd);
      }
    }
  }
  // Measured: fp32 1e-8 (bit-exact except the scalar tail element of the 33-
  // and 129-element tensors, where PyTorch's addcdiv rounds differently),
  // double 1.5e-7 (torch's own fp32 rounding).
  std::printf("adamw fixture: worst relative error fp32 %.3g, double reference %.3g\n", worst, worst_double);
}

TEST_CASE("AdamW two steps in double equal the textbook closed form", "[optim][adamw]") {
  // Adam's closed form: m_t = (1 - b1) sum_k b1^(t-k) g_k, v_t = (1 - b2)
  // sum_k b2^(t-k) g_k^2, p_t = p_{t-1} (1 - lr wd) - lr / (1 - b1^t) m_t /
  // (sqrt(v_t / (1 - b2^t)) + eps).
  const AdamWConfig cfg{.lr = 0, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1};
  const double b1 = cfg.beta1, b2 = cfg.beta2, lr = 0.1, wd = cfg.weight_decay, eps = cfg.eps;
  const double g1[] = {0.5, -3.0, 1e-3}, g2[] = {-0.25, 2.0, 0.0};
  double p[] = {1.0, -2.0, 0.5}, m[3] = {}, v[3] = {};
  const double p0[] = {1.0, -2.0, 0.5};

  cpu::adamw_update<double, double>(p, g1, m, v, nullptr, 3, adamw_coefficients(cfg, lr, 1, 1.f));
  for (int i = 0; i < 3; ++i) {
    const double m1 = (1 - b1) * g1[i], v1 = (1 - b2) * g1[i] * g1[i];
    const double p1 = p0[i] * (1 - lr * wd) - lr / (1 - b1) * m1 / (std::sqrt(v1 / (1 - b2)) + eps);
    REQUIRE_THAT(m[i], WithinAbs(m1, 1e-15));
    REQUIRE_THAT(v[i], WithinAbs(v1, 1e-15));
    REQUIRE_THAT(p[i], WithinAbs(p1, 1e-12));
  }
  // Worked by hand for element 0: p = 0.99 - 0.05 / (0.5 + 1e-8) = 0.890000002.
  REQUIRE_THAT(p[0], WithinAbs(0.890000002, 1e-12));
  // The first step moves by lr * sign(g) (|g| >> eps) besides the decay.
  REQUIRE_THAT(p[1], WithinAbs(-2.0 * 0.99 + 0.1, 1e-9));

  const double p1[] = {p[0], p[1], p[2]};
  cpu::adamw_update<double, double>(p, g2, m, v, nullptr, 3, adamw_coefficients(cfg, lr, 2, 1.f));
  for (int i = 0; i < 3; ++i) {
    const double m2 = (1 - b1) * (b1 * g1[i] + g2[i]);
    const double v2 = (1 - b2) * (b2 * g1[i] * g1[i] + g2[i] * g2[i]);
    const double want = p1[i] * (1 - lr * wd) - lr / (1 - b1 * b1) * m2 / (std::sqrt(v2 / (1 - b2 * b2)) + eps);
    REQUIRE_THAT(m[i], WithinAbs(m2, 1e-15));
    REQUIRE_THAT(v[i], WithinAbs(v2, 1e-15));
    REQUIRE_THAT(p[i], WithinAbs(want, 1e-12));
  }
}

TEST_CASE("AdamW grad_scale multiplies the gradient and param_copy is the rounded param", "[optim][adamw]") {
  const int64_t n = 37;
  std::vector<float> p0(n), g(n), g_quarter(n);
  for (int64_t i = 0; i < n; ++i) {
    p0[std::size_t(i)] = std::sin(0.3f * float(i)) * 2.f;
    g[std::size_t(i)] = std::cos(0.7f * float(i)) * 3.f;
    g_quarter[std::size_t(i)] = g[std::size_t(i)] * 0.25f;  // exact
  }
  auto run = [&](const std::vector<float>& grad, float scale, const Tensor& copy) {
    AdamWTensors t{Tensor::from_vector(p0, {n}), Tensor::from_vector(grad, {n}), Tensor::zeros({n}, DType::f32),
                   Tensor::zeros({n}, DType::f32), copy};
    for (int64_t step = 1; step <= 3; ++step) adamw_step({&t, 1}, AdamWConfig{}, 1e-2, step, scale);
    return t;
  };
  const AdamWTensors a = run(g, 0.25f, Tensor());
  const AdamWTensors b = run(g_quarter, 1.f, Tensor());
  REQUIRE(a.param.to_vector<float>() == b.param.to_vector<float>());
  REQUIRE(a.exp_avg.to_vector<float>() == b.exp_avg.to_vector<float>());
  REQUIRE(a.exp_avg_sq.to_vector<float>() == b.exp_avg_sq.to_vector<float>());

  for (DType dt : {DType::bf16, DType::f32}) {
    Tensor copy = Tensor::empty({n}, dt);
    copy.fill_bytes_(0xff);  // NaN: unwritten elements show
    const AdamWTensors c = run(g, 0.25f, copy);
    const std::vector<float> pc = c.param.to_vector<float>();
    REQUIRE(pc == a.param.to_vector<float>());  // the copy changes nothing else
    for (int64_t i = 0; i < n; ++i) {
      if (dt == DType::bf16) {
        REQUIRE(copy.data<BFloat16>()[i].bits == BFloat16(pc[std::size_t(i)]).bits);
      } else {
        REQUIRE(copy.data<float>()[i] == pc[std::size_t(i)]);
      }
    }
  }
}

TEST_CASE("AdamW device_grad_scale multiplies grad_scale, and a non-finite one skips the update", "[optim][adamw]") {
  const int64_t n = 37;
  std::vector<float> p0(n), g(n);
  for (int64_t i = 0; i < n; ++i) {
    p0[std::size_t(i)] = std::sin(0.3f * float(i)) * 2.f;
    g[std::size_t(i)] = std::cos(0.7f * float(i)) * 3.f;
  }
  auto fresh = [&] {
    return AdamWTensors{Tensor::from_vector(p0, {n}), Tensor::from_vector(g, {n}), Tensor::zeros({n}, DType::f32),
                        Tensor::zeros({n}, DType::f32), Tensor::empty({n}, DType::bf16)};
  };
  const float factor = 0.3183f;  // not a power of two: the product rounds
  AdamWTensors host = fresh(), dev = fresh();
  const Tensor scale = Tensor::from_vector(std::vector<float>{factor}, {1});
  for (int64_t step = 1; step <= 3; ++step) {
    adamw_step({&host, 1}, AdamWConfig{}, 1e-2, step, 0.5f * factor);
    adamw_step({&dev, 1}, AdamWConfig{}, 1e-2, step, 0.5f, {}, scale);
  }
  REQUIRE(dev.param.to_vector<float>() == host.param.to_vector<float>());
  REQUIRE(dev.exp_avg_sq.to_vector<float>() == host.exp_avg_sq.to_vector<float>());

  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    AdamWTensors t = fresh();
    t.param_copy.fill_bytes_(0x5a);
    const Tensor skip = Tensor::from_vector(std::vector<float>{bad}, {1});
    adamw_step({&t, 1}, AdamWConfig{}, 1e-2, 1, 1.f, {}, skip);
    REQUIRE(t.param.to_vector<float>() == p0);
    REQUIRE(t.exp_avg.to_vector<float>() == std::vector<float>(std::size_t(n), 0.f));
    REQUIRE(t.param_copy.data<BFloat16>()[0].bits == 0x5a5a);
  }
  AdamWTensors t = fresh();
  REQUIRE_THROWS_WITH(adamw_step({&t, 1}, AdamWConfig{}, 1e-2, 1, 1.f, {}, Tensor::zeros({2}, DType::f32)),
                      ContainsSubstring("device_grad_scale must be one f32 value"));
  REQUIRE_THROWS_WITH(adamw_step({&t, 1}, AdamWConfig{}, 1e-2, 1, 1.f, {}, Tensor::zeros({1}, DType::bf16)),
                      ContainsSubstring("device_grad_scale must be f32"));
}

TEST_CASE("AdamW weight decay is decoupled and skipped at weight_decay 0", "[optim][adamw]") {
  // A zero gradient moves nothing but the decay: p * (1 - lr wd) exactly (m =
  // v = 0 keeps the Adam term 0 / eps = 0).
  AdamWTensors t{Tensor::from_vector(std::vector<float>{1.f, -3.f, 0.5f}, {3}),
                 Tensor::zeros({3}, DType::f32),
                 Tensor::zeros({3}, DType::f32),
                 Tensor::zeros({3}, DType::f32),
                 {}};
  adamw_step({&t, 1}, AdamWConfig{.weight_decay = 0.5}, 0.1, 1);
  const std::vector<float> p = t.param.to_vector<float>();
  REQUIRE(p == std::vector<float>{0.95f, -3.f * 0.95f, 0.5f * 0.95f});
  adamw_step({&t, 1}, AdamWConfig{.weight_decay = 0}, 0.1, 2);
  REQUIRE(t.param.to_vector<float>() == p);
}

TEST_CASE("AdamW class: state tensors, step counter, resume from saved state", "[optim][adamw]") {
  const std::vector<int64_t> sizes = {5, 1, 130};
  auto make = [&](uint64_t salt) {
    std::vector<Tensor> out;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      std::vector<float> v(static_cast<std::size_t>(sizes[i]));
      for (std::size_t j = 0; j < v.size(); ++j) v[j] = std::sin(float(salt * 31 + i * 7 + j));
      out.push_back(Tensor::from_vector(v, {sizes[i]}));
    }
    return out;
  };
  std::vector<Tensor> params = make(1), grads = make(2);
  AdamW a(AdamWConfig{.lr = 5e-3, .weight_decay = 0.05});
  REQUIRE(a.state_tensors().empty());
  REQUIRE(a.config().weight_decay == 0.05);
  for (int s = 0; s < 3; ++s) a.step(params, grads, 5e-3);
  REQUIRE(a.step_count() == 3);
  const auto state = a.state_tensors();
  REQUIRE(state.size() == 6);
  REQUIRE(state[0].first == "exp_avg.0");
  REQUIRE(state[1].first == "exp_avg_sq.0");
  REQUIRE(state[5].first == "exp_avg_sq.2");
  REQUIRE(state[4].second.shape() == Shape{130});

  // Resume: a fresh optimizer with the saved moments and step count takes the
  // same fourth step bit for bit.
  std::vector<Tensor> params_b;
  for (const Tensor& p : params) params_b.push_back(p.clone());
  AdamW b(a.config());
  b.init_state(params_b);
  auto state_b = b.state_tensors();
  for (std::size_t i = 0; i < state.size(); ++i) state_b[i].second.copy_from(state[i].second);
  b.set_step_count(a.step_count());
  a.step(params, grads, 5e-3);
  b.step(params_b, grads, 5e-3);
  REQUIRE(b.step_count() == 4);
  for (std::size_t i = 0; i < params.size(); ++i)
    REQUIRE(params[i].to_vector<float>() == params_b[i].to_vector<float>());

  // Copies, one per param.
  std::vector<Tensor> copies;
  for (int64_t n : sizes) copies.push_back(Tensor::empty({n}, DType::bf16));
  a.step(params, grads, 5e-3, 0.5f, copies);
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::vector<float> p = params[i].to_vector<float>();
    for (std::size_t j = 0; j < p.size(); ++j) REQUIRE(copies[i].data<BFloat16>()[j].bits == BFloat16(p[j]).bits);
  }

  // Mismatched calls.
  REQUIRE_THROWS_WITH(a.step(std::span(params).first(2), std::span(grads).first(2), 1e-3),
                      ContainsSubstring("got 2 params, the optimizer holds state for 3"));
  REQUIRE_THROWS_WITH(a.step(params, std::span(grads).first(2), 1e-3), ContainsSubstring("3 params but 2 grads"));
  REQUIRE_THROWS_WITH(a.step(params, grads, 1e-3, 1.f, std::span(copies).first(1)),
                      ContainsSubstring("1 param_copies"));
  std::vector<Tensor> wrong = {params[0], params[2], params[1]};
  REQUIRE_THROWS_WITH(a.step(wrong, grads, 1e-3), ContainsSubstring("params[1]"));
  REQUIRE(a.step_count() == 5);  // failed calls do not count
  REQUIRE_THROWS_WITH(a.set_step_count(-1), ContainsSubstring("negative"));
}

TEST_CASE("AdamW rejects bad settings and tensors", "[optim][adamw]") {
  REQUIRE_THROWS_WITH(AdamW(AdamWConfig{.beta1 = 1.0}), ContainsSubstring("beta1 must be in [0, 1)"));
  REQUIRE_THROWS_WITH(AdamW(AdamWConfig{.beta2 = -0.1}), ContainsSubstring("beta2 must be in [0, 1)"));
  REQUIRE_THROWS_WITH(AdamW(AdamWConfig{.eps = -1}), ContainsSubstring("eps must be finite"));
  REQUIRE_THROWS_WITH(AdamW(AdamWConfig{.weight_decay = -0.1}), ContainsSubstring("weight_decay"));
  REQUIRE_THROWS_WITH(AdamW(AdamWConfig{.lr = NAN}), ContainsSubstring("lr must be finite"));

  auto group = [](int64_t n) {
    return AdamWTensors{Tensor::zeros({n}, DType::f32),
                        Tensor::zeros({n}, DType::f32),
                        Tensor::zeros({n}, DType::f32),
                        Tensor::zeros({n}, DType::f32),
                        {}};
  };
  AdamWTensors t = group(4);
  const AdamWConfig cfg;
  REQUIRE_THROWS_WITH(adamw_step({&t, 1}, cfg, 1e-3, 0), ContainsSubstring("step is 1-based"));
  REQUIRE_THROWS_WITH(adamw_step({&t, 1}, cfg, -1e-3, 1), ContainsSubstring("lr must be finite and >= 0"));
  REQUIRE_THROWS_WITH(adamw_step({&t, 1}, cfg, 1e-3, 1, NAN), ContainsSubstring("grad_scale must be finite"));
  REQUIRE_THROWS_WITH(adamw_step({&t, 1}, cfg, 1e-3, 1, INFINITY), ContainsSubstring("grad_scale must be finite"));

  AdamWTensors bad = group(4);
  bad.grad = Tensor::zeros({4}, DType::bf16);
  REQUIRE_THROWS_WITH(adamw_step({&bad, 1}, cfg, 1e-3, 1), ContainsSubstring("tensors[0].grad must be f32"));
  bad = group(4);
  bad.exp_avg_sq = Tensor::zeros({5}, DType::f32);
  REQUIRE_THROWS_WITH(adamw_step({&bad, 1}, cfg, 1e-3, 1), ContainsSubstring("exp_avg_sq must have 4 elements"));
  bad = group(4);
  bad.param_copy = Tensor::zeros({4}, DType::f16);
  REQUIRE_THROWS_WITH(adamw_step({&bad, 1}, cfg, 1e-3, 1), ContainsSubstring("param_copy must be bf16 or f32"));
  bad = group(4);
  bad.param_copy = Tensor::zeros({3}, DType::bf16);
  REQUIRE_THROWS_WITH(adamw_step({&bad, 1}, cfg, 1e-3, 1), ContainsSubstring("param_copy must have 4 elements"));
  bad = group(4);
  bad.grad = bad.param;
  REQUIRE_THROWS_WITH(adamw_step({&bad, 1}, cfg, 1e-3, 1), ContainsSubstring("param and grad overlap"));
  bad = group(4);
  bad.exp_avg = Tensor();
  REQUIRE_THROWS_WITH(adamw_step({&bad, 1}, cfg, 1e-3, 1), ContainsSubstring("exp_avg is undefined"));
  AdamWTensors two[] = {group(4), group(3)};
  two[1].param = Tensor::zeros({3}, DType::bf16);
  REQUIRE_THROWS_WITH(adamw_step(two, cfg, 1e-3, 1), ContainsSubstring("tensors[1].param must be f32"));

  // Empty lists and empty tensors are no-ops.
  adamw_step({}, cfg, 1e-3, 1);
  AdamWTensors empty = group(0);
  adamw_step({&empty, 1}, cfg, 1e-3, 1);
}

TEST_CASE("AdamW and NoOptimizer model ShardOptimizer: release_state keeps the step count", "[optim][adamw]") {
  static_assert(ShardOptimizer<AdamW> && AdamW::trains && AdamW::state_per_param == 2);
  static_assert(ShardOptimizer<NoOptimizer> && !NoOptimizer::trains && NoOptimizer::state_per_param == 0);
  static_assert(std::is_same_v<AdamW::Config, AdamWConfig>);
  auto make = [](uint64_t salt) {
    std::vector<Tensor> out;
    for (int64_t n : {7, 33}) {
      std::vector<float> v(static_cast<std::size_t>(n));
      for (std::size_t j = 0; j < v.size(); ++j) v[j] = std::cos(float(salt * 13 + std::size_t(n) + j));
      out.push_back(Tensor::from_vector(v, {n}));
    }
    return out;
  };
  std::vector<Tensor> pa = make(1), grads = make(2), pb;
  for (const Tensor& p : pa) pb.push_back(p.clone());
  AdamW a, b;
  for (int s = 0; s < 2; ++s) {
    a.step(pa, grads, 1e-2);
    b.step(pb, grads, 1e-2);
  }
  // b saves its state, drops it (as runtime offload does), restores it.
  std::vector<Tensor> saved;
  for (const auto& [name, t] : b.state_tensors()) saved.push_back(t.clone());
  b.release_state();
  REQUIRE(b.state_tensors().empty());
  REQUIRE(b.step_count() == 2);
  b.init_state(pb);
  auto state = b.state_tensors();
  REQUIRE(state.size() == AdamW::state_per_param * pb.size());
  for (std::size_t i = 0; i < state.size(); ++i) {
    REQUIRE(state[i].second.to_vector<float>() == std::vector<float>(std::size_t(state[i].second.numel()), 0.f));
    state[i].second.copy_from(saved[i]);
  }
  a.step(pa, grads, 1e-2);
  b.step(pb, grads, 1e-2);
  REQUIRE(b.step_count() == 3);
  for (std::size_t i = 0; i < pa.size(); ++i) REQUIRE(pa[i].to_vector<float>() == pb[i].to_vector<float>());

  NoOptimizer none{NoOptimizer::Config{}};
  none.init_state(pa);
  REQUIRE(none.state_tensors().empty());
  REQUIRE(none.step_count() == 0);
  REQUIRE_THROWS_WITH(none.step(pa, grads, 1e-2), ContainsSubstring("frozen"));
}
