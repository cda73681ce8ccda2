// Streaming safetensors writer and export_hf_directory: byte-identical files
// to write_safetensors, declaration-order checks, sharding with a correct
// index, atomic replacement of a directory, and errors that leave nothing
// behind.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io_test_util.hpp"
#include "slime/io/safetensors_writer.hpp"

using namespace slime;
using namespace slime::io;
using namespace slime::io::test;
using Catch::Matchers::ContainsSubstring;
namespace fs = std::filesystem;

namespace {

using Named = std::vector<std::pair<std::string, Tensor>>;

Named model_tensors() {
  return {
      {"model.embed_tokens.weight", patterned({37, 16}, DType::bf16, 1)},               // 1184 bytes
      {"model.layers.0.self_attn.q_proj.weight", patterned({16, 16}, DType::bf16, 2)},  // 512
      {"model.layers.0.input_layernorm.weight", patterned({16}, DType::f32, 3)},        // 64
      {"model.layers.0.mlp.up_proj.weight", patterned({24, 16}, DType::bf16, 4)},       // 768
      {"model.norm.weight", patterned({16}, DType::f32, 5)},                            // 64
      {"lm_head.weight", patterned({37, 16}, DType::bf16, 6)},                          // 1184
      {"empty", Tensor::empty({0, 3}, DType::f16)},
  };
}

std::vector<SafetensorsEntry> entries_of(const Named& tensors) {
  std::vector<SafetensorsEntry> out;
  for (const auto& [name, t] : tensors) out.push_back({name, t.dtype(), t.shape()});
  return out;
}

const nlohmann::json kConfig = {
    {"architectures", {"Qwen3ForCausalLM"}}, {"hidden_size", 16}, {"vocab_size", 37}, {"torch_dtype", "bfloat16"}};

bool has_tmp(const fs::path& dir) {
  for (const auto& name : list_dir(dir))
    if (name.find(".tmp") != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("streaming writer produces the bytes write_safetensors does", "[io][safetensors_writer]") {
  TempDir dir;
  const Named tensors = model_tensors();
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  write_safetensors(dir / "a.safetensors", tensors, metadata);
  {
    SafetensorsWriter w(dir / "b.safetensors", entries_of(tensors), metadata);
    CHECK(w.next() == 0);
    for (const auto& [name, t] : tensors) w.write(name, t.clone());  // a fresh copy each time
    CHECK(w.next() == tensors.size());
    CHECK_FALSE(fs::exists(dir / "b.safetensors"));  // not visible before commit
    w.commit();
  }
  CHECK(read_file(dir / "a.safetensors") == read_file(dir / "b.safetensors"));
  const SafetensorsFile f(dir / "b.safetensors");
  for (const auto& [name, t] : tensors) CHECK(same_bytes(f.read(name), t));
  CHECK(list_dir(dir.path) == std::vector<std::string>{"a.safetensors", "b.safetensors"});
}

TEST_CASE("streaming writer checks order, dtype, shape and completeness", "[io][safetensors_writer]") {
  TempDir dir;
  const Named tensors = model_tensors();
  const fs::path path = dir / "x.safetensors";
  const auto expect = [&](auto&& f, std::vector<std::string> parts) {
    try {
      SafetensorsWriter w(path, entries_of(tensors));
      f(w);
      FAIL("expected slime::Error");
    } catch (const Error& e) {
      for (const auto& p : parts) CHECK_THAT(std::string(e.what()), ContainsSubstring(p));
    }
    CHECK(list_dir(dir.path).empty());  // no file, no temporary
  };
  expect([&](SafetensorsWriter& w) { w.write(tensors[1].first, tensors[1].second); },
         {"expected data for tensor 'model.embed_tokens.weight'", "got 'model.layers.0.self_attn.q_proj.weight'"});
  expect(
      [&](SafetensorsWriter& w) {
        w.write(tensors[0].first, patterned({37, 16}, DType::f32, 1));
      },
      {"'model.embed_tokens.weight' was declared bf16 (37, 16)", "f32"});
  expect([&](SafetensorsWriter& w) { w.write(patterned({16, 37}, DType::bf16, 1)); }, {"declared bf16 (37, 16)"});
  expect(
      [&](SafetensorsWriter& w) {
        w.write(tensors[0].second);
        w.commit();
      },
      {"commit after 1 of 7", "next: 'model.layers.0.self_attn.q_proj.weight'"});
  expect(
      [&](SafetensorsWriter& w) {
        for (const auto& [name, t] : tensors) w.write(t);
        w.write(tensors[0].second);
      },
      {"all 7 declared tensors are already written"});
  CHECK_THROWS_WITH(SafetensorsWriter(path, {{"a", DType::f32, {1}}, {"a", DType::f32, {2}}}),
                    ContainsSubstring("duplicate tensor name 'a'"));
}

TEST_CASE("export_hf_directory writes one file below the shard threshold", "[io][safetensors_writer]") {
  TempDir dir;
  const Named tensors = model_tensors();
  write_file(dir / "tokenizer.json", "{\"model\": {}}");
  HfExportOptions options;
  options.copy_files = {dir / "tokenizer.json"};
  const fs::path out = dir / "export";
  export_hf_directory(out, kConfig, tensors, options);

  CHECK(list_dir(out) == std::vector<std::string>{"config.json", "model.safetensors", "tokenizer.json"});
  CHECK(nlohmann::json::parse(read_file(out / "config.json")) == kConfig);
  CHECK(read_file(out / "tokenizer.json") == "{\"model\": {}}");
  // Identical to write_safetensors with the "format": "pt" metadata.
  write_safetensors(dir / "ref.safetensors", tensors, {{"format", "pt"}});
  CHECK(read_file(out / "model.safetensors") == read_file(dir / "ref.safetensors"));
  const SafetensorsDir loaded(out);
  CHECK_FALSE(loaded.sharded());
  CHECK(loaded.size() == tensors.size());
  for (const auto& [name, t] : tensors) CHECK(same_bytes(loaded.read(name), t));
  CHECK_FALSE(has_tmp(dir.path));
}

TEST_CASE("export_hf_directory shards over the threshold with a correct index", "[io][safetensors_writer]") {
  TempDir dir;
  const Named tensors = model_tensors();
  HfExportOptions options;
  options.max_shard_bytes = 1300;  // embed | q_proj, norm, up_proj(over) ... greedy in order
  options.metadata = {{"producer", "slime"}};
  const fs::path out = dir / "export";
  std::vector<std::string> produced;
  export_hf_directory(
      out, kConfig, entries_of(tensors),
      [&](const SafetensorsEntry& e) {
        produced.push_back(e.name);
        for (const auto& [name, t] : tensors)
          if (name == e.name) return t.clone();
        return Tensor();
      },
      options);
  // Called once per tensor, in declaration order.
  std::vector<std::string> names;
  for (const auto& [name, t] : tensors) names.push_back(name);
  CHECK(produced == names);

  // Greedy: [embed 1184] [q 512 + norm 64 ... up 768 overflows -> q, ln] [up 768, norm 64] [lm_head 1184, empty 0]
  const std::vector<std::string> files = {"config.json",
                                          "model-00001-of-00004.safetensors",
                                          "model-00002-of-00004.safetensors",
                                          "model-00003-of-00004.safetensors",
                                          "model-00004-of-00004.safetensors",
                                          "model.safetensors.index.json"};
  CHECK(list_dir(out) == files);
  const nlohmann::json index = nlohmann::json::parse(read_file(out / "model.safetensors.index.json"));
  uint64_t total = 0;
  for (const auto& [name, t] : tensors) total += t.nbytes();
  CHECK(index["metadata"]["total_size"] == total);
  const nlohmann::json expected_map = {
      {"model.embed_tokens.weight", "model-00001-of-00004.safetensors"},
      {"model.layers.0.self_attn.q_proj.weight", "model-00002-of-00004.safetensors"},
      {"model.layers.0.input_layernorm.weight", "model-00002-of-00004.safetensors"},
      {"model.layers.0.mlp.up_proj.weight", "model-00003-of-00004.safetensors"},
      {"model.norm.weight", "model-00003-of-00004.safetensors"},
      {"lm_head.weight", "model-00004-of-00004.safetensors"},
      {"empty", "model-00004-of-00004.safetensors"},
  };
  CHECK(index["weight_map"] == expected_map);
  for (int i = 1; i <= 4; ++i) {
    const SafetensorsFile shard(out / files[std::size_t(i)]);
    CHECK(shard.metadata() == std::map<std::string, std::string>{{"format", "pt"}, {"producer", "slime"}});
    uint64_t bytes = 0;
    for (const auto& name : shard.names()) bytes += shard.info(name).nbytes();
    CHECK((bytes <= options.max_shard_bytes || shard.size() == 1));
  }
  const SafetensorsDir loaded(out);
  CHECK(loaded.sharded());
  CHECK(loaded.size() == tensors.size());
  for (const auto& [name, t] : tensors) CHECK(same_bytes(loaded.read(name), t));
  CHECK_FALSE(has_tmp(dir.path));
}

TEST_CASE("export_hf_directory replaces a directory atomically and leaves it intact on error",
          "[io][safetensors_writer]") {
  TempDir dir;
  const fs::path out = dir / "export";
  const Named first = model_tensors();
  HfExportOptions sharded;
  sharded.max_shard_bytes = 1300;
  export_hf_directory(out, kConfig, first, sharded);
  REQUIRE(SafetensorsDir(out).sharded());

  // A single-file export replaces the sharded one whole: no stale shard or index.
  const Named second = {{"w", patterned({5, 3}, DType::f32, 9)}};
  export_hf_directory(out, {{"hidden_size", 3}}, second);
  CHECK(list_dir(out) == std::vector<std::string>{"config.json", "model.safetensors"});
  CHECK(same_bytes(SafetensorsDir(out).read("w"), second[0].second));

  // A failure midway (the producer throws, or returns the wrong shape)
  // leaves the previous export as it was, and no temporary directory.
  const std::string before = read_file(out / "model.safetensors");
  const auto entries = entries_of(first);
  CHECK_THROWS_WITH(export_hf_directory(out, kConfig, entries,
                                        [&](const SafetensorsEntry& e) -> Tensor {
                                          if (e.name == "model.norm.weight") throw Error("gather failed");
                                          return patterned(e.shape, e.dtype, 1);
                                        }),
                    ContainsSubstring("gather failed"));
  CHECK_THROWS_WITH(
      export_hf_directory(out, kConfig, entries, [&](const SafetensorsEntry& e) { return patterned({1}, e.dtype, 1); }),
      ContainsSubstring("was declared bf16 (37, 16)"));
  CHECK_THROWS_WITH(export_hf_directory(out, nlohmann::json::array(), second),
                    ContainsSubstring("config must be a JSON object"));
  HfExportOptions missing;
  missing.copy_files = {dir / "no_such_tokenizer.json"};
  CHECK_THROWS_WITH(export_hf_directory(out, kConfig, second, missing), ContainsSubstring("no_such_tokenizer.json"));
  CHECK(read_file(out / "model.safetensors") == before);
  CHECK(list_dir(out) == std::vector<std::string>{"config.json", "model.safetensors"});
  CHECK(list_dir(dir.path) == std::vector<std::string>{"export"});
}
