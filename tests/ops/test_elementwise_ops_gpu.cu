// The memory-bound op families on the GPU (embedding, rms_norm, rope, swiglu,
// elementwise) against the CPU reference on fresh random inputs: f32 and bf16,
// odd sizes (rows 1, 17, 127, 577; hidden sizes not multiples of 8; views one
// element off 16-byte alignment, which take the scalar kernels), several
// packed sequences, outputs poisoned with NaN (0xff bytes) before every
// kernel, the accumulation contract, determinism, and a steady state that
// allocates nothing.
//
// Tolerances, as ||gpu - ref|| / ||ref|| with both computed from the same
// (already rounded) inputs in fp32:
//   exact (bit for bit): embedding forward and backward (the GPU adds each
//     id's rows in the CPU's order), add, scale, cast (one IEEE operation and
//     one round-to-nearest-even conversion on both sides);
//   bf16 outputs: 4e-3. The fp32 results differ only in summation order,
//     FMA contraction and sincosf/expf's last bits (~1e-6 relative); rounding
//     to bf16 then flips an element by at most one ulp (2^-8 relative), and
//     only the few elements that sit near a rounding boundary flip;
//   f32 outputs: 1e-5 (rstd, dweight summed over up to 577 rows in another
//     order: ~1e-6).
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "slime/core/memory.hpp"
#include "slime/core/random.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/ops/embedding.hpp"
#include "slime/ops/rms_norm.hpp"
#include "slime/ops/rope.hpp"
#include "slime/ops/swiglu.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;

namespace {

constexpr double kTolBf16 = 4e-3;
constexpr double kTolF32 = 1e-5;

double tolerance(DType t) { return t == DType::bf16 ? kTolBf16 : kTolF32; }

#define REQUIRE_GPU() \
  if (cuda_device_count() == 0) SKIP("no CUDA device")

Device gpu() { return Device::cuda(0); }

// A tensor on `d` filled with N(0, stddev), seeded.
Tensor randn(const Shape& shape, DType dt, Device d, uint64_t seed, float stddev = 1.f) {
  Tensor t = Tensor::empty(shape, dt, d);
  fill_normal(t, seed, 0, 0.f, stddev);
  return t;
}

// A view of `shape` one element into a fresh buffer: never 16-byte aligned,
// so the kernels take their one-element paths.
Tensor misaligned(const Tensor& src) {
  Tensor buf = Tensor::empty({src.numel() + 1}, src.dtype(), src.device());
  Tensor v = buf.view(1, src.shape());
  v.copy_from(src);
  return v;
}

Tensor poisoned(const Shape& shape, DType dt, Device d) {
  Tensor t = Tensor::empty(shape, dt, d);
  t.fill_bytes_(0xff);
  return t;
}

std::vector<double> to_double(const Tensor& t) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  ops::detail::memops::visit_floating(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const std::vector<T> v = t.to_vector<T>();
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = double(float(v[i]));
  });
  return out;
}

// ||got - want|| / ||want||; NaN when got holds a NaN (an element left unwritten).
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

bool same_bits(const Tensor& gpu_t, const Tensor& cpu_t) {
  const Tensor h = gpu_t.to(Device::cpu());
  return h.nbytes() == cpu_t.nbytes() && std::memcmp(h.data_ptr(), cpu_t.data_ptr(), h.nbytes()) == 0;
}

Tensor workspace(std::size_t bytes) {
  return Tensor::empty({int64_t(std::max<std::size_t>(bytes, 1))}, DType::u8, gpu());
}

}  // namespace

// ---------------------------------------------------------------- embedding

