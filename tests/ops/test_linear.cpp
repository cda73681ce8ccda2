// Linear on the CPU: finite differences of both backwards in double through
// the templates, the Tensor API against a naive triple loop on odd sizes
// (crossing every block edge of the blocked GEMM), the accumulation contract,
// and bad-input errors.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "slime/core/random.hpp"
#include "slime/ops/linear.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;

namespace {

std::vector<double> random_doubles(int64_t n, uint64_t seed) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[std::size_t(i)] = double(random_uniform(seed, uint64_t(i), -1.f, 1.f));
  return v;
}

Tensor random_tensor(const Shape& shape, DType dt, uint64_t seed) {
  Tensor t = Tensor::empty(shape, dt);
  fill_uniform(t, seed, 0, -1.f, 1.f);
  return t;
}

std::vector<double> to_double(const Tensor& t) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  if (t.dtype() == DType::f32) {
    const float* p = t.data<float>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = p[i];
  } else {
    const BFloat16* p = t.data<BFloat16>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = double(float(p[i]));
  }
  return out;
}

// C[m, n] = Σ_p A(m, p) B(n, p), the obvious way.
template <class FA, class FB>
std::vector<double> naive(int64_t M, int64_t N, int64_t P, FA a, FB b) {
  std::vector<double> c(static_cast<std::size_t>(M * N), 0.0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t p = 0; p < P; ++p) s += a(m, p) * b(n, p);
      c[std::size_t(m * N + n)] = s;
    }
  return c;
}

// ‖got − want‖ / ‖want‖ (0 when both are empty or zero).
double rel_error(const std::vector<double>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Every element within what rounding once to `dt` allows: half an ulp of bf16
// (2^-9 relative) or nothing for f32, plus fp32 summation error.
void check_close(const std::vector<double>& got, const std::vector<double>& want, DType dt, double scale) {
  REQUIRE(got.size() == want.size());
  const double rel = dt == DType::bf16 ? std::ldexp(1.0, -8) : 1e-6;
  int bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= rel * std::fabs(want[i]) + 1e-6 * scale)) ++bad;
  CHECK(bad == 0);
}

// L(x, W) = Σ g ⊙ (x · Wᵀ): dL/dx = g · W, dL/dW = gᵀ · x.
double loss(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& g, int64_t T,
            int64_t K, int64_t N) {
  std::vector<double> y(static_cast<std::size_t>(T * N));
  ops::cpu::linear_forward(x.data(), w.data(), T, K, N, y.data());
  double s = 0;
  for (std::size_t i = 0; i < y.size(); ++i) s += g[i] * y[i];
  return s;
}

// Central differences of L at `count` elements of x and of W (all of them when
// count < 0), against the analytic gradients; returns the worst relative error.
double fd_check(int64_t T, int64_t K, int64_t N, int64_t count, uint64_t seed) {
  std::vector<double> x = random_doubles(T * K, seed), w = random_doubles(N * K, seed + 1),
                      g = random_doubles(T * N, seed + 2);
  std::vector<double> dx(static_cast<std::size_t>(T * K), NAN), dw(static_cast<std::size_t>(N * K), 0.0);
  ops::cpu::linear_backward_input(g.data(), w.data(), T, K, N, dx.data());
  ops::cpu::linear_backward_weight(g.data(), x.data(), T, K, N, dw.data());
  // L is linear in each single element, so central differences carry no
  // truncation error at any step; a step of 1e-4 keeps their rounding error
  // (~1e-16 |L| / step) near 1e-10 relative.
  const double eps = 1e-4;
  auto fd = [&](std::vector<double>& v, std::size_t i) {
    const double keep = v[i];
    v[i] = keep + eps;
    const double up = loss(x, w, g, T, K, N);
    v[i] = keep - eps;
    const double down = loss(x, w, g, T, K, N);
    v[i] = keep;
    return (up - down) / (2 * eps);
  };
  auto indices = [&](int64_t n, uint64_t s) {
    std::vector<std::size_t> idx;
    if (count < 0 || count >= n) {
      for (int64_t i = 0; i < n; ++i) idx.push_back(std::size_t(i));
    } else {
      for (int64_t i = 0; i < count; ++i) idx.push_back(std::size_t(philox_word(s, uint64_t(i)) % uint64_t(n)));
    }
    return idx;
  };
  std::vector<double> num, ana;
  for (std::size_t i : indices(T * K, seed + 3)) {
    num.push_back(fd(x, i));
    ana.push_back(dx[i]);
  }
  const double ex = rel_error(num, ana);
  num.clear();
  ana.clear();
  for (std::size_t i : indices(N * K, seed + 4)) {
    num.push_back(fd(w, i));
    ana.push_back(dw[i]);
  }
  const double ew = rel_error(num, ana);
  return std::max(ex, ew);
}

}  // namespace

