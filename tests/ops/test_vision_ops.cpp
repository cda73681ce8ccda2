// CPU tests of the Qwen3-VL vision tower's ops: layer_norm (with weight and
// bias) and gelu (erf and tanh forms). The CPU references are checked against
// double-precision formulas written out here (the erf form through erfc, so
// not the reference's expression), every backward against central finite
// differences in double through the CPU templates, the Tensor API against the
// templates; bad input must throw clear errors. (Device mismatches need a GPU:
// tests/ops/test_vision_ops_gpu.cu.)
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "slime/core/random.hpp"
#include "slime/ops/gelu.hpp"
#include "slime/ops/layer_norm.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
using ops::GeluApproximation;

namespace {

std::vector<double> normals(std::size_t n, uint64_t seed, double scale = 1.0, double shift = 0.0) {
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = shift + scale * double(random_normal(seed, i));
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  return std::inner_product(a.begin(), a.end(), b.begin(), 0.0);
}

// ||a - b|| / ||b||; NaN when a holds a non-finite value.
double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return std::numeric_limits<double>::quiet_NaN();
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
Tensor filled(const Shape& shape, uint64_t seed, float stddev = 1.f, float mean = 0.f) {
  Tensor t = Tensor::empty(shape, dtype_of<T>);
  fill_normal(t, seed, 0, mean, stddev);
  return t;
}

std::vector<double> to_double(const Tensor& t) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  ops::detail::memops::visit_f32_bf16(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* p = t.data<T>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = double(float(p[i]));
  });
  return out;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && (a.nbytes() == 0 || std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0);
}

template <class T>
bool same_bits(const Tensor& a, const std::vector<T>& b) {
  return a.nbytes() == b.size() * sizeof(T) &&
         (a.nbytes() == 0 || std::memcmp(a.data_ptr(), b.data(), a.nbytes()) == 0);
}

// LayerNorm in double, written out: y [rows, dim], mean [rows], rstd [rows].
struct LnRef {
  std::vector<double> y, mean, rstd;
};
LnRef layer_norm_double(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& b,
                        int64_t rows, int64_t dim, double eps) {
  LnRef r{std::vector<double>(x.size()), std::vector<double>(std::size_t(rows)),
          std::vector<double>(std::size_t(rows))};
  for (int64_t i = 0; i < rows; ++i) {
    const double* xr = x.data() + i * dim;
    double mu = 0;
    for (int64_t d = 0; d < dim; ++d) mu += xr[d];
    mu /= double(dim);
    double var = 0;
    for (int64_t d = 0; d < dim; ++d) var += (xr[d] - mu) * (xr[d] - mu);
    var /= double(dim);  // biased, as torch.nn.LayerNorm
    const double rs = 1.0 / std::sqrt(var + eps);
    r.mean[std::size_t(i)] = mu;
    r.rstd[std::size_t(i)] = rs;
    for (int64_t d = 0; d < dim; ++d)
      r.y[std::size_t(i * dim + d)] = (xr[d] - mu) * rs * w[std::size_t(d)] + b[std::size_t(d)];
  }
  return r;
}

// GELU in double, written out: the erf form as x * Phi(x) with Phi through
// erfc, the tanh form as torch documents it.
double gelu_double(double x, GeluApproximation a) {
  if (a == GeluApproximation::tanh) {
    const double pi = 3.14159265358979323846;
    return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / pi) * (x + 0.044715 * x * x * x)));
  }
  return x * 0.5 * std::erfc(-x / std::sqrt(2.0));
}

constexpr GeluApproximation kForms[] = {GeluApproximation::none, GeluApproximation::tanh};

}  // namespace

// ---------------------------------------------------------------- layer_norm

