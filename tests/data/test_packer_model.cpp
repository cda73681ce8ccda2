// The Packer end to end with the dense model: a masked next-token loss over
// packed, budget-limited micro-batches gives the same loss, per-token
// logprobs and parameter gradients as running every sample alone.
#include <catch2/catch_test_macros.hpp>

#include <cmath>
#include <vector>

#include "slime/core/random.hpp"
#include "slime/data/packer.hpp"
#include "slime/nn/qwen3.hpp"

using namespace slime;

namespace {

constexpr int kVocab = 50;

nn::Qwen3Model tiny_model() {
  nn::Qwen3Config c;
  c.vocab_size = kVocab;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 1000.0;
  nn::Qwen3Model m(c, {});
  m.init_random(7, 0.2f);
  return m;
}

// Samples with prompt and response parts and a partial response mask, drawn
// from Philox so the test is reproducible.
std::vector<data::Sample> make_samples(int n) {
  std::vector<data::Sample> out;
  uint64_t k = 0;
  for (int i = 0; i < n; ++i) {
    data::Sample s;
    const int len = 2 + int(philox_word(11, k++) % 23);
    for (int t = 0; t < len; ++t) s.tokens.push_back(int32_t(philox_word(12, k++) % kVocab));
    s.response_length = 1 + int32_t(philox_word(13, k++) % uint32_t(len - 1));
    for (int t = 0; t < s.response_length; ++t) s.loss_mask.push_back(uint8_t(philox_word(14, k++) % 4 != 0));
    out.push_back(std::move(s));
  }
  return out;
}

struct Result {
  double loss = 0;
  std::vector<std::vector<float>> logprobs;  // per sample, per token
  std::vector<std::vector<double>> grads;    // per parameter
};

// Runs the masked loss L = -sum over trained tokens of log p(next token) /
// normalizer on one packed micro-batch and accumulates the gradients. The
// target of token t is token t + 1 of its own sequence; the last token of a
// sequence (and padding) has no target and mask 0.
double run_micro_batch(nn::Qwen3Model& model, const data::MicroBatch& mb, double normalizer,
                       std::vector<std::vector<float>>& per_sample_logprobs) {
  const int64_t T = mb.num_tokens();
  std::vector<int32_t> targets(std::size_t(T), 0);
  std::vector<float> grad(std::size_t(T), 0.f);
  for (int q = 0; q < mb.num_sequences(); ++q) {
    const int32_t begin = mb.cu_seqlens[std::size_t(q)], len = mb.lengths[std::size_t(q)];
    for (int32_t t = begin; t + 1 < begin + len; ++t) {
      targets[std::size_t(t)] = mb.tokens[std::size_t(t + 1)];
      // The mask of token t + 1 decides whether predicting it is trained.
      if (mb.loss_mask[std::size_t(t + 1)]) grad[std::size_t(t)] = float(-1.0 / normalizer);
    }
  }
  nn::PackedBatch batch;
  const data::MicroBatchTensors mt = mb.to_tensors();
  batch.tokens = mt.tokens;
  batch.positions = mt.positions;
  batch.cu_seqlens = mt.cu_seqlens;
  batch.cu_seqlens_host = mb.cu_seqlens;
  batch.max_seqlen = mb.max_seqlen;
  const Tensor target_t = Tensor::from_vector(targets, {T});
  nn::Qwen3Model::Context ctx;
  const Tensor hidden = model.forward(batch, ctx);
  const ops::TokenLogprobs lp = model.token_logprobs(hidden, target_t, 1.f);
  const Tensor d_hidden =
      model.token_logprobs_backward(hidden, target_t, 1.f, lp, Tensor::from_vector(grad, {T}), Tensor{});
  model.backward(ctx, d_hidden);
  const std::vector<float> values = lp.logprobs.to_vector<float>();
  double loss = 0;
  for (int64_t t = 0; t < T; ++t)
    if (grad[std::size_t(t)] != 0.f) loss -= double(values[std::size_t(t)]) / normalizer;
  data::unpack<float>(mb, values, per_sample_logprobs);
  return loss;
}

Result run(nn::Qwen3Model& model, const std::vector<data::Sample>& samples, const data::PackConfig& config) {
  // The normalizer: trained response tokens over the whole batch (each has a
  // predecessor that predicts it, since every prompt has at least one token).
  double trained = 0;
  for (const auto& s : samples)
    for (uint8_t m : s.loss_mask) trained += m;
  nn::zero_grad(model);
  Result r;
  r.logprobs.resize(samples.size());
  const data::Packer packer(config);
  const data::PackPlan plan = packer.plan(samples);
  for (std::size_t step = 0; step < plan.steps.size(); ++step)
    for (std::size_t rank = 0; rank < plan.steps[step].ranks.size(); ++rank)
      for (const data::MicroBatch& mb : packer.pack_rank(plan, int(step), int(rank), samples))
        r.loss += run_micro_batch(model, mb, trained, r.logprobs);
  model.for_each_parameter([&](nn::Parameter& p) {
    const std::vector<float> g = p.grad.to_vector<float>();
    r.grads.emplace_back(g.begin(), g.end());
  });
  return r;
}

double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace

TEST_CASE("packed micro-batches give the loss and gradients of one-sample batches", "[data][packer][nn]") {
  nn::Qwen3Model model = tiny_model();
  const std::vector<data::Sample> samples = make_samples(13);

  data::PackConfig one_each;
  one_each.micro_batch_size = 1;
  one_each.balance_dp = false;
  const Result alone = run(model, samples, one_each);

  data::PackConfig packed;
  packed.max_tokens_per_gpu = 48;  // several micro-batches, each holding several samples
  packed.dp_size = 2;              // both ranks' micro-batches summed, as a data-parallel reduce would
  packed.pad_sequence_to = 4;      // alignment padding must not change the result
  const Result together = run(model, samples, packed);

  const data::PackPlan plan = data::Packer(packed).plan(samples);
  REQUIRE(plan.stats.micro_batches > 2);
  REQUIRE(plan.stats.padding_tokens > 0);
  INFO("micro-batches " << plan.stats.micro_batches << ", padding " << plan.stats.padding_tokens);

  CHECK(std::abs(together.loss - alone.loss) <= 1e-6 * std::abs(alone.loss));
  REQUIRE(together.logprobs.size() == samples.size());
  for (std::size_t i = 0; i < samples.size(); ++i) {
    REQUIRE(together.logprobs[i].size() == samples[i].tokens.size());
    for (std::size_t t = 0; t + 1 < samples[i].tokens.size(); ++t)
      CHECK(std::abs(together.logprobs[i][t] - alone.logprobs[i][t]) <= 1e-5f);
  }
  REQUIRE(together.grads.size() == alone.grads.size());
  for (std::size_t p = 0; p < alone.grads.size(); ++p) {
    INFO("parameter " << p);
    CHECK(rel_error(together.grads[p], alone.grads[p]) <= 1e-5);
  }
}
