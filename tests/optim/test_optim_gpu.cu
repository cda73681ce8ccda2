// slime::optim on the GPU against the CPU reference on fresh random inputs:
// the multi-tensor AdamW kernel on many odd-sized tensors (numel 1, 7, 4097,
// 2^20 + 3, chunk edges, 200 small ones so that one step takes several
// launches), 16-byte aligned and misaligned views (the one-element path), no
// copy / bf16 copy / f32 copy mixed in one call, grad_scale != 1, param_copy
// poisoned with NaN (0xff) before every step; the AdamW class; the global
// gradient norm (several launches, determinism, NaN, LocalComm ranks); the
// steady state allocates nothing.
//
// Tolerances:
//   AdamW: bit for bit. The kernel performs the CPU reference's fp32
//     operations with the same roundings (explicit __fmaf_rn / __fmul_rn /
//     __fdiv_rn / __fsqrt_rn; IEEE on both sides). The relative error (f32:
//     <= 1e-6) is checked too, so a failure says how far off it is.
//   grad norm: relative 2.5e-6 against the fp64 CPU sum. The GPU adds squares
//     (all positive, no cancellation) in fp32 over at most 64 terms per lane,
//     then a 10-level tree, then fp64: at most ~(64 + 10) * 2^-24 = 4.4e-6 on
//     the sum, half of that on its square root.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "slime/comm/local_comm.hpp"
#include "slime/core/memory.hpp"
#include "slime/core/random.hpp"
#include "slime/optim/adamw.hpp"
#include "slime/optim/grad_clip.hpp"

using namespace slime;
using namespace slime::optim;
using Catch::Matchers::ContainsSubstring;

namespace {

#define REQUIRE_GPU() \
  if (cuda_device_count() == 0) SKIP("no CUDA device")

Device gpu() { return Device::cuda(0); }

// A 1-d f32 tensor on `d` of n elements ~ N(mean, stddev), seeded; with
// `misalign`, a view one element into a larger buffer (never 16-byte aligned).
Tensor randn(int64_t n, Device d, uint64_t seed, float stddev, bool misalign = false, float mean = 0.f) {
  Tensor buf = Tensor::empty({n + (misalign ? 1 : 0)}, DType::f32, d);
  fill_normal(buf, seed, 0, mean, stddev);
  return misalign ? buf.view(1, Shape{n}) : buf;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  return ha.nbytes() == hb.nbytes() && std::memcmp(ha.data_ptr(), hb.data_ptr(), ha.nbytes()) == 0;
}

// ||got - want|| / ||want|| (f32 tensors); NaN when got holds a NaN.
double rel_err(const Tensor& got, const Tensor& want) {
  const std::vector<float> g = got.to_vector<float>(), w = want.to_vector<float>();
  REQUIRE(g.size() == w.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i])) return std::numeric_limits<double>::quiet_NaN();
    num += (double(g[i]) - w[i]) * (double(g[i]) - w[i]);
    den += double(w[i]) * w[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

AdamWTensors to_cpu(const AdamWTensors& t) {
  return {t.param.to(Device::cpu()), t.grad.to(Device::cpu()), t.exp_avg.to(Device::cpu()),
          t.exp_avg_sq.to(Device::cpu()), t.param_copy.defined() ? t.param_copy.to(Device::cpu()) : Tensor()};
}

// Odd sizes, chunk edges (64Ki) and many small tensors.
std::vector<int64_t> test_sizes() {
  std::vector<int64_t> sizes = {1, 7, 4097, (int64_t(1) << 20) + 3, 3, 65536, 65537, 131071, 12345, 8, 4};
  for (int64_t i = 0; i < 200; ++i) sizes.push_back(1 + (i * 37) % 700);
  return sizes;
}

}  // namespace

