// slime-logprobs with images: the tool, run on the tiny Qwen3-VL fixture with
// a --jsonl file of prompts and PNG images, prints what Qwen3VLModel gives on
// the same preprocessed, placeholder-expanded input (exactly: the same CPU
// forward, compared as printed); with and without a preprocessor_config.json.
// A text model scores --jsonl as --tokens. Errors name FILE:LINE: bad JSON,
// a missing image, placeholders that do not match the images, images for a
// text model; and a preprocessor config that disagrees with the tower.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <fmt/core.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "slime/data/image.hpp"
#include "slime/data/qwen_vl_image.hpp"
#include "slime/nn/qwen3_vl.hpp"
#include "slime/nn/qwen3_vl_checkpoint.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
namespace fs = std::filesystem;

namespace {

const fs::path kVlModel = SLIME_TEST_VL_MODEL;  // tests/nn/data/qwen3_vl_tiny (no preprocessor config)
const fs::path kVlMoeModel = fs::path(SLIME_TEST_VL_MODEL).parent_path() / "qwen3_vl_moe_tiny";
const fs::path kTextModel = SLIME_TEST_TEXT_MODEL;  // tests/nn/data/qwen3_tiny
const fs::path kImages = SLIME_TEST_IMAGES;         // tests/data/fixtures/images
const std::string kTool = SLIME_LOGPROBS;

// The tiny model's special tokens (its config.json).
constexpr int32_t kImage = 120, kStart = 121, kEnd = 122;

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name)
      : path(fs::temp_directory_path() / ("slime_tools_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

void write(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
}

std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct Run {
  int status = -1;
  std::string out, err;
};

Run run_tool(const fs::path& dir, const std::string& args) {
  const fs::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  const std::string cmd = "'" + kTool + "' " + args + " > '" + out.string() + "' 2> '" + err.string() + "'";
  const int rc = std::system(cmd.c_str());
  Run r;
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  r.out = read(out);
  r.err = read(err);
  return r;
}

// A checkpoint directory: a tiny VL model's files, plus a preprocessor config
// when given.
fs::path vl_checkpoint(const fs::path& dir, const std::string& preprocessor_config = {},
                       const fs::path& source = kVlModel) {
  fs::create_directories(dir);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(source / f, dir / f);
  if (!preprocessor_config.empty()) write(dir / "preprocessor_config.json", preprocessor_config);
  return dir;
}

struct Line {
  std::vector<int32_t> tokens;
  std::vector<fs::path> images;
  int line = 0;  // in the JSONL file
};

// What the tool should print for `lines` (one batch) under the model in
// `dir`: Qwen3VLModel on the same preprocessed input, formatted as the tool
// formats it.
std::string expected_output(const fs::path& dir, const std::vector<Line>& lines, const std::string& file) {
  nn::Qwen3VLModel model = nn::load_hf_vl(dir);
  data::QwenVLImageOptions o;
  if (fs::exists(dir / "preprocessor_config.json")) {
    o = data::read_preprocessor_config(dir);
  } else {
    o.patch_size = model.config().vision.patch_size;
    o.merge_size = model.config().vision.spatial_merge_size;
    o.temporal_patch_size = model.config().vision.temporal_patch_size;
  }
  std::vector<nn::VLSequence> seqs;
  std::vector<int32_t> targets;
  for (const Line& l : lines) {
    data::VisionInput v;
    for (const fs::path& p : l.images) data::append_image(v, data::read_image(p), o);
    nn::VLSequence s;
    s.tokens = data::expand_image_placeholders(l.tokens, v.grid_thw, o.merge_size, {kImage, kStart, kEnd});
    for (const data::GridTHW& g : v.grid_thw) s.grids.push_back({g.t, g.h, g.w});
    if (!s.grids.empty()) s.pixel_values = Tensor::from_vector(v.pixel_values, {v.rows(), v.patch_dim});
    targets.insert(targets.end(), s.tokens.begin() + 1, s.tokens.end());
    targets.push_back(0);
    seqs.push_back(std::move(s));
  }
  const nn::VLBatch batch = nn::make_vl_batch(seqs, model.config(), Device::cpu(), DType::f32);
  nn::Qwen3VLModel::Context ctx;
  const Tensor hidden = model.forward(batch, ctx);
  const ops::TokenLogprobs lp =
      model.token_logprobs(hidden, Tensor::from_vector(targets, {int64_t(targets.size())}), 1.f);
  const std::vector<float> logprobs = lp.logprobs.to_vector<float>(), entropy = lp.entropy.to_vector<float>();
  std::string out;
  std::size_t offset = 0;
  for (std::size_t k = 0; k < seqs.size(); ++k) {
    const std::vector<int32_t>& t = seqs[k].tokens;
    out += fmt::format("# sequence {} ({}:{}, {} tokens)\n", k, file, lines[k].line, t.size());
    for (std::size_t i = 0; i < t.size(); ++i) {
      const std::string logp = i == 0 ? std::string("-") : fmt::format("{:.6f}", logprobs[offset + i - 1]);
      out += fmt::format("{}\t{}\t{}\t{:.6f}\n", i, t[i], logp, entropy[offset + i]);
    }
    offset += t.size();
  }
  return out;
}

// A small preprocessor config for the tiny tower (patch 4, merge 2): images
// of 64 to 2048 pixels, so the fixtures give a few dozen patches.
const std::string kSmallPreprocessor = R"({"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2,
  "size": {"shortest_edge": 64, "longest_edge": 2048}, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]})";

}  // namespace

