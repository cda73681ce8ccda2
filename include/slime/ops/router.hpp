// slime/ops/router.hpp: the Qwen3-MoE router (softmax over experts, top-k,
// optional renormalisation of the top-k weights) and the load-balancing
// auxiliary loss, forward and backward, on the CPU or the GPU; the auxiliary
// loss also from per-expert statistics summed over data-parallel ranks
// (router_aux_stats and the _from_stats calls, at the end of this file).
//
// Accumulation contract: parameter gradients accumulate (`+=`) into fp32
// tensors (the gate weight's, through linear_backward_weight); activation
// gradients are written (`=`), or added (`+=`) when `accumulate` is true.
//
// Exactly transformers' Qwen3MoeSparseMoeBlock.forward and
// load_balancing_loss_func (modeling_qwen3_moe.py; formulas and the commit
// followed are in ops/cpu/router.hpp):
//   logits  [T, E]  = hidden · gate.weightᵀ, in the hidden dtype (HF: the gate
//                     is an nn.Linear in the model dtype, so bf16 logits for a
//                     bf16 model); compute them with linear_forward (a bf16
//                     output matches HF, an f32 output is more precise).
//   probs   [T, E]  = softmax(logits) in fp32 (HF: dtype=torch.float), kept
//                     for the backward and the auxiliary loss.
//   indices [T, k]  = top-k experts by probability, descending; ties go to
//                     the lower expert id. i32.
//   weights [T, k]  = the top-k probabilities, divided by their sum when
//                     norm_topk_prob, cast to the hidden dtype (the logits'
//                     dtype; f32 also allowed).
//   aux loss        = E · Σ_e (count_e / N) · (mean_t probs[t, e]) over N rows,
//                     count_e = number of the N·k choices that picked e; the
//                     caller multiplies by router_aux_loss_coef. HF evaluates
//                     it once over the logits of all MoE layers concatenated:
//                     put every layer's probs and indices in one [L·T, E] /
//                     [L·T, k] buffer (router_forward takes slice_rows views)
//                     and call the aux functions on the whole buffer.
// Differences from HF: the aux loss uses the router's fp32 probabilities and
// its top-k (HF recomputes softmax in the logits' dtype and its own top-k,
// which can differ on rounding ties); 0 rows give loss 0 (HF: NaN).
// Gradients treat the top-k selection as constant; the aux loss's gradient
// flows only through the mean probabilities (the counts are constant).
//
// GPU (src/ops/router.cu): E <= 256 experts (cuda::kRouterMaxExperts), any k
// in [1, E] (k <= 8 is the fast path). Same top-k rule (ties to the lower
// id); probs differ from the CPU's in the last bits (expf and the order of
// the softmax sum), so a near tie (two probabilities within an ulp or two)
// may be ordered differently. Deterministic run to run (no float atomics).
// The auxiliary loss stays on the device (loss is a device f32 [1]) and needs
// a workspace of router_aux_loss_workspace_bytes(rows, E) bytes: pass one to
// allocate nothing in the steady state, or leave it undefined and the call
// allocates it. Expert ids are not validated on the GPU (that would need a
// device-to-host copy): an id outside [0, E) is skipped by the backward and
// by the auxiliary loss's counts.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/router.hpp"
#include "slime/ops/cuda/router.hpp"
#include "slime/ops/elementwise.hpp"

