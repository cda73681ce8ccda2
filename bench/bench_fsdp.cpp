// bench/bench_fsdp.cpp: the FSDP train step of dense Qwen3s (~0.5B and
// Qwen3-1.7B's shape), of a small Qwen3-MoE (with and without expert
// parallelism) and of a Qwen3-VL (Qwen3-VL-2B's tower, 8 text layers) on 1
// and 2 H200s, Sharded<Qwen3Model, FullShard> /
// Sharded<Qwen3VLModel, FullShard> over NcclComm, beside PyTorch FSDP2 on
// transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM /
// Qwen3VLForConditionalGeneration (bench/torch_fsdp2.py, which also prints
// the side-by-side table with the 1 -> 2 GPU scaling).
//
// Model "dense0.5b" (Qwen3-0.6B's shape with 24 layers): hidden 1024, 24
// layers, 16 heads / 8 KV heads, head_dim 128, intermediate 3072, vocab
// 151936, tied embeddings, rope_theta 1e6: 533.1M parameters.
// Model "dense1.7b" (Qwen3-1.7B's shape; opt-in, see Selection): hidden 2048,
// 28 layers, 16 heads / 8 KV heads, head_dim 128, intermediate 6144, vocab
// 151936, tied embeddings, rope_theta 1e6, rms_norm_eps 1e-6: 1720.6M
// parameters (1409.4M outside the embedding). The same 8 x 2048 tokens per
// GPU as the others: torch's side fits one 139 GiB H200 (estimate, from
// dense0.5b's measured 60.6 GiB: fp32 parameters + gradients + AdamW moments
// 16 B x 1.72 G = 25.6 GiB, saved activations of eager transformers about
// 104 KB per token and layer = 44.6 GiB, fp32 logits, their log-softmax and
// its gradient about 28 GiB: ~100 GiB on 1 GPU, ~88 GiB on 2); if it does
// not, its row reports the out-of-memory error instead of a time.
// Model "moe" (Qwen3-MoE, no expert parallelism: the stacked expert weights
// shard like any parameter of their layer's unit): hidden 1024, 8 layers, 16
// heads / 4 KV heads, head_dim 64, every layer sparse (decoder_sparse_step 1,
// no mlp_only_layers) with 32 experts top-4, moe_intermediate 384,
// norm_topk_prob, vocab 32000, untied LM head, rope_theta 1e6 (intermediate
// 3072 is unused: no dense MLP layer): 388.8M parameters, 91.8M of them
// active per token (attention, router, 4 experts, LM head; embedding not
// counted). No load-balancing loss (output_router_logits false, as torch's
// side). The MoE forward copies each sparse layer's expert group sizes to the
// host (SparseMoeBlock::host_group_sizes, the default: cuBLAS grouped GEMMs),
// one stream synchronisation per sparse layer and step.
// Model "moe_ep2" (slime only, 2 GPUs only, opt-in: FSDP2 has no expert
// parallelism to compare with): the "moe" model with expert parallelism, a
// comm::Mesh dp_shard 1 x ep 2 over the 2 ranks: each GPU holds 16 of the 32
// experts of every layer (ExpertParallel<>, the model built with it; its
// slice sharded over dp_shard = 1 rank, i.e. whole on the GPU), the dense
// units (embedding, attention, norms, routers, LM head) sharded over both
// GPUs (dp_shard x ep). Each rank routes its own tokens; the expert rows go
// to their expert's GPU and back by all_to_all_v, which needs host-side row
// counts: one device-to-host copy and stream synchronisation per sparse layer
// in the forward (ExpertParallel::dispatch; it replaces host_group_sizes' one,
// so as many as "moe"). The initial weights are the unsplit model's
// (nn::init_parameters gives each ep rank its slice's values), so loss_first
// equals fsdp/moe/gpus2's up to bf16 rounding. Compare with fsdp/moe/gpus2:
// the same model, tokens and FLOP, the experts exchanged instead of gathered.
// Model "vl2b_8layers" (opt-in, see Selection): Qwen3-VL-2B's vision tower
// (depth 24, hidden 1024, 16 heads of 64, intermediate 4096, 3 channels,
// patch 16, temporal patch 2, spatial merge 2, out_hidden 2048, a 48 x 48
// learned position grid (2304), deepstack after blocks 5, 11, 17: 407.0M
// parameters) and Qwen3-VL-2B's text model with 8 of its 28 layers
// (qwen3_vl_text: hidden 2048, 16 heads / 8 KV heads, head_dim 128,
// intermediate 6144, vocab 151936, tied embeddings, rope_theta 5e6,
// interleaved MRoPE sections [24, 20, 20], max_position_embeddings 262144,
// rms_norm_eps 1e-6: 713.9M parameters), transformers' default special token
// ids (image 151655, vision start / end 151652 / 151653): 1120.8M
// parameters. Units: patch embedding, 24 blocks, mergers, then the language
// model's (Qwen3VLModel::units). The tower trains (forward and backward; no
// pixel gradient). Its forward builds the image segments, rotary positions
// and position-table taps on the host and copies them up every step
// (nn/vision.hpp), inside the timed step.
// All: random init (std 0.02, norm weights 1), bf16 compute, fp32 master
// weights, fp32 gradient reduction, AdamW (lr 1e-5, betas 0.9 / 0.999, eps
// 1e-8, weight decay 0.01, no grad clipping). No activation checkpointing
// (neither side).
//
// Data, weak scaling: every rank trains on its own 8 sequences of 2048 tokens
// per step (16384 tokens per rank, 32768 per step on 2 GPUs), packed
// ([16384] with cu_seqlens, causal attention inside each sequence, positions
// restarting at 0). Sequence s of rank r holds the tokens x(j) = ((r * 8 + s)
// * 2049 + j) * 2654435761 mod vocab for j = 0 .. 2048: inputs j < 2048,
// targets j >= 1 (the next token), so every one of the 16384 positions has a
// target. torch_fsdp2.py builds the same tokens (as 8 rows of 2048).
// vl2b_8layers instead: sequence s of rank r is vision_start, 196 image pads
// (its one 448 x 448 image: grid (1, 28, 28) = 784 patches, 196 after the 2 x
// 2 merge), vision_end, then text y(j) = ((r * 8 + s) * 2049 + j) *
// 2654435761 mod 151643 (below Qwen's first special token, so no text token
// is a placeholder) for j = 198 .. 2048; inputs j < 2048, targets j >= 1
// (every position has a target, image positions included: the same 16384
// logprobs as the text rows). The image's pixel rows [784, 1536] ~ N(0, 1)
// (f32 on the host, cast to bf16), one VLSequence per sequence, packed by
// nn::make_vl_batch (MRoPE positions, equal to transformers' get_rope_index
// on this layout) once before the steps. torch_fsdp2.py builds the same
// tokens and grids (its pixel values: its own N(0, 1) draw).
//
// One step (the timed unit): zero_grad, forward, the fused lm-head + token
// log-probabilities (ops::token_logprobs: logits never materialised; it also
// computes the entropy), its backward with d logprob = -1 / (global tokens)
// (the loss is the mean negative log-likelihood over the step's tokens of all
// ranks; gradients summed over ranks), backward, AdamW on the master shards.
// No other host synchronisation inside a step (the loss is read only outside
// the timed steps).
//
// Rank drivers: run_nccl_ranks (one thread and one GPU per rank): 1 rank for
// fsdp/<model>/gpus1 (a 1-rank communicator: Sharded adds no copies),
// 2 ranks for gpus2 (FullShard: all-gathers prefetched on the communication
// stream, reduce-scatters overlapped with the backward).
//
// Selection: the rows of the models named in the environment variable
// SLIME_BENCH_FSDP_MODELS (comma-separated; "all" for every model), read when
// the benchmarks are registered; default "dense0.5b,moe" (the rows
// tools/gpu-test.sh runs within its 90 s: fsdp/dense0.5b/gpus1, gpus2,
// fsdp/moe/gpus1, gpus2). An unknown name is an error. --benchmark_filter
// selects among the registered rows as usual. The other rows:
//   fsdp/dense1.7b/gpus1, fsdp/dense1.7b/gpus2, fsdp/moe_ep2/gpus2,
//   fsdp/vl2b_8layers/gpus1, fsdp/vl2b_8layers/gpus2
// reproduced (from the repository root, on 2 GPUs; torch's side measures
// dense1.7b only: moe_ep2 has no FSDP2 counterpart) by
//   SLIME_BENCH_FSDP_MODELS=dense1.7b,moe_ep2 build/gpu/bench/bench_fsdp --benchmark_out=bench_fsdp_new.json
//   python3 bench/torch_fsdp2.py --models dense1.7b --out torch_fsdp_new.json
//   torchrun --nproc-per-node 2 bench/torch_fsdp2.py --models dense1.7b --append --out torch_fsdp_new.json
//   python3 bench/torch_fsdp2.py --table --slime bench_fsdp_new.json --out torch_fsdp_new.json
// (--benchmark_out writes Google Benchmark's JSON, its default format). The
// table takes several --slime files: `--slime bench_fsdp.json
// bench_fsdp_new.json` (tools/gpu-test.sh's run, which has fsdp/moe/gpus2,
// and this one) also prints moe_ep2 against moe on 2 GPUs.
// SLIME_BENCH_FSDP_MODELS=all and --models all measure every row. The VL row
// on one GPU, both sides in the same run:
//   export SLIME_BENCH_FSDP_MODELS=vl2b_8layers
//   build/gpu/bench/bench_fsdp --benchmark_filter=vl2b_8layers/gpus1 --benchmark_out=bench_fsdp_vl.json
//   python3 bench/torch_fsdp2.py --models vl2b_8layers --out torch_fsdp_vl.json
//   python3 bench/torch_fsdp2.py --table --slime bench_fsdp_vl.json --out torch_fsdp_vl.json
//
// Method (issue 19: honest step benchmarks), `reps` = 3 repetitions, each
// building the model and the ranks anew: build, `warmup` untimed steps (the
// first one's loss is checked: finite and within 1 of ln(vocab), as for any
// near-uniform random init), barrier, reset the peak of
// slime::memory_stats(device), `steps` = 20 steps with a CUDA event on the
// compute stream before each and after the last, then one synchronisation
// (warm-up: 3 steps, moe and moe_ep2 2). A step's time is the slowest rank's,
// a repetition's time its median step; the reported iteration time (us) is
// the median of the repetitions' times (one Google Benchmark iteration holds
// the whole measurement), with rep_min_us, rep_max_us and spread_pct (their
// difference over the median, %). torch_fsdp2.py times FSDP2 the same way.
// Counters (per configuration):
//   tokens_per_s     ranks * 16384 / median step time (all GPUs together;
//                    VL: every position, image tokens included)
//   patches_per_s    VL only: ranks * 8 * 784 / median step time (with
//                    patches_per_step, images_per_step)
//   peak_gib         max over ranks of memory_stats(device).peak_bytes during
//                    the timed steps (everything slime allocated: shards,
//                    optimizer states, gathered units, activations, workspace)
//   reserved_gib     max over ranks of the CUDA pool's reserved bytes after the
//                    timed steps (the pool is emptied before each run)
//   tflops           model FLOP per GPU per second: 6 * tokens * matmul params
//                    active per token (lm head included; MoE layers: router
//                    + top-k experts) + 6 * layers * seqs * 2048^2 * heads *
//                    head_dim (causal attention, forward + backward). Under
//                    expert parallelism the same per GPU: each GPU computes
//                    its own tokens' dense layers and, on average, as many
//                    expert rows (its experts' rows from both GPUs) as
//                    without it (routing imbalance shows as time, not FLOP).
//                    VL: plus the tower's forward + backward
//                    (bench::vision_tower_flop: 13.8 TFLOP of the step's
//                    87.3)
//   ep               the expert-parallel degree (1: none)
//   reps, rep_min_us, rep_max_us, spread_pct (see Method)
//   mean_us, min_us, max_us (over every timed step), loss_first (the first
//   repetition's), loss_last (the last one's), gpus, tokens_per_step, steps
//   (timed, per repetition)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench_models.hpp"
#include "bench_util.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/comm/nccl_comm.hpp"
#include "slime/core/memory.hpp"
#include "slime/core/random.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/nn/qwen3_vl.hpp"
#include "slime/ops/batch_invariant.hpp"
#include "slime/parallel/expert_parallel.hpp"
#include "slime/parallel/sharded.hpp"

