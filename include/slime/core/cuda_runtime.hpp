// slime/core/cuda_runtime.hpp: the CUDA runtime where the build has it
// (SLIME_WITH_CUDA), a stand-in handle type where it does not, and
// SLIME_CUDA_CHECK.
#pragma once

#include "slime/core/error.hpp"
#include "slime/core/macros.hpp"

#if SLIME_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace slime {

#if SLIME_HAS_CUDA
using StreamHandle = cudaStream_t;
using EventHandle = cudaEvent_t;
#else
using StreamHandle = void*;
using EventHandle = void*;
#endif

namespace detail {
#if SLIME_HAS_CUDA
// Throws for a failed CUDA call. cudaGetLastError() resets the runtime's
// last-error state, so the next check does not report this failure again
// (errors that poison the context, such as an illegal address, stay sticky:
// nothing can clear those but a process restart).
[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  (void)cudaGetLastError();
  throw_error(file, line,
              concat("CUDA error ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ") in ", expr));
}
#endif
}  // namespace detail
}  // namespace slime

#if SLIME_HAS_CUDA
#define SLIME_CUDA_CHECK(expr)                                                               \
  do {                                                                                       \
    const cudaError_t slime_cuda_err_ = (expr);                                              \
    if (slime_cuda_err_ != cudaSuccess) [[unlikely]]                                         \
      ::slime::detail::throw_cuda_error(slime_cuda_err_, #expr, __FILE__, __LINE__);         \
  } while (0)
// After a kernel launch: reports a bad launch configuration at once.
#define SLIME_CUDA_CHECK_LAUNCH() SLIME_CUDA_CHECK(cudaGetLastError())
#endif
