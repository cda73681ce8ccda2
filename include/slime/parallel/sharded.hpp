// slime/parallel/sharded.hpp: Sharded<Module, Strategy, Optimizer>, fully
// sharded data parallelism (FSDP2-style per-parameter dim-0 sharding) with
// mixed precision, prefetched all-gathers, overlapped reduce-scatters,
// gradient accumulation, an optimizer on the master shards
// (optim::ShardOptimizer: optim::AdamW by default, constructed from the
// optim::AdamWConfig the constructors take; optim::NoOptimizer for a frozen
// model, parallel::Frozen) and access for checkpoints.
//
// The pieces, composed here: flat_shard.hpp (FlatShardLayout: how a unit's
// parameters pack into one flat shard per rank), flat_param_group.hpp
// (FlatParamGroup: one unit's buffers and events, and its gather, release
// and reduce-scatter steps), shard_offload.hpp (ShardOffload: runtime offload
// of the groups and of the optimizer's state) and optim/optimizer.hpp (the
// optimizer concept). Sharded builds one group per unit of the module, drives
// the groups from the module's unit hooks and runs the optimizer over their
// master shards.
//
// What a rank holds (per unit: the module's units(), nn/units.hpp; layout: flat_shard.hpp):
//   master shard   [shard_numel] fp32: what the optimizer (AdamW) updates
//   compute shard  [shard_numel] compute dtype (bf16 on GPUs): the all-gather
//                  input, refreshed by AdamW's param_copies; the master itself
//                  when the dtypes are equal
//   grad shard     [shard_numel] fp32: reduced gradients, summed over
//                  micro-batches until zero_grad
//   optimizer      Optimizer::state_per_param x [shard_numel]: AdamW's two
//                  moments, fp32 (state_tensors(): k per unit, unit-major)
// and, only while a unit computes:
//   gathered       [world * shard_numel] compute dtype: every Parameter::value
//                  of the unit is a view into it, so the nn modules run as is
//   full gradient  [world * shard_numel] fp32: every Parameter::grad a view
// With a shard group of one rank (NoShard, or any strategy on one rank) the
// gathered buffer IS the compute shard and the gradients accumulate straight
// into the grad shard: the wrapper adds no copies, and the numbers are those
// of the unwrapped module.
//
// A step, per micro-batch: forward (units in order: unit u + 1 is gathered on
// the communication stream while u computes; FullShard releases u after its
// forward, except the last unit), token_logprobs / token_logprobs_backward
// (the LM head unit), backward (units in reverse: unit u - 1 is gathered while
// u computes; after u's backward its gradients are packed, reduce-scattered
// (and all-reduced over replicas) and added to the grad shard on the
// communication stream while the backward goes on). Streams are ordered by
// CUDA events: the step never waits on the host. On the CPU (LocalComm) the
// same calls run in order. Then optimizer_step (AdamW on the master shards;
// the optional global grad-norm clip is one all-reduce and one host read).
//
// Frozen models (Optimizer::trains == false: optim::NoOptimizer, the alias
// parallel::Frozen<Module, Strategy>; a reference or teacher model): no grad
// shards, no full gradients, no optimizer state, and the master shard IS the
// compute shard, in the module's dtype (precision.master is not used: a
// frozen bf16 model's rank holds 2 bytes per parameter / N, plus the flat
// layout's padding). backward, token_logprobs_backward, loss_and_backward,
// aux_loss_and_grad, zero_grad, grad_norm, optimizer_step and
// gather_gradient throw "the model is frozen"; cpu_offload is refused;
// forward, logits, token_logprobs, gather_parameter (the module's dtype),
// load_parameter and offload / onload work. With a strategy that reshards
// after forward every unit is released after its forward except the LM
// head's, which logits / token_logprobs release after their call (nothing
// stays gathered between calls; each head call gathers it again); ShardGradOp
// and NoShard keep what they gathered (no backward comes to release it).
// Runtime offload moves only the master shards, and copies them to the host
// only when they changed since the last offload (load_parameter): later
// cycles free the device memory without copying.
//
// Frozen units of a trained model (nn::Unit::trainable == false, e.g. a
// Qwen3-VL tower after set_vision_trainable(false)): the module's backward
// leaves their parameters alone, so their backward hooks gather nothing and
// they get no grad shard, no full gradient and no reduce-scatter; the
// optimizer holds no state for them and never steps them (its parameter list
// is the trainable units' masters, in unit order: state_tensors() and
// unit_trainable(u)); grad_norm and clipping skip them; gather_gradient
// refuses them. They keep the f32 master shard of the trainable units (one
// master dtype for gather_parameter, load_parameter and the checkpoints,
// which hold their masters only). Runtime offload moves their master and
// compute shards, the master only when load_parameter changed it since the
// last offload; cpu_offload keeps their master on the host as the others'.
//
// Gradient accumulation: set_micro_batches(n) says the next n backward passes
// form one step. GradientSync::at_end (default) accumulates full fp32
// gradients locally and reduces once, in the n-th backward;
// GradientSync::every_micro_batch reduces in every backward (less memory,
// more communication).
//
// Composition on a comm::Mesh (axes dp_replicate, dp_shard, cp, ep, from
// the outermost). Expert parallelism (ep > 1, the model built with an
// ExpertParallel over the mesh's ep axis): every rank holds the same dense
// parameters and its ep slice of the experts; the model's units() mark the
// expert stacks of each sparse layer as a unit of their own
// (nn::UnitKind::expert, see nn/units.hpp: a layer is then two units, its
// dense one and its expert one, each with its own flat buffers). Context
// parallelism (cp > 1, the model's sequence attention a ContextParallel over
// the mesh's cp axis, set on the module before wrapping or through module()
// before the first forward; a forward without one is an error): the cp ranks
// of a data-parallel rank share its batch, each holding its plan's rows
// (parallel/context_parallel.hpp), hold the same parameters and compute the
// gradients of their own tokens, so cp is one more axis that gradients sum
// over. The groups (Mesh::flatten, rank order the mesh's):
//   dense units    shard over dp_shard x cp x ep (gradients reduce over every rank)
//   expert units   shard over dp_shard x cp, the ranks holding the same slice
//                  (under EP the all_to_all inside the block already brings
//                  every ep rank's tokens to the expert)
//   HybridShard    replicates both over dp_replicate
//   NoShard        replicates dense units over dp x cp x ep and expert units
//                  over dp x cp (dp: the one data-parallel axis that is not 1)
// With the split-invariant global normaliser (every rank's loss divided by
// the token count of the whole step: all data-parallel ranks' batches, of
// which each cp rank holds its rows; padding rows of weight 0) and
// gradient_reduce = sum the reduced gradient is the unsharded gradient of
// the concatenated batch. This is the setting to use with cp.
// gradient_reduce = avg divides every gradient by the number of
// data-parallel ranks, dp_replicate x dp_shard x ep: every rank of those has
// a batch of its own, while the ranks of a cp group hold partial sums of one
// batch's loss, which add up (so dense gradients are scaled by cp after
// their reduction, expert ones by cp / ep: the avg over their groups divides
// by dp x cp and dp x cp x ep). Under avg a rank's normaliser is its
// data-parallel rank's own batch's token count (on every cp rank: the whole
// batch's, not its rows'), and the step minimises the mean over
// data-parallel ranks of their batches' mean losses. aux_loss_and_grad's
// statistics are all-reduced over the dense shard and replicate groups,
// which together are every rank: each token counts once (with cp, padding
// rows count too: context_parallel.hpp). The grad norm adds the expert shards
// over dp_shard x cp x ep (every expert element lives on one rank there).
// Checkpoint access sees an expert stack as this ep rank's slice: its shape
// is [E_local, ...] (the module's parameter), gather_parameter gathers over
// the expert group and returns the slice, load_parameter takes the slice,
// and parameter_first_expert(name) / LocalShard::first_expert give the
// global index of its first expert (the HF names:
// nn::Parameter::expert_name). Without expert parallelism (or ep = 1)
// Qwen3-MoE models shard like dense ones (the stacked expert weights are
// parameters of their layer's unit).
//
// CPU offload (ShardedOptions::cpu_offload): the master shards live in pinned
// host memory and the AdamW moments in (pageable) host memory: they never
// cross PCIe. optimizer_step copies the fp32 grad shards into pinned host
// buffers on the compute stream, waits for them (one host synchronisation per
// step), runs AdamW on the CPU (optim::cpu::adamw_update: the same roundings
// as the CUDA kernel, so the update equals the device one bit for bit),
// writing the new compute-dtype values into a pinned staging shard, and
// queues their copy into the device compute shard. A rank's device then holds
// only the compute shard (2 bytes per parameter / N in bf16) and the grad
// shard (4 / N) instead of 18 / N; the host holds master (4 / N, pinned),
// staging grad (4 / N, pinned) and compute (2 / N, pinned) shards and the
// moments (8 / N). The compute shard is always a separate buffer (also when
// the master and compute dtypes are equal). for_each_local_shard's masters
// are then host tensors; gather_parameter returns a device tensor as before.
//
// Runtime offload (colocated training and rollout on one GPU): offload()
// moves every device-resident piece of this rank's training state to pinned
// host memory and frees its device memory; onload() brings it back bit for
// bit (plain copies, no casts). With S = this rank's shard elements over all
// units and a bf16 model (f32 model: master and compute are one buffer, 4 S
// less), what moves, device -> pinned host, and back:
//   master shards        4 S   (f32)     unless cpu_offload: pinned already, stay
//   compute shards       2 S   (bf16)    (pinned: cpu_offload's staging shard)
//   grad shards          4 S   (f32)     (pinned: cpu_offload's staging shard)
//   AdamW moments        8 S   (f32)     unless cpu_offload: on the host already, stay
//   unreduced gradients  4 x the unit's gathered elements, only for units that
//                        hold them (GradientSync::at_end between micro-batches,
//                        shard groups > 1); pinned buffers made at first need
// = 18 S bytes each way at a step boundary (6 S with cpu_offload). A shard
// group of one (NoShard replicas, any strategy on one rank, HybridShard's
// replicas) has its gathered buffer = the compute shard: it moves with it.
// Gathered buffers of sharded units (ShardGradOp's kept-gathered parameters,
// FullShard's last unit after a forward) are dropped, not copied: the next
// use all-gathers them again from the compute shards (collective, as always).
// Freed, not copied: the module's op workspaces (attention, RMSNorm and
// embedding backward scratch, sized by the step's tokens, not the
// parameters; nn::release_workspaces), which the next backward allocates
// again. What stays: the streams and events, and whatever the caller holds (a
// forward Context's activations, tensors returned by forward / token_logprobs).
// The pinned buffers are allocated by the first offload and reused: later
// cycles allocate no host memory (onload keeps them; offload_host_bytes()).
// offload synchronises the host with the device (the copies must be done
// before the device memory goes; the caller's stream and the communication
// stream are drained); onload is stream-ordered (uploads on the communication
// stream, the caller's stream waits for them). Device memory is freed in
// stream order into CUDA's pool: memory_stats(device).current_bytes drops at
// once and the pool hands the bytes to the next allocation in this process
// (a colocated rollout::Engine); release_cached_memory(device) returns the
// cached pool memory to the driver, for another process.
// While offloaded: forward, backward, logits, token_logprobs(_backward),
// loss_and_backward, zero_grad, grad_norm, optimizer_step and load_parameter
// throw "Sharded is offloaded: call onload() first"; parameter_names,
// gather_parameter (from the host masters, via device temporaries) and
// for_each_local_shard (host masters) work; optimizer().state_tensors() is
// empty (the moments are in pinned buffers; take handles after onload). The
// nn::Parameter values and gradients of the module are undefined. offload()
// when offloaded and onload() when not are no-ops. Offload at a step or
// micro-batch boundary (after optimizer_step, or after a backward and before
// the next micro-batch or optimizer_step); micro-batch counting carries over.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/causal_lm.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/units.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/optim/adamw.hpp"
#include "slime/optim/grad_clip.hpp"
#include "slime/optim/optimizer.hpp"
#include "slime/parallel/flat_param_group.hpp"
#include "slime/parallel/flat_shard.hpp"
#include "slime/parallel/shard_offload.hpp"
#include "slime/parallel/sharding_strategy.hpp"

