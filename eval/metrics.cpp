#include "eval/metrics.h"

#include <algorithm>

#include "core/error.h"

namespace eval {

namespace {

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

// Byte length of the UTF-8 sequence starting at text[i] (1 for an invalid or cut one).
std::size_t sequence_bytes(std::string_view text, std::size_t i) {
  const auto lead = static_cast<unsigned char>(text[i]);
  const std::size_t n = lead < 0x80 ? 1 : (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xE ? 3 : (lead >> 3) == 0x1E ? 4 : 1;
  if (i + n > text.size()) return 1;
  for (std::size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(text[i + k]) & 0xC0) != 0x80) return 1;
  }
  return n;
}

}  // namespace

std::int64_t character_count(std::string_view text) {
  std::int64_t count = 0;
  for (std::size_t i = 0; i < text.size(); i += sequence_bytes(text, i)) ++count;
  return count;
}

std::string normalize_whitespace(std::string_view text) {
  std::string out;
  bool pending_space = false;
  for (const char c : text) {
    if (is_space(c)) {
      pending_space = !out.empty();
      continue;
    }
    if (pending_space) out.push_back(' ');
    pending_space = false;
    out.push_back(c);
  }
  return out;
}

std::string cut_at_stop(std::string_view text, const std::vector<std::string>& stops) {
  std::size_t end = text.size();
  for (const std::string& stop : stops) {
    if (stop.empty()) continue;
    end = std::min(end, text.find(stop));
  }
  return std::string(text.substr(0, end));
}

int argmax(std::span<const double> values) {
  if (values.empty()) throw core::Error("eval::argmax: no values");
  int best = 0;
  for (std::size_t i = 1; i < values.size(); ++i) {
    if (values[i] > values[static_cast<std::size_t>(best)]) best = static_cast<int>(i);
  }
  return best;
}

ChoiceScore score_choices(std::span<const double> loglik, const std::vector<std::string>& endings, int label) {
  if (loglik.size() != endings.size()) throw core::Error("eval::score_choices: one log-likelihood per ending");
  std::vector<double> normalized(loglik.size());
  for (std::size_t i = 0; i < loglik.size(); ++i) {
    normalized[i] = loglik[i] / static_cast<double>(character_count(endings[i]));
  }
  ChoiceScore s;
  s.prediction = argmax(loglik);
  s.prediction_norm = argmax(normalized);
  s.acc = s.prediction == label ? 1.0 : 0.0;
  s.acc_norm = s.prediction_norm == label ? 1.0 : 0.0;
  return s;
}

GenerativeScore score_generation(std::string_view output, const std::vector<std::string>& answers) {
  const std::string got = normalize_whitespace(output);
  GenerativeScore s;
  for (const std::string& answer : answers) {
    const std::string want = normalize_whitespace(answer);
    if (got == want) s.exact_match = 1.0;
    // Characters of `want` that `got` starts with, counted whole (a partial UTF-8 sequence is no match).
    std::size_t i = 0;
    std::int64_t matched = 0;
    while (i < want.size()) {
      const std::size_t n = sequence_bytes(want, i);
      if (i + n > got.size() || got.compare(i, n, want, i, n) != 0) break;
      i += n;
      ++matched;
    }
    const std::int64_t total = character_count(want);
    if (total > 0) s.prefix_share = std::max(s.prefix_share, static_cast<double>(matched) / static_cast<double>(total));
  }
  return s;
}

}  // namespace eval
