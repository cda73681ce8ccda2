// bench/bench_moe.cpp: the MoE layer end to end. nn::SparseMoeBlock forward +
// backward on one GPU (the local path: layout, permute, grouped GEMMs, SwiGLU,
// unpermute), and ExpertParallel<> dispatch + combine over NCCL on two GPUs.
// The PyTorch baseline of the block rows is bench/torch_moe.py (transformers'
// Qwen3MoeSparseMoeBlock); names match, so bench/compare_ops.py prints them
// side by side. The EP row has no baseline (compare_ops prints it alone).
//
// moe/block/<shape>/fwd_bwd: y = block.forward(x), dx = block.backward(dy), bf16
//   on cuda:0, x and dy ~ N(0, 1), every weight (router gate included) ~ N(0,
//   0.02) as on the torch side, so the routing is spread the same way (router
//   logits with std 0.02·sqrt(H)). Parameter gradients accumulate in fp32.
//     bench: the project's Qwen3-MoE benchmark config, H 1024, E 32, top-4,
//            moe_intermediate I 384, norm_topk_prob, T = 16384 tokens
//     a3b:   Qwen3-30B-A3B's MoE layer, H 2048, E 128, top-8, I 768, T = 8192
//   The two numbers (R = T·k rows; fwd + dgrad + wgrad of every GEMM):
//     FLOP  = 3 · (2·T·H·E + 3 · 2·R·H·I)   router gate + gate/up/down experts
//             bench: 4.7e11, a3b: 1.87e12
//     bytes = not the limit (the expert GEMMs dominate); not reported.
//   Counters: tokens_per_s = T / time, TFLOPs, max_load (the most loaded
//   expert's rows / the mean, from the first forward: how uneven the routing
//   is; the torch rows report the same).
//   Check (first run): on 4 sampled tokens, the chosen experts are the top-k
//   router logits, the k weights sum to 1, and y equals a double-precision
//   host sum over the chosen experts (bf16 weights copied back; relative error
//   ‖got − want‖ / ‖want‖ ≤ 2e-2: bf16 intermediates gate, up, h and y rows
//   are rounded once each, about 2^-8 relative); dx is finite and non-zero.
//
// moe/ep2/dispatch_combine/<shape>: ExpertParallel<> with EP = 2 over NcclComm
//   (run_nccl_ranks(2, ...): ranks as threads, rank r on cuda:r). Each rank
//   routes T = 16384 tokens of H = 2048 bf16 to k = 8 of E = 128 experts
//   (uniform random, distinct per token), then times rows = dispatch(x) and
//   y = combine(rows, weights) (forward only; the experts are the identity).
//   dispatch includes its host synchronisation (the all_gather of the counts
//   and the device→host copy that the all_to_all_v sizes need).
//     bytes per rank = 2 (dispatch, combine) · (rows sent + rows received) · H
//                      · 2 bytes, the rank's own rows included (as nccl-tests
//                      counts all_to_all); about 2 · 2 · 131072 · 2048 · 2 =
//                      2.1 GB per rank. remote_bytes: the rows that cross to
//                      the other GPU only (about half).
//     GBps = bytes / time of the slowest rank (algorithmic bandwidth).
//   Check (first run): the weights are all 1/8, so y = Σ_j x / 8 = x; each
//   rank compares y with x (|y − x| ≤ 2^-8 |x|, one bf16 rounding).
//   Reference: bench_collectives measured NCCL's all_to_all on these 2 H200s
//   at busbw 329 GB/s for 1 GiB per rank (README, tools/gpu-test.sh of
//   2026-11-30), i.e. algbw = busbw · n / (n − 1) = 658 GB/s of one rank's
//   buffer, or 1316 GB/s in this row's units (sent + received). Dispatch +
//   combine adds the permute, regroup and unpermute copies and one host
//   synchronisation per dispatch, so expect well below that.
//
// Timing: CUDA events (UseManualTime), fixed iterations and repetitions; read
// the median over repetitions. Block: kWarmup untimed calls, then per
// iteration kBatch calls between two events (bench::time_batches). EP: one
// run_nccl_ranks per repetition; each rank runs kWarmup untimed calls, then
// per iteration a barrier, an event, kEpBatch calls, an event; an iteration's
// time is the slowest rank's / kEpBatch.
//
// NVLink multicast stays off: main() sets NCCL_NVLS_ENABLE=0 unless the
// environment already says otherwise (tools/gpu-test.sh exports it too).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "slime/comm/nccl_comm.hpp"
#include "slime/core/half.hpp"
#include "slime/core/random.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/moe.hpp"
#include "slime/parallel/expert_parallel.hpp"

