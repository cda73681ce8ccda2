// Shared by the MoE tests: a naive per-token Qwen3-MoE block in double (plain
// loops, forward and backward), and helpers to fill SparseMoeBlocks from one
// set of full weights.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "slime/core/random.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/moe.hpp"

namespace moe_test {

using slime::BFloat16;
using slime::DType;
using slime::Shape;
using slime::Tensor;
using Vec = std::vector<double>;

inline Vec random_doubles(int64_t n, uint64_t seed, double scale = 1.0) {
  Vec v(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[std::size_t(i)] = scale * double(slime::random_uniform(seed, uint64_t(i), -1.f, 1.f));
  return v;
}

// Rows [first, first + n) of a [rows, cols] row-major vector.
inline Vec rows_of(const Vec& v, int64_t cols, int64_t first, int64_t n) {
  return Vec(v.begin() + first * cols, v.begin() + (first + n) * cols);
}

// Rounded to f32 (so a double reference sees exactly the f32 block's inputs).
inline Vec f32_rounded(Vec v) {
  for (double& x : v) x = double(float(x));
  return v;
}

inline Tensor tensor_of(const Vec& v, const Shape& shape, DType dtype = DType::f32) {
  if (dtype == DType::bf16) {
    std::vector<BFloat16> b(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) b[i] = BFloat16(float(v[i]));
    return Tensor::from_vector(b, shape);
  }
  std::vector<float> f(v.begin(), v.end());
  return Tensor::from_vector(f, shape);
}

inline Vec to_double(const Tensor& t) {
  const Tensor c = t.device().is_cpu() ? t : t.to(slime::Device::cpu());
  Vec out(static_cast<std::size_t>(c.numel()));
  if (c.dtype() == DType::f32) {
    const float* p = c.data<float>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = p[i];
  } else {
    const BFloat16* p = c.data<BFloat16>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = double(float(p[i]));
  }
  return out;
}

// ‖got − want‖ / ‖want‖ (the absolute norm when want is 0).
inline double rel_error(const Vec& got, const Vec& want) {
  if (got.size() != want.size()) return INFINITY;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

inline double max_abs_diff(const Vec& a, const Vec& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

inline double max_abs(const Vec& a) {
  double m = 0;
  for (double v : a) m = std::max(m, std::fabs(v));
  return m;
}

// Full weights of one block: gate [E, H]; gate_proj, up_proj [E, I, H];
// down_proj [E, H, I].
struct Weights {
  int64_t H = 0, I = 0, E = 0;
  Vec gate, wg, wu, wd;

  static Weights random(int64_t H, int64_t I, int64_t E, uint64_t seed, double router_scale = 1.0) {
    Weights w{H, I, E, {}, {}, {}, {}};
    w.gate = f32_rounded(random_doubles(E * H, seed + 1, router_scale));
    w.wg = f32_rounded(random_doubles(E * I * H, seed + 2, 0.5));
    w.wu = f32_rounded(random_doubles(E * I * H, seed + 3, 0.5));
    w.wd = f32_rounded(random_doubles(E * H * I, seed + 4, 0.5));
    return w;
  }
};

// Copies the full weights into `b` (its expert slice when it holds a slice).
inline void load(slime::nn::SparseMoeBlock& b, const Weights& w) {
  const DType dt = b.options.dtype;
  const int64_t first = b.gate_proj.first_expert, local = b.num_local_experts(), H = w.H, I = w.I;
  auto slice = [&](const Vec& full, int64_t per) {
    return Vec(full.begin() + first * per, full.begin() + (first + local) * per);
  };
  b.gate.value.copy_from(tensor_of(w.gate, Shape{w.E, H}, dt).to(b.options.device));
  b.gate_proj.value.copy_from(tensor_of(slice(w.wg, I * H), Shape{local, I, H}, dt).to(b.options.device));
  b.up_proj.value.copy_from(tensor_of(slice(w.wu, I * H), Shape{local, I, H}, dt).to(b.options.device));
  b.down_proj.value.copy_from(tensor_of(slice(w.wd, H * I), Shape{local, H, I}, dt).to(b.options.device));
}

// ---- The naive block in double: per token, its k experts' MLPs ------------

struct NaiveOut {
  Vec logits, probs, weights, y;
  std::vector<int> indices;
};

struct NaiveGrads {
  Vec x, gate, wg, wu, wd;
};

inline double silu(double g) { return g / (1 + std::exp(-g)); }

// replay (optional, [T, k], distinct valid ids per row): route to these
// experts instead of the top-k (routing replay).
inline NaiveOut naive_forward(const Weights& w, const Vec& x, int64_t T, int64_t k, bool norm,
                              const std::vector<int>* replay = nullptr) {
  const int64_t H = w.H, I = w.I, E = w.E;
  NaiveOut o;
  o.logits.assign(std::size_t(T * E), 0.0);
  o.probs.assign(std::size_t(T * E), 0.0);
  o.weights.assign(std::size_t(T * k), 0.0);
  o.indices.assign(std::size_t(T * k), 0);
  o.y.assign(std::size_t(T * H), 0.0);
  for (int64_t t = 0; t < T; ++t) {
    const double* xt = x.data() + t * H;
    double* l = o.logits.data() + t * E;
    double* p = o.probs.data() + t * E;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < H; ++i) l[e] += xt[i] * w.gate[std::size_t(e * H + i)];
    const double mx = *std::max_element(l, l + E);
    double s = 0;
    for (int64_t e = 0; e < E; ++e) s += (p[e] = std::exp(l[e] - mx));
    for (int64_t e = 0; e < E; ++e) p[e] /= s;
    std::vector<int> ids(static_cast<std::size_t>(E));
    std::iota(ids.begin(), ids.end(), 0);
    std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return p[a] > p[b]; });
    if (replay)
      for (int64_t j = 0; j < k; ++j) ids[std::size_t(j)] = (*replay)[std::size_t(t * k + j)];
    double ws = 0;
    for (int64_t j = 0; j < k; ++j) ws += p[ids[std::size_t(j)]];
    for (int64_t j = 0; j < k; ++j) {
      const int e = ids[std::size_t(j)];
      o.indices[std::size_t(t * k + j)] = e;
      const double wt = norm ? p[e] / ws : p[e];
      o.weights[std::size_t(t * k + j)] = wt;
      Vec h(static_cast<std::size_t>(I));
      for (int64_t f = 0; f < I; ++f) {
        double g = 0, u = 0;
        for (int64_t i = 0; i < H; ++i) {
          g += w.wg[std::size_t((e * I + f) * H + i)] * xt[i];
          u += w.wu[std::size_t((e * I + f) * H + i)] * xt[i];
        }
        h[std::size_t(f)] = silu(g) * u;
      }
      for (int64_t c = 0; c < H; ++c) {
        double s2 = 0;
        for (int64_t f = 0; f < I; ++f) s2 += w.wd[std::size_t((e * H + c) * I + f)] * h[std::size_t(f)];
        o.y[std::size_t(t * H + c)] += wt * s2;
      }
    }
  }
  return o;
}

// Gradients of L = Σ dy ⊙ y + Σ aux ⊙ logits (aux may be empty), the top-k
// selection (or the replayed one) held constant.
inline NaiveGrads naive_backward(const Weights& w, const Vec& x, int64_t T, int64_t k, bool norm, const Vec& dy,
                                 const Vec& aux, const std::vector<int>* replay = nullptr) {
  const int64_t H = w.H, I = w.I, E = w.E;
  const NaiveOut o = naive_forward(w, x, T, k, norm, replay);
  NaiveGrads d{Vec(x.size(), 0.0), Vec(w.gate.size(), 0.0), Vec(w.wg.size(), 0.0), Vec(w.wu.size(), 0.0),
               Vec(w.wd.size(), 0.0)};
  for (int64_t t = 0; t < T; ++t) {
    const double* xt = x.data() + t * H;
    const double* dyt = dy.data() + t * H;
    const double* p = o.probs.data() + t * E;
    Vec dw(static_cast<std::size_t>(k), 0.0);
    for (int64_t j = 0; j < k; ++j) {
      const int e = o.indices[std::size_t(t * k + j)];
      const double wt = o.weights[std::size_t(t * k + j)];
      Vec g(static_cast<std::size_t>(I), 0.0), u(g), h(g);
      for (int64_t f = 0; f < I; ++f) {
        for (int64_t i = 0; i < H; ++i) {
          g[std::size_t(f)] += w.wg[std::size_t((e * I + f) * H + i)] * xt[i];
          u[std::size_t(f)] += w.wu[std::size_t((e * I + f) * H + i)] * xt[i];
        }
        h[std::size_t(f)] = silu(g[std::size_t(f)]) * u[std::size_t(f)];
      }
      Vec dh(static_cast<std::size_t>(I), 0.0);
      for (int64_t c = 0; c < H; ++c) {
        double out = 0;
        for (int64_t f = 0; f < I; ++f) out += w.wd[std::size_t((e * H + c) * I + f)] * h[std::size_t(f)];
        dw[std::size_t(j)] += dyt[c] * out;
        const double dout = wt * dyt[c];
        for (int64_t f = 0; f < I; ++f) {
          d.wd[std::size_t((e * H + c) * I + f)] += dout * h[std::size_t(f)];
          dh[std::size_t(f)] += dout * w.wd[std::size_t((e * H + c) * I + f)];
        }
      }
      for (int64_t f = 0; f < I; ++f) {
        const double gf = g[std::size_t(f)], sg = 1 / (1 + std::exp(-gf));
        const double dg = dh[std::size_t(f)] * u[std::size_t(f)] * (sg * (1 + gf * (1 - sg)));
        const double du = dh[std::size_t(f)] * silu(gf);
        for (int64_t i = 0; i < H; ++i) {
          d.wg[std::size_t((e * I + f) * H + i)] += dg * xt[i];
          d.wu[std::size_t((e * I + f) * H + i)] += du * xt[i];
          d.x[std::size_t(t * H + i)] +=
              dg * w.wg[std::size_t((e * I + f) * H + i)] + du * w.wu[std::size_t((e * I + f) * H + i)];
        }
      }
    }
    // Router: weights → selected probabilities → logits.
    Vec dp(static_cast<std::size_t>(E), 0.0);
    double ws = 0, dot_wd = 0;
    for (int64_t j = 0; j < k; ++j) ws += p[o.indices[std::size_t(t * k + j)]];
    for (int64_t j = 0; j < k; ++j) dot_wd += dw[std::size_t(j)] * o.weights[std::size_t(t * k + j)];
    for (int64_t j = 0; j < k; ++j)
      dp[std::size_t(o.indices[std::size_t(t * k + j)])] =
          norm ? (dw[std::size_t(j)] - dot_wd) / ws : dw[std::size_t(j)];
    double pdp = 0;
    for (int64_t e = 0; e < E; ++e) pdp += p[e] * dp[std::size_t(e)];
    for (int64_t e = 0; e < E; ++e) {
      double dl = p[e] * (dp[std::size_t(e)] - pdp);
      if (!aux.empty()) dl += aux[std::size_t(t * E + e)];
      for (int64_t i = 0; i < H; ++i) {
        d.gate[std::size_t(e * H + i)] += dl * xt[i];
        d.x[std::size_t(t * H + i)] += dl * w.gate[std::size_t(e * H + i)];
      }
    }
  }
  return d;
}

}  // namespace moe_test