TEST_CASE("linear backward matches finite differences in double", "[ops][linear]") {
  // Small shapes, every element; then shapes crossing the 64 x 64 x 256 blocks
  // and the 2 x 8 micro-tiles, sampled.
  CHECK(fd_check(3, 5, 4, -1, 11) < 1e-8);
  CHECK(fd_check(1, 1, 1, -1, 12) < 1e-8);
  CHECK(fd_check(7, 2, 9, -1, 13) < 1e-8);
  CHECK(fd_check(67, 259, 66, 40, 14) < 1e-8);
  CHECK(fd_check(130, 17, 3, 40, 15) < 1e-8);
}

TEST_CASE("linear tensor API matches a naive triple loop on odd sizes", "[ops][linear]") {
  const int64_t kn[][2] = {{1, 1}, {1, 33}, {33, 255}, {255, 33}, {1000, 17}, {17, 1000}, {1000, 255}};
  uint64_t seed = 100;
  // (inputs, output): f32 -> f32, bf16 -> bf16, bf16 -> f32.
  const DType pairs[][2] = {{DType::f32, DType::f32}, {DType::bf16, DType::bf16}, {DType::bf16, DType::f32}};
  for (const auto& pair : pairs) {
    const DType dt = pair[0], out_dt = pair[1];
    for (int64_t T : {1, 17, 127}) {
      for (const auto& s : kn) {
        const int64_t K = s[0], N = s[1];
        INFO("dtype " << dtype_name(dt) << " out " << dtype_name(out_dt) << " T=" << T << " K=" << K << " N=" << N);
        seed += 10;
        Tensor x = random_tensor({T, K}, dt, seed), w = random_tensor({N, K}, dt, seed + 1),
               dy = random_tensor({T, N}, dt, seed + 2);
        const std::vector<double> xd = to_double(x), wd = to_double(w), dyd = to_double(dy);

        // y = x · Wᵀ
        Tensor y = Tensor::empty({T, N}, out_dt);
        y.fill_bytes_(0xff);
        ops::linear_forward(x, w, y);
        const auto y_ref = naive(
            T, N, K, [&](int64_t t, int64_t k) { return xd[std::size_t(t * K + k)]; },
            [&](int64_t n, int64_t k) { return wd[std::size_t(n * K + k)]; });
        check_close(to_double(y), y_ref, out_dt, std::sqrt(double(K)));

        // dx = dy · W, then dx += dy · W on top of random values.
        const auto dx_ref = naive(
            T, K, N, [&](int64_t t, int64_t n) { return dyd[std::size_t(t * N + n)]; },
            [&](int64_t k, int64_t n) { return wd[std::size_t(n * K + k)]; });
        Tensor dx = Tensor::empty({T, K}, out_dt);
        dx.fill_bytes_(0xff);
        ops::linear_backward_input(dy, w, dx);
        check_close(to_double(dx), dx_ref, out_dt, std::sqrt(double(N)));
        Tensor dx_acc = random_tensor({T, K}, out_dt, seed + 3);
        std::vector<double> dx_acc_ref = to_double(dx_acc);
        for (std::size_t i = 0; i < dx_acc_ref.size(); ++i) dx_acc_ref[i] += dx_ref[i];
        ops::linear_backward_input(dy, w, dx_acc, /*accumulate=*/true);
        check_close(to_double(dx_acc), dx_acc_ref, out_dt, std::sqrt(double(N)));

        // dW += dyᵀ · x on top of random values (always f32).
        const auto dw_ref0 = naive(
            N, K, T, [&](int64_t n, int64_t t) { return dyd[std::size_t(t * N + n)]; },
            [&](int64_t k, int64_t t) { return xd[std::size_t(t * K + k)]; });
        Tensor dw = random_tensor({N, K}, DType::f32, seed + 4);
        std::vector<double> dw_ref = to_double(dw);
        for (std::size_t i = 0; i < dw_ref.size(); ++i) dw_ref[i] += dw_ref0[i];
        ops::linear_backward_weight(dy, x, dw);
        check_close(to_double(dw), dw_ref, DType::f32, std::sqrt(double(T)));
      }
    }
  }
}

