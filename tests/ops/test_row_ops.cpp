// CPU tests of the row ops (ops/row_ops.hpp): bias_add_, bias_backward and the
// 4-tap position-embedding resample (pos_embed_interpolate forward and
// backward, pos_embed_row_taps). The references are checked against naive
// double-precision formulas written out here, every backward against central
// finite differences in double through the CPU templates, the Tensor API
// against the templates bit for bit; odd sizes and empty rows; bad input must
// throw clear errors. (Device mismatches need a GPU: test_row_ops_gpu.cu.)
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "slime/core/random.hpp"
#include "slime/ops/row_ops.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;

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

Tensor filled(const Shape& shape, DType dt, uint64_t seed, float stddev = 1.f, float mean = 0.f) {
  Tensor t = Tensor::empty(shape, dt);
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
  return a.nbytes() == b.nbytes() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

// Random taps of P patches into an S-row table: ids [4, P] in [0, S),
// weights [4, P] (any values; the op does not require a partition of unity).
struct Taps {
  std::vector<int32_t> ids;
  std::vector<double> weights;
};
Taps random_taps(int64_t patches, int64_t table_rows, uint64_t seed) {
  Taps t;
  const std::vector<double> u = normals(std::size_t(4 * patches), seed);
  t.weights = normals(std::size_t(4 * patches), seed + 1, 0.5, 0.25);
  for (std::size_t i = 0; i < u.size(); ++i)
    t.ids.push_back(int32_t(std::min<int64_t>(int64_t(std::abs(u[i]) * 1000.0) % table_rows, table_rows - 1)));
  return t;
}

Tensor ids_tensor(const Taps& t, int64_t patches) { return Tensor::from_vector(t.ids, {4, patches}); }
Tensor weights_tensor(const Taps& t, int64_t patches) {
  std::vector<float> w(t.weights.begin(), t.weights.end());
  return Tensor::from_vector(w, {4, patches});
}

// out[p, d] = sum_k w[k, p] * table[ids[k, p], d], written out in double.
std::vector<double> interpolate_double(const std::vector<double>& table, const Taps& t, int64_t patches, int64_t dim) {
  std::vector<double> out(std::size_t(patches * dim), 0.0);
  for (int64_t p = 0; p < patches; ++p)
    for (int64_t k = 0; k < 4; ++k) {
      const std::size_t i = std::size_t(k * patches + p);
      for (int64_t d = 0; d < dim; ++d)
        out[std::size_t(p * dim + d)] += t.weights[i] * table[std::size_t(int64_t(t.ids[i]) * dim + d)];
    }
  return out;
}

struct Extents {
  int64_t rows, n;
};

}  // namespace

// ---------------------------------------------------------------- bias

TEST_CASE("bias_add_ adds the bias to every row with one rounding (f32, bf16, odd sizes, rank 3)",
          "[ops][row_ops][bias]") {
  uint64_t seed = 10;
  for (Extents e : {Extents{1, 1}, Extents{5, 7}, Extents{3, 33}, Extents{17, 1001}}) {
    for (DType dt : {DType::f32, DType::bf16}) {
      INFO("rows " << e.rows << " n " << e.n << " " << dt);
      // [rows, 1, n]: any rank, rows = numel / n.
      Tensor y = filled({e.rows, 1, e.n}, dt, ++seed, 2.f);
      const Tensor b = filled({e.n}, dt, ++seed, 3.f);
      const std::vector<double> y0 = to_double(y), bd = to_double(b);
      ops::bias_add_(y, b);
      const std::vector<double> got = to_double(y);
      for (int64_t r = 0; r < e.rows; ++r)
        for (int64_t c = 0; c < e.n; ++c) {
          const std::size_t i = std::size_t(r * e.n + c);
          // The fp32 sum is exact in double for these magnitudes' ulps; one
          // rounding into the dtype.
          const float sum = float(y0[i]) + float(bd[std::size_t(c)]);
          const double want = dt == DType::bf16 ? double(float(BFloat16(sum))) : double(sum);
          REQUIRE(got[i] == want);
        }
    }
  }
}

