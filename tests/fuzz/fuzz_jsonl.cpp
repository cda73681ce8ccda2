// libFuzzer harness: JSONL text through the line parser and the sample and prompt readers, line
// by line as JsonlReader hands them out (the file layer is covered by the other harnesses; in
// memory more inputs run per second). Every error must name the file and line.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "slime/core/error.hpp"
#include "slime/data/prompt_dataset.hpp"
#include "slime/data/sample.hpp"

namespace {

void require_names_line(const slime::Error& e) {
  if (std::string_view(e.what()).find("fuzz.jsonl:") == std::string_view::npos) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  static const std::string file = "fuzz.jsonl";
  const slime::data::JsonlOptions options{.vocab_size = 1000};
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  for (int64_t line_no = 1; !rest.empty(); ++line_no) {
    const std::size_t end = rest.find('\n');
    std::string_view line = rest.substr(0, end);
    rest = end == std::string_view::npos ? std::string_view() : rest.substr(end + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
    const slime::data::detail::JsonlWhere at{&file, line_no};
    try {
      const nlohmann::json j = slime::data::detail::parse_line(line, at);
      try {
        (void)slime::data::sample_from_json(j, options, at);
      } catch (const slime::Error& e) {
        require_names_line(e);
      }
      (void)slime::data::prompt_from_json(j, options, at);
    } catch (const slime::Error& e) {
      require_names_line(e);
    }
  }
  return 0;
}