namespace slime::ops {

namespace detail::moe_router {

// The GPU path's limit on the number of experts.
inline void check_gpu_experts(int64_t experts, std::string_view op) {
  SLIME_CHECK(experts <= cuda::kRouterMaxExperts, op, ": the CUDA path takes at most ", cuda::kRouterMaxExperts,
              " experts, got ", experts);
}

inline void check_2d(const Tensor& t, std::string_view op, std::string_view name, std::string_view dims) {
  SLIME_CHECK(t.defined(), op, ": ", name, " is undefined");
  SLIME_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D ", dims, ", got ", t.str());
}

inline void check_f32_bf16(const Tensor& t, std::string_view op, std::string_view name) {
  SLIME_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, op, ": ", name, " must be f32 or bf16, got ",
              t.str());
}

// probs [rows, E] f32 with E >= 1.
inline void check_probs(const Tensor& probs, std::string_view op) {
  check_2d(probs, op, "probs", "[rows, experts]");
  SLIME_CHECK(probs.dtype() == DType::f32, op, ": probs must be f32, got ", probs.str());
  SLIME_CHECK(probs.size(1) >= 1, op, ": probs needs at least one expert, got ", probs.str());
}

// probs [rows, E] f32 and indices [rows, k] i32 with 1 <= k <= E, one device.
inline void check_probs_indices(const Tensor& probs, const Tensor& indices, std::string_view op) {
  check_probs(probs, op);
  check_2d(indices, op, "indices", "[rows, k]");
  SLIME_CHECK(indices.dtype() == DType::i32, op, ": indices must be i32, got ", indices.str());
  SLIME_CHECK(indices.size(0) == probs.size(0), op, ": indices must have ", probs.size(0), " rows (probs's), got ",
              indices.str());
  SLIME_CHECK(indices.size(1) >= 1 && indices.size(1) <= probs.size(1), op, ": k = ", indices.size(1),
              " (indices dim 1) must be in [1, num_experts = ", probs.size(1), "]");
  check_same_device(probs, indices, std::string(op) + ": probs", "indices");
}

// Every expert id in [0, E) (the CPU path reads them as array indices).
inline void check_ids(const Tensor& indices, int64_t experts, std::string_view op) {
  const int32_t* p = indices.data<int32_t>();
  for (int64_t i = 0; i < indices.numel(); ++i)
    SLIME_CHECK(p[i] >= 0 && p[i] < experts, op, ": indices[", i / indices.size(1), ", ", i % indices.size(1),
                "] = ", p[i], " is not an expert id in [0, ", experts, ")");
}

// A gradient of the logits: [rows, E], f32 or bf16.
inline void check_dlogits(const Tensor& dlogits, const Tensor& probs, std::string_view op) {
  SLIME_CHECK(dlogits.defined(), op, ": dlogits is undefined");
  SLIME_CHECK(dlogits.shape() == probs.shape(), op, ": dlogits must have shape ", probs.shape(), " (probs's), got ",
              dlogits.str());
  check_f32_bf16(dlogits, op, "dlogits");
  check_same_device(dlogits, probs, std::string(op) + ": dlogits", "probs");
}

using detail::memops::visit_f32_bf16;  // f32 or bf16, checked before

}  // namespace detail::moe_router

// Bytes of GPU workspace router_aux_loss_forward / _backward need for probs
// [rows, experts] (0 in a build without CUDA; the CPU path needs none).
inline std::size_t router_aux_loss_workspace_bytes(int64_t rows, int64_t experts) {
  SLIME_CHECK(rows >= 0 && experts >= 1, "router_aux_loss_workspace_bytes: need rows >= 0 and experts >= 1, got ", rows,
              " and ", experts);
#if SLIME_HAS_CUDA
  return cuda::router_aux_loss_workspace_bytes(rows, experts);
#else
  return 0;
#endif
}

namespace detail::moe_router {

// The caller's GPU workspace (checked: device, size, alignment, no overlap
// with the call's tensors) or a fresh one of `bytes` bytes on `s`.
inline Tensor aux_workspace(const Tensor& workspace, std::size_t bytes, const Tensor& probs, const Tensor& indices,
                            const Tensor& out, const Stream& s, std::string_view op) {
  if (!workspace.defined())
    return Tensor::empty({int64_t(std::max<std::size_t>(bytes, 1))}, DType::u8, probs.device(), s);
  check_same_device(workspace, probs, std::string(op) + ": workspace", "probs");
  SLIME_CHECK(workspace.nbytes() >= bytes, op, ": workspace has ", workspace.nbytes(), " bytes, needs ", bytes,
              " (router_aux_loss_workspace_bytes)");
  SLIME_CHECK(reinterpret_cast<std::uintptr_t>(workspace.data_ptr()) % 16 == 0, op,
              ": workspace must be 16-byte aligned");
  for (const Tensor* t : {&probs, &indices, &out})
    SLIME_CHECK(!memops::overlap(workspace, *t), op, ": workspace overlaps a tensor of the call");
  return workspace;
}

}  // namespace detail::moe_router

