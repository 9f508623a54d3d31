# Run logging and data preparation: TensorBoard event files (our writer and reader, a file of the
# tensorboard package) and tools/make_shards on corpora (many files, JSONL, separators, split,
# threads).
llmtrain_test(test_tensorboard cpu trainer/test_tensorboard.cpp)
target_link_libraries(test_tensorboard PRIVATE trainer_loop)
