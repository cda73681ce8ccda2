// slime/ops/attention.hpp: attention over packed sequences, FlashAttention
// style (never a [seq, seq] matrix): forward (o, lse), backward (dq, dk, dv),
// and the merge of two partial results over disjoint keys (ring attention).
//
// Shapes: q [T, Hq, d], k and v [Tk, Hkv, d], o [T, Hq, d], lse f32 [T, Hq];
// cu_seqlens_q and cu_seqlens_k i32 [B + 1] on the data's device (the same
// tensor for self-attention). GQA: Hkv divides Hq, query head h reads kv head
// h / (Hq / Hkv). Softmax in fp32; scale 1/sqrt(d) unless options say.
// lse is the natural-log log-sum-exp of the scaled scores a row sees; a row
// that sees no key gets lse = -inf and o = 0 (its gradients are 0). The exact
// formulas are in slime/ops/cpu/attention.hpp, the reference.
//
// Masks (AttentionOptions, slime/ops/cpu/attention.hpp): causal (default) or
// full. Causal: query i of sequence b sees key j iff j <= i + offset_b, with
// positions counted from the sequence's start in q and in k and
//   offset_b = causal_offset                        (CausalAlign::top_left)
//   offset_b = causal_offset + len_k_b - len_q_b    (CausalAlign::bottom_right,
//                                                    FlashAttention's convention)
// Self-attention: cu_seqlens_q = cu_seqlens_k, causal_offset = 0 (either
// alignment). Ring attention, queries from position q_start against keys from
// k_start: top_left with causal_offset = q_start - k_start, then
// merge_attention_partials of the (o, lse) pairs.
//
// Devices and dtypes: CPU f32 or bf16, any head_dim (the reference, fp32
// accumulation). CUDA bf16, head_dim 32, 64, 72, 80, 96, 128 or 256
// (cuda::visit_head_dim), sm_90a (mma.sync tensor-core kernels,
// src/ops/attention*.cu).
//
// max_seqlen_q / max_seqlen_k: an upper bound of the query / key lengths (the
// packer knows them). On CUDA the grid is sized by them and nothing reads
// cu_seqlens on the host; pass -1 to have them computed, which copies
// cu_seqlens to the host and synchronises (not capturable in a CUDA graph). On
// the CPU they are checked against cu_seqlens (-1: computed).
// Validation: the CPU path checks cu_seqlens fully (starts at 0,
// non-decreasing, ends at the token count). The CUDA path checks shapes,
// dtypes, devices and alignment on the host; the kernels trap on a negative
// length, a length above max_seqlen, a first entry other than 0 or a last
// entry other than the token count.
//
// Accumulation contract: o, lse, dq, dk and dv are written (=), never
// accumulated: they are activations and activation gradients (dk and dv are
// gradients of the k and v activations, summed over the query heads of a
// group). Parameter gradients elsewhere accumulate (+=) into fp32.
//
// Determinism: o, lse, dk and dv are bitwise run-to-run deterministic on both
// devices. On CUDA dq is summed over key blocks with fp32 atomics: by default
// it is NOT run-to-run deterministic (differences at fp32 rounding, before
// the final bf16 rounding); AttentionOptions::deterministic makes the key
// blocks add in a fixed order (bitwise run to run; its cost: bench_attention's
// /det rows), and so does the batch-invariant mode (ops/batch_invariant.hpp).
// The CPU path is deterministic.
//
// Workspace: attention_backward on CUDA needs
// attention_backward_workspace_elems(q) f32 elements (dq accumulator,
// D = rowsum(do * o) and the deterministic mode's turn counters). Pass a
// tensor that large to allocate nothing in the call; an undefined workspace
// makes the call allocate one (stream-ordered).
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "slime/core/tensor.hpp"
#include "slime/ops/batch_invariant.hpp"
#include "slime/ops/cpu/attention.hpp"
#include "slime/ops/cuda/attention.hpp"
#include "slime/ops/host_checks.hpp"