namespace slime::parallel {

// One parameter's piece on this rank, for checkpoints: `master` holds the
// elements [begin, end) of the flattened, unpadded parameter of shape `shape`.
struct LocalShard {
  const std::string& name;
  const Shape& shape;
  int64_t begin = 0, end = 0;
  Tensor master;  // [end - begin] view into the master shard (policy.master dtype)
  // Stacked expert weights under expert parallelism: `shape` is this ep
  // rank's slice [E_local, ...], whose entry i is global expert first_expert + i.
  bool expert = false;
  int64_t first_expert = 0;
};

template <class Module, ShardingStrategy Strategy = FullShard, optim::ShardOptimizer Optimizer = optim::AdamW>
class Sharded {
 public:
  using Context = typename Module::Context;
  using OptimizerConfig = typename Optimizer::Config;
  // Whether the model trains: false (optim::NoOptimizer, a frozen model)
  // keeps no gradient buffers and no optimizer state.
  static constexpr bool trains = Optimizer::trains;
  static_assert(nn::HasUnits<Module>,
                "Sharded<Module, Strategy>: Module must expose units() (nn/units.hpp) and for_each_parameter");

  // FullShard / ShardGradOp shard over `comm`; NoShard replicates over it.
  // HybridShard needs the two groups of a Mesh (see below), and so does a
  // model with ExpertParallel of degree > 1. `optimizer`: its config
  // (optim::AdamWConfig for the default optim::AdamW).
  Sharded(Module module, comm::Comm& comm, ShardedOptions options = {},
          OptimizerConfig optimizer = {}) requires(!(Strategy::shards && Strategy::replicates))
      : Sharded(std::move(module), comm_groups(comm), options, optimizer) {}

  // On a mesh: HybridShard shards over dp_shard and replicates over
  // dp_replicate; FullShard / ShardGradOp shard over dp_shard (dp_replicate
  // must be 1: use HybridShard); NoShard replicates over the one of the two
  // axes that is not 1. That data-parallel axis is taken times cp x ep by
  // dense units and times cp by expert units (ExpertParallel over the ep
  // axis, ContextParallel over the cp axis: see the top of this file).
  // Collective over the mesh's world when cp > 1 or ep > 1 (it flattens
  // those groups).
  Sharded(Module module, const comm::Mesh& mesh, ShardedOptions options = {}, OptimizerConfig optimizer = {})
      : Sharded(std::move(module), mesh_groups(mesh), options, optimizer) {}

  Sharded(const Sharded&) = delete;
  Sharded& operator=(const Sharded&) = delete;
  Sharded(Sharded&&) = default;
  Sharded& operator=(Sharded&&) = default;

  ~Sharded() {
    // Device buffers are freed in order on the communication stream: make it
    // wait for the last compute use (a no-op on the CPU).
    if (device_.is_cuda() && !units_.empty()) {
      try {
        grads_zeroed_.record(last_stream_);
        grads_zeroed_.wait(comm_stream_);
      } catch (...) {  // destructors do not throw; the memory is then freed unordered
      }
    }
  }

