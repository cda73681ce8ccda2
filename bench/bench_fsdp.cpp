// bench/bench_fsdp.cpp: the FSDP train step of a ~0.5B dense Qwen3 on 1 and 2
// H200s, Sharded<Qwen3Model, FullShard> over NcclComm, beside PyTorch FSDP2
// on transformers' Qwen3ForCausalLM (bench/torch_fsdp2.py, which also prints
// the side-by-side table with the 1 -> 2 GPU scaling).
//
// Model "dense0.5b" (Qwen3-0.6B's shape with 24 layers): hidden 1024, 24
// layers, 16 heads / 8 KV heads, head_dim 128, intermediate 3072, vocab
// 151936, tied embeddings, rope_theta 1e6: 533.1M parameters. Random init
// (std 0.02, norm weights 1), bf16 compute, fp32 master weights, fp32
// gradient reduction, AdamW (lr 1e-5, betas 0.9 / 0.999, eps 1e-8, weight
// decay 0.01, no grad clipping). No activation checkpointing (neither side).
//
// Data, weak scaling: every rank trains on its own 8 sequences of 2048 tokens
// per step (16384 tokens per rank, 32768 per step on 2 GPUs), packed
// ([16384] with cu_seqlens, causal attention inside each sequence, positions
// restarting at 0). Sequence s of rank r holds the tokens x(j) = ((r * 8 + s)
// * 2049 + j) * 2654435761 mod 151936 for j = 0 .. 2048: inputs j < 2048,
// targets j >= 1 (the next token), so every one of the 16384 positions has a
// target. torch_fsdp2.py builds the same tokens (as 8 rows of 2048).
//
// One step (the timed unit): zero_grad, forward, the fused lm-head + token
// log-probabilities (ops::token_logprobs: logits never materialised; it also
// computes the entropy), its backward with d logprob = -1 / (global tokens)
// (the loss is the mean negative log-likelihood over the step's tokens of all
// ranks; gradients summed over ranks), backward, AdamW on the master shards.
// No host synchronisation inside a step (the loss is read only outside the
// timed steps).
//
// Rank drivers: run_nccl_ranks (one thread and one GPU per rank): 1 rank for
// fsdp/dense0.5b/gpus1 (a 1-rank communicator: Sharded adds no copies),
// 2 ranks for gpus2 (FullShard: all-gathers prefetched on the communication
// stream, reduce-scatters overlapped with the backward).
//
// Method: build, kWarmup untimed steps (the first one's loss is checked:
// finite and within 1 of ln(vocab), as for any near-uniform random init),
// barrier, reset the peak of slime::memory_stats(device), kSteps steps with a
// CUDA event on the compute stream before each and after the last (no host
// sync in between), then one synchronisation. A step's time is the slowest
// rank's; the reported iteration time (us) is the median over the kSteps
// steps (one Google Benchmark iteration holds the whole measurement).
// Counters (per configuration):
//   tokens_per_s     ranks * 16384 / median step time (all GPUs together)
//   peak_gib         max over ranks of memory_stats(device).peak_bytes during
//                    the timed steps (everything slime allocated: shards,
//                    optimizer states, gathered units, activations, workspace)
//   reserved_gib     max over ranks of the CUDA pool's reserved bytes after the
//                    timed steps (the pool is emptied before each run)
//   tflops           model FLOP per GPU per second: 6 * tokens * matmul params
//                    (lm head included) + 6 * layers * seqs * 2048^2 * heads *
//                    head_dim (causal attention, forward + backward)
//   mean_us, min_us, max_us, loss_first, loss_last, gpus, tokens_per_step
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "slime/comm/nccl_comm.hpp"
#include "slime/core/memory.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/parallel/sharded.hpp"

