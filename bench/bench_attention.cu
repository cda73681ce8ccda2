// bench/bench_attention.cu: packed causal attention (slime::ops, bf16, one
// GPU): forward, backward, and forward + backward. The PyTorch baseline
// (scaled_dot_product_attention with the FLASH and the cuDNN backends on the
// equivalent [B, H, S, d] batch, is_causal=True) is bench/torch_attention.py.
//
// Shapes: Hq = Hkv = 16 heads, causal self-attention, sequences of equal
// length (so that torch's padded batch does exactly the same work):
//   hd128: 1 x 4096, 1 x 16384 and 4 x 1024    hd64: 1 x 2048 and 4 x 512
//   hd80, hd256: 1 x 2048 (Qwen2.5-VL's vision tower; the largest head dim)
//   hd128/varlen_rl: an RL-like packed batch, 24 sequences of 96 to 7400
//     tokens (55816 in all; kRlLens, the same list as torch_attention.py's
//     VARLEN_RL): GRPO rollouts whose responses differ tenfold in length.
//     PyTorch has no packed causal SDPA: its rows pad to the longest sequence
//     or loop over the sequences, as a PyTorch trainer would.
// The two numbers, per call (pairs = sum over sequences of L (L + 1) / 2, the
// (query, key) pairs the causal mask keeps):
//   FLOP  fwd = 4 d pairs Hq  (q k^T and p v, 2 FLOP per multiply-add)
//         bwd = 2.5 fwd       (q k^T again, do v^T, dv, dk, dq: 5 products of 2)
//         fwdbwd = 3.5 fwd
//   bytes (lower bound, each tensor once): fwd 2 (2 T Hq d + 2 T Hkv d) + 4 T Hq
//         (q, k, v read, o written, lse written); bwd 2 (4 T Hq d + 4 T Hkv d)
//         + 4 T Hq (q, o, do, dq, k, v, dk, dv, lse); fwdbwd the sum.
//
// Timing: the first run of each benchmark checks the last 64 query rows of the
// last sequence of heads 0 and 15 (o, lse, and dq for the runs with a
// backward) against the CPU reference on the same bf16 inputs (the causal
// offset picks the rows: rows [r0, L) against keys [0, L) with offset r0), then
// kWarmup untimed calls; each iteration records a CUDA event, runs kBatch calls,
// records another, and reports the time / kBatch (UseManualTime). Iterations
// and repetitions are fixed; read the median over repetitions. Counters:
// TFLOPs (from the run's total event time), GBps, flop, bytes. The backward's
// workspace is allocated once: a timed call allocates nothing.
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
#include "slime/ops/attention.hpp"

