// Helpers of the nn tests: host copies as double, relative errors, random
// tensors, finite differences on f32 CPU tensors, and the Qwen3 golden
// fixture (tools/make_qwen3_golden.py) compared against a loaded model.
#pragma once

#include <catch2/catch_test_macros.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "slime/core/random.hpp"
#include "slime/core/tensor.hpp"
#include "slime/io/safetensors.hpp"
#include "slime/nn/checkpoint.hpp"
#include "slime/nn/qwen3.hpp"

namespace nn_test {

using namespace slime;

// The elements of a floating tensor (any device) as doubles.
inline std::vector<double> to_double(const Tensor& t) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  if (t.dtype() == DType::f32) {
    const auto v = t.to_vector<float>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = v[i];
  } else {
    REQUIRE(t.dtype() == DType::bf16);
    const auto v = t.to_vector<BFloat16>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = double(float(v[i]));
  }
  return out;
}

// ‖a − b‖ / ‖b‖ (‖a − b‖ when b is zero).
inline double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}
inline double rel_error(const Tensor& a, const Tensor& b) { return rel_error(to_double(a), to_double(b)); }

inline Tensor random_tensor(const Shape& shape, uint64_t seed, float low = -1.f, float high = 1.f,
                            DType dtype = DType::f32) {
  Tensor t = Tensor::empty(shape, dtype);
  fill_uniform(t, seed, 0, low, high);
  return t;
}

// Sum of a .* w in double (the scalar loss of the module FD checks).
inline double dot(const Tensor& a, const Tensor& w) {
  const auto x = to_double(a), y = to_double(w);
  REQUIRE(x.size() == y.size());
  double s = 0;
  for (std::size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

// Central difference of `loss` along element i of the f32 CPU tensor t.
inline double central_difference(Tensor& t, int64_t i, double h, const std::function<double()>& loss) {
  float* p = t.data<float>() + i;
  const float saved = *p;
  *p = float(double(saved) + h);
  const double up = loss();
  *p = float(double(saved) - h);
  const double down = loss();
  *p = saved;
  return (up - down) / (2 * h);
}

// ‖fd − analytic‖ / ‖fd‖ over the elements `indices` (every element when
// empty) of `t`, whose analytic gradient is `grad` (f32 CPU, same shape).
inline double fd_rel_error(Tensor& t, const Tensor& grad, const std::function<double()>& loss, double h,
                           std::vector<int64_t> indices = {}) {
  REQUIRE(grad.numel() == t.numel());
  if (indices.empty())
    for (int64_t i = 0; i < t.numel(); ++i) indices.push_back(i);
  const auto g = to_double(grad);
  std::vector<double> fd, an;
  for (int64_t i : indices) {
    fd.push_back(central_difference(t, i, h, loss));
    an.push_back(g[std::size_t(i)]);
  }
  return rel_error(an, fd);
}

// `count` spread-out element indices of a tensor of n elements (all when n is
// small), always including the first and the last.
inline std::vector<int64_t> sample_indices(int64_t n, int64_t count, uint64_t seed) {
  std::vector<int64_t> out;
  if (n <= count) {
    for (int64_t i = 0; i < n; ++i) out.push_back(i);
    return out;
  }
  out.push_back(0);
  out.push_back(n - 1);
  for (int64_t k = 2; k < count; ++k) out.push_back(int64_t(philox_word(seed, uint64_t(k)) % uint64_t(n)));
  return out;
}

// ---- the golden fixture ---------------------------------------------------

inline std::filesystem::path golden_dir() { return std::filesystem::path(SLIME_NN_TEST_DATA) / "qwen3_tiny"; }

struct Golden {
  std::vector<std::vector<int32_t>> sequences;
  std::vector<int64_t> targets;
  io::SafetensorsFile file;

  Golden() : file(golden_dir() / "golden.safetensors") {
    const auto tokens = file.read("tokens", DType::i64).to_vector<int64_t>();
    const auto cu = file.read("cu_seqlens", DType::i32).to_vector<int32_t>();
    for (std::size_t b = 0; b + 1 < cu.size(); ++b)
      sequences.emplace_back(tokens.begin() + cu[b], tokens.begin() + cu[b + 1]);
    targets = file.read("targets", DType::i64).to_vector<int64_t>();
  }
  Tensor read(const std::string& name) const { return file.read(name, DType::f32); }
};

// Largest measured relative errors of one run against the golden fixture.
struct GoldenErrors {
  double logits = 0, logprobs = 0, entropy = 0, loss = 0, grad_max = 0;
  std::string worst_grad;
};

// Loads the HF directory on `device` in `dtype`, runs the golden batch and
// returns the errors (each ‖a − b‖/‖b‖ per tensor; grad_max the largest over
// parameters). Every golden parameter gradient must have a model parameter
// and vice versa.
inline GoldenErrors run_golden(Device device, DType dtype) {
  const Golden g;
  nn::Qwen3Model model = nn::load_hf(golden_dir(), device, dtype);
  const nn::PackedBatch batch = nn::make_packed_batch(g.sequences, device);
  const Tensor targets = Tensor::from_vector(g.targets, {int64_t(g.targets.size())}, device);
  GoldenErrors e;

  nn::Qwen3Model::Context ctx;
  const Tensor hidden = model.forward(batch, ctx);
  e.logits = rel_error(model.logits(hidden), g.read("logits"));
  const ops::TokenLogprobs lp = model.token_logprobs(hidden, targets);
  e.logprobs = rel_error(lp.logprobs, g.read("logprobs"));
  e.entropy = rel_error(lp.entropy, g.read("entropy"));

  nn::zero_grad(model);
  const nn::LossResult loss = model.loss_and_backward(batch, targets);
  const double want_loss = to_double(g.read("loss"))[0];
  e.loss = std::abs(loss.loss - want_loss) / std::abs(want_loss);

  int params = 0;
  model.for_each_parameter([&](nn::Parameter& p) {
    ++params;
    INFO("parameter " << p.name);
    REQUIRE(g.file.contains("grad." + p.name));
    REQUIRE(p.grad.defined());
    const double err = rel_error(p.grad, g.read("grad." + p.name));
    if (err >= e.grad_max) {
      e.grad_max = err;
      e.worst_grad = p.name;
    }
  });
  int golden_grads = 0;
  for (const auto& name : g.file.names()) golden_grads += name.starts_with("grad.") ? 1 : 0;
  REQUIRE(params == golden_grads);
  std::printf("golden %s %s: logits %.3g, logprobs %.3g, entropy %.3g, loss %.3g, grads max %.3g (%s)\n",
              device.str().c_str(), std::string(dtype_name(dtype)).c_str(), e.logits, e.logprobs, e.entropy, e.loss,
              e.grad_max, e.worst_grad.c_str());
  return e;
}

}  // namespace nn_test