TEST_CASE("embedding forward on the GPU equals the CPU bit for bit", "[ops][embedding][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 1000;
  for (DType dt : {DType::bf16, DType::f32}) {
    for (DType id_dt : {DType::i32, DType::i64}) {
      for (int64_t dim : {int64_t(1), int64_t(7), int64_t(64), int64_t(1000), int64_t(4096)}) {
        for (int64_t tokens : {int64_t(1), int64_t(17), int64_t(577)}) {
          const int64_t vocab = 301;
          std::vector<int64_t> ids(static_cast<std::size_t>(tokens));
          for (int64_t t = 0; t < tokens; ++t) ids[std::size_t(t)] = int64_t(philox_word(++seed, 0) % vocab);
          Tensor ids_cpu = id_dt == DType::i64
                               ? Tensor::from_vector(ids, {tokens})
                               : Tensor::from_vector(std::vector<int32_t>(ids.begin(), ids.end()), {tokens});
          Tensor table = randn({vocab, dim}, dt, Device::cpu(), ++seed);
          Tensor ref = Tensor::empty({tokens, dim}, dt);
          ops::embedding_forward(ids_cpu, table, ref);
          Tensor y = poisoned({tokens, dim}, dt, gpu());
          ops::embedding_forward(ids_cpu.to(gpu()), table.to(gpu()), y);
          INFO("dtype " << dt << " ids " << id_dt << " dim " << dim << " tokens " << tokens);
          CHECK(same_bits(y, ref));
          // Misaligned table and output: the scalar kernel.
          Tensor y2 = misaligned(poisoned({tokens, dim}, dt, gpu()));
          y2.fill_bytes_(0xff);
          ops::embedding_forward(ids_cpu.to(gpu()), misaligned(table.to(gpu())), y2);
          CHECK(same_bits(y2, ref));
        }
      }
    }
  }
}

TEST_CASE("embedding backward on the GPU equals the CPU bit for bit and is deterministic", "[ops][embedding][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 2000;
  for (DType dt : {DType::f32, DType::bf16}) {
    for (int64_t dim : {int64_t(5), int64_t(128), int64_t(1000)}) {
      for (int64_t tokens : {int64_t(1), int64_t(127), int64_t(577)}) {
        for (int64_t vocab : {int64_t(3), int64_t(5000)}) {  // many repeats / mostly distinct
          std::vector<int32_t> ids(static_cast<std::size_t>(tokens));
          for (int64_t t = 0; t < tokens; ++t) {
            // Skewed: a third of the tokens share id 1 (a long run to sum).
            const uint32_t w = philox_word(++seed, 0);
            ids[std::size_t(t)] = w % 3 == 0 ? 1 % int32_t(vocab) : int32_t(w / 3 % uint32_t(vocab));
          }
          Tensor ids_cpu = Tensor::from_vector(ids, {tokens});
          Tensor dy = randn({tokens, dim}, dt, Device::cpu(), ++seed);
          Tensor g0 = randn({vocab, dim}, DType::f32, Device::cpu(), ++seed);
          Tensor ref = g0.clone();
          ops::embedding_backward(ids_cpu, dy, ref, Tensor{});

          const Tensor ids_gpu = ids_cpu.to(gpu()), dy_gpu = dy.to(gpu());
          Tensor ws = workspace(ops::embedding_backward_workspace_bytes(tokens));
          Tensor g = g0.to(gpu());
          ops::embedding_backward(ids_gpu, dy_gpu, g, ws);
          INFO("dtype " << dt << " dim " << dim << " tokens " << tokens << " vocab " << vocab);
          CHECK(same_bits(g, ref));
          // Again from the same start: the same bits.
          Tensor g2 = g0.to(gpu());
          ops::embedding_backward(ids_gpu, dy_gpu, g2, ws);
          CHECK(same_bits(g2, ref));
          // Misaligned dy: the scalar kernel, same order, same bits.
          Tensor g3 = g0.to(gpu());
          ops::embedding_backward(ids_gpu, misaligned(dy_gpu), g3, ws);
          CHECK(same_bits(g3, ref));
        }
      }
    }
  }
}

