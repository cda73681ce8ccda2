// slime/parallel/context_parallel.hpp: ContextParallel, sequence (context)
// parallelism over the mesh's cp axis: every sequence of a packed batch is
// split over the cp ranks, and the attention of each layer runs as Ulysses
// (all-to-all: sequence-sharded -> head-sharded and back), RingAttention
// (K/V blocks travel around a ring, partial outputs merge by log-sum-exp) or
// both (USP: cp = ulysses x ring, the Ulysses groups being neighbouring
// ranks). Everything else in a layer is per token and runs unchanged on each
// rank's tokens. It is the model's nn::SequenceAttention
// (Qwen3Model::set_sequence_attention).
//
// Layout (CpPlan). cp = u * r ranks, cp rank = ring_rank * u + ulysses_rank.
// Each sequence b of length n_b is padded at its end to p_b, a multiple of
// m = 2 r u (r > 1) or u (r = 1), and cut into C = 2r (or 1) equal chunks.
// Ring rank i owns chunks i and 2r - 1 - i (zigzag: the cheap early chunk
// with the expensive late one, so causal work is balanced over the ring);
// each owned chunk is cut into u equal parts and Ulysses rank k holds part k
// of each. Rank's rows, per sequence in batch order: [part k of chunk i |
// part k of chunk 2r-1-i]; all ranks hold the same number of rows, p_b / cp
// per sequence. A sequence too short for its 2r chunks to fill the kernels'
// tiles (ContextParallelOptions::min_chunk_tokens) stays whole on one ring
// rank instead (cut into its u Ulysses parts there, padded to a multiple of
// u), the ring rank with the fewest rows so far, longest first; one padding
// entry per ring rank then evens out the ranks' rows. Padding sits after
// the sequence's last token (or in an entry of its own), so causal
// attention never lets a real token see it; give padding rows loss weight 0
// (CpPlan::take with a pad value). Positions are the rows' positions in
// their sequence (RoPE as without cp).
//
// Ulysses (u > 1; needs u | Hq and u | Hkv, else an error naming the head
// counts: no KV-head replication): x [T, H, d] -> rows (k, t) of width
// H/u * d (a row gather) -> all_to_all over the Ulysses group -> a row
// gather into the ring rank's order: [u T, H/u, d], the ring rank's tokens
// (its two chunks of every sequence, whole) for this rank's H/u heads. The
// inverse (o, and dq / dk / dv in backward) runs the same steps backwards.
//
// Ring (r > 1), zigzag, varlen: at step s (0 .. r-1) ring rank i holds the
// K/V block of ring rank j = (i - s) mod r and computes one block attention:
//   j == i: its queries over its keys, causal (both chunks in order; whole
//           sequences whole)
//   j <  i: its queries over the first chunk of j's keys, no mask (chunk j
//           precedes both of i's chunks; chunk 2r-1-j follows both)
//   j >  i: its second chunk's queries over both of j's chunks, no mask
// (a whole sequence's rows take part only in its owner's j == i block)
// with each sequence's rows described by cu_seqlens (sequences of zero
// queries or zero keys fill the gaps, so no block is copied and no attention
// crosses samples). Partial (o, lse) merge into an f32 accumulator
// (ops::merge_attention_partials). The next K/V block is exchanged with the
// ring neighbours (send to i + 1, receive from i - 1; even ranks send first,
// so a blocking send never deadlocks) on a communication stream while the
// block attention runs. Backward: the same blocks with the final o and lse;
// dq accumulates in f32 locally, dK/dV accumulate in f32 in a buffer that
// travels with its K/V block and reaches its owner after r hops.
//
// Composition: the loss over the batch must count every token once: give
// padding weight 0 and the global normaliser (all cp ranks' real tokens).
// Parameters are the same on every cp rank; their gradients sum over cp
// (Sharded on a mesh with cp > 1 shards over dp_shard x cp). MoE routing is
// per token; the load-balancing statistics count padding rows too (their
// hidden states route like any token), so the aux loss with cp > 1 differs
// from cp = 1 by the padding rows' share (none when every sequence is split
// and its length a multiple of the layout's).
//
// Costs per layer and rank (T = this rank's tokens): Ulysses moves q, k, v
// and o (and dO, dq, dk, dv in backward) through one all_to_all each,
// (u - 1) / u of their bytes; ring moves (r - 1) K/V blocks of 2 T_ring Hkv d
// elements (T_ring = u T) in forward, and (r - 1) K/V + r dK/dV (f32) blocks
// in backward.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/core/error.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/sequence_attention.hpp"
#include "slime/ops/attention.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/ops/index_rows.hpp"

namespace slime::parallel {

// Which rows of a packed batch one cp rank holds (see the top of the file).
struct CpPlan {
  int ulysses = 1, ring = 1, rank = 0;  // rank on the cp axis
  std::vector<int32_t> cu_global;       // the whole batch's cu_seqlens [B + 1]
  std::vector<int64_t> padded;          // [B] padded sequence lengths p_b
  // Entries: the B sequences, then (only when some sequence is whole) one
  // padding entry per ring rank that evens out the ranks' rows.
  std::vector<int> owner;                       // [entries] -1: split over the ring, else the ring rank holding it
  std::vector<std::vector<int32_t>> ring_rows;  // [entries][ring]: a ring rank's rows of the entry (u T in all)
  std::vector<int32_t> cu_local;                // [entries + 1] this rank's rows per entry, cumulated
  std::vector<int64_t> rows;                    // [T_local] the global row of each local row, -1: padding
  std::vector<int32_t> positions;               // [T_local] each local row's position in its sequence

  int size() const { return ulysses * ring; }
  int64_t local_tokens() const { return int64_t(rows.size()); }
  int64_t num_sequences() const { return int64_t(padded.size()); }
  int64_t num_entries() const { return int64_t(owner.size()); }
  int ring_rank() const { return rank / ulysses; }
  int ulysses_rank() const { return rank % ulysses; }
  // Every split sequence's padded length is a multiple of this.
  static int64_t multiple(int ulysses, int ring) { return ring > 1 ? int64_t(2) * ring * ulysses : ulysses; }

