// Qwen3-MoE against Hugging Face transformers (tests/nn/data/qwen3_moe_tiny,
// written by tools/make_qwen3_moe_golden.py: a float32 Qwen3MoeForCausalLM
// with eager attention, layer 0 dense, layer 1 with 8 experts, top-2): logits,
// router logits, per-token logprobs and entropies, the aux loss, the loss
// (-sum logprobs / T + 0.1 * aux) and the gradient of every parameter, on the
// CPU in f32 (tight) and in bf16 (the GPU dtype, with the GPU test's
// tolerances).
#include <catch2/catch_test_macros.hpp>

#include "nn_test_util.hpp"

using namespace slime;
using namespace nn_test;

namespace {
std::filesystem::path moe_dir() { return golden_dir("qwen3_moe_tiny"); }
}  // namespace

TEST_CASE("Qwen3-MoE f32 on the CPU matches transformers: logits, router logits, logprobs, aux loss, gradients",
          "[nn][golden][moe]") {
  const GoldenErrors e = run_golden(Device::cpu(), DType::f32, moe_dir());
  // f32 throughout, different summation orders. Measured: logits 7e-7,
  // router logits 5e-7, logprobs 2e-7, aux loss 7e-8, gradients up to 1.8e-6.
  CHECK(e.logits <= 1e-4);
  CHECK(e.router_logits <= 1e-4);
  CHECK(e.logprobs <= 1e-4);
  CHECK(e.entropy <= 1e-4);
  CHECK(e.aux_loss <= 1e-5);
  CHECK(e.loss <= 1e-5);
  INFO("worst gradient: " << e.worst_grad);
  CHECK(e.grad_max <= 1e-3);
}

// bf16 weights and activations on the CPU reference (fp32 accumulation, fp32
// gradients, f32 router probabilities), against the f32 golden. The fixture's
// routing has a top-k margin of at least 0.1 in the router logits, so bf16
// rounding does not change which experts a token picks. Measured: logits
// 1.4e-2, router logits 1.1e-2, logprobs 3.8e-3, entropy 1.7e-3, aux loss
// 1.9e-3, loss 4.2e-4, gradients up to 2.9e-2 (layer 1's q_proj): the same
// sources as the dense model's (f32 weights rounded to bf16, bf16 activations
// at every op boundary). The GPU test allows about twice these.
TEST_CASE("Qwen3-MoE bf16 on the CPU matches transformers within bf16 tolerances", "[nn][golden][moe]") {
  const GoldenErrors e = run_golden(Device::cpu(), DType::bf16, moe_dir());
  CHECK(e.logits <= 2e-2);
  CHECK(e.router_logits <= 2e-2);
  CHECK(e.logprobs <= 2e-2);
  CHECK(e.entropy <= 2e-2);
  CHECK(e.aux_loss <= 1e-2);
  CHECK(e.loss <= 1e-2);
  INFO("worst gradient: " << e.worst_grad);
  CHECK(e.grad_max <= 5e-2);
}
