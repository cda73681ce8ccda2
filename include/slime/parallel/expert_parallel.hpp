// slime/parallel/expert_parallel.hpp: ExpertParallel<N>, dropless MoE token
// dispatch and combine over the ep group (forward and both backwards), with a
// DispatchHandle that combine and the backwards reuse.
//
// Accumulation contract: parameter gradients accumulate (`+=`) into fp32
// tensors (none here); activation gradients are written (`=`).
//
// Experts are partitioned contiguously: with E experts over ep ranks, rank r
// owns experts [r·E/ep, (r+1)·E/ep) (E % ep == 0). Each rank routes its own T
// tokens (the router's global expert ids [T, k]); N = T·k copies.
//
//   dispatch          x [T, H] → rows for this rank's experts [R, H], grouped
//                     by local expert: feed them to ops::grouped_gemm_* with
//                     handle.local_offsets() [E_local + 1].
//   combine           expert outputs [R, H'] → y [T, H'] = Σ_j w[t, j] · out of
//                     (t, j), through the inverse exchange and
//                     ops::moe_unpermute_forward.
//   combine_backward  dy [T, H'] → d expert outputs [R, H'] and dweights [T, k].
//   dispatch_backward d rows [R, H] → dx [T, H] (written).
//
// How dispatch runs (ep > 1):
//   1. ops::moe_build_layout over the E global experts. Rows grouped by global
//      expert are also grouped by destination rank (contiguous ownership).
//   2. ops::moe_permute_forward: x → send rows [N, H] in layout order.
//   3. all_gather of the layout's counts (i32 [E] → [ep, E]): every rank
//      learns how many rows each rank sends to each expert.
//   4. One device→host copy of that [ep, E] matrix and a host synchronisation
//      of the stream (the all_to_all_v needs host row counts). On the CPU the
//      matrix is read in place. The host then computes send/recv row counts
//      per peer, the local offsets (copied to the device) and the regrouping.
//   5. all_to_all_v of the rows: received in source-rank order, and within a
//      source by local expert, in the sender's layout order.
//   6. Regroup into (local expert, source rank, sender order): one row-block
//      copy per (local expert, source) pair, adjacent blocks merged.
// The order is deterministic: with the tokens of the ep ranks concatenated in
// rank order, every expert sees its rows in the same order as an unsharded
// ops::moe_build_layout over all tokens, so sums over rows (weight gradients)
// are bitwise those of the unsharded block on the CPU.
//
// Degree 1 is the identity with no collective and no host synchronisation:
// the dispatched rows are the permuted rows, local offsets the layout's.
//
// Every rank takes part in every collective whatever its routing: a rank with
// T = 0 tokens, or whose experts receive no rows, exchanges zero rows and
// produces zero gradients. Calls must be made in the same order on all ranks.
//
// Memory: steady-state calls allocate no tensors. Buffers are views into
// capacity-grown tensors (grown by 1.5x when a call needs more; never shrunk):
// the forward buffers in the DispatchHandle (keep one handle per micro-batch in
// flight), the backward scratch in the ExpertParallel object (backwards run one
// at a time; shared by every MoE layer using the object). The returned tensors
// are views of those buffers, valid until the next call of the same function
// on the same handle (forward) or object (backward); pass an output tensor to
// combine / dispatch_backward to write elsewhere. (Host side: Comm::all_to_all_v
// builds two small count vectors per call; the handle's own host vectors keep
// their capacity.)
//
// Streams: every call is ordered on `stream` (a CPU stream means the
// communicator device's default stream). dispatch synchronises that stream
// once (step 4) when ep > 1.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/token_dispatcher.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/ops/moe_permute.hpp"

