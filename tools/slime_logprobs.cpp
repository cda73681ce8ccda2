// slime-logprobs: scores token sequences with a Hugging Face Qwen3 checkpoint.
//
//   slime-logprobs --model DIR --tokens FILE [--device cpu|cuda[:N]] [--temperature T]
//
// FILE holds one sequence per line as whitespace-separated token ids (blank
// lines are skipped). For every sequence the tool prints a header line
//   # sequence K (FILE:LINE, N tokens)
// then one line per token, tab-separated:
//   index  token  log p(token | prefix)  entropy of the next-token distribution
// The first token has no prefix, so its log-probability prints as "-". Both
// numbers are at temperature T (logits / T). The CPU model runs in f32, the
// CUDA model in bf16. Sequences are packed into batches of up to
// --batch-tokens tokens (one forward each).
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/nn/checkpoint.hpp"
#include "slime/nn/qwen3.hpp"

namespace {

struct Sequence {
  std::vector<int32_t> tokens;
  int line = 0;  // 1-based line in the file
};

// Parses FILE: one sequence per non-blank line; every id must be an integer in
// [0, vocab). Errors read "FILE:LINE: ...".
std::vector<Sequence> read_token_file(const std::filesystem::path& path, int64_t vocab) {
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

// Scores sequences [first, last) as one packed batch and prints them.
void score(slime::nn::Qwen3Model& model, const std::vector<Sequence>& seqs, std::size_t first, std::size_t last,
           float temperature, const std::string& file) {
  using namespace slime;
  std::vector<std::vector<int32_t>> tokens;
  std::vector<int32_t> targets;
  for (std::size_t s = first; s < last; ++s) {
    const auto& t = seqs[s].tokens;
    tokens.push_back(t);
    // Position i predicts token i + 1; the last position's target is unused.
    targets.insert(targets.end(), t.begin() + 1, t.end());
    targets.push_back(0);
  }
  const nn::PackedBatch batch = nn::make_packed_batch(tokens, model.device());
  const Tensor target_tensor = Tensor::from_vector(targets, {int64_t(targets.size())}, model.device());
  nn::Qwen3Model::Context ctx;
  const Tensor hidden = model.forward(batch, ctx);
  const ops::TokenLogprobs lp = model.token_logprobs(hidden, target_tensor, temperature);
  const std::vector<float> logprobs = lp.logprobs.to_vector<float>();
  const std::vector<float> entropy = lp.entropy.to_vector<float>();
  std::size_t offset = 0;
  for (std::size_t s = first; s < last; ++s) {
    const auto& t = seqs[s].tokens;
    fmt::print("# sequence {} ({}:{}, {} tokens)\n", s, file, seqs[s].line, t.size());
    for (std::size_t i = 0; i < t.size(); ++i) {
      const std::string logp = i == 0 ? std::string("-") : fmt::format("{:.6f}", logprobs[offset + i - 1]);
      fmt::print("{}\t{}\t{}\t{:.6f}\n", i, t[i], logp, entropy[offset + i]);
    }
    offset += t.size();
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Per-token log-probabilities and entropies of token sequences under a Hugging Face Qwen3 model"};
  std::string model_dir, tokens_file, device_name = "cpu";
  float temperature = 1.f;
  int64_t batch_tokens = 8192;
  app.add_option("--model", model_dir, "Hugging Face checkpoint directory (config.json + safetensors)")
      ->required()
      ->check(CLI::ExistingDirectory);
  app.add_option("--tokens", tokens_file, "token file: one sequence per line, whitespace-separated ids")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--device", device_name, "cpu (f32) or cuda[:N] (bf16)")->capture_default_str();
  app.add_option("--temperature", temperature, "divide the logits by T before the softmax")->capture_default_str();
  app.add_option("--batch-tokens", batch_tokens, "pack sequences into forwards of at most this many tokens")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  try {
    SLIME_CHECK(std::isfinite(temperature) && temperature > 0.f, "--temperature must be finite and > 0, got ",
                temperature);
    const slime::Device device = parse_device(device_name);
    const slime::DType dtype = device.is_cuda() ? slime::DType::bf16 : slime::DType::f32;
    slime::nn::Qwen3Model model = slime::nn::load_hf(model_dir, device, dtype);
    const std::vector<Sequence> seqs = read_token_file(tokens_file, model.config().vocab_size);
    for (const auto& s : seqs)
      if (int64_t(s.tokens.size()) > model.config().max_position_embeddings)
        fmt::print(stderr, "slime-logprobs: warning: {}:{}: {} tokens exceed max_position_embeddings = {}\n",
                   tokens_file, s.line, s.tokens.size(), model.config().max_position_embeddings);
    std::size_t first = 0;
    while (first < seqs.size()) {
      std::size_t last = first;
      int64_t n = 0;
      while (last < seqs.size() && (last == first || n + int64_t(seqs[last].tokens.size()) <= batch_tokens))
        n += int64_t(seqs[last++].tokens.size());
      score(model, seqs, first, last, temperature, tokens_file);
      first = last;
    }
  } catch (const slime::Error& e) {
    fmt::print(stderr, "slime-logprobs: error: {}\n", e.message());  // without the source location
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "slime-logprobs: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
