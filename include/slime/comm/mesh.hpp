// slime/comm/mesh.hpp: Mesh, the world's ranks arranged on named axes
// (dp_replicate, dp_shard, cp, ep) with one sub-communicator per axis.
//
// Layout: ep is the innermost (fastest-varying) axis, dp_replicate the
// outermost:
//   rank = ((dp_replicate_i * dp_shard + dp_shard_i) * cp + cp_i) * ep + ep_i
// so expert-parallel and context-parallel peers are neighbours (the same node
// first), and replicas are far apart. The product of the degrees must equal
// the world size. An axis of degree 1 is kept: its communicator has one rank,
// so code never branches on whether an axis exists.
#pragma once

#include <array>
#include <charconv>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "slime/comm/comm.hpp"

namespace slime::comm {

enum class Axis : uint8_t { dp_replicate = 0, dp_shard = 1, cp = 2, ep = 3 };
inline constexpr int kNumAxes = 4;
inline constexpr std::array<Axis, kNumAxes> kAllAxes{Axis::dp_replicate, Axis::dp_shard, Axis::cp, Axis::ep};

inline std::string_view axis_name(Axis a) {
  switch (a) {
    case Axis::dp_replicate: return "dp_replicate";
    case Axis::dp_shard: return "dp_shard";
    case Axis::cp: return "cp";
    case Axis::ep: return "ep";
  }
  return "?";
}

// Degrees of the mesh axes. At most one may be -1: it takes whatever the world
// size leaves (e.g. {.dp_shard = -1, .ep = 2} on 8 ranks gives dp_shard 4).
struct MeshShape {
  int dp_replicate = 1;
  int dp_shard = -1;
  int cp = 1;
  int ep = 1;

  int& operator[](Axis a) {
    switch (a) {
      case Axis::dp_replicate: return dp_replicate;
      case Axis::dp_shard: return dp_shard;
      case Axis::cp: return cp;
      case Axis::ep: return ep;
    }
    SLIME_FAIL("invalid axis ", int(a));
  }
  int operator[](Axis a) const {
    switch (a) {
      case Axis::dp_replicate: return dp_replicate;
      case Axis::dp_shard: return dp_shard;
      case Axis::cp: return cp;
      case Axis::ep: return ep;
    }
    SLIME_FAIL("invalid axis ", int(a));
  }

  // "dp_shard=4,ep=2" (axes not named keep their defaults). Whitespace is not
  // allowed; an unknown axis or a bad number is an error.
  static MeshShape parse(std::string_view spec) {
    MeshShape s;
    while (!spec.empty()) {
      const auto comma = spec.find(',');
      const std::string_view item = spec.substr(0, comma);
      spec = comma == std::string_view::npos ? std::string_view{} : spec.substr(comma + 1);
      const auto eq = item.find('=');
      SLIME_CHECK(eq != std::string_view::npos, "mesh spec item '", item, "' is not axis=degree");
      const std::string_view name = item.substr(0, eq), value = item.substr(eq + 1);
      int degree = 0;
      const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), degree);
      SLIME_CHECK(ec == std::errc() && end == value.data() + value.size(), "mesh spec: '", value,
                  "' is not an integer degree for axis ", name);
      bool known = false;
      for (Axis a : kAllAxes)
        if (axis_name(a) == name) {
          s[a] = degree;
          known = true;
        }
      SLIME_CHECK(known, "mesh spec: unknown axis '", name, "' (axes: dp_replicate, dp_shard, cp, ep)");
    }
    return s;
  }

  // Checks the degrees against `world` and fills in the -1 axis.
  MeshShape resolved(int world) const {
    MeshShape r = *this;
    int inferred = -1;
    int64_t known = 1;
    for (Axis a : kAllAxes) {
      const int d = r[a];
      if (d == -1) {
        SLIME_CHECK(inferred < 0, "mesh: both ", axis_name(Axis(inferred)), " and ", axis_name(a),
                    " are -1; at most one axis can be inferred");
        inferred = int(a);
      } else {
        SLIME_CHECK(d >= 1, "mesh: axis ", axis_name(a), " has degree ", d, "; degrees are >= 1 (or -1 to infer)");
        known *= d;
      }
    }
    if (inferred >= 0) {
      SLIME_CHECK(world % known == 0, "mesh: world size ", world, " is not divisible by the product ", known,
                  " of the given degrees (", str(), "), so ", axis_name(Axis(inferred)), " cannot be inferred");
      r[Axis(inferred)] = int(world / known);
    } else {
      SLIME_CHECK(known == world, "mesh: dp_replicate x dp_shard x cp x ep = ", str(), " = ", known,
                  " ranks, but the world has ", world);
    }
    return r;
  }

  std::string str() const {
    std::string s;
    for (Axis a : kAllAxes) s += (s.empty() ? "" : ",") + std::string(axis_name(a)) + "=" + std::to_string((*this)[a]);
    return s;
  }
};

