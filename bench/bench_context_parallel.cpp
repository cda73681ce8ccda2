// bench/bench_context_parallel.cpp: what sequence (context) parallelism
// (parallel/context_parallel.hpp) costs, measured on one GPU (H200, bf16):
// three studies, each a family of rows. No PyTorch baseline.
//
// 1. cp/ring/<batch>/hkv<H>/r<r>/{zigzag,whole256}: the ring's block attentions against
//    one causal attention of the whole batch (ring-flash-attention's
//    efficiency). Batches: "seq32768", one sequence of 32768 tokens;
//    "varlen16", 16 RL-like sequences of 512 .. 4096 tokens, 9 of odd length,
//    32547 tokens (kVarlenLengths); "varlen_rfa", ring-flash-attention's
//    varlen benchmark workload at r GPUs (kRfaLengthsPerGpu x r, 24576 r
//    tokens: its anchor figure's batch, mostly long sequences). Hq 16, Hkv 16 or 4, head_dim 128, causal;
//    ring degree r = 2, 4, 8 (ulysses 1). The schedule is ContextParallel's
//    (ring_forward / ring_backward), rebuilt from the public
//    CpPlan::make(cu, 1, r, i, min_chunk) and ring_blocks(): ring rank i at step
//    s = 0 .. r-1 holds the K/V block of rank j = (i - s) mod r and runs
//      s == 0: blocks.self   causal, its rows over its rows
//      j != i: blocks.from[j] no mask (j < i: "before", j > i: "after"; a
//              sequence whole on one rank has no rows across ranks)
//    with q = rank i's rows [T_r, Hq, d] and the K/V block = rank j's rows
//    [T_r, Hkv, d] (T_r = the padded tokens / r, the same on every rank).
//    Each block is timed alone, forward (attention_forward) and forward +
//    backward (attention_backward with the merged o and lse, as the ring's
//    backward), and summed over every rank and step. Counters (ms: the median
//    over kRingReps back-to-back calls after kRingWarmup):
//      full_fwd_ms, full_fwd_bwd_ms   one causal attention of the whole batch
//      full_fwd_tflops, full_fwd_bwd_tflops   its FLOP (4 d Hq pairs forward,
//                       3.5x that forward + backward; pairs = sum over
//                       sequences of n (n + 1) / 2) / its time
//      blocks_fwd_ms, blocks_fwd_bwd_ms   the sum of the r^2 block times
//      efficiency_fwd, efficiency_fwd_bwd = full / blocks (ideal 1: the ring
//                       splits the work without adding any). Below 1: the
//                       blocks' padding rows, their smaller tiles and tails,
//                       and per-launch costs
//      rank_{fwd,fwd_bwd}_{min,max}_ms    min / max over ranks of a rank's
//                       sum over its steps (the load balance of zigzag)
//      efficiency_{fwd,fwd_bwd}_rank_max = full / (r * the slowest rank): r
//                       GPUs running their blocks back to back, never waiting
//      efficiency_{fwd,fwd_bwd}_step_max = full / (r * sum over steps of the
//                       slowest rank's block): the ring in lockstep (each step
//                       waits for the K/V from the previous rank)
//      overhead_fwd_ms, overhead_fwd_bwd_ms   the ring's elementwise work over
//                       all ranks, from single-op times on the rank's shapes:
//                       forward: pack_kv (2 casts), cast of the step-0 output
//                       to f32, r-1 merge_attention_partials, cast to bf16;
//                       backward: pack_kv, r x (cast + add of dq, dk, dv into
//                       f32), 3 final casts (the zero fills are left out)
//      efficiency_{fwd,fwd_bwd}_with_overhead = full / (blocks + overhead)
//      tokens, padded_tokens (r T_r), ring, heads_q, heads_kv, head_dim
//    Communication is not in these numbers (one GPU). For comparison,
//    ring-flash-attention's README (zhuzilin/ring-flash-attention; 8 x H800,
//    Llama-3.1-8B's attention, 8k tokens per GPU) reports forward + backward
//    90.2% for zigzag and 75.9% for varlen zigzag: the ideal time (8 x one
//    GPU's flash attention over its own 8k tokens, 1/64 of the 64k causal
//    work) over the ring's on 8 GPUs, exchanges, merges and the slowest rank
//    included; the nearest of ours are efficiency_fwd_bwd_step_max and
//    _with_overhead.
//    Check (first): the ring's merged o and lse, and dq, dk, dv summed over
//    the blocks (dk / dv to the K/V's owner), against the full attention's on
//    every 31st real row of every rank (relative L2: o 1e-2, lse 1e-3,
//    gradients 2e-2). SLIME_BENCH_CP_BREAKDOWN=1 prints every (rank, step)
//    block's kind and times.
//
// 2. cp/ulysses/<shape>/s<S>/u<u>: Ulysses' all-to-all bytes per layer
//    against the attention they feed. Shapes: "moe" (bench_models.hpp
//    moe_config(): 16 / 4 heads, head_dim 64, hidden 1024) and "a3b"
//    (Qwen3-30B-A3B's attention: 32 / 4 heads, head_dim 128, hidden 2048);
//    one sequence of S = 16k, 32k, 64k tokens; cp = u = 2, 4, 8 (ring 1).
//    Each rank holds [S/u, H, d] of q, k, v and sends (u - 1) / u of each
//    through one all_to_all (ContextParallel::to_heads), and as much of o
//    (to_sequence); the backward moves dO, dq, dk, dv the same way:
//      a2a_fwd_MB = a2a_bwd_MB = 2 (u-1)/u (S/u) (Hq + Hkv') d bytes / 1e6
//    (bf16; per rank, sent, per layer), Hkv' = Hkv, or u when u > Hkv:
//    ContextParallel refuses u that does not divide the KV heads (Hkv 4,
//    u 8); those rows count the KV heads replicated to one per rank
//    (kv_replicated 1), what an implementation with KV-head replication would
//    send. The attention a rank then computes: S tokens, Hq/u query heads,
//    Hkv'/u KV heads; attn_fwd_GFLOP = 4 d (Hq/u) S (S + 1) / 2 / 1e9,
//    backward 2.5x. Counters: flop_per_byte_{fwd,bwd} (attention FLOP / a2a
//    bytes), attn_{fwd,bwd}_ms (measured, median of kUlyssesReps; checked
//    first: o of one head on the last rows against the CPU reference),
//    attn_{fwd,bwd}_tflops, a2a_{fwd,bwd}_ms = bytes / link_GBps (the
//    all-to-alls at the link rate, latency ignored), comm_over_attn_{fwd,bwd}
//    = a2a_ms / attn_ms (ContextParallel runs the all-to-alls before and
//    after the attention, not overlapped: the fraction adds to the layer's
//    attention time). link_GBps: 450 by default, NVLink 4 on H200 SXM (NVIDIA's
//    H200 datasheet: 900 GB/s bidirectional per GPU, 450 per direction), a
//    peak an all_to_all does not reach (bench_collectives measures
//    all_to_all); SLIME_BENCH_CP_LINK_GBPS overrides it.
//
// 3. cp/longest_seq/moe/cp1: the longest single sequence the Qwen3-MoE
//    benchmark model (bench_models.hpp moe_config(), bf16) trains at cp = 1
//    on one GPU: Sharded<Qwen3Model, FullShard> on a 1-rank NcclComm as
//    bench_fsdp's gpus1 (fp32 master weights, gradients and AdamW moments on
//    the GPU; no activation checkpointing), one step = zero_grad, forward,
//    fused LM head + token log-probabilities, their backward, backward, AdamW.
//    Lengths double from 4096 until a step runs out of memory (a
//    slime::Error saying so; any other error ends the row), then a bisection
//    to 1024 tokens between the longest that fit and the shortest that did
//    not. Its probes follow the memory line (peak bytes above the state
//    against length, through the two longest fitting tries) at 98% of the
//    free memory while such probes fit, else at 100% once, else the
//    midpoint. Before each try the pool is trimmed (release_cached_memory)
//    and the peak reset; after it the modules' workspaces are dropped. Time
//    cap: a try whose predicted time (the longest fitting try's x (length
//    ratio)^2) would take the tries past kSearchBudgetS
//    (SLIME_BENCH_CP_SEARCH_S overrides) is not run; instead one last try at
//    the longest length the rest of the budget affords (at most the line's
//    98% length) tightens the lower bound, and the search stops with
//    time_capped 1: the bracket is what was verified, predicted_max_tokens
//    what the line says (causal attention's time grows as the square of the
//    length: near the limit one try can take much of the budget). Counters:
//      max_tokens, first_oom_tokens (0: none), bracket_tokens (their gap)
//      peak_gib     memory_stats().peak_bytes during the longest fitting step
//                   (everything slime allocated: model state + the step's)
//      state_gib    what was allocated before that step (weights, master,
//                   gradients, AdamW moments)
//      reserved_gib the pool's reserved bytes after it
//      free_gib     the device's free memory before it (cudaMemGetInfo)
//      step_ms      its time (CUDA events)
//      mib_per_1k_tokens  slope of the memory line
//      predicted_max_tokens  where the line meets free_gib (not verified)
//      tries, search_s (the tries' wall time), time_capped
//    Every try is printed (length, fits, seconds, peak, step time, loss);
//    the loss of a fitting try must be finite and within 1 of ln(vocab).
//
// Run: build/<dir>/bench/bench_context_parallel (tools/gpu-test.sh with
// SLIME_GPU_TEST_BENCH=context_parallel builds and runs it); rows by
// --benchmark_filter=cp/ring, cp/ulysses, cp/longest_seq.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench_models.hpp"
#include "bench_util.hpp"
#include "slime/comm/nccl_comm.hpp"
#include "slime/core/cuda_runtime.hpp"
#include "slime/core/half.hpp"
#include "slime/core/memory.hpp"
#include "slime/core/random.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/ops/attention.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/ops/index_rows.hpp"
#include "slime/parallel/context_parallel.hpp"
#include "slime/parallel/sharded.hpp"

