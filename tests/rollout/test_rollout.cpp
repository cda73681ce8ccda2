// The rollout engine on the CPU: the engine's logprobs equal the trainer's
// recompute bit for bit, generation does not depend on the batch it runs in,
// bad requests fail alone, the KV arena's allocator and layout, sampling.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "rollout_test_util.hpp"
#include "slime/core/memory.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/ops/index_rows.hpp"
#include "slime/rollout/engine.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
using rollout_test::require_same;
using rollout_test::same_bits;

namespace {

nn::Qwen3Config tiny_config() {
  nn::Qwen3Config c;
  c.vocab_size = 48;
  c.hidden_size = 32;
  c.intermediate_size = 40;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 100.0;
  c.max_position_embeddings = 64;
  return c;
}

nn::Qwen3Model tiny_model(uint64_t seed = 3) {
  nn::Qwen3Model m(tiny_config(), {});
  m.init_random(seed, 0.3f);  // large weights: peaked, varied distributions
  return m;
}

std::vector<int32_t> prompt_of(int64_t n, int32_t salt) {
  std::vector<int32_t> p;
  for (int64_t i = 0; i < n; ++i) p.push_back(int32_t((i * 7 + salt * 13 + 1) % 48));
  return p;
}

std::vector<rollout::Request> some_requests() {
  std::vector<rollout::Request> rs;
  const int64_t lens[] = {1, 5, 17, 3, 9, 2};
  for (int i = 0; i < 6; ++i) {
    rollout::Request r;
    r.prompt = prompt_of(lens[i], i);
    r.sample_id = uint64_t(100 + i);
    r.sampling.temperature = i == 3 ? 0.7f : 1.f;
    r.sampling.max_new_tokens = 6 + i;
    rs.push_back(r);
  }
  return rs;
}

nn::Qwen3Model tiny_moe_model(uint64_t seed = 4) {
  nn::Qwen3Config c = tiny_config();
  c.model_type = "qwen3_moe";
  c.num_experts = 6;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 12;
  c.mlp_only_layers = {0};  // layer 0 dense, layer 1 sparse
  nn::Qwen3Model m(c, {});
  m.init_random(seed, 0.3f);
  return m;
}

// The engine's logprobs against the trainer's recompute over the packed
// prompts + completions, bit for bit.
void check_on_policy(nn::Qwen3Model& model) {
  rollout::Engine engine(model, {.max_batch = 4, .max_context = 40, .kv_capacity = 0, .seed = 11});
  const auto requests = some_requests();
  const auto out = engine.generate(requests);
  // The trainer: every prompt + completion packed into one batch.
  std::vector<std::vector<int32_t>> seqs;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    REQUIRE(out[i].finish == rollout::FinishReason::length);
    REQUIRE(out[i].tokens.size() == std::size_t(requests[i].sampling.max_new_tokens));
    std::vector<int32_t> s = requests[i].prompt;
    s.insert(s.end(), out[i].tokens.begin(), out[i].tokens.end() - 1);  // the last token is never an input
    seqs.push_back(s);
  }
  for (float temperature : {1.f, 0.7f}) {
    nn::PackedBatch batch = nn::make_packed_batch(seqs);
    nn::Qwen3Model::Context ctx;
    const Tensor hidden = model.forward(batch, ctx);
    const std::vector<int32_t> targets = rollout_test::next_token_targets(requests, out);
    const auto lp =
        model.token_logprobs(hidden, Tensor::from_vector(targets, {int64_t(targets.size())}), temperature).logprobs;
    const auto v = lp.to_vector<float>();
    int64_t compared = 0;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      if (requests[i].sampling.temperature != temperature) continue;
      const int64_t first = batch.cu_seqlens_host[i] + int64_t(requests[i].prompt.size()) - 1;
      for (std::size_t j = 0; j < out[i].tokens.size(); ++j) {
        INFO("request " << i << " token " << j);
        CHECK(same_bits(v[std::size_t(first) + j], out[i].logprobs[j]));
        ++compared;
      }
    }
    CHECK(compared > 0);
  }
}

}  // namespace

