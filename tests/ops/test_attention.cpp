// Attention over packed sequences on the CPU: the reference against a naive
// dense softmax(q k^T) v per sequence, finite-difference gradients in double,
// GQA head mapping, causal offsets and alignments, rows that see no key, the
// merge of partial results, the Tensor-level API, and bad-input errors.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "slime/core/random.hpp"
#include "slime/ops/attention.hpp"

using namespace slime;
using namespace slime::ops;
using Catch::Matchers::ContainsSubstring;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<int32_t> prefix(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu{0};
  for (int32_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

// A packed problem in double: q [T, hq, d], k and v [Tk, hkv, d].
struct Problem {
  std::vector<int32_t> cu_q, cu_k;
  int64_t hq = 0, hkv = 0, d = 0;
  std::vector<double> q, k, v;
  int64_t num_seqs() const { return int64_t(cu_q.size()) - 1; }
  int64_t tokens_q() const { return cu_q.back(); }
  int64_t tokens_k() const { return cu_k.back(); }
};

std::vector<double> normals(int64_t n, uint64_t seed, double stddev = 1.0) {
  std::vector<double> x(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[std::size_t(i)] = stddev * double(random_normal(seed, uint64_t(i)));
  return x;
}

Problem make_problem(const std::vector<int32_t>& lens_q, const std::vector<int32_t>& lens_k, int64_t hq, int64_t hkv,
                     int64_t d, uint64_t seed) {
  Problem p;
  p.cu_q = prefix(lens_q);
  p.cu_k = prefix(lens_k);
  p.hq = hq;
  p.hkv = hkv;
  p.d = d;
  p.q = normals(p.tokens_q() * hq * d, seed);
  p.k = normals(p.tokens_k() * hkv * d, seed + 1);
  p.v = normals(p.tokens_k() * hkv * d, seed + 2);
  return p;
}

// softmax(scale q k^T + mask) v with the whole [len_q, len_k] score matrix of
// a (sequence, head), straight from the definition of the masks.
void dense_attention(const Problem& p, const AttentionOptions& opt, std::vector<double>& o, std::vector<double>& lse) {
  const double scale = opt.softmax_scale > 0 ? double(opt.softmax_scale) : 1.0 / std::sqrt(double(p.d));
  o.assign(p.q.size(), 0.0);
  lse.assign(std::size_t(p.tokens_q() * p.hq), 0.0);
  const int64_t group = p.hq / p.hkv;
  for (int64_t b = 0; b < p.num_seqs(); ++b) {
    const int64_t q0 = p.cu_q[b], lq = p.cu_q[b + 1] - q0, k0 = p.cu_k[b], lk = p.cu_k[b + 1] - k0;
    const int64_t off = opt.causal_offset + (opt.align == CausalAlign::bottom_right ? lk - lq : 0);
    for (int64_t h = 0; h < p.hq; ++h) {
      const int64_t hk = h / group;
      std::vector<double> s(std::size_t(lq * lk), -kInf);
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t j = 0; j < lk; ++j) {
          if (opt.causal && j > i + off) continue;
          double dot = 0;
          for (int64_t c = 0; c < p.d; ++c)
            dot +=
                p.q[std::size_t(((q0 + i) * p.hq + h) * p.d + c)] * p.k[std::size_t(((k0 + j) * p.hkv + hk) * p.d + c)];
          s[std::size_t(i * lk + j)] = scale * dot;
        }
      for (int64_t i = 0; i < lq; ++i) {
        double m = -kInf;
        for (int64_t j = 0; j < lk; ++j) m = std::max(m, s[std::size_t(i * lk + j)]);
        const std::size_t row = std::size_t((q0 + i) * p.hq + h);
        if (m == -kInf) {
          lse[row] = -kInf;
          continue;
        }
        double sum = 0;
        for (int64_t j = 0; j < lk; ++j) sum += std::exp(s[std::size_t(i * lk + j)] - m);
        for (int64_t j = 0; j < lk; ++j) {
          const double w = std::exp(s[std::size_t(i * lk + j)] - m) / sum;
          for (int64_t c = 0; c < p.d; ++c)
            o[row * std::size_t(p.d) + std::size_t(c)] += w * p.v[std::size_t(((k0 + j) * p.hkv + hk) * p.d + c)];
        }
        lse[row] = m + std::log(sum);
      }
    }
  }
}

void reference_forward(const Problem& p, const AttentionOptions& opt, std::vector<double>& o,
                       std::vector<double>& lse) {
  o.assign(p.q.size(), 0.0);
  lse.assign(std::size_t(p.tokens_q() * p.hq), 0.0);
  cpu::attention_forward(p.q.data(), p.k.data(), p.v.data(), p.cu_q.data(), p.cu_k.data(), p.num_seqs(), p.hq, p.hkv,
                         p.d, opt, o.data(), lse.data());
}

// ||a - b|| / ||b|| (0 when both are 0).
double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// max |a - b| over rows, treating -inf == -inf as equal.
double lse_err(const std::vector<double>& a, const std::vector<double>& b) {
  double e = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] == -kInf || b[i] == -kInf) {
      if (a[i] != b[i]) return kInf;
      continue;
    }
    e = std::max(e, std::abs(a[i] - b[i]));
  }
  return e;
}

struct Variant {
  std::string name;
  AttentionOptions opt;
};

std::vector<Variant> variants() {
  std::vector<Variant> v;
  v.push_back({"causal", AttentionOptions{}});
  AttentionOptions o;
  o.causal_offset = 3;
  v.push_back({"causal offset 3", o});
  o.causal_offset = -4;  // early rows see no key
  v.push_back({"causal offset -4", o});
  o = AttentionOptions{};
  o.align = CausalAlign::bottom_right;
  v.push_back({"causal bottom-right", o});
  o.causal_offset = -2;
  v.push_back({"causal bottom-right offset -2", o});
  o = AttentionOptions{};
  o.causal = false;
  v.push_back({"full", o});
  o.softmax_scale = 0.7f;
  v.push_back({"full scale 0.7", o});
  return v;
}

// Tensors of a problem's data as f32 (or bf16) CPU tensors.
Tensor to_tensor(const std::vector<double>& x, const Shape& shape, DType dt) {
  if (dt == DType::f32) {
    std::vector<float> f(x.begin(), x.end());
    return Tensor::from_vector(f, shape);
  }
  std::vector<BFloat16> h;
  for (double y : x) h.push_back(BFloat16(float(y)));
  return Tensor::from_vector(h, shape);
}

std::vector<double> to_double(const Tensor& t) {
  std::vector<double> out;
  if (t.dtype() == DType::f32) {
    for (float f : t.to_vector<float>()) out.push_back(f);
  } else {
    for (BFloat16 h : t.to_vector<BFloat16>()) out.push_back(double(float(h)));
  }
  return out;
}

}  // namespace