namespace {

using namespace slime;

constexpr int kSeqs = 8;           // sequences per rank and step
constexpr int64_t kSeqLen = 2048;  // tokens per sequence
constexpr double kLr = 1e-5;
constexpr double kGiB = double(int64_t(1) << 30);
// vl2b_8layers: one kImageSide x kImageSide image per sequence; text tokens
// drawn below kTextVocab, Qwen's first special token (<|endoftext|>), so none
// is an image placeholder or vision marker.
constexpr int64_t kImageSide = 448;
constexpr int64_t kTextVocab = 151643;

// A benchmarked model: its row name, config, step counts, expert-parallel
// degree and GPU counts.
struct BenchModel {
  std::string name;
  nn::Qwen3Config config;                              // the language model's (a VL model's text_config)
  std::optional<nn::Qwen3VLConfig> vl = std::nullopt;  // set for a Qwen3-VL model (vl->text == config)
  int warmup = 3;                                      // untimed steps of each repetition
  int steps = 20;                                      // timed steps of each repetition
  int reps = 3;  // repetitions (each builds the model and the ranks anew); the median of their medians is reported
  int ep = 1;    // expert-parallel degree: mesh dp_shard (ranks / ep) x ep when > 1
  std::vector<int> gpus = {1, 2};
  std::string description;  // for the benchmark context
};

BenchModel dense_model() {
  return {
      .name = "dense0.5b",
      .config = bench::dense_0p5b_config(),
      .warmup = 3,
      .steps = 20,
      .description = "Qwen3 hidden 1024, 24 layers, 16/8 heads, head_dim 128, intermediate 3072, vocab 151936, tied"};
}

BenchModel dense_1p7b_model() {
  return {.name = "dense1.7b",
          .config = bench::dense_1p7b_config(),
          .warmup = 3,
          .steps = 20,
          .description =
              "Qwen3-1.7B's shape: hidden 2048, 28 layers, 16/8 heads, head_dim 128, intermediate 6144, vocab 151936, "
              "tied"};
}

BenchModel moe_model() {
  return {.name = "moe",
          .config = bench::moe_config(),
          .warmup = 2,
          .steps = 20,
          .description =
              "Qwen3-MoE hidden 1024, 8 layers (all sparse), 16/4 heads, head_dim 64, 32 experts top-4, "
              "moe_intermediate 384, norm_topk_prob, vocab 32000, untied, no expert parallelism, no aux loss"};
}

// "moe" with its experts split over 2 GPUs (mesh dp_shard 1 x ep 2).
BenchModel moe_ep2_model() {
  BenchModel m = moe_model();
  m.name = "moe_ep2";
  m.ep = 2;
  m.gpus = {2};
  m.description =
      "moe with expert parallelism: mesh dp_shard 1 x ep 2, 16 of the 32 experts per GPU (all_to_all_v token "
      "exchange), dense units sharded over both GPUs (slime only)";
  return m;
}

// Qwen3-VL-2B's tower with 8 of its 28 text layers (see the file comment).
BenchModel vl2b_8layers_model() {
  nn::Qwen3VLConfig vl;
  vl.text = bench::vl2b_8layers_text_config();
  vl.vision = bench::qwen3_vl_2b_vision_config();
  vl.validate();  // transformers' default special token ids (image 151655, vision start / end 151652 / 151653)
  return {.name = "vl2b_8layers",
          .config = vl.text,
          .vl = vl,
          .warmup = 3,
          .steps = 20,
          .description =
              "Qwen3-VL-2B's tower (depth 24, hidden 1024, 16 heads of 64, intermediate 4096, patch 16, "
              "temporal 2, merge 2, deepstack 5/11/17) + its text model with 8 layers (hidden 2048, 16/8 "
              "heads, head_dim 128, intermediate 6144, vocab 151936, tied, rope_theta 5e6, mrope "
              "[24, 20, 20]); one 448x448 image (784 patches, 196 tokens) per 2048-token sequence"};
}

// Every model, in row order.
std::vector<BenchModel> all_models() {
  return {dense_model(), moe_model(), dense_1p7b_model(), moe_ep2_model(), vl2b_8layers_model()};
}

constexpr const char* kDefaultModels = "dense0.5b,moe";  // tools/gpu-test.sh's rows

// The models named in SLIME_BENCH_FSDP_MODELS (unset or empty:
// kDefaultModels; "all": every model), in all_models()' order. Throws for an
// unknown name or a list of none.
std::vector<BenchModel> selected_models() {
  const char* env = std::getenv("SLIME_BENCH_FSDP_MODELS");
  const std::string spec = env != nullptr && *env != 0 ? env : kDefaultModels;
  const std::vector<BenchModel> all = all_models();
  std::vector<std::string> names;
  std::size_t begin = 0;
  while (begin <= spec.size()) {
    std::size_t end = spec.find(',', begin);
    if (end == std::string::npos) end = spec.size();
    std::string name = spec.substr(begin, end - begin);
    name.erase(0, name.find_first_not_of(" \t"));
    name.erase(name.find_last_not_of(" \t") + 1);
    if (!name.empty()) names.push_back(name);
    begin = end + 1;
  }
  std::string known;
  for (const BenchModel& bm : all) known += (known.empty() ? "" : ", ") + bm.name;
  SLIME_CHECK(!names.empty(), "SLIME_BENCH_FSDP_MODELS='", spec, "' names no model (models: ", known, ", or all)");
  for (const std::string& n : names) {
    bool found = n == "all";
    for (const BenchModel& bm : all) found |= bm.name == n;
    SLIME_CHECK(found, "SLIME_BENCH_FSDP_MODELS: unknown model '", n, "' (models: ", known, ", or all)");
  }
  std::vector<BenchModel> out;
  for (const BenchModel& bm : all)
    if (std::find(names.begin(), names.end(), bm.name) != names.end() ||
        std::find(names.begin(), names.end(), "all") != names.end())
      out.push_back(bm);
  return out;
}

// The image grids of one rank's step: kSeqs images of 1 x 28 x 28 patches.
std::vector<nn::GridThw> vl_grids(const nn::Qwen3VLConfig& c) {
  const int64_t side = kImageSide / c.vision.patch_size;
  return std::vector<nn::GridThw>(std::size_t(kSeqs), nn::GridThw{1, side, side});
}

// Model FLOP of one rank's step (see the file comment; the same with and
// without expert parallelism; a VL model's tower added).
double step_flop(const BenchModel& bm) {
  const nn::Qwen3Config& c = bm.config;
  const double d = double(c.hidden_size), qd = double(c.num_attention_heads) * c.head_dim,
               kvd = double(c.num_key_value_heads) * c.head_dim;
  double matmul_params = double(c.vocab_size) * d;  // the LM head
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    matmul_params += d * qd + 2 * d * kvd + qd * d;
    matmul_params += c.is_sparse_layer(l) ? d * double(c.num_experts) +
                                                double(c.num_experts_per_tok) * 3 * d * double(c.moe_intermediate_size)
                                          : 3 * d * double(c.intermediate_size);
  }
  const double tokens = double(kSeqs) * double(kSeqLen);
  const double attention = 6.0 * c.num_hidden_layers * kSeqs * double(kSeqLen) * double(kSeqLen) * qd;
  const double tower = bm.vl ? bench::vision_tower_flop(bm.vl->vision, vl_grids(*bm.vl), /*backward=*/true) : 0.0;
  return 6.0 * tokens * matmul_params + attention + tower;
}

