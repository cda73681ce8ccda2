// SparseMoeBlock on the CPU without expert parallelism: forward and backward
// against a naive per-token loop in double (tests/moe/moe_test_util.hpp),
// whose backward is itself checked by central finite differences in double;
// the auxiliary-loss gradient input; accumulation; T = 0; skewed routing;
// bf16 against f32; parameter names; steady-state allocations; bad input.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cstring>
#include <functional>
#include <tuple>
#include <utility>

#include "moe_test_util.hpp"
#include "slime/core/memory.hpp"
#include "slime/nn/moe.hpp"

using namespace slime;
using namespace moe_test;
using Catch::Matchers::ContainsSubstring;

namespace {

struct Config {
  int64_t T, H, I, E, k;
  bool norm;
};

nn::SparseMoeBlock make_block(const Config& c, const Weights& w, DType dt = DType::f32) {
  nn::MoeBlockConfig cfg{c.H, c.I, c.E, c.k, c.norm};
  nn::SparseMoeBlock b("model.layers.3.mlp", cfg, {Device::cpu(), dt});
  load(b, w);
  return b;
}

// Central differences of f at v, element by element (v is restored).
Vec finite_diff(Vec& v, const std::function<double()>& f, double eps) {
  Vec g(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    const double keep = v[i];
    v[i] = keep + eps;
    const double fp = f();
    v[i] = keep - eps;
    const double fm = f();
    v[i] = keep;
    g[i] = (fp - fm) / (2 * eps);
  }
  return g;
}

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

const Config kConfigs[] = {
    {13, 8, 6, 8, 2, true},   {9, 5, 7, 8, 1, false}, {7, 6, 4, 8, 8, true},
    {11, 4, 3, 16, 8, false}, {6, 7, 5, 16, 2, true}, {1, 3, 2, 8, 1, true},
};

}  // namespace

TEST_CASE("naive double MoE backward matches finite differences", "[moe][fd]") {
  // The reference of every other test: its gradients (x, gate, the three
  // expert weights, and an auxiliary gradient on the logits) against central
  // differences of its forward, all in double. eps 1e-5 with O(1) values:
  // truncation O(eps²) ≈ 1e-10, rounding O(1e-16 / eps) ≈ 1e-11.
  for (const Config& c : {kConfigs[0], kConfigs[1], kConfigs[3]}) {
    Weights w = Weights::random(c.H, c.I, c.E, 40 + uint64_t(c.E + c.k), 2.0);
    Vec x = random_doubles(c.T * c.H, 41 + uint64_t(c.T));
    const Vec R = random_doubles(c.T * c.H, 42);
    const Vec A = random_doubles(c.T * c.E, 43, 0.3);
    const NaiveOut base = naive_forward(w, x, c.T, c.k, c.norm);
    auto loss = [&] {
      const NaiveOut o = naive_forward(w, x, c.T, c.k, c.norm);
      REQUIRE(o.indices == base.indices);  // the step keeps the top-k
      return dot(R, o.y) + dot(A, o.logits);
    };
    const NaiveGrads d = naive_backward(w, x, c.T, c.k, c.norm, R, A);
    INFO("T " << c.T << " E " << c.E << " k " << c.k << " norm " << c.norm);
    CHECK(rel_error(d.x, finite_diff(x, loss, 1e-5)) < 1e-7);
    CHECK(rel_error(d.gate, finite_diff(w.gate, loss, 1e-5)) < 1e-7);
    CHECK(rel_error(d.wg, finite_diff(w.wg, loss, 1e-5)) < 1e-7);
    CHECK(rel_error(d.wu, finite_diff(w.wu, loss, 1e-5)) < 1e-7);
    CHECK(rel_error(d.wd, finite_diff(w.wd, loss, 1e-5)) < 1e-7);
  }
}

