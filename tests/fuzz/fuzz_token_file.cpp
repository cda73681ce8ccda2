// libFuzzer harness: a slime token file (header + uint32 ids) through TokenFile: header and size
// checks on open, then the vocabulary scan.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.hpp"
#include "slime/core/error.hpp"
#include "slime/data/token_file.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const auto path = slime::fuzz::work_dir() / "data.u32";
  slime::fuzz::write_input(path, data, size);
  try {
    const slime::data::TokenFile file(path);
    uint64_t sum = 0;
    for (uint32_t t : file.tokens()) sum += t;
    (void)sum;
    file.check_vocab(1000);
  } catch (const slime::Error&) {
  }
  return 0;
}