template <class Batch>
struct RankData {
  Batch batch;
  Tensor targets;  // i32 [kSeqs * kSeqLen]
};

// The tokens of the file comment: x(j) for sequence s of rank r.
RankData<nn::PackedBatch> rank_data(int rank, int64_t vocab, Device dev) {
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> targets;
  for (int s = 0; s < kSeqs; ++s) {
    const uint64_t base = uint64_t(rank * kSeqs + s) * uint64_t(kSeqLen + 1);
    std::vector<int32_t> x;
    for (int64_t j = 0; j <= kSeqLen; ++j) x.push_back(int32_t((base + uint64_t(j)) * 2654435761ull % uint64_t(vocab)));
    targets.insert(targets.end(), x.begin() + 1, x.end());
    x.pop_back();
    seqs.push_back(std::move(x));
  }
  RankData<nn::PackedBatch> d;
  d.batch = nn::make_packed_batch(seqs, dev);
  d.targets = Tensor::from_vector(targets, {int64_t(targets.size())}, dev);
  return d;
}

// vl2b_8layers' batch (see the file comment): sequence s of rank r is
// vision_start, 196 image pads, vision_end, then text y(j) = ((r * 8 + s) *
// 2049 + j) * 2654435761 mod 151643 for j = 198 .. 2048; inputs j < 2048,
// targets j >= 1. Its image: pixel rows [784, 1536] ~ N(0, 1) (seed 1000 + r *
// 8 + s), grid (1, 28, 28).
RankData<nn::VLBatch> vl_rank_data(int rank, const nn::Qwen3VLConfig& c, Device dev) {
  for (const int32_t id : {c.image_token_id, c.vision_start_token_id, c.vision_end_token_id})
    SLIME_CHECK(id >= kTextVocab, "vl_rank_data: special token ", id, " is inside the text tokens' range [0, ",
                kTextVocab, ")");
  const nn::GridThw grid = vl_grids(c)[0];
  const int64_t patches = grid[0] * grid[1] * grid[2], merged = patches / c.vision.merge_unit();
  std::vector<nn::VLSequence> seqs;
  std::vector<int32_t> targets;
  for (int s = 0; s < kSeqs; ++s) {
    const uint64_t base = uint64_t(rank * kSeqs + s) * uint64_t(kSeqLen + 1);
    std::vector<int32_t> y{c.vision_start_token_id};
    y.insert(y.end(), std::size_t(merged), c.image_token_id);
    y.push_back(c.vision_end_token_id);
    for (int64_t j = int64_t(y.size()); j <= kSeqLen; ++j)
      y.push_back(int32_t((base + uint64_t(j)) * 2654435761ull % uint64_t(kTextVocab)));
    targets.insert(targets.end(), y.begin() + 1, y.end());
    y.pop_back();
    Tensor pixels = Tensor::empty({patches, c.vision.patch_dim()}, DType::f32);
    fill_normal(pixels, uint64_t(1000 + rank * kSeqs + s), 0, 0.f, 1.f);
    seqs.push_back({.tokens = std::move(y), .grids = {grid}, .pixel_values = pixels});
  }
  RankData<nn::VLBatch> d;
  d.batch = nn::make_vl_batch(seqs, c, dev, DType::bf16);
  d.targets = Tensor::from_vector(targets, {int64_t(targets.size())}, dev);
  return d;
}

