# One E29a layer forward + backward, hybrid CUDA path (peer: peer_e29a.py; e29a_record.sh joins them).
add_executable(e29a_bench e29a_bench.cpp)
target_link_libraries(e29a_bench PRIVATE models CLI11::CLI11 nlohmann_json::nlohmann_json)
target_include_directories(e29a_bench PRIVATE ${PROJECT_SOURCE_DIR})
