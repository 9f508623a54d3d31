# Batch-1 decoding with the Qwen3 decode megakernel against the measured bandwidth floor.
add_executable(megakernel_bench megakernel_bench.cpp)
target_link_libraries(megakernel_bench PRIVATE models CLI11::CLI11 nlohmann_json::nlohmann_json)
target_include_directories(megakernel_bench PRIVATE ${PROJECT_SOURCE_DIR})

# The floor under one dependent phase: block-to-block hand-off latency by method and vector size.
add_executable(handoff_bench handoff_bench.cu)
target_link_libraries(handoff_bench PRIVATE core)
target_include_directories(handoff_bench PRIVATE ${PROJECT_SOURCE_DIR})

# What thread-block clusters cost (co-residency, cluster barrier, distributed shared memory) against
# a grid-wide hand-off: the measurements behind the megakernel's design (docs/megakernel.md).
add_executable(cluster_bench cluster_bench.cu)
target_link_libraries(cluster_bench PRIVATE core)
target_include_directories(cluster_bench PRIVATE ${PROJECT_SOURCE_DIR})
