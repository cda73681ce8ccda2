// Weight sync into the rollout engine: colocated (direct copies) and
// distributed (metadata + bucketed broadcasts over LocalComm ranks); after a
// sync the engine's weights equal the trainer's bit for bit and the engine
// reports the version.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cstring>
#include <vector>

#include "slime/comm/local_comm.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/rollout/weight_sync.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;

namespace {

nn::Qwen3Config tiny_config(int64_t hidden = 32) {
  nn::Qwen3Config c;
  c.vocab_size = 48;
  c.hidden_size = hidden;
  c.intermediate_size = 40;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 100.0;
  c.max_position_embeddings = 64;
  return c;
}

nn::Qwen3Model make_model(uint64_t seed, DType dtype = DType::f32, int64_t hidden = 32) {
  nn::Qwen3Model m(tiny_config(hidden), {Device::cpu(), dtype});
  m.init_random(seed, 0.3f);
  return m;
}

// One plain SGD step on a next-token loss: the trainer's weights move.
void train_step(nn::Qwen3Model& m) {
  nn::zero_grad(m);
  const auto batch = nn::make_packed_batch({{1, 2, 3, 4, 5}, {7, 8, 9}});
  const Tensor targets = Tensor::from_vector(std::vector<int32_t>{2, 3, 4, 5, 6, 8, 9, 10}, {8});
  m.loss_and_backward(batch, targets);
  m.for_each_parameter([](nn::Parameter& p) {
    float* v = p.value.data<float>();
    const float* g = p.grad.data<float>();
    for (int64_t i = 0; i < p.value.numel(); ++i) v[i] -= 0.5f * g[i];
  });
}

std::vector<rollout::Request> requests() {
  std::vector<rollout::Request> rs;
  for (int i = 0; i < 3; ++i) {
    rollout::Request r;
    r.prompt = {int32_t(i + 1), 5, 9};
    r.sample_id = uint64_t(i);
    r.sampling.max_new_tokens = 5;
    rs.push_back(r);
  }
  return rs;
}

}  // namespace

TEST_CASE("colocated sync: the engine serves the trainer's weights bit for bit", "[rollout][weight_sync]") {
  nn::Qwen3Model trainer = make_model(1);
  nn::Qwen3Model engine_weights = make_model(2);
  rollout::Engine engine(engine_weights, {.max_batch = 4, .max_context = 32, .kv_capacity = 0, .seed = 3});
  REQUIRE(rollout::weights_hash(engine_weights) != rollout::weights_hash(trainer));
  for (int64_t version = 1; version <= 2; ++version) {
    const auto st = rollout::sync_colocated(rollout::ModelWeights{&trainer}, engine, version, {.verify = true});
    CHECK(engine.weight_version() == version);
    CHECK(rollout::weights_hash(engine_weights) == rollout::weights_hash(trainer));
    CHECK(st.bytes == std::size_t(nn::num_parameters(trainer)) * 4);
    // Same outputs as an engine built on the trainer's model itself.
    rollout::Engine direct(trainer, {.max_batch = 4, .max_context = 32, .kv_capacity = 0, .seed = 3});
    const auto a = engine.generate(requests()), b = direct.generate(requests());
    for (std::size_t i = 0; i < a.size(); ++i) {
      CHECK(a[i].tokens == b[i].tokens);
      CHECK(std::memcmp(a[i].logprobs.data(), b[i].logprobs.data(), a[i].logprobs.size() * 4) == 0);
      CHECK(a[i].weight_version == version);
    }
    train_step(trainer);  // the next version differs
    REQUIRE(rollout::weights_hash(engine_weights) != rollout::weights_hash(trainer));
  }
  // A bf16 engine gets the rounded weights.
  nn::Qwen3Model bf = make_model(4, DType::bf16);
  rollout::Engine bf_engine(bf, {.max_batch = 2, .max_context = 32, .kv_capacity = 0, .seed = 0});
  rollout::sync_colocated(rollout::ModelWeights{&trainer}, bf_engine, 7);
  const auto w = trainer.embed_tokens().weight.value.to_vector<float>();
  const auto v = bf.embed_tokens().weight.value.to_vector<BFloat16>();
  for (std::size_t i = 0; i < w.size(); ++i) REQUIRE(float(v[i]) == float(BFloat16(w[i])));
  // A different architecture is refused by name and shape.
  nn::Qwen3Model other = make_model(5, DType::f32, 16);
  rollout::Engine other_engine(other, {.max_batch = 2, .max_context = 32, .kv_capacity = 0, .seed = 0});
  CHECK_THROWS_WITH(rollout::sync_colocated(rollout::ModelWeights{&trainer}, other_engine, 1),
                    ContainsSubstring("in the engine but"));
}