  // This rank's values of a per-token vector of the whole batch; padding rows get `pad`.
  template <class T>
  std::vector<T> take(const std::vector<T>& global, T pad) const {
    SLIME_CHECK(int64_t(global.size()) == int64_t(cu_global.back()), "CpPlan::take: ", global.size(),
                " values for a batch of ", cu_global.back(), " tokens");
    std::vector<T> out;
    out.reserve(rows.size());
    for (int64_t g : rows) out.push_back(g < 0 ? pad : global[std::size_t(g)]);
    return out;
  }

  // The plan of cp rank `rank` for a batch with cu_seqlens `cu` (host, [B + 1]).
  // With ring > 1, a sequence is split (zigzag) when each of its 2r chunks
  // gets at least `min_chunk_tokens` tokens; a shorter one stays whole on one
  // ring rank (split only into Ulysses parts), the rank with the fewest rows
  // so far, longest first: its chunks would fill a fraction of the attention
  // kernel's tiles, and its K/V need not reach other ranks. 0: split every
  // sequence.
  static CpPlan make(const std::vector<int32_t>& cu, int ulysses, int ring, int rank, int64_t min_chunk_tokens = 0) {
    SLIME_CHECK(ulysses >= 1 && ring >= 1, "CpPlan: ulysses and ring degrees must be >= 1, got ", ulysses, " and ",
                ring);
    SLIME_CHECK(rank >= 0 && rank < ulysses * ring, "CpPlan: rank ", rank, " out of range for cp = ", ulysses * ring);
    SLIME_CHECK(cu.size() >= 2 && cu.front() == 0, "CpPlan: cu_seqlens must start at 0 and hold at least one sequence");
    SLIME_CHECK(min_chunk_tokens >= 0, "CpPlan: min_chunk_tokens must be >= 0, got ", min_chunk_tokens);
    CpPlan p;
    p.ulysses = ulysses;
    p.ring = ring;
    p.rank = rank;
    p.cu_global = cu;
    const int64_t B = int64_t(cu.size()) - 1, m = multiple(ulysses, ring), chunks = ring > 1 ? 2 * ring : 1;
    // Which sequences split, and where the whole ones go (the same on every rank).
    std::vector<int64_t> n(static_cast<std::size_t>(B));
    for (int64_t b = 0; b < B; ++b) {
      n[std::size_t(b)] = int64_t(cu[std::size_t(b) + 1]) - cu[std::size_t(b)];
      SLIME_CHECK(n[std::size_t(b)] >= 1, "CpPlan: sequence ", b, " has ", n[std::size_t(b)],
                  " tokens; every sequence needs at least one");
    }
    p.owner.assign(std::size_t(B), -1);
    std::vector<int64_t> load(std::size_t(ring), 0), whole;
    for (int64_t b = 0; b < B; ++b) {
      if (ring > 1 && n[std::size_t(b)] < chunks * min_chunk_tokens) {
        whole.push_back(b);
        p.padded.push_back((n[std::size_t(b)] + ulysses - 1) / ulysses * ulysses);
      } else {
        p.padded.push_back((n[std::size_t(b)] + m - 1) / m * m);
        for (int64_t& l : load) l += p.padded.back() / ring;
      }
    }
    std::stable_sort(whole.begin(), whole.end(),
                     [&](int64_t a, int64_t b) { return n[std::size_t(a)] > n[std::size_t(b)]; });
    for (int64_t b : whole) {
      const int o = int(std::min_element(load.begin(), load.end()) - load.begin());
      p.owner[std::size_t(b)] = o;
      load[std::size_t(o)] += p.padded[std::size_t(b)];
    }
    for (int64_t b = 0; b < B; ++b) {
      std::vector<int32_t> rr(std::size_t(ring), 0);
      for (int j = 0; j < ring; ++j)
        rr[std::size_t(j)] = int32_t(p.owner[std::size_t(b)] < 0    ? p.padded[std::size_t(b)] / ring
                                     : p.owner[std::size_t(b)] == j ? p.padded[std::size_t(b)]
                                                                    : 0);
      p.ring_rows.push_back(rr);
    }
    if (!whole.empty()) {  // even out the ring ranks' rows (multiples of u)
      const int64_t most = *std::max_element(load.begin(), load.end());
      for (int j = 0; j < ring; ++j) {
        std::vector<int32_t> rr(std::size_t(ring), 0);
        rr[std::size_t(j)] = int32_t(most - load[std::size_t(j)]);
        p.owner.push_back(j);
        p.ring_rows.push_back(rr);
      }
    }
    // This rank's rows, entry by entry.
    const int i = p.ring_rank(), k = p.ulysses_rank();
    p.cu_local.push_back(0);
    for (int64_t e = 0; e < p.num_entries(); ++e) {
      const int o = p.owner[std::size_t(e)];
      const int64_t base = e < B ? cu[std::size_t(e)] : 0, len = e < B ? n[std::size_t(e)] : 0;
      const auto put = [&](int64_t pos) {
        p.rows.push_back(pos < len ? base + pos : -1);
        p.positions.push_back(int32_t(pos));
      };
      if (o < 0) {  // zigzag: part k of chunks i and 2r-1-i
        const int64_t chunk = p.padded[std::size_t(e)] / chunks, part = chunk / ulysses;
        const std::vector<int64_t> own = ring > 1 ? std::vector<int64_t>{i, 2 * ring - 1 - i} : std::vector<int64_t>{0};
        for (int64_t c : own)
          for (int64_t t = 0; t < part; ++t) put(c * chunk + k * part + t);
      } else if (o == i) {  // whole here: part k of it
        const int64_t part = p.ring_rows[std::size_t(e)][std::size_t(i)] / ulysses;
        for (int64_t t = 0; t < part; ++t) put(k * part + t);
      }
      SLIME_CHECK(int64_t(p.rows.size()) < (int64_t(1) << 31), "CpPlan: more than 2^31 - 1 rows on one rank");
      p.cu_local.push_back(int32_t(p.rows.size()));
    }
    return p;
  }
};

// One block attention of the ring schedule: the ring rank's queries over a
// K/V block, rows described per sequence by cu_seqlens (i32, on the device).
struct RingBlock {
  Tensor cu_q, cu_k;
  int64_t max_q = 0, max_k = 0;
  bool causal = false;
};

// Ring rank i's blocks (see the top of the file) for plan `p`, over the ring
// rank's rows (entry by entry, u parts of each owned chunk in order; u T rows
// in all): `self` (j == i: causal over its own rows; also the whole attention
// when ring == 1) and `from[j]` (j != i): for a split sequence, j < i: every
// query over the first chunk of j's block; j > i: the second chunk's queries
// over the whole block; for a whole sequence (and the padding entries),
// nothing (its rows are on one rank). Sequences of zero queries or zero keys
// fill the gaps, so a block needs no copy.
struct RingBlocks {
  RingBlock self;               // j == i
  std::vector<RingBlock> from;  // [ring]: the block of ring rank j's K/V (j != i)

