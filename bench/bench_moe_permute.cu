// bench/bench_moe_permute.cu: the MoE token layout ops of slime (router
// forward, moe_build_layout, permute / unpermute forward and backward, and
// the auxiliary loss's statistics and backward from them), bf16 activations,
// one GPU, beside a device-to-device copy of the same traffic.
// The PyTorch baseline is bench/torch_moe_permute.py (same names, same byte
// counts; the two aux rows have no baseline there yet).
//
// Configs: T = 32768 tokens, hidden H = 2048, E = 128 experts, k = 8
// (Qwen3-30B-A3B's router), and T = 16384, E = 64, k = 8; N = T k grouped
// rows; uniform random routing (k distinct experts per token).
//
// The two numbers per op: FLOPs are negligible (memory-bound; not reported);
// bytes are the algorithmic traffic, each operand read or written once (bf16
// = 2 bytes, f32 and i32 = 4), the i32 layout reads (4N per op) not counted:
//   permute_fwd     read x (2TH), write x_grouped (2NH)             2(T + N)H
//   permute_bwd     read dx_grouped (2NH), write dx (2TH)            2(N + T)H
//   unpermute_fwd   read y_grouped (2NH), weights (2Tk), write y (2TH)
//                                                                    2(N + T)H + 2Tk
//   unpermute_bwd   read dy (2TH), y_grouped (2NH), weights (2Tk); write
//                   dy_grouped (2NH), dweights (2Tk)                 2(T + 2N)H + 4Tk
//   router_fwd      read logits (2TE); write probs (4TE), indices (4Tk),
//                   weights (2Tk)                                    6TE + 6Tk
//   layout          read indices (4N); write row_to_copy, copy_to_row (8N)
//                                                                    12N (+ 8E)
//   aux_stats       read probs (4TE), indices (4Tk); write stats (8E + 4)
//                                                                    4TE + 4Tk (+ 8E)
//   aux_bwd         router_aux_loss_backward_from_stats: read probs (4TE);
//                   write f32 dlogits (4TE)                          8TE
// GBps = bytes / time (1e9 bytes/s). Every op also times a copy of bytes / 2
// (so the same traffic) and reports copy_GBps and frac_of_copy = GBps /
// copy_GBps. Operands of the permute ops are >= 64 MiB, above the 50 MB L2.
//
// Timing: the first run of each benchmark checks sampled tokens against the
// CPU reference (skips with the error when wrong), then kWarmup untimed
// calls; each iteration records a CUDA event, runs kBatch calls, records
// another and reports the time / kBatch (UseManualTime). Iterations and
// repetitions are fixed; read the median over repetitions.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "slime/core/half.hpp"
#include "slime/core/random.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/ops/moe_permute.hpp"
#include "slime/ops/router.hpp"

namespace {

using slime::BFloat16;
using slime::Device;
using slime::DType;
using slime::Event;
using slime::Stream;
using slime::Tensor;
namespace ops = slime::ops;

constexpr int64_t kHidden = 2048;
constexpr int kWarmup = 3;
constexpr int kBatch = 5;
constexpr int kIterations = 10;
constexpr int kRepetitions = 5;
constexpr int kCopyReps = 10;

Device gpu() { return Device::cuda(0); }

struct Config {
  int64_t T, E, k;
  std::string name() const {
    return "T" + std::to_string(T) + "xH" + std::to_string(kHidden) + "/E" + std::to_string(E) + "k" +
           std::to_string(k) + "/bf16";
  }
};

Tensor randn(const slime::Shape& shape, DType dt, const Stream& s, uint64_t seed, float stddev = 1.f) {
  Tensor t = Tensor::empty(shape, dt, gpu(), s);
  slime::fill_normal(t, seed, 0, 0.f, stddev, s);
  return t;
}

// k distinct experts per token from a seeded shuffle, on the host.
std::vector<int32_t> routing(int64_t T, int64_t E, int64_t k, uint64_t seed) {
  std::vector<int32_t> ids(static_cast<std::size_t>(T * k)), perm(static_cast<std::size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t pick = j + int64_t(slime::philox_word(seed, uint64_t(t * k + j)) % uint64_t(E - j));
      std::swap(perm[std::size_t(j)], perm[std::size_t(pick)]);
      ids[std::size_t(t * k + j)] = perm[std::size_t(j)];
    }
  }
  return ids;
}