TEST_CASE("layer_norm forward equals the double-precision formula for every dtype pair", "[ops][layer_norm]") {
  const float eps = 1e-6f;
  struct Shape2 {
    int64_t rows, dim;
  };
  uint64_t seed = 100;
  for (Shape2 s : {Shape2{5, 7}, Shape2{3, 33}, Shape2{2, 1}, Shape2{1, 1001}}) {
    for (DType xt : {DType::f32, DType::bf16}) {
      for (DType wt : {DType::f32, DType::bf16}) {
        INFO("rows " << s.rows << " dim " << s.dim << " x " << xt << " w " << wt);
        ops::detail::memops::visit_act_weight(xt, wt, [&](auto act_tag, auto weight_tag) {
          using T = decltype(act_tag);
          using W = decltype(weight_tag);
          // Rows far from zero (mean 3): a one-pass E[x^2] - mean^2 would cancel.
          Tensor x = filled<T>({s.rows, s.dim}, ++seed, 2.f, 3.f), w = filled<W>({s.dim}, ++seed, 0.5f, 1.f),
                 b = filled<W>({s.dim}, ++seed, 0.5f);
          Tensor y = Tensor::empty({s.rows, s.dim}, xt);
          Tensor mean = Tensor::empty({s.rows}, DType::f32), rstd = Tensor::empty({s.rows}, DType::f32);
          y.fill_bytes_(0xff);
          mean.fill_bytes_(0xff);
          rstd.fill_bytes_(0xff);
          ops::layer_norm_forward(x, w, b, eps, y, mean, rstd);
          const LnRef ref = layer_norm_double(to_double(x), to_double(w), to_double(b), s.rows, s.dim, double(eps));
          // f32 output: fp32 rounding (~1e-7 per operation, a few per element);
          // bf16 output: one bf16 rounding (2^-9 relative at most).
          CHECK(rel_err(to_double(y), ref.y) <= (xt == DType::bf16 ? 4e-3 : 1e-6));
          CHECK(rel_err(to_double(mean), ref.mean) <= 1e-6);
          // dim 1: var = 0, y = b and rstd = 1 / sqrt(eps).
          CHECK(rel_err(to_double(rstd), ref.rstd) <= 1e-5);
        });
      }
    }
  }
}

TEST_CASE("layer_norm backward matches finite differences w.r.t. x, weight and bias (double)", "[ops][layer_norm]") {
  const double eps = 1e-5;
  struct Shape2 {
    int64_t rows, dim;
  };
  for (Shape2 s : {Shape2{4, 7}, Shape2{3, 13}, Shape2{2, 3}}) {
    INFO("rows " << s.rows << " dim " << s.dim);
    const auto n = static_cast<std::size_t>(s.rows * s.dim), nd = static_cast<std::size_t>(s.dim);
    std::vector<double> x = normals(n, 51, 1.0, 0.5);
    std::vector<double> w = normals(nd, 52, 0.5, 1.0);
    std::vector<double> b = normals(nd, 53, 0.5);
    const std::vector<double> r = normals(n, 54);  // loss = sum(r * y)
    auto loss = [&] {
      std::vector<double> y(n), mean(std::size_t(s.rows)), rstd(std::size_t(s.rows));
      ops::cpu::layer_norm_forward(x.data(), w.data(), b.data(), s.rows, s.dim, eps, y.data(), mean.data(),
                                   rstd.data());
      return dot(r, y);
    };
    const std::vector<double> fd_x = numeric_grad(x, loss);
    const std::vector<double> fd_w = numeric_grad(w, loss);
    const std::vector<double> fd_b = numeric_grad(b, loss);

    std::vector<double> y(n), mean(std::size_t(s.rows)), rstd(std::size_t(s.rows)), dx(n, 99.0);
    ops::cpu::layer_norm_forward(x.data(), w.data(), b.data(), s.rows, s.dim, eps, y.data(), mean.data(), rstd.data());
    // The forward in double is the formula.
    const LnRef ref = layer_norm_double(x, w, b, s.rows, s.dim, eps);
    CHECK(rel_err(y, ref.y) < 1e-14);
    CHECK(rel_err(mean, ref.mean) < 1e-14);
    CHECK(rel_err(rstd, ref.rstd) < 1e-14);
    // Parameter gradients accumulate: start from dw0 / db0 and subtract them.
    const std::vector<double> dw0 = normals(nd, 55), db0 = normals(nd, 56);
    std::vector<double> dw = dw0, db = db0;
    ops::cpu::layer_norm_backward(x.data(), w.data(), mean.data(), rstd.data(), r.data(), s.rows, s.dim, dx.data(),
                                  dw.data(), db.data());
    for (std::size_t i = 0; i < nd; ++i) {
      dw[i] -= dw0[i];
      db[i] -= db0[i];
    }
    CHECK(rel_err(dx, fd_x) < kFdTol);
    CHECK(rel_err(dw, fd_w) < kFdTol);
    CHECK(rel_err(db, fd_b) < kFdTol);
    // Each row's dx sums to zero (y is invariant to shifting a row of x).
    for (int64_t i = 0; i < s.rows; ++i) {
      double sum = 0;
      for (int64_t d = 0; d < s.dim; ++d) sum += dx[std::size_t(i * s.dim + d)];
      CHECK(std::abs(sum) < 1e-12);
    }
  }
}

