// token_logprobs on the CPU: the chunked online log-sum-exp against a naive
// full softmax, finite differences of the backward in double precision, the
// Tensor API against the templates, extreme logits, workspace sizing and
// bad-input errors.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "slime/core/random.hpp"
#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/token_logprobs.hpp"
#include "slime/ops/token_logprobs.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;

namespace {

std::vector<double> randn(int64_t n, uint64_t seed, double scale = 1.0) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = scale * double(random_normal(seed, uint64_t(i)));
  return v;
}

std::vector<int64_t> random_targets(int64_t tokens, int64_t vocab, uint64_t seed) {
  std::vector<int64_t> t(static_cast<std::size_t>(tokens));
  for (int64_t i = 0; i < tokens; ++i) t[i] = int64_t(philox_word(seed, uint64_t(i)) % uint64_t(vocab));
  return t;
}

template <class T>
std::vector<T> cast_vector(const std::vector<double>& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = T(float(v[i]));
  return out;
}

// The specification written the obvious way: the full logits row of a token,
// softmax, then the outputs and dz. Double precision throughout.
struct Naive {
  std::vector<double> logprobs, entropy, lse, grad_hidden, grad_weight;
};

template <class T>
Naive naive(const std::vector<T>& h, const std::vector<T>& w, const std::vector<int64_t>& targets, int64_t dim,
            int64_t vocab, double temperature, const std::vector<double>& g_lp, const std::vector<double>& g_ent) {
  const int64_t tokens = int64_t(targets.size());
  auto val = [](T x) {
    if constexpr (std::is_same_v<T, double>) {
      return x;
    } else {
      return double(float(x));
    }
  };
  Naive r;
  r.logprobs.resize(tokens);
  r.entropy.resize(tokens);
  r.lse.resize(tokens);
  r.grad_hidden.assign(static_cast<std::size_t>(tokens * dim), 0.0);
  r.grad_weight.assign(static_cast<std::size_t>(vocab * dim), 0.0);
  std::vector<double> z(static_cast<std::size_t>(vocab)), p(static_cast<std::size_t>(vocab));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t v = 0; v < vocab; ++v) {
      double s = 0;
      for (int64_t i = 0; i < dim; ++i) s += val(h[t * dim + i]) * val(w[v * dim + i]);
      z[v] = s / temperature;
    }
    const double m = *std::max_element(z.begin(), z.end());
    double sum = 0;
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(z[v] - m);
    const double lse = m + std::log(sum);
    double mu = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      p[v] = std::exp(z[v] - lse);
      mu += p[v] * z[v];
    }
    r.lse[t] = lse;
    r.logprobs[t] = z[targets[t]] - lse;
    r.entropy[t] = lse - mu;
    for (int64_t v = 0; v < vocab; ++v) {
      const double dz = g_lp[t] * ((v == targets[t] ? 1.0 : 0.0) - p[v]) + g_ent[t] * p[v] * (mu - z[v]);
      for (int64_t i = 0; i < dim; ++i) {
        r.grad_hidden[t * dim + i] += dz * val(w[v * dim + i]) / temperature;
        r.grad_weight[v * dim + i] += dz * val(h[t * dim + i]) / temperature;
      }
    }
  }
  return r;
}

template <class A, class B>
double max_abs_diff(const std::vector<A>& a, const std::vector<B>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - double(b[i])));
  return m;
}

template <class A, class B>
double rel_error(const std::vector<A>& a, const std::vector<B>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

}  // namespace

