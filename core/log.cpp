#include "core/log.h"

#include <cstdlib>
#include <memory>
#include <string>

#include <spdlog/sinks/stdout_color_sinks.h>

namespace core {

void init_logging(int rank) {
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>("llmtrain", std::move(sink));
  logger->set_pattern("%H:%M:%S [rank " + std::to_string(rank) + "] %^%l%$ %v");
  if (const char* level = std::getenv("LLMTRAIN_LOG_LEVEL")) {
    logger->set_level(spdlog::level::from_str(level));
  }
  spdlog::set_default_logger(std::move(logger));
}

}  // namespace core