namespace slime::parallel {

// ExpertParallel<dynamic_degree> (= ExpertParallel<>) takes the degree from
// its communicator at run time.
inline constexpr int dynamic_degree = 0;

template <int N = dynamic_degree>
class ExpertParallel;

namespace detail {

using nn::detail::rows_view;
using nn::detail::vec_view;

// dst rows [b.dst, b.dst + b.rows) = src rows [b.src, b.src + b.rows), or the
// reverse when `inverse`.
struct RowBlock {
  int64_t src = 0, dst = 0, rows = 0;
};

inline void copy_blocks(const std::vector<RowBlock>& blocks, const Tensor& src, const Tensor& dst, bool inverse,
                        const Stream& stream) {
  for (const RowBlock& b : blocks) {
    if (inverse) {
      src.slice_rows(b.src, b.rows).copy_from(dst.slice_rows(b.dst, b.rows), stream);
    } else {
      dst.slice_rows(b.dst, b.rows).copy_from(src.slice_rows(b.src, b.rows), stream);
    }
  }
}

}  // namespace detail

using detail::RowBlock;

// What dispatch computed for one micro-batch, reused by combine and both
// backwards. Filled by ExpertParallel::dispatch; keep one per micro-batch in
// flight and reuse it across steps (its buffers keep their capacity).
class DispatchHandle {
 public:
  // The routing of this rank's tokens over the E global experts (on the data's
  // device): counts [E], offsets [E + 1], row_to_copy / copy_to_row [T·k].
  const ops::MoeLayout& layout() const { return layout_; }
  int64_t tokens() const { return layout_.tokens; }
  int64_t topk() const { return layout_.topk; }
  // Rows dispatched to this rank's experts (R).
  int64_t received_rows() const { return received_rows_; }
  // i32 [E_local + 1] on the data's device: grouped_gemm offsets of the
  // dispatched rows.
  const Tensor& local_offsets() const { return offsets_; }
  // Host copies (ep > 1 only; empty at degree 1, where layout().counts holds
  // the same on the device): expert_counts()[s·E + e] = rows rank s sends to
  // expert e; send_rows()[r] / recv_rows()[r] = rows sent to / received from
  // rank r; local_counts()[i] = rows for local expert i.
  const std::vector<int32_t>& expert_counts() const { return counts_; }
  const std::vector<int64_t>& send_rows() const { return send_rows_; }
  const std::vector<int64_t>& recv_rows() const { return recv_rows_; }
  const std::vector<int64_t>& local_counts() const { return local_counts_; }
  // The regrouping permutation in row blocks: received rows [src, src + rows)
  // (source-rank order) are dispatched rows [dst, dst + rows) (local-expert
  // order). Empty at degree 1.
  const std::vector<RowBlock>& regroup() const { return regroup_; }
  bool dispatched() const { return dispatched_; }
  bool combined() const { return y_layout_.defined(); }

 private:
  template <int>
  friend class ExpertParallel;

  ops::MoeLayout layout_;
  int64_t received_rows_ = 0;
  int64_t hidden_ = 0;
  bool dispatched_ = false;
  Tensor offsets_;  // view of offsets_cache_ (or the layout's offsets at degree 1)
  std::vector<int32_t> counts_;
  std::vector<int64_t> send_rows_, recv_rows_, local_counts_;
  std::vector<RowBlock> regroup_;
  Tensor y_layout_;  // combine: the expert outputs in layout order [N, H'] (for combine_backward)
  Tensor weights_;   // combine: the router weights [T, k]
  // Capacity caches (see detail::rows_view).
  Tensor counts_cache_, offsets_cache_, row_to_copy_cache_, copy_to_row_cache_, local_offsets_cache_;
  Tensor layout_workspace_cache_;  // moe_build_layout's CUDA scratch
  Tensor all_counts_cache_;        // [ep·E] i32 on the device: the all_gather output
  Tensor host_counts_cache_;       // [ep·E] i32 pinned (CUDA data only)
  Tensor host_offsets_cache_;      // [E_local + 1] i32 pinned (CUDA data only)
  Tensor send_cache_;              // [N, H]: permuted x, then (combine) the returned expert outputs
  Tensor recv_cache_;              // [R, H]: rows in source-rank order
  Tensor grouped_cache_;           // [R, H]: dispatch's output
  Tensor y_cache_;                 // [T, H']: combine's output when none is given
};

// Models nn::TokenDispatcher (nn/token_dispatcher.hpp): a SparseMoeBlock
// built with it exchanges its tokens over the ep group.
template <>
class ExpertParallel<dynamic_degree> {
 public:
  using Handle = DispatchHandle;
  using CombineGrads = nn::CombineGrads;
  using ErasedAs = ExpertParallel<dynamic_degree>;  // nn::DispatcherRef holds every degree as this type

