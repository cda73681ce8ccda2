// Metrics JSONL: lines written and flushed per step, read back; resume drops
// steps >= the resume step and a torn last line; TensorBoard mirroring.
#include <unistd.h>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "slime/io/metrics_log.hpp"

namespace fs = std::filesystem;
using slime::io::MetricsLog;
using slime::io::MetricsLogOptions;
using slime::io::read_metrics_jsonl;

namespace {

fs::path fresh_dir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("slime_metrics_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir;
}

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<int64_t> steps_of(const fs::path& path) {
  std::vector<int64_t> steps;
  for (const auto& r : read_metrics_jsonl(path)) steps.push_back(r.step);
  return steps;
}

void write_steps(MetricsLog& log, int64_t from, int64_t to, double offset = 0) {
  for (int64_t s = from; s < to; ++s) log.log(s, {{"reward", 0.1 * double(s) + offset}, {"loss", 1.0 / double(s + 1)}});
}

}  // namespace

TEST_CASE("MetricsLog writes one flushed JSON object per step", "[io][metrics]") {
  const fs::path dir = fresh_dir("write");
  const fs::path path = dir / "sub" / "metrics.jsonl";
  MetricsLog log(path);
  log.log(0, {{"reward", 0.5}, {"loss", -1.25}, {"kl", 1e-4}, {"tokens_per_s", 1500}}, /*time=*/1000.5);
  // Flushed: the line is on disk while the log is open.
  CHECK(read_all(path) ==
        "{\"step\":0,\"time\":1000.5,\"reward\":0.5,\"loss\":-1.25,\"kl\":0.0001,\"tokens_per_s\":1500.0}\n");
  log.log(1, {{"reward", std::nan("")}, {"loss", INFINITY}});
  const auto records = read_metrics_jsonl(path);
  REQUIRE(records.size() == 2);
  CHECK(records[0].step == 0);
  CHECK(records[0].time == 1000.5);
  REQUIRE(records[0].values.size() == 4);
  CHECK(records[0].values[0] == std::pair<std::string, double>("reward", 0.5));
  CHECK(records[0].values[3] == std::pair<std::string, double>("tokens_per_s", 1500));
  CHECK(records[1].step == 1);
  CHECK(records[1].time > 1.6e9);  // now, in unix seconds
  REQUIRE(records[1].values.size() == 2);
  CHECK(std::isnan(records[1].values[0].second));  // written as null
  CHECK(std::isnan(records[1].values[1].second));
  CHECK_THAT(read_all(path), Catch::Matchers::ContainsSubstring("\"reward\":null,\"loss\":null}"));
  fs::remove_all(dir);
}

TEST_CASE("MetricsLog without resume starts a new file", "[io][metrics]") {
  const fs::path dir = fresh_dir("fresh");
  const fs::path path = dir / "metrics.jsonl";
  {
    MetricsLog log(path);
    write_steps(log, 0, 5);
  }
  {
    MetricsLog log(path);
    write_steps(log, 0, 2);
  }
  CHECK(steps_of(path) == std::vector<int64_t>{0, 1});
  fs::remove_all(dir);
}

TEST_CASE("MetricsLog resume drops steps at and after the resume step", "[io][metrics]") {
  const fs::path dir = fresh_dir("resume");
  const fs::path path = dir / "metrics.jsonl";
  {
    MetricsLog log(path);
    write_steps(log, 0, 10);
  }
  const std::string first = read_all(path);
  {
    // The checkpoint was taken after step 5 ran; the run resumes at 6.
    MetricsLog log(path, {.resume_step = 6});
    CHECK(steps_of(path) == std::vector<int64_t>{0, 1, 2, 3, 4, 5});
    // The lines kept are byte-identical to those written first.
    const std::string kept = read_all(path);
    CHECK(kept == first.substr(0, kept.size()));
    CHECK(kept.back() == '\n');
    write_steps(log, 6, 12, /*offset=*/100);
  }
  const auto records = read_metrics_jsonl(path);
  REQUIRE(records.size() == 12);
  for (int64_t s = 0; s < 12; ++s) {
    CHECK(records[s].step == s);
    CHECK(records[s].values.at(0).second == 0.1 * double(s) + (s >= 6 ? 100 : 0));
  }
  CHECK_FALSE(fs::exists(path.string() + ".tmp"));

  SECTION("resume at 0 empties the file") {
    { MetricsLog log(path, {.resume_step = 0}); }
    CHECK(read_all(path).empty());
  }
  SECTION("resume past the end keeps everything") {
    { MetricsLog log(path, {.resume_step = 100}); }
    CHECK(steps_of(path).size() == 12);
  }
  fs::remove_all(dir);
}

