// slime/optim/lr_schedule.hpp: learning-rate schedules as a small value type,
// LrSchedule, queried with the 1-based step of the update (the `step` that
// adamw_step takes; AdamW::step_count() + 1):
//
//   constant(lr)                              lr at every step
//   linear_warmup(lr, W)                      lr * step / W for step <= W, then lr
//   cosine(lr, W, total, min_lr)              the warm-up above, then
//       min_lr + (lr - min_lr) * (1 + cos(pi * (step - W) / (total - W))) / 2
//       for W < step <= total, and min_lr after total.
//
// The warm-up reaches lr at step W (the first update uses lr / W, not 0, as
// Megatron-LM's scheduler; Hugging Face's schedules count from 0 and start at
// 0). Bad settings throw slime::Error when the schedule is made.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>

#include "slime/core/error.hpp"

namespace slime::optim {

class LrSchedule {
 public:
  enum class Kind : uint8_t { constant, linear_warmup, cosine };

  static LrSchedule constant(double lr) {
    check_lr(lr, "lr");
    return LrSchedule(Kind::constant, lr, 0, 0, lr);
  }

  static LrSchedule linear_warmup(double lr, int64_t warmup_steps) {
    check_lr(lr, "lr");
    SLIME_CHECK(warmup_steps >= 0, "LrSchedule: warmup_steps must be >= 0, got ", warmup_steps);
    return LrSchedule(Kind::linear_warmup, lr, warmup_steps, 0, lr);
  }

  // Warm-up over warmup_steps (0: none), then cosine decay from lr to min_lr
  // at total_steps (>= warmup_steps), min_lr afterwards.
  static LrSchedule cosine(double lr, int64_t warmup_steps, int64_t total_steps, double min_lr = 0) {
    check_lr(lr, "lr");
    check_lr(min_lr, "min_lr");
    SLIME_CHECK(min_lr <= lr, "LrSchedule: min_lr (", min_lr, ") must not exceed lr (", lr, ")");
    SLIME_CHECK(warmup_steps >= 0, "LrSchedule: warmup_steps must be >= 0, got ", warmup_steps);
    SLIME_CHECK(total_steps >= warmup_steps, "LrSchedule: total_steps (", total_steps, ") must be >= warmup_steps (",
                warmup_steps, ")");
    return LrSchedule(Kind::cosine, lr, warmup_steps, total_steps, min_lr);
  }

  // The learning rate of update number `step` (1-based).
  double lr(int64_t step) const {
    SLIME_CHECK(step >= 1, "LrSchedule::lr: step is 1-based (the step passed to adamw_step), got ", step);
    if (kind_ == Kind::constant) return lr_;
    if (step <= warmup_) return lr_ * double(step) / double(warmup_);
    if (kind_ == Kind::linear_warmup) return lr_;
    if (step >= total_) return min_lr_;
    const double progress = double(step - warmup_) / double(total_ - warmup_);
    return min_lr_ + (lr_ - min_lr_) * 0.5 * (1 + std::cos(std::numbers::pi * progress));
  }

  Kind kind() const { return kind_; }
  double peak_lr() const { return lr_; }
  double min_lr() const { return min_lr_; }
  int64_t warmup_steps() const { return warmup_; }
  int64_t total_steps() const { return total_; }

 private:
  LrSchedule(Kind kind, double lr, int64_t warmup, int64_t total, double min_lr)
      : kind_(kind), lr_(lr), min_lr_(min_lr), warmup_(warmup), total_(total) {}

  static void check_lr(double v, const char* name) {
    SLIME_CHECK(std::isfinite(v) && v >= 0, "LrSchedule: ", name, " must be finite and >= 0, got ", v);
  }

  Kind kind_;
  double lr_, min_lr_;
  int64_t warmup_, total_;
};

}  // namespace slime::optim
