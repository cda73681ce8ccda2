// slime/core/macros.hpp: portability macros shared by host-only and nvcc builds.
#pragma once

// Functions usable from host and device code. Under nvcc they are forced
// inline on both sides; a host-only compiler sees a plain inline function, so
// every header builds without CUDA.
#if defined(__CUDACC__)
#define SLIME_HOST_DEVICE __forceinline__ __host__ __device__
#define SLIME_DEVICE __forceinline__ __device__
#else
#define SLIME_HOST_DEVICE inline
#define SLIME_DEVICE inline
#endif

// True when this translation unit can call the CUDA runtime (the build links
// slime::cuda, which defines SLIME_WITH_CUDA=1).
#if defined(SLIME_WITH_CUDA) && SLIME_WITH_CUDA
#define SLIME_HAS_CUDA 1
#else
#define SLIME_HAS_CUDA 0
#endif

// A CPU reference loop that is most of a CPU step's time (the GEMM
// micro-kernel): compiled at -O2 by GCC even in -O0 builds (the sanitizer
// build, Debug), which would otherwise run the examples 2.5x slower.
// Sanitizer instrumentation still applies. Empty for other compilers and
// under nvcc (whose host pass sees it otherwise).
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define SLIME_CPU_HOT_LOOP __attribute__((optimize("O2")))
#else
#define SLIME_CPU_HOT_LOOP
#endif
