// Hostile input at the core: slime/core/json.hpp (nesting bound, NUL refusal, bounded excerpts,
// range-checked integers), slime/core/regular_file.hpp (FIFOs refused without blocking), the
// message order of SLIME_CHECK, and Shape's checked element and byte counts.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "slime/core/json.hpp"
#include "slime/core/regular_file.hpp"
#include "slime/core/shape.hpp"
#include "slime/core/tensor.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
namespace fs = std::filesystem;

namespace {

std::string nested(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }

struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path =
        fs::temp_directory_path() / ("slime_core_json_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

}  // namespace

TEST_CASE("parse_json refuses nesting past kJsonMaxDepth, naming the source and offset", "[core]") {
  // 66k levels: nlohmann parses it, but copying or dumping it would overflow the stack.
  const std::string deep = nested(66000);
  CHECK_THROWS_WITH(parse_json(deep, "config 'x.json'"), ContainsSubstring("config 'x.json'") &&
                                                             ContainsSubstring("deeper than 128") &&
                                                             ContainsSubstring("offset 128"));
  // Exactly at the bound parses; brackets inside strings and escaped quotes do not count.
  CHECK(parse_json(nested(kJsonMaxDepth), "s").is_array());
  const std::string in_string = "{\"k\": \"" + std::string(1000, '[') + "\\\"" + std::string(1000, '{') + "\"}";
  CHECK(parse_json(in_string, "s")["k"].get<std::string>().size() == 2001);
  CHECK_THROWS_WITH(parse_json("{\"a\": [1, 2", "index 'i.json'"), ContainsSubstring("index 'i.json' is not valid JSON"));
}

TEST_CASE("parse_json refuses a NUL byte instead of ignoring what follows it", "[core]") {
  const std::string text = std::string("{\"a\": 1}") + '\0' + "{\"b\": 2}";
  CHECK_THROWS_WITH(parse_json(text, "config 'c.json'"),
                    ContainsSubstring("config 'c.json'") && ContainsSubstring("NUL byte at offset 8"));
  // An escaped \u0000 inside a string is legal JSON.
  CHECK(parse_json("{\"a\": \"x\\u0000y\"}", "s")["a"].get<std::string>().size() == 3);
}

TEST_CASE("json_excerpt is bounded in size and depth", "[core]") {
  nlohmann::json big = nlohmann::json::array();
  for (int i = 0; i < 10000; ++i) big.push_back(std::string(100, 'x'));
  CHECK(json_excerpt(big, 80).size() <= 83);
  nlohmann::json deep = parse_json(nested(kJsonMaxDepth), "s");
  const std::string e = json_excerpt(deep, 200);
  CHECK(e.size() <= 203);
  CHECK_THAT(e, ContainsSubstring("[...]"));
  CHECK(json_excerpt(std::string_view("ab\0cd", 5), 4) == "ab?c...");
  CHECK(json_excerpt(nlohmann::json(42)) == "42");
}

TEST_CASE("json_integer converts with the target's range and refuses non-integers, naming the field", "[core]") {
  CHECK(json_integer<uint32_t>(nlohmann::json(151645), "eos_token_id", "config 'c'") == 151645u);
  CHECK(json_integer<int64_t>(nlohmann::json(-5), "f", "s") == -5);
  // 2^32 + 1 would wrap to 1 through a plain cast.
  CHECK_THROWS_WITH(json_integer<uint32_t>(nlohmann::json(4294967297LL), "eos_token_id", "config 'c.json'"),
                    ContainsSubstring("config 'c.json': eos_token_id = 4294967297 is out of range [0, 4294967295]"));
  CHECK_THROWS_WITH(json_integer<int32_t>(nlohmann::json(uint64_t(1) << 63), "f", "s"),
                    ContainsSubstring("out of range"));
  CHECK_THROWS_WITH(json_integer<uint32_t>(nlohmann::json(-1), "f", "s"), ContainsSubstring("out of range"));
  CHECK_THROWS_WITH(json_integer<int32_t>(nlohmann::json(3.7), "label", "p.jsonl:3"),
                    ContainsSubstring("p.jsonl:3: label = 3.7 is not an integer"));
  CHECK_THROWS_WITH(json_integer<int32_t>(nlohmann::json(true), "f", "s"), ContainsSubstring("not an integer"));
  CHECK_THROWS_WITH(json_integer<int32_t>(nlohmann::json("7"), "f", "s"), ContainsSubstring("not an integer"));
}

TEST_CASE("SLIME_CHECK puts the message before the checked condition", "[core]") {
  const auto fails = [](int n) { SLIME_CHECK(n > 0, "n = ", n, " must be positive"); };
  try {
    fails(-1);
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(e.message() == "n = -1 must be positive [check failed: n > 0]");
  }
  const auto bare = [](int n) { SLIME_CHECK(n > 0); };
  try {
    bare(0);
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(e.message() == "check failed: n > 0");
  }
}

TEST_CASE("Shape::numel and nbytes refuse to overflow int64", "[core]") {
  const Shape huge{int64_t(1) << 40, int64_t(1) << 30};
  CHECK_THROWS_WITH(huge.numel(), ContainsSubstring("overflows int64") && ContainsSubstring("1099511627776"));
  const Shape big{int64_t(1) << 62};
  CHECK(big.numel() == int64_t(1) << 62);
  CHECK_THROWS_WITH(big.nbytes(4), ContainsSubstring("number of bytes overflows"));
  // Not a zero-byte allocation that later writes run past.
  CHECK_THROWS_AS(Tensor::empty(huge, DType::f32), Error);
  CHECK_THROWS_AS(Tensor::empty(big, DType::f32), Error);
}

TEST_CASE("a FIFO given as a file is refused without blocking", "[core]") {
  ::alarm(60);  // a blocked open() ends the test run instead of hanging it
  TempDir dir;
  const fs::path fifo = dir.path / "config.json";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THROWS_WITH(require_regular_file(fifo, "config"),
                    ContainsSubstring(fifo.string()) && ContainsSubstring("a FIFO, not a regular file"));
  CHECK_THROWS_WITH(open_regular_file(fifo, "config"), ContainsSubstring("a FIFO"));
  CHECK_THROWS_WITH(read_regular_file(fifo, "config"), ContainsSubstring("a FIFO"));
  CHECK_THROWS_WITH(read_regular_file(dir.path, "config"), ContainsSubstring("a directory"));
  CHECK_THROWS_WITH(read_regular_file(dir.path / "missing", "config"), ContainsSubstring("cannot open config"));
  { std::ofstream(dir.path / "ok") << "{}"; }
  CHECK(read_regular_file(dir.path / "ok", "config") == "{}");
  ::alarm(0);
}
