// Hostile files through the io readers: config.json, safetensors headers, sharded indexes and
// training-state metadata that nest 66k levels deep, hold NUL bytes, are FIFOs, or declare absurd
// sizes. Each must end in slime::Error naming the file (and field), with the process alive.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

#include "io_test_util.hpp"
#include "slime/io/safetensors.hpp"
#include "slime/io/train_state.hpp"
#include "slime/nn/checkpoint.hpp"
#include "slime/nn/config.hpp"

using namespace slime;
using namespace slime::io;
using namespace slime::io::test;
using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::StartsWith;

namespace {

// ~66k '[' (132 KB): parses, but copying or dumping it recurses once per level.
const std::string kDeep = std::string(66000, '[') + std::string(66000, ']');

const char* kConfig = R"({"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8%s})";

std::string config_with(const std::string& extra) {
  std::string s = kConfig;
  return s.replace(s.find("%s"), 2, extra);
}

std::string safetensors_bytes(const std::string& header) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header;
}

}  // namespace

TEST_CASE("deeply nested config.json is an error naming the file, not a stack overflow", "[io]") {
  TempDir dir;
  write_file(dir / "config.json", config_with(", \"eos_token_id\": " + kDeep));
  CHECK_THROWS_WITH(nn::Qwen3Config::from_file(dir / "config.json"),
                    ContainsSubstring((dir / "config.json").string()) && ContainsSubstring("deeper than 128"));
  write_file(dir / "config.json", kDeep);
  CHECK_THROWS_WITH(nn::Qwen3Config::from_file(dir / "config.json"), ContainsSubstring("deeper than 128"));
}

TEST_CASE("a NUL byte in config.json is refused with its offset", "[io]") {
  TempDir dir;
  std::string text = config_with("");
  text.insert(1, 1, '\0');
  write_file(dir / "config.json", text);
  CHECK_THROWS_WITH(nn::Qwen3Config::from_file(dir / "config.json"),
                    ContainsSubstring((dir / "config.json").string()) && ContainsSubstring("NUL byte at offset 1"));
}

TEST_CASE("absurd config sizes fail validation naming the field", "[io]") {
  TempDir dir;
  const auto check = [&](const std::string& key, const std::string& value) {
    std::string text = config_with("");
    const auto at = text.find("\"" + key + "\": ");
    REQUIRE(at != std::string::npos);
    const auto start = at + key.size() + 4, end = text.find_first_of(",}", start);
    text.replace(start, end - start, value);
    write_file(dir / "config.json", text);
    CHECK_THROWS_WITH(nn::Qwen3Config::from_file(dir / "config.json"),
                      ContainsSubstring((dir / "config.json").string()) && ContainsSubstring(key + " = " + value) &&
                          ContainsSubstring("exceeds"));
  };
  check("vocab_size", "1000000000000");
  check("num_hidden_layers", "2147483647");
  check("hidden_size", "4294967296");
  check("num_attention_heads", "1000000");
}

TEST_CASE("a FIFO as config.json or safetensors file is refused without blocking", "[io]") {
  ::alarm(60);  // a blocked open() ends the run instead of hanging it
  TempDir dir;
  REQUIRE(::mkfifo((dir / "config.json").c_str(), 0600) == 0);
  CHECK_THROWS_WITH(nn::Qwen3Config::from_file(dir / "config.json"),
                    ContainsSubstring((dir / "config.json").string()) && ContainsSubstring("FIFO"));
  REQUIRE(::mkfifo((dir / "model.safetensors").c_str(), 0600) == 0);
  CHECK_THROWS_WITH(SafetensorsFile(dir / "model.safetensors"),
                    ContainsSubstring((dir / "model.safetensors").string()) && ContainsSubstring("FIFO"));
  CHECK_THROWS_WITH(SafetensorsDir(dir.path), ContainsSubstring("model.safetensors") && ContainsSubstring("FIFO"));
  ::alarm(0);
}

TEST_CASE("a deeply nested safetensors header is an error naming the file", "[io]") {
  TempDir dir;
  write_file(dir / "model.safetensors", safetensors_bytes("{\"__metadata__\": " + kDeep + "}"));
  CHECK_THROWS_WITH(SafetensorsFile(dir / "model.safetensors"),
                    ContainsSubstring((dir / "model.safetensors").string()) && ContainsSubstring("deeper than 128"));
  // A tensor entry that is not an object is quoted in a bounded excerpt, not dumped whole; a
  // 50000-digit number is quoted in a bounded parse error.
  for (const std::string& entry : {"\"" + std::string(50000, 'x') + "\"", std::string(50000, '7')}) {
    write_file(dir / "model.safetensors", safetensors_bytes("{\"t\": [" + entry + "]}"));
    try {
      SafetensorsFile f(dir / "model.safetensors");
      FAIL("no throw");
    } catch (const Error& e) {
      CHECK_THAT(e.what(), ContainsSubstring((dir / "model.safetensors").string()));
      CHECK(std::strlen(e.what()) < 1000);
    }
  }
  std::string nul = safetensors_bytes("{}  ");
  nul[9] = '\0';
  write_file(dir / "model.safetensors", nul);
  CHECK_THROWS_WITH(SafetensorsFile(dir / "model.safetensors"), ContainsSubstring("NUL byte at offset 1"));
}

TEST_CASE("a deeply nested sharded index is an error naming the index", "[io]") {
  TempDir dir;
  write_file(dir / "model.safetensors.index.json", "{\"weight_map\": {}, \"metadata\": " + kDeep + "}");
  CHECK_THROWS_WITH(SafetensorsDir(dir.path),
                    ContainsSubstring("model.safetensors.index.json") && ContainsSubstring("deeper than 128"));
}

TEST_CASE("deeply nested checkpoint metadata is an error naming the checkpoint", "[io]") {
  TempDir dir;
  const auto step = train_state_step_dir(dir.path, 3);
  fs::create_directories(step);
  write_file(step / "metadata.json", "{\"format\": \"x\", \"metadata\": " + kDeep + "}");
  CHECK_THROWS_WITH(TrainStateReader(dir.path, 3),
                    ContainsSubstring("metadata.json") && ContainsSubstring("deeper than 128"));
}

TEST_CASE("checkpoint metadata integers are range-checked, not cast", "[io]") {
  TempDir dir;
  const auto step = train_state_step_dir(dir.path, 3);
  fs::create_directories(step);
  // get<int>() of 1e40 is undefined behaviour; of 2^32 + 1 it is 1.
  for (const std::string& version : {"1e40", "4294967297", "1.5"}) {
    write_file(step / "metadata.json", "{\"format\": \"slime.train_state\", \"version\": " + version + "}");
    CHECK_THROWS_WITH(TrainStateReader(dir.path, 3),
                      ContainsSubstring("metadata.json' is corrupt") && ContainsSubstring("\"version\" is "));
  }
}

TEST_CASE("load errors read the message first, the checked condition last", "[io]") {
  TempDir dir;
  write_file(dir / "config.json", config_with(""));
  write_file(dir / "model.safetensors", safetensors_bytes("{}"));
  try {
    (void)nn::load_hf(dir.path);
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK_THAT(e.message(), StartsWith("load_hf('" + dir.path.string() + "')") &&
                                ContainsSubstring("parameter(s) missing from the checkpoint") &&
                                ContainsSubstring("[check failed: missing.empty()]"));
  }
}
