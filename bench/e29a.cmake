# One E29a layer forward + backward, hybrid CUDA path (peer: peer_e29a.py; e29a_record.sh joins them).
add_executable(e29a_bench e29a_bench.cpp)
target_link_libraries(e29a_bench PRIVATE models CLI11::CLI11 nlohmann_json::nlohmann_json)
target_include_directories(e29a_bench PRIVATE ${PROJECT_SOURCE_DIR})

# The gradient at a trained state: CUDA path against the CPU reference, and the backward through time.
add_executable(e29a_gradient_probe e29a_gradient_probe.cpp)
target_link_libraries(e29a_gradient_probe PRIVATE trainer_loop models CLI11::CLI11 nlohmann_json::nlohmann_json)
target_include_directories(e29a_gradient_probe PRIVATE ${PROJECT_SOURCE_DIR})