TEST_CASE("engine logprobs equal the trainer's recompute bit for bit on the CPU", "[rollout]") {
  nn::Qwen3Model model = tiny_model();
  check_on_policy(model);
}

TEST_CASE("the same holds for a Qwen3-MoE model (a dense and a sparse layer)", "[rollout][moe]") {
  nn::Qwen3Model model = tiny_moe_model();
  REQUIRE(model.layers()[1].is_sparse());
  REQUIRE_FALSE(model.layers()[0].is_sparse());
  check_on_policy(model);
}

TEST_CASE("the engine records each input token's experts: the trainer's routing, and its replay is on-policy",
          "[rollout][moe][replay]") {
  nn::Qwen3Model model = tiny_moe_model();
  const std::vector<int> sparse = model.sparse_layers();
  REQUIRE(sparse == std::vector<int>{1});
  const int64_t k = model.config().num_experts_per_tok, L = int64_t(sparse.size());
  rollout::EngineConfig cfg{.max_batch = 4, .max_context = 40, .kv_capacity = 0, .seed = 11};
  cfg.record_routing = true;
  rollout::Engine engine(model, cfg);
  const auto requests = some_requests();
  const auto out = engine.generate(requests);
  std::vector<std::vector<int32_t>> seqs;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    std::vector<int32_t> s = requests[i].prompt;
    s.insert(s.end(), out[i].tokens.begin(), out[i].tokens.end() - 1);
    REQUIRE(out[i].routing.size() == s.size() * std::size_t(L * k));
    seqs.push_back(s);
  }
  // The trainer's own routing over prompt + completion (but the last token)
  // equals the engine's, row for row (the CPU computes both bit for bit).
  const nn::PackedBatch batch = nn::make_packed_batch(seqs);
  nn::Qwen3Model::Context rec;
  rec.record_routing = true;
  const Tensor hidden = model.forward(batch, rec).clone();
  const std::vector<int32_t> trainer = rec.routing[std::size_t(sparse[0])].to_vector<int32_t>();
  std::vector<int32_t> engine_rows;  // [T, k] in the packed batch's order (one sparse layer)
  for (std::size_t i = 0; i < seqs.size(); ++i)
    engine_rows.insert(engine_rows.end(), out[i].routing.begin(), out[i].routing.end());
  CHECK(engine_rows == trainer);
  // Replaying the engine's routing gives the trainer the engine's logprobs.
  nn::Qwen3Model::Context replay;
  replay.routing_replay.resize(model.layers().size());
  replay.routing_replay[std::size_t(sparse[0])] = Tensor::from_vector(engine_rows, {batch.num_tokens(), k});
  const Tensor replayed = model.forward(batch, replay);
  CHECK(std::memcmp(replayed.data_ptr(), hidden.data_ptr(), hidden.nbytes()) == 0);
  // Without record_routing (and for dense models) the field stays empty.
  rollout::Engine plain(model, {.max_batch = 4, .max_context = 40, .kv_capacity = 0, .seed = 11});
  for (const rollout::Completion& c : plain.generate(requests)) CHECK(c.routing.empty());
}

TEST_CASE("a completion does not depend on the batch it runs in", "[rollout]") {
  nn::Qwen3Model model = tiny_model();
  const auto requests = some_requests();
  rollout::Engine wide(model, {.max_batch = 8, .max_context = 40, .kv_capacity = 0, .seed = 5});
  const auto all = wide.generate(requests);
  // One at a time.
  std::vector<rollout::Completion> alone;
  for (const auto& r : requests) alone.push_back(wide.generate({r})[0]);
  require_same(all, alone);
  // Two running at once (continuous batching: the others wait and join), and
  // a KV arena so small that sequences also wait for rows.
  rollout::Engine narrow(model, {.max_batch = 2, .max_context = 40, .kv_capacity = 30, .seed = 5});
  require_same(all, narrow.generate(requests));
  // The reverse order gives the same per-request results.
  std::vector<rollout::Request> reversed(requests.rbegin(), requests.rend());
  auto rev = wide.generate(reversed);
  std::reverse(rev.begin(), rev.end());
  require_same(all, rev);
}

