// The Qwen3-VL vision tower's ops on the GPU (layer_norm, gelu) against the
// CPU reference on fresh random inputs: f32 and bf16 (every activation /
// parameter dtype pair for layer_norm), odd sizes (rows 1, 17, 577; widths
// not multiples of 4 or 8, which take the one-element kernels, beside the
// tower's 1024, 1152, 4096 and 4304), views one element off 16-byte
// alignment, outputs and workspace poisoned with NaN (0xff bytes) before every
// kernel so an unwritten element fails, the accumulation contract, dweight /
// dbias bitwise run to run, device and workspace errors, and a steady state
// that allocates nothing.
//
// Tolerances, as ||gpu - ref|| / ||ref|| with both computed from the same
// (already rounded) inputs in fp32:
//   bf16 outputs: 4e-3. The fp32 results differ only in summation order, FMA
//     contraction and erff / tanhf / expf's last bits (~1e-6 relative);
//     rounding to bf16 then flips an element by at most one ulp (2^-8
//     relative), and only the few elements near a rounding boundary flip;
//   f32 outputs: 1e-5 (mean, rstd, dx; dweight and dbias summed over up to
//     16384 rows in another order: ~1e-6).
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "slime/core/memory.hpp"
#include "slime/core/random.hpp"
#include "slime/ops/gelu.hpp"
#include "slime/ops/layer_norm.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
using ops::GeluApproximation;

namespace {

constexpr double kTolBf16 = 4e-3;
constexpr double kTolF32 = 1e-5;

double tolerance(DType t) { return t == DType::bf16 ? kTolBf16 : kTolF32; }

#define REQUIRE_GPU() \
  if (cuda_device_count() == 0) SKIP("no CUDA device")

Device gpu() { return Device::cuda(0); }

// A tensor on `d` filled with N(mean, stddev), seeded.
Tensor randn(const Shape& shape, DType dt, Device d, uint64_t seed, float stddev = 1.f, float mean = 0.f) {
  Tensor t = Tensor::empty(shape, dt, d);
  fill_normal(t, seed, 0, mean, stddev);
  return t;
}

// A view of `shape` one element into a fresh buffer: never 16-byte aligned,
// so the kernels take their one-element paths.
Tensor misaligned(const Tensor& src) {
  Tensor buf = Tensor::empty({src.numel() + 1}, src.dtype(), src.device());
  Tensor v = buf.view(1, src.shape());
  v.copy_from(src);
  return v;
}

Tensor poisoned(const Shape& shape, DType dt, Device d) {
  Tensor t = Tensor::empty(shape, dt, d);
  t.fill_bytes_(0xff);
  return t;
}

Tensor poisoned_misaligned(const Shape& shape, DType dt, Device d) {
  Tensor v = misaligned(Tensor::empty(shape, dt, d));
  v.fill_bytes_(0xff);
  return v;
}

std::vector<double> to_double(const Tensor& t) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  ops::detail::memops::visit_f32_bf16(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const std::vector<T> v = t.to_vector<T>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = double(float(v[i]));
  });
  return out;
}

// ||got - want|| / ||want||; NaN when got holds a NaN (an element left unwritten).
double rel_err(const std::vector<double>& g, const std::vector<double>& w) {
  REQUIRE(g.size() == w.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i])) return std::numeric_limits<double>::quiet_NaN();
    num += (g[i] - w[i]) * (g[i] - w[i]);
    den += w[i] * w[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

double rel_err(const Tensor& got, const Tensor& want) { return rel_err(to_double(got), to_double(want)); }

// The relative error of got - base against want - base (an accumulated
// parameter gradient's increment).
double rel_err_increment(const Tensor& got, const Tensor& want, const Tensor& base) {
  std::vector<double> g = to_double(got), w = to_double(want);
  const std::vector<double> b = to_double(base);
  for (std::size_t i = 0; i < g.size(); ++i) {
    g[i] -= b[i];
    w[i] -= b[i];
  }
  return rel_err(g, w);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.data_ptr(), hb.data_ptr(), ha.nbytes()) == 0;
}

Tensor workspace(std::size_t bytes) {
  Tensor ws = Tensor::empty({int64_t(std::max<std::size_t>(bytes, 1))}, DType::u8, gpu());
  ws.fill_bytes_(0xff);  // partials must be written before they are read
  return ws;
}

constexpr GeluApproximation kForms[] = {GeluApproximation::none, GeluApproximation::tanh};

}  // namespace

