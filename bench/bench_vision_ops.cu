// bench/bench_vision_ops.cu: the memory-bound ops of the Qwen3-VL vision tower
// (slime::ops layer_norm, gelu in both forms), bf16, one GPU, each timed
// beside a device-to-device copy of the same traffic. The PyTorch baseline is
// bench/torch_vision_ops.py (same names, same byte counts).
//
// Shapes (Qwen3-VL-2B's tower: hidden 1024, MLP 4096; its deepstack mergers
// normalise 4096-wide rows after the 2x2 shuffle): rows T = 4096 (about five
// 448^2 images at patch 16, 784 patches each) and 16384 (four 1024^2 images,
// 4096 patches each).
//   layer_norm  T x D, D = 1024 and 4096, bf16 x, weight and bias
//   gelu        T x 4096 (the MLP's intermediate), tanh and erf forms
//
// Bytes are the algorithmic traffic, each operand read or written once (bf16
// = 2 bytes, fp32 = 4):
//   layer_norm_fwd      read x, w, b; write y, mean, rstd           4TD + 4D + 8T
//   layer_norm_fwd_bwd  the forward, then the backward: read x, dy, w,
//                       mean, rstd; write dx; dw, db read and written
//                                                                   4TD + 4D + 8T + 6TD + 2D + 8T + 16D
//                       (slime's dw / db partial sums add 2 x 2 x 4 x B x D
//                       bytes of workspace traffic for B resident blocks,
//                       not counted)
//   gelu_*_fwd          read x, write y                             4N   (N = T x 4096)
//   gelu_*_fwd_bwd      the forward, then read x, dy, write dx      4N + 6N
// Bandwidth GBps = bytes / time (1e9 bytes/s); copy_GBps is a copy of bytes / 2
// (the same traffic) and frac_of_copy = GBps / copy_GBps. The 16384-row
// operands are >= 32 MiB and the 4096-row ones >= 8 MiB: the smaller ones
// partly fit the 50 MB L2 (no flush; read the 16384 rows for bandwidth).
//
// Timing: the first run of each benchmark checks sampled rows against the CPU
// reference (skips with the error when wrong), then kWarmup untimed calls;
// each iteration records a CUDA event, runs kBatch calls, records another and
// reports the time / kBatch (UseManualTime). Iterations and repetitions are
// fixed; read the median over repetitions.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "slime/core/half.hpp"
#include "slime/core/random.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/ops/gelu.hpp"
#include "slime/ops/layer_norm.hpp"