TEST_CASE("linear with empty extents", "[ops][linear]") {
  // K = 0: y is an empty sum, written as zeros; dW of [N, 0] and dx of [T, 0] are empty.
  Tensor x = Tensor::empty({5, 0}, DType::bf16), w = Tensor::empty({3, 0}, DType::bf16);
  Tensor y = Tensor::empty({5, 3}, DType::bf16);
  y.fill_bytes_(0xff);
  ops::linear_forward(x, w, y);
  for (double v : to_double(y)) CHECK(v == 0.0);
  Tensor dy = random_tensor({5, 3}, DType::bf16, 1);
  Tensor dx = Tensor::empty({5, 0}, DType::bf16);
  Tensor dw = Tensor::zeros({3, 0}, DType::f32);
  ops::linear_backward(dy, x, w, dx, dw);

  // T = 0: nothing to write for y and dx; dW += an empty sum leaves it as it was.
  Tensor x0 = Tensor::empty({0, 4}, DType::f32), w0 = random_tensor({6, 4}, DType::f32, 2);
  Tensor y0 = Tensor::empty({0, 6}, DType::f32), dy0 = Tensor::empty({0, 6}, DType::f32);
  ops::linear_forward(x0, w0, y0);
  Tensor dw0 = random_tensor({6, 4}, DType::f32, 3);
  const auto before = to_double(dw0);
  Tensor dx0 = Tensor::empty({0, 4}, DType::f32);
  ops::linear_backward(dy0, x0, w0, dx0, dw0);
  CHECK(to_double(dw0) == before);

  // N = 0: y is [T, 0]; dx = dy · W is an empty sum, zeros.
  Tensor x1 = random_tensor({2, 4}, DType::f32, 4), w1 = Tensor::empty({0, 4}, DType::f32);
  Tensor y1 = Tensor::empty({2, 0}, DType::f32), dy1 = Tensor::empty({2, 0}, DType::f32);
  ops::linear_forward(x1, w1, y1);
  Tensor dx1 = Tensor::empty({2, 4}, DType::f32);
  dx1.fill_bytes_(0xff);
  ops::linear_backward_input(dy1, w1, dx1);
  for (double v : to_double(dx1)) CHECK(v == 0.0);
}

TEST_CASE("linear gradients follow the accumulation contract", "[ops][linear]") {
  const int64_t T = 19, K = 37, N = 21;
  Tensor x = random_tensor({T, K}, DType::bf16, 7), w = random_tensor({N, K}, DType::bf16, 8),
         dy = random_tensor({T, N}, DType::bf16, 9);

  // dW accumulates: two calls from zero give exactly twice one call.
  Tensor dw1 = Tensor::zeros({N, K}, DType::f32), dw2 = Tensor::zeros({N, K}, DType::f32);
  ops::linear_backward_weight(dy, x, dw1);
  ops::linear_backward_weight(dy, x, dw2);
  ops::linear_backward_weight(dy, x, dw2);
  const auto one = to_double(dw1), two = to_double(dw2);
  for (std::size_t i = 0; i < one.size(); ++i) REQUIRE(two[i] == 2 * one[i]);

  // dx is written by default (old contents, even NaN, do not matter) ...
  Tensor dx_a = Tensor::empty({T, K}, DType::f32), dx_b = Tensor::empty({T, K}, DType::f32);
  dx_a.fill_bytes_(0xff);
  dx_b.zero_();
  ops::linear_backward_input(dy, w, dx_a);
  ops::linear_backward_input(dy, w, dx_b);
  CHECK(to_double(dx_a) == to_double(dx_b));
  // ... and added with accumulate: twice from zero is twice once.
  ops::linear_backward_input(dy, w, dx_b, /*accumulate=*/true);
  const auto dx1 = to_double(dx_a), dx2 = to_double(dx_b);
  for (std::size_t i = 0; i < dx1.size(); ++i) REQUIRE(dx2[i] == 2 * dx1[i]);

  // linear_backward = the two calls; an undefined dx or dw is skipped.
  Tensor dx_c = Tensor::empty({T, K}, DType::f32), dw_c = Tensor::zeros({N, K}, DType::f32);
  ops::linear_backward(dy, x, w, dx_c, dw_c);
  CHECK(to_double(dx_c) == dx1);
  CHECK(to_double(dw_c) == one);
  ops::linear_backward(dy, x, w, Tensor{}, dw_c);
  CHECK(to_double(dw_c) == two);
  ops::linear_backward(dy, x, w, dx_c, Tensor{}, /*accumulate_dx=*/true);
  CHECK(to_double(dx_c) == dx2);
}

TEST_CASE("linear flattens leading extents and writes into views", "[ops][linear]") {
  const int64_t K = 24, N = 10;
  Tensor x = random_tensor({2, 3, K}, DType::bf16, 21), w = random_tensor({N, K}, DType::bf16, 22);
  Tensor y3 = Tensor::empty({2, 3, N}, DType::bf16), y2 = Tensor::empty({6, N}, DType::bf16);
  ops::linear_forward(x, w, y3);
  ops::linear_forward(x.reshape({6, K}), w, y2);
  CHECK(to_double(y3) == to_double(y2));

  // Rows 2..4 of a bigger buffer: the rows around them are left alone.
  Tensor big = Tensor::empty({8, N}, DType::bf16);
  big.fill_bytes_(0xff);
  ops::linear_forward(x.reshape({6, K}).slice_rows(1, 3), w, big.slice_rows(2, 3));
  const auto b = to_double(big), ref = to_double(y2);
  for (int64_t i = 0; i < 8 * N; ++i) {
    const int64_t row = i / N;
    if (row >= 2 && row < 5)
      CHECK(b[std::size_t(i)] == ref[std::size_t(i + (1 - 2) * N)]);
    else
      CHECK(std::isnan(b[std::size_t(i)]));
  }
}