TEST_CASE("embedding on the GPU flags bad ids, writes their rows as NaN and validates on demand",
          "[ops][embedding][gpu]") {
  REQUIRE_GPU();
  const int64_t vocab = 10, dim = 16;
  const std::vector<int64_t> ids = {3, 12, 0, -4, 9, 3};
  Tensor table = randn({vocab, dim}, DType::bf16, gpu(), 3001);
  Tensor ids_gpu = Tensor::from_vector(ids, {6}, gpu());
  Tensor flag = Tensor::zeros({1}, DType::i32, gpu());
  Tensor y = poisoned({6, dim}, DType::bf16, gpu());
  y.zero_();
  ops::embedding_forward(ids_gpu, table, y, flag);
  CHECK(flag.to_vector<int32_t>()[0] == 1);
  const std::vector<BFloat16> hy = y.to_vector<BFloat16>();
  const std::vector<BFloat16> ht = table.to_vector<BFloat16>();
  for (int64_t t = 0; t < 6; ++t) {
    const int64_t id = ids[std::size_t(t)];
    for (int64_t d = 0; d < dim; ++d) {
      const float v = float(hy[std::size_t(t * dim + d)]);
      if (id < 0 || id >= vocab) {
        CHECK(std::isnan(v));
      } else {
        CHECK(hy[std::size_t(t * dim + d)].bits == ht[std::size_t(id * dim + d)].bits);
      }
    }
  }
  CHECK_THROWS_WITH(ops::embedding_check_ids(ids_gpu, vocab), ContainsSubstring("ids[1] = 12 is outside [0, 10)"));
  CHECK_NOTHROW(ops::embedding_check_ids(Tensor::from_vector(std::vector<int32_t>{0, 9, 4}, {3}, gpu()), vocab));
  // A good batch leaves the flag as the caller set it.
  Tensor flag2 = Tensor::zeros({1}, DType::i32, gpu());
  ops::embedding_forward(Tensor::from_vector(std::vector<int32_t>{0, 9, 4}, {3}, gpu()), table,
                         Tensor::empty({3, dim}, DType::bf16, gpu()), flag2);
  CHECK(flag2.to_vector<int32_t>()[0] == 0);

  // The backward skips bad ids: equal to the CPU over the good tokens only.
  Tensor dy = randn({6, dim}, DType::f32, Device::cpu(), 3002);
  std::vector<int32_t> good_ids;
  std::vector<float> good_rows;
  for (int64_t t = 0; t < 6; ++t) {
    if (ids[std::size_t(t)] < 0 || ids[std::size_t(t)] >= vocab) continue;
    good_ids.push_back(int32_t(ids[std::size_t(t)]));
    for (int64_t d = 0; d < dim; ++d) good_rows.push_back(dy.data<float>()[t * dim + d]);
  }
  const int64_t good = int64_t(good_ids.size());
  Tensor ref = Tensor::zeros({vocab, dim}, DType::f32);
  ops::embedding_backward(Tensor::from_vector(good_ids, {good}), Tensor::from_vector(good_rows, {good, dim}), ref,
                          Tensor{});
  Tensor g = Tensor::zeros({vocab, dim}, DType::f32, gpu());
  ops::embedding_backward(ids_gpu, dy.to(gpu()), g, workspace(ops::embedding_backward_workspace_bytes(6)));
  CHECK(same_bits(g, ref));
  // A workspace that is too small is an error, not an out-of-bounds write.
  CHECK_THROWS_WITH(ops::embedding_backward(ids_gpu, dy.to(gpu()), g, workspace(16)),
                    ContainsSubstring("embedding_backward_workspace_bytes"));
}

// ---------------------------------------------------------------- rms_norm

