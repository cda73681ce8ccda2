// ReferenceModel on the CPU with a tiny random Qwen3: reference logprobs equal
// the policy's (bitwise) before any update, differ once the policy takes an
// optimizer step, and are equal again after update_from / maybe_update every K
// steps; offload / onload round trips keep the weights bit-exact; errors.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "slime/core/memory.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/rl/reference_model.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;

namespace {

nn::Qwen3Config tiny_config(int layers = 2) {
  nn::Qwen3Config c;
  c.vocab_size = 40;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 100.0;
  return c;
}

const std::vector<std::vector<int32_t>> kSequences = {{7}, {3, 9, 27, 1, 12}, {30, 2, 5, 6, 7, 8, 9, 10, 11}};

// Next-token targets within each sequence; the last position gets token 0.
Tensor targets_of(const std::vector<std::vector<int32_t>>& seqs) {
  std::vector<int32_t> t;
  for (const auto& s : seqs) {
    for (std::size_t i = 0; i < s.size(); ++i) t.push_back(i + 1 < s.size() ? s[i + 1] : 0);
  }
  return Tensor::from_vector(t, Shape{int64_t(t.size())});
}

std::vector<float> policy_logprobs(nn::Qwen3Model& m, const nn::PackedBatch& b, const Tensor& targets) {
  nn::Qwen3Model::Context ctx;
  const Tensor h = m.forward(b, ctx);
  return m.token_logprobs(h, targets).logprobs.to_vector<float>();
}

std::vector<std::vector<uint8_t>> weight_bytes(nn::Qwen3Model& m) {
  std::vector<std::vector<uint8_t>> out;
  m.for_each_parameter([&](nn::Parameter& p) {
    const Tensor h = p.value.to(Device::cpu());
    const auto* b = static_cast<const uint8_t*>(h.data_ptr());
    out.emplace_back(b, b + h.nbytes());
  });
  return out;
}

// One SGD step on the policy's own loss: the policy moves away from the reference.
void sgd_step(nn::Qwen3Model& m, const nn::PackedBatch& b, const Tensor& targets, float lr) {
  nn::zero_grad(m);
  m.loss_and_backward(b, targets);
  m.for_each_parameter([&](nn::Parameter& p) {
    float* w = p.value.data<float>();
    const float* g = p.grad.data<float>();
    for (int64_t i = 0; i < p.value.numel(); ++i) w[i] -= lr * g[i];
  });
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - double(b[i])));
  return m;
}

}  // namespace

TEST_CASE("reference logprobs follow the policy only through update_from") {
  nn::Qwen3Model policy(tiny_config(), {});
  policy.init_random(3, 0.2f);
  const nn::PackedBatch batch = nn::make_packed_batch(kSequences);
  const Tensor targets = targets_of(kSequences);

  rl::ReferenceModel<> ref(policy, {.update_every = 2, .offload = true});
  REQUIRE(ref.is_offloaded());
  CHECK_THROWS_WITH(ref.logprobs(batch, targets), ContainsSubstring("call onload() before scoring"));

  // Before any update: bitwise the policy's logprobs (same weights, same kernels).
  ref.onload();
  REQUIRE_FALSE(ref.is_offloaded());
  const std::vector<float> p0 = policy_logprobs(policy, batch, targets);
  CHECK(ref.logprobs(batch, targets).to_vector<float>() == p0);
  ref.offload();

  // The policy takes a step: the reference stays where it was.
  sgd_step(policy, batch, targets, 0.5f);
  const std::vector<float> p1 = policy_logprobs(policy, batch, targets);
  REQUIRE(max_abs_diff(p1, p0) > 1e-3);
  const std::vector<nn::PackedBatch> batches = {batch};
  const std::vector<Tensor> targets_list = {targets};
  std::vector<Tensor> r = ref.logprobs(batches, targets_list);  // onloads, scores, offloads again
  REQUIRE(ref.is_offloaded());
  CHECK(r[0].to_vector<float>() == p0);

  // update_every = 2: step 1 copies nothing, step 2 copies the policy in (while offloaded).
  CHECK_FALSE(ref.should_update(0));
  CHECK_FALSE(ref.maybe_update(1, policy));
  r = ref.logprobs(batches, targets_list);
  CHECK(r[0].to_vector<float>() == p0);
  CHECK(ref.maybe_update(2, policy));
  r = ref.logprobs(batches, targets_list);
  CHECK(r[0].to_vector<float>() == p1);

  // update_from while on the device, then another policy step.
  sgd_step(policy, batch, targets, 0.5f);
  const std::vector<float> p2 = policy_logprobs(policy, batch, targets);
  REQUIRE(max_abs_diff(p2, p1) > 1e-3);
  ref.onload();
  CHECK(ref.logprobs(batch, targets).to_vector<float>() == p1);
  ref.update_from(policy);
  CHECK(ref.logprobs(batch, targets).to_vector<float>() == p2);
  // The next offload copies the updated weights to the pinned copies.
  ref.offload();
  r = ref.logprobs(batches, targets_list);
  CHECK(r[0].to_vector<float>() == p2);
  // The reference never allocates gradients.
  ref.onload();
  ref.model().for_each_parameter([&](nn::Parameter& p) { CHECK_FALSE(p.grad.defined()); });
}