// ---------------------------------------------------------------- layer_norm

namespace {

struct LnCase {
  DType x, w;
  int64_t rows, dim;
  bool aligned;
};

// One case: CPU reference, then the GPU twice (the second run's dweight and
// dbias must be the same bits).
void check_layer_norm_case(const LnCase& c, uint64_t& seed) {
  INFO("x " << c.x << " w " << c.w << " rows " << c.rows << " dim " << c.dim << " aligned " << c.aligned);
  const float eps = 1e-6f;
  const Shape shape{c.rows, c.dim};
  // Rows off zero (mean 0.5): the variance is taken about the mean.
  Tensor x = randn(shape, c.x, Device::cpu(), ++seed, 2.f, 0.5f);
  Tensor w = randn({c.dim}, c.w, Device::cpu(), ++seed, 0.3f, 1.f);
  Tensor b = randn({c.dim}, c.w, Device::cpu(), ++seed, 0.3f);
  Tensor dy = randn(shape, c.x, Device::cpu(), ++seed);
  Tensor dw0 = randn({c.dim}, DType::f32, Device::cpu(), ++seed);
  Tensor db0 = randn({c.dim}, DType::f32, Device::cpu(), ++seed);
  Tensor y_ref = Tensor::empty(shape, c.x);
  Tensor mean_ref = Tensor::empty({c.rows}, DType::f32), rstd_ref = Tensor::empty({c.rows}, DType::f32);
  ops::layer_norm_forward(x, w, b, eps, y_ref, mean_ref, rstd_ref);
  Tensor dx_ref = Tensor::empty(shape, c.x), dw_ref = dw0.clone(), db_ref = db0.clone();
  ops::layer_norm_backward(x, w, mean_ref, rstd_ref, dy, dx_ref, dw_ref, db_ref, Tensor{});

  auto on_gpu = [&](const Tensor& t) { return c.aligned ? t.to(gpu()) : misaligned(t.to(gpu())); };
  const Tensor xg = on_gpu(x), wg = on_gpu(w), bg = on_gpu(b), dyg = on_gpu(dy);
  Tensor y = c.aligned ? poisoned(shape, c.x, gpu()) : poisoned_misaligned(shape, c.x, gpu());
  Tensor mean = poisoned({c.rows}, DType::f32, gpu()), rstd = poisoned({c.rows}, DType::f32, gpu());
  ops::layer_norm_forward(xg, wg, bg, eps, y, mean, rstd);
  CHECK(rel_err(y, y_ref) <= tolerance(c.x));
  CHECK(rel_err(mean, mean_ref) <= kTolF32);
  CHECK(rel_err(rstd, rstd_ref) <= kTolF32);

  Tensor ws = workspace(ops::layer_norm_backward_workspace_bytes(c.rows, c.dim));
  Tensor dx = c.aligned ? poisoned(shape, c.x, gpu()) : poisoned_misaligned(shape, c.x, gpu());
  Tensor dw = dw0.to(gpu()), db = db0.to(gpu());
  // From the CPU's mean and rstd, so dx is compared on the same statistics.
  const Tensor mean_g = mean_ref.to(gpu()), rstd_g = rstd_ref.to(gpu());
  ops::layer_norm_backward(xg, wg, mean_g, rstd_g, dyg, dx, dw, db, ws);
  if (c.dim > 1) {
    CHECK(rel_err(dx, dx_ref) <= tolerance(c.x));
  } else {
    // dim 1: x - mean is 0, so dx is exactly 0 and both sides hold only the
    // rounding of w dy - mean(w dy) (times rstd = 1/sqrt(eps)): a relative
    // error between two rounding residues means nothing; both must be ~0
    // next to the scale rstd |w dy| of the terms that cancel.
    double scale = 0, got = 0, want = 0;
    const std::vector<double> r = to_double(rstd_ref), wv = to_double(w), dyv = to_double(dy);
    for (std::size_t i = 0; i < dyv.size(); ++i) scale = std::max(scale, std::abs(r[i] * wv[0] * dyv[i]));
    for (double v : to_double(dx)) got = std::max(got, std::abs(v));
    for (double v : to_double(dx_ref)) want = std::max(want, std::abs(v));
    CHECK(got <= 1e-5 * scale);
    CHECK(want <= 1e-5 * scale);
  }
  CHECK(rel_err_increment(dw, dw_ref, dw0) <= kTolF32);
  CHECK(rel_err_increment(db, db_ref, db0) <= kTolF32);

  // Run to run: the same bits of dweight and dbias (and of dx), the
  // workspace poisoned again.
  ws.fill_bytes_(0xff);
  Tensor dx2 = c.aligned ? poisoned(shape, c.x, gpu()) : poisoned_misaligned(shape, c.x, gpu());
  Tensor dw2 = dw0.to(gpu()), db2 = db0.to(gpu());
  ops::layer_norm_backward(xg, wg, mean_g, rstd_g, dyg, dx2, dw2, db2, ws);
  CHECK(same_bits(dw2, dw));
  CHECK(same_bits(db2, db));
  CHECK(same_bits(dx2, dx));
}

}  // namespace