TEST_CASE("attention reference equals dense softmax(q k^T) v on tiny packed shapes", "[ops][attention]") {
  // Same lengths for q and k (self-attention) and different ones (bottom-right matters).
  const std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> shapes = {
      {{1, 3, 7, 5}, {1, 3, 7, 5}}, {{2, 5, 1, 4}, {6, 3, 1, 9}}, {{0, 4, 3}, {2, 0, 5}}};
  uint64_t seed = 10;
  for (const auto& [lq, lk] : shapes) {
    for (const auto& [hq, hkv] : {std::pair{4, 2}, std::pair{3, 3}, std::pair{4, 1}}) {
      const Problem p = make_problem(lq, lk, hq, hkv, 8, seed += 3);
      for (const Variant& var : variants()) {
        INFO(var.name << ", hq " << hq << ", hkv " << hkv);
        std::vector<double> o, lse, od, lsed;
        reference_forward(p, var.opt, o, lse);
        dense_attention(p, var.opt, od, lsed);
        CHECK(rel_err(o, od) < 1e-13);
        CHECK(lse_err(lse, lsed) < 1e-13);
      }
    }
  }
}

TEST_CASE("attention rows that see no key have lse -inf, o 0 and zero gradients", "[ops][attention]") {
  const Problem p = make_problem({4, 3}, {4, 3}, 2, 1, 4, 77);
  AttentionOptions opt;
  opt.causal_offset = -2;  // rows 0 and 1 of each sequence see nothing
  std::vector<double> o, lse;
  reference_forward(p, opt, o, lse);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t t = p.cu_q[b] + i;
        if (t >= p.cu_q[b + 1]) continue;
        const bool empty = i < 2;
        CHECK((lse[std::size_t(t * 2 + h)] == -kInf) == empty);
        if (empty)
          for (int64_t c = 0; c < 4; ++c) CHECK(o[std::size_t((t * 2 + h) * 4 + c)] == 0.0);
      }
  const std::vector<double> d_o = normals(int64_t(o.size()), 5);
  std::vector<double> dq(p.q.size()), dk(p.k.size()), dv(p.v.size());
  cpu::attention_backward(p.q.data(), p.k.data(), p.v.data(), o.data(), lse.data(), d_o.data(), p.cu_q.data(),
                          p.cu_k.data(), 2, 2, 1, 4, opt, dq.data(), dk.data(), dv.data());
  for (int64_t b = 0; b < 2; ++b) {
    const int64_t lq = p.cu_q[b + 1] - p.cu_q[b], lk = p.cu_k[b + 1] - p.cu_k[b];
    for (int64_t i = 0; i < std::min<int64_t>(2, lq); ++i)
      for (int64_t c = 0; c < 2 * 4; ++c) CHECK(dq[std::size_t((p.cu_q[b] + i) * 8 + c)] == 0.0);
    // Key j is seen by rows i >= j + 2: the last two keys by nobody.
    for (int64_t j = std::max<int64_t>(0, lk - 2); j < lk; ++j)
      for (int64_t c = 0; c < 4; ++c) {
        CHECK(dk[std::size_t((p.cu_k[b] + j) * 4 + c)] == 0.0);
        CHECK(dv[std::size_t((p.cu_k[b] + j) * 4 + c)] == 0.0);
      }
  }
}

TEST_CASE("attention backward matches finite differences in double", "[ops][attention]") {
  const std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>> shapes = {{{1, 4, 6}, {1, 4, 6}},
                                                                                     {{3, 2, 5}, {2, 4, 7}}};
  uint64_t seed = 100;
  for (const auto& [lq, lk] : shapes) {
    for (const Variant& var : variants()) {
      INFO(var.name);
      Problem p = make_problem(lq, lk, 4, 2, 5, seed += 5);
      const std::vector<double> w = normals(p.tokens_q() * p.hq * p.d, seed + 99);  // loss = sum(w * o)
      auto loss = [&](const Problem& x) {
        std::vector<double> o, lse;
        reference_forward(x, var.opt, o, lse);
        double l = 0;
        for (std::size_t i = 0; i < o.size(); ++i) l += w[i] * o[i];
        return l;
      };
      std::vector<double> o, lse;
      reference_forward(p, var.opt, o, lse);
      std::vector<double> dq(p.q.size()), dk(p.k.size()), dv(p.v.size());
      cpu::attention_backward(p.q.data(), p.k.data(), p.v.data(), o.data(), lse.data(), w.data(), p.cu_q.data(),
                              p.cu_k.data(), p.num_seqs(), p.hq, p.hkv, p.d, var.opt, dq.data(), dk.data(), dv.data());
      const double h = 1e-5;
      auto fd = [&](std::vector<double> Problem::*field) {
        std::vector<double> g((p.*field).size());
        for (std::size_t i = 0; i < g.size(); ++i) {
          const double x0 = (p.*field)[i];
          (p.*field)[i] = x0 + h;
          const double up = loss(p);
          (p.*field)[i] = x0 - h;
          const double down = loss(p);
          (p.*field)[i] = x0;
          g[i] = (up - down) / (2 * h);
        }
        return g;
      };
      CHECK(rel_err(dq, fd(&Problem::q)) < 1e-8);
      CHECK(rel_err(dk, fd(&Problem::k)) < 1e-8);
      CHECK(rel_err(dv, fd(&Problem::v)) < 1e-8);
    }
  }
}

TEST_CASE("attention GQA equals MHA with each kv head repeated over its group", "[ops][attention]") {
  const Problem g = make_problem({5, 9}, {5, 9}, 6, 2, 4, 31);
  Problem m = g;  // kv heads expanded: head h reads kv head h / 3
  m.hkv = 6;
  m.k.assign(std::size_t(g.tokens_k() * 6 * 4), 0.0);
  m.v = m.k;
  for (int64_t t = 0; t < g.tokens_k(); ++t)
    for (int64_t h = 0; h < 6; ++h)
      for (int64_t c = 0; c < 4; ++c) {
        m.k[std::size_t((t * 6 + h) * 4 + c)] = g.k[std::size_t((t * 2 + h / 3) * 4 + c)];
        m.v[std::size_t((t * 6 + h) * 4 + c)] = g.v[std::size_t((t * 2 + h / 3) * 4 + c)];
      }
  const AttentionOptions opt;
  std::vector<double> og, lg, om, lm;
  reference_forward(g, opt, og, lg);
  reference_forward(m, opt, om, lm);
  CHECK(og == om);
  CHECK(lg == lm);
  // dk, dv of GQA = the sum over the group of the MHA ones.
  const std::vector<double> d_o = normals(int64_t(og.size()), 8);
  std::vector<double> dqg(g.q.size()), dkg(g.k.size()), dvg(g.v.size());
  std::vector<double> dqm(m.q.size()), dkm(m.k.size()), dvm(m.v.size());
  cpu::attention_backward(g.q.data(), g.k.data(), g.v.data(), og.data(), lg.data(), d_o.data(), g.cu_q.data(),
                          g.cu_k.data(), 2, 6, 2, 4, opt, dqg.data(), dkg.data(), dvg.data());
  cpu::attention_backward(m.q.data(), m.k.data(), m.v.data(), om.data(), lm.data(), d_o.data(), m.cu_q.data(),
                          m.cu_k.data(), 2, 6, 6, 4, opt, dqm.data(), dkm.data(), dvm.data());
  CHECK(rel_err(dqg, dqm) < 1e-14);
  std::vector<double> dks(dkg.size(), 0.0), dvs(dvg.size(), 0.0);
  for (int64_t t = 0; t < g.tokens_k(); ++t)
    for (int64_t h = 0; h < 6; ++h)
      for (int64_t c = 0; c < 4; ++c) {
        dks[std::size_t((t * 2 + h / 3) * 4 + c)] += dkm[std::size_t((t * 6 + h) * 4 + c)];
        dvs[std::size_t((t * 2 + h / 3) * 4 + c)] += dvm[std::size_t((t * 6 + h) * 4 + c)];
      }
  CHECK(rel_err(dkg, dks) < 1e-13);
  CHECK(rel_err(dvg, dvs) < 1e-13);
}

