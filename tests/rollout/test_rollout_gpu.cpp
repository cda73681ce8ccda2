// The rollout engine, index ops, weight sync and colocated offload on CUDA.
// Skips without a GPU (the two-GPU case without two).
#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <tuple>
#include <vector>

#include "../../bench/bench_models.hpp"
#include "slime/comm/nccl_comm.hpp"
#include "slime/core/host_sync.hpp"
#include "slime/core/memory.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/ops/batch_invariant.hpp"
#include "slime/ops/index_rows.hpp"
#include "slime/rollout/weight_sync.hpp"

using namespace slime;

namespace {

nn::Qwen3Config gpu_config() {
  nn::Qwen3Config c;
  c.vocab_size = 300;
  c.hidden_size = 128;
  c.intermediate_size = 200;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;  // a head dim the CUDA attention runs at full speed
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 256;
  return c;
}

nn::Qwen3Model gpu_model(uint64_t seed, Device d = Device::cuda(0)) {
  nn::Qwen3Model m(gpu_config(), {d, DType::bf16});
  m.init_random(seed, 0.05f);
  return m;
}

std::vector<rollout::Request> requests(int n, int64_t max_new) {
  std::vector<rollout::Request> rs;
  for (int i = 0; i < n; ++i) {
    rollout::Request r;
    for (int j = 0; j < 1 + (i * 37) % 61; ++j) r.prompt.push_back(int32_t((i * 131 + j * 17) % 300));
    r.sample_id = uint64_t(i);
    r.sampling.max_new_tokens = max_new + i % 5;
    rs.push_back(r);
  }
  return rs;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  const Tensor x = a.to(Device::cpu()), y = b.to(Device::cpu());
  return x.nbytes() == y.nbytes() && std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

}  // namespace

TEST_CASE("gather_rows and scatter_rows on CUDA equal the CPU for every row width", "[rollout][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  for (int64_t width : {1, 3, 8, 64, 1000}) {  // bf16: 2, 6, 16, 128, 2000 bytes (byte, word and 16-byte paths)
    const int64_t m = 577, n = 301;
    Tensor src = Tensor::empty({m, width}, DType::bf16);
    fill_uniform(src, uint64_t(width), 0, -1.f, 1.f);
    std::vector<int32_t> idx(static_cast<std::size_t>(n));
    for (int64_t i = 0; i < n; ++i) idx[std::size_t(i)] = int32_t((i * 211 + 5) % m);  // distinct (211 coprime to 577)
    const Tensor index = Tensor::from_vector(idx, {n});
    Tensor want = Tensor::empty({n, width}, DType::bf16);
    ops::gather_rows(src, index, want);
    Tensor got = Tensor::empty({n, width}, DType::bf16, Device::cuda(0));
    got.fill_bytes_(0xff);
    ops::gather_rows(src.to(Device::cuda(0)), index.to(Device::cuda(0)), got);
    CHECK(same_bytes(got, want));
    // Scatter back into a poisoned copy: the indexed rows equal src's rows.
    Tensor back_cpu = Tensor::zeros({m, width}, DType::bf16);
    ops::scatter_rows(want, index, back_cpu);
    Tensor back = Tensor::zeros({m, width}, DType::bf16, Device::cuda(0));
    ops::scatter_rows(want.to(Device::cuda(0)), index.to(Device::cuda(0)), back);
    CHECK(same_bytes(back, back_cpu));
  }
}

TEST_CASE("the CUDA sampler picks the host sampler's token", "[rollout][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const int64_t rows = 37, vocab = 1000;
  Tensor logits = Tensor::empty({rows, vocab}, DType::f32);
  fill_normal(logits, 21, 0, 0.f, 3.f);
  const auto host = logits.to_vector<float>();
  std::vector<int32_t> scratch;
  for (float temperature : {0.f, 0.7f, 1.f}) {
    std::vector<int64_t> keys, steps;
    std::vector<float> temps;
    std::vector<int32_t> want;
    for (int64_t b = 0; b < rows; ++b) {
      rollout::SamplingParams p;
      p.temperature = temperature;
      keys.push_back(int64_t(rollout::sample_stream_key(9, uint64_t(b))));
      steps.push_back(b * 3);
      temps.push_back(temperature);
      want.push_back(rollout::sample_token(host.data() + b * vocab, vocab, p, 9, uint64_t(b), b * 3, scratch));
    }
    const Device d = Device::cuda(0);
    const Tensor z = logits.to(d), k = Tensor::from_vector(keys, {rows}, d), s = Tensor::from_vector(steps, {rows}, d);
    const Tensor t = Tensor::from_vector(temps, {rows}, d);
    Tensor tok = Tensor::empty({rows}, DType::i32, d);
    tok.fill_bytes_(0xff);
    rollout::cuda::sample_rows(z.data<float>(), rows, vocab, reinterpret_cast<const uint64_t*>(k.data<int64_t>()),
                               s.data<int64_t>(), t.data<float>(), tok.data<int32_t>(),
                               Stream::default_for(d).handle());
    CHECK(tok.to_vector<int32_t>() == want);
  }
}

