// token_logprobs on the GPU against the CPU reference run in double precision
// on the same (bf16- or f32-valued) inputs: Qwen's vocabulary (151936) with a
// small hidden size, odd sizes, several chunkings, optional outputs, extreme
// logits, determinism and allocation-free steady-state calls.
//
// Tolerances (the reference is exact up to double rounding, so they bound the
// GPU's error alone):
//   logprobs / entropy / lse, absolute: f32 1e-4, bf16 2e-3. The logits are
//     fp32 GEMM outputs in both cases (bf16 inputs are exact in fp32 and the
//     products are accumulated in fp32), so the error is fp32 rounding of
//     sums over dim and over up to 151936 vocabulary terms in a different
//     order, ~1e-6 relative on values of size ~log V = 12; bf16 gets the
//     looser bound the op's contract states.
//   grad_hidden / grad_weight, ||gpu - ref|| / ||ref||: f32 2e-5 (fp32 GEMMs
//     summing over 151936 vocabulary entries or all tokens, and fp32 dz);
//     bf16 1e-2: dz is rounded to bf16 (2^-9 relative per element) before
//     the two GEMMs, and grad_hidden itself is bf16 (another 2^-9), giving
//     ~2e-3 observed-order errors.
#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "slime/core/memory.hpp"
#include "slime/core/random.hpp"
#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/token_logprobs.hpp"
#include "slime/ops/token_logprobs.hpp"

using namespace slime;

namespace {

struct Case {
  DType dtype = DType::bf16;
  DType index = DType::i64;
  int64_t tokens = 17, dim = 64, vocab = 1000;
  float temperature = 0.7f;
  ops::TokenLogprobsChunks chunks{};
  uint64_t seed = 1;
  float hidden_scale = 1.f;
  bool grad_entropy = true;
  bool want_grad_hidden = true, want_grad_weight = true;
};

std::vector<double> as_double(const Tensor& t) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  if (t.dtype() == DType::f32) {
    const auto v = t.to_vector<float>();
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = v[i];
  } else {
    const auto v = t.to_vector<BFloat16>();
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = double(float(v[i]));
  }
  return out;
}

