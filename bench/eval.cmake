# Downstream evaluation speed through eval::Evaluator (bench/eval_record.sh records it).
add_executable(eval_bench eval_bench.cpp)
target_link_libraries(eval_bench PRIVATE eval models CLI11::CLI11 nlohmann_json::nlohmann_json)
target_include_directories(eval_bench PRIVATE ${PROJECT_SOURCE_DIR})
