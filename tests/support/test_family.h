// A test-only model family, "bigram": logits = tanh(E[x] A^T + b) U^T, cpu only. It exists to
// show that a family is a folder of code plus one add_family call: the unchanged trainer and
// export tool train, checkpoint, resume, reshard and export it (tests/trainer/run_test_family.sh).
#pragma once

#include "models/model.h"

namespace test {

const models::Family& bigram_family();

}  // namespace test
