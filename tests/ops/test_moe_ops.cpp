// MoE ops on the CPU (router, auxiliary loss, permute / unpermute, grouped
// GEMM): finite differences of every backward in double through the
// templates; a whole MoE block (router → permute → grouped GEMM gate/up →
// SwiGLU → grouped GEMM down → unpermute, plus the auxiliary loss) against a
// naive per-token loop and by finite differences; the auxiliary loss from
// statistics summed over 1..4 row shards against the unsharded loss and
// gradient, and by finite differences; the Tensor API against the templates;
// skewed routing, empty experts, k = 1..8, E = 1, T = 1, odd sizes;
// determinism; bad-input errors. The GPU paths are tested against these in
// test_moe_ops_gpu.cu.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "slime/core/device.hpp"
#include "slime/core/random.hpp"
#include "slime/ops/cpu/linear.hpp"
#include "slime/ops/cpu/swiglu.hpp"
#include "slime/ops/grouped_gemm.hpp"
#include "slime/ops/linear.hpp"
#include "slime/ops/moe_permute.hpp"
#include "slime/ops/router.hpp"
#include "slime/ops/swiglu.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
using Vec = std::vector<double>;
using IVec = std::vector<int32_t>;

namespace {

Vec random_doubles(int64_t n, uint64_t seed, double scale = 1.0) {
  Vec v(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[std::size_t(i)] = scale * double(random_uniform(seed, uint64_t(i), -1.f, 1.f));
  return v;
}

double dot(const Vec& a, const Vec& b) {
  REQUIRE(a.size() == b.size());
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// ‖got − want‖ / ‖want‖ (the absolute norm when want is 0).
double rel_error(const Vec& got, const Vec& want) {
  REQUIRE(got.size() == want.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Central differences of f at v, element by element (v is restored).
Vec finite_diff(Vec& v, const std::function<double()>& f, double eps = 1e-6) {
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

template <class T>
Tensor tensor_of(const std::vector<T>& v, const Shape& shape) {
  return Tensor::from_vector(v, shape);
}

Tensor f32_tensor(const Vec& v, const Shape& shape) {
  std::vector<float> f(v.begin(), v.end());
  return Tensor::from_vector(f, shape);
}

Vec to_double(const Tensor& t) {
  Vec out(static_cast<std::size_t>(t.numel()));
  if (t.dtype() == DType::f32) {
    const float* p = t.data<float>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = p[i];
  } else {
    const BFloat16* p = t.data<BFloat16>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = double(float(p[i]));
  }
  return out;
}

// ---- The router through the double templates -----------------------------

struct Routed {
  Vec probs, weights;
  IVec indices;
};

Routed route(const Vec& logits, int64_t T, int64_t E, int64_t k, bool norm) {
  Routed r{Vec(static_cast<std::size_t>(T * E)), Vec(static_cast<std::size_t>(T * k)),
           IVec(static_cast<std::size_t>(T * k))};
  ops::cpu::router_forward(logits.data(), T, E, k, norm, r.probs.data(), r.indices.data(), r.weights.data());
  return r;
}

// The naive router of one token: softmax, sort by probability descending
// (ties: lower id), first k, renormalised when `norm`.
void naive_route(const double* l, int64_t E, int64_t k, bool norm, std::vector<int>& ids, Vec& w) {
  Vec p(static_cast<std::size_t>(E));
  double mx = l[0], s = 0;
  for (int64_t e = 0; e < E; ++e) mx = std::max(mx, l[e]);
  for (int64_t e = 0; e < E; ++e) s += (p[std::size_t(e)] = std::exp(l[e] - mx));
  for (auto& v : p) v /= s;
  ids.resize(static_cast<std::size_t>(E));
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return p[std::size_t(a)] > p[std::size_t(b)]; });
  ids.resize(static_cast<std::size_t>(k));
  w.assign(static_cast<std::size_t>(k), 0);
  double ws = 0;
  for (int64_t j = 0; j < k; ++j) ws += (w[std::size_t(j)] = p[std::size_t(ids[std::size_t(j)])]);
  if (norm)
    for (auto& v : w) v /= ws;
}

// ---- A whole MoE block in double through the templates --------------------

struct Block {
  int64_t T, H, F, E, k;
  bool norm;
  double aux_coef;
  Vec x, wr, wg, wu, wd;  // x [T, H]; router [E, H]; gate, up [E, F, H]; down [E, H, F]
  Vec R;                  // the loss's weights of y: L = Σ R ⊙ y + aux_coef · aux

  Block(int64_t T_, int64_t H_, int64_t F_, int64_t E_, int64_t k_, bool norm_, uint64_t seed,
        double router_scale = 2.0)
      : T(T_), H(H_), F(F_), E(E_), k(k_), norm(norm_), aux_coef(0.3) {
    x = random_doubles(T * H, seed + 1);
    wr = random_doubles(E * H, seed + 2, router_scale);
    wg = random_doubles(E * F * H, seed + 3);
    wu = random_doubles(E * F * H, seed + 4);
    wd = random_doubles(E * H * F, seed + 5);
    R = random_doubles(T * H, seed + 6);
  }
};

struct Saved {
  Vec logits, xg, g, u, h, yg, y;
  Routed r;
  IVec counts, offsets, r2c, c2r;
  double loss = 0;
};

Saved block_forward(const Block& b) {
  const int64_t N = b.T * b.k;
  Saved s;
  s.logits.resize(static_cast<std::size_t>(b.T * b.E));
  ops::cpu::linear_forward(b.x.data(), b.wr.data(), b.T, b.H, b.E, s.logits.data());
  s.r = route(s.logits, b.T, b.E, b.k, b.norm);
  s.counts.resize(static_cast<std::size_t>(b.E));
  s.offsets.resize(static_cast<std::size_t>(b.E + 1));
  s.r2c.resize(static_cast<std::size_t>(N));
  s.c2r.resize(static_cast<std::size_t>(N));
  ops::cpu::moe_build_layout(s.r.indices.data(), b.T, b.k, b.E, s.counts.data(), s.offsets.data(), s.r2c.data(),
                             s.c2r.data());
  s.xg.resize(static_cast<std::size_t>(N * b.H));
  ops::cpu::moe_permute_forward(b.x.data(), s.r2c.data(), b.T, b.k, b.H, s.xg.data());
  s.g.resize(static_cast<std::size_t>(N * b.F));
  s.u.resize(static_cast<std::size_t>(N * b.F));
  s.h.resize(static_cast<std::size_t>(N * b.F));
  ops::cpu::grouped_gemm_forward(s.xg.data(), b.wg.data(), s.offsets.data(), b.E, b.F, b.H, s.g.data());
  ops::cpu::grouped_gemm_forward(s.xg.data(), b.wu.data(), s.offsets.data(), b.E, b.F, b.H, s.u.data());
  ops::cpu::swiglu_forward(s.g.data(), s.u.data(), N * b.F, s.h.data());  // rows are rows
  s.yg.resize(static_cast<std::size_t>(N * b.H));
  ops::cpu::grouped_gemm_forward(s.h.data(), b.wd.data(), s.offsets.data(), b.E, b.H, b.F, s.yg.data());
  s.y.resize(static_cast<std::size_t>(b.T * b.H));
  ops::cpu::moe_unpermute_forward(s.yg.data(), s.r.weights.data(), s.c2r.data(), b.T, b.k, b.H, s.y.data());
  s.loss = dot(b.R, s.y) +
           b.aux_coef * ops::cpu::router_aux_loss_forward(s.r.probs.data(), s.r.indices.data(), b.T, b.E, b.k);
  return s;
}

struct Grads {
  Vec x, wr, wg, wu, wd;
};

Grads block_backward(const Block& b, const Saved& s) {
  const int64_t N = b.T * b.k;
  Grads d{Vec(b.x.size()), Vec(b.wr.size(), 0.0), Vec(b.wg.size(), 0.0), Vec(b.wu.size(), 0.0), Vec(b.wd.size(), 0.0)};
  Vec dyg(static_cast<std::size_t>(N * b.H)), dw(static_cast<std::size_t>(N));
  ops::cpu::moe_unpermute_backward(b.R.data(), s.yg.data(), s.r.weights.data(), s.c2r.data(), b.T, b.k, b.H, dyg.data(),
                                   dw.data());
  Vec dh(static_cast<std::size_t>(N * b.F)), dg(dh.size()), du(dh.size()), dxg(static_cast<std::size_t>(N * b.H));
  ops::cpu::grouped_gemm_backward_input(dyg.data(), b.wd.data(), s.offsets.data(), b.E, b.H, b.F, dh.data());
  ops::cpu::grouped_gemm_backward_weight(dyg.data(), s.h.data(), s.offsets.data(), b.E, b.H, b.F, d.wd.data());
  ops::cpu::swiglu_backward(s.g.data(), s.u.data(), dh.data(), N * b.F, dg.data(), du.data());
  ops::cpu::grouped_gemm_backward_input(dg.data(), b.wg.data(), s.offsets.data(), b.E, b.F, b.H, dxg.data());
  ops::cpu::grouped_gemm_backward_input(du.data(), b.wu.data(), s.offsets.data(), b.E, b.F, b.H, dxg.data(), true);
  ops::cpu::grouped_gemm_backward_weight(dg.data(), s.xg.data(), s.offsets.data(), b.E, b.F, b.H, d.wg.data());
  ops::cpu::grouped_gemm_backward_weight(du.data(), s.xg.data(), s.offsets.data(), b.E, b.F, b.H, d.wu.data());
  ops::cpu::moe_permute_backward(dxg.data(), s.c2r.data(), b.T, b.k, b.H, d.x.data());
  Vec dlogits(static_cast<std::size_t>(b.T * b.E));
  ops::cpu::router_backward(s.r.probs.data(), s.r.indices.data(), dw.data(), b.T, b.E, b.k, b.norm, dlogits.data());
  ops::cpu::router_aux_loss_backward(s.r.probs.data(), s.r.indices.data(), b.T, b.E, b.k, b.aux_coef, dlogits.data(),
                                     true);
  ops::cpu::linear_backward_input(dlogits.data(), b.wr.data(), b.T, b.H, b.E, d.x.data(), true);
  ops::cpu::linear_backward_weight(dlogits.data(), b.x.data(), b.T, b.H, b.E, d.wr.data());
  return d;
}

// The block the obvious way: per token, its top-k experts' MLPs, weighted.
Vec naive_block(const Block& b) {
  Vec y(static_cast<std::size_t>(b.T * b.H), 0.0);
  for (int64_t t = 0; t < b.T; ++t) {
    Vec l(static_cast<std::size_t>(b.E), 0.0);
    for (int64_t e = 0; e < b.E; ++e)
      for (int64_t i = 0; i < b.H; ++i)
        l[std::size_t(e)] += b.x[std::size_t(t * b.H + i)] * b.wr[std::size_t(e * b.H + i)];
    std::vector<int> ids;
    Vec w;
    naive_route(l.data(), b.E, b.k, b.norm, ids, w);
    for (int64_t j = 0; j < b.k; ++j) {
      const int64_t e = ids[std::size_t(j)];
      Vec h(static_cast<std::size_t>(b.F));
      for (int64_t f = 0; f < b.F; ++f) {
        double g = 0, u = 0;
        for (int64_t i = 0; i < b.H; ++i) {
          g += b.wg[std::size_t((e * b.F + f) * b.H + i)] * b.x[std::size_t(t * b.H + i)];
          u += b.wu[std::size_t((e * b.F + f) * b.H + i)] * b.x[std::size_t(t * b.H + i)];
        }
        h[std::size_t(f)] = g / (1 + std::exp(-g)) * u;
      }
      for (int64_t o = 0; o < b.H; ++o) {
        double s = 0;
        for (int64_t f = 0; f < b.F; ++f) s += b.wd[std::size_t((e * b.H + o) * b.F + f)] * h[std::size_t(f)];
        y[std::size_t(t * b.H + o)] += w[std::size_t(j)] * s;
      }
    }
  }
  return y;
}

// Checks the layout of `indices` against its definition.
void check_layout_contents(const IVec& indices, int64_t T, int64_t k, int64_t E, const IVec& counts,
                           const IVec& offsets, const IVec& r2c, const IVec& c2r) {
  const int64_t N = T * k;
  REQUIRE(offsets[0] == 0);
  REQUIRE(offsets[std::size_t(E)] == N);
  for (int64_t e = 0; e < E; ++e) {
    int64_t want = 0;
    for (int64_t c = 0; c < N; ++c) want += indices[std::size_t(c)] == e;
    REQUIRE(counts[std::size_t(e)] == want);
    REQUIRE(offsets[std::size_t(e + 1)] - offsets[std::size_t(e)] == want);
    for (int64_t r = offsets[std::size_t(e)]; r < offsets[std::size_t(e + 1)]; ++r) {
      REQUIRE(indices[std::size_t(r2c[std::size_t(r)])] == e);
      if (r > offsets[std::size_t(e)]) REQUIRE(r2c[std::size_t(r)] > r2c[std::size_t(r - 1)]);  // (token, slot) order
    }
  }
  for (int64_t r = 0; r < N; ++r) REQUIRE(c2r[std::size_t(r2c[std::size_t(r)])] == r);
}

}  // namespace

TEST_CASE("router forward matches its definition, with and without renormalisation", "[moe][router]") {
  for (bool norm : {false, true})
    for (auto [T, E, k] : {std::tuple{7, 5, 2}, std::tuple{1, 1, 1}, std::tuple{3, 8, 8}, std::tuple{5, 13, 3}}) {
      const Vec logits = random_doubles(T * E, 11 + uint64_t(T * E + k), 3.0);
      const Routed r = route(logits, T, E, k, norm);
      for (int64_t t = 0; t < T; ++t) {
        std::vector<int> ids;
        Vec w;
        naive_route(logits.data() + t * E, E, k, norm, ids, w);
        double psum = 0;
        for (int64_t e = 0; e < E; ++e) psum += r.probs[std::size_t(t * E + e)];
        REQUIRE(std::fabs(psum - 1) < 1e-12);
        for (int64_t j = 0; j < k; ++j) {
          REQUIRE(r.indices[std::size_t(t * k + j)] == ids[std::size_t(j)]);
          REQUIRE(std::fabs(r.weights[std::size_t(t * k + j)] - w[std::size_t(j)]) < 1e-14);
        }
      }
    }
  // Ties go to the lower expert id.
  const Vec tied = {0.5, 1.0, 1.0, 0.5, 1.0};
  const Routed r = route(tied, 1, 5, 4, false);
  CHECK(r.indices == IVec{1, 2, 4, 0});
}

TEST_CASE("router_forward_replay: the top-k replayed gives the same bits, other ids weigh their probabilities",
          "[moe][router][replay]") {
  for (DType dt : {DType::f32, DType::bf16})
    for (bool norm : {false, true})
      for (auto [T, E, k] : {std::tuple{7, 5, 2}, std::tuple{1, 1, 1}, std::tuple{3, 8, 8}, std::tuple{13, 16, 3}}) {
        INFO("logits " << dt << " norm " << norm << " T " << T << " E " << E << " k " << k);
        const Vec lv = random_doubles(T * E, 21 + uint64_t(T * E + k), 3.0);
        Tensor logits = Tensor::empty({T, E}, dt);
        for (int64_t i = 0; i < T * E; ++i) {
          if (dt == DType::f32) {
            logits.data<float>()[i] = float(lv[std::size_t(i)]);
          } else {
            logits.data<BFloat16>()[i] = BFloat16(float(lv[std::size_t(i)]));
          }
        }
        const Tensor probs = Tensor::empty({T, E}, DType::f32), idx = Tensor::empty({T, k}, DType::i32);
        const Tensor w = Tensor::empty({T, k}, dt);
        ops::router_forward(logits, norm, probs, idx, w);
        // The top-k replayed: probs and weights bit for bit; indices untouched.
        Tensor probs2 = Tensor::empty({T, E}, DType::f32), w2 = Tensor::empty({T, k}, dt);
        probs2.fill_bytes_(0xff);
        w2.fill_bytes_(0xff);
        const Tensor idx2 = idx.clone();
        ops::router_forward_replay(logits, norm, idx2, probs2, w2);
        CHECK(std::memcmp(probs2.data_ptr(), probs.data_ptr(), probs.nbytes()) == 0);
        CHECK(std::memcmp(w2.data_ptr(), w.data_ptr(), w.nbytes()) == 0);
        CHECK(idx2.to_vector<int32_t>() == idx.to_vector<int32_t>());
        // Other ids: slot j of row t gets (t + 3 j) mod E, and slot 0 of odd
        // rows an id out of range (-1, or E), which weighs 0.
        IVec other(std::size_t(T * k));
        for (int64_t t = 0; t < T; ++t)
          for (int64_t j = 0; j < k; ++j) other[std::size_t(t * k + j)] = int32_t((t + 3 * j) % E);
        for (int64_t t = 1; t < T; t += 2) other[std::size_t(t * k)] = t % 4 == 1 ? -1 : int32_t(E);
        const Tensor ids = Tensor::from_vector(other, {T, k});
        Tensor w3 = Tensor::empty({T, k}, dt);
        w3.fill_bytes_(0xff);
        ops::router_forward_replay(logits, norm, ids, probs2, w3);
        const Vec p = to_double(probs), got = to_double(w3);
        Vec want(std::size_t(T * k));
        for (int64_t t = 0; t < T; ++t) {
          double sum = 0;
          for (int64_t j = 0; j < k; ++j) {
            const int32_t id = other[std::size_t(t * k + j)];
            want[std::size_t(t * k + j)] = id >= 0 && id < E ? p[std::size_t(t * E + id)] : 0.0;
            sum += want[std::size_t(t * k + j)];
          }
          if (norm)
            for (int64_t j = 0; j < k; ++j)
              want[std::size_t(t * k + j)] = sum > 0 ? want[std::size_t(t * k + j)] / sum : 0;
        }
        // f32: one rounding of an fp32 quotient; bf16: the cast (2^-9).
        CHECK(rel_error(got, want) < (dt == DType::f32 ? 1e-6 : 4e-3));
        for (int64_t t = 1; t < T; t += 2) CHECK(got[std::size_t(t * k)] == 0.0);
      }
  // The replayed ids' shape is checked like router_forward's indices.
  const Tensor logits = Tensor::zeros({4, 6}, DType::f32);
  CHECK_THROWS_WITH(ops::router_forward_replay(logits, true, Tensor::zeros({3, 2}, DType::i32),
                                               Tensor::empty({4, 6}, DType::f32), Tensor::empty({3, 2}, DType::f32)),
                    ContainsSubstring("router_forward_replay: indices must have 4 rows"));
}

TEST_CASE("router backward matches finite differences (selection held constant)", "[moe][router][fd]") {
  for (bool norm : {false, true})
    for (auto [T, E, k] :
         {std::tuple{6, 5, 2}, std::tuple{1, 1, 1}, std::tuple{3, 8, 8}, std::tuple{4, 7, 1}, std::tuple{5, 9, 4}}) {
      Vec logits = random_doubles(T * E, 100 + uint64_t(T * 31 + E * 7 + k), 3.0);
      const Vec R = random_doubles(T * k, 200 + uint64_t(T + E + k));
      const Routed base = route(logits, T, E, k, norm);
      auto f = [&] {
        const Routed r = route(logits, T, E, k, norm);
        REQUIRE(r.indices == base.indices);  // the perturbation keeps the top-k
        return dot(R, r.weights);
      };
      Vec dlogits(static_cast<std::size_t>(T * E));
      ops::cpu::router_backward(base.probs.data(), base.indices.data(), R.data(), T, E, k, norm, dlogits.data());
      const Vec fd = finite_diff(logits, f);
      INFO("T " << T << " E " << E << " k " << k << " norm " << norm);
      CHECK(rel_error(dlogits, fd) < 1e-8);
      // accumulate adds.
      Vec acc(dlogits.size(), 1.0);
      ops::cpu::router_backward(base.probs.data(), base.indices.data(), R.data(), T, E, k, norm, acc.data(), true);
      for (std::size_t i = 0; i < acc.size(); ++i) acc[i] -= 1.0;
      CHECK(rel_error(acc, dlogits) < 1e-14);
    }
}

TEST_CASE("aux loss matches transformers' formula and finite differences", "[moe][aux][fd]") {
  for (auto [N, E, k] :
       {std::tuple{9, 6, 2}, std::tuple{1, 1, 1}, std::tuple{4, 8, 8}, std::tuple{7, 5, 1}, std::tuple{12, 16, 4}}) {
    Vec logits = random_doubles(N * E, 300 + uint64_t(N * 13 + E + k), 2.0);
    const Routed base = route(logits, N, E, k, false);
    // load_balancing_loss_func with attention_mask = None: tokens_per_expert
    // [k, E] = mean over rows of one_hot(selected); router_prob_per_expert
    // [E] = mean of probs; loss = E · Σ tokens_per_expert · router_prob.
    Vec tpe(static_cast<std::size_t>(k * E), 0.0), rpe(static_cast<std::size_t>(E), 0.0);
    for (int64_t t = 0; t < N; ++t) {
      for (int64_t j = 0; j < k; ++j) tpe[std::size_t(j * E + base.indices[std::size_t(t * k + j)])] += 1.0 / double(N);
      for (int64_t e = 0; e < E; ++e) rpe[std::size_t(e)] += base.probs[std::size_t(t * E + e)] / double(N);
    }
    double hf = 0;
    for (int64_t j = 0; j < k; ++j)
      for (int64_t e = 0; e < E; ++e) hf += tpe[std::size_t(j * E + e)] * rpe[std::size_t(e)];
    hf *= double(E);
    const double loss = ops::cpu::router_aux_loss_forward(base.probs.data(), base.indices.data(), N, E, k);
    CHECK(std::fabs(loss - hf) < 1e-12);
    if (E == 1) CHECK(std::fabs(loss - double(k)) < 1e-12);  // one expert: every choice, probability 1
    auto f = [&] {
      const Routed r = route(logits, N, E, k, false);
      REQUIRE(r.indices == base.indices);
      return 0.7 * ops::cpu::router_aux_loss_forward(r.probs.data(), r.indices.data(), N, E, k);
    };
    Vec dlogits(static_cast<std::size_t>(N * E));
    ops::cpu::router_aux_loss_backward(base.probs.data(), base.indices.data(), N, E, k, 0.7, dlogits.data());
    // eps 1e-5: the gradient is O(1/N) of a loss of O(k), so a smaller step
    // loses the difference to rounding.
    const Vec fd = finite_diff(logits, f, 1e-5);
    INFO("N " << N << " E " << E << " k " << k);
    if (k == E) {  // every expert chosen by every row: loss = E · Σ_e mean p_e = E, constant
      CHECK(std::fabs(loss - double(E)) < 1e-12);
      double mx = 0, fd_mx = 0;
      for (std::size_t i = 0; i < fd.size(); ++i) {
        mx = std::max(mx, std::fabs(dlogits[i]));
        fd_mx = std::max(fd_mx, std::fabs(fd[i]));
      }
      CHECK(mx < 1e-15);
      CHECK(fd_mx < 1e-9);
    } else {
      CHECK(rel_error(dlogits, fd) < 1e-8);
    }
  }
  CHECK(ops::cpu::router_aux_loss_forward<double>(nullptr, nullptr, 0, 4, 2) == 0.0);
}

namespace {

// Rows [0, N) in `chunks` uneven contiguous pieces, [N i² / c², N (i + 1)² / c²)
// for i < c (some empty when N is small), as data-parallel ranks might hold them.
std::vector<std::pair<int64_t, int64_t>> split_rows(int64_t N, int64_t chunks) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t i = 0; i < chunks; ++i) {
    const int64_t a = N * i * i / (chunks * chunks), b = N * (i + 1) * (i + 1) / (chunks * chunks);
    out.emplace_back(a, b - a);
  }
  return out;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && (a.nbytes() == 0 || std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0);
}

Tensor nan_filled(const Shape& shape, DType dt) {
  Tensor t = Tensor::empty(shape, dt);
  t.fill_bytes_(0xff);
  return t;
}

}  // namespace

TEST_CASE("aux loss from stats summed over row shards equals the unsharded loss and gradient", "[moe][aux][dp]") {
  uint64_t seed = 900;
  const float dloss = 0.37f;
  for (int64_t E : {3, 5, 60})
    for (int64_t k : {int64_t(1), int64_t(2), E == 3 ? int64_t(3) : int64_t(4)})
      for (int64_t N : {0, 1, 37}) {
        const Tensor logits = f32_tensor(random_doubles(N * E, ++seed, 3.0), {N, E});
        const Tensor probs = Tensor::empty({N, E}, DType::f32), idx = Tensor::empty({N, k}, DType::i32);
        ops::router_forward(logits, false, probs, idx, Tensor::empty({N, k}, DType::f32));
        const Tensor loss = Tensor::empty({1}, DType::f32);
        ops::router_aux_loss_forward(probs, idx, loss);
        const float want = *loss.data<float>();
        // The stats of all rows against their definition.
        const Tensor all = nan_filled({2 * E + 1}, DType::f32);
        ops::router_aux_stats(probs, idx, all);
        {
          const std::vector<float> s = all.to_vector<float>();
          const Vec p = to_double(probs);
          const IVec ids = idx.to_vector<int32_t>();
          for (int64_t e = 0; e < E; ++e) {
            double ps = 0;
            for (int64_t t = 0; t < N; ++t) ps += p[std::size_t(t * E + e)];
            REQUIRE(s[std::size_t(e)] == float(std::count(ids.begin(), ids.end(), int32_t(e))));
            REQUIRE(std::fabs(s[std::size_t(E + e)] - ps) <= 1e-6 * std::max(1.0, ps));
          }
          REQUIRE(s[std::size_t(2 * E)] == float(N));
        }
        for (DType gdt : {DType::f32, DType::bf16})
          for (int64_t chunks = 1; chunks <= 4; ++chunks) {
            INFO("E " << E << " k " << k << " N " << N << " chunks " << chunks << " dlogits " << gdt);
            const auto pieces = split_rows(N, chunks);
            // Per-shard stats summed as all_reduce(sum) would, and the same through accumulate.
            Tensor summed = Tensor::zeros({2 * E + 1}, DType::f32);
            const Tensor accumulated = nan_filled({2 * E + 1}, DType::f32);
            for (std::size_t c = 0; c < pieces.size(); ++c) {
              const auto [a, n] = pieces[c];
              const Tensor st = nan_filled({2 * E + 1}, DType::f32);
              ops::router_aux_stats(probs.slice_rows(a, n), idx.slice_rows(a, n), st);
              for (int64_t i = 0; i < st.numel(); ++i) summed.data<float>()[i] += st.data<float>()[i];
              ops::router_aux_stats(probs.slice_rows(a, n), idx.slice_rows(a, n), accumulated, /*accumulate=*/c > 0);
            }
            CHECK(same_bits(summed, accumulated));
            // Counts and N are exact: equal to the unsharded stats.
            for (int64_t i = 0; i < E; ++i) CHECK(summed.data<float>()[i] == all.data<float>()[i]);
            CHECK(summed.data<float>()[2 * E] == float(N));
            const Tensor got = nan_filled({1}, DType::f32);
            ops::router_aux_loss_from_stats(summed, E, got);
            const float l = *got.data<float>();
            CHECK(std::fabs(l - want) <= 1e-6 * std::fabs(want));
            if (chunks == 1) CHECK(same_bits(got, loss));  // router_aux_loss_forward is stats + from_stats
            // The gradient rows, shard by shard, written and accumulated: the
            // same bits as the unsharded backward (g depends only on the
            // exact counts and N).
            for (bool accumulate : {false, true}) {
              Tensor base = nan_filled({N, E}, gdt);
              if (accumulate) fill_normal(base, ++seed, 0, 0.f, 1e-3f);
              const Tensor ref = base.clone(), d = base.clone();
              ops::router_aux_loss_backward(probs, idx, dloss, ref, accumulate);
              for (const auto& [a, n] : pieces)
                ops::router_aux_loss_backward_from_stats(probs.slice_rows(a, n), summed, dloss, d.slice_rows(a, n),
                                                         accumulate);
              CHECK(same_bits(d, ref));
            }
          }
      }
  // Zero rows: zero stats, loss 0.
  const Tensor st = nan_filled({7}, DType::f32), loss = nan_filled({1}, DType::f32);
  ops::router_aux_stats(Tensor::empty({0, 3}, DType::f32), Tensor::empty({0, 2}, DType::i32), st);
  CHECK(st.to_vector<float>() == std::vector<float>(7, 0.f));
  ops::router_aux_loss_from_stats(st, 3, loss);
  CHECK(*loss.data<float>() == 0.f);
}

TEST_CASE("aux loss over row shards matches finite differences of the unsharded loss", "[moe][aux][dp][fd]") {
  for (auto [N, E, k] : {std::tuple{37, 5, 2}, std::tuple{9, 3, 1}, std::tuple{13, 60, 4}, std::tuple{1, 5, 3}})
    for (int64_t chunks = 1; chunks <= 4; ++chunks) {
      Vec logits = random_doubles(N * E, 700 + uint64_t(N * 13 + E + k), 2.0);  // the same for every split
      const Routed base = route(logits, N, E, k, false);
      const auto pieces = split_rows(N, chunks);
      const auto size = static_cast<std::size_t>(2 * E + 1);
      // Σ over the shards of their stats, as all_reduce(sum).
      auto summed_stats = [&](const Routed& r) {
        Vec total(size, 0.0), st(size);
        for (const auto& [a, n] : pieces) {
          ops::cpu::router_aux_stats(r.probs.data() + a * E, r.indices.data() + a * k, n, E, k, st.data());
          for (std::size_t i = 0; i < size; ++i) total[i] += st[i];
        }
        return total;
      };
      const Vec stats = summed_stats(base);
      const double loss = ops::cpu::router_aux_loss_from_stats(stats.data(), E);
      INFO("N " << N << " E " << E << " k " << k << " chunks " << chunks);
      CHECK(std::fabs(loss - ops::cpu::router_aux_loss_forward(base.probs.data(), base.indices.data(), N, E, k)) <
            1e-12);
      auto f = [&] {
        const Routed r = route(logits, N, E, k, false);
        REQUIRE(r.indices == base.indices);
        const Vec s = summed_stats(r);
        return 0.7 * ops::cpu::router_aux_loss_from_stats(s.data(), E);
      };
      Vec dlogits(static_cast<std::size_t>(N * E), std::nan(""));
      for (const auto& [a, n] : pieces)
        ops::cpu::router_aux_loss_backward_from_stats(base.probs.data() + a * E, n, E, stats.data(), 0.7,
                                                      dlogits.data() + a * E);
      const Vec fd = finite_diff(logits, f, 1e-5);  // eps as the unsharded test's
      double mx = 0;
      for (double v : fd) mx = std::max(mx, std::fabs(v));
      INFO("max |fd| " << mx);
      CHECK(rel_error(dlogits, fd) < 1e-8);
    }
}

TEST_CASE("aux loss stats functions reject bad input with clear errors", "[moe][aux][errors]") {
  const Tensor probs = Tensor::zeros({4, 3}, DType::f32), idx = Tensor::zeros({4, 2}, DType::i32);
  const Tensor stats = Tensor::zeros({7}, DType::f32), loss = Tensor::empty({1}, DType::f32);
  const Tensor dlogits = Tensor::empty({4, 3}, DType::f32);
  // router_aux_stats: shapes and dtypes of probs, indices and stats.
  CHECK_THROWS_WITH(ops::router_aux_stats(probs, idx, Tensor::zeros({6}, DType::f32)),
                    ContainsSubstring("stats must be f32 [2 * experts + 1] = [7] for 3 experts"));
  CHECK_THROWS_WITH(ops::router_aux_stats(probs, idx, Tensor::zeros({7}, DType::i32)),
                    ContainsSubstring("stats must be f32 [2 * experts + 1] = [7]"));
  CHECK_THROWS_WITH(ops::router_aux_stats(probs, idx, Tensor::zeros({1, 7}, DType::f32)),
                    ContainsSubstring("stats must be f32 [2 * experts + 1] = [7]"));
  CHECK_THROWS_WITH(ops::router_aux_stats(probs, idx, Tensor()), ContainsSubstring("stats is undefined"));
  CHECK_THROWS_WITH(ops::router_aux_stats(Tensor::zeros({4, 3}, DType::bf16), idx, stats),
                    ContainsSubstring("router_aux_stats: probs must be f32"));
  CHECK_THROWS_WITH(ops::router_aux_stats(probs, Tensor::zeros({3, 2}, DType::i32), stats),
                    ContainsSubstring("indices must have 4 rows"));
  CHECK_THROWS_WITH(ops::router_aux_stats(probs, Tensor::zeros({4, 2}, DType::i64), stats),
                    ContainsSubstring("indices must be i32"));
  CHECK_THROWS_WITH(ops::router_aux_stats(probs, Tensor::zeros({4, 4}, DType::i32), stats), ContainsSubstring("k = 4"));
  CHECK_THROWS_WITH(
      ops::router_aux_stats(probs.slice_rows(0, 1), Tensor::from_vector(std::vector<int32_t>{0, 3}, {1, 2}), stats),
      ContainsSubstring("indices[0, 1] = 3 is not an expert id"));
  // Counts and N must stay exact in f32 (below 2^24); nothing is written on error.
  CHECK_THROWS_WITH(
      ops::router_aux_stats(Tensor::empty({ops::kRouterAuxStatsExact, 1}, DType::f32),
                            Tensor::empty({ops::kRouterAuxStatsExact, 1}, DType::i32), Tensor::zeros({3}, DType::f32)),
      ContainsSubstring("16777216 rows") && ContainsSubstring("below 2^24"));
  {
    Tensor near = Tensor::from_vector(std::vector<float>{16777215.f, 0.f, 0.f, 0.f, 0.f, 0.f, 1.f}, {7});
    const Tensor keep = near.clone();
    const Tensor row_ids = Tensor::from_vector(std::vector<int32_t>{0, 2}, {1, 2});  // one choice of expert 0
    CHECK_THROWS_WITH(ops::router_aux_stats(probs.slice_rows(0, 1), row_ids, near, true),
                      ContainsSubstring("stats[0] (a count) would reach 16777216 >= 2^24"));
    CHECK(same_bits(near, keep));
    near.data<float>()[0] = 0.f;
    near.data<float>()[1] = 0.5f;
    CHECK_THROWS_WITH(ops::router_aux_stats(probs.slice_rows(0, 1), row_ids, near, true),
                      ContainsSubstring("stats[1] = 0.5 (a count) to accumulate into is not an integer"));
  }
  // router_aux_loss_from_stats: E, the stats' length, their values, loss.
  CHECK_THROWS_WITH(ops::router_aux_loss_from_stats(stats, 0, loss), ContainsSubstring("needs at least one expert"));
  CHECK_THROWS_WITH(ops::router_aux_loss_from_stats(stats, 4, loss),
                    ContainsSubstring("stats must be f32 [2 * experts + 1] = [9] for 4 experts"));
  CHECK_THROWS_WITH(ops::router_aux_loss_from_stats(stats, 3, Tensor::empty({2}, DType::f32)),
                    ContainsSubstring("loss must be an f32 tensor of one element"));
  CHECK_THROWS_WITH(ops::router_aux_loss_from_stats(stats, 3, stats.view(6, {1})),
                    ContainsSubstring("loss overlaps stats"));
  // Stats averaged over 2 ranks instead of summed: a count of 2.5.
  const Tensor averaged = Tensor::from_vector(std::vector<float>{2.5f, 1.f, 4.5f, 1.f, 1.f, 2.f, 4.f}, {7});
  CHECK_THROWS_WITH(ops::router_aux_loss_from_stats(averaged, 3, loss),
                    ContainsSubstring("stats[0] = 2.5 (a count) is not an integer in [0, 2^24)") &&
                        ContainsSubstring("summed (not averaged)"));
  const Tensor bad_n = Tensor::from_vector(std::vector<float>{2.f, 1.f, 5.f, 1.f, 1.f, 2.f, -4.f}, {7});
  CHECK_THROWS_WITH(ops::router_aux_loss_from_stats(bad_n, 3, loss),
                    ContainsSubstring("stats[6] = -4 (a row count N) is not an integer"));
  // router_aux_loss_backward_from_stats: probs, stats, dlogits, and N >= the call's rows.
  CHECK_THROWS_WITH(ops::router_aux_loss_backward_from_stats(Tensor::zeros({12}, DType::f32), stats, 1.f, dlogits),
                    ContainsSubstring("probs must be 2-D"));
  CHECK_THROWS_WITH(ops::router_aux_loss_backward_from_stats(probs, Tensor::zeros({9}, DType::f32), 1.f, dlogits),
                    ContainsSubstring("stats must be f32 [2 * experts + 1] = [7] for 3 experts"));
  CHECK_THROWS_WITH(ops::router_aux_loss_backward_from_stats(probs, stats, 1.f, Tensor::empty({4, 2}, DType::f32)),
                    ContainsSubstring("dlogits must have shape (4, 3)"));
  CHECK_THROWS_WITH(ops::router_aux_loss_backward_from_stats(probs, stats, 1.f, Tensor::empty({4, 3}, DType::i32)),
                    ContainsSubstring("dlogits must be f32 or bf16"));
  CHECK_THROWS_WITH(ops::router_aux_loss_backward_from_stats(probs, stats.clone(), 1.f, dlogits),
                    ContainsSubstring("stats[6] = N = 0 rows, fewer than the 4 rows of probs"));
  CHECK_THROWS_WITH(ops::router_aux_loss_backward_from_stats(probs, averaged, 1.f, dlogits),
                    ContainsSubstring("summed (not averaged)"));
}

TEST_CASE("layout groups copies by expert, stable by token and slot", "[moe][permute]") {
  for (auto [T, E, k] :
       {std::tuple{9, 5, 2}, std::tuple{1, 1, 1}, std::tuple{1, 8, 8}, std::tuple{13, 7, 3}, std::tuple{0, 3, 2}}) {
    IVec idx(static_cast<std::size_t>(T * k));
    for (int64_t t = 0; t < T; ++t) {  // distinct experts per token, a skewed draw
      std::vector<int> perm(static_cast<std::size_t>(E));
      std::iota(perm.begin(), perm.end(), 0);
      for (int64_t i = E - 1; i > 0; --i) std::swap(perm[std::size_t(i)], perm[std::size_t((t * 7 + i * 3) % (i + 1))]);
      for (int64_t j = 0; j < k; ++j) idx[std::size_t(t * k + j)] = perm[std::size_t(j)];
    }
    IVec counts(static_cast<std::size_t>(E)), offsets(static_cast<std::size_t>(E + 1)),
        r2c(static_cast<std::size_t>(T * k)), c2r(static_cast<std::size_t>(T * k));
    ops::cpu::moe_build_layout(idx.data(), T, k, E, counts.data(), offsets.data(), r2c.data(), c2r.data());
    check_layout_contents(idx, T, k, E, counts, offsets, r2c, c2r);
  }
}

TEST_CASE("permute and unpermute backwards match finite differences", "[moe][permute][fd]") {
  for (auto [T, E, k, H] :
       {std::tuple{7, 5, 2, 3}, std::tuple{1, 1, 1, 1}, std::tuple{3, 8, 8, 5}, std::tuple{6, 4, 3, 7}}) {
    const Vec logits = random_doubles(T * E, 400 + uint64_t(T + E + k + H), 2.0);
    const Routed r = route(logits, T, E, k, true);
    const int64_t N = T * k;
    IVec counts(static_cast<std::size_t>(E)), offsets(static_cast<std::size_t>(E + 1)),
        r2c(static_cast<std::size_t>(N)), c2r(static_cast<std::size_t>(N));
    ops::cpu::moe_build_layout(r.indices.data(), T, k, E, counts.data(), offsets.data(), r2c.data(), c2r.data());
    Vec yg = random_doubles(N * H, 500 + uint64_t(N)), w = r.weights;
    const Vec R = random_doubles(T * H, 600 + uint64_t(T));
    auto f = [&] {
      Vec y(static_cast<std::size_t>(T * H));
      ops::cpu::moe_unpermute_forward(yg.data(), w.data(), c2r.data(), T, k, H, y.data());
      return dot(R, y);
    };
    Vec dyg(static_cast<std::size_t>(N * H)), dw(static_cast<std::size_t>(N));
    ops::cpu::moe_unpermute_backward(R.data(), yg.data(), w.data(), c2r.data(), T, k, H, dyg.data(), dw.data());
    INFO("T " << T << " E " << E << " k " << k << " H " << H);
    CHECK(rel_error(dyg, finite_diff(yg, f)) < 1e-9);
    CHECK(rel_error(dw, finite_diff(w, f)) < 1e-9);
    // permute's backward is its adjoint: <P x, g> = <x, Pᵀ g>.
    const Vec x = random_doubles(T * H, 700), g = random_doubles(N * H, 701);
    Vec px(static_cast<std::size_t>(N * H)), ptg(static_cast<std::size_t>(T * H));
    ops::cpu::moe_permute_forward(x.data(), r2c.data(), T, k, H, px.data());
    ops::cpu::moe_permute_backward(g.data(), c2r.data(), T, k, H, ptg.data());
    CHECK(std::fabs(dot(px, g) - dot(x, ptg)) < 1e-12 * (1 + std::fabs(dot(px, g))));
    // and the unpermute with weights 1 is the permute's backward.
    Vec ones(static_cast<std::size_t>(N), 1.0), up(static_cast<std::size_t>(T * H));
    ops::cpu::moe_unpermute_forward(g.data(), ones.data(), c2r.data(), T, k, H, up.data());
    CHECK(rel_error(up, ptg) < 1e-15);
  }
}

TEST_CASE("grouped GEMM matches per-expert GEMMs and finite differences, empty groups included", "[moe][gemm][fd]") {
  // Group sizes with empty experts (first, middle, last).
  for (const IVec& sizes : {IVec{0, 3, 0, 5, 1, 0}, IVec{4}, IVec{0}, IVec{1, 1, 1}, IVec{0, 0, 7}}) {
    const int64_t E = int64_t(sizes.size()), K = 5, No = 3;
    IVec offsets(static_cast<std::size_t>(E + 1), 0);
    for (int64_t e = 0; e < E; ++e) offsets[std::size_t(e + 1)] = offsets[std::size_t(e)] + sizes[std::size_t(e)];
    const int64_t N = offsets[std::size_t(E)];
    Vec x = random_doubles(N * K, 800 + uint64_t(N)), w = random_doubles(E * No * K, 801 + uint64_t(E));
    const Vec R = random_doubles(N * No, 802);
    Vec y(static_cast<std::size_t>(N * No));
    ops::cpu::grouped_gemm_forward(x.data(), w.data(), offsets.data(), E, No, K, y.data());
    Vec want(y.size(), 0.0);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = offsets[std::size_t(e)]; r < offsets[std::size_t(e + 1)]; ++r)
        for (int64_t o = 0; o < No; ++o)
          for (int64_t i = 0; i < K; ++i)
            want[std::size_t(r * No + o)] += x[std::size_t(r * K + i)] * w[std::size_t((e * No + o) * K + i)];
    CHECK(rel_error(y, want) < 1e-15);
    auto f = [&] {
      Vec yy(static_cast<std::size_t>(N * No));
      ops::cpu::grouped_gemm_forward(x.data(), w.data(), offsets.data(), E, No, K, yy.data());
      return dot(R, yy);
    };
    Vec dx(static_cast<std::size_t>(N * K)), dw(static_cast<std::size_t>(E * No * K), 0.0);
    ops::cpu::grouped_gemm_backward_input(R.data(), w.data(), offsets.data(), E, No, K, dx.data());
    ops::cpu::grouped_gemm_backward_weight(R.data(), x.data(), offsets.data(), E, No, K, dw.data());
    CHECK(rel_error(dx, finite_diff(x, f)) < 1e-9);
    CHECK(rel_error(dw, finite_diff(w, f)) < 1e-9);
    for (int64_t e = 0; e < E; ++e)  // empty experts' gradients stay 0
      if (sizes[std::size_t(e)] == 0)
        for (int64_t i = 0; i < No * K; ++i) REQUIRE(dw[std::size_t(e * No * K + i)] == 0.0);
  }
}

