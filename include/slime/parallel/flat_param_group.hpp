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
// comes from and goes back to Sharded's BufferCache (buffer_cache.hpp) on
// `c`, after the work queued on `s` that reads it (params_free), so memory
// is reused in stream order and a steady-state step allocates nothing.
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
#include "slime/parallel/buffer_cache.hpp"
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
  void issue_gather(const Stream& c, Event& params_updated, BufferCache& cache) {
    if (gathered.defined()) return;
    params_updated.wait(c);
    const int64_t n = layout.gathered_numel();
    Tensor rank_major = cache.acquire(n, compute_dtype, device, c);
    shard->all_gather(compute, rank_major, c);
    gathered = cache.acquire(n, compute_dtype, device, c);
    unpack_rank_major(rank_major, gathered, layout, c);
    cache.release(std::move(rank_major));  // the next use is on `c` too
    gathered_ready.record(c);
    install_values();
  }

  // Drops the gathered buffer once the work queued on `s` is done.
  void release_gathered(const Stream& s, const Stream& c, BufferCache& cache) {
    if (aliased || !gathered.defined()) return;
    for (nn::Parameter* p : params) p->value = Tensor{};
    params_free.record(s);
    params_free.wait(c);
    cache.release(std::move(gathered));
  }

  // The full fp32 gradient buffer exists (zero when new), `s` ordered after
  // its zero-fill.
  void ensure_full_grad(const Stream& s, const Stream& c, BufferCache& cache) {
    if (!full_grad.defined()) {
      full_grad = cache.acquire(layout.gathered_numel(), DType::f32, device, c);
      full_grad.zero_(c);
      grad_ready.record(c);
      install_grads();
    }
    grad_ready.wait(s);
  }

  void release_full_grad(const Stream& s, const Stream& c, BufferCache& cache) {
    for (nn::Parameter* p : params) p->grad = Tensor{};
    params_free.record(s);
    params_free.wait(c);
    cache.release(std::move(full_grad));
  }

  // Reduces the full gradient into the grad shard on `c`, after the work
  // queued on `s` (in dtype `rd`, combined with `op`), then frees it;
  // records `grads_reduced` on `c`.
  // Every temporary comes from `cache` and goes back to it once its last
  // use is queued on `c`.
  void reduce(const Stream& s, const Stream& c, DType rd, comm::ReduceOp op, Event& grads_reduced, BufferCache& cache) {
    if (direct_grads || !full_grad.defined()) return;
    params_free.record(s);
    params_free.wait(c);
    const int64_t n = layout.shard_numel();
    std::vector<Tensor> temps;  // back to the cache at the end
    const auto temp = [&](int64_t numel, DType dtype) {
      temps.push_back(cache.acquire(numel, dtype, device, c));
      return temps.back();
    };
    Tensor src = full_grad;
    if (rd != DType::f32) {
      src = temp(full_grad.numel(), rd);
      ops::cast(full_grad, src, c);
    }
    Tensor out;
    if (shard) {
      Tensor rank_major = temp(layout.gathered_numel(), rd);
      pack_rank_major(src, rank_major, layout, c);
      out = temp(n, rd);
      shard->reduce_scatter(rank_major, out, op, c);
    } else {
      out = src;  // one rank per shard group: the layout is the shard's
    }
    if (replicate) replicate->all_reduce(out, op, c);
    if (grad_scale != 1.f) ops::scale(out, grad_scale, out, c);
    if (rd != DType::f32) {
      Tensor f = temp(n, DType::f32);
      ops::cast(out, f, c);
      out = f;
    }
    ops::add_(grad_shard, out, c);
    for (nn::Parameter* p : params) p->grad = Tensor{};
    src = out = Tensor{};
    for (Tensor& t : temps) cache.release(std::move(t));
    cache.release(std::move(full_grad));
    grads_reduced.record(c);
  }
};

}  // namespace slime::parallel