struct RankResult {
  std::vector<double> step_ms;  // one per timed step
  int64_t peak_bytes = 0, reserved_bytes = 0;
  double loss_first = 0, loss_last = 0;
};

double mean_nll(const Tensor& logprobs, const Stream& s) {
  double sum = 0;
  const std::vector<float> lp = logprobs.to_vector<float>(s);
  for (float v : lp) sum += double(v);
  return -sum / double(lp.size());
}

using ShardedQwen3 = parallel::Sharded<nn::Qwen3Model, parallel::FullShard>;
using ShardedQwen3VL = parallel::Sharded<nn::Qwen3VLModel, parallel::FullShard>;

optim::AdamWConfig adamw_config() {
  optim::AdamWConfig adamw;
  adamw.lr = kLr;
  adamw.beta1 = 0.9;
  adamw.beta2 = 0.999;
  adamw.eps = 1e-8;
  adamw.weight_decay = 0.01;
  return adamw;
}

// The warm-up and timed steps of one rank (see the file comment) on a built
// Sharded model and its batch (nn::PackedBatch or nn::VLBatch).
template <class ShardedModel, class Batch>
void time_steps(comm::NcclComm& comm, ShardedModel& sh, const RankData<Batch>& data, const BenchModel& bm,
                RankResult& out) {
  const Device dev = comm.device();
  const Stream s = Stream::create(dev);
  const int64_t T = data.batch.num_tokens();
  // d loss / d logprob_t for loss = -sum over all ranks' tokens / their count.
  const Tensor grad_lp =
      Tensor::from_vector(std::vector<float>(std::size_t(T), float(-1.0 / double(T * comm.size()))), {T}, dev);
  Stream::default_for(dev).synchronize();  // the batch and grad_lp were written on the default stream

  // One Context for every step: its buffers, sized by the first step, hold
  // the activations and the LM head's outputs of the next ones, and Sharded
  // reuses its communication buffers (a steady-state step allocates nothing;
  // nn::detail::context_buffer, parallel::BufferCache).
  typename ShardedModel::Context ctx;
  auto step = [&]() -> Tensor {
    sh.zero_grad(s);
    const Tensor hidden = sh.forward(data.batch, ctx, s);
    ops::TokenLogprobs lp = sh.token_logprobs(ctx, hidden, data.targets, 1.f, s);
    const Tensor d_hidden = sh.token_logprobs_backward(ctx, hidden, data.targets, 1.f, lp, grad_lp, Tensor{}, s);
    sh.backward(ctx, d_hidden, s);
    sh.optimizer_step(kLr, 0, s);
    return lp.logprobs;
  };

  out.loss_first = mean_nll(step(), s);
  for (int i = 1; i < bm.warmup; ++i) step();
  s.synchronize();
  comm.barrier();
  reset_peak_memory_stats(dev);
  std::vector<Event> marks;
  for (int i = 0; i <= bm.steps; ++i) marks.emplace_back(dev);
  Tensor last;
  for (int i = 0; i < bm.steps; ++i) {
    marks[std::size_t(i)].record(s);
    last = step();
  }
  marks.back().record(s);
  s.synchronize();
  for (int i = 0; i < bm.steps; ++i)
    out.step_ms.push_back(double(Event::elapsed_ms(marks[std::size_t(i)], marks[std::size_t(i) + 1])));
  const MemoryStats m = memory_stats(dev);
  out.peak_bytes = m.peak_bytes;
  out.reserved_bytes = m.reserved_bytes;
  out.loss_last = mean_nll(last, s);
  comm.barrier();  // neither rank tears down while the other may still be in a collective
}