  Module& module() { return *module_; }
  const ShardedOptions& options() const { return options_; }
  Device device() const { return device_; }
  DType compute_dtype() const { return compute_dtype_; }
  // Ranks a (dense) parameter is split over, and ranks it is replicated over.
  int shard_world() const { return shard_comm_ ? shard_comm_->size() : 1; }
  int replicate_world() const { return replicate_comm_ ? replicate_comm_->size() : 1; }
  // The mesh's cp degree, included in both groups (1 without a mesh).
  int cp_world() const { return cp_; }
  int shard_rank() const { return shard_comm_ ? shard_comm_->rank() : 0; }
  // The same for expert parameters (expert units; the dense values without them).
  int expert_shard_world() const { return expert_shard_comm_ ? expert_shard_comm_->size() : 1; }
  int expert_replicate_world() const { return expert_replicate_comm_ ? expert_replicate_comm_->size() : 1; }
  // Whether unit u shards over the expert group (ShardGroup::expert).
  bool is_expert_unit(std::size_t u) const { return units_.at(u).group == ShardGroup::expert; }
  // The module's units (nn/units.hpp) as wrapped: unit u holds unit_layout(u).
  // This rank's index among the ranks holding the same shard of unit u (its
  // replicate group: NoShard's replicas, HybridShard's dp_replicate, the dp
  // ranks of an expert slice under NoShard); 0 when there are none.
  int unit_replicate_rank(std::size_t u) const {
    const FlatParamGroup& x = units_.at(u);
    return x.replicate ? x.replicate->rank() : 0;
  }
  std::size_t num_units() const { return units_.size(); }
  const std::string& unit_name(std::size_t u) const { return units_.at(u).name; }
  const FlatShardLayout& unit_layout(std::size_t u) const { return units_.at(u).layout; }
  // Whether unit u trains: it has a grad shard and optimizer state (false
  // for a unit the module marks not trainable, nn::Unit::trainable, and for
  // every unit of a frozen model). The optimizer's state_tensors() hold the
  // trainable units' state, in unit order.
  bool unit_trainable(std::size_t u) const { return units_.at(u).trainable; }
  // Whether unit u's parameters are gathered (their values are views).
  bool is_gathered(std::size_t u) const { return units_.at(u).gathered.defined(); }
  Optimizer& optimizer() { return optimizer_; }
  // Master shards and optimizer states on the host (ShardedOptions::cpu_offload).
  bool cpu_offload() const { return offload_; }

  // ---- colocated memory (see the top of this file) -------------------------

  // Device training state -> pinned host memory, its device memory freed.
  // Synchronises the host. A no-op when offloaded.
  void offload(const Stream& stream = {}) {
    if (offloaded_) return;
    const Stream s = switch_stream(stream);
    wait_for_reductions(s);                  // s after the communication stream's work
    if (offload_) params_uploaded_.wait(s);  // the staging shards' last uploads done before they are overwritten
    for (std::size_t i = 0; i < units_.size(); ++i) release_gathered(i, s);
    // Frozen units' masters change only through load_parameter: their host
    // copies of the last cycle are still current unless it was called.
    const std::size_t bytes =
        host_.offload(units_, optimizer_, offload_, host_masters_current_, s, comm_stream_, turn_);
    host_masters_current_ = true;
    // The modules' op workspaces go too (allocated again by the next backward).
    if constexpr (requires(Module & m) { m.for_each_workspace([](Tensor&) {}); }) nn::release_workspaces(module());
    buffers_.clear();
    norm_buffers_ = {};
    clip_ = {};
    comm_stream_.synchronize();  // the frees done: the pool can hand the memory to any stream
    transfer_bytes_ = bytes;
    offloaded_ = true;
  }

  // The state back on the device, bit for bit. Stream-ordered: the uploads
  // run on the communication stream and `stream` waits for them. A no-op
  // when not offloaded.
  void onload(const Stream& stream = {}) {
    if (!offloaded_) return;
    const Stream s = switch_stream(stream);
    const Stream& c = comm_stream_;
    turn_.record(s);
    turn_.wait(c);
    host_.onload(units_, optimizer_, offload_, c);
    params_updated_.record(c);
    if (offload_) params_uploaded_.record(c);  // the CPU AdamW waits for it before writing the staging shards
    turn_.record(c);
    turn_.wait(s);
    offloaded_ = false;
  }

  bool offloaded() const { return offloaded_; }

  // The buffers a step reuses instead of allocating (gathered parameters,
  // full gradients and collective staging of the units, the grad-norm
  // scratch; issue 19): held between steps, at most what one step had alive
  // at once. offload() and release_buffers() free them; the next step makes
  // them again.
  int64_t cached_buffer_bytes() const {
    int64_t n = buffers_.bytes();
    for (const optim::GradNormBuffers* b : {&norm_buffers_, &clip_.groups[0], &clip_.groups[1]})
      for (const Tensor* t : {&b->workspace, &b->sum, &b->host_sum})
        if (t->defined()) n += int64_t(t->nbytes());
    for (const Tensor* t : {&clip_.sums, &clip_.norm, &clip_.factor})
      if (t->defined()) n += int64_t(t->nbytes());
    return n;
  }
  void release_buffers() {
    comm_stream_.synchronize();  // their last uses are done: the pool can hand the memory to any stream
    last_stream_.synchronize();
    buffers_.clear();
    norm_buffers_ = {};
    clip_ = {};
  }
  // Bytes the last offload copied to the host (onload copies them back).
  std::size_t offload_transfer_bytes() const { return transfer_bytes_; }
  // Pinned bytes held for runtime offload (allocated by the first offload;
  // cpu_offload's own master and staging shards not counted).
  std::size_t offload_host_bytes() const { return host_.host_bytes(units_, offload_); }

  // ---- the step (the calls of the wrapped model) --------------------------

  // The module's forward (the batch it takes, e.g. an nn::PackedBatch) with
  // the hooks that gather, prefetch and release each unit.
  template <class Input>
  Tensor forward(const Input& input, Context& ctx, const Stream& stream = {}) {
    check_onloaded("forward");
    if constexpr (requires(const Module& m) { m.sequence_attention(); })
      SLIME_CHECK(cp_ == 1 || module_->sequence_attention() != nullptr, "Sharded::forward: the mesh has cp = ", cp_,
                  " but the module has no sequence attention; set a parallel::ContextParallel over the mesh's cp ",
                  "axis (module().set_sequence_attention) and give each cp rank its plan's rows of the batch");
    const Stream s = compute_stream(stream);
    Hooks hooks{*this, s};
    return module_->forward(input, ctx, s, hooks);
  }

  // Accumulates the gradients of every parameter but the LM head; reduces
  // them when this backward completes the step's micro-batches (or always,
  // with GradientSync::every_micro_batch). `extra`: what the module's
  // backward takes after its hooks (Qwen3Model: the nn::AuxLoss of
  // aux_loss_and_grad).
  template <class... Extra>
  void backward(const Context& ctx, const Tensor& d_hidden, const Stream& stream, const Extra&... extra) {
    check_trains("backward");
    check_onloaded("backward");
    const Stream s = compute_stream(stream);
    Hooks hooks{*this, s};
    sync_now_ = options_.gradient_sync == GradientSync::every_micro_batch || micro_batch_ + 1 == micro_batches_;
    module_->backward(ctx, d_hidden, s, hooks, extra...);
    micro_batch_ = (micro_batch_ + 1) % micro_batches_;
  }
  void backward(const Context& ctx, const Tensor& d_hidden) { backward(ctx, d_hidden, Stream{}); }

