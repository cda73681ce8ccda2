// The grouped GEMM on the GPU against the CPU reference (ops::cpu templates in
// double precision, from the same already-rounded inputs) on fresh random
// inputs: ragged groups with odd row counts and empty groups, all rows in one
// group, E = 1, 8, 128 and 300 (more experts than a CTA has threads, so the
// tile search scans in chunks), (K, Nout) in {(2048, 768), (768, 2048),
// (64, 72), (40, 24)} on the tensor-core kernel (every tile configuration and
// the dispatcher's choice) and (37, 21) and f32 inputs on the fallback;
// bf16 and f32 outputs, accumulate on and off, outputs poisoned with 0xff
// (NaN) first; bitwise run-to-run determinism; no allocation in steady state.
// Every case also runs the cuBLAS backend (host offsets given: grouped
// cublasGemmGroupedBatchedEx for same-dtype outputs, per-expert cublasGemmEx
// for f32 outputs of bf16 inputs and for dw) with the same checks, plus: the
// backend knobs (explicit, process-wide; cublas forced without host offsets
// fetches them), bad host offsets, more experts than the pointer ring's first
// capacity (it grows), and no allocation in steady state.
//
// Tolerances, as ‖gpu − ref‖ / ‖ref‖:
//   bf16 outputs: 1e-2. Rounding the exact result once to bf16 is off by at
//     most 2^-9 = 1.95e-3 relative per element (~1.1e-3 rms); the fp32 sums
//     add ~1e-6. 1e-2 leaves margin; any indexing or fragment-layout error
//     gives O(1).
//   f32 outputs: 1e-4 (tighter than the 2e-3 the issue allows). bf16 products
//     are exact in fp32 and the tensor cores and the fallback sum in fp32: the
//     error of a sum of K <= 2048 terms is ~sqrt(K) · 2^-24 ≈ 3e-6 relative
//     (the f32-input fallback likewise); 1e-4 covers the tensor cores'
//     non-IEEE accumulation rounding with margin.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "slime/core/memory.hpp"
#include "slime/core/random.hpp"
#include "slime/ops/cuda/grouped_gemm.hpp"
#include "slime/ops/grouped_gemm.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
using ops::cuda::GroupedGemmPass;
using ops::cuda::GroupedGemmTile;

namespace {

constexpr double kTolBf16 = 1e-2;
constexpr double kTolF32 = 1e-4;

double tolerance(DType out) { return out == DType::bf16 ? kTolBf16 : kTolF32; }

Tensor random_on(const Shape& shape, DType dt, Device d, uint64_t seed, const Stream& s) {
  Tensor t = Tensor::empty(shape, dt, d, s);
  fill_normal(t, seed, 0, 0.f, 1.f, s);
  return t;
}

std::vector<double> to_double(const Tensor& t, const Stream& s) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  if (t.dtype() == DType::f32) {
    const auto v = t.to_vector<float>(s);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = v[i];
  } else {
    const auto v = t.to_vector<BFloat16>(s);
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = double(float(v[i]));
  }
  return out;
}

void check_against(const Tensor& got, const std::vector<double>& want, const Stream& s, const std::string& what) {
  const std::vector<double> g = to_double(got, s);
  REQUIRE(g.size() == want.size());
  int64_t non_finite = 0;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i])) {
      ++non_finite;
      continue;
    }
    num += (g[i] - want[i]) * (g[i] - want[i]);
    den += want[i] * want[i];
  }
  const double rel = den == 0 ? std::sqrt(num) : std::sqrt(num / den);
  INFO(what << ": relative error " << rel << ", " << non_finite << " non-finite of " << g.size());
  CHECK(non_finite == 0);
  CHECK(rel <= tolerance(got.dtype()));
}

std::vector<int32_t> offsets_of(const std::vector<int32_t>& sizes) {
  std::vector<int32_t> o(sizes.size() + 1, 0);
  for (std::size_t e = 0; e < sizes.size(); ++e) o[e + 1] = o[e] + sizes[e];
  return o;
}