  // The ep group is `comm` (which must outlive this object); num_experts E
  // must divide by its size.
  ExpertParallel(comm::Comm& comm, int64_t num_experts) : comm_(&comm), num_experts_(num_experts) {
    const int ep = comm.size();
    SLIME_CHECK(num_experts >= 1, "ExpertParallel: num_experts must be positive, got ", num_experts);
    SLIME_CHECK(num_experts % ep == 0, "ExpertParallel: num_experts = ", num_experts,
                " does not divide over the ep group of ", ep, " ranks (each rank owns E / ep experts)");
    num_local_ = num_experts / ep;
    first_ = int64_t(comm.rank()) * num_local_;
  }
  // The ep axis of `mesh` (which must outlive this object).
  ExpertParallel(const comm::Mesh& mesh, int64_t num_experts)
      : ExpertParallel(mesh.comm(comm::Axis::ep), num_experts) {}

  ExpertParallel(const ExpertParallel&) = delete;
  ExpertParallel& operator=(const ExpertParallel&) = delete;
  virtual ~ExpertParallel() = default;

  comm::Comm& comm() const { return *comm_; }
  int size() const { return comm_->size(); }
  int rank() const { return comm_->rank(); }
  Device device() const { return comm_->device(); }
  int64_t num_experts() const { return num_experts_; }
  int64_t num_local_experts() const { return num_local_; }
  // This rank's experts are [first_expert(), first_expert() + num_local_experts()).
  int64_t first_expert() const { return first_; }
  // The whole stack [E, ...] of an expert weight from every ep rank's slice
  // [E_local, ...] (collective over the ep group: all ranks call it, in the
  // same order). For the rollout engine or an export, which hold all experts.
  // Degree 1: `slice` itself.
  Tensor gather_expert_stack(const Tensor& slice, const Stream& stream = {}) const {
    SLIME_CHECK(slice.defined() && slice.dim() >= 1 && slice.size(0) == num_local_,
                "ExpertParallel::gather_expert_stack: the slice must be [E_local = ", num_local_, ", ...], got ",
                slice.defined() ? slice.str() : std::string("an undefined tensor"));
    SLIME_CHECK(slice.device() == device(), "ExpertParallel::gather_expert_stack: the slice is ", slice.str(),
                " but the ep communicator works on ", device());
    if (size() == 1) return slice;
    std::vector<int64_t> dims(slice.shape().begin(), slice.shape().end());
    dims[0] = num_experts_;
    Tensor full = Tensor::empty(Shape(dims), slice.dtype(), slice.device(), stream);
    Tensor flat = full.flatten();
    comm_->all_gather(slice.flatten(), flat, stream);
    return full;
  }

  // The rank that owns global expert e.
  int owner(int64_t expert) const {
    SLIME_CHECK(expert >= 0 && expert < num_experts_, "ExpertParallel::owner: expert ", expert, " is not in [0, ",
                num_experts_, ")");
    return int(expert / num_local_);
  }

