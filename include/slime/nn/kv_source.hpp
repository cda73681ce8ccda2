// slime/nn/kv_source.hpp: where attention's keys and values come from, the
// K/V source policy of Attention::forward, DecoderLayer::forward and
// Qwen3Model::forward, so training, scoring, prefill and decode run the one
// layer loop of the library:
//   SelfKv    the packed batch's own keys: each sequence's queries attend
//             causally to its own tokens (training, scoring). Differentiable.
//   CachedKv  a KV cache (rollout::Engine fills it from its arena): the new
//             tokens' keys and values are written into per-layer cache
//             tensors at given rows, and each sequence's queries attend over
//             its cache rows, the new tokens last (bottom-right causal
//             alignment: decode, continuous batching). Forward only.
//
// A K/V source S (concept KvSource) gives, per decoder layer i, a layer
// source S.layer(i) (concept LayerKvSource) whose
//   attend(q, k, v, batch, o, lse, stream)
// writes o [T, Hq, d] (the activations' dtype) and lse f32 [T, Hq] from the
// batch's new queries q [T, Hq, d] and keys and values k, v [T, Hkv, d]
// (after the q/k norms and RoPE at batch.positions). S::differentiable says
// whether a backward may follow: only then does Attention save q, k, v, o
// and lse in its context, and Qwen3Model keep one context per layer (else
// one layer context serves every layer, so inference holds one layer's
// activations at a time).
//
// Other sources (a paged cache, sequence-parallel attention) model the same
// concepts; nn/ never includes rollout/ or parallel/: CachedKv takes plain
// tensors.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include "slime/core/error.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/ops/attention.hpp"
#include "slime/ops/index_rows.hpp"

namespace slime::nn {

template <class L>
concept LayerKvSource = requires(const L& l, const Tensor& t, const PackedBatch& b, const Stream& s) {
  l.attend(t, t, t, b, t, t, s);
  { L::differentiable } -> std::convertible_to<bool>;
};

template <class S>
concept KvSource = requires(const S& s, std::size_t layer) {
  { s.layer(layer) } -> LayerKvSource;
  { S::differentiable } -> std::convertible_to<bool>;
};

// The batch's own keys and values: sequence b's queries (tokens
// [cu_seqlens[b], cu_seqlens[b + 1])) see the keys of the same tokens,
// causally. Every layer uses it as it is.
struct SelfKv {
  static constexpr bool differentiable = true;

  SelfKv layer(std::size_t) const { return {}; }

  void attend(const Tensor& q, const Tensor& k, const Tensor& v, const PackedBatch& batch, const Tensor& o,
              const Tensor& lse, const Stream& stream) const {
    ops::attention_forward(q, k, v, batch.cu_seqlens, batch.cu_seqlens, batch.max_seqlen, batch.max_seqlen, o, lse, {},
                           stream);
  }
};
static_assert(KvSource<SelfKv>);

// A KV cache of per-layer tensors, read as B' cache sequences: cache
// sequence b is rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of every
// layer's K and V, and its new tokens are the batch's sequence b (tokens
// [batch.cu_seqlens[b], batch.cu_seqlens[b + 1]), possibly none: rows that
// belong to no running sequence are cache sequences without queries). The
// new tokens' keys and values are written at write_rows, which must be the
// last rows of their cache sequence (in token order), so that with
// bottom-right alignment new token j of n sees the sequence's keys up to
// its own row. batch.positions are the new tokens' positions in their
// sequence (cached tokens + j; RoPE uses them, as the cached keys did).
//
// Shapes: k[i], v[i] [rows, Hkv, d] in the model's dtype, on its device
// (one per decoder layer, written in place); write_rows i32 [T];
// cu_seqlens_k i32 [B' + 1] with B' = batch.num_sequences(), ending at rows.
// max_seqlen_k bounds the cache sequences' lengths (-1: computed, see
// ops/attention.hpp).
struct CachedKv {
  static constexpr bool differentiable = false;

  std::span<const Tensor> k, v;  // per layer [rows, Hkv, d]
  Tensor write_rows;             // i32 [T]: the cache row of each new token
  Tensor cu_seqlens_k;           // i32 [B' + 1]: the cache sequences' rows
  int max_seqlen_k = 0;

  // Layer i's cache.
  struct Layer {
    static constexpr bool differentiable = false;
    const CachedKv* cache = nullptr;
    const Tensor* k = nullptr;
    const Tensor* v = nullptr;

    void attend(const Tensor& q, const Tensor& k_new, const Tensor& v_new, const PackedBatch& batch, const Tensor& o,
                const Tensor& lse, const Stream& stream) const {
      const CachedKv& c = *cache;
      SLIME_CHECK(c.write_rows.defined() && c.write_rows.dim() == 1 && c.write_rows.size(0) == k_new.size(0),
                  "CachedKv: write_rows must be [", k_new.size(0), "] (one row per new token), got ",
                  c.write_rows.str());
      SLIME_CHECK(
          c.cu_seqlens_k.defined() && batch.cu_seqlens.defined() && c.cu_seqlens_k.numel() == batch.cu_seqlens.numel(),
          "CachedKv: cu_seqlens_k must have as many entries as the batch's cu_seqlens (", batch.cu_seqlens.numel(),
          ": one cache sequence per batch sequence), got ", c.cu_seqlens_k.str());
      ops::scatter_rows(k_new, c.write_rows, *k, stream);
      ops::scatter_rows(v_new, c.write_rows, *v, stream);
      ops::AttentionOptions opt;
      opt.align = ops::CausalAlign::bottom_right;  // the queries are the last rows of their cache sequence
      ops::attention_forward(q, *k, *v, batch.cu_seqlens, c.cu_seqlens_k, batch.max_seqlen, c.max_seqlen_k, o, lse, opt,
                             stream);
    }
  };

  Layer layer(std::size_t i) const {
    SLIME_CHECK(k.size() == v.size(), "CachedKv: ", k.size(), " key tensors but ", v.size(), " value tensors");
    SLIME_CHECK(i < k.size(), "CachedKv: no cache for layer ", i, " (the cache has ", k.size(), " layers)");
    return Layer{this, &k[i], &v[i]};
  }
};
static_assert(KvSource<CachedKv>);

}  // namespace slime::nn