namespace {

using slime::BFloat16;
using slime::Device;
using slime::DType;
using slime::Stream;
using slime::Tensor;

constexpr int64_t kHeads = 16;
constexpr int kWarmup = 3;       // untimed calls per run
constexpr int kBatch = 5;        // calls per timed iteration
constexpr int kIterations = 10;  // timed iterations per run
constexpr int kRepetitions = 5;  // runs; the median is reported
constexpr int64_t kCheckRows = 64;

// The RL-like batch (keep equal to torch_attention.py's VARLEN_RL).
constexpr int32_t kRlLens[] = {412,  1630, 3071, 788,  5120, 2290, 96,   7400, 1345, 2811, 660,  4096,
                               1980, 350,  6032, 1207, 2600, 905,  3550, 150,  4870, 1500, 2222, 731};
constexpr int64_t kRlSeqs = int64_t(sizeof(kRlLens) / sizeof(kRlLens[0]));

// seqs sequences of seqlen tokens each, or (rl) the kRlLens batch, seqlen its
// longest.
struct AttnShape {
  int64_t head_dim, seqs, seqlen;
  bool rl = false;
};

constexpr AttnShape kShapes[] = {{128, 1, 4096}, {128, 1, 16384}, {128, 4, 1024}, {64, 1, 2048},
                                 {64, 4, 512},   {80, 1, 2048},   {256, 1, 2048}, {128, kRlSeqs, 7400, true}};

std::vector<int64_t> lengths(const AttnShape& s) {
  if (s.rl) return std::vector<int64_t>(std::begin(kRlLens), std::end(kRlLens));
  return std::vector<int64_t>(std::size_t(s.seqs), s.seqlen);
}
int64_t total_tokens(const AttnShape& s) {
  int64_t t = 0;
  for (int64_t l : lengths(s)) t += l;
  return t;
}

enum class Op { fwd, bwd, fwdbwd };
constexpr const char* op_name(Op op) { return op == Op::fwd ? "fwd" : op == Op::bwd ? "bwd" : "fwdbwd"; }

std::string shape_name(const AttnShape& s) {
  if (s.rl) return "hd" + std::to_string(s.head_dim) + "/varlen_rl";
  return "hd" + std::to_string(s.head_dim) + "/" + std::to_string(s.seqs) + "x" + std::to_string(s.seqlen);
}

struct Problem {
  AttnShape shape{};
  Stream stream;
  Tensor cu, q, k, v, o, lse, d_o, dq, dk, dv, workspace;
};

std::unique_ptr<Problem> g_problem;

Problem& problem(const AttnShape& s) {
  if (g_problem && g_problem->shape.head_dim == s.head_dim && g_problem->shape.seqs == s.seqs &&
      g_problem->shape.seqlen == s.seqlen && g_problem->shape.rl == s.rl)
    return *g_problem;
  g_problem.reset();
  auto p = std::make_unique<Problem>();
  const Device dev = Device::cuda(0);
  p->shape = s;
  p->stream = Stream::create(dev);
  const Stream& st = p->stream;
  const int64_t T = total_tokens(s), d = s.head_dim;
  std::vector<int32_t> cu = {0};
  for (int64_t l : lengths(s)) cu.push_back(cu.back() + int32_t(l));
  p->cu = Tensor::from_vector(cu, {s.seqs + 1}, dev, st);
  for (auto [t, seed] : {std::pair{&p->q, 1}, std::pair{&p->k, 2}, std::pair{&p->v, 3}, std::pair{&p->d_o, 4}}) {
    *t = Tensor::empty({T, kHeads, d}, DType::bf16, dev, st);
    slime::fill_normal(*t, uint64_t(seed), 0, 0.f, 1.f, st);
  }
  p->o = Tensor::empty({T, kHeads, d}, DType::bf16, dev, st);
  p->lse = Tensor::empty({T, kHeads}, DType::f32, dev, st);
  p->dq = Tensor::empty({T, kHeads, d}, DType::bf16, dev, st);
  p->dk = Tensor::empty({T, kHeads, d}, DType::bf16, dev, st);
  p->dv = Tensor::empty({T, kHeads, d}, DType::bf16, dev, st);
  p->workspace = Tensor::empty({slime::ops::attention_backward_workspace_elems(p->q)}, DType::f32, dev, st);
  g_problem = std::move(p);
  return *g_problem;
}

// The /mma rows: the mma.sync forward forced (AttentionKernel::mma_sync), the
// Hopper kernel's before / after in the same run; the /sm90 rows: the Hopper
// kernels forced (the backward's is chosen automatically only with
// SLIME_ATTENTION_SM90_BWD=1 until it is measured).
slime::ops::AttentionKernel g_kernel = slime::ops::AttentionKernel::automatic;

void forward(Problem& p) {
  slime::ops::AttentionOptions opt;
  opt.kernel = g_kernel;
  slime::ops::attention_forward(p.q, p.k, p.v, p.cu, p.cu, p.shape.seqlen, p.shape.seqlen, p.o, p.lse, opt, p.stream);
}
// The /det rows: AttentionOptions::deterministic (dq summed in key-block order).
bool g_deterministic = false;

void backward(Problem& p) {
  slime::ops::AttentionOptions opt;
  opt.deterministic = g_deterministic;
  slime::ops::attention_backward(p.q, p.k, p.v, p.o, p.lse, p.d_o, p.cu, p.cu, p.shape.seqlen, p.shape.seqlen, p.dq,
                                 p.dk, p.dv, opt, p.workspace, p.stream);
}
void launch(Problem& p, Op op) {
  if (op != Op::bwd) forward(p);
  if (op != Op::fwd) backward(p);
}

double pairs(const AttnShape& s) {
  double n = 0;
  for (int64_t l : lengths(s)) n += double(l) * double(l + 1) / 2;
  return n;
}
double flop(const AttnShape& s, Op op) {
  const double fwd = 4.0 * double(s.head_dim) * pairs(s) * double(kHeads);
  return op == Op::fwd ? fwd : op == Op::bwd ? 2.5 * fwd : 3.5 * fwd;
}
double bytes(const AttnShape& s, Op op) {
  const double T = double(total_tokens(s)), d = double(s.head_dim), H = double(kHeads);
  const double fwd = 2 * (2 * T * H * d + 2 * T * H * d) + 4 * T * H;
  const double bwd = 2 * (4 * T * H * d + 4 * T * H * d) + 4 * T * H;
  return op == Op::fwd ? fwd : op == Op::bwd ? bwd : fwd + bwd;
}

std::vector<float> floats(const Tensor& t, const Stream& s) {
  std::vector<float> out;
  if (t.dtype() == DType::f32) return t.to_vector<float>(s);
  for (BFloat16 x : t.to_vector<BFloat16>(s)) out.push_back(float(x));
  return out;
}

double rel(const std::vector<float>& a, const std::vector<float>& b) {
  double n = 0, m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    n += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    m += double(b[i]) * b[i];
  }
  return m == 0 ? std::sqrt(n) : std::sqrt(n / m);
}

