// slime/ops/cpu/attention.hpp: the reference (the specification) of attention
// over packed sequences: forward, backward, and the merge of two partial
// results over disjoint key sets; plus the mask variants shared with the CUDA
// kernels.
//
// Layouts (row-major, no padding): q [T, Hq, d], k and v [Tk, Hkv, d],
// o [T, Hq, d], lse [T, Hq]. Sequence b owns query rows [cu_q[b], cu_q[b+1])
// and key rows [cu_k[b], cu_k[b+1]); positions i and j below count from the
// start of the sequence's query and key ranges. GQA: query head h reads kv
// head h / (Hq / Hkv).
//
//   s_ij = scale * <q_i, k_j>        over the keys j that row i sees (the mask)
//   lse_i = log sum_j exp(s_ij)      natural log, fp32 (fp64 for double)
//   o_i = sum_j exp(s_ij - lse_i) v_j
// A row that sees no key has lse_i = -inf and o_i = 0 (and zero gradients).
//
// Accumulation contract: every output here is an activation or an activation
// gradient and is written (=), never accumulated.
//
// Nothing here holds a [seq, seq] matrix: the forward makes two passes over a
// row's keys (max, then exp-sum and weighted values), the backward recomputes
// each probability from q, k and lse.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "slime/core/half.hpp"
#include "slime/core/macros.hpp"

namespace slime::ops {

// ---- Mask variants -----------------------------------------------------------
// Device-side policy structs (FlashInfer style), used by the CUDA kernels and
// by this reference. Every supported mask is a prefix mask within a sequence:
// query row i sees keys [0, key_end(i)), and key j is seen by rows
// [first_row(j), len_q). Positions are ints: sequences are < 2^31 tokens and
// |offsets| <= 2^30 (the host API checks).

// Row i sees key j iff j <= i + offset. offset = 0 is ordinary causal
// self-attention; a ring-attention step of queries starting at q_start against
// keys starting at k_start uses offset = q_start - k_start.
struct CausalMask {
  int offset = 0;
  SLIME_HOST_DEVICE int key_end(int row, int len_k) const {
    const int e = row + offset + 1;
    return e < 0 ? 0 : (e > len_k ? len_k : e);
  }
  SLIME_HOST_DEVICE int first_row(int key) const { return key - offset; }
};

// Every row sees every key of its sequence.
struct FullMask {
  SLIME_HOST_DEVICE int key_end(int /*row*/, int len_k) const { return len_k; }
  SLIME_HOST_DEVICE int first_row(int /*key*/) const { return 0; }
};

// Where the causal diagonal sits when a sequence has len_q != len_k.
//   top_left:     offset = causal_offset                      (row 0 sees key 0)
//   bottom_right: offset = causal_offset + len_k - len_q      (FlashAttention's
//                 convention: the last row sees the last key; a KV cache)
enum class CausalAlign : uint8_t { top_left, bottom_right };

// Which CUDA kernels run (the CPU ignores it). automatic: the Hopper forward
// (wgmma fed by TMA, warp-specialised; src/ops/attention_fwd_sm90.cu) at
// head_dim 64 and 128 on an sm_90 GPU of an sm_90a build, unless the
// environment sets SLIME_ATTENTION_SM90=0, and the mma.sync backward (the
// Hopper backward, src/ops/attention_bwd_sm90.cu, only with
// SLIME_ATTENTION_SM90_BWD=1 until its speed is measured); the mma.sync
// kernels otherwise. mma_sync / sm90 force one family, forward and backward
// (sm90 where it cannot run is a slime::Error; the deterministic backward is
// always the mma.sync one).
enum class AttentionKernel : uint8_t { automatic, mma_sync, sm90 };

struct AttentionOptions {
  bool causal = true;  // false: FullMask
  int causal_offset = 0;
  CausalAlign align = CausalAlign::top_left;
  float softmax_scale = 0.f;  // 0: 1 / sqrt(head_dim)
  // Backward on CUDA: sum dq over key blocks in a fixed order (bitwise run to
  // run) instead of in whatever order the fp32 atomics land. The CPU path is
  // always deterministic and ignores it.
  bool deterministic = false;
  AttentionKernel kernel = AttentionKernel::automatic;  // the CUDA kernels
  // CUDA, the Hopper forward: a call with at most one query row per
  // sequence (a decode step) and heads_q / heads_kv = G > 1 runs a tile per
  // (sequence, kv head) that holds the row of all G heads, rather than a
  // 128-row tile per query head holding one row (FlashDecoding's GQA
  // packing: G x fewer tiles, K/V read once per kv head). Each row's sum is
  // unchanged, so the bits are the same either way; false (or the
  // environment's SLIME_ATTENTION_PACK_GQA=0): one tile per head.
  bool pack_gqa = true;

