// bench/bench_linear.cu: the three GEMMs of Linear (slime::ops, cuBLAS) on
// Qwen3-like shapes, bf16 inputs, T = 8192 tokens, one GPU. The PyTorch
// baseline (F.linear and the matmuls of its backward) is bench/torch_linear.py,
// which also prints the side-by-side table from this program's JSON.
//
// Shapes (in -> out features), hidden 4096 (Qwen3-8B) and 2048 (Qwen3-1.7B):
//   h4096: qo 4096->4096 (q_proj, o_proj), kv 4096->1024, up 4096->12288
//          (gate_proj, up_proj), down 12288->4096
//   h2048: qo 2048->2048, kv 2048->1024, up 2048->6144, down 6144->2048
// Ops, with the two numbers per GEMM (T tokens, K in, N out):
//   fwd    y  [T, N] bf16  = x [T, K] · W [N, K]ᵀ
//   dgrad  dx [T, K] bf16  = dy [T, N] · W
//   wgrad  dW [N, K] f32  += dy [T, N]ᵀ · x            (beta = 1 into fp32)
//   FLOP   = 2·T·K·N for each
//   bytes  = each operand once (the lower bound): fwd 2(TK + NK + TN),
//            dgrad 2(TN + NK + TK), wgrad 2(TN + TK) + 8NK (dW read and written)
//
// Timing: the first run of each benchmark checks 256 sampled outputs against a
// double-precision host reference (skips with the error when wrong), then
// kWarmup untimed GEMMs; each iteration records a CUDA event, runs kBatch
// GEMMs, records another, and reports the time / kBatch (UseManualTime).
// Iterations and repetitions are fixed; read the median over repetitions.
// ".../fwd/batch_invariant" rows: the forward in the batch-invariant mode.
// Counters: TFLOPs (from the run's total event time), GBps, flop, bytes.
// Large GEMMs are compute-bound: no L2 flush and no CUDA-graph replay needed.
// "linear/decode/<proj>/m<rows>/fwd[/batch_invariant]" rows: the forward at a
// decode step's rows (1, 32, 256) on the rollout benchmark config's
// projections (hidden 1024; bench_models.hpp's rollout_config): where the
// mode's fixed-tile GEMM pays against cuBLAS's split-K. Counters host_us: host
// time per call (launch and tensor-map setup), to see which side bounds the
// row's time; graph_us: GPU time per call, the calls replayed from a CUDA graph.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
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
#include "slime/ops/batch_invariant.hpp"
#include "slime/ops/linear.hpp"

