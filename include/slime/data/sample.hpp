// slime/data/sample.hpp: Sample (one trajectory: tokens, response, loss mask,
// reward, rollout logprobs, group, images, metadata), its JSONL form, and a
// streaming JSONL reader whose errors name the file and line.
//
// One JSON object per line; blank lines are skipped; unknown fields are
// ignored. Fields:
//   tokens             [int]   required, non-empty: prompt then response, each
//                              in [0, vocab_size) when vocab_size is set
//   response_length    int     1 <= response_length <= len(tokens)
//   loss_mask          [0|1]   one per response token (as slime writes it);
//                              at least one of response_length and loss_mask
//                              must be there, and when both are they agree;
//                              without loss_mask every response token counts
//   reward             number  optional
//   rollout_log_probs  [number] optional, one per response token
//   group_index        int     optional, >= 0: samples of one prompt share it
//   images             [string] optional image paths (as written); once they
//                              are preprocessed, set Sample::image_patches
//   metadata           any     optional, kept as JSON
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "slime/core/error.hpp"
#include "slime/core/json.hpp"
#include "slime/core/regular_file.hpp"

namespace slime::data {

struct Sample {
  std::vector<int32_t> tokens;           // [prompt + response]
  int32_t response_length = 0;           // the last response_length tokens are the response
  std::vector<uint8_t> loss_mask;        // [response_length], 1 = trained on
  std::optional<double> reward;          //
  std::vector<float> rollout_log_probs;  // [response_length] or empty
  int64_t group_index = -1;              // -1: in a group of its own
  std::vector<std::string> images;       // image paths
  nlohmann::json metadata;               // null when absent
  // Vision-tower rows of the images once preprocessed (sum of their
  // GridTHW::patches()); the packer counts them in the token budget. Set by
  // the trainer after preprocessing; not part of the JSONL form.
  int64_t image_patches = 0;

  int64_t length() const { return int64_t(tokens.size()); }
  int64_t prompt_length() const { return length() - response_length; }
};

// Options shared by the JSONL readers.
struct JsonlOptions {
  // Token ids must be < vocab_size; 0 skips the check (ids must still be >= 0).
  int64_t vocab_size = 0;
};

namespace detail {

using ::slime::detail::concat;

// "file:line: " prefix of every data error.
struct JsonlWhere {
  const std::string* file;
  int64_t line;
};

[[noreturn]] inline void data_fail(const JsonlWhere& at, const std::string& message) {
  throw Error(concat(*at.file, ":", at.line, ": ", message));
}

inline const nlohmann::json* find_field(const nlohmann::json& j, std::string_view name) {
  auto it = j.find(name);
  return it == j.end() ? nullptr : &*it;
}

inline const nlohmann::json& require_field(const nlohmann::json& j, std::string_view name, const JsonlWhere& at) {
  const nlohmann::json* f = find_field(j, name);
  if (f == nullptr) data_fail(at, concat("missing field '", name, "'"));
  return *f;
}

inline int64_t read_integer(const nlohmann::json& v, std::string_view name, const JsonlWhere& at) {
  if (!v.is_number_integer()) data_fail(at, concat("field '", name, "' must be an integer, got ", json_excerpt(v)));
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
    data_fail(at, concat("field '", name, "' = ", json_excerpt(v), " is out of range"));
  return v.get<int64_t>();
}

inline const nlohmann::json& read_array(const nlohmann::json& v, std::string_view name, const JsonlWhere& at) {
  if (!v.is_array()) data_fail(at, concat("field '", name, "' must be an array, got ", v.type_name()));
  return v;
}

// Token ids: integers in [0, vocab_size) (vocab_size 0: in [0, 2^31)).
inline std::vector<int32_t> read_tokens(const nlohmann::json& v, std::string_view name, const JsonlOptions& options,
                                        const JsonlWhere& at) {
  const nlohmann::json& a = read_array(v, name, at);
  if (a.empty()) data_fail(at, concat("field '", name, "' is empty"));
  const int64_t limit = options.vocab_size > 0 ? options.vocab_size : int64_t(std::numeric_limits<int32_t>::max()) + 1;
  std::vector<int32_t> out;
  out.reserve(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    const nlohmann::json& t = a[i];
    if (!t.is_number_integer())
      data_fail(at, concat("field '", name, "'[", i, "] must be an integer token id, got ", json_excerpt(t)));
    const bool negative = t.is_number_integer() && !t.is_number_unsigned() && t.get<int64_t>() < 0;
    if (negative || t.get<uint64_t>() >= uint64_t(limit)) {
      if (options.vocab_size > 0)
        data_fail(at, concat("field '", name, "'[", i, "] = ", json_excerpt(t), " is out of the vocabulary [0, ",
                             options.vocab_size, ")"));
      data_fail(at,
                concat("field '", name, "'[", i, "] = ", json_excerpt(t), " is not a valid token id (0 <= id < 2^31)"));
    }
    out.push_back(int32_t(t.get<int64_t>()));
  }
  return out;
}

inline std::vector<std::string> read_strings(const nlohmann::json& v, std::string_view name, const JsonlWhere& at) {
  const nlohmann::json& a = read_array(v, name, at);
  std::vector<std::string> out;
  out.reserve(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!a[i].is_string())
      data_fail(at, concat("field '", name, "'[", i, "] must be a string, got ", json_excerpt(a[i])));
    out.push_back(a[i].get<std::string>());
  }
  return out;
}

// A line as one JSON object, or an error naming the line: malformed JSON, a NUL byte, nesting past
// kJsonMaxDepth and numbers out of range all read "<file>:<line>: ...".
inline nlohmann::json parse_line(std::string_view line, const JsonlWhere& at) {
  nlohmann::json j;
  try {
    check_json_text(line, "the line");
    j = nlohmann::json::parse(line.begin(), line.end());
  } catch (const nlohmann::json::exception& e) {
    data_fail(at, concat("malformed JSON: ", json_parse_error(e)));
  } catch (const Error& e) {
    data_fail(at, e.message());
  }
  if (!j.is_object()) data_fail(at, concat("expected a JSON object, got ", j.type_name()));
  return j;
}

}  // namespace detail