namespace slime::ops {

// Throws unless attention on `device` runs head_dim (any on the CPU; on CUDA
// the instantiated ones, cuda::visit_head_dim): for models to check at
// construction rather than at their first forward.
inline void check_attention_head_dim([[maybe_unused]] Device device, [[maybe_unused]] int64_t head_dim) {
#if SLIME_HAS_CUDA
  if (device.is_cuda()) cuda::visit_head_dim(head_dim, [](auto) {});
#endif
}

namespace detail {

using NamedTensor = std::pair<const Tensor*, const char*>;  // for checks over several arguments

struct AttentionDims {
  int64_t tokens_q = 0, tokens_k = 0, heads_q = 0, heads_kv = 0, head_dim = 0, num_seqs = 0;
};

inline Stream attention_stream(const Tensor& t, const Stream& s) {
  return s.device() == t.device() ? s : Stream::default_for(t.device());
}

inline void check_aligned16(const Tensor& t, std::string_view name) {
  SLIME_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must be 16-byte aligned for the CUDA attention kernels, got ", t.data_ptr(), " (", t.str(), ")");
}

inline AttentionDims check_attention_inputs(const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                            const AttentionOptions& opt) {
  for (const auto& [t, name] : {NamedTensor{&q, "q"}, NamedTensor{&k, "k"}, NamedTensor{&v, "v"}}) {
    SLIME_CHECK(t->defined(), name, " is undefined");
    SLIME_CHECK(t->dim() == 3, name, " must be 3-d [tokens, heads, head_dim], got ", t->str());
  }
  AttentionDims d;
  d.tokens_q = q.size(0);
  d.heads_q = q.size(1);
  d.head_dim = q.size(2);
  d.tokens_k = k.size(0);
  d.heads_kv = k.size(1);
  SLIME_CHECK(k.size(2) == d.head_dim, "k must have head_dim ", d.head_dim, " like q, got ", k.str());
  check_shape(v, k.shape(), "v");
  SLIME_CHECK(d.head_dim > 0, "head_dim must be positive, got ", q.str());
  SLIME_CHECK(d.heads_kv > 0 && d.heads_q % d.heads_kv == 0, "the kv heads (", d.heads_kv,
              ") must divide the query heads (", d.heads_q, ")");
  SLIME_CHECK(q.dtype() == DType::f32 || q.dtype() == DType::bf16, "q must be f32 or bf16, got ", q.str());
  check_dtype(k, q.dtype(), "k");
  check_dtype(v, q.dtype(), "v");
  check_same_device(k, q, "k", "q");
  check_same_device(v, q, "v", "q");
  for (const auto& [t, name] :
       {NamedTensor{&cu_seqlens_q, "cu_seqlens_q"}, NamedTensor{&cu_seqlens_k, "cu_seqlens_k"}}) {
    check_dtype(*t, DType::i32, name);
    SLIME_CHECK(t->dim() == 1 && t->size(0) >= 1, name, " must be 1-d [num_seqs + 1], got ", t->str());
    check_same_device(*t, q, name, "q");
  }
  SLIME_CHECK(cu_seqlens_q.size(0) == cu_seqlens_k.size(0), "cu_seqlens_q and cu_seqlens_k must hold the same ",
              "number of sequences, got ", cu_seqlens_q.str(), " and ", cu_seqlens_k.str());
  d.num_seqs = cu_seqlens_q.size(0) - 1;
  SLIME_CHECK(d.tokens_q < (int64_t(1) << 31) && d.tokens_k < (int64_t(1) << 31),
              "attention positions are 32-bit: at most 2^31 - 1 tokens, got ", d.tokens_q, " and ", d.tokens_k);
  SLIME_CHECK(std::isfinite(opt.softmax_scale) && opt.softmax_scale >= 0.f,
              "softmax_scale must be finite and >= 0 (0: 1/sqrt(head_dim)), got ", opt.softmax_scale);
  SLIME_CHECK(opt.causal_offset >= -(1 << 30) && opt.causal_offset <= (1 << 30), "causal_offset must be within ",
              "+-2^30, got ", opt.causal_offset);
  if (q.device().is_cuda()) {
    SLIME_CHECK(q.dtype() == DType::bf16, "attention on CUDA needs bf16 q, k, v, got ", q.str());
#if SLIME_HAS_CUDA
    cuda::visit_head_dim(d.head_dim, [](auto) {});  // throws for an unsupported head_dim
#endif
    SLIME_CHECK(d.num_seqs <= 65535, "attention on CUDA supports at most 65535 sequences per call, got ", d.num_seqs);
    check_aligned16(q, "q");
    check_aligned16(k, "k");
    check_aligned16(v, "v");
  }
  return d;
}

// Full validation of host cu_seqlens values.
inline void check_cu_seqlens_values(const int32_t* cu, int64_t num_seqs, int64_t tokens, std::string_view name) {
  (void)check_cu_seqlens(std::span<const int32_t>(cu, std::size_t(num_seqs + 1)), tokens, "attention", num_seqs, name);
}

// The max_seqlen to use: `given` (checked where cu_seqlens is on the host) or,
// for -1, computed from cu_seqlens (a device -> host copy for CUDA tensors).
inline int64_t resolve_max_seqlen(const Tensor& cu, int64_t given, int64_t tokens, std::string_view cu_name,
                                  std::string_view max_name) {
  SLIME_CHECK(given >= -1, max_name, " must be >= 0, or -1 to compute it, got ", given);
  SLIME_CHECK(given < (int64_t(1) << 31), max_name, " must be < 2^31, got ", given);
  const int64_t num_seqs = cu.size(0) - 1;
  if (cu.device().is_cuda() && given >= 0) return given;
  std::vector<int32_t> host;
  const int32_t* p = nullptr;
  if (cu.device().is_cpu()) {
    p = cu.data<int32_t>();
  } else {
    host = cu.to_vector<int32_t>();
    p = host.data();
  }
  check_cu_seqlens_values(p, num_seqs, tokens, cu_name);
  int64_t longest = 0;
  for (int64_t b = 0; b < num_seqs; ++b) longest = std::max<int64_t>(longest, p[b + 1] - p[b]);
  if (given < 0) return longest;
  SLIME_CHECK(given >= longest, max_name, " = ", given, " is shorter than the longest sequence in ", cu_name, " (",
              longest, ")");
  return given;
}

#if SLIME_HAS_CUDA
inline cuda::AttentionForwardParams cuda_forward_params(const Tensor& q, const Tensor& k, const Tensor& v,
                                                        const Tensor& cu_q, const Tensor& cu_k, const AttentionDims& d,
                                                        int64_t max_q, int64_t max_k, const AttentionOptions& opt) {
  cuda::AttentionForwardParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.cu_seqlens_q = cu_q.data<int32_t>();
  p.cu_seqlens_k = cu_k.data<int32_t>();
  p.num_seqs = int(d.num_seqs);
  p.heads_q = int(d.heads_q);
  p.heads_kv = int(d.heads_kv);
  p.head_dim = int(d.head_dim);
  p.tokens_q = int(d.tokens_q);
  p.tokens_k = int(d.tokens_k);
  p.max_seqlen_q = int(max_q);
  p.max_seqlen_k = int(max_k);
  p.softmax_scale = cpu::detail::resolve_scale<float>(opt, d.head_dim);
  p.options = opt;
  return p;
}
#endif

}  // namespace detail

// o = softmax(scale q k^T + mask) v and lse per sequence and query head.
inline void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                              const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, const Tensor& o,
                              const Tensor& lse, const AttentionOptions& options = {}, const Stream& stream = {}) {
  const detail::AttentionDims d = detail::check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, options);
  check_dtype(o, q.dtype(), "o");
  check_shape(o, q.shape(), "o");
  check_same_device(o, q, "o", "q");
  check_dtype(lse, DType::f32, "lse");
  check_shape(lse, Shape{d.tokens_q, d.heads_q}, "lse");
  check_same_device(lse, q, "lse", "q");
  const int64_t max_q =
      detail::resolve_max_seqlen(cu_seqlens_q, max_seqlen_q, d.tokens_q, "cu_seqlens_q", "max_seqlen_q");
  const int64_t max_k =
      detail::resolve_max_seqlen(cu_seqlens_k, max_seqlen_k, d.tokens_k, "cu_seqlens_k", "max_seqlen_k");
  if (q.device().is_cpu()) {
    const int32_t* cq = cu_seqlens_q.data<int32_t>();
    const int32_t* ck = cu_seqlens_k.data<int32_t>();
    if (q.dtype() == DType::f32) {
      cpu::attention_forward(q.data<float>(), k.data<float>(), v.data<float>(), cq, ck, d.num_seqs, d.heads_q,
                             d.heads_kv, d.head_dim, options, o.data<float>(), lse.data<float>());
    } else {
      cpu::attention_forward(q.data<BFloat16>(), k.data<BFloat16>(), v.data<BFloat16>(), cq, ck, d.num_seqs, d.heads_q,
                             d.heads_kv, d.head_dim, options, o.data<BFloat16>(), lse.data<float>());
    }
    return;
  }
