// CUDA kernels of slime/ops/router.hpp (launchers declared in
// slime/ops/cuda/router.hpp).
//
//   router_forward_kernel    one warp per token row: fp32 softmax over the
//                            row held in registers (expert e on lane e % 32,
//                            slot e / 32), then k rounds of a warp argmax
//                            (largest probability, ties to the lower id);
//                            the top-k sum runs in selection order, as the CPU;
//                            with `replay`, the given ids' probabilities instead.
//   router_backward_kernel   one warp per row: dp from the k (id, dweight)
//                            pairs in slot order, then p (dp − ⟨p, dp⟩).
//   aux_stats_kernel         one block per fixed chunk of rows: integer
//                            histogram of the chunk's ids (shared, then global
//                            integer atomics: exact) and, for the forward, the
//                            chunk's per-expert column sums of probs (fixed
//                            order) into the workspace.
//   aux_flatten_kernel       one block: the chunk sums in chunk order into
//                            router_aux_stats's flat [2E + 1] f32 stats.
//   aux_final_kernel         one block: the E terms in a fixed tree: the loss.
//   aux_backward_kernel      one warp per row: p (g − ⟨p, g⟩), g from counts.
// The last two read the statistics through a source (WorkspaceAuxStats: the
// workspace's integer counts and chunk sums; FlatAuxStats: the flat stats)
// whose values are the same floats for the same rows, so the _from_stats
// calls give router_aux_loss_forward / _backward's bits.
// No float atomics anywhere: every result is the same run to run.
//
// Bytes (the two numbers; FLOPs are negligible): forward reads logits (T E
// elements) and writes probs (4 T E) and indices / weights (T k each);
// backward reads probs and writes dlogits; the auxiliary loss reads probs once.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "memops.cuh"
#include "slime/core/half.hpp"
#include "slime/ops/cuda/router.hpp"

namespace slime::ops::cuda {
namespace {

using namespace ::slime::ops::detail::memops;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
// The auxiliary loss's row chunks: at least kMinChunkRows rows each, at most
// kMaxChunks chunks. The chunking depends only on the row count, so the sums
// are the same on every device.
constexpr int64_t kMinChunkRows = 64;
constexpr int64_t kMaxChunks = 1024;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// Rows handled by warps of a grid-stride loop.
struct WarpRows {
  int lane;
  int64_t first, stride;
};

__device__ __forceinline__ WarpRows warp_rows() {
  return {int(threadIdx.x % 32), blockIdx.x * int64_t(kWarps) + threadIdx.x / 32, int64_t(gridDim.x) * kWarps};
}

unsigned warp_row_blocks(int64_t rows) { return grid_1d(rows, kWarps, int64_t(1) << 20); }

// ---- forward -------------------------------------------------------------------

// The comparison key of a probability: NaN ranks below every probability, so
// the warp argmax is a total order and every lane agrees on the winner.
__device__ __forceinline__ float rank_key(float p) { return p != p ? -1.f : p; }

template <class T, class TW, int kItems>
__global__ void __launch_bounds__(kThreads) router_forward_kernel(const RouterForwardParams p) {
  const WarpRows w = warp_rows();
  const int E = int(p.experts), k = int(p.k), lane = w.lane;
  for (int64_t t = w.first; t < p.tokens; t += w.stride) {
    const T* l = static_cast<const T*>(p.logits) + t * E;
    float v[kItems];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int e = lane + 32 * i;
      v[i] = e < E ? to_float(l[e]) : -INFINITY;
      mx = fmaxf(mx, v[i]);
    }
    mx = warp_max(mx);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int e = lane + 32 * i;
      v[i] = e < E ? expf(v[i] - mx) : 0.f;
      s += v[i];
    }
    s = warp_sum(s);
    float* pr = p.probs + t * E;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int e = lane + 32 * i;
      v[i] = v[i] / s;
      if (e < E) pr[e] = v[i];
    }
    if (p.replay) {
      // Routing replay: the given experts' probabilities, summed in slot
      // order as the top-k path sums its picks (replaying the top-k gives the
      // same bits); an id outside [0, E) weighs 0, a row of them all 0.
      const int32_t* idx = p.indices + t * k;
      float sel_p[kItems] = {};
      float sel_sum = 0.f;
      for (int j = 0; j < k; ++j) {
        const int id = idx[j];
        const bool valid = id >= 0 && id < E;
        float cand = 0.f;
#pragma unroll
        for (int i = 0; i < kItems; ++i)
          if (valid && i == (id >> 5)) cand = v[i];
        const float pj = __shfl_sync(kFull, cand, id & 31);  // 0 from every lane when !valid
#pragma unroll
        for (int m = 0; m < kItems; ++m)
          if (m == (j >> 5) && lane == (j & 31)) sel_p[m] = pj;
        sel_sum += pj;
      }
#pragma unroll
      for (int m = 0; m < kItems; ++m) {
        const int j = lane + 32 * m;
        if (j < k)
          static_cast<TW*>(p.weights)[t * k + j] =
              from_float<TW>(p.norm_topk_prob ? (sel_sum > 0.f ? sel_p[m] / sel_sum : 0.f) : sel_p[m]);
      }
      continue;
    }
    // Top-k: round j picks the largest untaken probability (lowest id on ties).
    uint32_t taken = 0;
    int sel_id[kItems] = {};
    float sel_p[kItems] = {};
    float sel_sum = 0.f;
    for (int j = 0; j < k; ++j) {
      float bv = 0.f;
      int bi = -1;
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        const int e = lane + 32 * i;
        const float key = rank_key(v[i]);
        if (e < E && !((taken >> i) & 1u) && (bi < 0 || key > bv)) {
          bv = key;
          bi = e;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(kFull, bv, o);
        const int oi = __shfl_xor_sync(kFull, bi, o);
        if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
          bv = ov;
          bi = oi;
        }
      }
      // bi >= 0: j < k <= E leaves an untaken expert.
      const float pj = bv < 0.f ? NAN : bv;  // the winner's probability (NaN ranked as -1)
      if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
#pragma unroll
      for (int m = 0; m < kItems; ++m)
        if (m == (j >> 5) && lane == (j & 31)) {
          sel_id[m] = bi;
          sel_p[m] = pj;
        }
      sel_sum += pj;  // in selection order, as the CPU
    }