namespace {

using slime::BFloat16;
using slime::Device;
using slime::DType;
using slime::Event;
using slime::Stream;
using slime::Tensor;
using slime::detail::concat;

constexpr int kWarmup = 3;       // untimed calls per run
constexpr int kBatch = 3;        // calls per timed iteration (block)
constexpr int kEpBatch = 2;      // calls per timed iteration (EP)
constexpr int kIterations = 5;   // timed iterations per run
constexpr int kRepetitions = 3;  // runs; the median is reported
constexpr int kCheckTokens = 4;  // tokens checked against the host sum
constexpr float kWeightStd = 0.02f;

// ---- moe/block ------------------------------------------------------------------

struct BlockShape {
  const char* name;
  int64_t tokens, hidden, experts, topk, inter;
};

constexpr BlockShape kBlockShapes[] = {
    {"bench", 16384, 1024, 32, 4, 384},
    {"a3b", 8192, 2048, 128, 8, 768},
};

double block_flop(const BlockShape& s) {
  const double T = double(s.tokens), H = double(s.hidden), E = double(s.experts), I = double(s.inter);
  const double R = T * double(s.topk);
  return 3.0 * (2.0 * T * H * E + 3.0 * 2.0 * R * H * I);
}

// The block and its inputs for one shape, kept for the shape's runs.
struct BlockProblem {
  BlockShape shape{};
  Stream stream;
  slime::nn::SparseMoeBlock block;
  slime::nn::SparseMoeBlock::Context ctx;
  Tensor x, dy;
  double max_load = 0;  // from the check's forward
};

std::unique_ptr<BlockProblem> g_block;

BlockProblem& block_problem(const BlockShape& s) {
  if (g_block && std::string(g_block->shape.name) == s.name) return *g_block;
  g_block.reset();
  auto p = std::make_unique<BlockProblem>();
  const Device d = Device::cuda(0);
  p->shape = s;
  p->stream = Stream::create(d);
  const Stream& st = p->stream;
  const slime::nn::MoeBlockConfig cfg{s.hidden, s.inter, s.experts, s.topk, /*norm_topk_prob=*/true};
  p->block = slime::nn::SparseMoeBlock("model.layers.0.mlp", cfg, {d, DType::bf16});
  uint64_t seed = 10;
  p->block.for_each_parameter([&](slime::nn::Parameter& w) {
    slime::fill_normal(w.value, seed++, 0, 0.f, kWeightStd, st);
    w.zero_grad(st);
  });
  p->x = Tensor::empty({s.tokens, s.hidden}, DType::bf16, d, st);
  p->dy = Tensor::empty({s.tokens, s.hidden}, DType::bf16, d, st);
  slime::fill_normal(p->x, 1, 0, 0.f, 1.f, st);
  slime::fill_normal(p->dy, 2, 0, 0.f, 1.f, st);
  g_block = std::move(p);
  return *g_block;
}

void block_step(BlockProblem& p) {
  p.block.forward(p.x, p.ctx, p.stream);
  p.block.backward(p.ctx, p.dy, p.stream);
}

template <class T>
std::vector<double> host_rows(const Tensor& t, int64_t first, int64_t n, const Stream& s) {
  const std::vector<T> v = t.view(first, {n}).to_vector<T>(s);
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = double(float(v[i]));
  return out;
}

// One forward + backward on fresh gradients, then the checks described at the
// top of the file. "" or what is wrong; sets p.max_load.
std::string check_block(BlockProblem& p) {
  const BlockShape& s = p.shape;
  const Stream& st = p.stream;
  const int64_t T = s.tokens, H = s.hidden, E = s.experts, k = s.topk, I = s.inter;
  const Tensor y = p.block.forward(p.x, p.ctx, st);
  const Tensor dx = p.block.backward(p.ctx, p.dy, st);

  const std::vector<int32_t> idx = p.ctx.indices.to_vector<int32_t>(st);
  std::vector<int64_t> load(std::size_t(E), 0);
  for (int32_t e : idx) {
    if (e < 0 || e >= E) return concat("router index ", e, " is not in [0, ", E, ")");
    ++load[std::size_t(e)];
  }
  p.max_load = double(*std::max_element(load.begin(), load.end())) / (double(T * k) / double(E));

  for (int c = 0; c < kCheckTokens; ++c) {
    const int64_t t = int64_t(slime::philox_word(99, uint64_t(c)) % uint64_t(T));
    const std::vector<double> xr = host_rows<BFloat16>(p.x, t * H, H, st);
    const std::vector<double> logits = host_rows<BFloat16>(p.ctx.router_logits, t * E, E, st);
    const std::vector<double> w = host_rows<BFloat16>(p.ctx.weights, t * k, k, st);
    std::vector<bool> chosen(std::size_t(E), false);
    double wsum = 0, min_chosen = INFINITY, max_other = -INFINITY;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = idx[std::size_t(t * k + j)];
      if (chosen[std::size_t(e)]) return concat("token ", t, " routes twice to expert ", e);
      chosen[std::size_t(e)] = true;
      wsum += w[std::size_t(j)];
      min_chosen = std::min(min_chosen, logits[std::size_t(e)]);
    }
    for (int64_t e = 0; e < E; ++e)
      if (!chosen[std::size_t(e)]) max_other = std::max(max_other, logits[std::size_t(e)]);
    if (min_chosen < max_other)
      return concat("token ", t, ": a chosen expert's logit ", min_chosen, " is below an unchosen one's ", max_other);
    if (!(std::fabs(wsum - 1.0) <= 1e-2)) return concat("token ", t, ": router weights sum to ", wsum, ", not 1");

    std::vector<double> want(static_cast<std::size_t>(H), 0.0), act(static_cast<std::size_t>(I));
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = idx[std::size_t(t * k + j)];
      const std::vector<double> wg = host_rows<BFloat16>(p.block.gate_proj.value, e * I * H, I * H, st);
      const std::vector<double> wu = host_rows<BFloat16>(p.block.up_proj.value, e * I * H, I * H, st);
      const std::vector<double> wd = host_rows<BFloat16>(p.block.down_proj.value, e * H * I, H * I, st);
      for (int64_t i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (int64_t h = 0; h < H; ++h) {
          g += xr[std::size_t(h)] * wg[std::size_t(i * H + h)];
          u += xr[std::size_t(h)] * wu[std::size_t(i * H + h)];
        }
        act[std::size_t(i)] = g / (1.0 + std::exp(-g)) * u;  // silu(g) · u
      }
      for (int64_t h = 0; h < H; ++h) {
        double o = 0;
        for (int64_t i = 0; i < I; ++i) o += wd[std::size_t(h * I + i)] * act[std::size_t(i)];
        want[std::size_t(h)] += w[std::size_t(j)] * o;
      }
    }
    const std::vector<double> got = host_rows<BFloat16>(y, t * H, H, st);
    double err = 0, ref = 0;
    for (int64_t h = 0; h < H; ++h) {
      err += (got[std::size_t(h)] - want[std::size_t(h)]) * (got[std::size_t(h)] - want[std::size_t(h)]);
      ref += want[std::size_t(h)] * want[std::size_t(h)];
    }
    const double rel = std::sqrt(err / std::max(ref, 1e-30));
    if (!(rel <= 2e-2)) return concat("token ", t, ": y has relative error ", rel, " against the host sum (> 2e-2)");

