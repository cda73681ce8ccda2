// libFuzzer harness: a safetensors file (8-byte header length, JSON header, data) through
// SafetensorsFile: header parsing and validation, then every tensor read and converted to f32.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.hpp"
#include "slime/core/error.hpp"
#include "slime/io/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const auto path = slime::fuzz::work_dir() / "model.safetensors";
  slime::fuzz::write_input(path, data, size);
  try {
    const slime::io::SafetensorsFile file(path);
    for (const std::string& name : file.names()) {
      try {
        (void)file.read(name);
        (void)file.read(name, slime::DType::f32);
      } catch (const slime::Error&) {
      }
    }
  } catch (const slime::Error&) {
  }
  return 0;
}
