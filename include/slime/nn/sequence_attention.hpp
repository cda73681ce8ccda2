// slime/nn/sequence_attention.hpp: SequenceAttention, the attention of a
// training forward whose sequences are split over several ranks (sequence /
// context parallelism: parallel::ContextParallel runs Ulysses, ring attention
// or both behind it).
//
// Attention::forward calls it instead of the local kernel when a model has one
// (Qwen3Model::set_sequence_attention; every decoder layer gets it), with the
// batch's own keys (SelfKv): this rank holds some tokens of each sequence
// (the layout the implementation planned, e.g. zigzag chunks), the rest of
// the layer is per token and runs unchanged. The implementation keeps what
// its backward needs in `saved` (which lives in the layer's context), so it
// decides what to keep (e.g. the head-sharded tensors after Ulysses'
// all-to-all, not this rank's sequence-sharded ones).
//
// Shapes (this rank's T tokens, after the q/k norms and RoPE): q [T, Hq, d],
// k, v [T, Hkv, d] in the activations' dtype; o [T, Hq, d] written. backward
// writes dq, dk, dv (=) of those shapes from d_o [T, Hq, d].
//
// nn/ declares the interface only; the implementations are in parallel/.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "slime/core/tensor.hpp"
#include "slime/nn/packed_batch.hpp"

namespace slime::nn {

class SequenceAttention {
 public:
  virtual ~SequenceAttention() = default;

  // What a forward keeps for its backward: tensors and any state of the
  // implementation's own (e.g. the plan of the batch it ran).
  struct Saved {
    std::vector<Tensor> tensors;
    std::shared_ptr<const void> state;
    bool empty() const { return tensors.empty() && state == nullptr; }
    void clear() {
      tensors.clear();
      state.reset();
    }
  };

  // o = attention of this rank's queries over every rank's keys of the same
  // sequence (causal in the sequence's own positions). `batch` is this rank's
  // part of the batch (checked against the plan the implementation holds).
  virtual void forward(const Tensor& q, const Tensor& k, const Tensor& v, const PackedBatch& batch, const Tensor& o,
                       Saved& saved, const Stream& stream) = 0;

  // dq, dk, dv (written) from d_o and what forward saved.
  virtual void backward(const Saved& saved, const Tensor& d_o, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                        const Stream& stream) = 0;

  // The workspaces it keeps between calls (the model's for_each_workspace
  // visits them once, so nn::release_workspaces and runtime offload free them).
  virtual void for_each_workspace(const std::function<void(Tensor&)>& f) { (void)f; }
};

}  // namespace slime::nn
