// ReferenceModel on the CPU with a tiny random Qwen3: reference logprobs equal
// the policy's (bitwise) before any update, differ once the policy takes an
// optimizer step, and are equal again after update_from / maybe_update every K
// steps; offload / onload round trips keep the weights bit-exact; errors.
// ShardedReferenceModel (a parallel::Frozen) on LocalComm with 1, 2 and 4
// ranks: logprobs equal the unsharded reference's (bitwise at 1 rank, <= 1e-6
// otherwise), a rank's bytes are its master shards only (<= the model's / N +
// the flat layout's padding), update_from a trained Sharded policy (also while
// offloaded) makes them the policy's bitwise; with ExpertParallel (dp 1 x ep
// 2) the reference holds the policy's expert slice and scores as the policy.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "slime/comm/local_comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/core/memory.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/parallel/expert_parallel.hpp"
#include "slime/parallel/sharded.hpp"
#include "slime/rl/reference_model.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;

namespace {

nn::Qwen3Config tiny_config(int layers = 2) {
  nn::Qwen3Config c;
  c.vocab_size = 40;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 100.0;
  return c;
}

const std::vector<std::vector<int32_t>> kSequences = {{7}, {3, 9, 27, 1, 12}, {30, 2, 5, 6, 7, 8, 9, 10, 11}};

// Next-token targets within each sequence; the last position gets token 0.
Tensor targets_of(const std::vector<std::vector<int32_t>>& seqs) {
  std::vector<int32_t> t;
  for (const auto& s : seqs) {
    for (std::size_t i = 0; i < s.size(); ++i) t.push_back(i + 1 < s.size() ? s[i + 1] : 0);
  }
  return Tensor::from_vector(t, Shape{int64_t(t.size())});
}

std::vector<float> policy_logprobs(nn::Qwen3Model& m, const nn::PackedBatch& b, const Tensor& targets) {
  nn::Qwen3Model::Context ctx;
  const Tensor h = m.forward(b, ctx);
  return m.token_logprobs(h, targets).logprobs.to_vector<float>();
}

std::vector<std::vector<uint8_t>> weight_bytes(nn::Qwen3Model& m) {
  std::vector<std::vector<uint8_t>> out;
  m.for_each_parameter([&](nn::Parameter& p) {
    const Tensor h = p.value.to(Device::cpu());
    const auto* b = static_cast<const uint8_t*>(h.data_ptr());
    out.emplace_back(b, b + h.nbytes());
  });
  return out;
}

// One SGD step on the policy's own loss: the policy moves away from the reference.
void sgd_step(nn::Qwen3Model& m, const nn::PackedBatch& b, const Tensor& targets, float lr) {
  nn::zero_grad(m);
  m.loss_and_backward(b, targets);
  m.for_each_parameter([&](nn::Parameter& p) {
    float* w = p.value.data<float>();
    const float* g = p.grad.data<float>();
    for (int64_t i = 0; i < p.value.numel(); ++i) w[i] -= lr * g[i];
  });
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - double(b[i])));
  return m;
}

}  // namespace

