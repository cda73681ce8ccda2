// bench/bench_vision_tower.cpp: the Qwen3-VL vision tower end to end.
// nn::Qwen3VLVisionModel forward, and forward + backward, on one GPU. The
// PyTorch baseline is bench/torch_vision_tower.py (transformers'
// Qwen3VLVisionModel, SDPA attention); names match, so bench/compare_ops.py
// prints them side by side.
//
// The tower: Qwen3-VL-2B's shape with random weights (depth 24, hidden 1024,
//   16 heads of 64, intermediate 4096, patch 16, temporal patch 2, 3 channels,
//   spatial merge 2, out_hidden 2048, a 48 x 48 learned position grid,
//   deepstack after blocks 5, 11 and 17), bf16 on cuda:0, every weight ~ N(0,
//   0.02) and the LayerNorm weights 1 (init_random). Parameter gradients
//   accumulate in fp32 (the torch side's are bf16).
//
// vision_tower/<images>x<side>/{fwd,fwd_bwd}: <images> images of side x side
//   pixels, i.e. grid (1, side/16, side/16) each: 448 -> 28 x 28 = 784
//   patches, 1024 -> 64 x 64 = 4096 patches. pixel_values [P, 1536] ~ N(0, 1).
//   fwd:     out = tower.forward(pixel_values, grids) (a training forward: the
//            context is kept)
//   fwd_bwd: the same, then tower.backward(ctx, r, {r_0, r_1, r_2}): the
//            gradient of sum(embeds · r) + sum_j sum(deepstack_j · r_j) with
//            fixed r, r_j ~ N(0, 1) of [P/4, 2048]. No pixel gradient.
//   FLOP (GEMMs and attention only; P patches, P_i = side² / 256 per image,
//   N = P / 4 merged tokens, H 1024, I 4096, K = 3·2·16² = 1536, O 2048,
//   m² = 4, L = 24 blocks, 1 + 3 mergers):
//     fwd = 2·P·K·H                              patch embed (a Linear)
//         + L · 2·P·(3H·H + H·H + 2·H·I)         qkv, proj, fc1, fc2
//         + L · images · 4·P_i²·H                attention (QKᵀ and PV)
//         + 4 · 2·N·(m²H)·(m²H + O)              merger fc1 and fc2, x4
//     fwd_bwd = 3·fwd − 2·P·K·H                  backward = dgrad + wgrad,
//             (attention's backward counted as 2x its forward; the patch
//             embedding has no dgrad: neither side asks for a pixel gradient)
//     fwd:     1x448 5.76e11, 4x448 2.30e12, 8x448 4.61e12, 1x1024 4.34e12,
//              4x1024 1.74e13
//     fwd_bwd: 1x448 1.73e12, 4x448 6.90e12, 8x448 1.38e13, 1x1024 1.30e13,
//              4x1024 5.21e13
//   Not counted: the position-embedding resample (4 taps a patch on both
//   sides: ops::pos_embed_interpolate, transformers' gather), nor the norms,
//   GELU and rotary.
//   Counters: patches_per_s = P / time, TFLOPs, flop, patches, images,
//   check_embeds_rel and check_grad_rel (the small-tower check below).
//   The per-call host work (segments, rotary positions and the
//   position-embedding taps built on the host and copied up, nn/vision.hpp) is
//   inside the timed calls: the events bracket whole calls, so host time the
//   GPU waits on counts.
//
// Check (first run of each shape; both rows wait on it):
//   1. Once per process, a small tower (depth 2, hidden 256, 4 heads of 64,
//      intermediate 1024, out 512, deepstack after blocks 0 and 1; the same
//      patch, merge and 48 x 48 position grid) on one 12 x 20-patch image:
//      the bf16 GPU tower against the f32 CPU reference (nn/vision.hpp on the
//      CPU, golden-tested against transformers) holding the same weights (the
//      GPU's bf16 values), the same pixels and the same r, r_j. ‖gpu − cpu‖ /
//      ‖cpu‖ ≤ 3e-2 for embeds and each deepstack output (bf16 activations at
//      every op boundary over two blocks: about 1e-2), and ≤ 8e-2 for every
//      parameter gradient (the bound of the Qwen3 GPU golden: bf16 dgrads
//      rounded once per op, f32 accumulation).
//   2. On the timed shape, one forward + backward: embeds and every deepstack
//      output finite and non-zero, the patch embedding's weight gradient
//      finite and non-zero.
//
// Timing: CUDA events (UseManualTime), fixed iterations and repetitions; read
// the median over repetitions. kWarmup untimed calls, then per iteration
// kBatch calls between two events (bench::time_batches). No CUDA graph mode:
// a call does host work (above) and is far from launch-bound (the smallest,
// 1x448 fwd, is 0.58 TFLOP).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench_models.hpp"
#include "bench_util.hpp"
#include "slime/core/random.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/vision.hpp"
#include "slime/ops/attention.hpp"
#include "slime/ops/elementwise.hpp"