    const std::vector<double> dxr = host_rows<BFloat16>(dx, t * H, H, st);
    double norm = 0;
    for (double v : dxr) {
      if (!std::isfinite(v)) return concat("token ", t, ": dx is not finite");
      norm += v * v;
    }
    if (!(norm > 0)) return concat("token ", t, ": dx is zero");
  }
  return "";
}

void run_block(benchmark::State& state, BlockShape s) {
  if (slime::bench::skip_without_cuda(state)) return;
  slime::bench::run_or_skip(state, [&] {
    BlockProblem& p = block_problem(s);
    static std::map<std::string, std::string> verdicts;
    if (!slime::bench::passed_check(state, verdicts, std::string(s.name), [&] { return check_block(p); })) return;
    const double t = slime::bench::time_batches(state, p.stream, kWarmup, kBatch, [&] { block_step(p); });
    state.counters["tokens_per_s"] = slime::bench::per_second(double(s.tokens), t, 1.0);
    state.counters["TFLOPs"] = slime::bench::per_second(block_flop(s), t, 1e12);
    state.counters["flop"] = block_flop(s);
    state.counters["tokens"] = double(s.tokens);
    state.counters["max_load"] = p.max_load;
  });
}

// ---- moe/ep2 ----------------------------------------------------------------------

