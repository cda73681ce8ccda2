// Synthetic RL tasks: verifiers on hand-made cases, deterministic prompts, the
// oracle policy scoring 1, random replies scoring the closed-form expectation,
// the registry.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "slime/data/tasks.hpp"

using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::WithinAbs;
using slime::data::Credit;
using slime::data::make_task;
using slime::data::TaskConfig;
using slime::data::TaskVocab;

namespace {

constexpr int32_t B = TaskVocab::kBos, E = TaskVocab::kEos, S = TaskVocab::kSep;
// The built-in tasks (the registry test adds more, so loops do not ask it).
const std::vector<std::string> kBuiltin = {"copy", "reverse", "successor", "sum"};

// Token of symbol s.
constexpr int32_t t(int32_t s) { return TaskVocab::kFirstSymbol + s; }

}  // namespace

TEST_CASE("task vocabulary reserves BOS, EOS and SEP", "[data][tasks]") {
  const TaskVocab v{32};
  CHECK(v.num_symbols() == 29);
  CHECK(v.token(0) == 3);
  CHECK(v.token(28) == 31);
  CHECK(v.symbol(3) == 0);
  CHECK(v.symbol(31) == 28);
  for (int32_t special : {B, E, S, 32, -1}) {
    CHECK_FALSE(v.is_symbol(special));
    CHECK(v.symbol(special) == -1);
  }
}

TEST_CASE("successor verifier on hand-made cases", "[data][tasks]") {
  const auto task = make_task("successor");  // V = 32, K = 29, floor(K/2) = 14
  CHECK(task->name() == "successor");
  CHECK(task->answer_length() == 1);
  CHECK(task->prompt_length() == 5);
  const std::vector<int32_t> p = {B, t(5), t(7), t(10), S};
  CHECK(task->reward(p, std::vector<int32_t>{t(11)}) == 1.0);
  CHECK(task->reward(p, std::vector<int32_t>{t(11), E}) == 1.0);
  CHECK(task->reward(p, std::vector<int32_t>{t(11), t(3), t(3)}) == 1.0);  // after the answer: ignored
  CHECK_THAT(task->reward(p, std::vector<int32_t>{t(12)}), WithinAbs(1 - 1 / 14.0, 1e-15));
  CHECK_THAT(task->reward(p, std::vector<int32_t>{t(8)}), WithinAbs(1 - 3 / 14.0, 1e-15));
  CHECK(task->reward(p, std::vector<int32_t>{t(25)}) == 0.0);  // distance 14: opposite
  CHECK(task->reward(p, std::vector<int32_t>{t(26)}) == 0.0);  // distance 15 -> 14 the other way
  CHECK_THAT(task->reward(p, std::vector<int32_t>{t(27)}), WithinAbs(1 - 13 / 14.0, 1e-15));
  CHECK(task->reward(p, std::vector<int32_t>{E}) == 0.0);
  CHECK(task->reward(p, std::vector<int32_t>{B}) == 0.0);
  CHECK(task->reward(p, std::vector<int32_t>{}) == 0.0);
  CHECK(task->reward(p, std::vector<int32_t>{99}) == 0.0);
  CHECK(task->reward(p, std::vector<int32_t>{-5}) == 0.0);
  // Wrap-around: after the last symbol comes symbol 0, and its neighbour 28 is close.
  const std::vector<int32_t> wrap = {B, t(1), t(2), t(28), S};
  CHECK(task->reward(wrap, std::vector<int32_t>{t(0)}) == 1.0);
  CHECK_THAT(task->reward(wrap, std::vector<int32_t>{t(28)}), WithinAbs(1 - 1 / 14.0, 1e-15));
  CHECK(task->oracle(wrap) == std::vector<int32_t>{t(0), E});

  const auto exact = make_task("successor", {.credit = Credit::exact});
  CHECK(exact->reward(p, std::vector<int32_t>{t(11)}) == 1.0);
  CHECK(exact->reward(p, std::vector<int32_t>{t(12)}) == 0.0);
}