TEST_CASE("rms_norm on the GPU matches the CPU for odd sizes and every dtype pair", "[ops][rms_norm][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 4000;
  const float eps = 1e-6f;
  struct Pair {
    DType x, w;
  };
  for (Pair p : {Pair{DType::bf16, DType::bf16}, Pair{DType::bf16, DType::f32}, Pair{DType::f32, DType::f32},
                 Pair{DType::f32, DType::bf16}}) {
    for (int64_t dim :
         {int64_t(8), int64_t(13), int64_t(128), int64_t(1000), int64_t(2048), int64_t(4096), int64_t(5120)}) {
      for (int64_t rows : {int64_t(1), int64_t(17), int64_t(577)}) {
        for (bool aligned : {true, false}) {
          if (!aligned && rows > 17) continue;  // the scalar path needs fewer cases
          INFO("x " << p.x << " w " << p.w << " rows " << rows << " dim " << dim << " aligned " << aligned);
          Tensor x = randn({rows, dim}, p.x, Device::cpu(), ++seed, 2.f);
          Tensor w = randn({dim}, p.w, Device::cpu(), ++seed, 0.3f);
          Tensor dy = randn({rows, dim}, p.x, Device::cpu(), ++seed);
          Tensor dw0 = randn({dim}, DType::f32, Device::cpu(), ++seed);
          Tensor y_ref = Tensor::empty({rows, dim}, p.x), rstd_ref = Tensor::empty({rows}, DType::f32);
          ops::rms_norm_forward(x, w, eps, y_ref, rstd_ref);
          Tensor dx_ref = Tensor::empty({rows, dim}, p.x), dw_ref = dw0.clone();
          ops::rms_norm_backward(x, w, rstd_ref, dy, dx_ref, dw_ref, Tensor{});

          Tensor xg = aligned ? x.to(gpu()) : misaligned(x.to(gpu()));
          Tensor wg = aligned ? w.to(gpu()) : misaligned(w.to(gpu()));
          Tensor dyg = aligned ? dy.to(gpu()) : misaligned(dy.to(gpu()));
          Tensor y = poisoned({rows, dim}, p.x, gpu()), rstd = poisoned({rows}, DType::f32, gpu());
          ops::rms_norm_forward(xg, wg, eps, y, rstd);
          CHECK(rel_err(y, y_ref) <= tolerance(p.x));
          CHECK(rel_err(rstd, rstd_ref) <= kTolF32);

          Tensor ws = workspace(ops::rms_norm_backward_workspace_bytes(rows, dim));
          ws.fill_bytes_(0xff);  // partials must be written before they are read
          Tensor dx = poisoned({rows, dim}, p.x, gpu()), dw = dw0.to(gpu());
          ops::rms_norm_backward(xg, wg, rstd, dyg, dx, dw, ws);
          CHECK(rel_err(dx, dx_ref) <= tolerance(p.x));
          // dweight accumulated onto dw0: compare the increments.
          std::vector<double> inc = to_double(dw), inc_ref = to_double(dw_ref), base = to_double(dw0);
          double num = 0, den = 0;
          for (std::size_t i = 0; i < inc.size(); ++i) {
            num += std::pow((inc[i] - base[i]) - (inc_ref[i] - base[i]), 2);
            den += std::pow(inc_ref[i] - base[i], 2);
          }
          CHECK(std::sqrt(num / den) <= kTolF32);
          // Deterministic: the same dweight bits again.
          Tensor dw2 = dw0.to(gpu());
          ops::rms_norm_backward(xg, wg, rstd, dyg, dx, dw2, ws);
          CHECK(same_bits(dw2, dw.to(Device::cpu())));
        }
      }
    }
  }
}

TEST_CASE("rms_norm per head on the GPU (q_norm: [tokens, heads, 128], weight [128])", "[ops][rms_norm][gpu]") {
  REQUIRE_GPU();
  const int64_t tokens = 127, heads = 32, head_dim = 128;
  Tensor q = randn({tokens, heads, head_dim}, DType::bf16, Device::cpu(), 5001, 3.f);
  Tensor w = randn({head_dim}, DType::bf16, Device::cpu(), 5002);
  Tensor y_ref = Tensor::empty(q.shape(), DType::bf16), rstd_ref = Tensor::empty({tokens * heads}, DType::f32);
  ops::rms_norm_forward(q, w, 1e-6f, y_ref, rstd_ref);
  Tensor y = poisoned(q.shape(), DType::bf16, gpu()), rstd = poisoned({tokens * heads}, DType::f32, gpu());
  ops::rms_norm_forward(q.to(gpu()), w.to(gpu()), 1e-6f, y, rstd);
  CHECK(rel_err(y, y_ref) <= kTolBf16);
  CHECK(rel_err(rstd, rstd_ref) <= kTolF32);
  Tensor dy = randn(q.shape(), DType::bf16, Device::cpu(), 5003);
  Tensor dx_ref = Tensor::empty(q.shape(), DType::bf16), dw_ref = Tensor::zeros({head_dim}, DType::f32);
  ops::rms_norm_backward(q, w, rstd_ref, dy, dx_ref, dw_ref, Tensor{});
  Tensor dx = poisoned(q.shape(), DType::bf16, gpu()), dw = Tensor::zeros({head_dim}, DType::f32, gpu());
  ops::rms_norm_backward(q.to(gpu()), w.to(gpu()), rstd, dy.to(gpu()), dx, dw,
                         workspace(ops::rms_norm_backward_workspace_bytes(tokens * heads, head_dim)));
  CHECK(rel_err(dx, dx_ref) <= kTolBf16);
  CHECK(rel_err(dw, dw_ref) <= kTolF32);
}