TEST_CASE("bias_backward: column sums written or accumulated, empty rows", "[ops][row_ops][bias]") {
  uint64_t seed = 30;
  for (Extents e : {Extents{1, 1}, Extents{6, 5}, Extents{33, 17}, Extents{300, 129}}) {
    for (DType dt : {DType::f32, DType::bf16}) {
      for (bool accumulate : {false, true}) {
        INFO("rows " << e.rows << " n " << e.n << " " << dt << " accumulate " << accumulate);
        const Tensor dy = filled({e.rows, e.n}, dt, ++seed);
        Tensor db = filled({e.n}, DType::f32, ++seed);
        const std::vector<double> db0 = to_double(db), dyd = to_double(dy);
        ops::bias_backward(dy, db, accumulate, Tensor{});
        std::vector<double> want(std::size_t(e.n), 0.0);
        for (int64_t c = 0; c < e.n; ++c) {
          for (int64_t r = 0; r < e.rows; ++r) want[std::size_t(c)] += dyd[std::size_t(r * e.n + c)];
          if (accumulate) want[std::size_t(c)] += db0[std::size_t(c)];
        }
        // fp32 sums of up to 300 terms of order 1.
        CHECK(rel_err(to_double(db), want) <= 1e-6);
      }
    }
  }
  // No rows: written as zero, or left unchanged when accumulating.
  for (DType dt : {DType::f32, DType::bf16}) {
    const Tensor dy = Tensor::empty({0, 9}, dt);
    Tensor db = filled({9}, DType::f32, 77);
    const Tensor keep = db.clone();
    ops::bias_backward(dy, db, true, Tensor{});
    CHECK(same_bits(db, keep));
    ops::bias_backward(dy, db, false, Tensor{});
    CHECK(to_double(db) == std::vector<double>(9, 0.0));
  }
  // bias_add_ on no rows changes nothing and reads nothing.
  ops::bias_add_(Tensor::empty({0, 4}, DType::bf16), Tensor::zeros({4}, DType::bf16));
}

TEST_CASE("bias_backward is the finite-difference gradient of bias_add_ (double)", "[ops][row_ops][bias]") {
  for (Extents e : {Extents{4, 7}, Extents{3, 13}, Extents{1, 2}}) {
    INFO("rows " << e.rows << " n " << e.n);
    const auto n = std::size_t(e.rows * e.n);
    const std::vector<double> y0 = normals(n, 41), r = normals(n, 42);  // loss = sum(r * (y0 + b))
    std::vector<double> b = normals(std::size_t(e.n), 43);
    auto loss = [&] {
      std::vector<double> y = y0;
      ops::cpu::bias_add(y.data(), b.data(), e.rows, e.n);
      return dot(r, y);
    };
    const std::vector<double> fd = numeric_grad(b, loss);
    const std::vector<double> db0 = normals(std::size_t(e.n), 44);
    std::vector<double> db = db0;
    ops::cpu::bias_backward(r.data(), e.rows, e.n, db.data(), /*accumulate=*/true);
    for (std::size_t i = 0; i < db.size(); ++i) db[i] -= db0[i];
    CHECK(rel_err(db, fd) < kFdTol);
    std::vector<double> db_written(std::size_t(e.n), 99.0);
    ops::cpu::bias_backward(r.data(), e.rows, e.n, db_written.data(), /*accumulate=*/false);
    CHECK(rel_err(db_written, fd) < kFdTol);
  }
}

