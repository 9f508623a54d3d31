# Hostile input to the file readers (tests/fuzz), in the ordinary build: every fuzz corpus run
# once through its target without libFuzzer (label cpu), and the regression tests of refused
# inputs. The sanitizer build that fuzzes them: tests/fuzz/CMakeLists.txt via scripts/sanitize.sh.
set(fuzz_dir ${CMAKE_CURRENT_SOURCE_DIR}/fuzz)
add_library(fuzz_support STATIC ${fuzz_dir}/fuzz_support.cpp)
target_link_libraries(fuzz_support PUBLIC trainer_loop)
target_include_directories(fuzz_support PUBLIC ${fuzz_dir})
foreach(name config tokenizer token_shard hf_folder checkpoint)
  add_executable(fuzz_driver_${name} ${fuzz_dir}/fuzz_${name}.cpp ${fuzz_dir}/driver_main.cpp)
  target_link_libraries(fuzz_driver_${name} PRIVATE fuzz_support)
  add_test(NAME FuzzCorpus.${name} COMMAND fuzz_driver_${name} ${fuzz_dir}/corpus/${name})
  set_tests_properties(FuzzCorpus.${name} PROPERTIES LABELS cpu TIMEOUT 300)
endforeach()
llmtrain_test(test_hostile_inputs cpu fuzz/test_hostile_inputs.cpp)
target_link_libraries(test_hostile_inputs PRIVATE trainer_loop)