TEST_CASE("rms_norm and embedding backward allocate nothing in the steady state", "[ops][gpu]") {
  REQUIRE_GPU();
  Stream s = Stream::create(gpu());
  const int64_t rows = 577, dim = 2048, vocab = 1000;
  Tensor x = randn({rows, dim}, DType::bf16, gpu(), 6001), w = randn({dim}, DType::bf16, gpu(), 6002);
  Tensor dy = randn({rows, dim}, DType::bf16, gpu(), 6003);
  Tensor y = Tensor::empty({rows, dim}, DType::bf16, gpu(), s), rstd = Tensor::empty({rows}, DType::f32, gpu(), s);
  Tensor dx = Tensor::empty({rows, dim}, DType::bf16, gpu(), s), dw = Tensor::zeros({dim}, DType::f32, gpu(), s);
  Tensor ws = Tensor::empty({int64_t(ops::rms_norm_backward_workspace_bytes(rows, dim))}, DType::u8, gpu(), s);
  std::vector<int32_t> ids(static_cast<std::size_t>(rows));
  for (int64_t t = 0; t < rows; ++t) ids[std::size_t(t)] = int32_t(philox_word(6004, uint64_t(t)) % vocab);
  Tensor ids_gpu = Tensor::from_vector(ids, {rows}, gpu());
  Tensor table_grad = Tensor::zeros({vocab, dim}, DType::f32, gpu(), s);
  Tensor ews = Tensor::empty({int64_t(ops::embedding_backward_workspace_bytes(rows))}, DType::u8, gpu(), s);
  Tensor q = randn({rows, 4, 128}, DType::bf16, gpu(), 6005), k = randn({rows, 2, 128}, DType::bf16, gpu(), 6006);
  Tensor pos = Tensor::empty({rows}, DType::i32, gpu(), s);
  Tensor cu = Tensor::from_vector(std::vector<int32_t>{0, 100, int32_t(rows)}, {3}, gpu());
  // Inputs were filled on the default stream; s does not wait for it.
  Stream::default_for(gpu()).synchronize();
  s.synchronize();
  const int64_t before = memory_stats(gpu()).allocations;
  for (int i = 0; i < 3; ++i) {
    ops::rms_norm_forward(x, w, 1e-6f, y, rstd, s);
    ops::rms_norm_backward(x, w, rstd, dy, dx, dw, ws, s);
    ops::embedding_backward(ids_gpu, dy, table_grad, ews, s);
    ops::positions_from_cu_seqlens(cu, pos, s);
    ops::rope_forward(q, k, pos, 1e6, q, k, s);
    ops::swiglu_forward(x, dy, y, s);
    ops::add_(x, dy, s);
  }
  s.synchronize();
  CHECK(memory_stats(gpu()).allocations == before);
}

// ---------------------------------------------------------------- rope