// Group sizes in [0, max_rows], about a quarter of them empty.
std::vector<int32_t> random_sizes(int64_t experts, int max_rows, uint64_t seed) {
  std::vector<int32_t> s(std::size_t(experts), 0);
  for (int64_t e = 0; e < experts; ++e) {
    const uint64_t r = philox_word(seed, uint64_t(e));
    s[std::size_t(e)] = r % 4 == 0 ? 0 : int32_t((r >> 8) % uint64_t(max_rows + 1));
  }
  return s;
}

struct Case {
  std::string name;
  std::vector<int32_t> sizes;
  int64_t in_f, out_f;
  DType in_dtype = DType::bf16;
  bool hopper_only = false;  // only the sm90 tiles (small enough for compute-sanitizer)
};

// One pass on the GPU: through the Tensor API for `automatic` (the cuBLAS
// backend when `host` holds the host offsets), else through the CUDA API with
// the tile forced.
void run_pass(GroupedGemmPass pass, GroupedGemmTile tile, const Tensor& a, const Tensor& b, const Tensor& c,
              const Tensor& offsets, int64_t in_f, int64_t out_f, bool accumulate, const Stream& s,
              std::span<const int32_t> host = {}) {
  if (tile == GroupedGemmTile::automatic) {
    switch (pass) {
      case GroupedGemmPass::forward:
        return ops::grouped_gemm_forward(a, b, offsets, c, s, host);
      case GroupedGemmPass::backward_input:
        return ops::grouped_gemm_backward_input(a, b, offsets, c, accumulate, s, host);
      case GroupedGemmPass::backward_weight:
        return ops::grouped_gemm_backward_weight(a, b, offsets, c, s, host);
    }
  }
  ops::cuda::GroupedGemmParams p;
  p.pass = pass;
  p.a = a.data_ptr();
  p.b = b.data_ptr();
  p.c = c.data_ptr();
  p.offsets = offsets.data<int32_t>();
  p.in_dtype = a.dtype();
  p.out_dtype = c.dtype();
  p.experts = offsets.numel() - 1;
  p.rows = a.size(0);
  p.out_features = out_f;
  p.in_features = in_f;
  p.accumulate = accumulate;
  p.tile = tile;
  DeviceGuard guard(c.device());
  ops::cuda::grouped_gemm(p, s.handle());
}