// Runs the op once on poisoned outputs and checks kCheckRows rows of the last
// sequence for heads 0 and kHeads - 1. "" or the error.
std::string check_once(Problem& p, Op op) {
  for (Tensor* t : {&p.o, &p.lse, &p.dq, &p.dk, &p.dv}) t->fill_bytes_(0xff, p.stream);
  if (op == Op::bwd) forward(p);  // the backward's inputs
  launch(p, op);
  const int64_t T = total_tokens(p.shape), L = lengths(p.shape).back(), d = p.shape.head_dim;
  const int64_t s0 = T - L, r0 = L - kCheckRows;  // last sequence; its last rows
  const std::vector<float> q = floats(p.q, p.stream), k = floats(p.k, p.stream), v = floats(p.v, p.stream);
  const std::vector<float> o = floats(p.o, p.stream), lse = floats(p.lse, p.stream);
  const std::vector<float> d_o = floats(p.d_o, p.stream), dq = floats(p.dq, p.stream);
  for (int64_t h : {int64_t(0), kHeads - 1}) {
    auto rows = [&](const std::vector<float>& x, int64_t first, int64_t n, int64_t width) {
      std::vector<float> out;
      for (int64_t t = first; t < first + n; ++t)
        out.insert(out.end(), x.begin() + long((t * kHeads + h) * width),
                   x.begin() + long((t * kHeads + h + 1) * width));
      return out;
    };
    const std::vector<float> hq = rows(q, s0 + r0, kCheckRows, d), hk = rows(k, s0, L, d), hv = rows(v, s0, L, d);
    const std::vector<float> go = rows(o, s0 + r0, kCheckRows, d), glse = rows(lse, s0 + r0, kCheckRows, 1);
    slime::ops::AttentionOptions opt;
    opt.causal_offset = int(r0);
    const int32_t cq[2] = {0, int32_t(kCheckRows)}, ck[2] = {0, int32_t(L)};
    std::vector<float> ro(go.size()), rlse(glse.size());
    slime::ops::cpu::attention_forward(hq.data(), hk.data(), hv.data(), cq, ck, 1, 1, 1, d, opt, ro.data(),
                                       rlse.data());
    const double eo = rel(go, ro), el = rel(glse, rlse);
    if (!(eo <= 1e-2) || !(el <= 1e-4))
      return slime::detail::concat("correctness check failed: head ", h, ": o relative error ", eo,
                                   " (limit 1e-2), lse relative error ", el, " (limit 1e-4)");
    if (op != Op::fwd) {
      const std::vector<float> hdo = rows(d_o, s0 + r0, kCheckRows, d), gdq = rows(dq, s0 + r0, kCheckRows, d);
      std::vector<float> rdq(hq.size()), rdk(hk.size()), rdv(hv.size());
      slime::ops::cpu::attention_backward(hq.data(), hk.data(), hv.data(), go.data(), glse.data(), hdo.data(), cq, ck,
                                          1, 1, 1, d, opt, rdq.data(), rdk.data(), rdv.data());
      const double edq = rel(gdq, rdq);
      if (!(edq <= 2e-2))
        return slime::detail::concat("correctness check failed: head ", h, ": dq relative error ", edq,
                                     " (limit 2e-2)");
    }
  }
  return "";
}

