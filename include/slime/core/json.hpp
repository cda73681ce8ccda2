// slime/core/json.hpp: parsing untrusted JSON (config.json, safetensors headers, indexes, JSONL
// lines, checkpoint metadata) so that hostile text ends in a slime::Error naming its source.
//
// nlohmann::json parses nesting of any depth, but copying, comparing or dump()-ing the result
// recurses once per level: 66k '[' overflow the stack. parse_json first scans the text (strings
// and escapes respected) and refuses nesting deeper than kJsonMaxDepth and raw NUL bytes (a NUL
// would end a C-string parse early and the rest would be ignored). json_excerpt prints a bounded
// piece of a value for error messages; json_integer converts with the range of the target type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "slime/core/error.hpp"

namespace slime {

// No real config, header or sample nests deeper than a handful of levels.
inline constexpr int kJsonMaxDepth = 128;

// Throws "<source>: ..." when `text` holds a NUL byte or nests arrays and objects deeper than
// `max_depth`, naming the byte offset. Everything else is left to the parser.
inline void check_json_text(std::string_view text, std::string_view source, int max_depth = kJsonMaxDepth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\0') SLIME_FAIL(source, ": NUL byte at offset ", i, " (JSON text cannot contain one)");
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth)
        SLIME_FAIL(source, ": JSON nests deeper than ", max_depth, " levels (at byte offset ", i, ")");
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
}

// nlohmann's message, cut to a bounded length: it quotes the last token read, which may be a
// 100 KB number.
inline std::string json_parse_error(const nlohmann::json::exception& e, std::size_t max_chars = 240) {
  std::string out(std::string_view(e.what()).substr(0, max_chars));
  return std::string_view(e.what()).size() > max_chars ? out + "..." : out;
}

// check_json_text, then nlohmann's parse; a parse error becomes slime::Error "<source>: not valid
// JSON: ...". `callback` as nlohmann's parser_callback_t (may be null).
inline nlohmann::json parse_json(std::string_view text, std::string_view source,
                                 const nlohmann::json::parser_callback_t& callback = nullptr) {
  check_json_text(text, source);
  try {
    return nlohmann::json::parse(text.begin(), text.end(), callback);
  } catch (const nlohmann::json::exception& e) {
    SLIME_FAIL(source, " is not valid JSON: ", json_parse_error(e));
  }
}

namespace detail {

inline void json_excerpt_into(std::string& out, const nlohmann::json& j, std::size_t max_chars, int depth) {
  if (out.size() >= max_chars) return;
  if (depth > 8) {
    out += j.is_object() ? "{...}" : j.is_array() ? "[...]" : "...";
    return;
  }
  if (j.is_object() || j.is_array()) {
    const bool object = j.is_object();
    out += object ? '{' : '[';
    bool first = true;
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (out.size() >= max_chars) break;
      if (!first) out += ',';
      first = false;
      if (object) {
        out += nlohmann::json(it.key().substr(0, max_chars)).dump();
        out += ':';
      }
      json_excerpt_into(out, *it, max_chars, depth + 1);
    }
    out += object ? '}' : ']';
  } else if (j.is_string()) {
    out += nlohmann::json(j.get_ref<const std::string&>().substr(0, max_chars)).dump();
  } else {
    out += j.dump();
  }
}

inline std::string truncate_excerpt(std::string s, std::size_t max_chars) {
  if (s.size() > max_chars) {
    s.resize(max_chars);
    s += "...";
  }
  return s;
}

}  // namespace detail

// At most about `max_chars` characters of `j` as JSON, "..." marking a cut; never recurses more
// than a few levels, so it is safe on any value.
inline std::string json_excerpt(const nlohmann::json& j, std::size_t max_chars = 80) {
  std::string out;
  detail::json_excerpt_into(out, j, max_chars, 0);
  return detail::truncate_excerpt(std::move(out), max_chars);
}

// The first `max_chars` characters of raw text (NUL and control bytes shown as '?').
inline std::string json_excerpt(std::string_view text, std::size_t max_chars = 80) {
  std::string out(text.substr(0, max_chars));
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 0x20) c = '?';
  return text.size() > max_chars ? out + "..." : out;
}

// `v` as an integer of type T, or slime::Error "<source>: <field> = <v> ..." when it is not an
// integer (floats, booleans, strings are refused, not truncated) or does not fit in T.
template <class T>
T json_integer(const nlohmann::json& v, std::string_view field, std::string_view source) {
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>, "json_integer converts to an integer type");
  if (!v.is_number_integer())
    SLIME_FAIL(source, ": ", field, " = ", json_excerpt(v), " is not an integer (it is a JSON ",
               v.is_number_float() ? "floating-point number" : v.type_name(), ")");
  using Limits = std::numeric_limits<T>;
  bool fits;
  if (v.is_number_unsigned()) {
    fits = v.get<uint64_t>() <= uint64_t(Limits::max());
  } else {
    const int64_t x = v.get<int64_t>();
    fits = Limits::is_signed ? x >= int64_t(Limits::min()) &&
                                   (uint64_t(Limits::max()) >= uint64_t(INT64_MAX) || x <= int64_t(Limits::max()))
                             : x >= 0 && uint64_t(x) <= uint64_t(Limits::max());
  }
  if (!fits)
    SLIME_FAIL(source, ": ", field, " = ", json_excerpt(v), " is out of range [", +Limits::min(), ", ", +Limits::max(),
               "]");
  return v.is_number_unsigned() ? T(v.get<uint64_t>()) : T(v.get<int64_t>());
}

}  // namespace slime
