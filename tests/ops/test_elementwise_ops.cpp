// CPU tests of the memory-bound op families: embedding, rms_norm, rope,
// swiglu, elementwise. Every backward is checked against central finite
// differences in double precision through the CPU templates; the Tensor API
// is checked against the templates; bad input must throw clear errors.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

#include "slime/core/random.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/ops/embedding.hpp"
#include "slime/ops/rms_norm.hpp"
#include "slime/ops/rope.hpp"
#include "slime/ops/swiglu.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;

namespace {

std::vector<double> normals(std::size_t n, uint64_t seed, double scale = 1.0) {
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * double(random_normal(seed, i));
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  return std::inner_product(a.begin(), a.end(), b.begin(), 0.0);
}

// ||a - b|| / ||b||
double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// Central differences of loss() with respect to every entry of p.
template <class F>
std::vector<double> numeric_grad(std::vector<double>& p, F&& loss, double h = 1e-6) {
  std::vector<double> g(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    const double saved = p[i];
    p[i] = saved + h;
    const double up = loss();
    p[i] = saved - h;
    const double down = loss();
    p[i] = saved;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

constexpr double kFdTol = 1e-7;  // central differences in double: truncation ~h^2, roundoff ~1e-16 / h

template <class T>
Tensor filled(const Shape& shape, uint64_t seed, float stddev = 1.f) {
  Tensor t = Tensor::empty(shape, dtype_of<T>);
  fill_normal(t, seed, 0, 0.f, stddev);
  return t;
}

template <class T>
bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && (a.nbytes() == 0 || std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0);
}

}  // namespace

// ---------------------------------------------------------------- embedding

TEST_CASE("embedding backward matches finite differences w.r.t. the table (double)", "[ops][embedding]") {
  const int64_t vocab = 7, dim = 5, tokens = 12;
  const std::vector<int64_t> ids = {3, 0, 3, 6, 1, 3, 0, 5, 6, 6, 2, 3};  // duplicates; id 4 unused
  std::vector<double> table = normals(static_cast<std::size_t>(vocab * dim), 1);
  const std::vector<double> r = normals(static_cast<std::size_t>(tokens * dim), 2);  // loss = sum(r * y)
  auto loss = [&] {
    std::vector<double> y(static_cast<std::size_t>(tokens * dim));
    ops::cpu::embedding_forward(ids.data(), table.data(), tokens, vocab, dim, y.data());
    return dot(r, y);
  };
  const std::vector<double> fd = numeric_grad(table, loss);

  // Accumulates: start from g0 and subtract it afterwards.
  const std::vector<double> g0 = normals(static_cast<std::size_t>(vocab * dim), 3);
  std::vector<double> g = g0;
  ops::cpu::embedding_backward(ids.data(), r.data(), tokens, vocab, dim, g.data());
  for (std::size_t i = 0; i < g.size(); ++i) g[i] -= g0[i];
  CHECK(rel_err(g, fd) < kFdTol);
  for (int64_t d = 0; d < dim; ++d) CHECK(g[std::size_t(4 * dim + d)] == 0.0);  // unused row untouched
}

TEST_CASE("embedding backward sums each id's rows from zero in token order", "[ops][embedding]") {
  // The order the GPU kernel follows too; f32 results must match bit for bit.
  const int64_t vocab = 5, dim = 3, tokens = 9;
  const std::vector<int32_t> ids = {4, 1, 4, 4, 0, 1, 4, 2, 4};
  Tensor dy = filled<float>({tokens, dim}, 11, 3.f);
  Tensor g = filled<float>({vocab, dim}, 12);
  std::vector<float> expect = g.to_vector<float>();
  const float* pdy = dy.data<float>();
  for (int64_t v = 0; v < vocab; ++v) {
    for (int64_t d = 0; d < dim; ++d) {
      float acc = 0.f;
      bool any = false;
      for (int64_t t = 0; t < tokens; ++t)
        if (ids[std::size_t(t)] == v) {
          acc += pdy[t * dim + d];
          any = true;
        }
      if (any) expect[std::size_t(v * dim + d)] += acc;
    }
  }
  ops::embedding_backward(Tensor::from_vector(ids, {tokens}), dy, g, Tensor{});
  const std::vector<float> got = g.to_vector<float>();
  CHECK(std::memcmp(got.data(), expect.data(), got.size() * sizeof(float)) == 0);
}

TEST_CASE("embedding Tensor API equals the templates for i32/i64 ids and f32/bf16 tables", "[ops][embedding]") {
  const int64_t vocab = 11, dim = 13, tokens = 17;
  std::vector<int64_t> ids64(tokens);
  for (int64_t t = 0; t < tokens; ++t) ids64[std::size_t(t)] = (t * 7 + 3) % vocab;
  std::vector<int32_t> ids32(ids64.begin(), ids64.end());
  for (DType id_dtype : {DType::i32, DType::i64}) {
    const Tensor ids =
        id_dtype == DType::i32 ? Tensor::from_vector(ids32, {tokens}) : Tensor::from_vector(ids64, {tokens});
    for (DType dt : {DType::f32, DType::bf16}) {
      ops::detail::memops::visit_f32_bf16(dt, [&](auto tag) {
        using T = decltype(tag);
        Tensor table = filled<T>({vocab, dim}, 21);
        Tensor y = Tensor::empty({tokens, dim}, dt);
        y.fill_bytes_(0xff);
        ops::embedding_forward(ids, table, y);
        std::vector<T> ref(static_cast<std::size_t>(tokens * dim));
        ops::cpu::embedding_forward(ids64.data(), table.data<T>(), tokens, vocab, dim, ref.data());
        CHECK(std::memcmp(y.data_ptr(), ref.data(), y.nbytes()) == 0);

        Tensor dy = filled<T>({tokens, dim}, 22);
        Tensor g = filled<float>({vocab, dim}, 23);
        std::vector<float> gref = g.to_vector<float>();
        ops::embedding_backward(ids, dy, g, Tensor{});
        ops::cpu::embedding_backward(ids32.data(), dy.data<T>(), tokens, vocab, dim, gref.data());
        CHECK(std::memcmp(g.data_ptr(), gref.data(), g.nbytes()) == 0);
      });
    }
  }
}

TEST_CASE("embedding rejects out-of-range ids, naming the position and the id", "[ops][embedding]") {
  const int64_t vocab = 5, dim = 4;
  Tensor table = filled<float>({vocab, dim}, 31);
  Tensor y = Tensor::empty({4, dim}, DType::f32);
  Tensor g = Tensor::zeros({vocab, dim}, DType::f32);
  Tensor dy = filled<float>({4, dim}, 32);
  const Tensor high = Tensor::from_vector(std::vector<int32_t>{0, 3, 5, 1}, {4});
  const Tensor low = Tensor::from_vector(std::vector<int64_t>{0, -1, 2, 1}, {4});
  CHECK_THROWS_WITH(ops::embedding_forward(high, table, y), ContainsSubstring("ids[2] = 5 is outside [0, 5)"));
  CHECK_THROWS_WITH(ops::embedding_forward(low, table, y), ContainsSubstring("ids[1] = -1 is outside [0, 5)"));
  CHECK_THROWS_WITH(ops::embedding_backward(high, dy, g, Tensor{}), ContainsSubstring("ids[2] = 5"));
  CHECK_THROWS_WITH(ops::embedding_check_ids(low, vocab), ContainsSubstring("ids[1] = -1"));
  CHECK_NOTHROW(ops::embedding_check_ids(high, 6));
  // The backward validates before touching dtable.
  for (float v : g.to_vector<float>()) CHECK(v == 0.f);
}

TEST_CASE("embedding rejects bad dtypes and shapes", "[ops][embedding]") {
  Tensor table = filled<float>({5, 4}, 41);
  const Tensor ids = Tensor::from_vector(std::vector<int32_t>{0, 1, 2}, {3});
  CHECK_THROWS_WITH(ops::embedding_forward(Tensor::zeros({3}, DType::f32), table, Tensor::empty({3, 4}, DType::f32)),
                    ContainsSubstring("ids must be i32 or i64"));
  CHECK_THROWS_WITH(ops::embedding_forward(ids, table, Tensor::empty({3, 5}, DType::f32)),
                    ContainsSubstring("y must have shape (3, 4)"));
  CHECK_THROWS_WITH(ops::embedding_forward(ids, table, Tensor::empty({3, 4}, DType::bf16)),
                    ContainsSubstring("y must be f32"));
  CHECK_THROWS_WITH(ops::embedding_forward(ids, Tensor::zeros({5, 4}, DType::f16), Tensor::empty({3, 4}, DType::f16)),
                    ContainsSubstring("table must be f32 or bf16"));
  CHECK_THROWS_WITH(
      ops::embedding_backward(ids, Tensor::zeros({3, 4}, DType::f32), Tensor::zeros({5, 4}, DType::bf16), Tensor{}),
      ContainsSubstring("dtable must be f32"));
  CHECK_THROWS_WITH(
      ops::embedding_backward(ids, Tensor::zeros({2, 4}, DType::f32), Tensor::zeros({5, 4}, DType::f32), Tensor{}),
      ContainsSubstring("dy must have shape (3, 4)"));
  CHECK(ops::embedding_backward_workspace_bytes(0) == 0);
}

// ---------------------------------------------------------------- rms_norm

TEST_CASE("rms_norm backward matches finite differences w.r.t. x and w (double)", "[ops][rms_norm]") {
  const int64_t rows = 4, dim = 7;
  const double eps = 1e-5;
  std::vector<double> x = normals(static_cast<std::size_t>(rows * dim), 51);
  std::vector<double> w = normals(static_cast<std::size_t>(dim), 52, 0.5);
  for (double& v : w) v += 1.0;
  const std::vector<double> r = normals(static_cast<std::size_t>(rows * dim), 53);
  auto loss = [&] {
    std::vector<double> y(x.size()), rstd(static_cast<std::size_t>(rows));
    ops::cpu::rms_norm_forward(x.data(), w.data(), rows, dim, eps, y.data(), rstd.data());
    return dot(r, y);
  };
  const std::vector<double> fd_x = numeric_grad(x, loss);
  const std::vector<double> fd_w = numeric_grad(w, loss);

  std::vector<double> y(x.size()), rstd(static_cast<std::size_t>(rows)), dx(x.size(), 99.0);
  ops::cpu::rms_norm_forward(x.data(), w.data(), rows, dim, eps, y.data(), rstd.data());
  const std::vector<double> dw0 = normals(static_cast<std::size_t>(dim), 54);
  std::vector<double> dw = dw0;
  ops::cpu::rms_norm_backward(x.data(), w.data(), rstd.data(), r.data(), rows, dim, dx.data(), dw.data());
  for (std::size_t i = 0; i < dw.size(); ++i) dw[i] -= dw0[i];  // accumulated
  CHECK(rel_err(dx, fd_x) < kFdTol);
  CHECK(rel_err(dw, fd_w) < kFdTol);
  // rstd is what it says.
  double ss = 0;
  for (int64_t d = 0; d < dim; ++d) ss += x[std::size_t(d)] * x[std::size_t(d)];
  CHECK(std::abs(rstd[0] - 1.0 / std::sqrt(ss / double(dim) + eps)) < 1e-14);
}

TEST_CASE("rms_norm Tensor API equals the templates for every activation and weight dtype", "[ops][rms_norm]") {
  const int64_t rows = 5, dim = 33;
  const float eps = 1e-6f;
  for (DType xt : {DType::f32, DType::bf16}) {
    for (DType wt : {DType::f32, DType::bf16}) {
      ops::detail::memops::visit_act_weight(xt, wt, [&](auto act_tag, auto weight_tag) {
        using T = decltype(act_tag);
        using W = decltype(weight_tag);
        Tensor x = filled<T>({rows, dim}, 61, 2.f), w = filled<W>({dim}, 62), dy = filled<T>({rows, dim}, 63);
        Tensor y = Tensor::empty({rows, dim}, xt), rstd = Tensor::empty({rows}, DType::f32);
        ops::rms_norm_forward(x, w, eps, y, rstd);
        std::vector<T> yref(static_cast<std::size_t>(rows * dim));
        std::vector<float> rref(static_cast<std::size_t>(rows));
        ops::cpu::rms_norm_forward(x.data<T>(), w.data<W>(), rows, dim, eps, yref.data(), rref.data());
        CHECK(std::memcmp(y.data_ptr(), yref.data(), y.nbytes()) == 0);
        CHECK(std::memcmp(rstd.data_ptr(), rref.data(), rstd.nbytes()) == 0);

        Tensor dx = Tensor::empty({rows, dim}, xt), dw = filled<float>({dim}, 64);
        std::vector<T> dxref(static_cast<std::size_t>(rows * dim));
        std::vector<float> dwref = dw.to_vector<float>();
        ops::rms_norm_backward(x, w, rstd, dy, dx, dw, Tensor{});
        ops::cpu::rms_norm_backward(x.data<T>(), w.data<W>(), rref.data(), dy.data<T>(), rows, dim, dxref.data(),
                                    dwref.data());
        CHECK(std::memcmp(dx.data_ptr(), dxref.data(), dx.nbytes()) == 0);
        CHECK(std::memcmp(dw.data_ptr(), dwref.data(), dw.nbytes()) == 0);
      });
    }
  }
}

TEST_CASE("rms_norm per head (Qwen3 q_norm / k_norm): [tokens, heads, head_dim] with weight [head_dim]",
          "[ops][rms_norm]") {
  const int64_t tokens = 6, heads = 3, head_dim = 8;
  Tensor q = filled<BFloat16>({tokens, heads, head_dim}, 71, 3.f);
  Tensor w = filled<BFloat16>({head_dim}, 72);
  Tensor y3 = Tensor::empty(q.shape(), DType::bf16), rstd3 = Tensor::empty({tokens, heads}, DType::f32);
  ops::rms_norm_forward(q, w, 1e-6f, y3, rstd3);
  // The same op on the [tokens * heads, head_dim] view.
  Tensor y2 = Tensor::empty({tokens * heads, head_dim}, DType::bf16),
         rstd2 = Tensor::empty({tokens * heads}, DType::f32);
  ops::rms_norm_forward(q.reshape({tokens * heads, head_dim}), w, 1e-6f, y2, rstd2);
  CHECK(same_bits<BFloat16>(y3, y2));
  CHECK(same_bits<float>(rstd3, rstd2));
  // Each head normalised on its own: one head, one row.
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t row = t * heads + h;
      std::vector<BFloat16> one(static_cast<std::size_t>(head_dim));
      float rs = 0.f;
      ops::cpu::rms_norm_forward(q.data<BFloat16>() + row * head_dim, w.data<BFloat16>(), 1, head_dim, 1e-6, one.data(),
                                 &rs);
      CHECK(std::memcmp(one.data(), y3.data<BFloat16>() + row * head_dim, std::size_t(head_dim) * 2) == 0);
      CHECK(rs == rstd3.data<float>()[row]);
    }
  }
  // Backward per head: dweight sums over tokens and heads.
  Tensor dy = filled<BFloat16>(q.shape(), 73);
  Tensor dx = Tensor::empty(q.shape(), DType::bf16), dw = Tensor::zeros({head_dim}, DType::f32);
  ops::rms_norm_backward(q, w, rstd3, dy, dx, dw, Tensor{});
  std::vector<BFloat16> dxref(static_cast<std::size_t>(q.numel()));
  std::vector<float> dwref(static_cast<std::size_t>(head_dim), 0.f);
  ops::cpu::rms_norm_backward(q.data<BFloat16>(), w.data<BFloat16>(), rstd3.data<float>(), dy.data<BFloat16>(),
                              tokens * heads, head_dim, dxref.data(), dwref.data());
  CHECK(std::memcmp(dx.data_ptr(), dxref.data(), dx.nbytes()) == 0);
  CHECK(std::memcmp(dw.data_ptr(), dwref.data(), dw.nbytes()) == 0);
}

