// slime/ops/cuda/linear.hpp: host-callable cuBLAS GEMMs behind Linear (defined
// in src/ops/linear.cpp): a row-major GEMM and the three Linear products.
//
// Accumulation contract: parameter gradients accumulate (`+=`) into fp32;
// activation outputs are written (`=`), or added where `accumulate` is true.
//
// Numerics: bf16 or f32 operands, products summed in fp32
// (CUBLAS_COMPUTE_32F, with reduced-precision split-K reductions disallowed),
// rounded once into C. f32 operands do not use TF32 unless `allow_tf32`.
// Sizes: any, including 0 and leading dimensions that are not multiples of 8
// (cuBLAS then picks kernels without 16-byte vector access, which are slower:
// keep in/out features multiples of 8 and pointers 16-byte aligned for the
// fast path). Extents and leading dimensions must fit in int32.
// Determinism: run to run on the same GPU model with the same stream and
// workspace (cuBLAS's guarantee; each handle has its own fixed workspace).
//
// Handles: one cuBLAS handle per (thread, device), created on first use with
// a kCublasWorkspaceBytes workspace from slime's device pool and destroyed
// when the thread exits, so threads acting as ranks never share one. A call
// binds the handle to its stream; later calls allocate nothing.
#pragma once

#include <cstddef>
#include <cstdint>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"

#if SLIME_HAS_CUDA
namespace slime::ops::cuda {

// 32 MiB: what cuBLAS recommends on Hopper (its default pool uses the same).
inline constexpr std::size_t kCublasWorkspaceBytes = std::size_t(32) << 20;

// Row-major C[m, n] = alpha · op(A) · op(B) + beta · C, where op(A) is [m, k]
// and op(B) is [k, n]. A is stored [m, k] (trans_a = false) or [k, m]
// (trans_a = true) with row stride lda elements; B is stored [k, n] or [n, k]
// likewise with ldb; C is [m, n] with row stride ldc. beta = 0 never reads C
// (NaN in C does not propagate).
struct GemmParams {
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  DType ab_dtype = DType::bf16;  // A and B: bf16 or f32
  DType c_dtype = DType::bf16;   // C: ab_dtype or f32
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  bool trans_a = false, trans_b = false;
  float alpha = 1.f, beta = 0.f;
  bool allow_tf32 = false;  // f32 operands only
};

// Runs on `stream` of CUDA device `device` (any current device on entry; it is
// restored). Throws slime::Error for unsupported dtypes, sizes past int32, and
// any cuBLAS failure.
void gemm(const GemmParams& p, int device, StreamHandle stream);

// y [tokens, out] = x [tokens, in] · w [out, in]ᵀ
void linear_forward(const void* x, const void* w, void* y, DType in_dtype, DType out_dtype, int64_t tokens,
                    int64_t in_features, int64_t out_features, int device, StreamHandle stream);

// dx [tokens, in] (=|+=) dy [tokens, out] · w [out, in]
void linear_backward_input(const void* dy, const void* w, void* dx, DType in_dtype, DType out_dtype, int64_t tokens,
                           int64_t in_features, int64_t out_features, bool accumulate, int device, StreamHandle stream);

// dw [out, in] (f32) += dy [tokens, out]ᵀ · x [tokens, in]
void linear_backward_weight(const void* dy, const void* x, float* dw, DType in_dtype, int64_t tokens,
                            int64_t in_features, int64_t out_features, int device, StreamHandle stream);

}  // namespace slime::ops::cuda
#endif
