// Learning-rate schedules at their key steps and bad settings; the global
// gradient norm against a direct computation, sharded over 1, 2 and 3
// LocalComm ranks, with NaN / inf gradients; the clip coefficient.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numbers>
#include <utility>
#include <vector>

#include "slime/comm/local_comm.hpp"
#include "slime/optim/grad_clip.hpp"
#include "slime/optim/lr_schedule.hpp"

using namespace slime;
using namespace slime::optim;
using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::WithinAbs;
using Catch::Matchers::WithinRel;

TEST_CASE("constant and linear warm-up schedules", "[optim][lr_schedule]") {
  const LrSchedule c = LrSchedule::constant(3e-4);
  REQUIRE(c.kind() == LrSchedule::Kind::constant);
  for (int64_t s : {1, 2, 1000000}) REQUIRE(c.lr(s) == 3e-4);

  const LrSchedule w = LrSchedule::linear_warmup(1e-3, 10);
  REQUIRE_THAT(w.lr(1), WithinRel(1e-4, 1e-15));
  REQUIRE_THAT(w.lr(5), WithinRel(5e-4, 1e-15));
  REQUIRE(w.lr(10) == 1e-3);
  REQUIRE(w.lr(11) == 1e-3);
  REQUIRE(w.lr(100000) == 1e-3);
  REQUIRE(LrSchedule::linear_warmup(1e-3, 0).lr(1) == 1e-3);  // no warm-up
}

TEST_CASE("cosine schedule with warm-up decays to the minimum", "[optim][lr_schedule]") {
  const double peak = 1e-3, floor = 1e-5;
  const LrSchedule s = LrSchedule::cosine(peak, 100, 1100, floor);
  REQUIRE(s.kind() == LrSchedule::Kind::cosine);
  REQUIRE(s.peak_lr() == peak);
  REQUIRE(s.min_lr() == floor);
  REQUIRE(s.warmup_steps() == 100);
  REQUIRE(s.total_steps() == 1100);
  REQUIRE_THAT(s.lr(1), WithinRel(peak / 100, 1e-14));
  REQUIRE_THAT(s.lr(50), WithinRel(peak / 2, 1e-14));
  REQUIRE(s.lr(100) == peak);
  // Quarter, half and three quarters of the decay: cos(pi/4), 0, cos(3pi/4).
  const double q = (1 + std::cos(std::numbers::pi / 4)) / 2;
  REQUIRE_THAT(s.lr(350), WithinRel(floor + (peak - floor) * q, 1e-12));
  REQUIRE_THAT(s.lr(600), WithinRel((peak + floor) / 2, 1e-12));
  REQUIRE_THAT(s.lr(850), WithinRel(floor + (peak - floor) * (1 - q), 1e-12));
  REQUIRE_THAT(s.lr(1099),
               WithinRel(floor + (peak - floor) * (1 + std::cos(std::numbers::pi * 999 / 1000)) / 2, 1e-12));
  REQUIRE(s.lr(1100) == floor);
  REQUIRE(s.lr(5000) == floor);
  // Monotone after the warm-up.
  for (int64_t k = 101; k <= 1100; ++k) REQUIRE(s.lr(k) <= s.lr(k - 1));

  // No warm-up: the first step is already (slightly) below the peak; min 0.
  const LrSchedule z = LrSchedule::cosine(peak, 0, 10);
  REQUIRE_THAT(z.lr(1), WithinRel(peak * (1 + std::cos(std::numbers::pi / 10)) / 2, 1e-14));
  REQUIRE_THAT(z.lr(5), WithinAbs(peak / 2, 1e-18));
  REQUIRE(z.lr(10) == 0);
  // total == warmup: the warm-up, then the minimum.
  const LrSchedule flat = LrSchedule::cosine(peak, 4, 4, floor);
  REQUIRE(flat.lr(4) == peak);
  REQUIRE(flat.lr(5) == floor);
}

TEST_CASE("schedules reject bad settings", "[optim][lr_schedule]") {
  REQUIRE_THROWS_WITH(LrSchedule::constant(-1), ContainsSubstring("lr must be finite and >= 0"));
  REQUIRE_THROWS_WITH(LrSchedule::constant(NAN), ContainsSubstring("lr must be finite and >= 0"));
  REQUIRE_THROWS_WITH(LrSchedule::linear_warmup(1e-3, -1), ContainsSubstring("warmup_steps must be >= 0"));
  REQUIRE_THROWS_WITH(LrSchedule::cosine(1e-3, 10, 5),
                      ContainsSubstring("total_steps (5) must be >= warmup_steps (10)"));
  REQUIRE_THROWS_WITH(LrSchedule::cosine(1e-3, 10, 50, 2e-3), ContainsSubstring("min_lr"));
  REQUIRE_THROWS_WITH(LrSchedule::cosine(1e-3, 10, 50, -1), ContainsSubstring("min_lr must be finite"));
  REQUIRE_THROWS_WITH(LrSchedule::cosine(INFINITY, 10, 50), ContainsSubstring("lr must be finite"));
  REQUIRE_THROWS_WITH(LrSchedule::constant(1e-3).lr(0), ContainsSubstring("step is 1-based"));
  REQUIRE_THROWS_WITH(LrSchedule::cosine(1e-3, 1, 2).lr(-3), ContainsSubstring("step is 1-based"));
}