TEST_CASE("rms_norm in place (y = x, dx = dy) gives the out-of-place result", "[ops][rms_norm]") {
  Tensor x = filled<float>({4, 9}, 81), w = filled<float>({9}, 82), dy = filled<float>({4, 9}, 83);
  Tensor y = Tensor::empty({4, 9}, DType::f32), rstd = Tensor::empty({4}, DType::f32);
  ops::rms_norm_forward(x, w, 1e-6f, y, rstd);
  Tensor dx = Tensor::empty({4, 9}, DType::f32), dw = Tensor::zeros({9}, DType::f32);
  ops::rms_norm_backward(x, w, rstd, dy, dx, dw, Tensor{});
  Tensor dw2 = Tensor::zeros({9}, DType::f32);
  Tensor dy2 = dy.clone();
  ops::rms_norm_backward(x, w, rstd, dy2, dy2, dw2, Tensor{});
  CHECK(same_bits<float>(dy2, dx));
  CHECK(same_bits<float>(dw2, dw));
  Tensor x2 = x.clone();
  ops::rms_norm_forward(x2, w, 1e-6f, x2, rstd);
  CHECK(same_bits<float>(x2, y));
}

TEST_CASE("rms_norm rejects bad shapes, dtypes and overlaps", "[ops][rms_norm]") {
  Tensor x = filled<float>({4, 8}, 91), w = filled<float>({8}, 92);
  Tensor y = Tensor::empty({4, 8}, DType::f32), rstd = Tensor::empty({4}, DType::f32);
  CHECK_THROWS_WITH(ops::rms_norm_forward(x, Tensor::zeros({7}, DType::f32), 1e-6f, y, rstd),
                    ContainsSubstring("weight must have shape (8,)"));
  CHECK_THROWS_WITH(ops::rms_norm_forward(x, w, 1e-6f, y, Tensor::empty({3}, DType::f32)),
                    ContainsSubstring("rstd must have 4 elements"));
  CHECK_THROWS_WITH(ops::rms_norm_forward(x, w, 1e-6f, y, Tensor::empty({4}, DType::bf16)),
                    ContainsSubstring("rstd must be f32"));
  CHECK_THROWS_WITH(ops::rms_norm_forward(x, w, 1e-6f, Tensor::empty({4, 8}, DType::bf16), rstd),
                    ContainsSubstring("y must be f32"));
  CHECK_THROWS_WITH(ops::rms_norm_forward(Tensor::zeros({4, 8}, DType::f16), w, 1e-6f, y, rstd),
                    ContainsSubstring("x must be f32 or bf16"));
  CHECK_THROWS_WITH(ops::rms_norm_forward(x, w, 1e-6f, Tensor::empty({4, 7}, DType::f32), rstd),
                    ContainsSubstring("y must have shape (4, 8)"));
  Tensor big = Tensor::empty({40}, DType::f32);
  CHECK_THROWS_WITH(ops::rms_norm_forward(big.view(0, {4, 8}), w, 1e-6f, big.view(1, {4, 8}), rstd),
                    ContainsSubstring("overlaps"));
  Tensor dx = Tensor::empty({4, 8}, DType::f32);
  CHECK_THROWS_WITH(ops::rms_norm_backward(x, w, rstd, y, dx, Tensor::zeros({8}, DType::bf16), Tensor{}),
                    ContainsSubstring("dweight must be f32"));
  CHECK_THROWS_WITH(ops::rms_norm_backward(x, w, rstd, Tensor::zeros({4, 9}, DType::f32), dx,
                                           Tensor::zeros({8}, DType::f32), Tensor{}),
                    ContainsSubstring("dy must have shape (4, 8)"));
}

