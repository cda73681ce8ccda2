// tests/fsdp/fsdp_gpu_test_util.hpp: what the NCCL FSDP tests share
// (test_fsdp_nccl.cpp, test_sharded_offload_gpu.cpp): NVLink multicast off,
// the small bf16 Qwen3 they train, and the relative error of two parameter
// vectors.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "slime/nn/qwen3.hpp"

namespace slime_test::fsdp {

// NVLS (NVLink multicast) off unless the environment says otherwise, before
// any communicator exists (internal linkage: set by every test that includes
// this, at its static initialisation, whether or not it names it).
[[maybe_unused]] static const bool kNvlsOff = (setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0), true);

// A small Qwen3 (vocab 1001, hidden 192, 2 layers, untied embeddings).
inline slime::nn::Qwen3Config config() {
  slime::nn::Qwen3Config c;
  c.vocab_size = 1001;
  c.hidden_size = 192;
  c.intermediate_size = 320;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.tie_word_embeddings = false;
  return c;
}

// config() as a Qwen3-MoE: 8 experts top-2, layer 0 dense, layer 1 sparse.
inline slime::nn::Qwen3Config moe_config() {
  slime::nn::Qwen3Config c = config();
  c.model_type = "qwen3_moe";
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 96;
  c.mlp_only_layers = {0};
  return c;
}

// ||a - b|| / ||b||; 1e30 when the sizes differ.
inline double rel(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num += double(a[i] - b[i]) * double(a[i] - b[i]);
    den += double(b[i]) * double(b[i]);
  }
  return a.size() == b.size() ? std::sqrt(num / std::max(den, 1e-30)) : 1e30;
}

}  // namespace slime_test::fsdp