void check_case(const Case& c, uint64_t seed) {
  const Device d = Device::cuda(0);
  const Stream s = Stream::create(d);
  const int64_t E = int64_t(c.sizes.size()), K = c.in_f, No = c.out_f;
  const std::vector<int32_t> off = offsets_of(c.sizes);
  const int64_t N = off.back();
  INFO("case " << c.name << ": E=" << E << " rows=" << N << " K=" << K << " Nout=" << No << " in "
               << dtype_name(c.in_dtype));
  const Tensor offsets = Tensor::from_vector(off, {E + 1}, d, s);
  const Tensor x = random_on({N, K}, c.in_dtype, d, seed, s), w = random_on({E, No, K}, c.in_dtype, d, seed + 1, s),
               dy = random_on({N, No}, c.in_dtype, d, seed + 2, s);
  const std::vector<double> xd = to_double(x, s), wd = to_double(w, s), dyd = to_double(dy, s);
  std::vector<double> y_ref(std::size_t(N * No)), dx_ref(std::size_t(N * K)), dw_ref(std::size_t(E * No * K), 0.0);
  ops::cpu::grouped_gemm_forward(xd.data(), wd.data(), off.data(), E, No, K, y_ref.data());
  ops::cpu::grouped_gemm_backward_input(dyd.data(), wd.data(), off.data(), E, No, K, dx_ref.data());
  ops::cpu::grouped_gemm_backward_weight(dyd.data(), xd.data(), off.data(), E, No, K, dw_ref.data());

  std::vector<GroupedGemmTile> tiles = {GroupedGemmTile::automatic, GroupedGemmTile::simple};
  if (c.hopper_only) tiles.clear();
  ops::cuda::GroupedGemmParams probe;
  probe.in_dtype = c.in_dtype;
  probe.out_features = No;
  probe.in_features = K;
  probe.a = x.data_ptr();
  probe.b = w.data_ptr();
  probe.c = dy.data_ptr();
  probe.offsets = offsets.data<int32_t>();  // device offsets: null would mean one implicit group
  const bool tensor_cores = ops::cuda::grouped_gemm_tile_for(probe) != GroupedGemmTile::simple;
  if (tensor_cores) {
    for (GroupedGemmTile t : ops::cuda::kGroupedGemmTiles) {
      const bool hopper = ops::cuda::grouped_gemm_tile_is_sm90(t);
      if (ops::cuda::grouped_gemm_tile_supported(t) && (hopper || !c.hopper_only)) tiles.push_back(t);
    }
  } else {
    // A tensor-core tile cannot be forced on inputs that need the fallback.
    Tensor y = Tensor::empty({N, No}, DType::f32, d, s);
    CHECK_THROWS_WITH(
        run_pass(GroupedGemmPass::forward, GroupedGemmTile::m128n128k32, x, w, y, offsets, K, No, false, s),
        ContainsSubstring("needs bf16 inputs, in and out features multiples of 8"));
  }

  std::vector<DType> outs = {DType::f32};
  if (c.in_dtype == DType::bf16) outs.push_back(DType::bf16);
  // The kernels (every tile), then the cuBLAS backend (automatic with host offsets).
  struct Variant {
    GroupedGemmTile tile;
    bool cublas;
  };
  std::vector<Variant> variants;
  for (GroupedGemmTile t : tiles) variants.push_back({t, false});
  if (!c.hopper_only) variants.push_back({GroupedGemmTile::automatic, true});
  struct RestoreBackend {
    ~RestoreBackend() { ops::cuda::set_grouped_gemm_backend(ops::cuda::GroupedGemmBackend::automatic); }
  } restore_backend;
  for (const Variant& v : variants) {
    const GroupedGemmTile tile = v.tile;
    const std::span<const int32_t> host = v.cublas ? std::span<const int32_t>(off) : std::span<const int32_t>();
    // The cuBLAS variant forces the backend: with host offsets alone the
    // Hopper kernels would run where they take the inputs.
    ops::cuda::set_grouped_gemm_backend(v.cublas ? ops::cuda::GroupedGemmBackend::cublas
                                                 : ops::cuda::GroupedGemmBackend::automatic);
    for (DType out : outs) {
      INFO((v.cublas ? "cuBLAS backend" : "kernel") << ", tile " << ops::cuda::grouped_gemm_tile_name(tile) << " (runs "
                                                    << ops::cuda::grouped_gemm_tile_name([&] {
                                                         ops::cuda::GroupedGemmParams q = probe;
                                                         q.tile = tile;
                                                         return ops::cuda::grouped_gemm_tile_for(q);
                                                       }())
                                                    << "), out " << dtype_name(out));
      {  // the backend the Tensor API picks
        ops::cuda::GroupedGemmParams q = probe;
        q.tile = tile;
        q.host_offsets = v.cublas ? off.data() : nullptr;
        CHECK(ops::cuda::grouped_gemm_backend_for(q) ==
              (v.cublas ? ops::cuda::GroupedGemmBackend::cublas : ops::cuda::GroupedGemmBackend::kernel));
      }
      Tensor y = Tensor::empty({N, No}, out, d, s);
      y.fill_bytes_(0xff, s);
      run_pass(GroupedGemmPass::forward, tile, x, w, y, offsets, K, No, false, s, host);
      check_against(y, y_ref, s, "y");
      if (ops::cuda::grouped_gemm_tile_forward_only(tile)) {  // the 64-row Hopper tiles refuse the backward passes
        Tensor dx = Tensor::empty({N, K}, out, d, s);
        CHECK_THROWS_WITH(run_pass(GroupedGemmPass::backward_input, tile, dy, w, dx, offsets, K, No, false, s, host),
                          ContainsSubstring("runs the forward pass only"));
        continue;
      }

      Tensor dx = Tensor::empty({N, K}, out, d, s);
      dx.fill_bytes_(0xff, s);
      run_pass(GroupedGemmPass::backward_input, tile, dy, w, dx, offsets, K, No, false, s, host);
      check_against(dx, dx_ref, s, "dx");

      Tensor dx_acc = random_on({N, K}, out, d, seed + 3, s);
      std::vector<double> dx_acc_ref = to_double(dx_acc, s);
      for (std::size_t i = 0; i < dx_acc_ref.size(); ++i) dx_acc_ref[i] += dx_ref[i];
      run_pass(GroupedGemmPass::backward_input, tile, dy, w, dx_acc, offsets, K, No, true, s, host);
      check_against(dx_acc, dx_acc_ref, s, "dx (accumulate)");

      if (out != DType::f32) continue;  // dw is always f32
      // dw += on top of random values; experts with no rows keep theirs.
      Tensor dw = random_on({E, No, K}, DType::f32, d, seed + 4, s);
      const Tensor dw0 = dw.clone(s);
      std::vector<double> dw_acc_ref = to_double(dw, s);
      for (std::size_t i = 0; i < dw_acc_ref.size(); ++i) dw_acc_ref[i] += dw_ref[i];
      run_pass(GroupedGemmPass::backward_weight, tile, dy, x, dw, offsets, K, No, false, s, host);
      check_against(dw, dw_acc_ref, s, "dw (accumulate)");

      // Bitwise run to run: the same sums from the same start.
      Tensor dw2 = dw0.clone(s);
      run_pass(GroupedGemmPass::backward_weight, tile, dy, x, dw2, offsets, K, No, false, s, host);
      const auto v1 = dw.to_vector<float>(s), v2 = dw2.to_vector<float>(s);
      CHECK(std::memcmp(v1.data(), v2.data(), v1.size() * sizeof(float)) == 0);
    }
  }
}

}  // namespace

