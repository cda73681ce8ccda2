// slime-logprobs: scores token sequences with a Hugging Face Qwen3 or
// Qwen3-VL checkpoint.
//
//   slime-logprobs --model DIR (--tokens FILE | --jsonl FILE) [--device cpu|cuda[:N]] [--temperature T]
//
// --tokens FILE holds one sequence per line as whitespace-separated token ids
// (blank lines are skipped). --jsonl FILE holds one JSON object per line,
//   {"tokens": [...], "images": ["path", ...]}
// ("images" optional; relative paths are relative to FILE's directory). The
// tokens hold one image placeholder per image, framed as a chat template
// writes it: <|vision_start|> <|image_pad|> <|vision_end|> (the config's
// vision_start_token_id, image_token_id, vision_end_token_id). Only a
// Qwen3-VL checkpoint (config.json model_type qwen3_vl or qwen3_vl_moe) takes
// images: each is decoded (PNG or JPEG, data/image.hpp), preprocessed as
// transformers' Qwen3-VL processor does (DIR/preprocessor_config.json when
// present, else the Qwen3-VL defaults; patch, merge and temporal patch sizes
// default to, and must agree with, the config's vision_config), and its
// placeholder expanded to the image's merged patch count
// (data::expand_image_placeholders) before scoring.
//
// For every sequence the tool prints a header line
//   # sequence K (FILE:LINE, N tokens)
// then one line per token (of the expanded sequence), tab-separated:
//   index  token  log p(token | prefix)  entropy of the next-token distribution
// The first token has no prefix, so its log-probability prints as "-". Both
// numbers are at temperature T (logits / T). The CPU model runs in f32, the
// CUDA model in bf16. Sequences are packed into batches of up to
// --batch-tokens tokens, image patches included (one forward each).
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "slime/core/error.hpp"
#include "slime/core/json.hpp"
#include "slime/core/regular_file.hpp"
#include "slime/data/image.hpp"
#include "slime/data/qwen_vl_image.hpp"
#include "slime/data/sample.hpp"
#include "slime/nn/checkpoint.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/nn/qwen3_vl.hpp"
#include "slime/nn/qwen3_vl_checkpoint.hpp"
#include "slime/ops/host_checks.hpp"