namespace {

using namespace slime;

constexpr double kGiB = double(int64_t(1) << 30);

const Stream& bench_stream() {
  static const Stream s = Stream::create(Device::cuda(0));
  return s;
}

// Median milliseconds of one call of fn() on `s`: `warmup` untimed calls,
// then `reps` calls back to back with an event before each and after the
// last (the host runs ahead, so no call waits for the next launch), one
// synchronisation.
double median_ms(const Stream& s, int warmup, int reps, const std::function<void()>& fn) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<Event> marks;
  for (int i = 0; i <= reps; ++i) marks.emplace_back(s.device());
  for (int i = 0; i < reps; ++i) {
    marks[std::size_t(i)].record(s);
    fn();
  }
  marks.back().record(s);
  marks.back().synchronize();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i)
    ms.push_back(double(Event::elapsed_ms(marks[std::size_t(i)], marks[std::size_t(i) + 1])));
  std::sort(ms.begin(), ms.end());
  return ms.size() % 2 ? ms[ms.size() / 2] : 0.5 * (ms[ms.size() / 2 - 1] + ms[ms.size() / 2]);
}

// A positive number from the environment variable `name`, or `fallback`.
double env_positive(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == 0) return fallback;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  SLIME_CHECK(end != v && *end == 0 && x > 0, name, "='", v, "' is not a positive number");
  return x;
}

std::vector<float> host_floats(const Tensor& t, const Stream& s) {
  if (t.dtype() == DType::f32) return t.to_vector<float>(s);
  std::vector<float> out;
  for (BFloat16 x : t.to_vector<BFloat16>(s)) out.push_back(float(x));
  return out;
}

// Rows `rows` of x [N, ...] (any dtype), as floats on the host.
std::vector<float> host_rows(const Tensor& x, const std::vector<int32_t>& rows, const Stream& s) {
  Shape shape = x.shape();
  shape[0] = int64_t(rows.size());
  Tensor out = Tensor::empty(shape, x.dtype(), x.device(), s);
  ops::gather_rows(x, Tensor::from_vector(rows, {int64_t(rows.size())}, x.device(), s), out, s);
  return host_floats(out, s);
}

// sqrt(sum (got - want)^2 / sum want^2) over everything added.
struct RelError {
  double diff = 0, ref = 0;
  void add(const std::vector<float>& got, const std::vector<float>& want) {
    for (std::size_t i = 0; i < got.size(); ++i) {
      diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
      ref += double(want[i]) * want[i];
    }
  }
  double value() const { return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff); }
};

// Causal (query, key) pairs of a batch: sum over sequences of n (n + 1) / 2.
double causal_pairs(const std::vector<int32_t>& cu) {
  double p = 0;
  for (std::size_t b = 0; b + 1 < cu.size(); ++b) p += double(cu[b + 1] - cu[b]) * double(cu[b + 1] - cu[b] + 1) / 2;
  return p;
}

// ---- 1. the zigzag ring's blocks against one full attention ----------------

constexpr int64_t kRingHeadsQ = 16, kRingHeadDim = 128;
constexpr int kRingWarmup = 2, kRingReps = 7;
constexpr std::size_t kCheckStride = 31;  // every 31st real row is checked

// RL-like lengths: 512 .. 4096, 9 odd, in no order; 32547 tokens.
constexpr int32_t kVarlenLengths[] = {2731, 512, 4096, 1283, 3001, 777,  2048, 3967,
                                      1536, 999, 2560, 3584, 603,  2049, 1024, 1777};

struct RingBatch {
  std::string name;
  std::vector<int32_t> cu;  // cu_seqlens, host
};

RingBatch one_sequence_batch() { return {"seq32768", {0, 32768}}; }

RingBatch varlen_batch() {
  RingBatch b{"varlen16", {0}};
  for (int32_t n : kVarlenLengths) b.cu.push_back(b.cu.back() + n);
  return b;
}