#pragma unroll
    for (int m = 0; m < kItems; ++m) {
      const int j = lane + 32 * m;
      if (j < k) {
        p.indices[t * k + j] = sel_id[m];
        static_cast<TW*>(p.weights)[t * k + j] = from_float<TW>(p.norm_topk_prob ? sel_p[m] / sel_sum : sel_p[m]);
      }
    }
  }
}

// ---- backward ------------------------------------------------------------------

template <class TW, class TG, int kItems>
__global__ void __launch_bounds__(kThreads) router_backward_kernel(const RouterBackwardParams p) {
  const WarpRows w = warp_rows();
  const int E = int(p.experts), k = int(p.k), lane = w.lane;
  for (int64_t t = w.first; t < p.tokens; t += w.stride) {
    const float* pr = p.probs + t * E;
    const int32_t* idx = p.indices + t * k;
    const TW* dw = static_cast<const TW*>(p.dweights) + t * k;
    // Every lane walks the k slots in order (broadcast loads), as the CPU.
    float s = 0.f, c = 0.f;
    if (p.norm_topk_prob) {
      for (int j = 0; j < k; ++j) {
        const int id = idx[j];
        if (id >= 0 && id < E) s += pr[id];
      }
      for (int j = 0; j < k; ++j) {
        const int id = idx[j];
        if (id >= 0 && id < E) c += to_float(dw[j]) * (pr[id] / s);
      }
    }
    float dp[kItems];
#pragma unroll
    for (int i = 0; i < kItems; ++i) dp[i] = 0.f;
    for (int j = 0; j < k; ++j) {
      const int id = idx[j];
      if (id < 0 || id >= E || (id & 31) != lane) continue;
      const float d = to_float(dw[j]);
      const float g = p.norm_topk_prob ? (d - c) / s : d;
#pragma unroll
      for (int i = 0; i < kItems; ++i)
        if (i == (id >> 5)) dp[i] += g;
    }
    float pv[kItems], dot = 0.f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int e = lane + 32 * i;
      pv[i] = e < E ? pr[e] : 0.f;
      dot += pv[i] * dp[i];
    }
    dot = warp_sum(dot);
    TG* out = static_cast<TG*>(p.dlogits) + t * E;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int e = lane + 32 * i;
      if (e >= E) continue;
      const float g = pv[i] * (dp[i] - dot);
      out[e] = from_float<TG>(p.accumulate ? to_float(out[e]) + g : g);
    }
  }
}

// ---- auxiliary loss ------------------------------------------------------------