// Reads a JSONL file line by line; next() hands out each non-blank line parsed
// into a JSON object. Nothing but the current line is held in memory.
class JsonlReader {
 public:
  explicit JsonlReader(std::filesystem::path path) : path_(std::move(path)), name_(path_.string()) {
    require_regular_file(path_, "JSONL file");  // a FIFO would block the open below
    in_.open(path_, std::ios::binary);
    if (!in_) SLIME_FAIL("cannot open '", name_, "': ", std::strerror(errno));
  }

  // The next object, or false at the end of the file.
  bool next(nlohmann::json& out) {
    std::string line;
    while (std::getline(in_, line)) {
      ++line_;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") == std::string::npos) continue;
      out = detail::parse_line(line, where());
      return true;
    }
    if (in_.bad()) SLIME_FAIL("reading '", name_, "' failed after line ", line_);
    return false;
  }

  // The line number (1-based) of the object next() returned last.
  int64_t line() const { return line_; }
  const std::filesystem::path& path() const { return path_; }
  detail::JsonlWhere where() const { return {&name_, line_}; }

 private:
  std::filesystem::path path_;
  std::string name_;
  std::ifstream in_;
  int64_t line_ = 0;
};

// A Sample from its JSON object (see the field list at the top of the file);
// errors read "<at.file>:<at.line>: ...".
inline Sample sample_from_json(const nlohmann::json& j, const JsonlOptions& options, const detail::JsonlWhere& at) {
  using detail::concat;
  using detail::data_fail;
  using detail::find_field;
  Sample s;
  s.tokens = detail::read_tokens(detail::require_field(j, "tokens", at), "tokens", options, at);
  const int64_t n = s.length();
  const nlohmann::json* rl = find_field(j, "response_length");
  const nlohmann::json* mask = find_field(j, "loss_mask");
  if (rl == nullptr && mask == nullptr) data_fail(at, "missing field 'response_length' (or 'loss_mask')");
  int64_t response = -1;
  if (rl != nullptr) {
    response = detail::read_integer(*rl, "response_length", at);
    if (response <= 0 || response > n)
      data_fail(at, concat("field 'response_length' = ", response, " must be in [1, ", n, "] (the number of tokens)"));
  }
  if (mask != nullptr) {
    const nlohmann::json& a = detail::read_array(*mask, "loss_mask", at);
    if (response < 0) {
      response = int64_t(a.size());
      if (response <= 0 || response > n)
        data_fail(at, concat("field 'loss_mask' has ", a.size(), " entries; it needs one per response token, 1 to ", n,
                             " (the number of tokens)"));
    } else if (int64_t(a.size()) != response) {
      data_fail(at, concat("field 'loss_mask' has ", a.size(), " entries but response_length is ", response));
    }
    s.loss_mask.reserve(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      const nlohmann::json& m = a[i];
      if (m.is_boolean()) {
        s.loss_mask.push_back(m.get<bool>() ? 1 : 0);
      } else if (m.is_number_integer() && (m.get<int64_t>() == 0 || m.get<int64_t>() == 1)) {
        s.loss_mask.push_back(uint8_t(m.get<int64_t>()));
      } else {
        data_fail(at, concat("field 'loss_mask'[", i, "] must be 0 or 1, got ", json_excerpt(m)));
      }
    }
  } else {
    s.loss_mask.assign(std::size_t(response), 1);
  }
  s.response_length = int32_t(response);
  if (const nlohmann::json* r = find_field(j, "reward")) {
    if (!r->is_number()) data_fail(at, concat("field 'reward' must be a number, got ", json_excerpt(*r)));
    s.reward = r->get<double>();
  }
  if (const nlohmann::json* lp = find_field(j, "rollout_log_probs")) {
    const nlohmann::json& a = detail::read_array(*lp, "rollout_log_probs", at);
    if (int64_t(a.size()) != response)
      data_fail(at, concat("field 'rollout_log_probs' has ", a.size(), " entries but response_length is ", response));
    s.rollout_log_probs.reserve(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (!a[i].is_number())
        data_fail(at, concat("field 'rollout_log_probs'[", i, "] must be a number, got ", json_excerpt(a[i])));
      s.rollout_log_probs.push_back(a[i].get<float>());
    }
  }
  if (const nlohmann::json* g = find_field(j, "group_index")) {
    s.group_index = detail::read_integer(*g, "group_index", at);
    if (s.group_index < 0) data_fail(at, concat("field 'group_index' = ", s.group_index, " must be >= 0"));
  }
  if (const nlohmann::json* im = find_field(j, "images")) s.images = detail::read_strings(*im, "images", at);
  if (const nlohmann::json* md = find_field(j, "metadata")) s.metadata = *md;
  return s;
}

