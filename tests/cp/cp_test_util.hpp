// tests/cp/cp_test_util.hpp: what the context-parallel tests share (CPU and
// GPU): the attention op run through parallel::ContextParallel on LocalComm
// ranks against one attention over the whole batch, and a tiny Qwen3's loss,
// logprobs and gradients with cp ranks against the unsplit model.
#pragma once

#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "slime/comm/local_comm.hpp"
#include "slime/core/random.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/ops/attention.hpp"
#include "slime/parallel/context_parallel.hpp"

namespace slime_test::cp {

using namespace slime;

inline std::vector<int32_t> cu_of(const std::vector<int>& lengths) {
  std::vector<int32_t> cu{0};
  for (int n : lengths) cu.push_back(cu.back() + n);
  return cu;
}

inline std::vector<float> uniform(int64_t n, uint64_t seed) {
  Tensor t = Tensor::empty({n}, DType::f32);
  fill_uniform(t, seed, 0, -1.f, 1.f);
  return t.to_vector<float>();
}

// Rows of `global` ([T, w] row-major, host) at the plan's rows; padding rows
// get `pad` rows (random) or zeros.
inline std::vector<float> take_rows(const parallel::CpPlan& p, const std::vector<float>& global, int64_t w,
                                    const std::vector<float>* pad) {
  std::vector<float> out(std::size_t(p.local_tokens() * w), 0.f);
  for (int64_t t = 0; t < p.local_tokens(); ++t) {
    const int64_t g = p.rows[std::size_t(t)];
    for (int64_t e = 0; e < w; ++e)
      out[std::size_t(t * w + e)] = g >= 0 ? global[std::size_t(g * w + e)]
                                    : pad  ? (*pad)[std::size_t(t * w + e)]
                                           : 0.f;
  }
  return out;
}

struct OpShape {
  std::vector<int> lengths;
  int hq = 4, hkv = 2, d = 8;
};

// The largest differences of one cp run against the reference (each divided
// by the reference tensor's largest magnitude), and the largest magnitude of
// a padding row's gradient (must be 0).
struct OpResult {
  double o = 0, dq = 0, dk = 0, dv = 0, padding_grad = 0;
  int64_t rows_checked = 0;
};

inline Tensor on(const std::vector<float>& v, const Shape& s, Device dev, DType dtype) {
  Tensor host = Tensor::from_vector(v, s);
  if (dtype == DType::f32 && dev.is_cpu()) return host;
  Tensor cast = Tensor::empty(s, dtype);
  ops::cast(host, cast);
  return dev.is_cpu() ? cast : cast.to(dev);
}
inline std::vector<float> host_f32(const Tensor& t) {
  Tensor h = t.device().is_cpu() ? t : t.to(Device::cpu());
  if (h.dtype() == DType::f32) return h.to_vector<float>();
  Tensor f = Tensor::empty(h.shape(), DType::f32);
  ops::cast(h, f);
  return f.to_vector<float>();
}

// Attention over the batch `shape` through ContextParallel(u, r) on u * r
// LocalComm ranks of `dev` (dtype: the activations'), against the f32 CPU
// attention of the whole batch. Padding rows hold random q, k, v and d_o = 0.
inline OpResult run_attention_op(const OpShape& shape, int u, int r, parallel::RingKv kv = parallel::RingKv::p2p,
                                 Device dev = Device::cpu(), DType dtype = DType::f32, uint64_t seed = 1,
                                 int64_t min_chunk = 0) {
  const std::vector<int32_t> cu = cu_of(shape.lengths);
  const int64_t T = cu.back(), hq = shape.hq, hkv = shape.hkv, d = shape.d;
  const std::vector<float> q = uniform(T * hq * d, seed), k = uniform(T * hkv * d, seed + 1),
                           v = uniform(T * hkv * d, seed + 2), d_o = uniform(T * hq * d, seed + 3);
  // The reference: one attention over the whole batch (f32, CPU), of the
  // inputs rounded to `dtype` as the ranks see them.
  const auto rounded = [&](const std::vector<float>& x, const Shape& s) {
    return host_f32(on(x, s, Device::cpu(), dtype));
  };
  const Tensor qr = Tensor::from_vector(rounded(q, {T, hq, d}), {T, hq, d}),
               kr = Tensor::from_vector(rounded(k, {T, hkv, d}), {T, hkv, d}),
               vr = Tensor::from_vector(rounded(v, {T, hkv, d}), {T, hkv, d}),
               dor = Tensor::from_vector(rounded(d_o, {T, hq, d}), {T, hq, d});
  const Tensor cut = Tensor::from_vector(cu, {int64_t(cu.size())});
  Tensor o_ref = Tensor::empty({T, hq, d}, DType::f32), lse_ref = Tensor::empty({T, hq}, DType::f32);
  ops::attention_forward(qr, kr, vr, cut, cut, -1, -1, o_ref, lse_ref);
  Tensor dq_ref = Tensor::empty(qr.shape(), DType::f32), dk_ref = Tensor::empty(kr.shape(), DType::f32),
         dv_ref = Tensor::empty(vr.shape(), DType::f32);
  ops::attention_backward(qr, kr, vr, o_ref, lse_ref, dor, cut, cut, -1, -1, dq_ref, dk_ref, dv_ref);
  const std::vector<float> O = o_ref.to_vector<float>(), DQ = dq_ref.to_vector<float>(), DK = dk_ref.to_vector<float>(),
                           DV = dv_ref.to_vector<float>();

  std::mutex mu;
  OpResult res;
  comm::run_local_ranks(
      u * r,
      [&](comm::Comm& c) {
        parallel::ContextParallel cpar(c, {.ulysses = u, .ring_kv = kv, .min_chunk_tokens = min_chunk});
        const Stream stream = Stream::default_for(dev);
        const parallel::CpPlan& p = cpar.plan(cu, stream);
        const int64_t Tl = p.local_tokens();
        const std::vector<float> noise = uniform(Tl * hq * d, seed + 100 + uint64_t(c.rank()));
        const Tensor ql = on(take_rows(p, q, hq * d, &noise), {Tl, hq, d}, dev, dtype);
        const Tensor kl = on(take_rows(p, k, hkv * d, &noise), {Tl, hkv, d}, dev, dtype);
        const Tensor vl = on(take_rows(p, v, hkv * d, &noise), {Tl, hkv, d}, dev, dtype);
        const Tensor dol = on(take_rows(p, d_o, hq * d, nullptr), {Tl, hq, d}, dev, dtype);
        const nn::PackedBatch batch = cpar.local_batch(std::vector<int32_t>(std::size_t(T), 0), 0, stream);
        Tensor o = Tensor::empty(ql.shape(), dtype, dev);
        o.fill_bytes_(0xFF);  // NaN: unwritten rows fail
        nn::SequenceAttention::Saved saved;
        cpar.forward(ql, kl, vl, batch, o, saved, stream);
        Tensor dq = Tensor::empty(ql.shape(), dtype, dev), dk = Tensor::empty(kl.shape(), dtype, dev),
               dv = Tensor::empty(vl.shape(), dtype, dev);
        for (Tensor* t : {&dq, &dk, &dv}) t->fill_bytes_(0xFF);
        cpar.backward(saved, dol, dq, dk, dv, stream);
        stream.synchronize();
        const std::vector<float> ho = host_f32(o), hdq = host_f32(dq), hdk = host_f32(dk), hdv = host_f32(dv);
        OpResult mine;
        const auto diff = [](double& worst, const std::vector<float>& a, int64_t ta, const std::vector<float>& b,
                             int64_t tb, int64_t w) {
          for (int64_t e = 0; e < w; ++e) {
            const double x = a[std::size_t(ta * w + e)], y = b[std::size_t(tb * w + e)];
            worst = std::isfinite(x) ? std::max(worst, std::abs(x - y)) : INFINITY;
          }
        };
        for (int64_t t = 0; t < Tl; ++t) {
          const int64_t g = p.rows[std::size_t(t)];
          if (g < 0) {
            for (const auto* a : {&hdq, &hdk, &hdv}) {
              const int64_t w = a == &hdq ? hq * d : hkv * d;
              for (int64_t e = 0; e < w; ++e)
                mine.padding_grad = std::max(mine.padding_grad, double(std::abs((*a)[std::size_t(t * w + e)])));
            }
            continue;
          }
          ++mine.rows_checked;
          diff(mine.o, ho, t, O, g, hq * d);
          diff(mine.dq, hdq, t, DQ, g, hq * d);
          diff(mine.dk, hdk, t, DK, g, hkv * d);
          diff(mine.dv, hdv, t, DV, g, hkv * d);
        }
        std::lock_guard lock(mu);
        res.o = std::max(res.o, mine.o);
        res.dq = std::max(res.dq, mine.dq);
        res.dk = std::max(res.dk, mine.dk);
        res.dv = std::max(res.dv, mine.dv);
        res.padding_grad = std::max(res.padding_grad, mine.padding_grad);
        res.rows_checked += mine.rows_checked;
      },
      comm::kLocalCommTimeout, dev);
  REQUIRE(res.rows_checked == T);  // every real row checked once
  // Relative to the largest magnitude of each reference tensor.
  const auto peak = [](const std::vector<float>& x) {
    double m = 0;
    for (float e : x) m = std::max(m, double(std::abs(e)));
    return std::max(m, 1e-30);
  };
  res.o /= peak(O);
  res.dq /= peak(DQ);
  res.dk /= peak(DK);
  res.dv /= peak(DV);
  return res;
}

// Every difference of `r` within its tolerance (o; dq, dk, dv), padding
// rows' gradients exactly zero.
inline void check_op(const OpResult& r, double o_tol, double grad_tol) {
  CHECK(r.o <= o_tol);
  CHECK(r.dq <= grad_tol);
  CHECK(r.dk <= grad_tol);
  CHECK(r.dv <= grad_tol);
  CHECK(r.padding_grad == 0.0);
}

inline double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, double(std::abs(a[i] - b[i])));
  return m;
}

