// Under mpirun: the shipped tasks (the first 13 items of each) on a small random Qwen3 on the cpu,
// items split over the ranks and the scores summed over MPI; rank 0 writes every metric (17
// digits) and its own items' results to the file named by argv[1]. run_eval_ranks.sh compares the
// metrics of 1, 2 and 3 ranks.
#include <cstdio>
#include <fstream>

#include "comm/communicator.h"
#include "eval/evaluator.h"
#include "text/tokenizer.h"
#include "tiny_model.h"

int main(int argc, char** argv) {
  comm::Environment environment(&argc, &argv);
  if (argc != 2) {
    std::fprintf(stderr, "usage: eval_ranks OUT\n");
    return 2;
  }
  auto m = test::TinyModel::qwen3(31);
  const auto communicator = comm::make_communicator(environment, m.context, {});
  const int rank = communicator->rank(), world = communicator->world();
  text::ByteTokenizer bytes;
  eval::Evaluator evaluator(*m.spec, bytes, {.max_sequence = 256, .max_sequence_name = "data.seq_len"});
  const eval::ModelAccess model{.spec = m.spec.get(),
                                .slab = m.slab.get(),
                                .context = &m.context,
                                .scorer = m.scorer.get(),
                                .scorer_tokens = 4096};
  const std::string tasks = std::string(LLMTRAIN_SOURCE_DIR) + "/data/tasks/";
  for (const auto& task : eval::load_tasks({tasks + "kjv_next_verse.jsonl", tasks + "kjv_verse_completion.jsonl"})) {
    evaluator.add(task, 13);
  }
  const auto results = evaluator.run(model, rank, world, [&](std::vector<double> values) {
    return communicator->all_reduce_host(std::move(values), comm::ReduceOp::sum, "evaluation scores");
  });
  if (rank == 0) {
    std::ofstream out(argv[1]);
    for (const auto& r : results) {
      for (const auto& [name, value] : r.metrics) {
        char line[128];
        std::snprintf(line, sizeof line, "%s %s %.17g\n", r.name.c_str(), name.c_str(), value);
        out << line;
      }
    }
  }
  communicator->barrier("done");
  return 0;
}
