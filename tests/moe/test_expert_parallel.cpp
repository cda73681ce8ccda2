// ExpertParallel on LocalComm (ranks as threads, CPU): dispatch / combine and
// their backwards against hand-computed rows; SparseMoeBlock with EP = 1, 2, 4
// against the unsharded block (outputs and every gradient; random and skewed
// routing, experts and ranks without tokens, k = 1, 2, 8, E = 8, 16, the
// auxiliary-loss input); steady-state calls allocating nothing; bad input.
//
// Catch2 assertions are not thread-safe: rank threads record what they
// computed, and the test thread checks it after run_local_ranks has joined.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "moe_test_util.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/core/memory.hpp"
#include "slime/nn/moe.hpp"
#include "slime/parallel/expert_parallel.hpp"

using namespace slime;
using namespace moe_test;
using Catch::Matchers::ContainsSubstring;
using parallel::ExpertParallel;

namespace {

using namespace std::chrono_literals;

template <class F>
void run(int world, F&& fn) {
  comm::run_local_ranks(world, std::forward<F>(fn), 30s);
}

void append(Vec& to, const Vec& v) { to.insert(to.end(), v.begin(), v.end()); }

// ---- dispatch / combine against hand-computed rows ---------------------------

// Rank r's token t routes slot j to expert (3t + 5j + r) % E (distinct per
// token for k <= 2 and E = 8); x[t, c] = 1000 r + 10 t + c (exact in f32).
int32_t expert_of(int r, int64_t t, int64_t j, int64_t E) { return int32_t((3 * t + 5 * j + r) % E); }
double x_of(int r, int64_t t, int64_t c) { return 1000.0 * r + 10.0 * double(t) + double(c); }

struct ExchangeResult {
  Vec rows, y, d_out, dweights, dx;
  std::vector<int32_t> offsets;
  std::vector<int64_t> send_rows, recv_rows;
};

}  // namespace

TEST_CASE("ExpertParallel dispatch groups rows by local expert, then source rank, then token", "[moe][ep]") {
  for (int ep : {1, 2, 4}) {
    const int64_t E = 8, k = 2, H = 3;
    auto tokens = [](int r) { return int64_t(r == 1 ? 0 : 4 + r); };  // rank 1 has none
    auto weight = [](int r, int64_t t, int64_t j) { return 0.25 * double(j + 1) + 0.5 * r + 0.125 * double(t); };
    std::vector<ExchangeResult> got(static_cast<std::size_t>(ep));
    run(ep, [&](comm::Comm& comm) {
      const int r = comm.rank();
      ExchangeResult& out = got[std::size_t(r)];
      ExpertParallel<> epar(comm, E);
      const int64_t T = tokens(r);
      Vec x, w, dy;
      std::vector<int32_t> idx;
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t c = 0; c < H; ++c) x.push_back(x_of(r, t, c));
        for (int64_t c = 0; c < H; ++c) dy.push_back(double(c + 1) - 0.5 * double(t));
        for (int64_t j = 0; j < k; ++j) {
          idx.push_back(expert_of(r, t, j, E));
          w.push_back(weight(r, t, j));
        }
      }
      parallel::DispatchHandle h;
      const Tensor rows = epar.dispatch(tensor_of(x, {T, H}), Tensor::from_vector(idx, {T, k}), h);
      out.rows = to_double(rows);
      out.offsets = h.local_offsets().to_vector<int32_t>();
      out.send_rows = h.send_rows();
      out.recv_rows = h.recv_rows();
      // Identity experts: combine gives y[t] = Σ_j w[t, j] · x[t].
      out.y = to_double(epar.combine(rows, tensor_of(w, {T, k}), h));
      const auto g = epar.combine_backward(tensor_of(dy, {T, H}), h);
      out.d_out = to_double(g.d_expert_out);
      out.dweights = to_double(g.dweights);
      out.dx = to_double(epar.dispatch_backward(g.d_expert_out, h));
    });
    const int64_t El = E / ep;
    for (int r = 0; r < ep; ++r) {
      INFO("ep " << ep << " rank " << r);
      const ExchangeResult& o = got[std::size_t(r)];
      Vec want;
      std::vector<int32_t> offsets{0};
      std::vector<int64_t> recv(static_cast<std::size_t>(ep), 0);
      Vec want_d;
      for (int64_t i = 0; i < El; ++i) {
        for (int s = 0; s < ep; ++s)
          for (int64_t t = 0; t < tokens(s); ++t)
            for (int64_t j = 0; j < k; ++j)
              if (expert_of(s, t, j, E) == r * El + i) {
                for (int64_t c = 0; c < H; ++c) {
                  want.push_back(x_of(s, t, c));
                  want_d.push_back(weight(s, t, j) * (double(c + 1) - 0.5 * double(t)));
                }
                ++recv[std::size_t(s)];
              }
        offsets.push_back(int32_t(want.size() / H));
      }
      CHECK(o.rows == want);
      CHECK(o.offsets == offsets);
      CHECK(o.d_out == want_d);
      if (ep > 1) {
        CHECK(o.recv_rows == recv);
        std::vector<int64_t> send(static_cast<std::size_t>(ep), 0);
        for (int64_t t = 0; t < tokens(r); ++t)
          for (int64_t j = 0; j < k; ++j) ++send[std::size_t(expert_of(r, t, j, E) / El)];
        CHECK(o.send_rows == send);
      }
      Vec y, dw, dx;
      for (int64_t t = 0; t < tokens(r); ++t) {
        const double ws = weight(r, t, 0) + weight(r, t, 1);
        for (int64_t c = 0; c < H; ++c) {
          y.push_back(ws * x_of(r, t, c));
          dx.push_back(ws * (double(c + 1) - 0.5 * double(t)));
        }
        for (int64_t j = 0; j < k; ++j) {
          double d = 0;
          for (int64_t c = 0; c < H; ++c) d += (double(c + 1) - 0.5 * double(t)) * x_of(r, t, c);
          dw.push_back(d);
        }
      }
      CHECK(rel_error(o.y, y) < 1e-6);
      CHECK(rel_error(o.dweights, dw) < 1e-6);
      CHECK(rel_error(o.dx, dx) < 1e-6);
    }
  }
}

