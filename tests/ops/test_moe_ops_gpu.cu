// MoE ops on the GPU (router, auxiliary loss, layout, permute / unpermute)
// against the CPU reference on fresh random inputs: bf16 and f32, odd sizes
// (tokens 1, 17, 577, 4099; hidden 2048, 1000, 7; E = 8, 60, 128, 256;
// k = 1, 2, 8 and a slow-path k = 64), skewed routing (every token to the
// same experts, so most experts get none), outputs poisoned with NaN (0xff
// bytes) before every kernel, misaligned views (the one-element kernels),
// the accumulate flags, ids outside [0, E) on the GPU, determinism and a
// steady state that allocates nothing. The auxiliary loss's stats path
// (router_aux_stats, _from_stats) must equal the one-call ops bit for bit,
// whole and over three row shards; its counts and N equal the CPU's exactly.
//
// Tolerances (‖gpu − ref‖ / ‖ref‖ over the whole output):
//   bit for bit: the layout (the same stable sort), moe_permute_forward (a
//     copy), moe_permute_backward and moe_unpermute_forward (fp32 sums in slot
//     order with IEEE adds and multiplies on both sides, one rounding), and
//     moe_unpermute_backward's dy_grouped (one product, one rounding);
//   probs 2e-6: GPU expf and a tree-ordered softmax sum against glibc exp and
//     a sequential sum, a few ulp (1.2e-7 each);
//   top-k indices: equal, except that two experts whose CPU probabilities are
//     within 1e-6 relative (a near tie that the ulp differences above can
//     reorder) may swap; such rows skip the weight check;
//   f32 weights, dlogits, loss, dweights: 1e-5 (fp32 sums of up to 4099 rows
//     or 2048 products in another order: ~1e-6);
//   bf16 outputs: 4e-3 (the fp32 values differ by ~1e-6, then rounding to
//     bf16 flips the few elements near a rounding boundary by one ulp, 2^-8).
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

#include "slime/core/memory.hpp"
#include "slime/core/random.hpp"
#include "slime/ops/moe_permute.hpp"
#include "slime/ops/router.hpp"

using namespace slime;

namespace {

constexpr double kTolBf16 = 4e-3;
constexpr double kTolF32 = 1e-5;
constexpr double kTolProbs = 2e-6;
constexpr double kNearTie = 1e-6;

double tolerance(DType t) { return t == DType::bf16 ? kTolBf16 : kTolF32; }

#define REQUIRE_GPU() \
  if (cuda_device_count() == 0) SKIP("no CUDA device")

Device gpu() { return Device::cuda(0); }
Device cpu() { return Device::cpu(); }

Tensor randn(const Shape& shape, DType dt, Device d, uint64_t seed, float stddev = 1.f) {
  Tensor t = Tensor::empty(shape, dt, d);
  fill_normal(t, seed, 0, 0.f, stddev);
  return t;
}

Tensor poisoned(const Shape& shape, DType dt, Device d) {
  Tensor t = Tensor::empty(shape, dt, d);
  t.fill_bytes_(0xff);
  return t;
}

// A view of `src`'s contents one element into a fresh buffer: never 16-byte
// aligned, so the kernels take their one-element paths.
Tensor misaligned(const Tensor& src) {
  Tensor buf = Tensor::empty({src.numel() + 1}, src.dtype(), src.device());
  Tensor v = buf.view(1, src.shape());
  v.copy_from(src);
  return v;
}

std::vector<double> to_double(const Tensor& t) {
  const Tensor h = t.to(cpu());
  std::vector<double> out(static_cast<std::size_t>(h.numel()));
  if (h.dtype() == DType::f32) {
    const float* p = h.data<float>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = p[i];
  } else {
    const BFloat16* p = h.data<BFloat16>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = double(float(p[i]));
  }
  return out;
}

// ‖got − want‖ / ‖want‖ (absolute when want is 0); NaN when got holds a NaN
// or an infinity (an element left unwritten).
double rel_err(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = to_double(got), w = to_double(want);
  REQUIRE(g.size() == w.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i])) return std::numeric_limits<double>::quiet_NaN();
    num += (g[i] - w[i]) * (g[i] - w[i]);
    den += w[i] * w[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// ‖got − want‖ / (‖want‖ + floor / tol): a relative error that stops
// growing where ‖want‖ falls below the floor. The aux-loss gradient cancels to
// ~0 when every expert is equally loaded (k = E, or uniform routing at large
// N); there a plain relative error would measure fp32 rounding noise against
// nothing. Compare the result with tol: ‖got − want‖ <= tol·‖want‖ + floor.
double rel_err_floor(const Tensor& got, const Tensor& want, double floor, double tol) {
  const std::vector<double> g = to_double(got), w = to_double(want);
  REQUIRE(g.size() == w.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i])) return std::numeric_limits<double>::quiet_NaN();
    num += (g[i] - w[i]) * (g[i] - w[i]);
    den += w[i] * w[i];
  }
  return std::sqrt(num) / (std::sqrt(den) + floor / tol);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(cpu()), hb = b.to(cpu());
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.data_ptr(), hb.data_ptr(), ha.nbytes()) == 0;
}