TEST_CASE("bias_add_ / bias_backward: bad inputs are clear errors", "[ops][row_ops][bias]") {
  const Tensor y = Tensor::zeros({4, 8}, DType::bf16);
  CHECK_THROWS_WITH(ops::bias_add_(y, Tensor::zeros({8}, DType::f32)), ContainsSubstring("bias (y's dtype)"));
  CHECK_THROWS_WITH(ops::bias_add_(y, Tensor::zeros({7}, DType::bf16)), ContainsSubstring("bias (y's last dim)"));
  CHECK_THROWS_WITH(ops::bias_add_(Tensor::zeros({4, 8}, DType::f16), Tensor::zeros({8}, DType::f16)),
                    ContainsSubstring("bias_add_: y must be f32 or bf16"));
  CHECK_THROWS_WITH(ops::bias_add_(Tensor{}, Tensor::zeros({8}, DType::bf16)), ContainsSubstring("undefined"));
  CHECK_THROWS_WITH(ops::bias_add_(Tensor::zeros({}, DType::f32), Tensor::zeros({1}, DType::f32)),
                    ContainsSubstring("at least 1 dim"));
  Tensor big = Tensor::zeros({40}, DType::f32);
  CHECK_THROWS_WITH(ops::bias_add_(big.view(0, {4, 8}), big.view(4, {8})), ContainsSubstring("y overlaps bias"));

  Tensor db = Tensor::zeros({8}, DType::f32);
  CHECK_THROWS_WITH(ops::bias_backward(y, Tensor::zeros({8}, DType::bf16), false, Tensor{}),
                    ContainsSubstring("dbias must be f32"));
  CHECK_THROWS_WITH(ops::bias_backward(y, Tensor::zeros({9}, DType::f32), false, Tensor{}),
                    ContainsSubstring("dbias (dy's last dim)"));
  CHECK_THROWS_WITH(ops::bias_backward(Tensor::zeros({4, 8}, DType::i32), db, false, Tensor{}),
                    ContainsSubstring("bias_backward: dy must be f32 or bf16"));
  CHECK_THROWS_WITH(ops::bias_backward(big.view(0, {4, 8}), big.view(28, {8}), true, Tensor{}),
                    ContainsSubstring("dbias overlaps dy"));
  CHECK_THROWS_WITH(ops::bias_backward_workspace_bytes(-1, 8), ContainsSubstring("negative extent"));
}

TEST_CASE("bias_backward_workspace_bytes: chunks of rows independent of the device", "[ops][row_ops][bias]") {
  using P = ops::cuda::BiasBackwardPolicy;
  CHECK(ops::bias_backward_workspace_bytes(0, 4096) == 0);
  CHECK(ops::bias_backward_workspace_bytes(100, 0) == 0);
  CHECK(ops::bias_backward_workspace_bytes(1, 3) == 3 * sizeof(float));
  CHECK(ops::bias_backward_workspace_bytes(16384, 4096) == 128 * 4096 * sizeof(float));
  for (int64_t rows : {int64_t(1), int64_t(127), int64_t(128), int64_t(129), int64_t(16384), int64_t(1) << 20,
                       (int64_t(1) << 20) + 3}) {
    INFO("rows " << rows);
    const int64_t cr = P::chunk_rows(rows), chunks = P::chunks(rows);
    CHECK(cr % P::kThreadsY == 0);
    CHECK(cr >= P::kMinChunkRows);
    CHECK(chunks <= P::kMaxChunks);
    CHECK(chunks * cr >= rows);
    CHECK((chunks - 1) * cr < rows);
  }
}

// ---------------------------------------------------------------- pos_embed_interpolate

TEST_CASE("pos_embed_interpolate_forward equals the 4-tap formula (f32, bf16, odd sizes, accumulate)",
          "[ops][row_ops][pos_embed]") {
  uint64_t seed = 200;
  struct Case {
    int64_t patches, rows, dim;
  };
  for (Case c : {Case{1, 1, 1}, Case{7, 9, 5}, Case{33, 16, 13}, Case{130, 49, 40}}) {
    for (DType dt : {DType::f32, DType::bf16}) {
      for (bool accumulate : {false, true}) {
        INFO("P " << c.patches << " S " << c.rows << " D " << c.dim << " " << dt << " accumulate " << accumulate);
        const Taps t = random_taps(c.patches, c.rows, ++seed);
        const Tensor table = filled({c.rows, c.dim}, dt, ++seed);
        Tensor out = filled({c.patches, c.dim}, dt, ++seed);
        const std::vector<double> out0 = to_double(out);
        if (!accumulate) out.fill_bytes_(0xff);  // written, never read
        ops::pos_embed_interpolate_forward(table, ids_tensor(t, c.patches), weights_tensor(t, c.patches), out,
                                           accumulate);
        Taps tf = t;  // the weights as the op sees them (f32)
        for (double& w : tf.weights) w = double(float(w));
        std::vector<double> want = interpolate_double(to_double(table), tf, c.patches, c.dim);
        if (accumulate)
          for (std::size_t i = 0; i < want.size(); ++i) want[i] += out0[i];
        // bf16: one rounding (2^-9 relative); f32: a few fp32 roundings.
        CHECK(rel_err(to_double(out), want) <= (dt == DType::bf16 ? 4e-3 : 1e-6));
      }
    }
  }
}