#if SLIME_HAS_CUDA
  detail::check_aligned16(o, "o");
  cuda::AttentionForwardParams p =
      detail::cuda_forward_params(q, k, v, cu_seqlens_q, cu_seqlens_k, d, max_q, max_k, options);
  p.o = o.data_ptr();
  p.lse = lse.data<float>();
  DeviceGuard guard(q.device());
  cuda::attention_forward(p, detail::attention_stream(q, stream).handle());
#else
  (void)stream;
  (void)max_q;
  (void)max_k;
#endif
}

// f32 elements of workspace attention_backward needs for `q` (0 on the CPU).
inline int64_t attention_backward_workspace_elems(const Tensor& q) {
  SLIME_CHECK(q.defined() && q.dim() == 3, "q must be 3-d [tokens, heads, head_dim], got ", q.str());
#if SLIME_HAS_CUDA
  if (q.device().is_cuda()) return cuda::attention_backward_workspace_elems(q.size(0), q.size(1), q.size(2));
#endif
  return 0;
}

// dq, dk, dv of sum(d_o * o), given the forward's o and lse (same options).
inline void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                               const Tensor& d_o, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                               int64_t max_seqlen_q, int64_t max_seqlen_k, const Tensor& dq, const Tensor& dk,
                               const Tensor& dv, const AttentionOptions& options = {}, const Tensor& workspace = {},
                               const Stream& stream = {}) {
  const detail::AttentionDims d = detail::check_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, options);
  for (const auto& [t, name] :
       {detail::NamedTensor{&o, "o"}, detail::NamedTensor{&d_o, "d_o"}, detail::NamedTensor{&dq, "dq"}}) {
    check_dtype(*t, q.dtype(), name);
    check_shape(*t, q.shape(), name);
    check_same_device(*t, q, name, "q");
  }
  for (const auto& [t, name] : {detail::NamedTensor{&dk, "dk"}, detail::NamedTensor{&dv, "dv"}}) {
    check_dtype(*t, q.dtype(), name);
    check_shape(*t, k.shape(), name);
    check_same_device(*t, q, name, "q");
  }
  check_dtype(lse, DType::f32, "lse");
  check_shape(lse, Shape{d.tokens_q, d.heads_q}, "lse");
  check_same_device(lse, q, "lse", "q");
  const int64_t max_q =
      detail::resolve_max_seqlen(cu_seqlens_q, max_seqlen_q, d.tokens_q, "cu_seqlens_q", "max_seqlen_q");
  const int64_t max_k =
      detail::resolve_max_seqlen(cu_seqlens_k, max_seqlen_k, d.tokens_k, "cu_seqlens_k", "max_seqlen_k");
  if (q.device().is_cpu()) {
    const int32_t* cq = cu_seqlens_q.data<int32_t>();
    const int32_t* ck = cu_seqlens_k.data<int32_t>();
    if (q.dtype() == DType::f32) {
      cpu::attention_backward(q.data<float>(), k.data<float>(), v.data<float>(), o.data<float>(), lse.data<float>(),
                              d_o.data<float>(), cq, ck, d.num_seqs, d.heads_q, d.heads_kv, d.head_dim, options,
                              dq.data<float>(), dk.data<float>(), dv.data<float>());
    } else {
      cpu::attention_backward(q.data<BFloat16>(), k.data<BFloat16>(), v.data<BFloat16>(), o.data<BFloat16>(),
                              lse.data<float>(), d_o.data<BFloat16>(), cq, ck, d.num_seqs, d.heads_q, d.heads_kv,
                              d.head_dim, options, dq.data<BFloat16>(), dk.data<BFloat16>(), dv.data<BFloat16>());
    }
    return;
  }