namespace {

// The engine's logprobs of its sampled tokens against the trainer's
// recompute (one forward over every prompt + completion packed).
struct OnPolicyGap {
  int64_t tokens = 0, exact = 0;
  double max_diff = 0, mean_diff = 0;
};

// Fills 256 MiB of the device pool with NaN bits (0xff bytes) and frees it:
// the next allocations (the engine's KV arena among them) reuse that memory,
// so a buffer read before it is written shows as NaN instead of passing on
// whatever the pool happened to hold.
void poison_device_pool() {
  Tensor t = Tensor::empty({int64_t(256) << 20}, DType::u8, Device::cuda(0));
  t.fill_bytes_(0xff);
  Stream::default_for(Device::cuda(0)).synchronize();
}

OnPolicyGap on_policy_gap(nn::Qwen3Model& m, int64_t max_batch, int n_requests, uint64_t seed) {
  poison_device_pool();
  rollout::Engine engine(m, {.max_batch = max_batch, .max_context = 160, .kv_capacity = 0, .seed = seed});
  const auto reqs = requests(n_requests, 24);
  const auto out = engine.generate(reqs);
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> targets;
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    REQUIRE(out[i].finish != rollout::FinishReason::error);
    std::vector<int32_t> s = reqs[i].prompt;
    s.insert(s.end(), out[i].tokens.begin(), out[i].tokens.end());
    targets.insert(targets.end(), s.begin() + 1, s.end());
    s.pop_back();
    seqs.push_back(s);
  }
  const nn::PackedBatch batch = nn::make_packed_batch(seqs, Device::cuda(0));
  nn::Qwen3Model::Context ctx;
  const Tensor hidden = m.forward(batch, ctx);
  const auto lp = m.token_logprobs(hidden, Tensor::from_vector(targets, {int64_t(targets.size())}, Device::cuda(0)))
                      .logprobs.to_vector<float>();
  OnPolicyGap g;
  double sum = 0;
  int shown = 0;
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    const int64_t first = batch.cu_seqlens_host[i] + int64_t(reqs[i].prompt.size()) - 1;
    for (std::size_t j = 0; j < out[i].tokens.size(); ++j) {
      const float trainer = lp[std::size_t(first) + j], eng = out[i].logprobs[j];
      const double d = std::abs(double(trainer) - double(eng));
      if (!(d <= g.max_diff)) g.max_diff = d;  // a NaN sticks
      sum += d;
      // Bitwise: the same float, compared as bytes.
      const bool same = std::memcmp(&trainer, &eng, 4) == 0;
      g.exact += same;
      if (!same && shown < 4) {  // the first few, with their bits
        ++shown;
        uint32_t tb = 0, eb = 0;
        std::memcpy(&tb, &trainer, 4);
        std::memcpy(&eb, &eng, 4);
        std::printf("  differs: request %zu token %zu (id %d): trainer %.9g (%08x) engine %.9g (%08x)\n", i, j,
                    int(out[i].tokens[j]), double(trainer), tb, double(eng), eb);
      }
      ++g.tokens;
    }
  }
  g.mean_diff = g.tokens ? sum / double(g.tokens) : 0;
  return g;
}

nn::Qwen3Model gpu_moe_model(uint64_t seed) {
  nn::Qwen3Config c = gpu_config();
  c.model_type = "qwen3_moe";
  c.num_experts = 8;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 96;
  c.mlp_only_layers = {0};  // layer 0 dense, layer 1 sparse
  nn::Qwen3Model m(c, {Device::cuda(0), DType::bf16});
  m.init_random(seed, 0.05f);
  return m;
}

}  // namespace

