# Downstream evaluation: tasks, metrics, log-likelihoods against a brute-force reference and the
# transformers fixture, generative items (cpu); the same scores on 1, 2 and 3 ranks (mpi);
# build/evaluate and the committed tasks (tests/eval/run_evaluate.sh).
# The models are tiny: one OpenMP thread each (threads spinning on busy cores cost 10-50x).
add_executable(test_eval eval/test_eval.cpp)
target_link_libraries(test_eval PRIVATE test_support GTest::gtest_main eval trainer_loop)
target_compile_definitions(test_eval PRIVATE LLMTRAIN_FIXTURES_DIR="${CMAKE_CURRENT_SOURCE_DIR}/fixtures"
                           LLMTRAIN_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
gtest_discover_tests(test_eval PROPERTIES LABELS cpu SKIP_REGULAR_EXPRESSION "SKIPPED" ENVIRONMENT "OMP_NUM_THREADS=1"
                     DISCOVERY_TIMEOUT 60)

add_executable(eval_ranks eval/eval_ranks.cpp)
target_link_libraries(eval_ranks PRIVATE eval comm)
target_compile_definitions(eval_ranks PRIVATE LLMTRAIN_SOURCE_DIR="${PROJECT_SOURCE_DIR}")
add_test(NAME EvalMpi.SameScoresOn123Ranks
         COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/eval/run_eval_ranks.sh ${MPIEXEC_EXECUTABLE} $<TARGET_FILE:eval_ranks>)
set_tests_properties(EvalMpi.SameScoresOn123Ranks PROPERTIES LABELS mpi TIMEOUT 300
                     ENVIRONMENT "${LLMTRAIN_MPI_TEST_ENV};OMP_NUM_THREADS=1")

add_test(NAME Evaluate.CpuToolAndTasks COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/eval/run_evaluate.sh
         ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR})
set_tests_properties(Evaluate.CpuToolAndTasks PROPERTIES LABELS cpu TIMEOUT 300 ENVIRONMENT "OMP_NUM_THREADS=1")
add_test(NAME Evaluate.TrainerTasks COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/eval/run_trainer_tasks.sh
         ${PROJECT_BINARY_DIR} ${PROJECT_SOURCE_DIR})
set_tests_properties(Evaluate.TrainerTasks PROPERTIES LABELS cpu TIMEOUT 300 ENVIRONMENT "OMP_NUM_THREADS=1")