TEST_CASE("layer_norm on the GPU matches the CPU for odd sizes and every dtype pair", "[ops][layer_norm][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 1000;
  struct Pair {
    DType x, w;
  };
  for (Pair p : {Pair{DType::bf16, DType::bf16}, Pair{DType::bf16, DType::f32}, Pair{DType::f32, DType::f32},
                 Pair{DType::f32, DType::bf16}}) {
    for (int64_t dim : {int64_t(1), int64_t(7), int64_t(13), int64_t(100), int64_t(1001), int64_t(1024), int64_t(1152),
                        int64_t(4096), int64_t(4100), int64_t(5120)}) {
      for (int64_t rows : {int64_t(1), int64_t(17), int64_t(577)}) {
        for (bool aligned : {true, false}) {
          if (!aligned && rows > 17) continue;  // the scalar path needs fewer cases
          check_layer_norm_case({p.x, p.w, rows, dim, aligned}, seed);
        }
      }
    }
  }
}

TEST_CASE("layer_norm on the GPU at the Qwen3-VL tower's shapes (many rows per block)", "[ops][layer_norm][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 2000;
  // 16384 patches at hidden 1024 (the blocks' norms); 4099 merged rows at
  // 4096 (the deepstack mergers' post-shuffle norm), 1152 (wider towers).
  check_layer_norm_case({DType::bf16, DType::bf16, 16384, 1024, true}, seed);
  check_layer_norm_case({DType::bf16, DType::f32, 4099, 4096, true}, seed);
  check_layer_norm_case({DType::f32, DType::f32, 4099, 1152, true}, seed);
}

TEST_CASE("layer_norm on the GPU in place (y = x, dx = dy, dx = x) equals out of place bit for bit",
          "[ops][layer_norm][gpu]") {
  REQUIRE_GPU();
  const int64_t rows = 127, dim = 1152;
  Tensor x = randn({rows, dim}, DType::bf16, gpu(), 3001, 2.f);
  Tensor w = randn({dim}, DType::bf16, gpu(), 3002, 0.3f, 1.f), b = randn({dim}, DType::bf16, gpu(), 3003);
  Tensor dy = randn({rows, dim}, DType::bf16, gpu(), 3004);
  Tensor y = poisoned({rows, dim}, DType::bf16, gpu());
  Tensor mean = poisoned({rows}, DType::f32, gpu()), rstd = poisoned({rows}, DType::f32, gpu());
  ops::layer_norm_forward(x, w, b, 1e-6f, y, mean, rstd);
  Tensor ws = workspace(ops::layer_norm_backward_workspace_bytes(rows, dim));
  Tensor dx = poisoned({rows, dim}, DType::bf16, gpu());
  Tensor dw = Tensor::zeros({dim}, DType::f32, gpu()), db = Tensor::zeros({dim}, DType::f32, gpu());
  ops::layer_norm_backward(x, w, mean, rstd, dy, dx, dw, db, ws);

  Tensor x2 = x.clone();
  Tensor mean2 = poisoned({rows}, DType::f32, gpu()), rstd2 = poisoned({rows}, DType::f32, gpu());
  ops::layer_norm_forward(x2, w, b, 1e-6f, x2, mean2, rstd2);
  CHECK(same_bits(x2, y));
  CHECK(same_bits(mean2, mean));
  CHECK(same_bits(rstd2, rstd));
  Tensor dy2 = dy.clone();
  Tensor dw2 = Tensor::zeros({dim}, DType::f32, gpu()), db2 = Tensor::zeros({dim}, DType::f32, gpu());
  ops::layer_norm_backward(x, w, mean, rstd, dy2, dy2, dw2, db2, ws);
  CHECK(same_bits(dy2, dx));
  CHECK(same_bits(dw2, dw));
  CHECK(same_bits(db2, db));
  Tensor x3 = x.clone();
  Tensor dw3 = Tensor::zeros({dim}, DType::f32, gpu()), db3 = Tensor::zeros({dim}, DType::f32, gpu());
  ops::layer_norm_backward(x3, w, mean, rstd, dy, x3, dw3, db3, ws);
  CHECK(same_bits(x3, dx));
  CHECK(same_bits(dw3, dw));
}