namespace detail::moe_router {

// router_forward and router_forward_replay: `replay` reads indices instead of
// writing them.
inline void forward(std::string_view op, const Tensor& logits, bool norm_topk_prob, const Tensor& probs,
                    const Tensor& indices, const Tensor& weights, bool replay, [[maybe_unused]] const Stream& stream) {
  check_2d(logits, op, "logits", "[tokens, experts]");
  check_f32_bf16(logits, op, "logits");
  SLIME_CHECK(probs.defined() && probs.shape() == logits.shape(), op, ": probs must have shape ", logits.shape(),
              " (logits's), got ", probs.str());
  check_probs_indices(probs, indices, op);
  const int64_t tokens = logits.size(0), experts = logits.size(1), k = indices.size(1);
  SLIME_CHECK(weights.defined() && weights.shape() == indices.shape(), op, ": weights must have shape ",
              indices.shape(), " (indices's), got ", weights.str());
  SLIME_CHECK(weights.dtype() == logits.dtype() || weights.dtype() == DType::f32, op,
              ": weights must be the logits' dtype or f32, got ", weights.str(), " for logits ", logits.str());
  const std::string what = std::string(op) + ": logits";
  check_same_device(logits, probs, what, "probs");
  check_same_device(logits, weights, what, "weights");
  if (logits.device().is_cuda()) {
#if SLIME_HAS_CUDA
    check_gpu_experts(experts, op);
    const Stream s = detail::memops::stream_for(logits.device(), stream, op);
    DeviceGuard guard(logits.device());
    cuda::RouterForwardParams params{
        logits.data_ptr(),       logits.dtype(),     tokens,          experts, k, norm_topk_prob, probs.data<float>(),
        indices.data<int32_t>(), weights.data_ptr(), weights.dtype(), replay};
    cuda::router_forward(params, s.handle());
    return;
#else
    detail::memops::fail_no_cuda(op);
#endif
  }
  visit_f32_bf16(logits.dtype(), [&](auto lt) {
    using T = decltype(lt);
    visit_f32_bf16(weights.dtype(), [&](auto wt) {
      using TW = decltype(wt);
      cpu::router_forward(logits.data<T>(), tokens, experts, k, norm_topk_prob, probs.data<float>(),
                          indices.data<int32_t>(), weights.data<TW>(), replay);
    });
  });
}

}  // namespace detail::moe_router

// probs [T, E] f32, indices [T, k] i32 and weights [T, k] (logits' dtype or
// f32) from logits [T, E] (bf16 or f32); k = indices.size(1), 1 <= k <= E.
inline void router_forward(const Tensor& logits, bool norm_topk_prob, const Tensor& probs, const Tensor& indices,
                           const Tensor& weights, const Stream& stream = {}) {
  detail::moe_router::forward("router_forward", logits, norm_topk_prob, probs, indices, weights, false, stream);
}

// Routing replay (rollout routing replay: the trainer routes each token to
// the experts the rollout engine chose): as router_forward, but indices [T, k]
// is read, not written. weights[t, j] = probs[t, indices[t, j]], divided by
// the sum over the row's valid slots when norm_topk_prob (0 where that sum is
// 0); an id outside [0, E) weighs 0 (and the dispatch drops its copy, as any
// such id). Replaying
// router_forward's own indices gives its weights bit for bit (same device).
// router_backward takes the replayed indices as it takes the top-k.
inline void router_forward_replay(const Tensor& logits, bool norm_topk_prob, const Tensor& indices, const Tensor& probs,
                                  const Tensor& weights, const Stream& stream = {}) {
  detail::moe_router::forward("router_forward_replay", logits, norm_topk_prob, probs, indices, weights, true, stream);
}