// Router-like ids [T, k]: k distinct experts per token from a seeded shuffle;
// skewed: every token picks experts 0..k-1 (the others get no tokens).
Tensor routing(int64_t T, int64_t E, int64_t k, uint64_t seed, bool skewed = false) {
  std::vector<int32_t> ids(static_cast<std::size_t>(T * k));
  std::vector<int32_t> perm(static_cast<std::size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t pick = skewed ? j : j + int64_t(philox_word(seed, uint64_t(t * k + j)) % uint64_t(E - j));
      std::swap(perm[std::size_t(j)], perm[std::size_t(pick)]);
      ids[std::size_t(t * k + j)] = perm[std::size_t(j)];
    }
  }
  return Tensor::from_vector(ids, {T, k});
}

// ---- router helpers --------------------------------------------------------

struct RouterOut {
  Tensor probs, indices, weights;
};

RouterOut run_router(const Tensor& logits, DType wdt, bool norm, int64_t k) {
  const Device d = logits.device();
  const int64_t T = logits.size(0), E = logits.size(1);
  RouterOut o{poisoned({T, E}, DType::f32, d), poisoned({T, k}, DType::i32, d), poisoned({T, k}, wdt, d)};
  ops::router_forward(logits, norm, o.probs, o.indices, o.weights);
  return o;
}

// Auxiliary-loss inputs on the CPU: probs [N, E] from the CPU router on
// random logits, ids [N, k] from routing() (not the probs' top-k).
std::pair<Tensor, Tensor> aux_inputs(int64_t N, int64_t E, int64_t k, uint64_t& seed, bool skewed) {
  const RouterOut r = run_router(randn({N, E}, DType::f32, cpu(), ++seed, 2.f), DType::f32, false, k);
  return {r.probs, routing(N, E, k, ++seed, skewed)};
}

// GPU indices equal the CPU's except for near ties; returns the rows whose
// indices are equal (the others are checked to be near ties).
std::vector<char> check_indices(const RouterOut& g, const RouterOut& c, int64_t* swapped_rows) {
  const std::vector<int32_t> gi = g.indices.to(cpu()).to_vector<int32_t>(), ci = c.indices.to_vector<int32_t>();
  const float* p = c.probs.data<float>();
  const int64_t T = c.indices.size(0), k = c.indices.size(1), E = c.probs.size(1);
  std::vector<char> same(static_cast<std::size_t>(T), 1);
  int64_t bad = 0;
  *swapped_rows = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t a = gi[std::size_t(t * k + j)], b = ci[std::size_t(t * k + j)];
      if (a == b) continue;
      same[std::size_t(t)] = 0;
      const bool in_range = a >= 0 && a < E;
      const double pa = in_range ? p[t * E + a] : -1.0, pb = p[t * E + b];
      if (!(std::fabs(pa - pb) <= kNearTie * std::max(pa, pb))) ++bad;
    }
    *swapped_rows += same[std::size_t(t)] ? 0 : 1;
  }
  CHECK(bad == 0);
  return same;
}

// rel_err over the rows marked in `rows` of [T, k] tensors.
double rel_err_rows(const Tensor& got, const Tensor& want, const std::vector<char>& rows) {
  const std::vector<double> g = to_double(got), w = to_double(want);
  const std::size_t k = g.size() / rows.size();
  double num = 0, den = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (!rows[i / k]) continue;
    if (!std::isfinite(g[i])) return std::numeric_limits<double>::quiet_NaN();
    num += (g[i] - w[i]) * (g[i] - w[i]);
    den += w[i] * w[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

const std::vector<std::tuple<int64_t, int64_t>> kRouterShapes = {{8, 1},   {8, 2},   {8, 8},   {60, 2},   {60, 8},
                                                                 {128, 1}, {128, 8}, {256, 8}, {128, 64}, {33, 33}};

}  // namespace

// ---------------------------------------------------------------- router

TEST_CASE("router forward on the GPU matches the CPU", "[moe][router][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 100;
  for (DType dt : {DType::bf16, DType::f32})
    for (DType wdt : {dt, DType::f32})
      for (bool norm : {false, true})
        for (auto [E, k] : kRouterShapes)
          for (int64_t T : {int64_t(1), int64_t(17), int64_t(577), int64_t(4099)}) {
            if (wdt == DType::f32 && dt == DType::f32 && T > 577) continue;  // covered by dt == wdt
            const Tensor logits = randn({T, E}, dt, cpu(), ++seed, 2.f);
            const RouterOut c = run_router(logits, wdt, norm, k);
            const RouterOut g = run_router(logits.to(gpu()), wdt, norm, k);
            INFO("logits " << dt << " weights " << wdt << " norm " << norm << " T " << T << " E " << E << " k " << k);
            CHECK(rel_err(g.probs, c.probs) <= kTolProbs);
            int64_t swapped = 0;
            const std::vector<char> same = check_indices(g, c, &swapped);
            INFO("rows with near-tie swaps: " << swapped);
            CHECK(swapped * 100 <= T);  // rare
            CHECK(rel_err_rows(g.weights, c.weights, same) <= (wdt == DType::bf16 ? kTolBf16 : 1e-6));
          }
}

TEST_CASE("router forward on the GPU breaks ties to the lower expert id", "[moe][router][gpu]") {
  REQUIRE_GPU();
  for (auto [E, k] : kRouterShapes) {
    const int64_t T = 5;
    // Equal logits: every probability is 1/E; top-k must be 0..k-1.
    const RouterOut g = run_router(Tensor::zeros({T, E}, DType::bf16, gpu()), DType::f32, true, k);
    const std::vector<int32_t> idx = g.indices.to(cpu()).to_vector<int32_t>();
    const std::vector<float> w = g.weights.to(cpu()).to_vector<float>();
    INFO("E " << E << " k " << k);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j) {
        CHECK(idx[std::size_t(t * k + j)] == j);
        CHECK(std::fabs(w[std::size_t(t * k + j)] - 1.f / float(k)) <= 1e-6f);
      }
  }
  // Partial ties in one row: {0.5, 1, 1, 0.5, 1} -> 1, 2, 4, 0 (as the CPU test).
  const Tensor tied = Tensor::from_vector(std::vector<float>{0.5f, 1.f, 1.f, 0.5f, 1.f}, {1, 5}).to(gpu());
  const RouterOut g = run_router(tied, DType::f32, false, 4);
  CHECK(g.indices.to(cpu()).to_vector<int32_t>() == std::vector<int32_t>{1, 2, 4, 0});
}