TEST_CASE("attention on sequences of 1, 17, 127 and 577 tokens, GQA 8 to 2, head_dim 64 and 128", "[ops][attention]") {
  const std::vector<int32_t> lens = {1, 17, 127, 577};
  std::vector<Variant> vars;
  vars.push_back({"causal", AttentionOptions{}});
  AttentionOptions o;
  o.causal_offset = 37;
  vars.push_back({"causal offset 37", o});
  o = AttentionOptions{};
  o.causal = false;
  vars.push_back({"full", o});
  for (int64_t d : {64, 128}) {
    // Inputs rounded to f32 so that the Tensor API (f32) and the dense
    // reference (double) see the same numbers.
    Problem p = make_problem(lens, lens, 8, 2, d, uint64_t(d));
    for (auto* x : {&p.q, &p.k, &p.v})
      for (double& y : *x) y = double(float(y));
    const Tensor q = to_tensor(p.q, {p.tokens_q(), 8, d}, DType::f32);
    const Tensor k = to_tensor(p.k, {p.tokens_k(), 2, d}, DType::f32);
    const Tensor v = to_tensor(p.v, {p.tokens_k(), 2, d}, DType::f32);
    const Tensor cu = Tensor::from_vector(p.cu_q, {5});
    for (const Variant& var : vars) {
      INFO("head_dim " << d << ", " << var.name);
      Tensor out = Tensor::empty({p.tokens_q(), 8, d}, DType::f32);
      Tensor lse = Tensor::empty({p.tokens_q(), 8}, DType::f32);
      out.fill_bytes_(0xff);
      lse.fill_bytes_(0xff);
      attention_forward(q, k, v, cu, cu, -1, -1, out, lse, var.opt);
      std::vector<double> od, lsed;
      dense_attention(p, var.opt, od, lsed);
      CHECK(rel_err(to_double(out), od) < 1e-5);  // fp32 accumulation over up to 577 keys
      CHECK(lse_err(to_double(lse), lsed) < 1e-4);
    }
  }
}

TEST_CASE("merging two partials over split keys equals attention over all keys", "[ops][attention]") {
  // Keys of sequence b split at s_b: part 1 = keys [0, s_b), part 2 = keys
  // [s_b, len) with causal offset reduced by s_b (the ring-attention step).
  const std::vector<int32_t> lens = {1, 6, 9, 13};
  const std::vector<int32_t> split = {0, 3, 9, 5};  // part 2 of sequence 2 is empty, part 1 of 0
  for (int offset : {0, 4, -3}) {
    for (bool causal : {true, false}) {
      INFO("offset " << offset << ", causal " << causal);
      const Problem full = make_problem(lens, lens, 4, 2, 6, 500 + uint64_t(offset + 10));
      Problem a = full, b = full;
      std::vector<int32_t> la, lb;
      for (std::size_t s = 0; s < lens.size(); ++s) {
        la.push_back(split[s]);
        lb.push_back(lens[s] - split[s]);
      }
      a.cu_k = prefix(la);
      b.cu_k = prefix(lb);
      a.k.clear();
      a.v.clear();
      b.k.clear();
      b.v.clear();
      for (std::size_t s = 0; s < lens.size(); ++s)
        for (int32_t j = 0; j < lens[s]; ++j) {
          Problem& dst = j < split[s] ? a : b;
          const std::size_t at = std::size_t((full.cu_k[s] + j) * 2 * 6);
          dst.k.insert(dst.k.end(), full.k.begin() + long(at), full.k.begin() + long(at + 12));
          dst.v.insert(dst.v.end(), full.v.begin() + long(at), full.v.begin() + long(at + 12));
        }
      AttentionOptions opt;
      opt.causal = causal;
      opt.causal_offset = offset;
      std::vector<double> o, lse, o1, l1, o2, l2;
      reference_forward(full, opt, o, lse);
      reference_forward(a, opt, o1, l1);
      // Ring step for part 2: top-left, offset = q_start - k_start = offset - split.
      // The offset is per sequence, so each sequence is its own call.
      o2.assign(o.size(), 0.0);
      l2.assign(lse.size(), 0.0);
      for (std::size_t s = 0; s < lens.size(); ++s) {
        AttentionOptions o2opt = opt;
        o2opt.causal_offset = offset - split[s];
        const int32_t cq[2] = {0, lens[s]};
        const int32_t ck[2] = {0, lens[s] - split[s]};
        const int64_t q_at = full.cu_q[s] * 4, k_at = b.cu_k[s] * 2;
        cpu::attention_forward(full.q.data() + q_at * 6, b.k.data() + k_at * 6, b.v.data() + k_at * 6, cq, ck, 1, 4, 2,
                               6, o2opt, o2.data() + q_at * 6, l2.data() + q_at);
      }
      std::vector<double> om(o.size()), lm(lse.size());
      cpu::merge_attention_partials(o1.data(), l1.data(), o2.data(), l2.data(), int64_t(lse.size()), 6, om.data(),
                                    lm.data());
      CHECK(rel_err(om, o) < 1e-13);
      CHECK(lse_err(lm, lse) < 1e-13);
      // Through the Tensor API: into new tensors, and in place in f32 (o1 accumulates).
      {
        const auto [tom, tlm] = merge_attention_partials(
            to_tensor(o1, {full.tokens_q(), 4, 6}, DType::f32), to_tensor(l1, {full.tokens_q(), 4}, DType::f32),
            to_tensor(o2, {full.tokens_q(), 4, 6}, DType::f32), to_tensor(l2, {full.tokens_q(), 4}, DType::f32));
        CHECK(tom.dtype() == DType::f32);
        CHECK(rel_err(to_double(tom), o) < 1e-6);
        CHECK(lse_err(to_double(tlm), lse) < 1e-5);
      }
      Tensor to1 = to_tensor(o1, {full.tokens_q(), 4, 6}, DType::f32);
      Tensor tl1 = to_tensor(l1, {full.tokens_q(), 4}, DType::f32);
      const Tensor to2 = to_tensor(o2, {full.tokens_q(), 4, 6}, DType::bf16);  // mixed dtypes
      const Tensor tl2 = to_tensor(l2, {full.tokens_q(), 4}, DType::f32);
      merge_attention_partials(to1, tl1, to2, tl2, to1, tl1);
      CHECK(rel_err(to_double(to1), o) < 1e-2);  // o2 was rounded to bf16
      CHECK(lse_err(to_double(tl1), lse) < 1e-5);
    }
  }
}

