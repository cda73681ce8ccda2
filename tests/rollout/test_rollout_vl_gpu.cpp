// The rollout engine with a Qwen3-VL model on CUDA (bf16): image prompts
// prefill through the tower, the logprobs agree with the trainer's recompute
// (make_vl_batch) to bf16 rounding. Skips without a GPU.
#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "slime/nn/qwen3_vl.hpp"
#include "slime/rollout/engine.hpp"

using namespace slime;

namespace {

constexpr int32_t kImage = 290;

nn::Qwen3VLConfig gpu_vl_config() {
  nn::Qwen3VLConfig c;
  c.text.model_type = "qwen3_vl_text";
  c.text.vocab_size = 300;
  c.text.hidden_size = 128;
  c.text.intermediate_size = 200;
  c.text.num_hidden_layers = 2;
  c.text.num_attention_heads = 2;
  c.text.num_key_value_heads = 1;
  c.text.head_dim = 64;  // the CUDA attention kernels: 64 or 128
  c.text.max_position_embeddings = 256;
  c.text.mrope_section = {12, 10, 10};
  c.vision.depth = 2;
  c.vision.hidden_size = 128;
  c.vision.intermediate_size = 160;
  c.vision.num_heads = 2;  // head_dim 64
  c.vision.in_channels = 2;
  c.vision.patch_size = 2;
  c.vision.temporal_patch_size = 1;
  c.vision.spatial_merge_size = 2;
  c.vision.out_hidden_size = 128;
  c.vision.num_position_embeddings = 9;
  c.vision.deepstack_visual_indexes = {1, 0};
  c.image_token_id = kImage;
  c.video_token_id = 291;
  c.vision_start_token_id = 292;
  c.vision_end_token_id = 293;
  c.validate();
  return c;
}

}  // namespace

TEST_CASE("CUDA VL engine: the trainer's recompute of the sampled tokens' logprobs", "[rollout][gpu][vl]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  nn::Qwen3VLModel m(gpu_vl_config(), {d, DType::bf16});
  m.init_random(1, 0.05f);
  rollout::Engine engine(m, {.max_batch = 4, .max_context = 160, .kv_capacity = 0, .seed = 2});
  std::vector<rollout::Request> reqs;
  for (int i = 0; i < 10; ++i) {
    rollout::Request r;
    for (int j = 0; j < 1 + (i * 7) % 13; ++j) r.prompt.push_back(int32_t((i * 131 + j * 17) % 280));
    for (int k = 0; k < i % 3; ++k) {  // 0, 1 or 2 images of grids [1, 2(1+i%3), 2(1+k)]
      const nn::GridThw g{1, 2 * (1 + i % 3), 2 * (1 + k)};
      r.image_grids.push_back(g);
      r.prompt.push_back(292);
      r.prompt.insert(r.prompt.end(), std::size_t(g[1] * g[2] / 4), kImage);
      r.prompt.push_back(293);
    }
    int64_t patches = 0;
    for (const auto& g : r.image_grids) patches += g[0] * g[1] * g[2];
    if (patches > 0) {
      std::vector<float> px(std::size_t(patches * 8));
      for (std::size_t p = 0; p < px.size(); ++p) px[p] = float(int((p * 29 + std::size_t(i) * 7) % 17) - 8) / 8.f;
      r.pixel_values = Tensor::from_vector(px, {patches, 8});
    }
    r.sample_id = uint64_t(i);
    r.sampling.max_new_tokens = 16 + i % 5;
    r.sampling.stop_tokens = {kImage};
    reqs.push_back(r);
  }
  const auto out = engine.generate(reqs);
  std::vector<nn::VLSequence> seqs;
  std::vector<int32_t> targets;
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    REQUIRE(out[i].finish != rollout::FinishReason::error);
    nn::VLSequence s{reqs[i].prompt, reqs[i].image_grids, reqs[i].pixel_values};
    s.tokens.insert(s.tokens.end(), out[i].tokens.begin(), out[i].tokens.end());
    targets.insert(targets.end(), s.tokens.begin() + 1, s.tokens.end());
    s.tokens.pop_back();
    seqs.push_back(s);
  }
  const nn::VLBatch batch = nn::make_vl_batch(seqs, m.config(), d, DType::bf16);
  nn::Qwen3VLModel::Context ctx;
  const Tensor hidden = m.forward(batch, ctx);
  const auto lp =
      m.token_logprobs(hidden, Tensor::from_vector(targets, {int64_t(targets.size())}, d)).logprobs.to_vector<float>();
  double max_diff = 0;
  int64_t n = 0;
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    const int64_t first = batch.text.cu_seqlens_host[i] + int64_t(reqs[i].prompt.size()) - 1;
    for (std::size_t j = 0; j < out[i].tokens.size(); ++j, ++n)
      max_diff = std::max(max_diff, std::abs(double(lp[std::size_t(first) + j]) - double(out[i].logprobs[j])));
  }
  std::printf("VL rollout on-policy gap (CUDA bf16): %lld tokens, max |engine - trainer| logprob %.3g\n", (long long)n,
              max_diff);
  CHECK(n > 100);
  CHECK(max_diff < 0.05);  // bf16 activations: rounding differences between the two paths
}
