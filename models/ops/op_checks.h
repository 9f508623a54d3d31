// Argument checks shared by the ops. Every public op validates its sizes, index ranges and
// buffer aliasing before touching memory, and throws core::Error naming the op and the
// offending argument, so a shape mistake in a model fails loudly instead of reading garbage.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

#include "core/error.h"

namespace models::ops::checks {

[[noreturn]] inline void fail(std::string_view op, const std::string& message) {
  throw core::Error(std::string(op) + ": " + message);
}

inline void require_positive(std::string_view op, std::string_view name, std::int64_t value) {
  if (value <= 0) fail(op, std::string(name) + " must be positive, got " + std::to_string(value));
}

inline void require_non_negative(std::string_view op, std::string_view name, std::int64_t value) {
  if (value < 0) fail(op, std::string(name) + " must not be negative, got " + std::to_string(value));
}

// `values` must hold exactly `expected` elements; `formula` says how `expected` was derived.
template <typename Element>
void require_size(std::string_view op, std::string_view name, std::span<Element> values, std::int64_t expected,
                  std::string_view formula) {
  if (static_cast<std::int64_t>(values.size()) != expected) {
    fail(op, std::string(name) + " has " + std::to_string(values.size()) + " elements, expected " +
                 std::to_string(expected) + " (" + std::string(formula) + ")");
  }
}

// A named byte range, for the aliasing check.
struct Region {
  std::string_view name;
  const void* begin;
  std::size_t bytes;
};

template <typename Element>
Region region(std::string_view name, std::span<Element> values) {
  return {name, values.data(), values.size_bytes()};
}

inline bool overlap(const Region& a, const Region& b) {
  if (a.bytes == 0 || b.bytes == 0) return false;
  const std::less<const void*> before;
  const auto* a_end = static_cast<const std::byte*>(a.begin) + a.bytes;
  const auto* b_end = static_cast<const std::byte*>(b.begin) + b.bytes;
  return before(a.begin, b_end) && before(b.begin, a_end);
}

// Outputs must not overlap each other nor any input.
inline void require_disjoint(std::string_view op, std::initializer_list<Region> outputs,
                             std::initializer_list<Region> inputs) {
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    for (auto other = out + 1; other != outputs.end(); ++other) {
      if (overlap(*out, *other)) fail(op, std::string(out->name) + " overlaps " + std::string(other->name));
    }
    for (const Region& in : inputs) {
      if (overlap(*out, in)) fail(op, std::string(out->name) + " overlaps the input " + std::string(in.name));
    }
  }
}

}  // namespace models::ops::checks
