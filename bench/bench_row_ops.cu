// bench/bench_row_ops.cu: the row ops of the Qwen3-VL vision tower (slime::ops
// bias_add_, bias_backward, pos_embed_interpolate forward and backward), bf16,
// one GPU, each timed beside a device-to-device copy of the same traffic. The
// PyTorch baseline is bench/torch_row_ops.py (same names, same byte counts).
//
// Shapes: T = 16384 rows (four 1024^2 images at patch 16) at n = 4096 (the
// MLP's linear_fc1 bias) and n = 1152 (a 1152-wide tower's projections); the
// position-embedding resample of P = 16384 patches (one 128 x 128 patch grid,
// align-corners bilinear taps) from Qwen3-VL's 48 x 48 table (S = 2304) at
// D = 1024.
//
// Bytes are the algorithmic traffic, each operand read or written once (bf16
// = 2 bytes, fp32 = 4, i32 = 4):
//   bias_add           read y, b; write y                      4Tn + 2n
//   bias_grad          read dy; db read and written (fp32)      2Tn + 8n
//                      (slime's partial sums add 2 x 4 x chunks x n bytes of
//                      workspace traffic, chunks = 128 at T = 16384: not counted)
//   pos_embed_fwd      read table, ids, weights; write out      2SD + 32P + 2PD
//   pos_embed_fwd_bwd  the forward, then read d_out, ids,
//                      weights; d_table read and written (fp32) 2SD + 32P + 2PD + 2PD + 32P + 8SD
//                      (slime also reads its by-row grouping of the taps,
//                      16P + 4S bytes, and each patch's d_out row once per tap:
//                      not counted)
// Bandwidth GBps = bytes / time (1e9 bytes/s); copy_GBps is a copy of bytes / 2
// (the same traffic) and frac_of_copy = GBps / copy_GBps. The gathered table
// rows of the resample come from L2 (the table is 4.5 MiB).
//
// Timing: the first run of each benchmark checks it against the CPU reference
// (sampled rows, or every column of the gradients; skips with the error when
// wrong), then kWarmup untimed calls; each iteration records a CUDA event,
// runs kBatch calls, records another and reports the time / kBatch
// (UseManualTime). Iterations and repetitions are fixed; read the median over
// repetitions.
#include <benchmark/benchmark.h>

#include <algorithm>
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
#include "slime/ops/row_ops.hpp"