  // Sends the T·k copies of x [T, H] (f32 or bf16) routed by indices [T, k]
  // (i32, global expert ids) to the ranks owning their experts. Returns the
  // rows for this rank's experts [R, H], grouped by local expert (offsets:
  // h.local_offsets()); a view of h's buffer.
  Tensor dispatch(const Tensor& x, const Tensor& indices, DispatchHandle& h, const Stream& stream = {}) {
    constexpr std::string_view op = "ExpertParallel::dispatch";
    SLIME_CHECK(x.defined() && x.dim() == 2, op, ": x must be 2-D [tokens, hidden], got ", x.str());
    SLIME_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::bf16, op, ": x must be f32 or bf16, got ", x.str());
    SLIME_CHECK(x.device() == device(), op, ": x is ", x.str(), " but the ep communicator works on ", device());
    SLIME_CHECK(indices.defined() && indices.dim() == 2 && indices.dtype() == DType::i32, op,
                ": indices must be i32 [tokens, k], got ", indices.str());
    SLIME_CHECK(indices.size(0) == x.size(0), op, ": indices ", indices.str(), " must have one row per token of x ",
                x.str());
    SLIME_CHECK(indices.size(1) >= 1 && indices.size(1) <= num_experts_, op, ": k = ", indices.size(1),
                " (indices dim 1) must be in [1, num_experts = ", num_experts_, "]");
    check_same_device(x, indices, "ExpertParallel::dispatch: x", "indices");
    const Device dev = x.device();
    const Stream s = ops::detail::memops::stream_for(dev, stream, op);
    const int64_t T = x.size(0), k = indices.size(1), H = x.size(1), N = T * k, E = num_experts_;
    const int ep = size();

    h.dispatched_ = false;
    h.y_layout_ = Tensor();
    h.weights_ = Tensor();
    h.hidden_ = H;
    // 1. Layout over the global experts (capacity-reused tensors).
    ops::MoeLayout& l = h.layout_;
    l.tokens = T;
    l.topk = k;
    l.num_experts = E;
    l.counts = detail::vec_view(h.counts_cache_, E, DType::i32, dev, s);
    l.offsets = detail::vec_view(h.offsets_cache_, E + 1, DType::i32, dev, s);
    l.row_to_copy = detail::vec_view(h.row_to_copy_cache_, N, DType::i32, dev, s);
    l.copy_to_row = detail::vec_view(h.copy_to_row_cache_, N, DType::i32, dev, s);
    l.workspace = ops::moe_layout_workspace(h.layout_workspace_cache_, l, dev, s);
    ops::moe_build_layout(indices, l, s);
    // 2. Permute into layout order.
    const Tensor send = detail::rows_view(h.send_cache_, N, H, x.dtype(), dev, s);
    ops::moe_permute_forward(x, l, send, s);

    h.counts_.clear();
    h.send_rows_.clear();
    h.recv_rows_.clear();
    h.local_counts_.clear();
    h.regroup_.clear();
    if (ep == 1) {  // the identity: no exchange, no host synchronisation
      h.offsets_ = l.offsets;
      h.received_rows_ = N;
      h.dispatched_ = true;
      return send;
    }

    // 3-4. Counts of every rank, on the host.
    Tensor all_counts = detail::vec_view(h.all_counts_cache_, int64_t(ep) * E, DType::i32, dev, s);
    comm_->all_gather(l.counts, all_counts, s);
    const int32_t* counts = nullptr;
    if (dev.is_cpu()) {
      counts = all_counts.data<int32_t>();
    } else {
      if (!h.host_counts_cache_.defined() || h.host_counts_cache_.numel() != all_counts.numel())
        h.host_counts_cache_ = Tensor::empty_pinned(all_counts.shape(), DType::i32);
      h.host_counts_cache_.copy_from(all_counts, s);
      s.synchronize();
      counts = h.host_counts_cache_.data<int32_t>();
    }
    h.counts_.assign(counts, counts + int64_t(ep) * E);
    plan(h);