TEST_CASE("multi-tensor AdamW on the GPU equals the CPU reference bit for bit", "[optim][adamw][gpu]") {
  REQUIRE_GPU();
  const std::vector<int64_t> sizes = test_sizes();
  for (float grad_scale : {1.f, 0.37f}) {
    for (int copies = 0; copies < 2; ++copies) {
      std::vector<AdamWTensors> dev;
      uint64_t seed = 100 + uint64_t(copies) * 7 + (grad_scale == 1.f ? 0 : 1000);
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        const int64_t n = sizes[i];
        const bool mis = i % 5 == 3;  // every fifth tensor misaligned: the scalar path
        AdamWTensors t;
        t.param = randn(n, gpu(), ++seed, 1.f, mis);
        t.grad = randn(n, gpu(), ++seed, 0.01f, mis && i % 2 == 0);
        // Moments of a run in progress: m ~ N(0, 0.01), v ~ |N(1e-4, 1e-5)|.
        t.exp_avg = randn(n, gpu(), ++seed, 0.01f);
        t.exp_avg_sq = randn(n, gpu(), ++seed, 1e-5f, false, 1e-4f);
        if (copies == 1 && i % 3 != 2) {
          // bf16 and f32 copies mixed with none in one call; some misaligned.
          const DType dt = i % 3 == 0 ? DType::bf16 : DType::f32;
          Tensor buf = Tensor::empty({n + 1}, dt, gpu());
          t.param_copy = i % 7 == 1 ? buf.view(1, Shape{n}) : buf.view(0, Shape{n});
        }
        dev.push_back(t);
      }
      // |v| so the moments are valid.
      for (AdamWTensors& t : dev) {
        std::vector<float> v = t.exp_avg_sq.to_vector<float>();
        for (float& x : v) x = std::abs(x);
        t.exp_avg_sq.copy_from(Tensor::from_vector(v, t.exp_avg_sq.shape()));
      }
      std::vector<AdamWTensors> host;
      for (const AdamWTensors& t : dev) host.push_back(to_cpu(t));

      const AdamWConfig cfg{.lr = 0, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
      for (int64_t step = 1; step <= 3; ++step) {
        const double lr = 3e-4 * double(step);
        for (AdamWTensors& t : dev)
          if (t.param_copy.defined()) t.param_copy.fill_bytes_(0xff);
        for (AdamWTensors& t : host)
          if (t.param_copy.defined()) t.param_copy.fill_bytes_(0xff);
        adamw_step(dev, cfg, lr, 10 + step, grad_scale);
        adamw_step(host, cfg, lr, 10 + step, grad_scale);
      }
      for (std::size_t i = 0; i < dev.size(); ++i) {
        INFO("tensor " << i << " numel " << sizes[i] << " grad_scale " << grad_scale << " copies " << copies);
        CHECK(rel_err(dev[i].param, host[i].param) <= 1e-6);
        CHECK(rel_err(dev[i].exp_avg, host[i].exp_avg) <= 1e-6);
        CHECK(rel_err(dev[i].exp_avg_sq, host[i].exp_avg_sq) <= 1e-6);
        CHECK(same_bits(dev[i].param, host[i].param));
        CHECK(same_bits(dev[i].exp_avg, host[i].exp_avg));
        CHECK(same_bits(dev[i].exp_avg_sq, host[i].exp_avg_sq));
        if (dev[i].param_copy.defined()) {
          // Every element written (no NaN left), equal to the CPU's rounding
          // of the CPU param.
          CHECK(same_bits(dev[i].param_copy, host[i].param_copy));
        }
      }
    }
  }
}

TEST_CASE("AdamW class on the GPU: state on the device, same steps as the CPU, no allocation", "[optim][adamw][gpu]") {
  REQUIRE_GPU();
  const std::vector<int64_t> sizes = {1, 4097, 7, 65536 * 2 + 5};
  std::vector<Tensor> p_dev, g_dev, c_dev, p_host, g_host, c_host;
  uint64_t seed = 500;
  for (int64_t n : sizes) {
    p_dev.push_back(randn(n, gpu(), ++seed, 1.f));
    g_dev.push_back(randn(n, gpu(), ++seed, 0.1f));
    c_dev.push_back(Tensor::empty({n}, DType::bf16, gpu()));
    p_host.push_back(p_dev.back().to(Device::cpu()));
    g_host.push_back(g_dev.back().to(Device::cpu()));
    c_host.push_back(Tensor::empty({n}, DType::bf16));
  }
  SLIME_CUDA_CHECK(cudaDeviceSynchronize());  // the inputs, made on the default stream
  const Stream s = Stream::create(gpu());
  AdamW a, b;
  a.step(p_dev, g_dev, 1e-3, 0.5f, c_dev, s);
  b.step(p_host, g_host, 1e-3, 0.5f, c_host);
  for (const auto& [name, t] : a.state_tensors()) {
    INFO(name);
    CHECK(t.device() == gpu());
  }
  // Steady state: no device allocation.
  s.synchronize();
  const int64_t before = memory_stats(gpu()).allocations;
  for (int i = 0; i < 3; ++i) {
    a.step(p_dev, g_dev, 1e-3, 0.5f, c_dev, s);
    b.step(p_host, g_host, 1e-3, 0.5f, c_host);
  }
  s.synchronize();
  CHECK(memory_stats(gpu()).allocations == before);
  CHECK(a.step_count() == 4);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    CHECK(same_bits(p_dev[i], p_host[i]));
    CHECK(same_bits(c_dev[i], c_host[i]));
  }

  // Tensors on two devices.
  AdamWTensors mixed{
      p_dev[0], g_host[0], Tensor::zeros({1}, DType::f32, gpu()), Tensor::zeros({1}, DType::f32, gpu()), {}};
  REQUIRE_THROWS_WITH(adamw_step({&mixed, 1}, AdamWConfig{}, 1e-3, 1), ContainsSubstring("grad must be on cuda:0"));
}

