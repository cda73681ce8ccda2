// bench/bench_grouped_gemm.cu: the grouped GEMM over experts (slime::ops,
// hand-written mma.sync kernel) on MoE shapes, bf16 inputs, one GPU. The
// PyTorch baseline (torch._grouped_mm) is bench/torch_grouped_gemm.py; names
// match, so bench/compare_ops.py prints them side by side.
//
// Problems (rows = tokens x top-k, grouped by expert):
//   q30b: Qwen3-30B-A3B layer, 128 experts, hidden 2048, moe_intermediate 768,
//         32768 tokens x top-8 = 262144 rows; projections gate_up (2048 ->
//         768, as gate_proj and up_proj each) and down (768 -> 2048)
//   e64:  64 experts, 2048 -> 768, 65536 rows
// Group sizes: uniform (rows / E each) or skewed (weights w_e = 0 for
// e % 16 == 15, 8 for e % 8 == 0, else 1 + e % 5; size_e = rows · w_e / Σw,
// the remainder to expert 0; the same formula as the Python baseline).
// Ops, with the two numbers (K in, Nout out, E experts):
//   fwd    y  [rows, Nout] bf16  = x_g · w_eᵀ
//   dgrad  dx [rows, K]    bf16  = dy_g · w_e
//   wgrad  dw [E, Nout, K] f32  += dy_gᵀ · x_g
//   FLOP  = 2 · rows · K · Nout for each
//   bytes = each operand once: fwd 2(rows·K + E·Nout·K + rows·Nout), dgrad the
//           same, wgrad 2(rows·Nout + rows·K) + 8·E·Nout·K (dw read and written)
// Names: grouped_gemm/<problem>/<proj>/<dist>/<op> runs the dispatcher's
// choice; .../<op>/<tile> (m128n128k32, m128n256k64, m128n128k64) forces each
// tensor-core tile configuration (slime only, to pick the dispatcher's table
// from one run); .../<op>/cublas runs the cuBLAS backend with the host offsets
// (slime only: fwd and dgrad one cublasGemmGroupedBatchedEx, experts of equal
// size in one group; wgrad, f32 dw, one cublasGemmEx per expert), so one run
// shows both backends against torch's <op> row. The plain <op> row is the
// device-offset kernel unless SLIME_GROUPED_GEMM_BACKEND=cublas forces cuBLAS
// (it then fetches the offsets with a stream sync per call).
//
// Timing: the first run of each benchmark checks 256 sampled outputs against a
// double-precision host sum over host copies of the inputs (skips with the
// error when wrong), then kWarmup untimed calls; each iteration records a CUDA
// event, runs kBatch calls, records another (UseManualTime). Read the median
// over repetitions. Large GEMMs are compute-bound: no L2 flush needed.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "slime/core/half.hpp"
#include "slime/core/random.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/ops/cuda/grouped_gemm.hpp"
#include "slime/ops/cuda/linear.hpp"
#include "slime/ops/grouped_gemm.hpp"

