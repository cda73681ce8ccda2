// Qwen3-MoE on the GPU (bf16 weights and activations, fp32 gradients) against
// Hugging Face transformers' float32 golden (tests/nn/data/qwen3_moe_tiny),
// and packed sequences against each sequence alone.
#include <catch2/catch_test_macros.hpp>

#include "nn_test_util.hpp"

using namespace slime;
using namespace nn_test;

namespace {
std::filesystem::path moe_dir() { return golden_dir("qwen3_moe_tiny"); }
}  // namespace

// Tolerances (‖gpu − golden‖ / ‖golden‖ per tensor, a stacked expert weight
// counting as one tensor). The bf16 CPU reference meets the bounds of
// test_qwen3_moe_golden.cpp (f32 weights rounded to bf16, 2^-9 relative each,
// and bf16 activations at every op boundary); the GPU rounds at other points
// too (attention's P in bf16, bf16 dz in the fused LM-head backward, cuBLAS
// orders), so these allow about twice that, as the dense GPU golden test
// does. The routing cannot flip: the fixture keeps a top-k margin of 0.1 in
// every token's router logits, several times the bf16 error of a logit.
TEST_CASE("Qwen3-MoE bf16 on the GPU matches transformers within bf16 tolerances", "[nn][golden][moe][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const GoldenErrors e = run_golden(Device::cuda(0), DType::bf16, moe_dir());
  CHECK(e.logits <= 3e-2);
  CHECK(e.router_logits <= 3e-2);
  CHECK(e.logprobs <= 2e-2);
  CHECK(e.entropy <= 2e-2);
  CHECK(e.aux_loss <= 1e-2);
  CHECK(e.loss <= 1e-2);
  INFO("worst gradient: " << e.worst_grad);
  CHECK(e.grad_max <= 8e-2);
}

// Routing is per token and positions restart per sequence: the packed
// batch's hidden states and router logits equal each sequence run alone (up
// to bf16 rounding: kernels may differ with the row count).
TEST_CASE("Qwen3-MoE on the GPU: a packed batch equals its sequences run alone", "[nn][moe][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Golden g(moe_dir());
  nn::Qwen3Model model = nn::load_hf(moe_dir(), Device::cuda(0), DType::bf16);
  nn::Qwen3Model::Context ctx;
  const std::vector<double> packed = to_double(model.forward(nn::make_packed_batch(g.sequences, Device::cuda(0)), ctx));
  const std::vector<double> packed_router = to_double(model.router_logits(ctx).at(0));
  std::vector<double> alone, alone_router;
  for (const auto& s : g.sequences) {
    nn::Qwen3Model::Context c;
    const auto h = to_double(model.forward(nn::make_packed_batch({s}, Device::cuda(0)), c));
    alone.insert(alone.end(), h.begin(), h.end());
    const auto r = to_double(model.router_logits(c).at(0));
    alone_router.insert(alone_router.end(), r.begin(), r.end());
  }
  CHECK(rel_error(packed, alone) <= 1e-2);
  CHECK(rel_error(packed_router, alone_router) <= 1e-2);
}