// One rank's whole measurement (see the file comment).
void train_rank(comm::NcclComm& comm, const BenchModel& bm, RankResult& out) {
  const Device dev = comm.device();
  const int world = comm.size();
  release_cached_memory(dev);        // a clean pool: reserved_bytes is this run's
  parallel::ShardedOptions options;  // bf16 compute (the module's), fp32 master, fp32 reduction
  if (bm.vl) {
    nn::Qwen3VLModel model(*bm.vl, {dev, DType::bf16});
    model.init_random(1, 0.02f, Stream::default_for(dev));  // the same weights on every rank
    ShardedQwen3VL sh(std::move(model), comm, options, adamw_config());
    time_steps(comm, sh, vl_rank_data(comm.rank(), *bm.vl, dev), bm, out);
    return;
  }
  const nn::Qwen3Config& cfg = bm.config;
  // Expert parallelism: the mesh and the ExpertParallel (declared before the
  // model and sh, so they outlive both).
  std::unique_ptr<comm::Mesh> mesh;
  std::unique_ptr<parallel::ExpertParallel<>> ep;
  if (bm.ep > 1) {
    SLIME_CHECK(world % bm.ep == 0, bm.name, ": ep ", bm.ep, " does not divide the ", world, " ranks");
    mesh = std::make_unique<comm::Mesh>(
        comm, comm::MeshShape{.dp_replicate = 1, .dp_shard = world / bm.ep, .cp = 1, .ep = bm.ep});
    ep = std::make_unique<parallel::ExpertParallel<>>(*mesh, cfg.num_experts);
  }
  nn::Qwen3Model model(cfg, {dev, DType::bf16}, ep.get());
  // The same weights on every rank (an ep rank: its slice of the unsplit model's).
  model.init_random(1, 0.02f, Stream::default_for(dev));
  // Without expert parallelism over the communicator (as before the mesh
  // existed); with it over the mesh: dense units over dp_shard x ep, expert
  // units over dp_shard. (Returned as prvalues: sh is built in place.)
  ShardedQwen3 sh = [&]() {
    if (mesh) return ShardedQwen3(std::move(model), *mesh, options, adamw_config());
    return ShardedQwen3(std::move(model), comm, options, adamw_config());
  }();
  time_steps(comm, sh, rank_data(comm.rank(), cfg.vocab_size, dev), bm, out);
}

