// bench/bench_adamw.cu: slime::optim on one GPU over the parameter list of
// Qwen3-0.6B (28 layers, hidden 1024, MLP 3072, 16 query / 8 KV heads of 128,
// vocab 151936 tied: 310 tensors, N = 596,049,920 elements), each tensor its
// own allocation as a model's parameters are. The PyTorch baseline is
// bench/torch_adamw.py (same names, same byte counts).
//
// The two numbers per benchmark: FLOPs are negligible (memory-bound; ~15 per
// element, not reported); bytes are the algorithmic traffic, each operand
// read or written once:
//   adamw/qwen3_0.6b/f32          read p, g, m, v; write p, m, v (fp32)   28 N
//   adamw/qwen3_0.6b/f32_bf16copy the same plus the bf16 model copy       30 N
//   grad_norm/qwen3_0.6b          read g (fp32), one 8-byte read back      4 N
//   copy/<bytes>                  cudaMemcpyAsync device to device        2B
// Bandwidth GBps = bytes / time (1e9 bytes/s); every benchmark also times a
// copy of bytes / 2 (the same traffic) and reports copy_GBps and
// frac_of_copy = GBps / copy_GBps. 10.7 GB of operands: far above the L2.
// grad_norm returns its value to the host, so each call includes one
// stream synchronisation (as a training step pays it).
//
// Timing: the first run of each benchmark checks two tensors (a [128] q_norm
// weight and layer 0's k_proj [1024, 1024]) against the CPU reference (AdamW
// bit for bit; the norm to 2.5e-6 relative), then kWarmup untimed calls; each
// iteration records a CUDA event, runs kBatch calls, records another and
// reports the time / kBatch (UseManualTime). Read the median over repetitions.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "slime/core/random.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/optim/adamw.hpp"
#include "slime/optim/grad_clip.hpp"

