// The tf32 rounding under every tensor-core product of the backward and the chunk state
// kernel (cuda/mma.cuh): to_tf32 against a host rounding of the same values (ties to even
// from sm_90 on, ties away on sm_80), split_tf32's hi + lo against the value, and the mma's
// reading of both: a product with an identity matrix gives back exactly the rounded operand.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cuda/mma.cuh"
#include "device_mirror.h"

namespace flashdelta::detail::cuda {
namespace {

uint32_t bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
float from_bits(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// x rounded to tf32 (10 mantissa bits) on the host; inf and NaN as they are.
uint32_t host_tf32(float x, bool ties_to_even) {
  const uint32_t b = bits(x);
  if ((b & 0x7f800000u) == 0x7f800000u) return b;
  const uint32_t half = ties_to_even ? 0xfffu + (b >> 13 & 1u) : 0x1000u;
  return (b + half) & 0xffffe000u;
}

constexpr int kValues = 1024;  // a multiple of 16 x 8: every value once in an A tile

// Per value: to_tf32's result and split_tf32's hi and lo.
__global__ void round_kernel(const float* x, uint32_t* rounded, uint32_t* hi, uint32_t* lo,
                             int* arch) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  rounded[i] = to_tf32(x[i]);
  split_tf32(x[i], hi[i], lo[i]);
#ifdef __CUDA_ARCH__
  if (i == 0) arch[0] = __CUDA_ARCH__;
#endif
}

// One warp per 16 x 8 tile of 128 values (row-major): the mma's product of the tile with the
// 8 x 8 identity. Lane (g, c) holds A[g][c], A[g + 8][c], A[g][c + 4], A[g + 8][c + 4].
__global__ void identity_product_kernel(const float* x, float* product) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int64_t tile = (blockIdx.x * blockDim.x + threadIdx.x) / 32 * 128;
  const float* t = x + tile;
  const uint32_t a[4] = {to_tf32(t[g * 8 + c]), to_tf32(t[(g + 8) * 8 + c]),
                         to_tf32(t[g * 8 + c + 4]), to_tf32(t[(g + 8) * 8 + c + 4])};
  // B = identity: b0 = B[c][g], b1 = B[c + 4][g].
  const uint32_t one = 0x3f800000u;
  Acc acc;
  mma_tf32(acc, a, c == g ? one : 0u, c + 4 == g ? one : 0u);
#pragma unroll
  for (int r = 0; r < 4; ++r) product[tile + acc_row(r) * 8 + acc_col(r)] = acc.d[r];
}

TEST(CudaTf32, RoundsToNearestAndSplitsExactly) {
  FLASHDELTA_REQUIRE_GPU();
  std::vector<float> x(kValues);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (float& v : x) v = normal(rng) * std::exp2(static_cast<float>(rng() % 40) - 20.f);
  // Ties (a 1 in bit 12 alone below the kept bits): even and odd kept last bits, both signs.
  const float ties[] = {from_bits(0x3f801000u), from_bits(0x3f803000u), from_bits(0xbf801000u),
                        from_bits(0xbf803000u), from_bits(0x40001000u), from_bits(0x00001000u)};
  // The edges: zeros, a subnormal, the largest float (rounds to inf), inf, NaN.
  const float edges[] = {0.f, -0.f, from_bits(0x00000fffu), std::numeric_limits<float>::max(),
                         std::numeric_limits<float>::infinity(),
                         -std::numeric_limits<float>::infinity(),
                         std::numeric_limits<float>::quiet_NaN()};
  int at = 0;
  for (float v : ties) x[at++] = v;
  for (float v : edges) x[at++] = v;

  // Device memory freed with the mirror; a failing CUDA call throws (the test fails).
  using flashdelta::testing::check_cuda;
  flashdelta::testing::DeviceMirror d;
  const size_t bytes = kValues * sizeof(float);
  auto* dx = static_cast<float*>(d.allocate(bytes));
  auto* dproduct = static_cast<float*>(d.allocate(bytes));
  auto* drounded = static_cast<uint32_t*>(d.allocate(bytes));
  auto* dhi = static_cast<uint32_t*>(d.allocate(bytes));
  auto* dlo = static_cast<uint32_t*>(d.allocate(bytes));
  auto* darch = static_cast<int*>(d.allocate(sizeof(int)));
  check_cuda(cudaMemcpy(dx, x.data(), bytes, cudaMemcpyHostToDevice), "copy x");
  round_kernel<<<kValues / 128, 128>>>(dx, drounded, dhi, dlo, darch);
  check_cuda(cudaGetLastError(), "round_kernel");
  identity_product_kernel<<<1, kValues / 128 * 32>>>(dx, dproduct);
  check_cuda(cudaGetLastError(), "identity_product_kernel");
  std::vector<uint32_t> rounded(kValues), hi(kValues), lo(kValues);
  std::vector<float> product(kValues);
  int arch = 0;
  check_cuda(cudaMemcpy(rounded.data(), drounded, bytes, cudaMemcpyDeviceToHost), "copy back");
  check_cuda(cudaMemcpy(hi.data(), dhi, bytes, cudaMemcpyDeviceToHost), "copy back");
  check_cuda(cudaMemcpy(lo.data(), dlo, bytes, cudaMemcpyDeviceToHost), "copy back");
  check_cuda(cudaMemcpy(product.data(), dproduct, bytes, cudaMemcpyDeviceToHost), "copy back");
  check_cuda(cudaMemcpy(&arch, darch, sizeof(int), cudaMemcpyDeviceToHost), "copy back");

  const bool even = arch >= 900;
  auto row_finite = [&](int i) {
    const int first = i / 8 * 8;  // the tile row's 8 values are consecutive
    for (int j = first; j < first + 8; ++j)
      if (!std::isfinite(from_bits(host_tf32(x[j], even)))) return false;
    return true;
  };
  for (int i = 0; i < kValues; ++i) {
    SCOPED_TRACE(::testing::Message() << "value " << i << " = " << x[i] << " (bits 0x" << std::hex
                                    << bits(x[i]) << "), __CUDA_ARCH__ " << std::dec << arch);
    const uint32_t want = host_tf32(x[i], even);
    const uint32_t got = rounded[i] & 0xffffe000u;  // the bits the mma reads
    if (std::isnan(x[i])) {
      EXPECT_TRUE(std::isnan(from_bits(got)));
      EXPECT_TRUE(std::isnan(product[i]));
      continue;
    }
    EXPECT_EQ(got, want);
    EXPECT_EQ(hi[i] & 0xffffe000u, want);
    // The identity product returns the operand as the mma read it, where its tile row is
    // finite (inf times the identity's zeros is NaN) and it is not subnormal (which the
    // tensor cores may flush).
    if (row_finite(i) && std::isnormal(from_bits(want)))
      EXPECT_EQ(bits(product[i]), want);
    // hi + lo carries a normal x to about float32's precision (below 2^-126 tf32's steps are
    // 2^-136: a subnormal's low bits are out of its reach).
    if (std::isinf(from_bits(want)) || !std::isnormal(x[i])) continue;
    const double sum = static_cast<double>(from_bits(hi[i] & 0xffffe000u)) +
                       static_cast<double>(from_bits(lo[i] & 0xffffe000u));
    EXPECT_LE(std::fabs(sum - static_cast<double>(x[i])),
              std::ldexp(std::fabs(static_cast<double>(x[i])), -20));
  }
}

}  // namespace
}  // namespace flashdelta::detail::cuda
