// Console progress line: value, rate and ETA formatting; plain mode (every N
// steps, first and last) and terminal mode (redraw with \r + clear-line) on a
// string stream with a fake clock.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "slime/io/progress.hpp"

using slime::io::format_duration;
using slime::io::format_value;
using slime::io::Progress;
using slime::io::ProgressOptions;

namespace {

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// A clock the test moves by hand.
struct FakeClock {
  double now = 100.0;
  std::function<double()> fn() {
    return [this] { return now; };
  }
};

}  // namespace

TEST_CASE("format_duration", "[io][progress]") {
  CHECK(format_duration(0) == "0s");
  CHECK(format_duration(0.4) == "0s");
  CHECK(format_duration(42.4) == "42s");
  CHECK(format_duration(59.4) == "59s");
  CHECK(format_duration(59.6) == "1m00s");
  CHECK(format_duration(245) == "4m05s");
  CHECK(format_duration(3599) == "59m59s");
  CHECK(format_duration(3600) == "1h00m");
  CHECK(format_duration(3600 + 2 * 60 + 29) == "1h02m");
  CHECK(format_duration(3600 + 2 * 60 + 31) == "1h03m");
  CHECK(format_duration(100 * 3600.0) == "100h00m");
  CHECK(format_duration(-1) == "?");
  CHECK(format_duration(NAN) == "?");
  CHECK(format_duration(INFINITY) == "?");
}

TEST_CASE("format_value", "[io][progress]") {
  CHECK(format_value(0) == "0");
  CHECK(format_value(0.43125) == "0.4313");
  CHECK(format_value(-0.012345) == "-0.01235");
  CHECK(format_value(1.2e-5) == "1.2e-05");
  CHECK(format_value(1) == "1");
  CHECK(format_value(1234) == "1234");
  CHECK(format_value(9999) == "9999");
  CHECK(format_value(12345) == "12.3k");
  CHECK(format_value(-12345) == "-12.3k");
  CHECK(format_value(999400) == "999k");
  CHECK(format_value(999600) == "1M");
  CHECK(format_value(4.56e6) == "4.56M");
  CHECK(format_value(7.1e9) == "7.1G");
  CHECK(format_value(2.5e12) == "2.5T");
  CHECK(format_value(3e15) == "3e+15");
  CHECK(format_value(NAN) == "nan");
  CHECK(format_value(-INFINITY) == "-inf");
}

TEST_CASE("Progress line shows values, rate and ETA", "[io][progress]") {
  FakeClock clock;
  std::ostringstream out;
  Progress p(out, {.total_steps = 100, .mode = ProgressOptions::Mode::plain, .clock = clock.fn()});
  CHECK_FALSE(p.terminal());
  // 10 steps in 20 s: 2 s/step, 90 steps left: 3 minutes.
  CHECK(p.format_line(10, {{"reward", 0.4312}, {"loss", -0.01234}, {"kl", 1.5e-4}, {"tok/s", 12345}}, 120.0) ==
        "step 10/100 (10%) | reward 0.4312 | loss -0.01234 | kl 0.00015 | tok/s 12.3k | 2 s/step | ETA 3m00s");
  // Faster than a step a second: steps per second.
  CHECK(p.format_line(50, {}, 110.0) == "step 50/100 (50%) | 5 step/s | ETA 10s");
  // Nothing done yet: the ETA is unknown.
  CHECK(p.format_line(0, {}, 100.0) == "step 0/100 (0%) | ETA ?");
  CHECK(p.format_line(100, {}, 300.0) == "step 100/100 (100%) | 2 s/step | ETA 0s");
}

TEST_CASE("Progress measures the ETA from the resume step", "[io][progress]") {
  FakeClock clock;
  std::ostringstream out;
  Progress p(out, {.total_steps = 1000, .mode = ProgressOptions::Mode::plain, .label = "iter", .clock = clock.fn()},
             /*start_step=*/900);
  CHECK(p.format_line(950, {}, 150.0) == "iter 950/1000 (95%) | 1 s/step | ETA 50s");
}