  // The block ring rank i runs over ring rank j's K/V.
  const RingBlock& of(int j, int i) const { return j == i ? self : from[std::size_t(j)]; }
};
inline RingBlocks ring_blocks(const CpPlan& p, Device dev, const Stream& s = {}) {
  const auto upload = [&](const std::vector<int32_t>& v) {
    return Tensor::from_vector(v, {int64_t(v.size())}, dev, s);
  };
  const int i = p.ring_rank();
  RingBlocks out;
  std::vector<int32_t> cu_self{0};
  int64_t max_self = 0;
  for (int64_t e = 0; e < p.num_entries(); ++e) {
    const int32_t len = p.ring_rows[std::size_t(e)][std::size_t(i)];
    cu_self.push_back(cu_self.back() + len);
    max_self = std::max<int64_t>(max_self, len);
  }
  out.self.cu_q = out.self.cu_k = upload(cu_self);
  out.self.max_q = out.self.max_k = max_self;
  out.self.causal = true;
  out.from.resize(std::size_t(p.ring));
  for (int j = 0; j < p.ring; ++j) {
    if (j == i) continue;
    // Two entries per entry e: its query rows here first, its key rows of j next.
    std::vector<int32_t> cq{0}, ck{0};
    int64_t max_q = 0, max_k = 0;
    const auto add = [&](int64_t q, int64_t k) {
      cq.push_back(int32_t(cq.back() + q));
      ck.push_back(int32_t(ck.back() + k));
      max_q = std::max(max_q, q);
      max_k = std::max(max_k, k);
    };
    for (int64_t e = 0; e < p.num_entries(); ++e) {
      if (p.owner[std::size_t(e)] >= 0) {  // whole on one rank (or padding): nothing across ranks
        add(p.ring_rows[std::size_t(e)][std::size_t(i)], 0);
        add(0, p.ring_rows[std::size_t(e)][std::size_t(j)]);
        continue;
      }
      const int64_t L = p.ring_rows[std::size_t(e)][std::size_t(i)] / 2;  // split: two chunks of L here and on j
      if (j < i) {  // every query over the first chunk of j, none over its second
        add(2 * L, L);
        add(0, L);
      } else {  // the first chunk's queries see nothing, the second chunk's the whole block
        add(L, 0);
        add(L, 2 * L);
      }
    }
    out.from[std::size_t(j)] = {upload(cq), upload(ck), max_q, max_k, false};
  }
  return out;
}

// How the ring degree's K/V reach the queries (r > 1).
enum class RingKv : uint8_t {
  p2p,         // blocks travel around the ring (send/recv), overlapping the block attention
  all_gather,  // every ring rank gathers the whole sequences' K/V once (Llama 3): two attention calls
  automatic,   // all_gather when the ring rank's rows (u T) are at most all_gather_max_rows, else p2p
};

struct ContextParallelOptions {
  int ulysses = 1;  // Ulysses degree u (divides cp); the ring degree is cp / u
  RingKv ring_kv = RingKv::automatic;
  // RingKv::automatic's size rule: short batches are bound by the ring's r
  // latency-bound exchanges, long ones by the gathered K/V's memory
  // (r times the rank's). Not tuned by measurement yet.
  int64_t all_gather_max_rows = 4096;
  // A sequence is split over the ring (zigzag) only when each of its 2 x ring
  // chunks gets at least this many tokens; shorter ones stay whole on one
  // ring rank (CpPlan::make): the attention kernels work in 128-row query
  // tiles, and shorter chunks leave most of a tile empty. 0 (default): split
  // every sequence. Measured on the H200 (bench/RESULTS.md, cp/ring rows
  // whole256): 256 is no better than 0 and worse at r = 4 and 8 on short
  // sequences (its balancing padding and the whole sequences' causal blocks
  // cost more than the chunks' empty tile rows), so it stays opt-in.
  int64_t min_chunk_tokens = 0;
};

class ContextParallel final : public nn::SequenceAttention {
 public:
  // Collective over `cp` (the mesh's cp axis; it must outlive this object):
  // splits it into the Ulysses groups (ranks ring_rank * u .. + u - 1) and
  // the rings (ranks with the same ulysses_rank).
  explicit ContextParallel(comm::Comm& cp, ContextParallelOptions opt = {}) : cp_(&cp), u_(opt.ulysses), options_(opt) {
    SLIME_CHECK(u_ >= 1 && cp.size() % u_ == 0, "ContextParallel: the Ulysses degree ", u_, " must divide the cp size ",
                cp.size());
    r_ = cp.size() / u_;
    ulysses_comm_ = cp.split(cp.rank() / u_, cp.rank() % u_);
    ring_comm_ = cp.split(cp.rank() % u_, cp.rank() / u_);
    SLIME_CHECK(ulysses_comm_ && ring_comm_, "ContextParallel: splitting the cp communicator failed");
  }

  int size() const { return cp_->size(); }
  int rank() const { return cp_->rank(); }
  int ulysses() const { return u_; }
  int ring() const { return r_; }
  Device device() const { return cp_->device(); }

