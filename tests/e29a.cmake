# E29a: the layer's CPU reference (finite differences, the PyTorch fixture, the zero-tape
# degeneracy) and its CUDA path against that reference.
llmtrain_test(test_e29a_cpu cpu models/e29a/test_e29a_cpu.cpp)
target_link_libraries(test_e29a_cpu PRIVATE models OpenMP::OpenMP_CXX nlohmann_json::nlohmann_json)
llmtrain_test(test_e29a_gpu gpu models/e29a/test_e29a_gpu.cpp)
target_link_libraries(test_e29a_gpu PRIVATE models)
# The family end to end on the CPU: training with the loss falling, resume on 2 ranks, export, init_from.
add_test(NAME E29a.TrainResumeExport COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/models/e29a/run_e29a_train.sh
         ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR})
set_tests_properties(E29a.TrainResumeExport PROPERTIES LABELS "cpu;mpi" TIMEOUT 600)
# The multi-rank CPU tests (loss parity over 1/2/3 ranks for each optimizer and ZeRO stage; resume
# on another world size; ZeRO-3's samples and task scores against ZeRO-1's) on an E29a config.
# Muon's parity runs on ci-tiny only (its assembly does not depend on the family; E29a's matrices
# are checked in test_muon_cpu and resumed here), which keeps this test's time.
set(e29a_mpi_args_parity adamw adamw8bit adafactor)
foreach(script parity reshard zero3_decode)
  add_test(NAME E29a.Mpi_${script} COMMAND env MPI_CONFIG=${PROJECT_SOURCE_DIR}/configs/e29a-ci-tiny.yaml
           bash ${CMAKE_CURRENT_SOURCE_DIR}/trainer/run_mpi_${script}.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR}
           ${e29a_mpi_args_${script}})
  set_tests_properties(E29a.Mpi_${script} PROPERTIES LABELS mpi TIMEOUT 900)
endforeach()
# ZeRO-3 on cuda (the layer-by-layer gathers, prefetched): samples, validation losses and task
# scores equal ZeRO-1's bit for bit on 1 and 2 GPUs.
add_test(NAME E29a.Nccl_zero3_decode
         COMMAND env MPI_CONFIG=${PROJECT_SOURCE_DIR}/configs/e29a-ci-tiny.yaml
                 "MPI_EXTRA_ARGS=device=cuda training.precision=bf16" "MPI_DECODE_WORLDS=1 2" bash
                 ${CMAKE_CURRENT_SOURCE_DIR}/trainer/run_mpi_zero3_decode.sh ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR})
set_tests_properties(E29a.Nccl_zero3_decode PROPERTIES LABELS nccl TIMEOUT 600 SKIP_REGULAR_EXPRESSION "SKIPPED"
                     ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
# The language model behind the model interface: cpu gradients, decoder; cuda against cpu.
llmtrain_test(test_e29a_model_cpu cpu models/e29a/test_e29a_model_cpu.cpp)
target_link_libraries(test_e29a_model_cpu PRIVATE models)
llmtrain_test(test_e29a_model_gpu gpu models/e29a/test_e29a_model_gpu.cpp)
target_link_libraries(test_e29a_model_gpu PRIVATE models)
# The shipped N = 16 upstream config trains 120 steps on the GPU without its gradient exploding.
add_test(NAME E29a.UpstreamRecipeStable COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/models/e29a/run_e29a_recipe.sh
         ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR})
set_tests_properties(E29a.UpstreamRecipeStable PROPERTIES LABELS gpu SKIP_REGULAR_EXPRESSION "SKIPPED" TIMEOUT 400)
