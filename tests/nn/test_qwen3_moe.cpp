// Qwen3-MoE in slime::nn on the CPU: the MoE fields of Qwen3Config and HF's
// sparse-layer rule, the model's layers and parameter names, router logits
// and the load-balancing aux loss (value against a direct evaluation of HF's
// formula, gradients against finite differences), packed batches, and
// Hugging Face checkpoints with per-expert tensors (bit-exact round trips,
// expert slices, missing / unexpected / misshaped experts).
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "nn_test_util.hpp"
#include "slime/nn/checkpoint.hpp"
#include "slime/nn/qwen3.hpp"

using namespace slime;
using namespace nn_test;
using Catch::Matchers::ContainsSubstring;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// 3 layers, layer 1 dense (mlp_only_layers): sparse layers 0 and 2, so the
// aux loss concatenates two layers' router outputs.
nn::Qwen3Config moe_config() {
  nn::Qwen3Config c;
  c.model_type = "qwen3_moe";
  c.vocab_size = 40;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 100.0;
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 8;
  c.norm_topk_prob = true;
  c.mlp_only_layers = {1};
  c.router_aux_loss_coef = 0.1;
  c.output_router_logits = true;
  return c;
}

nn::Qwen3Model moe_model(uint64_t seed = 1, float std = 0.2f) {
  nn::Qwen3Model m(moe_config(), {});
  m.init_random(seed, std);
  return m;
}

void check_identical(nn::Qwen3Model& a, nn::Qwen3Model& b) {
  auto pa = parameters_of(a), pb = parameters_of(b);
  REQUIRE(pa.size() == pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    INFO(pa[i].first);
    CHECK(pa[i].first == pb[i].first);
    CHECK(bitwise_equal(pa[i].second, pb[i].second));
  }
}

Tensor next_token_targets(const std::vector<std::vector<int32_t>>& seqs) {
  std::vector<int32_t> t;
  for (const auto& s : seqs) {
    t.insert(t.end(), s.begin() + 1, s.end());
    t.push_back(int32_t(s.size() * 7) % 40);
  }
  return Tensor::from_vector(t, {int64_t(t.size())});
}

// HF's load_balancing_loss_func evaluated directly in double from router
// logits [T, E] per layer: softmax, top-k, E · Σ_e (count_e / N) · mean p_e
// over the N = L·T rows of all layers together.
double hf_aux_loss(const std::vector<Tensor>& logits, int k) {
  const int64_t E = logits.at(0).size(1);
  std::vector<double> count(std::size_t(E), 0), psum(std::size_t(E), 0);
  int64_t rows = 0;
  for (const Tensor& l : logits) {
    const auto v = to_double(l);
    for (int64_t t = 0; t < l.size(0); ++t, ++rows) {
      std::vector<double> p(v.begin() + t * E, v.begin() + (t + 1) * E);
      const double m = *std::max_element(p.begin(), p.end());
      double z = 0;
      for (double& x : p) z += (x = std::exp(x - m));
      for (double& x : p) x /= z;
      std::vector<int> order(static_cast<std::size_t>(E));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[std::size_t(a)] > p[std::size_t(b)]; });
      for (int j = 0; j < k; ++j) count[std::size_t(order[std::size_t(j)])] += 1;
      for (int64_t e = 0; e < E; ++e) psum[std::size_t(e)] += p[std::size_t(e)];
    }
  }
  double loss = 0;
  for (int64_t e = 0; e < E; ++e)
    loss += (count[std::size_t(e)] / double(rows)) * (psum[std::size_t(e)] / double(rows));
  return double(E) * loss;
}

}  // namespace