TEST_CASE("distributed sync over LocalComm: metadata, buckets, hash and version", "[rollout][weight_sync]") {
  for (std::size_t bucket : {std::size_t(700), std::size_t(1) << 20}) {
    for (DType wire : {DType::f32, DType::bf16}) {
      DYNAMIC_SECTION("bucket " << bucket << " wire " << dtype_name(wire)) {
        nn::Qwen3Model trainer = make_model(1);
        train_step(trainer);
        std::vector<uint64_t> hashes(3);
        std::vector<int64_t> versions(3);
        std::vector<int> buckets(3);
        comm::run_local_ranks(3, [&](comm::Comm& comm) {
          const int r = comm.rank();
          if (r == 0) {
            const auto st = rollout::send_weights(comm, rollout::ModelWeights{&trainer}, 9, wire, Device::cpu(),
                                                  {.bucket_bytes = bucket, .verify = true});
            hashes[0] = st.hash;
            buckets[0] = st.buckets;
          } else {
            nn::Qwen3Model mine = make_model(10 + uint64_t(r), wire);
            rollout::Engine engine(mine, {.max_batch = 2, .max_context = 32, .kv_capacity = 0, .seed = 0});
            const auto st = rollout::receive_weights(comm, 0, engine);
            hashes[std::size_t(r)] = rollout::weights_hash(mine);
            versions[std::size_t(r)] = engine.weight_version();
            buckets[std::size_t(r)] = st.buckets;
          }
        });
        CHECK(hashes[1] == hashes[0]);
        CHECK(hashes[2] == hashes[0]);
        CHECK(versions[1] == 9);
        CHECK(versions[2] == 9);
        CHECK(buckets[1] == buckets[0]);
        if (bucket == 700) {
          CHECK(buckets[0] > 5);  // many buckets, some tensors larger than one bucket
        } else {
          CHECK(buckets[0] == 1);
        }
        if (wire == DType::f32) CHECK(hashes[0] == rollout::weights_hash(trainer));
      }
    }
  }
}

TEST_CASE("distributed sync refuses an engine whose parameters do not match", "[rollout][weight_sync]") {
  nn::Qwen3Model trainer = make_model(1);
  CHECK_THROWS_WITH(comm::run_local_ranks(2,
                                          [&](comm::Comm& comm) {
                                            if (comm.rank() == 0) {
                                              rollout::send_weights(comm, rollout::ModelWeights{&trainer}, 1,
                                                                    DType::f32, Device::cpu());
                                            } else {
                                              nn::Qwen3Model bf = make_model(2, DType::bf16);
                                              rollout::Engine e(bf, {.max_batch = 1, .max_context = 8});
                                              rollout::receive_weights(comm, 0, e);
                                            }
                                          }),
                    ContainsSubstring("the sender sends f32"));
}

TEST_CASE("engine offload and onload keep the weights and the outputs", "[rollout][offload]") {
  nn::Qwen3Model m = make_model(6);
  rollout::Engine engine(m, {.max_batch = 4, .max_context = 32, .kv_capacity = 0, .seed = 1});
  const auto before = engine.generate(requests());
  const uint64_t h = rollout::weights_hash(m);
  CHECK(engine.kv_cache_bytes() > 0);
  for (int cycle = 0; cycle < 3; ++cycle) {
    engine.offload();
    CHECK(engine.offloaded());
    CHECK(engine.kv_cache_bytes() == 0);
    CHECK_THROWS_WITH(engine.generate(requests()), ContainsSubstring("onload"));
    engine.onload();
    CHECK(rollout::weights_hash(m) == h);
    const auto after = engine.generate(requests());
    for (std::size_t i = 0; i < after.size(); ++i) CHECK(after[i].tokens == before[i].tokens);
  }
}