    // Local offsets on the device.
    h.offsets_ = detail::vec_view(h.local_offsets_cache_, num_local_ + 1, DType::i32, dev, s);
    if (dev.is_cpu()) {
      write_offsets(h, h.offsets_.data<int32_t>());
    } else {
      if (!h.host_offsets_cache_.defined() || h.host_offsets_cache_.numel() != num_local_ + 1)
        h.host_offsets_cache_ = Tensor::empty_pinned(Shape{num_local_ + 1}, DType::i32);
      write_offsets(h, h.host_offsets_cache_.data<int32_t>());
      h.offsets_.copy_from(h.host_offsets_cache_, s);
    }

    // 5. Exchange the rows. 6. Regroup by local expert.
    const int64_t R = h.received_rows_;
    Tensor recv = detail::rows_view(h.recv_cache_, R, H, x.dtype(), dev, s);
    comm_->all_to_all_v(send, h.send_rows_, recv, h.recv_rows_, s);
    const Tensor grouped = detail::rows_view(h.grouped_cache_, R, H, x.dtype(), dev, s);
    detail::copy_blocks(h.regroup_, recv, grouped, /*inverse=*/false, s);
    h.dispatched_ = true;
    return grouped;
  }

  // y [T, H'] = Σ_j weights[t, j] · (the expert output of copy (t, j)), from
  // this rank's expert outputs [R, H'] in dispatch's grouped order (f32 or
  // bf16) and the router weights [T, k] (bf16 or f32). Written into `y` when
  // given (expert_out's dtype or f32), else into h's buffer. Saves what
  // combine_backward needs in h.
  Tensor combine(const Tensor& expert_out, const Tensor& weights, DispatchHandle& h, const Stream& stream = {},
                 const Tensor& y = {}) {
    constexpr std::string_view op = "ExpertParallel::combine";
    check_dispatched(h, op);
    check_rows(expert_out, "expert_out", h.received_rows_, -1, op);
    SLIME_CHECK(weights.defined() && weights.shape() == Shape({h.tokens(), h.topk()}), op, ": weights must be [",
                h.tokens(), ", ", h.topk(), "] (the router's), got ", weights.str());
    const Device dev = expert_out.device();
    const Stream s = ops::detail::memops::stream_for(dev, stream, op);
    const int64_t H = expert_out.size(1);
    h.y_layout_ = Tensor();
    Tensor y_layout = expert_out;
    if (size() > 1) {
      const Tensor recv = detail::rows_view(h.recv_cache_, h.received_rows_, H, expert_out.dtype(), dev, s);
      detail::copy_blocks(h.regroup_, recv, expert_out, /*inverse=*/true, s);
      y_layout = detail::rows_view(h.send_cache_, h.layout_.rows(), H, expert_out.dtype(), dev, s);
      comm_->all_to_all_v(recv, h.recv_rows_, y_layout, h.send_rows_, s);
    }
    const Tensor out = y.defined() ? y : detail::rows_view(h.y_cache_, h.tokens(), H, expert_out.dtype(), dev, s);
    ops::moe_unpermute_forward(y_layout, weights, h.layout_, out, s);
    h.y_layout_ = y_layout;
    h.weights_ = weights;
    return out;
  }