// Issue 19: decode runs (EngineConfig::decode_steps: several steps per read
// of the host) give the completions of one step at a time, bit for bit:
// stop tokens inside a run, different lengths, the context's end, requests
// waiting for a slot, greedy and sampled rows; a request at another
// temperature makes its batch take single steps.
TEST_CASE("decode runs of several steps equal one step at a time", "[rollout]") {
  for (const bool moe : {false, true}) {
    INFO((moe ? "Qwen3-MoE" : "dense Qwen3"));
    nn::Qwen3Model model = moe ? tiny_moe_model() : tiny_model();
    std::vector<rollout::Request> rs;
    for (int i = 0; i < 7; ++i) {
      rollout::Request r;
      r.prompt = prompt_of(2 + 3 * i, i);
      r.sample_id = uint64_t(40 + i);
      r.sampling.temperature = i % 3 == 0 ? 0.f : 1.f;
      r.sampling.max_new_tokens = 5 + 4 * i;
      if (i % 2 == 1) r.sampling.stop_tokens = {int32_t(i), int32_t(7 + i), 30};
      rs.push_back(r);
    }
    auto run = [&](int64_t decode_steps, int64_t max_batch) {
      rollout::Engine e(model, {.max_batch = max_batch,
                                .max_context = 30,
                                .kv_capacity = 0,
                                .seed = 9,
                                .record_routing = false,
                                .decode_steps = decode_steps});
      auto out = e.generate(rs);
      return std::make_pair(out, e.stats());
    };
    const auto [one, one_stats] = run(1, 3);
    CHECK(one_stats.decode_runs == 0);
    int stopped = 0, at_context = 0;
    for (std::size_t i = 0; i < rs.size(); ++i) {
      stopped += one[i].finish == rollout::FinishReason::stop;
      at_context += int64_t(rs[i].prompt.size() + one[i].tokens.size()) == 30;
    }
    CHECK(stopped > 0);     // some stop tokens were sampled
    CHECK(at_context > 0);  // and some sequences ran into the context's end
    for (int64_t steps : {2, 3, 8, 64}) {
      for (int64_t max_batch : {3, 8}) {
        INFO("decode_steps " << steps << ", max_batch " << max_batch);
        const auto [many, stats] = run(steps, max_batch);
        require_same(one, many);
        CHECK(stats.decode_runs > 0);
        CHECK(stats.decode_run_steps > stats.decode_runs);
        CHECK(stats.steps + stats.decode_runs < one_stats.steps);  // fewer reads of the host
      }
    }
    // A second temperature in the batch: single steps while it runs beside
    // the others (the longest, it ends alone, in runs), the same completions.
    const auto [same_temperature, same_stats] = run(8, 8);
    rs[2].sampling.temperature = 0.7f;
    rs[2].sampling.max_new_tokens = 100;
    const auto [mixed_one, mixed_one_stats] = run(1, 8);
    const auto [mixed, mixed_stats] = run(8, 8);
    require_same(mixed_one, mixed);
    CHECK(mixed_stats.steps > same_stats.steps);
    CHECK(mixed[2].tokens.size() == 22);  // to the context's end, past every other request
    REQUIRE_THROWS_WITH(rollout::Engine(model, {.max_batch = 2, .decode_steps = 0}),
                        ContainsSubstring("decode_steps must be >= 1"));
  }
}

TEST_CASE("the seed keys the samples", "[rollout]") {
  nn::Qwen3Model model = tiny_model();
  const auto requests = some_requests();
  rollout::Engine a(model, {.max_batch = 8, .max_context = 40, .kv_capacity = 0, .seed = 1});
  rollout::Engine b(model, {.max_batch = 8, .max_context = 40, .kv_capacity = 0, .seed = 2});
  const auto x = a.generate(requests), y = a.generate(requests), z = b.generate(requests);
  require_same(x, y);
  int differ = 0;
  for (std::size_t i = 0; i < x.size(); ++i) differ += x[i].tokens != z[i].tokens;
  CHECK(differ > 0);
}

