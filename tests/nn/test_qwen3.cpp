// Qwen3Model on the CPU: packed batches (positions restart, no attention
// across sequences), gradient accumulation over micro-batches, parameter names
// and initialisation, configuration and input errors, and Hugging Face
// checkpoints (save_hf / load_hf round trips, missing / unexpected / misshaped
// tensors). Qwen3-MoE: test_qwen3_moe.cpp.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "nn_test_util.hpp"
#include "slime/nn/checkpoint.hpp"
#include "slime/nn/qwen3.hpp"

using namespace slime;
using namespace nn_test;
using Catch::Matchers::ContainsSubstring;
namespace fs = std::filesystem;

namespace {

nn::Qwen3Config tiny_config(bool tied = false) {
  nn::Qwen3Config c;
  c.vocab_size = 40;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 100.0;
  c.tie_word_embeddings = tied;
  return c;
}

nn::Qwen3Model tiny_model(bool tied = false, uint64_t seed = 1) {
  nn::Qwen3Model m(tiny_config(tied), {});
  m.init_random(seed, 0.2f);
  return m;
}

}  // namespace

TEST_CASE("make_packed_batch packs sequences with cu_seqlens and restarting positions", "[nn]") {
  const nn::PackedBatch b = nn::make_packed_batch({{5, 6}, {}, {7, 8, 9}});
  CHECK(b.num_tokens() == 5);
  CHECK(b.num_sequences() == 3);
  CHECK(b.max_seqlen == 3);
  CHECK(b.cu_seqlens_host == std::vector<int32_t>{0, 2, 2, 5});
  CHECK(b.cu_seqlens.to_vector<int32_t>() == std::vector<int32_t>{0, 2, 2, 5});
  CHECK(b.tokens.to_vector<int32_t>() == std::vector<int32_t>{5, 6, 7, 8, 9});
  CHECK(b.positions.to_vector<int32_t>() == std::vector<int32_t>{0, 1, 0, 1, 2});
  CHECK_THROWS_WITH(nn::make_packed_batch({}), ContainsSubstring("no sequences"));
  CHECK_THROWS_WITH(nn::make_packed_batch({{}, {}}), ContainsSubstring("hold no tokens"));
}

TEST_CASE("Qwen3Model: a packed batch gives each sequence's outputs as if run alone", "[nn]") {
  nn::Qwen3Model model = tiny_model();
  nn::Qwen3Model::Context ctx;
  const nn::PackedBatch batch = nn::make_packed_batch(kSequences);
  const auto packed = to_double(model.forward(batch, ctx));
  std::vector<double> alone;
  for (const auto& s : kSequences) {
    nn::Qwen3Model::Context c;
    const auto h = to_double(model.forward(nn::make_packed_batch({s}), c));
    alone.insert(alone.end(), h.begin(), h.end());
  }
  CHECK(rel_error(packed, alone) <= 1e-6);

  // Changing the first sequence changes none of the others' hidden states.
  auto changed = kSequences;
  changed[1][0] = 33;
  nn::Qwen3Model::Context c2;
  const auto h2 = to_double(model.forward(nn::make_packed_batch(changed), c2));
  const std::size_t D = 16, start1 = 1 * D, start2 = 6 * D;
  bool first_differs = false;
  for (std::size_t i = start1; i < start2; ++i) first_differs |= h2[i] != packed[i];
  CHECK(first_differs);
  for (std::size_t i = 0; i < start1; ++i) REQUIRE(h2[i] == packed[i]);
  for (std::size_t i = start2; i < packed.size(); ++i) REQUIRE(h2[i] == packed[i]);
}

TEST_CASE("Qwen3Model: gradients of micro-batches accumulate to the packed batch's", "[nn]") {
  nn::Qwen3Model model = tiny_model();
  const nn::PackedBatch batch = nn::make_packed_batch(kSequences);
  std::vector<int32_t> all_targets;
  std::vector<Tensor> seq_targets;
  for (const auto& s : kSequences) {
    std::vector<int32_t> t(s.begin() + 1, s.end());
    t.push_back(int32_t(s.size()) % 40);
    all_targets.insert(all_targets.end(), t.begin(), t.end());
    seq_targets.push_back(Tensor::from_vector(t, {int64_t(t.size())}));
  }
  const Tensor targets = Tensor::from_vector(all_targets, {int64_t(all_targets.size())});

  nn::zero_grad(model);
  const double packed_loss = model.loss_and_backward(batch, targets).loss;
  std::vector<std::vector<double>> packed_grads;
  model.for_each_parameter([&](nn::Parameter& p) { packed_grads.push_back(to_double(p.grad)); });

  nn::zero_grad(model);
  double sum = 0;
  for (std::size_t i = 0; i < kSequences.size(); ++i)
    sum +=
        model.loss_and_backward(nn::make_packed_batch({kSequences[i]}), seq_targets[i], 1.f, double(batch.num_tokens()))
            .loss;
  CHECK(std::abs(sum - packed_loss) <= 1e-6 * std::abs(packed_loss));
  std::size_t k = 0;
  model.for_each_parameter([&](nn::Parameter& p) {
    INFO(p.name);
    CHECK(rel_error(to_double(p.grad), packed_grads[k++]) <= 1e-5);
  });

  // zero_grad resets every gradient to 0.
  nn::zero_grad(model);
  model.for_each_parameter([&](nn::Parameter& p) {
    for (double v : to_double(p.grad)) REQUIRE(v == 0);
  });
}