TEST_CASE("reference logprobs follow the policy only through update_from") {
  nn::Qwen3Model policy(tiny_config(), {});
  policy.init_random(3, 0.2f);
  const nn::PackedBatch batch = nn::make_packed_batch(kSequences);
  const Tensor targets = targets_of(kSequences);

  rl::ReferenceModel<> ref(policy, {.update_every = 2, .offload = true});
  REQUIRE(ref.is_offloaded());
  CHECK_THROWS_WITH(ref.logprobs(batch, targets), ContainsSubstring("call onload() before scoring"));

  // Before any update: bitwise the policy's logprobs (same weights, same kernels).
  ref.onload();
  REQUIRE_FALSE(ref.is_offloaded());
  const std::vector<float> p0 = policy_logprobs(policy, batch, targets);
  CHECK(ref.logprobs(batch, targets).to_vector<float>() == p0);
  ref.offload();

  // The policy takes a step: the reference stays where it was.
  sgd_step(policy, batch, targets, 0.5f);
  const std::vector<float> p1 = policy_logprobs(policy, batch, targets);
  REQUIRE(max_abs_diff(p1, p0) > 1e-3);
  const std::vector<nn::PackedBatch> batches = {batch};
  const std::vector<Tensor> targets_list = {targets};
  std::vector<Tensor> r = ref.logprobs(batches, targets_list);  // onloads, scores, offloads again
  REQUIRE(ref.is_offloaded());
  CHECK(r[0].to_vector<float>() == p0);

  // update_every = 2: step 1 copies nothing, step 2 copies the policy in (while offloaded).
  CHECK_FALSE(ref.should_update(0));
  CHECK_FALSE(ref.maybe_update(1, policy));
  r = ref.logprobs(batches, targets_list);
  CHECK(r[0].to_vector<float>() == p0);
  CHECK(ref.maybe_update(2, policy));
  r = ref.logprobs(batches, targets_list);
  CHECK(r[0].to_vector<float>() == p1);

  // update_from while on the device, then another policy step.
  sgd_step(policy, batch, targets, 0.5f);
  const std::vector<float> p2 = policy_logprobs(policy, batch, targets);
  REQUIRE(max_abs_diff(p2, p1) > 1e-3);
  ref.onload();
  CHECK(ref.logprobs(batch, targets).to_vector<float>() == p1);
  ref.update_from(policy);
  CHECK(ref.logprobs(batch, targets).to_vector<float>() == p2);
  // The next offload copies the updated weights to the pinned copies.
  ref.offload();
  r = ref.logprobs(batches, targets_list);
  CHECK(r[0].to_vector<float>() == p2);
  // The reference never allocates gradients.
  ref.onload();
  ref.model().for_each_parameter([&](nn::Parameter& p) { CHECK_FALSE(p.grad.defined()); });
}

TEST_CASE("reference model offload and onload keep the weights bit-exact") {
  nn::Qwen3Model policy(tiny_config(), {});
  policy.init_random(5, 0.2f);
  rl::ReferenceModel<> ref(policy, {.update_every = 0, .offload = false});
  REQUIRE_FALSE(ref.is_offloaded());
  CHECK_FALSE(ref.should_update(1));
  CHECK_FALSE(ref.should_update(100));
  const auto before = weight_bytes(ref.model());
  CHECK(before == weight_bytes(policy));
  const int64_t pinned_before = pinned_memory_stats().current_bytes;
  ref.offload();
  REQUIRE(ref.is_offloaded());
  // The parameters now live in the pinned copies only: the model's values are released.
  ref.model().for_each_parameter([&](nn::Parameter& p) { CHECK_FALSE(p.value.defined()); });
  CHECK(pinned_memory_stats().current_bytes - pinned_before == nn::num_parameters(policy) * 4);
  ref.offload();  // no-op
  for (int round = 0; round < 3; ++round) {
    ref.onload();
    REQUIRE_FALSE(ref.is_offloaded());
    CHECK(weight_bytes(ref.model()) == before);
    ref.onload();  // no-op
    ref.offload();
  }
  // The pinned buffers are allocated once and reused.
  CHECK(pinned_memory_stats().current_bytes - pinned_before == nn::num_parameters(policy) * 4);
}

TEST_CASE("reference model rejects a policy of another shape and bad configs") {
  nn::Qwen3Model policy(tiny_config(2), {});
  policy.init_random(1, 0.2f);
  rl::ReferenceModel<> ref(policy);
  nn::Qwen3Model other(tiny_config(1), {});
  other.init_random(1, 0.2f);
  CHECK_THROWS_WITH(ref.update_from(other), ContainsSubstring("parameters, the reference"));
  nn::Qwen3Config wider = tiny_config(2);
  wider.intermediate_size = 32;
  nn::Qwen3Model third(wider, {});
  third.init_random(1, 0.2f);
  CHECK_THROWS_WITH(ref.update_from(third), ContainsSubstring("in the policy"));
  CHECK_THROWS_WITH(rl::ReferenceModel<>(policy, {.update_every = -1}), ContainsSubstring("update_every must be >= 0"));
  const std::vector<nn::PackedBatch> one(1);
  CHECK_THROWS_WITH(ref.logprobs(one, std::vector<Tensor>{}), ContainsSubstring("1 micro-batches but 0 target"));
}