TEST_CASE("greedy decoding, stop tokens and the context limit", "[rollout]") {
  nn::Qwen3Model model = tiny_model();
  rollout::Engine engine(model, {.max_batch = 4, .max_context = 12, .kv_capacity = 0, .seed = 0});
  rollout::Request r;
  r.prompt = prompt_of(4, 1);
  r.sampling.temperature = 0.f;
  r.sampling.max_new_tokens = 5;
  const auto greedy = engine.generate({r})[0];
  REQUIRE(greedy.tokens.size() == 5);
  // Greedy = the argmax of the trainer's logits at every step.
  for (std::size_t j = 0; j < greedy.tokens.size(); ++j) {
    std::vector<int32_t> seq = r.prompt;
    seq.insert(seq.end(), greedy.tokens.begin(), greedy.tokens.begin() + int64_t(j));
    nn::Qwen3Model::Context ctx;
    const auto logits = model.logits(model.forward(nn::make_packed_batch({seq}), ctx)).to_vector<float>();
    const float* last = logits.data() + (seq.size() - 1) * 48;
    CHECK(std::max_element(last, last + 48) - last == greedy.tokens[j]);
  }
  // Stopping at the third token keeps it and reports `stop`.
  rollout::Request s = r;
  s.sampling.stop_tokens = {greedy.tokens[2]};
  const auto stopped = engine.generate({s})[0];
  CHECK(stopped.finish == rollout::FinishReason::stop);
  const auto first_stop = std::find(greedy.tokens.begin(), greedy.tokens.end(), greedy.tokens[2]);
  CHECK(stopped.tokens == std::vector<int32_t>(greedy.tokens.begin(), first_stop + 1));
  // A long request ends at the context (12 = 4 prompt + 8 generated).
  rollout::Request l = r;
  l.sampling.max_new_tokens = 100;
  const auto limited = engine.generate({l})[0];
  CHECK(limited.finish == rollout::FinishReason::length);
  CHECK(limited.tokens.size() == 8);
}

TEST_CASE("bad requests fail alone with a clear reason", "[rollout]") {
  nn::Qwen3Model model = tiny_model();
  rollout::Engine engine(model, {.max_batch = 4, .max_context = 20, .kv_capacity = 0, .seed = 9});
  auto good = some_requests();
  good.resize(3);
  for (auto& g : good) g.sampling.max_new_tokens = 4;
  const auto alone = engine.generate(good);
  std::vector<rollout::Request> mixed;
  rollout::Request empty;
  empty.sample_id = 1;
  rollout::Request too_long;
  too_long.prompt = prompt_of(20, 2);
  rollout::Request zero_new;
  zero_new.prompt = {1, 2};
  zero_new.sampling.max_new_tokens = 0;
  rollout::Request oov;
  oov.prompt = {1, 48};
  mixed = {empty, good[0], too_long, good[1], zero_new, oov, good[2]};
  const auto out = engine.generate(mixed);
  CHECK(out[0].finish == rollout::FinishReason::error);
  CHECK_THAT(out[0].error, ContainsSubstring("empty prompt"));
  CHECK_THAT(out[2].error, ContainsSubstring("no room"));
  CHECK_THAT(out[4].error, ContainsSubstring("max_new_tokens"));
  CHECK_THAT(out[5].error, ContainsSubstring("outside the vocabulary"));
  for (int i : {0, 2, 4, 5}) CHECK(out[std::size_t(i)].tokens.empty());
  require_same(alone, {out[1], out[3], out[6]});
  // A sequence larger than the whole arena fails; the others run.
  rollout::Engine small(model, {.max_batch = 4, .max_context = 20, .kv_capacity = 6, .seed = 9});
  rollout::Request big;
  big.prompt = prompt_of(5, 3);
  big.sampling.max_new_tokens = 4;
  rollout::Request fits = big;
  fits.prompt = {3};
  const auto r = small.generate({big, fits});
  CHECK_THAT(r[0].error, ContainsSubstring("more than the arena"));
  CHECK(r[1].tokens.size() == 4);
  CHECK_THROWS_WITH(rollout::Engine(model, {.max_batch = 0}), ContainsSubstring("max_batch"));
}

