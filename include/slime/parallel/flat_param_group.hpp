// slime/parallel/flat_param_group.hpp: FlatParamGroup, one sharding unit of
// a Sharded model on this rank (the parameters of one nn::Unit): its flat
// buffers, the events that order them, and the steps on one unit that
// Sharded composes with the module's unit hooks: gather (all-gather of the
// compute shards, unpacked into the parameter-major buffer the module's
// values are views of), release, the full gradient (the module's gradients
// are views of it) and reduce (pack, reduce-scatter over the shard group,
// all-reduce over replicas, added to the grad shard). Layout: flat_shard.hpp.
//
// Streams: gathers and reductions run on the communication stream `c`;
// `s` is the compute stream that uses (or used) the buffers. Every buffer
// is allocated and freed on `c`, after the work queued on `s` that reads it
// (params_free), so memory is reused in stream order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/units.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/parallel/flat_shard.hpp"

namespace slime::parallel {

// Which data-parallel group a unit shards over (nn::UnitKind):
//   dense:  every rank holding the same copy of the parameters: on a Mesh
//           with cp or ep > 1 the flattened dp_shard x cp x ep group, since
//           every cp and ep rank holds the same dense parameters.
//   expert: expert weights split over ep_degree > 1 ranks: the unit shards
//           over the ranks holding the same slice (the mesh's dp_shard x cp)
//           and its gradients reduce over those only (the expert's gradient
//           on its ep rank already covers the tokens every ep rank routed to
//           it, through the block's all_to_all).
using ShardGroup = nn::UnitKind;

struct FlatParamGroup {
  std::string name;
  std::vector<nn::Parameter*> params;
  ShardGroup group = ShardGroup::dense;
  comm::Comm* shard = nullptr;      // null: one rank per shard group
  comm::Comm* replicate = nullptr;  // null: no replicas
  bool aliased = false;             // gathered buffer = compute shard (shard group of one)
  bool direct_grads = false;        // gradients accumulate straight into the grad shard
  bool separate_compute = false;    // compute shard distinct from the master shard
  // false: no gradients and no optimizer state (a frozen unit of a trained
  // model, nn::Unit::trainable, or any unit of a frozen model): no grad
  // shard, no full gradient, no reduction.
  bool trainable = true;
  float grad_scale = 1.f;  // applied after the reduction (avg: cp, or cp / ep for expert units)
  Device device;           // where the compute shard, gathered buffer and gradients live
  DType compute_dtype = DType::f32;
  FlatShardLayout layout;
  Tensor master, compute, grad_shard;  // [shard_numel]; grad_shard undefined when not trainable
  // Pinned: cpu_offload's staging shards (f32, compute dtype), made by
  // Sharded's constructor; with runtime offload alone, the grad and compute
  // shards' copies, made by the first offload (shard_offload.hpp).
  Tensor host_grad, host_compute;
  Tensor gathered;   // defined while gathered (views installed)
  Tensor full_grad;  // defined while unreduced gradients accumulate (views installed)
  Event gathered_ready, grad_ready, params_free;

  // This rank's index in the shard group.
  int rank() const { return shard ? shard->rank() : 0; }

  void install_values() {
    const auto& es = layout.entries();
    for (std::size_t i = 0; i < es.size(); ++i)
      params[i]->value = gathered.view(layout.gathered_offset(i), es[i].shape);
  }
  void install_grads() {
    const auto& es = layout.entries();
    for (std::size_t i = 0; i < es.size(); ++i)
      params[i]->grad = full_grad.view(layout.gathered_offset(i), es[i].shape);
  }

  // This rank's rows of `full` (parameter e of this unit) into the master
  // (and compute) shard, cast to their dtypes, on `s`.
  void copy_rows(const FlatShardEntry& e, const Tensor& full, const Stream& s) {
    const int r = rank();
    const int64_t b = e.begin(r), n = e.end(r) - b;
    if (n == 0) return;
    const Tensor src = full.reshape(Shape{e.numel}).view(b, Shape{n});
    Tensor m = master.view(e.shard_offset, Shape{n});
    if (m.device() == src.device()) {
      ops::cast(src, m, s);
    } else {  // an offloaded master: cast on the device, then download (and wait: not a hot path)
      Tensor tmp = Tensor::empty({n}, m.dtype(), device, s);
      ops::cast(src, tmp, s);
      m.copy_from(tmp, s);
      s.synchronize();
    }
    if (separate_compute) ops::cast(src, compute.view(e.shard_offset, Shape{n}), s);
  }

  // Queues the all-gather on `c` after `params_updated` (no-op when gathered
  // or aliased).
  void issue_gather(const Stream& c, Event& params_updated) {
    if (gathered.defined()) return;
    params_updated.wait(c);
    const int64_t n = layout.gathered_numel();
    Tensor rank_major = Tensor::empty({n}, compute_dtype, device, c);
    shard->all_gather(compute, rank_major, c);
    gathered = Tensor::empty({n}, compute_dtype, device, c);
    unpack_rank_major(rank_major, gathered, layout, c);
    gathered_ready.record(c);
    install_values();
  }

  // Drops the gathered buffer once the work queued on `s` is done.
  void release_gathered(const Stream& s, const Stream& c) {
    if (aliased || !gathered.defined()) return;
    for (nn::Parameter* p : params) p->value = Tensor{};
    params_free.record(s);
    params_free.wait(c);
    gathered = Tensor{};
  }

  // The full fp32 gradient buffer exists (zero when new), `s` ordered after
  // its zero-fill.
  void ensure_full_grad(const Stream& s, const Stream& c) {
    if (!full_grad.defined()) {
      full_grad = Tensor::zeros({layout.gathered_numel()}, DType::f32, device, c);
      grad_ready.record(c);
      install_grads();
    }
    grad_ready.wait(s);
  }

  void release_full_grad(const Stream& s, const Stream& c) {
    for (nn::Parameter* p : params) p->grad = Tensor{};
    params_free.record(s);
    params_free.wait(c);
    full_grad = Tensor{};
  }

  // Reduces the full gradient into the grad shard on `c`, after the work
  // queued on `s` (in dtype `rd`, combined with `op`), then frees it;
  // records `grads_reduced` on `c`.
  void reduce(const Stream& s, const Stream& c, DType rd, comm::ReduceOp op, Event& grads_reduced) {
    if (direct_grads || !full_grad.defined()) return;
    params_free.record(s);
    params_free.wait(c);
    const int64_t n = layout.shard_numel();
    Tensor src = full_grad;
    if (rd != DType::f32) {
      src = Tensor::empty(full_grad.shape(), rd, device, c);
      ops::cast(full_grad, src, c);
    }
    Tensor out;
    if (shard) {
      Tensor rank_major = Tensor::empty({layout.gathered_numel()}, rd, device, c);
      pack_rank_major(src, rank_major, layout, c);
      out = Tensor::empty({n}, rd, device, c);
      shard->reduce_scatter(rank_major, out, op, c);
    } else {
      out = src;  // one rank per shard group: the layout is the shard's
    }
    if (replicate) replicate->all_reduce(out, op, c);
    if (grad_scale != 1.f) ops::scale(out, grad_scale, out, c);
    if (rd != DType::f32) {
      Tensor f = Tensor::empty({n}, DType::f32, device, c);
      ops::cast(out, f, c);
      out = f;
    }
    ops::add_(grad_shard, out, c);
    for (nn::Parameter* p : params) p->grad = Tensor{};
    full_grad = Tensor{};
    grads_reduced.record(c);
  }
};

}  // namespace slime::parallel