// The JSON object sample_from_json reads back to an equal Sample.
inline nlohmann::json sample_to_json(const Sample& s) {
  nlohmann::json j;
  j["tokens"] = s.tokens;
  j["response_length"] = s.response_length;
  std::vector<int> mask(s.loss_mask.begin(), s.loss_mask.end());
  j["loss_mask"] = mask;
  if (s.reward) j["reward"] = *s.reward;
  if (!s.rollout_log_probs.empty()) j["rollout_log_probs"] = s.rollout_log_probs;
  if (s.group_index >= 0) j["group_index"] = s.group_index;
  if (!s.images.empty()) j["images"] = s.images;
  if (!s.metadata.is_null()) j["metadata"] = s.metadata;
  return j;
}

// Streams Samples from a JSONL file.
class SampleReader {
 public:
  explicit SampleReader(std::filesystem::path path, JsonlOptions options = {})
      : reader_(std::move(path)), options_(options) {}

  // The next sample, or false at the end of the file.
  bool next(Sample& out) {
    nlohmann::json j;
    if (!reader_.next(j)) return false;
    out = sample_from_json(j, options_, reader_.where());
    return true;
  }
  int64_t line() const { return reader_.line(); }
  detail::JsonlWhere where() const { return reader_.where(); }

 private:
  JsonlReader reader_;
  JsonlOptions options_;
};

// Every sample of a JSONL file.
inline std::vector<Sample> read_samples(const std::filesystem::path& path, JsonlOptions options = {}) {
  SampleReader reader(path, options);
  std::vector<Sample> out;
  Sample s;
  while (reader.next(s)) out.push_back(std::move(s));
  return out;
}

}  // namespace slime::data
