// The whole Qwen3-VL model (nn/qwen3_vl.hpp): against transformers'
// Qwen3VLForConditionalGeneration on the fixture tests/nn/data/qwen3_vl_tiny
// (tools/make_qwen3_vl_golden.py: three samples, one image, two images of
// which one is tall, and text only; logits, logprobs, the loss and the
// gradient of every parameter), Qwen3-VL-MoE on tests/nn/data/qwen3_vl_moe_tiny
// (fused expert layout), HF save/load round trips, finite differences of the
// image-feature path, the config parser and bad inputs.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "nn_test_util.hpp"
#include "slime/nn/qwen3_vl.hpp"
#include "slime/nn/qwen3_vl_checkpoint.hpp"
#include "vl_test_util.hpp"

using namespace slime;
using namespace nn_test;
using Catch::Matchers::ContainsSubstring;

TEST_CASE("Qwen3-VL f32 on the CPU matches transformers: positions, logits, logprobs, loss, every gradient",
          "[nn][golden][vl]") {
  const VlErrors e = run_vl_golden(golden_dir("qwen3_vl_tiny"), DType::f32);
  CHECK(e.logits <= 1e-5);
  CHECK(e.logprobs <= 1e-5);
  CHECK(e.loss <= 1e-5);
  INFO("worst gradient: " << e.worst_grad);
  CHECK(e.grad_max <= 1e-4);
}

TEST_CASE("Qwen3-VL bf16 on the CPU matches transformers within bf16 tolerances", "[nn][golden][vl]") {
  const VlErrors e = run_vl_golden(golden_dir("qwen3_vl_tiny"), DType::bf16, false);
  CHECK(e.logits <= 3e-2);
  CHECK(e.logprobs <= 3e-2);
  CHECK(e.loss <= 3e-2);
  INFO("worst gradient: " << e.worst_grad);
  CHECK(e.grad_max <= 1e-1);
}

TEST_CASE("Qwen3-VL-MoE f32 on the CPU matches transformers (fused experts, a dense mlp_only layer)",
          "[nn][golden][vl][moe]") {
  const VlErrors e = run_vl_golden(golden_dir("qwen3_vl_moe_tiny"), DType::f32);
  CHECK(e.logits <= 1e-5);
  CHECK(e.logprobs <= 1e-5);
  CHECK(e.loss <= 1e-5);
  INFO("worst gradient: " << e.worst_grad);
  CHECK(e.grad_max <= 1e-4);
}

// The fixture's routing is random (no top-k margin, unlike qwen3_moe_tiny's),
// so bf16 rounding flips a few near-tie selections; the router gate's
// gradient feels it most. Measured: logits 2.3e-2, gradients up to 0.111
// (layers.2.mlp.gate.weight). The f32 case above is the exact check.
TEST_CASE("Qwen3-VL-MoE bf16 on the CPU matches transformers within bf16 tolerances", "[nn][golden][vl][moe]") {
  const VlErrors e = run_vl_golden(golden_dir("qwen3_vl_moe_tiny"), DType::bf16, false);
  CHECK(e.logits <= 3e-2);
  CHECK(e.logprobs <= 3e-2);
  INFO("worst gradient: " << e.worst_grad);
  CHECK(e.grad_max <= 0.15);
}

namespace {

std::vector<std::pair<std::string, std::vector<double>>> values_of(nn::Qwen3VLModel& m) {
  std::vector<std::pair<std::string, std::vector<double>>> out;
  m.for_each_parameter([&](nn::Parameter& p) { out.emplace_back(p.name, to_double(p.value)); });
  return out;
}

}  // namespace