// dlogits [T, E] (bf16 or f32; = or += with accumulate) from dweights [T, k]
// (the gradient of router_forward's weights; bf16 or f32), the saved probs
// and indices, and the same norm_topk_prob. The top-k selection is constant.
inline void router_backward(const Tensor& probs, const Tensor& indices, const Tensor& dweights, bool norm_topk_prob,
                            const Tensor& dlogits, bool accumulate = false,
                            [[maybe_unused]] const Stream& stream = {}) {
  constexpr std::string_view op = "router_backward";
  namespace r = detail::moe_router;
  r::check_probs_indices(probs, indices, op);
  SLIME_CHECK(dweights.defined() && dweights.shape() == indices.shape(), op, ": dweights must have shape ",
              indices.shape(), " (indices's), got ", dweights.str());
  r::check_f32_bf16(dweights, op, "dweights");
  check_same_device(dweights, probs, "router_backward: dweights", "probs");
  r::check_dlogits(dlogits, probs, op);
  if (probs.device().is_cuda()) {
#if SLIME_HAS_CUDA
    r::check_gpu_experts(probs.size(1), op);
    const Stream s = detail::memops::stream_for(probs.device(), stream, op);
    DeviceGuard guard(probs.device());
    cuda::router_backward(
        {probs.data<float>(), indices.data<int32_t>(), dweights.data_ptr(), dweights.dtype(), probs.size(0),
         probs.size(1), indices.size(1), norm_topk_prob, dlogits.data_ptr(), dlogits.dtype(), accumulate},
        s.handle());
    return;
#else
    detail::memops::fail_no_cuda(op);
#endif
  }
  r::check_ids(indices, probs.size(1), op);
  r::visit_f32_bf16(dweights.dtype(), [&](auto wt) {
    using TW = decltype(wt);
    r::visit_f32_bf16(dlogits.dtype(), [&](auto gt) {
      using TG = decltype(gt);
      cpu::router_backward(probs.data<float>(), indices.data<int32_t>(), dweights.data<TW>(), probs.size(0),
                           probs.size(1), indices.size(1), norm_topk_prob, dlogits.data<TG>(), accumulate);
    });
  });
}

// loss (f32, one element, on probs' device) = the auxiliary load-balancing
// loss over the rows of probs [N, E] and indices [N, k] (not yet multiplied
// by router_aux_loss_coef). workspace: GPU only, see the top of this file.
inline void router_aux_loss_forward(const Tensor& probs, const Tensor& indices, const Tensor& loss,
                                    [[maybe_unused]] const Stream& stream = {},
                                    [[maybe_unused]] const Tensor& workspace = {}) {
  constexpr std::string_view op = "router_aux_loss_forward";
  namespace r = detail::moe_router;
  r::check_probs_indices(probs, indices, op);
  SLIME_CHECK(loss.defined() && loss.dtype() == DType::f32 && loss.numel() == 1, op,
              ": loss must be an f32 tensor of one element, got ", loss.str());
  check_same_device(loss, probs, "router_aux_loss_forward: loss", "probs");
  if (probs.device().is_cuda()) {
#if SLIME_HAS_CUDA
    r::check_gpu_experts(probs.size(1), op);
    const Stream s = detail::memops::stream_for(probs.device(), stream, op);
    DeviceGuard guard(probs.device());
    const std::size_t bytes = cuda::router_aux_loss_workspace_bytes(probs.size(0), probs.size(1));
    const Tensor ws = r::aux_workspace(workspace, bytes, probs, indices, loss, s, op);
    cuda::router_aux_loss_forward({probs.data<float>(), indices.data<int32_t>(), probs.size(0), probs.size(1),
                                   indices.size(1), ws.data_ptr(), ws.nbytes()},
                                  loss.data<float>(), s.handle());
    return;
#else
    detail::memops::fail_no_cuda(op);
#endif
  }
  r::check_ids(indices, probs.size(1), op);
  *loss.data<float>() = cpu::router_aux_loss_forward(probs.data<float>(), indices.data<int32_t>(), probs.size(0),
                                                     probs.size(1), indices.size(1));
}

