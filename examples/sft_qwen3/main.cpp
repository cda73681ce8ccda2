// sft_qwen3: supervised fine-tuning of a Qwen3 model on uint32 token files,
// packed into micro-batches under a token budget and sharded with FSDP
// (slime::parallel::Sharded), optionally with context parallelism
// (slime::parallel::ContextParallel, --cp). A template to copy: the files are
//   main.cpp        options, devices and launch (this file)
//   trainer.hpp     one rank's training loop
//   token_data.hpp  token files -> documents -> training sequences; synthetic data
//   checkpoint.hpp  sharded train-state checkpoints
// and from the library the launch of the ranks (slime/comm/launch.hpp) and
// the Hugging Face export (slime/parallel/export_hf.hpp).
//
// Runs:
//   sft_qwen3                                  synthetic data, built-in tiny model,
//                                              2 CPU ranks (or the GPUs)
//   sft_qwen3 --data corpus/ --model Qwen3-0.6B --steps 2000 --export-hf out
//   sft_qwen3 --ranks 4 --cp 2                 2 data-parallel x 2 context-parallel ranks
//   torchrun --no-python --nproc-per-node 8 sft_qwen3 --device cuda --data corpus/ ...
//   sft_qwen3 --short --verify-resume          the CI check (see verify_resume)
//   sft_qwen3 --short --verify-cp --ranks 4 --cp 2   the CI check of --cp (see verify_cp)
#include <fmt/core.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "slime/comm/launch.hpp"
#include "slime/core/device.hpp"
#include "slime/nn/config.hpp"
#include "token_data.hpp"
#include "trainer.hpp"

