# Stateful generation: KV-cache decoders (cpu reference, cuda), token sampling, text decoding.
llmtrain_test(test_decoder_cpu cpu models/qwen3/test_decoder_cpu.cpp)
target_link_libraries(test_decoder_cpu PRIVATE models)
llmtrain_test(test_sampling cpu models/ops/test_sampling.cpp)
target_link_libraries(test_sampling PRIVATE models)
llmtrain_test(test_decoder_bpe cpu text/test_decoder_bpe.cpp)
target_link_libraries(test_decoder_bpe PRIVATE text_data)
# GPU suites with a time limit per test (a hung kernel fails the test instead of stalling the run;
# tests/support/gpu_watchdog.h also ends the process from inside).
foreach(source models/qwen3/test_decoder_gpu.cpp models/ops/test_sampling_gpu.cpp)
  get_filename_component(name ${source} NAME_WE)
  add_executable(${name} ${source})
  target_link_libraries(${name} PRIVATE test_support GTest::gtest_main models OpenMP::OpenMP_CXX)
  target_compile_definitions(${name} PRIVATE LLMTRAIN_FIXTURES_DIR="${CMAKE_CURRENT_SOURCE_DIR}/fixtures")
  gtest_discover_tests(${name} PROPERTIES LABELS gpu SKIP_REGULAR_EXPRESSION "SKIPPED" TIMEOUT 180
                       DISCOVERY_TIMEOUT 60)
endforeach()
# build/generate: greedy ids equal transformers' on the fixture folders, exit 2 on bad input, and
# samples and generation from byte-level and BPE training runs (tests/models/run_generate.sh).
add_test(NAME Generate.CpuFixturesAndRuns COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/models/run_generate.sh
         ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR})
set_tests_properties(Generate.CpuFixturesAndRuns PROPERTIES LABELS cpu TIMEOUT 600)
# What each tool refuses (tests/tools/bad_inputs.sh; the table of docs/bad_inputs.md).
foreach(tool generate make_shards export_hf plot_metrics)
  add_test(NAME BadInputs.${tool} COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/tools/bad_inputs.sh ${PROJECT_BINARY_DIR}
           ${PROJECT_SOURCE_DIR} ${tool})
  set_tests_properties(BadInputs.${tool} PROPERTIES LABELS cpu TIMEOUT 120)
endforeach()