#if SLIME_HAS_CUDA
  for (const auto& [t, name] :
       {detail::NamedTensor{&o, "o"}, detail::NamedTensor{&d_o, "d_o"}, detail::NamedTensor{&dq, "dq"},
        detail::NamedTensor{&dk, "dk"}, detail::NamedTensor{&dv, "dv"}})
    detail::check_aligned16(*t, name);
  const Stream s = detail::attention_stream(q, stream);
  const int64_t need = attention_backward_workspace_elems(q);
  Tensor ws = workspace;
  if (ws.defined()) {
    check_dtype(ws, DType::f32, "workspace");
    check_same_device(ws, q, "workspace", "q");
    SLIME_CHECK(ws.numel() >= need, "workspace must hold attention_backward_workspace_elems(q) = ", need,
                " f32 elements, got ", ws.str());
    detail::check_aligned16(ws, "workspace");
  } else {
    ws = Tensor::empty(Shape{need}, DType::f32, q.device(), s);
  }
  cuda::AttentionBackwardParams p;
  p.fwd = detail::cuda_forward_params(q, k, v, cu_seqlens_q, cu_seqlens_k, d, max_q, max_k, options);
  p.fwd.o = o.data_ptr();  // read only in the backward
  p.fwd.lse = lse.data<float>();
  // The batch-invariant mode is also run-to-run deterministic: dq adds in a fixed order.
  if (batch_invariant()) p.fwd.options.deterministic = true;
  p.d_o = d_o.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.workspace = ws.data<float>();
  DeviceGuard guard(q.device());
  cuda::attention_backward(p, s.handle());