TEST_CASE("MoE block forward matches a naive per-token loop", "[moe][block]") {
  struct Cfg {
    int64_t T, H, F, E, k;
  };
  for (bool norm : {false, true})
    for (const Cfg c : {Cfg{7, 6, 4, 4, 2}, Cfg{1, 5, 3, 1, 1}, Cfg{1, 9, 5, 8, 8}, Cfg{13, 7, 3, 8, 1},
                        Cfg{5, 3, 7, 9, 5}, Cfg{11, 10, 6, 16, 8}, Cfg{3, 1, 1, 2, 2}}) {
      for (int64_t k = 1; k <= std::min<int64_t>(8, c.E); ++k) {  // top-k from 1 to 8
        const Block b(c.T, c.H, c.F, c.E, k, norm, 1000 + uint64_t(c.T * 100 + c.E * 10 + k));
        const Saved s = block_forward(b);
        INFO("T " << c.T << " H " << c.H << " F " << c.F << " E " << c.E << " k " << k << " norm " << norm);
        CHECK(rel_error(s.y, naive_block(b)) < 1e-13);
        check_layout_contents(s.r.indices, b.T, b.k, b.E, s.counts, s.offsets, s.r2c, s.c2r);
      }
    }
}

TEST_CASE("MoE block backward matches finite differences", "[moe][block][fd]") {
  struct Cfg {
    int64_t T, H, F, E, k;
  };
  for (bool norm : {false, true})
    for (const Cfg c :
         {Cfg{5, 6, 4, 4, 2}, Cfg{1, 3, 2, 1, 1}, Cfg{3, 4, 3, 8, 8}, Cfg{6, 5, 3, 6, 1}, Cfg{4, 3, 5, 5, 3}}) {
      Block b(c.T, c.H, c.F, c.E, c.k, norm, 2000 + uint64_t(c.T * 100 + c.E * 10 + c.k));
      const Saved s = block_forward(b);
      const Grads d = block_backward(b, s);
      auto f = [&] {
        const Saved p = block_forward(b);
        REQUIRE(p.r.indices == s.r.indices);  // the perturbation keeps the top-k
        return p.loss;
      };
      INFO("T " << c.T << " H " << c.H << " F " << c.F << " E " << c.E << " k " << c.k << " norm " << norm);
      CHECK(rel_error(d.x, finite_diff(b.x, f)) < 1e-8);
      CHECK(rel_error(d.wr, finite_diff(b.wr, f)) < 1e-8);
      CHECK(rel_error(d.wg, finite_diff(b.wg, f)) < 1e-8);
      CHECK(rel_error(d.wu, finite_diff(b.wu, f)) < 1e-8);
      CHECK(rel_error(d.wd, finite_diff(b.wd, f)) < 1e-8);
    }
}