  // Plans the batch with cu_seqlens `cu` (the whole batch, host) for this
  // rank and makes it the plan forward and backward use (its index tensors
  // go to the device on `stream`). Returns the plan: take() this rank's
  // targets, weights, advantages...; local_batch() this rank's PackedBatch.
  const CpPlan& plan(const std::vector<int32_t>& cu, const Stream& stream = {}) {
    auto st = std::make_shared<State>();
    st->plan = CpPlan::make(cu, u_, r_, rank(), options_.min_chunk_tokens);
    build_state(*st, stream);
    state_ = std::move(st);
    return state_->plan;
  }
  const CpPlan& current_plan() const {
    SLIME_CHECK(state_ != nullptr, "ContextParallel: no batch planned (call plan() first)");
    return state_->plan;
  }

  // This rank's part of the batch whose tokens are `tokens` (host, the whole
  // batch's, in cu order) under the current plan; padding rows get `pad_token`.
  nn::PackedBatch local_batch(const std::vector<int32_t>& tokens, int32_t pad_token = 0,
                              const Stream& stream = {}) const {
    const CpPlan& p = current_plan();
    const Device dev = device();
    nn::PackedBatch b;
    const int64_t T = p.local_tokens();
    b.tokens = Tensor::from_vector(p.take(tokens, pad_token), {T}, dev, stream);
    b.positions = Tensor::from_vector(p.positions, {T}, dev, stream);
    b.cu_seqlens_host = p.cu_local;
    b.cu_seqlens = Tensor::from_vector(p.cu_local, {int64_t(p.cu_local.size())}, dev, stream);
    for (std::size_t s = 0; s + 1 < p.cu_local.size(); ++s)
      b.max_seqlen = std::max(b.max_seqlen, p.cu_local[s + 1] - p.cu_local[s]);
    return b;
  }

  // The whole batch's values [T_global] (in cu order, padding dropped) of a
  // per-row tensor of this rank, local [T_local, ...] on the cp device:
  // an all_gather over cp, then a row gather. Collective over cp.
  Tensor gather(const Tensor& local, const Stream& stream = {}) const {
    const State& st = *checked_state();
    const CpPlan& p = st.plan;
    SLIME_CHECK(local.dim() >= 1 && local.size(0) == p.local_tokens(), "ContextParallel::gather: expected [",
                p.local_tokens(), ", ...] (this rank's rows), got ", local.str());
    Shape all_shape = local.shape();
    all_shape[0] = local.size(0) * size();
    Tensor all = Tensor::empty(all_shape, local.dtype(), device(), stream);
    cp_->all_gather(local, all, stream);
    Shape out_shape = local.shape();
    out_shape[0] = p.cu_global.back();
    Tensor out = Tensor::empty(out_shape, local.dtype(), device(), stream);
    ops::gather_rows(all, st.gather_index, out, stream);
    return out;
  }

  // This rank's rows [T_local, ...] of a tensor of the whole batch, global
  // [T_global, ...] on the cp device (e.g. a loss's gradient of the gathered
  // logprobs); padding rows are 0. Not collective.
  Tensor local_rows(const Tensor& global, const Stream& stream = {}) const {
    const State& st = *checked_state();
    const int64_t T = st.plan.cu_global.back();
    SLIME_CHECK(global.dim() >= 1 && global.size(0) == T, "ContextParallel::local_rows: expected [", T,
                ", ...] (the whole batch's rows), got ", global.str());
    Shape ext_shape = global.shape(), out_shape = global.shape();
    ext_shape[0] = T + 1;  // one zero row for the padding
    out_shape[0] = st.plan.local_tokens();
    Tensor ext = Tensor::zeros(ext_shape, global.dtype(), global.device(), stream);
    ext.slice_rows(0, T).copy_from(global, stream);
    Tensor out = Tensor::empty(out_shape, global.dtype(), global.device(), stream);
    ops::gather_rows(ext, st.local_index, out, stream);
    return out;
  }

  // ---- nn::SequenceAttention ----------------------------------------------

  void for_each_workspace(const std::function<void(Tensor&)>& f) override { f(ws_); }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, const nn::PackedBatch& batch, const Tensor& o,
               nn::SequenceAttention::Saved& saved, const Stream& given) override {
    const Stream stream = on_device(given);
    const std::shared_ptr<const State> st = checked_state();
    check_batch(*st, q, k, batch);
    const Tensor qh = to_heads(*st, q, stream), kh = to_heads(*st, k, stream), vh = to_heads(*st, v, stream);
    const Tensor oh = u_ > 1 ? Tensor::empty(qh.shape(), qh.dtype(), qh.device(), stream) : o;
    const Tensor lse = Tensor::empty({qh.size(0), qh.size(1)}, DType::f32, qh.device(), stream);
    saved.tensors = {qh, kh, vh, oh, lse};
    saved.state = st;
    if (r_ == 1) {
      ops::attention_forward(qh, kh, vh, st->blocks.self.cu_q, st->blocks.self.cu_q, st->blocks.self.max_q,
                             st->blocks.self.max_q, oh, lse, {}, stream);
    } else if (st->all_gather) {
      const Tensor kn = gather_natural(*st, kh, stream), vn = gather_natural(*st, vh, stream);
      gathered_forward(*st, qh, kn, vn, oh, lse, stream);
      saved.tensors[1] = kn;  // backward needs the gathered keys and values
      saved.tensors[2] = vn;
    } else {
      ring_forward(*st, qh, kh, vh, oh, lse, stream);
    }
    if (u_ > 1) to_sequence(*st, oh, o, stream);
  }