double rel_error(const std::vector<double>& gpu, const std::vector<double>& ref) {
  REQUIRE(gpu.size() == ref.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < gpu.size(); ++i) {
    const double d = gpu[i] - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

double max_abs_error(const std::vector<float>& gpu, const std::vector<double>& ref) {
  REQUIRE(gpu.size() == ref.size());
  double m = 0;
  for (std::size_t i = 0; i < gpu.size(); ++i) {
    if (!std::isfinite(gpu[i])) return INFINITY;  // poisoned or broken
    m = std::max(m, std::abs(double(gpu[i]) - ref[i]));
  }
  return m;
}

struct Inputs {
  Tensor h, w, targets, g_lp, g_ent, dw_init;  // CPU
  std::vector<int64_t> target_values;
};

Inputs make_inputs(const Case& c) {
  Inputs in;
  in.h = Tensor::empty({c.tokens, c.dim}, c.dtype);
  in.w = Tensor::empty({c.vocab, c.dim}, c.dtype);
  // Logits of standard deviation ~2 * hidden_scale / temperature.
  fill_normal(in.h, c.seed, 0, 0.f, c.hidden_scale);
  fill_normal(in.w, c.seed + 1, 0, 0.f, 2.f / std::sqrt(float(c.dim)));
  in.target_values.resize(static_cast<std::size_t>(c.tokens));
  for (int64_t t = 0; t < c.tokens; ++t)
    in.target_values[t] = int64_t(philox_word(c.seed + 2, uint64_t(t)) % uint64_t(c.vocab));
  // Some targets at the edges of the vocabulary and of chunks.
  if (c.tokens > 2) {
    in.target_values[0] = 0;
    in.target_values[1] = c.vocab - 1;
  }
  if (c.index == DType::i64) {
    in.targets = Tensor::from_vector(in.target_values, {c.tokens});
  } else {
    in.targets =
        Tensor::from_vector(std::vector<int32_t>(in.target_values.begin(), in.target_values.end()), {c.tokens});
  }
  in.g_lp = Tensor::empty({c.tokens}, DType::f32);
  in.g_ent = Tensor::empty({c.tokens}, DType::f32);
  fill_normal(in.g_lp, c.seed + 3, 0, 0.f, 1.f);
  fill_normal(in.g_ent, c.seed + 4, 0, 0.f, 1.f);
  in.dw_init = Tensor::empty({c.vocab, c.dim}, DType::f32);
  fill_uniform(in.dw_init, c.seed + 5, 0, -1.f, 1.f);
  return in;
}

struct Reference {
  std::vector<double> lp, ent, lse, dh, dw;  // dw: the accumulated part only
};

Reference reference(const Case& c, const Inputs& in) {
  const auto h = as_double(in.h), w = as_double(in.w);
  const auto glp_f = in.g_lp.to_vector<float>(), gent_f = in.g_ent.to_vector<float>();
  const std::vector<double> g_lp(glp_f.begin(), glp_f.end());
  std::vector<double> g_ent(gent_f.begin(), gent_f.end());
  if (!c.grad_entropy) std::fill(g_ent.begin(), g_ent.end(), 0.0);
  Reference r;
  r.lp.resize(static_cast<std::size_t>(c.tokens));
  r.ent.resize(static_cast<std::size_t>(c.tokens));
  r.lse.resize(static_cast<std::size_t>(c.tokens));
  r.dh.assign(static_cast<std::size_t>(c.tokens * c.dim), 0.0);
  r.dw.assign(static_cast<std::size_t>(c.vocab * c.dim), 0.0);
  ops::cpu::token_logprobs_forward<double, int64_t>(h.data(), w.data(), in.target_values.data(), c.tokens, c.dim,
                                                    c.vocab, double(c.temperature), r.lp.data(), r.ent.data(),
                                                    r.lse.data());
  ops::cpu::token_logprobs_backward<double, int64_t>(h.data(), w.data(), in.target_values.data(), c.tokens, c.dim,
                                                     c.vocab, double(c.temperature), r.lse.data(), r.ent.data(),
                                                     g_lp.data(), g_ent.data(), r.dh.data(), r.dw.data());
  return r;
}

struct GpuResult {
  std::vector<float> lp, ent, lse;
  std::vector<double> dh, dw;  // dw: accumulated part (final - initial)
};

GpuResult run_gpu(const Case& c, const Inputs& in, const Tensor& workspace = {}) {
  const Device dev = Device::cuda(0);
  const Stream stream = Stream::create(dev);
  Tensor h = in.h.to(dev, stream), w = in.w.to(dev, stream), targets = in.targets.to(dev, stream);
  Tensor g_lp = in.g_lp.to(dev, stream), g_ent = in.g_ent.to(dev, stream);
  Tensor lp = Tensor::empty({c.tokens}, DType::f32, dev, stream);
  Tensor ent = Tensor::empty({c.tokens}, DType::f32, dev, stream);
  Tensor lse = Tensor::empty({c.tokens}, DType::f32, dev, stream);
  for (Tensor* t : {&lp, &ent, &lse}) t->fill_bytes_(0xff, stream);  // NaN where unwritten
  ops::token_logprobs_forward(h, w, targets, c.temperature, lp, ent, lse, workspace, c.chunks, stream);

  Tensor dh, dw;
  if (c.want_grad_hidden) {
    dh = Tensor::empty({c.tokens, c.dim}, c.dtype, dev, stream);
    dh.fill_bytes_(0xff, stream);
  }
  if (c.want_grad_weight) dw = in.dw_init.to(dev, stream);
  ops::token_logprobs_backward(h, w, targets, c.temperature, lse, ent, g_lp, c.grad_entropy ? g_ent : Tensor{}, dh, dw,
                               workspace, c.chunks, stream);
  stream.synchronize();
  GpuResult r;
  r.lp = lp.to_vector<float>(stream);
  r.ent = ent.to_vector<float>(stream);
  r.lse = lse.to_vector<float>(stream);
  if (c.want_grad_hidden) r.dh = as_double(dh.to(Device::cpu(), stream));
  if (c.want_grad_weight) {
    r.dw = as_double(dw.to(Device::cpu(), stream));
    const auto init = as_double(in.dw_init);
    for (std::size_t i = 0; i < r.dw.size(); ++i) r.dw[i] -= init[i];
  }
  return r;
}

void check_case(const Case& c) {
  CAPTURE(dtype_name(c.dtype), dtype_name(c.index), c.tokens, c.dim, c.vocab, c.temperature, c.chunks.tokens,
          c.chunks.vocab, c.grad_entropy, c.want_grad_hidden, c.want_grad_weight);
  const Inputs in = make_inputs(c);
  const Reference ref = reference(c, in);
  const GpuResult got = run_gpu(c, in);
  const bool bf16 = c.dtype == DType::bf16;
  const double fwd_tol = bf16 ? 2e-3 : 1e-4;
  const double grad_tol = bf16 ? 1e-2 : 2e-5;
  const double e_lp = max_abs_error(got.lp, ref.lp), e_ent = max_abs_error(got.ent, ref.ent),
               e_lse = max_abs_error(got.lse, ref.lse);
  CAPTURE(e_lp, e_ent, e_lse);
  CHECK(e_lp <= fwd_tol);
  CHECK(e_ent <= fwd_tol);
  CHECK(e_lse <= fwd_tol);
  if (c.want_grad_hidden) {
    const bool finite = std::all_of(got.dh.begin(), got.dh.end(), [](double x) { return std::isfinite(x); });
    CHECK(finite);
    const double e = rel_error(got.dh, ref.dh);
    CAPTURE(e);
    CHECK(e <= grad_tol);
  }
  if (c.want_grad_weight) {
    const bool finite = std::all_of(got.dw.begin(), got.dw.end(), [](double x) { return std::isfinite(x); });
    CHECK(finite);
    const double e = rel_error(got.dw, ref.dw);
    CAPTURE(e);
    CHECK(e <= grad_tol);
  }
}

}  // namespace

TEST_CASE("token_logprobs GPU with the Qwen vocabulary of 151936 and a small hidden size",
          "[ops][token_logprobs][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  for (DType dt : {DType::bf16, DType::f32}) {
    for (int64_t tokens : {int64_t(17), int64_t(300)}) {
      Case c;
      c.dtype = dt;
      c.tokens = tokens;
      c.dim = 64;
      c.vocab = 151936;
      c.seed = 100 + uint64_t(tokens);
      check_case(c);
    }
    // Several token chunks (128, 128, 44) and the largest vocabulary chunk,
    // with i32 targets.
    Case c;
    c.dtype = dt;
    c.index = DType::i32;
    c.tokens = 300;
    c.dim = 64;
    c.vocab = 151936;
    c.chunks = {128, ops::kTokenLogprobsMaxVocabChunk};
    c.seed = 200;
    check_case(c);
  }
}