TEST_CASE("slime-logprobs --jsonl with images equals Qwen3VLModel on the preprocessed input") {
  if (!data::images_supported()) SKIP("built without libpng/libjpeg");
  TempDir tmp("logprobs_vl");
  const fs::path model = vl_checkpoint(tmp.path / "model", kSmallPreprocessor);
  // A relative image path is relative to the JSONL file's directory.
  fs::copy_file(kImages / "rgb.png", tmp.path / "local.png");
  const fs::path jsonl = tmp.path / "in.jsonl";
  const fs::path palette = kImages / "palette.png", rgb = kImages / "rgb.png";
  write(jsonl, fmt::format("{{\"tokens\": [1, 2, 121, 120, 122, 5, 6], \"images\": [\"local.png\"]}}\n"
                           "\n"
                           "{{\"tokens\": [121, 120, 122, 7, 121, 120, 122, 8, 9], \"images\": [\"{}\", \"{}\"]}}\n"
                           "{{\"tokens\": [3, 4, 5]}}\n",
                           palette.string(), rgb.string()));
  const Run r = run_tool(tmp.path, fmt::format("--model '{}' --jsonl '{}'", model.string(), jsonl.string()));
  INFO(r.err);
  REQUIRE(r.status == 0);
  const std::vector<Line> lines{{{1, 2, kStart, kImage, kEnd, 5, 6}, {tmp.path / "local.png"}, 1},
                                {{kStart, kImage, kEnd, 7, kStart, kImage, kEnd, 8, 9}, {palette, rgb}, 3},
                                {{3, 4, 5}, {}, 4}};
  const std::string want = expected_output(model, lines, jsonl.string());
  CHECK(r.out == want);
  // rgb.png (13 x 21) resizes to 16 x 24: 24 patches, 6 merged tokens;
  // palette.png (40 x 90) to 24 x 64: 96 patches, 24 merged tokens.
  CHECK_THAT(r.out, ContainsSubstring(fmt::format("# sequence 0 ({}:1, 12 tokens)", jsonl.string())));
  CHECK_THAT(r.out, ContainsSubstring(fmt::format("# sequence 1 ({}:3, 37 tokens)", jsonl.string())));
  CHECK_THAT(r.out, ContainsSubstring(fmt::format("# sequence 2 ({}:4, 3 tokens)", jsonl.string())));

  // One sequence per forward (--batch-tokens 1): the same sequences, each
  // alone; its first sequence equals a one-sequence batch in the test.
  const Run single =
      run_tool(tmp.path, fmt::format("--model '{}' --jsonl '{}' --batch-tokens 1", model.string(), jsonl.string()));
  REQUIRE(single.status == 0);
  const std::string first = expected_output(model, {lines[0]}, jsonl.string());
  CHECK(single.out.substr(0, first.size()) == first);

  // Qwen3-VL-MoE (model_type qwen3_vl_moe) likewise.
  const fs::path moe = vl_checkpoint(tmp.path / "moe", kSmallPreprocessor, kVlMoeModel);
  const Run m = run_tool(tmp.path, fmt::format("--model '{}' --jsonl '{}'", moe.string(), jsonl.string()));
  INFO(m.err);
  REQUIRE(m.status == 0);
  CHECK(m.out == expected_output(moe, lines, jsonl.string()));
  CHECK(m.out != r.out);
}

TEST_CASE("slime-logprobs --jsonl without a preprocessor config uses the Qwen3-VL defaults") {
  if (!data::images_supported()) SKIP("built without libpng/libjpeg");
  TempDir tmp("logprobs_vl_defaults");
  const fs::path jsonl = tmp.path / "in.jsonl";
  write(jsonl,
        fmt::format("{{\"tokens\": [9, 121, 120, 122, 4], \"images\": [\"{}\"]}}\n", (kImages / "rgb.png").string()));
  const Run r = run_tool(tmp.path, fmt::format("--model '{}' --jsonl '{}'", kVlModel.string(), jsonl.string()));
  INFO(r.err);
  REQUIRE(r.status == 0);
  CHECK(r.out == expected_output(kVlModel, {{{9, kStart, kImage, kEnd, 4}, {kImages / "rgb.png"}, 1}}, jsonl.string()));
  // min_pixels 2^16: 13 x 21 resizes to 208 x 328, 52 x 82 patches, 1066 tokens.
  CHECK_THAT(r.out, ContainsSubstring("1070 tokens)"));
}