  // The backward of combine, both written: from dy [T, H'] (expert_out's
  // dtype), the gradients of the expert outputs and of the router weights.
  // Views of this object's scratch (valid until its next combine_backward).
  CombineGrads combine_backward(const Tensor& dy, const DispatchHandle& h, const Stream& stream = {}) {
    constexpr std::string_view op = "ExpertParallel::combine_backward";
    SLIME_CHECK(h.combined(), op, ": the handle has no combine (call combine before its backward)");
    const Tensor& y_layout = h.y_layout_;
    const int64_t H = y_layout.size(1);
    check_rows(dy, "dy", h.tokens(), H, op);
    SLIME_CHECK(dy.dtype() == y_layout.dtype(), op, ": dy must be ", dtype_name(y_layout.dtype()),
                " (the expert outputs' dtype), got ", dy.str());
    const Device dev = dy.device();
    const Stream s = ops::detail::memops::stream_for(dev, stream, op);
    const Tensor dy_layout = detail::rows_view(b_layout_, h.layout_.rows(), H, dy.dtype(), dev, s);
    const Tensor dweights = detail::rows_view(b_dweights_, h.tokens(), h.topk(), h.weights_.dtype(), dev, s);
    ops::moe_unpermute_backward(dy, y_layout, h.weights_, h.layout_, dy_layout, dweights, s);
    if (size() == 1) return {dy_layout, dweights};
    Tensor recv = detail::rows_view(b_recv_, h.received_rows_, H, dy.dtype(), dev, s);
    comm_->all_to_all_v(dy_layout, h.send_rows_, recv, h.recv_rows_, s);
    const Tensor grouped = detail::rows_view(b_grouped_, h.received_rows_, H, dy.dtype(), dev, s);
    detail::copy_blocks(h.regroup_, recv, grouped, /*inverse=*/false, s);
    return {grouped, dweights};
  }

  // The backward of dispatch: dx [T, H] (written) = Σ over each token's k
  // copies of the gradient of its dispatched row, from d_rows [R, H] in
  // dispatch's grouped order. Into `dx` when given (d_rows' dtype or f32),
  // else into this object's scratch (valid until its next dispatch_backward).
  Tensor dispatch_backward(const Tensor& d_rows, const DispatchHandle& h, const Stream& stream = {},
                           const Tensor& dx = {}) {
    constexpr std::string_view op = "ExpertParallel::dispatch_backward";
    check_dispatched(h, op);
    check_rows(d_rows, "d_rows", h.received_rows_, h.hidden_, op);
    const Device dev = d_rows.device();
    const Stream s = ops::detail::memops::stream_for(dev, stream, op);
    const int64_t H = h.hidden_;
    Tensor dx_layout = d_rows;
    if (size() > 1) {
      const Tensor recv = detail::rows_view(b_recv_, h.received_rows_, H, d_rows.dtype(), dev, s);
      detail::copy_blocks(h.regroup_, recv, d_rows, /*inverse=*/true, s);
      dx_layout = detail::rows_view(b_layout_, h.layout_.rows(), H, d_rows.dtype(), dev, s);
      comm_->all_to_all_v(recv, h.recv_rows_, dx_layout, h.send_rows_, s);
    }
    const Tensor out = dx.defined() ? dx : detail::rows_view(b_dx_, h.tokens(), H, d_rows.dtype(), dev, s);
    ops::moe_permute_backward(dx_layout, h.layout_, out, /*accumulate=*/false, s);
    return out;
  }

 private:
  void check_dispatched(const DispatchHandle& h, std::string_view op) const {
    SLIME_CHECK(h.dispatched_, op, ": the handle holds no dispatch (call dispatch first)");
    SLIME_CHECK(h.layout_.num_experts == num_experts_, op, ": the handle was dispatched for ", h.layout_.num_experts,
                " experts, this ExpertParallel has ", num_experts_);
  }