#else
  (void)workspace;
  (void)stream;
  (void)max_q;
  (void)max_k;
#endif
}

// (o, lse) over the union of two disjoint key sets from the partial results
// (o1, lse1) and (o2, lse2) of the same queries (ring attention):
//   lse = log(exp(lse1) + exp(lse2)),  o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2
// o1, o2, o: [T, H, d], each f32 or bf16 (an fp32 running o keeps ring steps
// from rounding to bf16 each time); lse1, lse2, lse: f32 [T, H]. o may be the
// same tensor as o1 or o2, lse the same as lse1 or lse2 (in-place merge).
inline void merge_attention_partials(const Tensor& o1, const Tensor& lse1, const Tensor& o2, const Tensor& lse2,
                                     const Tensor& o, const Tensor& lse, const Stream& stream = {}) {
  for (const auto& [t, name] :
       {detail::NamedTensor{&o1, "o1"}, detail::NamedTensor{&o2, "o2"}, detail::NamedTensor{&o, "o"}}) {
    SLIME_CHECK(t->defined(), name, " is undefined");
    SLIME_CHECK(t->dim() == 3, name, " must be 3-d [tokens, heads, head_dim], got ", t->str());
    SLIME_CHECK(t->dtype() == DType::f32 || t->dtype() == DType::bf16, name, " must be f32 or bf16, got ", t->str());
    check_same_device(*t, o1, name, "o1");
  }
  check_shape(o2, o1.shape(), "o2");
  check_shape(o, o1.shape(), "o");
  const Shape lse_shape{o1.size(0), o1.size(1)};
  for (const auto& [t, name] :
       {detail::NamedTensor{&lse1, "lse1"}, detail::NamedTensor{&lse2, "lse2"}, detail::NamedTensor{&lse, "lse"}}) {
    check_dtype(*t, DType::f32, name);
    check_shape(*t, lse_shape, name);
    check_same_device(*t, o1, name, "o1");
  }
  const int64_t rows = o1.size(0) * o1.size(1), dim = o1.size(2);
  if (o1.device().is_cpu()) {
    auto with = [](const Tensor& t, auto&& f) {
      if (t.dtype() == DType::f32) {
        f(t.data<float>());
      } else {
        f(t.data<BFloat16>());
      }
    };
    with(o1, [&](const auto* p1) {
      with(o2, [&](const auto* p2) {
        with(o, [&](auto* po) {
          cpu::merge_attention_partials(p1, lse1.data<float>(), p2, lse2.data<float>(), rows, dim, po,
                                        lse.data<float>());
        });
      });
    });
    return;
  }
#if SLIME_HAS_CUDA
  DeviceGuard guard(o1.device());
  cuda::merge_attention_partials(o1.data_ptr(), o1.dtype(), lse1.data<float>(), o2.data_ptr(), o2.dtype(),
                                 lse2.data<float>(), o.data_ptr(), o.dtype(), lse.data<float>(), rows, dim,
                                 detail::attention_stream(o1, stream).handle());
#else
  (void)stream;
#endif
}

// The same, into new tensors: o of o1's dtype (allocated on `stream`), lse f32.
inline std::pair<Tensor, Tensor> merge_attention_partials(const Tensor& o1, const Tensor& lse1, const Tensor& o2,
                                                          const Tensor& lse2, const Stream& stream = {}) {
  SLIME_CHECK(o1.defined() && o1.dim() == 3, "o1 must be 3-d [tokens, heads, head_dim], got ", o1.str());
  Tensor o = Tensor::empty(o1.shape(), o1.dtype(), o1.device(), stream);
  Tensor lse = Tensor::empty(Shape{o1.size(0), o1.size(1)}, DType::f32, o1.device(), stream);
  merge_attention_partials(o1, lse1, o2, lse2, o, lse, stream);
  return {o, lse};
}

}  // namespace slime::ops
