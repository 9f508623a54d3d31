// Hugging Face export: a folder that transformers saved, read by ours and written back, holds the
// same tensors (fp32: bit for bit; bf16: the rounded values) and config; a tied model writes no
// lm_head.weight. A checkpoint's master weights exported and read back reproduce the model.
// With LLMTRAIN_EXPORT_DIR set, the exported folders are kept there for
// tests/fixtures/check_hf_export.py, which loads them with transformers.
#include <cstdlib>
#include <filesystem>

#include <gtest/gtest.h>

#include "core/half.h"
#include "support/qwen3/hf_export.h"
#include "support/qwen3/hf_import.h"
#include "models/safetensors.h"
#include "support/test_support.h"

namespace {

namespace fs = std::filesystem;
namespace q3 = models::qwen3;

fs::path export_root() {
  if (const char* dir = std::getenv("LLMTRAIN_EXPORT_DIR")) return dir;
  return fs::temp_directory_path() / ("hf_export_" + std::to_string(test::fresh_seed()));
}

void round_trip(const std::string& name, q3::ExportDtype dtype) {
  const std::string source = std::string(LLMTRAIN_FIXTURES_DIR) + "/qwen3/" + name;
  const q3::Qwen3Config config = q3::read_hf_config(source);
  core::DeviceContext cpu(core::Device::cpu());
  optim::Slab slab(optim::SlabLayout(q3::parameter_specs(config), 1), cpu);
  q3::load_hf_weights(source, config, slab);
  const fs::path out = export_root() / (name + (dtype == q3::ExportDtype::fp32 ? "_fp32" : "_bf16"));
  q3::write_hf_folder(out.string(), config, slab.layout(), slab.master().as<float>(), dtype);

  EXPECT_EQ(q3::read_hf_config(out.string()), config);
  const models::SafetensorsFile original(source + "/model.safetensors");
  const models::SafetensorsFile exported((out / "model.safetensors").string());
  EXPECT_EQ(exported.contains("lm_head.weight"), !config.tie_word_embeddings);
  EXPECT_EQ(exported.entries().size(),
            original.entries().size() - (original.contains("lm_head.weight") && config.tie_word_embeddings));
  for (const auto& e : original.entries()) {
    if (e.name == "lm_head.weight" && config.tie_word_embeddings) continue;
    const auto a = original.read_f32(e.name);
    const auto b = exported.read_f32(e.name);
    ASSERT_EQ(exported.entry(e.name).shape, e.shape) << e.name;
    for (std::size_t i = 0; i < a.size(); ++i) {
      const float want = dtype == q3::ExportDtype::fp32 ? a[i] : core::bf16_to_float(core::float_to_bf16(a[i]));
      ASSERT_EQ(b[i], want) << e.name << "[" << i << "]";
    }
  }
  // Reading the export back gives the same slab (fp32).
  if (dtype == q3::ExportDtype::fp32) {
    optim::Slab again(optim::SlabLayout(q3::parameter_specs(config), 1), cpu);
    q3::load_hf_weights(out.string(), config, again);
    EXPECT_EQ(test::to_host<float>(again.master()), test::to_host<float>(slab.master()));
  }
  if (!std::getenv("LLMTRAIN_EXPORT_DIR")) fs::remove_all(out.parent_path());
}

TEST(HfExport, TiedFp32RoundTrip) { round_trip("tied", q3::ExportDtype::fp32); }
TEST(HfExport, UntiedFp32RoundTrip) { round_trip("untied", q3::ExportDtype::fp32); }
TEST(HfExport, TiedBf16) { round_trip("tied", q3::ExportDtype::bf16); }
TEST(HfExport, UntiedBf16) { round_trip("untied", q3::ExportDtype::bf16); }

}  // namespace