TEST_CASE("Progress without a total shows no ETA", "[io][progress]") {
  FakeClock clock;
  std::ostringstream out;
  Progress p(out, {.mode = ProgressOptions::Mode::plain, .clock = clock.fn()});
  CHECK(p.format_line(3, {{"loss", 2}}, 106.0) == "step 3 | loss 2 | 2 s/step");
  CHECK(p.format_line(0, {}, 100.0) == "step 0");
}

TEST_CASE("Progress plain mode prints every N steps, the first and the last", "[io][progress]") {
  FakeClock clock;
  std::ostringstream out;
  {
    Progress p(out, {.total_steps = 10, .print_every = 4, .mode = ProgressOptions::Mode::plain, .clock = clock.fn()});
    for (int step = 1; step <= 10; ++step) {
      clock.now += 1.5;
      p.update(step, {{"reward", 0.1 * step}});
      if (step == 5) p.message("checkpoint saved");
    }
  }
  const std::string s = out.str();
  CHECK(s.find('\r') == std::string::npos);
  CHECK(s.find('\033') == std::string::npos);
  const auto l = lines(s);
  REQUIRE(l.size() == 5);
  CHECK(l[0] == "step 1/10 (10%) | reward 0.1 | 1.5 s/step | ETA 14s");
  CHECK(l[1] == "step 4/10 (40%) | reward 0.4 | 1.5 s/step | ETA 9s");
  CHECK(l[2] == "checkpoint saved");
  CHECK(l[3] == "step 8/10 (80%) | reward 0.8 | 1.5 s/step | ETA 3s");
  CHECK(l[4] == "step 10/10 (100%) | reward 1 | 1.5 s/step | ETA 0s");
}

TEST_CASE("Progress plain mode with print_every 1 prints every step", "[io][progress]") {
  FakeClock clock;
  std::ostringstream out;
  Progress p(out, {.total_steps = 3, .mode = ProgressOptions::Mode::plain, .clock = clock.fn()});
  for (int step = 1; step <= 3; ++step) p.update(step);
  CHECK(lines(out.str()).size() == 3);
}

TEST_CASE("Progress terminal mode redraws in place", "[io][progress]") {
  FakeClock clock;
  std::ostringstream out;
  {
    Progress p(out, {.total_steps = 3, .mode = ProgressOptions::Mode::terminal, .clock = clock.fn()});
    CHECK(p.terminal());
    clock.now += 2;
    p.update(1, {{"loss", 1}});
    CHECK(out.str() == "\r\033[2Kstep 1/3 (33%) | loss 1 | 2 s/step | ETA 4s");
    p.message("hello");
    clock.now += 2;
    p.update(2, {{"loss", 0.5}});
  }
  CHECK(out.str() ==
        "\r\033[2Kstep 1/3 (33%) | loss 1 | 2 s/step | ETA 4s"
        "\r\033[2Khello\nstep 1/3 (33%) | loss 1 | 2 s/step | ETA 4s"
        "\r\033[2Kstep 2/3 (66%) | loss 0.5 | 2 s/step | ETA 2s\n");  // the destructor ends the line
}

TEST_CASE("Progress automatic mode is plain on a string stream", "[io][progress]") {
  std::ostringstream out;
  Progress p(out, {.total_steps = 2});
  CHECK_FALSE(p.terminal());
  CHECK_FALSE(slime::io::stream_is_terminal(out));
  p.update(1);
  CHECK(out.str().find('\r') == std::string::npos);
  CHECK(out.str().back() == '\n');
}

TEST_CASE("Progress rejects bad options", "[io][progress]") {
  std::ostringstream out;
  CHECK_THROWS_WITH(Progress(out, {.total_steps = -1}), Catch::Matchers::ContainsSubstring("total_steps"));
  CHECK_THROWS_WITH(Progress(out, {.print_every = 0}), Catch::Matchers::ContainsSubstring("print_every"));
}
