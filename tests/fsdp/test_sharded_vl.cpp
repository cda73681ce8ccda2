// Sharded<Qwen3VLModel, Strategy> on LocalComm: the vision tower's units and
// the language model's under one wrapper. With 1 to 3 ranks (FullShard,
// ShardGradOp, NoShard), dense and MoE, each rank a different mix of image
// and text-only samples (one rank has no image at all, so its tower units
// only run their hooks), the losses and the reduced gradients equal the
// unwrapped model's on all samples at once (bitwise at one rank, <= 1e-5
// relative otherwise), and an optimizer step runs. A frozen tower under an
// optimizer is refused with a clear error.
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "sharded_test_util.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/core/random.hpp"
#include "slime/nn/qwen3_vl.hpp"
#include "slime/parallel/sharded.hpp"
#include "thread_checks.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
using parallel::FullShard;
using parallel::NoShard;
using parallel::Sharded;
using parallel::ShardGradOp;
using slime_test::fsdp::Params;
using slime_test::fsdp::thread_checks;

namespace {

nn::Qwen3VLConfig vl_config(bool moe) {
  nn::Qwen3VLConfig c;
  c.model_type = moe ? "qwen3_vl_moe" : "qwen3_vl";
  c.text.model_type = moe ? "qwen3_vl_moe_text" : "qwen3_vl_text";
  c.text.vocab_size = 37;
  c.text.hidden_size = 16;
  c.text.intermediate_size = 20;
  c.text.num_hidden_layers = 2;
  c.text.num_attention_heads = 2;
  c.text.num_key_value_heads = 1;
  c.text.head_dim = 16;
  c.text.mrope_section = {3, 3, 2};
  if (moe) {
    c.text.num_experts = 3;
    c.text.num_experts_per_tok = 2;
    c.text.moe_intermediate_size = 8;
    c.text.norm_topk_prob = true;
  }
  c.vision.depth = 2;
  c.vision.hidden_size = 8;
  c.vision.intermediate_size = 12;
  c.vision.num_heads = 1;
  c.vision.in_channels = 1;
  c.vision.patch_size = 2;
  c.vision.temporal_patch_size = 1;
  c.vision.spatial_merge_size = 2;
  c.vision.out_hidden_size = 16;
  c.vision.num_position_embeddings = 4;
  c.vision.deepstack_visual_indexes = {0};
  c.image_token_id = 30;
  c.vision_start_token_id = 31;
  c.vision_end_token_id = 32;
  c.video_token_id = 33;
  c.validate();
  return c;
}

Tensor pixels(int64_t rows, int64_t width, uint64_t seed) {
  Tensor t = Tensor::empty({rows, width}, DType::f32);
  fill_normal(t, seed, 0, 0.f, 1.f);
  return t;
}

// Rank r's samples (of `world`): rank 0 one image and text, rank 1 two
// images in one sample, rank 2 text only.
std::vector<nn::VLSequence> samples_of(int rank, const nn::Qwen3VLConfig& c) {
  const int32_t img = c.image_token_id, s = c.vision_start_token_id, e = c.vision_end_token_id;
  const int64_t w = c.vision.patch_dim();
  std::vector<nn::VLSequence> out;
  if (rank == 0) {
    out.push_back({{4, 5, s, img, img, e, 6, 7}, {{1, 4, 2}}, pixels(8, w, 100)});
    out.push_back({{8, 9, 10}, {}, {}});
  } else if (rank == 1) {
    out.push_back({{s, img, e, 3, s, img, img, img, img, e, 2}, {{1, 2, 2}, {1, 4, 4}}, pixels(20, w, 200)});
  } else {
    out.push_back({{1, 2, 3, 4, 5, 6}, {}, {}});
    out.push_back({{11, 12}, {}, {}});
  }
  return out;
}

std::vector<int32_t> targets_of(const std::vector<nn::VLSequence>& seqs, int32_t vocab) {
  std::vector<int32_t> t;
  for (const auto& s : seqs)
    for (std::size_t i = 0; i < s.tokens.size(); ++i) t.push_back(int32_t((s.tokens[i] * 7 + int32_t(i)) % vocab));
  return t;
}

int64_t tokens_of(const std::vector<nn::VLSequence>& seqs) {
  int64_t n = 0;
  for (const auto& s : seqs) n += int64_t(s.tokens.size());
  return n;
}

nn::Qwen3VLModel make(const nn::Qwen3VLConfig& c) {
  nn::Qwen3VLModel m(c, {});
  m.init_random(17, 0.3f);
  return m;
}

// max |a - b| / max |b| (b all zero: max |a - b|).
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    d = std::max(d, double(std::abs(a[i] - b[i])));
    m = std::max(m, double(std::abs(b[i])));
  }
  return a.size() != b.size() ? 1e30 : (m > 0 ? d / m : d);
}