TEST_CASE("Qwen3Model parameters carry Hugging Face names in state_dict order", "[nn]") {
  nn::Qwen3Model model = tiny_model();
  std::vector<std::string> names;
  model.for_each_parameter([&](nn::Parameter& p) { names.push_back(p.name); });
  std::vector<std::string> want = {"model.embed_tokens.weight"};
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char* s : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                          "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                          "input_layernorm", "post_attention_layernorm"})
      want.push_back(p + s + ".weight");
  }
  want.push_back("model.norm.weight");
  want.push_back("lm_head.weight");
  CHECK(names == want);
  // V*D + L * (Hq*d*D + 2*Hkv*d*D + D*Hq*d + 2d + 3*D*F + 2D) + D + V*D
  const int64_t V = 40, D = 16, F = 24, q = 32, kv = 16, d = 8;
  CHECK(nn::num_parameters(model) == V * D + 2 * (q * D + 2 * kv * D + D * q + 2 * d + 3 * D * F + 2 * D) + D + V * D);

  nn::Qwen3Model tied = tiny_model(true);
  std::vector<std::string> tied_names;
  tied.for_each_parameter([&](nn::Parameter& p) { tied_names.push_back(p.name); });
  want.pop_back();
  CHECK(tied_names == want);
  CHECK(&tied.lm_head() == &tied.embed_tokens().weight);
  CHECK(model.lm_head().name == "lm_head.weight");
}

TEST_CASE("Qwen3Model init_random: seeded normal projections, unit norms", "[nn]") {
  nn::Qwen3Model a(tiny_config(), {}), b(tiny_config(), {}), c(tiny_config(), {});
  a.init_random(42);
  b.init_random(42);
  c.init_random(43);
  auto pa = parameters_of(a), pb = parameters_of(b), pc = parameters_of(c);
  double sumsq = 0;
  int64_t n = 0;
  for (std::size_t i = 0; i < pa.size(); ++i) {
    INFO(pa[i].first);
    CHECK(bitwise_equal(pa[i].second, pb[i].second));
    const auto v = to_double(pa[i].second);
    if (pa[i].first.ends_with("norm.weight")) {
      for (double x : v) REQUIRE(x == 1.0);
    } else {
      CHECK_FALSE(bitwise_equal(pa[i].second, pc[i].second));
      for (double x : v) sumsq += x * x;
      n += int64_t(v.size());
    }
  }
  CHECK(std::abs(std::sqrt(sumsq / double(n)) - 0.02) < 0.001);
  // Two projections of one model hold different values (distinct offsets).
  CHECK_FALSE(bitwise_equal(a.layers()[0].mlp.gate_proj.weight.value, a.layers()[0].mlp.up_proj.weight.value));
}

TEST_CASE("Qwen3Model rejects bad configs, unsupported dtypes and bad inputs", "[nn]") {
  nn::Qwen3Config c = tiny_config();
  c.num_attention_heads = 3;  // not a multiple of num_key_value_heads = 2
  CHECK_THROWS_WITH(nn::Qwen3Model(c, {}), ContainsSubstring("not a multiple of num_key_value_heads"));

  nn::AttentionConfig a;
  a.hidden_size = 16;
  a.num_heads = 4;
  a.num_kv_heads = 3;
  a.head_dim = 8;
  CHECK_THROWS_WITH(nn::Attention("attn", a, {}), ContainsSubstring("must divide num_heads"));
  a.num_kv_heads = 2;
  a.head_dim = 7;
  CHECK_THROWS_WITH(nn::Attention("attn", a, {}), ContainsSubstring("must be even"));

  CHECK_THROWS_WITH(nn::Qwen3Model(tiny_config(), {Device::cpu(), DType::f16}),
                    ContainsSubstring("dtype must be f32 or bf16"));
  if (cuda_device_count() == 0)  // "built without CUDA" or "does not exist"
    CHECK_THROWS_AS(nn::Qwen3Model(tiny_config(), {Device::cuda(0), DType::bf16}), slime::Error);
  if (cuda_device_count() > 0)
    CHECK_THROWS_WITH(nn::Qwen3Model(tiny_config(), {Device::cuda(0), DType::f32}), ContainsSubstring("must be bf16"));

  nn::Qwen3Model model = tiny_model();
  nn::Qwen3Model::Context ctx;
  CHECK_THROWS_WITH(model.forward(nn::make_packed_batch({{1, 2, 40}}), ctx), ContainsSubstring("outside [0, 40)"));
  const Tensor hidden = model.forward(nn::make_packed_batch({{1, 2, 3}}), ctx);
  const Tensor targets = Tensor::from_vector(std::vector<int32_t>{1, 2}, {2});
  CHECK_THROWS_WITH(model.token_logprobs(hidden, targets), ContainsSubstring("targets must have shape"));
  const Tensor wrong = Tensor::zeros({3, 8}, DType::f32);
  CHECK_THROWS_WITH(model.logits(wrong), ContainsSubstring("must have last extent 16"));
  nn::Qwen3Model::Context empty;
  CHECK_THROWS_WITH(model.backward(empty, hidden), ContainsSubstring("was forward called"));
}