// ||a - b|| / ||b||.
inline double rel_norm_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += double(a[i] - b[i]) * double(a[i] - b[i]);
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Ulysses x ring degrees and how the ring's K/V travel.
struct Degrees {
  int u, r;
  parallel::RingKv kv = parallel::RingKv::p2p;
  int64_t min_chunk = 0;  // ContextParallelOptions::min_chunk_tokens (0: every sequence zigzag)
};

// The model on `dev` (bf16 on CUDA), the same initial values everywhere.
inline nn::Qwen3Model model_of(const nn::Qwen3Config& c, Device dev) {
  nn::Qwen3Model m(c, {dev, dev.is_cuda() ? DType::bf16 : DType::f32});
  m.init_random(11, 0.2f);
  return m;
}

struct ModelRun {
  double loss = 0;
  std::vector<float> logprobs;
  std::map<std::string, std::vector<float>> grads;
};

// loss_and_backward of the whole batch on one rank.
inline ModelRun reference_run(const nn::Qwen3Config& c, const std::vector<std::vector<int32_t>>& seqs,
                              const std::vector<int32_t>& targets, Device dev = Device::cpu()) {
  nn::Qwen3Model m = model_of(c, dev);
  nn::zero_grad(m);
  const nn::PackedBatch b = nn::make_packed_batch(seqs, dev);
  const auto res = m.loss_and_backward(b, Tensor::from_vector(targets, {int64_t(targets.size())}, dev));
  ModelRun out;
  out.loss = res.loss;
  out.logprobs = host_f32(res.logprobs);
  m.for_each_parameter([&](nn::Parameter& p) { out.grads[p.name] = host_f32(p.grad); });
  return out;
}

