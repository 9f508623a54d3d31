# The Qwen3 decode megakernel: its plan on the host, and its decoder against the cpu and plain cuda decoders.
llmtrain_test(test_megakernel_plan cpu models/qwen3/test_megakernel_plan.cpp)
target_link_libraries(test_megakernel_plan PRIVATE models)
llmtrain_test(test_megakernel_gpu gpu models/qwen3/test_megakernel_gpu.cpp)
target_link_libraries(test_megakernel_gpu PRIVATE models OpenMP::OpenMP_CXX)