TEST_CASE("router replay on the GPU: the top-k replayed gives its bits, other ids match the CPU",
          "[moe][router][replay][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 700;
  auto same_bytes = [](const Tensor& a, const Tensor& b) {
    const Tensor x = a.to(cpu()), y = b.to(cpu());
    return x.nbytes() == y.nbytes() && std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
  };
  for (DType dt : {DType::bf16, DType::f32})
    for (bool norm : {false, true})
      for (auto [E, k] : kRouterShapes)
        for (int64_t T : {int64_t(1), int64_t(17), int64_t(577)}) {
          INFO("logits " << dt << " norm " << norm << " T " << T << " E " << E << " k " << k);
          const Tensor logits = randn({T, E}, dt, cpu(), ++seed, 2.f), lg = logits.to(gpu());
          const RouterOut g = run_router(lg, dt, norm, k);
          // The GPU's own top-k replayed: the same probs and weights, bit for bit.
          RouterOut r{poisoned({T, E}, DType::f32, gpu()), g.indices.clone(), poisoned({T, k}, dt, gpu())};
          ops::router_forward_replay(lg, norm, r.indices, r.probs, r.weights);
          CHECK(same_bytes(r.probs, g.probs));
          CHECK(same_bytes(r.weights, g.weights));
          // Other ids, one out of range per odd row, against the CPU's replay.
          std::vector<int32_t> other(std::size_t(T * k));
          for (int64_t t = 0; t < T; ++t)
            for (int64_t j = 0; j < k; ++j) other[std::size_t(t * k + j)] = int32_t((t * 7 + 5 * j) % E);
          for (int64_t t = 1; t < T; t += 2) other[std::size_t(t * k)] = t % 4 == 1 ? -1 : int32_t(E);
          const Tensor ids = Tensor::from_vector(other, {T, k});
          RouterOut c{Tensor::empty({T, E}, DType::f32), ids, Tensor::empty({T, k}, dt)};
          ops::router_forward_replay(logits, norm, c.indices, c.probs, c.weights);
          RouterOut o{poisoned({T, E}, DType::f32, gpu()), ids.to(gpu()), poisoned({T, k}, dt, gpu())};
          ops::router_forward_replay(lg, norm, o.indices, o.probs, o.weights);
          CHECK(rel_err(o.probs, c.probs) <= kTolProbs);
          // f32: the probs' last bits through one quotient.
          CHECK(rel_err(o.weights, c.weights) <= (dt == DType::bf16 ? kTolBf16 : 1e-5));
        }
}

TEST_CASE("router backward on the GPU matches the CPU", "[moe][router][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 2000;
  for (DType wdt : {DType::bf16, DType::f32})
    for (DType gdt : {DType::f32, DType::bf16})
      for (bool norm : {false, true})
        for (auto [E, k] : kRouterShapes)
          for (int64_t T : {int64_t(1), int64_t(17), int64_t(577), int64_t(4099)}) {
            // probs and indices from the CPU router, shared by both sides.
            const RouterOut c = run_router(randn({T, E}, DType::f32, cpu(), ++seed, 2.f), DType::f32, norm, k);
            const Tensor dw = randn({T, k}, wdt, cpu(), ++seed);
            const Tensor probs = c.probs.to(gpu()), idx = c.indices.to(gpu()), dw_g = dw.to(gpu());
            INFO("dweights " << wdt << " dlogits " << gdt << " norm " << norm << " T " << T << " E " << E << " k "
                             << k);
            Tensor ref = Tensor::empty({T, E}, gdt);
            ops::router_backward(c.probs, c.indices, dw, norm, ref);
            Tensor got = poisoned({T, E}, gdt, gpu());
            ops::router_backward(probs, idx, dw_g, norm, got);
            CHECK(rel_err(got, ref) <= tolerance(gdt));
            // accumulate adds to what is there.
            const Tensor base = randn({T, E}, gdt, cpu(), ++seed);
            Tensor ref_acc = base.clone(), got_acc = base.to(gpu());
            ops::router_backward(c.probs, c.indices, dw, norm, ref_acc, true);
            ops::router_backward(probs, idx, dw_g, norm, got_acc, true);
            CHECK(rel_err(got_acc, ref_acc) <= tolerance(gdt));
          }
}

