// The row ops on the GPU (bias_add_, bias_backward, pos_embed_interpolate
// forward and backward) against the CPU reference on fresh random inputs:
// f32 and bf16, odd sizes (rows 1, 17, 577; widths not multiples of 4 or 8,
// which take the one-element kernels, beside the tower's 1024, 1152 and
// 4096), views one element off 16-byte alignment, outputs and workspaces
// poisoned with NaN (0xff bytes) before every kernel so an unwritten element
// fails, bitwise run to run (and across the vector and one-element paths for
// bias_backward), bad ids, device and workspace errors, and a steady state
// that allocates nothing.
//
// Tolerances, as ||gpu - ref|| / ||ref|| (of the increment for accumulated
// gradients), both from the same rounded inputs:
//   bias_add_: none, the same bits (one fp32 add and one rounding on both).
//   bf16 outputs: 4e-3 (the fp32 sums differ by FMA contraction and order,
//     ~1e-7 relative, and rounding to bf16 flips the few elements near a
//     boundary by one ulp, 2^-8).
//   f32 outputs and gradients: 1e-5 (sums of up to 16384 terms in another
//     order: ~1e-6).
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
#include "slime/ops/row_ops.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;

namespace {

constexpr double kTolBf16 = 4e-3;
constexpr double kTolF32 = 1e-5;

double tolerance(DType t) { return t == DType::bf16 ? kTolBf16 : kTolF32; }

#define REQUIRE_GPU() \
  if (cuda_device_count() == 0) SKIP("no CUDA device")

Device gpu() { return Device::cuda(0); }

Tensor randn(const Shape& shape, DType dt, Device d, uint64_t seed, float stddev = 1.f, float mean = 0.f) {
  Tensor t = Tensor::empty(shape, dt, d);
  fill_normal(t, seed, 0, mean, stddev);
  return t;
}

// A view of `src`'s shape one element into a fresh buffer on src's device:
// never 16-byte aligned, so the kernels take their one-element paths.
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
// gradient's increment).
double rel_err_increment(const Tensor& got, const Tensor& want, const Tensor& base) {
  std::vector<double> g = to_double(got), w = to_double(want);
  const std::vector<double> b = to_double(base);
  for (std::size_t i = 0; i < g.size(); ++i) {
    g[i] -= b[i];
    w[i] -= b[i];
  }
  return rel_err(g, w);
}

// max over columns of |got - want| / (|base| + sum over rows |dy|): the error
// of an accumulated column sum against the scale its f32 rounding has.
double accumulate_err(const Tensor& got, const Tensor& want, const Tensor& base, const Tensor& dy) {
  const std::vector<double> g = to_double(got), w = to_double(want), b = to_double(base), d = to_double(dy);
  const std::size_t n = g.size();
  std::vector<double> scale(n);
  for (std::size_t i = 0; i < n; ++i) scale[i] = std::abs(b[i]);
  for (std::size_t k = 0; k < d.size(); ++k) scale[k % n] += std::abs(d[k]);
  double worst = 0;
  for (std::size_t i = 0; i < n; ++i) worst = std::max(worst, std::abs(g[i] - w[i]) / std::max(scale[i], 1e-30));
  return worst;
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

// The Qwen3-VL resample's taps (align-corners bilinear) of an h x w patch
// grid into a side x side table, ids [4, P] and weights [4, P] on the host.
struct Taps {
  Tensor ids, weights;
};
Taps bilinear_taps(int64_t h, int64_t w, int64_t side) {
  const int64_t P = h * w;
  std::vector<int32_t> ids(std::size_t(4 * P));
  std::vector<float> wt(std::size_t(4 * P));
  const auto axis = [&](int64_t i, int64_t n, int32_t(&tap)[2], float(&f)[2]) {
    const float src = float(i) * float(side - 1) / float(std::max<int64_t>(n - 1, 1));
    const float fl = std::floor(src);
    for (int o = 0; o < 2; ++o) {
      tap[o] = int32_t(std::min<int64_t>(int64_t(fl) + o, side - 1));
      f[o] = std::max(0.f, 1.f - std::abs(src - fl - float(o)));
    }
  };
  for (int64_t r = 0; r < h; ++r)
    for (int64_t c = 0; c < w; ++c) {
      int32_t rt[2], ct[2];
      float rf[2], cf[2];
      axis(r, h, rt, rf);
      axis(c, w, ct, cf);
      for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 2; ++b) {
          const std::size_t i = std::size_t((2 * a + b) * P + r * w + c);
          ids[i] = int32_t(rt[a] * side + ct[b]);
          wt[i] = rf[a] * cf[b];
        }
    }
  return {Tensor::from_vector(ids, {4, P}), Tensor::from_vector(wt, {4, P})};
}

// Random taps of P patches into an S-row table (uniform ids), weights N(0.25, 0.5).
Taps random_taps(int64_t P, int64_t S, uint64_t seed) {
  std::vector<int32_t> ids(std::size_t(4 * P));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t(philox_word(seed, i) % uint64_t(S));
  Tensor w = Tensor::empty({4, P}, DType::f32);
  fill_normal(w, seed + 1, 0, 0.25f, 0.5f);
  return {Tensor::from_vector(ids, {4, P}), w};
}

}  // namespace

