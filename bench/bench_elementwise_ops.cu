// bench/bench_elementwise_ops.cu: the memory-bound ops of the Qwen3 decoder
// (slime::ops rms_norm, rope, swiglu, add), bf16, one GPU, beside a
// device-to-device copy of the same traffic. The PyTorch baseline is
// bench/torch_elementwise_ops.py (same names, same byte counts).
//
// The two numbers per op: FLOPs are negligible (memory-bound; not reported);
// bytes are the algorithmic traffic, each operand read or written once (bf16
// = 2 bytes, fp32 = 4):
//   rms_norm_fwd  T x D   read x, w; write y, rstd       2TD + 2D + 2TD + 4T
//   rms_norm_bwd  T x D   read x, dy, w, rstd; write dx;  3 * 2TD + 2D + 4T + 8D
//                         dw read and written (f32)
//                 (slime's dw partial sums add 2 * 4 * B * D bytes of workspace
//                 traffic for B resident blocks, not counted: ~2% at
//                 16384 x 4096 with 2 blocks on each of 132 SMs)
//   rope_fwd/bwd  T x (Hq + Hk) x d   read and write q and k; read positions
//   mrope_fwd     the same with Qwen3-VL's interleaved MRoPE (3 positions per
//                 token); its torch row is HF's apply_rotary_pos_emb with the
//                 MRoPE cos / sin (computed once per forward there, as here)
//                                     2 * 2T(Hq + Hk)d + 4T
//   swiglu_fwd    T x F   fused gate_up [T, 2F] read, h written   3 * 2TF
//   swiglu_bwd    T x F   gate_up, dh read; dgate_up written      5 * 2TF
//   add           T x D   y = a + b                               3 * 2TD
//   copy          B bytes cudaMemcpyAsync device to device        2B
// Bandwidth GBps = bytes / time (1e9 bytes/s). Every op also times a copy of
// bytes / 2 (so the same traffic) and reports copy_GBps and frac_of_copy =
// GBps / copy_GBps (target >= 0.7). Operands are >= 128 MiB, well above the
// 50 MB L2, so no L2 flush is needed.
//
// Timing: the first run of each benchmark checks sampled rows against the CPU
// reference (skips with the error when wrong), then kWarmup untimed calls;
// each iteration records a CUDA event, runs kBatch calls, records another and
// reports the time / kBatch (UseManualTime). Iterations and repetitions are
// fixed; read the median over repetitions.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "slime/core/half.hpp"
#include "slime/core/random.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/ops/rms_norm.hpp"
#include "slime/ops/rope.hpp"
#include "slime/ops/swiglu.hpp"