TEST_CASE("CUDA engine: the trainer's recompute of the sampled tokens' logprobs", "[rollout][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  nn::Qwen3Model m = gpu_model(1);
  ops::BatchInvariantScope mode(false);
  const OnPolicyGap g = on_policy_gap(m, 8, 12, 2);
  std::printf(
      "rollout on-policy gap (CUDA bf16, batch-invariant mode off): %lld tokens, max |engine - trainer| logprob "
      "%.3g, mean %.3g, %lld bitwise equal\n",
      (long long)g.tokens, g.max_diff, g.mean_diff, (long long)g.exact);
  CHECK(g.tokens > 200);
  CHECK(g.max_diff < 0.05);  // bf16 activations: hidden rounding differences between the two paths
}

// Issue 20: in the batch-invariant mode every sampled token's engine logprob
// equals the trainer's recompute bit for bit, whatever the engine's batch.
TEST_CASE("CUDA engine in the batch-invariant mode: logprobs equal the trainer's bit for bit", "[rollout][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  ops::BatchInvariantScope mode;
  for (bool moe : {false, true}) {
    nn::Qwen3Model m = moe ? gpu_moe_model(5) : gpu_model(5);
    for (int64_t max_batch : {1, 7, 64}) {
      INFO((moe ? "MoE" : "dense") << ", engine max_batch " << max_batch);
      const OnPolicyGap g = on_policy_gap(m, max_batch, max_batch == 64 ? 70 : 16, 9);
      std::printf(
          "batch-invariant on-policy gap (%s, max_batch %lld): %lld tokens, %lld bitwise equal, max |diff| %.3g\n",
          moe ? "MoE" : "dense", (long long)max_batch, (long long)g.tokens, (long long)g.exact, g.max_diff);
      CHECK(g.tokens > 200);
      CHECK(g.exact == g.tokens);
      CHECK(g.max_diff == 0);
    }
  }
}

// The same at the rollout benchmark's model configs (bench_models.hpp's
// rollout_config: hidden 1024, 8 layers, 16 / 4 heads of 64, vocab 32000;
// dense MLP 3072 or 32 experts top-4 of 384), randomly initialised: GEMMs wide enough that
// decode, prefill and the trainer's batch take different tile widths
// (n64 / n128 / n256) and the MoE blocks hold rows of many experts.
TEST_CASE("CUDA engine in the batch-invariant mode at the benchmark configs: bitwise logprobs", "[rollout][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  ops::BatchInvariantScope mode;
  for (bool moe : {false, true}) {
    nn::Qwen3Model m(bench::rollout_config(moe), {Device::cuda(0), DType::bf16});
    m.init_random(17, 0.02f);
    for (int64_t max_batch : {1, 7, 64}) {
      INFO((moe ? "MoE" : "dense") << " benchmark config, engine max_batch " << max_batch);
      const OnPolicyGap g = on_policy_gap(m, max_batch, max_batch == 64 ? 70 : 16, 11);
      std::printf(
          "batch-invariant on-policy gap (%s benchmark config, max_batch %lld): %lld tokens, %lld bitwise equal, "
          "max |diff| %.3g\n",
          moe ? "MoE" : "dense", (long long)max_batch, (long long)g.tokens, (long long)g.exact, g.max_diff);
      CHECK(g.tokens > 200);
      CHECK(g.exact == g.tokens);
      CHECK(g.max_diff == 0);
    }
  }
}

// Issue 19: decode runs on the GPU wait on the host once per run, not once
// per step, and give the completions of single steps (equal lengths, no stop
// tokens: every step has the same batch either way, so the same kernels).
TEST_CASE("CUDA engine: decode runs wait on the host once per run and equal single steps", "[rollout][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  nn::Qwen3Model m = gpu_model(3);
  std::vector<rollout::Request> reqs = requests(6, 33);
  for (auto& r : reqs) r.sampling.max_new_tokens = 33;
  auto run = [&](int64_t decode_steps) {
    rollout::Engine e(m, {.max_batch = 8,
                          .max_context = 160,
                          .kv_capacity = 0,
                          .seed = 4,
                          .record_routing = false,
                          .decode_steps = decode_steps});
    e.generate(reqs);  // sizes the buffers
    Stream::default_for(Device::cuda(0)).synchronize();
    const int64_t before = host_sync_count();
    auto out = e.generate(reqs);
    const int64_t waits = host_sync_count() - before;
    return std::make_tuple(out, waits, e.stats());
  };
  const auto [one, one_waits, one_stats] = run(1);
  const auto [eight, eight_waits, eight_stats] = run(8);
  std::printf("engine host waits for 6 x 33 tokens: %lld one step at a time, %lld with decode runs of 8\n",
              (long long)one_waits, (long long)eight_waits);
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    INFO("request " << i);
    REQUIRE(one[i].tokens == eight[i].tokens);
    REQUIRE(std::memcmp(one[i].logprobs.data(), eight[i].logprobs.data(), one[i].logprobs.size() * 4) == 0);
  }
  CHECK(eight_stats.decode_runs == 2 * 4);  // per generate: the prefill step, then 32 decode steps in 4 runs
  CHECK(eight_waits * 4 <= one_waits);
}