TEST_CASE("save_hf then load_hf gives identical parameters and a config Qwen3Config parses", "[nn][checkpoint]") {
  for (bool tied : {false, true}) {
    DYNAMIC_SECTION((tied ? "tied" : "untied")) {
      TempDir dir(tied ? "roundtrip_tied" : "roundtrip");
      nn::Qwen3Model model = tiny_model(tied, 5);
      nn::save_hf(model, dir.path);
      CHECK(fs::exists(dir.path / "model.safetensors"));
      const nn::Qwen3Config parsed = nn::Qwen3Config::from_file(dir.path / "config.json");
      CHECK(parsed.model_type == "qwen3");
      CHECK(parsed.vocab_size == 40);
      CHECK(parsed.hidden_size == 16);
      CHECK(parsed.num_key_value_heads == 2);
      CHECK(parsed.head_dim == 8);
      CHECK(parsed.rope_theta == 100.0);
      CHECK(parsed.tie_word_embeddings == tied);
      CHECK(parsed.torch_dtype == DType::f32);
      const io::SafetensorsDir files(dir.path);
      CHECK(files.contains("lm_head.weight") == !tied);

      nn::Qwen3Model loaded = nn::load_hf(dir.path);
      auto a = parameters_of(model), b = parameters_of(loaded);
      REQUIRE(a.size() == b.size());
      for (std::size_t i = 0; i < a.size(); ++i) {
        INFO(a[i].first);
        CHECK(a[i].first == b[i].first);
        CHECK(bitwise_equal(a[i].second, b[i].second));
      }
    }
  }
}

TEST_CASE("load_hf converts dtypes, reads sharded checkpoints and writes bf16 ones", "[nn][checkpoint]") {
  TempDir dir("dtypes"), sharded("sharded"), bf16("bf16");
  nn::Qwen3Model model = tiny_model(false, 6);
  nn::save_hf(model, dir.path);
  nn::save_hf(model, sharded.path, /*max_shard_bytes=*/8192);
  CHECK(fs::exists(sharded.path / "model.safetensors.index.json"));
  nn::Qwen3Model from_shards = nn::load_hf(sharded.path);
  auto a = parameters_of(model), s = parameters_of(from_shards);
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(bitwise_equal(a[i].second, s[i].second));

  nn::Qwen3Model half = nn::load_hf(dir.path, Device::cpu(), DType::bf16);
  CHECK(half.dtype() == DType::bf16);
  nn::save_hf(half, bf16.path);
  CHECK(nn::Qwen3Config::from_file(bf16.path / "config.json").torch_dtype == DType::bf16);
  CHECK(io::SafetensorsDir(bf16.path).info("model.norm.weight").dtype == DType::bf16);
  nn::Qwen3Model again = nn::load_hf(bf16.path, Device::cpu(), DType::bf16);
  auto h = parameters_of(half), g = parameters_of(again);
  for (std::size_t i = 0; i < h.size(); ++i) {
    CHECK(bitwise_equal(h[i].second, g[i].second));
    // bf16 rounding of the f32 original: relative error under 2^-8.
    CHECK(rel_error(h[i].second, a[i].second) < 1.0 / 256);
  }
}

