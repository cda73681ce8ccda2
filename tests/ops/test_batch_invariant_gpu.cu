// The batch-invariant mode on the GPU (slime/ops/batch_invariant.hpp, issue
// 20): in the mode, a row's result must not depend on the other rows of the
// call. Every case computes a batch of rows once, then sub-batches of it
// (1, 7, 64, 129 rows at several offsets) and requires the same bits row for
// row; and the mode's kernels must still be right (against the CPU
// reference, tolerances as in test_linear_gpu / test_grouped_gemm_gpu).
//
// Also the grouped GEMM's plain-GEMM form under the mode: null offsets (one
// group of all rows) equal an explicit single group bit for bit (for K <= 256,
// one K chunk: longer K sums in chunks on Hopper), a row pitch
// (ldc) larger than the row leaves the padding untouched, alpha scales the
// stored result, and bad combinations throw.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "slime/core/memory.hpp"
#include "slime/core/random.hpp"
#include "slime/ops/batch_invariant.hpp"
#include "slime/ops/cuda/grouped_gemm.hpp"
#include "slime/ops/grouped_gemm.hpp"
#include "slime/ops/linear.hpp"
#include "slime/ops/token_logprobs.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
using ops::cuda::GroupedGemmPass;

namespace {

Tensor random_on(const Shape& shape, DType dt, Device d, uint64_t seed, const Stream& s, float stddev = 1.f) {
  Tensor t = Tensor::empty(shape, dt, d, s);
  fill_normal(t, seed, 0, 0.f, stddev, s);
  return t;
}

std::vector<unsigned char> bytes_of(const Tensor& t, const Stream& s) {
  const Tensor h = t.to(Device::cpu(), s);
  const auto* p = static_cast<const unsigned char*>(h.data_ptr());
  return std::vector<unsigned char>(p, p + h.nbytes());
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

// ‖got − want‖ / ‖want‖, and whether every element of got is finite.
double relative_error(const std::vector<double>& got, const std::vector<double>& want, bool& finite) {
  double num = 0, den = 0;
  finite = true;
  for (std::size_t i = 0; i < got.size(); ++i) {
    finite = finite && std::isfinite(got[i]);
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Sub-batches [offset, offset + rows) of a 300-row batch.
struct Slice {
  int64_t offset, rows;
};
constexpr int64_t kRows = 300;
constexpr Slice kSlices[] = {{0, 1}, {299, 1}, {5, 7}, {37, 64}, {100, 129}, {0, 300}};

}  // namespace

TEST_CASE("batch-invariant mode: a Linear row's output does not depend on the batch", "[ops][linear][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const Stream s = Stream::create(d);
  ops::BatchInvariantScope mode;
  // (K, N): tensor-core shapes (the n128 and n256 tiles), and odd ones (the fallback).
  const int64_t kn[][2] = {{128, 384}, {1024, 2048}, {2048, 768}, {200, 300}, {33, 7}};
  uint64_t seed = 7000;
  for (const auto& e : kn) {
    for (DType out_dt : {DType::bf16, DType::f32}) {
      const int64_t K = e[0], N = e[1];
      INFO("K=" << K << " N=" << N << " out " << dtype_name(out_dt));
      seed += 10;
      const Tensor x = random_on({kRows, K}, DType::bf16, d, seed, s),
                   w = random_on({N, K}, DType::bf16, d, seed + 1, s);
      Tensor full = Tensor::empty({kRows, N}, out_dt, d, s);
      full.fill_bytes_(0xff, s);
      ops::linear_forward(x, w, full, s);
      // Right, against the CPU reference.
      const auto xd = to_double(x, s), wd = to_double(w, s);
      std::vector<double> ref(std::size_t(kRows * N));
      ops::cpu::linear_forward(xd.data(), wd.data(), kRows, K, N, ref.data());
      bool finite = false;
      const double rel = relative_error(to_double(full, s), ref, finite);
      CHECK(finite);
      CHECK(rel <= (out_dt == DType::bf16 ? 5e-3 : 1e-4));
      // Invariant: every sub-batch gives the full batch's bytes.
      const auto want = bytes_of(full, s);
      const std::size_t row_bytes = std::size_t(N) * dtype_size(out_dt);
      for (const Slice& sl : kSlices) {
        INFO("rows [" << sl.offset << ", " << sl.offset + sl.rows << ")");
        Tensor part = Tensor::empty({sl.rows, N}, out_dt, d, s);
        part.fill_bytes_(0xff, s);
        ops::linear_forward(x.slice_rows(sl.offset, sl.rows), w, part, s);
        const auto got = bytes_of(part, s);
        CHECK(std::memcmp(got.data(), want.data() + std::size_t(sl.offset) * row_bytes, got.size()) == 0);
      }
    }
  }
}

TEST_CASE("batch-invariant mode: a token's logprob, entropy and lse do not depend on the batch",
          "[ops][token_logprobs][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const Stream s = Stream::create(d);
  ops::BatchInvariantScope mode;
  const int64_t dim = 128;
  // vocab 1000: tensor cores; 300: logits rows of 300 floats in a pitch of 304 (the fallback kernel).
  for (int64_t vocab : {1000, 300}) {
    for (float temperature : {1.f, 0.7f}) {
      INFO("vocab " << vocab << " temperature " << temperature);
      const Tensor h = random_on({kRows, dim}, DType::bf16, d, uint64_t(vocab), s);
      const Tensor w = random_on({vocab, dim}, DType::bf16, d, uint64_t(vocab) + 1, s, 0.3f);
      std::vector<int32_t> t(static_cast<std::size_t>(kRows));
      for (int64_t i = 0; i < kRows; ++i) t[std::size_t(i)] = int32_t((i * 7919) % vocab);
      const Tensor targets = Tensor::from_vector(t, {kRows}, d, s);
      const ops::TokenLogprobs full = ops::token_logprobs(h, w, targets, temperature, s);
      // Right, against the CPU reference (fp32 sums; the GPU's logits differ by rounding).
      const ops::TokenLogprobs cpu = ops::token_logprobs(h.to(Device::cpu(), s), w.to(Device::cpu(), s),
                                                         targets.to(Device::cpu(), s), temperature);
      bool finite = false;
      CHECK(relative_error(to_double(full.logprobs, s), to_double(cpu.logprobs, s), finite) <= 1e-4);
      CHECK(finite);
      const auto lp = bytes_of(full.logprobs, s), en = bytes_of(full.entropy, s), lse = bytes_of(full.lse, s);
      for (const Slice& sl : kSlices) {
        INFO("rows [" << sl.offset << ", " << sl.offset + sl.rows << ")");
        const ops::TokenLogprobs part = ops::token_logprobs(h.slice_rows(sl.offset, sl.rows), w,
                                                            targets.slice_rows(sl.offset, sl.rows), temperature, s);
        const std::size_t at = std::size_t(sl.offset) * 4, n = std::size_t(sl.rows) * 4;
        CHECK(std::memcmp(bytes_of(part.logprobs, s).data(), lp.data() + at, n) == 0);
        CHECK(std::memcmp(bytes_of(part.entropy, s).data(), en.data() + at, n) == 0);
        CHECK(std::memcmp(bytes_of(part.lse, s).data(), lse.data() + at, n) == 0);
      }
    }
  }
}

TEST_CASE("batch-invariant mode: MoE expert rows do not depend on the group sizes", "[ops][moe][gemm][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const Stream s = Stream::create(d);
  ops::BatchInvariantScope mode;
  const int64_t E = 8, K = 256, N = 512;
  // Row r of the big batch belongs to expert r % E (sorted by expert below);
  // the small batch holds one or two rows of some experts and none of others.
  const int64_t rows = 600;
  const Tensor w = random_on({E, N, K}, DType::bf16, d, 91, s);
  const Tensor x = random_on({rows, K}, DType::bf16, d, 92, s);
  std::vector<int32_t> offsets(std::size_t(E + 1));
  for (int64_t e = 0; e <= E; ++e) offsets[std::size_t(e)] = int32_t(e * rows / E);
  const Tensor off = Tensor::from_vector(offsets, {E + 1}, d, s);
  Tensor full = Tensor::empty({rows, N}, DType::bf16, d, s);
  full.fill_bytes_(0xff, s);
  // With host offsets too: outside the mode they may select cuBLAS.
  ops::grouped_gemm_forward(x, w, off, full, s, offsets);
  const auto want = bytes_of(full, s);
  // The small batch: rows {first row of expert 1, two rows of expert 4, last row of expert 7}.
  const int64_t picks[] = {offsets[1], offsets[4] + 3, offsets[4] + 10, offsets[8] - 1};
  const int32_t small_offsets[] = {0, 0, 1, 1, 1, 3, 3, 3, 4};
  std::vector<int32_t> so(std::begin(small_offsets), std::end(small_offsets));
  Tensor xs = Tensor::empty({4, K}, DType::bf16, d, s);
  for (int i = 0; i < 4; ++i) xs.slice_rows(i, 1).copy_from(x.slice_rows(picks[i], 1), s);
  Tensor ys = Tensor::empty({4, N}, DType::bf16, d, s);
  ys.fill_bytes_(0xff, s);
  ops::grouped_gemm_forward(xs, w, Tensor::from_vector(so, {E + 1}, d, s), ys, s, so);
  const auto got = bytes_of(ys, s);
  const std::size_t row_bytes = std::size_t(N) * 2;
  for (int i = 0; i < 4; ++i) {
    INFO("row " << picks[i]);
    CHECK(std::memcmp(got.data() + std::size_t(i) * row_bytes, want.data() + std::size_t(picks[i]) * row_bytes,
                      row_bytes) == 0);
  }
  ops::cuda::GroupedGemmParams p;
  p.offsets = off.data<int32_t>();
  p.host_offsets = offsets.data();
  p.experts = E;
  p.rows = rows;
  CHECK(ops::cuda::grouped_gemm_backend_for(p) == ops::cuda::GroupedGemmBackend::kernel);
}

TEST_CASE("a plain GEMM on Hopper: tile width and K split leave the bits unchanged", "[ops][gemm][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  if (!ops::cuda::grouped_gemm_tile_supported(ops::cuda::GroupedGemmTile::sm90_m128n128))
    SKIP("the Hopper tiles need an sm_90a build on a compute capability 9.0 GPU");
  using ops::cuda::GroupedGemmTile;
  const Device d = Device::cuda(0);
  const Stream s = Stream::create(d);
  // SLIME_GEMM_K_CHUNKS=1 (opt-in, grouped_gemm_sm90.cu) sums K in chunks
  // of 256 and splits K for few rows; by default one accumulator, n256
  // allowed. The bits must agree among the calls either way (run both).
  const char* chunks_env = std::getenv("SLIME_GEMM_K_CHUNKS");
  const bool chunks = chunks_env != nullptr && std::string(chunks_env) == "1";
  // The automatic choice: for few rows the 64-row n16 tile (with K chunks:
  // its chunks side by side), n128 once its tiles cover the SMs (n256 only
  // without K chunks).
  {
    ops::cuda::GroupedGemmParams q;
    q.experts = 1;
    q.out_features = 1024;
    q.in_features = 1024;
    q.rows = 1;
    if (std::getenv("SLIME_GEMM_PLAIN_TILE") == nullptr)
      CHECK(ops::cuda::grouped_gemm_tile_for(q) == GroupedGemmTile::sm90_m64n16);
    q.rows = 128 * 4 * 1024;
    CHECK(ops::cuda::grouped_gemm_tile_for(q) ==
          (chunks ? GroupedGemmTile::sm90_m128n128 : GroupedGemmTile::sm90_m128n256));
    // With K chunks and SLIME_GEMM_CLUSTER_K=1 a few rows run the cluster K
    // split (unless a tile is forced): 1 row of 1024 x 1024, 4 chunks, 4 CTAs per cluster;
    // 2048 x 256 rows (8 chunks, 2 per CTA of a 4-CTA cluster on 132 SMs); never
    // past 256 rows or with a forced tile.
    const char* cluster_env = std::getenv("SLIME_GEMM_CLUSTER_K");
    const bool cluster = chunks && std::getenv("SLIME_GEMM_PLAIN_TILE") == nullptr && cluster_env != nullptr &&
                         std::string(cluster_env) == "1";
    q.rows = 1;
    CHECK(ops::cuda::grouped_gemm_sm90_cluster_k(q) == (cluster ? 4 : 0));
    q.in_features = 2048;
    q.rows = 256;
    CHECK((ops::cuda::grouped_gemm_sm90_cluster_k(q) >= 2) == cluster);
    q.rows = 257;
    CHECK(ops::cuda::grouped_gemm_sm90_cluster_k(q) == 0);
    q.rows = 1;
    q.tile = GroupedGemmTile::sm90_m64n16;
    CHECK(ops::cuda::grouped_gemm_sm90_cluster_k(q) == 0);
  }
  // Scratch for the K split's f32 partials (as Linear passes its cuBLAS
  // workspace); without it, or where the partials do not fit, the call runs
  // unsplit.
  const Tensor workspace = Tensor::empty({int64_t(8) << 20}, DType::f32, d, s);
  auto run = [&](const Tensor& x, const Tensor& w, DType out_dt, GroupedGemmTile tile, std::size_t ws_bytes = 0) {
    Tensor y = Tensor::empty({x.shape()[0], w.shape()[1]}, out_dt, d, s);
    y.fill_bytes_(0xff, s);
    ops::cuda::GroupedGemmParams p;
    p.a = x.data_ptr();
    p.b = w.data_ptr();
    p.c = y.data_ptr();
    p.out_dtype = out_dt;
    p.experts = 1;
    p.rows = x.shape()[0];
    p.out_features = w.shape()[1];
    p.in_features = w.shape()[2];
    p.tile = tile;
    p.workspace = ws_bytes > 0 ? workspace.data_ptr() : nullptr;
    p.workspace_bytes = ws_bytes;
    ops::cuda::grouped_gemm(p, s.handle());
    return y;
  };
  // The big batch: 2200 rows, so that N >= 1024 runs n128 unsplit; its first
  // rows again as 1, 7, 64 and 300 rows (the 64-row tiles; with K chunks n64
  // splits K where its tiles are few) and with each tile forced. (K, N): one K chunk (64), a partial last k-step and
  // chunk (1000), 8 chunks (2048); partial n tiles (200, 776).
  const int64_t kn[][2] = {{64, 256}, {1000, 768}, {2048, 1024}, {136, 200}, {512, 776}};
  constexpr int64_t kBig = 2200;
  uint64_t seed = 9100;
  for (const auto& e : kn) {
    const int64_t K = e[0], N = e[1];
    seed += 2;
    const Tensor x = random_on({kBig, K}, DType::bf16, d, seed, s);
    const Tensor w = random_on({1, N, K}, DType::bf16, d, seed + 1, s);
    for (DType out_dt : {DType::bf16, DType::f32}) {
      INFO("K=" << K << " N=" << N << " out " << dtype_name(out_dt));
      const Tensor big = run(x, w, out_dt, GroupedGemmTile::automatic);
      const auto want = bytes_of(big, s);
      const std::size_t row_bytes = std::size_t(N) * dtype_size(out_dt);
      {  // right, against the CPU reference, on the first 300 rows (every element written: finite)
        const Tensor head = x.slice_rows(0, 300);
        const auto xd = to_double(head, s), wd = to_double(w, s);
        std::vector<double> ref(std::size_t(300 * N));
        ops::cpu::linear_forward(xd.data(), wd.data(), 300, K, N, ref.data());
        bool finite = false;
        CHECK(relative_error(to_double(big.slice_rows(0, 300), s), ref, finite) <=
              (out_dt == DType::bf16 ? 5e-3 : 1e-4));
        CHECK(finite);
      }
      // The 64-row tiles: one accumulator, or with K chunks their chunks side
      // by side in one CTA (1000 and 2048 of K: 4 and 8 chunks over 4
      // warpgroups, a CTA's ordered sum handed on between them).
      const GroupedGemmTile tiles[] = {GroupedGemmTile::automatic,    GroupedGemmTile::sm90_m128n128,
                                       GroupedGemmTile::sm90_m128n64, GroupedGemmTile::sm90_m64n64,
                                       GroupedGemmTile::sm90_m64n32,  GroupedGemmTile::sm90_m64n16};
      // 1 to 256 rows, automatic: with the cluster K split on (K 1000:
      // 4 chunks; 2048: 8 chunks, 2 per CTA at 256 rows; partial n tiles at 200 and 776).
      for (int64_t rows : {1, 7, 64, 256, 300}) {
        for (GroupedGemmTile t : tiles) {
          // No workspace (unsplit), one too small for 2 chunks (unsplit), a full one (split where few tiles).
          for (std::size_t ws : {std::size_t(0), std::size_t(rows * N * 4), std::size_t(32) << 20}) {
            INFO(rows << " rows, tile " << ops::cuda::grouped_gemm_tile_name(t) << ", workspace " << ws << " bytes");
            const auto got = bytes_of(run(x.slice_rows(0, rows), w, out_dt, t, ws), s);
            CHECK(std::memcmp(got.data(), want.data(), std::size_t(rows) * row_bytes) == 0);
          }
        }
      }
    }
    // n256 keeps one accumulator set: it cannot chunk K, so a plain GEMM refuses it.
    if (chunks) {
      CHECK_THROWS_WITH(run(x.slice_rows(0, 7), w, DType::bf16, GroupedGemmTile::sm90_m128n256),
                        ContainsSubstring("runs the sm90_m128n128, sm90_m128n64 or a 64-row tile"));
    } else if (N % 256 == 0) {
      const std::size_t row_bytes = std::size_t(N) * 2;
      const auto want = bytes_of(run(x, w, DType::bf16, GroupedGemmTile::automatic), s);
      const auto got = bytes_of(run(x.slice_rows(0, 7), w, DType::bf16, GroupedGemmTile::sm90_m128n256), s);
      CHECK(std::memcmp(got.data(), want.data(), 7 * row_bytes) == 0);
    }
  }
}

TEST_CASE("grouped GEMM as a plain GEMM: null offsets, a row pitch and alpha", "[ops][gemm][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const Stream s = Stream::create(d);
  // (K, N): the n256 and n128 tensor-core tiles and the fallback.
  const int64_t kn[][2] = {{256, 512}, {72, 64}, {37, 21}};
  uint64_t seed = 500;
  for (const auto& e : kn) {
    for (int64_t rows : {1, 7, 130, 300}) {
      for (DType out_dt : {DType::bf16, DType::f32}) {
        for (GroupedGemmPass pass : {GroupedGemmPass::forward, GroupedGemmPass::backward_input}) {
          const int64_t K = e[0], N = e[1];
          const bool fwd = pass == GroupedGemmPass::forward;
          const int64_t in_cols = fwd ? K : N, out_cols = fwd ? N : K;
          INFO("K=" << K << " N=" << N << " rows " << rows << " out " << dtype_name(out_dt)
                    << (fwd ? " fwd" : " dgrad"));
          seed += 3;
          const Tensor a = random_on({rows, in_cols}, DType::bf16, d, seed, s);
          const Tensor w = random_on({1, N, K}, DType::bf16, d, seed + 1, s);
          const std::vector<int32_t> one_group{0, int32_t(rows)};
          const Tensor off = Tensor::from_vector(one_group, {2}, d, s);
          ops::cuda::GroupedGemmParams p;
          p.pass = pass;
          p.a = a.data_ptr();
          p.b = w.data_ptr();
          p.in_dtype = DType::bf16;
          p.out_dtype = out_dt;
          p.experts = 1;
          p.rows = rows;
          p.out_features = N;
          p.in_features = K;
          p.backend = ops::cuda::GroupedGemmBackend::kernel;
          // The explicit single group.
          Tensor want = Tensor::empty({rows, out_cols}, out_dt, d, s);
          want.fill_bytes_(0xff, s);
          p.c = want.data_ptr();
          p.offsets = off.data<int32_t>();
          ops::cuda::grouped_gemm(p, s.handle());
          // Null offsets, and a pitch of out_cols + 8 (16-byte rows for bf16 and f32 alike).
          const int64_t ldc = out_cols + 8;
          Tensor padded = Tensor::empty({rows, ldc}, out_dt, d, s);
          padded.fill_bytes_(0xff, s);
          p.c = padded.data_ptr();
          p.offsets = nullptr;
          p.ldc = ldc;
          ops::cuda::grouped_gemm(p, s.handle());
          const auto w_bytes = bytes_of(want, s), p_bytes = bytes_of(padded, s);
          const std::size_t es = dtype_size(out_dt), row_bytes = std::size_t(out_cols) * es;
          bool same = true, pad_kept = true;
          for (int64_t r = 0; r < rows; ++r) {
            const unsigned char* row = p_bytes.data() + std::size_t(r * ldc) * es;
            same = same && std::memcmp(row, w_bytes.data() + std::size_t(r) * row_bytes, row_bytes) == 0;
            for (std::size_t b = row_bytes; b < std::size_t(ldc) * es; ++b) pad_kept = pad_kept && row[b] == 0xff;
          }
          CHECK(same);
          CHECK(pad_kept);
          if (fwd && out_dt == DType::f32) {
            // alpha: the stored result times alpha, rounded once more (f32 here).
            const float alpha = 1.f / 0.7f;
            p.alpha = alpha;
            ops::cuda::grouped_gemm(p, s.handle());
            const auto scaled = padded.to_vector<float>(s);
            const auto base = want.to_vector<float>(s);
            int64_t off_by = 0;
            for (int64_t r = 0; r < rows; ++r)
              for (int64_t c = 0; c < out_cols; ++c)
                off_by += scaled[std::size_t(r * ldc + c)] != base[std::size_t(r * out_cols + c)] * alpha;
            CHECK(off_by == 0);
          }
        }
      }
    }
  }
  // Bad combinations.
  ops::cuda::GroupedGemmParams bad;
  bad.experts = 2;
  bad.rows = 4;
  bad.out_features = 8;
  bad.in_features = 8;
  CHECK_THROWS_WITH(ops::cuda::grouped_gemm(bad, s.handle()), ContainsSubstring("experts = 1"));
  bad.experts = 1;
  bad.ldc = 4;
  CHECK_THROWS_WITH(ops::cuda::grouped_gemm(bad, s.handle()), ContainsSubstring("ldc 4"));
  bad.ldc = 0;
  bad.alpha = 2.f;
  bad.pass = GroupedGemmPass::backward_input;
  CHECK_THROWS_WITH(ops::cuda::grouped_gemm(bad, s.handle()), ContainsSubstring("forward pass only"));
}
