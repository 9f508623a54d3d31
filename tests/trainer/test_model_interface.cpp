// The model interface's config and folder plumbing: config.json keys of the committed Qwen3
// fixtures round-trip through a shape and back; an export carries metadata, writes
// generation_config.json and copies the tokenizer; a checkpoint whose manifest records the model
// the way manifests did before the interface (a Qwen3 config.json object) still resumes and loads.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "core/error.h"
#include "models/hf_folder.h"
#include "models/model_config.h"
#include "models/registry.h"
#include "text/token_shard.h"
#include "trainer/checkpoint.h"
#include "trainer/config.h"
#include "trainer/pretrained.h"
#include "trainer/train.h"

namespace {

namespace fs = std::filesystem;

std::string fixture(const std::string& name) { return std::string(LLMTRAIN_FIXTURES_DIR) + "/qwen3/" + name; }

fs::path fresh_dir(const std::string& name) {
  const fs::path dir =
      fs::temp_directory_path() / ("llmtrain_model_interface_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TEST(ModelInterface, FixtureConfigKeysRoundTrip) {
  for (const std::string name : {"tied", "untied"}) {
    const models::HfConfig read = models::read_hf_config(fixture(name));
    ASSERT_EQ(read.family->name(), "qwen3");
    const auto spec = read.family->spec(read.shape);
    const nlohmann::ordered_json written = spec->hf_config(read.config);
    for (const auto& [key, value] : read.config.items()) {
      ASSERT_TRUE(written.contains(key)) << name << ": " << key;
      EXPECT_EQ(written[key], value) << name << ": " << key;
    }
    // And the shape read back from what was written is the same shape.
    EXPECT_EQ(models::shape_from_hf(*read.family, written, "written", models::base_shape(*read.family, "")),
              read.shape);
  }
}

TEST(ModelInterface, UnsupportedConfigJsonIsRefusedByKey) {
  const models::Family& qwen3 = models::family("qwen3");
  const nlohmann::json base = models::read_json_file(fixture("tied") + "/config.json");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"rope_scaling": {"type": "yarn", "factor": 4.0}})", "rope_scaling: rope scaling is not supported"},
      {R"({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0}})", "rope_parameters.rope_type:"},
      {R"({"use_sliding_window": true})", "use_sliding_window:"},
      {R"({"attention_bias": true})", "attention_bias:"},
      {R"({"hidden_act": "gelu"})", "hidden_act: expected 'silu'"},
      {R"({"dtype": "float8_e4m3fn"})", "dtype: expected float32, bfloat16 or float16"},
      {R"({"num_attention_heads": 0})", "num_attention_heads: expected an integer >= 1, got 0"},
      {R"({"num_key_value_heads": 3})", "num_key_value_heads: expected a divisor of num_heads"},
      {R"({"hidden_size": 1.5})", "hidden_size: expected an integer"},
  };
  for (const auto& [patch, expected] : cases) {
    nlohmann::json j = base;
    j.merge_patch(nlohmann::json::parse(patch));
    try {
      models::shape_from_hf(qwen3, j, "config.json", models::base_shape(qwen3, ""));
      ADD_FAILURE() << "accepted " << patch;
    } catch (const core::InputError& e) {
      EXPECT_NE(std::string(e.what()).find("config.json: " + expected), std::string::npos) << e.what();
    }
  }
}

TEST(ModelInterface, InvalidJsonNamesLineAndColumn) {
  const fs::path dir = fresh_dir("json");
  std::ofstream(dir / "config.json") << "{\n  \"a\": 1,\n  \"b\": [1, 2,, 3]\n}\n";
  try {
    models::read_json_file(dir / "config.json");
    FAIL() << "accepted invalid JSON";
  } catch (const core::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("config.json:3:"), std::string::npos) << e.what();
  }
  std::string deep(200, '[');
  std::ofstream(dir / "deep.json") << deep;
  EXPECT_THROW(models::read_json_file(dir / "deep.json"), core::InputError);
  fs::remove_all(dir);
}

TEST(ModelInterface, ExportCarriesMetadataGenerationConfigAndTokenizer) {
  const fs::path dir = fresh_dir("export");
  const models::HfConfig read = models::read_hf_config(fixture("tied"));
  const auto spec = read.family->spec(read.shape);
  const optim::SlabLayout layout(spec->parameters(), 1);
  std::vector<float> master(static_cast<std::size_t>(layout.total_elements()), 0.5f);
  nlohmann::json carried = read.config;
  carried["bos_token_id"] = 1;
  carried["eos_token_id"] = 2;
  carried["rope_theta"] = 1.0;  // a superseded spelling: the shape's rope_parameters win
  std::ofstream(dir / "tok.json") << "{\"model\": {}}";
  models::write_hf_folder(dir / "out", *spec, layout, master.data(), models::ExportDtype::bf16, carried,
                          dir / "tok.json");
  const nlohmann::json config = models::read_json_file(dir / "out" / "config.json");
  EXPECT_EQ(config["dtype"], "bfloat16");
  EXPECT_EQ(config["bos_token_id"], 1);
  EXPECT_FALSE(config.contains("rope_theta"));
  EXPECT_EQ(config["rope_parameters"]["rope_theta"], 10000.0);
  const nlohmann::json generation = models::read_json_file(dir / "out" / "generation_config.json");
  EXPECT_EQ(generation["bos_token_id"], 1);
  EXPECT_EQ(generation["eos_token_id"], 2);
  EXPECT_TRUE(fs::exists(dir / "out" / "tokenizer.json"));
  EXPECT_FALSE(fs::exists(dir / "out" / "lm_head.weight"));
  fs::remove_all(dir);
}

