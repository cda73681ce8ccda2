// slime/io/progress.hpp: a console progress line for training loops:
//   step 12/100 (12%) | reward 0.4312 | loss -0.01234 | tok/s 12.3k | 1.52 s/step | ETA 2m14s
// redrawn in place ("\r" + ANSI clear-line) on a terminal, printed as plain
// lines (every N steps, and the first and last) otherwise, e.g. in CI logs.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "slime/core/error.hpp"

namespace slime::io {

// "42s", "4m05s", "1h02m"; "?" when unknown (negative, NaN, infinite).
inline std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = int64_t(std::llround(seconds));
  char buf[48];
  if (s < 60) {
    std::snprintf(buf, sizeof(buf), "%llds", (long long)s);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", (long long)(s / 60), (long long)(s % 60));
  } else {
    const int64_t m = (s + 30) / 60;  // minutes, rounded
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", (long long)(m / 60), (long long)(m % 60));
  }
  return buf;
}

// A value for the progress line: 4 significant digits, and an SI suffix
// (k, M, G, T) with 3 significant digits from 10^4 on: 0.4312, -0.01234,
// 1.2e-05, 1234, 12.3k, 4.56M.
inline std::string format_value(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[48];
  const double a = std::fabs(v);
  if (a >= 1e4 && a < 1e15) {
    static constexpr const char* kSuffix[] = {"k", "M", "G", "T"};
    int e = 0;
    double m = a / 1e3;
    while (m >= 999.5 && e < 3) {
      m /= 1e3;
      ++e;
    }
    std::snprintf(buf, sizeof(buf), "%s%.3g%s", v < 0 ? "-" : "", m, kSuffix[e]);
  } else {
    std::snprintf(buf, sizeof(buf), "%.4g", v);
  }
  return buf;
}

struct ProgressOptions {
  enum class Mode { automatic, terminal, plain };
  int64_t total_steps = 0;      // 0: unknown (no percentage, no ETA)
  int64_t print_every = 1;      // plain mode: print every N steps (and the first and last)
  Mode mode = Mode::automatic;  // automatic: terminal when the stream is std::cout/cerr/clog on a tty
  std::string label = "step";
  // Seconds on a monotonic clock; tests substitute their own.
  std::function<double()> clock = [] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  };
};

// Whether `out` is the standard output or error stream attached to a
// terminal (and TERM is not "dumb").
inline bool stream_is_terminal(const std::ostream& out) {
  int fd = -1;
  if (&out == &std::cout) {
    fd = STDOUT_FILENO;
  } else if (&out == &std::cerr || &out == &std::clog) {
    fd = STDERR_FILENO;
  }
  if (fd < 0 || ::isatty(fd) == 0) return false;
  const char* term = std::getenv("TERM");
  return term == nullptr || std::strcmp(term, "dumb") != 0;
}

class Progress {
 public:
  using Values = std::vector<std::pair<std::string, double>>;

  // The ETA is measured from construction: steps done since `start_step`
  // (the step a resumed run starts at) over the time elapsed.
  explicit Progress(std::ostream& out, ProgressOptions options = {}, int64_t start_step = 0)
      : out_(&out), opt_(std::move(options)), start_step_(start_step) {
    SLIME_CHECK(opt_.total_steps >= 0, "Progress: total_steps must be >= 0, got ", opt_.total_steps);
    SLIME_CHECK(opt_.print_every >= 1, "Progress: print_every must be >= 1, got ", opt_.print_every);
    SLIME_CHECK(bool(opt_.clock), "Progress: clock is empty");
    terminal_ = opt_.mode == ProgressOptions::Mode::terminal ||
                (opt_.mode == ProgressOptions::Mode::automatic && stream_is_terminal(out));
    start_time_ = opt_.clock();
  }

  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  ~Progress() {
    try {
      finish();
    } catch (...) {
    }
  }

  bool terminal() const { return terminal_; }

  // Reports that `step` (counting from 1 up to total_steps, as "step 3/10"
  // reads: three steps done) finished with these values.
  void update(int64_t step, const Values& values = {}) {
    last_line_ = format_line(step, values, opt_.clock());
    ++updates_;
    if (terminal_) {
      *out_ << "\r\033[2K" << last_line_ << std::flush;
      drawn_ = true;
    } else if (updates_ == 1 || step % opt_.print_every == 0 || (opt_.total_steps > 0 && step >= opt_.total_steps)) {
      *out_ << last_line_ << '\n' << std::flush;
    }
  }

  // Prints a message line without breaking the progress line: on a terminal
  // the line is cleared, the message printed and the line drawn again.
  void message(std::string_view text) {
    if (terminal_ && drawn_) {
      *out_ << "\r\033[2K" << text << '\n' << last_line_ << std::flush;
    } else {
      *out_ << text << '\n' << std::flush;
    }
  }

  // Ends the redrawn line with a newline (terminal mode); called by the
  // destructor too. Safe to call more than once.
  void finish() {
    if (terminal_ && drawn_) *out_ << '\n' << std::flush;
    drawn_ = false;
  }

  // The line for `step` at time `now` (on the options' clock).
  std::string format_line(int64_t step, const Values& values, double now) const {
    std::string line = opt_.label + " " + std::to_string(step);
    if (opt_.total_steps > 0) {
      line += "/" + std::to_string(opt_.total_steps);
      const int64_t pct = std::min<int64_t>(100, std::max<int64_t>(0, step * 100 / opt_.total_steps));
      line += " (" + std::to_string(pct) + "%)";
    }
    for (const auto& [name, value] : values) line += " | " + name + " " + format_value(value);
    const int64_t done = step - start_step_;
    const double elapsed = now - start_time_;
    if (done > 0 && elapsed > 0) {
      const double per_step = elapsed / double(done);
      line +=
          per_step >= 1 ? " | " + format_value(per_step) + " s/step" : " | " + format_value(1 / per_step) + " step/s";
      if (opt_.total_steps > 0)
        line += " | ETA " + format_duration(per_step * double(std::max<int64_t>(0, opt_.total_steps - step)));
    } else if (opt_.total_steps > 0) {
      line += " | ETA ?";
    }
    return line;
  }

 private:
  std::ostream* out_;
  ProgressOptions opt_;
  int64_t start_step_ = 0;
  double start_time_ = 0;
  bool terminal_ = false;
  bool drawn_ = false;
  int64_t updates_ = 0;
  std::string last_line_;
};

}  // namespace slime::io