// ---------------------------------------------------------------- rope

TEST_CASE("rope backward matches finite differences and inverts the forward (double)", "[ops][rope]") {
  const int64_t tokens = 5, heads = 2, head_dim = 6;
  const std::vector<int32_t> pos = {0, 1, 7, 0, 3};
  const double theta = 10000.0;
  std::vector<double> x = normals(static_cast<std::size_t>(tokens * heads * head_dim), 101);
  const std::vector<double> r = normals(x.size(), 102);
  auto loss = [&] {
    std::vector<double> y(x.size());
    ops::cpu::rope_forward(x.data(), pos.data(), tokens, heads, head_dim, theta, y.data());
    return dot(r, y);
  };
  const std::vector<double> fd = numeric_grad(x, loss);
  std::vector<double> dx(x.size(), 99.0);
  ops::cpu::rope_backward(r.data(), pos.data(), tokens, heads, head_dim, theta, dx.data());
  CHECK(rel_err(dx, fd) < kFdTol);

  std::vector<double> y(x.size()), back(x.size());
  ops::cpu::rope_forward(x.data(), pos.data(), tokens, heads, head_dim, theta, y.data());
  ops::cpu::rope_backward(y.data(), pos.data(), tokens, heads, head_dim, theta, back.data());
  CHECK(rel_err(back, x) < 1e-14);
  // Position 0 is the identity.
  for (int64_t i = 0; i < heads * head_dim; ++i) CHECK(y[std::size_t(i)] == x[std::size_t(i)]);
}