TEST_CASE("layer_norm on the GPU rejects mixed devices and a short or misplaced workspace", "[ops][layer_norm][gpu]") {
  REQUIRE_GPU();
  const int64_t rows = 33, dim = 64;
  Tensor x = randn({rows, dim}, DType::bf16, gpu(), 4001), w = randn({dim}, DType::bf16, gpu(), 4002),
         b = randn({dim}, DType::bf16, gpu(), 4003);
  Tensor y = Tensor::empty({rows, dim}, DType::bf16, gpu());
  Tensor mean = Tensor::empty({rows}, DType::f32, gpu()), rstd = Tensor::empty({rows}, DType::f32, gpu());
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w.to(Device::cpu()), b, 1e-6f, y, mean, rstd),
                    ContainsSubstring("x and weight are on different devices"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, b.to(Device::cpu()), 1e-6f, y, mean, rstd),
                    ContainsSubstring("x and bias are on different devices"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, b, 1e-6f, y.to(Device::cpu()), mean, rstd),
                    ContainsSubstring("x and y are on different devices"));
  CHECK_THROWS_WITH(ops::layer_norm_forward(x, w, b, 1e-6f, y, mean, rstd.to(Device::cpu())),
                    ContainsSubstring("x and rstd are on different devices"));
  ops::layer_norm_forward(x, w, b, 1e-6f, y, mean, rstd);
  Tensor dy = randn({rows, dim}, DType::bf16, gpu(), 4004), dx = Tensor::empty({rows, dim}, DType::bf16, gpu());
  Tensor dw = Tensor::zeros({dim}, DType::f32, gpu()), db = Tensor::zeros({dim}, DType::f32, gpu());
  const std::size_t need = ops::layer_norm_backward_workspace_bytes(rows, dim);
  REQUIRE(need > 0);
  Tensor ws = workspace(need);
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean, rstd, dy, dx, dw, db.to(Device::cpu()), ws),
                    ContainsSubstring("x and dbias are on different devices"));
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean.to(Device::cpu()), rstd, dy, dx, dw, db, ws),
                    ContainsSubstring("x and mean are on different devices"));
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean, rstd, dy, dx, dw, db, workspace(need - 4)),
                    ContainsSubstring("layer_norm_backward_workspace_bytes"));
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean, rstd, dy, dx, dw, db, Tensor{}),
                    ContainsSubstring("workspace is undefined"));
  CHECK_THROWS_WITH(
      ops::layer_norm_backward(x, w, mean, rstd, dy, dx, dw, db, Tensor::empty({int64_t(need)}, DType::u8)),
      ContainsSubstring("x and workspace are on different devices"));
  // A workspace inside dx's bytes.
  Tensor big = Tensor::empty({rows * dim + int64_t(need)}, DType::bf16, gpu());
  CHECK_THROWS_WITH(ops::layer_norm_backward(x, w, mean, rstd, dy, big.view(0, {rows, dim}), dw, db, big),
                    ContainsSubstring("workspace overlaps"));
  // Nothing was accumulated by the rejected calls.
  for (float v : dw.to_vector<float>()) CHECK(v == 0.f);
  for (float v : db.to_vector<float>()) CHECK(v == 0.f);
}

// ---------------------------------------------------------------- gelu