std::vector<BFloat16> host_row(const Tensor& t, int64_t r, const Stream& s) {
  return t.slice_rows(r, 1).to_vector<BFloat16>(s);
}

bool same(const std::vector<BFloat16>& a, const std::vector<BFloat16>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(BFloat16)) == 0;
}

// Everything one config needs, made once per benchmark.
struct Bufs {
  Config c;
  std::vector<int32_t> ids;
  Tensor logits, probs, idx, w, dw, x, xg, dx, y, dy, dyg, gidx;
  ops::MoeLayout layout;
  std::vector<int32_t> c2r;  // host copy of the layout
};

std::shared_ptr<Bufs> make_bufs(const Config& c, const Stream& s) {
  auto b = std::make_shared<Bufs>();
  b->c = c;
  const int64_t T = c.T, N = c.T * c.k, H = kHidden;
  b->ids = routing(T, c.E, c.k, 7);
  b->gidx = Tensor::from_vector(b->ids, {T, c.k}, gpu(), s);
  b->logits = randn({T, c.E}, DType::bf16, s, 1, 2.f);
  b->probs = Tensor::empty({T, c.E}, DType::f32, gpu(), s);
  b->idx = Tensor::empty({T, c.k}, DType::i32, gpu(), s);
  b->w = randn({T, c.k}, DType::bf16, s, 2, 0.3f);
  b->dw = Tensor::empty({T, c.k}, DType::bf16, gpu(), s);
  b->x = randn({T, H}, DType::bf16, s, 3);
  b->xg = randn({N, H}, DType::bf16, s, 4);
  b->dx = Tensor::empty({T, H}, DType::bf16, gpu(), s);
  b->y = Tensor::empty({T, H}, DType::bf16, gpu(), s);
  b->dy = randn({T, H}, DType::bf16, s, 5);
  b->dyg = Tensor::empty({N, H}, DType::bf16, gpu(), s);
  b->layout = ops::MoeLayout::empty(T, c.k, c.E, gpu(), s);
  ops::moe_build_layout(b->gidx, b->layout, s);
  b->c2r = b->layout.copy_to_row.to_vector<int32_t>(s);
  return b;
}

using Case = slime::bench::CopyBoundCase;

void run_case(benchmark::State& state, const std::string& name, const std::function<Case(const Stream&)>& setup) {
  slime::bench::run_copy_bound_case(state, name, setup, gpu(), kWarmup, kBatch, kCopyReps);
}

const int64_t kCheckTokens[] = {0, 1, 4097};

std::string fail(const char* what, int64_t t) {
  return slime::detail::concat("correctness check failed: ", what, " token ", t);
}

Case permute_case(const Config& cfg, const Stream& s, bool backward) {
  auto b = make_bufs(cfg, s);
  const int64_t T = cfg.T, N = T * cfg.k, H = kHidden, k = cfg.k;
  Case c;
  c.bytes = 2.0 * double(T + N) * double(H);
  if (!backward) {
    c.launch = [b](const Stream& st) { ops::moe_permute_forward(b->x, b->layout, b->xg, st); };
    c.check = [b, k, launch = c.launch](const Stream& st) -> std::string {
      b->xg.fill_bytes_(0xff, st);
      launch(st);
      for (int64_t t : kCheckTokens) {
        const std::vector<BFloat16> x = host_row(b->x, t, st);
        for (int64_t j = 0; j < k; ++j)
          if (!same(host_row(b->xg, b->c2r[std::size_t(t * k + j)], st), x)) return fail("permute_fwd", t);
      }
      return "";
    };
  } else {
    c.launch = [b](const Stream& st) { ops::moe_permute_backward(b->xg, b->layout, b->dx, false, st); };
    c.check = [b, k, H, launch = c.launch](const Stream& st) -> std::string {
      b->dx.fill_bytes_(0xff, st);
      launch(st);
      for (int64_t t : kCheckTokens) {
        std::vector<float> acc(static_cast<std::size_t>(H), 0.f);
        for (int64_t j = 0; j < k; ++j) {
          const std::vector<BFloat16> g = host_row(b->xg, b->c2r[std::size_t(t * k + j)], st);
          for (int64_t h = 0; h < H; ++h) acc[std::size_t(h)] += float(g[std::size_t(h)]);
        }
        std::vector<BFloat16> want(acc.size());
        for (std::size_t h = 0; h < acc.size(); ++h) want[h] = BFloat16(acc[h]);
        if (!same(host_row(b->dx, t, st), want)) return fail("permute_bwd", t);
      }
      return "";
    };
  }
  return c;
}