TEST_CASE("token_logprobs forward: chunked online lse equals a naive full softmax", "[ops][token_logprobs]") {
  const double temperature = 0.8;
  for (int64_t vocab : {int64_t(37), int64_t(1000)}) {
    for (int64_t tokens : {int64_t(1), int64_t(5), int64_t(17)}) {
      for (int64_t dim : {int64_t(13), int64_t(24)}) {
        const auto hd = randn(tokens * dim, 10 + uint64_t(tokens), 1.0);
        const auto wd = randn(vocab * dim, 20 + uint64_t(vocab), 0.5);
        const auto targets = random_targets(tokens, vocab, 30 + uint64_t(tokens + vocab));
        const std::vector<double> zeros(static_cast<std::size_t>(tokens), 0.0);
        const Naive ref = naive(hd, wd, targets, dim, vocab, temperature, zeros, zeros);
        const Naive ref_f =
            naive(cast_vector<float>(hd), cast_vector<float>(wd), targets, dim, vocab, temperature, zeros, zeros);
        for (int64_t chunk : {int64_t(1), int64_t(7), int64_t(64), int64_t(4096)}) {
          CAPTURE(vocab, tokens, dim, chunk);
          std::vector<double> lp(tokens), ent(tokens), lse(tokens);
          ops::cpu::token_logprobs_forward<double, int64_t>(hd.data(), wd.data(), targets.data(), tokens, dim, vocab,
                                                            temperature, lp.data(), ent.data(), lse.data(), chunk);
          CHECK(max_abs_diff(lp, ref.logprobs) < 1e-12);
          CHECK(max_abs_diff(ent, ref.entropy) < 1e-12);
          CHECK(max_abs_diff(lse, ref.lse) < 1e-12);

          // float: values are O(log V) <= 7; float sums over <= 1000 terms.
          const auto hf = cast_vector<float>(hd), wf = cast_vector<float>(wd);
          std::vector<float> lpf(tokens), entf(tokens), lsef(tokens);
          ops::cpu::token_logprobs_forward<float, int64_t>(hf.data(), wf.data(), targets.data(), tokens, dim, vocab,
                                                           float(temperature), lpf.data(), entf.data(), lsef.data(),
                                                           chunk);
          CHECK(max_abs_diff(lpf, ref_f.logprobs) < 2e-5);
          CHECK(max_abs_diff(entf, ref_f.entropy) < 2e-5);
          CHECK(max_abs_diff(lsef, ref_f.lse) < 2e-5);
        }
      }
    }
  }
}

TEST_CASE("token_logprobs backward equals the naive full-softmax gradient", "[ops][token_logprobs]") {
  const int64_t tokens = 17, dim = 9, vocab = 37;
  const double temperature = 1.3;
  const auto h = randn(tokens * dim, 1), w = randn(vocab * dim, 2, 0.7);
  const auto targets = random_targets(tokens, vocab, 3);
  const auto g_lp = randn(tokens, 4), g_ent = randn(tokens, 5);
  const Naive ref = naive(h, w, targets, dim, vocab, temperature, g_lp, g_ent);
  std::vector<double> lp(tokens), ent(tokens), lse(tokens);
  ops::cpu::token_logprobs_forward<double, int64_t>(h.data(), w.data(), targets.data(), tokens, dim, vocab, temperature,
                                                    lp.data(), ent.data(), lse.data(), 5);
  std::vector<double> dh(static_cast<std::size_t>(tokens * dim), 123.0), dw(static_cast<std::size_t>(vocab * dim), 0.0);
  ops::cpu::token_logprobs_backward<double, int64_t>(h.data(), w.data(), targets.data(), tokens, dim, vocab,
                                                     temperature, lse.data(), ent.data(), g_lp.data(), g_ent.data(),
                                                     dh.data(), dw.data());
  CHECK(rel_error(dh, ref.grad_hidden) < 1e-12);
  CHECK(rel_error(dw, ref.grad_weight) < 1e-12);

  // nullptr upstream gradients are zeros; nullptr outputs are skipped.
  std::vector<double> dh_lp(static_cast<std::size_t>(tokens * dim)),
      dw_none(static_cast<std::size_t>(vocab * dim), 7.0);
  ops::cpu::token_logprobs_backward<double, int64_t>(h.data(), w.data(), targets.data(), tokens, dim, vocab,
                                                     temperature, lse.data(), ent.data(), g_lp.data(), nullptr,
                                                     dh_lp.data(), nullptr);
  const std::vector<double> zeros(static_cast<std::size_t>(tokens), 0.0);
  const Naive ref_lp = naive(h, w, targets, dim, vocab, temperature, g_lp, zeros);
  CHECK(rel_error(dh_lp, ref_lp.grad_hidden) < 1e-12);
  CHECK(std::all_of(dw_none.begin(), dw_none.end(), [](double x) { return x == 7.0; }));
}