TEST_CASE("grouped GEMM on the GPU matches the CPU reference on the Qwen3-30B-A3B projections",
          "[ops][moe][gemm][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  // gate/up (2048 -> 768) and down (768 -> 2048) with ragged odd groups; the
  // 255- and 300-row groups span several m-tiles, 768 and 2048 several n-tiles.
  check_case({"gate_up", {37, 0, 129, 1, 0, 64, 255, 17}, 2048, 768}, 100);
  check_case({"down", {128, 0, 0, 300, 5, 1, 77, 0}, 768, 2048}, 200);
}

TEST_CASE("grouped GEMM on the GPU matches the CPU reference on small and odd shapes", "[ops][moe][gemm][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  // Feature counts that are not multiples of the tiles (K 40: a partial
  // k-step; Nout 72 / 24: partial n-tiles), many experts with empty groups.
  check_case({"E128 64x72", random_sizes(128, 40, 11), 64, 72}, 300);
  check_case({"E128 40x24", random_sizes(128, 33, 12), 40, 24}, 400);
  // More experts than threads per CTA: the tile search scans in chunks.
  check_case({"E300 64x72", random_sizes(300, 21, 13), 64, 72}, 500);
  check_case({"E1", {577}, 64, 72}, 600);
  check_case({"one group", {0, 0, 0, 1000, 0, 0, 0, 0}, 64, 72}, 700);
  check_case({"last group", {0, 0, 0, 0, 0, 0, 0, 333}, 40, 24}, 800);
  check_case({"single rows", {1, 1, 0, 1, 1, 1, 1, 1}, 2048, 768}, 900);
}

TEST_CASE("grouped GEMM Hopper kernels on ragged partial tiles", "[ops][moe][gemm][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  if (!ops::cuda::grouped_gemm_tile_supported(GroupedGemmTile::sm90_m128n256))
    SKIP("needs a compute capability 9.0 GPU and an sm_90a build");
  // Groups that end at every residue of the 64-row k-step (wgrad's zeroed
  // tail) and of the 128-row m-tile (forward / dgrad store partial tiles from
  // registers, full ones through TMA); K 136 and Nout 200: partial k-steps and
  // n-tiles inside the 3-D weight map; Nout 384: a full and a partial 256
  // tile. Small enough for compute-sanitizer (tools/gpu-test.sh).
  check_case({"hopper ragged", {1, 63, 64, 65, 0, 127, 128, 129, 300}, 256, 384, DType::bf16, true}, 1600);
  check_case({"hopper tails", {200, 5, 0, 77}, 136, 200, DType::bf16, true}, 1700);
}