  // The module's MoE load-balancing loss of the forward that filled ctx and
  // its router-logit gradients (nn::Qwen3Model::aux_loss_and_grad; no
  // parameter is read), for backward(ctx, d, stream, aux). The loss is the
  // one of the whole data-parallel batch (the statistics of every rank's
  // tokens are all-reduced over the dense shard and replicate groups, which
  // together are every rank of the mesh, cp and ep included, and so hold
  // every token once), so with gradient_reduce = sum the reduced gradients
  // are the unsharded model's; with avg the scale is multiplied by the
  // data-parallel ranks (cp not counted, see the top of this file) to undo
  // the division. One rank: the module's own call, bit for bit.
  nn::AuxLoss aux_loss_and_grad(const Context& ctx, std::optional<double> scale = std::nullopt,
                                const Stream& stream = {}) requires requires(const Module& m) {
    m.aux_loss_and_grad(ctx, scale, stream, nn::AuxStatsReduce{});
  }
  {
    check_trains("aux_loss_and_grad");
    check_onloaded("aux_loss_and_grad");
    const Stream s = compute_stream(stream);
    const int ranks = shard_world() * replicate_world();
    if (ranks == 1) return module_->aux_loss_and_grad(ctx, scale, s);
    const bool avg = options_.gradient_reduce == comm::ReduceOp::avg;
    const int dp_ranks = ranks / cp_;  // what avg divides the gradients by
    if (avg) scale = scale.value_or(module_->language_config().router_aux_loss_coef) * double(dp_ranks);
    nn::AuxStatsReduce reduce = [this](const Tensor& stats, const Stream& on) {
      Tensor t = stats;
      if (shard_comm_) shard_comm_->all_reduce(t, comm::ReduceOp::sum, on);
      if (replicate_comm_) replicate_comm_->all_reduce(t, comm::ReduceOp::sum, on);
    };
    nn::AuxLoss aux = module_->aux_loss_and_grad(ctx, scale, s, reduce);
    if (avg) aux.scale /= double(dp_ranks);
    return aux;
  }

  // The head calls exist when the module has them (a causal LM).
  Tensor logits(const Tensor& hidden, const Stream& stream = {}) requires requires(Module& m) {
    m.logits(hidden, stream);
  }
  {
    check_onloaded("logits");
    check_lm_head("logits");
    const Stream s = compute_stream(stream);
    gather_for_use(lm_head_unit_, s);
    Tensor out = module_->logits(hidden, s);
    release_frozen_head(s);
    return out;
  }

  ops::TokenLogprobs token_logprobs(const Tensor& hidden, const Tensor& targets, float temperature = 1.f,
                                    const Stream& stream = {}) requires requires(Module& m) {
    m.token_logprobs(hidden, targets, temperature, stream);
  }
  {
    check_onloaded("token_logprobs");
    check_lm_head("token_logprobs");
    const Stream s = compute_stream(stream);
    gather_for_use(lm_head_unit_, s);
    ops::TokenLogprobs out = module_->token_logprobs(hidden, targets, temperature, s);
    release_frozen_head(s);
    return out;
  }

  Tensor token_logprobs_backward(const Tensor& hidden, const Tensor& targets, float temperature,
                                 const ops::TokenLogprobs& fwd, const Tensor& grad_logprobs, const Tensor& grad_entropy,
                                 const Stream& stream = {}) requires requires(Module& m) {
    m.token_logprobs_backward(hidden, targets, temperature, fwd, grad_logprobs, grad_entropy, stream);
  }
  {
    const Stream s = head_backward_stream(stream);
    return module_->token_logprobs_backward(hidden, targets, temperature, fwd, grad_logprobs, grad_entropy, s);
  }

  // As above with the outputs in ctx's buffers (Qwen3Model::token_logprobs(ctx,
  // ...)): a Context reused across steps allocates nothing here once sized.
  ops::TokenLogprobs token_logprobs(Context& ctx, const Tensor& hidden, const Tensor& targets, float temperature = 1.f,
                                    const Stream& stream = {}) requires requires(Module& m) {
    m.token_logprobs(ctx, hidden, targets, temperature, stream);
  }
  {
    check_onloaded("token_logprobs");
    check_lm_head("token_logprobs");
    const Stream s = compute_stream(stream);
    gather_for_use(lm_head_unit_, s);
    ops::TokenLogprobs out = module_->token_logprobs(ctx, hidden, targets, temperature, s);
    release_frozen_head(s);
    return out;
  }
  Tensor token_logprobs_backward(Context& ctx, const Tensor& hidden, const Tensor& targets, float temperature,
                                 const ops::TokenLogprobs& fwd, const Tensor& grad_logprobs, const Tensor& grad_entropy,
                                 const Stream& stream = {}) requires requires(Module& m) {
    m.token_logprobs_backward(ctx, hidden, targets, temperature, fwd, grad_logprobs, grad_entropy, stream);
  }
  {
    const Stream s = head_backward_stream(stream);
    return module_->token_logprobs_backward(ctx, hidden, targets, temperature, fwd, grad_logprobs, grad_entropy, s);
  }

  // As Qwen3Model::loss_and_backward (nn/causal_lm.hpp): L = -Σ_t w_t
  // logprob_t / normalizer (+ the aux loss when with_aux_loss, default: the
  // model config's output_router_logits), one backward pass.
  // Batch: the module's (nn::PackedBatch; nn::VLBatch for a Qwen3VLModel).
  template <class Batch = nn::PackedBatch>
  nn::LossResult loss_and_backward(
      const Batch& batch, const Tensor& targets, float temperature = 1.f,
      std::optional<double> normalizer = std::nullopt, const Stream& stream = {},
      std::optional<bool> with_aux_loss = std::nullopt) requires nn::CausalLM<Module, Batch> {
    return loss_and_backward(batch, targets, Tensor{}, temperature, normalizer, stream, with_aux_loss);
  }
  template <class Batch = nn::PackedBatch>
  nn::LossResult loss_and_backward(
      const Batch& batch, const Tensor& targets, const Tensor& loss_weights, float temperature = 1.f,
      std::optional<double> normalizer = std::nullopt, const Stream& stream = {},
      std::optional<bool> with_aux_loss = std::nullopt) requires nn::CausalLM<Module, Batch> {
    return loss_and_backward_in(nullptr, batch, targets, loss_weights, temperature, normalizer, stream, with_aux_loss);
  }

  // As above with a Context the caller keeps across micro-batches: its
  // buffers hold the activations and the LM head's outputs (the returned
  // logprobs and entropy are views, valid until the next call with ctx).
  template <class Batch = nn::PackedBatch>
  nn::LossResult loss_and_backward(
      Context& ctx, const Batch& batch, const Tensor& targets, const Tensor& loss_weights = {}, float temperature = 1.f,
      std::optional<double> normalizer = std::nullopt, const Stream& stream = {},
      std::optional<bool> with_aux_loss = std::nullopt) requires nn::CausalLM<Module, Batch> {
    return loss_and_backward_in(&ctx, batch, targets, loss_weights, temperature, normalizer, stream, with_aux_loss);
  }

  // The next n backward passes accumulate into one optimizer step (default 1).
  void set_micro_batches(int n) {
    SLIME_CHECK(n >= 1, "Sharded::set_micro_batches: n must be >= 1, got ", n);
    SLIME_CHECK(micro_batch_ == 0, "Sharded::set_micro_batches: called after ", micro_batch_, " of ", micro_batches_,
                " micro-batches of the current step");
    micro_batches_ = n;
  }
  int micro_batches() const { return micro_batches_; }

  // Zeroes the sharded gradients (and drops unreduced ones); call before the
  // first micro-batch of a step, as with the unwrapped model.
  void zero_grad(const Stream& stream = {}) {
    check_trains("zero_grad");
    check_onloaded("zero_grad");
    const Stream s = compute_stream(stream);
    wait_for_reductions(s);
    for (FlatParamGroup& u : units_) {
      if (!u.trainable) continue;
      if (!u.direct_grads && u.full_grad.defined()) u.release_full_grad(s, comm_stream_, buffers_);
      u.grad_shard.zero_(s);
    }
    grads_zeroed_.record(s);
    grads_zeroed_.wait(comm_stream_);
    micro_batch_ = 0;
  }

  // The 2-norm of the gradient over all shards (one all-reduce over the shard
  // group; replicas hold equal gradients; NoShard with expert units: a second
  // one over ep). A host synchronisation.
  double grad_norm(const Stream& stream = {}) {
    check_trains("grad_norm");
    check_onloaded("grad_norm");
    const Stream s = compute_stream(stream);
    wait_for_reductions(s);
    return global_norm(s);
  }

