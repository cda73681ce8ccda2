// Linear on the GPU (cuBLAS) against the CPU reference on fresh random inputs:
// bf16 and f32, odd sizes (in/out features not multiples of 8, unaligned
// views), outputs poisoned with NaN first, the accumulation contract, a
// steady state that allocates nothing, and handles used from two threads.
//
// Tolerances, as ‖gpu − ref‖ / ‖ref‖ against a double-precision reference
// computed from the same (already rounded) inputs:
//   bf16 outputs: 5e-3. Rounding the exact result once to bf16 is off by at
//     most 2^-9 = 1.95e-3 relative per element; fp32 summation adds ~1e-6.
//   f32 outputs (f32 inputs without TF32, or bf16 inputs, whose products are
//     exact in fp32): 1e-5. fp32 sums of K <= 4096 terms are off by ~1e-6.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "slime/core/memory.hpp"
#include "slime/core/random.hpp"
#include "slime/ops/batch_invariant.hpp"
#include "slime/ops/linear.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;

namespace {

constexpr double kTolBf16 = 5e-3;
constexpr double kTolF32 = 1e-5;

double tolerance(DType out) { return out == DType::bf16 ? kTolBf16 : kTolF32; }

Tensor random_on(const Shape& shape, DType dt, Device d, uint64_t seed, const Stream& s) {
  Tensor t = Tensor::empty(shape, dt, d, s);
  fill_normal(t, seed, 0, 0.f, 1.f, s);
  return t;
}

std::vector<double> to_double(const Tensor& t, const Stream& s = {}) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  if (t.dtype() == DType::f32) {
    const auto v = t.to_vector<float>(s);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = v[i];
  } else {
    const auto v = t.to_vector<BFloat16>(s);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = double(float(v[i]));
  }
  return out;
}

struct Compare {
  double rel = 0;
  int64_t non_finite = 0;
};

Compare compare(const std::vector<double>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  Compare c;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++c.non_finite;
      continue;
    }
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  c.rel = den == 0 ? std::sqrt(num) : std::sqrt(num / den);
  return c;
}

void check_against(const Tensor& got, const std::vector<double>& want, DType out, const Stream& s, const char* what,
                   double tol_f32 = kTolF32) {
  const Compare c = compare(to_double(got, s), want);
  INFO(what << ": relative error " << c.rel << ", " << c.non_finite << " non-finite");
  CHECK(c.non_finite == 0);
  CHECK(c.rel <= (out == DType::f32 ? tol_f32 : tolerance(out)));
}