namespace {

using slime::Device;
using slime::DType;
using slime::Stream;
using slime::Tensor;
using slime::detail::concat;
using slime::nn::GridThw;
using slime::nn::Qwen3VLVisionConfig;
using slime::nn::Qwen3VLVisionModel;

constexpr int kWarmup = 2;       // untimed calls per run
constexpr int kBatch = 2;        // calls per timed iteration
constexpr int kIterations = 3;   // timed iterations per run
constexpr int kRepetitions = 3;  // runs; the median is reported
constexpr float kWeightStd = 0.02f;
constexpr double kOutputTol = 3e-2;  // embeds, deepstack: bf16 GPU vs f32 CPU
constexpr double kGradTol = 8e-2;    // parameter gradients: bf16 GPU vs f32 CPU

// Qwen3-VL-2B's vision tower.
Qwen3VLVisionConfig tower_2b_config() { return slime::bench::qwen3_vl_2b_vision_config(); }

// The check's small tower: head_dim 64 (a CUDA attention kernel), the 2B
// tower's patch, merge and position grid, two blocks each feeding a deepstack
// merger.
Qwen3VLVisionConfig small_config() {
  Qwen3VLVisionConfig c = tower_2b_config();
  c.depth = 2;
  c.hidden_size = 256;
  c.intermediate_size = 1024;
  c.num_heads = 4;
  c.out_hidden_size = 512;
  c.deepstack_visual_indexes = {0, 1};
  c.validate();
  return c;
}

struct TowerShape {
  const char* name;
  int64_t images;
  int64_t side_px;  // square images of side_px x side_px pixels
};

constexpr TowerShape kShapes[] = {
    {"1x448", 1, 448}, {"4x448", 4, 448}, {"8x448", 8, 448}, {"1x1024", 1, 1024}, {"4x1024", 4, 1024},
};

std::vector<GridThw> grids_of(const Qwen3VLVisionConfig& c, const TowerShape& s) {
  const int64_t side = s.side_px / c.patch_size;
  return std::vector<GridThw>(std::size_t(s.images), GridThw{1, side, side});
}

int64_t patches_of(const std::vector<GridThw>& grids) {
  int64_t p = 0;
  for (const GridThw& g : grids) p += g[0] * g[1] * g[2];
  return p;
}

// The FLOP of one call (the formula at the top of the file).
double tower_flop(const Qwen3VLVisionConfig& c, const std::vector<GridThw>& grids, bool backward) {
  return slime::bench::vision_tower_flop(c, grids, backward);
}

// ---- helpers ---------------------------------------------------------------------

// t (any float dtype, any device) as an f32 tensor on the host.
Tensor host_f32(const Tensor& t, const Stream& s) {
  Tensor f = Tensor::empty(t.shape(), DType::f32, t.device(), s);
  slime::ops::cast(t, f, s);
  Tensor h = f.to(Device::cpu(), s);
  s.synchronize();
  return h;
}

// ‖a − b‖ / ‖b‖ over two host f32 tensors of one size (inf when not finite).
double rel_error(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to_vector<float>(), y = b.to_vector<float>();
  SLIME_CHECK(x.size() == y.size(), "rel_error: ", a.str(), " vs ", b.str());
  double err = 0, ref = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double d = double(x[i]) - double(y[i]);
    err += d * d;
    ref += double(y[i]) * double(y[i]);
  }
  const double r = std::sqrt(err / std::max(ref, 1e-30));
  return std::isfinite(r) ? r : INFINITY;
}