TEST_CASE("global grad norm on the GPU: multi-tensor, deterministic, NaN reported", "[optim][grad_clip][gpu]") {
  REQUIRE_GPU();
  const std::vector<int64_t> sizes = test_sizes();  // 211 tensors: two sum-of-squares launches
  std::vector<Tensor> dev, host;
  uint64_t seed = 900;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    dev.push_back(randn(sizes[i], gpu(), ++seed, i % 4 == 0 ? 10.f : 0.01f, i % 5 == 3));
    host.push_back(dev.back().to(Device::cpu()));
  }
  const double want = global_grad_norm(host);
  const double got = global_grad_norm(dev);
  INFO("gpu " << got << " cpu " << want);
  CHECK(std::abs(got - want) <= 2.5e-6 * want);
  const Stream s = Stream::create(gpu());
  const double again = global_grad_norm(dev, nullptr, s);
  CHECK(std::memcmp(&got, &again, sizeof(double)) == 0);  // run to run, bit for bit

  // Two LocalComm ranks, each with half of the tensors on the GPU (the ranks
  // record, the test thread asserts: Catch2's assertions are not thread-safe).
  std::vector<double> rank_norms(2, 0.0);
  comm::run_local_ranks(2, [&](comm::Comm& c) {
    std::vector<Tensor> mine;
    for (std::size_t i = std::size_t(c.rank()); i < dev.size(); i += 2) mine.push_back(dev[i]);
    rank_norms[std::size_t(c.rank())] = global_grad_norm(mine, &c);
  });
  for (double norm : rank_norms) CHECK(std::abs(norm - want) <= 2.5e-6 * want);

  // NaN and inf propagate.
  std::vector<float> v = host[3].to_vector<float>();
  v.back() = std::numeric_limits<float>::quiet_NaN();
  Tensor bad = Tensor::from_vector(v, host[3].shape(), gpu());
  std::vector<Tensor> with_nan = dev;
  with_nan[3] = bad;
  CHECK(std::isnan(global_grad_norm(with_nan)));
  v.back() = std::numeric_limits<float>::infinity();
  with_nan[3] = Tensor::from_vector(v, host[3].shape(), gpu());
  CHECK(std::isinf(global_grad_norm(with_nan)));

  // Empty tensors and an empty list.
  std::vector<Tensor> empty = {Tensor::empty({0}, DType::f32, gpu())};
  CHECK(global_grad_norm(empty) == 0);
  REQUIRE_THROWS_WITH(global_grad_norm(std::vector<Tensor>{dev[0], host[1]}), ContainsSubstring("grads[1]"));
}