TEST_CASE("token_logprobs GPU on odd sizes and chunkings", "[ops][token_logprobs][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  uint64_t seed = 300;
  for (DType dt : {DType::bf16, DType::f32}) {
    for (int64_t tokens : {int64_t(1), int64_t(17), int64_t(127), int64_t(577)}) {
      // vocab chunk 333: logits rows of pitch 336 and a last chunk of 1 column.
      for (ops::TokenLogprobsChunks chunks :
           {ops::TokenLogprobsChunks{}, ops::TokenLogprobsChunks{64, 333}, ops::TokenLogprobsChunks{100, 128}}) {
        Case c;
        c.dtype = dt;
        c.index = tokens % 2 ? DType::i32 : DType::i64;
        c.tokens = tokens;
        c.dim = 256;
        c.vocab = 1000;
        c.chunks = chunks;
        c.seed = seed++;
        check_case(c);
      }
    }
    // A hidden size that is not a multiple of 8 (unaligned GEMM operands and
    // the scalar bf16 cast) and an odd vocabulary.
    for (int64_t dim : {int64_t(37), int64_t(255)}) {
      Case c;
      c.dtype = dt;
      c.tokens = 131;
      c.dim = dim;
      c.vocab = 4099;
      c.chunks = {50, 1024};
      c.temperature = 1.3f;
      c.seed = seed++;
      check_case(c);
    }
  }
}

TEST_CASE("token_logprobs GPU optional gradients", "[ops][token_logprobs][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  for (DType dt : {DType::bf16, DType::f32}) {
    Case c;
    c.dtype = dt;
    c.tokens = 33;
    c.dim = 128;
    c.vocab = 2000;
    c.seed = 400;
    c.grad_entropy = false;  // grad_entropy undefined: zero
    check_case(c);
    c.grad_entropy = true;
    c.want_grad_hidden = false;  // grad_weight only
    check_case(c);
    c.want_grad_hidden = true;
    c.want_grad_weight = false;  // grad_hidden only (frozen lm_head)
    check_case(c);
  }
}

