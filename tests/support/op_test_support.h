// Helpers for the model-op tests: fp32/fp64 conversions of random data, a weighted-sum loss
// that turns any op output into a scalar, a central finite-difference check of analytic
// gradients (evaluated in fp64) and an assertion that an op rejects misuse with core::Error.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "support/test_support.h"

namespace optest {

inline std::vector<double> widen(const std::vector<float>& values) { return {values.begin(), values.end()}; }

inline std::vector<float> narrow(const std::vector<double>& values) {
  std::vector<float> out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) out[i] = static_cast<float>(values[i]);
  return out;
}

// N(0, scale^2) values that are exactly representable in fp32, as doubles.
inline std::vector<double> random_doubles(std::mt19937_64& rng, std::size_t n, float scale = 1.0f) {
  return widen(test::random_normal(rng, n, scale));
}

// sum_i values[i] * weights[i]: with random weights, its gradient with respect to the values is
// `weights`, so an op's backward is fed dout = weights.
inline double weighted_sum(const std::vector<double>& values, const std::vector<double>& weights) {
  double sum = 0.0;
  for (std::size_t i = 0; i < values.size(); ++i) sum += values[i] * weights[i];
  return sum;
}

struct FiniteDifferences {
  int coordinates = 64;     // sampled coordinates (every one when the tensor is smaller)
  int directions = 4;       // random unit directions
  double step = 1e-5;       // central difference step
  double tolerance = 1e-6;  // |fd - analytic| <= tolerance * (|analytic| + rms(analytic)) + floor
  double floor = 1e-9;
};

// Compares `analytic` (the gradient of `loss` with respect to `x`) with central differences of
// `loss`, which must read `x` (perturbed in place and restored).
inline ::testing::AssertionResult matches_finite_differences(std::string_view name, std::vector<double>& x,
                                                             const std::vector<double>& analytic,
                                                             const std::function<double()>& loss, std::mt19937_64& rng,
                                                             const FiniteDifferences& options = {}) {
  if (x.size() != analytic.size()) {
    return ::testing::AssertionFailure() << name << ": gradient has " << analytic.size() << " elements, input "
                                         << x.size();
  }
  if (x.empty()) return ::testing::AssertionSuccess();
  double sum_sq = 0.0;
  for (const double g : analytic) sum_sq += g * g;
  const double rms = std::sqrt(sum_sq / static_cast<double>(analytic.size()));
  const double h = options.step;
  auto failure = [&](std::string_view what, std::size_t index, double fd, double expected) {
    return ::testing::AssertionFailure() << name << " " << what << " " << index << ": finite difference " << fd
                                         << " vs analytic " << expected << " (difference " << fd - expected
                                         << ", rms gradient " << rms << ")";
  };
  auto close = [&](double fd, double expected) {
    return std::fabs(fd - expected) <= options.tolerance * (std::fabs(expected) + rms) + options.floor;
  };

  std::vector<std::size_t> picks;
  if (x.size() <= static_cast<std::size_t>(options.coordinates)) {
    for (std::size_t i = 0; i < x.size(); ++i) picks.push_back(i);
  } else {
    std::uniform_int_distribution<std::size_t> pick(0, x.size() - 1);
    for (int c = 0; c < options.coordinates; ++c) picks.push_back(pick(rng));
  }
  for (const std::size_t i : picks) {
    const double saved = x[i];
    x[i] = saved + h;
    const double plus = loss();
    x[i] = saved - h;
    const double minus = loss();
    x[i] = saved;
    const double fd = (plus - minus) / (2 * h);
    if (!close(fd, analytic[i])) return failure("element", i, fd, analytic[i]);
  }

  std::normal_distribution<double> normal;
  for (int d = 0; d < options.directions; ++d) {
    std::vector<double> u(x.size());
    double norm = 0.0;
    for (double& value : u) {
      value = normal(rng);
      norm += value * value;
    }
    norm = std::sqrt(norm);
    double expected = 0.0;
    for (std::size_t i = 0; i < u.size(); ++i) {
      u[i] /= norm;
      expected += analytic[i] * u[i];
    }
    const std::vector<double> saved = x;
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = saved[i] + h * u[i];
    const double plus = loss();
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = saved[i] - h * u[i];
    const double minus = loss();
    x = saved;
    const double fd = (plus - minus) / (2 * h);
    if (!close(fd, expected)) return failure("direction", static_cast<std::size_t>(d), fd, expected);
  }
  return ::testing::AssertionSuccess();
}

}  // namespace optest

// Expects `statement` to throw core::Error whose message contains `text`.
#define EXPECT_OP_ERROR(statement, text)                                                  \
  do {                                                                                    \
    try {                                                                                 \
      statement;                                                                          \
      ADD_FAILURE() << "expected core::Error mentioning \"" << (text) << "\"";            \
    } catch (const core::Error& error) {                                                  \
      EXPECT_NE(std::string(error.what()).find(text), std::string::npos) << error.what(); \
    }                                                                                     \
  } while (0)
