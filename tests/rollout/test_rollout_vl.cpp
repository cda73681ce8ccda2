// The rollout engine with Qwen3-VL models on the CPU: prompts with 0, 1 and
// 2 images of different grids in one generate call, under continuous
// batching; every logprob equals the trainer's recompute (Qwen3VLModel over
// make_vl_batch of prompt + completion) bit for bit, a completion does not
// depend on its batch, bad image requests fail alone.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <vector>

#include "rollout_test_util.hpp"
#include "slime/nn/qwen3_vl.hpp"
#include "slime/rollout/engine.hpp"
#include "slime/rollout/weight_sync.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
using rollout_test::require_same;
using rollout_test::same_bits;

namespace {

constexpr int32_t kImage = 30, kStart = 32, kEnd = 33;

// A tiny Qwen3-VL (the vision tower: patch_dim 2·1·2² = 8, merge 2; MoE:
// layer 0 dense, layer 1 sparse).
nn::Qwen3VLConfig vl_config(bool moe) {
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
  c.text.rope_theta = 100.0;
  c.text.max_position_embeddings = 64;
  c.text.mrope_section = {3, 3, 2};
  if (moe) {
    c.text.num_experts = 4;
    c.text.num_experts_per_tok = 2;
    c.text.moe_intermediate_size = 8;
    c.text.norm_topk_prob = true;
    c.text.mlp_only_layers = {0};
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
  c.image_token_id = kImage;
  c.video_token_id = 31;
  c.vision_start_token_id = kStart;
  c.vision_end_token_id = kEnd;
  c.validate();
  return c;
}

nn::Qwen3VLModel vl_model(bool moe, uint64_t seed = 3) {
  nn::Qwen3VLModel m(vl_config(moe), {});
  m.init_random(seed, 0.3f);  // large weights: peaked, varied distributions
  return m;
}

// Pixel rows of `grids` ([sum t·h·w, 8] f32), deterministic in `salt`.
Tensor pixels_of(const std::vector<nn::GridThw>& grids, int salt) {
  int64_t n = 0;
  for (const auto& g : grids) n += g[0] * g[1] * g[2];
  std::vector<float> v(std::size_t(n * 8));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = float(int((i * 37 + std::size_t(salt) * 101) % 23) - 11) / 8.f;
  return Tensor::from_vector(v, {n, 8});
}

// An image's placeholder: start, its merged patch count of image-pad tokens, end.
void add_image(std::vector<int32_t>& p, const nn::GridThw& g) {
  p.push_back(kStart);
  p.insert(p.end(), std::size_t(g[0] * (g[1] / 2) * (g[2] / 2)), kImage);
  p.push_back(kEnd);
}

rollout::Request request(std::vector<int32_t> text_before, std::vector<nn::GridThw> grids,
                         std::vector<int32_t> text_after, uint64_t id) {
  rollout::Request r;
  r.prompt = std::move(text_before);
  for (std::size_t i = 0; i < grids.size(); ++i) {
    add_image(r.prompt, grids[i]);
    if (i + 1 < grids.size()) r.prompt.push_back(int32_t(3 + i));  // text between the images
  }
  r.prompt.insert(r.prompt.end(), text_after.begin(), text_after.end());
  if (!grids.empty()) r.pixel_values = pixels_of(grids, int(id));
  r.image_grids = std::move(grids);
  r.sample_id = id;
  // A generated image-pad token would be an image placeholder to
  // make_vl_batch (the recompute): it ends the completion instead.
  r.sampling.stop_tokens = {kImage};
  return r;
}

// Prompts with 0, 1 and 2 images of different grids (tall, wide, square,
// two frames) and several sampling settings.
std::vector<rollout::Request> vl_requests() {
  std::vector<rollout::Request> rs;
  rs.push_back(request({5, 7, 9, 11, 2}, {}, {}, 100));
  rs.push_back(request({5, 7}, {{1, 4, 2}}, {9, 11, 2}, 101));
  rs.push_back(request({}, {{1, 2, 4}, {1, 4, 4}}, {8}, 102));
  rs.push_back(request({17}, {}, {}, 103));
  rs.push_back(request({}, {{1, 6, 4}}, {}, 104));
  rs.push_back(request({2}, {{1, 2, 2}, {2, 4, 2}}, {4, 6}, 105));
  rs.push_back(request({1, 2, 3, 4, 5, 6, 7, 8, 9}, {}, {}, 106));
  rs.push_back(request({12, 13}, {{1, 4, 6}}, {14}, 107));
  const float temperature[] = {1.f, 0.7f, 1.f, 0.f, 1.f, 0.7f, 1.f, 1.3f};
  for (std::size_t i = 0; i < rs.size(); ++i) {
    rs[i].sampling.temperature = temperature[i];
    rs[i].sampling.max_new_tokens = int64_t(5 + i);
  }
  rs[2].sampling.top_k = 5;
  rs[4].sampling.top_p = 0.8f;
  rs[5].sampling.top_k = 3;
  rs[5].sampling.top_p = 0.9f;
  return rs;
}

// The trainer's recompute: every prompt + completion (the last token is
// never an input) with its images in one make_vl_batch, Qwen3VLModel::forward,
// token_logprobs at each request's temperature (0: 1); every engine logprob
// must equal it bit for bit. Returns how many were compared.
int64_t check_on_policy(nn::Qwen3VLModel& model, const std::vector<rollout::Request>& requests,
                        const std::vector<rollout::Completion>& out) {
  std::vector<nn::VLSequence> seqs;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    REQUIRE(out[i].finish != rollout::FinishReason::error);
    REQUIRE(!out[i].tokens.empty());
    nn::VLSequence s;
    s.tokens = requests[i].prompt;
    s.tokens.insert(s.tokens.end(), out[i].tokens.begin(), out[i].tokens.end() - 1);
    s.grids = requests[i].image_grids;
    s.pixel_values = requests[i].pixel_values;
    seqs.push_back(std::move(s));
  }
  const nn::VLBatch batch = nn::make_vl_batch(seqs, model.config(), Device::cpu(), DType::f32);
  nn::Qwen3VLModel::Context ctx;
  const Tensor hidden = model.forward(batch, ctx);
  const std::vector<int32_t> targets = rollout_test::next_token_targets(requests, out);
  const Tensor target_tensor = Tensor::from_vector(targets, {int64_t(targets.size())});
  std::map<float, std::vector<float>> by_temperature;
  int64_t compared = 0;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const float t = requests[i].sampling.temperature == 0.f ? 1.f : requests[i].sampling.temperature;
    if (!by_temperature.contains(t))
      by_temperature[t] = model.token_logprobs(hidden, target_tensor, t).logprobs.to_vector<float>();
    const std::vector<float>& v = by_temperature[t];
    const int64_t first = batch.text.cu_seqlens_host[i] + int64_t(requests[i].prompt.size()) - 1;
    for (std::size_t j = 0; j < out[i].tokens.size(); ++j) {
      INFO("request " << i << " token " << j);
      CHECK(same_bits(v[std::size_t(first) + j], out[i].logprobs[j]));
      ++compared;
    }
  }
  return compared;
}