TEST_CASE("grouped GEMM on the GPU falls back for odd features and f32 inputs", "[ops][moe][gemm][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  check_case({"K37 Nout21", {17, 0, 127, 3, 0, 1, 40, 9}, 37, 21}, 1000);
  check_case({"f32 inputs", {17, 0, 127, 3, 0, 1, 40, 9}, 64, 72, DType::f32}, 1100);
  check_case({"f32 E128", random_sizes(128, 12, 14), 40, 24, DType::f32}, 1200);
}

TEST_CASE("grouped GEMM on the GPU with no rows writes nothing and keeps dw", "[ops][moe][gemm][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  check_case({"all empty", {0, 0, 0, 0}, 64, 72}, 1300);
}

TEST_CASE("grouped GEMM cuBLAS backend groups equal sizes and grows its pointer ring", "[ops][moe][gemm][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  // Uniform routing: every expert in one cuBLAS group.
  check_case({"uniform E32", std::vector<int32_t>(32, 40), 256, 128}, 1400);
  // 700 experts with rows: more problems than the ring's first capacity (256).
  std::vector<int32_t> many(700);
  for (std::size_t e = 0; e < many.size(); ++e) many[e] = int32_t(1 + philox_word(15, e) % 3);
  check_case({"E700 all non-empty", many, 64, 72}, 1500);
}

TEST_CASE("grouped GEMM backend knobs pick the kernels or cuBLAS", "[ops][moe][gemm][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  using ops::cuda::GroupedGemmBackend;
  struct Restore {
    ~Restore() { ops::cuda::set_grouped_gemm_backend(GroupedGemmBackend::automatic); }
  } restore;
  ops::cuda::set_grouped_gemm_backend(GroupedGemmBackend::automatic);
  const Device d = Device::cuda(0);
  const Stream s = Stream::create(d);
  const std::vector<int32_t> off = offsets_of({37, 0, 129, 1, 0, 64, 255, 17});
  const int64_t E = 8, N = off.back(), K = 256, No = 128;
  const Tensor offsets = Tensor::from_vector(off, {E + 1}, d, s);
  const Tensor x = random_on({N, K}, DType::bf16, d, 31, s), w = random_on({E, No, K}, DType::bf16, d, 32, s);
  auto forward = [&](std::span<const int32_t> host) {
    Tensor y = Tensor::empty({N, No}, DType::bf16, d, s);
    y.fill_bytes_(0xff, s);
    ops::grouped_gemm_forward(x, w, offsets, y, s, host);
    return y.to_vector<BFloat16>(s);
  };
  auto same_bits = [](const std::vector<BFloat16>& a, const std::vector<BFloat16>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(BFloat16)) == 0;
  };
  // Host offsets choose cuBLAS, except where the Hopper kernels run (faster).
  const bool hopper = ops::cuda::grouped_gemm_hopper_kernels();
  const GroupedGemmBackend with_host = hopper ? GroupedGemmBackend::kernel : GroupedGemmBackend::cublas;
  auto forward_cublas = [&](std::span<const int32_t> host) {
    ops::cuda::set_grouped_gemm_backend(GroupedGemmBackend::cublas);
    std::vector<BFloat16> y = forward(host);
    ops::cuda::set_grouped_gemm_backend(GroupedGemmBackend::automatic);
    return y;
  };
  const int64_t fallbacks = ops::cuda::grouped_gemm_cublas_fallbacks();
  const std::vector<BFloat16> y_kernel = forward({}), y_cublas = forward_cublas(off);
  CHECK(same_bits(forward(off), hopper ? y_kernel : y_cublas));
  // bf16 -> bf16 is one of cublasGemmGroupedBatchedEx's type combinations
  // (no fallback to the loop); the backend's other form, the per-expert loop.
  CHECK(ops::cuda::grouped_gemm_cublas_fallbacks() == fallbacks);
  ops::cuda::set_grouped_gemm_cublas_grouped_api(false);
  const std::vector<BFloat16> y_grouped = forward_cublas(off);  // (the loop's result)
  ops::cuda::set_grouped_gemm_cublas_grouped_api(true);
  {  // the backends agree to bf16 rounding
    std::vector<double> want(y_kernel.size());
    for (std::size_t i = 0; i < want.size(); ++i) want[i] = double(float(y_kernel[i]));
    check_against(Tensor::from_vector(y_cublas, {N, No}, d, s), want, s, "cuBLAS grouped vs kernel");
    check_against(Tensor::from_vector(y_grouped, {N, No}, d, s), want, s, "cuBLAS loop vs kernel");
  }

  ops::cuda::GroupedGemmParams q;
  q.experts = E, q.rows = N, q.in_features = K, q.out_features = No;
  q.offsets = offsets.data<int32_t>();
  CHECK(ops::cuda::grouped_gemm_backend() == GroupedGemmBackend::automatic);
  CHECK(ops::cuda::grouped_gemm_backend_for(q) == GroupedGemmBackend::kernel);
  q.host_offsets = off.data();
  CHECK(ops::cuda::grouped_gemm_backend_for(q) == with_host);
  CHECK(ops::grouped_gemm_wants_host_offsets(d) == !hopper);
  q.backend = GroupedGemmBackend::kernel;  // explicit per call
  CHECK(ops::cuda::grouped_gemm_backend_for(q) == GroupedGemmBackend::kernel);
  q.backend = GroupedGemmBackend::automatic;
  q.tile = GroupedGemmTile::m128n128k32;  // a forced tile is the kernels
  CHECK(ops::cuda::grouped_gemm_backend_for(q) == GroupedGemmBackend::kernel);
  q.tile = GroupedGemmTile::automatic;

  // Process-wide kernel: host offsets are ignored, the kernel's bits.
  ops::cuda::set_grouped_gemm_backend(GroupedGemmBackend::kernel);
  CHECK(ops::cuda::grouped_gemm_backend_for(q) == GroupedGemmBackend::kernel);
  CHECK(same_bits(forward(off), y_kernel));
  // Process-wide cublas without host offsets: fetched from the device, cuBLAS's bits.
  ops::cuda::set_grouped_gemm_backend(GroupedGemmBackend::cublas);
  q.host_offsets = nullptr;
  CHECK(ops::cuda::grouped_gemm_backend_for(q) == GroupedGemmBackend::cublas);
  q.backend = GroupedGemmBackend::kernel;  // explicit beats process-wide
  CHECK(ops::cuda::grouped_gemm_backend_for(q) == GroupedGemmBackend::kernel);
  CHECK(same_bits(forward({}), y_cublas));
  ops::cuda::set_grouped_gemm_backend(GroupedGemmBackend::automatic);
  CHECK(std::string(ops::cuda::grouped_gemm_backend_name(GroupedGemmBackend::cublas)) == "cublas");
  CHECK(std::string(ops::cuda::grouped_gemm_backend_name(GroupedGemmBackend::kernel)) == "kernel");
}