TEST_CASE("layer_norm Tensor API equals the templates for every dtype pair, and the f32 path the double one",
          "[ops][layer_norm]") {
  const int64_t rows = 5, dim = 37;
  const float eps = 1e-6f;
  for (DType xt : {DType::f32, DType::bf16}) {
    for (DType wt : {DType::f32, DType::bf16}) {
      INFO("x " << xt << " w " << wt);
      ops::detail::memops::visit_act_weight(xt, wt, [&](auto act_tag, auto weight_tag) {
        using T = decltype(act_tag);
        using W = decltype(weight_tag);
        Tensor x = filled<T>({rows, dim}, 61, 2.f, -1.f), w = filled<W>({dim}, 62, 0.3f, 1.f), b = filled<W>({dim}, 63),
               dy = filled<T>({rows, dim}, 64);
        Tensor y = Tensor::empty({rows, dim}, xt);
        Tensor mean = Tensor::empty({rows}, DType::f32), rstd = Tensor::empty({rows}, DType::f32);
        ops::layer_norm_forward(x, w, b, eps, y, mean, rstd);
        std::vector<T> yref(static_cast<std::size_t>(rows * dim));
        std::vector<float> mref(static_cast<std::size_t>(rows)), rref(static_cast<std::size_t>(rows));
        ops::cpu::layer_norm_forward(x.data<T>(), w.data<W>(), b.data<W>(), rows, dim, eps, yref.data(), mref.data(),
                                     rref.data());
        CHECK(same_bits(y, yref));
        CHECK(same_bits(mean, mref));
        CHECK(same_bits(rstd, rref));

        Tensor dx = Tensor::empty({rows, dim}, xt), dw = filled<float>({dim}, 65), db = filled<float>({dim}, 66);
        const std::vector<float> dw0 = dw.to_vector<float>(), db0 = db.to_vector<float>();
        std::vector<T> dxref(static_cast<std::size_t>(rows * dim));
        std::vector<float> dwref = dw0, dbref = db0;
        ops::layer_norm_backward(x, w, mean, rstd, dy, dx, dw, db, Tensor{});
        ops::cpu::layer_norm_backward(x.data<T>(), w.data<W>(), mref.data(), rref.data(), dy.data<T>(), rows, dim,
                                      dxref.data(), dwref.data(), dbref.data());
        CHECK(same_bits(dx, dxref));
        CHECK(same_bits(dw, dwref));
        CHECK(same_bits(db, dbref));

        // The fp32 math against the (finite-difference-checked) double
        // template on the same rounded inputs.
        const std::vector<double> xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
        std::vector<double> md(static_cast<std::size_t>(rows)), rd(md.size()), yd(xd.size()), dxd(xd.size());
        std::vector<double> dwd(static_cast<std::size_t>(dim), 0.0), dbd(dwd.size(), 0.0);
        ops::cpu::layer_norm_forward(xd.data(), wd.data(), to_double(b).data(), rows, dim, double(eps), yd.data(),
                                     md.data(), rd.data());
        ops::cpu::layer_norm_backward(xd.data(), wd.data(), md.data(), rd.data(), dyd.data(), rows, dim, dxd.data(),
                                      dwd.data(), dbd.data());
        const double tol = xt == DType::bf16 ? 4e-3 : 1e-5;
        CHECK(rel_err(to_double(dx), dxd) <= tol);
        std::vector<double> dw_inc = to_double(dw), db_inc = to_double(db);
        for (std::size_t i = 0; i < dw_inc.size(); ++i) {
          dw_inc[i] -= double(dw0[i]);
          db_inc[i] -= double(db0[i]);
        }
        CHECK(rel_err(dw_inc, dwd) <= 1e-5);
        CHECK(rel_err(db_inc, dbd) <= 1e-5);
      });
    }
  }
}

