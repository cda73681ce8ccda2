// qwen3_vl_rl: GRPO on a Qwen3-VL model with slime, on a synthetic image task
// the example draws itself (shapes_task.hpp: name the colour of the shapes,
// or count them). With no arguments it trains the built-in tiny Qwen3-VL on
// the colour task with 2 ranks: on the CPU (threads, LocalComm) where there
// is no GPU, on CUDA (one GPU per rank, NCCL) where there is; the vision
// tower, the language model, the rollout engine and the weight sync are the
// library's (see trainer.hpp for the step).
//
// At the end rank 0 prints whether it learned (the mean reward of the last 10
// steps against the first 10, up by at least 0.1) and writes the trained
// model as a Hugging Face directory (<out>/hf) that transformers'
// Qwen3VLForConditionalGeneration loads (tools/check_vl_export.py checks it).
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "slime/comm/launch.hpp"
#include "slime/ops/batch_invariant.hpp"
#include "trainer.hpp"

namespace {

using namespace slime;
using vl_example::Options;
using vl_example::StepReport;

double mean_reward(const std::vector<StepReport>& r, std::size_t first, std::size_t last) {
  double s = 0;
  for (std::size_t i = first; i < last; ++i) s += r[i].reward;
  return last > first ? s / double(last - first) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"qwen3_vl_rl: GRPO on a Qwen3-VL model (vision tower + MRoPE language model) with slime"};
  Options o;
  app.add_option("--steps", o.steps, "optimizer steps (one rollout each)")->check(CLI::Range(1, 1000000));
  app.add_option("--ranks", o.ranks, "ranks (threads on the CPU, one GPU each on CUDA)")->check(CLI::Range(1, 64));
  app.add_option("--prompts-per-step", o.prompts_per_step, "prompts per step over all ranks")
      ->check(CLI::Range(1, 100000));
  app.add_option("--samples-per-prompt", o.samples_per_prompt, "responses per prompt (the GRPO group)")
      ->check(CLI::Range(2, 1024));
  app.add_option("--lr", o.lr, "AdamW learning rate")->check(CLI::Range(0.0, 1.0));
  app.add_option("--max-grad-norm", o.max_grad_norm, "global gradient-norm clip (0: none)")
      ->check(CLI::Range(0.0, 1e9));
  app.add_option("--temperature", o.temperature, "sampling temperature")->check(CLI::Range(0.0, 100.0));
  app.add_option("--task", o.task, "colour (name the shapes' colour) or count (how many shapes)")
      ->check(CLI::IsMember({"colour", "count"}));
  app.add_flag("--moe", o.moe, "the built-in Qwen3-VL-MoE (4 experts, top-2) instead of the dense model");
  app.add_flag("--freeze-vision", o.freeze_vision,
               "keep the vision tower's weights (train the language model only; the tower runs forward only)");
  app.add_option("--device", o.device, "auto, cpu or cuda")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--seed", o.seed, "seed of the weights, the images and the sampling");
  app.add_option("--out", o.out_dir, "output directory (metrics.jsonl, hf/)");
  app.add_flag("!--no-export", o.export_hf, "skip the Hugging Face export at the end");
  std::string batch_invariant = "on";
  app.add_option("--batch-invariant", batch_invariant,
                 "on | off: the batch-invariant numerics mode (CUDA: the engine's logprobs equal the trainer's "
                 "recompute bit for bit, at some cost in speed; no effect on the CPU)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  // Before any rank starts: every engine and trainer op runs in this mode.
  ops::set_batch_invariant(batch_invariant == "on");
  try {
    const comm::Launch launch = comm::plan_launch({.device = o.device, .ranks = o.ranks, .fit_to_devices = true});
    if (!launch.note.empty() && launch.has_rank_zero()) fmt::print("{}\n", launch.note);
    const std::optional<std::vector<StepReport>> reports = comm::run_ranks(
        launch, [&](comm::Comm& comm) { return vl_example::Trainer<parallel::FullShard>(o, comm).run(); });
    if (reports && !reports->empty()) {
      const std::vector<StepReport>& r = *reports;
      const std::size_t k = std::min<std::size_t>(10, r.size() / 2);
      const double first = mean_reward(r, 0, k), last = mean_reward(r, r.size() - k, r.size());
      double diff = 0;
      for (const StepReport& s : r) diff = std::max(diff, s.max_lp_diff);
      fmt::print("engine vs trainer logprobs: largest difference {:.3g} over {} steps\n", diff, r.size());
      fmt::print("mean reward: first {} steps {:.3f}, last {} steps {:.3f} ({:+.3f}); learned (>= +0.1): {}\n", k,
                 first, k, last, last - first, last - first >= 0.1 ? "yes" : "no");
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "qwen3_vl_rl: {}\n", e.what());
    return 1;
  }
  return 0;
}
