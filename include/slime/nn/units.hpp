// slime/nn/units.hpp: a model's units (the groups of parameters a wrapper
// gathers, releases and reduces together) and the hooks its forward and
// backward call at unit boundaries: the one layer loop of the library, that
// wrappers (parallel::Sharded) plug into instead of copying it.
//
// A model with units provides
//   std::vector<Unit> units();    // in forward order; every parameter exactly once
//   forward(input, ctx, stream, hooks)
//   backward(ctx, dy, stream, hooks, ...)
// forward calls hooks.forward_begin(u) / forward_end(u) around the work that
// uses unit u's parameters, for u = 0, 1, ... in order (a unit may begin
// inside another: a layer's expert stack inside its layer); backward calls
// backward_begin(u) / backward_end(u) in reverse order. A unit's parameters
// are used only between its begin and its end, so a wrapper may install
// their values and gradients as views that exist only then.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "slime/nn/module.hpp"

namespace slime::nn {

// dense:  parameters every data-parallel rank holds the same copy of.
// expert: an expert stack split over `expert_degree` > 1 ranks (each holds its
//         slice), so the ranks holding the same slice are fewer than those
//         holding the dense parameters.
enum class UnitKind : uint8_t { dense, expert };

struct Unit {
  std::string name;  // HF module path, e.g. "model.layers.3" or "model.layers.3.mlp.experts"
  std::vector<Parameter*> params;
  UnitKind kind = UnitKind::dense;
  int expert_degree = 1;     // expert units: ranks the stack is split over
  bool has_lm_head = false;  // holds the LM head (logits and token logprobs use it)
  // false: the model's backward leaves these parameters alone (a frozen
  // vision tower); a wrapper's optimizer must not step them either.
  bool trainable = true;
};

template <class H>
concept UnitHooks = requires(H& h, std::size_t u) {
  h.forward_begin(u);
  h.forward_end(u);
  h.backward_begin(u);
  h.backward_end(u);
};

// The default: nothing happens at unit boundaries.
struct NoHooks {
  void forward_begin(std::size_t) {}
  void forward_end(std::size_t) {}
  void backward_begin(std::size_t) {}
  void backward_end(std::size_t) {}
};
static_assert(UnitHooks<NoHooks>);

// Hooks of a part of a model whose units start at `offset` in the whole
// model's list (a VLM's language model after its vision tower's units).
template <UnitHooks H>
struct OffsetHooks {
  H& hooks;
  std::size_t offset = 0;
  void forward_begin(std::size_t u) { hooks.forward_begin(offset + u); }
  void forward_end(std::size_t u) { hooks.forward_end(offset + u); }
  void backward_begin(std::size_t u) { hooks.backward_begin(offset + u); }
  void backward_end(std::size_t u) { hooks.backward_end(offset + u); }
};

// A model whose units a wrapper can drive.
template <class M>
concept HasUnits = requires(M& m) {
  { m.units() } -> std::convertible_to<std::vector<Unit>>;
};

// Index of the unit holding the LM head (units.size() when there is none).
inline std::size_t lm_head_unit(const std::vector<Unit>& units) {
  for (std::size_t i = 0; i < units.size(); ++i)
    if (units[i].has_lm_head) return i;
  return units.size();
}

}  // namespace slime::nn
