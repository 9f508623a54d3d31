# Batch-1 generation with the Qwen3 decoder (peer: peer_decode.py).
add_executable(decode_bench decode_bench.cpp)
target_link_libraries(decode_bench PRIVATE models CLI11::CLI11 nlohmann_json::nlohmann_json)
target_include_directories(decode_bench PRIVATE ${PROJECT_SOURCE_DIR})