TEST_CASE("rope follows HF apply_rotary_pos_emb (rotate_half) in fp32", "[ops][rope]") {
  // HF: inv_freq = 1 / theta ** (arange(0, d, 2).float() / d); freqs = pos * inv_freq;
  // emb = cat(freqs, freqs); q * emb.cos() + rotate_half(q) * emb.sin(),
  // rotate_half(q) = cat(-q[d/2:], q[:d/2]).
  const int64_t tokens = 3, heads = 2, head_dim = 128;
  const double theta = 1000000.0;  // Qwen3's rope_theta
  const std::vector<int32_t> pos = {0, 5, 40000};
  Tensor q = filled<float>({tokens, heads, head_dim}, 111);
  Tensor y = Tensor::empty(q.shape(), DType::f32);
  const Tensor positions = Tensor::from_vector(pos, {tokens});
  ops::rope_forward(q, Tensor{}, positions, theta, y, Tensor{});
  std::vector<double> got, want;
  const float* pq = q.data<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* x = pq + (t * heads + h) * head_dim;
      for (int64_t j = 0; j < head_dim; ++j) {
        const int64_t i = j % (head_dim / 2);
        const float inv_freq = 1.0f / std::pow(float(theta), float(2 * i) / float(head_dim));
        const float angle = float(pos[std::size_t(t)]) * inv_freq;
        const float rot = j < head_dim / 2 ? -x[j + head_dim / 2] : x[j - head_dim / 2];
        want.push_back(double(x[j] * std::cos(angle) + rot * std::sin(angle)));
        got.push_back(double(y.data<float>()[(t * heads + h) * head_dim + j]));
      }
    }
  }
  CHECK(rel_err(got, want) < 1e-6);
  // theta matters.
  Tensor y2 = Tensor::empty(q.shape(), DType::f32);
  ops::rope_forward(q, Tensor{}, positions, 10000.0, y2, Tensor{});
  CHECK_FALSE(same_bits<float>(y, y2));
}

TEST_CASE("rope positions restart at 0 for every packed sequence", "[ops][rope]") {
  const std::vector<int32_t> cu = {0, 3, 3, 7, 8};  // lengths 3, 0, 4, 1
  Tensor positions = Tensor::empty({8}, DType::i32);
  ops::positions_from_cu_seqlens(Tensor::from_vector(cu, {5}), positions);
  CHECK(positions.to_vector<int32_t>() == std::vector<int32_t>{0, 1, 2, 0, 1, 2, 3, 0});

  // A packed batch gives each sequence the result it gets alone.
  const int64_t hq = 3, hk = 1, d = 10;
  Tensor q = filled<BFloat16>({8, hq, d}, 121), k = filled<BFloat16>({8, hk, d}, 122);
  Tensor qo = Tensor::empty(q.shape(), DType::bf16), ko = Tensor::empty(k.shape(), DType::bf16);
  ops::rope_forward(q, k, positions, 1e6, qo, ko);
  for (auto [start, len] : std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {3, 4}, {7, 1}}) {
    std::vector<int32_t> local(static_cast<std::size_t>(len));
    std::iota(local.begin(), local.end(), 0);
    Tensor qs = q.slice_rows(start, len).clone(), ks = k.slice_rows(start, len).clone();
    ops::rope_forward(qs, ks, Tensor::from_vector(local, {len}), 1e6, qs, ks);  // in place
    CHECK(std::memcmp(qs.data_ptr(), qo.slice_rows(start, len).data_ptr(), qs.nbytes()) == 0);
    CHECK(std::memcmp(ks.data_ptr(), ko.slice_rows(start, len).data_ptr(), ks.nbytes()) == 0);
  }
}

TEST_CASE("rope Tensor API equals the templates, q and k, forward and backward", "[ops][rope]") {
  const int64_t tokens = 7, hq = 4, hk = 2, d = 16;
  const std::vector<int32_t> pos = {0, 1, 2, 0, 1, 2, 3};
  const Tensor positions = Tensor::from_vector(pos, {tokens});
  for (DType dt : {DType::f32, DType::bf16}) {
    ops::detail::memops::visit_f32_bf16(dt, [&](auto tag) {
      using T = decltype(tag);
      Tensor q = filled<T>({tokens, hq, d}, 131), k = filled<T>({tokens, hk, d}, 132);
      Tensor qo = Tensor::empty(q.shape(), dt), ko = Tensor::empty(k.shape(), dt);
      ops::rope_forward(q, k, positions, 5e5, qo, ko);
      std::vector<T> qr(static_cast<std::size_t>(q.numel())), kr(static_cast<std::size_t>(k.numel()));
      ops::cpu::rope_forward(q.data<T>(), pos.data(), tokens, hq, d, 5e5, qr.data());
      ops::cpu::rope_forward(k.data<T>(), pos.data(), tokens, hk, d, 5e5, kr.data());
      CHECK(std::memcmp(qo.data_ptr(), qr.data(), qo.nbytes()) == 0);
      CHECK(std::memcmp(ko.data_ptr(), kr.data(), ko.nbytes()) == 0);
      Tensor dq = Tensor::empty(q.shape(), dt), dk = Tensor::empty(k.shape(), dt);
      ops::rope_backward(qo, ko, positions, 5e5, dq, dk);
      ops::cpu::rope_backward(qo.data<T>(), pos.data(), tokens, hq, d, 5e5, qr.data());
      ops::cpu::rope_backward(ko.data<T>(), pos.data(), tokens, hk, d, 5e5, kr.data());
      CHECK(std::memcmp(dq.data_ptr(), qr.data(), dq.nbytes()) == 0);
      CHECK(std::memcmp(dk.data_ptr(), kr.data(), dk.nbytes()) == 0);
    });
  }
}