TEST_CASE("router aux loss on the GPU matches the CPU, deterministically", "[moe][router][aux][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 3000;
  for (auto [E, k] : kRouterShapes)
    for (int64_t N : {int64_t(1), int64_t(17), int64_t(577), int64_t(4099), int64_t(70001)})
      for (bool skewed : {false, true}) {
        if (N == 70001 && E != 128) continue;
        const auto [probs_c, idx_c] = aux_inputs(N, E, k, seed, skewed);
        const Tensor probs = probs_c.to(gpu()), idx = idx_c.to(gpu());
        INFO("N " << N << " E " << E << " k " << k << " skewed " << skewed);
        Tensor ref = Tensor::empty({1}, DType::f32);
        ops::router_aux_loss_forward(probs_c, idx_c, ref);
        Tensor ws = Tensor::empty({int64_t(ops::router_aux_loss_workspace_bytes(N, E))}, DType::u8, gpu());
        Tensor loss = poisoned({1}, DType::f32, gpu()), loss2 = poisoned({1}, DType::f32, gpu());
        ops::router_aux_loss_forward(probs, idx, loss, {}, ws);
        ops::router_aux_loss_forward(probs, idx, loss2);  // a workspace of its own
        CHECK(rel_err(loss, ref) <= kTolF32);
        CHECK(same_bits(loss, loss2));
        // Backward, written and accumulated, f32 and bf16.
        for (DType gdt : {DType::f32, DType::bf16}) {
          const float dloss = 0.37f;
          Tensor dref = Tensor::empty({N, E}, gdt);
          ops::router_aux_loss_backward(probs_c, idx_c, dloss, dref);
          Tensor got = poisoned({N, E}, gdt, gpu());
          ops::router_aux_loss_backward(probs, idx, dloss, got, false, {}, ws);
          // dlogits[t, e] = dloss·E/N · p[t, e]·(f_e − Σ_j p[t, j] f_j): its
          // terms are at most dloss·E/N in size, so a few fp32 roundings of
          // each of the N·E elements give the absolute floor below.
          const double floor = 1e-6 * double(dloss) * double(E) / double(N) * std::sqrt(double(N * E));
          CHECK(rel_err_floor(got, dref, floor, tolerance(gdt)) <= tolerance(gdt));
          const Tensor base = randn({N, E}, gdt, cpu(), ++seed, 1e-3f);
          Tensor ref_acc = base.clone(), got_acc = base.to(gpu());
          ops::router_aux_loss_backward(probs_c, idx_c, dloss, ref_acc, true);
          ops::router_aux_loss_backward(probs, idx, dloss, got_acc, true);
          CHECK(rel_err_floor(got_acc, ref_acc, floor, tolerance(gdt)) <= tolerance(gdt));
        }
      }
  // Zero rows: loss 0 (the poison is overwritten).
  Tensor loss = poisoned({1}, DType::f32, gpu());
  ops::router_aux_loss_forward(Tensor::empty({0, 8}, DType::f32, gpu()), Tensor::empty({0, 2}, DType::i32, gpu()),
                               loss);
  CHECK(loss.to(cpu()).to_vector<float>() == std::vector<float>{0.f});
  // Too small a workspace is an error.
  CHECK_THROWS_WITH(
      ops::router_aux_loss_forward(Tensor::zeros({17, 8}, DType::f32, gpu()), Tensor::zeros({17, 2}, DType::i32, gpu()),
                                   loss, {}, Tensor::empty({4}, DType::u8, gpu())),
      Catch::Matchers::ContainsSubstring("router_aux_loss_workspace_bytes"));
  // More than 256 experts is an error on the GPU.
  CHECK_THROWS_WITH(run_router(Tensor::zeros({2, 300}, DType::f32, gpu()), DType::f32, false, 2),
                    Catch::Matchers::ContainsSubstring("at most 256 experts"));
}