namespace {

// ---- SparseMoeBlock with EP against the unsharded block ---------------------

struct EpCase {
  std::vector<int64_t> tokens;  // per ep rank
  int64_t H, I, E, k;
  bool norm = true;
  int skew = -1;  // every token's first choice (via the gate), or -1
  bool aux = false;
  uint64_t seed = 1;
};

struct Run {
  Vec y, dx, gate, wg, wu, wd;
};

// The block on `x` [T, H] (T from the sizes), once without ep.
Run run_block(nn::SparseMoeBlock& b, const Vec& x, const Vec& dy, const Vec& aux, int64_t T) {
  const int64_t H = b.config.hidden_size, E = b.config.num_experts;
  nn::SparseMoeBlock::Context ctx;
  Run out;
  // Twice, the second time through the same context and (with ep) the same
  // handle, gradients zeroed in between: the second pass is reported.
  for (int pass = 0; pass < 2; ++pass) {
    nn::zero_grad(b);
    out.y = to_double(b.forward(tensor_of(x, {T, H}), ctx));
    out.dx = to_double(b.backward(ctx, tensor_of(dy, {T, H}), {}, aux.empty() ? Tensor() : tensor_of(aux, {T, E})));
  }
  out.gate = to_double(b.gate.grad);
  out.wg = to_double(b.gate_proj.grad);
  out.wu = to_double(b.up_proj.grad);
  out.wd = to_double(b.down_proj.grad);
  return out;
}

void check_ep_case(const EpCase& c) {
  const int ep = int(c.tokens.size());
  int64_t T = 0;
  std::vector<int64_t> first_token;
  for (int64_t n : c.tokens) {
    first_token.push_back(T);
    T += n;
  }
  Weights w = Weights::random(c.H, c.I, c.E, c.seed, 2.0);
  Vec x = f32_rounded(random_doubles(T * c.H, c.seed + 10));
  if (c.skew >= 0) {
    // Feature 0 of every token is 1 and only the skewed expert's gate weighs
    // it (by 20): that expert is every token's first choice.
    for (int64_t t = 0; t < T; ++t) x[std::size_t(t * c.H)] = 1.0;
    for (int64_t e = 0; e < c.E; ++e) w.gate[std::size_t(e * c.H)] = e == c.skew ? 20.0 : 0.0;
  }
  const Vec dy = f32_rounded(random_doubles(T * c.H, c.seed + 11));
  const Vec aux = c.aux ? f32_rounded(random_doubles(T * c.E, c.seed + 12, 0.2)) : Vec{};
  const nn::MoeBlockConfig cfg{c.H, c.I, c.E, c.k, c.norm};

  nn::SparseMoeBlock full("model.layers.1.mlp", cfg, {});
  load(full, w);
  const Run want = run_block(full, x, dy, aux, T);

  std::vector<Run> got(static_cast<std::size_t>(ep));
  std::vector<int64_t> firsts(static_cast<std::size_t>(ep));
  run(ep, [&](comm::Comm& comm) {
    const int r = comm.rank();
    ExpertParallel<> epar(comm, c.E);
    nn::SparseMoeBlock b("model.layers.1.mlp", cfg, {}, &epar);
    load(b, w);
    firsts[std::size_t(r)] = b.gate_proj.first_expert;
    const int64_t t0 = first_token[std::size_t(r)], n = c.tokens[std::size_t(r)];
    got[std::size_t(r)] =
        run_block(b, rows_of(x, c.H, t0, n), rows_of(dy, c.H, t0, n), c.aux ? rows_of(aux, c.E, t0, n) : Vec{}, n);
  });

  Vec y, dx, wg, wu, wd, gate(want.gate.size(), 0.0);
  for (int r = 0; r < ep; ++r) {
    const Run& g = got[std::size_t(r)];
    CHECK(firsts[std::size_t(r)] == r * (c.E / ep));
    append(y, g.y);
    append(dx, g.dx);
    append(wg, g.wg);
    append(wu, g.wu);
    append(wd, g.wd);
    for (std::size_t i = 0; i < gate.size(); ++i) gate[i] += g.gate[i];  // the data-parallel reduction
  }
  CHECK(rel_error(y, want.y) <= 1e-6);
  CHECK(rel_error(dx, want.dx) <= 1e-6);
  CHECK(rel_error(gate, want.gate) <= 1e-6);
  CHECK(rel_error(wg, want.wg) <= 1e-6);
  CHECK(rel_error(wu, want.wu) <= 1e-6);
  CHECK(rel_error(wd, want.wd) <= 1e-6);
  // The expert path is the unsharded one row for row (same rows, same order):
  // outputs and expert gradients are bitwise equal.
  CHECK(y == want.y);
  CHECK(wd == want.wd);
  CHECK(max_abs(want.y) > 0);
}

}  // namespace