TEST_CASE("rope on the GPU matches the CPU with positions restarting per packed sequence", "[ops][rope][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 7000;
  // Packed sequences of 1, 17, 127 and 577 tokens (and an empty one).
  const std::vector<int32_t> cu = {0, 1, 18, 18, 145, 722};
  const int64_t tokens = 722;
  Tensor cu_cpu = Tensor::from_vector(cu, {int64_t(cu.size())});
  Tensor pos_ref = Tensor::empty({tokens}, DType::i32);
  ops::positions_from_cu_seqlens(cu_cpu, pos_ref);
  Tensor pos = poisoned({tokens}, DType::i32, gpu());
  ops::positions_from_cu_seqlens(cu_cpu.to(gpu()), pos);
  REQUIRE(same_bits(pos, pos_ref));
  // Positions far out, where the fp32 angle's rounding matters.
  std::vector<int32_t> far(static_cast<std::size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) far[std::size_t(t)] = int32_t(30000 + 7 * t);
  const Tensor far_cpu = Tensor::from_vector(far, {tokens});

  struct Heads {
    int64_t q, k, d;
  };
  for (DType dt : {DType::bf16, DType::f32}) {
    for (Heads h : {Heads{32, 4, 128}, Heads{3, 1, 64}, Heads{2, 2, 10}, Heads{4, 0, 6}}) {
      for (const Tensor* positions : std::initializer_list<const Tensor*>{&pos_ref, &far_cpu}) {
        for (bool aligned : {true, false}) {
          INFO("dtype " << dt << " heads " << h.q << "+" << h.k << " head_dim " << h.d << " aligned " << aligned);
          Tensor q = randn({tokens, h.q, h.d}, dt, Device::cpu(), ++seed);
          Tensor k = h.k > 0 ? randn({tokens, h.k, h.d}, dt, Device::cpu(), ++seed) : Tensor{};
          Tensor qr = Tensor::empty(q.shape(), dt), kr = h.k > 0 ? Tensor::empty(k.shape(), dt) : Tensor{};
          ops::rope_forward(q, k, *positions, 1e6, qr, kr);
          Tensor qg = aligned ? q.to(gpu()) : misaligned(q.to(gpu()));
          Tensor kg = h.k > 0 ? (aligned ? k.to(gpu()) : misaligned(k.to(gpu()))) : Tensor{};
          Tensor qo = poisoned(q.shape(), dt, gpu()), ko = h.k > 0 ? poisoned(k.shape(), dt, gpu()) : Tensor{};
          const Tensor pg = positions->to(gpu());
          ops::rope_forward(qg, kg, pg, 1e6, qo, ko);
          CHECK(rel_err(qo, qr) <= tolerance(dt));
          if (h.k > 0) CHECK(rel_err(ko, kr) <= tolerance(dt));
          // Backward (rotation by -angle), in place on the GPU.
          Tensor dq_ref = Tensor::empty(q.shape(), dt), dk_ref = h.k > 0 ? Tensor::empty(k.shape(), dt) : Tensor{};
          ops::rope_backward(q, k, *positions, 1e6, dq_ref, dk_ref);
          ops::rope_backward(qg, kg, pg, 1e6, qg, kg);
          CHECK(rel_err(qg, dq_ref) <= tolerance(dt));
          if (h.k > 0) CHECK(rel_err(kg, dk_ref) <= tolerance(dt));
        }
      }
    }
  }
}

TEST_CASE("multi-axis rope (MRoPE, 2-D vision) on the GPU matches the CPU", "[ops][rope][mrope][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 7500;
  const int64_t tokens = 301;
  struct Case {
    ops::RopeSpec spec;
    int64_t q, k, d;
  };
  const std::vector<Case> cases = {
      {ops::RopeSpec::mrope(5e6, {24, 20, 20}), 16, 8, 128},  // Qwen3-VL text
      {ops::RopeSpec::mrope(1e4, {2, 2, 1}), 3, 1, 10},       // odd pair count, scalar path
      {ops::RopeSpec::vision(1e4), 16, 16, 64},               // Qwen3-VL-2B tower
      {ops::RopeSpec::vision(1e4), 16, 0, 72},                // Qwen3-VL-8B tower, q only
  };
  for (DType dt : {DType::bf16, DType::f32}) {
    for (const Case& c : cases) {
      for (bool aligned : {true, false}) {
        INFO("dtype " << dt << " rotary " << c.spec.name() << " heads " << c.q << "+" << c.k << " head_dim " << c.d
                      << " aligned " << aligned);
        std::vector<int32_t> pos(static_cast<std::size_t>(tokens * c.spec.axes()));
        for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = int32_t(philox_word(++seed, i) % 40000);
        const Tensor pcpu = Tensor::from_vector(pos, {tokens, int64_t(c.spec.axes())});
        Tensor q = randn({tokens, c.q, c.d}, dt, Device::cpu(), ++seed);
        Tensor k = c.k > 0 ? randn({tokens, c.k, c.d}, dt, Device::cpu(), ++seed) : Tensor{};
        Tensor qr = Tensor::empty(q.shape(), dt), kr = c.k > 0 ? Tensor::empty(k.shape(), dt) : Tensor{};
        ops::rope_forward(q, k, pcpu, c.spec, qr, kr);
        Tensor qg = aligned ? q.to(gpu()) : misaligned(q.to(gpu()));
        Tensor kg = c.k > 0 ? (aligned ? k.to(gpu()) : misaligned(k.to(gpu()))) : Tensor{};
        Tensor qo = poisoned(q.shape(), dt, gpu()), ko = c.k > 0 ? poisoned(k.shape(), dt, gpu()) : Tensor{};
        const Tensor pg = pcpu.to(gpu());
        ops::rope_forward(qg, kg, pg, c.spec, qo, ko);
        CHECK(rel_err(qo, qr) <= tolerance(dt));
        if (c.k > 0) CHECK(rel_err(ko, kr) <= tolerance(dt));
        Tensor dq_ref = Tensor::empty(q.shape(), dt), dk_ref = c.k > 0 ? Tensor::empty(k.shape(), dt) : Tensor{};
        ops::rope_backward(q, k, pcpu, c.spec, dq_ref, dk_ref);
        ops::rope_backward(qg, kg, pg, c.spec, qg, kg);  // in place
        CHECK(rel_err(qg, dq_ref) <= tolerance(dt));
        if (c.k > 0) CHECK(rel_err(kg, dk_ref) <= tolerance(dt));
      }
    }
  }
}