// ring-flash-attention's varlen benchmark workload (its
// benchmark/benchmark_varlen_kvpacked_func.py): 8192 tokens per GPU, packed
// as [256, 7392, 544], [4096, 4096] or [3104, 3200, 1600, 160, 128] tokens per
// GPU, each sequence r times as long globally (its cu_seqlens x world size).
// Here the three mixes are packed into one batch: 24576 r tokens.
constexpr int32_t kRfaLengthsPerGpu[] = {256, 7392, 544, 4096, 4096, 3104, 3200, 1600, 160, 128};

RingBatch rfa_batch(int ring) {
  RingBatch b{"varlen_rfa", {0}};
  for (int32_t n : kRfaLengthsPerGpu) b.cu.push_back(b.cu.back() + n * ring);
  return b;
}

// The whole batch's inputs and its causal attention: the denominator of the
// efficiencies and the reference of the check. Kept for the rows that share it.
struct FullAttention {
  std::string key;
  std::vector<int32_t> cu;
  int64_t max_len = 0;
  Tensor cu_dev, q, k, v, d_o, o, lse, dq, dk, dv, ws;
  double fwd_ms = 0, fwd_bwd_ms = 0;
};

std::unique_ptr<FullAttention> g_full;

FullAttention& full_attention(const RingBatch& batch, int64_t heads_kv, const Stream& s) {
  const std::string key = batch.name + "/" + std::to_string(heads_kv) + "/" + std::to_string(batch.cu.back());
  if (g_full && g_full->key == key) return *g_full;
  g_full.reset();
  auto f = std::make_unique<FullAttention>();
  const Device dev = s.device();
  const int64_t T = batch.cu.back(), d = kRingHeadDim;
  f->key = key;
  f->cu = batch.cu;
  for (std::size_t b = 0; b + 1 < batch.cu.size(); ++b)
    f->max_len = std::max<int64_t>(f->max_len, batch.cu[b + 1] - batch.cu[b]);
  f->cu_dev = Tensor::from_vector(batch.cu, {int64_t(batch.cu.size())}, dev, s);
  uint64_t seed = 1;
  for (auto [t, heads] : {std::pair{&f->q, kRingHeadsQ}, std::pair{&f->k, heads_kv}, std::pair{&f->v, heads_kv},
                          std::pair{&f->d_o, kRingHeadsQ}}) {
    *t = Tensor::empty({T, heads, d}, DType::bf16, dev, s);
    fill_uniform(*t, seed++, 0, -1.f, 1.f, s);
  }
  f->o = Tensor::empty(f->q.shape(), DType::bf16, dev, s);
  f->lse = Tensor::empty({T, kRingHeadsQ}, DType::f32, dev, s);
  f->dq = Tensor::empty(f->q.shape(), DType::bf16, dev, s);
  f->dk = Tensor::empty(f->k.shape(), DType::bf16, dev, s);
  f->dv = Tensor::empty(f->v.shape(), DType::bf16, dev, s);
  f->ws = Tensor::empty({ops::attention_backward_workspace_elems(f->q)}, DType::f32, dev, s);
  FullAttention& r = *f;
  const auto fwd = [&] {
    ops::attention_forward(r.q, r.k, r.v, r.cu_dev, r.cu_dev, r.max_len, r.max_len, r.o, r.lse, {}, s);
  };
  const auto bwd = [&] {
    ops::attention_backward(r.q, r.k, r.v, r.o, r.lse, r.d_o, r.cu_dev, r.cu_dev, r.max_len, r.max_len, r.dq, r.dk,
                            r.dv, {}, r.ws, s);
  };
  r.fwd_ms = median_ms(s, kRingWarmup, kRingReps, fwd);
  r.fwd_bwd_ms = median_ms(s, kRingWarmup, kRingReps, [&] {
    fwd();
    bwd();
  });
  g_full = std::move(f);
  return *g_full;
}

// One ring rank's rows of the batch (the K/V block it starts with is its own
// k and v) and what its ring forward produced.
struct RingRank {
  parallel::CpPlan plan;
  parallel::RingBlocks blocks;
  Tensor q, k, v, d_o;  // [T_r, H, d]: rows `plan.rows` of the batch's (padding rows: q, k, v row 0's, d_o 0)
  Tensor o, lse;        // the merged ring forward: the backward's o and lse
  Tensor dq, dk, dv;    // f32: the check's sums over the blocks (dk, dv: of this rank's K/V)
};

// The block ring rank i runs at step s (ContextParallel::ring_forward).
struct RingStep {
  const parallel::RingBlock* block;
  int kv_rank;  // j = (i - s) mod r: whose K/V block
  const char* kind;
};

RingStep ring_step(const RingRank& rank, int i, int step, int ring) {
  const int j = (i - step + ring) % ring;
  return {&rank.blocks.of(j, i), j, j == i ? "self" : j < i ? "before" : "after"};
}

void block_forward(const RingRank& a, const RingRank& kv, const RingStep& st, const Tensor& o, const Tensor& lse,
                   const Stream& s) {
  ops::AttentionOptions opt;
  opt.causal = st.block->causal;
  ops::attention_forward(a.q, kv.k, kv.v, st.block->cu_q, st.block->cu_k, st.block->max_q, st.block->max_k, o, lse, opt,
                         s);
}

void block_backward(const RingRank& a, const RingRank& kv, const RingStep& st, const Tensor& dq, const Tensor& dk,
                    const Tensor& dv, const Tensor& ws, const Stream& s) {
  ops::AttentionOptions opt;
  opt.causal = st.block->causal;
  ops::attention_backward(a.q, kv.k, kv.v, a.o, a.lse, a.d_o, st.block->cu_q, st.block->cu_k, st.block->max_q,
                          st.block->max_k, dq, dk, dv, opt, ws, s);
}

std::vector<RingRank> make_ring(const FullAttention& f, int ring, int64_t min_chunk, const Stream& s) {
  const Device dev = s.device();
  std::vector<RingRank> ranks(static_cast<std::size_t>(ring));
  // d_o with a zero row at its end for the padding rows (a loss weight of 0:
  // padding queries see real keys, their d_o must not reach dk and dv).
  const int64_t T_global = f.cu.back();
  const Tensor d_o_padded = Tensor::zeros({T_global + 1, f.d_o.size(1), f.d_o.size(2)}, f.d_o.dtype(), dev, s);
  d_o_padded.slice_rows(0, T_global).copy_from(f.d_o, s);
  for (int i = 0; i < ring; ++i) {
    RingRank& r = ranks[std::size_t(i)];
    r.plan = parallel::CpPlan::make(f.cu, 1, ring, i, min_chunk);
    r.blocks = parallel::ring_blocks(r.plan, dev, s);
    const int64_t T = r.plan.local_tokens();
    std::vector<int32_t> index, index_do;
    for (int64_t g : r.plan.rows) {
      index.push_back(g < 0 ? 0 : int32_t(g));
      index_do.push_back(g < 0 ? int32_t(f.cu.back()) : int32_t(g));
    }
    const auto take = [&](const Tensor& x, const std::vector<int32_t>& rows) {
      Tensor out = Tensor::empty({T, x.size(1), x.size(2)}, x.dtype(), dev, s);
      ops::gather_rows(x, Tensor::from_vector(rows, {T}, dev, s), out, s);
      return out;
    };
    r.q = take(f.q, index);
    r.k = take(f.k, index);
    r.v = take(f.v, index);
    r.d_o = take(d_o_padded, index_do);
    r.o = Tensor::empty(r.q.shape(), DType::bf16, dev, s);
    r.lse = Tensor::empty({T, r.q.size(1)}, DType::f32, dev, s);
    r.dq = Tensor::zeros(r.q.shape(), DType::f32, dev, s);
    r.dk = Tensor::zeros(r.k.shape(), DType::f32, dev, s);
    r.dv = Tensor::zeros(r.v.shape(), DType::f32, dev, s);
  }
  return ranks;
}

