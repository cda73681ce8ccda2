// Finite-difference checks of every nn module's backward (the input and every
// parameter) on the CPU in f32, and the accumulation contract (parameter
// gradients +=, activation gradients =).
//
// Tolerances: modules run in f32 only (Tensor has no f64), so the checks use
// central differences with step h = 1e-2 on small sizes and a relative error
// ‖analytic − fd‖/‖fd‖ ≤ 1e-2 per tensor (measured errors are printed; they
// are 1e-6 .. 1e-3: f32 rounding of the loss over 2h, and the O(h²)
// truncation of the nonlinear modules). Each op's backward is already checked
// in double precision against finite differences to well under 1e-6 in
// tests/ops; these checks are about the wiring of the modules.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cstdio>
#include <functional>
#include <string>

#include "nn_test_util.hpp"
#include "slime/nn/attention.hpp"
#include "slime/nn/decoder_layer.hpp"
#include "slime/nn/embedding.hpp"
#include "slime/nn/linear.hpp"
#include "slime/nn/mlp.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/nn/rms_norm.hpp"

using namespace slime;
using namespace nn_test;
using Catch::Matchers::ContainsSubstring;

namespace {

constexpr double kStep = 1e-2;
constexpr double kTolerance = 1e-2;

// Random weights: projections N(0, std), norm weights U(0.5, 1.5) so that the
// weight product is exercised (ones would hide a missing factor).
template <class M>
void randomize(M& module, uint64_t seed, float std = 0.3f) {
  uint64_t offset = 0;
  module.for_each_parameter([&](nn::Parameter& p) {
    if (p.init == nn::ParamInit::ones) {
      fill_uniform(p.value, seed, offset, 0.5f, 1.5f);
    } else {
      fill_normal(p.value, seed, offset, 0.f, std);
    }
    offset += uint64_t(p.value.numel());
  });
}

// Checks the gradient of every parameter of `module` (at most `samples`
// elements each) against central differences of `loss`.
template <class M>
void check_parameters(M& module, const std::function<double()>& loss, int64_t samples, const char* what) {
  int n = 0;
  module.for_each_parameter([&](nn::Parameter& p) {
    REQUIRE(p.grad.defined());
    const double err = fd_rel_error(p.value, p.grad, loss, kStep, sample_indices(p.value.numel(), samples, 7 + n++));
    std::printf("  %-10s %-48s fd rel error %.2e\n", what, p.name.c_str(), err);
    INFO(what << ": parameter " << p.name);
    CHECK(err <= kTolerance);
  });
}

void report(const char* what, const char* tensor, double err) {
  std::printf("  %-10s %-48s fd rel error %.2e\n", what, tensor, err);
}

nn::AttentionConfig small_attention() {
  nn::AttentionConfig c;
  c.hidden_size = 16;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.rope = ops::RopeSpec::text(100.0);  // fast rotations: positions matter at these lengths
  c.rms_norm_eps = 1e-6;
  return c;
}

// Two sequences (3 and 5 tokens): positions restart, no cross attention.
nn::PackedBatch small_batch() { return nn::make_packed_batch({{1, 2, 3}, {4, 5, 6, 7, 8}}); }

nn::Qwen3Config small_config(bool tied) {
  nn::Qwen3Config c;
  c.vocab_size = 32;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 100.0;
  c.tie_word_embeddings = tied;
  return c;
}

}  // namespace

