// Consumer of an installed slime: uses tensors, the RNG and LocalComm, and
// exits non-zero if anything is off.
#include <atomic>
#include <cstdio>
#include <vector>

#include "slime/comm/local_comm.hpp"
#include "slime/core/random.hpp"
#include "slime/core/tensor.hpp"

int main() {
  slime::Tensor t = slime::Tensor::empty({3, 5}, slime::DType::bf16);
  slime::fill_uniform(t, 1, 0, -1.f, 1.f);
  std::atomic<int> ok{0};
  slime::comm::run_local_ranks(3, [&](slime::comm::Comm& comm) {
    slime::Tensor x = slime::Tensor::from_vector(std::vector<int64_t>{comm.rank() + 1}, {1});
    comm.all_reduce(x);
    ok += x.to_vector<int64_t>()[0] == 6;
  });
  std::printf("slime consumer: built_with_cuda=%d, all_reduce %s\n", int(slime::built_with_cuda()),
              ok == 3 ? "ok" : "WRONG");
  return ok == 3 ? 0 : 1;
}
