// bench/bench_models.hpp: the model configurations the benchmarks share.
#pragma once

#include "slime/nn/config.hpp"

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

}  // namespace slime::bench