namespace {

// HF's rotate_half application for one head x [d] with cos / sin [d] (fp32).
std::vector<double> hf_rotate_half(const float* x, const std::vector<float>& cos, const std::vector<float>& sin,
                                   int64_t d) {
  std::vector<double> y;
  for (int64_t j = 0; j < d; ++j) {
    const float rot = j < d / 2 ? -x[j + d / 2] : x[j - d / 2];
    y.push_back(double(x[j] * cos[std::size_t(j)] + rot * sin[std::size_t(j)]));
  }
  return y;
}

// transformers' Qwen3VLTextRotaryEmbedding for one token: freqs[a][i] =
// pos[a] * inv_freq[i] for the three axes, apply_interleaved_mrope (start
// from T, overwrite slice(1, 3 s_h, 3) with H and slice(2, 3 s_w, 3) with W),
// emb = cat(freqs, freqs).
std::vector<float> hf_mrope_angles(const int32_t* pos3, int64_t d, double theta, std::array<int64_t, 3> section) {
  std::vector<float> inv(static_cast<std::size_t>(d / 2));
  for (int64_t i = 0; i < d / 2; ++i) inv[std::size_t(i)] = 1.0f / std::pow(float(theta), float(2 * i) / float(d));
  std::vector<float> f(static_cast<std::size_t>(d / 2));
  for (int64_t i = 0; i < d / 2; ++i) f[std::size_t(i)] = float(pos3[0]) * inv[std::size_t(i)];
  for (int a = 1; a <= 2; ++a)
    for (int64_t i = a; i < 3 * section[std::size_t(a)] && i < d / 2; i += 3)
      f[std::size_t(i)] = float(pos3[a]) * inv[std::size_t(i)];
  std::vector<float> emb(f);
  emb.insert(emb.end(), f.begin(), f.end());
  return emb;
}

// transformers' Qwen3VLVisionModel rotary for one patch at (row, col):
// inv_freq over dim = d / 2 (arange(0, d/2, 2) / (d/2)), emb =
// cat(row * inv, col * inv), then cat(emb, emb).
std::vector<float> hf_vision_angles(int32_t row, int32_t col, int64_t d, double theta) {
  const int64_t dim = d / 2;
  std::vector<float> half;
  for (int32_t p : {row, col})
    for (int64_t j = 0; j < dim / 2; ++j)
      half.push_back(float(p) * (1.0f / std::pow(float(theta), float(2 * j) / float(dim))));
  std::vector<float> emb(half);
  emb.insert(emb.end(), half.begin(), half.end());
  return emb;
}

// Rotates q [tokens, heads, d] by per-token angles (HF's cos / sin of them).
std::vector<double> hf_apply(const Tensor& q, const std::function<std::vector<float>(int64_t)>& angles_of) {
  const int64_t tokens = q.size(0), heads = q.size(1), d = q.size(2);
  std::vector<double> out;
  for (int64_t t = 0; t < tokens; ++t) {
    const std::vector<float> a = angles_of(t);
    std::vector<float> c, s;
    for (float x : a) {
      c.push_back(std::cos(x));
      s.push_back(std::sin(x));
    }
    for (int64_t h = 0; h < heads; ++h) {
      const std::vector<double> y = hf_rotate_half(q.data<float>() + (t * heads + h) * d, c, s, d);
      out.insert(out.end(), y.begin(), y.end());
    }
  }
  return out;
}

std::vector<double> as_doubles(const Tensor& t) {
  std::vector<double> v;
  for (float x : t.to_vector<float>()) v.push_back(double(x));
  return v;
}

}  // namespace

TEST_CASE("interleaved MRoPE follows transformers' Qwen3-VL text rotary (fp32)", "[ops][rope][mrope]") {
  // Qwen3-VL's sections (head_dim 128) and a small odd one (head_dim 10).
  for (auto [d, section] : std::vector<std::pair<int64_t, std::array<int64_t, 3>>>{
           {128, {24, 20, 20}}, {10, {2, 2, 1}}, {16, {8, 0, 0}}}) {
    INFO("head_dim " << d << " section " << section[0] << "," << section[1] << "," << section[2]);
    const int64_t tokens = 6, heads = 3;
    const double theta = 5000000.0;  // Qwen3-VL's rope_theta
    // (t, h, w) per token: text tokens (equal), image tokens (different), far out.
    const std::vector<int32_t> pos = {0, 0, 0, 3, 3, 3, 4, 4, 5, 4, 7, 9, 11, 2, 40000, 50000, 123, 9};
    const Tensor positions = Tensor::from_vector(pos, {tokens, 3});
    Tensor q = filled<float>({tokens, heads, d}, 151);
    Tensor y = Tensor::empty(q.shape(), DType::f32);
    ops::rope_forward(q, Tensor{}, positions, ops::RopeSpec::mrope(theta, section), y, Tensor{});
    const std::vector<double> want =
        hf_apply(q, [&](int64_t t) { return hf_mrope_angles(pos.data() + 3 * t, d, theta, section); });
    CHECK(rel_err(as_doubles(y), want) < 1e-6);
  }
}

TEST_CASE("MRoPE with equal (t, h, w) positions is the text rotary bit for bit", "[ops][rope][mrope]") {
  const int64_t tokens = 9, hq = 4, hk = 2, d = 128;
  std::vector<int32_t> pos1, pos3;
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t p = int32_t(t * 977 % 5000);
    pos1.push_back(p);
    for (int a = 0; a < 3; ++a) pos3.push_back(p);
  }
  for (DType dt : {DType::f32, DType::bf16}) {
    ops::detail::memops::visit_f32_bf16(dt, [&](auto tag) {
      using T = decltype(tag);
      Tensor q = filled<T>({tokens, hq, d}, 161), k = filled<T>({tokens, hk, d}, 162);
      Tensor q1 = Tensor::empty(q.shape(), dt), k1 = Tensor::empty(k.shape(), dt);
      Tensor q3 = Tensor::empty(q.shape(), dt), k3 = Tensor::empty(k.shape(), dt);
      ops::rope_forward(q, k, Tensor::from_vector(pos1, {tokens}), 5e6, q1, k1);
      ops::rope_forward(q, k, Tensor::from_vector(pos3, {tokens, 3}), ops::RopeSpec::mrope(5e6, {24, 20, 20}), q3,
                        k3);
      CHECK(same_bits<T>(q1, q3));
      CHECK(same_bits<T>(k1, k3));
    });
  }
  // Unequal positions change the result (the axes are really read).
  std::vector<int32_t> other = pos3;
  other[3 * 5 + 1] += 7;
  Tensor q = filled<float>({tokens, hq, d}, 163);
  Tensor a = Tensor::empty(q.shape(), DType::f32), b = Tensor::empty(q.shape(), DType::f32);
  ops::rope_forward(q, Tensor{}, Tensor::from_vector(pos3, {tokens, 3}), ops::RopeSpec::mrope(5e6, {24, 20, 20}), a,
                    Tensor{});
  ops::rope_forward(q, Tensor{}, Tensor::from_vector(other, {tokens, 3}), ops::RopeSpec::mrope(5e6, {24, 20, 20}), b,
                    Tensor{});
  CHECK_FALSE(same_bits<float>(a, b));
}