  void backward(const nn::SequenceAttention::Saved& saved, const Tensor& d_o, const Tensor& dq, const Tensor& dk,
                const Tensor& dv, const Stream& given) override {
    const Stream stream = on_device(given);
    const auto st = std::static_pointer_cast<const State>(saved.state);
    SLIME_CHECK(st != nullptr && saved.tensors.size() == 5,
                "ContextParallel::backward: the saved state is not from ContextParallel::forward");
    const Tensor &qh = saved.tensors[0], &kh = saved.tensors[1], &vh = saved.tensors[2], &oh = saved.tensors[3],
                 &lse = saved.tensors[4];
    const Tensor doh = to_heads(*st, d_o, stream);
    // The ring rank's rows (kh, vh hold every ring rank's after an all-gather).
    const auto like = [&](const Tensor& t, const Tensor& out) {
      return u_ > 1 ? Tensor::empty({qh.size(0), t.size(1), t.size(2)}, t.dtype(), t.device(), stream) : out;
    };
    const Tensor dqh = like(qh, dq), dkh = like(kh, dk), dvh = like(vh, dv);
    if (r_ == 1) {
      ops::attention_backward(qh, kh, vh, oh, lse, doh, st->blocks.self.cu_q, st->blocks.self.cu_q,
                              st->blocks.self.max_q, st->blocks.self.max_q, dqh, dkh, dvh, {}, workspace(qh, stream),
                              stream);
    } else if (st->all_gather) {
      gathered_backward(*st, qh, kh, vh, oh, lse, doh, dqh, dkh, dvh, stream);
    } else {
      ring_backward(*st, qh, kh, vh, oh, lse, doh, dqh, dkh, dvh, stream);
    }
    if (u_ > 1) {
      to_sequence(*st, dqh, dq, stream);
      to_sequence(*st, dkh, dk, stream);
      to_sequence(*st, dvh, dv, stream);
    }
  }

 private:
  // A plan and its device tensors, shared with the contexts of the forwards
  // that used it (a backward uses the plan of its own forward).
  struct State {
    CpPlan plan;
    Tensor gather_index;  // i32 [T_global]: row of the all-gathered [cp T_local] buffer
    Tensor local_index;   // i32 [T_local]: global row of each local row, T_global for padding
    // Ulysses (u > 1), indices over rows of width H/u * d:
    Tensor split_index;   // [u T]: row (k, t) of the send buffer = row t u + k of x
    Tensor ring_order;    // [u T]: ring-order row -> row of the received buffer
    Tensor ring_inverse;  // [u T]: received-buffer row -> ring-order row
    Tensor merge_index;   // [T u]: row t u + k of the output = row k T + t of the received buffer
    RingBlocks blocks;
    bool all_gather = false;  // RingKv resolved for this batch
    // all_gather: natural order (sequence by sequence, positions in order) of
    // the gathered [r u T] rows, and the block of each of the two chunks.
    Tensor natural_index;    // natural row -> row of the all-gathered (ring-rank-major) buffer
    Tensor natural_inverse;  // the inverse
    RingBlock first, second;
  };

  // The stream work runs on: `s`, or the device's default stream when `s`
  // belongs elsewhere (e.g. the CPU's Stream{} for CUDA tensors), so that the
  // ring's events order the right queue.
  Stream on_device(const Stream& s) const { return s.device() == device() ? s : Stream::default_for(device()); }

  std::shared_ptr<const State> checked_state() const {
    SLIME_CHECK(state_ != nullptr, "ContextParallel: no batch planned (call plan() before the forward)");
    return state_;
  }

  static Tensor upload(const std::vector<int32_t>& v, Device dev, const Stream& s) {
    return Tensor::from_vector(v, {int64_t(v.size())}, dev, s);
  }

  void build_state(State& st, const Stream& s) const {
    const CpPlan& p = st.plan;
    const Device dev = device();
    const int64_t T = p.local_tokens(), cp = size();
    // Where each global row sits in the all-gathered buffer (rank-major).
    std::vector<int32_t> gi(std::size_t(p.cu_global.back()), -1);
    for (int r = 0; r < cp; ++r) {
      const CpPlan pr = r == p.rank ? p : CpPlan::make(p.cu_global, u_, r_, r, options_.min_chunk_tokens);
      for (int64_t t = 0; t < T; ++t)
        if (pr.rows[std::size_t(t)] >= 0) gi[std::size_t(pr.rows[std::size_t(t)])] = int32_t(r * T + t);
    }
    st.gather_index = upload(gi, dev, s);
    std::vector<int32_t> li;
    for (int64_t g : p.rows) li.push_back(int32_t(g < 0 ? p.cu_global.back() : g));
    st.local_index = upload(li, dev, s);
    st.blocks = ring_blocks(p, dev, s);
    const int64_t ring_rows = u_ * T;
    st.all_gather = r_ > 1 && (options_.ring_kv == RingKv::all_gather ||
                               (options_.ring_kv == RingKv::automatic && ring_rows <= options_.all_gather_max_rows));
    if (st.all_gather) build_gathered(st, s);
    if (u_ > 1) {
      std::vector<int32_t> split(std::size_t(u_ * T)), order(std::size_t(u_ * T)), inverse(std::size_t(u_ * T)),
          merge(std::size_t(u_ * T));
      for (int64_t k = 0; k < u_; ++k)
        for (int64_t t = 0; t < T; ++t) {
          split[std::size_t(k * T + t)] = int32_t(t * u_ + k);
          merge[std::size_t(t * u_ + k)] = int32_t(k * T + t);
        }
      // Ring order: per sequence, per owned chunk, part k = 0 .. u-1 (each
      // `part` rows, at the same local offset on every Ulysses rank).
      int64_t at = 0;
      for (int64_t b = 0; b < p.num_entries(); ++b) {
        const int64_t own = r_ > 1 && p.owner[std::size_t(b)] < 0 ? 2 : 1;  // whole entries: one chunk
        const int64_t start = p.cu_local[std::size_t(b)];
        const int64_t part = (p.cu_local[std::size_t(b) + 1] - start) / own;
        for (int64_t c = 0; c < own; ++c)
          for (int64_t k = 0; k < u_; ++k)
            for (int64_t t = 0; t < part; ++t) {
              const int64_t src = k * T + start + c * part + t;
              order[std::size_t(at)] = int32_t(src);
              inverse[std::size_t(src)] = int32_t(at);
              ++at;
            }
      }
      st.split_index = upload(split, dev, s);
      st.ring_order = upload(order, dev, s);
      st.ring_inverse = upload(inverse, dev, s);
      st.merge_index = upload(merge, dev, s);
    }
  }