TEST_CASE("skewed routing sends every token to one expert, the others get none", "[moe][block]") {
  for (int64_t k : {1, 2, 3}) {
    Block b(9, 5, 4, 6, k, true, 3000 + uint64_t(k), 0.1);
    // A constant feature makes experts 4, then 1, then 2 win for every token.
    for (int64_t t = 0; t < b.T; ++t) b.x[std::size_t(t * b.H)] = 1.0;
    for (auto [e, bias] : {std::pair{4, 30.0}, std::pair{1, 20.0}, std::pair{2, 10.0}})
      b.wr[std::size_t(e * b.H)] = bias;
    const Saved s = block_forward(b);
    for (int64_t e = 0; e < b.E; ++e) {
      const bool used = e == 4 || (k >= 2 && e == 1) || (k >= 3 && e == 2);
      CHECK(s.counts[std::size_t(e)] == (used ? b.T : 0));
    }
    CHECK(rel_error(s.y, naive_block(b)) < 1e-13);
    const Grads d = block_backward(b, s);
    auto f = [&] { return block_forward(b).loss; };
    CHECK(rel_error(d.wd, finite_diff(b.wd, f)) < 1e-8);
    CHECK(rel_error(d.x, finite_diff(b.x, f)) < 1e-7);
  }
}

