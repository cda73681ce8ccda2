// src/comm/local_comm_cuda.cu: the CUDA side of LocalComm groups on one
// device (slime/comm/local_comm.hpp): device-to-device copies, stream waits,
// scratch memory and the reduction over ranks, handed to
// src/comm/local_comm.cpp (built without CUDA) as detail::LocalCudaOps.
//
// The reduction kernel applies detail_reduce.hpp's rule, the same code the
// CPU fold runs, so its bits equal the CPU group's (f32 division and
// addition are IEEE here: the build uses neither fast math nor flush to
// zero, and the fold has no product to contract into an FMA).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "slime/comm/detail_reduce.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/core/host_sync.hpp"
#include "slime/core/memory.hpp"

namespace slime::comm::detail {
namespace {

constexpr int kThreads = 256;
// Grid-stride beyond this many blocks: a reduction is memory-bound, and this
// already keeps every SM of an H200 busy.
constexpr int64_t kMaxBlocks = 4096;

// Passed by value: the rank pointers sit in the kernel's parameter space.
struct ReduceParams {
  const void* inputs[kLocalCudaMaxRanks];  // [rank]: `count` elements of T
  void* out;                               // `count` elements of T
  int64_t count;
  int ranks;
  bool average;
};

template <class T, class Combine>
__global__ void __launch_bounds__(kThreads) reduce_over_ranks_kernel(ReduceParams p) {
  T* out = static_cast<T*>(p.out);
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < p.count; i += stride)
    out[i] = reduce_over_ranks<T, Combine>(p.inputs, p.ranks, i, p.average);
}

Stream stream_of(int device, void* stream) {
  return Stream::borrow(Device::cuda(device), static_cast<cudaStream_t>(stream));
}

void* allocate_scratch(int device, std::size_t bytes, void* stream) {
  return ::slime::allocate(MemoryKind::device, bytes, stream_of(device, stream));
}

void deallocate_scratch(int device, void* p, std::size_t bytes, void* stream) noexcept {
  ::slime::deallocate(MemoryKind::device, p, bytes, stream_of(device, stream));
}

void copy_bytes(int device, void* dst, const void* src, std::size_t bytes, void* stream) {
  DeviceGuard guard(Device::cuda(device));
  SLIME_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
}

void reduce_ranks(int device, const void* const* inputs, int ranks, void* out, int64_t count, DType dtype, ReduceOp op,
                  void* stream) {
  SLIME_CHECK(ranks >= 1 && ranks <= kLocalCudaMaxRanks, "LocalComm reduction on cuda:", device, " over ", ranks,
              " ranks; at most ", kLocalCudaMaxRanks);
  if (count == 0) return;
  ReduceParams p{};
  std::copy(inputs, inputs + ranks, p.inputs);
  p.out = out;
  p.count = count;
  p.ranks = ranks;
  DeviceGuard guard(Device::cuda(device));
  const unsigned blocks = unsigned(std::min<int64_t>((count + kThreads - 1) / kThreads, kMaxBlocks));
  visit_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    visit_reduce_op<T>(op, [&](auto combine, bool average) {
      p.average = average;
      reduce_over_ranks_kernel<T, decltype(combine)><<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
      SLIME_CUDA_CHECK_LAUNCH();
    });
  });
}

void synchronize_stream(int device, void* stream) {
  DeviceGuard guard(Device::cuda(device));
  note_host_sync();
  SLIME_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

}  // namespace

const LocalCudaOps& local_cuda_ops() {
  static constexpr LocalCudaOps ops{&allocate_scratch, &deallocate_scratch, &copy_bytes, &reduce_ranks,
                                    &synchronize_stream};
  return ops;
}

}  // namespace slime::comm::detail