TEST_CASE("attention Tensor API equals the templates for f32 and bf16", "[ops][attention]") {
  const Problem p = make_problem({3, 1, 20}, {5, 2, 20}, 4, 2, 16, 900);
  AttentionOptions opt;
  opt.align = CausalAlign::bottom_right;
  for (DType dt : {DType::f32, DType::bf16}) {
    INFO(dtype_name(dt));
    const Tensor q = to_tensor(p.q, {p.tokens_q(), 4, 16}, dt);
    const Tensor k = to_tensor(p.k, {p.tokens_k(), 2, 16}, dt);
    const Tensor v = to_tensor(p.v, {p.tokens_k(), 2, 16}, dt);
    const Tensor d_o = to_tensor(normals(p.tokens_q() * 64, 901), {p.tokens_q(), 4, 16}, dt);
    const Tensor cq = Tensor::from_vector(p.cu_q, {4});
    const Tensor ck = Tensor::from_vector(p.cu_k, {4});
    Tensor o = Tensor::empty(q.shape(), dt), lse = Tensor::empty({p.tokens_q(), 4}, DType::f32);
    Tensor dq = Tensor::empty(q.shape(), dt), dk = Tensor::empty(k.shape(), dt), dv = Tensor::empty(k.shape(), dt);
    for (Tensor* t : {&o, &lse, &dq, &dk, &dv}) t->fill_bytes_(0xff);
    attention_forward(q, k, v, cq, ck, 20, 20, o, lse, opt);
    attention_backward(q, k, v, o, lse, d_o, cq, ck, -1, -1, dq, dk, dv, opt);
    CHECK(attention_backward_workspace_elems(q) == 0);

    Tensor o2 = Tensor::empty(q.shape(), dt), lse2 = Tensor::empty({p.tokens_q(), 4}, DType::f32);
    Tensor dq2 = Tensor::empty(q.shape(), dt), dk2 = Tensor::empty(k.shape(), dt), dv2 = Tensor::empty(k.shape(), dt);
    auto same = [](const Tensor& a, const Tensor& b) {
      return std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
    };
    if (dt == DType::f32) {
      cpu::attention_forward(q.data<float>(), k.data<float>(), v.data<float>(), p.cu_q.data(), p.cu_k.data(), 3, 4, 2,
                             16, opt, o2.data<float>(), lse2.data<float>());
      cpu::attention_backward(q.data<float>(), k.data<float>(), v.data<float>(), o2.data<float>(), lse2.data<float>(),
                              d_o.data<float>(), p.cu_q.data(), p.cu_k.data(), 3, 4, 2, 16, opt, dq2.data<float>(),
                              dk2.data<float>(), dv2.data<float>());
    } else {
      cpu::attention_forward(q.data<BFloat16>(), k.data<BFloat16>(), v.data<BFloat16>(), p.cu_q.data(), p.cu_k.data(),
                             3, 4, 2, 16, opt, o2.data<BFloat16>(), lse2.data<float>());
      cpu::attention_backward(q.data<BFloat16>(), k.data<BFloat16>(), v.data<BFloat16>(), o2.data<BFloat16>(),
                              lse2.data<float>(), d_o.data<BFloat16>(), p.cu_q.data(), p.cu_k.data(), 3, 4, 2, 16, opt,
                              dq2.data<BFloat16>(), dk2.data<BFloat16>(), dv2.data<BFloat16>());
    }
    CHECK(same(o, o2));
    CHECK(same(lse, lse2));
    CHECK(same(dq, dq2));
    CHECK(same(dk, dk2));
    CHECK(same(dv, dv2));
  }
}