namespace {

nn::Qwen3Config tiny_moe_config() {
  nn::Qwen3Config c = tiny_config(2);
  c.model_type = "qwen3_moe";
  c.num_experts = 4;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 12;
  c.mlp_only_layers = {0};
  return c;
}

nn::Qwen3Model random_model(const nn::Qwen3Config& c, uint64_t seed) {
  nn::Qwen3Model m(c, {});
  m.init_random(seed, 0.2f);
  return m;
}

// Rank r's micro-batch: a few of kSequences shifted by r (tokens < 40).
std::vector<std::vector<int32_t>> rank_sequences(int r) {
  std::vector<std::vector<int32_t>> seqs = kSequences;
  for (auto& s : seqs)
    for (int32_t& t : s) t = (t + 3 * r) % 40;
  return seqs;
}

// Elements of one rank's flat shards bound by FlatShardLayout: per
// parameter of r rows of e elements, rows_per_rank = ceil(r / N) rounded up
// to a multiple of 16 / gcd(16, e) rows, so the piece is < numel / N +
// lcm(16, e). Returns sum over parameters of lcm(16, e) (the padding bound).
int64_t padding_bound(nn::Qwen3Model& m) {
  int64_t pad = 0;
  m.for_each_parameter([&](nn::Parameter& p) {
    const Shape& s = p.value.shape();
    const int64_t rows = s.rank() == 0 ? 1 : s[0];
    const int64_t e = rows > 0 ? s.numel() / rows : 0;
    if (e > 0) pad += std::lcm(parallel::kFlatShardAlign, e);
  });
  return pad;
}

}  // namespace

TEST_CASE("sharded reference model: logprobs equal the unsharded reference's, bytes fall as 1/N") {
  for (const bool moe : {false, true}) {
    const nn::Qwen3Config config = moe ? tiny_moe_config() : tiny_config();
    nn::Qwen3Model policy = random_model(config, 3);
    const int64_t numel = nn::num_parameters(policy);
    const int64_t pad = padding_bound(policy);
    rl::ReferenceModel<> plain(policy, {.update_every = 0, .offload = false});
    for (int ranks : {1, 2, 4}) {
      INFO((moe ? "MoE, " : "dense, ") << ranks << " ranks, " << numel << " parameters");
      std::vector<std::vector<float>> want;
      for (int r = 0; r < ranks; ++r) {
        const auto seqs = rank_sequences(r);
        want.push_back(plain.logprobs(nn::make_packed_batch(seqs), targets_of(seqs)).to_vector<float>());
      }
      std::vector<std::vector<float>> got(static_cast<std::size_t>(ranks)),
          got_offloaded(static_cast<std::size_t>(ranks));
      std::vector<int64_t> bytes(static_cast<std::size_t>(ranks)), freed(static_cast<std::size_t>(ranks)),
          pinned(static_cast<std::size_t>(ranks));
      std::vector<int> no_grads(std::size_t(ranks), 1), offloaded(std::size_t(ranks), 0);
      comm::run_local_ranks(ranks, [&](comm::Comm& comm) {
        const std::size_t r = std::size_t(comm.rank());
        const auto seqs = rank_sequences(comm.rank());
        const nn::PackedBatch batch = nn::make_packed_batch(seqs);
        const Tensor targets = targets_of(seqs);
        std::optional<rl::ShardedReferenceModel<>> ref;
        ref.emplace(random_model(config, 3), comm, rl::ReferenceModelConfig{.update_every = 0, .offload = true});
        offloaded[r] = ref->is_offloaded();
        const std::vector<nn::PackedBatch> batches = {batch};
        const std::vector<Tensor> targets_list = {targets};
        got_offloaded[r] = ref->logprobs(batches, targets_list)[0].to_vector<float>();  // onload, score, offload
        ref->onload();
        got[r] = ref->logprobs(batch, targets).to_vector<float>();
        ref->model().for_each_parameter([&](nn::Parameter& p) { no_grads[r] = no_grads[r] && !p.grad.defined(); });
        bytes[r] = int64_t(ref->parameter_bytes());
        // One rank at a time destroys its reference: the drop is what it held
        // (host) and what its offload buffers held (pinned).
        for (int q = 0; q < comm.size(); ++q) {
          comm.barrier();
          if (q == comm.rank()) {
            // The gather buffers its scoring reused (Sharded::cached_buffer_bytes) are not state.
            ref->sharded().release_buffers();
            const int64_t h0 = memory_stats(Device::cpu()).current_bytes, p0 = pinned_memory_stats().current_bytes;
            ref.reset();
            freed[r] = h0 - memory_stats(Device::cpu()).current_bytes;
            pinned[r] = p0 - pinned_memory_stats().current_bytes;
          }
          comm.barrier();
        }
      });
      for (int r = 0; r < ranks; ++r) {
        const std::size_t i = std::size_t(r);
        INFO("rank " << r << ": " << bytes[i] << " parameter bytes (unsharded " << 4 * numel
                     << ", / N = " << 4 * numel / ranks << ", padding bound " << 4 * pad << ")");
        CHECK(offloaded[i] == 1);
        CHECK(no_grads[i] == 1);
        CHECK(max_abs_diff(got[i], want[i]) <= 1e-6);
        CHECK(got_offloaded[i] == got[i]);
        if (ranks == 1) CHECK(got[i] == want[i]);
        // The master shards (f32 here) are all a rank holds: no gradient, no
        // optimizer state; the pinned copies of offload are the same size.
        CHECK(freed[i] == bytes[i]);
        CHECK(pinned[i] == bytes[i]);
        CHECK(double(bytes[i]) < 4.0 * (double(numel) / ranks + double(pad)));
      }
    }
  }
}

