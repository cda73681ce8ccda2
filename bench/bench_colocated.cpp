// bench/bench_colocated.cpp: colocated training and rollout on one GPU: a
// ~0.5B dense Qwen3 under Sharded<Qwen3Model, FullShard> (1-rank NcclComm,
// bf16 compute, fp32 master weights and AdamW moments) and a rollout::Engine
// with its own bf16 copy of the model, taking turns through Sharded::offload /
// onload and Engine::offload / onload. Prints JSON lines (one per
// measurement, then a summary); without a GPU one line {"skipped": ...}.
//
// Model (bench_fsdp.cpp's "dense0.5b", Qwen3-0.6B's shape with 24 layers):
// hidden 1024, 24 layers, 16 heads / 8 KV heads, head_dim 128, intermediate
// 3072, vocab 151936, tied embeddings, rope_theta 1e6: 533.1M parameters.
// Training step: zero_grad, forward, token_logprobs, its backward
// (d logprob = -1 / tokens), backward, AdamW; 8 packed sequences of 1024
// tokens (8192 tokens). Rollout turn: 64 prompts of 32 .. 95 tokens, 128 new
// tokens each (temperature 1, no stop tokens: every sample runs 128 tokens),
// Engine max_batch 64, max_context 1024, KV arena 64 x 1024 rows per layer
// (24 x 65536 x 8 x 128 x 2 x 2 bytes = 6 GiB, allocated by generate and freed
// by Engine::offload).
//
// Peaks (memory_stats(device).peak_bytes after reset_peak_memory_stats: the
// bytes slime holds, everything resident included, not the CUDA pool's
// reservation):
//   train_peak      (a) one training step, the engine offloaded
//   rollout_peak    (b) one generate, the policy offloaded
//   colocated_peak  (c) one colocated step: train step, engine onload (its
//                   weights), sync_colocated of the gathered weights (device
//                   to device), policy offload, generate (the KV arena),
//                   engine offload, policy onload
//   resident_peak   (d) the same work with nothing offloaded (train step,
//                   sync into the device engine, generate)
// printed with (a) + (b) (two GPUs' worth) beside (c) and (d).
// Also: what offload leaves on the device (the policy modules' op workspaces,
// sized by the step's tokens), and the median (of 5) wall time of policy
// offload (synchronous), policy onload (+ stream synchronisation), engine
// offload and onload, with GB/s = bytes moved / time (PCIe; pinned buffers
// reused after the first cycle), and sync_colocated's time.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "bench_models.hpp"
#include "slime/comm/nccl_comm.hpp"
#include "slime/core/memory.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/parallel/sharded.hpp"
#include "slime/rollout/engine.hpp"
#include "slime/rollout/weight_sync.hpp"

namespace {

using namespace slime;
using Policy = parallel::Sharded<nn::Qwen3Model, parallel::FullShard>;

constexpr int kSeqs = 8;
constexpr int64_t kSeqLen = 1024;
constexpr int kPrompts = 64;
constexpr int64_t kNewTokens = 128;
constexpr int kRepeats = 5;
constexpr double kLr = 1e-5;
constexpr double kGiB = double(int64_t(1) << 30);

nn::Qwen3Config dense_config() { return bench::dense_0p5b_config(); }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

double gib(int64_t bytes) { return double(bytes) / kGiB; }

}  // namespace