TEST_CASE("attention rejects bad inputs with clear errors", "[ops][attention]") {
  const int64_t T = 7, d = 8;
  auto t = [](std::initializer_list<int64_t> s, DType dt = DType::f32) { return Tensor::zeros(Shape(s), dt); };
  const Tensor q = t({T, 4, d}), k = t({T, 2, d}), v = t({T, 2, d});
  const Tensor cu = Tensor::from_vector(std::vector<int32_t>{0, 3, 7}, {3});
  Tensor o = t({T, 4, d}), lse = t({T, 4});
  CHECK_NOTHROW(attention_forward(q, k, v, cu, cu, -1, -1, o, lse));
  CHECK_THROWS_WITH(attention_forward(t({T, 4, d}, DType::bf16), k, v, cu, cu, -1, -1, o, lse),
                    ContainsSubstring("k must be bf16"));
  CHECK_THROWS_WITH(attention_forward(q, t({T, 3, d}), t({T, 3, d}), cu, cu, -1, -1, o, lse),
                    ContainsSubstring("must divide the query heads"));
  CHECK_THROWS_WITH(attention_forward(q, k, t({T, 2, d + 1}), cu, cu, -1, -1, o, lse),
                    ContainsSubstring("v must have shape"));
  CHECK_THROWS_WITH(attention_forward(q, t({T, 2, d + 1}), t({T, 2, d + 1}), cu, cu, -1, -1, o, lse),
                    ContainsSubstring("k must have head_dim 8"));
  CHECK_THROWS_WITH(attention_forward(t({T, 4 * d}), k, v, cu, cu, -1, -1, o, lse), ContainsSubstring("must be 3-d"));
  CHECK_THROWS_WITH(attention_forward(q, k, v, cu, cu, -1, -1, o, t({T, 4}, DType::bf16)),
                    ContainsSubstring("lse must be f32"));
  CHECK_THROWS_WITH(attention_forward(q, k, v, cu, cu, -1, -1, t({T, 4, d + 1}), lse),
                    ContainsSubstring("o must have shape"));
  auto cu_of = [](std::vector<int32_t> x) {
    const int64_t n = int64_t(x.size());
    return Tensor::from_vector(x, {n});
  };
  CHECK_THROWS_WITH(attention_forward(q, k, v, cu_of({1, 3, 7}), cu, -1, -1, o, lse),
                    ContainsSubstring("cu_seqlens_q[0] must be 0"));
  CHECK_THROWS_WITH(attention_forward(q, k, v, cu_of({0, 5, 3, 7}), cu_of({0, 1, 3, 7}), -1, -1, o, lse),
                    ContainsSubstring("non-decreasing"));
  CHECK_THROWS_WITH(attention_forward(q, k, v, cu, cu_of({0, 3, 6}), -1, -1, o, lse),
                    ContainsSubstring("must end at the token count 7"));
  CHECK_THROWS_WITH(attention_forward(q, k, v, cu, cu_of({0, 7}), -1, -1, o, lse),
                    ContainsSubstring("the same number of sequences"));
  CHECK_THROWS_WITH(
      attention_forward(q, k, v, Tensor::from_vector(std::vector<float>{0, 3, 7}, {3}), cu, -1, -1, o, lse),
      ContainsSubstring("cu_seqlens_q must be i32"));
  CHECK_THROWS_WITH(attention_forward(q, k, v, cu, cu, 3, -1, o, lse),
                    ContainsSubstring("max_seqlen_q = 3 is shorter than the longest sequence"));
  AttentionOptions bad;
  bad.softmax_scale = -1.f;
  CHECK_THROWS_WITH(attention_forward(q, k, v, cu, cu, -1, -1, o, lse, bad), ContainsSubstring("softmax_scale"));
  bad = AttentionOptions{};
  bad.causal_offset = (1 << 30) + 1;
  CHECK_THROWS_WITH(attention_forward(q, k, v, cu, cu, -1, -1, o, lse, bad), ContainsSubstring("causal_offset"));

  Tensor dq = t({T, 4, d}), dk = t({T, 2, d}), dv = t({T, 2, d});
  CHECK_NOTHROW(attention_backward(q, k, v, o, lse, o, cu, cu, -1, -1, dq, dk, dv));
  CHECK_THROWS_WITH(attention_backward(q, k, v, o, lse, o, cu, cu, -1, -1, dq, dq, dv),
                    ContainsSubstring("dk must have shape"));
  CHECK_THROWS_WITH(attention_backward(q, k, v, o, lse, t({T, 4, d}, DType::bf16), cu, cu, -1, -1, dq, dk, dv),
                    ContainsSubstring("d_o must be f32"));

  CHECK_THROWS_WITH(merge_attention_partials(o, lse, t({T, 4, d + 1}), lse, o, lse),
                    ContainsSubstring("o2 must have shape"));
  CHECK_THROWS_WITH(merge_attention_partials(o, lse, o, t({T, 3}), o, lse), ContainsSubstring("lse2 must have shape"));
  CHECK_THROWS_WITH(merge_attention_partials(o, lse, o, lse, t({T, 4, d}, DType::i32), lse),
                    ContainsSubstring("o must be f32 or bf16"));
}

// ---- The CUDA kernels, run on the CPU ------------------------------------------
// src/ops/attention_kernels.cuh compiled as host code (SLIME_ATTENTION_EMULATION)
// with a small emulator: a CTA's threads are fibers (ucontext) on this thread,
// switching only at barriers, in a shuffled order each round, each warp with
// its own random speed (so warps drift apart between barriers); __syncthreads and
// the warp collectives are barriers; ldmatrix (.trans), mma.m16n8k16 (bf16 ->
// fp32) and shfl.xor follow the PTX ISA's fragment definitions; a cp.async group
// lands at its commit or at cp.async.wait_group (at random: a read before the
// wait may see stale data, a refill may clobber a buffer still being read), with
// a zero fill for src-size 0; shared memory starts as 0xff bytes (NaN). This
// checks the kernels' index math, masking, pipelining order and tile skipping
// against the reference where no GPU exists; it says nothing about speed.
#if SLIME_HAS_CUDA && defined(__linux__)
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <cstring>
#include <functional>
#include <random>

namespace attention_emulation {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};
struct Copy {
  void* dst;
  const void* src;
  bool full;
};
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
  std::vector<std::vector<Copy>> groups;  // committed cp.async groups, oldest first
  std::vector<Copy> open;
  const long* wait_gen = nullptr;  // the barrier generation it waits to change
  long wait_val = 0;
};
struct Warp {
  int arrived = 0;
  long gen = 0;
  uint32_t u[32][6];
  float f[32];
  const void* addr[32];
  // mma: the warp's A [16][16] and B [16][8] fragments as floats, decoded
  // once per mma by the first lane past its barrier (mma_built: that mma's
  // number; mma_calls[lane]: how many each lane began).
  float mma_a[16][16], mma_b[16][8];
  long mma_built = 0, mma_calls[32] = {};
};
struct Cta {
  int threads = 0, arrived = 0;
  long gen = 0;
  std::vector<Warp> warps;
  std::vector<unsigned char> smem;
  Dim3 block;
};

inline Dim3 grid, block_dim;
inline Cta* cta = nullptr;
inline std::vector<Fiber>* fibers = nullptr;
inline int cur = 0;
inline ucontext_t scheduler;
inline long progress = 0;
inline std::mt19937 rng(1234);
inline const std::function<void()>* body = nullptr;

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "attention emulation: %s (thread %d, block %u %u %u)\n", what, cur, cta->block.x, cta->block.y,
               cta->block.z);
  std::abort();
}
inline void yield() { swapcontext(&(*fibers)[std::size_t(cur)].ctx, &scheduler); }
inline Dim3 thread_idx() { return {unsigned(cur), 0, 0}; }
inline unsigned char* smem() { return cta->smem.data(); }
inline Warp& warp() { return cta->warps[std::size_t(cur / 32)]; }

template <class S>
void arrive_and_wait(S& s, int count) {
  const long gen = s.gen;
  ++progress;
  if (++s.arrived == count) {
    s.arrived = 0;
    ++s.gen;
  } else {
    Fiber& f = (*fibers)[std::size_t(cur)];
    f.wait_gen = &s.gen;
    f.wait_val = gen;
    while (s.gen == gen) yield();
    f.wait_gen = nullptr;
  }
}
inline void sync_cta() { arrive_and_wait(*cta, cta->threads); }
inline void sync_warp() { arrive_and_wait(warp(), 32); }

inline bool in_smem(const void* p, std::size_t n) {
  const auto* b = cta->smem.data();
  const auto* q = static_cast<const unsigned char*>(p);
  return q >= b && q + n <= b + cta->smem.size();
}
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline void cp_async(void* dst, const void* src, bool full) {
  if (!in_smem(dst, 16) || !aligned16(dst) || !aligned16(src)) fail("cp.async address outside smem or misaligned");
  (*fibers)[std::size_t(cur)].open.push_back({dst, src, full});
}
inline void land(const Copy& c) {
  if (c.full) {
    std::memcpy(c.dst, c.src, 16);
  } else {
    std::memset(c.dst, 0, 16);
  }
}
// A committed group lands either at once (half the groups: the earliest the
// hardware may write, which exposes refills of a buffer that another warp may
// still read) or at cp.async.wait_group (the latest, exposing reads before
// the wait).
inline void cp_commit() {
  Fiber& f = (*fibers)[std::size_t(cur)];
  if (rng() & 1) {
    for (const Copy& c : f.open) land(c);
    f.open.clear();
  }
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}
inline void cp_wait(int pending) {
  Fiber& f = (*fibers)[std::size_t(cur)];
  while (int(f.groups.size()) > pending) {
    for (const Copy& c : f.groups.front()) land(c);
    f.groups.erase(f.groups.begin());
  }
}