  // The CausalMask offset of a sequence with these lengths.
  SLIME_HOST_DEVICE int offset_for(int len_q, int len_k) const {
    return causal_offset + (align == CausalAlign::bottom_right ? len_k - len_q : 0);
  }
};

namespace cpu {

template <class T>
using attention_acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

namespace detail {

template <class Acc, class T>
inline Acc to_acc(T x) {
  if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
    return Acc(float(x));
  } else {
    return Acc(x);
  }
}

template <class T, class Acc>
inline T from_acc(Acc x) {
  if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
    return T(float(x));
  } else {
    return T(x);
  }
}

template <class Acc, class T>
inline Acc dot(const T* a, const T* b, int64_t n) {
  Acc s = 0;
  for (int64_t c = 0; c < n; ++c) s += to_acc<Acc>(a[c]) * to_acc<Acc>(b[c]);
  return s;
}

template <class Acc>
inline Acc resolve_scale(const AttentionOptions& opt, int64_t d) {
  return opt.softmax_scale > 0.f ? Acc(opt.softmax_scale) : Acc(1) / std::sqrt(Acc(d));
}

// Keys [0, key_end) are visible to row i of a sequence of these lengths.
inline int64_t visible_keys(const AttentionOptions& opt, int64_t i, int64_t len_q, int64_t len_k) {
  if (!opt.causal) return FullMask{}.key_end(int(i), int(len_k));
  return CausalMask{opt.offset_for(int(len_q), int(len_k))}.key_end(int(i), int(len_k));
}

}  // namespace detail

// o = softmax(scale q k^T + mask) v per sequence and head; lse as above.
// cu_q and cu_k: [num_seqs + 1], valid (0, non-decreasing); d any positive size.
template <class T>
void attention_forward(const T* q, const T* k, const T* v, const int32_t* cu_q, const int32_t* cu_k, int64_t num_seqs,
                       int64_t hq, int64_t hkv, int64_t d, const AttentionOptions& opt, T* o, attention_acc_t<T>* lse) {
  using Acc = attention_acc_t<T>;
  const Acc scale = detail::resolve_scale<Acc>(opt, d);
  const int64_t group = hq / hkv;
  std::vector<Acc> acc(static_cast<std::size_t>(d));
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q0 = cu_q[b], len_q = cu_q[b + 1] - q0;
    const int64_t k0 = cu_k[b], len_k = cu_k[b + 1] - k0;
    for (int64_t i = 0; i < len_q; ++i) {
      const int64_t end = detail::visible_keys(opt, i, len_q, len_k);
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t hk = h / group;
        const T* qi = q + ((q0 + i) * hq + h) * d;
        T* oi = o + ((q0 + i) * hq + h) * d;
        Acc& lse_i = lse[(q0 + i) * hq + h];
        if (end == 0) {
          for (int64_t c = 0; c < d; ++c) oi[c] = detail::from_acc<T>(Acc(0));
          lse_i = -std::numeric_limits<Acc>::infinity();
          continue;
        }
        Acc m = -std::numeric_limits<Acc>::infinity();
        for (int64_t j = 0; j < end; ++j)
          m = std::max(m, scale * detail::dot<Acc>(qi, k + ((k0 + j) * hkv + hk) * d, d));
        Acc l = 0;
        std::fill(acc.begin(), acc.end(), Acc(0));
        for (int64_t j = 0; j < end; ++j) {
          const Acc p = std::exp(scale * detail::dot<Acc>(qi, k + ((k0 + j) * hkv + hk) * d, d) - m);
          l += p;
          const T* vj = v + ((k0 + j) * hkv + hk) * d;
          for (int64_t c = 0; c < d; ++c) acc[std::size_t(c)] += p * detail::to_acc<Acc>(vj[c]);
        }
        for (int64_t c = 0; c < d; ++c) oi[c] = detail::from_acc<T>(acc[std::size_t(c)] / l);
        lse_i = m + std::log(l);
      }
    }
  }
}

