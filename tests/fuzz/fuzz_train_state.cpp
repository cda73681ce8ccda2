// libFuzzer harness: a checkpoint's metadata.json (training-state metadata of step 1) through
// TrainStateReader, then the user metadata it holds (a copy, and a DataPosition read from it).
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.hpp"
#include "slime/core/error.hpp"
#include "slime/data/shuffle.hpp"
#include "slime/io/train_state.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  const auto dir = slime::fuzz::work_dir() / "checkpoints";
  const auto step = slime::io::train_state_step_dir(dir, 1);
  // Rank files 0..3 exist (empty), so that metadata naming up to 4 ranks reaches the tensor list.
  static const bool made = [&] {
    std::filesystem::create_directories(step);
    for (int r = 0; r < 4; ++r)
      slime::fuzz::write_input(step / ("rank_" + std::to_string(r) + ".safetensors"), nullptr, 0);
    return true;
  }();
  (void)made;
  slime::fuzz::write_input(step / slime::io::kTrainStateMetadataFile, data, size);
  try {
    const slime::io::TrainStateReader reader(dir, 1);
    const nlohmann::json copy = reader.metadata();
    (void)reader.names();
    if (copy.is_object() && copy.contains("data")) (void)slime::data::DataPosition::from_json(copy["data"]);
  } catch (const slime::Error&) {
  }
  return 0;
}