class Mesh {
 public:
  // Collective over `world`: every rank calls it with the same shape. Creates
  // one communicator per axis (kAllAxes order, so all ranks split alike).
  // `world` must outlive the mesh.
  Mesh(Comm& world, const MeshShape& shape) : world_(&world), shape_(shape.resolved(world.size())) {
    int rest = world_->rank();
    for (int i = kNumAxes - 1; i >= 0; --i) {
      const int d = shape_[Axis(i)];
      coord_[std::size_t(i)] = rest % d;
      rest /= d;
    }
    for (Axis a : kAllAxes) axis_comm_[std::size_t(a)] = split_over({a});
  }

  Comm& world() const { return *world_; }
  const MeshShape& shape() const { return shape_; }
  int size(Axis a) const { return shape_[a]; }
  // This rank's position along `a` (its rank in comm(a)).
  int coord(Axis a) const { return coord_[std::size_t(a)]; }
  Comm& comm(Axis a) const { return *axis_comm_[std::size_t(a)]; }

  // The world rank at the given coordinates.
  int rank_at(const std::array<int, kNumAxes>& coord) const {
    int r = 0;
    for (Axis a : kAllAxes) {
      const int c = coord[std::size_t(a)];
      SLIME_CHECK(c >= 0 && c < shape_[a], "mesh coordinate ", c, " out of range for axis ", axis_name(a),
                  " of degree ", shape_[a]);
      r = r * shape_[a] + c;
    }
    return r;
  }

  // A new communicator over the product of `axes` (e.g. {dp_shard, ep}: the
  // ranks a dense parameter shards over when experts take the ep axis); rank
  // order follows the mesh layout. Collective over the world: every rank must
  // call it with the same axes, in the same order relative to other calls.
  std::unique_ptr<Comm> flatten(std::initializer_list<Axis> axes) const { return split_over(axes); }

 private:
  std::unique_ptr<Comm> split_over(std::initializer_list<Axis> axes) const {
    bool in_group[kNumAxes] = {};
    for (Axis a : axes) {
      SLIME_CHECK(!in_group[std::size_t(a)], "mesh: axis ", axis_name(a), " named twice");
      in_group[std::size_t(a)] = true;
    }
    // color: the coordinates off the group's axes (ranks that differ only on
    // the group's axes share it); key: position inside the group, row-major.
    int color = 0, key = 0;
    for (Axis a : kAllAxes) {
      const std::size_t i = std::size_t(a);
      if (in_group[i]) {
        key = key * shape_[a] + coord_[i];
      } else {
        color = color * shape_[a] + coord_[i];
      }
    }
    auto comm = world_->split(color, key);
    SLIME_CHECK(comm != nullptr, "mesh: split returned no communicator");
    return comm;
  }

  Comm* world_;
  MeshShape shape_;
  std::array<int, kNumAxes> coord_{};
  std::array<std::unique_ptr<Comm>, kNumAxes> axis_comm_;
};

}  // namespace slime::comm