TEST_CASE("linear rejects bad inputs with clear errors", "[ops][linear]") {
  const int64_t T = 4, K = 6, N = 5;
  Tensor x = random_tensor({T, K}, DType::bf16, 31), w = random_tensor({N, K}, DType::bf16, 32);
  Tensor y = Tensor::empty({T, N}, DType::bf16), dy = random_tensor({T, N}, DType::bf16, 33);
  Tensor dx = Tensor::empty({T, K}, DType::bf16), dw = Tensor::zeros({N, K}, DType::f32);

  // K mismatch.
  Tensor x_bad = random_tensor({T, K + 1}, DType::bf16, 34);
  CHECK_THROWS_WITH(ops::linear_forward(x_bad, w, y), ContainsSubstring("x must have shape (..., 6)"));
  CHECK_THROWS_WITH(ops::linear_backward_weight(dy, x_bad, dw), ContainsSubstring("x must have shape (..., 6)"));
  // dy's features are N, not K.
  CHECK_THROWS_WITH(ops::linear_backward_input(x, w, dx), ContainsSubstring("dy must have shape (..., 5)"));
  // w not 2-D.
  CHECK_THROWS_WITH(ops::linear_forward(x, w.reshape({N * K}), y), ContainsSubstring("w must be 2-D"));

  // dtype mismatch and unsupported dtypes.
  Tensor w32 = random_tensor({N, K}, DType::f32, 35);
  CHECK_THROWS_WITH(ops::linear_forward(x, w32, y), ContainsSubstring("x and w must have the same dtype"));
  CHECK_THROWS_WITH(ops::linear_backward_weight(random_tensor({T, N}, DType::f32, 36), x, dw),
                    ContainsSubstring("dy and x must have the same dtype"));
  Tensor x16 = random_tensor({T, K}, DType::f16, 37), w16 = random_tensor({N, K}, DType::f16, 38);
  CHECK_THROWS_WITH(ops::linear_forward(x16, w16, Tensor::empty({T, N}, DType::f16)),
                    ContainsSubstring("unsupported input dtype f16"));
  // f32 inputs never produce bf16.
  Tensor x32 = random_tensor({T, K}, DType::f32, 39);
  CHECK_THROWS_WITH(ops::linear_forward(x32, w32, y), ContainsSubstring("y must be f32 for f32 inputs"));

  // Wrong output shapes.
  CHECK_THROWS_WITH(ops::linear_forward(x, w, Tensor::empty({T, N + 1}, DType::bf16)),
                    ContainsSubstring("y must have shape (4, 5)"));
  CHECK_THROWS_WITH(ops::linear_backward_input(dy, w, Tensor::empty({T + 1, K}, DType::bf16)),
                    ContainsSubstring("dx must have shape (4, 6)"));
  CHECK_THROWS_WITH(ops::linear_backward_weight(dy, x, Tensor::zeros({N, K + 1}, DType::f32)),
                    ContainsSubstring("x must have shape (..., 7)"));
  CHECK_THROWS_WITH(ops::linear_backward_weight(dy, x, Tensor::zeros({N + 1, K}, DType::f32)),
                    ContainsSubstring("dy must have shape (4, 6)"));
  CHECK_THROWS_WITH(ops::linear_backward(dy, x, w, dx, Tensor::zeros({K, N}, DType::f32)),
                    ContainsSubstring("dw must have w's shape"));
  CHECK_THROWS_WITH(ops::linear_backward(dy, x, w, Tensor::empty({T, N}, DType::bf16), dw),
                    ContainsSubstring("dx must have x's shape"));

  // dW must be f32.
  CHECK_THROWS_WITH(ops::linear_backward_weight(dy, x, Tensor::zeros({N, K}, DType::bf16)),
                    ContainsSubstring("dw must be f32"));

  // Undefined tensors and outputs overlapping inputs.
  CHECK_THROWS_WITH(ops::linear_forward(x, w, Tensor{}), ContainsSubstring("y is undefined"));
  Tensor xy = random_tensor({T, K}, DType::bf16, 40);
  CHECK_THROWS_WITH(ops::linear_forward(xy, random_tensor({K, K}, DType::bf16, 41), xy),
                    ContainsSubstring("y overlaps x"));

  // Every error is a slime::Error.
  CHECK_THROWS_AS(ops::linear_forward(x_bad, w, y), slime::Error);
}