// ---------------------------------------------------------------- bias

TEST_CASE("bias_add_ on the GPU equals the CPU bit for bit (f32, bf16, odd sizes, misaligned)",
          "[ops][row_ops][bias][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 100;
  for (DType dt : {DType::bf16, DType::f32}) {
    for (int64_t n : {int64_t(1), int64_t(7), int64_t(13), int64_t(1001), int64_t(1024), int64_t(1152), int64_t(4096),
                      int64_t(4100)}) {
      for (int64_t rows : {int64_t(1), int64_t(17), int64_t(577)}) {
        for (bool aligned : {true, false}) {
          INFO(dt << " rows " << rows << " n " << n << " aligned " << aligned);
          const Tensor y0 = randn({rows, n}, dt, Device::cpu(), ++seed, 2.f);
          const Tensor b = randn({n}, dt, Device::cpu(), ++seed, 3.f);
          Tensor want = y0.clone();
          ops::bias_add_(want, b);
          Tensor y = aligned ? y0.to(gpu()) : misaligned(y0.to(gpu()));
          ops::bias_add_(y, aligned ? b.to(gpu()) : misaligned(b.to(gpu())));
          CHECK(same_bits(y, want));
        }
      }
    }
  }
  // Many rows: the threads stride over them.
  const Tensor y0 = randn({16385, 1152}, DType::bf16, Device::cpu(), 150);
  const Tensor b = randn({1152}, DType::bf16, Device::cpu(), 151);
  Tensor want = y0.clone();
  ops::bias_add_(want, b);
  Tensor y = y0.to(gpu());
  ops::bias_add_(y.reshape({5, 3277, 1152}), b.to(gpu()));
  CHECK(same_bits(y, want));
}

TEST_CASE("bias_backward on the GPU matches the CPU, written or accumulated, and is the same bits run to run",
          "[ops][row_ops][bias][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 200;
  for (DType dt : {DType::bf16, DType::f32}) {
    for (int64_t n : {int64_t(1), int64_t(7), int64_t(1001), int64_t(1152), int64_t(4096), int64_t(4100)}) {
      for (int64_t rows : {int64_t(1), int64_t(17), int64_t(577), int64_t(16385)}) {
        if (rows > 577 && n != 1152 && n != 4100) continue;  // many rows at two widths
        for (bool accumulate : {false, true}) {
          INFO(dt << " rows " << rows << " n " << n << " accumulate " << accumulate);
          const Tensor dy = randn({rows, n}, dt, Device::cpu(), ++seed);
          const Tensor db0 = randn({n}, DType::f32, Device::cpu(), ++seed);
          Tensor want = db0.clone();
          ops::bias_backward(dy, want, accumulate, Tensor{});

          const std::size_t need = ops::bias_backward_workspace_bytes(rows, n);
          Tensor ws = workspace(need);
          const Tensor dyg = dy.to(gpu());
          Tensor db = accumulate ? db0.to(gpu()) : poisoned({n}, DType::f32, gpu());
          ops::bias_backward(dyg, db, accumulate, ws);
          if (accumulate) {
            // Both sides round db0 + sum to f32 once: an ulp of the result,
            // which can be large next to a small increment (n = 1 with
            // cancelling rows measured 2.9e-5 of it on the H200). So the
            // error is taken against each column's scale |db0| + sum |dy|.
            CHECK(accumulate_err(db, want, db0, dy) <= kTolF32);
          } else {
            CHECK(rel_err(db, want) <= kTolF32);
          }
          // Run to run, and through the one-element path (misaligned dy):
          // the same rows per lane and chunk in the same order, the same bits.
          ws.fill_bytes_(0xff);
          Tensor db2 = accumulate ? db0.to(gpu()) : poisoned({n}, DType::f32, gpu());
          ops::bias_backward(dyg, db2, accumulate, ws);
          CHECK(same_bits(db2, db));
          ws.fill_bytes_(0xff);
          Tensor db3 = accumulate ? db0.to(gpu()) : poisoned({n}, DType::f32, gpu());
          ops::bias_backward(misaligned(dyg), db3, accumulate, ws);
          CHECK(same_bits(db3, db));
        }
      }
    }
  }
  // No rows: db = 0, or unchanged when accumulating; no workspace needed.
  REQUIRE(ops::bias_backward_workspace_bytes(0, 9) == 0);
  Tensor db = poisoned({9}, DType::f32, gpu());
  ops::bias_backward(Tensor::empty({0, 9}, DType::bf16, gpu()), db, false, Tensor{});
  CHECK(to_double(db) == std::vector<double>(9, 0.0));
  const Tensor keep = randn({9}, DType::f32, gpu(), 299);
  db = keep.clone();
  ops::bias_backward(Tensor::empty({0, 9}, DType::bf16, gpu()), db, true, Tensor{});
  CHECK(same_bits(db, keep));
}

