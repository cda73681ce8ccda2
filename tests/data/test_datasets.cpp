// Datasets: JSONL samples (every field, round trip, and every kind of bad
// line, each error naming file and line), RL prompt files, uint32 token files
// (round trip, atomic writes, truncated and corrupt files), deterministic
// shuffling by (seed, epoch) and resuming from a saved DataPosition.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "slime/data/prompt_dataset.hpp"
#include "slime/data/sample.hpp"
#include "slime/data/shuffle.hpp"
#include "slime/data/token_file.hpp"

using namespace slime;
using namespace slime::data;
using Catch::Matchers::ContainsSubstring;
namespace fs = std::filesystem;

namespace {

// A fresh directory per test case, removed at the end.
struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path =
        fs::temp_directory_path() / ("slime_test_data_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  fs::path write(const std::string& name, const std::string& text) const {
    std::ofstream(path / name, std::ios::binary) << text;
    return path / name;
  }
};

// The error a JSONL file of `lines` raises (vocab 1000), as what().
std::string jsonl_error(const TempDir& dir, const std::string& text) {
  const fs::path file = dir.write("bad.jsonl", text);
  try {
    (void)read_samples(file, {.vocab_size = 1000});
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("JSONL samples: every field, blank lines, CRLF, and a round trip") {
  TempDir dir;
  const fs::path file = dir.write(
      "samples.jsonl",
      R"({"tokens": [1, 2, 3, 4, 5], "response_length": 2, "reward": 1.5, "rollout_log_probs": [-0.5, -1.25], "group_index": 3, "images": ["a.png"], "metadata": {"source": "math", "id": 7}, "extra": "ignored"})"
      "\n\n"
      R"({"tokens": [151935, 0, 7], "loss_mask": [1, 0]})"
      "\r\n"
      "   \n"
      R"({"tokens": [9], "response_length": 1, "loss_mask": [true]})");
  SampleReader reader(file, {.vocab_size = 151936});
  Sample s;
  REQUIRE(reader.next(s));
  CHECK(reader.line() == 1);
  CHECK(s.tokens == std::vector<int32_t>{1, 2, 3, 4, 5});
  CHECK(s.response_length == 2);
  CHECK(s.prompt_length() == 3);
  CHECK(s.loss_mask == std::vector<uint8_t>{1, 1});
  CHECK(s.reward == 1.5);
  CHECK(s.rollout_log_probs == std::vector<float>{-0.5f, -1.25f});
  CHECK(s.group_index == 3);
  CHECK(s.images == std::vector<std::string>{"a.png"});
  CHECK(s.metadata["source"] == "math");
  const Sample first = s;
  REQUIRE(reader.next(s));
  CHECK(reader.line() == 3);
  CHECK(s.tokens == std::vector<int32_t>{151935, 0, 7});
  CHECK(s.response_length == 2);
  CHECK(s.loss_mask == std::vector<uint8_t>{1, 0});
  CHECK_FALSE(s.reward.has_value());
  CHECK(s.group_index == -1);
  REQUIRE(reader.next(s));
  CHECK(reader.line() == 5);
  CHECK(s.loss_mask == std::vector<uint8_t>{1});
  CHECK_FALSE(reader.next(s));

  // sample_to_json reads back to the same sample.
  const Sample back = sample_from_json(sample_to_json(first), {}, reader.where());
  CHECK(back.tokens == first.tokens);
  CHECK(back.response_length == first.response_length);
  CHECK(back.loss_mask == first.loss_mask);
  CHECK(back.reward == first.reward);
  CHECK(back.rollout_log_probs == first.rollout_log_probs);
  CHECK(back.group_index == first.group_index);
  CHECK(back.images == first.images);
  CHECK(back.metadata == first.metadata);
  CHECK(read_samples(file).size() == 3);
}

TEST_CASE("JSONL samples: bad input names the file, the line and the field") {
  TempDir dir;
  const std::string good = R"({"tokens": [1, 2, 3], "response_length": 1})";
  const std::string where = (dir.path / "bad.jsonl").string();
  auto at = [&](int line) { return ContainsSubstring(where + ":" + std::to_string(line) + ": "); };

  std::string e = jsonl_error(dir, good + "\n" + good + "\n{\"tokens\": [1, 2,\n");
  CHECK_THAT(e, at(3) && ContainsSubstring("malformed JSON"));
  e = jsonl_error(dir, good + "\n[1, 2]\n");
  CHECK_THAT(e, at(2) && ContainsSubstring("expected a JSON object, got array"));
  e = jsonl_error(dir, good + "\n{\"response_length\": 1}\n");
  CHECK_THAT(e, at(2) && ContainsSubstring("missing field 'tokens'"));
  e = jsonl_error(dir, "{\"tokens\": [1, 2]}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("missing field 'response_length' (or 'loss_mask')"));
  e = jsonl_error(dir, "\n\n{\"tokens\": [1, 1000], \"response_length\": 1}\n");
  CHECK_THAT(e, at(3) && ContainsSubstring("field 'tokens'[1] = 1000 is out of the vocabulary [0, 1000)"));
  e = jsonl_error(dir, "{\"tokens\": [-4, 2], \"response_length\": 1}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("field 'tokens'[0] = -4 is out of the vocabulary"));
  e = jsonl_error(dir, "{\"tokens\": [1, 2.5], \"response_length\": 1}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("field 'tokens'[1] must be an integer token id"));
  e = jsonl_error(dir, "{\"tokens\": [], \"response_length\": 1}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("field 'tokens' is empty"));
  e = jsonl_error(dir, "{\"tokens\": \"hello\", \"response_length\": 1}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("field 'tokens' must be an array"));
  e = jsonl_error(dir, good + "\n{\"tokens\": [1, 2], \"response_length\": 0}\n");
  CHECK_THAT(e, at(2) && ContainsSubstring("field 'response_length' = 0 must be in [1, 2]"));
  e = jsonl_error(dir, "{\"tokens\": [1, 2], \"response_length\": -3}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("field 'response_length' = -3 must be in [1, 2]"));
  e = jsonl_error(dir, "{\"tokens\": [1, 2], \"response_length\": 3}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("field 'response_length' = 3 must be in [1, 2]"));
  e = jsonl_error(dir, "{\"tokens\": [1, 2], \"response_length\": \"2\"}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("field 'response_length' must be an integer"));
  e = jsonl_error(dir, "{\"tokens\": [1, 2], \"loss_mask\": []}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("field 'loss_mask' has 0 entries"));
  e = jsonl_error(dir, "{\"tokens\": [1, 2, 3], \"response_length\": 2, \"loss_mask\": [1]}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("field 'loss_mask' has 1 entries but response_length is 2"));
  e = jsonl_error(dir, "{\"tokens\": [1, 2, 3], \"loss_mask\": [1, 2]}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("field 'loss_mask'[1] must be 0 or 1, got 2"));
  e = jsonl_error(dir, "{\"tokens\": [1, 2, 3], \"response_length\": 2, \"rollout_log_probs\": [-1]}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("field 'rollout_log_probs' has 1 entries but response_length is 2"));
  e = jsonl_error(dir, "{\"tokens\": [1, 2], \"response_length\": 1, \"rollout_log_probs\": [null]}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("field 'rollout_log_probs'[0] must be a number"));
  e = jsonl_error(dir, "{\"tokens\": [1, 2], \"response_length\": 1, \"reward\": \"high\"}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("field 'reward' must be a number"));
  e = jsonl_error(dir, "{\"tokens\": [1, 2], \"response_length\": 1, \"group_index\": -2}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("field 'group_index' = -2 must be >= 0"));
  e = jsonl_error(dir, "{\"tokens\": [1, 2], \"response_length\": 1, \"images\": [3]}\n");
  CHECK_THAT(e, at(1) && ContainsSubstring("field 'images'[0] must be a string"));
  // Without a vocabulary, ids must still fit int32.
  const fs::path big = dir.write("big.jsonl", "{\"tokens\": [4294967296], \"response_length\": 1}\n");
  CHECK_THROWS_WITH(read_samples(big), ContainsSubstring("big.jsonl:1: field 'tokens'[0] = 4294967296 is not a valid"));
  CHECK_THROWS_WITH(read_samples(dir.path / "missing.jsonl"), ContainsSubstring("cannot open"));
}

TEST_CASE("prompt datasets: tokens, label and metadata, errors by line, resumable order") {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 10; ++i)
    text += "{\"prompt_tokens\": [" + std::to_string(i + 1) + ", 2], \"label\": \"" + std::to_string(i * i) +
            "\", \"metadata\": {\"i\": " + std::to_string(i) + "}}\n";
  const fs::path file = dir.write("prompts.jsonl", text);
  PromptDataset ds = PromptDataset::from_jsonl(file, /*seed=*/11, {.vocab_size = 100});
  REQUIRE(ds.size() == 10);
  CHECK(ds[3].tokens == std::vector<int32_t>{4, 2});
  CHECK(ds[3].label == "9");
  CHECK(ds[3].metadata["i"] == 3);
  CHECK(ds[3].line == 4);
  CHECK_THROWS(ds[10]);

  const std::vector<int64_t> first = ds.next_batch(4);
  const DataPosition saved = ds.position();
  const std::vector<int64_t> rest = ds.next_batch(15);  // crosses into epoch 1
  CHECK(ds.position() == DataPosition{1, 9});
  PromptDataset resumed = PromptDataset::from_jsonl(file, 11, {.vocab_size = 100});
  resumed.seek(saved);
  CHECK(resumed.next_batch(15) == rest);
  std::vector<int64_t> epoch0 = first;
  epoch0.insert(epoch0.end(), rest.begin(), rest.begin() + 6);
  std::sort(epoch0.begin(), epoch0.end());
  std::vector<int64_t> all(10);
  std::iota(all.begin(), all.end(), 0);
  CHECK(epoch0 == all);

  const fs::path bad = dir.write("bad_prompts.jsonl", text + "{\"prompt_tokens\": [1, 200]}\n");
  CHECK_THROWS_WITH(PromptDataset::from_jsonl(bad, 1, {.vocab_size = 100}),
                    ContainsSubstring("bad_prompts.jsonl:11: field 'prompt_tokens'[1] = 200 is out of the vocabulary"));
  const fs::path missing = dir.write("no_prompt.jsonl", "{\"label\": 3}\n");
  CHECK_THROWS_WITH(PromptDataset::from_jsonl(missing, 1),
                    ContainsSubstring("no_prompt.jsonl:1: missing field 'prompt_tokens'"));
  const fs::path empty = dir.write("empty.jsonl", "\n\n");
  CHECK_THROWS_WITH(PromptDataset::from_jsonl(empty, 1), ContainsSubstring("holds no prompts"));
}

TEST_CASE("token files: round trip, header layout, streaming writer") {
  TempDir dir;
  const fs::path file = dir.path / "train.tok";
  std::vector<uint32_t> tokens(1000);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint32_t(i * 2654435761u % 151936u);
  tokens[7] = 151935;  // above 65535: why the tokens are uint32
  write_token_file(file, tokens);
  CHECK(fs::file_size(file) == 24 + 4 * tokens.size());
  {
    std::ifstream in(file, std::ios::binary);
    char header[24];
    in.read(header, 24);
    CHECK(std::string(header, 8) == std::string("SLMTOK\0\0", 8));
    uint32_t version = 0;
    uint64_t count = 0;
    std::memcpy(&version, header + 8, 4);
    std::memcpy(&count, header + 16, 8);
    CHECK(version == 1);
    CHECK(count == 1000);
  }
  TokenFile tf(file);
  CHECK(tf.size() == 1000);
  CHECK(std::equal(tf.tokens().begin(), tf.tokens().end(), tokens.begin(), tokens.end()));
  CHECK(tf[7] == 151935);
  CHECK(tf.slice(10, 3)[0] == tokens[10]);
  CHECK_THROWS(tf.slice(999, 2));
  tf.check_vocab(151936);
  CHECK_THROWS_WITH(tf.check_vocab(151935), ContainsSubstring("train.tok': token 7 = 151935 is out of the vocabulary"));
  TokenFile moved = std::move(tf);
  CHECK(moved.size() == 1000);

  // Streaming writer: chunks, then one atomic rename; no temp file left.
  const fs::path streamed = dir.path / "streamed.tok";
  {
    TokenFileWriter w(streamed);
    w.append(std::span(tokens).first(300));
    w.append(std::span(tokens).subspan(300));
    CHECK_FALSE(fs::exists(streamed));
    w.commit();
  }
  CHECK(TokenFile(streamed).size() == 1000);
  // A writer dropped before commit leaves neither the file nor its temp.
  {
    TokenFileWriter w(dir.path / "dropped.tok");
    w.append(tokens);
  }
  CHECK_FALSE(fs::exists(dir.path / "dropped.tok"));
  // Overwriting replaces the whole file.
  const std::vector<uint32_t> small{1, 2, 3};
  write_token_file(file, small);
  CHECK(TokenFile(file).size() == 3);
  std::size_t entries = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) entries += e.is_regular_file();
  CHECK(entries == 2);
  // Empty files are valid.
  write_token_file(dir.path / "empty.tok", {});
  CHECK(TokenFile(dir.path / "empty.tok").size() == 0);
}

TEST_CASE("token files: truncated and corrupt files are errors naming the file") {
  TempDir dir;
  const fs::path file = dir.path / "data.tok";
  std::vector<uint32_t> tokens(100, 5);
  write_token_file(file, tokens);
  const std::string name = file.string();

  fs::resize_file(file, 24 + 4 * 100 - 2);
  CHECK_THROWS_WITH(
      TokenFile(file),
      ContainsSubstring("token file '" + name +
                        "' is truncated: the header says 100 tokens (424 bytes) but the file has 422 bytes"));
  fs::resize_file(file, 10);
  CHECK_THROWS_WITH(TokenFile(file),
                    ContainsSubstring("'" + name + "' is truncated: 10 bytes, shorter than the 24-byte header"));
  write_token_file(file, tokens);
  fs::resize_file(file, 24 + 4 * 100 + 4);
  CHECK_THROWS_WITH(TokenFile(file), ContainsSubstring("has 4 bytes after its 100 tokens"));

  write_token_file(file, tokens);
  auto patch = [&](std::streamoff offset, const void* data, std::size_t bytes) {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(offset);
    f.write(static_cast<const char*>(data), std::streamsize(bytes));
  };
  const uint32_t version = 2;
  patch(8, &version, 4);
  CHECK_THROWS_WITH(TokenFile(file), ContainsSubstring("has version 2"));
  patch(0, "NOTATOK!", 8);
  CHECK_THROWS_WITH(TokenFile(file), ContainsSubstring("'" + name + "' is not a slime token file"));
  CHECK_THROWS_WITH(TokenFile(dir.path / "nope.tok"), ContainsSubstring("cannot open token file"));
}

TEST_CASE("shuffling: a permutation per (seed, epoch), deterministic and unbiased") {
  const std::vector<int64_t> a = epoch_permutation(1000, 42, 0);
  std::vector<int64_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> identity(1000);
  std::iota(identity.begin(), identity.end(), 0);
  CHECK(sorted == identity);
  CHECK(a != identity);
  CHECK(epoch_permutation(1000, 42, 0) == a);
  CHECK(epoch_permutation(1000, 42, 1) != a);
  CHECK(epoch_permutation(1000, 43, 0) != a);
  CHECK(epoch_permutation(0, 1, 0).empty());
  CHECK(epoch_permutation(1, 1, 5) == std::vector<int64_t>{0});
  // Pinned values: the order must never change between releases (resumed
  // runs depend on it).
  CHECK(epoch_permutation(8, 1234, 3) == std::vector<int64_t>{2, 5, 3, 1, 0, 7, 4, 6});
  CHECK(epoch_permutation(8, 1234, 4) == std::vector<int64_t>{1, 7, 5, 2, 0, 6, 3, 4});
  // Every item lands on every position about equally often: 6000 epochs of
  // 6 items, 1000 expected per (item, position); 5 sigma is about +-150.
  std::map<std::pair<int64_t, int64_t>, int> counts;
  for (int64_t e = 0; e < 6000; ++e) {
    const std::vector<int64_t> p = epoch_permutation(6, 7, e);
    for (int64_t pos = 0; pos < 6; ++pos) ++counts[{p[std::size_t(pos)], pos}];
  }
  REQUIRE(counts.size() == 36);
  for (const auto& [key, c] : counts) {
    INFO("item " << key.first << " at position " << key.second);
    CHECK(std::abs(c - 1000) < 150);
  }
}

TEST_CASE("shuffling: resuming from a saved DataPosition yields the same remaining sequence") {
  for (bool shuffle : {true, false}) {
    EpochSampler run(37, /*seed=*/99, shuffle);
    (void)run.next_batch(50);  // into epoch 1
    const nlohmann::json saved = run.position().to_json();
    CHECK(saved == nlohmann::json{{"epoch", 1}, {"index", 13}});
    const std::string text = saved.dump();
    const std::vector<int64_t> remaining = run.next_batch(200);

    EpochSampler resumed(37, 99, shuffle);
    resumed.seek(DataPosition::from_json(nlohmann::json::parse(text)));
    CHECK(resumed.next_batch(200) == remaining);
    // Through nlohmann's conversions too.
    EpochSampler again(37, 99, shuffle);
    again.seek(nlohmann::json::parse(text).get<DataPosition>());
    CHECK(again.next_batch(200) == remaining);
  }
  EpochSampler s(10, 1);
  s.seek({2, 10});  // the end of epoch 2 is the start of epoch 3
  CHECK(s.position() == DataPosition{3, 0});
  CHECK(s.next() == epoch_permutation(10, 1, 3)[0]);
  CHECK_THROWS_WITH(s.seek({0, 11}), ContainsSubstring("out of range for 10 items"));
  CHECK_THROWS_WITH(DataPosition::from_json(nlohmann::json{{"epoch", 1}}), ContainsSubstring("missing field 'index'"));
  CHECK_THROWS_WITH(DataPosition::from_json(nlohmann::json{{"epoch", -1}, {"index", 0}}),
                    ContainsSubstring("field 'epoch' must be a non-negative integer"));
  CHECK_THROWS(EpochSampler(0, 1));
}

// Hostile JSONL and token files (issue 21): deep nesting, NUL bytes, overflowing numbers and FIFOs
// end in slime::Error naming the file and line, never a crash, a hang or a silently cut line.
TEST_CASE("hostile JSONL lines are errors naming file:line", "[data]") {
  TempDir dir;
  const std::string deep = std::string(66000, '[') + std::string(66000, ']');
  const fs::path nested =
      dir.write("deep.jsonl", "{\"prompt_tokens\": [1]}\n{\"prompt_tokens\": [1], \"label\": " + deep + "}\n");
  CHECK_THROWS_WITH(PromptDataset::from_jsonl(nested, 1),
                    ContainsSubstring(nested.string() + ":2:") && ContainsSubstring("deeper than 128"));
  const fs::path nul =
      dir.write("nul.jsonl", std::string("{\"tokens\": [1, 2], \"response_length\": 1}") + '\0' + "garbage\n");
  CHECK_THROWS_WITH(read_samples(nul), ContainsSubstring(nul.string() + ":1:") && ContainsSubstring("NUL byte"));
  const fs::path big = dir.write("big.jsonl", "\n{\"tokens\": [1, 2], \"response_length\": 1, \"reward\": 1e999}\n");
  CHECK_THROWS_WITH(read_samples(big), ContainsSubstring(big.string() + ":2:"));
  const fs::path huge_int =
      dir.write("int.jsonl", "{\"tokens\": [1, 2], \"response_length\": 99999999999999999999999}\n");
  CHECK_THROWS_WITH(read_samples(huge_int), ContainsSubstring(huge_int.string() + ":1:"));
}

TEST_CASE("a FIFO as JSONL or token file is refused without blocking", "[data]") {
  ::alarm(60);  // a blocked open() ends the run instead of hanging it
  TempDir dir;
  const fs::path jsonl = dir.path / "prompts.jsonl", tokens = dir.path / "data.u32";
  REQUIRE(::mkfifo(jsonl.c_str(), 0600) == 0);
  REQUIRE(::mkfifo(tokens.c_str(), 0600) == 0);
  CHECK_THROWS_WITH(PromptDataset::from_jsonl(jsonl, 1),
                    ContainsSubstring(jsonl.string()) && ContainsSubstring("FIFO"));
  CHECK_THROWS_WITH(read_samples(jsonl), ContainsSubstring("FIFO"));
  CHECK_THROWS_WITH(TokenFile(tokens), ContainsSubstring(tokens.string()) && ContainsSubstring("FIFO"));
  ::alarm(0);
}