  // AdamW on the master shards (refreshing the compute shards). With
  // max_grad_norm > 0 the gradients are first scaled by
  // clip_coefficient(global norm, max_grad_norm); returns that norm (a host
  // wait on the GPU: queue_optimizer_step has none). A norm that is not
  // finite throws, the parameters and the step count unchanged.
  std::optional<double> optimizer_step(double lr, double max_grad_norm = 0, const Stream& stream = {}) {
    const optim::PendingNorm pending = queue_optimizer_step(lr, max_grad_norm, stream);
    if (!pending.has_value()) return std::nullopt;
    const double norm = pending.get();
    if (!std::isfinite(norm)) {
      optimizer_.set_step_count(optimizer_.step_count() - 1);
      SLIME_FAIL("Sharded::optimizer_step: the gradient norm is ", norm,
                 " (a NaN or inf gradient): the update was not applied; skip this step instead of clipping");
    }
    return norm;
  }

  // optimizer_step without a host wait on the GPU: the clip factor is
  // computed on the device (optim::clip_factor) and AdamW reads it there;
  // the norm is read when the caller asks the returned PendingNorm (empty
  // without clipping). A norm that is not finite skips the update (the
  // parameters and moments keep their values; the step count advances, as
  // a skipped step). cpu_offload runs its AdamW on the host, so it waits
  // there as optimizer_step does.
  optim::PendingNorm queue_optimizer_step(double lr, double max_grad_norm = 0, const Stream& stream = {}) {
    check_trains("optimizer_step");
    check_onloaded("optimizer_step");
    const Stream s = compute_stream(stream);
    SLIME_CHECK(micro_batch_ == 0, "Sharded::optimizer_step after ", micro_batch_, " of ", micro_batches_,
                " micro-batches: the gradients are not reduced yet (set_micro_batches)");
    SLIME_CHECK(max_grad_norm == 0 || (std::isfinite(max_grad_norm) && max_grad_norm > 0),
                "Sharded::optimizer_step: max_grad_norm must be 0 (no clipping) or finite and > 0, got ",
                max_grad_norm);
    wait_for_reductions(s);
    // Gathered parameters go stale with the update.
    for (std::size_t i = 0; i < units_.size(); ++i) release_gathered(i, s);
    // The trainable units only (frozen ones have no gradient and no state).
    std::vector<Tensor> params, grads = grad_shards(), copies;
    for (FlatParamGroup& u : units_) {
      if (!u.trainable) continue;
      params.push_back(u.master);
      if (separate_compute_) copies.push_back(u.compute);
    }
    const bool clip = max_grad_norm > 0;
    optim::PendingNorm pending;
    if (offload_) {
      float scale = 1.f;
      if (clip) {
        const double norm = global_norm(s);
        clip_.norm = reuse_buffer(clip_.norm, {1}, DType::i64, Device::cpu(), Stream{});
        *static_cast<double*>(clip_.norm.data_ptr()) = norm;
        pending = norm_slots_.publish(clip_.norm, Stream{});
        if (!std::isfinite(norm)) {
          optimizer_.set_step_count(optimizer_.step_count() + 1);  // skipped, as on the device
          return pending;
        }
        scale = optim::clip_coefficient(norm, max_grad_norm);
      }
      // Gradients to the host, the update on the CPU, the new compute values
      // back to the device. Before the CPU writes the staging shards, the
      // previous step's uploads from them must be done (they may have been
      // queued on another stream): wait for those and for the downloads.
      for (FlatParamGroup& u : units_)
        if (u.trainable) u.host_grad.copy_from(u.grad_shard, s);
      params_uploaded_.synchronize();
      s.synchronize();
      std::vector<Tensor> host_grads, staging;
      for (FlatParamGroup& u : units_) {
        if (!u.trainable) continue;
        host_grads.push_back(u.host_grad);
        staging.push_back(u.host_compute);
      }
      optimizer_.step(params, host_grads, lr, scale, staging, Stream{});
      for (FlatParamGroup& u : units_)
        if (u.trainable) u.compute.copy_from(u.host_compute, s);
      params_uploaded_.record(s);
    } else if (clip) {
      const Tensor& factor = clip_factor(max_grad_norm, s);
      pending = norm_slots_.publish(clip_.norm, s);
      optimizer_.step(params, grads, lr, 1.f, copies, s, factor);
    } else {
      optimizer_.step(params, grads, lr, 1.f, copies, s);
    }
    params_updated_.record(s);
    return pending;
  }

  // ---- checkpoints ---------------------------------------------------------

  // f(const LocalShard&) for every parameter, in the module's unit order.
  template <class F>
  void for_each_local_shard(F&& f) {
    for (FlatParamGroup& u : units_) {
      const int r = u.rank();
      const bool expert = u.group == ShardGroup::expert;
      const auto& es = u.layout.entries();
      for (std::size_t i = 0; i < es.size(); ++i) {
        const FlatShardEntry& e = es[i];
        f(LocalShard{e.name, e.shape, e.begin(r), e.end(r), u.master.view(e.shard_offset, Shape{e.end(r) - e.begin(r)}),
                     expert, expert ? u.params[i]->first_expert : 0});
      }
    }
  }

  // Names of the parameters, in unit order (the order of for_each_local_shard).
  std::vector<std::string> parameter_names() const {
    std::vector<std::string> names;
    for (const FlatParamGroup& u : units_)
      for (const FlatShardEntry& e : u.layout.entries()) names.push_back(e.name);
    return names;
  }

  // The full (unsharded) shape of one parameter (of an expert stack under
  // expert parallelism: this ep rank's slice [E_local, ...]).
  const Shape& parameter_shape(std::string_view name) const {
    const auto [u, i] = find(name);
    return units_[u].layout.entries()[i].shape;
  }

  // Whether `name` is an expert stack sharded over the expert group, and the
  // global index of its first expert on this rank (0 for other parameters).
  bool is_expert_parameter(std::string_view name) const { return units_[find(name).first].group == ShardGroup::expert; }
  int64_t parameter_first_expert(std::string_view name) const {
    const auto [u, i] = find(name);
    return units_[u].group == ShardGroup::expert ? units_[u].params[i]->first_expert : 0;
  }

  // The full master-dtype value of one parameter on every rank of its shard
  // group (one all-gather of that parameter only, so an export streams the
  // model one tensor at a time). Collective over the shard group: every rank
  // calls it with the same names in the same order (the dense group, or for
  // an expert stack the expert group, which returns this ep rank's slice
  // [E_local, ...]; every rank takes part in both kinds, so calling it for
  // every name of parameter_names() on every rank is always right).
  Tensor gather_parameter(std::string_view name, const Stream& stream = {}) {
    const auto [u, i] = find(name);
    return gather_piece(units_[u].master, u, i, master_dtype_, compute_stream(stream));
  }

  // The full fp32 reduced gradient of one parameter (the sum over the
  // micro-batches since zero_grad, as the optimizer sees it), gathered as
  // gather_parameter (collective over the same group, same rules). Call it
  // after the step's last backward.
  Tensor gather_gradient(std::string_view name, const Stream& stream = {}) {
    check_trains("gather_gradient");
    check_onloaded("gather_gradient");
    const Stream s = compute_stream(stream);
    wait_for_reductions(s);
    const auto [u, i] = find(name);
    SLIME_CHECK(units_[u].trainable, "Sharded::gather_gradient: '", name, "' is in unit '", units_[u].name,
                "', which is not trainable (nn::Unit::trainable, e.g. a frozen Qwen3-VL tower): it has no gradient");
    return gather_piece(units_[u].grad_shard, u, i, DType::f32, s);
  }