TEST_CASE("SparseMoeBlock with EP = 1, 2, 4 equals the unsharded block", "[moe][ep][block]") {
  for (int ep : {1, 2, 4})
    for (int64_t E : {8, 16})
      for (int64_t k : {1, 2, 8}) {
        EpCase c;
        for (int r = 0; r < ep; ++r) c.tokens.push_back(5 + 3 * r);
        c.H = 6;
        c.I = 5;
        c.E = E;
        c.k = k;
        c.norm = k != 2;
        c.aux = k == 2;
        c.seed = uint64_t(100 * ep + 10 * E + k);
        INFO("ep " << ep << " E " << E << " k " << k);
        check_ep_case(c);
      }
}

TEST_CASE("SparseMoeBlock with EP: skewed routing, idle experts and ranks, zero tokens", "[moe][ep][block]") {
  SECTION("every token to expert 13, k = 1: ranks owning no chosen expert get nothing") {
    for (int ep : {2, 4}) {
      EpCase c{std::vector<int64_t>(std::size_t(ep), 6), 5, 4, 16, 1, true, 13, false, 7};
      INFO("ep " << ep);
      check_ep_case(c);
    }
  }
  SECTION("every token first to expert 2, k = 2 and 8") {
    for (int64_t k : {2, 8}) {
      EpCase c{{4, 7, 3, 5}, 6, 3, 8, k, true, 2, true, 8};
      INFO("k " << k);
      check_ep_case(c);
    }
  }
  SECTION("a rank with 0 tokens") {
    check_ep_case({{0, 9}, 4, 3, 8, 2, true, -1, true, 9});
    check_ep_case({{6, 0, 0, 3}, 4, 3, 16, 8, false, -1, false, 10});
  }
  SECTION("more experts than tokens: most experts idle") {
    check_ep_case({{1, 2, 1, 1}, 5, 3, 16, 1, true, -1, false, 11});
  }
}