TEST_CASE("token_logprobs backward matches finite differences in double", "[ops][token_logprobs]") {
  const int64_t tokens = 5, dim = 6, vocab = 11;
  const double temperature = 0.7;
  auto h = randn(tokens * dim, 41), w = randn(vocab * dim, 42, 0.8);
  const auto targets = random_targets(tokens, vocab, 43);
  const auto g_lp = randn(tokens, 44), g_ent = randn(tokens, 45);
  const int64_t chunk = 4;  // three vocabulary chunks: the online merge is differentiated too

  auto loss = [&] {
    std::vector<double> lp(tokens), ent(tokens), lse(tokens);
    ops::cpu::token_logprobs_forward<double, int64_t>(h.data(), w.data(), targets.data(), tokens, dim, vocab,
                                                      temperature, lp.data(), ent.data(), lse.data(), chunk);
    double l = 0;
    for (int64_t t = 0; t < tokens; ++t) l += g_lp[t] * lp[t] + g_ent[t] * ent[t];
    return l;
  };

  std::vector<double> lp(tokens), ent(tokens), lse(tokens);
  ops::cpu::token_logprobs_forward<double, int64_t>(h.data(), w.data(), targets.data(), tokens, dim, vocab, temperature,
                                                    lp.data(), ent.data(), lse.data(), chunk);
  std::vector<double> dh(static_cast<std::size_t>(tokens * dim), -5.0);
  const auto dw_init = randn(vocab * dim, 46);  // grad_weight accumulates: start from non-zero values
  std::vector<double> dw = dw_init;
  ops::cpu::token_logprobs_backward<double, int64_t>(h.data(), w.data(), targets.data(), tokens, dim, vocab,
                                                     temperature, lse.data(), ent.data(), g_lp.data(), g_ent.data(),
                                                     dh.data(), dw.data());
  for (std::size_t i = 0; i < dw.size(); ++i) dw[i] -= dw_init[i];

  const double eps = 1e-5;
  auto fd = [&](std::vector<double>& x) {
    std::vector<double> g(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double keep = x[i];
      x[i] = keep + eps;
      const double up = loss();
      x[i] = keep - eps;
      const double down = loss();
      x[i] = keep;
      g[i] = (up - down) / (2 * eps);
    }
    return g;
  };
  const auto fd_h = fd(h), fd_w = fd(w);
  CHECK(rel_error(dh, fd_h) < 1e-8);
  CHECK(rel_error(dw, fd_w) < 1e-8);
  CHECK(max_abs_diff(dh, fd_h) < 1e-8);
  CHECK(max_abs_diff(dw, fd_w) < 1e-8);

  // Each term alone, so neither can hide behind the other.
  for (int which = 0; which < 2; ++which) {
    std::vector<double> a(static_cast<std::size_t>(tokens), 0.0), b(static_cast<std::size_t>(tokens), 0.0);
    (which == 0 ? a : b) = (which == 0 ? g_lp : g_ent);
    std::vector<double> dh1(static_cast<std::size_t>(tokens * dim));
    ops::cpu::token_logprobs_backward<double, int64_t>(h.data(), w.data(), targets.data(), tokens, dim, vocab,
                                                       temperature, lse.data(), ent.data(), a.data(), b.data(),
                                                       dh1.data(), nullptr);
    auto loss1 = [&] {
      std::vector<double> lp1(tokens), ent1(tokens), lse1(tokens);
      ops::cpu::token_logprobs_forward<double, int64_t>(h.data(), w.data(), targets.data(), tokens, dim, vocab,
                                                        temperature, lp1.data(), ent1.data(), lse1.data(), chunk);
      double l = 0;
      for (int64_t t = 0; t < tokens; ++t) l += a[t] * lp1[t] + b[t] * ent1[t];
      return l;
    };
    std::vector<double> g(h.size());
    for (std::size_t i = 0; i < h.size(); ++i) {
      const double keep = h[i];
      h[i] = keep + eps;
      const double up = loss1();
      h[i] = keep - eps;
      const double down = loss1();
      h[i] = keep;
      g[i] = (up - down) / (2 * eps);
    }
    CAPTURE(which);
    CHECK(rel_error(dh1, g) < 1e-8);
  }
}