TEST_CASE("token_logprobs GPU stays finite for extreme logits", "[ops][token_logprobs][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  // |logits| up to ~1e4: exp() would overflow without the running max.
  Case c;
  c.dtype = DType::f32;
  c.tokens = 40;
  c.dim = 64;
  c.vocab = 20000;
  c.temperature = 0.05f;
  c.hidden_scale = 100.f;
  c.seed = 500;
  CAPTURE(c.tokens);
  const Inputs in = make_inputs(c);
  const Reference ref = reference(c, in);
  double max_lse = 0;
  for (double l : ref.lse) max_lse = std::max(max_lse, std::abs(l));
  REQUIRE(max_lse > 1000.0);
  const GpuResult got = run_gpu(c, in);
  // fp32 logits of size |z| carry ~|z| * 1e-6 absolute error.
  CHECK(max_abs_error(got.lp, ref.lp) <= 1e-5 * max_lse);
  CHECK(max_abs_error(got.ent, ref.ent) <= 1e-5 * max_lse);
  CHECK(max_abs_error(got.lse, ref.lse) <= 1e-5 * max_lse);
  CHECK(std::all_of(got.dh.begin(), got.dh.end(), [](double x) { return std::isfinite(x); }));
  CHECK(std::all_of(got.dw.begin(), got.dw.end(), [](double x) { return std::isfinite(x); }));
  CHECK(rel_error(got.dh, ref.dh) <= 1e-2);
  CHECK(rel_error(got.dw, ref.dw) <= 1e-2);
}

TEST_CASE("token_logprobs GPU is deterministic and allocates nothing with a workspace", "[ops][token_logprobs][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  Case c;
  c.dtype = DType::bf16;
  c.tokens = 300;
  c.dim = 128;
  c.vocab = 151936;
  c.chunks = {128, 0};
  c.seed = 600;
  const Inputs in = make_inputs(c);
  const Device dev = Device::cuda(0);
  const Stream stream = Stream::create(dev);
  Tensor h = in.h.to(dev, stream), w = in.w.to(dev, stream), targets = in.targets.to(dev, stream);
  Tensor g_lp = in.g_lp.to(dev, stream), g_ent = in.g_ent.to(dev, stream);
  Tensor lp = Tensor::empty({c.tokens}, DType::f32, dev, stream),
         ent = Tensor::empty({c.tokens}, DType::f32, dev, stream),
         lse = Tensor::empty({c.tokens}, DType::f32, dev, stream);
  Tensor dh = Tensor::empty({c.tokens, c.dim}, c.dtype, dev, stream);
  Tensor dw = Tensor::zeros({c.vocab, c.dim}, DType::f32, dev, stream);
  const std::size_t bytes = ops::token_logprobs_workspace_bytes(c.tokens, c.dim, c.vocab, c.dtype, c.chunks);
  Tensor workspace = Tensor::empty({int64_t(bytes)}, DType::u8, dev, stream);
  auto bytes_of = [&](const Tensor& t) {
    std::vector<uint8_t> out(t.nbytes());
    const Tensor host = t.to(Device::cpu(), stream);
    std::memcpy(out.data(), host.data_ptr(), out.size());
    return out;
  };
  auto run = [&] {
    ops::token_logprobs_forward(h, w, targets, c.temperature, lp, ent, lse, workspace, c.chunks, stream);
    dw.zero_(stream);
    ops::token_logprobs_backward(h, w, targets, c.temperature, lse, ent, g_lp, g_ent, dh, dw, workspace, c.chunks,
                                 stream);
    stream.synchronize();
  };
  run();  // warm-up: creates the cuBLAS handle (and its workspace)
  const auto first = std::vector{bytes_of(lp), bytes_of(ent), bytes_of(lse), bytes_of(dh), bytes_of(dw)};
  const int64_t allocations = memory_stats(dev).allocations;
  run();
  CHECK(memory_stats(dev).allocations == allocations);
  const auto second = std::vector{bytes_of(lp), bytes_of(ent), bytes_of(lse), bytes_of(dh), bytes_of(dw)};
  CHECK(first == second);
  // A workspace that is too small is an error, not a silent overrun.
  Tensor small = Tensor::empty({int64_t(bytes) - 1}, DType::u8, dev, stream);
  CHECK_THROWS_AS(ops::token_logprobs_forward(h, w, targets, c.temperature, lp, ent, lse, small, c.chunks, stream),
                  Error);
}