TEST_CASE("SparseMoeBlock with EP: every rank with 0 tokens still runs and gives zero gradients", "[moe][ep][block]") {
  std::vector<Run> got(2);
  run(2, [&](comm::Comm& comm) {
    ExpertParallel<2> epar(comm, 8);
    nn::SparseMoeBlock b("m", {4, 3, 8, 2, true}, {}, &epar);
    load(b, Weights::random(4, 3, 8, 5));
    got[std::size_t(comm.rank())] = run_block(b, {}, {}, {}, 0);
  });
  for (const Run& g : got) {
    CHECK(g.y.empty());
    CHECK(g.dx.empty());
    CHECK(max_abs(g.gate) == 0.0);
    CHECK(max_abs(g.wg) == 0.0);
    CHECK(max_abs(g.wu) == 0.0);
    CHECK(max_abs(g.wd) == 0.0);
    CHECK(g.wd.size() == 4 * 4 * 3);  // E_local = 4 experts of [H, I]
  }
}

TEST_CASE("ExpertParallel: steady-state calls allocate no tensors", "[moe][ep][memory]") {
  // The rows and counts change between calls, within the capacity the warm-up
  // reached. Between the two barriers every rank is in steady state, so the
  // (process-wide) allocation counter must not move.
  const int64_t E = 8, k = 2, H = 4;
  std::vector<int64_t> delta(2, -1);
  run(2, [&](comm::Comm& comm) {
    const int r = comm.rank();
    ExpertParallel<> epar(comm, E);
    parallel::DispatchHandle h;
    auto inputs = [&](int64_t T, int variant) {
      std::vector<int32_t> idx;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < k; ++j) idx.push_back(expert_of(r + variant, t, j, E));
      return std::pair{tensor_of(random_doubles(T * H, uint64_t(r + 1)), {T, H}), Tensor::from_vector(idx, {T, k})};
    };
    auto step = [&](const Tensor& x, const Tensor& idx, const Tensor& w, const Tensor& dy) {
      const Tensor rows = epar.dispatch(x, idx, h);
      (void)epar.combine(rows, w, h);
      const auto g = epar.combine_backward(dy, h);
      (void)epar.dispatch_backward(g.d_expert_out, h);
    };
    auto [x, idx] = inputs(12, 0);
    auto [x2, idx2] = inputs(9, 1);
    const Tensor w = tensor_of(random_doubles(12 * k, 3), {12, k}), dy = tensor_of(random_doubles(12 * H, 4), {12, H});
    const Tensor w2 = w.slice_rows(0, 9), dy2 = dy.slice_rows(0, 9);
    // Warm-up: all rows of both ranks to rank 0's experts, then to rank 1's,
    // so every buffer reaches its largest size.
    for (int32_t to : {0, 4}) {
      std::vector<int32_t> one_rank(12 * k);
      for (std::size_t i = 0; i < one_rank.size(); ++i) one_rank[i] = to + int32_t(i % k);
      step(x, Tensor::from_vector(one_rank, {12, k}), w, dy);
    }
    comm.barrier();
    const int64_t before = memory_stats(Device::cpu()).allocations;
    step(x, idx, w, dy);
    step(x2, idx2, w2, dy2);
    step(x, idx, w, dy);
    comm.barrier();
    delta[std::size_t(r)] = memory_stats(Device::cpu()).allocations - before;
    comm.barrier();
  });
  CHECK(delta == std::vector<int64_t>{0, 0});
}