namespace {

using slime::BFloat16;
using slime::Device;
using slime::DType;
using slime::Stream;
using slime::Tensor;
namespace ops = slime::ops;

constexpr int kWarmup = 3;
constexpr int kBatch = 5;
constexpr int kIterations = 10;
constexpr int kRepetitions = 5;
constexpr int kCopyReps = 10;  // timed copy batches for frac_of_copy; the median is used
constexpr int64_t kRows = 16384;
constexpr int64_t kGrid = 128, kSide = 48, kDim = 1024;  // P = kGrid^2 patches, S = kSide^2

Device gpu() { return Device::cuda(0); }

Tensor randn(const slime::Shape& shape, const Stream& s, uint64_t seed, float stddev = 1.f) {
  Tensor t = Tensor::empty(shape, DType::bf16, gpu(), s);
  slime::fill_normal(t, seed, 0, 0.f, stddev, s);
  return t;
}

std::vector<double> to_double(const std::vector<BFloat16>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = double(float(v[i]));
  return out;
}

double rel_err(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

std::string check_err(double err, double tol, const std::string& what) {
  if (err <= tol) return "";
  return slime::detail::concat("correctness check failed: ", what, " relative error ", err);
}

// Align-corners bilinear taps of a g x g patch grid into a side x side table
// (nn::vision_pos_interpolation for one image of one frame without the merge
// reordering, which only permutes the patches): ids and weights [4, g^2].
void bilinear_taps(int64_t g, int64_t side, std::vector<int32_t>& ids, std::vector<float>& weights) {
  const int64_t P = g * g;
  ids.assign(std::size_t(4 * P), 0);
  weights.assign(std::size_t(4 * P), 0.f);
  for (int64_t p = 0; p < P; ++p) {
    int32_t tap[2][2];
    float f[2][2];
    for (int a = 0; a < 2; ++a) {
      const float src = float(a == 0 ? p / g : p % g) * float(side - 1) / float(g - 1);
      const float fl = std::floor(src);
      for (int o = 0; o < 2; ++o) {
        tap[a][o] = int32_t(std::min<int64_t>(int64_t(fl) + o, side - 1));
        f[a][o] = std::max(0.f, 1.f - std::abs(src - fl - float(o)));
      }
    }
    for (int a = 0; a < 2; ++a)
      for (int b = 0; b < 2; ++b) {
        ids[std::size_t((2 * a + b) * P + p)] = tap[0][a] * int32_t(side) + tap[1][b];
        weights[std::size_t((2 * a + b) * P + p)] = f[0][a] * f[1][b];
      }
  }
}

using Case = slime::bench::CopyBoundCase;

void run_case(benchmark::State& state, const std::string& name, const std::function<Case(const Stream&)>& setup) {
  slime::bench::run_copy_bound_case(state, name, setup, gpu(), kWarmup, kBatch, kCopyReps);
}

// ---- cases ----

Case bias_add_case(const Stream& s, int64_t T, int64_t n) {
  struct Bufs {
    Tensor y, b;
  };
  auto b = std::make_shared<Bufs>();
  b->y = randn({T, n}, s, 1);
  b->b = randn({n}, s, 2);
  Case c;
  c.bytes = 4 * double(T) * double(n) + 2 * double(n);
  c.launch = [b](const Stream& st) { ops::bias_add_(b->y, b->b, st); };
  c.check = [b, T, n](const Stream& st) -> std::string {
    const std::vector<int64_t> rows{0, 1, T / 2, T - 1};
    std::vector<std::vector<BFloat16>> before;
    for (int64_t r : rows) before.push_back(b->y.slice_rows(r, 1).to_vector<BFloat16>(st));
    ops::bias_add_(b->y, b->b, st);
    const std::vector<BFloat16> bias = b->b.to_vector<BFloat16>(st);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      ops::cpu::bias_add(before[i].data(), bias.data(), 1, n);
      const std::vector<BFloat16> got = b->y.slice_rows(rows[i], 1).to_vector<BFloat16>(st);
      // One fp32 add and one rounding on both devices: the same bits.
      for (int64_t k = 0; k < n; ++k)
        if (got[std::size_t(k)].bits != before[i][std::size_t(k)].bits)
          return slime::detail::concat("correctness check failed: row ", rows[i], " column ", k);
    }
    return "";
  };
  return c;
}

Case bias_grad_case(const Stream& s, int64_t T, int64_t n) {
  struct Bufs {
    Tensor dy, db, ws;
  };
  auto b = std::make_shared<Bufs>();
  b->dy = randn({T, n}, s, 3);
  b->db = Tensor::zeros({n}, DType::f32, gpu(), s);
  b->ws = Tensor::empty({int64_t(ops::bias_backward_workspace_bytes(T, n))}, DType::u8, gpu(), s);
  Case c;
  c.bytes = 2 * double(T) * double(n) + 8 * double(n);
  c.launch = [b](const Stream& st) { ops::bias_backward(b->dy, b->db, /*accumulate=*/true, b->ws, st); };
  c.check = [b, T, n](const Stream& st) -> std::string {
    b->db.fill_bytes_(0xff, st);
    ops::bias_backward(b->dy, b->db, /*accumulate=*/false, b->ws, st);
    const std::vector<BFloat16> dy = b->dy.to_vector<BFloat16>(st);
    std::vector<float> want(static_cast<std::size_t>(n));
    ops::cpu::bias_backward(dy.data(), T, n, want.data(), false);
    const std::vector<float> got = b->db.to_vector<float>(st);
    return check_err(
        rel_err(std::vector<double>(got.begin(), got.end()), std::vector<double>(want.begin(), want.end())), 1e-5,
        "db");
  };
  return c;
}

Case pos_embed_case(const Stream& s, bool backward) {
  const int64_t P = kGrid * kGrid, S = kSide * kSide, D = kDim;
  struct Bufs {
    Tensor table, ids, weights, out, d_out, d_table;
    ops::PosEmbedRowTaps by_row;
    std::vector<int32_t> ids_host;
    std::vector<float> weights_host;
  };
  auto b = std::make_shared<Bufs>();
  bilinear_taps(kGrid, kSide, b->ids_host, b->weights_host);
  const Tensor ids_host = Tensor::from_vector(b->ids_host, {4, P});
  b->ids = ids_host.to(gpu(), s);
  b->weights = Tensor::from_vector(b->weights_host, {4, P}, gpu(), s);
  b->by_row = ops::pos_embed_row_taps(ids_host, S, gpu(), s);
  b->table = randn({S, D}, s, 4);
  b->out = Tensor::empty({P, D}, DType::bf16, gpu(), s);
  b->d_out = randn({P, D}, s, 5);
  b->d_table = Tensor::zeros({S, D}, DType::f32, gpu(), s);
  Case c;
  const double fwd = 2 * double(S * D) + 32 * double(P) + 2 * double(P * D);
  c.bytes = backward ? fwd + 2 * double(P * D) + 32 * double(P) + 8 * double(S * D) : fwd;
  c.launch = [b, backward](const Stream& st) {
    ops::pos_embed_interpolate_forward(b->table, b->ids, b->weights, b->out, /*accumulate=*/false, st);
    if (backward) ops::pos_embed_interpolate_backward(b->d_out, b->ids, b->weights, b->by_row, b->d_table, st);
  };
  c.check = [b, P, S, D, backward](const Stream& st) -> std::string {
    b->out.fill_bytes_(0xff, st);
    b->d_table.fill_bytes_(0, st);
    ops::pos_embed_interpolate_forward(b->table, b->ids, b->weights, b->out, false, st);
    if (backward) ops::pos_embed_interpolate_backward(b->d_out, b->ids, b->weights, b->by_row, b->d_table, st);
    const std::vector<BFloat16> table = b->table.to_vector<BFloat16>(st);
    for (int64_t p : {int64_t(0), int64_t(1), P / 3, P - 1}) {
      int32_t ids[4];
      float w[4];
      for (int k = 0; k < 4; ++k) {
        ids[k] = b->ids_host[std::size_t(k * P + p)];
        w[k] = b->weights_host[std::size_t(k * P + p)];
      }
      std::vector<BFloat16> want(static_cast<std::size_t>(D));
      ops::cpu::pos_embed_interpolate_forward(table.data(), S, D, ids, w, 1, want.data(), false);
      const std::string e =
          check_err(rel_err(to_double(b->out.slice_rows(p, 1).to_vector<BFloat16>(st)), to_double(want)), 4e-3,
                    slime::detail::concat("out row ", p));
      if (!e.empty()) return e;
    }
    if (!backward) return "";
    const std::vector<BFloat16> d_out = b->d_out.to_vector<BFloat16>(st);
    std::vector<float> want(std::size_t(S * D), 0.f);
    ops::cpu::pos_embed_interpolate_backward(d_out.data(), b->ids_host.data(), b->weights_host.data(), P, S, D,
                                             want.data());
    const std::vector<float> got = b->d_table.to_vector<float>(st);
    return check_err(
        rel_err(std::vector<double>(got.begin(), got.end()), std::vector<double>(want.begin(), want.end())), 1e-5,
        "d_table");
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
  for (int64_t n : {int64_t(4096), int64_t(1152)}) {
    const std::string shape = std::to_string(kRows) + "x" + std::to_string(n);
    add_benchmark("bias_add/" + shape + "/bf16", [n](const Stream& s) { return bias_add_case(s, kRows, n); });
    add_benchmark("bias_grad/" + shape + "/bf16", [n](const Stream& s) { return bias_grad_case(s, kRows, n); });
  }
  const std::string shape =
      std::to_string(kGrid * kGrid) + "x" + std::to_string(kSide * kSide) + "x" + std::to_string(kDim);
  add_benchmark("pos_embed_fwd/" + shape + "/bf16", [](const Stream& s) { return pos_embed_case(s, false); });
  add_benchmark("pos_embed_fwd_bwd/" + shape + "/bf16", [](const Stream& s) { return pos_embed_case(s, true); });
  return slime::bench::run_benchmarks(argc, argv);
}
