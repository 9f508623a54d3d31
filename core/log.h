// Logging through spdlog with the rank in every line ("[rank 3] ..."), so the interleaved
// output of many processes stays readable.
#pragma once

#include <spdlog/spdlog.h>

namespace core {

// Makes the default spdlog logger tag lines with `rank`; level from LLMTRAIN_LOG_LEVEL
// (trace, debug, info, warn, error), info when unset. Safe to call again (e.g. once the rank is known).
void init_logging(int rank);

}  // namespace core