TEST_CASE("ExpertParallel: construction from a communicator or a mesh, and its degree", "[moe][ep]") {
  std::vector<int64_t> first(4), local(4), owner(4);
  std::vector<int> size(4);
  run(4, [&](comm::Comm& world) {
    const comm::Mesh mesh(world, comm::MeshShape{.dp_replicate = 1, .dp_shard = 2, .cp = 1, .ep = 2});
    ExpertParallel<2> fixed(mesh, 8);
    ExpertParallel<>* dynamic = &fixed;  // ExpertParallel<N> is an ExpertParallel<>
    const std::size_t r = std::size_t(world.rank());
    first[r] = dynamic->first_expert();
    local[r] = dynamic->num_local_experts();
    owner[r] = dynamic->owner(5);
    size[r] = dynamic->size();
  });
  CHECK(first == std::vector<int64_t>{0, 4, 0, 4});  // ep is the innermost mesh axis
  CHECK(local == std::vector<int64_t>{4, 4, 4, 4});
  CHECK(owner == std::vector<int64_t>{1, 1, 1, 1});
  CHECK(size == std::vector<int>{2, 2, 2, 2});
  static_assert(ExpertParallel<8>::degree == 8);
}

TEST_CASE(
    "ExpertParallel: init_parameters gives each ep rank its slice of the unsplit stack, gather_expert_stack "
    "reassembles it",
    "[moe][ep]") {
  nn::MoeBlockConfig cfg;
  cfg.hidden_size = 6;
  cfg.moe_intermediate_size = 5;
  cfg.num_experts = 8;
  cfg.num_experts_per_tok = 2;
  nn::SparseMoeBlock full("model.layers.1.mlp", cfg, {});
  nn::init_parameters(full, 11, 0.5f);
  std::vector<std::vector<float>> whole;
  full.for_each_parameter([&](nn::Parameter& p) { whole.push_back(p.value.to_vector<float>()); });
  for (int ep_size : {2, 4}) {
    INFO("ep " << ep_size);
    const auto ranks = std::size_t(ep_size);
    std::vector<std::vector<std::vector<float>>> sliced(ranks), gathered(ranks);
    std::vector<int64_t> firsts(ranks);
    run(ep_size, [&](comm::Comm& world) {
      ExpertParallel<> ep(world, cfg.num_experts);
      nn::SparseMoeBlock mine("model.layers.1.mlp", cfg, {}, &ep);
      nn::init_parameters(mine, 11, 0.5f);
      const std::size_t r = std::size_t(world.rank());
      firsts[r] = ep.first_expert();
      mine.for_each_parameter([&](nn::Parameter& p) {
        sliced[r].push_back(p.value.to_vector<float>());
        gathered[r].push_back(p.is_expert_stack() ? ep.gather_expert_stack(p.value).to_vector<float>()
                                                  : p.value.to_vector<float>());
      });
    });
    for (std::size_t r = 0; r < std::size_t(ep_size); ++r) {
      REQUIRE(sliced[r].size() == whole.size());
      CHECK(sliced[r][0] == whole[0]);  // the gate: replicated
      for (std::size_t i = 1; i < whole.size(); ++i) {
        const std::size_t per = whole[i].size() / std::size_t(cfg.num_experts);
        const std::size_t local = per * std::size_t(cfg.num_experts / ep_size);
        const auto begin = whole[i].begin() + std::ptrdiff_t(std::size_t(firsts[r]) * per);
        CHECK(sliced[r][i] == std::vector<float>(begin, begin + std::ptrdiff_t(local)));
        CHECK(gathered[r][i] == whole[i]);
      }
    }
  }
}