TEST_CASE("2-D vision rotary follows transformers' Qwen3-VL vision tower (fp32)", "[ops][rope][mrope]") {
  for (int64_t d : {int64_t(64), int64_t(72), int64_t(12)}) {
    INFO("head_dim " << d);
    const int64_t tokens = 7, heads = 2;
    const std::vector<int32_t> pos = {0, 0, 0, 1, 1, 0, 1, 1, 5, 3, 31, 47, 2, 63};  // (row, col)
    Tensor q = filled<float>({tokens, heads, d}, 171);
    Tensor y = Tensor::empty(q.shape(), DType::f32);
    ops::rope_forward(q, Tensor{}, Tensor::from_vector(pos, {tokens, 2}), ops::RopeSpec::vision(10000.0), y,
                      Tensor{});
    const std::vector<double> want =
        hf_apply(q, [&](int64_t t) { return hf_vision_angles(pos[std::size_t(2 * t)], pos[std::size_t(2 * t + 1)], d,
                                                             10000.0); });
    CHECK(rel_err(as_doubles(y), want) < 1e-6);
  }
}

TEST_CASE("multi-axis rope backward matches finite differences and inverts the forward (double)",
          "[ops][rope][mrope]") {
  const int64_t tokens = 4, heads = 2;
  for (const auto& [spec, d] : std::vector<std::pair<ops::RopeSpec, int64_t>>{
           {ops::RopeSpec::mrope(1e4, {2, 1, 1}), 8}, {ops::RopeSpec::vision(1e4), 8}}) {
    INFO("rotary " << spec.name());
    std::vector<int32_t> pos;
    for (int64_t i = 0; i < tokens * spec.axes(); ++i) pos.push_back(int32_t((i * 5 + 1) % 9));
    std::vector<double> x = normals(static_cast<std::size_t>(tokens * heads * d), 181);
    const std::vector<double> r = normals(x.size(), 182);
    auto loss = [&] {
      std::vector<double> y(x.size());
      ops::cpu::rope_rotate(x.data(), pos.data(), tokens, heads, d, spec, +1, y.data());
      return dot(r, y);
    };
    const std::vector<double> fd = numeric_grad(x, loss);
    std::vector<double> dx(x.size(), 99.0);
    ops::cpu::rope_rotate(r.data(), pos.data(), tokens, heads, d, spec, -1, dx.data());
    CHECK(rel_err(dx, fd) < kFdTol);
    std::vector<double> y(x.size()), back(x.size());
    ops::cpu::rope_rotate(x.data(), pos.data(), tokens, heads, d, spec, +1, y.data());
    ops::cpu::rope_rotate(y.data(), pos.data(), tokens, heads, d, spec, -1, back.data());
    CHECK(rel_err(back, x) < 1e-14);
    CHECK(rel_err(y, x) > 1e-3);  // it rotated
  }
  // The Tensor API's backward is the same rotation by -angle.
  const std::vector<int32_t> pos = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  Tensor q = filled<float>({4, 2, 8}, 183), y = Tensor::empty({4, 2, 8}, DType::f32),
         back = Tensor::empty({4, 2, 8}, DType::f32);
  const auto spec = ops::RopeSpec::mrope(1e4, {2, 1, 1});
  ops::rope_forward(q, Tensor{}, Tensor::from_vector(pos, {4, 3}), spec, y, Tensor{});
  ops::rope_backward(y, Tensor{}, Tensor::from_vector(pos, {4, 3}), spec, back, Tensor{});
  CHECK(rel_err(as_doubles(back), as_doubles(q)) < 1e-6);
}

TEST_CASE("multi-axis rope rejects bad specs and positions", "[ops][rope][mrope]") {
  Tensor q = filled<float>({3, 2, 8}, 191);
  Tensor qo = Tensor::empty(q.shape(), DType::f32);
  const Tensor pos3 = Tensor::zeros({3, 3}, DType::i32);
  CHECK_THROWS_WITH(ops::rope_forward(q, Tensor{}, pos3, ops::RopeSpec::mrope(1e4, {2, 1, 2}), qo, Tensor{}),
                    ContainsSubstring("mrope_section [2, 1, 2] must be >= 0 and sum to head_dim / 2 = 4"));
  CHECK_THROWS_WITH(ops::rope_forward(q, Tensor{}, pos3, ops::RopeSpec::mrope(1e4, {5, -1, 0}), qo, Tensor{}),
                    ContainsSubstring("mrope_section"));
  CHECK_THROWS_WITH(ops::rope_forward(q, Tensor{}, Tensor::zeros({3}, DType::i32),
                                      ops::RopeSpec::mrope(1e4, {2, 1, 1}), qo, Tensor{}),
                    ContainsSubstring("positions must be [3, 3] for the mrope_interleaved rotary"));
  CHECK_THROWS_WITH(ops::rope_forward(q, Tensor{}, pos3, ops::RopeSpec::vision(1e4), qo, Tensor{}),
                    ContainsSubstring("positions must be [3, 2] for the vision_2d rotary"));
  Tensor q6 = filled<float>({3, 2, 6}, 192);
  CHECK_THROWS_WITH(ops::rope_forward(q6, Tensor{}, Tensor::zeros({3, 2}, DType::i32), ops::RopeSpec::vision(1e4),
                                      Tensor::empty(q6.shape(), DType::f32), Tensor{}),
                    ContainsSubstring("head_dim divisible by 4, got 6"));
  CHECK_THROWS_WITH(ops::rope_forward(q, Tensor{}, pos3, ops::RopeSpec::mrope(-1.0, {2, 1, 1}), qo, Tensor{}),
                    ContainsSubstring("rope_theta must be positive"));
}