namespace {

using namespace slime;

constexpr int kSeqs = 8;           // sequences per rank and step
constexpr int64_t kSeqLen = 2048;  // tokens per sequence
constexpr int kWarmup = 3;         // untimed steps
constexpr int kSteps = 10;         // timed steps; the median is reported
constexpr double kLr = 1e-5;
constexpr double kGiB = double(int64_t(1) << 30);

nn::Qwen3Config dense_config() {
  nn::Qwen3Config c;
  c.vocab_size = 151936;
  c.hidden_size = 1024;
  c.intermediate_size = 3072;
  c.num_hidden_layers = 24;
  c.num_attention_heads = 16;
  c.num_key_value_heads = 8;
  c.head_dim = 128;
  c.max_position_embeddings = 40960;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 1e6;
  c.tie_word_embeddings = true;
  c.torch_dtype = DType::bf16;
  return c;
}

// Model FLOP of one rank's step (see the file comment).
double step_flop(const nn::Qwen3Config& c) {
  const double d = double(c.hidden_size), qd = double(c.num_attention_heads) * c.head_dim,
               kvd = double(c.num_key_value_heads) * c.head_dim;
  const double per_layer = d * qd + 2 * d * kvd + qd * d + 3 * d * double(c.intermediate_size);
  const double matmul_params = double(c.num_hidden_layers) * per_layer + double(c.vocab_size) * d;
  const double tokens = double(kSeqs) * double(kSeqLen);
  const double attention = 6.0 * c.num_hidden_layers * kSeqs * double(kSeqLen) * double(kSeqLen) * qd;
  return 6.0 * tokens * matmul_params + attention;
}

struct RankData {
  nn::PackedBatch batch;
  Tensor targets;  // i32 [kSeqs * kSeqLen]
};

// The tokens of the file comment: x(j) for sequence s of rank r.
RankData rank_data(int rank, int64_t vocab, Device dev) {
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> targets;
  for (int s = 0; s < kSeqs; ++s) {
    const uint64_t base = uint64_t(rank * kSeqs + s) * uint64_t(kSeqLen + 1);
    std::vector<int32_t> x;
    for (int64_t j = 0; j <= kSeqLen; ++j) x.push_back(int32_t((base + uint64_t(j)) * 2654435761ull % uint64_t(vocab)));
    targets.insert(targets.end(), x.begin() + 1, x.end());
    x.pop_back();
    seqs.push_back(std::move(x));
  }
  RankData d;
  d.batch = nn::make_packed_batch(seqs, dev);
  d.targets = Tensor::from_vector(targets, {int64_t(targets.size())}, dev);
  return d;
}

struct RankResult {
  std::vector<double> step_ms;  // kSteps
  int64_t peak_bytes = 0, reserved_bytes = 0;
  double loss_first = 0, loss_last = 0;
};

double mean_nll(const Tensor& logprobs, const Stream& s) {
  double sum = 0;
  const std::vector<float> lp = logprobs.to_vector<float>(s);
  for (float v : lp) sum += double(v);
  return -sum / double(lp.size());
}

// One rank's whole measurement (see the file comment).
void train_rank(comm::NcclComm& comm, RankResult& out) {
  const Device dev = comm.device();
  const int world = comm.size();
  release_cached_memory(dev);  // a clean pool: reserved_bytes is this run's
  const nn::Qwen3Config cfg = dense_config();
  nn::Qwen3Model model(cfg, {dev, DType::bf16});
  model.init_random(1, 0.02f, Stream::default_for(dev));  // the same weights on every rank
  parallel::ShardedOptions options;                       // bf16 compute (the module's), fp32 master, fp32 reduction
  optim::AdamWConfig adamw;
  adamw.lr = kLr;
  adamw.beta1 = 0.9;
  adamw.beta2 = 0.999;
  adamw.eps = 1e-8;
  adamw.weight_decay = 0.01;
  parallel::Sharded<nn::Qwen3Model, parallel::FullShard> sh(std::move(model), comm, options, adamw);

  const Stream s = Stream::create(dev);
  const RankData data = rank_data(comm.rank(), cfg.vocab_size, dev);
  const int64_t T = data.batch.num_tokens();
  // d loss / d logprob_t for loss = -sum over all ranks' tokens / their count.
  const Tensor grad_lp =
      Tensor::from_vector(std::vector<float>(std::size_t(T), float(-1.0 / double(T * world))), {T}, dev);
  Stream::default_for(dev).synchronize();  // the batch and grad_lp were written on the default stream

  auto step = [&]() -> Tensor {
    sh.zero_grad(s);
    parallel::Sharded<nn::Qwen3Model, parallel::FullShard>::Context ctx;
    const Tensor hidden = sh.forward(data.batch, ctx, s);
    ops::TokenLogprobs lp = sh.token_logprobs(hidden, data.targets, 1.f, s);
    const Tensor d_hidden = sh.token_logprobs_backward(hidden, data.targets, 1.f, lp, grad_lp, Tensor{}, s);
    sh.backward(ctx, d_hidden, s);
    sh.optimizer_step(kLr, 0, s);
    return lp.logprobs;
  };

  out.loss_first = mean_nll(step(), s);
  for (int i = 1; i < kWarmup; ++i) step();
  s.synchronize();
  comm.barrier();
  reset_peak_memory_stats(dev);
  std::vector<Event> marks;
  for (int i = 0; i <= kSteps; ++i) marks.emplace_back(dev);
  Tensor last;
  for (int i = 0; i < kSteps; ++i) {
    marks[std::size_t(i)].record(s);
    last = step();
  }
  marks.back().record(s);
  s.synchronize();
  for (int i = 0; i < kSteps; ++i)
    out.step_ms.push_back(double(Event::elapsed_ms(marks[std::size_t(i)], marks[std::size_t(i) + 1])));
  const MemoryStats m = memory_stats(dev);
  out.peak_bytes = m.peak_bytes;
  out.reserved_bytes = m.reserved_bytes;
  out.loss_last = mean_nll(last, s);
  comm.barrier();  // neither rank tears down while the other may still be in a collective
}

void run_fsdp(benchmark::State& state, int ranks) {
  if (bench::skip_without_cuda(state)) return;
  const int devices = cuda_device_count();
  if (devices < ranks) {
    state.SkipWithError(detail::concat("needs ", ranks, " CUDA devices, this process sees ", devices).c_str());
    return;
  }
  bench::run_or_skip(state, [&] {
    const nn::Qwen3Config cfg = dense_config();
    for (auto _ : state) {
      std::vector<RankResult> results(static_cast<std::size_t>(ranks));
      comm::run_nccl_ranks(ranks, [&](comm::NcclComm& comm) { train_rank(comm, results[std::size_t(comm.rank())]); });
      // Checks: a near-uniform start (random init, std 0.02) and no blow-up.
      const double ln_v = std::log(double(cfg.vocab_size));
      for (int r = 0; r < ranks; ++r) {
        const RankResult& rr = results[std::size_t(r)];
        if (!(std::abs(rr.loss_first - ln_v) < 1.0) || !std::isfinite(rr.loss_last) || rr.loss_last > ln_v + 1.0) {
          state.SkipWithError(detail::concat("correctness check failed on rank ", r, ": first loss ", rr.loss_first,
                                             ", last loss ", rr.loss_last, ", expected about ln(vocab) = ", ln_v)
                                  .c_str());
          return;
        }
      }
      std::vector<double> step_ms(kSteps, 0.0);  // the slowest rank's time of each step
      int64_t peak = 0, reserved = 0;
      for (const RankResult& rr : results) {
        for (int i = 0; i < kSteps; ++i)
          step_ms[std::size_t(i)] = std::max(step_ms[std::size_t(i)], rr.step_ms[std::size_t(i)]);
        peak = std::max(peak, rr.peak_bytes);
        reserved = std::max(reserved, rr.reserved_bytes);
      }
      std::vector<double> sorted = step_ms;
      std::sort(sorted.begin(), sorted.end());
      const double median_ms = kSteps % 2 ? sorted[kSteps / 2] : 0.5 * (sorted[kSteps / 2 - 1] + sorted[kSteps / 2]);
      double mean_ms = 0;
      for (double t : step_ms) mean_ms += t / kSteps;
      state.SetIterationTime(median_ms * 1e-3);

      const double tokens_per_step = double(ranks) * kSeqs * double(kSeqLen);
      state.counters["tokens_per_s"] = tokens_per_step / (median_ms * 1e-3);
      state.counters["tokens_per_step"] = tokens_per_step;
      state.counters["gpus"] = ranks;
      state.counters["peak_gib"] = double(peak) / kGiB;
      state.counters["reserved_gib"] = double(reserved) / kGiB;
      state.counters["tflops"] = bench::per_second(step_flop(cfg), median_ms * 1e-3, 1e12);
      state.counters["mean_us"] = mean_ms * 1e3;
      state.counters["min_us"] = sorted.front() * 1e3;
      state.counters["max_us"] = sorted.back() * 1e3;
      state.counters["loss_first"] = results[0].loss_first;
      state.counters["loss_last"] = results[0].loss_last;
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  // Never NVLink multicast (shared hosts); an explicit setting is left alone.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  for (int ranks : {1, 2}) {
    // One iteration holds the whole measurement (kWarmup + kSteps steps); its
    // time is the median step.
    bench::register_manual(
        "fsdp/dense0.5b/gpus" + std::to_string(ranks), [ranks](benchmark::State& state) { run_fsdp(state, ranks); },
        benchmark::kMillisecond,
        /*iterations=*/1, /*repetitions=*/1);
  }
  return bench::run_benchmarks(argc, argv, [] {
    benchmark::AddCustomContext("model",
                                "dense0.5b: Qwen3 hidden 1024, 24 layers, 16/8 heads, head_dim 128, "
                                "intermediate 3072, vocab 151936, tied");
    benchmark::AddCustomContext("tokens_per_rank", std::to_string(kSeqs) + " x " + std::to_string(kSeqLen));
    benchmark::AddCustomContext("steps", std::to_string(kWarmup) + " warm-up + " + std::to_string(kSteps) + " timed");
    try {
      benchmark::AddCustomContext("nccl_version", comm::NcclComm::nccl_version());
    } catch (const std::exception& e) {
      benchmark::AddCustomContext("nccl_version", std::string("unknown: ") + e.what());
    }
  });
}
