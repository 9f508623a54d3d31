// Scoring of one item, as lm-evaluation-harness scores its multiple-choice tasks and as the
// generative metrics are defined in docs/evaluation.md.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace eval {

// Characters (Unicode code points, as Python's len()) of UTF-8 text; an invalid byte counts as one.
std::int64_t character_count(std::string_view text);

// Leading and trailing whitespace removed, every inner run of whitespace one space.
std::string normalize_whitespace(std::string_view text);

// `text` up to the first occurrence of any of `stops` (all of it when none occurs).
std::string cut_at_stop(std::string_view text, const std::vector<std::string>& stops);

// The index of the largest value, the first among equal ones (numpy.argmax).
int argmax(std::span<const double> values);

// Multiple choice: acc picks the largest summed log-likelihood; acc_norm the largest
// log-likelihood divided by the ending's length in characters (lm-evaluation-harness:
// completion_len = len(choice), the choice without the space put before it).
struct ChoiceScore {
  int prediction = 0;       // argmax of loglik
  int prediction_norm = 0;  // argmax of loglik / characters
  double acc = 0, acc_norm = 0;
};
ChoiceScore score_choices(std::span<const double> loglik, const std::vector<std::string>& endings, int label);

// Generative: over the answers, after whitespace normalisation of both sides, exact match (1 or 0)
// and the largest share of an answer's characters that the output reproduces as its prefix.
struct GenerativeScore {
  double exact_match = 0;
  double prefix_share = 0;
};
GenerativeScore score_generation(std::string_view output, const std::vector<std::string>& answers);

}  // namespace eval