TEST_CASE("SparseMoeBlock f32 forward and backward match the naive double block", "[moe][block]") {
  // f32 against double: every output is a short fp32 sum (H, I <= 8 terms)
  // rounded once or twice, so the relative error is a few 1e-7; 1e-5 leaves
  // margin and still catches any wrong term.
  for (const Config& c : kConfigs)
    for (bool with_aux : {false, true}) {
      const Weights w = Weights::random(c.H, c.I, c.E, 7 + uint64_t(c.E * 3 + c.k), 2.0);
      const Vec x = f32_rounded(random_doubles(c.T * c.H, 8 + uint64_t(c.T)));
      const Vec dy = f32_rounded(random_doubles(c.T * c.H, 9));
      const Vec aux = with_aux ? f32_rounded(random_doubles(c.T * c.E, 10, 0.2)) : Vec{};
      nn::SparseMoeBlock b = make_block(c, w);
      nn::zero_grad(b);
      nn::SparseMoeBlock::Context ctx;
      const Tensor y = b.forward(tensor_of(x, {c.T, c.H}), ctx);
      const Tensor dx =
          b.backward(ctx, tensor_of(dy, {c.T, c.H}), {}, with_aux ? tensor_of(aux, {c.T, c.E}) : Tensor());
      const NaiveOut o = naive_forward(w, x, c.T, c.k, c.norm);
      const NaiveGrads d = naive_backward(w, x, c.T, c.k, c.norm, dy, aux);
      INFO("T " << c.T << " H " << c.H << " I " << c.I << " E " << c.E << " k " << c.k << " norm " << c.norm << " aux "
                << with_aux);
      CHECK(ctx.indices.to_vector<int32_t>() == std::vector<int32_t>(o.indices.begin(), o.indices.end()));
      CHECK(ctx.router_logits.dtype() == DType::f32);
      CHECK(ctx.router_logits.shape() == Shape({c.T, c.E}));
      CHECK(rel_error(to_double(ctx.router_logits), o.logits) < 1e-5);
      CHECK(rel_error(to_double(ctx.probs), o.probs) < 1e-5);
      CHECK(rel_error(to_double(ctx.weights), o.weights) < 1e-5);
      CHECK(rel_error(to_double(y), o.y) < 1e-5);
      CHECK(rel_error(to_double(dx), d.x) < 1e-5);
      CHECK(rel_error(to_double(b.gate.grad), d.gate) < 1e-5);
      CHECK(rel_error(to_double(b.gate_proj.grad), d.wg) < 1e-5);
      CHECK(rel_error(to_double(b.up_proj.grad), d.wu) < 1e-5);
      CHECK(rel_error(to_double(b.down_proj.grad), d.wd) < 1e-5);
    }
}

