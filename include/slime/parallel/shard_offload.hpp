// slime/parallel/shard_offload.hpp: ShardOffload, the runtime offload of a
// Sharded model's flat parameter groups (flat_param_group.hpp) and of its
// optimizer's state: offload copies every device-resident buffer to pinned
// host memory and frees it, onload brings it back bit for bit (plain
// copies, no casts). What moves, and the stream and memory rules, are
// described at the top of sharded.hpp, which calls these two at a step or
// micro-batch boundary after ordering its streams.
//
// The pinned buffers are allocated by the first offload and reused (onload
// keeps them). With cpu_offload the master shards and the optimizer state
// are on the host already (they stay), and the compute and grad shards move
// into the groups' pinned staging shards. A group that does not train (a
// frozen unit, or any unit of a frozen model) has no grad shard and no
// state; its master changes only through Sharded::load_parameter, so an
// offload whose host copy of it is current does not copy it (a frozen model
// then copies nothing).
#pragma once

#include <cstddef>
#include <vector>

#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/module.hpp"
#include "slime/optim/optimizer.hpp"
#include "slime/parallel/flat_param_group.hpp"

namespace slime::parallel {

class ShardOffload {
 public:
  // Device -> pinned host for every group, on `s` (ordered after all work
  // on the buffers), then waits for the copies and frees the device buffers
  // in order on the communication stream `c`. `masters_current`: the host
  // masters of the last cycle are still equal for the groups that do not
  // train (nothing but a load changes those). Returns the bytes copied.
  template <optim::ShardOptimizer Optimizer>
  std::size_t offload(std::vector<FlatParamGroup>& groups, Optimizer& optimizer, bool cpu_offload, bool masters_current,
                      const Stream& s, const Stream& c, Event& turn) {
    constexpr std::size_t k = Optimizer::state_per_param;
    host_.resize(groups.size());
    std::size_t bytes = 0;
    auto down = [&](Tensor& host, const Tensor& dev) {
      if (!host.defined()) host = Tensor::empty_pinned(dev.shape(), dev.dtype());
      host.copy_from(dev, s);
      bytes += dev.nbytes();
    };
    // The t-th trainable group's entries: [k t, k t + k).
    std::vector<std::pair<std::string, Tensor>> state;
    if (!cpu_offload) state = optimizer.state_tensors();
    std::size_t t = 0;
    for (std::size_t i = 0; i < groups.size(); ++i) {
      FlatParamGroup& g = groups[i];
      HostCopy& h = host_[i];
      if (!cpu_offload && !(masters_current && !g.trainable && h.master.defined())) down(h.master, g.master);
      if (g.separate_compute) down(g.host_compute, g.compute);
      if (g.grad_shard.defined()) down(g.host_grad, g.grad_shard);
      h.full_grad_offloaded = !g.direct_grads && g.full_grad.defined();
      if (h.full_grad_offloaded) down(h.full_grad, g.full_grad);
      if (!state.empty() && g.trainable) {
        h.state.resize(k);
        for (std::size_t j = 0; j < k; ++j) down(h.state[j], state[k * t + j].second);
      }
      if (g.trainable) ++t;
    }
    state.clear();
    s.synchronize();
    // The device buffers go (freed in order on the communication stream,
    // where they were allocated, after the copies).
    turn.record(s);
    turn.wait(c);
    for (std::size_t i = 0; i < groups.size(); ++i) {
      FlatParamGroup& g = groups[i];
      for (nn::Parameter* p : g.params) {
        p->value = Tensor{};
        p->grad = Tensor{};
      }
      g.gathered = Tensor{};
      g.full_grad = Tensor{};
      g.compute = Tensor{};
      g.grad_shard = Tensor{};
      if (!cpu_offload) g.master = host_[i].master;  // checkpoint reads see the host copy
    }
    if (!cpu_offload) optimizer.release_state();  // the step count stays; onload restores the state
    return bytes;
  }

  // Pinned host -> fresh device buffers on `c` (stream-ordered), the views
  // installed again; the optimizer's state restored into zero state it
  // allocates. The caller orders `c` after its stream before and its stream
  // after `c` afterwards.
  template <optim::ShardOptimizer Optimizer>
  void onload(std::vector<FlatParamGroup>& groups, Optimizer& optimizer, bool cpu_offload, const Stream& c) {
    auto up = [&](const Tensor& host, const Device& device) {
      Tensor t = Tensor::empty(host.shape(), host.dtype(), device, c);
      t.copy_from(host, c);
      return t;
    };
    std::vector<Tensor> masters;
    for (std::size_t i = 0; i < groups.size(); ++i) {
      FlatParamGroup& g = groups[i];
      HostCopy& h = host_[i];
      if (!cpu_offload) g.master = up(h.master, g.device);
      g.compute = g.separate_compute ? up(g.host_compute, g.device) : g.master;
      if (g.trainable) g.grad_shard = up(g.host_grad, g.device);
      if (g.aliased) {
        g.gathered = g.compute;
        g.install_values();
      }
      if (g.direct_grads) {
        g.full_grad = g.grad_shard;
        g.install_grads();
      } else if (h.full_grad_offloaded) {
        g.full_grad = up(h.full_grad, g.device);
        g.install_grads();
        h.full_grad_offloaded = false;
      }
      g.gathered_ready.record(c);
      g.grad_ready.record(c);
      if (g.trainable) masters.push_back(g.master);
    }
    if (!cpu_offload) {
      optimizer.init_state(masters, c);  // zero state on the device, overwritten here
      constexpr std::size_t k = Optimizer::state_per_param;
      auto state = optimizer.state_tensors();
      std::size_t t = 0;  // the trainable groups' index
      for (std::size_t i = 0; i < groups.size(); ++i) {
        if (!groups[i].trainable) continue;
        for (std::size_t j = 0; j < host_[i].state.size(); ++j) state[k * t + j].second.copy_from(host_[i].state[j], c);
        ++t;
      }
    }
  }

  // Pinned bytes held (cpu_offload's own master and staging shards not
  // counted).
  std::size_t host_bytes(const std::vector<FlatParamGroup>& groups, bool cpu_offload) const {
    std::size_t n = 0;
    for (const HostCopy& h : host_) {
      for (const Tensor* t : {&h.master, &h.full_grad})
        if (t->defined()) n += t->nbytes();
      for (const Tensor& t : h.state) n += t.nbytes();
    }
    if (!cpu_offload)
      for (const FlatParamGroup& g : groups)
        for (const Tensor* t : {&g.host_compute, &g.host_grad})
          if (t->defined()) n += t->nbytes();
    return n;
  }

 private:
  // One group's pinned copies (runtime offload; the compute and grad shards'
  // copies are the group's host_compute / host_grad).
  struct HostCopy {
    Tensor master;              // not with cpu_offload (the master is on the host already)
    std::vector<Tensor> state;  // the optimizer's k state tensors of the group
    Tensor full_grad;           // unreduced gradients (f32)
    bool full_grad_offloaded = false;
  };
  std::vector<HostCopy> host_;
};

}  // namespace slime::parallel