void check_model(bool moe) {
  nn::Qwen3VLModel model = vl_model(moe);
  const auto requests = vl_requests();
  // Three running at once of eight: prefills of image prompts join decodes.
  rollout::Engine engine(model, {.max_batch = 3, .max_context = 40, .kv_capacity = 0, .seed = 11});
  REQUIRE(engine.vl_model() == &model);
  const auto out = engine.generate(requests);
  int64_t tokens = 0;
  for (const auto& o : out) tokens += int64_t(o.tokens.size());
  CHECK(check_on_policy(model, requests, out) == tokens);
  CHECK(tokens > 30);
  // Batch independence: each request alone, all at once, one at a time
  // through a tight KV arena, and in reverse order.
  std::vector<rollout::Completion> alone;
  for (const auto& r : requests) alone.push_back(engine.generate({r})[0]);
  require_same(out, alone);
  rollout::Engine wide(model, {.max_batch = 16, .max_context = 40, .kv_capacity = 0, .seed = 11});
  require_same(out, wide.generate(requests));
  rollout::Engine tight(model, {.max_batch = 4, .max_context = 40, .kv_capacity = 40, .seed = 11});
  require_same(out, tight.generate(requests));
  std::vector<rollout::Request> reversed(requests.rbegin(), requests.rend());
  auto rev = wide.generate(reversed);
  std::reverse(rev.begin(), rev.end());
  require_same(out, rev);
}

}  // namespace