TEST_CASE("grouped GEMM rejects bad host offsets", "[ops][moe][gemm][gpu]") {
  // The CPU part needs no GPU: host offsets must equal the CPU offsets, and
  // change nothing there.
  {
    const Device c = Device::cpu();
    const std::vector<int32_t> off = {0, 3, 3, 8};
    const Tensor offsets = Tensor::from_vector(off, {4}, c);
    Tensor x = Tensor::empty({8, 5}, DType::f32, c), w = Tensor::empty({3, 4, 5}, DType::f32, c);
    fill_normal(x, 41, 0, 0.f, 1.f);
    fill_normal(w, 42, 0, 0.f, 1.f);
    Tensor y1 = Tensor::empty({8, 4}, DType::f32, c), y2 = Tensor::empty({8, 4}, DType::f32, c);
    ops::grouped_gemm_forward(x, w, offsets, y1);
    ops::grouped_gemm_forward(x, w, offsets, y2, {}, off);
    const auto v1 = y1.to_vector<float>(), v2 = y2.to_vector<float>();
    CHECK(std::memcmp(v1.data(), v2.data(), v1.size() * sizeof(float)) == 0);
    const std::vector<int32_t> other = {0, 2, 3, 8};
    CHECK_THROWS_WITH(ops::grouped_gemm_forward(x, w, offsets, y2, {}, other),
                      ContainsSubstring("host_offsets[1] = 2 differs from offsets[1] = 3"));
  }
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const Stream s = Stream::create(d);
  const std::vector<int32_t> off = {0, 3, 3, 8};
  const Tensor offsets = Tensor::from_vector(off, {4}, d, s);
  const Tensor x = random_on({8, 64}, DType::bf16, d, 43, s), w = random_on({3, 72, 64}, DType::bf16, d, 44, s),
               dy = random_on({8, 72}, DType::bf16, d, 45, s);
  Tensor y = Tensor::empty({8, 72}, DType::bf16, d, s), dx = Tensor::empty({8, 64}, DType::bf16, d, s);
  Tensor dw = Tensor::zeros({3, 72, 64}, DType::f32, d, s);
  const std::vector<int32_t> short_ = {0, 3, 8}, first = {1, 3, 3, 8}, decreasing = {0, 3, 2, 8}, last = {0, 3, 3, 7};
  CHECK_THROWS_WITH(ops::grouped_gemm_forward(x, w, offsets, y, s, short_),
                    ContainsSubstring("host_offsets must have experts + 1 = 4 entries, got 3"));
  CHECK_THROWS_WITH(ops::grouped_gemm_forward(x, w, offsets, y, s, first),
                    ContainsSubstring("host_offsets[0] = 1, expected 0"));
  CHECK_THROWS_WITH(ops::grouped_gemm_backward_input(dy, w, offsets, dx, false, s, decreasing),
                    ContainsSubstring("host_offsets must be non-decreasing"));
  CHECK_THROWS_WITH(ops::grouped_gemm_backward_weight(dy, x, offsets, dw, s, last),
                    ContainsSubstring("host_offsets[3] = 7, expected the row count 8"));
  // The CUDA API checks them too.
  ops::cuda::GroupedGemmParams p;
  p.a = x.data_ptr(), p.b = w.data_ptr(), p.c = y.data_ptr(), p.offsets = offsets.data<int32_t>();
  p.experts = 3, p.rows = 8, p.in_features = 64, p.out_features = 72;
  p.host_offsets = decreasing.data();
  DeviceGuard guard(d);
  CHECK_THROWS_WITH(ops::cuda::grouped_gemm(p, s.handle()), ContainsSubstring("host offsets must be non-decreasing"));
}

