// bench_weight_sync: weight sync into the rollout engine on H200s.
//
// weight_sync/colocated/<model>: sync_colocated from a trainer Qwen3Model to
//   an engine Qwen3Model on the same GPU (bf16 -> bf16: one device copy per
//   parameter); GBps = parameter bytes / time.
// weight_sync/distributed/<model>/bucket<MiB>: send_weights on GPU 0 and
//   receive_weights on GPU 1 (NCCL, ranks as threads), metadata + buckets;
//   GBps = parameter bytes / time (algorithmic bandwidth of a broadcast to one
//   peer, = its bus bandwidth); no hash check.
// weight_sync/nccl_broadcast/<MiB>: comm.broadcast of one bucket-sized bf16
//   buffer from GPU 0 to GPU 1, the bound the distributed sync should reach
//   (target: >= 80% of it).
// Model "dense0.5b": hidden 1024, 24 layers, 16 / 8 heads, head_dim 128,
// intermediate 3072, vocab 151936 (0.53 B parameters, 1.07 GB in bf16).
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_models.hpp"
#include "bench_util.hpp"
#include "slime/comm/nccl_comm.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/rollout/weight_sync.hpp"

namespace {

using namespace slime;

nn::Qwen3Config dense_config() { return bench::dense_0p5b_config(); }

double model_bytes(nn::Qwen3Model& m) { return double(nn::num_parameters(m)) * 2.0; }

void colocated(benchmark::State& state) {
  if (bench::skip_without_cuda(state)) return;
  bench::run_or_skip(state, [&] {
    const Device d = Device::cuda(0);
    nn::Qwen3Model trainer(dense_config(), {d, DType::bf16}), engine_model(dense_config(), {d, DType::bf16});
    trainer.init_random(1, 0.02f);
    rollout::Engine engine(engine_model, {.max_batch = 1, .max_context = 64});
    rollout::sync_colocated(rollout::ModelWeights{&trainer}, engine, 0, {.verify = true});  // warm-up + check
    int64_t version = 1;
    for (auto _ : state) {
      const auto st = rollout::sync_colocated(rollout::ModelWeights{&trainer}, engine, version++);
      state.SetIterationTime(st.seconds);
    }
    state.counters["GBps"] =
        benchmark::Counter(model_bytes(trainer) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  });
}

void distributed(benchmark::State& state, std::size_t bucket_mib) {
  if (bench::skip_without_cuda(state)) return;
  if (cuda_device_count() < 2) {
    state.SkipWithError("needs 2 GPUs");
    return;
  }
  bench::run_or_skip(state, [&] {
    const int iterations = int(state.max_iterations);
    std::vector<double> seconds;
    double bytes = 0;
    comm::run_nccl_ranks(2, [&](comm::Comm& comm) {
      const Device d = Device::cuda(comm.rank());
      nn::Qwen3Model m(dense_config(), {d, DType::bf16});
      if (comm.rank() == 0) {
        m.init_random(1, 0.02f);
        bytes = model_bytes(m);
        for (int i = 0; i <= iterations; ++i) {  // the first is the warm-up
          comm.barrier();
          const auto st = rollout::send_weights(comm, rollout::ModelWeights{&m}, i, DType::bf16, d,
                                                {.bucket_bytes = bucket_mib << 20, .verify = i == 0});
          if (i > 0) seconds.push_back(st.seconds);
        }
      } else {
        rollout::Engine engine(m, {.max_batch = 1, .max_context = 64});
        for (int i = 0; i <= iterations; ++i) {
          comm.barrier();
          rollout::receive_weights(comm, 0, engine);
        }
      }
    });
    std::size_t i = 0;
    for (auto _ : state) state.SetIterationTime(seconds.at(i++));
    state.counters["GBps"] = benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  });
}

void nccl_broadcast(benchmark::State& state, std::size_t mib) {
  if (bench::skip_without_cuda(state)) return;
  if (cuda_device_count() < 2) {
    state.SkipWithError("needs 2 GPUs");
    return;
  }
  bench::run_or_skip(state, [&] {
    const int iterations = int(state.max_iterations);
    std::vector<double> seconds;
    comm::run_nccl_ranks(2, [&](comm::Comm& comm) {
      const Device d = Device::cuda(comm.rank());
      Tensor buf = Tensor::zeros({int64_t(mib << 19)}, DType::bf16, d);  // mib MiB of bf16
      const Stream s = Stream::default_for(d);
      for (int i = 0; i <= iterations; ++i) {
        comm.barrier();
        const auto t0 = std::chrono::steady_clock::now();
        comm.broadcast(buf, 0, s);
        s.synchronize();
        const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (comm.rank() == 0 && i > 0) seconds.push_back(t);
      }
    });
    std::size_t i = 0;
    for (auto _ : state) state.SetIterationTime(seconds.at(i++));
    state.counters["GBps"] = benchmark::Counter(double(mib << 20) / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  });
}

}  // namespace

int main(int argc, char** argv) {
  if (std::getenv("NCCL_NVLS_ENABLE") == nullptr) setenv("NCCL_NVLS_ENABLE", "0", 1);
  benchmark::RegisterBenchmark("weight_sync/colocated/dense0.5b", colocated)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond)
      ->Iterations(5);
  for (std::size_t mib : {64, 512})
    benchmark::RegisterBenchmark(("weight_sync/distributed/dense0.5b/bucket" + std::to_string(mib)).c_str(),
                                 [mib](benchmark::State& s) { distributed(s, mib); })
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(5);
  for (std::size_t mib : {64, 512})
    benchmark::RegisterBenchmark(("weight_sync/nccl_broadcast/" + std::to_string(mib) + "MiB").c_str(),
                                 [mib](benchmark::State& s) { nccl_broadcast(s, mib); })
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(5);
  return slime::bench::run_benchmarks(argc, argv);
}