TEST_CASE("Qwen3-VL save_hf_vl -> load_hf_vl round trip (dense and MoE), the hub's transposed expert layout loads",
          "[nn][vl][io]") {
  for (const char* name : {"qwen3_vl_tiny", "qwen3_vl_moe_tiny"}) {
    INFO(name);
    nn::Qwen3VLModel a = nn::load_hf_vl(golden_dir(name));
    TempDir dir(std::string("vl_roundtrip_") + name);
    nn::save_hf_vl(a, dir.path);
    nn::Qwen3VLModel b = nn::load_hf_vl(dir.path);
    CHECK(b.config().to_json() == a.config().to_json());
    const auto va = values_of(a), vb = values_of(b);
    REQUIRE(va.size() == vb.size());
    for (std::size_t i = 0; i < va.size(); ++i) {
      INFO(va[i].first);
      CHECK(va[i].first == vb[i].first);
      CHECK(va[i].second == vb[i].second);
    }
    // The file holds the fixture's tensors unchanged (transformers 5's layout).
    const io::SafetensorsDir src(golden_dir(name)), dst(dir.path);
    CHECK(src.names() == dst.names());
    for (const std::string& t : src.names()) {
      INFO(t);
      CHECK(to_double(src.file_of(t).read(t, DType::f32)) == to_double(dst.file_of(t).read(t, DType::f32)));
    }
  }

  // The hub's layout: gate_up_proj [E, hidden, 2I], down_proj [E, I, hidden].
  const std::filesystem::path moe = golden_dir("qwen3_vl_moe_tiny");
  nn::Qwen3VLModel want = nn::load_hf_vl(moe);
  TempDir hub("vl_hub_layout");
  const io::SafetensorsDir files(moe);
  std::vector<std::pair<std::string, Tensor>> tensors;
  int transposed = 0;
  for (const std::string& t : files.names()) {
    Tensor x = files.file_of(t).read(t, DType::f32);
    if (t.ends_with("experts.gate_up_proj") || t.ends_with("experts.down_proj")) {
      const int64_t E = x.size(0), r = x.size(1), c = x.size(2);
      const auto v = x.to_vector<float>();
      std::vector<float> y(v.size());
      for (int64_t e = 0; e < E; ++e)
        for (int64_t i = 0; i < r; ++i)
          for (int64_t j = 0; j < c; ++j) y[std::size_t((e * c + j) * r + i)] = v[std::size_t((e * r + i) * c + j)];
      x = Tensor::from_vector(y, {E, c, r});
      ++transposed;
    }
    tensors.emplace_back(t, x);
  }
  CHECK(transposed == 4);
  io::write_safetensors_dir(hub.path, tensors);
  std::filesystem::copy_file(moe / "config.json", hub.path / "config.json");
  nn::Qwen3VLModel got = nn::load_hf_vl(hub.path);
  const auto vw = values_of(want), vg = values_of(got);
  REQUIRE(vw.size() == vg.size());
  for (std::size_t i = 0; i < vw.size(); ++i) {
    INFO(vw[i].first);
    CHECK(vw[i].second == vg[i].second);
  }
}

