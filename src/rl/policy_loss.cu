// CUDA implementation of slime/rl/policy_loss.hpp (the fused per-token policy
// loss and its gradient with respect to lp and entropy):
//   policy_loss_kernel<Kind>   one block per sequence (grid-stride over
//                              sequences): when GSPO or a sequence-mean
//                              aggregation needs them, a first sweep reduces the
//                              sequence's mask count and Σ(lp − old); a second
//                              sweep writes grad_lp / grad_entropy and sums the
//                              metrics; GSPO adds its sequence-ratio term in a
//                              third sweep (the sequence is L2-resident by
//                              then). Per-sequence metric partials go to the
//                              workspace.
//   reduce_metrics_kernel      one block sums the partials over sequences.
// Deterministic run to run: every reduction is a fixed-order block tree
// (warp xor-shuffles, then warps in order), no atomics.
//
// Per-token math is fp32 (the inputs are f32); metric sums and the GSPO
// sequence sums are fp64. Loads are 4-byte coalesced, not 16-byte vectors:
// sequences start at arbitrary token offsets.
//
// Bytes per call (T tokens): reads 12 T (lp, old, advantages) + T (mask)
// [+ 4 T each for ref_lp, entropy, is_weights; + T for keep], writes 4 T
// (grad_lp) [+ 4 T grad_entropy]; GSPO re-reads lp, old, mask and grad_lp
// from L2. FLOPs: O(30 T), negligible: the op is memory-bound.
#include <cstdint>

#include "slime/core/error.hpp"
#include "slime/rl/cuda/policy_loss.hpp"
#include "slime/rl/policy_loss.hpp"

namespace slime::rl::cuda {
namespace {

// 512 threads: with 64 sequences of 4096 tokens (the benchmark's long shape)
// each thread sweeps 8 tokens; with many short sequences the grid fills the GPU.
constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMetrics = kPolicyLossMetrics;

// Sums v[0..N) over the block (fixed order); every thread gets the sums.
// `scratch` holds kWarps * N doubles.
template <int N>
__device__ void block_sum(double (&v)[N], double* scratch, int lane, int warp) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
  }
  __syncthreads();  // the previous use of scratch is over
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) scratch[warp * N + i] = v[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) {
    double s = 0;
    for (int w = 0; w < kWarps; ++w) s += scratch[w * N + i];
    v[i] = s;
  }
}

struct PgTerm {
  float pg = 0, dpg_dlp = 0, dpg_dratio = 0;
  bool clipped = false, dual = false;
};

// The policy-gradient term of one token (before the importance weight).
template <PolicyLossKind K>
__device__ __forceinline__ PgTerm pg_term(float ratio, float lp, float adv, float lo, float hi, float eps_c) {
  PgTerm t;
  const float cr = fminf(fmaxf(ratio, lo), hi);
  if constexpr (K == PolicyLossKind::cispo) {
    t.pg = -cr * adv * lp;
    t.dpg_dlp = -cr * adv;
    t.clipped = cr != ratio;
  } else {
    const float pg1 = -adv * ratio, pg2 = -adv * cr;
    t.clipped = pg2 > pg1;
    if (t.clipped) {
      t.pg = pg2;
    } else {
      t.pg = pg1;
      t.dpg_dratio = -adv;
    }
    if (eps_c > 0 && adv < 0) {
      const float pg3 = -adv * eps_c;
      if (pg3 < t.pg) {
        t.pg = pg3;
        t.dpg_dratio = 0;
        t.dual = true;
      }
    }
  }
  return t;
}