// The same batch on u * r LocalComm ranks of `dev`, each with its plan's
// rows; the loss summed, the logprobs gathered and the gradients summed over
// the ranks.
inline ModelRun cp_run(const nn::Qwen3Config& c, const std::vector<std::vector<int32_t>>& seqs,
                       const std::vector<int32_t>& targets, Degrees dg, Device dev = Device::cpu()) {
  std::vector<int32_t> cu{0}, tokens;
  for (const auto& s : seqs) {
    cu.push_back(cu.back() + int32_t(s.size()));
    tokens.insert(tokens.end(), s.begin(), s.end());
  }
  ModelRun out;
  std::mutex mu;
  comm::run_local_ranks(
      dg.u * dg.r,
      [&](comm::Comm& comm) {
        nn::Qwen3Model m = model_of(c, dev);
        parallel::ContextParallel cpar(comm, {.ulysses = dg.u, .ring_kv = dg.kv, .min_chunk_tokens = dg.min_chunk});
        m.set_sequence_attention(&cpar);
        nn::zero_grad(m);
        const parallel::CpPlan& plan = cpar.plan(cu);
        const nn::PackedBatch local = cpar.local_batch(tokens);
        const int64_t T = plan.local_tokens();
        const Tensor t = Tensor::from_vector(plan.take(targets, 0), {T}, dev);
        const Tensor w = Tensor::from_vector(plan.take(std::vector<float>(targets.size(), 1.f), 0.f), {T}, dev);
        // The whole batch's token count normalises every rank's share.
        const auto res = m.loss_and_backward(local, t, w, 1.f, double(targets.size()));
        Tensor loss = Tensor::from_vector(std::vector<float>{float(res.loss)}, {1}, dev);
        comm.all_reduce(loss);
        const Tensor lp = cpar.gather(res.logprobs);
        std::map<std::string, std::vector<float>> grads;
        m.for_each_parameter([&](nn::Parameter& p) {
          comm.all_reduce(p.grad);  // each cp rank holds its tokens' share
          grads[p.name] = host_f32(p.grad);
        });
        if (comm.rank() == 0) {
          std::lock_guard lock(mu);
          out.loss = loss.to_vector<float>()[0];
          out.logprobs = host_f32(lp);
          out.grads = grads;
        }
      },
      comm::kLocalCommTimeout, dev);
  return out;
}

}  // namespace slime_test::cp