TEST_CASE("reference model offload and onload keep the weights bit-exact") {
  nn::Qwen3Model policy(tiny_config(), {});
  policy.init_random(5, 0.2f);
  rl::ReferenceModel<> ref(policy, {.update_every = 0, .offload = false});
  REQUIRE_FALSE(ref.is_offloaded());
  CHECK_FALSE(ref.should_update(1));
  CHECK_FALSE(ref.should_update(100));
  const auto before = weight_bytes(ref.model());
  CHECK(before == weight_bytes(policy));
  const int64_t pinned_before = pinned_memory_stats().current_bytes;
  ref.offload();
  REQUIRE(ref.is_offloaded());
  // The parameters now live in the pinned copies only: the model's values are released.
  ref.model().for_each_parameter([&](nn::Parameter& p) { CHECK_FALSE(p.value.defined()); });
  CHECK(pinned_memory_stats().current_bytes - pinned_before == nn::num_parameters(policy) * 4);
  ref.offload();  // no-op
  for (int round = 0; round < 3; ++round) {
    ref.onload();
    REQUIRE_FALSE(ref.is_offloaded());
    CHECK(weight_bytes(ref.model()) == before);
    ref.onload();  // no-op
    ref.offload();
  }
  // The pinned buffers are allocated once and reused.
  CHECK(pinned_memory_stats().current_bytes - pinned_before == nn::num_parameters(policy) * 4);
}

TEST_CASE("reference model rejects a policy of another shape and bad configs") {
  nn::Qwen3Model policy(tiny_config(2), {});
  policy.init_random(1, 0.2f);
  rl::ReferenceModel<> ref(policy);
  nn::Qwen3Model other(tiny_config(1), {});
  other.init_random(1, 0.2f);
  CHECK_THROWS_WITH(ref.update_from(other), ContainsSubstring("parameters, the reference"));
  nn::Qwen3Config wider = tiny_config(2);
  wider.intermediate_size = 32;
  nn::Qwen3Model third(wider, {});
  third.init_random(1, 0.2f);
  CHECK_THROWS_WITH(ref.update_from(third), ContainsSubstring("in the policy"));
  CHECK_THROWS_WITH(rl::ReferenceModel<>(policy, {.update_every = -1}), ContainsSubstring("update_every must be >= 0"));
  const std::vector<nn::PackedBatch> one(1);
  CHECK_THROWS_WITH(ref.logprobs(one, std::vector<Tensor>{}), ContainsSubstring("1 micro-batches but 0 target"));
}