TEST_CASE("CUDA colocated weight sync is bitwise, offload cycles do not grow memory", "[rollout][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const Device dev = Device::cuda(0);
  nn::Qwen3Model trainer = gpu_model(3);
  nn::Qwen3Model engine_model = gpu_model(4);
  rollout::Engine engine(engine_model, {.max_batch = 8, .max_context = 128, .kv_capacity = 0, .seed = 5});
  nn::ParameterOffload trainer_offload(/*with_grads=*/true);
  const auto batch = nn::make_packed_batch({{1, 2, 3, 4, 5, 6, 7, 8}, {9, 10, 11}}, dev);
  const Tensor targets = Tensor::from_vector(std::vector<int32_t>{2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, {11}, dev);
  int64_t first_current = -1, first_peak = -1;
  int64_t train_peak = 0, rollout_peak = 0;
  for (int cycle = 0; cycle < 100; ++cycle) {
    // Training turn.
    trainer_offload.onload(trainer, dev);
    reset_peak_memory_stats(dev);
    const int64_t base_t = memory_stats(dev).current_bytes;
    trainer.loss_and_backward(batch, targets);
    train_peak = std::max(train_peak, memory_stats(dev).peak_bytes - base_t);
    rollout::sync_colocated(rollout::ModelWeights{&trainer}, engine, cycle + 1, {.verify = cycle % 25 == 0});
    trainer_offload.offload(trainer);
    // Rollout turn.
    engine.onload();
    reset_peak_memory_stats(dev);
    const int64_t base_r = memory_stats(dev).current_bytes;
    const auto out = engine.generate(requests(8, 8));
    rollout_peak = std::max(rollout_peak, memory_stats(dev).peak_bytes - base_r);
    CHECK(out[0].weight_version == cycle + 1);
    engine.offload();
    if (cycle == 0) {
      first_current = memory_stats(dev).current_bytes;
      first_peak = memory_stats(dev).peak_bytes;
    }
  }
  CHECK(rollout::weights_hash(engine_model) == rollout::weights_hash(trainer));
  const int64_t current = memory_stats(dev).current_bytes;
  std::printf(
      "colocated cycles: device bytes after cycle 1 %lld, after cycle 100 %lld; training turn peak %lld, "
      "rollout turn peak %lld (above their bases)\n",
      (long long)first_current, (long long)current, (long long)train_peak, (long long)rollout_peak);
  CHECK(current == first_current);
  CHECK(first_peak > 0);
}

TEST_CASE("distributed weight sync across two GPUs (one trainer, one engine)", "[rollout][gpu][multi_gpu]") {
  if (cuda_device_count() < 2) SKIP("needs two CUDA devices");
  std::vector<uint64_t> hashes(2);
  std::vector<int64_t> versions(2);
  comm::run_nccl_ranks(2, [&](comm::Comm& comm) {
    const int r = comm.rank();
    const Device dev = Device::cuda(r);
    nn::Qwen3Model m = gpu_model(r == 0 ? 7 : 8, dev);
    if (r == 0) {
      const auto st = rollout::send_weights(comm, rollout::ModelWeights{&m}, 42, DType::bf16, dev,
                                            {.bucket_bytes = 64 << 10, .verify = true});
      hashes[0] = st.hash;
      versions[0] = st.version;
    } else {
      rollout::Engine engine(m, {.max_batch = 2, .max_context = 64});
      rollout::receive_weights(comm, 0, engine);
      hashes[1] = rollout::weights_hash(m);
      versions[1] = engine.weight_version();
    }
  });
  CHECK(hashes[0] == hashes[1]);
  CHECK(versions[1] == 42);
}