namespace {

// A tiny random Qwen3-VL (head_dim 8 in the tower, 16 in the language
// model, MRoPE sections 3/3/2) for finite differences.
nn::Qwen3VLConfig tiny_vl_config(bool moe) {
  nn::Qwen3VLConfig c;
  c.model_type = moe ? "qwen3_vl_moe" : "qwen3_vl";
  c.text.model_type = moe ? "qwen3_vl_moe_text" : "qwen3_vl_text";
  c.text.vocab_size = 40;
  c.text.hidden_size = 16;
  c.text.intermediate_size = 24;
  c.text.num_hidden_layers = 2;
  c.text.num_attention_heads = 2;
  c.text.num_key_value_heads = 1;
  c.text.head_dim = 16;
  c.text.mrope_section = {3, 3, 2};
  if (moe) {
    c.text.num_experts = 3;
    c.text.num_experts_per_tok = 2;
    c.text.moe_intermediate_size = 8;
    c.text.norm_topk_prob = true;
  }
  c.vision.depth = 2;
  c.vision.hidden_size = 16;
  c.vision.intermediate_size = 24;
  c.vision.num_heads = 2;
  c.vision.in_channels = 2;
  c.vision.patch_size = 2;
  c.vision.temporal_patch_size = 1;
  c.vision.spatial_merge_size = 2;
  c.vision.out_hidden_size = 16;
  c.vision.num_position_embeddings = 9;
  c.vision.deepstack_visual_indexes = {1, 0};
  c.image_token_id = 30;
  c.video_token_id = 31;
  c.vision_start_token_id = 32;
  c.vision_end_token_id = 33;
  c.validate();
  return c;
}

// Two sequences: one with a 4x2 image between text, one with a 2x4 image
// first; and a text-only one.
std::vector<nn::VLSequence> tiny_vl_sequences(const nn::Qwen3VLConfig& c, uint64_t seed) {
  std::vector<nn::VLSequence> s(3);
  const int32_t img = c.image_token_id;
  s[0].tokens = {5, 7, c.vision_start_token_id, img, img, c.vision_end_token_id, 9, 11, 2};
  s[0].grids = {{1, 4, 2}};
  s[1].tokens = {c.vision_start_token_id, img, img, c.vision_end_token_id, 4};
  s[1].grids = {{1, 2, 4}};
  s[2].tokens = {3, 1, 4, 1, 5};
  for (std::size_t i = 0; i < 2; ++i) s[i].pixel_values = random_tensor({8, c.vision.patch_dim()}, seed + i);
  return s;
}

}  // namespace

TEST_CASE("Qwen3-VL backward through the image features matches finite differences (dense and MoE)", "[nn][vl]") {
  for (const bool moe : {false, true}) {
    INFO((moe ? "MoE" : "dense"));
    const nn::Qwen3VLConfig c = tiny_vl_config(moe);
    nn::Qwen3VLModel model(c, {});
    uint64_t offset = 0;
    model.for_each_parameter([&](nn::Parameter& p) {
      if (p.init == nn::ParamInit::ones) {
        fill_uniform(p.value, 31, offset, 0.5f, 1.5f);
      } else {
        fill_normal(p.value, 31, offset, 0.f, 0.3f);
      }
      offset += uint64_t(p.value.numel());
    });
    const std::vector<nn::VLSequence> seqs = tiny_vl_sequences(c, 40);
    nn::VLBatch batch = nn::make_vl_batch(seqs, c, Device::cpu(), DType::f32);
    REQUIRE(batch.image_rows.numel() == 4);
    const Tensor targets = Tensor::from_vector(
        std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19}, {19});
    const auto loss = [&]() {
      nn::Qwen3VLModel::Context ctx;
      const Tensor h = model.forward(batch, ctx);
      double s = 0;
      for (float v : model.token_logprobs(h, targets).logprobs.to_vector<float>()) s -= double(v);
      return s;
    };
    nn::zero_grad(model);
    model.loss_and_backward(batch, targets, Tensor{}, 1.f, 1.0);
    constexpr double kStep = 1e-2, kTolerance = 2e-2;
    int checked = 0;
    model.for_each_parameter([&](nn::Parameter& p) {
      // The tower's input side, a deepstack merger, the embedding (whose
      // image rows must get no gradient) and an attention projection.
      const bool pick = p.name.ends_with("patch_embed.proj.weight") || p.name.ends_with("pos_embed.weight") ||
                        p.name.find("deepstack_merger_list.1.linear_fc2") != std::string::npos ||
                        p.name.ends_with("embed_tokens.weight") || p.name.ends_with("layers.1.self_attn.q_proj.weight");
      if (!pick) return;
      INFO(p.name);
      REQUIRE(p.grad.defined());
      const double e = fd_rel_error(p.value, p.grad, loss, kStep, sample_indices(p.value.numel(), 16, 7));
      std::printf("  vl fd %s %s rel error %.2e\n", moe ? "moe" : "dense", p.name.c_str(), e);
      CHECK(e <= kTolerance);
      ++checked;
    });
    CHECK(checked == 6);  // the merger's fc2 weight and bias
    // The image-pad token's embedding row is replaced in every use: no gradient.
    nn::Parameter* embed = nullptr;
    model.for_each_parameter([&](nn::Parameter& p) {
      if (p.name.ends_with("embed_tokens.weight")) embed = &p;
    });
    const auto g = embed->grad.to_vector<float>();
    for (int64_t k = 0; k < c.text.hidden_size; ++k)
      CHECK(g[std::size_t(c.image_token_id * c.text.hidden_size + k)] == 0.f);
  }
}