TEST_CASE("layer_norm over [batch, tokens, dim] equals the [rows, dim] view", "[ops][layer_norm]") {
  const int64_t a = 2, t = 3, dim = 9;
  Tensor x = filled<BFloat16>({a, t, dim}, 71, 1.5f), w = filled<BFloat16>({dim}, 72, 0.2f, 1.f),
         b = filled<BFloat16>({dim}, 73);
  Tensor y3 = Tensor::empty(x.shape(), DType::bf16);
  Tensor m3 = Tensor::empty({a, t}, DType::f32), r3 = Tensor::empty({a, t}, DType::f32);
  ops::layer_norm_forward(x, w, b, 1e-6f, y3, m3, r3);
  Tensor y2 = Tensor::empty({a * t, dim}, DType::bf16);
  Tensor m2 = Tensor::empty({a * t}, DType::f32), r2 = Tensor::empty({a * t}, DType::f32);
  ops::layer_norm_forward(x.reshape({a * t, dim}), w, b, 1e-6f, y2, m2, r2);
  CHECK(same_bits(y3, y2));
  CHECK(same_bits(m3, m2));
  CHECK(same_bits(r3, r2));
}

TEST_CASE("layer_norm in place (y = x, dx = x, dx = dy) gives the out-of-place result", "[ops][layer_norm]") {
  const int64_t rows = 4, dim = 11;
  Tensor x = filled<float>({rows, dim}, 81), w = filled<float>({dim}, 82), b = filled<float>({dim}, 83),
         dy = filled<float>({rows, dim}, 84);
  Tensor y = Tensor::empty({rows, dim}, DType::f32);
  Tensor mean = Tensor::empty({rows}, DType::f32), rstd = Tensor::empty({rows}, DType::f32);
  ops::layer_norm_forward(x, w, b, 1e-6f, y, mean, rstd);
  Tensor dx = Tensor::empty({rows, dim}, DType::f32);
  Tensor dw = Tensor::zeros({dim}, DType::f32), db = Tensor::zeros({dim}, DType::f32);
  ops::layer_norm_backward(x, w, mean, rstd, dy, dx, dw, db, Tensor{});

  Tensor dy2 = dy.clone(), dw2 = Tensor::zeros({dim}, DType::f32), db2 = Tensor::zeros({dim}, DType::f32);
  ops::layer_norm_backward(x, w, mean, rstd, dy2, dy2, dw2, db2, Tensor{});
  CHECK(same_bits(dy2, dx));
  CHECK(same_bits(dw2, dw));
  CHECK(same_bits(db2, db));

  Tensor x3 = x.clone(), dw3 = Tensor::zeros({dim}, DType::f32), db3 = Tensor::zeros({dim}, DType::f32);
  ops::layer_norm_backward(x3, w, mean, rstd, dy, x3, dw3, db3, Tensor{});
  CHECK(same_bits(x3, dx));
  CHECK(same_bits(dw3, dw));
  CHECK(same_bits(db3, db));

  Tensor x2 = x.clone();
  Tensor mean2 = Tensor::empty({rows}, DType::f32), rstd2 = Tensor::empty({rows}, DType::f32);
  ops::layer_norm_forward(x2, w, b, 1e-6f, x2, mean2, rstd2);
  CHECK(same_bits(x2, y));
  CHECK(same_bits(mean2, mean));
  CHECK(same_bits(rstd2, rstd));
}