TEST_CASE("copy, reverse and sum verifiers on hand-made cases", "[data][tasks]") {
  const auto copy = make_task("copy", {.credit = Credit::exact});
  const std::vector<int32_t> p = {B, t(1), t(2), t(3), S};
  CHECK(copy->answer_length() == 3);
  CHECK(copy->reward(p, std::vector<int32_t>{t(1), t(2), t(3), E}) == 1.0);
  CHECK_THAT(copy->reward(p, std::vector<int32_t>{t(1), t(2)}), WithinAbs(2 / 3.0, 1e-15));  // cut short
  CHECK_THAT(copy->reward(p, std::vector<int32_t>{t(1), t(9), t(3)}), WithinAbs(2 / 3.0, 1e-15));
  CHECK(copy->reward(p, std::vector<int32_t>{t(3), t(1), t(2)}) == 0.0);  // position matters
  CHECK(copy->oracle(p) == std::vector<int32_t>{t(1), t(2), t(3), E});

  const auto copy_d = make_task("copy");
  CHECK_THAT(copy_d->reward(p, std::vector<int32_t>{t(1), t(3), E}), WithinAbs((1 + (1 - 1 / 14.0) + 0) / 3, 1e-15));

  const auto reverse = make_task("reverse", {.prompt_symbols = 4, .credit = Credit::exact});
  const std::vector<int32_t> q = {B, t(4), t(0), t(7), t(4), S};
  CHECK(reverse->answer_length() == 4);
  CHECK(reverse->reward(q, std::vector<int32_t>{t(4), t(7), t(0), t(4)}) == 1.0);
  CHECK(reverse->reward(q, std::vector<int32_t>{t(4), t(0), t(7), t(4)}) == 0.5);  // the copy: the ends match
  CHECK(reverse->oracle(q) == std::vector<int32_t>{t(4), t(7), t(0), t(4), E});

  const auto sum = make_task("sum");
  CHECK(sum->prompt_length() == 4);
  CHECK(sum->reward(std::vector<int32_t>{B, t(20), t(15), S}, std::vector<int32_t>{t(6)}) == 1.0);  // 35 mod 29
  CHECK(sum->reward(std::vector<int32_t>{B, t(0), t(0), S}, std::vector<int32_t>{t(0)}) == 1.0);
  const auto sum3 = make_task("sum", {.vocab_size = 13, .prompt_symbols = 3});  // K = 10
  CHECK(sum3->reward(std::vector<int32_t>{B, t(9), t(9), t(9), S}, std::vector<int32_t>{t(7)}) == 1.0);
  CHECK_THAT(sum3->reward(std::vector<int32_t>{B, t(9), t(9), t(9), S}, std::vector<int32_t>{t(2)}),
             WithinAbs(0.0, 1e-15));  // distance 5 = K/2
}

TEST_CASE("verifiers reject prompts of another shape", "[data][tasks]") {
  const auto task = make_task("successor");
  const std::vector<int32_t> r = {t(1)};
  CHECK_THROWS_WITH(
      task->reward(std::vector<int32_t>{B, t(1), S}, r),
      ContainsSubstring("task 'successor': prompt must be [BOS=0, 3 symbols in [3, 32), SEP=2]: length 3"));
  CHECK_THROWS_WITH(task->reward(std::vector<int32_t>{}, r), ContainsSubstring("length 0"));
  CHECK_THROWS_WITH(task->reward(std::vector<int32_t>{E, t(1), t(2), t(3), S}, r), ContainsSubstring("no BOS first"));
  CHECK_THROWS_WITH(task->reward(std::vector<int32_t>{B, t(1), t(2), t(3), E}, r), ContainsSubstring("no SEP last"));
  CHECK_THROWS_WITH(task->reward(std::vector<int32_t>{B, t(1), S, t(3), S}, r),
                    ContainsSubstring("token 2 is not a symbol; found [0 4 2 6 2]"));
  CHECK_THROWS_WITH(task->oracle(std::vector<int32_t>{B, t(1), t(2), 32, S}),
                    ContainsSubstring("token 32 is not a symbol"));
}

TEST_CASE("task configs are checked", "[data][tasks]") {
  CHECK_THROWS_WITH(make_task("copy", {.vocab_size = 4}), ContainsSubstring("vocab_size must be >= 5"));
  CHECK_THROWS_WITH(make_task("copy", {.prompt_symbols = -1}), ContainsSubstring("prompt_symbols must be >= 0"));
  CHECK(make_task("copy", {.vocab_size = 5})->vocab().num_symbols() == 2);
}

TEST_CASE("prompts are deterministic in (seed, index) and uniform over symbols", "[data][tasks]") {
  for (const std::string& name : kBuiltin) {
    const auto task = make_task(name);
    const int32_t n = task->prompt_symbols();
    const int32_t k = task->vocab().num_symbols();
    std::vector<int64_t> counts(std::size_t(k), 0);
    std::set<std::vector<int32_t>> distinct;
    const int64_t prompts = 20000;
    for (int64_t i = 0; i < prompts; ++i) {
      const std::vector<int32_t> p = task->prompt(7, uint64_t(i));
      REQUIRE(p.size() == std::size_t(n) + 2);
      REQUIRE(p.front() == B);
      REQUIRE(p.back() == S);
      for (int32_t j = 1; j <= n; ++j) {
        REQUIRE(task->vocab().is_symbol(p[j]));
        ++counts[std::size_t(task->vocab().symbol(p[j]))];
      }
      distinct.insert(p);
    }
    CHECK(task->prompt(7, 123) == task->prompt(7, 123));
    CHECK(make_task(name)->prompt(7, 123) == task->prompt(7, 123));
    // Prompts repeat only by chance: k^n possible prompts.
    const double space = std::pow(double(k), double(n));
    const double expected_distinct = space * (1 - std::pow(1 - 1 / space, double(prompts)));
    CHECK(double(distinct.size()) > 0.97 * expected_distinct);
    // Another seed gives another stream.
    int same = 0;
    for (uint64_t i = 0; i < 200; ++i) same += task->prompt(7, i) == task->prompt(8, i);
    CHECK(same < 20);
    // Chi-square of the symbol counts, k - 1 degrees of freedom (28 at k = 29):
    // the 99.99th percentile is below 70.
    const double mean = double(prompts * n) / double(k);
    double chi2 = 0;
    for (int64_t c : counts) chi2 += (double(c) - mean) * (double(c) - mean) / mean;
    INFO(name << " chi2 " << chi2);
    CHECK(chi2 < 70);
  }
}