TEST_CASE("SparseMoeBlock routing replay: its own top-k gives the same bits, other experts the naive block's",
          "[moe][block][replay]") {
  auto bytes_equal = [](const Tensor& a, const Tensor& b) {
    return a.nbytes() == b.nbytes() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
  };
  for (const Config& c : kConfigs) {
    const Weights w = Weights::random(c.H, c.I, c.E, 90 + uint64_t(c.E * 3 + c.k), 2.0);
    const Vec x = f32_rounded(random_doubles(c.T * c.H, 91 + uint64_t(c.T)));
    const Vec dy = f32_rounded(random_doubles(c.T * c.H, 92));
    INFO("T " << c.T << " H " << c.H << " I " << c.I << " E " << c.E << " k " << c.k << " norm " << c.norm);
    nn::SparseMoeBlock b = make_block(c, w);
    struct Run {
      Tensor y, dx, gate, wg, wu, wd, indices, weights;
    };
    auto run = [&](const Tensor& replay) {
      nn::zero_grad(b);
      nn::SparseMoeBlock::Context ctx;
      ctx.replay_indices = replay;
      Run r;
      r.y = b.forward(tensor_of(x, {c.T, c.H}), ctx);
      r.dx = b.backward(ctx, tensor_of(dy, {c.T, c.H}));
      r.gate = b.gate.grad.clone();
      r.wg = b.gate_proj.grad.clone();
      r.wu = b.up_proj.grad.clone();
      r.wd = b.down_proj.grad.clone();
      r.indices = ctx.indices.clone();
      r.weights = ctx.weights.clone();
      return r;
    };
    // Replaying the block's own routing changes nothing, bit for bit.
    const Run top = run(Tensor());
    const Run same = run(top.indices.clone());
    const std::pair<const char*, Tensor Run::*> fields[] = {{"y", &Run::y},
                                                            {"weights", &Run::weights},
                                                            {"dx", &Run::dx},
                                                            {"gate grad", &Run::gate},
                                                            {"gate_proj grad", &Run::wg},
                                                            {"up_proj grad", &Run::wu},
                                                            {"down_proj grad", &Run::wd}};
    for (const auto& [name, field] : fields) {
      INFO(name);
      CHECK(bytes_equal(same.*field, top.*field));
    }
    // Other experts (each row's top-k shifted by 1 + t mod (E - 1): still
    // distinct, never the same set when E > k) against the naive block routed
    // to them.
    if (c.E == 1) continue;
    std::vector<int> other(std::size_t(c.T * c.k));
    const std::vector<int32_t> own = top.indices.to_vector<int32_t>();
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t j = 0; j < c.k; ++j)
        other[std::size_t(t * c.k + j)] = int((own[std::size_t(t * c.k + j)] + 1 + t % (c.E - 1)) % c.E);
    const Run r = run(Tensor::from_vector(std::vector<int32_t>(other.begin(), other.end()), {c.T, c.k}));
    const NaiveOut o = naive_forward(w, x, c.T, c.k, c.norm, &other);
    const NaiveGrads d = naive_backward(w, x, c.T, c.k, c.norm, dy, {}, &other);
    CHECK(r.indices.to_vector<int32_t>() == std::vector<int32_t>(other.begin(), other.end()));
    CHECK(rel_error(to_double(r.weights), o.weights) < 1e-5);
    CHECK(rel_error(to_double(r.y), o.y) < 1e-5);
    CHECK(rel_error(to_double(r.dx), d.x) < 1e-5);
    CHECK(rel_error(to_double(r.gate), d.gate) < 1e-5);
    CHECK(rel_error(to_double(r.wg), d.wg) < 1e-5);
    CHECK(rel_error(to_double(r.wu), d.wu) < 1e-5);
    CHECK(rel_error(to_double(r.wd), d.wd) < 1e-5);
    if (c.k < c.E) CHECK(rel_error(to_double(r.y), to_double(top.y)) > 1e-3);  // the replay was used
  }
  // A replay of the wrong shape or dtype is an error naming the field.
  const Config c = kConfigs[0];
  nn::SparseMoeBlock b = make_block(c, Weights::random(c.H, c.I, c.E, 95, 2.0));
  nn::SparseMoeBlock::Context ctx;
  const Tensor x = tensor_of(f32_rounded(random_doubles(c.T * c.H, 96)), {c.T, c.H});
  ctx.replay_indices = Tensor::zeros({c.T, c.k + 1}, DType::i32);
  CHECK_THROWS_WITH(b.forward(x, ctx), ContainsSubstring("replay_indices must be i32"));
  ctx.replay_indices = Tensor::zeros({c.T, c.k}, DType::f32);
  CHECK_THROWS_WITH(b.forward(x, ctx), ContainsSubstring("replay_indices must be i32"));
}