TEST_CASE("token_logprobs stays finite and exact for extreme logits", "[ops][token_logprobs]") {
  // Logits of magnitude ~1e4 (and one token with a dominant target): exp()
  // of them overflows unless every exponent is taken relative to the max.
  const int64_t tokens = 5, dim = 8, vocab = 1000;
  const double temperature = 0.05;
  const auto hd = randn(tokens * dim, 51, 30.0), wd = randn(vocab * dim, 52, 3.0);
  const auto targets = random_targets(tokens, vocab, 53);
  const auto g_lp = randn(tokens, 54), g_ent = randn(tokens, 55);
  const auto hf = cast_vector<float>(hd), wf = cast_vector<float>(wd);
  const Naive ref = naive(hf, wf, targets, dim, vocab, temperature, g_lp, g_ent);
  double max_z = 0;
  for (double l : ref.lse) max_z = std::max(max_z, std::abs(l));
  REQUIRE(max_z > 1000.0);

  std::vector<float> lp(tokens), ent(tokens), lse(tokens);
  ops::cpu::token_logprobs_forward<float, int64_t>(hf.data(), wf.data(), targets.data(), tokens, dim, vocab,
                                                   float(temperature), lp.data(), ent.data(), lse.data(), 64);
  for (int64_t t = 0; t < tokens; ++t) {
    CAPTURE(t, lp[t], ent[t], lse[t], ref.logprobs[t], ref.entropy[t]);
    REQUIRE(std::isfinite(lp[t]));
    REQUIRE(std::isfinite(ent[t]));
    REQUIRE(std::isfinite(lse[t]));
    CHECK(lp[t] <= 1e-3f);
    CHECK(ent[t] >= -1e-6f);
    // fp32 logits of size |z| carry an absolute error of ~|z| * 1e-7 * sqrt(dim).
    CHECK(std::abs(lse[t] - ref.lse[t]) <= 1e-5 * max_z);
    CHECK(std::abs(lp[t] - ref.logprobs[t]) <= 1e-5 * max_z);
    CHECK(std::abs(ent[t] - ref.entropy[t]) <= 1e-5 * max_z);
  }
  std::vector<float> dh(static_cast<std::size_t>(tokens * dim)), dw(static_cast<std::size_t>(vocab * dim), 0.f);
  std::vector<float> glp_f(g_lp.begin(), g_lp.end()), gent_f(g_ent.begin(), g_ent.end());
  ops::cpu::token_logprobs_backward<float, int64_t>(hf.data(), wf.data(), targets.data(), tokens, dim, vocab,
                                                    float(temperature), lse.data(), ent.data(), glp_f.data(),
                                                    gent_f.data(), dh.data(), dw.data());
  CHECK(std::all_of(dh.begin(), dh.end(), [](float x) { return std::isfinite(x); }));
  CHECK(std::all_of(dw.begin(), dw.end(), [](float x) { return std::isfinite(x); }));
  CHECK(rel_error(dh, ref.grad_hidden) < 1e-2);
  CHECK(rel_error(dw, ref.grad_weight) < 1e-2);
}

