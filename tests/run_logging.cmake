# Run logging and data preparation: TensorBoard event files (our writer and reader, a file of the
# tensorboard package) and tools/make_shards on corpora (many files, JSONL, separators, split,
# threads).
llmtrain_test(test_tensorboard cpu trainer/test_tensorboard.cpp)
target_link_libraries(test_tensorboard PRIVATE trainer_loop)
llmtrain_test(test_make_shards cpu tools/test_make_shards.cpp)
target_link_libraries(test_make_shards PRIVATE text_data)
target_compile_definitions(test_make_shards PRIVATE LLMTRAIN_MAKE_SHARDS="$<TARGET_FILE:make_shards>")
add_dependencies(test_make_shards make_shards)