TEST_CASE("Qwen3-VL: a frozen tower gets no gradient, the language model the same as trained", "[nn][vl]") {
  const nn::Qwen3VLConfig c = tiny_vl_config(false);
  nn::Qwen3VLModel a(c, {}), b(c, {});
  a.init_random(5, 0.3f);
  b.init_random(5, 0.3f);
  b.set_vision_trainable(false);
  const std::vector<nn::VLSequence> seqs = tiny_vl_sequences(c, 50);
  const nn::VLBatch batch = nn::make_vl_batch(seqs, c, Device::cpu(), DType::f32);
  const Tensor targets = Tensor::from_vector(std::vector<int32_t>(19, 3), {19});
  nn::zero_grad(a);
  nn::zero_grad(b);
  const double la = a.loss_and_backward(batch, targets).loss, lb = b.loss_and_backward(batch, targets).loss;
  CHECK(la == lb);
  std::vector<std::pair<std::string, Tensor>> ga, gb;
  a.for_each_parameter([&](nn::Parameter& p) { ga.emplace_back(p.name, p.grad); });
  b.for_each_parameter([&](nn::Parameter& p) { gb.emplace_back(p.name, p.grad); });
  for (std::size_t i = 0; i < ga.size(); ++i) {
    INFO(ga[i].first);
    if (ga[i].first.starts_with("model.visual.")) {
      const auto trained = to_double(ga[i].second), frozen = to_double(gb[i].second);
      CHECK(std::any_of(trained.begin(), trained.end(), [](double v) { return v != 0; }));
      CHECK(std::all_of(frozen.begin(), frozen.end(), [](double v) { return v == 0; }));
    } else {
      CHECK(to_double(ga[i].second) == to_double(gb[i].second));
    }
  }
}

TEST_CASE("Qwen3-VL units: the tower's then the language model's, every parameter once", "[nn][vl]") {
  nn::Qwen3VLModel model(tiny_vl_config(true), {});
  const std::vector<nn::Unit> units = model.units();
  REQUIRE(units.size() == model.num_vision_units() + 4);
  CHECK(units[0].name == "model.visual.patch_embed");
  CHECK(units[3].name == "model.visual.merger");
  CHECK(units[4].name == "model.language_model.embed_tokens");
  CHECK(units.back().name == "model.language_model.norm+lm_head");
  std::set<const nn::Parameter*> seen;
  for (const auto& u : units)
    for (const nn::Parameter* p : u.params) CHECK(seen.insert(p).second);
  int n = 0;
  model.for_each_parameter([&](nn::Parameter& p) {
    ++n;
    CHECK(seen.count(&p) == 1);
  });
  CHECK(int(seen.size()) == n);

  // Hooks: every unit begins and ends once per forward, in order, with or
  // without images; in reverse in backward.
  struct Record {
    std::vector<std::size_t> fwd, bwd;
    void forward_begin(std::size_t u) { fwd.push_back(u); }
    void forward_end(std::size_t) {}
    void backward_begin(std::size_t u) { bwd.push_back(u); }
    void backward_end(std::size_t) {}
  };
  model.init_random(3);
  for (const bool images : {true, false}) {
    std::vector<nn::VLSequence> seqs = tiny_vl_sequences(model.config(), 60);
    if (!images) seqs = {seqs[2]};
    const nn::VLBatch batch = nn::make_vl_batch(seqs, model.config(), Device::cpu(), DType::f32);
    Record r;
    nn::Qwen3VLModel::Context ctx;
    const Tensor h = model.forward(batch, ctx, {}, r);
    model.backward(ctx, Tensor::zeros(h.shape(), DType::f32), {}, r);
    REQUIRE(r.fwd.size() == units.size());
    REQUIRE(r.bwd.size() == units.size());
    for (std::size_t u = 0; u < units.size(); ++u) {
      CHECK(r.fwd[u] == u);
      CHECK(r.bwd[u] == units.size() - 1 - u);
    }
  }
}