int main() {
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);  // never NVLink multicast (shared hosts)
  if (cuda_device_count() == 0) {
    std::printf("{\"bench\": \"colocated\", \"skipped\": \"no CUDA device\"}\n");
    return 0;
  }
  try {
    const Device dev = Device::cuda(0);
    DeviceGuard guard(dev);
    release_cached_memory(dev);
    const auto comm = comm::NcclComm::init_rank(comm::NcclComm::unique_id(), 0, 1, dev);
    const nn::Qwen3Config cfg = dense_config();
    const int64_t base = memory_stats(dev).current_bytes;

    nn::Qwen3Model model(cfg, {dev, DType::bf16});
    model.init_random(1, 0.02f);
    Policy sh(std::move(model), *comm);
    nn::Qwen3Model engine_model(cfg, {dev, DType::bf16});
    engine_model.init_random(2, 0.02f);
    rollout::Engine engine(engine_model, {.max_batch = kPrompts, .max_context = 1024, .kv_capacity = 0, .seed = 3});
    int64_t engine_bytes = 0;
    engine_model.for_each_parameter([&](nn::Parameter& p) { engine_bytes += int64_t(p.value.nbytes()); });

    // Training data (bench_fsdp's token formula) and prompts.
    std::vector<std::vector<int32_t>> seqs;
    std::vector<int32_t> targets;
    for (int s = 0; s < kSeqs; ++s) {
      std::vector<int32_t> x;
      for (int64_t j = 0; j <= kSeqLen; ++j)
        x.push_back(
            int32_t((uint64_t(s) * uint64_t(kSeqLen + 1) + uint64_t(j)) * 2654435761ull % uint64_t(cfg.vocab_size)));
      targets.insert(targets.end(), x.begin() + 1, x.end());
      x.pop_back();
      seqs.push_back(std::move(x));
    }
    const nn::PackedBatch batch = nn::make_packed_batch(seqs, dev);
    const int64_t T = batch.num_tokens();
    const Tensor target = Tensor::from_vector(targets, {T}, dev);
    const Tensor grad_lp = Tensor::from_vector(std::vector<float>(std::size_t(T), float(-1.0 / double(T))), {T}, dev);
    std::vector<rollout::Request> prompts;
    for (int i = 0; i < kPrompts; ++i) {
      rollout::Request r;
      for (int j = 0; j < 32 + (i * 37) % 64; ++j)
        r.prompt.push_back(int32_t((uint64_t(i) * 7919 + uint64_t(j) * 104729) % uint64_t(cfg.vocab_size)));
      r.sample_id = uint64_t(i);
      r.sampling.max_new_tokens = kNewTokens;
      prompts.push_back(std::move(r));
    }
    const Stream s = Stream::default_for(dev);
    s.synchronize();

    double loss = 0;
    auto train_step = [&] {
      sh.zero_grad(s);
      Policy::Context ctx;
      const Tensor hidden = sh.forward(batch, ctx, s);
      ops::TokenLogprobs lp = sh.token_logprobs(hidden, target, 1.f, s);
      const Tensor d_hidden = sh.token_logprobs_backward(hidden, target, 1.f, lp, grad_lp, Tensor{}, s);
      sh.backward(ctx, d_hidden, s);
      sh.optimizer_step(kLr, 0, s);
      double sum = 0;
      for (float v : lp.logprobs.to_vector<float>(s)) sum += double(v);  // (synchronises)
      loss = -sum / double(T);
    };
    int64_t generated = 0, version = 0, kv_bytes = 0;
    auto generate = [&] {
      const auto out = engine.generate(prompts);
      kv_bytes = int64_t(engine.kv_cache_bytes());
      generated = 0;
      for (const auto& c : out) {
        SLIME_CHECK(c.finish != rollout::FinishReason::error, "bench_colocated: a sample failed");
        generated += int64_t(c.tokens.size());
      }
      s.synchronize();
    };
    auto peak_of = [&](auto&& f) {
      s.synchronize();
      reset_peak_memory_stats(dev);
      const auto t0 = std::chrono::steady_clock::now();
      f();
      s.synchronize();
      return std::pair{memory_stats(dev).peak_bytes, seconds_since(t0)};
    };
    auto print = [](const char* name, int64_t peak, double sec) {
      std::printf("{\"bench\": \"colocated/dense0.5b/%s\", \"peak_gib\": %.4f, \"ms\": %.2f}\n", name, gib(peak),
                  sec * 1e3);
    };

    // Warm-up: one of each turn (workspaces, the pinned buffers, the KV arena's first allocation).
    engine.offload();
    train_step();
    const double loss_first = loss;
    sh.offload();
    engine.onload();
    generate();
    engine.offload();
    sh.onload();

    // (a) a training step alone, (b) a rollout turn alone.
    const auto [train_peak, train_s] = peak_of(train_step);
    print("train_step", train_peak, train_s);
    const int64_t before_offload = memory_stats(dev).current_bytes;
    sh.offload();
    const int64_t left_on_device = memory_stats(dev).current_bytes - base;
    engine.onload();
    const auto [rollout_peak, rollout_s] = peak_of(generate);
    print("rollout_turn", rollout_peak, rollout_s);
    std::printf(
        "{\"bench\": \"colocated/dense0.5b/rollout_turn\", \"generated_tokens\": %lld, \"tokens_per_s\": %.1f}\n",
        (long long)generated, double(generated) / rollout_s);
    engine.offload();
    sh.onload();

    // (c) the colocated step.
    double sync_s = 0;
    const auto [colocated_peak, colocated_s] = peak_of([&] {
      train_step();
      engine.onload();  // the engine's weights (1 GiB) while the step's activations are gone
      sync_s = rollout::sync_colocated(rollout::ShardedWeights<Policy>{&sh}, engine, ++version).seconds;
      sh.offload();
      generate();
      engine.offload();
      sh.onload();
    });
    print("colocated_step", colocated_peak, colocated_s);

    // (d) both resident, nothing offloaded.
    engine.onload();
    double resident_sync_s = 0;
    const auto [resident_peak, resident_s] = peak_of([&] {
      train_step();
      resident_sync_s = rollout::sync_colocated(rollout::ShardedWeights<Policy>{&sh}, engine, ++version).seconds;
      generate();
    });
    print("resident_step", resident_peak, resident_s);
    engine.offload();

    // Offload / onload timings (the policy onloaded, the engine offloaded at the start of each).
    std::vector<double> p_off, p_on, e_off, e_on;
    for (int i = 0; i < kRepeats; ++i) {
      s.synchronize();
      auto t0 = std::chrono::steady_clock::now();
      sh.offload();
      p_off.push_back(seconds_since(t0));
      t0 = std::chrono::steady_clock::now();
      engine.onload();
      s.synchronize();
      e_on.push_back(seconds_since(t0));
      t0 = std::chrono::steady_clock::now();
      engine.offload();
      e_off.push_back(seconds_since(t0));
      t0 = std::chrono::steady_clock::now();
      sh.onload();
      s.synchronize();
      p_on.push_back(seconds_since(t0));
    }
    const double policy_bytes = double(sh.offload_transfer_bytes());
    auto print_move = [](const char* name, double bytes, const std::vector<double>& t) {
      const double m = median(t);
      std::printf("{\"bench\": \"colocated/dense0.5b/%s\", \"gib\": %.4f, \"ms\": %.2f, \"gbps\": %.2f}\n", name,
                  bytes / kGiB, m * 1e3, bytes / m / 1e9);
    };
    print_move("policy_offload", policy_bytes, p_off);
    print_move("policy_onload", policy_bytes, p_on);
    print_move("engine_offload", double(engine_bytes), e_off);
    print_move("engine_onload", double(engine_bytes), e_on);

    std::printf(
        "{\"bench\": \"colocated/dense0.5b/summary\", \"train_peak_gib\": %.4f, \"rollout_peak_gib\": %.4f, "
        "\"sum_of_peaks_gib\": %.4f, \"colocated_peak_gib\": %.4f, \"resident_peak_gib\": %.4f, "
        "\"colocated_over_sum\": %.4f, \"policy_state_gib\": %.4f, \"policy_device_before_offload_gib\": %.4f, "
        "\"left_on_device_when_offloaded_gib\": %.4f, \"engine_weights_gib\": %.4f, \"kv_cache_gib\": %.4f, "
        "\"sync_colocated_ms\": %.2f, \"sync_resident_ms\": %.2f, \"pinned_gib\": %.4f, \"reserved_gib\": %.4f, "
        "\"loss_first\": %.4f, \"loss_last\": %.4f}\n",
        gib(train_peak), gib(rollout_peak), gib(train_peak + rollout_peak), gib(colocated_peak), gib(resident_peak),
        double(colocated_peak) / double(train_peak + rollout_peak), policy_bytes / kGiB, gib(before_offload - base),
        gib(left_on_device), gib(engine_bytes), gib(kv_bytes), sync_s * 1e3, resident_sync_s * 1e3,
        gib(pinned_memory_stats().current_bytes), gib(memory_stats(dev).reserved_bytes), loss_first, loss);
    const double ln_v = std::log(double(cfg.vocab_size));
    if (!(std::abs(loss_first - ln_v) < 1.0) || !std::isfinite(loss)) {
      std::fprintf(stderr, "bench_colocated: correctness check failed: first loss %f, last %f, ln(vocab) %f\n",
                   loss_first, loss, ln_v);
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_colocated: %s\n", e.what());
    return 1;
  }
  return 0;
}