TEST_CASE("bias ops on the GPU reject mixed devices and a short or misplaced workspace", "[ops][row_ops][bias][gpu]") {
  REQUIRE_GPU();
  const int64_t rows = 33, n = 64;
  Tensor y = randn({rows, n}, DType::bf16, gpu(), 301), b = randn({n}, DType::bf16, gpu(), 302);
  CHECK_THROWS_WITH(ops::bias_add_(y, b.to(Device::cpu())), ContainsSubstring("y and bias are on different devices"));
  Tensor db = Tensor::zeros({n}, DType::f32, gpu());
  const std::size_t need = ops::bias_backward_workspace_bytes(rows, n);
  REQUIRE(need > 0);
  CHECK_THROWS_WITH(ops::bias_backward(y, db.to(Device::cpu()), true, workspace(need)),
                    ContainsSubstring("dy and dbias are on different devices"));
  CHECK_THROWS_WITH(ops::bias_backward(y, db, true, workspace(need - 4)),
                    ContainsSubstring("bias_backward_workspace_bytes"));
  CHECK_THROWS_WITH(ops::bias_backward(y, db, true, Tensor{}), ContainsSubstring("workspace is undefined"));
  CHECK_THROWS_WITH(ops::bias_backward(y, db, true, Tensor::empty({int64_t(need)}, DType::u8)),
                    ContainsSubstring("dy and workspace are on different devices"));
  Tensor big = Tensor::empty({rows * n + int64_t(need)}, DType::bf16, gpu());
  CHECK_THROWS_WITH(ops::bias_backward(big.view(0, {rows, n}), db, true, big), ContainsSubstring("workspace overlaps"));
  for (float v : db.to_vector<float>()) CHECK(v == 0.f);
}

// ---------------------------------------------------------------- pos_embed_interpolate