// All three products at (T, K, N) on `d`, against the double CPU reference.
// tol_f32_y: the forward's f32 tolerance (the batch-invariant mode's tensor
// cores accumulate like the grouped GEMM's: 1e-4, see test_grouped_gemm_gpu).
void check_linear(int64_t T, int64_t K, int64_t N, DType dt, DType out_dt, uint64_t seed, Device d, const Stream& s,
                  double tol_f32_y = kTolF32) {
  INFO("dtype " << dtype_name(dt) << " out " << dtype_name(out_dt) << " T=" << T << " K=" << K << " N=" << N);
  Tensor x = random_on({T, K}, dt, d, seed, s), w = random_on({N, K}, dt, d, seed + 1, s),
         dy = random_on({T, N}, dt, d, seed + 2, s);
  const std::vector<double> xd = to_double(x, s), wd = to_double(w, s), dyd = to_double(dy, s);
  std::vector<double> y_ref(std::size_t(T * N)), dx_ref(std::size_t(T * K)), dw_ref(std::size_t(N * K), 0.0);
  ops::cpu::linear_forward(xd.data(), wd.data(), T, K, N, y_ref.data());
  ops::cpu::linear_backward_input(dyd.data(), wd.data(), T, K, N, dx_ref.data());
  ops::cpu::linear_backward_weight(dyd.data(), xd.data(), T, K, N, dw_ref.data());

  Tensor y = Tensor::empty({T, N}, out_dt, d, s);
  y.fill_bytes_(0xff, s);
  ops::linear_forward(x, w, y, s);
  check_against(y, y_ref, out_dt, s, "y", tol_f32_y);

  Tensor dx = Tensor::empty({T, K}, out_dt, d, s);
  dx.fill_bytes_(0xff, s);
  ops::linear_backward_input(dy, w, dx, false, s);
  check_against(dx, dx_ref, out_dt, s, "dx");

  // dx += dy · W on top of random values.
  Tensor dx_acc = random_on({T, K}, out_dt, d, seed + 3, s);
  std::vector<double> dx_acc_ref = to_double(dx_acc, s);
  for (std::size_t i = 0; i < dx_acc_ref.size(); ++i) dx_acc_ref[i] += dx_ref[i];
  ops::linear_backward_input(dy, w, dx_acc, true, s);
  check_against(dx_acc, dx_acc_ref, out_dt, s, "dx (accumulate)");

  // dW += dyᵀ · x on top of random values.
  Tensor dw = random_on({N, K}, DType::f32, d, seed + 4, s);
  std::vector<double> dw_acc_ref = to_double(dw, s);
  for (std::size_t i = 0; i < dw_acc_ref.size(); ++i) dw_acc_ref[i] += dw_ref[i];
  ops::linear_backward_weight(dy, x, dw, s);
  check_against(dw, dw_acc_ref, DType::f32, s, "dw (accumulate)");
}

}  // namespace

TEST_CASE("linear on the GPU matches the CPU reference on odd sizes", "[ops][linear][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const Stream s = Stream::create(d);
  const int64_t kn[][2] = {{1, 1}, {33, 255}, {255, 33}, {1000, 129}, {7, 3}, {1024, 512}};
  uint64_t seed = 1000;
  // (inputs, output): f32 -> f32, bf16 -> bf16, bf16 -> f32.
  const DType pairs[][2] = {{DType::f32, DType::f32}, {DType::bf16, DType::bf16}, {DType::bf16, DType::f32}};
  for (const auto& pair : pairs) {
    const DType dt = pair[0], out_dt = pair[1];
    for (int64_t T : {1, 17, 127, 577}) {
      for (const auto& e : kn) {
        seed += 10;
        check_linear(T, e[0], e[1], dt, out_dt, seed, d, s);
      }
    }
  }
  // A Qwen3-sized projection with several hundred packed tokens.
  check_linear(577, 2048, 1024, DType::bf16, DType::bf16, 99, d, s);
}

// The forward runs slime's own kernels in the batch-invariant mode
// (slime/ops/batch_invariant.hpp); the backward stays on cuBLAS.
TEST_CASE("linear on the GPU in the batch-invariant mode matches the CPU reference", "[ops][linear][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const Stream s = Stream::create(d);
  ops::BatchInvariantScope mode;
  const int64_t kn[][2] = {{1, 1}, {33, 255}, {1000, 129}, {7, 3}, {1024, 512}, {2048, 768}};
  uint64_t seed = 3000;
  const DType pairs[][2] = {{DType::f32, DType::f32}, {DType::bf16, DType::bf16}, {DType::bf16, DType::f32}};
  for (const auto& pair : pairs) {
    for (int64_t T : {1, 17, 577}) {
      for (const auto& e : kn) {
        seed += 10;
        check_linear(T, e[0], e[1], pair[0], pair[1], seed, d, s, 1e-4);
      }
    }
  }
}

