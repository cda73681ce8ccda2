// Mesh: degree validation, rank layout, per-axis communicators (membership
// checked by gathering world ranks), flattened groups, size-1 axes.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <mutex>

#include "slime/comm/local_comm.hpp"
#include "slime/comm/mesh.hpp"

using namespace slime;
using namespace slime::comm;
using Catch::Matchers::ContainsSubstring;

namespace {

// The world ranks that make up `c`, in c's rank order.
std::vector<int64_t> members(Comm& c, int world_rank) {
  Tensor mine = Tensor::from_vector(std::vector<int64_t>{world_rank}, {1});
  Tensor all = Tensor::empty({c.size()}, DType::i64);
  c.all_gather(mine, all);
  return all.to_vector<int64_t>();
}

}  // namespace

TEST_CASE("mesh shapes validate against the world size", "[comm][mesh]") {
  CHECK(MeshShape{}.resolved(8).dp_shard == 8);
  const MeshShape s = MeshShape{.dp_replicate = 2, .dp_shard = -1, .cp = 1, .ep = 2}.resolved(8);
  CHECK(s.dp_shard == 2);
  CHECK(MeshShape{.dp_replicate = 1, .dp_shard = 3, .cp = 1, .ep = 1}.resolved(3).str() ==
        "dp_replicate=1,dp_shard=3,cp=1,ep=1");
  CHECK_THROWS_WITH((MeshShape{.dp_replicate = 1, .dp_shard = 3, .cp = 1, .ep = 2}.resolved(8)),
                    ContainsSubstring("= 6 ranks, but the world has 8"));
  CHECK_THROWS_WITH((MeshShape{.dp_replicate = 1, .dp_shard = -1, .cp = 1, .ep = 3}.resolved(8)),
                    ContainsSubstring("not divisible"));
  CHECK_THROWS_WITH((MeshShape{.dp_replicate = -1, .dp_shard = -1, .cp = 1, .ep = 1}.resolved(8)),
                    ContainsSubstring("at most one axis"));
  CHECK_THROWS_WITH((MeshShape{.dp_replicate = 1, .dp_shard = 0, .cp = 1, .ep = 1}.resolved(8)),
                    ContainsSubstring("dp_shard has degree 0"));
}

TEST_CASE("mesh specs parse from text", "[comm][mesh]") {
  const MeshShape s = MeshShape::parse("dp_shard=4,ep=2");
  CHECK(s.dp_shard == 4);
  CHECK(s.ep == 2);
  CHECK(s.cp == 1);
  CHECK(MeshShape::parse("").dp_shard == -1);
  CHECK_THROWS_WITH(MeshShape::parse("tp=2"), ContainsSubstring("unknown axis 'tp'"));
  CHECK_THROWS_WITH(MeshShape::parse("ep=two"), ContainsSubstring("not an integer"));
  CHECK_THROWS_WITH(MeshShape::parse("ep"), ContainsSubstring("not axis=degree"));
}

TEST_CASE("an 8-rank mesh builds the right groups on every axis", "[comm][mesh]") {
  // dp_replicate=2, dp_shard=2, cp=1, ep=2: rank = (r * 2 + s) * 2 + e.
  std::mutex mu;
  std::vector<std::string> failures;
  run_local_ranks(8, [&](Comm& world) {
    const int w = world.rank();
    Mesh mesh(world, MeshShape{.dp_replicate = 2, .dp_shard = 2, .cp = 1, .ep = 2});
    const int r = w / 4, s = (w / 2) % 2, e = w % 2;
    auto expect = [&](bool ok, const std::string& what) {
      if (!ok) {
        std::lock_guard lock(mu);
        failures.push_back("rank " + std::to_string(w) + ": " + what);
      }
    };
    expect(mesh.coord(Axis::dp_replicate) == r && mesh.coord(Axis::dp_shard) == s && mesh.coord(Axis::ep) == e &&
               mesh.coord(Axis::cp) == 0,
           "coordinates");
    expect(mesh.rank_at({r, s, 0, e}) == w, "rank_at");
    for (Axis a : kAllAxes) expect(mesh.comm(a).rank() == mesh.coord(a), "comm rank on " + std::string(axis_name(a)));
    const int base = w - e;  // ep peers: same r, s
    expect(members(mesh.comm(Axis::ep), w) == std::vector<int64_t>{base, base + 1}, "ep members");
    expect(members(mesh.comm(Axis::dp_shard), w) == std::vector<int64_t>{r * 4 + e, r * 4 + 2 + e}, "dp_shard members");
    expect(members(mesh.comm(Axis::dp_replicate), w) == std::vector<int64_t>{s * 2 + e, 4 + s * 2 + e},
           "dp_replicate members");
    expect(members(mesh.comm(Axis::cp), w) == std::vector<int64_t>{w}, "size-1 cp axis");
    auto fsdp = mesh.flatten({Axis::dp_shard, Axis::ep});
    expect(fsdp->size() == 4 && fsdp->rank() == s * 2 + e, "flattened rank");
    expect(members(*fsdp, w) == std::vector<int64_t>{r * 4, r * 4 + 1, r * 4 + 2, r * 4 + 3}, "flattened members");
  });
  INFO((failures.empty() ? std::string() : failures.front()));
  CHECK(failures.empty());
}

TEST_CASE("a world of one rank is a valid mesh with every axis of size 1", "[comm][mesh]") {
  run_local_ranks(1, [&](Comm& world) {
    Mesh mesh(world, MeshShape{});
    for (Axis a : kAllAxes) {
      REQUIRE(mesh.size(a) == 1);
      REQUIRE(mesh.comm(a).size() == 1);
    }
    Tensor t = Tensor::from_vector(std::vector<float>{1.5f, -2.f}, {2});
    mesh.comm(Axis::ep).all_reduce(t);
    REQUIRE(t.to_vector<float>() == std::vector<float>{1.5f, -2.f});
  });
}

TEST_CASE("a mesh that does not fit the world fails on every rank", "[comm][mesh]") {
  CHECK_THROWS_WITH(run_local_ranks(4,
                                    [&](Comm& world) {
                                      Mesh mesh(world, MeshShape{.dp_replicate = 1, .dp_shard = 3, .cp = 1, .ep = 1});
                                    }),
                    ContainsSubstring("but the world has 4"));
}