TEST_CASE("VL engine: logprobs equal the trainer's recompute bit for bit, completions do not depend on the batch",
          "[rollout][vl]") {
  check_model(false);
}

TEST_CASE("VL-MoE engine: the same (a dense and a sparse layer)", "[rollout][vl][moe]") { check_model(true); }

TEST_CASE("VL engine: the images matter, text-only prompts run at t = h = w = index", "[rollout][vl]") {
  nn::Qwen3VLModel model = vl_model(false);
  rollout::Engine engine(model, {.max_batch = 4, .max_context = 40, .kv_capacity = 0, .seed = 2});
  auto requests = vl_requests();
  for (auto& r : requests) {
    r.sampling = {};
    r.sampling.temperature = 0.f;
    r.sampling.max_new_tokens = 4;
  }
  const auto out = engine.generate(requests);
  // Other pixels for the same grids: other logprobs.
  auto changed = requests;
  for (auto& r : changed)
    if (!r.image_grids.empty()) r.pixel_values = pixels_of(r.image_grids, 7 + int(r.sample_id));
  const auto other = engine.generate(changed);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    if (requests[i].image_grids.empty()) {
      CHECK(same_bits(out[i].logprobs[0], other[i].logprobs[0]));
    } else {
      CHECK_FALSE(same_bits(out[i].logprobs[0], other[i].logprobs[0]));
    }
  }
  // A text-only prompt on the VL model: greedy = the argmax of the language
  // model's logits at positions 0, 1, 2, ... on every axis.
  const rollout::Request& text = requests[6];
  REQUIRE(text.image_grids.empty());
  std::vector<int32_t> seq = text.prompt;
  for (std::size_t j = 0; j < out[6].tokens.size(); ++j) {
    std::vector<int32_t> pos;
    for (std::size_t t = 0; t < seq.size(); ++t) pos.insert(pos.end(), 3, int32_t(t));
    nn::PackedBatch batch = nn::make_packed_batch({seq});
    batch.positions = Tensor::from_vector(pos, {int64_t(seq.size()), 3});
    nn::Qwen3Model::Context ctx;
    const auto logits = model.logits(model.language().forward(batch, ctx)).to_vector<float>();
    const float* last = logits.data() + (seq.size() - 1) * 40;
    const int32_t argmax = int32_t(std::max_element(last, last + 40) - last);
    CHECK(argmax == out[6].tokens[j]);
    if (argmax == kImage) break;  // a stop token
    seq.push_back(argmax);
  }
}

