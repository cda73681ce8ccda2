// bench_rollout: the rollout engine's generation throughput on an H200,
// beside transformers' generate with a static cache (bench/torch_rollout.py,
// same config, random weights, bf16, the same prompts and lengths).
//
// rollout/<model>/decode/b<B>: one Engine::generate of B requests, prompt 64
// tokens, exactly 64 new tokens each (no stop token), temperature 1; the time
// is the whole call (prefill + 64 decode steps, sampling on the GPU); the
// counter tokens_per_s = B * 64 / time. The ".../batch_invariant" rows run
// the same in the batch-invariant mode (slime/ops/batch_invariant.hpp): its
// cost beside the row before it.
// rollout/<model>/decode/b<B>/mode_cost: the mode's cost measured in pairs,
// for machines whose speed drifts between rows (two runs of the same binary
// minutes apart differed by up to 40% on one H100): each iteration times one
// generate in each mode on the same engine, the order alternating, and the
// counter cost_pct is the median over the pairs of (mode / default - 1) x
// 100; default_ms and mode_ms are the medians of each side.
// Models "dense" and "moe": bench_models.hpp's rollout_config (hidden 1024, 8
// layers, 16 heads / 4 KV heads, head_dim 64, vocab 32000; a dense MLP of
// intermediate 3072, or 32 experts top-4 of moe_intermediate 384).
#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "bench_models.hpp"
#include "bench_util.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/ops/batch_invariant.hpp"
#include "slime/rollout/engine.hpp"

namespace {

using namespace slime;

constexpr int64_t kPrompt = 64, kNew = 64;

std::vector<rollout::Request> requests(int64_t batch) {
  std::vector<rollout::Request> rs;
  for (int64_t i = 0; i < batch; ++i) {
    rollout::Request r;
    for (int64_t j = 0; j < kPrompt; ++j) r.prompt.push_back(int32_t((i * 7919 + j * 104729) % 32000));
    r.sample_id = uint64_t(i);
    r.sampling.max_new_tokens = kNew;
    rs.push_back(r);
  }
  return rs;
}

void decode(benchmark::State& state, bool moe, int64_t batch, bool invariant) {
  if (bench::skip_without_cuda(state)) return;
  ops::BatchInvariantScope mode(invariant);
  bench::run_or_skip(state, [&] {
    static nn::Qwen3Model* models[2] = {nullptr, nullptr};
    nn::Qwen3Model*& model = models[moe ? 1 : 0];
    if (model == nullptr) {
      model = new nn::Qwen3Model(bench::rollout_config(moe), {Device::cuda(0), DType::bf16});
      model->init_random(1, 0.02f);
    }
    rollout::Engine engine(*model, {.max_batch = batch, .max_context = kPrompt + kNew, .kv_capacity = 0, .seed = 1});
    const auto reqs = requests(batch);
    engine.generate(reqs);  // warm-up: allocations, cuBLAS handles
    for (auto _ : state) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto out = engine.generate(reqs);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      state.SetIterationTime(s);
      if (out[0].tokens.size() != std::size_t(kNew)) state.SkipWithError("a sequence ended early");
    }
    state.counters["tokens_per_s"] =
        benchmark::Counter(double(batch * kNew), benchmark::Counter::kIsIterationInvariantRate);
  });
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void mode_cost(benchmark::State& state, bool moe, int64_t batch) {
  if (bench::skip_without_cuda(state)) return;
  bench::run_or_skip(state, [&] {
    nn::Qwen3Model model(bench::rollout_config(moe), {Device::cuda(0), DType::bf16});
    model.init_random(1, 0.02f);
    rollout::Engine engine(model, {.max_batch = batch, .max_context = kPrompt + kNew, .kv_capacity = 0, .seed = 1});
    const auto reqs = requests(batch);
    auto timed = [&](bool invariant) {
      ops::BatchInvariantScope mode(invariant);
      const auto t0 = std::chrono::steady_clock::now();
      const auto out = engine.generate(reqs);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (out[0].tokens.size() != std::size_t(kNew)) state.SkipWithError("a sequence ended early");
      return s;
    };
    timed(false);  // warm-up of both modes: allocations, cuBLAS handles, tensor maps
    timed(true);
    std::vector<double> def, inv, cost;
    bool invariant_first = false;
    for (auto _ : state) {
      const double a = invariant_first ? timed(true) : timed(false);
      const double b = invariant_first ? timed(false) : timed(true);
      const double t_def = invariant_first ? b : a, t_inv = invariant_first ? a : b;
      invariant_first = !invariant_first;
      def.push_back(t_def);
      inv.push_back(t_inv);
      cost.push_back((t_inv / t_def - 1.0) * 100.0);
      state.SetIterationTime(t_def + t_inv);
    }
    state.counters["cost_pct"] = median(cost);
    state.counters["default_ms"] = median(def) * 1e3;
    state.counters["mode_ms"] = median(inv) * 1e3;
  });
}

}  // namespace

int main(int argc, char** argv) {
  for (bool moe : {false, true})
    for (int64_t b : {1, 32, 256})
      for (bool invariant : {false, true})
        benchmark::RegisterBenchmark(("rollout/" + std::string(moe ? "moe" : "dense") + "/decode/b" +
                                      std::to_string(b) + (invariant ? "/batch_invariant" : ""))
                                         .c_str(),
                                     [moe, b, invariant](benchmark::State& s) { decode(s, moe, b, invariant); })
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond)
            ->Iterations(3)
            ->Repetitions(3)
            ->ReportAggregatesOnly(true);
  for (bool moe : {false, true})
    for (int64_t b : {1, 32, 256})
      benchmark::RegisterBenchmark(
          ("rollout/" + std::string(moe ? "moe" : "dense") + "/decode/b" + std::to_string(b) + "/mode_cost").c_str(),
          [moe, b](benchmark::State& s) { mode_cost(s, moe, b); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(10);
  return slime::bench::run_benchmarks(argc, argv);
}