TEST_CASE("Linear backward matches finite differences and accumulates", "[nn][fd]") {
  nn::Linear lin("lin", 7, 6, {});
  randomize(lin, 1);
  Tensor x = random_tensor({5, 7}, 2);
  const Tensor w = random_tensor({5, 6}, 3);
  auto loss = [&] {
    nn::Linear::Context c;
    return dot(lin.forward(x, c), w);
  };
  nn::zero_grad(lin);
  nn::Linear::Context ctx;
  CHECK(lin.forward(x, ctx).shape() == Shape{5, 6});
  const Tensor dx = lin.backward(ctx, w);
  const double ex = fd_rel_error(x, dx, loss, kStep);
  report("Linear", "x", ex);
  CHECK(ex <= kTolerance);
  check_parameters(lin, loss, 64, "Linear");

  // Parameter gradients accumulate; dx is written.
  const auto g1 = to_double(lin.weight.grad);
  const Tensor dx2 = lin.backward(ctx, w);
  const auto g2 = to_double(lin.weight.grad);
  for (std::size_t i = 0; i < g1.size(); ++i) REQUIRE(g2[i] == 2 * g1[i]);
  CHECK(rel_error(dx2, dx) == 0);
  nn::zero_grad(lin);
  for (double v : to_double(lin.weight.grad)) REQUIRE(v == 0);

  // backward_into with accumulate adds to what dx holds.
  Tensor acc = dx.clone();
  lin.backward_into(ctx, w, acc, /*accumulate=*/true);
  const auto a = to_double(acc), d = to_double(dx);
  for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(std::abs(a[i] - 2 * d[i]) <= 1e-6 * (1 + std::abs(d[i])));
}

TEST_CASE("RMSNorm backward matches finite differences on [tokens, heads, dim]", "[nn][fd]") {
  nn::RMSNorm norm("norm", 8, 1e-6, {});
  randomize(norm, 4);
  Tensor x = random_tensor({4, 3, 8}, 5);
  const Tensor w = random_tensor({4, 3, 8}, 6);
  auto loss = [&] {
    nn::RMSNorm::Context c;
    return dot(norm.forward(x, c), w);
  };
  nn::zero_grad(norm);
  nn::RMSNorm::Context ctx;
  const Tensor dx = norm.backward((norm.forward(x, ctx), ctx), w);
  CHECK(ctx.rstd.numel() == 12);
  const double ex = fd_rel_error(x, dx, loss, kStep);
  report("RMSNorm", "x", ex);
  CHECK(ex <= kTolerance);
  check_parameters(norm, loss, 64, "RMSNorm");
  CHECK(norm.weight.init == nn::ParamInit::ones);
}

TEST_CASE("Embedding backward matches finite differences with repeated ids", "[nn][fd]") {
  nn::Embedding emb("emb", 5, 4, {});
  randomize(emb, 7);
  const Tensor ids = Tensor::from_vector(std::vector<int32_t>{3, 1, 3, 0, 4, 3}, {6});
  const Tensor w = random_tensor({6, 4}, 8);
  auto loss = [&] {
    nn::Embedding::Context c;
    return dot(emb.forward(ids, c), w);
  };
  nn::zero_grad(emb);
  nn::Embedding::Context ctx;
  emb.forward(ids, ctx);
  emb.backward(ctx, w);
  check_parameters(emb, loss, 64, "Embedding");
  // Row 2 is never looked up: its gradient stays zero.
  const auto g = to_double(emb.weight.grad);
  for (int d = 0; d < 4; ++d) CHECK(g[std::size_t(2 * 4 + d)] == 0);

  const Tensor bad = Tensor::from_vector(std::vector<int32_t>{0, 5}, {2});
  nn::Embedding::Context c;
  CHECK_THROWS_WITH(emb.forward(bad, c), ContainsSubstring("outside [0, 5)"));
}

TEST_CASE("MLP backward matches finite differences", "[nn][fd]") {
  nn::MLP mlp("mlp", 8, 12, {});
  randomize(mlp, 9);
  Tensor x = random_tensor({5, 8}, 10);
  const Tensor w = random_tensor({5, 8}, 11);
  auto loss = [&] {
    nn::MLP::Context c;
    return dot(mlp.forward(x, c), w);
  };
  nn::zero_grad(mlp);
  nn::MLP::Context ctx;
  mlp.forward(x, ctx);
  const Tensor dx = mlp.backward(ctx, w);
  const double ex = fd_rel_error(x, dx, loss, kStep);
  report("MLP", "x", ex);
  CHECK(ex <= kTolerance);
  check_parameters(mlp, loss, 48, "MLP");
}