// Per-rank scratch of the ring's steps (the shapes of every rank are equal).
struct RingScratch {
  Tensor acc, part, part_lse;  // forward: f32 [T_r, Hq, d], bf16 block output, f32 [T_r, Hq]
  Tensor dq, dk, dv;           // a block's gradients, bf16
  Tensor f32_q, f32_kv;        // cast targets of the accumulation
  Tensor kv;                   // [2, T_r, Hkv, d]: pack_kv's buffer
  Tensor ws;                   // attention_backward's workspace
};

RingScratch make_scratch(const RingRank& r, const Stream& s) {
  const Device dev = s.device();
  RingScratch x;
  x.acc = Tensor::empty(r.q.shape(), DType::f32, dev, s);
  x.part = Tensor::empty(r.q.shape(), DType::bf16, dev, s);
  x.part_lse = Tensor::empty(r.lse.shape(), DType::f32, dev, s);
  x.dq = Tensor::empty(r.q.shape(), DType::bf16, dev, s);
  x.dk = Tensor::empty(r.k.shape(), DType::bf16, dev, s);
  x.dv = Tensor::empty(r.v.shape(), DType::bf16, dev, s);
  x.f32_q = Tensor::empty(r.q.shape(), DType::f32, dev, s);
  x.f32_kv = Tensor::empty(r.k.shape(), DType::f32, dev, s);
  x.kv = Tensor::empty({2, r.k.size(0), r.k.size(1), r.k.size(2)}, DType::bf16, dev, s);
  x.ws = Tensor::empty({ops::attention_backward_workspace_elems(r.q)}, DType::f32, dev, s);
  return x;
}

void accumulate(const Tensor& part, const Tensor& acc, const Tensor& tmp, const Stream& s) {
  ops::cast(part, tmp, s);
  ops::add_(acc, tmp, s);
}

// The ring forward and backward of every rank, as ContextParallel runs them
// (without the exchanges), then the check against the full attention.
std::string ring_check(std::vector<RingRank>& ranks, RingScratch& x, const FullAttention& f, const Stream& s) {
  const int ring = int(ranks.size());
  for (int i = 0; i < ring; ++i) {
    RingRank& a = ranks[std::size_t(i)];
    for (int step = 0; step < ring; ++step) {
      const RingStep st = ring_step(a, i, step, ring);
      const RingRank& kv = ranks[std::size_t(st.kv_rank)];
      if (step == 0) {
        block_forward(a, kv, st, x.part, a.lse, s);
        ops::cast(x.part, x.acc, s);
      } else {
        block_forward(a, kv, st, x.part, x.part_lse, s);
        ops::merge_attention_partials(x.acc, a.lse, x.part, x.part_lse, x.acc, a.lse, s);
      }
    }
    ops::cast(x.acc, a.o, s);
  }
  for (int i = 0; i < ring; ++i) {
    RingRank& a = ranks[std::size_t(i)];
    for (int step = 0; step < ring; ++step) {
      const RingStep st = ring_step(a, i, step, ring);
      RingRank& kv = ranks[std::size_t(st.kv_rank)];
      block_backward(a, kv, st, x.dq, x.dk, x.dv, x.ws, s);
      accumulate(x.dq, a.dq, x.f32_q, s);
      accumulate(x.dk, kv.dk, x.f32_kv, s);
      accumulate(x.dv, kv.dv, x.f32_kv, s);
    }
  }
  RelError eo, el, edq, edk, edv;
  for (const RingRank& a : ranks) {
    std::vector<int32_t> local, global;
    for (std::size_t t = 0; t < a.plan.rows.size(); ++t)
      if (a.plan.rows[t] >= 0 && std::size_t(a.plan.rows[t]) % kCheckStride == 0) {
        local.push_back(int32_t(t));
        global.push_back(int32_t(a.plan.rows[t]));
      }
    if (local.empty()) continue;
    eo.add(host_rows(a.o, local, s), host_rows(f.o, global, s));
    el.add(host_rows(a.lse, local, s), host_rows(f.lse, global, s));
    edq.add(host_rows(a.dq, local, s), host_rows(f.dq, global, s));
    edk.add(host_rows(a.dk, local, s), host_rows(f.dk, global, s));
    edv.add(host_rows(a.dv, local, s), host_rows(f.dv, global, s));
  }
  if (!(eo.value() <= 1e-2) || !(el.value() <= 1e-3) || !(edq.value() <= 2e-2) || !(edk.value() <= 2e-2) ||
      !(edv.value() <= 2e-2))
    return detail::concat("correctness check failed: the ring against the full attention, relative errors o ",
                          eo.value(), " (limit 1e-2), lse ", el.value(), " (1e-3), dq ", edq.value(), ", dk ",
                          edk.value(), ", dv ", edv.value(), " (2e-2)");
  return "";
}

// The ring's elementwise work per rank (see the file comment), milliseconds.
struct RingOverhead {
  double fwd = 0, bwd = 0;
};

RingOverhead ring_overhead(const RingRank& r, RingScratch& x, int ring, const Stream& s) {
  const auto t = [&](const std::function<void()>& fn) { return median_ms(s, kRingWarmup, kRingReps, fn); };
  const Tensor k_slot = x.kv.view(0, r.k.shape());
  const Tensor lse_out = Tensor::empty(r.lse.shape(), DType::f32, s.device(), s);
  const Tensor acc_kv_buf = Tensor::zeros(r.k.shape(), DType::f32, s.device(), s);
  const double pack = 2 * t([&] { ops::cast(r.k, k_slot, s); });
  const double to_f32 = t([&] { ops::cast(x.part, x.acc, s); });
  const double merge = t([&] { ops::merge_attention_partials(x.acc, r.lse, x.part, x.part_lse, x.acc, lse_out, s); });
  const double to_bf16 = t([&] { ops::cast(x.acc, x.part, s); });
  const double acc_q = t([&] { accumulate(x.dq, x.acc, x.f32_q, s); });
  const double acc_kv = t([&] { accumulate(x.dk, acc_kv_buf, x.f32_kv, s); });
  const double kv_to_bf16 = t([&] { ops::cast(acc_kv_buf, x.dk, s); });
  RingOverhead o;
  o.fwd = pack + to_f32 + (ring - 1) * merge + to_bf16;
  o.bwd = pack + ring * (acc_q + 2 * acc_kv) + to_bf16 + 2 * kv_to_bf16;
  return o;
}

