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

namespace flashdelta::detail::cuda {
namespace {

bool has_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

void check(cudaError_t e, const char* what) {
  ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorString(e);
}

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

// Per value: to_tf32's result, split_tf32's hi and lo, and the mma's product of the value's
// 16 x 8 tile with the 8 x 8 identity (row g, column c of the tile in lane (g, c)'s slots).
__global__ void tf32_kernel(const float* x, uint32_t* rounded, uint32_t* hi, uint32_t* lo,
                            float* product, int* arch) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  rounded[i] = to_tf32(x[i]);
  split_tf32(x[i], hi[i], lo[i]);
#ifdef __CUDA_ARCH__
  if (i == 0) arch[0] = __CUDA_ARCH__;
#endif
  // One warp per 128 values: lane (g, c) holds A[g][c], A[g + 8][c], A[g][c + 4],
  // A[g + 8][c + 4] of the tile stored row-major at t.
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const float* t = x + (i / 32) * 128;
  const uint32_t a[4] = {to_tf32(t[g * 8 + c]), to_tf32(t[(g + 8) * 8 + c]),
                         to_tf32(t[g * 8 + c + 4]), to_tf32(t[(g + 8) * 8 + c + 4])};
  // B = identity: b0 = B[c][g], b1 = B[c + 4][g].
  const uint32_t one = 0x3f800000u;
  Acc acc;
  mma_tf32(acc, a, c == g ? one : 0u, c + 4 == g ? one : 0u);
  float* out = product + (i / 32) * 128;
#pragma unroll
  for (int r = 0; r < 4; ++r) out[acc_row(r) * 8 + acc_col(r)] = acc.d[r];
}

TEST(CudaTf32, RoundsToNearestAndSplitsExactly) {
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device on this machine";
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

  float *dx = nullptr, *dproduct = nullptr;
  uint32_t *drounded = nullptr, *dhi = nullptr, *dlo = nullptr;
  int* darch = nullptr;
  check(cudaMalloc(&dx, kValues * 4), "malloc");
  check(cudaMalloc(&dproduct, kValues * 4), "malloc");
  check(cudaMalloc(&drounded, kValues * 4), "malloc");
  check(cudaMalloc(&dhi, kValues * 4), "malloc");
  check(cudaMalloc(&dlo, kValues * 4), "malloc");
  check(cudaMalloc(&darch, 4), "malloc");
  check(cudaMemcpy(dx, x.data(), kValues * 4, cudaMemcpyHostToDevice), "copy");
  tf32_kernel<<<kValues / 128, 128>>>(dx, drounded, dhi, dlo, dproduct, darch);
  check(cudaGetLastError(), "launch");
  std::vector<uint32_t> rounded(kValues), hi(kValues), lo(kValues);
  std::vector<float> product(kValues);
  int arch = 0;
  check(cudaMemcpy(rounded.data(), drounded, kValues * 4, cudaMemcpyDeviceToHost), "copy");
  check(cudaMemcpy(hi.data(), dhi, kValues * 4, cudaMemcpyDeviceToHost), "copy");
  check(cudaMemcpy(lo.data(), dlo, kValues * 4, cudaMemcpyDeviceToHost), "copy");
  check(cudaMemcpy(product.data(), dproduct, kValues * 4, cudaMemcpyDeviceToHost), "copy");
  check(cudaMemcpy(&arch, darch, 4, cudaMemcpyDeviceToHost), "copy");
  for (void* p : {static_cast<void*>(dx), static_cast<void*>(dproduct),
                  static_cast<void*>(drounded), static_cast<void*>(dhi),
                  static_cast<void*>(dlo), static_cast<void*>(darch)})
    cudaFree(p);

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
    if (std::isinf(from_bits(want))) continue;
    // hi + lo carries x to about float32's precision.
    const double sum = static_cast<double>(from_bits(hi[i] & 0xffffe000u)) +
                       static_cast<double>(from_bits(lo[i] & 0xffffe000u));
    EXPECT_LE(std::fabs(sum - static_cast<double>(x[i])),
              std::ldexp(std::fabs(static_cast<double>(x[i])), -20) + 1e-44);
  }
}

}  // namespace
}  // namespace flashdelta::detail::cuda
