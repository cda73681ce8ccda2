// Attention on CUDA (bf16, head_dim 32, 64, 72, 80, 96, 128 and 256) against
// the CPU reference run in f32 on the same bf16-rounded inputs, on fresh random
// inputs with odd, packed sequence lengths; outputs and workspace poisoned
// (0xff = NaN) before every call so that an unwritten element fails the
// comparison, and followed by a poisoned guard band that must stay untouched
// (a write past the end, e.g. of a padding column, fails).
//
// Tolerances, relative error ||gpu - ref|| / ||ref||:
//   o <= 1e-2: q k^T is exact in both (bf16 products, fp32 sums); the kernel
//     rounds P to bf16 before P v (2^-9 relative per term, averaging out over
//     the keys) and rounds o to bf16 (2^-9): about 3e-3 expected.
//   lse: max |gpu - ref| <= 1e-3 (fp32 on both sides, exp2/log2 of the
//     hardware, different summation order), and -inf exactly where ref is.
//   dq, dk, dv <= 2e-2: the backward is checked on the GPU's own o and lse
//     (so it is isolated from the forward); P and dS are rounded to bf16
//     before the four products that use them and the results to bf16, and
//     dS = P (dP - D) cancels: about 5e-3 expected (both backward kernels).
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "slime/core/random.hpp"
#include "slime/ops/attention.hpp"

using namespace slime;
using namespace slime::ops;
using Catch::Matchers::ContainsSubstring;