// "" when every element of t is finite and some is non-zero, else what is wrong.
std::string finite_nonzero(const Tensor& t, const std::string& what, const Stream& s) {
  const std::vector<float> v = host_f32(t, s).to_vector<float>();
  double norm = 0;
  for (float x : v) {
    if (!std::isfinite(x)) return concat(what, " is not finite");
    norm += double(x) * double(x);
  }
  return norm > 0 ? std::string() : concat(what, " is zero");
}

std::vector<slime::nn::Parameter*> parameters(Qwen3VLVisionModel& m) {
  std::vector<slime::nn::Parameter*> out;
  m.for_each_parameter([&](slime::nn::Parameter& p) { out.push_back(&p); });
  return out;
}

// ---- check 1: the small tower, bf16 GPU against f32 CPU -------------------------

struct SmallCheck {
  std::string error;  // "" when it passed
  double embeds_rel = 0, grad_rel = 0;
};

SmallCheck check_small_tower() {
  const Device d = Device::cuda(0);
  const Stream s = Stream::create(d);
  const Qwen3VLVisionConfig c = small_config();
  const std::vector<GridThw> grids = {{1, 12, 20}};
  const int64_t P = patches_of(grids), N = P / c.merge_unit(), O = c.out_hidden_size;
  const std::size_t D = c.deepstack_visual_indexes.size();

  Qwen3VLVisionModel gpu(c, {d, DType::bf16});
  gpu.init_random(7, kWeightStd, s);
  Qwen3VLVisionModel cpu(c, {Device::cpu(), DType::f32});
  const std::vector<slime::nn::Parameter*> gp = parameters(gpu), cp = parameters(cpu);
  for (std::size_t i = 0; i < gp.size(); ++i) cp[i]->value.copy_from(host_f32(gp[i]->value, s));
  slime::nn::zero_grad(gpu, s);
  slime::nn::zero_grad(cpu);

  Tensor pixels = Tensor::empty({P, c.patch_dim()}, DType::bf16, d, s);
  slime::fill_normal(pixels, 8, 0, 0.f, 1.f, s);
  std::vector<Tensor> r(D + 1);  // r[0] for the embeds, r[1 + j] for deepstack j
  for (std::size_t j = 0; j <= D; ++j) {
    r[j] = Tensor::empty({N, O}, DType::bf16, d, s);
    slime::fill_normal(r[j], 9 + j, 0, 0.f, 1.f, s);
  }
  std::vector<Tensor> r_cpu;
  for (const Tensor& t : r) r_cpu.push_back(host_f32(t, s));

  Qwen3VLVisionModel::Context gctx, cctx;
  const slime::nn::VisionOutput go = gpu.forward(pixels, grids, gctx, s);
  gpu.backward(gctx, r[0], std::vector<Tensor>(r.begin() + 1, r.end()), s);
  const slime::nn::VisionOutput co = cpu.forward(host_f32(pixels, s), grids, cctx);
  cpu.backward(cctx, r_cpu[0], std::vector<Tensor>(r_cpu.begin() + 1, r_cpu.end()));

  SmallCheck out;
  out.embeds_rel = rel_error(host_f32(go.embeds, s), co.embeds);
  if (!(out.embeds_rel <= kOutputTol))
    out.error =
        concat("small tower: embeds differ from the CPU f32 reference by ", out.embeds_rel, " (> ", kOutputTol, ")");
  for (std::size_t j = 0; j < D && out.error.empty(); ++j) {
    const double e = rel_error(host_f32(go.deepstack[j], s), co.deepstack[j]);
    out.embeds_rel = std::max(out.embeds_rel, e);
    if (!(e <= kOutputTol))
      out.error =
          concat("small tower: deepstack[", j, "] differs from the CPU f32 reference by ", e, " (> ", kOutputTol, ")");
  }
  std::string worst;
  for (std::size_t i = 0; i < gp.size(); ++i) {
    const double e = rel_error(host_f32(gp[i]->grad, s), cp[i]->grad);
    if (e >= out.grad_rel) {
      out.grad_rel = e;
      worst = gp[i]->name;
    }
  }
  if (out.error.empty() && !(out.grad_rel <= kGradTol))
    out.error = concat("small tower: the gradient of ", worst, " differs from the CPU f32 reference by ", out.grad_rel,
                       " (> ", kGradTol, ")");
  return out;
}

