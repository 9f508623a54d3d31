// Buffers, tensor views, device context and errors on the cpu backend.
#include <gtest/gtest.h>

#include "core/buffer.h"
#include "core/device.h"
#include "core/error.h"
#include "core/tensor.h"

namespace {

TEST(Buffer, HostAllocationMoveAndFill) {
  core::Buffer a(core::Device::cpu(), 1000);
  ASSERT_NE(a.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.data()) % 64, 0u);
  a.fill_bytes(0x7F);
  EXPECT_EQ(a.as<unsigned char>()[999], 0x7F);
  core::Buffer b(std::move(a));
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(a.bytes(), 0u);
  EXPECT_EQ(b.bytes(), 1000u);
  EXPECT_EQ(b.as<unsigned char>()[0], 0x7F);
}

TEST(Buffer, ZeroBytesHoldsNothing) {
  core::Buffer a(core::Device::cpu(), 0);
  EXPECT_EQ(a.data(), nullptr);
  a.fill_bytes(1);  // no-op
}

TEST(TensorView, ChecksElementTypeAndCounts) {
  core::Buffer buf(core::Device::cpu(), 6 * sizeof(float));
  core::TensorView v{buf.data(), core::DType::f32, {2, 3}, core::Device::cpu()};
  EXPECT_EQ(v.numel(), 6);
  EXPECT_EQ(v.bytes(), 24u);
  EXPECT_NO_THROW(v.as<float>());
  EXPECT_THROW(v.as<std::uint16_t>(), core::Error);
  EXPECT_EQ(core::shape_str(v.shape), "[2, 3]");
  EXPECT_EQ(core::shape_numel({}), 1);
  EXPECT_EQ(core::shape_numel({4, 0}), 0);
}

TEST(DeviceContext, CpuCreatesNoCudaHandles) {
  core::DeviceContext cpu(core::Device::cpu());
  EXPECT_EQ(cpu.stream(), nullptr);
  EXPECT_EQ(cpu.cublaslt(), nullptr);
  EXPECT_FALSE(cpu.is_cuda());
  cpu.synchronize();
}

TEST(DeviceContext, MissingGpuIsAClearError) {
  const int count = core::cuda_device_count();
  EXPECT_GE(count, 0);
  try {
    core::DeviceContext ctx(core::Device::cuda(count));  // one past the last device
    FAIL() << "expected an error";
  } catch (const core::Error& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA device(s) are available"), std::string::npos) << e.what();
  }
}

TEST(Error, NamesTheFailingCall) {
  try {
    CUDA_CHECK(cudaErrorInvalidValue);
    FAIL() << "expected an error";
  } catch (const core::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("cudaErrorInvalidValue"), std::string::npos) << what;
    EXPECT_NE(what.find("test_buffer.cpp"), std::string::npos) << what;
  }
}

}  // namespace