namespace {

using slime::BFloat16;
using slime::Device;
using slime::DType;
using slime::Event;
using slime::Stream;
using slime::Tensor;
namespace ops = slime::ops;

constexpr int64_t kTokens = 16384;
constexpr int kWarmup = 3;
constexpr int kBatch = 5;
constexpr int kIterations = 10;
constexpr int kRepetitions = 5;
constexpr int kCopyReps = 10;  // timed copy batches for frac_of_copy; the median is used
constexpr float kEps = 1e-6f;
constexpr double kTheta = 1e6;

Device gpu() { return Device::cuda(0); }

Tensor randn(const slime::Shape& shape, const Stream& s, uint64_t seed, float stddev = 1.f) {
  Tensor t = Tensor::empty(shape, DType::bf16, gpu(), s);
  slime::fill_normal(t, seed, 0, 0.f, stddev, s);
  return t;
}

// Host copies of rows [r, r + 1) of a [rows, cols] bf16 device tensor.
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

Case rms_norm_case(const Stream& s, int64_t D, bool backward) {
  const int64_t T = kTokens;
  struct Bufs {
    Tensor x, w, y, rstd, dy, dx, dw, ws;
  };
  auto b = std::make_shared<Bufs>();
  b->x = randn({T, D}, s, 1, 2.f);
  b->w = randn({D}, s, 2, 0.3f);
  b->y = Tensor::empty({T, D}, DType::bf16, gpu(), s);
  b->rstd = Tensor::empty({T}, DType::f32, gpu(), s);
  b->dy = randn({T, D}, s, 3);
  b->dx = Tensor::empty({T, D}, DType::bf16, gpu(), s);
  b->dw = Tensor::zeros({D}, DType::f32, gpu(), s);
  b->ws = Tensor::empty({int64_t(ops::rms_norm_backward_workspace_bytes(T, D))}, DType::u8, gpu(), s);
  ops::rms_norm_forward(b->x, b->w, kEps, b->y, b->rstd, s);
  Case c;
  const double TD = double(T) * double(D);
  c.bytes = backward ? 3 * 2 * TD + 2 * D + 4 * T + 8 * D : 2 * 2 * TD + 2 * D + 4 * T;
  if (backward) {
    c.launch = [b](const Stream& st) { ops::rms_norm_backward(b->x, b->w, b->rstd, b->dy, b->dx, b->dw, b->ws, st); };
  } else {
    c.launch = [b](const Stream& st) { ops::rms_norm_forward(b->x, b->w, kEps, b->y, b->rstd, st); };
  }
  c.check = [b, D, T, backward](const Stream& st) -> std::string {
    (backward ? b->dx : b->y).fill_bytes_(0xff, st);
    if (backward) {
      ops::rms_norm_backward(b->x, b->w, b->rstd, b->dy, b->dx, b->dw, b->ws, st);
    } else {
      ops::rms_norm_forward(b->x, b->w, kEps, b->y, b->rstd, st);
    }
    const std::vector<BFloat16> w = b->w.to_vector<BFloat16>(st);
    for (int64_t r : {int64_t(0), int64_t(1), T / 2, T - 1}) {
      const std::vector<BFloat16> x = host_row(b->x, r, st), dy = host_row(b->dy, r, st);
      std::vector<BFloat16> want(static_cast<std::size_t>(D)), dx(static_cast<std::size_t>(D));
      float rs = 0.f;
      ops::cpu::rms_norm_forward(x.data(), w.data(), 1, D, kEps, want.data(), &rs);
      if (backward) {
        std::vector<float> dw(static_cast<std::size_t>(D), 0.f);
        ops::cpu::rms_norm_backward(x.data(), w.data(), &rs, dy.data(), 1, D, dx.data(), dw.data());
        want = dx;
      }
      const double err = rel_err(host_row(backward ? b->dx : b->y, r, st), want);
      if (!(err <= 4e-3)) return slime::detail::concat("correctness check failed: row ", r, " relative error ", err);
    }
    return "";
  };
  return c;
}

Case rope_case(const Stream& s, bool backward) {
  const int64_t T = kTokens, Hq = 32, Hk = 4, d = 128;
  struct Bufs {
    Tensor q, k, qo, ko, pos;
  };
  auto b = std::make_shared<Bufs>();
  b->q = randn({T, Hq, d}, s, 11);
  b->k = randn({T, Hk, d}, s, 12);
  b->qo = Tensor::empty({T, Hq, d}, DType::bf16, gpu(), s);
  b->ko = Tensor::empty({T, Hk, d}, DType::bf16, gpu(), s);
  b->pos = Tensor::empty({T}, DType::i32, gpu(), s);
  // Four packed sequences of 4096 tokens.
  const Tensor cu = Tensor::from_vector(std::vector<int32_t>{0, 4096, 8192, 12288, 16384}, {5}, gpu(), s);
  ops::positions_from_cu_seqlens(cu, b->pos, s);
  Case c;
  c.bytes = 2.0 * 2.0 * double(T) * double(Hq + Hk) * double(d) + 4.0 * double(T);
  const double sign = backward ? -1 : 1;
  c.launch = [b, backward](const Stream& st) {
    if (backward) {
      ops::rope_backward(b->q, b->k, b->pos, kTheta, b->qo, b->ko, st);
    } else {
      ops::rope_forward(b->q, b->k, b->pos, kTheta, b->qo, b->ko, st);
    }
  };
  c.check = [b, T, Hq, d, sign, launch = c.launch](const Stream& st) -> std::string {
    b->qo.fill_bytes_(0xff, st);
    launch(st);
    const std::vector<int32_t> pos = b->pos.to_vector<int32_t>(st);
    for (int64_t t : {int64_t(0), int64_t(4095), int64_t(4096), T - 1}) {
      const std::vector<BFloat16> q = host_row(b->q, t, st);
      std::vector<BFloat16> want(q.size());
      ops::cpu::rope_rotate(q.data(), &pos[std::size_t(t)], 1, Hq, d, kTheta, int(sign), want.data());
      const double err = rel_err(host_row(b->qo, t, st), want);
      if (!(err <= 4e-3)) return slime::detail::concat("correctness check failed: token ", t, " relative error ", err);
    }
    return "";
  };
  return c;
}

// Qwen3-VL's interleaved MRoPE (sections 24 / 20 / 20): the same traffic as
// rope plus two more position reads per token; positions (t, h, w) differ
// per axis, as for image tokens.
Case mrope_case(const Stream& s) {
  const int64_t T = kTokens, Hq = 32, Hk = 4, d = 128;
  const ops::RopeSpec spec = ops::RopeSpec::mrope(kTheta, {24, 20, 20});
  struct Bufs {
    Tensor q, k, qo, ko, pos;
    std::vector<int32_t> host_pos;
  };
  auto b = std::make_shared<Bufs>();
  b->q = randn({T, Hq, d}, s, 31);
  b->k = randn({T, Hk, d}, s, 32);
  b->qo = Tensor::empty({T, Hq, d}, DType::bf16, gpu(), s);
  b->ko = Tensor::empty({T, Hk, d}, DType::bf16, gpu(), s);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t a = 0; a < 3; ++a) b->host_pos.push_back(int32_t(t % 4096 + (a == 0 ? 0 : (t * (a + 1)) % 64)));
  b->pos = Tensor::from_vector(b->host_pos, {T, 3}, gpu(), s);
  Case c;
  c.bytes = 2.0 * 2.0 * double(T) * double(Hq + Hk) * double(d) + 12.0 * double(T);
  c.launch = [b, spec](const Stream& st) { ops::rope_forward(b->q, b->k, b->pos, spec, b->qo, b->ko, st); };
  c.check = [b, T, Hq, d, spec, launch = c.launch](const Stream& st) -> std::string {
    b->qo.fill_bytes_(0xff, st);
    launch(st);
    for (int64_t t : {int64_t(0), int64_t(4095), int64_t(4096), T - 1}) {
      const std::vector<BFloat16> q = host_row(b->q, t, st);
      std::vector<BFloat16> want(q.size());
      ops::cpu::rope_rotate(q.data(), &b->host_pos[std::size_t(3 * t)], 1, Hq, d, spec, 1, want.data());
      const double err = rel_err(host_row(b->qo, t, st), want);
      if (!(err <= 4e-3)) return slime::detail::concat("correctness check failed: token ", t, " relative error ", err);
    }
    return "";
  };
  return c;
}

