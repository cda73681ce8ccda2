// bench/bench_token_logprobs.cu: the fused lm-head + log-softmax + entropy op
// (slime::ops::token_logprobs_forward / _backward) at RL-training sizes, bf16,
// one GPU: time and peak device memory. The PyTorch baseline,
// log_softmax((h @ W.T).float() / temperature) + gather + entropy, which
// materialises [T, V] fp32 logits, is bench/torch_token_logprobs.py; it also
// prints the side-by-side table (time and memory ratios) from this program's
// JSON.
//
// Shapes: T = 4096 and 8192 tokens, D = 4096 (Qwen3-8B) and 2048 (Qwen3-1.7B),
// V = 151936 (Qwen's vocabulary), temperature 0.8, i64 targets.
// Modes: fwd (forward only: logprobs, entropy, lse), fwd_bwd (forward then
// backward: grad_hidden bf16 written, grad_weight fp32 accumulated).
// The two numbers, per call:
//   flop   fwd 2 T V D; fwd_bwd 6 T V D (forward, dh and dW GEMMs: the work any
//          implementation must do; ours executes 8 T V D, as the backward
//          recomputes the logits instead of storing them)
//   bytes  lower bound (each operand once): fwd 2(T D + V D) + 8 T + 12 T;
//          fwd_bwd adds h, W again, dh written (2 T D) and dW read and written
//          (8 V D). The [T, V] logits never reach memory in this bound.
// Memory counters (slime::memory_stats of the device, all of which this
// program allocates through slime):
//   peak_bytes   high-water mark during one call, everything included (inputs,
//                outputs, gradient buffers, workspace, the cuBLAS workspace)
//   extra_bytes  peak_bytes minus what is held after the call excluding the
//                workspace: the op's own memory (the workspace, ~192 MiB at
//                D 4096), to set beside PyTorch's logits and their copies
// Timing: the first run of each shape checks sampled outputs against the CPU
// reference (2 tokens' logprob, entropy and grad_hidden; 4 rows of
// grad_weight) and skips with the error when wrong; kWarmup untimed calls;
// each iteration records a CUDA event, runs kBatch calls, records another and
// reports time / kBatch (UseManualTime). Read the median over repetitions.
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
#include "slime/core/memory.hpp"
#include "slime/core/random.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/token_logprobs.hpp"
#include "slime/ops/token_logprobs.hpp"