namespace {

// Tensors of odd sizes with values of varied magnitude.
std::vector<std::vector<float>> grad_values() {
  std::vector<std::vector<float>> out;
  for (int64_t n : {1, 7, 4097, 100, 33}) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = std::sin(float(i) * 0.37f + float(n)) * (1.f + float(i % 13)) * (n == 7 ? 100.f : 1.f);
    out.push_back(v);
  }
  return out;
}

double direct_norm(const std::vector<std::vector<float>>& g) {
  long double s = 0;
  for (const auto& v : g)
    for (float x : v) s += (long double)x * x;
  return double(std::sqrt(s));
}

}  // namespace

TEST_CASE("global grad norm equals a direct computation", "[optim][grad_clip]") {
  const auto values = grad_values();
  std::vector<Tensor> grads;
  for (const auto& v : values) grads.push_back(Tensor::from_vector(v, {int64_t(v.size())}));
  REQUIRE_THAT(global_grad_norm(grads), WithinRel(direct_norm(values), 1e-14));
  REQUIRE(global_grad_norm({}) == 0);
  REQUIRE(global_grad_norm(std::span(grads).first(1)) == std::abs(double(values[0][0])));
  REQUIRE_THROWS_WITH(global_grad_norm(std::vector<Tensor>{Tensor::zeros({3}, DType::bf16)}),
                      ContainsSubstring("grads[0] must be f32"));
}

TEST_CASE("global grad norm sharded over 1, 2, 3 LocalComm ranks equals the unsharded norm", "[optim][grad_clip]") {
  const auto values = grad_values();
  const double want = direct_norm(values);
  for (int world : {1, 2, 3}) {
    std::vector<double> got(std::size_t(world), -1.0);
    comm::run_local_ranks(world, [&](comm::Comm& c) {
      // Rank r holds the r-th of `world` uneven, disjoint slices of every
      // tensor (some empty: a 1-element tensor has one owner).
      std::vector<Tensor> shards;
      for (const auto& v : values) {
        const int64_t n = int64_t(v.size());
        const int64_t begin = n * c.rank() * c.rank() / (world * world);
        const int64_t end = n * (c.rank() + 1) * (c.rank() + 1) / (world * world);
        shards.push_back(Tensor::from_vector(std::vector<float>(v.begin() + begin, v.begin() + end), {end - begin}));
      }
      got[std::size_t(c.rank())] = global_grad_norm(shards, &c);
    });
    for (double g : got) {
      INFO("world " << world);
      // The ranks' fp64 sums travel as one f32 value each: ~1e-7 relative.
      REQUIRE_THAT(g, WithinRel(want, 1e-6));
      REQUIRE(g == got[0]);  // every rank gets the same value
    }
  }
}

TEST_CASE("a NaN or infinite gradient gives a non-finite norm, which clip_coefficient refuses", "[optim][grad_clip]") {
  auto values = grad_values();
  values[2][100] = std::numeric_limits<float>::quiet_NaN();
  std::vector<Tensor> grads;
  for (const auto& v : values) grads.push_back(Tensor::from_vector(v, {int64_t(v.size())}));
  const double nan_norm = global_grad_norm(grads);
  REQUIRE(std::isnan(nan_norm));
  REQUIRE_THROWS_WITH(clip_coefficient(nan_norm, 1.0), ContainsSubstring("skip this step"));

  grads[2].data<float>()[100] = std::numeric_limits<float>::infinity();
  const double inf_norm = global_grad_norm(grads);
  REQUIRE(std::isinf(inf_norm));
  REQUIRE_THROWS_WITH(clip_coefficient(inf_norm, 1.0), ContainsSubstring("gradient norm is inf"));

  // Sharded: one rank's NaN reaches every rank (the ranks record, the test
  // thread asserts: Catch2's assertions are not thread-safe).
  std::vector<double> rank_norms(2, 0.0);
  comm::run_local_ranks(2, [&](comm::Comm& c) {
    Tensor g = Tensor::from_vector(std::vector<float>{1.f, c.rank() == 1 ? NAN : 2.f}, {2});
    rank_norms[std::size_t(c.rank())] = global_grad_norm({&g, 1}, &c);
  });
  CHECK(std::isnan(rank_norms[0]));
  CHECK(std::isnan(rank_norms[1]));
}