Case unpermute_case(const Config& cfg, const Stream& s, bool backward) {
  auto b = make_bufs(cfg, s);
  const int64_t T = cfg.T, N = T * cfg.k, H = kHidden, k = cfg.k;
  Case c;
  if (!backward) {
    c.bytes = 2.0 * double(N + T) * double(H) + 2.0 * double(T * k);
    c.launch = [b](const Stream& st) { ops::moe_unpermute_forward(b->xg, b->w, b->layout, b->y, st); };
    c.check = [b, k, H, launch = c.launch](const Stream& st) -> std::string {
      b->y.fill_bytes_(0xff, st);
      launch(st);
      const std::vector<BFloat16> w = b->w.to_vector<BFloat16>(st);
      for (int64_t t : kCheckTokens) {
        std::vector<float> acc(static_cast<std::size_t>(H), 0.f);
        for (int64_t j = 0; j < k; ++j) {
          const std::vector<BFloat16> g = host_row(b->xg, b->c2r[std::size_t(t * k + j)], st);
          const float wj = float(w[std::size_t(t * k + j)]);
          for (int64_t h = 0; h < H; ++h) acc[std::size_t(h)] += wj * float(g[std::size_t(h)]);
        }
        std::vector<BFloat16> want(acc.size());
        for (std::size_t h = 0; h < acc.size(); ++h) want[h] = BFloat16(acc[h]);
        if (!same(host_row(b->y, t, st), want)) return fail("unpermute_fwd", t);
      }
      return "";
    };
  } else {
    c.bytes = 2.0 * double(T + 2 * N) * double(H) + 4.0 * double(T * k);
    c.launch = [b](const Stream& st) { ops::moe_unpermute_backward(b->dy, b->xg, b->w, b->layout, b->dyg, b->dw, st); };
    c.check = [b, k, H, launch = c.launch](const Stream& st) -> std::string {
      b->dyg.fill_bytes_(0xff, st);
      b->dw.fill_bytes_(0xff, st);
      launch(st);
      const std::vector<BFloat16> w = b->w.to_vector<BFloat16>(st), dw = b->dw.to_vector<BFloat16>(st);
      for (int64_t t : kCheckTokens) {
        const std::vector<BFloat16> dy = host_row(b->dy, t, st);
        for (int64_t j = 0; j < k; ++j) {
          const int64_t r = b->c2r[std::size_t(t * k + j)];
          const std::vector<BFloat16> yg = host_row(b->xg, r, st), got = host_row(b->dyg, r, st);
          const float wj = float(w[std::size_t(t * k + j)]);
          double dot = 0;
          for (int64_t h = 0; h < H; ++h) {
            if (got[std::size_t(h)].bits != BFloat16(wj * float(dy[std::size_t(h)])).bits)
              return fail("unpermute_bwd dy_grouped", t);
            dot += double(float(dy[std::size_t(h)])) * double(float(yg[std::size_t(h)]));
          }
          const double g = float(dw[std::size_t(t * k + j)]);
          if (!(std::fabs(g - dot) <= 1e-2 * std::fabs(dot) + 1e-2)) return fail("unpermute_bwd dweights", t);
        }
      }
      return "";
    };
  }
  return c;
}