TEST_CASE("sharded reference model: update_from a trained Sharded policy, bitwise, also while offloaded") {
  for (int ranks : {1, 2}) {
    INFO(ranks << " ranks");
    std::vector<int> before(static_cast<std::size_t>(ranks)), stale(static_cast<std::size_t>(ranks)),
        updated(static_cast<std::size_t>(ranks)), skipped(static_cast<std::size_t>(ranks)),
        from_unwrapped(static_cast<std::size_t>(ranks));
    std::vector<std::string> bad_shape(static_cast<std::size_t>(ranks));
    comm::run_local_ranks(ranks, [&](comm::Comm& comm) {
      const std::size_t r = std::size_t(comm.rank());
      const auto seqs = rank_sequences(comm.rank());
      const nn::PackedBatch batch = nn::make_packed_batch(seqs);
      const Tensor targets = targets_of(seqs);
      parallel::Sharded<nn::Qwen3Model, parallel::NoShard> policy(random_model(tiny_config(), 5), comm);
      auto policy_lp = [&] {
        nn::Qwen3Model::Context ctx;
        const Tensor h = policy.forward(batch, ctx);
        return policy.token_logprobs(h, targets).logprobs.to_vector<float>();
      };
      rl::ShardedReferenceModel<> ref(random_model(tiny_config(), 5), comm, {.update_every = 2, .offload = true});
      const std::vector<nn::PackedBatch> batches = {batch};
      const std::vector<Tensor> targets_list = {targets};
      auto ref_lp = [&] { return ref.logprobs(batches, targets_list)[0].to_vector<float>(); };
      before[r] = ref_lp() == policy_lp();
      policy.zero_grad();
      policy.loss_and_backward(batch, targets);
      policy.optimizer_step(5e-2);
      const std::vector<float> trained = policy_lp();
      stale[r] = ref_lp() != trained;
      skipped[r] = !ref.maybe_update(1, policy) && ref_lp() != trained;
      updated[r] = ref.maybe_update(2, policy) && ref.is_offloaded() && ref_lp() == trained;
      // From an unwrapped model (local): back to the initial weights.
      nn::Qwen3Model initial = random_model(tiny_config(), 5);
      ref.update_from(initial);
      from_unwrapped[r] = ref_lp() == policy_logprobs(initial, batch, targets);
      nn::Qwen3Config wider = tiny_config();
      wider.intermediate_size = 32;
      nn::Qwen3Model other = random_model(wider, 1);
      bad_shape[r] = [&] {
        try {
          ref.update_from(other);
        } catch (const std::exception& e) {
          return std::string(e.what());
        }
        return std::string("(no error)");
      }();
    });
    for (int r = 0; r < ranks; ++r) {
      INFO("rank " << r);
      const std::size_t i = std::size_t(r);
      CHECK(before[i] == 1);
      CHECK(stale[i] == 1);
      CHECK(skipped[i] == 1);
      CHECK(updated[i] == 1);
      CHECK(from_unwrapped[i] == 1);
      CHECK_THAT(bad_shape[i], ContainsSubstring("in the policy"));
    }
  }
}