TEST_CASE("grouped GEMM on the GPU allocates nothing in steady state", "[ops][moe][gemm][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const Stream s = Stream::create(d);
  const std::vector<int32_t> off = offsets_of({100, 0, 28, 256});
  const int64_t E = 4, N = off.back(), K = 256, No = 128;
  const Tensor offsets = Tensor::from_vector(off, {E + 1}, d, s);
  Tensor x = random_on({N, K}, DType::bf16, d, 21, s), w = random_on({E, No, K}, DType::bf16, d, 22, s),
         dy = random_on({N, No}, DType::bf16, d, 23, s);
  Tensor y = Tensor::empty({N, No}, DType::bf16, d, s), dx = Tensor::empty({N, K}, DType::bf16, d, s);
  Tensor dw = Tensor::zeros({E, No, K}, DType::f32, d, s);
  Tensor dx32 = Tensor::empty({N, K}, DType::f32, d, s);
  // First calls of the cuBLAS backend create its handles and pointer ring.
  ops::grouped_gemm_forward(x, w, offsets, y, s);
  ops::grouped_gemm_forward(x, w, offsets, y, s, off);
  ops::grouped_gemm_backward_input(dy, w, offsets, dx32, false, s, off);
  ops::grouped_gemm_backward_weight(dy, x, offsets, dw, s, off);
  s.synchronize();
  const int64_t allocations = memory_stats(d).allocations;
  // More grouped calls than the ring has slots: slots are reused.
  for (int i = 0; i < ops::cuda::kGroupedGemmPointerSlots + 5; ++i) {
    const std::span<const int32_t> host = i % 2 == 0 ? std::span<const int32_t>() : std::span<const int32_t>(off);
    ops::grouped_gemm_forward(x, w, offsets, y, s, host);
    ops::grouped_gemm_backward_input(dy, w, offsets, dx, i % 3 == 1, s, host);
    ops::grouped_gemm_backward_input(dy, w, offsets, dx32, i % 3 == 2, s, host);
    ops::grouped_gemm_backward_weight(dy, x, offsets, dw, s, host);
  }
  s.synchronize();
  CHECK(memory_stats(d).allocations == allocations);
}