TEST_CASE("router aux stats, and the loss and backward from them, on the GPU match the CPU and the one-call ops",
          "[moe][router][aux][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 3500;
  const float dloss = 0.37f;
  std::vector<std::tuple<int64_t, int64_t>> shapes = kRouterShapes;
  shapes.insert(shapes.end(), {{3, 1}, {3, 2}, {5, 3}, {60, 4}});
  for (auto [E, k] : shapes)
    for (int64_t N : {int64_t(0), int64_t(1), int64_t(37), int64_t(577), int64_t(4099)})
      for (bool skewed : {false, true}) {
        const auto [probs_c, idx_c] = aux_inputs(N, E, k, seed, skewed);
        const Tensor probs = probs_c.to(gpu()), idx = idx_c.to(gpu());
        INFO("N " << N << " E " << E << " k " << k << " skewed " << skewed);
        // Stats: counts and N exact, prob sums to fp32 rounding.
        Tensor ref = Tensor::empty({2 * E + 1}, DType::f32);
        ops::router_aux_stats(probs_c, idx_c, ref);
        Tensor ws = Tensor::empty({int64_t(ops::router_aux_loss_workspace_bytes(N, E))}, DType::u8, gpu());
        Tensor st = poisoned({2 * E + 1}, DType::f32, gpu());
        ops::router_aux_stats(probs, idx, st, false, {}, ws);
        const std::vector<float> sg = st.to(cpu()).to_vector<float>(), sc = ref.to_vector<float>();
        for (int64_t e = 0; e < E; ++e) REQUIRE(sg[std::size_t(e)] == sc[std::size_t(e)]);
        CHECK(sg[std::size_t(2 * E)] == float(N));
        CHECK(rel_err(st.view(E, {E}), ref.view(E, {E})) <= kTolF32);
        // The loss from the stats: the bits of router_aux_loss_forward, the CPU's value.
        Tensor loss = poisoned({1}, DType::f32, gpu()), fwd = poisoned({1}, DType::f32, gpu());
        ops::router_aux_loss_from_stats(st, E, loss);
        ops::router_aux_loss_forward(probs, idx, fwd, {}, ws);
        CHECK(same_bits(loss, fwd));
        Tensor loss_c = Tensor::empty({1}, DType::f32);
        ops::router_aux_loss_from_stats(ref, E, loss_c);
        CHECK(rel_err(loss, loss_c) <= kTolF32);
        // Three uneven shards [0, N/5), [N/5, N/5 + N/2), the rest: stats
        // accumulated (as all_reduce(sum) would add them), loss to rounding,
        // gradient rows the bits of the unsharded backward.
        const int64_t a = N / 5, b = N / 5 + N / 2;
        const std::vector<std::pair<int64_t, int64_t>> shards = {{0, a}, {a, b - a}, {b, N - b}};
        Tensor summed = poisoned({2 * E + 1}, DType::f32, gpu());
        for (std::size_t c = 0; c < shards.size(); ++c)
          ops::router_aux_stats(probs.slice_rows(shards[c].first, shards[c].second),
                                idx.slice_rows(shards[c].first, shards[c].second), summed, c > 0);
        const std::vector<float> ss = summed.to(cpu()).to_vector<float>();
        for (int64_t e = 0; e < E; ++e) REQUIRE(ss[std::size_t(e)] == sc[std::size_t(e)]);
        CHECK(ss[std::size_t(2 * E)] == float(N));
        Tensor sharded_loss = poisoned({1}, DType::f32, gpu());
        ops::router_aux_loss_from_stats(summed, E, sharded_loss);
        CHECK(rel_err(sharded_loss, loss_c) <= kTolF32);
        for (DType gdt : {DType::f32, DType::bf16})
          for (bool accumulate : {false, true}) {
            INFO("dlogits " << gdt << " accumulate " << accumulate);
            Tensor base = poisoned({N, E}, gdt, gpu());
            if (accumulate) base = randn({N, E}, gdt, gpu(), ++seed, 1e-3f);
            Tensor want = base.clone(), got = base.clone(), got_sharded = base.clone();
            ops::router_aux_loss_backward(probs, idx, dloss, want, accumulate, {}, ws);
            ops::router_aux_loss_backward_from_stats(probs, st, dloss, got, accumulate);
            CHECK(same_bits(got, want));
            for (const auto& [r0, n] : shards)
              ops::router_aux_loss_backward_from_stats(probs.slice_rows(r0, n), summed, dloss,
                                                       got_sharded.slice_rows(r0, n), accumulate);
            CHECK(same_bits(got_sharded, want));
            // Against the CPU reference from the CPU's stats.
            Tensor cref = accumulate ? base.to(cpu()) : Tensor::empty({N, E}, gdt);
            ops::router_aux_loss_backward_from_stats(probs_c, ref, dloss, cref, accumulate);
            const double floor = 1e-6 * double(dloss) * double(E) / double(std::max<int64_t>(N, 1)) *
                                 std::sqrt(double(std::max<int64_t>(N * E, 1)));
            CHECK(rel_err_floor(got, cref, floor, tolerance(gdt)) <= tolerance(gdt));
          }
      }
  // Zero rows write zero stats; with accumulate they leave the stats alone.
  Tensor st = poisoned({17}, DType::f32, gpu());
  ops::router_aux_stats(Tensor::empty({0, 8}, DType::f32, gpu()), Tensor::empty({0, 2}, DType::i32, gpu()), st);
  CHECK(st.to(cpu()).to_vector<float>() == std::vector<float>(17, 0.f));
  const std::vector<float> held(17, 3.f);
  Tensor kept = Tensor::from_vector(held, {17}, gpu());
  ops::router_aux_stats(Tensor::empty({0, 8}, DType::f32, gpu()), Tensor::empty({0, 2}, DType::i32, gpu()), kept, true);
  CHECK(kept.to(cpu()).to_vector<float>() == held);
  // Devices, sizes and the expert limit.
  const Tensor probs = Tensor::zeros({5, 8}, DType::f32, gpu()), idx = Tensor::zeros({5, 2}, DType::i32, gpu());
  using Catch::Matchers::ContainsSubstring;
  CHECK_THROWS_WITH(ops::router_aux_stats(probs, idx, Tensor::zeros({17}, DType::f32)),
                    ContainsSubstring("stats and probs are on different devices"));
  CHECK_THROWS_WITH(ops::router_aux_stats(probs, idx, st, false, {}, Tensor::empty({4}, DType::u8, gpu())),
                    ContainsSubstring("router_aux_loss_workspace_bytes"));
  CHECK_THROWS_WITH(ops::router_aux_stats(probs, idx, Tensor::zeros({16}, DType::f32, gpu())),
                    ContainsSubstring("stats must be f32 [2 * experts + 1] = [17]"));
  CHECK_THROWS_WITH(ops::router_aux_loss_from_stats(st, 8, Tensor::empty({1}, DType::f32)),
                    ContainsSubstring("loss and stats are on different devices"));
  CHECK_THROWS_WITH(ops::router_aux_loss_backward_from_stats(probs, Tensor::zeros({17}, DType::f32), 1.f,
                                                             Tensor::empty({5, 8}, DType::f32, gpu())),
                    ContainsSubstring("stats and probs are on different devices"));
  CHECK_THROWS_WITH(ops::router_aux_loss_backward_from_stats(probs, st, 1.f, Tensor::empty({5, 8}, DType::f32)),
                    ContainsSubstring("dlogits and probs are on different devices"));
  CHECK_THROWS_WITH(ops::router_aux_loss_from_stats(Tensor::zeros({601}, DType::f32, gpu()), 300,
                                                    Tensor::empty({1}, DType::f32, gpu())),
                    ContainsSubstring("at most 256 experts"));
}