constexpr int kEpRanks = 2;

struct EpShape {
  const char* name;
  int64_t tokens, hidden, experts, topk;
};

constexpr EpShape kEpShape{"a3b", 16384, 2048, 128, 8};

// k distinct experts of E per token, uniform (partial Fisher-Yates on philox).
std::vector<int32_t> uniform_routing(int64_t T, int64_t k, int64_t E, uint64_t seed) {
  std::vector<int32_t> idx(static_cast<std::size_t>(T * k)), perm(static_cast<std::size_t>(E));
  uint64_t n = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t pick = j + int64_t(slime::philox_word(seed, n++) % uint64_t(E - j));
      std::swap(perm[std::size_t(j)], perm[std::size_t(pick)]);
      idx[std::size_t(t * k + j)] = perm[std::size_t(j)];
    }
  }
  return idx;
}

struct EpRankResult {
  std::string error;       // the check's verdict on this rank ("" = passed)
  std::vector<double> ms;  // per timed iteration, per call
  double bytes = 0, remote_bytes = 0;
};

void ep_rank(slime::comm::NcclComm& comm, const EpShape& s, bool check, int64_t iterations, EpRankResult& out) {
  const Device dev = comm.device();
  const int me = comm.rank();
  const Stream st = Stream::create(dev);
  const int64_t T = s.tokens, H = s.hidden, k = s.topk;
  slime::parallel::ExpertParallel<> ep(comm, s.experts);
  Tensor x = Tensor::empty({T, H}, DType::bf16, dev, st);
  slime::fill_normal(x, 20 + uint64_t(me), 0, 0.f, 1.f, st);
  const Tensor indices = Tensor::from_vector(uniform_routing(T, k, s.experts, 30 + uint64_t(me)), {T, k}, dev, st);
  const Tensor weights =
      Tensor::from_vector(std::vector<BFloat16>(std::size_t(T * k), BFloat16(1.f / float(k))), {T, k}, dev, st);
  const Tensor y = Tensor::empty({T, H}, DType::bf16, dev, st);
  slime::parallel::DispatchHandle h;
  auto call = [&] {
    const Tensor rows = ep.dispatch(x, indices, h, st);
    ep.combine(rows, weights, h, st, y);
  };

  call();
  if (check) {  // local only: both ranks run the same collectives whatever they find
    const std::vector<BFloat16> hx = x.to_vector<BFloat16>(st), hy = y.to_vector<BFloat16>(st);
    for (std::size_t i = 0; i < hx.size() && out.error.empty(); ++i) {
      const double a = double(float(hx[i])), b = double(float(hy[i]));
      if (!(std::fabs(b - a) <= std::ldexp(std::fabs(a), -8)))
        out.error = concat("correctness check failed on rank ", me, ": combine(dispatch(x)) with weights 1/", k,
                           " gives ", b, " at element ", i, ", expected x = ", a);
    }
    int64_t local = 0;
    for (int64_t c : h.local_counts()) local += c;
    if (out.error.empty() && local != h.received_rows())
      out.error = concat("rank ", me, ": local expert counts sum to ", local, ", received rows ", h.received_rows());
  }
  int64_t sent = 0, recv = 0;
  for (int64_t r : h.send_rows()) sent += r;
  for (int64_t r : h.recv_rows()) recv += r;
  const int64_t remote = sent - h.send_rows()[std::size_t(me)] + recv - h.recv_rows()[std::size_t(me)];
  out.bytes = 2.0 * double(sent + recv) * double(H) * 2.0;
  out.remote_bytes = 2.0 * double(remote) * double(H) * 2.0;

  slime::bench::warm_up(st, kWarmup, call);
  Event start(dev), stop(dev);
  for (int64_t i = 0; i < iterations; ++i) {
    comm.barrier();  // both ranks start together: no time waiting for a late peer
    start.record(st);
    for (int b = 0; b < kEpBatch; ++b) call();
    stop.record(st);
    stop.synchronize();
    out.ms.push_back(double(Event::elapsed_ms(start, stop)) / kEpBatch);
  }
  comm.barrier();  // neither rank tears down while the other may still be in a collective
}