namespace {

using slime::BFloat16;
using slime::Device;
using slime::DType;
using slime::Stream;
using slime::Tensor;

constexpr int64_t kTokens = 8192;
constexpr int kWarmup = 3;       // untimed GEMMs per run
constexpr int kBatch = 5;        // GEMMs per timed iteration
constexpr int kIterations = 10;  // timed iterations per run
constexpr int kRepetitions = 5;  // runs; the median is reported
constexpr int kSamples = 256;    // checked outputs per benchmark

struct LinearShape {
  const char* model;
  const char* proj;
  int64_t in, out;
  int64_t tokens = kTokens;  // rows of x
};

constexpr LinearShape kShapes[] = {
    {"h4096", "qo", 4096, 4096},    {"h4096", "kv", 4096, 1024},   {"h4096", "up", 4096, 12288},
    {"h4096", "down", 12288, 4096}, {"h2048", "qo", 2048, 2048},   {"h2048", "kv", 2048, 1024},
    {"h2048", "up", 2048, 6144},    {"h2048", "down", 6144, 2048},
};

// The rollout config's projections (bench_models.hpp: hidden 1024, 16 / 4
// heads of 64, intermediate 3072, vocab 32000): qkv, o, gate+up, down, lm_head.
constexpr LinearShape kDecodeProjections[] = {
    {"decode", "qkv", 1024, 1536},  {"decode", "o", 1024, 1024},        {"decode", "gate_up", 1024, 6144},
    {"decode", "down", 3072, 1024}, {"decode", "lm_head", 1024, 32000},
};
constexpr int64_t kDecodeRows[] = {1, 32, 256};
constexpr int kDecodeBatch = 50;  // GEMMs per timed iteration (microseconds each)

enum class Op { fwd, dgrad, wgrad };
constexpr const char* op_name(Op op) { return op == Op::fwd ? "fwd" : op == Op::dgrad ? "dgrad" : "wgrad"; }

// Inputs and outputs of one shape, with host copies of the inputs for the
// check. Kept for the shape's three ops, then dropped for the next shape.
struct Problem {
  LinearShape shape{};
  Stream stream;
  Tensor x, w, dy, y, dx, dw;
  std::vector<BFloat16> hx, hw, hdy;
};

std::unique_ptr<Problem> g_problem;

Problem& problem(const LinearShape& s) {
  if (g_problem && g_problem->shape.in == s.in && g_problem->shape.out == s.out && g_problem->shape.tokens == s.tokens)
    return *g_problem;
  g_problem.reset();
  auto p = std::make_unique<Problem>();
  const Device d = Device::cuda(0);
  p->shape = s;
  p->stream = Stream::create(d);
  const Stream& st = p->stream;
  const int64_t T = s.tokens, K = s.in, N = s.out;
  p->x = Tensor::empty({T, K}, DType::bf16, d, st);
  p->w = Tensor::empty({N, K}, DType::bf16, d, st);
  p->dy = Tensor::empty({T, N}, DType::bf16, d, st);
  slime::fill_normal(p->x, 1, 0, 0.f, 1.f, st);
  slime::fill_normal(p->w, 2, 0, 0.f, 1.f, st);
  slime::fill_normal(p->dy, 3, 0, 0.f, 1.f, st);
  p->y = Tensor::empty({T, N}, DType::bf16, d, st);
  p->dx = Tensor::empty({T, K}, DType::bf16, d, st);
  p->dw = Tensor::zeros({N, K}, DType::f32, d, st);
  p->hx = p->x.to_vector<BFloat16>(st);
  p->hw = p->w.to_vector<BFloat16>(st);
  p->hdy = p->dy.to_vector<BFloat16>(st);
  g_problem = std::move(p);
  return *g_problem;
}

void launch(Problem& p, Op op) {
  switch (op) {
    case Op::fwd:
      slime::ops::linear_forward(p.x, p.w, p.y, p.stream);
      break;
    case Op::dgrad:
      slime::ops::linear_backward_input(p.dy, p.w, p.dx, false, p.stream);
      break;
    case Op::wgrad:
      slime::ops::linear_backward_weight(p.dy, p.x, p.dw, p.stream);
      break;
  }
}

double flop(const LinearShape& s) { return 2.0 * double(s.tokens) * double(s.in) * double(s.out); }

double bytes(const LinearShape& s, Op op) {
  const double T = double(s.tokens), K = double(s.in), N = double(s.out);
  switch (op) {
    case Op::fwd:
      return 2 * (T * K + N * K + T * N);
    case Op::dgrad:
      return 2 * (T * N + N * K + T * K);
    case Op::wgrad:
      return 2 * (T * N + T * K) + 8 * N * K;
  }
  return 0;
}

// Runs the op once on poisoned outputs (dW from zero) and compares kSamples
// outputs with a double-precision sum over the host inputs. "" or the error.
std::string check_once(Problem& p, Op op) {
  const int64_t T = p.shape.tokens, K = p.shape.in, N = p.shape.out;
  p.y.fill_bytes_(0xff, p.stream);
  p.dx.fill_bytes_(0xff, p.stream);
  p.dw.zero_(p.stream);
  launch(p, op);
  auto f = [](BFloat16 v) { return double(float(v)); };
  const int64_t rows = op == Op::wgrad ? N : T, cols = op == Op::fwd ? N : K;
  const int64_t red = op == Op::fwd ? K : op == Op::dgrad ? N : T;
  std::vector<double> got(std::size_t(rows * cols));
  if (op == Op::wgrad) {
    const auto v = p.dw.to_vector<float>(p.stream);
    for (std::size_t i = 0; i < got.size(); ++i) got[i] = v[i];
  } else {
    const auto v = (op == Op::fwd ? p.y : p.dx).to_vector<BFloat16>(p.stream);
    for (std::size_t i = 0; i < got.size(); ++i) got[i] = f(v[i]);
  }
  for (int i = 0; i < kSamples; ++i) {
    const int64_t r = int64_t(slime::philox_word(77, uint64_t(2 * i)) % uint64_t(rows));
    const int64_t c = int64_t(slime::philox_word(77, uint64_t(2 * i + 1)) % uint64_t(cols));
    double want = 0, mag = 0;
    for (int64_t q = 0; q < red; ++q) {
      double a = 0, b = 0;
      switch (op) {
        case Op::fwd:
          a = f(p.hx[std::size_t(r * K + q)]), b = f(p.hw[std::size_t(c * K + q)]);
          break;
        case Op::dgrad:
          a = f(p.hdy[std::size_t(r * N + q)]), b = f(p.hw[std::size_t(q * K + c)]);
          break;
        case Op::wgrad:
          a = f(p.hdy[std::size_t(q * N + r)]), b = f(p.hx[std::size_t(q * K + c)]);
          break;
      }
      want += a * b;
      mag += std::fabs(a * b);
    }
    // bf16 outputs: half an ulp (2^-9) of rounding; all: fp32 summation error,
    // bounded by ~red · 2^-24 · Σ|a·b| and far smaller in practice.
    const double rounding = op == Op::wgrad ? 0.0 : std::ldexp(1.0, -8) * std::fabs(want);
    const double tol = rounding + 1e-5 * mag;
    const double g = got[std::size_t(r * cols + c)];
    if (!(std::fabs(g - want) <= tol))
      return slime::detail::concat("correctness check failed: ", op_name(op), " output (", r, ", ", c, ") is ", g,
                                   ", expected ", want, " (tolerance ", tol, ")");
  }
  return "";
}

// GPU time of one call without the host's launch cost: `batch` calls
// captured in a CUDA graph, replayed; microseconds per call (-1 when the
// capture fails, e.g. a backend that cannot be captured).
double graph_us(Problem& p, Op op, int batch) {
  cudaStream_t st = static_cast<cudaStream_t>(p.stream.handle());
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return -1;
  for (int i = 0; i < batch; ++i) launch(p, op);
  if (cudaStreamEndCapture(st, &graph) != cudaSuccess || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    cudaGetLastError();
    return -1;
  }
  constexpr int kReplays = 10;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int i = 0; i < 2; ++i) cudaGraphLaunch(exec, st);
  cudaEventRecord(e0, st);
  for (int i = 0; i < kReplays; ++i) cudaGraphLaunch(exec, st);
  cudaEventRecord(e1, st);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return 1e3 * double(ms) / double(kReplays * batch);
}