TEST_CASE("clip_factor on the GPU equals the host's norm and factor bit for bit, and AdamW reads it there",
          "[optim][grad_clip][gpu]") {
  REQUIRE_GPU();
  const std::vector<int64_t> sizes = test_sizes();
  std::vector<Tensor> dev;
  uint64_t seed = 1900;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    dev.push_back(randn(sizes[i], gpu(), ++seed, i % 4 == 0 ? 10.f : 0.01f, i % 5 == 3));
  Stream::default_for(gpu()).synchronize();  // filled on the default stream, read on s below
  const auto norm_of = [](const ClipBuffers& b) {
    double v = 0;
    const Tensor h = b.norm.to(Device::cpu());
    std::memcpy(&v, h.data_ptr(), sizeof v);
    return v;
  };
  const Stream s = Stream::create(gpu());
  ClipBuffers b;
  for (double max_norm : {1.0, 1e9}) {
    const Tensor& factor = clip_factor(std::array{NormGroup{dev, nullptr}}, max_norm, gpu(), s, b);
    const double want = global_grad_norm(dev, nullptr, s);
    CHECK(norm_of(b) == want);
    CHECK(factor.to_vector<float>(s)[0] == clip_coefficient(want, max_norm));
  }

  // Two groups over 2 LocalComm ranks on the GPU (fp32 all-reduced sums); the
  // ranks record, the test checks (Catch2's assertions are not thread-safe).
  std::vector<std::pair<double, double>> norms(2), factors(2);  // (got, want)
  comm::run_local_ranks(
      2,
      [&](comm::Comm& c) {
        std::vector<Tensor> dense, expert;
        for (std::size_t i = std::size_t(c.rank()); i < dev.size(); i += 2) (i % 3 ? dense : expert).push_back(dev[i]);
        ClipBuffers mine;
        const Tensor& factor =
            clip_factor(std::array{NormGroup{dense, &c}, NormGroup{expert, &c}}, 0.5, c.device(), {}, mine);
        const double d = global_grad_norm(dense, &c), e = global_grad_norm(expert, &c);
        const double want = std::sqrt(d * d + e * e);
        norms[std::size_t(c.rank())] = {norm_of(mine), want};
        factors[std::size_t(c.rank())] = {factor.to_vector<float>()[0], clip_coefficient(want, 0.5)};
      },
      comm::kLocalCommTimeout, gpu());
  for (int r = 0; r < 2; ++r) {
    CHECK(norms[std::size_t(r)].first == norms[std::size_t(r)].second);
    CHECK(factors[std::size_t(r)].first == factors[std::size_t(r)].second);
  }

  // AdamW with the factor on the device equals AdamW with the host's float factor.
  const Tensor& factor = clip_factor(std::array{NormGroup{dev, nullptr}}, 1.0, gpu(), s, b);
  const float host_factor = clip_coefficient(global_grad_norm(dev, nullptr, s), 1.0);
  REQUIRE(host_factor < 1.f);
  auto fresh = [&](uint64_t k) {
    std::vector<AdamWTensors> t;
    for (std::size_t i = 0; i < 12; ++i) {
      Tensor copy = Tensor::empty({sizes[i]}, DType::bf16, gpu());
      copy.fill_bytes_(0xff);
      t.push_back({randn(sizes[i], gpu(), 7000 + k * 100 + i, 1.f), dev[i],
                   Tensor::zeros({sizes[i]}, DType::f32, gpu()), Tensor::zeros({sizes[i]}, DType::f32, gpu()), copy});
    }
    return t;
  };
  std::vector<AdamWTensors> on_host = fresh(1), on_device = fresh(1);
  Stream::default_for(gpu()).synchronize();  // the fills ran on the default stream, the steps run on s
  for (int64_t step = 1; step <= 2; ++step) {
    adamw_step(on_host, AdamWConfig{}, 1e-3, step, host_factor, s);
    adamw_step(on_device, AdamWConfig{}, 1e-3, step, 1.f, s, factor);
  }
  s.synchronize();  // same_bits and norm_of copy on the default stream, which does not wait for s
  for (std::size_t i = 0; i < on_host.size(); ++i) {
    INFO("tensor " << i);
    CHECK(same_bits(on_host[i].param, on_device[i].param));
    CHECK(same_bits(on_host[i].exp_avg_sq, on_device[i].exp_avg_sq));
    CHECK(same_bits(on_host[i].param_copy, on_device[i].param_copy));
  }

  // A NaN gradient: a NaN factor, and the update skipped on the device.
  std::vector<float> v = dev[3].to_vector<float>();
  v[0] = std::numeric_limits<float>::quiet_NaN();
  std::vector<Tensor> with_nan = dev;
  with_nan[3] = Tensor::from_vector(v, dev[3].shape(), gpu());
  Stream::default_for(gpu()).synchronize();  // uploaded on the default stream, read on s
  const Tensor& nan_factor = clip_factor(std::array{NormGroup{with_nan, nullptr}}, 1.0, gpu(), s, b);
  s.synchronize();
  CHECK(std::isnan(norm_of(b)));
  CHECK(std::isnan(nan_factor.to_vector<float>(s)[0]));
  std::vector<AdamWTensors> skipped = fresh(2);
  Stream::default_for(gpu()).synchronize();
  std::vector<AdamWTensors> skipped_before;
  for (const AdamWTensors& t : skipped) skipped_before.push_back(to_cpu(t));
  adamw_step(skipped, AdamWConfig{}, 1e-3, 1, 1.f, s, nan_factor);
  s.synchronize();
  for (std::size_t i = 0; i < skipped.size(); ++i) {
    CHECK(same_bits(skipped[i].param, skipped_before[i].param));
    CHECK(same_bits(skipped[i].exp_avg, skipped_before[i].exp_avg));
    CHECK(same_bits(skipped[i].param_copy, skipped_before[i].param_copy));
  }
  REQUIRE_THROWS_WITH(adamw_step(skipped, AdamWConfig{}, 1e-3, 1, 1.f, s, nan_factor.to(Device::cpu())),
                      ContainsSubstring("device_grad_scale must be one f32 value on cuda:0"));
}
