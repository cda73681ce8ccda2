// Qwen3Config: parsing Hugging Face config.json of Qwen3 dense and MoE models
// (both spellings of renamed fields, transformers' defaults), validation
// errors, to_json -> from_json round trips, and the MoE layer rule.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "slime/nn/config.hpp"

using namespace slime;
using namespace slime::nn;
using Catch::Matchers::ContainsSubstring;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// Qwen/Qwen3-0.6B config.json as published on the Hugging Face hub.
const char* kQwen3_0_6B = R"({
  "architectures": ["Qwen3ForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

// Qwen/Qwen3-30B-A3B config.json as published on the Hugging Face hub.
const char* kQwen3_30B_A3B = R"({
  "architectures": ["Qwen3MoeForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "decoder_sparse_step": 1,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 6144,
  "max_position_embeddings": 40960,
  "max_window_layers": 48,
  "mlp_only_layers": [],
  "model_type": "qwen3_moe",
  "moe_intermediate_size": 768,
  "norm_topk_prob": true,
  "num_attention_heads": 32,
  "num_experts": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 48,
  "num_key_value_heads": 4,
  "output_router_logits": false,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.001,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

json dense() { return json::parse(kQwen3_0_6B); }
json moe() { return json::parse(kQwen3_30B_A3B); }

void check_same(const Qwen3Config& a, const Qwen3Config& b) {
  CHECK(a.model_type == b.model_type);
  CHECK(a.vocab_size == b.vocab_size);
  CHECK(a.hidden_size == b.hidden_size);
  CHECK(a.intermediate_size == b.intermediate_size);
  CHECK(a.num_hidden_layers == b.num_hidden_layers);
  CHECK(a.num_attention_heads == b.num_attention_heads);
  CHECK(a.num_key_value_heads == b.num_key_value_heads);
  CHECK(a.head_dim == b.head_dim);
  CHECK(a.max_position_embeddings == b.max_position_embeddings);
  CHECK(a.rms_norm_eps == b.rms_norm_eps);
  CHECK(a.rope_theta == b.rope_theta);
  CHECK(a.tie_word_embeddings == b.tie_word_embeddings);
  CHECK(a.torch_dtype == b.torch_dtype);
  CHECK(a.attention_bias == b.attention_bias);
  CHECK(a.num_experts == b.num_experts);
  CHECK(a.num_experts_per_tok == b.num_experts_per_tok);
  CHECK(a.moe_intermediate_size == b.moe_intermediate_size);
  CHECK(a.norm_topk_prob == b.norm_topk_prob);
  CHECK(a.decoder_sparse_step == b.decoder_sparse_step);
  CHECK(a.mlp_only_layers == b.mlp_only_layers);
  CHECK(a.router_aux_loss_coef == b.router_aux_loss_coef);
  CHECK(a.extra == b.extra);
}

struct TempFile {
  fs::path path;
  explicit TempFile(const std::string& text) {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("slime_config_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + ".json");
    std::ofstream(path) << text;
  }
  ~TempFile() {
    std::error_code ec;
    fs::remove(path, ec);
  }
};

}  // namespace

TEST_CASE("Qwen3-0.6B config.json", "[io][config]") {
  const Qwen3Config c = Qwen3Config::from_json(dense());
  CHECK(c.model_type == "qwen3");
  CHECK(c.vocab_size == 151936);
  CHECK(c.hidden_size == 1024);
  CHECK(c.intermediate_size == 3072);
  CHECK(c.num_hidden_layers == 28);
  CHECK(c.num_attention_heads == 16);
  CHECK(c.num_key_value_heads == 8);
  CHECK(c.head_dim == 128);
  CHECK(c.max_position_embeddings == 40960);
  CHECK(c.rms_norm_eps == 1e-6);
  CHECK(c.rope_theta == 1e6);
  CHECK(c.tie_word_embeddings);
  CHECK(c.torch_dtype == DType::bf16);
  CHECK_FALSE(c.attention_bias);
  CHECK_FALSE(c.is_moe());
  CHECK(c.num_experts == 0);
  for (int layer = 0; layer < c.num_hidden_layers; ++layer) CHECK_FALSE(c.is_moe_layer(layer));
  // Keys the struct does not model are kept.
  CHECK(c.extra["bos_token_id"] == 151643);
  CHECK(c.extra["eos_token_id"] == 151645);
  CHECK(c.extra["max_window_layers"] == 28);
  CHECK_FALSE(c.extra.contains("hidden_size"));
  CHECK_FALSE(c.extra.contains("rope_scaling"));
}

TEST_CASE("Qwen3-30B-A3B config.json", "[io][config]") {
  const Qwen3Config c = Qwen3Config::from_json(moe());
  CHECK(c.model_type == "qwen3_moe");
  CHECK(c.hidden_size == 2048);
  CHECK(c.intermediate_size == 6144);
  CHECK(c.moe_intermediate_size == 768);
  CHECK(c.num_experts == 128);
  CHECK(c.num_experts_per_tok == 8);
  CHECK(c.num_hidden_layers == 48);
  CHECK(c.num_attention_heads == 32);
  CHECK(c.num_key_value_heads == 4);
  CHECK(c.head_dim == 128);
  CHECK(c.decoder_sparse_step == 1);
  CHECK(c.mlp_only_layers.empty());
  CHECK(c.norm_topk_prob);
  CHECK(c.router_aux_loss_coef == 0.001);
  CHECK_FALSE(c.tie_word_embeddings);
  CHECK(c.rope_theta == 1e6);
  CHECK(c.is_moe());
  for (int layer = 0; layer < c.num_hidden_layers; ++layer) CHECK(c.is_moe_layer(layer));
  CHECK_FALSE(c.output_router_logits);  // a Qwen3Config field now, no longer in extra
}

TEST_CASE("both spellings of renamed fields", "[io][config]") {
  SECTION("num_local_experts for num_experts") {
    json j = moe();
    j.erase("num_experts");
    j["num_local_experts"] = 64;
    CHECK(Qwen3Config::from_json(j).num_experts == 64);
    j["num_experts"] = 64;  // both, agreeing
    CHECK(Qwen3Config::from_json(j).num_experts == 64);
    j["num_experts"] = 32;
    CHECK_THROWS_WITH(Qwen3Config::from_json(j),
                      ContainsSubstring("num_experts = 32 and num_local_experts = 64 disagree"));
  }
  SECTION("dtype for torch_dtype") {
    json j = dense();
    j.erase("torch_dtype");
    j["dtype"] = "float16";
    CHECK(Qwen3Config::from_json(j).torch_dtype == DType::f16);
    j["torch_dtype"] = "float16";
    CHECK(Qwen3Config::from_json(j).torch_dtype == DType::f16);
    j["torch_dtype"] = "bfloat16";
    CHECK_THROWS_WITH(Qwen3Config::from_json(j), ContainsSubstring("torch_dtype = bf16 and dtype = f16 disagree"));
    j.erase("dtype");
    j["torch_dtype"] = "torch.float32";
    CHECK(Qwen3Config::from_json(j).torch_dtype == DType::f32);
    j["torch_dtype"] = "int8";
    CHECK_THROWS_WITH(Qwen3Config::from_json(j), ContainsSubstring("torch_dtype = \"int8\" is not one of"));
  }
  SECTION("rope_parameters (transformers 5) for rope_theta") {
    json j = dense();
    j.erase("rope_theta");
    j.erase("rope_scaling");
    j["rope_parameters"] = {{"rope_theta", 5000000.0}, {"rope_type", "default"}};
    CHECK(Qwen3Config::from_json(j).rope_theta == 5e6);
    j["rope_theta"] = 5000000;
    CHECK(Qwen3Config::from_json(j).rope_theta == 5e6);
    j["rope_theta"] = 1000000;
    CHECK_THROWS_WITH(Qwen3Config::from_json(j),
                      ContainsSubstring("rope_theta = 1e+06 and rope_parameters.rope_theta = 5e+06 disagree"));
  }
  SECTION("rope scaling slime does not implement is refused") {
    json j = dense();
    j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
    CHECK_THROWS_WITH(Qwen3Config::from_json(j), ContainsSubstring("rope_scaling has rope_type 'yarn'"));
    j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
    CHECK_THROWS_WITH(Qwen3Config::from_json(j), ContainsSubstring("rope_type 'linear'"));
    j.erase("rope_scaling");
    j["rope_parameters"] = {{"rope_theta", 1e6}, {"rope_type", "yarn"}};
    CHECK_THROWS_WITH(Qwen3Config::from_json(j), ContainsSubstring("rope_parameters has rope_type 'yarn'"));
  }
}

TEST_CASE("absent fields take transformers' defaults", "[io][config]") {
  SECTION("dense") {
    json j = {{"model_type", "qwen3"},    {"vocab_size", 1000},     {"hidden_size", 256},
              {"intermediate_size", 512}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
              {"num_key_value_heads", 2}};
    const Qwen3Config c = Qwen3Config::from_json(j);
    CHECK(c.head_dim == 128);  // Qwen3Config's default, not hidden_size / heads
    CHECK(c.max_position_embeddings == 32768);
    CHECK(c.rms_norm_eps == 1e-6);
    CHECK(c.rope_theta == 10000.0);
    CHECK_FALSE(c.tie_word_embeddings);
    CHECK_FALSE(c.attention_bias);
    CHECK(c.torch_dtype == DType::f32);
    CHECK(c.num_experts == 0);
    CHECK(c.extra.empty());
    j["num_key_value_heads"] = nullptr;  // null means "as many as attention heads"
    CHECK(Qwen3Config::from_json(j).num_key_value_heads == 4);
    j.erase("num_key_value_heads");  // absent takes the class default, 32
    CHECK_THROWS_WITH(Qwen3Config::from_json(j),
                      ContainsSubstring("num_attention_heads = 4 is not a multiple of num_key_value_heads = 32"));
  }
  SECTION("MoE: missing head_dim is hidden_size / num_attention_heads") {
    json j = moe();
    j.erase("head_dim");
    for (const char* key : {"decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "router_aux_loss_coef",
                            "num_experts_per_tok", "moe_intermediate_size", "tie_word_embeddings"})
      j.erase(key);
    const Qwen3Config c = Qwen3Config::from_json(j);
    CHECK(c.head_dim == 2048 / 32);
    CHECK(c.decoder_sparse_step == 1);
    CHECK(c.mlp_only_layers.empty());
    CHECK_FALSE(c.norm_topk_prob);
    CHECK(c.router_aux_loss_coef == 0.001);
    CHECK(c.num_experts_per_tok == 8);
    CHECK(c.moe_intermediate_size == 768);
    CHECK_FALSE(c.tie_word_embeddings);
  }
  SECTION("model_type inferred when absent") {
    json j = moe();
    j.erase("model_type");
    CHECK(Qwen3Config::from_json(j).model_type == "qwen3_moe");  // from architectures
    j.erase("architectures");
    CHECK(Qwen3Config::from_json(j).model_type == "qwen3_moe");  // from num_experts
    json d = dense();
    d.erase("model_type");
    d.erase("architectures");
    CHECK(Qwen3Config::from_json(d).model_type == "qwen3");
  }
}

TEST_CASE("validation errors name the field and the value", "[io][config]") {
  auto fails = [](const json& j, const std::string& what) {
    INFO(what);
    CHECK_THROWS_WITH(Qwen3Config::from_json(j), ContainsSubstring(what));
  };
  json j = dense();
  j["num_key_value_heads"] = 5;
  fails(j, "num_attention_heads = 16 is not a multiple of num_key_value_heads = 5");
  j = dense();
  j["head_dim"] = 127;
  fails(j, "head_dim = 127 must be even");
  j["head_dim"] = 0;
  fails(j, "head_dim = 0 must be positive");
  j = dense();
  j["hidden_size"] = -1024;
  fails(j, "hidden_size = -1024 must be positive");
  j = dense();
  j["num_hidden_layers"] = 0;
  fails(j, "num_hidden_layers = 0 must be positive");
  j = dense();
  j["vocab_size"] = "151936";
  fails(j, "vocab_size = \"151936\" is not an integer");
  j = dense();
  j["intermediate_size"] = 3072.5;
  fails(j, "intermediate_size = 3072.5 is not an integer");
  j = dense();
  j.erase("hidden_size");
  fails(j, "required field 'hidden_size' is missing");
  j = dense();
  j["tie_word_embeddings"] = 1;
  fails(j, "tie_word_embeddings = 1 is not a boolean");
  j = dense();
  j["rms_norm_eps"] = 0;
  fails(j, "rms_norm_eps = 0 must be > 0");
  j = dense();
  j["model_type"] = "llama";
  fails(j, "model_type = 'llama' is not a Qwen3 model type");
  j = dense();
  j["hidden_act"] = "gelu";
  fails(j, "hidden_act = \"gelu\" is not supported");
  j = dense();
  j["use_sliding_window"] = true;
  fails(j, "use_sliding_window = true is not supported");
  j = dense();
  j["num_experts"] = 8;
  fails(j, "num_experts = 8 but model_type 'qwen3' is dense");
  j = moe();
  j["num_experts_per_tok"] = 129;
  fails(j, "num_experts_per_tok = 129 exceeds num_experts = 128");
  j = moe();
  j["num_experts"] = 0;
  fails(j, "num_experts = 0 must be positive");
  j = moe();
  j["mlp_only_layers"] = {0, 48};
  fails(j, "mlp_only_layers contains 48, outside [0, num_hidden_layers = 48)");
  j["mlp_only_layers"] = {-1};
  fails(j, "mlp_only_layers contains -1");
  j["mlp_only_layers"] = {"3"};
  fails(j, "mlp_only_layers = [\"3\"] holds \"3\", which is not a layer index");
  j = moe();
  j["decoder_sparse_step"] = 0;
  fails(j, "decoder_sparse_step = 0 must be positive");
  fails(json::array(), "config is not a JSON object");

  // validate() on a config built or changed in code.
  Qwen3Config c = Qwen3Config::from_json(dense());
  c.num_key_value_heads = 3;
  CHECK_THROWS_WITH(c.validate(), ContainsSubstring("Qwen3Config: num_attention_heads = 16 is not a multiple of "
                                                    "num_key_value_heads = 3"));
  CHECK_THROWS_WITH(c.to_json(), ContainsSubstring("num_key_value_heads = 3"));
  c.num_key_value_heads = 8;
  c.torch_dtype = DType::i32;
  CHECK_THROWS_WITH(c.validate(), ContainsSubstring("torch_dtype = i32 is not a floating-point dtype"));
}

TEST_CASE("from_file names the file in every error", "[io][config]") {
  TempFile good(kQwen3_30B_A3B);
  const Qwen3Config c = Qwen3Config::from_file(good.path);
  CHECK(c.num_experts == 128);
  CHECK(c.source == good.path.string());

  json j = moe();
  j["num_experts_per_tok"] = 300;
  TempFile invalid(j.dump());
  CHECK_THROWS_WITH(Qwen3Config::from_file(invalid.path),
                    ContainsSubstring("config '" + invalid.path.string() + "'") &&
                        ContainsSubstring("num_experts_per_tok = 300 exceeds num_experts = 128"));
  TempFile garbage("{\"hidden_size\": ");
  CHECK_THROWS_WITH(Qwen3Config::from_file(garbage.path),
                    ContainsSubstring(garbage.path.string()) && ContainsSubstring("not valid JSON"));
  const fs::path missing = fs::temp_directory_path() / "slime_no_such_config.json";
  CHECK_THROWS_WITH(Qwen3Config::from_file(missing),
                    ContainsSubstring(missing.string()) && ContainsSubstring("cannot open"));
  // Errors raised after loading still name the file.
  Qwen3Config loaded = Qwen3Config::from_file(good.path);
  loaded.head_dim = 3;
  CHECK_THROWS_WITH(loaded.validate(),
                    ContainsSubstring("config '" + good.path.string() + "'") && ContainsSubstring("head_dim = 3"));
  CHECK_THROWS_WITH(loaded.is_moe_layer(48),
                    ContainsSubstring(good.path.string()) && ContainsSubstring("layer 48 out of range [0, 48)"));
}

TEST_CASE("to_json writes what transformers reads and round-trips", "[io][config]") {
  for (const char* text : {kQwen3_0_6B, kQwen3_30B_A3B}) {
    const Qwen3Config c = Qwen3Config::from_json(json::parse(text));
    const json out = c.to_json();
    INFO(out.dump(2));
    const bool is_moe = c.model_type == "qwen3_moe";
    CHECK(out["architectures"] == json::array({is_moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"}));
    CHECK(out["model_type"] == c.model_type);
    CHECK(out["rope_theta"] == 1e6);
    CHECK(out["rope_parameters"] == json({{"rope_theta", 1e6}, {"rope_type", "default"}}));
    CHECK(out["torch_dtype"] == "bfloat16");
    CHECK(out["dtype"] == "bfloat16");
    CHECK(out["head_dim"] == 128);
    CHECK(out["hidden_act"] == "silu");
    CHECK(out["bos_token_id"] == 151643);  // from extra
    CHECK(out.contains("num_experts") == is_moe);
    CHECK_FALSE(out.contains("num_local_experts"));
    if (is_moe) {
      CHECK(out["num_experts"] == 128);
      CHECK(out["mlp_only_layers"] == json::array());
      CHECK(out["norm_topk_prob"] == true);
    }
    // Every field of the original survives (values compared as numbers).
    const json original = json::parse(text);
    for (auto& [key, value] : original.items()) {
      INFO(key);
      if (key == "rope_scaling") continue;  // null: written as rope_parameters
      REQUIRE(out.contains(key));
      if (value.is_number())
        CHECK(out[key].get<double>() == value.get<double>());
      else
        CHECK(out[key] == value);
    }
    check_same(Qwen3Config::from_json(out), c);
  }

  // A config built in code, with non-default MoE layout.
  Qwen3Config c;
  c.model_type = "qwen3_moe";
  c.vocab_size = 1000;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 6;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 32;
  c.decoder_sparse_step = 2;
  c.mlp_only_layers = {3};
  c.torch_dtype = DType::f16;
  c.rope_theta = 12345.5;
  const Qwen3Config back = Qwen3Config::from_json(c.to_json());
  check_same(back, c);
  CHECK(c.to_json()["torch_dtype"] == "float16");
}

TEST_CASE("is_moe_layer follows Qwen3-MoE's rule", "[io][config]") {
  json j = moe();
  j["num_hidden_layers"] = 8;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3, 5};
  const Qwen3Config c = Qwen3Config::from_json(j);
  // (layer + 1) % 2 == 0 -> layers 1, 3, 5, 7; 3 and 5 are dense.
  std::vector<int> moe_layers;
  for (int layer = 0; layer < c.num_hidden_layers; ++layer)
    if (c.is_moe_layer(layer)) moe_layers.push_back(layer);
  CHECK(moe_layers == std::vector<int>{1, 7});

  j["decoder_sparse_step"] = 1;
  j["mlp_only_layers"] = {0};
  const Qwen3Config d = Qwen3Config::from_json(j);
  CHECK_FALSE(d.is_moe_layer(0));
  for (int layer = 1; layer < 8; ++layer) CHECK(d.is_moe_layer(layer));
  CHECK_THROWS_WITH(d.is_moe_layer(-1), ContainsSubstring("layer -1 out of range [0, 8)"));
  CHECK_THROWS_WITH(d.is_moe_layer(8), ContainsSubstring("layer 8 out of range"));
}