namespace {

using slime::BFloat16;
using slime::Device;
using slime::DType;
using slime::Stream;
using slime::Tensor;
using slime::ops::cuda::GroupedGemmPass;
using slime::ops::cuda::GroupedGemmTile;

constexpr int kWarmup = 2;       // untimed calls per run
constexpr int kBatch = 3;        // calls per timed iteration
constexpr int kIterations = 5;   // timed iterations per run
constexpr int kRepetitions = 3;  // runs; the median is reported
constexpr int kSamples = 256;    // checked outputs per benchmark

struct Shape {
  const char* problem;
  const char* proj;
  const char* dist;
  int64_t experts, rows, in, out;
};

constexpr Shape kShapes[] = {
    {"q30b", "gate_up", "uniform", 128, 262144, 2048, 768}, {"q30b", "down", "uniform", 128, 262144, 768, 2048},
    {"q30b", "gate_up", "skewed", 128, 262144, 2048, 768},  {"q30b", "down", "skewed", 128, 262144, 768, 2048},
    {"e64", "gate_up", "uniform", 64, 65536, 2048, 768},    {"e64", "gate_up", "skewed", 64, 65536, 2048, 768},
};

enum class Op { fwd, dgrad, wgrad };
constexpr const char* op_name(Op op) { return op == Op::fwd ? "fwd" : op == Op::dgrad ? "dgrad" : "wgrad"; }

std::vector<int32_t> group_sizes(const Shape& s) {
  std::vector<int64_t> w(std::size_t(s.experts), 1);
  if (std::string(s.dist) == "skewed")
    for (int64_t e = 0; e < s.experts; ++e) w[std::size_t(e)] = e % 16 == 15 ? 0 : e % 8 == 0 ? 8 : 1 + e % 5;
  int64_t total_w = 0;
  for (int64_t v : w) total_w += v;
  std::vector<int32_t> sizes(std::size_t(s.experts));
  int64_t used = 0;
  for (int64_t e = 0; e < s.experts; ++e) {
    sizes[std::size_t(e)] = int32_t(s.rows * w[std::size_t(e)] / total_w);
    used += sizes[std::size_t(e)];
  }
  sizes[0] += int32_t(s.rows - used);
  return sizes;
}

// Inputs and outputs of one shape, with host copies of the inputs for the
// check. Kept for the shape's ops, then dropped for the next shape.
struct Problem {
  Shape shape{};
  Stream stream;
  std::vector<int32_t> offsets_host;
  Tensor offsets, x, w, dy, y, dx, dw;
  std::vector<BFloat16> hx, hw, hdy;
};

std::unique_ptr<Problem> g_problem;

Problem& problem(const Shape& s) {
  if (g_problem && std::string(g_problem->shape.problem) == s.problem && std::string(g_problem->shape.proj) == s.proj &&
      std::string(g_problem->shape.dist) == s.dist)
    return *g_problem;
  g_problem.reset();
  auto p = std::make_unique<Problem>();
  const Device d = Device::cuda(0);
  p->shape = s;
  p->stream = Stream::create(d);
  const Stream& st = p->stream;
  const int64_t E = s.experts, N = s.rows, K = s.in, No = s.out;
  const std::vector<int32_t> sizes = group_sizes(s);
  p->offsets_host.assign(std::size_t(E + 1), 0);
  for (int64_t e = 0; e < E; ++e)
    p->offsets_host[std::size_t(e + 1)] = p->offsets_host[std::size_t(e)] + sizes[std::size_t(e)];
  p->offsets = Tensor::from_vector(p->offsets_host, {E + 1}, d, st);
  p->x = Tensor::empty({N, K}, DType::bf16, d, st);
  p->w = Tensor::empty({E, No, K}, DType::bf16, d, st);
  p->dy = Tensor::empty({N, No}, DType::bf16, d, st);
  slime::fill_normal(p->x, 1, 0, 0.f, 1.f, st);
  slime::fill_normal(p->w, 2, 0, 0.f, 1.f, st);
  slime::fill_normal(p->dy, 3, 0, 0.f, 1.f, st);
  p->y = Tensor::empty({N, No}, DType::bf16, d, st);
  p->dx = Tensor::empty({N, K}, DType::bf16, d, st);
  p->dw = Tensor::zeros({E, No, K}, DType::f32, d, st);
  p->hx = p->x.to_vector<BFloat16>(st);
  p->hw = p->w.to_vector<BFloat16>(st);
  p->hdy = p->dy.to_vector<BFloat16>(st);
  g_problem = std::move(p);
  return *g_problem;
}

// `cublas`: the cuBLAS backend with host offsets (tile automatic).
void launch(Problem& p, Op op, GroupedGemmTile tile, bool cublas) {
  const Shape& s = p.shape;
  if (tile == GroupedGemmTile::automatic && !cublas) {
    switch (op) {
      case Op::fwd:
        return slime::ops::grouped_gemm_forward(p.x, p.w, p.offsets, p.y, p.stream);
      case Op::dgrad:
        return slime::ops::grouped_gemm_backward_input(p.dy, p.w, p.offsets, p.dx, false, p.stream);
      case Op::wgrad:
        return slime::ops::grouped_gemm_backward_weight(p.dy, p.x, p.offsets, p.dw, p.stream);
    }
  }
  slime::ops::cuda::GroupedGemmParams q;
  q.pass = op == Op::fwd     ? GroupedGemmPass::forward
           : op == Op::dgrad ? GroupedGemmPass::backward_input
                             : GroupedGemmPass::backward_weight;
  q.a = op == Op::fwd ? p.x.data_ptr() : p.dy.data_ptr();
  q.b = op == Op::wgrad ? p.x.data_ptr() : p.w.data_ptr();
  q.c = op == Op::fwd ? p.y.data_ptr() : op == Op::dgrad ? p.dx.data_ptr() : p.dw.data_ptr();
  q.offsets = p.offsets.data<int32_t>();
  q.in_dtype = DType::bf16;
  q.out_dtype = op == Op::wgrad ? DType::f32 : DType::bf16;
  q.experts = s.experts;
  q.rows = s.rows;
  q.out_features = s.out;
  q.in_features = s.in;
  q.tile = tile;
  if (cublas) {
    q.host_offsets = p.offsets_host.data();
    q.backend = slime::ops::cuda::GroupedGemmBackend::cublas;
  }
  slime::ops::cuda::grouped_gemm(q, p.stream.handle());
}

double flop(const Shape& s) { return 2.0 * double(s.rows) * double(s.in) * double(s.out); }

double bytes(const Shape& s, Op op) {
  const double N = double(s.rows), K = double(s.in), No = double(s.out), E = double(s.experts);
  if (op == Op::wgrad) return 2 * (N * No + N * K) + 8 * E * No * K;
  return 2 * (N * K + E * No * K + N * No);
}

int group_of(const std::vector<int32_t>& off, int64_t r) {
  return int(std::upper_bound(off.begin(), off.end(), int32_t(r)) - off.begin()) - 1;
}

// One element of a device tensor (a 1-element copy).
template <class T>
double element(const Tensor& t, int64_t i, const Stream& s) {
  const T v = t.view(i, {1}).to_vector<T>(s)[0];
  return double(float(v));
}

// Runs the op once on poisoned outputs (dw from zero) and compares kSamples
// outputs with a double-precision sum over the host inputs. "" or the error.
std::string check_once(Problem& p, Op op, GroupedGemmTile tile, bool cublas) {
  const Shape& s = p.shape;
  const int64_t K = s.in, No = s.out;
  p.y.fill_bytes_(0xff, p.stream);
  p.dx.fill_bytes_(0xff, p.stream);
  p.dw.zero_(p.stream);
  launch(p, op, tile, cublas);
  auto f = [](BFloat16 v) { return double(float(v)); };
  const std::vector<int32_t>& off = p.offsets_host;
  for (int i = 0; i < kSamples; ++i) {
    const uint64_t r1 = slime::philox_word(77, uint64_t(2 * i)), r2 = slime::philox_word(77, uint64_t(2 * i + 1));
    double want = 0, mag = 0, got = 0;
    int64_t where[3] = {};
    if (op == Op::wgrad) {
      // Sample experts with rows (dw of empty experts stays 0).
      int64_t e = int64_t(r1 % uint64_t(s.experts));
      while (off[std::size_t(e + 1)] == off[std::size_t(e)]) e = (e + 1) % s.experts;
      const int64_t n = int64_t((r1 >> 32) % uint64_t(No)), k = int64_t(r2 % uint64_t(K));
      for (int64_t r = off[std::size_t(e)]; r < off[std::size_t(e + 1)]; ++r) {
        const double t = f(p.hdy[std::size_t(r * No + n)]) * f(p.hx[std::size_t(r * K + k)]);
        want += t;
        mag += std::fabs(t);
      }
      got = element<float>(p.dw, (e * No + n) * K + k, p.stream);
      where[0] = e, where[1] = n, where[2] = k;
    } else {
      const int64_t r = int64_t(r1 % uint64_t(s.rows));
      const int64_t e = group_of(off, r);
      const int64_t cols = op == Op::fwd ? No : K, c = int64_t(r2 % uint64_t(cols));
      const int64_t red = op == Op::fwd ? K : No;
      for (int64_t q = 0; q < red; ++q) {
        const double t = op == Op::fwd ? f(p.hx[std::size_t(r * K + q)]) * f(p.hw[std::size_t((e * No + c) * K + q)])
                                       : f(p.hdy[std::size_t(r * No + q)]) * f(p.hw[std::size_t((e * No + q) * K + c)]);
        want += t;
        mag += std::fabs(t);
      }
      got = element<BFloat16>(op == Op::fwd ? p.y : p.dx, r * cols + c, p.stream);
      where[0] = e, where[1] = r, where[2] = c;
    }
    // bf16 outputs: half an ulp (2^-9) of rounding; all: fp32 summation error.
    const double rounding = op == Op::wgrad ? 0.0 : std::ldexp(1.0, -8) * std::fabs(want);
    const double tol = rounding + 1e-5 * mag;
    if (!(std::fabs(got - want) <= tol))
      return slime::detail::concat("correctness check failed: ", op_name(op), " (expert ", where[0], ", ", where[1],
                                   ", ", where[2], ") is ", got, ", expected ", want, " (tolerance ", tol, ")");
  }
  return "";
}

void run_grouped_gemm(benchmark::State& state, Shape s, Op op, GroupedGemmTile tile, bool cublas) {
  if (slime::bench::skip_without_cuda(state)) return;
  if (!slime::ops::cuda::grouped_gemm_tile_supported(tile)) {
    state.SkipWithError("this tile needs a compute capability 9.0 GPU and an sm_90a build");
    return;
  }
  slime::bench::run_or_skip(state, [&] {
    Problem& p = problem(s);
    static std::map<std::string, std::string> verdicts;
    const std::string id = std::string(s.problem) + s.proj + s.dist + op_name(op) +
                           (cublas ? "cublas" : slime::ops::cuda::grouped_gemm_tile_name(tile));
    if (!slime::bench::passed_check(state, verdicts, id, [&] { return check_once(p, op, tile, cublas); })) return;
    const double t = slime::bench::time_batches(state, p.stream, kWarmup, kBatch, [&] { launch(p, op, tile, cublas); });
    slime::bench::flop_byte_counters(state, t, flop(s), bytes(s, op));
  });
}

// The dense reference of the same FLOPs: one cuBLAS GEMM with expert 0's
// weights over all rows (the "≥ 85% of cuBLAS dense" bar of issue 18). Not
// the same function, so no correctness check.
void run_dense(benchmark::State& state, Shape s, Op op) {
  if (slime::bench::skip_without_cuda(state)) return;
  slime::bench::run_or_skip(state, [&] {
    Problem& p = problem(s);
    const int dev = p.stream.device().index;
    const auto h = p.stream.handle();
    const double t = slime::bench::time_batches(state, p.stream, kWarmup, kBatch, [&] {
      namespace cu = slime::ops::cuda;
      if (op == Op::fwd)
        cu::linear_forward(p.x.data_ptr(), p.w.data_ptr(), p.y.data_ptr(), DType::bf16, DType::bf16, s.rows, s.in,
                           s.out, dev, h);
      else if (op == Op::dgrad)
        cu::linear_backward_input(p.dy.data_ptr(), p.w.data_ptr(), p.dx.data_ptr(), DType::bf16, DType::bf16, s.rows,
                                  s.in, s.out, false, dev, h);
      else
        cu::linear_backward_weight(p.dy.data_ptr(), p.x.data_ptr(), p.dw.data<float>(), DType::bf16, s.rows, s.in,
                                   s.out, dev, h);
    });
    slime::bench::flop_byte_counters(state, t, flop(s), bytes(s, op));
  });
}

}  // namespace

