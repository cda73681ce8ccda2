// bench/bench_models.hpp: the model configurations the benchmarks share.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "slime/nn/config.hpp"
#include "slime/nn/vision_config.hpp"

namespace slime::bench {

// "dense0.5b": a ~0.5B dense Qwen3 (hidden 1024, 24 layers, 16 / 8 heads,
// head_dim 128, intermediate 3072, vocab 151936, tied embeddings; 0.53 B
// parameters, 1.07 GB in bf16).
inline nn::Qwen3Config dense_0p5b_config() {
  nn::Qwen3Config c;
  c.vocab_size = 151936;
  c.hidden_size = 1024;
  c.intermediate_size = 3072;
  c.num_hidden_layers = 24;
  c.num_attention_heads = 16;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  c.max_position_embeddings = 40960;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1e6;
  c.tie_word_embeddings = true;
  c.torch_dtype = DType::bf16;
  return c;
}

// "dense1.7b": Qwen3-1.7B's shape (hidden 2048, 28 layers, 16 / 8 heads,
// head_dim 128, intermediate 6144, vocab 151936, tied embeddings, rope_theta
// 1e6; 1.72 B parameters, 1.41 B of them outside the embedding, 3.44 GB in
// bf16).
inline nn::Qwen3Config dense_1p7b_config() {
  nn::Qwen3Config c = dense_0p5b_config();
  c.hidden_size = 2048;
  c.intermediate_size = 6144;
  c.num_hidden_layers = 28;
  return c;
}

// "moe": the Qwen3-MoE benchmark config (bench_fsdp, bench_context_parallel):
// hidden 1024, 8 layers, all sparse (decoder_sparse_step 1, no
// mlp_only_layers), 16 / 4 heads, head_dim 64, 32 experts top-4,
// moe_intermediate 384, norm_topk_prob, vocab 32000, untied LM head,
// rope_theta 1e6, no load-balancing loss (output_router_logits false);
// intermediate 3072 is unused (no dense MLP layer). 388.8M parameters, 91.8M
// of them active per token (attention, router, 4 experts, LM head).
inline nn::Qwen3Config moe_config() {
  nn::Qwen3Config c = dense_0p5b_config();
  c.model_type = "qwen3_moe";
  c.vocab_size = 32000;
  c.num_hidden_layers = 8;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.tie_word_embeddings = false;
  c.num_experts = 32;
  c.num_experts_per_tok = 4;
  c.moe_intermediate_size = 384;
  c.norm_topk_prob = true;
  c.decoder_sparse_step = 1;
  c.mlp_only_layers = {};
  c.output_router_logits = false;  // no load-balancing loss
  c.validate();
  return c;
}

// "rollout" (bench_rollout, bench/torch_rollout.py; test_rollout_gpu's
// bitwise case at the benchmark configs): hidden 1024, 8 layers, 16 / 4
// heads of 64, vocab 32000, rope_theta 1e6; dense: an MLP of intermediate
// 3072; moe: 32 experts top-4 of moe_intermediate 384 (every layer sparse).
inline nn::Qwen3Config rollout_config(bool moe) {
  nn::Qwen3Config c;
  if (moe) {
    c.model_type = "qwen3_moe";
    c.num_experts = 32;
    c.num_experts_per_tok = 4;
    c.moe_intermediate_size = 384;
    c.norm_topk_prob = true;
  }
  c.vocab_size = 32000;
  c.hidden_size = 1024;
  c.intermediate_size = 3072;
  c.num_hidden_layers = 8;
  c.num_attention_heads = 16;
  c.num_key_value_heads = 4;
  c.head_dim = 64;
  c.max_position_embeddings = 4096;
  c.rope_theta = 1e6;
  return c;
}

// Qwen3-VL-2B's vision tower (bench_vision_tower, bench_fsdp's
// "vl2b_8layers"): depth 24, hidden 1024, 16 heads of 64, intermediate 4096,
// 3 channels, patch 16, temporal patch 2, spatial merge 2, out_hidden 2048,
// a 48 x 48 learned position grid (2304), deepstack after blocks 5, 11, 17.
inline nn::Qwen3VLVisionConfig qwen3_vl_2b_vision_config() {
  nn::Qwen3VLVisionConfig c;
  c.depth = 24;
  c.hidden_size = 1024;
  c.intermediate_size = 4096;
  c.num_heads = 16;
  c.in_channels = 3;
  c.patch_size = 16;
  c.temporal_patch_size = 2;
  c.spatial_merge_size = 2;
  c.out_hidden_size = 2048;
  c.num_position_embeddings = 2304;
  c.deepstack_visual_indexes = {5, 11, 17};
  c.validate();
  return c;
}

// "vl2b_8layers"' language model: Qwen3-VL-2B's text_config with 8 of its 28
// decoder layers (hidden 2048, 16 / 8 heads, head_dim 128, intermediate 6144,
// vocab 151936, tied embeddings, rope_theta 5e6, interleaved MRoPE sections
// [24, 20, 20], max_position_embeddings 262144, rms_norm_eps 1e-6): 713.9M
// parameters, 402.7M of them outside the embedding (the tower: 407.0M).
inline nn::Qwen3Config vl2b_8layers_text_config() {
  nn::Qwen3Config c = dense_1p7b_config();
  c.model_type = "qwen3_vl_text";
  c.num_hidden_layers = 8;
  c.rope_theta = 5e6;
  c.mrope_section = {24, 20, 20};
  c.max_position_embeddings = 262144;
  c.validate();
  return c;
}

// Model FLOP of one Qwen3-VL vision tower call on images of grids (t, h, w):
// GEMMs and attention only, P patches, P_i = t·h·w of image i, N = P / m²
// merged tokens, H hidden, I intermediate, K = C·T·p² the pixel row, O
// out_hidden, L blocks, 1 + deepstack mergers:
//   fwd = 2·P·K·H                              patch embed (a Linear)
//       + L · 2·P·(3H·H + H·H + 2·H·I)         qkv, proj, fc1, fc2
//       + L · Σ_i 4·P_i²·H                      attention (QKᵀ and PV, per image)
//       + mergers · 2·N·(m²H)·(m²H + O)        merger fc1 and fc2
//   fwd + bwd = 3·fwd − 2·P·K·H                backward = dgrad + wgrad (no
//           pixel gradient: the patch embedding has no dgrad)
// Not counted: the position-embedding resample, norms, GELU, rotary.
inline double vision_tower_flop(const nn::Qwen3VLVisionConfig& c, const std::vector<std::array<int64_t, 3>>& grids,
                                bool backward) {
  const double H = double(c.hidden_size), I = double(c.intermediate_size), K = double(c.patch_dim());
  const double O = double(c.out_hidden_size), m2 = double(c.merge_unit()), L = double(c.depth);
  double P = 0, attn = 0;
  for (const std::array<int64_t, 3>& g : grids) {
    const double n = double(g[0] * g[1] * g[2]);
    P += n;
    attn += double(g[0]) * 4.0 * double(g[1] * g[2]) * double(g[1] * g[2]) * H;
  }
  const double N = P / m2;
  const double patch = 2.0 * P * K * H;
  const double blocks = L * (2.0 * P * (3.0 * H * H + H * H + 2.0 * H * I) + attn);
  const double mergers = double(1 + c.deepstack_visual_indexes.size()) * 2.0 * N * (m2 * H) * (m2 * H + O);
  const double fwd = patch + blocks + mergers;
  return backward ? 3.0 * fwd - patch : fwd;
}

}  // namespace slime::bench
