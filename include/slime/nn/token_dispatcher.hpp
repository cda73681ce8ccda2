// slime/nn/token_dispatcher.hpp: how an MoE block moves its tokens to its
// experts and back: the TokenDispatcher concept, LocalDispatcher (every expert
// on this rank) and DispatcherRef (a type-erased reference the block holds,
// so a model with expert parallelism has the same type as one without).
//
// A dispatcher D provides, for one micro-batch at a time (its D::Handle
// carries what dispatch learned to combine and both backwards; keep one per
// micro-batch in flight and reuse it: its buffers keep their capacity):
//   dispatch          x [T, H], indices [T, k] (i32 global expert ids) →
//                     rows for this rank's experts [R, H], grouped by local
//                     expert (offsets: h.local_offsets() i32 [E_local + 1]).
//   combine           expert outputs [R, H'] and router weights [T, k] →
//                     y [T, H'] = Σ_j w[t, j] · out of copy (t, j), written into
//                     `y` when given.
//   combine_backward  dy [T, H'] → d expert outputs [R, H'] and dweights [T, k].
//   dispatch_backward d rows [R, H] → dx [T, H] (written; into `dx` when given).
// and says which experts this rank holds: num_experts() E, num_local_experts()
// E_local, first_expert(), size() (the ranks the experts are split over; 1
// for a local dispatcher) and device(). h.local_counts() holds the rows per
// local expert on the host when the dispatcher learned them for free (an
// expert-parallel exchange), else it is empty.
//
// Accumulation contract: dispatchers have no parameters; activation
// gradients are written (`=`).
//
// parallel::ExpertParallel models the concept (rows exchanged over the ep
// group); nn/ never includes parallel/.
#pragma once

#include <any>
#include <concepts>
#include <cstdint>
#include <string_view>
#include <vector>

#include "slime/core/tensor.hpp"
#include "slime/nn/module.hpp"
#include "slime/ops/moe_permute.hpp"

namespace slime::nn {

// The gradients combine_backward returns.
struct CombineGrads {
  Tensor d_expert_out;  // [R, H'] in dispatch's grouped order, the expert outputs' dtype
  Tensor dweights;      // [T, k], the router weights' dtype
};

template <class D>
concept TokenDispatcher = requires(D& d, const D& cd, typename D::Handle& h, const typename D::Handle& ch,
                                   const Tensor& t, const Stream& s) {
  { cd.num_experts() } -> std::convertible_to<int64_t>;
  { cd.num_local_experts() } -> std::convertible_to<int64_t>;
  { cd.first_expert() } -> std::convertible_to<int64_t>;
  { cd.size() } -> std::convertible_to<int>;
  { cd.device() } -> std::convertible_to<Device>;
  { d.dispatch(t, t, h, s) } -> std::convertible_to<Tensor>;
  { d.combine(t, t, h, s, t) } -> std::convertible_to<Tensor>;
  { d.combine_backward(t, ch, s) } -> std::convertible_to<CombineGrads>;
  { d.dispatch_backward(t, ch, s, t) } -> std::convertible_to<Tensor>;
  { ch.local_offsets() } -> std::convertible_to<Tensor>;
  { ch.local_counts() } -> std::convertible_to<const std::vector<int64_t>&>;
};

// All E experts on this rank: layout → permute → (experts) → unpermute.
// Stateless but for its sizes; the handle holds the layout and the buffers.
class LocalDispatcher {
 public:
  class Handle {
   public:
    const ops::MoeLayout& layout() const { return layout_; }
    const Tensor& local_offsets() const { return layout_.offsets; }
    const std::vector<int64_t>& local_counts() const { return no_counts_; }  // never known for free

   private:
    friend class LocalDispatcher;
    ops::MoeLayout layout_;
    Tensor y_rows_, weights_;  // combine's inputs, for combine_backward
    // Capacity of the layout's tensors and of dispatch's rows (see detail::rows_view).
    Tensor counts_, offsets_, row_to_copy_, copy_to_row_, rows_, workspace_;
    mutable Tensor d_expert_out_, dweights_;  // combine_backward's (detail::context_buffer)
    std::vector<int64_t> no_counts_;
  };

  LocalDispatcher() = default;
  LocalDispatcher(int64_t num_experts, Device device) : num_experts_(num_experts), device_(device) {}

  int64_t num_experts() const { return num_experts_; }
  int64_t num_local_experts() const { return num_experts_; }
  int64_t first_expert() const { return 0; }
  int size() const { return 1; }
  Device device() const { return device_; }