// The median of `v` (not empty).
double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

void run_fsdp(benchmark::State& state, const BenchModel& bm, int ranks) {
  if (bench::skip_without_cuda(state)) return;
  const int devices = cuda_device_count();
  if (devices < ranks) {
    state.SkipWithError(detail::concat("needs ", ranks, " CUDA devices, this process sees ", devices).c_str());
    return;
  }
  bench::run_or_skip(state, [&] {
    const nn::Qwen3Config& cfg = bm.config;
    const int n = bm.steps;
    for (auto _ : state) {
      std::vector<double> rep_ms;  // each repetition's median step
      std::vector<double> all_ms;  // every timed step of every repetition
      int64_t peak = 0, reserved = 0;
      double loss_first = 0, loss_last = 0;
      for (int rep = 0; rep < bm.reps; ++rep) {
        std::vector<RankResult> results(static_cast<std::size_t>(ranks));
        comm::run_nccl_ranks(ranks,
                             [&](comm::NcclComm& comm) { train_rank(comm, bm, results[std::size_t(comm.rank())]); });
        // Checks: a near-uniform start (random init, std 0.02) and no blow-up.
        const double ln_v = std::log(double(cfg.vocab_size));
        for (int r = 0; r < ranks; ++r) {
          const RankResult& rr = results[std::size_t(r)];
          if (!(std::abs(rr.loss_first - ln_v) < 1.0) || !std::isfinite(rr.loss_last) || rr.loss_last > ln_v + 1.0) {
            state.SkipWithError(detail::concat("correctness check failed on rank ", r, " (repetition ", rep,
                                               "): first loss ", rr.loss_first, ", last loss ", rr.loss_last,
                                               ", expected about ln(vocab) = ", ln_v)
                                    .c_str());
            return;
          }
        }
        std::vector<double> step_ms(std::size_t(n), 0.0);  // the slowest rank's time of each step
        for (const RankResult& rr : results) {
          for (int i = 0; i < n; ++i)
            step_ms[std::size_t(i)] = std::max(step_ms[std::size_t(i)], rr.step_ms[std::size_t(i)]);
          peak = std::max(peak, rr.peak_bytes);
          reserved = std::max(reserved, rr.reserved_bytes);
        }
        rep_ms.push_back(median_of(step_ms));
        all_ms.insert(all_ms.end(), step_ms.begin(), step_ms.end());
        if (rep == 0) loss_first = results[0].loss_first;
        loss_last = results[0].loss_last;
      }
      const double median_ms = median_of(rep_ms);
      const auto [rep_min, rep_max] = std::minmax_element(rep_ms.begin(), rep_ms.end());
      const auto [step_min, step_max] = std::minmax_element(all_ms.begin(), all_ms.end());
      double mean_ms = 0;
      for (double t : all_ms) mean_ms += t / double(all_ms.size());
      state.SetIterationTime(median_ms * 1e-3);

      const double tokens_per_step = double(ranks) * kSeqs * double(kSeqLen);
      state.counters["tokens_per_s"] = tokens_per_step / (median_ms * 1e-3);
      state.counters["tokens_per_step"] = tokens_per_step;
      state.counters["gpus"] = ranks;
      state.counters["ep"] = bm.ep;
      state.counters["steps"] = n;
      state.counters["reps"] = bm.reps;
      state.counters["rep_min_us"] = *rep_min * 1e3;
      state.counters["rep_max_us"] = *rep_max * 1e3;
      state.counters["spread_pct"] = 100.0 * (*rep_max - *rep_min) / median_ms;
      state.counters["peak_gib"] = double(peak) / kGiB;
      state.counters["reserved_gib"] = double(reserved) / kGiB;
      state.counters["tflops"] = bench::per_second(step_flop(bm), median_ms * 1e-3, 1e12);
      if (bm.vl) {
        int64_t patches = 0;
        for (const nn::GridThw& g : vl_grids(*bm.vl)) patches += g[0] * g[1] * g[2];
        const double patches_per_step = double(ranks) * double(patches);
        state.counters["patches_per_s"] = patches_per_step / (median_ms * 1e-3);
        state.counters["patches_per_step"] = patches_per_step;
        state.counters["images_per_step"] = double(ranks) * kSeqs;
      }
      state.counters["mean_us"] = mean_ms * 1e3;
      state.counters["min_us"] = *step_min * 1e3;
      state.counters["max_us"] = *step_max * 1e3;
      state.counters["loss_first"] = loss_first;
      state.counters["loss_last"] = loss_last;
    }
  });
}

}  // namespace