void run_attention(benchmark::State& state, AttnShape s, Op op, bool deterministic = false,
                   slime::ops::AttentionKernel kernel = slime::ops::AttentionKernel::automatic) {
  if (slime::bench::skip_without_cuda(state)) return;
  g_deterministic = deterministic;
  g_kernel = kernel;
  slime::bench::run_or_skip(state, [&] {
    Problem& p = problem(s);
    static std::map<std::string, std::string> verdicts;
    const std::string kernel_tag = kernel == slime::ops::AttentionKernel::mma_sync ? "mma"
                                   : kernel == slime::ops::AttentionKernel::sm90   ? "sm90"
                                                                                   : "";
    if (!slime::bench::passed_check(state, verdicts,
                                    shape_name(s) + op_name(op) + (deterministic ? "det" : "") + kernel_tag,
                                    [&] { return check_once(p, op); }))
      return;
    if (op == Op::bwd) forward(p);
    const double t = slime::bench::time_batches(state, p.stream, kWarmup, kBatch, [&] { launch(p, op); });
    slime::bench::flop_byte_counters(state, t, flop(s, op), bytes(s, op));
  });
}

}  // namespace

int main(int argc, char** argv) {
  for (const AttnShape& s : kShapes) {
    for (Op op : {Op::fwd, Op::bwd, Op::fwdbwd}) {
      const std::string name = "attention/" + shape_name(s) + "/" + op_name(op);
      slime::bench::register_manual(
          name, [s, op](benchmark::State& st) { run_attention(st, s, op); }, benchmark::kMicrosecond, kIterations,
          kRepetitions);
      if (op == Op::fwd)  // the mma.sync forward, before the Hopper kernel
        slime::bench::register_manual(
            name + "/mma",
            [s, op](benchmark::State& st) { run_attention(st, s, op, false, slime::ops::AttentionKernel::mma_sync); },
            benchmark::kMicrosecond, kIterations, kRepetitions);
      // The Hopper backward forced (AttentionKernel::sm90: forward and
      // backward), beside the automatic choice's mma.sync backward.
      if (op != Op::fwd && (s.head_dim == 64 || s.head_dim == 128))
        slime::bench::register_manual(
            name + "/sm90",
            [s, op](benchmark::State& st) { run_attention(st, s, op, false, slime::ops::AttentionKernel::sm90); },
            benchmark::kMicrosecond, kIterations, kRepetitions);
      if (op != Op::fwd)  // the deterministic backward's cost
        slime::bench::register_manual(
            name + "/det", [s, op](benchmark::State& st) { run_attention(st, s, op, true); }, benchmark::kMicrosecond,
            kIterations, kRepetitions);
    }
  }
  const int rc = slime::bench::run_benchmarks(argc, argv);
  g_problem.reset();
  return rc;
}