TEST_CASE("linear on the GPU accepts unaligned views", "[ops][linear][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const Stream s = Stream::create(d);
  // Views starting one bf16 element in: pointers only 2-byte aligned.
  const int64_t T = 33, K = 65, N = 31;
  Tensor xb = random_on({T * K + 1}, DType::bf16, d, 7, s), wb = random_on({N * K + 1}, DType::bf16, d, 8, s);
  Tensor x = xb.view(1, {T, K}), w = wb.view(1, {N, K});
  const auto xd = to_double(x, s), wd = to_double(w, s);
  std::vector<double> y_ref(std::size_t(T * N));
  ops::cpu::linear_forward(xd.data(), wd.data(), T, K, N, y_ref.data());
  Tensor yb = Tensor::empty({T * N + 1}, DType::bf16, d, s);
  yb.fill_bytes_(0xff, s);
  ops::linear_forward(x, w, yb.view(1, {T, N}), s);
  const auto yd = to_double(yb, s);
  CHECK(std::isnan(yd[0]));  // the element before the view is untouched
  check_against(yb.view(1, {T, N}), y_ref, DType::bf16, s, "y (unaligned)");
}

TEST_CASE("linear on the GPU: empty extents and the accumulation contract", "[ops][linear][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const Stream s = Stream::create(d);

  // K = 0: y and dW are empty sums: y is written as zeros, dW keeps its value.
  Tensor x0 = Tensor::empty({5, 0}, DType::bf16, d, s), w0 = Tensor::empty({3, 0}, DType::bf16, d, s);
  Tensor y0 = Tensor::empty({5, 3}, DType::bf16, d, s);
  y0.fill_bytes_(0xff, s);
  ops::linear_forward(x0, w0, y0, s);
  for (double v : to_double(y0, s)) CHECK(v == 0.0);
  // T = 0: dW += an empty sum.
  Tensor xt = Tensor::empty({0, 8}, DType::bf16, d, s), dyt = Tensor::empty({0, 4}, DType::bf16, d, s);
  Tensor dwt = random_on({4, 8}, DType::f32, d, 5, s);
  const auto before = to_double(dwt, s);
  ops::linear_backward_weight(dyt, xt, dwt, s);
  CHECK(to_double(dwt, s) == before);

  // dW accumulates: two calls from zero give twice one call.
  const int64_t T = 129, K = 72, N = 40;
  Tensor x = random_on({T, K}, DType::bf16, d, 11, s), w = random_on({N, K}, DType::bf16, d, 12, s),
         dy = random_on({T, N}, DType::bf16, d, 13, s);
  Tensor dw1 = Tensor::zeros({N, K}, DType::f32, d, s), dw2 = Tensor::zeros({N, K}, DType::f32, d, s);
  ops::linear_backward_weight(dy, x, dw1, s);
  ops::linear_backward_weight(dy, x, dw2, s);
  ops::linear_backward_weight(dy, x, dw2, s);
  std::vector<double> twice = to_double(dw1, s);
  for (double& v : twice) v *= 2;
  const Compare c = compare(to_double(dw2, s), twice);
  CHECK(c.non_finite == 0);
  CHECK(c.rel <= 1e-6);

  // linear_backward with both outputs; the default stream works too.
  Tensor dx = Tensor::empty({T, K}, DType::bf16, d);
  dx.fill_bytes_(0xff);
  Tensor dw3 = Tensor::zeros({N, K}, DType::f32, d);
  s.synchronize();
  ops::linear_backward(dy, x, w, dx, dw3);
  const Compare c3 = compare(to_double(dw3), to_double(dw1, s));
  CHECK(c3.non_finite == 0);
  CHECK(c3.rel <= 1e-6);
  for (double v : to_double(dx)) REQUIRE(std::isfinite(v));
}

TEST_CASE("linear on the GPU allocates nothing in steady state", "[ops][linear][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const Stream s = Stream::create(d);
  const int64_t T = 256, K = 512, N = 384;
  Tensor x = random_on({T, K}, DType::bf16, d, 21, s), w = random_on({N, K}, DType::bf16, d, 22, s),
         dy = random_on({T, N}, DType::bf16, d, 23, s);
  Tensor y = Tensor::empty({T, N}, DType::bf16, d, s), dx = Tensor::empty({T, K}, DType::bf16, d, s);
  Tensor dw = Tensor::zeros({N, K}, DType::f32, d, s);
  ops::linear_forward(x, w, y, s);  // creates this thread's handle and workspace
  s.synchronize();
  const int64_t allocations = memory_stats(d).allocations;
  for (int i = 0; i < 10; ++i) {
    ops::linear_forward(x, w, y, s);
    ops::linear_backward(dy, x, w, dx, dw, false, s);
  }
  s.synchronize();
  CHECK(memory_stats(d).allocations == allocations);
}