TEST_CASE("MetricsLog resume drops a torn last line and creates a missing file", "[io][metrics]") {
  const fs::path dir = fresh_dir("torn");
  const fs::path path = dir / "metrics.jsonl";
  {
    MetricsLog log(path);
    write_steps(log, 0, 4);
  }
  // A crash in the middle of writing step 4.
  { std::ofstream(path, std::ios::app | std::ios::binary) << "{\"step\":4,\"time\":17"; }
  CHECK_THROWS_WITH(read_metrics_jsonl(path, /*allow_torn_tail=*/false),
                    Catch::Matchers::ContainsSubstring("metrics.jsonl:5: not a JSON object"));
  CHECK(steps_of(path).size() == 4);
  {
    MetricsLog log(path, {.resume_step = 4});
    write_steps(log, 4, 6);
  }
  CHECK(steps_of(path) == std::vector<int64_t>{0, 1, 2, 3, 4, 5});
  CHECK(read_all(path).find("17{") == std::string::npos);

  const fs::path missing = dir / "new" / "m.jsonl";
  {
    MetricsLog log(missing, {.resume_step = 3});
    write_steps(log, 3, 4);
  }
  CHECK(steps_of(missing) == std::vector<int64_t>{3});
  fs::remove_all(dir);
}

TEST_CASE("MetricsLog resume rejects a corrupt line that is not the last", "[io][metrics]") {
  const fs::path dir = fresh_dir("corrupt");
  const fs::path path = dir / "metrics.jsonl";
  fs::create_directories(dir);
  const std::string text = "{\"step\":0,\"time\":1}\n\n{\"step\":\"one\"}\n{\"step\":2,\"time\":1}\n";
  { std::ofstream(path) << text; }
  CHECK_THROWS_WITH(MetricsLog(path, {.resume_step = 1}),
                    Catch::Matchers::ContainsSubstring("metrics.jsonl:3: missing integer field \"step\""));
  // The file is left as it was.
  CHECK(read_all(path) == text);
  { std::ofstream(path) << "{\"step\":0,\"time\":1,\"x\":\"a\"}\n"; }
  CHECK_THROWS_WITH(read_metrics_jsonl(path), Catch::Matchers::ContainsSubstring(":1: field \"x\" is not a number"));
  { std::ofstream(path) << "[1,2]\n"; }
  CHECK_THROWS_WITH(read_metrics_jsonl(path), Catch::Matchers::ContainsSubstring(":1: not a JSON object"));
  fs::remove_all(dir);
}

TEST_CASE("MetricsLog rejects bad metric names", "[io][metrics]") {
  const fs::path dir = fresh_dir("names");
  MetricsLog log(dir / "m.jsonl");
  CHECK_THROWS_WITH(log.log(0, {{"step", 1}}), Catch::Matchers::ContainsSubstring("bad metric name 'step'"));
  CHECK_THROWS_WITH(log.log(0, {{"time", 1}}), Catch::Matchers::ContainsSubstring("bad metric name 'time'"));
  CHECK_THROWS_WITH(log.log(0, {{"", 1}}), Catch::Matchers::ContainsSubstring("bad metric name"));
  CHECK_THROWS_WITH(log.log(0, {{"a", 1}, {"a", 2}}), Catch::Matchers::ContainsSubstring("'a' given twice"));
  CHECK(read_all(log.path()).empty());  // nothing half-written
  fs::remove_all(dir);
}

TEST_CASE("MetricsLog mirrors scalars to TensorBoard", "[io][metrics]") {
  const fs::path dir = fresh_dir("tb");
  fs::path event_file;
  {
    MetricsLog log(dir / "metrics.jsonl", {.tensorboard_dir = dir / "tb"});
    REQUIRE(log.tensorboard() != nullptr);
    event_file = log.tensorboard()->path();
    write_steps(log, 0, 3);
  }
  {
    MetricsLog log(dir / "metrics.jsonl", {.resume_step = 2, .tensorboard_dir = dir / "tb"});
    write_steps(log, 2, 4);
  }
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir / "tb")) files.push_back(e.path());
  CHECK(files.size() == 2);  // one event file per run
  // The first run's file: version record, then one record per step, each
  // holding the step's two scalars: 4 records.
  const std::string bytes = read_all(event_file);
  std::size_t pos = 0;
  int records = 0;
  while (pos + 12 <= bytes.size()) {
    uint64_t length = 0;
    for (int i = 0; i < 8; ++i) length |= uint64_t(uint8_t(bytes[pos + i])) << (8 * i);
    pos += 12 + length + 4;
    ++records;
  }
  CHECK(pos == bytes.size());
  CHECK(records == 4);
  CHECK(bytes.find("reward") != std::string::npos);
  CHECK(bytes.find("loss") != std::string::npos);
  CHECK(steps_of(dir / "metrics.jsonl") == std::vector<int64_t>{0, 1, 2, 3});
  fs::remove_all(dir);
}