TEST_CASE("slime-logprobs: a text model scores --jsonl as --tokens") {
  TempDir tmp("logprobs_text");
  write(tmp.path / "in.jsonl", "{\"tokens\": [3, 9, 27, 1]}\n{\"tokens\": [5, 6, 7]}\n");
  write(tmp.path / "in.txt", "3 9 27 1\n5 6 7\n");
  const Run j = run_tool(
      tmp.path, fmt::format("--model '{}' --jsonl '{}'", kTextModel.string(), (tmp.path / "in.jsonl").string()));
  const Run t = run_tool(
      tmp.path, fmt::format("--model '{}' --tokens '{}'", kTextModel.string(), (tmp.path / "in.txt").string()));
  REQUIRE(j.status == 0);
  REQUIRE(t.status == 0);
  // The same output but for the file the headers name.
  std::string renamed = j.out;
  const std::string from = (tmp.path / "in.jsonl").string(), to = (tmp.path / "in.txt").string();
  for (std::size_t at = renamed.find(from); at != std::string::npos; at = renamed.find(from, at + to.size()))
    renamed.replace(at, from.size(), to);
  CHECK(renamed == t.out);
  CHECK_THAT(t.out, ContainsSubstring("# sequence 1 ("));
}

TEST_CASE("slime-logprobs with images: errors name the file and line") {
  if (!data::images_supported()) SKIP("built without libpng/libjpeg");
  TempDir tmp("logprobs_errors");
  const fs::path model = vl_checkpoint(tmp.path / "model", kSmallPreprocessor);
  const std::string rgb = (kImages / "rgb.png").string();
  const fs::path jsonl = tmp.path / "in.jsonl";
  auto run_with = [&](const fs::path& dir, const std::string& text) {
    write(jsonl, text);
    return run_tool(tmp.path, fmt::format("--model '{}' --jsonl '{}'", dir.string(), jsonl.string()));
  };
  const std::string ok = fmt::format("{{\"tokens\": [121, 120, 122, 4], \"images\": [\"{}\"]}}\n", rgb);

  Run r = run_with(model, ok + "{\"tokens\": [1, 2\n");
  CHECK(r.status == 1);
  CHECK_THAT(r.err, ContainsSubstring(jsonl.string() + ":2: malformed JSON"));

  r = run_with(model, ok + "{\"tokens\": [121, 120, 122], \"images\": [\"missing.png\"]}\n");
  CHECK(r.status == 1);
  CHECK_THAT(r.err, ContainsSubstring(jsonl.string() + ":2: cannot read image '"));
  CHECK_THAT(r.err, ContainsSubstring("missing.png"));

  r = run_with(model, fmt::format("{{\"tokens\": [121, 120, 122, 4], \"images\": [\"{}\", \"{}\"]}}\n", rgb, rgb));
  CHECK(r.status == 1);
  CHECK_THAT(r.err, ContainsSubstring(jsonl.string() + ":1: "));
  CHECK_THAT(r.err, ContainsSubstring("the prompt has 1 image placeholders (token 120) but 2 images were given"));

  r = run_with(model, "{\"tokens\": [4, 121, 120, 122]}\n");
  CHECK(r.status == 1);
  CHECK_THAT(r.err, ContainsSubstring(jsonl.string() + ":1: "));
  CHECK_THAT(r.err, ContainsSubstring("the prompt has 1 image placeholders (token 120) but 0 images were given"));

  r = run_with(model, fmt::format("{{\"tokens\": [4, 120, 5], \"images\": [\"{}\"]}}\n", rgb));
  CHECK(r.status == 1);
  CHECK_THAT(r.err, ContainsSubstring(jsonl.string() + ":1: "));
  CHECK_THAT(r.err, ContainsSubstring("image token 120 at position 1 is not directly between vision_start (121)"));

  r = run_with(model, fmt::format("{{\"tokens\": [121, 120, 122], \"images\": [\"{}\"]}}\n",
                                  (kImages / "decoded.safetensors").string()));
  CHECK(r.status == 1);
  CHECK_THAT(r.err, ContainsSubstring(jsonl.string() + ":1: image '"));

  r = run_with(kTextModel, "{\"tokens\": [1, 2]}\n" + ok);
  CHECK(r.status == 1);
  CHECK_THAT(r.err, ContainsSubstring(jsonl.string() + ":2: 1 image(s) given, but '" + kTextModel.string() +
                                      "' is a text model (model_type 'qwen3')"));

  const fs::path mismatched = vl_checkpoint(tmp.path / "mismatched", R"({"patch_size": 16, "merge_size": 2})");
  r = run_with(mismatched, ok);
  CHECK(r.status == 1);
  CHECK_THAT(r.err, ContainsSubstring("has patch_size 16, merge_size 2, temporal_patch_size 2 but the model's "
                                      "vision_config has 4, 2, 2"));

  r = run_tool(tmp.path, fmt::format("--model '{}'", model.string()));
  CHECK(r.status != 0);
  CHECK_THAT(r.err, ContainsSubstring("give one of --tokens FILE and --jsonl FILE"));
}