struct AuxLayout {
  int64_t chunk_rows, chunks;
  std::size_t counts_bytes, sums_offset, total_bytes;
};

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

AuxLayout aux_layout(int64_t rows, int64_t experts) {
  AuxLayout l;
  const int64_t want = std::clamp<int64_t>((rows + kMinChunkRows - 1) / kMinChunkRows, 1, kMaxChunks);
  l.chunk_rows = std::max<int64_t>((rows + want - 1) / want, 1);
  l.chunks = std::max<int64_t>((rows + l.chunk_rows - 1) / l.chunk_rows, 1);
  l.counts_bytes = round_up(std::size_t(experts) * 4, 256);
  l.sums_offset = l.counts_bytes;
  l.total_bytes = l.sums_offset + round_up(std::size_t(l.chunks * experts) * 4, 256);
  return l;
}

// The statistics as the loss kernels read them (count(e), prob_sum(e) and
// rows_f(), as floats), from one of two sources.
// The workspace of one call: integer counts [E] and chunk sums [chunks, E]
// (prob_sum sums the chunks in order; sums is null where unused).
struct WorkspaceAuxStats {
  const int32_t* counts;
  const float* sums;
  int64_t chunks, rows;
  int E;
  __device__ float count(int e) const { return float(counts[e]); }
  __device__ float prob_sum(int e) const {
    float ps = 0.f;
    for (int64_t c = 0; c < chunks; ++c) ps += sums[c * E + e];
    return ps;
  }
  __device__ float rows_f() const { return float(rows); }
};

// router_aux_stats's [2E + 1] f32 vector (possibly summed over ranks).
struct FlatAuxStats {
  const float* stats;
  int E;
  __device__ float count(int e) const { return stats[e]; }
  __device__ float prob_sum(int e) const { return stats[E + e]; }
  __device__ float rows_f() const { return stats[2 * E]; }
};

// Block c: the ids of rows [c R, min((c + 1) R, rows)) counted into counts
// (integer atomics: exact); with sums, the chunk's column sums of probs into
// sums[c, :] (row lanes in a fixed order).
__global__ void __launch_bounds__(kThreads)
    aux_stats_kernel(const float* probs, const int32_t* indices, int64_t rows, int E, int k, int64_t chunk_rows,
                     int32_t* counts, float* sums) {
  __shared__ int hist[kRouterMaxExperts];
  __shared__ float part[kThreads];
  const int tid = threadIdx.x;
  const int64_t r0 = blockIdx.x * chunk_rows, r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
  for (int e = tid; e < E; e += kThreads) hist[e] = 0;
  __syncthreads();
  for (int64_t i = r0 * k + tid; i < r1 * k; i += kThreads) {
    const int id = indices[i];
    if (id >= 0 && id < E) atomicAdd(&hist[id], 1);
  }
  __syncthreads();
  for (int e = tid; e < E; e += kThreads)
    if (hist[e] != 0) atomicAdd(&counts[e], hist[e]);
  if (sums == nullptr) return;
  const int lanes = kThreads / E;  // E <= kThreads
  const int e = tid % E, rl = tid / E;
  float acc = 0.f;
  if (rl < lanes)
    for (int64_t r = r0 + rl; r < r1; r += lanes) acc += probs[r * E + e];
  part[tid] = acc;
  __syncthreads();
  if (tid < E) {
    float s = 0.f;
    for (int q = 0; q < lanes; ++q) s += part[q * E + tid];
    sums[blockIdx.x * int64_t(E) + tid] = s;
  }
}

// stats [2E + 1] = (counts, prob sums, rows) of the workspace (= or += with accumulate).
__global__ void __launch_bounds__(kThreads)
    aux_flatten_kernel(const WorkspaceAuxStats s, float* stats, bool accumulate) {
  const int E = s.E;
  for (int i = threadIdx.x; i <= 2 * E; i += kThreads) {
    const float v = i < E ? s.count(i) : i < 2 * E ? s.prob_sum(i - E) : s.rows_f();
    stats[i] = accumulate ? stats[i] + v : v;
  }
}

