// libFuzzer harness: a Hugging Face config.json through the model-config readers (Qwen3 and
// Qwen3-MoE, Qwen3-VL's text and vision configs), and to_json -> from_json for what is accepted.
// The text is parsed in memory, as from_file does after reading the file (read_regular_file is
// covered by the other harnesses), so that more inputs run per second.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "slime/core/error.hpp"
#include "slime/core/json.hpp"
#include "slime/nn/config.hpp"
#include "slime/nn/qwen3_vl.hpp"
#include "slime/nn/vision_config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  nlohmann::json j;
  try {
    j = slime::parse_json(std::string_view(reinterpret_cast<const char*>(data), size), "config 'fuzz'");
  } catch (const slime::Error&) {
    return 0;
  }
  try {
    const slime::nn::Qwen3Config c = slime::nn::Qwen3Config::from_json(j, "fuzz");
    const slime::nn::Qwen3Config again = slime::nn::Qwen3Config::from_json(c.to_json(), "round trip");
    if (again.to_json() != c.to_json()) __builtin_trap();
  } catch (const slime::Error&) {
  }
  try {
    (void)slime::nn::Qwen3VLVisionConfig::from_json(j, "fuzz");
  } catch (const slime::Error&) {
  }
  try {
    (void)slime::nn::Qwen3VLConfig::from_json(j, "fuzz");
  } catch (const slime::Error&) {
  }
  return 0;
}
