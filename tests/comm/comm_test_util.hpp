// Helpers of the bootstrap and watchdog tests: free_port() (a loopback TCP
// port the kernel just handed out, so it is free for the next moments) and
// rank_of() (a ProcessInfo of one host).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <catch2/catch_test_macros.hpp>

#include "slime/comm/bootstrap.hpp"

namespace slime::comm::test {

inline int free_port() {
  slime::comm::detail::Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  REQUIRE(fd);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  REQUIRE(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  socklen_t len = sizeof(addr);
  REQUIRE(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  return ntohs(addr.sin_port);
}

inline ProcessInfo rank_of(int rank, int world_size) {
  ProcessInfo info;
  info.rank = rank;
  info.world_size = world_size;
  info.local_rank = rank;
  info.local_world_size = world_size;
  return info;
}

}  // namespace slime::comm::test