  // Sets one parameter from its full value (any dtype ops::cast takes, the
  // parameter's shape, on this device; an expert stack under expert
  // parallelism: this ep rank's slice): this rank keeps its rows. Local, no
  // communication; call it on every rank (e.g. loading a checkpoint written
  // with another number of ranks).
  void load_parameter(std::string_view name, const Tensor& full, const Stream& stream = {}) {
    check_onloaded("load_parameter");
    const Stream s = compute_stream(stream);
    const auto [u, i] = find(name);
    const FlatShardEntry& e = units_[u].layout.entries()[i];
    check_shape(full, e.shape, std::string("Sharded::load_parameter: '") + std::string(name) + "'");
    SLIME_CHECK(full.device() == device_, "Sharded::load_parameter: '", name, "' must be on ", device_, ", got ",
                full.str());
    release_gathered(u, s);
    units_[u].copy_rows(e, full, s);
    params_updated_.record(s);
    host_masters_current_ = false;
  }

 private:
  // The callbacks the module's forward / backward make around each unit.
  struct Hooks {
    Sharded& self;
    const Stream& stream;

    void forward_begin(std::size_t u) {
      self.gather_for_use(u, stream);
      if (self.options_.prefetch) {
        // After the last unit: the LM head's (token_logprobs comes next), if any.
        const std::size_t next = u + 1 < self.units_.size() ? u + 1 : self.lm_head_unit_;
        if (next < self.units_.size()) self.issue_gather(next);
      }
    }
    void forward_end(std::size_t u) {
      // The last unit stays gathered for the head and the backward (frozen:
      // no backward, so only the LM head's unit stays, for the head).
      const bool keep = trains ? u + 1 == self.units_.size() : u == self.lm_head_unit_;
      if (Strategy::reshard_after_forward && !keep) self.release_gathered(u, stream);
    }
    // A frozen unit's backward reads none of its parameters (nn::Unit::
    // trainable: the module leaves them alone, e.g. no tower backward), so
    // its hooks gather nothing, hold no gradient and reduce nothing.
    void backward_begin(std::size_t u) {
      if (!self.units_[u].trainable) return;
      self.gather_for_use(u, stream);
      if (self.options_.prefetch && u > 0 && self.units_[u - 1].trainable) self.issue_gather(u - 1);
      self.ensure_full_grad(u, stream);
    }
    void backward_end(std::size_t u) {
      if (self.sync_now_ && self.units_[u].trainable) self.reduce(u, stream);
      if (Strategy::reshard_after_backward) self.release_gathered(u, stream);
    }
  };

  // The communicators of the two kinds of units. `ep`: the degree of the
  // ep axis the expert groups assume (0: none given, expert units refused).
  struct Groups {
    comm::Comm *shard = nullptr, *replicate = nullptr;                // dense units
    comm::Comm *expert_shard = nullptr, *expert_replicate = nullptr;  // expert units
    comm::Comm* expert_norm = nullptr;         // every expert element on one rank (the grad norm)
    std::unique_ptr<comm::Comm> owned_dense;   // a flattened dp x cp x ep group
    std::unique_ptr<comm::Comm> owned_expert;  // a flattened dp x cp group
    int ep = 0;
    int cp = 1;  // the cp degree the groups include (their ranks' gradients are partial sums of one batch)
  };

  static comm::Comm* nontrivial(comm::Comm* c) { return c && c->size() > 1 ? c : nullptr; }

  Sharded(Module module, Groups groups, const ShardedOptions& options, const OptimizerConfig& optimizer)
      : module_(std::make_unique<Module>(std::move(module))),
        options_(options),
        owned_dense_comm_(std::move(groups.owned_dense)),
        owned_expert_comm_(std::move(groups.owned_expert)),
        cp_(groups.cp),
        shard_comm_(nontrivial(groups.shard)),
        replicate_comm_(nontrivial(groups.replicate)),
        expert_shard_comm_(nontrivial(groups.expert_shard)),
        expert_replicate_comm_(nontrivial(groups.expert_replicate)),
        expert_norm_comm_(nontrivial(groups.expert_norm)),
        optimizer_(optimizer) {
    comm::Comm* const shard = groups.shard;
    comm::Comm* const replicate = groups.replicate;
    std::vector<nn::Unit> units = module_->units();
    SLIME_CHECK(!units.empty(), "Sharded: the module has no units");
    lm_head_unit_ = nn::lm_head_unit(units);
    // Device and dtype from the parameters; all must agree.
    const nn::Parameter* first = nullptr;
    std::unordered_map<const nn::Parameter*, std::string> seen;
    for (const nn::Unit& su : units) {
      if (su.kind == nn::UnitKind::expert) {
        SLIME_CHECK(groups.ep > 0, "Sharded: unit '", su.name, "' holds expert weights of an ExpertParallel of degree ",
                    su.expert_degree, "; build Sharded from a comm::Mesh whose ep axis is the ExpertParallel's group ",
                    "(expert weights shard over dp_shard x cp, dense ones over dp_shard x cp x ep)");
        SLIME_CHECK(su.expert_degree == groups.ep, "Sharded: unit '", su.name, "' holds expert weights of an ",
                    "ExpertParallel of degree ", su.expert_degree, " but the mesh has ep = ", groups.ep,
                    "; build the model's ExpertParallel over the mesh's ep axis");
        has_expert_units_ = true;
      }
      for (const nn::Parameter* p : su.params) {
        SLIME_CHECK(p != nullptr && p->value.defined(), "Sharded: unit '", su.name, "' has a parameter ",
                    p ? "'" + p->name + "' " : std::string(), "without a value (was the module already sharded?)");
        const auto [it, fresh] = seen.emplace(p, su.name);
        SLIME_CHECK(fresh, "Sharded: parameter '", p->name, "' is in units '", it->second, "' and '", su.name,
                    "'; a parameter belongs to exactly one unit");
        if (!first) first = p;
        SLIME_CHECK(p->value.device() == first->value.device() && p->value.dtype() == first->value.dtype(),
                    "Sharded: parameters differ in device or dtype: '", first->name, "' is ", first->value.str(), ", '",
                    p->name, "' is ", p->value.str());
      }
    }
    SLIME_CHECK(first != nullptr, "Sharded: the module has no parameters");
    device_ = first->value.device();
    const DType module_dtype = first->value.dtype();
    for (comm::Comm* c : {shard, replicate, groups.expert_shard, groups.expert_replicate, groups.expert_norm})
      if (c)
        SLIME_CHECK(c->device() == device_, "Sharded: the communicator works on ", c->device(),
                    " but the module's parameters are on ", device_);
    const MixedPrecisionPolicy& mp = options_.precision;
    compute_dtype_ = mp.compute.value_or(module_dtype);
    SLIME_CHECK(compute_dtype_ == module_dtype, "Sharded: compute dtype ", dtype_name(compute_dtype_),
                " differs from the module's dtype ", dtype_name(module_dtype),
                "; the modules run in their own dtype: build the model in the compute dtype");
    if constexpr (trains) {
      master_dtype_ = mp.master;
      SLIME_CHECK(master_dtype_ == DType::f32, "Sharded: master dtype ", dtype_name(master_dtype_),
                  " is not supported: optim::AdamW updates f32 master parameters");
    } else {
      // Frozen: the master shard is the compute shard, in the module's dtype
      // (precision.master is not used: there is nothing to update).
      master_dtype_ = compute_dtype_;
      SLIME_CHECK(!options_.cpu_offload, "Sharded: cpu_offload keeps master shards and optimizer states on the ",
                  "host for the optimizer step, but the model is frozen (its optimizer does not train); use ",
                  "offload() / onload() to move its parameters to pinned host memory");
    }
    SLIME_CHECK(mp.reduce == DType::f32 || mp.reduce == DType::bf16, "Sharded: reduce dtype must be f32 or bf16, got ",
                dtype_name(mp.reduce));
    offload_ = options_.cpu_offload;
    separate_compute_ = master_dtype_ != compute_dtype_ || offload_;
    comm_stream_ = device_.is_cuda() ? Stream::create(device_) : Stream{};
    last_stream_ = Stream::default_for(device_);
    grads_reduced_ = Event(device_, false);
    params_updated_ = Event(device_, false);
    grads_zeroed_ = Event(device_, false);
    params_uploaded_ = Event(device_, false);
    turn_ = Event(device_, false);

    // The shards are built on the communication stream, after the work that
    // wrote the module's values (the device's default stream).
    const Stream init = Stream::default_for(device_);
    grads_zeroed_.record(init);
    grads_zeroed_.wait(comm_stream_);
    units_.reserve(units.size());
    for (nn::Unit& su : units) {
      FlatParamGroup u;
      u.name = su.name;
      u.trainable = trains && su.trainable;
      u.params = su.params;
      u.group = su.kind;
      const bool expert = su.kind == nn::UnitKind::expert;
      u.shard = expert ? expert_shard_comm_ : shard_comm_;
      u.replicate = expert ? expert_replicate_comm_ : replicate_comm_;
      // avg: from the division by the unit's groups to the one by the
      // data-parallel ranks (see the top of this file).
      if (options_.gradient_reduce == comm::ReduceOp::avg)
        u.grad_scale = float(groups.cp) / float(expert ? groups.ep : 1);
      u.aliased = u.shard == nullptr;
      // A unit with a scale keeps a full gradient to scale in its reduction.
      u.direct_grads = u.trainable && u.shard == nullptr && u.replicate == nullptr && u.grad_scale == 1.f;
      u.separate_compute = separate_compute_;
      u.device = device_;
      u.compute_dtype = compute_dtype_;
      std::vector<std::pair<std::string, Shape>> shapes;
      for (const nn::Parameter* p : su.params) shapes.emplace_back(p->name, p->value.shape());
      u.layout = FlatShardLayout(shapes, u.shard ? u.shard->size() : 1);
      const int64_t n = u.layout.shard_numel();
      if (offload_) {
        u.master = Tensor::empty_pinned({n}, master_dtype_);
        u.master.zero_();
        if (u.trainable) u.host_grad = Tensor::empty_pinned({n}, DType::f32);
        u.host_compute = Tensor::empty_pinned({n}, compute_dtype_);
      } else {
        u.master = Tensor::zeros({n}, master_dtype_, device_, comm_stream_);
      }
      u.compute = separate_compute_ ? Tensor::zeros({n}, compute_dtype_, device_, comm_stream_) : u.master;
      if (u.trainable) u.grad_shard = Tensor::zeros({n}, DType::f32, device_, comm_stream_);
      for (std::size_t i = 0; i < su.params.size(); ++i)
        u.copy_rows(u.layout.entries()[i], su.params[i]->value, comm_stream_);
      u.gathered_ready = Event(device_, false);
      u.grad_ready = Event(device_, false);
      u.params_free = Event(device_, false);
      units_.push_back(std::move(u));
    }
    // The module's full tensors go (freed on their streams once the copies
    // are done); from here on values and gradients are views.
    params_updated_.record(comm_stream_);
    params_updated_.wait(init);
    for (FlatParamGroup& u : units_)
      for (nn::Parameter* p : u.params) {
        p->value = Tensor{};
        p->grad = Tensor{};
      }
    for (std::size_t i = 0; i < units_.size(); ++i) {
      FlatParamGroup& u = units_[i];
      if (u.aliased) {
        u.gathered = u.compute;
        u.install_values();
      }
      if (u.direct_grads) {
        u.full_grad = u.grad_shard;
        u.install_grads();
      }
      u.gathered_ready.record(comm_stream_);
    }
    // The optimizer's moments now, so a rank's memory is known up front
    // (the trainable units' only).
    std::vector<Tensor> masters;
    for (const FlatParamGroup& u : units_)
      if (u.trainable) masters.push_back(u.master);
    optimizer_.init_state(masters, offload_ ? Stream{} : comm_stream_);
    for (std::size_t i = 0; i < units_.size(); ++i)
      for (std::size_t j = 0; j < units_[i].layout.entries().size(); ++j)
        index_.emplace(units_[i].layout.entries()[j].name, std::pair{i, j});
  }