int main(int argc, char** argv) {
  // Never NVLink multicast (shared hosts); an explicit setting is left alone.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  std::vector<BenchModel> models;
  try {
    models = selected_models();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_fsdp: %s\n", e.what());
    return 2;
  }
  // SLIME_BENCH_FSDP_BATCH_INVARIANT=1 adds a ".../batch_invariant" row after
  // each row: the same step in the batch-invariant mode (its cost, issue 20).
  const char* bi = std::getenv("SLIME_BENCH_FSDP_BATCH_INVARIANT");
  const bool with_batch_invariant = bi != nullptr && std::string(bi) == "1";
  for (const BenchModel& bm : models) {
    for (int ranks : bm.gpus) {
      for (bool invariant : {false, true}) {
        if (invariant && !with_batch_invariant) continue;
        // One iteration holds the whole measurement (warm-up + timed steps);
        // its time is the median step.
        bench::register_manual(
            "fsdp/" + bm.name + "/gpus" + std::to_string(ranks) + (invariant ? "/batch_invariant" : ""),
            [bm, ranks, invariant](benchmark::State& state) {
              ops::BatchInvariantScope mode(invariant);
              run_fsdp(state, bm, ranks);
            },
            benchmark::kMillisecond,
            /*iterations=*/1, /*repetitions=*/1);
      }
    }
  }
  return bench::run_benchmarks(argc, argv, [&models] {
    // "model" and "model_moe" as before; "model_<name>" for the other models selected.
    for (const BenchModel& bm : models)
      benchmark::AddCustomContext(bm.name == "dense0.5b" ? std::string("model")
                                  : bm.name == "moe"     ? std::string("model_moe")
                                                         : "model_" + bm.name,
                                  bm.name + ": " + bm.description);
    std::string names, steps;
    for (const BenchModel& bm : models) {
      names += (names.empty() ? "" : ",") + bm.name;
      steps += (steps.empty() ? "" : "; ") + bm.name + ": " + std::to_string(bm.reps) + " x (" +
               std::to_string(bm.warmup) + " warm-up + " + std::to_string(bm.steps) + " timed)";
    }
    benchmark::AddCustomContext("models", names + " (SLIME_BENCH_FSDP_MODELS; default " + kDefaultModels + ")");
    benchmark::AddCustomContext("tokens_per_rank", std::to_string(kSeqs) + " x " + std::to_string(kSeqLen));
    benchmark::AddCustomContext("steps", steps);
    try {
      benchmark::AddCustomContext("nccl_version", comm::NcclComm::nccl_version());
    } catch (const std::exception& e) {
      benchmark::AddCustomContext("nccl_version", std::string("unknown: ") + e.what());
    }
  });
}
