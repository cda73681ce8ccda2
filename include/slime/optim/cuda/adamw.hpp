// slime/optim/cuda/adamw.hpp: host-callable launchers of the multi-tensor CUDA
// kernels of slime::optim (src/optim/adamw.cu): the AdamW update and the sum
// of squares behind the global gradient norm. Declarations only (no CUDA
// syntax); the Tensor-level API in slime/optim/adamw.hpp and grad_clip.hpp
// checks the arguments and calls these.
//
// Multi-tensor launch (as apex's multi_tensor_apply): every tensor is cut into
// chunks of kMultiTensorChunk elements, and one kernel launch covers the
// chunks of up to a table's worth of tensors; the table (pointers, sizes,
// first chunk of each tensor) travels in the kernel's argument struct, so a
// launch needs no device memory and no host-to-device copy, and can be
// captured in a CUDA graph. A block finds its tensor by binary search over
// the table. More tensors than one table holds take several launches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"

#if SLIME_HAS_CUDA
namespace slime::optim::cuda {

// Elements per chunk (one block each); a multiple of every vector width.
inline constexpr int64_t kMultiTensorChunk = 65536;

// The per-step scalars of the AdamW update, rounded to fp32 once on the host
// (as PyTorch rounds its Python-float scalars for an fp32 tensor op).
struct AdamWScalars {
  float decay;        // 1 - lr * weight_decay
  float lerp_weight;  // 1 - beta1
  float beta2;
  float one_minus_beta2;        // 1 - beta2
  float step_size;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float eps;
  float grad_scale;
  // Optional (nullptr: none): a device float the kernel multiplies grad_scale
  // by (clip_factor_on_device's factor). When it is not finite the launch
  // updates nothing: parameters, moments and copies keep their values.
  const float* device_grad_scale = nullptr;
};

// One tensor group: fp32 param, grad, exp_avg, exp_avg_sq of `numel`
// elements; maybe_param_copy (nullptr for none) of copy_dtype f32 or bf16.
struct AdamWTensorArgs {
  float* param;
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* maybe_param_copy;
  DType copy_dtype;
  int64_t numel;
};

// The AdamW update of every group, in ceil(groups / table size) launches on
// `stream`. Deterministic (elementwise).
void adamw_multi_tensor(std::span<const AdamWTensorArgs> tensors, const AdamWScalars& scalars, StreamHandle stream);

// Bytes of device workspace sum_of_squares_multi_tensor needs for tensors of
// these element counts (one fp32 partial per chunk, plus the fp64 result).
std::size_t sum_of_squares_workspace_bytes(std::span<const int64_t> numels);

// The sum over tensors and elements of x^2, as an fp64 value written to the
// first 8 bytes of `workspace` (device memory of
// sum_of_squares_workspace_bytes(numels) bytes, 8-byte aligned): fp32 partial
// sums per chunk (a fixed tree per block), then one block adds the partials in
// chunk order in fp64. Deterministic run to run; NaN and inf propagate.
// With sum_f32, the sum is also written there rounded to fp32 (the value a
// gradient norm all-reduces over ranks).
void sum_of_squares_multi_tensor(std::span<const float* const> data, std::span<const int64_t> numels, void* workspace,
                                 StreamHandle stream, float* sum_f32 = nullptr);
// The sums of squares of 1 or 2 gradient groups on the device: group i's is
// *f64[i] when given (one device's sum, no ranks), else f32[i] (all-reduced
// over ranks in fp32).
struct NormSums {
  const float* f32[2] = {nullptr, nullptr};
  const double* f64[2] = {nullptr, nullptr};
  int count = 1;
};
// The global gradient norm and torch.nn.utils.clip_grad_norm_'s factor,
// computed on the device in fp64 with the host's operations
// (optim::global_grad_norm, optim::clip_coefficient): nᵢ = sqrt(sumᵢ),
// norm = n₀ for one group, sqrt(n₀² + n₁²) for two (as Sharded adds a dense
// and an expert norm); factor = min(1, max_norm / (norm + 1e-6)) rounded to
// fp32, or NaN when the norm is not finite (adamw_multi_tensor then skips the
// update). Writes *norm and *factor.
void clip_factor_on_device(const NormSums& sums, double max_norm, double* norm, float* factor, StreamHandle stream);

}  // namespace slime::optim::cuda
#endif
