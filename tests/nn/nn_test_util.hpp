// Helpers of the nn tests: host copies as double, relative errors, random
// tensors, finite differences on f32 CPU tensors, and the Qwen3 / Qwen3-MoE
// golden fixtures (tools/make_qwen3_golden.py, tools/make_qwen3_moe_golden.py)
// compared against a loaded model; temp dirs, parameter lists, bitwise
// comparison and the packed sequences of test_qwen3.cpp / test_qwen3_moe.cpp.
#pragma once

#include <catch2/catch_test_macros.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <system_error>
#include <utility>
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

// ---- the golden fixtures ---------------------------------------------------

// tests/nn/data/<name>: qwen3_tiny (tools/make_qwen3_golden.py, dense) or
// qwen3_moe_tiny (tools/make_qwen3_moe_golden.py).
inline std::filesystem::path golden_dir(const std::string& name = "qwen3_tiny") {
  return std::filesystem::path(SLIME_NN_TEST_DATA) / name;
}

struct Golden {
  std::vector<std::vector<int32_t>> sequences;
  std::vector<int64_t> targets;
  io::SafetensorsFile file;

  explicit Golden(const std::filesystem::path& dir = golden_dir()) : file(dir / "golden.safetensors") {
    const auto tokens = file.read("tokens", DType::i64).to_vector<int64_t>();
    const auto cu = file.read("cu_seqlens", DType::i32).to_vector<int32_t>();
    for (std::size_t b = 0; b + 1 < cu.size(); ++b)
      sequences.emplace_back(tokens.begin() + cu[b], tokens.begin() + cu[b + 1]);
    targets = file.read("targets", DType::i64).to_vector<int64_t>();
  }
  Tensor read(const std::string& name) const { return file.read(name, DType::f32); }
};

// Largest measured relative errors of one run against a golden fixture.
struct GoldenErrors {
  double logits = 0, logprobs = 0, entropy = 0, loss = 0, grad_max = 0;
  double router_logits = 0, aux_loss = 0;  // MoE fixtures only (largest over sparse layers)
  std::string worst_grad;
};

// The golden gradient of a model parameter: "grad.<name>", or for a stacked
// expert parameter the per-expert "grad.<expert_name(i)>" concatenated in
// stack order.
inline std::vector<double> golden_grad(const Golden& g, const nn::Parameter& p) {
  if (!p.is_expert_stack()) {
    REQUIRE(g.file.contains("grad." + p.name));
    return to_double(g.read("grad." + p.name));
  }
  std::vector<double> out;
  for (int64_t i = 0; i < p.value.size(0); ++i) {
    INFO("expert tensor " << p.expert_name(i));
    REQUIRE(g.file.contains("grad." + p.expert_name(i)));
    const auto v = to_double(g.read("grad." + p.expert_name(i)));
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// Loads the HF directory `dir` on `device` in `dtype`, runs the golden batch
// and returns the errors (each ‖a − b‖/‖b‖ per tensor; a stacked expert
// parameter counts as one tensor; grad_max the largest over parameters).
// Every golden parameter gradient must have a model parameter and vice
// versa. MoE fixtures also compare each sparse layer's router logits and the
// aux loss; their "loss" includes router_aux_loss_coef * aux_loss (the
// fixture's config sets output_router_logits, which loss_and_backward
// follows).
inline GoldenErrors run_golden(Device device, DType dtype, const std::filesystem::path& dir = golden_dir()) {
  const Golden g(dir);
  nn::Qwen3Model model = nn::load_hf(dir, device, dtype);
  const nn::PackedBatch batch = nn::make_packed_batch(g.sequences, device);
  const Tensor targets = Tensor::from_vector(g.targets, {int64_t(g.targets.size())}, device);
  GoldenErrors e;

  nn::Qwen3Model::Context ctx;
  const Tensor hidden = model.forward(batch, ctx);
  e.logits = rel_error(model.logits(hidden), g.read("logits"));
  const ops::TokenLogprobs lp = model.token_logprobs(hidden, targets);
  e.logprobs = rel_error(lp.logprobs, g.read("logprobs"));
  e.entropy = rel_error(lp.entropy, g.read("entropy"));
  const std::vector<int> sparse = model.sparse_layers();
  const std::vector<Tensor> router = model.router_logits(ctx);
  REQUIRE(router.size() == sparse.size());
  int golden_routers = 0;
  for (const auto& name : g.file.names()) golden_routers += name.starts_with("router_logits.") ? 1 : 0;
  REQUIRE(golden_routers == int(sparse.size()));
  for (std::size_t l = 0; l < sparse.size(); ++l) {
    const std::string name = "router_logits." + std::to_string(sparse[l]);
    INFO(name);
    REQUIRE(g.file.contains(name));
    e.router_logits = std::max(e.router_logits, rel_error(router[l], g.read(name)));
  }
  if (model.config().is_moe()) {
    const double want_aux = to_double(g.read("aux_loss"))[0];
    e.aux_loss = std::abs(model.aux_loss_and_grad(ctx).value - want_aux) / std::abs(want_aux);
  }

  nn::zero_grad(model);
  const nn::LossResult loss = model.loss_and_backward(batch, targets);
  const double want_loss = to_double(g.read("loss"))[0];
  e.loss = std::abs(loss.loss - want_loss) / std::abs(want_loss);

  int params = 0;
  model.for_each_parameter([&](nn::Parameter& p) {
    params += p.is_expert_stack() ? int(p.value.size(0)) : 1;
    INFO("parameter " << p.name);
    REQUIRE(p.grad.defined());
    const double err = rel_error(to_double(p.grad), golden_grad(g, p));
    if (err >= e.grad_max) {
      e.grad_max = err;
      e.worst_grad = p.name;
    }
  });
  int golden_grads = 0;
  for (const auto& name : g.file.names()) golden_grads += name.starts_with("grad.") ? 1 : 0;
  REQUIRE(params == golden_grads);
  std::printf(
      "golden %s %s %s: logits %.3g, logprobs %.3g, entropy %.3g, loss %.3g, router logits %.3g, aux %.3g, "
      "grads max %.3g (%s)\n",
      dir.filename().string().c_str(), device.str().c_str(), std::string(dtype_name(dtype)).c_str(), e.logits,
      e.logprobs, e.entropy, e.loss, e.router_logits, e.aux_loss, e.grad_max, e.worst_grad.c_str());
  return e;
}

// A fresh directory under the system temp dir (slime_nn_<name>_<pid>),
// removed with the object.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& name)
      : path(std::filesystem::temp_directory_path() / ("slime_nn_" + name + "_" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// (name, value) of every parameter, in visiting order.
inline std::vector<std::pair<std::string, Tensor>> parameters_of(nn::Qwen3Model& m) {
  std::vector<std::pair<std::string, Tensor>> out;
  m.for_each_parameter([&](nn::Parameter& p) { out.emplace_back(p.name, p.value); });
  return out;
}

// Same dtype, shape and bytes (any devices).
inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || !(a.shape() == b.shape())) return false;
  const Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  return std::memcmp(ha.data_ptr(), hb.data_ptr(), ha.nbytes()) == 0;
}

// Three packed sequences (lengths 1, 5, 9) of token ids below 40.
inline const std::vector<std::vector<int32_t>> kSequences = {{7}, {3, 9, 27, 1, 12}, {30, 2, 5, 6, 7, 8, 9, 10, 11}};

}  // namespace nn_test