TEST_CASE("token_logprobs Tensor API matches the templates", "[ops][token_logprobs]") {
  const int64_t tokens = 17, dim = 24, vocab = 1000;
  const float temperature = 0.9f;
  for (DType dt : {DType::f32, DType::bf16}) {
    for (DType it : {DType::i32, DType::i64}) {
      CAPTURE(dtype_name(dt), dtype_name(it));
      Tensor h = Tensor::empty({tokens, dim}, dt), w = Tensor::empty({vocab, dim}, dt);
      fill_normal(h, 61, 0, 0.f, 1.f);
      fill_normal(w, 62, 0, 0.f, 0.5f);
      const auto t64 = random_targets(tokens, vocab, 63);
      Tensor targets;
      if (it == DType::i64) {
        targets = Tensor::from_vector(t64, {tokens});
      } else {
        targets = Tensor::from_vector(std::vector<int32_t>(t64.begin(), t64.end()), {tokens});
      }
      Tensor lp = Tensor::empty({tokens}, DType::f32), ent = Tensor::empty({tokens}, DType::f32),
             lse = Tensor::empty({tokens}, DType::f32);
      ops::token_logprobs_forward(h, w, targets, temperature, lp, ent, lse, Tensor{}, ops::TokenLogprobsChunks{0, 300});

      std::vector<float> lp_ref(tokens), ent_ref(tokens), lse_ref(tokens);
      Tensor g_lp = Tensor::empty({tokens}, DType::f32), g_ent = Tensor::empty({tokens}, DType::f32);
      fill_normal(g_lp, 64, 0, 0.f, 1.f);
      fill_normal(g_ent, 65, 0, 0.f, 1.f);
      Tensor dh = Tensor::empty({tokens, dim}, dt), dw = Tensor::empty({vocab, dim}, DType::f32);
      fill_normal(dw, 66, 0, 0.f, 1.f);
      const std::vector<float> dw_init = dw.to_vector<float>();
      ops::token_logprobs_backward(h, w, targets, temperature, lse, ent, g_lp, g_ent, dh, dw);

      std::vector<float> dw_ref = dw_init;
      auto run = [&](auto value) {
        using T = decltype(value);
        ops::cpu::token_logprobs_forward<T, int64_t>(h.data<T>(), w.data<T>(), t64.data(), tokens, dim, vocab,
                                                     temperature, lp_ref.data(), ent_ref.data(), lse_ref.data(), 300);
        std::vector<T> dh_ref(static_cast<std::size_t>(tokens * dim));
        ops::cpu::token_logprobs_backward<T, int64_t>(h.data<T>(), w.data<T>(), t64.data(), tokens, dim, vocab,
                                                      temperature, lse_ref.data(), ent_ref.data(), g_lp.data<float>(),
                                                      g_ent.data<float>(), dh_ref.data(), dw_ref.data());
        CHECK(std::memcmp(dh_ref.data(), dh.data_ptr(), dh.nbytes()) == 0);
      };
      if (dt == DType::f32) {
        run(float{});
      } else {
        run(BFloat16{});
      }
      CHECK(lp.to_vector<float>() == lp_ref);
      CHECK(ent.to_vector<float>() == ent_ref);
      CHECK(lse.to_vector<float>() == lse_ref);
      CHECK(dw.to_vector<float>() == dw_ref);

      // The convenience forward gives the same numbers with the default chunk
      // (up to rounding), and undefined outputs of the backward are skipped.
      const ops::TokenLogprobs out = ops::token_logprobs(h, w, targets, temperature);
      CHECK(max_abs_diff(out.logprobs.to_vector<float>(), lp_ref) < 1e-5);
      CHECK(max_abs_diff(out.entropy.to_vector<float>(), ent_ref) < 1e-5);
      Tensor dw2 = Tensor::zeros({vocab, dim}, DType::f32);
      ops::token_logprobs_backward(h, w, targets, temperature, lse, ent, g_lp, Tensor{}, Tensor{}, dw2);
      const auto dw2v = dw2.to_vector<float>();
      CHECK(std::any_of(dw2v.begin(), dw2v.end(), [](float x) { return x != 0.f; }));
    }
  }
}