  Tensor dispatch(const Tensor& x, const Tensor& indices, Handle& h, const Stream& stream = {}) {
    const Device dev = x.device();
    const int64_t T = x.size(0), k = indices.size(1), H = x.size(1), E = num_experts_;
    ops::MoeLayout& l = h.layout_;
    l.tokens = T;
    l.topk = k;
    l.num_experts = E;
    l.counts = detail::vec_view(h.counts_, E, DType::i32, dev, stream);
    l.offsets = detail::vec_view(h.offsets_, E + 1, DType::i32, dev, stream);
    l.row_to_copy = detail::vec_view(h.row_to_copy_, T * k, DType::i32, dev, stream);
    l.copy_to_row = detail::vec_view(h.copy_to_row_, T * k, DType::i32, dev, stream);
    l.workspace = ops::moe_layout_workspace(h.workspace_, l, dev, stream);
    ops::moe_build_layout(indices, l, stream);
    const Tensor rows = detail::rows_view(h.rows_, T * k, H, x.dtype(), dev, stream);
    ops::moe_permute_forward(x, l, rows, stream);
    h.y_rows_ = Tensor{};
    h.weights_ = Tensor{};
    return rows;
  }

  Tensor combine(const Tensor& expert_out, const Tensor& weights, Handle& h, const Stream& stream = {},
                 const Tensor& y = {}) {
    Tensor out = y.defined() ? y
                             : Tensor::empty({h.layout_.tokens, expert_out.size(1)}, expert_out.dtype(),
                                             expert_out.device(), stream);
    ops::moe_unpermute_forward(expert_out, weights, h.layout_, out, stream);
    h.y_rows_ = expert_out;
    h.weights_ = weights;
    return out;
  }

  CombineGrads combine_backward(const Tensor& dy, const Handle& h, const Stream& stream = {}) {
    SLIME_CHECK(h.y_rows_.defined(), "LocalDispatcher::combine_backward: the handle has no combine");
    CombineGrads g;
    g.d_expert_out = detail::context_buffer(h.d_expert_out_, h.y_rows_.shape(), h.y_rows_.dtype(), dy.device(), stream);
    g.dweights = detail::context_buffer(h.dweights_, {h.layout_.tokens, h.layout_.topk}, h.weights_.dtype(),
                                        dy.device(), stream);
    ops::moe_unpermute_backward(dy, h.y_rows_, h.weights_, h.layout_, g.d_expert_out, g.dweights, stream);
    return g;
  }

  Tensor dispatch_backward(const Tensor& d_rows, const Handle& h, const Stream& stream = {}, const Tensor& dx = {}) {
    Tensor out =
        dx.defined() ? dx : Tensor::empty({h.layout_.tokens, d_rows.size(1)}, d_rows.dtype(), d_rows.device(), stream);
    ops::moe_permute_backward(d_rows, h.layout_, out, /*accumulate=*/false, stream);
    return out;
  }

 private:
  int64_t num_experts_ = 0;
  Device device_ = Device::cpu();
};
static_assert(TokenDispatcher<LocalDispatcher>);

// A non-owning, type-erased reference to any TokenDispatcher (which must
// outlive it), with std::any as its handle (holding the dispatcher's own
// Handle, made on first use and reused after). Empty: no dispatcher (the
// block dispatches locally). Built from a pointer so that `&ep` and a null
// `ExpertParallel<>*` both convert.
class DispatcherRef {
 public:
  using Handle = std::any;

  DispatcherRef() = default;
  DispatcherRef(std::nullptr_t) {}  // NOLINT: null means "none", as a null pointer
  // A dispatcher type may name the base it is held as (`using ErasedAs =
  // Base;`), so that derived types (ExpertParallel<N>) read back with get<Base>().
  template <TokenDispatcher D>
  DispatcherRef(D* d)  // NOLINT: implicit, as a pointer
      : self_(static_cast<erased_t<D>*>(d)), ops_(d ? &table<erased_t<D>> : nullptr) {}

  explicit operator bool() const { return ops_ != nullptr; }
  // The dispatcher as D (null when it is another type or none).
  template <class D>
  D* get() const {
    return ops_ == &table<D> ? static_cast<D*>(self_) : nullptr;
  }