void run_linear(benchmark::State& state, LinearShape s, Op op) {
  if (slime::bench::skip_without_cuda(state)) return;
  slime::bench::run_or_skip(state, [&] {
    Problem& p = problem(s);
    static std::map<std::string, std::string> verdicts;
    const std::string id = std::string(s.model) + s.proj + std::to_string(s.tokens) + op_name(op) +
                           (slime::ops::batch_invariant() ? "/bi" : "");
    if (!slime::bench::passed_check(state, verdicts, id, [&] { return check_once(p, op); })) return;
    const bool decode = s.tokens < kTokens;
    const int batch = decode ? kDecodeBatch : kBatch;
    double host_s = 0;
    int64_t calls = 0;
    const double t = slime::bench::time_batches(state, p.stream, kWarmup, batch, [&] {
      const auto t0 = std::chrono::steady_clock::now();
      launch(p, op);
      host_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ++calls;
    });
    slime::bench::flop_byte_counters(state, t, flop(s), bytes(s, op));
    if (decode) {
      state.counters["host_us"] = calls > 0 ? 1e6 * host_s / double(calls) : 0;
      state.counters["graph_us"] = graph_us(p, op, batch);
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  for (const LinearShape& s : kShapes) {
    for (Op op : {Op::fwd, Op::dgrad, Op::wgrad}) {
      const std::string name = std::string("linear/") + s.model + "/" + s.proj + "/" + op_name(op);
      slime::bench::register_manual(
          name, [s, op](benchmark::State& st) { run_linear(st, s, op); }, benchmark::kMicrosecond, kIterations,
          kRepetitions);
    }
    // The forward in the batch-invariant mode (slime/ops/batch_invariant.hpp):
    // slime's fixed-tile GEMM instead of cuBLAS, the mode's cost per GEMM.
    slime::bench::register_manual(
        std::string("linear/") + s.model + "/" + s.proj + "/fwd/batch_invariant",
        [s](benchmark::State& st) {
          slime::ops::BatchInvariantScope mode;
          run_linear(st, s, Op::fwd);
        },
        benchmark::kMicrosecond, kIterations, kRepetitions);
  }
  for (const LinearShape& proj : kDecodeProjections) {
    for (int64_t rows : kDecodeRows) {
      LinearShape s = proj;
      s.tokens = rows;
      const std::string name = std::string("linear/decode/") + s.proj + "/m" + std::to_string(rows) + "/fwd";
      slime::bench::register_manual(
          name, [s](benchmark::State& st) { run_linear(st, s, Op::fwd); }, benchmark::kMicrosecond, kIterations,
          kRepetitions);
      slime::bench::register_manual(
          name + "/batch_invariant",
          [s](benchmark::State& st) {
            slime::ops::BatchInvariantScope mode;
            run_linear(st, s, Op::fwd);
          },
          benchmark::kMicrosecond, kIterations, kRepetitions);
    }
  }
  const int rc = slime::bench::run_benchmarks(argc, argv);
  g_problem.reset();
  return rc;
}