TEST_CASE("linear on the GPU from two threads on one device", "[ops][linear][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const int64_t T = 300, K = 264, N = 136;
  // Each thread: its own stream, inputs and outputs; many GEMMs back to back
  // so the two threads' calls interleave. Catch2 is not thread-safe: results
  // are checked on the main thread.
  struct Result {
    std::string error;
    Compare y, dw;
  };
  std::vector<Result> results(2);
  auto work = [&](int r) {
    try {
      const Stream s = Stream::create(d);
      const uint64_t seed = 500 + 10 * uint64_t(r);
      Tensor x = random_on({T, K}, DType::bf16, d, seed, s), w = random_on({N, K}, DType::bf16, d, seed + 1, s),
             dy = random_on({T, N}, DType::bf16, d, seed + 2, s);
      Tensor y = Tensor::empty({T, N}, DType::bf16, d, s);
      const int kRounds = 50;
      Tensor dw = Tensor::zeros({N, K}, DType::f32, d, s);
      for (int i = 0; i < kRounds; ++i) {
        y.fill_bytes_(0xff, s);
        ops::linear_forward(x, w, y, s);
        ops::linear_backward_weight(dy, x, dw, s);
      }
      const auto xd = to_double(x, s), wd = to_double(w, s), dyd = to_double(dy, s);
      std::vector<double> y_ref(std::size_t(T * N)), dw_ref(std::size_t(N * K), 0.0);
      ops::cpu::linear_forward(xd.data(), wd.data(), T, K, N, y_ref.data());
      ops::cpu::linear_backward_weight(dyd.data(), xd.data(), T, K, N, dw_ref.data());
      for (double& v : dw_ref) v *= kRounds;
      results[std::size_t(r)].y = compare(to_double(y, s), y_ref);
      results[std::size_t(r)].dw = compare(to_double(dw, s), dw_ref);
    } catch (const std::exception& e) {
      results[std::size_t(r)].error = e.what();
    }
  };
  std::thread t0(work, 0), t1(work, 1);
  t0.join();
  t1.join();
  for (int r = 0; r < 2; ++r) {
    const Result& res = results[std::size_t(r)];
    INFO("thread " << r << ": " << res.error << " y rel " << res.y.rel << " dw rel " << res.dw.rel);
    CHECK(res.error.empty());
    CHECK(res.y.non_finite == 0);
    CHECK(res.y.rel <= kTolBf16);
    CHECK(res.dw.non_finite == 0);
    CHECK(res.dw.rel <= kTolF32);
  }
}

TEST_CASE("linear on the GPU rejects mixed devices", "[ops][linear][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  Tensor x = Tensor::zeros({4, 8}, DType::bf16, d), w_cpu = Tensor::zeros({3, 8}, DType::bf16);
  Tensor y = Tensor::empty({4, 3}, DType::bf16, d);
  CHECK_THROWS_WITH(ops::linear_forward(x, w_cpu, y), ContainsSubstring("different devices"));
  Tensor w = Tensor::zeros({3, 8}, DType::bf16, d), y_cpu = Tensor::empty({4, 3}, DType::bf16);
  CHECK_THROWS_WITH(ops::linear_forward(x, w, y_cpu), ContainsSubstring("different devices"));
  Tensor dw_cpu = Tensor::zeros({3, 8}, DType::f32), dy = Tensor::zeros({4, 3}, DType::bf16, d);
  CHECK_THROWS_WITH(ops::linear_backward_weight(dy, x, dw_cpu), ContainsSubstring("different devices"));
}