namespace {

struct Sequence {
  std::vector<int32_t> tokens;
  int line = 0;                     // 1-based line in the file
  std::vector<std::string> images;  // paths, resolved (--jsonl only)
};

// Parses FILE: one sequence per non-blank line; every id must be an integer in
// [0, vocab). Errors read "FILE:LINE: ...".
std::vector<Sequence> read_token_file(const std::filesystem::path& path, int64_t vocab) {
  slime::require_regular_file(path, "token file");  // a FIFO would block the open below
  std::ifstream in(path);
  if (!in) SLIME_FAIL("cannot open token file '", path.string(), "'");
  std::vector<Sequence> out;
  std::string text;
  for (int line = 1; std::getline(in, text); ++line) {
    Sequence seq;
    seq.line = line;
    std::string_view rest(text);
    while (true) {
      const auto start = rest.find_first_not_of(" \t\r\f\v");
      if (start == std::string_view::npos) break;
      rest.remove_prefix(start);
      const auto end = std::min(rest.find_first_of(" \t\r\f\v"), rest.size());
      const std::string_view word = rest.substr(0, end);
      int64_t id = 0;
      const auto [ptr, ec] = std::from_chars(word.data(), word.data() + word.size(), id);
      if (ec != std::errc() || ptr != word.data() + word.size())
        SLIME_FAIL(path.string(), ":", line, ": '", word, "' is not a token id (expected an integer)");
      if (id < 0 || id >= vocab)
        SLIME_FAIL(path.string(), ":", line, ": token id ", id, " is outside the vocabulary [0, ", vocab, ")");
      seq.tokens.push_back(int32_t(id));
      rest.remove_prefix(end);
    }
    if (!seq.tokens.empty()) out.push_back(std::move(seq));
  }
  if (in.bad()) SLIME_FAIL("error reading token file '", path.string(), "'");
  return out;
}

// Parses a JSONL file: {"tokens": [...], "images": [...]} per non-blank line,
// ids in [0, vocab). Errors read "FILE:LINE: ...".
std::vector<Sequence> read_jsonl_file(const std::filesystem::path& path, int64_t vocab) {
  namespace data = slime::data;
  data::JsonlReader reader(path);
  const data::JsonlOptions options{.vocab_size = vocab};
  std::vector<Sequence> out;
  nlohmann::json j;
  while (reader.next(j)) {
    Sequence seq;
    seq.line = int(reader.line());
    seq.tokens = data::detail::read_tokens(data::detail::require_field(j, "tokens", reader.where()), "tokens", options,
                                           reader.where());
    if (const nlohmann::json* im = data::detail::find_field(j, "images"))
      for (std::string& image : data::detail::read_strings(*im, "images", reader.where())) {
        const std::filesystem::path p(image);
        seq.images.push_back(p.is_absolute() ? image : (path.parent_path() / p).string());
      }
    out.push_back(std::move(seq));
  }
  return out;
}

slime::Device parse_device(const std::string& s) {
  if (s == "cpu") return slime::Device::cpu();
  if (s == "cuda") return slime::Device::cuda(0);
  if (s.starts_with("cuda:")) {
    int index = -1;
    const char* b = s.data() + 5;
    const auto [ptr, ec] = std::from_chars(b, s.data() + s.size(), index);
    if (ec == std::errc() && ptr == s.data() + s.size() && index >= 0) return slime::Device::cuda(index);
  }
  SLIME_FAIL("--device must be cpu, cuda or cuda:N, got '", s, "'");
}

// Runs one packed batch of `tokens` (a PackedBatch or VLBatch) and prints the
// sequences; `index` and `line` name each one in its header.
template <class Model, class Batch>
void score(Model& model, const Batch& batch, const std::vector<std::vector<int32_t>>& tokens,
           const std::vector<std::size_t>& index, const std::vector<int>& line, float temperature,
           const std::string& file) {
  using namespace slime;
  std::vector<int32_t> targets;
  for (const auto& t : tokens) {
    // Position i predicts token i + 1; the last position's target is unused.
    targets.insert(targets.end(), t.begin() + 1, t.end());
    targets.push_back(0);
  }
  // Checked on the host: an out-of-range target traps in the GPU kernel.
  int64_t vocab = 0;
  if constexpr (requires { model.language_config(); })
    vocab = model.language_config().vocab_size;
  else
    vocab = model.config().vocab_size;
  ops::check_token_targets(std::span<const int32_t>(targets), vocab, file);
  const Tensor target_tensor = Tensor::from_vector(targets, {int64_t(targets.size())}, model.device());
  typename Model::Context ctx;
  const Tensor hidden = model.forward(batch, ctx);
  const ops::TokenLogprobs lp = model.token_logprobs(hidden, target_tensor, temperature);
  const std::vector<float> logprobs = lp.logprobs.to_vector<float>();
  const std::vector<float> entropy = lp.entropy.to_vector<float>();
  std::size_t offset = 0;
  for (std::size_t s = 0; s < tokens.size(); ++s) {
    const auto& t = tokens[s];
    fmt::print("# sequence {} ({}:{}, {} tokens)\n", index[s], file, line[s], t.size());
    for (std::size_t i = 0; i < t.size(); ++i) {
      const std::string logp = i == 0 ? std::string("-") : fmt::format("{:.6f}", logprobs[offset + i - 1]);
      fmt::print("{}\t{}\t{}\t{:.6f}\n", i, t[i], logp, entropy[offset + i]);
    }
    offset += t.size();
  }
}

// Scores text sequences with a Qwen3 model, batches of up to batch_tokens.
void score_text(slime::nn::Qwen3Model& model, const std::vector<Sequence>& seqs, int64_t batch_tokens,
                float temperature, const std::string& file) {
  std::size_t first = 0;
  while (first < seqs.size()) {
    std::size_t last = first;
    int64_t n = 0;
    while (last < seqs.size() && (last == first || n + int64_t(seqs[last].tokens.size()) <= batch_tokens))
      n += int64_t(seqs[last++].tokens.size());
    std::vector<std::vector<int32_t>> tokens;
    std::vector<std::size_t> index;
    std::vector<int> line;
    for (std::size_t s = first; s < last; ++s) {
      tokens.push_back(seqs[s].tokens);
      index.push_back(s);
      line.push_back(seqs[s].line);
    }
    score(model, slime::nn::make_packed_batch(tokens, model.device()), tokens, index, line, temperature, file);
    first = last;
  }
}

// The image options for a Qwen3-VL checkpoint: DIR/preprocessor_config.json
// when present, else the Qwen3-VL defaults with the tower's patch, merge and
// temporal patch sizes; either way they must match the tower.
slime::data::QwenVLImageOptions vl_image_options(const std::filesystem::path& dir,
                                                 const slime::nn::Qwen3VLConfig& config) {
  namespace data = slime::data;
  const slime::nn::Qwen3VLVisionConfig& v = config.vision;
  const std::filesystem::path file = dir / "preprocessor_config.json";
  std::error_code ec;
  if (!std::filesystem::exists(file, ec)) {
    data::QwenVLImageOptions o;
    o.patch_size = v.patch_size;
    o.merge_size = v.spatial_merge_size;
    o.temporal_patch_size = v.temporal_patch_size;
    return o;
  }
  const data::QwenVLImageOptions o = data::read_preprocessor_config(file);
  SLIME_CHECK(o.patch_size == v.patch_size && o.merge_size == v.spatial_merge_size &&
                  o.temporal_patch_size == v.temporal_patch_size,
              "'", file.string(), "' has patch_size ", o.patch_size, ", merge_size ", o.merge_size,
              ", temporal_patch_size ", o.temporal_patch_size, " but the model's vision_config has ", v.patch_size,
              ", ", v.spatial_merge_size, ", ", v.temporal_patch_size);
  return o;
}

// One sequence ready for a VL batch: images decoded and preprocessed, the
// placeholders expanded. Errors are prefixed "FILE:LINE: ".
slime::nn::VLSequence prepare_vl(const Sequence& seq, const slime::nn::Qwen3VLConfig& config,
                                 const slime::data::QwenVLImageOptions& options, const std::string& file) {
  namespace data = slime::data;
  using namespace slime;
  try {
    data::VisionInput vision;
    vision.patch_dim = options.patch_dim();
    for (const std::string& path : seq.images) data::append_image(vision, data::read_image(path), options);
    const data::VisionTokenIds ids{config.image_token_id, config.vision_start_token_id, config.vision_end_token_id};
    nn::VLSequence out;
    out.tokens = data::expand_image_placeholders(seq.tokens, vision.grid_thw, options.merge_size, ids);
    for (const data::GridTHW& g : vision.grid_thw) out.grids.push_back({g.t, g.h, g.w});
    if (!out.grids.empty())
      out.pixel_values = Tensor::from_vector(vision.pixel_values, {vision.rows(), vision.patch_dim});
    return out;
  } catch (const Error& e) {
    SLIME_FAIL(file, ":", seq.line, ": ", e.message());
  }
}

// Scores sequences with a Qwen3-VL model, batches of up to batch_tokens
// tokens plus image patches; each batch's images are read when it is built.
void score_vl(slime::nn::Qwen3VLModel& model, const std::filesystem::path& dir, const std::vector<Sequence>& seqs,
              int64_t batch_tokens, float temperature, const std::string& file) {
  using namespace slime;
  const data::QwenVLImageOptions options = vl_image_options(dir, model.config());
  std::vector<nn::VLSequence> batch;
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::size_t> index;
  std::vector<int> line;
  int64_t n = 0;
  auto flush = [&] {
    if (batch.empty()) return;
    score(model, nn::make_vl_batch(batch, model.config(), model.device(), model.dtype()), tokens, index, line,
          temperature, file);
    batch.clear();
    tokens.clear();
    index.clear();
    line.clear();
    n = 0;
  };
  for (std::size_t s = 0; s < seqs.size(); ++s) {
    nn::VLSequence q = prepare_vl(seqs[s], model.config(), options, file);
    const int64_t cost = int64_t(q.tokens.size()) + (q.grids.empty() ? 0 : q.pixel_values.size(0));
    if (int64_t(q.tokens.size()) > model.language_config().max_position_embeddings)
      fmt::print(stderr, "slime-logprobs: warning: {}:{}: {} tokens exceed max_position_embeddings = {}\n", file,
                 seqs[s].line, q.tokens.size(), model.language_config().max_position_embeddings);
    if (!batch.empty() && n + cost > batch_tokens) flush();
    n += cost;
    tokens.push_back(q.tokens);
    index.push_back(s);
    line.push_back(seqs[s].line);
    batch.push_back(std::move(q));
  }
  flush();
}

// model_type of DIR/config.json, or "" when it cannot be read (load_hf then
// reports the problem).
std::string model_type(const std::filesystem::path& dir) {
  nlohmann::json j;
  try {
    j = slime::parse_json(slime::read_regular_file(dir / "config.json", "config"), "config.json");
  } catch (const slime::Error&) {
    return {};
  }
  if (!j.is_object()) return {};
  const auto it = j.find("model_type");
  return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Per-token log-probabilities and entropies of token sequences under a Hugging Face Qwen3 or Qwen3-VL model"};
  std::string model_dir, tokens_file, jsonl_file, device_name = "cpu";
  float temperature = 1.f;
  int64_t batch_tokens = 8192;
  app.add_option("--model", model_dir, "Hugging Face checkpoint directory (config.json + safetensors)")
      ->required()
      ->check(CLI::ExistingDirectory);
  auto* tokens_opt =
      app.add_option("--tokens", tokens_file, "token file: one sequence per line, whitespace-separated ids")
          ->check(CLI::ExistingFile);
  auto* jsonl_opt = app.add_option("--jsonl", jsonl_file,
                                   "JSONL file: {\"tokens\": [...], \"images\": [\"path\", ...]} per line "
                                   "(images: Qwen3-VL checkpoints only)")
                        ->check(CLI::ExistingFile);
  tokens_opt->excludes(jsonl_opt);
  app.add_option("--device", device_name, "cpu (f32) or cuda[:N] (bf16)")->capture_default_str();
  app.add_option("--temperature", temperature, "divide the logits by T before the softmax")->capture_default_str();
  app.add_option("--batch-tokens", batch_tokens,
                 "pack sequences into forwards of at most this many tokens (image patches included)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  if (tokens_file.empty() == jsonl_file.empty()) {
    fmt::print(stderr, "slime-logprobs: error: give one of --tokens FILE and --jsonl FILE\n");
    return 2;
  }
  const std::string& file = jsonl_file.empty() ? tokens_file : jsonl_file;

  try {
    SLIME_CHECK(std::isfinite(temperature) && temperature > 0.f, "--temperature must be finite and > 0, got ",
                temperature);
    const slime::Device device = parse_device(device_name);
    const slime::DType dtype = device.is_cuda() ? slime::DType::bf16 : slime::DType::f32;
    auto read = [&](int64_t vocab) {
      return jsonl_file.empty() ? read_token_file(tokens_file, vocab) : read_jsonl_file(jsonl_file, vocab);
    };
    const std::string type = model_type(model_dir);
    if (type == "qwen3_vl" || type == "qwen3_vl_moe") {
      slime::nn::Qwen3VLModel model = slime::nn::load_hf_vl(model_dir, device, dtype);
      score_vl(model, model_dir, read(model.language_config().vocab_size), batch_tokens, temperature, file);
      return 0;
    }
    slime::nn::Qwen3Model model = slime::nn::load_hf(model_dir, device, dtype);
    const std::vector<Sequence> seqs = read(model.config().vocab_size);
    for (const auto& s : seqs) {
      SLIME_CHECK(s.images.empty(), file, ":", s.line, ": ", s.images.size(), " image(s) given, but '", model_dir,
                  "' is a text model (model_type '", type,
                  "'); images need a Qwen3-VL checkpoint (model_type qwen3_vl or qwen3_vl_moe)");
      if (int64_t(s.tokens.size()) > model.config().max_position_embeddings)
        fmt::print(stderr, "slime-logprobs: warning: {}:{}: {} tokens exceed max_position_embeddings = {}\n", file,
                   s.line, s.tokens.size(), model.config().max_position_embeddings);
    }
    score_text(model, seqs, batch_tokens, temperature, file);
  } catch (const slime::Error& e) {
    fmt::print(stderr, "slime-logprobs: error: {}\n", e.message());  // without the source location
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "slime-logprobs: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