TEST_CASE("Qwen3-VL bad inputs and configs give clear errors", "[nn][vl]") {
  const nn::Qwen3VLConfig c = tiny_vl_config(false);
  nn::Qwen3VLModel model(c, {});
  model.init_random(1);
  std::vector<nn::VLSequence> seqs = tiny_vl_sequences(c, 70);

  SECTION("an image-pad run that does not match its grid") {
    seqs[0].tokens.insert(seqs[0].tokens.begin() + 3, c.image_token_id);  // 3 pads for a 2-token image
    CHECK_THROWS_WITH(nn::make_vl_batch(seqs, c, Device::cpu(), DType::f32),
                      ContainsSubstring("sequence 0") && ContainsSubstring("needs 2 image-pad tokens"));
  }
  SECTION("pixel rows that do not match the grids") {
    seqs[1].pixel_values = random_tensor({6, c.vision.patch_dim()}, 1);
    CHECK_THROWS_WITH(nn::make_vl_batch(seqs, c, Device::cpu(), DType::f32),
                      ContainsSubstring("sequence 1: pixel_values must be f32 [8, 8]"));
  }
  SECTION("more images than runs") {
    seqs[2].grids = {{1, 2, 2}};
    seqs[2].pixel_values = random_tensor({4, c.vision.patch_dim()}, 1);
    CHECK_THROWS_WITH(nn::make_vl_batch(seqs, c, Device::cpu(), DType::f32),
                      ContainsSubstring("sequence 2") && ContainsSubstring("1 images given"));
  }
  SECTION("image features into a text-only language model") {
    nn::Qwen3Config text = c.text;
    text.model_type = "qwen3";
    text.mrope_section = {0, 0, 0};
    nn::Qwen3Model plain(text, {});
    plain.init_random(1);
    nn::PackedBatch b = nn::make_packed_batch({{1, 2, 3}});
    nn::Qwen3Model::Context ctx;
    nn::NoHooks none;
    const nn::VisualEmbeds v{Tensor::from_vector(std::vector<int32_t>{1}, {1}), random_tensor({1, 16}, 2), {}};
    CHECK_THROWS_WITH(plain.forward(b, ctx, {}, none, nn::SelfKv{}, v), ContainsSubstring("need a Qwen3-VL"));
  }
  SECTION("text positions into an MRoPE model") {
    nn::VLBatch b = nn::make_vl_batch(seqs, c, Device::cpu(), DType::f32);
    b.text.positions = Tensor::zeros({b.num_tokens()}, DType::i32);
    nn::Qwen3VLModel::Context ctx;
    CHECK_THROWS_WITH(model.forward(b, ctx), ContainsSubstring("MRoPE"));
  }
  SECTION("configs") {
    nlohmann::json j = c.to_json();
    CHECK(nn::Qwen3VLConfig::from_json(j).to_json() == j);
    nlohmann::json bad = j;
    bad["tie_word_embeddings"] = true;
    bad["text_config"]["tie_word_embeddings"] = false;
    CHECK_THROWS_WITH(nn::Qwen3VLConfig::from_json(bad), ContainsSubstring("disagree"));
    bad = j;
    bad["vision_config"]["out_hidden_size"] = 12;
    CHECK_THROWS_WITH(nn::Qwen3VLConfig::from_json(bad), ContainsSubstring("out_hidden_size = 12 must equal"));
    bad = j;
    bad["text_config"]["rope_parameters"]["mrope_interleaved"] = false;
    CHECK_THROWS_WITH(nn::Qwen3VLConfig::from_json(bad), ContainsSubstring("interleaved MRoPE only"));
    bad = j;
    bad["text_config"]["rope_parameters"]["mrope_section"] = {3, 3, 3};
    CHECK_THROWS_WITH(nn::Qwen3VLConfig::from_json(bad), ContainsSubstring("sum to head_dim / 2 = 8"));
    bad = j;
    bad["model_type"] = "qwen2_vl";
    CHECK_THROWS_WITH(nn::Qwen3VLConfig::from_json(bad), ContainsSubstring("not a Qwen3-VL model type"));
    bad = j;
    bad["image_token_id"] = 4000;
    CHECK_THROWS_WITH(nn::Qwen3VLConfig::from_json(bad), ContainsSubstring("image_token_id = 4000 is outside"));
    bad = j;
    bad["text_config"].erase("rope_parameters");
    bad["text_config"].erase("rope_theta");
    CHECK_THROWS_WITH(nn::Qwen3VLConfig::from_json(bad), ContainsSubstring("needs rope_parameters.mrope_section"));
  }
  SECTION("a checkpoint with a missing fused expert tensor") {
    TempDir dir("vl_bad_moe");
    const std::filesystem::path src = golden_dir("qwen3_vl_moe_tiny");
    const io::SafetensorsDir files(src);
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const std::string& t : files.names())
      if (!t.ends_with("layers.2.mlp.experts.down_proj")) tensors.emplace_back(t, files.file_of(t).read(t));
    io::write_safetensors_dir(dir.path, tensors);
    std::filesystem::copy_file(src / "config.json", dir.path / "config.json");
    CHECK_THROWS_WITH(nn::load_hf_vl(dir.path), ContainsSubstring("layers.2.mlp.experts.down_proj"));
  }
}