void run_ring(benchmark::State& state, const RingBatch& batch, int64_t heads_kv, int ring, int64_t min_chunk) {
  if (bench::skip_without_cuda(state)) return;
  bench::run_or_skip(state, [&] {
    const Stream& s = bench_stream();
    for (auto _ : state) {
      FullAttention& f = full_attention(batch, heads_kv, s);
      std::vector<RingRank> ranks = make_ring(f, ring, min_chunk, s);
      RingScratch x = make_scratch(ranks[0], s);
      if (bench::skip_if_error(state, ring_check(ranks, x, f, s))) return;

      // fwd[i][step], fwd_bwd[i][step]: one block's median ms.
      std::vector<std::vector<double>> fwd(static_cast<std::size_t>(ring)), fwd_bwd(static_cast<std::size_t>(ring));
      const bool breakdown = std::getenv("SLIME_BENCH_CP_BREAKDOWN") != nullptr;
      for (int i = 0; i < ring; ++i) {
        const RingRank& a = ranks[std::size_t(i)];
        for (int step = 0; step < ring; ++step) {
          const RingStep st = ring_step(a, i, step, ring);
          const RingRank& kv = ranks[std::size_t(st.kv_rank)];
          const auto forward = [&] { block_forward(a, kv, st, x.part, x.part_lse, s); };
          fwd[std::size_t(i)].push_back(median_ms(s, kRingWarmup, kRingReps, forward));
          fwd_bwd[std::size_t(i)].push_back(median_ms(s, kRingWarmup, kRingReps, [&] {
            forward();
            block_backward(a, kv, st, x.dq, x.dk, x.dv, x.ws, s);
          }));
          if (breakdown)
            std::printf("%s/hkv%lld/r%d rank %d step %d kv %d %-6s fwd %.4f ms fwd+bwd %.4f ms\n", batch.name.c_str(),
                        static_cast<long long>(heads_kv), ring, i, step, st.kv_rank, st.kind,
                        fwd[std::size_t(i)].back(), fwd_bwd[std::size_t(i)].back());
        }
      }
      const RingOverhead over = ring_overhead(ranks[0], x, ring, s);

      const double flop_fwd = 4.0 * kRingHeadDim * kRingHeadsQ * causal_pairs(f.cu);
      const auto report = [&](const std::string& what, const std::vector<std::vector<double>>& ms, double full_ms,
                              double overhead_per_rank) {
        double total = 0, rank_min = 1e300, rank_max = 0, lockstep = 0;
        for (int i = 0; i < ring; ++i) {
          double sum = 0;
          for (double t : ms[std::size_t(i)]) sum += t;
          total += sum;
          rank_min = std::min(rank_min, sum);
          rank_max = std::max(rank_max, sum);
        }
        for (int step = 0; step < ring; ++step) {
          double slowest = 0;
          for (int i = 0; i < ring; ++i) slowest = std::max(slowest, ms[std::size_t(i)][std::size_t(step)]);
          lockstep += slowest;
        }
        state.counters["full_" + what + "_ms"] = full_ms;
        state.counters["blocks_" + what + "_ms"] = total;
        state.counters["efficiency_" + what] = full_ms / total;
        state.counters["rank_" + what + "_min_ms"] = rank_min;
        state.counters["rank_" + what + "_max_ms"] = rank_max;
        state.counters["efficiency_" + what + "_rank_max"] = full_ms / (ring * rank_max);
        state.counters["efficiency_" + what + "_step_max"] = full_ms / (ring * lockstep);
        state.counters["overhead_" + what + "_ms"] = ring * overhead_per_rank;
        state.counters["efficiency_" + what + "_with_overhead"] = full_ms / (total + ring * overhead_per_rank);
        return total;
      };
      report("fwd", fwd, f.fwd_ms, over.fwd);
      const double blocks_fwd_bwd = report("fwd_bwd", fwd_bwd, f.fwd_bwd_ms, over.fwd + over.bwd);
      state.counters["full_fwd_tflops"] = bench::per_second(flop_fwd, f.fwd_ms * 1e-3, 1e12);
      state.counters["full_fwd_bwd_tflops"] = bench::per_second(3.5 * flop_fwd, f.fwd_bwd_ms * 1e-3, 1e12);
      state.counters["tokens"] = double(f.cu.back());
      state.counters["padded_tokens"] = double(ring * ranks[0].plan.local_tokens());
      state.counters["ring"] = ring;
      state.counters["heads_q"] = double(kRingHeadsQ);
      state.counters["heads_kv"] = double(heads_kv);
      state.counters["head_dim"] = double(kRingHeadDim);
      state.SetIterationTime(blocks_fwd_bwd * 1e-3);
    }
  });
}

// ---- 2. Ulysses: all-to-all bytes against attention FLOPs -------------------

constexpr int kUlyssesWarmup = 1, kUlyssesReps = 3;
constexpr int64_t kUlyssesSeqLens[] = {16384, 32768, 65536};
constexpr int kUlyssesDegrees[] = {2, 4, 8};
constexpr double kLinkGBps = 450;  // see the file comment

struct AttnShape {
  std::string name;
  int64_t heads_q, heads_kv, head_dim;
};

std::vector<AttnShape> ulysses_shapes() {
  const nn::Qwen3Config moe = bench::moe_config();
  return {{"moe", moe.num_attention_heads, moe.num_key_value_heads, moe.head_dim}, {"a3b", 32, 4, 128}};
}

constexpr int64_t kUlyssesCheckRows = 8;

// o of query head 0 on the last kUlyssesCheckRows rows of a one-sequence
// causal attention against the CPU reference. "" or the error.
std::string attention_check(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Stream& s) {
  const int64_t S = q.size(0), hkv = k.size(1), d = q.size(2), r0 = S - kUlyssesCheckRows;
  std::vector<int32_t> last;
  for (int64_t t = r0; t < S; ++t) last.push_back(int32_t(t));
  const std::vector<float> q_rows = host_rows(q, last, s), o_rows = host_rows(o, last, s);
  const std::vector<float> k_all = host_floats(k, s), v_all = host_floats(v, s);
  const auto head0 = [&](const std::vector<float>& x, int64_t rows, int64_t heads) {
    std::vector<float> out;
    for (int64_t t = 0; t < rows; ++t)
      out.insert(out.end(), x.begin() + long(t * heads * d), x.begin() + long(t * heads * d + d));
    return out;
  };
  const std::vector<float> hq = head0(q_rows, kUlyssesCheckRows, q.size(1)), hk = head0(k_all, S, hkv),
                           hv = head0(v_all, S, hkv), got = head0(o_rows, kUlyssesCheckRows, q.size(1));
  ops::AttentionOptions opt;
  opt.causal_offset = int(r0);
  const int32_t cq[2] = {0, int32_t(kUlyssesCheckRows)}, ck[2] = {0, int32_t(S)};
  std::vector<float> want(got.size()), lse(static_cast<std::size_t>(kUlyssesCheckRows));
  ops::cpu::attention_forward(hq.data(), hk.data(), hv.data(), cq, ck, 1, 1, 1, d, opt, want.data(), lse.data());
  RelError e;
  e.add(got, want);
  if (!(e.value() <= 1e-2))
    return detail::concat("correctness check failed: o of head 0, last ", kUlyssesCheckRows, " rows, relative error ",
                          e.value(), " (limit 1e-2)");
  return "";
}

