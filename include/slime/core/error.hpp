// slime/core/error.hpp: slime::Error and the checking macros every layer uses.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace slime {

// The one exception type of the host API. what() reads
// "<file>:<line>: <message>" so a failure says where it was raised.
class Error : public std::runtime_error {
 public:
  Error(std::string message, const char* file = nullptr, int line = 0)
      : std::runtime_error(format(message, file, line)), message_(std::move(message)) {}

  // The message without the location prefix.
  const std::string& message() const noexcept { return message_; }

 private:
  static std::string format(const std::string& message, const char* file, int line) {
    if (file == nullptr) return message;
    std::string_view path(file);
    // Keep the path from include/ or src/ on, not the build machine's prefix.
    for (std::string_view root : {"include/slime/", "src/", "tests/", "examples/", "bench/"}) {
      if (auto pos = path.rfind(root); pos != std::string_view::npos) {
        path = path.substr(pos);
        break;
      }
    }
    std::ostringstream out;
    out << path << ":" << line << ": " << message;
    return out.str();
  }

  std::string message_;
};

namespace detail {

// Streams every argument into one string: SLIME_CHECK(x > 0, "x=", x).
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  if constexpr (sizeof...(Args) > 0) (out << ... << args);
  return out.str();
}

// "<message> [check failed: <cond>]", or "check failed: <cond>" without a message.
inline std::string check_message(std::string message, const char* cond) {
  if (message.empty()) return std::string("check failed: ") + cond;
  return message + " [check failed: " + cond + "]";
}

[[noreturn]] inline void throw_error(const char* file, int line, std::string message) {
  throw Error(std::move(message), file, line);
}

}  // namespace detail
}  // namespace slime

// Throws slime::Error when `cond` is false: the streamed message first, then the
// condition's text, "<message> [check failed: <cond>]", so a user reads what is
// wrong before the internal expression. Use for preconditions on user input;
// never for hot loops.
#define SLIME_CHECK(cond, ...)                                                                                   \
  do {                                                                                                           \
    if (!(cond)) [[unlikely]] {                                                                                  \
      ::slime::detail::throw_error(__FILE__, __LINE__,                                                           \
                                   ::slime::detail::check_message(::slime::detail::concat(__VA_ARGS__), #cond)); \
    }                                                                                                            \
  } while (0)

// Throws slime::Error unconditionally with the streamed message.
#define SLIME_FAIL(...) \
  ::slime::detail::throw_error(__FILE__, __LINE__, ::slime::detail::concat(__VA_ARGS__))