TEST_CASE("gelu on the GPU matches the CPU, both forms, f32 and bf16, odd sizes", "[ops][gelu][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 5000;
  for (GeluApproximation form : kForms) {
    for (DType dt : {DType::bf16, DType::f32}) {
      // [rows, width]: the tower's MLP widths (4096; 4304 in wider towers) and
      // odd ones (a tail after the vectors, or no vector at all).
      for (Shape shape :
           {Shape{1, 1}, Shape{1, 7}, Shape{17, 1001}, Shape{577, 4096}, Shape{127, 4304}, Shape{3, 16387}}) {
        for (bool aligned : {true, false}) {
          INFO("form " << ops::gelu_approximation_name(form) << " dtype " << dt << " shape " << shape[0] << "x"
                       << shape[1] << " aligned " << aligned);
          Tensor x = randn(shape, dt, Device::cpu(), ++seed, 3.f);
          Tensor dy = randn(shape, dt, Device::cpu(), ++seed);
          Tensor y_ref = Tensor::empty(shape, dt), dx_ref = Tensor::empty(shape, dt);
          ops::gelu_forward(x, form, y_ref);
          ops::gelu_backward(x, dy, form, dx_ref);

          const Tensor xg = aligned ? x.to(gpu()) : misaligned(x.to(gpu()));
          const Tensor dyg = aligned ? dy.to(gpu()) : misaligned(dy.to(gpu()));
          Tensor y = aligned ? poisoned(shape, dt, gpu()) : poisoned_misaligned(shape, dt, gpu());
          ops::gelu_forward(xg, form, y);
          CHECK(rel_err(y, y_ref) <= tolerance(dt));
          Tensor dx = aligned ? poisoned(shape, dt, gpu()) : poisoned_misaligned(shape, dt, gpu());
          ops::gelu_backward(xg, dyg, form, dx);
          CHECK(rel_err(dx, dx_ref) <= tolerance(dt));

          // In place: the out-of-place bits (on equally aligned copies, so
          // the same kernel runs).
          Tensor x2 = aligned ? xg.clone() : misaligned(xg);
          ops::gelu_forward_(x2, form);
          CHECK(same_bits(x2, y));
          Tensor dy2 = aligned ? dyg.clone() : misaligned(dyg);
          ops::gelu_backward(xg, dy2, form, dy2);
          CHECK(same_bits(dy2, dx));
        }
      }
    }
  }
}

TEST_CASE("gelu on the GPU rejects mixed devices", "[ops][gelu][gpu]") {
  REQUIRE_GPU();
  Tensor x = randn({4, 8}, DType::f32, gpu(), 6001), dy = randn({4, 8}, DType::f32, gpu(), 6002);
  CHECK_THROWS_WITH(ops::gelu_forward(x, GeluApproximation::tanh, Tensor::empty({4, 8}, DType::f32)),
                    ContainsSubstring("x and y are on different devices"));
  CHECK_THROWS_WITH(
      ops::gelu_backward(x, dy.to(Device::cpu()), GeluApproximation::none, Tensor::empty({4, 8}, DType::f32, gpu())),
      ContainsSubstring("x and dy are on different devices"));
  CHECK_THROWS_WITH(ops::gelu_backward(x, dy, GeluApproximation::none, Tensor::empty({4, 8}, DType::f32)),
                    ContainsSubstring("x and dx are on different devices"));
}

TEST_CASE("layer_norm and gelu allocate nothing in the steady state", "[ops][gpu]") {
  REQUIRE_GPU();
  Stream s = Stream::create(gpu());
  const int64_t rows = 577, dim = 1024;
  Tensor x = randn({rows, dim}, DType::bf16, gpu(), 7001), w = randn({dim}, DType::bf16, gpu(), 7002),
         b = randn({dim}, DType::bf16, gpu(), 7003), dy = randn({rows, dim}, DType::bf16, gpu(), 7004);
  Tensor y = Tensor::empty({rows, dim}, DType::bf16, gpu(), s), dx = Tensor::empty({rows, dim}, DType::bf16, gpu(), s);
  Tensor mean = Tensor::empty({rows}, DType::f32, gpu(), s), rstd = Tensor::empty({rows}, DType::f32, gpu(), s);
  Tensor dw = Tensor::zeros({dim}, DType::f32, gpu(), s), db = Tensor::zeros({dim}, DType::f32, gpu(), s);
  Tensor ws = Tensor::empty({int64_t(ops::layer_norm_backward_workspace_bytes(rows, dim))}, DType::u8, gpu(), s);
  // Inputs were filled on the default stream; s does not wait for it.
  Stream::default_for(gpu()).synchronize();
  s.synchronize();
  const int64_t before = memory_stats(gpu()).allocations;
  for (int i = 0; i < 3; ++i) {
    ops::layer_norm_forward(x, w, b, 1e-6f, y, mean, rstd, s);
    ops::layer_norm_backward(x, w, mean, rstd, dy, dx, dw, db, ws, s);
    ops::gelu_forward(x, GeluApproximation::tanh, y, s);
    ops::gelu_backward(x, dy, GeluApproximation::none, dx, s);
  }
  s.synchronize();
  CHECK(memory_stats(gpu()).allocations == before);
}
