// bench/bench_policy_loss.cu: the fused policy loss (slime::rl::policy_loss_into
// on CUDA: per-token PPO / GSPO terms, TIS weights, rejected tokens, k3 KL,
// entropy bonus, gradients w.r.t. lp and entropy, deterministic metrics) at
// RL-training sizes, f32, one GPU. The PyTorch eager baseline (the same loss
// with autograd) is bench/torch_policy_loss.py.
//
// Shapes: 64 sequences x 4096 tokens and 256 x 1024 (262144 tokens each), a
// 16-token prompt per sequence (loss_mask 0). Variants: ppo (token_mean, dual
// clip) and gspo (seq_mean_token_mean, bounds 3e-4 / 4e-4), both with ref_lp,
// entropy, is_weights and keep_mask.
// The two numbers, per call (T tokens):
//   bytes  34 T: reads lp, old_lp, advantages, ref_lp, entropy, is_weights (6 x
//          4 T) + loss_mask, keep_mask (2 T); writes grad_lp, grad_entropy
//          (2 x 4 T). cu_seqlens and the metric partials are negligible.
//   flop   ~30 T (exp, clamps, products): negligible, the op is memory-bound.
// Counters: GBps (bytes / time) and copy_fraction = (bytes / time) / (copy
// bandwidth), the copy bandwidth measured here as a device-to-device
// cudaMemcpyAsync moving the same number of bytes (bytes / 2 read, bytes / 2
// written), timed the same way. Both are L2-warm (9 MB fits in the H200's L2):
// the fraction compares like with like.
// Timing: the first run of each shape checks the loss and gradients against
// the CPU reference and skips with the error when wrong; kWarmup untimed calls;
// each iteration records a CUDA event, runs kBatch calls, records another and
// reports time / kBatch (UseManualTime). Read the median over repetitions.
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/rl/policy_loss.hpp"