TEST_CASE("rope and positions reject bad input", "[ops][rope]") {
  Tensor q = filled<float>({3, 2, 8}, 141);
  const Tensor pos = Tensor::from_vector(std::vector<int32_t>{0, 1, 2}, {3});
  Tensor qo = Tensor::empty(q.shape(), DType::f32);
  CHECK_THROWS_WITH(ops::rope_forward(filled<float>({3, 2, 7}, 1), Tensor{}, pos, 1e4,
                                      Tensor::empty({3, 2, 7}, DType::f32), Tensor{}),
                    ContainsSubstring("head_dim must be even"));
  CHECK_THROWS_WITH(
      ops::rope_forward(q, Tensor{}, Tensor::from_vector(std::vector<int32_t>{0, 1}, {2}), 1e4, qo, Tensor{}),
      ContainsSubstring("positions must have shape (3,)"));
  CHECK_THROWS_WITH(ops::rope_forward(q, Tensor{}, Tensor::zeros({3}, DType::i64), 1e4, qo, Tensor{}),
                    ContainsSubstring("positions must be i32"));
  CHECK_THROWS_WITH(ops::rope_forward(q, filled<float>({3, 1, 8}, 2), pos, 1e4, qo, Tensor{}),
                    ContainsSubstring("must both be given"));
  CHECK_THROWS_WITH(
      ops::rope_forward(q, filled<float>({3, 1, 4}, 2), pos, 1e4, qo, Tensor::empty({3, 1, 4}, DType::f32)),
      ContainsSubstring("k must be [3, heads, 8]"));
  CHECK_THROWS_WITH(ops::rope_forward(q, Tensor{}, pos, 0.0, qo, Tensor{}), ContainsSubstring("rope_theta"));
  CHECK_THROWS_WITH(ops::rope_backward(q, Tensor{}, pos, 1e4, Tensor::empty(q.shape(), DType::bf16), Tensor{}),
                    ContainsSubstring("dq must be f32"));

  Tensor p = Tensor::empty({4}, DType::i32);
  CHECK_THROWS_WITH(ops::positions_from_cu_seqlens(Tensor::from_vector(std::vector<int32_t>{1, 4}, {2}), p),
                    ContainsSubstring("cu_seqlens[0] must be 0"));
  CHECK_THROWS_WITH(ops::positions_from_cu_seqlens(Tensor::from_vector(std::vector<int32_t>{0, 3, 2, 4}, {4}), p),
                    ContainsSubstring("must not decrease"));
  CHECK_THROWS_WITH(ops::positions_from_cu_seqlens(Tensor::from_vector(std::vector<int32_t>{0, 3}, {2}), p),
                    ContainsSubstring("must equal the number of tokens 4"));
  CHECK_THROWS_WITH(ops::positions_from_cu_seqlens(Tensor::zeros({2}, DType::i64), p),
                    ContainsSubstring("cu_seqlens must be i32"));
}

// ---------------------------------------------------------------- swiglu

TEST_CASE("swiglu backward matches finite differences w.r.t. gate and up (double)", "[ops][swiglu]") {
  const int64_t n = 23;
  std::vector<double> gate = normals(static_cast<std::size_t>(n), 151, 3.0),
                      up = normals(static_cast<std::size_t>(n), 152);
  const std::vector<double> r = normals(static_cast<std::size_t>(n), 153);
  auto loss = [&] {
    std::vector<double> h(static_cast<std::size_t>(n));
    ops::cpu::swiglu_forward(gate.data(), up.data(), n, h.data());
    return dot(r, h);
  };
  const std::vector<double> fd_gate = numeric_grad(gate, loss);
  const std::vector<double> fd_up = numeric_grad(up, loss);
  std::vector<double> dgate(static_cast<std::size_t>(n), 99.0), dup(static_cast<std::size_t>(n), 99.0);
  ops::cpu::swiglu_backward(gate.data(), up.data(), r.data(), n, dgate.data(), dup.data());
  CHECK(rel_err(dgate, fd_gate) < kFdTol);
  CHECK(rel_err(dup, fd_up) < kFdTol);
  // silu itself: g * sigmoid(g).
  std::vector<double> h(static_cast<std::size_t>(n));
  ops::cpu::swiglu_forward(gate.data(), up.data(), n, h.data());
  CHECK(std::abs(h[0] - gate[0] / (1.0 + std::exp(-gate[0])) * up[0]) < 1e-15);
}

TEST_CASE("swiglu fused [tokens, 2F] layout equals two tensors, and in place works", "[ops][swiglu]") {
  const int64_t tokens = 5, f = 13;
  for (DType dt : {DType::f32, DType::bf16}) {
    ops::detail::memops::visit_f32_bf16(dt, [&](auto tag) {
      using T = decltype(tag);
      Tensor gate_up = filled<T>({tokens, 2 * f}, 161, 2.f);
      Tensor gate = Tensor::empty({tokens, f}, dt), up = Tensor::empty({tokens, f}, dt);
      for (int64_t t = 0; t < tokens; ++t) {
        std::memcpy(gate.data<T>() + t * f, gate_up.data<T>() + t * 2 * f, std::size_t(f) * sizeof(T));
        std::memcpy(up.data<T>() + t * f, gate_up.data<T>() + t * 2 * f + f, std::size_t(f) * sizeof(T));
      }
      Tensor h = Tensor::empty({tokens, f}, dt), hf = Tensor::empty({tokens, f}, dt);
      ops::swiglu_forward(gate, up, h);
      ops::swiglu_forward_fused(gate_up, hf);
      CHECK(same_bits<T>(h, hf));
      std::vector<T> href(static_cast<std::size_t>(tokens * f));
      ops::cpu::swiglu_forward(gate.data<T>(), up.data<T>(), tokens * f, href.data());
      CHECK(std::memcmp(h.data_ptr(), href.data(), h.nbytes()) == 0);

      Tensor dh = filled<T>({tokens, f}, 162);
      Tensor dgate = Tensor::empty({tokens, f}, dt), dup = Tensor::empty({tokens, f}, dt);
      ops::swiglu_backward(gate, up, dh, dgate, dup);
      Tensor dgu = Tensor::empty({tokens, 2 * f}, dt);
      ops::swiglu_backward_fused(gate_up, dh, dgu);
      for (int64_t t = 0; t < tokens; ++t) {
        CHECK(std::memcmp(dgu.data<T>() + t * 2 * f, dgate.data<T>() + t * f, std::size_t(f) * sizeof(T)) == 0);
        CHECK(std::memcmp(dgu.data<T>() + t * 2 * f + f, dup.data<T>() + t * f, std::size_t(f) * sizeof(T)) == 0);
      }
      // In place: dgate_up over gate_up, dgate over gate and dup over up.
      Tensor inplace = gate_up.clone();
      ops::swiglu_backward_fused(inplace, dh, inplace);
      CHECK(same_bits<T>(inplace, dgu));
      Tensor g2 = gate.clone(), u2 = up.clone();
      ops::swiglu_backward(g2, u2, dh, g2, u2);
      CHECK(same_bits<T>(g2, dgate));
      CHECK(same_bits<T>(u2, dup));
    });
  }
}