// ldmatrix.x4: matrix i has the rows addressed by lanes 8i..8i+7; thread t gets
// (row t/4, cols 2(t%4), 2(t%4)+1), or with .trans (rows 2(t%4), 2(t%4)+1, col t/4).
inline void ldmatrix(uint32_t (&r)[4], const void* p, bool trans) {
  Warp& w = warp();
  const int lane = cur % 32;
  if (!in_smem(p, 16) || !aligned16(p)) fail("ldmatrix row address outside smem or misaligned");
  w.addr[lane] = p;
  sync_warp();
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (!trans) {
      const auto* row = static_cast<const uint16_t*>(w.addr[8 * i + lane / 4]);
      lo = row[2 * (lane % 4)];
      hi = row[2 * (lane % 4) + 1];
    } else {
      lo = static_cast<const uint16_t*>(w.addr[8 * i + 2 * (lane % 4)])[lane / 4];
      hi = static_cast<const uint16_t*>(w.addr[8 * i + 2 * (lane % 4) + 1])[lane / 4];
    }
    r[i] = uint32_t(lo) | (uint32_t(hi) << 16);
  }
  sync_warp();
}

inline float bf16_bits(uint32_t h) { return float(BFloat16::from_bits(uint16_t(h))); }

// mma.m16n8k16.row.col.f32.bf16.bf16.f32 (g = lane / 4, t = lane % 4):
//   a_i: row g (+8 for i in {2, 3, 6, 7}), col 2t + (i & 1) (+8 for i >= 4)
//   b_i: row 2t + (i & 1) (+8 for i >= 2), col g
//   c_i: row g (+8 for i >= 2), col 2t + (i & 1); elements low half first.
inline void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  Warp& w = warp();
  const int lane = cur % 32;
  for (int i = 0; i < 4; ++i) w.u[lane][i] = a[i];
  w.u[lane][4] = b0;
  w.u[lane][5] = b1;
  sync_warp();
  // Every lane has written its registers; the first one here decodes the
  // warp's fragments (the barrier at the end keeps them until all have read).
  auto& A = w.mma_a;
  auto& B = w.mma_b;
  if (w.mma_built != ++w.mma_calls[lane]) {
    w.mma_built = w.mma_calls[lane];
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, t = l % 4;
      for (int i = 0; i < 8; ++i)
        A[g + ((i / 2) % 2) * 8][2 * t + (i & 1) + (i >= 4 ? 8 : 0)] =
            bf16_bits((w.u[l][i / 2] >> (16 * (i % 2))) & 0xffff);
      for (int i = 0; i < 4; ++i)
        B[2 * t + (i & 1) + (i >= 2 ? 8 : 0)][g] = bf16_bits((w.u[l][4 + i / 2] >> (16 * (i % 2))) & 0xffff);
    }
  }
  const int g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    float s = 0.f;
    for (int k = 0; k < 16; ++k) s += A[g + (i >= 2 ? 8 : 0)][k] * B[k][2 * t + (i & 1)];
    c[i] += s;
  }
  sync_warp();
}

inline float shfl_xor(float x, int m) {
  Warp& w = warp();
  const int lane = cur % 32;
  w.f[lane] = x;
  sync_warp();
  const float y = w.f[lane ^ m];
  sync_warp();
  return y;
}

inline void fiber_main() {
  (*body)();
  (*fibers)[std::size_t(cur)].done = true;
  ++progress;
}

// getcontext and swapcontext return twice; kept out of line so that no caller's
// locals live across them.
[[gnu::noinline]] inline void start_fiber(Fiber& f) {
  f.done = false;
  f.wait_gen = nullptr;
  f.groups.clear();
  f.open.clear();
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = f.stack.data();
  f.ctx.uc_stack.ss_size = f.stack.size();
  f.ctx.uc_link = &scheduler;
  makecontext(&f.ctx, fiber_main, 0);
}
[[gnu::noinline]] inline void resume(int i) {
  cur = i;
  swapcontext(&scheduler, &(*fibers)[std::size_t(i)].ctx);
}

// Runs `kernel` as every thread of every block of `g`.
inline void launch(Dim3 g, int threads, std::size_t smem_bytes, const std::function<void()>& kernel) {
  grid = g;
  block_dim = {unsigned(threads), 1, 1};
  body = &kernel;
  std::vector<Fiber> fs(static_cast<std::size_t>(threads));
  for (Fiber& f : fs) f.stack.resize(std::size_t(1) << 18);
  std::vector<int> order(static_cast<std::size_t>(threads));
  for (int i = 0; i < threads; ++i) order[std::size_t(i)] = i;
  for (unsigned z = 0; z < g.z; ++z)
    for (unsigned y = 0; y < g.y; ++y)
      for (unsigned x = 0; x < g.x; ++x) {
        Cta c;
        c.threads = threads;
        c.warps.resize(std::size_t((threads + 31) / 32));
        c.smem.assign(smem_bytes, 0xff);
        c.block = {x, y, z};
        cta = &c;
        fibers = &fs;
        for (Fiber& f : fs) start_fiber(f);
        // Each warp gets a speed: the chance that its threads run in a round
        // (one warp of the CTA 0.03, the others 0.5 to 1). The slow warp lags
        // the others by hundreds of warp collectives between two barriers, so
        // a shared-memory write that no barrier orders after another warp's
        // read of the same data (or the reverse) shows as wrong results.
        // Threads blocked at a barrier are not resumed until it opens.
        const std::size_t warps = c.warps.size();
        std::vector<double> speed(warps);
        std::vector<char> run(warps);
        std::uniform_real_distribution<double> uni(0.0, 1.0);
        for (double& sp : speed) sp = 0.5 + 0.5 * uni(rng);
        speed[std::size_t(rng() % warps)] = 0.03;
        for (;;) {
          const long before = progress;
          bool all_done = true, skipped = false;
          std::shuffle(order.begin(), order.end(), rng);
          for (std::size_t w = 0; w < warps; ++w) run[w] = uni(rng) < speed[w];
          for (int i : order) {
            const Fiber& f = fs[std::size_t(i)];
            if (f.done) continue;
            all_done = false;
            if (f.wait_gen != nullptr && *f.wait_gen == f.wait_val) continue;  // blocked
            if (!run[std::size_t(i / 32)]) {
              skipped = true;
              continue;
            }
            resume(i);
          }
          if (all_done) break;
          if (progress == before && !skipped) fail("deadlock: a barrier that not every thread reaches");
        }
      }
}

}  // namespace attention_emulation