// dlogits [N, E] (bf16 or f32; = or += with accumulate) of dloss · aux loss;
// pass dloss = router_aux_loss_coef (times the upstream gradient). To add it
// to router_backward's gradient with one rounding, use an f32 dlogits and
// accumulate = true on the second call. workspace: GPU only, as the forward's.
inline void router_aux_loss_backward(const Tensor& probs, const Tensor& indices, float dloss, const Tensor& dlogits,
                                     bool accumulate = false, [[maybe_unused]] const Stream& stream = {},
                                     [[maybe_unused]] const Tensor& workspace = {}) {
  constexpr std::string_view op = "router_aux_loss_backward";
  namespace r = detail::moe_router;
  r::check_probs_indices(probs, indices, op);
  r::check_dlogits(dlogits, probs, op);
  if (probs.device().is_cuda()) {
#if SLIME_HAS_CUDA
    r::check_gpu_experts(probs.size(1), op);
    const Stream s = detail::memops::stream_for(probs.device(), stream, op);
    DeviceGuard guard(probs.device());
    const std::size_t bytes = cuda::router_aux_loss_workspace_bytes(probs.size(0), probs.size(1));
    const Tensor ws = r::aux_workspace(workspace, bytes, probs, indices, dlogits, s, op);
    cuda::router_aux_loss_backward({probs.data<float>(), indices.data<int32_t>(), probs.size(0), probs.size(1),
                                    indices.size(1), ws.data_ptr(), ws.nbytes()},
                                   dloss, dlogits.data_ptr(), dlogits.dtype(), accumulate, s.handle());
    return;
#else
    detail::memops::fail_no_cuda(op);
#endif
  }
  r::check_ids(indices, probs.size(1), op);
  r::visit_f32_bf16(dlogits.dtype(), [&](auto gt) {
    using TG = decltype(gt);
    cpu::router_aux_loss_backward(probs.data<float>(), indices.data<int32_t>(), probs.size(0), probs.size(1),
                                  indices.size(1), dloss, dlogits.data<TG>(), accumulate);
  });
}

// ---- The auxiliary loss over rows spread across data-parallel ranks ---------
//
// The loss depends on the N rows of the batch only through per-expert
// statistics, so with the rows spread over ranks each rank runs
//   1. router_aux_stats(probs, indices, stats)         its rows' statistics
//   2. comm.all_reduce(stats)                          (sum) over the DP ranks
//   3. router_aux_loss_from_stats(stats, E, loss)      the loss of all N rows
//   4. router_aux_loss_backward_from_stats(probs, stats, dloss, dlogits)
//                                                      its rows' gradient
// and gets the unsharded batch's loss and gradient rows (the same dloss on
// every rank). The rows are the global loss's gradient, so the ranks' parameter
// gradients sum to its full gradient; where the DP gradient reduction averages
// over R ranks, pass dloss · R.
//
// stats: f32 [router_aux_stats_size(E) = 2E + 1], one tensor for one all_reduce:
//   stats[0, E)    count_e: how many of the rows' (row, slot) choices picked e
//   stats[E, 2E)   Σ_t probs[t, e]
//   stats[2E]      N, the number of rows
//
// Numerics. Stats of all the rows in one call give router_aux_loss_forward's
// loss and router_aux_loss_backward's gradient bit for bit (CPU and GPU: the
// same sums in the same order). Counts and N are integers held in f32, so
// they and their sums over ranks, in any order, are exact below 2^24 =
// 16,777,216 (kRouterAuxStatsExact); the gradient depends only on them, so
// sharded gradient rows are the unsharded ones bit for bit. The prob sums are
// f32 sums in a fixed order (CPU: the rows in order; GPU: the forward's fixed
// row chunks, then the chunks in order), the same run to run; another split
// of the rows rounds them differently (~1e-7 relative), and the sharded loss
// equals the unsharded one to that, not bitwise. f32 because DType has no
// f64 and one dtype keeps it one collective.
//
// Checks. Both paths reject a call of 2^24 rows or more. The CPU path also
// rejects a count that would reach 2^24 (possible only when a row repeats an
// expert), and in the _from_stats calls any count or N that is not an integer
// in [0, 2^24) or an N below the call's rows: stats averaged instead of
// summed, or missing this rank's rows, are an error. On the GPU the summed
// stats live on the device and are not checked: past 2^24 they round as an
// f32 sum does (relative 2^-24 per add, the size of the prob sums' rounding).

// Elements of router_aux_stats's output for `experts` experts: 2E + 1.
inline int64_t router_aux_stats_size(int64_t experts) { return 2 * experts + 1; }

// Counts and N in f32 stats are exact below this.
inline constexpr int64_t kRouterAuxStatsExact = int64_t(1) << 24;