TEST_CASE("VL engine: bad image requests fail alone with a clear reason", "[rollout][vl]") {
  nn::Qwen3VLModel model = vl_model(false);
  rollout::Engine engine(model, {.max_batch = 2, .max_context = 40, .kv_capacity = 0, .seed = 9});
  auto good = vl_requests();
  good.resize(3);
  const auto alone = engine.generate(good);

  rollout::Request runs = good[1];  // two grids, one image-pad run
  runs.image_grids.push_back({1, 2, 2});
  runs.pixel_values = pixels_of(runs.image_grids, 1);
  rollout::Request length = good[1];  // a run of 2 for a grid of 4 merged patches
  length.image_grids = {{1, 4, 4}};
  length.pixel_values = pixels_of(length.image_grids, 1);
  rollout::Request no_grids = good[1];  // an image-pad run, no images
  no_grids.image_grids.clear();
  no_grids.pixel_values = Tensor{};
  rollout::Request rows = good[1];  // 7 pixel rows for 8 patches
  rows.pixel_values = rows.pixel_values.slice_rows(0, 7).clone();
  rollout::Request pixels_only = good[0];  // pixel rows without images
  pixels_only.pixel_values = pixels_of({{1, 2, 2}}, 1);
  rollout::Request merge = good[1];  // a grid side not divisible by the merge size
  merge.image_grids = {{1, 3, 2}};
  merge.pixel_values = pixels_of(merge.image_grids, 1);
  rollout::Request no_pixels = good[2];
  no_pixels.pixel_values = Tensor{};

  const std::vector<rollout::Request> mixed = {runs, good[0], length,      no_grids,  good[1],
                                               rows, merge,   pixels_only, no_pixels, good[2]};
  const auto out = engine.generate(mixed);
  for (std::size_t i : {0, 2, 3, 5, 6, 7, 8}) {
    INFO("request " << i);
    CHECK(out[i].finish == rollout::FinishReason::error);
    CHECK(out[i].tokens.empty());
  }
  CHECK_THAT(out[0].error, ContainsSubstring("2 images given, the sequence has 1 image-pad runs"));
  CHECK_THAT(out[2].error, ContainsSubstring("needs 4 image-pad tokens, the sequence has 2"));
  CHECK_THAT(out[3].error, ContainsSubstring("more image-pad runs than the 0 images"));
  CHECK_THAT(out[5].error, ContainsSubstring("pixel_values must be f32 [8, 8]"));
  CHECK_THAT(out[6].error, ContainsSubstring("not divisible by the spatial merge size"));
  CHECK_THAT(out[7].error, ContainsSubstring("pixel rows but no images"));
  CHECK_THAT(out[8].error, ContainsSubstring("got none"));
  require_same(alone, {out[1], out[4], out[9]});

  // Images to a text-only engine fail; its text requests run.
  nn::Qwen3Config tc = vl_config(false).text;
  tc.model_type = "qwen3";
  tc.mrope_section = {0, 0, 0};
  nn::Qwen3Model text_model(tc, {});
  text_model.init_random(3, 0.3f);
  rollout::Engine text_engine(text_model, {.max_batch = 2, .max_context = 40, .kv_capacity = 0, .seed = 9});
  CHECK(text_engine.vl_model() == nullptr);
  rollout::Request plain = good[0];
  plain.sampling.stop_tokens.clear();
  const auto t = text_engine.generate({good[1], plain});
  CHECK(t[0].finish == rollout::FinishReason::error);
  CHECK_THAT(t[0].error, ContainsSubstring("the engine's model is text-only"));
  CHECK(t[1].tokens.size() == std::size_t(plain.sampling.max_new_tokens));
}

TEST_CASE("VL engine: colocated weight sync writes the tower and the language model", "[rollout][vl]") {
  nn::Qwen3VLModel trainer = vl_model(false, 3), engine_weights = vl_model(false, 8);
  const auto requests = vl_requests();
  rollout::Engine reference(trainer, {.max_batch = 3, .max_context = 40, .kv_capacity = 0, .seed = 4});
  rollout::Engine engine(engine_weights, {.max_batch = 3, .max_context = 40, .kv_capacity = 0, .seed = 4});
  REQUIRE(rollout::weights_hash(engine) != rollout::weights_hash(trainer));
  const auto st = rollout::sync_colocated(rollout::ModelWeights{&trainer}, engine, 5, {.verify = true});
  CHECK(st.hash == rollout::weights_hash(trainer));
  CHECK(rollout::weights_hash(engine_weights) == rollout::weights_hash(trainer));
  CHECK(engine.weight_version() == 5);
  require_same(reference.generate(requests), engine.generate(requests));
  // A text-only model is no source for a VL engine: the tower is missing.
  nn::Qwen3Config tc = vl_config(false).text;
  tc.model_type = "qwen3";
  tc.mrope_section = {0, 0, 0};
  nn::Qwen3Model text(tc, {});
  text.init_random(1, 0.3f);
  CHECK_THROWS_WITH(rollout::sync_colocated(rollout::ModelWeights{&text}, engine, 6),
                    ContainsSubstring("has no parameter"));
}