namespace {

using slime::BFloat16;
using slime::Device;
using slime::DType;
using slime::Stream;
using slime::Tensor;

constexpr int64_t kVocab = 151936;
constexpr float kTemperature = 0.8f;
constexpr int kWarmup = 2;       // untimed calls per run
constexpr int kBatch = 2;        // calls per timed iteration
constexpr int kIterations = 5;   // timed iterations per run
constexpr int kRepetitions = 3;  // runs; the median is reported

struct Shape {
  int64_t tokens, dim;
};
constexpr Shape kShapes[] = {{4096, 4096}, {8192, 4096}, {4096, 2048}, {8192, 2048}};

enum class Mode { fwd, fwd_bwd };
constexpr const char* mode_name(Mode m) { return m == Mode::fwd ? "fwd" : "fwd_bwd"; }

// Inputs, outputs and workspace of one shape, kept for both modes.
struct Problem {
  Shape shape{};
  Stream stream;
  Tensor h, w, targets, g_lp, g_ent;  // inputs
  Tensor lp, ent, lse, dh, dw;        // outputs
  Tensor workspace;
  std::string verdict;  // "" when the correctness check passed
  bool checked = false;
};

std::unique_ptr<Problem> g_problem;

Problem& problem(const Shape& s) {
  if (g_problem && g_problem->shape.tokens == s.tokens && g_problem->shape.dim == s.dim) return *g_problem;
  g_problem.reset();
  auto p = std::make_unique<Problem>();
  const Device d = Device::cuda(0);
  p->shape = s;
  p->stream = Stream::create(d);
  const Stream& st = p->stream;
  const int64_t T = s.tokens, D = s.dim, V = kVocab;
  p->h = Tensor::empty({T, D}, DType::bf16, d, st);
  p->w = Tensor::empty({V, D}, DType::bf16, d, st);
  // Logits of standard deviation ~2.5: a realistic, non-degenerate softmax.
  slime::fill_normal(p->h, 1, 0, 0.f, 1.f, st);
  slime::fill_normal(p->w, 2, 0, 0.f, 2.f / std::sqrt(float(D)), st);
  std::vector<int64_t> targets(static_cast<std::size_t>(T));
  for (int64_t t = 0; t < T; ++t) targets[t] = int64_t(slime::philox_word(3, uint64_t(t)) % uint64_t(V));
  p->targets = Tensor::from_vector(targets, {T}, d, st);
  p->g_lp = Tensor::empty({T}, DType::f32, d, st);
  p->g_ent = Tensor::empty({T}, DType::f32, d, st);
  slime::fill_normal(p->g_lp, 4, 0, 0.f, 1.f, st);
  slime::fill_normal(p->g_ent, 5, 0, 0.f, 0.1f, st);
  p->lp = Tensor::empty({T}, DType::f32, d, st);
  p->ent = Tensor::empty({T}, DType::f32, d, st);
  p->lse = Tensor::empty({T}, DType::f32, d, st);
  p->dh = Tensor::empty({T, D}, DType::bf16, d, st);
  p->dw = Tensor::zeros({V, D}, DType::f32, d, st);
  const std::size_t ws = slime::ops::token_logprobs_workspace_bytes(T, D, V, DType::bf16);
  p->workspace = Tensor::empty({int64_t(ws)}, DType::u8, d, st);
  st.synchronize();
  g_problem = std::move(p);
  return *g_problem;
}

void launch(Problem& p, Mode mode) {
  slime::ops::token_logprobs_forward(p.h, p.w, p.targets, kTemperature, p.lp, p.ent, p.lse, p.workspace, {}, p.stream);
  if (mode == Mode::fwd_bwd)
    slime::ops::token_logprobs_backward(p.h, p.w, p.targets, kTemperature, p.lse, p.ent, p.g_lp, p.g_ent, p.dh, p.dw,
                                        p.workspace, {}, p.stream);
}

double flop(const Shape& s, Mode m) {
  const double tvd = double(s.tokens) * double(kVocab) * double(s.dim);
  return (m == Mode::fwd ? 2.0 : 6.0) * tvd;
}

double bytes(const Shape& s, Mode m) {
  const double T = double(s.tokens), D = double(s.dim), V = double(kVocab);
  const double fwd = 2 * (T * D + V * D) + 8 * T + 12 * T;
  return m == Mode::fwd ? fwd : 2 * fwd + 2 * T * D + 8 * V * D + 8 * T;
}

// One forward + backward from dW = 0, compared with the CPU reference on
// sampled tokens (logprob, entropy, grad_hidden) and vocabulary rows
// (grad_weight, which sums over every token). "" or what went wrong.
std::string check_once(Problem& p) {
  const int64_t T = p.shape.tokens, D = p.shape.dim, V = kVocab;
  for (Tensor* t : {&p.lp, &p.ent, &p.lse, &p.dh}) t->fill_bytes_(0xff, p.stream);
  p.dw.zero_(p.stream);
  launch(p, Mode::fwd_bwd);
  p.stream.synchronize();
  const auto h = p.h.to_vector<BFloat16>(p.stream), w = p.w.to_vector<BFloat16>(p.stream);
  const auto targets = p.targets.to_vector<int64_t>(p.stream);
  const auto lp = p.lp.to_vector<float>(p.stream), ent = p.ent.to_vector<float>(p.stream),
             lse = p.lse.to_vector<float>(p.stream);
  const auto g_lp = p.g_lp.to_vector<float>(p.stream), g_ent = p.g_ent.to_vector<float>(p.stream);
  const auto dh = p.dh.to_vector<BFloat16>(p.stream);

  for (int64_t t : {int64_t(0), T - 1}) {
    float r_lp = 0, r_ent = 0, r_lse = 0;
    const BFloat16* ht = h.data() + t * D;
    slime::ops::cpu::token_logprobs_forward<BFloat16, int64_t>(ht, w.data(), &targets[t], 1, D, V, kTemperature, &r_lp,
                                                               &r_ent, &r_lse);
    // bf16 inputs, fp32 logits on both sides: 2e-3 is the op's contract.
    if (!(std::fabs(lp[t] - r_lp) <= 2e-3f && std::fabs(ent[t] - r_ent) <= 2e-3f && std::fabs(lse[t] - r_lse) <= 2e-3f))
      return slime::detail::concat("correctness check failed: token ", t, ": logprob ", lp[t], " vs ", r_lp,
                                   ", entropy ", ent[t], " vs ", r_ent, ", lse ", lse[t], " vs ", r_lse);
    std::vector<BFloat16> r_dh(static_cast<std::size_t>(D));
    slime::ops::cpu::token_logprobs_backward<BFloat16, int64_t>(
        ht, w.data(), &targets[t], 1, D, V, kTemperature, &r_lse, &r_ent, &g_lp[t], &g_ent[t], r_dh.data(), nullptr);
    double num = 0, den = 0;
    for (int64_t i = 0; i < D; ++i) {
      const double a = float(dh[std::size_t(t * D + i)]), b = float(r_dh[std::size_t(i)]);
      num += (a - b) * (a - b);
      den += b * b;
    }
    if (!(std::sqrt(num / std::max(den, 1e-30)) <= 1e-2))
      return slime::detail::concat("correctness check failed: grad_hidden of token ", t, ": relative error ",
                                   std::sqrt(num / std::max(den, 1e-30)));
  }

  // grad_weight rows: dW[v] = sum_t dz[t, v] h[t] / temperature, with the
  // GPU's (already checked) lse and entropy per token.
  const std::vector<int64_t> rows = {targets[0], targets[std::size_t(T / 2)], 12345, V - 1};
  auto f = [](BFloat16 x) { return double(float(x)); };
  for (int64_t v : rows) {
    std::vector<double> want(static_cast<std::size_t>(D), 0.0);
    for (int64_t t = 0; t < T; ++t) {
      double z = 0;
      for (int64_t i = 0; i < D; ++i) z += f(h[std::size_t(t * D + i)]) * f(w[std::size_t(v * D + i)]);
      z /= kTemperature;
      const double pv = std::exp(z - lse[t]), mu = double(lse[t]) - ent[t];
      const double dz = g_lp[t] * ((v == targets[t] ? 1.0 : 0.0) - pv) + g_ent[t] * pv * (mu - z);
      for (int64_t i = 0; i < D; ++i) want[std::size_t(i)] += dz * f(h[std::size_t(t * D + i)]) / kTemperature;
    }
    Tensor row = p.dw.slice_rows(v, 1);
    const auto got = row.to_vector<float>(p.stream);
    double num = 0, den = 0;
    for (int64_t i = 0; i < D; ++i) {
      num += (got[std::size_t(i)] - want[std::size_t(i)]) * (got[std::size_t(i)] - want[std::size_t(i)]);
      den += want[std::size_t(i)] * want[std::size_t(i)];
    }
    if (!(std::sqrt(num / std::max(den, 1e-30)) <= 1e-2))
      return slime::detail::concat("correctness check failed: grad_weight row ", v, ": relative error ",
                                   std::sqrt(num / std::max(den, 1e-30)));
  }
  return "";
}

void run_token_logprobs(benchmark::State& state, Shape s, Mode mode) {
  if (slime::bench::skip_without_cuda(state)) return;
  slime::bench::run_or_skip(state, [&] {
    Problem& p = problem(s);
    if (!p.checked) {
      p.verdict = check_once(p);
      p.checked = true;
    }
    if (slime::bench::skip_if_error(state, p.verdict)) return;
    slime::bench::warm_up(p.stream, kWarmup, [&] { launch(p, mode); });

    // Memory of one call: everything is allocated already, so the op's own
    // memory is the workspace plus anything it allocated during the call.
    const Device d = p.stream.device();
    const int64_t before = slime::memory_stats(d).current_bytes;
    slime::reset_peak_memory_stats(d);
    launch(p, mode);
    p.stream.synchronize();
    const int64_t peak = slime::memory_stats(d).peak_bytes;
    const int64_t extra = peak - (before - int64_t(p.workspace.nbytes()));

    const double t = slime::bench::time_batches(state, p.stream, 0, kBatch, [&] { launch(p, mode); });
    slime::bench::flop_byte_counters(state, t, flop(s, mode), bytes(s, mode));
    state.counters["peak_bytes"] = double(peak);
    state.counters["extra_bytes"] = double(extra);
    state.counters["workspace_bytes"] = double(p.workspace.nbytes());
  });
}

}  // namespace

int main(int argc, char** argv) {
  for (const Shape& s : kShapes) {
    for (Mode m : {Mode::fwd, Mode::fwd_bwd}) {
      const std::string name =
          "token_logprobs/T" + std::to_string(s.tokens) + "/D" + std::to_string(s.dim) + "/" + mode_name(m);
      slime::bench::register_manual(
          name, [s, m](benchmark::State& st) { run_token_logprobs(st, s, m); }, benchmark::kMillisecond, kIterations,
          kRepetitions);
    }
  }
  const int rc = slime::bench::run_benchmarks(argc, argv);
  g_problem.reset();
  return rc;
}
