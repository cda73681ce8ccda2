// Consumer of an installed slime: uses tensors, the RNG, LocalComm and a
// safetensors round trip (the last two from the compiled slime::core), and
// exits non-zero if anything is off.
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "slime/comm/local_comm.hpp"
#include "slime/core/random.hpp"
#include "slime/core/tensor.hpp"
#include "slime/io/safetensors.hpp"

int main() {
  slime::Tensor t = slime::Tensor::empty({3, 5}, slime::DType::bf16);
  slime::fill_uniform(t, 1, 0, -1.f, 1.f);
  std::atomic<int> ok{0};
  slime::comm::run_local_ranks(3, [&](slime::comm::Comm& comm) {
    slime::Tensor x = slime::Tensor::from_vector(std::vector<int64_t>{comm.rank() + 1}, {1});
    comm.all_reduce(x);
    ok += x.to_vector<int64_t>()[0] == 6;
  });
  const std::filesystem::path file =
      std::filesystem::temp_directory_path() / ("slime-consumer-" + std::to_string(::getpid()) + ".safetensors");
  const std::vector<float> values{1.5f, -2.f, 3.25f};
  slime::io::write_safetensors(file, {{"v", slime::Tensor::from_vector(values, {3})}});
  const bool round_trip = slime::io::SafetensorsFile(file).read("v").to_vector<float>() == values;
  std::filesystem::remove(file);
  std::printf("slime consumer: built_with_cuda=%d, all_reduce %s, safetensors %s\n", int(slime::built_with_cuda()),
              ok == 3 ? "ok" : "WRONG", round_trip ? "ok" : "WRONG");
  return ok == 3 && round_trip ? 0 : 1;
}