TEST_CASE("ExpertParallel rejects bad degrees, shapes and call orders", "[moe][ep][errors]") {
  CHECK_THROWS_WITH(run(4, [](comm::Comm& c) { ExpertParallel<> e(c, 6); }),
                    ContainsSubstring("num_experts = 6 does not divide over the ep group of 4 ranks"));
  CHECK_THROWS_WITH(run(4, [](comm::Comm& c) { ExpertParallel<2> e(c, 8); }),
                    ContainsSubstring("ExpertParallel<2>: the ep group has 4 ranks, expected 2"));
  CHECK_THROWS_WITH(run(2,
                        [](comm::Comm& c) {
                          ExpertParallel<> e(c, 8);
                          nn::SparseMoeBlock b("m", {4, 3, 16, 2, true}, {}, &e);
                        }),
                    ContainsSubstring("splits 8 experts but the block has num_experts = 16"));

  auto single = [](auto&& fn) {
    run(1, [&](comm::Comm& c) {
      ExpertParallel<1> e(c, 4);
      parallel::DispatchHandle h;
      fn(e, h);
    });
  };
  const Tensor x = Tensor::zeros({3, 2}, DType::f32);
  const Tensor idx = Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 3, 1, 0}, {3, 2});
  const Tensor w = Tensor::zeros({3, 2}, DType::f32);
  CHECK_THROWS_WITH(single([&](auto& e, auto& h) { e.dispatch(x.reshape({6}), idx, h); }),
                    ContainsSubstring("x must be 2-D [tokens, hidden]"));
  CHECK_THROWS_WITH(single([&](auto& e, auto& h) {
                      e.dispatch(Tensor::zeros({3, 2}, DType::i32), idx, h);
                    }),
                    ContainsSubstring("x must be f32 or bf16"));
  CHECK_THROWS_WITH(single([&](auto& e, auto& h) { e.dispatch(x.slice_rows(0, 2), idx, h); }),
                    ContainsSubstring("must have one row per token"));
  CHECK_THROWS_WITH(single([&](auto& e, auto& h) {
                      e.dispatch(x, Tensor::zeros({3, 2}, DType::i64), h);
                    }),
                    ContainsSubstring("indices must be i32 [tokens, k]"));
  CHECK_THROWS_WITH(single([&](auto& e, auto& h) {
                      e.dispatch(x, Tensor::zeros({3, 5}, DType::i32), h);
                    }),
                    ContainsSubstring("k = 5 (indices dim 1) must be in [1, num_experts = 4]"));
  CHECK_THROWS_WITH(single([&](auto& e, auto& h) {
                      e.dispatch(x, Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 4, 1, 0}, {3, 2}), h);
                    }),
                    ContainsSubstring("is not an expert id in [0, 4)"));
  CHECK_THROWS_WITH(single([&](auto& e, auto& h) {
                      e.combine(Tensor::zeros({6, 2}, DType::f32), w, h);
                    }),
                    ContainsSubstring("holds no dispatch"));
  CHECK_THROWS_WITH(single([&](auto& e, auto& h) { e.combine_backward(x, h); }), ContainsSubstring("has no combine"));
  CHECK_THROWS_WITH(single([&](auto& e, auto& h) {
                      e.dispatch(x, idx, h);
                      e.combine(Tensor::zeros({5, 2}, DType::f32), w, h);
                    }),
                    ContainsSubstring("expert_out must have shape [6, hidden]"));
  CHECK_THROWS_WITH(single([&](auto& e, auto& h) {
                      e.dispatch(x, idx, h);
                      e.combine(Tensor::zeros({6, 2}, DType::f32), Tensor::zeros({3, 1}, DType::f32), h);
                    }),
                    ContainsSubstring("weights must be [3, 2]"));
  CHECK_THROWS_WITH(single([&](auto& e, auto& h) {
                      const Tensor rows = e.dispatch(x, idx, h);
                      e.combine(rows, w, h);
                      e.combine_backward(Tensor::zeros({3, 2}, DType::bf16), h);
                    }),
                    ContainsSubstring("dy must be f32"));
  CHECK_THROWS_WITH(single([&](auto& e, auto& h) {
                      e.dispatch(x, idx, h);
                      e.dispatch_backward(Tensor::zeros({6, 3}, DType::f32), h);
                    }),
                    ContainsSubstring("d_rows must have shape [6, 2]"));
  // The same check fails on every rank of a larger group, before any collective.
  CHECK_THROWS_WITH(run(2,
                        [&](comm::Comm& c) {
                          ExpertParallel<> e(c, 4);
                          parallel::DispatchHandle h;
                          e.dispatch(x, Tensor::zeros({3, 5}, DType::i32), h);
                        }),
                    ContainsSubstring("must be in [1, num_experts = 4]"));
}