TEST_CASE("load_hf names missing, unexpected and misshaped tensors", "[nn][checkpoint]") {
  TempDir dir("errors");
  nn::Qwen3Model model = tiny_model(false, 7);
  nn::save_hf(model, dir.path);
  const fs::path file = dir.path / "model.safetensors";
  auto tensors = parameters_of(model);

  SECTION("missing") {
    auto fewer = tensors;
    fewer.erase(fewer.begin() + 3);  // model.layers.0.self_attn.v_proj.weight
    io::write_safetensors(file, fewer, {{"format", "pt"}});
    CHECK_THROWS_WITH(nn::load_hf(dir.path),
                      ContainsSubstring("missing") && ContainsSubstring("model.layers.0.self_attn.v_proj.weight"));
  }
  SECTION("unexpected") {
    auto more = tensors;
    more.emplace_back("model.layers.0.mlp.experts.0.up_proj.weight", Tensor::zeros({2, 2}, DType::f32));
    io::write_safetensors(file, more, {{"format", "pt"}});
    CHECK_THROWS_WITH(nn::load_hf(dir.path), ContainsSubstring("unexpected") &&
                                                 ContainsSubstring("model.layers.0.mlp.experts.0.up_proj.weight"));
  }
  SECTION("rotary inv_freq buffers are ignored") {
    auto more = tensors;
    more.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", Tensor::zeros({4}, DType::f32));
    more.emplace_back("model.rotary_emb.inv_freq", Tensor::zeros({4}, DType::f32));
    io::write_safetensors(file, more, {{"format", "pt"}});
    CHECK_NOTHROW(nn::load_hf(dir.path));
  }
  SECTION("wrong shape") {
    auto bad = tensors;
    bad[1].second = Tensor::zeros({31, 16}, DType::f32);  // q_proj should be [32, 16]
    io::write_safetensors(file, bad, {{"format", "pt"}});
    CHECK_THROWS_WITH(nn::load_hf(dir.path), ContainsSubstring("model.layers.0.self_attn.q_proj.weight") &&
                                                 ContainsSubstring("(31, 16)") &&
                                                 ContainsSubstring("model.safetensors"));
  }
  SECTION("no config.json") {
    fs::remove(dir.path / "config.json");
    CHECK_THROWS_WITH(nn::load_hf(dir.path), ContainsSubstring("config.json") && ContainsSubstring("cannot open"));
  }
  SECTION("no directory") { CHECK_THROWS_WITH(nn::load_hf(dir.path / "nope"), ContainsSubstring("does not exist")); }
  SECTION("a MoE config over dense weights") {
    nlohmann::json j = model.config().to_json();
    j["model_type"] = "qwen3_moe";
    j["architectures"] = {"Qwen3MoeForCausalLM"};
    j["num_experts"] = 4;
    j["num_experts_per_tok"] = 2;
    j["moe_intermediate_size"] = 8;
    std::ofstream(dir.path / "config.json") << j.dump(2);
    CHECK_THROWS_WITH(nn::load_hf(dir.path), ContainsSubstring("missing") &&
                                                 ContainsSubstring("model.layers.0.mlp.gate.weight") &&
                                                 ContainsSubstring("model.layers.0.mlp.experts.0.gate_proj.weight"));
  }
}

// The batch's host cu_seqlens are checked before anything runs (on a GPU a
// broken one traps in the attention kernel and kills the CUDA context): each
// bad batch is a slime::Error, and the model still runs a good one after it.
TEST_CASE("Qwen3Model::forward refuses a batch with broken cu_seqlens before any launch", "[nn]") {
  nn::Qwen3Model model = tiny_model();
  const auto with_cu = [](std::vector<int32_t> cu, int max_seqlen = 8) {
    nn::PackedBatch b = nn::make_packed_batch({{1, 2, 3}, {4, 5, 6, 7}});
    b.cu_seqlens_host = std::move(cu);
    b.cu_seqlens = Tensor::from_vector(b.cu_seqlens_host, {int64_t(b.cu_seqlens_host.size())});
    b.max_seqlen = max_seqlen;
    return b;
  };
  const auto forward = [&](const nn::PackedBatch& b) {
    nn::Qwen3Model::Context c;
    (void)model.forward(b, c);
  };
  CHECK_THROWS_WITH(forward(with_cu({1, 3, 7})), ContainsSubstring("cu_seqlens[0] must be 0, got 1"));
  CHECK_THROWS_WITH(forward(with_cu({0, 5, 3, 7})), ContainsSubstring("must be non-decreasing"));
  CHECK_THROWS_WITH(forward(with_cu({0, 3, 6})), ContainsSubstring("batch.tokens must be [6]"));
  CHECK_THROWS_WITH(forward(with_cu({0, 3, 7}, 3)), ContainsSubstring("max_seqlen = 3 is shorter"));
  nn::PackedBatch wrong_length = with_cu({0, 3, 7});
  wrong_length.cu_seqlens = Tensor::from_vector(std::vector<int32_t>{0, 7}, {2});
  CHECK_THROWS_WITH(forward(wrong_length), ContainsSubstring("batch.cu_seqlens"));
  CHECK_NOTHROW(forward(with_cu({0, 3, 7})));
}