void run_ep(benchmark::State& state, EpShape s) {
  const int devices = slime::cuda_device_count();
  if (devices < kEpRanks) {
    state.SkipWithError(concat("needs 2 GPUs, this process sees ", devices).c_str());
    return;
  }
  slime::bench::run_or_skip(state, [&] {
    static std::map<std::string, std::string> verdicts;
    const std::string id = s.name;
    const bool check = verdicts.find(id) == verdicts.end();
    if (!check && slime::bench::skip_if_error(state, verdicts[id])) return;
    const int64_t iterations = int64_t(state.max_iterations);
    std::vector<EpRankResult> results(kEpRanks);
    slime::comm::run_nccl_ranks(kEpRanks, [&](slime::comm::NcclComm& comm) {
      ep_rank(comm, s, check, iterations, results[std::size_t(comm.rank())]);
    });
    if (check) {
      std::string verdict;
      for (const EpRankResult& r : results)
        if (verdict.empty()) verdict = r.error;
      verdicts[id] = verdict;
      if (slime::bench::skip_if_error(state, verdict)) return;
    }
    double bytes = 0, remote = 0, total_s = 0;
    for (const EpRankResult& r : results) {
      bytes += r.bytes / kEpRanks;
      remote += r.remote_bytes / kEpRanks;
    }
    int64_t i = 0;
    for (auto _ : state) {
      double ms = 0;
      for (const EpRankResult& r : results) ms = std::max(ms, r.ms.at(std::size_t(i)));
      state.SetIterationTime(ms * 1e-3);
      total_s += ms * 1e-3;
      ++i;
    }
    const double t = total_s / double(std::max<int64_t>(i, 1));
    state.counters["bytes"] = bytes;
    state.counters["remote_bytes"] = remote;
    state.counters["GBps"] = slime::bench::per_second(bytes, t, 1e9);
    state.counters["remote_GBps"] = slime::bench::per_second(remote, t, 1e9);
    state.counters["tokens_per_rank"] = double(s.tokens);
    state.counters["ranks"] = kEpRanks;
  });
}

}  // namespace

int main(int argc, char** argv) {
  // Never NVLink multicast (shared hosts); an explicit setting is left alone.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  for (const BlockShape& s : kBlockShapes)
    slime::bench::register_manual(
        std::string("moe/block/") + s.name + "/fwd_bwd", [s](benchmark::State& st) { run_block(st, s); },
        benchmark::kMicrosecond, kIterations, kRepetitions);
  slime::bench::register_manual(
      std::string("moe/ep2/dispatch_combine/") + kEpShape.name, [](benchmark::State& st) { run_ep(st, kEpShape); },
      benchmark::kMicrosecond, kIterations, kRepetitions);
  return slime::bench::run_benchmarks(argc, argv);
}