// ---------------------------------------------------------------- swiglu

TEST_CASE("swiglu on the GPU matches the CPU, separate and fused layouts", "[ops][swiglu][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 8000;
  for (DType dt : {DType::bf16, DType::f32}) {
    for (int64_t f : {int64_t(1), int64_t(13), int64_t(17), int64_t(4096)}) {
      for (int64_t rows : {int64_t(1), int64_t(17), int64_t(127)}) {
        INFO("dtype " << dt << " F " << f << " rows " << rows);
        Tensor gu = randn({rows, 2 * f}, dt, Device::cpu(), ++seed, 3.f);
        Tensor dh = randn({rows, f}, dt, Device::cpu(), ++seed);
        Tensor h_ref = Tensor::empty({rows, f}, dt), dgu_ref = Tensor::empty({rows, 2 * f}, dt);
        ops::swiglu_forward_fused(gu, h_ref);
        ops::swiglu_backward_fused(gu, dh, dgu_ref);
        const Tensor gug = gu.to(gpu()), dhg = dh.to(gpu());
        Tensor h = poisoned({rows, f}, dt, gpu());
        ops::swiglu_forward_fused(gug, h);
        CHECK(rel_err(h, h_ref) <= tolerance(dt));
        Tensor dgu = poisoned({rows, 2 * f}, dt, gpu());
        ops::swiglu_backward_fused(gug, dhg, dgu);
        CHECK(rel_err(dgu, dgu_ref) <= tolerance(dt));

        // Separate tensors (the CPU's split), misaligned too.
        Tensor gate = Tensor::empty({rows, f}, dt), up = Tensor::empty({rows, f}, dt);
        const std::size_t es = dtype_size(dt);
        for (int64_t r = 0; r < rows; ++r) {
          std::memcpy(static_cast<char*>(gate.data_ptr()) + r * f * es,
                      static_cast<const char*>(gu.data_ptr()) + r * 2 * f * es, std::size_t(f) * es);
          std::memcpy(static_cast<char*>(up.data_ptr()) + r * f * es,
                      static_cast<const char*>(gu.data_ptr()) + (r * 2 * f + f) * es, std::size_t(f) * es);
        }
        for (bool aligned : {true, false}) {
          Tensor gg = aligned ? gate.to(gpu()) : misaligned(gate.to(gpu()));
          Tensor ug = aligned ? up.to(gpu()) : misaligned(up.to(gpu()));
          Tensor h2 = poisoned({rows, f}, dt, gpu());
          ops::swiglu_forward(gg, ug, h2);
          CHECK(rel_err(h2, h_ref) <= tolerance(dt));
          Tensor dg = poisoned({rows, f}, dt, gpu()), du = poisoned({rows, f}, dt, gpu());
          ops::swiglu_backward(gg, ug, dhg, dg, du);
          Tensor dg_ref = Tensor::empty({rows, f}, dt), du_ref = Tensor::empty({rows, f}, dt);
          ops::swiglu_backward(gate, up, dh, dg_ref, du_ref);
          CHECK(rel_err(dg, dg_ref) <= tolerance(dt));
          CHECK(rel_err(du, du_ref) <= tolerance(dt));
        }
      }
    }
  }
}

// ---------------------------------------------------------------- elementwise