TEST_CASE("sharded reference model with ExpertParallel holds the policy's expert slice and scores as the policy") {
  const nn::Qwen3Config config = tiny_moe_config();
  std::vector<int> same_slice(2), same_before(2), same_after(2), expert_params(2);
  comm::run_local_ranks(2, [&](comm::Comm& world) {
    const std::size_t r = std::size_t(world.rank());
    const comm::Mesh mesh(world, comm::MeshShape{.dp_replicate = 1, .dp_shard = 1, .cp = 1, .ep = 2});
    parallel::ExpertParallel<> ep(mesh, config.num_experts);
    // This ep rank's slice of one full model, as the policy's module and the reference's.
    auto ep_model = [&] {
      nn::Qwen3Model full = random_model(config, 9);
      nn::Qwen3Model m(config, {}, &ep);
      std::vector<nn::Parameter*> src;
      full.for_each_parameter([&](nn::Parameter& p) { src.push_back(&p); });
      std::size_t i = 0;
      m.for_each_parameter([&](nn::Parameter& p) {
        const nn::Parameter& s = *src[i++];
        if (p.is_expert_stack()) {
          const int64_t per = p.value.numel() / p.value.size(0);
          p.value.copy_from(s.value.view(p.first_expert * per, p.value.shape()));
        } else {
          p.value.copy_from(s.value);
        }
      });
      return m;
    };
    parallel::Sharded<nn::Qwen3Model, parallel::FullShard> policy(ep_model(), mesh);
    rl::ShardedReferenceModel<> ref(ep_model(), mesh, {.update_every = 0, .offload = false});
    const auto seqs = rank_sequences(world.rank());
    const nn::PackedBatch batch = nn::make_packed_batch(seqs);
    const Tensor targets = targets_of(seqs);
    auto policy_lp = [&] {
      nn::Qwen3Model::Context ctx;
      const Tensor h = policy.forward(batch, ctx);
      return policy.token_logprobs(h, targets).logprobs.to_vector<float>();
    };
    int slice = 1, experts = 0;
    for (const std::string& name : policy.parameter_names()) {
      const bool expert = policy.is_expert_parameter(name);
      experts += expert;
      slice =
          slice && ref.sharded().is_expert_parameter(name) == expert &&
          ref.sharded().parameter_first_expert(name) == policy.parameter_first_expert(name) &&
          ref.sharded().parameter_shape(name) == policy.parameter_shape(name) &&
          ref.sharded().gather_parameter(name).to_vector<float>() == policy.gather_parameter(name).to_vector<float>();
    }
    same_slice[r] = slice;
    expert_params[r] = experts;
    same_before[r] = ref.logprobs(batch, targets).to_vector<float>() == policy_lp();
    policy.zero_grad();
    policy.loss_and_backward(batch, targets);
    policy.optimizer_step(5e-2);
    ref.update_from(policy);
    same_after[r] = ref.logprobs(batch, targets).to_vector<float>() == policy_lp();
  });
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    const std::size_t i = std::size_t(r);
    CHECK(expert_params[i] == 3);  // gate_up / down stacks of the one sparse layer
    CHECK(same_slice[i] == 1);
    CHECK(same_before[i] == 1);
    CHECK(same_after[i] == 1);
  }
}