namespace {

// Forward and backward of one case against the CPU, twice on the GPU (the
// backward's second run must be the same bits).
void check_pos_embed_case(DType dt, const Taps& taps, int64_t S, int64_t D, bool aligned, uint64_t& seed) {
  const int64_t P = taps.ids.size(1);
  INFO(dt << " P " << P << " S " << S << " D " << D << " aligned " << aligned);
  const Tensor table = randn({S, D}, dt, Device::cpu(), ++seed);
  const Tensor d_out = randn({P, D}, dt, Device::cpu(), ++seed);
  const Tensor out0 = randn({P, D}, dt, Device::cpu(), ++seed);
  const Tensor g0 = randn({S, D}, DType::f32, Device::cpu(), ++seed);
  auto on_gpu = [&](const Tensor& t) { return aligned ? t.to(gpu()) : misaligned(t.to(gpu())); };
  const Tensor ids = taps.ids.to(gpu()), w = taps.weights.to(gpu()), tg = on_gpu(table);
  for (bool accumulate : {false, true}) {
    INFO("accumulate " << accumulate);
    Tensor want = out0.clone();
    ops::pos_embed_interpolate_forward(table, taps.ids, taps.weights, want, accumulate);
    Tensor out = accumulate ? on_gpu(out0) : on_gpu(poisoned({P, D}, dt, Device::cpu()));
    ops::pos_embed_interpolate_forward(tg, ids, w, out, accumulate);
    CHECK(rel_err(out, want) <= tolerance(dt));
  }
  Tensor g_want = g0.clone();
  ops::pos_embed_interpolate_backward(d_out, taps.ids, taps.weights, ops::PosEmbedRowTaps{}, g_want);
  const ops::PosEmbedRowTaps rt = ops::pos_embed_row_taps(taps.ids, S, gpu());
  const Tensor dog = on_gpu(d_out);
  Tensor g = on_gpu(g0);
  ops::pos_embed_interpolate_backward(dog, ids, w, rt, g);
  CHECK(rel_err_increment(g, g_want, g0) <= kTolF32);
  Tensor g2 = on_gpu(g0);
  ops::pos_embed_interpolate_backward(dog, ids, w, rt, g2);
  CHECK(same_bits(g2, g));
}

}  // namespace

TEST_CASE("pos_embed_interpolate on the GPU matches the CPU: odd sizes, f32 and bf16, misaligned",
          "[ops][row_ops][pos_embed][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 1000;
  for (DType dt : {DType::bf16, DType::f32}) {
    for (int64_t D : {int64_t(1), int64_t(5), int64_t(13), int64_t(1001), int64_t(1024), int64_t(1152)}) {
      for (bool aligned : {true, false}) {
        check_pos_embed_case(dt, random_taps(1, 1, ++seed), 1, D, aligned, seed);
        check_pos_embed_case(dt, random_taps(17, 9, ++seed), 9, D, aligned, seed);
        check_pos_embed_case(dt, random_taps(577, 49, ++seed), 49, D, aligned, seed);
        // Bilinear taps of a 13 x 7 grid into a 6 x 6 table (rows 1 .. 35 of
        // a 36-row table, several without taps when the grid is coarse).
        check_pos_embed_case(dt, bilinear_taps(13, 7, 6), 36, D, aligned, seed);
        check_pos_embed_case(dt, bilinear_taps(3, 2, 6), 36, D, aligned, seed);
      }
    }
  }
}

TEST_CASE("pos_embed_interpolate on the GPU at the Qwen3-VL shape (16384 patches, 48 x 48 table, D 1024)",
          "[ops][row_ops][pos_embed][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 2000;
  check_pos_embed_case(DType::bf16, bilinear_taps(128, 128, 48), 2304, 1024, true, seed);
  check_pos_embed_case(DType::f32, bilinear_taps(96, 60, 48), 2304, 1152, true, seed);
}

TEST_CASE("pos_embed_interpolate_forward on the GPU writes NaN for a patch with a bad id, the rest as the CPU",
          "[ops][row_ops][pos_embed][gpu]") {
  REQUIRE_GPU();
  const int64_t P = 9, S = 7, D = 16;
  Taps taps = random_taps(P, S, 3001);
  std::vector<int32_t> ids = taps.ids.to_vector<int32_t>();
  ids[std::size_t(1 * P + 4)] = int32_t(S);  // patch 4, tap 1
  ids[std::size_t(3 * P + 6)] = -1;          // patch 6, tap 3
  const Tensor bad = Tensor::from_vector(ids, {4, P});
  const Tensor table = randn({S, D}, DType::bf16, Device::cpu(), 3002);
  Tensor out = poisoned({P, D}, DType::bf16, gpu());
  ops::pos_embed_interpolate_forward(table.to(gpu()), bad.to(gpu()), taps.weights.to(gpu()), out, false);
  Tensor want = Tensor::empty({P, D}, DType::bf16);
  ops::pos_embed_interpolate_forward(table, taps.ids, taps.weights, want, false);
  const std::vector<double> got = to_double(out), ref = to_double(want);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t d = 0; d < D; ++d) {
      INFO("patch " << p << " col " << d);
      const std::size_t i = std::size_t(p * D + d);
      if (p == 4 || p == 6) {
        CHECK(std::isnan(got[i]));
      } else {
        CHECK(std::abs(got[i] - ref[i]) <= 1e-2 * std::max(1.0, std::abs(ref[i])));
      }
    }
  // The host helper the backward needs rejects them, naming the tap.
  CHECK_THROWS_WITH(ops::pos_embed_row_taps(bad, S, gpu()), ContainsSubstring("ids[1][4] = 7 is outside"));
}