  static Groups comm_groups(comm::Comm& comm) {
    Groups g;
    (Strategy::shards ? g.shard : g.replicate) = &comm;
    return g;
  }

  static Groups mesh_groups(const comm::Mesh& mesh) {
    using comm::Axis;
    const int cp = mesh.size(Axis::cp), ep = mesh.size(Axis::ep);
    Groups g;
    g.ep = ep;
    g.cp = cp;
    // The groups over the data-parallel axis a: dense units a x cp x ep,
    // expert units a x cp (when ep = 1 there are none: the dense group).
    struct Pair {
      comm::Comm *dense, *expert;
    };
    const auto over = [&](Axis a) {
      Pair p{&mesh.comm(a), nullptr};
      if (cp > 1 || ep > 1) {
        g.owned_dense = mesh.flatten({a, Axis::cp, Axis::ep});
        p.dense = g.owned_dense.get();
      }
      p.expert = p.dense;
      if (ep > 1) {
        p.expert = &mesh.comm(a);
        if (cp > 1) {
          g.owned_expert = mesh.flatten({a, Axis::cp});
          p.expert = g.owned_expert.get();
        }
      }
      return p;
    };
    if constexpr (Strategy::shards) {
      if constexpr (!Strategy::replicates)
        SLIME_CHECK(mesh.size(Axis::dp_replicate) == 1, "Sharded: this strategy shards over dp_shard",
                    cp > 1 ? " x cp" : "", " only, but the mesh (", mesh.shape().str(),
                    ") has dp_replicate = ", mesh.size(Axis::dp_replicate),
                    "; use HybridShard to replicate across groups");
      const Pair p = over(Axis::dp_shard);
      g.shard = p.dense;
      g.expert_shard = p.expert;
      g.expert_norm = g.shard;
      if constexpr (Strategy::replicates) g.replicate = g.expert_replicate = &mesh.comm(Axis::dp_replicate);
    } else {
      const int r = mesh.size(Axis::dp_replicate), s = mesh.size(Axis::dp_shard);
      SLIME_CHECK(r == 1 || s == 1, "Sharded<NoShard>: the mesh (", mesh.shape().str(), ") has dp_replicate = ", r,
                  " and dp_shard = ", s, "; NoShard replicates over one axis (set the other to 1)",
                  cp > 1 || ep > 1 ? ", times cp x ep" : "");
      const Pair p = over(r > 1 ? Axis::dp_replicate : Axis::dp_shard);
      g.replicate = p.dense;
      g.expert_replicate = p.expert;
      g.expert_norm = &mesh.comm(Axis::ep);
    }
    return g;
  }

  // Parameter i of unit u whole from every shard group rank's piece of
  // `flat` (a master or grad shard of that unit).
  Tensor gather_piece(const Tensor& flat, std::size_t u, std::size_t i, DType dtype, const Stream& s) {
    const FlatShardEntry& e = units_[u].layout.entries()[i];
    Tensor piece = flat.view(e.shard_offset, Shape{e.piece});
    if (piece.device() != device_) piece = piece.to(device_, s);  // offloaded master: via the device
    Tensor all = Tensor::empty({e.piece * units_[u].layout.world()}, dtype, device_, s);
    if (units_[u].shard) {
      units_[u].shard->all_gather(piece, all, s);
    } else {
      all.copy_from(piece, s);
    }
    return all.view(0, e.shape);
  }

  // The trainable gradient shards in their norm groups, viewing `dense` and
  // `expert` (filled here): one group over the shard group, or, for NoShard
  // with expert units, the dense gradients (replicated) over the shard group
  // and the expert ones (different across ep) over ep.
  std::vector<optim::NormGroup> norm_groups(std::vector<Tensor>& dense, std::vector<Tensor>& expert) const {
    const bool split = has_expert_units_ && expert_norm_comm_ != shard_comm_;
    for (const FlatParamGroup& u : units_)
      if (u.trainable) (split && u.group == ShardGroup::expert ? expert : dense).push_back(u.grad_shard);
    if (!split) return {optim::NormGroup{dense, shard_comm_}};
    return {optim::NormGroup{dense, shard_comm_}, optim::NormGroup{expert, expert_norm_comm_}};
  }