namespace {

using slime::Device;
using slime::DType;
using slime::Shape;
using slime::Stream;
using slime::Tensor;
namespace rl = slime::rl;

constexpr int kWarmup = 20;
constexpr int kBatch = 50;
constexpr int kIterations = 20;
constexpr int kRepetitions = 5;
constexpr int kPrompt = 16;

struct Config {
  int64_t seqs, len;
  rl::PolicyLossKind kind;
};

double bytes_of(int64_t tokens) { return 34.0 * double(tokens); }

rl::PolicyLossConfig loss_config(rl::PolicyLossKind kind) {
  rl::PolicyLossConfig c;
  c.kind = kind;
  c.kl_coef = 0.05;
  c.kl_estimator = rl::KlEstimator::k3;
  c.entropy_coef = 0.01;
  if (kind == rl::PolicyLossKind::gspo) {
    c.eps_clip = 3e-4;
    c.eps_clip_high = 4e-4;
    c.aggregation = rl::Aggregation::seq_mean_token_mean;
  } else {
    c.eps_clip = 0.2;
    c.eps_clip_high = 0.28;
    c.eps_clip_c = 3;
  }
  return c;
}

struct Problem {
  rl::PolicyLossTensors host, dev;
  rl::PolicyLossOutputs out;
  rl::LossNormalizer norm;
  Tensor copy_src, copy_dst;
  Stream stream;
};

Problem make_problem(const Config& cfg) {
  Problem p;
  p.stream = Stream::create(Device::cuda(0));
  const int64_t n = cfg.seqs * cfg.len;
  std::mt19937 gen(1234);
  std::uniform_real_distribution<float> u(0, 1);
  const float spread = cfg.kind == rl::PolicyLossKind::gspo ? 2e-3f : 0.6f;
  std::vector<float> lp(n), old(n), adv(n), ref(n), ent(n), w(n);
  std::vector<uint8_t> mask(n), keep(n);
  std::vector<int32_t> cu;
  for (int64_t s = 0; s <= cfg.seqs; ++s) cu.push_back(int32_t(s * cfg.len));
  for (int64_t s = 0; s < cfg.seqs; ++s) {
    const float a = u(gen) * 4 - 2;
    for (int64_t t = 0; t < cfg.len; ++t) {
      const int64_t i = s * cfg.len + t;
      old[i] = -0.05f - 3 * u(gen);
      lp[i] = old[i] + (u(gen) - 0.5f) * spread;
      ref[i] = old[i] + (u(gen) - 0.5f);
      ent[i] = 2 * u(gen);
      w[i] = 0.5f + u(gen);
      adv[i] = a;
      mask[i] = t >= kPrompt;
      keep[i] = u(gen) > 0.05f;
    }
  }
  auto make = [&](rl::PolicyLossTensors& t, Device d) {
    t.lp = Tensor::from_vector(lp, Shape{n}, d, p.stream);
    t.old_lp = Tensor::from_vector(old, Shape{n}, d, p.stream);
    t.advantages = Tensor::from_vector(adv, Shape{n}, d, p.stream);
    t.ref_lp = Tensor::from_vector(ref, Shape{n}, d, p.stream);
    t.entropy = Tensor::from_vector(ent, Shape{n}, d, p.stream);
    t.is_weights = Tensor::from_vector(w, Shape{n}, d, p.stream);
    t.loss_mask = Tensor::from_vector(mask, Shape{n}, d, p.stream);
    t.keep_mask = Tensor::from_vector(keep, Shape{n}, d, p.stream);
    t.cu_seqlens = Tensor::from_vector(cu, Shape{int64_t(cu.size())}, d, p.stream);
  };
  make(p.host, Device::cpu());
  make(p.dev, Device::cuda(0));
  p.norm = rl::count_normalizer(p.host.loss_mask, p.host.cu_seqlens);
  p.out.grad_lp = Tensor::empty(Shape{n}, DType::f32, Device::cuda(0), p.stream);
  p.out.grad_entropy = Tensor::empty(Shape{n}, DType::f32, Device::cuda(0), p.stream);
  p.out.workspace =
      Tensor::empty(Shape{int64_t(rl::policy_loss_workspace_bytes(cfg.seqs))}, DType::u8, Device::cuda(0), p.stream);
  const int64_t half = int64_t(bytes_of(n) / 2);
  p.copy_src = Tensor::zeros(Shape{half}, DType::u8, Device::cuda(0), p.stream);
  p.copy_dst = Tensor::empty(Shape{half}, DType::u8, Device::cuda(0), p.stream);
  p.stream.synchronize();
  return p;
}

// "" when the GPU loss and gradients match the CPU reference.
std::string check_once(Problem& p, const rl::PolicyLossConfig& c) {
  const rl::PolicyLossResult ref = rl::policy_loss(c, p.norm, p.host);
  rl::policy_loss_into(c, p.norm, p.dev, p.out, p.stream);
  const rl::PolicyLossMetrics m = rl::read_policy_loss_metrics(p.out.workspace, p.stream);
  if (!(std::fabs(m.loss - ref.metrics.loss) <= 1e-5 && std::fabs(m.clip_fraction - ref.metrics.clip_fraction) <= 1e-9))
    return slime::detail::concat("correctness check failed: loss ", m.loss, " vs ", ref.metrics.loss,
                                 ", clip fraction ", m.clip_fraction, " vs ", ref.metrics.clip_fraction);
  for (auto [gpu, cpu] : {std::pair{&p.out.grad_lp, &ref.grad_lp}, std::pair{&p.out.grad_entropy, &ref.grad_entropy}}) {
    const auto g = gpu->to_vector<float>(p.stream), r = cpu->to_vector<float>();
    double num = 0, den = 0;
    for (std::size_t i = 0; i < g.size(); ++i) {
      num += (double(g[i]) - r[i]) * (double(g[i]) - r[i]);
      den += double(r[i]) * r[i];
    }
    if (!(std::sqrt(num) <= 1e-5 * std::sqrt(den)))
      return slime::detail::concat("correctness check failed: gradient relative error ", std::sqrt(num / den));
  }
  return "";
}

std::map<std::string, std::string> g_verdicts;
std::map<std::string, double> g_copy_seconds;

void run_policy_loss(benchmark::State& state, Config cfg, std::string name) {
  if (slime::bench::skip_without_cuda(state)) return;
  slime::bench::run_or_skip(state, [&] {
    Problem p = make_problem(cfg);
    const rl::PolicyLossConfig c = loss_config(cfg.kind);
    if (!slime::bench::passed_check(state, g_verdicts, name, [&] { return check_once(p, c); })) return;
    // The copy bandwidth reference, once per shape.
    if (!g_copy_seconds.count(name)) {
      slime::Event start(Device::cuda(0)), stop(Device::cuda(0));
      auto copy = [&] { p.copy_dst.copy_from(p.copy_src, p.stream); };
      slime::bench::warm_up(p.stream, kWarmup, copy);
      start.record(p.stream);
      for (int i = 0; i < kBatch * 4; ++i) copy();
      stop.record(p.stream);
      stop.synchronize();
      g_copy_seconds[name] = double(slime::Event::elapsed_ms(start, stop)) * 1e-3 / (kBatch * 4);
    }
    const double t = slime::bench::time_batches(state, p.stream, kWarmup, kBatch,
                                                [&] { rl::policy_loss_into(c, p.norm, p.dev, p.out, p.stream); });
    const double bytes = bytes_of(cfg.seqs * cfg.len);
    slime::bench::flop_byte_counters(state, t, 30.0 * double(cfg.seqs * cfg.len), bytes);
    const double copy_bw = bytes / g_copy_seconds[name];
    state.counters["copy_GBps"] = copy_bw / 1e9;
    state.counters["copy_fraction"] = t > 0 ? (bytes / t) / copy_bw : 0.0;
  });
}

}  // namespace

int main(int argc, char** argv) {
  for (Config cfg : {Config{64, 4096, rl::PolicyLossKind::ppo}, Config{256, 1024, rl::PolicyLossKind::ppo},
                     Config{64, 4096, rl::PolicyLossKind::gspo}, Config{256, 1024, rl::PolicyLossKind::gspo}}) {
    const std::string name = "policy_loss/S" + std::to_string(cfg.seqs) + "xL" + std::to_string(cfg.len) + "/" +
                             (cfg.kind == rl::PolicyLossKind::gspo ? "gspo" : "ppo");
    slime::bench::register_manual(
        name, [cfg, name](benchmark::State& st) { run_policy_loss(st, cfg, name); }, benchmark::kMicrosecond,
        kIterations, kRepetitions);
  }
  return slime::bench::run_benchmarks(argc, argv);
}