TEST_CASE("Qwen3Config reads the MoE fields and picks sparse layers by HF's rule", "[nn][moe][config]") {
  json j = moe_config().to_json();
  CHECK(j["output_router_logits"] == true);
  CHECK(j["router_aux_loss_coef"] == 0.1);
  j.erase("num_experts");
  j["num_local_experts"] = 4;  // transformers 5 writes this spelling
  j["num_hidden_layers"] = 8;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3, 4};
  const nn::Qwen3Config c = nn::Qwen3Config::from_json(j);
  CHECK(c.num_experts == 4);
  CHECK(c.num_experts_per_tok == 2);
  CHECK(c.moe_intermediate_size == 8);
  CHECK(c.norm_topk_prob);
  CHECK(c.output_router_logits);
  CHECK(c.router_aux_loss_coef == 0.1);
  CHECK_FALSE(c.extra.contains("output_router_logits"));
  // (i + 1) % 2 == 0 -> 1, 3, 5, 7; 3 is in mlp_only_layers (4 would not be sparse anyway).
  std::vector<int> sparse;
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    CHECK(c.is_moe_layer(i) == c.is_sparse_layer(i));
    if (c.is_sparse_layer(i)) sparse.push_back(i);
  }
  CHECK(sparse == std::vector<int>{1, 5, 7});
  CHECK(c.num_sparse_layers() == 3);
  CHECK_THROWS_WITH(c.is_sparse_layer(8), ContainsSubstring("layer 8 out of range [0, 8)"));
  CHECK(nn::Qwen3Config::from_json(c.to_json()).output_router_logits);

  // Absent: HF's defaults (output_router_logits false). Dense configs have no experts.
  json d = moe_config().to_json();
  d.erase("output_router_logits");
  CHECK_FALSE(nn::Qwen3Config::from_json(d).output_router_logits);
  nn::Qwen3Config dense = moe_config();
  dense.model_type = "qwen3";
  dense.num_experts = dense.num_experts_per_tok = 0;
  dense.moe_intermediate_size = 0;
  for (int i = 0; i < 3; ++i) CHECK_FALSE(dense.is_sparse_layer(i));
  CHECK(dense.num_sparse_layers() == 0);

  const auto fails = [](const json& bad, const std::string& what) {
    INFO(bad.dump());
    CHECK_THROWS_WITH(nn::Qwen3Config::from_json(bad), ContainsSubstring(what));
  };
  json b = moe_config().to_json();
  b["output_router_logits"] = "yes";
  fails(b, "output_router_logits = \"yes\" is not a boolean");
  b = moe_config().to_json();
  b["num_experts_per_tok"] = 0;
  fails(b, "num_experts_per_tok = 0 must be positive");
  b["num_experts_per_tok"] = 5;
  fails(b, "num_experts_per_tok = 5 exceeds num_experts = 4");
  b = moe_config().to_json();
  b["moe_intermediate_size"] = 0;
  fails(b, "moe_intermediate_size = 0 must be positive");
  b = moe_config().to_json();
  b["router_aux_loss_coef"] = -0.5;
  fails(b, "router_aux_loss_coef = -0.5 must be >= 0");
  b = moe_config().to_json();
  b["decoder_sparse_step"] = -1;
  fails(b, "decoder_sparse_step = -1 must be positive");
  b = moe_config().to_json();
  b["mlp_only_layers"] = {0, 3};
  fails(b, "mlp_only_layers contains 3, outside [0, num_hidden_layers = 3)");
  b = moe_config().to_json();
  b["num_local_experts"] = 8;
  fails(b, "num_experts = 4 and num_local_experts = 8 disagree");
  b = moe_config().to_json();
  b["num_experts"] = 2.5;
  fails(b, "num_experts = 2.5 is not an integer");
}