  // optim::clip_factor over the norm groups, into clip_.
  const Tensor& clip_factor(double max_grad_norm, const Stream& s) {
    std::vector<Tensor> dense, expert;
    return optim::clip_factor(norm_groups(dense, expert), max_grad_norm, device_, s, clip_);
  }

  // The 2-norm of the gradient over all shards (see grad_norm): √(n₀² + n₁²)
  // over the norm groups.
  double global_norm(const Stream& s) {
    std::vector<Tensor> dense, expert;
    const std::vector<optim::NormGroup> groups = norm_groups(dense, expert);
    const double d = optim::global_grad_norm(groups[0].grads, groups[0].comm, s, &norm_buffers_);
    if (groups.size() == 1) return d;
    const double e = optim::global_grad_norm(groups[1].grads, groups[1].comm, s, &norm_buffers_);
    return std::sqrt(d * d + e * e);
  }

  // loss_and_backward in ctx (null: a fresh Context).
  template <class Batch>
  nn::LossResult loss_and_backward_in(Context* ctx, const Batch& batch, const Tensor& targets,
                                      const Tensor& loss_weights, float temperature, std::optional<double> normalizer,
                                      const Stream& stream, std::optional<bool> with_aux_loss) {
    check_trains("loss_and_backward");
    check_onloaded("loss_and_backward");
    const Stream s = compute_stream(stream);
    bool aux = with_aux_loss.value_or(false);
    if constexpr (requires(Module & m) { m.config().output_router_logits; })
      aux = with_aux_loss.value_or(module_->language_config().output_router_logits);
    return nn::causal_lm_loss_and_backward(*this, batch, targets, loss_weights, temperature, normalizer, s, aux, ctx);
  }

  void check_lm_head(const char* where) const {
    SLIME_CHECK(lm_head_unit_ < units_.size(), "Sharded::", where, ": the module has no unit holding an LM head");
  }

  void check_trains([[maybe_unused]] const char* where) const {
    if constexpr (!trains)
      SLIME_FAIL("Sharded::", where, ": the model is frozen (its optimizer, e.g. optim::NoOptimizer, does not ",
                 "train): it has no gradients and takes no optimizer step");
  }

  // A frozen model under a strategy that reshards after forward releases
  // the LM head's unit after the head's call (no backward needs it).
  void release_frozen_head(const Stream& s) {
    if constexpr (!trains && Strategy::reshard_after_forward) release_gathered(lm_head_unit_, s);
  }

  // Before the LM head's backward: the checks, the head's unit gathered and
  // its full gradient ready; the compute stream.
  Stream head_backward_stream(const Stream& stream) {
    check_trains("token_logprobs_backward");
    check_onloaded("token_logprobs_backward");
    check_lm_head("token_logprobs_backward");
    SLIME_CHECK(units_[lm_head_unit_].trainable, "Sharded::token_logprobs_backward: the LM head's unit '",
                units_[lm_head_unit_].name, "' is not trainable, but the head's backward accumulates its gradient");
    const Stream s = compute_stream(stream);
    gather_for_use(lm_head_unit_, s);
    ensure_full_grad(lm_head_unit_, s);
    return s;
  }

  void check_onloaded(const char* where) const {
    SLIME_CHECK(!offloaded_, "Sharded::", where, ": Sharded is offloaded: call onload() first");
  }

  // compute_stream(stream), ordered after the work queued on the previous one.
  Stream switch_stream(const Stream& stream) {
    turn_.record(last_stream_);
    const Stream s = compute_stream(stream);
    turn_.wait(s);
    return s;
  }

  Stream compute_stream(const Stream& stream) {
    last_stream_ = stream.device() == device_ ? stream : Stream::default_for(device_);
    return last_stream_;
  }

  std::pair<std::size_t, std::size_t> find(std::string_view name) const {
    const auto it = index_.find(std::string(name));
    SLIME_CHECK(it != index_.end(), "Sharded: no parameter named '", name, "'");
    return it->second;
  }

  // The steps on one unit (flat_param_group.hpp), on the communication stream.
  void issue_gather(std::size_t i) { units_[i].issue_gather(comm_stream_, params_updated_, buffers_); }

  // Unit i gathered, and `s` ordered after the gather.
  void gather_for_use(std::size_t i, const Stream& s) {
    issue_gather(i);
    units_[i].gathered_ready.wait(s);
  }

  void release_gathered(std::size_t i, const Stream& s) { units_[i].release_gathered(s, comm_stream_, buffers_); }
  void ensure_full_grad(std::size_t i, const Stream& s) { units_[i].ensure_full_grad(s, comm_stream_, buffers_); }
  void reduce(std::size_t i, const Stream& s) {
    units_[i].reduce(s, comm_stream_, options_.precision.reduce, options_.gradient_reduce, grads_reduced_, buffers_);
  }

  void wait_for_reductions(const Stream& s) {
    grads_reduced_.record(comm_stream_);
    grads_reduced_.wait(s);
  }

  std::vector<Tensor> grad_shards() const {
    std::vector<Tensor> g;
    for (const FlatParamGroup& u : units_)
      if (u.trainable) g.push_back(u.grad_shard);
    return g;
  }

  std::unique_ptr<Module> module_;
  ShardedOptions options_;
  std::unique_ptr<comm::Comm> owned_dense_comm_;   // the flattened dp x cp x ep group (mesh with cp or ep > 1)
  std::unique_ptr<comm::Comm> owned_expert_comm_;  // the flattened dp x cp group (mesh with cp and ep > 1)
  int cp_ = 1;                                     // the mesh's cp degree (1 without a mesh)
  comm::Comm* shard_comm_ = nullptr;               // dense units; null: one rank per shard group
  comm::Comm* replicate_comm_ = nullptr;           // dense units; null: no replicas
  comm::Comm* expert_shard_comm_ = nullptr;        // expert units (ShardGroup::expert)
  comm::Comm* expert_replicate_comm_ = nullptr;
  comm::Comm* expert_norm_comm_ = nullptr;  // the grad norm of expert shards (see global_norm)
  bool has_expert_units_ = false;
  Optimizer optimizer_;
  Device device_;
  DType compute_dtype_ = DType::f32, master_dtype_ = DType::f32;
  bool separate_compute_ = false;  // compute shard distinct from the master shard
  bool offload_ = false;           // master shards and AdamW states on the host (cpu_offload)
  std::vector<FlatParamGroup> units_;
  ShardOffload host_;  // runtime offload's pinned copies
  std::size_t lm_head_unit_ = 0;
  std::unordered_map<std::string, std::pair<std::size_t, std::size_t>> index_;
  Stream comm_stream_, last_stream_;
  BufferCache buffers_;  // gathered parameters, full gradients and staging, reused from step to step
  optim::GradNormBuffers norm_buffers_;
  optim::ClipBuffers clip_;            // the clip factor on the device (queue_optimizer_step)
  optim::PendingNormPool norm_slots_;  // the host copies of its norm
  Event grads_reduced_, params_updated_, grads_zeroed_;
  Event params_uploaded_;  // cpu_offload: the last uploads from the staging shards
  Event turn_;             // offload / onload: ordering between the caller's and the communication stream
  bool offloaded_ = false;
  bool host_masters_current_ = false;  // the host masters of runtime offload equal the masters (frozen units)
  std::size_t transfer_bytes_ = 0;
  int micro_batches_ = 1, micro_batch_ = 0;
  bool sync_now_ = true;
};

// A frozen model (a reference or teacher): sharded like a policy, no
// gradients, no optimizer state, offloadable (see the top of this file).
template <class Module, ShardingStrategy Strategy = FullShard>
using Frozen = Sharded<Module, Strategy, optim::NoOptimizer>;

}  // namespace slime::parallel