TEST(ModelInterface, TiedFolderWithADifferentHeadIsRefused) {
  const fs::path dir = fresh_dir("tied_head");
  const models::HfConfig read = models::read_hf_config(fixture("untied"));
  // The untied fixture's weights under a tied config: lm_head.weight differs from the embedding.
  fs::copy(fixture("untied"), dir / "folder");
  nlohmann::json config = read.config;
  config["tie_word_embeddings"] = true;
  std::ofstream(dir / "folder" / "config.json") << config.dump(2);
  const models::HfConfig tied = models::read_hf_config(dir / "folder");
  const auto spec = tied.family->spec(tied.shape);
  const core::DeviceContext cpu(core::Device::cpu());
  optim::Slab slab(optim::SlabLayout(spec->parameters(), 1), cpu);
  try {
    models::load_hf_weights(dir / "folder", *spec, slab);
    FAIL() << "accepted a tied config with a different lm_head.weight";
  } catch (const core::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("'lm_head.weight' differs from the tensor it is tied to"), std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

// A checkpoint whose manifest records the model as manifests did before the model interface.
TEST(ModelInterface, ManifestsOfEarlierVersionsStillResume) {
  const fs::path dir = fresh_dir("legacy");
  std::vector<std::uint32_t> tokens(4000);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint32_t>((i * 7919) % 251);
  text::write_token_shard(dir / "train.bin", tokens, text::TokenDtype::u16);
  const std::string yaml = "run: {output_dir: " + (dir / "run").string() +
                           "}\ndevice: cpu\nmodel: {preset: qwen3-tiny, hidden_size: 32, intermediate_size: 64, "
                           "num_layers: 1, num_heads: 2, num_kv_heads: 1, head_dim: 16}\n"
                           "data: {train: " +
                           (dir / "train.bin").string() +
                           ", seq_len: 16}\n"
                           "training: {micro_batch_size: 2, max_steps: 4}\nschedule: {warmup_steps: 1}\n"
                           "checkpoint: {every: 2, keep_last: 0}\nlogging: {every: 1}\nsample: {tokens: 1}\n";
  const trainer::RunConfig config = trainer::parse_run_config(yaml, "legacy.yaml", {});
  trainer::train(config, {.stop_after_step = 2});
  const fs::path step = dir / "run" / "checkpoints" / "step_00000002";
  nlohmann::json manifest = trainer::read_verified_manifest(step);
  const auto spec = trainer::model_spec(config);
  nlohmann::json legacy_model = spec->hf_config(nullptr);
  legacy_model.erase("rope_parameters");
  legacy_model["rope_theta"] = config.model.shape["rope_theta"];
  legacy_model["torch_dtype"] = "float32";
  manifest["model"] = legacy_model;
  const std::string text = manifest.dump(2) + "\n";
  std::ofstream(step / "manifest.json", std::ios::trunc) << text;
  char done[32];
  std::snprintf(done, sizeof done, "crc32c %08x\n", trainer::crc32c(0, text.data(), text.size()));
  std::ofstream(step / "DONE", std::ios::trunc) << done;

  const trainer::ManifestModel model = trainer::manifest_model_of(manifest, "manifest");
  EXPECT_EQ(model.family, "qwen3");
  EXPECT_EQ(models::weights_shape(models::family("qwen3"), config.model.shape), model.shape);
  const trainer::PretrainedWeights weights = trainer::load_pretrained((dir / "run").string());
  EXPECT_EQ(weights.spec->parameter_count(), spec->parameter_count());
  const trainer::TrainSummary resumed = trainer::train(config);
  EXPECT_EQ(resumed.resumed_from, 2);
  EXPECT_EQ(resumed.steps, 4);
  fs::remove_all(dir);
}

// Every shipped config loads (its data paths replaced by files that exist).
TEST(ModelInterface, ShippedConfigsLoad) {
  const fs::path dir = fresh_dir("configs");
  text::write_token_shard(dir / "shard.bin", std::vector<std::uint32_t>(100, 1), text::TokenDtype::u16);
  const fs::path configs = fs::path(LLMTRAIN_FIXTURES_DIR).parent_path().parent_path() / "configs";
  int loaded = 0;
  for (const auto& entry : fs::directory_iterator(configs)) {
    if (entry.path().extension() != ".yaml") continue;
    std::vector<std::string> overrides = {"data.train=" + (dir / "shard.bin").string(),
                                          "data.val=" + (dir / "shard.bin").string()};
    const std::string text = [&] {
      std::ifstream in(entry.path());
      return std::string(std::istreambuf_iterator<char>(in), {});
    }();
    // Task files, like the data, are named relative to the directory a run starts in.
    if (text.find("  tasks: [data/tasks/") != std::string::npos) {
      const fs::path tasks = configs.parent_path() / "data" / "tasks";
      overrides.push_back("eval.tasks=[" + (tasks / "kjv_next_verse.jsonl").string() + ", " +
                          (tasks / "kjv_verse_completion.jsonl").string() + "]");
    }
    if (text.find("tokenizer: runs/") != std::string::npos) {
      overrides.push_back("data.tokenizer=" + std::string(LLMTRAIN_FIXTURES_DIR) + "/tokenizer/small_bpe.json");
    }
    EXPECT_NO_THROW(trainer::load_run_config(entry.path().string(), overrides)) << entry.path();
    ++loaded;
  }
  EXPECT_GE(loaded, 7);
  fs::remove_all(dir);
}

}  // namespace
