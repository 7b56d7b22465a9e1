// What the memory streams at in the decode step's access patterns, with no arithmetic: the
// floor under the decode kernels' state bandwidth (issue 4 measures them against
// cudaMemcpy's device-to-device copy). A decode step reads each state and writes it back in
// place; the warp kernel moves it in 4 KB tasks of one warp (each lane 8 runs of 16 bytes,
// all loaded before any is stored). Timed here on 1 GiB buffers (far past L2), each form
// out of place (read a, write b) and in place (read and write a, values + 0.0f so that the
// store is kept):
//   memcpy        cudaMemcpyAsync device to device
//   stream        a grid-stride loop of 16-byte loads and stores, 8 blocks of 256 per SM
//   warp tasks    one-warp blocks of 4 KB each, the warp kernel's task shape and grid order
//                 for a float32 state at K = 128 (a bfloat16 state's tasks are 2 KB of
//                 8-byte runs; serving slots come shuffled, here in order), as many per SM
//                 as fit (32) and, with shared memory as ballast, the warp kernel's 24
// CUDA events around each call, median of 20 after 3 warm-ups; GB/s of bytes read + written
// and the ratio to memcpy's.
//
//   flashdelta_cuda_stream_floor
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

#include "bench_util.h"

namespace {

constexpr size_t kBytes = size_t{1} << 30;
constexpr int kRuns = 8;  // 16-byte runs per lane in a warp task: 32 x 8 x 16 B = 4 KB

__device__ __forceinline__ float4 plus_zero(float4 v) {
  return make_float4(v.x + 0.f, v.y + 0.f, v.z + 0.f, v.w + 0.f);
}

// Four 16-byte loads in flight per thread before its stores (one at a time left ~32 KB in
// flight per SM).
__global__ void stream_kernel(const float4* src, float4* dst, size_t n) {
  const size_t threads = size_t{gridDim.x} * blockDim.x;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += 4 * threads) {
    float4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (i + u * threads < n) v[u] = src[i + u * threads];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (i + u * threads < n) dst[i + u * threads] = plus_zero(v[u]);
  }
}

// One 4 KB task per one-warp block: the lane's 8 runs are 512 bytes apart (a column each,
// as the warp kernel's chunks of a V-first state), all loaded before any is stored.
__global__ void warp_task_kernel(const float4* src, float4* dst) {
  const size_t base = size_t{blockIdx.x} * 32 * kRuns + threadIdx.x;
  float4 v[kRuns];
#pragma unroll
  for (int r = 0; r < kRuns; ++r) v[r] = src[base + r * 32];
#pragma unroll
  for (int r = 0; r < kRuns; ++r) dst[base + r * 32] = plus_zero(v[r]);
}

// GB/s (read + write) of `step`, median of 20 timed calls after 3.
template <class F>
double rate_gbs(F step) {
  using flashdelta::bench::check;
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "event");
  check(cudaEventCreate(&e1), "event");
  std::vector<double> gbs;
  for (int i = 0; i < 23; ++i) {
    cudaEventRecord(e0);
    step();
    cudaEventRecord(e1);
    check(cudaEventSynchronize(e1), "run");
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i >= 3) gbs.push_back(2.0 * kBytes / (ms * 1e-3) / 1e9);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return flashdelta::bench::median(gbs);
}

}  // namespace

int main() {
  using flashdelta::bench::check;
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "device");
  float4 *a = nullptr, *b = nullptr;
  check(cudaMalloc(&a, kBytes), "cudaMalloc");
  check(cudaMalloc(&b, kBytes), "cudaMalloc");
  check(cudaMemset(a, 0, kBytes), "memset");
  check(cudaMemset(b, 0, kBytes), "memset");
  const size_t n = kBytes / sizeof(float4);
  const unsigned stream_blocks = 8u * static_cast<unsigned>(prop.multiProcessorCount);
  const unsigned tasks = static_cast<unsigned>(kBytes / (32 * kRuns * sizeof(float4)));

  // Ballast shared memory that leaves room for 24 one-warp blocks per SM (the system keeps
  // reservedSharedMemPerBlock per block; allocations come in 128-byte units), as the warp
  // kernel's registers do; the count reached is printed.
  check(cudaFuncSetAttribute(warp_task_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100),
        "carveout");
  const size_t ballast =
      (prop.sharedMemPerMultiprocessor / 24 - prop.reservedSharedMemPerBlock) / 128 * 128;
  int resident = 0, resident_ballast = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, warp_task_kernel, 32, 0), "occupancy");
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident_ballast, warp_task_kernel, 32, ballast),
        "occupancy");

  const double memcpy_gbs = rate_gbs([&] { cudaMemcpyAsync(b, a, kBytes, cudaMemcpyDeviceToDevice); });
  struct Line {
    const char* name;
    double gbs;
  };
  const Line lines[] = {
      {"memcpy", memcpy_gbs},
      {"stream, out of place", rate_gbs([&] { stream_kernel<<<stream_blocks, 256>>>(a, b, n); })},
      {"stream, in place", rate_gbs([&] { stream_kernel<<<stream_blocks, 256>>>(a, a, n); })},
      {"warp tasks, out of place", rate_gbs([&] { warp_task_kernel<<<tasks, 32>>>(a, b); })},
      {"warp tasks, in place", rate_gbs([&] { warp_task_kernel<<<tasks, 32>>>(a, a); })},
      {"warp tasks ballast, out", rate_gbs([&] { warp_task_kernel<<<tasks, 32, ballast>>>(a, b); })},
      {"warp tasks ballast, in", rate_gbs([&] { warp_task_kernel<<<tasks, 32, ballast>>>(a, a); })},
  };
  check(cudaGetLastError(), "launch");
  std::printf("device: %s; 1 GiB buffers, GB/s read + written, median of 20; warp tasks %d "
              "blocks per SM, with ballast %d\n",
              prop.name, resident, resident_ballast);
  for (const Line& l : lines)
    std::printf("  %-26s %8.0f GB/s  %6.1f%% of memcpy\n", l.name, l.gbs, 100.0 * l.gbs / memcpy_gbs);
  cudaFree(a);
  cudaFree(b);
  return 0;
}