TEST_CASE("pos_embed_interpolate: the Tensor API equals the templates bit for bit", "[ops][row_ops][pos_embed]") {
  const int64_t P = 29, S = 12, D = 19;
  const Taps t = random_taps(P, S, 300);
  const Tensor ids = ids_tensor(t, P), w = weights_tensor(t, P);
  for (DType dt : {DType::f32, DType::bf16}) {
    INFO(dt);
    ops::detail::memops::visit_f32_bf16(dt, [&](auto tag) {
      using T = decltype(tag);
      const Tensor table = filled({S, D}, dt, 301), d_out = filled({P, D}, dt, 302);
      Tensor out = filled({P, D}, dt, 303);
      Tensor want = out.clone();
      ops::pos_embed_interpolate_forward(table, ids, w, out, true);
      ops::cpu::pos_embed_interpolate_forward(table.data<T>(), S, D, ids.data<int32_t>(), w.data<float>(), P,
                                              want.data<T>(), true);
      CHECK(same_bits(out, want));
      Tensor dt_got = filled({S, D}, DType::f32, 304);
      Tensor dt_want = dt_got.clone();
      ops::pos_embed_interpolate_backward(d_out, ids, w, ops::PosEmbedRowTaps{}, dt_got);
      ops::cpu::pos_embed_interpolate_backward(d_out.data<T>(), ids.data<int32_t>(), w.data<float>(), P, S, D,
                                               dt_want.data<float>());
      CHECK(same_bits(dt_got, dt_want));
    });
  }
}

TEST_CASE("pos_embed_interpolate_backward: the formula, and finite differences of the forward (double)",
          "[ops][row_ops][pos_embed]") {
  struct Case {
    int64_t patches, rows, dim;
  };
  for (Case c : {Case{5, 4, 3}, Case{9, 16, 2}, Case{1, 1, 4}}) {
    INFO("P " << c.patches << " S " << c.rows << " D " << c.dim);
    const Taps t = random_taps(c.patches, c.rows, 400 + uint64_t(c.patches));
    std::vector<double> table = normals(std::size_t(c.rows * c.dim), 401);
    const std::vector<double> r = normals(std::size_t(c.patches * c.dim), 402);  // loss = sum(r * out)
    auto loss = [&] {
      std::vector<double> out(r.size());
      ops::cpu::pos_embed_interpolate_forward(table.data(), c.rows, c.dim, t.ids.data(), t.weights.data(), c.patches,
                                              out.data(), false);
      return dot(r, out);
    };
    // The forward in double is the formula.
    std::vector<double> out(r.size(), 5.0);
    ops::cpu::pos_embed_interpolate_forward(table.data(), c.rows, c.dim, t.ids.data(), t.weights.data(), c.patches,
                                            out.data(), false);
    CHECK(rel_err(out, interpolate_double(table, t, c.patches, c.dim)) < 1e-14);

    const std::vector<double> fd = numeric_grad(table, loss);
    const std::vector<double> g0 = normals(table.size(), 403);
    std::vector<double> g = g0;
    ops::cpu::pos_embed_interpolate_backward(r.data(), t.ids.data(), t.weights.data(), c.patches, c.rows, c.dim,
                                             g.data());
    for (std::size_t i = 0; i < g.size(); ++i) g[i] -= g0[i];
    CHECK(rel_err(g, fd) < kFdTol);
  }
}