const SmallCheck& small_check() {
  static const SmallCheck result = check_small_tower();
  return result;
}

// ---- the timed tower -----------------------------------------------------------------

// The 2B tower, built once for every shape (the weights do not depend on it),
// and the inputs of the current shape.
struct TowerProblem {
  Stream stream;
  Qwen3VLVisionModel model;
  std::string shape;  // name of the shape the inputs below are for
  std::vector<GridThw> grids;
  Tensor pixels, r;
  std::vector<Tensor> r_deepstack;
  Qwen3VLVisionModel::Context ctx;
};

std::unique_ptr<TowerProblem> g_tower;

TowerProblem& tower_problem(const TowerShape& shape) {
  const Device d = Device::cuda(0);
  if (!g_tower) {
    auto p = std::make_unique<TowerProblem>();
    p->stream = Stream::create(d);
    p->model = Qwen3VLVisionModel(tower_2b_config(), {d, DType::bf16});
    p->model.init_random(1, kWeightStd, p->stream);
    slime::nn::zero_grad(p->model, p->stream);
    g_tower = std::move(p);
  }
  TowerProblem& p = *g_tower;
  if (p.shape == shape.name) return p;
  const Stream& st = p.stream;
  const Qwen3VLVisionConfig& c = p.model.config();
  p.ctx = {};  // frees the previous shape's activations first
  p.pixels = p.r = Tensor();
  p.r_deepstack.clear();
  p.grids = grids_of(c, shape);
  const int64_t P = patches_of(p.grids), N = P / c.merge_unit();
  p.pixels = Tensor::empty({P, c.patch_dim()}, DType::bf16, d, st);
  slime::fill_normal(p.pixels, 2, 0, 0.f, 1.f, st);
  p.r = Tensor::empty({N, c.out_hidden_size}, DType::bf16, d, st);
  slime::fill_normal(p.r, 3, 0, 0.f, 1.f, st);
  for (std::size_t j = 0; j < c.deepstack_visual_indexes.size(); ++j) {
    p.r_deepstack.push_back(Tensor::empty({N, c.out_hidden_size}, DType::bf16, d, st));
    slime::fill_normal(p.r_deepstack.back(), 4 + j, 0, 0.f, 1.f, st);
  }
  p.shape = shape.name;
  return p;
}

void tower_forward(TowerProblem& p) { p.model.forward(p.pixels, p.grids, p.ctx, p.stream); }

void tower_forward_backward(TowerProblem& p) {
  p.model.forward(p.pixels, p.grids, p.ctx, p.stream);
  p.model.backward(p.ctx, p.r, p.r_deepstack, p.stream);
}

// Check 2 on the timed shape (after check 1): "" or what is wrong.
std::string check_tower(TowerProblem& p) {
  if (!small_check().error.empty()) return small_check().error;
  const Stream& st = p.stream;
  slime::nn::zero_grad(p.model, st);
  const slime::nn::VisionOutput out = p.model.forward(p.pixels, p.grids, p.ctx, st);
  p.model.backward(p.ctx, p.r, p.r_deepstack, st);
  if (std::string e = finite_nonzero(out.embeds, "embeds", st); !e.empty()) return e;
  for (std::size_t j = 0; j < out.deepstack.size(); ++j)
    if (std::string e = finite_nonzero(out.deepstack[j], concat("deepstack[", j, "]"), st); !e.empty()) return e;
  return finite_nonzero(p.model.patch_embed().weight.grad, "the patch embedding's weight gradient", st);
}

void run_tower(benchmark::State& state, TowerShape s, bool backward) {
  if (slime::bench::skip_without_cuda(state)) return;
  slime::bench::run_or_skip(state, [&] {
    TowerProblem& p = tower_problem(s);
    static std::map<std::string, std::string> verdicts;
    if (!slime::bench::passed_check(state, verdicts, std::string(s.name), [&] { return check_tower(p); })) return;
    const double t =
        backward ? slime::bench::time_batches(state, p.stream, kWarmup, kBatch, [&] { tower_forward_backward(p); })
                 : slime::bench::time_batches(state, p.stream, kWarmup, kBatch, [&] { tower_forward(p); });
    const double P = double(patches_of(p.grids)), flop = tower_flop(p.model.config(), p.grids, backward);
    state.counters["patches_per_s"] = slime::bench::per_second(P, t, 1.0);
    state.counters["TFLOPs"] = slime::bench::per_second(flop, t, 1e12);
    state.counters["flop"] = flop;
    state.counters["patches"] = P;
    state.counters["images"] = double(s.images);
    state.counters["check_embeds_rel"] = small_check().embeds_rel;
    state.counters["check_grad_rel"] = small_check().grad_rel;
  });
}