TEST_CASE("Qwen3Model (MoE): sparse layers hold router and experts under HF names", "[nn][moe]") {
  nn::Qwen3Model model = moe_model();
  CHECK(model.sparse_layers() == std::vector<int>{0, 2});
  CHECK(model.layers()[0].is_sparse());
  CHECK_FALSE(model.layers()[1].is_sparse());
  CHECK(model.layers()[2].is_sparse());

  std::vector<std::string> names;
  std::vector<Shape> shapes;
  model.for_each_parameter([&](nn::Parameter& p) {
    names.push_back(p.name);
    shapes.push_back(p.value.shape());
  });
  std::vector<std::string> want = {"model.embed_tokens.weight"};
  std::vector<Shape> want_shapes = {{40, 16}};
  for (int l = 0; l < 3; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char* s : {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"})
      want.push_back(p + "self_attn." + s + ".weight");
    for (const Shape& s : {Shape{32, 16}, Shape{16, 16}, Shape{16, 16}, Shape{16, 32}, Shape{8}, Shape{8}})
      want_shapes.push_back(s);
    if (l == 1) {
      for (const char* s : {"gate_proj", "up_proj", "down_proj"}) want.push_back(p + "mlp." + s + ".weight");
      for (const Shape& s : {Shape{24, 16}, Shape{24, 16}, Shape{16, 24}}) want_shapes.push_back(s);
    } else {
      for (const char* s :
           {"gate.weight", "experts.{}.gate_proj.weight", "experts.{}.up_proj.weight", "experts.{}.down_proj.weight"})
        want.push_back(p + "mlp." + s);
      for (const Shape& s : {Shape{4, 16}, Shape{4, 8, 16}, Shape{4, 8, 16}, Shape{4, 16, 8}}) want_shapes.push_back(s);
    }
    want.push_back(p + "input_layernorm.weight");
    want.push_back(p + "post_attention_layernorm.weight");
    want_shapes.push_back(Shape{16});
    want_shapes.push_back(Shape{16});
  }
  want.push_back("model.norm.weight");
  want.push_back("lm_head.weight");
  want_shapes.push_back(Shape{16});
  want_shapes.push_back(Shape{40, 16});
  CHECK(names == want);
  CHECK(shapes == want_shapes);
}

TEST_CASE("Qwen3Model (MoE): router logits per sparse layer and HF's aux loss over all of them", "[nn][moe]") {
  nn::Qwen3Model model = moe_model(3);
  const nn::PackedBatch batch = nn::make_packed_batch(kSequences);
  const int64_t T = batch.num_tokens();
  nn::Qwen3Model::Context ctx;
  model.forward(batch, ctx);
  const std::vector<Tensor> logits = model.router_logits(ctx);
  REQUIRE(logits.size() == 2);
  for (const Tensor& l : logits) {
    CHECK(l.shape() == Shape{T, 4});
    CHECK(l.dtype() == DType::f32);
  }
  const nn::AuxLoss aux = model.aux_loss_and_grad(ctx);
  // Over both layers' rows together (not the mean of per-layer losses).
  const double want = hf_aux_loss(logits, 2);
  CHECK(std::abs(aux.value - want) <= 1e-6 * want);
  CHECK(std::abs(aux.value - 0.5 * (hf_aux_loss({logits[0]}, 2) + hf_aux_loss({logits[1]}, 2))) > 1e-4);
  CHECK(aux.scale == 0.1);
  REQUIRE(aux.dlogits.size() == 3);
  CHECK(aux.dlogits[0].shape() == Shape{T, 4});
  CHECK_FALSE(aux.dlogits[1].defined());
  CHECK(aux.dlogits[2].shape() == Shape{T, 4});
  CHECK(model.aux_loss_and_grad(ctx, 2.0).scale == 2.0);
  // The gradient is linear in the scale.
  CHECK(rel_error(to_double(model.aux_loss_and_grad(ctx, 0.2).dlogits[2]), [&] {
          auto v = to_double(aux.dlogits[2]);
          for (double& x : v) x *= 2;
          return v;
        }()) <= 1e-6);

  nn::Qwen3Model::Context empty;
  CHECK_THROWS_WITH(model.aux_loss_and_grad(empty), ContainsSubstring("was forward called"));
  CHECK_THROWS_WITH(model.router_logits(empty), ContainsSubstring("was forward called"));
  const Tensor d = Tensor::zeros({T, 16}, DType::f32);
  nn::AuxLoss wrong;
  wrong.dlogits.resize(2);
  CHECK_THROWS_WITH(model.backward(ctx, d, {}, wrong), ContainsSubstring("aux.dlogits holds 2 tensors"));
}

TEST_CASE("Qwen3Model (MoE): routing is recorded per sparse layer and replayed", "[nn][moe][replay]") {
  nn::Qwen3Model model = moe_model(5);
  const nn::PackedBatch batch = nn::make_packed_batch(kSequences);
  const int64_t T = batch.num_tokens();
  auto same_bits = [](const Tensor& a, const Tensor& b) {
    return a.nbytes() == b.nbytes() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
  };
  nn::Qwen3Model::Context rec;
  rec.record_routing = true;
  const Tensor h = model.forward(batch, rec).clone();
  REQUIRE(rec.routing.size() == 3);
  CHECK_FALSE(rec.routing[1].defined());  // the dense layer
  for (std::size_t l : {std::size_t(0), std::size_t(2)}) {
    REQUIRE(rec.routing[l].shape() == Shape{T, 2});
    CHECK(rec.routing[l].to_vector<int32_t>() == rec.layers[l].moe.indices.to_vector<int32_t>());
  }
  // Replaying the recorded routing gives the same hidden states bit for bit.
  nn::Qwen3Model::Context same;
  same.routing_replay = rec.routing;
  CHECK(same_bits(model.forward(batch, same), h));
  // Other experts (every id + 1 mod 4: a different pair for every token) give
  // other hidden states, and are what a record of that forward holds.
  nn::Qwen3Model::Context other;
  other.routing_replay.resize(3);
  for (std::size_t l : {std::size_t(0), std::size_t(2)}) {
    std::vector<int32_t> ids = rec.routing[l].to_vector<int32_t>();
    for (int32_t& id : ids) id = (id + 1) % 4;
    other.routing_replay[l] = Tensor::from_vector(ids, {T, 2});
  }
  other.record_routing = true;
  const Tensor h_other = model.forward(batch, other);
  CHECK(rel_error(to_double(h_other), to_double(h)) > 1e-3);
  for (std::size_t l : {std::size_t(0), std::size_t(2)})
    CHECK(other.routing[l].to_vector<int32_t>() == other.routing_replay[l].to_vector<int32_t>());
  // The gradient flows through the replayed routing: backward runs and
  // differs from the top-k's.
  const Tensor ones = Tensor::from_vector(std::vector<float>(std::size_t(T * 16), 1.f), {T, 16});
  nn::zero_grad(model);
  model.backward(other, ones);
  const std::vector<double> g_other = to_double(model.layers()[0].moe->gate.grad);
  nn::zero_grad(model);
  model.backward(rec, ones);
  CHECK(rel_error(g_other, to_double(model.layers()[0].moe->gate.grad)) > 1e-3);
  // One tensor per layer, defined for every sparse layer.
  nn::Qwen3Model::Context bad;
  bad.routing_replay = {rec.routing[0], rec.routing[2]};
  CHECK_THROWS_WITH(model.forward(batch, bad), ContainsSubstring("routing_replay holds 2 tensors"));
  bad.routing_replay = {Tensor(), Tensor(), rec.routing[2]};
  CHECK_THROWS_WITH(model.forward(batch, bad), ContainsSubstring("routing_replay[0] is undefined"));
  bad.routing_replay = {Tensor::zeros({T, 3}, DType::i32), Tensor(), rec.routing[2]};
  CHECK_THROWS_WITH(model.forward(batch, bad), ContainsSubstring("replay_indices must be i32"));
}

// Smallest gap between the k-th and (k+1)-th router logit over the tokens of
// every sparse layer of the forward in ctx.
double topk_margin(nn::Qwen3Model& model, const nn::Qwen3Model::Context& ctx, int k) {
  double margin = 1e30;
  for (const Tensor& l : model.router_logits(ctx)) {
    const auto v = to_double(l);
    const int64_t E = l.size(1);
    for (int64_t t = 0; t < l.size(0); ++t) {
      std::vector<double> row(v.begin() + t * E, v.begin() + (t + 1) * E);
      std::sort(row.begin(), row.end(), std::greater<>());
      margin = std::min(margin, row[std::size_t(k - 1)] - row[std::size_t(k)]);
    }
  }
  return margin;
}

TEST_CASE("Qwen3Model (MoE) loss_and_backward with the aux loss matches finite differences", "[nn][moe][fd]") {
  const nn::PackedBatch batch = nn::make_packed_batch(kSequences);
  // A model whose routing no finite-difference step (1e-2 on one weight) can
  // change: routers with larger weights (N(0, 1)), and the first seed whose
  // tokens all have their 2nd and 3rd router logits at least 0.2 apart.
  nn::Qwen3Model model;
  for (uint64_t seed = 5;; ++seed) {
    REQUIRE(seed < 300);
    model = moe_model(seed, 0.3f);
    for (int l : model.sparse_layers())
      fill_normal(model.layers()[std::size_t(l)].moe->gate.value, seed, 1u << 20, 0.f, 1.f);
    nn::Qwen3Model::Context c;
    model.forward(batch, c);
    const double margin = topk_margin(model, c, 2);
    if (margin >= 0.2) {
      std::printf("  MoE FD model: seed %llu, top-2 router margin %.3f\n", (unsigned long long)seed, margin);
      break;
    }
  }
  const Tensor targets = next_token_targets(kSequences);
  const double T = double(batch.num_tokens());

  // Each token's set of experts per sparse layer (the order within the top-k
  // does not change the loss).
  const auto routing = [&](const nn::Qwen3Model::Context& c) {
    std::vector<std::vector<int32_t>> out;
    for (int l : model.sparse_layers()) {
      auto v = c.layers[std::size_t(l)].moe.indices.to_vector<int32_t>();
      for (std::size_t t = 0; t < v.size(); t += 2) std::sort(v.begin() + long(t), v.begin() + long(t) + 2);
      out.push_back(v);
    }
    return out;
  };
  nn::Qwen3Model::Context base;
  model.forward(batch, base);
  const auto routed = routing(base);
  // L = -Σ lp / T + 0.1 · aux, with the routing of the unperturbed model (FD
  // is only meaningful while no token changes experts: checked).
  auto loss = [&] {
    nn::Qwen3Model::Context c;
    const Tensor h = model.forward(batch, c);
    REQUIRE(routing(c) == routed);
    double s = 0;
    for (float v : model.token_logprobs(h, targets).logprobs.to_vector<float>()) s -= v;
    return s / T + 0.1 * model.aux_loss_and_grad(c).value;
  };

  nn::zero_grad(model);
  const nn::LossResult r = model.loss_and_backward(batch, targets);  // output_router_logits: aux included
  CHECK(r.aux_loss > 0);
  CHECK(std::abs(r.loss - loss()) <= 1e-5 * std::abs(r.loss));
  int checked = 0;
  model.for_each_parameter([&](nn::Parameter& p) {
    // The router and experts of both sparse layers, and a dense weight before them.
    if (p.name.find(".mlp.") == std::string::npos && p.name.find("layers.0.self_attn.v_proj") == std::string::npos)
      return;
    const double err = fd_rel_error(p.value, p.grad, loss, 1e-2, sample_indices(p.value.numel(), 12, 7));
    std::printf("  MoE FD %-48s %.2e\n", p.name.c_str(), err);
    INFO(p.name);
    CHECK(err <= 1e-2);
    ++checked;
  });
  CHECK(checked == 12);  // v_proj, 4 × 2 sparse, 3 dense MLP

  // Without the aux loss: the loss drops coef · aux and the gate gradients change.
  std::vector<double> with_aux = to_double(model.layers()[2].moe->gate.grad);
  nn::zero_grad(model);
  const nn::LossResult plain = model.loss_and_backward(batch, targets, 1.f, std::nullopt, {}, /*with_aux_loss=*/false);
  CHECK(plain.aux_loss == 0);
  CHECK(std::abs((r.loss - plain.loss) - 0.1 * r.aux_loss) <= 1e-6 * std::abs(r.loss));
  CHECK(rel_error(to_double(model.layers()[2].moe->gate.grad), with_aux) > 1e-3);
}

TEST_CASE("Qwen3Model (MoE): a packed batch gives each sequence's outputs as if run alone", "[nn][moe]") {
  nn::Qwen3Model model = moe_model(4);
  nn::Qwen3Model::Context ctx;
  const auto packed = to_double(model.forward(nn::make_packed_batch(kSequences), ctx));
  const auto packed_router = to_double(model.router_logits(ctx)[1]);
  std::vector<double> alone, alone_router;
  for (const auto& s : kSequences) {
    nn::Qwen3Model::Context c;
    const auto h = to_double(model.forward(nn::make_packed_batch({s}), c));
    alone.insert(alone.end(), h.begin(), h.end());
    const auto r = to_double(model.router_logits(c)[1]);
    alone_router.insert(alone_router.end(), r.begin(), r.end());
  }
  CHECK(rel_error(packed, alone) <= 1e-6);
  CHECK(rel_error(packed_router, alone_router) <= 1e-6);
}

TEST_CASE("save_hf / load_hf (MoE): one tensor per expert, bit-exact round trips", "[nn][moe][checkpoint]") {
  TempDir dir("moe_roundtrip"), sharded("moe_sharded"), bf16("moe_bf16");
  nn::Qwen3Model model = moe_model(6);
  nn::save_hf(model, dir.path);
  const io::SafetensorsDir files(dir.path);
  for (const auto& name : files.names()) CHECK(name.find("{}") == std::string::npos);
  CHECK(files.info("model.layers.0.mlp.gate.weight").dims == std::vector<int64_t>{4, 16});
  for (int l : {0, 2})
    for (int e = 0; e < 4; ++e) {
      const std::string p = "model.layers." + std::to_string(l) + ".mlp.experts." + std::to_string(e) + ".";
      INFO(p);
      CHECK(files.info(p + "gate_proj.weight").dims == std::vector<int64_t>{8, 16});
      CHECK(files.info(p + "up_proj.weight").dims == std::vector<int64_t>{8, 16});
      CHECK(files.info(p + "down_proj.weight").dims == std::vector<int64_t>{16, 8});
    }
  CHECK_FALSE(files.contains("model.layers.0.mlp.experts.4.up_proj.weight"));
  CHECK(files.contains("model.layers.1.mlp.up_proj.weight"));
  // Expert 2's up_proj in the file is entry 2 of the stack.
  const Tensor entry = model.layers()[2].moe->up_proj.value.slice_rows(2, 1).reshape({8, 16});
  CHECK(bitwise_equal(files.file_of("model.layers.2.mlp.experts.2.up_proj.weight")
                          .read("model.layers.2.mlp.experts.2.up_proj.weight", DType::f32),
                      entry));

  const nn::Qwen3Config parsed = nn::Qwen3Config::from_file(dir.path / "config.json");
  CHECK(parsed.model_type == "qwen3_moe");
  CHECK(parsed.num_experts == 4);
  CHECK(parsed.mlp_only_layers == std::vector<int>{1});
  CHECK(parsed.output_router_logits);

  nn::Qwen3Model loaded = nn::load_hf(dir.path);
  check_identical(model, loaded);
  nn::save_hf(model, sharded.path, /*max_shard_bytes=*/4096);
  CHECK(fs::exists(sharded.path / "model.safetensors.index.json"));
  nn::Qwen3Model from_shards = nn::load_hf(sharded.path);
  check_identical(model, from_shards);

  nn::Qwen3Model half = nn::load_hf(dir.path, Device::cpu(), DType::bf16);
  nn::save_hf(half, bf16.path);
  CHECK(io::SafetensorsDir(bf16.path).info("model.layers.0.mlp.experts.3.down_proj.weight").dtype == DType::bf16);
  nn::Qwen3Model again = nn::load_hf(bf16.path, Device::cpu(), DType::bf16);
  check_identical(half, again);
}

TEST_CASE("load_hf (MoE): a model holding an expert slice loads only its experts", "[nn][moe][checkpoint]") {
  TempDir dir("moe_slice");
  nn::Qwen3Model full = moe_model(8);
  nn::save_hf(full, dir.path);
  // What an expert-parallel rank of degree 2 holds: experts [2, 4).
  nn::Qwen3Model rank1(moe_config(), {});
  rank1.for_each_parameter([](nn::Parameter& p) {
    if (!p.is_expert_stack()) return;
    Shape s = p.value.shape();
    s[0] = 2;
    p.value = Tensor::zeros(s, DType::f32);
    p.first_expert = 2;
  });
  nn::load_hf_weights(rank1, dir.path);
  auto a = parameters_of(full), b = parameters_of(rank1);
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].first);
    const Tensor want = a[i].first.find("{}") == std::string::npos ? a[i].second : a[i].second.slice_rows(2, 2);
    CHECK(bitwise_equal(b[i].second, want));
  }
  TempDir out("moe_slice_save");
  CHECK_THROWS_WITH(nn::save_hf(rank1, out.path),
                    ContainsSubstring("holds experts [2, 4) of 4") && ContainsSubstring("gather the experts"));
}