void run_ulysses(benchmark::State& state, const AttnShape& shape, int64_t seq, int u) {
  if (bench::skip_without_cuda(state)) return;
  bench::run_or_skip(state, [&] {
    const Stream& s = bench_stream();
    const Device dev = s.device();
    const double link = env_positive("SLIME_BENCH_CP_LINK_GBPS", kLinkGBps);
    for (auto _ : state) {
      g_full.reset();
      const int64_t d = shape.head_dim, kv_sent = std::max<int64_t>(shape.heads_kv, u);
      const int64_t hq = shape.heads_q / u, hkv = kv_sent / u;  // heads per rank after the all-to-all
      const std::vector<int32_t> cu{0, int32_t(seq)};
      const Tensor cu_dev = Tensor::from_vector(cu, {2}, dev, s);
      Tensor q = Tensor::empty({seq, hq, d}, DType::bf16, dev, s),
             k = Tensor::empty({seq, hkv, d}, DType::bf16, dev, s),
             v = Tensor::empty({seq, hkv, d}, DType::bf16, dev, s), d_o = Tensor::empty(q.shape(), DType::bf16, dev, s);
      uint64_t seed = 11;
      for (Tensor* t : {&q, &k, &v, &d_o}) fill_uniform(*t, seed++, 0, -1.f, 1.f, s);
      const Tensor o = Tensor::empty(q.shape(), DType::bf16, dev, s),
                   lse = Tensor::empty({seq, hq}, DType::f32, dev, s);
      const Tensor dq = Tensor::empty(q.shape(), DType::bf16, dev, s),
                   dk = Tensor::empty(k.shape(), DType::bf16, dev, s),
                   dv = Tensor::empty(v.shape(), DType::bf16, dev, s);
      const Tensor ws = Tensor::empty({ops::attention_backward_workspace_elems(q)}, DType::f32, dev, s);
      const double fwd_ms = median_ms(s, kUlyssesWarmup, kUlyssesReps, [&] {
        ops::attention_forward(q, k, v, cu_dev, cu_dev, seq, seq, o, lse, {}, s);
      });
      if (bench::skip_if_error(state, attention_check(q, k, v, o, s))) return;
      const double bwd_ms = median_ms(s, kUlyssesWarmup, kUlyssesReps, [&] {
        ops::attention_backward(q, k, v, o, lse, d_o, cu_dev, cu_dev, seq, seq, dq, dk, dv, {}, ws, s);
      });
      // Per rank and layer, bf16: (u-1)/u of [S/u, H, d] for q and o (k and
      // v) in forward, dO and dq (dk and dv) in backward.
      const double sent = double(u - 1) / u * double(seq) / u * double(d) * 2;
      const double bytes = 2 * sent * double(shape.heads_q) + 2 * sent * double(kv_sent);
      const double flop_fwd = 4.0 * double(d) * double(hq) * double(seq) * double(seq + 1) / 2,
                   flop_bwd = 2.5 * flop_fwd;
      const double a2a_ms = bytes / (link * 1e9) * 1e3;
      state.counters["seq_len"] = double(seq);
      state.counters["ulysses"] = u;
      state.counters["heads_q_per_rank"] = double(hq);
      state.counters["heads_kv_per_rank"] = double(hkv);
      state.counters["kv_replicated"] = kv_sent > shape.heads_kv ? 1 : 0;
      state.counters["a2a_fwd_MB"] = bytes / 1e6;
      state.counters["a2a_bwd_MB"] = bytes / 1e6;
      state.counters["attn_fwd_GFLOP"] = flop_fwd / 1e9;
      state.counters["attn_bwd_GFLOP"] = flop_bwd / 1e9;
      state.counters["flop_per_byte_fwd"] = flop_fwd / bytes;
      state.counters["flop_per_byte_bwd"] = flop_bwd / bytes;
      state.counters["attn_fwd_ms"] = fwd_ms;
      state.counters["attn_bwd_ms"] = bwd_ms;
      state.counters["attn_fwd_tflops"] = bench::per_second(flop_fwd, fwd_ms * 1e-3, 1e12);
      state.counters["attn_bwd_tflops"] = bench::per_second(flop_bwd, bwd_ms * 1e-3, 1e12);
      state.counters["a2a_fwd_ms"] = a2a_ms;
      state.counters["a2a_bwd_ms"] = a2a_ms;
      state.counters["comm_over_attn_fwd"] = a2a_ms / fwd_ms;
      state.counters["comm_over_attn_bwd"] = a2a_ms / bwd_ms;
      state.counters["link_GBps"] = link;
      state.SetIterationTime(fwd_ms * 1e-3);
    }
  });
}

// ---- 3. the longest trainable sequence at cp = 1 ------------------------------

constexpr int64_t kSearchStart = 4096, kSearchStep = 1024, kSearchMaxTokens = int64_t(1) << 22;
constexpr double kSearchBudgetS = 60;  // seconds of tries; SLIME_BENCH_CP_SEARCH_S overrides
constexpr double kLr = 1e-5;

// One try of the search: a training step on one sequence of `tokens`.
struct SeqTry {
  int64_t tokens = 0;
  bool fits = false;
  double seconds = 0;       // the try, host wall time (setup, step, synchronisation, release)
  double step_ms = 0;       // the step (CUDA events), when it fits
  double loss = 0;          // its mean negative log-likelihood, when it fits
  int64_t state_bytes = 0;  // allocated before the step
  int64_t peak_bytes = 0;   // memory_stats().peak_bytes during the try
  int64_t reserved_bytes = 0, free_bytes = 0;
  std::string error;  // the out-of-memory error, when it does not fit
  int64_t extra_bytes() const { return peak_bytes - state_bytes; }
};

struct SeqSearch {
  std::vector<SeqTry> tries;
  int64_t longest = 0, first_oom = 0;  // 0: none
  double slope = 0;                    // the memory line's bytes per token (0: unknown)
  double predicted = 0;                // its length at the free memory
  double target = 0;                   // its length at kLineFreeFraction of the free memory: where probes aim
  bool time_capped = false;
  double seconds = 0;
};

// Probes aim a little below the line's length at the free memory: what slime
// does not count (the pool's granularity, fragmentation) takes some of it.
constexpr double kLineFreeFraction = 0.98;