TEST_CASE("pos_embed_interpolate on the GPU rejects mixed devices and a row_taps of the wrong shape or device",
          "[ops][row_ops][pos_embed][gpu]") {
  REQUIRE_GPU();
  const int64_t P = 10, S = 6, D = 8;
  const Taps taps = random_taps(P, S, 4001);
  const Tensor ids = taps.ids.to(gpu()), w = taps.weights.to(gpu());
  const Tensor table = randn({S, D}, DType::bf16, gpu(), 4002);
  Tensor out = Tensor::empty({P, D}, DType::bf16, gpu());
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_forward(table, taps.ids, w, out, false),
                    ContainsSubstring("ids and weights are on different devices"));
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_forward(table, taps.ids, taps.weights, out, false),
                    ContainsSubstring("table and ids are on different devices"));
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_forward(table, ids, w, out.to(Device::cpu()), false),
                    ContainsSubstring("table and out are on different devices"));
  const ops::PosEmbedRowTaps rt = ops::pos_embed_row_taps(taps.ids, S, gpu());
  Tensor g = Tensor::zeros({S, D}, DType::f32, gpu());
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_backward(out, ids, w, ops::PosEmbedRowTaps{}, g),
                    ContainsSubstring("row_taps.offsets is undefined"));
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_backward(out, ids, w, ops::pos_embed_row_taps(taps.ids, S), g),
                    ContainsSubstring("d_out and row_taps.offsets are on different devices"));
  CHECK_THROWS_WITH(
      ops::pos_embed_interpolate_backward(out, ids, w, ops::pos_embed_row_taps(taps.ids, S + 1, gpu()), g),
      ContainsSubstring("row_taps.offsets (table rows + 1"));
  CHECK_THROWS_WITH(ops::pos_embed_interpolate_backward(out, ids, w, rt, g.to(Device::cpu())),
                    ContainsSubstring("d_out and d_table are on different devices"));
  CHECK_THROWS_WITH(ops::pos_embed_row_taps(ids, S, gpu()), ContainsSubstring("ids must be on the CPU"));
  for (float v : g.to_vector<float>()) CHECK(v == 0.f);
}

TEST_CASE("row ops allocate nothing in the steady state", "[ops][row_ops][gpu]") {
  REQUIRE_GPU();
  Stream s = Stream::create(gpu());
  const int64_t rows = 577, n = 1152, S = 36, D = 1024;
  Tensor y = randn({rows, n}, DType::bf16, gpu(), 5001), b = randn({n}, DType::bf16, gpu(), 5002);
  Tensor db = Tensor::zeros({n}, DType::f32, gpu(), s);
  Tensor ws = Tensor::empty({int64_t(ops::bias_backward_workspace_bytes(rows, n))}, DType::u8, gpu(), s);
  const Taps taps = bilinear_taps(20, 18, 6);
  const int64_t P = taps.ids.size(1);
  const Tensor ids = taps.ids.to(gpu(), s), w = taps.weights.to(gpu(), s);
  const ops::PosEmbedRowTaps rt = ops::pos_embed_row_taps(taps.ids, S, gpu(), s);
  Tensor table = randn({S, D}, DType::bf16, gpu(), 5003), out = Tensor::empty({P, D}, DType::bf16, gpu(), s);
  Tensor g = Tensor::zeros({S, D}, DType::f32, gpu(), s);
  Stream::default_for(gpu()).synchronize();
  s.synchronize();
  const int64_t before = memory_stats(gpu()).allocations;
  for (int i = 0; i < 3; ++i) {
    ops::bias_add_(y, b, s);
    ops::bias_backward(y, db, i > 0, ws, s);
    ops::pos_embed_interpolate_forward(table, ids, w, out, i > 0, s);
    ops::pos_embed_interpolate_backward(out, ids, w, rt, g, s);
  }
  s.synchronize();
  CHECK(memory_stats(gpu()).allocations == before);
}