TEST_CASE("make_vl_batch: a completion's image-pad tokens are text (prompt_length)", "[nn][vl]") {
  const nn::Qwen3VLConfig c = tiny_vl_config(false);
  std::vector<nn::VLSequence> seqs = tiny_vl_sequences(c, 80);
  nn::VLSequence& s = seqs[0];  // 9 prompt tokens with a 2-token image at 3..4
  s.prompt_length = int64_t(s.tokens.size());
  s.tokens.insert(s.tokens.end(), {c.image_token_id, 7, c.image_token_id});  // sampled
  const nn::VLBatch b = nn::make_vl_batch(seqs, c, Device::cpu(), DType::f32);
  const auto rows = b.image_rows.to_vector<int32_t>();
  REQUIRE(rows.size() == 4);  // 2 of sequence 0's prompt, 2 of sequence 1
  CHECK(rows[0] == 3);
  CHECK(rows[1] == 4);
  const auto pos = b.text.positions.to_vector<int32_t>();
  // Prompt: text 0..2, the 4x2 image (merged 2x1) at (3, 3..4, 3), text 5..8:
  // next_position 9, and the completion goes on at 9, 10, 11 on every axis.
  for (int k = 0; k < 3; ++k)
    for (int a = 0; a < 3; ++a) CHECK(pos[std::size_t((9 + k) * 3 + a)] == 9 + k);
  // Without prompt_length the sampled pads are a third image run: an error.
  seqs[0].prompt_length = -1;
  CHECK_THROWS_WITH(nn::make_vl_batch(seqs, c, Device::cpu(), DType::f32), ContainsSubstring("more image-pad runs"));
}