TEST_CASE("the oracle policy earns reward 1 on every task", "[data][tasks]") {
  for (const std::string& name : kBuiltin) {
    for (Credit credit : {Credit::distance, Credit::exact}) {
      for (int32_t vocab : {5, 13, 32, 64}) {
        const auto task = make_task(name, {.vocab_size = vocab, .credit = credit});
        for (uint64_t i = 0; i < 200; ++i) {
          const std::vector<int32_t> p = task->prompt(1, i);
          const std::vector<int32_t> reply = task->oracle(p);
          REQUIRE(reply.size() == std::size_t(task->answer_length()) + 1);
          CHECK(reply.back() == E);
          CHECK(task->reward(p, reply) == 1.0);
          // Any wrong token in the answer costs reward.
          std::vector<int32_t> wrong = reply;
          wrong[i % std::size_t(task->answer_length())] = E;
          CHECK(task->reward(p, wrong) < 1.0);
        }
      }
    }
  }
}

TEST_CASE("random replies earn the expected mean reward", "[data][tasks]") {
  // A uniformly random token over all V ids scores, per answer position,
  // floor(K/2) / V with distance credit (the credits of the K symbols sum to
  // floor(K/2)) and 1 / V with exact credit.
  std::mt19937_64 rng(42);
  for (const std::string& name : kBuiltin) {
    for (Credit credit : {Credit::distance, Credit::exact}) {
      for (int32_t vocab : {13, 32}) {
        const auto task = make_task(name, {.vocab_size = vocab, .credit = credit});
        const int32_t k = task->vocab().num_symbols();
        const double expected = credit == Credit::distance ? double(k / 2) / vocab : 1.0 / vocab;
        std::uniform_int_distribution<int32_t> token(0, vocab - 1);
        const int n = 40000;
        double sum = 0, sum_sq = 0;
        for (int i = 0; i < n; ++i) {
          const std::vector<int32_t> p = task->prompt(3, uint64_t(i));
          std::vector<int32_t> reply(std::size_t(task->answer_length()));
          for (int32_t& r : reply) r = token(rng);
          const double r = task->reward(p, reply);
          sum += r;
          sum_sq += r * r;
        }
        const double mean = sum / n;
        const double stderr_ = std::sqrt((sum_sq / n - mean * mean) / n);
        INFO(name << " vocab " << vocab << " credit " << int(credit) << ": mean " << mean << " expected " << expected
                  << " stderr " << stderr_);
        CHECK(std::abs(mean - expected) < 5 * stderr_ + 1e-12);
        CHECK(stderr_ < 0.005);
      }
    }
  }
}

TEST_CASE("the task registry", "[data][tasks]") {
  CHECK(slime::data::task_names() == kBuiltin);
  CHECK_THROWS_WITH(make_task("sucessor"),
                    ContainsSubstring("unknown task 'sucessor' (known tasks: copy, reverse, successor, sum)"));

  // A user task: reply with the first prompt symbol.
  struct FirstTask final : slime::data::Task {
    explicit FirstTask(const TaskConfig& c) : Task("first", "the first symbol", c, 4) {}
    int32_t answer_length() const override { return 1; }

   protected:
    std::vector<int32_t> answer(const std::vector<int32_t>& x) const override { return {x.front()}; }
  };
  slime::data::register_task("first", [](const TaskConfig& c) { return std::make_unique<FirstTask>(c); });
  const auto first = make_task("first");
  CHECK(first->prompt_length() == 6);
  const std::vector<int32_t> p = first->prompt(0, 0);
  CHECK(first->reward(p, std::vector<int32_t>{p[1]}) == 1.0);
  CHECK_THROWS_WITH(
      slime::data::register_task("first", [](const TaskConfig& c) { return std::make_unique<FirstTask>(c); }),
      ContainsSubstring("a task named 'first' is already registered"));
  CHECK_THROWS_WITH(slime::data::register_task("none", nullptr), ContainsSubstring("empty factory"));
  slime::data::register_task("broken", [](const TaskConfig&) { return std::unique_ptr<slime::data::Task>(); });
  CHECK_THROWS_WITH(make_task("broken"), ContainsSubstring("returned no task"));
}