// Gradients of sum(do * o) through attention_forward, given its o and lse:
//   p_ij = exp(s_ij - lse_i),  D_i = <do_i, o_i>,  ds_ij = p_ij (<do_i, v_j> - D_i)
//   dq_i = scale sum_j ds_ij k_j,  dk_j = scale sum_i ds_ij q_i,  dv_j = sum_i p_ij do_i
// dk and dv sum over the query heads of a kv head's group. All three are
// written (=); keys no row sees get zero gradients.
template <class T>
void attention_backward(const T* q, const T* k, const T* v, const T* o, const attention_acc_t<T>* lse, const T* d_o,
                        const int32_t* cu_q, const int32_t* cu_k, int64_t num_seqs, int64_t hq, int64_t hkv, int64_t d,
                        const AttentionOptions& opt, T* dq, T* dk, T* dv) {
  using Acc = attention_acc_t<T>;
  const Acc scale = detail::resolve_scale<Acc>(opt, d);
  const int64_t group = hq / hkv;
  const int64_t total_k = cu_k[num_seqs];
  std::vector<Acc> dk_acc(static_cast<std::size_t>(total_k * hkv * d), Acc(0));
  std::vector<Acc> dv_acc(dk_acc.size(), Acc(0));
  std::vector<Acc> dq_acc(static_cast<std::size_t>(d));
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q0 = cu_q[b], len_q = cu_q[b + 1] - q0;
    const int64_t k0 = cu_k[b], len_k = cu_k[b + 1] - k0;
    for (int64_t i = 0; i < len_q; ++i) {
      const int64_t end = detail::visible_keys(opt, i, len_q, len_k);
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t hk = h / group;
        const int64_t row = (q0 + i) * hq + h;
        const T* qi = q + row * d;
        const T* doi = d_o + row * d;
        std::fill(dq_acc.begin(), dq_acc.end(), Acc(0));
        if (end > 0) {
          const Acc lse_i = lse[row];
          const Acc D = detail::dot<Acc>(doi, o + row * d, d);
          for (int64_t j = 0; j < end; ++j) {
            const int64_t kv = ((k0 + j) * hkv + hk) * d;
            const Acc p = std::exp(scale * detail::dot<Acc>(qi, k + kv, d) - lse_i);
            const Acc ds = p * (detail::dot<Acc>(doi, v + kv, d) - D);
            for (int64_t c = 0; c < d; ++c) {
              dq_acc[std::size_t(c)] += ds * detail::to_acc<Acc>(k[kv + c]);
              dk_acc[std::size_t(kv + c)] += ds * detail::to_acc<Acc>(qi[c]);
              dv_acc[std::size_t(kv + c)] += p * detail::to_acc<Acc>(doi[c]);
            }
          }
        }
        for (int64_t c = 0; c < d; ++c) dq[row * d + c] = detail::from_acc<T>(scale * dq_acc[std::size_t(c)]);
      }
    }
  }
  for (std::size_t x = 0; x < dk_acc.size(); ++x) {
    dk[x] = detail::from_acc<T>(scale * dk_acc[x]);
    dv[x] = detail::from_acc<T>(dv_acc[x]);
  }
}

// Merges two partial results of the same queries over disjoint key sets into
// the result over their union (ring attention):
//   lse = log(exp(lse1) + exp(lse2)),  o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2
// A row with lse1 = lse2 = -inf (no key in either part) gives lse = -inf,
// o = 0. rows = T * H; o may alias o1 or o2 and lse may alias lse1 or lse2
// (each row is read before it is written).
template <class T1, class T2, class TO, class Acc>
void merge_attention_partials(const T1* o1, const Acc* lse1, const T2* o2, const Acc* lse2, int64_t rows, int64_t d,
                              TO* o, Acc* lse) {
  std::vector<Acc> tmp(static_cast<std::size_t>(d));
  for (int64_t r = 0; r < rows; ++r) {
    const Acc a = lse1[r], b = lse2[r];
    const Acc m = std::max(a, b);
    if (m == -std::numeric_limits<Acc>::infinity()) {
      for (int64_t c = 0; c < d; ++c) o[r * d + c] = detail::from_acc<TO>(Acc(0));
      lse[r] = m;
      continue;
    }
    const Acc e1 = std::exp(a - m), e2 = std::exp(b - m);
    const Acc s = e1 + e2;
    const Acc w1 = e1 / s, w2 = e2 / s;
    // A part with lse = -inf (weight 0) contributes nothing, whatever its o holds.
    for (int64_t c = 0; c < d; ++c)
      tmp[std::size_t(c)] = (w1 != 0 ? w1 * detail::to_acc<Acc>(o1[r * d + c]) : Acc(0)) +
                            (w2 != 0 ? w2 * detail::to_acc<Acc>(o2[r * d + c]) : Acc(0));
    for (int64_t c = 0; c < d; ++c) o[r * d + c] = detail::from_acc<TO>(tmp[std::size_t(c)]);
    lse[r] = m + std::log(s);
  }
}

}  // namespace cpu
}  // namespace slime::ops