namespace {

namespace fs = std::filesystem;
using sft::RunResult;
using sft::TokenDataset;
using sft::TrainOptions;

// Runs one training run on every rank (slime/comm/launch.hpp: threads of
// this process, LocalComm on the CPU or NCCL with one GPU each, or this
// process as one rank of a torchrun / mpirun / srun job); returns rank 0's
// result (empty in the other processes of a job).
RunResult run(const slime::comm::Launch& l, const TrainOptions& o, const TokenDataset& data,
              const slime::nn::Qwen3Config& config) {
  return slime::comm::run_ranks(l, [&](slime::comm::Comm& comm) { return sft::train_rank(comm, o, data, config); })
      .value_or(RunResult{});
}

// A directory for this run's scratch files, removed at exit.
class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / fmt::format("sft_qwen3-{}-{}", ::getpid(), slime::io::detail::make_nonce());
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

double mean_loss(const std::vector<std::pair<int64_t, double>>& losses, std::size_t begin, std::size_t end) {
  double sum = 0;
  for (std::size_t i = begin; i < end; ++i) sum += losses[i].second;
  return sum / double(end - begin);
}

// Trains the first and the last quarter of the steps' mean loss; the run
// learns when the last is below `factor` times the first.
bool report_loss_drop(const RunResult& r, double factor) {
  const std::size_t n = r.losses.size(), q = std::max<std::size_t>(1, n / 4);
  if (n < 2) return true;
  const double first = mean_loss(r.losses, 0, q), last = mean_loss(r.losses, n - q, n);
  const bool fell = last < factor * first;
  fmt::print(
      "loss: first {} step(s) mean {:.4f} -> last {} step(s) mean {:.4f} ({}; criterion: last < {:.2f} x first)\n", q,
      first, q, last, fell ? "falls" : "DOES NOT FALL", factor);
  return fell;
}

// --verify-resume: (1) an uninterrupted run of --steps; (2) the same run
// stopped after step k = steps / 2, right after its checkpoint (as a
// preempted job); (3) a new run resuming from that checkpoint. The losses of
// steps k + 1 .. steps of (3) must equal those of (1): bit for bit on the CPU
// (LocalComm and the CPU kernels are deterministic), to 1e-5 relative on
// GPUs. The loss of (1) must also fall (first vs last quarter of the steps).
int verify_resume(const slime::comm::Launch& l, const TrainOptions& o, const TokenDataset& data,
                  const slime::nn::Qwen3Config& config, const fs::path& scratch) {
  sft::require(o.steps >= 2, "--verify-resume needs --steps >= 2, got ", o.steps);
  sft::require(l.mode != slime::comm::LaunchMode::processes,
               "--verify-resume runs its ranks as threads of one process; start it without a launcher");
  const int64_t k = o.steps / 2;
  fmt::print("verify-resume 1/3: {} uninterrupted steps\n", o.steps);
  TrainOptions full = o;
  full.checkpoint_dir.clear();
  full.resume = false;
  const RunResult a = run(l, full, data, config);

  fmt::print("verify-resume 2/3: the same run, stopped after its checkpoint at step {}\n", k);
  TrainOptions cut = o;
  cut.checkpoint_dir = (scratch / "checkpoints").string();
  cut.checkpoint_every = k;
  cut.stop_after = k;
  cut.resume = false;
  cut.metrics.clear();
  cut.tensorboard.clear();
  cut.export_hf.clear();
  cut.quiet = true;
  run(l, cut, data, config);

  fmt::print("verify-resume 3/3: resume from step {}\n", k);
  TrainOptions resumed = cut;
  resumed.stop_after = 0;
  resumed.resume = true;
  const RunResult c = run(l, resumed, data, config);

  const double tolerance = l.cuda() ? 1e-5 : 0.0;
  bool same = c.first_step == k + 1 && c.losses.size() == std::size_t(o.steps - k);
  for (std::size_t i = 0; same && i < c.losses.size(); ++i) {
    const auto [step, loss] = c.losses[i];
    const double want = a.losses[std::size_t(step - 1)].second;
    const bool ok = std::abs(loss - want) <= tolerance * std::abs(want);
    fmt::print("  step {:3d}  uninterrupted {:.9f}  resumed {:.9f}  {}\n", step, want, loss,
               ok ? "equal" : "DIFFERENT");
    same = same && ok;
  }
  fmt::print("resume: {} ({})\n", same ? "OK" : "MISMATCH",
             l.cuda() ? "criterion: within 1e-5 relative" : "criterion: equal bit for bit");
  const bool fell = report_loss_drop(a, 0.8);
  return same && fell ? 0 : 1;
}

// --verify-cp: the run with --cp N (and --ulysses) against the same run
// with --cp 1 on ranks / N ranks: the same data-parallel ranks, so the same
// data, seed and micro-batches; only the attention and the gradient sums are
// split over the cp ranks. The losses of the first kCpSteps steps must
// agree within 1e-5 relative (f32 rounding: the ring attention and the
// reductions add in another order, and AdamW's steps at --short's lr 1e-2
// grow the difference: --ranks 2 --cp 2 measured 6.7e-6 at step 4 and
// 2.3e-4 at step 12; the later steps are printed, not checked), and the loss
// of the cp run must fall. CPU only (the f32 reference kernels).
int verify_cp(const slime::comm::Launch& l, const std::string& device, const TrainOptions& o, const TokenDataset& data,
              const slime::nn::Qwen3Config& config) {
  constexpr int64_t kCpSteps = 6;
  sft::require(o.cp > 1, "--verify-cp compares --cp N > 1 with --cp 1; give --cp");
  sft::require(l.mode == slime::comm::LaunchMode::local_threads,
               "--verify-cp runs CPU ranks as threads of one process; use --device cpu and no launcher");
  fmt::print("verify-cp 1/2: {} steps on {} ranks, dp {} x cp {} (Ulysses {} x ring {})\n", o.steps, l.world_size,
             l.world_size / o.cp, o.cp, o.ulysses, o.cp / o.ulysses);
  const RunResult a = run(l, o, data, config);
  fmt::print("verify-cp 2/2: the same on {} ranks, dp {} x cp 1\n", l.world_size / o.cp, l.world_size / o.cp);
  TrainOptions plain = o;
  plain.cp = plain.ulysses = 1;
  plain.checkpoint_dir.clear();
  plain.resume = false;
  plain.metrics.clear();
  plain.tensorboard.clear();
  plain.export_hf.clear();
  plain.quiet = true;
  const RunResult b =
      run(slime::comm::plan_launch({.device = device, .ranks = l.world_size / o.cp}), plain, data, config);
  bool same = a.losses.size() == b.losses.size() && !a.losses.empty();
  for (std::size_t i = 0; i < std::min(a.losses.size(), b.losses.size()); ++i) {
    const auto [step, loss] = a.losses[i];
    const double want = b.losses[i].second, rel = std::abs(loss - want) / std::abs(want);
    const bool checked = step <= kCpSteps, ok = !checked || rel <= 1e-5;
    fmt::print("  step {:3d}  cp 1 {:.9f}  cp {} {:.9f}  relative {:.1e}  {}\n", step, want, o.cp, loss, rel,
               !checked ? "(not checked)"
               : ok     ? "equal"
                        : "DIFFERENT");
    same = same && ok;
  }
  fmt::print("cp: {} (criterion: the first {} steps within 1e-5 relative)\n", same ? "OK" : "MISMATCH", kCpSteps);
  const bool fell = report_loss_drop(a, 0.8);
  return same && fell ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "sft_qwen3: supervised fine-tuning of Qwen3 on uint32 token files, packed, with FSDP.\n"
      "Without --data it trains the built-in tiny model on synthetic data."};
  TrainOptions o;
  std::string data_path, device = "auto";
  int ranks = 2;
  int64_t eos_id = -1;
  bool short_mode = false, verify = false, verify_context = false;
  app.add_option("--data", data_path,
                 "token file (.u32, slime token format) or a directory of them; documents end with --eos-id. "
                 "Default: a synthetic file written to a temporary directory");
  app.add_option("--eos-id", eos_id,
                 "the id that ends each document (default: the model's eos_token_id; 0 for the synthetic data)")
      ->check(CLI::Range(int64_t(0), int64_t(UINT32_MAX)));
  app.add_option("--model", o.model,
                 "Hugging Face model directory (config.json + safetensors); default: built-in tiny Qwen3");
  app.add_option("--ranks", ranks, "ranks run as threads of this process: CPU threads, or one GPU each")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--device", device, "auto (CUDA when a GPU is visible), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--steps", o.steps, "optimizer steps")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40))
      ->capture_default_str();
  app.add_option("--lr", o.lr, "peak learning rate")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  app.add_option("--schedule", o.schedule, "learning-rate schedule: constant, warmup (linear, then constant) or cosine")
      ->check(CLI::IsMember({"constant", "warmup", "cosine"}))
      ->capture_default_str();
  app.add_option("--warmup", o.warmup, "warm-up steps (warmup and cosine schedules; by default at most --steps)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40))
      ->capture_default_str();
  app.add_option("--min-lr", o.min_lr, "learning rate at the end of the cosine schedule")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--weight-decay", o.weight_decay, "AdamW weight decay")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--max-grad-norm", o.max_grad_norm, "clip the global gradient norm to this (0: no clipping)")
      ->check(CLI::Range(0.0, 1e9))
      ->capture_default_str();
  app.add_option(
         "--max-tokens-per-rank", o.max_tokens_per_rank,
         "packing budget: tokens per micro-batch of a data-parallel rank (with --cp N its N ranks hold about 1/N "
         "each); longer documents are cut into windows of this")
      ->check(CLI::Range(int64_t(2), int64_t(1) << 30))
      ->capture_default_str();
  app.add_option("--global-batch-tokens", o.global_batch_tokens,
                 "tokens per optimizer step over all ranks (at least this many: whole sequences are drawn)")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 40))
      ->capture_default_str();
  app.add_option("--strategy", o.strategy, "FSDP strategy: full (ZeRO-3), grad_op (ZeRO-2) or no_shard (DDP)")
      ->check(CLI::IsMember({"full", "grad_op", "no_shard"}))
      ->capture_default_str();
  app.add_option("--cp", o.cp,
                 "context parallelism: N ranks share each micro-batch, each holding 1/N of every sequence (the ranks "
                 "are ranks/N data-parallel x N; FSDP shards over all of them)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--ulysses", o.ulysses,
                 "the Ulysses (all-to-all over heads) degree of --cp; it divides --cp and the rest is ring attention "
                 "(--ulysses 1: ring only; --ulysses = --cp: Ulysses only, which needs it to divide the KV heads)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--checkpoint-dir", o.checkpoint_dir, "directory of sharded training checkpoints (none when empty)");
  app.add_option("--checkpoint-every", o.checkpoint_every,
                 "save every N steps, and at the end (0: only at the end; needs --checkpoint-dir)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40))
      ->capture_default_str();
  app.add_option("--keep-checkpoints", o.keep_checkpoints, "keep this many newest checkpoints (0: all)")
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  app.add_flag("--resume", o.resume, "continue from the newest checkpoint in --checkpoint-dir");
  app.add_option("--export-hf", o.export_hf, "write the trained model here as a Hugging Face directory at the end");
  app.add_option("--metrics", o.metrics, "per-step metrics as JSONL (loss, lr, grad_norm, tokens_per_s, ...)");
  app.add_option("--tensorboard", o.tensorboard,
                 "TensorBoard event files in this directory (and metrics.jsonl there when --metrics is not given)");
  app.add_option("--seed", o.seed, "seed of the model initialisation, data order and synthetic data")
      ->capture_default_str();
  app.add_flag("--short", short_mode,
               "CI mode: 12 steps of 512 tokens, 256 per micro-batch, constant lr 1e-2 (explicit options win)");
  app.add_flag("--verify-resume", verify,
               "train, then train again stopping at steps/2 with a checkpoint, resume it, and exit non-zero unless "
               "the resumed losses equal the uninterrupted ones and the loss falls");
  app.add_flag("--verify-cp", verify_context,
               "train with --cp N, then with --cp 1 on ranks / N ranks, and exit non-zero unless the first steps' "
               "losses agree within 1e-5 relative and the loss falls (CPU)");
  CLI11_PARSE(app, argc, argv);

  try {
    if (short_mode) {
      const auto unset = [&](const char* name) { return app.count(name) == 0; };
      if (unset("--steps")) o.steps = 12;
      if (unset("--global-batch-tokens")) o.global_batch_tokens = 512;
      if (unset("--max-tokens-per-rank")) o.max_tokens_per_rank = 256;
      if (unset("--schedule")) o.schedule = "constant";
      if (unset("--lr")) o.lr = 1e-2;
    }
    if (app.count("--warmup") == 0) o.warmup = std::min(o.warmup, o.steps);
    while (o.export_hf.size() > 1 && o.export_hf.back() == '/') o.export_hf.pop_back();  // "out/" names "out"
    sft::require(!o.resume || !o.checkpoint_dir.empty(), "--resume needs --checkpoint-dir");
    sft::require(o.checkpoint_every == 0 || !o.checkpoint_dir.empty(), "--checkpoint-every needs --checkpoint-dir");
    sft::require(o.schedule != "cosine" || o.warmup <= o.steps, "--warmup ", o.warmup, " exceeds --steps ", o.steps,
                 " (the cosine schedule decays after the warm-up)");
    sft::require(o.min_lr <= o.lr, "--min-lr ", o.min_lr, " exceeds --lr ", o.lr);
    sft::require(o.cp % o.ulysses == 0, "--ulysses ", o.ulysses, " must divide --cp ", o.cp);
    if (!o.model.empty())
      sft::require(fs::is_directory(o.model), "--model: '", o.model, "' is not a directory (expected a Hugging Face ",
                   "model directory with config.json and safetensors)");
    const slime::comm::Launch launch = slime::comm::plan_launch({.device = device, .ranks = ranks});
    sft::require(launch.world_size % o.cp == 0, "--cp ", o.cp, " must divide the ", launch.world_size,
                 " ranks (they are ranks / cp data-parallel x cp)");

    // The model's architecture, and the data (checked against its vocabulary).
    std::optional<slime::nn::Qwen3Config> hf_config;
    if (!o.model.empty()) hf_config = slime::nn::Qwen3Config::from_file(fs::path(o.model) / "config.json");
    TempDir scratch;
    if (data_path.empty()) {
      // Synthetic documents end with id 0 (token_data.hpp).
      sft::require(eos_id <= 0, "synthetic data ends documents with id 0; drop --eos-id or give --data");
      eos_id = 0;
      data_path = (scratch.path() / "synthetic.u32").string();
      const int64_t vocab = hf_config ? std::min<int64_t>(hf_config->vocab_size, 64) : 64;
      sft::write_synthetic_token_file(data_path, vocab, 4096, o.seed);
    } else if (eos_id < 0) {
      // The model's eos_token_id (an id, or a list whose first id ends documents).
      const nlohmann::json eos =
          hf_config ? hf_config->extra.value("eos_token_id", nlohmann::json()) : nlohmann::json();
      const nlohmann::json first = eos.is_array() && !eos.empty() ? eos[0] : eos;
      sft::require(first.is_number_integer(), "--eos-id is needed: ",
                   hf_config ? "the model's config.json has no integer eos_token_id"
                             : "the built-in model has no tokenizer, so the documents' separator must be given");
      eos_id = slime::json_integer<uint32_t>(first, "eos_token_id",
                                             "config '" + (fs::path(o.model) / "config.json").string() + "'");
    }
    const TokenDataset data(data_path, uint32_t(eos_id), o.max_tokens_per_rank);
    slime::nn::Qwen3Config config;
    if (hf_config) {
      config = *hf_config;
      data.check_vocab(config.vocab_size);
    } else {
      // The built-in model's vocabulary covers the data's ids, rounded up to 64.
      config = sft::tiny_qwen3_config((data.vocab_needed() + 63) / 64 * 64);
    }
    sft::require(config.num_attention_heads % o.ulysses == 0 && config.num_key_value_heads % o.ulysses == 0,
                 "--ulysses ", o.ulysses, " must divide the model's query heads (", config.num_attention_heads,
                 ") and KV heads (", config.num_key_value_heads, "); put the rest of --cp into ring attention");

    sft::require(!(verify && verify_context), "--verify-resume and --verify-cp are separate checks; give one");
    if (verify) return verify_resume(launch, o, data, config, scratch.path());
    if (verify_context) return verify_cp(launch, device, o, data, config);
    const RunResult result = run(launch, o, data, config);
    if (launch.has_rank_zero()) report_loss_drop(result, 1.0);
    return 0;
  } catch (const slime::Error& e) {
    fmt::print(stderr, "error: {}\n", e.message());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