Case swiglu_case(const Stream& s, int64_t F, bool backward) {
  const int64_t T = kTokens;
  struct Bufs {
    Tensor gu, dh, h, dgu;
  };
  auto b = std::make_shared<Bufs>();
  b->gu = randn({T, 2 * F}, s, 21, 2.f);
  b->dh = randn({T, F}, s, 22);
  b->h = Tensor::empty({T, F}, DType::bf16, gpu(), s);
  b->dgu = Tensor::empty({T, 2 * F}, DType::bf16, gpu(), s);
  Case c;
  c.bytes = (backward ? 5.0 : 3.0) * 2.0 * double(T) * double(F);
  c.launch = [b, backward](const Stream& st) {
    if (backward) {
      ops::swiglu_backward_fused(b->gu, b->dh, b->dgu, st);
    } else {
      ops::swiglu_forward_fused(b->gu, b->h, st);
    }
  };
  c.check = [b, T, F, backward, launch = c.launch](const Stream& st) -> std::string {
    (backward ? b->dgu : b->h).fill_bytes_(0xff, st);
    launch(st);
    for (int64_t r : {int64_t(0), T / 3, T - 1}) {
      const std::vector<BFloat16> gu = host_row(b->gu, r, st), dh = host_row(b->dh, r, st);
      std::vector<BFloat16> want(static_cast<std::size_t>(backward ? 2 * F : F));
      if (backward) {
        ops::cpu::swiglu_backward(gu.data(), gu.data() + F, dh.data(), F, want.data(), want.data() + F);
      } else {
        ops::cpu::swiglu_forward(gu.data(), gu.data() + F, F, want.data());
      }
      const double err = rel_err(host_row(backward ? b->dgu : b->h, r, st), want);
      if (!(err <= 4e-3)) return slime::detail::concat("correctness check failed: row ", r, " relative error ", err);
    }
    return "";
  };
  return c;
}