TEST_CASE("region allocator: first fit, release merges neighbours, misuse is an error", "[rollout]") {
  rollout::RegionAllocator a(10);
  CHECK(a.allocate(4) == 0);
  CHECK(a.allocate(3) == 4);
  CHECK(a.allocate(4) == std::nullopt);
  CHECK(a.allocate(3) == 7);
  a.release(4, 3);
  CHECK(a.free_rows() == 3);
  CHECK(a.allocate(2) == 4);
  a.release(0, 4);
  a.release(7, 3);
  a.release(4, 2);
  CHECK(a.free_rows() == 10);
  CHECK(a.allocate(10) == 0);  // merged back into one range
  a.release(0, 10);
  CHECK_THROWS_WITH(a.release(2, 3), ContainsSubstring("released twice"));
  CHECK_THROWS_WITH(a.release(8, 5), ContainsSubstring("outside"));
}

TEST_CASE("arena layout: gaps become sequences without queries", "[rollout]") {
  const auto l = rollout::arena_layout({{2, 3, 1}, {10, 0, 4}}, 20);
  CHECK(l.cu_q == std::vector<int32_t>{0, 0, 1, 1, 5, 5});
  CHECK(l.cu_k == std::vector<int32_t>{0, 2, 6, 10, 14, 20});
  CHECK(l.write_rows == std::vector<int32_t>{5, 10, 11, 12, 13});
  CHECK(l.max_q == 4);
  CHECK(l.max_k == 6);
  CHECK_THROWS_WITH(rollout::arena_layout({{4, 0, 2}, {5, 0, 1}}, 20), ContainsSubstring("overlap"));
  CHECK_THROWS_WITH(rollout::arena_layout({{18, 1, 2}}, 20), ContainsSubstring("capacity"));
}

TEST_CASE("sampling: greedy, top-k 1, tiny top-p, and the distribution", "[rollout]") {
  const std::vector<float> z = {0.1f, 2.0f, -1.0f, 1.5f, 2.0f, 0.f};
  std::vector<int32_t> scratch;
  rollout::SamplingParams g;
  g.temperature = 0.f;
  CHECK(rollout::sample_token(z.data(), 6, g, 0, 0, 0, scratch) == 1);  // ties: the lower id
  rollout::SamplingParams k1;
  k1.top_k = 1;
  rollout::SamplingParams p0;
  p0.top_p = 1e-6f;
  for (uint64_t id = 0; id < 50; ++id) {
    CHECK(rollout::sample_token(z.data(), 6, k1, 3, id, 0, scratch) == 1);
    CHECK(rollout::sample_token(z.data(), 6, p0, 3, id, 0, scratch) == 1);
  }
  // Frequencies over many sample ids match softmax(z / 0.8) within 5 sigma;
  // top_k = 2 keeps only the two largest (ids 1 and 4, equal mass).
  rollout::SamplingParams t;
  t.temperature = 0.8f;
  rollout::SamplingParams k2 = t;
  k2.top_k = 2;
  const int n = 20000;
  std::vector<int> count(6, 0), count2(6, 0);
  for (int id = 0; id < n; ++id) {
    ++count[std::size_t(rollout::sample_token(z.data(), 6, t, 7, uint64_t(id), 3, scratch))];
    ++count2[std::size_t(rollout::sample_token(z.data(), 6, k2, 7, uint64_t(id), 3, scratch))];
  }
  double total = 0;
  for (float v : z) total += std::exp(double(v) / 0.8);
  for (int v = 0; v < 6; ++v) {
    const double p = std::exp(double(z[std::size_t(v)]) / 0.8) / total;
    CHECK(std::abs(count[std::size_t(v)] - n * p) < 5 * std::sqrt(n * p * (1 - p)) + 1);
  }
  CHECK(count2[0] + count2[2] + count2[3] + count2[5] == 0);
  CHECK(std::abs(count2[1] - n / 2) < 5 * std::sqrt(n * 0.25));
  rollout::SamplingParams bad;
  bad.top_p = 0.f;
  CHECK_THROWS_WITH(bad.validate("x"), ContainsSubstring("top_p"));
}