TEST_CASE("layer_norm rejects bad shapes, dtypes and overlaps", "[ops][layer_norm]") {
  Tensor x = filled<float>({4, 8}, 91), w = filled<float>({8}, 92), b = filled<float>({8}, 93);
  Tensor y = Tensor::empty({4, 8}, DType::f32);
  Tensor mean = Tensor::empty({4}, DType::f32), rstd = Tensor::empty({4}, DType::f32);
  // forward: shapes
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, Tensor::zeros({7}, DType::f32), b, 1e-6f, y, mean, rstd),
                    ContainsSubstring("layer_norm_forward: weight must have shape (8,)"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, Tensor::zeros({9}, DType::f32), 1e-6f, y, mean, rstd),
                    ContainsSubstring("layer_norm_forward: bias must have shape (8,)"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, b, 1e-6f, Tensor::empty({4, 7}, DType::f32), mean, rstd),
                    ContainsSubstring("y must have shape (4, 8)"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, b, 1e-6f, y, Tensor::empty({3}, DType::f32), rstd),
                    ContainsSubstring("mean must have 4 elements"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, b, 1e-6f, y, mean, Tensor::empty({5}, DType::f32)),
                    ContainsSubstring("rstd must have 4 elements"));
  CHECK_THROWS_WITH(
      ops::layer_norm_forward(Tensor::zeros({4, 0}, DType::f32), Tensor::zeros({0}, DType::f32),
                              Tensor::zeros({0}, DType::f32), 1e-6f, Tensor::empty({4, 0}, DType::f32), mean, rstd),
      ContainsSubstring("empty last dim"));
  // forward: dtypes and values
  CHECK_THROWS_WITH(ops::layer_norm_forward(Tensor::zeros({4, 8}, DType::f16), w, b, 1e-6f, y, mean, rstd),
                    ContainsSubstring("x must be f32 or bf16"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, Tensor::zeros({8}, DType::f16), b, 1e-6f, y, mean, rstd),
                    ContainsSubstring("weight must be f32 or bf16"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, Tensor::zeros({8}, DType::bf16), 1e-6f, y, mean, rstd),
                    ContainsSubstring("bias (the weight's dtype) must be f32"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, b, 1e-6f, Tensor::empty({4, 8}, DType::bf16), mean, rstd),
                    ContainsSubstring("y must be f32"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, b, 1e-6f, y, Tensor::empty({4}, DType::bf16), rstd),
                    ContainsSubstring("mean must be f32"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, b, 1e-6f, y, mean, Tensor::empty({4}, DType::bf16)),
                    ContainsSubstring("rstd must be f32"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, Tensor{}, 1e-6f, y, mean, rstd),
                    ContainsSubstring("bias is undefined"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, b, -1e-6f, y, mean, rstd), ContainsSubstring("negative eps"));
  // forward: overlaps
  Tensor big = Tensor::empty({40}, DType::f32);
  CHECK_THROWS_WITH(ops::layer_norm_forward(big.view(0, {4, 8}), w, b, 1e-6f, big.view(1, {4, 8}), mean, rstd),
                    ContainsSubstring("y overlaps"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, b, 1e-6f, y, mean, mean), ContainsSubstring("mean and rstd overlap"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, b, 1e-6f, y, w.view(0, {4}), rstd),
                    ContainsSubstring("mean or rstd overlaps an input"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, b, 1e-6f, y, mean, y.view(4, {4})), ContainsSubstring("y overlaps"));
  // Nothing was written by a rejected call.
  Tensor y_keep = Tensor::zeros({4, 8}, DType::f32);
  CHECK_THROWS(ops::layer_norm_forward(x, w, b, 1e-6f, y_keep, mean, Tensor::empty({4}, DType::bf16)));
  for (float v : y_keep.to_vector<float>()) CHECK(v == 0.f);

  ops::layer_norm_forward(x, w, b, 1e-6f, y, mean, rstd);
  Tensor dx = Tensor::empty({4, 8}, DType::f32);
  Tensor dw = Tensor::zeros({8}, DType::f32), db = Tensor::zeros({8}, DType::f32);
  // backward: shapes
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean, rstd, Tensor::zeros({4, 9}, DType::f32), dx, dw, db, Tensor{}),
                    ContainsSubstring("layer_norm_backward: dy must have shape (4, 8)"));
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean, rstd, y, Tensor::empty({8, 4}, DType::f32), dw, db, Tensor{}),
                    ContainsSubstring("dx must have shape (4, 8)"));
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean, rstd, y, dx, Tensor::zeros({9}, DType::f32), db, Tensor{}),
                    ContainsSubstring("dweight must have shape (8,)"));
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean, rstd, y, dx, dw, Tensor::zeros({4, 2}, DType::f32), Tensor{}),
                    ContainsSubstring("dbias must have shape (8,)"));
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, Tensor::zeros({2}, DType::f32), rstd, y, dx, dw, db, Tensor{}),
                    ContainsSubstring("mean must have 4 elements"));
  // backward: dtypes
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean, rstd, y, dx, Tensor::zeros({8}, DType::bf16), db, Tensor{}),
                    ContainsSubstring("dweight must be f32"));
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean, rstd, y, dx, dw, Tensor::zeros({8}, DType::bf16), Tensor{}),
                    ContainsSubstring("dbias must be f32"));
  CHECK_THROWS_WITH(
      ops::layer_norm_backward(x, w, mean, rstd, Tensor::zeros({4, 8}, DType::bf16), dx, dw, db, Tensor{}),
      ContainsSubstring("dy must be f32"));
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean, Tensor::zeros({4}, DType::bf16), y, dx, dw, db, Tensor{}),
                    ContainsSubstring("rstd must be f32"));
  // backward: overlaps
  CHECK_THROWS_WITH(
      ops::layer_norm_backward(big.view(0, {4, 8}), w, mean, rstd, y, big.view(2, {4, 8}), dw, db, Tensor{}),
      ContainsSubstring("dx overlaps"));
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean, rstd, y, dx, dw, dw, Tensor{}),
                    ContainsSubstring("dweight and dbias overlap"));
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean, rstd, y, dx, w, db, Tensor{}),
                    ContainsSubstring("dweight or dbias overlaps"));
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean, rstd, y, dx, dw, x.view(8, {8}), Tensor{}),
                    ContainsSubstring("dweight or dbias overlaps"));
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean, rstd, y, dx, dx.view(0, {8}), db, Tensor{}),
                    ContainsSubstring("dx overlaps"));
  // A rejected backward leaves dweight and dbias alone.
  CHECK_THROWS(ops::layer_norm_backward(x, w, mean, rstd, y, dx, dw, Tensor::zeros({8}, DType::bf16), Tensor{}));
  for (float v : dw.to_vector<float>()) CHECK(v == 0.f);
  CHECK(ops::layer_norm_backward_workspace_bytes(0, 8) == 0);
  CHECK_THROWS_WITH(ops::layer_norm_backward_workspace_bytes(-1, 8), ContainsSubstring("negative extent"));
}