namespace {

std::vector<int32_t> prefix(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu{0};
  for (int32_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}

std::vector<float> host_floats(const Tensor& t) {
  if (t.dtype() == DType::f32) return t.to_vector<float>();
  std::vector<float> out;
  for (BFloat16 h : t.to_vector<BFloat16>()) out.push_back(float(h));
  return out;
}

double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    num += d * d;
    den += double(b[i]) * double(b[i]);
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// max |a - b|, infinite when a row is -inf on one side only or NaN anywhere.
double lse_err(const std::vector<float>& a, const std::vector<float>& b) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  double e = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return std::numeric_limits<double>::infinity();
    if (a[i] == kNegInf || b[i] == kNegInf) {
      if (a[i] != b[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    e = std::max(e, std::abs(double(a[i]) - double(b[i])));
  }
  return e;
}

Tensor random_bf16(const Shape& shape, uint64_t seed, Device dev) {
  Tensor t = Tensor::empty(shape, DType::bf16, dev);
  fill_normal(t, seed, 0, 0.f, 1.f);
  return t;
}

struct Case {
  std::string name;
  std::vector<int32_t> lens_q, lens_k;
  int64_t hq, hkv;
  AttentionOptions opt;
  int64_t extra_max = 0;  // max_seqlen passed = longest + extra_max (-1: computed by the call)
};

std::vector<Case> cases() {
  const std::vector<int32_t> odd = {1, 17, 127, 577};
  std::vector<Case> c;
  c.push_back({"causal self-attention", odd, odd, 8, 2, AttentionOptions{}});
  AttentionOptions o;
  o.causal = false;
  c.push_back({"full self-attention", odd, odd, 8, 2, o});
  o = AttentionOptions{};
  o.causal_offset = 37;
  c.push_back({"causal offset 37", odd, odd, 8, 2, o, 100});
  o.causal_offset = -50;  // the first 50 rows of each sequence see no key
  c.push_back({"causal offset -50", {3, 60, 130, 211}, {3, 60, 130, 211}, 8, 2, o});
  o = AttentionOptions{};
  o.align = CausalAlign::bottom_right;
  c.push_back({"causal bottom-right, fewer queries", {1, 17, 127, 200}, {5, 17, 300, 577}, 8, 2, o, -1});
  o = AttentionOptions{};
  c.push_back({"causal top-left, more queries", {130, 1, 64, 0, 77}, {65, 3, 129, 9, 0}, 4, 4, o});
  o.causal = false;
  o.softmax_scale = 0.05f;
  c.push_back({"full, scale 0.05, MHA", {333, 0, 45}, {200, 31, 0}, 2, 2, o});
  o = AttentionOptions{};
  o.align = CausalAlign::bottom_right;  // decode against a KV cache: the query is the last position
  c.push_back(
      {"causal bottom-right, one query per sequence against a cache", {1, 1, 1, 2}, {300, 1, 577, 64}, 8, 2, o});
  // Many sequences: 600 tiles of 128 rows (about 300 with rows), several per CTA of the persistent
  // Hopper forward (its stage ring and Q hand-off run on across tiles), some
  // without rows (short sequences) and one empty sequence.
  std::vector<int32_t> many;
  for (int i = 0; i < 30; ++i) many.push_back((i * 137) % 611);
  c.push_back({"30 sequences of 0 to 610 tokens", many, many, 4, 2, AttentionOptions{}});
  return c;
}

// A tensor of `shape` at the start of a buffer kGuard elements longer, all of
// it poisoned (0xff bytes): a write past the tensor's end shows in the tail.
constexpr int64_t kGuard = 256;
struct Guarded {
  Tensor base, t;
  Guarded(const Shape& shape, DType dt, Device dev) : base(Tensor::empty({shape.numel() + kGuard}, dt, dev)) {
    base.fill_bytes_(0xff);
    t = base.view(0, shape);
  }
  bool tail_intact() const {
    const Tensor tail = base.view(t.numel(), {kGuard}).to(Device::cpu());
    const auto* b = static_cast<const uint8_t*>(tail.data_ptr());
    return std::all_of(b, b + tail.nbytes(), [](uint8_t x) { return x == 0xff; });
  }
};

// Forward and backward of case `c` at head dim d on the GPU against the CPU
// reference, inputs from `seed`.
void check_case(const Case& c, int64_t d, uint64_t seed, Device dev) {
  const std::vector<int32_t> cu_q = prefix(c.lens_q), cu_k = prefix(c.lens_k);
  const int64_t B = int64_t(c.lens_q.size()), T = cu_q.back(), Tk = cu_k.back();
  int64_t max_q = 0, max_k = 0;
  for (int32_t l : c.lens_q) max_q = std::max<int64_t>(max_q, l);
  for (int32_t l : c.lens_k) max_k = std::max<int64_t>(max_k, l);
  if (c.extra_max < 0) {
    max_q = max_k = -1;
  } else {
    max_q += c.extra_max;
    max_k += c.extra_max;
  }
  const Tensor q = random_bf16({T, c.hq, d}, seed, dev);
  const Tensor k = random_bf16({Tk, c.hkv, d}, seed + 1, dev);
  const Tensor v = random_bf16({Tk, c.hkv, d}, seed + 2, dev);
  const Tensor d_o = random_bf16({T, c.hq, d}, seed + 3, dev);
  const Tensor tcq = Tensor::from_vector(cu_q, {B + 1}, dev);
  const Tensor tck = Tensor::from_vector(cu_k, {B + 1}, dev);
  const Guarded o({T, c.hq, d}, DType::bf16, dev), lse({T, c.hq}, DType::f32, dev);
  const Guarded dq(q.shape(), DType::bf16, dev), dk(k.shape(), DType::bf16, dev), dv(k.shape(), DType::bf16, dev);
  const Guarded ws({attention_backward_workspace_elems(q)}, DType::f32, dev);

  attention_forward(q, k, v, tcq, tck, max_q, max_k, o.t, lse.t, c.opt);
  attention_backward(q, k, v, o.t, lse.t, d_o, tcq, tck, max_q, max_k, dq.t, dk.t, dv.t, c.opt, ws.t);

  const std::vector<float> hq = host_floats(q), hk = host_floats(k), hv = host_floats(v), hdo = host_floats(d_o);
  const std::vector<float> go = host_floats(o.t), glse = host_floats(lse.t);
  std::vector<float> ro(hq.size()), rlse(glse.size());
  cpu::attention_forward(hq.data(), hk.data(), hv.data(), cu_q.data(), cu_k.data(), B, c.hq, c.hkv, d, c.opt, ro.data(),
                         rlse.data());
  CHECK(rel_err(go, ro) <= 1e-2);
  CHECK(lse_err(glse, rlse) <= 1e-3);

  std::vector<float> rdq(hq.size()), rdk(hk.size()), rdv(hv.size());
  cpu::attention_backward(hq.data(), hk.data(), hv.data(), go.data(), glse.data(), hdo.data(), cu_q.data(), cu_k.data(),
                          B, c.hq, c.hkv, d, c.opt, rdq.data(), rdk.data(), rdv.data());
  CHECK(rel_err(host_floats(dq.t), rdq) <= 2e-2);
  CHECK(rel_err(host_floats(dk.t), rdk) <= 2e-2);
  CHECK(rel_err(host_floats(dv.t), rdv) <= 2e-2);
  for (const Guarded* g : {&o, &lse, &dq, &dk, &dv, &ws}) CHECK(g->tail_intact());
}

}  // namespace

TEST_CASE("attention on CUDA matches the CPU reference", "[ops][attention][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device dev = Device::cuda(0);
  uint64_t seed = 1000;
  for (int64_t d : {64, 128}) {
    for (const Case& c : cases()) {
      INFO("head_dim " << d << ", " << c.name);
      seed += 10;
      check_case(c, d, seed, dev);
    }
  }
}

// Both kernel families at head_dim 64 and 128, each forced (the test above
// runs the automatic choice: on an H200 the Hopper forward and the mma.sync
// backward, unless SLIME_ATTENTION_SM90_BWD=1): mma_sync runs the mma.sync
// forward and backward, sm90 the Hopper forward and backward; each backward is
// checked on its forward's o and lse.
TEST_CASE("attention on CUDA: the mma.sync and the Hopper (sm90) kernels each match the CPU reference",
          "[ops][attention][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device dev = Device::cuda(0);
  std::vector<AttentionKernel> kernels = {AttentionKernel::mma_sync};
  if (cuda::attention_sm90_available()) kernels.push_back(AttentionKernel::sm90);
  uint64_t seed = 3000;
  for (AttentionKernel kernel : kernels) {
    for (int64_t d : {64, 128}) {
      for (Case c : cases()) {
        INFO((kernel == AttentionKernel::sm90 ? "sm90" : "mma_sync") << ", head_dim " << d << ", " << c.name);
        c.opt.kernel = kernel;
        seed += 10;
        check_case(c, d, seed, dev);
      }
    }
  }
  // A forced Hopper kernel where it cannot run is an error, not a fallback.
  AttentionOptions opt;
  opt.kernel = AttentionKernel::sm90;
  const Tensor q = random_bf16({5, 2, 32}, 1, dev), o = Tensor::empty({5, 2, 32}, DType::bf16, dev);
  const Tensor lse = Tensor::empty({5, 2}, DType::f32, dev),
               cu = Tensor::from_vector(std::vector<int32_t>{0, 5}, {2}, dev);
  CHECK_THROWS_WITH(attention_forward(q, q, q, cu, cu, 5, 5, o, lse, opt),
                    ContainsSubstring("Hopper forward kernel (AttentionKernel::sm90) cannot run"));
  const Tensor ws = Tensor::empty({attention_backward_workspace_elems(q)}, DType::f32, dev);
  const Tensor dq = Tensor::empty({5, 2, 32}, DType::bf16, dev);
  CHECK_THROWS_WITH(attention_backward(q, q, q, o, lse, q, cu, cu, 5, 5, dq, dq, dq, opt, ws),
                    ContainsSubstring("Hopper backward kernel (AttentionKernel::sm90) cannot run"));
}

// 32 (the shapes of 64), 72 (tiles of 80, columns past 72 zero-filled), 80
// (dQ columns split unevenly over the warps), 96, 256 (dK, dV, dQ columns over
// two CTAs; Q from shared memory in the forward).
TEST_CASE("attention on CUDA matches the CPU reference at head_dim 32, 72, 80, 96 and 256", "[ops][attention][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device dev = Device::cuda(0);
  uint64_t seed = 5000;
  for (int64_t d : {32, 72, 80, 96, 256}) {
    for (const Case& c : cases()) {
      INFO("head_dim " << d << ", " << c.name);
      seed += 10;
      check_case(c, d, seed, dev);
    }
  }
}

TEST_CASE("attention on CUDA: o, lse, dk and dv are bitwise run-to-run deterministic", "[ops][attention][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device dev = Device::cuda(0);
  const std::vector<int32_t> cu = prefix({300, 1, 555});
  const Tensor tcu = Tensor::from_vector(cu, {4}, dev);
  const int64_t T = cu.back();
  for (int64_t d : {128, 32, 72, 80, 96, 256}) {
    INFO("head_dim " << d);
    const Tensor q = random_bf16({T, 8, d}, 7, dev), k = random_bf16({T, 2, d}, 8, dev);
    const Tensor v = random_bf16({T, 2, d}, 9, dev), d_o = random_bf16({T, 8, d}, 10, dev);
    auto run = [&](std::vector<Tensor>& out) {
      out = {Tensor::empty(q.shape(), DType::bf16, dev), Tensor::empty({T, 8}, DType::f32, dev),
             Tensor::empty(q.shape(), DType::bf16, dev), Tensor::empty(k.shape(), DType::bf16, dev),
             Tensor::empty(k.shape(), DType::bf16, dev)};
      for (Tensor& t : out) t.fill_bytes_(0xff);
      attention_forward(q, k, v, tcu, tcu, 555, 555, out[0], out[1]);
      attention_backward(q, k, v, out[0], out[1], d_o, tcu, tcu, 555, 555, out[2], out[3], out[4]);
    };
    std::vector<Tensor> a, b;
    run(a);
    run(b);
    auto bytes = [](const Tensor& t) {
      std::vector<uint8_t> x(t.nbytes());
      const Tensor h = t.to(Device::cpu());
      std::memcpy(x.data(), h.data_ptr(), x.size());
      return x;
    };
    CHECK(bytes(a[0]) == bytes(b[0]));  // o
    CHECK(bytes(a[1]) == bytes(b[1]));  // lse
    CHECK(bytes(a[3]) == bytes(b[3]));  // dk
    CHECK(bytes(a[4]) == bytes(b[4]));  // dv
    // dq sums key blocks with fp32 atomics: equal up to rounding only.
    CHECK(rel_err(host_floats(a[2]), host_floats(b[2])) <= 1e-2);
  }
}

TEST_CASE("attention on CUDA: the deterministic backward gives the same dq bits every run", "[ops][attention][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device dev = Device::cuda(0);
  // Several key blocks per sequence (128 keys each) and a long one, so that
  // many CTAs add to the same query rows; causal and full masks.
  const std::vector<int32_t> cu = prefix({1000, 1, 555, 2048});
  const Tensor tcu = Tensor::from_vector(cu, {5}, dev);
  const int64_t T = cu.back();
  for (const bool causal : {true, false}) {
    for (int64_t d : {128, 64, 256}) {
      INFO("head_dim " << d << (causal ? ", causal" : ", full"));
      const Tensor q = random_bf16({T, 8, d}, 17, dev), k = random_bf16({T, 2, d}, 18, dev);
      const Tensor v = random_bf16({T, 2, d}, 19, dev), d_o = random_bf16({T, 8, d}, 20, dev);
      AttentionOptions opt;
      opt.causal = causal;
      const Tensor o = Tensor::empty(q.shape(), DType::bf16, dev), lse = Tensor::empty({T, 8}, DType::f32, dev);
      attention_forward(q, k, v, tcu, tcu, 2048, 2048, o, lse, opt);
      auto backward = [&](bool deterministic) {
        AttentionOptions b = opt;
        b.deterministic = deterministic;
        std::vector<Tensor> g = {Tensor::empty(q.shape(), DType::bf16, dev), Tensor::empty(k.shape(), DType::bf16, dev),
                                 Tensor::empty(k.shape(), DType::bf16, dev)};
        for (Tensor& t : g) t.fill_bytes_(0xff);
        attention_backward(q, k, v, o, lse, d_o, tcu, tcu, 2048, 2048, g[0], g[1], g[2], b);
        return g;
      };
      auto bytes = [](const Tensor& t) {
        std::vector<uint8_t> x(t.nbytes());
        const Tensor h = t.to(Device::cpu());
        std::memcpy(x.data(), h.data_ptr(), x.size());
        return x;
      };
      const std::vector<Tensor> ref = backward(false), a = backward(true), b = backward(true), c = backward(true);
      CHECK(bytes(a[0]) == bytes(b[0]));  // dq, bitwise
      CHECK(bytes(a[0]) == bytes(c[0]));
      CHECK(bytes(a[1]) == bytes(ref[1]));  // dk and dv do not change
      CHECK(bytes(a[2]) == bytes(ref[2]));
      CHECK(rel_err(host_floats(a[0]), host_floats(ref[0])) <= 1e-2);  // the same sums in another order
    }
  }
}

// A decode step (one query row per sequence against its cache) must give the
// bits of the training forward's last row of each sequence (issue 20: the
// engine's logprobs equal the trainer's). On Hopper the decode call runs with
// a kv group's heads packed into one tile (AttentionOptions::pack_gqa); the
// test also compares it with the unpacked call, and checks o and lse against
// the CPU. Key lengths around the 128-key block (1, 127, 128, 129, 300), a
// sequence without a decode row, GQA groups 2, 4, 8 and 16, causal (offset 0
// and -3: the decode row then sees all but its last 3 keys) and full masks.
TEST_CASE("attention on CUDA: a decode step gives the bits of the training forward's last rows",
          "[ops][attention][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device dev = Device::cuda(0);
  const std::vector<int32_t> lens = {1, 127, 128, 129, 300, 40, 257};
  const std::vector<int32_t> cu_k = prefix(lens);
  const int64_t B = int64_t(lens.size()), Tk = cu_k.back();
  const Tensor tcu_k = Tensor::from_vector(cu_k, {B + 1}, dev);
  struct Mask {
    const char* name;
    bool causal;
    int offset;
  };
  uint64_t seed = 7000;
  for (AttentionKernel kernel : {AttentionKernel::automatic, AttentionKernel::mma_sync}) {
    for (int64_t d : {64, 128}) {
      for (int64_t group : {2, 4, 8, 16}) {
        for (const Mask& m : {Mask{"causal", true, 0}, Mask{"causal offset -3", true, -3}, Mask{"full", false, 0}}) {
          const int64_t hkv = group == 16 ? 1 : 2, hq = hkv * group;
          INFO((kernel == AttentionKernel::mma_sync ? "mma_sync" : "automatic")
               << ", head_dim " << d << ", " << hq << " heads over " << hkv << ", " << m.name);
          seed += 4;
          const Tensor q = random_bf16({Tk, hq, d}, seed, dev);
          const Tensor k = random_bf16({Tk, hkv, d}, seed + 1, dev);
          const Tensor v = random_bf16({Tk, hkv, d}, seed + 2, dev);
          // Training: every row of every sequence (top-left: row i sees keys <= i + offset).
          AttentionOptions train;
          train.causal = m.causal;
          train.causal_offset = m.offset;
          train.kernel = kernel;
          const Tensor o_all = Tensor::empty(q.shape(), DType::bf16, dev),
                       lse_all = Tensor::empty({Tk, hq}, DType::f32, dev);
          attention_forward(q, k, v, tcu_k, tcu_k, 300, 300, o_all, lse_all, train);
          // Decode: each sequence's last row, except sequence 5's (no query row), against all its keys
          // (bottom-right: the row is the cache's last position).
          std::vector<int32_t> dec_lens, last_rows;
          for (int64_t b = 0; b < B; ++b) {
            dec_lens.push_back(b == 5 ? 0 : 1);
            if (b != 5) last_rows.push_back(cu_k[std::size_t(b + 1)] - 1);
          }
          const int64_t T = int64_t(last_rows.size());
          const std::vector<BFloat16> hq_all = q.to_vector<BFloat16>();
          std::vector<BFloat16> hq_dec;
          for (int32_t r : last_rows)
            hq_dec.insert(hq_dec.end(), hq_all.begin() + r * hq * d, hq_all.begin() + (r + 1) * hq * d);
          const Tensor q_dec = Tensor::from_vector(hq_dec, {T, hq, d}, dev);
          const Tensor tcu_q = Tensor::from_vector(prefix(dec_lens), {B + 1}, dev);
          AttentionOptions dec = train;
          dec.align = CausalAlign::bottom_right;
          auto decode = [&](bool pack) {
            AttentionOptions o = dec;
            o.pack_gqa = pack;
            auto out = std::make_pair(Guarded({T, hq, d}, DType::bf16, dev), Guarded({T, hq}, DType::f32, dev));
            attention_forward(q_dec, k, v, tcu_q, tcu_k, 1, 300, out.first.t, out.second.t, o);
            CHECK(out.first.tail_intact());
            CHECK(out.second.tail_intact());
            return std::make_pair(host_floats(out.first.t), host_floats(out.second.t));
          };
          const auto packed = decode(true), unpacked = decode(false);
          // The training rows at the decode rows' positions.
          const std::vector<float> go = host_floats(o_all), glse = host_floats(lse_all);
          std::vector<float> want_o, want_lse;
          for (int32_t r : last_rows) {
            want_o.insert(want_o.end(), go.begin() + r * hq * d, go.begin() + (r + 1) * hq * d);
            want_lse.insert(want_lse.end(), glse.begin() + r * hq, glse.begin() + (r + 1) * hq);
          }
          auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
            return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
          };
          CHECK(same_bits(packed.first, want_o));
          CHECK(same_bits(packed.second, want_lse));
          CHECK(same_bits(unpacked.first, want_o));
          CHECK(same_bits(unpacked.second, want_lse));
          // And right: against the CPU on the decode call itself.
          std::vector<float> ro(packed.first.size()), rlse(packed.second.size());
          const std::vector<float> hk = host_floats(k), hv = host_floats(v), hqd = host_floats(q_dec);
          cpu::attention_forward(hqd.data(), hk.data(), hv.data(), prefix(dec_lens).data(), cu_k.data(), B, hq, hkv, d,
                                 dec, ro.data(), rlse.data());
          CHECK(rel_err(packed.first, ro) <= 1e-2);
          CHECK(lse_err(packed.second, rlse) <= 1e-3);
        }
      }
    }
  }
}

TEST_CASE("merge_attention_partials on CUDA matches the CPU", "[ops][attention][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device dev = Device::cuda(0);
  const int64_t T = 37, H = 3, d = 100;  // head_dim not a multiple of 32
  for (DType t1 : {DType::bf16, DType::f32}) {
    for (DType to : {DType::bf16, DType::f32}) {
      INFO(dtype_name(t1) << " + bf16 -> " << dtype_name(to));
      Tensor o1 = Tensor::empty({T, H, d}, t1, dev);
      fill_normal(o1, 1, 0, 0.f, 1.f);
      const Tensor o2 = random_bf16({T, H, d}, 2, dev);
      Tensor l1 = Tensor::empty({T, H}, DType::f32, dev), l2 = Tensor::empty({T, H}, DType::f32, dev);
      fill_uniform(l1, 3, 0, -5.f, 5.f);
      fill_uniform(l2, 4, 0, -5.f, 5.f);
      // Some rows see no key in one part or in both (lse = -inf; o = 0 there).
      std::vector<float> hl1 = l1.to_vector<float>(), hl2 = l2.to_vector<float>();
      const float ninf = -std::numeric_limits<float>::infinity();
      for (int64_t r = 0; r < T * H; r += 5) hl1[std::size_t(r)] = ninf;
      for (int64_t r = 0; r < T * H; r += 7) hl2[std::size_t(r)] = ninf;
      l1.copy_from(Tensor::from_vector(hl1, {T, H}));
      l2.copy_from(Tensor::from_vector(hl2, {T, H}));
      Tensor o = Tensor::empty({T, H, d}, to, dev), lse = Tensor::empty({T, H}, DType::f32, dev);
      o.fill_bytes_(0xff);
      lse.fill_bytes_(0xff);
      merge_attention_partials(o1, l1, o2, l2, o, lse);

      const std::vector<float> h1 = host_floats(o1), h2 = host_floats(o2);
      std::vector<float> ro(h1.size()), rl(hl1.size());
      cpu::merge_attention_partials(h1.data(), hl1.data(), h2.data(), hl2.data(), T * H, d, ro.data(), rl.data());
      CHECK(rel_err(host_floats(o), ro) <= (to == DType::bf16 ? 1e-2 : 1e-5));
      CHECK(lse_err(host_floats(lse), rl) <= 1e-5);

      // In place into (o1, l1).
      merge_attention_partials(o1, l1, o2, l2, o1, l1);
      CHECK(rel_err(host_floats(o1), ro) <= (t1 == DType::bf16 ? 1e-2 : 1e-5));
      CHECK(lse_err(host_floats(l1), rl) <= 1e-5);
    }
  }
}

TEST_CASE("attention on CUDA rejects what the kernels do not support", "[ops][attention][gpu]") {
  if (slime::cuda_device_count() == 0) SKIP("no CUDA device");
  const Device dev = Device::cuda(0);
  const Tensor cu = Tensor::from_vector(std::vector<int32_t>{0, 9}, {2}, dev);
  auto run = [&](int64_t d, DType dt, int64_t offset_elems) {
    const Tensor base = Tensor::zeros({9 * 2 * d + offset_elems}, dt, dev);
    const Tensor q = base.view(offset_elems, {9, 2, d});
    const Tensor o = Tensor::empty({9, 2, d}, dt, dev), lse = Tensor::empty({9, 2}, DType::f32, dev);
    attention_forward(q, q, q, cu, cu, 9, 9, o, lse);
  };
  CHECK_NOTHROW(run(64, DType::bf16, 0));
  CHECK_NOTHROW(run(72, DType::bf16, 0));
  CHECK_THROWS_WITH(run(100, DType::bf16, 0),
                    ContainsSubstring("supports head_dim 32, 64, 72, 80, 96, 128 and 256, got 100"));
  CHECK_THROWS_WITH(run(64, DType::f32, 0), ContainsSubstring("needs bf16"));
  CHECK_THROWS_WITH(run(64, DType::bf16, 1), ContainsSubstring("16-byte aligned"));
}