Case router_case(const Config& cfg, const Stream& s) {
  auto b = make_bufs(cfg, s);
  const int64_t T = cfg.T, E = cfg.E, k = cfg.k;
  Case c;
  c.bytes = 6.0 * double(T * E) + 6.0 * double(T * k);
  c.launch = [b](const Stream& st) { ops::router_forward(b->logits, true, b->probs, b->idx, b->w, st); };
  c.check = [b, E, k, launch = c.launch](const Stream& st) -> std::string {
    b->idx.fill_bytes_(0xff, st);
    launch(st);
    const std::vector<int32_t> idx = b->idx.to_vector<int32_t>(st);
    const std::vector<BFloat16> w = b->w.to_vector<BFloat16>(st);
    for (int64_t t : kCheckTokens) {
      const std::vector<BFloat16> l = host_row(b->logits, t, st);
      std::vector<float> p(static_cast<std::size_t>(E));
      std::vector<int32_t> want_idx(static_cast<std::size_t>(k));
      std::vector<float> want_w(static_cast<std::size_t>(k));
      ops::cpu::router_forward(l.data(), 1, E, k, true, p.data(), want_idx.data(), want_w.data());
      for (int64_t j = 0; j < k; ++j) {
        if (idx[std::size_t(t * k + j)] != want_idx[std::size_t(j)]) return fail("router_fwd indices", t);
        if (std::fabs(float(w[std::size_t(t * k + j)]) - want_w[std::size_t(j)]) > 1e-2f * want_w[std::size_t(j)])
          return fail("router_fwd weights", t);
      }
    }
    return "";
  };
  return c;
}

// router_aux_stats (backward = false) or router_aux_loss_backward_from_stats
// from those stats, on router_forward's probs and uniform ids.
Case aux_case(const Config& cfg, const Stream& s, bool backward) {
  auto b = make_bufs(cfg, s);
  const int64_t T = cfg.T, E = cfg.E, k = cfg.k;
  ops::router_forward(b->logits, true, b->probs, b->idx, b->w, s);
  auto ws = std::make_shared<Tensor>(
      Tensor::empty({int64_t(ops::router_aux_loss_workspace_bytes(T, E))}, DType::u8, gpu(), s));
  auto stats = std::make_shared<Tensor>(Tensor::empty({ops::router_aux_stats_size(E)}, DType::f32, gpu(), s));
  auto dlogits = std::make_shared<Tensor>(Tensor::empty({T, E}, DType::f32, gpu(), s));
  ops::router_aux_stats(b->probs, b->gidx, *stats, false, s, *ws);
  Case c;
  if (!backward) {
    c.bytes = 4.0 * double(T * E) + 4.0 * double(T * k) + 8.0 * double(E);
    c.launch = [b, ws, stats](const Stream& st) { ops::router_aux_stats(b->probs, b->gidx, *stats, false, st, *ws); };
    c.check = [b, stats, T, E, launch = c.launch](const Stream& st) -> std::string {
      stats->fill_bytes_(0xff, st);
      launch(st);
      const std::vector<float> got = stats->to_vector<float>(st), p = b->probs.to_vector<float>(st);
      for (int64_t e = 0; e < E; ++e) {
        double ps = 0;
        for (int64_t t = 0; t < T; ++t) ps += p[std::size_t(t * E + e)];
        if (got[std::size_t(e)] != float(std::count(b->ids.begin(), b->ids.end(), int32_t(e))) ||
            !(std::fabs(got[std::size_t(E + e)] - ps) <= 1e-5 * ps))
          return slime::detail::concat("correctness check failed: aux_stats expert ", e);
      }
      if (got[std::size_t(2 * E)] != float(T)) return "correctness check failed: aux_stats row count";
      return "";
    };
  } else {
    c.bytes = 8.0 * double(T * E);
    c.launch = [b, stats, dlogits](const Stream& st) {
      ops::router_aux_loss_backward_from_stats(b->probs, *stats, 0.01f, *dlogits, false, st);
    };
    c.check = [b, stats, dlogits, E, launch = c.launch](const Stream& st) -> std::string {
      dlogits->fill_bytes_(0xff, st);
      launch(st);
      const std::vector<float> sv = stats->to_vector<float>(st);
      // p (g − ⟨p, g⟩) cancels where the load is balanced: compare to g's scale.
      const float n = sv[std::size_t(2 * E)];
      const float gmax = 0.01f * float(E) * *std::max_element(sv.begin(), sv.begin() + E) / (n * n);
      for (int64_t t : kCheckTokens) {
        const std::vector<float> p = b->probs.slice_rows(t, 1).to_vector<float>(st),
                                 got = dlogits->slice_rows(t, 1).to_vector<float>(st);
        std::vector<float> want(static_cast<std::size_t>(E));
        ops::cpu::router_aux_loss_backward_from_stats(p.data(), 1, E, sv.data(), 0.01f, want.data());
        for (int64_t e = 0; e < E; ++e)
          if (!(std::fabs(got[std::size_t(e)] - want[std::size_t(e)]) <= 1e-5f * p[std::size_t(e)] * gmax))
            return fail("aux_bwd", t);
      }
      return "";
    };
  }
  return c;
}