TEST_CASE("Attention backward matches finite differences over packed sequences with GQA", "[nn][fd]") {
  nn::Attention attn("attn", small_attention(), {});
  randomize(attn, 12);
  const nn::PackedBatch batch = small_batch();
  Tensor x = random_tensor({8, 16}, 13);
  const Tensor w = random_tensor({8, 16}, 14);
  auto loss = [&] {
    nn::Attention::Context c;
    return dot(attn.forward(x, batch, c), w);
  };
  nn::zero_grad(attn);
  nn::Attention::Context ctx;
  attn.forward(x, batch, ctx);
  const Tensor dx = attn.backward(ctx, w);
  const double ex = fd_rel_error(x, dx, loss, kStep);
  report("Attention", "x", ex);
  CHECK(ex <= kTolerance);
  check_parameters(attn, loss, 48, "Attention");
}

TEST_CASE("DecoderLayer backward matches finite differences", "[nn][fd]") {
  nn::DecoderLayer layer("model.layers.0", small_attention(), 24, {});
  randomize(layer, 15);
  const nn::PackedBatch batch = small_batch();
  Tensor x = random_tensor({8, 16}, 16);
  const Tensor w = random_tensor({8, 16}, 17);
  auto loss = [&] {
    nn::DecoderLayer::Context c;
    return dot(layer.forward(x, batch, c), w);
  };
  nn::zero_grad(layer);
  nn::DecoderLayer::Context ctx;
  layer.forward(x, batch, ctx);
  const Tensor dx = layer.backward(ctx, w);
  const double ex = fd_rel_error(x, dx, loss, kStep);
  report("Decoder", "x", ex);
  CHECK(ex <= kTolerance);
  check_parameters(layer, loss, 32, "Decoder");
}

TEST_CASE("Qwen3Model loss_and_backward matches finite differences, untied and tied", "[nn][fd]") {
  for (bool tied : {false, true}) {
    DYNAMIC_SECTION((tied ? "tied" : "untied")) {
      nn::Qwen3Model model(small_config(tied), {});
      randomize(model, 18);
      const nn::PackedBatch batch = nn::make_packed_batch({{3, 9, 27, 1}, {30, 2}, {5, 6, 7, 8, 9, 10, 11}});
      const Tensor targets =
          Tensor::from_vector(std::vector<int32_t>{9, 27, 1, 0, 2, 31, 6, 7, 8, 9, 10, 11, 4}, {batch.num_tokens()});
      const float temperature = 0.7f;
      auto loss = [&] {
        nn::Qwen3Model::Context c;
        const auto lp = model.token_logprobs(model.forward(batch, c), targets, temperature).logprobs;
        double s = 0;
        for (float v : lp.to_vector<float>()) s -= v;
        return s / double(batch.num_tokens());
      };
      nn::zero_grad(model);
      const nn::LossResult r = model.loss_and_backward(batch, targets, temperature);
      CHECK(std::abs(r.loss - loss()) <= 1e-6 * std::abs(r.loss));
      check_parameters(model, loss, 16, tied ? "Qwen3 tied" : "Qwen3");
    }
  }
}

TEST_CASE("Qwen3Model token_logprobs_backward with entropy gradients matches finite differences", "[nn][fd]") {
  nn::Qwen3Model model(small_config(true), {});
  randomize(model, 19);
  const nn::PackedBatch batch = nn::make_packed_batch({{1, 2, 3, 4, 5}, {6, 7, 8}});
  const Tensor targets = Tensor::from_vector(std::vector<int32_t>{2, 3, 4, 5, 0, 7, 8, 1}, {8});
  const Tensor a = random_tensor({8}, 20), b = random_tensor({8}, 21);
  auto loss = [&] {
    nn::Qwen3Model::Context c;
    const auto lp = model.token_logprobs(model.forward(batch, c), targets);
    return dot(lp.logprobs, a) + dot(lp.entropy, b);
  };
  nn::zero_grad(model);
  nn::Qwen3Model::Context ctx;
  const Tensor hidden = model.forward(batch, ctx);
  const auto lp = model.token_logprobs(hidden, targets);
  model.backward(ctx, model.token_logprobs_backward(hidden, targets, 1.f, lp, a, b));
  check_parameters(model, loss, 12, "Qwen3 ent");
}