TEST_CASE("clip coefficient is torch's max_norm / (norm + 1e-6) capped at 1", "[optim][grad_clip]") {
  REQUIRE(clip_coefficient(10.0, 1.0) == float(1.0 / (10.0 + 1e-6)));
  REQUIRE(clip_coefficient(4.0, 2.0) == float(2.0 / (4.0 + 1e-6)));
  REQUIRE(clip_coefficient(0.5, 1.0) == 1.f);
  REQUIRE(clip_coefficient(1.0, 1.0) == float(1.0 / (1.0 + 1e-6)));  // torch clips at norm == max_norm too
  REQUIRE(clip_coefficient(1.0, 1.0) < 1.f);
  REQUIRE(clip_coefficient(0.0, 1.0) == 1.f);
  REQUIRE_THROWS_WITH(clip_coefficient(1.0, 0.0), ContainsSubstring("max_norm must be finite and > 0"));
  REQUIRE_THROWS_WITH(clip_coefficient(1.0, INFINITY), ContainsSubstring("max_norm must be finite and > 0"));
  REQUIRE_THROWS_WITH(clip_coefficient(-1.0, 1.0), ContainsSubstring("negative norm"));
}

TEST_CASE("clip_factor leaves global_grad_norm and clip_coefficient in tensors, NaN for a non-finite norm",
          "[optim][grad_clip]") {
  const auto values = grad_values();
  std::vector<Tensor> grads;
  for (const auto& v : values) grads.push_back(Tensor::from_vector(v, {int64_t(v.size())}));
  const auto norm_of = [](const ClipBuffers& b) { return *static_cast<const double*>(b.norm.data_ptr()); };
  ClipBuffers b;
  for (double max_norm : {0.5, 1e9}) {
    const Tensor& factor = clip_factor(std::array{NormGroup{grads, nullptr}}, max_norm, Device::cpu(), {}, b);
    const double want = global_grad_norm(grads);
    REQUIRE(norm_of(b) == want);
    REQUIRE(factor.to_vector<float>()[0] == clip_coefficient(want, max_norm));
  }
  REQUIRE(b.factor.to_vector<float>()[0] == 1.f);  // max_norm 1e9: no clipping

  // Two groups over their own ranks: √(n0² + n1²) of the per-group norms, as
  // Sharded adds them (the ranks record, the test checks: Catch2's assertions
  // are not thread-safe).
  std::vector<std::pair<double, double>> norms(2), factors(2);  // (got, want)
  comm::run_local_ranks(2, [&](comm::Comm& c) {
    std::vector<Tensor> dense{grads[std::size_t(c.rank())]}, expert{grads[2 + std::size_t(c.rank())]};
    ClipBuffers mine;
    const Tensor& factor =
        clip_factor(std::array{NormGroup{dense, &c}, NormGroup{expert, &c}}, 0.25, Device::cpu(), {}, mine);
    const double d = global_grad_norm(dense, &c), e = global_grad_norm(expert, &c);
    const double want = std::sqrt(d * d + e * e);
    norms[std::size_t(c.rank())] = {norm_of(mine), want};
    factors[std::size_t(c.rank())] = {factor.to_vector<float>()[0], clip_coefficient(want, 0.25)};
  });
  for (int r = 0; r < 2; ++r) {
    CHECK(norms[std::size_t(r)].first == norms[std::size_t(r)].second);
    CHECK(factors[std::size_t(r)].first == factors[std::size_t(r)].second);
  }

  grads[1].data<float>()[0] = std::numeric_limits<float>::infinity();
  const Tensor& factor = clip_factor(std::array{NormGroup{grads, nullptr}}, 1.0, Device::cpu(), {}, b);
  REQUIRE(std::isinf(norm_of(b)));
  REQUIRE(std::isnan(factor.to_vector<float>()[0]));

  REQUIRE_THROWS_WITH(clip_factor(std::array{NormGroup{grads, nullptr}}, 0.0, Device::cpu(), {}, b),
                      ContainsSubstring("max_norm must be finite and > 0"));
  REQUIRE_THROWS_WITH(clip_factor(std::span<const NormGroup>{}, 1.0, Device::cpu(), {}, b),
                      ContainsSubstring("1 or 2 gradient groups"));
  const std::vector<Tensor> bf16{Tensor::zeros({3}, DType::bf16)};
  REQUIRE_THROWS_WITH(clip_factor(std::array{NormGroup{bf16, nullptr}}, 1.0, Device::cpu(), {}, b),
                      ContainsSubstring("groups[0].grads[0] must be f32"));
}

TEST_CASE("PendingNorm reads the published norm, and its pool reuses slots no PendingNorm holds",
          "[optim][grad_clip]") {
  PendingNormPool pool;
  Tensor norm = Tensor::empty({1}, DType::i64);
  auto set = [&](double v) { *static_cast<double*>(norm.data_ptr()) = v; };
  set(2.5);
  PendingNorm a = pool.publish(norm, {});
  set(7.0);
  PendingNorm b = pool.publish(norm, {});  // a is alive: a second slot
  REQUIRE(a.get() == 2.5);
  REQUIRE(b.get() == 7.0);
  a = PendingNorm();
  set(1.0);
  const PendingNorm c = pool.publish(norm, {});  // reuses a's slot
  REQUIRE(c.get() == 1.0);
  REQUIRE(b.get() == 7.0);
  REQUIRE_FALSE(a.has_value());
  REQUIRE_THROWS_WITH(a.get(), ContainsSubstring("did not clip"));
}