  int64_t num_experts() const { return ops_->num_experts(self_); }
  int64_t num_local_experts() const { return ops_->num_local_experts(self_); }
  int64_t first_expert() const { return ops_->first_expert(self_); }
  int size() const { return ops_->size(self_); }
  Device device() const { return ops_->device(self_); }

  Tensor dispatch(const Tensor& x, const Tensor& indices, Handle& h, const Stream& s = {}) const {
    return ops_->dispatch(self_, x, indices, h, s);
  }
  Tensor combine(const Tensor& out, const Tensor& weights, Handle& h, const Stream& s = {},
                 const Tensor& y = {}) const {
    return ops_->combine(self_, out, weights, h, s, y);
  }
  CombineGrads combine_backward(const Tensor& dy, const Handle& h, const Stream& s = {}) const {
    return ops_->combine_backward(self_, dy, h, s);
  }
  Tensor dispatch_backward(const Tensor& d_rows, const Handle& h, const Stream& s = {}, const Tensor& dx = {}) const {
    return ops_->dispatch_backward(self_, d_rows, h, s, dx);
  }
  Tensor local_offsets(const Handle& h) const { return ops_->local_offsets(h); }
  const std::vector<int64_t>& local_counts(const Handle& h) const { return ops_->local_counts(h); }

 private:
  template <class D>
  struct erased {
    using type = D;
  };
  template <class D>
  requires requires { typename D::ErasedAs; }
  struct erased<D> {
    using type = typename D::ErasedAs;
  };
  template <class D>
  using erased_t = typename erased<D>::type;

  struct Ops {
    int64_t (*num_experts)(const void*);
    int64_t (*num_local_experts)(const void*);
    int64_t (*first_expert)(const void*);
    int (*size)(const void*);
    Device (*device)(const void*);
    Tensor (*dispatch)(void*, const Tensor&, const Tensor&, Handle&, const Stream&);
    Tensor (*combine)(void*, const Tensor&, const Tensor&, Handle&, const Stream&, const Tensor&);
    CombineGrads (*combine_backward)(void*, const Tensor&, const Handle&, const Stream&);
    Tensor (*dispatch_backward)(void*, const Tensor&, const Handle&, const Stream&, const Tensor&);
    Tensor (*local_offsets)(const Handle&);
    const std::vector<int64_t>& (*local_counts)(const Handle&);
  };

  template <class D>
  static typename D::Handle& handle_of(Handle& h) {
    if (!h.has_value() || h.type() != typeid(typename D::Handle)) h.emplace<typename D::Handle>();
    return std::any_cast<typename D::Handle&>(h);
  }
  template <class D>
  static const typename D::Handle& handle_of(const Handle& h) {
    const auto* p = std::any_cast<typename D::Handle>(&h);
    SLIME_CHECK(p != nullptr, "DispatcherRef: the handle holds no dispatch of this dispatcher (call dispatch first)");
    return *p;
  }

  template <class D>
  static constexpr Ops table = {
      [](const void* d) -> int64_t { return static_cast<const D*>(d)->num_experts(); },
      [](const void* d) -> int64_t { return static_cast<const D*>(d)->num_local_experts(); },
      [](const void* d) -> int64_t { return static_cast<const D*>(d)->first_expert(); },
      [](const void* d) -> int { return static_cast<const D*>(d)->size(); },
      [](const void* d) -> Device { return static_cast<const D*>(d)->device(); },
      [](void* d, const Tensor& x, const Tensor& i, Handle& h, const Stream& s) -> Tensor {
        return static_cast<D*>(d)->dispatch(x, i, handle_of<D>(h), s);
      },
      [](void* d, const Tensor& o, const Tensor& w, Handle& h, const Stream& s, const Tensor& y) -> Tensor {
        return static_cast<D*>(d)->combine(o, w, handle_of<D>(h), s, y);
      },
      [](void* d, const Tensor& dy, const Handle& h, const Stream& s) -> CombineGrads {
        return static_cast<D*>(d)->combine_backward(dy, handle_of<D>(h), s);
      },
      [](void* d, const Tensor& dr, const Handle& h, const Stream& s, const Tensor& dx) -> Tensor {
        return static_cast<D*>(d)->dispatch_backward(dr, handle_of<D>(h), s, dx);
      },
      [](const Handle& h) -> Tensor { return handle_of<D>(h).local_offsets(); },
      [](const Handle& h) -> const std::vector<int64_t>& { return handle_of<D>(h).local_counts(); },
  };

  void* self_ = nullptr;
  const Ops* ops_ = nullptr;
};

}  // namespace slime::nn