TEST_CASE("load_hf (MoE) names missing, unexpected and misshaped experts", "[nn][moe][checkpoint]") {
  TempDir dir("moe_errors");
  nn::Qwen3Model model = moe_model(9);
  nn::save_hf(model, dir.path);
  const fs::path file = dir.path / "model.safetensors";
  const io::SafetensorsDir files(dir.path);
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& name : files.names()) tensors.emplace_back(name, files.file_of(name).read(name, DType::f32));
  const auto find = [&](const std::string& name) {
    return std::find_if(tensors.begin(), tensors.end(), [&](const auto& t) { return t.first == name; });
  };

  SECTION("missing expert") {
    tensors.erase(find("model.layers.2.mlp.experts.3.up_proj.weight"));
    io::write_safetensors(file, tensors, {{"format", "pt"}});
    CHECK_THROWS_WITH(nn::load_hf(dir.path), ContainsSubstring("1 parameter(s) missing") &&
                                                 ContainsSubstring("model.layers.2.mlp.experts.3.up_proj.weight"));
  }
  SECTION("missing router") {
    tensors.erase(find("model.layers.0.mlp.gate.weight"));
    io::write_safetensors(file, tensors, {{"format", "pt"}});
    CHECK_THROWS_WITH(nn::load_hf(dir.path),
                      ContainsSubstring("missing") && ContainsSubstring("model.layers.0.mlp.gate.weight"));
  }
  SECTION("an expert beyond num_experts") {
    tensors.emplace_back("model.layers.0.mlp.experts.4.down_proj.weight", Tensor::zeros({16, 8}, DType::f32));
    io::write_safetensors(file, tensors, {{"format", "pt"}});
    CHECK_THROWS_WITH(nn::load_hf(dir.path), ContainsSubstring("unexpected") && ContainsSubstring("Qwen3-MoE") &&
                                                 ContainsSubstring("model.layers.0.mlp.experts.4.down_proj.weight"));
  }
  SECTION("fused experts (transformers 5's in-memory layout) are not the hub layout") {
    tensors.emplace_back("model.layers.0.mlp.experts.gate_up_proj", Tensor::zeros({4, 16, 16}, DType::f32));
    io::write_safetensors(file, tensors, {{"format", "pt"}});
    CHECK_THROWS_WITH(nn::load_hf(dir.path),
                      ContainsSubstring("unexpected") && ContainsSubstring("model.layers.0.mlp.experts.gate_up_proj"));
  }
  SECTION("misshaped expert") {
    find("model.layers.2.mlp.experts.1.down_proj.weight")->second = Tensor::zeros({8, 16}, DType::f32);
    io::write_safetensors(file, tensors, {{"format", "pt"}});
    CHECK_THROWS_WITH(nn::load_hf(dir.path), ContainsSubstring("model.layers.2.mlp.experts.1.down_proj.weight") &&
                                                 ContainsSubstring("(8, 16)") && ContainsSubstring("(16, 8)"));
  }
  SECTION("a dense checkpoint under a MoE config") {
    nn::Qwen3Config dense = moe_config();
    dense.model_type = "qwen3";
    dense.num_experts = dense.num_experts_per_tok = 0;
    dense.moe_intermediate_size = 0;
    nn::Qwen3Model d(dense, {});
    d.init_random(1);
    TempDir other("moe_dense");
    nn::save_hf(d, other.path);
    fs::copy_file(dir.path / "config.json", other.path / "config.json", fs::copy_options::overwrite_existing);
    CHECK_THROWS_WITH(nn::load_hf(other.path), ContainsSubstring("missing") &&
                                                   ContainsSubstring("model.layers.0.mlp.experts.0.gate_proj.weight"));
  }
}