TEST_CASE("SparseMoeBlock: parameter gradients accumulate, dx is written, contexts are reusable", "[moe][block]") {
  const Config c = kConfigs[0];
  const Weights w = Weights::random(c.H, c.I, c.E, 70, 2.0);
  nn::SparseMoeBlock b = make_block(c, w);
  const Tensor x = tensor_of(random_doubles(c.T * c.H, 71), {c.T, c.H});
  const Tensor dy = tensor_of(random_doubles(c.T * c.H, 72), {c.T, c.H});
  nn::SparseMoeBlock::Context ctx;
  nn::zero_grad(b);
  const Vec y1 = to_double(b.forward(x, ctx));
  const Vec dx1 = to_double(b.backward(ctx, dy));
  std::vector<Vec> once;
  b.for_each_parameter([&](nn::Parameter& p) { once.push_back(to_double(p.grad)); });
  // The same context again (its buffers reused): the same y and dx, twice the
  // parameter gradients.
  const Vec y2 = to_double(b.forward(x, ctx));
  const Vec dx2 = to_double(b.backward(ctx, dy));
  CHECK(y1 == y2);
  CHECK(dx1 == dx2);
  std::size_t i = 0;
  b.for_each_parameter([&](nn::Parameter& p) {
    Vec twice = once[i++];
    for (double& v : twice) v *= 2;
    CHECK(rel_error(to_double(p.grad), twice) < 1e-6);
  });
}

TEST_CASE("SparseMoeBlock: a steady-state forward and backward allocate nothing", "[moe][block][memory]") {
  const Config c = kConfigs[4];
  nn::SparseMoeBlock b = make_block(c, Weights::random(c.H, c.I, c.E, 80, 2.0));
  const Tensor x = tensor_of(random_doubles(c.T * c.H, 81), {c.T, c.H});
  const Tensor x_small = x.slice_rows(0, c.T - 2);
  const Tensor dy = tensor_of(random_doubles(c.T * c.H, 82), {c.T, c.H});
  const Tensor dy_small = dy.slice_rows(0, c.T - 2);
  nn::zero_grad(b);
  nn::SparseMoeBlock::Context ctx;
  (void)b.forward(x, ctx);  // warm-up: sizes the context's buffers (the output's too)
  (void)b.backward(ctx, dy);
  // The same results as a fresh context's, bit for bit.
  nn::SparseMoeBlock::Context fresh;
  const std::vector<double> want_y = to_double(b.forward(x_small, fresh)),
                            want_dx = to_double(b.backward(fresh, dy_small));
  const int64_t before = memory_stats(Device::cpu()).allocations;
  (void)b.forward(x, ctx);
  (void)b.backward(ctx, dy);
  const Tensor y = b.forward(x_small, ctx);  // fewer tokens fit the same buffers
  const Tensor dx = b.backward(ctx, dy_small);
  CHECK(memory_stats(Device::cpu()).allocations - before == 0);
  CHECK(to_double(y) == want_y);
  CHECK(to_double(dx) == want_dx);
}