Case add_case(const Stream& s, int64_t D) {
  const int64_t T = kTokens;
  struct Bufs {
    Tensor a, b, y;
  };
  auto b = std::make_shared<Bufs>();
  b->a = randn({T, D}, s, 31);
  b->b = randn({T, D}, s, 32);
  b->y = Tensor::empty({T, D}, DType::bf16, gpu(), s);
  Case c;
  c.bytes = 3.0 * 2.0 * double(T) * double(D);
  c.launch = [b](const Stream& st) { ops::add(b->a, b->b, b->y, st); };
  c.check = [b, T](const Stream& st) -> std::string {
    b->y.fill_bytes_(0xff, st);
    ops::add(b->a, b->b, b->y, st);
    for (int64_t r : {int64_t(0), T - 1}) {
      const std::vector<BFloat16> a = host_row(b->a, r, st), bb = host_row(b->b, r, st), y = host_row(b->y, r, st);
      for (std::size_t i = 0; i < a.size(); ++i)
        if (y[i].bits != BFloat16(float(a[i]) + float(bb[i])).bits)
          return slime::detail::concat("correctness check failed: row ", r, " element ", i);
    }
    return "";
  };
  return c;
}

Case copy_case(const Stream& s, int64_t bytes) {
  auto a = std::make_shared<Tensor>(Tensor::empty({bytes}, DType::u8, gpu(), s));
  auto b = std::make_shared<Tensor>(Tensor::empty({bytes}, DType::u8, gpu(), s));
  a->fill_bytes_(7, s);
  Case c;
  c.bytes = 2.0 * double(bytes);
  c.launch = [a, b, bytes](const Stream& st) {
    SLIME_CUDA_CHECK(
        cudaMemcpyAsync(b->data_ptr(), a->data_ptr(), std::size_t(bytes), cudaMemcpyDeviceToDevice, st.handle()));
  };
  c.check = [b, launch = c.launch](const Stream& st) -> std::string {
    launch(st);
    const std::vector<uint8_t> tail = b->view(b->numel() - 4096, {4096}).to_vector<uint8_t>(st);
    for (uint8_t v : tail)
      if (v != 7) return "correctness check failed: copy";
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
  for (int64_t D : {int64_t(4096), int64_t(2048)}) {
    const std::string shape = std::to_string(kTokens) + "x" + std::to_string(D);
    add_benchmark("rms_norm_fwd/" + shape + "/bf16", [D](const Stream& s) { return rms_norm_case(s, D, false); });
    add_benchmark("rms_norm_bwd/" + shape + "/bf16", [D](const Stream& s) { return rms_norm_case(s, D, true); });
  }
  const std::string rope_shape = std::to_string(kTokens) + "x36x128";
  add_benchmark("rope_fwd/" + rope_shape + "/bf16", [](const Stream& s) { return rope_case(s, false); });
  add_benchmark("rope_bwd/" + rope_shape + "/bf16", [](const Stream& s) { return rope_case(s, true); });
  add_benchmark("mrope_fwd/" + rope_shape + "/bf16", [](const Stream& s) { return mrope_case(s); });
  const std::string swiglu_shape = std::to_string(kTokens) + "x4096";
  add_benchmark("swiglu_fwd/" + swiglu_shape + "/bf16", [](const Stream& s) { return swiglu_case(s, 4096, false); });
  add_benchmark("swiglu_bwd/" + swiglu_shape + "/bf16", [](const Stream& s) { return swiglu_case(s, 4096, true); });
  add_benchmark("add/" + std::to_string(kTokens) + "x4096/bf16", [](const Stream& s) { return add_case(s, 4096); });
  for (int64_t mib : {int64_t(128), int64_t(256), int64_t(512)})
    add_benchmark("copy/" + std::to_string(mib) + "MiB", [mib](const Stream& s) { return copy_case(s, mib << 20); });
  return slime::bench::run_benchmarks(argc, argv);
}