TEST_CASE("pos_embed_interpolate_backward accumulates f32 (bf16 d_out) and touches rows without taps by + 0",
          "[ops][row_ops][pos_embed]") {
  const int64_t P = 41, S = 30, D = 11;
  // Taps only into rows [0, 10): rows 10 .. 29 have none.
  Taps t = random_taps(P, 10, 500);
  for (DType dt : {DType::f32, DType::bf16}) {
    INFO(dt);
    const Tensor d_out = filled({P, D}, dt, 501);
    Tensor d_table = filled({S, D}, DType::f32, 502);
    const std::vector<double> base = to_double(d_table);
    ops::pos_embed_interpolate_backward(d_out, ids_tensor(t, P), weights_tensor(t, P), ops::PosEmbedRowTaps{}, d_table);
    const std::vector<double> dod = to_double(d_out), got = to_double(d_table);
    std::vector<double> want = base;
    for (int64_t i = 0; i < 4 * P; ++i)
      for (int64_t d = 0; d < D; ++d)
        want[std::size_t(t.ids[std::size_t(i)] * D + d)] +=
            double(float(t.weights[std::size_t(i)])) * dod[std::size_t((i % P) * D + d)];
    CHECK(rel_err(got, want) <= 1e-6);
    for (std::size_t i = std::size_t(10 * D); i < got.size(); ++i) REQUIRE(got[i] == base[i]);
  }
}

TEST_CASE("pos_embed_row_taps groups the taps by table row in increasing tap order", "[ops][row_ops][pos_embed]") {
  const int64_t P = 37, S = 11;
  const Taps t = random_taps(P, S, 600);
  const ops::PosEmbedRowTaps rt = ops::pos_embed_row_taps(ids_tensor(t, P), S);
  REQUIRE(rt.offsets.shape() == Shape{S + 1});
  REQUIRE(rt.taps.shape() == Shape{4 * P});
  const std::vector<int32_t> off = rt.offsets.to_vector<int32_t>(), taps = rt.taps.to_vector<int32_t>();
  CHECK(off.front() == 0);
  CHECK(off.back() == 4 * P);
  std::vector<int> seen(std::size_t(4 * P), 0);
  for (int64_t s = 0; s < S; ++s)
    for (int32_t i = off[std::size_t(s)]; i < off[std::size_t(s) + 1]; ++i) {
      const int32_t tap = taps[std::size_t(i)];
      REQUIRE(t.ids[std::size_t(tap)] == s);
      if (i > off[std::size_t(s)]) REQUIRE(taps[std::size_t(i) - 1] < tap);
      ++seen[std::size_t(tap)];
    }
  CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
  // No patches: every row empty.
  const ops::PosEmbedRowTaps none = ops::pos_embed_row_taps(Tensor::empty({4, 0}, DType::i32), 3);
  CHECK(none.offsets.to_vector<int32_t>() == std::vector<int32_t>{0, 0, 0, 0});
  CHECK(none.taps.numel() == 0);
}

TEST_CASE("pos_embed_interpolate: no patches writes nothing and adds zero", "[ops][row_ops][pos_embed]") {
  const Tensor ids = Tensor::empty({4, 0}, DType::i32), w = Tensor::empty({4, 0}, DType::f32);
  const Tensor table = filled({5, 3}, DType::bf16, 700);
  ops::pos_embed_interpolate_forward(table, ids, w, Tensor::empty({0, 3}, DType::bf16), false);
  Tensor d_table = filled({5, 3}, DType::f32, 701);
  const Tensor keep = d_table.clone();
  ops::pos_embed_interpolate_backward(Tensor::empty({0, 3}, DType::bf16), ids, w, ops::PosEmbedRowTaps{}, d_table);
  CHECK(to_double(d_table) == to_double(keep));
}

