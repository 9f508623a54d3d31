// The optimizer section of a YAML config: accepted values and clear errors for bad ones.
#include <gtest/gtest.h>

#include "core/error.h"
#include "optim/optimizer_config.h"

namespace {

optim::OptimizerConfig parse(const std::string& text) {
  return optim::optimizer_config_from_yaml(YAML::Load(text)["optimizer"], "run.yaml");
}

std::string error_of(const std::string& text) {
  try {
    parse(text);
  } catch (const core::InputError& e) {
    return e.what();
  }
  return "";
}

TEST(OptimizerConfig, ReadsAllKeys) {
  const auto c = parse(
      "optimizer:\n  type: adamw\n  lr: 6e-4\n  betas: [0.8, 0.99]\n  eps: 1e-6\n  weight_decay: 0.05\n"
      "  grad_clip: 0.5\n  nonfinite: zero_element\n");
  EXPECT_EQ(c.type, "adamw");
  EXPECT_DOUBLE_EQ(c.lr, 6e-4);
  EXPECT_DOUBLE_EQ(c.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.beta2, 0.99);
  EXPECT_DOUBLE_EQ(c.eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.weight_decay, 0.05);
  EXPECT_DOUBLE_EQ(c.grad_clip, 0.5);
  EXPECT_EQ(c.nonfinite, optim::NonFinitePolicy::zero_element);
  EXPECT_EQ(parse("optimizer: {lr: 1e-3}").nonfinite, optim::NonFinitePolicy::skip_step);
}

TEST(OptimizerConfig, RejectsBadValuesNamingFileLineAndKey) {
  struct Case {
    std::string yaml, expected;
  };
  const Case cases[] = {
      {"optimizer:\n  lr: 1e-3\n  betta: 0.9\n", "run.yaml:3: optimizer.betta: unknown key"},
      {"optimizer:\n  betas: [0.9, 1.0]\n", "optimizer.betas[1]: expected a number in [0, 1), got 1.0"},
      {"optimizer:\n  betas: 0.9\n", "run.yaml:2: optimizer.betas: expected a list of two numbers"},
      {"optimizer:\n  lr: fast\n", "run.yaml:2: optimizer.lr: expected a number, got 'fast'"},
      {"optimizer:\n  lr: -1\n", "optimizer.lr: expected a finite number >= 0"},
      {"optimizer:\n  eps: 0\n", "optimizer.eps: expected a finite number > 0"},
      {"optimizer:\n  nonfinite: ignore\n", "run.yaml:2: optimizer.nonfinite: expected skip_step or zero_element, got 'ignore'"},
      {"optimizer:\n  type: sgd\n", "optimizer.type: expected one of [adamw], got 'sgd'"},
      {"optimizer:\n  grad_clip: -0.5\n", "optimizer.grad_clip: expected a finite number >= 0"},
      {"optimizer: 3\n", "run.yaml: optimizer: expected a mapping"},
  };
  for (const auto& c : cases) {
    const std::string what = error_of(c.yaml);
    EXPECT_NE(what.find(c.expected), std::string::npos) << "yaml:\n" << c.yaml << "\nerror: '" << what << "'";
  }
}

}  // namespace