// The memory line through the two longest fitting tries (through the origin
// with one) and its lengths at the free memory of the last try.
void fit_memory_line(SeqSearch& out) {
  const SeqTry *a = nullptr, *b = nullptr;  // b the longest, a the next
  for (const SeqTry& t : out.tries) {
    if (!t.fits) continue;
    if (b == nullptr || t.tokens > b->tokens) {
      a = b;
      b = &t;
    } else if (a == nullptr || t.tokens > a->tokens) {
      a = &t;
    }
  }
  out.slope = out.predicted = out.target = 0;
  if (b == nullptr) return;
  const double slope = a ? double(b->extra_bytes() - a->extra_bytes()) / double(b->tokens - a->tokens)
                         : double(b->extra_bytes()) / double(b->tokens);
  if (!(slope > 0)) return;
  const double free_b = double(out.tries.back().free_bytes);
  out.slope = slope;
  out.predicted = double(b->tokens) + (free_b - double(b->extra_bytes())) / slope;
  out.target = double(b->tokens) + (kLineFreeFraction * free_b - double(b->extra_bytes())) / slope;
}

// The search of the file comment; attempt(tokens) runs one try. A try is
// run only when its predicted time (the longest fitting try's x (length
// ratio)^2) keeps the tries within budget_s; when the next is not, one last
// try at the longest affordable length (below the line's target, beyond the
// longest that fit) tightens the lower bound, and the search stops.
template <class Attempt>
SeqSearch search_longest(double budget_s, Attempt&& attempt) {
  SeqSearch out;
  double longest_s = 0;  // the longest fitting try's seconds
  const auto run = [&](int64_t n) {
    out.tries.push_back(attempt(n));
    const SeqTry& t = out.tries.back();
    out.seconds += t.seconds;
    if (t.fits && n > out.longest) {
      out.longest = n;
      longest_s = t.seconds;
    }
    if (!t.fits && (out.first_oom == 0 || n < out.first_oom)) out.first_oom = n;
    fit_memory_line(out);
    return t.fits;
  };
  // Bisection probes: the line's target while it is inside the bracket and
  // its probes fit, else its prediction once, else the midpoint; after a
  // line probe that did not fit, or one at the prediction, the midpoint.
  bool guided = true;
  for (;;) {
    // The next probe: doubling until a try fails, then bisection (0: done).
    int64_t n = 0;
    bool at_target = false, on_line = false;
    const int64_t lo = out.longest, hi = out.first_oom;
    const auto inside = [&](double x) { return double(lo) < x && x < double(hi); };
    if (hi == 0) {
      n = lo == 0 ? kSearchStart : lo < kSearchMaxTokens ? 2 * lo : 0;
    } else if (lo > 0 && hi - lo > kSearchStep) {
      n = lo + std::max(kSearchStep, (hi - lo) / 2 / kSearchStep * kSearchStep);
      at_target = guided && inside(out.target);
      on_line = at_target || (guided && inside(out.predicted));
      if (on_line)
        n = std::clamp(int64_t(at_target ? out.target : out.predicted) / kSearchStep * kSearchStep, lo + kSearchStep,
                       hi - kSearchStep);
    }
    if (n == 0) break;
    const double ratio = lo > 0 ? double(n) / double(lo) : 0;
    if (out.seconds + longest_s * ratio * ratio > budget_s) {
      out.time_capped = true;
      const double room = longest_s > 0 ? (budget_s - out.seconds) / longest_s : 0;
      double last = room > 0 ? double(lo) * std::sqrt(room) : 0;
      if (out.target > 0) last = std::min(last, out.target);
      const int64_t m = int64_t(last) / kSearchStep * kSearchStep;
      if (lo > 0 && m >= lo + kSearchStep && (hi == 0 || m < hi)) run(m);
      break;
    }
    const bool fits = run(n);
    guided = !on_line || (at_target && fits);
  }
  return out;
}

bool is_out_of_memory(const std::string& what) {
  for (const char* m : {"out of memory", "ALLOC_FAILED", "cudaErrorMemoryAllocation"})
    if (what.find(m) != std::string::npos) return true;
  return false;
}

// The device's free memory (cudaMemGetInfo); 0 for the CPU.
int64_t free_device_bytes([[maybe_unused]] Device dev) {
  std::size_t free_b = 0, total_b = 0;
#if SLIME_HAS_CUDA
  if (dev.is_cuda()) {
    DeviceGuard guard(dev);
    SLIME_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  }
#endif
  return int64_t(free_b);
}

using ShardedQwen3 = parallel::Sharded<nn::Qwen3Model, parallel::FullShard>;

// One training step on a single sequence of n tokens (x(j) = j * 2654435761
// mod vocab; targets the next token); out-of-memory errors are the try's
// outcome, other errors propagate.
SeqTry train_try(ShardedQwen3& sh, int64_t n, const Stream& s) {
  const Device dev = sh.device();
  const auto t0 = std::chrono::steady_clock::now();
  SeqTry t;
  t.tokens = n;
  release_cached_memory(dev);
  t.free_bytes = free_device_bytes(dev);
  reset_peak_memory_stats(dev);
  t.state_bytes = memory_stats(dev).current_bytes;
  try {
    const uint64_t vocab = uint64_t(sh.module().config().vocab_size);
    std::vector<int32_t> x(std::size_t(n) + 1);
    for (std::size_t j = 0; j < x.size(); ++j) x[j] = int32_t(uint64_t(j) * 2654435761ull % vocab);
    const Tensor targets = Tensor::from_vector(std::vector<int32_t>(x.begin() + 1, x.end()), {n}, dev, s);
    x.pop_back();
    const nn::PackedBatch batch = nn::make_packed_batch({x}, dev, s);
    const Tensor grad_lp =
        Tensor::from_vector(std::vector<float>(std::size_t(n), float(-1.0 / double(n))), {n}, dev, s);
    Event start(dev), stop(dev);
    const auto host_start = std::chrono::steady_clock::now();
    start.record(s);
    sh.zero_grad(s);
    ShardedQwen3::Context ctx;
    const Tensor hidden = sh.forward(batch, ctx, s);
    const ops::TokenLogprobs lp = sh.token_logprobs(hidden, targets, 1.f, s);
    const Tensor d_hidden = sh.token_logprobs_backward(hidden, targets, 1.f, lp, grad_lp, Tensor{}, s);
    sh.backward(ctx, d_hidden, s);
    sh.optimizer_step(kLr, 0, s);
    stop.record(s);
    stop.synchronize();
    // (A CPU model, as in a test of this file: host time.)
    t.step_ms = dev.is_cuda()
                    ? double(Event::elapsed_ms(start, stop))
                    : std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - host_start).count();
    double sum = 0;
    for (float v : lp.logprobs.to_vector<float>(s)) sum += double(v);
    t.loss = -sum / double(n);
    t.fits = true;
  } catch (const Error& e) {
    if (!is_out_of_memory(e.what())) throw;
    t.error = e.what();
  }
  s.synchronize();
  const MemoryStats m = memory_stats(dev);
  t.peak_bytes = m.peak_bytes;
  t.reserved_bytes = m.reserved_bytes;
  nn::release_workspaces(sh.module());
  release_cached_memory(dev);
  t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return t;
}