inline void __syncthreads() { attention_emulation::sync_cta(); }
inline float __shfl_xor_sync(unsigned, float x, int m) { return attention_emulation::shfl_xor(x, m); }
inline void __trap() { attention_emulation::fail("__trap"); }
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float2 atomicAdd(float2* p, float2 v) {
  const float2 old = *p;
  p->x += v.x;
  p->y += v.y;
  return old;
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#pragma GCC diagnostic ignored "-Wunused-variable"
#pragma GCC diagnostic ignored "-Wstrict-aliasing"
#pragma push_macro("__global__")
#pragma push_macro("__device__")
#pragma push_macro("__forceinline__")
#pragma push_macro("__launch_bounds__")
#pragma push_macro("__align__")
#undef __global__
#undef __device__
#undef __forceinline__
#undef __launch_bounds__
#undef __align__
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define threadIdx (attention_emulation::thread_idx())
#define blockIdx (attention_emulation::cta->block)
#define gridDim (attention_emulation::grid)
#define blockDim (attention_emulation::block_dim)
#define SLIME_ATTENTION_EMULATION 1
#define SLIME_ATTENTION_DYNAMIC_SMEM(name) unsigned char* name = attention_emulation::smem()
using std::max;
using std::min;
namespace slime::ops::cuda::attention_impl {
inline void cp_async_16(void* dst, const void* src, bool full) { attention_emulation::cp_async(dst, src, full); }
inline void cp_async_commit() { attention_emulation::cp_commit(); }
template <int N>
inline void cp_async_wait() {
  attention_emulation::cp_wait(N);
}
inline void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) { attention_emulation::ldmatrix(r, p, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* p) { attention_emulation::ldmatrix(r, p, true); }
inline void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  attention_emulation::mma(c, a, b0, b1);
}
// ex2.approx.ftz: subnormal results are 0.
inline float exp2_ftz(float x) {
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
}
// The deterministic dq's turns: CTAs run one after another in blockIdx order
// (x fastest), so every turn has come when it is waited for; one that has
// not is an ordering bug.
inline void dq_turn_wait(const int* turn, int mine) {
  if (*turn != mine) attention_emulation::fail("deterministic dq: a key block's turn came out of order");
}
inline void dq_turn_pass(int* turn) { ++*turn; }
inline void dq_adds_fence() {}
}  // namespace slime::ops::cuda::attention_impl
#include "../../src/ops/attention_kernels.cuh"
#undef threadIdx
#undef blockIdx
#undef gridDim
#undef blockDim
#pragma pop_macro("__global__")
#pragma pop_macro("__device__")
#pragma pop_macro("__forceinline__")
#pragma pop_macro("__launch_bounds__")
#pragma pop_macro("__align__")
#pragma GCC diagnostic pop