// KL estimator value and d/dlp (slime/rl/kl.hpp's formulas in fp32): k3
// unclamped; low_var_kl is k3 clamped to ±low_var_kl_clamp after the
// unbiased ratio, with no gradient where clamped.
__device__ __forceinline__ void kl_term(KlEstimator e, bool unbiased, float lp, float ref, float old, float& value,
                                        float& grad) {
  switch (e) {
    case KlEstimator::k1:
      value = lp - ref;
      grad = 1.f;
      break;
    case KlEstimator::k2:
      value = 0.5f * (lp - ref) * (lp - ref);
      grad = lp - ref;
      break;
    case KlEstimator::k3:
    case KlEstimator::low_var_kl: {
      const float d = ref - lp;
      const float ex = expf(d);
      value = ex - d - 1.f;
      grad = 1.f - ex;
      break;
    }
  }
  if (unbiased) {
    const float r = expf(lp - old);
    grad = r * (grad + value);
    value *= r;
  }
  if (e == KlEstimator::low_var_kl) {
    const float clamp = float(low_var_kl_clamp);
    if (value > clamp || value < -clamp) {
      value = value > clamp ? clamp : -clamp;
      grad = 0.f;
    }
  }
}

template <PolicyLossKind K>
__global__ void __launch_bounds__(kThreads) policy_loss_kernel(PolicyLossParams p) {
  __shared__ double scratch[kWarps * kMetrics];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const float lo = 1.f - p.eps_clip, hi = 1.f + p.eps_clip_high;
  const bool need_counts = K == PolicyLossKind::gspo || p.aggregation != Aggregation::token_mean;
  double* partials = static_cast<double*>(p.workspace);

  for (int64_t s = blockIdx.x; s < p.num_seqs; s += gridDim.x) {
    const int64_t begin = p.cu_seqlens[s], end = p.cu_seqlens[s + 1];
    // Broken cu_seqlens (documented in the public header): trap rather than
    // read or write out of bounds.
    if (begin < 0 || end < begin || end > p.tokens || (s == 0 && begin != 0) ||
        (s == p.num_seqs - 1 && end != p.tokens))
      __trap();

    double n_s = 0, log_ratio_mean = 0;
    if (need_counts) {
      double v[2] = {0, 0};
      for (int64_t t = begin + tid; t < end; t += kThreads) {
        if (!p.loss_mask[t]) continue;
        v[0] += 1;
        v[1] += double(p.lp[t]) - double(p.old_lp[t]);
      }
      block_sum(v, scratch, lane, warp);
      n_s = v[0];
      log_ratio_mean = n_s > 0 ? v[1] / n_s : 0.0;
    }
    // c: the weight of the KL and entropy terms and of the metrics; c_pg: of
    // the pg term (they differ under seq_mean_token_sum only).
    double c = 0, c_pg = 0;
    switch (p.aggregation) {
      case Aggregation::token_mean:
        c = c_pg = 1.0 / double(p.norm_tokens);
        break;
      case Aggregation::seq_mean_token_mean:
        c = c_pg = n_s > 0 ? 1.0 / (n_s * double(p.norm_sequences)) : 0.0;
        break;
      case Aggregation::seq_mean_token_sum:
        c = n_s > 0 ? 1.0 / (n_s * double(p.norm_sequences)) : 0.0;
        c_pg = 1.0 / double(p.norm_sequences);
        break;
    }
    const float cf = float(c), cf_pg = float(c_pg);
    const float seq_ratio = expf(float(log_ratio_mean));

    double m[kMetrics] = {};
    double gspo[1] = {0};
    for (int64_t t = begin + tid; t < end; t += kThreads) {
      float g = 0.f, ge = 0.f;
      if (p.loss_mask[t] && (!p.maybe_keep || p.maybe_keep[t])) {
        const float lp = p.lp[t], old = p.old_lp[t], adv = p.advantages[t];
        const float log_ratio = K == PolicyLossKind::gspo ? float(log_ratio_mean) : lp - old;
        const float ratio = K == PolicyLossKind::gspo ? seq_ratio : expf(log_ratio);
        const float w = p.maybe_is_weights ? p.maybe_is_weights[t] : 1.f;
        PgTerm pt = pg_term<K>(ratio, lp, adv, lo, hi, p.eps_clip_c);
        const float pg = w * pt.pg;
        float kl = 0.f, dkl = 0.f;
        if (p.maybe_ref_lp) kl_term(p.kl_estimator, p.unbiased_kl, lp, p.maybe_ref_lp[t], old, kl, dkl);
        const float h = p.maybe_entropy ? p.maybe_entropy[t] : 0.f;
        m[0] += c_pg * double(pg) + c * (double(p.kl_coef) * kl - double(p.entropy_coef) * h);
        m[1] += c_pg * pg;
        m[2] += c * h;
        m[3] += c * kl;
        m[4] += c * -double(log_ratio);
        m[5] += pt.clipped ? c : 0.0;
        m[6] += pt.dual ? c : 0.0;
        const float dratio = w * pt.dpg_dratio * ratio;
        g = cf_pg * (w * pt.dpg_dlp) + cf * (p.kl_coef * dkl);
        if constexpr (K == PolicyLossKind::gspo) {
          gspo[0] += c_pg * double(dratio);
        } else {
          g += cf_pg * dratio;
        }
        ge = -p.entropy_coef * cf;
      }
      p.grad_lp[t] = g;
      if (p.maybe_grad_entropy) p.maybe_grad_entropy[t] = ge;
    }
    if constexpr (K == PolicyLossKind::gspo) {
      // d r / d lp_u = r · m_u / n_s for every response token u, rejected ones
      // included (their lp still moves the sequence ratio). Each thread adds
      // to the tokens it wrote above.
      block_sum(gspo, scratch, lane, warp);
      if (gspo[0] != 0 && n_s > 0) {
        const float add = float(gspo[0] / n_s);
        for (int64_t t = begin + tid; t < end; t += kThreads) {
          if (p.loss_mask[t]) p.grad_lp[t] += add;
        }
      }
    }
    block_sum(m, scratch, lane, warp);
    if (tid == 0) {
#pragma unroll
      for (int i = 0; i < kMetrics; ++i) partials[s * kMetrics + i] = m[i];
    }
  }
}