TEST_CASE("add, add_ and scale on the GPU equal the CPU bit for bit", "[ops][elementwise][gpu]") {
  REQUIRE_GPU();
  uint64_t seed = 9000;
  for (DType dt : {DType::bf16, DType::f32, DType::f16}) {
    for (int64_t n : {int64_t(1), int64_t(7), int64_t(17), int64_t(4099), int64_t(1) << 20}) {
      for (bool aligned : {true, false}) {
        INFO("dtype " << dt << " n " << n << " aligned " << aligned);
        Tensor a = randn({n}, dt, Device::cpu(), ++seed, 4.f), b = randn({n}, dt, Device::cpu(), ++seed, 4.f);
        Tensor sum_ref = Tensor::empty({n}, dt), scaled_ref = Tensor::empty({n}, dt);
        ops::add(a, b, sum_ref);
        ops::scale(a, -0.731f, scaled_ref);
        Tensor ag = aligned ? a.to(gpu()) : misaligned(a.to(gpu()));
        Tensor bg = aligned ? b.to(gpu()) : misaligned(b.to(gpu()));
        Tensor y = poisoned({n}, dt, gpu());
        ops::add(ag, bg, y);
        CHECK(same_bits(y, sum_ref));
        Tensor sc = poisoned({n}, dt, gpu());
        ops::scale(ag, -0.731f, sc);
        CHECK(same_bits(sc, scaled_ref));
        ops::add_(ag, bg);
        CHECK(same_bits(ag, sum_ref));
      }
    }
  }
}

TEST_CASE("casts on the GPU equal slime::BFloat16 / Half bit for bit, special values included",
          "[ops][elementwise][gpu]") {
  REQUIRE_GPU();
  // Every 16-bit pattern as bf16 and as f16, and random f32 bit patterns
  // (NaNs with payloads, infinities, subnormals, ties).
  const int64_t n16 = 65536, n32 = int64_t(1) << 20;
  std::vector<BFloat16> all_bf(n16);
  std::vector<Half> all_h(n16);
  for (int64_t i = 0; i < n16; ++i) {
    all_bf[std::size_t(i)] = BFloat16::from_bits(uint16_t(i));
    all_h[std::size_t(i)] = Half::from_bits(uint16_t(i));
  }
  std::vector<float> f(static_cast<std::size_t>(n32));
  for (int64_t i = 0; i < n32; ++i) {
    const uint32_t w = philox_word(9999, uint64_t(i));
    // Mix in ties and near-ties for both 16-bit formats.
    f[std::size_t(i)] = detail::bits_float(i % 4 == 0   ? (w & 0xffff0000u) | 0x8000u
                                           : i % 4 == 1 ? (w & 0xffffe000u) | 0x1000u
                                                        : w);
  }
  const Tensor bf_cpu = Tensor::from_vector(all_bf, {n16}), h_cpu = Tensor::from_vector(all_h, {n16});
  const Tensor f_cpu = Tensor::from_vector(f, {n32});
  struct Case {
    const Tensor* src;
    DType to;
  };
  for (Case c : {Case{&f_cpu, DType::bf16}, Case{&f_cpu, DType::f16}, Case{&bf_cpu, DType::f32},
                 Case{&bf_cpu, DType::f16}, Case{&h_cpu, DType::f32}, Case{&h_cpu, DType::bf16}}) {
    for (bool aligned : {true, false}) {
      INFO("cast " << c.src->dtype() << " -> " << c.to << " aligned " << aligned);
      Tensor ref = Tensor::empty(c.src->shape(), c.to);
      ops::cast(*c.src, ref);
      Tensor src = aligned ? c.src->to(gpu()) : misaligned(c.src->to(gpu()));
      Tensor out = poisoned(c.src->shape(), c.to, gpu());
      ops::cast(src, out);
      CHECK(same_bits(out, ref));
    }
  }
  // The CPU cast is the slime types' conversion (so the GPU's is too).
  Tensor ref = Tensor::empty({n32}, DType::bf16);
  ops::cast(f_cpu, ref);
  int64_t differ = 0;
  for (int64_t j = 0; j < n32; ++j) differ += ref.data<BFloat16>()[j].bits != BFloat16(f[std::size_t(j)]).bits;
  CHECK(differ == 0);
}