namespace detail::moe_router {

inline void check_stats(const Tensor& stats, int64_t experts, std::string_view op) {
  SLIME_CHECK(stats.defined(), op, ": stats is undefined");
  SLIME_CHECK(stats.dtype() == DType::f32 && stats.dim() == 1 && stats.numel() == router_aux_stats_size(experts), op,
              ": stats must be f32 [2 * experts + 1] = [", router_aux_stats_size(experts), "] for ", experts,
              " experts (router_aux_stats_size), got ", stats.str());
}

// An integer-valued element of f32 stats (a count or N) that is exact.
inline bool exact_count(float v) { return v >= 0.f && v < float(kRouterAuxStatsExact) && v == std::floor(v); }

inline const char* stats_field(int64_t i, int64_t experts) { return i < experts ? "count" : "row count N"; }

// f(i) for the integer-valued elements of stats: the counts [0, E) and N [2E].
template <class F>
void for_each_count(int64_t experts, F&& f) {
  for (int64_t e = 0; e < experts; ++e) f(e);
  f(2 * experts);
}

// CPU stats given to the _from_stats functions: the counts and N are exact
// integers and N covers the call's `rows`.
inline void check_stats_values(const Tensor& stats, int64_t experts, int64_t rows, std::string_view op) {
  const float* s = stats.data<float>();
  for_each_count(experts, [&](int64_t i) {
    SLIME_CHECK(exact_count(s[i]), op, ": stats[", i, "] = ", s[i], " (a ", stats_field(i, experts),
                ") is not an integer in [0, 2^24): stats must be router_aux_stats's, summed (not averaged) over "
                "the ranks, with counts below 2^24");
  });
  SLIME_CHECK(s[2 * experts] >= float(rows), op, ": stats[", 2 * experts, "] = N = ", s[2 * experts],
              " rows, fewer than the ", rows, " rows of probs: the stats must include this call's rows");
}

}  // namespace detail::moe_router

// stats (f32 [2E + 1], on probs' device; = or += with accumulate) = the
// auxiliary loss's statistics of the rows of probs [N, E] and indices [N, k]
// (layout above). With accumulate the statistics of several calls add up in
// one tensor (still one all_reduce). workspace: GPU only, the size of
// router_aux_loss_workspace_bytes(N, E), as router_aux_loss_forward's.
inline void router_aux_stats(const Tensor& probs, const Tensor& indices, const Tensor& stats, bool accumulate = false,
                             [[maybe_unused]] const Stream& stream = {},
                             [[maybe_unused]] const Tensor& workspace = {}) {
  constexpr std::string_view op = "router_aux_stats";
  namespace r = detail::moe_router;
  r::check_probs_indices(probs, indices, op);
  const int64_t rows = probs.size(0), experts = probs.size(1), k = indices.size(1);
  r::check_stats(stats, experts, op);
  check_same_device(stats, probs, "router_aux_stats: stats", "probs");
  SLIME_CHECK(rows < kRouterAuxStatsExact, op, ": ", rows,
              " rows; f32 stats count rows exactly only below 2^24 = ", kRouterAuxStatsExact);
  if (probs.device().is_cuda()) {
#if SLIME_HAS_CUDA
    r::check_gpu_experts(experts, op);
    const Stream s = detail::memops::stream_for(probs.device(), stream, op);
    DeviceGuard guard(probs.device());
    const std::size_t bytes = cuda::router_aux_loss_workspace_bytes(rows, experts);
    const Tensor ws = r::aux_workspace(workspace, bytes, probs, indices, stats, s, op);
    cuda::router_aux_stats({probs.data<float>(), indices.data<int32_t>(), rows, experts, k, ws.data_ptr(), ws.nbytes()},
                           stats.data<float>(), accumulate, s.handle());
    return;
#else
    detail::memops::fail_no_cuda(op);
#endif
  }
  r::check_ids(indices, experts, op);
  std::vector<float> local(static_cast<std::size_t>(router_aux_stats_size(experts)));
  cpu::router_aux_stats(probs.data<float>(), indices.data<int32_t>(), rows, experts, k, local.data());
  float* out = stats.data<float>();
  // Every count and N written must stay exact (checked before anything is written).
  r::for_each_count(experts, [&](int64_t i) {
    if (accumulate)
      SLIME_CHECK(r::exact_count(out[i]), op, ": stats[", i, "] = ", out[i], " (a ", r::stats_field(i, experts),
                  ") to accumulate into is not an integer in [0, 2^24)");
    const int64_t total = int64_t(local[std::size_t(i)]) + (accumulate ? int64_t(out[i]) : 0);
    SLIME_CHECK(total < kRouterAuxStatsExact, op, ": stats[", i, "] (a ", r::stats_field(i, experts), ") would reach ",
                total, " >= 2^24, past which f32 counts are not exact");
  });
  for (std::size_t i = 0; i < local.size(); ++i) out[i] = accumulate ? out[i] + local[i] : local[i];
}