  // t [rows, cols] (cols < 0: any), f32 or bf16, on the communicator's device.
  void check_rows(const Tensor& t, std::string_view name, int64_t rows, int64_t cols, std::string_view op) const {
    SLIME_CHECK(t.defined(), op, ": ", name, " is undefined");
    SLIME_CHECK(t.dim() == 2 && t.size(0) == rows && (cols < 0 || t.size(1) == cols), op, ": ", name,
                " must have shape [", rows, ", ", cols < 0 ? std::string("hidden") : std::to_string(cols), "], got ",
                t.str());
    SLIME_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, op, ": ", name, " must be f32 or bf16, got ",
                t.str());
    SLIME_CHECK(t.device() == device(), op, ": ", name, " is ", t.str(), " but the ep communicator works on ",
                device());
  }

  // From h.counts_ ([ep, E] on the host): row counts per peer and per local
  // expert, and the regrouping blocks.
  void plan(DispatchHandle& h) {
    const int ep = size(), me = rank();
    const int64_t E = num_experts_, El = num_local_;
    const int32_t* c = h.counts_.data();
    auto count = [&](int src, int64_t expert) { return int64_t(c[int64_t(src) * E + expert]); };
    h.send_rows_.assign(std::size_t(ep), 0);
    h.recv_rows_.assign(std::size_t(ep), 0);
    h.local_counts_.assign(std::size_t(El), 0);
    for (int r = 0; r < ep; ++r)
      for (int64_t i = 0; i < El; ++i) {
        h.send_rows_[std::size_t(r)] += count(me, int64_t(r) * El + i);
        h.recv_rows_[std::size_t(r)] += count(r, first_ + i);
        h.local_counts_[std::size_t(i)] += count(r, first_ + i);
      }
    int64_t total = 0;
    cursor_.assign(std::size_t(ep), 0);  // where source r's next local expert starts in the received rows
    for (int r = 0; r < ep; ++r) {
      cursor_[std::size_t(r)] = total;
      total += h.recv_rows_[std::size_t(r)];
    }
    SLIME_CHECK(total <= std::numeric_limits<int32_t>::max(), "ExpertParallel::dispatch: ", total,
                " rows received by rank ", me, " do not fit the i32 offsets");
    h.received_rows_ = total;
    // Grouped order: local expert, then source rank, then the sender's order.
    int64_t dst = 0;
    for (int64_t i = 0; i < El; ++i)
      for (int r = 0; r < ep; ++r) {
        const int64_t rows = count(r, first_ + i), src = cursor_[std::size_t(r)];
        cursor_[std::size_t(r)] += rows;
        if (rows == 0) continue;
        if (!h.regroup_.empty() && h.regroup_.back().src + h.regroup_.back().rows == src) {
          h.regroup_.back().rows += rows;  // contiguous on both sides (dst always is)
        } else {
          h.regroup_.push_back({src, dst, rows});
        }
        dst += rows;
      }
  }

  void write_offsets(const DispatchHandle& h, int32_t* offsets) const {
    offsets[0] = 0;
    for (int64_t i = 0; i < num_local_; ++i) offsets[i + 1] = int32_t(offsets[i] + h.local_counts_[std::size_t(i)]);
  }

  comm::Comm* comm_;
  int64_t num_experts_, num_local_ = 0, first_ = 0;
  std::vector<int64_t> cursor_;  // plan()'s host scratch
  // Backward scratch (see detail::rows_view): dy / dx in layout order [N, H],
  // rows in source-rank order [R, H], d expert outputs [R, H], dweights [T, k],
  // dx [T, H].
  Tensor b_layout_, b_recv_, b_grouped_, b_dweights_, b_dx_;
};

// ExpertParallel with a degree fixed at compile time: checks at construction
// that the ep group has N ranks. Derives from ExpertParallel<>, so an
// ExpertParallel<>* (or &) accepts either.
template <int N>
class ExpertParallel : public ExpertParallel<dynamic_degree> {
  static_assert(N > 0, "ExpertParallel<N>: the degree N must be positive (or dynamic_degree for a runtime degree)");

 public:
  static constexpr int degree = N;

  ExpertParallel(comm::Comm& comm, int64_t num_experts) : ExpertParallel<>(checked(comm), num_experts) {}
  ExpertParallel(const comm::Mesh& mesh, int64_t num_experts)
      : ExpertParallel<>(checked(mesh.comm(comm::Axis::ep)), num_experts) {}

 private:
  static comm::Comm& checked(comm::Comm& comm) {
    SLIME_CHECK(comm.size() == N, "ExpertParallel<", N, ">: the ep group has ", comm.size(), " ranks, expected ", N);
    return comm;
  }
};

static_assert(nn::TokenDispatcher<ExpertParallel<>>);

}  // namespace slime::parallel