TEST_CASE("token_logprobs workspace sizing", "[ops][token_logprobs]") {
  // Qwen's vocabulary at the benchmark sizes: under the 256 MiB budget.
  for (int64_t tokens : {int64_t(4096), int64_t(8192), int64_t(65536)}) {
    for (int64_t dim : {int64_t(2048), int64_t(4096)}) {
      const auto l = ops::token_logprobs_workspace_layout(tokens, dim, 151936, DType::bf16);
      CAPTURE(tokens, dim, l.token_chunk, l.vocab_chunk, l.total_bytes);
      CHECK(l.total_bytes <= ops::kTokenLogprobsWorkspaceBudget);
      CHECK(l.vocab_chunk <= ops::kTokenLogprobsVocabChunk);
      CHECK(l.vocab_chunk % 128 == 0);
      CHECK(l.logits_ld % 8 == 0);
      CHECK(l.token_chunk >= 1024);
      CHECK(l.scratch_offset % 256 == 0);
      CHECK(l.logits_bytes >= std::size_t(l.token_chunk * l.logits_ld * 4));
      CHECK(l.total_bytes >= l.scratch_offset + std::size_t(l.token_chunk * dim * 4));
    }
  }
  // Small problems get small workspaces; explicit chunks are honoured.
  const auto small = ops::token_logprobs_workspace_layout(17, 64, 37, DType::f32);
  CHECK(small.token_chunk == 17);
  CHECK(small.vocab_chunk == 37);
  CHECK(small.logits_ld == 40);
  const auto fixed = ops::token_logprobs_workspace_layout(300, 64, 151936, DType::bf16, {64, 16384});
  CHECK(fixed.token_chunk == 64);
  CHECK(fixed.vocab_chunk == 16384);
  CHECK(ops::token_logprobs_workspace_bytes(300, 64, 151936, DType::bf16, {64, 16384}) == fixed.total_bytes);
  CHECK_THROWS_WITH(ops::token_logprobs_workspace_bytes(10, 64, 1000, DType::bf16, {0, 16385}),
                    ContainsSubstring("chunks"));
  CHECK_THROWS_WITH(ops::token_logprobs_workspace_bytes(10, 0, 1000, DType::bf16), ContainsSubstring("dim > 0"));
}