// ---------------------------------------------------------------- gelu

TEST_CASE("gelu forward equals the double-precision formulas, both forms, f32 and bf16", "[ops][gelu]") {
  // Known values of x * Phi(x) and of torch's tanh form at +-1.
  std::vector<double> y(4);
  const std::vector<double> at = {1.0, -1.0, 1.0, -1.0};
  ops::cpu::gelu_forward(at.data(), 2, GeluApproximation::none, y.data());
  ops::cpu::gelu_forward(at.data() + 2, 2, GeluApproximation::tanh, y.data() + 2);
  CHECK(std::abs(y[0] - 0.8413447460685429) < 1e-15);
  CHECK(std::abs(y[1] + 0.15865525393145707) < 1e-15);
  CHECK(std::abs(y[2] - 0.8411919906082768) < 1e-15);
  CHECK(std::abs(y[3] + 0.15880800939172324) < 1e-15);

  // An odd count over the range that matters and the tails (|x| up to 12,
  // where the tanh form's u = kBeta * kKappa * x^3 saturates).
  const int64_t n = 2001;
  std::vector<float> xs(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) xs[std::size_t(i)] = float(-12.0 + 24.0 * double(i) / double(n - 1));
  xs[1000] = 0.f;
  for (GeluApproximation form : kForms) {
    for (DType dt : {DType::f32, DType::bf16}) {
      INFO("form " << ops::gelu_approximation_name(form) << " dtype " << dt);
      Tensor x = Tensor::empty({n}, dt);
      ops::cast(Tensor::from_vector(xs, {n}), x);
      Tensor yt = Tensor::empty({n}, dt);
      yt.fill_bytes_(0xff);
      ops::gelu_forward(x, form, yt);
      const std::vector<double> xd = to_double(x), got = to_double(yt);
      std::vector<double> want(xd.size());
      double max_abs = 0;
      for (std::size_t i = 0; i < xd.size(); ++i) {
        want[i] = gelu_double(xd[i], form);
        max_abs = std::max(max_abs, std::abs(got[i] - want[i]));
      }
      CHECK(rel_err(got, want) <= (dt == DType::bf16 ? 4e-3 : 1e-6));
      // Absolutely: fp32 ~1e-6 at |y| up to 12; bf16 half an ulp of 12 (2^-5).
      CHECK(max_abs <= (dt == DType::bf16 ? 0.032 : 1e-5));
      CHECK(got[1000] == 0.0);
    }
  }
  // The forms differ (by up to 4.7e-4 near x = -2.7): the enum selects.
  std::vector<double> e(1), t(1);
  const double x27 = -2.7;
  ops::cpu::gelu_forward(&x27, 1, GeluApproximation::none, e.data());
  ops::cpu::gelu_forward(&x27, 1, GeluApproximation::tanh, t.data());
  CHECK(std::abs(e[0] - t[0]) > 4e-4);
}