// *loss = E · Σ_e (count_e / N) · (prob_sum_e / N); 0 for N = 0.
template <class Stats>
__global__ void __launch_bounds__(kThreads) aux_final_kernel(const Stats s, float* loss) {
  __shared__ float scratch[kWarps];
  const int tid = threadIdx.x, E = s.E;
  const float n = s.rows_f();
  float term = 0.f;
  if (tid < E) {
    const float ps = s.prob_sum(tid);
    term = (s.count(tid) / n) * (ps / n);
  }
  term = warp_sum(term);
  if (tid % 32 == 0) scratch[tid / 32] = term;
  __syncthreads();
  if (tid < 32) {
    float v = tid < kWarps ? scratch[tid] : 0.f;
    v = warp_sum(v);
    if (tid == 0) *loss = n == 0.f ? 0.f : float(E) * v;
  }
}

// dlogits of `rows` rows of probs; g from the statistics of N >= rows rows.
template <class TG, int kItems, class Stats>
__global__ void __launch_bounds__(kThreads)
    aux_backward_kernel(const float* probs, const Stats s, int64_t rows, float dloss, TG* dlogits, bool accumulate) {
  const WarpRows w = warp_rows();
  const int lane = w.lane, E = s.E;
  const float n = s.rows_f();
  float g[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int e = lane + 32 * i;
    // The CPU's expression, in its order.
    g[i] = e < E && n != 0.f ? dloss * float(E) * s.count(e) / (n * n) : 0.f;
  }
  for (int64_t t = w.first; t < rows; t += w.stride) {
    const float* pr = probs + t * E;
    float pv[kItems], dot = 0.f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int e = lane + 32 * i;
      pv[i] = e < E ? pr[e] : 0.f;
      dot += pv[i] * g[i];
    }
    dot = warp_sum(dot);
    TG* out = dlogits + t * E;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int e = lane + 32 * i;
      if (e >= E) continue;
      const float d = pv[i] * (g[i] - dot);
      out[e] = from_float<TG>(accumulate ? to_float(out[e]) + d : d);
    }
  }
}

// ---- dispatch ------------------------------------------------------------------

template <class F>
void with_type(DType t, const char* what, F&& f) {
  if (t == DType::f32) {
    f(float{});
  } else if (t == DType::bf16) {
    f(BFloat16{});
  } else {
    SLIME_FAIL("router: ", what, " must be f32 or bf16, got ", dtype_name(t));
  }
}

// Calls f(std::integral_constant<int, kItems>) with the registers per lane for E experts.
template <class F>
void with_items(int64_t experts, F&& f) {
  SLIME_CHECK(experts >= 1 && experts <= kRouterMaxExperts, "router: the CUDA path takes 1 to ", kRouterMaxExperts,
              " experts, got ", experts);
  if (experts <= 32) {
    f(std::integral_constant<int, 1>{});
  } else if (experts <= 64) {
    f(std::integral_constant<int, 2>{});
  } else if (experts <= 128) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 8>{});
  }
}

AuxLayout checked_aux_layout(const RouterAuxParams& p) {
  const AuxLayout l = aux_layout(p.rows, p.experts);
  SLIME_CHECK(p.workspace != nullptr && p.workspace_bytes >= l.total_bytes, "router aux loss: workspace of ",
              p.workspace_bytes, " bytes, needs ", l.total_bytes, " (router_aux_loss_workspace_bytes)");
  return l;
}

// counts [E] (workspace) = the ids' histogram; sums [chunks, E] with the
// column sums when with_sums. Returns them as the loss kernels read them.
WorkspaceAuxStats aux_stats(const RouterAuxParams& p, const AuxLayout& l, bool with_sums, StreamHandle stream) {
  auto* base = static_cast<char*>(p.workspace);
  auto* counts = reinterpret_cast<int32_t*>(base);
  float* sums = with_sums ? reinterpret_cast<float*>(base + l.sums_offset) : nullptr;
  SLIME_CUDA_CHECK(cudaMemsetAsync(counts, 0, std::size_t(p.experts) * 4, stream));
  aux_stats_kernel<<<unsigned(l.chunks), kThreads, 0, stream>>>(p.probs, p.indices, p.rows, int(p.experts), int(p.k),
                                                                l.chunk_rows, counts, sums);
  SLIME_CUDA_CHECK_LAUNCH();
  return {counts, sums, l.chunks, p.rows, int(p.experts)};
}

template <class Stats>
void aux_backward(const float* probs, const Stats& s, int64_t rows, float dloss, void* dlogits, DType dlogits_dtype,
                  bool accumulate, StreamHandle stream) {
  with_items(s.E, [&](auto items) {
    with_type(dlogits_dtype, "dlogits", [&](auto gt) {
      using TG = decltype(gt);
      aux_backward_kernel<TG, decltype(items)::value, Stats><<<warp_row_blocks(rows), kThreads, 0, stream>>>(
          probs, s, rows, dloss, static_cast<TG*>(dlogits), accumulate);
    });
  });
  SLIME_CUDA_CHECK_LAUNCH();
}

}  // namespace