namespace {

using slime::Device;
using slime::DType;
using slime::Event;
using slime::Shape;
using slime::Stream;
using slime::Tensor;
namespace optim = slime::optim;

constexpr int kWarmup = 2;
constexpr int kBatch = 5;
constexpr int kIterations = 5;
constexpr int kRepetitions = 5;
constexpr int kCopyReps = 10;

Device gpu() { return Device::cuda(0); }

// Qwen3-0.6B's parameter shapes (tied lm_head): the embedding, per layer
// input_layernorm, q/k/v/o_proj, q_norm, k_norm, post_attention_layernorm,
// gate/up/down_proj, then the final norm.
std::vector<Shape> qwen3_0_6b_shapes() {
  const int64_t H = 1024, F = 3072, Q = 16 * 128, KV = 8 * 128, V = 151936, L = 28;
  std::vector<Shape> s = {{V, H}};
  for (int64_t l = 0; l < L; ++l) {
    for (const Shape& x : {Shape{H}, Shape{Q, H}, Shape{KV, H}, Shape{KV, H}, Shape{H, Q}, Shape{128}, Shape{128},
                           Shape{H}, Shape{F, H}, Shape{F, H}, Shape{H, F}})
      s.push_back(x);
  }
  s.push_back({H});
  return s;
}

// The model's optimizer state on the GPU, made once and shared by the cases.
struct Model {
  std::vector<optim::AdamWTensors> groups;
  std::vector<Tensor> grads;
  int64_t numel = 0;
  int64_t step = 0;
};

Model& model(const Stream& s) {
  static std::unique_ptr<Model> m;
  if (m) return *m;
  m = std::make_unique<Model>();
  uint64_t seed = 1;
  for (const Shape& shape : qwen3_0_6b_shapes()) {
    optim::AdamWTensors t;
    t.param = Tensor::empty(shape, DType::f32, gpu(), s);
    t.grad = Tensor::empty(shape, DType::f32, gpu(), s);
    slime::fill_normal(t.param, ++seed, 0, 0.f, 0.02f, s);
    slime::fill_normal(t.grad, ++seed, 0, 0.f, 1e-3f, s);
    t.exp_avg = Tensor::zeros(shape, DType::f32, gpu(), s);
    t.exp_avg_sq = Tensor::zeros(shape, DType::f32, gpu(), s);
    t.param_copy = Tensor::empty(shape, DType::bf16, gpu(), s);
    m->numel += shape.numel();
    m->grads.push_back(t.grad);
    m->groups.push_back(t);
  }
  s.synchronize();
  return *m;
}

const optim::AdamWConfig kConfig{.lr = 0, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
constexpr double kLr = 1e-4;
constexpr float kGradScale = 0.5f;

// One AdamW step of every tensor, with or without the bf16 copies.
void adamw_launch(Model& m, bool copy, const Stream& s) {
  static std::vector<optim::AdamWTensors> no_copy;
  if (!copy && no_copy.empty()) {
    no_copy = m.groups;
    for (auto& t : no_copy) t.param_copy = Tensor();
  }
  optim::adamw_step(copy ? m.groups : no_copy, kConfig, kLr, ++m.step, kGradScale, s);
}

// One AdamW step, checked on layer 0's q_norm (tensor 6) and k_proj (tensor
// 3) against the CPU reference, bit for bit.
std::string check_adamw(Model& m, bool copy, const Stream& s) {
  const std::size_t picks[] = {6, 3};
  std::vector<optim::AdamWTensors> host;
  for (std::size_t i : picks) {
    const auto& t = m.groups[i];
    host.push_back({t.param.to(Device::cpu(), s), t.grad.to(Device::cpu(), s), t.exp_avg.to(Device::cpu(), s),
                    t.exp_avg_sq.to(Device::cpu(), s), copy ? Tensor::empty(t.param.shape(), DType::bf16) : Tensor()});
  }
  s.synchronize();
  if (copy)
    for (std::size_t i : picks) m.groups[i].param_copy.fill_bytes_(0xff, s);
  const int64_t step = m.step + 1;
  adamw_launch(m, copy, s);
  optim::adamw_step(host, kConfig, kLr, step, kGradScale);
  for (std::size_t k = 0; k < 2; ++k) {
    const auto& t = m.groups[picks[k]];
    const Tensor* pairs[][2] = {{&t.param, &host[k].param},
                                {&t.exp_avg, &host[k].exp_avg},
                                {&t.exp_avg_sq, &host[k].exp_avg_sq},
                                {&t.param_copy, &host[k].param_copy}};
    for (int j = 0; j < (copy ? 4 : 3); ++j) {
      const Tensor h = pairs[j][0]->to(Device::cpu(), s);
      s.synchronize();
      if (std::memcmp(h.data_ptr(), pairs[j][1]->data_ptr(), h.nbytes()) != 0)
        return slime::detail::concat("correctness check failed: tensor ", picks[k], " operand ", j,
                                     " differs from the CPU reference");
    }
  }
  return "";
}

std::string check_norm(Model& m, const Stream& s) {
  const double got = optim::global_grad_norm(m.grads, nullptr, s);
  std::vector<Tensor> host;
  for (const Tensor& g : m.grads) host.push_back(g.to(Device::cpu(), s));
  s.synchronize();
  const double want = optim::global_grad_norm(host);
  if (!(std::abs(got - want) <= 2.5e-6 * want))
    return slime::detail::concat("correctness check failed: grad norm ", got, " vs CPU ", want);
  return "";
}

enum class Kind { adamw, adamw_copy, grad_norm };

void run(benchmark::State& state, const std::string& name, Kind kind) {
  if (slime::bench::skip_without_cuda(state)) return;
  slime::bench::run_or_skip(state, [&] {
    static Stream stream = Stream::create(gpu());
    const Stream& s = stream;
    Model& m = model(s);
    static std::map<std::string, std::string> verdicts;
    if (!slime::bench::passed_check(state, verdicts, name, [&] {
          return kind == Kind::grad_norm ? check_norm(m, s) : check_adamw(m, kind == Kind::adamw_copy, s);
        }))
      return;
    const double N = double(m.numel);
    const double bytes = kind == Kind::grad_norm ? 4 * N : kind == Kind::adamw ? 28 * N : 30 * N;
    const double t = slime::bench::time_batches(state, s, kWarmup, kBatch, [&] {
      if (kind == Kind::grad_norm) {
        benchmark::DoNotOptimize(optim::global_grad_norm(m.grads, nullptr, s));
      } else {
        adamw_launch(m, kind == Kind::adamw_copy, s);
      }
    });
    slime::bench::copy_fraction_counters(
        state, bytes, t, slime::bench::copy_seconds(std::size_t(bytes / 2), s, kWarmup, kBatch, kCopyReps));
    state.counters["numel"] = N;
    s.synchronize();
  });
}

void add(const std::string& name, Kind kind) {
  slime::bench::register_manual(
      name, [name, kind](benchmark::State& st) { run(st, name, kind); }, benchmark::kMicrosecond, kIterations,
      kRepetitions);
}

}  // namespace

int main(int argc, char** argv) {
  add("adamw/qwen3_0.6b/f32", Kind::adamw);
  add("adamw/qwen3_0.6b/f32_bf16copy", Kind::adamw_copy);
  add("grad_norm/qwen3_0.6b", Kind::grad_norm);
  return slime::bench::run_benchmarks(argc, argv);
}