namespace {

using slime::BFloat16;
using slime::Device;
using slime::DType;
using slime::Stream;
using slime::Tensor;
using slime::ops::GeluApproximation;
namespace ops = slime::ops;

constexpr int kWarmup = 3;
constexpr int kBatch = 5;
constexpr int kIterations = 10;
constexpr int kRepetitions = 5;
constexpr int kCopyReps = 10;  // timed copy batches for frac_of_copy; the median is used
constexpr float kEps = 1e-6f;  // Qwen3-VL's vision LayerNorm eps
constexpr int64_t kMlp = 4096;

Device gpu() { return Device::cuda(0); }

Tensor randn(const slime::Shape& shape, const Stream& s, uint64_t seed, float stddev = 1.f, float mean = 0.f) {
  Tensor t = Tensor::empty(shape, DType::bf16, gpu(), s);
  slime::fill_normal(t, seed, 0, mean, stddev, s);
  return t;
}

// Host copy of row r of a [rows, cols] bf16 device tensor.
std::vector<BFloat16> host_row(const Tensor& t, int64_t r, const Stream& s) {
  return t.slice_rows(r, 1).to_vector<BFloat16>(s);
}

double rel_err(const std::vector<BFloat16>& got, const std::vector<BFloat16>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = float(got[i]), w = float(want[i]);
    if (!std::isfinite(g)) return INFINITY;
    num += (g - w) * (g - w);
    den += w * w;
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

using Case = slime::bench::CopyBoundCase;

void run_case(benchmark::State& state, const std::string& name, const std::function<Case(const Stream&)>& setup) {
  slime::bench::run_copy_bound_case(state, name, setup, gpu(), kWarmup, kBatch, kCopyReps);
}

// ---- cases ----

Case layer_norm_case(const Stream& s, int64_t T, int64_t D, bool backward) {
  struct Bufs {
    Tensor x, w, b, y, mean, rstd, dy, dx, dw, db, ws;
  };
  auto b = std::make_shared<Bufs>();
  b->x = randn({T, D}, s, 1, 2.f, 0.5f);
  b->w = randn({D}, s, 2, 0.3f, 1.f);
  b->b = randn({D}, s, 3, 0.3f);
  b->y = Tensor::empty({T, D}, DType::bf16, gpu(), s);
  b->mean = Tensor::empty({T}, DType::f32, gpu(), s);
  b->rstd = Tensor::empty({T}, DType::f32, gpu(), s);
  b->dy = randn({T, D}, s, 4);
  b->dx = Tensor::empty({T, D}, DType::bf16, gpu(), s);
  b->dw = Tensor::zeros({D}, DType::f32, gpu(), s);
  b->db = Tensor::zeros({D}, DType::f32, gpu(), s);
  b->ws = Tensor::empty({int64_t(ops::layer_norm_backward_workspace_bytes(T, D))}, DType::u8, gpu(), s);
  Case c;
  const double TD = double(T) * double(D);
  const double fwd_bytes = 4 * TD + 4 * double(D) + 8 * double(T);
  c.bytes = backward ? fwd_bytes + 6 * TD + 2 * double(D) + 8 * double(T) + 16 * double(D) : fwd_bytes;
  c.launch = [b, backward](const Stream& st) {
    ops::layer_norm_forward(b->x, b->w, b->b, kEps, b->y, b->mean, b->rstd, st);
    if (backward) ops::layer_norm_backward(b->x, b->w, b->mean, b->rstd, b->dy, b->dx, b->dw, b->db, b->ws, st);
  };
  c.check = [b, T, D, backward, launch = c.launch](const Stream& st) -> std::string {
    b->y.fill_bytes_(0xff, st);
    b->dx.fill_bytes_(0xff, st);
    launch(st);
    const std::vector<BFloat16> w = b->w.to_vector<BFloat16>(st), bias = b->b.to_vector<BFloat16>(st);
    for (int64_t r : {int64_t(0), int64_t(1), T / 2, T - 1}) {
      const std::vector<BFloat16> x = host_row(b->x, r, st), dy = host_row(b->dy, r, st);
      std::vector<BFloat16> y(static_cast<std::size_t>(D)), dx(static_cast<std::size_t>(D));
      float mean = 0.f, rstd = 0.f;
      ops::cpu::layer_norm_forward(x.data(), w.data(), bias.data(), 1, D, kEps, y.data(), &mean, &rstd);
      double err = rel_err(host_row(b->y, r, st), y);
      if (backward) {
        std::vector<float> dw(static_cast<std::size_t>(D), 0.f), db(static_cast<std::size_t>(D), 0.f);
        ops::cpu::layer_norm_backward(x.data(), w.data(), &mean, &rstd, dy.data(), 1, D, dx.data(), dw.data(),
                                      db.data());
        err = std::max(err, rel_err(host_row(b->dx, r, st), dx));
      }
      if (!(err <= 4e-3)) return slime::detail::concat("correctness check failed: row ", r, " relative error ", err);
    }
    return "";
  };
  return c;
}

Case gelu_case(const Stream& s, int64_t T, GeluApproximation form, bool backward) {
  struct Bufs {
    Tensor x, y, dy, dx;
  };
  auto b = std::make_shared<Bufs>();
  b->x = randn({T, kMlp}, s, 11, 3.f);
  b->y = Tensor::empty({T, kMlp}, DType::bf16, gpu(), s);
  b->dy = randn({T, kMlp}, s, 12);
  b->dx = Tensor::empty({T, kMlp}, DType::bf16, gpu(), s);
  Case c;
  const double n = double(T) * double(kMlp);
  c.bytes = backward ? 10 * n : 4 * n;
  c.launch = [b, form, backward](const Stream& st) {
    ops::gelu_forward(b->x, form, b->y, st);
    if (backward) ops::gelu_backward(b->x, b->dy, form, b->dx, st);
  };
  c.check = [b, T, form, backward, launch = c.launch](const Stream& st) -> std::string {
    b->y.fill_bytes_(0xff, st);
    b->dx.fill_bytes_(0xff, st);
    launch(st);
    for (int64_t r : {int64_t(0), T / 3, T - 1}) {
      const std::vector<BFloat16> x = host_row(b->x, r, st), dy = host_row(b->dy, r, st);
      std::vector<BFloat16> y(x.size()), dx(x.size());
      ops::cpu::gelu_forward(x.data(), kMlp, form, y.data());
      double err = rel_err(host_row(b->y, r, st), y);
      if (backward) {
        ops::cpu::gelu_backward(x.data(), dy.data(), kMlp, form, dx.data());
        err = std::max(err, rel_err(host_row(b->dx, r, st), dx));
      }
      if (!(err <= 4e-3)) return slime::detail::concat("correctness check failed: row ", r, " relative error ", err);
    }
    return "";
  };
  return c;
}

void add_benchmark(const std::string& name, std::function<Case(const Stream&)> setup) {
  slime::bench::register_manual(
      name, [name, setup](benchmark::State& st) { run_case(st, name, setup); }, benchmark::kMicrosecond, kIterations,
      kRepetitions);
}

}  // namespace

int main(int argc, char** argv) {
  for (int64_t T : {int64_t(16384), int64_t(4096)}) {
    for (int64_t D : {int64_t(1024), int64_t(4096)}) {
      const std::string shape = std::to_string(T) + "x" + std::to_string(D);
      add_benchmark("layer_norm_fwd/" + shape + "/bf16",
                    [T, D](const Stream& s) { return layer_norm_case(s, T, D, false); });
      add_benchmark("layer_norm_fwd_bwd/" + shape + "/bf16",
                    [T, D](const Stream& s) { return layer_norm_case(s, T, D, true); });
    }
    const std::string shape = std::to_string(T) + "x" + std::to_string(kMlp);
    for (GeluApproximation form : {GeluApproximation::tanh, GeluApproximation::none}) {
      const std::string op = form == GeluApproximation::tanh ? "gelu_tanh" : "gelu_erf";
      add_benchmark(op + "_fwd/" + shape + "/bf16",
                    [T, form](const Stream& s) { return gelu_case(s, T, form, false); });
      add_benchmark(op + "_fwd_bwd/" + shape + "/bf16",
                    [T, form](const Stream& s) { return gelu_case(s, T, form, true); });
    }
  }
  return slime::bench::run_benchmarks(argc, argv);
}
