// rollout/remote.hpp: requests and completions between ranks (disaggregated
// rollout) arrive field for field, bit for bit (floats by their bits), in
// both directions and for empty lists; malformed messages give clear errors.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "slime/comm/local_comm.hpp"
#include "slime/rollout/remote.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;

namespace {

std::vector<rollout::Request> some_requests() {
  std::vector<rollout::Request> rs;
  for (int i = 0; i < 5; ++i) {
    rollout::Request q;
    for (int j = 0; j < 3 * i + 1; ++j) q.prompt.push_back(int32_t(1000 * i - 7 * j));
    q.sample_id = (uint64_t(1) << 63) + uint64_t(i);  // above int64's range: travels by its bits
    q.sampling.temperature = 0.1f * float(i) + 1e-7f;
    q.sampling.top_p = i == 2 ? 0.3f : 1.f;
    q.sampling.top_k = i;
    q.sampling.max_new_tokens = 17 + i;
    if (i % 2 == 1) q.sampling.stop_tokens = {2, int32_t(-i), 151643};
    rs.push_back(q);
  }
  return rs;
}

std::vector<rollout::Completion> some_completions() {
  std::vector<rollout::Completion> cs(3);
  cs[0].sample_id = 9;
  cs[0].tokens = {5, 6, 7};
  cs[0].logprobs = {-0.f, -1e-30f, -std::numeric_limits<float>::infinity()};
  cs[0].finish = rollout::FinishReason::stop;
  cs[0].weight_version = 41;
  cs[0].routing = {3, 0, 127, -1, 2, 2, 64, 1};  // engine routing (record_routing), ids as they came
  cs[1].sample_id = 10;
  cs[1].finish = rollout::FinishReason::error;
  cs[1].error = "prompt of 0 tokens\twith a tab and é";
  cs[2].sample_id = 11;
  cs[2].tokens = {1};
  cs[2].logprobs = {-3.25f};
  cs[2].finish = rollout::FinishReason::length;
  cs[2].weight_version = -1;
  return cs;
}

std::vector<uint32_t> bits(const std::vector<float>& v) {
  std::vector<uint32_t> b;
  for (float x : v) b.push_back(std::bit_cast<uint32_t>(x));
  return b;
}

}  // namespace

TEST_CASE("requests and completions cross ranks field for field", "[rollout][remote]") {
  const std::vector<rollout::Request> sent = some_requests();
  const std::vector<rollout::Completion> replies = some_completions();
  std::vector<rollout::Request> got;
  std::vector<rollout::Completion> back;
  std::vector<rollout::Request> none_got = some_requests();
  comm::run_local_ranks(2, [&](comm::Comm& c) {
    if (c.rank() == 0) {
      rollout::send_requests(c, 1, sent, Device::cpu());
      back = rollout::recv_completions(c, 1, Device::cpu());
      rollout::send_requests(c, 1, {}, Device::cpu());
    } else {
      got = rollout::recv_requests(c, 0, Device::cpu());
      rollout::send_completions(c, 0, replies, Device::cpu());
      none_got = rollout::recv_requests(c, 0, Device::cpu());
    }
  });
  REQUIRE(got.size() == sent.size());
  for (std::size_t i = 0; i < sent.size(); ++i) {
    INFO("request " << i);
    CHECK(got[i].prompt == sent[i].prompt);
    CHECK(got[i].sample_id == sent[i].sample_id);
    CHECK(std::bit_cast<uint32_t>(got[i].sampling.temperature) ==
          std::bit_cast<uint32_t>(sent[i].sampling.temperature));
    CHECK(std::bit_cast<uint32_t>(got[i].sampling.top_p) == std::bit_cast<uint32_t>(sent[i].sampling.top_p));
    CHECK(got[i].sampling.top_k == sent[i].sampling.top_k);
    CHECK(got[i].sampling.max_new_tokens == sent[i].sampling.max_new_tokens);
    CHECK(got[i].sampling.stop_tokens == sent[i].sampling.stop_tokens);
  }
  REQUIRE(back.size() == replies.size());
  for (std::size_t i = 0; i < replies.size(); ++i) {
    INFO("completion " << i);
    CHECK(back[i].sample_id == replies[i].sample_id);
    CHECK(back[i].tokens == replies[i].tokens);
    CHECK(bits(back[i].logprobs) == bits(replies[i].logprobs));
    CHECK(back[i].finish == replies[i].finish);
    CHECK(back[i].error == replies[i].error);
    CHECK(back[i].weight_version == replies[i].weight_version);
    CHECK(back[i].routing == replies[i].routing);
  }
  CHECK(none_got.empty());
}

TEST_CASE("malformed remote messages give clear errors", "[rollout][remote]") {
  std::string truncated, trailing, bad_finish;
  comm::run_local_ranks(2, [&](comm::Comm& c) {
    auto expect_error = [&](std::string& into, auto&& receive) {
      try {
        receive();
      } catch (const std::exception& e) {
        into = e.what();
      }
    };
    if (c.rank() == 0) {
      // 2 requests announced, only the first one's sample id present.
      rollout::detail::remote::send_words(c, 1, {2, 7}, Device::cpu());
      // One empty completion list, then a stray word.
      rollout::detail::remote::send_words(c, 1, {0, 99}, Device::cpu());
      // A completion with finish reason 7.
      rollout::detail::remote::send_words(c, 1, {1, 5, 0, 0, 7, 0, 0}, Device::cpu());
    } else {
      expect_error(truncated, [&] { (void)rollout::recv_requests(c, 0, Device::cpu()); });
      expect_error(trailing, [&] { (void)rollout::recv_completions(c, 0, Device::cpu()); });
      expect_error(bad_finish, [&] { (void)rollout::recv_completions(c, 0, Device::cpu()); });
    }
  });
  CHECK_THAT(truncated, ContainsSubstring("truncated message") || ContainsSubstring("bad length"));
  CHECK_THAT(trailing, ContainsSubstring("1 words left after the completions"));
  CHECK_THAT(bad_finish, ContainsSubstring("bad finish reason 7"));
}