TEST_CASE("swiglu rejects bad input", "[ops][swiglu]") {
  Tensor g = filled<float>({4, 6}, 171), u = filled<float>({4, 6}, 172);
  CHECK_THROWS_WITH(ops::swiglu_forward(g, filled<float>({4, 5}, 1), Tensor::empty({4, 6}, DType::f32)),
                    ContainsSubstring("up must have shape (4, 6)"));
  CHECK_THROWS_WITH(ops::swiglu_forward(g, u, Tensor::empty({4, 6}, DType::bf16)), ContainsSubstring("h must be f32"));
  CHECK_THROWS_WITH(ops::swiglu_forward_fused(filled<float>({4, 7}, 1), Tensor::empty({4, 3}, DType::f32)),
                    ContainsSubstring("gate_up must be 2-d [tokens, 2F]"));
  CHECK_THROWS_WITH(ops::swiglu_forward_fused(filled<float>({4, 8}, 1), Tensor::empty({4, 8}, DType::f32)),
                    ContainsSubstring("h must have shape (4, 4)"));
  CHECK_THROWS_WITH(ops::swiglu_backward(g, u, filled<float>({4, 6}, 2), g, g),
                    ContainsSubstring("two outputs overlap"));
  Tensor big = Tensor::empty({30}, DType::f32);
  CHECK_THROWS_WITH(ops::swiglu_forward(big.view(0, {4, 6}), u, big.view(3, {4, 6})),
                    ContainsSubstring("partially overlaps"));
}

// ---------------------------------------------------------------- elementwise

TEST_CASE("add, add_ and scale compute in fp32 and round once, for f32, bf16 and f16", "[ops][elementwise]") {
  const int64_t n = 37;
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    ops::detail::memops::visit_floating(dt, [&](auto tag) {
      using T = decltype(tag);
      Tensor a = filled<T>({n}, 181, 4.f), b = filled<T>({n}, 182, 4.f);
      Tensor y = Tensor::empty({n}, dt);
      ops::add(a, b, y);
      Tensor s = Tensor::empty({n}, dt);
      ops::scale(a, 0.37f, s);
      for (int64_t i = 0; i < n; ++i) {
        const T want = T(float(a.data<T>()[i]) + float(b.data<T>()[i]));
        CHECK(std::memcmp(&y.data<T>()[i], &want, sizeof(T)) == 0);
        const T want_s = T(float(a.data<T>()[i]) * 0.37f);
        CHECK(std::memcmp(&s.data<T>()[i], &want_s, sizeof(T)) == 0);
      }
      Tensor a2 = a.clone();
      ops::add_(a2, b);
      CHECK(same_bits<T>(a2, y));
      Tensor a3 = a.clone();
      ops::scale(a3, 0.37f, a3);
      CHECK(same_bits<T>(a3, s));
    });
  }
}

TEST_CASE("cast rounds to nearest even and matches BFloat16 / Half bit for bit", "[ops][elementwise]") {
  std::vector<float> v = {0.f,
                          -0.f,
                          1.f,
                          -2.5f,
                          3.14159265f,
                          65504.f,
                          65520.f,
                          1e6f,
                          -1e-30f,
                          6e-8f,
                          3e-5f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::max()};
  for (uint32_t bits : {0x3f808000u, 0x3f818000u, 0x3f800fffu, 0x3f801000u, 0x3f803000u, 0xffc00001u, 0x7f800001u})
    v.push_back(detail::bits_float(bits));  // bf16 ties (even / odd), f16 ties, NaN payloads
  const int64_t n = int64_t(v.size());
  Tensor f32 = Tensor::from_vector(v, {n});
  Tensor bf = Tensor::empty({n}, DType::bf16), hf = Tensor::empty({n}, DType::f16);
  ops::cast(f32, bf);
  ops::cast(f32, hf);
  for (int64_t i = 0; i < n; ++i) {
    CHECK(bf.data<BFloat16>()[i].bits == BFloat16(v[std::size_t(i)]).bits);
    CHECK(hf.data<Half>()[i].bits == Half(v[std::size_t(i)]).bits);
  }
  // Back to f32 (exact), and across the 16-bit types through f32.
  Tensor back = Tensor::empty({n}, DType::f32), bf_to_h = Tensor::empty({n}, DType::f16),
         h_to_bf = Tensor::empty({n}, DType::bf16);
  ops::cast(bf, back);
  ops::cast(bf, bf_to_h);
  ops::cast(hf, h_to_bf);
  for (int64_t i = 0; i < n; ++i) {
    const float fb = float(bf.data<BFloat16>()[i]);
    CHECK(detail::float_bits(back.data<float>()[i]) == detail::float_bits(fb));
    CHECK(bf_to_h.data<Half>()[i].bits == Half(fb).bits);
    CHECK(h_to_bf.data<BFloat16>()[i].bits == BFloat16(float(hf.data<Half>()[i])).bits);
  }
  // Same dtype copies.
  Tensor copy = Tensor::empty({n}, DType::bf16);
  ops::cast(bf, copy);
  CHECK(same_bits<BFloat16>(copy, bf));
}

TEST_CASE("elementwise ops reject bad input", "[ops][elementwise]") {
  Tensor a = filled<float>({8}, 191), b = filled<float>({8}, 192);
  CHECK_THROWS_WITH(ops::add(a, Tensor::zeros({8}, DType::bf16), Tensor::empty({8}, DType::f32)),
                    ContainsSubstring("b must be f32"));
  CHECK_THROWS_WITH(ops::add(a, Tensor::zeros({9}, DType::f32), Tensor::empty({8}, DType::f32)),
                    ContainsSubstring("b must have shape (8,)"));
  CHECK_THROWS_WITH(
      ops::add(Tensor::zeros({8}, DType::i32), Tensor::zeros({8}, DType::i32), Tensor::zeros({8}, DType::i32)),
      ContainsSubstring("a must be f32, bf16 or f16"));
  CHECK_THROWS_WITH(ops::cast(a, Tensor::empty({4, 2}, DType::bf16)), ContainsSubstring("y must have shape (8,)"));
  CHECK_THROWS_WITH(ops::cast(a, Tensor::empty({8}, DType::u8)), ContainsSubstring("y must be f32, bf16 or f16"));
  Tensor big = Tensor::empty({10}, DType::f32);
  CHECK_THROWS_WITH(ops::add(big.view(0, {8}), b, big.view(1, {8})), ContainsSubstring("partially overlaps"));
  CHECK_THROWS_WITH(ops::scale(big.view(0, {8}), 2.f, big.view(2, {8})), ContainsSubstring("partially overlaps"));
  CHECK_NOTHROW(ops::cast(a, a));  // the same tensor: nothing to do
  CHECK_THROWS_WITH(ops::cast(big.view(0, {8}), big.view(1, {8})), ContainsSubstring("x and y overlap"));
  CHECK_THROWS_WITH(ops::add(a, b, Tensor{}), ContainsSubstring("y is undefined"));
}