// ---------------------------------------------------------------- layout

namespace {

ops::MoeLayout cpu_layout(const Tensor& idx_c, int64_t E) { return ops::moe_make_layout(idx_c, E); }

void poison(const ops::MoeLayout& l) {
  for (const Tensor* t : {&l.counts, &l.offsets, &l.row_to_copy, &l.copy_to_row})
    if (t->numel() > 0) const_cast<Tensor*>(t)->fill_bytes_(0xff);
}

bool same_layout(const ops::MoeLayout& g, const ops::MoeLayout& c) {
  return same_bits(g.counts, c.counts) && same_bits(g.offsets, c.offsets) && same_bits(g.row_to_copy, c.row_to_copy) &&
         same_bits(g.copy_to_row, c.copy_to_row);
}

}  // namespace

TEST_CASE("moe_build_layout on the GPU equals the CPU's layout bit for bit", "[moe][layout][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 4000;
  for (int64_t E : {int64_t(8), int64_t(60), int64_t(128), int64_t(256)})
    for (int64_t k : {int64_t(1), int64_t(2), int64_t(8)})
      for (int64_t T : {int64_t(0), int64_t(1), int64_t(17), int64_t(577), int64_t(4099)})
        for (bool skewed : {false, true}) {
          const Tensor idx_c = routing(T, E, k, ++seed, skewed);
          const ops::MoeLayout ref = cpu_layout(idx_c, E);
          const Tensor idx = idx_c.to(gpu());
          INFO("T " << T << " E " << E << " k " << k << " skewed " << skewed);
          ops::MoeLayout l = ops::MoeLayout::empty(T, k, E, gpu());
          REQUIRE(l.workspace.defined());
          poison(l);
          ops::moe_build_layout(idx, l);
          CHECK(same_layout(l, ref));
          // Rebuild in place (stale contents), and without a workspace.
          ops::moe_build_layout(idx, l);
          CHECK(same_layout(l, ref));
          ops::MoeLayout bare = ops::MoeLayout::empty(T, k, E, gpu());
          bare.workspace = Tensor{};
          poison(bare);
          ops::moe_build_layout(idx, bare);
          CHECK(same_layout(bare, ref));
          CHECK(same_layout(ops::moe_make_layout(idx, E), ref));
        }
  // Ids that repeat within a token (not a router's, but a valid layout input).
  const Tensor rep = Tensor::from_vector(std::vector<int32_t>{3, 3, 0, 3, 1, 1}, {3, 2});
  CHECK(same_layout(ops::moe_make_layout(rep.to(gpu()), 4), cpu_layout(rep, 4)));
}