TEST_CASE("gelu backward matches finite differences, both forms (double)", "[ops][gelu]") {
  for (GeluApproximation form : kForms) {
    INFO("form " << ops::gelu_approximation_name(form));
    const std::size_t n = 37;
    std::vector<double> x = normals(n, 201, 2.5);
    x[0] = 0.0;
    x[1] = -6.0;
    x[2] = 5.0;
    const std::vector<double> r = normals(n, 202);  // loss = sum(r * y)
    auto loss = [&] {
      std::vector<double> y(n);
      ops::cpu::gelu_forward(x.data(), int64_t(n), form, y.data());
      return dot(r, y);
    };
    const std::vector<double> fd = numeric_grad(x, loss);
    std::vector<double> dx(n, 99.0);
    ops::cpu::gelu_backward(x.data(), r.data(), int64_t(n), form, dx.data());
    CHECK(rel_err(dx, fd) < kFdTol);
    // The forward in double is the formula.
    std::vector<double> y(n), want(n);
    ops::cpu::gelu_forward(x.data(), int64_t(n), form, y.data());
    for (std::size_t i = 0; i < n; ++i) want[i] = gelu_double(x[i], form);
    CHECK(rel_err(y, want) < 1e-15);
  }
}

TEST_CASE("gelu Tensor API equals the templates, and its f32 backward the double one", "[ops][gelu]") {
  for (GeluApproximation form : kForms) {
    for (DType dt : {DType::f32, DType::bf16}) {
      INFO("form " << ops::gelu_approximation_name(form) << " dtype " << dt);
      ops::detail::memops::visit_f32_bf16(dt, [&](auto tag) {
        using T = decltype(tag);
        Tensor x = filled<T>({3, 5, 7}, 301, 3.f), dy = filled<T>({3, 5, 7}, 302);
        const auto n = static_cast<std::size_t>(x.numel());
        Tensor y = Tensor::empty(x.shape(), dt), dx = Tensor::empty(x.shape(), dt);
        ops::gelu_forward(x, form, y);
        ops::gelu_backward(x, dy, form, dx);
        std::vector<T> yref(n), dxref(n);
        ops::cpu::gelu_forward(x.data<T>(), int64_t(n), form, yref.data());
        ops::cpu::gelu_backward(x.data<T>(), dy.data<T>(), int64_t(n), form, dxref.data());
        CHECK(same_bits(y, yref));
        CHECK(same_bits(dx, dxref));
        const std::vector<double> xd = to_double(x), dyd = to_double(dy);
        std::vector<double> dxd(n);
        ops::cpu::gelu_backward(xd.data(), dyd.data(), int64_t(n), form, dxd.data());
        CHECK(rel_err(to_double(dx), dxd) <= (dt == DType::bf16 ? 4e-3 : 1e-6));
      });
    }
  }
}