TEST_CASE("pos_embed_interpolate: bad ids and bad inputs are clear errors", "[ops][row_ops][pos_embed]") {
  const int64_t P = 6, S = 5, D = 4;
  Taps t = random_taps(P, S, 800);
  t.ids[std::size_t(2 * P + 3)] = int32_t(S);  // tap k = 2 of patch 3
  const Tensor ids = ids_tensor(t, P), w = weights_tensor(t, P);
  const Tensor table = filled({S, D}, DType::bf16, 801);
  Tensor out = Tensor::zeros({P, D}, DType::bf16);
  const Tensor keep = out.clone();
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_forward(table, ids, w, out, false),
                    ContainsSubstring("ids[2][3] = 5 is outside the table's rows [0, 5)"));
  CHECK(same_bits(out, keep));  // nothing written
  Tensor d_table = Tensor::zeros({S, D}, DType::f32);
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_backward(out, ids, w, ops::PosEmbedRowTaps{}, d_table),
                    ContainsSubstring("ids[2][3] = 5 is outside"));
  CHECK(to_double(d_table) == std::vector<double>(std::size_t(S * D), 0.0));
  CHECK_THROWS_WITH(ops::pos_embed_row_taps(ids, S), ContainsSubstring("pos_embed_csr: ids[2][3] = 5"));
  Taps neg = random_taps(P, S, 802);
  neg.ids[0] = -1;
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_forward(table, ids_tensor(neg, P), w, out, true),
                    ContainsSubstring("ids[0][0] = -1 is outside"));

  const Taps good = random_taps(P, S, 803);
  const Tensor gi = ids_tensor(good, P);
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_forward(table, Tensor::zeros({3, P}, DType::i32), w, out, false),
                    ContainsSubstring("ids must be [4, patches]"));
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_forward(table, Tensor::zeros({4, P}, DType::i64), w, out, false),
                    ContainsSubstring("ids must be i32"));
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_forward(table, gi, Tensor::zeros({4, P}, DType::bf16), out, false),
                    ContainsSubstring("weights must be f32"));
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_forward(table, gi, Tensor::zeros({4, P + 1}, DType::f32), out, false),
                    ContainsSubstring("weights (ids' shape)"));
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_forward(table, gi, w, Tensor::zeros({P, D}, DType::f32), false),
                    ContainsSubstring("out (the table's dtype)"));
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_forward(table, gi, w, Tensor::zeros({P, D + 1}, DType::bf16), false),
                    ContainsSubstring("out [patches, dim]"));
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_forward(Tensor::zeros({S * D}, DType::bf16), gi, w, out, false),
                    ContainsSubstring("table must be 2-d"));
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_forward(Tensor::zeros({S, D}, DType::f16), gi, w, out, false),
                    ContainsSubstring("table must be f32 or bf16"));
  Tensor shared = Tensor::zeros({2 * S * D}, DType::bf16);
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_forward(shared.view(0, {S, D}), gi, w, shared.view(D, {P, D}), false),
                    ContainsSubstring("out overlaps an input"));

  CHECK_THROWS_WITH(
      ops::pos_embed_interpolate_backward(out, gi, w, ops::PosEmbedRowTaps{}, Tensor::zeros({S, D}, DType::bf16)),
      ContainsSubstring("d_table must be f32"));
  CHECK_THROWS_WITH(
      ops::pos_embed_interpolate_backward(out, gi, w, ops::PosEmbedRowTaps{}, Tensor::zeros({S, D + 1}, DType::f32)),
      ContainsSubstring("d_table must be [rows, 4]"));
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_backward(Tensor::zeros({P + 1, D}, DType::bf16), gi, w,
                                                        ops::PosEmbedRowTaps{}, d_table),
                    ContainsSubstring("d_out must be [patches = 6, dim]"));
  CHECK_THROWS_WITH(ops::pos_embed_row_taps(Tensor::zeros({2, P}, DType::i32), S),
                    ContainsSubstring("ids must be [4, patches]"));
  CHECK_THROWS_WITH(ops::pos_embed_row_taps(Tensor::zeros({4, P}, DType::i64), S),
                    ContainsSubstring("ids must be i32"));
}