// ---- The Tensor API ---------------------------------------------------------

namespace {

// The block through the Tensor API in `dt` (f32 or bf16) with the fused
// gate_up weight [E, 2F, H] and swiglu_*_fused on the grouped rows; returns y
// and the parameter / input gradients (f32), the loss being Σ R ⊙ y + coef · aux.
struct ApiOut {
  Tensor y, probs, indices, weights, dx, dwr, dwgu, dwd;
  float aux = 0;
};

ApiOut api_block(const Block& b, DType dt) {
  const int64_t N = b.T * b.k;
  auto cast = [&](const Vec& v, const Shape& s) {
    Tensor f = f32_tensor(v, s);
    if (dt == DType::f32) return f;
    Tensor o = Tensor::empty(s, dt);
    ops::cast(f, o);
    return o;
  };
  // gate_up [E, 2F, H]: rows [0, F) gate, [F, 2F) up, per expert.
  Vec wgu(static_cast<std::size_t>(b.E * 2 * b.F * b.H));
  for (int64_t e = 0; e < b.E; ++e)
    for (int64_t i = 0; i < b.F * b.H; ++i) {
      wgu[std::size_t(e * 2 * b.F * b.H + i)] = b.wg[std::size_t(e * b.F * b.H + i)];
      wgu[std::size_t(e * 2 * b.F * b.H + b.F * b.H + i)] = b.wu[std::size_t(e * b.F * b.H + i)];
    }
  const Tensor x = cast(b.x, {b.T, b.H}), wr = cast(b.wr, {b.E, b.H}), w_gu = cast(wgu, {b.E, 2 * b.F, b.H}),
               wd = cast(b.wd, {b.E, b.H, b.F}), R = cast(b.R, {b.T, b.H});
  ApiOut o;
  const Tensor logits = Tensor::empty({b.T, b.E}, dt);
  ops::linear_forward(x, wr, logits);
  o.probs = Tensor::empty({b.T, b.E}, DType::f32);
  o.indices = Tensor::empty({b.T, b.k}, DType::i32);
  o.weights = Tensor::empty({b.T, b.k}, dt);
  ops::router_forward(logits, b.norm, o.probs, o.indices, o.weights);
  const Tensor aux = Tensor::empty({1}, DType::f32);
  ops::router_aux_loss_forward(o.probs, o.indices, aux);
  o.aux = *aux.data<float>();
  const ops::MoeLayout layout = ops::moe_make_layout(o.indices, b.E);
  const Tensor xg = Tensor::empty({N, b.H}, dt), gu = Tensor::empty({N, 2 * b.F}, dt), h = Tensor::empty({N, b.F}, dt),
               yg = Tensor::empty({N, b.H}, dt);
  ops::moe_permute_forward(x, layout, xg);
  ops::grouped_gemm_forward(xg, w_gu, layout.offsets, gu);
  ops::swiglu_forward_fused(gu, h);  // the existing SwiGLU on the grouped rows
  ops::grouped_gemm_forward(h, wd, layout.offsets, yg);
  o.y = Tensor::empty({b.T, b.H}, DType::f32);
  ops::moe_unpermute_forward(yg, o.weights, layout, o.y);
  // Backward.
  const Tensor dyg = Tensor::empty({N, b.H}, dt), dwts = Tensor::empty({b.T, b.k}, dt),
               dh = Tensor::empty({N, b.F}, dt), dgu = Tensor::empty({N, 2 * b.F}, dt),
               dxg = Tensor::empty({N, b.H}, dt), dlogits = Tensor::empty({b.T, b.E}, DType::f32);
  ops::moe_unpermute_backward(R, yg, o.weights, layout, dyg, dwts);
  o.dwd = Tensor::zeros({b.E, b.H, b.F}, DType::f32);
  o.dwgu = Tensor::zeros({b.E, 2 * b.F, b.H}, DType::f32);
  o.dwr = Tensor::zeros({b.E, b.H}, DType::f32);
  ops::grouped_gemm_backward_input(dyg, wd, layout.offsets, dh);
  ops::grouped_gemm_backward_weight(dyg, h, layout.offsets, o.dwd);
  ops::swiglu_backward_fused(gu, dh, dgu);
  ops::grouped_gemm_backward_input(dgu, w_gu, layout.offsets, dxg);
  ops::grouped_gemm_backward_weight(dgu, xg, layout.offsets, o.dwgu);
  o.dx = Tensor::empty({b.T, b.H}, DType::f32);
  ops::moe_permute_backward(dxg, layout, o.dx);
  ops::router_backward(o.probs, o.indices, dwts, b.norm, dlogits);
  ops::router_aux_loss_backward(o.probs, o.indices, float(b.aux_coef), dlogits, true);
  const Tensor dlogits_dt = cast(to_double(dlogits), {b.T, b.E});
  const Tensor dx_router = Tensor::empty({b.T, b.H}, DType::f32);
  ops::linear_backward_input(dlogits_dt, wr, dx_router);
  ops::add(o.dx, dx_router, o.dx);
  ops::linear_backward_weight(dlogits_dt, x, o.dwr);
  return o;
}

}  // namespace