Case layout_case(const Config& cfg, const Stream& s) {
  auto b = make_bufs(cfg, s);
  const int64_t N = cfg.T * cfg.k, E = cfg.E;
  Case c;
  c.bytes = 12.0 * double(N) + 8.0 * double(E);
  c.launch = [b](const Stream& st) { ops::moe_build_layout(b->gidx, b->layout, st); };
  c.check = [b, N, E, launch = c.launch](const Stream& st) -> std::string {
    b->layout.copy_to_row.fill_bytes_(0xff, st);
    b->layout.row_to_copy.fill_bytes_(0xff, st);
    launch(st);
    std::vector<int32_t> counts(static_cast<std::size_t>(E)), offsets(static_cast<std::size_t>(E + 1)),
        r2c(static_cast<std::size_t>(N)), c2r(static_cast<std::size_t>(N));
    ops::cpu::moe_build_layout(b->ids.data(), b->c.T, b->c.k, E, counts.data(), offsets.data(), r2c.data(), c2r.data());
    if (b->layout.row_to_copy.to_vector<int32_t>(st) != r2c || b->layout.copy_to_row.to_vector<int32_t>(st) != c2r ||
        b->layout.offsets.to_vector<int32_t>(st) != offsets)
      return "correctness check failed: layout differs from the CPU's";
    return "";
  };
  return c;
}

void add_benchmark(const std::string& name, std::function<Case(const Stream&)> setup) {
  slime::bench::register_manual(
      name, [name, setup](benchmark::State& st) { run_case(st, name, setup); }, benchmark::kMicrosecond, kIterations,
      kRepetitions);
}

}  // namespace

int main(int argc, char** argv) {
  for (const Config cfg : {Config{32768, 128, 8}, Config{16384, 64, 8}}) {
    const std::string n = cfg.name();
    add_benchmark("moe_permute_fwd/" + n, [cfg](const Stream& s) { return permute_case(cfg, s, false); });
    add_benchmark("moe_permute_bwd/" + n, [cfg](const Stream& s) { return permute_case(cfg, s, true); });
    add_benchmark("moe_unpermute_fwd/" + n, [cfg](const Stream& s) { return unpermute_case(cfg, s, false); });
    add_benchmark("moe_unpermute_bwd/" + n, [cfg](const Stream& s) { return unpermute_case(cfg, s, true); });
    add_benchmark("moe_router_fwd/" + n, [cfg](const Stream& s) { return router_case(cfg, s); });
    add_benchmark("moe_layout/" + n, [cfg](const Stream& s) { return layout_case(cfg, s); });
    add_benchmark("moe_router_aux_stats/" + n, [cfg](const Stream& s) { return aux_case(cfg, s, false); });
    add_benchmark("moe_router_aux_bwd/" + n, [cfg](const Stream& s) { return aux_case(cfg, s, true); });
  }
  return slime::bench::run_benchmarks(argc, argv);
}