int main(int argc, char** argv) {
  for (const Shape& s : kShapes) {
    for (Op op : {Op::fwd, Op::dgrad, Op::wgrad}) {
      const std::string base =
          std::string("grouped_gemm/") + s.problem + "/" + s.proj + "/" + s.dist + "/" + op_name(op);
      slime::bench::register_manual(
          base, [s, op](benchmark::State& st) { run_grouped_gemm(st, s, op, GroupedGemmTile::automatic, false); },
          benchmark::kMicrosecond, kIterations, kRepetitions);
      slime::bench::register_manual(
          base + "/cublas",
          [s, op](benchmark::State& st) { run_grouped_gemm(st, s, op, GroupedGemmTile::automatic, true); },
          benchmark::kMicrosecond, kIterations, kRepetitions);
      if (op != Op::wgrad)  // wgrad (f32 dw) always runs the per-expert loop
        slime::bench::register_manual(
            base + "/cublas_loop",
            [s, op](benchmark::State& st) {
              slime::ops::cuda::set_grouped_gemm_cublas_grouped_api(false);
              run_grouped_gemm(st, s, op, GroupedGemmTile::automatic, true);
              slime::ops::cuda::set_grouped_gemm_cublas_grouped_api(true);
            },
            benchmark::kMicrosecond, kIterations, kRepetitions);
      slime::bench::register_manual(
          base + "/cublas_dense", [s, op](benchmark::State& st) { run_dense(st, s, op); }, benchmark::kMicrosecond,
          kIterations, kRepetitions);
      for (GroupedGemmTile tile : slime::ops::cuda::kGroupedGemmTiles)
        if (op == Op::fwd || !slime::ops::cuda::grouped_gemm_tile_forward_only(tile))
          slime::bench::register_manual(
              base + "/" + slime::ops::cuda::grouped_gemm_tile_name(tile),
              [s, op, tile](benchmark::State& st) { run_grouped_gemm(st, s, op, tile, false); },
              benchmark::kMicrosecond, kIterations, kRepetitions);
    }
  }
  return slime::bench::run_benchmarks(argc, argv);
}