TEST_CASE("Tensor API runs the MoE block like the double templates", "[moe][api]") {
  for (bool norm : {false, true})
    for (auto [T, H, F, E, k] : {std::tuple{9, 6, 4, 5, 2}, std::tuple{1, 3, 3, 1, 1}, std::tuple{6, 7, 5, 8, 8},
                                 std::tuple{17, 8, 6, 12, 3}}) {
      const Block b(T, H, F, E, k, norm, 4000 + uint64_t(T * 10 + E + k));
      const Saved s = block_forward(b);
      const Grads d = block_backward(b, s);
      Vec dwgu(static_cast<std::size_t>(E * 2 * F * H));
      for (int64_t e = 0; e < E; ++e)
        for (int64_t i = 0; i < F * H; ++i) {
          dwgu[std::size_t(e * 2 * F * H + i)] = d.wg[std::size_t(e * F * H + i)];
          dwgu[std::size_t(e * 2 * F * H + F * H + i)] = d.wu[std::size_t(e * F * H + i)];
        }
      const double aux = ops::cpu::router_aux_loss_forward(s.r.probs.data(), s.r.indices.data(), T, E, k);
      INFO("T " << T << " E " << E << " k " << k << " norm " << norm);
      // f32: fp32 sums of O(10) terms, rounded at each op boundary: ≤ 1e-5.
      const ApiOut o = api_block(b, DType::f32);
      CHECK(o.indices.to_vector<int32_t>() == s.r.indices);
      CHECK(rel_error(to_double(o.probs), s.r.probs) < 1e-6);
      CHECK(rel_error(to_double(o.weights), s.r.weights) < 1e-6);
      CHECK(std::fabs(o.aux - aux) < 1e-5 * aux);
      CHECK(rel_error(to_double(o.y), s.y) < 1e-5);
      CHECK(rel_error(to_double(o.dx), d.x) < 1e-5);
      CHECK(rel_error(to_double(o.dwr), d.wr) < 1e-5);
      CHECK(rel_error(to_double(o.dwgu), dwgu) < 1e-5);
      CHECK(rel_error(to_double(o.dwd), d.wd) < 1e-5);
      // bf16: inputs and every intermediate rounded to bf16 (2^-9 relative each,
      // a handful in a row): ≤ 3e-2. Top-k can flip on near ties after rounding,
      // so compare only when the selection is the same.
      const ApiOut ob = api_block(b, DType::bf16);
      if (ob.indices.to_vector<int32_t>() == s.r.indices) {
        CHECK(rel_error(to_double(ob.y), s.y) < 3e-2);
        CHECK(rel_error(to_double(ob.dwd), d.wd) < 3e-2);
        CHECK(rel_error(to_double(ob.dwgu), dwgu) < 3e-2);
      }
    }
}