namespace {

namespace ai = slime::ops::cuda::attention_impl;
namespace emu = attention_emulation;

// The launch sequence of forward_launch / backward_launch, on the emulator.
template <int kD>
void emulated_forward(const cuda::AttentionForwardParams& p) {
  using Cfg = ai::FwdConfig<kD>;
  const emu::Dim3 g{unsigned((p.max_seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM), unsigned(p.num_seqs),
                    unsigned(p.heads_q)};
  if (p.options.causal) {
    emu::launch(g, Cfg::kThreads, Cfg::kSmemBytes, [&] { ai::attention_fwd_kernel<Cfg, CausalMask>(p); });
  } else {
    emu::launch(g, Cfg::kThreads, Cfg::kSmemBytes, [&] { ai::attention_fwd_kernel<Cfg, FullMask>(p); });
  }
}

template <int kD>
void emulated_backward(const cuda::AttentionBackwardParams& bp) {
  using Cfg = ai::BwdConfig<kD>;
  const cuda::AttentionForwardParams& p = bp.fwd;
  const int64_t rows = int64_t(p.tokens_q) * p.heads_q, n = rows * kD;
  std::memset(bp.workspace, 0, std::size_t(n) * sizeof(float));
  if (p.options.deterministic) std::memset(bp.workspace + n + rows, 0, std::size_t(rows) * 2 * sizeof(int));
  emu::launch({unsigned((rows * ai::preprocess_lanes(kD) + 255) / 256), 1, 1}, 256, 0, [&] {
    ai::attention_bwd_preprocess_kernel<kD>(static_cast<const ai::bf16*>(p.o), static_cast<const ai::bf16*>(bp.d_o),
                                            bp.workspace + n, rows);
  });
  const emu::Dim3 g{unsigned((p.max_seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN), unsigned(p.num_seqs),
                    unsigned(p.heads_kv * Cfg::kColSplits)};
  if (p.options.causal) {
    emu::launch(g, Cfg::kThreads, Cfg::kSmemBytes, [&] { ai::attention_bwd_kernel<Cfg, CausalMask>(bp); });
  } else {
    emu::launch(g, Cfg::kThreads, Cfg::kSmemBytes, [&] { ai::attention_bwd_kernel<Cfg, FullMask>(bp); });
  }
  emu::launch({3, 1, 1}, 256, 0, [&] {
    ai::attention_bwd_dq_kernel<kD>(bp.workspace, static_cast<ai::bf16*>(bp.dq), n, p.softmax_scale);
  });
}

std::vector<float> floats_of(const std::vector<BFloat16>& v) {
  std::vector<float> f;
  for (BFloat16 x : v) f.push_back(float(x));
  return f;
}

double rel_err_f(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Emulated kernels vs the f32 reference on the same bf16 inputs; tolerances
// as in test_attention_gpu.cu (the emulated mma sums in a different order
// than the hardware, which is far inside them).
// `deterministic_too`: the backward again with AttentionOptions::deterministic
// (the turn counters: a turn out of order fails the emulator). dk and dv must
// give the same bits; dq, added in the other key-block order (the last key
// block first), must match the reference as closely.
template <int kD>
void check_emulated(const std::vector<int32_t>& lens_q, const std::vector<int32_t>& lens_k, int hq, int hkv,
                    const AttentionOptions& opt, uint64_t seed, bool deterministic_too = false) {
  const std::vector<int32_t> cq = prefix(lens_q), ck = prefix(lens_k);
  const int B = int(lens_q.size()), T = cq.back(), Tk = ck.back();
  auto bf = [](int64_t n, uint64_t s) {
    std::vector<BFloat16> v(static_cast<std::size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[std::size_t(i)] = BFloat16(random_normal(s, uint64_t(i)));
    return v;
  };
  const std::vector<BFloat16> q = bf(int64_t(T) * hq * kD, seed), k = bf(int64_t(Tk) * hkv * kD, seed + 1),
                              v = bf(int64_t(Tk) * hkv * kD, seed + 2), d_o = bf(int64_t(T) * hq * kD, seed + 3);
  const BFloat16 nan = BFloat16::from_bits(0xffff);
  std::vector<BFloat16> o(q.size(), nan), dq(q.size(), nan), dk(k.size(), nan), dv(k.size(), nan);
  std::vector<float> lse(std::size_t(T) * std::size_t(hq), std::nanf("")),
      ws(std::size_t(cuda::attention_backward_workspace_elems(T, hq, kD)), std::nanf(""));
  cuda::AttentionForwardParams p;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.o = o.data();
  p.lse = lse.data();
  p.cu_seqlens_q = cq.data();
  p.cu_seqlens_k = ck.data();
  p.num_seqs = B;
  p.heads_q = hq;
  p.heads_kv = hkv;
  p.head_dim = kD;
  p.tokens_q = T;
  p.tokens_k = Tk;
  p.max_seqlen_q = *std::max_element(lens_q.begin(), lens_q.end());
  p.max_seqlen_k = *std::max_element(lens_k.begin(), lens_k.end());
  p.softmax_scale = cpu::detail::resolve_scale<float>(opt, kD);
  p.options = opt;
  emulated_forward<kD>(p);
  cuda::AttentionBackwardParams bp;
  bp.fwd = p;
  bp.d_o = d_o.data();
  bp.dq = dq.data();
  bp.dk = dk.data();
  bp.dv = dv.data();
  bp.workspace = ws.data();
  emulated_backward<kD>(bp);

  const std::vector<float> fq = floats_of(q), fk = floats_of(k), fv = floats_of(v), fdo = floats_of(d_o),
                           go = floats_of(o);
  std::vector<float> ro(fq.size()), rlse(lse.size());
  cpu::attention_forward(fq.data(), fk.data(), fv.data(), cq.data(), ck.data(), B, hq, hkv, kD, opt, ro.data(),
                         rlse.data());
  CHECK(rel_err_f(go, ro) <= 1e-2);
  std::vector<double> dl(lse.begin(), lse.end()), drl(rlse.begin(), rlse.end());
  CHECK(lse_err(dl, drl) <= 1e-3);
  std::vector<float> rdq(fq.size()), rdk(fk.size()), rdv(fv.size());
  cpu::attention_backward(fq.data(), fk.data(), fv.data(), go.data(), lse.data(), fdo.data(), cq.data(), ck.data(), B,
                          hq, hkv, kD, opt, rdq.data(), rdk.data(), rdv.data());
  CHECK(rel_err_f(floats_of(dq), rdq) <= 2e-2);
  CHECK(rel_err_f(floats_of(dk), rdk) <= 2e-2);
  CHECK(rel_err_f(floats_of(dv), rdv) <= 2e-2);
  if (deterministic_too) {
    std::vector<BFloat16> dq2(q.size(), nan), dk2(k.size(), nan), dv2(k.size(), nan);
    std::fill(ws.begin(), ws.end(), std::nanf(""));
    bp.fwd.options.deterministic = true;
    bp.dq = dq2.data();
    bp.dk = dk2.data();
    bp.dv = dv2.data();
    emulated_backward<kD>(bp);
    auto same = [](const std::vector<BFloat16>& a, const std::vector<BFloat16>& b) {
      return std::memcmp(a.data(), b.data(), a.size() * sizeof(BFloat16)) == 0;
    };
    CHECK(rel_err_f(floats_of(dq2), rdq) <= 2e-2);
    CHECK(same(dk, dk2));
    CHECK(same(dv, dv2));
  }
}

template <int kD>
void emulated_cases() {
  AttentionOptions opt;
  SECTION("causal self-attention, GQA 2 to 1") { check_emulated<kD>({1, 17, 130}, {1, 17, 130}, 2, 1, opt, 11, true); }
  SECTION("causal offset -50: rows and keys that see nothing") {
    opt.causal_offset = -50;
    check_emulated<kD>({3, 60, 130}, {3, 60, 130}, 2, 1, opt, 41, true);
  }
  SECTION("causal, 3 key blocks, deterministic dq") { check_emulated<kD>({300, 129}, {300, 129}, 2, 2, opt, 91, true); }
  SECTION("causal offset 150 over 3 key blocks (a ring step), deterministic dq") {
    opt.causal_offset = 150;
    check_emulated<kD>({140, 20}, {290, 200}, 1, 1, opt, 93, true);
  }
  SECTION("causal bottom-right, empty sequences, GQA 4 to 2") {
    opt.align = CausalAlign::bottom_right;
    check_emulated<kD>({1, 0, 60, 9}, {5, 17, 150, 0}, 4, 2, opt, 51, true);
  }
  SECTION("causal offset 37, more queries than keys, MHA") {
    opt.causal_offset = 37;
    check_emulated<kD>({130, 1, 64}, {65, 3, 129}, 1, 1, opt, 61);
  }
  SECTION("full mask, scale 0.05") {
    opt.causal = false;
    opt.softmax_scale = 0.05f;
    check_emulated<kD>({33, 0, 70}, {70, 31, 65}, 2, 2, opt, 71);
  }
  SECTION("full mask, 2 key blocks, deterministic dq") {
    opt.causal = false;
    check_emulated<kD>({70, 140}, {200, 150}, 2, 1, opt, 81, true);
  }
}

}  // namespace

TEST_CASE("attention CUDA kernels for head_dim 64, emulated on the CPU, match the reference", "[ops][attention]") {
  emulated_cases<64>();
}

TEST_CASE("attention CUDA kernels for head_dim 128, emulated on the CPU, match the reference", "[ops][attention]") {
  emulated_cases<128>();
}

// The other head dims: 32 (the shapes of 64), 72 (tiles of 80, zero-filled
// columns), 80 (dQ columns split 3 + 2 chunks), 96, 256 (two CTAs per key
// block, Q from shared memory in the forward).
TEST_CASE("attention CUDA kernels for head_dim 32, emulated on the CPU, match the reference", "[ops][attention]") {
  emulated_cases<32>();
}

TEST_CASE("attention CUDA kernels for head_dim 72, emulated on the CPU, match the reference", "[ops][attention]") {
  emulated_cases<72>();
}

TEST_CASE("attention CUDA kernels for head_dim 80, emulated on the CPU, match the reference", "[ops][attention]") {
  emulated_cases<80>();
}

TEST_CASE("attention CUDA kernels for head_dim 96, emulated on the CPU, match the reference", "[ops][attention]") {
  emulated_cases<96>();
}

TEST_CASE("attention CUDA kernels for head_dim 256, emulated on the CPU, match the reference", "[ops][attention]") {
  emulated_cases<256>();
}
#endif  // SLIME_HAS_CUDA && __linux__