TEST_CASE("GPU layout, permute and unpermute drop copies with expert ids below 0 or at least E", "[moe][layout][gpu]") {
  REQUIRE_GPU();
  const int64_t T = 5, k = 2, E = 4, H = 8;
  // Copies 1 (id -1), 4 (id 4) and 9 (id 7) are invalid.
  const std::vector<int32_t> ids = {2, -1, 0, 2, 4, 1, 3, 0, 1, 7};
  const ops::MoeLayout l = ops::moe_make_layout(Tensor::from_vector(ids, {T, k}).to(gpu()), E);
  CHECK(l.counts.to(cpu()).to_vector<int32_t>() == std::vector<int32_t>{2, 2, 2, 1});
  CHECK(l.offsets.to(cpu()).to_vector<int32_t>() == std::vector<int32_t>{0, 2, 4, 6, 7});
  // Valid copies sorted by (expert, copy), then the invalid ones in copy order.
  CHECK(l.row_to_copy.to(cpu()).to_vector<int32_t>() == std::vector<int32_t>{2, 7, 5, 8, 0, 3, 6, 1, 4, 9});
  const std::vector<int32_t> c2r = l.copy_to_row.to(cpu()).to_vector<int32_t>();
  for (int r = 0; r < T * k; ++r)
    CHECK(c2r[std::size_t(l.row_to_copy.to(cpu()).to_vector<int32_t>()[std::size_t(r)])] == r);
  // permute writes zeros into the dropped rows; unpermute ignores them.
  const Tensor x = randn({T, H}, DType::f32, gpu(), 4500);
  Tensor xg = poisoned({T * k, H}, DType::f32, gpu());
  ops::moe_permute_forward(x, l, xg);
  const std::vector<float> xgv = xg.to(cpu()).to_vector<float>(), xv = x.to(cpu()).to_vector<float>();
  for (int64_t r = 7; r < T * k; ++r)
    for (int64_t h = 0; h < H; ++h) CHECK(xgv[std::size_t(r * H + h)] == 0.f);
  const Tensor w = randn({T, k}, DType::f32, gpu(), 4501);
  Tensor y = poisoned({T, H}, DType::f32, gpu());
  ops::moe_unpermute_forward(xg, w, l, y);
  const std::vector<float> yv = y.to(cpu()).to_vector<float>(), wv = w.to(cpu()).to_vector<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float want = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t id = ids[std::size_t(t * k + j)];
        if (id >= 0 && id < E) want += wv[std::size_t(t * k + j)] * xv[std::size_t(t * H + h)];
      }
      CHECK(std::fabs(yv[std::size_t(t * H + h)] - want) <= 1e-6f * (1.f + std::fabs(want)));
    }
  Tensor dyg = poisoned({T * k, H}, DType::f32, gpu()), dw = poisoned({T, k}, DType::f32, gpu());
  ops::moe_unpermute_backward(y, xg, w, l, dyg, dw);
  const std::vector<float> dwv = dw.to(cpu()).to_vector<float>(), dygv = dyg.to(cpu()).to_vector<float>();
  for (int c : {1, 4, 9}) CHECK(dwv[std::size_t(c)] == 0.f);
  for (int64_t r = 7; r < T * k; ++r)
    for (int64_t h = 0; h < H; ++h) CHECK(dygv[std::size_t(r * H + h)] == 0.f);
}

// ---------------------------------------------------------------- permute / unpermute

namespace {

struct PermuteCase {
  int64_t T, H, E, k;
  bool skewed;
};

const std::vector<PermuteCase> kPermuteCases = {
    {1, 7, 8, 1, false},         {1, 2048, 128, 8, false},   {17, 1000, 8, 2, false}, {17, 7, 60, 8, false},
    {577, 2048, 128, 8, false},  {577, 1000, 60, 2, false},  {577, 2048, 8, 8, true}, {577, 7, 128, 1, true},
    {4099, 2048, 128, 8, false}, {4099, 1000, 60, 1, false}, {4099, 7, 8, 2, false},  {4099, 1000, 128, 8, true},
};

}  // namespace

TEST_CASE("moe permute and unpermute on the GPU match the CPU", "[moe][permute][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 5000;
  for (const PermuteCase& pc : kPermuteCases)
    for (DType dt : {DType::bf16, DType::f32}) {
      const int64_t T = pc.T, H = pc.H, E = pc.E, k = pc.k, N = T * k;
      const Tensor idx_c = routing(T, E, k, ++seed, pc.skewed);
      const ops::MoeLayout lc = cpu_layout(idx_c, E);
      const ops::MoeLayout lg = ops::moe_make_layout(idx_c.to(gpu()), E);
      INFO("T " << T << " H " << H << " E " << E << " k " << k << " skewed " << pc.skewed << " dtype " << dt);
      REQUIRE(same_layout(lg, lc));
      for (bool misalign : {false, true}) {
        if (misalign && (H != 2048 || T > 577)) continue;
        INFO("misaligned " << misalign);
        auto on_gpu = [&](const Tensor& t) { return misalign ? misaligned(t.to(gpu())) : t.to(gpu()); };
        auto out = [&](const Shape& s, DType d) {
          Tensor t = misalign ? misaligned(Tensor::empty(s, d, gpu())) : Tensor::empty(s, d, gpu());
          t.fill_bytes_(0xff);
          return t;
        };
        // permute forward: a copy.
        const Tensor x = randn({T, H}, dt, cpu(), ++seed);
        Tensor xg_ref = Tensor::empty({N, H}, dt);
        ops::moe_permute_forward(x, lc, xg_ref);
        Tensor xg = out({N, H}, dt);
        ops::moe_permute_forward(on_gpu(x), lg, xg);
        CHECK(same_bits(xg, xg_ref));
        // permute backward, into dx's dtype and f32, written and accumulated.
        const Tensor dxg = randn({N, H}, dt, cpu(), ++seed);
        for (DType odt : {dt, DType::f32}) {
          INFO("dx " << odt);
          Tensor dx_ref = Tensor::empty({T, H}, odt);
          ops::moe_permute_backward(dxg, lc, dx_ref);
          Tensor dx = out({T, H}, odt);
          ops::moe_permute_backward(on_gpu(dxg), lg, dx);
          CHECK(same_bits(dx, dx_ref));
          const Tensor base = randn({T, H}, odt, cpu(), ++seed);
          Tensor acc_ref = base.clone(), acc = on_gpu(base);
          ops::moe_permute_backward(dxg, lc, acc_ref, true);
          ops::moe_permute_backward(on_gpu(dxg), lg, acc, true);
          CHECK(same_bits(acc, acc_ref));
        }
        // unpermute forward and backward, bf16 and f32 weights.
        const Tensor yg = randn({N, H}, dt, cpu(), ++seed), dy = randn({T, H}, dt, cpu(), ++seed);
        for (DType wdt : {DType::bf16, DType::f32}) {
          INFO("weights " << wdt);
          const Tensor w = randn({T, k}, wdt, cpu(), ++seed, 0.5f);
          for (DType odt : {dt, DType::f32}) {
            INFO("y " << odt);
            Tensor y_ref = Tensor::empty({T, H}, odt);
            ops::moe_unpermute_forward(yg, w, lc, y_ref);
            Tensor y = out({T, H}, odt);
            ops::moe_unpermute_forward(on_gpu(yg), w.to(gpu()), lg, y);
            CHECK(same_bits(y, y_ref));
          }
          Tensor dyg_ref = Tensor::empty({N, H}, dt), dw_ref = Tensor::empty({T, k}, wdt);
          ops::moe_unpermute_backward(dy, yg, w, lc, dyg_ref, dw_ref);
          Tensor dyg = out({N, H}, dt), dw = poisoned({T, k}, wdt, gpu());
          ops::moe_unpermute_backward(on_gpu(dy), on_gpu(yg), w.to(gpu()), lg, dyg, dw);
          CHECK(same_bits(dyg, dyg_ref));
          CHECK(rel_err(dw, dw_ref) <= tolerance(wdt));
        }
      }
    }
}