std::size_t router_aux_loss_workspace_bytes(int64_t rows, int64_t experts) {
  return aux_layout(rows, experts).total_bytes;
}

void router_forward(const RouterForwardParams& p, StreamHandle stream) {
  if (p.tokens == 0) return;
  SLIME_CHECK(p.k >= 1 && p.k <= p.experts, "router_forward: k = ", p.k, " must be in [1, ", p.experts, "]");
  with_type(p.logits_dtype, "logits", [&](auto lt) {
    using T = decltype(lt);
    with_type(p.weights_dtype, "weights", [&](auto wt) {
      using TW = decltype(wt);
      with_items(p.experts, [&](auto items) {
        router_forward_kernel<T, TW, decltype(items)::value><<<warp_row_blocks(p.tokens), kThreads, 0, stream>>>(p);
      });
    });
  });
  SLIME_CUDA_CHECK_LAUNCH();
}

void router_backward(const RouterBackwardParams& p, StreamHandle stream) {
  if (p.tokens == 0) return;
  with_type(p.dweights_dtype, "dweights", [&](auto wt) {
    using TW = decltype(wt);
    with_type(p.dlogits_dtype, "dlogits", [&](auto gt) {
      using TG = decltype(gt);
      with_items(p.experts, [&](auto items) {
        router_backward_kernel<TW, TG, decltype(items)::value><<<warp_row_blocks(p.tokens), kThreads, 0, stream>>>(p);
      });
    });
  });
  SLIME_CUDA_CHECK_LAUNCH();
}

void router_aux_loss_forward(const RouterAuxParams& p, float* loss, StreamHandle stream) {
  if (p.rows == 0) {
    SLIME_CUDA_CHECK(cudaMemsetAsync(loss, 0, sizeof(float), stream));
    return;
  }
  with_items(p.experts, [](auto) {});  // the range check
  const AuxLayout l = checked_aux_layout(p);
  const WorkspaceAuxStats s = aux_stats(p, l, true, stream);
  aux_final_kernel<<<1, kThreads, 0, stream>>>(s, loss);
  SLIME_CUDA_CHECK_LAUNCH();
}

void router_aux_loss_backward(const RouterAuxParams& p, float dloss, void* dlogits, DType dlogits_dtype,
                              bool accumulate, StreamHandle stream) {
  if (p.rows == 0) return;
  with_items(p.experts, [](auto) {});  // the range check, before any launch
  with_type(dlogits_dtype, "dlogits", [](auto) {});
  const AuxLayout l = checked_aux_layout(p);
  const WorkspaceAuxStats s = aux_stats(p, l, false, stream);
  aux_backward(p.probs, s, p.rows, dloss, dlogits, dlogits_dtype, accumulate, stream);
}

void router_aux_stats(const RouterAuxParams& p, float* stats, bool accumulate, StreamHandle stream) {
  with_items(p.experts, [](auto) {});  // the range check
  if (p.rows == 0) {
    if (!accumulate) SLIME_CUDA_CHECK(cudaMemsetAsync(stats, 0, std::size_t(2 * p.experts + 1) * 4, stream));
    return;
  }
  const AuxLayout l = checked_aux_layout(p);
  const WorkspaceAuxStats s = aux_stats(p, l, true, stream);
  aux_flatten_kernel<<<1, kThreads, 0, stream>>>(s, stats, accumulate);
  SLIME_CUDA_CHECK_LAUNCH();
}

void router_aux_loss_from_stats(const float* stats, int64_t experts, float* loss, StreamHandle stream) {
  with_items(experts, [](auto) {});  // the range check
  aux_final_kernel<<<1, kThreads, 0, stream>>>(FlatAuxStats{stats, int(experts)}, loss);
  SLIME_CUDA_CHECK_LAUNCH();
}

void router_aux_loss_backward_from_stats(const RouterAuxFromStatsParams& p, StreamHandle stream) {
  if (p.rows == 0) return;
  aux_backward(p.probs, FlatAuxStats{p.stats, int(p.experts)}, p.rows, p.dloss, p.dlogits, p.dlogits_dtype,
               p.accumulate, stream);
}

}  // namespace slime::ops::cuda
