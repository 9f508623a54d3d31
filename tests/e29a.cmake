# E29a: the layer's CPU reference (finite differences, the PyTorch fixture, the zero-tape
# degeneracy) and its CUDA path against that reference.
llmtrain_test(test_e29a_cpu cpu models/test_e29a_cpu.cpp)
target_link_libraries(test_e29a_cpu PRIVATE models OpenMP::OpenMP_CXX nlohmann_json::nlohmann_json)
