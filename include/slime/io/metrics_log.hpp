// slime/io/metrics_log.hpp: per-step training metrics to a JSONL file (and,
// optionally, to TensorBoard event files), resumable after a crash.
//
// One JSON object per line, keys in this order:
//   {"step": <int>, "time": <unix seconds>, "<name>": <number>, ...}
// Non-finite values are written as null (JSON has no NaN). Each line is
// written with one fwrite and flushed, so a crash loses at most the line
// being written; a resumed log drops a torn last line.
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "slime/core/error.hpp"
#include "slime/core/json.hpp"
#include "slime/core/regular_file.hpp"
#include "slime/io/tensorboard.hpp"

namespace slime::io {

struct MetricsLogOptions {
  // Unset: a new run; an existing file is replaced. Set to s: a resumed run
  // that continues at step s; lines with step >= s (and a torn last line) are
  // dropped, earlier lines kept, new lines appended.
  std::optional<int64_t> resume_step = std::nullopt;
  // When set, every step's scalars also go to a TensorBoardWriter in this
  // directory (a new event file per run; a resumed run first marks a session
  // start at resume_step so TensorBoard drops the replaced steps).
  std::optional<std::filesystem::path> tensorboard_dir = std::nullopt;
};

// Scalars of one step, in the order they are written.
using Scalars = std::vector<std::pair<std::string, double>>;

// One line of a metrics JSONL file.
struct MetricsRecord {
  int64_t step = 0;
  double time = 0;
  Scalars values;  // null values read back as NaN
};

// Reads a metrics JSONL file. A last line without its newline (a write torn
// by a crash) is skipped when `allow_torn_tail`; any other malformed line
// throws slime::Error naming the file and line.
inline std::vector<MetricsRecord> read_metrics_jsonl(const std::filesystem::path& path, bool allow_torn_tail = true) {
  require_regular_file(path, "metrics log");
  std::ifstream in(path, std::ios::binary);
  SLIME_CHECK(in.good(), "metrics log '", path.string(), "' cannot be opened: ", std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<MetricsRecord> records;
  std::size_t pos = 0;
  for (int64_t line_no = 1; pos < text.size(); ++line_no) {
    const std::size_t end = text.find('\n', pos);
    if (end == std::string::npos && allow_torn_tail) break;
    const std::string line = text.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
    pos = end == std::string::npos ? text.size() : end + 1;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto where = [&] { return ::slime::detail::concat(path.string(), ":", line_no, ": "); };
    // Bounded nesting, no NUL: the file may come from a hostile --resume directory.
    try {
      check_json_text(line, "the line");
    } catch (const Error& e) {
      SLIME_FAIL(where(), e.message());
    }
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) SLIME_FAIL(where(), "not a JSON object: ", line.substr(0, 80));
    const auto step = j.find("step");
    if (step == j.end() || !step->is_number_integer()) SLIME_FAIL(where(), "missing integer field \"step\"");
    MetricsRecord r;
    r.step = step->get<int64_t>();
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it.key() == "step") continue;
      double v;
      if (it.value().is_number()) {
        v = it.value().get<double>();
      } else if (it.value().is_null()) {
        v = std::nan("");
      } else {
        SLIME_FAIL(where(), "field \"", it.key(), "\" is not a number");
      }
      if (it.key() == "time") {
        r.time = v;
      } else {
        r.values.emplace_back(it.key(), v);
      }
    }
    records.push_back(std::move(r));
  }
  return records;
}

class MetricsLog {
 public:
  explicit MetricsLog(const std::filesystem::path& jsonl_path, MetricsLogOptions options = {}) : path_(jsonl_path) {
    std::error_code ec;
    if (path_.has_parent_path()) std::filesystem::create_directories(path_.parent_path(), ec);
    SLIME_CHECK(!ec, "MetricsLog: cannot create directory '", path_.parent_path().string(), "': ", ec.message());
    if (options.resume_step && std::filesystem::exists(path_)) truncate_from(*options.resume_step);
    file_ = std::fopen(path_.c_str(), options.resume_step ? "ab" : "wb");
    SLIME_CHECK(file_ != nullptr, "MetricsLog: cannot open '", path_.string(), "': ", std::strerror(errno));
    if (options.tensorboard_dir) {
      tensorboard_ = std::make_unique<TensorBoardWriter>(*options.tensorboard_dir);
      if (options.resume_step) tensorboard_->add_session_start(*options.resume_step);
    }
  }

  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  ~MetricsLog() {
    if (file_ != nullptr) std::fclose(file_);
  }

  const std::filesystem::path& path() const { return path_; }
  TensorBoardWriter* tensorboard() { return tensorboard_.get(); }

  // Appends the step's line and flushes it; `time` < 0 means now. Names must
  // be unique and not "step" or "time".
  void log(int64_t step, const Scalars& values, double time = -1) {
    nlohmann::ordered_json j;
    j["step"] = step;
    j["time"] = time >= 0 ? time : detail::unix_time_now();
    for (const auto& [name, value] : values) {
      SLIME_CHECK(!name.empty() && name != "step" && name != "time", "MetricsLog: bad metric name '", name,
                  "' at step ", step);
      SLIME_CHECK(!j.contains(name), "MetricsLog: metric '", name, "' given twice at step ", step);
      if (std::isfinite(value)) {
        j[name] = value;
      } else {
        j[name] = nullptr;
      }
    }
    const std::string line = j.dump() + "\n";
    if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
      SLIME_FAIL("MetricsLog: write to '", path_.string(), "' failed: ", std::strerror(errno));
    }
    if (tensorboard_) tensorboard_->add_scalars(values, step);
  }

 private:
  // Keeps the lines with step < `step`, atomically (temp file + rename).
  void truncate_from(int64_t step) {
    std::string kept;
    require_regular_file(path_, "metrics log");
    std::ifstream in(path_, std::ios::binary);
    SLIME_CHECK(in.good(), "MetricsLog: cannot read '", path_.string(), "' to resume: ", std::strerror(errno));
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    in.close();
    // Parse to validate (errors name the line), then keep the original text
    // of the lines before the resume step.
    const std::vector<MetricsRecord> records = read_metrics_jsonl(path_);
    std::size_t pos = 0, r = 0;
    while (pos < text.size()) {
      const std::size_t end = text.find('\n', pos);
      if (end == std::string::npos) break;  // torn tail
      const std::string_view line(text.data() + pos, end - pos);
      if (line.find_first_not_of(" \t\r") != std::string_view::npos) {
        if (records[r].step < step) kept.append(line).push_back('\n');
        ++r;
      }
      pos = end + 1;
    }
    const std::filesystem::path tmp = path_.string() + ".tmp";
    {
      std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
      out << kept;
      out.flush();
      SLIME_CHECK(out.good(), "MetricsLog: cannot write '", tmp.string(), "'");
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path_, ec);
    SLIME_CHECK(!ec, "MetricsLog: cannot replace '", path_.string(), "': ", ec.message());
  }

  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

}  // namespace slime::io