struct Result {
  double loss = 0;
  Params grads;
};

// The unwrapped model on every rank's samples in one batch.
Result reference(const nn::Qwen3VLConfig& c, int world) {
  std::vector<nn::VLSequence> all;
  for (int r = 0; r < world; ++r)
    for (auto& s : samples_of(r, c)) all.push_back(std::move(s));
  nn::Qwen3VLModel m = make(c);
  nn::zero_grad(m);
  const nn::VLBatch b = nn::make_vl_batch(all, c, Device::cpu(), DType::f32);
  const std::vector<int32_t> t = targets_of(all, int32_t(c.text.vocab_size));
  Result out;
  out.loss = m.loss_and_backward(b, Tensor::from_vector(t, {int64_t(t.size())})).loss;
  m.for_each_parameter([&](nn::Parameter& p) { out.grads[p.name] = p.grad.to_vector<float>(); });
  return out;
}

template <class S>
Result sharded(const nn::Qwen3VLConfig& c, int world) {
  int64_t total = 0;
  for (int r = 0; r < world; ++r) total += tokens_of(samples_of(r, c));
  Result out;
  std::mutex mutex;
  comm::run_local_ranks(world, [&](comm::Comm& w) {
    Sharded<nn::Qwen3VLModel, S> sh(make(c), w);
    TCHECK(sh.num_units() == sh.module().units().size());
    TCHECK(sh.unit_name(0) == "model.visual.patch_embed");
    sh.zero_grad();
    const std::vector<nn::VLSequence> mine = samples_of(w.rank(), c);
    const nn::VLBatch b = nn::make_vl_batch(mine, c, Device::cpu(), DType::f32);
    const std::vector<int32_t> t = targets_of(mine, int32_t(c.text.vocab_size));
    const double loss = sh.loss_and_backward(b, Tensor::from_vector(t, {int64_t(t.size())}), 1.f, double(total)).loss;
    // The loss over all ranks' tokens: each rank's share summed.
    Tensor l = Tensor::from_vector(std::vector<float>{float(loss)}, {1});
    w.all_reduce(l, comm::ReduceOp::sum);
    for (const std::string& name : sh.parameter_names()) {
      const std::vector<float> g = sh.gather_gradient(name).template to_vector<float>();
      if (w.rank() == 0) {
        std::lock_guard lock(mutex);
        out.grads[name] = g;
      }
    }
    if (w.rank() == 0) out.loss = double(l.to_vector<float>()[0]);
    sh.optimizer_step(1e-2);
  });
  thread_checks().require_none();
  return out;
}

template <class S>
void check(bool moe, int world) {
  INFO((moe ? "MoE" : "dense") << ", " << world << " rank(s)");
  const nn::Qwen3VLConfig c = vl_config(moe);
  const Result want = reference(c, world), got = sharded<S>(c, world);
  CHECK(std::abs(got.loss - want.loss) <= 1e-6 * std::abs(want.loss));
  REQUIRE(got.grads.size() == want.grads.size());
  double worst = 0;
  for (const auto& [name, g] : want.grads) {
    INFO(name);
    REQUIRE(got.grads.count(name) == 1);
    const double d = rel_diff(got.grads.at(name), g);
    worst = std::max(worst, d);
    if (world == 1) {
      CHECK(got.grads.at(name) == g);
    } else {
      CHECK(d <= 1e-5);
    }
  }
  std::printf("sharded vl %s world %d: worst gradient %.3g\n", moe ? "moe" : "dense", world, worst);
}

}  // namespace

TEMPLATE_TEST_CASE("Sharded<Qwen3VLModel> equals the unwrapped model (tower and language units, mixed batches)",
                   "[fsdp][vl]", FullShard, ShardGradOp, NoShard) {
  for (const bool moe : {false, true})
    for (const int world : {1, 2, 3}) check<TestType>(moe, world);
}

TEST_CASE("Sharded<Qwen3VLModel> refuses a frozen tower under an optimizer", "[fsdp][vl]") {
  const nn::Qwen3VLConfig c = vl_config(false);
  comm::run_local_ranks(1, [&](comm::Comm& w) {
    nn::Qwen3VLModel m = make(c);
    m.set_vision_trainable(false);
    bool threw = false;
    try {
      Sharded<nn::Qwen3VLModel, FullShard> sh(std::move(m), w);
    } catch (const Error& e) {
      threw = std::string(e.what()).find("is not trainable") != std::string::npos;
    }
    TCHECK(threw);
  });
  thread_checks().require_none();
}
