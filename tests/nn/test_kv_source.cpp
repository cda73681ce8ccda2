// The K/V source policy (nn/kv_source.hpp) on the CPU. Qwen3Model::forward
// with CachedKv over a prefix, then a new chunk, then one token at a time
// (the rollout engine's prefill and decode) gives the hidden states of
// SelfKv over the whole sequences bit for bit, for a dense and a MoE model:
// every CPU op computes each row independently of the others, and the
// attention reads the same keys (from the cache) in the same order. The
// cache holds SelfKv's keys and values at the write rows; rows outside the
// sequences' keys (filled with NaN) are never read. A cached forward keeps
// one layer context and refuses backward; bad cache arguments fail clearly.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "slime/nn/kv_source.hpp"
#include "slime/nn/qwen3.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;

namespace {

nn::Qwen3Config config(bool moe) {
  nn::Qwen3Config c;
  c.vocab_size = 40;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 100.0;
  c.max_position_embeddings = 32;
  if (moe) {
    c.model_type = "qwen3_moe";
    c.num_experts = 5;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 12;
    c.mlp_only_layers = {1};  // layers 0 and 2 sparse, layer 1 dense
  }
  return c;
}

nn::Qwen3Model model_of(bool moe) {
  nn::Qwen3Model m(config(moe), {});
  m.init_random(21, 0.3f);
  return m;
}

const std::vector<std::vector<int32_t>> kSeqs = {
    {3, 17, 5, 22, 9, 1, 30, 8, 12}, {11, 2, 39, 4, 6, 27}, {7, 7, 19, 33}};

// Per layer K and V caches of `rows` rows, NaN everywhere (a row read
// before it is written poisons the outputs); sequence i owns the rows from
// start[i] on, with gaps between the regions.
struct Cache {
  std::vector<Tensor> k, v;
  std::vector<int64_t> start;
  int64_t rows = 0;
};

Cache make_cache(const nn::Qwen3Config& c, std::vector<int64_t> start, int64_t rows) {
  Cache cache;
  cache.start = std::move(start);
  cache.rows = rows;
  const std::vector<float> nan(std::size_t(rows * c.num_key_value_heads * c.head_dim),
                               std::numeric_limits<float>::quiet_NaN());
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    cache.k.push_back(Tensor::from_vector(nan, {rows, c.num_key_value_heads, c.head_dim}));
    cache.v.push_back(Tensor::from_vector(nan, {rows, c.num_key_value_heads, c.head_dim}));
  }
  return cache;
}

struct Step {
  nn::PackedBatch batch;
  nn::CachedKv kv;
};

// One cached step: sequence i appends its tokens [from[i], to[i]) (none when
// equal). Cache sequences: the gap before each region (no queries), the
// region's rows [start, start + to[i]) with to[i] - from[i] queries, the tail.
Step cached_step(const Cache& cache, const std::vector<int64_t>& from, const std::vector<int64_t>& to) {
  std::vector<int32_t> tokens, positions, cu_q{0}, cu_k{0}, write_rows;
  int max_q = 0, max_k = 0;
  int64_t cursor = 0;
  auto push = [&](int64_t nq, int64_t nk) {
    cu_q.push_back(cu_q.back() + int32_t(nq));
    cu_k.push_back(cu_k.back() + int32_t(nk));
    max_q = std::max(max_q, int(nq));
    max_k = std::max(max_k, int(nk));
    cursor += nk;
  };
  for (std::size_t i = 0; i < kSeqs.size(); ++i) {
    const int64_t s = cache.start[i];
    if (s > cursor) push(0, s - cursor);
    for (int64_t j = from[i]; j < to[i]; ++j) {
      tokens.push_back(kSeqs[i][std::size_t(j)]);
      positions.push_back(int32_t(j));
      write_rows.push_back(int32_t(s + j));
    }
    push(to[i] - from[i], to[i]);
  }
  push(0, cache.rows - cursor);
  Step st;
  const int64_t T = int64_t(tokens.size());
  st.batch.tokens = Tensor::from_vector(tokens, {T});
  st.batch.positions = Tensor::from_vector(positions, {T});
  st.batch.cu_seqlens_host = cu_q;
  st.batch.cu_seqlens = Tensor::from_vector(cu_q, {int64_t(cu_q.size())});
  st.batch.max_seqlen = max_q;
  st.kv.k = cache.k;
  st.kv.v = cache.v;
  st.kv.write_rows = Tensor::from_vector(write_rows, {T});
  st.kv.cu_seqlens_k = Tensor::from_vector(cu_k, {int64_t(cu_k.size())});
  st.kv.max_seqlen_k = max_k;
  return st;
}