TEST_CASE("token_logprobs rejects bad input with clear errors", "[ops][token_logprobs]") {
  const int64_t tokens = 4, dim = 8, vocab = 10;
  Tensor h = Tensor::zeros({tokens, dim}, DType::f32), w = Tensor::zeros({vocab, dim}, DType::f32);
  Tensor targets = Tensor::from_vector(std::vector<int32_t>{0, 3, 9, 2}, {tokens});
  Tensor lp = Tensor::empty({tokens}, DType::f32), ent = Tensor::empty({tokens}, DType::f32),
         lse = Tensor::empty({tokens}, DType::f32);
  auto fwd = [&](const Tensor& hh, const Tensor& ww, const Tensor& tt, float temp) {
    ops::token_logprobs_forward(hh, ww, tt, temp, lp, ent, lse);
  };
  REQUIRE_NOTHROW(fwd(h, w, targets, 1.f));
  // All-zero logits: uniform distribution.
  for (float x : lp.to_vector<float>()) CHECK(std::abs(x + std::log(10.f)) < 1e-6f);
  for (float x : ent.to_vector<float>()) CHECK(std::abs(x - std::log(10.f)) < 1e-6f);

  // Targets out of range (no "ignore" value), on both passes.
  for (int32_t bad : {-1, -100, 10, 1000}) {
    CAPTURE(bad);
    Tensor t = Tensor::from_vector(std::vector<int32_t>{0, bad, 1, 2}, {tokens});
    CHECK_THROWS_WITH(fwd(h, w, t, 1.f), ContainsSubstring("targets[1] = " + std::to_string(bad)) &&
                                             ContainsSubstring("outside the vocabulary [0, 10)"));
    Tensor dh = Tensor::empty({tokens, dim}, DType::f32);
    CHECK_THROWS_WITH(ops::token_logprobs_backward(h, w, t, 1.f, lse, ent, lp, Tensor{}, dh, Tensor{}),
                      ContainsSubstring("outside the vocabulary"));
  }
  Tensor t64 = Tensor::from_vector(std::vector<int64_t>{0, 1, int64_t(1) << 40, 2}, {tokens});
  CHECK_THROWS_WITH(fwd(h, w, t64, 1.f), ContainsSubstring("outside the vocabulary"));

  // Temperature.
  for (float temp : {0.f, -1.f, std::nanf(""), INFINITY}) {
    CAPTURE(temp);
    CHECK_THROWS_WITH(fwd(h, w, targets, temp), ContainsSubstring("temperature must be finite and > 0"));
  }

  // Shapes and dtypes.
  CHECK_THROWS_WITH(fwd(h, Tensor::zeros({vocab, dim + 1}, DType::f32), targets, 1.f),
                    ContainsSubstring("weight must be [vocab > 0, 8]"));
  CHECK_THROWS_WITH(fwd(h, Tensor::zeros({0, dim}, DType::f32), targets, 1.f),
                    ContainsSubstring("weight must be [vocab > 0, 8]"));
  CHECK_THROWS_WITH(fwd(h, Tensor::zeros({vocab, dim}, DType::bf16), targets, 1.f),
                    ContainsSubstring("weight (the dtype of hidden) must be f32"));
  CHECK_THROWS_WITH(fwd(h.reshape({-1}), w, targets, 1.f), ContainsSubstring("hidden must be [tokens, dim]"));
  CHECK_THROWS_WITH(fwd(Tensor::zeros({tokens, dim}, DType::f16), w, targets, 1.f),
                    ContainsSubstring("hidden must be bf16 or f32"));
  CHECK_THROWS_WITH(fwd(h, w, Tensor::zeros({tokens + 1}, DType::i32), 1.f),
                    ContainsSubstring("targets must have shape (4,)"));
  CHECK_THROWS_WITH(fwd(h, w, Tensor::zeros({tokens}, DType::f32), 1.f),
                    ContainsSubstring("targets must be i32 or i64"));
  CHECK_THROWS_WITH(ops::token_logprobs_forward(h, w, targets, 1.f, Tensor::empty({tokens + 1}, DType::f32), ent, lse),
                    ContainsSubstring("logprobs must have shape (4,)"));
  CHECK_THROWS_WITH(ops::token_logprobs_forward(h, w, targets, 1.f, lp, Tensor::empty({tokens}, DType::bf16), lse),
                    ContainsSubstring("entropy must be f32"));
  CHECK_THROWS_WITH(ops::token_logprobs_forward(h, w, targets, 1.f, lp, ent, Tensor{}),
                    ContainsSubstring("lse is undefined"));
  CHECK_THROWS_WITH(
      ops::token_logprobs_forward(h, w, targets, 1.f, lp, ent, lse, Tensor{}, ops::TokenLogprobsChunks{0, 20000}),
      ContainsSubstring("chunks"));

  Tensor dh = Tensor::empty({tokens, dim}, DType::f32), dw = Tensor::zeros({vocab, dim}, DType::f32);
  CHECK_THROWS_WITH(ops::token_logprobs_backward(h, w, targets, 1.f, lse, ent, lp, ent,
                                                 Tensor::empty({tokens, dim}, DType::bf16), dw),
                    ContainsSubstring("grad_hidden (the dtype of hidden) must be f32"));
  CHECK_THROWS_WITH(
      ops::token_logprobs_backward(h, w, targets, 1.f, lse, ent, lp, ent, dh, Tensor::zeros({vocab, dim}, DType::bf16)),
      ContainsSubstring("grad_weight (fp32 accumulator) must be f32"));
  CHECK_THROWS_WITH(ops::token_logprobs_backward(h, w, targets, 1.f, lse, ent, lp, ent, dh,
                                                 Tensor::zeros({vocab + 1, dim}, DType::f32)),
                    ContainsSubstring("grad_weight must have shape (10, 8)"));
  CHECK_THROWS_WITH(
      ops::token_logprobs_backward(h, w, targets, 1.f, lse, ent, Tensor::empty({2}, DType::f32), ent, dh, dw),
      ContainsSubstring("grad_logprobs must have shape (4,)"));
  CHECK_THROWS_WITH(ops::token_logprobs_backward(h, w, targets, 1.f, Tensor{}, ent, lp, ent, dh, dw),
                    ContainsSubstring("lse is undefined"));

  // No tokens: nothing to do, no error.
  Tensor h0 = Tensor::zeros({0, dim}, DType::f32);
  Tensor t0 = Tensor::zeros({0}, DType::i64), e0 = Tensor::empty({0}, DType::f32);
  CHECK_NOTHROW(ops::token_logprobs_forward(h0, w, t0, 1.f, e0, e0, e0));
}