// metrics[i] = Σ_s partials[s][i], sequences in a fixed order per thread.
__global__ void __launch_bounds__(kThreads)
    reduce_metrics_kernel(const double* partials, int64_t num_seqs, double* metrics) {
  __shared__ double scratch[kWarps * kMetrics];
  const int tid = threadIdx.x;
  double m[kMetrics] = {};
  for (int64_t s = tid; s < num_seqs; s += kThreads) {
#pragma unroll
    for (int i = 0; i < kMetrics; ++i) m[i] += partials[s * kMetrics + i];
  }
  block_sum(m, scratch, tid % 32, tid / 32);
  if (tid < kMetrics) metrics[tid] = m[tid];
}

}  // namespace

std::size_t policy_loss_workspace_bytes(int64_t num_seqs) {
  return std::size_t(num_seqs > 0 ? num_seqs : 0) * kMetrics * sizeof(double);
}

void policy_loss(const PolicyLossParams& p, StreamHandle stream) {
  SLIME_CHECK(p.workspace_bytes >= policy_loss_workspace_bytes(p.num_seqs), "rl::cuda::policy_loss: workspace of ",
              p.workspace_bytes, " bytes, need ", policy_loss_workspace_bytes(p.num_seqs));
  if (p.num_seqs > 0) {
    // One block per sequence up to a grid the GPU holds many times over; the
    // kernel strides over the rest.
    const unsigned grid = unsigned(p.num_seqs < (int64_t(1) << 20) ? p.num_seqs : (int64_t(1) << 20));
    switch (p.kind) {
      case PolicyLossKind::ppo:
        policy_loss_kernel<PolicyLossKind::ppo><<<grid, kThreads, 0, stream>>>(p);
        break;
      case PolicyLossKind::gspo:
        policy_loss_kernel<PolicyLossKind::gspo><<<grid, kThreads, 0, stream>>>(p);
        break;
      case PolicyLossKind::cispo:
        policy_loss_kernel<PolicyLossKind::cispo><<<grid, kThreads, 0, stream>>>(p);
        break;
    }
    SLIME_CUDA_CHECK_LAUNCH();
  }
  reduce_metrics_kernel<<<1, kThreads, 0, stream>>>(static_cast<const double*>(p.workspace), p.num_seqs, p.metrics);
  SLIME_CUDA_CHECK_LAUNCH();
}

}  // namespace slime::rl::cuda
