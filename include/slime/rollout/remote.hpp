// slime/rollout/remote.hpp: requests and completions between a trainer rank
// and an engine rank on other devices (disaggregated rollout), point to point
// over a comm::Comm.
//
//   trainer rank t:  send_requests(world, engine_rank, requests, device);
//                    completions = recv_completions(world, engine_rank, device);
//   engine rank e:   requests = recv_requests(world, t, device);
//                    send_completions(world, t, engine.generate(requests), device);
//
// Each message is two point-to-point transfers on `device` (the comm's
// device: NCCL needs device buffers): its length (one i64), then its payload
// as i64 words. Requests carry everything the engine needs (prompt, sampling
// parameters, sample id), so an engine with the trainer's weights and seed
// returns the completions a colocated engine would (the sampler keys each
// sample's random stream by (seed, sample_id); see engine.hpp). The weights
// themselves travel by rollout::send_weights / receive_weights.
#pragma once

#include <bit>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/core/tensor.hpp"
#include "slime/rollout/engine.hpp"

namespace slime::rollout {

namespace detail::remote {

// Words of a message, written and read in the same order.
struct Writer {
  std::vector<int64_t> words;
  void put(int64_t v) { words.push_back(v); }
  void put_f32(float v) { words.push_back(int64_t(std::bit_cast<uint32_t>(v))); }
  template <class T>
  void put_seq(const std::vector<T>& v) {
    put(int64_t(v.size()));
    for (const T& x : v) {
      if constexpr (std::is_same_v<T, float>) {
        put_f32(x);
      } else {
        put(int64_t(x));
      }
    }
  }
  void put_string(const std::string& s) { put_seq(std::vector<char>(s.begin(), s.end())); }
};

struct Reader {
  const std::vector<int64_t>& words;
  std::size_t at = 0;
  int64_t get() {
    SLIME_CHECK(at < words.size(), "rollout remote: truncated message (", words.size(), " words)");
    return words[at++];
  }
  float get_f32() { return std::bit_cast<float>(uint32_t(get())); }
  int64_t get_count() {
    const int64_t n = get();
    SLIME_CHECK(n >= 0 && std::size_t(n) <= words.size() - at, "rollout remote: bad length ", n, " at word ", at - 1);
    return n;
  }
  template <class T>
  std::vector<T> get_seq() {
    std::vector<T> v(static_cast<std::size_t>(get_count()));
    for (T& x : v) {
      if constexpr (std::is_same_v<T, float>) {
        x = get_f32();
      } else {
        x = T(get());
      }
    }
    return v;
  }
  std::string get_string() {
    const std::vector<char> c = get_seq<char>();
    return std::string(c.begin(), c.end());
  }
};

inline void send_words(comm::Comm& comm, int peer, const std::vector<int64_t>& words, Device device) {
  const Tensor n = Tensor::from_vector(std::vector<int64_t>{int64_t(words.size())}, {1}, device);
  comm.send(n, peer);
  if (!words.empty()) comm.send(Tensor::from_vector(words, {int64_t(words.size())}, device), peer);
}

inline std::vector<int64_t> recv_words(comm::Comm& comm, int peer, Device device) {
  Tensor n = Tensor::empty({1}, DType::i64, device);
  comm.recv(n, peer);
  const int64_t count = n.to_vector<int64_t>()[0];
  SLIME_CHECK(count >= 0, "rollout remote: rank ", peer, " announced a message of ", count, " words");
  if (count == 0) return {};
  Tensor words = Tensor::empty({count}, DType::i64, device);
  comm.recv(words, peer);
  return words.to_vector<int64_t>();
}

}  // namespace detail::remote

inline void send_requests(comm::Comm& comm, int peer, const std::vector<Request>& requests, Device device) {
  detail::remote::Writer w;
  w.put(int64_t(requests.size()));
  for (const Request& q : requests) {
    w.put(int64_t(q.sample_id));
    w.put_seq(q.prompt);
    w.put_f32(q.sampling.temperature);
    w.put_f32(q.sampling.top_p);
    w.put(q.sampling.top_k);
    w.put(q.sampling.max_new_tokens);
    w.put_seq(q.sampling.stop_tokens);
  }
  detail::remote::send_words(comm, peer, w.words, device);
}

inline std::vector<Request> recv_requests(comm::Comm& comm, int peer, Device device) {
  const std::vector<int64_t> words = detail::remote::recv_words(comm, peer, device);
  detail::remote::Reader r{words};
  std::vector<Request> out(static_cast<std::size_t>(r.get_count()));
  for (Request& q : out) {
    q.sample_id = uint64_t(r.get());
    q.prompt = r.get_seq<int32_t>();
    q.sampling.temperature = r.get_f32();
    q.sampling.top_p = r.get_f32();
    q.sampling.top_k = r.get();
    q.sampling.max_new_tokens = r.get();
    q.sampling.stop_tokens = r.get_seq<int32_t>();
  }
  SLIME_CHECK(r.at == words.size(), "rollout remote: ", words.size() - r.at, " words left after the requests");
  return out;
}

inline void send_completions(comm::Comm& comm, int peer, const std::vector<Completion>& done, Device device) {
  detail::remote::Writer w;
  w.put(int64_t(done.size()));
  for (const Completion& c : done) {
    w.put(int64_t(c.sample_id));
    w.put_seq(c.tokens);
    w.put_seq(c.logprobs);
    w.put(int64_t(c.finish));
    w.put_string(c.error);
    w.put(c.weight_version);
    w.put_seq(c.routing);
  }
  detail::remote::send_words(comm, peer, w.words, device);
}

inline std::vector<Completion> recv_completions(comm::Comm& comm, int peer, Device device) {
  const std::vector<int64_t> words = detail::remote::recv_words(comm, peer, device);
  detail::remote::Reader r{words};
  std::vector<Completion> out(static_cast<std::size_t>(r.get_count()));
  for (Completion& c : out) {
    c.sample_id = uint64_t(r.get());
    c.tokens = r.get_seq<int32_t>();
    c.logprobs = r.get_seq<float>();
    const int64_t finish = r.get();
    SLIME_CHECK(finish >= 0 && finish <= int64_t(FinishReason::error), "rollout remote: bad finish reason ", finish);
    c.finish = FinishReason(finish);
    c.error = r.get_string();
    c.weight_version = r.get();
    c.routing = r.get_seq<int32_t>();
  }
  SLIME_CHECK(r.at == words.size(), "rollout remote: ", words.size() - r.at, " words left after the completions");
  return out;
}

}  // namespace slime::rollout