TEST_CASE("SparseMoeBlock: zero tokens, skewed routing, experts without tokens", "[moe][block]") {
  SECTION("T = 0") {
    const Config c{0, 6, 4, 8, 2, true};
    nn::SparseMoeBlock b = make_block(c, Weights::random(c.H, c.I, c.E, 90));
    nn::zero_grad(b);
    nn::SparseMoeBlock::Context ctx;
    const Tensor y = b.forward(Tensor::empty({0, c.H}, DType::f32), ctx);
    CHECK(y.shape() == Shape({0, c.H}));
    const Tensor dx = b.backward(ctx, Tensor::empty({0, c.H}, DType::f32));
    CHECK(dx.shape() == Shape({0, c.H}));
    b.for_each_parameter([&](nn::Parameter& p) { CHECK(max_abs(to_double(p.grad)) == 0.0); });
  }
  SECTION("every token to one expert") {
    // Feature 0 of x is 1 and the gate's column 0 is 20 for expert 5 only, so
    // expert 5 wins every token; with k = 1 the other experts get nothing.
    for (int64_t k : {1, 2}) {
      const Config c{10, 6, 4, 8, k, true};
      Weights w = Weights::random(c.H, c.I, c.E, 91, 0.1);
      for (int64_t e = 0; e < c.E; ++e) w.gate[std::size_t(e * c.H)] = e == 5 ? 20.0 : 0.0;
      Vec x = f32_rounded(random_doubles(c.T * c.H, 92));
      for (int64_t t = 0; t < c.T; ++t) x[std::size_t(t * c.H)] = 1.0;
      const Vec dy = random_doubles(c.T * c.H, 93);
      nn::SparseMoeBlock b = make_block(c, w);
      nn::zero_grad(b);
      nn::SparseMoeBlock::Context ctx;
      const Tensor y = b.forward(tensor_of(x, {c.T, c.H}), ctx);
      const Tensor dx = b.backward(ctx, tensor_of(dy, {c.T, c.H}));
      const auto idx = ctx.indices.to_vector<int32_t>();
      for (int64_t t = 0; t < c.T; ++t) CHECK(idx[std::size_t(t * k)] == 5);
      const NaiveOut o = naive_forward(w, x, c.T, c.k, c.norm);
      const NaiveGrads d = naive_backward(w, x, c.T, c.k, c.norm, dy, {});
      CHECK(rel_error(to_double(y), o.y) < 1e-5);
      CHECK(rel_error(to_double(dx), d.x) < 1e-5);
      CHECK(rel_error(to_double(b.gate.grad), d.gate) < 1e-5);
      CHECK(rel_error(to_double(b.down_proj.grad), d.wd) < 1e-5);
      if (k == 1) {  // experts without tokens: zero gradients
        const Vec g = to_double(b.gate_proj.grad);
        for (int64_t e = 0; e < c.E; ++e)
          if (e != 5)
            for (int64_t i = 0; i < c.I * c.H; ++i) CHECK(g[std::size_t(e * c.I * c.H + i)] == 0.0);
      }
    }
  }
}

TEST_CASE("SparseMoeBlock bf16 is close to f32", "[moe][block][bf16]") {
  // Same weights (bf16-representable) and inputs. bf16 rounds the logits,
  // router weights and every intermediate (8-bit mantissa, 2^-9 relative per
  // rounding; a handful of roundings in a row): 2e-2 relative, and the router
  // inputs are scaled so no top-k choice sits within a bf16 step of a tie.
  const Config c{12, 16, 8, 8, 2, true};
  Weights w = Weights::random(c.H, c.I, c.E, 100, 1.0);
  for (Vec* v : {&w.gate, &w.wg, &w.wu, &w.wd})
    for (double& e : *v) e = double(float(BFloat16(float(e))));
  Vec x = random_doubles(c.T * c.H, 101);
  for (double& e : x) e = double(float(BFloat16(float(e))));
  const Vec dy = random_doubles(c.T * c.H, 102);
  nn::SparseMoeBlock b32 = make_block(c, w), b16 = make_block(c, w, DType::bf16);
  nn::zero_grad(b32);
  nn::zero_grad(b16);
  nn::SparseMoeBlock::Context c32, c16;
  const Vec y32 = to_double(b32.forward(tensor_of(x, {c.T, c.H}), c32));
  const Vec y16 = to_double(b16.forward(tensor_of(x, {c.T, c.H}, DType::bf16), c16));
  CHECK(c16.router_logits.dtype() == DType::bf16);
  CHECK(c16.probs.dtype() == DType::f32);
  REQUIRE(c16.indices.to_vector<int32_t>() == c32.indices.to_vector<int32_t>());
  CHECK(rel_error(y16, y32) < 2e-2);
  const Vec dx32 = to_double(b32.backward(c32, tensor_of(dy, {c.T, c.H})));
  const Vec dx16 = to_double(b16.backward(c16, tensor_of(dy, {c.T, c.H}, DType::bf16)));
  CHECK(rel_error(dx16, dx32) < 2e-2);
  CHECK(b16.gate.grad.dtype() == DType::f32);
  CHECK(rel_error(to_double(b16.gate.grad), to_double(b32.gate.grad)) < 2e-2);
  CHECK(rel_error(to_double(b16.gate_proj.grad), to_double(b32.gate_proj.grad)) < 2e-2);
  CHECK(rel_error(to_double(b16.down_proj.grad), to_double(b32.down_proj.grad)) < 2e-2);
}