// vision_tower/<shape>/attention_fwd_bwd: the tower's attention alone, as the
// tower runs it (depth x (forward + backward), 16 heads of 64, one non-causal
// segment per image, bf16 q, k, v ~ N(0, 1)): the share of the fwd_bwd row's
// time that attention takes. FLOP = depth · 3 · 4 · Σ_img n² · hidden
// (backward counted as 2x forward, as tower_flop does).
void run_attention(benchmark::State& state, TowerShape s) {
  if (slime::bench::skip_without_cuda(state)) return;
  slime::bench::run_or_skip(state, [&] {
    const Device d = Device::cuda(0);
    const Stream st = Stream::create(d);
    const Qwen3VLVisionConfig c = tower_2b_config();
    const std::vector<GridThw> grids = grids_of(c, s);
    const int64_t P = patches_of(grids), H = c.num_heads, hd = c.head_dim();
    std::vector<int32_t> cu{0};
    int max_len = 0;
    double pairs = 0;
    for (const GridThw& g : grids) {
      cu.push_back(int32_t(cu.back() + g[1] * g[2]));
      max_len = std::max(max_len, int(g[1] * g[2]));
      pairs += double(g[1] * g[2]) * double(g[1] * g[2]);
    }
    const Tensor cu_t = Tensor::from_vector(cu, {int64_t(cu.size())}, d, st);
    const auto make = [&](uint64_t seed) {
      Tensor t = Tensor::empty({P, H, hd}, DType::bf16, d, st);
      slime::fill_normal(t, seed, 0, 0.f, 1.f, st);
      return t;
    };
    const Tensor q = make(11), k = make(12), v = make(13), d_o = make(14);
    const Tensor o = Tensor::empty({P, H, hd}, DType::bf16, d, st), dq = o.clone(st), dk = o.clone(st),
                 dv = o.clone(st);
    const Tensor lse = Tensor::empty({P, H}, DType::f32, d, st);
    const Tensor ws =
        Tensor::empty({std::max<int64_t>(slime::ops::attention_backward_workspace_elems(q), 1)}, DType::f32, d, st);
    slime::ops::AttentionOptions opt;
    opt.causal = false;
    const auto layer = [&] {
      slime::ops::attention_forward(q, k, v, cu_t, cu_t, max_len, max_len, o, lse, opt, st);
      slime::ops::attention_backward(q, k, v, o, lse, d_o, cu_t, cu_t, max_len, max_len, dq, dk, dv, opt, ws, st);
    };
    const double t = slime::bench::time_batches(state, st, kWarmup, kBatch, [&] {
      for (int l = 0; l < c.depth; ++l) layer();
    });
    const double flop = double(c.depth) * 3.0 * 4.0 * pairs * double(c.hidden_size);
    state.counters["TFLOPs"] = slime::bench::per_second(flop, t, 1e12);
    state.counters["flop"] = flop;
    state.counters["patches"] = double(P);
  });
}

}  // namespace

int main(int argc, char** argv) {
  for (const TowerShape& s : kShapes) {
    for (const bool backward : {false, true})
      slime::bench::register_manual(
          std::string("vision_tower/") + s.name + (backward ? "/fwd_bwd" : "/fwd"),
          [s, backward](benchmark::State& st) { run_tower(st, s, backward); }, benchmark::kMillisecond, kIterations,
          kRepetitions);
    slime::bench::register_manual(
        std::string("vision_tower/") + s.name + "/attention_fwd_bwd",
        [s](benchmark::State& st) { run_attention(st, s); }, benchmark::kMillisecond, kIterations, kRepetitions);
  }
  return slime::bench::run_benchmarks(argc, argv);
}