TEST_CASE("the MoE golden fixture is a Hugging Face directory slime reads", "[nn][moe][checkpoint]") {
  // config.json as transformers 5 writes it (num_local_experts, no architectures).
  const nn::Qwen3Config c = nn::Qwen3Config::from_file(golden_dir("qwen3_moe_tiny") / "config.json");
  CHECK(c.model_type == "qwen3_moe");
  CHECK(c.num_experts == 8);
  CHECK(c.num_experts_per_tok == 2);
  CHECK(c.mlp_only_layers == std::vector<int>{0});
  CHECK(c.output_router_logits);
  CHECK(c.head_dim == 64);
  CHECK_FALSE(c.is_sparse_layer(0));
  CHECK(c.is_sparse_layer(1));
  TempDir dir("moe_golden");
  nn::Qwen3Model model = nn::load_hf(golden_dir("qwen3_moe_tiny"));
  nn::save_hf(model, dir.path);
  nn::Qwen3Model again = nn::load_hf(dir.path);
  check_identical(model, again);
  // The saved file holds the same tensors, bit for bit, as the fixture's.
  const io::SafetensorsDir a(golden_dir("qwen3_moe_tiny")), b(dir.path);
  auto na = a.names(), nb = b.names();
  std::sort(na.begin(), na.end());
  std::sort(nb.begin(), nb.end());
  CHECK(na == nb);
  for (const auto& name : na) {
    INFO(name);
    CHECK(bitwise_equal(a.file_of(name).read(name, DType::f32), b.file_of(name).read(name, DType::f32)));
  }
}