// loss (f32, one element, on stats' device) = the auxiliary loss of the rows
// that stats [2E + 1] describes (0 when N = 0), from router_aux_stats summed
// over the ranks.
inline void router_aux_loss_from_stats(const Tensor& stats, int64_t experts, const Tensor& loss,
                                       [[maybe_unused]] const Stream& stream = {}) {
  constexpr std::string_view op = "router_aux_loss_from_stats";
  namespace r = detail::moe_router;
  SLIME_CHECK(experts >= 1, op, ": needs at least one expert, got ", experts);
  r::check_stats(stats, experts, op);
  SLIME_CHECK(loss.defined() && loss.dtype() == DType::f32 && loss.numel() == 1, op,
              ": loss must be an f32 tensor of one element, got ", loss.str());
  check_same_device(loss, stats, "router_aux_loss_from_stats: loss", "stats");
  SLIME_CHECK(!detail::memops::overlap(loss, stats), op, ": loss overlaps stats");
  if (stats.device().is_cuda()) {
#if SLIME_HAS_CUDA
    r::check_gpu_experts(experts, op);
    const Stream s = detail::memops::stream_for(stats.device(), stream, op);
    DeviceGuard guard(stats.device());
    cuda::router_aux_loss_from_stats(stats.data<float>(), experts, loss.data<float>(), s.handle());
    return;
#else
    detail::memops::fail_no_cuda(op);
#endif
  }
  r::check_stats_values(stats, experts, 0, op);
  *loss.data<float>() = cpu::router_aux_loss_from_stats(stats.data<float>(), experts);
}

// dlogits [rows, E] (bf16 or f32; = or += with accumulate) of this call's
// rows of probs [rows, E], of dloss · the auxiliary loss of all the rows that
// stats [2E + 1] describes (router_aux_stats summed over the ranks, these
// rows included). The top-k ids enter only through the counts in stats.
inline void router_aux_loss_backward_from_stats(const Tensor& probs, const Tensor& stats, float dloss,
                                                const Tensor& dlogits, bool accumulate = false,
                                                [[maybe_unused]] const Stream& stream = {}) {
  constexpr std::string_view op = "router_aux_loss_backward_from_stats";
  namespace r = detail::moe_router;
  r::check_probs(probs, op);
  const int64_t rows = probs.size(0), experts = probs.size(1);
  r::check_stats(stats, experts, op);
  check_same_device(stats, probs, "router_aux_loss_backward_from_stats: stats", "probs");
  r::check_dlogits(dlogits, probs, op);
  SLIME_CHECK(!detail::memops::overlap(dlogits, stats), op, ": dlogits overlaps stats");
  if (probs.device().is_cuda()) {
#if SLIME_HAS_CUDA
    r::check_gpu_experts(experts, op);
    const Stream s = detail::memops::stream_for(probs.device(), stream, op);
    DeviceGuard guard(probs.device());
    cuda::router_aux_loss_backward_from_stats({probs.data<float>(), rows, experts, stats.data<float>(), dloss,
                                               dlogits.data_ptr(), dlogits.dtype(), accumulate},
                                              s.handle());
    return;
#else
    detail::memops::fail_no_cuda(op);
#endif
  }
  r::check_stats_values(stats, experts, rows, op);
  r::visit_f32_bf16(dlogits.dtype(), [&](auto gt) {
    using TG = decltype(gt);
    cpu::router_aux_loss_backward_from_stats(probs.data<float>(), rows, experts, stats.data<float>(), dloss,
                                             dlogits.data<TG>(), accumulate);
  });
}

}  // namespace slime::ops
