// UTF-8 coding, character classes by binary search over generated ranges, and NFC.
#include "text/unicode_text.h"

#include <algorithm>
#include <cstdint>
#include <iterator>

#include "core/error.h"

namespace text::unicode {
namespace {

struct CodeRange {
  char32_t first, last;
};
struct ClassRange {
  char32_t first, last;
  int combining_class;
};
struct Decomposition {
  char32_t code_point;
  std::uint32_t offset, length;
};
struct Composition {
  char32_t first, second, composite;
};

#include "text/unicode_tables.inc"

template <typename Range, std::size_t N>
const Range* find_range(const Range (&table)[N], char32_t c) {
  const Range* it = std::upper_bound(std::begin(table), std::end(table), c,
                                     [](char32_t value, const Range& r) { return value < r.first; });
  if (it == std::begin(table)) return nullptr;
  --it;
  return c <= it->last ? it : nullptr;
}

constexpr char32_t kHangulBase = 0xAC00, kLeadBase = 0x1100, kVowelBase = 0x1161, kTrailBase = 0x11A7;
constexpr char32_t kLeadCount = 19, kVowelCount = 21, kTrailCount = 28;
constexpr char32_t kSyllablesPerLead = kVowelCount * kTrailCount, kHangulCount = kLeadCount * kSyllablesPerLead;

void decompose(char32_t c, std::u32string& out) {
  if (c >= kHangulBase && c < kHangulBase + kHangulCount) {
    const char32_t index = c - kHangulBase;
    out.push_back(kLeadBase + index / kSyllablesPerLead);
    out.push_back(kVowelBase + (index % kSyllablesPerLead) / kTrailCount);
    if (index % kTrailCount != 0) out.push_back(kTrailBase + index % kTrailCount);
    return;
  }
  const auto* it = std::lower_bound(std::begin(kDecompositions), std::end(kDecompositions), c,
                                    [](const Decomposition& d, char32_t value) { return d.code_point < value; });
  if (it != std::end(kDecompositions) && it->code_point == c) {
    out.append(kDecompositionData + it->offset, it->length);
  } else {
    out.push_back(c);
  }
}

// The primary composite of (first, second), or 0.
char32_t compose(char32_t first, char32_t second) {
  if (first >= kLeadBase && first < kLeadBase + kLeadCount && second >= kVowelBase &&
      second < kVowelBase + kVowelCount) {
    return kHangulBase + ((first - kLeadBase) * kVowelCount + (second - kVowelBase)) * kTrailCount;
  }
  if (first >= kHangulBase && first < kHangulBase + kHangulCount && (first - kHangulBase) % kTrailCount == 0 &&
      second > kTrailBase && second < kTrailBase + kTrailCount) {
    return first + (second - kTrailBase);
  }
  const auto* it = std::lower_bound(std::begin(kCompositions), std::end(kCompositions), std::pair{first, second},
                                    [](const Composition& c, const std::pair<char32_t, char32_t>& key) {
                                      return std::pair{c.first, c.second} < key;
                                    });
  if (it != std::end(kCompositions) && it->first == first && it->second == second) return it->composite;
  return 0;
}

}  // namespace

std::u32string decode_utf8(std::string_view text, std::string_view what) {
  std::u32string out;
  out.reserve(text.size());
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const std::size_t n = text.size();
  std::size_t i = 0;
  while (i < n) {
    const unsigned char b = s[i];
    if (b < 0x80) {
      out.push_back(b);
      ++i;
      continue;
    }
    int length = 0;
    char32_t c = 0, minimum = 0;
    if ((b & 0xE0) == 0xC0) {
      length = 2, c = b & 0x1F, minimum = 0x80;
    } else if ((b & 0xF0) == 0xE0) {
      length = 3, c = b & 0x0F, minimum = 0x800;
    } else if ((b & 0xF8) == 0xF0) {
      length = 4, c = b & 0x07, minimum = 0x10000;
    }
    bool valid = length > 0 && i + static_cast<std::size_t>(length) <= n;
    for (int k = 1; valid && k < length; ++k) {
      const unsigned char continuation = s[i + static_cast<std::size_t>(k)];
      valid = (continuation & 0xC0) == 0x80;
      c = (c << 6) | (continuation & 0x3F);
    }
    valid = valid && c >= minimum && c <= 0x10FFFF && !(c >= 0xD800 && c <= 0xDFFF);
    if (!valid) {
      throw core::InputError(std::string(what) + ": invalid UTF-8 at byte offset " + std::to_string(i));
    }
    out.push_back(c);
    i += static_cast<std::size_t>(length);
  }
  return out;
}

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string encode_utf8(std::u32string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char32_t c : text) append_utf8(out, c);
  return out;
}

bool is_letter(char32_t c) {
  if (c < 0x80) return (c | 0x20) >= 'a' && (c | 0x20) <= 'z';
  return find_range(kLetterRanges, c) != nullptr;
}

bool is_number(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  return find_range(kNumberRanges, c) != nullptr;
}

bool is_whitespace(char32_t c) {
  if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D);
  switch (c) {
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000: return true;
    default: return c >= 0x2000 && c <= 0x200A;
  }
}

int combining_class(char32_t c) {
  if (c < 0x300) return 0;
  const ClassRange* range = find_range(kCombiningClass, c);
  return range ? range->combining_class : 0;
}

std::u32string nfc(std::u32string_view text) {
  // Below U+0300 every character is its own NFC form and none composes with a neighbour.
  if (std::all_of(text.begin(), text.end(), [](char32_t c) { return c < 0x300; })) return std::u32string(text);

  std::u32string decomposed;
  decomposed.reserve(text.size() + 8);
  for (char32_t c : text) decompose(c, decomposed);

  // Canonical ordering: stable sort of each run of non-starters by combining class.
  for (std::size_t i = 0; i < decomposed.size();) {
    if (combining_class(decomposed[i]) == 0) {
      ++i;
      continue;
    }
    std::size_t end = i;
    while (end < decomposed.size() && combining_class(decomposed[end]) != 0) ++end;
    std::stable_sort(decomposed.begin() + static_cast<std::ptrdiff_t>(i),
                     decomposed.begin() + static_cast<std::ptrdiff_t>(end),
                     [](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = end;
  }

  // Canonical composition: each character composes with the last starter unless blocked.
  std::u32string out;
  out.reserve(decomposed.size());
  std::size_t starter = 0;
  bool have_starter = false;
  int last_class = 0;
  for (char32_t c : decomposed) {
    const int c_class = combining_class(c);
    if (have_starter) {
      const bool adjacent = out.size() == starter + 1;
      const bool unblocked = adjacent ? true : (last_class != 0 && last_class < c_class);
      if (unblocked) {
        if (const char32_t composite = compose(out[starter], c)) {
          out[starter] = composite;
          continue;
        }
      }
    }
    if (c_class == 0) {
      starter = out.size();
      have_starter = true;
    }
    last_class = c_class;
    out.push_back(c);
  }
  return out;
}

}  // namespace text::unicode