// Rows [r, r + n) of a 2-d or 3-d f32 tensor a and [s, s + n) of b hold the same bits.
bool same_rows(const Tensor& a, int64_t r, const Tensor& b, int64_t s, int64_t n) {
  const int64_t w = a.numel() / a.size(0);
  REQUIRE(w == b.numel() / b.size(0));
  const std::vector<float> x = a.to_vector<float>(), y = b.to_vector<float>();
  return std::memcmp(x.data() + r * w, y.data() + s * w, std::size_t(n * w) * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("CachedKv over a prefix, a chunk and single tokens equals SelfKv over the whole sequences, bit for bit",
          "[nn][kv]") {
  for (bool moe : {false, true}) {
    DYNAMIC_SECTION((moe ? "qwen3_moe" : "qwen3")) {
      nn::Qwen3Model model = model_of(moe);
      REQUIRE(model.sparse_layers().size() == (moe ? 2u : 0u));
      const nn::PackedBatch whole = nn::make_packed_batch(kSeqs);
      nn::Qwen3Model::Context full;
      const Tensor want = model.forward(whole, full);  // SelfKv, the default
      CHECK(full.differentiable);
      CHECK(full.layers.size() == 3);

      // Regions at rows 2, 13 and 21 of 29: gaps before, between and after.
      Cache cache = make_cache(model.config(), {2, 13, 21}, 29);
      // Cut points per sequence: a prefix (sequence 2 not started yet), a
      // chunk (sequence 2's whole prompt), then one token at a time.
      const std::vector<std::vector<int64_t>> cuts = {{0, 5, 7, 8, 9}, {0, 2, 6, 6, 6}, {0, 0, 3, 4, 4}};
      int64_t compared = 0;
      for (std::size_t step = 0; step + 1 < cuts[0].size(); ++step) {
        std::vector<int64_t> from, to;
        for (const auto& c : cuts) {
          from.push_back(c[step]);
          to.push_back(c[step + 1]);
        }
        const Step st = cached_step(cache, from, to);
        nn::Qwen3Model::Context ctx;
        nn::NoHooks hooks;
        const Tensor got = model.forward(st.batch, ctx, {}, hooks, st.kv);
        CHECK_FALSE(ctx.differentiable);
        CHECK(ctx.layers.size() == 1);  // one layer context, reused by every layer
        REQUIRE(got.size(0) == st.batch.num_tokens());
        int64_t row = 0;
        for (std::size_t i = 0; i < kSeqs.size(); ++i) {
          const int64_t n = to[i] - from[i];
          INFO("step " << step << " sequence " << i);
          CHECK(same_rows(got, row, want, whole.cu_seqlens_host[i] + from[i], n));
          row += n;
          compared += n;
        }
      }
      CHECK(compared == whole.num_tokens());
      // The cache holds SelfKv's keys (after norm and RoPE) and values, each
      // sequence's in its region.
      for (std::size_t l = 0; l < 3; ++l) {
        const auto& attn = full.layers[l].self_attn;
        for (std::size_t i = 0; i < kSeqs.size(); ++i) {
          INFO("layer " << l << " sequence " << i);
          const int64_t n = int64_t(kSeqs[i].size()), at = whole.cu_seqlens_host[i];
          CHECK(same_rows(cache.k[l], cache.start[i], attn.k, at, n));
          CHECK(same_rows(cache.v[l], cache.start[i], attn.v, at, n));
        }
      }
    }
  }
}

TEST_CASE("Attention and DecoderLayer take the K/V source too, and SelfKv spelled out is the default", "[nn][kv]") {
  nn::Qwen3Model model = model_of(false);
  const nn::PackedBatch whole = nn::make_packed_batch(kSeqs);
  nn::Qwen3Model::Context a, b;
  nn::NoHooks hooks;
  CHECK(same_rows(model.forward(whole, a), 0, model.forward(whole, b, {}, hooks, nn::SelfKv{}), 0, whole.num_tokens()));
  // One layer, the whole sequences through the cache at once (prefill).
  nn::DecoderLayer& layer = model.layers()[0];
  const Tensor x = a.layers[1].input_layernorm.x;  // layer 1's input: some hidden states [T, D]
  nn::DecoderLayer::Context self_ctx, cached_ctx;
  const Tensor want = layer.forward(x, whole, self_ctx);
  Cache cache = make_cache(model.config(), {0, 10, 16}, 22);
  const Step st = cached_step(cache, {0, 0, 0}, {9, 6, 4});
  const Tensor got = layer.forward(x, st.batch, cached_ctx, {}, st.kv.layer(0));
  CHECK(same_rows(got, 0, want, 0, whole.num_tokens()));
  // The cached context is not one to differentiate.
  CHECK_THROWS_WITH(layer.self_attn.backward(cached_ctx.self_attn, got),
                    ContainsSubstring("differentiable K/V source"));
}

TEST_CASE("a cached forward refuses backward, and bad cache arguments fail clearly", "[nn][kv]") {
  nn::Qwen3Model model = model_of(true);
  Cache cache = make_cache(model.config(), {0, 10, 16}, 22);
  nn::NoHooks hooks;
  {
    const Step st = cached_step(cache, {0, 0, 0}, {3, 2, 1});
    nn::Qwen3Model::Context ctx;
    const Tensor h = model.forward(st.batch, ctx, {}, hooks, st.kv);
    CHECK_THROWS_WITH(model.backward(ctx, h), ContainsSubstring("not differentiable"));
    CHECK_THROWS_WITH(model.aux_loss_and_grad(ctx), ContainsSubstring("not differentiable"));
    CHECK_THROWS_WITH(model.router_logits(ctx), ContainsSubstring("not differentiable"));
  }
  nn::Qwen3Model::Context ctx;
  {
    Step st = cached_step(cache, {0, 0, 0}, {3, 2, 1});
    st.kv.write_rows = Tensor::from_vector(std::vector<int32_t>{0, 1}, {2});
    CHECK_THROWS_WITH(model.forward(st.batch, ctx, {}, hooks, st.kv), ContainsSubstring("write_rows"));
  }
  {
    Step st = cached_step(cache, {0, 0, 0}, {3, 2, 1});
    st.kv.cu_seqlens_k = Tensor::from_vector(std::vector<int32_t>{0, 22}, {2});
    CHECK_THROWS_WITH(model.forward(st.batch, ctx, {}, hooks, st.kv), ContainsSubstring("cu_seqlens_k"));
  }
  {
    Step st = cached_step(cache, {0, 0, 0}, {3, 2, 1});
    st.kv.k = std::span<const Tensor>(cache.k).first(2);
    st.kv.v = std::span<const Tensor>(cache.v).first(2);
    CHECK_THROWS_WITH(model.forward(st.batch, ctx, {}, hooks, st.kv), ContainsSubstring("no cache for layer 2"));
  }
}