TEST_CASE("gelu in place (y = x, dx = dy, dx = x) gives the out-of-place result", "[ops][gelu]") {
  for (GeluApproximation form : kForms) {
    Tensor x = filled<BFloat16>({9, 13}, 401, 2.f), dy = filled<BFloat16>({9, 13}, 402);
    Tensor y = Tensor::empty(x.shape(), DType::bf16), dx = Tensor::empty(x.shape(), DType::bf16);
    ops::gelu_forward(x, form, y);
    ops::gelu_backward(x, dy, form, dx);
    Tensor x2 = x.clone();
    ops::gelu_forward_(x2, form);
    CHECK(same_bits(x2, y));
    Tensor dy2 = dy.clone();
    ops::gelu_backward(x, dy2, form, dy2);
    CHECK(same_bits(dy2, dx));
    Tensor x3 = x.clone();
    ops::gelu_backward(x3, dy, form, x3);
    CHECK(same_bits(x3, dx));
  }
}

TEST_CASE("gelu rejects bad shapes, dtypes, forms and overlaps", "[ops][gelu]") {
  const auto form = GeluApproximation::tanh;
  Tensor x = filled<float>({4, 8}, 501), dy = filled<float>({4, 8}, 502);
  Tensor y = Tensor::empty({4, 8}, DType::f32);
  CHECK_THROWS_WITH(ops::gelu_forward(Tensor::zeros({4, 8}, DType::f16), form, Tensor::empty({4, 8}, DType::f16)),
                    ContainsSubstring("gelu_forward: x must be f32 or bf16"));
  CHECK_THROWS_WITH(ops::gelu_forward(x, form, Tensor::empty({4, 8}, DType::bf16)),
                    ContainsSubstring("gelu_forward: y must be f32"));
  CHECK_THROWS_WITH(ops::gelu_forward(x, form, Tensor::empty({32}, DType::f32)),
                    ContainsSubstring("gelu_forward: y must have shape (4, 8)"));
  CHECK_THROWS_WITH(ops::gelu_forward(x, static_cast<GeluApproximation>(7), y),
                    ContainsSubstring("unknown GeluApproximation 7"));
  CHECK_THROWS_WITH(ops::gelu_forward(x, form, Tensor{}), ContainsSubstring("gelu_forward: y is undefined"));
  Tensor big = Tensor::empty({40}, DType::f32);
  CHECK_THROWS_WITH(ops::gelu_forward(big.view(0, {4, 8}), form, big.view(3, {4, 8})),
                    ContainsSubstring("y partially overlaps x"));
  Tensor dx = Tensor::empty({4, 8}, DType::f32);
  CHECK_THROWS_WITH(ops::gelu_backward(x, Tensor::zeros({4, 8}, DType::bf16), form, dx),
                    ContainsSubstring("gelu_backward: dy must be f32"));
  CHECK_THROWS_WITH(ops::gelu_backward(x, dy, form, Tensor::empty({4, 9}, DType::f32)),
                    ContainsSubstring("gelu_backward: dx must have shape (4, 8)"));
  CHECK_THROWS_WITH(ops::gelu_backward(x, Tensor{}, form, dx), ContainsSubstring("gelu_backward: dy is undefined"));
  CHECK_THROWS_WITH(ops::gelu_backward(x, dy, static_cast<GeluApproximation>(-1), dx),
                    ContainsSubstring("unknown GeluApproximation -1"));
  CHECK_THROWS_WITH(ops::gelu_backward(big.view(0, {4, 8}), dy, form, big.view(1, {4, 8})),
                    ContainsSubstring("dx partially overlaps an input"));
  CHECK_THROWS_WITH(ops::gelu_backward(x, big.view(8, {4, 8}), form, big.view(0, {4, 8})),
                    ContainsSubstring("dx partially overlaps an input"));
  // Empty tensors are fine.
  CHECK_NOTHROW(ops::gelu_forward(Tensor::empty({0, 8}, DType::f32), form, Tensor::empty({0, 8}, DType::f32)));
}