  // The all-gather variant's indices and blocks for ring rank i. Ring rank j
  // holds entry e at rows start_j[e] (prefix sums of ring_rows[.][j]). A split
  // sequence's natural position c L + t (L rows per chunk) lives on ring rank
  // j = min(c, 2r-1-c) at start_j + (c == j ? 0 : L) + t; a whole one (and a
  // padding entry) on its owner, in order. Queries of chunk i see the natural
  // keys [0, (i+1) L), those of chunk 2r-1-i [0, (2r-i) L), a whole
  // sequence's the whole sequence, all bottom-right causal: one call for the
  // first chunks (and whole entries), one for the second chunks (the other
  // rows are sequences with no keys), then a merge.
  void build_gathered(State& st, const Stream& s) const {
    const CpPlan& p = st.plan;
    const int i = p.ring_rank();
    const int64_t rows = u_ * p.local_tokens(), E = p.num_entries(), r = r_;
    std::vector<std::vector<int64_t>> start(std::size_t(r), std::vector<int64_t>(std::size_t(E), 0));
    for (int64_t j = 0; j < r; ++j)
      for (int64_t e = 1; e < E; ++e)
        start[std::size_t(j)][std::size_t(e)] =
            start[std::size_t(j)][std::size_t(e) - 1] + p.ring_rows[std::size_t(e) - 1][std::size_t(j)];
    std::vector<int32_t> nat(std::size_t(r * rows)), inv(std::size_t(r * rows));
    std::vector<int32_t> fq{0}, fk{0}, sq{0}, sk{0};
    int64_t at = 0, max_q = 0, max_k = 0;
    const auto natural = [&](int64_t src) {
      nat[std::size_t(at)] = int32_t(src);
      inv[std::size_t(src)] = int32_t(at);
      ++at;
    };
    const auto entries = [&](std::vector<int32_t>& cq, std::vector<int32_t>& ck,
                             std::initializer_list<std::pair<int64_t, int64_t>> qk) {
      for (const auto& [q, k] : qk) {
        cq.push_back(int32_t(cq.back() + q));
        ck.push_back(int32_t(ck.back() + k));
        max_q = std::max(max_q, q);
        max_k = std::max(max_k, k);
      }
    };
    for (int64_t e = 0; e < E; ++e) {
      const int o = p.owner[std::size_t(e)];
      if (o >= 0) {
        const int64_t n = p.ring_rows[std::size_t(e)][std::size_t(o)], q = p.ring_rows[std::size_t(e)][std::size_t(i)];
        for (int64_t t = 0; t < n; ++t) natural(o * rows + start[std::size_t(o)][std::size_t(e)] + t);
        entries(fq, fk, {{q, n}, {0, 0}, {0, 0}});
        entries(sq, sk, {{q, 0}, {0, n}, {0, 0}});
        continue;
      }
      const int64_t L = p.ring_rows[std::size_t(e)][std::size_t(i)] / 2, P = 2 * r * L;
      for (int64_t c = 0; c < 2 * r; ++c) {
        const int64_t j = std::min(c, 2 * r - 1 - c);
        for (int64_t t = 0; t < L; ++t)
          natural(j * rows + start[std::size_t(j)][std::size_t(e)] + (c == j ? 0 : L) + t);
      }
      const int64_t kf = (i + 1) * L, ks = (2 * r - i) * L;
      entries(fq, fk, {{L, kf}, {0, P - kf}, {L, 0}});
      entries(sq, sk, {{L, 0}, {L, ks}, {0, P - ks}});
    }
    SLIME_CHECK(at == r * rows, "ContextParallel: the natural order covers ", at, " of ", r * rows, " rows");
    const Device dev = device();
    st.natural_index = upload(nat, dev, s);
    st.natural_inverse = upload(inv, dev, s);
    st.first = {upload(fq, dev, s), upload(fk, dev, s), max_q, max_k, true};
    st.second = {upload(sq, dev, s), upload(sk, dev, s), max_q, max_k, true};
  }

  // x [u T, H, d] of every ring rank, gathered in natural order: [r u T, H, d].
  Tensor gather_natural(const State& st, const Tensor& x, const Stream& s) const {
    Tensor all = Tensor::empty({r_ * x.size(0), x.size(1), x.size(2)}, x.dtype(), x.device(), s);
    ring_comm_->all_gather(x, all, s);
    Tensor out = Tensor::empty(all.shape(), x.dtype(), x.device(), s);
    ops::gather_rows(all, st.natural_index, out, s);
    return out;
  }

  static ops::AttentionOptions gathered_options() {
    ops::AttentionOptions opt;
    opt.align = ops::CausalAlign::bottom_right;
    return opt;
  }

  void gathered_forward(const State& st, const Tensor& q, const Tensor& kn, const Tensor& vn, const Tensor& o,
                        const Tensor& lse, const Stream& s) const {
    const ops::AttentionOptions opt = gathered_options();
    Tensor o2 = Tensor::empty(q.shape(), q.dtype(), q.device(), s);
    Tensor lse2 = Tensor::empty(lse.shape(), DType::f32, q.device(), s);
    ops::attention_forward(q, kn, vn, st.first.cu_q, st.first.cu_k, st.first.max_q, st.first.max_k, o, lse, opt, s);
    ops::attention_forward(q, kn, vn, st.second.cu_q, st.second.cu_k, st.second.max_q, st.second.max_k, o2, lse2, opt,
                           s);
    ops::merge_attention_partials(o, lse, o2, lse2, o, lse, s);  // each row has its keys in one of the two
  }