TEST_CASE("moe GPU ops are deterministic and allocate nothing in the steady state", "[moe][gpu]") {
  REQUIRE_GPU();
  Stream s = Stream::create(gpu());
  const int64_t T = 4099, H = 1000, E = 128, k = 8, N = T * k;
  const Tensor logits = randn({T, E}, DType::bf16, gpu(), 6000, 2.f);
  const Tensor x = randn({T, H}, DType::bf16, gpu(), 6001), dy = randn({T, H}, DType::bf16, gpu(), 6002);
  Tensor probs = Tensor::empty({T, E}, DType::f32, gpu(), s), idx = Tensor::empty({T, k}, DType::i32, gpu(), s);
  Tensor w = Tensor::empty({T, k}, DType::bf16, gpu(), s), dw = Tensor::empty({T, k}, DType::bf16, gpu(), s);
  Tensor dlogits = Tensor::empty({T, E}, DType::f32, gpu(), s), loss = Tensor::empty({1}, DType::f32, gpu(), s);
  Tensor ws = Tensor::empty({int64_t(ops::router_aux_loss_workspace_bytes(T, E))}, DType::u8, gpu(), s);
  Tensor stats = Tensor::empty({ops::router_aux_stats_size(E)}, DType::f32, gpu(), s);
  Tensor loss2 = Tensor::empty({1}, DType::f32, gpu(), s);
  Tensor xg = Tensor::empty({N, H}, DType::bf16, gpu(), s), dyg = Tensor::empty({N, H}, DType::bf16, gpu(), s);
  Tensor y = Tensor::empty({T, H}, DType::f32, gpu(), s), dx = Tensor::empty({T, H}, DType::f32, gpu(), s);
  ops::MoeLayout l = ops::MoeLayout::empty(T, k, E, gpu(), s);
  Stream::default_for(gpu()).synchronize();
  s.synchronize();
  auto step = [&] {
    ops::router_forward(logits, true, probs, idx, w, s);
    ops::router_aux_loss_forward(probs, idx, loss, s, ws);
    ops::moe_build_layout(idx, l, s);
    ops::moe_permute_forward(x, l, xg, s);
    ops::moe_unpermute_forward(xg, w, l, y, s);
    ops::moe_unpermute_backward(dy, xg, w, l, dyg, dw, s);
    ops::moe_permute_backward(dyg, l, dx, false, s);
    ops::router_backward(probs, idx, dw, true, dlogits, false, s);
    ops::router_aux_loss_backward(probs, idx, 0.01f, dlogits, true, s, ws);
    ops::router_aux_stats(probs, idx, stats, false, s, ws);  // the data-parallel form (no all_reduce here)
    ops::router_aux_loss_from_stats(stats, E, loss2, s);
    ops::router_aux_loss_backward_from_stats(probs, stats, 0.01f, dlogits, true, s);
  };
  step();
  s.synchronize();
  CHECK(same_bits(loss2, loss));
  const std::vector<Tensor> first = {probs.clone(),         idx.clone(),   w.clone(),    loss.clone(),
                                     l.row_to_copy.clone(), y.clone(),     dx.clone(),   dw.clone(),
                                     dlogits.clone(),       stats.clone(), loss2.clone()};
  s.synchronize();
  const int64_t before = memory_stats(gpu()).allocations;
  for (int i = 0; i < 3; ++i) step();
  s.synchronize();
  CHECK(memory_stats(gpu()).allocations == before);
  const std::vector<Tensor> again = {probs, idx, w, loss, l.row_to_copy, y, dx, dw, dlogits, stats, loss2};
  for (std::size_t i = 0; i < first.size(); ++i) {
    INFO("output " << i);
    CHECK(same_bits(again[i], first[i]));
  }
}