void run_longest(benchmark::State& state) {
  if (bench::skip_without_cuda(state)) return;
  bench::run_or_skip(state, [&] {
    const nn::Qwen3Config cfg = bench::moe_config();
    const double budget = env_positive("SLIME_BENCH_CP_SEARCH_S", kSearchBudgetS);
    for (auto _ : state) {
      g_full.reset();  // the ring rows' tensors
      SeqSearch r;
      comm::run_nccl_ranks(1, [&](comm::NcclComm& comm) {
        const Device dev = comm.device();
        nn::Qwen3Model model(cfg, {dev, DType::bf16});
        model.init_random(1, 0.02f, Stream::default_for(dev));
        optim::AdamWConfig adamw;
        adamw.lr = kLr;
        ShardedQwen3 sh(std::move(model), comm, parallel::ShardedOptions{}, adamw);
        const Stream s = Stream::create(dev);
        Stream::default_for(dev).synchronize();
        r = search_longest(budget, [&](int64_t n) { return train_try(sh, n, s); });
      });
      const double ln_v = std::log(double(cfg.vocab_size));
      std::printf("cp/longest_seq/moe/cp1 tries (budget %.0f s):\n", budget);
      for (const SeqTry& t : r.tries)
        std::printf("  %8lld tokens  %-4s %7.2f s  peak %7.2f GiB  step %9.1f ms  loss %.4f%s%s\n",
                    static_cast<long long>(t.tokens), t.fits ? "fits" : "OOM", t.seconds, double(t.peak_bytes) / kGiB,
                    t.step_ms, t.loss, t.fits ? "" : "  ", t.error.substr(0, 120).c_str());
      std::fflush(stdout);
      const SeqTry* best = nullptr;
      for (const SeqTry& t : r.tries) {
        if (t.fits && !(std::isfinite(t.loss) && std::abs(t.loss - ln_v) < 1.0)) {
          state.SkipWithError(detail::concat("correctness check failed: the step of ", t.tokens, " tokens has loss ",
                                             t.loss, ", expected about ln(vocab) = ", ln_v)
                                  .c_str());
          return;
        }
        if (t.fits && t.tokens == r.longest) best = &t;
      }
      if (best == nullptr) {
        state.SkipWithError(detail::concat("no length fits, the first try (", kSearchStart, " tokens) failed: ",
                                           r.tries.empty() ? std::string("not run") : r.tries.front().error)
                                .c_str());
        return;
      }
      state.counters["max_tokens"] = double(r.longest);
      state.counters["first_oom_tokens"] = double(r.first_oom);
      state.counters["bracket_tokens"] = r.first_oom > 0 ? double(r.first_oom - r.longest) : 0;
      state.counters["peak_gib"] = double(best->peak_bytes) / kGiB;
      state.counters["state_gib"] = double(best->state_bytes) / kGiB;
      state.counters["reserved_gib"] = double(best->reserved_bytes) / kGiB;
      state.counters["free_gib"] = double(best->free_bytes) / kGiB;
      state.counters["step_ms"] = best->step_ms;
      state.counters["mib_per_1k_tokens"] = r.slope * 1024 / double(1 << 20);
      state.counters["predicted_max_tokens"] = r.predicted;
      state.counters["tries"] = double(r.tries.size());
      state.counters["search_s"] = r.seconds;
      state.counters["time_capped"] = r.time_capped ? 1 : 0;
      state.SetIterationTime(best->step_ms * 1e-3);
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  // Never NVLink multicast (shared hosts); an explicit setting is left alone.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  // zigzag: every sequence split (min_chunk_tokens 0, the default);
  // whole256: sequences whose 2r chunks would be shorter than 256 tokens stay
  // whole on one ring rank.
  for (int batch_kind = 0; batch_kind < 3; ++batch_kind)
    for (int64_t hkv : {int64_t(16), int64_t(4)})
      for (int ring : {2, 4, 8})
        for (const int64_t min_chunk : {int64_t(0), int64_t(256)}) {
          const RingBatch batch = batch_kind == 0   ? one_sequence_batch()
                                  : batch_kind == 1 ? varlen_batch()
                                                    : rfa_batch(ring);
          bench::register_manual(
              "cp/ring/" + batch.name + "/hkv" + std::to_string(hkv) + "/r" + std::to_string(ring) +
                  (min_chunk == 0 ? "/zigzag" : "/whole256"),
              [batch, hkv, ring, min_chunk](benchmark::State& st) { run_ring(st, batch, hkv, ring, min_chunk); },
              benchmark::kMillisecond, /*iterations=*/1, /*repetitions=*/1);
        }
  for (const AttnShape& shape : ulysses_shapes())
    for (int64_t seq : kUlyssesSeqLens)
      for (int u : kUlyssesDegrees)
        bench::register_manual(
            "cp/ulysses/" + shape.name + "/s" + std::to_string(seq) + "/u" + std::to_string(u),
            [shape, seq, u](benchmark::State& st) { run_ulysses(st, shape, seq, u); }, benchmark::kMillisecond,
            /*iterations=*/1, /*repetitions=*/1);
  bench::register_manual("cp/longest_seq/moe/cp1", run_longest, benchmark::kMillisecond, /*iterations=*/1,
                         /*repetitions=*/1);
  const int rc = bench::run_benchmarks(argc, argv, [] {
    std::string lengths;
    for (int32_t n : kVarlenLengths) {
      if (!lengths.empty()) lengths += ',';
      lengths += std::to_string(n);
    }
    benchmark::AddCustomContext("ring_varlen16_lengths", lengths);
    std::string rfa;
    for (int32_t n : kRfaLengthsPerGpu) {
      if (!rfa.empty()) rfa += ',';
      rfa += std::to_string(n);
    }
    benchmark::AddCustomContext("ring_varlen_rfa_lengths", rfa + " (x r)");
    benchmark::AddCustomContext("ring_shape", "Hq 16, Hkv 16 or 4, head_dim 128, bf16, causal");
    benchmark::AddCustomContext("ulysses_shapes",
                                "moe: bench_models.hpp moe_config() 16/4 heads, head_dim 64, hidden 1024; a3b: "
                                "Qwen3-30B-A3B 32/4 heads, head_dim 128, hidden 2048");
    benchmark::AddCustomContext(
        "link_GBps", std::to_string(env_positive("SLIME_BENCH_CP_LINK_GBPS", kLinkGBps)) +
                         " (default 450: NVLink 4 on H200 SXM, 900 GB/s bidirectional per NVIDIA's datasheet; "
                         "SLIME_BENCH_CP_LINK_GBPS)");
    benchmark::AddCustomContext("longest_seq_budget_s",
                                std::to_string(env_positive("SLIME_BENCH_CP_SEARCH_S", kSearchBudgetS)));
  });
  g_full.reset();
  return rc;
}