  void gathered_backward(const State& st, const Tensor& q, const Tensor& kn, const Tensor& vn, const Tensor& o,
                         const Tensor& lse, const Tensor& d_o, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                         const Stream& s) {
    const ops::AttentionOptions opt = gathered_options();
    const Device dev = q.device();
    const Tensor& ws = workspace(q, s);
    Tensor dq2 = Tensor::empty(q.shape(), q.dtype(), dev, s);
    Tensor dk1 = Tensor::empty(kn.shape(), kn.dtype(), dev, s), dv1 = Tensor::empty(vn.shape(), vn.dtype(), dev, s);
    Tensor dk2 = Tensor::empty(kn.shape(), kn.dtype(), dev, s), dv2 = Tensor::empty(vn.shape(), vn.dtype(), dev, s);
    ops::attention_backward(q, kn, vn, o, lse, d_o, st.first.cu_q, st.first.cu_k, st.first.max_q, st.first.max_k, dq,
                            dk1, dv1, opt, ws, s);
    ops::attention_backward(q, kn, vn, o, lse, d_o, st.second.cu_q, st.second.cu_k, st.second.max_q, st.second.max_k,
                            dq2, dk2, dv2, opt, ws, s);
    ops::add_(dq, dq2, s);  // a row's dq is zero in the call where it sees no key: exact
    // dK, dV of the natural rows: the two calls' sum in f32, back to ring-rank
    // order, summed over the ring onto each row's owner.
    const auto reduce_to_owner = [&](const Tensor& g1, const Tensor& g2, const Tensor& out) {
      Tensor sum = Tensor::empty(g1.shape(), DType::f32, dev, s), tmp = Tensor::empty(g1.shape(), DType::f32, dev, s);
      ops::cast(g1, sum, s);
      ops::cast(g2, tmp, s);
      ops::add_(sum, tmp, s);
      ops::gather_rows(sum, st.natural_inverse, tmp, s);  // ring-rank-major
      Tensor mine = Tensor::empty(out.shape(), DType::f32, dev, s);
      ring_comm_->reduce_scatter(tmp, mine, comm::ReduceOp::sum, s);
      ops::cast(mine, out, s);
    };
    reduce_to_owner(dk1, dk2, dk);
    reduce_to_owner(dv1, dv2, dv);
  }

  void check_batch(const State& st, const Tensor& q, const Tensor& k, const nn::PackedBatch& batch) const {
    const CpPlan& p = st.plan;
    SLIME_CHECK(batch.cu_seqlens_host == p.cu_local,
                "ContextParallel: the batch is not this rank's part of the "
                "planned batch (its cu_seqlens differ from the plan's; build it with local_batch())");
    SLIME_CHECK(q.device() == device(), "ContextParallel: q is on ", q.device(), " but the cp communicator on ",
                device());
    SLIME_CHECK(q.size(1) % u_ == 0 && k.size(1) % u_ == 0, "ContextParallel: Ulysses degree ", u_,
                " must divide the query heads (", q.size(1), ") and the kv heads (", k.size(1),
                "); use a smaller Ulysses degree (the rest as ring)");
  }

  // x [T, H, d], this rank's rows -> [u T, H/u, d]: the ring rank's rows
  // (ring order) for this rank's H/u heads. Identity for u = 1.
  Tensor to_heads(const State& st, const Tensor& x, const Stream& s) const {
    if (u_ == 1) return x;
    const int64_t T = x.size(0), H = x.size(1), d = x.size(2), w = H / u_ * d;
    Tensor send = Tensor::empty({u_ * T, w}, x.dtype(), x.device(), s);
    ops::gather_rows(x.reshape({T * u_, w}), st.split_index, send, s);
    Tensor recv = Tensor::empty({u_ * T, w}, x.dtype(), x.device(), s);
    ulysses_comm_->all_to_all(send, recv, s);
    Tensor out = Tensor::empty({u_ * T, H / u_, d}, x.dtype(), x.device(), s);
    ops::gather_rows(recv, st.ring_order, out.reshape({u_ * T, w}), s);
    return out;
  }

  // The inverse: y [u T, H/u, d] -> out [T, H, d] (written).
  void to_sequence(const State& st, const Tensor& y, const Tensor& out, const Stream& s) const {
    const int64_t T = out.size(0), w = y.size(1) * y.size(2);
    Tensor send = Tensor::empty({u_ * T, w}, y.dtype(), y.device(), s);
    ops::gather_rows(y.reshape({u_ * T, w}), st.ring_inverse, send, s);
    Tensor recv = Tensor::empty({u_ * T, w}, y.dtype(), y.device(), s);
    ulysses_comm_->all_to_all(send, recv, s);
    ops::gather_rows(recv, st.merge_index, out.reshape({T * u_, w}), s);
  }

  // Sends `out` to the next ring rank and receives `in` from the previous
  // one; even ranks send first, so blocking sends never wait on each other.
  void exchange(const Tensor& out, Tensor& in, const Stream& s) const {
    const int i = ring_comm_->rank(), next = (i + 1) % r_, prev = (i + r_ - 1) % r_;
    if (i % 2 == 0) {
      ring_comm_->send(out, next, s);
      ring_comm_->recv(in, prev, s);
    } else {
      ring_comm_->recv(in, prev, s);
      ring_comm_->send(out, next, s);
    }
  }

  // The communication stream (CUDA: one of its own, created once; CPU: the
  // calling one, calls complete in order).
  Stream comm_stream(const Stream& compute) {
    if (!device().is_cuda()) return compute;
    if (!comm_stream_) comm_stream_ = std::make_unique<Stream>(Stream::create(device()));
    return *comm_stream_;
  }

  // [2, T, Hkv, d]: k then v, one buffer so one message carries both.
  static Tensor pack_kv(const Tensor& k, const Tensor& v, DType dtype, const Stream& s) {
    Tensor kv = Tensor::empty({2, k.size(0), k.size(1), k.size(2)}, dtype, k.device(), s);
    ops::cast(k, kv.view(0, k.shape()), s);
    ops::cast(v, kv.view(k.numel(), v.shape()), s);
    return kv;
  }

  const Tensor& workspace(const Tensor& q, const Stream& s) {
    if (const int64_t n = ops::attention_backward_workspace_elems(q); n > 0) {
      if (!ws_.defined() || ws_.numel() < n) ws_ = Tensor::empty({n}, DType::f32, q.device(), s);
    }
    return ws_;
  }