TEST_CASE("MoE ops are deterministic", "[moe][api]") {
  const Block b(23, 9, 5, 7, 3, true, 5000);
  const ApiOut a = api_block(b, DType::f32), c = api_block(b, DType::f32);
  auto same = [](const Tensor& x, const Tensor& y) {
    return x.nbytes() == y.nbytes() && (x.nbytes() == 0 || std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0);
  };
  CHECK(same(a.y, c.y));
  CHECK(same(a.dx, c.dx));
  CHECK(same(a.dwr, c.dwr));
  CHECK(same(a.dwgu, c.dwgu));
  CHECK(same(a.dwd, c.dwd));
  CHECK(same(a.indices, c.indices));
  CHECK(a.aux == c.aux);
}

TEST_CASE("MoE ops reject bad input with clear errors", "[moe][errors]") {
  const Tensor logits = f32_tensor(random_doubles(12, 1), {4, 3});
  const Tensor probs = Tensor::empty({4, 3}, DType::f32);
  // k > E.
  CHECK_THROWS_WITH(
      ops::router_forward(logits, false, probs, Tensor::empty({4, 4}, DType::i32), Tensor::empty({4, 4}, DType::f32)),
      ContainsSubstring("k = 4") && ContainsSubstring("num_experts = 3"));
  CHECK_THROWS_WITH(ops::moe_make_layout(Tensor::zeros({4, 4}, DType::i32), 3), ContainsSubstring("k = 4"));
  // Mismatched shapes and dtypes.
  CHECK_THROWS_WITH(ops::router_forward(logits, false, Tensor::empty({4, 2}, DType::f32),
                                        Tensor::empty({4, 2}, DType::i32), Tensor::empty({4, 2}, DType::f32)),
                    ContainsSubstring("probs must have shape"));
  CHECK_THROWS_WITH(
      ops::router_forward(logits, false, probs, Tensor::empty({4, 2}, DType::i64), Tensor::empty({4, 2}, DType::f32)),
      ContainsSubstring("indices must be i32"));
  CHECK_THROWS_WITH(
      ops::router_forward(logits, false, probs, Tensor::empty({4, 2}, DType::i32), Tensor::empty({4, 3}, DType::f32)),
      ContainsSubstring("weights must have shape"));
  CHECK_THROWS_WITH(
      ops::router_aux_loss_forward(probs, Tensor::zeros({4, 2}, DType::i32), Tensor::empty({2}, DType::f32)),
      ContainsSubstring("loss must be an f32 tensor of one element"));
  // Expert ids out of range.
  const Tensor bad_ids = Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 3}, {2, 2});
  CHECK_THROWS_WITH(ops::moe_make_layout(bad_ids, 3), ContainsSubstring("indices[1, 1] = 3 is not an expert id"));
  CHECK_THROWS_WITH(ops::router_backward(Tensor::zeros({2, 3}, DType::f32), bad_ids, Tensor::zeros({2, 2}, DType::f32),
                                         false, Tensor::empty({2, 3}, DType::f32)),
                    ContainsSubstring("is not an expert id"));
  const Tensor neg_ids = Tensor::from_vector(std::vector<int32_t>{0, -1}, {1, 2});
  CHECK_THROWS_WITH(
      ops::router_aux_loss_forward(Tensor::zeros({1, 3}, DType::f32), neg_ids, Tensor::empty({1}, DType::f32)),
      ContainsSubstring("indices[0, 1] = -1"));
  // A hand-made layout that is inconsistent.
  const Tensor good_ids = Tensor::from_vector(std::vector<int32_t>{2, 0, 1, 2}, {2, 2});
  ops::MoeLayout l = ops::moe_make_layout(good_ids, 3);
  const Tensor x = f32_tensor(random_doubles(10, 2), {2, 5}), xg = Tensor::empty({4, 5}, DType::f32);
  ops::moe_permute_forward(x, l, xg);  // fine as built
  {
    ops::MoeLayout m = l;
    m.offsets = l.offsets.clone();
    m.offsets.data<int32_t>()[3] = 5;
    CHECK_THROWS_WITH(ops::moe_permute_forward(x, m, xg), ContainsSubstring("layout.offsets[3]"));
    m = l;
    m.row_to_copy = l.row_to_copy.clone();
    m.row_to_copy.data<int32_t>()[0] = 7;
    CHECK_THROWS_WITH(ops::moe_permute_forward(x, m, xg), ContainsSubstring("layout.row_to_copy[0] = 7"));
    m = l;
    m.counts = Tensor::zeros({2}, DType::i32);
    CHECK_THROWS_WITH(ops::moe_permute_forward(x, m, xg), ContainsSubstring("layout.counts must be i32 [3]"));
  }
  CHECK_THROWS_WITH(ops::moe_permute_forward(x, l, Tensor::empty({3, 5}, DType::f32)),
                    ContainsSubstring("x_grouped must have shape [4, 5]"));
  CHECK_THROWS_WITH(
      ops::moe_unpermute_forward(xg, Tensor::empty({2, 3}, DType::f32), l, Tensor::empty({2, 5}, DType::f32)),
      ContainsSubstring("weights must have shape [2, 2]"));
  CHECK_THROWS_WITH(
      ops::moe_unpermute_forward(xg, Tensor::empty({2, 2}, DType::f32), l, Tensor::empty({2, 5}, DType::bf16)),
      ContainsSubstring("y must be y_grouped's dtype or f32"));
  // Grouped GEMM: shapes and offsets.
  const Tensor w = f32_tensor(random_doubles(3 * 4 * 5, 3), {3, 4, 5});
  CHECK_THROWS_WITH(ops::grouped_gemm_forward(xg, w, l.offsets, Tensor::empty({4, 5}, DType::f32)),
                    ContainsSubstring("y must have shape [4, 4]"));
  CHECK_THROWS_WITH(
      ops::grouped_gemm_forward(Tensor::empty({4, 6}, DType::f32), w, l.offsets, Tensor::empty({4, 4}, DType::f32)),
      ContainsSubstring("x must have shape [rows, 5]"));
  CHECK_THROWS_WITH(ops::grouped_gemm_forward(xg, w, Tensor::from_vector(std::vector<int32_t>{0, 1, 3, 3}, {4}),
                                              Tensor::empty({4, 4}, DType::f32)),
                    ContainsSubstring("offsets[3] = 3, expected the row count 4"));
  CHECK_THROWS_WITH(ops::grouped_gemm_forward(xg, w, Tensor::from_vector(std::vector<int32_t>{0, 3, 1, 4}, {4}),
                                              Tensor::empty({4, 4}, DType::f32)),
                    ContainsSubstring("non-decreasing"));
  CHECK_THROWS_WITH(ops::grouped_gemm_forward(xg, w, Tensor::zeros({3}, DType::i32), Tensor::empty({4, 4}, DType::f32)),
                    ContainsSubstring("offsets must be i32 [experts + 1 = 4]"));
  CHECK_THROWS_WITH(ops::grouped_gemm_backward_weight(Tensor::empty({4, 4}, DType::f32), xg, l.offsets,
                                                      Tensor::zeros({3, 4, 5}, DType::bf16)),
                    ContainsSubstring("dw must be f32"));
  CHECK_THROWS_WITH(ops::grouped_gemm_backward_input(Tensor::empty({4, 3}, DType::f32), w, l.offsets,
                                                     Tensor::empty({4, 5}, DType::f32)),
                    ContainsSubstring("dy must have shape [rows, 4]"));
}