TEST_CASE("gather_rows and scatter_rows move rows and reject bad indices", "[rollout][ops]") {
  const Tensor src = Tensor::from_vector(std::vector<float>{0, 1, 2, 3, 4, 5}, {3, 2});
  Tensor dst = Tensor::zeros({2, 2}, DType::f32);
  ops::gather_rows(src, Tensor::from_vector(std::vector<int32_t>{2, 0}, {2}), dst);
  CHECK(dst.to_vector<float>() == std::vector<float>{4, 5, 0, 1});
  Tensor big = Tensor::zeros({4, 2}, DType::f32);
  ops::scatter_rows(src, Tensor::from_vector(std::vector<int32_t>{3, 0, 1}, {3}), big);
  CHECK(big.to_vector<float>() == std::vector<float>{2, 3, 4, 5, 0, 0, 0, 1});
  CHECK_THROWS_WITH(ops::gather_rows(src, Tensor::from_vector(std::vector<int32_t>{3, 0}, {2}), dst),
                    ContainsSubstring("outside [0, 3)"));
  CHECK_THROWS_WITH(ops::scatter_rows(src, Tensor::from_vector(std::vector<int32_t>{1, 1, 0}, {3}), big),
                    ContainsSubstring("repeats"));
  CHECK_THROWS_WITH(ops::gather_rows(src, Tensor::from_vector(std::vector<int32_t>{0}, {1}), dst),
                    ContainsSubstring("rows"));
}

// Issue 19: a decode step reuses the engine's buffers (the model's Context,
// the step's uploads, the last rows, logits and logprobs), so the steps after
// the first allocate nothing: generating 8 more tokens for the same batch
// costs no allocation more. Greedy and sampled rows, dense and MoE.
TEST_CASE("a decode step allocates nothing once the engine's buffers are sized", "[rollout][memory]") {
  for (const bool moe : {false, true}) {
    INFO((moe ? "Qwen3-MoE" : "dense Qwen3"));
    nn::Qwen3Model model = moe ? tiny_moe_model() : tiny_model();
    rollout::Engine engine(model, {.max_batch = 4, .max_context = 40, .kv_capacity = 0, .seed = 11});
    auto requests_of = [](int64_t new_tokens) {
      std::vector<rollout::Request> rs;
      for (int i = 0; i < 4; ++i) {
        rollout::Request r;
        r.prompt = prompt_of(3 + i, i);
        r.sample_id = uint64_t(i);
        r.sampling.temperature = i == 0 ? 0.f : 1.f;
        r.sampling.max_new_tokens = new_tokens;
        rs.push_back(r);
      }
      return rs;
    };
    const auto short_requests = requests_of(8), long_requests = requests_of(16);
    engine.generate(long_requests);  // sizes the buffers
    const auto allocations = [&](const std::vector<rollout::Request>& rs) {
      const int64_t before = memory_stats(Device::cpu()).allocations;
      const auto out = engine.generate(rs);
      const int64_t n = memory_stats(Device::cpu()).allocations - before;
      for (const auto& c : out) REQUIRE(c.tokens.size() == std::size_t(rs[0].sampling.max_new_tokens));
      return n;
    };
    const int64_t a8 = allocations(short_requests), a16 = allocations(long_requests);
    INFO("generate: " << a8 << " allocations for 8 tokens, " << a16 << " for 16");
    CHECK(a16 - a8 == 0);
  }
}