  // Runs fn(s, kv_block, j) for s = 0 .. r-1 with kv_block the K/V block of
  // ring rank j = (i - s) mod r, exchanging the next block on the
  // communication stream meanwhile.
  template <class Fn>
  void around_the_ring(Tensor kv, const Stream& compute, Fn&& fn) {
    const Stream comm = comm_stream(compute);
    const bool cuda = device().is_cuda();
    Event ready(device(), false), arrived(device(), false);
    Tensor next = Tensor::empty(kv.shape(), kv.dtype(), kv.device(), compute);
    const int i = ring_comm_->rank();
    for (int s = 0; s < r_; ++s) {
      const bool more = s + 1 < r_;
      if (more) {
        if (cuda) {
          ready.record(compute);
          ready.wait(comm);
        }
        exchange(kv, next, comm);
        if (cuda) arrived.record(comm);
      }
      fn(s, kv, (i - s + r_) % r_);
      if (more) {
        if (cuda) arrived.wait(compute);
        std::swap(kv, next);
      }
    }
  }

  void ring_forward(const State& st, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                    const Tensor& lse, const Stream& s) {
    const int64_t T = q.size(0), Hq = q.size(1), d = q.size(2);
    Tensor acc = Tensor::empty({T, Hq, d}, DType::f32, q.device(), s);
    Tensor part = Tensor::empty({T, Hq, d}, q.dtype(), q.device(), s);
    Tensor part_lse = Tensor::empty({T, Hq}, DType::f32, q.device(), s);
    const int i = ring_comm_->rank();
    around_the_ring(pack_kv(k, v, k.dtype(), s), s, [&](int step, const Tensor& kv, int j) {
      const Tensor kb = kv.view(0, k.shape()), vb = kv.view(k.numel(), v.shape());
      const RingBlock& blk = st.blocks.of(j, i);
      ops::AttentionOptions opt;
      opt.causal = blk.causal;
      // The first block (its own) starts the accumulator; the others merge in.
      ops::attention_forward(q, kb, vb, blk.cu_q, blk.cu_k, blk.max_q, blk.max_k, part, step == 0 ? lse : part_lse, opt,
                             s);
      if (step == 0) {
        ops::cast(part, acc, s);
      } else {
        ops::merge_attention_partials(acc, lse, part, part_lse, acc, lse, s);
      }
    });
    ops::cast(acc, o, s);
  }

  void ring_backward(const State& st, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                     const Tensor& lse, const Tensor& d_o, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                     const Stream& s) {
    const int i = ring_comm_->rank();
    const Device dev = q.device();
    Tensor dq_acc = Tensor::zeros(q.shape(), DType::f32, dev, s);
    Tensor dkv = Tensor::zeros({2, k.size(0), k.size(1), k.size(2)}, DType::f32, dev, s);
    Tensor dkv_next = Tensor::empty(dkv.shape(), DType::f32, dev, s);
    Tensor dq_b = Tensor::empty(q.shape(), q.dtype(), dev, s), dk_b = Tensor::empty(k.shape(), k.dtype(), dev, s),
           dv_b = Tensor::empty(v.shape(), v.dtype(), dev, s);
    Tensor f32 = Tensor::empty(q.shape(), DType::f32, dev, s), f32_kv = Tensor::empty(k.shape(), DType::f32, dev, s);
    const Tensor& ws = workspace(q, s);
    const auto accumulate = [&](const Tensor& part, const Tensor& acc, const Tensor& tmp) {
      ops::cast(part, tmp, s);
      ops::add_(acc, tmp, s);
    };
    // Both exchanges of a step run on the communication stream (one
    // communicator is never used from two streams at once): the next K/V
    // block's while this block's backward runs, then this block's dK/dV.
    const Stream comm = comm_stream(s);
    const bool cuda = dev.is_cuda();
    Event ready(dev, false), arrived(dev, false);
    const auto after_compute = [&] {
      if (cuda) {
        ready.record(s);
        ready.wait(comm);
      }
    };
    Tensor kv = pack_kv(k, v, k.dtype(), s), kv_next = Tensor::empty(kv.shape(), kv.dtype(), dev, s);
    for (int step = 0; step < r_; ++step) {
      const int j = (i - step + r_) % r_;
      if (step + 1 < r_) {
        after_compute();
        exchange(kv, kv_next, comm);
      }
      const Tensor kb = kv.view(0, k.shape()), vb = kv.view(k.numel(), v.shape());
      const RingBlock& blk = st.blocks.of(j, i);
      ops::AttentionOptions opt;
      opt.causal = blk.causal;
      ops::attention_backward(q, kb, vb, o, lse, d_o, blk.cu_q, blk.cu_k, blk.max_q, blk.max_k, dq_b, dk_b, dv_b, opt,
                              ws, s);
      accumulate(dq_b, dq_acc, f32);
      accumulate(dk_b, dkv.view(0, k.shape()), f32_kv);
      accumulate(dv_b, dkv.view(k.numel(), v.shape()), f32_kv);
      // dK/dV of block j move on with it: after r hops each reaches its owner.
      after_compute();
      exchange(dkv, dkv_next, comm);
      if (cuda) {
        arrived.record(comm);
        arrived.wait(s);
      }
      std::swap(dkv, dkv_next);
      if (step + 1 < r_) std::swap(kv, kv_next);
    }
    ops::cast(dq_acc, dq, s);
    ops::cast(dkv.view(0, k.shape()), dk, s);
    ops::cast(dkv.view(k.numel(), v.shape()), dv, s);
  }

  comm::Comm* cp_;
  int u_ = 1, r_ = 1;
  ContextParallelOptions options_;
  std::unique_ptr<comm::Comm> ulysses_comm_, ring_comm_;
  std::shared_ptr<const State> state_;
  std::unique_ptr<Stream> comm_stream_;
  Tensor ws_;  // attention backward workspace (CUDA)
};

}  // namespace slime::parallel