// The modules write their outputs and saved values into buffers of their
// Context (nn::detail::context_buffer): a Context reused for the next step
// allocates nothing once its buffers are large enough (issue 19: a
// steady-state step allocates nothing), and every result equals a fresh
// Context's bit for bit, also for a smaller batch after a larger one (views
// of larger buffers) and for the larger one again.
TEST_CASE("Qwen3Model: a Context reused across steps allocates nothing and equals a fresh one", "[nn][moe][memory]") {
  for (const bool moe : {false, true}) {
    INFO((moe ? "Qwen3-MoE" : "dense Qwen3"));
    nn::Qwen3Config cfg = moe_config();
    if (!moe) {
      cfg.model_type = "qwen3";
      cfg.num_experts = 0;
      cfg.mlp_only_layers.clear();
    }
    nn::Qwen3Model model(cfg, {});
    model.init_random(11, 0.2f);
    const nn::PackedBatch large = nn::make_packed_batch({{3, 9, 27, 1, 12, 5, 6}, {30, 2, 5, 6, 7, 8, 9, 10, 11}});
    const nn::PackedBatch small = nn::make_packed_batch(kSequences);
    // hidden and every parameter gradient of one forward + backward (the
    // gradients zeroed first, d_hidden fixed per batch size).
    struct Result {
      Tensor hidden;
      std::vector<Tensor> grads;
    };
    auto step = [&](const nn::PackedBatch& batch, nn::Qwen3Model::Context& ctx, const Tensor& d_hidden) {
      nn::zero_grad(model);
      Result r;
      r.hidden = model.forward(batch, ctx);
      model.backward(ctx, d_hidden);
      r.hidden = r.hidden.clone();
      model.for_each_parameter([&](nn::Parameter& p) { r.grads.push_back(p.grad.clone()); });
      return r;
    };
    auto same = [](const Result& a, const Result& b) {
      if (!bitwise_equal(a.hidden, b.hidden) || a.grads.size() != b.grads.size()) return false;
      for (std::size_t i = 0; i < a.grads.size(); ++i)
        if (!bitwise_equal(a.grads[i], b.grads[i])) return false;
      return true;
    };
    const Tensor d_large = random_tensor({large.num_tokens(), cfg.hidden_size}, 3);
    const Tensor d_small = random_tensor({small.num_tokens(), cfg.hidden_size}, 4);
    nn::Qwen3Model::Context fresh_large, fresh_small;
    const Result want_large = step(large, fresh_large, d_large);
    const Result want_small = step(small, fresh_small, d_small);

    nn::Qwen3Model::Context ctx;
    CHECK(same(step(large, ctx, d_large), want_large));  // the first step sizes the buffers
    // The steps counted; their results are cloned after the count.
    const auto counted_step = [&](const nn::PackedBatch& batch, nn::Qwen3Model::Context& c, const Tensor& d_hidden,
                                  int64_t& allocations) {
      nn::zero_grad(model);
      const int64_t before = memory_stats(Device::cpu()).allocations;
      const Tensor h = model.forward(batch, c);
      model.backward(c, d_hidden);
      allocations = memory_stats(Device::cpu()).allocations - before;
      Result r;
      r.hidden = h.clone();
      model.for_each_parameter([&](nn::Parameter& p) { r.grads.push_back(p.grad.clone()); });
      return r;
    };
    int64_t allocations = -1;
    CHECK(same(counted_step(large, ctx, d_large, allocations), want_large));
    CHECK(allocations == 0);
    CHECK(same(counted_step(small, ctx, d_small, allocations), want_small));
    CHECK(allocations == 0);
    CHECK(same(counted_step(large, ctx, d_large, allocations), want_large));
    CHECK(allocations == 0);
    // The count sees allocations: a fresh Context's step makes them.
    nn::Qwen3Model::Context other;
    CHECK(same(counted_step(large, other, d_large, allocations), want_large));
    CHECK(allocations > 0);
  }
}