TEST_CASE("SparseMoeBlock parameters carry Hugging Face names and shapes", "[moe][block]") {
  nn::SparseMoeBlock b("model.layers.0.mlp", {16, 12, 8, 2, true}, {});
  std::vector<std::string> names;
  std::vector<Shape> shapes;
  b.for_each_parameter([&](nn::Parameter& p) {
    names.push_back(p.name);
    shapes.push_back(p.value.shape());
  });
  CHECK(names == std::vector<std::string>{
                     "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.{}.gate_proj.weight",
                     "model.layers.0.mlp.experts.{}.up_proj.weight", "model.layers.0.mlp.experts.{}.down_proj.weight"});
  CHECK(shapes == std::vector<Shape>{Shape{8, 16}, Shape{8, 12, 16}, Shape{8, 12, 16}, Shape{8, 16, 12}});
  CHECK(b.gate_proj.is_expert_stack());
  CHECK(!b.gate.is_expert_stack());
  CHECK(b.down_proj.expert_name(7) == "model.layers.0.mlp.experts.7.down_proj.weight");
  CHECK(nn::num_parameters(b) == 8 * 16 + 3 * 8 * 12 * 16);
}

TEST_CASE("SparseMoeBlock rejects bad configurations and inputs", "[moe][block][errors]") {
  const nn::ModuleOptions opt{};
  CHECK_THROWS_WITH(nn::SparseMoeBlock("m", {16, 12, 8, 9, true}, opt),
                    ContainsSubstring("num_experts_per_tok = 9 must be in [1, num_experts = 8]"));
  CHECK_THROWS_WITH(nn::SparseMoeBlock("m", {16, 12, 0, 1, true}, opt), ContainsSubstring("must be positive"));
  CHECK_THROWS_WITH(nn::SparseMoeBlock("m", {16, 12, 8, 2, true}, {Device::cpu(), DType::i32}),
                    ContainsSubstring("dtype must be f32 or bf16"));
  const Config c = kConfigs[0];
  nn::SparseMoeBlock b = make_block(c, Weights::random(c.H, c.I, c.E, 110));
  nn::SparseMoeBlock::Context ctx;
  CHECK_THROWS_WITH(b.backward(ctx, Tensor::zeros({4, c.H}, DType::f32)), ContainsSubstring("holds no forward"));
  CHECK_THROWS_WITH(b.forward(Tensor::zeros({4, c.H + 1}, DType::f32), ctx), ContainsSubstring("last extent 8"));
  CHECK_THROWS_WITH(b.forward(Tensor::zeros({4, c.H}, DType::bf16), ctx), ContainsSubstring("must be f32"));
  CHECK_THROWS_WITH(b.forward(Tensor::zeros({2, 4, c.H}, DType::f32), ctx), ContainsSubstring("must be 2-D"));
  (void)b.forward(Tensor::zeros({4, c.H}, DType::f32), ctx);
  CHECK_THROWS_WITH(b.backward(ctx, Tensor::zeros({5, c.H}, DType::f32)), ContainsSubstring("input's shape"));
  CHECK_THROWS_WITH(b.backward(ctx, Tensor::zeros({4, c.H}, DType::f32), {}, Tensor::zeros({4, c.E + 1}, DType::f32)),
                    ContainsSubstring("aux_dlogits must be f32 [4, 8]"));
  CHECK_THROWS_WITH(b.backward(ctx, Tensor::zeros({4, c.H}, DType::f32), {}, Tensor::zeros({4, c.E}, DType::bf16)),
                    ContainsSubstring("aux_dlogits must be f32"));
}
